//! MIG discovery: a GPU's MIG mode, its MIG devices (a GPU instance and
//! the compute instance spanning it, which CUDA sees as a device), the
//! profiles it could still host, and the `nvidia-caps` device nodes that
//! grant access to each MIG device.
//!
//! The safe nvml-wrapper API gives the mode, the MIG device handles, their
//! UUID, name, memory and attributes; the GPU and compute instance ids, the
//! profiles' names (the v2 profile info) and the remaining capacity come
//! from the raw `nvml-wrapper-sys` calls, which the safe API lacks.
//!
//! Access to a MIG device is granted by two capability nodes,
//! `/dev/nvidia-caps/nvidia-capN`: its GPU instance's and its compute
//! instance's. The driver lists their minors in
//! `/proc/driver/nvidia-caps/mig-minors` as `gpu<minor>/gi<id>/access N`
//! and `gpu<minor>/gi<id>/ci<id>/access N`, with `<minor>` the parent's
//! `/dev/nvidia<minor>` (NVIDIA's container toolkit reads it the same way).

use std::collections::BTreeMap;
use std::path::Path;

use gpuctl_core::types::{MigCapacity, MigDevice, MigInfo, MigProfile};
use nvml_wrapper::error::{nvml_sym, nvml_try, NvmlError};
use nvml_wrapper::{Device, Nvml};

/// Where the driver lists the capability minors, under the proc root.
pub const MIG_MINORS: &str = "driver/nvidia-caps/mig-minors";

/// The minors of `mig-minors`, by name (`gpu0/gi1/access`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CapsMinors(BTreeMap<String, u32>);

impl CapsMinors {
    /// Parses the file's `NAME MINOR` lines; others are skipped.
    pub fn parse(text: &str) -> CapsMinors {
        let mut map = BTreeMap::new();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            if let (Some(name), Some(minor), None) = (words.next(), words.next(), words.next()) {
                if let Ok(m) = minor.parse() {
                    map.insert(name.to_string(), m);
                }
            }
        }
        CapsMinors(map)
    }

    /// `proc_root/driver/nvidia-caps/mig-minors`, or none when the file is
    /// missing (no MIG-capable driver).
    pub fn read(proc_root: &Path) -> CapsMinors {
        std::fs::read_to_string(proc_root.join(MIG_MINORS))
            .map(|t| CapsMinors::parse(&t))
            .unwrap_or_default()
    }

    /// The GPU instance's and the compute instance's access minors of a
    /// MIG device of the GPU with `/dev/nvidia<gpu_minor>`; those the file
    /// does not list are left out.
    pub fn for_device(&self, gpu_minor: u32, gi: u32, ci: u32) -> Vec<u32> {
        [
            format!("gpu{gpu_minor}/gi{gi}/access"),
            format!("gpu{gpu_minor}/gi{gi}/ci{ci}/access"),
        ]
        .iter()
        .filter_map(|k| self.0.get(k).copied())
        .collect()
    }
}

/// The MIG state of `dev` (`gpu_minor`: its `/dev/nvidia` minor). A GPU
/// without MIG (NVML says not supported) is off; other NVML errors are
/// returned for the caller to report.
pub fn read(
    nvml: &Nvml,
    dev: &Device,
    gpu_minor: u32,
    caps: &CapsMinors,
) -> Result<MigInfo, NvmlError> {
    let mode = match dev.mig_mode() {
        Ok(m) => m,
        Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => {
            return Ok(MigInfo::default())
        }
        Err(e) => return Err(e),
    };
    let enabled = mode.current != 0;
    let pending = (mode.pending != mode.current).then_some(mode.pending != 0);
    let mut info = MigInfo {
        enabled,
        pending,
        capable: true,
        // The driver may give the table only in MIG mode: none otherwise.
        profiles: super::mig_layout::profiles(nvml, dev)
            .unwrap_or_default()
            .into_iter()
            .map(|p| MigProfile {
                name: p.name,
                gpu_slices: p.slices,
                memory_mib: p.memory_mib,
                max_count: p.max_count,
            })
            .collect(),
        ..MigInfo::default()
    };
    if !enabled {
        return Ok(info);
    }
    let max = dev.mig_device_count()?;
    for i in 0..max {
        let mig = match dev.mig_device_by_index(i) {
            Ok(m) => m,
            // An empty slot: fewer devices than the maximum.
            Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
            Err(e) => return Err(e),
        };
        info.devices.push(read_device(nvml, &mig, gpu_minor, caps)?);
    }
    info.free = free_profiles(nvml, dev);
    Ok(info)
}

fn read_device(
    nvml: &Nvml,
    mig: &Device,
    gpu_minor: u32,
    caps: &CapsMinors,
) -> Result<MigDevice, NvmlError> {
    let uuid = mig.uuid()?;
    let attrs = mig.attributes()?;
    let memory_mib = match mig.memory_info() {
        Ok(m) => m.total / (1024 * 1024),
        Err(_) => attrs.memory_size_mb,
    };
    let gi_id = instance_id(nvml, mig, Instance::Gpu)?;
    let ci_id = instance_id(nvml, mig, Instance::Compute)?;
    // Real drivers name a MIG device "<GPU name> MIG 3g.20gb".
    let profile = mig
        .name()
        .ok()
        .and_then(|n| n.rsplit_once("MIG ").map(|(_, p)| p.trim().to_string()))
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| {
            super::mig_layout::profile_name(attrs.gpu_instance_slice_count, memory_mib)
        });
    Ok(MigDevice {
        uuid,
        profile,
        memory_mib,
        gpu_slices: attrs.gpu_instance_slice_count,
        compute_slices: attrs.compute_instance_slice_count,
        gi_id,
        ci_id,
        caps_minors: caps.for_device(gpu_minor, gi_id, ci_id),
    })
}

enum Instance {
    Gpu,
    Compute,
}

// The raw call the safe API lacks.
#[allow(unsafe_code)]
fn instance_id(nvml: &Nvml, mig: &Device, which: Instance) -> Result<u32, NvmlError> {
    let lib = nvml.lib();
    let sym = match which {
        Instance::Gpu => nvml_sym(lib.nvmlDeviceGetGpuInstanceId.as_ref())?,
        Instance::Compute => nvml_sym(lib.nvmlDeviceGetComputeInstanceId.as_ref())?,
    };
    let mut id = 0;
    // SAFETY: the handle is live for `mig`'s lifetime; NVML writes one uint.
    nvml_try(unsafe { sym(mig.handle(), &mut id) })?;
    Ok(id)
}

/// The profiles `dev` could still host, by name, with how many more of
/// each fit. Profiles NVML does not know on this GPU are skipped, as is
/// everything when the driver lacks the calls. Raw call: the safe API has
/// no remaining capacity.
#[allow(unsafe_code)]
fn free_profiles(nvml: &Nvml, dev: &Device) -> Vec<MigCapacity> {
    let Ok(capacity) = nvml_sym(
        nvml.lib()
            .nvmlDeviceGetGpuInstanceRemainingCapacity
            .as_ref(),
    ) else {
        return Vec::new();
    };
    let profiles = super::mig_layout::profiles(nvml, dev).unwrap_or_default();
    let mut out: Vec<MigCapacity> = Vec::new();
    for p in profiles {
        let mut count = 0;
        // SAFETY: the handle is live for `dev`'s lifetime; NVML writes one uint.
        if nvml_try(unsafe { capacity(dev.handle(), p.id, &mut count) }).is_err() || count == 0 {
            continue;
        }
        if !out.iter().any(|c| c.profile == p.name) {
            out.push(MigCapacity {
                profile: p.name,
                count,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_minors_are_read_by_name_and_odd_lines_skipped() {
        let caps = CapsMinors::parse(
            "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n\
             gpu1/gi2/access 21\ngarbage\ngpu1/gi2/ci0/access x\n",
        );
        assert_eq!(caps.for_device(0, 1, 0), vec![12, 13]);
        // The compute instance's line is unreadable: only the GI's.
        assert_eq!(caps.for_device(1, 2, 0), vec![21]);
        assert!(caps.for_device(3, 1, 0).is_empty());
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(CapsMinors::read(dir.path()), CapsMinors::default());
        std::fs::create_dir_all(dir.path().join("driver/nvidia-caps")).unwrap();
        std::fs::write(dir.path().join(MIG_MINORS), "gpu2/gi3/access 40\n").unwrap();
        assert_eq!(CapsMinors::read(dir.path()).for_device(2, 3, 0), vec![40]);
    }

    #[test]
    fn profile_names_follow_nvidia() {
        use super::super::mig_layout::profile_name;
        assert_eq!(profile_name(1, 4864), "1g.5gb");
        assert_eq!(profile_name(2, 9856), "2g.10gb");
        assert_eq!(profile_name(3, 19968), "3g.20gb");
        assert_eq!(profile_name(7, 40192), "7g.40gb");
    }
}
