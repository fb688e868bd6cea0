//! Task and job states, their display names, status updates, runtime
//! statuses and GPU samples.

use super::*;
use crate::pb;
use crate::types::*;

pub fn task_state_from_pb(field: &str, v: i32) -> Result<TaskState> {
    use pb::TaskState as P;
    Ok(match P::try_from(v) {
        Ok(P::TaskStaging) => TaskState::Staging,
        Ok(P::TaskStarting) => TaskState::Starting,
        Ok(P::TaskRunning) => TaskState::Running,
        Ok(P::TaskFinished) => TaskState::Finished,
        Ok(P::TaskFailed) => TaskState::Failed,
        Ok(P::TaskKilled) => TaskState::Killed,
        Ok(P::TaskLost) => TaskState::Lost,
        Ok(P::TaskError) => TaskState::Error,
        Ok(P::TaskUnreachable) => TaskState::Unreachable,
        _ => return Err(ConvertError::new(field, format!("unknown task state {v}"))),
    })
}

impl From<TaskState> for pb::TaskState {
    fn from(s: TaskState) -> Self {
        use pb::TaskState as P;
        match s {
            TaskState::Staging => P::TaskStaging,
            TaskState::Starting => P::TaskStarting,
            TaskState::Running => P::TaskRunning,
            TaskState::Finished => P::TaskFinished,
            TaskState::Failed => P::TaskFailed,
            TaskState::Killed => P::TaskKilled,
            TaskState::Lost => P::TaskLost,
            TaskState::Error => P::TaskError,
            TaskState::Unreachable => P::TaskUnreachable,
        }
    }
}

impl From<TaskReason> for pb::Reason {
    fn from(r: TaskReason) -> Self {
        match r {
            TaskReason::Unspecified => pb::Reason::Unspecified,
            TaskReason::CommandExited => pb::Reason::CommandExited,
            TaskReason::TaskInvalid => pb::Reason::TaskInvalid,
            TaskReason::ResourcesUnavailable => pb::Reason::ResourcesUnavailable,
            TaskReason::AgentLost => pb::Reason::AgentLost,
            TaskReason::FrameworkRemoved => pb::Reason::FrameworkRemoved,
            TaskReason::KilledByFramework => pb::Reason::KilledByFramework,
            TaskReason::ContainerLaunchFailed => pb::Reason::ContainerLaunchFailed,
            TaskReason::Preempted => pb::Reason::Preempted,
            TaskReason::GpuUnhealthy => pb::Reason::GpuUnhealthy,
            TaskReason::Fenced => pb::Reason::Fenced,
            TaskReason::AgentDrained => pb::Reason::AgentDraining,
            TaskReason::DriverRequirementUnmet => pb::Reason::DriverRequirementUnmet,
            TaskReason::GpuMemoryLimit => pb::Reason::GpuMemoryLimit,
            TaskReason::Reclaimed => pb::Reason::Reclaimed,
            TaskReason::Hung => pb::Reason::Hung,
            TaskReason::RuntimeRestarted => pb::Reason::RuntimeRestarted,
            TaskReason::LivenessFailed => pb::Reason::LivenessFailed,
        }
    }
}

impl From<JobState> for pb::JobState {
    fn from(s: JobState) -> Self {
        use pb::JobState as P;
        match s {
            JobState::Queued => P::JobQueued,
            JobState::Starting => P::JobStarting,
            JobState::Running => P::JobRunning,
            JobState::Succeeded => P::JobSucceeded,
            JobState::Failed => P::JobFailed,
            JobState::Cancelled => P::JobCancelled,
        }
    }
}

/// A job state from the wire; unknown values (and UNSPECIFIED) are refused.
pub fn job_state_from_pb(field: &str, v: i32) -> Result<JobState> {
    use pb::JobState as P;
    Ok(match P::try_from(v) {
        Ok(P::JobQueued) => JobState::Queued,
        Ok(P::JobStarting) => JobState::Starting,
        Ok(P::JobRunning) => JobState::Running,
        Ok(P::JobSucceeded) => JobState::Succeeded,
        Ok(P::JobFailed) => JobState::Failed,
        Ok(P::JobCancelled) => JobState::Cancelled,
        _ => return Err(ConvertError::new(field, format!("unknown job state {v}"))),
    })
}

/// Job state as the user-facing upper-case word (`QUEUED`, ...), from the wire value.
/// A runtime's name (`docker`, `process`), or `unknown(N)`.
pub fn runtime_name(v: i32) -> String {
    match runtime_from_pb("runtime", v) {
        Ok(r) => r.to_string(),
        Err(_) => format!("unknown({v})"),
    }
}

/// An agent's state in gpuctl's words (`ACTIVE`, `UNREACHABLE`, `LOST`).
pub fn agent_state_name(v: i32) -> &'static str {
    match pb::AgentState::try_from(v) {
        Ok(pb::AgentState::AgentActive) => "ACTIVE",
        Ok(pb::AgentState::AgentLost) => "LOST",
        Ok(pb::AgentState::AgentUnreachable) => "UNREACHABLE",
        _ => "UNKNOWN",
    }
}

pub fn job_state_name(v: i32) -> &'static str {
    use pb::JobState as P;
    match P::try_from(v) {
        Ok(P::JobQueued) => "QUEUED",
        Ok(P::JobStarting) => "STARTING",
        Ok(P::JobRunning) => "RUNNING",
        Ok(P::JobSucceeded) => "SUCCEEDED",
        Ok(P::JobFailed) => "FAILED",
        Ok(P::JobCancelled) => "CANCELLED",
        _ => "UNKNOWN",
    }
}

/// Task state as the upper-case word (`RUNNING`, ...), from the wire value.
pub fn task_state_name(v: i32) -> &'static str {
    match task_state_from_pb("state", v) {
        Ok(TaskState::Staging) => "STAGING",
        Ok(TaskState::Starting) => "STARTING",
        Ok(TaskState::Running) => "RUNNING",
        Ok(TaskState::Finished) => "FINISHED",
        Ok(TaskState::Failed) => "FAILED",
        Ok(TaskState::Killed) => "KILLED",
        Ok(TaskState::Lost) => "LOST",
        Ok(TaskState::Error) => "ERROR",
        Ok(TaskState::Unreachable) => "UNREACHABLE",
        Err(_) => "UNKNOWN",
    }
}

impl TryFrom<pb::StatusUpdate> for StatusUpdate {
    type Error = ConvertError;
    fn try_from(u: pb::StatusUpdate) -> Result<Self> {
        check_id("agent_id", &u.agent_id)?;
        check_id("task_id", &u.task_id)?;
        let state = task_state_from_pb("state", u.state)?;
        if state == TaskState::Unreachable {
            return Err(ConvertError::new(
                "state",
                "TASK_UNREACHABLE is set by the master, not reported by agents",
            ));
        }
        let fenced = u.reason == pb::Reason::Fenced as i32;
        if fenced && !state.is_terminal() {
            return Err(ConvertError::new(
                "reason",
                format!("REASON_FENCED needs a final state (KILLED), not {state}"),
            ));
        }
        let latest_state = match u.latest_state {
            0 => None,
            v => match task_state_from_pb("latest_state", v)? {
                TaskState::Unreachable => {
                    return Err(ConvertError::new(
                        "latest_state",
                        "TASK_UNREACHABLE is set by the master, not reported by agents",
                    ))
                }
                s => Some(s),
            },
        };
        let unmet = u.reason == pb::Reason::DriverRequirementUnmet as i32;
        if unmet == u.requires.is_empty() {
            return Err(ConvertError::new(
                "requires",
                "is set with REASON_DRIVER_REQUIREMENT_UNMET, and only with it",
            ));
        }
        if unmet && state != TaskState::Failed {
            return Err(ConvertError::new(
                "reason",
                format!("REASON_DRIVER_REQUIREMENT_UNMET needs state FAILED, not {state}"),
            ));
        }
        if u.requires.len() > crate::cuda_req::MAX_EXPRS {
            return Err(ConvertError::new(
                "requires",
                format!(
                    "has {} requirements, at most {}",
                    u.requires.len(),
                    crate::cuda_req::MAX_EXPRS
                ),
            ));
        }
        for (i, r) in u.requires.iter().enumerate() {
            check_text(
                &format!("requires[{i}]"),
                r,
                crate::cuda_req::MAX_EXPR_LEN,
                true,
            )?;
        }
        let failure = |reason: pb::Reason, name: &str| {
            let given = u.reason == reason as i32;
            if given && state != TaskState::Failed {
                return Err(ConvertError::new(
                    "reason",
                    format!("{name} needs state FAILED, not {state}"),
                ));
            }
            Ok(given)
        };
        let gpu_memory_limit = failure(pb::Reason::GpuMemoryLimit, "REASON_GPU_MEMORY_LIMIT")?;
        let hung = failure(pb::Reason::Hung, "REASON_HUNG")?;
        let runtime_restarted = failure(pb::Reason::RuntimeRestarted, "REASON_RUNTIME_RESTARTED")?;
        let liveness_failed = failure(pb::Reason::LivenessFailed, "REASON_LIVENESS_FAILED")?;
        let health = health_from_pb(state, u.health)?;
        let gpu_unhealthy = u.reason == pb::Reason::GpuUnhealthy as i32;
        if !gpu_unhealthy && !u.failed_gpus.is_empty() {
            return Err(ConvertError::new(
                "failed_gpus",
                "is set only with REASON_GPU_UNHEALTHY",
            ));
        }
        if u.failed_gpus.len() > MAX_GPUS as usize {
            return Err(ConvertError::new(
                "failed_gpus",
                format!("has {} GPUs, at most {MAX_GPUS}", u.failed_gpus.len()),
            ));
        }
        for (i, g) in u.failed_gpus.iter().enumerate() {
            check_text(&format!("failed_gpus[{i}]"), g, MAX_NAME_LEN, false)?;
        }
        let enforcement = if u.enforcement.is_empty() {
            None
        } else {
            Some(
                u.enforcement
                    .parse()
                    .map_err(|e| ConvertError::new("enforcement", e))?,
            )
        };
        Ok(StatusUpdate {
            agent_id: u.agent_id,
            task_id: u.task_id,
            state,
            exit_code: u.exit_code,
            message: u.message,
            uuid: u.uuid,
            gpu_unhealthy,
            fenced,
            latest_state,
            requires: u.requires,
            enforcement,
            gpu_memory_limit,
            hung,
            failed_gpus: u.failed_gpus,
            runtime_restarted,
            liveness_failed,
            health,
        })
    }
}

/// A status update's `health`: only with RUNNING, its words on one line.
fn health_from_pb(state: TaskState, h: Option<pb::TaskHealth>) -> Result<Option<TaskHealth>> {
    let Some(h) = h else {
        return Ok(None);
    };
    if state != TaskState::Running {
        return Err(ConvertError::new(
            "health",
            format!("is sent with state RUNNING, not {state}"),
        ));
    }
    check_text("health.failure", &h.failure, MAX_REASON_LEN, true)?;
    Ok(Some(TaskHealth {
        ready: h.ready,
        failure: h.failure,
    }))
}

impl From<StatusUpdate> for pb::StatusUpdate {
    fn from(u: StatusUpdate) -> Self {
        pb::StatusUpdate {
            agent_id: u.agent_id,
            task_id: u.task_id,
            state: pb::TaskState::from(u.state) as i32,
            exit_code: u.exit_code,
            message: u.message,
            uuid: u.uuid,
            reason: if u.gpu_unhealthy {
                pb::Reason::GpuUnhealthy as i32
            } else if u.fenced {
                pb::Reason::Fenced as i32
            } else if !u.requires.is_empty() {
                pb::Reason::DriverRequirementUnmet as i32
            } else if u.gpu_memory_limit {
                pb::Reason::GpuMemoryLimit as i32
            } else if u.hung {
                pb::Reason::Hung as i32
            } else if u.runtime_restarted {
                pb::Reason::RuntimeRestarted as i32
            } else if u.liveness_failed {
                pb::Reason::LivenessFailed as i32
            } else {
                pb::Reason::Unspecified as i32
            },
            latest_state: u
                .latest_state
                .map_or(pb::TaskState::Unspecified as i32, |s| {
                    pb::TaskState::from(s) as i32
                }),
            requires: u.requires,
            enforcement: u.enforcement.map(|e| e.to_string()).unwrap_or_default(),
            failed_gpus: u.failed_gpus,
            health: u.health.map(|h| pb::TaskHealth {
                ready: h.ready,
                failure: h.failure,
            }),
        }
    }
}

impl TryFrom<pb::RuntimeStatus> for RuntimeStatus {
    type Error = ConvertError;
    fn try_from(r: pb::RuntimeStatus) -> Result<Self> {
        if r.message.len() > MAX_REASON_LEN {
            return Err(ConvertError::new(
                "runtimes.message",
                format!("longer than {MAX_REASON_LEN} bytes"),
            ));
        }
        Ok(RuntimeStatus {
            runtime: runtime_from_pb("runtimes.runtime", r.runtime)?,
            available: r.available,
            message: r.message,
        })
    }
}

impl From<RuntimeStatus> for pb::RuntimeStatus {
    fn from(r: RuntimeStatus) -> Self {
        pb::RuntimeStatus {
            runtime: pb::Runtime::from(r.runtime) as i32,
            available: r.available,
            message: r.message,
        }
    }
}

impl From<pb::GpuSample> for GpuSample {
    fn from(s: pb::GpuSample) -> Self {
        GpuSample {
            utilization_pct: s.utilization_pct.min(100),
            memory_used_mib: s.memory_used_mib,
            memory_total_mib: s.memory_total_mib,
            temperature_c: s.temperature_c,
            power_w: s.power_w.filter(|w| w.is_finite() && *w >= 0.0),
            sampled_at_ms: s.sampled_at_ms,
            xid_errors: s.xid_errors,
            task_memory_used_mib: s.task_memory_used_mib.into_iter().collect(),
            task_utilization_pct: s
                .task_utilization_pct
                .into_iter()
                .map(|(t, u)| (t, u.min(100)))
                .collect(),
            task_utilization_read: s.task_utilization_read,
        }
    }
}

impl From<GpuSample> for pb::GpuSample {
    fn from(s: GpuSample) -> Self {
        pb::GpuSample {
            utilization_pct: s.utilization_pct,
            memory_used_mib: s.memory_used_mib,
            memory_total_mib: s.memory_total_mib,
            temperature_c: s.temperature_c,
            power_w: s.power_w,
            sampled_at_ms: s.sampled_at_ms,
            xid_errors: s.xid_errors,
            task_memory_used_mib: s.task_memory_used_mib.into_iter().collect(),
            task_utilization_pct: s.task_utilization_pct.into_iter().collect(),
            task_utilization_read: s.task_utilization_read,
        }
    }
}

impl TryFrom<pb::GpuReport> for GpuReport {
    type Error = ConvertError;
    fn try_from(r: pb::GpuReport) -> Result<Self> {
        check_printable("gpus.uuid", &r.uuid, false)?;
        if r.uuid.is_empty() {
            return Err(ConvertError::new("gpus.uuid", "must not be empty"));
        }
        if r.unhealthy_reason.len() > MAX_REASON_LEN {
            return Err(ConvertError::new(
                "gpus.unhealthy_reason",
                format!("longer than {MAX_REASON_LEN} bytes"),
            ));
        }
        if let Some(s) = &r.sample {
            const FIELD: &str = "gpus.sample.task_memory_used_mib";
            if s.task_memory_used_mib.len() > MAX_SAMPLE_TASKS {
                return Err(ConvertError::new(
                    FIELD,
                    format!("more than {MAX_SAMPLE_TASKS} tasks"),
                ));
            }
            for task in s.task_memory_used_mib.keys() {
                check_id(FIELD, task)?;
            }
            const UTIL: &str = "gpus.sample.task_utilization_pct";
            if s.task_utilization_pct.len() > MAX_SAMPLE_TASKS {
                return Err(ConvertError::new(
                    UTIL,
                    format!("more than {MAX_SAMPLE_TASKS} tasks"),
                ));
            }
            for task in s.task_utilization_pct.keys() {
                check_id(UTIL, task)?;
            }
        }
        Ok(GpuReport {
            uuid: r.uuid,
            healthy: r.healthy,
            unhealthy_reason: r.unhealthy_reason,
            sample: r.sample.map(Into::into),
        })
    }
}

impl From<GpuReport> for pb::GpuReport {
    fn from(r: GpuReport) -> Self {
        pb::GpuReport {
            uuid: r.uuid,
            healthy: r.healthy,
            unhealthy_reason: r.unhealthy_reason,
            sample: r.sample.map(Into::into),
        }
    }
}
