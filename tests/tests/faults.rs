//! Faults and limits with the real binaries and host-process tasks: an
//! agent SIGKILLed in the middle of launches starts every task once; sizes
//! are refused at the door with a one-line error naming the field (by
//! gpuctl with the master's own check, and by the master); more
//! than 4 MiB of environment across one agent's tasks flows to it, through
//! an agent restart, and is cancelled; a drain moves new work away, kills
//! at its deadline (or at once with --kill) and requeues without using a
//! retry. An outside watcher (/proc environ) checks throughout that no GPU
//! is used by two live tasks and no job runs twice at once.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::Value;

use gpuctl_tests::{live_tasks, try_wait_for, wait_for, AgentOpts, Cluster, InvariantWatch};
use gpuctl_tests::{test_marker, Gpuctl};

const MARKER: &str = "GPUCTL_FAULTS_TEST";

/// The job ids of `gpuctl jobs list ... --json`, in the order printed.
fn listed_ids(c: &Cluster, args: &[&str]) -> Vec<String> {
    let mut all = vec!["jobs", "list"];
    all.extend_from_slice(args);
    all.push("--json");
    c.json(&all)
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap().to_string())
        .collect()
}

/// The rows of the `gpuctl jobs list` table (lines naming a job).
fn table_rows(c: &Cluster, args: &[&str]) -> Vec<String> {
    let mut all = vec!["jobs", "list"];
    all.extend_from_slice(args);
    c.ok(&all)
        .lines()
        .filter(|l| l.contains("job-"))
        .map(str::to_string)
        .collect()
}

/// Job ids with a live task process (from /proc, outside gpuctl).
fn live_jobs(m: &str) -> BTreeSet<String> {
    live_tasks(MARKER, m)
        .into_iter()
        .map(|t| t.job_id)
        .collect()
}

#[test]
fn an_agent_sigkilled_during_launches_starts_every_task_exactly_once() {
    let m = test_marker("launch");
    let env = format!("{MARKER}={m}");
    let dir = gpuctl_tests::test_dir();
    // Written by the tasks, which do not run as root.
    let ran =
        gpuctl_tests::task_shared_file(&gpuctl_tests::task_writable_dir(dir.path()).join("ran"));
    let mut c = Cluster::start(&["--heartbeat-interval-secs", "0.2"]);
    c.add_agent(AgentOpts {
        stop_tasks_on_shutdown: false,
        ..Default::default()
    });
    let watch = InvariantWatch::start(MARKER, &m);
    let cmd = format!(
        "echo \"ran $GPUCTL_JOB_ID\" >> '{}'; sleep 2",
        ran.display()
    );
    // Killed a few ms to 300 ms after the submit returns (from before the
    // master placed the task to well into its start), or the moment a
    // launch step shows in the agent's work dir: the task's checkpoint
    // (task.json), the supervisor's launch file, its state file (the
    // command is starting).
    let rounds: [(&str, u64); 9] = [
        ("submit", 3),
        ("submit", 25),
        ("submit", 60),
        ("submit", 120),
        ("submit", 300),
        ("task.json", 0),
        ("launch.json", 0),
        ("launch.json", 3),
        ("supervisor.json", 0),
    ];
    let state_dir = c.dir.path().join("agent0/state");
    let mut jobs = Vec::new();
    for (i, (after, d)) in rounds.iter().enumerate() {
        let j = c.submit(&[
            "--name",
            &format!("launch{i}"),
            "--gpus",
            "1",
            "--env",
            &env,
            "--",
            "sh",
            "-c",
            &cmd,
        ]);
        if *after != "submit" {
            let file = state_dir.join(format!("{j}.0")).join(after);
            let deadline = Instant::now() + Duration::from_secs(20);
            while !file.exists() {
                assert!(
                    Instant::now() < deadline,
                    "{} never written",
                    file.display()
                );
                std::thread::sleep(Duration::from_micros(500));
            }
        }
        std::thread::sleep(Duration::from_millis(*d));
        c.agents[0].kill();
        let state = c.job(&j);
        let had_run = std::fs::read_to_string(&ran)
            .unwrap_or_default()
            .contains(&format!("ran {j}"));
        eprintln!(
            "{j}: agent killed {d} ms after {after}; job {}, task {}, command started: {had_run}",
            state["state"], state["tasks"][0]["state"]
        );
        c.restart_agent(0);
        // The next crash hits this task while it runs (sleep 2), and the
        // next launch.
        // (RUNNING, or already done when the restart was slow.)
        let mut last = Value::Null;
        let started = try_wait_for(Duration::from_secs(60), || {
            last = c.job(&j);
            last["state"] == "RUNNING" || last["state"] == "SUCCEEDED"
        });
        assert!(started, "{j} did not start: {last}\n{}", c.diagnostics());
        jobs.push(j);
    }
    for j in &jobs {
        let job = c.wait_state(j, "SUCCEEDED", Duration::from_secs(60));
        let tasks = job["tasks"].as_array().unwrap();
        assert_eq!(tasks.len(), 1, "{j} started more than once: {job}");
        assert_eq!(tasks[0]["exit_code"], 0, "{job}");
        assert_eq!(tasks[0]["state"], "FINISHED", "{job}");
    }
    let lines = std::fs::read_to_string(&ran).unwrap();
    for j in &jobs {
        let n = lines.lines().filter(|l| *l == format!("ran {j}")).count();
        assert_eq!(n, 1, "{j} ran {n} times:\n{lines}");
    }
    assert_eq!(lines.lines().count(), jobs.len(), "{lines}");
    assert!(live_jobs(&m).is_empty());
    watch.assert_held();
}

/// Runs `gpuctl jobs submit ARGS`, which must fail with one line on stderr
/// naming `field`; returns that line.
fn refused(c: &Cluster, args: &[&str], field: &str) -> String {
    let mut all = vec!["jobs", "submit"];
    all.extend_from_slice(args);
    let out = c.gpuctl(&all);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "accepted: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(out.stdout.is_empty(), "printed a job id on refusal");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "not one line: {err:?}");
    assert!(lines[0].contains(field), "{field} not named: {err}");
    // Names the field, does not echo a 32 KiB value back.
    assert!(lines[0].len() < 1024, "{} bytes of error", lines[0].len());
    lines[0].to_string()
}

#[test]
fn sizes_are_refused_at_the_door_and_jobs_list_limits_and_filters() {
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts::default());

    let over = format!("BIG_VALUE={}", "x".repeat(32 * 1024 + 1));
    let line = refused(
        &c,
        &["--name", "big-env", "--env", &over, "--", "true"],
        "spec.env[\"BIG_VALUE\"]",
    );
    assert!(line.contains("32768"), "{line}");
    // gpuctl refuses that before any call, with the master's own check; the
    // master's door still holds for every other client.
    let status = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let mut op = gpuctl_proto::pb::operator_client::OperatorClient::connect(format!(
            "http://{}",
            c.master_addr
        ))
        .await
        .unwrap();
        let spec = gpuctl_proto::pb::JobSpec {
            name: "big-env".into(),
            command: vec!["true".into()],
            env: [("BIG_VALUE".to_string(), "x".repeat(32 * 1024 + 1))].into(),
            ..Default::default()
        };
        op.submit_job(gpuctl_proto::pb::SubmitJobRequest {
            spec: Some(spec),
            ..Default::default()
        })
        .await
        .unwrap_err()
    });
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("spec.env[\"BIG_VALUE\"]") && status.message().contains("32768"),
        "{}",
        status.message()
    );
    let line = refused(
        &c,
        &[
            "--name",
            "huge-mem",
            "--mem",
            "18446744073709551615",
            "--",
            "true",
        ],
        "spec.resources.mem_mib",
    );
    assert!(line.starts_with("error: "), "{line}");
    // Nothing was created by the refusals.
    assert!(listed_ids(&c, &[]).is_empty());

    // At the limit is fine.
    let at = format!("AT_LIMIT={}", "y".repeat(32 * 1024));
    let mut ids = vec![c.submit(&["--name", "at-limit", "--env", &at, "--", "true"])];
    for i in 0..2 {
        ids.push(c.submit(&["--name", &format!("ok{i}"), "--", "true"]));
    }
    for j in &ids {
        assert_eq!(c.wait_job(j, 30), (0, "SUCCEEDED".to_string()));
    }
    // Fits nowhere (the agent has 4 GPUs): stays QUEUED.
    let queued = c.submit(&["--name", "too-big", "--gpus", "8", "--", "true"]);
    ids.push(queued.clone());
    assert_eq!(c.job(&queued)["state"], "QUEUED");

    // --limit N: the N most recent, oldest first.
    assert_eq!(listed_ids(&c, &[]), ids);
    assert_eq!(listed_ids(&c, &["--limit", "2"]), ids[2..].to_vec());
    let rows = table_rows(&c, &["--limit", "2"]);
    assert_eq!(rows.len(), 2, "{rows:#?}");
    assert!(
        rows[0].contains(&ids[2]) && rows[1].contains(&queued),
        "{rows:#?}"
    );
    // --state filters (any case, comma separated).
    assert_eq!(listed_ids(&c, &["--state", "QUEUED"]), vec![queued.clone()]);
    let rows = table_rows(&c, &["--state", "QUEUED"]);
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert!(rows[0].contains(&queued) && rows[0].contains("QUEUED"));
    assert_eq!(listed_ids(&c, &["--state", "succeeded"]), ids[..3].to_vec());
    assert_eq!(
        listed_ids(&c, &["--state", "SUCCEEDED", "--limit", "1"]),
        vec![ids[2].clone()]
    );
    assert_eq!(listed_ids(&c, &["--state", "QUEUED,SUCCEEDED"]), ids);
    assert!(listed_ids(&c, &["--state", "RUNNING"]).is_empty());
    // Bad values are usage errors.
    let out = c.gpuctl(&["jobs", "list", "--limit", "0"]);
    assert_eq!(out.status.code(), Some(2));
    let out = c.gpuctl(&["jobs", "list", "--state", "SLEEPING"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn more_than_4_mib_of_environment_across_one_agents_tasks() {
    let m = test_marker("bulk");
    let env = format!("{MARKER}={m}");
    let mut c = Cluster::start(&["--heartbeat-interval-secs", "0.2"]);
    c.add_agent(AgentOpts {
        extra: vec!["--cpus".into(), "64".into()],
        stop_tasks_on_shutdown: false,
        ..Default::default()
    });
    let watch = InvariantWatch::start(MARKER, &m);
    // 24 jobs of 7 x 30,000 bytes (210,000 each, under the 32 KiB per
    // value and 256 KiB per job limits): 5 MB in all, over gRPC's 4 MiB.
    const JOBS: usize = 24;
    const VARS: usize = 7;
    const VALUE: usize = 30_000;
    let mut jobs = Vec::new();
    for i in 0..JOBS {
        let fill = char::from(b'a' + (i % 26) as u8);
        let vars: Vec<String> = (0..VARS)
            .map(|k| format!("BULK_{k}={}", fill.to_string().repeat(VALUE)))
            .collect();
        let mut args = vec![
            "--name".to_string(),
            format!("bulk{i}"),
            "--cpus".into(),
            "0.5".into(),
            "--env".into(),
            env.clone(),
        ];
        for v in &vars {
            args.push("--env".into());
            args.push(v.clone());
        }
        args.extend(["--".into(), "sleep".into(), "300".into()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        jobs.push(c.submit(&args));
    }
    let started = Instant::now();
    let mut running = Vec::new();
    let all_running = try_wait_for(Duration::from_secs(120), || {
        running = listed_ids(&c, &["--state", "RUNNING"]);
        running.len() == JOBS
    });
    assert!(
        all_running,
        "{} of {JOBS} jobs RUNNING after {:?}\n{}",
        running.len(),
        started.elapsed(),
        c.diagnostics()
    );
    eprintln!("{JOBS} jobs RUNNING in {:?}", started.elapsed());
    wait_for(Duration::from_secs(20), "every task process live", || {
        live_jobs(&m).len() == JOBS
    });
    // The whole environment reached the processes.
    let t = live_tasks(MARKER, &m)
        .into_iter()
        .find(|t| t.job_id == jobs[JOBS - 1])
        .unwrap();
    let environ = std::fs::read(format!("/proc/{}/environ", t.pid)).unwrap();
    let fill = char::from(b'a' + ((JOBS - 1) % 26) as u8);
    for k in 0..VARS {
        let want = format!("BULK_{k}={}", fill.to_string().repeat(VALUE));
        assert!(
            environ.split(|b| *b == 0).any(|v| v == want.as_bytes()),
            "BULK_{k} missing or cut in the task's environment"
        );
    }

    // A crash and restart: the new agent process takes the whole desired
    // set (over 4 MiB) again and finds every task.
    c.agents[0].kill();
    c.restart_agent(0);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(live_jobs(&m).len(), JOBS, "tasks lost across the restart");
    let all_running = try_wait_for(Duration::from_secs(30), || {
        running = listed_ids(&c, &["--state", "RUNNING"]);
        running.len() == JOBS
    });
    assert!(all_running, "{running:?}\n{}", c.diagnostics());

    // Cancel them all: every one is killed, no process remains.
    for j in &jobs {
        c.ok(&["jobs", "cancel", j]);
    }
    for j in &jobs {
        let job = c.wait_state(j, "CANCELLED", Duration::from_secs(60));
        let tasks = job["tasks"].as_array().unwrap();
        assert_eq!(tasks.len(), 1, "{j}: {job}");
        assert_eq!(tasks[0]["state"], "KILLED", "{j}: {}", tasks[0]);
    }
    let gone = try_wait_for(Duration::from_secs(30), || live_jobs(&m).is_empty());
    assert!(gone, "task processes left: {:?}", live_jobs(&m));
    watch.assert_held();
}

/// Submits `sleep 300` on `gpus` GPUs.
fn sleeper(c: &Cluster, env: &str, name: &str, gpus: &str, more: &[&str]) -> String {
    let mut args = vec!["--name", name, "--gpus", gpus, "--env", env];
    args.extend_from_slice(more);
    args.extend_from_slice(&["--", "sleep", "300"]);
    c.submit(&args)
}

fn agent_row(c: &Cluster, id: &str) -> Value {
    c.agents_json()
        .into_iter()
        .find(|a| a["id"] == id)
        .unwrap_or_else(|| panic!("agent {id} not listed"))
}

/// The job is QUEUED again after a drain killed its latest task: the task
/// KILLED with reason AGENT_DRAINING, no retry used, not FAILED.
fn assert_requeued_by_drain(job: &Value, tasks: usize) {
    assert_eq!(job["state"], "QUEUED", "{job}");
    let ts = job["tasks"].as_array().unwrap();
    assert_eq!(ts.len(), tasks, "{job}");
    let last = &ts[tasks - 1];
    assert_eq!(last["state"], "KILLED", "{job}");
    assert_eq!(last["reason"], "AGENT_DRAINING", "{job}");
    assert_eq!(job["retries"], 0, "a drain used a retry: {job}");
}

#[test]
fn drain_moves_new_work_away_kills_at_its_deadline_and_requeues() {
    let m = test_marker("drain");
    let env = format!("{MARKER}={m}");
    let mut c = Cluster::start(&["--heartbeat-interval-secs", "0.2"]);
    let a = c.add_agent(AgentOpts {
        simulate_gpus: Some("2xA100-SXM4-40GB"),
        ..Default::default()
    });
    let watch = InvariantWatch::start(MARKER, &m);
    let held = sleeper(&c, &env, "held", "1", &[]);
    let job = c.wait_state(&held, "RUNNING", Duration::from_secs(60));
    assert_eq!(job["tasks"][0]["agent_id"], a.as_str());
    let b = c.add_agent(AgentOpts {
        simulate_gpus: Some("1xA100-SXM4-40GB"),
        ..Default::default()
    });

    // Drain A with a 3 s deadline.
    let drained_at = Instant::now();
    let printed = c.json(&["agents", "drain", &a, "--deadline", "3", "--json"]);
    assert_eq!(printed["draining"], true, "{printed}");
    assert!(printed["drain_deadline_ms"].as_u64().is_some(), "{printed}");
    let row = agent_row(&c, &a);
    assert_eq!(
        (&row["state"], &row["draining"]),
        (&"ACTIVE".into(), &true.into())
    );
    let table = c.ok(&["agents", "list"]);
    let line = table.lines().find(|l| l.contains(&a)).unwrap();
    assert!(line.contains("DRAINING"), "{table}");
    assert!(!table
        .lines()
        .find(|l| l.contains(&b))
        .unwrap()
        .contains("DRAINING"));

    // New work goes to B although A has a free GPU...
    let moved = sleeper(&c, &env, "moved", "1", &[]);
    let job = c.wait_state(&moved, "RUNNING", Duration::from_secs(30));
    assert_eq!(job["tasks"][0]["agent_id"], b.as_str(), "{job}");
    // ...and a job only A could hold waits, saying so.
    let only_a = sleeper(&c, &env, "only-a", "2", &[]);
    let job = c.job_with_reason(&only_a);
    assert_eq!(job["state"], "QUEUED", "{job}");
    let reason = job["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("draining") && reason.contains(&a),
        "the reason does not name the drain: {job}"
    );
    // Before the deadline the task runs on.
    if drained_at.elapsed() < Duration::from_millis(2500) {
        let job = c.job(&held);
        assert_eq!(job["state"], "RUNNING", "killed before the deadline: {job}");
        assert!(live_jobs(&m).contains(&held));
    }
    // At the deadline it is killed and its job requeued (A draining, B
    // full: it waits).
    let mut last = Value::Null;
    let requeued = try_wait_for(Duration::from_secs(20), || {
        last = c.job(&held);
        last["state"] != "RUNNING"
    });
    assert!(requeued, "not killed at the deadline: {last}");
    let killed_after = drained_at.elapsed();
    assert!(
        killed_after >= Duration::from_secs(3),
        "killed {killed_after:?} after a 3 s deadline"
    );
    assert_requeued_by_drain(&last, 1);
    assert!(!live_jobs(&m).contains(&held), "its process still runs");
    c.ok(&["jobs", "cancel", &only_a]);
    c.wait_state(&only_a, "CANCELLED", Duration::from_secs(30));
    assert_eq!(c.job(&held)["state"], "QUEUED");

    // Undrain: A takes work again.
    let printed = c.json(&["agents", "undrain", &a, "--json"]);
    assert_eq!(printed["draining"], false, "{printed}");
    let job = c.wait_state(&held, "RUNNING", Duration::from_secs(30));
    assert_eq!(job["tasks"].as_array().unwrap().len(), 2, "{job}");
    assert_eq!(job["tasks"][1]["agent_id"], a.as_str(), "{job}");
    assert_eq!(job["retries"], 0, "{job}");
    let once = sleeper(&c, &env, "once", "1", &["--no-requeue"]);
    let job = c.wait_state(&once, "RUNNING", Duration::from_secs(30));
    assert_eq!(job["tasks"][0]["agent_id"], a.as_str(), "{job}");

    // drain --kill: stopped now (SIGTERM; the grace is 2 s), requeued, or
    // FAILED for a job submitted with --no-requeue.
    let killed_at = Instant::now();
    c.ok(&["agents", "drain", &a, "--kill"]);
    let mut last = Value::Null;
    let stopped = try_wait_for(Duration::from_secs(10), || {
        last = c.job(&held);
        last["state"] != "RUNNING"
    });
    assert!(stopped, "drain --kill left it running: {last}");
    assert_requeued_by_drain(&last, 2);
    let job = c.wait_state(&once, "FAILED", Duration::from_secs(10));
    let t = &job["tasks"][0];
    assert_eq!(
        (&t["state"], &t["reason"]),
        (&"KILLED".into(), &"AGENT_DRAINING".into())
    );
    assert!(
        job["message"].as_str().unwrap().contains("--no-requeue"),
        "{job}"
    );
    wait_for(Duration::from_secs(5), "drained processes gone", || {
        let live = live_jobs(&m);
        !live.contains(&held) && !live.contains(&once)
    });
    eprintln!("drain --kill stopped both in {:?}", killed_at.elapsed());
    // B's job was never touched.
    let job = c.job(&moved);
    assert_eq!(job["state"], "RUNNING", "{job}");
    assert_eq!(job["tasks"].as_array().unwrap().len(), 1, "{job}");
    for j in [&held, &moved] {
        c.ok(&["jobs", "cancel", j]);
    }
    c.wait_state(&moved, "CANCELLED", Duration::from_secs(30));
    watch.assert_held();
}
