//! The node as the rest of the master sees it: read the state, wait for
//! commits and elections, propose commands and membership changes.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock, RwLockReadGuard};

use raft::eraftpb::{ConfChange, Message};
use tokio::sync::{mpsc, oneshot, watch};

use super::wakeups::{AgentWakeup, AgentWakeups};
use super::Addresses;
use crate::state::{Command, Outcome, State};

use super::types::*;

/// Cheap to clone; what services use to read and change the state.
#[derive(Clone)]
pub struct RaftHandle {
    pub(super) tx: mpsc::Sender<NodeMsg>,
    pub(super) state: Arc<RwLock<State>>,
    pub(super) applied: watch::Receiver<u64>,
    pub(super) status: watch::Receiver<NodeStatus>,
    pub(super) role: watch::Receiver<RoleStatus>,
    pub(super) addresses: Addresses,
    pub(super) wakeups: AgentWakeups,
}

impl RaftHandle {
    fn send(&self, msg: NodeMsg) -> Result<(), ProposeError> {
        self.tx.try_send(msg).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => ProposeError::Busy,
            mpsc::error::TrySendError::Closed(_) => ProposeError::Stopped,
        })
    }

    /// Proposes a command and waits until it is committed and applied.
    pub async fn propose(&self, command: Command) -> Result<Outcome, ProposeError> {
        let (reply, rx) = oneshot::channel();
        self.send(NodeMsg::Propose {
            command: Box::new(command),
            reply,
        })?;
        rx.await.map_err(|_| ProposeError::Stopped)?
    }

    /// Proposes `data` as an entry's as it is, as a master of another
    /// version could have written it.
    #[cfg(test)]
    pub async fn propose_raw(&self, data: Vec<u8>) -> Result<Outcome, ProposeError> {
        let (reply, rx) = oneshot::channel();
        self.send(NodeMsg::ProposeRaw { data, reply })?;
        rx.await.map_err(|_| ProposeError::Stopped)?
    }

    /// Proposes a membership change and waits until it is applied here.
    pub async fn propose_conf_change(&self, cc: ConfChange) -> Result<(), ProposeError> {
        let (reply, rx) = oneshot::channel();
        self.send(NodeMsg::ConfChange { cc, reply })?;
        rx.await.map_err(|_| ProposeError::Stopped)?
    }

    /// Hands a message from a peer to the node (dropped when it is busy:
    /// Raft resends).
    pub fn step(&self, msg: Message) -> Result<(), ProposeError> {
        self.send(NodeMsg::Step(Box::new(msg)))
    }

    /// Asks the leader to hand leadership to `to`.
    pub fn transfer_leader(&self, to: u64) -> Result<(), ProposeError> {
        self.send(NodeMsg::TransferLeader(to))
    }

    /// On the leader: the highest log index known to be replicated on each
    /// member. Empty elsewhere.
    pub async fn progress(&self) -> Result<BTreeMap<u64, u64>, ProposeError> {
        let (reply, rx) = oneshot::channel();
        self.send(NodeMsg::Progress(reply))?;
        rx.await.map_err(|_| ProposeError::Stopped)
    }

    /// On the leader: waits until the applied state holds every entry
    /// committed before the call and every proposal made before it here
    /// (the leader's last log index when the call reached the Raft loop,
    /// which is at least its term's first entry). A decision read from the
    /// state then is one a proposal made at the call would have met, so a
    /// proposal that would change nothing may be left out. Elsewhere:
    /// `NotLeader`.
    pub async fn caught_up(&self) -> Result<(), ProposeError> {
        let (reply, rx) = oneshot::channel();
        self.send(NodeMsg::LastIndex(reply))?;
        let last = rx.await.map_err(|_| ProposeError::Stopped)??;
        let mut applied = self.applied.clone();
        applied
            .wait_for(|a| *a >= last)
            .await
            .map_err(|_| ProposeError::Stopped)?;
        Ok(())
    }

    /// Read access to the applied state. Hold it briefly.
    pub fn state(&self) -> RwLockReadGuard<'_, State> {
        // Apply never panics half way (it checks before it changes), so a
        // poisoned lock still guards consistent data.
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes whenever an applied entry may change what `agent` should run
    /// (`State::desired_tasks`), and once after a snapshot replaced the
    /// state.
    pub fn agent_wakeup(&self, agent: &str) -> AgentWakeup {
        self.wakeups.subscribe(agent)
    }

    /// Changes whenever a log entry is applied.
    pub fn applied(&self) -> watch::Receiver<u64> {
        self.applied.clone()
    }

    pub fn status(&self) -> NodeStatus {
        self.status.borrow().clone()
    }

    /// Changes at every commit (the indexes are in it).
    pub fn status_watch(&self) -> watch::Receiver<NodeStatus> {
        self.status.clone()
    }

    /// Changes only when the role, term, leader or serving change.
    pub fn role_watch(&self) -> watch::Receiver<RoleStatus> {
        self.role.clone()
    }

    pub fn addresses(&self) -> &Addresses {
        &self.addresses
    }

    /// The leader's id and API address, when both are known.
    pub fn leader(&self) -> Option<(u64, String)> {
        leader_of(self.status().leader_id, &self.addresses)
    }
}
