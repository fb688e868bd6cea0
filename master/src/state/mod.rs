//! The replicated state machine. PURE: no I/O, no clock, no randomness.
//! `State::apply` is called with each committed log entry, in order, on every
//! master; given the same entries it yields the same state.

mod apply;
pub mod command;

use std::collections::BTreeMap;

use gpuctl_proto::types::{
    AgentId, AgentInfo, GpuUuid, JobId, JobSpec, JobState, Resources, TaskId, TaskSpec, TaskState,
};
use serde::{Deserialize, Serialize};

pub use apply::{ApplyError, Outcome};
pub use command::{Command, Launch};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AgentState {
    Active,
    Lost,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentRecord {
    pub info: AgentInfo,
    pub state: AgentState,
    pub registered_at_ms: u64,
    /// Sum of the resources of this agent's non-terminal tasks.
    pub allocated: Resources,
}

impl AgentRecord {
    pub fn free(&self) -> Resources {
        self.info.total.saturating_sub(&self.allocated)
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
    pub message: String,
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
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub agents: BTreeMap<AgentId, AgentRecord>,
    pub jobs: BTreeMap<JobId, JobRecord>,
    pub tasks: BTreeMap<TaskId, TaskRecord>,
    /// Which task holds each GPU. The single source of truth for "no GPU is
    /// ever given to two tasks": a launch is refused unless all its GPUs are
    /// absent here.
    pub gpu_owner: BTreeMap<GpuUuid, TaskId>,
    /// Sequence for job ids (`job-<n>`), advanced by apply.
    pub next_job_seq: u64,
    /// Index of the last log entry applied.
    pub applied_index: u64,
}

impl State {
    pub fn new() -> State {
        State {
            next_job_seq: 1,
            ..Default::default()
        }
    }

    /// Jobs waiting for placement, oldest first.
    pub fn queued_jobs(&self) -> Vec<&JobRecord> {
        let mut q: Vec<&JobRecord> = self
            .jobs
            .values()
            .filter(|j| j.state == JobState::Queued && !j.cancel_requested)
            .collect();
        q.sort_by_key(|j| (j.submitted_at_ms, job_seq(&j.id)));
        q
    }

    /// The tasks an agent should be running now: placed on it, not ended,
    /// and not asked to stop. The agent kills whatever it runs that is not
    /// in this list.
    pub fn desired_tasks(&self, agent_id: &str) -> Vec<TaskSpec> {
        self.tasks
            .values()
            .filter(|t| t.agent_id == agent_id && !t.state.is_terminal() && !t.kill_requested)
            .filter_map(|t| {
                let job = self.jobs.get(&t.job_id)?;
                Some(TaskSpec {
                    task_id: t.id.clone(),
                    job_id: t.job_id.clone(),
                    image: job.spec.image.clone(),
                    command: job.spec.command.clone(),
                    env: job.spec.env.clone(),
                    resources: t.resources,
                    gpu_uuids: t.gpu_uuids.clone(),
                })
            })
            .collect()
    }

    /// The job's most recent task.
    pub fn latest_task(&self, job_id: &str) -> Option<&TaskRecord> {
        let job = self.jobs.get(job_id)?;
        job.task_ids.last().and_then(|t| self.tasks.get(t))
    }
}

/// Numeric part of `job-<n>`, for ordering job ids numerically.
pub fn job_seq(id: &str) -> u64 {
    id.strip_prefix("job-")
        .and_then(|n| n.parse().ok())
        .unwrap_or(u64::MAX)
}
