//! `State::apply`: one committed command in, a new state and an outcome out.
//! A command that is refused leaves the state exactly as it was (checks come
//! first, changes after), so a refused command is harmless on every master.

use std::collections::BTreeSet;

use gpuctl_core::types::{
    find_device, Device, JobState, Resources, Runtime, StatusUpdate, TaskState,
};

use super::events::EventKind;
use super::{AgentState, Command, JobRecord, State, TaskReason};

/// What the launches checked so far in one command take.
#[derive(Debug, Default)]
pub(super) struct Pending {
    pub(super) resources: std::collections::BTreeMap<String, Resources>,
    pub(super) gpus: BTreeSet<String>,
    /// Fractions given, by GPU: memory (MiB) and compute (percent).
    pub(super) shares: std::collections::BTreeMap<String, (u64, u32)>,
    /// Host ports given, by agent.
    pub(super) ports: std::collections::BTreeMap<String, BTreeSet<u16>>,
}

/// Which devices a launch may name: a job's are whole GPUs, MIG devices
/// of its profile (`placement.mig`), or a fraction of one shared GPU
/// (`placement.fraction`); a framework's task whole GPUs or MIG devices
/// (`Any`), or a fraction of one shared GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wants<'a> {
    Whole,
    Mig(&'a str),
    Fraction(gpuctl_core::types::GpuFraction),
    Any,
}

impl<'a> Wants<'a> {
    pub(super) fn of_job(spec: &'a gpuctl_core::types::JobSpec) -> Wants<'a> {
        if let Some(f) = spec.placement.fraction {
            return Wants::Fraction(f);
        }
        spec.placement
            .mig
            .as_deref()
            .map_or(Wants::Whole, Wants::Mig)
    }
}

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
            } => {
                if let Some(key) = request_id {
                    if let Some(job_id) = self.resubmitted(key, spec, Some(*at_ms))? {
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
                    *at_ms,
                    super::requests::MAX_REMEMBERED,
                );
                let job_id = format!("job-{}", self.next_job_seq);
                if let Some(key) = request_id {
                    super::requests::remember(
                        &mut self.submit_requests,
                        &mut self.submit_request_order,
                        key,
                        job_id.clone(),
                        *at_ms,
                    );
                }
                self.next_job_seq += 1;
                self.jobs.insert(
                    job_id.clone(),
                    JobRecord {
                        id: job_id.clone(),
                        spec: spec.clone(),
                        state: JobState::Queued,
                        submitted_at_ms: *at_ms,
                        updated_at_ms: *at_ms,
                        task_ids: Vec::new(),
                        cancel_requested: false,
                        message: String::new(),
                        retries: 0,
                        preemptions: 0,
                        stopping: None,
                        preempted_by: None,
                        image_requires: Vec::new(),
                        events: Default::default(),
                    },
                );
                self.job_event(
                    &job_id,
                    EventKind::Queued,
                    super::events::queued_words(spec),
                    *at_ms,
                );
                Ok(Outcome::JobSubmitted { job_id })
            }
            Command::LaunchTasks { launches, at_ms } => self.launch_tasks(launches, *at_ms),
            Command::LaunchJobs { jobs, at_ms } => {
                let mut refused = Vec::new();
                for launches in jobs {
                    // Checked whole before anything changes: a refused
                    // job leaves nothing behind.
                    if let Err(e) = self.launch_tasks(launches, *at_ms) {
                        let job = launches
                            .first()
                            .map(|l| l.job_id.clone())
                            .unwrap_or_default();
                        refused.push((job, e.to_string()));
                    }
                }
                Ok(Outcome::JobsLaunched { refused })
            }
            Command::UpdateTaskStatus { update, at_ms } => self.update_task(update, *at_ms),
            Command::CancelJob { job_id, at_ms } => self.cancel_job(job_id, *at_ms),
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
            Command::CordonGpu { uuid, cordon } => {
                if !self
                    .agents
                    .values()
                    .any(|a| a.info.gpus.iter().any(|g| &g.uuid == uuid))
                {
                    return Err(ApplyError::Invalid {
                        field: "uuid".into(),
                        reason: format!("no agent has GPU {uuid}"),
                    });
                }
                self.agents.mark_gpu(uuid);
                if *cordon {
                    self.cordoned.insert(uuid.clone());
                } else {
                    self.cordoned.remove(uuid);
                }
                Ok(Outcome::Done)
            }
            Command::PreemptJobs {
                job_id,
                victims,
                at_ms,
            } => self.preempt_jobs(job_id, victims, *at_ms),
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
            } => self.use_join_token(id, agent_id, *at_ms),
            Command::SetQuota {
                tenant,
                gpus,
                borrow,
                clear_borrow,
                weight,
            } => {
                let borrow = if *clear_borrow {
                    Some(None)
                } else {
                    borrow.map(Some)
                };
                self.set_quota(tenant, *gpus, borrow, *weight)
            }
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

    /// Records an agent's new verdict on some of its GPUs. All or nothing:
    /// a GPU the agent does not have refuses the whole command.
    fn set_gpu_health(
        &mut self,
        agent_id: &str,
        changes: &[super::command::GpuHealthChange],
    ) -> Result<Outcome, ApplyError> {
        let agent = self
            .agents
            .get_mut(agent_id)
            .ok_or_else(|| ApplyError::AgentNotFound(agent_id.to_string()))?;
        if let Some(c) = changes
            .iter()
            .find(|c| !agent.info.gpus.iter().any(|g| g.uuid == c.uuid))
        {
            return Err(ApplyError::Invalid {
                field: "gpus".into(),
                reason: format!("agent {agent_id} has no GPU {}", c.uuid),
            });
        }
        for c in changes {
            if let Some(g) = agent.info.gpus.iter_mut().find(|g| g.uuid == c.uuid) {
                g.healthy = c.healthy;
                g.unhealthy_reason = if c.healthy {
                    String::new()
                } else {
                    c.reason.clone()
                };
            }
        }
        Ok(Outcome::Done)
    }

    /// Whether `resources` with exactly the devices `gpus` (GPUs, or MIG
    /// devices, as `wants` allows) fit on the agent now, counting what
    /// earlier launches of the same command (`pending`) took. On success
    /// `pending` includes this launch.
    ///
    /// The device invariant: a GPU or MIG device is never given twice, a
    /// GPU in MIG mode is never given whole, and a MIG device only while
    /// its parent is in MIG mode and not held whole (which the first two
    /// make impossible, and is checked anyway).
    pub(super) fn check_fit(
        &self,
        agent_id: &str,
        runtime: Runtime,
        resources: &Resources,
        gpus: &[String],
        wants: Wants<'_>,
        pending: &mut Pending,
    ) -> Result<Vec<u16>, ApplyError> {
        let agent = self
            .agents
            .get(agent_id)
            .ok_or_else(|| ApplyError::AgentNotFound(agent_id.to_string()))?;
        match agent.state {
            AgentState::Active => {}
            AgentState::Unreachable => {
                return Err(ApplyError::AgentUnreachable(agent_id.to_string()))
            }
            AgentState::Lost => return Err(ApplyError::AgentLost(agent_id.to_string())),
        }
        if agent.drain.is_some() {
            return Err(ApplyError::AgentDraining(agent_id.to_string()));
        }
        if !agent.info.runtimes.contains(&runtime) {
            return Err(ApplyError::DoesNotFit(format!(
                "agent {agent_id} has no {runtime} runtime"
            )));
        }
        if let Wants::Fraction(f) = wants {
            self.check_fraction(agent, gpus, f, pending)?;
        } else if gpus.len() != resources.gpus as usize {
            return Err(ApplyError::DoesNotFit(format!(
                "{} GPUs asked for, {} named",
                resources.gpus,
                gpus.len()
            )));
        }
        // (A fraction's GPU was checked above.)
        let devices = if matches!(wants, Wants::Fraction(_)) {
            &[][..]
        } else {
            gpus
        };
        for uuid in devices {
            let Some(device) = find_device(&agent.info.gpus, uuid) else {
                return Err(ApplyError::DoesNotFit(format!(
                    "GPU {uuid} is not on agent {agent_id}"
                )));
            };
            let gpu = device.gpu();
            match (device, wants) {
                (Device::Gpu(_), Wants::Mig(p)) => {
                    return Err(ApplyError::DoesNotFit(format!(
                        "GPU {uuid} is a whole GPU, the job asks for a MIG device {p}"
                    )))
                }
                (Device::Mig { .. }, Wants::Whole) => {
                    return Err(ApplyError::DoesNotFit(format!(
                        "{uuid} is a MIG device, the job asks for whole GPUs"
                    )))
                }
                (Device::Mig { device, .. }, Wants::Mig(p)) if device.profile != p => {
                    return Err(ApplyError::DoesNotFit(format!(
                        "MIG device {uuid} is a {}, the job asks for a {p}",
                        device.profile
                    )))
                }
                (Device::Gpu(g), _) if g.mig.enabled => {
                    return Err(ApplyError::DoesNotFit(format!(
                        "GPU {uuid} is in MIG mode: it is used through its MIG devices, never whole"
                    )))
                }
                _ => {}
            }
            if !gpu.healthy {
                return Err(ApplyError::DoesNotFit(format!(
                    "GPU {} is unhealthy",
                    gpu.uuid
                )));
            }
            if self.cordoned.contains(&gpu.uuid) {
                return Err(ApplyError::DoesNotFit(format!(
                    "GPU {} is cordoned",
                    gpu.uuid
                )));
            }
            if self.mig_changes.contains_key(&gpu.uuid) {
                return Err(ApplyError::DoesNotFit(format!(
                    "GPU {} is being repartitioned (MIG layout change)",
                    gpu.uuid
                )));
            }
            if let Some(m) = self.shared.get(&gpu.uuid) {
                return Err(ApplyError::DoesNotFit(format!(
                    "GPU {} is shared ({m}): it is given only as fractions",
                    gpu.uuid
                )));
            }
            // A MIG device's parent must not be held whole, nor the device.
            for held in [uuid.as_str(), gpu.uuid.as_str()] {
                if let Some(owner) = self.gpu_owner.get(held) {
                    return Err(ApplyError::GpuTaken {
                        gpu: held.to_string(),
                        task_id: owner.clone(),
                    });
                }
            }
            if pending.gpus.contains(uuid) {
                return Err(ApplyError::GpuTaken {
                    gpu: uuid.clone(),
                    task_id: "another launch in the same command".into(),
                });
            }
        }
        let more = pending
            .resources
            .get(agent_id)
            .copied()
            .unwrap_or_default()
            .add(resources);
        if !agent.free().fits(&more) {
            return Err(ApplyError::DoesNotFit(format!(
                "agent {agent_id} has {:.2} cpus, {} MiB and {} ports free",
                agent.free().cpus,
                agent.free().mem_mib,
                agent.free().ports
            )));
        }
        let taken = pending.ports.entry(agent_id.to_string()).or_default();
        let ports = self.pick_ports(agent_id, resources.ports, taken)?;
        taken.extend(&ports);
        pending.resources.insert(agent_id.to_string(), more);
        pending.gpus.extend(gpus.iter().cloned());
        Ok(ports)
    }

    /// A fraction's one GPU: shared, healthy, not cordoned, and holding
    /// it beside the fractions already there (and those of earlier
    /// launches of the same command, which `pending` gains on success).
    fn check_fraction(
        &self,
        agent: &super::AgentRecord,
        gpus: &[String],
        f: gpuctl_core::types::GpuFraction,
        pending: &mut Pending,
    ) -> Result<(), ApplyError> {
        let agent_id = agent.info.id.as_str();
        let [uuid] = gpus else {
            return Err(ApplyError::DoesNotFit(format!(
                "a fraction is of one GPU, {} named",
                gpus.len()
            )));
        };
        let Some(gpu) = agent.info.gpus.iter().find(|g| &g.uuid == uuid) else {
            return Err(ApplyError::DoesNotFit(format!(
                "GPU {uuid} is not on agent {agent_id}"
            )));
        };
        if !self.shared.contains_key(uuid) {
            return Err(ApplyError::DoesNotFit(format!(
                "GPU {uuid} is not shared: fractions go only to GPUs marked shareable (gpuctl gpus share)"
            )));
        }
        if !gpu.healthy {
            return Err(ApplyError::DoesNotFit(format!("GPU {uuid} is unhealthy")));
        }
        if self.cordoned.contains(uuid) {
            return Err(ApplyError::DoesNotFit(format!("GPU {uuid} is cordoned")));
        }
        // Sharing is refused for these; checked anyway.
        if gpu.mig.enabled {
            return Err(ApplyError::DoesNotFit(format!("GPU {uuid} is in MIG mode")));
        }
        if let Some(owner) = self.gpu_owner.get(uuid) {
            return Err(ApplyError::GpuTaken {
                gpu: uuid.clone(),
                task_id: owner.clone(),
            });
        }
        let (mem, pct) = self.share_used(agent_id, uuid);
        let (pm, pp) = pending.shares.get(uuid).copied().unwrap_or_default();
        let used = (mem.saturating_add(pm), pct.saturating_add(pp));
        if !State::fraction_fits(gpu, used, f) {
            return Err(ApplyError::DoesNotFit(format!(
                "GPU {uuid} has {} MiB and {}% of compute left, the fraction asks {} MiB and {}%",
                gpu.memory_mib.saturating_sub(used.0),
                100u32.saturating_sub(used.1),
                f.mem_mib,
                f.compute_pct
            )));
        }
        let e = pending.shares.entry(uuid.clone()).or_default();
        *e = (
            e.0.saturating_add(f.mem_mib),
            e.1.saturating_add(f.compute_pct),
        );
        Ok(())
    }

    /// The `n` lowest ports of the agent's range that no task holding
    /// resources there holds and that are not in `taken`. Deterministic, so
    /// every replica picks the same. The count check (`Resources::ports`)
    /// comes first; this also refuses when the numbers run out (a range
    /// that shrank under tasks holding ports outside it).
    fn pick_ports(
        &self,
        agent_id: &str,
        n: u32,
        taken: &BTreeSet<u16>,
    ) -> Result<Vec<u16>, ApplyError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let range = self
            .agents
            .get(agent_id)
            .and_then(|a| a.info.ports)
            .ok_or_else(|| ApplyError::DoesNotFit(format!("agent {agent_id} offers no ports")))?;
        let held: BTreeSet<u16> = self
            .tasks
            .on(agent_id)
            .filter(|t| t.holds_resources())
            .flat_map(|t| t.ports.iter().copied())
            .collect();
        let picked: Vec<u16> = (range.start..=range.end)
            .filter(|p| !held.contains(p) && !taken.contains(p))
            .take(n as usize)
            .collect();
        if picked.len() < n as usize {
            return Err(ApplyError::DoesNotFit(format!(
                "agent {agent_id} has {} of its ports {range} free, {n} asked for",
                picked.len()
            )));
        }
        Ok(picked)
    }

    fn update_task(&mut self, u: &StatusUpdate, at_ms: u64) -> Result<Outcome, ApplyError> {
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
            if u.gpu_unhealthy || u.fenced || u.gpu_memory_limit {
                if let Some(task) = self.tasks.get_mut(&u.task_id) {
                    task.reason = if u.gpu_unhealthy {
                        TaskReason::GpuUnhealthy
                    } else if u.fenced {
                        TaskReason::Fenced
                    } else {
                        TaskReason::GpuMemoryLimit
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
                    (TaskState::Finished | TaskState::Failed, Some(_)) => TaskReason::CommandExited,
                    (TaskState::Failed | TaskState::Error, None) => {
                        TaskReason::ContainerLaunchFailed
                    }
                    (TaskState::Killed, _) if task.reason == TaskReason::Unspecified => {
                        TaskReason::KilledByFramework
                    }
                    _ => task.reason,
                };
            }
            return Ok(Outcome::Done);
        }
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
            return Ok(if released {
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
            if !u.message.is_empty() {
                task.message = u.message.clone();
            }
        }
        if !job_id.is_empty() {
            self.job_task_progressed(&job_id, &u.task_id, at_ms);
        }
        Ok(Outcome::Done)
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
    fn release_early(&mut self, task_id: &str) -> bool {
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
    fn learn_driver_requires(&mut self, task_id: &str, u: &StatusUpdate) -> bool {
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
    fn free_held(&mut self, task_id: &str) {
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

    pub(super) fn recompute_allocated(&mut self, agent_id: &str) {
        let total = self
            .tasks
            .on(agent_id)
            .filter(|t| t.holds_resources())
            .fold(Resources::default(), |acc, t| acc.add(&t.resources));
        if let Some(a) = self.agents.get_mut(agent_id) {
            a.allocated = total;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Launch;
    use gpuctl_core::types::{AgentInfo, GpuInfo, JobSpec};

    fn agent(id: &str, gpus: u32) -> AgentInfo {
        AgentInfo {
            share_gpus: None,
            id: id.into(),
            hostname: format!("{id}.local"),
            address: "127.0.0.1:7051".into(),
            total: Resources {
                cpus: 8.0,
                mem_mib: 16384,
                gpus,
                ports: 0,
            },
            gpus: (0..gpus)
                .map(|i| GpuInfo::new(format!("GPU-{id}-{i}"), i, "A100", 40960))
                .collect(),
            runtimes: vec![Runtime::Docker, Runtime::Process],
            simulated_gpus: true,
            attributes: Default::default(),
            driver_version: None,
            cuda_driver_version: None,
            allow_root_tasks: false,
            allowed_mounts: Vec::new(),
            ports: None,
        }
    }

    #[test]
    fn a_repeated_submit_key_returns_the_first_job_until_it_expires() {
        let mut t = T::new();
        let submit = |key: &str, at_ms: u64| Command::SubmitJob {
            spec: spec(0),
            at_ms,
            request_id: Some(key.into()),
        };
        let first = t.apply(submit("k1", 1_000)).unwrap();
        let again = t.apply(submit("k1", 2_000)).unwrap();
        assert_eq!(first, again);
        assert_eq!(t.s.jobs.len(), 1, "no second job");
        t.apply(submit("k2", 3_000)).unwrap();
        assert_eq!(t.s.jobs.len(), 2);
        // After the TTL the key is forgotten (and only the old one).
        let later = 1_000 + super::super::SUBMIT_REQUEST_TTL_MS + 1;
        t.apply(submit("k3", later)).unwrap();
        assert!(!t.s.submit_requests.contains_key("k1"));
        assert!(t.s.submit_requests.contains_key("k2"));
        assert_eq!(t.s.submit_request_order.len(), 2);
        let fresh = t.apply(submit("k1", later + 1)).unwrap();
        assert_ne!(fresh, first);
        assert_eq!(t.s.jobs.len(), 4);
    }

    /// Request ids are scoped by their caller (`requests::request_key`):
    /// two callers' same id makes two jobs, each caller's resend its own.
    #[test]
    fn submit_keys_are_per_caller() {
        let mut t = T::new();
        let submit = |scope: &str, at_ms: u64| Command::SubmitJob {
            spec: spec(0),
            at_ms,
            request_id: Some(super::super::requests::request_key(scope, "nightly")),
        };
        let a = t.apply(submit("aaaa", 1_000)).unwrap();
        let b = t.apply(submit("bbbb", 1_001)).unwrap();
        assert_ne!(a, b, "another caller's same id is another request");
        assert_eq!(t.apply(submit("aaaa", 1_002)).unwrap(), a);
        assert_eq!(t.apply(submit("bbbb", 1_003)).unwrap(), b);
        assert_eq!(t.s.jobs.len(), 2);
        let Outcome::JobSubmitted { job_id } = &a else {
            panic!("{a:?}")
        };
        assert_eq!(t.s.submitted_job("aaaa/nightly"), Some(job_id));
        assert_eq!(t.s.submitted_job("nightly"), None);
    }

    /// A key sent again with another spec (a job file edited, a form
    /// changed after an unknown outcome) is refused, changing nothing,
    /// rather than answered with the first job.
    #[test]
    fn a_submit_key_reused_for_another_spec_is_refused() {
        let mut t = T::new();
        let submit = |gpus: u32, at_ms: u64| Command::SubmitJob {
            spec: spec(gpus),
            at_ms,
            request_id: Some("k1".into()),
        };
        t.apply(submit(0, 1_000)).unwrap();
        let before = t.s.clone();
        let err = t.apply(submit(1, 2_000)).unwrap_err();
        assert_eq!(
            err,
            ApplyError::RequestIdReused {
                job_id: "job-1".into()
            }
        );
        assert!(err.to_string().contains("request_id"), "{err}");
        let mut after = t.s.clone();
        after.applied_index = before.applied_index;
        assert_eq!(after, before, "a refused submit changes nothing");
        // Past the TTL the key is free for another job.
        let later = 1_000 + super::super::SUBMIT_REQUEST_TTL_MS + 1;
        assert_eq!(
            t.apply(submit(1, later)).unwrap(),
            Outcome::JobSubmitted {
                job_id: "job-2".into()
            }
        );
    }

    fn spec(gpus: u32) -> JobSpec {
        JobSpec {
            placement: Default::default(),
            name: "j".into(),
            image: None,
            command: vec!["true".into()],
            env: Default::default(),
            resources: Resources {
                cpus: 1.0,
                mem_mib: 128,
                gpus,
                ports: 0,
            },
            ..Default::default()
        }
    }

    struct T {
        s: State,
        i: u64,
    }

    impl T {
        fn new() -> T {
            T {
                s: State::new(),
                i: 0,
            }
        }
        fn apply(&mut self, c: Command) -> Result<Outcome, ApplyError> {
            self.i += 1;
            self.s.apply(self.i, &c)
        }
        fn register(&mut self, id: &str, gpus: u32) {
            self.apply(Command::RegisterAgent {
                info: agent(id, gpus),
                running_task_ids: vec![],
                at_ms: 1,
            })
            .unwrap();
        }
        fn submit(&mut self, gpus: u32) -> String {
            match self
                .apply(Command::SubmitJob {
                    spec: spec(gpus),
                    at_ms: 2,
                    request_id: None,
                })
                .unwrap()
            {
                Outcome::JobSubmitted { job_id } => job_id,
                o => panic!("{o:?}"),
            }
        }
        fn launch(&mut self, job: &str, agent: &str, gpus: &[&str]) -> Result<Outcome, ApplyError> {
            self.apply(Command::LaunchTasks {
                launches: vec![Launch {
                    job_id: job.into(),
                    agent_id: agent.into(),
                    gpu_uuids: gpus.iter().map(|s| s.to_string()).collect(),
                }],
                at_ms: 3,
            })
        }
        fn status(
            &mut self,
            task: &str,
            agent: &str,
            state: TaskState,
            code: Option<i32>,
        ) -> Outcome {
            self.apply(Command::UpdateTaskStatus {
                update: StatusUpdate {
                    gpu_memory_limit: false,
                    enforcement: None,
                    agent_id: agent.into(),
                    task_id: task.into(),
                    state,
                    exit_code: code,
                    message: String::new(),
                    uuid: Vec::new(),
                    gpu_unhealthy: false,
                    requires: Vec::new(),
                    fenced: false,
                    latest_state: None,
                },
                at_ms: 4,
            })
            .unwrap()
        }
    }

    #[test]
    fn job_lifecycle_to_success_frees_gpus() {
        let mut t = T::new();
        t.register("a1", 4);
        let j = t.submit(2);
        assert_eq!(j, "job-1");
        assert_eq!(t.s.queued_jobs().len(), 1);
        t.launch(&j, "a1", &["GPU-a1-0", "GPU-a1-1"]).unwrap();
        assert_eq!(t.s.jobs[&j].state, JobState::Starting);
        assert_eq!(t.s.gpu_owner.len(), 2);
        assert_eq!(t.s.agents["a1"].allocated.gpus, 2);
        assert_eq!(t.s.desired_tasks("a1").0.len(), 1);
        t.status("job-1.0", "a1", TaskState::Running, None);
        assert_eq!(t.s.jobs[&j].state, JobState::Running);
        t.status("job-1.0", "a1", TaskState::Finished, Some(0));
        assert_eq!(t.s.jobs[&j].state, JobState::Succeeded);
        assert!(t.s.gpu_owner.is_empty());
        assert_eq!(t.s.agents["a1"].allocated, Resources::default());
        assert!(t.s.desired_tasks("a1").0.is_empty());
        // A repeated final update is accepted and changes nothing.
        let before = t.s.clone();
        assert_eq!(
            t.status("job-1.0", "a1", TaskState::Finished, Some(0)),
            Outcome::StaleUpdate
        );
        assert_eq!(t.s.jobs, before.jobs);
    }

    #[test]
    fn nonzero_exit_fails_the_job() {
        let mut t = T::new();
        t.register("a1", 0);
        let j = t.submit(0);
        t.launch(&j, "a1", &[]).unwrap();
        t.status("job-1.0", "a1", TaskState::Failed, Some(3));
        assert_eq!(t.s.jobs[&j].state, JobState::Failed);
        assert!(t.s.jobs[&j].message.contains("code 3"));
        assert_eq!(t.s.tasks["job-1.0"].exit_code, Some(3));
    }

    #[test]
    fn a_gpu_is_never_given_twice() {
        let mut t = T::new();
        t.register("a1", 2);
        let j1 = t.submit(1);
        let j2 = t.submit(1);
        t.launch(&j1, "a1", &["GPU-a1-0"]).unwrap();
        let before = t.s.clone();
        let err = t.launch(&j2, "a1", &["GPU-a1-0"]).unwrap_err();
        assert!(matches!(err, ApplyError::GpuTaken { .. }), "{err}");
        // Refused: nothing changed but the applied index.
        assert_eq!(t.s.jobs, before.jobs);
        assert_eq!(t.s.gpu_owner, before.gpu_owner);
        // The same GPU twice in one command is refused too, all or nothing.
        let j3 = t.submit(1);
        let err = t
            .apply(Command::LaunchTasks {
                launches: vec![
                    Launch {
                        job_id: j2.clone(),
                        agent_id: "a1".into(),
                        gpu_uuids: vec!["GPU-a1-1".into()],
                    },
                    Launch {
                        job_id: j3.clone(),
                        agent_id: "a1".into(),
                        gpu_uuids: vec!["GPU-a1-1".into()],
                    },
                ],
                at_ms: 5,
            })
            .unwrap_err();
        assert!(matches!(err, ApplyError::GpuTaken { .. }));
        assert_eq!(t.s.jobs[&j2].state, JobState::Queued);
        assert_eq!(t.s.jobs[&j3].state, JobState::Queued);
    }

    #[test]
    fn launch_checks_fit_runtime_and_gpu_ownership() {
        let mut t = T::new();
        t.register("a1", 1);
        t.register("a2", 1);
        let j = t.submit(1);
        assert!(matches!(
            t.launch(&j, "a1", &["GPU-a2-0"]),
            Err(ApplyError::DoesNotFit(_))
        ));
        assert!(matches!(
            t.launch(&j, "a1", &[]),
            Err(ApplyError::DoesNotFit(_))
        ));
        assert!(matches!(
            t.launch(&j, "nope", &["GPU-a1-0"]),
            Err(ApplyError::AgentNotFound(_))
        ));
        assert!(matches!(
            t.launch("job-99", "a1", &["GPU-a1-0"]),
            Err(ApplyError::JobNotFound(_))
        ));
        // CPU and memory count too.
        let mut big = spec(0);
        big.resources.cpus = 100.0;
        t.apply(Command::SubmitJob {
            spec: big,
            at_ms: 1,
            request_id: None,
        })
        .unwrap();
        assert!(matches!(
            t.launch("job-2", "a1", &[]),
            Err(ApplyError::DoesNotFit(_))
        ));
        // An image job needs an agent with Docker.
        let mut info = agent("a3", 0);
        info.runtimes = vec![Runtime::Process];
        t.apply(Command::RegisterAgent {
            info,
            running_task_ids: vec![],
            at_ms: 1,
        })
        .unwrap();
        let mut img = spec(0);
        img.image = Some("busybox".into());
        t.apply(Command::SubmitJob {
            spec: img,
            at_ms: 1,
            request_id: None,
        })
        .unwrap();
        let err = t.launch("job-3", "a3", &[]).unwrap_err();
        assert!(err.to_string().contains("docker"), "{err}");
    }

    #[test]
    fn lost_agent_loses_its_tasks_but_holds_gpus_until_it_registers_again() {
        let mut t = T::new();
        t.register("a1", 2);
        let j = t.submit(2);
        t.launch(&j, "a1", &["GPU-a1-0", "GPU-a1-1"]).unwrap();
        t.status("job-1.0", "a1", TaskState::Running, None);
        t.apply(Command::AgentUnreachable {
            agent_id: "a1".into(),
            at_ms: 8,
        })
        .unwrap();
        assert_eq!(t.s.jobs[&j].state, JobState::Running);
        t.apply(Command::AgentLostAfterTimeout {
            agent_id: "a1".into(),
            at_ms: 9,
        })
        .unwrap();
        assert_eq!(t.s.agents["a1"].state, AgentState::Lost);
        assert_eq!(t.s.tasks["job-1.0"].state, TaskState::Lost);
        assert_eq!(t.s.jobs[&j].state, JobState::Failed);
        // The agent has not said the task is gone: its GPUs stay held.
        assert_eq!(t.s.gpu_owner.len(), 2);
        // A lost agent gets no launches until it registers again.
        let j2 = t.submit(1);
        assert!(matches!(
            t.launch(&j2, "a1", &["GPU-a1-0"]),
            Err(ApplyError::AgentLost(_))
        ));
        // Back without the task: its word that the task is gone.
        t.register("a1", 2);
        assert!(t.s.gpu_owner.is_empty());
        t.launch(&j2, "a1", &["GPU-a1-0"]).unwrap();
    }

    #[test]
    fn reregistration_keeps_listed_tasks_and_loses_the_rest() {
        let mut t = T::new();
        t.register("a1", 2);
        let j1 = t.submit(1);
        let j2 = t.submit(1);
        t.launch(&j1, "a1", &["GPU-a1-0"]).unwrap();
        t.launch(&j2, "a1", &["GPU-a1-1"]).unwrap();
        let j3 = t.submit(0);
        t.launch(&j3, "a1", &[]).unwrap();
        t.status("job-2.0", "a1", TaskState::Running, None);
        t.apply(Command::RegisterAgent {
            info: agent("a1", 2),
            running_task_ids: vec!["job-1.0".into()],
            at_ms: 5,
        })
        .unwrap();
        assert_eq!(t.s.tasks["job-1.0"].state, TaskState::Staging);
        // It ran there and the agent no longer has it: lost.
        assert_eq!(t.s.tasks["job-2.0"].state, TaskState::Lost);
        // Placed while the agent was away: not lost, still to be delivered.
        assert_eq!(t.s.tasks["job-3.0"].state, TaskState::Staging);
        assert_eq!(t.s.desired_tasks("a1").0.len(), 2);
        assert_eq!(t.s.gpu_owner.len(), 1);
        assert_eq!(t.s.agents["a1"].allocated.gpus, 1);
    }

    #[test]
    fn two_agents_cannot_claim_one_gpu() {
        let mut t = T::new();
        t.register("a1", 1);
        let mut info = agent("a2", 1);
        info.gpus[0].uuid = "GPU-a1-0".into();
        let err = t
            .apply(Command::RegisterAgent {
                info,
                running_task_ids: vec![],
                at_ms: 1,
            })
            .unwrap_err();
        assert!(matches!(err, ApplyError::GpuClaimed { .. }));
        assert!(!t.s.agents.contains_key("a2"));
    }

    #[test]
    fn cancel_queued_and_running_jobs() {
        let mut t = T::new();
        t.register("a1", 1);
        let j1 = t.submit(1);
        let j2 = t.submit(1);
        t.launch(&j1, "a1", &["GPU-a1-0"]).unwrap();
        t.status("job-1.0", "a1", TaskState::Running, None);
        // Queued: cancelled at once.
        assert_eq!(
            t.apply(Command::CancelJob {
                job_id: j2.clone(),
                at_ms: 5
            })
            .unwrap(),
            Outcome::JobCancelled {
                state: JobState::Cancelled
            }
        );
        // Running: the task leaves the agent's desired set; the job is
        // CANCELLED once the agent reports it killed.
        t.apply(Command::CancelJob {
            job_id: j1.clone(),
            at_ms: 6,
        })
        .unwrap();
        assert!(t.s.desired_tasks("a1").0.is_empty());
        assert_eq!(t.s.jobs[&j1].state, JobState::Running);
        t.status("job-1.0", "a1", TaskState::Killed, None);
        assert_eq!(t.s.jobs[&j1].state, JobState::Cancelled);
        assert!(t.s.gpu_owner.is_empty());
        assert!(matches!(
            t.apply(Command::CancelJob {
                job_id: "job-42".into(),
                at_ms: 7
            }),
            Err(ApplyError::JobNotFound(_))
        ));
    }

    #[test]
    fn updates_from_the_wrong_agent_or_backwards_are_refused() {
        let mut t = T::new();
        t.register("a1", 0);
        t.register("a2", 0);
        let j = t.submit(0);
        t.launch(&j, "a1", &[]).unwrap();
        assert!(matches!(
            t.apply(Command::UpdateTaskStatus {
                update: StatusUpdate {
                    gpu_memory_limit: false,
                    enforcement: None,
                    agent_id: "a2".into(),
                    task_id: "job-1.0".into(),
                    state: TaskState::Finished,
                    exit_code: Some(0),
                    message: String::new(),
                    uuid: Vec::new(),
                    gpu_unhealthy: false,
                    requires: Vec::new(),
                    fenced: false,
                    latest_state: None,
                },
                at_ms: 1
            }),
            Err(ApplyError::WrongAgent { .. })
        ));
        t.status("job-1.0", "a1", TaskState::Running, None);
        assert_eq!(
            t.status("job-1.0", "a1", TaskState::Starting, None),
            Outcome::StaleUpdate
        );
        assert_eq!(t.s.tasks["job-1.0"].state, TaskState::Running);
        assert_eq!(
            t.status("job-9.0", "a1", TaskState::Running, None),
            Outcome::StaleUpdate
        );
    }

    /// Issue 33: a GPU in MIG mode is never given whole, neither by the
    /// scheduler nor by a launch naming it (CUDA would see none of it).
    #[test]
    fn a_gpu_in_mig_mode_is_never_given_whole() {
        let mut t = T::new();
        let mut info = agent("a1", 2);
        info.gpus[0].mig.enabled = true;
        t.apply(Command::RegisterAgent {
            info,
            running_task_ids: vec![],
            at_ms: 1,
        })
        .unwrap();
        let j = t.submit(1);
        let err = t.launch(&j, "a1", &["GPU-a1-0"]).unwrap_err();
        assert!(err.to_string().contains("MIG mode"), "{err}");
        assert!(t.s.gpu_owner.is_empty());
        let l = crate::scheduler::place(&t.s, &Default::default(), &Default::default());
        assert_eq!(l[0].gpu_uuids, vec!["GPU-a1-1".to_string()]);
        // A job needing both GPUs cannot be placed.
        let j2 = t.submit(2);
        let l = crate::scheduler::place(&t.s, &Default::default(), &Default::default());
        assert!(l.iter().all(|p| p.job_id != j2), "{l:?}");
    }

    #[test]
    fn a_cordoned_gpu_is_not_launched_on_until_uncordoned() {
        let mut t = T::new();
        t.register("a1", 2);
        let j = t.submit(1);
        let cordon = |uuid: &str, cordon: bool| Command::CordonGpu {
            uuid: uuid.into(),
            cordon,
        };
        let err = t.apply(cordon("GPU-nope", true)).unwrap_err();
        assert!(err.to_string().contains("uuid"), "{err}");
        assert!(t.s.cordoned.is_empty());
        t.apply(cordon("GPU-a1-0", true)).unwrap();
        let err = t.launch(&j, "a1", &["GPU-a1-0"]).unwrap_err();
        assert!(err.to_string().contains("cordoned"), "{err}");
        // The scheduler does not pick it either.
        let l = crate::scheduler::place(&t.s, &Default::default(), &Default::default());
        assert_eq!(l[0].gpu_uuids, vec!["GPU-a1-1".to_string()]);
        // It survives the agent registering again; uncordon gives it back.
        t.register("a1", 2);
        assert!(t.s.cordoned.contains("GPU-a1-0"));
        t.apply(cordon("GPU-a1-0", false)).unwrap();
        t.launch(&j, "a1", &["GPU-a1-0"]).unwrap();
    }

    #[test]
    fn gpu_health_changes_are_recorded_all_or_nothing() {
        let mut t = T::new();
        t.register("a1", 2);
        t.register("a2", 1);
        let j = t.submit(1);
        let health = |agent: &str, gpus: &[(&str, bool)]| Command::SetGpuHealth {
            agent_id: agent.into(),
            gpus: gpus
                .iter()
                .map(|(uuid, healthy)| crate::state::GpuHealthChange {
                    uuid: uuid.to_string(),
                    healthy: *healthy,
                    reason: if *healthy {
                        String::new()
                    } else {
                        "XID 79".into()
                    },
                })
                .collect(),
            at_ms: 5,
        };
        // A GPU of another agent (or none): nothing is applied.
        let before = t.s.clone();
        let err = t
            .apply(health("a1", &[("GPU-a1-0", false), ("GPU-a2-0", false)]))
            .unwrap_err();
        assert!(err.to_string().contains("gpus"), "{err}");
        assert_eq!(t.s.agents, before.agents);
        assert!(t.apply(health("nope", &[])).is_err());
        t.apply(health("a1", &[("GPU-a1-0", false)])).unwrap();
        let g = &t.s.agents["a1"].info.gpus[0];
        assert!(!g.healthy);
        assert_eq!(g.unhealthy_reason, "XID 79");
        // Neither launched on nor chosen by the scheduler.
        let err = t.launch(&j, "a1", &["GPU-a1-0"]).unwrap_err();
        assert!(err.to_string().contains("unhealthy"), "{err}");
        let l = crate::scheduler::place(&t.s, &Default::default(), &Default::default());
        assert_ne!(l[0].gpu_uuids, vec!["GPU-a1-0".to_string()]);
        // Healthy again: the reason goes and the GPU can be used.
        t.apply(health("a1", &[("GPU-a1-0", true)])).unwrap();
        let g = &t.s.agents["a1"].info.gpus[0];
        assert!(g.healthy && g.unhealthy_reason.is_empty());
        t.launch(&j, "a1", &["GPU-a1-0"]).unwrap();
    }

    #[test]
    fn apply_is_deterministic() {
        let cmds = [
            Command::RegisterAgent {
                info: agent("a1", 4),
                running_task_ids: vec![],
                at_ms: 1,
            },
            Command::SubmitJob {
                spec: spec(2),
                at_ms: 2,
                request_id: None,
            },
            Command::LaunchTasks {
                launches: vec![Launch {
                    job_id: "job-1".into(),
                    agent_id: "a1".into(),
                    gpu_uuids: vec!["GPU-a1-2".into(), "GPU-a1-3".into()],
                }],
                at_ms: 3,
            },
            Command::AgentUnreachable {
                agent_id: "a1".into(),
                at_ms: 4,
            },
            Command::DrainAgent {
                agent_id: "a1".into(),
                kill: false,
                deadline_ms: Some(9),
                at_ms: 5,
            },
            Command::AgentLostAfterTimeout {
                agent_id: "a1".into(),
                at_ms: 6,
            },
            Command::AgentLost {
                agent_id: "a1".into(),
                at_ms: 7,
            },
            Command::ForgetJobs {
                job_ids: vec!["job-1".into()],
                at_ms: 8,
            },
        ];
        let run = || {
            let mut s = State::new();
            for (i, c) in cmds.iter().enumerate() {
                // Round-trip through the log encoding, as replay does.
                let c = Command::decode(&c.encode().unwrap()).unwrap();
                let _ = s.apply(i as u64 + 1, &c);
            }
            s
        };
        assert_eq!(run(), run());
        assert_eq!(run().applied_index, 8);
        // Its task is LOST but holds its GPUs (unconfirmed): kept.
        assert!(run().jobs.contains_key("job-1"));
    }
}
