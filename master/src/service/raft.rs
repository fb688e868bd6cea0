//! RaftTransport: raft messages from other masters, and this master's view
//! of itself for `gpuctl masters`.

use gpuctl_proto::pb;
use protobuf::Message as _;
use raft::eraftpb::Message;
use tonic::{Request, Response, Status};

use super::Ctx;

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

#[tonic::async_trait]
impl pb::raft_transport_server::RaftTransport for RaftService {
    async fn step(
        &self,
        req: Request<pb::StepRequest>,
    ) -> Result<Response<pb::StepResponse>, Status> {
        let req = req.into_inner();
        let me = self.ctx.config.node_id;
        if req.from == 0 || req.from == me {
            return Err(Status::invalid_argument(format!(
                "from: {} is not another master's node id",
                req.from
            )));
        }
        if !req.from_address.is_empty() {
            if let Err(e) = crate::config::check_host_port("from_address", &req.from_address) {
                return Err(Status::invalid_argument(e));
            }
            // So that a master we have not heard of (one joining) gets answers.
            self.ctx.raft.addresses().learn(req.from, &req.from_address);
        }
        for (i, bytes) in req.messages.iter().enumerate() {
            let m = Message::parse_from_bytes(bytes).map_err(|e| {
                Status::invalid_argument(format!("messages[{i}]: not a raft message: {e}"))
            })?;
            if m.from != req.from || m.to != me {
                return Err(Status::invalid_argument(format!(
                    "messages[{i}]: from {} to {}, but this is master {me} and the sender {}",
                    m.from, m.to, req.from
                )));
            }
            // A full queue drops the rest: Raft resends.
            if self.ctx.raft.step(m).is_err() {
                break;
            }
        }
        Ok(Response::new(pb::StepResponse {}))
    }

    async fn status(
        &self,
        _: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::MasterInfo>, Status> {
        Ok(Response::new(self_info(&self.ctx)))
    }
}
