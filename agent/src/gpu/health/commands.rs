//! Commands run on a GPU: its reset and the preflight check, bounded in time and output.

use super::*;

/// The GPUs a live task of this agent holds (a reset waits for them).
pub type Busy = Box<dyn Fn() -> BTreeSet<String> + Send>;

/// Longest a reset command may run.
pub(super) const RESET_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs the reset command for one GPU; `Err` says why it failed.
pub(super) fn run_reset(command: &[String], uuid: &str, index: u32) -> Result<(), String> {
    run_gpu_command(command, uuid, index, RESET_TIMEOUT)
}

/// Runs an operator's command for one device (`{uuid}` and `{index}`
/// replaced), at most `timeout`; `Err` says how it failed, with the end of
/// what it printed (stdout and stderr together, as a terminal shows them).
pub(super) fn run_gpu_command(
    command: &[String],
    uuid: &str,
    index: u32,
    timeout: Duration,
) -> Result<(), String> {
    use std::io::Read;
    let args: Vec<String> = command
        .iter()
        .map(|a| {
            a.replace("{uuid}", uuid)
                .replace("{index}", &index.to_string())
        })
        .collect();
    let Some((program, rest)) = args.split_first() else {
        return Err("no command".into());
    };
    // Close-on-exec: no other child spawned meanwhile keeps it open.
    let (reader, writer) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    let writer2 = writer.try_clone().map_err(|e| format!("pipe: {e}"))?;
    let reader = std::fs::File::from(reader);
    // The builder, and with it this side's write ends, is dropped once
    // spawned: the reader ends when the command (and what it left) does.
    let mut child = std::process::Command::new(program)
        .args(rest)
        .stdin(std::process::Stdio::null())
        .stdout(writer)
        .stderr(writer2)
        .spawn()
        .map_err(|e| format!("{program}: {e}"))?;
    // Read on a thread of its own so that a chatty command never blocks
    // on a full pipe; only the last bytes are kept.
    let printed = Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
    let sink = printed.clone();
    std::thread::spawn(move || {
        let mut reader = reader;
        let mut buf = [0u8; 4096];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 {
                break;
            }
            let mut out = sink.lock().unwrap_or_else(|p| p.into_inner());
            out.extend_from_slice(&buf[..n]);
            let excess = out.len().saturating_sub(OUTPUT_KEPT);
            out.drain(..excess);
        }
    });
    let tail = |printed: &std::sync::Mutex<Vec<u8>>| {
        let out = printed.lock().unwrap_or_else(|p| p.into_inner());
        String::from_utf8_lossy(&out).trim().to_string()
    };
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => {
                // What it printed last arrives just after its exit.
                std::thread::sleep(Duration::from_millis(50));
                return Err(format!(
                    "{} exited with {status}: {}",
                    args.join(" "),
                    tail(&printed)
                ));
            }
            Ok(None) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{} took over {timeout:?}: {}",
                    args.join(" "),
                    tail(&printed)
                ));
            }
            Err(e) => return Err(format!("{program}: {e}")),
        }
    }
}

/// What is kept of a command's output for a GPU's reason.
pub(super) const OUTPUT_KEPT: usize = 400;

/// A task's preflight of `devices` (see [`PreflightRequest`]): each one's
/// GPU must be in service, pass an NVML probe, have no memory pages
/// waiting for retirement (where NVML tells), and pass the operator's
/// command. The first that fails is withdrawn ([`Tracker::withdraw`]) and
/// named in the answer.
pub(super) fn preflight(
    nvml: &Nvml,
    tracker: &mut Tracker,
    command: &[String],
    timeout: Duration,
    devices: &[String],
) -> Result<(), PreflightFailed> {
    for device in devices {
        let Some(gpu) = tracker.gpu_of(device) else {
            return Err(PreflightFailed {
                gpu: None,
                why: format!("preflight: {device} is not a GPU of this agent"),
            });
        };
        let (uuid, index) = (gpu.uuid.clone(), gpu.index);
        if !gpu.healthy {
            return Err(PreflightFailed {
                why: format!(
                    "preflight: GPU {index} ({uuid}) is out of service: {}",
                    gpu.reason
                ),
                gpu: Some(uuid),
            });
        }
        let failed = match probe_device(nvml, &uuid, None).0 {
            Probe::Failed(why) => Some(why),
            Probe::Passed(_) => None,
        }
        .or_else(|| {
            let dev = nvml.device_by_uuid(uuid.as_str()).ok()?;
            // Newer GPUs remap rows instead and answer NOT_SUPPORTED.
            dev.are_pages_pending_retired()
                .ok()
                .filter(|pending| *pending)
                .map(|_| {
                    "memory pages are waiting for retirement (a reset retires them)".to_string()
                })
        })
        .or_else(|| {
            if command.is_empty() {
                return None;
            }
            run_gpu_command(command, device, index, timeout).err()
        });
        if let Some(why) = failed {
            let reason = format!("preflight failed: {why}");
            tracker.withdraw(&uuid, reason.clone());
            return Err(PreflightFailed {
                why: format!("{reason} (GPU {index}, {uuid}: withdrawn)"),
                gpu: Some(uuid),
            });
        }
    }
    Ok(())
}
