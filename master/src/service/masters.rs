//! `gpuctl masters`: the members of the Raft group, adding and removing them.
//!
//! A new master joins as a learner (it receives the log but does not vote),
//! and becomes a voter only once it has caught up, so adding a master that
//! is down or slow never costs the group its majority. Removing the leader
//! first hands leadership to the most up-to-date voter; the redirect that
//! follows makes the client ask the new leader, which does the removal.

use std::time::{Duration, Instant};

use gpuctl_core::convert::check_host_port;
use gpuctl_core::ConvertError;
use gpuctl_proto::pb;
use gpuctl_proto::pb::raft_transport_client::RaftTransportClient;
use raft::eraftpb::{ConfChange, ConfChangeType};
use tonic::transport::Endpoint;

use super::raft::self_info;
use super::{Ctx, ServiceError};
use crate::raft::Role;

/// How long a new master may take to catch up before it stays a learner.
const CATCH_UP: Duration = Duration::from_secs(30);
/// How long a peer may take to say how it is.
const PEER_STATUS_TIMEOUT: Duration = Duration::from_millis(800);

async fn peer_status(ctx: &Ctx, addr: &str) -> Option<pb::MasterInfo> {
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .ok()?
        .connect_timeout(PEER_STATUS_TIMEOUT)
        .timeout(PEER_STATUS_TIMEOUT);
    let call = async {
        let channel =
            gpuctl_auth::tls::connect(&endpoint, ctx.tls(), gpuctl_auth::CertRole::Master)
                .await
                .ok()?;
        RaftTransportClient::new(channel)
            .status(pb::StatusRequest {})
            .await
            .ok()
            .map(|r| r.into_inner())
    };
    tokio::time::timeout(PEER_STATUS_TIMEOUT * 2, call)
        .await
        .ok()
        .flatten()
}

/// Every member (voters and learners), each as it describes itself; members
/// that do not answer are listed as unreachable.
pub async fn list(ctx: &Ctx) -> pb::ListMastersResponse {
    let st = ctx.raft.status();
    let mut ids: Vec<u64> = st.voters.iter().chain(&st.learners).copied().collect();
    if !ids.contains(&st.id) {
        // Not (yet) a member: a master started with --join.
        ids.push(st.id);
    }
    ids.sort_unstable();
    let lookups = ids.iter().map(|&id| {
        let addr = ctx.raft.addresses().get(id).unwrap_or_default();
        let voter = st.voters.contains(&id);
        let member = voter || st.learners.contains(&id);
        async move {
            if id == st.id {
                let mut me = self_info(ctx);
                me.answered = true;
                if !member {
                    // Started with --join and not added yet, or removed.
                    me.role = "non-member".into();
                }
                return me;
            }
            match peer_status(ctx, &addr).await {
                Some(mut info) => {
                    info.id = id;
                    info.address = addr;
                    // Our configuration is the committed one.
                    info.voter = voter;
                    info.answered = false;
                    info.reachable = true;
                    info
                }
                None => pb::MasterInfo {
                    id,
                    address: addr,
                    role: "unknown".into(),
                    voter,
                    reachable: false,
                    ..Default::default()
                },
            }
        }
    });
    pb::ListMastersResponse {
        masters: futures::future::join_all(lookups).await,
    }
}

fn conf_change(kind: ConfChangeType, id: u64, address: &str) -> ConfChange {
    let mut cc = ConfChange {
        node_id: id,
        context: address.as_bytes().to_vec().into(),
        ..Default::default()
    };
    cc.set_change_type(kind);
    cc
}

pub async fn add(
    ctx: &Ctx,
    req: pb::AddMasterRequest,
) -> Result<pb::ListMastersResponse, ServiceError> {
    let id = req.id;
    if id == 0 {
        return Err(ConvertError::new("id", "must be >= 1").into());
    }
    let addr = req.address.trim().to_string();
    check_host_port("address", &addr)?;
    let st = ctx.raft.status();
    if st.voters.contains(&id) {
        // The same add sent again (its first send's outcome unknown to the
        // client): done already. The id at another address is a mistake.
        if ctx.raft.addresses().get(id).as_deref() == Some(addr.as_str()) {
            tracing::info!(id, address = %addr, "master add resent: already a voter");
            return Ok(list(ctx).await);
        }
        return Err(ServiceError::AlreadyVoter { id });
    }
    if !st.learners.contains(&id) {
        tracing::info!(id, address = %addr, "adding a master as a learner");
        ctx.raft
            .propose_conf_change(conf_change(ConfChangeType::AddLearnerNode, id, &addr))
            .await?;
    }
    // Caught up: it holds everything committed when we started waiting.
    let target = ctx.raft.status().commit_index;
    let deadline = Instant::now() + CATCH_UP;
    loop {
        let matched = ctx.raft.progress().await?.get(&id).copied().unwrap_or(0);
        if matched >= target {
            break;
        }
        if ctx.raft.status().role != Role::Leader {
            return Err(ctx.not_leader());
        }
        if Instant::now() >= deadline {
            return Err(ServiceError::CatchUpTimeout {
                id,
                address: addr,
                secs: CATCH_UP.as_secs(),
                matched,
                target,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tracing::info!(id, address = %addr, "promoting a caught-up learner to voter");
    ctx.raft
        .propose_conf_change(conf_change(ConfChangeType::AddNode, id, &addr))
        .await?;
    Ok(list(ctx).await)
}

pub async fn remove(
    ctx: &Ctx,
    req: pb::RemoveMasterRequest,
) -> Result<pb::ListMastersResponse, ServiceError> {
    let id = req.id;
    let st = ctx.raft.status();
    let is_voter = st.voters.contains(&id);
    if !is_voter && !st.learners.contains(&id) {
        return Err(ServiceError::NotAMember { id });
    }
    if is_voter && st.voters.len() == 1 {
        return Err(ServiceError::LastVoter { id });
    }
    if id == st.id {
        // Hand over first, to the voter with the most of the log; the
        // client is redirected and asks the new leader to remove us.
        let progress = ctx.raft.progress().await?;
        let Some(next) = st
            .voters
            .iter()
            .filter(|v| **v != id)
            .max_by_key(|v| progress.get(v).copied().unwrap_or(0))
            .copied()
        else {
            return Err(ServiceError::NoOtherVoter);
        };
        tracing::info!(
            to = next,
            "removing the leader: transferring leadership first"
        );
        ctx.raft.transfer_leader(next)?;
        let mut status = ctx.raft.status_watch();
        let wait = tokio::time::timeout(Duration::from_secs(5), async {
            while status.borrow().role == Role::Leader {
                if status.changed().await.is_err() {
                    break;
                }
            }
        });
        let _ = wait.await;
        return Err(match ctx.raft.addresses().get(next) {
            Some(a) if ctx.raft.status().role != Role::Leader => ServiceError::NotLeader {
                leader: Some((next, a)),
            },
            _ => ServiceError::TransferIncomplete { to: next },
        });
    }
    tracing::info!(id, "removing a master");
    let addr = ctx.raft.addresses().get(id).unwrap_or_default();
    ctx.raft
        .propose_conf_change(conf_change(ConfChangeType::RemoveNode, id, &addr))
        .await?;
    Ok(list(ctx).await)
}
