//! A task's options: each field is at once the domain's (in the Raft log
//! and the agent's state), `gpuctl jobs submit`'s flag (clap, feature
//! `clap`), the job file's key and `jobs get --json`'s field (serde), with
//! one form and one default everywhere. The wire carries them in one
//! message, `TaskOptions` (common.proto), the same in a job's spec and in
//! each task; `convert/options.rs` checks them.
//!
//! A new per-task option is a field here, its field in that message, its
//! check and copy in `convert/options.rs`, and the code that acts on it.
//! (The options older than this struct keep their own fields, flags and
//! keys: `TaskTemplate`, `SubmitArgs`, `JobFile`, for compatibility.)

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct TaskOptions {}

impl TaskOptions {
    pub fn is_default(&self) -> bool {
        *self == TaskOptions::default()
    }
}
