//! `gpuctl completions SHELL` and `gpuctl man [DIR]`: generated from the
//! clap definition itself, so they never drift from the flags.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Args, CommandFactory};
use clap_complete::Shell;

use super::{Cli, CliError, EXIT_OK};

#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell to complete for. Load it with e.g.
    /// `source <(gpuctl completions bash)`, or write it where the shell
    /// looks for completions (/usr/share/bash-completion/completions/gpuctl,
    /// a directory of $fpath as _gpuctl, ~/.config/fish/completions/gpuctl.fish).
    #[arg(value_enum, value_name = "SHELL")]
    pub shell: Shell,
}

#[derive(Debug, Args)]
pub struct ManArgs {
    /// Directory to write the pages to (created when missing); prints the
    /// path of each page written. View one with `man -l DIR/gpuctl-jobs-submit.1`.
    #[arg(value_name = "DIR", default_value = ".")]
    pub dir: PathBuf,
}

pub fn run_completions(args: &CompletionsArgs, out: &mut dyn Write) -> Result<u8, CliError> {
    let mut cmd = Cli::command();
    // Into memory first: clap_complete panics when its writer fails, and
    // `gpuctl completions bash | head` must end quietly like other output.
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "gpuctl", &mut script);
    out.write_all(&script)?;
    out.flush()?;
    Ok(EXIT_OK)
}

pub fn run_man(args: &ManArgs, out: &mut dyn Write) -> Result<u8, CliError> {
    for path in write_man_pages(&args.dir)? {
        writeln!(out, "{}", path.display())?;
    }
    out.flush()?;
    Ok(EXIT_OK)
}

/// Writes `gpuctl.1` and one page per subcommand, named by its path
/// (`gpuctl-jobs-submit.1`, as git's pages are); returns their paths.
pub fn write_man_pages(dir: &Path) -> Result<Vec<PathBuf>, CliError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| CliError::Other(format!("cannot create {}: {e}", dir.display())))?;
    // Built first, so that subcommands have their display names
    // (gpuctl-jobs-submit) and global flags are listed on each page.
    let mut cmd = Cli::command().disable_help_subcommand(true);
    cmd.build();
    let mut written = Vec::new();
    write_pages(&cmd, dir, &mut written)?;
    Ok(written)
}

fn write_pages(
    cmd: &clap::Command,
    dir: &Path,
    written: &mut Vec<PathBuf>,
) -> Result<(), CliError> {
    let man = clap_mangen::Man::new(cmd.clone());
    let path = dir.join(man.get_filename());
    let mut page = Vec::new();
    man.render(&mut page)?;
    std::fs::write(&path, page)
        .map_err(|e| CliError::Other(format!("cannot write {}: {e}", path.display())))?;
    written.push(path);
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        write_pages(sub, dir, written)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn completion(shell: Shell) -> String {
        let mut out = Vec::new();
        run_completions(&CompletionsArgs { shell }, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn bash_completion_knows_the_commands_and_is_valid_bash() {
        let script = completion(Shell::Bash);
        for word in [
            "jobs",
            "submit",
            "agents",
            "completions",
            "--gpus",
            "--file",
        ] {
            assert!(script.contains(word), "no {word} in the bash script");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpuctl.bash");
        std::fs::write(&path, &script).unwrap();
        match Command::new("bash").arg("-n").arg(&path).output() {
            Ok(out) => assert!(
                out.status.success(),
                "bash -n: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => eprintln!("bash not found ({e}): syntax not checked"),
        }
    }

    #[test]
    fn zsh_and_fish_completions_name_the_commands() {
        let zsh = completion(Shell::Zsh);
        assert!(zsh.starts_with("#compdef gpuctl"), "{}", &zsh[..40]);
        assert!(zsh.contains("submit") && zsh.contains("--gpus"));
        let fish = completion(Shell::Fish);
        assert!(fish.contains("complete -c gpuctl") && fish.contains("submit"));
        assert!(fish.contains("-l gpus"), "fish names --gpus");
    }

    #[test]
    fn man_pages_one_per_command() {
        let dir = tempfile::tempdir().unwrap();
        let pages = write_man_pages(&dir.path().join("man1")).unwrap();
        let names: Vec<String> = pages
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        for want in [
            "gpuctl.1",
            "gpuctl-jobs.1",
            "gpuctl-jobs-submit.1",
            "gpuctl-jobs-get.1",
            "gpuctl-completions.1",
            "gpuctl-man.1",
        ] {
            assert!(names.iter().any(|n| n == want), "no {want} in {names:?}");
        }
        let submit = dir.path().join("man1/gpuctl-jobs-submit.1");
        let roff = std::fs::read_to_string(&submit).unwrap();
        // The structure of a man page: title, then NAME and SYNOPSIS.
        assert!(roff.contains(".TH gpuctl-jobs-submit 1"), "{roff}");
        assert!(roff.contains(".SH NAME") && roff.contains(".SH SYNOPSIS"));
        assert!(roff.contains("\\-\\-gpus"), "{roff}");
        // Rendered by groff when there is one: no warnings, and --gpus.
        match Command::new("groff")
            .args(["-man", "-Tutf8", "-ww", "-z"])
            .arg(&submit)
            .output()
        {
            Ok(out) => {
                assert!(out.status.success());
                let warnings = String::from_utf8_lossy(&out.stderr);
                assert!(warnings.trim().is_empty(), "groff: {warnings}");
                let text = Command::new("groff")
                    .args(["-man", "-Tascii", "-P-cbu"])
                    .arg(&submit)
                    .output()
                    .unwrap();
                let text = String::from_utf8_lossy(&text.stdout);
                assert!(text.contains("--gpus"), "{text}");
            }
            Err(e) => eprintln!("groff not found ({e}): only the structure checked"),
        }
    }
}
