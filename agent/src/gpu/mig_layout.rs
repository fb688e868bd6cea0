//! Repartitioning a GPU in MIG mode through NVML: the GPU instances (and
//! the one compute instance spanning each) that make its MIG devices are
//! destroyed and created until the GPU holds the profiles asked for.
//!
//! All or nothing: a failure part way (a GPU instance still in use, no
//! room for a profile) puts back the layout found at the start, at the
//! same placements, and says what failed. Nothing here knows about tasks:
//! the caller makes sure no task uses the GPU (a process holding a GPU
//! instance makes NVML refuse to destroy it, which also rolls back).
//!
//! The raw NVML calls come from `nvml-wrapper-sys`: the safe API has none
//! of them. The agent applies the master's layout changes through
//! `gpu::mig_apply`.

use std::ffi::CStr;

use nvml_wrapper::error::{nvml_sym, nvml_try, NvmlError};
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    nvmlComputeInstanceProfileInfo_t, nvmlComputeInstance_t, nvmlGpuInstanceInfo_t,
    nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_v2_t, nvmlGpuInstance_t, NvmlLib,
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, NVML_GPU_INSTANCE_PROFILE_COUNT,
};

/// Compute instance profile indices (NVML_COMPUTE_INSTANCE_PROFILE_*).
const CI_PROFILE_COUNT: u32 = 8;
/// Most GPU instances of one profile on a GPU.
const MAX_INSTANCES: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("GPU is not in MIG mode")]
    NotMig,
    #[error("profile {0:?} is not one this GPU offers (it offers: {1})")]
    UnknownProfile(String, String),
    #[error("{what}: {source}")]
    Nvml {
        what: String,
        #[source]
        source: NvmlError,
    },
    /// A change that an earlier agent process did not finish.
    #[error("the change was interrupted (the agent stopped part way)")]
    Interrupted,
    /// The change failed and the layout found at the start is back.
    #[error("{cause}; the previous layout was put back")]
    RolledBack { cause: Box<LayoutError> },
    /// The change failed and so did putting the old layout back: the GPU
    /// holds what NVML reports now (read it again).
    #[error("{cause}; putting the previous layout back failed too: {rollback}")]
    RollbackFailed {
        cause: Box<LayoutError>,
        rollback: Box<LayoutError>,
    },
}

fn nvml_err(what: impl Into<String>) -> impl FnOnce(NvmlError) -> LayoutError {
    let what = what.into();
    move |source| LayoutError::Nvml { what, source }
}

/// A GPU instance profile the GPU offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GiProfile {
    /// NVML's profile id (what the instance calls take).
    pub id: u32,
    /// `1g.5gb`.
    pub name: String,
    pub slices: u32,
    pub memory_mib: u64,
    /// Most instances of it on an empty GPU.
    pub max_count: u32,
}

/// A GPU instance as found: its profile and placement.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Placed {
    pub profile: String,
    pub start: u32,
    pub size: u32,
}

/// NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 2).
pub(crate) const PROFILE_INFO_V2: u32 =
    (std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as u32) | (2 << 24);

/// A profile's name from its slices and memory when NVML gives none:
/// `<slices>g.<GiB, rounded up>gb`, as NVIDIA names them (4864 MiB is
/// `1g.5gb`, 19968 MiB `3g.20gb`).
pub fn profile_name(slices: u32, memory_mib: u64) -> String {
    format!("{slices}g.{}gb", memory_mib.div_ceil(1024))
}

/// The GPU instance profiles `dev` offers, in NVML's profile order.
#[allow(unsafe_code)]
pub fn profiles(nvml: &Nvml, dev: &Device) -> Result<Vec<GiProfile>, LayoutError> {
    let lib = nvml.lib();
    let info_v2 = nvml_sym(lib.nvmlDeviceGetGpuInstanceProfileInfoV.as_ref())
        .map_err(nvml_err("GPU instance profiles"))?;
    let mut out: Vec<GiProfile> = Vec::new();
    for index in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
        // SAFETY: a zeroed v2 struct with its version set, as NVML asks;
        // the device handle is live for `dev`'s lifetime.
        let mut p: nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
        p.version = PROFILE_INFO_V2;
        // SAFETY: as above.
        if nvml_try(unsafe { info_v2(dev.handle(), index, &mut p) }).is_err() {
            continue;
        }
        let bytes: Vec<u8> = p.name.iter().map(|c| *c as u8).collect();
        let name = CStr::from_bytes_until_nul(&bytes)
            .ok()
            .and_then(|c| c.to_str().ok())
            .and_then(|n| n.trim().strip_prefix("MIG "))
            .map(str::to_string)
            .unwrap_or_else(|| profile_name(p.sliceCount, p.memorySizeMB));
        if !out.iter().any(|o| o.id == p.id) {
            out.push(GiProfile {
                id: p.id,
                name,
                slices: p.sliceCount,
                memory_mib: p.memorySizeMB,
                max_count: p.instanceCount,
            });
        }
    }
    Ok(out)
}

/// One GPU instance found on the GPU.
struct Found {
    handle: nvmlGpuInstance_t,
    placed: Placed,
}

/// The GPU instances on `dev`, by profile.
#[allow(unsafe_code)]
fn instances(
    lib: &NvmlLib,
    dev: &Device,
    profiles: &[GiProfile],
) -> Result<Vec<Found>, LayoutError> {
    let list =
        nvml_sym(lib.nvmlDeviceGetGpuInstances.as_ref()).map_err(nvml_err("list GPU instances"))?;
    let info =
        nvml_sym(lib.nvmlGpuInstanceGetInfo.as_ref()).map_err(nvml_err("GPU instance info"))?;
    let mut out = Vec::new();
    for p in profiles {
        let mut handles: [nvmlGpuInstance_t; MAX_INSTANCES] = [std::ptr::null_mut(); MAX_INSTANCES];
        let mut count = MAX_INSTANCES as u32;
        // SAFETY: `handles` has room for `count` handles, NVML writes at
        // most that many and sets `count`.
        nvml_try(unsafe { list(dev.handle(), p.id, handles.as_mut_ptr(), &mut count) })
            .map_err(nvml_err(format!("list {} instances", p.name)))?;
        for h in handles.iter().take((count as usize).min(MAX_INSTANCES)) {
            // SAFETY: a handle NVML just gave; the struct is plain data.
            let mut i: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            nvml_try(unsafe { info(*h, &mut i) }).map_err(nvml_err("GPU instance info"))?;
            out.push(Found {
                handle: *h,
                placed: Placed {
                    profile: p.name.clone(),
                    start: i.placement.start,
                    size: i.placement.size,
                },
            });
        }
    }
    out.sort_by_key(|f| f.placed.start);
    Ok(out)
}

/// The layout of `dev` now: its GPU instances by placement.
pub fn layout(nvml: &Nvml, dev: &Device) -> Result<Vec<Placed>, LayoutError> {
    let profiles = profiles(nvml, dev)?;
    Ok(instances(nvml.lib(), dev, &profiles)?
        .into_iter()
        .map(|f| f.placed)
        .collect())
}

/// Makes `dev` hold exactly the MIG devices of `wanted` (profile names,
/// any order; empty: none), all or nothing. A GPU already holding them
/// (in any placement) is left alone.
pub fn set_layout(nvml: &Nvml, dev: &Device, wanted: &[String]) -> Result<(), LayoutError> {
    match dev.mig_mode() {
        Ok(m) if m.current != 0 => {}
        Ok(_) | Err(NvmlError::NotSupported) => return Err(LayoutError::NotMig),
        Err(e) => return Err(nvml_err("MIG mode")(e)),
    }
    let profiles = profiles(nvml, dev)?;
    let mut want: Vec<&GiProfile> = Vec::with_capacity(wanted.len());
    for name in wanted {
        let p = profiles.iter().find(|p| &p.name == name).ok_or_else(|| {
            let offered: Vec<&str> = profiles.iter().map(|p| p.name.as_str()).collect();
            LayoutError::UnknownProfile(name.clone(), offered.join(", "))
        })?;
        want.push(p);
    }
    // Largest first: NVML places each where it fits, and big profiles have
    // the fewest places.
    want.sort_by_key(|p| std::cmp::Reverse(p.slices));
    let lib = nvml.lib();
    let before = instances(lib, dev, &profiles)?;
    let mut have: Vec<&str> = before.iter().map(|f| f.placed.profile.as_str()).collect();
    let mut asked: Vec<&str> = want.iter().map(|p| p.name.as_str()).collect();
    have.sort_unstable();
    asked.sort_unstable();
    if have == asked {
        return Ok(());
    }
    let old: Vec<Placed> = before.iter().map(|f| f.placed.clone()).collect();
    let result = before
        .iter()
        .try_for_each(|f| destroy(lib, f))
        .and_then(|()| want.iter().try_for_each(|p| create(lib, dev, p, None)));
    match result {
        Ok(()) => Ok(()),
        Err(cause) => Err(roll_back(lib, dev, &profiles, &old, cause)),
    }
}

/// Puts `old` (a [`layout`] read earlier) back on `dev`: what is not in it
/// is destroyed, what is missing created at its placement. For an agent
/// that was killed part way through a change.
pub fn restore(nvml: &Nvml, dev: &Device, old: &[Placed]) -> Result<(), LayoutError> {
    let profiles = profiles(nvml, dev)?;
    let cause = LayoutError::Interrupted;
    match roll_back(nvml.lib(), dev, &profiles, old, cause) {
        LayoutError::RolledBack { .. } => Ok(()),
        LayoutError::RollbackFailed { rollback, .. } => Err(*rollback),
        other => Err(other),
    }
}

/// Destroys whatever is on `dev` now and recreates `old` at its
/// placements.
fn roll_back(
    lib: &NvmlLib,
    dev: &Device,
    profiles: &[GiProfile],
    old: &[Placed],
    cause: LayoutError,
) -> LayoutError {
    let restore = || -> Result<(), LayoutError> {
        for f in instances(lib, dev, profiles)? {
            if !old.contains(&f.placed) {
                destroy(lib, &f)?;
            }
        }
        let now: Vec<Placed> = instances(lib, dev, profiles)?
            .into_iter()
            .map(|f| f.placed)
            .collect();
        for p in old.iter().filter(|p| !now.contains(p)) {
            let profile = profiles
                .iter()
                .find(|g| g.name == p.profile)
                .ok_or_else(|| LayoutError::UnknownProfile(p.profile.clone(), String::new()))?;
            create(lib, dev, profile, Some(p))?;
        }
        Ok(())
    };
    match restore() {
        Ok(()) => LayoutError::RolledBack {
            cause: Box::new(cause),
        },
        Err(rollback) => LayoutError::RollbackFailed {
            cause: Box::new(cause),
            rollback: Box::new(rollback),
        },
    }
}

/// The compute instance profiles of a GPU instance, with their ids and
/// slice counts.
#[allow(unsafe_code)]
fn ci_profiles(lib: &NvmlLib, gi: nvmlGpuInstance_t) -> Result<Vec<(u32, u32)>, LayoutError> {
    let info = nvml_sym(lib.nvmlGpuInstanceGetComputeInstanceProfileInfo.as_ref())
        .map_err(nvml_err("compute instance profiles"))?;
    let mut out = Vec::new();
    for index in 0..CI_PROFILE_COUNT {
        // SAFETY: plain data NVML fills; the handle is live.
        let mut p: nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let r = unsafe {
            info(
                gi,
                index,
                NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                &mut p,
            )
        };
        if nvml_try(r).is_ok() {
            out.push((p.id, p.sliceCount));
        }
    }
    Ok(out)
}

/// Destroys a GPU instance's compute instances, then the instance.
#[allow(unsafe_code)]
fn destroy(lib: &NvmlLib, f: &Found) -> Result<(), LayoutError> {
    let list = nvml_sym(lib.nvmlGpuInstanceGetComputeInstances.as_ref())
        .map_err(nvml_err("list compute instances"))?;
    let ci_destroy = nvml_sym(lib.nvmlComputeInstanceDestroy.as_ref())
        .map_err(nvml_err("destroy a compute instance"))?;
    let gi_destroy = nvml_sym(lib.nvmlGpuInstanceDestroy.as_ref())
        .map_err(nvml_err("destroy a GPU instance"))?;
    let what = format!("{} at slice {}", f.placed.profile, f.placed.start);
    for (id, _) in ci_profiles(lib, f.handle)? {
        let mut cis: [nvmlComputeInstance_t; MAX_INSTANCES] = [std::ptr::null_mut(); MAX_INSTANCES];
        let mut count = MAX_INSTANCES as u32;
        // SAFETY: room for `count` handles; NVML sets `count`.
        nvml_try(unsafe { list(f.handle, id, cis.as_mut_ptr(), &mut count) })
            .map_err(nvml_err(format!("list the compute instances of {what}")))?;
        for ci in cis.iter().take((count as usize).min(MAX_INSTANCES)) {
            // SAFETY: a handle NVML just gave.
            nvml_try(unsafe { ci_destroy(*ci) })
                .map_err(nvml_err(format!("destroy the compute instance of {what}")))?;
        }
    }
    // SAFETY: a handle NVML gave; not used after this.
    nvml_try(unsafe { gi_destroy(f.handle) }).map_err(nvml_err(format!("destroy {what}")))
}

/// Creates a GPU instance of `profile` (at `at`, or where NVML places
/// it) and the compute instance spanning it.
#[allow(unsafe_code)]
fn create(
    lib: &NvmlLib,
    dev: &Device,
    profile: &GiProfile,
    at: Option<&Placed>,
) -> Result<(), LayoutError> {
    let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
    let what = format!("create {}", profile.name);
    match at {
        None => {
            let f = nvml_sym(lib.nvmlDeviceCreateGpuInstance.as_ref()).map_err(nvml_err(&what))?;
            // SAFETY: the device handle is live; NVML writes one handle.
            nvml_try(unsafe { f(dev.handle(), profile.id, &mut gi) }).map_err(nvml_err(&what))?;
        }
        Some(p) => {
            let f = nvml_sym(lib.nvmlDeviceCreateGpuInstanceWithPlacement.as_ref())
                .map_err(nvml_err(&what))?;
            let placement = nvmlGpuInstancePlacement_t {
                start: p.start,
                size: p.size,
            };
            // SAFETY: as above; `placement` outlives the call.
            nvml_try(unsafe { f(dev.handle(), profile.id, &placement, &mut gi) })
                .map_err(nvml_err(format!("{what} at slice {}", p.start)))?;
        }
    }
    let ci = ci_profiles(lib, gi)?
        .into_iter()
        .find(|(_, slices)| *slices == profile.slices)
        .map(|(id, _)| id);
    let create_ci = nvml_sym(lib.nvmlGpuInstanceCreateComputeInstance.as_ref())
        .map_err(nvml_err("create a compute instance"))?;
    let made = match ci {
        Some(id) => {
            let mut handle: nvmlComputeInstance_t = std::ptr::null_mut();
            // SAFETY: a GPU instance handle NVML just gave.
            nvml_try(unsafe { create_ci(gi, id, &mut handle) })
        }
        None => Err(NvmlError::NotSupported),
    };
    if let Err(e) = made {
        // No GPU instance left behind without its compute instance.
        if let Ok(d) = nvml_sym(lib.nvmlGpuInstanceDestroy.as_ref()) {
            // SAFETY: the handle NVML gave above; not used after this.
            let _ = unsafe { d(gi) };
        }
        return Err(nvml_err(format!(
            "create the compute instance of {}",
            profile.name
        ))(e));
    }
    Ok(())
}
