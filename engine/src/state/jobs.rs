//! gpuctl jobs in the state machine: launching an attempt (one task, or a
//! gang of `replicas` tasks, all or nothing), ending it (success, failure
//! with retries, cancel, preemption) and preempting jobs of lower priority.
//!
//! An attempt ends when its last task has ended. The first task that fails
//! decides what follows ([`Stopping`]) and the rest of the gang is killed;
//! a job goes back to QUEUED only once all its tasks have ended, so a new
//! attempt never overlaps the old one. (A task LOST by timeout has ended:
//! its agent's fence stopped it before the lost timeout; its GPUs stay held
//! until the agent confirms, so the new attempt runs on other GPUs.)

use std::collections::{BTreeMap, BTreeSet};

use gpuctl_core::types::{Holding, JobState, RestartPolicy, TaskState};

use super::events::EventKind;
use super::fit::Pending;
use super::{ApplyError, JobRecord, Launch, Outcome, State, Stopping, TaskReason, TaskRecord};

impl State {
    /// Checks every launch against the current state (and against the other
    /// launches of the same command) before changing anything: each job
    /// queued, given exactly `replicas` launches, each fitting. Returns each
    /// launch's host ports.
    pub(super) fn check_launches(&self, launches: &[Launch]) -> Result<Vec<Vec<u16>>, ApplyError> {
        let mut pending = Pending::default();
        let mut ports = Vec::with_capacity(launches.len());
        let mut per_job: BTreeMap<&str, u32> = BTreeMap::new();
        for l in launches {
            let job = self
                .jobs
                .get(&l.job_id)
                .ok_or_else(|| ApplyError::JobNotFound(l.job_id.clone()))?;
            if job.state != JobState::Queued || job.cancel_requested {
                return Err(ApplyError::JobNotQueued {
                    job_id: job.id.clone(),
                    state: job.state,
                });
            }
            *per_job.entry(job.id.as_str()).or_default() += 1;
            ports.push(self.check_fit(
                &l.agent_id,
                job.spec.runtime(),
                &job.spec.template.resources,
                &l.gpu_uuids,
                Some(job.spec.placement.wants()),
                &mut pending,
            )?);
        }
        for (job_id, n) in per_job {
            let Some(spec) = self.jobs.get(job_id).map(|j| &j.spec) else {
                continue; // checked above
            };
            let (min, max) = (spec.min_replicas(), spec.replicas());
            if !(min..=max).contains(&n) {
                let want = if min == max {
                    format!("{max} replicas")
                } else {
                    format!("{min} to {max} replicas (elastic)")
                };
                return Err(ApplyError::DoesNotFit(format!(
                    "job {job_id} has {want}, {n} launched (all start or none)"
                )));
            }
        }
        Ok(ports)
    }

    /// Starts an attempt of each job named: tasks `<job>.<n>` with ranks in
    /// the order of the launches.
    pub(super) fn launch_tasks(
        &mut self,
        launches: &[Launch],
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        let ports = self.check_launches(launches)?;
        let mut rank: BTreeMap<String, u32> = BTreeMap::new();
        let mut placed: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (l, ports) in launches.iter().zip(ports) {
            let Some(job) = self.jobs.get_mut(&l.job_id) else {
                continue; // checked above
            };
            let r = rank.entry(job.id.clone()).or_default();
            let n = (job.task_ids.len() as u64).saturating_add(job.forgotten_tasks);
            let task_id = format!("{}.{n}", job.id);
            job.task_ids.push(task_id.clone());
            // The attempt's size so far: all its launches by the loop's end.
            job.world = *r + 1;
            job.state = JobState::Starting;
            job.updated_at_ms = at_ms;
            job.preempted_by = None;
            job.stopping = None;
            job.not_before_ms = 0;
            let resources = job.spec.template.resources;
            let fraction = job.spec.placement.fraction;
            // A fraction shares its GPU: it is counted from the tasks
            // (`State::share_used`), never owned.
            for uuid in Holding::of(&l.gpu_uuids, fraction.as_ref()).owned() {
                self.gpu_owner.insert(uuid.clone(), task_id.clone());
            }
            if let Some(agent) = self.agents.get_mut(&l.agent_id) {
                agent.allocated = agent.allocated.add(&resources);
            }
            self.tasks.insert(
                task_id.clone(),
                TaskRecord {
                    id: task_id,
                    job_id: l.job_id.clone(),
                    agent_id: l.agent_id.clone(),
                    gpu_uuids: l.gpu_uuids.clone(),
                    resources,
                    state: TaskState::Staging,
                    exit_code: None,
                    message: String::new(),
                    kill_requested: false,
                    created_at_ms: at_ms,
                    updated_at_ms: at_ms,
                    framework_id: String::new(),
                    framework_task_id: String::new(),
                    launch: None,
                    reason: TaskReason::Unspecified,
                    last_update_uuid: Vec::new(),
                    acked_uuid: Vec::new(),
                    rank: *r,
                    before_unreachable: None,
                    holding: false,
                    released: false,
                    ports,
                    fraction,
                    enforcement: None,
                    gpu_sampled_ms: 0,
                    gpu_busy_ms: 0,
                    quiet: None,
                    running_at_ms: None,
                    health: None,
                },
            );
            let gpus = if l.gpu_uuids.is_empty() {
                "no GPUs".to_string()
            } else {
                format!("GPUs {}", l.gpu_uuids.join(","))
            };
            placed
                .entry(l.job_id.clone())
                .or_default()
                .push(format!("agent {} ({gpus})", l.agent_id));
            *r += 1;
        }
        for (job_id, places) in placed {
            // Rank order: the launches' order.
            let message = match places.as_slice() {
                [one] => format!("placed on {one}"),
                many => format!(
                    "{} tasks placed: {}",
                    many.len(),
                    many.iter()
                        .enumerate()
                        .map(|(rank, p)| format!("rank {rank} on {p}"))
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
            };
            self.job_event(&job_id, EventKind::Scheduled, message, at_ms);
        }
        Ok(Outcome::Done)
    }

    /// A task of the job's current attempt moved forward (STARTING,
    /// RUNNING): the job is RUNNING once all its tasks are.
    pub(super) fn job_task_progressed(&mut self, job_id: &str, task_id: &str, at_ms: u64) {
        let Some(job) = self.jobs.get(job_id) else {
            return;
        };
        if job.state.is_terminal() || job.stopping.is_some() {
            return;
        }
        let current = job.current_tasks();
        if !current.iter().any(|t| t == task_id) {
            return;
        }
        // A task on an unreachable agent counts as what it was: the job
        // does not move while its agent is away.
        let all_running = current.iter().all(|t| {
            self.tasks.get(t).is_some_and(|t| {
                t.state == TaskState::Running
                    || (t.state == TaskState::Unreachable
                        && t.before_unreachable == Some(TaskState::Running))
            })
        });
        // Started once per attempt: when it becomes RUNNING (an agent
        // coming back changes nothing here).
        let started = (all_running && job.state != JobState::Running).then(|| {
            let agents: BTreeSet<&str> = current
                .iter()
                .filter_map(|t| self.tasks.get(t))
                .map(|t| t.agent_id.as_str())
                .collect();
            match (current.len(), agents.len()) {
                (1, _) => format!("running on agent {}", join_cut(&agents)),
                (n, 1) => format!("all {n} tasks running on agent {}", join_cut(&agents)),
                (n, _) => format!("all {n} tasks running on agents {}", join_cut(&agents)),
            }
        });
        if let Some(job) = self.jobs.get_mut(job_id) {
            if let Some(words) = started {
                job.events.record(EventKind::Started, words, at_ms);
            }
            job.state = if all_running {
                JobState::Running
            } else {
                JobState::Starting
            };
            job.updated_at_ms = at_ms;
        }
    }

    /// A task of the job ended (the task itself is already updated). The
    /// first failure of an attempt decides its fate and stops the rest of
    /// the gang; once every task of the attempt has ended the job moves on.
    pub(super) fn job_task_ended(&mut self, job_id: &str, task_id: &str, at_ms: u64) {
        let Some(job) = self.jobs.get(job_id) else {
            return;
        };
        if job.state.is_terminal() || job.state == JobState::Queued {
            return;
        }
        let current: Vec<String> = job.current_tasks().to_vec();
        if !current.iter().any(|t| t == task_id) {
            return; // a task of an earlier attempt
        }
        let Some(task) = self.tasks.get(task_id) else {
            return;
        };
        let ok = task.state == TaskState::Finished && task.exit_code.unwrap_or(0) == 0;
        if !ok && !job.cancel_requested && job.stopping.is_none() {
            self.stop_attempt_on_failure(job_id, task_id, &current, at_ms);
        }
        let tasks: Vec<&TaskRecord> = current.iter().filter_map(|t| self.tasks.get(t)).collect();
        let all_ended = tasks.iter().all(|t| t.state.is_terminal());
        let all_ok = tasks
            .iter()
            .all(|t| t.state == TaskState::Finished && t.exit_code.unwrap_or(0) == 0);
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        job.updated_at_ms = at_ms;
        if all_ended {
            let replica = job.spec.restart_policy == RestartPolicy::Always;
            if replica {
                super::services::backoff_after_run(job, &tasks, at_ms);
            }
            end_attempt(job, all_ok, tasks.len(), at_ms);
            if replica {
                self.forget_old_replica_tasks(job_id);
            }
        }
    }

    /// The first failure of an attempt: what stops it is recorded (with
    /// its event) and the rest of the gang is stopped.
    fn stop_attempt_on_failure(
        &mut self,
        job_id: &str,
        task_id: &str,
        current: &[String],
        at_ms: u64,
    ) {
        let (Some(job), Some(task)) = (self.jobs.get(job_id), self.tasks.get(task_id)) else {
            return;
        };
        let message = failure_message(task, job.world());
        let stopping = if task.reason == TaskReason::GpuUnhealthy {
            Stopping::GpuFailed {
                message: message.clone(),
                requeue: !job.spec.no_requeue,
            }
        } else if task.reason == TaskReason::DriverRequirementUnmet {
            Stopping::DriverRefused {
                message: message.clone(),
            }
        } else if task.reason == TaskReason::RuntimeRestarted {
            Stopping::RuntimeRestarted {
                message: message.clone(),
                requeue: !job.spec.no_requeue,
            }
        } else {
            Stopping::Failed {
                message: message.clone(),
                retry: job.spec.restart_policy == RestartPolicy::Always
                    || (job.retries < job.spec.max_retries
                        && job.spec.restart_policy == RestartPolicy::Gang),
            }
        };
        let others: Vec<String> = current
            .iter()
            .filter(|t| t.as_str() != task_id)
            .cloned()
            .collect();
        let event = match &stopping {
            Stopping::GpuFailed { .. } => Some(EventKind::GpuFailed),
            Stopping::DriverRefused { .. } => Some(EventKind::DriverRefused),
            _ if task.reason == TaskReason::Hung => Some(EventKind::Hung),
            _ if task.reason == TaskReason::LivenessFailed => Some(EventKind::Unhealthy),
            // What follows says it when the attempt ends.
            _ => None,
        };
        if let Some(job) = self.jobs.get_mut(job_id) {
            job.stopping = Some(stopping);
            if let Some(kind) = event {
                job.events.record(kind, message.clone(), at_ms);
            }
        }
        let why = format!("stopped: {message}");
        self.kill_live(&others, &why, None, at_ms);
    }

    /// A task ended because a GPU failed: its job avoids the GPUs the
    /// agent names (all of the task's when it names none).
    pub(super) fn avoid_failed_gpus(&mut self, task_id: &str, failed: &[String], at_ms: u64) {
        let Some(task) = self.tasks.get(task_id) else {
            return;
        };
        let gpus = if failed.is_empty() {
            task.gpu_uuids.clone()
        } else {
            failed.to_vec()
        };
        let job_id = task.job_id.clone();
        if let Some(job) = self.jobs.get_mut(&job_id) {
            if job.state.is_terminal() {
                return;
            }
            for g in &gpus {
                job.avoid_gpu(g, at_ms);
            }
        }
    }

    /// Asks the agents to stop the given tasks that still run.
    pub(super) fn kill_live(
        &mut self,
        tasks: &[String],
        why: &str,
        reason: Option<TaskReason>,
        at_ms: u64,
    ) {
        for id in tasks {
            if let Some(t) = self.tasks.get_mut(id) {
                if t.state.is_terminal() || t.kill_requested {
                    continue;
                }
                t.kill_requested = true;
                t.updated_at_ms = at_ms;
                t.message = why.to_string();
                if let Some(r) = reason {
                    t.reason = r;
                }
            }
        }
    }

    /// Restarts a running elastic gang to grow it: its ranks are stopped
    /// and, once all have ended, it is queued again without using a retry,
    /// to be placed with as many ranks as fit, up to `to` (the leader saw
    /// room for more; see `scheduler::elastic`).
    pub(super) fn grow_job(
        &mut self,
        job_id: &str,
        to: u32,
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        let job = self.stoppable(job_id)?;
        let from = job.world();
        if !job.spec.is_elastic() {
            return Err(ApplyError::Invalid {
                field: "job_id".into(),
                reason: format!("job {job_id} is not an elastic gang (--replicas MIN:MAX)"),
            });
        }
        if job.state != JobState::Running || to <= from || to > job.spec.replicas() {
            return Err(ApplyError::Invalid {
                field: "to".into(),
                reason: format!(
                    "job {job_id} runs {from} of {} ranks ({:?}): cannot grow to {to}",
                    job.spec.replicas(),
                    job.state
                ),
            });
        }
        let live = job.current_tasks().to_vec();
        if let Some(job) = self.jobs.get_mut(job_id) {
            job.stopping = Some(Stopping::Growing { from, to });
            job.updated_at_ms = at_ms;
            job.events.record(
                EventKind::Growing,
                format!("GPUs free for more ranks: restarting its {from} ranks to grow up to {to}"),
                at_ms,
            );
        }
        let why = format!("stopped to grow the gang from {from} ranks");
        self.kill_live(&live, &why, None, at_ms);
        Ok(Outcome::Done)
    }

    /// Cancels a job: at once when queued, else its live tasks are killed
    /// and it ends CANCELLED when the last has ended.
    pub(super) fn cancel_job(&mut self, job_id: &str, at_ms: u64) -> Result<Outcome, ApplyError> {
        let job = self
            .jobs
            .get_mut(job_id)
            .ok_or_else(|| ApplyError::JobNotFound(job_id.to_string()))?;
        if job.state.is_terminal() {
            return Ok(Outcome::JobCancelled { state: job.state });
        }
        job.cancel_requested = true;
        job.updated_at_ms = at_ms;
        if job.state == JobState::Queued {
            job.state = JobState::Cancelled;
            job.message = "cancelled before it started".into();
            job.events
                .record(EventKind::Cancelled, job.message.clone(), at_ms);
            return Ok(Outcome::JobCancelled {
                state: JobState::Cancelled,
            });
        }
        job.events.record(
            EventKind::Cancelling,
            "cancel asked: stopping its tasks",
            at_ms,
        );
        let live = job.current_tasks().to_vec();
        self.kill_live(&live, "cancelled", None, at_ms);
        // Its end is decided: CANCELLED once its tasks have stopped.
        Ok(Outcome::JobCancelled {
            state: JobState::Cancelled,
        })
    }
}

/// Names joined with ", ", at most a few (an event's message is short).
fn join_cut(names: &BTreeSet<&str>) -> String {
    const MAX: usize = 8;
    let mut s: Vec<&str> = names.iter().take(MAX).copied().collect();
    if names.len() > MAX {
        s.push("...");
    }
    s.join(", ")
}

/// A preempted or reclaimed job's message.
fn stopped_for(by: &str, reclaimed_for: Option<&str>) -> String {
    match reclaimed_for {
        Some(tenant) => format!("reclaimed for tenant {tenant} by {by}"),
        None => format!("preempted by {by}"),
    }
}

/// What a failed task says, for its job's message; a rank of a gang of
/// `replicas` is named as such (the first to fail is what `jobs wait`
/// shows).
fn failure_message(t: &TaskRecord, replicas: u32) -> String {
    let who = if replicas > 1 {
        format!("rank {} of {replicas}: task {}", t.rank, t.id)
    } else {
        format!("task {}", t.id)
    };
    if matches!(
        t.reason,
        TaskReason::GpuUnhealthy | TaskReason::GpuMemoryLimit
    ) {
        return format!("{who} failed: {}", t.message);
    }
    if t.reason == TaskReason::DriverRequirementUnmet {
        return format!("{who} refused by agent {}: {}", t.agent_id, t.message);
    }
    if t.reason == TaskReason::Fenced {
        return format!(
            "{who} was stopped by its agent's fence (no leader for too long): {}",
            t.message
        );
    }
    match (t.state, t.exit_code) {
        // The agent's words say how it ended (a signal, an OOM kill).
        (TaskState::Finished | TaskState::Failed, Some(c)) if t.message.is_empty() => {
            format!("{who} exited with code {c}")
        }
        (TaskState::Finished | TaskState::Failed, Some(_)) => format!("{who} {}", t.message),
        (TaskState::Killed, _) => format!("{who} was killed"),
        (TaskState::Lost, _) => format!("{who} lost: {}", t.message),
        (TaskState::Error, _) => format!("{who} error: {}", t.message),
        _ => format!("{who} failed: {}", t.message),
    }
}

impl State {
    /// A job queued (or, for a request id seen before, the job it made).
    pub(super) fn submit_job(
        &mut self,
        spec: &gpuctl_core::types::JobSpec,
        at_ms: u64,
        request_id: Option<&str>,
    ) -> Result<Outcome, ApplyError> {
        if let Some(key) = request_id {
            if let Some(job_id) = self.resubmitted(key, spec, Some(at_ms))? {
                return Ok(Outcome::JobSubmitted {
                    job_id: job_id.clone(),
                });
            }
        }
        // Forget keys older than the TTL (by the proposer's clock,
        // carried in the command, so every master forgets the same).
        super::requests::forget_expired(
            &mut self.submit_requests,
            &mut self.submit_request_order,
            at_ms,
            super::requests::MAX_REMEMBERED,
        );
        let job_id = format!("job-{}", self.next_job_seq);
        if let Some(key) = request_id {
            super::requests::remember(
                &mut self.submit_requests,
                &mut self.submit_request_order,
                key,
                job_id.clone(),
                at_ms,
            );
        }
        self.next_job_seq += 1;
        self.jobs.insert(
            job_id.clone(),
            JobRecord {
                id: job_id.clone(),
                spec: spec.clone(),
                state: JobState::Queued,
                submitted_at_ms: at_ms,
                updated_at_ms: at_ms,
                task_ids: Vec::new(),
                cancel_requested: false,
                message: String::new(),
                retries: 0,
                preemptions: 0,
                stopping: None,
                preempted_by: None,
                image_requires: Vec::new(),
                events: Default::default(),
                world: 0,
                not_before_ms: 0,
                avoid_gpus: Vec::new(),
                idle_since_ms: None,
                forgotten_tasks: 0,
            },
        );
        self.job_event(
            &job_id,
            EventKind::Queued,
            super::events::queued_words(spec),
            at_ms,
        );
        Ok(Outcome::JobSubmitted { job_id })
    }

    /// The built-in scheduler's round: each job launched whole or refused
    /// whole, the others unaffected.
    pub(super) fn launch_jobs(
        &mut self,
        jobs: &[Vec<Launch>],
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        let mut refused = Vec::new();
        for launches in jobs {
            // Checked whole before anything changes: a refused
            // job leaves nothing behind.
            if let Err(e) = self.launch_tasks(launches, at_ms) {
                let job = launches
                    .first()
                    .map(|l| l.job_id.clone())
                    .unwrap_or_default();
                refused.push((job, e.to_string()));
            }
        }
        Ok(Outcome::JobsLaunched { refused })
    }
}

/// Said of a job put back in the queue for what was not its own failure.
const NO_RETRY: &str = "back in the queue (no retry used)";

/// Every task of the attempt ended: the job's next state, its message and
/// the event that says so.
fn end_attempt(job: &mut JobRecord, all_ok: bool, task_count: usize, at_ms: u64) {
    let stopping = job.stopping.take();
    let mut event = None;
    // A cancel decides the end once committed: a task that exits 0 on
    // the SIGTERM does not make the job SUCCEEDED (as Slurm's scancel).
    let (state, message) = if job.cancel_requested {
        (JobState::Cancelled, "cancelled".to_string())
    } else if let Some(Stopping::IdleStopped { message }) = stopping {
        (JobState::Cancelled, message)
    } else if let Some(Stopping::Growing { from, to }) = stopping {
        // Stopped to grow: whatever its ranks exited with on the
        // SIGTERM (a trainer may save and exit 0), it starts again.
        event = Some((
            EventKind::Requeued,
            format!("to grow from {from} to up to {to} ranks: {NO_RETRY}"),
        ));
        (
            JobState::Queued,
            format!("restarting to grow from {from} ranks"),
        )
    } else if all_ok && job.spec.restart_policy == RestartPolicy::Always {
        // A service's replica that exits 0 is started again all the same.
        let stopping = Some(Stopping::Failed {
            message: "exited with code 0".into(),
            retry: true,
        });
        stopped_outcome(job, stopping, &mut event, at_ms)
    } else if all_ok {
        event = Some((
            EventKind::Succeeded,
            match task_count {
                1 => "exited with code 0".to_string(),
                n => format!("all {n} tasks exited with code 0"),
            },
        ));
        (JobState::Succeeded, String::new())
    } else {
        stopped_outcome(job, stopping, &mut event, at_ms)
    };
    // The event of the outcome; its message says what the job's does
    // not already (the exit code, the retry count).
    let (kind, words) = event.unwrap_or_else(|| match state {
        JobState::Cancelled => (EventKind::Cancelled, message.clone()),
        JobState::Queued => (EventKind::Requeued, format!("{message}: {NO_RETRY}")),
        _ => (EventKind::Failed, message.clone()),
    });
    job.events.record(kind, words, at_ms);
    if state.is_terminal() {
        job.avoid_gpus.clear();
    }
    // A new attempt is watched afresh.
    job.idle_since_ms = None;
    job.state = state;
    job.message = message;
}

/// How an attempt that neither succeeded nor was cancelled ends, by what
/// stopped it; `event` is set when the outcome has words of its own.
fn stopped_outcome(
    job: &mut JobRecord,
    stopping: Option<Stopping>,
    event: &mut Option<(EventKind, String)>,
    at_ms: u64,
) -> (JobState, String) {
    match stopping {
        Some(Stopping::Preempted {
            by,
            requeue: true,
            reclaimed_for,
        }) => {
            job.preempted_by = Some(by.clone());
            (JobState::Queued, stopped_for(&by, reclaimed_for.as_deref()))
        }
        Some(Stopping::Preempted {
            by,
            requeue: false,
            reclaimed_for,
        }) => (
            JobState::Failed,
            format!(
                "{} (submitted with --no-requeue)",
                stopped_for(&by, reclaimed_for.as_deref())
            ),
        ),
        Some(Stopping::Failed {
            message,
            retry: true,
        }) if job.spec.restart_policy == RestartPolicy::Always => {
            *event = Some(super::services::restart_replica(job, &message, at_ms));
            (JobState::Queued, message)
        }
        Some(Stopping::Failed {
            message,
            retry: true,
        }) => {
            job.retries += 1;
            let pause = job.spec.restart_backoff(job.retries);
            // 0: at once, whatever the placer's clock says.
            job.not_before_ms = if pause == 0 {
                0
            } else {
                at_ms.saturating_add(pause)
            };
            *event = Some((
                EventKind::Retrying,
                format!(
                    "{message}; retry {} of {} in {}s",
                    job.retries,
                    job.spec.max_retries,
                    pause as f64 / 1000.0
                ),
            ));
            (JobState::Queued, message)
        }
        Some(Stopping::Failed {
            message,
            retry: false,
        }) => (JobState::Failed, message),
        Some(Stopping::GpuFailed {
            message,
            requeue: true,
        }) => {
            let avoiding: BTreeSet<&str> = job.avoid_gpus.iter().map(|a| a.uuid.as_str()).collect();
            let avoid = if avoiding.is_empty() {
                String::new()
            } else {
                format!(
                    "; avoiding GPU {} until it is back in service (at most {} min)",
                    join_cut(&avoiding),
                    super::AVOID_GPU_MS / 60_000
                )
            };
            *event = Some((
                EventKind::Requeued,
                format!("after its GPU failed: {NO_RETRY}{avoid}"),
            ));
            (JobState::Queued, message)
        }
        Some(Stopping::GpuFailed {
            message,
            requeue: false,
        }) => (
            JobState::Failed,
            format!("{message} (submitted with --no-requeue)"),
        ),
        Some(Stopping::Drained {
            agent_id,
            requeue: true,
        }) => (JobState::Queued, format!("agent {agent_id} drained")),
        Some(Stopping::Drained {
            agent_id,
            requeue: false,
        }) => (
            JobState::Failed,
            format!("agent {agent_id} drained (submitted with --no-requeue)"),
        ),
        // Handled before the exits are looked at.
        Some(Stopping::IdleStopped { message }) => (JobState::Cancelled, message),
        Some(Stopping::Growing { from, .. }) => (
            JobState::Queued,
            format!("restarting to grow from {from} ranks"),
        ),
        Some(Stopping::DriverRefused { message }) => {
            *event = Some((
                EventKind::Requeued,
                format!("to be placed where the driver qualifies: {NO_RETRY}"),
            ));
            (JobState::Queued, message)
        }
        Some(Stopping::RuntimeRestarted {
            message,
            requeue: true,
        }) => {
            *event = Some((
                EventKind::Requeued,
                format!("after its container runtime restarted under it: {NO_RETRY}"),
            ));
            (JobState::Queued, message)
        }
        Some(Stopping::RuntimeRestarted {
            message,
            requeue: false,
        }) => (
            JobState::Failed,
            format!("{message} (submitted with --no-requeue)"),
        ),
        // Not reached: the first failure sets `stopping`.
        None => (JobState::Failed, "attempt ended".to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::testkit::{status, Driver};
    use crate::state::Command;
    use gpuctl_core::types::{JobSpec, Resources, StatusUpdate};

    /// The shared driver, and what these tests add to it.
    struct T(Driver);

    impl std::ops::Deref for T {
        type Target = Driver;
        fn deref(&self) -> &Driver {
            &self.0
        }
    }

    impl std::ops::DerefMut for T {
        fn deref_mut(&mut self) -> &mut Driver {
            &mut self.0
        }
    }

    impl T {
        fn new(agents: &[(&str, u32)]) -> T {
            T(Driver::new(agents))
        }
        fn submit(&mut self, spec: JobSpec) -> String {
            let at_ms = self.i;
            match self.apply(Command::SubmitJob {
                spec,
                at_ms,
                request_id: None,
            }) {
                Ok(Outcome::JobSubmitted { job_id }) => job_id,
                o => panic!("{o:?}"),
            }
        }
        fn launch(&mut self, job: &str, at: &[(&str, &[&str])]) -> Result<Outcome, ApplyError> {
            let at_ms = self.i;
            self.launch_at(job, at, at_ms)
        }
        fn report(&mut self, task: &str, state: TaskState, code: Option<i32>) {
            let mut update = status(&self.s.tasks[task].agent_id, task, state);
            update.exit_code = code;
            let at_ms = self.i;
            self.apply(Command::UpdateTaskStatus { update, at_ms })
                .unwrap();
        }
        /// The agent stopped the task because its GPU failed.
        fn report_gpu_failure(&mut self, task: &str, gpu: &str) {
            let mut update = status(&self.s.tasks[task].agent_id, task, TaskState::Failed);
            update.message = format!("GPU {gpu} unhealthy: XID 79 (GPU has fallen off the bus)");
            update.gpu_unhealthy = true;
            let at_ms = self.i;
            self.apply(Command::UpdateTaskStatus { update, at_ms })
                .unwrap();
        }
        fn job(&self, id: &str) -> &crate::state::JobRecord {
            &self.s.jobs[id]
        }
        /// The agent refused to start the task: its driver does not meet
        /// what the image requires.
        fn refusal(&self, task: &str, requires: &[&str]) -> StatusUpdate {
            let mut update = status(&self.s.tasks[task].agent_id, task, TaskState::Failed);
            update.message = format!(
                "image cuda:12.2 requires {} (NVIDIA_REQUIRE_CUDA); this agent has \
                 driver 470.57.02, CUDA 11.4",
                requires[0]
            );
            update.requires = requires.iter().map(|r| r.to_string()).collect();
            update.uuid = format!("{task}-refused").into_bytes();
            update
        }
        fn report_refusal(&mut self, task: &str, requires: &[&str]) -> Outcome {
            let update = self.refusal(task, requires);
            let at_ms = self.i;
            self.apply(Command::UpdateTaskStatus { update, at_ms })
                .unwrap()
        }
        fn learned(&self, job: &str) -> Vec<&str> {
            self.job(job)
                .image_requires
                .iter()
                .map(|e| e.text())
                .collect()
        }
    }

    const CUDA_12_2: &str = "cuda>=12.2 brand=tesla,driver>=470,driver<471";

    fn spec(gpus: u32, replicas: u32) -> JobSpec {
        let mut s = JobSpec::new(
            "j",
            vec!["true".into()],
            Resources {
                cpus: 1.0,
                mem_mib: 0,
                gpus,
                ports: 0,
            },
        );
        s.replicas = replicas;
        s
    }

    #[test]
    fn a_gang_launches_whole_with_ranks_and_peer_env() {
        let mut t = T::new(&[("a", 2), ("b", 2)]);
        let j = t.submit(spec(1, 3));
        // Fewer launches than replicas: refused, nothing changes.
        let before = t.s.clone();
        let err = t
            .launch(&j, &[("a", &["GPU-a-0"]), ("b", &["GPU-b-0"])])
            .unwrap_err();
        assert!(err.to_string().contains("3 replicas, 2 launched"), "{err}");
        assert_eq!(t.s.jobs, before.jobs);
        assert!(t.s.gpu_owner.is_empty());
        t.launch(
            &j,
            &[
                ("b", &["GPU-b-0"]),
                ("a", &["GPU-a-0"]),
                ("a", &["GPU-a-1"]),
            ],
        )
        .unwrap();
        let ranks: Vec<(String, u32)> = t
            .job(&j)
            .current_tasks()
            .iter()
            .map(|id| (t.s.tasks[id].agent_id.clone(), t.s.tasks[id].rank))
            .collect();
        assert_eq!(
            ranks,
            vec![("b".into(), 0), ("a".into(), 1), ("a".into(), 2)]
        );
        let (run, _) = t.s.desired_tasks("a");
        assert_eq!(run.len(), 2);
        for task in &run {
            assert_eq!(task.template.env["GPUCTL_WORLD_SIZE"], "3");
            assert_eq!(task.template.env["GPUCTL_PEERS"], "b.host,a.host,a.host");
        }
        let mut r: Vec<&str> = run
            .iter()
            .map(|t| t.template.env["GPUCTL_RANK"].as_str())
            .collect();
        r.sort();
        assert_eq!(r, vec!["1", "2"]);
        // RUNNING only once every rank runs.
        t.report("job-1.0", TaskState::Running, None);
        t.report("job-1.1", TaskState::Running, None);
        assert_eq!(t.job(&j).state, JobState::Starting);
        t.report("job-1.2", TaskState::Running, None);
        assert_eq!(t.job(&j).state, JobState::Running);
        // SUCCEEDED only once every rank exited 0.
        t.report("job-1.0", TaskState::Finished, Some(0));
        t.report("job-1.1", TaskState::Finished, Some(0));
        assert_eq!(t.job(&j).state, JobState::Running);
        t.report("job-1.2", TaskState::Finished, Some(0));
        assert_eq!(t.job(&j).state, JobState::Succeeded);
        assert!(t.s.gpu_owner.is_empty());
    }

    /// An elastic gang (2:4) starts with 2 to 4 ranks, its env says the
    /// attempt's size, and growing restarts it (whatever its ranks exit
    /// with on the SIGTERM) without using a retry.
    #[test]
    fn an_elastic_gang_starts_with_what_fits_and_grows_by_a_restart() {
        let mut t = T::new(&[("a", 2), ("b", 2)]);
        let mut s = spec(1, 4);
        s.min_replicas = Some(2);
        s.template.resources.ports = 1;
        let j = t.submit(s);
        let err = t.launch(&j, &[("a", &["GPU-a-0"])]).unwrap_err();
        assert!(
            err.to_string()
                .contains("2 to 4 replicas (elastic), 1 launched"),
            "{err}"
        );
        t.launch(
            &j,
            &[
                ("a", &["GPU-a-0"]),
                ("a", &["GPU-a-1"]),
                ("b", &["GPU-b-0"]),
            ],
        )
        .unwrap();
        assert_eq!(t.job(&j).world(), 3);
        assert_eq!(t.job(&j).current_tasks().len(), 3);
        let (run, _) = t.s.desired_tasks("a");
        for task in &run {
            for (k, v) in [
                ("WORLD_SIZE", "3"),
                ("GPUCTL_WORLD_SIZE", "3"),
                ("GPUCTL_MIN_REPLICAS", "2"),
                ("GPUCTL_MAX_REPLICAS", "4"),
                ("PET_NNODES", "3"),
            ] {
                assert_eq!(task.template.env[k], v, "{k}");
            }
            assert_eq!(
                task.template.env["PET_NODE_RANK"],
                task.template.env["RANK"]
            );
        }
        // Not running yet: nothing to grow.
        let err = t
            .apply(Command::GrowJob {
                job_id: j.clone(),
                to: 4,
                at_ms: 5,
            })
            .unwrap_err();
        assert!(err.to_string().contains("cannot grow to 4"), "{err}");
        for i in 0..3 {
            t.report(&format!("{j}.{i}"), TaskState::Running, None);
        }
        assert_eq!(t.job(&j).state, JobState::Running);
        // Past its most, or not more: refused.
        for to in [5, 3] {
            assert!(t
                .apply(Command::GrowJob {
                    job_id: j.clone(),
                    to,
                    at_ms: 6
                })
                .is_err());
        }
        t.apply(Command::GrowJob {
            job_id: j.clone(),
            to: 4,
            at_ms: 7,
        })
        .unwrap();
        assert!(t
            .job(&j)
            .current_tasks()
            .iter()
            .all(|id| t.s.tasks[id].kill_requested));
        // A rank that saves and exits 0 on the SIGTERM does not end it.
        t.report(&format!("{j}.0"), TaskState::Finished, Some(0));
        t.report(&format!("{j}.1"), TaskState::Killed, None);
        assert_eq!(t.job(&j).state, JobState::Running);
        t.report(&format!("{j}.2"), TaskState::Finished, Some(0));
        let job = t.job(&j);
        assert_eq!(job.state, JobState::Queued);
        assert_eq!(job.retries, 0, "growing uses no retry");
        assert!(job.message.contains("grow from 3 ranks"), "{}", job.message);
        let kinds: Vec<&str> = job.events.iter().map(|e| e.kind.as_str()).collect();
        assert!(kinds.ends_with(&["Growing", "Requeued"]), "{kinds:?}");
        assert!(t.s.gpu_owner.is_empty());
        t.launch(
            &j,
            &[
                ("a", &["GPU-a-0"]),
                ("a", &["GPU-a-1"]),
                ("b", &["GPU-b-0"]),
                ("b", &["GPU-b-1"]),
            ],
        )
        .unwrap();
        assert_eq!(t.job(&j).world(), 4);
        assert_eq!(
            t.job(&j).current_tasks(),
            [
                format!("{j}.3"),
                format!("{j}.4"),
                format!("{j}.5"),
                format!("{j}.6")
            ]
        );
        let (run, _) = t.s.desired_tasks("b");
        assert!(run
            .iter()
            .all(|task| task.template.env["WORLD_SIZE"] == "4"));
        // A fixed gang is never grown.
        let fixed = t.submit(spec(0, 1));
        t.launch(&fixed, &[("a", &[])]).unwrap();
        let err = t
            .apply(Command::GrowJob {
                job_id: fixed,
                to: 2,
                at_ms: 9,
            })
            .unwrap_err();
        assert!(err.to_string().contains("not an elastic gang"), "{err}");
    }

    /// Host ports come from the agent's range, lowest free first, never
    /// to two tasks holding resources at once, and are free again once a
    /// task ends. A launch asking more than are free is refused whole.
    #[test]
    fn host_ports_are_given_once_and_freed_at_the_end() {
        let mut t = T::new(&[("a", 0)]);
        let ported = |n: u32| {
            let mut s = spec(0, 1);
            s.template.resources.ports = n;
            s
        };
        let ports = |t: &T, task: &str| t.s.tasks[task].ports.clone();
        let j1 = t.submit(ported(3));
        let j2 = t.submit(ported(3));
        let mut named = ported(5);
        named.template.options.port = vec!["http".into(), "grpc-api".into()];
        let j3 = t.submit(named);
        t.launch(&j1, &[("a", &[])]).unwrap();
        t.launch(&j2, &[("a", &[])]).unwrap();
        assert_eq!(ports(&t, "job-1.0"), [31000, 31001, 31002]);
        assert_eq!(ports(&t, "job-2.0"), [31003, 31004, 31005]);
        // 4 of 10 left: refused, nothing changes.
        let before = t.s.clone();
        let err = t.launch(&j3, &[("a", &[])]).unwrap_err();
        assert!(err.to_string().contains("4 ports free"), "{err}");
        assert_eq!((&t.s.jobs, &t.s.tasks), (&before.jobs, &before.tasks));
        // job-1 ends: its ports go to job-3, lowest first.
        t.report("job-1.0", TaskState::Finished, Some(0));
        t.launch(&j3, &[("a", &[])]).unwrap();
        assert_eq!(ports(&t, "job-3.0"), [31000, 31001, 31002, 31006, 31007]);
        let (run, _) = t.s.desired_tasks("a");
        let env = |id: &str| {
            run.iter()
                .find(|r| r.task_id == id)
                .unwrap()
                .template
                .env
                .clone()
        };
        assert_eq!(
            env("job-3.0")["GPUCTL_PORTS"],
            "31000,31001,31002,31006,31007"
        );
        // Named ports are its first ones, in order.
        assert_eq!(env("job-3.0")["GPUCTL_PORT_HTTP"], "31000");
        assert_eq!(env("job-3.0")["GPUCTL_PORT_GRPC_API"], "31001");
        // A single task is its own rank 0.
        assert_eq!(env("job-3.0")["MASTER_PORT"], "31000");
        assert_eq!(env("job-3.0")["MASTER_ADDR"], "a.host");
        assert_eq!(env("job-3.0")["WORLD_SIZE"], "1");
        assert_eq!(t.s.agent("a").unwrap().allocated.ports, 8);
        assert!(
            t.s.invariant_violations().is_empty(),
            "{:?}",
            t.s.invariant_violations()
        );
        // A snapshot (a new leader, a restarted master) keeps them.
        let back: State = serde_json::from_slice(&serde_json::to_vec(&t.s).unwrap()).unwrap();
        assert_eq!(back, t.s);
        // The agent restarts with its tasks running: they keep their
        // ports, and the next launch goes around them.
        let mut again = crate::state::testkit::register("a", 0);
        if let Command::RegisterAgent {
            running_task_ids, ..
        } = &mut again
        {
            *running_task_ids = vec!["job-2.0".into(), "job-3.0".into()];
        }
        t.apply(again).unwrap();
        assert_eq!(ports(&t, "job-2.0"), [31003, 31004, 31005]);
        let j4 = t.submit(ported(2));
        t.launch(&j4, &[("a", &[])]).unwrap();
        assert_eq!(ports(&t, "job-4.0"), [31008, 31009]);
        assert!(t.s.invariant_violations().is_empty());
        // A job without ports gets no GPUCTL_PORTS and no MASTER_PORT.
        let j5 = t.submit(ported(0));
        t.launch(&j5, &[("a", &[])]).unwrap();
        let (run, _) = t.s.desired_tasks("a");
        let e4 = &run
            .iter()
            .find(|r| r.task_id == "job-5.0")
            .unwrap()
            .template
            .env;
        assert!(!e4.contains_key("GPUCTL_PORTS") && !e4.contains_key("MASTER_PORT"));
        assert_eq!(e4["RANK"], "0");
    }

    /// A gang's ranks get PyTorch's variables: rank 0's agent address and
    /// first port, ranks local to each agent, agents in order of their
    /// lowest rank. Two ranks on one agent hold different ports. The job's
    /// own value of such a name wins.
    #[test]
    fn a_gang_gets_torchrun_variables() {
        let mut t = T::new(&[("a", 2), ("b", 2)]);
        let mut s = spec(1, 3);
        s.template.resources.ports = 1;
        s.template.env.insert("LOCAL_WORLD_SIZE".into(), "8".into());
        let j = t.submit(s);
        t.launch(
            &j,
            &[
                ("b", &["GPU-b-0"]),
                ("a", &["GPU-a-0"]),
                ("a", &["GPU-a-1"]),
            ],
        )
        .unwrap();
        let mut envs = std::collections::BTreeMap::new();
        for agent in ["a", "b"] {
            for task in t.s.desired_tasks(agent).0 {
                envs.insert(task.template.env["RANK"].clone(), task.template.env);
            }
        }
        let get = |rank: &str, k: &str| envs[rank][k].as_str();
        for rank in ["0", "1", "2"] {
            assert_eq!(get(rank, "MASTER_ADDR"), "b.host");
            assert_eq!(get(rank, "MASTER_PORT"), "31000");
            assert_eq!(get(rank, "WORLD_SIZE"), "3");
            assert_eq!(get(rank, "GPUCTL_RANK"), rank);
            assert_eq!(get(rank, "LOCAL_WORLD_SIZE"), "8", "the job's own");
        }
        assert_eq!(
            ["0", "1", "2"].map(|r| (get(r, "NODE_RANK"), get(r, "LOCAL_RANK"))),
            [("0", "0"), ("1", "0"), ("1", "1")]
        );
        assert_eq!(
            ["0", "1", "2"].map(|r| get(r, "GPUCTL_PORTS")),
            ["31000", "31000", "31001"]
        );
        assert!(t.s.invariant_violations().is_empty());
    }

    #[test]
    fn agent_hosts_come_from_the_advertised_address() {
        use gpuctl_core::types::AgentInfo;
        let info = |address: &str| {
            let mut i: AgentInfo = match crate::state::testkit::register("x", 0) {
                Command::RegisterAgent { info, .. } => info,
                _ => unreachable!(),
            };
            i.address = address.into();
            i
        };
        assert_eq!(crate::state::agent_host(&info("10.0.0.7:7051")), "10.0.0.7");
        assert_eq!(crate::state::agent_host(&info("[fd00::7]:7051")), "fd00::7");
        assert_eq!(crate::state::agent_host(&info("gpu7.lab:7051")), "gpu7.lab");
        assert_eq!(crate::state::agent_host(&info("0.0.0.0:7051")), "x.host");
        assert_eq!(crate::state::agent_host(&info("")), "x.host");
    }

    #[test]
    fn a_failed_rank_stops_the_gang_then_retries_then_fails() {
        let mut t = T::new(&[("a", 2)]);
        let mut s = spec(1, 2);
        s.max_retries = 1;
        let j = t.submit(s);
        t.launch(&j, &[("a", &["GPU-a-0"]), ("a", &["GPU-a-1"])])
            .unwrap();
        t.report("job-1.0", TaskState::Running, None);
        t.report("job-1.1", TaskState::Failed, Some(3));
        // Rank 0 is asked to stop; the job is not queued while it holds a GPU.
        assert!(t.s.tasks["job-1.0"].kill_requested);
        assert!(t.s.tasks["job-1.0"].message.contains("exited with code 3"));
        assert_eq!(t.job(&j).state, JobState::Starting);
        assert_eq!(t.s.gpu_owner.len(), 1);
        let (run, kill) = t.s.desired_tasks("a");
        assert!(run.is_empty());
        assert_eq!(kill, vec!["job-1.0".to_string()]);
        t.report("job-1.0", TaskState::Killed, None);
        assert_eq!(t.job(&j).state, JobState::Queued);
        assert_eq!(t.job(&j).retries, 1);
        assert!(t.job(&j).message.contains("job-1.1 exited with code 3"));
        // The second attempt: new tasks, new ranks.
        t.launch(&j, &[("a", &["GPU-a-1"]), ("a", &["GPU-a-0"])])
            .unwrap();
        assert_eq!(t.job(&j).current_tasks(), ["job-1.2", "job-1.3"]);
        assert_eq!(t.s.tasks["job-1.3"].rank, 1);
        // Two attempts of two ranks each, as `jobs logs --attempt` reads them.
        let attempts: Vec<Vec<(&str, u32)>> =
            t.s.attempts(&j)
                .iter()
                .map(|a| a.iter().map(|t| (t.id.as_str(), t.rank)).collect())
                .collect();
        assert_eq!(
            attempts,
            vec![
                vec![("job-1.0", 0), ("job-1.1", 1)],
                vec![("job-1.2", 0), ("job-1.3", 1)]
            ]
        );
        // A late update of the first attempt changes nothing.
        let before = t.job(&j).clone();
        t.report("job-1.0", TaskState::Finished, Some(0));
        assert_eq!(*t.job(&j), before);
        // No retries left: the next failure ends it.
        t.report("job-1.2", TaskState::Lost, None);
        t.report("job-1.3", TaskState::Killed, None);
        assert_eq!(t.job(&j).state, JobState::Failed);
        assert!(
            t.job(&j).message.contains("job-1.2 lost"),
            "{}",
            t.job(&j).message
        );
        assert_eq!(t.job(&j).retries, 1);
    }

    #[test]
    fn a_driver_refusal_teaches_the_job_and_requeues_it_without_a_retry() {
        let mut t = T::new(&[("old", 1), ("new", 1)]);
        let mut s = spec(1, 1);
        s.no_requeue = true; // nothing of it ran: requeued all the same
        let j = t.submit(s);
        t.launch(&j, &[("old", &["GPU-old-0"])]).unwrap();
        t.report("job-1.0", TaskState::Starting, None);
        assert_eq!(t.report_refusal("job-1.0", &[CUDA_12_2]), Outcome::Done);
        let task = &t.s.tasks["job-1.0"];
        assert_eq!(task.state, TaskState::Failed);
        assert_eq!(task.reason, TaskReason::DriverRequirementUnmet);
        let job = t.job(&j);
        assert_eq!(job.state, JobState::Queued);
        assert_eq!(job.retries, 0, "a refusal is not a failed attempt");
        assert!(
            job.message
                .starts_with("task job-1.0 refused by agent old: image cuda:12.2 requires"),
            "{}",
            job.message
        );
        assert_eq!(t.learned(&j), [CUDA_12_2]);
        assert!(t.s.gpu_owner.is_empty());
        assert!(t.s.invariant_violations().is_empty());
        // The agent sends it again until acknowledged: learned once.
        let before = t.s.clone();
        let again = t.refusal("job-1.0", &[CUDA_12_2]);
        let at_ms = t.i;
        let o = t
            .apply(Command::UpdateTaskStatus {
                update: again,
                at_ms,
            })
            .unwrap();
        assert_eq!(o, Outcome::StaleUpdate);
        assert_eq!(t.s.jobs, before.jobs);
        assert_eq!(t.s.tasks, before.tasks);
        // A Raft snapshot is the state's serde form: what was learned
        // survives a restore (and a failover to a master that restored).
        let bytes = serde_json::to_vec(&t.s).unwrap();
        let restored: State = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(restored.jobs, t.s.jobs);
        assert_eq!(
            restored.jobs[&j].image_requires[0].text(),
            CUDA_12_2,
            "parsed again from its text"
        );
        // Placed on the new agent, it runs.
        t.launch(&j, &[("new", &["GPU-new-0"])]).unwrap();
        t.report("job-1.1", TaskState::Running, None);
        t.report("job-1.1", TaskState::Finished, Some(0));
        assert_eq!(t.job(&j).state, JobState::Succeeded);
    }

    #[test]
    fn a_refusal_that_teaches_nothing_is_a_failed_attempt() {
        let mut t = T::new(&[("old", 1)]);
        let mut s = spec(1, 1);
        s.max_retries = 1;
        let j = t.submit(s);
        t.launch(&j, &[("old", &["GPU-old-0"])]).unwrap();
        t.report_refusal("job-1.0", &[CUDA_12_2]);
        assert_eq!((t.job(&j).state, t.job(&j).retries), (JobState::Queued, 0));
        // Launched there again (master and agent disagree about its
        // driver), refused for the same: counted, so it cannot loop.
        t.launch(&j, &[("old", &["GPU-old-0"])]).unwrap();
        t.report_refusal("job-1.1", &[CUDA_12_2]);
        assert_eq!((t.job(&j).state, t.job(&j).retries), (JobState::Queued, 1));
        assert_eq!(
            t.s.tasks["job-1.1"].reason,
            TaskReason::ContainerLaunchFailed
        );
        // A new requirement besides the known one is learned, not counted.
        t.launch(&j, &[("old", &["GPU-old-0"])]).unwrap();
        t.report_refusal("job-1.2", &[CUDA_12_2, "driver>=535"]);
        assert_eq!((t.job(&j).state, t.job(&j).retries), (JobState::Queued, 1));
        assert_eq!(t.learned(&j), [CUDA_12_2, "driver>=535"]);
        // Unparsable: an ordinary failure; no retry left, so FAILED.
        t.launch(&j, &[("old", &["GPU-old-0"])]).unwrap();
        t.report_refusal("job-1.3", &["cuda>>12"]);
        assert_eq!(t.job(&j).state, JobState::Failed);
        assert_eq!(t.learned(&j), [CUDA_12_2, "driver>=535"]);
        assert!(
            t.job(&j).message.contains("job-1.3 error")
                || t.job(&j).message.contains("job-1.3 failed"),
            "{}",
            t.job(&j).message
        );
    }

    #[test]
    fn a_refusal_the_job_asked_for_itself_is_a_failed_attempt() {
        let mut t = T::new(&[("old", 1)]);
        let mut s = spec(1, 1);
        s.require_cuda = Some(gpuctl_core::cuda_req::Expr::parse("cuda>=12.2").unwrap());
        let j = t.submit(s);
        t.launch(&j, &[("old", &["GPU-old-0"])]).unwrap();
        t.report_refusal("job-1.0", &["cuda>=12.2"]);
        assert_eq!(t.job(&j).state, JobState::Failed);
        assert!(t.learned(&j).is_empty());
    }

    #[test]
    fn a_refused_rank_stops_the_gang_which_requeues_without_a_retry() {
        let mut t = T::new(&[("old", 1), ("old2", 1), ("new", 2)]);
        let j = t.submit(spec(1, 3));
        t.launch(
            &j,
            &[
                ("old", &["GPU-old-0"]),
                ("old2", &["GPU-old2-0"]),
                ("new", &["GPU-new-0"]),
            ],
        )
        .unwrap();
        t.report("job-1.2", TaskState::Running, None);
        t.report_refusal("job-1.0", &[CUDA_12_2]);
        // The running rank is asked to stop; the other refusal, the same
        // requirement, changes nothing the first did not decide.
        assert!(t.s.tasks["job-1.2"].kill_requested);
        t.report_refusal("job-1.1", &[CUDA_12_2]);
        assert_eq!(t.learned(&j), [CUDA_12_2]);
        assert_ne!(t.job(&j).state, JobState::Queued);
        t.report("job-1.2", TaskState::Killed, None);
        let job = t.job(&j);
        assert_eq!((job.state, job.retries), (JobState::Queued, 0));
        assert!(
            job.message.contains("job-1.0 refused by agent old"),
            "{}",
            job.message
        );
        assert!(t.s.gpu_owner.is_empty());
    }

    #[test]
    fn a_gpu_failure_requeues_the_gang_without_using_a_retry() {
        let mut t = T::new(&[("a", 2)]);
        let j = t.submit(spec(1, 2));
        t.launch(&j, &[("a", &["GPU-a-0"]), ("a", &["GPU-a-1"])])
            .unwrap();
        t.report("job-1.0", TaskState::Running, None);
        t.report("job-1.1", TaskState::Running, None);
        t.report_gpu_failure("job-1.1", "GPU-a-1");
        let failed = &t.s.tasks["job-1.1"];
        assert_eq!(failed.state, TaskState::Failed);
        assert_eq!(failed.reason, TaskReason::GpuUnhealthy);
        // The rest of the gang is stopped first.
        assert!(t.s.tasks["job-1.0"].kill_requested);
        assert_eq!(t.job(&j).state, JobState::Running);
        t.report("job-1.0", TaskState::Killed, None);
        // Back in the queue with no retries (max_retries is 0), none used.
        let job = t.job(&j);
        assert_eq!(job.state, JobState::Queued);
        assert_eq!(job.retries, 0);
        assert!(
            job.message
                .contains("task job-1.1 failed: GPU GPU-a-1 unhealthy: XID 79"),
            "{}",
            job.message
        );
        assert!(t.s.gpu_owner.is_empty());
    }

    #[test]
    fn a_requeued_job_avoids_the_failed_gpu_until_it_is_back_in_service() {
        let mut t = T::new(&[("a", 4)]);
        let j = t.submit(spec(2, 1));
        t.launch(&j, &[("a", &["GPU-a-0", "GPU-a-1"])]).unwrap();
        t.report("job-1.0", TaskState::Running, None);
        // The agent names the GPU that failed: only that one is avoided.
        let mut update = status("a", "job-1.0", TaskState::Failed);
        update.message = "GPU GPU-a-1 unhealthy: XID 79 (GPU has fallen off the bus)".into();
        update.gpu_unhealthy = true;
        update.failed_gpus = vec!["GPU-a-1".into()];
        t.apply(Command::UpdateTaskStatus {
            update,
            at_ms: 1000,
        })
        .unwrap();
        let job = t.job(&j);
        assert_eq!(job.state, JobState::Queued);
        let avoided: Vec<(&str, u64)> = job
            .avoid_gpus
            .iter()
            .map(|a| (a.uuid.as_str(), a.until_ms))
            .collect();
        assert_eq!(avoided, [("GPU-a-1", 1000 + crate::state::AVOID_GPU_MS)]);
        let requeued = job
            .events
            .iter()
            .filter(|e| e.kind == EventKind::Requeued)
            .last()
            .expect("a Requeued event");
        assert!(
            requeued.message.contains("avoiding GPU GPU-a-1"),
            "{}",
            requeued.message
        );
        // Another GPU coming back changes nothing; this one does.
        let back = |uuid: &str| Command::SetGpuHealth {
            agent_id: "a".into(),
            gpus: vec![crate::state::command::GpuHealthChange {
                uuid: uuid.into(),
                healthy: true,
                reason: String::new(),
            }],
            at_ms: 2000,
        };
        t.apply(back("GPU-a-2")).unwrap();
        assert_eq!(t.job(&j).avoid_gpus.len(), 1);
        t.apply(back("GPU-a-1")).unwrap();
        assert!(t.job(&j).avoid_gpus.is_empty());
        // An old agent names none: all of the task's GPUs are avoided.
        t.launch(&j, &[("a", &["GPU-a-2", "GPU-a-3"])]).unwrap();
        t.report_gpu_failure("job-1.1", "GPU-a-3");
        let mut avoided: Vec<&str> = t
            .job(&j)
            .avoid_gpus
            .iter()
            .map(|a| a.uuid.as_str())
            .collect();
        avoided.sort();
        assert_eq!(avoided, ["GPU-a-2", "GPU-a-3"]);
    }

    #[test]
    fn avoided_gpus_are_bounded_and_cleared_when_the_job_ends() {
        let mut t = T::new(&[("a", 1)]);
        let j = t.submit(spec(1, 1));
        let job = t.s.jobs.get_mut(&j).unwrap();
        for i in 0..(crate::state::MAX_AVOIDED_GPUS + 3) {
            job.avoid_gpu(&format!("GPU-x-{i}"), i as u64);
        }
        job.avoid_gpu("GPU-x-5", 99);
        assert_eq!(job.avoid_gpus.len(), crate::state::MAX_AVOIDED_GPUS);
        // The oldest went first; one named again moved to the end.
        assert_eq!(job.avoid_gpus[0].uuid, "GPU-x-3");
        assert_eq!(job.avoid_gpus.last().unwrap().uuid, "GPU-x-5");
        t.launch(&j, &[("a", &["GPU-a-0"])]).unwrap();
        t.report("job-1.0", TaskState::Finished, Some(0));
        assert_eq!(t.job(&j).state, JobState::Succeeded);
        assert!(t.job(&j).avoid_gpus.is_empty());
    }

    #[test]
    fn a_gpu_failure_fails_a_job_submitted_with_no_requeue() {
        let mut t = T::new(&[("a", 1)]);
        let mut s = spec(1, 1);
        s.no_requeue = true;
        s.max_retries = 3;
        let j = t.submit(s);
        t.launch(&j, &[("a", &["GPU-a-0"])]).unwrap();
        t.report_gpu_failure("job-1.0", "GPU-a-0");
        let job = t.job(&j);
        assert_eq!(job.state, JobState::Failed);
        assert!(job.message.contains("--no-requeue"), "{}", job.message);
        assert_eq!(job.retries, 0);
    }

    #[test]
    fn cancel_wins_over_retry() {
        let mut t = T::new(&[("a", 1)]);
        let mut s = spec(1, 1);
        s.max_retries = 5;
        let j = t.submit(s);
        t.launch(&j, &[("a", &["GPU-a-0"])]).unwrap();
        t.apply(Command::CancelJob {
            job_id: j.clone(),
            at_ms: 9,
        })
        .unwrap();
        t.report("job-1.0", TaskState::Killed, None);
        assert_eq!(t.job(&j).state, JobState::Cancelled);
        assert_eq!(t.job(&j).retries, 0);
    }

    #[test]
    fn a_committed_cancel_decides_the_end_and_is_answered_as_it() {
        let mut t = T::new(&[("a", 1)]);
        let j = t.submit(spec(1, 1));
        t.launch(&j, &[("a", &["GPU-a-0"])]).unwrap();
        t.report("job-1.0", TaskState::Running, None);
        let out = t
            .apply(Command::CancelJob {
                job_id: j.clone(),
                at_ms: 9,
            })
            .unwrap();
        assert_eq!(
            out,
            Outcome::JobCancelled {
                state: JobState::Cancelled
            }
        );
        assert_eq!(t.job(&j).state, JobState::Running, "until its task stops");
        // The task ends by itself before the kill reaches it: still
        // CANCELLED, as answered.
        t.report("job-1.0", TaskState::Finished, Some(0));
        assert_eq!(t.job(&j).state, JobState::Cancelled);
    }

    #[test]
    fn a_gangs_failure_names_the_rank_and_the_agents_words() {
        let mut t = T::new(&[("a", 2)]);
        let j = t.submit(spec(1, 2));
        t.launch(&j, &[("a", &["GPU-a-0"]), ("a", &["GPU-a-1"])])
            .unwrap();
        let mut update = status("a", "job-1.1", TaskState::Failed);
        update.exit_code = Some(137);
        update.message = "killed by signal 9 (SIGKILL)".into();
        t.apply(Command::UpdateTaskStatus { update, at_ms: 5 })
            .unwrap();
        t.report("job-1.0", TaskState::Killed, None);
        assert_eq!(t.job(&j).state, JobState::Failed);
        assert_eq!(
            t.job(&j).message,
            "rank 1 of 2: task job-1.1 killed by signal 9 (SIGKILL)"
        );
    }

    #[test]
    fn kill_reasons_reach_the_desired_set_and_the_spec_its_grace() {
        let mut t = T::new(&[("a", 4), ("b", 1)]);
        let mut s = spec(1, 1);
        s.template.stop_grace_ms = Some(60_000);
        s.template.checkpoint_dir = Some("/ckpt/low".into());
        let low = t.submit(s);
        let cancelled = t.submit(spec(1, 1));
        let drained = t.submit(spec(1, 1));
        t.launch(&low, &[("a", &["GPU-a-0"])]).unwrap();
        t.launch(&cancelled, &[("a", &["GPU-a-1"])]).unwrap();
        t.launch(&drained, &[("b", &["GPU-b-0"])]).unwrap();
        let spec_of = t.s.task_spec("job-1.0").unwrap();
        assert_eq!(spec_of.template.stop_grace_ms, Some(60_000));
        assert_eq!(
            spec_of.template.checkpoint_dir.as_deref(),
            Some("/ckpt/low")
        );
        let mut s = spec(4, 1);
        s.priority = 5;
        let high = t.submit(s);
        t.apply(Command::PreemptJobs {
            job_id: high,
            victims: vec![low.clone()],
            at_ms: 10,
        })
        .unwrap();
        t.apply(Command::CancelJob {
            job_id: cancelled,
            at_ms: 11,
        })
        .unwrap();
        t.apply(Command::DrainAgent {
            agent_id: "b".into(),
            kill: true,
            deadline_ms: None,
            at_ms: 12,
        })
        .unwrap();
        let kinds = |agent: &str| -> Vec<(String, String, String)> {
            t.s.desired_task_ids(agent)
                .1
                .into_iter()
                .map(|(id, n)| (id, n.kind, n.message))
                .collect()
        };
        assert_eq!(
            kinds("a"),
            [
                (
                    "job-1.0".to_string(),
                    "preempted".to_string(),
                    "preempted by job-4 (priority 5)".to_string()
                ),
                ("job-2.0".into(), "cancelled".into(), "cancelled".into()),
            ]
        );
        let b = kinds("b");
        assert_eq!((b[0].0.as_str(), b[0].1.as_str()), ("job-3.0", "drained"));
        assert!(b[0].2.contains("drain"), "{b:?}");
        // The full-set form keeps the ids.
        assert_eq!(t.s.desired_tasks("a").1, ["job-1.0", "job-2.0"]);
    }

    #[test]
    fn preemption_requeues_victims_or_fails_them_with_no_requeue() {
        let mut t = T::new(&[("a", 4)]);
        let low = t.submit(spec(2, 1));
        let mut s = spec(2, 1);
        s.no_requeue = true;
        let once = t.submit(s);
        t.launch(&low, &[("a", &["GPU-a-0", "GPU-a-1"])]).unwrap();
        t.launch(&once, &[("a", &["GPU-a-2", "GPU-a-3"])]).unwrap();
        let mut s = spec(4, 1);
        s.priority = 5;
        let high = t.submit(s);
        // Victims of equal or higher priority, unknown or queued: refused.
        let mut eq = spec(1, 1);
        eq.priority = 5;
        let queued = t.submit(eq);
        for victims in [
            vec![high.clone()],
            vec![queued.clone()],
            vec![],
            vec!["job-9".into()],
        ] {
            let before = t.s.clone();
            assert!(t
                .apply(Command::PreemptJobs {
                    job_id: high.clone(),
                    victims,
                    at_ms: 1,
                })
                .is_err());
            assert_eq!(t.s.jobs, before.jobs);
            assert_eq!(t.s.tasks, before.tasks);
        }
        t.apply(Command::PreemptJobs {
            job_id: high.clone(),
            victims: vec![low.clone(), once.clone()],
            at_ms: 10,
        })
        .unwrap();
        for task in ["job-1.0", "job-2.0"] {
            let task = &t.s.tasks[task];
            assert!(task.kill_requested);
            assert_eq!(task.reason, TaskReason::Preempted);
            assert_eq!(task.message, "preempted by job-3 (priority 5)");
        }
        // Already stopping: cannot be preempted twice.
        assert!(t
            .apply(Command::PreemptJobs {
                job_id: high.clone(),
                victims: vec![low.clone()],
                at_ms: 11,
            })
            .is_err());
        t.report("job-1.0", TaskState::Killed, None);
        t.report("job-2.0", TaskState::Killed, None);
        assert_eq!(t.job(&low).state, JobState::Queued);
        assert_eq!(t.job(&low).preempted_by.as_deref(), Some("job-3"));
        assert_eq!(t.job(&low).preemptions, 1);
        assert_eq!(t.job(&low).retries, 0, "preemption is not a retry");
        assert_eq!(t.job(&once).state, JobState::Failed);
        assert!(t.job(&once).message.contains("--no-requeue"));
        // The preemptor gets the GPUs; the victim runs again later.
        t.launch(
            &high,
            &[("a", &["GPU-a-0", "GPU-a-1", "GPU-a-2", "GPU-a-3"])],
        )
        .unwrap();
        t.report("job-3.0", TaskState::Finished, Some(0));
        t.launch(&low, &[("a", &["GPU-a-0", "GPU-a-1"])]).unwrap();
        assert_eq!(t.job(&low).preempted_by, None);
        assert_eq!(t.job(&low).current_tasks(), ["job-1.1"]);
    }

    #[test]
    fn a_victim_that_finishes_before_the_kill_succeeds() {
        let mut t = T::new(&[("a", 1)]);
        let low = t.submit(spec(1, 1));
        t.launch(&low, &[("a", &["GPU-a-0"])]).unwrap();
        let mut s = spec(1, 1);
        s.priority = 1;
        let high = t.submit(s);
        t.apply(Command::PreemptJobs {
            job_id: high,
            victims: vec![low.clone()],
            at_ms: 5,
        })
        .unwrap();
        t.report("job-1.0", TaskState::Finished, Some(0));
        assert_eq!(t.job(&low).state, JobState::Succeeded);
    }
}
