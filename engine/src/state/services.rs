//! Services: replicas that run until the service is deleted. Each replica
//! is a job of one task whose restart policy is `Always`, so the queue,
//! placement, quotas, fair share, preemption and events treat it as any
//! job; this file keeps which job is which replica, and how a replica is
//! restarted.

use serde::{Deserialize, Serialize};

use gpuctl_core::types::{JobId, ServiceSpec};

use super::events::{EventKind, Events};
use super::{ApplyError, JobRecord, Outcome, State, TaskRecord};

/// A replica that ran this long before it ended starts its backoff again
/// from the first pause (as Kubernetes' CrashLoopBackOff does after 10
/// minutes of running).
pub const REPLICA_BACKOFF_RESET_MS: u64 = 10 * 60 * 1000;
/// Tasks of a replica's job kept (its latest attempts'); older ended ones
/// that hold nothing are forgotten, so a replica restarted for months
/// does not grow the state.
pub const KEPT_REPLICA_TASKS: usize = 16;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceRecord {
    pub id: String,
    /// As created, with `replicas` as last scaled.
    pub spec: ServiceSpec,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    /// Its replicas' jobs, by replica index.
    pub replicas: Vec<JobId>,
    pub events: Events,
}

/// Where one replica of a service answers (`State::service_endpoints`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaEndpoint {
    pub replica: u32,
    pub job_id: JobId,
    pub task_id: String,
    pub agent_id: String,
    /// Its agent's address host (its hostname when it has none).
    pub host: String,
    /// The task's host port named by the template's first port name.
    pub port: Option<u16>,
    pub ready: bool,
}

/// `host` of `host:port` or `[v6]:port`; the whole when there is no port.
fn address_host(address: &str) -> &str {
    let host = match address.rsplit_once(':') {
        Some((h, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => address,
    };
    host.trim_start_matches('[').trim_end_matches(']')
}

impl State {
    /// The service's replicas whose task runs (not unreachable): where
    /// each answers and whether it is ready, by replica index.
    pub fn service_endpoints(&self, s: &ServiceRecord) -> Vec<ReplicaEndpoint> {
        let has_readiness = s.spec.template.template.options.readiness.is_some();
        let mut out = Vec::new();
        for (i, job_id) in s.replicas.iter().enumerate() {
            let Some(job) = self.jobs.get(job_id) else {
                continue;
            };
            for task in job.current_tasks().iter().filter_map(|t| self.tasks.get(t)) {
                if task.state != gpuctl_core::types::TaskState::Running {
                    continue;
                }
                let host = self.agents.get(&task.agent_id).map_or(String::new(), |a| {
                    match address_host(&a.info.address) {
                        "" => a.info.hostname.clone(),
                        h => h.to_string(),
                    }
                });
                out.push(ReplicaEndpoint {
                    replica: u32::try_from(i).unwrap_or(u32::MAX),
                    job_id: job_id.clone(),
                    task_id: task.id.clone(),
                    agent_id: task.agent_id.clone(),
                    host,
                    port: task.ports.first().copied(),
                    ready: task.ready(has_readiness),
                });
            }
        }
        out
    }

    /// Whether a job's (a replica's) current attempt serves: every task of
    /// it runs and passes its readiness check; and the last failure its
    /// checks told, if any.
    pub fn job_ready(&self, job_id: &str) -> (bool, String) {
        let Some(job) = self.jobs.get(job_id) else {
            return (false, String::new());
        };
        let has_readiness = job.spec.template.options.readiness.is_some();
        let tasks: Vec<&TaskRecord> = job
            .current_tasks()
            .iter()
            .filter_map(|t| self.tasks.get(t))
            .collect();
        let ready = !tasks.is_empty() && tasks.iter().all(|t| t.ready(has_readiness));
        let failure = tasks
            .iter()
            .filter_map(|t| t.health.as_ref())
            .map(|h| h.failure.clone())
            .find(|f| !f.is_empty())
            .unwrap_or_default();
        (ready, failure)
    }

    pub fn services(&self) -> impl Iterator<Item = &ServiceRecord> {
        self.services.values()
    }

    /// The live service of this name (names are unique among them).
    pub fn service_named(&self, name: &str) -> Option<&ServiceRecord> {
        self.services.values().find(|s| s.spec.name == name)
    }

    /// `Command::CreateService`. The name is the create's key: the same
    /// spec again returns the service it made; another is refused.
    pub(super) fn create_service(
        &mut self,
        spec: &ServiceSpec,
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        if let Some(s) = self.service_named(&spec.name) {
            let id = s.id.clone();
            // Scaled since: the replica count is not the create's to judge.
            let same = ServiceSpec {
                replicas: spec.replicas,
                ..s.spec.clone()
            } == *spec;
            return if same {
                Ok(Outcome::ServiceCreated { id })
            } else {
                Err(ApplyError::ServiceExists(spec.name.clone()))
            };
        }
        self.check_within_cap(spec, spec.replicas)?;
        let id = format!("svc-{}", self.next_service_seq.max(1));
        self.next_service_seq = self.next_service_seq.max(1) + 1;
        let mut record = ServiceRecord {
            id: id.clone(),
            spec: spec.clone(),
            created_at_ms: at_ms,
            updated_at_ms: at_ms,
            replicas: Vec::new(),
            events: Events::default(),
        };
        record.events.record(
            EventKind::Created,
            format!("with {} replica(s)", spec.replicas),
            at_ms,
        );
        for index in 0..spec.replicas {
            let job = self.submit_replica(&record, index, at_ms)?;
            record.replicas.push(job);
        }
        self.services.insert(id.clone(), record);
        Ok(Outcome::ServiceCreated { id })
    }

    /// `replicas` of the service could all run within its tenant's cap
    /// (quota plus borrowing): more could never run together, and are
    /// refused rather than left waiting for ever.
    fn check_within_cap(&self, spec: &ServiceSpec, replicas: u32) -> Result<(), ApplyError> {
        let tenant = spec.template.tenant.name();
        let Some(cap) = self.tenant_cap(tenant) else {
            return Ok(());
        };
        let t = &spec.template;
        let each = t.placement.wants().devices(t.template.resources.gpus) as u64;
        let all = each.saturating_mul(u64::from(replicas));
        if all > u64::from(cap) {
            return Err(ApplyError::Invalid {
                field: "replicas".into(),
                reason: format!(
                    "{replicas} replicas of {each} GPU(s) need {all}: more than tenant \
                     {tenant} may hold ({cap}, its quota and borrowing)"
                ),
            });
        }
        Ok(())
    }

    /// Queues replica `index` of the service as a job.
    fn submit_replica(
        &mut self,
        service: &ServiceRecord,
        index: u32,
        at_ms: u64,
    ) -> Result<JobId, ApplyError> {
        let mut spec = service.spec.template.clone();
        spec.service = Some(service.id.clone());
        let env = &mut spec.template.env;
        env.insert("GPUCTL_SERVICE".into(), service.spec.name.clone());
        env.insert("GPUCTL_REPLICA".into(), index.to_string());
        match self.submit_job(&spec, at_ms, None)? {
            Outcome::JobSubmitted { job_id } => Ok(job_id),
            other => Err(ApplyError::Unexpected(format!(
                "submit of a replica answered {other:?}"
            ))),
        }
    }

    /// `Command::ScaleService`: more replicas are queued; for fewer, the
    /// newest are stopped.
    pub(super) fn scale_service(
        &mut self,
        name: &str,
        replicas: u32,
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        let Some(mut record) = self.service_named(name).cloned() else {
            return Err(ApplyError::ServiceNotFound(name.to_string()));
        };
        if record.spec.replicas == replicas {
            return Ok(Outcome::Done);
        }
        self.check_within_cap(&record.spec, replicas)?;
        let from = record.spec.replicas;
        while record.replicas.len() < replicas as usize {
            let index = u32::try_from(record.replicas.len()).unwrap_or(u32::MAX);
            let job = self.submit_replica(&record, index, at_ms)?;
            record.replicas.push(job);
        }
        let drain = record.spec.drain();
        while record.replicas.len() > replicas as usize {
            if let Some(job) = record.replicas.pop() {
                self.leave(&job, drain, at_ms)?;
            }
        }
        record.spec.replicas = replicas;
        record.updated_at_ms = at_ms;
        let drained = if replicas < from && drain > 0 {
            format!(" (the leaving draining {}s)", drain as f64 / 1000.0)
        } else {
            String::new()
        };
        record.events.record(
            EventKind::Scaled,
            format!("from {from} to {replicas}{drained}"),
            at_ms,
        );
        self.services.insert(record.id.clone(), record);
        Ok(Outcome::Done)
    }

    /// `Command::DeleteService`: every replica is stopped and the name is
    /// free at once (the stopping jobs name the old service's id).
    pub(super) fn delete_service(&mut self, name: &str, at_ms: u64) -> Result<Outcome, ApplyError> {
        let Some(id) = self.service_named(name).map(|s| s.id.clone()) else {
            return Err(ApplyError::ServiceNotFound(name.to_string()));
        };
        let Some(record) = self.services.remove(&id) else {
            return Err(ApplyError::ServiceNotFound(name.to_string()));
        };
        let drain = record.spec.drain();
        for job in &record.replicas {
            self.leave(job, drain, at_ms)?;
        }
        Ok(Outcome::ServiceDeleted {
            job_ids: record.replicas,
        })
    }

    /// A replica leaves its service: with a drain, its job runs on, out of
    /// the endpoints, until `EndDrains` stops it (and, ending before,
    /// ends for good: it is no longer restarted, retried or requeued);
    /// without, it is stopped now.
    fn leave(&mut self, job_id: &str, drain_ms: u64, at_ms: u64) -> Result<(), ApplyError> {
        // Only a replica with tasks out may have requests in flight.
        let live = self.jobs.get(job_id).is_some_and(|j| {
            matches!(
                j.state,
                gpuctl_core::types::JobState::Running | gpuctl_core::types::JobState::Starting
            )
        });
        if drain_ms == 0 || !live {
            return self.cancel_job(job_id, at_ms).map(|_| ());
        }
        if let Some(job) = self.jobs.get_mut(job_id) {
            job.spec.restart_policy = gpuctl_core::types::RestartPolicy::Never;
            job.spec.max_retries = 0;
            job.spec.no_requeue = true;
            job.events.record(
                EventKind::Draining,
                format!(
                    "left its service: out of its endpoints, stopped in {}s",
                    drain_ms as f64 / 1000.0
                ),
                at_ms,
            );
        }
        self.draining
            .insert(job_id.to_string(), at_ms.saturating_add(drain_ms));
        Ok(())
    }

    /// Whether an `EndDrains` at `now_ms` has anything to do: a drain over,
    /// or a draining replica that ended by itself.
    pub fn drains_due(&self, now_ms: u64) -> bool {
        self.draining.iter().any(|(job, until)| {
            *until <= now_ms || self.jobs.get(job).is_none_or(|j| j.state.is_terminal())
        })
    }

    /// Replicas still draining, with when their drain ends.
    pub fn draining(&self) -> impl Iterator<Item = (&JobId, u64)> {
        self.draining.iter().map(|(j, u)| (j, *u))
    }

    /// `Command::EndDrains`.
    pub(super) fn end_drains(&mut self, at_ms: u64) -> Result<Outcome, ApplyError> {
        let due: Vec<JobId> = self
            .draining
            .iter()
            .filter(|(job, until)| {
                **until <= at_ms || self.jobs.get(*job).is_none_or(|j| j.state.is_terminal())
            })
            .map(|(job, _)| job.clone())
            .collect();
        for job in due {
            self.draining.remove(&job);
            if self.jobs.get(&job).is_some_and(|j| !j.state.is_terminal()) {
                self.cancel_job(&job, at_ms)?;
            }
        }
        Ok(Outcome::Done)
    }

    /// `Command::CancelJob`: a live service's replica is its service's to
    /// stop (scale or delete it), not a cancel's.
    pub(super) fn cancel_job_asked(
        &mut self,
        job_id: &str,
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        let owner = self
            .jobs
            .get(job_id)
            .and_then(|j| j.spec.service.as_deref())
            .and_then(|id| self.services.get(id));
        if let Some(service) = owner {
            return Err(ApplyError::ReplicaOfService {
                job_id: job_id.to_string(),
                service: service.spec.name.clone(),
            });
        }
        self.cancel_job(job_id, at_ms)
    }

    /// Forgets a replica's oldest tasks beyond [`KEPT_REPLICA_TASKS`],
    /// those that ended and hold nothing; the job's task numbers go on.
    pub(super) fn forget_old_replica_tasks(&mut self, job_id: &str) {
        let Some(job) = self.jobs.get(job_id) else {
            return;
        };
        let excess = job.task_ids.len().saturating_sub(KEPT_REPLICA_TASKS);
        let drop = job.task_ids[..excess]
            .iter()
            .take_while(|t| {
                self.tasks
                    .get(*t)
                    .is_none_or(|t| t.state.is_terminal() && self.task_holds_nothing(t))
            })
            .count();
        if drop == 0 {
            return;
        }
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        let gone: Vec<String> = job.task_ids.drain(..drop).collect();
        job.forgotten_tasks = job.forgotten_tasks.saturating_add(drop as u64);
        for t in &gone {
            self.tasks.remove(t);
            self.util.forget_task(t);
        }
    }
}

/// Before a replica's attempt ends: one that ran long enough starts its
/// backoff again from the first pause.
pub(super) fn backoff_after_run(job: &mut JobRecord, tasks: &[&TaskRecord], at_ms: u64) {
    let ran = tasks
        .iter()
        .filter_map(|t| t.running_at_ms)
        .min()
        .map(|since| at_ms.saturating_sub(since));
    if ran.is_some_and(|ran| ran >= REPLICA_BACKOFF_RESET_MS) {
        job.retries = 0;
    }
}

/// A replica's attempt ended (exit 0 or not): it is queued again after
/// its backoff, without a retry limit. The event of it.
pub(super) fn restart_replica(
    job: &mut JobRecord,
    message: &str,
    at_ms: u64,
) -> (EventKind, String) {
    job.retries = job.retries.saturating_add(1);
    let pause = job.spec.restart_backoff(job.retries);
    job.not_before_ms = if pause == 0 {
        0
    } else {
        at_ms.saturating_add(pause)
    };
    (
        EventKind::Retrying,
        format!(
            "{message}; restart {} in {}s",
            job.retries,
            pause as f64 / 1000.0
        ),
    )
}

#[cfg(test)]
mod endpoint_tests {
    #[test]
    fn an_address_gives_its_host() {
        for (a, h) in [
            ("10.0.0.7:7051", "10.0.0.7"),
            ("gpu-a.lab:7051", "gpu-a.lab"),
            ("[fd00::7]:7051", "fd00::7"),
            ("gpu-a", "gpu-a"),
            ("", ""),
        ] {
            assert_eq!(super::address_host(a), h, "{a}");
        }
    }
}
