//! A service as gpuctl's `--json` and the console's API show it: its
//! template in `JobJson`'s shape, and each replica's job as a `JobJson`.

use std::collections::BTreeMap;

use serde::Serialize;

use super::{EventJson, JobJson, PlacementJson, SecurityJson};
use crate::pb;
use crate::types::{Resources, TaskOptions};

/// A service (`GET /api/services/NAME`, items of `GET /api/services`), as
/// `gpuctl services get --json` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServiceJson {
    /// `svc-N`, never reused.
    pub id: String,
    pub name: String,
    /// The tenant its replicas are charged to.
    pub tenant: String,
    /// Replicas asked for.
    pub replicas: u32,
    /// Replicas whose job is RUNNING.
    pub running: u32,
    /// Of them, those whose readiness check passes (all, without one).
    pub ready: u32,
    /// How long a leaving replica runs on, out of the endpoints.
    pub drain_ms: u64,
    /// Replicas that left and still drain: their jobs.
    pub draining_jobs: Vec<String>,
    /// What each replica runs.
    pub template: TemplateJson,
    pub created_at_ms: u64,
    /// One per replica, by index.
    pub replica_jobs: Vec<ReplicaJson>,
    /// Created, Scaled, Deleting, oldest first, as a job's events (`[]` in
    /// lists).
    pub events: Vec<EventJson>,
}

/// One replica of a service.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplicaJson {
    pub index: u32,
    pub job_id: String,
    /// Its job as `jobs get --json` shows it (restarts are its
    /// `retries`); `null` in the list.
    pub job: Option<JobJson>,
    /// It runs and its readiness check passes (none: running is ready).
    pub ready: bool,
    /// Its checks' last failure's words; `null`: none.
    pub check_failure: Option<String>,
}

/// A service's template: the job fields a replica's job is made of, in
/// `JobJson`'s shape (its name is the service's; it has no replicas,
/// retries or restart policy of its own).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TemplateJson {
    /// `null` for a host process.
    pub image: Option<String>,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub resources: Resources,
    pub placement: PlacementJson,
    pub priority: i32,
    /// `--restart-backoff` in ms; `null`: the default (1 s).
    pub restart_backoff_ms: Option<u64>,
    pub preflight: bool,
    pub no_fence: bool,
    pub stop_grace_ms: Option<u64>,
    pub checkpoint_dir: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hang_timeout_ms: Option<u64>,
    #[serde(flatten)]
    pub options: TaskOptions,
    pub security: SecurityJson,
    pub require_cuda: Option<String>,
}

impl From<&pb::JobSpec> for TemplateJson {
    fn from(spec: &pb::JobSpec) -> Self {
        let some = |s: &str| (!s.is_empty()).then(|| s.to_string());
        TemplateJson {
            image: some(&spec.image),
            command: spec.command.clone(),
            env: spec
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            resources: crate::wait_words::resources_of(spec.resources.as_ref()),
            placement: PlacementJson::from(spec.placement.as_ref()),
            priority: spec.priority,
            restart_backoff_ms: spec.restart_backoff_ms,
            preflight: spec.preflight,
            no_fence: spec.no_fence,
            stop_grace_ms: spec.stop_grace_ms,
            checkpoint_dir: some(&spec.checkpoint_dir),
            hang_timeout_ms: spec.hang_timeout_ms,
            options: crate::convert::options_view(spec.options.as_ref()),
            security: SecurityJson::from(spec.security.as_ref()),
            require_cuda: some(&spec.require_cuda),
        }
    }
}

impl From<&pb::Service> for ServiceJson {
    fn from(s: &pb::Service) -> Self {
        ServiceJson {
            id: s.id.clone(),
            name: s.name.clone(),
            tenant: s.tenant.clone(),
            replicas: s.replicas,
            running: s.running,
            ready: s.ready,
            drain_ms: s.drain_ms,
            draining_jobs: s.draining_jobs.clone(),
            template: TemplateJson::from(&s.template.clone().unwrap_or_default()),
            created_at_ms: s.created_at_ms,
            replica_jobs: s
                .replica_jobs
                .iter()
                .map(|r| ReplicaJson {
                    index: r.index,
                    job_id: r.job_id.clone(),
                    job: r.job.as_ref().map(JobJson::from),
                    ready: r.ready,
                    check_failure: (!r.check_failure.is_empty()).then(|| r.check_failure.clone()),
                })
                .collect(),
            events: s.events.iter().map(EventJson::from).collect(),
        }
    }
}

/// One service's endpoints (`gpuctl services endpoints --json`; each line
/// of `--watch --json`): where its running replicas answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EndpointsJson {
    pub service: String,
    pub tenant: String,
    /// The service is gone: forget its endpoints.
    pub deleted: bool,
    /// The port name the addresses are at (`null`: it names none).
    pub port_name: Option<String>,
    pub endpoints: Vec<EndpointJson>,
}

/// One running replica.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EndpointJson {
    pub replica: u32,
    pub job_id: String,
    pub task_id: String,
    pub agent_id: String,
    /// `host:port`; the host alone when the service names no port.
    pub address: String,
    /// Its readiness check passes (without one: it runs).
    pub ready: bool,
}

impl From<&pb::Endpoint> for EndpointJson {
    fn from(e: &pb::Endpoint) -> Self {
        EndpointJson {
            replica: e.replica,
            job_id: e.job_id.clone(),
            task_id: e.task_id.clone(),
            agent_id: e.agent_id.clone(),
            address: endpoint_address(e),
            ready: e.ready,
        }
    }
}

/// `host:port` (`[v6]:port`), or the host when there is no port.
pub fn endpoint_address(e: &pb::Endpoint) -> String {
    match (e.port, e.host.contains(':')) {
        (0, _) => e.host.clone(),
        (p, true) => format!("[{}]:{p}", e.host),
        (p, false) => format!("{}:{p}", e.host),
    }
}

impl From<&pb::ServiceEndpoints> for EndpointsJson {
    fn from(s: &pb::ServiceEndpoints) -> Self {
        EndpointsJson {
            service: s.service.clone(),
            tenant: s.tenant.clone(),
            deleted: s.deleted,
            port_name: (!s.port_name.is_empty()).then(|| s.port_name.clone()),
            endpoints: s.endpoints.iter().map(EndpointJson::from).collect(),
        }
    }
}
