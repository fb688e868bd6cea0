//! Stopping running jobs for a waiting one: preemption by priority within
//! a tenant and reclaim across tenants, each victim checked before any is
//! stopped, so a plan that no longer holds changes nothing.

use std::collections::BTreeSet;

use gpuctl_core::types::JobState;

use super::events::EventKind;
use super::{ApplyError, Outcome, State, Stopping, TaskReason};

impl State {
    /// `victim`, if its attempt runs and is not already being stopped.
    pub(super) fn stoppable(&self, victim: &str) -> Result<&super::JobRecord, ApplyError> {
        let v = self
            .jobs
            .get(victim)
            .ok_or_else(|| ApplyError::JobNotFound(victim.to_string()))?;
        let live = v
            .current_tasks()
            .iter()
            .any(|t| self.tasks.get(t).is_some_and(|t| !t.state.is_terminal()));
        if v.state.is_terminal() || v.state == JobState::Queued || !live {
            return Err(invalid_victim(format!("job {victim} is not running")));
        }
        if v.stopping.is_some() || v.cancel_requested {
            return Err(invalid_victim(format!("job {victim} is already stopping")));
        }
        Ok(v)
    }

    /// Why a job may not preempt `victim`, if it may not: the victim must be
    /// a job of lower priority whose attempt runs and is not already being
    /// stopped.
    pub fn preemptible(&self, priority: i32, victim: &str) -> Result<(), ApplyError> {
        let v = self.stoppable(victim)?;
        if v.spec.priority >= priority {
            return Err(invalid_victim(format!(
                "job {victim} has priority {}, not lower than {priority}",
                v.spec.priority
            )));
        }
        Ok(())
    }

    /// Why a job of `tenant` may not reclaim `victim` at `at_ms`, if it may
    /// not: the victim must be another tenant's running job, not being
    /// stopped, that has run at least `min_runtime_ms` (no thrash). That
    /// its tenant is over its fair share is the scheduler's judgement
    /// (`scheduler::queue`), made on the state it proposed from.
    pub fn reclaimable(
        &self,
        tenant: &str,
        victim: &str,
        at_ms: u64,
        min_runtime_ms: u64,
    ) -> Result<(), ApplyError> {
        let v = self.stoppable(victim)?;
        if v.spec.tenant.name() == tenant {
            return Err(invalid_victim(format!(
                "job {victim} is tenant {tenant}'s own: its jobs are ordered by priority"
            )));
        }
        let ran = at_ms.saturating_sub(self.started_ms(v));
        if ran < min_runtime_ms {
            return Err(invalid_victim(format!(
                "job {victim} has run {} s, less than the minimum of {} s before a reclaim",
                ran / 1000,
                min_runtime_ms / 1000
            )));
        }
        Ok(())
    }

    /// When a job's current attempt started: its last task's launch.
    pub fn started_ms(&self, job: &super::JobRecord) -> u64 {
        job.current_tasks()
            .iter()
            .filter_map(|t| self.tasks.get(t))
            .map(|t| t.created_at_ms)
            .max()
            .unwrap_or(0)
    }

    pub(super) fn reclaim_jobs(
        &mut self,
        job_id: &str,
        victims: &[String],
        at_ms: u64,
        min_runtime_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        let job = self.queued_for_stopping(job_id, victims)?;
        let tenant = job.spec.tenant.name().to_string();
        for v in victims {
            self.reclaimable(&tenant, v, at_ms, min_runtime_ms)?;
        }
        let owners: BTreeSet<String> = victims
            .iter()
            .filter_map(|v| self.jobs.get(v))
            .map(|v| v.spec.tenant.name().to_string())
            .collect();
        let owners = owners.into_iter().collect::<Vec<_>>().join(", ");
        self.job_event(
            job_id,
            EventKind::Reclaiming,
            format!(
                "stopping {} of {owners} (over its fair share) for tenant {tenant}",
                victims.join(", ")
            ),
            at_ms,
        );
        let why = format!("reclaimed for tenant {tenant} by {job_id}");
        self.stop_victims(job_id, victims, &why, Some(&tenant), at_ms);
        Ok(Outcome::Done)
    }

    /// Stops the checked `victims` for `job_id`: preempted, or reclaimed
    /// for tenant `reclaimed_for`; their live tasks are killed with `why`.
    fn stop_victims(
        &mut self,
        job_id: &str,
        victims: &[String],
        why: &str,
        reclaimed_for: Option<&str>,
        at_ms: u64,
    ) {
        let (event, reason) = match reclaimed_for {
            Some(_) => (EventKind::Reclaimed, TaskReason::Reclaimed),
            None => (EventKind::Preempted, TaskReason::Preempted),
        };
        for v in victims {
            let Some(victim) = self.jobs.get_mut(v) else {
                continue; // checked by the caller
            };
            victim.stopping = Some(Stopping::Preempted {
                by: job_id.to_string(),
                requeue: !victim.spec.no_requeue,
                reclaimed_for: reclaimed_for.map(str::to_string),
            });
            victim.preemptions += 1;
            victim.updated_at_ms = at_ms;
            victim.events.record(event, why.to_string(), at_ms);
            let tasks = victim.current_tasks().to_vec();
            self.kill_live(&tasks, why, Some(reason), at_ms);
        }
    }

    /// `job_id`, queued, for which `victims` (distinct, not none) are to be
    /// stopped.
    fn queued_for_stopping(
        &self,
        job_id: &str,
        victims: &[String],
    ) -> Result<&super::JobRecord, ApplyError> {
        let job = self
            .jobs
            .get(job_id)
            .ok_or_else(|| ApplyError::JobNotFound(job_id.to_string()))?;
        if job.state != JobState::Queued || job.cancel_requested {
            return Err(ApplyError::JobNotQueued {
                job_id: job_id.to_string(),
                state: job.state,
            });
        }
        let unique: BTreeSet<&String> = victims.iter().collect();
        if victims.is_empty() || unique.len() != victims.len() {
            return Err(ApplyError::Invalid {
                field: "victims".into(),
                reason: "must be distinct and not empty".into(),
            });
        }
        Ok(job)
    }

    pub(super) fn preempt_jobs(
        &mut self,
        job_id: &str,
        victims: &[String],
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        let priority = self.queued_for_stopping(job_id, victims)?.spec.priority;
        for v in victims {
            self.preemptible(priority, v)?;
        }
        let why = format!("preempted by {job_id} (priority {priority})");
        let names = victims.join(", ");
        self.job_event(
            job_id,
            EventKind::Preempting,
            format!("stopping lower-priority {names} to make room"),
            at_ms,
        );
        self.stop_victims(job_id, victims, &why, None, at_ms);
        Ok(Outcome::Done)
    }
}

fn invalid_victim(reason: String) -> ApplyError {
    ApplyError::Invalid {
        field: "victims".into(),
        reason,
    }
}
