//! What an agent is given to run: a job's template bound to an agent and exact GPUs.

use serde::{Deserialize, Serialize};

use super::*;

/// What an agent runs: a job's spec bound to an agent and exact GPUs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskSpec {
    pub task_id: TaskId,
    /// The gpuctl job; empty for a framework's task.
    pub job_id: JobId,
    /// The framework that launched it; empty for gpuctl jobs.
    #[serde(default)]
    pub framework_id: FrameworkId,
    /// Its job's template with the task's own env (rank, peers, ports) and
    /// resources; a framework's task has the defaults but for what it
    /// launched with.
    #[serde(flatten)]
    pub template: TaskTemplate,
    pub gpu_uuids: Vec<GpuUuid>,
    /// A fraction of its one GPU, and how that GPU is shared; `None`:
    /// whole GPUs or MIG devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<TaskShare>,
}

impl TaskSpec {
    /// What it holds: its GPUs or MIG devices, or a fraction of one.
    pub fn holding(&self) -> Holding<'_, TaskShare> {
        Holding::of(&self.gpu_uuids, self.share.as_ref())
    }
}

/// Why the master wants a task stopped, as its agent tells the task in its
/// notice file: `kind` is machine-readable (`preempted`, `drained`,
/// `cancelled`, `killed`, or the lower-case name of any other reason the
/// master records), `message` the task's message (`preempted by job-7
/// (priority 5)`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopNotice {
    pub kind: String,
    pub message: String,
}

/// What a task holds of a shared GPU, as its agent enforces it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskShare {
    pub fraction: GpuFraction,
    pub mode: ShareMode,
    /// The tenant the task is charged to: tasks of different tenants never
    /// share an MPS server.
    #[serde(default)]
    pub tenant: Tenant,
}
