//! `State::apply`: one committed command in, a new state and an outcome out.
//! A command that is refused leaves the state exactly as it was (checks come
//! first, changes after), so a refused command is harmless on every master.

use gpuctl_core::types::JobState;

use super::{Command, State};

/// What a successful apply produced, returned to the proposer.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Done,
    JobSubmitted {
        job_id: String,
    },
    JobCancelled {
        state: JobState,
    },
    FrameworkSubscribed {
        framework_id: String,
    },
    /// The token of a CreateToken: the command's own, or (a resend of a
    /// create that carried a request id) the one its first send made.
    TokenCreated {
        token_id: String,
    },
    /// Per task of a LaunchFrameworkTasks: launched, or recorded in ERROR
    /// with the reason, or (`unrecorded`) refused without a record because
    /// its id is another task's.
    FrameworkTasksLaunched {
        launched: Vec<String>,
        refused: Vec<(String, String)>,
        unrecorded: Vec<(String, String)>,
    },
    /// Per job of a LaunchJobs: those refused, with why (the others
    /// started).
    JobsLaunched {
        refused: Vec<(String, String)>,
    },
    /// The update was about a task that already ended or that this master
    /// does not know; accepted (so the agent stops retrying) and ignored.
    StaleUpdate,
    ServiceCreated {
        id: String,
    },
    /// The replicas' jobs, being stopped.
    ServiceDeleted {
        job_ids: Vec<String>,
    },
}

/// A committed change of the Raft group's members, for
/// [`State::apply_member_change`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberChange<'a> {
    /// A master joined, reachable at this API address.
    Added {
        id: u64,
        addr: &'a str,
    },
    Removed {
        id: u64,
    },
}

/// Why a command was refused. Deterministic: every master refuses it alike.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApplyError {
    #[error("job {0} not found")]
    JobNotFound(String),
    #[error("agent {0} not found")]
    AgentNotFound(String),
    #[error("agent {0} is lost")]
    AgentLost(String),
    #[error(
        "agent {0} is unreachable (no heartbeat): it gets no new tasks until it registers again"
    )]
    AgentUnreachable(String),
    #[error("agent {0} is draining: it gets no new tasks (gpuctl agents undrain {0})")]
    AgentDraining(String),
    #[error("job {job_id} is {state}, not QUEUED")]
    JobNotQueued { job_id: String, state: JobState },
    #[error("GPU {gpu} is already held by task {task_id}")]
    GpuTaken { gpu: String, task_id: String },
    #[error("GPU {gpu} is already registered by agent {agent_id}")]
    GpuClaimed { gpu: String, agent_id: String },
    #[error("launch does not fit: {0}")]
    DoesNotFit(String),
    #[error(
        "status update for task {task_id} from agent {agent_id}, but the task is on agent {owner}"
    )]
    WrongAgent {
        task_id: String,
        agent_id: String,
        owner: String,
    },
    #[error("framework {0} not found")]
    FrameworkNotFound(String),
    #[error("framework {0} was removed")]
    FrameworkRemoved(String),
    #[error("task {0} not found")]
    TaskNotFound(String),
    #[error("invalid {field}: {reason}")]
    Invalid { field: String, reason: String },
    #[error(
        "request_id: this caller already submitted job {job_id} with this request id and another spec; \
         give another request id (or none) for another job"
    )]
    RequestIdReused { job_id: String },
    #[error("undecodable command at index {index}: {reason}")]
    Undecodable { index: u64, reason: String },
    #[error("name: a service named {0:?} exists with another spec (scale it, or delete it first)")]
    ServiceExists(String),
    #[error("service {0:?} not found")]
    ServiceNotFound(String),
    #[error("job {job_id} is a replica of service {service:?}: scale or delete the service")]
    ReplicaOfService { job_id: String, service: String },
    #[error("{0}")]
    Unexpected(String),
}

impl State {
    /// Applies the command committed at `index`.
    pub fn apply(&mut self, index: u64, cmd: &Command) -> Result<Outcome, ApplyError> {
        let out = self.apply_command(index, cmd);
        self.refresh_derived();
        out
    }

    fn apply_command(&mut self, index: u64, cmd: &Command) -> Result<Outcome, ApplyError> {
        if index > self.applied_index {
            self.applied_index = index;
        }
        match cmd {
            Command::RecordMasters { masters } => {
                for (id, addr) in masters {
                    self.masters.insert(*id, addr.clone());
                }
                Ok(Outcome::Done)
            }
            Command::RegisterAgent {
                info,
                running_task_ids,
                at_ms,
            } => {
                let out = self.register_agent(info, running_task_ids, *at_ms)?;
                self.forget_mig_changes_of_gone_gpus(info);
                self.share_by_default(info);
                Ok(out)
            }
            Command::AgentLost { agent_id, at_ms } => self.agent_lost_legacy(agent_id, *at_ms),
            Command::AgentUnreachable { agent_id, at_ms } => {
                self.agent_unreachable(agent_id, *at_ms)
            }
            Command::AgentLostAfterTimeout { agent_id, at_ms } => {
                self.agent_lost_after_timeout(agent_id, *at_ms)
            }
            Command::DrainAgent {
                agent_id,
                kill,
                deadline_ms,
                at_ms,
            } => self.drain_agent(agent_id, *kill, *deadline_ms, *at_ms),
            Command::UndrainAgent { agent_id, .. } => self.undrain_agent(agent_id),
            Command::DrainDeadlinePassed { agent_id, at_ms } => {
                self.drain_deadline_passed(agent_id, *at_ms)
            }
            Command::SubmitJob {
                spec,
                at_ms,
                request_id,
            } => self.submit_job(spec, *at_ms, request_id.as_deref()),
            Command::LaunchTasks { launches, at_ms } => self.launch_tasks(launches, *at_ms),
            Command::LaunchJobs { jobs, at_ms } => self.launch_jobs(jobs, *at_ms),
            Command::UpdateTaskStatus { update, at_ms } => self.update_task(update, *at_ms),
            Command::CancelJob { job_id, at_ms } => self.cancel_job_asked(job_id, *at_ms),
            Command::SetGpuHealth { agent_id, gpus, .. } => self.set_gpu_health(agent_id, gpus),
            Command::ShareGpu { gpu_uuid, mode } => self.share_gpu(gpu_uuid, *mode),
            Command::SetMigLayout {
                gpu_uuid,
                profiles,
                disable,
                by,
                at_ms,
            } => self.set_mig_layout(index, gpu_uuid, profiles, *disable, by, *at_ms),
            Command::MigLayoutDone {
                agent_id,
                generation,
                gpu,
                error,
            } => self.mig_layout_done(agent_id, *generation, gpu, error.as_deref()),
            Command::CordonGpu { uuid, cordon } => self.cordon_gpu(uuid, *cordon),
            Command::PreemptJobs {
                job_id,
                victims,
                at_ms,
            } => self.preempt_jobs(job_id, victims, *at_ms),
            Command::GrowJob { job_id, to, at_ms } => self.grow_job(job_id, *to, *at_ms),
            Command::RecordUtilization {
                at_ms,
                period_ms,
                points,
                idle_window_ms,
                idle_below_pct,
            } => {
                self.record_utilization(*at_ms, *period_ms, points);
                if *idle_window_ms > 0 {
                    self.flag_idle_jobs(
                        points,
                        *at_ms,
                        *period_ms,
                        *idle_window_ms,
                        *idle_below_pct,
                    );
                }
                Ok(Outcome::Done)
            }
            Command::ReclaimJobs {
                job_id,
                victims,
                at_ms,
                min_runtime_ms,
            } => self.reclaim_jobs(job_id, victims, *at_ms, *min_runtime_ms),
            Command::ReclaimFrameworkTasks {
                framework_id,
                task_ids,
                for_framework,
                at_ms,
            } => self.reclaim_framework_tasks(framework_id, task_ids, for_framework, *at_ms),
            Command::SubscribeFramework {
                info,
                at_ms,
                request_id,
            } => self.subscribe_framework(info, *at_ms, request_id.as_deref()),
            Command::UpdateFramework { info, .. } => self.update_framework(info),
            Command::RemoveFramework {
                framework_id,
                reason,
                at_ms,
            } => self.remove_framework(framework_id, reason, *at_ms),
            Command::LaunchFrameworkTasks {
                framework_id,
                tasks,
                group,
                at_ms,
            } => self.launch_framework_tasks(framework_id, tasks, *group, *at_ms),
            Command::KillTask {
                framework_id,
                framework_task_id,
                at_ms,
            } => self.kill_framework_task(framework_id, framework_task_id, *at_ms),
            Command::AcknowledgeUpdate {
                framework_id,
                framework_task_id,
                uuid,
            } => self.acknowledge_update(framework_id, framework_task_id, uuid),
            Command::ForgetJobs { job_ids, at_ms } => Ok(self.forget_jobs(job_ids, *at_ms)),
            Command::ForgetFrameworkTasks { task_ids, at_ms } => {
                Ok(self.forget_framework_tasks(task_ids, *at_ms))
            }
            Command::CreateToken { record, request } => self.create_token(record, request.as_ref()),
            Command::RevokeToken { id, at_ms } => self.revoke_token(id, *at_ms),
            Command::UseJoinToken {
                id,
                agent_id,
                at_ms,
                key,
            } => self.use_join_token(id, agent_id, *at_ms, key),
            Command::SetQuota {
                tenant,
                gpus,
                borrow,
                clear_borrow,
                weight,
                stop_idle_after_ms,
                clear_stop_idle,
            } => {
                let borrow = if *clear_borrow {
                    Some(None)
                } else {
                    borrow.map(Some)
                };
                let stop_idle = if *clear_stop_idle {
                    Some(None)
                } else {
                    stop_idle_after_ms.map(Some)
                };
                self.set_quota(tenant, *gpus, borrow, *weight, stop_idle)
            }
            Command::CreateService { spec, at_ms } => self.create_service(spec, *at_ms),
            Command::ScaleService {
                name,
                replicas,
                at_ms,
            } => self.scale_service(name, *replicas, *at_ms),
            Command::DeleteService { name, at_ms } => self.delete_service(name, *at_ms),
            Command::EndDrains { at_ms } => self.end_drains(*at_ms),
        }
    }

    // The log also holds entries that carry no `Command`; Raft commits
    // them like the others, so they are applied here too, alike on every
    // master, rather than by the Raft node writing the fields itself.

    /// Applies an entry at `index` that changes nothing but the applied
    /// index: a new leader's empty entry, an undecodable one, or a
    /// membership change that was refused or carries no address.
    pub fn apply_noop(&mut self, index: u64) {
        self.applied_index = self.applied_index.max(index);
    }

    /// Applies a membership change of the Raft group committed at `index`
    /// (a Raft conf change entry, not a `Command`): keeps the address book
    /// of the masters.
    pub fn apply_member_change(&mut self, index: u64, change: MemberChange<'_>) {
        self.apply_noop(index);
        match change {
            MemberChange::Added { id, addr } => {
                self.masters.insert(id, addr.to_string());
            }
            MemberChange::Removed { id } => {
                self.masters.remove(&id);
            }
        }
    }
}

#[cfg(test)]
mod tests;
