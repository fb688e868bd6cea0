//! Container runtimes: how a task's command actually runs on this host.
//!
//! A runtime supervises one task for its whole life in a single call:
//! [`ContainerRuntime::run`] prepares and starts it, reports that it is
//! running, copies its output to the task's log file, waits for it to end,
//! stops it when asked, and cleans up (a container is removed once its output
//! has been saved). The executor spawns one such call per task.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use futures::future::BoxFuture;
use gpuctl_proto::types::{Runtime, TaskSpec};
use tokio::sync::{oneshot, watch};

pub mod docker;
pub mod image;
pub mod process;

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
}

/// How a task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskExit {
    /// The command exited by itself. A process killed by a signal that was
    /// not ours reports 128 + signal number, like a shell.
    Exited(i32),
    /// Stopped because the executor asked (the kill channel turned true).
    Killed,
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("docker: {0}")]
    Docker(#[from] bollard::errors::Error),
    #[error("image {image}: {reason}")]
    Image { image: String, reason: String },
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
    #[error("{0}")]
    Other(String),
}

/// One way of running tasks. Object safe so the executor can hold
/// `Arc<dyn ContainerRuntime>` per [`Runtime`] kind.
pub trait ContainerRuntime: Send + Sync {
    fn kind(&self) -> Runtime;

    /// Runs the task to its end.
    ///
    /// - sends on `running` once the command has started (never if it could
    ///   not be started, in which case it returns `Err`);
    /// - when `kill` turns `true`, stops the task (SIGTERM, then SIGKILL after
    ///   `spec.kill_grace`) and returns `Ok(TaskExit::Killed)`;
    /// - leaves nothing behind: no container, no process. The log file stays.
    fn run(
        &self,
        spec: LaunchSpec,
        running: oneshot::Sender<()>,
        kill: watch::Receiver<bool>,
    ) -> BoxFuture<'_, Result<TaskExit, RuntimeError>>;

    /// Removes whatever this agent started earlier and no longer knows about
    /// (containers labelled with `agent_id` from a previous agent process).
    fn cleanup_orphans<'a>(
        &'a self,
        agent_id: &'a str,
    ) -> BoxFuture<'a, Result<usize, RuntimeError>>;
}

/// Label keys put on every container gpuctl starts.
pub const LABEL_TASK_ID: &str = "gpuctl.task_id";
pub const LABEL_JOB_ID: &str = "gpuctl.job_id";
pub const LABEL_AGENT_ID: &str = "gpuctl.agent_id";
