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

/// The row of `key`'s `field`; 0 without the row or the field.
fn field_or_0(r: &Value, key: &str, field: &str) -> u64 {
    r["rows"]
        .as_array()
        .and_then(|rows| rows.iter().find(|row| row["key"] == key))
        .and_then(|row| row[field].as_u64())
        .unwrap_or(0)
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

const GPU0: &str = "GPU-0c5e6a3e-0000-4000-8000-000000000000";
const GPU1: &str = "GPU-0c5e6a3e-0000-4000-8000-000000000001";

/// fake-nvml's machine: GPU 0 at `util0`%, GPU 1 87% busy. Written whole
/// then renamed, so that fake-nvml never reads half of it.
fn write_machine(path: &std::path::Path, util0: u32) {
    gpuctl_tests::write_fake_machine(
        path,
        &serde_json::json!({
            "gpus": [
                { "uuid": GPU0, "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960,
                  "utilization_gpu_pct": util0 },
                { "uuid": GPU1, "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960,
                  "memory_used_mib": 12288, "utilization_gpu_pct": 87 }
            ],
            "events": []
        }),
    );
}

/// Job `id` as `gpuctl jobs list --json` shows it.
fn listed(c: &impl Gpuctl, id: &str) -> Value {
    c.json(&["jobs", "list", "--json"])
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["id"] == id)
        .unwrap()
        .clone()
}

/// `Operator.Utilization` at the master.
fn utilization(
    c: &gpuctl_tests::Cluster,
    req: gpuctl_proto::pb::UtilizationRequest,
) -> gpuctl_proto::pb::UtilizationResponse {
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let mut op = gpuctl_proto::pb::operator_client::OperatorClient::connect(format!(
            "http://{}",
            c.master_addr
        ))
        .await
        .unwrap();
        op.utilization(req).await.unwrap().into_inner()
    })
}

/// A series' (util, mem) of each period with a reading.
fn readings(s: &gpuctl_proto::pb::GpuSeries) -> Vec<(u8, u8)> {
    s.util
        .iter()
        .zip(&s.mem)
        .filter(|(u, _)| **u != 255)
        .map(|(u, m)| (*u, *m))
        .collect()
}

/// A master recording utilization every second (`extra`: more flags) and
/// an agent on fake-nvml's two GPUs.
fn fake_nvml_cluster(extra: &[&str]) -> (gpuctl_tests::Cluster, std::path::PathBuf) {
    let mut flags = vec!["--utilization-period", "1s"];
    flags.extend_from_slice(extra);
    let mut c = gpuctl_tests::Cluster::start(&flags);
    let machine = c.dir.path().join("machine.json");
    write_machine(&machine, 0);
    c.add_agent(AgentOpts::fake_nvml(&machine, "0.2"));
    (c, machine)
}

/// Issue 39, item 3: a running job whose GPUs stay idle for the window
/// (3 s here) is flagged, with an `Idle` event, in `jobs list` (table and
/// JSON); the job on the busy GPU is not; when its GPU gets busy, the flag
/// goes, with a `Busy` event.
#[test]
fn idle_jobs_are_flagged_until_their_gpus_are_busy() {
    let (c, machine) = fake_nvml_cluster(&["--idle-window", "3s"]);
    let jobs: Vec<String> = ["a", "b"]
        .iter()
        .map(|n| c.submit(&["--name", n, "--gpus", "1", "--", "sleep", "120"]))
        .collect();
    let mut on_gpu = std::collections::BTreeMap::new();
    for j in &jobs {
        let running = c.wait_state(j, "RUNNING", Duration::from_secs(60));
        on_gpu.insert(
            running["tasks"][0]["gpus"][0].as_str().unwrap().to_string(),
            j.clone(),
        );
    }
    let (idle, busy) = (on_gpu[GPU0].clone(), on_gpu[GPU1].clone());
    let listed = |id: &str| listed(&c, id);
    let flagged = gpuctl_tests::try_wait_for(Duration::from_secs(30), || {
        listed(&idle)["idle_since_ms"].as_u64().is_some()
    });
    assert!(flagged, "{}", listed(&idle));
    assert!(
        listed(&busy).get("idle_since_ms").is_none(),
        "{}",
        listed(&busy)
    );
    let kinds = |id: &str| -> Vec<String> {
        c.job(id)["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["reason"].as_str().unwrap().to_string())
            .collect()
    };
    assert!(
        kinds(&idle).contains(&"Idle".to_string()),
        "{:?}",
        kinds(&idle)
    );
    assert!(
        !kinds(&busy).contains(&"Idle".to_string()),
        "{:?}",
        kinds(&busy)
    );
    let table = c.ok(&["jobs", "list"]);
    assert!(table.contains("Idle: GPUs idle for"), "{table}");
    // Its GPU gets busy: the flag goes, with a Busy event.
    write_machine(&machine, 60);
    let cleared = gpuctl_tests::try_wait_for(Duration::from_secs(30), || {
        listed(&idle)["idle_since_ms"].is_null()
    });
    assert!(cleared, "{}", listed(&idle));
    assert_eq!(kinds(&idle).last().map(String::as_str), Some("Busy"));
    // The tenant stops jobs idle 2 s past their flag: idle again, the job
    // is stopped and ends CANCELLED saying why; the busy one runs on.
    let set = c.ok(&[
        "quota",
        "set",
        "default",
        "--gpus",
        "0",
        "--stop-idle-after",
        "2s",
    ]);
    assert!(set.contains("idle jobs stopped after 2 s"), "{set}");
    write_machine(&machine, 0);
    let j = c.wait_state(&idle, "CANCELLED", Duration::from_secs(60));
    let message = j["message"].as_str().unwrap();
    assert!(message.contains("tenant default stops idle jobs"), "{j}");
    assert_eq!(c.job(&busy)["state"], "RUNNING");
    let bad = c.gpuctl(&[
        "quota",
        "set",
        "default",
        "--gpus",
        "0",
        "--stop-idle-after",
        "soon",
    ]);
    assert_eq!(bad.status.code(), Some(2));
    c.ok(&["jobs", "cancel", &busy]);
}

/// Issue 39, item 2: allocated against used. GPUs discovered through
/// fake-nvml, GPU 1 87% busy and GPU 0 idle; the master records a period
/// every second. A job on each GPU: its report shows the GPU-hours it held
/// and the mean utilization of its GPU over them.
#[test]
fn usage_shows_each_jobs_mean_utilization_beside_its_gpu_hours() {
    let (c, _machine) = fake_nvml_cluster(&[]);
    let jobs: Vec<String> = ["a", "b"]
        .iter()
        .map(|n| c.submit(&["--name", n, "--gpus", "1", "--", "sleep", "5"]))
        .collect();
    let mut on_gpu = std::collections::BTreeMap::new();
    for j in &jobs {
        let done = c.wait_state(j, "SUCCEEDED", Duration::from_secs(60));
        on_gpu.insert(
            done["tasks"][0]["gpus"][0].as_str().unwrap().to_string(),
            j.clone(),
        );
    }
    // The last period is recorded within a second or two of the end.
    std::thread::sleep(Duration::from_secs(3));
    let r: Value = serde_json::from_str(&c.ok(&["usage", "--by", "job", "--json"])).unwrap();
    let row = |job: &str| {
        r["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|row| row["key"] == job)
            .unwrap_or_else(|| panic!("no row {job}: {r}"))
            .clone()
    };
    let busy = row(&on_gpu[GPU1]);
    let idle = row(&on_gpu[GPU0]);
    // Periods with readings cover most of the 5 s each held its GPU.
    for row in [&busy, &idle] {
        let sampled = row["gpu_sampled_ms"].as_u64().unwrap();
        assert!(
            sampled >= 3000 && sampled <= row["gpu_ms"].as_u64().unwrap() + 2000,
            "{r}"
        );
    }
    assert_eq!(busy["gpu_util_pct"].as_f64(), Some(87.0), "{r}");
    assert_eq!(idle["gpu_util_pct"].as_f64(), Some(0.0), "{r}");
    // By model: the two together, in between.
    let m: Value = serde_json::from_str(&c.ok(&["usage", "--by", "gpu-model", "--json"])).unwrap();
    let util = m["rows"][0]["gpu_util_pct"].as_f64().unwrap();
    assert!(util > 20.0 && util < 70.0, "{m}");
    let table = c.ok(&["usage", "--by", "job"]);
    assert!(table.contains("87%"), "{table}");
    // The week's view: hourly means of each GPU (87% and 30% of memory
    // all along; 0%), and the cluster's per hour.
    let r = utilization(
        &c,
        gpuctl_proto::pb::UtilizationRequest {
            hourly: true,
            ..Default::default()
        },
    );
    for (gpu, util, mem) in [(GPU1, 87u8, 30u8), (GPU0, 0, 0)] {
        let s = r.gpus.iter().find(|s| s.gpu == gpu).unwrap();
        assert_eq!(s.period_ms, 3_600_000, "{s:?}");
        assert_eq!(s.start_ms % 3_600_000, 0, "{s:?}");
        let read = readings(s);
        assert!(
            !read.is_empty() && read.iter().all(|p| *p == (util, mem)),
            "{gpu}: {read:?}"
        );
    }
    assert_eq!(r.cluster_period_ms, 3_600_000);
    assert!(!r.allocated.is_empty(), "{r:?}");
}

/// Issue 39, item 2, on a shared GPU: NVML's per-process utilization
/// (fake-nvml's `sm_util_pct`) of two real fraction tasks' processes, found
/// from outside by their environment. The agent attributes each process to
/// its task by cgroup; each tenant is charged its own task's use against
/// its share, not the whole GPU's 100%: half the GPU with processes using
/// 30% + 10% of it was 80% busy; a quarter whose process used 60% was busy
/// all of its quarter (and no more); a process of no task's is charged to
/// nobody. The tenant and job views say the same. Item 3 too: a fraction
/// whose processes stop using the GPU is flagged idle while the GPU is
/// busy with its neighbour's. Each job's curve is its own processes'.
#[test]
fn fractions_of_a_shared_gpu_are_charged_their_own_processes_utilization() {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipped: task cgroups need root");
        return;
    }
    let (c, machine) = fake_nvml_cluster(&["--idle-window", "3s"]);
    c.ok(&["gpus", "share", GPU0, "--mode", "time-slice"]);
    let marker = "PROCUTIL";
    let value = gpuctl_tests::test_marker("procutil");
    let env = format!("{marker}={value}");
    let fraction = |name: &str, tenant: &str, mem: &str| {
        let id = c.submit(&[
            "--name",
            name,
            "--tenant",
            tenant,
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
        let j = c.wait_state(&id, "RUNNING", Duration::from_secs(30));
        assert_eq!(j["tasks"][0]["gpus"][0], GPU0, "{j}");
        (id, j["tasks"][0]["id"].as_str().unwrap().to_string())
    };
    let (half, half_task) = fraction("half", "alpha", "20GiB");
    let (quarter, quarter_task) = fraction("quarter", "beta", "10GiB");
    let mut pids: std::collections::HashMap<String, Vec<i32>> = Default::default();
    gpuctl_tests::wait_for(Duration::from_secs(10), "the tasks' processes", || {
        pids.clear();
        for t in gpuctl_tests::live_tasks(marker, &value) {
            pids.entry(t.task_id).or_default().push(t.pid);
        }
        pids.get(&half_task).is_some_and(|p| p.len() >= 2) && pids.contains_key(&quarter_task)
    });
    let procs = serde_json::json!([
        { "pid": 1, "memory_used_mib": 100, "sm_util_pct": 5 },
        { "pid": pids[&half_task][0], "memory_used_mib": 1000, "sm_util_pct": 30 },
        { "pid": pids[&half_task][1], "memory_used_mib": 1000, "sm_util_pct": 10 },
        { "pid": pids[&quarter_task][0], "memory_used_mib": 1000, "sm_util_pct": 60 },
    ]);
    let machine_with = |procs: Value| {
        gpuctl_tests::write_fake_machine(
            &machine,
            &serde_json::json!({
                "gpus": [
                    { "uuid": GPU0, "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960,
                      "memory_used_mib": 3100, "utilization_gpu_pct": 100, "processes": procs },
                    { "uuid": GPU1, "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960 }
                ],
                "events": []
            }),
        )
    };
    machine_with(procs.clone());
    // (sampled, busy) ms of `key`'s row, by `by`; zeros before its first.
    let read = |by: &str, key: &str| -> (u64, u64) {
        let r: Value = serde_json::from_str(&c.ok(&["usage", "--by", by, "--json"])).unwrap();
        r["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|row| row["key"] == key)
            .map(|row| {
                (
                    row["gpu_sampled_ms"].as_u64().unwrap_or(0),
                    row["gpu_busy_ms"].as_u64().unwrap_or(0),
                )
            })
            .unwrap_or((0, 0))
    };
    // The first period with readings may hold the change half-way; every
    // later one is whole. Compare from after the first.
    gpuctl_tests::wait_for(Duration::from_secs(30), "alpha's first reading", || {
        read("tenant", "alpha").0 > 0
    });
    let rows = || -> Vec<(u64, u64)> {
        [
            ("tenant", "alpha"),
            ("tenant", "beta"),
            ("job", half.as_str()),
            ("job", quarter.as_str()),
        ]
        .iter()
        .map(|(by, k)| read(by, k))
        .collect()
    };
    let start = rows();
    // Four whole periods more of alpha's half (500 ms of each second).
    gpuctl_tests::wait_for(Duration::from_secs(30), "four more periods", || {
        read("tenant", "alpha").0 >= start[0].0 + 4 * 500
    });
    let end = rows();
    let delta = |i: usize| (end[i].0 - start[i].0, end[i].1 - start[i].1);
    for (i, what, share_ms, busy_pct) in [
        (0, "alpha", 500, 80),
        (1, "beta", 250, 100),
        (2, "the half job", 500, 80),
        (3, "the quarter job", 250, 100),
    ] {
        let (sampled, busy) = delta(i);
        assert!(
            sampled > 0 && sampled % share_ms == 0,
            "{what}: {sampled} ms sampled is not whole periods of its share: {start:?} {end:?}"
        );
        assert_eq!(
            busy * 100,
            sampled * busy_pct,
            "{what}: {busy} of {sampled} ms busy: {start:?} {end:?}"
        );
    }
    // Nobody else was charged GPU time: the default tenant holds nothing.
    assert_eq!(read("tenant", "default").0, 0);
    // Each job's curve is its own processes' (40% and 60% of the GPU's
    // SMs, 2000 and 1000 MiB of its 40960: 4% and 2%), never the whole
    // GPU's 100% and 7%; a period that held the change lies in between.
    let series = |job: &str| -> gpuctl_proto::pb::GpuSeries {
        let r = utilization(
            &c,
            gpuctl_proto::pb::UtilizationRequest {
                job_id: job.to_string(),
                ..Default::default()
            },
        );
        assert_eq!(r.gpus.len(), 1, "{job}: {r:?}");
        r.gpus[0].clone()
    };
    for (job, util, mem) in [(&half, 40u8, 4u8), (&quarter, 60, 2)] {
        let s = series(job);
        assert!(s.own && s.gpu == GPU0, "{job}: {s:?}");
        let read = readings(&s);
        assert_eq!(read.last(), Some(&(util, mem)), "{job}: {read:?}");
        assert!(
            read.iter().all(|(u, m)| *u <= util && *m <= mem),
            "{job}: {read:?}"
        );
    }
    // Idle by its own readings: the quarter's process stops using the GPU
    // (NVML lists it no more, so it reads 0 while the GPU reads 100%) and
    // its job is flagged idle after the window (3 s); the half's processes
    // still use 40%, so it is not. Back at 60%, the quarter is busy again.
    let listed = |id: &str| listed(&c, id);
    let mut without_quarter = procs.clone();
    without_quarter.as_array_mut().unwrap().pop();
    machine_with(without_quarter);
    let flagged = gpuctl_tests::try_wait_for(Duration::from_secs(30), || {
        listed(&quarter)["idle_since_ms"].as_u64().is_some()
    });
    assert!(flagged, "{}", listed(&quarter));
    assert!(
        listed(&half).get("idle_since_ms").is_none(),
        "{}",
        listed(&half)
    );
    machine_with(procs);
    let busy_again = gpuctl_tests::try_wait_for(Duration::from_secs(30), || {
        listed(&quarter)["idle_since_ms"].is_null()
    });
    assert!(busy_again, "{}", listed(&quarter));
    for j in [&half, &quarter] {
        c.ok(&["jobs", "cancel", j]);
    }
}

/// Issue 39 in foul weather: two fractions of a shared GPU, the leader
/// SIGKILLed while they run. The new leader charges each its own
/// processes' use against its share as the old one did (alpha's half at
/// 40% of the GPU: 80% busy), gives the quarter whose process NVML does
/// not list 0 (it is idle by its own readings, flagged and unflagged by the
/// new leader), the tasks' processes live on (seen in /proc), and once
/// they end both masters left report the same for each job.
#[test]
fn fractions_are_charged_their_own_across_a_leader_sigkill() {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipped: task cgroups need root");
        return;
    }
    let mut c = HaCluster::start(3, &["--utilization-period", "1s", "--idle-window", "3s"]);
    let machine = c.dir.path().join("machine.json");
    write_machine(&machine, 0);
    c.add_agent(AgentOpts::fake_nvml(&machine, "0.2"));
    c.ok(&["gpus", "share", GPU0, "--mode", "time-slice"]);
    let marker = "PROCUTIL";
    let value = gpuctl_tests::test_marker("procutil-failover");
    let env = format!("{marker}={value}");
    let fraction = |name: &str, tenant: &str, mem: &str| {
        let id = c.submit(&[
            "--name",
            name,
            "--tenant",
            tenant,
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
        let j = c.wait_state(&id, "RUNNING", Duration::from_secs(30));
        (id, j["tasks"][0]["id"].as_str().unwrap().to_string())
    };
    let (half, half_task) = fraction("half", "alpha", "20GiB");
    let (quarter, quarter_task) = fraction("quarter", "beta", "10GiB");
    let pids = || -> std::collections::BTreeMap<String, Vec<i32>> {
        let mut by: std::collections::BTreeMap<String, Vec<i32>> = Default::default();
        for t in gpuctl_tests::live_tasks(marker, &value) {
            by.entry(t.task_id).or_default().push(t.pid);
        }
        for p in by.values_mut() {
            p.sort();
        }
        by
    };
    let mut before = Default::default();
    gpuctl_tests::wait_for(Duration::from_secs(10), "the tasks' processes", || {
        before = pids();
        before.get(&half_task).is_some_and(|p| p.len() >= 2) && before.contains_key(&quarter_task)
    });
    // (pid, sm_util_pct) of the listed processes.
    let machine_with = |procs: &[(i32, u32)]| {
        let procs: Vec<Value> = procs
            .iter()
            .map(|(pid, u)| serde_json::json!({ "pid": pid, "memory_used_mib": 1000, "sm_util_pct": u }))
            .collect();
        gpuctl_tests::write_fake_machine(
            &machine,
            &serde_json::json!({
                "gpus": [
                    { "uuid": GPU0, "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960,
                      "memory_used_mib": 3000, "utilization_gpu_pct": 100, "processes": procs },
                    { "uuid": GPU1, "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960 }
                ],
                "events": []
            }),
        )
    };
    let half_only = [(before[&half_task][0], 30), (before[&half_task][1], 10)];
    machine_with(&half_only);
    let alpha = |c: &HaCluster| -> (u64, u64) {
        let r = report(c, &c.addrs(), "tenant");
        (
            field_or_0(&r, "alpha", "gpu_sampled_ms"),
            field_or_0(&r, "alpha", "gpu_busy_ms"),
        )
    };
    gpuctl_tests::wait_for(Duration::from_secs(30), "alpha's readings", || {
        alpha(&c).0 > 0
    });
    let old = c.leader_id();
    c.kill_master(old);
    c.wait_new_leader(old);
    // The new leader's periods: every reading is the same, so whole or
    // not, alpha's half was 80% busy.
    let start = alpha(&c);
    gpuctl_tests::wait_for(
        Duration::from_secs(30),
        "four periods of the new leader",
        || alpha(&c).0 >= start.0 + 4 * 500,
    );
    let end = alpha(&c);
    let (sampled, busy) = (end.0 - start.0, end.1 - start.1);
    assert_eq!(busy * 100, sampled * 80, "{start:?} -> {end:?}");
    // The quarter, unlisted on a GPU that was read, is idle by its own
    // readings; busy at 60%; idle again, each by the new leader.
    let flag = |c: &HaCluster, id: &str| listed(c, id)["idle_since_ms"].as_u64();
    for (procs, idle) in [
        (half_only.to_vec(), true),
        (
            [&half_only[..], &[(before[&quarter_task][0], 60)]].concat(),
            false,
        ),
        (half_only.to_vec(), true),
    ] {
        machine_with(&procs);
        let ok = gpuctl_tests::try_wait_for(Duration::from_secs(30), || {
            flag(&c, &quarter).is_some() == idle
        });
        assert!(ok, "quarter idle {idle}: {}", listed(&c, &quarter));
        assert_eq!(flag(&c, &half), None, "{}", listed(&c, &half));
    }
    // The same processes ran through it all, on their GPU only.
    assert_eq!(pids(), before);
    for t in gpuctl_tests::live_tasks(marker, &value) {
        assert_eq!(t.gpus, [GPU0], "pid {} of {}", t.pid, t.task_id);
    }
    for j in [&half, &quarter] {
        c.ok(&["jobs", "cancel", j]);
        c.wait_state(j, "CANCELLED", Duration::from_secs(30));
    }
    // Both masters left hold the same for each job.
    let live: Vec<String> = c
        .masters
        .iter()
        .filter(|(id, _)| **id != old)
        .map(|(_, m)| m.addr.clone())
        .collect();
    let rows = |addr: &str| {
        let r = report(&c, addr, "job");
        [&half, &quarter].map(|j| {
            (
                field_or_0(&r, j, "gpu_sampled_ms"),
                field_or_0(&r, j, "gpu_busy_ms"),
                field_or_0(&r, j, "gpu_ms"),
            )
        })
    };
    gpuctl_tests::wait_for(Duration::from_secs(20), "the masters agree", || {
        rows(&live[0]) == rows(&live[1])
    });
    assert!(rows(&live[0])[0].0 > 0, "{:?}", rows(&live[0]));
}
