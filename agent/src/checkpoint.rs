//! What the agent keeps on disk so that a restarted agent (and a task's
//! supervisor, while the agent is down) knows what it knew.
//!
//! Layout under `--work-dir`:
//!
//! ```text
//! contact.json            last successful heartbeat to a leader + fence timeout
//! state/<task-id>/        one directory per task launched here
//!   task.json             the task's spec, written before anything is started
//!   launch.json           a host process: what its supervisor runs
//!   supervisor.lock       held (flock) by the supervisor while it lives
//!   supervisor.json       the supervisor's and the task's pid and start time
//!   exit.json             how the task ended (written by the supervisor)
//!   log.cursor            a container: how far its output was copied
//!   final.json            the task's final status update, decided once
//!   acked                 the master acknowledged final.json
//! tasks/<task-id>/        the task's sandbox; output.log is kept after the end
//! notices/<task-id>/stop  the task's notice before a stop (executor/notice.rs)
//! retired/<task-id>       when the agent forgot the task (its final status
//!                         acknowledged, no longer wanted): its sandbox goes
//!                         --task-retention later (executor/retention.rs)
//! ```
//!
//! Every file is replaced atomically (write a temporary file, fsync, rename),
//! so a crash leaves either the old or the new content, never half of one.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub const STATE_DIR: &str = "state";
pub const SANDBOX_DIR: &str = "tasks";
pub const RETIRED_DIR: &str = "retired";
pub const CONTACT_FILE: &str = "contact.json";
pub const TASK_FILE: &str = "task.json";
pub const FINAL_FILE: &str = "final.json";
pub const ACKED_FILE: &str = "acked";
/// Each task's notice before a stop: `notices/<task-id>/stop`.
pub const NOTICE_DIR: &str = "notices";
/// Per task with a hang timeout, the directory of the file it may touch to
/// say it is alive (`GPUCTL_HEARTBEAT_FILE`).
pub const HEARTBEAT_DIR: &str = "heartbeats";
/// The same for containers whose user is the image's (unknown here): the
/// directory is anyone's to write, so it lies under a root (mode 0700)
/// that no host process but root may pass; the container gets it mounted.
pub const CONTAINER_HEARTBEAT_DIR: &str = "heartbeats-containers";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Replaces `path` with `bytes` atomically and durably.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    write_atomic_inner(path, bytes, None)
}

/// [`write_atomic`], the file's mode `mode` whatever the umask (a file
/// others read, such as a task's stop notice).
pub fn write_atomic_mode(path: &Path, bytes: &[u8], mode: u32) -> Result<(), CheckpointError> {
    write_atomic_inner(path, bytes, Some(mode))
}

fn write_atomic_inner(path: &Path, bytes: &[u8], mode: Option<u32>) -> Result<(), CheckpointError> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    if let Some(mode) = mode {
        use std::os::unix::fs::PermissionsExt;
        f.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(io(&tmp))?;
    }
    f.sync_all().map_err(io(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io(path))?;
    // The rename itself is durable once the directory is.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), CheckpointError> {
    let bytes = serde_json::to_vec_pretty(value).map_err(|source| CheckpointError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    write_atomic(path, &bytes)
}

/// `Ok(None)` when the file does not exist.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> Result<Option<T>, CheckpointError> {
    match std::fs::read(path) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|source| CheckpointError::Json {
                    path: path.to_path_buf(),
                    source,
                })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(path)(e)),
    }
}

/// Wall-clock milliseconds: the fence deadline must survive an agent
/// restart, which a monotonic clock does not.
pub use gpuctl_core::time::now_ms as wall_ms;

/// When the agent last reached a leader, and how long its tasks may run
/// without that (the master's fence timeout). Written after every
/// successful heartbeat; read by the agent after a restart and by every
/// task supervisor, so that tasks are fenced even while the agent itself is
/// frozen or dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Contact {
    /// Wall-clock time at which the last successful heartbeat was *sent*:
    /// never later than the leader's receipt, from which the leader counts
    /// its lost timeout.
    pub last_contact_ms: u64,
    /// 0: no fencing (a master that does not ask for it).
    pub fence_timeout_ms: u64,
}

impl Contact {
    /// The wall-clock time after which fenced tasks must stop; `None` when
    /// the master asked for no fencing.
    pub fn fence_deadline_ms(&self) -> Option<u64> {
        (self.fence_timeout_ms > 0)
            .then(|| self.last_contact_ms.saturating_add(self.fence_timeout_ms))
    }

    pub fn expired_at(&self, now_ms: u64) -> bool {
        self.fence_deadline_ms().is_some_and(|d| now_ms > d)
    }
}

pub fn contact_path(work_dir: &Path) -> PathBuf {
    work_dir.join(CONTACT_FILE)
}

/// The recorded contact; `None` when there is none or it cannot be read
/// (an unreadable file must not stop tasks: it is logged by the caller).
pub fn read_contact(path: &Path) -> Result<Option<Contact>, CheckpointError> {
    read_json(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_json_round_trip_and_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.json");
        assert_eq!(read_json::<Contact>(&p).unwrap(), None);
        let c = Contact {
            last_contact_ms: 10,
            fence_timeout_ms: 5,
        };
        write_json(&p, &c).unwrap();
        assert_eq!(read_json::<Contact>(&p).unwrap(), Some(c));
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("x.json")]);
        std::fs::write(&p, b"{not json").unwrap();
        assert!(matches!(
            read_json::<Contact>(&p),
            Err(CheckpointError::Json { .. })
        ));
    }

    #[test]
    fn fence_deadline() {
        let c = Contact {
            last_contact_ms: 1_000,
            fence_timeout_ms: 500,
        };
        assert_eq!(c.fence_deadline_ms(), Some(1_500));
        assert!(!c.expired_at(1_500));
        assert!(c.expired_at(1_501));
        let off = Contact {
            last_contact_ms: 1_000,
            fence_timeout_ms: 0,
        };
        assert!(!off.expired_at(u64::MAX));
    }
}
