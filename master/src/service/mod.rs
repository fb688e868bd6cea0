//! tonic services. Thin: validate input (through gpuctl-core's convert),
//! read the applied state or propose a command, convert the answer. Each
//! RPC's logic returns a `ServiceError` (error.rs), which alone becomes a
//! `Status`.

mod access;
mod agent;
pub mod auth;
mod error;
mod framework;
pub mod gate;
mod jobs_page;
pub mod limits;
mod masters;
mod operator;
mod raft;
mod task_stream;

use std::sync::Arc;

pub use error::{reply, Missing, MustRegister, ServiceError};
use gpuctl_proto::pb;
use tokio::sync::watch;

use crate::leader::board::WaitBoard;
use crate::leader::frameworks::Hub;
use crate::leader::Liveness;
use crate::raft::RaftHandle;
use crate::MasterConfig;

#[derive(Clone)]
pub struct Ctx {
    pub raft: RaftHandle,
    pub config: MasterConfig,
    pub liveness: Arc<Liveness>,
    pub hub: Arc<Hub>,
    /// Why queued jobs wait, as the leader's last queue pass found it.
    pub waits: Arc<WaitBoard>,
    pub shutdown: watch::Receiver<bool>,
    /// TLS and the CA key; `None`: no security configured.
    pub security: Option<Arc<crate::security::Security>>,
}

impl Ctx {
    /// This master's TLS, for the connections it makes (to peers, agents).
    pub fn tls(&self) -> Option<&Arc<gpuctl_auth::tls::Tls>> {
        self.security.as_ref().map(|s| &s.tls)
    }

    /// The redirect this master answers with when it is not the leader.
    pub fn not_leader(&self) -> ServiceError {
        ServiceError::NotLeader {
            leader: self.raft.leader(),
        }
    }
}

// Each call's own cap on its requests is enforced by `limits::RequestCapLayer`;
// tonic's limit per service (the largest of its calls' caps) backs it up.

pub fn operator_server(ctx: Ctx) -> pb::operator_server::OperatorServer<operator::OperatorService> {
    pb::operator_server::OperatorServer::new(operator::OperatorService { ctx })
        .max_decoding_message_size(limits::service_cap("gpuctl.v1.Operator"))
}

pub fn agent_manager_server(
    ctx: Ctx,
) -> pb::agent_manager_server::AgentManagerServer<agent::AgentManagerService> {
    pb::agent_manager_server::AgentManagerServer::new(agent::AgentManagerService { ctx })
        .max_decoding_message_size(limits::service_cap("gpuctl.v1.AgentManager"))
}

pub fn raft_server(ctx: Ctx) -> pb::raft_transport_server::RaftTransportServer<raft::RaftService> {
    pb::raft_transport_server::RaftTransportServer::new(raft::RaftService { ctx })
        .max_decoding_message_size(limits::service_cap("gpuctl.v1.RaftTransport"))
}

pub fn identity_server(ctx: Ctx) -> pb::identity_server::IdentityServer<access::IdentityService> {
    pb::identity_server::IdentityServer::new(access::IdentityService { ctx })
        .max_decoding_message_size(limits::service_cap("gpuctl.v1.Identity"))
}

pub fn access_server(ctx: Ctx) -> pb::access_server::AccessServer<access::AccessService> {
    pb::access_server::AccessServer::new(access::AccessService { ctx })
        .max_decoding_message_size(limits::service_cap("gpuctl.v1.Access"))
}

pub fn framework_server(
    ctx: Ctx,
) -> pb::scheduler_server::SchedulerServer<framework::SchedulerService> {
    pb::scheduler_server::SchedulerServer::new(framework::SchedulerService { ctx })
        .max_decoding_message_size(limits::service_cap("gpuctl.v1.Scheduler"))
}
