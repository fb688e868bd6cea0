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

pub struct OperatorService {
    pub(super) ctx: Ctx,
}

pub fn task_to_pb(t: &TaskRecord) -> pb::Task {
    pb::Task {
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
            .map(task_to_pb)
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
    job.events = j
        .events
        .iter()
        .map(|e| pb::JobEvent {
            kind: e.kind.as_str().to_string(),
            warning: e.kind.is_warning(),
            message: e.message.clone(),
            first_ms: e.first_ms,
            last_ms: e.last_ms,
            count: e.count,
        })
        .collect();
    job.events_dropped = j.events.dropped();
    job
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

type LogStream = Pin<Box<dyn Stream<Item = Result<pb::LogChunk, Status>> + Send>>;

/// A line longer than this is sent in pieces.
const MAX_LINE: usize = 64 * 1024;
/// A partial line waits this long for its end before it is sent as is (a
/// progress bar redrawn with `\r` never ends its line).
const PARTIAL_LINE_WAIT: Duration = Duration::from_millis(500);

/// Copies one task's output into a job's log stream. With several tasks,
/// in whole lines, so that their outputs interleave by line; with one, as
/// it comes.
struct LogRelay {
    tx: mpsc::Sender<Result<pb::LogChunk, Status>>,
    task_id: String,
    rank: u32,
    tasks: u32,
}

impl LogRelay {
    fn chunk(&self, data: Vec<u8>) -> pb::LogChunk {
        pb::LogChunk {
            data,
            task_id: self.task_id.clone(),
            rank: self.rank,
            tasks: self.tasks,
        }
    }

    async fn send(&self, data: Vec<u8>) -> bool {
        data.is_empty() || self.tx.send(Ok(self.chunk(data))).await.is_ok()
    }

    async fn run(
        self,
        mut upstream: tonic::Streaming<pb::TaskLogChunk>,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) {
        let by_line = self.tasks > 1;
        let mut partial: Vec<u8> = Vec::new();
        loop {
            // A follower must not hold up the master's shutdown.
            let item = tokio::select! {
                item = upstream.next() => item,
                _ = tokio::time::sleep(PARTIAL_LINE_WAIT), if !partial.is_empty() => {
                    if !self.send(std::mem::take(&mut partial)).await {
                        return;
                    }
                    continue;
                }
                _ = shutdown.changed() => return,
            };
            let data = match item {
                Some(Ok(c)) => c.data,
                Some(Err(status)) => {
                    let _ = self.send(std::mem::take(&mut partial)).await;
                    let _ = self.tx.send(Err(status)).await;
                    return;
                }
                None => break,
            };
            if !by_line {
                if !self.send(data).await {
                    return;
                }
                continue;
            }
            partial.extend_from_slice(&data);
            let whole = match partial.iter().rposition(|b| *b == b'\n') {
                Some(i) => i + 1,
                None if partial.len() >= MAX_LINE => partial.len(),
                None => 0,
            };
            if whole > 0 {
                let rest = partial.split_off(whole);
                if !self.send(std::mem::replace(&mut partial, rest)).await {
                    return;
                }
            }
        }
        let _ = self.send(partial).await;
    }
}
type JobStream = Pin<Box<dyn Stream<Item = Result<pb::Job, Status>> + Send>>;

#[tonic::async_trait]
impl pb::operator_server::Operator for OperatorService {
    type JobLogsStream = LogStream;
    type WatchJobStream = JobStream;

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

/// The curves `req` asks for, as `scope` (the caller's tenant; `None`:
/// every tenant's) may see them: a job's GPUs while its tasks held them;
/// per GPU, every GPU's whole curve for an admin, and for a tenant's token
/// only the GPUs its own jobs held, for the time they held them: a GPU's
/// curve shows whoever held it, and a tenant sees only its own jobs. PURE.
fn wanted_series(
    state: &State,
    scope: Option<&str>,
    req: &pb::UtilizationRequest,
) -> Result<Vec<WantedSeries>, ServiceError> {
    let mut wanted = Vec::new();
    // A task's GPUs while it held them: a fraction's own curve, or none
    // (it goes a day after the task's last reading), since a shared GPU's
    // is its neighbours' too, never the fraction's.
    let held_by = |t: &TaskRecord, wanted: &mut Vec<WantedSeries>| {
        let to = if t.state.is_terminal() {
            t.updated_at_ms
        } else {
            u64::MAX
        };
        for g in &t.gpu_uuids {
            wanted.push(WantedSeries {
                gpu: g.clone(),
                task_id: t.id.clone(),
                from: t.created_at_ms.max(req.since_ms),
                to,
                own: t.fraction.is_some(),
            });
        }
    };
    if !req.job_id.is_empty() {
        let job = state
            .job(&req.job_id)
            .ok_or_else(|| ServiceError::not_found(Missing::Job, &req.job_id))?;
        for t in job.task_ids.iter().filter_map(|t| state.task(t)) {
            held_by(t, &mut wanted);
        }
    } else if let Some(tenant) = scope {
        let mine = state.tasks().values().filter(|t| {
            !t.job_id.is_empty()
                && !t.gpu_uuids.is_empty()
                && (!t.state.is_terminal() || t.updated_at_ms >= req.since_ms)
                && state
                    .job(&t.job_id)
                    .is_some_and(|j| !tenant.is_empty() && j.spec.tenant.name() == tenant)
        });
        for t in mine {
            held_by(t, &mut wanted);
        }
        if !req.gpus.is_empty() {
            wanted.retain(|w| req.gpus.contains(&w.gpu));
        }
    } else {
        let history = state.util_history();
        let all: Vec<&String> = if req.gpus.is_empty() {
            history.gpus.keys().collect()
        } else {
            req.gpus.iter().collect()
        };
        wanted.extend(all.into_iter().map(|g| WantedSeries {
            gpu: g.clone(),
            task_id: String::new(),
            from: req.since_ms,
            to: u64::MAX,
            own: false,
        }));
    }
    Ok(wanted)
}

/// Each RPC's logic; the `Operator` impl above only turns its errors
/// into `Status` (`reply`).
impl OperatorService {
    /// GPU utilization history, from this master's state.
    fn utilization(
        &self,
        caller: &Caller,
        req: pb::UtilizationRequest,
    ) -> Result<pb::UtilizationResponse, ServiceError> {
        /// Most GPUs in one answer (a day of minutes each is ~3 KB).
        const MAX_GPUS: usize = 256;
        if req.gpus.len() > MAX_GPUS {
            return Err(ConvertError::new("gpus", format!("at most {MAX_GPUS}")).into());
        }
        if !req.job_id.is_empty() {
            job_id_arg(&req.job_id)?;
            self.check_job_access(caller, &req.job_id)?;
        }
        let state = self.ctx.raft.state();
        let history = state.util_history();
        let mut wanted = wanted_series(&state, caller.tenant_scope(), &req)?;
        let truncated = wanted.len() > MAX_GPUS;
        wanted.truncate(MAX_GPUS);
        let gpus = wanted
            .into_iter()
            .filter_map(
                |WantedSeries {
                     gpu,
                     task_id,
                     from,
                     to,
                     own,
                 }| {
                    let h = if own {
                        history.task(&task_id)?
                    } else {
                        history.gpu(&gpu)?
                    };
                    if req.hourly {
                        let (start_ms, util, mem) = h.hourly(from, to);
                        return (!util.is_empty()).then_some(pb::GpuSeries {
                            start_ms,
                            period_ms: crate::state::usage::HOUR_MS,
                            util,
                            mem,
                            gpu,
                            task_id,
                            own,
                        });
                    }
                    let first =
                        from.saturating_sub(h.start_ms).div_ceil(h.period_ms.max(1)) as usize;
                    let last = if to == u64::MAX {
                        h.util.len()
                    } else {
                        (to.saturating_sub(h.start_ms) / h.period_ms.max(1)) as usize + 1
                    };
                    let range = first.min(h.util.len())..last.min(h.util.len());
                    Some(pb::GpuSeries {
                        start_ms: h.start_ms + h.period_ms * range.start as u64,
                        period_ms: h.period_ms,
                        util: h.util.range(range.clone()).copied().collect(),
                        mem: h.mem.range(range).copied().collect(),
                        gpu,
                        task_id,
                        own,
                    })
                },
            )
            .collect();
        let c = &history.cluster;
        if req.hourly {
            let (cluster_start_ms, allocated, busy_pct_sum) = c.hourly(req.since_ms);
            return Ok(pb::UtilizationResponse {
                gpus,
                cluster_start_ms,
                cluster_period_ms: crate::state::usage::HOUR_MS,
                allocated,
                busy_pct_sum,
                truncated,
            });
        }
        let first = (req.since_ms.saturating_sub(c.start_ms))
            .div_ceil(c.period_ms.max(1))
            .min(c.allocated.len() as u64) as usize;
        Ok(pb::UtilizationResponse {
            gpus,
            cluster_start_ms: c.start_ms + c.period_ms * first as u64,
            cluster_period_ms: c.period_ms,
            allocated: c.allocated.range(first..).copied().collect(),
            busy_pct_sum: c.busy_pct_sum.range(first..).copied().collect(),
            truncated,
        })
    }

    /// The accounting report, from this master's state.
    fn usage(
        &self,
        caller: &Caller,
        req: pb::UsageRequest,
    ) -> Result<pb::UsageResponse, ServiceError> {
        use crate::state::usage;
        let by: usage::By = req
            .by
            .parse()
            .map_err(|e: String| ConvertError::new("by", e))?;
        let now = now_ms();
        if req.since_ms > now {
            return Err(ConvertError::new("since_ms", "is in the future").into());
        }
        let state = self.ctx.raft.state();
        let (rows, since, truncated) =
            usage::report(&state, req.since_ms, now, by, caller.tenant_scope());
        Ok(pb::UsageResponse {
            rows: rows
                .into_iter()
                .map(|r| pb::UsageRow {
                    key: r.key,
                    tenant: r.tenant,
                    gpu_ms: r.totals.gpu_ms,
                    cpu_ms: r.totals.cpu_ms,
                    mem_mib_ms: r.totals.mem_mib_ms,
                    tasks: r.totals.tasks,
                    running: r.running,
                    gpu_sampled_ms: r.totals.gpu_sampled_ms,
                    gpu_busy_ms: r.totals.gpu_busy_ms,
                    gpu_startup_ms: r.totals.gpu_startup_ms,
                })
                .collect(),
            since_ms: since,
            until_ms: now,
            truncated,
        })
    }

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

    async fn submit_job(
        &self,
        caller: &Caller,
        req: pb::SubmitJobRequest,
    ) -> Result<pb::SubmitJobResponse, ServiceError> {
        // The key is the caller's: another token's same id is another key.
        let request_id = if req.request_id.is_empty() {
            None
        } else {
            gpuctl_core::convert::check_id("request_id", &req.request_id)?;
            Some(request_key(caller.request_scope(), &req.request_id))
        };
        let spec = req
            .spec
            .ok_or_else(|| ConvertError::new("spec", "missing"))?;
        let mut spec = JobSpec::try_from(spec)?;
        spec.submitted_by = caller.token_id().unwrap_or_default().to_string();
        // Charged to the caller's tenant; only an admin may name another.
        if spec.tenant.is_unset() {
            spec.tenant = caller.tenant().into();
        } else if !caller.may_access(spec.tenant.name()) {
            return Err(ServiceError::Forbidden(format!(
                "spec.tenant: your token is tenant {}'s; it cannot submit jobs for tenant {}",
                caller.tenant(),
                spec.tenant
            )));
        }
        // Root on a host needs the agent's consent (allow_root_tasks, in
        // placement) and the tenant's: its token must allow it.
        if spec.template.security.run_as_root {
            if let Caller::Token(t) = caller {
                if !t.allow_root {
                    return Err(ServiceError::Forbidden(format!(
                        "spec.security.run_as_root: tenant {}'s token does not allow root \
                         tasks (an admin makes one with `gpuctl tokens create --allow-root`)",
                        caller.tenant()
                    )));
                }
            }
        }
        if let Caller::Token(t) = caller {
            check_chosen_user(t, &spec.template.security)?;
        }
        self.ctx
            .config
            .check_stop_grace(spec.template.stop_grace_ms)
            .map_err(|why| ConvertError::new("spec.stop_grace_ms", why))?;
        // A resend of a submit already committed: answer from the state
        // (apply dedupes too, for a resend racing its first send).
        if let Some(key) = &request_id {
            let state = self.ctx.raft.state();
            if let Some(job_id) = state
                .resubmitted(key, &spec, None)
                .map_err(crate::raft::ProposeError::Rejected)?
            {
                return Ok(pb::SubmitJobResponse {
                    job_id: job_id.clone(),
                });
            }
        }
        match self
            .ctx
            .raft
            .propose(Command::SubmitJob {
                spec,
                at_ms: now_ms(),
                request_id,
            })
            .await?
        {
            Outcome::JobSubmitted { job_id } => {
                tracing::info!(job_id = %job_id, "job submitted");
                Ok(pb::SubmitJobResponse { job_id })
            }
            other => Err(ServiceError::unexpected("submit_job", other)),
        }
    }

    /// The job, then each change of it, until it ends. Wakes on applied
    /// entries and on newly published wait reasons; sends only when what
    /// the client would see differs. Bounded: one message in flight.
    async fn watch_job(
        &self,
        caller: &Caller,
        req: pb::GetJobRequest,
    ) -> Result<JobStream, ServiceError> {
        let first = self.get_job(caller, req).await?;
        let id = first.id.clone();
        let (tx, rx) = mpsc::channel(1);
        let ctx = self.ctx.clone();
        tokio::spawn(async move {
            let mut applied = ctx.raft.applied();
            let mut published = ctx.waits.subscribe();
            let mut status = ctx.raft.status_watch();
            let mut shutdown = ctx.shutdown.clone();
            let mut last = first;
            if tx.send(Ok(last.clone())).await.is_err() {
                return;
            }
            while !job_state_from_pb("state", last.state).is_ok_and(|s| s.is_terminal()) {
                tokio::select! {
                    r = applied.changed() => if r.is_err() { return },
                    r = published.changed() => if r.is_err() { return },
                    r = status.changed() => if r.is_err() { return },
                    _ = shutdown.changed() => return,
                    _ = tx.closed() => return,
                }
                if !ctx.raft.status().serving {
                    let _ = tx.send(Err(ctx.not_leader().into())).await;
                    return;
                }
                let job = {
                    let state = ctx.raft.state();
                    match state.job(&id) {
                        Some(j) => Ok(job_detail_to_pb(&state, j, &ctx.waits.reasons())),
                        // Forgotten (--job-retention) while watched.
                        None => Err(ServiceError::job_not_found(&state, &id)),
                    }
                };
                let job = match job {
                    Ok(job) => job,
                    Err(gone) => {
                        let _ = tx.send(Err(gone.into())).await;
                        return;
                    }
                };
                if job != last {
                    last = job;
                    if tx.send(Ok(last.clone())).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }

    async fn get_job(
        &self,
        caller: &Caller,
        req: pb::GetJobRequest,
    ) -> Result<pb::Job, ServiceError> {
        let id = self.job_id_of(caller, req)?;
        job_id_arg(&id)?;
        self.check_job_access(caller, &id)?;
        let state = self.ctx.raft.state();
        let job = state
            .job(&id)
            .ok_or_else(|| ServiceError::job_not_found(&state, &id))?;
        let reasons = self.ctx.waits.reasons();
        Ok(job_detail_to_pb(&state, job, &reasons))
    }

    async fn list_jobs(
        &self,
        caller: &Caller,
        req: pb::ListJobsRequest,
    ) -> Result<pb::ListJobsResponse, ServiceError> {
        let req = JobsQuery::try_from(req)?;
        let state = self.ctx.raft.state();
        let reasons = self.ctx.waits.reasons();
        Ok(jobs_page::page(
            &state,
            &req,
            caller.tenant_scope(),
            jobs_page::PAGE_BYTES,
            |j| job_to_pb(&state, j, &reasons),
        ))
    }

    async fn cancel_job(
        &self,
        caller: &Caller,
        req: pb::CancelJobRequest,
    ) -> Result<pb::CancelJobResponse, ServiceError> {
        let job_id = req.job_id;
        job_id_arg(&job_id)?;
        self.check_job_access(caller, &job_id)?;
        match self
            .ctx
            .raft
            .propose(Command::CancelJob {
                job_id,
                at_ms: now_ms(),
            })
            .await?
        {
            Outcome::JobCancelled { state } => Ok(pb::CancelJobResponse {
                state: pb::JobState::from(state) as i32,
            }),
            other => Err(ServiceError::unexpected("cancel_job", other)),
        }
    }

    async fn list_agents(
        &self,
        _req: pb::ListAgentsRequest,
    ) -> Result<pb::ListAgentsResponse, ServiceError> {
        let state = self.ctx.raft.state();
        Ok(pb::ListAgentsResponse {
            agents: state
                .agents()
                .values()
                .map(|a| agent_to_pb(a, self.ctx.liveness.runtime_status(&a.info.id)))
                .collect(),
        })
    }

    async fn list_gpus(
        &self,
        _req: pb::ListGpusRequest,
    ) -> Result<pb::ListGpusResponse, ServiceError> {
        let samples = self.ctx.liveness.gpu_samples();
        let state = self.ctx.raft.state();
        let mut gpus = Vec::new();
        for a in state.agents().values() {
            for g in &a.info.gpus {
                gpus.push(gpu_status(&state, a, g, &samples));
            }
        }
        Ok(pb::ListGpusResponse { gpus })
    }

    async fn cordon_gpu(&self, req: pb::CordonGpuRequest) -> Result<pb::GpuStatus, ServiceError> {
        gpuctl_core::convert::check_id("uuid", &req.uuid)?;
        self.ctx
            .raft
            .propose(Command::CordonGpu {
                uuid: req.uuid.clone(),
                cordon: req.cordon,
            })
            .await?;
        tracing::info!(uuid = %req.uuid, cordon = req.cordon, "GPU cordon changed");
        self.gpu_status_of(&req.uuid)
    }

    /// One GPU as `gpus` shows it, after a change of it.
    fn gpu_status_of(&self, uuid: &str) -> Result<pb::GpuStatus, ServiceError> {
        let samples = self.ctx.liveness.gpu_samples();
        let state = self.ctx.raft.state();
        state
            .agents()
            .values()
            .find_map(|a| {
                a.info
                    .gpus
                    .iter()
                    .find(|g| g.uuid == uuid)
                    .map(|g| gpu_status(&state, a, g, &samples))
            })
            .ok_or_else(|| ServiceError::not_found(Missing::Gpu, uuid))
    }

    async fn share_gpu(&self, req: pb::ShareGpuRequest) -> Result<pb::GpuStatus, ServiceError> {
        gpuctl_core::convert::check_id("uuid", &req.uuid)?;
        let mode = if req.mode.is_empty() {
            None
        } else {
            Some(
                req.mode
                    .parse::<gpuctl_core::types::ShareMode>()
                    .map_err(|e| gpuctl_core::convert::ConvertError::new("mode", e))?,
            )
        };
        self.ctx
            .raft
            .propose(Command::ShareGpu {
                gpu_uuid: req.uuid.clone(),
                mode,
            })
            .await?;
        tracing::info!(uuid = %req.uuid, mode = ?mode, "GPU sharing changed");
        self.gpu_status_of(&req.uuid)
    }

    async fn set_mig_layout(
        &self,
        caller: &Caller,
        req: pb::SetMigLayoutRequest,
    ) -> Result<pb::GpuStatus, ServiceError> {
        gpuctl_core::convert::check_id("uuid", &req.uuid)?;
        gpuctl_core::convert::check_mig_layout(&req.profiles, req.disable)?;
        let by = match caller {
            Caller::Token(t) => format!("token {}", t.id),
            _ => "operator".to_string(),
        };
        self.ctx
            .raft
            .propose(Command::SetMigLayout {
                gpu_uuid: req.uuid.clone(),
                profiles: req.profiles.clone(),
                disable: req.disable,
                by,
                at_ms: now_ms(),
            })
            .await?;
        tracing::info!(uuid = %req.uuid, profiles = ?req.profiles, disable = req.disable, "MIG layout change asked");
        self.gpu_status_of(&req.uuid)
    }

    async fn drain_agent(&self, req: pb::DrainAgentRequest) -> Result<pb::Agent, ServiceError> {
        gpuctl_core::convert::check_id("agent_id", &req.agent_id)?;
        let at_ms = now_ms();
        let deadline_ms = drain_deadline(at_ms, req.deadline_secs)?;
        self.ctx
            .raft
            .propose(Command::DrainAgent {
                agent_id: req.agent_id.clone(),
                kill: req.kill,
                deadline_ms,
                at_ms,
            })
            .await?;
        tracing::info!(agent_id = %req.agent_id, kill = req.kill, deadline_ms = ?deadline_ms, "agent draining");
        // Its outstanding offers are rescinded by the next cycle.
        self.ctx.hub.wake();
        self.agent_reply(&req.agent_id)
    }

    async fn undrain_agent(&self, req: pb::UndrainAgentRequest) -> Result<pb::Agent, ServiceError> {
        gpuctl_core::convert::check_id("agent_id", &req.agent_id)?;
        self.ctx
            .raft
            .propose(Command::UndrainAgent {
                agent_id: req.agent_id.clone(),
                at_ms: now_ms(),
            })
            .await?;
        tracing::info!(agent_id = %req.agent_id, "agent drain ended");
        self.ctx.hub.wake();
        self.agent_reply(&req.agent_id)
    }

    async fn job_logs(
        &self,
        caller: &Caller,
        req: pb::JobLogsRequest,
    ) -> Result<LogStream, ServiceError> {
        job_id_arg(&req.job_id)?;
        if req.attempt == Some(0) {
            return Err(ConvertError::new("attempt", "attempts count from 1").into());
        }
        self.check_job_access(caller, &req.job_id)?;
        let raft = self.ctx.raft.clone();
        let job_id = req.job_id.clone();
        // The attempt's tasks and their agents; with --follow wait until
        // that attempt is placed.
        let mut applied = raft.applied();
        let tasks: Vec<(u32, String, String)> = loop {
            {
                let state = raft.state();
                let job = state
                    .job(&job_id)
                    .ok_or_else(|| ServiceError::job_not_found(&state, &job_id))?;
                let attempts = state.attempts(&job_id);
                let chosen = match req.attempt {
                    Some(n) => attempts.get(n as usize - 1),
                    None => attempts.last(),
                };
                if let Some(tasks) = chosen {
                    let picked: Vec<(u32, String, String)> = tasks
                        .iter()
                        .filter(|t| req.rank.is_none_or(|r| r == t.rank))
                        .map(|t| {
                            let addr = state
                                .agent(&t.agent_id)
                                .map(|a| a.info.address.clone())
                                .unwrap_or_default();
                            (t.rank, t.id.clone(), addr)
                        })
                        .collect();
                    if picked.is_empty() {
                        return Err(ConvertError::new(
                            "rank",
                            format!(
                                "job {job_id} has ranks 0 to {} in that attempt",
                                tasks.len().saturating_sub(1)
                            ),
                        )
                        .into());
                    }
                    break picked;
                }
                if job.state.is_terminal() {
                    return match req.attempt {
                        Some(n) => Err(ConvertError::new(
                            "attempt",
                            format!(
                                "job {job_id} ended after {} attempt(s), not {n}",
                                attempts.len()
                            ),
                        )
                        .into()),
                        None => Ok(Box::pin(futures::stream::empty())),
                    };
                }
                if !req.follow {
                    return Err(ServiceError::JobNotStarted { job_id });
                }
            }
            if applied.changed().await.is_err() {
                return Err(ServiceError::ShuttingDown);
            }
        };
        let count = tasks.len() as u32;
        let upstreams =
            futures::future::try_join_all(tasks.into_iter().map(|(rank, task_id, address)| {
                self.task_logs(rank, task_id, address, req.follow)
            }))
            .await?;
        let (tx, rx) = mpsc::channel(16);
        for (rank, task_id, upstream) in upstreams {
            let relay = LogRelay {
                tx: tx.clone(),
                task_id,
                rank,
                tasks: count,
            };
            tokio::spawn(relay.run(upstream, self.ctx.shutdown.clone()));
        }
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }

    /// Opens one task's output at its agent.
    async fn task_logs(
        &self,
        rank: u32,
        task_id: String,
        address: String,
        follow: bool,
    ) -> Result<(u32, String, tonic::Streaming<pb::TaskLogChunk>), ServiceError> {
        if address.is_empty() {
            // Not a master problem: another master would not do better.
            return Err(ServiceError::NoLogAddress { task_id });
        }
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
            .map_err(|source| ServiceError::AgentAddress {
                address: address.clone(),
                source,
            })?
            .connect_timeout(Duration::from_secs(5));
        // The agent must hold an agent certificate (checked by the
        // connector); it checks ours is a master's.
        let channel =
            gpuctl_auth::tls::connect(&endpoint, self.ctx.tls(), gpuctl_auth::CertRole::Agent)
                .await
                .map_err(|source| ServiceError::AgentUnreachable {
                    address: address.clone(),
                    source,
                })?;
        let mut client = pb::agent_api_client::AgentApiClient::new(channel);
        let upstream = client
            .task_logs(pb::TaskLogsRequest {
                task_id: task_id.clone(),
                follow,
            })
            .await
            .map_err(ServiceError::Relayed)?
            .into_inner();
        Ok((rank, task_id, upstream))
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
