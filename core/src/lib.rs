//! gpuctl's pure core: the wire messages (`pb`, prost structs without the
//! gRPC services), the domain types the rest of the code works with
//! (`types`), and `convert`, the one place where input from the wire is
//! checked and turned into domain types, naming the field on failure.
//!
//! It links no async runtime, RPC or HTTP stack (`tests/tests/dependencies.rs` checks
//! with `cargo tree`), so the state machine, the allocator, placement and
//! the agent's plans can use it and stay plain functions of their input.

#[allow(clippy::all, clippy::unwrap_used, missing_docs)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/gpuctl.v1.rs"));
}

pub mod convert;
pub mod cuda_req;
pub mod desired;
pub mod host;
pub mod logs;
pub mod metrics;
pub mod time;
pub mod types;
pub mod view;
pub mod wait;
pub mod wait_words;

pub use convert::ConvertError;
