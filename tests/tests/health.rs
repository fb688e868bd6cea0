//! GPU health checks and metrics, end to end: a real master and agent, the
//! agent's GPUs discovered through fake-nvml, faults injected by rewriting
//! fake-nvml's machine description while the agent runs (it re-reads it on
//! every call, and delivers the `events` it lists).
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuctl_tests::{free_port, try_wait_for, wait_for, AgentOpts, Cluster, Gpuctl};
use serde_json::{json, Value};

const GPU0: &str = "GPU-0c5e6a3e-0000-4000-8000-000000000000";
const GPU1: &str = "GPU-0c5e6a3e-0000-4000-8000-000000000001";

/// Two A100s; GPU 1 busy at 87% with 12 GiB used.
fn machine() -> Value {
    json!({
        "gpus": [
            { "uuid": GPU0, "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960,
              "temperature_c": 41, "power_mw": 61000 },
            { "uuid": GPU1, "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960,
              "memory_used_mib": 12288, "utilization_gpu_pct": 87,
              "temperature_c": 67, "power_mw": 250500 }
        ],
        "events": []
    })
}

/// Replaces the file at once (write then rename), so fake-nvml never
/// reads half a description.
fn write_machine(path: &Path, m: &Value) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(m).unwrap()).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

struct Setup {
    c: Cluster,
    machine_path: PathBuf,
    machine: Value,
    master_metrics: String,
    agent_metrics: String,
}

impl Setup {
    /// A master and one agent with fast health checks; `recovery_secs` is
    /// the agent's hysteresis.
    fn start(recovery_secs: &str) -> Setup {
        // No resets: a GPU that needs one stays out, as these tests want.
        Setup::start_with(recovery_secs, &["--gpu-reset-command", "none"])
    }

    /// `start`, with more agent flags.
    fn start_with(recovery_secs: &str, more: &[&str]) -> Setup {
        Setup::start_on(machine(), recovery_secs, more)
    }

    /// `start_with` on another machine.
    fn start_on(machine: Value, recovery_secs: &str, more: &[&str]) -> Setup {
        let master_metrics = format!("127.0.0.1:{}", free_port());
        let mut c = Cluster::start(&["--metrics-listen", &master_metrics]);
        let machine_path = c.dir.path().join("machine.json");
        write_machine(&machine_path, &machine);
        let agent_metrics = format!("127.0.0.1:{}", free_port());
        c.add_agent(AgentOpts {
            simulate_gpus: None,
            extra: vec![
                "--nvml-lib".into(),
                gpuctl_tests::fake_nvml_lib().display().to_string(),
                "--health-interval-secs".into(),
                "0.2".into(),
                "--health-recovery-secs".into(),
                recovery_secs.into(),
                "--metrics-listen".into(),
                agent_metrics.clone(),
                "--mps-control".into(),
                gpuctl_tests::fake_mps_control().display().to_string(),
            ]
            .into_iter()
            .chain(more.iter().map(|a| a.to_string()))
            .collect(),
            env: vec![(
                "FAKE_NVML_CONFIG".into(),
                machine_path.display().to_string(),
            )],
            ..Default::default()
        });
        Setup {
            c,
            machine_path,
            machine,
            master_metrics,
            agent_metrics,
        }
    }

    fn change(&mut self, f: impl FnOnce(&mut Value)) {
        f(&mut self.machine);
        write_machine(&self.machine_path, &self.machine);
    }

    fn gpu(&self, uuid: &str) -> Value {
        let all = self.c.json(&["gpus", "--json"]);
        all.as_array()
            .unwrap()
            .iter()
            .find(|g| g["uuid"] == uuid)
            .cloned()
            .unwrap_or_else(|| panic!("no GPU {uuid} in {all}"))
    }

    fn wait_health(&self, uuid: &str, healthy: bool) -> Value {
        let mut last = Value::Null;
        let ok = try_wait_for(Duration::from_secs(20), || {
            last = self.gpu(uuid);
            last["healthy"] == healthy
        });
        assert!(
            ok,
            "GPU {uuid} never became healthy={healthy}; last {last}\n{}",
            self.c.diagnostics()
        );
        last
    }

    /// Starts a sleeping 1-GPU job and returns (job id, its GPU).
    fn sleeper(&self, name: &str) -> (String, String) {
        let id = self
            .c
            .submit(&["--name", name, "--gpus", "1", "--", "sleep", "600"]);
        let j = self.c.wait_state(&id, "RUNNING", Duration::from_secs(30));
        let gpu = j["tasks"][0]["gpus"][0].as_str().unwrap().to_string();
        (id, gpu)
    }
}

/// GET http://addr/path; panics unless 200.
fn http_get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    body.to_string()
}

/// A scrape parsed by an independent parser (prometheus-parse).
struct Scrape(prometheus_parse::Scrape);

impl Scrape {
    fn get(addr: &str) -> Scrape {
        let body = http_get(addr, "/metrics");
        let lines = body.lines().map(|l| Ok(l.to_string()));
        Scrape(prometheus_parse::Scrape::parse(lines).expect("valid Prometheus text"))
    }

    /// The value of the one sample of `metric` whose labels include `labels`.
    fn value(&self, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut found = self.0.samples.iter().filter(|s| {
            s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v))
        });
        let s = found.next()?;
        assert!(found.next().is_none(), "more than one {metric} {labels:?}");
        match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => Some(v),
            ref other => panic!("{metric}: unexpected {other:?}"),
        }
    }

    fn labels_of(&self, metric: &str, uuid: &str) -> HashMap<String, String> {
        let s = self
            .0
            .samples
            .iter()
            .find(|s| s.metric == metric && s.labels.get("uuid") == Some(uuid))
            .unwrap_or_else(|| panic!("no {metric} for {uuid}"));
        ["uuid", "index", "model", "task", "job"]
            .iter()
            .filter_map(|k| s.labels.get(k).map(|v| (k.to_string(), v.to_string())))
            .collect()
    }

    fn help(&self, metric: &str) -> bool {
        self.0.docs.contains_key(metric)
    }
}

/// A lost GPU: its task fails with GPU_UNHEALTHY, the job is requeued onto
/// the other GPU, the GPU is shown unhealthy with the reason; once found
/// again it returns, but not before the recovery time.
#[test]
fn a_lost_gpu_fails_its_task_requeues_the_job_and_comes_back_after_recovery() {
    let mut s = Setup::start("3");
    let (job, first) = s.sleeper("train");
    let other = if first == GPU0 { GPU1 } else { GPU0 };
    let index = if first == GPU0 { 0 } else { 1 };
    s.change(|m| m["gpus"][index]["lost"] = true.into());

    let g = s.wait_health(&first, false);
    assert!(
        g["unhealthy_reason"]
            .as_str()
            .unwrap()
            .contains("GPU is lost"),
        "{g}"
    );
    // The job runs again, on the other GPU, without using up a retry.
    let mut j = Value::Null;
    let moved = try_wait_for(Duration::from_secs(30), || {
        j = s.c.job(&job);
        j["state"] == "RUNNING" && j["tasks"].as_array().unwrap().len() == 2
    });
    assert!(moved, "job not requeued: {j}\n{}", s.c.diagnostics());
    let failed = &j["tasks"][0];
    assert_eq!(failed["state"], "FAILED", "{j}");
    assert_eq!(failed["reason"], "GPU_UNHEALTHY", "{j}");
    let msg = failed["message"].as_str().unwrap();
    assert!(msg.contains(&format!("GPU {first} unhealthy")), "{msg}");
    assert_eq!(j["tasks"][1]["gpus"][0], other, "{j}");
    assert_eq!(j["retries"], 0, "{j}");

    // `gpuctl top` shows the readings of the GPU in use and its task.
    let top = s.c.json(&["top", "--once", "--json"]);
    let row = top
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["uuid"] == other)
        .cloned()
        .unwrap();
    assert_eq!(row["job_id"], job.as_str(), "{row}");
    assert_eq!(row["task_id"], j["tasks"][1]["id"], "{row}");
    if other == GPU1 {
        assert_eq!(row["utilization_pct"], 87, "{row}");
        assert_eq!(row["memory_used_mib"], 12288, "{row}");
        assert_eq!(row["temperature_c"], 67, "{row}");
    }

    // Found again: back in service, after the recovery time and not before.
    let found_at = Instant::now();
    s.change(|m| m["gpus"][index]["lost"] = false.into());
    let g = s.wait_health(&first, true);
    assert!(
        found_at.elapsed() >= Duration::from_secs(3),
        "back after {:?}, before the 3 s recovery",
        found_at.elapsed()
    );
    assert_eq!(g["unhealthy_reason"], "", "{g}");
    // And it takes work again.
    let (_, gpu) = s.sleeper("after");
    assert_eq!(gpu, first);
}

/// NVML events: an application's XID 13 is counted but changes nothing;
/// XID 79 and a double-bit ECC error withdraw their GPUs and fail the task
/// on them; the metrics of agent and master say so.
#[test]
fn critical_events_withdraw_gpus_ignored_xids_do_not_and_metrics_show_it() {
    let mut s = Setup::start("3600");
    let (job, gpu) = s.sleeper("victim");
    let index = if gpu == GPU0 { 0 } else { 1 };
    let (other, other_index) = if gpu == GPU0 { (GPU1, 1) } else { (GPU0, 0) };
    s.change(|m| m["events"] = json!([{ "id": 1, "gpu_index": index, "type": "xid", "data": 13 }]));
    let xid = |s: &Setup, uuid: &str, code: &str| {
        Scrape::get(&s.agent_metrics).value(
            "gpuctl_gpu_xid_errors_total",
            &[("uuid", uuid), ("xid", code)],
        )
    };
    wait_for(Duration::from_secs(20), "XID 13 counted", || {
        xid(&s, &gpu, "13") == Some(1.0)
    });
    assert_eq!(s.gpu(&gpu)["healthy"], true);
    assert_eq!(s.c.job(&job)["state"], "RUNNING");

    // The free GPU first, so that the job has nowhere to go afterwards.
    s.change(|m| {
        m["events"] = json!([
            { "id": 1, "gpu_index": index, "type": "xid", "data": 13 },
            { "id": 3, "gpu_index": other_index, "type": "double_bit_ecc" }
        ])
    });
    let g = s.wait_health(other, false);
    assert_eq!(
        g["unhealthy_reason"], "double-bit ECC error: the GPU needs a reset",
        "{g}"
    );
    assert_eq!(s.c.job(&job)["state"], "RUNNING");
    s.change(|m| {
        m["events"] = json!([
            { "id": 1, "gpu_index": index, "type": "xid", "data": 13 },
            { "id": 2, "gpu_index": index, "type": "xid", "data": 79 },
            { "id": 3, "gpu_index": other_index, "type": "double_bit_ecc" }
        ])
    });
    let g = s.wait_health(&gpu, false);
    assert_eq!(
        g["unhealthy_reason"], "XID 79 (GPU has fallen off the bus): the GPU needs a reset",
        "{g}"
    );
    // Its task failed; with no healthy GPU left, the job waits, saying why.
    s.c.wait_state(&job, "QUEUED", Duration::from_secs(30));
    let j = s.c.job_with_reason(&job);
    assert_eq!(j["tasks"][0]["reason"], "GPU_UNHEALTHY", "{j}");
    let reason = j["reason"].as_str().unwrap();
    assert!(
        reason.contains("requeued after task") && reason.contains("XID 79"),
        "{reason}"
    );

    // The agent's metrics.
    let a = Scrape::get(&s.agent_metrics);
    for uuid in [GPU0, GPU1] {
        assert_eq!(a.value("gpuctl_gpu_healthy", &[("uuid", uuid)]), Some(0.0));
        let l = a.labels_of("gpuctl_gpu_healthy", uuid);
        assert_eq!(l["model"], "NVIDIA A100-SXM4-40GB");
        assert_eq!(l["index"], if uuid == GPU0 { "0" } else { "1" });
        assert_eq!(l["task"], "", "no task on a failed GPU");
        assert_eq!(
            a.value("gpuctl_gpu_memory_total_bytes", &[("uuid", uuid)]),
            Some(40960.0 * 1024.0 * 1024.0)
        );
    }
    assert_eq!(
        a.value("gpuctl_gpu_utilization_ratio", &[("uuid", GPU1)]),
        Some(0.87)
    );
    assert_eq!(
        a.value("gpuctl_gpu_memory_used_bytes", &[("uuid", GPU1)]),
        Some(12288.0 * 1024.0 * 1024.0)
    );
    assert_eq!(
        a.value("gpuctl_gpu_temperature_celsius", &[("uuid", GPU0)]),
        Some(41.0)
    );
    assert_eq!(
        a.value("gpuctl_gpu_power_watts", &[("uuid", GPU1)]),
        Some(250.5)
    );
    assert_eq!(xid(&s, &gpu, "79"), Some(1.0));
    assert_eq!(
        a.value("gpuctl_gpu_double_bit_ecc_errors_total", &[("uuid", other)]),
        Some(1.0)
    );
    assert_eq!(a.value("gpuctl_agent_tasks_running", &[]), Some(0.0));
    assert!(a.help("gpuctl_gpu_healthy"));

    // The master's.
    let m = Scrape::get(&s.master_metrics);
    assert_eq!(m.value("gpuctl_raft_leader", &[]), Some(1.0));
    assert!(m.value("gpuctl_raft_term", &[]).unwrap() >= 1.0);
    assert!(m.value("gpuctl_raft_commit_index", &[]).unwrap() >= 1.0);
    assert_eq!(m.value("gpuctl_agents", &[("state", "active")]), Some(1.0));
    assert_eq!(m.value("gpuctl_gpus", &[]), Some(2.0));
    assert_eq!(m.value("gpuctl_gpus_unhealthy", &[]), Some(2.0));
    assert_eq!(m.value("gpuctl_gpus_allocated", &[]), Some(0.0));
    assert_eq!(m.value("gpuctl_jobs", &[("state", "queued")]), Some(1.0));
    assert_eq!(m.value("gpuctl_jobs", &[("state", "running")]), Some(0.0));
    // Alone, the built-in scheduler places without offers.
    assert!(m.value("gpuctl_offers_total", &[]).is_some());
    assert!(
        m.value("gpuctl_scheduler_direct_launches_total", &[])
            .unwrap()
            >= 1.0
    );
    assert!(m.value("gpuctl_task_launch_seconds_count", &[]).unwrap() >= 1.0);
    assert!(
        m.value("gpuctl_allocation_cycle_seconds_count", &[])
            .unwrap()
            >= 1.0
    );
    assert!(m.help("gpuctl_allocation_cycle_seconds"));
}

/// Issue 38: faults handled by what they are. An XID 79 takes its GPU
/// away (it also falls off the bus: the fake answers GPU_IS_LOST), its task
/// is requeued without using a retry and runs on the other GPU; once
/// nothing runs on the GPU the agent resets it (a reset command that puts
/// the fake GPU back on the bus) and it returns after its probe. An XID 13
/// (the application's own error) leaves its GPU and task alone.
#[test]
fn an_xid_79_gpu_is_reset_once_idle_and_an_xid_13_changes_nothing() {
    let dir = gpuctl_tests::test_dir();
    let log = dir.path().join("resets");
    let machine = dir.path().join("machine-ref");
    // The reset: logs the GPU, waits a little (the requeued task is placed
    // meanwhile), then puts the GPU back on the bus in fake-nvml's file.
    let script = dir.path().join("reset.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho \"$1\" >> {log}\nsleep 1\nm=$(cat {machine})\n\
             sed 's/\"lost\": true/\"lost\": false/' \"$m\" > \"$m.reset\" && mv \"$m.reset\" \"$m\"\n",
            log = log.display(),
            machine = machine.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let reset = format!("{} {{uuid}}", script.display());
    let mut s = Setup::start_with("3600", &["--gpu-reset-command", &reset]);
    std::fs::write(&machine, s.machine_path.display().to_string()).unwrap();

    let (job, first) = s.sleeper("train");
    let index = if first == GPU0 { 0 } else { 1 };
    let other = if first == GPU0 { GPU1 } else { GPU0 };
    s.change(|m| {
        m["gpus"][index]["lost"] = true.into();
        m["events"] = json!([{ "id": 1, "gpu_index": index, "type": "xid", "data": 79 }]);
    });
    // Requeued without a retry, and running on the other GPU.
    let mut j = Value::Null;
    let moved = try_wait_for(Duration::from_secs(30), || {
        j = s.c.job(&job);
        j["state"] == "RUNNING" && j["tasks"].as_array().unwrap().len() == 2
    });
    assert!(moved, "job not requeued: {j}\n{}", s.c.diagnostics());
    assert_eq!(j["tasks"][0]["reason"], "GPU_UNHEALTHY", "{j}");
    let msg = j["tasks"][0]["message"].as_str().unwrap();
    assert!(
        msg.contains("XID 79") && msg.contains("needs a reset"),
        "{msg}"
    );
    assert_eq!(j["tasks"][1]["gpus"][0], other, "{j}");
    assert_eq!(j["retries"], 0, "{j}");
    // Reset once, after its task ended, and back in service.
    let g = s.wait_health(&first, true);
    assert_eq!(g["unhealthy_reason"], "", "{g}");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), format!("{first}\n"));

    // The application's own XID on the GPU in use: counted, nothing else.
    s.change(|m| {
        m["events"] = json!([
            { "id": 1, "gpu_index": index, "type": "xid", "data": 79 },
            { "id": 2, "gpu_index": 1 - index, "type": "xid", "data": 13 }
        ]);
    });
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(s.gpu(other)["healthy"], true);
    let j = s.c.job(&job);
    assert_eq!(j["state"], "RUNNING", "{j}");
    assert_eq!(j["tasks"].as_array().unwrap().len(), 2, "{j}");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), format!("{first}\n"));
}

/// Issue 38, item 6: an XID 79 on one rank's GPU. The gang (2 ranks, no
/// retries) is stopped whole and started again on GPUs that work, without
/// using a retry; the GPU is reset once idle and comes back; no GPU is ever
/// held by two live tasks, and only one attempt's ranks live at a time
/// (seen from /proc).
#[test]
fn an_xid_79_on_a_ranks_gpu_restarts_the_gang_on_other_gpus() {
    let dir = gpuctl_tests::test_dir();
    let machine_ref = dir.path().join("machine-ref");
    let script = dir.path().join("reset.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nsleep 1\nm=$(cat {machine})\n\
             sed 's/\"lost\": true/\"lost\": false/' \"$m\" > \"$m.reset\" && mv \"$m.reset\" \"$m\"\n",
            machine = machine_ref.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let uuid = |i: u32| format!("GPU-0c5e6a3e-0000-4000-8000-00000000010{i}");
    let four = json!({
        "gpus": (0..4).map(|i| json!({
            "uuid": uuid(i), "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960
        })).collect::<Vec<_>>(),
        "events": []
    });
    let reset = format!("{} {{uuid}}", script.display());
    let mut s = Setup::start_on(four, "3600", &["--gpu-reset-command", &reset]);
    std::fs::write(&machine_ref, s.machine_path.display().to_string()).unwrap();
    let mark = format!("{}-xid-gang", std::process::id());
    let env_mark = format!("GPUCTL_TEST_XID_GANG={mark}");
    let gang = s.c.submit(&[
        "--name",
        "gang",
        "--gpus",
        "1",
        "--replicas",
        "2",
        "--env",
        &env_mark,
        "--",
        "sleep",
        "600",
    ]);
    let j = s.c.wait_state(&gang, "RUNNING", Duration::from_secs(30));
    let first: Vec<String> = (0..2)
        .map(|r| j["tasks"][r]["gpus"][0].as_str().unwrap().to_string())
        .collect();
    let failing = first[1].clone();
    let index = (0..4).find(|i| uuid(*i) == failing).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (stop, mark) = (stop.clone(), mark.clone());
        std::thread::spawn(move || {
            let mut bad = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let live = gpuctl_tests::live_tasks("GPUCTL_TEST_XID_GANG", &mark);
                let mut seen = std::collections::BTreeSet::new();
                for t in &live {
                    for g in &t.gpus {
                        if !seen.insert(g.clone()) {
                            bad.push(format!("GPU {g} held by two live tasks: {live:?}"));
                        }
                    }
                }
                let attempts: std::collections::BTreeSet<u32> = live
                    .iter()
                    .map(|t| {
                        t.task_id
                            .rsplit('.')
                            .next()
                            .unwrap()
                            .parse::<u32>()
                            .unwrap()
                            / 2
                    })
                    .collect();
                if attempts.len() > 1 {
                    bad.push(format!("two attempts alive: {live:?}"));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            bad
        })
    };
    s.change(|m| {
        m["gpus"][index as usize]["lost"] = true.into();
        m["events"] = json!([{ "id": 1, "gpu_index": index, "type": "xid", "data": 79 }]);
    });
    let j =
        s.c.wait_job_until(&gang, Duration::from_secs(40), "the gang runs again", |j| {
            j["state"] == "RUNNING" && gpuctl_tests::task_ids(j).len() == 4
        });
    assert_eq!(j["retries"], 0, "no retry used: {j}");
    assert_eq!(j["tasks"][1]["reason"], "GPU_UNHEALTHY", "{j}");
    let again: Vec<&str> = (2..4)
        .map(|t| j["tasks"][t]["gpus"][0].as_str().unwrap())
        .collect();
    assert!(
        !again.contains(&failing.as_str()),
        "placed on the failed GPU: {j}"
    );
    let reasons: Vec<&str> = j["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["reason"].as_str().unwrap())
        .collect();
    assert!(
        reasons.contains(&"GpuFailed") && reasons.contains(&"Requeued"),
        "{reasons:?}"
    );
    // Reset once idle, and back in service.
    s.wait_health(&failing, true);
    // Both ranks of the new attempt live, on distinct GPUs.
    wait_for(
        Duration::from_secs(10),
        "the new attempt's ranks live",
        || gpuctl_tests::live_tasks("GPUCTL_TEST_XID_GANG", &mark).len() == 2,
    );
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let bad = watcher.join().unwrap();
    assert!(bad.is_empty(), "{bad:?}");
    s.c.ok(&["jobs", "cancel", &gang, "--wait"]);
}

/// Issue 38, item 3: a job's `--preflight` runs the agent's
/// `--preflight-command` on each of its GPUs before it starts. The command
/// fails on GPU 0 (a memory test that finds errors): that GPU is withdrawn
/// with the command's words, the task ends GPU_UNHEALTHY before it runs,
/// the job goes back to the queue without using a retry, and starts on a
/// GPU that passes. A job without `--preflight` is not checked.
#[test]
fn a_gpu_that_fails_preflight_is_withdrawn_and_the_job_placed_again() {
    let dir = gpuctl_tests::test_dir();
    let log = dir.path().join("checked");
    let script = dir.path().join("memtest.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho \"$1\" >> {log}\necho \"testing $1\"\n\
             if [ \"$1\" = {GPU0} ]; then echo 'memtest: 3 errors at 0x7f3a0000' >&2; exit 1; fi\n",
            log = log.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let command = format!("{} {{uuid}}", script.display());
    let s = Setup::start_with(
        "3600",
        &[
            "--gpu-reset-command",
            "none",
            "--preflight-command",
            &command,
        ],
    );
    let checked = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    // Unchecked: no preflight asked.
    let (plain, plain_gpu) = s.sleeper("plain");
    assert!(checked().is_empty(), "{:?}", checked());
    s.c.ok(&["jobs", "cancel", &plain, "--wait"]);
    let checked_job = |name: &str| {
        s.c.submit(&[
            "--name",
            name,
            "--gpus",
            "1",
            "--preflight",
            "--",
            "sleep",
            "600",
        ])
    };
    // Two checked jobs on two GPUs: the one placed on GPU 0 fails its
    // preflight and waits (GPU 0 is out, GPU 1 is taken).
    let a = checked_job("a");
    let b = checked_job("b");
    let g = s.wait_health(GPU0, false);
    let why = g["unhealthy_reason"].as_str().unwrap();
    assert!(
        why.contains("preflight failed") && why.contains("memtest: 3 errors at 0x7f3a0000"),
        "{g}"
    );
    let mut jobs = Value::Null;
    let settled = try_wait_for(Duration::from_secs(30), || {
        jobs = json!([s.c.job(&a), s.c.job(&b)]);
        let states: Vec<&str> = jobs
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j["state"].as_str().unwrap())
            .collect();
        states.contains(&"RUNNING") && states.contains(&"QUEUED")
    });
    assert!(settled, "{jobs}\n{}", s.c.diagnostics());
    let (running, waiting) = {
        let js = jobs.as_array().unwrap();
        if js[0]["state"] == "RUNNING" {
            (js[0].clone(), js[1].clone())
        } else {
            (js[1].clone(), js[0].clone())
        }
    };
    assert_eq!(running["tasks"][0]["gpus"][0], GPU1, "{running}");
    let failed = &waiting["tasks"][0];
    assert_eq!(failed["reason"], "GPU_UNHEALTHY", "{waiting}");
    assert_eq!(failed["gpus"][0], GPU0, "{waiting}");
    assert!(
        failed["message"]
            .as_str()
            .unwrap()
            .contains("preflight failed"),
        "{waiting}"
    );
    assert_eq!(waiting["retries"], 0, "{waiting}");
    let reasons: Vec<&str> = waiting["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["reason"].as_str().unwrap())
        .collect();
    assert!(reasons.contains(&"GpuFailed"), "{reasons:?}");
    // It never ran: no task process was started for it.
    // Once GPU 1 is free it starts there, checked again.
    let running_id = running["id"].as_str().unwrap().to_string();
    let waiting_id = waiting["id"].as_str().unwrap().to_string();
    s.c.ok(&["jobs", "cancel", &running_id, "--wait"]);
    let j =
        s.c.wait_state(&waiting_id, "RUNNING", Duration::from_secs(30));
    // The job avoids GPU 0 from the failed task's report on, whether or
    // not the agent's heartbeat has said GPU 0 is out: never placed there
    // again.
    let tasks = j["tasks"].as_array().unwrap();
    let gpus: Vec<&str> = tasks
        .iter()
        .map(|t| t["gpus"][0].as_str().unwrap())
        .collect();
    assert_eq!(gpus, [GPU0, GPU1], "{j}");
    assert_eq!(tasks[0]["reason"], "GPU_UNHEALTHY", "{j}");
    assert_eq!(j["retries"], 0, "{j}");
    let requeued = j["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["reason"] == "Requeued")
        .unwrap_or_else(|| panic!("no Requeued event: {j}"));
    assert!(
        requeued["message"]
            .as_str()
            .unwrap()
            .contains(&format!("avoiding GPU {GPU0}")),
        "{requeued}"
    );
    let seen = checked();
    assert_eq!(seen.iter().filter(|g| *g == GPU0).count(), 1, "{seen:?}");
    assert_eq!(seen.iter().filter(|g| *g == GPU1).count(), 2, "{seen:?}");
    // Withdrawn until a reset, which is off here.
    assert_eq!(s.gpu(GPU0)["healthy"], false);
    let _ = plain_gpu;
}

/// Issue 38, item 2: GPU activity keeps a silent task alive. Two silent
/// 1-GPU jobs with a 2 s `--hang-timeout`: the one on the idle GPU 0 is
/// stopped as HUNG; the one on GPU 1, which fake-nvml shows 87% busy, runs
/// on.
#[test]
fn a_silent_task_on_a_busy_gpu_is_not_hung_and_one_on_an_idle_gpu_is() {
    let s = Setup::start("3600");
    let args = |name: &'static str| {
        vec![
            "--name",
            name,
            "--gpus",
            "1",
            "--hang-timeout",
            "2s",
            "--",
            "sleep",
            "120",
        ]
    };
    let a = s.c.submit(&args("silent-a"));
    let b = s.c.submit(&args("silent-b"));
    // No GPU, no output, but it touches its heartbeat file: alive.
    let beating = s.c.submit(&[
        "--name",
        "beating",
        "--hang-timeout",
        "2s",
        "--",
        "sh",
        "-c",
        "while true; do touch \"$GPUCTL_HEARTBEAT_FILE\"; sleep 0.5; done",
    ]);
    let ja = s.c.wait_state(&a, "RUNNING", Duration::from_secs(30));
    s.c.wait_state(&b, "RUNNING", Duration::from_secs(30));
    let on_gpu = |j: &Value| j["tasks"][0]["gpus"][0].as_str().unwrap().to_string();
    let (idle_job, busy_job) = if on_gpu(&ja) == GPU0 { (a, b) } else { (b, a) };
    let j = s.c.wait_state(&idle_job, "FAILED", Duration::from_secs(30));
    assert_eq!(j["tasks"][0]["reason"], "HUNG", "{j}");
    // Well past its own timeout, the job on the busy GPU still runs.
    std::thread::sleep(Duration::from_secs(3));
    let j = s.c.job(&busy_job);
    assert_eq!(j["state"], "RUNNING", "{j}");
    assert_eq!(j["tasks"].as_array().unwrap().len(), 1, "{j}");
    let j = s.c.job(&beating);
    assert_eq!(j["state"], "RUNNING", "{j}");
    assert_eq!(j["tasks"].as_array().unwrap().len(), 1, "{j}");
}

/// Issue 34 item 4: two tasks sharing a GPU by fractions, each with the
/// GPU memory of its own processes. NVML's process list (the fake's
/// `processes`) names the tasks' host pids; the agent finds each pid's
/// task from its cgroup and reports the memory per task, in its metrics
/// and with the heartbeat, so that `gpuctl top` shows it under the GPU.
#[test]
fn tasks_sharing_a_gpu_each_report_their_processes_memory() {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipped: task cgroups need root");
        return;
    }
    let mut s = Setup::start("3600");
    s.c.ok(&["gpus", "share", GPU0, "--mode", "time-slice"]);
    let marker = gpuctl_tests::test_marker("procmem");
    let env = format!("PROCMEM={marker}");
    let fraction = |name: &str, mem: &str| {
        let id = s.c.submit(&[
            "--name",
            name,
            "--gpu-mem",
            mem,
            "--cpus",
            "0.1",
            "--env",
            &env,
            "--",
            "sh",
            "-c",
            "sleep 600 & sleep 600",
        ]);
        let j = s.c.wait_state(&id, "RUNNING", Duration::from_secs(30));
        j["tasks"][0]["id"].as_str().unwrap().to_string()
    };
    let big = fraction("big", "10GiB");
    let small = fraction("small", "1GiB");
    // Each task's host processes (two sleeps at least), from outside.
    let pids = two_processes_each("PROCMEM", &marker, &[&big, &small]);
    // big: 3000 MiB on one process and 174 on another; small: 512; a
    // process of nobody's (the MPS daemon, say) is not counted.
    let mut procs = vec![json!({"pid": 1, "memory_used_mib": 4096})];
    for (k, pid) in pids[&big].iter().enumerate() {
        let mib = [3000, 174].get(k).copied().unwrap_or(0);
        procs.push(json!({"pid": pid, "memory_used_mib": mib}));
    }
    procs.push(json!({"pid": pids[&small][0], "memory_used_mib": 512}));
    s.change(|m| m["gpus"][0]["processes"] = json!(procs));

    let mib = |v: f64| v * 1024.0 * 1024.0;
    let ok = try_wait_for(Duration::from_secs(20), || {
        let a = Scrape::get(&s.agent_metrics);
        let used = |task: &str| {
            a.value(
                "gpuctl_task_gpu_memory_used_bytes",
                &[("task", task), ("gpu", GPU0)],
            )
        };
        used(&big) == Some(mib(3174.0)) && used(&small) == Some(mib(512.0))
    });
    let cgroups: Vec<String> = pids
        .values()
        .flatten()
        .map(|p| std::fs::read_to_string(format!("/proc/{p}/cgroup")).unwrap_or_default())
        .collect();
    assert!(
        ok,
        "no per-task memory in the metrics: {pids:?} in {cgroups:?}\n{}\n{}",
        http_get(&s.agent_metrics, "/metrics"),
        s.c.diagnostics()
    );
    assert!(Scrape::get(&s.agent_metrics).help("gpuctl_task_gpu_memory_used_bytes"));

    // gpuctl top, from the leader's copy of the agent's heartbeat.
    let mut last = Value::Null;
    let ok = try_wait_for(Duration::from_secs(20), || {
        last = s.c.json(&["top", "--json"]);
        let g = last
            .as_array()
            .and_then(|a| a.iter().find(|g| g["uuid"] == GPU0).cloned())
            .unwrap_or_default();
        let used = |task: &str| {
            g["shares"]
                .as_array()
                .and_then(|a| a.iter().find(|h| h["task_id"] == task))
                .map(|h| h["memory_used_mib"].clone())
        };
        used(&big) == Some(json!(3174)) && used(&small) == Some(json!(512))
    });
    assert!(
        ok,
        "top never showed the tasks' memory: {last}\n{}",
        s.c.diagnostics()
    );
    let table = s.c.ok(&["top", "--once"]);
    let row = |task: &str| {
        table
            .lines()
            .find(|l| l.contains("└ share") && l.ends_with(task))
            .unwrap_or_else(|| panic!("no share row for {task}:\n{table}"))
            .to_string()
    };
    assert!(row(&big).contains("3.1/10GiB"), "{table}");
    assert!(row(&small).contains("0.5/1GiB"), "{table}");
}

/// The host pids of each of `tasks` (jobs submitted with
/// `--env marker=value`), once each has two live processes.
fn two_processes_each(marker: &str, value: &str, tasks: &[&str]) -> HashMap<String, Vec<i32>> {
    let mut pids: HashMap<String, Vec<i32>> = HashMap::new();
    wait_for(Duration::from_secs(10), "the tasks' processes", || {
        pids.clear();
        for t in gpuctl_tests::live_tasks(marker, value) {
            pids.entry(t.task_id).or_default().push(t.pid);
        }
        tasks
            .iter()
            .all(|t| pids.get(*t).is_some_and(|p| p.len() >= 2))
    });
    pids
}

/// Issue 34 item 2: MPS holds each process of a task to its fraction, not
/// the task: two processes each under the limit, together over it (the
/// device plugin's #720). The agent sees the total in NVML's per-process
/// accounting and stops the task with GPU_MEMORY_LIMIT; its neighbour under
/// its own fraction runs on.
#[test]
fn an_mps_fraction_whose_processes_together_pass_its_memory_fails_with_gpu_memory_limit() {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipped: task cgroups need root");
        return;
    }
    let mut s = Setup::start("3600");
    s.c.ok(&["gpus", "share", GPU0, "--mode", "mps"]);
    let marker = gpuctl_tests::test_marker("memlimit");
    let env = format!("MEMLIMIT={marker}");
    let fraction = |name: &str| {
        let id = s.c.submit(&[
            "--name",
            name,
            "--gpu-mem",
            "1GiB",
            "--cpus",
            "0.1",
            "--env",
            &env,
            "--",
            "sh",
            "-c",
            "sleep 600 & sleep 600",
        ]);
        let j = s.c.wait_state(&id, "RUNNING", Duration::from_secs(30));
        assert_eq!(j["tasks"][0]["enforcement"], "mps", "{j}");
        (id, j["tasks"][0]["id"].as_str().unwrap().to_string())
    };
    let (hog_job, hog) = fraction("hog");
    let (fine_job, fine) = fraction("fine");
    let pids = two_processes_each("MEMLIMIT", &marker, &[&hog, &fine]);
    // hog: 600 MiB on each of two processes, each under its 1024 MiB MPS
    // limit, 1200 together; fine: 512 on one.
    let mut procs = Vec::new();
    for pid in pids[&hog].iter().take(2) {
        procs.push(json!({"pid": pid, "memory_used_mib": 600}));
    }
    procs.push(json!({"pid": pids[&fine][0], "memory_used_mib": 512}));
    s.change(|m| m["gpus"][0]["processes"] = json!(procs));

    let job = s.c.wait_state(&hog_job, "FAILED", Duration::from_secs(30));
    let task = &job["tasks"][0];
    assert_eq!(task["reason"], "GPU_MEMORY_LIMIT", "{job}");
    let msg = task["message"].as_str().unwrap();
    assert!(
        msg.contains("1200 MiB") && msg.contains("1024 MiB"),
        "{msg}"
    );
    let got = s.c.ok(&["jobs", "get", &hog_job]);
    assert!(got.contains("1200 MiB"), "{got}");
    // Its processes are gone, from outside the master.
    wait_for(Duration::from_secs(10), "the hog's processes gone", || {
        gpuctl_tests::live_tasks("MEMLIMIT", &marker)
            .iter()
            .all(|t| t.task_id != hog)
    });
    // The neighbour within its fraction was not touched.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(s.c.job(&fine_job)["state"], "RUNNING");
    s.c.ok(&["jobs", "cancel", &fine_job]);
    s.c.wait_job(&fine_job, 30);
}

/// A fraction capped at allocation (by MPS or the driver) that runs out of
/// memory gets CUDA's out-of-memory and exits with its own code, which the
/// agent cannot tell from any other failure. When its processes were seen
/// at 95% of its fraction or more, its failure says so as a likely cause.
#[test]
fn a_fraction_that_fails_near_its_memory_is_told_the_likely_cause() {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipped: task cgroups need root");
        return;
    }
    let mut s = Setup::start("3600");
    s.c.ok(&["gpus", "share", GPU0, "--mode", "time-slice"]);
    let marker = gpuctl_tests::test_marker("nearoom");
    let env = format!("NEAROOM={marker}");
    // Ends (exit 3) once the test drops `go` into its sandbox.
    let script = "sleep 600 & while [ ! -e go ]; do sleep 0.2; done; exit 3";
    let submit = |name: &str| {
        let id = s.c.submit(&[
            "--name",
            name,
            "--gpu-mem",
            "1GiB",
            "--cpus",
            "0.1",
            "--env",
            &env,
            "--",
            "sh",
            "-c",
            script,
        ]);
        let j = s.c.wait_state(&id, "RUNNING", Duration::from_secs(30));
        (id, j["tasks"][0]["id"].as_str().unwrap().to_string())
    };
    let (near_job, near) = submit("near");
    let (far_job, far) = submit("far");
    let pids = two_processes_each("NEAROOM", &marker, &[&near, &far]);
    let procs = json!([
        {"pid": pids[&near][0], "memory_used_mib": 1000},
        {"pid": pids[&far][0], "memory_used_mib": 300},
    ]);
    s.change(|m| m["gpus"][0]["processes"] = procs);
    wait_for(Duration::from_secs(20), "the tasks' memory read", || {
        let a = Scrape::get(&s.agent_metrics);
        let used = |t: &str| {
            a.value(
                "gpuctl_task_gpu_memory_used_bytes",
                &[("task", t), ("gpu", GPU0)],
            )
        };
        used(&near) == Some(1000.0 * 1048576.0) && used(&far) == Some(300.0 * 1048576.0)
    });
    let work = s.c.dir.path().join("agent0/tasks");
    for t in [&near, &far] {
        std::fs::write(work.join(t).join("go"), "").unwrap();
    }
    let near_msg = s.c.wait_state(&near_job, "FAILED", Duration::from_secs(30))["tasks"][0]
        ["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        near_msg.contains("exited with code 3")
            && near_msg.contains("seen at 1000 MiB of its 1024 MiB fraction"),
        "{near_msg}"
    );
    let far_msg = s.c.wait_state(&far_job, "FAILED", Duration::from_secs(30))["tasks"][0]
        ["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(far_msg, "exited with code 3");
}

/// Issue 39, item 5: the agent also exposes its readings under NVIDIA's
/// DCGM exporter names and labels (so DCGM dashboards work), with the job
/// holding the GPU as `hpc_job`; both expositions pass `promtool check
/// metrics` (Prometheus' own linter; skipped without it unless
/// GPUCTL_REQUIRE_PROMTOOL=1, which CI sets).
#[test]
fn metrics_carry_dcgm_names_and_pass_promtool() {
    let s = Setup::start("3600");
    let job =
        s.c.submit(&["--name", "held", "--gpus", "2", "--", "sleep", "60"]);
    s.c.wait_state(&job, "RUNNING", Duration::from_secs(30));
    let mut a = Scrape::get(&s.agent_metrics);
    let held = try_wait_for(Duration::from_secs(10), || {
        a = Scrape::get(&s.agent_metrics);
        a.value("DCGM_FI_DEV_GPU_UTIL", &[("UUID", GPU1), ("hpc_job", &job)])
            .is_some()
    });
    assert!(held, "no DCGM series with hpc_job={job}");
    assert_eq!(
        a.value("DCGM_FI_DEV_GPU_UTIL", &[("UUID", GPU1)]),
        Some(87.0)
    );
    assert_eq!(
        a.value("DCGM_FI_DEV_FB_USED", &[("UUID", GPU1)]),
        Some(12288.0)
    );
    assert_eq!(
        a.value("DCGM_FI_DEV_FB_FREE", &[("UUID", GPU1)]),
        Some(40960.0 - 12288.0)
    );
    assert_eq!(
        a.value("DCGM_FI_DEV_GPU_TEMP", &[("UUID", GPU0)]),
        Some(41.0)
    );
    assert_eq!(
        a.value("DCGM_FI_DEV_POWER_USAGE", &[("UUID", GPU1)]),
        Some(250.5)
    );
    assert_eq!(
        a.value(
            "DCGM_FI_DEV_GPU_UTIL",
            &[
                ("UUID", GPU0),
                ("gpu", "0"),
                ("modelName", "NVIDIA A100-SXM4-40GB")
            ]
        ),
        Some(0.0)
    );
    // Every metric the Grafana dashboard in deploy/ queries is one the
    // agent or the master (leader) exposes.
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/gpuctl.json"),
        )
        .unwrap(),
    )
    .unwrap();
    // (A quota, so that the tenants' quota series has a sample.)
    s.c.ok(&["quota", "set", "default", "--gpus", "4"]);
    let m = Scrape::get(&s.master_metrics);
    assert_eq!(
        m.value("gpuctl_tenant_gpus_allocated", &[("tenant", "default")]),
        Some(2.0)
    );
    assert_eq!(
        m.value("gpuctl_tenant_gpu_quota", &[("tenant", "default")]),
        Some(4.0)
    );
    let exposed: std::collections::BTreeSet<&str> =
        a.0.samples
            .iter()
            .chain(&m.0.samples)
            .map(|s| s.metric.as_str())
            .collect();
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().into_iter().flatten() {
            exprs.push(t["expr"].as_str().unwrap().to_string());
        }
    }
    assert!(exprs.len() >= 10, "{exprs:?}");
    for e in &exprs {
        let names = e
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("gpuctl_") || w.starts_with("DCGM_FI_"));
        for name in names {
            // A family with no sample now (no task process on a GPU)
            // is still declared.
            assert!(
                exposed.contains(name) || a.help(name) || m.help(name),
                "the dashboard queries {name}, which nothing exposes: {e}"
            );
        }
    }
    let required = std::env::var("GPUCTL_REQUIRE_PROMTOOL").is_ok_and(|v| v == "1");
    let promtool = std::process::Command::new("promtool")
        .arg("--version")
        .output();
    if promtool.is_err() {
        assert!(
            !required,
            "GPUCTL_REQUIRE_PROMTOOL=1 but promtool is not installed"
        );
        eprintln!("skipped: promtool is not installed (apt-get install prometheus)");
        return;
    }
    // promtool's lint wants snake_case labels, and DCGM's own labels are
    // camelCase (modelName, Hostname): gpuctl's families must pass whole,
    // the DCGM ones with that complaint alone.
    let check = |body: &str| -> (bool, String) {
        let mut child = std::process::Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(body.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    for (what, addr) in [("agent", &s.agent_metrics), ("master", &s.master_metrics)] {
        let body = http_get(addr, "/metrics");
        let own: String = body
            .lines()
            .filter(|l| !l.contains("DCGM_FI_"))
            .map(|l| format!("{l}\n"))
            .collect();
        let (ok, text) = check(&own);
        assert!(
            ok,
            "promtool check metrics on the {what}'s own families: {text}\n{own}"
        );
        let (_, text) = check(&body);
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            assert!(
                line.starts_with("DCGM_FI_") && line.contains("snake_case"),
                "promtool on the {what}'s exposition: {line}\n{text}"
            );
        }
    }
}
