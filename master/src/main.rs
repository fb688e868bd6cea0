//! gpuctl-master: parse options, then `gpuctl_proto::daemon::run` (log,
//! bind, serve until SIGTERM or Ctrl-C).

use std::process::ExitCode;

use gpuctl_master::config::Options;

#[tokio::main]
async fn main() -> ExitCode {
    let opts = match Options::load() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("gpuctl-master: {e}");
            return ExitCode::from(2);
        }
    };
    gpuctl_proto::daemon::init_logging(&opts.log);
    return_freed_memory();
    gpuctl_proto::daemon::run(
        "gpuctl-master",
        opts.to_config(),
        |c| c.listen,
        gpuctl_master::serve,
    )
    .await
}

/// Every 30 s, gives the memory that glibc's malloc keeps after bursts (a
/// registration storm, a snapshot's encoding: tens of MiB at 10,000 agents)
/// back to the system. Without it the resident size stays at its peak: at
/// 10,000 idle agents 1.8 KB per agent of the leader's 9.8 KB was freed
/// memory malloc had kept (`docs/benchmarks.md`). The walk over malloc's free
/// lists took 0.1 to 8 ms there.
#[allow(unsafe_code)]
fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const EVERY: std::time::Duration = std::time::Duration::from_secs(30);
        let spawned = std::thread::Builder::new()
            .name("malloc-trim".into())
            .spawn(|| loop {
                std::thread::sleep(EVERY);
                let started = std::time::Instant::now();
                // SAFETY: malloc_trim only walks and releases free memory of
                // glibc's own arenas; it takes no pointers.
                let released = unsafe { libc::malloc_trim(0) };
                tracing::debug!(
                    released = released != 0,
                    micros = started.elapsed().as_micros() as u64,
                    "malloc_trim"
                );
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no malloc_trim thread: freed memory stays with the process");
        }
    }
}
