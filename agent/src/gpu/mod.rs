//! GPU discovery: NVML through nvml-wrapper on hosts with a driver, or a
//! simulated inventory (`--simulate-gpus`) for laptops and the demo.

mod simulate;

use std::path::Path;

use gpuctl_proto::types::GpuInfo;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

pub use simulate::{parse_spec, simulated_gpus, SimSpec, SimulateError};

/// What discovery found on this host.
#[derive(Debug, Clone, Default)]
pub struct Discovery {
    pub gpus: Vec<GpuInfo>,
    pub driver_version: Option<String>,
    pub cuda_driver_version: Option<String>,
    /// Why NVML could not be used (library missing, init failed). Zero GPUs
    /// are reported then; the agent logs this once.
    pub error: Option<String>,
}

/// Discovers the host's GPUs through NVML. Never fails: without a usable
/// libnvidia-ml it returns zero GPUs and says why in `error`.
pub fn discover(nvml_lib: Option<&Path>) -> Discovery {
    let nvml = match nvml_lib {
        Some(p) => Nvml::builder().lib_path(p.as_os_str()).init(),
        None => Nvml::init(),
    };
    let nvml = match nvml {
        Ok(n) => n,
        Err(e) => {
            let lib = nvml_lib.map_or_else(
                || "libnvidia-ml.so.1".to_string(),
                |p| p.display().to_string(),
            );
            return Discovery {
                error: Some(format!("NVML unavailable ({lib}): {e}")),
                ..Default::default()
            };
        }
    };
    let mut d = Discovery {
        driver_version: nvml.sys_driver_version().ok(),
        cuda_driver_version: nvml
            .sys_cuda_driver_version()
            .ok()
            .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10)),
        ..Default::default()
    };
    let count = match nvml.device_count() {
        Ok(c) => c,
        Err(e) => {
            d.error = Some(format!("NVML device count: {e}"));
            return d;
        }
    };
    for index in 0..count {
        match read_device(&nvml, index) {
            Ok(g) => d.gpus.push(g),
            Err(e) => tracing::warn!(index, error = %e, "GPU skipped: NVML could not identify it"),
        }
    }
    d
}

fn read_device(nvml: &Nvml, index: u32) -> Result<GpuInfo, NvmlError> {
    let dev = nvml.device_by_index(index)?;
    let uuid = dev.uuid()?;
    // The identity (uuid) is enough to report a GPU; a GPU that answers
    // nothing else (e.g. "GPU is lost") is reported unhealthy, not hidden.
    let name = dev.name();
    let memory = dev.memory_info();
    let minor = dev.minor_number();
    let pci = dev.pci_info();
    let healthy = name.is_ok() && memory.is_ok() && minor.is_ok();
    Ok(GpuInfo {
        uuid,
        index,
        minor: minor.unwrap_or(index),
        model: name.unwrap_or_default(),
        memory_mib: memory.map_or(0, |m| m.total / (1024 * 1024)),
        healthy,
        pci_bus_id: pci.map(|p| p.bus_id).unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_gives_zero_gpus_and_a_reason() {
        let d = discover(Some(Path::new("/nonexistent/libnvidia-ml.so.1")));
        assert!(d.gpus.is_empty());
        let e = d.error.unwrap();
        assert!(e.contains("/nonexistent/libnvidia-ml.so.1"), "{e}");
    }
}
