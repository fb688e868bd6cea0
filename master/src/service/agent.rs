//! AgentManager: agents register, heartbeat, watch their desired tasks and
//! report task status.

use std::pin::Pin;

use futures::Stream;
use gpuctl_core::convert::MAX_STATUS_BATCH;
use gpuctl_core::types::{AgentInfo, GpuReport, RuntimeStatus, StatusUpdate, TaskSpec, TaskState};
use gpuctl_core::ConvertError;
use gpuctl_proto::pb;
use tonic::{Code, Request, Response, Status};

use super::auth::Caller;
use super::task_stream::{self, TaskStream};
use super::{reply, Ctx, MustRegister, ServiceError};
use crate::now_ms;
use crate::state::{AgentState, Command, GpuHealthChange};

/// The reported GPUs whose health differs from the state's (GPUs the
/// agent did not register are left out: registration names them).
fn health_changes(ctx: &Ctx, agent_id: &str, reports: &[GpuReport]) -> Vec<GpuHealthChange> {
    let state = ctx.raft.state();
    let Some(agent) = state.agent(agent_id) else {
        return Vec::new();
    };
    reports
        .iter()
        .filter(|r| {
            agent.info.gpus.iter().any(|g| {
                g.uuid == r.uuid
                    && (g.healthy != r.healthy
                        || (!r.healthy && g.unhealthy_reason != r.unhealthy_reason))
            })
        })
        .map(|r| GpuHealthChange {
            uuid: r.uuid.clone(),
            healthy: r.healthy,
            reason: r.unhealthy_reason.clone(),
        })
        .collect()
}

type TaskStreamOut = Pin<Box<dyn Stream<Item = Result<pb::DesiredTasks, Status>> + Send>>;

pub struct AgentManagerService {
    pub(super) ctx: Ctx,
}

/// Whether the agent may heartbeat and watch its tasks: registered and
/// ACTIVE. An agent the leader marked UNREACHABLE or LOST must register
/// again, listing the tasks it runs: that is what brings them back.
fn agent_known(ctx: &Ctx, agent_id: &str) -> Result<(), ServiceError> {
    let why = match ctx.raft.state().agent(agent_id).map(|a| a.state) {
        Some(AgentState::Active) => return Ok(()),
        Some(AgentState::Unreachable) => MustRegister::Unreachable,
        Some(AgentState::Lost) => MustRegister::Lost,
        None => MustRegister::Unknown,
    };
    Err(ServiceError::MustRegister {
        agent_id: agent_id.to_string(),
        why,
    })
}

/// Restarts the leader's clock for an agent it knows and has not declared
/// LOST (an UNREACHABLE one too: it must register again, but it is alive,
/// and counting its silence further would declare it lost). Whether the
/// clock was restarted.
fn touch_if_known(ctx: &Ctx, agent_id: &str) -> bool {
    if ctx.raft.status().role != crate::raft::Role::Leader {
        return false;
    }
    let known = matches!(
        ctx.raft.state().agent(agent_id).map(|a| a.state),
        Some(AgentState::Active | AgentState::Unreachable)
    );
    if known {
        ctx.liveness.touch(agent_id);
    }
    known
}

#[tonic::async_trait]
impl pb::agent_manager_server::AgentManager for AgentManagerService {
    type WatchTasksStream = TaskStreamOut;
    async fn register(
        &self,
        req: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        Caller::of(&req).check_agent(&req.get_ref().agent_id)?;
        reply(self.register(req.into_inner()).await)
    }

    async fn heartbeat(
        &self,
        req: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        Caller::of(&req).check_agent(&req.get_ref().agent_id)?;
        let id = req.get_ref().agent_id.clone();
        // Heard even when refused: the leader's clock for the agent
        // restarted, so the agent's fence may count from this answer.
        let heard = touch_if_known(&self.ctx, &id);
        reply(self.heartbeat(req.into_inner()).await).map_err(|s| {
            if heard {
                gpuctl_proto::leader::mark_heard(s)
            } else {
                s
            }
        })
    }

    async fn watch_tasks(
        &self,
        req: Request<pb::WatchTasksRequest>,
    ) -> Result<Response<Self::WatchTasksStream>, Status> {
        Caller::of(&req).check_agent(&req.get_ref().agent_id)?;
        reply(self.watch_tasks(req.into_inner()).await)
    }

    async fn update_status(
        &self,
        req: Request<pb::StatusUpdate>,
    ) -> Result<Response<pb::StatusAck>, Status> {
        // The state checks that the task is this agent's (WrongAgent).
        Caller::of(&req).check_agent(&req.get_ref().agent_id)?;
        reply(self.update_status(req.into_inner()).await)
    }

    async fn update_statuses(
        &self,
        req: Request<pb::StatusUpdates>,
    ) -> Result<Response<pb::StatusVerdicts>, Status> {
        let caller = Caller::of(&req);
        for u in &req.get_ref().updates {
            caller.check_agent(&u.agent_id)?;
        }
        reply(self.update_statuses(req.into_inner()).await)
    }
}

/// One agent's WatchTasks stream (see `watch_tasks`).
///
/// Kept small: the leader holds one per connected agent, idle or not (no
/// copy of `Ctx`, whose config alone was 450 bytes of heap per agent).
struct TaskWatch {
    raft: crate::raft::RaftHandle,
    agent_id: String,
    /// Incremental agents get a snapshot, then differences, in messages of
    /// bounded size; older agents the full set on every change.
    incremental: bool,
    wakeup: crate::raft::AgentWakeup,
    /// Who leads (not every commit: see `RaftHandle::role_watch`).
    status: tokio::sync::watch::Receiver<crate::raft::RoleStatus>,
    shutdown: tokio::sync::watch::Receiver<bool>,
    stream: TaskStream,
    last: Option<(Vec<TaskSpec>, Vec<String>)>,
    /// Messages of one update not yet sent.
    pending: std::collections::VecDeque<pb::DesiredTasks>,
    ended: bool,
}

impl TaskWatch {
    /// The next message; `None` ends the stream.
    async fn next(&mut self) -> Option<Result<pb::DesiredTasks, Status>> {
        loop {
            if self.ended {
                return None;
            }
            if let Some(msg) = self.pending.pop_front() {
                if self.pending.is_empty() {
                    // An emptied queue keeps its capacity; an idle stream
                    // should hold nothing (about 500 bytes per agent).
                    self.pending = std::collections::VecDeque::new();
                }
                return Some(Ok(msg));
            }
            if *self.shutdown.borrow() {
                return None;
            }
            if !self.status.borrow().serving {
                // Deposed: send the agent to the new leader.
                self.ended = true;
                let leader = self.raft.leader();
                return Some(Err(ServiceError::NotLeader { leader }.into()));
            }
            let msgs = self.changes();
            if !msgs.is_empty() {
                self.pending.extend(msgs);
                continue;
            }
            tokio::select! {
                _ = self.wakeup.changed() => {},
                r = self.status.changed() => if r.is_err() { return None },
                _ = self.shutdown.changed() => return None,
            }
        }
    }

    /// The messages that bring the agent up to date, none if it is.
    fn changes(&mut self) -> Vec<pb::DesiredTasks> {
        let state = self.raft.state();
        if self.incremental {
            let (run, kill) = state.desired_task_ids(&self.agent_id);
            return self.stream.update_with(run, kill, |id| state.task_spec(id));
        }
        let desired = state.desired_tasks(&self.agent_id);
        if self.last.as_ref() == Some(&desired) {
            return Vec::new();
        }
        let kill_notices = desired
            .1
            .iter()
            .filter_map(|id| {
                let n = state.stop_notice(state.task(id)?);
                Some((
                    id.clone(),
                    pb::StopNotice {
                        kind: n.kind,
                        message: n.message,
                    },
                ))
            })
            .collect();
        let msg = pb::DesiredTasks {
            tasks: desired.0.iter().cloned().map(Into::into).collect(),
            kill: desired.1.clone(),
            kill_notices,
            ..Default::default()
        };
        self.last = Some(desired);
        vec![msg]
    }
}

/// Each RPC's logic; the `AgentManager` impl above only turns its
/// errors into `Status` (`reply`).
impl AgentManagerService {
    async fn register(
        &self,
        req: pb::RegisterRequest,
    ) -> Result<pb::RegisterResponse, ServiceError> {
        let running = req.running_task_ids.clone();
        let kill_grace_ms = req.kill_grace_ms;
        let info = AgentInfo::try_from(req)?;
        let agent_id = info.id.clone();
        // An agent that could not stop its tasks before this master
        // declares them LOST must not run any (see check_kill_grace).
        if let Err(e) = self.ctx.config.check_kill_grace(kill_grace_ms) {
            tracing::warn!(agent_id = %agent_id, kill_grace_ms, error = %e, "agent registration refused");
            return Err(ServiceError::KillGrace {
                agent_id,
                reason: e,
            });
        }
        tracing::info!(agent_id = %agent_id, hostname = %info.hostname, gpus = info.gpus.len(), "agent registering");
        // Counts as a heartbeat, so a slow commit cannot get it marked lost.
        self.ctx.liveness.touch(&agent_id);
        // Every agent registers again when a new leader takes over, most
        // with nothing changed: those are answered from the state, without
        // a write, once it holds all that came before (`caught_up`).
        let caught_up = tokio::time::timeout(
            self.ctx.config.heartbeat_interval,
            self.ctx.raft.caught_up(),
        )
        .await;
        let unchanged = matches!(caught_up, Ok(Ok(())))
            && self
                .ctx
                .raft
                .state()
                .registration_changes_nothing(&info, &running);
        if unchanged {
            tracing::debug!(agent_id = %agent_id, "agent registered again, unchanged: nothing to write");
        } else {
            self.ctx
                .raft
                .propose(Command::RegisterAgent {
                    info,
                    running_task_ids: running,
                    at_ms: now_ms(),
                })
                .await?;
            self.ctx.hub.wake();
        }
        self.ctx.liveness.touch(&agent_id);
        let agents = self.ctx.raft.state().agents().len();
        Ok(pb::RegisterResponse {
            heartbeat_interval_ms: self.ctx.config.heartbeat_interval_for(agents).as_millis()
                as u32,
            fence_timeout_ms: self.ctx.config.agent_fence_timeout.as_millis() as u64,
        })
    }

    async fn heartbeat(
        &self,
        req: pb::HeartbeatRequest,
    ) -> Result<pb::HeartbeatResponse, ServiceError> {
        let id = req.agent_id;
        agent_known(&self.ctx, &id)?;
        let reports = req
            .gpus
            .into_iter()
            .map(GpuReport::try_from)
            .collect::<Result<Vec<_>, _>>()?;
        let runtimes = req
            .runtimes
            .into_iter()
            .map(RuntimeStatus::try_from)
            .collect::<Result<Vec<_>, _>>()?;
        self.ctx.liveness.record_runtimes(&id, runtimes);
        // Record what changed in the GPUs' health; the readings stay in
        // memory (they change every probe and matter only while fresh).
        let changes = health_changes(&self.ctx, &id, &reports);
        self.ctx.liveness.record_gpus(&id, reports);
        if !changes.is_empty() {
            for c in &changes {
                if c.healthy {
                    tracing::info!(agent_id = %id, gpu = %c.uuid, "GPU healthy again");
                } else {
                    tracing::warn!(agent_id = %id, gpu = %c.uuid, reason = %c.reason, "GPU unhealthy: no longer offered");
                }
            }
            let propose = self.ctx.raft.propose(Command::SetGpuHealth {
                agent_id: id.clone(),
                gpus: changes,
                at_ms: now_ms(),
            });
            // Answered within a heartbeat interval even when the masters
            // are slow to commit (the agent's fence counts from answers):
            // every heartbeat carries every GPU's health, so a change not
            // committed yet is proposed again by the next one.
            match tokio::time::timeout(self.ctx.config.heartbeat_interval, propose).await {
                Ok(r) => {
                    r?;
                    self.ctx.hub.wake();
                }
                Err(_) => {
                    tracing::info!(agent_id = %id, "GPU health change not committed within a heartbeat interval; the next heartbeat proposes it again");
                }
            }
        }
        self.record_mig_results(&id, req.mig_results).await?;
        let state = self.ctx.raft.state();
        Ok(pb::HeartbeatResponse {
            mig_changes: state
                .mig_changes_of(&id)
                .map(super::operator::mig_change_to_pb)
                .collect(),
            heartbeat_interval_ms: self
                .ctx
                .config
                .heartbeat_interval_for(state.agents().len())
                .as_millis() as u32,
        })
    }

    /// Records the outcome of each MIG layout change the agent reports
    /// and the state still has under way (once committed, the agent
    /// stops reporting it: the heartbeat answer no longer lists it).
    async fn record_mig_results(
        &self,
        agent_id: &str,
        results: Vec<pb::MigResult>,
    ) -> Result<(), ServiceError> {
        if results.len() > gpuctl_core::convert::MAX_AGENT_GPUS {
            return Err(gpuctl_core::convert::ConvertError::new(
                "mig_results",
                format!(
                    "has {} results, at most {}",
                    results.len(),
                    gpuctl_core::convert::MAX_AGENT_GPUS
                ),
            )
            .into());
        }
        let mut commands = Vec::new();
        for (i, r) in results.into_iter().enumerate() {
            let field = format!("mig_results[{i}].gpu");
            let gpu = gpuctl_core::convert::gpu_from_pb(&field, r.gpu.unwrap_or_default())?;
            if gpu.uuid != r.gpu_uuid {
                return Err(gpuctl_core::convert::ConvertError::new(
                    format!("{field}.uuid"),
                    format!("is {}, the result is of {}", gpu.uuid, r.gpu_uuid),
                )
                .into());
            }
            let under_way = self
                .ctx
                .raft
                .state()
                .mig_change(&gpu.uuid)
                .is_some_and(|c| c.generation == r.generation && c.agent_id == agent_id);
            if !under_way {
                continue;
            }
            let error = (!r.ok).then(|| gpuctl_core::convert::cut(&r.message, 1024));
            match &error {
                None => {
                    tracing::info!(agent_id, gpu = %gpu.uuid, generation = r.generation, "MIG layout applied")
                }
                Some(e) => {
                    tracing::warn!(agent_id, gpu = %gpu.uuid, generation = r.generation, error = %e, "MIG layout change failed")
                }
            }
            commands.push(Command::MigLayoutDone {
                agent_id: agent_id.to_string(),
                generation: r.generation,
                gpu,
                error,
            });
        }
        for c in commands {
            // As with health: answered within a heartbeat interval; a
            // result not committed by then is sent again by the next one.
            let propose = self.ctx.raft.propose(c);
            match tokio::time::timeout(self.ctx.config.heartbeat_interval, propose).await {
                Ok(r) => {
                    r?;
                    self.ctx.hub.wake();
                }
                Err(_) => return Ok(()),
            }
        }
        Ok(())
    }

    /// The agent's desired tasks, as a stream that computes its next
    /// message when the connection asks for one: no task and no channel per
    /// agent (they were 8 KB of each agent's bookkeeping at the leader),
    /// and changes made while the agent reads coalesce into one difference.
    async fn watch_tasks(&self, req: pb::WatchTasksRequest) -> Result<TaskStreamOut, ServiceError> {
        let (agent_id, incremental) = (req.agent_id, req.incremental);
        agent_known(&self.ctx, &agent_id)?;
        let raft = self.ctx.raft.clone();
        let watch = TaskWatch {
            // Subscribed before the first look at the state: no change is missed.
            wakeup: raft.agent_wakeup(&agent_id),
            status: raft.role_watch(),
            shutdown: self.ctx.shutdown.clone(),
            raft,
            agent_id,
            incremental,
            stream: TaskStream::new(task_stream::MESSAGE_BUDGET),
            last: None,
            pending: std::collections::VecDeque::new(),
            ended: false,
        };
        Ok(Box::pin(futures::stream::unfold(
            watch,
            |mut w| async move {
                let msg = w.next().await?;
                Some((msg, w))
            },
        )))
    }

    /// Records the updates concurrently, so that their commands reach Raft
    /// together and share its writes (group commit).
    async fn update_statuses(
        &self,
        req: pb::StatusUpdates,
    ) -> Result<pb::StatusVerdicts, ServiceError> {
        if req.updates.len() > MAX_STATUS_BATCH {
            return Err(ConvertError::new(
                "updates",
                format!(
                    "{} updates, at most {MAX_STATUS_BATCH} in one call",
                    req.updates.len()
                ),
            )
            .into());
        }
        let results =
            futures::future::join_all(req.updates.into_iter().map(|u| self.update_status(u))).await;
        let mut verdicts = Vec::with_capacity(results.len());
        for r in results {
            use pb::status_verdict::Kind;
            let verdict = match r {
                Ok(ack) if ack.acknowledged => (Kind::Acknowledged, String::new()),
                Ok(_) => (Kind::Recorded, String::new()),
                Err(e) => {
                    let status = Status::from(e);
                    if !matches!(
                        status.code(),
                        Code::InvalidArgument | Code::FailedPrecondition | Code::NotFound
                    ) {
                        // Not the leader, busy, ...: none is surely recorded.
                        return Err(ServiceError::Relayed(status));
                    }
                    (Kind::Refused, status.message().to_string())
                }
            };
            verdicts.push(pb::StatusVerdict {
                kind: verdict.0 as i32,
                message: verdict.1,
            });
        }
        Ok(pb::StatusVerdicts { verdicts })
    }

    async fn update_status(&self, req: pb::StatusUpdate) -> Result<pb::StatusAck, ServiceError> {
        let update = StatusUpdate::try_from(req)?;
        self.ctx.liveness.touch(&update.agent_id);
        let (task_id, uuid) = (update.task_id.clone(), update.uuid.clone());
        // A resend of an update already recorded (waiting for its framework's
        // acknowledgement) is answered from the state, not logged again.
        // Unless it now says the task ended behind it (latest_state): that
        // frees the task's GPUs, once.
        let ended_behind = update.latest_state.is_some_and(TaskState::is_terminal);
        let recorded = !uuid.is_empty()
            && self.ctx.raft.state().task(&task_id).is_some_and(|t| {
                t.last_update_uuid == uuid
                    && !(ended_behind && !t.state.is_terminal() && !t.released)
            });
        if !recorded {
            tracing::info!(task_id = %update.task_id, agent_id = %update.agent_id, state = %update.state, exit_code = ?update.exit_code, "task status");
            // Launch latency: from the launch's commit to the first RUNNING.
            let launched_at_ms = (update.state == TaskState::Running)
                .then(|| {
                    self.ctx
                        .raft
                        .state()
                        .task(&task_id)
                        .filter(|t| matches!(t.state, TaskState::Staging | TaskState::Starting))
                        .map(|t| t.created_at_ms)
                })
                .flatten();
            self.ctx
                .raft
                .propose(Command::UpdateTaskStatus {
                    update,
                    at_ms: now_ms(),
                })
                .await?;
            if let Some(at) = launched_at_ms {
                let secs = now_ms().saturating_sub(at) as f64 / 1000.0;
                self.ctx.hub.metrics.task_launch.observe(secs);
            }
        }
        let acknowledged = self.ctx.raft.state().is_acknowledged(&task_id, &uuid);
        Ok(pb::StatusAck { acknowledged })
    }
}
