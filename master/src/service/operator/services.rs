//! Services: create, get, list, scale, delete. A service's replicas are
//! jobs (`state/services.rs`); these calls name the service and show its
//! replicas' jobs as GetJob does.

use gpuctl_core::types::ServiceSpec;

use super::*;
use crate::state::ServiceRecord;

fn name_arg(name: &str) -> Result<(), ConvertError> {
    gpuctl_core::types::check_service_name(name).map_err(|e| ConvertError::new("name", e))
}

/// A service as the API shows it; `detail`: with its replicas' jobs and
/// its events (GetService and the create's and scale's answers).
pub fn service_to_pb(
    state: &State,
    s: &ServiceRecord,
    reasons: &BTreeMap<String, Waiting>,
    detail: bool,
) -> pb::Service {
    let replica_jobs = s
        .replicas
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let (ready, check_failure) = state.job_ready(id);
            pb::ServiceReplica {
                index: u32::try_from(i).unwrap_or(u32::MAX),
                job_id: id.clone(),
                job: detail
                    .then(|| state.job(id))
                    .flatten()
                    .map(|j| job_detail_to_pb(state, j, reasons)),
                ready,
                check_failure,
            }
        })
        .collect::<Vec<_>>();
    let ready = replica_jobs.iter().filter(|r| r.ready).count();
    let running = s
        .replicas
        .iter()
        .filter_map(|id| state.job(id))
        .filter(|j| j.state == JobState::Running)
        .count();
    pb::Service {
        id: s.id.clone(),
        name: s.spec.name.clone(),
        tenant: s.spec.template.tenant.name().to_string(),
        replicas: s.spec.replicas,
        template: Some(s.spec.template.redacted().into()),
        created_at_ms: s.created_at_ms,
        replica_jobs,
        events: if detail {
            s.events.iter().map(super::event_to_pb).collect()
        } else {
            Vec::new()
        },
        running: u32::try_from(running).unwrap_or(u32::MAX),
        ready: u32::try_from(ready).unwrap_or(u32::MAX),
        drain_ms: s.spec.drain(),
        draining_jobs: state
            .draining()
            .filter(|(job, _)| {
                state
                    .job(job)
                    .is_some_and(|j| j.spec.service.as_deref() == Some(s.id.as_str()))
            })
            .map(|(job, _)| job.clone())
            .collect(),
    }
}

impl OperatorService {
    pub(super) async fn create_service(
        &self,
        caller: &Caller,
        req: pb::CreateServiceRequest,
    ) -> Result<pb::Service, ServiceError> {
        let mut spec = ServiceSpec::try_from(req)?;
        self.admit(caller, &mut spec.template, "template")?;
        let out = self
            .ctx
            .raft
            .propose(Command::CreateService {
                spec: spec.clone(),
                at_ms: now_ms(),
            })
            .await?;
        match out {
            Outcome::ServiceCreated { id } => {
                tracing::info!(service = %id, name = %spec.name, "service created");
                self.service_reply(&spec.name)
            }
            other => Err(ServiceError::unexpected("create_service", other)),
        }
    }

    pub(super) async fn get_service(
        &self,
        caller: &Caller,
        req: pb::GetServiceRequest,
    ) -> Result<pb::Service, ServiceError> {
        name_arg(&req.name)?;
        self.check_service_access(caller, &req.name)?;
        self.service_reply(&req.name)
    }

    pub(super) async fn list_services(
        &self,
        caller: &Caller,
        _req: pb::ListServicesRequest,
    ) -> Result<pb::ListServicesResponse, ServiceError> {
        let state = self.ctx.raft.state();
        let reasons = self.ctx.waits.reasons();
        let mut services: Vec<pb::Service> = state
            .services()
            .filter(|s| caller.may_access(s.spec.template.tenant.name()))
            .map(|s| service_to_pb(&state, s, &reasons, false))
            .collect();
        services.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(pb::ListServicesResponse { services })
    }

    pub(super) async fn scale_service(
        &self,
        caller: &Caller,
        req: pb::ScaleServiceRequest,
    ) -> Result<pb::Service, ServiceError> {
        name_arg(&req.name)?;
        if req.replicas > gpuctl_core::convert::MAX_SERVICE_REPLICAS {
            return Err(ConvertError::new(
                "replicas",
                format!(
                    "is {}: at most {}",
                    req.replicas,
                    gpuctl_core::convert::MAX_SERVICE_REPLICAS
                ),
            )
            .into());
        }
        self.check_service_access(caller, &req.name)?;
        self.ctx
            .raft
            .propose(Command::ScaleService {
                name: req.name.clone(),
                replicas: req.replicas,
                at_ms: now_ms(),
            })
            .await?;
        self.service_reply(&req.name)
    }

    pub(super) async fn delete_service(
        &self,
        caller: &Caller,
        req: pb::DeleteServiceRequest,
    ) -> Result<pb::DeleteServiceResponse, ServiceError> {
        name_arg(&req.name)?;
        self.check_service_access(caller, &req.name)?;
        match self
            .ctx
            .raft
            .propose(Command::DeleteService {
                name: req.name.clone(),
                at_ms: now_ms(),
            })
            .await?
        {
            Outcome::ServiceDeleted { job_ids } => {
                tracing::info!(name = %req.name, "service deleted");
                Ok(pb::DeleteServiceResponse { job_ids })
            }
            other => Err(ServiceError::unexpected("delete_service", other)),
        }
    }

    /// The service as this master's state has it now, in detail.
    fn service_reply(&self, name: &str) -> Result<pb::Service, ServiceError> {
        let state = self.ctx.raft.state();
        let reasons = self.ctx.waits.reasons();
        state
            .service_named(name)
            .map(|s| service_to_pb(&state, s, &reasons, true))
            .ok_or_else(|| ServiceError::NotFound {
                what: Missing::Service,
                id: name.to_string(),
            })
    }

    /// Another tenant's service is NOT_FOUND to the caller, as if absent:
    /// names are cluster-wide, and a name says nothing of who has it.
    fn check_service_access(&self, caller: &Caller, name: &str) -> Result<(), ServiceError> {
        let state = self.ctx.raft.state();
        match state.service_named(name) {
            Some(s) if caller.may_access(s.spec.template.tenant.name()) => Ok(()),
            _ => Err(ServiceError::NotFound {
                what: Missing::Service,
                id: name.to_string(),
            }),
        }
    }
}

/// How long a watch waits after a change for the next one: a burst of
/// applies (a placement round, a rollout step) is one message.
const ENDPOINTS_COALESCE: std::time::Duration = std::time::Duration::from_millis(50);

/// The endpoints of the services `caller` may see (`only`: one by name),
/// by name.
fn endpoints_now(
    state: &State,
    caller: &Caller,
    only: &str,
) -> BTreeMap<String, pb::ServiceEndpoints> {
    state
        .services()
        .filter(|s| only.is_empty() || s.spec.name == only)
        .filter(|s| caller.may_access(s.spec.template.tenant.name()))
        .map(|s| {
            let port_name = s
                .spec
                .template
                .template
                .options
                .port
                .first()
                .cloned()
                .unwrap_or_default();
            let endpoints = state
                .service_endpoints(s)
                .into_iter()
                .map(|e| pb::Endpoint {
                    replica: e.replica,
                    job_id: e.job_id,
                    task_id: e.task_id,
                    agent_id: e.agent_id,
                    host: e.host,
                    port: e.port.map_or(0, u32::from),
                    ready: e.ready,
                })
                .collect();
            let msg = pb::ServiceEndpoints {
                service: s.spec.name.clone(),
                tenant: s.spec.template.tenant.name().to_string(),
                deleted: false,
                port_name,
                endpoints,
                synced: false,
            };
            (s.spec.name.clone(), msg)
        })
        .collect()
}

impl OperatorService {
    pub(super) async fn watch_endpoints(
        &self,
        caller: &Caller,
        req: pb::WatchEndpointsRequest,
    ) -> Result<EndpointStream, ServiceError> {
        if !req.service.is_empty() {
            name_arg(&req.service)?;
        }
        let (tx, rx) = mpsc::channel(64);
        let ctx = self.ctx.clone();
        let caller = caller.clone();
        tokio::spawn(async move {
            let mut applied = ctx.raft.applied();
            let mut status = ctx.raft.status_watch();
            let mut shutdown = ctx.shutdown.clone();
            let mut sent: BTreeMap<String, pb::ServiceEndpoints> = BTreeMap::new();
            let mut synced = false;
            loop {
                if !ctx.raft.status().serving {
                    let _ = tx.send(Err(ctx.not_leader().into())).await;
                    return;
                }
                let now = endpoints_now(&ctx.raft.state(), &caller, &req.service);
                let mut out: Vec<pb::ServiceEndpoints> = now
                    .iter()
                    .filter(|(name, msg)| sent.get(*name) != Some(msg))
                    .map(|(_, msg)| msg.clone())
                    .collect();
                out.extend(
                    sent.iter()
                        .filter(|(name, _)| !now.contains_key(*name))
                        .map(|(name, msg)| pb::ServiceEndpoints {
                            service: name.clone(),
                            tenant: msg.tenant.clone(),
                            deleted: true,
                            ..Default::default()
                        }),
                );
                if !synced {
                    out.push(pb::ServiceEndpoints {
                        synced: true,
                        ..Default::default()
                    });
                    synced = true;
                }
                for msg in out {
                    if tx.send(Ok(msg)).await.is_err() {
                        return;
                    }
                }
                sent = now;
                tokio::select! {
                    r = applied.changed() => if r.is_err() { return },
                    r = status.changed() => if r.is_err() { return },
                    _ = shutdown.changed() => return,
                    _ = tx.closed() => return,
                }
                tokio::time::sleep(ENDPOINTS_COALESCE).await;
            }
        });
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }
}
