//! GPUs as agents report them: whole GPUs, MIG devices and their layout, NVLink peers.

use serde::{Deserialize, Serialize};

use super::*;

/// Fields added after the first release carry `#[serde(default)]`: the
/// master's log holds these structs, and old entries must still decode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub uuid: GpuUuid,
    pub index: u32,
    pub minor: u32,
    pub model: String,
    pub memory_mib: u64,
    pub healthy: bool,
    pub pci_bus_id: String,
    #[serde(default)]
    pub serial: String,
    #[serde(default)]
    pub numa_node: Option<u32>,
    /// `(major, minor)`, e.g. `(8, 0)` for an A100.
    #[serde(default)]
    pub compute_capability: Option<(u32, u32)>,
    #[serde(default)]
    pub peers: Vec<GpuPeer>,
    #[serde(default)]
    pub unhealthy_reason: String,
    /// MIG: the GPU's mode, its MIG devices and what it could still host.
    /// Default (off, none) for a GPU without MIG.
    #[serde(default, skip_serializing_if = "MigInfo::is_off")]
    pub mig: MigInfo,
}

/// A GPU's MIG state as its agent discovered it through NVML.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigInfo {
    /// MIG mode is on (NVML's current mode).
    #[serde(default)]
    pub enabled: bool,
    /// The mode after the next GPU reset, when it differs (A100: a mode
    /// change waits for a reset).
    #[serde(default)]
    pub pending: Option<bool>,
    #[serde(default)]
    pub devices: Vec<MigDevice>,
    /// The profiles the GPU could still host next to its devices, and how
    /// many of each (NVML's remaining capacity); empty when none fits.
    #[serde(default)]
    pub free: Vec<MigCapacity>,
    /// The GPU has MIG (NVML reports a mode), whether or not it is on.
    #[serde(default)]
    pub capable: bool,
    /// The GPU instance profiles it offers (an empty GPU's table).
    #[serde(default)]
    pub profiles: Vec<MigProfile>,
}

/// A GPU instance profile of a MIG-capable GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigProfile {
    pub name: String,
    pub gpu_slices: u32,
    pub memory_mib: u64,
    /// Most instances of it on an empty GPU.
    pub max_count: u32,
}

impl MigInfo {
    pub fn is_off(&self) -> bool {
        *self == MigInfo::default()
    }
}

/// One MIG device: a GPU instance and the compute instance spanning it,
/// which CUDA sees as a device of its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigDevice {
    /// `MIG-…`, as in `NVIDIA_VISIBLE_DEVICES`.
    pub uuid: String,
    /// The profile's name, e.g. `1g.10gb`: compute slices and memory.
    pub profile: String,
    pub memory_mib: u64,
    /// Slices of the GPU's compute (out of 7) and of its compute instance.
    pub gpu_slices: u32,
    pub compute_slices: u32,
    /// NVML's GPU instance and compute instance ids.
    pub gi_id: u32,
    pub ci_id: u32,
    /// Minors of the `/dev/nvidia-caps/nvidia-capN` nodes that grant
    /// access to it (its GPU instance's and its compute instance's); empty
    /// when the host does not say (no `mig-minors` file).
    pub caps_minors: Vec<u32>,
}

/// A device a task can be given: a whole GPU that is not in MIG mode, or
/// one MIG device of a GPU that is. `Resources::gpus` counts devices, so a
/// MIG device counts as one GPU in totals, quotas and fair shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device<'a> {
    Gpu(&'a GpuInfo),
    Mig {
        parent: &'a GpuInfo,
        device: &'a MigDevice,
    },
}

impl<'a> Device<'a> {
    pub fn uuid(&self) -> &'a str {
        match self {
            Device::Gpu(g) => &g.uuid,
            Device::Mig { device, .. } => &device.uuid,
        }
    }

    /// The physical GPU: itself, or the MIG device's parent.
    pub fn gpu(&self) -> &'a GpuInfo {
        match self {
            Device::Gpu(g) => g,
            Device::Mig { parent, .. } => parent,
        }
    }

    /// The MIG profile; `None` for a whole GPU.
    pub fn mig_profile(&self) -> Option<&'a str> {
        match self {
            Device::Gpu(_) => None,
            Device::Mig { device, .. } => Some(&device.profile),
        }
    }

    pub fn memory_mib(&self) -> u64 {
        match self {
            Device::Gpu(g) => g.memory_mib,
            Device::Mig { device, .. } => device.memory_mib,
        }
    }

    /// The device as one entry of a list of GPUs (the allocator's unit):
    /// a MIG device is its parent narrowed to it (its uuid and memory, MIG
    /// mode with only this device, no peers).
    pub fn to_gpu(&self) -> GpuInfo {
        match self {
            Device::Gpu(g) => (*g).clone(),
            Device::Mig { parent, device } => GpuInfo {
                uuid: device.uuid.clone(),
                memory_mib: device.memory_mib,
                peers: Vec::new(),
                mig: MigInfo {
                    enabled: true,
                    pending: None,
                    devices: vec![(*device).clone()],
                    free: Vec::new(),
                    capable: true,
                    profiles: Vec::new(),
                },
                ..(*parent).clone()
            },
        }
    }
}

/// What a list of GPUs says of the devices `uuids` (an offer's): each
/// whole GPU named, and each parent of a MIG device named with only its
/// named MIG devices listed. In the order of `gpus`.
pub fn gpus_of_devices(gpus: &[GpuInfo], uuids: &[String]) -> Vec<GpuInfo> {
    let named = |u: &str| uuids.iter().any(|x| x == u);
    let mut out = Vec::new();
    for g in gpus {
        if !g.mig.enabled {
            if named(&g.uuid) {
                out.push(g.clone());
            }
            continue;
        }
        if g.mig.devices.iter().any(|d| named(&d.uuid)) {
            let mut p = g.clone();
            p.mig.devices.retain(|d| named(&d.uuid));
            out.push(p);
        }
    }
    out
}

/// Every device `gpus` give tasks: each GPU not in MIG mode, and each MIG
/// device of those that are (a GPU in MIG mode is never given whole).
pub fn devices(gpus: &[GpuInfo]) -> impl Iterator<Item = Device<'_>> {
    gpus.iter().flat_map(|g| {
        let whole = (!g.mig.enabled).then_some(Device::Gpu(g));
        whole
            .into_iter()
            .chain(g.mig_devices().iter().map(move |d| Device::Mig {
                parent: g,
                device: d,
            }))
    })
}

/// Every MIG device `gpus` give tasks, with its parent GPU.
pub fn mig_devices_of(gpus: &[GpuInfo]) -> impl Iterator<Item = (&GpuInfo, &MigDevice)> {
    gpus.iter()
        .flat_map(|g| g.mig_devices().iter().map(move |d| (g, d)))
}

/// How many devices `gpus` give tasks (an agent's `total.gpus`).
pub fn device_count(gpus: &[GpuInfo]) -> u32 {
    u32::try_from(devices(gpus).count()).unwrap_or(u32::MAX)
}

/// The device `uuid` names among `gpus`: a whole GPU (also one in MIG
/// mode, which callers refuse by its mode) or a MIG device of a GPU in
/// MIG mode.
pub fn find_device<'a>(gpus: &'a [GpuInfo], uuid: &str) -> Option<Device<'a>> {
    gpus.iter().find_map(|g| {
        if g.uuid == uuid {
            return Some(Device::Gpu(g));
        }
        g.mig_devices()
            .iter()
            .find(|d| d.uuid == uuid)
            .map(|d| Device::Mig {
                parent: g,
                device: d,
            })
    })
}

/// How many more MIG devices of a profile a GPU could host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigCapacity {
    pub profile: String,
    pub count: u32,
}

impl GpuInfo {
    /// Its MIG devices that tasks may be given: those of a GPU in MIG mode.
    pub fn mig_devices(&self) -> &[MigDevice] {
        if self.mig.enabled {
            &self.mig.devices
        } else {
            &[]
        }
    }

    /// A GPU known only by identity; the rest is filled by discovery.
    pub fn new(
        uuid: impl Into<String>,
        index: u32,
        model: impl Into<String>,
        memory_mib: u64,
    ) -> Self {
        GpuInfo {
            uuid: uuid.into(),
            index,
            minor: index,
            model: model.into(),
            memory_mib,
            healthy: true,
            pci_bus_id: String::new(),
            serial: String::new(),
            numa_node: None,
            compute_capability: None,
            peers: Vec::new(),
            unhealthy_reason: String::new(),
            mig: MigInfo::default(),
        }
    }
}

/// How one GPU reaches another GPU of the same host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuPeer {
    pub uuid: GpuUuid,
    /// Active NVLink links between the two.
    pub nvlinks: u32,
    /// PCIe path: PIX, PXB, PHB, NODE or SYS (as `nvidia-smi topo -m`);
    /// empty when unknown.
    pub pcie: String,
}
