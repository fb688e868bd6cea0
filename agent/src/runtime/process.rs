//! Host-process runtime: the task's command runs directly on the agent's
//! host, in its own process group, with the sandbox as working directory,
//! under a per-task supervisor process (`runtime::supervisor`) that outlives
//! the agent. Everything the agent needs to find the task again is in the
//! task's state directory.
//!
//! Beyond what the executor sets up around it (cgroup, device rules), the
//! task runs as the user its launch names (the agent's `task_user` by
//! default), without supplementary groups and with `no_new_privs`; the
//! sandbox is given to that user, the log stays the agent's. This runtime is
//! for hosts without Docker and for tests.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use gpuctl_core::time::Backoff;
use gpuctl_core::types::{Runtime, UserIds};
use nix::fcntl::{Flock, FlockArg};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::supervisor::{
    self, ExitRecord, Launch, SupervisorState, EXIT_FILE, LAUNCH_FILE, LOCK_FILE, STATE_FILE,
};
use super::{ContainerRuntime, Ended, LaunchSpec, Observed, RuntimeError, RuntimeStatus, TaskRef};
use crate::checkpoint;

/// A host task's `PATH` unless its job sets one: the plain user
/// directories, not the agent's own (root's `sbin`s, whatever the service
/// manager put there).
pub const TASK_PATH: &str = "/usr/local/bin:/usr/bin:/bin";
/// How long a supervisor may take to start its task.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Runs tasks as host processes, each under `<exe> supervise <state-dir>`.
#[derive(Debug, Clone)]
pub struct ProcessRuntime {
    /// A binary that runs [`supervisor::main_if_requested`] first thing:
    /// `gpuctl-agent` (or `gpuctl`, whose demo runs an agent in-process).
    exe: PathBuf,
}

impl ProcessRuntime {
    pub fn new(exe: PathBuf) -> ProcessRuntime {
        ProcessRuntime { exe }
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> RuntimeError + '_ {
    move |source| RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn checkpoint_err(e: checkpoint::CheckpointError) -> RuntimeError {
    RuntimeError::Other(e.to_string())
}

/// Whether a supervisor holds the task's lock now.
fn supervisor_alive(dir: &Path) -> Result<bool, RuntimeError> {
    let path = dir.join(LOCK_FILE);
    let file = match std::fs::OpenOptions::new().write(true).open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_err(&path)(e)),
    };
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        // Nobody held it; let go at once.
        Ok(lock) => {
            drop(lock);
            Ok(false)
        }
        Err(_) => Ok(true),
    }
}

fn ended_from(rec: ExitRecord) -> Ended {
    Ended {
        code: rec.code,
        fenced: rec.fenced,
        error: rec.error,
        signal: rec.signal,
        ..Default::default()
    }
}

/// What the task directory says. A supervisor that died without an exit
/// record (OOM-killed, say) leaves the task without anyone to report its
/// exit: whatever is left of it is killed and it ends with an error.
fn observe_dir(dir: &Path) -> Result<Observed, RuntimeError> {
    if let Some(rec) =
        checkpoint::read_json::<ExitRecord>(&dir.join(EXIT_FILE)).map_err(checkpoint_err)?
    {
        return Ok(Observed::Ended(ended_from(rec)));
    }
    if supervisor_alive(dir)? {
        return Ok(Observed::Running);
    }
    // The supervisor may have written its exit record just before we looked
    // at the lock.
    if let Some(rec) =
        checkpoint::read_json::<ExitRecord>(&dir.join(EXIT_FILE)).map_err(checkpoint_err)?
    {
        return Ok(Observed::Ended(ended_from(rec)));
    }
    match checkpoint::read_json::<SupervisorState>(&dir.join(STATE_FILE)).map_err(checkpoint_err)? {
        None => Ok(Observed::NotStarted),
        Some(state) => {
            // A supervisor that started after the lock was looked at may
            // have written this state: it takes the lock before it writes
            // anything and holds it for life, so a lock held now means it
            // is alive, and a free one that it is gone. (Killing on the
            // first look killed a task that was just starting.)
            if supervisor_alive(dir)? {
                return Ok(Observed::Running);
            }
            if let Some(rec) =
                checkpoint::read_json::<ExitRecord>(&dir.join(EXIT_FILE)).map_err(checkpoint_err)?
            {
                return Ok(Observed::Ended(ended_from(rec)));
            }
            if let Some(task) = state.task.filter(|t| t.alive()) {
                supervisor::signal_group(Pid::from_raw(task.pid), Signal::SIGKILL);
            }
            Ok(Observed::Ended(Ended {
                code: None,
                fenced: false,
                error: Some("its supervisor died; the task was killed".into()),
                ..Default::default()
            }))
        }
    }
}

/// Makes the sandbox the task user's own (its working directory and HOME),
/// readable by nobody else. The log is made first, as the agent's: the
/// supervisor appends to it and the agent serves it, and neither follows a
/// link put in its place (`supervisor::open_log`).
fn give_sandbox_to(sandbox: &Path, log: &Path, user: UserIds) -> Result<(), RuntimeError> {
    use std::os::unix::fs::PermissionsExt;
    supervisor::open_log(log).map_err(RuntimeError::Other)?;
    std::os::unix::fs::chown(sandbox, Some(user.uid), Some(user.gid)).map_err(io_err(sandbox))?;
    std::fs::set_permissions(sandbox, std::fs::Permissions::from_mode(0o700))
        .map_err(io_err(sandbox))
}

impl ProcessRuntime {
    async fn start_task(&self, spec: &LaunchSpec) -> Result<(), RuntimeError> {
        let dir = &spec.state_dir;
        match observe_dir(dir)? {
            Observed::NotStarted => {}
            // Started before: never twice.
            Observed::Running | Observed::Ended(_) => return Ok(()),
        }
        let Some((program, args)) = spec.task.template.command.split_first() else {
            return Err(RuntimeError::Spawn {
                program: String::new(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty command"),
            });
        };
        let mut env = spec.env.clone();
        env.entry("PATH".into())
            .or_insert_with(|| TASK_PATH.to_string());
        env.insert("HOME".into(), spec.sandbox.display().to_string());
        let user = spec.security.user;
        if let Some(u) = user {
            give_sandbox_to(&spec.sandbox, &spec.log_path, u)?;
        }
        let keep_visible = std::iter::once(spec.sandbox.clone())
            .chain(spec.isolation.dev_root.clone())
            .chain(spec.security.keep_visible.iter().cloned())
            .collect();
        let launch = Launch {
            program: program.clone(),
            args: args.to_vec(),
            env,
            cwd: spec.sandbox.clone(),
            log_path: spec.log_path.clone(),
            cgroup_procs: spec.isolation.cgroup_procs.clone(),
            kill_grace_ms: spec.kill_grace.as_millis() as u64,
            fence: spec.fence.clone(),
            user,
            namespaces: spec.security.namespaces,
            keep_visible,
        };
        checkpoint::write_json(&dir.join(LAUNCH_FILE), &launch).map_err(checkpoint_err)?;
        let log_path = dir.join(supervisor::LOG_FILE);
        let mut child = super::spawn_helper(&self.exe, supervisor::SUBCOMMAND, dir, &log_path)
            .map_err(|source| RuntimeError::Spawn {
                program: self.exe.display().to_string(),
                source,
            })?;
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        let mut pause = Backoff::new(Duration::from_millis(2), Duration::from_millis(50));
        loop {
            if let Some(rec) =
                checkpoint::read_json::<ExitRecord>(&dir.join(EXIT_FILE)).map_err(checkpoint_err)?
            {
                if let Some(e) = rec.error {
                    return Err(RuntimeError::Other(e));
                }
                return Ok(()); // ran and ended already
            }
            let state = checkpoint::read_json::<SupervisorState>(&dir.join(STATE_FILE))
                .map_err(checkpoint_err)?;
            if state.is_some_and(|s| s.task.is_some()) {
                return Ok(());
            }
            if let Ok(Some(status)) = child.try_wait() {
                // Exit 3: another supervisor has it (a launch by an earlier
                // agent process racing this one): it runs once, there.
                if status.code() == Some(3) {
                    return Ok(());
                }
                if !status.success() {
                    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
                    return Err(RuntimeError::Other(format!(
                        "task supervisor exited with {status}: {}",
                        text.lines().last().unwrap_or_default()
                    )));
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(RuntimeError::Other(format!(
                    "task supervisor did not start the task within {START_TIMEOUT:?}"
                )));
            }
            tokio::time::sleep(pause.next_wait()).await;
        }
    }

    /// Blocks (on a thread of its own) until the supervisor lets go of its
    /// lock, that is until it exits, however it exits.
    async fn wait_task(&self, task: &TaskRef) -> Result<Ended, RuntimeError> {
        let dir = task.state_dir.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        // A plain thread, not spawn_blocking: the runtime must not wait for
        // it when the agent shuts down with tasks still running.
        std::thread::Builder::new()
            .name(format!("wait-{}", task.task_id))
            .spawn(move || {
                let path = dir.join(LOCK_FILE);
                let res = std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&path)
                    .map_err(io_err(&path))
                    .and_then(|f| {
                        Flock::lock(f, FlockArg::LockExclusive).map_err(|(_, e)| {
                            RuntimeError::Other(format!("{}: flock: {e}", path.display()))
                        })
                    })
                    .and_then(|lock| {
                        drop(lock);
                        observe_dir(&dir)
                    });
                let _ = tx.send(res);
            })
            .map_err(|e| RuntimeError::Other(format!("start a waiter thread: {e}")))?;
        match rx.await {
            Ok(Ok(Observed::Ended(e))) => Ok(e),
            Ok(Ok(Observed::NotStarted | Observed::Running)) => Ok(Ended {
                code: None,
                fenced: false,
                error: Some("the task was never started".into()),
                ..Default::default()
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(RuntimeError::Other("waiter thread vanished".into())),
        }
    }

    fn stop_task(&self, task: &TaskRef, grace: Duration) -> Result<(), RuntimeError> {
        let state = checkpoint::read_json::<SupervisorState>(&task.state_dir.join(STATE_FILE))
            .map_err(checkpoint_err)?;
        let Some(state) = state else {
            return Ok(()); // never started
        };
        if state.supervisor.alive() {
            // The grace of this stop, for the supervisor to read when the
            // signal comes (its own fence keeps the grace of its launch).
            checkpoint::write_json(
                &task.state_dir.join(supervisor::STOP_FILE),
                &supervisor::StopRequest {
                    grace_ms: u64::try_from(grace.as_millis()).unwrap_or(u64::MAX),
                },
            )
            .map_err(checkpoint_err)?;
            // The supervisor gives the task its grace, then SIGKILL.
            match kill(Pid::from_raw(state.supervisor.pid), Signal::SIGTERM) {
                Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
                Err(e) => return Err(RuntimeError::Other(format!("signal supervisor: {e}"))),
            }
        } else if let Some(t) = state.task.filter(|t| t.alive()) {
            supervisor::signal_group(Pid::from_raw(t.pid), Signal::SIGKILL);
        }
        Ok(())
    }
}

impl ContainerRuntime for ProcessRuntime {
    fn kind(&self) -> Runtime {
        Runtime::Process
    }

    fn start<'a>(&'a self, spec: &'a LaunchSpec) -> BoxFuture<'a, Result<(), RuntimeError>> {
        self.start_task(spec).boxed()
    }

    fn observe<'a>(&'a self, task: &'a TaskRef) -> BoxFuture<'a, Result<Observed, RuntimeError>> {
        futures::future::ready(observe_dir(&task.state_dir)).boxed()
    }

    fn wait<'a>(&'a self, task: &'a TaskRef) -> BoxFuture<'a, Result<Ended, RuntimeError>> {
        self.wait_task(task).boxed()
    }

    fn stop<'a>(
        &'a self,
        task: &'a TaskRef,
        grace: Duration,
    ) -> BoxFuture<'a, Result<(), RuntimeError>> {
        futures::future::ready(self.stop_task(task, grace)).boxed()
    }

    fn remove<'a>(&'a self, _task: &'a TaskRef) -> BoxFuture<'a, Result<(), RuntimeError>> {
        futures::future::ready(Ok(())).boxed()
    }

    /// Host processes are found through their state directories, which the
    /// executor reads itself.
    fn list<'a>(&'a self, _agent_id: &'a str) -> BoxFuture<'a, Result<Vec<String>, RuntimeError>> {
        futures::future::ready(Ok(Vec::new())).boxed()
    }

    fn status(&self) -> RuntimeStatus {
        RuntimeStatus {
            available: true,
            message: String::new(),
        }
    }

    fn exec<'a>(
        &'a self,
        task: &'a TaskRef,
        command: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<super::ExecOutput, RuntimeError>> {
        exec_beside(task, command, timeout).boxed()
    }
}

/// `sh -c command` as the task itself would run it: its launch's user,
/// environment, working directory and cgroups, and (a task in namespaces
/// of its own) its mount and IPC namespaces, so that it sees the task's
/// private `/tmp`. In a process group of its own, killed past `timeout`.
async fn exec_beside(
    task: &TaskRef,
    command: &str,
    timeout: Duration,
) -> Result<super::ExecOutput, RuntimeError> {
    use std::os::unix::process::CommandExt;
    let dir = &task.state_dir;
    let launch: Launch = checkpoint::read_json(&dir.join(LAUNCH_FILE))
        .map_err(checkpoint_err)?
        .ok_or_else(|| RuntimeError::Other("the task has no launch record".into()))?;
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(command)
        .env_clear()
        .envs(&launch.env)
        .current_dir(&launch.cwd)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0);
    crate::isolation::join::join_before_exec_std(&mut cmd, &launch.cgroup_procs)
        .map_err(|e| RuntimeError::Other(e.to_string()))?;
    if launch.namespaces {
        let state: Option<SupervisorState> =
            checkpoint::read_json(&dir.join(STATE_FILE)).map_err(checkpoint_err)?;
        let init = state
            .and_then(|s| s.task)
            .filter(|p| p.alive())
            .ok_or_else(|| RuntimeError::Other("the task's init is not running".into()))?;
        super::helper::enter_namespaces_before_exec(&mut cmd, init.pid)
            .map_err(|e| RuntimeError::Other(format!("the task's namespaces: {e}")))?;
    }
    super::helper::drop_privileges_before_exec(&mut cmd, launch.user);
    let child = tokio::process::Command::from(cmd)
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| RuntimeError::Spawn {
            program: "/bin/sh".into(),
            source,
        })?;
    let pgid = child.id().and_then(|p| i32::try_from(p).ok());
    match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Ok(Ok(out)) => {
            let mut bytes = out.stdout;
            bytes.extend_from_slice(&out.stderr);
            Ok(super::ExecOutput::new(
                Some(supervisor::exit_code(out.status)),
                &bytes,
            ))
        }
        Ok(Err(e)) => Err(RuntimeError::Other(format!("wait for the check: {e}"))),
        Err(_) => {
            // What it started goes with it.
            if let Some(pgid) = pgid {
                supervisor::signal_group(Pid::from_raw(pgid), Signal::SIGKILL);
            }
            Ok(super::ExecOutput::new(None, b""))
        }
    }
}
