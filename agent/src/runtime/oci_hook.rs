//! The driver's GPU memory cap for containers: `gpuctl-runc`, an OCI
//! runtime that is runc plus one hook, and that hook.
//!
//! NVIDIA's per-cgroup cap (`gpu::memcap`) must be on the container's own
//! cgroup before its workload runs, and runc makes that cgroup only when it
//! creates the container. So, as nvidia-container-runtime does for its
//! hook, Docker is given a runtime (`dockerd --add-runtime
//! gpuctl=/usr/lib/gpuctl/gpuctl-runc`, a link to `gpuctl-agent`) that
//! edits the bundle and then runs runc:
//!
//! - `create` / `run` of a container whose environment holds
//!   [`CAP_ENV`] (`SOCKET|TASK`, set by the agent): the variable is taken
//!   out of the environment and a `createRuntime` hook `gpuctl-agent
//!   cap-hook SOCKET TASK` is added. Anything else is runc's alone.
//! - The hook runs once runc has put the container's init in its cgroup and
//!   before the workload starts. It hands the agent (over its root-only
//!   socket, `gpu::cap_socket`) the container id and init pid; the agent
//!   caps that cgroup and reads the cap back, or says why it could not (the
//!   container then runs with what else holds, and its task says which).
//!   A hook the agent cannot answer, or does not expect, fails, and runc
//!   fails the create.

use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use serde_json::Value;

/// The container variable that asks for the hook: `SOCKET|TASK`.
pub const CAP_ENV: &str = "GPUCTL_DRIVER_CAP";
/// The name the runtime is called by (a link to `gpuctl-agent`).
pub const RUNTIME_NAME: &str = "gpuctl-runc";
/// `gpuctl-agent oci-runtime ARGS…` is the same as `gpuctl-runc ARGS…`.
pub const RUNTIME_SUBCOMMAND: &str = "oci-runtime";
pub const HOOK_SUBCOMMAND: &str = "cap-hook";
/// How long the hook waits for the agent (NVML calls included); runc's own
/// hook timeout is set a little above.
const HOOK_WAIT: Duration = Duration::from_secs(30);
const HOOK_TIMEOUT_S: u64 = 40;
/// Bounds on what is read: a state or an answer is a line of JSON.
const MAX_LINE: u64 = 64 * 1024;

/// runc's global options that take a value (`--root DIR`).
const GLOBAL_WITH_VALUE: &[&str] = &["--log", "--log-format", "--root", "--criu", "--rootless"];

// What the hook asks the agent and its answer are the socket's protocol,
// kept with the socket (gpu/cap_socket.rs).
pub use crate::gpu::cap_socket::{CapAnswer, CapRequest};

/// Runs as `gpuctl-runc ARGS…` (by name), `gpuctl-agent oci-runtime
/// ARGS…` or `gpuctl-agent cap-hook SOCKET TASK`; `None` for any other
/// invocation.
pub fn main_if_requested() -> Option<ExitCode> {
    let mut args = std::env::args_os();
    let argv0 = args.next()?;
    let rest: Vec<OsString> = args.collect();
    let by_name = Path::new(&argv0)
        .file_name()
        .is_some_and(|n| n == RUNTIME_NAME);
    if by_name {
        return Some(runtime_main(&rest));
    }
    match rest.first().and_then(|a| a.to_str()) {
        Some(RUNTIME_SUBCOMMAND) => Some(runtime_main(&rest[1..])),
        Some(HOOK_SUBCOMMAND) => Some(hook_main(&rest[1..])),
        _ => None,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {reason}", .path.display())]
    Config { path: PathBuf, reason: String },
    #[error("no runc found in PATH or /usr/sbin, /usr/bin, /usr/local/bin, /usr/local/sbin")]
    NoRunc,
    #[error("exec {}: {source}", .path.display())]
    Exec {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("usage: gpuctl-agent {HOOK_SUBCOMMAND} SOCKET TASK (OCI state on stdin)")]
    Usage,
    #[error("container state on stdin: {0}")]
    State(String),
    #[error("agent at {}: {reason}", .socket.display())]
    Agent { socket: PathBuf, reason: String },
    #[error("the agent did not cap the container: {0}")]
    Refused(String),
}

fn runtime_main(args: &[OsString]) -> ExitCode {
    match prepare(args).and_then(|()| exec_runc(args)) {
        Ok(never) => match never {},
        Err(e) => {
            eprintln!("{RUNTIME_NAME}: {e}");
            ExitCode::from(1)
        }
    }
}

/// Adds the hook to the bundle of a `create` or `run` that asks for it.
fn prepare(args: &[OsString]) -> Result<(), HookError> {
    let Some(bundle) = created_bundle(args) else {
        return Ok(());
    };
    let path = bundle.join("config.json");
    let io = |source| HookError::Io {
        path: path.clone(),
        source,
    };
    let text = std::fs::read(&path).map_err(io)?;
    let mut config: Value = serde_json::from_slice(&text).map_err(|e| HookError::Config {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    let exe = std::env::current_exe().map_err(|source| HookError::Io {
        path: PathBuf::from("/proc/self/exe"),
        source,
    })?;
    let changed = add_hook(&mut config, &exe).map_err(|reason| HookError::Config {
        path: path.clone(),
        reason,
    })?;
    if changed {
        let tmp = bundle.join(".config.json.gpuctl");
        let out = serde_json::to_vec(&config).map_err(|e| HookError::Config {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        std::fs::write(&tmp, out).map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)?;
    }
    Ok(())
}

/// The bundle directory of a `create` or `run` (runc's default: the
/// working directory); `None` for every other command.
pub fn created_bundle(args: &[OsString]) -> Option<PathBuf> {
    let mut it = args.iter().map(|a| a.as_os_str());
    // Global options, then the command.
    let command = loop {
        let a = it.next()?;
        let s = a.to_str()?;
        if GLOBAL_WITH_VALUE.contains(&s) {
            it.next()?;
        } else if !s.starts_with('-') {
            break s;
        }
    };
    if command != "create" && command != "run" {
        return None;
    }
    let mut bundle: Option<&OsStr> = None;
    while let Some(a) = it.next() {
        match a.to_str() {
            Some("--bundle" | "-b") => bundle = it.next(),
            Some(s) if s.starts_with("--bundle=") => {
                bundle = Some(OsStr::new(&s["--bundle=".len()..]))
            }
            _ => {}
        }
    }
    Some(bundle.map_or_else(|| PathBuf::from("."), PathBuf::from))
}

/// Takes [`CAP_ENV`] out of the process environment and adds the
/// `createRuntime` hook it asks for; false when it is not there.
pub fn add_hook(config: &mut Value, exe: &Path) -> Result<bool, String> {
    let Some(env) = config
        .pointer_mut("/process/env")
        .and_then(|e| e.as_array_mut())
    else {
        return Ok(false);
    };
    let prefix = format!("{CAP_ENV}=");
    let mut asked = None;
    env.retain(|e| match e.as_str().and_then(|s| s.strip_prefix(&prefix)) {
        Some(v) => {
            asked = Some(v.to_string());
            false
        }
        None => true,
    });
    let Some(asked) = asked else {
        return Ok(false);
    };
    let (socket, task) = asked
        .split_once('|')
        .filter(|(s, t)| s.starts_with('/') && !t.is_empty())
        .ok_or_else(|| format!("{CAP_ENV}={asked}: not SOCKET|TASK"))?;
    let hook = serde_json::json!({
        "path": exe.to_string_lossy(),
        "args": ["gpuctl-agent", HOOK_SUBCOMMAND, socket, task],
        "timeout": HOOK_TIMEOUT_S,
    });
    let root = config
        .as_object_mut()
        .ok_or_else(|| "not a JSON object".to_string())?;
    let hooks = root
        .entry("hooks")
        .or_insert_with(|| Value::Object(Default::default()))
        .as_object_mut()
        .ok_or_else(|| "hooks: not an object".to_string())?;
    hooks
        .entry("createRuntime")
        .or_insert_with(|| Value::Array(Vec::new()))
        .as_array_mut()
        .ok_or_else(|| "hooks.createRuntime: not a list".to_string())?
        .push(hook);
    Ok(true)
}

/// runc, not this program under another name.
fn find_runc() -> Result<PathBuf, HookError> {
    let me = std::env::current_exe().and_then(std::fs::canonicalize).ok();
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(
            ["/usr/sbin", "/usr/bin", "/usr/local/bin", "/usr/local/sbin"]
                .iter()
                .map(PathBuf::from),
        )
        .map(|d| d.join("runc"))
        .find(|p| p.is_file() && std::fs::canonicalize(p).ok().as_ref() != me.as_ref())
        .ok_or(HookError::NoRunc)
}

fn exec_runc(args: &[OsString]) -> Result<std::convert::Infallible, HookError> {
    let runc = find_runc()?;
    let source = std::process::Command::new(&runc).args(args).exec();
    Err(HookError::Exec { path: runc, source })
}

fn hook_main(args: &[OsString]) -> ExitCode {
    match hook(args) {
        Ok(a) if a.uncapped.is_empty() => {
            eprintln!("{HOOK_SUBCOMMAND}: capped {}", a.cgroup);
            ExitCode::SUCCESS
        }
        Ok(a) => {
            eprintln!("{HOOK_SUBCOMMAND}: not capped: {}", a.uncapped);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gpuctl {HOOK_SUBCOMMAND}: {e}");
            ExitCode::from(1)
        }
    }
}

fn hook(args: &[OsString]) -> Result<CapAnswer, HookError> {
    let [socket, task] = args else {
        return Err(HookError::Usage);
    };
    let task = task.to_str().ok_or(HookError::Usage)?;
    let mut state = String::new();
    std::io::stdin()
        .take(MAX_LINE)
        .read_to_string(&mut state)
        .map_err(|e| HookError::State(e.to_string()))?;
    let state: Value = serde_json::from_str(&state).map_err(|e| HookError::State(e.to_string()))?;
    let pid = state["pid"]
        .as_u64()
        .and_then(|p| u32::try_from(p).ok())
        .filter(|p| *p > 0)
        .ok_or_else(|| HookError::State("no pid".into()))?;
    let container = state["id"]
        .as_str()
        .filter(|s| !s.is_empty())
        .ok_or_else(|| HookError::State("no id".into()))?;
    let req = CapRequest {
        task: task.to_string(),
        container: container.to_string(),
        pid,
    };
    let answer = ask(Path::new(socket), &req)?;
    if answer.error.is_empty() {
        Ok(answer)
    } else {
        Err(HookError::Refused(answer.error))
    }
}

/// One request, one answer, over the agent's socket.
pub fn ask(socket: &Path, req: &CapRequest) -> Result<CapAnswer, HookError> {
    let err = |reason: String| HookError::Agent {
        socket: socket.to_path_buf(),
        reason,
    };
    let mut stream = UnixStream::connect(socket).map_err(|e| err(e.to_string()))?;
    stream
        .set_read_timeout(Some(HOOK_WAIT))
        .and_then(|()| stream.set_write_timeout(Some(HOOK_WAIT)))
        .map_err(|e| err(e.to_string()))?;
    let mut line = serde_json::to_vec(req).map_err(|e| err(e.to_string()))?;
    line.push(b'\n');
    stream.write_all(&line).map_err(|e| err(e.to_string()))?;
    let mut answer = String::new();
    BufReader::new(stream.take(MAX_LINE))
        .read_line(&mut answer)
        .map_err(|e| err(e.to_string()))?;
    serde_json::from_str(&answer).map_err(|e| err(format!("answer {answer:?}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<OsString> {
        a.iter().map(OsString::from).collect()
    }

    #[test]
    fn the_bundle_of_a_create_or_run_is_found_past_runcs_own_options() {
        let cases: &[(&[&str], Option<&str>)] = &[
            // As containerd's shim calls it.
            (
                &[
                    "--root",
                    "/run/docker/runtime-runc/moby",
                    "--log",
                    "/x/log.json",
                    "--log-format",
                    "json",
                    "create",
                    "--bundle",
                    "/b1",
                    "--pid-file",
                    "/b1/init.pid",
                    "c1",
                ],
                Some("/b1"),
            ),
            (
                &["--systemd-cgroup", "create", "--bundle=/b2", "c2"],
                Some("/b2"),
            ),
            (&["run", "-b", "/b3", "c3"], Some("/b3")),
            (&["run", "c4"], Some(".")),
            (&["--root", "/r", "start", "c1"], None),
            (&["--root", "/r", "delete", "--force", "c1"], None),
            (&["--root", "/r", "state", "create"], None),
            (&["--version"], None),
            (&[], None),
        ];
        for (a, want) in cases {
            assert_eq!(
                created_bundle(&args(a)),
                want.map(PathBuf::from),
                "args {a:?}"
            );
        }
    }

    #[test]
    fn the_hook_goes_in_and_the_variable_comes_out() {
        let mut config = serde_json::json!({
            "ociVersion": "1.0.2",
            "process": { "env": ["PATH=/bin", "GPUCTL_DRIVER_CAP=/run/a.sock|task-1", "X=1"] },
            "hooks": { "prestart": [{ "path": "/other" }], "createRuntime": [{ "path": "/first" }] },
            "linux": { "cgroupsPath": "/x/y" },
        });
        assert!(add_hook(&mut config, Path::new("/usr/bin/gpuctl-agent")).unwrap());
        assert_eq!(
            config["process"]["env"],
            serde_json::json!(["PATH=/bin", "X=1"])
        );
        let hooks = config["hooks"]["createRuntime"].as_array().unwrap();
        assert_eq!(hooks.len(), 2, "the runtime's own hooks stay");
        assert_eq!(hooks[1]["path"], "/usr/bin/gpuctl-agent");
        assert_eq!(
            hooks[1]["args"],
            serde_json::json!(["gpuctl-agent", "cap-hook", "/run/a.sock", "task-1"])
        );
        assert_eq!(config["hooks"]["prestart"][0]["path"], "/other");
        assert_eq!(config["linux"]["cgroupsPath"], "/x/y");
    }

    #[test]
    fn a_container_that_does_not_ask_is_left_alone_and_a_bad_ask_is_refused() {
        let plain = serde_json::json!({ "process": { "env": ["PATH=/bin"] } });
        let mut c = plain.clone();
        assert!(!add_hook(&mut c, Path::new("/a")).unwrap());
        assert_eq!(c, plain);
        let mut no_process = serde_json::json!({ "ociVersion": "1.0.2" });
        assert!(!add_hook(&mut no_process, Path::new("/a")).unwrap());
        for bad in [
            "GPUCTL_DRIVER_CAP=relative.sock|t",
            "GPUCTL_DRIVER_CAP=/a.sock|",
            "GPUCTL_DRIVER_CAP=/a.sock",
        ] {
            let mut c = serde_json::json!({ "process": { "env": [bad] } });
            let e = add_hook(&mut c, Path::new("/a")).unwrap_err();
            assert!(e.contains(CAP_ENV), "{e}");
        }
        let mut c = serde_json::json!({ "process": { "env": ["GPUCTL_DRIVER_CAP=/a.sock|t"] }, "hooks": [] });
        assert!(add_hook(&mut c, Path::new("/a"))
            .unwrap_err()
            .contains("hooks"));
    }
}
