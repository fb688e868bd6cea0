//! The JSON machine description (schema in `tests/fake-nvml/README.md`).
//!
//! Parsed with `deny_unknown_fields` everywhere, then checked and resolved:
//! defaults that depend on a GPU's position (minor number, bus id, serial)
//! are filled in here, so the exported functions read plain values.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use serde::{Deserialize, Deserializer};

use crate::ffi::{self, nvmlReturn_t};
use crate::profiles::{self, Profile, Table};

/// Per-device functions an `errors` entry may name. Each of them consults
/// the override before anything else it does for that GPU.
pub const PER_DEVICE_FUNCTIONS: &[&str] = &[
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetHandleByUUID",
    "nvmlDeviceGetHandleByPciBusId_v2",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetSerial",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetCpuAffinity",
    "nvmlDeviceGetNumaNodeId",
    "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetTopologyCommonAncestor",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkRemotePciInfo_v2",
    "nvmlDeviceRegisterEvents",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetMPSComputeRunningProcesses_v3",
    "nvmlDeviceGetProcessUtilization",
];

/// The cgroup memory limit functions (r615+), which an `errors` entry may
/// name too.
pub const MEMORY_LIMIT_FUNCTIONS: &[&str] = &[
    "nvmlDeviceSetMemoryLimits_v1",
    "nvmlDeviceGetMemoryLimits_v1",
];

/// The MIG functions an `errors` entry may name (besides
/// nvmlDeviceGetMigMode above). Calls on a GPU instance, compute instance or
/// MIG device consult the parent GPU's `errors`.
pub const MIG_FUNCTIONS: &[&str] = &[
    "nvmlDeviceSetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceIsMigDeviceHandle",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
    "nvmlDeviceGetAttributes_v2",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
    "nvmlDeviceGetGpuInstanceProfileInfo",
    "nvmlDeviceGetGpuInstanceProfileInfoV",
    "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
    "nvmlDeviceGetGpuInstanceRemainingCapacity",
    "nvmlDeviceCreateGpuInstance",
    "nvmlDeviceCreateGpuInstanceWithPlacement",
    "nvmlDeviceGetGpuInstances",
    "nvmlDeviceGetGpuInstanceById",
    "nvmlGpuInstanceGetInfo",
    "nvmlGpuInstanceDestroy",
    "nvmlGpuInstanceGetComputeInstanceProfileInfo",
    "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
    "nvmlGpuInstanceCreateComputeInstance",
    "nvmlGpuInstanceGetComputeInstances",
    "nvmlComputeInstanceGetInfo_v2",
    "nvmlComputeInstanceDestroy",
];

/// Highest GPU instance id a config may name (real GPUs use 0..=14).
pub const MAX_GI_ID: u32 = 63;
/// Highest compute instance id a config may name (real GPUs use 0..=7).
pub const MAX_CI_ID: u32 = 7;

/// Most memory a process may use, MiB (1 PiB: far beyond any GPU, and its
/// bytes fit a u64).
const MAX_PROCESS_MIB: u64 = 1 << 30;

/// Highest CPU number a `cpu_affinity` list may name (keeps a typo from
/// allocating gigabytes).
const MAX_CPU: u32 = 65_535;

/// The whole machine, resolved.
#[derive(Debug, Clone)]
pub struct Config {
    pub driver_version: String,
    pub cuda_driver_version: i32,
    pub init_error: Option<ErrorCode>,
    /// Whether the driver has per-cgroup memory limits (r615+).
    pub memory_limits: bool,
    pub gpus: Vec<Gpu>,
    pub events: Vec<Event>,
}

/// One GPU, resolved (no optional fields left but `pci_switch`).
#[derive(Debug, Clone)]
pub struct Gpu {
    pub uuid: String,
    pub name: String,
    pub serial: String,
    pub memory_total_mib: u64,
    pub memory_used_mib: u64,
    pub minor: u32,
    pub pci_bus_id: BusId,
    pub pci_device_id: u32,
    pub numa_node: u32,
    /// Sorted, de-duplicated CPU numbers.
    pub cpu_affinity: Vec<u32>,
    pub compute_capability: [i32; 2],
    pub utilization_gpu_pct: u32,
    pub utilization_memory_pct: u32,
    pub temperature_c: u32,
    pub power_mw: u32,
    pub mig: Mig,
    pub pci_switch: Option<String>,
    /// Remote bus id of each active link; link number = position.
    pub nvlinks: Vec<BusId>,
    pub lost: bool,
    pub errors: BTreeMap<String, ErrorCode>,
    /// Processes using the GPU, in file order (unique pids).
    pub processes: Vec<Process>,
    /// The last limits set per cgroup (unique paths), in file order.
    pub cgroup_memory_limits: Vec<CgroupLimit>,
}

/// A cgroup's memory limits on a GPU, as the last
/// `nvmlDeviceSetMemoryLimits_v1` left them (soft 0 and hard
/// `NVML_DEVICE_MEMORY_LIMIT_MAX`: cleared).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CgroupLimit {
    /// The path as the caller gave it.
    pub cgroup: String,
    pub soft_bytes: u64,
    pub hard_bytes: u64,
    /// What `currentUsed` reports; tests set it.
    #[serde(default)]
    pub used_bytes: u64,
}

/// A process using a GPU, as NVML's process lists report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Process {
    pub pid: u32,
    /// None (absent or null): NVML_VALUE_NOT_AVAILABLE, as NVML reports
    /// when it cannot account a process's memory.
    #[serde(default)]
    pub memory_used_mib: Option<u64>,
    /// An MPS client, listed by both process calls (true), or a process
    /// that bypassed MPS, listed by the compute call only (false).
    #[serde(default = "yes")]
    pub mps_client: bool,
    /// Its share of the GPU's SMs over the last sample period, percent, as
    /// nvmlDeviceGetProcessUtilization reports it; None: not listed there
    /// (NVML lists only processes with a non-zero reading).
    #[serde(default)]
    pub sm_util_pct: Option<u32>,
}

fn yes() -> bool {
    true
}

/// A GPU's MIG state, resolved.
#[derive(Debug, Clone)]
pub struct Mig {
    /// The model's profile table; None: the model has no MIG.
    pub table: Option<&'static Table>,
    /// Current mode.
    pub mode: bool,
    /// Pending mode (what the next reset applies).
    pub pending: bool,
    pub needs_reset: bool,
    /// In file order.
    pub instances: Vec<GpuInstance>,
}

/// A GPU instance, resolved (ids assigned, uuid derived).
#[derive(Debug, Clone)]
pub struct GpuInstance {
    pub profile: &'static Profile,
    pub start: u32,
    pub gi_id: u32,
    /// Its one compute instance (spanning the whole GI); None: not created.
    pub ci_id: Option<u32>,
    pub uuid: String,
    pub memory_used_mib: u64,
    pub busy: bool,
    /// Position in the file's `instances` list; None: created by a call and
    /// not yet written.
    pub file_pos: Option<usize>,
}

impl GpuInstance {
    /// Memory slices it spans: start..end.
    pub fn mem_range(&self) -> std::ops::Range<u32> {
        self.start..self.start + self.profile.mem_slices
    }
}

impl Mig {
    /// The MIG devices (instances with a compute instance), in MIG device
    /// index order: by GPU instance id.
    pub fn devices(&self) -> Vec<&GpuInstance> {
        let mut d: Vec<&GpuInstance> = self
            .instances
            .iter()
            .filter(|i| i.ci_id.is_some())
            .collect();
        d.sort_by_key(|i| i.gi_id);
        d
    }

    /// Whether `profile` fits at `start` next to the existing instances:
    /// `start` is one of its placements, no memory slice is taken, and the
    /// compute slices add up to at most 7.
    pub fn fits(&self, profile: &Profile, start: u32) -> bool {
        let range = start..start + profile.mem_slices;
        let compute: u32 = self.instances.iter().map(|i| i.profile.slices).sum();
        profile.starts.contains(&start)
            && compute + profile.slices <= profiles::COMPUTE_SLICES
            && !self
                .instances
                .iter()
                .any(|i| i.mem_range().start < range.end && range.start < i.mem_range().end)
    }

    /// Lowest GPU instance id not in use (from 1).
    pub fn free_gi_id(&self) -> Option<u32> {
        (1..=MAX_GI_ID).find(|id| !self.instances.iter().any(|i| i.gi_id == *id))
    }
}

/// The default MIG device uuid: `MIG-` and a v4-style uuid hashed from the
/// parent's uuid and the GPU instance id (FNV-1a, two seeds).
pub fn derived_mig_uuid(parent_uuid: &str, gi_id: u32) -> String {
    let fnv = |seed: u64| {
        let mut h = seed;
        for b in parent_uuid.bytes().chain(gi_id.to_le_bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01B3);
        }
        h
    };
    let a = fnv(0xcbf2_9ce4_8422_2325);
    let b = fnv(0x6c62_272e_07bb_0142);
    format!(
        "MIG-{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xFFFF,
        a & 0x0FFF,
        0x8000 | ((b >> 48) & 0x3FFF),
        b & 0xFFFF_FFFF_FFFF
    )
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Event {
    pub id: u64,
    pub gpu_index: usize,
    #[serde(rename = "type")]
    pub kind: EventKind,
    /// The XID for `xid` events; passed through as `eventData` for all types.
    #[serde(default)]
    pub data: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    Xid,
    DoubleBitEcc,
    SingleBitEcc,
}

impl EventKind {
    /// The `nvmlEventType*` bit.
    pub fn mask(self) -> u64 {
        match self {
            EventKind::Xid => ffi::nvmlEventTypeXidCriticalError,
            EventKind::DoubleBitEcc => ffi::nvmlEventTypeDoubleBitEccError,
            EventKind::SingleBitEcc => ffi::nvmlEventTypeSingleBitEccError,
        }
    }
}

/// An NVML error (never SUCCESS), written in configs by name: "GPU_IS_LOST"
/// or "NVML_ERROR_GPU_IS_LOST".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorCode(pub nvmlReturn_t);

impl ErrorCode {
    pub fn parse(name: &str) -> Option<ErrorCode> {
        let short = name.strip_prefix("NVML_ERROR_").unwrap_or(name);
        ffi::RETURN_CODES
            .iter()
            .find(|(code, n, _)| *code != ffi::NVML_SUCCESS && *n == short)
            .map(|(code, _, _)| ErrorCode(*code))
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ErrorCode::parse(&s).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "unknown NVML error {s:?} (expected a name such as \"GPU_IS_LOST\")"
            ))
        })
    }
}

/// A PCI address. Parses the 8-digit ("00000000:07:00.0") and the legacy
/// 4-digit ("0000:07:00.0") domain spellings, any hex case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BusId {
    pub domain: u32,
    pub bus: u32,
    pub device: u32,
    pub function: u32,
}

impl BusId {
    pub fn parse(s: &str) -> Option<BusId> {
        let (domain, rest) = s.split_once(':')?;
        let (bus, rest) = rest.split_once(':')?;
        let (device, function) = rest.split_once('.')?;
        let hex = |p: &str, max_len: usize| {
            if p.is_empty() || p.len() > max_len {
                None
            } else {
                u32::from_str_radix(p, 16).ok()
            }
        };
        let id = BusId {
            domain: hex(domain, 8)?,
            bus: hex(bus, 2)?,
            device: hex(device, 2)?,
            function: hex(function, 1)?,
        };
        (id.device < 32 && id.function < 8).then_some(id)
    }

    /// NVML's `busId`: "%08X:%02X:%02X.%X" (31 chars at most with the NUL).
    pub fn canonical(&self) -> String {
        format!(
            "{:08X}:{:02X}:{:02X}.{:X}",
            self.domain, self.bus, self.device, self.function
        )
    }

    /// NVML's `busIdLegacy`: "%04X:%02X:%02X.%X" (13 bytes with the NUL).
    pub fn legacy(&self) -> String {
        format!(
            "{:04X}:{:02X}:{:02X}.{:X}",
            self.domain & 0xFFFF,
            self.bus,
            self.device,
            self.function
        )
    }
}

impl fmt::Display for BusId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.canonical())
    }
}

impl<'de> Deserialize<'de> for BusId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        BusId::parse(&s).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "bad PCI bus id {s:?} (expected \"00000000:07:00.0\")"
            ))
        })
    }
}

/// Parses a Linux cpu list ("0-31,64-95", "" for none).
pub fn parse_cpu_list(s: &str) -> Result<Vec<u32>, String> {
    let mut cpus = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let num = |t: &str| {
            t.trim()
                .parse::<u32>()
                .ok()
                .filter(|n| *n <= MAX_CPU)
                .ok_or_else(|| format!("bad cpu list {s:?}: {t:?} is not a CPU number"))
        };
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => {
                let n = num(part)?;
                (n, n)
            }
        };
        if lo > hi {
            return Err(format!("bad cpu list {s:?}: range {part:?} is backwards"));
        }
        cpus.extend(lo..=hi);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

// ----- the file as written -----

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    #[serde(default = "default_driver_version")]
    driver_version: String,
    #[serde(default = "default_cuda_driver_version")]
    cuda_driver_version: i32,
    #[serde(default)]
    init_error: Option<ErrorCode>,
    #[serde(default)]
    memory_limits: bool,
    #[serde(default)]
    gpus: Vec<GpuFile>,
    #[serde(default)]
    events: Vec<Event>,
}

fn default_driver_version() -> String {
    "535.129.03".to_string()
}

fn default_cuda_driver_version() -> i32 {
    12020
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GpuFile {
    uuid: String,
    name: String,
    #[serde(default)]
    serial: Option<String>,
    #[serde(default = "default_memory_total_mib")]
    memory_total_mib: u64,
    #[serde(default)]
    memory_used_mib: u64,
    #[serde(default)]
    minor: Option<u32>,
    #[serde(default)]
    pci_bus_id: Option<BusId>,
    #[serde(default = "default_pci_device_id")]
    pci_device_id: u32,
    #[serde(default)]
    numa_node: u32,
    #[serde(default)]
    cpu_affinity: Option<String>,
    #[serde(default = "default_compute_capability")]
    compute_capability: [i32; 2],
    #[serde(default)]
    utilization_gpu_pct: u32,
    #[serde(default)]
    utilization_memory_pct: u32,
    #[serde(default = "default_temperature_c")]
    temperature_c: u32,
    #[serde(default = "default_power_mw")]
    power_mw: u32,
    #[serde(default)]
    mig_enabled: Option<bool>,
    #[serde(default)]
    mig: Option<MigFile>,
    #[serde(default)]
    pci_switch: Option<String>,
    #[serde(default)]
    nvlinks: Vec<BusId>,
    #[serde(default)]
    lost: bool,
    #[serde(default)]
    errors: BTreeMap<String, ErrorCode>,
    #[serde(default)]
    processes: Vec<Process>,
    #[serde(default)]
    cgroup_memory_limits: Vec<CgroupLimit>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MigFile {
    #[serde(default)]
    mode: Option<bool>,
    #[serde(default)]
    pending: Option<bool>,
    #[serde(default)]
    needs_reset: Option<bool>,
    #[serde(default)]
    instances: Vec<InstanceFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InstanceFile {
    profile: String,
    start: u32,
    #[serde(default)]
    gi_id: Option<u32>,
    #[serde(default)]
    ci_id: Option<u32>,
    #[serde(default)]
    uuid: Option<String>,
    #[serde(default)]
    memory_used_mib: u64,
    #[serde(default)]
    busy: bool,
}

/// Resolves a GPU's `mig` object (and the older `mig_enabled`).
fn resolve_mig(
    name: &str,
    uuid: &str,
    mig_enabled: Option<bool>,
    mig: Option<MigFile>,
) -> Result<Mig, String> {
    let table = profiles::table_for(name);
    let file_mode = mig.as_ref().and_then(|m| m.mode);
    let mode = match (mig_enabled, file_mode) {
        (Some(a), Some(b)) if a != b => {
            return Err(format!(
                "mig_enabled ({a}) and mig.mode ({b}) disagree; write one"
            ))
        }
        (a, b) => a.or(b).unwrap_or(false),
    };
    let mig = mig.unwrap_or(MigFile {
        mode: None,
        pending: None,
        needs_reset: None,
        instances: Vec::new(),
    });
    let Some(table) = table else {
        if mode || mig.pending == Some(true) || !mig.instances.is_empty() {
            return Err(format!("{name:?} has no MIG (no built-in profile table)"));
        }
        return Ok(Mig {
            table: None,
            mode: false,
            pending: false,
            needs_reset: mig.needs_reset.unwrap_or(false),
            instances: Vec::new(),
        });
    };
    let mut out = Mig {
        table: Some(table),
        mode,
        pending: mig.pending.unwrap_or(mode),
        needs_reset: mig.needs_reset.unwrap_or(table.needs_reset),
        instances: Vec::new(),
    };
    if !mode && !mig.instances.is_empty() {
        return Err("mig.instances without MIG mode (mig.mode is false)".to_string());
    }
    let explicit: Vec<u32> = mig.instances.iter().filter_map(|i| i.gi_id).collect();
    for (pos, i) in mig.instances.into_iter().enumerate() {
        let at = |what: String| format!("mig.instances[{pos}]: {what}");
        let profile = table.by_name(&i.profile).ok_or_else(|| {
            let names: Vec<&str> = table.profiles.iter().map(|p| p.name).collect();
            at(format!(
                "profile {:?} is not one of {name:?}'s: {}",
                i.profile,
                names.join(", ")
            ))
        })?;
        if !out.fits(profile, i.start) {
            return Err(at(format!(
                "{} at start {} is not a free placement (starts {:?}, size {})",
                profile.name, i.start, profile.starts, profile.mem_slices
            )));
        }
        let gi_id = match i.gi_id {
            Some(id) if id > MAX_GI_ID => return Err(at(format!("gi_id {id} > {MAX_GI_ID}"))),
            Some(id) if out.instances.iter().any(|o| o.gi_id == id) => {
                return Err(at(format!("duplicate gi_id {id}")))
            }
            Some(id) => id,
            None => (1..=MAX_GI_ID)
                .find(|id| !explicit.contains(id) && !out.instances.iter().any(|o| o.gi_id == *id))
                .ok_or_else(|| at("no free gi_id".to_string()))?,
        };
        if let Some(ci) = i.ci_id.filter(|c| *c > MAX_CI_ID) {
            return Err(at(format!("ci_id {ci} > {MAX_CI_ID}")));
        }
        let uuid = i.uuid.unwrap_or_else(|| derived_mig_uuid(uuid, gi_id));
        if out.instances.iter().any(|o| o.uuid == uuid) {
            return Err(at(format!("duplicate uuid {uuid:?}")));
        }
        out.instances.push(GpuInstance {
            profile,
            start: i.start,
            gi_id,
            ci_id: i.ci_id,
            uuid,
            memory_used_mib: i.memory_used_mib,
            busy: i.busy,
            file_pos: Some(pos),
        });
    }
    Ok(out)
}

/// Writes `mig` into one GPU's JSON object (a config being written back):
/// `mig.mode`, `mig.pending` and `mig.instances`; `mig_enabled` is folded
/// into `mig.mode`. Every other field, of the GPU and of each instance that
/// was in the file (`uuid`, `memory_used_mib`, `busy`, ...), stays as it was.
pub fn write_mig(gpu: &mut serde_json::Value, mig: &Mig) -> Result<(), String> {
    use serde_json::{json, Value};
    let obj = gpu
        .as_object_mut()
        .ok_or_else(|| "a GPU is not a JSON object".to_string())?;
    obj.remove("mig_enabled");
    let old: Vec<Value> = obj
        .get("mig")
        .and_then(|m| m.get("instances"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let entry = obj.entry("mig").or_insert_with(|| json!({}));
    if !entry.is_object() {
        *entry = json!({});
    }
    let m = entry
        .as_object_mut()
        .ok_or_else(|| "mig is not a JSON object".to_string())?;
    m.insert("mode".into(), json!(mig.mode));
    m.insert("pending".into(), json!(mig.pending));
    let instances: Vec<Value> = mig
        .instances
        .iter()
        .map(|i| {
            let mut o = i
                .file_pos
                .and_then(|p| old.get(p))
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            o.insert("profile".into(), json!(i.profile.name));
            o.insert("start".into(), json!(i.start));
            o.insert("gi_id".into(), json!(i.gi_id));
            match i.ci_id {
                Some(ci) => o.insert("ci_id".into(), json!(ci)),
                None => o.remove("ci_id"),
            };
            Value::Object(o)
        })
        .collect();
    m.insert("instances".into(), Value::Array(instances));
    Ok(())
}

fn default_memory_total_mib() -> u64 {
    16_384
}

/// 0x20B0 (A100-SXM4-40GB) << 16 | 0x10DE (NVIDIA).
fn default_pci_device_id() -> u32 {
    0x20B0_10DE
}

fn default_compute_capability() -> [i32; 2] {
    [8, 0]
}

fn default_temperature_c() -> u32 {
    35
}

fn default_power_mw() -> u32 {
    50_000
}

/// Reads, parses and checks the machine description at `path`. The error is
/// one line, meant for stderr.
pub fn load(path: &Path) -> Result<Config, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    parse(&text)
}

/// Parses and checks a machine description.
pub fn parse(text: &str) -> Result<Config, String> {
    let file: ConfigFile = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let host_cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    let mut gpus = Vec::with_capacity(file.gpus.len());
    for (index, g) in file.gpus.into_iter().enumerate() {
        let at = |what: String| format!("gpus[{index}]: {what}");
        if gpus.iter().any(|o: &Gpu| o.uuid == g.uuid) {
            return Err(at(format!("duplicate uuid {:?}", g.uuid)));
        }
        if let Some(name) = g.errors.keys().find(|k| {
            ![PER_DEVICE_FUNCTIONS, MIG_FUNCTIONS, MEMORY_LIMIT_FUNCTIONS]
                .iter()
                .any(|l| l.contains(&k.as_str()))
        }) {
            return Err(at(format!(
                "errors: {name:?} is not a per-device function this library exports"
            )));
        }
        if g.nvlinks.len() > ffi::NVML_NVLINK_MAX_LINKS as usize {
            return Err(at(format!(
                "{} nvlinks, NVML has at most {}",
                g.nvlinks.len(),
                ffi::NVML_NVLINK_MAX_LINKS
            )));
        }
        let cpu_affinity = match &g.cpu_affinity {
            Some(list) => parse_cpu_list(list).map_err(at)?,
            // Default: every CPU of the host running the fake.
            None => (0..host_cpus).collect(),
        };
        // Position-dependent defaults; `index` < gpus.len() fits in u32 in practice.
        let n = index as u64;
        let pci_bus_id = g.pci_bus_id.unwrap_or(BusId {
            domain: ((n + 1) >> 8) as u32,
            bus: ((n + 1) & 0xFF) as u32,
            device: 0,
            function: 0,
        });
        let mig = resolve_mig(&g.name, &g.uuid, g.mig_enabled, g.mig).map_err(at)?;
        for (k, p) in g.processes.iter().enumerate() {
            if g.processes[..k].iter().any(|o| o.pid == p.pid) {
                return Err(at(format!("processes: duplicate pid {}", p.pid)));
            }
            // MiB to bytes must not overflow (u64::MAX bytes is NOT_AVAILABLE).
            if p.memory_used_mib.is_some_and(|m| m > MAX_PROCESS_MIB) {
                return Err(at(format!(
                    "processes: pid {} uses more than {MAX_PROCESS_MIB} MiB",
                    p.pid
                )));
            }
        }
        for (k, l) in g.cgroup_memory_limits.iter().enumerate() {
            if l.cgroup.is_empty()
                || g.cgroup_memory_limits[..k]
                    .iter()
                    .any(|o| o.cgroup == l.cgroup)
            {
                return Err(at(format!(
                    "cgroup_memory_limits: empty or duplicate cgroup {:?}",
                    l.cgroup
                )));
            }
            if l.soft_bytes > l.hard_bytes {
                return Err(at(format!(
                    "cgroup_memory_limits: {:?} has soft_bytes over hard_bytes",
                    l.cgroup
                )));
            }
        }
        gpus.push(Gpu {
            mig,
            serial: g
                .serial
                .unwrap_or_else(|| (1_320_000_000_000 + n).to_string()),
            minor: g.minor.unwrap_or(index as u32),
            pci_bus_id,
            uuid: g.uuid,
            name: g.name,
            memory_total_mib: g.memory_total_mib,
            memory_used_mib: g.memory_used_mib,
            pci_device_id: g.pci_device_id,
            numa_node: g.numa_node,
            cpu_affinity,
            compute_capability: g.compute_capability,
            utilization_gpu_pct: g.utilization_gpu_pct,
            utilization_memory_pct: g.utilization_memory_pct,
            temperature_c: g.temperature_c,
            power_mw: g.power_mw,
            pci_switch: g.pci_switch.filter(|s| !s.is_empty()),
            nvlinks: g.nvlinks,
            lost: g.lost,
            errors: g.errors,
            processes: g.processes,
            cgroup_memory_limits: g.cgroup_memory_limits,
        });
    }
    for (i, g) in gpus.iter().enumerate() {
        if let Some(j) = gpus[..i].iter().position(|o| o.pci_bus_id == g.pci_bus_id) {
            return Err(format!(
                "gpus[{i}]: PCI bus id {} is also gpus[{j}]'s",
                g.pci_bus_id
            ));
        }
    }
    Ok(Config {
        driver_version: file.driver_version,
        cuda_driver_version: file.cuda_driver_version,
        init_error: file.init_error,
        memory_limits: file.memory_limits,
        gpus,
        events: file.events,
    })
}
