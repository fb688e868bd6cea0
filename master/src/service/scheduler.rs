//! The Scheduler (framework) API: an outline until the framework API issue.

use gpuctl_proto::pb;
use tonic::{Request, Response, Status};

pub struct SchedulerService;

fn not_yet() -> Status {
    Status::unimplemented(
        "the framework (Scheduler) API is not implemented yet; use the Operator API (gpuctl jobs)",
    )
}

#[tonic::async_trait]
impl pb::scheduler_server::Scheduler for SchedulerService {
    type SubscribeStream =
        std::pin::Pin<Box<dyn futures::Stream<Item = Result<pb::Event, Status>> + Send>>;

    async fn subscribe(
        &self,
        _: Request<pb::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        Err(not_yet())
    }
    async fn accept(
        &self,
        _: Request<pb::AcceptRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        Err(not_yet())
    }
    async fn decline(
        &self,
        _: Request<pb::DeclineRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        Err(not_yet())
    }
    async fn kill(
        &self,
        _: Request<pb::KillRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        Err(not_yet())
    }
    async fn acknowledge(
        &self,
        _: Request<pb::AcknowledgeRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        Err(not_yet())
    }
    async fn revive(
        &self,
        _: Request<pb::ReviveRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        Err(not_yet())
    }
    async fn suppress(
        &self,
        _: Request<pb::SuppressRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        Err(not_yet())
    }
    async fn reconcile(
        &self,
        _: Request<pb::ReconcileRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        Err(not_yet())
    }
    async fn teardown(
        &self,
        _: Request<pb::TeardownRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        Err(not_yet())
    }
    async fn update_framework(
        &self,
        _: Request<pb::UpdateFrameworkRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        Err(not_yet())
    }
}
