//! The README quickstart, `gpuctl demo`, runs to the end and exits 0.
#![allow(clippy::unwrap_used)]

use std::process::Command;

#[test]
fn demo_runs_both_jobs_and_exits_zero() {
    // With Docker when the test may use it, else host processes.
    let docker = gpuctl_tests::docker_or_skip("demo (Docker path)");
    let mut cmd = Command::new(gpuctl_tests::bin("gpuctl"));
    // The binaries are built (bin_dir): not started as `cargo run` would,
    // so the demo asks cargo for nothing.
    cmd.arg("demo")
        .env_remove("CARGO")
        .env_remove("CARGO_MANIFEST_DIR");
    if !docker {
        cmd.arg("--no-docker");
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("simulated"), "{stdout}");
    for line in [
        "demo-1gpu: SUCCEEDED",
        "demo-2gpu: SUCCEEDED",
        "Both jobs SUCCEEDED",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in:\n{stdout}");
    }
    // The 2-GPU job printed the two GPUs it was given.
    let printed = stdout
        .lines()
        .find(|l| l.starts_with("[demo-2gpu] job"))
        .unwrap_or_else(|| panic!("no output of demo-2gpu in:\n{stdout}"));
    assert_eq!(printed.matches("GPU-").count(), 2, "{printed}");
    if docker {
        assert!(stdout.contains("Jobs run in Docker containers"), "{stdout}");
    } else {
        assert!(stdout.contains("host processes"), "{stdout}");
    }
}

/// `GET path` over plain HTTP; the status line and body.
fn http_get(addr: &str, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// Kills the demo if the test fails before it ends it.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn demo_with_console_serves_its_jobs_until_interrupted() {
    use std::io::BufRead;
    use std::process::Stdio;
    let addr = format!("127.0.0.1:{}", gpuctl_tests::free_port());
    let mut child = KillOnDrop(
        Command::new(gpuctl_tests::bin("gpuctl"))
            .args(["demo", "--no-docker", "--console", &addr])
            .env_remove("CARGO")
            .env_remove("CARGO_MANIFEST_DIR")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut lines = std::io::BufReader::new(child.0.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let done = line.contains("keeps running for the web console");
        seen.push(line);
        if done {
            break;
        }
    }
    let text = seen.join("\n");
    assert!(
        text.contains(&format!("Web console: http://{addr}/"))
            && text.contains("demo-2gpu: SUCCEEDED"),
        "{text}"
    );
    let (status, body) = http_get(&addr, "/");
    assert!(
        status.contains("200") && body.contains("gpuctl console"),
        "{status}\n{body}"
    );
    let (status, body) = http_get(&addr, "/api/jobs");
    assert!(status.contains("200"), "{status}: {body}");
    let jobs: serde_json::Value = serde_json::from_str(body.trim()).unwrap();
    let states: Vec<&str> = jobs["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["SUCCEEDED", "SUCCEEDED"], "{body}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.0.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    let status = child.0.wait().unwrap();
    assert!(status.success(), "{status:?}: {rest:?}");
    assert!(
        rest.iter().any(|l| l.contains("Both jobs SUCCEEDED")),
        "{rest:?}"
    );
}

/// `gpuctl` copied into `dir`, beside the given daemon stand-ins (shell
/// scripts), run as `gpuctl demo --no-docker` with an empty PATH but /bin.
fn demo_beside(dir: &std::path::Path, daemons: &[(&str, &str)]) -> std::process::Output {
    use std::os::unix::fs::PermissionsExt;
    std::fs::copy(gpuctl_tests::bin("gpuctl"), dir.join("gpuctl")).unwrap();
    for (name, script) in daemons {
        let p = dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{script}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    Command::new(dir.join("gpuctl"))
        .args(["demo", "--no-docker", "--timeout", "20"])
        .env("PATH", "/bin")
        // Not as `cargo run` would start it: nothing is built.
        .env_remove("CARGO")
        .env_remove("CARGO_MANIFEST_DIR")
        .output()
        .unwrap()
}

#[test]
fn demo_without_the_daemon_binaries_says_how_to_build_them() {
    let dir = tempfile::tempdir().unwrap();
    let out = demo_beside(dir.path(), &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("gpuctl demo runs gpuctl-master, which is neither next to gpuctl")
            && stderr.contains("cargo build --release -p gpuctl -p gpuctl-master -p gpuctl-agent"),
        "{stderr}"
    );
}

#[test]
fn demo_whose_master_exits_stops_and_shows_the_end_of_its_log() {
    let dir = tempfile::tempdir().unwrap();
    let check = r#"{"gpus":[],"driver_version":null,"nvml_error":"no driver here","docker":null}"#;
    let out = demo_beside(
        dir.path(),
        &[
            (
                "gpuctl-master",
                "echo 'gpuctl-master: listen on 127.0.0.1:1: address in use' >&2; exit 1",
            ),
            (
                "gpuctl-agent",
                &format!("if [ \"$1\" = check ]; then echo '{check}'; exit 0; fi; exec sleep 60"),
            ),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("No usable NVIDIA GPU on this host (no driver here)"),
        "{stdout}"
    );
    assert!(
        stderr.contains("the master exited (exit status: 1)") && stderr.contains("address in use"),
        "{stderr}"
    );
    // The agent stand-in was stopped, not left behind.
    assert!(
        stdout.contains("Stopping the agent and the master"),
        "{stdout}"
    );
}
