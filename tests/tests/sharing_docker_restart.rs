//! The Docker daemon SIGKILLed and started again under GPU fractions
//! shared through MPS (issue 34). Its own test binary, with one test,
//! because it kills the machine's dockerd (restarted exactly as CI starts
//! it; whatever happens, the test leaves a daemon that answers, see
//! `gpuctl_tests::dockerd`).
//!
//! What is expected (docs/operations.md, and docker_restart.rs for what
//! Docker 20.10 does without live-restore, as CI runs it): the containers
//! outlive the daemon's death, their shims keep them running, and the
//! agent keeps their tasks through the outage; the restarted daemon stops
//! them (SIGTERM through docker-init: exit 143) and gpuctl reports that
//! exit code, as the runtime's restart (REASON_RUNTIME_RESTARTED): the job
//! goes back to the queue without using a retry, unless it was submitted
//! with --no-requeue. The MPS control daemon is a host process of the agent, not
//! Docker's: it keeps its pid throughout. Fractions placed while Docker is
//! down, a job's retry and a fraction that waited for room then share the
//! GPU exactly to its memory, on the same MPS daemon, and the masters, the
//! agent (its task records and metrics), Docker and the daemon's clients
//! (the containers mounting its pipe) agree: no fraction counted twice,
//! none counted that no container runs.
//! Needs root and Docker (skipped otherwise; required in CI).
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use gpuctl_tests::dockerd::{
    docker_answers, dockerd_log, kill_dockerd, start_dockerd, DockerGuard,
};
use gpuctl_tests::{
    alive, busybox_image, docker_or_skip, free_port, mps_daemon_pid, mps_groups, mps_pipe,
    running_task_containers, try_wait_for, wait_for, AgentOpts, Cluster, Gpuctl,
};

const GIB: u64 = 1024;

/// The docker runtime's health as `gpuctl agents list --json` shows it.
fn docker_available(c: &Cluster) -> Option<bool> {
    c.agents_json().first().and_then(|a| {
        a["runtime_status"]
            .as_array()?
            .iter()
            .find(|s| s["runtime"] == "docker")
            .and_then(|s| s["available"].as_bool())
    })
}

/// The shares the master counts on `uuid`: task id -> MiB.
fn counted(c: &Cluster, uuid: &str) -> BTreeMap<String, u64> {
    let gpus = c.json(&["gpus", "--json"]);
    let gpu = gpus
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["uuid"] == uuid)
        .cloned()
        .unwrap();
    gpu["shares"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| {
            (
                s["task_id"].as_str().unwrap().to_string(),
                s["mem_mib"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// The agent's `gpuctl_agent_tasks_running` gauge.
fn agent_tasks_running(metrics: &str) -> Option<u64> {
    let mut s = std::net::TcpStream::connect(metrics).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {metrics}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("gpuctl_agent_tasks_running "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

/// The tasks the agent keeps a record of as clients of the daemon group
/// `group` (`<work>/state/<task>/mps-group`).
fn agent_mps_tasks(work: &Path, group: &str) -> BTreeSet<String> {
    std::fs::read_dir(work.join("state"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("mps-group")).is_ok_and(|g| g.trim() == group)
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

fn is_final(state: &Value) -> bool {
    ["SUCCEEDED", "FAILED", "CANCELLED"]
        .iter()
        .any(|s| state == *s)
}

#[test]
fn mps_fractions_through_a_docker_daemon_restart_are_counted_once() {
    let test = "mps_fractions_through_a_docker_daemon_restart_are_counted_once";
    if !docker_or_skip(test) {
        return;
    }
    let mut guard = DockerGuard::default();
    let image = busybox_image();
    let mut c = Cluster::start(&["--heartbeat-interval-secs", "0.2"]);
    let metrics = format!("127.0.0.1:{}", free_port());
    let agent = c.add_agent(AgentOpts {
        simulate_gpus: Some("1xA100-SXM4-40GB"),
        runtime: "docker,process",
        extra: vec![
            "--share-gpus".into(),
            "mps".into(),
            "--mps-control".into(),
            gpuctl_tests::fake_mps_control().display().to_string(),
            "--metrics-listen".into(),
            metrics.clone(),
        ],
        ..Default::default()
    });
    guard.agent_id = Some(agent.clone());
    let uuid = c.json(&["gpus", "--json"])[0]["uuid"]
        .as_str()
        .unwrap()
        .to_string();
    wait_for(Duration::from_secs(10), "docker reported available", || {
        docker_available(&c) == Some(true)
    });
    let work = c.dir.path().join("agent0");
    let fraction = |name: &str, mib: u64, extra: &[&str]| {
        let mem = format!("{mib}MiB");
        let mut args = vec![
            "--name",
            name,
            "--image",
            &image,
            "--gpu-mem",
            &mem,
            "--cpus",
            "0.1",
        ];
        args.extend(extra);
        args.extend(["--", "sh", "-c", "echo up; exec sleep 600"]);
        c.submit(&args)
    };

    // Two 15 GiB fractions of the 40 GiB GPU; one job may run again.
    let again = fraction("again", 15 * GIB, &["--max-retries", "1"]);
    let once = fraction("once", 15 * GIB, &["--no-requeue"]);
    for j in [&again, &once] {
        c.wait_state(j, "RUNNING", Duration::from_secs(60));
    }
    let groups = mps_groups(&work, &uuid);
    assert_eq!(groups.len(), 1, "{groups:?}");
    let group = groups[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let pipe = mps_pipe(&groups[0]);
    let daemon = mps_daemon_pid(&pipe).expect("the MPS daemon runs");
    let mut before = BTreeMap::new();
    wait_for(Duration::from_secs(20), "both containers running", || {
        before = running_task_containers(&agent).unwrap_or_default();
        before.len() == 2
    });
    assert!(
        before.values().all(|r| Path::new(&r.mps_pipe) == pipe),
        "{before:?}"
    );

    // Crash the daemon.
    kill_dockerd();
    let killed = Instant::now();
    // The containers run on without it (their shims hold them), and the
    // MPS daemon is not Docker's.
    std::thread::sleep(Duration::from_millis(500));
    for r in before.values() {
        assert!(alive(r.pid), "a container died with dockerd: {r:?}");
    }
    assert_eq!(mps_daemon_pid(&pipe), Some(daemon));
    wait_for(Duration::from_secs(15), "docker reported down", || {
        docker_available(&c) == Some(false)
    });
    // Placed while Docker is down: a 10 GiB fraction fills the GPU; a
    // 15 GiB one finds no room.
    let during = fraction("during", 10 * GIB, &[]);
    let waits = fraction("waits", 15 * GIB, &[]);
    // While Docker is down (at least 4 s), nothing ends, nothing else is
    // placed, and the count stays within the GPU.
    while killed.elapsed() < Duration::from_secs(5) {
        for j in [&again, &once] {
            let j = c.job(j);
            assert_eq!(j["state"], "RUNNING", "a Docker outage ended a job: {j}");
        }
        assert_eq!(c.job(&waits)["state"], "QUEUED", "placed beyond the GPU");
        let n = counted(&c, &uuid);
        assert!(n.values().sum::<u64>() <= 40 * GIB, "over-counted: {n:?}");
        for r in before.values() {
            assert!(alive(r.pid), "{r:?}");
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    // Placed (the agent waits for Docker to start it): the GPU is full.
    let d = c.job(&during);
    assert!(
        ["STARTING", "RUNNING"].contains(&d["state"].as_str().unwrap()),
        "{d}"
    );
    assert_eq!(counted(&c, &uuid).values().sum::<u64>(), 40 * GIB);

    start_dockerd();
    assert!(
        try_wait_for(Duration::from_secs(90), docker_answers),
        "dockerd does not answer after its restart (see {})",
        dockerd_log().display()
    );
    // No live-restore: the restarted daemon stopped both containers, and
    // gpuctl says so with Docker's exit code, as the runtime's restart;
    // the job that asked not to be requeued fails, saying why.
    let j = c.wait_state(&once, "FAILED", Duration::from_secs(60));
    let t = &j["tasks"][0];
    assert_eq!(t["exit_code"], 143, "{j}");
    assert_eq!(t["reason"], "RUNTIME_RESTARTED", "{j}");
    assert!(
        t["message"].as_str().unwrap().starts_with(
            "was stopped by its container runtime as the runtime restarted (exited with code 143, \
             as a process killed by signal 15 (SIGTERM) does;"
        ),
        "{j}"
    );
    assert!(
        j["message"]
            .as_str()
            .unwrap()
            .ends_with("(submitted with --no-requeue)"),
        "{j}"
    );
    for r in before.values() {
        wait_for(Duration::from_secs(10), "the old containers gone", || {
            !alive(r.pid)
        });
    }
    // The job with a retry runs again; with room for it, the waiting one
    // too: 15 + 10 + 15 GiB, the GPU's whole memory.
    let mut a = Value::Null;
    wait_for(Duration::from_secs(60), "the retry running", || {
        a = c.job(&again);
        a["state"] == "RUNNING" && a["tasks"].as_array().unwrap().len() == 2
    });
    assert_eq!(a["tasks"][0]["state"], "FAILED", "{a}");
    assert_eq!(a["tasks"][0]["exit_code"], 143, "{a}");
    assert_eq!(a["tasks"][0]["reason"], "RUNTIME_RESTARTED", "{a}");
    assert_eq!(a["retries"], 0, "requeued without using its retry: {a}");
    for j in [&during, &waits] {
        c.wait_state(j, "RUNNING", Duration::from_secs(60));
    }
    let want: BTreeMap<String, u64> = [
        (a["tasks"][1]["id"].as_str().unwrap().to_string(), 15 * GIB),
        (format!("{during}.0"), 10 * GIB),
        (format!("{waits}.0"), 15 * GIB),
    ]
    .into();

    // Everyone agrees: the master's count, Docker's running containers,
    // the daemon's clients (the containers mounting its pipe), the agent's
    // task records and its gauge.
    let mut last = String::new();
    let agreed = try_wait_for(Duration::from_secs(30), || {
        let docker = running_task_containers(&agent).unwrap_or_default();
        let clients: BTreeSet<String> = docker
            .iter()
            .filter(|(_, r)| Path::new(&r.mps_pipe) == pipe)
            .map(|(t, _)| t.clone())
            .collect();
        let master = counted(&c, &uuid);
        let records = agent_mps_tasks(&work, &group);
        let gauge = agent_tasks_running(&metrics);
        last = format!(
            "docker {docker:?}\nclients {clients:?}\nmaster {master:?}\nagent records {records:?}, gauge {gauge:?}"
        );
        docker.keys().eq(want.keys())
            && clients.iter().eq(want.keys())
            && master == want
            && records.iter().eq(want.keys())
            && gauge == Some(want.len() as u64)
    });
    assert!(
        agreed,
        "the views disagree (want {want:?}):\n{last}\n{}",
        c.diagnostics()
    );
    assert_eq!(counted(&c, &uuid).values().sum::<u64>(), 40 * GIB);
    // The daemon never changed: one group, the same pid, started once.
    assert_eq!(mps_groups(&work, &uuid).len(), 1);
    assert_eq!(mps_daemon_pid(&pipe), Some(daemon));
    let log = std::fs::read_to_string(groups[0].join("log/control.log")).unwrap();
    assert_eq!(log.matches(" start ").count(), 1, "{log}");

    for j in [&again, &during, &waits] {
        c.ok(&["jobs", "cancel", j]);
        let (_, state) = c.wait_job(j, 60);
        assert!(is_final(&c.job(j)["state"]), "{j}: {state}");
    }
}
