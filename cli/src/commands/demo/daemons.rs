//! The demo's master and agent are the real daemon binaries, `gpuctl-master`
//! and `gpuctl-agent`, found next to `gpuctl` (or on PATH) and started as
//! child processes: `gpuctl` itself links neither (no sled, raft, Docker
//! client or NVML), and the demo runs exactly what a cluster runs.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use gpuctl_core::host::HostCheck;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::super::{one_line, CliError};

pub(super) const MASTER: &str = "gpuctl-master";
pub(super) const AGENT: &str = "gpuctl-agent";
/// How long `gpuctl-agent check` may take (Docker's answer, an image import).
const CHECK_TIMEOUT: Duration = Duration::from_secs(240);
/// Log lines shown when a daemon fails.
const TAIL_LINES: usize = 15;

/// A daemon binary: beside this executable (a cargo build puts all three
/// in one directory), else the first on PATH.
pub(super) fn binary(name: &str) -> Result<PathBuf, CliError> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join(name)));
    if let Some(p) = beside.as_ref().filter(|p| p.is_file()) {
        return Ok(p.clone());
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    });
    on_path.ok_or_else(|| {
        let dir = beside
            .as_deref()
            .and_then(Path::parent)
            .map_or_else(|| "?".to_string(), |d| d.display().to_string());
        CliError::Other(format!(
            "gpuctl demo runs {name}, which is neither next to gpuctl ({dir}) nor on PATH; \
             build it with `cargo build --release -p gpuctl -p gpuctl-master -p gpuctl-agent`"
        ))
    })
}

/// Under `cargo run -p gpuctl` (the README's quickstart), cargo builds only
/// `gpuctl`: the daemons it runs are built here, with the same cargo,
/// profile and target directory, so they land beside it, current with the
/// source. Elsewhere (an
/// installed `gpuctl`) nothing is built and [`binary`] says what is missing.
pub(super) fn build_if_run_by_cargo() -> Result<(), CliError> {
    let (Some(cargo), Some(manifest)) = (
        std::env::var_os("CARGO"),
        std::env::var_os("CARGO_MANIFEST_DIR"),
    ) else {
        return Ok(());
    };
    let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    else {
        return Ok(());
    };
    // Always asked, even when the binaries are there: they may be older
    // than the source (cargo answers at once when they are current).
    // target/<profile>/gpuctl: the profile is the directory's name.
    let (Some(profile), Some(target)) = (
        dir.file_name().and_then(|p| p.to_str()).map(str::to_string),
        dir.parent(),
    ) else {
        return Ok(());
    };
    let mut cmd = std::process::Command::new(cargo);
    cmd.current_dir(manifest)
        .args(["build", "-p", MASTER, "-p", AGENT, "--target-dir"])
        .arg(target);
    match profile.as_str() {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    super::say(format!(
        "Making sure {MASTER} and {AGENT} are built (cargo build -p {MASTER} -p {AGENT}, profile {profile})"
    ));
    let status = cmd
        .status()
        .map_err(|e| CliError::Other(format!("running cargo to build the daemons: {e}")))?;
    if !status.success() {
        return Err(CliError::Other(format!(
            "cargo could not build {MASTER} and {AGENT} ({status})"
        )));
    }
    Ok(())
}

/// The daemons get a clean environment of gpuctl settings: a user's
/// `GPUCTL_MASTER` or `GPUCTL_AGENT_CONFIG` must not reach the demo's cluster.
fn command(program: &Path) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(program);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("GPUCTL_") {
            cmd.env_remove(key);
        }
    }
    cmd.stdin(Stdio::null());
    cmd
}

/// Runs `gpuctl-agent check --json`: the agent's own GPU discovery and
/// Docker check (importing the demo image unless `no_docker`).
pub(super) async fn host_check(agent: &Path, no_docker: bool) -> Result<HostCheck, CliError> {
    let mut cmd = command(agent);
    cmd.args(["check", "--json"]);
    if no_docker {
        cmd.arg("--no-docker");
    } else {
        cmd.arg("--busybox-image");
    }
    cmd.kill_on_drop(true);
    let out = tokio::time::timeout(CHECK_TIMEOUT, cmd.output())
        .await
        .map_err(|_| {
            CliError::Other(format!(
                "`{AGENT} check` did not finish within {}s",
                CHECK_TIMEOUT.as_secs()
            ))
        })?
        .map_err(|e| CliError::Other(format!("running {}: {e}", agent.display())))?;
    if !out.status.success() {
        return Err(CliError::Other(format!(
            "`{AGENT} check` failed ({}): {}",
            out.status,
            one_line(&String::from_utf8_lossy(&out.stderr))
        )));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| {
        CliError::Other(format!(
            "`{AGENT} check --json` printed something else than its report ({e}); \
             is {} from another gpuctl version?",
            agent.display()
        ))
    })
}

/// A loopback port free at this moment, for a daemon to listen on. Another
/// process could take it before the daemon binds; the daemon then exits
/// saying so, and the demo reports that.
pub(super) fn free_port() -> Result<u16, CliError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| CliError::Other(format!("finding a free loopback port: {e}")))
}

/// One running daemon; its stdout and stderr go to `log`.
#[derive(Debug)]
pub(super) struct Daemon {
    pub(super) name: &'static str,
    child: tokio::process::Child,
    pub(super) log: PathBuf,
    /// How it ended, once it has.
    ended: Option<String>,
}

impl Daemon {
    pub(super) fn spawn(
        name: &'static str,
        program: &Path,
        args: &[OsString],
        dir: &Path,
    ) -> Result<Daemon, CliError> {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log)
            .map_err(|e| CliError::Other(format!("{}: {e}", log.display())))?;
        let file2 = file
            .try_clone()
            .map_err(|e| CliError::Other(format!("{}: {e}", log.display())))?;
        let mut cmd = command(program);
        cmd.args(args)
            .stdout(Stdio::from(file))
            .stderr(Stdio::from(file2))
            // Its own process group: a Ctrl-C at the terminal reaches the
            // demo only, which stops the agent before the master.
            .process_group(0)
            .kill_on_drop(true);
        die_with_parent(&mut cmd);
        let child = cmd
            .spawn()
            .map_err(|e| CliError::Other(format!("starting {}: {e}", program.display())))?;
        Ok(Daemon {
            name,
            child,
            log,
            ended: None,
        })
    }

    /// Resolves when the process has ended, with how and its last log lines.
    pub(super) async fn exited(&mut self) -> String {
        if let Some(how) = &self.ended {
            return how.clone();
        }
        let how = match self.child.wait().await {
            Ok(status) => format!("the {} exited ({status})", self.name),
            Err(e) => format!("the {} could not be waited for: {e}", self.name),
        };
        let how = format!("{how}{}", self.tail());
        self.ended = Some(how.clone());
        how
    }

    /// The last lines of its log, indented, or nothing.
    fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        if lines.is_empty() {
            return String::new();
        }
        let from = lines.len().saturating_sub(TAIL_LINES);
        let mut out = format!("; the end of its log ({}):", self.log.display());
        for l in &lines[from..] {
            out.push_str("\n    ");
            out.push_str(l);
        }
        out
    }

    /// SIGTERM, then SIGKILL after `grace`. A warning when it did not end
    /// cleanly.
    pub(super) async fn stop(mut self, grace: Duration) -> Option<String> {
        if self.ended.is_some() {
            return None;
        }
        if let Some(pid) = self.child.id().and_then(|p| i32::try_from(p).ok()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(Ok(status)) if status.success() => None,
            Ok(Ok(status)) => Some(format!(
                "the {} stopped with {status}{}",
                self.name,
                self.tail()
            )),
            Ok(Err(e)) => Some(format!("the {} could not be waited for: {e}", self.name)),
            Err(_) => {
                let _ = self.child.kill().await;
                Some(format!(
                    "the {} did not stop within {}s and was killed",
                    self.name,
                    grace.as_secs()
                ))
            }
        }
    }
}

/// The kernel sends the daemon SIGTERM if the demo dies without stopping
/// it (SIGKILL, a crash), so no orphaned master or agent stays behind.
#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut tokio::process::Command) {
    // SAFETY: the closure runs in the forked child before exec and makes
    // one prctl system call, which is async-signal-safe; it touches no
    // memory of the parent and takes no lock.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(Signal::SIGTERM).map_err(std::io::Error::from)
        });
    }
}
