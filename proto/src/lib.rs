//! The gpuctl gRPC API (v1): the services' clients and servers, the leader
//! redirect every client follows, and (features `metrics-server`, `daemon`)
//! the daemons' `/metrics` server and what their `main` does.
//!
//! The messages, the domain types and the conversion between them live in
//! `gpuctl-core`, which links no RPC stack; `pb` here re-exports its
//! messages beside the generated services, so `pb::OperatorClient`'s
//! requests are `pb::…` as before.

#[allow(clippy::all, clippy::unwrap_used, missing_docs)]
pub mod pb {
    pub use gpuctl_core::pb::*;
    tonic::include_proto!("gpuctl.v1");
}

pub mod codec;
#[cfg(feature = "daemon")]
pub mod daemon;
pub mod follow;
pub mod leader;
#[cfg(any(test, feature = "memnet"))]
pub mod memnet;
#[cfg(feature = "metrics-server")]
pub mod metrics_server;
#[cfg(feature = "daemon")]
pub mod options;

/// Bad input as the API answers it: `INVALID_ARGUMENT` with the field named.
/// (A function, not a `From`: neither type is this crate's.)
pub fn invalid_argument(e: gpuctl_core::ConvertError) -> tonic::Status {
    tonic::Status::invalid_argument(e.to_string())
}

/// A new idempotency key for a submit (`SubmitJobRequest.request_id`): 128
/// random bits in hex, from the kernel; the clock and pid if that fails.
pub fn new_request_id() -> String {
    use std::io::Read as _;
    let mut b = [0u8; 16];
    let random = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    if random.is_err() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        b[..12].copy_from_slice(&now.to_le_bytes()[..12]);
        b[12..].copy_from_slice(&std::process::id().to_le_bytes());
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}
