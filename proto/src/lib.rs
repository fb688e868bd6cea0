//! The gpuctl gRPC API (v1) and the domain types shared by master, agent and CLI.
//!
//! `pb` is the generated wire code. `types` are the plain Rust types the rest of
//! the code works with; `convert` turns one into the other and is the single
//! place where bad input from the wire is rejected, naming the field.

#[allow(clippy::all, clippy::unwrap_used, missing_docs)]
pub mod pb {
    tonic::include_proto!("gpuctl.v1");
}

pub mod convert;
pub mod desired;
pub mod leader;
pub mod metrics;
pub mod time;
pub mod types;

pub use convert::ConvertError;
