//! What the agent's helper processes share (the supervisor, a host task's
//! `task-init`, a container's fence watcher): the launch a supervisor runs,
//! the lock each holds for its life, the fence rule, and what a task's
//! process does between fork and exec.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuctl_core::types::UserIds;
use nix::fcntl::{Flock, FlockArg};
use nix::sys::signal::SigSet;
use serde::{Deserialize, Serialize};

use crate::checkpoint;

/// The launch's file in the task's state directory.
pub const LAUNCH_FILE: &str = "launch.json";
/// Tries at the lock, 2 ms apart (see `lock_or_give_up`).
const LOCK_TRIES: u32 = 100;

/// What the supervisor runs, written by the agent before it starts one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Launch {
    pub program: String,
    pub args: Vec<String>,
    /// The whole environment of the task (nothing is inherited).
    pub env: BTreeMap<String, String>,
    pub cwd: PathBuf,
    /// stdout and stderr are appended here.
    pub log_path: PathBuf,
    /// `cgroup.procs` files the task joins before it execs.
    pub cgroup_procs: Vec<PathBuf>,
    pub kill_grace_ms: u64,
    /// The agent's `contact.json`; `None`: never fenced (`--no-fence`).
    pub fence: Option<PathBuf>,
    /// The task switches to this user and group, without supplementary
    /// groups, after joining its cgroups and before exec; `None`: it keeps
    /// the supervisor's (root, for a job allowed to run as root).
    #[serde(default)]
    pub user: Option<UserIds>,
    /// The task runs in PID, mount and IPC namespaces of its own, under
    /// `task-init` (`runtime::task_init`).
    #[serde(default)]
    pub namespaces: bool,
    /// With `namespaces`: paths that stay visible where they are although
    /// below a private directory (the sandbox, the device directory).
    #[serde(default)]
    pub keep_visible: Vec<PathBuf>,
}

/// Takes the exclusive lock that a helper process (a supervisor, a fence
/// watcher) holds for its whole life; `None` when another process holds
/// it. The agent probes liveness by taking the lock for an instant, so a
/// failed try is retried for a moment before giving up. (Rust opens files
/// close-on-exec: a task never inherits the lock.)
pub fn lock_or_give_up(path: &Path) -> std::io::Result<Option<Flock<std::fs::File>>> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    for _ in 0..LOCK_TRIES {
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(l) => return Ok(Some(l)),
            Err((f, _)) => {
                file = f;
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
    Ok(None)
}

/// Why the task's command could not be started, naming the user it was to
/// run as when permission was what failed.
pub(crate) fn spawn_error(launch: &Launch, e: &std::io::Error) -> String {
    use std::io::ErrorKind::{NotFound, PermissionDenied};
    let user = launch.user.unwrap_or(UserIds { uid: 0, gid: 0 });
    let who = match launch.user {
        Some(u) => format!("user {u}"),
        None => "root".to_string(),
    };
    // Which path exec could not reach, found from outside (a script's
    // interpreter, a closed directory above it).
    let why = matches!(e.kind(), PermissionDenied | NotFound)
        .then(|| {
            super::reach::why_not(
                &launch.program,
                &launch.cwd,
                launch.env.get("PATH").map(String::as_str),
                user,
            )
        })
        .flatten();
    match (e.kind(), why) {
        (_, Some(why)) => format!("spawn {}: {e}: the task runs as {who}; {why}", launch.program),
        (PermissionDenied, None) => format!(
            "spawn {}: {e} (the task runs as {who}: the program and the directories above it must be readable and executable by it)",
            launch.program
        ),
        _ => format!("spawn {}: {e}", launch.program),
    }
}

/// The task must get SIGTERM (and run its own handlers): std does not
/// reset the signal mask the supervisor blocked for itself.
#[allow(unsafe_code)]
pub(crate) fn unblock_signals_before_exec(cmd: &mut std::process::Command) {
    // SAFETY: runs in the forked child before exec; pthread_sigmask is
    // async-signal-safe and the empty set is built without allocating.
    unsafe {
        cmd.pre_exec(|| {
            SigSet::empty()
                .thread_set_mask()
                .map_err(std::io::Error::from)
        });
    }
}

/// Makes the child switch to `user` (when given) just before exec: no
/// supplementary groups, then the group, then the user (after which it
/// cannot go back). `std`'s own `uid`/`gid` are not used because they
/// switch before the `pre_exec` closures, and joining the cgroups must be
/// done as root. Every task also gets `no_new_privs`: a setuid or
/// file-capability program (`sudo`, `su`, `ping`) cannot raise its
/// privileges again.
#[allow(unsafe_code)]
pub(crate) fn drop_privileges_before_exec(cmd: &mut std::process::Command, user: Option<UserIds>) {
    use nix::unistd::{setgid, setgroups, setuid, Gid, Uid};
    // SAFETY: runs in the forked child before exec; setgroups (with an
    // empty slice), setgid, setuid and prctl are plain system calls that
    // neither allocate nor lock.
    unsafe {
        cmd.pre_exec(move || {
            if let Some(u) = user {
                setgroups(&[]).map_err(std::io::Error::from)?;
                setgid(Gid::from_raw(u.gid)).map_err(std::io::Error::from)?;
                setuid(Uid::from_raw(u.uid)).map_err(std::io::Error::from)?;
            }
            nix::sys::prctl::set_no_new_privs().map_err(std::io::Error::from)
        });
    }
}

/// Makes the child of `cmd` enter the mount and IPC namespaces of process
/// `pid` (a task's init) between fork and exec, before it drops its
/// privileges: a check command then sees what the task sees.
#[allow(unsafe_code)]
pub(crate) fn enter_namespaces_before_exec(
    cmd: &mut std::process::Command,
    pid: i32,
) -> std::io::Result<()> {
    use nix::sched::{setns, CloneFlags};
    // Opened here, before the fork.
    let files = [
        ("ipc", CloneFlags::CLONE_NEWIPC),
        ("mnt", CloneFlags::CLONE_NEWNS),
    ]
    .into_iter()
    .map(|(ns, flag)| Ok((std::fs::File::open(format!("/proc/{pid}/ns/{ns}"))?, flag)))
    .collect::<std::io::Result<Vec<_>>>()?;
    // SAFETY: runs in the forked child before exec; setns is a plain
    // system call on descriptors opened before the fork.
    unsafe {
        cmd.pre_exec(move || {
            for (file, flag) in &files {
                setns(file, *flag).map_err(std::io::Error::from)?;
            }
            Ok(())
        });
    }
    Ok(())
}

/// Whether the fence has fallen for a task fenced by `contact` (the
/// agent's `contact.json`; `None`: never fenced).
pub fn fence_expired(contact: Option<&Path>) -> bool {
    fence_expired_at(contact, checkpoint::wall_ms())
}

/// [`fence_expired`] at `now_ms` (wall clock, as the fence survives restarts).
pub fn fence_expired_at(contact: Option<&Path>, now_ms: u64) -> bool {
    let Some(path) = contact else {
        return false;
    };
    match checkpoint::read_contact(path) {
        Ok(Some(c)) => c.expired_at(now_ms),
        // Gone: the agent records a contact before it launches anything and
        // replaces the file atomically, so its work dir was wiped. Nobody
        // can report or stop this task any more, and it may hold a GPU the
        // master will give away: stop it.
        Ok(None) => true,
        // Unreadable: a damaged file; stopping a training run on it would
        // be worse (the agent's next heartbeat rewrites it).
        Err(_) => false,
    }
}
