//! The C types and constants of NVML that this library speaks, copied from
//! `nvml-wrapper-sys` 0.10 (`src/bindings.rs`, itself generated from
//! `nvml.h`). Layouts must match byte for byte: nvml-wrapper hands us
//! pointers to its own `mem::zeroed()` copies of these structs.

#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

use std::os::raw::{c_char, c_uint, c_ulonglong};

pub type nvmlReturn_t = c_uint;

pub const NVML_SUCCESS: nvmlReturn_t = 0;
pub const NVML_ERROR_UNINITIALIZED: nvmlReturn_t = 1;
pub const NVML_ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
pub const NVML_ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
pub const NVML_ERROR_NOT_FOUND: nvmlReturn_t = 6;
pub const NVML_ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
pub const NVML_ERROR_TIMEOUT: nvmlReturn_t = 10;
pub const NVML_ERROR_GPU_IS_LOST: nvmlReturn_t = 15;
pub const NVML_ERROR_RESET_REQUIRED: nvmlReturn_t = 16;
pub const NVML_ERROR_IN_USE: nvmlReturn_t = 19;
pub const NVML_ERROR_INSUFFICIENT_RESOURCES: nvmlReturn_t = 23;
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: nvmlReturn_t = 25;
pub const NVML_ERROR_UNKNOWN: nvmlReturn_t = 999;

/// Every NVML return code: (code, name in configs without the `NVML_ERROR_`
/// prefix, message of `nvmlErrorString`, NUL-terminated).
pub const RETURN_CODES: &[(nvmlReturn_t, &str, &std::ffi::CStr)] = &[
    (0, "SUCCESS", c"Success"),
    (1, "UNINITIALIZED", c"Uninitialized"),
    (2, "INVALID_ARGUMENT", c"Invalid Argument"),
    (3, "NOT_SUPPORTED", c"Not Supported"),
    (4, "NO_PERMISSION", c"Insufficient Permissions"),
    (5, "ALREADY_INITIALIZED", c"Already Initialized"),
    (6, "NOT_FOUND", c"Not Found"),
    (7, "INSUFFICIENT_SIZE", c"Insufficient Size"),
    (8, "INSUFFICIENT_POWER", c"Insufficient External Power"),
    (9, "DRIVER_NOT_LOADED", c"Driver Not Loaded"),
    (10, "TIMEOUT", c"Timeout"),
    (11, "IRQ_ISSUE", c"Interrupt request issue"),
    (12, "LIBRARY_NOT_FOUND", c"NVML Shared Library Not Found"),
    (13, "FUNCTION_NOT_FOUND", c"Function Not Found"),
    (14, "CORRUPTED_INFOROM", c"Corrupted infoROM"),
    (15, "GPU_IS_LOST", c"GPU is lost"),
    (16, "RESET_REQUIRED", c"GPU requires restart"),
    (
        17,
        "OPERATING_SYSTEM",
        c"The operating system has blocked the request.",
    ),
    (
        18,
        "LIB_RM_VERSION_MISMATCH",
        c"RM has detected an NVML/RM version mismatch.",
    ),
    (19, "IN_USE", c"In use by another client"),
    (20, "MEMORY", c"Insufficient Memory"),
    (21, "NO_DATA", c"No data"),
    (
        22,
        "VGPU_ECC_NOT_SUPPORTED",
        c"The requested vgpu operation is not available on target device, because ECC is enabled",
    ),
    (23, "INSUFFICIENT_RESOURCES", c"Insufficient resources"),
    (24, "FREQ_NOT_SUPPORTED", c"Frequency not supported"),
    (
        25,
        "ARGUMENT_VERSION_MISMATCH",
        c"Argument version mismatch",
    ),
    (26, "DEPRECATED", c"Deprecated"),
    (27, "NOT_READY", c"Not ready"),
    (28, "GPU_NOT_FOUND", c"GPU not found"),
    (29, "INVALID_STATE", c"Invalid state"),
    (30, "RESET_TYPE_NOT_SUPPORTED", c"Reset type not supported"),
    (999, "UNKNOWN", c"Unknown Error"),
];

/// Opaque device; `nvmlDevice_t` values are never dereferenced (see
/// `state::handle_for`).
#[repr(C)]
pub struct nvmlDevice_st {
    _unused: [u8; 0],
}
pub type nvmlDevice_t = *mut nvmlDevice_st;

/// Opaque event set as C sees it; an `events::EventSet` behind it.
#[repr(C)]
pub struct nvmlEventSet_st {
    _unused: [u8; 0],
}
pub type nvmlEventSet_t = *mut nvmlEventSet_st;

pub const NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE: usize = 32;
pub const NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE: usize = 16;
pub const NVML_NVLINK_MAX_LINKS: c_uint = 18;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlPciInfo_t {
    /// Legacy "%04X:%02X:%02X.%X" id, NUL-terminated.
    pub busIdLegacy: [c_char; NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE],
    pub domain: c_uint,
    pub bus: c_uint,
    pub device: c_uint,
    pub pciDeviceId: c_uint,
    pub pciSubSystemId: c_uint,
    /// "%08X:%02X:%02X.%X", NUL-terminated.
    pub busId: [c_char; NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE],
}

/// `nvmlMemory_t` (v1), filled by `nvmlDeviceGetMemoryInfo`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlMemory_t {
    pub total: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

/// `nvmlMemory_v2_t`, filled by `nvmlDeviceGetMemoryInfo_v2`; the caller sets
/// `version` to [`nvmlMemory_v2`].
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlMemory_v2_t {
    pub version: c_uint,
    pub total: c_ulonglong,
    pub reserved: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

/// `NVML_STRUCT_VERSION(Memory, 2)` = sizeof | 2 << 24, exactly what
/// nvml-wrapper 0.13's `memory_info` writes (0x0200_0028 on 64-bit).
pub const nvmlMemory_v2: c_uint = (std::mem::size_of::<nvmlMemory_v2_t>() as c_uint) | (2 << 24);

/// `nvmlProcessUtilizationSample_t`, filled by
/// `nvmlDeviceGetProcessUtilization`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct nvmlProcessUtilizationSample_t {
    pub pid: c_uint,
    /// CPU timestamp, microseconds.
    pub timeStamp: c_ulonglong,
    pub smUtil: c_uint,
    pub memUtil: c_uint,
    pub encUtil: c_uint,
    pub decUtil: c_uint,
}

/// `nvmlProcessInfo_t` (= `nvmlProcessInfo_v2_t`), filled by
/// `nvmlDevice(MPS)GetComputeRunningProcesses_v3`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct nvmlProcessInfo_t {
    pub pid: c_uint,
    /// Bytes; [`NVML_VALUE_NOT_AVAILABLE_ULL`] when NVML cannot tell.
    pub usedGpuMemory: c_ulonglong,
    /// [`NO_INSTANCE`] when not on a MIG device.
    pub gpuInstanceId: c_uint,
    pub computeInstanceId: c_uint,
}

/// `NVML_VALUE_NOT_AVAILABLE` (-1) as the 64-bit unsigned value NVML writes.
pub const NVML_VALUE_NOT_AVAILABLE_ULL: c_ulonglong = c_ulonglong::MAX;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlUtilization_t {
    pub gpu: c_uint,
    pub memory: c_uint,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlEventData_t {
    pub device: nvmlDevice_t,
    pub eventType: c_ulonglong,
    pub eventData: c_ulonglong,
    pub gpuInstanceId: c_uint,
    pub computeInstanceId: c_uint,
}

pub type nvmlEnableState_t = c_uint;
pub const NVML_FEATURE_DISABLED: nvmlEnableState_t = 0;
pub const NVML_FEATURE_ENABLED: nvmlEnableState_t = 1;

pub type nvmlTemperatureSensors_t = c_uint;
pub const NVML_TEMPERATURE_GPU: nvmlTemperatureSensors_t = 0;

pub const NVML_DEVICE_MIG_DISABLE: c_uint = 0;
pub const NVML_DEVICE_MIG_ENABLE: c_uint = 1;

pub type nvmlGpuTopologyLevel_t = c_uint;
pub const NVML_TOPOLOGY_INTERNAL: nvmlGpuTopologyLevel_t = 0;
pub const NVML_TOPOLOGY_SINGLE: nvmlGpuTopologyLevel_t = 10;
pub const NVML_TOPOLOGY_NODE: nvmlGpuTopologyLevel_t = 40;
pub const NVML_TOPOLOGY_SYSTEM: nvmlGpuTopologyLevel_t = 50;

pub const nvmlEventTypeSingleBitEccError: c_ulonglong = 1;
pub const nvmlEventTypeDoubleBitEccError: c_ulonglong = 2;
pub const nvmlEventTypePState: c_ulonglong = 4;
pub const nvmlEventTypeXidCriticalError: c_ulonglong = 8;
pub const nvmlEventTypeClock: c_ulonglong = 16;

/// What `nvmlDeviceGetSupportedEventTypes` reports, and the only bits
/// `nvmlDeviceRegisterEvents` accepts.
pub const SUPPORTED_EVENT_TYPES: c_ulonglong = nvmlEventTypeSingleBitEccError
    | nvmlEventTypeDoubleBitEccError
    | nvmlEventTypeXidCriticalError
    | nvmlEventTypePState
    | nvmlEventTypeClock;

/// `gpuInstanceId` / `computeInstanceId` of an event or a process not tied
/// to a MIG instance.
pub const NO_INSTANCE: c_uint = 0xFFFF_FFFF;

// ----- MIG -----

/// Opaque GPU instance; a tag, never dereferenced (see `state::gi_handle`).
#[repr(C)]
pub struct nvmlGpuInstance_st {
    _unused: [u8; 0],
}
pub type nvmlGpuInstance_t = *mut nvmlGpuInstance_st;

/// Opaque compute instance; a tag, never dereferenced (see `state::ci_handle`).
#[repr(C)]
pub struct nvmlComputeInstance_st {
    _unused: [u8; 0],
}
pub type nvmlComputeInstance_t = *mut nvmlComputeInstance_st;

pub const NVML_GPU_INSTANCE_PROFILE_COUNT: c_uint = 17;
pub const NVML_COMPUTE_INSTANCE_PROFILE_COUNT: c_uint = 8;
pub const NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED: c_uint = 0;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlDeviceAttributes_t {
    pub multiprocessorCount: c_uint,
    pub sharedCopyEngineCount: c_uint,
    pub sharedDecoderCount: c_uint,
    pub sharedEncoderCount: c_uint,
    pub sharedJpegCount: c_uint,
    pub sharedOfaCount: c_uint,
    pub gpuInstanceSliceCount: c_uint,
    pub computeInstanceSliceCount: c_uint,
    pub memorySizeMB: c_ulonglong,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct nvmlGpuInstancePlacement_t {
    pub start: c_uint,
    pub size: c_uint,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlGpuInstanceProfileInfo_t {
    pub id: c_uint,
    pub isP2pSupported: c_uint,
    pub sliceCount: c_uint,
    pub instanceCount: c_uint,
    pub multiprocessorCount: c_uint,
    pub copyEngineCount: c_uint,
    pub decoderCount: c_uint,
    pub encoderCount: c_uint,
    pub jpegCount: c_uint,
    pub ofaCount: c_uint,
    pub memorySizeMB: c_ulonglong,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlGpuInstanceProfileInfo_v2_t {
    pub version: c_uint,
    pub id: c_uint,
    pub isP2pSupported: c_uint,
    pub sliceCount: c_uint,
    pub instanceCount: c_uint,
    pub multiprocessorCount: c_uint,
    pub copyEngineCount: c_uint,
    pub decoderCount: c_uint,
    pub encoderCount: c_uint,
    pub jpegCount: c_uint,
    pub ofaCount: c_uint,
    pub memorySizeMB: c_ulonglong,
    pub name: [c_char; 96],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlGpuInstanceProfileInfo_v3_t {
    pub version: c_uint,
    pub id: c_uint,
    pub sliceCount: c_uint,
    pub instanceCount: c_uint,
    pub multiprocessorCount: c_uint,
    pub copyEngineCount: c_uint,
    pub decoderCount: c_uint,
    pub encoderCount: c_uint,
    pub jpegCount: c_uint,
    pub ofaCount: c_uint,
    pub memorySizeMB: c_ulonglong,
    pub name: [c_char; 96],
    pub capabilities: c_uint,
}

/// `NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 2)`.
pub const nvmlGpuInstanceProfileInfo_v2: c_uint =
    (std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as c_uint) | (2 << 24);
/// `NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 3)`.
pub const nvmlGpuInstanceProfileInfo_v3: c_uint =
    (std::mem::size_of::<nvmlGpuInstanceProfileInfo_v3_t>() as c_uint) | (3 << 24);

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlGpuInstanceInfo_t {
    pub device: nvmlDevice_t,
    pub id: c_uint,
    pub profileId: c_uint,
    pub placement: nvmlGpuInstancePlacement_t,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct nvmlComputeInstancePlacement_t {
    pub start: c_uint,
    pub size: c_uint,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlComputeInstanceProfileInfo_t {
    pub id: c_uint,
    pub sliceCount: c_uint,
    pub instanceCount: c_uint,
    pub multiprocessorCount: c_uint,
    pub sharedCopyEngineCount: c_uint,
    pub sharedDecoderCount: c_uint,
    pub sharedEncoderCount: c_uint,
    pub sharedJpegCount: c_uint,
    pub sharedOfaCount: c_uint,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlComputeInstanceProfileInfo_v2_t {
    pub version: c_uint,
    pub id: c_uint,
    pub sliceCount: c_uint,
    pub instanceCount: c_uint,
    pub multiprocessorCount: c_uint,
    pub sharedCopyEngineCount: c_uint,
    pub sharedDecoderCount: c_uint,
    pub sharedEncoderCount: c_uint,
    pub sharedJpegCount: c_uint,
    pub sharedOfaCount: c_uint,
    pub name: [c_char; 96],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlComputeInstanceProfileInfo_v3_t {
    pub version: c_uint,
    pub id: c_uint,
    pub sliceCount: c_uint,
    pub instanceCount: c_uint,
    pub multiprocessorCount: c_uint,
    pub sharedCopyEngineCount: c_uint,
    pub sharedDecoderCount: c_uint,
    pub sharedEncoderCount: c_uint,
    pub sharedJpegCount: c_uint,
    pub sharedOfaCount: c_uint,
    pub name: [c_char; 96],
    pub capabilities: c_uint,
}

/// `NVML_STRUCT_VERSION(ComputeInstanceProfileInfo, 2)`.
pub const nvmlComputeInstanceProfileInfo_v2: c_uint =
    (std::mem::size_of::<nvmlComputeInstanceProfileInfo_v2_t>() as c_uint) | (2 << 24);
/// `NVML_STRUCT_VERSION(ComputeInstanceProfileInfo, 3)`.
pub const nvmlComputeInstanceProfileInfo_v3: c_uint =
    (std::mem::size_of::<nvmlComputeInstanceProfileInfo_v3_t>() as c_uint) | (3 << 24);

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlComputeInstanceInfo_t {
    pub device: nvmlDevice_t,
    pub gpuInstance: nvmlGpuInstance_t,
    pub id: c_uint,
    pub profileId: c_uint,
    pub placement: nvmlComputeInstancePlacement_t,
}

/// Size checks: a mismatch here would corrupt nvml-wrapper's memory.
const _: () = {
    assert!(std::mem::size_of::<nvmlPciInfo_t>() == 68);
    assert!(std::mem::size_of::<nvmlMemory_v2_t>() == 40);
    assert!(std::mem::size_of::<nvmlEventData_t>() == 32);
    assert!(std::mem::size_of::<nvmlDeviceAttributes_t>() == 40);
    assert!(std::mem::size_of::<nvmlGpuInstanceProfileInfo_t>() == 48);
    assert!(std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() == 152);
    assert!(std::mem::size_of::<nvmlGpuInstanceProfileInfo_v3_t>() == 152);
    assert!(std::mem::size_of::<nvmlComputeInstanceProfileInfo_t>() == 36);
    assert!(std::mem::size_of::<nvmlComputeInstanceProfileInfo_v2_t>() == 136);
    assert!(std::mem::size_of::<nvmlComputeInstanceProfileInfo_v3_t>() == 140);
    assert!(std::mem::size_of::<nvmlGpuInstanceInfo_t>() == 24);
    assert!(std::mem::size_of::<nvmlComputeInstanceInfo_t>() == 32);
};

// ----- cgroup memory limits (driver r615+) -----
//
// Not in nvml-wrapper-sys 0.10 (it predates them). Layout from NVIDIA's NVML
// reference, `nvmlSetMemoryLimits_v1_t` / `nvmlGetMemoryLimits_v1_t`: no
// version member (docs/research/mps-fractions.md §3.1).

/// What `nvmlDeviceSetMemoryLimits_v1` reads.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlSetMemoryLimits_v1_t {
    /// Full path of the cgroup v2 directory.
    pub nameSpace: *const c_char,
    /// Bytes.
    pub softLimit: c_ulonglong,
    /// Bytes.
    pub hardLimit: c_ulonglong,
}

/// What `nvmlDeviceGetMemoryLimits_v1` fills (`nameSpace` is its input).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlGetMemoryLimits_v1_t {
    pub nameSpace: *const c_char,
    pub softLimit: c_ulonglong,
    pub hardLimit: c_ulonglong,
    /// Bytes the cgroup uses now.
    pub currentUsed: c_ulonglong,
}

/// `NVML_DEVICE_MEMORY_LIMIT_MAX`: "no hard limit". Its value was not seen in
/// a header; ~0ULL is what the sources bound it to (research §3.1).
pub const NVML_DEVICE_MEMORY_LIMIT_MAX: c_ulonglong = c_ulonglong::MAX;
