//! MPS control daemons for GPUs shared in `mps` mode (docs/sharing.md).
//!
//! One daemon per GPU and group (the executor's: tenant and Linux user):
//! tasks of different tenants never share an MPS server, so neither its
//! faults nor its `/dev/shm`, and tasks of different users never wait on
//! each other's server. Each daemon has its own directories under
//! `<work>/mps/<gpu>/<group>/`:
//!
//! - `pipe/`: the daemon's sockets and pid file, mounted into that GPU's
//!   and tenant's tasks only (at [`CONTAINER_PIPE_DIR`]);
//! - `log/`: its logs, never mounted into a task;
//! - `shm/`: a tmpfs the daemon's clients share as `/dev/shm` (MPS clients
//!   and their server meet there; Docker's own `/dev/shm` is per container).
//!
//! The daemon is started with `-d`, so it leaves the agent's process group
//! and outlives an agent restart like the tasks do; a new agent finds it by
//! the agent's own record of its pid (`<group>/daemon.pid`, never mounted
//! into a task), a process that must be the control program serving that
//! very pipe directory. The daemon's own pid file lies in `pipe/`, which
//! tasks may write: trusted, a root container could name another tenant's
//! daemon there and have the agent stop it. A daemon that dies while tasks
//! use it is started again; one no task has used for [`IDLE_QUIT`] is
//! asked to quit.
//!
//! MPS's limits are per CUDA process (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`,
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` in the client's environment, which a
//! client can only lower); the task's total is held by the executor's
//! memory watch, not here.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpuctl_core::types::GpuFraction;

/// The control program's name, looked for in the driver volume and PATH.
pub const CONTROL_NAME: &str = "nvidia-cuda-mps-control";
/// The pid file the daemon writes into its pipe directory.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// Where a container sees its server's pipe directory.
pub const CONTAINER_PIPE_DIR: &str = "/run/nvidia-mps";
/// How long a daemon no task uses is kept before it is asked to quit: a job
/// that restarts its task soon finds it running.
pub const IDLE_QUIT: Duration = Duration::from_secs(30);
/// How long a start or a quit is waited for.
const WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    #[error("no MPS control program ({CONTROL_NAME}) on this agent")]
    NoControl,
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Daemon(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> MpsError {
    let what = what.into();
    move |source| MpsError::Io { what, source }
}

/// One daemon's place on disk and its process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsServer {
    pub gpu: String,
    pub tenant: String,
    pub pipe_dir: PathBuf,
    pub log_dir: PathBuf,
    pub shm_dir: PathBuf,
    /// The agent's record of the daemon's pid.
    record: PathBuf,
}

impl MpsServer {
    fn new(root: &Path, gpu: &str, tenant: &str) -> MpsServer {
        let dir = root.join(gpu).join(tenant);
        MpsServer {
            gpu: gpu.to_string(),
            tenant: tenant.to_string(),
            pipe_dir: root.join(PIPES_DIR).join(pipe_id(gpu, tenant)),
            log_dir: dir.join("log"),
            shm_dir: dir.join("shm"),
            record: dir.join(RECORD_FILE),
        }
    }

    /// The daemon's pid: the agent's record of it (else, for a daemon an
    /// older agent started, its pid file), when that names a live control
    /// program serving this pipe directory.
    pub fn pid(&self) -> Option<i32> {
        let text = std::fs::read_to_string(&self.record)
            .or_else(|_| std::fs::read_to_string(self.pipe_dir.join(PID_FILE)))
            .ok()?;
        let pid: i32 = text.trim().parse().ok().filter(|p| *p > 0)?;
        (live_control(pid) && serves(pid, &self.pipe_dir)).then_some(pid)
    }

    /// The pid the daemon wrote into its pipe directory, if that is this
    /// daemon's (it is written before any task can mount the directory).
    fn announced_pid(&self) -> Option<i32> {
        let text = std::fs::read_to_string(self.pipe_dir.join(PID_FILE)).ok()?;
        let pid: i32 = text.trim().parse().ok().filter(|p| *p > 0)?;
        (live_control(pid) && serves(pid, &self.pipe_dir)).then_some(pid)
    }
}

/// The agent's record of a daemon's pid, in its group's directory.
const RECORD_FILE: &str = "daemon.pid";

/// Where the daemons' pipe directories are, under the MPS root (a name no
/// GPU can have: `check_name` refuses a leading dot).
const PIPES_DIR: &str = ".pipes";

/// The longest socket the daemon makes in its pipe directory.
const LONGEST_SOCKET: &str = "control_privileged";

/// The most bytes of a Unix socket's path (`sun_path` is 108, with its NUL).
const SOCKET_PATH_MAX: usize = 107;

/// A pipe directory's name: short and fixed whatever the GPU's and group's
/// names, because the daemon's sockets must fit a Unix socket path. On a
/// real driver, `<work>/mps/<gpu>/<group>/pipe/control_privileged` was
/// longer than that, and `-d` exited 1 with nothing said (docs/hardware.md).
/// FNV-1a, 64 bits: stable across agents and releases.
fn pipe_id(gpu: &str, group: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in gpu.bytes().chain([b'/']).chain(group.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// `<group>/pipe`, a link to the group's pipe directory: where an operator
/// looks for it beside `log/` and `shm/`. (A directory of that name, from
/// an agent before the short names, is left alone.)
fn link_pipe(server: &MpsServer) {
    let Some(link) = server.record.parent().map(|g| g.join("pipe")) else {
        return;
    };
    if std::fs::read_link(&link).is_ok_and(|to| to == server.pipe_dir) {
        return;
    }
    let _ = std::fs::remove_file(&link);
    if let Err(e) = std::os::unix::fs::symlink(&server.pipe_dir, &link) {
        tracing::debug!(link = %link.display(), error = %e, "no pipe link");
    }
}

/// Why the daemons' sockets cannot be made under `root`, if they cannot.
pub fn socket_path_problem(root: &Path) -> Option<String> {
    let longest = root
        .join(PIPES_DIR)
        .join(pipe_id("", ""))
        .join(LONGEST_SOCKET);
    let len = longest.as_os_str().len();
    (len > SOCKET_PATH_MAX).then(|| {
        format!(
            "the MPS daemon's sockets under {} would be {len} bytes long, more than a Unix socket path takes ({SOCKET_PATH_MAX}): give the agent a shorter --work-dir",
            root.display()
        )
    })
}

/// Whether `pid` was started for `pipe_dir`: its environment names it (the
/// agent starts each daemon with its own `CUDA_MPS_PIPE_DIRECTORY`).
fn serves(pid: i32, pipe_dir: &Path) -> bool {
    let want = format!("CUDA_MPS_PIPE_DIRECTORY={}", pipe_dir.display());
    std::fs::read(format!("/proc/{pid}/environ"))
        .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == want.as_bytes()))
}

/// Whether `pid` is a live (not zombie) process running the control program.
fn live_control(pid: i32) -> bool {
    let proc = PathBuf::from(format!("/proc/{pid}"));
    let Ok(stat) = std::fs::read_to_string(proc.join("stat")) else {
        return false;
    };
    // The state follows the command name's closing parenthesis.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, r)| r.trim().chars().next());
    if matches!(state, Some('Z' | 'X') | None) {
        return false;
    }
    std::fs::read(proc.join("cmdline")).is_ok_and(|c| {
        c.split(|b| *b == 0)
            .any(|arg| arg.ends_with(CONTROL_NAME.as_bytes()))
    })
}

/// The client environment of a task on `server`'s GPU: where the daemon is
/// and the task's limits, per CUDA process. `pipe_dir` is where the task
/// sees the pipe directory. Device 0: the task sees only its GPU (naming
/// one it cannot see makes MPS drop every limit).
pub fn client_env(pipe_dir: &str, fraction: &GpuFraction) -> BTreeMap<String, String> {
    let mut env = BTreeMap::from([
        ("CUDA_MPS_PIPE_DIRECTORY".to_string(), pipe_dir.to_string()),
        (
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".to_string(),
            format!("0={}M", fraction.mem_mib),
        ),
    ]);
    if fraction.compute_pct > 0 {
        env.insert(
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".to_string(),
            fraction.compute_pct.to_string(),
        );
    }
    env
}

/// Removes what a task set of MPS's client variables: only the agent's
/// count (a task's own `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` naming a GPU it
/// cannot see would drop its limit).
pub fn scrub_env(env: &mut BTreeMap<String, String>) {
    env.retain(|k, _| !k.starts_with("CUDA_MPS_"));
}

/// The MPS control daemons of this agent.
pub struct Mps {
    control: Option<PathBuf>,
    root: PathBuf,
    /// Tasks using each (GPU, group) daemon, and since when none has.
    users: Mutex<BTreeMap<(String, String), Users>>,
    idle_quit: Duration,
    /// Held while a daemon is looked for and started or stopped: two tasks
    /// starting at once on a GPU must find one daemon, not start two.
    starts: Mutex<()>,
}

#[derive(Default)]
struct Users {
    tasks: BTreeSet<String>,
    idle_since: Option<Instant>,
}

impl Mps {
    /// `control`: the control program (`None`: MPS is not available here
    /// and tasks on `mps` GPUs run unenforced, saying so). `root`: where
    /// daemons keep their directories.
    pub fn new(control: Option<PathBuf>, root: PathBuf) -> Mps {
        Mps {
            control,
            root,
            users: Mutex::default(),
            idle_quit: IDLE_QUIT,
            starts: Mutex::default(),
        }
    }

    /// How long an unused daemon is kept (tests shorten it).
    pub fn with_idle_quit(mut self, idle: Duration) -> Mps {
        self.idle_quit = idle;
        self
    }

    pub fn available(&self) -> bool {
        self.control.is_some()
    }

    pub fn control(&self) -> Option<&Path> {
        self.control.as_deref()
    }

    /// The control program to use: `configured` when given (empty: none),
    /// else the driver volume's, else the first on PATH.
    pub fn find_control(
        configured: Option<&Path>,
        driver_volume: Option<&Path>,
    ) -> Option<PathBuf> {
        if let Some(p) = configured {
            return (!p.as_os_str().is_empty()).then(|| p.to_path_buf());
        }
        let in_volume = driver_volume.map(|v| v.join("bin").join(CONTROL_NAME));
        let on_path = std::env::var_os("PATH")
            .map(|p| {
                std::env::split_paths(&p)
                    .map(|d| d.join(CONTROL_NAME))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        in_volume.into_iter().chain(on_path).find(|p| p.is_file())
    }

    /// The daemon for `gpu` and `tenant`, started when it is not running,
    /// and `task` counted as its user. Blocking.
    pub fn acquire(&self, task: &str, gpu: &str, tenant: &str) -> Result<MpsServer, MpsError> {
        // Claimed first, so that supervision cannot stop it as idle
        // between its start and the claim.
        self.adopt(task, gpu, tenant);
        self.ensure(gpu, tenant).inspect_err(|_| self.release(task))
    }

    /// Counts `task` as a user of the (GPU, group) daemon without starting
    /// it (a task found running after an agent restart).
    pub fn adopt(&self, task: &str, gpu: &str, tenant: &str) {
        let mut users = self.users.lock().unwrap_or_else(|p| p.into_inner());
        let u = users
            .entry((gpu.to_string(), tenant.to_string()))
            .or_default();
        u.tasks.insert(task.to_string());
        u.idle_since = None;
    }

    /// The task no longer uses its daemon.
    pub fn release(&self, task: &str) {
        let mut users = self.users.lock().unwrap_or_else(|p| p.into_inner());
        for u in users.values_mut() {
            if u.tasks.remove(task) && u.tasks.is_empty() {
                u.idle_since = Some(Instant::now());
            }
        }
    }

    /// The daemon's place for `gpu` and `tenant` (whether it runs or not).
    pub fn server(&self, gpu: &str, tenant: &str) -> MpsServer {
        MpsServer::new(&self.root, gpu, tenant)
    }

    /// Starts the daemon for `gpu` and `tenant` unless it runs. Blocking.
    pub fn ensure(&self, gpu: &str, tenant: &str) -> Result<MpsServer, MpsError> {
        check_name("GPU", gpu)?;
        check_name("tenant", tenant)?;
        let control = self.control.as_ref().ok_or(MpsError::NoControl)?;
        let _one = self.starts.lock().unwrap_or_else(|p| p.into_inner());
        let server = self.server(gpu, tenant);
        if server.pid().is_some() {
            return Ok(server);
        }
        if let Some(why) = socket_path_problem(&self.root) {
            return Err(MpsError::Daemon(why));
        }
        for (dir, mode) in [
            (&server.pipe_dir, 0o755),
            (&server.log_dir, 0o700),
            (&server.shm_dir, 0o1777),
        ] {
            std::fs::create_dir_all(dir).map_err(io(format!("create {}", dir.display())))?;
            set_mode(dir, mode)?;
        }
        mount_shm(&server.shm_dir);
        link_pipe(&server);
        // A daemon that died leaves its socket and pid file; a new one
        // refuses to start beside them.
        for stale in [
            "control",
            "control_privileged",
            "control_lock",
            "log",
            PID_FILE,
        ] {
            let _ = std::fs::remove_file(server.pipe_dir.join(stale));
        }
        let _ = std::fs::remove_file(&server.record);
        let status = Command::new(control)
            .arg("-d")
            .env("CUDA_VISIBLE_DEVICES", gpu)
            .env("CUDA_MPS_PIPE_DIRECTORY", &server.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &server.log_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .map_err(io(format!("run {} -d", control.display())))?;
        if !status.status.success() {
            return Err(MpsError::Daemon(format!(
                "{} -d for GPU {gpu}: {}: {}",
                control.display(),
                status.status,
                String::from_utf8_lossy(&status.stderr).trim()
            )));
        }
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            if let (Some(pid), true) = (
                server.announced_pid(),
                server.pipe_dir.join("control").exists(),
            ) {
                crate::checkpoint::write_atomic(&server.record, pid.to_string().as_bytes())
                    .map_err(|e| MpsError::Daemon(format!("record the daemon's pid: {e}")))?;
                tracing::info!(gpu, tenant, pid, pipe = %server.pipe_dir.display(), "MPS control daemon started");
                return Ok(server);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(MpsError::Daemon(format!(
            "the MPS control daemon for GPU {gpu} did not come up in {} s (its log: {})",
            WAIT.as_secs(),
            server.log_dir.display()
        )))
    }

    /// Sends commands to a running daemon (the control program in client
    /// mode, one command per line); its answer.
    pub fn command(&self, server: &MpsServer, commands: &str) -> Result<String, MpsError> {
        let control = self.control.as_ref().ok_or(MpsError::NoControl)?;
        let mut child = Command::new(control)
            .env("CUDA_MPS_PIPE_DIRECTORY", &server.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &server.log_dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(io(format!("run {}", control.display())))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(commands.as_bytes())
                .map_err(io("write to the MPS control program"))?;
        }
        let out = child
            .wait_with_output()
            .map_err(io("wait for the MPS control program"))?;
        if !out.status.success() {
            return Err(MpsError::Daemon(format!(
                "{commands:?} to the MPS daemon of GPU {}: {}: {}",
                server.gpu,
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Asks the daemon to quit and waits for it; kills it when it does not.
    pub fn stop(&self, server: &MpsServer) -> Result<(), MpsError> {
        let Some(pid) = server.pid() else {
            return Ok(());
        };
        if let Err(e) = self.command(server, "quit\n") {
            tracing::warn!(gpu = %server.gpu, error = %e, "MPS daemon did not take quit; killing it");
        }
        let deadline = Instant::now() + WAIT;
        while live_control(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if live_control(pid) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = nix::mount::umount2(&server.shm_dir, nix::mount::MntFlags::MNT_DETACH);
        tracing::info!(gpu = %server.gpu, tenant = %server.tenant, "MPS control daemon stopped");
        Ok(())
    }

    /// One round of supervision: a daemon that died under tasks is started
    /// again, one idle for [`IDLE_QUIT`] quits, and one no task of this
    /// agent knows (left by an earlier agent, its tasks gone) is counted
    /// idle from now. Blocking; the daemons it restarted.
    pub fn supervise(&self) -> Vec<MpsServer> {
        if self.control.is_none() {
            return Vec::new();
        }
        self.notice_running();
        let keys: Vec<((String, String), bool, bool)> = {
            let users = self.users.lock().unwrap_or_else(|p| p.into_inner());
            users
                .iter()
                .map(|(k, u)| {
                    let idle = u.tasks.is_empty()
                        && u.idle_since.is_some_and(|t| t.elapsed() >= self.idle_quit);
                    (k.clone(), !u.tasks.is_empty(), idle)
                })
                .collect()
        };
        let mut restarted = Vec::new();
        for ((gpu, tenant), used, idle) in keys {
            let server = self.server(&gpu, &tenant);
            if used && server.pid().is_none() {
                tracing::warn!(
                    gpu,
                    tenant,
                    "MPS control daemon is gone while tasks use it; starting it again"
                );
                match self.ensure(&gpu, &tenant) {
                    Ok(s) => restarted.push(s),
                    Err(e) => {
                        tracing::warn!(gpu, tenant, error = %e, "MPS control daemon could not be restarted")
                    }
                }
            } else if idle {
                let _one = self.starts.lock().unwrap_or_else(|p| p.into_inner());
                // Claimed again since the look above: it stays.
                let still_idle = self
                    .users
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&(gpu.clone(), tenant.clone()))
                    .is_none_or(|u| u.tasks.is_empty());
                if !still_idle {
                    continue;
                }
                if let Err(e) = self.stop(&server) {
                    tracing::warn!(gpu, tenant, error = %e, "MPS control daemon could not be stopped");
                }
                let mut users = self.users.lock().unwrap_or_else(|p| p.into_inner());
                if users
                    .get(&(gpu.clone(), tenant.clone()))
                    .is_some_and(|u| u.tasks.is_empty())
                {
                    users.remove(&(gpu, tenant));
                }
            }
        }
        restarted
    }

    /// Daemons running on disk that no task has claimed: idle from now.
    fn notice_running(&self) {
        let Ok(gpus) = std::fs::read_dir(&self.root) else {
            return;
        };
        let mut found = Vec::new();
        for g in gpus.flatten() {
            if g.file_name() == PIPES_DIR {
                continue;
            }
            let Ok(tenants) = std::fs::read_dir(g.path()) else {
                continue;
            };
            for t in tenants.flatten() {
                let (gpu, tenant) = (
                    g.file_name().to_string_lossy().into_owned(),
                    t.file_name().to_string_lossy().into_owned(),
                );
                if self.server(&gpu, &tenant).pid().is_some() {
                    found.push((gpu, tenant));
                }
            }
        }
        let mut users = self.users.lock().unwrap_or_else(|p| p.into_inner());
        for key in found {
            users.entry(key).or_insert_with(|| Users {
                tasks: BTreeSet::new(),
                idle_since: Some(Instant::now()),
            });
        }
    }

    /// Stops every daemon of this agent (an agent that takes its tasks
    /// down with it). Blocking.
    pub fn stop_all(&self) {
        self.notice_running();
        let keys: Vec<(String, String)> = {
            let mut users = self.users.lock().unwrap_or_else(|p| p.into_inner());
            std::mem::take(&mut *users).into_keys().collect()
        };
        for (gpu, tenant) in keys {
            if let Err(e) = self.stop(&self.server(&gpu, &tenant)) {
                tracing::warn!(gpu, tenant, error = %e, "MPS control daemon could not be stopped");
            }
        }
    }

    /// The daemons running now, for status and metrics.
    pub fn running(&self) -> Vec<(MpsServer, usize)> {
        let users = self.users.lock().unwrap_or_else(|p| p.into_inner());
        users
            .iter()
            .map(|((g, t), u)| (self.server(g, t), u.tasks.len()))
            .filter(|(s, _)| s.pid().is_some())
            .collect()
    }
}

/// A GPU uuid or tenant names a directory: nothing that could leave it.
fn check_name(what: &str, s: &str) -> Result<(), MpsError> {
    let ok = !s.is_empty()
        && s.len() <= 128
        && !s.starts_with('.')
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(MpsError::Daemon(format!(
            "{what} {s:?} cannot name an MPS directory"
        )))
    }
}

fn set_mode(path: &Path, mode: u32) -> Result<(), MpsError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(io(format!("chmod {}", path.display())))
}

/// A tmpfs on `dir` unless one is there (a daemon adopted after a restart).
/// Without one (no privilege to mount), the directory itself serves, on
/// the agent's disk.
fn mount_shm(dir: &Path) {
    use std::os::unix::fs::MetadataExt;
    let on_own_fs = match (std::fs::metadata(dir), dir.parent().map(std::fs::metadata)) {
        (Ok(d), Some(Ok(p))) => d.dev() != p.dev(),
        _ => false,
    };
    if on_own_fs {
        return;
    }
    if let Err(e) = nix::mount::mount(
        Some("tmpfs"),
        dir,
        Some("tmpfs"),
        nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
        Some("mode=1777"),
    ) {
        tracing::warn!(dir = %dir.display(), error = %e, "no tmpfs for MPS clients' /dev/shm; using the directory");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_env_sets_limits_for_the_one_visible_gpu() {
        let env = client_env(
            CONTAINER_PIPE_DIR,
            &GpuFraction {
                mem_mib: 10240,
                compute_pct: 25,
            },
        );
        assert_eq!(env["CUDA_MPS_PIPE_DIRECTORY"], "/run/nvidia-mps");
        assert_eq!(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=10240M");
        assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
        let env = client_env(
            "/x",
            &GpuFraction {
                mem_mib: 512,
                compute_pct: 0,
            },
        );
        assert!(!env.contains_key("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"));
    }

    #[test]
    fn a_task_cannot_set_its_own_mps_variables() {
        let mut env = BTreeMap::from([
            (
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".to_string(),
                "0=1G,7=1G".to_string(),
            ),
            (
                "CUDA_MPS_PIPE_DIRECTORY".to_string(),
                "/elsewhere".to_string(),
            ),
            ("PATH".to_string(), "/bin".to_string()),
        ]);
        scrub_env(&mut env);
        assert_eq!(env.keys().collect::<Vec<_>>(), vec!["PATH"]);
    }

    #[test]
    fn names_that_leave_the_directory_are_refused() {
        for bad in ["", "..", ".hidden", "a/b", "a b"] {
            assert!(check_name("tenant", bad).is_err(), "{bad:?}");
        }
        check_name("GPU", "GPU-2f6c1e4e-0000").unwrap();
        check_name("tenant", "team-a").unwrap();
    }

    #[test]
    fn without_a_control_program_nothing_starts() {
        let dir = tempfile::tempdir().unwrap();
        let mps = Mps::new(None, dir.path().to_path_buf());
        assert!(matches!(mps.ensure("GPU-1", "t"), Err(MpsError::NoControl)));
        assert!(mps.supervise().is_empty());
        let none = Mps::find_control(Some(Path::new("")), None);
        assert_eq!(none, None);
    }

    fn fake_control() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fake-mps/nvidia-cuda-mps-control")
    }

    fn log_of(s: &MpsServer) -> String {
        std::fs::read_to_string(s.log_dir.join("control.log")).unwrap_or_default()
    }

    /// The daemon's sockets must fit a Unix socket path (107 bytes): the
    /// pipe directory's name is short whatever the GPU's and group's, and
    /// a work dir too long even for that is refused with the reason
    /// before the daemon fails silently (the real one exits 1 with
    /// nothing said, and so does the fake).
    #[test]
    fn pipe_directories_fit_a_unix_socket_path() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().to_string_lossy().len();
        // A root where the old layout, <gpu>/<group>/pipe/, was too long.
        let root = dir.path().join("w".repeat(50 - base)).join("mps");
        let (gpu, group) = ("GPU-e3fcdd08-83ff-e10e-ac6c-3b4dc1b454ed", "team-a.u80000");
        let old = root.join(gpu).join(group).join("pipe/control_privileged");
        assert!(old.as_os_str().len() > SOCKET_PATH_MAX);
        let mps = Mps::new(Some(fake_control()), root.clone());
        let s = mps.acquire("t1", gpu, group).unwrap();
        assert!(s.pid().is_some());
        assert!(s.pipe_dir.join(LONGEST_SOCKET).as_os_str().len() <= SOCKET_PATH_MAX);
        assert_eq!(s.pipe_dir, mps.server(gpu, group).pipe_dir, "stable");
        let link = root.join(gpu).join(group).join("pipe");
        assert_eq!(std::fs::read_link(&link).unwrap(), s.pipe_dir);
        assert_ne!(s.pipe_dir, mps.server(gpu, "team-b.u80001").pipe_dir);
        // A new agent finds the daemon (and never takes .pipes for a GPU).
        let again = Mps::new(Some(fake_control()), root.clone());
        again.notice_running();
        let found: Vec<_> = again.running().into_iter().map(|(s, _)| s).collect();
        assert_eq!(found, vec![s.clone()]);
        mps.stop(&s).unwrap();

        // Too long even so: refused, naming the cause.
        let deep = dir.path().join("d".repeat(80 - base)).join("mps");
        let mps = Mps::new(Some(fake_control()), deep.clone());
        let err = mps.acquire("t2", gpu, group).unwrap_err().to_string();
        assert!(
            err.contains("--work-dir") && err.contains("Unix socket"),
            "{err}"
        );
        assert!(socket_path_problem(&deep).is_some());
        assert!(socket_path_problem(&root).is_none());
        // The fake fails as the real daemon does past the limit.
        let pipe = deep.join("p".repeat(40));
        let out = std::process::Command::new(fake_control())
            .arg("-d")
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", dir.path().join("log"))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        assert!(out.stderr.is_empty());
    }

    /// The real daemon's life with the fake control program: one daemon
    /// per (GPU, group), shared by that pair's tasks, started again when
    /// it dies under them, asked to quit once idle.
    #[test]
    fn daemons_per_gpu_and_tenant_are_started_shared_restarted_and_quit() {
        let dir = tempfile::tempdir().unwrap();
        let mps = Mps::new(Some(fake_control()), dir.path().join("mps"))
            .with_idle_quit(Duration::from_millis(200));
        let a = mps.acquire("t1", "GPU-1", "team-a").unwrap();
        let a2 = mps.acquire("t2", "GPU-1", "team-a").unwrap();
        let b = mps.acquire("t3", "GPU-1", "team-b").unwrap();
        assert_eq!(a, a2, "one daemon for a GPU and group");
        assert_ne!(a.pipe_dir, b.pipe_dir, "tenants never share a daemon");
        let (pa, pb) = (a.pid().unwrap(), b.pid().unwrap());
        assert_ne!(pa, pb);
        assert_eq!(log_of(&a).matches(" start ").count(), 1, "{}", log_of(&a));
        assert!(
            log_of(&a).contains("CUDA_VISIBLE_DEVICES=GPU-1"),
            "{}",
            log_of(&a)
        );
        assert_eq!(mps.running().len(), 2);

        // Killed under its tasks: started again by supervision.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pa),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while live_control(pa) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let restarted = mps.supervise();
        assert_eq!(restarted.len(), 1, "{restarted:?}");
        assert_ne!(a.pid(), Some(pa));
        assert_eq!(log_of(&a).matches(" start ").count(), 2, "{}", log_of(&a));

        // A new agent (a new Mps) finds them by their pid files.
        let again = Mps::new(Some(fake_control()), dir.path().join("mps"));
        again.adopt("t3", "GPU-1", "team-b");
        assert!(again.supervise().is_empty());
        assert_eq!(b.pid(), Some(pb), "an adopted daemon is not restarted");

        // Idle: asked to quit, by command.
        for t in ["t1", "t2", "t3"] {
            mps.release(t);
        }
        std::thread::sleep(Duration::from_millis(300));
        mps.supervise();
        assert_eq!(a.pid(), None);
        assert_eq!(b.pid(), None);
        assert!(log_of(&a).contains("command quit"), "{}", log_of(&a));
        assert!(mps.running().is_empty());
    }

    /// A task that can write its pipe directory (a root container) names
    /// another tenant's daemon in the pid file there: the agent goes by its
    /// own record, and stopping the task's daemon leaves the other alone.
    #[test]
    fn a_pid_file_rewritten_by_a_task_cannot_name_another_daemon() {
        let dir = tempfile::tempdir().unwrap();
        let mps = Mps::new(Some(fake_control()), dir.path().to_path_buf());
        let a = mps.ensure("GPU-1", "alpha.image").unwrap();
        let b = mps.ensure("GPU-1", "beta.image").unwrap();
        let (pa, pb) = (a.pid().unwrap(), b.pid().unwrap());
        std::fs::write(a.pipe_dir.join(PID_FILE), pb.to_string()).unwrap();
        assert_eq!(a.pid(), Some(pa), "the agent's record, not the task's file");
        // A new agent (no record is lost: it is on disk) sees the same.
        let later = Mps::new(Some(fake_control()), dir.path().to_path_buf());
        assert_eq!(later.server("GPU-1", "alpha.image").pid(), Some(pa));
        later.stop(&a).unwrap();
        assert!(!live_control(pa));
        assert!(live_control(pb), "beta's daemon was stopped for alpha's");
        assert_eq!(b.pid(), Some(pb));
        // Without a record (a daemon of an older agent), a pid file naming
        // a daemon of another pipe directory is not believed either.
        let c = mps.ensure("GPU-1", "gamma.image").unwrap();
        let pc = c.pid().unwrap();
        std::fs::remove_file(dir.path().join("GPU-1/gamma.image").join(RECORD_FILE)).unwrap();
        std::fs::write(c.pipe_dir.join(PID_FILE), pb.to_string()).unwrap();
        assert_eq!(c.pid(), None);
        std::fs::write(c.pipe_dir.join(PID_FILE), pc.to_string()).unwrap();
        assert_eq!(c.pid(), Some(pc), "its own daemon's pid file is");
        mps.stop(&c).unwrap();
        later.stop(&b).unwrap();
        assert!(!live_control(pc) && !live_control(pb));
    }

    #[test]
    fn a_pid_file_naming_another_program_is_not_a_daemon() {
        let dir = tempfile::tempdir().unwrap();
        let s = MpsServer::new(dir.path(), "GPU-1", "t");
        std::fs::create_dir_all(&s.pipe_dir).unwrap();
        // This test process is alive but is not the control program.
        std::fs::write(s.pipe_dir.join(PID_FILE), std::process::id().to_string()).unwrap();
        assert_eq!(s.pid(), None);
        std::fs::write(s.pipe_dir.join(PID_FILE), "garbage").unwrap();
        assert_eq!(s.pid(), None);
    }
}
