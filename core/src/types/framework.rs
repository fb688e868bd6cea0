//! Frameworks (schedulers above the master) and the tasks they launch.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::*;

/// The id of gpuctl's own job scheduler, which runs as a framework; no
/// other framework may take it.
pub const BUILTIN_FRAMEWORK_ID: &str = "gpuctl-jobs";

/// A task as a framework launches it (checked in `convert`; checked
/// against the accepted offers and the state by the master).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrameworkTask {
    /// The framework's own id for it.
    pub task_id: String,
    pub agent_id: AgentId,
    pub image: Option<String>,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub resources: Resources,
    /// Whole GPUs and MIG devices; for a fraction, its one shared GPU (as
    /// a fraction's task record names it).
    pub gpu_uuids: Vec<GpuUuid>,
    /// A fraction of its one shared GPU instead of devices
    /// (`resources.gpus` 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fraction: Option<GpuFraction>,
}

/// A checked ListJobs request.
#[derive(Debug, Clone, PartialEq)]
pub struct JobsQuery {
    /// Empty: any state.
    pub states: std::collections::HashSet<JobState>,
    pub name: Option<String>,
    pub limit: usize,
    /// Only jobs with a smaller sequence number (from the page token).
    pub before: Option<u64>,
}

/// A framework as it registers (the framework API).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrameworkInfo {
    /// Empty when subscribing for the first time: the master assigns one.
    pub id: FrameworkId,
    pub name: String,
    pub roles: Vec<String>,
    /// Capability GPU_RESOURCES.
    pub gpu_capable: bool,
    pub failover_timeout_ms: u64,
    /// The tenant it acts for, set by the master from its token (not part
    /// of the API: a framework cannot choose it).
    #[serde(default, skip_serializing_if = "Tenant::is_unset")]
    pub tenant: Tenant,
}

impl FrameworkInfo {
    /// The role its resources are accounted to (the first; "default" when none).
    pub fn role(&self) -> &str {
        self.roles.first().map_or("default", String::as_str)
    }
}
