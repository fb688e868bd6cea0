//! The Scheduler (framework) service: calls are validated here, turned
//! into replicated commands or leader-side offer bookkeeping (Hub).

use std::collections::{BTreeMap, BTreeSet};
use std::pin::Pin;

use futures::{Stream, StreamExt};
use gpuctl_core::convert::{check_id, framework_info_from_pb, framework_task_from_pb};
use gpuctl_core::types::{FrameworkTask, Resources};
use gpuctl_core::ConvertError;
use gpuctl_proto::pb;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use super::auth::Caller;
use super::{reply, Ctx, ServiceError};
use crate::allocator::refuse_until;
use crate::leader::frameworks::{task_status, EVENT_BUFFER};
use crate::now_ms;
use crate::state::access::TokenRole;
use crate::state::frameworks::task_key;
use crate::state::frameworks::BUILTIN_FRAMEWORK_ID;
use crate::state::{Command, Outcome, State};
use gpuctl_core::types::FrameworkInfo;

pub struct SchedulerService {
    pub(super) ctx: Ctx,
}

impl SchedulerService {
    fn leader(&self) -> Result<(), ServiceError> {
        if !self.ctx.raft.status().serving {
            return Err(ServiceError::FrameworkApiNotServed);
        }
        Ok(())
    }

    /// Whether Suppress/Revive's `roles` concern the role the framework is
    /// offered in (its first): an empty list means all its roles; a role it
    /// did not subscribe with is refused, naming it.
    fn names_offer_role(&self, framework_id: &str, roles: &[String]) -> Result<bool, ServiceError> {
        if roles.is_empty() {
            return Ok(true);
        }
        let state = self.ctx.raft.state();
        let Some(f) = state.framework(framework_id) else {
            return Err(ServiceError::NotSubscribed {
                framework_id: framework_id.to_string(),
            });
        };
        let mut names_it = false;
        for (i, r) in roles.iter().enumerate() {
            let subscribed = if f.info.roles.is_empty() {
                r == f.info.role()
            } else {
                f.info.roles.contains(r)
            };
            if !subscribed {
                return Err(ConvertError::new(
                    format!("roles[{i}]"),
                    format!("{r:?} is not one of the framework's roles"),
                )
                .into());
            }
            names_it |= r == f.info.role();
        }
        Ok(names_it)
    }

    /// Refuses unless `caller` may act for framework `framework_id`: the
    /// framework is its tenant's (admins: any), and never the built-in
    /// scheduler's (only the master itself acts for it). A framework the
    /// state does not know is left to the call's own answer.
    fn check_framework(&self, caller: &Caller, framework_id: &str) -> Result<(), ServiceError> {
        if *caller == Caller::Open {
            return Ok(());
        }
        if framework_id == BUILTIN_FRAMEWORK_ID {
            return Err(ServiceError::Forbidden(format!(
                "framework {framework_id} is the master's own job scheduler"
            )));
        }
        let state = self.ctx.raft.state();
        match state.framework(framework_id) {
            Some(f) if !caller.may_access(f.info.tenant.name()) => {
                Err(ServiceError::Forbidden(format!(
                    "framework {framework_id} belongs to another tenant than yours ({})",
                    caller.tenant()
                )))
            }
            _ => Ok(()),
        }
    }

    /// Checks a subscription or update against the caller's token (its
    /// roles must be among those the token allows; an existing framework
    /// must be the caller's tenant's) and sets the framework's tenant.
    fn authorize(&self, caller: &Caller, info: &mut FrameworkInfo) -> Result<(), ServiceError> {
        if let Caller::Token(t) = caller {
            if t.role == TokenRole::Framework {
                let asked: Vec<&str> = if info.roles.is_empty() {
                    vec![info.role()]
                } else {
                    info.roles.iter().map(String::as_str).collect()
                };
                if let Some(r) = asked
                    .iter()
                    .find(|r| !t.framework_roles.iter().any(|a| a == *r))
                {
                    return Err(ServiceError::Forbidden(format!(
                        "framework.roles: your token does not allow role {r:?} (it allows {})",
                        t.framework_roles.join(", ")
                    )));
                }
            }
        }
        if info.id.is_empty() {
            info.tenant = caller.tenant().into();
            return Ok(());
        }
        self.check_framework(caller, &info.id)?;
        let state = self.ctx.raft.state();
        info.tenant = match state.framework(&info.id) {
            Some(f) => f.info.tenant.clone(),
            None => caller.tenant().into(),
        };
        Ok(())
    }

    /// The framework must exist, not be removed, and be connected.
    fn connected(&self, framework_id: &str) -> Result<(), ServiceError> {
        check_id("framework_id", framework_id)?;
        self.leader()?;
        if !self.ctx.hub.is_connected(framework_id) {
            return Err(ServiceError::NotSubscribed {
                framework_id: framework_id.to_string(),
            });
        }
        Ok(())
    }
}

/// What the offers an Accept names hold on one agent.
#[derive(Debug, Default)]
struct Offered {
    resources: Resources,
    gpus: BTreeSet<String>,
    /// Shared GPUs: memory (MiB) and compute (percent) their fractions
    /// left when offered.
    shares: BTreeMap<String, (u64, u32)>,
}

/// What the tasks of an Accept checked so far take of its offers.
#[derive(Debug, Default)]
struct Used {
    resources: BTreeMap<String, Resources>,
    gpus: BTreeSet<String>,
    shares: BTreeMap<String, (u64, u32)>,
}

/// Checks a task (its shape already checked at the door) against the
/// offers named for it: its agent was offered, its GPUs are among that
/// agent's offered GPUs and named by no other task of the call, its
/// fraction is of a shared GPU offered there and, with the call's other
/// fractions of it, within what was offered of it, and all tasks on an
/// agent fit in what was offered there.
fn within_offers(
    field: &str,
    t: &FrameworkTask,
    offered: &BTreeMap<String, Offered>,
    used: &mut Used,
) -> Result<(), ConvertError> {
    let o = offered.get(&t.agent_id).ok_or_else(|| {
        ConvertError::new(
            format!("{field}.agent_id"),
            format!("{} is not in the accepted offers", t.agent_id),
        )
    })?;
    if let (Some(f), [uuid]) = (t.fraction, t.gpu_uuids.as_slice()) {
        let at = |name: &str| format!("{field}.gpu_fraction.{name}");
        let Some(&(mem, pct)) = o.shares.get(uuid) else {
            return Err(ConvertError::new(
                at("gpu_uuid"),
                format!(
                    "{uuid} was not offered as a shared GPU on agent {}",
                    t.agent_id
                ),
            ));
        };
        let e = used.shares.entry(uuid.clone()).or_default();
        *e = (
            e.0.saturating_add(f.mem_mib),
            e.1.saturating_add(f.compute_pct),
        );
        if e.0 > mem {
            return Err(ConvertError::new(
                at("mem_mib"),
                format!(
                    "{} MiB of GPU {uuid} asked by this call's fractions, {mem} MiB offered",
                    e.0
                ),
            ));
        }
        if e.1 > pct {
            return Err(ConvertError::new(
                at("compute_pct"),
                format!(
                    "{}% of GPU {uuid}'s compute asked by this call's fractions, {pct}% offered",
                    e.1
                ),
            ));
        }
    }
    let whole = if t.fraction.is_some() {
        &[][..]
    } else {
        t.gpu_uuids.as_slice()
    };
    for (i, g) in whole.iter().enumerate() {
        if o.shares.contains_key(g) {
            return Err(ConvertError::new(
                format!("{field}.gpu_uuids[{i}]"),
                format!("GPU {g} is shared: it is given only as fractions (gpu_fraction)"),
            ));
        }
        if !o.gpus.contains(g) {
            return Err(ConvertError::new(
                format!("{field}.gpu_uuids[{i}]"),
                format!("{g} was not offered on agent {}", t.agent_id),
            ));
        }
        if !used.gpus.insert(g.clone()) {
            return Err(ConvertError::new(
                format!("{field}.gpu_uuids[{i}]"),
                format!("GPU {g} is named by another task of this call"),
            ));
        }
    }
    let total = used.resources.entry(t.agent_id.clone()).or_default();
    *total = total.add(&t.resources);
    if !o.resources.fits(total) {
        return Err(ConvertError::new(
            format!("{field}.resources"),
            format!("more than offered on agent {}", t.agent_id),
        ));
    }
    Ok(())
}

/// Every operation of an Accept turned into its launch command, or the
/// first refusal, naming the field. Checked before any offer is taken, so
/// that a refused call leaves its offers outstanding.
fn launch_commands(
    state: &State,
    framework_id: &str,
    operations: Vec<pb::Operation>,
    offered: &BTreeMap<String, Offered>,
) -> Result<Vec<Command>, ServiceError> {
    let mut used = Used::default();
    let mut ids = BTreeSet::new();
    let mut commands = Vec::new();
    for (i, op) in operations.into_iter().enumerate() {
        let (launch, group) = match op.operation {
            Some(pb::operation::Operation::Launch(l)) => (l, false),
            Some(pb::operation::Operation::LaunchGroup(l)) => (l, true),
            None => return Err(ConvertError::new(format!("operations[{i}]"), "empty").into()),
        };
        let mut tasks = Vec::with_capacity(launch.tasks.len());
        for (j, t) in launch.tasks.into_iter().enumerate() {
            let field = format!("operations[{i}].tasks[{j}]");
            let t = framework_task_from_pb(&field, t)?;
            if !ids.insert(t.task_id.clone()) {
                return Err(ConvertError::new(
                    format!("{field}.task_id"),
                    format!("task id {} is named twice in this call", t.task_id),
                )
                .into());
            }
            if state.task(&task_key(framework_id, &t.task_id)).is_some() {
                return Err(ServiceError::TaskIdInUse {
                    field: format!("{field}.task_id"),
                    task_id: t.task_id,
                });
            }
            within_offers(&field, &t, offered, &mut used)?;
            tasks.push(t);
        }
        commands.push(Command::LaunchFrameworkTasks {
            framework_id: framework_id.to_string(),
            tasks,
            group,
            at_ms: now_ms(),
        });
    }
    Ok(commands)
}

/// Where a task of an Accept goes and what it takes.
struct Launched {
    agent_id: String,
    resources: Resources,
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::Event, Status>> + Send>>;

/// Lives as long as a framework's event stream: when tonic drops the
/// stream (the framework disconnected), the hub forgets that connection.
struct StreamGuard {
    hub: std::sync::Arc<crate::leader::frameworks::Hub>,
    framework_id: String,
    conn: u64,
    /// Dropped with the guard, which ends the shutdown watcher.
    _gone: tokio::sync::oneshot::Sender<()>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        tracing::info!(framework_id = %self.framework_id, "framework disconnected");
        self.hub.disconnect(&self.framework_id, self.conn);
    }
}

#[tonic::async_trait]
impl pb::scheduler_server::Scheduler for SchedulerService {
    type SubscribeStream = EventStream;
    async fn subscribe(
        &self,
        req: Request<pb::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let caller = Caller::of(&req);
        reply(self.subscribe(&caller, req.into_inner()).await)
    }

    async fn accept(
        &self,
        req: Request<pb::AcceptRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let caller = Caller::of(&req);
        if let Err(e) = self.check_framework(&caller, &req.get_ref().framework_id) {
            return Err(e.into());
        }
        reply(self.accept(req.into_inner()).await)
    }

    async fn decline(
        &self,
        req: Request<pb::DeclineRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let caller = Caller::of(&req);
        if let Err(e) = self.check_framework(&caller, &req.get_ref().framework_id) {
            return Err(e.into());
        }
        reply(self.decline(req.into_inner()).await)
    }

    async fn revive(
        &self,
        req: Request<pb::ReviveRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let caller = Caller::of(&req);
        if let Err(e) = self.check_framework(&caller, &req.get_ref().framework_id) {
            return Err(e.into());
        }
        reply(self.revive(req.into_inner()).await)
    }

    async fn suppress(
        &self,
        req: Request<pb::SuppressRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let caller = Caller::of(&req);
        if let Err(e) = self.check_framework(&caller, &req.get_ref().framework_id) {
            return Err(e.into());
        }
        reply(self.suppress(req.into_inner()).await)
    }

    async fn kill(
        &self,
        req: Request<pb::KillRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let caller = Caller::of(&req);
        if let Err(e) = self.check_framework(&caller, &req.get_ref().framework_id) {
            return Err(e.into());
        }
        reply(self.kill(req.into_inner()).await)
    }

    async fn acknowledge(
        &self,
        req: Request<pb::AcknowledgeRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let caller = Caller::of(&req);
        if let Err(e) = self.check_framework(&caller, &req.get_ref().framework_id) {
            return Err(e.into());
        }
        reply(self.acknowledge(req.into_inner()).await)
    }

    async fn reconcile(
        &self,
        req: Request<pb::ReconcileRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let caller = Caller::of(&req);
        if let Err(e) = self.check_framework(&caller, &req.get_ref().framework_id) {
            return Err(e.into());
        }
        reply(self.reconcile(req.into_inner()).await)
    }

    async fn teardown(
        &self,
        req: Request<pb::TeardownRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let caller = Caller::of(&req);
        if let Err(e) = self.check_framework(&caller, &req.get_ref().framework_id) {
            return Err(e.into());
        }
        reply(self.teardown(req.into_inner()).await)
    }

    async fn update_framework(
        &self,
        req: Request<pb::UpdateFrameworkRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let caller = Caller::of(&req);
        reply(self.update_framework(&caller, req.into_inner()).await)
    }
}

/// Each RPC's logic; the `Scheduler` impl above only turns its errors
/// into `Status` (`reply`).
impl SchedulerService {
    async fn subscribe(
        &self,
        caller: &Caller,
        req: pb::SubscribeRequest,
    ) -> Result<EventStream, ServiceError> {
        self.leader()?;
        let mut info = framework_info_from_pb(req.framework)?;
        self.authorize(caller, &mut info)?;
        let suppressed = req.suppressed;
        let demand = req
            .demand
            .map(|d| gpuctl_core::convert::resources_from_pb("demand", Some(d)))
            .transpose()?;
        let request_id = if req.request_id.is_empty() || !info.id.is_empty() {
            None
        } else {
            gpuctl_core::convert::check_id("request_id", &req.request_id)?;
            Some(crate::state::requests::request_key(
                caller.request_scope(),
                &req.request_id,
            ))
        };
        let framework_id = match self
            .ctx
            .raft
            .propose(Command::SubscribeFramework {
                info,
                at_ms: now_ms(),
                request_id,
            })
            .await?
        {
            Outcome::FrameworkSubscribed { framework_id } => framework_id,
            other => return Err(ServiceError::unexpected("subscribe_framework", other)),
        };
        tracing::info!(framework_id = %framework_id, "framework subscribed");
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        // The hub holds the only sender: when it lets go (Teardown, a newer
        // subscription, leadership lost), the stream ends after the events
        // queued before, ERROR included.
        // Declared before the connection, so that no round offers it
        // anything smaller than its task in between.
        if let Some(d) = demand {
            self.ctx.hub.declare_demand(&framework_id, d);
        }
        let conn = self
            .ctx
            .hub
            .connect_suppressed(&framework_id, tx, Some(suppressed));
        let (gone_tx, gone_rx) = tokio::sync::oneshot::channel::<()>();
        let guard = StreamGuard {
            hub: self.ctx.hub.clone(),
            framework_id: framework_id.clone(),
            conn,
            _gone: gone_tx,
        };
        let hub = self.ctx.hub.clone();
        let mut shutdown = self.ctx.shutdown.clone();
        tokio::spawn(async move {
            tokio::select! {
                // The framework went away (the guard dropped with the stream).
                _ = gone_rx => {}
                // The master stops: end the stream so shutdown need not wait.
                _ = shutdown.changed() => hub.disconnect(&framework_id, conn),
            }
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx).map(move |e| {
            let _ = &guard;
            e
        });
        Ok(Box::pin(stream))
    }

    async fn accept(&self, req: pb::AcceptRequest) -> Result<pb::CallResponse, ServiceError> {
        self.connected(&req.framework_id)?;
        // All or nothing: every task is checked before the offers are
        // taken, so a refused call leaves them outstanding for another try.
        let offers = self
            .ctx
            .hub
            .peek_offers(&req.framework_id, &req.offer_ids)?;
        let mut offered: BTreeMap<String, Offered> = BTreeMap::new();
        for o in &offers {
            let e = offered.entry(o.agent_id.clone()).or_default();
            e.resources = e.resources.add(&o.resources);
            e.gpus.extend(o.gpu_uuids.iter().cloned());
            for sh in &o.shares {
                e.shares
                    .insert(sh.gpu_uuid.clone(), (sh.mem_mib, sh.compute_pct));
            }
        }
        let commands = {
            let state = self.ctx.raft.state();
            for (agent_id, o) in offered.iter_mut() {
                if let Some(a) = state.agent(agent_id) {
                    o.resources = a.with_free_ports(o.resources);
                }
            }
            launch_commands(&state, &req.framework_id, req.operations, &offered)?
        };
        self.ctx
            .hub
            .take_offers(&req.framework_id, &req.offer_ids)?;
        let launched: Vec<Launched> = commands
            .iter()
            .flat_map(|c| match c {
                Command::LaunchFrameworkTasks { tasks, .. } => tasks.as_slice(),
                _ => &[],
            })
            .map(|t| Launched {
                agent_id: t.agent_id.clone(),
                resources: t.resources,
            })
            .collect();
        let agents: BTreeSet<String> = offered.keys().cloned().collect();
        // Until the launches commit, nothing of these agents is offered.
        let _launching = self.ctx.hub.launching(&agents);
        for c in commands {
            if let Outcome::FrameworkTasksLaunched {
                refused,
                unrecorded,
                ..
            } = self.ctx.raft.propose(c).await?
            {
                // Refused when applied (the state changed since the check):
                // recorded in ERROR, whose update the framework gets like
                // any other; or, with an id taken meanwhile, not recorded,
                // so it hears of it here.
                for (task, reason) in refused {
                    tracing::info!(framework_id = %req.framework_id, task_id = %task, %reason, "launch refused");
                }
                for (task, reason) in unrecorded {
                    tracing::info!(framework_id = %req.framework_id, task_id = %task, %reason, "launch refused");
                    self.ctx.hub.send(
                        &req.framework_id,
                        pb::event::Event::Update(pb::TaskStatus {
                            task_id: task,
                            state: pb::TaskState::TaskError as i32,
                            reason: pb::Reason::TaskInvalid as i32,
                            message: reason,
                            ..Default::default()
                        }),
                    );
                }
            }
        }
        // What was not used is declined, with the call's filters; what was
        // launched tells the allocator what this framework asks for.
        let mut refused: BTreeMap<String, Resources> = offered
            .iter()
            .map(|(a, o)| (a.clone(), o.resources))
            .collect();
        for t in &launched {
            if let Some(r) = refused.get_mut(&t.agent_id) {
                *r = r.saturating_sub(&t.resources);
            }
        }
        self.ctx.hub.learn_demand(
            &req.framework_id,
            &launched.iter().map(|t| t.resources).collect::<Vec<_>>(),
        );
        let refuse = req.filters.and_then(|f| f.refuse_seconds);
        self.ctx
            .hub
            .filter_declined(&req.framework_id, &refused, refuse_until(now_ms(), refuse));
        Ok(pb::CallResponse {})
    }

    async fn decline(&self, req: pb::DeclineRequest) -> Result<pb::CallResponse, ServiceError> {
        self.connected(&req.framework_id)?;
        let offers = self
            .ctx
            .hub
            .take_offers(&req.framework_id, &req.offer_ids)?;
        let mut refused: BTreeMap<String, Resources> = BTreeMap::new();
        for o in &offers {
            let r = refused.entry(o.agent_id.clone()).or_default();
            *r = r.add(&o.resources);
        }
        // It wants none of what it was offered: next time, whole agents.
        self.ctx.hub.learn_demand(&req.framework_id, &[]);
        let refuse = req.filters.and_then(|f| f.refuse_seconds);
        self.ctx
            .hub
            .filter_declined(&req.framework_id, &refused, refuse_until(now_ms(), refuse));
        Ok(pb::CallResponse {})
    }

    async fn revive(&self, req: pb::ReviveRequest) -> Result<pb::CallResponse, ServiceError> {
        self.connected(&req.framework_id)?;
        if let Some(d) = req.demand {
            let d = gpuctl_core::convert::resources_from_pb("demand", Some(d))?;
            self.ctx.hub.declare_demand(&req.framework_id, d);
        }
        if self.names_offer_role(&req.framework_id, &req.roles)? {
            self.ctx.hub.revive(&req.framework_id);
        }
        Ok(pb::CallResponse {})
    }

    async fn suppress(&self, req: pb::SuppressRequest) -> Result<pb::CallResponse, ServiceError> {
        self.connected(&req.framework_id)?;
        if self.names_offer_role(&req.framework_id, &req.roles)? {
            self.ctx.hub.suppress(&req.framework_id);
        }
        Ok(pb::CallResponse {})
    }

    async fn kill(&self, req: pb::KillRequest) -> Result<pb::CallResponse, ServiceError> {
        self.connected(&req.framework_id)?;
        check_id("task_id", &req.task_id)?;
        self.ctx
            .raft
            .propose(Command::KillTask {
                framework_id: req.framework_id,
                framework_task_id: req.task_id,
                at_ms: now_ms(),
            })
            .await?;
        Ok(pb::CallResponse {})
    }

    async fn acknowledge(
        &self,
        req: pb::AcknowledgeRequest,
    ) -> Result<pb::CallResponse, ServiceError> {
        self.connected(&req.framework_id)?;
        check_id("task_id", &req.task_id)?;
        if req.uuid.is_empty() {
            return Err(ConvertError::new("uuid", "must not be empty").into());
        }
        self.ctx
            .raft
            .propose(Command::AcknowledgeUpdate {
                framework_id: req.framework_id,
                framework_task_id: req.task_id,
                uuid: req.uuid,
            })
            .await?;
        Ok(pb::CallResponse {})
    }

    async fn reconcile(&self, req: pb::ReconcileRequest) -> Result<pb::CallResponse, ServiceError> {
        self.connected(&req.framework_id)?;
        let statuses: Vec<pb::TaskStatus> = {
            let state = self.ctx.raft.state();
            if req.tasks.is_empty() {
                // Implicit: the latest state of every task not yet ended.
                state
                    .tasks()
                    .values()
                    .filter(|t| t.framework_id == req.framework_id && !t.state.is_terminal())
                    .map(|t| task_status(t, Some(pb::Reason::Reconciliation)))
                    .collect()
            } else {
                req.tasks
                    .iter()
                    .map(
                        |rt| match state.task(&task_key(&req.framework_id, &rt.task_id)) {
                            Some(t) => task_status(t, Some(pb::Reason::Reconciliation)),
                            // Unknown to the master: lost, as Mesos answers.
                            None => pb::TaskStatus {
                                task_id: rt.task_id.clone(),
                                agent_id: rt.agent_id.clone(),
                                state: pb::TaskState::TaskLost as i32,
                                reason: pb::Reason::TaskUnknown as i32,
                                message: "unknown task".into(),
                                ..Default::default()
                            },
                        },
                    )
                    .collect()
            }
        };
        for mut s in statuses {
            // Answers need no acknowledgement.
            s.uuid.clear();
            self.ctx
                .hub
                .send(&req.framework_id, pb::event::Event::Update(s));
        }
        Ok(pb::CallResponse {})
    }

    async fn teardown(&self, req: pb::TeardownRequest) -> Result<pb::CallResponse, ServiceError> {
        check_id("framework_id", &req.framework_id)?;
        self.leader()?;
        self.ctx
            .raft
            .propose(Command::RemoveFramework {
                framework_id: req.framework_id.clone(),
                reason: "teardown".into(),
                at_ms: now_ms(),
            })
            .await?;
        tracing::info!(framework_id = %req.framework_id, "framework torn down");
        self.ctx.hub.close(&req.framework_id, "teardown");
        Ok(pb::CallResponse {})
    }

    async fn update_framework(
        &self,
        caller: &Caller,
        req: pb::UpdateFrameworkRequest,
    ) -> Result<pb::CallResponse, ServiceError> {
        let mut info = framework_info_from_pb(req.framework)?;
        if info.id.is_empty() {
            return Err(ConvertError::new("framework.id", "must not be empty").into());
        }
        self.authorize(caller, &mut info)?;
        self.connected(&info.id)?;
        self.ctx
            .raft
            .propose(Command::UpdateFramework {
                info,
                at_ms: now_ms(),
            })
            .await?;
        self.ctx.hub.wake();
        Ok(pb::CallResponse {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offered() -> BTreeMap<String, Offered> {
        let all = Resources {
            cpus: 8.0,
            mem_mib: 1024,
            gpus: 1,
            ports: 0,
        };
        [(
            "a1".to_string(),
            Offered {
                resources: all,
                gpus: ["GPU-0".to_string()].into(),
                shares: [("GPU-S".to_string(), (40960, 50))].into(),
            },
        )]
        .into()
    }

    fn task(agent: &str, gpus: &[&str], mem_mib: u64) -> FrameworkTask {
        FrameworkTask {
            task_id: "t1".into(),
            agent_id: agent.into(),
            image: None,
            command: vec!["true".into()],
            env: BTreeMap::new(),
            resources: Resources {
                cpus: 1.0,
                mem_mib,
                gpus: gpus.len() as u32,
                ports: 0,
            },
            gpu_uuids: gpus.iter().map(|g| g.to_string()).collect(),
            fraction: None,
        }
    }

    fn fraction(gpu: &str, mem_mib: u64, compute_pct: u32) -> FrameworkTask {
        FrameworkTask {
            gpu_uuids: vec![gpu.to_string()],
            fraction: Some(gpuctl_core::types::GpuFraction {
                mem_mib,
                compute_pct,
            }),
            ..task("a1", &[], 1)
        }
    }

    fn check(tasks: &[FrameworkTask]) -> Result<(), String> {
        let offered = offered();
        let mut used = Used::default();
        for t in tasks {
            within_offers("operations[0].tasks[1]", t, &offered, &mut used)
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Issue 34: fractions of an offered shared GPU, together within what
    /// the offer left of it; the refusal names the field.
    #[test]
    fn fractions_must_stay_within_what_was_offered_of_their_gpu() {
        let quarter = || fraction("GPU-S", 10240, 10);
        assert_eq!(check(&[quarter(), quarter(), quarter(), quarter()]), Ok(()));
        let err = check(&[quarter(), quarter(), quarter(), quarter(), quarter()]).unwrap_err();
        assert!(
            err.starts_with("invalid operations[0].tasks[1].gpu_fraction.mem_mib: 51200 MiB of GPU GPU-S asked by this call's fractions, 40960 MiB offered"),
            "{err}"
        );
        let err = check(&[fraction("GPU-S", 1, 30), fraction("GPU-S", 1, 30)]).unwrap_err();
        assert!(
            err.starts_with("invalid operations[0].tasks[1].gpu_fraction.compute_pct: 60%"),
            "{err}"
        );
        let err = check(&[fraction("GPU-0", 1, 0)]).unwrap_err();
        assert!(
            err.starts_with("invalid operations[0].tasks[1].gpu_fraction.gpu_uuid: GPU-0 was not offered as a shared GPU on agent a1"),
            "{err}"
        );
        // A shared GPU is never taken whole.
        let mut whole = task("a1", &["GPU-S"], 1);
        whole.resources.gpus = 1;
        let err = check(&[whole]).unwrap_err();
        assert!(
            err.starts_with("invalid operations[0].tasks[1].gpu_uuids[0]: GPU GPU-S is shared"),
            "{err}"
        );
        // A fraction beside a whole GPU of the same offer.
        assert_eq!(check(&[task("a1", &["GPU-0"], 1), quarter()]), Ok(()));
    }

    #[test]
    fn tasks_must_stay_within_what_was_offered() {
        assert_eq!(check(&[task("a1", &["GPU-0"], 512)]), Ok(()));
        let err = check(&[task("a2", &[], 1)]).unwrap_err();
        assert!(
            err.starts_with(
                "invalid operations[0].tasks[1].agent_id: a2 is not in the accepted offers"
            ),
            "{err}"
        );
        let err = check(&[task("a1", &["GPU-9"], 1)]).unwrap_err();
        assert!(
            err.starts_with("invalid operations[0].tasks[1].gpu_uuids[0]: GPU-9 was not offered"),
            "{err}"
        );
        // Each task fits alone; together they ask more memory than offered.
        let err = check(&[task("a1", &[], 600), task("a1", &[], 600)]).unwrap_err();
        assert!(
            err.starts_with("invalid operations[0].tasks[1].resources: more than offered"),
            "{err}"
        );
        // One GPU in two tasks of the call.
        let err = check(&[task("a1", &["GPU-0"], 1), task("a1", &["GPU-0"], 1)]).unwrap_err();
        assert!(
            err.starts_with(
                "invalid operations[0].tasks[1].gpu_uuids[0]: GPU GPU-0 is named by another task"
            ),
            "{err}"
        );
    }
}
