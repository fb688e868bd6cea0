//! gpuctl-agent: parse options, then `gpuctl_proto::daemon::run` (log, bind,
//! serve until SIGTERM or Ctrl-C).
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
    gpuctl_proto::daemon::init_logging(&opts.log);
    gpuctl_proto::daemon::run(
        "gpuctl-agent",
        opts.to_config(),
        |c| c.listen,
        gpuctl_agent::serve,
    )
    .await
}
