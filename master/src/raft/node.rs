//! The raft node: one tokio task owns the `RawNode`, ticks it, takes
//! proposals from a bounded channel and runs the ready loop in the order of
//! raft-rs' examples. Replies are matched to proposals by an id carried in
//! each entry's context (never by position), and are sent only after the
//! entry is committed and applied.

use std::collections::HashMap;
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::Duration;

use raft::eraftpb::{ConfChange, ConfChangeV2, Entry, EntryType};
use raft::{RawNode, StateRole};
use tokio::sync::{mpsc, oneshot, watch};

use super::storage::SledStorage;
use crate::state::{ApplyError, Command, Outcome, State};

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
        // 100 ms ticks, 1 s election timeout (etcd's default).
        RaftNodeConfig {
            node_id,
            tick: Duration::from_millis(100),
            election_ticks: 10,
            heartbeat_ticks: 2,
            snapshot_every: 10_000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Leader,
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
    pub leader_id: u64,
    pub commit_index: u64,
    pub applied_index: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ProposeError {
    #[error("this master is not the leader (leader: {leader})")]
    NotLeader { leader: String },
    #[error(transparent)]
    Rejected(#[from] ApplyError),
    #[error("raft node stopped")]
    Stopped,
    #[error("proposal queue full, try again")]
    Busy,
}

enum NodeMsg {
    Propose {
        command: Command,
        reply: oneshot::Sender<Result<Outcome, ProposeError>>,
    },
}

/// Cheap to clone; what services use to read and change the state.
#[derive(Clone)]
pub struct RaftHandle {
    tx: mpsc::Sender<NodeMsg>,
    state: Arc<RwLock<State>>,
    applied: watch::Receiver<u64>,
    status: watch::Receiver<NodeStatus>,
}

impl RaftHandle {
    /// Proposes a command and waits until it is committed and applied.
    pub async fn propose(&self, command: Command) -> Result<Outcome, ProposeError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .try_send(NodeMsg::Propose { command, reply })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => ProposeError::Busy,
                mpsc::error::TrySendError::Closed(_) => ProposeError::Stopped,
            })?;
        rx.await.map_err(|_| ProposeError::Stopped)?
    }

    /// Read access to the applied state. Hold it briefly.
    pub fn state(&self) -> RwLockReadGuard<'_, State> {
        // Apply never panics half way (it checks before it changes), so a
        // poisoned lock still guards consistent data.
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes whenever a log entry is applied.
    pub fn applied(&self) -> watch::Receiver<u64> {
        self.applied.clone()
    }

    pub fn status(&self) -> NodeStatus {
        self.status.borrow().clone()
    }

    pub fn status_watch(&self) -> watch::Receiver<NodeStatus> {
        self.status.clone()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("raft: {0}")]
    Raft(#[from] raft::Error),
    #[error("snapshot of the state machine: {0}")]
    Snapshot(#[from] serde_json::Error),
}

struct Node {
    raw: RawNode<SledStorage>,
    id: u64,
    state: Arc<RwLock<State>>,
    pending: HashMap<u64, oneshot::Sender<Result<Outcome, ProposeError>>>,
    next_proposal: u64,
    applied_tx: watch::Sender<u64>,
    status_tx: watch::Sender<NodeStatus>,
    snapshot_every: u64,
    snapshot_index: u64,
}

/// What [`start`] returns: the handle, the node task, and the commit index
/// found in storage (what must be replayed before serving).
pub type Started = (
    RaftHandle,
    tokio::task::JoinHandle<Result<(), NodeError>>,
    u64,
);

/// Starts the node task. Committed entries already in `storage` are replayed
/// into a fresh state before [`RaftHandle`] reports them applied.
pub fn start(
    config: RaftNodeConfig,
    storage: SledStorage,
    mut shutdown: watch::Receiver<bool>,
) -> Result<Started, NodeError> {
    let initial_commit = storage.hard_state().commit;
    let voters = storage.conf_state().voters.clone();
    // Start from the latest snapshot, then replay the log after it.
    let (snap_meta, snap_data) = storage.snapshot_data()?;
    let initial_state = if snap_data.is_empty() {
        State::new()
    } else {
        serde_json::from_slice::<State>(&snap_data)?
    };
    let snapshot_index = snap_meta.index;
    let raft_config = raft::Config {
        id: config.node_id,
        election_tick: config.election_ticks,
        heartbeat_tick: config.heartbeat_ticks,
        max_size_per_msg: 1024 * 1024,
        max_inflight_msgs: 256,
        // Replay what follows the snapshot: the state machine lives in memory.
        applied: snapshot_index,
        pre_vote: true,
        check_quorum: true,
        ..Default::default()
    };
    raft_config.validate()?;
    let logger = super::logger::logger(config.node_id);
    let mut raw = RawNode::new(&raft_config, storage, &logger)?;
    // A lone voter need not wait an election timeout to lead.
    if voters == [config.node_id] {
        raw.campaign()?;
    }
    let state = Arc::new(RwLock::new(initial_state));
    let (applied_tx, applied_rx) = watch::channel(snapshot_index);
    let status0 = NodeStatus {
        id: config.node_id,
        role: Role::Follower,
        term: 0,
        leader_id: 0,
        commit_index: initial_commit,
        applied_index: snapshot_index,
    };
    let (status_tx, status_rx) = watch::channel(status0);
    let (tx, mut rx) = mpsc::channel::<NodeMsg>(4096);
    let handle = RaftHandle {
        tx,
        state: state.clone(),
        applied: applied_rx,
        status: status_rx,
    };
    let mut node = Node {
        raw,
        id: config.node_id,
        state,
        pending: HashMap::new(),
        // Unique across restarts, so a replayed entry never answers a new proposal.
        next_proposal: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
        applied_tx,
        status_tx,
        snapshot_every: config.snapshot_every.max(1),
        snapshot_index,
    };
    let tick = config.tick;
    let task = tokio::spawn(async move {
        let mut ticker = tokio::time::interval(tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => { node.raw.tick(); }
                msg = rx.recv() => match msg {
                    Some(m) => {
                        node.handle(m);
                        // Batch whatever else is queued into the same ready.
                        while let Ok(m) = rx.try_recv() {
                            node.handle(m);
                        }
                    }
                    None => break,
                },
                _ = shutdown.changed() => break,
            }
            node.on_ready()?;
            node.publish_status();
        }
        node.fail_pending(|| ProposeError::Stopped);
        Ok(())
    });
    Ok((handle, task, initial_commit))
}

impl Node {
    fn handle(&mut self, msg: NodeMsg) {
        match msg {
            NodeMsg::Propose { command, reply } => {
                if self.raw.raft.state != StateRole::Leader {
                    let _ = reply.send(Err(self.not_leader()));
                    return;
                }
                let id = self.next_proposal;
                self.next_proposal += 1;
                let mut context = Vec::with_capacity(16);
                context.extend_from_slice(&self.id.to_be_bytes());
                context.extend_from_slice(&id.to_be_bytes());
                match self.raw.propose(context, command.encode()) {
                    Ok(()) => {
                        self.pending.insert(id, reply);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "proposal dropped");
                        let _ = reply.send(Err(self.not_leader()));
                    }
                }
            }
        }
    }

    fn not_leader(&self) -> ProposeError {
        let leader = self.raw.raft.leader_id;
        ProposeError::NotLeader {
            leader: if leader == 0 {
                "unknown".into()
            } else {
                format!("node {leader}")
            },
        }
    }

    fn fail_pending(&mut self, err: impl Fn() -> ProposeError) {
        for (_, reply) in self.pending.drain() {
            let _ = reply.send(Err(err()));
        }
    }

    fn publish_status(&mut self) {
        let r = &self.raw.raft;
        let role = match r.state {
            StateRole::Leader => Role::Leader,
            StateRole::Candidate | StateRole::PreCandidate => Role::Candidate,
            StateRole::Follower => Role::Follower,
        };
        let status = NodeStatus {
            id: self.id,
            role,
            term: r.term,
            leader_id: r.leader_id,
            commit_index: r.raft_log.committed,
            applied_index: r.raft_log.applied,
        };
        self.status_tx.send_if_modified(|s| {
            if *s != status {
                *s = status;
                true
            } else {
                false
            }
        });
        // Proposals made while leader may never commit once leadership is
        // gone; tell their callers so they can retry with the new leader.
        if role != Role::Leader && !self.pending.is_empty() {
            tracing::warn!(
                pending = self.pending.len(),
                "lost leadership; failing pending proposals"
            );
            let pending: Vec<_> = self.pending.drain().collect();
            for (_, reply) in pending {
                let _ = reply.send(Err(self.not_leader()));
            }
        }
    }

    fn on_ready(&mut self) -> Result<(), NodeError> {
        if !self.raw.has_ready() {
            return Ok(());
        }
        let mut ready = self.raw.ready();
        // Peers arrive with the multi-master issue; a lone voter sends none.
        if !ready.messages().is_empty() {
            let _ = ready.take_messages();
        }
        if !ready.snapshot().is_empty() {
            // Only a follower behind a compacted leader gets one: installing
            // it comes with the multi-master issue (a single voter never does).
            tracing::warn!("ignoring a raft snapshot sent by a leader: installing snapshots is not implemented yet");
        }
        self.apply_entries(ready.take_committed_entries())?;
        let store = self.raw.store();
        store.append(ready.entries())?;
        if let Some(hs) = ready.hs() {
            store.set_hard_state(hs)?;
        }
        // Durable before any persisted message leaves or any reply is sent.
        store.flush()?;
        if !ready.persisted_messages().is_empty() {
            let _ = ready.take_persisted_messages();
        }
        let mut light = self.raw.advance(ready);
        if let Some(commit) = light.commit_index() {
            self.raw.store().set_commit(commit)?;
        }
        let _ = light.take_messages();
        self.apply_entries(light.take_committed_entries())?;
        self.raw.advance_apply();
        self.maybe_snapshot()
    }

    /// Every `snapshot_every` applied entries: serialize the state machine,
    /// store it as the snapshot and drop the log before it.
    fn maybe_snapshot(&mut self) -> Result<(), NodeError> {
        let (applied, data) = {
            let s = self.state.read().unwrap_or_else(|p| p.into_inner());
            if s.applied_index < self.snapshot_index + self.snapshot_every {
                return Ok(());
            }
            (s.applied_index, serde_json::to_vec(&*s)?)
        };
        let term = self.raw.raft.raft_log.term(applied)?;
        self.raw.store().compact(applied, term, data)?;
        tracing::info!(
            index = applied,
            term,
            "state machine snapshot taken; log compacted"
        );
        self.snapshot_index = applied;
        Ok(())
    }

    fn apply_entries(&mut self, entries: Vec<Entry>) -> Result<(), NodeError> {
        let mut last = None;
        for entry in entries {
            last = Some(entry.index);
            match entry.get_entry_type() {
                EntryType::EntryNormal => self.apply_normal(&entry),
                EntryType::EntryConfChange => {
                    let cc: ConfChange = protobuf::Message::parse_from_bytes(&entry.data)
                        .map_err(raft::Error::CodecError)?;
                    let cs = self.raw.apply_conf_change(&cc)?;
                    self.raw.store().set_conf_state(&cs)?;
                }
                EntryType::EntryConfChangeV2 => {
                    let cc: ConfChangeV2 = protobuf::Message::parse_from_bytes(&entry.data)
                        .map_err(raft::Error::CodecError)?;
                    let cs = self.raw.apply_conf_change(&cc)?;
                    self.raw.store().set_conf_state(&cs)?;
                }
            }
        }
        if let Some(index) = last {
            self.applied_tx.send_replace(index);
        }
        Ok(())
    }

    fn apply_normal(&mut self, entry: &Entry) {
        let result = if entry.data.is_empty() {
            // The empty entry a new leader appends.
            let mut s = self.state.write().unwrap_or_else(|p| p.into_inner());
            s.applied_index = s.applied_index.max(entry.index);
            return;
        } else {
            match Command::decode(&entry.data) {
                Ok(cmd) => {
                    let mut s = self.state.write().unwrap_or_else(|p| p.into_inner());
                    let r = s.apply(entry.index, &cmd);
                    drop(s);
                    match &r {
                        Ok(_) => {
                            tracing::debug!(index = entry.index, command = cmd.kind(), "applied")
                        }
                        Err(e) => {
                            tracing::info!(index = entry.index, command = cmd.kind(), error = %e, "command refused")
                        }
                    }
                    r
                }
                Err(e) => {
                    // Skipped identically on every master, so states agree.
                    tracing::error!(index = entry.index, error = %e, "undecodable log entry skipped");
                    let mut s = self.state.write().unwrap_or_else(|p| p.into_inner());
                    s.applied_index = s.applied_index.max(entry.index);
                    Err(ApplyError::Undecodable {
                        index: entry.index,
                        reason: e.to_string(),
                    })
                }
            }
        };
        if let Some(id) = proposal_id(&entry.context, self.id) {
            if let Some(reply) = self.pending.remove(&id) {
                let _ = reply.send(result.map_err(ProposeError::Rejected));
            }
        }
    }
}

fn proposal_id(context: &[u8], node_id: u64) -> Option<u64> {
    if context.len() != 16 {
        return None;
    }
    let node = u64::from_be_bytes(context[..8].try_into().ok()?);
    if node != node_id {
        return None;
    }
    Some(u64::from_be_bytes(context[8..].try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuctl_proto::types::{JobSpec, Resources};
    use raft::Storage as _;

    fn submit() -> Command {
        Command::SubmitJob {
            spec: JobSpec {
                name: "j".into(),
                image: None,
                command: vec!["true".into()],
                env: Default::default(),
                resources: Resources::default(),
            },
            at_ms: 1,
        }
    }

    async fn run_node(dir: &std::path::Path, jobs: usize) -> (State, u64) {
        let storage = SledStorage::open(dir, &[1]).unwrap();
        let mut config = RaftNodeConfig::new(1);
        config.snapshot_every = 5;
        let (stop_tx, stop_rx) = watch::channel(false);
        let (handle, task, initial_commit) = start(config, storage, stop_rx).unwrap();
        let mut applied = handle.applied();
        while *applied.borrow() < initial_commit {
            applied.changed().await.unwrap();
        }
        // Wait to lead, then propose.
        let mut status = handle.status_watch();
        while status.borrow().role != Role::Leader {
            status.changed().await.unwrap();
        }
        for _ in 0..jobs {
            handle.propose(submit()).await.unwrap();
        }
        let state = handle.state().clone();
        stop_tx.send(true).unwrap();
        task.await.unwrap().unwrap();
        (state, initial_commit)
    }

    #[tokio::test]
    async fn snapshots_compact_the_log_and_a_restart_starts_from_them() {
        let dir = tempfile::tempdir().unwrap();
        let (first, _) = run_node(dir.path(), 12).await;
        assert_eq!(first.jobs.len(), 12);
        {
            let storage = SledStorage::open(dir.path(), &[1]).unwrap();
            let (meta, data) = storage.snapshot_data().unwrap();
            assert!(meta.index >= 10, "snapshot at {}", meta.index);
            assert!(!data.is_empty());
            assert_eq!(storage.first_index().unwrap(), meta.index + 1);
        }
        // Restarted from the snapshot plus the log after it: the same state,
        // and ids keep counting.
        let (second, _) = run_node(dir.path(), 1).await;
        assert_eq!(second.jobs.len(), 13);
        assert!(second.jobs.contains_key("job-13"));
        assert_eq!(second.jobs["job-12"], first.jobs["job-12"]);
    }
}
