//! Replication: every state change goes through the raft-rs log.

mod logger;
pub mod node;
pub mod storage;

pub use node::{NodeStatus, ProposeError, RaftHandle, RaftNodeConfig, Role};
pub use storage::SledStorage;
