//! The agent's end of the container cap hook (`runtime::oci_hook`): a
//! unix socket in the agent's work directory (root only) on which a
//! container's `createRuntime` hook says "task T's container C has its init
//! at pid P". The agent caps that pid's cgroup v2 with the driver
//! (`gpu::memcap`), reads it back and answers; only then does runc let
//! the workload start. When the cap cannot be had (no cgroup v2 of the
//! container's own, a driver that refuses) the answer says so and the
//! container runs with what else holds, which the executor then states.
//!
//! Only a task the executor is starting with a cap is capped ([`expect`]),
//! and only a cgroup named after the container the hook reports: a hook
//! cannot have another cgroup capped. A hook for any other task is refused,
//! and its container does not run.
//!
//! [`expect`]: CapSocket::expect

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use super::memcap::DriverCap;
use serde::{Deserialize, Serialize};

/// What the hook (`runtime/oci_hook.rs`) asks the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapRequest {
    pub task: String,
    pub container: String,
    pub pid: u32,
}

/// The agent's answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapAnswer {
    /// Not empty: the request is not the agent's; the container must not
    /// run.
    #[serde(default)]
    pub error: String,
    /// The cgroup capped.
    #[serde(default)]
    pub cgroup: String,
    /// Not empty: why the container is not capped; it runs with what else
    /// holds, and its task says which.
    #[serde(default)]
    pub uncapped: String,
}

/// The socket's name in the work directory.
pub const SOCKET_FILE: &str = "driver-cap.sock";
/// A request is one short line of JSON.
const MAX_REQUEST: u64 = 4096;
/// Longest `sun_path` Linux takes, less its NUL.
const MAX_SOCKET_PATH: usize = 107;

/// A fraction whose container is being started with the driver's cap.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Pending {
    gpu_uuid: String,
    mem_mib: u64,
    /// What its hook got: capped or not (why); `None`: no hook yet.
    outcome: Option<Result<(), String>>,
}

#[derive(Debug)]
pub struct CapSocket {
    path: PathBuf,
    memcap: Arc<DriverCap>,
    pending: Mutex<HashMap<String, Pending>>,
    proc_root: PathBuf,
}

impl CapSocket {
    /// Binds `<work_dir>/driver-cap.sock` (mode 0600) and serves it until
    /// the agent exits. An error leaves containers without the driver's cap.
    pub fn start(work_dir: &Path, memcap: Arc<DriverCap>) -> std::io::Result<Arc<CapSocket>> {
        let path = work_dir.join(SOCKET_FILE);
        if path.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "{} is longer than a unix socket path may be",
                    path.display()
                ),
            ));
        }
        // A file left by an earlier agent process.
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        }
        let me = Arc::new(CapSocket {
            path,
            memcap,
            pending: Mutex::new(HashMap::new()),
            proc_root: PathBuf::from("/proc"),
        });
        tokio::spawn(me.clone().serve(listener));
        Ok(me)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The value of the container's `GPUCTL_DRIVER_CAP`.
    pub fn env_value(&self, task_id: &str) -> String {
        format!("{}|{task_id}", self.path.display())
    }

    /// Task `task_id`'s container is about to be created: cap it on
    /// `gpu_uuid` at `mem_mib` when its hook calls.
    pub fn expect(&self, task_id: &str, gpu_uuid: &str, mem_mib: u64) {
        self.lock().insert(
            task_id.to_string(),
            Pending {
                gpu_uuid: gpu_uuid.to_string(),
                mem_mib,
                outcome: None,
            },
        );
    }

    /// The start is over (started or failed): no more caps for it. Says
    /// whether its container was capped (`Err`: why not).
    pub fn done(&self, task_id: &str) -> Result<(), String> {
        match self.lock().remove(task_id).and_then(|p| p.outcome) {
            Some(o) => o,
            None => Err("its runtime hook never called".into()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pending>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn serve(self: Arc<Self>, listener: UnixListener) {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    tokio::spawn(self.clone().answer(stream));
                }
                Err(e) => {
                    tracing::warn!(socket = %self.path.display(), error = %e, "driver cap socket");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            }
        }
    }

    async fn answer(self: Arc<Self>, stream: UnixStream) {
        let (read, mut write) = stream.into_split();
        let mut line = String::new();
        let answer = match BufReader::new(read.take(MAX_REQUEST))
            .read_line(&mut line)
            .await
        {
            Err(e) => refuse(format!("read: {e}")),
            Ok(_) => match serde_json::from_str::<CapRequest>(&line) {
                Err(e) => refuse(format!("request: {e}")),
                Ok(req) => {
                    let me = self.clone();
                    tokio::task::spawn_blocking(move || me.cap(&req))
                        .await
                        .unwrap_or_else(|e| refuse(format!("panicked: {e}")))
                }
            },
        };
        let mut out = serde_json::to_vec(&answer).unwrap_or_default();
        out.push(b'\n');
        if let Err(e) = write.write_all(&out).await {
            tracing::warn!(error = %e, "driver cap socket: answer not sent");
        }
    }

    /// Caps the cgroup of the hook's container, if its task expects it.
    fn cap(&self, req: &CapRequest) -> CapAnswer {
        let Some(p) = self.lock().get(&req.task).cloned() else {
            return refuse(format!(
                "task {} is not being started with a driver cap",
                req.task
            ));
        };
        let capped = container_cgroup(&self.proc_root, req.pid, &req.container).and_then(|cg| {
            self.memcap
                .apply(&req.task, &p.gpu_uuid, &cg, p.mem_mib, false)
                .map(|c| (cg.clone(), c))
                .map_err(|e| format!("{}: {e}", cg.display()))
        });
        let (outcome, answer) = match capped {
            Ok((cg, c)) => {
                tracing::info!(task_id = %req.task, container = %req.container, cgroup = %cg.display(), hard_bytes = c.hard_bytes, "the driver caps the container's GPU memory");
                let cgroup = cg.display().to_string();
                (
                    Ok(()),
                    CapAnswer {
                        cgroup,
                        ..CapAnswer::default()
                    },
                )
            }
            Err(why) => {
                tracing::info!(task_id = %req.task, container = %req.container, reason = %why, "no driver memory cap for the container");
                (
                    Err(why.clone()),
                    CapAnswer {
                        uncapped: why,
                        ..CapAnswer::default()
                    },
                )
            }
        };
        if let Some(p) = self.lock().get_mut(&req.task) {
            p.outcome = Some(outcome);
        }
        answer
    }
}

fn refuse(error: String) -> CapAnswer {
    tracing::warn!(%error, "driver cap hook refused: its container does not run");
    CapAnswer {
        error,
        ..CapAnswer::default()
    }
}

/// The cgroup v2 directory of `pid`, which must be named after `container`
/// (runc's cgroupfs `…/<id>`, systemd's `docker-<id>.scope`).
pub fn container_cgroup(proc_root: &Path, pid: u32, container: &str) -> Result<PathBuf, String> {
    let file = proc_root.join(format!("{pid}/cgroup"));
    let text = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
    let rel = unified_path(&text)
        .ok_or_else(|| format!("{}: pid {pid} is in no cgroup v2", file.display()))?;
    let named = Path::new(rel)
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| !container.is_empty() && n.contains(container));
    if !named {
        return Err(format!(
            "pid {pid} is in cgroup {rel}, not one of container {container}"
        ));
    }
    let mountinfo = proc_root.join("self/mountinfo");
    let mounts =
        std::fs::read_to_string(&mountinfo).map_err(|e| format!("{}: {e}", mountinfo.display()))?;
    let root = cgroup2_mount(&mounts).ok_or("no cgroup2 is mounted")?;
    Ok(root.join(rel.trim_start_matches('/')))
}

/// The `0::/path` line of a `/proc/<pid>/cgroup`; `None` for the root,
/// which is no container's.
pub fn unified_path(proc_cgroup: &str) -> Option<&str> {
    proc_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .filter(|p| p.starts_with('/') && *p != "/" && !p.contains("/../"))
}

/// Where the cgroup2 hierarchy is mounted (`/sys/fs/cgroup` preferred, then
/// a hybrid host's `/sys/fs/cgroup/unified`, then any other mount of it).
pub fn cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    let mounts: Vec<&str> = mountinfo
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let fstype = right.split_whitespace().next()?;
            // Only mounts of the hierarchy's root show all of it.
            let mut f = left.split_whitespace();
            let root = f.nth(3)?;
            let point = f.next()?;
            (fstype == "cgroup2" && root == "/").then_some(point)
        })
        .collect();
    ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .iter()
        .find(|p| mounts.contains(p))
        .copied()
        .or_else(|| mounts.first().copied())
        .map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unified_line_names_the_container_cgroup() {
        let hybrid = "9:name=systemd:/\n4:memory:/docker/abc\n0::/gpuctl/t1/abc\n";
        assert_eq!(unified_path(hybrid), Some("/gpuctl/t1/abc"));
        assert_eq!(unified_path("0::/\n"), None, "the root is no container's");
        assert_eq!(unified_path("4:memory:/x\n"), None, "v1 only");
        assert_eq!(unified_path("0::/a/../b\n"), None);
    }

    #[test]
    fn the_cgroup2_mount_is_found_in_mountinfo() {
        let hybrid = "\
25 1 0:23 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
41 25 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
50 1 0:38 / /tmp/cg2 rw,relatime - cgroup2 none rw
";
        assert_eq!(
            cgroup2_mount(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let v2 = "30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(cgroup2_mount(v2), Some(PathBuf::from("/sys/fs/cgroup")));
        let other = "50 1 0:38 / /tmp/cg2 rw,relatime - cgroup2 none rw\n60 1 0:38 /sub /tmp/sub rw - cgroup2 none rw\n";
        assert_eq!(cgroup2_mount(other), Some(PathBuf::from("/tmp/cg2")));
        let none = "25 1 0:23 / /sys/fs/cgroup ro - tmpfs tmpfs ro\n";
        assert_eq!(cgroup2_mount(none), None);
    }

    #[test]
    fn only_a_cgroup_named_after_the_container_is_taken() {
        let dir = tempfile::tempdir().unwrap();
        let proc_root = dir.path();
        std::fs::create_dir_all(proc_root.join("42")).unwrap();
        std::fs::create_dir_all(proc_root.join("self")).unwrap();
        std::fs::write(
            proc_root.join("self/mountinfo"),
            "41 25 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
        )
        .unwrap();
        std::fs::write(proc_root.join("42/cgroup"), "0::/gpuctl/t1/abc123\n").unwrap();
        assert_eq!(
            container_cgroup(proc_root, 42, "abc123").unwrap(),
            PathBuf::from("/sys/fs/cgroup/unified/gpuctl/t1/abc123")
        );
        let systemd = "0::/system.slice/docker-abc123.scope\n";
        std::fs::write(proc_root.join("42/cgroup"), systemd).unwrap();
        assert!(container_cgroup(proc_root, 42, "abc123").is_ok());
        // Another container's cgroup, the root, an unknown pid.
        let e = container_cgroup(proc_root, 42, "zzz").unwrap_err();
        assert!(e.contains("not one of container zzz"), "{e}");
        std::fs::write(proc_root.join("42/cgroup"), "0::/\n").unwrap();
        assert!(container_cgroup(proc_root, 42, "abc123")
            .unwrap_err()
            .contains("no cgroup v2"));
        assert!(container_cgroup(proc_root, 7, "abc123").is_err());
    }
}
