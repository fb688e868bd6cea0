//! The fence of a Docker task: `gpuctl-agent fence-container STATE_DIR`, a
//! small process per container that stops it once the agent's last contact
//! with a leader is older than the fence timeout, whether the agent process
//! is alive, frozen or dead (a host-process task's supervisor does the same
//! for its task). It exits once the container has ended.
//!
//! It speaks to Docker with plain HTTP/1.0 over the daemon's Unix socket: it
//! must be small and synchronous. When the daemon does not answer at the
//! moment the fence falls, it stops the container's processes through the
//! task's cgroups instead (where the container was placed in them: cgroup
//! v1 with Docker's cgroupfs driver).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use super::helper;
use crate::checkpoint;

pub const SUBCOMMAND: &str = "fence-container";
/// What the watcher needs, written by the agent before it starts one.
pub const CONFIG_FILE: &str = "fence.json";
pub const LOCK_FILE: &str = "fence.lock";
/// Written when the watcher stopped the container: the task ends `fenced`.
pub const FENCED_FILE: &str = "fenced";
const TICK: Duration = Duration::from_millis(250);
/// How often the container's state is asked for (to exit once it ended).
const STATE_EVERY: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FenceConfig {
    /// The container's name.
    pub container: String,
    /// The Docker daemon's socket path.
    pub socket: PathBuf,
    /// The agent's `contact.json`.
    pub contact: PathBuf,
    pub kill_grace_ms: u64,
    /// The task cgroup's `cgroup.procs` files (fallback when Docker does not
    /// answer); empty when the container is not in them.
    pub cgroup_procs: Vec<PathBuf>,
}

/// Runs the watcher when the process was started as one.
pub fn main_if_requested() -> Option<ExitCode> {
    let mut args = std::env::args_os().skip(1);
    if args.next()? != SUBCOMMAND {
        return None;
    }
    let code = match (args.next(), args.next()) {
        (Some(dir), None) => run(Path::new(&dir)),
        _ => {
            eprintln!("usage: gpuctl-agent {SUBCOMMAND} STATE_DIR");
            2
        }
    };
    Some(ExitCode::from(code))
}

fn run(dir: &Path) -> u8 {
    let lock_path = dir.join(LOCK_FILE);
    let _lock = match helper::lock_or_give_up(&lock_path) {
        Ok(Some(l)) => l,
        // Another watcher has it.
        Ok(None) => return 3,
        Err(e) => {
            eprintln!("gpuctl-agent {SUBCOMMAND}: {}: {e}", lock_path.display());
            return 1;
        }
    };
    let config: FenceConfig = match checkpoint::read_json(&dir.join(CONFIG_FILE)) {
        Ok(Some(c)) => c,
        _ => {
            eprintln!(
                "gpuctl-agent {SUBCOMMAND}: no readable {CONFIG_FILE} in {}",
                dir.display()
            );
            return 1;
        }
    };
    let mut last_state = Instant::now();
    loop {
        if helper::fence_expired(Some(&config.contact)) {
            eprintln!(
                "gpuctl-agent {SUBCOMMAND}: no contact with a master for the fence timeout: stopping container {}",
                config.container
            );
            let _ = checkpoint::write_atomic(&dir.join(FENCED_FILE), b"");
            stop(&config);
            return 0;
        }
        if last_state.elapsed() >= STATE_EVERY {
            last_state = Instant::now();
            // Ended or gone: nothing left to fence. A daemon that does not
            // answer says nothing: keep watching.
            if let Some(false) = running(&config) {
                return 0;
            }
        }
        std::thread::sleep(TICK);
    }
}

/// `docker stop`, or, when the daemon does not answer, SIGTERM and then
/// SIGKILL to every process in the task's cgroups.
fn stop(config: &FenceConfig) {
    let grace_s = config.kill_grace_ms.div_ceil(1000);
    let path = format!("/containers/{}/stop?t={grace_s}", config.container);
    let timeout = Duration::from_secs(grace_s + 30);
    match request(&config.socket, "POST", &path, timeout) {
        Ok((204 | 304 | 404, _)) => return,
        Ok((status, body)) => eprintln!("docker stop: {status} {body}"),
        Err(e) => eprintln!("docker stop: {e}"),
    }
    signal_cgroup(&config.cgroup_procs, Signal::SIGTERM);
    let deadline = Instant::now() + Duration::from_millis(config.kill_grace_ms);
    while Instant::now() < deadline && !cgroup_empty(&config.cgroup_procs) {
        std::thread::sleep(Duration::from_millis(50));
    }
    signal_cgroup(&config.cgroup_procs, Signal::SIGKILL);
}

fn cgroup_pids(procs: &[PathBuf]) -> Vec<i32> {
    procs
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .flat_map(|t| {
            t.lines()
                .filter_map(|l| l.trim().parse::<i32>().ok())
                .collect::<Vec<_>>()
        })
        .collect()
}

fn cgroup_empty(procs: &[PathBuf]) -> bool {
    cgroup_pids(procs).is_empty()
}

fn signal_cgroup(procs: &[PathBuf], sig: Signal) {
    for pid in cgroup_pids(procs) {
        let _ = kill(Pid::from_raw(pid), sig);
    }
}

/// Whether the container runs: `Some(false)` when it ended or is gone,
/// `None` when the daemon does not answer.
fn running(config: &FenceConfig) -> Option<bool> {
    let path = format!("/containers/{}/json", config.container);
    match request(&config.socket, "GET", &path, Duration::from_secs(10)) {
        Ok((404, _)) => Some(false),
        Ok((200, body)) => serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["State"]["Running"].as_bool()),
        _ => None,
    }
}

/// One HTTP/1.0 request (the daemon closes the connection after the
/// answer, so the body is whatever follows the headers).
pub fn request(
    socket: &Path,
    method: &str,
    path: &str,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    let mut s = UnixStream::connect(socket)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: docker\r\nContent-Length: 0\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad answer: {text:.80}")))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_reaches_the_docker_daemon() {
        let socket = Path::new("/var/run/docker.sock");
        if !socket.exists() {
            assert_ne!(
                std::env::var("GPUCTL_REQUIRE_DOCKER").as_deref(),
                Ok("1"),
                "Docker required but {} is missing",
                socket.display()
            );
            eprintln!("plain_http_reaches_the_docker_daemon: skipped: no Docker socket");
            return;
        }
        let (status, body) = request(socket, "GET", "/_ping", Duration::from_secs(10)).unwrap();
        assert_eq!((status, body.as_str()), (200, "OK"));
        let (status, _) = request(
            socket,
            "GET",
            "/containers/gpuctl-no-such-container-for-tests/json",
            Duration::from_secs(10),
        )
        .unwrap();
        assert_eq!(status, 404);
        let config = FenceConfig {
            container: "gpuctl-no-such-container-for-tests".into(),
            socket: socket.to_path_buf(),
            contact: PathBuf::from("/nonexistent"),
            kill_grace_ms: 0,
            cgroup_procs: vec![],
        };
        // A container that is gone needs no watcher.
        assert_eq!(running(&config), Some(false));
        // A daemon that does not answer says nothing.
        let down = FenceConfig {
            socket: PathBuf::from("/nonexistent/docker.sock"),
            ..config
        };
        assert_eq!(running(&down), None);
    }
}
