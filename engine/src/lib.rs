//! gpuctl's engine: what the master decides, as pure functions of its
//! state. The replicated state machine ([`state`]: `State::apply` of each
//! committed command, the same on every master), the framework allocator
//! ([`allocator`]: DRF offers and reclaim) and the built-in scheduler's
//! decisions ([`scheduler`]: placement, the queue, preemption, MIG on
//! demand). No clock, no I/O, no randomness: the master crate runs them
//! (Raft, the services, the leader's loops) and this crate cannot reach
//! any of that, since it depends on no async runtime, RPC, storage or Raft
//! crate (tests/tests/dependencies.rs checks).

pub mod allocator;
pub mod scheduler;
pub mod state;
