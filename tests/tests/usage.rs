//! Issue 39, item 1: accounting that adds up and survives failover. Real
//! masters (three, Raft) and an agent over loopback; the tasks write their
//! own start and end times, and `gpuctl usage` must charge each job its
//! GPUs times at least that long (launch to end), and not much more; the
//! views agree with each other, and every master answers the same after
//! the leader is SIGKILLed.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use gpuctl_tests::{AgentOpts, Gpuctl, HaCluster};
use serde_json::Value;

/// Milliseconds since the epoch written by a task, from `path`.
fn stamp(path: &std::path::Path) -> u64 {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .parse()
        .unwrap()
}

fn report(c: &HaCluster, masters: &str, by: &str) -> Value {
    serde_json::from_str(&c.ok_at(masters, &["usage", "--since", "1d", "--by", by, "--json"]))
        .unwrap()
}

/// The row of `key`'s `field`.
fn field(r: &Value, key: &str, field: &str) -> u64 {
    r["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|row| row["key"] == key)
        .unwrap_or_else(|| panic!("no row {key}: {r}"))[field]
        .as_u64()
        .unwrap()
}

#[test]
fn usage_adds_up_to_what_ran_and_every_master_agrees_after_failover() {
    let mut c = HaCluster::start(3, &[]);
    c.add_agent(AgentOpts {
        simulate_gpus: Some("4xA100-SXM4-40GB"),
        ..Default::default()
    });
    let out = gpuctl_tests::task_writable_dir(&c.dir.path().join("out"));
    let timed = |name: &str, secs: &str| {
        format!(
            "date +%s%3N > {o}/{name}.start; sleep {secs}; date +%s%3N > {o}/{name}.end",
            o = out.display()
        )
    };
    // Two GPUs for ~3 s, one GPU for ~1 s, a CPU-only task for ~1 s.
    let two = c.submit(&[
        "--name",
        "two",
        "--gpus",
        "2",
        "--cpus",
        "1",
        "--mem",
        "256",
        "--",
        "sh",
        "-c",
        &timed("two", "3"),
    ]);
    let one = c.submit(&[
        "--name",
        "one",
        "--gpus",
        "1",
        "--cpus",
        "0.5",
        "--mem",
        "128",
        "--",
        "sh",
        "-c",
        &timed("one", "1"),
    ]);
    let cpu = c.submit(&[
        "--name",
        "cpu",
        "--cpus",
        "0.25",
        "--mem",
        "64",
        "--",
        "sh",
        "-c",
        &timed("cpu", "1"),
    ]);
    for j in [&two, &one, &cpu] {
        c.wait_state(j, "SUCCEEDED", Duration::from_secs(60));
    }
    let leader = c.leader_id();
    let at_leader = c.addr(leader).to_string();
    let by_job = report(&c, &at_leader, "job");
    // Each job is charged its GPUs (and CPUs, memory) for at least the
    // time its command ran, and at most that plus the launch (a few
    // seconds on a loaded machine).
    let slack_ms = 10_000;
    for (job, name, gpus, cpu_milli, mem) in [
        (&two, "two", 2, 1000, 256),
        (&one, "one", 1, 500, 128),
        (&cpu, "cpu", 0, 250, 64),
    ] {
        let ran =
            stamp(&out.join(format!("{name}.end"))) - stamp(&out.join(format!("{name}.start")));
        // Memory is charged exactly per ms: it says how long was charged.
        let charged_ms = field(&by_job, job, "mem_mib_ms") / mem;
        assert!(
            charged_ms >= ran && charged_ms <= ran + slack_ms,
            "{name}: ran {ran} ms, charged {charged_ms} ms: {by_job}"
        );
        assert_eq!(field(&by_job, job, "mem_mib_ms"), mem * charged_ms);
        assert_eq!(field(&by_job, job, "gpu_ms"), gpus * charged_ms, "{by_job}");
        assert_eq!(
            field(&by_job, job, "cpu_ms"),
            cpu_milli * charged_ms / 1000,
            "{by_job}"
        );
        assert_eq!(field(&by_job, job, "tasks"), 1, "{by_job}");
        assert_eq!(field(&by_job, job, "running"), 0, "{by_job}");
    }
    // The ledger (by model, by tenant) holds the same sums as the jobs.
    let jobs_gpu: u64 = [&two, &one]
        .iter()
        .map(|j| field(&by_job, j, "gpu_ms"))
        .sum();
    let by_model = report(&c, &at_leader, "gpu-model");
    let model = by_model["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["key"].as_str().unwrap().contains("A100"))
        .unwrap_or_else(|| panic!("no A100 row: {by_model}"));
    assert_eq!(model["gpu_ms"].as_u64().unwrap(), jobs_gpu, "{by_model}");
    assert_eq!(model["tasks"], 2, "{by_model}");
    assert_eq!(field(&by_model, "", "tasks"), 1, "the CPU task: {by_model}");
    let by_tenant = report(&c, &at_leader, "tenant");
    assert_eq!(
        field(&by_tenant, "default", "gpu_ms"),
        jobs_gpu,
        "{by_tenant}"
    );
    assert_eq!(field(&by_tenant, "default", "tasks"), 3, "{by_tenant}");
    // The table says the same in hours.
    let table = c.ok_at(&at_leader, &["usage", "--by", "gpu-model"]);
    assert!(
        table.contains("GPU-HOURS") && table.contains("TOTAL"),
        "{table}"
    );
    let csv = c.ok_at(&at_leader, &["usage", "--by", "job", "--csv"]);
    assert!(csv.starts_with("job,tenant,gpu_hours,"), "{csv}");
    assert_eq!(csv.lines().count(), 4, "{csv}");
    // The leader dies: every master left answers, with the same numbers.
    c.kill_master(leader);
    c.wait_new_leader(leader);
    for (&id, m) in &c.masters {
        if id == leader {
            continue;
        }
        let again = report(&c, &m.addr, "tenant");
        assert_eq!(
            field(&again, "default", "gpu_ms"),
            jobs_gpu,
            "master {id}: {again}"
        );
        assert_eq!(field(&again, "default", "tasks"), 3, "master {id}: {again}");
    }
    // A bad grouping is refused, naming the flag.
    let bad = gpuctl_tests::gpuctl_at(&c.live_addrs(), &["usage", "--by", "team"]);
    assert_eq!(bad.status.code(), Some(2));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("--by"), "{err}");
}
