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
mod records;
pub mod requests;
mod retention;
mod services;
#[cfg(test)]
mod services_tests;
pub mod share;
#[cfg(test)]
mod share_tests;
pub mod tables;
mod tasks;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
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
pub use records::*;
pub use services::{ReplicaEndpoint, ServiceRecord, KEPT_REPLICA_TASKS, REPLICA_BACKOFF_RESET_MS};
pub use tables::Touched;
use tables::{AgentTable, JobTable, TaskTable};

/// A job waiting for placement.
fn waits(j: &&JobRecord) -> bool {
    j.state == JobState::Queued && !j.cancel_requested
}

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
    /// Live services by id (`svc-<n>`); a deleted one is removed at once.
    #[serde(default)]
    services: BTreeMap<String, ServiceRecord>,
    /// Sequence for service ids (0 in states from before services: 1).
    #[serde(default)]
    next_service_seq: u64,
    /// Replicas that left their service (scale down, delete), running out
    /// of the endpoints until their drain ends (ms), then stopped.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    draining: BTreeMap<JobId, u64>,
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
    #[cfg(any(test, feature = "testkit"))]
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
        // Named ports: `GPUCTL_PORT_HTTP`, in the order of the names.
        for (name, port) in job.spec.template.options.port.iter().zip(&task.ports) {
            let key = format!(
                "GPUCTL_PORT_{}",
                name.to_ascii_uppercase().replace('-', "_")
            );
            env.insert(key, port.to_string());
        }
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
