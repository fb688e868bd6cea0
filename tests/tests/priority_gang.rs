//! Priorities, preemption, gangs and retries on a real cluster (master and
//! agents as processes, simulated GPUs, host-process tasks): a job of higher
//! priority stops the fewest, least important running jobs it needs (they
//! get SIGTERM and go back to the queue, or fail with --no-requeue); a gang
//! starts all or nothing with its rank environment; a failed rank stops the
//! gang, which is retried; and queued jobs say why they wait.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::time::Duration;

use gpuctl_tests::Gpuctl;
use gpuctl_tests::{task_ids, try_wait_for, AgentOpts, Cluster};
use serde_json::Value;

const T: Duration = Duration::from_secs(20);

/// A task that runs until stopped; on SIGTERM it prints `got-term`, takes
/// `term_delay` seconds (so that the preemptor is seen waiting for it,
/// within the agent's 2 s kill grace) and exits 143.
fn trapper(c: &Cluster, name: &str, gpus: u32, priority: i32, extra: &[&str]) -> String {
    trapper_slow(c, name, gpus, priority, "0", extra)
}

fn trapper_slow(
    c: &Cluster,
    name: &str,
    gpus: u32,
    priority: i32,
    term_delay: &str,
    extra: &[&str],
) -> String {
    let gpus = gpus.to_string();
    let prio = priority.to_string();
    let script = format!(
        "trap 'echo got-term; sleep {term_delay}; exit 143' TERM; echo started; \
         while true; do sleep 0.2; done"
    );
    let mut args = vec![
        "--name",
        name,
        "--cpus",
        "0.1",
        "--gpus",
        &gpus,
        "--priority",
        &prio,
    ];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", &script]);
    c.submit(&args)
}

fn agent(c: &mut Cluster, gpus: &str) -> String {
    c.add_agent(AgentOpts {
        simulate_gpus: Some(gpus),
        ..Default::default()
    })
}

fn reason(job: &Value) -> &str {
    job["reason"].as_str().unwrap_or_default()
}

/// Asserts the job is RUNNING with exactly the one task `task`, never
/// preempted.
fn assert_untouched(c: &Cluster, id: &str, task: &str) {
    let j = c.job(id);
    assert_eq!(j["state"], "RUNNING", "{j}");
    assert_eq!(task_ids(&j), vec![task.to_string()], "{j}");
    assert_eq!(j["preemptions"], 0, "{j}");
    assert_eq!(j["tasks"][0]["state"], "RUNNING", "{j}");
    assert_eq!(j["tasks"][0]["message"], "", "{j}");
}

fn running_task(c: &Cluster, id: &str) -> String {
    let j = c.wait_state(id, "RUNNING", T);
    j["tasks"].as_array().unwrap().last().unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn preemption_stops_the_lowest_priority_and_requeues_it() {
    let mut c = Cluster::start(&[]);
    agent(&mut c, "4xA100-SXM4-40GB");
    let a = trapper_slow(&c, "a", 2, 0, "1.5", &[]);
    let a_task = running_task(&c, &a);
    assert_eq!(a_task, format!("{a}.0"));
    let b = trapper(&c, "b", 2, 1, &[]);
    let b_task = running_task(&c, &b);

    let h = trapper(&c, "h", 2, 10, &[]);
    // A, the lowest priority, is asked to stop, and its task says why.
    let ja = c.wait_job_until(&a, T, "A is preempted", |j| j["preemptions"] == 1);
    assert_eq!(
        ja["tasks"][0]["message"],
        format!("preempted by {h} (priority 10)"),
        "{ja}"
    );
    // While A takes its time to stop, H waits for it, and says so.
    let j = c.job_with_reason(&h);
    assert_eq!(j["state"], "QUEUED", "H ran before A stopped: {j}");
    assert_eq!(j["priority"], 10);
    assert!(reason(&j).starts_with("Preempting:"), "{j}");
    assert!(
        reason(&j).contains("waiting for 1 task of lower priority to stop"),
        "{j}"
    );

    c.wait_state(&h, "RUNNING", T);
    // A, the lowest priority, went back to the queue once its task ended.
    let ja = c.wait_job_until(&a, T, "A is requeued, saying why", |j| {
        j["state"] == "QUEUED" && j["tasks"][0]["state"] != "RUNNING" && !j["wait_reason"].is_null()
    });
    assert_eq!(ja["preemptions"], 1, "{ja}");
    assert_eq!(ja["retries"], 0, "a preemption is no retry: {ja}");
    assert!(
        reason(&ja).starts_with(&format!("PREEMPTED by {h}")),
        "{ja}"
    );
    assert_eq!(task_ids(&ja), vec![a_task.clone()]);
    // Checked last (see the end of the test).
    let ended_message = ja["tasks"][0]["message"].clone();
    assert!(
        ["KILLED", "FAILED"].contains(&ja["tasks"][0]["state"].as_str().unwrap()),
        "{ja}"
    );
    // It was asked to stop with SIGTERM first.
    let logs = c.ok(&["jobs", "logs", &a]);
    assert!(
        logs.contains("started") && logs.contains("got-term"),
        "{logs}"
    );
    // B, of higher priority than A, is untouched.
    assert_untouched(&c, &b, &b_task);
    let logs = c.ok(&["jobs", "logs", &b]);
    assert!(!logs.contains("got-term"), "{logs}");

    // With H gone A runs again, as a new task.
    assert_eq!(c.ok(&["jobs", "cancel", &h]).trim(), "CANCELLED");
    let ja = c.wait_state(&a, "RUNNING", T);
    assert_eq!(
        task_ids(&ja),
        vec![a_task.clone(), format!("{a}.1")],
        "{ja}"
    );
    assert!(ja["reason"].is_null(), "{ja}");
    assert_eq!(ja["preemptions"], 1, "{ja}");
    assert_eq!(c.wait_job(&h, 20), (1, "CANCELLED".to_string()));
    assert_untouched(&c, &b, &b_task);

    // The preempted task still says why once it has ended (the agent's
    // own "killed" does not replace it).
    assert_eq!(
        ended_message,
        format!("preempted by {h} (priority 10)"),
        "message of {a_task} once ended"
    );
}

#[test]
fn preemption_takes_no_more_than_needed_and_respects_no_requeue() {
    let mut c = Cluster::start(&[]);
    agent(&mut c, "8xA100-SXM4-40GB");
    // Equal priorities: P (4 GPUs), Q (2), then R (2, the latest started).
    let p = trapper(&c, "p", 4, 0, &[]);
    let p_task = running_task(&c, &p);
    let q = trapper(&c, "q", 2, 0, &[]);
    let q_task = running_task(&c, &q);
    let r = trapper(&c, "r", 2, 0, &["--no-requeue"]);
    running_task(&c, &r);
    let jr = c.job(&r);
    assert_eq!(jr["no_requeue"], true);
    let r_gpus = jr["tasks"][0]["gpus"].clone();

    // H needs 2 GPUs: P alone would free 2 more than needed; Q and R free
    // exactly 2, and R started last. Only R is preempted.
    let h = trapper(&c, "h", 2, 5, &[]);
    let jh = c.wait_state(&h, "RUNNING", T);
    let mut got = jh["tasks"][0]["gpus"].as_array().unwrap().clone();
    let mut want = r_gpus.as_array().unwrap().clone();
    got.sort_by_key(|g| g.to_string());
    want.sort_by_key(|g| g.to_string());
    assert_eq!(got, want, "H runs on the GPUs R held: {jh}");
    // R was submitted with --no-requeue: it fails instead of waiting.
    let (code, state) = c.wait_job(&r, 20);
    assert_eq!((code, state.as_str()), (1, "FAILED"));
    let jr = c.job(&r);
    assert!(
        jr["message"]
            .as_str()
            .unwrap()
            .contains(&format!("preempted by {h}")),
        "{jr}"
    );
    assert_eq!(jr["preemptions"], 1, "{jr}");
    assert_eq!(task_ids(&jr).len(), 1, "not started again: {jr}");
    assert!(c.ok(&["jobs", "logs", &r]).contains("got-term"));
    assert_untouched(&c, &p, &p_task);
    assert_untouched(&c, &q, &q_task);

    // A job of the same priority as the running ones never preempts them.
    let e = trapper(&c, "e", 1, 0, &[]);
    let je = c.wait_job_until(&e, T, "it has a reason", |j| {
        !j["wait_reason"].is_null() || j["state"] != "QUEUED"
    });
    assert_eq!(je["state"], "QUEUED", "{je}");
    assert!(reason(&je).starts_with("Resources:"), "{je}");
    let preempted = try_wait_for(Duration::from_millis(1500), || {
        [&p, &q, &h]
            .iter()
            .any(|id| c.job(id)["state"] != "RUNNING")
            || c.job(&e)["state"] != "QUEUED"
    });
    assert!(
        !preempted,
        "an equal priority preempted\n{}",
        c.diagnostics()
    );
    assert_untouched(&c, &p, &p_task);
    assert_untouched(&c, &q, &q_task);
    let je = c.job(&e);
    assert!(reason(&je).starts_with("Resources:"), "{je}");
}

#[test]
fn preemption_of_several_victims_is_a_minimal_set() {
    let mut c = Cluster::start(&[]);
    agent(&mut c, "4xA100-SXM4-40GB");
    // Y (2 GPUs) first, then X1 (1), then X2 (1), all of priority 0.
    let y = trapper(&c, "y", 2, 0, &[]);
    running_task(&c, &y);
    let x1 = trapper(&c, "x1", 1, 0, &[]);
    let x1_task = running_task(&c, &x1);
    let x2 = trapper(&c, "x2", 1, 0, &[]);
    running_task(&c, &x2);

    // H needs 3 GPUs: no one victim frees that much. The most recently
    // started first (X2), then the one that covers the rest on its own (Y);
    // X1 is not needed.
    let h = trapper(&c, "h", 3, 1, &[]);
    c.wait_state(&h, "RUNNING", T);
    for v in [&x2, &y] {
        let j = c.wait_job_until(v, T, "requeued, saying why", |j| {
            j["state"] == "QUEUED" && !j["wait_reason"].is_null()
        });
        assert_eq!(j["preemptions"], 1, "{j}");
        assert!(reason(&j).starts_with(&format!("PREEMPTED by {h}")), "{j}");
    }
    assert_untouched(&c, &x1, &x1_task);
    let jh = c.job(&h);
    assert_eq!(jh["tasks"][0]["gpus"].as_array().unwrap().len(), 3, "{jh}");
}

/// `(agent id, hostname)` of every agent.
fn hostnames(c: &Cluster) -> Vec<(String, String)> {
    c.agents_json()
        .iter()
        .map(|a| {
            (
                a["id"].as_str().unwrap().to_string(),
                a["hostname"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn gang_starts_all_or_nothing_with_rank_env() {
    let mut c = Cluster::start(&[]);
    agent(&mut c, "2xA100-SXM4-40GB");
    agent(&mut c, "2xA100-SXM4-40GB");
    // The ranks write here, as the agents' task user.
    let out = gpuctl_tests::task_writable_dir(&c.dir.path().join("out"));
    let filler = trapper(&c, "filler", 1, 0, &[]);
    running_task(&c, &filler);

    let env = format!("OUT={}", out.display());
    let gang = c.submit(&[
        "--name",
        "gang",
        "--cpus",
        "0.1",
        "--gpus",
        "2",
        "--replicas",
        "2",
        "--env",
        &env,
        "--",
        "sh",
        "-c",
        "line=\"rank=$GPUCTL_RANK world=$GPUCTL_WORLD_SIZE peers=$GPUCTL_PEERS job=$GPUCTL_JOB_ID\"; \
         echo \"$line\"; echo \"$line\" > \"$OUT/rank-$GPUCTL_RANK\"",
    ]);
    // One agent has 1 GPU free: neither replica starts.
    let j = c.wait_job_until(&gang, T, "it has a reason", |j| {
        !j["wait_reason"].is_null() || j["state"] != "QUEUED"
    });
    assert_eq!(j["state"], "QUEUED", "{j}");
    assert_eq!(j["replicas"], 2, "{j}");
    assert!(reason(&j).starts_with("Resources:"), "{j}");
    let started = try_wait_for(Duration::from_millis(1500), || {
        !c.job(&gang)["tasks"].as_array().unwrap().is_empty()
    });
    assert!(!started, "a replica started alone: {}", c.job(&gang));
    let list = c.ok(&["jobs", "list"]);
    let row = list
        .lines()
        .find(|l| l.starts_with(&format!("{gang} ")))
        .unwrap_or_else(|| panic!("{gang} not listed:\n{list}"));
    assert!(row.split_whitespace().any(|w| w == "2x2"), "{row}");
    assert!(out.read_dir().unwrap().next().is_none());

    // Once the filler is gone both start, and both succeed.
    c.ok(&["jobs", "cancel", &filler]);
    assert_eq!(c.wait_job(&gang, 30), (0, "SUCCEEDED".to_string()));
    let j = c.job(&gang);
    let tasks = j["tasks"].as_array().unwrap();
    assert_eq!(task_ids(&j), vec![format!("{gang}.0"), format!("{gang}.1")]);
    let ranks: Vec<u64> = tasks.iter().map(|t| t["rank"].as_u64().unwrap()).collect();
    assert_eq!(ranks, vec![0, 1]);
    let agents: BTreeSet<&str> = tasks
        .iter()
        .map(|t| t["agent_id"].as_str().unwrap())
        .collect();
    assert_eq!(agents.len(), 2, "2 GPUs each: one replica per agent: {j}");
    for t in tasks {
        assert_eq!(t["state"], "FINISHED", "{j}");
        assert_eq!(t["exit_code"], 0, "{j}");
        assert_eq!(t["gpus"].as_array().unwrap().len(), 2, "{j}");
    }
    // GPUCTL_PEERS: the ranks' agents' hostnames, in rank order.
    let hosts = hostnames(&c);
    let host_of = |agent: &str| {
        hosts
            .iter()
            .find(|(id, _)| id == agent)
            .map(|(_, h)| h.clone())
            .unwrap()
    };
    let peers = tasks
        .iter()
        .map(|t| host_of(t["agent_id"].as_str().unwrap()))
        .collect::<Vec<_>>()
        .join(",");
    for rank in 0..2 {
        let line = std::fs::read_to_string(out.join(format!("rank-{rank}"))).unwrap();
        assert_eq!(
            line.trim(),
            format!("rank={rank} world=2 peers={peers} job={gang}"),
            "rank {rank}"
        );
        assert_eq!(peers.split(',').count(), 2);
    }
    // `jobs logs` shows the latest task's output.
    let logs = c.ok(&["jobs", "logs", &gang]);
    assert!(logs.contains("rank=1 world=2"), "{logs}");
}

#[test]
fn a_failed_rank_stops_the_gang_and_it_is_retried() {
    let mut c = Cluster::start(&[]);
    agent(&mut c, "4xA100-SXM4-40GB");
    // The ranks write here, as the agents' task user.
    let out = gpuctl_tests::task_writable_dir(&c.dir.path().join("out"));
    let env = format!("OUT={}", out.display());
    let gang = c.submit(&[
        "--name",
        "flaky",
        "--cpus",
        "0.1",
        "--gpus",
        "1",
        "--replicas",
        "2",
        "--max-retries",
        "1",
        "--env",
        &env,
        "--",
        "sh",
        "-c",
        "if [ \"$GPUCTL_RANK\" = 1 ]; then sleep 0.5; exit 3; fi; \
         readlink /proc/self/ns/pid > \"$OUT/ns-$GPUCTL_TASK_ID\"; exec sleep 120",
    ]);
    let (code, state) = c.wait_job(&gang, 35);
    let j = c.job(&gang);
    assert_eq!((code, state.as_str()), (1, "FAILED"), "{j}");
    assert_eq!(j["max_retries"], 1, "{j}");
    assert_eq!(j["retries"], 1, "{j}");
    assert_eq!(j["preemptions"], 0, "{j}");
    let ids: Vec<String> = (0..4).map(|n| format!("{gang}.{n}")).collect();
    assert_eq!(task_ids(&j), ids, "two attempts of two tasks: {j}");
    assert_eq!(
        j["message"],
        format!("rank 1 of 2: task {gang}.3 exited with code 3"),
        "{j}"
    );
    // Checked last (see the end of the test).
    let mut stop_messages = Vec::new();
    for (n, t) in j["tasks"].as_array().unwrap().iter().enumerate() {
        assert_eq!(t["rank"], n % 2, "{j}");
        if n % 2 == 1 {
            assert_eq!(t["exit_code"], 3, "{j}");
            assert_ne!(t["state"], "FINISHED", "{j}");
        } else {
            // Rank 0 was stopped because rank 1 failed.
            assert_eq!(t["state"], "KILLED", "{j}");
            stop_messages.push((
                t["message"].clone(),
                format!(
                    "stopped: rank 1 of 2: task {gang}.{} exited with code 3",
                    n + 1
                ),
            ));
            // It ran, and nothing of it is left: its PID namespace (which
            // it wrote down) is empty.
            let ns = std::fs::read_to_string(out.join(format!("ns-{gang}.{n}"))).unwrap();
            let left = gpuctl_tests::pid_ns_members(ns.trim());
            assert!(left.is_empty(), "rank 0 ({gang}.{n}) still runs: {left:?}");
        }
    }
    // Every GPU is free again.
    let gpus = c.json(&["gpus", "--json"]);
    assert!(
        gpus.as_array()
            .unwrap()
            .iter()
            .all(|g| g["task_id"].is_null()),
        "{gpus}"
    );

    // A gang that could never fit waits and says so.
    let big = trapper(&c, "big", 4, 0, &["--replicas", "3"]);
    let jb = c.wait_job_until(&big, T, "it has a reason", |j| {
        !j["wait_reason"].is_null() || j["state"] != "QUEUED"
    });
    assert_eq!(jb["state"], "QUEUED", "{jb}");
    assert_eq!(
        reason(&jb),
        "the agents cannot hold 3 replicas of 4 GPUs at once",
        "{jb}"
    );
    assert!(jb["tasks"].as_array().unwrap().is_empty(), "{jb}");
    assert_eq!(c.ok(&["jobs", "cancel", &big]).trim(), "CANCELLED");

    // A rank stopped for another's failure says so once it has ended (the
    // agent's own "killed" does not replace it).
    for (got, want) in stop_messages {
        assert_eq!(got, want, "message of a stopped rank 0: {j}");
    }
}

#[test]
fn a_job_over_the_jobs_quota_waits_with_a_quota_reason() {
    let mut c = Cluster::start(&["--role", "jobs=gpus:2"]);
    agent(&mut c, "4xA100-SXM4-40GB");
    let first = trapper(&c, "first", 2, 0, &[]);
    running_task(&c, &first);
    // A job that needs more than the quota leaves waits, whatever is free.
    let big = trapper(&c, "big", 3, 0, &[]);
    let j = c.wait_job_until(&big, T, "it has a reason", |j| {
        !j["wait_reason"].is_null() || j["state"] != "QUEUED"
    });
    assert_eq!(j["state"], "QUEUED", "{j}");
    assert_eq!(
        reason(&j),
        "Quota: the jobs role's quota: 2 GPUs in use + 3 asked > 2",
        "{j}"
    );
    c.ok(&["jobs", "cancel", &big]);
    // Two GPUs are free, but the jobs may hold only 2.
    let second = trapper(&c, "second", 2, 0, &[]);
    let j = c.wait_job_until(&second, T, "it has a reason", |j| {
        !j["wait_reason"].is_null() || j["state"] != "QUEUED"
    });
    assert_eq!(j["state"], "QUEUED", "{j}");
    assert!(reason(&j).starts_with("Quota:"), "{j}");
    assert!(reason(&j).contains("2 GPUs in use + 2 asked > 2"), "{j}");
    let started = try_wait_for(Duration::from_millis(1000), || {
        c.job(&second)["state"] != "QUEUED"
    });
    assert!(!started, "over quota but started: {}", c.job(&second));
    // Once the first is gone the second runs.
    c.ok(&["jobs", "cancel", &first]);
    c.wait_state(&second, "RUNNING", T);
}
