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
            eprintln!("{}", usage_error_line(&e.render().to_string()));
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

/// clap's usage error as one line: its first paragraph (the error and,
/// for missing arguments, the list of them, which follows on its own
/// lines), without the usage and the hint after the blank line.
fn usage_error_line(text: &str) -> String {
    let line = text
        .lines()
        .skip_while(|l| l.trim().is_empty())
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ");
    if line.is_empty() {
        "error: usage".to_string()
    } else {
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A missing argument is named: the list clap puts on the lines after
    /// its first is kept (it printed "... not provided:" and nothing).
    #[test]
    fn a_usage_error_names_what_is_missing() {
        let Err(e) = Cli::try_parse_from(["gpuctl", "jobs", "submit", "--gpus", "1", "--", "true"])
        else {
            panic!("no --name, parsed");
        };
        let line = usage_error_line(&e.render().to_string());
        assert!(line.contains("--name"), "{line}");
        assert!(!line.contains("Usage:"), "{line}");
        let Err(e) = Cli::try_parse_from(["gpuctl", "jobs", "submit", "--bogus"]) else {
            panic!("a bad flag, parsed");
        };
        let line = usage_error_line(&e.render().to_string());
        assert!(
            line.starts_with("error: unexpected argument '--bogus'"),
            "{line}"
        );
        assert_eq!(usage_error_line("\n\n"), "error: usage");
    }
}
