//! What the node, its handle, snapshots and the transport share: the
//! node's configuration, its status as others see it, the messages its
//! loop takes, and its errors. Nothing here runs the node (`node.rs`).

use std::collections::BTreeMap;
use std::time::Duration;

use raft::eraftpb::{ConfChange, Message};
use tokio::sync::{mpsc, oneshot};

use super::Addresses;
use crate::state::{ApplyError, Command, Outcome};

#[derive(Debug, Clone)]
pub struct RaftNodeConfig {
    pub node_id: u64,
    pub tick: Duration,
    pub election_ticks: usize,
    pub heartbeat_ticks: usize,
    /// Snapshot the state machine and drop the log before it every this
    /// many applied entries (bounds the log and the replay at restart).
    pub snapshot_every: u64,
}

impl RaftNodeConfig {
    pub fn new(node_id: u64) -> Self {
        // 100 ms ticks, elections after 1 to 2 s of silence (etcd's default).
        RaftNodeConfig {
            node_id,
            tick: Duration::from_millis(100),
            election_ticks: 10,
            heartbeat_ticks: 1,
            snapshot_every: 10_000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    Leader,
    #[default]
    Follower,
    Candidate,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Leader => "leader",
            Role::Follower => "follower",
            Role::Candidate => "candidate",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeStatus {
    pub id: u64,
    pub role: Role,
    pub term: u64,
    /// 0: no leader known.
    pub leader_id: u64,
    pub commit_index: u64,
    pub applied_index: u64,
    pub voters: Vec<u64>,
    pub learners: Vec<u64>,
    /// The log starts after this index (the state before it is a snapshot).
    pub snapshot_index: u64,
    /// Leader, and has applied everything committed before its term (its
    /// first entry): only then does its state include every write a
    /// previous leader acknowledged, so only then does it serve.
    pub serving: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ProposeError {
    /// Refused before anything was proposed: safe to retry at the leader.
    #[error("this master is not the leader ({})", match leader { Some((id, addr)) => format!("leader: master {id} at {addr}"), None => "no leader elected yet".to_string() })]
    NotLeader { leader: Option<(u64, String)> },
    /// Proposed, then leadership was lost before it committed: it may still
    /// commit under the next leader, or not.
    #[error("leadership lost while committing; the outcome is unknown")]
    LeadershipLost,
    #[error(transparent)]
    Rejected(#[from] ApplyError),
    #[error("raft node stopped")]
    Stopped,
    #[error("proposal queue full, try again")]
    Busy,
    #[error("{0}")]
    Membership(String),
    /// Not proposed: the command could not be encoded.
    #[error(transparent)]
    Encode(#[from] crate::state::EncodeError),
}

pub(super) enum NodeMsg {
    Propose {
        // Boxed: a job's spec makes a command several hundred bytes, and
        // every message of the node's queue would be that big.
        command: Box<Command>,
        reply: oneshot::Sender<Result<Outcome, ProposeError>>,
    },
    /// An entry's data as given (tests: entries of another version).
    #[cfg(test)]
    ProposeRaw {
        data: Vec<u8>,
        reply: oneshot::Sender<Result<Outcome, ProposeError>>,
    },
    ConfChange {
        cc: ConfChange,
        reply: oneshot::Sender<Result<(), ProposeError>>,
    },
    Step(Box<Message>),
    Unreachable {
        to: u64,
        snapshot_failed: bool,
    },
    SnapshotSent(u64),
    TransferLeader(u64),
    Progress(oneshot::Sender<BTreeMap<u64, u64>>),
    /// The leader's last log index (see `RaftHandle::caught_up`).
    LastIndex(oneshot::Sender<Result<u64, ProposeError>>),
}

/// What the transport uses to tell the node about delivery.
#[derive(Clone)]
pub struct Reporter {
    pub(super) tx: mpsc::Sender<NodeMsg>,
}

impl Reporter {
    /// The peer could not be reached; `snapshot_failed` when a snapshot to
    /// it was among the lost messages (the leader then sends another).
    pub fn unreachable(&self, to: u64, snapshot_failed: bool) {
        let _ = self.tx.try_send(NodeMsg::Unreachable {
            to,
            snapshot_failed,
        });
    }

    /// A snapshot reached the peer (or failed to).
    pub fn snapshot(&self, to: u64, ok: bool) {
        let msg = if ok {
            NodeMsg::SnapshotSent(to)
        } else {
            NodeMsg::Unreachable {
                to,
                snapshot_failed: true,
            }
        };
        let _ = self.tx.try_send(msg);
    }
}

#[cfg(test)]
impl Reporter {
    /// A reporter whose reports are only counted (transport tests).
    pub(crate) fn counting() -> (Reporter, impl FnMut() -> usize) {
        let (tx, mut rx) = mpsc::channel(1024);
        let mut count = 0;
        let read = move || {
            while rx.try_recv().is_ok() {
                count += 1;
            }
            count
        };
        (Reporter { tx }, read)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("raft: {0}")]
    Raft(#[from] raft::Error),
    #[error("snapshot of the state machine: {0}")]
    Snapshot(#[from] serde_json::Error),
    #[error("snapshot of the state machine: zstd: {0}")]
    SnapshotCodec(std::io::Error),
    #[error(transparent)]
    Open(#[from] super::storage::StorageInitError),
    #[error("starting the raft node's thread: {0}")]
    Thread(std::io::Error),
    #[error("the raft node's thread panicked")]
    Panicked,
    /// A committed entry this master cannot read: it stops rather than
    /// skip a command the others apply (their states would part).
    #[error("log entry {index} is of command version {version}, newer than this master's ({ours}): upgrade this master to the version of the others (upgrade followers first, then the leader: docs/operations.md)", ours = crate::state::COMMAND_VERSION)]
    NewerCommand { index: u64, version: u32 },
}

pub(super) type CcReply = oneshot::Sender<Result<(), ProposeError>>;

/// The part of [`NodeStatus`] that changes with elections, not with every
/// commit: what the loops that only care who leads wait on (one per agent
/// stream: waking 10,000 of them at every commit cost a pass over every
/// agent per commit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RoleStatus {
    pub role: Role,
    pub term: u64,
    pub leader_id: u64,
    pub serving: bool,
}

pub(super) fn leader_of(leader_id: u64, addresses: &Addresses) -> Option<(u64, String)> {
    if leader_id == 0 {
        return None;
    }
    addresses.get(leader_id).map(|a| (leader_id, a))
}
