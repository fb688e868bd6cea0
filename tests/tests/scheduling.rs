//! GPU-aware placement on a real cluster (master and agents as processes,
//! simulated GPUs, host-process tasks): bundle keeps a whole agent free for
//! a big job, spread does the opposite, and GPU model, GPU memory and agent
//! attribute constraints decide where a job runs or say why it waits.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::time::Duration;

use gpuctl_tests::Gpuctl;
use gpuctl_tests::{AgentOpts, Cluster};

fn sleeper(c: &Cluster, name: &str, extra: &[&str]) -> String {
    let mut args = vec!["--name", name, "--cpus", "0.1"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sleep", "120"]);
    c.submit(&args)
}

fn agent_of(c: &Cluster, job: &str) -> String {
    let j = c.wait_state(job, "RUNNING", Duration::from_secs(30));
    j["tasks"][0]["agent_id"].as_str().unwrap().to_string()
}

fn agent_with(c: &mut Cluster, gpus: &str, attrs: &[&str]) -> String {
    let mut extra = Vec::new();
    for a in attrs {
        extra.push("--attribute".to_string());
        extra.push(a.to_string());
    }
    c.add_agent(AgentOpts {
        simulate_gpus: Some(gpus),
        extra,
        ..Default::default()
    })
}

#[test]
fn bundle_keeps_a_whole_agent_free_for_a_big_job() {
    let mut c = Cluster::start(&[]);
    for _ in 0..4 {
        c.add_agent(AgentOpts::default());
    }
    let small: Vec<String> = (0..3)
        .map(|i| sleeper(&c, &format!("small{i}"), &["--gpus", "1"]))
        .collect();
    let hosts: BTreeSet<String> = small.iter().map(|j| agent_of(&c, j)).collect();
    assert_eq!(hosts.len(), 1, "the small jobs share one agent: {hosts:?}");
    // Three whole agents are left: a 4-GPU job fits, and so does another.
    let big = sleeper(&c, "big", &["--gpus", "4"]);
    let big_host = agent_of(&c, &big);
    assert!(!hosts.contains(&big_host));
    let big2 = sleeper(&c, "big2", &["--gpus", "4"]);
    agent_of(&c, &big2);
    // A per-job spread goes to an agent with the most free GPUs (a whole one).
    let spread = sleeper(&c, "spread", &["--gpus", "1", "--placement", "spread"]);
    let spread_host = agent_of(&c, &spread);
    assert!(!hosts.contains(&spread_host) && spread_host != big_host);
}

#[test]
fn a_spread_cluster_spreads_small_jobs() {
    let mut c = Cluster::start(&["--placement", "spread"]);
    for _ in 0..2 {
        c.add_agent(AgentOpts::default());
    }
    let a = sleeper(&c, "a", &["--gpus", "1"]);
    let first = agent_of(&c, &a);
    let b = sleeper(&c, "b", &["--gpus", "1"]);
    assert_ne!(agent_of(&c, &b), first, "spread uses the emptier agent");
    // A per-job bundle packs next to a running job instead.
    let packed = sleeper(&c, "packed", &["--gpus", "1", "--placement", "bundle"]);
    agent_of(&c, &packed);
}

#[test]
fn gpu_model_memory_and_attributes_choose_the_agent_or_explain_the_wait() {
    let mut c = Cluster::start(&[]);
    let a100 = agent_with(&mut c, "4xA100-SXM4-40GB", &["zone=a"]);
    let h100 = agent_with(&mut c, "2xH100-SXM5-80GB", &["zone=b"]);

    let j = sleeper(&c, "model", &["--gpus", "1", "--gpu-model", "h100*"]);
    assert_eq!(agent_of(&c, &j), h100);
    let j = sleeper(&c, "memory", &["--gpus", "1", "--gpu-mem-min", "81920"]);
    assert_eq!(agent_of(&c, &j), h100);
    let j = sleeper(&c, "zone", &["--gpus", "1", "--constraint", "zone=a"]);
    assert_eq!(agent_of(&c, &j), a100);
    let j = sleeper(
        &c,
        "product",
        &[
            "--constraint",
            "nvidia.com/gpu.product=*A100*",
            "--gpus",
            "1",
        ],
    );
    assert_eq!(agent_of(&c, &j), a100);

    // What nothing can ever satisfy waits, and says why.
    for (args, why) in [
        (
            vec!["--gpus", "1", "--gpu-model", "B200*"],
            "no agent has GPU model B200*",
        ),
        (
            vec!["--gpus", "1", "--constraint", "zone=c"],
            "no agent has attribute zone=c",
        ),
        (
            vec!["--gpus", "3", "--gpu-model", "H100*"],
            "no agent has 3 GPUs of model H100* (at most 2)",
        ),
    ] {
        let id = sleeper(&c, "never", &args);
        let job = c.job_with_reason(&id);
        assert_eq!(job["state"], "QUEUED", "{job}");
        assert_eq!(job["reason"], why, "{job}");
        c.ok(&["jobs", "cancel", &id]);
    }
    // Both H100 GPUs are busy (the "model" and "memory" jobs): another H100
    // job waits for resources, not for a constraint.
    let id = sleeper(&c, "more", &["--gpus", "1", "--gpu-model", "H100*"]);
    let job = c.job_with_reason(&id);
    assert_eq!(job["state"], "QUEUED", "{job}");
    assert!(
        job["reason"].as_str().unwrap().starts_with("Resources"),
        "{job}"
    );

    // Bad input is refused naming the field.
    let out = c.gpuctl(&[
        "jobs",
        "submit",
        "--name",
        "x",
        "--constraint",
        "zone",
        "--",
        "true",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("KEY=VALUE"));
}

/// Four GPUs discovered through NVML (fake-nvml): 0-2 NVLinked, 1-3
/// NVLinked (not neighbours by index, so lowest-index choice would be
/// wrong), each pair on its own PCIe switch.
fn two_nvlink_pairs(dir: &std::path::Path) -> (std::path::PathBuf, Vec<String>) {
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(gpuctl_tests::fake_nvml_config("mixed")).unwrap(),
    )
    .unwrap();
    let gpus = cfg["gpus"].as_array_mut().unwrap();
    let bus: Vec<String> = gpus
        .iter()
        .map(|g| g["pci_bus_id"].as_str().unwrap().to_string())
        .collect();
    for (i, g) in gpus.iter_mut().enumerate() {
        let partner = i ^ 2;
        g["name"] = "NVIDIA A100-SXM4-40GB".into();
        g["memory_total_mib"] = 40960.into();
        g["pci_switch"] = format!("sw{}", i % 2).into();
        g["nvlinks"] = serde_json::json!([bus[partner], bus[partner]]);
    }
    let uuids = gpus
        .iter()
        .map(|g| g["uuid"].as_str().unwrap().to_string())
        .collect();
    let path = dir.join("two-pairs.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    (path, uuids)
}

fn gpus_of(c: &Cluster, job: &str) -> BTreeSet<String> {
    let j = c.wait_state(job, "RUNNING", Duration::from_secs(30));
    j["tasks"][0]["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn gpus_are_chosen_by_nvlink_topology() {
    let mut c = Cluster::start(&[]);
    let (cfg, uuids) = two_nvlink_pairs(c.dir.path());
    c.add_agent(AgentOpts {
        simulate_gpus: None,
        extra: vec![
            "--nvml-lib".into(),
            gpuctl_tests::fake_nvml_lib().display().to_string(),
        ],
        env: vec![("FAKE_NVML_CONFIG".into(), cfg.display().to_string())],
        ..Default::default()
    });
    let set =
        |ids: &[usize]| -> BTreeSet<String> { ids.iter().map(|i| uuids[*i].clone()).collect() };
    // The first 1-GPU task takes GPU 0; the second takes its NVLink partner,
    // GPU 2, rather than GPU 1, which would break up the 1-3 pair.
    let a = sleeper(&c, "a", &["--gpus", "1"]);
    assert_eq!(gpus_of(&c, &a), set(&[0]));
    let b = sleeper(&c, "b", &["--gpus", "1"]);
    assert_eq!(gpus_of(&c, &b), set(&[2]));
    // So a 2-GPU task still gets an NVLinked pair.
    let pair = sleeper(&c, "pair", &["--gpus", "2"]);
    assert_eq!(gpus_of(&c, &pair), set(&[1, 3]));
}

#[test]
fn a_cordoned_gpu_gets_no_new_task_until_uncordoned() {
    let mut c = Cluster::start(&[]);
    agent_with(&mut c, "1xA100", &[]);
    let gpus = c.json(&["gpus", "--json"]);
    let uuid = gpus[0]["uuid"].as_str().unwrap().to_string();
    let out = c.ok(&["gpus", "cordon", &uuid]);
    assert!(out.contains("CORDONED"), "{out}");
    assert_eq!(c.json(&["gpus", "--json"])[0]["cordoned"], true);
    let job = sleeper(&c, "waits", &["--gpus", "1"]);
    std::thread::sleep(Duration::from_millis(1500));
    let j = c.job(&job);
    assert_eq!(j["state"], "QUEUED", "{j}");
    assert!(
        j["reason"].as_str().unwrap().starts_with("Resources:"),
        "{j}"
    );
    // An unknown GPU is refused, naming the field.
    let bad = c.gpuctl(&["gpus", "cordon", "GPU-nope"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("uuid"));
    let g = c.json(&["gpus", "uncordon", &uuid, "--json"]);
    assert_eq!(
        (g["uuid"].as_str(), &g["cordoned"]),
        (Some(uuid.as_str()), &false.into()),
        "{g}"
    );
    agent_of(&c, &job);
}
