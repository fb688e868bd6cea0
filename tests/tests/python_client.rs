//! The Python client of the framework API (clients/python) against real
//! masters and agents over loopback: its example framework runs tasks on
//! GPUs named by the offers, with one master and across a leader failover;
//! and its own unit checks pass.
//!
//! Needs python3 with the grpc and protobuf modules (Debian: python3-grpcio
//! python3-protobuf). Without them the tests print "skipped"; with
//! `GPUCTL_REQUIRE_DOCKER=1` (CI, which installs them) they fail instead.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use gpuctl_tests::{wait_for, workspace_root, AgentOpts, Cluster, Gpuctl, HaCluster};

/// A python3 that imports grpc and google.protobuf: `$GPUCTL_PYTHON`, else
/// `python3` on PATH, else the system's `/usr/bin/python3` (the Debian
/// packages install there; a pyenv or virtualenv python3 on PATH does not
/// see them). None, with "skipped" printed, when there is none; a panic
/// when `GPUCTL_REQUIRE_DOCKER=1`.
fn python_or_skip(test: &str) -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = std::env::var_os("GPUCTL_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    candidates.extend(["python3", "/usr/bin/python3"].map(PathBuf::from));
    let mut why = Vec::new();
    for python in candidates {
        match Command::new(&python)
            // Names from the modules, not the bare imports: a stray empty
            // `grpc` directory imports fine as a namespace package.
            .args([
                "-c",
                "from grpc import insecure_channel; from google.protobuf import message",
            ])
            .output()
        {
            Ok(o) if o.status.success() => return Some(python),
            Ok(o) => why.push(format!(
                "{}: {}",
                python.display(),
                String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .last()
                    .unwrap_or("failed")
            )),
            Err(e) => why.push(format!("{}: {e}", python.display())),
        }
    }
    let why = why.join("; ");
    if std::env::var("GPUCTL_REQUIRE_DOCKER").as_deref() == Ok("1") {
        panic!("{test}: python3 with grpc and protobuf is required (GPUCTL_REQUIRE_DOCKER=1; apt-get install python3-grpcio python3-protobuf) but none was found: {why}");
    }
    eprintln!("skipped: {test}: needs python3 with grpc and protobuf (apt-get install python3-grpcio python3-protobuf): {why}");
    None
}

fn client_dir() -> PathBuf {
    workspace_root().join("clients/python")
}

/// Runs `run_tasks.py --master <masters> --tasks <n> --gpus-per-task 1
/// <extra> -- sh -c <script>`, calls `during` meanwhile, and waits for it
/// (at most `timeout`, then kills it).
fn run_tasks(
    python: &Path,
    masters: &str,
    tasks: u32,
    extra: &[&str],
    script: &str,
    timeout: Duration,
    during: impl FnOnce(),
) -> Output {
    let child = Command::new(python)
        .arg(client_dir().join("examples/run_tasks.py"))
        .args(["--master", masters, "--tasks", &tasks.to_string()])
        .args(["--gpus-per-task", "1", "--timeout", "100", "--verbose"])
        .args(extra)
        .args(["--", "sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    // The example has its own timeout; this one only keeps a hung
    // interpreter from hanging the test.
    let watchdog = std::thread::spawn(move || {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                return;
            }
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    });
    during();
    let out = child.wait_with_output().unwrap();
    let _ = watchdog.join();
    out
}

/// One final line of the example: `task-0 FINISHED exit=0 agent=A gpus=G`.
#[derive(Debug)]
struct TaskLine {
    id: String,
    state: String,
    exit: Option<String>,
    agent: String,
    gpus: Vec<String>,
}

fn task_lines(stdout: &str) -> Vec<TaskLine> {
    stdout
        .lines()
        .filter(|l| l.starts_with("task-"))
        .map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let field = |k: &str| {
                words
                    .iter()
                    .find_map(|w| w.strip_prefix(&format!("{k}=")))
                    .map(str::to_string)
            };
            TaskLine {
                id: words[0].to_string(),
                state: words[1].to_string(),
                exit: field("exit"),
                agent: field("agent").unwrap_or_default(),
                gpus: field("gpus")
                    .unwrap_or_default()
                    .split(',')
                    .filter(|g| g.starts_with("GPU-"))
                    .map(str::to_string)
                    .collect(),
            }
        })
        .collect()
}

/// The framework id the example reports on stderr (`subscribed as fw-1`).
fn framework_id(stderr: &str) -> String {
    stderr
        .lines()
        .find_map(|l| l.strip_prefix("subscribed as "))
        .expect("the example reports its framework id")
        .trim()
        .to_string()
}

/// Asserts the final report: `tasks` lines, all FINISHED with exit 0, one
/// GPU each, never the same GPU twice.
fn assert_all_finished(out: &Output, tasks: usize, diagnostics: &str) -> Vec<TaskLine> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let context = format!("stdout:\n{stdout}\nstderr:\n{stderr}\n{diagnostics}");
    assert!(out.status.success(), "run_tasks.py failed: {context}");
    let lines = task_lines(&stdout);
    assert_eq!(lines.len(), tasks, "{context}");
    let mut gpus = BTreeSet::new();
    for t in &lines {
        assert_eq!(t.state, "FINISHED", "{}: {context}", t.id);
        assert_eq!(t.exit.as_deref(), Some("0"), "{}: {context}", t.id);
        assert_eq!(t.gpus.len(), 1, "{}: {context}", t.id);
        assert!(gpus.insert(t.gpus[0].clone()), "GPU given twice: {context}");
    }
    lines
}

/// No GPU of the cluster is held by a task, as `gpuctl gpus` sees it.
fn assert_gpus_free(c: &impl Gpuctl) {
    let gpus = c.json(&["gpus", "--json"]);
    let held: Vec<&serde_json::Value> = gpus
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| !g["task_id"].is_null())
        .collect();
    assert!(held.is_empty(), "GPUs still held: {held:?}");
}

#[test]
fn the_python_example_runs_tasks_on_the_gpus_it_names() {
    let Some(python) = python_or_skip("the_python_example_runs_tasks_on_the_gpus_it_names") else {
        return;
    };
    let mut c = Cluster::start(&[]);
    let agent = c.add_agent(AgentOpts::default());
    let out = run_tasks(
        &python,
        &c.master_addr,
        3,
        &[],
        "echo gpus=$NVIDIA_VISIBLE_DEVICES",
        Duration::from_secs(120),
        || {},
    );
    let lines = assert_all_finished(&out, 3, &c.diagnostics());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let fw = framework_id(&stderr);
    for t in &lines {
        assert_eq!(t.agent, agent);
        // Seen from the agent: the task ran in its sandbox with exactly the
        // GPU the framework named in its Accept.
        let log = c
            .dir
            .path()
            .join(format!("agent0/tasks/{fw}.{}/output.log", t.id));
        let output = std::fs::read_to_string(&log)
            .unwrap_or_else(|e| panic!("{}: {e}\n{stderr}", log.display()));
        assert_eq!(output.trim(), format!("gpus={}", t.gpus[0]), "{}", t.id);
    }
    // Seen from the master: the tasks ended and their GPUs are free.
    assert_gpus_free(&c);
}

/// Issue 34: with `--gpu-mem` the example asks fractions of the shared GPU
/// its offers name (`Offer.shared_gpus`, `TaskInfo.gpu_fraction`) instead
/// of whole GPUs: three halves of one 40 GiB GPU, all run on it (two at a
/// time), the whole GPU beside it untouched.
#[test]
fn the_python_example_runs_tasks_on_fractions_of_a_shared_gpu() {
    let Some(python) = python_or_skip("the_python_example_runs_tasks_on_fractions_of_a_shared_gpu")
    else {
        return;
    };
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts {
        simulate_gpus: Some("2xA100-SXM4-40GB"),
        ..Default::default()
    });
    let uuid = c.json(&["gpus", "--json"])[0]["uuid"]
        .as_str()
        .unwrap()
        .to_string();
    c.ok(&["gpus", "share", &uuid, "--mode", "time-slice"]);
    let out = run_tasks(
        &python,
        &c.master_addr,
        3,
        &["--gpu-mem", "20480", "--gpu-compute", "30"],
        "echo gpus=$NVIDIA_VISIBLE_DEVICES; sleep 1",
        Duration::from_secs(120),
        || {},
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let context = format!("stdout:\n{stdout}\nstderr:\n{stderr}\n{}", c.diagnostics());
    assert!(out.status.success(), "run_tasks.py failed: {context}");
    let lines = task_lines(&stdout);
    assert_eq!(lines.len(), 3, "{context}");
    for t in &lines {
        assert_eq!(t.state, "FINISHED", "{}: {context}", t.id);
        assert_eq!(t.gpus, vec![uuid.clone()], "{}: {context}", t.id);
        assert!(
            stderr.contains(&format!(
                "{} launching on {} with 20480 MiB of {uuid}",
                t.id, t.agent
            )),
            "{context}"
        );
    }
    // Seen from the master: the fractions ended, nothing is held.
    assert_gpus_free(&c);
    let gpus = c.json(&["gpus", "--json"]);
    assert!(
        gpus[0]["shares"].as_array().is_none_or(|s| s.is_empty()),
        "{gpus}"
    );
}

/// The example is given every master, a follower first: it follows the
/// `gpuctl-leader` redirect to subscribe, and when the leader is killed
/// while its tasks run, subscribes again at the new leader with its
/// framework id, so its tasks are kept, their updates acknowledged there
/// (by the client itself: `--auto-acknowledge`), and none runs twice.
#[test]
fn the_python_client_follows_the_leader_across_a_failover() {
    let Some(python) = python_or_skip("the_python_client_follows_the_leader_across_a_failover")
    else {
        return;
    };
    let mut c = HaCluster::start(3, &[]);
    c.add_agent(AgentOpts::default());
    let leader = c.leader_id();
    // Followers first, so that the first Subscribe is redirected.
    let mut ids: Vec<u64> = c.masters.keys().copied().collect();
    ids.sort_by_key(|id| *id == leader);
    let masters = ids
        .iter()
        .map(|id| c.addr(*id).to_string())
        .collect::<Vec<_>>()
        .join(",");
    // The tasks run as the agent's task user, not root.
    let runs = gpuctl_tests::task_shared_file(
        &gpuctl_tests::task_writable_dir(&c.dir.path().join("shared")).join("runs"),
    );
    let script = format!(
        "echo $NVIDIA_VISIBLE_DEVICES >> '{}'; sleep 4",
        runs.display()
    );
    let started = |n: usize| {
        std::fs::read_to_string(&runs)
            .map(|s| s.lines().count() >= n)
            .unwrap_or(false)
    };
    let mut killed = None;
    let out = run_tasks(
        &python,
        &masters,
        3,
        // The client's own acknowledgements: without them no task would
        // get past its first update that carries a uuid.
        &["--auto-acknowledge"],
        &script,
        Duration::from_secs(150),
        || {
            wait_for(
                Duration::from_secs(60),
                "the framework's tasks start",
                || started(3),
            );
            c.kill_master(leader);
            killed = Some(c.wait_new_leader(leader));
        },
    );
    assert!(killed.is_some());
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_all_finished(&out, 3, &c.diagnostics());
    assert!(
        stderr.contains(&format!(
            "{} is not the leader; redirected to {}",
            c.addr(ids[0]),
            c.addr(leader)
        )),
        "the first Subscribe did not follow the redirect:\n{stderr}"
    );
    // It subscribed twice, as the same framework.
    let subscriptions: BTreeSet<&str> = stderr
        .lines()
        .filter_map(|l| l.strip_prefix("subscribed as "))
        .collect();
    let count = stderr
        .lines()
        .filter(|l| l.starts_with("subscribed as "))
        .count();
    assert!(count >= 2, "no re-subscription:\n{stderr}");
    assert_eq!(subscriptions.len(), 1, "a new framework id:\n{stderr}");
    // Each task ran once: none was lost and relaunched across the failover.
    let ran = std::fs::read_to_string(&runs).unwrap();
    assert_eq!(ran.lines().count(), 3, "{ran}\n{stderr}");
    assert_gpus_free(&c);
}

#[test]
fn the_python_clients_own_checks_pass() {
    let Some(python) = python_or_skip("the_python_clients_own_checks_pass") else {
        return;
    };
    let out = Command::new(&python)
        .args(["-m", "unittest", "discover", "-s", "tests", "-v"])
        .current_dir(client_dir())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python3 -m unittest failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The Python client on a cluster with mutual TLS and tokens: the example
/// connects with the CA, an admin-made client certificate and a framework
/// token of tenant vision, subscribes with role vision and runs its tasks;
/// with the role of another tenant, or without a token, it is refused.
#[test]
fn the_python_client_speaks_tls_with_a_framework_token() {
    let Some(python) = python_or_skip("the_python_client_speaks_tls_with_a_framework_token") else {
        return;
    };
    let c = gpuctl_tests::SecureSingle::start(&[], "2xA100-SXM4-40GB");
    let (addr, pki) = (c.addr.clone(), c.pki.clone());
    let gpuctl = |args: &[&str]| c.ok(args);
    let token = gpuctl(&[
        "tokens",
        "create",
        "--role",
        "framework",
        "--tenant",
        "vision",
    ]);
    let pki_dir = pki.display().to_string();
    let out = run_tasks(
        &python,
        &addr,
        2,
        &["--tls-dir", &pki_dir, "--token", &token, "--role", "vision"],
        "echo gpus=$NVIDIA_VISIBLE_DEVICES",
        Duration::from_secs(120),
        || {},
    );
    assert_all_finished(&out, 2, &gpuctl_tests::tail(&c.master.log_text(), 30));
    // Another tenant's role: refused, and the example gives up.
    let out = run_tasks(
        &python,
        &addr,
        1,
        &[
            "--tls-dir",
            &pki_dir,
            "--token",
            &token,
            "--role",
            "nlp",
            "--timeout",
            "10",
        ],
        "true",
        Duration::from_secs(60),
        || {},
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("does not allow role"),
        "expected a refusal naming the role: {stderr}"
    );
}
