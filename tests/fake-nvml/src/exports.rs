//! NVML's C entry points: init, system and per-device queries, NVLink,
//! topology and running processes. (Event sets are in `events.rs`.)
//!
//! Signatures match `nvml-wrapper-sys` 0.10 `bindings.rs` exactly.
//!
//! # Safety (every function here)
//!
//! The NVML contract: every pointer argument is null or valid for what NVML
//! documents (one element for out-parameters; `length` bytes for string
//! buffers; `cpuSetSize` elements for the CPU set; `*infoCount` elements
//! for process lists; NUL-terminated strings for inputs). Nulls are
//! answered with NVML_ERROR_INVALID_ARGUMENT. Device handles are tags and
//! are never dereferenced.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::os::raw::{c_char, c_int, c_uint, c_ulong, c_ulonglong};

use crate::config::BusId;
use crate::ffi::*;
use crate::state::{self, device_identity, gpu_at, guard, in_str, out, out_array, out_str, Dev};

const MIB: u64 = 1024 * 1024;

// ----- init and shutdown -----

fn init(name: &str) -> nvmlReturn_t {
    guard(name, || {
        let cfg = state::load_config()?;
        if let Some(e) = cfg.init_error {
            return Err(e.0);
        }
        state::acquire();
        Ok(())
    })
}

/// Succeeds (one more reference) unless the config is unreadable (UNKNOWN) or
/// sets `init_error`.
#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    init("nvmlInit_v2")
}

/// As [`nvmlInit_v2`]; the flags (NO_GPUS, NO_ATTACH) change nothing here:
/// a machine without GPUs initializes anyway.
#[no_mangle]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    init("nvmlInitWithFlags")
}

/// Drops one reference; UNINITIALIZED when there is none.
#[no_mangle]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    guard("nvmlShutdown", state::release)
}

/// A static message for every NVML code ("Unknown Error" for codes NVML
/// does not define). Needs no init.
#[no_mangle]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    RETURN_CODES
        .iter()
        .find(|(code, _, _)| *code == result)
        .map_or(c"Unknown Error", |(_, _, msg)| msg)
        .as_ptr()
}

// ----- system -----

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guard("nvmlSystemGetDriverVersion", || {
        let cfg = state::session()?;
        unsafe { out_str(version, length) }?.set_str(&cfg.driver_version)
    })
}

/// "<CUDA major>.<driver version>", as real NVML reports (e.g. "12.535.129.03").
#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guard("nvmlSystemGetNVMLVersion", || {
        let cfg = state::session()?;
        let v = format!("{}.{}", cfg.cuda_driver_version / 1000, cfg.driver_version);
        unsafe { out_str(version, length) }?.set_str(&v)
    })
}

/// # Safety
/// `out_version` is null or valid for one write.
unsafe fn cuda_driver_version(name: &str, out_version: *mut c_int) -> nvmlReturn_t {
    guard(name, || {
        let cfg = state::session()?;
        unsafe { out(out_version) }?.set(cfg.cuda_driver_version);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(
    cudaDriverVersion: *mut c_int,
) -> nvmlReturn_t {
    unsafe { cuda_driver_version("nvmlSystemGetCudaDriverVersion", cudaDriverVersion) }
}

/// What nvml-wrapper 0.13's `sys_cuda_driver_version` calls.
#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(
    cudaDriverVersion: *mut c_int,
) -> nvmlReturn_t {
    unsafe { cuda_driver_version("nvmlSystemGetCudaDriverVersion_v2", cudaDriverVersion) }
}

// ----- device handles -----

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(deviceCount: *mut c_uint) -> nvmlReturn_t {
    guard("nvmlDeviceGetCount_v2", || {
        let cfg = state::session()?;
        unsafe { out(deviceCount) }?.set(cfg.gpus.len() as c_uint);
        Ok(())
    })
}

/// Index past the end: INVALID_ARGUMENT. A `lost` GPU still gets a handle
/// (see [`nvmlDeviceGetUUID`]).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetHandleByIndex_v2";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(device) }?;
        let index = index as usize;
        if index >= cfg.gpus.len() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        gpu_at(&cfg, index, NAME, true)?;
        out.set(state::handle_for(index));
        Ok(())
    })
}

/// Unknown UUID: NOT_FOUND. A `lost` GPU is still found.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetHandleByUUID";
    guard(NAME, || {
        let cfg = state::session()?;
        let uuid = unsafe { in_str(uuid) }?;
        let out = unsafe { out(device) }?;
        let index = cfg
            .gpus
            .iter()
            .position(|g| g.uuid == uuid)
            .ok_or(NVML_ERROR_NOT_FOUND)?;
        gpu_at(&cfg, index, NAME, true)?;
        out.set(state::handle_for(index));
        Ok(())
    })
}

/// Accepts the 8- and 4-digit domain spellings, any case. Unparsable:
/// INVALID_ARGUMENT; no such GPU: NOT_FOUND; a `lost` GPU: GPU_IS_LOST.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    pciBusId: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetHandleByPciBusId_v2";
    guard(NAME, || {
        let cfg = state::session()?;
        let bus = unsafe { in_str(pciBusId) }?;
        let out = unsafe { out(device) }?;
        let bus = BusId::parse(bus.trim()).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        let index = cfg
            .gpus
            .iter()
            .position(|g| g.pci_bus_id == bus)
            .ok_or(NVML_ERROR_NOT_FOUND)?;
        gpu_at(&cfg, index, NAME, false)?;
        out.set(state::handle_for(index));
        Ok(())
    })
}

// ----- identity (readable when lost) -----
//
// A GPU marked `lost` answers GPU_IS_LOST to every per-device call except
// the handle lookups by index and UUID, nvmlDeviceGetUUID, nvmlDeviceGetIndex
// and nvmlDeviceGetPciInfo_v3. That is a choice: real NVML's answers for a
// fallen-off GPU vary by driver, and keeping the identity readable lets the
// agent report "GPU <uuid> at <bus id> is lost" (unhealthy, not hidden)
// instead of silently skipping it.

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    index: *mut c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetIndex";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(index) }?;
        let (i, _) = device_identity(&cfg, device, NAME)?;
        out.set(i as c_uint);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetUUID";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out_str(uuid, length) }?;
        match state::any_device(&cfg, device, NAME, true)? {
            Dev::Gpu(gpu) => out.set_str(&gpu.uuid),
            Dev::Mig(_, _, inst) => out.set_str(&inst.uuid),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetPciInfo_v3";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(pci) }?;
        let (_, gpu) = device_identity(&cfg, device, NAME)?;
        out.set(state::pci_info(&gpu.pci_bus_id, gpu.pci_device_id));
        Ok(())
    })
}

// ----- per-device queries -----

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetName";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out_str(name, length) }?;
        match state::any_device(&cfg, device, NAME, false)? {
            Dev::Gpu(gpu) => out.set_str(&gpu.name),
            Dev::Mig(_, gpu, inst) => {
                out.set_str(&format!("{} MIG {}", gpu.name, inst.profile.name))
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetSerial(
    device: nvmlDevice_t,
    serial: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetSerial";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out_str(serial, length) }?;
        let (_, gpu) = state::device(&cfg, device, NAME)?;
        out.set_str(&gpu.serial)
    })
}

/// (total, used) in bytes of a GPU or of a MIG device (its profile's
/// memory and the instance's `memory_used_mib`); used <= total.
fn memory_of(dev: Dev<'_>) -> (u64, u64) {
    let (total_mib, used_mib) = match dev {
        Dev::Gpu(gpu) => (gpu.memory_total_mib, gpu.memory_used_mib),
        Dev::Mig(_, _, inst) => (inst.profile.memory_mib, inst.memory_used_mib),
    };
    let total = total_mib * MIB;
    (total, (used_mib * MIB).min(total))
}

/// v1: total/free/used in bytes; free = total - used. A MIG device answers
/// for its instance.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetMemoryInfo";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(memory) }?;
        let (total, used) = memory_of(state::any_device(&cfg, device, NAME, false)?);
        out.set(nvmlMemory_t {
            total,
            free: total - used,
            used,
        });
        Ok(())
    })
}

/// What nvml-wrapper 0.13's `memory_info` calls. The caller must set
/// `version` to `nvmlMemory_v2` (sizeof | 2 << 24), as nvml-wrapper does;
/// anything else is ARGUMENT_VERSION_MISMATCH, as in real NVML. reserved = 0.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetMemoryInfo_v2";
    guard(NAME, || {
        let cfg = state::session()?;
        if memory.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null and valid for a read per the NVML contract; the
        // caller initialized `version` (NVML reads it too).
        let version = unsafe { std::ptr::addr_of!((*memory).version).read() };
        if version != nvmlMemory_v2 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let out = unsafe { out(memory) }?;
        let (total, used) = memory_of(state::any_device(&cfg, device, NAME, false)?);
        out.set(nvmlMemory_v2_t {
            version,
            total,
            reserved: 0,
            free: total - used,
            used,
        });
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minorNumber: *mut c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetMinorNumber";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(minorNumber) }?;
        let (_, gpu) = state::device(&cfg, device, NAME)?;
        out.set(gpu.minor);
        Ok(())
    })
}

/// Fills all `cpuSetSize` words: bit n of word w = CPU w * 64 + n. CPUs past
/// the array are left out (as real NVML does); size 0 is INSUFFICIENT_SIZE.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCpuAffinity(
    device: nvmlDevice_t,
    cpuSetSize: c_uint,
    cpuSet: *mut c_ulong,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetCpuAffinity";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out_array(cpuSet, cpuSetSize) }?;
        let (_, gpu) = state::device(&cfg, device, NAME)?;
        if out.len() == 0 {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        let bits = c_ulong::BITS as usize;
        let mut words: Vec<c_ulong> = vec![0; out.len()];
        for &cpu in &gpu.cpu_affinity {
            if let Some(w) = words.get_mut(cpu as usize / bits) {
                *w |= 1 << (cpu as usize % bits);
            }
        }
        out.write(&words)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNumaNodeId(
    device: nvmlDevice_t,
    node: *mut c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetNumaNodeId";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(node) }?;
        let (_, gpu) = state::device(&cfg, device, NAME)?;
        out.set(gpu.numa_node);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetCudaComputeCapability";
    guard(NAME, || {
        let cfg = state::session()?;
        let major = unsafe { out(major) }?;
        let minor = unsafe { out(minor) }?;
        let (_, gpu) = state::device(&cfg, device, NAME)?;
        major.set(gpu.compute_capability[0]);
        minor.set(gpu.compute_capability[1]);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetUtilizationRates";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(utilization) }?;
        let (_, gpu) = state::device(&cfg, device, NAME)?;
        out.set(nvmlUtilization_t {
            gpu: gpu.utilization_gpu_pct,
            memory: gpu.utilization_memory_pct,
        });
        Ok(())
    })
}

/// Only NVML_TEMPERATURE_GPU exists; other sensors are INVALID_ARGUMENT.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: nvmlDevice_t,
    sensorType: nvmlTemperatureSensors_t,
    temp: *mut c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetTemperature";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(temp) }?;
        let (_, gpu) = state::device(&cfg, device, NAME)?;
        if sensorType != NVML_TEMPERATURE_GPU {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        out.set(gpu.temperature_c);
        Ok(())
    })
}

/// Milliwatts.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(
    device: nvmlDevice_t,
    power: *mut c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetPowerUsage";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(power) }?;
        let (_, gpu) = state::device(&cfg, device, NAME)?;
        out.set(gpu.power_mw);
        Ok(())
    })
}

/// `mig.mode` and `mig.pending`. A model without a MIG profile table:
/// NOT_SUPPORTED.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    currentMode: *mut c_uint,
    pendingMode: *mut c_uint,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetMigMode";
    guard(NAME, || {
        let cfg = state::session()?;
        let current = unsafe { out(currentMode) }?;
        let pending = unsafe { out(pendingMode) }?;
        let (_, gpu) = state::device(&cfg, device, NAME)?;
        if gpu.mig.table.is_none() {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        let mode = |on: bool| {
            if on {
                NVML_DEVICE_MIG_ENABLE
            } else {
                NVML_DEVICE_MIG_DISABLE
            }
        };
        current.set(mode(gpu.mig.mode));
        pending.set(mode(gpu.mig.pending));
        Ok(())
    })
}

// ----- topology and NVLink -----

/// Same device: INTERNAL; same non-empty `pci_switch`: SINGLE; same
/// `numa_node`: NODE; else SYSTEM. Both GPUs must answer (lost, errors).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    pathInfo: *mut nvmlGpuTopologyLevel_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetTopologyCommonAncestor";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(pathInfo) }?;
        let (i, a) = state::device(&cfg, device1, NAME)?;
        let (j, b) = state::device(&cfg, device2, NAME)?;
        let level = if i == j {
            NVML_TOPOLOGY_INTERNAL
        } else if a.pci_switch.is_some() && a.pci_switch == b.pci_switch {
            NVML_TOPOLOGY_SINGLE
        } else if a.numa_node == b.numa_node {
            NVML_TOPOLOGY_NODE
        } else {
            NVML_TOPOLOGY_SYSTEM
        };
        out.set(level);
        Ok(())
    })
}

/// Checks `link` for the two NVLink functions and says whether it is active.
/// No links at all: NOT_SUPPORTED; link >= 18: INVALID_ARGUMENT.
fn link_active(nvlinks: &[BusId], link: c_uint) -> state::Res<Option<&BusId>> {
    if nvlinks.is_empty() {
        return Err(NVML_ERROR_NOT_SUPPORTED);
    }
    if link >= NVML_NVLINK_MAX_LINKS {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    Ok(nvlinks.get(link as usize))
}

/// link < len(nvlinks): ENABLED; len <= link < 18: DISABLED.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    isActive: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetNvLinkState";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(isActive) }?;
        let (_, gpu) = state::device(&cfg, device, NAME)?;
        let state = match link_active(&gpu.nvlinks, link)? {
            Some(_) => NVML_FEATURE_ENABLED,
            None => NVML_FEATURE_DISABLED,
        };
        out.set(state);
        Ok(())
    })
}

/// The remote end of an active link: busId, busIdLegacy, domain/bus/device,
/// and pciDeviceId when the remote is a GPU of this config (else 0). An
/// inactive link (len <= link < 18) is INVALID_ARGUMENT.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    device: nvmlDevice_t,
    link: c_uint,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetNvLinkRemotePciInfo_v2";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(pci) }?;
        let (_, gpu) = state::device(&cfg, device, NAME)?;
        let remote = link_active(&gpu.nvlinks, link)?.ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        let remote_device_id = cfg
            .gpus
            .iter()
            .find(|g| g.pci_bus_id == *remote)
            .map_or(0, |g| g.pci_device_id);
        out.set(state::pci_info(remote, remote_device_id));
        Ok(())
    })
}

/// Single/double bit ECC, XID critical, PState, Clock.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    eventTypes: *mut c_ulonglong,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetSupportedEventTypes";
    guard(NAME, || {
        let cfg = state::session()?;
        let out = unsafe { out(eventTypes) }?;
        state::device(&cfg, device, NAME)?;
        out.set(SUPPORTED_EVENT_TYPES);
        Ok(())
    })
}

// ----- processes -----

/// The GPU's `processes` into the caller's array, with NVML's sizing
/// protocol: `*infoCount` is the room in `infos` (null with room:
/// INVALID_ARGUMENT);
/// too little room is INSUFFICIENT_SIZE with the count needed written back,
/// so `*infoCount = 0, infos = NULL` sizes the list (SUCCESS when it is
/// empty). On success `*infoCount` is the number written.
///
/// # Safety
/// `infoCount` is null or valid for a read and a write; `infos` is null or
/// valid for `*infoCount` writes.
unsafe fn running_processes(
    name: &str,
    mps_only: bool,
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    guard(name, || {
        let cfg = state::session()?;
        let count = unsafe { out(infoCount) }?;
        let (_, gpu) = state::device(&cfg, device, name)?;
        let list: Vec<nvmlProcessInfo_t> = gpu
            .processes
            .iter()
            .filter(|p| p.mps_client || !mps_only)
            .map(|p| nvmlProcessInfo_t {
                pid: p.pid,
                usedGpuMemory: p
                    .memory_used_mib
                    .map_or(NVML_VALUE_NOT_AVAILABLE_ULL, |m| m * MIB),
                gpuInstanceId: NO_INSTANCE,
                computeInstanceId: NO_INSTANCE,
            })
            .collect();
        let n = list.len() as c_uint;
        let room = count.get();
        if room < n {
            count.set(n);
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        if room > 0 {
            unsafe { out_array(infos, room) }?.write(&list)?;
        }
        count.set(n);
        Ok(())
    })
}

/// The GPU's `processes` (pid, memory; GPU and compute instance ids
/// 0xFFFFFFFF), what nvml-wrapper 0.13's `running_compute_processes` calls.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    unsafe {
        running_processes(
            "nvmlDeviceGetComputeRunningProcesses_v3",
            false,
            device,
            infoCount,
            infos,
        )
    }
}

/// Each of the GPU's `processes` with an `sm_util_pct`, as a sample now
/// (`lastSeenTimeStamp` is not consulted: every call is a new period);
/// NOT_FOUND when none has one, as NVML answers.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    utilization: *mut nvmlProcessUtilizationSample_t,
    processSamplesCount: *mut c_uint,
    _lastSeenTimeStamp: c_ulonglong,
) -> nvmlReturn_t {
    let name = "nvmlDeviceGetProcessUtilization";
    guard(name, || {
        let cfg = state::session()?;
        let count = unsafe { out(processSamplesCount) }?;
        let (_, gpu) = state::device(&cfg, device, name)?;
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let list: Vec<nvmlProcessUtilizationSample_t> = gpu
            .processes
            .iter()
            .filter_map(|p| {
                p.sm_util_pct.map(|u| nvmlProcessUtilizationSample_t {
                    pid: p.pid,
                    timeStamp: now_us,
                    smUtil: u,
                    memUtil: 0,
                    encUtil: 0,
                    decUtil: 0,
                })
            })
            .collect();
        let n = list.len() as c_uint;
        // NVML's answer when no process has a sample since the last one.
        if n == 0 {
            count.set(0);
            return Err(NVML_ERROR_NOT_FOUND);
        }
        if utilization.is_null() || count.get() < n {
            count.set(n);
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        unsafe { out_array(utilization, n) }?.write(&list)?;
        count.set(n);
        Ok(())
    })
}

/// The GPU's `processes` that are MPS clients (`mps_client`, the
/// default): on Volta and later MPS clients appear in both lists, a
/// process that bypassed MPS in the compute list only.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    unsafe {
        running_processes(
            "nvmlDeviceGetMPSComputeRunningProcesses_v3",
            true,
            device,
            infoCount,
            infos,
        )
    }
}
