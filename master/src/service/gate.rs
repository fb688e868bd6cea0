//! Only the leader serves the API, once it has applied everything committed
//! before its term (`NodeStatus::serving`): on any other master every call but
//! `Operator.ListMasters` (and master-to-master Raft traffic) is answered
//! with a redirect naming the leader (`gpuctl_proto::leader`). A tower layer
//! over the whole server, so no handler can forget it.

use std::task::{Context, Poll};

use futures::future::{Either, Ready};
use tonic::body::BoxBody;

use crate::raft::{RaftHandle, Role};

#[derive(Clone)]
pub struct LeaderGateLayer {
    pub raft: RaftHandle,
}

impl<S> tower_layer::Layer<S> for LeaderGateLayer {
    type Service = LeaderGate<S>;

    fn layer(&self, inner: S) -> LeaderGate<S> {
        LeaderGate {
            inner,
            raft: self.raft.clone(),
        }
    }
}

#[derive(Clone)]
pub struct LeaderGate<S> {
    inner: S,
    raft: RaftHandle,
}

/// Calls any master answers itself.
pub fn served_by_any_master(path: &str) -> bool {
    path.starts_with("/gpuctl.v1.RaftTransport/")
        || path == "/gpuctl.v1.Operator/ListMasters"
        // The replicated ledger, as this master has applied it.
        || path == "/gpuctl.v1.Operator/Usage"
        || path == "/gpuctl.v1.Operator/Utilization"
        || path.starts_with("/grpc.")
}

/// Calls a leader answers before it serves: an agent's heartbeat only
/// restarts the leader's clock for the agent (no commit needed), and its
/// answer keeps the agent's fence from falling while the masters are slow
/// to commit among themselves (a new leader catching up over a lossy link).
pub fn served_by_any_leader(path: &str) -> bool {
    path == "/gpuctl.v1.AgentManager/Heartbeat"
}

impl<S, B> tower_service::Service<http::Request<B>> for LeaderGate<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<BoxBody>>,
{
    type Response = http::Response<BoxBody>;
    type Error = S::Error;
    type Future = Either<Ready<Result<Self::Response, Self::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let st = self.raft.status();
        let path = req.uri().path();
        let passes = st.serving
            || served_by_any_master(path)
            || (st.role == Role::Leader && served_by_any_leader(path));
        if !passes {
            let status = if st.role == Role::Leader {
                // Elected, still applying what earlier leaders committed.
                gpuctl_proto::leader::catching_up()
            } else {
                let leader = self.raft.leader();
                gpuctl_proto::leader::not_leader(leader.as_ref().map(|(id, a)| (*id, a.as_str())))
            };
            return Either::Left(futures::future::ready(Ok(status.into_http())));
        }
        Either::Right(self.inner.call(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_master_listing_and_raft_pass_on_followers() {
        assert!(served_by_any_master("/gpuctl.v1.Operator/ListMasters"));
        assert!(served_by_any_master("/gpuctl.v1.RaftTransport/Step"));
        for p in [
            "/gpuctl.v1.Operator/SubmitJob",
            "/gpuctl.v1.Operator/AddMaster",
            "/gpuctl.v1.AgentManager/Register",
            "/gpuctl.v1.Scheduler/Subscribe",
        ] {
            assert!(!served_by_any_master(p), "{p}");
        }
        assert!(served_by_any_leader("/gpuctl.v1.AgentManager/Heartbeat"));
        assert!(!served_by_any_leader("/gpuctl.v1.AgentManager/Register"));
    }
}
