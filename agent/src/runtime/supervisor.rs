//! The per-task supervisor of a host-process task: a small process that
//! outlives the agent, like containerd's shim or a Mesos executor.
//!
//! The agent starts `gpuctl-agent supervise <state-dir>` (its own binary,
//! in a session of its own) for every host-process task. The supervisor:
//!
//! - holds an exclusive `flock` on `supervisor.lock` for its whole life: the
//!   lock is how anyone tells that it still lives (the kernel drops it when
//!   the process dies, however it dies), and it makes a second supervisor of
//!   the same task exit at once;
//! - refuses to run a task that a supervisor already started once
//!   (`supervisor.json` exists), so a task never runs twice;
//! - starts the task in its own process group, its output appended to the
//!   log, after the child joined the task's cgroups;
//! - on SIGTERM stops the task: SIGTERM to the group, SIGKILL after the
//!   grace (the agent's `stop.json`, written before the signal; the
//!   launch's kill grace without one);
//! - stops the task itself once the agent's last contact with a leader is
//!   older than the fence timeout (`contact.json`), so that a frozen, dead
//!   or cut-off agent never leaves a task running past the point where the
//!   master may start it elsewhere;
//! - writes how the task ended to `exit.json`, then exits.
//!
//! It is synchronous and single-threaded on purpose: it must be small,
//! start fast and never depend on the agent.

use std::os::fd::AsFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{killpg, SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use super::helper::{drop_privileges_before_exec, spawn_error, unblock_signals_before_exec};
pub use super::helper::{fence_expired, fence_expired_at, lock_or_give_up, Launch, LAUNCH_FILE};
use crate::checkpoint::{self, CheckpointError};

/// The hidden subcommand of the agent's binary (and of `gpuctl`, whose demo
/// runs an agent in-process).
pub const SUBCOMMAND: &str = "supervise";
pub const LOCK_FILE: &str = "supervisor.lock";
pub const STATE_FILE: &str = "supervisor.json";
pub const EXIT_FILE: &str = "exit.json";
pub const LOG_FILE: &str = "supervisor.log";
/// Written by the agent before it sends the supervisor SIGTERM: the grace
/// of that stop (a job's `stop_grace`), read when the signal comes.
pub const STOP_FILE: &str = "stop.json";

/// `stop.json`: how long the task gets between SIGTERM and SIGKILL in the
/// stop the agent asks for now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopRequest {
    pub grace_ms: u64,
}

/// How often the supervisor looks at the fence and the kill deadline when
/// no signal comes.
const TICK: Duration = Duration::from_millis(200);

/// A process by pid and start time (clock ticks since boot, from
/// `/proc/<pid>/stat`), so a recycled pid is never mistaken for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcId {
    pub pid: i32,
    pub start_time: u64,
}

impl ProcId {
    pub fn of(pid: i32) -> Option<ProcId> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let st = parse_stat(&stat)?;
        Some(ProcId {
            pid,
            start_time: st.start_time,
        })
    }

    /// The same process still exists and is not a zombie.
    pub fn alive(&self) -> bool {
        std::fs::read_to_string(format!("/proc/{}/stat", self.pid))
            .ok()
            .and_then(|s| parse_stat(&s))
            .is_some_and(|st| st.start_time == self.start_time && st.state != 'Z')
    }
}

/// `supervisor.json`: written before the task starts (without `task`) and
/// again once it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SupervisorState {
    pub supervisor: ProcId,
    pub task: Option<ProcId>,
}

/// `exit.json`: how the task ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitRecord {
    /// The exit code; 128 + signal for a task killed by a signal.
    pub code: Option<i32>,
    /// The supervisor stopped it (asked to, or fenced).
    pub killed: bool,
    /// Stopped because the agent had no contact with a leader for the
    /// fence timeout.
    pub fenced: bool,
    /// The task could not be started.
    pub error: Option<String>,
    /// The signal that killed it (`code` is then 128 + it); absent in a
    /// record of an older agent.
    #[serde(default)]
    pub signal: Option<i32>,
}

#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("usage: gpuctl-agent {SUBCOMMAND} STATE_DIR")]
    Usage,
    #[error("another supervisor holds {0}")]
    AlreadySupervised(PathBuf),
    #[error("{0}: this task was started before; it is never started twice")]
    AlreadyStarted(PathBuf),
    #[error("{0} is missing")]
    NoLaunch(PathBuf),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("{what}: {source}")]
    Sys { what: &'static str, source: Errno },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

impl SupervisorError {
    fn exit_code(&self) -> u8 {
        match self {
            SupervisorError::Usage => 2,
            SupervisorError::AlreadySupervised(_) | SupervisorError::AlreadyStarted(_) => 3,
            _ => 1,
        }
    }
}

/// Runs the supervisor when the process was started as one
/// (`<binary> supervise STATE_DIR`). Call it first thing in `main`, before
/// any thread or async runtime exists.
/// Also runs a container's fence watcher (`fence-container DIR`, see
/// `runtime::fence`).
pub fn main_if_requested() -> Option<ExitCode> {
    if let Some(code) = super::fence::main_if_requested() {
        return Some(code);
    }
    if let Some(code) = crate::isolation::probe::main_if_requested() {
        return Some(code);
    }
    if let Some(code) = super::task_init::main_if_requested() {
        return Some(code);
    }
    let mut args = std::env::args_os().skip(1);
    if args.next()? != SUBCOMMAND {
        return None;
    }
    let result = match (args.next(), args.next()) {
        (Some(dir), None) => run(Path::new(&dir)),
        _ => Err(SupervisorError::Usage),
    };
    Some(match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpuctl-agent {SUBCOMMAND}: {e}");
            ExitCode::from(e.exit_code())
        }
    })
}

fn sys(what: &'static str) -> impl FnOnce(Errno) -> SupervisorError {
    move |source| SupervisorError::Sys { what, source }
}

/// The supervisor proper.
pub fn run(dir: &Path) -> Result<(), SupervisorError> {
    let lock_path = dir.join(LOCK_FILE);
    let _lock = match lock_or_give_up(&lock_path) {
        Ok(Some(l)) => l,
        Ok(None) => return Err(SupervisorError::AlreadySupervised(lock_path)),
        Err(source) => {
            return Err(SupervisorError::Io {
                what: lock_path.display().to_string(),
                source,
            })
        }
    };
    let state_path = dir.join(STATE_FILE);
    if state_path.exists() || dir.join(EXIT_FILE).exists() {
        return Err(SupervisorError::AlreadyStarted(state_path));
    }
    let launch_path = dir.join(LAUNCH_FILE);
    let launch: Launch =
        checkpoint::read_json(&launch_path)?.ok_or(SupervisorError::NoLaunch(launch_path))?;
    let me = ProcId::of(std::process::id() as i32).ok_or_else(|| SupervisorError::Io {
        what: "/proc/self/stat".into(),
        source: std::io::Error::other("unreadable"),
    })?;
    let mut mask = SigSet::empty();
    for s in [
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGCHLD,
        Signal::SIGHUP,
    ] {
        mask.add(s);
    }
    // Blocked here and read from a signalfd. The mask is inherited across
    // fork and exec, so the task's child unblocks everything (`spawn`).
    mask.thread_block().map_err(sys("block signals"))?;
    let signals = SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .map_err(sys("signalfd"))?;

    // Recorded before the task can exist: from here on, nobody starts it
    // again. (Signals are blocked first: a stop that comes now waits in
    // the signalfd instead of killing the supervisor.)
    checkpoint::write_json(
        &state_path,
        &SupervisorState {
            supervisor: me,
            task: None,
        },
    )?;

    // The task's first process (task-init) is PID 1 of a namespace of its
    // own. Only the supervisor's next child enters it, and the supervisor
    // makes no other.
    let unshared = if launch.namespaces {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWPID).map_err(|e| {
            format!("the task's own PID namespace could not be made: unshare(CLONE_NEWPID): {e}")
        })
    } else {
        Ok(())
    };
    let mut child = match unshared.and_then(|()| spawn(dir, &launch)) {
        Ok(c) => c,
        Err(e) => {
            checkpoint::write_json(
                &dir.join(EXIT_FILE),
                &ExitRecord {
                    code: None,
                    killed: false,
                    fenced: false,
                    error: Some(e),
                    signal: None,
                },
            )?;
            return Ok(());
        }
    };
    let pid = child.id() as i32;
    checkpoint::write_json(
        &state_path,
        &SupervisorState {
            supervisor: me,
            task: ProcId::of(pid),
        },
    )?;

    let (status, killed, fenced) = follow(dir, &launch, &mut child, &signals)?;
    record_exit(dir, &launch, status, killed, fenced)?;
    Ok(())
}

/// Follows the task until it and its process group are gone: stops it
/// (SIGTERM, then SIGKILL after the grace) when the agent asks or the fence
/// falls. Its exit status, whether it was stopped, and whether by the
/// fence.
fn follow(
    dir: &Path,
    launch: &Launch,
    child: &mut std::process::Child,
    signals: &SignalFd,
) -> Result<(ExitStatus, bool, bool), SupervisorError> {
    let pid = child.id() as i32;
    let pgid = Pid::from_raw(pid);
    let grace = Duration::from_millis(launch.kill_grace_ms);
    let mut kill_deadline: Option<Instant> = None;
    let mut fenced = false;
    let mut status: Option<ExitStatus> = None;
    loop {
        if status.is_none() {
            status = child.try_wait().map_err(|source| SupervisorError::Io {
                what: format!("wait for task process {pid}"),
                source,
            })?;
        }
        let now = Instant::now();
        match (status, kill_deadline) {
            // Ended by itself: what it left in the background goes too.
            (Some(_), None) => {
                signal_group(pgid, Signal::SIGKILL);
                break;
            }
            // Being stopped: the rest of the group gets what is left of
            // the grace.
            (Some(_), Some(deadline)) if !group_alive(pgid) || now >= deadline => {
                signal_group(pgid, Signal::SIGKILL);
                break;
            }
            (None, Some(deadline)) if now >= deadline => signal_group(pgid, Signal::SIGKILL),
            _ => {}
        }
        if kill_deadline.is_none() && fence_expired(launch.fence.as_deref()) {
            fenced = true;
            eprintln!("gpuctl-agent {SUBCOMMAND}: no contact with a master for the fence timeout: stopping task process {pid}");
            kill_deadline = Some(begin_stop(pgid, grace));
        }
        let mut fds = [PollFd::new(signals.as_fd(), PollFlags::POLLIN)];
        match nix::poll::poll(&mut fds, PollTimeout::from(TICK.as_millis() as u16)) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => return Err(sys("poll")(e)),
        }
        while let Ok(Some(info)) = signals.read_signal() {
            let signo = info.ssi_signo as i32;
            if (signo == Signal::SIGTERM as i32 || signo == Signal::SIGINT as i32)
                && kill_deadline.is_none()
            {
                kill_deadline = Some(begin_stop(pgid, stop_grace(dir, grace)));
            }
        }
    }
    let status = match status {
        Some(s) => s,
        None => child.wait().map_err(|source| SupervisorError::Io {
            what: format!("wait for task process {pid}"),
            source,
        })?,
    };
    Ok((status, kill_deadline.is_some(), fenced))
}

/// The task's exit as the agent reads it: its code, or the signal that
/// killed it, or task-init's word that the command never ran.
fn record_exit(
    dir: &Path,
    launch: &Launch,
    status: ExitStatus,
    killed: bool,
    fenced: bool,
) -> Result<(), SupervisorError> {
    // task-init says so when the command never ran, and which signal
    // killed the command (its own exit code is then 128 + it).
    let error = launch
        .namespaces
        .then(|| std::fs::read_to_string(dir.join(super::task_init::ERROR_FILE)).ok())
        .flatten();
    // task-init killed with its namespace (a stop past its grace) says
    // nothing; its own status does.
    let signal = status.signal().or_else(|| {
        launch
            .namespaces
            .then(|| std::fs::read_to_string(dir.join(super::task_init::SIGNAL_FILE)).ok())
            .flatten()
            .and_then(|s| s.trim().parse().ok())
    });
    checkpoint::write_json(
        &dir.join(EXIT_FILE),
        &ExitRecord {
            code: error.is_none().then(|| exit_code(status)),
            killed,
            fenced,
            error: error.clone(),
            signal: signal.filter(|_| error.is_none()),
        },
    )?;
    Ok(())
}

/// The grace of a stop the agent asked for: its `stop.json`, else the
/// launch's (`default`).
fn stop_grace(dir: &Path, default: Duration) -> Duration {
    match checkpoint::read_json::<StopRequest>(&dir.join(STOP_FILE)) {
        Ok(Some(r)) => Duration::from_millis(r.grace_ms),
        Ok(None) => default,
        Err(e) => {
            eprintln!("gpuctl-agent {SUBCOMMAND}: {e}; the launch's kill grace applies");
            default
        }
    }
}

fn begin_stop(pgid: Pid, grace: Duration) -> Instant {
    signal_group(pgid, Signal::SIGTERM);
    Instant::now() + grace
}

/// Opens (or creates) a task's log for appending, as the agent. The log
/// lies in the sandbox, which the task's user owns: a symlink, hard link or
/// FIFO the task (or another task of the same user) put there is refused
/// rather than followed, so the agent never writes to a file of its
/// choosing.
pub fn open_log(path: &Path) -> Result<std::fs::File, String> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        // O_NONBLOCK: a FIFO fails at once instead of blocking the open.
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("open {}: {e}", path.display()))?;
    let md = file
        .metadata()
        .map_err(|e| format!("stat {}: {e}", path.display()))?;
    if !md.is_file() || md.nlink() != 1 || md.uid() != nix::unistd::geteuid().as_raw() {
        return Err(format!(
            "{} is not a plain file of the agent's (a link, or made by the task): refused",
            path.display()
        ));
    }
    use std::os::fd::AsRawFd;
    nix::fcntl::fcntl(
        file.as_raw_fd(),
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_APPEND),
    )
    .map_err(|e| format!("fcntl {}: {e}", path.display()))?;
    Ok(file)
}

fn spawn(dir: &Path, launch: &Launch) -> Result<std::process::Child, String> {
    let open_log = || open_log(&launch.log_path);
    let (out, err) = (open_log()?, open_log()?);
    let mut cmd = if launch.namespaces {
        // This very binary, as the namespace's init; it starts the command.
        let mut c = std::process::Command::new("/proc/self/exe");
        c.arg(super::task_init::SUBCOMMAND)
            .arg(dir)
            .env_clear()
            .current_dir("/");
        c
    } else {
        let mut c = std::process::Command::new(&launch.program);
        c.args(&launch.args)
            .env_clear()
            .envs(&launch.env)
            .current_dir(&launch.cwd);
        c
    };
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        // One signal reaches the command and everything it forks.
        .process_group(0);
    unblock_signals_before_exec(&mut cmd);
    // As root: cgroup.procs is root's to write.
    crate::isolation::join::join_before_exec_std(&mut cmd, &launch.cgroup_procs)
        .map_err(|e| e.to_string())?;
    if launch.namespaces {
        // task-init needs root for its mounts and drops it for the command.
        return cmd
            .spawn()
            .map_err(|e| format!("spawn the task's init (/proc/self/exe): {e}"));
    }
    // Last, so that nothing above runs as the task's user.
    drop_privileges_before_exec(&mut cmd, launch.user);
    cmd.spawn().map_err(|e| spawn_error(launch, &e))
}

pub fn signal_group(pgid: Pid, signal: Signal) {
    match killpg(pgid, signal) {
        Ok(()) | Err(Errno::ESRCH) => {}
        Err(e) => eprintln!(
            "gpuctl-agent {SUBCOMMAND}: killpg {} {signal}: {e}",
            pgid.as_raw()
        ),
    }
}

/// True while the group has a member that is not a zombie.
pub fn group_alive(pgid: Pid) -> bool {
    if matches!(killpg(pgid, None), Err(Errno::ESRCH)) {
        return false;
    }
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
            .is_some_and(|st| st.state != 'Z' && st.pgrp == pgid.as_raw())
    })
}

/// The fields of `/proc/<pid>/stat` we use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub state: char,
    pub pgrp: i32,
    pub start_time: u64,
}

/// "pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt
/// cmajflt utime stime cutime cstime priority nice threads itrealvalue
/// starttime ..."; comm may contain spaces and parentheses.
pub fn parse_stat(stat: &str) -> Option<Stat> {
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(Stat {
        state: fields.first()?.chars().next()?,
        pgrp: fields.get(2)?.parse().ok()?,
        // starttime is field 22 of the line, the 20th after the comm.
        start_time: fields.get(19)?.parse().ok()?,
    })
}

/// The exit code, or 128 + signal for a process killed by a signal.
pub fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        (None, None) => -1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fence_falls_past_the_timeout_or_without_a_contact_never_on_a_damaged_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("contact.json");
        checkpoint::write_json(
            &path,
            &checkpoint::Contact {
                last_contact_ms: 10_000,
                fence_timeout_ms: 1_500,
            },
        )
        .unwrap();
        assert!(!fence_expired_at(Some(&path), 11_500));
        assert!(fence_expired_at(Some(&path), 11_501));
        assert!(!fence_expired_at(None, u64::MAX), "--no-fence");
        std::fs::write(&path, b"{not json").unwrap();
        assert!(
            !fence_expired_at(Some(&path), u64::MAX),
            "a damaged file stops nothing"
        );
        std::fs::remove_file(&path).unwrap();
        assert!(fence_expired_at(Some(&path), 0), "the work dir was wiped");
    }

    #[test]
    fn stat_lines_are_parsed() {
        let line = "12 (a b) c)) S 1 12 12 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 200";
        assert_eq!(
            parse_stat(line),
            Some(Stat {
                state: 'S',
                pgrp: 12,
                start_time: 987654
            })
        );
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat("1 (x) S 1 2"), None);
    }

    #[test]
    fn own_process_is_alive_and_a_wrong_start_time_is_not() {
        let me = ProcId::of(std::process::id() as i32).unwrap();
        assert!(me.alive());
        let other = ProcId {
            start_time: me.start_time + 1,
            ..me
        };
        assert!(!other.alive());
    }
}
