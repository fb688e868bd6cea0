//! The machine's Docker daemon, for tests that kill it under running
//! containers and start it again exactly as CI starts it (`dockerd
//! --iptables=false --bridge=none`, detached). Such tests live in a test
//! binary of their own (no sibling test may use Docker meanwhile) and hold
//! a [`DockerGuard`], so that whatever happens they leave a daemon that
//! answers `docker info`.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{alive, containers_with_label, try_wait_for};

/// `docker info` answers (bounded: the CLI could wait on a stuck socket).
pub fn docker_answers() -> bool {
    Command::new("timeout")
        .args(["10", "docker", "info", "--format", "{{.ServerVersion}}"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Pids of the running dockerd processes (`pidof dockerd`, zombies left
/// out).
pub fn dockerd_pids() -> Vec<i32> {
    let out = Command::new("pidof").arg("dockerd").output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .filter(|p| alive(*p))
        .collect()
}

/// Where the restarted daemon writes: the file CI's daemon writes to.
pub fn dockerd_log() -> PathBuf {
    std::env::temp_dir().join("dockerd.log")
}

/// The pid files of dockerd and of the containerd it runs.
const PIDFILES: [&str; 2] = [
    "/var/run/docker.pid",
    "/var/run/docker/containerd/containerd.pid",
];

/// SIGKILLs every dockerd (a crash; its containerd goes with it, the
/// containers' shims stay) and waits until none answers.
pub fn kill_dockerd() {
    let pids = dockerd_pids();
    assert!(!pids.is_empty(), "no dockerd to kill");
    for pid in &pids {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
    }
    assert!(
        try_wait_for(Duration::from_secs(10), || {
            dockerd_pids().is_empty() && !docker_answers()
        }),
        "dockerd did not go"
    );
}

/// Starts dockerd as CI does, detached (its own session, reparented to
/// init) so that it outlives the test; output appended to [`dockerd_log`].
/// A killed daemon leaves its pid file and its containerd's (which dies
/// with it); dockerd refuses to start while the first names a process,
/// and waits 15 s for a containerd the second names, even an unreaped
/// zombie: such stale files are removed first. Tries again (up to 3
/// times) when the daemon exits at once.
pub fn start_dockerd() {
    for attempt in 1..=3 {
        for file in PIDFILES {
            if let Ok(pid) = std::fs::read_to_string(file) {
                if pid.trim().parse().is_ok_and(|p: i32| !alive(p)) {
                    let _ = std::fs::remove_file(file);
                }
            }
        }
        let script = format!(
            "setsid nohup dockerd --iptables=false --bridge=none >>'{}' 2>&1 </dev/null &",
            dockerd_log().display()
        );
        let status = Command::new("sh").args(["-c", &script]).status().unwrap();
        assert!(status.success(), "starting dockerd failed: {status}");
        // A daemon that cannot start exits within a moment.
        let started = try_wait_for(Duration::from_secs(2), || !dockerd_pids().is_empty());
        std::thread::sleep(Duration::from_millis(500));
        if started && !dockerd_pids().is_empty() {
            return;
        }
        eprintln!(
            "dockerd exited at once (attempt {attempt}); see {}",
            dockerd_log().display()
        );
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Leaves the machine with a Docker daemon that answers, even when the
/// test fails half way, then removes the containers of the test's agent.
/// Declared before the cluster, so it runs after the agent was stopped.
#[derive(Default)]
pub struct DockerGuard {
    pub agent_id: Option<String>,
}

impl Drop for DockerGuard {
    fn drop(&mut self) {
        // A daemon that stops surviving containers answers only once they
        // are down (10 s stop timeout, in parallel).
        let deadline = Instant::now() + Duration::from_secs(120);
        while !docker_answers() && Instant::now() < deadline {
            if dockerd_pids().is_empty() {
                eprintln!("docker guard: no dockerd running; starting one");
                start_dockerd();
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        if !docker_answers() {
            eprintln!(
                "docker guard: dockerd still does not answer; see {}",
                dockerd_log().display()
            );
        }
        if let Some(agent) = &self.agent_id {
            for id in containers_with_label("gpuctl.agent_id", agent) {
                let _ = Command::new("docker")
                    .args(["rm", "-f", &id])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
        }
    }
}
