//! The host-process runtime against the real supervisor: every task here
//! runs under `gpuctl-agent supervise STATE_DIR` (this package's binary),
//! exactly as the agent runs it.
//!
//! Every test stops what it started; a test that fails half-way leaves
//! nothing behind either: [`Task`]'s `Drop` kills the supervisor and the
//! task's process group.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuctl_agent::checkpoint::{self, Contact};
use gpuctl_agent::runtime::supervisor::{self, SupervisorState, STATE_FILE};
use gpuctl_agent::runtime::{
    ContainerRuntime, Ended, LaunchSpec, Observed, ProcessRuntime, RuntimeError, TaskRef,
};
use gpuctl_core::types::{Resources, TaskSpec, UserIds};
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use tempfile::TempDir;

/// What the runtime puts in a task's `PATH` when neither the task nor the
/// agent has one.
const MISSING_PROGRAM: &str = "/nonexistent/gpuctl-no-such-program";

fn runtime() -> ProcessRuntime {
    ProcessRuntime::new(PathBuf::from(env!("CARGO_BIN_EXE_gpuctl-agent")))
}

/// One task: its temporary work dir (sandbox, state dir, log, contact file)
/// and a runtime to drive it.
struct Task {
    rt: ProcessRuntime,
    spec: LaunchSpec,
    /// The agent's `contact.json`, when the test fences.
    contact: PathBuf,
    /// Removed after `Drop` killed what was left.
    _dir: TempDir,
}

impl Task {
    fn new(task_id: &str, command: &[&str]) -> Task {
        let dir = tempfile::tempdir().unwrap();
        let sandbox = dir.path().join("tasks").join(task_id);
        let state_dir = dir.path().join("state").join(task_id);
        std::fs::create_dir_all(&sandbox).unwrap();
        std::fs::create_dir_all(&state_dir).unwrap();
        let spec = LaunchSpec {
            task: TaskSpec {
                share: None,
                task_id: task_id.to_string(),
                job_id: "job-proc".to_string(),
                framework_id: String::new(),
                gpu_uuids: vec![],
                template: gpuctl_core::types::TaskTemplate {
                    stop_grace_ms: None,
                    checkpoint_dir: None,
                    image: None,
                    command: command.iter().map(|s| s.to_string()).collect(),
                    env: BTreeMap::new(),
                    resources: Resources::default(),
                    no_fence: false,
                    security: Default::default(),
                    hang_timeout_ms: None,
                    preflight: false,
                    options: Default::default(),
                },
            },
            agent_id: "agent-proc-test".to_string(),
            env: BTreeMap::from([("GPUCTL_TASK_ID".to_string(), task_id.to_string())]),
            log_path: sandbox.join("output.log"),
            sandbox,
            // Long: a task that ends quickly after `stop` ended of SIGTERM,
            // not of the SIGKILL after the grace.
            kill_grace: Duration::from_secs(10),
            isolation: Default::default(),
            state_dir,
            fence: None,
            // As the agent itself (root here): the user tests below set one.
            security: Default::default(),
        };
        Task {
            rt: runtime(),
            contact: checkpoint::contact_path(dir.path()),
            spec,
            _dir: dir,
        }
    }

    fn tref(&self) -> TaskRef {
        self.spec.task_ref()
    }

    async fn start(&self) -> Result<(), RuntimeError> {
        self.rt.start(&self.spec).await
    }

    async fn observe(&self) -> Observed {
        self.rt.observe(&self.tref()).await.unwrap()
    }

    async fn stop(&self) {
        self.rt
            .stop(&self.tref(), self.spec.kill_grace)
            .await
            .unwrap();
    }

    /// `wait`, bounded: a task that does not end `within` fails the test.
    async fn wait(&self, within: Duration) -> Ended {
        tokio::time::timeout(within, self.rt.wait(&self.tref()))
            .await
            .unwrap_or_else(|_| panic!("the task did not end within {within:?}"))
            .unwrap()
    }

    fn state(&self) -> SupervisorState {
        checkpoint::read_json(&self.spec.state_dir.join(STATE_FILE))
            .unwrap()
            .expect("no supervisor.json")
    }

    /// The task's pid, which is also its process group.
    fn task_pid(&self) -> i32 {
        self.state().task.expect("the task has no pid").pid
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.spec.log_path).unwrap_or_default()
    }

    /// Waits until the log contains `needle`.
    async fn log_contains(&self, needle: &str) {
        eventually(
            &format!("{needle:?} in the log"),
            Duration::from_secs(5),
            || self.log().contains(needle),
        )
        .await;
    }

    /// Records an agent's contact with a leader now.
    fn touch_contact(&self, fence_timeout_ms: u64) {
        checkpoint::write_json(
            &self.contact,
            &Contact {
                last_contact_ms: checkpoint::wall_ms(),
                fence_timeout_ms,
            },
        )
        .unwrap();
    }
}

impl Drop for Task {
    /// Whatever the test left running: SIGKILL to the task's group, then
    /// to its supervisor.
    fn drop(&mut self) {
        let Ok(Some(state)) =
            checkpoint::read_json::<SupervisorState>(&self.spec.state_dir.join(STATE_FILE))
        else {
            return;
        };
        if let Some(task) = state.task {
            if !live_group_members(task.pid).is_empty() {
                let _ = killpg(Pid::from_raw(task.pid), Signal::SIGKILL);
            }
        }
        if state.supervisor.alive() {
            let _ = kill(Pid::from_raw(state.supervisor.pid), Signal::SIGKILL);
        }
    }
}

/// Polls `done` every 20 ms; fails the test after `within`.
async fn eventually(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "no {what} within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Pids of the live (not zombie) processes in a process group, from /proc.
fn live_group_members(pgid: i32) -> Vec<i32> {
    let mut out = vec![];
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        if let Some(st) = supervisor::parse_stat(&stat) {
            if st.state != 'Z' && st.pgrp == pgid {
                out.push(pid);
            }
        }
    }
    out
}

/// The process group of a live process.
fn pgrp(pid: i32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    supervisor::parse_stat(&stat).unwrap().pgrp
}

fn ended(code: i32) -> Ended {
    Ended {
        code: Some(code),
        ..Default::default()
    }
}

/// Killed by `sig`: the code a shell would say, and the signal itself.
fn killed(sig: i32) -> Ended {
    Ended {
        code: Some(128 + sig),
        signal: Some(sig),
        ..Default::default()
    }
}

// --- output, environment, exit codes ------------------------------------

#[tokio::test]
async fn output_is_appended_to_the_log_and_home_and_cwd_are_the_sandbox() {
    let task = Task::new(
        "proc-out",
        &[
            "sh",
            "-c",
            "echo to-stdout; echo to-stderr >&2; echo \"id=$GPUCTL_TASK_ID home=$HOME\"; pwd",
        ],
    );
    std::fs::write(&task.spec.log_path, "previous line\n").unwrap();
    task.start().await.unwrap();
    assert_eq!(task.wait(Duration::from_secs(10)).await, ended(0));
    let text = task.log();
    assert!(
        text.starts_with("previous line\n"),
        "log not appended: {text}"
    );
    assert!(text.contains("to-stdout\n"), "{text}");
    assert!(text.contains("to-stderr\n"), "{text}");
    let sandbox = &task.spec.sandbox;
    assert!(
        text.contains(&format!("id=proc-out home={}\n", sandbox.display())),
        "{text}"
    );
    let cwd = sandbox.canonicalize().unwrap();
    assert!(
        text.lines().any(|l| l == cwd.display().to_string()),
        "cwd is not {}: {text}",
        cwd.display()
    );
}

/// The sorted `NAME=value` lines `env` printed into the task's log.
async fn env_of(task: &Task) -> Vec<String> {
    task.start().await.unwrap();
    assert_eq!(task.wait(Duration::from_secs(10)).await, ended(0));
    let mut lines: Vec<String> = task.log().lines().map(str::to_string).collect();
    lines.sort();
    lines
}

#[tokio::test]
async fn env_is_exactly_the_spec_env_plus_path_and_home() {
    // Nothing of the agent's own environment reaches a task.
    std::env::set_var("GPUCTL_PROCESS_RUNTIME_TEST_LEAK", "leaked");

    let mut task = Task::new("proc-env", &["env"]);
    task.spec.env.insert("GPUCTL_EXTRA".into(), "a b=c".into());
    // The plain PATH, not the agent's own.
    let our_path = gpuctl_agent::runtime::process::TASK_PATH;
    let mut want = vec![
        "GPUCTL_EXTRA=a b=c".to_string(),
        "GPUCTL_TASK_ID=proc-env".to_string(),
        format!("HOME={}", task.spec.sandbox.display()),
        format!("PATH={our_path}"),
    ];
    want.sort();
    assert_eq!(env_of(&task).await, want);

    // A PATH of the task's own is kept.
    let mut task = Task::new("proc-env-path", &["env"]);
    let path = "/usr/bin:/bin:/gpuctl-test-path";
    task.spec.env.insert("PATH".into(), path.into());
    let mut want = vec![
        "GPUCTL_TASK_ID=proc-env-path".to_string(),
        format!("HOME={}", task.spec.sandbox.display()),
        format!("PATH={path}"),
    ];
    want.sort();
    assert_eq!(env_of(&task).await, want);
}

#[tokio::test]
async fn exit_codes_are_reported() {
    for (id, script, want) in [
        ("proc-exit3", "exit 3", ended(3)),
        ("proc-sig9", "kill -9 $$", killed(9)),
        ("proc-exit0", "exit 0", ended(0)),
    ] {
        let task = Task::new(id, &["sh", "-c", script]);
        task.start().await.unwrap();
        assert_eq!(
            task.wait(Duration::from_secs(10)).await,
            want.clone(),
            "{script}"
        );
        // And so says `observe`, from the exit record.
        assert_eq!(task.observe().await, Observed::Ended(want), "{script}");
    }
}

#[tokio::test]
async fn a_missing_program_fails_the_start_and_ends_with_an_error() {
    let task = Task::new("proc-missing", &[MISSING_PROGRAM]);
    assert_eq!(task.observe().await, Observed::NotStarted);
    let err = task.start().await.expect_err("a missing program started");
    assert!(err.to_string().contains(MISSING_PROGRAM), "{err}");
    let Observed::Ended(e) = task.observe().await else {
        panic!("not ended: {:?}", task.observe().await);
    };
    assert_eq!(e.code, None);
    assert!(!e.fenced);
    assert!(
        e.error
            .as_deref()
            .is_some_and(|m| m.contains(MISSING_PROGRAM)),
        "{e:?}"
    );
    // `wait` does not hang on it either.
    assert_eq!(task.wait(Duration::from_secs(5)).await, e);
}

/// A task starts like any program, with no signal blocked: the
/// supervisor's own mask (it reads SIGTERM, SIGINT, SIGHUP and SIGCHLD from
/// a signalfd) must not reach it, or `stop` and the fence could only ever
/// SIGKILL it after the grace, and it would never see a SIGCHLD.
#[tokio::test]
async fn the_task_starts_with_no_signal_blocked() {
    let mut task = Task::new("proc-sigmask", &["sleep", "300"]);
    task.spec.kill_grace = GRACE;
    task.start().await.unwrap();
    let pid = task.task_pid();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let blocked = status
        .lines()
        .find_map(|l| l.strip_prefix("SigBlk:"))
        .unwrap()
        .trim()
        .to_string();
    task.stop().await;
    task.wait(GRACE + SLACK).await;
    assert_eq!(
        u64::from_str_radix(&blocked, 16).unwrap(),
        0,
        "signals blocked in the task (SigBlk, bit n-1 = signal n): {blocked}"
    );
}

// --- stopping --------------------------------------------------------------

#[tokio::test]
async fn stop_ends_a_task_quickly() {
    let task = Task::new("proc-stop", &["sleep", "300"]);
    task.start().await.unwrap();
    assert_eq!(task.observe().await, Observed::Running);
    let pid = task.task_pid();
    assert_eq!(live_group_members(pid), vec![pid]);
    let t = Instant::now();
    task.stop().await;
    assert_eq!(task.wait(Duration::from_secs(5)).await, killed(15));
    // The grace is 10 s: SIGTERM did it.
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "stop took {:?}",
        t.elapsed()
    );
    assert_eq!(live_group_members(pid), Vec::<i32>::new());
    let task_proc = task.state().task.unwrap();
    assert!(!task_proc.alive());
}

#[tokio::test]
async fn stop_reaches_the_tasks_children() {
    let task = Task::new(
        "proc-stop-children",
        &["sh", "-c", "echo $$; sleep 30 & sleep 30 & wait"],
    );
    task.start().await.unwrap();
    let pid = task.task_pid();
    task.log_contains(&format!("{pid}\n")).await;
    eventually(
        "shell and both sleeps in the group",
        Duration::from_secs(5),
        || live_group_members(pid).len() >= 3,
    )
    .await;
    let t = Instant::now();
    task.stop().await;
    assert_eq!(task.wait(Duration::from_secs(5)).await, killed(15));
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "stop took {:?}",
        t.elapsed()
    );
    // The supervisor only lets go once the whole group is gone.
    assert_eq!(live_group_members(pid), Vec::<i32>::new());
}

#[tokio::test]
async fn a_task_ignoring_sigterm_gets_sigkill_after_the_grace() {
    let mut task = Task::new(
        "proc-stubborn",
        &[
            "sh",
            "-c",
            "trap '' TERM; echo ready; while :; do sleep 1; done",
        ],
    );
    task.spec.kill_grace = Duration::from_millis(500);
    task.start().await.unwrap();
    task.log_contains("ready\n").await;
    let pid = task.task_pid();
    let t = Instant::now();
    task.stop().await;
    assert_eq!(task.wait(Duration::from_secs(5)).await, killed(9));
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(450),
        "SIGKILL came before the grace: {took:?}"
    );
    assert!(took < Duration::from_secs(3), "stop took {took:?}");
    eventually("empty group", Duration::from_secs(2), || {
        live_group_members(pid).is_empty()
    })
    .await;
}

#[tokio::test]
async fn background_children_do_not_outlive_a_task_that_exited() {
    let task = Task::new("proc-bg", &["sh", "-c", "echo $$; sleep 30 & exit 0"]);
    task.start().await.unwrap();
    let pid = task.task_pid();
    assert_eq!(task.wait(Duration::from_secs(10)).await, ended(0));
    assert_eq!(task.log(), format!("{pid}\n"));
    // SIGKILL is delivered asynchronously.
    eventually("empty group", Duration::from_secs(2), || {
        live_group_members(pid).is_empty()
    })
    .await;
}

// --- tasks outlive the agent -----------------------------------------------

fn tokio_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// What an agent restart does to a task: the runtime value that started it
/// (and the async runtime it ran on, and a `wait` given up half-way) go
/// away; a new one finds the task running and follows it to its end.
#[test]
fn the_task_outlives_its_runtime() {
    let task = Task::new("proc-outlive", &["sh", "-c", "echo $$; sleep 2; exit 7"]);
    let tref = task.tref();
    {
        let tokio_rt = tokio_runtime();
        let first = runtime();
        tokio_rt.block_on(async {
            first.start(&task.spec).await.unwrap();
            let gave_up = tokio::time::timeout(Duration::from_millis(100), first.wait(&tref))
                .await
                .is_err();
            assert!(gave_up, "the task ended at once: {}", task.log());
        });
        drop(first);
        drop(tokio_rt);
    }
    let pid = task.task_pid();
    assert!(
        live_group_members(pid).contains(&pid),
        "the task did not survive"
    );

    let second = runtime();
    tokio_runtime().block_on(async {
        assert_eq!(second.observe(&tref).await.unwrap(), Observed::Running);
        // A recovering agent may launch it again: it is not started twice.
        second.start(&task.spec).await.unwrap();
        let end = tokio::time::timeout(Duration::from_secs(10), second.wait(&tref))
            .await
            .expect("the task did not end")
            .unwrap();
        assert_eq!(end, ended(7));
    });
    let log = task.log();
    assert_eq!(
        log.lines().filter(|l| *l == pid.to_string()).count(),
        1,
        "{log}"
    );
    assert_eq!(log.lines().count(), 1, "the task ran more than once: {log}");
}

#[tokio::test]
async fn start_twice_runs_the_task_once() {
    let task = Task::new("proc-twice", &["sh", "-c", "echo started; sleep 1; exit 5"]);
    assert_eq!(task.observe().await, Observed::NotStarted);
    // Stopping or removing a task that never started does nothing.
    task.stop().await;
    task.rt.remove(&task.tref()).await.unwrap();
    assert_eq!(task.observe().await, Observed::NotStarted);

    task.start().await.unwrap();
    let pid = task.task_pid();
    // Again, by this runtime and by another (a second agent process).
    task.start().await.unwrap();
    runtime().start(&task.spec).await.unwrap();
    assert_eq!(task.observe().await, Observed::Running);
    assert_eq!(task.task_pid(), pid);
    assert_eq!(task.wait(Duration::from_secs(10)).await, ended(5));
    // And after it ended.
    task.start().await.unwrap();
    assert_eq!(task.observe().await, Observed::Ended(ended(5)));
    assert_eq!(task.wait(Duration::from_secs(5)).await, ended(5));
    assert_eq!(task.log(), "started\n");
}

#[tokio::test]
async fn concurrent_starts_run_the_task_once() {
    for i in 0..5 {
        let task = Task::new(&format!("proc-race-{i}"), &["sh", "-c", "echo started"]);
        let (a, b) = (runtime(), runtime());
        let (ra, rb) = tokio::join!(a.start(&task.spec), b.start(&task.spec));
        ra.unwrap();
        rb.unwrap();
        assert_eq!(task.wait(Duration::from_secs(10)).await, ended(0));
        assert_eq!(task.log(), "started\n", "round {i}");
    }
}

/// `observe` only looks: a supervisor that starts while someone observes
/// its task (another agent process recovering it, say) still runs it, and
/// `start` does not return `Ok` for a task that will never run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observing_a_task_does_not_keep_it_from_starting() {
    for i in 0..40 {
        let task = Task::new(&format!("proc-observed-{i}"), &["sh", "-c", "echo started"]);
        let done = Arc::new(AtomicBool::new(false));
        let observer = {
            let (done, rt, tref) = (done.clone(), runtime(), task.tref());
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    let _ = futures::executor::block_on(rt.observe(&tref));
                }
            })
        };
        let started = task.start().await;
        done.store(true, Ordering::Relaxed);
        observer.join().unwrap();
        let supervisor_log =
            std::fs::read_to_string(task.spec.state_dir.join(supervisor::LOG_FILE))
                .unwrap_or_default();
        started.unwrap();
        let e = task.wait(Duration::from_secs(10)).await;
        assert_eq!(
            (e, task.log()),
            (ended(0), "started\n".to_string()),
            "round {i}; the supervisor said: {supervisor_log}"
        );
    }
}

/// Kills the task's supervisor and waits until it is gone; returns the
/// task's pid.
async fn kill_supervisor(task: &Task) -> i32 {
    let pid = task.task_pid();
    task.log_contains(&format!("{pid}\n")).await;
    eventually("shell and its sleeps", Duration::from_secs(5), || {
        live_group_members(pid).len() >= 3
    })
    .await;
    let sup = task.state().supervisor;
    kill(Pid::from_raw(sup.pid), Signal::SIGKILL).unwrap();
    eventually("dead supervisor", Duration::from_secs(5), || !sup.alive()).await;
    pid
}

fn is_supervisor_death(e: &Ended) -> bool {
    e.code.is_none() && !e.fenced && e.error.is_some()
}

#[tokio::test]
async fn the_task_of_a_dead_supervisor_is_killed_by_observe() {
    let task = Task::new(
        "proc-orphan-observe",
        &["sh", "-c", "echo $$; sleep 30 & sleep 30 & wait"],
    );
    task.start().await.unwrap();
    let pid = kill_supervisor(&task).await;
    // Nobody killed the task yet: the supervisor's death alone does not.
    assert!(live_group_members(pid).len() >= 3);
    let Observed::Ended(e) = task.observe().await else {
        panic!("a task without a supervisor is not ended");
    };
    assert!(is_supervisor_death(&e), "{e:?}");
    eventually("empty group", Duration::from_secs(2), || {
        live_group_members(pid).is_empty()
    })
    .await;
    assert!(is_supervisor_death(
        &task.wait(Duration::from_secs(5)).await
    ));
}

#[tokio::test]
async fn the_task_of_a_dead_supervisor_is_killed_by_wait() {
    let task = Task::new(
        "proc-orphan-wait",
        &["sh", "-c", "echo $$; sleep 30 & sleep 30 & wait"],
    );
    task.start().await.unwrap();
    // Followed since before its supervisor died.
    let (rt, tref) = (task.rt.clone(), task.tref());
    let waiting = tokio::spawn(async move { rt.wait(&tref).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished());
    let pid = kill_supervisor(&task).await;
    let e = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("wait did not return")
        .unwrap()
        .unwrap();
    assert!(is_supervisor_death(&e), "{e:?}");
    eventually("empty group", Duration::from_secs(2), || {
        live_group_members(pid).is_empty()
    })
    .await;
    assert!(matches!(task.observe().await, Observed::Ended(e) if is_supervisor_death(&e)));
}

// --- fencing -----------------------------------------------------------------

const FENCE: Duration = Duration::from_millis(1500);
const GRACE: Duration = Duration::from_millis(500);
/// Scheduling on a loaded machine, and the supervisor's 200 ms tick.
const SLACK: Duration = Duration::from_secs(2);

fn fenced_task(task_id: &str) -> Task {
    let mut task = Task::new(task_id, &["sleep", "300"]);
    task.spec.kill_grace = GRACE;
    task.spec.fence = Some(task.contact.clone());
    task
}

#[tokio::test]
async fn a_task_is_fenced_when_the_agent_loses_contact() {
    let task = fenced_task("proc-fence");
    task.touch_contact(FENCE.as_millis() as u64);
    let contact = Instant::now();
    task.start().await.unwrap();
    assert_eq!(task.observe().await, Observed::Running);
    let pid = task.task_pid();
    let e = task.wait(FENCE + GRACE + SLACK + SLACK).await;
    let took = contact.elapsed();
    // The task gets SIGTERM (its own handlers run): 143.
    assert!(
        e.fenced && e.error.is_none() && e.code == Some(143),
        "{e:?}"
    );
    assert!(
        took >= FENCE - Duration::from_millis(100),
        "fenced before the fence timeout: {took:?}"
    );
    assert!(took < FENCE + GRACE + SLACK, "fenced only after {took:?}");
    assert_eq!(live_group_members(pid), Vec::<i32>::new());
}

/// The agent's work dir was wiped under a running task: nobody can report
/// or stop it any more, so its supervisor stops it (it may hold a GPU the
/// master will give away).
#[tokio::test]
async fn a_task_whose_agent_records_vanished_is_stopped() {
    let task = fenced_task("proc-orphaned");
    // A fence far away: only the missing file can stop it.
    task.touch_contact(3_600_000);
    task.start().await.unwrap();
    assert_eq!(task.observe().await, Observed::Running);
    let pid = task.task_pid();
    std::fs::remove_file(&task.contact).unwrap();
    let e = task.wait(GRACE + SLACK + SLACK).await;
    assert!(e.fenced && e.code == Some(143), "{e:?}");
    assert_eq!(live_group_members(pid), Vec::<i32>::new());
}

#[tokio::test]
async fn a_no_fence_task_keeps_running_without_contact() {
    let mut task = fenced_task("proc-no-fence");
    task.spec.task.template.no_fence = true;
    task.spec.fence = None;
    // The agent's contact expires all the same.
    task.touch_contact(FENCE.as_millis() as u64);
    let deadline = Instant::now() + FENCE + GRACE + SLACK;
    task.start().await.unwrap();
    while Instant::now() < deadline {
        assert_eq!(task.observe().await, Observed::Running);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pid = task.task_pid();
    assert_eq!(live_group_members(pid), vec![pid]);
    task.stop().await;
    let e = task.wait(Duration::from_secs(5)).await;
    assert!(!e.fenced && e.code.is_some(), "{e:?}");
}

#[tokio::test]
async fn a_refreshed_contact_keeps_the_task_running() {
    let task = fenced_task("proc-contact");
    task.touch_contact(FENCE.as_millis() as u64);
    task.start().await.unwrap();
    let pid = task.task_pid();
    let until = Instant::now() + FENCE * 2 + GRACE;
    let mut last_contact = Instant::now();
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(300)).await;
        task.touch_contact(FENCE.as_millis() as u64);
        last_contact = Instant::now();
        assert_eq!(task.observe().await, Observed::Running);
    }
    assert_eq!(live_group_members(pid), vec![pid]);
    // Contact lost from here on: the fence was armed all along.
    let e = task.wait(FENCE + GRACE + SLACK + SLACK).await;
    let took = last_contact.elapsed();
    assert!(e.fenced, "{e:?}");
    assert!(
        took >= FENCE - Duration::from_millis(100),
        "fenced before the fence timeout: {took:?}"
    );
    assert!(took < FENCE + GRACE + SLACK, "fenced only after {took:?}");
}

// --- the supervisor's place ----------------------------------------------------

/// A Ctrl-C or a signal to the agent's process group never reaches a
/// supervisor or its task: each leads a group of its own.
#[tokio::test]
async fn the_supervisor_and_the_task_lead_process_groups_of_their_own() {
    let mut task = Task::new("proc-groups", &["sleep", "300"]);
    task.spec.kill_grace = GRACE;
    task.start().await.unwrap();
    let state = task.state();
    let (sup, pid) = (state.supervisor.pid, task.task_pid());
    let ours = nix::unistd::getpgrp().as_raw();
    let (sup_pgrp, task_pgrp) = (pgrp(sup), pgrp(pid));
    assert_eq!(sup_pgrp, sup, "the supervisor leads no group");
    assert_ne!(sup_pgrp, ours, "the supervisor is in the test's group");
    assert_eq!(task_pgrp, pid, "the task leads no group");
    assert_ne!(task_pgrp, sup_pgrp);
    assert_ne!(task_pgrp, ours);
    task.stop().await;
    let e = task.wait(task.spec.kill_grace + SLACK).await;
    assert!(e.code.is_some() && !e.fenced, "{e:?}");
}

// --- the task's user -------------------------------------------------------

/// Switching users needs root; says so when it is not there.
fn root_or_skip(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    eprintln!("skipped: {test}: needs root to run a task as another user");
    false
}

/// A task that prints who it is and what it may do.
const WHO_AM_I: &str = "id -u; id -g; id -G; grep -E '^(NoNewPrivs|CapEff):' /proc/self/status; \
    if cat /etc/shadow >/dev/null 2>&1; then echo shadow-read; else echo shadow-denied; fi; \
    echo mine > file-of-mine && echo wrote-sandbox";

fn as_user(task_id: &str, command: &[&str], uid: u32, gid: u32) -> Task {
    let mut t = Task::new(task_id, command);
    t.spec.security.user = Some(UserIds { uid, gid });
    t
}

#[tokio::test]
async fn a_task_runs_as_its_user_without_groups_or_new_privileges() {
    if !root_or_skip("a_task_runs_as_its_user_without_groups_or_new_privileges") {
        return;
    }
    let task = as_user("proc-user", &["sh", "-c", WHO_AM_I], 65534, 65534);
    task.start().await.unwrap();
    assert_eq!(task.wait(Duration::from_secs(10)).await, ended(0));
    let text = task.log();
    let lines: Vec<&str> = text.lines().collect();
    // uid, gid, and no group but its own (the agent's root groups dropped).
    assert_eq!(lines[..3], ["65534", "65534", "65534"], "{text}");
    assert!(text.contains("NoNewPrivs:\t1\n"), "{text}");
    assert!(text.contains("CapEff:\t0000000000000000\n"), "{text}");
    assert!(text.contains("shadow-denied\n"), "{text}");
    assert!(text.contains("wrote-sandbox\n"), "{text}");
    // Its sandbox is its own and private; its log stays the agent's.
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let sandbox = std::fs::metadata(&task.spec.sandbox).unwrap();
    assert_eq!((sandbox.uid(), sandbox.gid()), (65534, 65534));
    assert_eq!(sandbox.permissions().mode() & 0o777, 0o700);
    let log = std::fs::metadata(&task.spec.log_path).unwrap();
    assert_eq!(log.uid(), 0);
    let mine = std::fs::metadata(task.spec.sandbox.join("file-of-mine")).unwrap();
    assert_eq!(mine.uid(), 65534);
}

#[tokio::test]
async fn a_task_as_root_keeps_root() {
    if !root_or_skip("a_task_as_root_keeps_root") {
        return;
    }
    // No user in the launch: the supervisor's (what run_as_root gives).
    let task = Task::new("proc-root", &["sh", "-c", WHO_AM_I]);
    task.start().await.unwrap();
    assert_eq!(task.wait(Duration::from_secs(10)).await, ended(0));
    let text = task.log();
    assert_eq!(text.lines().next(), Some("0"), "{text}");
    assert!(text.contains("shadow-read\n"), "{text}");
    // Even root's task cannot gain privileges through exec.
    assert!(text.contains("NoNewPrivs:\t1\n"), "{text}");
}

/// The task joins its cgroup as root, then becomes its user: not one
/// instruction of it runs outside the cgroup, and it cannot leave it.
#[tokio::test]
async fn a_task_of_another_user_still_joins_its_cgroup_first() {
    if !root_or_skip("a_task_of_another_user_still_joins_its_cgroup_first") {
        return;
    }
    let root = PathBuf::from("/sys/fs/cgroup/pids");
    if !root.join("cgroup.procs").exists() {
        eprintln!("skipped: no cgroup v1 pids hierarchy at {}", root.display());
        return;
    }
    let name = format!("gpuctl-test-user-{}", std::process::id());
    let cg = root.join(&name);
    std::fs::create_dir_all(&cg).unwrap();
    struct Remove(PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let _cleanup = Remove(cg.clone());
    let mut task = as_user(
        "proc-user-cg",
        &[
            "sh",
            "-c",
            "id -u; grep pids /proc/self/cgroup; echo $$ > /sys/fs/cgroup/pids/cgroup.procs && echo left || echo stayed",
        ],
        1234,
        1234,
    );
    task.spec.isolation.cgroup_procs = vec![cg.join("cgroup.procs")];
    task.start().await.unwrap();
    assert_eq!(task.wait(Duration::from_secs(10)).await, ended(0));
    let text = task.log();
    assert_eq!(text.lines().next(), Some("1234"), "{text}");
    assert!(text.contains(&format!(":pids:/{name}\n")), "{text}");
    assert!(text.contains("stayed\n"), "{text}");
}

/// A link put where the log goes (by another task of the same user, in the
/// sandbox it owns) is refused, not written through.
#[tokio::test]
async fn the_log_is_never_written_through_a_link() {
    if !root_or_skip("the_log_is_never_written_through_a_link") {
        return;
    }
    let task = as_user("proc-link", &["true"], 65534, 65534);
    let target = task._dir.path().join("precious");
    std::fs::write(&target, "precious\n").unwrap();
    std::os::unix::fs::symlink(&target, &task.spec.log_path).unwrap();
    let err = task.start().await.unwrap_err().to_string();
    assert!(err.contains("output.log"), "{err}");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious\n");
    // The supervisor refuses a link too (it checks the file it opens).
    std::fs::remove_file(&task.spec.log_path).unwrap();
    std::fs::hard_link(&target, &task.spec.log_path).unwrap();
    let err = supervisor::open_log(&task.spec.log_path).unwrap_err();
    assert!(err.contains("refused"), "{err}");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious\n");
}

// --- namespaces of its own ---------------------------------------------------

/// A task as the agent runs a default host task: its own user, and PID,
/// mount and IPC namespaces of its own under task-init.
fn namespaced(task_id: &str, command: &[&str], uid: u32) -> Task {
    let mut t = as_user(task_id, command, uid, uid);
    t.spec.security.namespaces = true;
    t
}

/// `pid:[inode]` of a process's PID namespace.
fn pid_ns(pid: i32) -> Option<String> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid"))
        .ok()
        .map(|p| p.display().to_string())
}

/// Live processes of the host in the PID namespace `ns`.
fn members_of(ns: &str) -> Vec<i32> {
    let mut out = vec![];
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| supervisor::parse_stat(&s))
            .is_some_and(|st| st.state != 'Z');
        if alive && pid_ns(pid).as_deref() == Some(ns) {
            out.push(pid);
        }
    }
    out
}

/// The `Uid:` line's real uid of a process.
fn uid_of(pid: i32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn a_namespaced_task_sees_and_reaches_only_itself() {
    if !root_or_skip("a_namespaced_task_sees_and_reaches_only_itself") {
        return;
    }
    // Made on the host before the task starts: its private /tmp and
    // /dev/shm do not show them.
    let marker = format!("gpuctl-ns-test-{}", std::process::id());
    std::fs::write(std::env::temp_dir().join(&marker), "host\n").unwrap();
    let shm = std::path::Path::new("/dev/shm").join(&marker);
    let _ = std::fs::write(&shm, "host\n");
    let script = format!(
        "echo pid=$$; echo procs=$(ls /proc | grep -c '^[0-9]'); \
         echo init=$(tr '\\0' ' ' < /proc/1/cmdline | cut -d' ' -f2); \
         if kill -0 $AGENT_PID 2>/dev/null; then echo agent-reached; else echo agent-unreachable; fi; \
         if [ -e /tmp/{marker} ]; then echo host-tmp-seen; else echo host-tmp-private; fi; \
         if [ -e /dev/shm/{marker} ]; then echo host-shm-seen; else echo host-shm-private; fi; \
         echo x > /tmp/mine && echo tmp-writable; \
         ls $HOME >/dev/null && echo sandbox-visible; \
         ls $DEV_ROOT/nvidia0 >/dev/null && echo devices-visible; \
         echo ready; sleep 300"
    );
    let mut task = namespaced("proc-ns", &["sh", "-c", &script], 80500);
    let dev = task._dir.path().join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    std::fs::write(dev.join("nvidia0"), "").unwrap();
    task.spec.isolation.dev_root = Some(dev.clone());
    task.spec
        .env
        .insert("AGENT_PID".into(), std::process::id().to_string());
    task.spec
        .env
        .insert("DEV_ROOT".into(), dev.display().to_string());
    task.start().await.unwrap();
    task.log_contains("ready\n").await;
    let text = task.log();
    // The command is the namespace's second process, task-init its first.
    assert!(text.contains("pid=2\n"), "{text}");
    assert!(text.contains("init=task-init\n"), "{text}");
    // task-init, the shell, its subshell, ls and grep at most.
    let procs: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("procs="))
        .unwrap()
        .parse()
        .unwrap();
    assert!(procs <= 5, "{text}");
    for want in [
        "agent-unreachable",
        "host-tmp-private",
        "tmp-writable",
        "sandbox-visible",
        "devices-visible",
    ] {
        assert!(text.contains(&format!("{want}\n")), "{want}: {text}");
    }
    if shm.exists() {
        assert!(text.contains("host-shm-private\n"), "{text}");
    }
    // From outside: task-init is in a PID namespace that is not ours, the
    // command with it, as its user; task-init stays root.
    let init = task.task_pid();
    let ns = pid_ns(init).unwrap();
    assert_ne!(Some(ns.clone()), pid_ns(std::process::id() as i32));
    let members = members_of(&ns);
    assert!(members.len() >= 2, "{members:?}");
    assert_eq!(uid_of(init), 0);
    for pid in members.iter().filter(|p| **p != init) {
        assert_eq!(uid_of(*pid), 80500, "process {pid}");
    }
    // Nothing it mounted reached the host.
    assert!(!std::path::Path::new("/tmp/mine").exists());
    task.stop().await;
    task.wait(Duration::from_secs(5)).await;
    // The namespace died with its init: nothing of the task is left.
    eventually("an empty namespace", Duration::from_secs(2), || {
        members_of(&ns).is_empty()
    })
    .await;
    let _ = std::fs::remove_file(std::env::temp_dir().join(&marker));
    let _ = std::fs::remove_file(&shm);
}

#[tokio::test]
async fn a_namespaced_task_gets_signals_exit_codes_and_no_survivors() {
    if !root_or_skip("a_namespaced_task_gets_signals_exit_codes_and_no_survivors") {
        return;
    }
    // SIGTERM reaches the command through task-init (a PID 1 would ignore
    // it), and its own exit code is what the task ends with.
    let task = namespaced(
        "proc-ns-term",
        &[
            "sh",
            "-c",
            "trap 'echo got-term; exit 7' TERM; echo ready; while :; do sleep 1; done",
        ],
        80501,
    );
    task.start().await.unwrap();
    task.log_contains("ready\n").await;
    task.stop().await;
    assert_eq!(task.wait(Duration::from_secs(5)).await, ended(7));
    assert!(task.log().contains("got-term\n"), "{}", task.log());

    for (id, script, want) in [
        ("proc-ns-exit3", "exit 3", ended(3)),
        ("proc-ns-sig9", "kill -9 $$", killed(9)),
        ("proc-ns-exit0", "exit 0", ended(0)),
    ] {
        let task = namespaced(id, &["sh", "-c", script], 80502);
        task.start().await.unwrap();
        assert_eq!(task.wait(Duration::from_secs(10)).await, want, "{script}");
    }

    // What the command left in the background dies with it.
    let task = namespaced(
        "proc-ns-bg",
        &["sh", "-c", "sleep 300 & echo started; sleep 0.5; exit 0"],
        80503,
    );
    task.start().await.unwrap();
    task.log_contains("started\n").await;
    let ns = pid_ns(task.task_pid()).unwrap();
    assert!(members_of(&ns).len() >= 2);
    assert_eq!(task.wait(Duration::from_secs(10)).await, ended(0));
    eventually("an empty namespace", Duration::from_secs(2), || {
        members_of(&ns).is_empty()
    })
    .await;

    // A command that ignores SIGTERM is killed with its namespace after
    // the grace.
    let mut task = namespaced(
        "proc-ns-stubborn",
        &[
            "sh",
            "-c",
            "trap '' TERM; echo ready; while :; do sleep 1; done",
        ],
        80504,
    );
    task.spec.kill_grace = Duration::from_millis(500);
    task.start().await.unwrap();
    task.log_contains("ready\n").await;
    task.stop().await;
    assert_eq!(task.wait(Duration::from_secs(5)).await, killed(9));
}

#[tokio::test]
async fn a_namespaced_task_that_cannot_start_says_why() {
    if !root_or_skip("a_namespaced_task_that_cannot_start_says_why") {
        return;
    }
    let task = namespaced("proc-ns-missing", &[MISSING_PROGRAM], 80505);
    // The supervisor starts task-init; task-init fails to start the
    // command: the task ends with the error, not an exit code.
    let _ = task.start().await;
    let e = task.wait(Duration::from_secs(10)).await;
    assert_eq!(e.code, None, "{e:?}");
    assert!(
        e.error
            .as_deref()
            .is_some_and(|m| m.contains(MISSING_PROGRAM)),
        "{e:?}"
    );
    // A program its user may not run: the error names the user.
    let task = namespaced("proc-ns-denied", &["/root/.gpuctl-no-such/x"], 80506);
    let _ = task.start().await;
    let e = task.wait(Duration::from_secs(10)).await;
    let msg = e.error.unwrap_or_default();
    assert!(msg.contains("80506:80506"), "{msg}");
}
