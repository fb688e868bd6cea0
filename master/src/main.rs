//! gpuctl-master: parse options, set up logging, run until SIGTERM or Ctrl-C.

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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&opts.log)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let config = match opts.to_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpuctl-master: {e}");
            return ExitCode::from(2);
        }
    };
    let listener = match tokio::net::TcpListener::bind(config.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("gpuctl-master: listen on {}: {e}", config.listen);
            return ExitCode::from(1);
        }
    };
    return_freed_memory();
    match gpuctl_master::serve(config, listener, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpuctl-master: {e}");
            ExitCode::from(1)
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot watch SIGTERM");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupt: shutting down"),
    }
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
