//! Commands: the only way the replicated state changes. Each is decided by
//! the proposer (time, ids of things it names) and carried in the log, so
//! that applying it gives the same result on every master.

use std::collections::BTreeMap;

use gpuctl_proto::types::{
    AgentId, AgentInfo, FrameworkId, FrameworkInfo, GpuUuid, JobId, JobSpec, Resources,
    StatusUpdate, TaskId,
};
use serde::{Deserialize, Serialize};

/// Version of the encoding below. Bump it and keep decoding the old one when
/// a command changes shape, because old entries stay in the log.
pub const COMMAND_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Command {
    /// API addresses of masters (a new leader records those it was given by
    /// `--peers` and that the state lacks). Entries replace older ones.
    RecordMasters {
        masters: BTreeMap<u64, String>,
    },
    /// An agent (re)registers. Tasks the master placed on it that it does
    /// not list in `running_task_ids` are lost.
    RegisterAgent {
        info: AgentInfo,
        running_task_ids: Vec<TaskId>,
        at_ms: u64,
    },
    /// The leader has not heard from the agent for too long.
    AgentLost {
        agent_id: AgentId,
        at_ms: u64,
    },
    SubmitJob {
        spec: JobSpec,
        at_ms: u64,
        /// The client's idempotency key (see `State::submit_requests`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request_id: Option<String>,
    },
    /// Place queued jobs: all launches in the command happen or none does.
    LaunchTasks {
        launches: Vec<Launch>,
        at_ms: u64,
    },
    UpdateTaskStatus {
        update: StatusUpdate,
        at_ms: u64,
    },
    CancelJob {
        job_id: JobId,
        at_ms: u64,
    },
    /// An agent's health checks changed their verdict on some of its GPUs:
    /// an unhealthy GPU is neither offered nor placed on until it is
    /// healthy again. (The agent itself stops tasks on a failed GPU.)
    SetGpuHealth {
        agent_id: AgentId,
        gpus: Vec<GpuHealthChange>,
        at_ms: u64,
    },
    /// An operator cordons (`cordon`) or uncordons a GPU.
    CordonGpu {
        uuid: GpuUuid,
        cordon: bool,
    },
    /// Stop the current attempts of `victims` (jobs of lower priority) so
    /// that the queued `job_id` can run: their tasks are killed (SIGTERM,
    /// then SIGKILL after the agent's grace) and they go back to the queue
    /// (or end FAILED with `--no-requeue`). All victims or none.
    PreemptJobs {
        job_id: JobId,
        victims: Vec<JobId>,
        at_ms: u64,
    },
    /// A framework subscribes: new (empty id: apply assigns `fw-<n>`) or
    /// re-attaching with its id.
    SubscribeFramework {
        info: FrameworkInfo,
        at_ms: u64,
    },
    UpdateFramework {
        info: FrameworkInfo,
        at_ms: u64,
    },
    /// Teardown, or its failover timeout passed: its tasks are killed.
    RemoveFramework {
        framework_id: FrameworkId,
        reason: String,
        at_ms: u64,
    },
    /// Tasks a framework launches on offered resources. With `group`, all
    /// start or none does. A task that does not fit is recorded in ERROR
    /// with the reason; nothing else changes.
    LaunchFrameworkTasks {
        framework_id: FrameworkId,
        tasks: Vec<FrameworkTask>,
        group: bool,
        at_ms: u64,
    },
    KillTask {
        framework_id: FrameworkId,
        framework_task_id: String,
        at_ms: u64,
    },
    /// The framework acknowledged a status update.
    AcknowledgeUpdate {
        framework_id: FrameworkId,
        framework_task_id: String,
        uuid: Vec<u8>,
    },
}

/// A task as a framework launches it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrameworkTask {
    /// The framework's own id for it.
    pub task_id: String,
    pub agent_id: AgentId,
    pub image: Option<String>,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub resources: Resources,
    pub gpu_uuids: Vec<GpuUuid>,
}

/// One task of a job placed on one agent with exact GPUs. A job of
/// `replicas` tasks (a gang) needs that many launches in one command, in
/// rank order.
/// A GPU's new health, as its agent's checks see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuHealthChange {
    pub uuid: GpuUuid,
    pub healthy: bool,
    /// Why it is unhealthy; empty when healthy.
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Launch {
    pub job_id: JobId,
    pub agent_id: AgentId,
    pub gpu_uuids: Vec<GpuUuid>,
}

/// What goes into a log entry's data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EncodedCommand {
    pub version: u32,
    pub command: Command,
}

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error(
        "command encoding version {0} is newer than this master understands ({COMMAND_VERSION})"
    )]
    UnknownVersion(u32),
    #[error("malformed command: {0}")]
    Malformed(#[from] serde_json::Error),
}

impl Command {
    pub fn encode(&self) -> Vec<u8> {
        let enc = EncodedCommand {
            version: COMMAND_VERSION,
            command: self.clone(),
        };
        // Serializing plain data with string keys cannot fail.
        serde_json::to_vec(&enc).unwrap_or_default()
    }

    pub fn decode(data: &[u8]) -> Result<Command, DecodeError> {
        let enc: EncodedCommand = serde_json::from_slice(data)?;
        if enc.version != COMMAND_VERSION {
            return Err(DecodeError::UnknownVersion(enc.version));
        }
        Ok(enc.command)
    }

    /// Short name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Command::RecordMasters { .. } => "record_masters",
            Command::RegisterAgent { .. } => "register_agent",
            Command::AgentLost { .. } => "agent_lost",
            Command::SubmitJob { .. } => "submit_job",
            Command::LaunchTasks { .. } => "launch_tasks",
            Command::UpdateTaskStatus { .. } => "update_task_status",
            Command::CancelJob { .. } => "cancel_job",
            Command::PreemptJobs { .. } => "preempt_jobs",
            Command::CordonGpu { .. } => "cordon_gpu",
            Command::SetGpuHealth { .. } => "set_gpu_health",
            Command::SubscribeFramework { .. } => "subscribe_framework",
            Command::UpdateFramework { .. } => "update_framework",
            Command::RemoveFramework { .. } => "remove_framework",
            Command::LaunchFrameworkTasks { .. } => "launch_framework_tasks",
            Command::KillTask { .. } => "kill_task",
            Command::AcknowledgeUpdate { .. } => "acknowledge_update",
        }
    }
}
