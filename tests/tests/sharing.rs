//! Fractions of a shared GPU end to end (issue 34, the scheduling part):
//! real master, agent and gpuctl binaries, one simulated A100 of 40 GiB
//! marked shareable. Four quarter jobs run at once on it, a fifth waits,
//! a whole-GPU job is never given it, and an agent SIGKILLed under the
//! shared tasks comes back to the same count. The agent's enforcement
//! (MPS, the driver's memory cap) is not built yet: `mps` is refused.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use gpuctl_tests::{wait_for, AgentOpts, Cluster, Gpuctl};

fn quarter(c: &Cluster, name: &str) -> String {
    c.submit(&[
        "--name",
        name,
        "--gpu-mem",
        "10GiB",
        "--cpus",
        "0.1",
        "--",
        "sleep",
        "600",
    ])
}

#[test]
fn four_quarters_share_a_gpu_and_the_fifth_waits() {
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts {
        simulate_gpus: Some("1xA100-SXM4-40GB"),
        // The shared tasks must outlive the agent's SIGKILL below.
        stop_tasks_on_shutdown: false,
        ..Default::default()
    });
    let gpus = c.json(&["gpus", "--json"]);
    let uuid = gpus[0]["uuid"].as_str().unwrap().to_string();

    // MPS is not enforced yet: refused, saying so.
    let out = c.gpuctl(&["gpus", "share", &uuid, "--mode", "mps"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not built yet"), "{err}");
    c.ok(&["gpus", "share", &uuid, "--mode", "time-slice"]);

    let jobs: Vec<String> = (0..4).map(|i| quarter(&c, &format!("q{i}"))).collect();
    for j in &jobs {
        c.wait_state(j, "RUNNING", Duration::from_secs(30));
    }
    let fifth = quarter(&c, "q4");
    let whole = c.submit(&[
        "--name", "whole", "--gpus", "1", "--cpus", "0.1", "--", "true",
    ]);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(c.job(&fifth)["state"], "QUEUED");
    assert_eq!(c.job(&whole)["state"], "QUEUED", "a shared GPU given whole");
    let shares = |c: &Cluster| {
        c.json(&["gpus", "--json"])[0]["shares"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    assert_eq!(shares(&c).len(), 4);
    let table = c.ok(&["gpus"]);
    assert!(table.contains("SHARED (time-slice)"), "{table}");
    assert_eq!(table.matches("└ share").count(), 4, "{table}");
    let got = c.ok(&["jobs", "get", &jobs[0]]);
    assert!(
        got.contains("a fraction of a shared GPU each: 10GiB"),
        "{got}"
    );
    // Each task says what its agent enforces of it: nothing, yet.
    assert_eq!(c.job(&jobs[0])["tasks"][0]["enforcement"], "none");
    assert!(
        got.contains(&format!("Enforcement of {}.0: none", jobs[0])),
        "{got}"
    );

    // The agent SIGKILLed under them: they run on, and the count holds.
    c.restart_agent(0);
    wait_for(Duration::from_secs(30), "the agent back", || {
        c.agents_json()
            .first()
            .is_some_and(|a| a["state"] == "ACTIVE")
    });
    for j in &jobs {
        assert_eq!(c.job(j)["state"], "RUNNING", "{}", c.diagnostics());
    }
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(c.job(&fifth)["state"], "QUEUED");
    assert_eq!(shares(&c).len(), 4);

    // One ends: the fifth takes its place.
    c.ok(&["jobs", "cancel", &jobs[0]]);
    c.wait_state(&fifth, "RUNNING", Duration::from_secs(30));
    assert_eq!(c.job(&whole)["state"], "QUEUED");
    for j in jobs.iter().skip(1).chain([&fifth, &whole]) {
        c.ok(&["jobs", "cancel", j]);
    }
}
