//! Built-in MIG profile tables, by GPU model (matched on the exact name).
//!
//! Two numbers name a GPU instance profile in NVML, and they differ:
//! - the profile *index*, one of the `NVML_GPU_INSTANCE_PROFILE_*` constants
//!   (1_SLICE = 0, 2_SLICE = 1, ...), which only
//!   nvmlDeviceGetGpuInstanceProfileInfo(V) takes;
//! - the profile *id*, which that call returns in `info.id` and which every
//!   other MIG call takes (placements, capacity, create, list) and reports
//!   (nvmlGpuInstanceInfo_t.profileId). It is the `ID` column of
//!   `nvidia-smi mig -lgip` (A100: 1g.5gb = 19, 7g.40gb = 0).
//!
//! Memory slices: 8 per GPU; a placement is (start, size) in memory slices.
//! Compute slices: 7 per GPU (`sliceCount`).

/// One GPU instance profile of one GPU model.
#[derive(Debug, PartialEq, Eq)]
pub struct Profile {
    /// `NVML_GPU_INSTANCE_PROFILE_*` (what ProfileInfo takes).
    pub index: u32,
    /// NVML's profile id (`info.id`; what create/placements take).
    pub id: u32,
    /// "1g.5gb" (NVML's name is "MIG 1g.5gb").
    pub name: &'static str,
    /// Compute slices (`sliceCount`), of 7.
    pub slices: u32,
    /// Memory slices a placement spans (placement `size`), of 8.
    pub mem_slices: u32,
    /// Most instances of this profile on one GPU (`instanceCount`).
    pub instance_count: u32,
    pub sms: u32,
    pub copy_engines: u32,
    pub decoders: u32,
    pub encoders: u32,
    pub jpegs: u32,
    pub ofas: u32,
    pub memory_mib: u64,
    /// Possible placement starts, in memory slices.
    pub starts: &'static [u32],
}

/// The MIG profiles of a family of GPU models.
#[derive(Debug, PartialEq, Eq)]
pub struct Table {
    pub models: &'static [&'static str],
    /// Default of a GPU's `mig.needs_reset`: whether a MIG mode change waits
    /// for a GPU reset (A100) or applies at once when no instance exists (H100).
    pub needs_reset: bool,
    pub profiles: &'static [Profile],
}

/// Memory slices per GPU.
pub const MEM_SLICES: u32 = 8;
/// Compute slices per GPU.
pub const COMPUTE_SLICES: u32 = 7;
/// nvmlDeviceGetMaxMigDeviceCount on a MIG-enabled GPU.
pub const MAX_MIG_DEVICES: u32 = 7;

const ONE_SLICE_STARTS: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const EVEN_STARTS: &[u32] = &[0, 2, 4];
const HALF_STARTS: &[u32] = &[0, 4];
const ZERO: &[u32] = &[0];

#[allow(clippy::too_many_arguments)]
const fn p(
    index: u32,
    id: u32,
    name: &'static str,
    (slices, mem_slices, instance_count): (u32, u32, u32),
    (sms, copy_engines, decoders, encoders, jpegs, ofas): (u32, u32, u32, u32, u32, u32),
    memory_mib: u64,
    starts: &'static [u32],
) -> Profile {
    Profile {
        index,
        id,
        name,
        slices,
        mem_slices,
        instance_count,
        sms,
        copy_engines,
        decoders,
        encoders,
        jpegs,
        ofas,
        memory_mib,
        starts,
    }
}

/// A100 40GB. Ids, slice counts, instance counts, SMs and engines as
/// `nvidia-smi mig -lgip` reports them; memory as the MIG devices report it.
pub static A100_40GB: Table = Table {
    models: &["NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"],
    needs_reset: true,
    profiles: &[
        p(
            0,
            19,
            "1g.5gb",
            (1, 1, 7),
            (14, 1, 0, 0, 0, 0),
            4864,
            ONE_SLICE_STARTS,
        ),
        p(
            1,
            14,
            "2g.10gb",
            (2, 2, 3),
            (28, 2, 1, 0, 0, 0),
            9856,
            EVEN_STARTS,
        ),
        p(
            2,
            9,
            "3g.20gb",
            (3, 4, 2),
            (42, 3, 2, 0, 0, 0),
            19968,
            HALF_STARTS,
        ),
        p(3, 5, "4g.20gb", (4, 4, 1), (56, 4, 2, 0, 0, 0), 19968, ZERO),
        p(4, 0, "7g.40gb", (7, 8, 1), (98, 7, 5, 0, 1, 1), 40192, ZERO),
    ],
};

/// H100 80GB: `nvidia-smi mig -lgip` of an H100 80GB HBM3 (ids, counts,
/// SMs, engines; memory = its GiB column x 1024). The PCIe card is given the
/// same table (its real SM counts are lower).
pub static H100_80GB: Table = Table {
    models: &["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"],
    needs_reset: false,
    profiles: &[
        p(
            0,
            19,
            "1g.10gb",
            (1, 1, 7),
            (16, 1, 1, 0, 1, 0),
            9984,
            ONE_SLICE_STARTS,
        ),
        p(
            9,
            15,
            "1g.20gb",
            (1, 2, 4),
            (26, 1, 1, 0, 1, 0),
            20096,
            &[0, 2, 4, 6],
        ),
        p(
            1,
            14,
            "2g.20gb",
            (2, 2, 3),
            (32, 2, 2, 0, 2, 0),
            20096,
            EVEN_STARTS,
        ),
        p(
            2,
            9,
            "3g.40gb",
            (3, 4, 2),
            (60, 3, 3, 0, 3, 0),
            40448,
            HALF_STARTS,
        ),
        p(3, 5, "4g.40gb", (4, 4, 1), (64, 4, 4, 0, 4, 0), 40448, ZERO),
        p(
            4,
            0,
            "7g.80gb",
            (7, 8, 1),
            (132, 8, 7, 0, 7, 1),
            81152,
            ZERO,
        ),
    ],
};

pub static TABLES: &[&Table] = &[&A100_40GB, &H100_80GB];

/// The MIG table of a GPU model; None: the model has no MIG.
pub fn table_for(model: &str) -> Option<&'static Table> {
    TABLES.iter().copied().find(|t| t.models.contains(&model))
}

impl Table {
    pub fn by_index(&self, index: u32) -> Option<&'static Profile> {
        let profiles: &'static [Profile] = self.profiles;
        profiles.iter().find(|p| p.index == index)
    }

    pub fn by_id(&self, id: u32) -> Option<&'static Profile> {
        let profiles: &'static [Profile] = self.profiles;
        profiles.iter().find(|p| p.id == id)
    }

    pub fn by_name(&self, name: &str) -> Option<&'static Profile> {
        let profiles: &'static [Profile] = self.profiles;
        profiles.iter().find(|p| p.name == name)
    }
}

/// The compute instance profile index of the one compute instance spanning
/// a GPU instance of `slices` compute slices (`NVML_COMPUTE_INSTANCE_PROFILE_*`).
pub fn full_ci_profile(slices: u32) -> u32 {
    match slices {
        1 => 0,
        2 => 1,
        3 => 2,
        4 => 3,
        7 => 4,
        8 => 5,
        _ => 6,
    }
}
