//! What each GPU UUID of a task gives it, in device nodes. PURE.
//!
//! A whole GPU is its `/dev/nvidia<minor>`. A MIG device is what NVIDIA's
//! container toolkit gives for one: its parent's `/dev/nvidia<minor>` and
//! the `/dev/nvidia-caps/nvidia-cap<N>` nodes of its GPU instance's and its
//! compute instance's access capabilities. Without those caps CUDA cannot
//! use a MIG device, so the parent's node can be shared by every MIG task
//! of the parent (docs/isolation.md, "MIG").

use std::collections::{BTreeMap, HashMap};

use gpuctl_core::types::GpuInfo;

/// A MIG device has two access caps: its GPU instance's and its compute
/// instance's.
pub const MIG_ACCESS_CAPS: usize = 2;

/// What one UUID of `TaskSpec.gpu_uuids` gives a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceGrant {
    /// A whole GPU: `/dev/nvidia<minor>`.
    Gpu { minor: u32 },
    /// A MIG device: its parent's `/dev/nvidia<parent_minor>` and the caps
    /// nodes of `caps` (as discovery read them from `mig-minors`; fewer
    /// than [`MIG_ACCESS_CAPS`] when the host did not say). `parent` is the
    /// parent GPU's UUID: its health is the MIG device's.
    Mig {
        parent: String,
        parent_minor: u32,
        caps: Vec<u32>,
    },
}

/// The grant of each GPU and each MIG device of `gpus`, by UUID.
/// The grants, replaced whole when a MIG layout change makes new MIG
/// devices (read by each task's launch).
pub type SharedGrants = std::sync::Arc<std::sync::RwLock<HashMap<String, DeviceGrant>>>;

pub fn device_grants(gpus: &[GpuInfo]) -> HashMap<String, DeviceGrant> {
    let mut out = HashMap::new();
    for g in gpus {
        out.insert(g.uuid.clone(), DeviceGrant::Gpu { minor: g.minor });
        for m in &g.mig.devices {
            out.insert(
                m.uuid.clone(),
                DeviceGrant::Mig {
                    parent: g.uuid.clone(),
                    parent_minor: g.minor,
                    caps: m.caps_minors.clone(),
                },
            );
        }
    }
    out
}

/// The device nodes a task is given, by minor number.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskDevices {
    /// `nvidia<N>`: its whole GPUs and its MIG devices' parents.
    pub gpus: Vec<u32>,
    /// `nvidia-caps/nvidia-cap<N>`: its MIG devices' access caps.
    pub caps: Vec<u32>,
    /// Its MIG devices whose caps are not known, by UUID: they cannot be
    /// isolated from their neighbours, so a host with NVIDIA nodes refuses
    /// them (`Isolator::prepare`).
    pub unknown_caps: Vec<String>,
}

impl TaskDevices {
    /// Whole GPUs of these minors.
    pub fn gpus(minors: &[u32]) -> TaskDevices {
        TaskDevices {
            gpus: minors.to_vec(),
            ..TaskDevices::default()
        }
    }

    /// No GPU and no MIG device: the task gets no NVIDIA node at all.
    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty() && self.caps.is_empty()
    }
}

/// Each MIG device's parent GPU, by MIG device UUID: a task holding a MIG
/// device fails with its parent (`executor::plan`).
pub fn mig_parents(grants: &HashMap<String, DeviceGrant>) -> BTreeMap<String, String> {
    grants
        .iter()
        .filter_map(|(uuid, g)| match g {
            DeviceGrant::Mig { parent, .. } => Some((uuid.clone(), parent.clone())),
            DeviceGrant::Gpu { .. } => None,
        })
        .collect()
}

/// The devices of a task holding `uuids`; `Err` names the first UUID that
/// is neither a GPU nor a MIG device of this agent.
pub fn resolve(
    grants: &HashMap<String, DeviceGrant>,
    uuids: &[String],
) -> Result<TaskDevices, String> {
    let mut out = TaskDevices::default();
    for u in uuids {
        match grants.get(u) {
            None => return Err(u.clone()),
            Some(DeviceGrant::Gpu { minor }) => out.gpus.push(*minor),
            Some(DeviceGrant::Mig {
                parent_minor, caps, ..
            }) => {
                out.gpus.push(*parent_minor);
                out.caps.extend(caps);
                if caps.len() < MIG_ACCESS_CAPS {
                    out.unknown_caps.push(u.clone());
                }
            }
        }
    }
    // Two MIG devices of one parent share its node.
    for v in [&mut out.gpus, &mut out.caps] {
        v.sort_unstable();
        v.dedup();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuctl_core::types::{MigDevice, MigInfo};

    fn mig(uuid: &str, gi: u32, caps: &[u32]) -> MigDevice {
        MigDevice {
            uuid: uuid.into(),
            profile: "1g.10gb".into(),
            memory_mib: 9856,
            gpu_slices: 1,
            compute_slices: 1,
            gi_id: gi,
            ci_id: 0,
            caps_minors: caps.to_vec(),
        }
    }

    /// GPU-a whole (minor 0); GPU-b (minor 3) in MIG mode with two MIG
    /// devices, and one whose caps the host did not list.
    fn gpus() -> Vec<GpuInfo> {
        let a = GpuInfo::new("GPU-a", 0, "A100", 40960);
        let mut b = GpuInfo::new("GPU-b", 1, "A100", 40960);
        b.minor = 3;
        b.mig = MigInfo {
            enabled: true,
            devices: vec![
                mig("MIG-b1", 1, &[30, 31]),
                mig("MIG-b2", 2, &[39, 40]),
                mig("MIG-b3", 3, &[]),
            ],
            ..MigInfo::default()
        };
        vec![a, b]
    }

    fn ids(u: &[&str]) -> Vec<String> {
        u.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn grants_name_gpus_and_mig_devices_with_their_parents_minor() {
        let g = device_grants(&gpus());
        assert_eq!(g.len(), 5);
        assert_eq!(g["GPU-a"], DeviceGrant::Gpu { minor: 0 });
        assert_eq!(g["GPU-b"], DeviceGrant::Gpu { minor: 3 });
        assert_eq!(
            g["MIG-b2"],
            DeviceGrant::Mig {
                parent: "GPU-b".into(),
                parent_minor: 3,
                caps: vec![39, 40]
            }
        );
    }

    #[test]
    fn mig_devices_map_to_their_parents() {
        let p = mig_parents(&device_grants(&gpus()));
        let want: BTreeMap<String, String> = ["MIG-b1", "MIG-b2", "MIG-b3"]
            .iter()
            .map(|m| (m.to_string(), "GPU-b".to_string()))
            .collect();
        assert_eq!(p, want);
    }

    #[test]
    fn uuids_resolve_to_node_minors() {
        let g = device_grants(&gpus());
        // (uuids, gpus, caps, unknown caps)
        type Row<'a> = (&'a [&'a str], &'a [u32], &'a [u32], &'a [&'a str]);
        let table: &[Row] = &[
            (&[], &[], &[], &[]),
            (&["GPU-a"], &[0], &[], &[]),
            (&["GPU-b", "GPU-a"], &[0, 3], &[], &[]),
            (&["MIG-b1"], &[3], &[30, 31], &[]),
            // Two MIG devices of one parent: its node once, both caps.
            (&["MIG-b2", "MIG-b1"], &[3], &[30, 31, 39, 40], &[]),
            (&["MIG-b3"], &[3], &[], &["MIG-b3"]),
            (&["GPU-a", "MIG-b1"], &[0, 3], &[30, 31], &[]),
        ];
        for (uuids, want_gpus, want_caps, unknown) in table {
            let d = resolve(&g, &ids(uuids)).unwrap();
            assert_eq!(
                (d.gpus.as_slice(), d.caps.as_slice()),
                (*want_gpus, *want_caps),
                "{uuids:?}"
            );
            assert_eq!(d.unknown_caps, ids(unknown), "{uuids:?}");
            assert_eq!(d.is_empty(), uuids.is_empty(), "{uuids:?}");
        }
    }

    #[test]
    fn a_mig_device_with_one_cap_known_has_unknown_caps() {
        let mut list = gpus();
        list[1].mig.devices[0].caps_minors = vec![30];
        let d = resolve(&device_grants(&list), &ids(&["MIG-b1"])).unwrap();
        assert_eq!(d.unknown_caps, ids(&["MIG-b1"]));
    }

    #[test]
    fn an_unknown_uuid_is_named() {
        let g = device_grants(&gpus());
        assert_eq!(
            resolve(&g, &ids(&["GPU-a", "MIG-zz"])),
            Err("MIG-zz".to_string())
        );
    }
}
