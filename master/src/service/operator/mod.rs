//! Operator: what gpuctl uses.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::time::Duration;

use futures::{Stream, StreamExt};
use gpuctl_core::convert::{drain_deadline, job_state_from_pb};
use gpuctl_core::types::{
    utc_timestamp, GpuSample, JobSpec, JobState, JobsQuery, RuntimeStatus, TaskState,
};
use gpuctl_core::ConvertError;
use gpuctl_proto::pb;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use super::auth::Caller;
use super::{jobs_page, reply, Ctx, Missing, ServiceError};
use crate::now_ms;
use crate::state::requests::request_key;
use crate::state::{AgentRecord, AgentState, Command, JobRecord, Outcome, State, TaskRecord};
use gpuctl_core::wait::Waiting;

mod agents;
mod jobs;
mod logs;
mod services;
mod usage;

type LogStream = Pin<Box<dyn Stream<Item = Result<pb::LogChunk, Status>> + Send>>;
type JobStream = Pin<Box<dyn Stream<Item = Result<pb::Job, Status>> + Send>>;
type EndpointStream = Pin<Box<dyn Stream<Item = Result<pb::ServiceEndpoints, Status>> + Send>>;

pub struct OperatorService {
    pub(super) ctx: Ctx,
}

/// A task as the API shows it; `has_readiness`: its job has a readiness
/// check (without one, a running task is ready).
pub fn task_to_pb(t: &TaskRecord, has_readiness: bool) -> pb::Task {
    pb::Task {
        ready: t.ready(has_readiness),
        check_failure: t
            .health
            .as_ref()
            .map(|h| h.failure.clone())
            .unwrap_or_default(),
        enforcement: t.enforcement.map(|e| e.to_string()).unwrap_or_default(),
        id: t.id.clone(),
        agent_id: t.agent_id.clone(),
        gpu_uuids: t.gpu_uuids.clone(),
        state: pb::TaskState::from(t.state) as i32,
        exit_code: t.exit_code,
        message: t.message.clone(),
        updated_at_ms: t.updated_at_ms,
        rank: t.rank,
        reason: crate::leader::frameworks::wire_reason(t) as i32,
        ports: t.ports.iter().map(|p| u32::from(*p)).collect(),
    }
}

/// A job as the API shows it; `reasons` says why queued jobs wait (see
/// `scheduler::queue`), as data: the CLI words it. A job with tasks on an
/// unreachable agent says so in its message (it stays RUNNING meanwhile).
pub fn job_to_pb(state: &State, j: &JobRecord, reasons: &BTreeMap<String, Waiting>) -> pb::Job {
    let message = unreachable_note(state, j).unwrap_or_else(|| j.message.clone());
    let wait_reason = (j.state == JobState::Queued)
        .then(|| reasons.get(&j.id))
        .flatten()
        .map(pb::WaitReason::from);
    pb::Job {
        id: j.id.clone(),
        // Secret env values never leave the master (the agent gets them
        // through WatchTasks).
        spec: Some(j.spec.redacted().into()),
        state: pb::JobState::from(j.state) as i32,
        tasks: j
            .task_ids
            .iter()
            .filter_map(|t| state.task(t))
            .map(|t| task_to_pb(t, j.spec.template.options.readiness.is_some()))
            .collect(),
        submitted_at_ms: j.submitted_at_ms,
        message,
        retries: j.retries,
        preemptions: j.preemptions,
        wait_reason,
        image_requires: j
            .image_requires
            .iter()
            .map(|e| e.text().to_string())
            .collect(),
        events: Vec::new(),
        events_dropped: 0,
        idle_since_ms: j.idle_since_ms.unwrap_or(0),
    }
}

/// [`job_to_pb`] with the job's events: GetJob and WatchJob (ListJobs
/// leaves them out, to keep its pages small).
pub fn job_detail_to_pb(
    state: &State,
    j: &JobRecord,
    reasons: &BTreeMap<String, Waiting>,
) -> pb::Job {
    let mut job = job_to_pb(state, j, reasons);
    job.events = j.events.iter().map(event_to_pb).collect();
    job.events_dropped = j.events.dropped();
    job
}

fn event_to_pb(e: &crate::state::events::JobEvent) -> pb::JobEvent {
    pb::JobEvent {
        kind: e.kind.as_str().to_string(),
        warning: e.kind.is_warning(),
        message: e.message.clone(),
        first_ms: e.first_ms,
        last_ms: e.last_ms,
        count: e.count,
    }
}

/// "task job-1.0: agent a1 unreachable since ..." for a live job whose
/// current tasks include UNREACHABLE ones.
fn unreachable_note(state: &State, j: &JobRecord) -> Option<String> {
    if j.state.is_terminal() {
        return None;
    }
    let notes: Vec<String> = j
        .current_tasks()
        .iter()
        .filter_map(|t| state.task(t))
        .filter(|t| t.state == TaskState::Unreachable)
        .map(|t| {
            let since = state
                .agent(&t.agent_id)
                .and_then(|a| a.unreachable_since_ms)
                .map(|ms| format!(" since {}", utc_timestamp(ms)))
                .unwrap_or_default();
            format!(
                "task {} unreachable: agent {} unreachable{since} (its GPUs stay held)",
                t.id, t.agent_id
            )
        })
        .collect();
    (!notes.is_empty()).then(|| notes.join("; "))
}

fn gpu_status(
    state: &State,
    agent: &AgentRecord,
    g: &gpuctl_core::types::GpuInfo,
    samples: &HashMap<String, GpuSample>,
) -> pb::GpuStatus {
    let task_id = state.gpu_owner(&g.uuid).cloned().unwrap_or_default();
    let job_id = state
        .task(&task_id)
        .map(|t| t.job_id.clone())
        .unwrap_or_default();
    pb::GpuStatus {
        gpu: Some(g.clone().into()),
        agent_id: agent.info.id.clone(),
        task_id,
        cordoned: state.is_cordoned(&g.uuid),
        // A lost agent's last readings are stale: show none.
        sample: (agent.state == AgentState::Active)
            .then(|| samples.get(&g.uuid).cloned().map(Into::into))
            .flatten(),
        job_id,
        hostname: agent.info.hostname.clone(),
        mig_tasks: g
            .mig
            .devices
            .iter()
            .filter_map(|d| Some((d.uuid.clone(), state.gpu_owner(&d.uuid)?.clone())))
            .collect(),
        mig_change: state.mig_change(&g.uuid).map(mig_change_to_pb),
        mig_error: state.mig_error(&g.uuid).unwrap_or_default().to_string(),
        share_mode: state
            .share_mode(&g.uuid)
            .map(|m| m.to_string())
            .unwrap_or_default(),
        shares: state
            .share_holders(&agent.info.id, &g.uuid)
            .map(|(t, f)| pb::GpuShareHolder {
                task_id: t.to_string(),
                mem_mib: f.mem_mib,
                compute_pct: f.compute_pct,
            })
            .collect(),
    }
}

/// A layout change as the API shows it (and as an agent's heartbeat
/// answer carries it).
pub fn mig_change_to_pb(c: &crate::state::mig::MigChange) -> pb::MigChange {
    pb::MigChange {
        gpu_uuid: c.gpu_uuid.clone(),
        generation: c.generation,
        profiles: c.profiles.clone(),
        disable: c.disable,
    }
}

/// An agent as the API shows it, with the runtime statuses of its latest
/// heartbeat (the leader's memory; empty elsewhere).
pub fn agent_to_pb(a: &AgentRecord, runtimes: Vec<RuntimeStatus>) -> pb::Agent {
    pb::Agent {
        id: a.info.id.clone(),
        hostname: a.info.hostname.clone(),
        address: a.info.address.clone(),
        state: match a.state {
            AgentState::Active => pb::AgentState::AgentActive,
            AgentState::Lost => pb::AgentState::AgentLost,
            AgentState::Unreachable => pb::AgentState::AgentUnreachable,
        } as i32,
        total: Some(a.info.total.into()),
        allocated: Some(a.allocated.into()),
        gpus: a.info.gpus.iter().cloned().map(Into::into).collect(),
        runtimes: a
            .info
            .runtimes
            .iter()
            .map(|r| pb::Runtime::from(*r) as i32)
            .collect(),
        registered_at_ms: a.registered_at_ms,
        simulated_gpus: a.info.simulated_gpus,
        attributes: a.info.attributes.clone().into_iter().collect(),
        driver_version: a.info.driver_version.clone().unwrap_or_default(),
        cuda_driver_version: a.info.cuda_driver_version.clone().unwrap_or_default(),
        draining: a.drain.is_some(),
        drain_deadline_ms: a
            .drain
            .as_ref()
            .and_then(|d| d.deadline_ms)
            .unwrap_or_default(),
        // A silent agent's last report is stale: show none.
        runtime_status: if a.state == AgentState::Active {
            runtimes.into_iter().map(Into::into).collect()
        } else {
            Vec::new()
        },
        unreachable_since_ms: a.unreachable_since_ms.unwrap_or_default(),
        allow_root_tasks: a.info.allow_root_tasks,
        allowed_mounts: a.info.allowed_mounts.clone(),
        allowed_users: a
            .info
            .allowed_users
            .as_ref()
            .map(|r| r.to_string())
            .unwrap_or_default(),
        ports: a.info.ports.map(Into::into),
    }
}

impl OperatorService {
    /// The agent as the state has it now.
    fn agent_reply(&self, agent_id: &str) -> Result<pb::Agent, ServiceError> {
        let state = self.ctx.raft.state();
        let a = state
            .agent(agent_id)
            .ok_or_else(|| ServiceError::not_found(Missing::Agent, agent_id))?;
        Ok(agent_to_pb(a, self.ctx.liveness.runtime_status(agent_id)))
    }
}

fn job_id_arg(id: &str) -> Result<(), ConvertError> {
    gpuctl_core::convert::check_id("job_id", id)
}

#[tonic::async_trait]
impl pb::operator_server::Operator for OperatorService {
    type JobLogsStream = LogStream;
    type WatchJobStream = JobStream;
    type WatchEndpointsStream = EndpointStream;

    async fn watch_endpoints(
        &self,
        req: Request<pb::WatchEndpointsRequest>,
    ) -> Result<Response<Self::WatchEndpointsStream>, Status> {
        let caller = Caller::of(&req);
        reply(self.watch_endpoints(&caller, req.into_inner()).await)
    }

    async fn watch_job(
        &self,
        req: Request<pb::GetJobRequest>,
    ) -> Result<Response<Self::WatchJobStream>, Status> {
        let caller = Caller::of(&req);
        reply(self.watch_job(&caller, req.into_inner()).await)
    }
    async fn submit_job(
        &self,
        req: Request<pb::SubmitJobRequest>,
    ) -> Result<Response<pb::SubmitJobResponse>, Status> {
        let caller = Caller::of(&req);
        reply(self.submit_job(&caller, req.into_inner()).await)
    }

    async fn create_service(
        &self,
        req: Request<pb::CreateServiceRequest>,
    ) -> Result<Response<pb::Service>, Status> {
        let caller = Caller::of(&req);
        reply(self.create_service(&caller, req.into_inner()).await)
    }

    async fn get_service(
        &self,
        req: Request<pb::GetServiceRequest>,
    ) -> Result<Response<pb::Service>, Status> {
        let caller = Caller::of(&req);
        reply(self.get_service(&caller, req.into_inner()).await)
    }

    async fn list_services(
        &self,
        req: Request<pb::ListServicesRequest>,
    ) -> Result<Response<pb::ListServicesResponse>, Status> {
        let caller = Caller::of(&req);
        reply(self.list_services(&caller, req.into_inner()).await)
    }

    async fn scale_service(
        &self,
        req: Request<pb::ScaleServiceRequest>,
    ) -> Result<Response<pb::Service>, Status> {
        let caller = Caller::of(&req);
        reply(self.scale_service(&caller, req.into_inner()).await)
    }

    async fn delete_service(
        &self,
        req: Request<pb::DeleteServiceRequest>,
    ) -> Result<Response<pb::DeleteServiceResponse>, Status> {
        let caller = Caller::of(&req);
        reply(self.delete_service(&caller, req.into_inner()).await)
    }

    async fn get_job(&self, req: Request<pb::GetJobRequest>) -> Result<Response<pb::Job>, Status> {
        let caller = Caller::of(&req);
        reply(self.get_job(&caller, req.into_inner()).await)
    }

    async fn list_jobs(
        &self,
        req: Request<pb::ListJobsRequest>,
    ) -> Result<Response<pb::ListJobsResponse>, Status> {
        let caller = Caller::of(&req);
        reply(self.list_jobs(&caller, req.into_inner()).await)
    }

    async fn cancel_job(
        &self,
        req: Request<pb::CancelJobRequest>,
    ) -> Result<Response<pb::CancelJobResponse>, Status> {
        let caller = Caller::of(&req);
        reply(self.cancel_job(&caller, req.into_inner()).await)
    }

    async fn list_agents(
        &self,
        req: Request<pb::ListAgentsRequest>,
    ) -> Result<Response<pb::ListAgentsResponse>, Status> {
        reply(self.list_agents(req.into_inner()).await)
    }

    async fn list_gpus(
        &self,
        req: Request<pb::ListGpusRequest>,
    ) -> Result<Response<pb::ListGpusResponse>, Status> {
        reply(self.list_gpus(req.into_inner()).await)
    }

    async fn share_gpu(
        &self,
        req: Request<pb::ShareGpuRequest>,
    ) -> Result<Response<pb::GpuStatus>, Status> {
        reply(self.share_gpu(req.into_inner()).await)
    }

    async fn set_mig_layout(
        &self,
        req: Request<pb::SetMigLayoutRequest>,
    ) -> Result<Response<pb::GpuStatus>, Status> {
        let caller = Caller::of(&req);
        reply(self.set_mig_layout(&caller, req.into_inner()).await)
    }

    async fn cordon_gpu(
        &self,
        req: Request<pb::CordonGpuRequest>,
    ) -> Result<Response<pb::GpuStatus>, Status> {
        reply(self.cordon_gpu(req.into_inner()).await)
    }

    async fn drain_agent(
        &self,
        req: Request<pb::DrainAgentRequest>,
    ) -> Result<Response<pb::Agent>, Status> {
        reply(self.drain_agent(req.into_inner()).await)
    }

    async fn undrain_agent(
        &self,
        req: Request<pb::UndrainAgentRequest>,
    ) -> Result<Response<pb::Agent>, Status> {
        reply(self.undrain_agent(req.into_inner()).await)
    }

    async fn job_logs(
        &self,
        req: Request<pb::JobLogsRequest>,
    ) -> Result<Response<Self::JobLogsStream>, Status> {
        let caller = Caller::of(&req);
        reply(self.job_logs(&caller, req.into_inner()).await)
    }

    async fn utilization(
        &self,
        req: Request<pb::UtilizationRequest>,
    ) -> Result<Response<pb::UtilizationResponse>, Status> {
        let caller = Caller::of(&req);
        reply(self.utilization(&caller, req.into_inner()))
    }

    async fn usage(
        &self,
        req: Request<pb::UsageRequest>,
    ) -> Result<Response<pb::UsageResponse>, Status> {
        let caller = Caller::of(&req);
        reply(self.usage(&caller, req.into_inner()))
    }

    async fn list_masters(
        &self,
        req: Request<pb::ListMastersRequest>,
    ) -> Result<Response<pb::ListMastersResponse>, Status> {
        reply(self.list_masters(req.into_inner()).await)
    }

    async fn add_master(
        &self,
        req: Request<pb::AddMasterRequest>,
    ) -> Result<Response<pb::ListMastersResponse>, Status> {
        reply(self.add_master(req.into_inner()).await)
    }

    async fn remove_master(
        &self,
        req: Request<pb::RemoveMasterRequest>,
    ) -> Result<Response<pb::ListMastersResponse>, Status> {
        reply(self.remove_master(req.into_inner()).await)
    }
}

/// One curve an Utilization answer may carry: a GPU's readings from `from`
/// to `to`, held by `task_id` then (empty: whoever held it), of the task's
/// own processes when `own` (a fraction).
#[derive(Debug, Clone, PartialEq)]
struct WantedSeries {
    gpu: String,
    task_id: String,
    from: u64,
    to: u64,
    own: bool,
}

/// Each RPC's logic; the `Operator` impl above only turns its errors
/// into `Status` (`reply`).
impl OperatorService {
    /// Refuses when the job is another tenant's (a job that does not exist
    /// is left to the caller's own not-found answer).
    fn check_job_access(&self, caller: &Caller, job_id: &str) -> Result<(), ServiceError> {
        let state = self.ctx.raft.state();
        match state.job(job_id) {
            Some(j) if !caller.may_access(j.spec.tenant.name()) => {
                Err(ServiceError::Forbidden(format!(
                    "job {job_id} belongs to another tenant than yours ({})",
                    caller.tenant()
                )))
            }
            _ => Ok(()),
        }
    }

    /// The job a GetJob names: its `job_id`, or the job this caller
    /// submitted with its `request_id` (exactly one of the two).
    fn job_id_of(&self, caller: &Caller, req: pb::GetJobRequest) -> Result<String, ServiceError> {
        if req.request_id.is_empty() {
            return Ok(req.job_id);
        }
        if !req.job_id.is_empty() {
            return Err(
                ConvertError::new("request_id", "give job_id or request_id, not both").into(),
            );
        }
        gpuctl_core::convert::check_id("request_id", &req.request_id)?;
        let key = request_key(caller.request_scope(), &req.request_id);
        self.ctx
            .raft
            .state()
            .submitted_job(&key)
            .cloned()
            .ok_or(ServiceError::NoSuchRequest {
                what: "job",
                request_id: req.request_id,
            })
    }

    async fn list_masters(
        &self,
        _req: pb::ListMastersRequest,
    ) -> Result<pb::ListMastersResponse, ServiceError> {
        Ok(super::masters::list(&self.ctx).await)
    }

    async fn add_master(
        &self,
        req: pb::AddMasterRequest,
    ) -> Result<pb::ListMastersResponse, ServiceError> {
        super::masters::add(&self.ctx, req).await
    }

    async fn remove_master(
        &self,
        req: pb::RemoveMasterRequest,
    ) -> Result<pb::ListMastersResponse, ServiceError> {
        super::masters::remove(&self.ctx, req).await
    }
}

/// A job may name a user (`security.user`) only within the ids its token
/// allows, uid and gid each (`gpuctl tokens create --allow-uids
/// --allow-gids`). The job's form was checked on the way in, so the user
/// parses; supplementary groups are never given (agents drop them). Id 0
/// reaches here only for a container (a host process asks root with
/// run_as_root), where it is what most images run as anyway.
fn check_chosen_user(
    token: &super::auth::TokenCaller,
    security: &gpuctl_core::types::TaskSecurity,
) -> Result<(), ServiceError> {
    let Some(user) = security.user.as_deref() else {
        return Ok(());
    };
    let ids: gpuctl_core::types::UserIds = user
        .parse()
        .map_err(|e: String| ConvertError::new("spec.security.user", e))?;
    for (kind, id, allowed, flag) in [
        ("uid", ids.uid, &token.allowed_uids, "--allow-uids"),
        ("gid", ids.gid, &token.allowed_gids, "--allow-gids"),
    ] {
        if id != 0 && !allowed.contains(id) {
            return Err(ServiceError::Forbidden(format!(
                "spec.security.user: {kind} {id} is not among the {kind}s token {} allows ({allowed}); \
                 an admin sets them with `gpuctl tokens create {flag}`, or leave --user out to run \
                 under a user of the task's own",
                token.id
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queued_job_carries_why_it_waits_as_data_and_its_own_message() {
        use crate::state::testkit::Driver;
        use gpuctl_core::types::Resources;
        use gpuctl_core::wait::WaitReason;
        let mut d = Driver::new(&[("a", 1)]);
        let submit = |d: &mut Driver, gpus| {
            let spec = JobSpec::new(
                "j",
                vec!["true".into()],
                Resources {
                    cpus: 1.0,
                    mem_mib: 0,
                    gpus,
                    ports: 0,
                },
            );
            match d.apply(Command::SubmitJob {
                spec,
                at_ms: 0,
                request_id: None,
            }) {
                Ok(Outcome::JobSubmitted { job_id }) => job_id,
                o => panic!("{o:?}"),
            }
        };
        let big = submit(&mut d, 8);
        let small = submit(&mut d, 1);
        d.launch_at(&small, &[("a", &["GPU-a-0"])], 1).unwrap();
        let reasons = crate::scheduler::queue::plan(&d.s, &Default::default()).reasons;
        let j = job_to_pb(&d.s, &d.s.jobs()[&big], &reasons);
        assert_eq!(j.message, "", "the words are the client's");
        let w = j.wait_reason.expect("a reason");
        assert!(
            matches!(
                Waiting::try_from(&w).map(|w| w.reason),
                Ok(WaitReason::NeverFits { .. })
            ),
            "{w:?}"
        );
        let j = job_to_pb(&d.s, &d.s.jobs()[&small], &reasons);
        assert_eq!(j.wait_reason, None, "not queued");
        // Events: in GetJob's answer (and WatchJob's), not in list pages.
        assert!(j.events.is_empty());
        let j = job_detail_to_pb(&d.s, &d.s.jobs()[&small], &reasons);
        let words: Vec<(&str, bool, u64, u32)> = j
            .events
            .iter()
            .map(|e| (e.kind.as_str(), e.warning, e.last_ms, e.count))
            .collect();
        assert_eq!(words, [("Queued", false, 0, 1), ("Scheduled", false, 1, 1)]);
        assert_eq!(j.events[1].message, "placed on agent a (GPUs GPU-a-0)");
        assert_eq!(j.events_dropped, 0);
    }
}

#[cfg(test)]
mod utilization_tests {
    use super::usage::wanted_series;
    use super::*;
    use crate::state::testkit::Driver;
    use gpuctl_core::types::Resources;

    /// Per GPU, a tenant's token gets the curves of the GPUs its own jobs
    /// held, each for the time its task held it, named by the task; never
    /// another tenant's; an admin gets each GPU whole.
    #[test]
    fn a_tenants_token_sees_only_its_own_jobs_gpu_curves() {
        let mut d = Driver::new(&[("a", 2)]);
        let mut submit = |tenant: &str| {
            let mut spec = JobSpec::new(
                "j",
                vec!["true".into()],
                Resources {
                    cpus: 1.0,
                    mem_mib: 0,
                    gpus: 1,
                    ports: 0,
                },
            );
            spec.tenant = tenant.into();
            d.submit(spec)
        };
        let (v, n) = (submit("vision"), submit("nlp"));
        d.launch_at(&v, &[("a", &["GPU-a-0"])], 10).unwrap();
        d.launch_at(&n, &[("a", &["GPU-a-1"])], 20).unwrap();
        let per_gpu = |gpus: &[&str]| pb::UtilizationRequest {
            gpus: gpus.iter().map(|g| g.to_string()).collect(),
            since_ms: 5,
            ..Default::default()
        };
        let got = wanted_series(&d.s, Some("vision"), &per_gpu(&[])).unwrap();
        assert_eq!(
            got,
            [WantedSeries {
                gpu: "GPU-a-0".into(),
                task_id: format!("{v}.0"),
                from: 10,
                to: u64::MAX,
                own: false,
            }]
        );
        assert_eq!(
            wanted_series(&d.s, Some("vision"), &per_gpu(&["GPU-a-1"])).unwrap(),
            [],
            "nlp's GPU"
        );
        let nlp: Vec<String> = wanted_series(&d.s, Some("nlp"), &per_gpu(&[]))
            .unwrap()
            .into_iter()
            .map(|w| w.gpu)
            .collect();
        assert_eq!(nlp, ["GPU-a-1"]);
        // A scope of no tenant (an agent's) sees nothing.
        assert_eq!(wanted_series(&d.s, Some(""), &per_gpu(&[])).unwrap(), []);
        let admin = wanted_series(&d.s, None, &per_gpu(&["GPU-a-0", "GPU-a-1"])).unwrap();
        assert_eq!(admin.len(), 2);
        assert!(admin.iter().all(|w| w.task_id.is_empty() && w.from == 5));
    }
}

#[cfg(test)]
mod user_policy_tests {
    use super::*;
    use crate::state::access::TokenRole;
    use gpuctl_core::types::{IdRanges, TaskSecurity};

    fn token(uids: &str, gids: &str) -> super::super::auth::TokenCaller {
        super::super::auth::TokenCaller {
            id: "t1".into(),
            role: TokenRole::User,
            tenant: "vision".into(),
            framework_roles: vec![],
            allow_root: false,
            allowed_uids: IdRanges::parse(uids).unwrap(),
            allowed_gids: IdRanges::parse(gids).unwrap(),
        }
    }

    fn user(u: Option<&str>) -> TaskSecurity {
        TaskSecurity {
            user: u.map(str::to_string),
            ..Default::default()
        }
    }

    #[test]
    fn a_job_names_only_users_its_token_allows() {
        let t = token("2000-2999", "2000-2999,3500");
        for ok in [None, Some("2000"), Some("2999:3500"), Some("2500:2000")] {
            assert!(check_chosen_user(&t, &user(ok)).is_ok(), "{ok:?}");
        }
        let refused = |u: &str, t| match check_chosen_user(t, &user(Some(u))) {
            Err(ServiceError::Forbidden(m)) => m,
            other => panic!("{u}: {other:?}"),
        };
        // Another tenant's uid.
        let m = refused("1999", &t);
        assert!(m.contains("spec.security.user: uid 1999"), "{m}");
        assert!(m.contains("2000-2999") && m.contains("--allow-uids"), "{m}");
        // A system group with an allowed uid (shadow is 42 on Debian).
        let m = refused("2001:42", &t);
        assert!(m.contains("spec.security.user: gid 42"), "{m}");
        assert!(m.contains("--allow-gids"), "{m}");
        // `UID` alone is `UID:UID`: its gid must be allowed too.
        let wide = token("1-4294967294", "2000");
        let m = refused("3500", &wide);
        assert!(m.contains("gid 3500"), "{m}");
        // A token without a policy (made before it existed) allows none.
        let old = token("none", "none");
        let m = refused("2000", &old);
        assert!(m.contains("(none)"), "{m}");
    }
}
