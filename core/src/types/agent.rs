//! What an agent says about itself when it registers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::*;

/// What an agent says about itself when it registers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentInfo {
    pub id: AgentId,
    pub hostname: String,
    pub address: String,
    pub total: Resources,
    pub gpus: Vec<GpuInfo>,
    pub runtimes: Vec<Runtime>,
    pub simulated_gpus: bool,
    /// GPU feature labels (see the agent's `gpu::labels`).
    #[serde(default)]
    pub attributes: BTreeMap<String, String>,
    #[serde(default)]
    pub driver_version: Option<String>,
    #[serde(default)]
    pub cuda_driver_version: Option<String>,
    /// Host-process tasks may run as root here (`allow_root_tasks`).
    #[serde(default)]
    pub allow_root_tasks: bool,
    /// Host path prefixes containers may mount here (`allowed_mounts`).
    #[serde(default)]
    pub allowed_mounts: Vec<String>,
    /// Host ports tasks may be given here (`total.ports` is its size);
    /// `None` from agents that offer none.
    #[serde(default)]
    pub ports: Option<PortRange>,
    /// Its default for its GPUs (`--share-gpus`): shareable in this mode
    /// unless an admin said otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_gpus: Option<ShareMode>,
    /// The ids a job may name here (`allowed_users`); `None` from agents
    /// that do not say (any).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_users: Option<IdRanges>,
}
