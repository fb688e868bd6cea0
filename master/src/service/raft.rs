//! RaftTransport: raft messages from other masters, and this master's view
//! of itself for `gpuctl masters`.

use gpuctl_core::convert::check_host_port;
use gpuctl_core::ConvertError;
use gpuctl_proto::pb;
use protobuf::Message as _;
use raft::eraftpb::Message;
use tonic::{Request, Response, Status};

use super::auth::Caller;
use super::{reply, Ctx, ServiceError};

pub struct RaftService {
    pub(super) ctx: Ctx,
}

/// This master as `gpuctl masters` shows it.
pub fn self_info(ctx: &Ctx) -> pb::MasterInfo {
    let st = ctx.raft.status();
    pb::MasterInfo {
        id: st.id,
        address: ctx.config.advertise.clone(),
        role: st.role.to_string(),
        term: st.term,
        commit_index: st.commit_index,
        applied_index: st.applied_index,
        answered: false,
        voter: st.voters.contains(&st.id),
        reachable: true,
    }
}

impl RaftService {
    /// Steps the messages into the local node (each checked: from the
    /// sender, to this master).
    fn step(
        &self,
        caller: &Caller,
        req: pb::StepRequest,
    ) -> Result<pb::StepResponse, ServiceError> {
        let me = self.ctx.config.node_id;
        // A master speaks only for itself: its certificate names its id.
        if let Caller::Master { node_id } = caller {
            if *node_id != req.from {
                return Err(ServiceError::Forbidden(format!(
                    "master {node_id}'s certificate cannot send raft messages from master {}",
                    req.from
                )));
            }
        }
        if req.from == 0 || req.from == me {
            return Err(ConvertError::new(
                "from",
                format!("{} is not another master's node id", req.from),
            )
            .into());
        }
        if !req.from_address.is_empty() {
            check_host_port("from_address", &req.from_address).map_err(ServiceError::from)?;
            // So that a master we have not heard of (one joining) gets answers.
            self.ctx.raft.addresses().learn(req.from, &req.from_address);
        }
        for (i, bytes) in req.messages.iter().enumerate() {
            let m = Message::parse_from_bytes(bytes).map_err(|e| {
                ServiceError::from(ConvertError::new(
                    format!("messages[{i}]"),
                    format!("not a raft message: {e}"),
                ))
            })?;
            if m.from != req.from || m.to != me {
                return Err(ServiceError::from(ConvertError::new(
                    format!("messages[{i}]"),
                    format!(
                        "from {} to {}, but this is master {me} and the sender {}",
                        m.from, m.to, req.from
                    ),
                )));
            }
            // A full queue drops the rest: Raft resends.
            if self.ctx.raft.step(m).is_err() {
                break;
            }
        }
        Ok(pb::StepResponse {})
    }
}

#[tonic::async_trait]
impl pb::raft_transport_server::RaftTransport for RaftService {
    async fn step(
        &self,
        req: Request<pb::StepRequest>,
    ) -> Result<Response<pb::StepResponse>, Status> {
        let caller = Caller::of(&req);
        reply(self.step(&caller, req.into_inner()))
    }

    async fn status(
        &self,
        _: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::MasterInfo>, Status> {
        Ok(Response::new(self_info(&self.ctx)))
    }
}
