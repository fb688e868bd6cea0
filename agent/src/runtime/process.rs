//! Host-process runtime: the task's command runs directly on the agent's host,
//! in its own process group, with the sandbox as working directory.
//!
//! There is no isolation beyond what the executor sets up around it (cgroup,
//! device rules); this runtime is for hosts without Docker and for tests.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use gpuctl_proto::types::Runtime;
use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::sync::{oneshot, watch};

use super::{ContainerRuntime, LaunchSpec, RuntimeError, TaskExit};

/// Used when neither the task nor the agent has a `PATH`.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How often we look whether a process group has emptied during the grace period.
const GROUP_POLL: Duration = Duration::from_millis(50);

/// Runs tasks as host processes.
#[derive(Debug, Default, Clone)]
pub struct ProcessRuntime;

impl ProcessRuntime {
    pub fn new() -> ProcessRuntime {
        ProcessRuntime
    }
}

impl ContainerRuntime for ProcessRuntime {
    fn kind(&self) -> Runtime {
        Runtime::Process
    }

    fn run(
        &self,
        spec: LaunchSpec,
        running: oneshot::Sender<()>,
        kill: watch::Receiver<bool>,
    ) -> BoxFuture<'_, Result<TaskExit, RuntimeError>> {
        run_process(spec, running, kill).boxed()
    }

    /// Always 0: every task runs in its own process group, which is killed when
    /// the task ends or is killed. If the agent itself dies, its tasks are not
    /// tracked across restarts (they have no label to find them by), so there
    /// is nothing this runtime could reliably identify as its own.
    fn cleanup_orphans<'a>(
        &'a self,
        _agent_id: &'a str,
    ) -> BoxFuture<'a, Result<usize, RuntimeError>> {
        futures::future::ready(Ok(0)).boxed()
    }
}

async fn run_process(
    spec: LaunchSpec,
    running: oneshot::Sender<()>,
    mut kill: watch::Receiver<bool>,
) -> Result<TaskExit, RuntimeError> {
    let task_id = spec.task.task_id.as_str();
    let Some((program, args)) = spec.task.command.split_first() else {
        return Err(RuntimeError::Spawn {
            program: String::new(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("task {task_id}: empty command"),
            ),
        });
    };
    // Killed before it started: nothing to run, nothing to clean.
    if *kill.borrow() {
        return Ok(TaskExit::Killed);
    }

    let log = open_log(&spec.log_path)?;
    let log_err = log.try_clone().map_err(|source| RuntimeError::Io {
        path: spec.log_path.clone(),
        source,
    })?;

    let mut cmd = Command::new(program);
    cmd.args(args)
        .env_clear()
        .env(
            "PATH",
            std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into()),
        )
        .env("HOME", &spec.sandbox)
        .envs(&spec.env)
        .current_dir(&spec.sandbox)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log_err))
        // Own group: one signal reaches the command and everything it forks.
        .process_group(0)
        // If this future is dropped, at least the leader does not outlive it.
        .kill_on_drop(true);
    crate::isolation::join::join_before_exec(&mut cmd, &spec.isolation.cgroup_procs)
        .map_err(|e| RuntimeError::Other(format!("task {task_id}: {e}")))?;

    let mut child = cmd.spawn().map_err(|source| RuntimeError::Spawn {
        program: program.clone(),
        source,
    })?;
    let Some(pid) = child.id() else {
        return Err(RuntimeError::Other(format!(
            "task {task_id}: spawned process has no pid"
        )));
    };
    // The group id is the leader's pid (process_group(0)).
    let pgid = Pid::from_raw(pid as i32);
    let mut guard = KillGroupOnDrop { pgid, armed: true };
    tracing::debug!(task_id, pid, program = %program, "task process started");
    // The receiver may be gone if the executor stopped caring; not our problem.
    let _ = running.send(());

    tokio::select! {
        status = child.wait() => {
            let status = status.map_err(|e| wait_error(task_id, e))?;
            // Background children the command left behind must not outlive the task.
            signal_group(pgid, Signal::SIGKILL);
            guard.armed = false;
            let code = exit_code(status);
            tracing::debug!(task_id, code, "task process exited");
            return Ok(TaskExit::Exited(code));
        }
        () = kill_requested(&mut kill) => {}
    }

    terminate_group(&mut child, pgid, spec.kill_grace)
        .await
        .map_err(|e| wait_error(task_id, e))?;
    guard.armed = false;
    tracing::debug!(task_id, "task process killed");
    Ok(TaskExit::Killed)
}

/// SIGKILLs the group if the run future is dropped before the task ended
/// (`kill_on_drop` alone would only reach the leader).
struct KillGroupOnDrop {
    pgid: Pid,
    armed: bool,
}

impl Drop for KillGroupOnDrop {
    fn drop(&mut self) {
        if self.armed {
            signal_group(self.pgid, Signal::SIGKILL);
        }
    }
}

/// Resolves when the kill flag turns true; never if the sender is dropped
/// without asking (the task then simply runs to its end).
async fn kill_requested(kill: &mut watch::Receiver<bool>) {
    if kill.wait_for(|k| *k).await.is_err() {
        futures::future::pending::<()>().await;
    }
}

/// SIGTERM to the group, up to `grace` for the leader to exit and the group to
/// empty, then SIGKILL to whatever is left, and reap the leader.
async fn terminate_group(child: &mut Child, pgid: Pid, grace: Duration) -> std::io::Result<()> {
    let deadline = tokio::time::Instant::now() + grace;
    signal_group(pgid, Signal::SIGTERM);
    if tokio::time::timeout_at(deadline, child.wait())
        .await
        .is_ok()
    {
        // Leader reaped; give the rest of the group what remains of the grace.
        while group_alive(pgid) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(GROUP_POLL).await;
        }
    }
    signal_group(pgid, Signal::SIGKILL);
    child.wait().await.map(|_| ())
}

fn signal_group(pgid: Pid, signal: Signal) {
    match killpg(pgid, signal) {
        // ESRCH: the group is already empty.
        Ok(()) | Err(Errno::ESRCH) => {}
        Err(e) => tracing::warn!(pgid = pgid.as_raw(), %signal, error = %e, "killpg failed"),
    }
}

/// True while the group has a member that is not a zombie. Orphaned members
/// that died stay signalable until their new parent reaps them, which may
/// take a while, so `killpg(0)` alone would make us wait out the grace.
fn group_alive(pgid: Pid) -> bool {
    if matches!(killpg(pgid, None), Err(Errno::ESRCH)) {
        return false;
    }
    // Without /proc we cannot tell zombies apart: assume alive.
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return true;
    };
    entries.flatten().any(|entry| {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            return false;
        };
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| parse_stat(&stat))
            .is_some_and(|(state, pgrp)| state != 'Z' && pgrp == pgid.as_raw())
    })
}

/// State and process group from a `/proc/<pid>/stat` line:
/// "pid (comm) state ppid pgrp ..."; comm may contain spaces and parentheses.
fn parse_stat(stat: &str) -> Option<(char, i32)> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let pgrp = fields.nth(1)?.parse().ok()?;
    Some((state, pgrp))
}

/// The exit code, or 128 + signal for a process killed by a signal, like a shell.
fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        (None, None) => -1,
    }
}

fn open_log(path: &Path) -> Result<std::fs::File, RuntimeError> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|source| RuntimeError::Io {
            path: path.to_path_buf(),
            source,
        })
}

fn wait_error(task_id: &str, e: std::io::Error) -> RuntimeError {
    RuntimeError::Other(format!("task {task_id}: waiting for the process: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::time::Instant;

    use gpuctl_proto::types::{Resources, TaskSpec};

    fn spec(dir: &Path, task_id: &str, command: &[&str]) -> LaunchSpec {
        let sandbox = dir.join("sandbox");
        std::fs::create_dir_all(&sandbox).unwrap();
        LaunchSpec {
            task: TaskSpec {
                task_id: task_id.to_string(),
                job_id: "job-proc".to_string(),
                framework_id: String::new(),
                image: None,
                command: command.iter().map(|s| s.to_string()).collect(),
                env: BTreeMap::new(),
                resources: Resources::default(),
                gpu_uuids: vec![],
                no_fence: false,
            },
            agent_id: "agent-proc-test".to_string(),
            env: BTreeMap::from([("GPUCTL_TASK_ID".to_string(), task_id.to_string())]),
            sandbox,
            log_path: dir.join("task.log"),
            kill_grace: Duration::from_secs(2),
            isolation: Default::default(),
        }
    }

    /// Runs to the end without killing; also checks `running` was sent.
    async fn run_to_end(spec: LaunchSpec) -> Result<TaskExit, RuntimeError> {
        let (tx, rx) = oneshot::channel();
        let (_kill_tx, kill_rx) = watch::channel(false);
        let res = ProcessRuntime::new().run(spec, tx, kill_rx).await;
        if res.is_ok() {
            rx.await.expect("running was not sent");
        }
        res
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
            if let Some((state, pgrp)) = parse_stat(&stat) {
                if state != 'Z' && pgrp == pgid {
                    out.push(pid);
                }
            }
        }
        out
    }

    #[test]
    fn stat_lines_are_parsed() {
        assert_eq!(parse_stat("12 (sh) S 1 12 12 0 -1"), Some(('S', 12)));
        assert_eq!(parse_stat("13 (a) b (c)) Z 12 7 7 0"), Some(('Z', 7)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[tokio::test]
    async fn output_goes_to_log_and_exit_zero() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(
            dir.path(),
            "proc-out",
            &[
                "sh",
                "-c",
                "echo to-stdout; echo to-stderr >&2; echo \"id=$GPUCTL_TASK_ID home=$HOME\"; pwd",
            ],
        );
        let sandbox = s.sandbox.clone();
        let log = s.log_path.clone();
        std::fs::write(&log, "previous line\n").unwrap();
        assert_eq!(run_to_end(s).await.unwrap(), TaskExit::Exited(0));
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(
            text.starts_with("previous line\n"),
            "log not appended: {text}"
        );
        assert!(text.contains("to-stdout"), "{text}");
        assert!(text.contains("to-stderr"), "{text}");
        assert!(
            text.contains(&format!("id=proc-out home={}", sandbox.display())),
            "{text}"
        );
        assert!(text.contains(&format!("{}\n", sandbox.display())), "{text}");
    }

    #[tokio::test]
    async fn env_is_only_the_spec_env() {
        std::env::set_var("GPUCTL_PROCESS_TEST_LEAK", "leaked");
        let dir = tempfile::tempdir().unwrap();
        let s = spec(dir.path(), "proc-env", &["env"]);
        let log = s.log_path.clone();
        assert_eq!(run_to_end(s).await.unwrap(), TaskExit::Exited(0));
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(!text.contains("GPUCTL_PROCESS_TEST_LEAK"), "{text}");
        assert!(text.contains("GPUCTL_TASK_ID=proc-env"), "{text}");
        assert!(text.contains("PATH="), "{text}");
    }

    #[tokio::test]
    async fn exit_code_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(dir.path(), "proc-exit3", &["sh", "-c", "exit 3"]);
        assert_eq!(run_to_end(s).await.unwrap(), TaskExit::Exited(3));
    }

    #[tokio::test]
    async fn foreign_signal_is_128_plus_signal() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(dir.path(), "proc-sig", &["sh", "-c", "kill -9 $$"]);
        assert_eq!(run_to_end(s).await.unwrap(), TaskExit::Exited(128 + 9));
    }

    #[tokio::test]
    async fn missing_program_is_spawn_error() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(
            dir.path(),
            "proc-missing",
            &["/nonexistent/gpuctl-no-such-program"],
        );
        match run_to_end(s).await {
            Err(RuntimeError::Spawn { program, .. }) => {
                assert_eq!(program, "/nonexistent/gpuctl-no-such-program")
            }
            other => panic!("expected Spawn error, got {other:?}"),
        }
    }

    /// Starts `command`, waits for `running`, returns the pid, then kills it
    /// through the watch and checks it returned Killed in time.
    async fn start_then_kill(dir: &Path, task_id: &str, command: &[&str]) -> i32 {
        let s = spec(dir, task_id, command);
        let log = s.log_path.clone();
        let (run_tx, run_rx) = oneshot::channel();
        let (kill_tx, kill_rx) = watch::channel(false);
        let handle =
            tokio::spawn(async move { ProcessRuntime::new().run(s, run_tx, kill_rx).await });
        run_rx.await.unwrap();
        // The shell writes its pid first, so we know it is up.
        let deadline = Instant::now() + Duration::from_secs(5);
        let pid = loop {
            if let Ok(text) = std::fs::read_to_string(&log) {
                if let Some(line) = text.lines().next() {
                    break line.trim().parse::<i32>().unwrap();
                }
            }
            assert!(Instant::now() < deadline, "task never wrote its pid");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        // Let the children start too.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!live_group_members(pid).is_empty());
        let started = Instant::now();
        kill_tx.send(true).unwrap();
        let res = handle.await.unwrap().unwrap();
        assert_eq!(res, TaskExit::Killed);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "kill took {:?}",
            started.elapsed()
        );
        pid
    }

    #[tokio::test]
    async fn kill_stops_the_process() {
        let dir = tempfile::tempdir().unwrap();
        let pid = start_then_kill(
            dir.path(),
            "proc-kill",
            &["sh", "-c", "echo $$; exec sleep 30"],
        )
        .await;
        assert_eq!(
            nix::sys::signal::kill(Pid::from_raw(pid), None),
            Err(Errno::ESRCH),
            "leader {pid} still exists"
        );
        assert_eq!(live_group_members(pid), Vec::<i32>::new());
    }

    #[tokio::test]
    async fn kill_reaches_children() {
        let dir = tempfile::tempdir().unwrap();
        let pid = start_then_kill(
            dir.path(),
            "proc-kill-children",
            &["sh", "-c", "echo $$; sleep 30 & sleep 30 & wait"],
        )
        .await;
        assert_eq!(live_group_members(pid), Vec::<i32>::new());
    }

    #[tokio::test]
    async fn sigterm_ignoring_task_gets_sigkill_after_grace() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spec(
            dir.path(),
            "proc-stubborn",
            &[
                "sh",
                "-c",
                "trap '' TERM; echo ready; while :; do sleep 1; done",
            ],
        );
        s.kill_grace = Duration::from_millis(500);
        let log = s.log_path.clone();
        let (run_tx, run_rx) = oneshot::channel();
        let (kill_tx, kill_rx) = watch::channel(false);
        let handle =
            tokio::spawn(async move { ProcessRuntime::new().run(s, run_tx, kill_rx).await });
        run_rx.await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("ready")
        {
            assert!(Instant::now() < deadline, "task never got ready");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let started = Instant::now();
        kill_tx.send(true).unwrap();
        assert_eq!(handle.await.unwrap().unwrap(), TaskExit::Killed);
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(450),
            "SIGKILL came before the grace: {took:?}"
        );
        assert!(took < Duration::from_secs(3), "kill took {took:?}");
    }

    #[tokio::test]
    async fn dropping_the_run_future_kills_the_group() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(
            dir.path(),
            "proc-drop",
            &["sh", "-c", "echo $$; sleep 30 & sleep 30"],
        );
        let log = s.log_path.clone();
        let (run_tx, run_rx) = oneshot::channel();
        let (_kill_tx, kill_rx) = watch::channel(false);
        let handle =
            tokio::spawn(async move { ProcessRuntime::new().run(s, run_tx, kill_rx).await });
        run_rx.await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let pid = loop {
            if let Some(line) = std::fs::read_to_string(&log)
                .unwrap_or_default()
                .lines()
                .next()
            {
                break line.trim().parse::<i32>().unwrap();
            }
            assert!(Instant::now() < deadline, "task never wrote its pid");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        handle.abort();
        let _ = handle.await;
        let deadline = Instant::now() + Duration::from_secs(2);
        while !live_group_members(pid).is_empty() {
            assert!(
                Instant::now() < deadline,
                "group survived the dropped future"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn background_children_do_not_outlive_a_finished_task() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(
            dir.path(),
            "proc-bg",
            &["sh", "-c", "echo $$; sleep 30 & exit 0"],
        );
        let log = s.log_path.clone();
        assert_eq!(run_to_end(s).await.unwrap(), TaskExit::Exited(0));
        let text = std::fs::read_to_string(&log).unwrap();
        let pid: i32 = text.lines().next().unwrap().trim().parse().unwrap();
        // SIGKILL delivery is asynchronous; allow a moment.
        let deadline = Instant::now() + Duration::from_secs(2);
        while !live_group_members(pid).is_empty() {
            assert!(Instant::now() < deadline, "background child survived");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
