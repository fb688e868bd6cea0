//! The records the state machine keeps of agents, jobs, tasks and
//! frameworks: serialized in snapshots as they are.

use super::*;

/// An agent's liveness, as the leader's clocks decided it (through
/// commands: `AgentUnreachable`, `AgentLostAfterTimeout`).
///
/// ```text
/// ACTIVE --(no heartbeat for --agent-timeout-secs)--> UNREACHABLE
/// UNREACHABLE --(no heartbeat for --agent-lost-timeout-secs)--> LOST
/// UNREACHABLE or LOST --(registers again)--> ACTIVE
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AgentState {
    Active,
    Lost,
    /// Silent for the agent timeout: its tasks are UNREACHABLE and keep
    /// their GPUs; nothing new goes to it.
    Unreachable,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentRecord {
    pub info: AgentInfo,
    pub state: AgentState,
    pub registered_at_ms: u64,
    /// Sum of the resources its tasks hold: live tasks, and ended tasks
    /// whose end the agent has not confirmed yet ([`TaskRecord::holding`]).
    pub allocated: Resources,
    /// When it became UNREACHABLE (kept while LOST); `None` while ACTIVE.
    #[serde(default)]
    pub unreachable_since_ms: Option<u64>,
    /// Set by `gpuctl agents drain`: it takes no new tasks. Survives the
    /// agent registering again and leader changes (it is replicated).
    #[serde(default)]
    pub drain: Option<Drain>,
}

/// An agent being drained.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drain {
    /// When the drain was asked for.
    pub since_ms: u64,
    /// When its remaining tasks are killed (the proposer's clock plus
    /// `--deadline`); `None`: they run until they end.
    pub deadline_ms: Option<u64>,
}

impl AgentRecord {
    pub fn free(&self) -> Resources {
        self.info.total.saturating_sub(&self.allocated)
    }

    /// An offer of it with its host ports: the allocator does not divide
    /// ports between offers, so each carries all the agent has free, and a
    /// launch's apply arbitrates (the loser is refused).
    pub fn with_free_ports(&self, offered: Resources) -> Resources {
        Resources {
            ports: self.free().ports,
            ..offered
        }
    }

    /// Whether new tasks may be placed, launched or offered on it: ACTIVE
    /// and not draining.
    pub fn accepts_tasks(&self) -> bool {
        self.state == AgentState::Active && self.drain.is_none()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    pub id: JobId,
    pub spec: JobSpec,
    pub state: JobState,
    pub submitted_at_ms: u64,
    pub updated_at_ms: u64,
    /// Every task ever started for this job, oldest first.
    pub task_ids: Vec<TaskId>,
    pub cancel_requested: bool,
    /// How it ended; for a job back in the queue, why its last attempt ended.
    pub message: String,
    /// Failed attempts started again so far (at most `spec.max_retries`).
    #[serde(default)]
    pub retries: u32,
    /// Times its tasks were preempted.
    #[serde(default)]
    pub preemptions: u32,
    /// Its current attempt is being stopped: what happens once its last
    /// task has ended.
    #[serde(default)]
    pub stopping: Option<Stopping>,
    /// The job that preempted it, while it waits to run again.
    #[serde(default)]
    pub preempted_by: Option<JobId>,
    /// What its image requires of the NVIDIA driver (its NVIDIA_REQUIRE_*
    /// values, all to hold), learned from agents that refused to start it;
    /// placement applies them with `spec.require_cuda`. At most
    /// `cuda_req::MAX_EXPRS`, each once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_requires: Vec<gpuctl_core::cuda_req::Expr>,
    /// What happened to it, bounded (`events.rs`); recorded by apply.
    #[serde(default)]
    pub events: events::Events,
    /// The ranks of its latest attempt: an elastic gang's may be fewer
    /// than `spec.replicas`. 0: `spec.replicas` (records from before
    /// elastic gangs).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub world: u32,
    /// A job queued again after a failure is not placed before this (the
    /// leader's wall clock, ms): its restart backoff. 0: at once.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub not_before_ms: u64,
    /// GPUs that failed under it: it is not placed on them again until
    /// they are back in service or the entry's time passes (see
    /// [`JobRecord::avoid_gpu`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub avoid_gpus: Vec<AvoidGpu>,
    /// Since when its GPUs have been idle (under the idle threshold for
    /// the idle window, see `State::flag_idle_jobs`); None: not idle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_since_ms: Option<u64>,
    /// Tasks of its earliest attempts dropped from `task_ids` (a service's
    /// replica, restarted without end, keeps its latest only): the next
    /// task's number is `task_ids.len()` plus this.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub forgotten_tasks: u64,
}

/// A GPU a job is not placed on until `until_ms` (the leader's clock).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AvoidGpu {
    pub uuid: GpuUuid,
    pub until_ms: u64,
}

/// How long a job avoids a GPU that failed under it at most: it is
/// forgotten sooner when the GPU is seen back in service (reset and
/// probed), and this bounds the case where the master never saw it out
/// (out and back between two heartbeats).
pub const AVOID_GPU_MS: u64 = 10 * 60 * 1000;
/// The most GPUs one job avoids (the oldest go first).
pub const MAX_AVOIDED_GPUS: usize = 16;

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Why a job's current attempt is being stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Stopping {
    /// One of its tasks failed: queued again when `retry`, else FAILED.
    Failed { message: String, retry: bool },
    /// Preempted by a job of higher priority, or reclaimed for a tenant
    /// below its fair share (`reclaimed_for`: that tenant): queued again
    /// when `requeue` (not `--no-requeue`), without using a retry, else
    /// FAILED.
    Preempted {
        by: JobId,
        requeue: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reclaimed_for: Option<String>,
    },
    /// A GPU of one of its tasks failed: not the job's fault, so it is
    /// queued again without using up a retry, unless `--no-requeue`.
    GpuFailed { message: String, requeue: bool },
    /// One of its tasks' agents is drained (`--kill`, or the drain's
    /// deadline passed): like a preemption, queued again without using up
    /// a retry, unless `--no-requeue`.
    Drained { agent_id: AgentId, requeue: bool },
    /// An agent refused to start one of its tasks because its driver does
    /// not meet what the image requires, which the job has learned: queued
    /// again without using up a retry (nothing of it ran, so even with
    /// `--no-requeue`), to be placed only where the driver qualifies.
    DriverRefused { message: String },
    /// An elastic gang is restarted with more ranks (GPUs freed for it):
    /// queued again without using up a retry, to be placed with as many
    /// ranks as fit, up to `to`.
    Growing { from: u32, to: u32 },
    /// Its GPUs stayed idle past its tenant's `stop_idle_after`: it ends
    /// CANCELLED with `message`, however its tasks exit.
    IdleStopped { message: String },
    /// A task's container runtime stopped it as the runtime restarted: not
    /// the job's fault, so it is queued again without using up a retry,
    /// unless `--no-requeue`.
    RuntimeRestarted { message: String, requeue: bool },
}

impl JobRecord {
    /// The job avoids `uuid` from `at_ms` on, for [`AVOID_GPU_MS`].
    pub fn avoid_gpu(&mut self, uuid: &str, at_ms: u64) {
        self.avoid_gpus.retain(|a| a.uuid != uuid);
        if self.avoid_gpus.len() >= MAX_AVOIDED_GPUS {
            self.avoid_gpus.remove(0);
        }
        self.avoid_gpus.push(AvoidGpu {
            uuid: uuid.to_string(),
            until_ms: at_ms.saturating_add(AVOID_GPU_MS),
        });
    }

    /// Everything its tasks require of the NVIDIA driver: its own
    /// `require_cuda`, then what its image taught.
    pub fn driver_requires(&self) -> impl Iterator<Item = &gpuctl_core::cuda_req::Expr> {
        self.spec.require_cuda.iter().chain(&self.image_requires)
    }

    /// The ranks of its latest attempt (the gang's size, or what an
    /// elastic gang started with).
    pub fn world(&self) -> u32 {
        if self.world > 0 {
            self.world
        } else {
            self.spec.replicas()
        }
    }

    /// The tasks of its latest attempt, in rank order (a launch starts
    /// [`JobRecord::world`] tasks). Empty before the first launch.
    pub fn current_tasks(&self) -> &[TaskId] {
        let n = self.world() as usize;
        if self.task_ids.len() < n {
            return &[];
        }
        &self.task_ids[self.task_ids.len() - n..]
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskRecord {
    pub id: TaskId,
    pub job_id: JobId,
    pub agent_id: AgentId,
    pub gpu_uuids: Vec<GpuUuid>,
    pub resources: Resources,
    pub state: TaskState,
    pub exit_code: Option<i32>,
    pub message: String,
    /// The agent should stop it (the job was cancelled).
    pub kill_requested: bool,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    /// The framework that launched it; empty for gpuctl jobs.
    #[serde(default)]
    pub framework_id: FrameworkId,
    /// The id its framework knows it by (the state's id is
    /// `<framework-id>.<this>`).
    #[serde(default)]
    pub framework_task_id: String,
    /// What a framework's task runs (a job's task runs its job's spec).
    #[serde(default)]
    pub launch: Option<TaskLaunch>,
    /// Why it is in its state (Mesos' reasons).
    #[serde(default)]
    pub reason: TaskReason,
    /// The last status update recorded, and the last one its framework
    /// acknowledged (agents resend until they match).
    #[serde(default)]
    pub last_update_uuid: Vec<u8>,
    #[serde(default)]
    pub acked_uuid: Vec<u8>,
    /// Its rank in its job's gang (0 for a single task).
    #[serde(default)]
    pub rank: u32,
    /// While UNREACHABLE: the state it had before (STAGING, STARTING or
    /// RUNNING), to go back to when its agent returns listing it. Agent
    /// updates received meanwhile move it forward.
    #[serde(default)]
    pub before_unreachable: Option<TaskState>,
    /// Ended (LOST by timeout) without its agent's word that its processes
    /// are gone: its GPUs stay in `gpu_owner` and its resources in its
    /// agent's `allocated`, so nothing else gets them, until its agent
    /// confirms (registers again without it, or sends a final status
    /// update for it). Always false for a live task.
    #[serde(default)]
    pub holding: bool,
    /// Not yet ended as its framework sees it, but its agent reported a
    /// final state behind an unacknowledged update (`latest_state`): its
    /// processes are gone, so its GPUs and resources are free already.
    #[serde(default)]
    pub released: bool,
    /// Host ports it holds, from its agent's range (`GPUCTL_PORTS`), as
    /// many as `resources.ports`; freed with its resources.
    #[serde(default)]
    pub ports: Vec<u16>,
    /// The fraction it holds of its one GPU (`gpu_uuids`), a shared GPU;
    /// `None` for a task of whole GPUs or MIG devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fraction: Option<gpuctl_core::types::GpuFraction>,
    /// What its agent enforces of its fraction, as the agent said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforcement: Option<gpuctl_core::types::Enforcement>,
    /// A fraction's own readings (its processes', per period): ms of its
    /// share with a reading, and of them busy, as the ledger charged them.
    /// What a report by job shows for it: a shared GPU's history is the
    /// whole GPU's, not the task's.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub gpu_sampled_ms: u64,
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub gpu_busy_ms: u64,
    /// A fraction's current run of readings under the idle threshold
    /// (a job's fraction, while idle detection is on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quiet: Option<util::QuietRun>,
    /// When its agent first said it runs (RUNNING); `None` until then. What
    /// it held before is its startup (image pull, preflight), charged and
    /// shown apart (`usage`'s `gpu_startup_ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_at_ms: Option<u64>,
    /// What its health checks say, as its agent last reported (`None`:
    /// nothing reported; see [`TaskRecord::ready`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<gpuctl_core::types::TaskHealth>,
}

impl TaskRecord {
    /// Running, and its readiness check passes (`has_readiness`: its job
    /// has one; without, a running task is ready).
    pub fn ready(&self, has_readiness: bool) -> bool {
        self.state == TaskState::Running
            && (!has_readiness || self.health.as_ref().is_some_and(|h| h.ready))
    }

    /// What it holds: its GPUs or MIG devices, or a fraction of one.
    pub fn holding(&self) -> gpuctl_core::types::Holding<'_, gpuctl_core::types::GpuFraction> {
        gpuctl_core::types::Holding::of(&self.gpu_uuids, self.fraction.as_ref())
    }
}

impl TaskRecord {
    /// Whether it holds its GPUs and resources: it is live (and its agent
    /// has not reported its end ahead of its updates), or it ended without
    /// its agent's confirmation.
    pub fn holds_resources(&self) -> bool {
        (!self.state.is_terminal() && !self.released) || self.holding
    }
}

/// What a framework's task runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskLaunch {
    pub image: Option<String>,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
}

/// A framework as the replicated state knows it. Whether it is connected is
/// the leader's business (in memory), like agent liveness.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrameworkRecord {
    pub info: FrameworkInfo,
    pub registered_at_ms: u64,
    /// Torn down (by itself, or its failover timeout passed): it cannot
    /// subscribe again and its tasks are killed.
    pub removed: bool,
}

/// How long a submit's idempotency key is remembered.
pub const SUBMIT_REQUEST_TTL_MS: u64 = requests::REQUEST_TTL_MS;
