//! tonic services. Thin: validate input (through gpuctl-proto's convert),
//! read the applied state or propose a command, convert the answer.

mod agent;
mod framework;
pub mod gate;
mod jobs_page;
mod masters;
mod operator;
mod raft;
mod task_stream;

use std::sync::Arc;

use gpuctl_proto::pb;
use tokio::sync::watch;

use crate::leader::frameworks::Hub;
use crate::leader::Liveness;
use crate::raft::{ProposeError, RaftHandle};
use crate::state::ApplyError;
use crate::MasterConfig;

#[derive(Clone)]
pub struct Ctx {
    pub raft: RaftHandle,
    pub config: MasterConfig,
    pub liveness: Arc<Liveness>,
    pub hub: Arc<Hub>,
    pub shutdown: watch::Receiver<bool>,
}

impl Ctx {
    /// The redirect this master answers with when it is not the leader.
    pub fn not_leader(&self) -> tonic::Status {
        let leader = self.raft.leader();
        gpuctl_proto::leader::not_leader(leader.as_ref().map(|(id, a)| (*id, a.as_str())))
    }
}

/// Upper bound on a gRPC message, both ways.
const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

pub fn operator_server(ctx: Ctx) -> pb::operator_server::OperatorServer<operator::OperatorService> {
    pb::operator_server::OperatorServer::new(operator::OperatorService { ctx })
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
}

pub fn agent_manager_server(
    ctx: Ctx,
) -> pb::agent_manager_server::AgentManagerServer<agent::AgentManagerService> {
    pb::agent_manager_server::AgentManagerServer::new(agent::AgentManagerService { ctx })
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
}

pub fn raft_server(ctx: Ctx) -> pb::raft_transport_server::RaftTransportServer<raft::RaftService> {
    pb::raft_transport_server::RaftTransportServer::new(raft::RaftService { ctx })
        .max_decoding_message_size(crate::raft::transport::MAX_RAFT_MESSAGE_BYTES)
}

pub fn framework_server(
    ctx: Ctx,
) -> pb::scheduler_server::SchedulerServer<framework::SchedulerService> {
    pb::scheduler_server::SchedulerServer::new(framework::SchedulerService { ctx })
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
}

impl From<ProposeError> for tonic::Status {
    fn from(e: ProposeError) -> Self {
        match e {
            // Never proposed: the client may retry at the leader.
            ProposeError::NotLeader { leader } => gpuctl_proto::leader::not_leader(
                leader.as_ref().map(|(id, addr)| (*id, addr.as_str())),
            ),
            // Proposed but not known to be committed: no leader hint, so
            // clients do not resubmit blindly.
            ProposeError::LeadershipLost | ProposeError::Stopped => {
                tonic::Status::unavailable(e.to_string())
            }
            ProposeError::Membership(m) => tonic::Status::failed_precondition(m),
            ProposeError::Busy => tonic::Status::resource_exhausted(e.to_string()),
            ProposeError::Rejected(a) => match a {
                ApplyError::JobNotFound(_)
                | ApplyError::AgentNotFound(_)
                | ApplyError::FrameworkNotFound(_)
                | ApplyError::TaskNotFound(_) => tonic::Status::not_found(a.to_string()),
                ApplyError::Undecodable { .. } => tonic::Status::internal(a.to_string()),
                ApplyError::Invalid { .. } => tonic::Status::invalid_argument(a.to_string()),
                _ => tonic::Status::failed_precondition(a.to_string()),
            },
        }
    }
}
