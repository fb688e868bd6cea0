//! GPU discovery: NVML through nvml-wrapper on hosts with a driver, or a
//! simulated inventory (`--simulate-gpus`) for laptops and the demo.
//!
//! What is read, per GPU: index, UUID, name, serial, memory, minor number
//! (hence `/dev/nvidiaN`), PCI bus id, NUMA node, compute capability, and
//! for every pair of GPUs the active NVLink links between them and their
//! PCIe path; its MIG mode, MIG devices and free MIG profiles (`mig.rs`);
//! per host: driver and CUDA driver versions. See docs/hardware.md.

pub mod cap_socket;
pub mod health;
mod labels;
pub mod memcap;
pub mod mig;
pub mod mig_apply;
pub mod mig_layout;
pub mod mps;
pub mod procs;
mod simulate;

use std::path::Path;

use gpuctl_core::types::{GpuInfo, GpuPeer};
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

pub use labels::{family, labels};
pub use simulate::{parse_spec, simulated_gpus, SimSpec, SimulateError};

/// NVML_NVLINK_MAX_LINKS: no GPU has more links than this.
const MAX_NVLINKS: u32 = 18;

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
/// `nvidia_proc_root` holds the driver's `/proc` files (MIG's capability
/// minors).
pub fn discover(nvml_lib: Option<&Path>, nvidia_proc_root: &Path) -> Discovery {
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
    let caps = mig::CapsMinors::read(nvidia_proc_root);
    // Remote PCI bus ids of each GPU's active NVLink links, by position in d.gpus.
    let mut links: Vec<Vec<BusId>> = Vec::new();
    for index in 0..count {
        match read_device(&nvml, index, &caps) {
            Ok((g, l)) => {
                d.gpus.push(g);
                links.push(l);
            }
            Err(e) => tracing::warn!(index, error = %e, "GPU skipped: NVML cannot identify it"),
        }
    }
    fill_topology(&nvml, &mut d.gpus, &links);
    d
}

/// A PCI address, parsed so that NVML's 8-digit and legacy 4-digit domain
/// spellings compare equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BusId {
    domain: u32,
    bus: u32,
    device: u32,
    function: u32,
}

impl BusId {
    pub fn parse(s: &str) -> Option<BusId> {
        let s = s.trim().trim_end_matches('\0');
        let (domain, rest) = s.split_once(':')?;
        let (bus, rest) = rest.split_once(':')?;
        let (device, function) = rest.split_once('.')?;
        Some(BusId {
            domain: u32::from_str_radix(domain, 16).ok()?,
            bus: u32::from_str_radix(bus, 16).ok()?,
            device: u32::from_str_radix(device, 16).ok()?,
            function: u32::from_str_radix(function, 16).ok()?,
        })
    }
}

fn read_device(
    nvml: &Nvml,
    index: u32,
    caps: &mig::CapsMinors,
) -> Result<(GpuInfo, Vec<BusId>), NvmlError> {
    let dev = nvml.device_by_index(index)?;
    let uuid = dev.uuid()?;
    // The identity (UUID) is enough to report a GPU. A GPU that answers
    // nothing else ("GPU is lost") is reported unhealthy, never hidden, so
    // that it is not handed out and operators see it.
    let mut g = GpuInfo::new(uuid, index, String::new(), 0);
    let mut problems = Vec::new();
    let mut note = |what: &str, e: &NvmlError| match e {
        // Optional features a GPU may lack do not make it unhealthy.
        NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_) => {}
        // One clear reason instead of the same message for every query.
        NvmlError::GpuLost => {
            let lost = "GPU is lost (fallen off the bus or inaccessible)".to_string();
            if !problems.contains(&lost) {
                problems.push(lost);
            }
        }
        e => problems.push(format!("{what}: {e}")),
    };
    match dev.name() {
        Ok(n) => g.model = n,
        Err(e) => note("name", &e),
    }
    match dev.memory_info() {
        Ok(m) => g.memory_mib = m.total / (1024 * 1024),
        Err(e) => note("memory", &e),
    }
    match dev.minor_number() {
        Ok(m) => g.minor = m,
        Err(e) => note("minor number", &e),
    }
    match dev.pci_info() {
        Ok(p) => g.pci_bus_id = p.bus_id,
        Err(e) => note("PCI info", &e),
    }
    match dev.serial() {
        Ok(s) => g.serial = s,
        Err(e) => note("serial", &e),
    }
    match dev.numa_node_id() {
        Ok(n) => g.numa_node = Some(n),
        Err(e) => note("NUMA node", &e),
    }
    match dev.cuda_compute_capability() {
        Ok(c) => {
            g.compute_capability = Some((c.major.max(0) as u32, c.minor.max(0) as u32));
        }
        Err(e) => note("compute capability", &e),
    }
    match mig::read(nvml, &dev, g.minor, caps) {
        Ok(m) => g.mig = m,
        Err(e) => note("MIG", &e),
    }
    let mut remote = Vec::new();
    for link in 0..MAX_NVLINKS {
        let l = dev.link_wrapper_for(link);
        match l.is_active() {
            Ok(true) => match l.remote_pci_info() {
                Ok(p) => remote.extend(BusId::parse(&p.bus_id)),
                Err(e) => {
                    note("NVLink remote", &e);
                    break;
                }
            },
            Ok(false) => {}
            // NotSupported (no NVLink) or past the last link.
            Err(_) => break,
        }
    }
    if !problems.is_empty() {
        g.healthy = false;
        g.unhealthy_reason = problems.join("; ");
    }
    Ok((g, remote))
}

fn pcie_name(level: TopologyLevel) -> &'static str {
    match level {
        TopologyLevel::Internal | TopologyLevel::Single => "PIX",
        TopologyLevel::Multiple => "PXB",
        TopologyLevel::HostBridge => "PHB",
        TopologyLevel::Node => "NODE",
        TopologyLevel::System => "SYS",
    }
}

/// Fills each GPU's `peers`: NVLink counts from the remote bus ids, PCIe
/// path from NVML's common-ancestor query.
fn fill_topology(nvml: &Nvml, gpus: &mut [GpuInfo], links: &[Vec<BusId>]) {
    let bus: Vec<Option<BusId>> = gpus.iter().map(|g| BusId::parse(&g.pci_bus_id)).collect();
    let handles: Vec<Option<Device>> = gpus
        .iter()
        .map(|g| nvml.device_by_index(g.index).ok())
        .collect();
    for i in 0..gpus.len() {
        let mut peers = Vec::new();
        for j in 0..gpus.len() {
            if i == j {
                continue;
            }
            let nvlinks = bus[j].map_or(0, |b| links[i].iter().filter(|r| **r == b).count() as u32);
            let pcie = match (&handles[i], nvml.device_by_index(gpus[j].index)) {
                (Some(a), Ok(b)) => a.topology_common_ancestor(b).map_or("", pcie_name),
                _ => "",
            };
            peers.push(GpuPeer {
                uuid: gpus[j].uuid.clone(),
                nvlinks,
                pcie: pcie.to_string(),
            });
        }
        gpus[i].peers = peers;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_gives_zero_gpus_and_a_reason() {
        let d = discover(
            Some(Path::new("/nonexistent/libnvidia-ml.so.1")),
            Path::new("/proc"),
        );
        assert!(d.gpus.is_empty());
        let e = d.error.unwrap();
        assert!(e.contains("/nonexistent/libnvidia-ml.so.1"), "{e}");
    }

    #[test]
    fn bus_ids_compare_across_spellings() {
        assert_eq!(
            BusId::parse("00000000:07:00.0"),
            BusId::parse("0000:07:00.0")
        );
        assert_ne!(
            BusId::parse("00000000:07:00.0"),
            BusId::parse("00000000:0F:00.0")
        );
        assert_eq!(BusId::parse("garbage"), None);
    }
}
