//! What stops an agent from starting or running: its config, work dir,
//! runtimes, isolation, listener or server.

use std::path::PathBuf;

use crate::{isolation, runtime};
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("config: {0}")]
    Config(String),
    #[error("work dir {path}: {source}")]
    WorkDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("Docker runtime requested but unavailable: {0}")]
    Docker(runtime::RuntimeError),
    #[error("agent API server: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("isolation: {0}")]
    Isolation(#[from] isolation::IsolationError),
    #[error("listen on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
    #[error("start the GPU health checks: {0}")]
    HealthThread(std::io::Error),
}
