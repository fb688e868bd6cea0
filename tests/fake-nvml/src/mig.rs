//! MIG: mode, MIG device handles, GPU instance profiles and placements,
//! GPU and compute instances. (nvmlDeviceGetMigMode and the MIG-aware
//! UUID/name/memory queries are in `exports.rs`.)
//!
//! The layout lives in each GPU's `mig` object in the config; the calls that
//! change it (set mode, create, destroy) write the file back through
//! `state::transact`, so it persists across calls and processes. Each GPU
//! instance has at most one compute instance, spanning the whole GPU
//! instance; an instance with a compute instance is a MIG device.
//!
//! Error choices (see the README): MIG disabled: NOT_SUPPORTED; a model
//! without a profile table: NOT_SUPPORTED; unknown profile id or bad
//! placement size: INVALID_ARGUMENT; no room or a start that is not free:
//! INSUFFICIENT_RESOURCES; destroying what is in use: IN_USE; a GPU/compute
//! instance handle whose instance is gone: INVALID_ARGUMENT.
//!
//! # Safety (every function here)
//!
//! As in `exports.rs`: pointer arguments are null or valid for NVML's use;
//! arrays of GPU/compute instances hold the profile's `instanceCount`
//! entries (the NVML contract: `count` is only an output there).

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::os::raw::{c_char, c_uint};

use crate::config::{self, Config, Gpu, GpuInstance, Mig};
use crate::ffi::*;
use crate::profiles::{self, Profile, Table};
use crate::state::{self, gpu_at, guard, in_value, out, out_array, Dev, Res};

// ----- helpers -----

/// A GPU (not MIG device) handle of a MIG-capable model: (index, GPU, table).
/// No table: NOT_SUPPORTED; a MIG device handle: NOT_SUPPORTED.
fn mig_gpu<'c>(
    cfg: &'c Config,
    device: nvmlDevice_t,
    func: &str,
) -> Res<(usize, &'c Gpu, &'static Table)> {
    let (i, gpu) = state::device(cfg, device, func)?;
    let table = gpu.mig.table.ok_or(NVML_ERROR_NOT_SUPPORTED)?;
    Ok((i, gpu, table))
}

/// As [`mig_gpu`], and MIG mode must be on (else NOT_SUPPORTED).
fn mig_on<'c>(
    cfg: &'c Config,
    device: nvmlDevice_t,
    func: &str,
) -> Res<(usize, &'c Gpu, &'static Table)> {
    let r = mig_gpu(cfg, device, func)?;
    if !r.1.mig.mode {
        return Err(NVML_ERROR_NOT_SUPPORTED);
    }
    Ok(r)
}

/// A profile by NVML profile id (what create/placements take).
fn profile_by_id(table: &Table, id: c_uint) -> Res<&'static Profile> {
    table.by_id(id).ok_or(NVML_ERROR_INVALID_ARGUMENT)
}

/// The GPU instance behind `gi`: (GPU index, GPU, instance). Not a GPU
/// instance handle, or its instance is gone: INVALID_ARGUMENT.
fn gi_at<'c>(
    cfg: &'c Config,
    gi: nvmlGpuInstance_t,
    func: &str,
) -> Res<(usize, &'c Gpu, &'c GpuInstance)> {
    let (g, id) = state::gi_of(gi)?;
    let gpu = gpu_at(cfg, g, func, false)?;
    let inst = gpu
        .mig
        .instances
        .iter()
        .find(|i| i.gi_id == id)
        .filter(|_| gpu.mig.mode)
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    Ok((g, gpu, inst))
}

/// The compute instance behind `ci`: (GPU index, GPU, its GPU instance).
fn ci_at<'c>(
    cfg: &'c Config,
    ci: nvmlComputeInstance_t,
    func: &str,
) -> Res<(usize, &'c Gpu, &'c GpuInstance)> {
    let (g, gi, id) = state::ci_of(ci)?;
    let gpu = gpu_at(cfg, g, func, false)?;
    let inst = gpu
        .mig
        .instances
        .iter()
        .find(|i| i.gi_id == gi && i.ci_id == Some(id))
        .filter(|_| gpu.mig.mode)
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    Ok((g, gpu, inst))
}

/// Writes GPU `index`'s new MIG state into the raw config.
fn persist(root: &mut serde_json::Value, index: usize, mig: &Mig) -> Res<()> {
    let gpu = root
        .get_mut("gpus")
        .and_then(|g| g.get_mut(index))
        .ok_or(NVML_ERROR_UNKNOWN)?;
    config::write_mig(gpu, mig).map_err(|e| {
        eprintln!("fake-nvml: cannot write the MIG layout back: {e}");
        NVML_ERROR_UNKNOWN
    })
}

/// "MIG 1g.5gb" in a fixed NVML name buffer.
fn name_field(profile: &Profile) -> [c_char; 96] {
    let mut buf = [0 as c_char; 96];
    for (d, s) in buf[..95]
        .iter_mut()
        .zip(format!("MIG {}", profile.name).bytes())
    {
        *d = s as c_char;
    }
    buf
}

/// How many more instances of `profile` fit (first free start each time).
fn remaining(mig: &Mig, profile: &'static Profile) -> u32 {
    let mut m = mig.clone();
    let mut n = 0;
    while let Some(start) = first_fit(&m, profile) {
        m.instances.push(new_instance(profile, start, 0, ""));
        n += 1;
    }
    n
}

/// The lowest start where `profile` fits now, respecting its instance count.
fn first_fit(mig: &Mig, profile: &Profile) -> Option<u32> {
    let existing = mig
        .instances
        .iter()
        .filter(|i| std::ptr::eq(i.profile, profile))
        .count();
    if existing >= profile.instance_count as usize {
        return None;
    }
    profile
        .starts
        .iter()
        .copied()
        .find(|s| mig.fits(profile, *s))
}

fn new_instance(profile: &'static Profile, start: u32, gi_id: u32, parent: &str) -> GpuInstance {
    GpuInstance {
        profile,
        start,
        gi_id,
        ci_id: None,
        uuid: config::derived_mig_uuid(parent, gi_id),
        memory_used_mib: 0,
        busy: false,
        file_pos: None,
    }
}

/// Creates a GPU instance of profile id `profile_id` at `start` (None: the
/// first free placement) on `device`, writes it back, returns its handle.
/// `FAKE_NVML_MIG_DELAY_MS`: each GPU instance create and destroy takes
/// this long, so that a test can kill the caller part way through a
/// layout change (each step is written to the config file at once).
pub const MIG_DELAY_ENV: &str = "FAKE_NVML_MIG_DELAY_MS";

fn mig_delay() {
    if let Some(ms) = std::env::var(MIG_DELAY_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

fn create_gi(
    func: &str,
    device: nvmlDevice_t,
    profile_id: c_uint,
    start: Option<nvmlGpuInstancePlacement_t>,
) -> Res<nvmlGpuInstance_t> {
    mig_delay();
    state::transact(|cfg, root| {
        let (g, gpu, table) = mig_on(cfg, device, func)?;
        let profile = profile_by_id(table, profile_id)?;
        let start = match start {
            Some(p) => {
                if p.size != profile.mem_slices {
                    return Err(NVML_ERROR_INVALID_ARGUMENT);
                }
                let existing = gpu
                    .mig
                    .instances
                    .iter()
                    .filter(|i| std::ptr::eq(i.profile, profile))
                    .count();
                if existing >= profile.instance_count as usize || !gpu.mig.fits(profile, p.start) {
                    return Err(NVML_ERROR_INSUFFICIENT_RESOURCES);
                }
                p.start
            }
            None => first_fit(&gpu.mig, profile).ok_or(NVML_ERROR_INSUFFICIENT_RESOURCES)?,
        };
        let id = gpu
            .mig
            .free_gi_id()
            .ok_or(NVML_ERROR_INSUFFICIENT_RESOURCES)?;
        let mut mig = gpu.mig.clone();
        mig.instances
            .push(new_instance(profile, start, id, &gpu.uuid));
        persist(root, g, &mig)?;
        Ok(state::gi_handle(g, id))
    })
}

/// Checks a compute instance profile index for GPU instance `inst`: past
/// NVML's profiles: INVALID_ARGUMENT; not the one spanning the whole GPU
/// instance (the only one modelled): NOT_SUPPORTED.
fn check_ci_profile(inst: &GpuInstance, profile: c_uint) -> Res<()> {
    if profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if profile != profiles::full_ci_profile(inst.profile.slices) {
        return Err(NVML_ERROR_NOT_SUPPORTED);
    }
    Ok(())
}

fn check_gi_profile_index(table: &Table, profile: c_uint) -> Res<&'static Profile> {
    if profile >= NVML_GPU_INSTANCE_PROFILE_COUNT {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    table.by_index(profile).ok_or(NVML_ERROR_NOT_SUPPORTED)
}

// ----- mode and MIG device handles -----

/// Sets the pending mode. It applies at once (activationStatus SUCCESS) when
/// it is already the current mode or the GPU's `needs_reset` is false;
/// otherwise it stays pending (activationStatus RESET_REQUIRED) until a test
/// writes `mig.mode`. Leaving MIG mode while GPU instances exist: IN_USE.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceSetMigMode(
    device: nvmlDevice_t,
    mode: c_uint,
    activationStatus: *mut nvmlReturn_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceSetMigMode";
    guard(NAME, || {
        let status = unsafe { out(activationStatus) }?;
        let r = state::transact(|cfg, root| {
            let (g, gpu, _) = mig_gpu(cfg, device, NAME)?;
            let want = match mode {
                NVML_DEVICE_MIG_ENABLE => true,
                NVML_DEVICE_MIG_DISABLE => false,
                _ => return Err(NVML_ERROR_INVALID_ARGUMENT),
            };
            let mut mig = gpu.mig.clone();
            if want != mig.mode && !mig.instances.is_empty() {
                return Err(NVML_ERROR_IN_USE);
            }
            mig.pending = want;
            let r = if mig.mode == want {
                NVML_SUCCESS
            } else if !mig.needs_reset {
                mig.mode = want;
                NVML_SUCCESS
            } else {
                NVML_ERROR_RESET_REQUIRED
            };
            persist(root, g, &mig)?;
            Ok(r)
        })?;
        status.set(r);
        Ok(())
    })
}

/// 7 on a MIG-capable GPU in MIG mode; 0 otherwise (as NVML documents).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetMaxMigDeviceCount";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(count) }?;
        let (_, gpu) = state::device(&cfg, device, NAME)?;
        let on = gpu.mig.table.is_some() && gpu.mig.mode;
        out.set(if on { profiles::MAX_MIG_DEVICES } else { 0 });
        Ok(())
    })
}

/// The index-th MIG device (GPU instances with a compute instance, by GPU
/// instance id). index >= 7: INVALID_ARGUMENT; no such device (or MIG
/// mode off): NOT_FOUND; no MIG: NOT_SUPPORTED.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    migDevice: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetMigDeviceHandleByIndex";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(migDevice) }?;
        let (g, gpu, _) = mig_gpu(&cfg, device, NAME)?;
        if index >= profiles::MAX_MIG_DEVICES {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        if !gpu.mig.mode {
            return Err(NVML_ERROR_NOT_FOUND);
        }
        let devices = gpu.mig.devices();
        let inst = devices.get(index as usize).ok_or(NVML_ERROR_NOT_FOUND)?;
        out.set(state::mig_handle(g, inst.gi_id, inst.ci_id.unwrap_or(0)));
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    isMigDevice: *mut c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceIsMigDeviceHandle";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(isMigDevice) }?;
        let is = matches!(state::any_device(&cfg, device, NAME, false)?, Dev::Mig(..));
        out.set(c_uint::from(is));
        Ok(())
    })
}

/// The parent GPU of a MIG device; a GPU handle: INVALID_ARGUMENT.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    migDevice: nvmlDevice_t,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetDeviceHandleFromMigDeviceHandle";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(device) }?;
        match state::any_device(&cfg, migDevice, NAME, false)? {
            Dev::Mig(g, _, _) => {
                out.set(state::handle_for(g));
                Ok(())
            }
            Dev::Gpu(..) => Err(NVML_ERROR_INVALID_ARGUMENT),
        }
    })
}

/// A MIG device's attributes (its profile; one compute instance spanning
/// the GPU instance). A GPU handle: NOT_SUPPORTED (not modelled).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: nvmlDevice_t,
    attributes: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetAttributes_v2";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(attributes) }?;
        let Dev::Mig(_, _, inst) = state::any_device(&cfg, device, NAME, false)? else {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        };
        let p = inst.profile;
        out.set(nvmlDeviceAttributes_t {
            multiprocessorCount: p.sms,
            sharedCopyEngineCount: p.copy_engines,
            sharedDecoderCount: p.decoders,
            sharedEncoderCount: p.encoders,
            sharedJpegCount: p.jpegs,
            sharedOfaCount: p.ofas,
            gpuInstanceSliceCount: p.slices,
            computeInstanceSliceCount: p.slices,
            memorySizeMB: p.memory_mib,
        });
        Ok(())
    })
}

/// A MIG device's GPU instance id; a GPU handle: NOT_SUPPORTED.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetGpuInstanceId";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(id) }?;
        match state::any_device(&cfg, device, NAME, false)? {
            Dev::Mig(_, _, inst) => {
                out.set(inst.gi_id);
                Ok(())
            }
            Dev::Gpu(..) => Err(NVML_ERROR_NOT_SUPPORTED),
        }
    })
}

/// A MIG device's compute instance id; a GPU handle: NOT_SUPPORTED.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetComputeInstanceId";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(id) }?;
        match state::any_device(&cfg, device, NAME, false)? {
            Dev::Mig(_, _, inst) => {
                out.set(inst.ci_id.unwrap_or(0));
                Ok(())
            }
            Dev::Gpu(..) => Err(NVML_ERROR_NOT_SUPPORTED),
        }
    })
}

// ----- GPU instance profiles and placements -----

/// `profile` is an NVML_GPU_INSTANCE_PROFILE_* index (not the id): past
/// them: INVALID_ARGUMENT; one this model lacks: NOT_SUPPORTED. Needs no
/// MIG mode.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetGpuInstanceProfileInfo";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(info) }?;
        let (_, _, table) = mig_gpu(&cfg, device, NAME)?;
        let p = check_gi_profile_index(table, profile)?;
        out.set(nvmlGpuInstanceProfileInfo_t {
            id: p.id,
            isP2pSupported: 0,
            sliceCount: p.slices,
            instanceCount: p.instance_count,
            multiprocessorCount: p.sms,
            copyEngineCount: p.copy_engines,
            decoderCount: p.decoders,
            encoderCount: p.encoders,
            jpegCount: p.jpegs,
            ofaCount: p.ofas,
            memorySizeMB: p.memory_mib,
        });
        Ok(())
    })
}

/// As [`nvmlDeviceGetGpuInstanceProfileInfo`], with the name ("MIG
/// 1g.5gb"). `info->version` must be nvmlGpuInstanceProfileInfo_v2 or _v3
/// (then the v3 layout is written, capabilities 0); else
/// ARGUMENT_VERSION_MISMATCH.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetGpuInstanceProfileInfoV";
    guard(NAME, || {
        let cfg = state::session()?;
        let out2 = unsafe { out(info) }?;
        let version = out2.get().version;
        if version != nvmlGpuInstanceProfileInfo_v2 && version != nvmlGpuInstanceProfileInfo_v3 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let (_, _, table) = mig_gpu(&cfg, device, NAME)?;
        let p = check_gi_profile_index(table, profile)?;
        if version == nvmlGpuInstanceProfileInfo_v3 {
            // The caller's struct is a v3 one (same size, other layout).
            let out3 = unsafe { out(info.cast::<nvmlGpuInstanceProfileInfo_v3_t>()) }?;
            out3.set(nvmlGpuInstanceProfileInfo_v3_t {
                version,
                id: p.id,
                sliceCount: p.slices,
                instanceCount: p.instance_count,
                multiprocessorCount: p.sms,
                copyEngineCount: p.copy_engines,
                decoderCount: p.decoders,
                encoderCount: p.encoders,
                jpegCount: p.jpegs,
                ofaCount: p.ofas,
                memorySizeMB: p.memory_mib,
                name: name_field(p),
                capabilities: 0,
            });
            return Ok(());
        }
        out2.set(nvmlGpuInstanceProfileInfo_v2_t {
            version,
            id: p.id,
            isP2pSupported: 0,
            sliceCount: p.slices,
            instanceCount: p.instance_count,
            multiprocessorCount: p.sms,
            copyEngineCount: p.copy_engines,
            decoderCount: p.decoders,
            encoderCount: p.encoders,
            jpegCount: p.jpegs,
            ofaCount: p.ofas,
            memorySizeMB: p.memory_mib,
            name: name_field(p),
        });
        Ok(())
    })
}

/// Every placement of profile id `profileId`, whatever exists already and
/// whatever the mode. `placements` null: just the count; `*count` too
/// small: INSUFFICIENT_SIZE with `*count` set to the number needed.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: nvmlDevice_t,
    profileId: c_uint,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetGpuInstancePossiblePlacements_v2";
    guard(NAME, || {
        let cfg = state::session()?;
        let count = unsafe { out(count) }?;
        let (_, _, table) = mig_gpu(&cfg, device, NAME)?;
        let p = profile_by_id(table, profileId)?;
        let all: Vec<nvmlGpuInstancePlacement_t> = p
            .starts
            .iter()
            .map(|&start| nvmlGpuInstancePlacement_t {
                start,
                size: p.mem_slices,
            })
            .collect();
        let n = all.len() as c_uint;
        if placements.is_null() {
            count.set(n);
            return Ok(());
        }
        let room = count.get();
        if room < n {
            count.set(n);
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        unsafe { out_array(placements, room) }?.write(&all)?;
        count.set(n);
        Ok(())
    })
}

/// How many more GPU instances of profile id `profileId` fit next to the
/// existing ones (placements, memory and compute slices, instance count).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceRemainingCapacity(
    device: nvmlDevice_t,
    profileId: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetGpuInstanceRemainingCapacity";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(count) }?;
        let (_, gpu, table) = mig_on(&cfg, device, NAME)?;
        let p = profile_by_id(table, profileId)?;
        out.set(remaining(&gpu.mig, p));
        Ok(())
    })
}

// ----- GPU instances -----

/// At the first free placement, without a compute instance; written back.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstance(
    device: nvmlDevice_t,
    profileId: c_uint,
    gpuInstance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceCreateGpuInstance";
    guard(NAME, || {
        let out = unsafe { out(gpuInstance) }?;
        out.set(create_gi(NAME, device, profileId, None)?);
        Ok(())
    })
}

/// At `placement`: a size other than the profile's: INVALID_ARGUMENT; a
/// start that is not one of its placements or not free:
/// INSUFFICIENT_RESOURCES.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: nvmlDevice_t,
    profileId: c_uint,
    placement: *const nvmlGpuInstancePlacement_t,
    gpuInstance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceCreateGpuInstanceWithPlacement";
    guard(NAME, || {
        let placement = unsafe { in_value(placement) }?;
        let out = unsafe { out(gpuInstance) }?;
        out.set(create_gi(NAME, device, profileId, Some(placement))?);
        Ok(())
    })
}

/// The GPU instances of profile id `profileId`, by id. `gpuInstances` must
/// hold the profile's instanceCount handles; `*count` is set.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    device: nvmlDevice_t,
    profileId: c_uint,
    gpuInstances: *mut nvmlGpuInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetGpuInstances";
    guard(NAME, || {
        let cfg = state::session()?;
        let count = unsafe { out(count) }?;
        let (g, gpu, table) = mig_on(&cfg, device, NAME)?;
        let p = profile_by_id(table, profileId)?;
        let array = unsafe { out_array(gpuInstances, p.instance_count) }?;
        let mut ids: Vec<u32> = gpu
            .mig
            .instances
            .iter()
            .filter(|i| std::ptr::eq(i.profile, p))
            .map(|i| i.gi_id)
            .collect();
        ids.sort_unstable();
        let handles: Vec<nvmlGpuInstance_t> =
            ids.iter().map(|id| state::gi_handle(g, *id)).collect();
        array.write(&handles)?;
        count.set(handles.len() as c_uint);
        Ok(())
    })
}

/// Unknown id: NOT_FOUND.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: nvmlDevice_t,
    id: c_uint,
    gpuInstance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetGpuInstanceById";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(gpuInstance) }?;
        let (g, gpu, _) = mig_on(&cfg, device, NAME)?;
        if !gpu.mig.instances.iter().any(|i| i.gi_id == id) {
            return Err(NVML_ERROR_NOT_FOUND);
        }
        out.set(state::gi_handle(g, id));
        Ok(())
    })
}

/// Parent device, id, profile id, placement (start, size in memory slices).
#[no_mangle]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gpuInstance: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlGpuInstanceGetInfo";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(info) }?;
        let (g, _, inst) = gi_at(&cfg, gpuInstance, NAME)?;
        out.set(nvmlGpuInstanceInfo_t {
            device: state::handle_for(g),
            id: inst.gi_id,
            profileId: inst.profile.id,
            placement: nvmlGpuInstancePlacement_t {
                start: inst.start,
                size: inst.profile.mem_slices,
            },
        });
        Ok(())
    })
}

/// IN_USE while it has a compute instance or is `busy`; written back.
#[no_mangle]
pub unsafe extern "C" fn nvmlGpuInstanceDestroy(gpuInstance: nvmlGpuInstance_t) -> nvmlReturn_t {
    const NAME: &str = "nvmlGpuInstanceDestroy";
    guard(NAME, || {
        mig_delay();
        state::transact(|cfg, root| {
            let (g, gpu, inst) = gi_at(cfg, gpuInstance, NAME)?;
            if inst.ci_id.is_some() || inst.busy {
                return Err(NVML_ERROR_IN_USE);
            }
            let mut mig = gpu.mig.clone();
            mig.instances.retain(|i| i.gi_id != inst.gi_id);
            persist(root, g, &mig)
        })
    })
}

// ----- compute instances -----

fn ci_profile_info(inst: &GpuInstance, profile: c_uint) -> nvmlComputeInstanceProfileInfo_t {
    let p = inst.profile;
    nvmlComputeInstanceProfileInfo_t {
        id: profile,
        sliceCount: p.slices,
        instanceCount: 1,
        multiprocessorCount: p.sms,
        sharedCopyEngineCount: p.copy_engines,
        sharedDecoderCount: p.decoders,
        sharedEncoderCount: p.encoders,
        sharedJpegCount: p.jpegs,
        sharedOfaCount: p.ofas,
    }
}

/// Only the compute instance profile spanning the whole GPU instance
/// (NVML_COMPUTE_INSTANCE_PROFILE_<slices>_SLICE) exists here; other
/// profiles: NOT_SUPPORTED; past NVML's: INVALID_ARGUMENT. `engProfile`
/// must be SHARED (else INVALID_ARGUMENT).
#[no_mangle]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gpuInstance: nvmlGpuInstance_t,
    profile: c_uint,
    engProfile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlGpuInstanceGetComputeInstanceProfileInfo";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(info) }?;
        let (_, _, inst) = gi_at(&cfg, gpuInstance, NAME)?;
        if engProfile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        check_ci_profile(inst, profile)?;
        out.set(ci_profile_info(inst, profile));
        Ok(())
    })
}

/// As above with the name ("MIG 3g.20gb"); version v2 or v3, else
/// ARGUMENT_VERSION_MISMATCH.
#[no_mangle]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    gpuInstance: nvmlGpuInstance_t,
    profile: c_uint,
    engProfile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlGpuInstanceGetComputeInstanceProfileInfoV";
    guard(NAME, || {
        let cfg = state::session()?;
        let out2 = unsafe { out(info) }?;
        let version = out2.get().version;
        if version != nvmlComputeInstanceProfileInfo_v2
            && version != nvmlComputeInstanceProfileInfo_v3
        {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let (_, _, inst) = gi_at(&cfg, gpuInstance, NAME)?;
        if engProfile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        check_ci_profile(inst, profile)?;
        let i = ci_profile_info(inst, profile);
        let v2 = nvmlComputeInstanceProfileInfo_v2_t {
            version,
            id: i.id,
            sliceCount: i.sliceCount,
            instanceCount: i.instanceCount,
            multiprocessorCount: i.multiprocessorCount,
            sharedCopyEngineCount: i.sharedCopyEngineCount,
            sharedDecoderCount: i.sharedDecoderCount,
            sharedEncoderCount: i.sharedEncoderCount,
            sharedJpegCount: i.sharedJpegCount,
            sharedOfaCount: i.sharedOfaCount,
            name: name_field(inst.profile),
        };
        if version == nvmlComputeInstanceProfileInfo_v3 {
            // v3 is v2 plus a trailing `capabilities` word.
            let out3 = unsafe { out(info.cast::<nvmlComputeInstanceProfileInfo_v3_t>()) }?;
            out3.set(nvmlComputeInstanceProfileInfo_v3_t {
                version,
                id: v2.id,
                sliceCount: v2.sliceCount,
                instanceCount: v2.instanceCount,
                multiprocessorCount: v2.multiprocessorCount,
                sharedCopyEngineCount: v2.sharedCopyEngineCount,
                sharedDecoderCount: v2.sharedDecoderCount,
                sharedEncoderCount: v2.sharedEncoderCount,
                sharedJpegCount: v2.sharedJpegCount,
                sharedOfaCount: v2.sharedOfaCount,
                name: v2.name,
                capabilities: 0,
            });
            return Ok(());
        }
        out2.set(v2);
        Ok(())
    })
}

/// Creates the GPU instance's one compute instance (id 0); the MIG device
/// appears. One exists already: INSUFFICIENT_RESOURCES. Written back.
#[no_mangle]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gpuInstance: nvmlGpuInstance_t,
    profileId: c_uint,
    computeInstance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlGpuInstanceCreateComputeInstance";
    guard(NAME, || {
        let out = unsafe { out(computeInstance) }?;
        let h = state::transact(|cfg, root| {
            let (g, gpu, inst) = gi_at(cfg, gpuInstance, NAME)?;
            check_ci_profile(inst, profileId)?;
            if inst.ci_id.is_some() {
                return Err(NVML_ERROR_INSUFFICIENT_RESOURCES);
            }
            let mut mig = gpu.mig.clone();
            for i in mig.instances.iter_mut().filter(|i| i.gi_id == inst.gi_id) {
                i.ci_id = Some(0);
            }
            persist(root, g, &mig)?;
            Ok(state::ci_handle(g, inst.gi_id, 0))
        })?;
        out.set(h);
        Ok(())
    })
}

/// The compute instances of compute profile `profileId` (0 or 1). The
/// array must hold one handle; `*count` is set.
#[no_mangle]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gpuInstance: nvmlGpuInstance_t,
    profileId: c_uint,
    computeInstances: *mut nvmlComputeInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlGpuInstanceGetComputeInstances";
    guard(NAME, || {
        let cfg = state::session()?;
        let count = unsafe { out(count) }?;
        let array = unsafe { out_array(computeInstances, 1) }?;
        let (g, _, inst) = gi_at(&cfg, gpuInstance, NAME)?;
        check_ci_profile(inst, profileId)?;
        let handles: Vec<nvmlComputeInstance_t> = inst
            .ci_id
            .map(|ci| state::ci_handle(g, inst.gi_id, ci))
            .into_iter()
            .collect();
        array.write(&handles)?;
        count.set(handles.len() as c_uint);
        Ok(())
    })
}

/// Parent device, GPU instance, id, compute profile, placement (0, slices).
#[no_mangle]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    computeInstance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlComputeInstanceGetInfo_v2";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(info) }?;
        let (g, _, inst) = ci_at(&cfg, computeInstance, NAME)?;
        out.set(nvmlComputeInstanceInfo_t {
            device: state::handle_for(g),
            gpuInstance: state::gi_handle(g, inst.gi_id),
            id: inst.ci_id.unwrap_or(0),
            profileId: profiles::full_ci_profile(inst.profile.slices),
            placement: nvmlComputeInstancePlacement_t {
                start: 0,
                size: inst.profile.slices,
            },
        });
        Ok(())
    })
}

/// IN_USE while the instance is `busy`; the MIG device goes away. Written
/// back.
#[no_mangle]
pub unsafe extern "C" fn nvmlComputeInstanceDestroy(
    computeInstance: nvmlComputeInstance_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlComputeInstanceDestroy";
    guard(NAME, || {
        mig_delay();
        state::transact(|cfg, root| {
            let (g, gpu, inst) = ci_at(cfg, computeInstance, NAME)?;
            if inst.busy {
                return Err(NVML_ERROR_IN_USE);
            }
            let mut mig = gpu.mig.clone();
            for i in mig.instances.iter_mut().filter(|i| i.gi_id == inst.gi_id) {
                i.ci_id = None;
            }
            persist(root, g, &mig)
        })
    })
}
