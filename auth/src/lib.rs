//! Who may talk to whom in a gpuctl cluster.
//!
//! - [`pki`]: the cluster CA and the certificates it signs. A certificate
//!   says its holder's role (master, agent, client) and name (a master's
//!   node id, an agent's id, a client's name) in a URI SAN
//!   `gpuctl://ROLE/NAME`, and carries the DNS SAN `ROLE.gpuctl` that
//!   clients verify a server against, so an agent certificate can never pass
//!   for a master's.
//! - [`tls`]: rustls configurations for tonic servers and channels whose
//!   certificates can be replaced while they run (agent renewal, rotation).
//! - [`token`]: bearer tokens for people, frameworks and joining agents:
//!   random secrets of which the masters keep only a SHA-256 hash.
//! - [`peer`]: the identity of the caller of a gRPC request.

mod error;
pub mod peer;
pub mod pki;
pub mod tls;
pub mod token;

pub use error::AuthError;

use serde::{Deserialize, Serialize};

/// What a certificate lets its holder be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CertRole {
    /// A member of the Raft group: speaks Raft, serves the API.
    Master,
    /// An agent: registers itself, heartbeats, reports its own tasks, and
    /// serves task logs to masters.
    Agent,
    /// gpuctl, frameworks and other programs: call the API with a token.
    Client,
}

impl CertRole {
    pub fn as_str(self) -> &'static str {
        match self {
            CertRole::Master => "master",
            CertRole::Agent => "agent",
            CertRole::Client => "client",
        }
    }

    pub fn parse(s: &str) -> Option<CertRole> {
        match s {
            "master" => Some(CertRole::Master),
            "agent" => Some(CertRole::Agent),
            "client" => Some(CertRole::Client),
            _ => None,
        }
    }

    /// The DNS name every certificate of this role carries and that a
    /// client checks a server's certificate against.
    pub fn server_name(self) -> &'static str {
        match self {
            CertRole::Master => "master.gpuctl",
            CertRole::Agent => "agent.gpuctl",
            CertRole::Client => "client.gpuctl",
        }
    }
}

impl std::fmt::Display for CertRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl AuthError {
    pub(crate) fn invalid(what: impl Into<String>, msg: impl std::fmt::Display) -> AuthError {
        AuthError::Invalid {
            what: what.into(),
            msg: msg.to_string(),
        }
    }
}

/// Reads a file, naming it in the error.
pub(crate) fn read(path: &std::path::Path) -> Result<Vec<u8>, AuthError> {
    std::fs::read(path).map_err(|source| AuthError::Io {
        path: path.display().to_string(),
        source,
    })
}
