//! What stops a master from starting or running: its data dir, storage,
//! Raft node, listener, server or config.

use std::path::PathBuf;

use crate::raft;
#[derive(Debug, thiserror::Error)]
pub enum MasterError {
    #[error("data dir {path}: {source}")]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Storage(#[from] raft::storage::StorageInitError),
    #[error(transparent)]
    Raft(#[from] raft::NodeError),
    #[error("listen on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("config: {0}")]
    Config(String),
}
