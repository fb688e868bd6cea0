//! Replication: every state change goes through the raft-rs log.

mod handle;
mod logger;
pub mod node;
mod snapshot;
pub mod storage;
pub mod transport;
mod types;
pub mod wakeups;

#[cfg(test)]
mod cluster_tests;
#[cfg(test)]
pub(crate) mod sim;

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

pub use handle::RaftHandle;
pub use snapshot::{decode_snapshot, encode_snapshot, state_at_rest};
pub use storage::SledStorage;
pub use transport::{GrpcTransport, Transport};
pub use types::{NodeError, NodeStatus, ProposeError, RaftNodeConfig, Reporter, Role, RoleStatus};
pub use wakeups::{AgentWakeup, AgentWakeups};

/// API address (`HOST:PORT`) of each master by node id: from `--peers`,
/// from the replicated state (`State::masters`) and from the senders of raft
/// messages. Shared by the node, the transport and the services.
#[derive(Debug, Clone, Default)]
pub struct Addresses(Arc<RwLock<BTreeMap<u64, String>>>);

impl Addresses {
    pub fn new(initial: BTreeMap<u64, String>) -> Addresses {
        Addresses(Arc::new(RwLock::new(initial)))
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<u64, String>> {
        self.0.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<u64, String>> {
        self.0.write().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, id: u64) -> Option<String> {
        self.read().get(&id).cloned()
    }

    pub fn all(&self) -> BTreeMap<u64, String> {
        self.read().clone()
    }

    /// Sets (or replaces) an address: the replicated state's word wins.
    pub fn set(&self, id: u64, addr: &str) {
        if addr.is_empty() {
            return;
        }
        self.write().insert(id, addr.to_string());
    }

    /// Records an address only when none is known (a message's sender).
    pub fn learn(&self, id: u64, addr: &str) {
        if addr.is_empty() {
            return;
        }
        self.write().entry(id).or_insert_with(|| addr.to_string());
    }

    pub fn remove(&self, id: u64) {
        self.write().remove(&id);
    }
}
