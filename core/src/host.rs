//! What a host offers an agent, as `gpuctl-agent check --json` prints it.
//! `gpuctl demo` reads it to choose real or simulated GPUs and the runtime,
//! so that the command line links no NVML or Docker client itself.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostCheck {
    /// The GPUs NVML found (none without a usable driver).
    pub gpus: Vec<HostGpu>,
    pub driver_version: Option<String>,
    /// Why NVML could not be used (library missing, init failed).
    pub nvml_error: Option<String>,
    /// `None` when Docker was not checked (`--no-docker`).
    pub docker: Option<DockerCheck>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostGpu {
    /// NVML's UUID (`GPU-...`); empty in a report of an older agent.
    #[serde(default)]
    pub uuid: String,
    pub model: String,
    pub healthy: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DockerCheck {
    /// Why the daemon cannot be used; `None` when it answers.
    pub error: Option<String>,
    /// The local busybox image, when asked for and ready.
    pub image: Option<String>,
    /// Why that image could not be prepared.
    pub image_error: Option<String>,
}

impl HostCheck {
    pub fn healthy_gpus(&self) -> usize {
        self.gpus.iter().filter(|g| g.healthy).count()
    }
}
