//! The Docker daemon dies under running containers and comes back: a
//! runtime outage, not a task failure. Its own test binary, with one test,
//! because it SIGKILLs the machine's dockerd (and restarts it exactly as CI
//! starts it: `dockerd --iptables=false --bridge=none`, detached). Whatever
//! happens, the test leaves a daemon that answers `docker info`.
//!
//! What Docker itself does here (20.10, no live-restore): SIGKILLing dockerd
//! takes its containerd along, but the containers' shims keep the
//! containers running, and a container that ends meanwhile keeps its exit
//! status in its shim. A restarted dockerd, while "Loading containers"
//! (its API not yet listening), stops every container that still runs
//! (SIGTERM, SIGKILL after 10 s) and records how the others ended. gpuctl
//! starts containers with `init: true`, so the task's `sh` is not PID 1 and
//! dies of the SIGTERM at once: exit 143. The test restarts the daemon 9 s
//! after the containers were seen running, so that a 15 s container is
//! always stopped by Docker (143) and a 5 s one always ended on its own
//! during the outage (its own code, 4): both outcomes are deterministic,
//! and both are reported with the code Docker recorded. The one Docker
//! stopped is said as such (REASON_RUNTIME_RESTARTED: not the task's own
//! failure) and its job goes back to the queue without using a retry.
//! Needs root and Docker (skipped otherwise; required in CI).
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use serde_json::Value;

use gpuctl_tests::dockerd::{
    docker_answers, dockerd_log, kill_dockerd, start_dockerd, DockerGuard,
};
use gpuctl_tests::Gpuctl;
use gpuctl_tests::{
    busybox_image, containers_with_label, docker_or_skip, live_tasks, try_wait_for, wait_for,
    AgentOpts, Cluster, InvariantWatch,
};

const MARKER: &str = "GPUCTL_DOCKER_RESTART_TEST";

/// The docker runtime's health as `gpuctl agents list --json` shows it.
fn docker_status(c: &Cluster) -> Option<Value> {
    c.agents_json().first().and_then(|a| {
        a["runtime_status"]
            .as_array()?
            .iter()
            .find(|s| s["runtime"] == "docker")
            .cloned()
    })
}

fn is_final(state: &Value) -> bool {
    ["SUCCEEDED", "FAILED", "CANCELLED"]
        .iter()
        .any(|s| state == *s)
}

/// The job's one task ended with a real exit code (not a launch failure,
/// not "no exit code").
fn assert_one_task_with_exit_code(j: &Value, state: &str, code: i64) {
    let tasks = j["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 1, "one task only: {j}");
    let t = &tasks[0];
    assert_eq!(j["state"], state, "{j}");
    assert_eq!(t["exit_code"], code, "the container's real exit code: {j}");
    assert_ne!(t["reason"], "CONTAINER_LAUNCH_FAILED", "{j}");
    let msg = t["message"].as_str().unwrap_or_default().to_lowercase();
    assert!(
        !msg.contains("no exit code") && !msg.contains("vanished"),
        "{j}"
    );
}

#[test]
fn containers_outlive_a_docker_daemon_crash_and_report_their_real_exit_codes() {
    let test = "containers_outlive_a_docker_daemon_crash_and_report_their_real_exit_codes";
    if !docker_or_skip(test) {
        return;
    }
    let mut guard = DockerGuard::default();
    let image = busybox_image();
    let m = gpuctl_tests::test_marker("restart");
    let env = format!("{MARKER}={m}");
    let mut c = Cluster::start(&["--heartbeat-interval-secs", "0.2"]);
    let agent = c.add_agent(AgentOpts {
        simulate_gpus: Some("1xA100-SXM4-40GB"),
        runtime: "docker,process",
        stop_tasks_on_shutdown: false,
        ..Default::default()
    });
    guard.agent_id = Some(agent.clone());
    wait_for(Duration::from_secs(10), "docker reported available", || {
        docker_status(&c).is_some_and(|s| s["available"] == true)
    });
    let watch = InvariantWatch::start(MARKER, &m);

    // On the agent's only GPU: still running when the daemon comes back.
    let gpu_job = c.submit(&[
        "--name",
        "ctr-gpu",
        "--gpus",
        "1",
        "--image",
        &image,
        "--env",
        &env,
        "--",
        "sh",
        "-c",
        "echo up; sleep 15; exit 6",
    ]);
    // No GPU, short: ends on its own while the daemon is down.
    let short_job = c.submit(&[
        "--name",
        "ctr-short",
        "--image",
        &image,
        "--env",
        &env,
        "--",
        "sh",
        "-c",
        "echo up; sleep 5; exit 4",
    ]);
    let j = c.wait_state(&gpu_job, "RUNNING", Duration::from_secs(60));
    let running_at = Instant::now();
    let gpus = j["tasks"][0]["gpus"].clone();
    assert_eq!(gpus.as_array().unwrap().len(), 1, "{j}");
    c.wait_state(&short_job, "RUNNING", Duration::from_secs(60));
    wait_for(Duration::from_secs(10), "both containers live", || {
        live_tasks(MARKER, &m)
            .iter()
            .map(|t| &t.job_id)
            .collect::<std::collections::BTreeSet<_>>()
            .len()
            == 2
    });

    // Crash the daemon.
    kill_dockerd();
    // The containers run on without their daemon, seen from outside.
    std::thread::sleep(Duration::from_millis(500));
    let live = live_tasks(MARKER, &m);
    assert_eq!(
        live.iter()
            .map(|t| &t.job_id)
            .collect::<std::collections::BTreeSet<_>>()
            .len(),
        2,
        "containers died with dockerd: {live:?}"
    );
    // The agent says Docker is down; the process runtime is fine.
    let mut last = None;
    let down = try_wait_for(Duration::from_secs(15), || {
        last = docker_status(&c);
        last.as_ref().is_some_and(|s| s["available"] == false)
    });
    assert!(
        down,
        "agents list never showed docker unavailable; last: {last:?}\n{}",
        c.diagnostics()
    );
    let why = last.as_ref().unwrap()["message"]
        .as_str()
        .unwrap_or_default();
    assert!(!why.is_empty(), "docker down without a reason: {last:?}");
    let a = &c.agents_json()[0];
    assert_eq!(a["state"], "ACTIVE", "{a}");
    let process = a["runtime_status"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["runtime"] == "process")
        .cloned();
    assert!(
        process.as_ref().is_none_or(|s| s["available"] == true),
        "{a}"
    );
    let table = c.ok(&["agents", "list"]);
    assert!(table.contains("docker (down"), "{table}");

    // A host-process job wanting the only GPU: the process runtime works,
    // so only the GPU held by the container keeps it waiting.
    let waiter = c.submit(&[
        "--name", "waiter", "--gpus", "1", "--env", &env, "--", "sh", "-c", "sleep 1",
    ]);
    // While Docker is down (at least 3 s), nothing ends and nothing moves.
    let restart_at = running_at + Duration::from_secs(9);
    let hold_until = restart_at.max(Instant::now() + Duration::from_secs(3));
    while Instant::now() < hold_until {
        let w = c.job(&waiter);
        assert_eq!(w["state"], "QUEUED", "GPU given while Docker is down: {w}");
        for id in [&gpu_job, &short_job] {
            let j = c.job(id);
            assert_eq!(j["state"], "RUNNING", "a Docker outage ended a job: {j}");
            assert_eq!(j["tasks"].as_array().unwrap().len(), 1, "{j}");
        }
        std::thread::sleep(Duration::from_millis(250));
    }

    // Restart the daemon as CI does.
    let restarted = Instant::now();
    start_dockerd();
    // Until the GPU job's first attempt ends, the waiter stays queued
    // (sampled before the GPU job, so a start after its end is not
    // mistaken for an overlap).
    let mut gpu_end = Value::Null;
    let first_ended = |j: &Value| {
        j["tasks"]
            .as_array()
            .and_then(|t| t.first())
            .is_some_and(|t| {
                ["FAILED", "FINISHED", "KILLED"]
                    .iter()
                    .any(|s| t["state"] == *s)
            })
    };
    let ended = try_wait_for(Duration::from_secs(60), || {
        let w = c.job(&waiter);
        gpu_end = c.job(&gpu_job);
        if !first_ended(&gpu_end) {
            assert_eq!(
                w["state"], "QUEUED",
                "the GPU was given while its container ran: {w}\n{gpu_end}"
            );
        }
        first_ended(&gpu_end)
    });
    assert!(
        ended,
        "the GPU job's container did not end after Docker came back: {gpu_end}\n{}",
        c.diagnostics()
    );
    assert!(
        try_wait_for(Duration::from_secs(90), docker_answers),
        "dockerd does not answer after its restart (see {})",
        dockerd_log().display()
    );
    let back = restarted.elapsed();
    eprintln!("dockerd answered {back:?} after its restart");

    // Stopped by the restarted daemon (no live-restore): SIGTERM through
    // docker-init, so 143, said as the runtime's restart, not the task's
    // failure; the job is back in the queue with no retry used.
    let first = gpu_end["tasks"][0].clone();
    assert_eq!(first["state"], "FAILED", "{gpu_end}");
    assert_eq!(
        first["exit_code"], 143,
        "the container's real exit code: {gpu_end}"
    );
    assert_eq!(first["reason"], "RUNTIME_RESTARTED", "{gpu_end}");
    let said = first["message"].as_str().unwrap_or_default();
    assert!(
        said.contains("stopped by its container runtime as the runtime restarted"),
        "{gpu_end}"
    );
    let requeued = try_wait_for(Duration::from_secs(20), || {
        gpu_end = c.job(&gpu_job);
        gpu_end["events"].as_array().is_some_and(|e| {
            e.iter().any(|e| {
                e["reason"] == "Requeued"
                    && e["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("container runtime restarted under it"))
            })
        })
    });
    assert!(requeued, "not requeued after Docker's restart: {gpu_end}");
    assert!(!is_final(&gpu_end["state"]), "{gpu_end}");
    assert_eq!(gpu_end["retries"], 0, "no retry used: {gpu_end}");
    // Its next attempt is not this test's business: cancelled, so that the
    // waiter's turn comes at once.
    c.ok(&["jobs", "cancel", &gpu_job]);
    c.wait_state(&gpu_job, "CANCELLED", Duration::from_secs(60));
    // Ended on its own while no daemon ran: its own exit code.
    let short_end = c.wait_state(&short_job, "FAILED", Duration::from_secs(60));
    assert_one_task_with_exit_code(&short_end, "FAILED", 4);
    // The waiter got the GPU only after the first attempt ended, and ran
    // once.
    let w = c.wait_state(&waiter, "SUCCEEDED", Duration::from_secs(60));
    let wt = w["tasks"].as_array().unwrap();
    assert_eq!(wt.len(), 1, "{w}");
    assert_eq!(wt[0]["gpus"], gpus, "{w}");
    // The output was copied once across the outage.
    let logs = c.ok(&["jobs", "logs", &gpu_job, "--attempt", "1"]);
    assert_eq!(logs.matches("up").count(), 1, "{gpu_job}: {logs}");
    let logs = c.ok(&["jobs", "logs", &short_job]);
    assert_eq!(logs.matches("up").count(), 1, "{short_job}: {logs}");
    // And the agent says Docker is back.
    wait_for(
        Duration::from_secs(15),
        "docker reported available again",
        || docker_status(&c).is_some_and(|s| s["available"] == true),
    );
    wait_for(Duration::from_secs(20), "containers removed", || {
        containers_with_label("gpuctl.agent_id", &agent).is_empty()
    });
    watch.assert_held();
}
