//! A daemon's options from one declaration: its clap struct gives the
//! flags, their environment variables, defaults and docs, and the keys of
//! its TOML config file (a key is the option's id: the flag's name with
//! `_` for `-`). The file is laid under the command line by one generic
//! step: a key whose option was not given by flag or environment is parsed
//! by that flag's own parser, as if given as the flag. A new option is a
//! field of the struct, nothing more.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Command, FromArgMatches};

/// Parses `args` (argv, program name first) and the environment, then
/// fills what they left unset from the TOML file named by the `config_id`
/// option, if given. Clap's own errors (`--help`, a bad flag) exit as clap
/// does; a bad file is `Err` naming the file and the key.
pub fn parse_with_file<P, I, T>(args: I, config_id: &str) -> Result<P, String>
where
    P: clap::CommandFactory + FromArgMatches,
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    // A flag given twice takes its last value: the file's come first.
    let cmd = P::command().args_override_self(true);
    let matches = cmd.clone().get_matches_from(&args);
    let from = |m: &ArgMatches| P::from_arg_matches(m).map_err(|e| first_line(&e.to_string()));
    let Some(path) = matches.get_one::<PathBuf>(config_id).cloned() else {
        return from(&matches);
    };
    let file_args = file_args(&cmd, &matches, &path, config_id)?;
    if file_args.is_empty() {
        return from(&matches);
    }
    let mut all = Vec::with_capacity(args.len() + file_args.len());
    all.extend(args.first().cloned());
    all.extend(file_args);
    all.extend(args.iter().skip(1).cloned());
    let matches = cmd
        .try_get_matches_from(all)
        .map_err(|e| format!("{}: {}", path.display(), first_line(&e.to_string())))?;
    from(&matches)
}

/// The file's keys that flags and environment left unset, as flags, each
/// value checked by its flag's parser first so that an error names the key.
fn file_args(
    cmd: &Command,
    matches: &ArgMatches,
    path: &Path,
    config_id: &str,
) -> Result<Vec<OsString>, String> {
    let at = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("{at}: {e}"))?;
    let table: toml::Table = toml::from_str(&text).map_err(|e| format!("{at}: {e}"))?;
    let mut out = Vec::new();
    for (key, value) in table {
        // The option's id (the field's name), or its flag's name with '_'.
        let arg = cmd
            .get_arguments()
            .filter(|a| a.get_id() != config_id)
            .find(|a| {
                a.get_long()
                    .is_some_and(|long| a.get_id() == key.as_str() || long.replace('-', "_") == key)
            })
            .ok_or_else(|| format!("{at}: unknown key {key:?}"))?;
        if matches!(
            matches.value_source(arg.get_id().as_str()),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        let flag = format!("--{}", arg.get_long().unwrap_or(key.as_str()));
        let bad = |why: String| format!("{at}: {key}: {why}");
        let values = match (arg.get_action(), value) {
            (ArgAction::SetTrue, toml::Value::Boolean(b)) => {
                if b {
                    out.push(OsString::from(&flag));
                }
                continue;
            }
            (ArgAction::SetTrue, other) => {
                return Err(bad(format!("{other} is not true or false")));
            }
            (ArgAction::Append, toml::Value::Array(items)) => items,
            (_, toml::Value::Array(_)) => return Err(bad("takes one value, not a list".into())),
            (_, one) => vec![one],
        };
        for v in values {
            let text = match v {
                toml::Value::String(s) => s,
                toml::Value::Integer(n) => n.to_string(),
                toml::Value::Float(f) => f.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                other => return Err(bad(format!("{other} is not a string, number or boolean"))),
            };
            let given = OsString::from(format!("{flag}={text}"));
            // The flag alone, through its own parser.
            Command::new("option")
                .no_binary_name(true)
                .arg(arg.clone().required(false))
                .try_get_matches_from([&given])
                .map_err(|e| bad(first_line(&e.to_string())))?;
            out.push(given);
        }
    }
    Ok(out)
}

/// Clap's message without its `error: ` and the usage lines after it.
fn first_line(e: &str) -> String {
    let line = e.lines().next().unwrap_or(e);
    line.strip_prefix("error: ").unwrap_or(line).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Opts {
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long, env = "GPUCTL_OPTIONS_TEST_PORT", default_value_t = 80, value_parser = clap::value_parser!(u16).range(1..))]
        port: u16,
        #[arg(long)]
        verbose: bool,
        #[arg(long = "tag")]
        tags: Vec<String>,
        #[arg(long)]
        name: Option<String>,
        #[arg(long, default_value_t = 1.5)]
        ratio: f64,
    }

    fn with_file(text: &str, args: &[&str]) -> Result<Opts, String> {
        let dir = std::env::temp_dir().join(format!("gpuctl-options-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join(format!("{:x}.toml", text.len() * 31 + args.len()));
        std::fs::write(&f, text).unwrap();
        let mut argv = vec!["d".to_string(), "--config".into(), f.display().to_string()];
        argv.extend(args.iter().map(|s| s.to_string()));
        let r = parse_with_file::<Opts, _, _>(argv, "config");
        std::fs::remove_file(&f).unwrap();
        r
    }

    #[test]
    fn the_file_fills_what_flags_leave_and_flags_win() {
        let file = "port = 8080\nverbose = true\ntags = [\"a\", \"b\"]\nname = \"n\"\nratio = 2\n";
        let o = with_file(file, &[]).unwrap();
        assert_eq!((o.port, o.verbose, o.ratio), (8080, true, 2.0));
        assert_eq!(
            (o.tags, o.name.as_deref()),
            (vec!["a".into(), "b".into()], Some("n"))
        );
        let o = with_file(file, &["--port", "9", "--tag", "c", "--ratio", "3"]).unwrap();
        assert_eq!((o.port, o.tags, o.ratio), (9, vec!["c".to_string()], 3.0));
        // Unset everywhere: the flag's default.
        let o = with_file("name = \"n\"\n", &[]).unwrap();
        assert_eq!((o.port, o.verbose, o.ratio), (80, false, 1.5));
    }

    #[test]
    fn a_bad_file_names_the_file_and_the_key() {
        for (text, needle) in [
            ("prot = 1\n", "unknown key \"prot\""),
            ("port = 0\n", "port: invalid value '0'"),
            ("port = \"x\"\n", "port: invalid value 'x'"),
            ("verbose = 1\n", "verbose: 1 is not true or false"),
            ("name = [\"a\"]\n", "name: takes one value"),
            ("config = \"x\"\n", "unknown key \"config\""),
            ("port = \n", "TOML parse error"),
        ] {
            let e = with_file(text, &[]).unwrap_err();
            assert!(e.contains(".toml: ") && e.contains(needle), "{text:?}: {e}");
        }
    }
}
