//! What `gpuctl-master` and `gpuctl-agent` do around their service, in one
//! place: log to stderr at the configured filter, bind the listen address,
//! serve until SIGTERM or Ctrl-C, and exit with the documented codes (2: bad
//! options or configuration, 1: could not listen or serve).

use std::fmt::Display;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::ExitCode;

/// Resolves on the daemon's stop signal: the future `serve` stops on.
pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Logs to stderr with `filter` (tracing's syntax), `info` if it does not
/// parse.
pub fn init_logging(filter: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(filter)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// Binds `listen(&config)` and runs `serve` on it until SIGTERM or Ctrl-C.
/// `config` is the daemon's checked configuration or why it is not valid.
pub async fn run<C, E, S, Fut, SE>(
    name: &str,
    config: Result<C, E>,
    listen: impl FnOnce(&C) -> SocketAddr,
    serve: S,
) -> ExitCode
where
    E: Display,
    S: FnOnce(C, tokio::net::TcpListener, Shutdown) -> Fut,
    Fut: Future<Output = Result<(), SE>>,
    SE: Display,
{
    let config = match config {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{name}: {e}");
            return ExitCode::from(2);
        }
    };
    let addr = listen(&config);
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("{name}: listen on {addr}: {e}");
            return ExitCode::from(1);
        }
    };
    match serve(config, listener, Box::pin(shutdown_signal())).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e}");
            ExitCode::from(1)
        }
    }
}

/// SIGTERM (systemd's stop) or Ctrl-C.
pub async fn shutdown_signal() {
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
