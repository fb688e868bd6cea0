//! gpuctl-agent: parse options, set up logging, run until SIGTERM or Ctrl-C.
//! `gpuctl-agent supervise DIR` is a task's supervisor (started by the agent);
//! `gpuctl-agent check` reports what this host offers (`check.rs`).

use std::process::ExitCode;

use gpuctl_agent::config::Options;

fn main() -> ExitCode {
    // `gpuctl-runc` (a link to this binary) and its hook: runc's wrapper.
    if let Some(code) = gpuctl_agent::runtime::oci_hook::main_if_requested() {
        return code;
    }
    // `gpuctl-agent check`: what this host offers, without starting.
    if let Some(code) = gpuctl_agent::check::main_if_requested() {
        return code;
    }
    // Before any thread exists: the supervisor blocks signals for itself.
    if let Some(code) = gpuctl_agent::runtime::supervisor::main_if_requested() {
        return code;
    }
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(agent_main()),
        Err(e) => {
            eprintln!("gpuctl-agent: start the async runtime: {e}");
            ExitCode::from(1)
        }
    }
}

async fn agent_main() -> ExitCode {
    let opts = match Options::load() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("gpuctl-agent: {e}");
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
            eprintln!("gpuctl-agent: {e}");
            return ExitCode::from(2);
        }
    };
    let listener = match tokio::net::TcpListener::bind(config.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("gpuctl-agent: listen on {}: {e}", config.listen);
            return ExitCode::from(1);
        }
    };
    match gpuctl_agent::serve(config, listener, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpuctl-agent: {e}");
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
