//! A fake master for tests: implement [`FakeOperator`] for the state a test
//! needs, overriding only the calls it answers, and [`serve`] it.
//!
//! Calls are plain functions from request message to response message; a
//! call not overridden answers `UNIMPLEMENTED`.

use futures::StreamExt as _;
use std::pin::Pin;
use std::sync::Arc;

use gpuctl_proto::pb;
use tonic::{Request, Response, Status};

fn unused<T>() -> Result<T, Status> {
    Err(Status::unimplemented("not used by this test"))
}

/// The Operator service, one plain method per call.
pub(crate) trait FakeOperator: Send + Sync + 'static {
    fn submit_job(&self, _: pb::SubmitJobRequest) -> Result<pb::SubmitJobResponse, Status> {
        unused()
    }
    fn get_job(&self, _: pb::GetJobRequest) -> Result<pb::Job, Status> {
        unused()
    }
    fn list_jobs(&self, _: pb::ListJobsRequest) -> Result<pb::ListJobsResponse, Status> {
        unused()
    }
    fn cancel_job(&self, _: pb::CancelJobRequest) -> Result<pb::CancelJobResponse, Status> {
        unused()
    }
    fn list_agents(&self, _: pb::ListAgentsRequest) -> Result<pb::ListAgentsResponse, Status> {
        unused()
    }
    fn list_gpus(&self, _: pb::ListGpusRequest) -> Result<pb::ListGpusResponse, Status> {
        unused()
    }
    fn cordon_gpu(&self, _: pb::CordonGpuRequest) -> Result<pb::GpuStatus, Status> {
        unused()
    }
    fn set_mig_layout(&self, _: pb::SetMigLayoutRequest) -> Result<pb::GpuStatus, Status> {
        unused()
    }
    fn share_gpu(&self, _: pb::ShareGpuRequest) -> Result<pb::GpuStatus, Status> {
        unused()
    }
    fn drain_agent(&self, _: pb::DrainAgentRequest) -> Result<pb::Agent, Status> {
        unused()
    }
    fn undrain_agent(&self, _: pb::UndrainAgentRequest) -> Result<pb::Agent, Status> {
        unused()
    }
    /// The items of the stream, sent in order; then the stream ends.
    /// UNIMPLEMENTED unless a test says otherwise, as from a master that
    /// predates WatchJob: `jobs wait` then polls `get_job`.
    fn watch_job(&self, _: pb::GetJobRequest) -> Result<Vec<Result<pb::Job, Status>>, Status> {
        Err(Status::unimplemented("WatchJob"))
    }
    /// Whether the watch stream stays open after its items (a job that
    /// does not change) instead of ending.
    fn watch_stays_open(&self) -> bool {
        false
    }
    /// The items of an endpoints watch (then as `watch_stays_open`).
    fn watch_endpoints(
        &self,
        _: pb::WatchEndpointsRequest,
    ) -> Result<Vec<Result<pb::ServiceEndpoints, Status>>, Status> {
        Err(Status::unimplemented("WatchEndpoints"))
    }
    /// The items of the stream, sent in order; then the stream ends.
    fn job_logs(&self, _: pb::JobLogsRequest) -> Result<Vec<Result<pb::LogChunk, Status>>, Status> {
        unused()
    }
    fn list_masters(&self, _: pb::ListMastersRequest) -> Result<pb::ListMastersResponse, Status> {
        unused()
    }
    fn add_master(&self, _: pb::AddMasterRequest) -> Result<pb::ListMastersResponse, Status> {
        unused()
    }
    fn remove_master(&self, _: pb::RemoveMasterRequest) -> Result<pb::ListMastersResponse, Status> {
        unused()
    }
    fn usage(&self, _: pb::UsageRequest) -> Result<pb::UsageResponse, Status> {
        unused()
    }
    fn utilization(&self, _: pb::UtilizationRequest) -> Result<pb::UtilizationResponse, Status> {
        unused()
    }
    fn create_service(&self, _: pb::CreateServiceRequest) -> Result<pb::Service, Status> {
        unused()
    }
    fn get_service(&self, _: pb::GetServiceRequest) -> Result<pb::Service, Status> {
        unused()
    }
    fn list_services(
        &self,
        _: pb::ListServicesRequest,
    ) -> Result<pb::ListServicesResponse, Status> {
        unused()
    }
    fn scale_service(&self, _: pb::ScaleServiceRequest) -> Result<pb::Service, Status> {
        unused()
    }
    fn delete_service(
        &self,
        _: pb::DeleteServiceRequest,
    ) -> Result<pb::DeleteServiceResponse, Status> {
        unused()
    }
}

/// Log chunks holding these strings.
pub(crate) fn chunks(data: &[&str]) -> Vec<Result<pb::LogChunk, Status>> {
    data.iter()
        .map(|s| {
            Ok(pb::LogChunk {
                data: s.as_bytes().to_vec(),
                task_id: "job-1.0".into(),
                rank: 0,
                tasks: 1,
            })
        })
        .collect()
}

/// A page of `jobs` as the master answers ListJobs: filtered by state and
/// name, newest first by the N of `job-N`, `limit` jobs (0: 500, at most
/// 1000), the token being the last job's N.
pub(crate) fn jobs_page(jobs: &[pb::Job], req: &pb::ListJobsRequest) -> pb::ListJobsResponse {
    let seq = |j: &pb::Job| -> u64 {
        j.id.strip_prefix("job-")
            .and_then(|n| n.parse().ok())
            .unwrap_or(u64::MAX)
    };
    let before: u64 = req.page_token.parse().unwrap_or(u64::MAX);
    let mut matching: Vec<&pb::Job> = jobs
        .iter()
        .filter(|j| req.states.is_empty() || req.states.contains(&j.state))
        .filter(|j| req.name.is_empty() || j.spec.as_ref().is_some_and(|s| s.name == req.name))
        .filter(|j| req.page_token.is_empty() || seq(j) < before)
        .collect();
    matching.sort_by_key(|j| std::cmp::Reverse(seq(j)));
    let limit = match req.limit {
        0 => 500,
        n => n.min(1000),
    } as usize;
    let page: Vec<pb::Job> = matching.iter().take(limit).map(|j| (*j).clone()).collect();
    let next_page_token = match page.last() {
        Some(last) if matching.len() > page.len() => seq(last).to_string(),
        _ => String::new(),
    };
    pb::ListJobsResponse {
        jobs: page,
        next_page_token,
    }
}

/// Serves `fake` on a free local port; returns its address.
pub(crate) async fn serve<F: FakeOperator>(fake: Arc<F>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::operator_server::OperatorServer::new(Served(fake)))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    addr
}

/// An address nobody listens on.
pub(crate) fn dead_addr() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string()
}

struct Served<F>(Arc<F>);

type LogStream = Pin<Box<dyn futures::Stream<Item = Result<pb::LogChunk, Status>> + Send>>;
type JobStream = Pin<Box<dyn futures::Stream<Item = Result<pb::Job, Status>> + Send>>;
type EndpointStream =
    Pin<Box<dyn futures::Stream<Item = Result<pb::ServiceEndpoints, Status>> + Send>>;

/// The generated trait, each call forwarded to the plain method.
macro_rules! forward {
    ($($name:ident($req:ty) -> $resp:ty;)*) => {
        #[tonic::async_trait]
        impl<F: FakeOperator> pb::operator_server::Operator for Served<F> {
            $(async fn $name(&self, r: Request<$req>) -> Result<Response<$resp>, Status> {
                self.0.$name(r.into_inner()).map(Response::new)
            })*
            type JobLogsStream = LogStream;
            async fn job_logs(
                &self,
                r: Request<pb::JobLogsRequest>,
            ) -> Result<Response<LogStream>, Status> {
                let items = self.0.job_logs(r.into_inner())?;
                Ok(Response::new(Box::pin(futures::stream::iter(items))))
            }
            type WatchEndpointsStream = EndpointStream;
            async fn watch_endpoints(
                &self,
                r: Request<pb::WatchEndpointsRequest>,
            ) -> Result<Response<EndpointStream>, Status> {
                let items = futures::stream::iter(self.0.watch_endpoints(r.into_inner())?);
                if self.0.watch_stays_open() {
                    Ok(Response::new(Box::pin(items.chain(futures::stream::pending()))))
                } else {
                    Ok(Response::new(Box::pin(items)))
                }
            }
            type WatchJobStream = JobStream;
            async fn watch_job(
                &self,
                r: Request<pb::GetJobRequest>,
            ) -> Result<Response<JobStream>, Status> {
                let items = futures::stream::iter(self.0.watch_job(r.into_inner())?);
                if self.0.watch_stays_open() {
                    Ok(Response::new(Box::pin(items.chain(futures::stream::pending()))))
                } else {
                    Ok(Response::new(Box::pin(items)))
                }
            }
        }
    };
}

forward! {
    submit_job(pb::SubmitJobRequest) -> pb::SubmitJobResponse;
    get_job(pb::GetJobRequest) -> pb::Job;
    list_jobs(pb::ListJobsRequest) -> pb::ListJobsResponse;
    cancel_job(pb::CancelJobRequest) -> pb::CancelJobResponse;
    list_agents(pb::ListAgentsRequest) -> pb::ListAgentsResponse;
    list_gpus(pb::ListGpusRequest) -> pb::ListGpusResponse;
    cordon_gpu(pb::CordonGpuRequest) -> pb::GpuStatus;
    set_mig_layout(pb::SetMigLayoutRequest) -> pb::GpuStatus;
    share_gpu(pb::ShareGpuRequest) -> pb::GpuStatus;
    drain_agent(pb::DrainAgentRequest) -> pb::Agent;
    undrain_agent(pb::UndrainAgentRequest) -> pb::Agent;
    list_masters(pb::ListMastersRequest) -> pb::ListMastersResponse;
    add_master(pb::AddMasterRequest) -> pb::ListMastersResponse;
    remove_master(pb::RemoveMasterRequest) -> pb::ListMastersResponse;
    usage(pb::UsageRequest) -> pb::UsageResponse;
    utilization(pb::UtilizationRequest) -> pb::UtilizationResponse;
    create_service(pb::CreateServiceRequest) -> pb::Service;
    get_service(pb::GetServiceRequest) -> pb::Service;
    list_services(pb::ListServicesRequest) -> pb::ListServicesResponse;
    scale_service(pb::ScaleServiceRequest) -> pb::Service;
    delete_service(pb::DeleteServiceRequest) -> pb::DeleteServiceResponse;
}
