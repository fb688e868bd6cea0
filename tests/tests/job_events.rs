//! Job events end to end (real master, agents and gpuctl, simulated GPUs,
//! host-process tasks): `jobs get` tells what happened to a job, in order,
//! with times, in its Events table and in `--json`: placed, started,
//! finished with its exit code, retried, preempted by which job, and what
//! an agent killed under a running job did to it.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use gpuctl_tests::Gpuctl;
use gpuctl_tests::{try_wait_for, AgentOpts, Cluster};
use serde_json::Value;

const T: Duration = Duration::from_secs(30);

/// The job's events as (reason, message).
fn events(job: &Value) -> Vec<(String, String)> {
    job["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["reason"].as_str().unwrap().to_string(),
                e["message"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn reasons(job: &Value) -> Vec<String> {
    events(job).into_iter().map(|(r, _)| r).collect()
}

/// Polls the job until its events include `reason`; returns the job.
fn wait_event(c: &Cluster, id: &str, reason: &str) -> Value {
    let mut last = Value::Null;
    let ok = try_wait_for(T, || {
        last = c.job(id);
        reasons(&last).iter().any(|r| r == reason)
    });
    assert!(
        ok,
        "job {id}: no {reason} event; last: {last}\n{}",
        c.diagnostics()
    );
    last
}

#[test]
fn jobs_get_tells_what_happened_in_order() {
    let mut c = Cluster::start(&[]);
    let agent = c.add_agent(AgentOpts {
        simulate_gpus: Some("1xA100-SXM4-40GB"),
        ..Default::default()
    });

    // Queued, placed, started, finished with its exit code.
    let ok = c.submit(&[
        "--name", "ok", "--cpus", "0.1", "--gpus", "1", "--", "sh", "-c", "sleep 1",
    ]);
    assert_eq!(c.wait_job(&ok, 30), (0, "SUCCEEDED".to_string()));
    let j = c.job(&ok);
    let gpu = j["tasks"][0]["gpus"][0].as_str().unwrap().to_string();
    assert_eq!(
        events(&j),
        [
            (
                "Queued".into(),
                "submitted: 1 GPU, priority 0; waiting for placement".into()
            ),
            (
                "Scheduled".into(),
                format!("placed on agent {agent} (GPUs {gpu})")
            ),
            ("Started".into(), format!("running on agent {agent}")),
            ("Succeeded".into(), "exited with code 0".into()),
        ],
        "{j}"
    );
    let times: Vec<u64> = j["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["last_ms"].as_u64().unwrap())
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    assert!(times[0] >= j["submitted_at_ms"].as_u64().unwrap());
    // The text: an Events table at the end, as kubectl describe has.
    let text = c.ok(&["jobs", "get", &ok]);
    let table = text.split("\nEvents:\n").nth(1).expect(&text);
    let rows: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split_whitespace().take(2).collect())
        .collect();
    assert_eq!(
        rows,
        [
            vec!["TYPE", "REASON"],
            vec!["Normal", "Queued"],
            vec!["Normal", "Scheduled"],
            vec!["Normal", "Started"],
            vec!["Normal", "Succeeded"],
        ],
        "{text}"
    );
    // Replicated state: a master restarted from its log has the same
    // events, with the same times.
    c.restart_master();
    assert_eq!(c.job(&ok)["events"], j["events"]);
    // A list answer stays small: no events.
    let list = c.json(&["jobs", "list", "--json"]);
    assert!(list
        .as_array()
        .unwrap()
        .iter()
        .all(|j| j["events"].as_array().unwrap().is_empty()));

    // A failure: retried once, then failed, each time with its exit code.
    let bad = c.submit(&[
        "--name",
        "bad",
        "--cpus",
        "0.1",
        "--max-retries",
        "1",
        "--",
        "sh",
        "-c",
        "exit 3",
    ]);
    assert_eq!(c.wait_job(&bad, 30).1, "FAILED");
    let j = c.job(&bad);
    let ev = events(&j);
    let r: Vec<&str> = ev.iter().map(|(r, _)| r.as_str()).collect();
    // The Scheduled of the second attempt repeats the first: one row, x2.
    assert_eq!(r.first(), Some(&"Queued"), "{j}");
    assert!(
        ev.contains(&(
            "Retrying".into(),
            format!("task {bad}.0 exited with code 3; retry 1 of 1 in 1s")
        )),
        "{j}"
    );
    assert_eq!(
        ev.last().unwrap(),
        &("Failed".into(), format!("task {bad}.1 exited with code 3")),
        "{j}"
    );
    let failed = j["events"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(failed["type"], "Warning", "{j}");

    // Preemption: the victim names the job that preempted it, which
    // names its victim.
    let script = "trap 'exit 143' TERM; while true; do sleep 0.2; done";
    let low = c.submit(&[
        "--name", "low", "--cpus", "0.1", "--gpus", "1", "--", "sh", "-c", script,
    ]);
    c.wait_state(&low, "RUNNING", T);
    let high = c.submit(&[
        "--name",
        "high",
        "--cpus",
        "0.1",
        "--gpus",
        "1",
        "--priority",
        "10",
        "--",
        "sh",
        "-c",
        "sleep 1",
    ]);
    assert_eq!(c.wait_job(&high, 30), (0, "SUCCEEDED".to_string()));
    let j = wait_event(&c, &low, "Requeued");
    let ev = events(&j);
    assert!(
        ev.contains(&(
            "Preempted".into(),
            format!("preempted by {high} (priority 10)")
        )),
        "{j}"
    );
    // (Placed and started again once `high` ended: those rows, repeats,
    // moved to the end with a count.)
    let at = |r: &str| ev.iter().position(|(x, _)| x == r).unwrap();
    assert!(at("Preempted") < at("Requeued"), "{j}");
    assert_eq!(
        ev[at("Requeued")].1,
        format!("preempted by {high}: back in the queue (no retry used)"),
        "{j}"
    );
    let h = c.job(&high);
    assert!(
        events(&h).contains(&(
            "Preempting".into(),
            format!("stopping lower-priority {low} to make room")
        )),
        "{h}"
    );
    c.ok(&["jobs", "cancel", &low]);
}

#[test]
fn an_agent_killed_under_a_running_job_shows_unreachable_lost_and_retried() {
    // As in e2e_process: unreachable after 1.5 s, lost after 18 s (above
    // the fence, the assumed kill grace and the margin).
    let mut c = Cluster::start(&[
        "--heartbeat-interval-secs",
        "0.2",
        "--agent-timeout-secs",
        "1.5",
        "--agent-fence-timeout-secs",
        "2",
        "--agent-lost-timeout-secs",
        "18",
    ]);
    let agent = c.add_agent(AgentOpts::default());
    let j = c.submit(&[
        "--name",
        "long",
        "--gpus",
        "1",
        "--max-retries",
        "1",
        "--",
        "sh",
        "-c",
        "exec sleep 300",
    ]);
    c.wait_state(&j, "RUNNING", T);
    c.agents[0].kill();
    let job = wait_event(&c, &j, "AgentUnreachable");
    assert!(
        events(&job).contains(&(
            "AgentUnreachable".into(),
            format!("agent {agent} stopped heartbeating; its tasks keep their GPUs")
        )),
        "{job}"
    );
    let job = wait_event(&c, &j, "Retrying");
    assert_eq!(
        reasons(&job),
        [
            "Queued",
            "Scheduled",
            "Started",
            "AgentUnreachable",
            "AgentLost",
            "Retrying"
        ],
        "{job}"
    );
    let ev = events(&job);
    assert!(
        ev[4]
            .1
            .starts_with(&format!("agent {agent} unreachable since ")),
        "{job}"
    );
    assert!(
        ev[5]
            .1
            .starts_with(&format!("task {j}.0 lost: agent {agent} lost")),
        "{job}"
    );
    assert!(ev[5].1.ends_with("; retry 1 of 1 in 1s"), "{job}");
}
