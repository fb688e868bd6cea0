//! Reclaim across tenants end to end (issue 35): real master, agent and
//! gpuctl, jobs as real processes. Tenant a fills an idle 8-GPU agent with
//! long jobs; tenant b comes later with as many. With reclaim on, the
//! master takes b's fair share (4 of 8, weights 1:1) back from a: each of
//! a's victims gets SIGTERM and writes its checkpoint before it is killed,
//! goes back to the queue without using a retry, and the GPUs go to b, not
//! back to a. From outside the master, every 50 ms: no GPU is held by two
//! live processes.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use gpuctl_tests::{AgentOpts, Cluster, Gpuctl, InvariantWatch};

const MARKER: &str = "GPUCTL_RECLAIM_TEST";

/// Live tasks per tenant, from /proc (each task's shell carries the
/// marker; its job id says whose it is).
fn live_by_tenant(value: &str, tenant_of: &BTreeMap<String, &str>) -> BTreeMap<String, usize> {
    let tasks: BTreeSet<String> = gpuctl_tests::live_tasks(MARKER, value)
        .into_iter()
        .map(|t| t.task_id)
        .collect();
    let mut out = BTreeMap::new();
    for t in tasks {
        let job = t.rsplit_once('.').map_or(t.as_str(), |(j, _)| j);
        if let Some(tenant) = tenant_of.get(job) {
            *out.entry(tenant.to_string()).or_default() += 1;
        }
    }
    out
}

/// Tenant `t`'s row of `gpuctl quota`'s table, by column.
fn quota_row(table: &str, t: &str) -> Vec<String> {
    table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(t))
        .unwrap_or_else(|| panic!("no row for {t}:\n{table}"))
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

#[test]
fn a_tenant_that_came_second_gets_its_fair_share_back_with_notice() {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipped: task cgroups need root");
        return;
    }
    let mut c = Cluster::start(&["--reclaim-min-runtime", "2s"]);
    c.add_agent(AgentOpts {
        simulate_gpus: Some("8xA100-SXM4-40GB"),
        ..AgentOpts::default()
    });
    let value = gpuctl_tests::test_marker("reclaim");
    let watch = InvariantWatch::start(MARKER, &value);
    let env = format!("{MARKER}={value}");
    // On SIGTERM: a checkpoint in its sandbox (its working directory),
    // then out.
    // The checkpoint holds the notice the agent wrote before SIGTERM.
    let script = "trap 'cat \"$GPUCTL_STOP_NOTICE\" > checkpoint; echo saved >> checkpoint; exit 143' TERM; \
                  sleep 600 & wait";
    let submit = |c: &Cluster, tenant: &str| {
        c.submit(&[
            "--name",
            tenant,
            "--tenant",
            tenant,
            "--gpus",
            "1",
            "--cpus",
            "0.1",
            "--max-retries",
            "0",
            "--env",
            &env,
            "--",
            "sh",
            "-c",
            script,
        ])
    };
    let a: Vec<String> = (0..8).map(|_| submit(&c, "a")).collect();
    for j in &a {
        c.wait_state(j, "RUNNING", Duration::from_secs(60));
    }
    // Past the minimum runtime before b comes.
    std::thread::sleep(Duration::from_secs(3));
    let b: Vec<String> = (0..8).map(|_| submit(&c, "b")).collect();
    let mut tenant_of: BTreeMap<String, &str> = BTreeMap::new();
    for j in &a {
        tenant_of.insert(j.clone(), "a");
    }
    for j in &b {
        tenant_of.insert(j.clone(), "b");
    }

    // 4 and 4, held for 3 s, within 30 s of b's jobs.
    let started = Instant::now();
    let mut since: Option<Instant> = None;
    let want = BTreeMap::from([("a".to_string(), 4), ("b".to_string(), 4)]);
    loop {
        let live = live_by_tenant(&value, &tenant_of);
        if live == want {
            if since.get_or_insert_with(Instant::now).elapsed() >= Duration::from_secs(3) {
                break;
            }
        } else {
            since = None;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no 4/4 within 30 s: live {live:?}\n{}",
            c.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("converged to 4/4 in {:?}", started.elapsed());

    // The victims: the youngest four of a, back in the queue, no retry
    // used; each got SIGTERM and wrote its checkpoint before the kill.
    let reclaimed: Vec<&String> = a.iter().filter(|j| c.job(j)["state"] == "QUEUED").collect();
    assert_eq!(reclaimed.len(), 4, "{}", c.diagnostics());
    for j in &reclaimed {
        let job = c.job(j);
        assert_eq!(job["retries"].as_u64().unwrap_or(0), 0, "{job}");
        let task = job["tasks"][0]["id"].as_str().unwrap().to_string();
        assert_eq!(job["tasks"][0]["reason"], "RECLAIMED", "{job}");
        let ckpt = c.dir.path().join(format!("agent0/tasks/{task}/checkpoint"));
        let saved = std::fs::read_to_string(&ckpt).unwrap_or_default();
        assert!(
            saved.ends_with("saved\n")
                && saved.contains("reason=reclaimed")
                && saved.contains("reclaimed for tenant b by job-"),
            "{j} wrote no checkpoint with its notice at {}: {saved:?}",
            ckpt.display()
        );
        let got = c.ok(&["jobs", "get", j]);
        assert!(
            got.contains("Reclaimed") && got.contains("reclaimed for tenant b"),
            "{got}"
        );
        // Waiting now: b is at its share, a at its own.
        let w = &job["wait_reason"];
        assert_ne!(w["kind"], "preempting", "{w}");
    }
    let mut youngest: Vec<&String> = a.iter().rev().take(4).collect();
    youngest.sort();
    let mut got = reclaimed.clone();
    got.sort();
    assert_eq!(got, youngest, "the youngest of a go first");
    // b's side of it.
    let b_events: String = b.iter().map(|j| c.ok(&["jobs", "get", j])).collect();
    assert!(b_events.contains("Reclaiming"), "{b_events}");

    // gpuctl quota: fair shares 4 and 4, nothing borrowed.
    let q = c.ok(&["quota"]);
    let row = |t: &str| quota_row(&q, t);
    // TENANT GPUS-USED QUOTA LIMIT WEIGHT FAIR-SHARE BORROWED LENT ...
    assert_eq!(&row("a")[1..6], ["4", "-", "-", "1", "4"], "{q}");
    assert_eq!(&row("b")[1..6], ["4", "-", "-", "1", "4"], "{q}");

    for j in a.iter().chain(&b) {
        c.ok(&["jobs", "cancel", j]);
    }
    watch.assert_held();
}

/// Quota that lends and borrows: b is guaranteed 6 GPUs, a 2 with up to 6
/// more borrowed. a fills the idle 8 (6 of them b's, lent); when b asks for
/// its 6 they come back, each within the victims' grace plus a queue pass
/// or two, and `gpuctl quota` says who borrowed and who lent.
#[test]
fn borrowed_gpus_go_back_to_their_owner_within_the_grace_and_a_round() {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipped: task cgroups need root");
        return;
    }
    let mut c = Cluster::start(&["--reclaim-min-runtime", "0s"]);
    c.add_agent(AgentOpts {
        simulate_gpus: Some("8xA100-SXM4-40GB"),
        ..AgentOpts::default()
    });
    c.ok(&["quota", "set", "a", "--gpus", "2", "--borrow", "6"]);
    c.ok(&["quota", "set", "b", "--gpus", "6"]);
    let value = gpuctl_tests::test_marker("borrow");
    let watch = InvariantWatch::start(MARKER, &value);
    let env = format!("{MARKER}={value}");
    let submit = |c: &Cluster, tenant: &str| {
        c.submit(&[
            "--name",
            tenant,
            "--tenant",
            tenant,
            "--gpus",
            "1",
            "--cpus",
            "0.1",
            "--env",
            &env,
            "--",
            "sh",
            "-c",
            "trap 'exit 143' TERM; sleep 600 & wait",
        ])
    };
    let a: Vec<String> = (0..8).map(|_| submit(&c, "a")).collect();
    for j in &a {
        c.wait_state(j, "RUNNING", Duration::from_secs(60));
    }
    let q = c.ok(&["quota"]);
    let cols = |t: &str| quota_row(&q, t);
    // TENANT USED QUOTA LIMIT WEIGHT SHARE BORROWED LENT ...
    assert_eq!(&cols("a")[1..8], ["8", "2", "8", "1", "8", "6", "0"], "{q}");
    assert_eq!(&cols("b")[1..8], ["0", "6", "6", "1", "0", "0", "6"], "{q}");

    let asked = Instant::now();
    let b: Vec<String> = (0..6).map(|_| submit(&c, "b")).collect();
    let mut tenant_of: BTreeMap<String, &str> = BTreeMap::new();
    for j in &a {
        tenant_of.insert(j.clone(), "a");
    }
    for j in &b {
        tenant_of.insert(j.clone(), "b");
    }
    let want = BTreeMap::from([("a".to_string(), 2), ("b".to_string(), 6)]);
    loop {
        if live_by_tenant(&value, &tenant_of) == want {
            break;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(30),
            "b never got its 6: {:?}\n{}",
            live_by_tenant(&value, &tenant_of),
            c.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let took = asked.elapsed();
    eprintln!("b had its 6 GPUs back {took:?} after asking");
    // Six victims, each stopped within the agents' 2 s grace (they exit on
    // SIGTERM at once), one reclaim per queue pass: well within 6 rounds of
    // a grace each.
    assert!(took < Duration::from_secs(12), "{took:?}");
    assert!(b.iter().all(|j| c.job(j)["state"] == "RUNNING"));
    let reclaimed = a.iter().filter(|j| c.job(j)["state"] == "QUEUED").count();
    assert_eq!(reclaimed, 6);
    // a is back at its quota, borrowing nothing; b at its own.
    let q2 = c.ok(&["quota"]);
    let cols = |t: &str| quota_row(&q2, t);
    assert_eq!(
        &cols("a")[1..8],
        ["2", "2", "8", "1", "2", "0", "0"],
        "{q2}"
    );
    assert_eq!(
        &cols("b")[1..8],
        ["6", "6", "6", "1", "6", "0", "0"],
        "{q2}"
    );
    for j in a.iter().chain(&b) {
        c.ok(&["jobs", "cancel", j]);
    }
    watch.assert_held();
}
