//! Container runtimes: how a task's command actually runs on this host.
//!
//! A runtime does not own a task's life in one call: tasks outlive the agent
//! (a restart, a crash, an upgrade), so every step can be taken again by a
//! new agent process from what the runtime itself reports:
//!
//! - [`ContainerRuntime::start`] starts a task, at most once (starting one
//!   that was already started is a no-op);
//! - [`ContainerRuntime::observe`] says whether it was started, runs or ended;
//! - [`ContainerRuntime::wait`] follows it to its end (copying a container's
//!   output to the task's log) and waits out outages of the runtime itself;
//! - [`ContainerRuntime::stop`] asks it to stop (SIGTERM, SIGKILL after the
//!   grace) and [`ContainerRuntime::remove`] removes what is left.
//!
//! An outage of the runtime (the Docker daemon restarting) is
//! [`RuntimeError::Unavailable`]: a condition to wait out, never a task failure.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use futures::future::BoxFuture;
use gpuctl_core::types::{Runtime, TaskSpec};

pub mod docker;
pub mod fence;
pub mod helper;
pub mod image;
pub mod oci_hook;
pub mod process;
pub mod reach;
pub mod supervisor;
pub mod task_init;

pub use docker::DockerRuntime;
pub use process::ProcessRuntime;

/// Everything a runtime needs to start one task.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub task: TaskSpec,
    /// The agent that runs it; put on containers as a label so that an agent
    /// can find (and clean up) what it started.
    pub agent_id: String,
    /// Final environment: the job's env plus what gpuctl adds (GPU ids, task id).
    pub env: BTreeMap<String, String>,
    /// `<work-dir>/tasks/<task_id>`, created by the caller; the working
    /// directory of a host process.
    pub sandbox: PathBuf,
    /// Combined stdout and stderr go here (appended), for `gpuctl jobs logs`.
    pub log_path: PathBuf,
    /// Time between SIGTERM and SIGKILL when the task is killed.
    pub kill_grace: Duration,
    /// Devices, cgroup and driver volume (see `crate::isolation`).
    pub isolation: TaskIsolation,
    /// The task's checkpoint directory (`<work-dir>/state/<task-id>`).
    pub state_dir: PathBuf,
    /// The agent's `contact.json`, for supervisors that fence; `None`: the
    /// task is never fenced.
    pub fence: Option<PathBuf>,
    /// Its user and mounts, as the agent's policy allowed them.
    pub security: crate::security::LaunchSecurity,
}

impl LaunchSpec {
    pub fn task_ref(&self) -> TaskRef {
        TaskRef {
            task_id: self.task.task_id.clone(),
            agent_id: self.agent_id.clone(),
            state_dir: self.state_dir.clone(),
            log_path: self.log_path.clone(),
        }
    }
}

/// A task that may have been started, by the names a runtime finds it by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskRef {
    pub task_id: String,
    pub agent_id: String,
    pub state_dir: PathBuf,
    pub log_path: PathBuf,
}

/// How a runtime confines a task. Default: nothing (tests of the runtimes
/// themselves, hosts without GPUs).
#[derive(Debug, Clone, Default)]
pub struct TaskIsolation {
    /// Device nodes to create in a container (the task's GPUs and the
    /// control devices).
    pub devices: Vec<crate::isolation::DeviceNode>,
    /// Docker's `--cgroup-parent` (an absolute cgroupfs path).
    pub cgroup_parent: Option<String>,
    /// `cgroup.procs` files a host process writes itself into before exec.
    pub cgroup_procs: Vec<PathBuf>,
    /// The consolidated driver volume, mounted read-only at
    /// `/usr/local/nvidia` in GPU containers and in containers whose image
    /// has the label `com.nvidia.volumes.needed=nvidia_driver`.
    pub driver_volume: Option<PathBuf>,
    /// The task holds GPUs.
    pub gpu_task: bool,
    /// Every NVIDIA node of the host, for the check of a started
    /// container's device access.
    pub host_nodes: Vec<PathBuf>,
    /// The CDI names of all the task's GPUs (none when CDI is off or a GPU
    /// has no name): Docker gets the GPUs through a CDI device request when
    /// the daemon takes one, else through `devices`.
    pub cdi_devices: Vec<crate::cdi::CdiDevice>,
    /// The host's NVIDIA driver, which a container given the driver must
    /// have what its image requires of (NVIDIA_REQUIRE_*).
    pub driver: HostDriver,
    /// The agent's device directory (`/dev`, or `--dev-root`): a host
    /// process in namespaces of its own keeps seeing it where it is.
    pub dev_root: Option<PathBuf>,
    /// At most this many processes and threads (a container's
    /// `PidsLimit`; a host process gets it from its cgroup).
    pub pids_max: Option<u64>,
    /// The Docker runtime to create the container with (`gpuctl`, which
    /// adds the driver cap's hook); `None`: the daemon's default.
    pub oci_runtime: Option<String>,
}

/// The host's NVIDIA driver as NVML reports it (and the agent reports it to
/// the master, whose placement checks the same facts); `None`: unknown.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostDriver {
    /// `535.129.03`.
    pub version: Option<String>,
    /// `12.2`.
    pub cuda: Option<String>,
}

impl HostDriver {
    pub fn facts(&self) -> gpuctl_core::cuda_req::Facts {
        gpuctl_core::cuda_req::Facts::reported(self.version.as_deref(), self.cuda.as_deref())
    }

    /// `driver 535.129.03, CUDA 12.2`.
    pub fn words(&self) -> String {
        gpuctl_core::cuda_req::Facts::words(self.version.as_deref(), self.cuda.as_deref())
    }
}

/// What a runtime knows of a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    /// Never started (or nothing of it is left to find).
    NotStarted,
    Running,
    Ended(Ended),
}

/// How a task ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ended {
    /// Its exit code; 128 + signal for a process killed by a signal.
    pub code: Option<i32>,
    /// Its supervisor stopped it because the agent had no contact with a
    /// master for the fence timeout.
    pub fenced: bool,
    /// It could not be started, or it vanished (no exit code to report).
    pub error: Option<String>,
    /// The signal that killed it, when the runtime knows that it was one
    /// (the process runtime does; Docker only has the code, 128 + signal).
    pub signal: Option<i32>,
    /// The kernel's OOM killer ended a process of it (Docker's OOMKilled,
    /// or the OOM kills counted in the task's memory cgroup).
    pub oom_killed: bool,
    /// The runtime itself stopped it as the runtime restarted (Docker: a
    /// SIGTERM or SIGKILL exit recorded after the agent saw the daemon go
    /// down): not the task's own failure.
    pub runtime_restarted: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The runtime itself does not answer (the Docker daemon is down or
    /// restarting): retry later, the task is not at fault.
    #[error("{runtime} unavailable: {reason}")]
    Unavailable { runtime: Runtime, reason: String },
    #[error("docker: {0}")]
    Docker(#[from] bollard::errors::Error),
    #[error("image {image}: {reason}")]
    Image { image: String, reason: String },
    /// The image requires of the NVIDIA driver what this host's does not
    /// offer: the task is refused before its container is made.
    #[error("image {image} requires {unmet} of the NVIDIA driver; this agent has {host}")]
    DriverRequirement {
        image: String,
        /// The unmet requirements, as `VARIABLE=first alternative (+n)`.
        unmet: String,
        host: String,
        /// Every requirement of the image, in full (the master learns them).
        requires: Vec<String>,
    },
    #[error("spawn {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The running container's cgroup lets it open devices it was not
    /// given, or not those it was (see `isolation::probe`).
    #[error("device isolation check failed: {0}")]
    Isolation(String),
    #[error("{0}")]
    Other(String),
}

impl RuntimeError {
    pub fn is_unavailable(&self) -> bool {
        matches!(self, RuntimeError::Unavailable { .. })
    }
}

/// What a command run beside a task ([`ContainerRuntime::exec`]) did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// Its exit code; `None`: it ran past its timeout.
    pub code: Option<i32>,
    /// The start of its output, stdout then stderr, at most
    /// [`EXEC_OUTPUT_MAX`] bytes.
    pub output: String,
}

/// What is kept of a check command's output: enough for its words.
pub const EXEC_OUTPUT_MAX: usize = 512;

impl ExecOutput {
    /// At most [`EXEC_OUTPUT_MAX`] bytes of `bytes`, as text.
    pub fn new(code: Option<i32>, bytes: &[u8]) -> ExecOutput {
        let bytes = &bytes[..bytes.len().min(EXEC_OUTPUT_MAX)];
        ExecOutput {
            code,
            output: String::from_utf8_lossy(bytes).into_owned(),
        }
    }
}

/// Whether a runtime answers, for heartbeats and `gpuctl agents`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeStatus {
    pub available: bool,
    /// Why not, when not.
    pub message: String,
}

/// One way of running tasks. Object safe so the executor can hold
/// `Arc<dyn ContainerRuntime>` per [`Runtime`] kind.
pub trait ContainerRuntime: Send + Sync {
    fn kind(&self) -> Runtime;

    /// Starts the task and returns once it runs. Idempotent: a task that
    /// was started before (by this or an earlier agent process) is not
    /// started again.
    fn start<'a>(&'a self, spec: &'a LaunchSpec) -> BoxFuture<'a, Result<(), RuntimeError>>;

    /// Whether the task was started, runs or ended, from the runtime itself.
    fn observe<'a>(&'a self, task: &'a TaskRef) -> BoxFuture<'a, Result<Observed, RuntimeError>>;

    /// Follows a started task to its end. Outages of the runtime are waited
    /// out here; an error means the task cannot be followed at all.
    fn wait<'a>(&'a self, task: &'a TaskRef) -> BoxFuture<'a, Result<Ended, RuntimeError>>;

    /// Asks the task to stop: SIGTERM now, SIGKILL after `grace`.
    fn stop<'a>(
        &'a self,
        task: &'a TaskRef,
        grace: Duration,
    ) -> BoxFuture<'a, Result<(), RuntimeError>>;

    /// Removes what is left of an ended task (a container); the log stays.
    fn remove<'a>(&'a self, task: &'a TaskRef) -> BoxFuture<'a, Result<(), RuntimeError>>;

    /// Ids of the tasks this runtime runs for `agent_id` (to find strays
    /// the agent has no record of).
    fn list<'a>(&'a self, agent_id: &'a str) -> BoxFuture<'a, Result<Vec<String>, RuntimeError>>;

    fn status(&self) -> RuntimeStatus;

    /// Runs `sh -c command` beside a running task, for its health checks:
    /// in its container, or (a host task) as its user, in its cgroups and
    /// namespaces, with its environment. Past `timeout` it is given up
    /// (`code: None`).
    fn exec<'a>(
        &'a self,
        task: &'a TaskRef,
        command: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<ExecOutput, RuntimeError>>;

    /// Whether containers can be created with the OCI runtime `name` whose
    /// hook has the driver cap their cgroup (`oci_hook`), and why not.
    fn cap_runtime(&self, name: &str) -> Result<(), String> {
        let _ = name;
        Err(format!("the {} runtime runs no containers", self.kind()))
    }
}

/// Starts `<exe> <subcommand> <dir>` (a task supervisor, a container's
/// fence watcher): with an empty environment, its output appended to
/// `log`, in a process group of its own so that a Ctrl-C or a signal to
/// the agent's group does not reach it. It is not killed when the agent
/// exits.
pub(crate) fn spawn_helper(
    exe: &std::path::Path,
    subcommand: &str,
    dir: &std::path::Path,
    log: &std::path::Path,
) -> std::io::Result<tokio::process::Child> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    let err = out.try_clone()?;
    tokio::process::Command::new(exe)
        .arg(subcommand)
        .arg(dir)
        .env_clear()
        .stdin(std::process::Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
}

/// Label keys put on every container gpuctl starts.
pub const LABEL_TASK_ID: &str = "gpuctl.task_id";
pub const LABEL_JOB_ID: &str = "gpuctl.job_id";
pub const LABEL_AGENT_ID: &str = "gpuctl.agent_id";
