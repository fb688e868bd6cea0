//! The built-in job scheduler behind `gpuctl jobs`: its decisions are pure
//! and live in `gpuctl_engine::scheduler` (re-exported here); this module
//! runs them. [`runner`] is the loop that runs a pass against the leader's
//! offers, as a framework; [`board`] holds why each queued job waits, which
//! is not replicated.

pub use gpuctl_engine::scheduler::*;

pub mod board;
pub mod runner;
