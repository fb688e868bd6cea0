//! The Scheduler (framework) service: calls are validated here, turned
//! into replicated commands or leader-side offer bookkeeping (Hub).

use std::collections::{BTreeMap, BTreeSet};
use std::pin::Pin;

use futures::Stream;
use gpuctl_proto::convert::{check_id, check_payload, resources_from_pb};
use gpuctl_proto::pb;
use gpuctl_proto::types::{FrameworkInfo, Resources};
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use super::Ctx;
use crate::allocator::refuse_until;
use crate::leader::frameworks::{task_status, EVENT_BUFFER};
use crate::now_ms;
use crate::state::frameworks::task_key;
use crate::state::{Command, FrameworkTask, Outcome};

pub struct SchedulerService {
    pub(super) ctx: Ctx,
}

const MAX_FAILOVER_SECS: f64 = 7.0 * 24.0 * 3600.0;

fn framework_info(f: Option<pb::FrameworkInfo>) -> Result<FrameworkInfo, Status> {
    let f = f.ok_or_else(|| Status::invalid_argument("invalid framework: missing"))?;
    if !f.id.is_empty() {
        check_id("framework.id", &f.id)?;
    }
    if f.id == crate::state::frameworks::BUILTIN_FRAMEWORK_ID {
        return Err(Status::invalid_argument(
            "invalid framework.id: reserved for gpuctl's own job scheduler",
        ));
    }
    if f.name.trim().is_empty() || f.name.len() > 128 {
        return Err(Status::invalid_argument(
            "invalid framework.name: 1 to 128 characters",
        ));
    }
    for r in &f.roles {
        check_id("framework.roles[]", r)?;
    }
    if !f.failover_timeout_secs.is_finite()
        || !(0.0..=MAX_FAILOVER_SECS).contains(&f.failover_timeout_secs)
    {
        return Err(Status::invalid_argument(format!(
            "invalid framework.failover_timeout_secs: must be 0..={MAX_FAILOVER_SECS}"
        )));
    }
    Ok(FrameworkInfo {
        id: f.id,
        name: f.name,
        roles: f.roles,
        gpu_capable: f
            .capabilities
            .contains(&(pb::FrameworkCapability::GpuResources as i32)),
        failover_timeout_ms: (f.failover_timeout_secs * 1000.0) as u64,
    })
}

impl SchedulerService {
    fn leader(&self) -> Result<(), Status> {
        if !self.ctx.raft.status().serving {
            return Err(Status::unavailable(
                "this master is not the leader; subscribe to the leader",
            ));
        }
        Ok(())
    }

    /// The framework must exist, not be removed, and be connected.
    fn connected(&self, framework_id: &str) -> Result<(), Status> {
        check_id("framework_id", framework_id)?;
        self.leader()?;
        if !self.ctx.hub.is_connected(framework_id) {
            return Err(Status::failed_precondition(format!(
                "framework {framework_id} is not subscribed to this master"
            )));
        }
        Ok(())
    }
}

/// Checks a task against the offers taken for it: its agent was offered,
/// its GPUs are among that agent's offered GPUs, and all tasks on an agent
/// fit in what was offered there.
fn to_framework_task(
    field: &str,
    t: pb::TaskInfo,
    offered: &BTreeMap<String, (Resources, BTreeSet<String>)>,
    used: &mut BTreeMap<String, Resources>,
) -> Result<FrameworkTask, Status> {
    check_id(&format!("{field}.task_id"), &t.task_id)?;
    let (res_offered, gpus_offered) = offered.get(&t.agent_id).ok_or_else(|| {
        Status::invalid_argument(format!(
            "invalid {field}.agent_id: {} is not in the accepted offers",
            t.agent_id
        ))
    })?;
    let resources = resources_from_pb(&format!("{field}.resources"), t.resources)?;
    if t.gpu_uuids.len() != resources.gpus as usize {
        return Err(Status::invalid_argument(format!(
            "invalid {field}.gpu_uuids: names {} GPUs, resources.gpus is {}",
            t.gpu_uuids.len(),
            resources.gpus
        )));
    }
    if let Some(g) = t.gpu_uuids.iter().find(|g| !gpus_offered.contains(*g)) {
        return Err(Status::invalid_argument(format!(
            "invalid {field}.gpu_uuids: {g} was not offered on agent {}",
            t.agent_id
        )));
    }
    let total = used.entry(t.agent_id.clone()).or_default();
    *total = total.add(&resources);
    if !res_offered.fits(total) {
        return Err(Status::invalid_argument(format!(
            "invalid {field}.resources: more than offered on agent {}",
            t.agent_id
        )));
    }
    // The same limits as a job's (docs/framework-api.md#limits).
    let env: BTreeMap<String, String> = t.env.into_iter().collect();
    check_payload(field, &t.image, &t.command, &env)?;
    Ok(FrameworkTask {
        task_id: t.task_id,
        agent_id: t.agent_id,
        image: (!t.image.is_empty()).then_some(t.image),
        command: t.command,
        env,
        resources,
        gpu_uuids: t.gpu_uuids,
    })
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::Event, Status>> + Send>>;

#[tonic::async_trait]
impl pb::scheduler_server::Scheduler for SchedulerService {
    type SubscribeStream = EventStream;

    async fn subscribe(
        &self,
        req: Request<pb::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        self.leader()?;
        let info = framework_info(req.into_inner().framework)?;
        let framework_id = match self
            .ctx
            .raft
            .propose(Command::SubscribeFramework {
                info,
                at_ms: now_ms(),
            })
            .await?
        {
            Outcome::FrameworkSubscribed { framework_id } => framework_id,
            other => return Err(Status::internal(format!("unexpected outcome {other:?}"))),
        };
        tracing::info!(framework_id = %framework_id, "framework subscribed");
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let conn = self.ctx.hub.connect(&framework_id, tx.clone());
        let hub = self.ctx.hub.clone();
        let mut shutdown = self.ctx.shutdown.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = tx.closed() => {}
                _ = shutdown.changed() => {}
            }
            tracing::info!(framework_id = %framework_id, "framework disconnected");
            hub.disconnect(&framework_id, conn);
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn accept(
        &self,
        req: Request<pb::AcceptRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let req = req.into_inner();
        self.connected(&req.framework_id)?;
        // Check the operations' shape before taking the offers, so a
        // malformed call leaves them outstanding.
        for (i, op) in req.operations.iter().enumerate() {
            if op.operation.is_none() {
                return Err(Status::invalid_argument(format!(
                    "invalid operations[{i}]: empty"
                )));
            }
        }
        let offers = self
            .ctx
            .hub
            .take_offers(&req.framework_id, &req.offer_ids)?;
        let mut offered: BTreeMap<String, (Resources, BTreeSet<String>)> = BTreeMap::new();
        for o in &offers {
            let e = offered.entry(o.agent_id.clone()).or_default();
            e.0 = e.0.add(&o.resources);
            e.1.extend(o.gpu_uuids.iter().cloned());
        }
        let agents: BTreeSet<String> = offered.keys().cloned().collect();
        let mut used = BTreeMap::new();
        let mut commands = Vec::new();
        for (i, op) in req.operations.into_iter().enumerate() {
            let (launch, group) = match op.operation {
                Some(pb::operation::Operation::Launch(l)) => (l, false),
                Some(pb::operation::Operation::LaunchGroup(l)) => (l, true),
                None => continue,
            };
            let mut tasks = Vec::with_capacity(launch.tasks.len());
            for (j, t) in launch.tasks.into_iter().enumerate() {
                match to_framework_task(
                    &format!("operations[{i}].tasks[{j}]"),
                    t,
                    &offered,
                    &mut used,
                ) {
                    Ok(t) => tasks.push(t),
                    Err(e) => {
                        // The offers are used up either way (as in Mesos);
                        // their agents become offerable again at once.
                        self.ctx
                            .hub
                            .filter(&req.framework_id, &BTreeSet::new(), None);
                        return Err(e);
                    }
                }
            }
            commands.push(Command::LaunchFrameworkTasks {
                framework_id: req.framework_id.clone(),
                tasks,
                group,
                at_ms: now_ms(),
            });
        }
        for c in commands {
            if let Outcome::FrameworkTasksLaunched { refused, .. } =
                self.ctx.raft.propose(c).await?
            {
                for (task, reason) in refused {
                    tracing::info!(framework_id = %req.framework_id, task_id = %task, %reason, "launch refused");
                }
            }
        }
        // What was not used is declined, with the call's filters.
        let refuse = req.filters.and_then(|f| f.refuse_seconds);
        self.ctx
            .hub
            .filter(&req.framework_id, &agents, refuse_until(now_ms(), refuse));
        Ok(Response::new(pb::CallResponse {}))
    }

    async fn decline(
        &self,
        req: Request<pb::DeclineRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let req = req.into_inner();
        self.connected(&req.framework_id)?;
        let offers = self
            .ctx
            .hub
            .take_offers(&req.framework_id, &req.offer_ids)?;
        let agents: BTreeSet<String> = offers.iter().map(|o| o.agent_id.clone()).collect();
        let refuse = req.filters.and_then(|f| f.refuse_seconds);
        self.ctx
            .hub
            .filter(&req.framework_id, &agents, refuse_until(now_ms(), refuse));
        Ok(Response::new(pb::CallResponse {}))
    }

    async fn revive(
        &self,
        req: Request<pb::ReviveRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let req = req.into_inner();
        self.connected(&req.framework_id)?;
        self.ctx.hub.revive(&req.framework_id);
        Ok(Response::new(pb::CallResponse {}))
    }

    async fn suppress(
        &self,
        req: Request<pb::SuppressRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let req = req.into_inner();
        self.connected(&req.framework_id)?;
        self.ctx.hub.suppress(&req.framework_id);
        Ok(Response::new(pb::CallResponse {}))
    }

    async fn kill(
        &self,
        req: Request<pb::KillRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let req = req.into_inner();
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
        Ok(Response::new(pb::CallResponse {}))
    }

    async fn acknowledge(
        &self,
        req: Request<pb::AcknowledgeRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let req = req.into_inner();
        self.connected(&req.framework_id)?;
        check_id("task_id", &req.task_id)?;
        if req.uuid.is_empty() {
            return Err(Status::invalid_argument("invalid uuid: must not be empty"));
        }
        self.ctx
            .raft
            .propose(Command::AcknowledgeUpdate {
                framework_id: req.framework_id,
                framework_task_id: req.task_id,
                uuid: req.uuid,
            })
            .await?;
        Ok(Response::new(pb::CallResponse {}))
    }

    async fn reconcile(
        &self,
        req: Request<pb::ReconcileRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let req = req.into_inner();
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
                                reason: pb::Reason::Reconciliation as i32,
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
        Ok(Response::new(pb::CallResponse {}))
    }

    async fn teardown(
        &self,
        req: Request<pb::TeardownRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let req = req.into_inner();
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
        self.ctx.hub.close(&req.framework_id);
        Ok(Response::new(pb::CallResponse {}))
    }

    async fn update_framework(
        &self,
        req: Request<pb::UpdateFrameworkRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let info = framework_info(req.into_inner().framework)?;
        self.connected(&info.id)?;
        self.ctx
            .raft
            .propose(Command::UpdateFramework {
                info,
                at_ms: now_ms(),
            })
            .await?;
        self.ctx.hub.wake();
        Ok(Response::new(pb::CallResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuctl_proto::convert::{
        MAX_COMMAND_ARGS, MAX_ENV_TOTAL_BYTES, MAX_ENV_VALUE_BYTES, MAX_MEM_MIB,
    };

    fn offered() -> BTreeMap<String, (Resources, BTreeSet<String>)> {
        let all = Resources {
            cpus: 8.0,
            mem_mib: MAX_MEM_MIB,
            gpus: 1,
        };
        [("a1".to_string(), (all, ["GPU-0".to_string()].into()))].into()
    }

    fn task() -> pb::TaskInfo {
        pb::TaskInfo {
            task_id: "t1".into(),
            agent_id: "a1".into(),
            command: vec!["true".into()],
            resources: Some(pb::Resources {
                cpus: 1.0,
                mem_mib: 64,
                gpus: 0,
            }),
            ..Default::default()
        }
    }

    /// The task converted as `operations[0].tasks[1]`; the field of the
    /// error when it is refused.
    fn launch(t: pb::TaskInfo) -> Result<FrameworkTask, String> {
        to_framework_task(
            "operations[0].tasks[1]",
            t,
            &offered(),
            &mut BTreeMap::new(),
        )
        .map_err(|s| {
            assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
            s.message().to_string()
        })
    }

    #[test]
    fn framework_tasks_have_the_job_limits() {
        let mut t = task();
        t.env = [("FOO".to_string(), "v".repeat(MAX_ENV_VALUE_BYTES))].into();
        assert!(launch(t.clone()).is_ok());
        t.env = [("FOO".to_string(), "v".repeat(MAX_ENV_VALUE_BYTES + 1))].into();
        let err = launch(t).unwrap_err();
        assert!(
            err.starts_with("invalid operations[0].tasks[1].env[\"FOO\"]: value is 32769 bytes"),
            "{err}"
        );

        let mut t = task();
        t.env = (0..9)
            .map(|i| (format!("K{i}"), "v".repeat(MAX_ENV_TOTAL_BYTES / 8 - 2)))
            .collect();
        let err = launch(t).unwrap_err();
        assert!(
            err.starts_with("invalid operations[0].tasks[1].env:"),
            "{err}"
        );

        let mut t = task();
        t.command = vec!["a".into(); MAX_COMMAND_ARGS];
        assert!(launch(t.clone()).is_ok());
        t.command.push("b".into());
        let err = launch(t).unwrap_err();
        assert!(
            err.starts_with("invalid operations[0].tasks[1].command:"),
            "{err}"
        );

        let mut t = task();
        t.image = "bad image".into();
        assert!(launch(t)
            .unwrap_err()
            .starts_with("invalid operations[0].tasks[1].image:"));

        let mut t = task();
        t.command.clear();
        assert!(launch(t)
            .unwrap_err()
            .starts_with("invalid operations[0].tasks[1].command:"));

        let mut t = task();
        if let Some(r) = t.resources.as_mut() {
            r.mem_mib = u64::MAX;
        }
        let err = launch(t).unwrap_err();
        assert!(
            err.starts_with("invalid operations[0].tasks[1].resources.mem_mib:"),
            "{err}"
        );
    }
}
