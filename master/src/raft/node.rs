//! The raft node: one thread, with a tokio runtime of its own, owns the
//! `RawNode`, ticks it, takes proposals and peer messages from a bounded
//! channel and runs the ready loop in the order of raft-rs' examples.
//! Replies are matched to proposals by an id carried in each entry's
//! context (never by position), and are sent only after the entry is
//! committed on a majority and applied here.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use raft::eraftpb::{
    ConfChange, ConfChangeType, ConfChangeV2, Entry, EntryType, Message, Snapshot,
};
use raft::{RawNode, SnapshotStatus, StateRole};
use tokio::sync::{mpsc, oneshot, watch};

use super::storage::SledStorage;
use super::transport::Transport;
use super::wakeups::AgentWakeups;
use super::Addresses;
use crate::state::command::DecodeError;
use crate::state::{ApplyError, Command, MemberChange, Outcome, State};

use super::handle::RaftHandle;
use super::snapshot::{decode_snapshot, encode_snapshot};
use super::types::*;

struct Node {
    raw: RawNode<SledStorage>,
    id: u64,
    state: Arc<RwLock<State>>,
    pending: HashMap<u64, oneshot::Sender<Result<Outcome, ProposeError>>>,
    pending_cc: HashMap<u64, CcReply>,
    next_proposal: u64,
    applied_tx: watch::Sender<u64>,
    status_tx: watch::Sender<NodeStatus>,
    role_tx: watch::Sender<RoleStatus>,
    snapshot_every: u64,
    snapshot_index: u64,
    /// Bytes of the entries applied since the last periodic snapshot began,
    /// and the size of the last snapshot: a snapshot waits until the log
    /// it replaces is half its size, so that the cost of snapshots follows
    /// the writes, not the size of the state (at 10,000 agents a snapshot
    /// every 10,000 small entries was a fifth of a master's CPU).
    log_bytes_since_snapshot: u64,
    last_snapshot_bytes: u64,
    /// Snapshot at the end of this ready (a master was added).
    snapshot_due: bool,
    /// The periodic snapshot being serialized on a blocking thread.
    snapshot_job: Option<SnapshotJob>,
    /// While leader: the index of the first entry of its term.
    lead_start: Option<u64>,
    /// The role and term last published (changes are logged).
    role_term: (Role, u64),
    transport: Arc<dyn Transport>,
    reporter: Reporter,
    addresses: Addresses,
    wakeups: AgentWakeups,
}

/// A copy of the state at `index`, being serialized and stored (the log
/// compacted) off the node's loop: at 10,000 agents and 100,000 jobs the
/// JSON is ~100 MiB and takes about a second to make and more to write,
/// during which the loop would neither tick nor answer, and the leader lost
/// its term. Its result is the snapshot's size.
struct SnapshotJob {
    index: u64,
    done: oneshot::Receiver<Result<usize, String>>,
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
/// `addresses` holds what is known of the other masters (`--peers`); the
/// replicated state adds to it.
pub fn start(
    config: RaftNodeConfig,
    storage: SledStorage,
    transport: Arc<dyn Transport>,
    addresses: Addresses,
    shutdown: watch::Receiver<bool>,
) -> Result<Started, NodeError> {
    let initial_commit = storage.hard_state().commit;
    let voters = storage.conf_state().voters.clone();
    // Start from the latest snapshot, then replay the log after it.
    let (snap_meta, snap_data) = storage.snapshot_data()?;
    let (initial_state, snap_json_bytes) = if snap_data.is_empty() {
        (State::new(), 0)
    } else {
        decode_snapshot(&snap_data)?
    };
    for (id, addr) in initial_state.masters() {
        addresses.set(*id, addr);
    }
    let snapshot_index = snap_meta.index;
    let raft_config = raft::Config {
        id: config.node_id,
        election_tick: config.election_ticks,
        heartbeat_tick: config.heartbeat_ticks,
        max_size_per_msg: 1024 * 1024,
        max_inflight_msgs: 256,
        // Replay what follows the snapshot: the state machine lives in memory.
        applied: snapshot_index,
        // A master coming back from a partition must not depose a healthy
        // leader (pre-vote), and a leader cut off from a majority steps down
        // (check quorum) so clients go to the new one.
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
    let wakeups = AgentWakeups::default();
    let (applied_tx, applied_rx) = watch::channel(snapshot_index);
    let status0 = NodeStatus {
        id: config.node_id,
        role: Role::Follower,
        term: 0,
        leader_id: 0,
        commit_index: initial_commit,
        applied_index: snapshot_index,
        voters: Vec::new(),
        learners: Vec::new(),
        snapshot_index,
        serving: false,
    };
    let (role_tx, role_rx) = watch::channel(RoleStatus {
        role: status0.role,
        term: status0.term,
        leader_id: status0.leader_id,
        serving: status0.serving,
    });
    let (status_tx, status_rx) = watch::channel(status0);
    let (tx, rx) = mpsc::channel::<NodeMsg>(8192);
    let handle = RaftHandle {
        tx: tx.clone(),
        state: state.clone(),
        applied: applied_rx,
        status: status_rx,
        role: role_rx,
        addresses: addresses.clone(),
        wakeups: wakeups.clone(),
    };
    let mut node = Node {
        raw,
        id: config.node_id,
        state,
        pending: HashMap::new(),
        pending_cc: HashMap::new(),
        // Unique across restarts, so a replayed entry never answers a new proposal.
        next_proposal: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
        applied_tx,
        status_tx,
        role_tx,
        snapshot_every: config.snapshot_every.max(1),
        snapshot_index,
        log_bytes_since_snapshot: 0,
        last_snapshot_bytes: snap_json_bytes as u64,
        snapshot_due: false,
        snapshot_job: None,
        lead_start: None,
        role_term: (Role::Follower, 0),
        transport,
        reporter: Reporter { tx },
        addresses,
        wakeups,
    };
    node.publish_status();
    let tick = config.tick;
    let task = spawn_thread(config.node_id, node.run(rx, shutdown, tick))?;
    Ok((handle, task, initial_commit))
}

/// Runs the node's loop on a thread of its own, with a runtime of its own
/// (its ticks, the transport's connections to the peers, sled's flushes):
/// however busy the API's runtime is, the node ticks and sends on time, and
/// no API call waits behind a flush. A 13 MiB SubmitJob decoded on an API
/// worker once held up every timer of the shared runtime for 7.7 s (no
/// tick, no heartbeat: an election). The returned task, on the caller's
/// runtime, ends with the loop.
fn spawn_thread(
    node_id: u64,
    run: impl std::future::Future<Output = Result<(), NodeError>> + Send + 'static,
) -> Result<tokio::task::JoinHandle<Result<(), NodeError>>, NodeError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .thread_name(format!("raft-{node_id}-blocking"))
        .build()
        .map_err(NodeError::Thread)?;
    let (done_tx, done_rx) = oneshot::channel();
    std::thread::Builder::new()
        .name(format!("raft-{node_id}"))
        .spawn(move || {
            let result = runtime.block_on(run);
            // Ends the peers' sending tasks with the loop.
            drop(runtime);
            let _ = done_tx.send(result);
        })
        .map_err(NodeError::Thread)?;
    Ok(tokio::spawn(async move {
        // A panic on the thread drops the sender: a stopped node all the same.
        done_rx.await.unwrap_or(Err(NodeError::Panicked))
    }))
}

impl Node {
    async fn run(
        mut self,
        mut rx: mpsc::Receiver<NodeMsg>,
        mut shutdown: watch::Receiver<bool>,
        tick: Duration,
    ) -> Result<(), NodeError> {
        let mut ticker = tokio::time::interval(tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => { self.raw.tick(); }
                msg = rx.recv() => match msg {
                    Some(m) => {
                        self.handle(m);
                        // Batch whatever else is queued into the same ready.
                        let mut n = 0;
                        while n < 4096 {
                            let Ok(m) = rx.try_recv() else { break };
                            self.handle(m);
                            n += 1;
                        }
                    }
                    None => break,
                },
                _ = shutdown.changed() => break,
            }
            self.on_ready()?;
            // A snapshot encoded off the loop is recorded at the next tick
            // even when nothing else happens (an idle single master has no
            // ready), and the next one due starts then.
            if self.snapshot_job.is_some() {
                self.maybe_snapshot()?;
            }
            self.publish_status();
        }
        self.fail_pending(|| ProposeError::Stopped);
        // A snapshot under way is kept: it saves replaying its entries at
        // the next start.
        if let Some(job) = self.snapshot_job.take() {
            if let Ok(Ok(bytes)) = job.done.await {
                self.snapshot_stored(job.index, bytes);
            }
        }
        Ok(())
    }

    fn next_context(&mut self) -> (u64, Vec<u8>) {
        let id = self.next_proposal;
        self.next_proposal += 1;
        let mut context = Vec::with_capacity(16);
        context.extend_from_slice(&self.id.to_be_bytes());
        context.extend_from_slice(&id.to_be_bytes());
        (id, context)
    }

    fn propose(&mut self, data: Vec<u8>, reply: oneshot::Sender<Result<Outcome, ProposeError>>) {
        if self.raw.raft.state != StateRole::Leader || self.raw.raft.lead_transferee.is_some() {
            let _ = reply.send(Err(self.not_leader()));
            return;
        }
        let (id, context) = self.next_context();
        match self.raw.propose(context, data) {
            Ok(()) => {
                self.pending.insert(id, reply);
            }
            Err(e) => {
                tracing::warn!(error = %e, "proposal dropped");
                let _ = reply.send(Err(self.not_leader()));
            }
        }
    }

    fn handle(&mut self, msg: NodeMsg) {
        match msg {
            NodeMsg::Propose { command, reply } => match command.encode() {
                Ok(data) => self.propose(data, reply),
                Err(e) => {
                    tracing::error!(error = %e, "command not proposed");
                    let _ = reply.send(Err(e.into()));
                }
            },
            #[cfg(test)]
            NodeMsg::ProposeRaw { data, reply } => self.propose(data, reply),
            NodeMsg::ConfChange { cc, reply } => {
                if self.raw.raft.state != StateRole::Leader {
                    let _ = reply.send(Err(self.not_leader()));
                    return;
                }
                let (id, context) = self.next_context();
                match self.raw.propose_conf_change(context, cc) {
                    Ok(()) => {
                        self.pending_cc.insert(id, reply);
                    }
                    Err(e) => {
                        // raft-rs allows one membership change in flight.
                        let _ = reply.send(Err(ProposeError::Membership(format!(
                            "membership change refused: {e} (another change may be in progress; retry)"
                        ))));
                    }
                }
            }
            NodeMsg::Step(m) => {
                if let Err(e) = self.raw.step(*m) {
                    tracing::debug!(error = %e, "raft message ignored");
                }
            }
            NodeMsg::Unreachable {
                to,
                snapshot_failed,
            } => {
                self.raw.report_unreachable(to);
                if snapshot_failed {
                    self.raw.report_snapshot(to, SnapshotStatus::Failure);
                }
            }
            NodeMsg::SnapshotSent(to) => self.raw.report_snapshot(to, SnapshotStatus::Finish),
            NodeMsg::TransferLeader(to) => self.raw.transfer_leader(to),
            NodeMsg::Progress(reply) => {
                let mut out = BTreeMap::new();
                if self.raw.raft.state == StateRole::Leader {
                    for (id, pr) in self.raw.raft.prs().iter() {
                        out.insert(*id, pr.matched);
                    }
                }
                let _ = reply.send(out);
            }
            NodeMsg::LastIndex(reply) => {
                let leading = self.raw.raft.state == StateRole::Leader
                    && self.raw.raft.lead_transferee.is_none();
                let _ = reply.send(if leading {
                    Ok(self.raw.raft.raft_log.last_index())
                } else {
                    Err(self.not_leader())
                });
            }
        }
    }

    fn not_leader(&self) -> ProposeError {
        let lead = if self.raw.raft.state == StateRole::Leader {
            // Handing over: the transferee is about to lead.
            self.raw.raft.lead_transferee.unwrap_or(0)
        } else {
            self.raw.raft.leader_id
        };
        ProposeError::NotLeader {
            leader: leader_of(lead, &self.addresses),
        }
    }

    fn fail_pending(&mut self, err: impl Fn() -> ProposeError) {
        for (_, reply) in self.pending.drain() {
            let _ = reply.send(Err(err()));
        }
        for (_, reply) in self.pending_cc.drain() {
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
        // raft-rs appends the new term's empty entry when it becomes leader.
        self.lead_start = match role {
            Role::Leader => Some(self.lead_start.unwrap_or_else(|| r.raft_log.last_index())),
            _ => None,
        };
        if self.role_term != (role, r.term) {
            // Elections are rare and each one pauses writes: worth a line.
            tracing::info!(%role, term = r.term, leader = r.leader_id, "raft role changed");
            self.role_term = (role, r.term);
        }
        let serving = self
            .lead_start
            .is_some_and(|start| r.raft_log.applied >= start);
        let conf = r.prs().conf();
        let mut voters: Vec<u64> = conf.voters().ids().iter().collect();
        voters.sort_unstable();
        let mut learners: Vec<u64> = conf.learners().iter().copied().collect();
        learners.sort_unstable();
        let status = NodeStatus {
            id: self.id,
            role,
            term: r.term,
            leader_id: r.leader_id,
            commit_index: r.raft_log.committed,
            applied_index: r.raft_log.applied,
            voters,
            learners,
            snapshot_index: self.snapshot_index,
            serving,
        };
        let role_status = RoleStatus {
            role: status.role,
            term: status.term,
            leader_id: status.leader_id,
            serving: status.serving,
        };
        self.status_tx.send_if_modified(|s| {
            if *s != status {
                *s = status;
                true
            } else {
                false
            }
        });
        // After the full status: whoever wakes on a role change and reads
        // `RaftHandle::status` sees the new one.
        self.role_tx.send_if_modified(|s| {
            let changed = *s != role_status;
            *s = role_status;
            changed
        });
        // Proposals made while leader may never commit once leadership is
        // gone (or may, under the next leader): the outcome is unknown.
        if role != Role::Leader && !(self.pending.is_empty() && self.pending_cc.is_empty()) {
            tracing::warn!(
                pending = self.pending.len() + self.pending_cc.len(),
                "lost leadership; failing pending proposals"
            );
            self.fail_pending(|| ProposeError::LeadershipLost);
        }
    }

    fn send(&self, msgs: Vec<Message>) {
        if !msgs.is_empty() {
            self.transport.send(msgs, &self.reporter);
        }
    }

    fn on_ready(&mut self) -> Result<(), NodeError> {
        if !self.raw.has_ready() {
            return Ok(());
        }
        let mut ready = self.raw.ready();
        // A leader may send before its own write is durable (Raft thesis
        // 10.2.1): the entry only commits once a majority, counting the
        // leader only after its flush, has it on disk.
        self.send(ready.take_messages());
        if !ready.snapshot().is_empty() {
            self.install_snapshot(ready.snapshot())?;
        }
        self.apply_entries(ready.take_committed_entries())?;
        let store = self.raw.store();
        store.append(ready.entries())?;
        if let Some(hs) = ready.hs() {
            store.set_hard_state(hs)?;
        }
        // Durable before any vote, append response or reply leaves.
        store.flush()?;
        self.send(ready.take_persisted_messages());
        let mut light = self.raw.advance(ready);
        if let Some(commit) = light.commit_index() {
            self.raw.store().set_commit(commit)?;
        }
        self.send(light.take_messages());
        self.apply_entries(light.take_committed_entries())?;
        self.raw.advance_apply();
        self.maybe_snapshot()
    }

    /// A leader sent the state machine because our log is too far behind
    /// its compacted log: store it, then replace the state with it.
    fn install_snapshot(&mut self, snap: &Snapshot) -> Result<(), NodeError> {
        let meta = snap.get_metadata();
        let (new_state, json_bytes) = decode_snapshot(&snap.data)?;
        self.raw.store().apply_snapshot(snap)?;
        for (id, addr) in new_state.masters() {
            self.addresses.set(*id, addr);
        }
        tracing::info!(
            index = meta.index,
            term = meta.term,
            "installed a snapshot from the leader"
        );
        *self.state.write().unwrap_or_else(|p| p.into_inner()) = new_state;
        self.snapshot_index = meta.index;
        self.last_snapshot_bytes = json_bytes as u64;
        self.wake_touched(meta.index);
        self.applied_tx.send_replace(meta.index);
        Ok(())
    }

    /// Every `snapshot_every` applied entries: copy the state machine,
    /// serialize the copy on a blocking thread, and once it is done (checked
    /// at each ready, so within a tick) store it as the snapshot and drop
    /// the log before it. A snapshot asked for by a membership change is
    /// taken at once, on the loop.
    fn maybe_snapshot(&mut self) -> Result<(), NodeError> {
        if self.snapshot_due {
            self.snapshot_due = false;
            return self.snapshot_now();
        }
        if let Some(job) = self.snapshot_job.as_mut() {
            match job.done.try_recv() {
                Err(oneshot::error::TryRecvError::Empty) => return Ok(()),
                Ok(Ok(bytes)) => {
                    let index = job.index;
                    self.snapshot_job = None;
                    self.snapshot_stored(index, bytes);
                }
                Ok(Err(e)) => {
                    self.snapshot_job = None;
                    tracing::error!(error = %e, "state machine snapshot failed; will retry");
                }
                Err(oneshot::error::TryRecvError::Closed) => {
                    self.snapshot_job = None;
                    tracing::error!("state machine snapshot failed (its thread ended); will retry");
                }
            }
        }
        let copy_started = std::time::Instant::now();
        let (applied, copy) = {
            let s = self.state.read().unwrap_or_else(|p| p.into_inner());
            let applied = s.applied_index();
            if applied < self.snapshot_index + self.snapshot_every
                || self.log_bytes_since_snapshot < self.last_snapshot_bytes / 2
            {
                return Ok(());
            }
            (applied, s.clone())
        };
        // The copy is the part on the Raft loop's thread.
        let copy_ms = copy_started.elapsed().as_secs_f64() * 1e3;
        self.log_bytes_since_snapshot = 0;
        let term = self.raw.raft.raft_log.term(applied)?;
        let storage = self.raw.store().clone();
        let (tx, rx) = oneshot::channel();
        tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            let stored =
                encode_snapshot(&copy)
                    .map_err(|e| e.to_string())
                    .and_then(|(data, json_bytes)| {
                        storage
                            .compact(applied, term, data)
                            .map(|()| json_bytes)
                            .map_err(|e| e.to_string())
                    });
            tracing::debug!(
                index = applied,
                copy_ms,
                encode_and_store_ms = started.elapsed().as_secs_f64() * 1e3,
                "state machine snapshot written"
            );
            let _ = tx.send(stored);
        });
        self.snapshot_job = Some(SnapshotJob {
            index: applied,
            done: rx,
        });
        Ok(())
    }

    /// A snapshot at `index` of `bytes` (of JSON, before compression) is
    /// stored and the log compacted.
    fn snapshot_stored(&mut self, index: u64, bytes: usize) {
        // One installed from the leader meanwhile may be newer.
        if index > self.snapshot_index {
            self.snapshot_index = index;
            self.last_snapshot_bytes = bytes as u64;
            tracing::info!(index, bytes, "state machine snapshot taken; log compacted");
        }
    }

    fn store_snapshot(
        &mut self,
        index: u64,
        term: u64,
        (data, json_bytes): (Vec<u8>, usize),
    ) -> Result<(), NodeError> {
        if index <= self.snapshot_index {
            // A newer one was installed or taken meanwhile.
            return Ok(());
        }
        self.raw.store().compact(index, term, data)?;
        self.snapshot_stored(index, json_bytes);
        Ok(())
    }

    fn snapshot_now(&mut self) -> Result<(), NodeError> {
        let (applied, data) = {
            let s = self.state.read().unwrap_or_else(|p| p.into_inner());
            if s.applied_index() <= self.snapshot_index {
                return Ok(());
            }
            (s.applied_index(), encode_snapshot(&s)?)
        };
        let term = self.raw.raft.raft_log.term(applied)?;
        self.store_snapshot(applied, term, data)
    }

    fn apply_entries(&mut self, entries: Vec<Entry>) -> Result<(), NodeError> {
        let mut last = None;
        for entry in entries {
            last = Some(entry.index);
            self.log_bytes_since_snapshot += entry.data.len() as u64;
            match entry.get_entry_type() {
                EntryType::EntryNormal => self.apply_normal(&entry)?,
                EntryType::EntryConfChange => {
                    let cc: ConfChange = protobuf::Message::parse_from_bytes(&entry.data)
                        .map_err(raft::Error::CodecError)?;
                    // An impossible change (one removing the last voter) is
                    // skipped, identically on every master.
                    let result = match self.raw.apply_conf_change(&cc) {
                        Ok(cs) => {
                            self.raw.store().set_conf_state(&cs)?;
                            self.record_member(entry.index, &cc);
                            Ok(())
                        }
                        Err(e) => {
                            tracing::error!(index = entry.index, error = %e, "membership change refused");
                            self.bump_applied(entry.index);
                            Err(ProposeError::Membership(format!(
                                "membership change refused: {e}"
                            )))
                        }
                    };
                    // Replies see the new configuration.
                    self.publish_status();
                    if let Some(id) = proposal_id(&entry.context, self.id) {
                        if let Some(reply) = self.pending_cc.remove(&id) {
                            let _ = reply.send(result);
                        }
                    }
                }
                EntryType::EntryConfChangeV2 => {
                    let cc: ConfChangeV2 = protobuf::Message::parse_from_bytes(&entry.data)
                        .map_err(raft::Error::CodecError)?;
                    let cs = self.raw.apply_conf_change(&cc)?;
                    self.raw.store().set_conf_state(&cs)?;
                    self.bump_applied(entry.index);
                }
            }
        }
        if let Some(index) = last {
            self.wake_touched(index);
            self.applied_tx.send_replace(index);
        }
        Ok(())
    }

    /// Wakes the task streams of the agents the applied entries touched.
    fn wake_touched(&self, index: u64) {
        let touched = self
            .state
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .take_touched();
        self.wakeups.notify(&touched, index);
    }

    /// An entry that carries no command still counts as applied.
    fn bump_applied(&self, index: u64) {
        self.state
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .apply_noop(index);
    }

    /// Keeps the address book of the group in the replicated state: a
    /// change adding a master carries its API address in its context.
    fn record_member(&mut self, index: u64, cc: &ConfChange) {
        let mut s = self.state.write().unwrap_or_else(|p| p.into_inner());
        match cc.get_change_type() {
            ConfChangeType::AddNode | ConfChangeType::AddLearnerNode => {
                // The bootstrap configuration is not in the log, so a new
                // master must start from a snapshot that carries the
                // configuration with itself in it (raft-rs refuses others):
                // compact now, before the leader sends it anything; it then
                // asks for entries the log no longer has and gets this
                // snapshot.
                self.snapshot_due = true;
                match std::str::from_utf8(&cc.context) {
                    Ok(addr) if !addr.is_empty() => {
                        let id = cc.node_id;
                        s.apply_member_change(index, MemberChange::Added { id, addr });
                        self.addresses.set(id, addr);
                    }
                    _ => s.apply_noop(index),
                }
            }
            ConfChangeType::RemoveNode => {
                s.apply_member_change(index, MemberChange::Removed { id: cc.node_id });
                if cc.node_id != self.id {
                    self.addresses.remove(cc.node_id);
                }
            }
        }
        tracing::info!(index, node = cc.node_id, change = ?cc.get_change_type(), "membership changed");
    }

    /// Applies one entry; an entry of a newer command version stops the
    /// node, with the entry not applied (an upgraded master applies it).
    fn apply_normal(&mut self, entry: &Entry) -> Result<(), NodeError> {
        let result = if entry.data.is_empty() {
            // The empty entry a new leader appends.
            self.bump_applied(entry.index);
            return Ok(());
        } else {
            match Command::decode(&entry.data) {
                Ok(cmd) => {
                    let mut s = self.state.write().unwrap_or_else(|p| p.into_inner());
                    let r = s.apply(entry.index, &cmd);
                    if let Command::RecordMasters { masters } = &cmd {
                        for (id, addr) in masters {
                            self.addresses.set(*id, addr);
                        }
                    }
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
                Err(DecodeError::UnknownVersion(version)) => {
                    let e = NodeError::NewerCommand {
                        index: entry.index,
                        version,
                    };
                    tracing::error!(error = %e, "stopping");
                    return Err(e);
                }
                Err(e) => {
                    // Masters of one command version decode alike, so every
                    // master skips it and the states agree.
                    tracing::error!(index = entry.index, error = %e, "undecodable log entry skipped");
                    self.bump_applied(entry.index);
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
        Ok(())
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
    use super::super::snapshot::ZSTD_MAGIC;
    use super::*;
    use gpuctl_core::types::{JobSpec, Resources};
    use raft::Storage as _;

    fn submit() -> Command {
        Command::SubmitJob {
            spec: JobSpec {
                placement: Default::default(),
                name: "j".into(),
                template: gpuctl_core::types::TaskTemplate {
                    image: None,
                    command: vec!["true".into()],
                    env: Default::default(),
                    resources: Resources::default(),
                    ..Default::default()
                },
                ..Default::default()
            },
            at_ms: 1,
            request_id: None,
        }
    }

    async fn run_node(dir: &std::path::Path, jobs: usize) -> (State, u64) {
        let storage = SledStorage::open(dir, &[1]).unwrap();
        let mut config = RaftNodeConfig::new(1);
        config.snapshot_every = 5;
        let (stop_tx, stop_rx) = watch::channel(false);
        let net = super::super::sim::SimNet::new();
        let (handle, task, initial_commit) = start(
            config,
            storage,
            net.transport(1),
            Addresses::default(),
            stop_rx,
        )
        .unwrap();
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
        // Snapshots are encoded off the loop and stored at a later tick: on
        // a busy machine the one every 5 entries asks for may still be on
        // its way when the last entry applies. Wait for it (bounded).
        let mut status = handle.status_watch();
        let want = (jobs as u64 / 5) * 5;
        let stored = tokio::time::timeout(std::time::Duration::from_secs(30), async {
            while status.borrow().snapshot_index < want.min(10) {
                status.changed().await.unwrap();
            }
        })
        .await;
        assert!(
            stored.is_ok(),
            "no snapshot at {} within 30 s",
            want.min(10)
        );
        let state = handle.state().clone();
        stop_tx.send(true).unwrap();
        task.await.unwrap().unwrap();
        (state, initial_commit)
    }

    #[tokio::test]
    async fn snapshots_compact_the_log_and_a_restart_starts_from_them() {
        let dir = tempfile::tempdir().unwrap();
        let (first, _) = run_node(dir.path(), 12).await;
        assert_eq!(first.jobs().len(), 12);
        {
            let storage = SledStorage::open(dir.path(), &[1]).unwrap();
            let (meta, data) = storage.snapshot_data().unwrap();
            assert!(meta.index >= 10, "snapshot at {}", meta.index);
            assert!(!data.is_empty());
            // The state serialized off the loop is the one at the
            // snapshot's index, not a later one.
            assert!(data.starts_with(&ZSTD_MAGIC), "compressed");
            let (snap, _) = decode_snapshot(&data).unwrap();
            assert_eq!(snap.applied_index(), meta.index);
            // A snapshot an older master wrote, plain JSON, still reads.
            let json = serde_json::to_vec(&snap).unwrap();
            assert_eq!(
                decode_snapshot(&json).unwrap().0.applied_index(),
                meta.index
            );
            assert!(
                data.len() * 3 < json.len(),
                "{} of {}",
                data.len(),
                json.len()
            );
            assert_eq!(storage.first_index().unwrap(), meta.index + 1);
        }
        // Restarted from the snapshot plus the log after it: the same state,
        // and ids keep counting.
        let (second, _) = run_node(dir.path(), 1).await;
        assert_eq!(second.jobs().len(), 13);
        assert!(second.jobs().contains_key("job-13"));
        assert_eq!(second.jobs()["job-12"], first.jobs()["job-12"]);
    }
}
