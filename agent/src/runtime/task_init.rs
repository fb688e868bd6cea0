//! PID 1 of a host-process task's own namespaces: `gpuctl-agent task-init
//! STATE_DIR`, started by the task's supervisor (`runtime::supervisor`)
//! after it unshared a PID namespace, so this process is the first of it.
//! Like `docker --init` (tini) with a little of systemd's `PrivateTmp`:
//!
//! - it gives the task a mount namespace of its own (nothing mounted in it
//!   reaches the host; the host's later mounts do come in), with a `/proc`
//!   that shows only the task's own
//!   processes, and fresh, private `/tmp`, `/var/tmp` and `/dev/shm`
//!   (tmpfs, gone with the task); paths the task needs that lie below them
//!   on the host (its sandbox, the agent's device directory) are bound back
//!   at the same place;
//! - and an IPC namespace of its own (System V IPC, POSIX message queues);
//! - it starts the task's command as the task's user (no supplementary
//!   groups, `no_new_privs`), forwards the signals the supervisor sends
//!   (a PID 1 ignores those it has no handler for, so without it a task
//!   would never see SIGTERM), reaps whatever is orphaned into it, and exits
//!   with the command's status as soon as the command ends. The kernel then
//!   kills everything left in the namespace: nothing of a task outlives it.
//!
//! Another task, even of the same user, cannot see or signal these
//! processes, and they cannot see or signal the agent's or the host's.
//! What fails before the command runs is written to `init-error` in the
//! state directory, which the supervisor reports as the task's error.

use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};

use gpuctl_core::types::path_within;
use nix::errno::Errno;
use nix::mount::{mount, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use super::helper::{self, Launch, LAUNCH_FILE};
use crate::checkpoint;

pub const SUBCOMMAND: &str = "task-init";
/// In the state directory: why the task could not be started.
pub const ERROR_FILE: &str = "init-error";
/// In the state directory: the signal that killed the command, when one did.
pub const SIGNAL_FILE: &str = "init-signal";
/// Each gets a fresh tmpfs in the task's mount namespace.
pub const PRIVATE_DIRS: [&str; 3] = ["/tmp", "/var/tmp", "/dev/shm"];
/// Signals passed on to every process of the task.
const FORWARDED: [Signal; 7] = [
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGWINCH,
];
/// Exit codes when the command never ran (the supervisor reports the
/// error file instead).
const SETUP_FAILED: u8 = 125;
const SPAWN_FAILED: u8 = 127;

/// Runs task-init when the process was started as it. Called from
/// `supervisor::main_if_requested`, first thing in `main`.
pub fn main_if_requested() -> Option<ExitCode> {
    let mut args = std::env::args_os().skip(1);
    if args.next()? != SUBCOMMAND {
        return None;
    }
    let Some(dir) = args.next().map(PathBuf::from) else {
        eprintln!("usage: gpuctl-agent {SUBCOMMAND} STATE_DIR");
        return Some(ExitCode::from(2));
    };
    // Held open: once the private directories are mounted, a state
    // directory below one of them is reached only through this.
    let held = match std::fs::File::open(&dir) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("gpuctl-agent {SUBCOMMAND}: {}: {e}", dir.display());
            return Some(ExitCode::from(SETUP_FAILED));
        }
    };
    let host_dir = PathBuf::from(format!("/proc/self/fd/{}", held.as_raw_fd()));
    Some(ExitCode::from(run(&host_dir)))
}

/// Records why the command never ran, in the state directory as the host
/// sees it (`dir`).
fn record(dir: &Path, what: &str, code: u8) -> u8 {
    if let Err(e) = checkpoint::write_atomic(&dir.join(ERROR_FILE), what.as_bytes()) {
        eprintln!("gpuctl-agent {SUBCOMMAND}: {what} (and could not record it: {e})");
    }
    code
}

/// `dir`: the state directory, as the host sees it.
fn run(dir: &Path) -> u8 {
    let launch: Launch = match checkpoint::read_json(&dir.join(LAUNCH_FILE)) {
        Ok(Some(l)) => l,
        Ok(None) => return record(dir, "task-init: launch.json is missing", SETUP_FAILED),
        Err(e) => return record(dir, &format!("task-init: {e}"), SETUP_FAILED),
    };
    if let Err(e) = private_mounts(&launch.keep_visible) {
        return record(
            dir,
            &format!("the task's own namespaces could not be made: {e}"),
            SETUP_FAILED,
        );
    }
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGCHLD);
    for s in FORWARDED {
        mask.add(s);
    }
    // Blocked before the command exists, read from a signalfd: nothing is
    // lost between its start and the loop. Its child unblocks them.
    if let Err(e) = mask.thread_block() {
        return record(dir, &format!("task-init: block signals: {e}"), SETUP_FAILED);
    }
    let signals = match SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC) {
        Ok(s) => s,
        Err(e) => return record(dir, &format!("task-init: signalfd: {e}"), SETUP_FAILED),
    };
    let mut cmd = std::process::Command::new(&launch.program);
    cmd.args(&launch.args)
        .env_clear()
        .envs(&launch.env)
        .current_dir(&launch.cwd)
        .stdin(Stdio::null())
        .process_group(0);
    helper::unblock_signals_before_exec(&mut cmd);
    helper::drop_privileges_before_exec(&mut cmd, launch.user);
    let main = match cmd.spawn() {
        Ok(c) => Pid::from_raw(c.id() as i32),
        Err(e) => return record(dir, &helper::spawn_error(&launch, &e), SPAWN_FAILED),
    };
    loop {
        let info = match signals.read_signal() {
            Ok(Some(i)) => i,
            Ok(None) | Err(Errno::EINTR) => continue,
            // Nothing else to wait with: end, and the kernel ends the rest.
            Err(e) => {
                eprintln!("gpuctl-agent {SUBCOMMAND}: signalfd: {e}");
                return 1;
            }
        };
        let signo = info.ssi_signo as i32;
        if signo == Signal::SIGCHLD as i32 {
            if let Some(code) = reap(dir, main) {
                return code;
            }
        } else if let Ok(sig) = Signal::try_from(signo) {
            // -1: every process of the namespace but this one.
            match kill(Pid::from_raw(-1), sig) {
                Ok(()) | Err(Errno::ESRCH) => {}
                Err(e) => eprintln!("gpuctl-agent {SUBCOMMAND}: forward {sig}: {e}"),
            }
        }
    }
}

/// Reaps every child that ended; the command's exit code once it has
/// (128 + signal for one killed by a signal, as a shell says it; the
/// signal itself is written to `SIGNAL_FILE` in `dir`, so that a kill is
/// told apart from an `exit 137`).
fn reap(dir: &Path, main: Pid) -> Option<u8> {
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(pid, code)) if pid == main => return Some(code as u8),
            Ok(WaitStatus::Signaled(pid, sig, _)) if pid == main => {
                let signo = sig as i32;
                if let Err(e) =
                    checkpoint::write_atomic(&dir.join(SIGNAL_FILE), signo.to_string().as_bytes())
                {
                    eprintln!("gpuctl-agent {SUBCOMMAND}: record signal {signo}: {e}");
                }
                return Some(128u8.wrapping_add(signo as u8));
            }
            Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return None,
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(e) => {
                eprintln!("gpuctl-agent {SUBCOMMAND}: waitpid: {e}");
                return None;
            }
        }
    }
}

/// The mount and IPC namespaces: see the module's comment. `keep` are paths
/// that stay visible where they are (those below a private directory are
/// bound back into its fresh tmpfs).
fn private_mounts(keep: &[PathBuf]) -> Result<(), String> {
    unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWIPC)
        .map_err(|e| format!("unshare(CLONE_NEWNS | CLONE_NEWIPC): {e}"))?;
    // Nothing mounted here propagates back to the host, while the host's
    // later mounts still come in (an automounted /home or dataset), as
    // systemd does for PrivateTmp.
    mount::<str, str, str, str>(None, "/", None, MsFlags::MS_REC | MsFlags::MS_SLAVE, None)
        .map_err(|e| format!("make / a slave of the host's mounts: {e}"))?;
    let private: Vec<&str> = PRIVATE_DIRS
        .iter()
        .copied()
        .filter(|d| std::fs::symlink_metadata(d).is_ok_and(|m| m.is_dir()))
        .collect();
    // Opened before the tmpfs hides them.
    let mut kept = Vec::new();
    for p in keep {
        let Some(s) = p.to_str() else { continue };
        if !path_within(&private, s) {
            continue;
        }
        let fd = std::fs::File::open(p).map_err(|e| format!("open {}: {e}", p.display()))?;
        kept.push((p, fd));
    }
    let tmp_flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    for d in &private {
        mount(
            Some("tmpfs"),
            *d,
            Some("tmpfs"),
            tmp_flags,
            Some("mode=1777"),
        )
        .map_err(|e| format!("mount a private tmpfs on {d}: {e}"))?;
    }
    for (p, fd) in &kept {
        std::fs::create_dir_all(p).map_err(|e| format!("mkdir {}: {e}", p.display()))?;
        let src = format!("/proc/self/fd/{}", fd.as_raw_fd());
        mount::<str, Path, str, str>(
            Some(src.as_str()),
            p,
            None,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None,
        )
        .map_err(|e| format!("bind {} back: {e}", p.display()))?;
    }
    drop(kept);
    let proc_flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount(
        Some("proc"),
        "/proc",
        Some("proc"),
        proc_flags,
        None::<&str>,
    )
    .map_err(|e| format!("mount /proc for the task's PID namespace: {e}"))?;
    // The host's message queues are a file system of the host's IPC
    // namespace: this task gets its own.
    if Path::new("/dev/mqueue").is_dir() {
        mount(
            Some("mqueue"),
            "/dev/mqueue",
            Some("mqueue"),
            proc_flags,
            None::<&str>,
        )
        .map_err(|e| format!("mount /dev/mqueue: {e}"))?;
    }
    Ok(())
}
