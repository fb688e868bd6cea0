//! What agents report: task status updates, runtime health, GPU samples, and why a task ended.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::*;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusUpdate {
    pub agent_id: AgentId,
    pub task_id: TaskId,
    pub state: TaskState,
    pub exit_code: Option<i32>,
    pub message: String,
    /// Identifies this update for acknowledgement; empty from old agents.
    #[serde(default)]
    pub uuid: Vec<u8>,
    /// The task ended because one of its GPUs failed a health check.
    #[serde(default)]
    pub gpu_unhealthy: bool,
    /// The agent killed the task because it heard from no leader for its
    /// fence timeout (wire: state KILLED, reason REASON_FENCED).
    #[serde(default)]
    pub fenced: bool,
    /// The state of a newer update the agent holds behind this one (until
    /// this one is acknowledged); a final one means the task's processes
    /// are gone and its GPUs may be given again. None: this is the latest.
    #[serde(default)]
    pub latest_state: Option<TaskState>,
    /// Not empty: the agent refused to start the task because its driver
    /// does not meet what the image requires (wire: state FAILED, reason
    /// REASON_DRIVER_REQUIREMENT_UNMET); these are all the image's
    /// requirements, as text (the master parses them when it applies the
    /// update, so that an agent's bad text never makes the log unreadable).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requires: Vec<String>,
    /// For a task holding a fraction of a shared GPU: what its agent
    /// enforces of it (sent with STARTING).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforcement: Option<Enforcement>,
    /// The agent stopped the task for using more GPU memory than its
    /// fraction (wire: state FAILED, reason REASON_GPU_MEMORY_LIMIT).
    #[serde(default)]
    pub gpu_memory_limit: bool,
    /// The agent stopped the task as hung (wire: state FAILED, reason
    /// REASON_HUNG).
    #[serde(default)]
    pub hung: bool,
    /// With `gpu_unhealthy`: the GPUs that failed (whole GPUs), which the
    /// job avoids when placed again; empty: all of the task's are suspect.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed_gpus: Vec<String>,
    /// Its container runtime stopped it as the runtime restarted (wire:
    /// state FAILED, reason REASON_RUNTIME_RESTARTED): not its own failure.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub runtime_restarted: bool,
    /// The agent stopped the task because its liveness check failed (wire:
    /// state FAILED, reason REASON_LIVENESS_FAILED).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub liveness_failed: bool,
    /// With state RUNNING: what the task's health checks say now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<TaskHealth>,
}

/// What an agent enforces of a fraction of a shared GPU, stated per task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Enforcement {
    /// The driver's per-cgroup memory cap: the task's processes together.
    Driver,
    /// MPS limits, per process of the task.
    Mps,
    /// Nothing: the scheduler counts, nothing limits (time-slicing).
    None,
}

impl fmt::Display for Enforcement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Enforcement::Driver => "driver",
            Enforcement::Mps => "mps",
            Enforcement::None => "none",
        })
    }
}

impl std::str::FromStr for Enforcement {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "driver" => Ok(Enforcement::Driver),
            "mps" => Ok(Enforcement::Mps),
            "none" => Ok(Enforcement::None),
            _ => Err(format!(
                "{s:?} is not an enforcement level (driver, mps, none)"
            )),
        }
    }
}

/// Whether one of an agent's container runtimes works now, as its last
/// heartbeat said.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeStatus {
    pub runtime: Runtime,
    pub available: bool,
    /// Why it is not available (or a note); may be empty.
    pub message: String,
}

/// One reading of a GPU's gauges, by the agent's health probe.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuSample {
    /// GPU (SM) busy time over NVML's last sample period, 0 to 100.
    pub utilization_pct: u32,
    pub memory_used_mib: u64,
    pub memory_total_mib: u64,
    pub temperature_c: Option<u32>,
    pub power_w: Option<f64>,
    /// Agent clock, ms since the Unix epoch.
    pub sampled_at_ms: u64,
    /// Critical XID events seen since the agent started.
    pub xid_errors: u64,
    /// GPU memory used by each task's processes (NVML's per-process
    /// accounting), MiB by task id; only tasks with a process on the GPU.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub task_memory_used_mib: BTreeMap<TaskId, u64>,
    /// Each task's processes' share of the GPU's SMs over the last sample
    /// period (NVML's per-process utilization), percent by task id; only
    /// tasks NVML sampled (what a fraction of a shared GPU used).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub task_utilization_pct: BTreeMap<TaskId, u32>,
    /// Whether the per-process readings were read: a task on the GPU
    /// absent from `task_utilization_pct` then used none of it.
    #[serde(default)]
    pub task_utilization_read: bool,
}

/// A GPU's health as its agent sees it now, with its latest reading.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuReport {
    pub uuid: GpuUuid,
    pub healthy: bool,
    pub unhealthy_reason: String,
    pub sample: Option<GpuSample>,
}

/// Why a task is in its state (the API's `Reason`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaskReason {
    #[default]
    Unspecified,
    CommandExited,
    TaskInvalid,
    ResourcesUnavailable,
    AgentLost,
    FrameworkRemoved,
    KilledByFramework,
    ContainerLaunchFailed,
    /// Stopped for a job of higher priority.
    Preempted,
    /// One of its GPUs failed a health check.
    GpuUnhealthy,
    /// Killed by its own agent, which heard from no leader for its fence
    /// timeout. For its job it counts like LOST (the retry policy).
    Fenced,
    /// Killed because its agent is drained (`--kill` or the deadline).
    AgentDrained,
    /// Refused before it started: its image requires of the NVIDIA driver
    /// what its agent's does not offer. Its job goes back to the queue
    /// without using a retry, placed from then on only where the driver
    /// qualifies.
    DriverRequirementUnmet,
    /// Stopped by its agent: its processes together used more GPU memory
    /// than its fraction of a shared GPU.
    GpuMemoryLimit,
    /// Stopped to give GPUs back to a tenant below its fair share: its own
    /// tenant held more than its share.
    Reclaimed,
    /// Stopped by its agent: no output and no GPU activity for its job's
    /// hang timeout.
    Hung,
    /// Stopped by its container runtime as the runtime restarted (dockerd
    /// without live-restore): its job goes back to the queue without using
    /// a retry.
    RuntimeRestarted,
    /// Stopped by its agent: its liveness check failed too many times in
    /// a row.
    LivenessFailed,
}
