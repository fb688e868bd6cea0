//! `gpuctl`: the command line for a gpuctl cluster. See docs/cli.md.

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

mod client;
mod commands;
mod error;
mod output;

use commands::Cli;
use error::{EXIT_FAILURE, EXIT_OK, EXIT_USAGE};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version go to stdout and succeed. Usage errors
            // exit 2 with one line (clap's own adds a blank line and a hint).
            if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                let _ = e.print();
                return ExitCode::from(EXIT_USAGE);
            }
            if !e.use_stderr() {
                let _ = e.print();
                return ExitCode::from(EXIT_OK);
            }
            let text = e.render().to_string();
            let line = text
                .lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("error: usage");
            eprintln!("{line}");
            return ExitCode::from(EXIT_USAGE);
        }
    };

    // Only warnings by default; RUST_LOG overrides (and sets the demo's
    // daemons' level).
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let result = runtime.block_on(commands::run(cli));
    // Do not wait for background tasks (a log stream still open).
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) if e.is_broken_pipe() => ExitCode::from(EXIT_OK),
        Err(e) => {
            eprintln!("error: {}", error::one_line(&e.to_string()));
            ExitCode::from(e.exit_code())
        }
    }
}
