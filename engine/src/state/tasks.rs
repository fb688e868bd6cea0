//! A task's life after launch: status updates, its end, and the release of
//! what it held (GPUs, fractions, ports, resources).

use gpuctl_core::types::{StatusUpdate, TaskState};

use super::apply::Outcome;
use super::events::EventKind;
use super::ApplyError;
use super::{State, TaskReason};

impl State {
    pub(super) fn update_task(
        &mut self,
        u: &StatusUpdate,
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        let Some(task) = self.tasks.get(&u.task_id) else {
            return Ok(Outcome::StaleUpdate);
        };
        if task.agent_id != u.agent_id {
            return Err(ApplyError::WrongAgent {
                task_id: u.task_id.clone(),
                agent_id: u.agent_id.clone(),
                owner: task.agent_id.clone(),
            });
        }
        if task.state.is_terminal() {
            // A final report of a task that ended without its agent's word
            // (LOST by timeout): its processes are gone now, so its GPUs
            // may be given again. The task itself stays as it ended.
            if task.holding && u.state.is_terminal() {
                self.release(&u.task_id);
                return Ok(Outcome::Done);
            }
            return Ok(Outcome::StaleUpdate);
        }
        // The task ended on its agent, which holds the final update behind
        // this one until this one is acknowledged: free what it held now.
        let released = u.latest_state.is_some_and(TaskState::is_terminal)
            && !task.released
            && self.release_early(&u.task_id);
        // What the agent enforces of a fraction, as it says (only for a
        // task that holds one).
        if let Some(e) = u.enforcement {
            if let Some(t) = self.tasks.get_mut(&u.task_id) {
                if t.fraction.is_some() {
                    t.enforcement = Some(e);
                }
            }
        }
        let Some(task) = self.tasks.get(&u.task_id) else {
            return Ok(Outcome::StaleUpdate);
        };
        // The agent resends an update until it is acknowledged: a repeat is
        // not news.
        if !u.uuid.is_empty() && task.last_update_uuid == u.uuid {
            return Ok(if released {
                Outcome::Done
            } else {
                Outcome::StaleUpdate
            });
        }
        if u.state.is_terminal() {
            self.task_update_ended(u, at_ms);
            return Ok(Outcome::Done);
        }
        let health_changed = u.health.is_some() && self.task_health(u, at_ms);
        let Some(task) = self.tasks.get(&u.task_id) else {
            return Ok(Outcome::StaleUpdate);
        };
        // Non-terminal updates only move forward.
        let rank = |s: TaskState| match s {
            TaskState::Staging => 0,
            TaskState::Starting => 1,
            _ => 2,
        };
        if task.state == TaskState::Unreachable {
            // News from an agent the leader had given up on (sent before
            // its registration): remembered for when it registers again,
            // which is what brings its tasks back.
            let before = task.before_unreachable.unwrap_or(TaskState::Running);
            if rank(u.state) <= rank(before) {
                return Ok(Outcome::StaleUpdate);
            }
            if let Some(task) = self.tasks.get_mut(&u.task_id) {
                task.before_unreachable = Some(u.state);
                task.updated_at_ms = at_ms;
                task.last_update_uuid = u.uuid.clone();
            }
            return Ok(Outcome::Done);
        }
        if rank(u.state) <= rank(task.state) {
            return Ok(if released || health_changed {
                Outcome::Done
            } else {
                Outcome::StaleUpdate
            });
        }
        let job_id = task.job_id.clone();
        if let Some(task) = self.tasks.get_mut(&u.task_id) {
            task.state = u.state;
            task.updated_at_ms = at_ms;
            task.last_update_uuid = u.uuid.clone();
            if u.state == TaskState::Running && task.running_at_ms.is_none() {
                task.running_at_ms = Some(at_ms);
            }
            if !u.message.is_empty() {
                task.message = u.message.clone();
            }
        }
        if !job_id.is_empty() {
            self.job_task_progressed(&job_id, &u.task_id, at_ms);
        }
        Ok(Outcome::Done)
    }

    /// What a live task's health checks say now (an update with
    /// `health`): recorded, and said in its job's events when readiness
    /// changes or a new failure is told. Whether anything changed.
    fn task_health(&mut self, u: &StatusUpdate, at_ms: u64) -> bool {
        let Some(h) = &u.health else {
            return false;
        };
        let Some(task) = self.tasks.get_mut(&u.task_id) else {
            return false;
        };
        if task.state.is_terminal() || task.health.as_ref() == Some(h) {
            return false;
        }
        let before = task.health.replace(h.clone());
        task.last_update_uuid = u.uuid.clone();
        task.updated_at_ms = at_ms;
        let (job_id, rank) = (task.job_id.clone(), task.rank);
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return true;
        };
        let who = if job.world() > 1 {
            format!("task {rank} ")
        } else {
            String::new()
        };
        let was_ready = before.as_ref().is_some_and(|b| b.ready);
        let new_failure =
            !h.failure.is_empty() && before.as_ref().map(|b| &b.failure) != Some(&h.failure);
        if h.ready && !was_ready {
            job.events
                .record(EventKind::Ready, format!("{who}ready"), at_ms);
        } else if new_failure || (was_ready && !h.ready) {
            let state = if h.ready { "" } else { "not ready: " };
            job.events.record(
                EventKind::Unhealthy,
                format!("{who}{state}{}", h.failure),
                at_ms,
            );
        }
        true
    }

    /// A final update: why the task ended (a GPU failure, the fence, a
    /// driver refusal, the GPU memory limit, a hang, its runtime's restart,
    /// or its exit), said as such rather than as an exit code (see
    /// `job_task_ended` and `failure_message`), and its end.
    fn task_update_ended(&mut self, u: &StatusUpdate, at_ms: u64) {
        let refused = !u.requires.is_empty() && self.learn_driver_requires(&u.task_id, u);
        // Known before the job hears of the end: a GPU failure, the
        // agent's fence, a driver refusal or the GPU memory limit is
        // said as such, not as an exit code (see job_task_ended and
        // failure_message).
        if refused {
            if let Some(task) = self.tasks.get_mut(&u.task_id) {
                task.reason = TaskReason::DriverRequirementUnmet;
            }
        }
        if u.gpu_unhealthy {
            self.avoid_failed_gpus(&u.task_id, &u.failed_gpus, at_ms);
        }
        if u.gpu_unhealthy
            || u.fenced
            || u.gpu_memory_limit
            || u.hung
            || u.runtime_restarted
            || u.liveness_failed
        {
            if let Some(task) = self.tasks.get_mut(&u.task_id) {
                task.reason = if u.gpu_unhealthy {
                    TaskReason::GpuUnhealthy
                } else if u.fenced {
                    TaskReason::Fenced
                } else if u.gpu_memory_limit {
                    TaskReason::GpuMemoryLimit
                } else if u.hung {
                    TaskReason::Hung
                } else if u.liveness_failed {
                    TaskReason::LivenessFailed
                } else {
                    TaskReason::RuntimeRestarted
                };
            }
        }
        self.end_task(&u.task_id, u.state, u.exit_code, &u.message, at_ms);
        if let Some(task) = self.tasks.get_mut(&u.task_id) {
            task.last_update_uuid = u.uuid.clone();
            task.reason = match (u.state, u.exit_code) {
                _ if u.gpu_unhealthy => TaskReason::GpuUnhealthy,
                _ if u.fenced => TaskReason::Fenced,
                _ if refused => TaskReason::DriverRequirementUnmet,
                _ if u.gpu_memory_limit => TaskReason::GpuMemoryLimit,
                _ if u.hung => TaskReason::Hung,
                _ if u.runtime_restarted => TaskReason::RuntimeRestarted,
                _ if u.liveness_failed => TaskReason::LivenessFailed,
                (TaskState::Finished | TaskState::Failed, Some(_)) => TaskReason::CommandExited,
                (TaskState::Failed | TaskState::Error, None) => TaskReason::ContainerLaunchFailed,
                (TaskState::Killed, _) if task.reason == TaskReason::Unspecified => {
                    TaskReason::KilledByFramework
                }
                _ => task.reason,
            };
        }
    }

    /// Moves a task to a terminal state on its agent's word (the agent
    /// reported it, or registered without it), frees what it held and
    /// updates its job.
    pub(super) fn end_task(
        &mut self,
        task_id: &str,
        state: TaskState,
        exit_code: Option<i32>,
        message: &str,
        at_ms: u64,
    ) {
        self.end_task_with(task_id, state, exit_code, message, at_ms, false);
    }

    /// Moves a task to a terminal state and updates its job. With `hold`
    /// (the agent has not confirmed the end: LOST by timeout) its GPUs and
    /// resources stay held until [`State::release`]; else they are freed.
    pub(super) fn end_task_with(
        &mut self,
        task_id: &str,
        state: TaskState,
        exit_code: Option<i32>,
        message: &str,
        at_ms: u64,
        hold: bool,
    ) {
        // Charged once, when it ends: what it held from its launch.
        if let Some(t) = self.tasks.get(task_id).filter(|t| !t.state.is_terminal()) {
            let charge = self.charge_of(t);
            let from = t.created_at_ms;
            let running = t.running_at_ms.unwrap_or(at_ms);
            self.usage.charge(&charge, from, at_ms.max(from), running);
        }
        let Some(task) = self.tasks.get_mut(task_id) else {
            return;
        };
        task.before_unreachable = None;
        task.state = state;
        task.exit_code = exit_code;
        // A task the master asked to stop keeps the master's reason
        // ("preempted by ...") over the agent's "killed".
        let keep = task.kill_requested && !task.message.is_empty();
        if !message.is_empty() && !keep {
            task.message = message.to_string();
        }
        task.updated_at_ms = at_ms;
        // Made here, not by an agent: nothing for the agent to resend.
        task.last_update_uuid.clear();
        if state == TaskState::Lost {
            task.reason = TaskReason::AgentLost;
        }
        let job_id = task.job_id.clone();
        // Held (not yet released) until release() below or later; unless
        // its agent's latest_state freed it already.
        task.holding = !task.released;
        if !hold {
            self.release(task_id);
        }
        if !job_id.is_empty() {
            self.job_task_ended(&job_id, task_id, at_ms);
        }
    }

    /// A period of utilization readings: history, and the busy time of
    /// each task holding a whole GPU or a fraction (by its processes' own
    /// readings, which are its history too); a MIG device's readings are
    /// its whole GPU's, and are not charged to a task.
    pub(super) fn record_utilization(
        &mut self,
        at_ms: u64,
        period_ms: u64,
        points: &[super::util::UtilPoint],
    ) {
        self.util.record(at_ms, period_ms, points);
        let busy: u32 = points.iter().map(|p| u32::from(p.util_pct.min(100))).sum();
        let allocated = u32::try_from(self.gpu_owner.len()).unwrap_or(u32::MAX);
        self.util.cluster.record(at_ms, period_ms, allocated, busy);
        // A shared GPU's fractions: each its own reading, against its share.
        for p in points {
            for (task_id, util) in &p.tasks {
                let Some(task) = self
                    .tasks
                    .get(task_id)
                    .filter(|t| !t.state.is_terminal() && t.fraction.is_some())
                    .filter(|t| t.gpu_uuids.contains(&p.gpu))
                else {
                    continue;
                };
                let charge = self.charge_of(task);
                let share = charge.gpu_milli.max(1);
                let (sampled, busy) = self
                    .usage
                    .charge_busy_share(&charge, at_ms, period_ms, *util, share);
                if let Some(task) = self.tasks.get_mut(task_id) {
                    task.gpu_sampled_ms = task.gpu_sampled_ms.saturating_add(sampled);
                    task.gpu_busy_ms = task.gpu_busy_ms.saturating_add(busy);
                }
                let mem = p
                    .task_mem
                    .iter()
                    .find(|(t, _)| t == task_id)
                    .map_or(0, |(_, m)| *m);
                self.util.record_task(task_id, at_ms, period_ms, *util, mem);
            }
        }
        for p in points {
            let Some(task) = self
                .gpu_owner
                .get(&p.gpu)
                .and_then(|t| self.tasks.get(t))
                .filter(|t| !t.state.is_terminal() && t.fraction.is_none())
            else {
                continue;
            };
            let charge = self.charge_of(task);
            self.usage
                .charge_busy(&charge, at_ms, period_ms, p.util_pct);
        }
    }

    /// After a period's readings: a running job whose whole GPUs all had a
    /// reading under `below` pct in each of the last `window_ms` (all of
    /// it since its tasks launched), and whose fractions of shared GPUs
    /// had readings of their own processes under it as long, is flagged
    /// idle, with an `Idle` event; one flagged that has a GPU or fraction
    /// at or above it in this period is busy again (`Busy`). Jobs on MIG
    /// devices have no readings of their own and are never flagged, nor
    /// are fractions on a GPU whose per-process readings are not read.
    pub(super) fn flag_idle_jobs(
        &mut self,
        points: &[super::util::UtilPoint],
        at_ms: u64,
        period_ms: u64,
        window_ms: u64,
        below: u8,
    ) {
        use super::events::EventKind;
        let period_ms = period_ms.max(1);
        let periods = (window_ms / period_ms).max(1);
        let end = at_ms.saturating_add(period_ms);
        let from = end.saturating_sub(periods * period_ms);
        let mut jobs: std::collections::BTreeSet<String> = points
            .iter()
            .filter_map(|p| self.gpu_owner.get(&p.gpu))
            .filter_map(|t| self.tasks.get(t))
            .filter(|t| !t.job_id.is_empty())
            .map(|t| t.job_id.clone())
            .collect();
        // Jobs' fractions: their own readings extend or end their runs.
        let mut busy_fractions = std::collections::BTreeSet::new();
        for p in points {
            for (task_id, util) in &p.tasks {
                let Some(task) = self
                    .tasks
                    .get_mut(task_id)
                    .filter(|t| !t.state.is_terminal() && t.fraction.is_some())
                    .filter(|t| !t.job_id.is_empty() && t.gpu_uuids.contains(&p.gpu))
                else {
                    continue;
                };
                task.quiet =
                    super::util::QuietRun::next(task.quiet, at_ms, period_ms, *util, below);
                if task.quiet.is_none() {
                    busy_fractions.insert(task.job_id.clone());
                }
                jobs.insert(task.job_id.clone());
            }
        }
        for job_id in jobs {
            let Some(job) = self.jobs.get(&job_id) else {
                continue;
            };
            if job.state != gpuctl_core::types::JobState::Running {
                continue;
            }
            let Readings { idle, sum, n, gpus } = self.job_readings(job, from, end, periods, below);
            let idle = idle && gpus > 0;
            let busy_now = busy_fractions.contains(&job_id)
                || points.iter().any(|p| {
                    p.util_pct >= below
                        && self
                            .gpu_owner
                            .get(&p.gpu)
                            .and_then(|t| self.tasks.get(t))
                            .is_some_and(|t| t.job_id == job_id)
                });
            let was_idle = job.idle_since_ms.is_some();
            let mean = sum as f64 / n.max(1) as f64;
            let stop_after = self
                .tenant_terms
                .get(job.spec.tenant.name())
                .and_then(|t| t.stop_idle_after_ms);
            let tenant = job.spec.tenant.name().to_string();
            let Some(job) = self.jobs.get_mut(&job_id) else {
                continue;
            };
            if idle && !was_idle {
                job.idle_since_ms = Some(from);
                let window = if window_ms % 60_000 == 0 {
                    format!("{} min", window_ms / 60_000)
                } else {
                    format!("{} s", window_ms as f64 / 1000.0)
                };
                job.events.record(
                    EventKind::Idle,
                    format!(
                        "its {gpus} GPU(s) stayed under {below}% for {window} (mean {mean:.1}%)"
                    ),
                    at_ms,
                );
            } else if was_idle && busy_now {
                job.idle_since_ms = None;
                job.events.record(
                    EventKind::Busy,
                    format!("its GPUs are busy again ({below}% or more)"),
                    at_ms,
                );
            }
            // Flagged (at the end of its first idle window) for its
            // tenant's stop_idle_after: stopped, once.
            let due = |since: u64, after: u64| {
                end >= since
                    .saturating_add(periods * period_ms)
                    .saturating_add(after)
            };
            if let (true, Some(since), Some(after), None) =
                (idle, job.idle_since_ms, stop_after, &job.stopping)
            {
                // A service's replica is flagged, not stopped: serving
                // waits for requests.
                if due(since, after) && !job.cancel_requested && job.spec.service.is_none() {
                    let message = format!(
                        "stopped: its GPUs stayed idle (under {below}%) for {} s after it was flagged idle (tenant {tenant} stops idle jobs)",
                        after / 1000
                    );
                    job.stopping = Some(super::Stopping::IdleStopped {
                        message: message.clone(),
                    });
                    job.events
                        .record(EventKind::Cancelling, message.clone(), at_ms);
                    let live = job.current_tasks().to_vec();
                    self.kill_live(&live, &message, None, at_ms);
                }
            }
        }
    }

    /// A running job's readings over the window `from..end`: whether each
    /// of its GPUs and fractions stayed idle for all of it, and the sum and
    /// count of the readings (for the mean the event says).
    fn job_readings(
        &self,
        job: &super::JobRecord,
        from: u64,
        end: u64,
        periods: u64,
        below: u8,
    ) -> Readings {
        let mut idle = true;
        let (mut sum, mut n, mut gpus) = (0u64, 0u64, 0usize);
        for task in job.current_tasks().iter().filter_map(|t| self.tasks.get(t)) {
            let holding = task.holding();
            if holding.fraction().is_some() {
                gpus += 1;
                match task.quiet {
                    // A run of the whole window (its periods, not
                    // cut short by the cluster's start), to its end.
                    Some(q)
                        if task.created_at_ms <= from
                            && q.n >= periods
                            && q.from_ms <= from
                            && q.to_ms >= end =>
                    {
                        sum += q.sum;
                        n += q.n;
                    }
                    _ => idle = false,
                }
                continue;
            }
            for g in holding.owned() {
                gpus += 1;
                let readings: Vec<u8> = self
                    .util
                    .gpu(g)
                    .map(|h| h.points(from, end).map(|(_, u, _)| u).collect())
                    .unwrap_or_default();
                sum += readings.iter().map(|u| u64::from(*u)).sum::<u64>();
                n += readings.len() as u64;
                idle &= task.created_at_ms <= from
                    && readings.len() as u64 == periods
                    && readings.iter().all(|u| *u < below);
            }
        }
        Readings { idle, sum, n, gpus }
    }

    /// What `task` holds, charged to its job's tenant and submitter (a
    /// framework's task: its framework's tenant) and its GPU model.
    pub(crate) fn charge_of(&self, task: &super::TaskRecord) -> super::usage::Charge {
        let (tenant, user) = match self.jobs.get(&task.job_id) {
            Some(j) => (
                j.spec.tenant.name().to_string(),
                j.spec.submitted_by.clone(),
            ),
            None => (
                self.frameworks
                    .get(&task.framework_id)
                    .map_or(gpuctl_core::types::DEFAULT_TENANT, |f| f.info.tenant.name())
                    .to_string(),
                String::new(),
            ),
        };
        let gpus = self.agents.get(&task.agent_id).map(|a| &a.info.gpus[..]);
        let device = task
            .gpu_uuids
            .first()
            .and_then(|u| gpuctl_core::types::find_device(gpus.unwrap_or_default(), u));
        use gpuctl_core::types::Device;
        let gpu_model = match device {
            Some(Device::Gpu(g)) => g.model.clone(),
            Some(Device::Mig { parent, device }) => {
                format!("{} MIG {}", parent.model, device.profile)
            }
            None if task.gpu_uuids.is_empty() => String::new(),
            None => "unknown".to_string(),
        };
        let gpu_milli = match (task.fraction, device) {
            (Some(f), _) if f.compute_pct > 0 => u64::from(f.compute_pct) * 10,
            (Some(f), Some(Device::Gpu(g))) if g.memory_mib > 0 => {
                (f.mem_mib.saturating_mul(1000) / g.memory_mib).min(1000)
            }
            (Some(_), _) => 0,
            (None, _) => 1000 * task.gpu_uuids.len() as u64,
        };
        let gpu_model = match task.fraction {
            Some(_) => format!("{gpu_model} (shared)"),
            None => gpu_model,
        };
        super::usage::Charge {
            tenant,
            user,
            gpu_model,
            gpu_milli,
            cpu_milli: (task.resources.cpus * 1000.0).round().max(0.0) as u64,
            mem_mib: task.resources.mem_mib,
        }
    }

    /// Frees what an ended task held: its GPUs in `gpu_owner` and its
    /// resources in its agent's `allocated`. Only for a task that ended
    /// and still holds (`holding`); anything else is left alone.
    pub(super) fn release(&mut self, task_id: &str) {
        let Some(task) = self.tasks.get_mut(task_id) else {
            return;
        };
        if !task.state.is_terminal() || !task.holding {
            return;
        }
        task.holding = false;
        self.free_held(task_id);
    }

    /// Frees the GPUs and resources of a live task whose agent reported
    /// its end ahead of its updates (`latest_state`). True if it held any.
    pub(super) fn release_early(&mut self, task_id: &str) -> bool {
        let Some(task) = self.tasks.get_mut(task_id) else {
            return false;
        };
        if task.state.is_terminal() || task.released {
            return false;
        }
        task.released = true;
        self.free_held(task_id);
        true
    }

    /// An agent refused to start `task_id` because its driver does not meet
    /// what the image requires (`u.requires`). The job of a task of its
    /// current attempt learns the requirements it did not know yet, so that
    /// placement sends it only where the driver qualifies. True when the
    /// refusal stands as one (a framework's task, whose framework hears
    /// the reason; a job that learned something): then it is not a failed
    /// attempt. A refusal that teaches nothing (placement applied these
    /// already, so master and agent disagree about the agent's driver),
    /// does not parse, or would take the job past `MAX_EXPRS` counts as an
    /// ordinary failure: the job's retries bound it, never a loop.
    pub(super) fn learn_driver_requires(&mut self, task_id: &str, u: &StatusUpdate) -> bool {
        use gpuctl_core::cuda_req::{Expr, MAX_EXPRS};
        let Some(job_id) = self.tasks.get(task_id).map(|t| t.job_id.clone()) else {
            return false;
        };
        if job_id.is_empty() {
            return true;
        }
        let Ok(parsed) = u
            .requires
            .iter()
            .map(|r| Expr::parse(r))
            .collect::<Result<Vec<_>, _>>()
        else {
            return false;
        };
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return false;
        };
        if job.state.is_terminal() || !job.current_tasks().iter().any(|t| t == task_id) {
            return false;
        }
        let mut new: Vec<Expr> = Vec::new();
        for e in parsed {
            let known = job
                .driver_requires()
                .chain(&new)
                .any(|k| k.text() == e.text());
            if !known && !e.is_empty() {
                new.push(e);
            }
        }
        if new.is_empty() || job.image_requires.len() + new.len() > MAX_EXPRS {
            return false;
        }
        job.image_requires.extend(new);
        true
    }

    /// Takes the task's GPUs out of `gpu_owner` (those still its own) and
    /// its resources out of its agent's `allocated`; the callers decide
    /// when (once per task).
    pub(super) fn free_held(&mut self, task_id: &str) {
        let Some(task) = self.tasks.get(task_id) else {
            return;
        };
        let (agent_id, resources) = (task.agent_id.clone(), task.resources);
        for g in &task.gpu_uuids {
            if self.gpu_owner.get(g).map(String::as_str) == Some(task_id) {
                self.gpu_owner.remove(g);
            }
        }
        if let Some(agent) = self.agents.get_mut(&agent_id) {
            agent.allocated = agent.allocated.saturating_sub(&resources);
        }
    }
}
/// What [`State::job_readings`] found.
struct Readings {
    /// Every GPU and fraction under the threshold for the whole window.
    idle: bool,
    sum: u64,
    n: u64,
    /// GPUs and fractions counted.
    gpus: usize,
}
