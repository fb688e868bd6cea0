//! What tests that drive a state through commands share.

use gpuctl_proto::types::{AgentInfo, GpuInfo, Resources, Runtime};

use super::Command;

/// An agent `id` (hostname `<id>.host`) with `gpus` simulated A100s
/// (`GPU-<id>-<n>`), 64 CPUs and 1 TiB, running host processes, registering.
pub fn register(id: &str, gpus: u32) -> Command {
    Command::RegisterAgent {
        info: AgentInfo {
            id: id.into(),
            hostname: format!("{id}.host"),
            address: String::new(),
            total: Resources {
                cpus: 64.0,
                mem_mib: 1 << 20,
                gpus,
            },
            gpus: (0..gpus)
                .map(|i| GpuInfo::new(format!("GPU-{id}-{i}"), i, "A100", 40960))
                .collect(),
            runtimes: vec![Runtime::Process],
            simulated_gpus: true,
            attributes: Default::default(),
            driver_version: None,
            cuda_driver_version: None,
        },
        running_task_ids: vec![],
        at_ms: 0,
    }
}
