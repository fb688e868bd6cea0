//! The replicated state machine. PURE: no I/O, no clock, no randomness.
//! `State::apply` is called with each committed log entry, in order, on every
//! master; given the same entries it yields the same state.

pub mod access;
mod agents;
mod apply;
pub mod capacity;
pub mod command;
pub(crate) mod derived;
pub mod events;
#[cfg(test)]
mod events_tests;
mod fit;
pub mod frameworks;
mod jobs;
pub mod mig;
#[cfg(test)]
mod mig_tests;
mod preempt;
pub mod requests;
mod retention;
pub mod share;
#[cfg(test)]
mod share_tests;
pub mod tables;
mod tasks;
#[cfg(test)]
pub(crate) mod testkit;
#[cfg(test)]
mod touched_tests;
pub mod usage;
pub mod util;

use std::collections::BTreeMap;

use gpuctl_core::types::{
    AgentId, AgentInfo, FrameworkId, FrameworkInfo, GpuUuid, JobId, JobSpec, JobState, Resources,
    StopNotice, TaskId, TaskSpec, TaskState, TaskTemplate,
};
use serde::{Deserialize, Serialize};

pub use apply::{ApplyError, MemberChange, Outcome};
pub use command::{Command, EncodeError, GpuHealthChange, Launch, COMMAND_VERSION};
pub use gpuctl_core::types::{FrameworkTask, TaskReason};
pub use tables::Touched;
use tables::{AgentTable, JobTable, TaskTable};

/// A job waiting for placement.
fn waits(j: &&JobRecord) -> bool {
    j.state == JobState::Queued && !j.cancel_requested
}

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

/// The replicated state. Its fields are private so that it changes only by
/// applying committed log entries ([`State::apply`], and for the entries
/// that carry no command [`State::apply_noop`] and
/// [`State::apply_member_change`]), alike on every master; others read it
/// through the accessors. A Raft snapshot is its serde form (so the field
/// names are the snapshot format) and replaces it whole.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct State {
    agents: AgentTable,
    jobs: JobTable,
    tasks: TaskTable,
    /// Which task holds each GPU. The single source of truth for "no GPU is
    /// ever given to two tasks": a launch is refused unless all its GPUs are
    /// absent here.
    gpu_owner: imbl::OrdMap<GpuUuid, TaskId>,
    /// Sequence for job ids (`job-<n>`), advanced by apply.
    next_job_seq: u64,
    #[serde(default)]
    frameworks: BTreeMap<FrameworkId, FrameworkRecord>,
    /// Sequence for framework ids (`fw-<n>`).
    #[serde(default)]
    next_framework_seq: u64,
    /// Idempotency keys of recent submits (`requests::request_key`: the
    /// caller's scope and its request id) to (job id, submit time). A
    /// repeated submit with a known key returns that job.
    #[serde(default)]
    submit_requests: BTreeMap<String, (JobId, u64)>,
    /// The same keys by submit time, to forget them after
    /// [`SUBMIT_REQUEST_TTL_MS`].
    #[serde(default)]
    submit_request_order: std::collections::BTreeSet<(u64, String)>,
    /// Idempotency keys of recent token creates, likewise.
    #[serde(default)]
    token_requests: requests::Remembered<requests::CreatedToken>,
    /// Idempotency keys of recent subscriptions of new frameworks, to the
    /// framework each made.
    #[serde(default)]
    framework_requests: requests::Remembered<FrameworkId>,
    /// API address of each master of the Raft group, by node id, so that
    /// every master (a joining one too) can reach every other.
    #[serde(default)]
    masters: BTreeMap<u64, String>,
    /// GPUs an operator took out of service (`gpuctl gpus cordon`): no new
    /// task gets them; tasks already on them keep running.
    #[serde(default)]
    cordoned: std::collections::BTreeSet<GpuUuid>,
    /// Access tokens by id (hashes only).
    #[serde(default)]
    tokens: BTreeMap<String, access::TokenRecord>,
    /// Tenants' GPU quotas: what each is guaranteed.
    #[serde(default)]
    quotas: BTreeMap<String, u32>,
    /// Tenants' borrowing limits and weights (`gpuctl quota set --borrow
    /// --weight`); a tenant not here has weight 1 and, without a quota, no
    /// limit.
    #[serde(default)]
    tenant_terms: BTreeMap<String, access::TenantTerms>,
    /// MIG layout changes asked and not yet applied, by GPU: nothing is
    /// placed on such a GPU or its MIG devices meanwhile.
    #[serde(default)]
    mig_changes: BTreeMap<GpuUuid, mig::MigChange>,
    /// Why the last layout change of a GPU failed (cleared by a success).
    #[serde(default)]
    mig_errors: BTreeMap<GpuUuid, String>,
    /// GPUs an admin marked shareable (`gpuctl gpus share`): given only
    /// as fractions, never whole nor split into MIG devices.
    #[serde(default)]
    shared: BTreeMap<GpuUuid, gpuctl_core::types::ShareMode>,
    /// GPUs an admin stopped sharing (`gpuctl gpus share --off`): their
    /// agent's default (`--share-gpus`) does not share them again.
    #[serde(default)]
    share_off: std::collections::BTreeSet<GpuUuid>,
    /// What ended tasks held, by hour, tenant, token and GPU model
    /// (`gpuctl usage`).
    #[serde(default)]
    usage: usage::Ledger,
    /// Each GPU's utilization over time (`RecordUtilization`).
    #[serde(default)]
    util: util::History,
    /// Index of the last log entry applied.
    applied_index: u64,
    /// Indexes derived from the above (see `derived`).
    #[serde(skip)]
    derived: derived::Derived,
}

impl State {
    pub fn new() -> State {
        State {
            next_job_seq: 1,
            next_framework_seq: 1,
            ..Default::default()
        }
    }

    // Read access for code outside `state/`.

    pub fn agents(&self) -> &imbl::OrdMap<AgentId, AgentRecord> {
        &self.agents
    }

    pub fn agent(&self, id: &str) -> Option<&AgentRecord> {
        self.agents.get(id)
    }

    pub fn jobs(&self) -> &imbl::OrdMap<JobId, JobRecord> {
        &self.jobs
    }

    pub fn job(&self, id: &str) -> Option<&JobRecord> {
        self.jobs.get(id)
    }

    pub fn tasks(&self) -> &imbl::OrdMap<TaskId, TaskRecord> {
        &self.tasks
    }

    /// The tasks of frameworks (not of gpuctl's jobs), from an index: what
    /// the framework loop walks each pass, whatever the number of jobs.
    pub fn framework_tasks(&self) -> impl Iterator<Item = &TaskRecord> + '_ {
        self.tasks.of_frameworks()
    }

    pub fn task(&self, id: &str) -> Option<&TaskRecord> {
        self.tasks.get(id)
    }

    /// The accounting ledger of ended tasks.
    pub fn usage(&self) -> &usage::Ledger {
        &self.usage
    }

    /// Each GPU's utilization history.
    pub fn util_history(&self) -> &util::History {
        &self.util
    }

    /// The task holding this GPU, if any.
    pub fn gpu_owner(&self, uuid: &str) -> Option<&TaskId> {
        self.gpu_owner.get(uuid)
    }

    /// Every GPU held, and by which task.
    #[cfg(test)]
    pub fn gpu_owners(&self) -> &imbl::OrdMap<GpuUuid, TaskId> {
        &self.gpu_owner
    }

    pub fn frameworks(&self) -> &BTreeMap<FrameworkId, FrameworkRecord> {
        &self.frameworks
    }

    pub fn framework(&self, id: &str) -> Option<&FrameworkRecord> {
        self.frameworks.get(id)
    }

    /// The job a submit with this idempotency key (`requests::request_key`)
    /// created, while the key is remembered.
    pub fn submitted_job(&self, key: &str) -> Option<&JobId> {
        self.submit_requests.get(key).map(|(job_id, _)| job_id)
    }

    /// What a submit of `spec` sent again with this key gets: the job its
    /// first send made, while the key is remembered (as of `now_ms` when
    /// given); refused when that job is still kept and its spec differs
    /// (the key was reused for another job: giving it the first job's id
    /// would silently drop the new one).
    pub fn resubmitted(
        &self,
        key: &str,
        spec: &JobSpec,
        now_ms: Option<u64>,
    ) -> Result<Option<&JobId>, ApplyError> {
        let Some((job_id, at_ms)) = self.submit_requests.get(key) else {
            return Ok(None);
        };
        if now_ms.is_some_and(|now| !requests::live(*at_ms, now)) {
            return Ok(None);
        }
        match self.jobs.get(job_id) {
            Some(j) if j.spec != *spec => Err(ApplyError::RequestIdReused {
                job_id: job_id.clone(),
            }),
            _ => Ok(Some(job_id)),
        }
    }

    /// The token a create with this key (`requests::TokenRequest::key`)
    /// made, while the key is remembered.
    pub fn created_token(&self, key: &str) -> Option<&requests::CreatedToken> {
        self.token_requests.get(key)
    }

    /// API address of each master of the Raft group, by node id.
    pub fn masters(&self) -> &BTreeMap<u64, String> {
        &self.masters
    }

    pub fn cordoned(&self) -> &std::collections::BTreeSet<GpuUuid> {
        &self.cordoned
    }

    pub fn is_cordoned(&self, uuid: &str) -> bool {
        self.cordoned.contains(uuid)
    }

    /// Index of the last log entry applied.
    pub fn applied_index(&self) -> u64 {
        self.applied_index
    }

    /// Jobs ever submitted (the next job's sequence number minus one).
    pub fn jobs_submitted(&self) -> u64 {
        self.next_job_seq.saturating_sub(1)
    }

    /// Whether some job waits for placement (cheaper than
    /// [`queued_jobs`](Self::queued_jobs): no list, no sort).
    pub fn has_queued(&self) -> bool {
        !self.queue_index().is_empty()
    }

    /// How many jobs wait for placement.
    pub fn count_queued(&self) -> usize {
        self.queue_index().len()
    }

    /// What agents that take tasks have free, summed: it grows only when
    /// something ends, an agent comes or a GPU comes back.
    pub fn free_total(&self) -> Resources {
        self.capacity().totals().resources()
    }

    /// Jobs waiting for placement in the order they are placed: highest
    /// priority first, then oldest.
    pub fn queued_jobs(&self) -> Vec<&JobRecord> {
        match self.queue_index() {
            std::borrow::Cow::Borrowed(q) => q.ids().filter_map(|id| self.jobs.get(id)).collect(),
            std::borrow::Cow::Owned(q) => q.ids().filter_map(|id| self.jobs.get(id)).collect(),
        }
    }

    /// Agents whose [`State::desired_tasks`] may have changed since the
    /// last call (the leader wakes their task streams).
    pub fn take_touched(&mut self) -> Touched {
        self.tasks.take_touched()
    }

    /// The tasks an agent should be running now (placed on it, not ended,
    /// not asked to stop) and those it must stop: asked to stop, or LOST
    /// while still holding their GPUs (the agent came back still running
    /// them; its final report releases the GPUs). The agent also kills
    /// whatever it runs that is in neither list.
    pub fn desired_tasks(&self, agent_id: &str) -> (Vec<TaskSpec>, Vec<TaskId>) {
        let (run, kill) = self.desired_task_ids(agent_id);
        let run = run.iter().filter_map(|id| self.task_spec(id)).collect();
        (run, kill.into_iter().map(|(id, _)| id).collect())
    }

    /// [`State::desired_tasks`] by id only: what the agent should run, in
    /// id order (those whose spec [`State::task_spec`] can make), and what
    /// it must stop, each with why (the task's notice).
    pub fn desired_task_ids(&self, agent_id: &str) -> (Vec<TaskId>, Vec<(TaskId, StopNotice)>) {
        let mut run = Vec::new();
        let mut kill = Vec::new();
        for t in self.tasks.on(agent_id).filter(|t| t.holds_resources()) {
            if t.kill_requested || t.state.is_terminal() {
                kill.push((t.id.clone(), self.stop_notice(t)));
            } else if t.launch.is_some() || self.jobs.contains_key(&t.job_id) {
                run.push(t.id.clone());
            }
        }
        (run, kill)
    }

    /// Why a task is being stopped, as its agent tells it: from what the
    /// stop recorded in the task (its reason and message), so that every
    /// reason, present and future, reaches the task without more work.
    pub fn stop_notice(&self, t: &TaskRecord) -> StopNotice {
        let cancelled = self.jobs.get(&t.job_id).is_some_and(|j| j.cancel_requested);
        StopNotice {
            kind: gpuctl_core::convert::stop_kind(t.reason, cancelled),
            message: t.message.clone(),
        }
    }

    /// What an agent needs to start a task: its command, environment,
    /// resources and GPUs. `None` for a task unknown, or a job task whose
    /// job is gone.
    pub fn task_spec(&self, task_id: &str) -> Option<TaskSpec> {
        let t = self.tasks.get(task_id)?;
        let job = self.jobs.get(&t.job_id);
        // A job's task is its template with the task's own env; a
        // framework's task has the defaults but for what it launched.
        let template = match (&t.launch, job) {
            (Some(l), _) => {
                let mut env = l.env.clone();
                insert_ports(&mut env, &t.ports);
                TaskTemplate {
                    image: l.image.clone(),
                    env,
                    ..TaskTemplate::new(l.command.clone(), t.resources)
                }
            }
            (None, Some(job)) => TaskTemplate {
                env: self.job_task_env(job, t),
                resources: t.resources,
                ..job.spec.template.clone()
            },
            (None, None) => return None,
        };
        let tenant = match (&t.launch, job) {
            (None, Some(job)) => job.spec.tenant.name(),
            _ => self
                .frameworks
                .get(&t.framework_id)
                .map_or(access::DEFAULT_TENANT, |f| f.info.tenant.name()),
        };
        Some(TaskSpec {
            // A fraction's GPU stays shared while the fraction is held.
            share: t.fraction.map(|fraction| gpuctl_core::types::TaskShare {
                tenant: tenant.into(),
                fraction,
                mode: t
                    .gpu_uuids
                    .first()
                    .and_then(|g| self.share_mode(g))
                    .unwrap_or(gpuctl_core::types::ShareMode::TimeSlice),
            }),
            task_id: t.id.clone(),
            job_id: t.job_id.clone(),
            framework_id: t.framework_id.clone(),
            template,
            gpu_uuids: t.gpu_uuids.clone(),
        })
    }

    /// Whether the task opted out of fencing (its job's `no_fence`;
    /// frameworks' tasks are always fenced).
    pub fn no_fence(&self, t: &TaskRecord) -> bool {
        !t.job_id.is_empty()
            && self
                .jobs
                .get(&t.job_id)
                .is_some_and(|j| j.spec.template.no_fence)
    }

    /// A job task's environment: the job's, and where it stands in its
    /// gang: `GPUCTL_RANK`, `GPUCTL_WORLD_SIZE` and `GPUCTL_PEERS` (the
    /// hostnames of its attempt's ranks in rank order, comma-separated),
    /// `GPUCTL_PORTS` (its host ports), and the same in PyTorch's
    /// convention ([`torch_env`]) unless the job sets those names itself,
    /// and `OMP_NUM_THREADS` from its `--cpus` unless the job sets it.
    /// The agent adds `GPUCTL_JOB_ID` and `GPUCTL_TASK_ID`.
    fn job_task_env(&self, job: &JobRecord, task: &TaskRecord) -> BTreeMap<String, String> {
        let mut env = job.spec.template.env.clone();
        let gang: Vec<&TaskRecord> = job
            .current_tasks()
            .iter()
            .filter_map(|id| self.tasks.get(id))
            .collect();
        let peers: Vec<&str> = gang
            .iter()
            .map(|t| {
                self.agents
                    .get(&t.agent_id)
                    .map_or(t.agent_id.as_str(), |a| a.info.hostname.as_str())
            })
            .collect();
        env.insert("GPUCTL_RANK".into(), task.rank.to_string());
        env.insert("GPUCTL_WORLD_SIZE".into(), job.world().to_string());
        if job.spec.is_elastic() {
            env.insert(
                "GPUCTL_MIN_REPLICAS".into(),
                job.spec.min_replicas().to_string(),
            );
            env.insert(
                "GPUCTL_MAX_REPLICAS".into(),
                job.spec.replicas().to_string(),
            );
        }
        env.insert("GPUCTL_PEERS".into(), peers.join(","));
        insert_ports(&mut env, &task.ports);
        // OpenMP (and PyTorch's CPU ops) otherwise start a thread per core
        // of the host: four ranks on two cores would run 4x oversubscribed.
        env.entry("OMP_NUM_THREADS".into())
            .or_insert_with(|| omp_threads(job.spec.template.resources.cpus).to_string());
        for (k, v) in self.torch_env(job, task, &gang) {
            env.entry(k.into()).or_insert(v);
        }
        env
    }

    /// `torchrun`'s variables for one process per task, so that
    /// `init_process_group(init_method="env://")` needs no wrapper:
    /// `RANK`, `WORLD_SIZE`; `LOCAL_RANK` and `LOCAL_WORLD_SIZE` among the
    /// gang's tasks on the same agent (rank order); `NODE_RANK`, the
    /// agent's place among the gang's agents in order of their lowest rank;
    /// `MASTER_ADDR` and `MASTER_PORT`, rank 0's agent address and first
    /// host port (absent when rank 0 has no port). And `torchrun`'s own
    /// defaults (`PET_*`) for one torchrun per task, each a "node" of the
    /// attempt: `PET_NNODES` (the attempt's ranks: an elastic gang is
    /// restarted by gpuctl when it grows, so each attempt's size is fixed),
    /// `PET_NODE_RANK` (the task's rank), `PET_MASTER_ADDR` and
    /// `PET_MASTER_PORT`: `torchrun train.py` needs no arguments.
    fn torch_env(
        &self,
        job: &JobRecord,
        task: &TaskRecord,
        gang: &[&TaskRecord],
    ) -> Vec<(&'static str, String)> {
        let mut nodes: Vec<&str> = Vec::new();
        for t in gang {
            if !nodes.contains(&t.agent_id.as_str()) {
                nodes.push(&t.agent_id);
            }
        }
        let local: Vec<&&TaskRecord> = gang
            .iter()
            .filter(|t| t.agent_id == task.agent_id)
            .collect();
        let local_rank = local.iter().position(|t| t.id == task.id).unwrap_or(0);
        let node_rank = nodes.iter().position(|a| *a == task.agent_id).unwrap_or(0);
        let mut env = vec![
            ("RANK", task.rank.to_string()),
            ("WORLD_SIZE", job.world().to_string()),
            ("LOCAL_RANK", local_rank.to_string()),
            ("LOCAL_WORLD_SIZE", local.len().max(1).to_string()),
            ("NODE_RANK", node_rank.to_string()),
        ];
        if let Some(rank0) = gang.iter().find(|t| t.rank == 0) {
            if let (Some(port), Some(agent)) =
                (rank0.ports.first(), self.agents.get(&rank0.agent_id))
            {
                env.push(("MASTER_ADDR", agent_host(&agent.info).to_string()));
                env.push(("MASTER_PORT", port.to_string()));
                env.push(("PET_MASTER_ADDR", agent_host(&agent.info).to_string()));
                env.push(("PET_MASTER_PORT", port.to_string()));
                env.push(("PET_NNODES", job.world().to_string()));
                env.push(("PET_NODE_RANK", task.rank.to_string()));
            }
        }
        env
    }

    /// Whether the agent may forget the status update `uuid` of `task_id`:
    /// gpuctl's own jobs once it is recorded, a framework's task once the
    /// framework acknowledged it (or when nobody is left to: the task or its
    /// framework is gone).
    pub fn is_acknowledged(&self, task_id: &str, uuid: &[u8]) -> bool {
        let Some(t) = self.tasks.get(task_id) else {
            return true;
        };
        if t.framework_id.is_empty() {
            return true;
        }
        if self
            .frameworks
            .get(&t.framework_id)
            .is_none_or(|f| f.removed)
        {
            return true;
        }
        uuid.is_empty() || t.acked_uuid == uuid || t.last_update_uuid != uuid
    }

    /// Whether new tasks may get this GPU whole (healthy is the agent's word).
    pub fn schedulable(&self, gpu: &gpuctl_core::types::GpuInfo) -> bool {
        // A GPU in MIG mode is never given whole: CUDA sees only its MIG
        // devices, which are given one by one.
        gpu.healthy
            && !gpu.mig.enabled
            && !self.cordoned.contains(&gpu.uuid)
            && !self.mig_changes.contains_key(&gpu.uuid)
            && !self.shared.contains_key(&gpu.uuid)
    }

    /// Whether new tasks may get this device (held or not): a schedulable
    /// whole GPU, or a MIG device of a healthy, uncordoned GPU in MIG mode;
    /// neither while the GPU's MIG layout is being changed.
    pub fn device_schedulable(&self, device: gpuctl_core::types::Device<'_>) -> bool {
        let gpu = device.gpu();
        if self.mig_changes.contains_key(&gpu.uuid) {
            return false;
        }
        match device {
            gpuctl_core::types::Device::Gpu(g) => self.schedulable(g),
            gpuctl_core::types::Device::Mig { .. } => {
                gpu.healthy && gpu.mig.enabled && !self.cordoned.contains(&gpu.uuid)
            }
        }
    }

    /// Whether new tasks may get this device now: schedulable and not held.
    pub fn device_free(&self, device: gpuctl_core::types::Device<'_>) -> bool {
        self.device_schedulable(device) && !self.gpu_owner.contains_key(device.uuid())
    }

    /// Records an event of a job (none if the job is gone).
    pub(super) fn job_event(
        &mut self,
        job_id: &str,
        kind: events::EventKind,
        message: impl Into<String>,
        at_ms: u64,
    ) {
        if let Some(j) = self.jobs.get_mut(job_id) {
            j.events.record(kind, message, at_ms);
        }
    }

    /// The job's most recent task.
    pub fn latest_task(&self, job_id: &str) -> Option<&TaskRecord> {
        let job = self.jobs.get(job_id)?;
        job.task_ids.last().and_then(|t| self.tasks.get(t))
    }

    /// The job's attempts, oldest first, each its tasks in rank order. An
    /// attempt launches all its ranks at once from rank 0, so a rank 0
    /// starts the next one.
    pub fn attempts(&self, job_id: &str) -> Vec<Vec<&TaskRecord>> {
        let mut out: Vec<Vec<&TaskRecord>> = Vec::new();
        let Some(job) = self.jobs.get(job_id) else {
            return out;
        };
        for t in job.task_ids.iter().filter_map(|t| self.tasks.get(t)) {
            match out.last_mut() {
                Some(attempt) if t.rank != 0 => attempt.push(t),
                _ => out.push(vec![t]),
            }
        }
        for a in &mut out {
            a.sort_by_key(|t| t.rank);
        }
        out
    }
}

/// Numeric part of `job-<n>`, for ordering job ids numerically.
pub fn job_seq(id: &str) -> u64 {
    id.strip_prefix("job-")
        .and_then(|n| n.parse().ok())
        .unwrap_or(u64::MAX)
}

/// The threads an OpenMP runtime may start for a task of `cpus` CPUs: the
/// whole CPUs it was given, at least 1 (Slurm's `--cpus-per-task` rule).
pub fn omp_threads(cpus: f64) -> u32 {
    if cpus.is_finite() && cpus >= 1.0 {
        cpus.floor().min(f64::from(u32::MAX)) as u32
    } else {
        1
    }
}

/// `GPUCTL_PORTS`: the task's host ports, comma-separated (none: unset).
fn insert_ports(env: &mut BTreeMap<String, String>, ports: &[u16]) {
    if !ports.is_empty() {
        let list: Vec<String> = ports.iter().map(u16::to_string).collect();
        env.insert("GPUCTL_PORTS".into(), list.join(","));
    }
}

/// Where other hosts reach an agent: the host of its advertised address
/// (`HOST:PORT`, `[V6]:PORT`), or its hostname when that says nothing.
pub(crate) fn agent_host(info: &gpuctl_core::types::AgentInfo) -> &str {
    let a = info.address.as_str();
    let host = match a.strip_prefix('[') {
        Some(rest) => rest.split_once(']').map_or("", |(h, _)| h),
        None => a.rsplit_once(':').map_or(a, |(h, _)| h),
    };
    match host {
        "" | "0.0.0.0" | "::" => &info.hostname,
        h => h,
    }
}
