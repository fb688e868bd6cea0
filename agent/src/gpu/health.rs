//! GPU health checks: a periodic NVML probe of every GPU and a watch of
//! NVML's critical events (XID errors, double-bit ECC errors).
//!
//! A GPU turns unhealthy at once when it is lost, fails the probe, raises a
//! critical XID that is not on the ignore list (by default the XIDs an
//! application causes itself), or reports a double-bit ECC error. It comes
//! back only after passing every probe for `recovery` with no new fault:
//! hysteresis, so that a flapping GPU does not take work, fail it and take
//! more. The state machine ([`Tracker`]) is pure and tested without NVML;
//! [`spawn`] runs it against NVML on a thread of its own (NVML blocks).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuctl_core::types::{GpuInfo, GpuReport, GpuSample};
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, EventSet, Nvml};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::procs;

/// XIDs caused by applications, not by the GPU (NVIDIA's device plugin
/// ignores the same by default): 13 graphics engine exception, 31 memory
/// page fault, 43 GPU stopped processing, 45 preemptive cleanup, 68 video
/// processor exception, 109 context switch timeout.
pub const DEFAULT_IGNORED_XIDS: &[u64] = &[13, 31, 43, 45, 68, 109];

/// Longest a blocking NVML event wait lasts, so that stopping is prompt.
const MAX_WAIT: Duration = Duration::from_millis(500);

#[derive(Debug, Clone, PartialEq)]
pub struct HealthConfig {
    /// Between two probes of every GPU.
    pub interval: Duration,
    /// How long an unhealthy GPU must pass its probes, with no new fault,
    /// before it returns to service.
    pub recovery: Duration,
    /// XIDs an application causes: counted, the GPU stays in service.
    pub ignored_xids: BTreeSet<u64>,
    /// XIDs that mean the node needs service: every GPU is withdrawn.
    pub node_xids: BTreeSet<u64>,
    /// How a GPU is reset (`{uuid}`, `{index}` replaced); empty: never.
    pub reset_command: Vec<String>,
    /// Resets of one GPU before it stays out of service.
    pub max_resets: u32,
    /// A job's preflight also runs this per device (`{uuid}`, `{index}`
    /// replaced; a tiny CUDA or NCCL test, a memory test); empty: none.
    pub preflight_command: Vec<String>,
    /// How long the preflight command may take.
    pub preflight_timeout: Duration,
    /// Where the GPUs waiting for a reset are recorded, so that an agent
    /// restarted meanwhile keeps them out until the reset (a restart is no
    /// repair); None: not recorded.
    pub state_file: Option<PathBuf>,
}

/// The file, in the agent's work dir, of [`HealthConfig::state_file`].
pub const STATE_FILE: &str = "gpu-health.json";

/// What [`HealthConfig::state_file`] holds: each GPU waiting for a reset,
/// with why it is out.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Saved {
    awaiting_reset: BTreeMap<String, String>,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            interval: Duration::from_secs(5),
            recovery: Duration::from_secs(60),
            ignored_xids: DEFAULT_IGNORED_XIDS.iter().copied().collect(),
            node_xids: BTreeSet::new(),
            reset_command: ["nvidia-smi", "--gpu-reset", "-i", "{uuid}"]
                .map(String::from)
                .to_vec(),
            max_resets: 3,
            preflight_command: Vec::new(),
            preflight_timeout: Duration::from_secs(60),
            state_file: None,
        }
    }
}

/// A task's preflight (`--preflight`): check these devices (GPUs or MIG
/// devices of this agent) before it starts. The answer is `Err` with why
/// when one failed; that GPU has then been withdrawn (see [`preflight`]).
pub struct PreflightRequest {
    pub devices: Vec<String>,
    pub reply: tokio::sync::oneshot::Sender<Result<(), PreflightFailed>>,
}

/// Why a preflight failed, and the GPU that failed it when it was one of
/// this agent's (withdrawn by then).
#[derive(Debug, Clone, PartialEq)]
pub struct PreflightFailed {
    pub gpu: Option<String>,
    pub why: String,
}

/// Where the executor sends preflight requests: the health thread, which
/// owns NVML and the GPUs' health; `timeout` is the command's per device.
#[derive(Clone)]
pub struct PreflightTx {
    pub tx: std::sync::mpsc::Sender<PreflightRequest>,
    pub timeout: Duration,
}

/// What a critical XID calls for, after the "immediate action" of NVIDIA's
/// XID catalog (docs.nvidia.com/deploy/xid-errors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XidAction {
    /// RESTART_APP: the application's own error. The GPU stays in
    /// service; the task fails by itself if it cannot go on.
    App,
    /// RESET_GPU: the GPU is withdrawn, its tasks are stopped and
    /// requeued, and once nothing runs on it the agent resets it and gives
    /// it back if its probe then passes. Unknown XIDs are treated so.
    ResetGpu,
    /// RESTART_BM: the node needs service: every GPU is withdrawn until
    /// the agent restarts (after the operator's repair or reboot).
    Node,
}

impl XidAction {
    pub fn words(self) -> &'static str {
        match self {
            XidAction::App => "an application's error, the GPU stays in service",
            XidAction::ResetGpu => "the GPU needs a reset",
            XidAction::Node => "the node needs service",
        }
    }
}

/// Which action an XID calls for: the operator's lists first, then every
/// other XID (known or not) a GPU reset.
pub fn xid_action(xid: Option<u64>, config: &HealthConfig) -> XidAction {
    match xid {
        Some(x) if config.ignored_xids.contains(&x) => XidAction::App,
        Some(x) if config.node_xids.contains(&x) => XidAction::Node,
        _ => XidAction::ResetGpu,
    }
}

/// One reading of a MIG device. A MIG device has no health of its own: its
/// parent's checks decide for it.
#[derive(Debug, Clone, PartialEq)]
pub struct MigSample {
    pub uuid: String,
    /// `1g.10gb`; empty when NVML's name does not say.
    pub profile: String,
    pub memory_used_mib: u64,
    pub memory_total_mib: u64,
    /// None where NVML does not give it: real drivers answer NOT_SUPPORTED
    /// for a MIG device's utilization, and absent is not 0.
    pub utilization_pct: Option<u32>,
}

/// What the checks know about one GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuHealth {
    pub uuid: String,
    pub index: u32,
    pub model: String,
    pub healthy: bool,
    /// Why it is unhealthy (the first fault since it was last healthy).
    pub reason: String,
    pub sample: Option<GpuSample>,
    /// Its MIG devices' readings, as NVML lists them at the last probe (so
    /// they follow layout changes); empty out of MIG mode or when the GPU
    /// failed its probe.
    pub mig: Vec<MigSample>,
    /// Critical XID events seen, by XID, ignored ones included.
    pub xid_errors: BTreeMap<u64, u64>,
    pub double_bit_ecc_errors: u64,
}

impl GpuHealth {
    pub fn report(&self) -> GpuReport {
        GpuReport {
            uuid: self.uuid.clone(),
            healthy: self.healthy,
            unhealthy_reason: self.reason.clone(),
            sample: self.sample.clone(),
        }
    }
}

/// The checks' view of every GPU; `generation` moves when any GPU's health
/// changes (not on every sample), so that listeners can act on changes only.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub gpus: Vec<GpuHealth>,
    pub generation: u64,
}

impl Snapshot {
    /// Unhealthy GPUs and why, by UUID.
    pub fn faults(&self) -> BTreeMap<String, String> {
        self.gpus
            .iter()
            .filter(|g| !g.healthy)
            .map(|g| (g.uuid.clone(), g.reason.clone()))
            .collect()
    }
}

/// A fault NVML reported as an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A critical XID error; `None`: NVML could not tell which.
    Xid(Option<u64>),
    DoubleBitEcc,
}

/// A probe's outcome for one GPU.
#[derive(Debug, Clone, PartialEq)]
pub enum Probe {
    Passed(GpuSample),
    Failed(String),
}

struct Tracked {
    health: GpuHealth,
    /// While unhealthy: since when it has passed every probe with no new
    /// fault (None: it has not passed one since its last fault).
    passing_since: Option<Instant>,
    /// It comes back only through a reset (a RESET_GPU XID), not by
    /// passing its probes.
    needs_reset: bool,
    /// Resets done since the agent started.
    resets: u32,
    /// Out until the agent restarts: the node needs service, or its
    /// resets are spent.
    stays_out: bool,
}

/// The health state machine of an agent's GPUs.
pub struct Tracker {
    config: HealthConfig,
    gpus: Vec<Tracked>,
    generation: u64,
}

/// A short description of the XIDs that most often mean a broken GPU.
fn xid_meaning(xid: u64) -> &'static str {
    match xid {
        48 => "double-bit ECC error",
        61 | 62 => "internal micro-controller error",
        63 | 64 => "ECC page retirement or row remapping",
        74 => "NVLink error",
        79 => "GPU has fallen off the bus",
        92 => "high single-bit ECC error rate",
        94 => "contained ECC error",
        95 => "uncontained ECC error",
        119 | 120 => "GSP error",
        _ => "critical error",
    }
}

impl Tracker {
    /// Starts from discovery's view: a GPU discovery found broken starts
    /// unhealthy with discovery's reason, and one that was waiting for a
    /// reset when the agent last stopped (its state file) waits again, its
    /// resets counted afresh.
    pub fn new(config: HealthConfig, gpus: &[GpuInfo]) -> Tracker {
        let saved = config.state_file.as_deref().map_or_else(Saved::default, |p| {
            crate::checkpoint::read_json::<Saved>(p)
                .unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "unreadable GPU health record: GPUs waiting for a reset are not known");
                    None
                })
                .unwrap_or_default()
        });
        let mut tracker = Tracker {
            gpus: gpus
                .iter()
                .map(|g| Tracked {
                    health: GpuHealth {
                        uuid: g.uuid.clone(),
                        index: g.index,
                        model: g.model.clone(),
                        healthy: g.healthy,
                        reason: g.unhealthy_reason.clone(),
                        sample: None,
                        mig: Vec::new(),
                        xid_errors: BTreeMap::new(),
                        double_bit_ecc_errors: 0,
                    },
                    passing_since: None,
                    needs_reset: false,
                    resets: 0,
                    stays_out: false,
                })
                .collect(),
            config,
            generation: 0,
        };
        for (uuid, reason) in saved.awaiting_reset {
            if let Some(t) = tracker.find(&uuid) {
                tracing::warn!(uuid, index = t.health.index, %reason, "GPU was waiting for a reset when the agent stopped: out of service until it is reset");
                t.needs_reset = true;
                t.health.healthy = false;
                // Its resets start again: drop what the last ones said.
                t.health.reason = reason
                    .split("; reset")
                    .next()
                    .unwrap_or_default()
                    .to_string();
            }
        }
        tracker
    }

    /// Records the GPUs waiting for a reset (when they change).
    fn save(&self) {
        let Some(path) = &self.config.state_file else {
            return;
        };
        let saved = Saved {
            awaiting_reset: self
                .gpus
                .iter()
                .filter(|t| t.needs_reset)
                .map(|t| (t.health.uuid.clone(), t.health.reason.clone()))
                .collect(),
        };
        if let Err(e) = crate::checkpoint::write_json(path, &saved) {
            tracing::warn!(error = %e, "could not record the GPUs waiting for a reset");
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            gpus: self.gpus.iter().map(|t| t.health.clone()).collect(),
            generation: self.generation,
        }
    }

    fn find(&mut self, uuid: &str) -> Option<&mut Tracked> {
        self.gpus.iter_mut().find(|t| t.health.uuid == uuid)
    }

    /// Records a fault: the GPU turns unhealthy (keeping the first reason
    /// if it already was) and its recovery clock stops.
    fn fault(&mut self, uuid: &str, reason: String) -> bool {
        let Some(t) = self.find(uuid) else {
            return false;
        };
        t.passing_since = None;
        if !t.health.healthy {
            return false;
        }
        tracing::warn!(uuid, index = t.health.index, reason = %reason, "GPU unhealthy: withdrawn from service");
        t.health.healthy = false;
        t.health.reason = reason;
        self.generation += 1;
        true
    }

    /// A probe's outcome; returns whether the GPU's health changed.
    pub fn probe(&mut self, uuid: &str, probe: Probe, now: Instant) -> bool {
        match probe {
            Probe::Failed(reason) => {
                if let Some(t) = self.find(uuid) {
                    t.health.sample = None;
                    t.health.mig.clear();
                }
                self.fault(uuid, reason)
            }
            Probe::Passed(mut sample) => {
                let recovery = self.config.recovery;
                let Some(t) = self.find(uuid) else {
                    return false;
                };
                sample.xid_errors = t.health.xid_errors.values().sum();
                t.health.sample = Some(sample);
                if t.health.healthy || t.needs_reset || t.stays_out {
                    return false;
                }
                let since = *t.passing_since.get_or_insert(now);
                if now.saturating_duration_since(since) < recovery {
                    return false;
                }
                tracing::info!(uuid, index = t.health.index, was = %t.health.reason, "GPU healthy again: back in service");
                t.health.healthy = true;
                t.health.reason.clear();
                t.passing_since = None;
                self.generation += 1;
                true
            }
        }
    }

    /// The readings of a GPU's MIG devices at this probe; they never change
    /// its health.
    pub fn mig(&mut self, uuid: &str, mig: Vec<MigSample>) {
        if let Some(t) = self.find(uuid) {
            t.health.mig = mig;
        }
    }

    /// An NVML event; returns whether the health of a GPU changed.
    pub fn event(&mut self, uuid: &str, event: Event) -> bool {
        let action = match event {
            Event::Xid(xid) => xid_action(xid, &self.config),
            // NVIDIA: a double-bit ECC error (XID 48) calls for a reset.
            Event::DoubleBitEcc => XidAction::ResetGpu,
        };
        let Some(t) = self.find(uuid) else {
            return false;
        };
        let index = t.health.index;
        let what = match event {
            Event::Xid(xid) => {
                let code = xid.unwrap_or(999);
                *t.health.xid_errors.entry(code).or_insert(0) += 1;
                if let Some(s) = &mut t.health.sample {
                    s.xid_errors += 1;
                }
                if action == XidAction::App {
                    tracing::info!(
                        uuid,
                        xid = code,
                        "XID error caused by an application; the GPU stays in service"
                    );
                    return false;
                }
                match xid {
                    Some(x) => format!("XID {x} ({})", xid_meaning(x)),
                    None => "XID error of unknown kind".to_string(),
                }
            }
            Event::DoubleBitEcc => {
                t.health.double_bit_ecc_errors += 1;
                "double-bit ECC error".to_string()
            }
        };
        if action == XidAction::Node {
            let reason = format!("node needs service: {what} on GPU {index}");
            let mut changed = false;
            for t in &mut self.gpus {
                t.stays_out = true;
                t.needs_reset = false;
            }
            let all: Vec<String> = self.gpus.iter().map(|t| t.health.uuid.clone()).collect();
            for u in all {
                changed |= self.fault(&u, reason.clone());
            }
            return changed;
        }
        if let Some(t) = self.find(uuid) {
            if !t.stays_out {
                t.needs_reset = true;
            }
        }
        let changed = self.fault(uuid, format!("{what}: {}", action.words()));
        self.save();
        changed
    }

    /// Withdraws a GPU that failed a job's preflight: out of service until
    /// a reset (when resets are configured) and the probe after it pass,
    /// as for an XID that calls for a reset.
    pub fn withdraw(&mut self, uuid: &str, reason: String) -> bool {
        if let Some(t) = self.find(uuid) {
            if !t.stays_out {
                t.needs_reset = true;
            }
        }
        let changed = self.fault(uuid, reason);
        self.save();
        changed
    }

    /// The GPU a device is or belongs to (a MIG device: its parent, as
    /// the last probe listed it): its UUID, index, health and reason.
    fn gpu_of(&self, device: &str) -> Option<&GpuHealth> {
        self.gpus
            .iter()
            .map(|t| &t.health)
            .find(|h| h.uuid == device || h.mig.iter().any(|m| m.uuid == device))
    }

    /// GPUs waiting for a reset that may still have one.
    pub fn to_reset(&self) -> Vec<(String, u32)> {
        self.gpus
            .iter()
            .filter(|t| {
                t.needs_reset
                    && !t.stays_out
                    && t.resets < self.config.max_resets
                    && !self.config.reset_command.is_empty()
            })
            .map(|t| (t.health.uuid.clone(), t.health.index))
            .collect()
    }

    /// A reset was tried (`Err`: the command failed) and the GPU probed
    /// after it; returns whether its health changed. It is back only if
    /// both passed; after `max_resets` it stays out.
    pub fn reset_done(&mut self, uuid: &str, result: Result<(), String>, probe: Probe) -> bool {
        let max = self.config.max_resets;
        let Some(t) = self.find(uuid) else {
            return false;
        };
        t.resets += 1;
        let n = t.resets;
        match (result, probe) {
            (Ok(()), Probe::Passed(sample)) => {
                tracing::info!(uuid, index = t.health.index, was = %t.health.reason, resets = n, "GPU reset and probed: back in service");
                t.health.sample = Some(sample);
                t.health.healthy = true;
                t.health.reason.clear();
                t.needs_reset = false;
                t.passing_since = None;
                self.generation += 1;
                self.save();
                true
            }
            (result, probe) => {
                let why = match (result, probe) {
                    (Err(e), _) => format!("reset failed: {e}"),
                    (Ok(()), Probe::Failed(e)) => format!("probe after reset failed: {e}"),
                    (Ok(()), Probe::Passed(_)) => String::new(),
                };
                tracing::warn!(uuid, index = t.health.index, resets = n, %why, "GPU reset did not bring it back");
                if n >= max {
                    t.stays_out = true;
                    let first = t
                        .health
                        .reason
                        .split("; reset")
                        .next()
                        .unwrap_or_default()
                        .to_string();
                    t.health.reason = format!(
                        "{first}; reset {n} times ({why}): stays out of service until the agent restarts"
                    );
                    self.generation += 1;
                    self.save();
                    return true;
                }
                false
            }
        }
    }
}

use gpuctl_core::time::now_ms;

const LOST: &str = "GPU is lost (fallen off the bus or inaccessible)";

fn describe(what: &str, e: &NvmlError) -> String {
    match e {
        NvmlError::GpuLost => LOST.to_string(),
        e => format!("probe failed: {what}: {e}"),
    }
}

/// Reads a GPU's gauges, and its MIG devices' and its tasks' memory when
/// it passes.
fn probe_device(
    nvml: &Nvml,
    uuid: &str,
    tasks: Option<(&Path, &procs::TaskCgroups)>,
) -> (Probe, Vec<MigSample>) {
    let dev = match nvml.device_by_uuid(uuid) {
        Ok(d) => d,
        Err(NvmlError::NotFound) => return (Probe::Failed("GPU not found by NVML".into()), vec![]),
        Err(e) => return (Probe::Failed(describe("handle", &e)), vec![]),
    };
    match probe_gpu(&dev) {
        Probe::Passed(mut s) => {
            if let Some((proc_root, cgroups)) = tasks {
                s.task_memory_used_mib = probe_tasks(uuid, &dev, proc_root, cgroups);
                (s.task_utilization_pct, s.task_utilization_read) =
                    probe_task_utilization(uuid, &dev, proc_root, cgroups);
            }
            (Probe::Passed(s), probe_mig(uuid, &dev))
        }
        failed => (failed, vec![]),
    }
}

/// MiB used by each task's processes on the GPU, the largest few that fit
/// in a reading. What cannot be read is left out (logged at debug).
fn probe_tasks(
    uuid: &str,
    dev: &Device,
    proc_root: &Path,
    cgroups: &procs::TaskCgroups,
) -> BTreeMap<String, u64> {
    match procs::device_processes(dev) {
        Ok(p) => procs::largest(
            procs::task_memory(&p, proc_root, cgroups),
            gpuctl_core::convert::MAX_SAMPLE_TASKS,
        ),
        Err(e) => {
            tracing::debug!(uuid, error = %e, "GPU processes not read");
            BTreeMap::new()
        }
    }
}

/// Each task's processes' share of the GPU's SMs (NVML's per-process
/// utilization samples, the latest per process), the largest few that fit
/// in a reading, and whether they were read: NVML's "not found" (no process
/// has a sample) is a reading of none; a GPU that does not answer (older
/// drivers, an error) gives none and false (logged at debug).
fn probe_task_utilization(
    uuid: &str,
    dev: &Device,
    proc_root: &Path,
    cgroups: &procs::TaskCgroups,
) -> (BTreeMap<String, u32>, bool) {
    match dev.process_utilization_stats(None) {
        Ok(samples) => {
            // The newest sample of each process.
            let mut latest: BTreeMap<u32, (u64, u32)> = BTreeMap::new();
            for s in samples {
                let e = latest.entry(s.pid).or_insert((0, 0));
                if s.timestamp >= e.0 {
                    *e = (s.timestamp, s.sm_util);
                }
            }
            let per_pid: Vec<(u32, u32)> = latest.into_iter().map(|(p, (_, u))| (p, u)).collect();
            let mut by_task = procs::task_utilization(&per_pid, proc_root, cgroups);
            // The busiest tasks only: past the limit (more tasks than a
            // GPU's fractions can be in practice) the least busy read 0.
            if by_task.len() > gpuctl_core::convert::MAX_SAMPLE_TASKS {
                let mut v: Vec<(String, u32)> = by_task.into_iter().collect();
                v.sort_by_key(|e| std::cmp::Reverse(e.1));
                v.truncate(gpuctl_core::convert::MAX_SAMPLE_TASKS);
                by_task = v.into_iter().collect();
            }
            (by_task, true)
        }
        // NVML's answer when no process has a sample: all used none.
        Err(NvmlError::NotFound) => (BTreeMap::new(), true),
        Err(e) => {
            tracing::debug!(uuid, error = %e, "GPU process utilization not read");
            (BTreeMap::new(), false)
        }
    }
}

/// Reads a GPU's gauges. The GPU must answer its memory and utilization
/// queries; temperature and power are read when supported, and a GPU that
/// is lost there fails too.
fn probe_gpu(dev: &Device) -> Probe {
    let memory = match dev.memory_info() {
        Ok(m) => m,
        Err(e) => return Probe::Failed(describe("memory", &e)),
    };
    let utilization_pct = match dev.utilization_rates() {
        Ok(u) => u.gpu.min(100),
        Err(NvmlError::NotSupported) => 0,
        Err(e) => return Probe::Failed(describe("utilization", &e)),
    };
    let optional = |r: Result<u32, NvmlError>| match r {
        Ok(v) => Ok(Some(v)),
        Err(NvmlError::GpuLost) => Err(LOST.to_string()),
        Err(_) => Ok(None),
    };
    let temperature_c = match optional(dev.temperature(TemperatureSensor::Gpu)) {
        Ok(t) => t,
        Err(e) => return Probe::Failed(e),
    };
    let power_mw = match optional(dev.power_usage()) {
        Ok(p) => p,
        Err(e) => return Probe::Failed(e),
    };
    Probe::Passed(GpuSample {
        utilization_pct,
        memory_used_mib: memory.used / (1024 * 1024),
        memory_total_mib: memory.total / (1024 * 1024),
        temperature_c,
        power_w: power_mw.map(|mw| f64::from(mw) / 1000.0),
        sampled_at_ms: now_ms(),
        xid_errors: 0,
        task_memory_used_mib: BTreeMap::new(),
        task_utilization_pct: BTreeMap::new(),
        task_utilization_read: false,
    })
}

const WATCHED_EVENTS: EventTypes =
    EventTypes::CRITICAL_XID_ERROR.union(EventTypes::DOUBLE_BIT_ECC_ERROR);

/// Reads the MIG devices NVML lists now under a GPU in MIG mode: their
/// memory, and their utilization where NVML gives it. What cannot be read
/// is left out (logged at debug): the parent's probe, not this, decides
/// its health.
fn probe_mig(uuid: &str, dev: &Device) -> Vec<MigSample> {
    let enabled = dev.mig_mode().is_ok_and(|m| m.current != 0);
    if !enabled {
        return Vec::new();
    }
    let max = match dev.mig_device_count() {
        Ok(n) => n,
        Err(e) => {
            tracing::debug!(uuid, error = %e, "MIG devices not read");
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for i in 0..max {
        let mig = match dev.mig_device_by_index(i) {
            Ok(m) => m,
            // An empty slot: fewer devices than the maximum.
            Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
            Err(e) => {
                tracing::debug!(uuid, index = i, error = %e, "MIG device not read");
                continue;
            }
        };
        let read = mig.uuid().and_then(|u| mig.memory_info().map(|m| (u, m)));
        let (mig_uuid, memory) = match read {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(uuid, index = i, error = %e, "MIG device not read");
                continue;
            }
        };
        out.push(MigSample {
            uuid: mig_uuid,
            // Real drivers name a MIG device "<GPU name> MIG 3g.20gb".
            profile: mig
                .name()
                .ok()
                .and_then(|n| n.rsplit_once("MIG ").map(|(_, p)| p.trim().to_string()))
                .unwrap_or_default(),
            memory_used_mib: memory.used / (1024 * 1024),
            memory_total_mib: memory.total / (1024 * 1024),
            utilization_pct: mig.utilization_rates().ok().map(|u| u.gpu.min(100)),
        });
    }
    out
}

/// An event set watching every GPU in `uuids` that supports it; returns
/// it and the GPUs it watches. NVML frees a set when a registration fails,
/// so the set is built again without the GPU that refused.
fn event_set<'n>(nvml: &'n Nvml, uuids: &[String]) -> (Option<EventSet<'n>>, BTreeSet<String>) {
    let mut skip = BTreeSet::new();
    'rebuild: loop {
        let mut set = match nvml.create_event_set() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "NVML events unavailable: XID and ECC errors are not watched");
                return (None, BTreeSet::new());
            }
        };
        let mut watched = BTreeSet::new();
        for uuid in uuids {
            if skip.contains(uuid) {
                continue;
            }
            let types = nvml
                .device_by_uuid(uuid.as_str())
                .and_then(|d: Device| d.supported_event_types().map(|t| (d, t)));
            let (dev, supported) = match types {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(uuid = %uuid, error = %e, "GPU events not watched");
                    skip.insert(uuid.clone());
                    continue;
                }
            };
            let wanted = supported & WATCHED_EVENTS;
            if wanted.is_empty() {
                skip.insert(uuid.clone());
                continue;
            }
            set = match dev.register_events(wanted, set) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(uuid = %uuid, error = %e.error, "GPU events not watched");
                    skip.insert(uuid.clone());
                    continue 'rebuild;
                }
            };
            watched.insert(uuid.clone());
        }
        return (Some(set), watched);
    }
}

/// The GPUs a live task of this agent holds (a reset waits for them).
pub type Busy = Box<dyn Fn() -> BTreeSet<String> + Send>;

/// Longest a reset command may run.
const RESET_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs the reset command for one GPU; `Err` says why it failed.
fn run_reset(command: &[String], uuid: &str, index: u32) -> Result<(), String> {
    run_gpu_command(command, uuid, index, RESET_TIMEOUT)
}

/// Runs an operator's command for one device (`{uuid}` and `{index}`
/// replaced), at most `timeout`; `Err` says how it failed, with the end of
/// what it printed (stdout and stderr together, as a terminal shows them).
fn run_gpu_command(
    command: &[String],
    uuid: &str,
    index: u32,
    timeout: Duration,
) -> Result<(), String> {
    use std::io::Read;
    let args: Vec<String> = command
        .iter()
        .map(|a| {
            a.replace("{uuid}", uuid)
                .replace("{index}", &index.to_string())
        })
        .collect();
    let Some((program, rest)) = args.split_first() else {
        return Err("no command".into());
    };
    // Close-on-exec: no other child spawned meanwhile keeps it open.
    let (reader, writer) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    let writer2 = writer.try_clone().map_err(|e| format!("pipe: {e}"))?;
    let reader = std::fs::File::from(reader);
    // The builder, and with it this side's write ends, is dropped once
    // spawned: the reader ends when the command (and what it left) does.
    let mut child = std::process::Command::new(program)
        .args(rest)
        .stdin(std::process::Stdio::null())
        .stdout(writer)
        .stderr(writer2)
        .spawn()
        .map_err(|e| format!("{program}: {e}"))?;
    // Read on a thread of its own so that a chatty command never blocks
    // on a full pipe; only the last bytes are kept.
    let printed = Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
    let sink = printed.clone();
    std::thread::spawn(move || {
        let mut reader = reader;
        let mut buf = [0u8; 4096];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 {
                break;
            }
            let mut out = sink.lock().unwrap_or_else(|p| p.into_inner());
            out.extend_from_slice(&buf[..n]);
            let excess = out.len().saturating_sub(OUTPUT_KEPT);
            out.drain(..excess);
        }
    });
    let tail = |printed: &std::sync::Mutex<Vec<u8>>| {
        let out = printed.lock().unwrap_or_else(|p| p.into_inner());
        String::from_utf8_lossy(&out).trim().to_string()
    };
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => {
                // What it printed last arrives just after its exit.
                std::thread::sleep(Duration::from_millis(50));
                return Err(format!(
                    "{} exited with {status}: {}",
                    args.join(" "),
                    tail(&printed)
                ));
            }
            Ok(None) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{} took over {timeout:?}: {}",
                    args.join(" "),
                    tail(&printed)
                ));
            }
            Err(e) => return Err(format!("{program}: {e}")),
        }
    }
}

/// What is kept of a command's output for a GPU's reason.
const OUTPUT_KEPT: usize = 400;

/// A task's preflight of `devices` (see [`PreflightRequest`]): each one's
/// GPU must be in service, pass an NVML probe, have no memory pages
/// waiting for retirement (where NVML tells), and pass the operator's
/// command. The first that fails is withdrawn ([`Tracker::withdraw`]) and
/// named in the answer.
fn preflight(
    nvml: &Nvml,
    tracker: &mut Tracker,
    command: &[String],
    timeout: Duration,
    devices: &[String],
) -> Result<(), PreflightFailed> {
    for device in devices {
        let Some(gpu) = tracker.gpu_of(device) else {
            return Err(PreflightFailed {
                gpu: None,
                why: format!("preflight: {device} is not a GPU of this agent"),
            });
        };
        let (uuid, index) = (gpu.uuid.clone(), gpu.index);
        if !gpu.healthy {
            return Err(PreflightFailed {
                why: format!(
                    "preflight: GPU {index} ({uuid}) is out of service: {}",
                    gpu.reason
                ),
                gpu: Some(uuid),
            });
        }
        let failed = match probe_device(nvml, &uuid, None).0 {
            Probe::Failed(why) => Some(why),
            Probe::Passed(_) => None,
        }
        .or_else(|| {
            let dev = nvml.device_by_uuid(uuid.as_str()).ok()?;
            // Newer GPUs remap rows instead and answer NOT_SUPPORTED.
            dev.are_pages_pending_retired()
                .ok()
                .filter(|pending| *pending)
                .map(|_| {
                    "memory pages are waiting for retirement (a reset retires them)".to_string()
                })
        })
        .or_else(|| {
            if command.is_empty() {
                return None;
            }
            run_gpu_command(command, device, index, timeout).err()
        });
        if let Some(why) = failed {
            let reason = format!("preflight failed: {why}");
            tracker.withdraw(&uuid, reason.clone());
            return Err(PreflightFailed {
                why: format!("{reason} (GPU {index}, {uuid}: withdrawn)"),
                gpu: Some(uuid),
            });
        }
    }
    Ok(())
}

/// Runs the checks on a thread until `stop` is set, publishing every change
/// (health or sample) on `tx`. With `tasks`, each sample also carries the
/// memory each task's processes use on the GPU. A GPU that needs a reset
/// gets it once `busy` no longer names it and NVML lists no process on it.
#[allow(clippy::too_many_arguments)]
pub fn spawn(
    nvml_lib: Option<PathBuf>,
    gpus: Vec<GpuInfo>,
    config: HealthConfig,
    tasks: Option<procs::Attribution>,
    busy: Busy,
    tx: watch::Sender<Snapshot>,
    preflights: std::sync::mpsc::Receiver<PreflightRequest>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("gpu-health".into())
        .spawn(move || run(nvml_lib, gpus, config, tasks, busy, tx, preflights, stop))
}

/// Resets the GPUs that need it and are idle, and probes each after.
fn reset_idle(
    nvml: &Nvml,
    tracker: &mut Tracker,
    command: &[String],
    busy: &Busy,
    attribution: Option<(&Path, &procs::TaskCgroups)>,
) {
    let pending = tracker.to_reset();
    if pending.is_empty() {
        return;
    }
    let held = busy();
    for (uuid, index) in pending {
        if held.contains(&uuid) {
            continue;
        }
        // Processes gpuctl does not know of hold it too.
        if let Ok(dev) = nvml.device_by_uuid(uuid.as_str()) {
            if procs::device_processes(&dev).is_ok_and(|p| !p.is_empty()) {
                continue;
            }
        }
        tracing::info!(uuid = %uuid, index, "resetting GPU: nothing runs on it");
        let result = run_reset(command, &uuid, index);
        let (probe, mig) = probe_device(nvml, &uuid, attribution);
        tracker.reset_done(&uuid, result, probe);
        tracker.mig(&uuid, mig);
    }
}

#[allow(clippy::too_many_arguments)]
fn run(
    nvml_lib: Option<PathBuf>,
    gpus: Vec<GpuInfo>,
    config: HealthConfig,
    tasks: Option<procs::Attribution>,
    busy: Busy,
    tx: watch::Sender<Snapshot>,
    preflights: std::sync::mpsc::Receiver<PreflightRequest>,
    stop: Arc<AtomicBool>,
) {
    let interval = config.interval;
    let reset_command = config.reset_command.clone();
    let (preflight_command, preflight_timeout) =
        (config.preflight_command.clone(), config.preflight_timeout);
    let mut tracker = Tracker::new(config, &gpus);
    tx.send_replace(tracker.snapshot());
    let init = || match &nvml_lib {
        Some(p) => Nvml::builder().lib_path(p.as_os_str()).init(),
        None => Nvml::init(),
    };
    let nvml = loop {
        match init() {
            Ok(n) => break n,
            Err(e) => {
                for g in &gpus {
                    tracker.probe(
                        &g.uuid,
                        Probe::Failed(format!("NVML unavailable: {e}")),
                        Instant::now(),
                    );
                }
                tx.send_replace(tracker.snapshot());
                if sleep_unless_stopped(&stop, interval) {
                    return;
                }
            }
        }
    };
    let uuids: Vec<String> = gpus.iter().map(|g| g.uuid.clone()).collect();
    let (mut set, mut watched) = event_set(&nvml, &uuids);
    let mut wait_failed = false;
    let mut next_probe = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        // Tasks waiting to start on their preflight come first.
        let mut answered = false;
        while let Ok(req) = preflights.try_recv() {
            let result = preflight(
                &nvml,
                &mut tracker,
                &preflight_command,
                preflight_timeout,
                &req.devices,
            );
            let _ = req.reply.send(result);
            answered = true;
        }
        if answered {
            tx.send_replace(tracker.snapshot());
        }
        let now = Instant::now();
        if now >= next_probe {
            let cgroups = tasks.as_ref().map(|t| (t.cgroups)());
            let attribution = tasks
                .as_ref()
                .zip(cgroups.as_ref())
                .map(|(t, c)| (t.proc_root.as_path(), c));
            for uuid in &uuids {
                let (probe, mig) = probe_device(&nvml, uuid, attribution);
                tracker.probe(uuid, probe, Instant::now());
                tracker.mig(uuid, mig);
            }
            reset_idle(&nvml, &mut tracker, &reset_command, &busy, attribution);
            // A GPU that could not be watched (lost when the set was made)
            // and is healthy again is watched from now on.
            let snapshot = tracker.snapshot();
            if snapshot
                .gpus
                .iter()
                .any(|g| g.healthy && !watched.contains(&g.uuid))
                && watched.len() < uuids.len()
                && set.is_some()
            {
                drop(set);
                (set, watched) = event_set(&nvml, &uuids);
            }
            tx.send_replace(snapshot);
            next_probe = now + interval;
        }
        let wait = next_probe
            .saturating_duration_since(Instant::now())
            .min(MAX_WAIT);
        let Some(s) = &set else {
            if sleep_unless_stopped(&stop, wait) {
                return;
            }
            continue;
        };
        match s.wait(wait.as_millis() as u32) {
            Ok(ev) => {
                wait_failed = false;
                let uuid = ev.device.uuid().or_else(|_| {
                    ev.device
                        .index()
                        .ok()
                        .and_then(|i| gpus.iter().find(|g| g.index == i))
                        .map(|g| g.uuid.clone())
                        .ok_or(NvmlError::NotFound)
                });
                let Ok(uuid) = uuid else {
                    tracing::warn!(kind = ?ev.event_type, "NVML event for a GPU not known here; ignored");
                    continue;
                };
                let event = if ev.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
                    Event::Xid(match ev.event_data {
                        Some(XidError::Value(x)) => Some(x),
                        _ => None,
                    })
                } else {
                    Event::DoubleBitEcc
                };
                tracker.event(&uuid, event);
                tx.send_replace(tracker.snapshot());
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => {
                // Said once per run of failures; the probe still runs.
                if !wait_failed {
                    tracing::warn!(error = %e, "waiting for NVML events failed");
                    wait_failed = true;
                }
                if sleep_unless_stopped(&stop, wait) {
                    return;
                }
            }
        }
    }
}

/// Sleeps `d`, waking early to return true when `stop` is set.
fn sleep_unless_stopped(stop: &AtomicBool, d: Duration) -> bool {
    let end = Instant::now() + d;
    loop {
        if stop.load(Ordering::Relaxed) {
            return true;
        }
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        std::thread::sleep(left.min(Duration::from_millis(50)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker(recovery_secs: u64) -> (Tracker, Instant) {
        let now = Instant::now();
        let mut lost = GpuInfo::new("GPU-1", 1, "A100", 40960);
        lost.healthy = false;
        lost.unhealthy_reason = LOST.into();
        let t = Tracker::new(
            HealthConfig {
                interval: Duration::from_secs(1),
                recovery: Duration::from_secs(recovery_secs),
                ..Default::default()
            },
            &[GpuInfo::new("GPU-0", 0, "A100", 40960), lost],
        );
        (t, now)
    }

    fn sample() -> GpuSample {
        GpuSample {
            utilization_pct: 50,
            memory_used_mib: 100,
            memory_total_mib: 40960,
            ..Default::default()
        }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn discovery_faults_carry_over() {
        let (t, _) = tracker(10);
        let s = t.snapshot();
        assert!(s.gpus[0].healthy);
        assert!(!s.gpus[1].healthy);
        assert_eq!(s.faults()["GPU-1"], LOST);
    }

    #[test]
    fn a_critical_xid_withdraws_the_gpu_and_an_ignored_one_does_not() {
        let (mut t, _) = tracker(10);
        assert!(!t.event("GPU-0", Event::Xid(Some(13))));
        assert!(t.snapshot().gpus[0].healthy);
        assert_eq!(t.snapshot().gpus[0].xid_errors[&13], 1);
        assert!(t.event("GPU-0", Event::Xid(Some(79))));
        let g = &t.snapshot().gpus[0];
        assert!(!g.healthy);
        assert_eq!(
            g.reason,
            "XID 79 (GPU has fallen off the bus): the GPU needs a reset"
        );
        assert_eq!(t.snapshot().generation, 1);
        // A second fault keeps the first reason and is no change.
        assert!(!t.event("GPU-0", Event::DoubleBitEcc));
        assert_eq!(
            t.snapshot().gpus[0].reason,
            "XID 79 (GPU has fallen off the bus): the GPU needs a reset"
        );
        assert_eq!(t.snapshot().gpus[0].double_bit_ecc_errors, 1);
    }

    #[test]
    fn the_ignore_list_is_configurable() {
        let mut t = Tracker::new(
            HealthConfig {
                ignored_xids: [79].into_iter().collect(),
                ..Default::default()
            },
            &[GpuInfo::new("GPU-0", 0, "A100", 40960)],
        );
        assert!(!t.event("GPU-0", Event::Xid(Some(79))));
        assert!(t.event("GPU-0", Event::Xid(Some(13))));
        assert_eq!(
            t.snapshot().gpus[0].reason,
            "XID 13 (critical error): the GPU needs a reset"
        );
        assert_eq!(t.snapshot().gpus[0].xid_errors[&13], 1);
        assert_eq!(t.snapshot().gpus[0].xid_errors.get(&79), Some(&1));
    }

    #[test]
    fn recovery_waits_for_a_quiet_period_and_a_new_fault_restarts_it() {
        let (mut t, now) = tracker(10);
        assert!(t.probe("GPU-0", Probe::Failed(LOST.into()), now));
        assert!(t.snapshot().gpus[0].sample.is_none());
        // Passing again, but not for long enough.
        assert!(!t.probe("GPU-0", Probe::Passed(sample()), now + secs(5)));
        assert!(!t.snapshot().gpus[0].healthy);
        assert_eq!(t.snapshot().gpus[0].sample, Some(sample()));
        // A fault in the quiet period starts it over: the clock runs from
        // the first passing probe after it.
        assert!(!t.probe("GPU-0", Probe::Failed(LOST.into()), now + secs(11)));
        assert!(!t.probe("GPU-0", Probe::Passed(sample()), now + secs(12)));
        assert!(!t.probe("GPU-0", Probe::Passed(sample()), now + secs(21)));
        assert!(!t.snapshot().gpus[0].healthy);
        assert!(t.probe("GPU-0", Probe::Passed(sample()), now + secs(22)));
        let g = &t.snapshot().gpus[0];
        assert!(g.healthy);
        assert!(g.reason.is_empty());
        assert_eq!(t.snapshot().generation, 2);
        // The GPU that discovery found lost recovers the same way.
        assert!(!t.probe("GPU-1", Probe::Passed(sample()), now + secs(1)));
        assert!(t.probe("GPU-1", Probe::Passed(sample()), now + secs(11)));
    }

    /// XIDs handled by what they are (issue 38): an application's leaves
    /// the GPU in service; one that needs a reset keeps it out, however
    /// long its probes pass, until a reset and the probe after it pass;
    /// after `max_resets` it stays out; a node's withdraws every GPU.
    #[test]
    fn xids_are_handled_by_what_they_call_for() {
        let config = HealthConfig {
            recovery: secs(1),
            node_xids: [140].into_iter().collect(),
            max_resets: 3,
            ..Default::default()
        };
        assert_eq!(xid_action(Some(13), &config), XidAction::App);
        assert_eq!(xid_action(Some(79), &config), XidAction::ResetGpu);
        assert_eq!(xid_action(Some(140), &config), XidAction::Node);
        // Unknown ones, conservatively.
        assert_eq!(xid_action(Some(4242), &config), XidAction::ResetGpu);
        assert_eq!(xid_action(None, &config), XidAction::ResetGpu);

        let gpus = [
            GpuInfo::new("GPU-0", 0, "A100", 40960),
            GpuInfo::new("GPU-1", 1, "A100", 40960),
        ];
        let now = Instant::now();
        let mut t = Tracker::new(config.clone(), &gpus);
        assert!(!t.event("GPU-0", Event::Xid(Some(13))));
        assert!(t.snapshot().gpus[0].healthy);
        assert!(t.to_reset().is_empty());

        assert!(t.event("GPU-0", Event::Xid(Some(79))));
        assert_eq!(t.to_reset(), vec![("GPU-0".to_string(), 0)]);
        // Passing probes do not bring it back: only a reset does.
        for s in 0..5 {
            assert!(!t.probe("GPU-0", Probe::Passed(sample()), now + secs(s)));
        }
        assert!(!t.snapshot().gpus[0].healthy);
        assert!(t.reset_done("GPU-0", Ok(()), Probe::Passed(sample())));
        let g = &t.snapshot().gpus[0];
        assert!(g.healthy && g.reason.is_empty(), "{g:?}");
        assert!(t.to_reset().is_empty());

        // Again: a failed reset, a reset whose probe fails, then the third
        // of its three resets fails too: it stays out, saying so.
        assert!(t.event("GPU-0", Event::DoubleBitEcc));
        assert!(!t.reset_done(
            "GPU-0",
            Err("nvidia-smi: busy".into()),
            Probe::Passed(sample())
        ));
        assert_eq!(t.to_reset().len(), 1);
        assert!(t.reset_done("GPU-0", Ok(()), Probe::Failed(LOST.into())));
        let g = &t.snapshot().gpus[0];
        assert!(!g.healthy);
        assert!(
            g.reason
                .starts_with("double-bit ECC error: the GPU needs a reset; reset 3 times")
                && g.reason
                    .ends_with("stays out of service until the agent restarts"),
            "{}",
            g.reason
        );
        assert!(t.to_reset().is_empty());
        assert!(!t.probe("GPU-0", Probe::Passed(sample()), now + secs(100)));

        // A node's XID: every GPU out, none reset.
        let mut t = Tracker::new(config.clone(), &gpus);
        assert!(t.event("GPU-1", Event::Xid(Some(140))));
        for g in t.snapshot().gpus {
            assert!(!g.healthy);
            assert_eq!(
                g.reason,
                "node needs service: XID 140 (critical error) on GPU 1"
            );
        }
        assert!(t.to_reset().is_empty());
        assert!(!t.probe("GPU-0", Probe::Passed(sample()), now + secs(100)));

        // No reset command: a GPU that needs one stays out.
        let mut t = Tracker::new(
            HealthConfig {
                reset_command: Vec::new(),
                ..config
            },
            &gpus,
        );
        assert!(t.event("GPU-0", Event::Xid(Some(79))));
        assert!(t.to_reset().is_empty());
    }

    #[test]
    fn a_reset_command_is_run_with_the_gpu_named_and_its_failure_said() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("out");
        let cmd = |script: &str| -> Vec<String> {
            vec![
                "sh".into(),
                "-c".into(),
                script.into(),
                "reset".into(),
                "{uuid}".into(),
                "{index}".into(),
            ]
        };
        let ok = cmd(&format!("echo \"$1 $2\" > {}", out.display()));
        assert_eq!(run_reset(&ok, "GPU-7", 3), Ok(()));
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "GPU-7 3\n");
        let e = run_reset(&cmd("echo in use >&2; exit 4"), "GPU-7", 3).unwrap_err();
        assert!(e.contains("exit status: 4") && e.ends_with("in use"), "{e}");
        let e = run_reset(&["/nonexistent/gpuctl-reset".to_string()], "GPU-7", 3).unwrap_err();
        assert!(e.starts_with("/nonexistent/gpuctl-reset:"), "{e}");
    }

    #[test]
    fn mig_readings_are_kept_until_a_failed_probe_and_never_change_health() {
        let (mut t, now) = tracker(10);
        let m = MigSample {
            uuid: "MIG-0".into(),
            profile: "1g.5gb".into(),
            memory_used_mib: 1,
            memory_total_mib: 4864,
            utilization_pct: None,
        };
        t.probe("GPU-0", Probe::Passed(sample()), now);
        t.mig("GPU-0", vec![m.clone()]);
        let s = t.snapshot();
        assert_eq!(s.gpus[0].mig, vec![m]);
        assert_eq!(s.generation, 0);
        assert!(t.probe("GPU-0", Probe::Failed(LOST.into()), now));
        assert!(t.snapshot().gpus[0].mig.is_empty());
    }

    #[test]
    fn zero_recovery_returns_at_the_first_passing_probe() {
        let (mut t, now) = tracker(0);
        assert!(t.probe(
            "GPU-0",
            Probe::Failed("probe failed: memory: x".into()),
            now
        ));
        assert!(t.probe("GPU-0", Probe::Passed(sample()), now));
    }

    /// A GPU that failed a job's preflight is out until a reset and the
    /// probe after it pass: passing probes alone do not bring it back.
    #[test]
    fn a_preflight_failure_withdraws_the_gpu_until_a_reset() {
        let (mut t, now) = tracker(0);
        assert!(t.withdraw("GPU-0", "preflight failed: memtest".into()));
        assert_eq!(t.snapshot().faults()["GPU-0"], "preflight failed: memtest");
        assert!(!t.probe("GPU-0", Probe::Passed(sample()), now + secs(60)));
        assert_eq!(t.to_reset(), vec![("GPU-0".to_string(), 0)]);
        assert!(t.reset_done("GPU-0", Ok(()), Probe::Passed(sample())));
        assert!(!t.snapshot().faults().contains_key("GPU-0"));
        // A MIG device is checked as its parent.
        t.mig(
            "GPU-0",
            vec![MigSample {
                uuid: "MIG-0a".into(),
                profile: "1g.10gb".into(),
                memory_used_mib: 0,
                memory_total_mib: 9984,
                utilization_pct: None,
            }],
        );
        assert_eq!(t.gpu_of("MIG-0a").map(|g| g.uuid.as_str()), Some("GPU-0"));
        assert!(t.gpu_of("MIG-9").is_none());
    }

    /// A GPU waiting for a reset when the agent stops waits again after it
    /// starts, however well it probes, and is back only after a reset; a
    /// node's withdrawal and a reset GPU are not carried over.
    #[test]
    fn gpus_waiting_for_a_reset_stay_out_across_an_agent_restart() {
        let dir = tempfile::tempdir().unwrap();
        let config = HealthConfig {
            recovery: Duration::ZERO,
            max_resets: 1,
            node_xids: [119].into(),
            state_file: Some(dir.path().join(STATE_FILE)),
            ..Default::default()
        };
        let gpus = [
            GpuInfo::new("GPU-0", 0, "A100", 40960),
            GpuInfo::new("GPU-1", 1, "A100", 40960),
        ];
        let now = Instant::now();
        let mut t = Tracker::new(config.clone(), &gpus);
        assert!(t.event("GPU-0", Event::Xid(Some(79))));
        // Its one reset fails: it stays out until the agent restarts.
        assert!(t.reset_done("GPU-0", Err("busy".into()), Probe::Passed(sample())));
        assert!(t.withdraw("GPU-1", "preflight failed: memtest".into()));
        assert!(t.reset_done("GPU-1", Ok(()), Probe::Passed(sample())));
        // Restarted: GPU-0 is out again, with its first reason and its
        // resets to do again; GPU-1 (reset since) is in service.
        let mut t = Tracker::new(config.clone(), &gpus);
        let faults = t.snapshot().faults();
        assert_eq!(faults.len(), 1, "{faults:?}");
        assert!(faults["GPU-0"].starts_with("XID 79"), "{faults:?}");
        assert!(!faults["GPU-0"].contains("; reset"), "{faults:?}");
        assert!(!t.probe("GPU-0", Probe::Passed(sample()), now + secs(60)));
        assert_eq!(t.to_reset(), vec![("GPU-0".to_string(), 0)]);
        assert!(t.reset_done("GPU-0", Ok(()), Probe::Passed(sample())));
        assert!(Tracker::new(config.clone(), &gpus)
            .snapshot()
            .faults()
            .is_empty());
        // A node that needs service is out until the restart, no longer.
        assert!(t.event("GPU-1", Event::Xid(Some(119))));
        assert_eq!(t.snapshot().faults().len(), 2);
        assert!(Tracker::new(config.clone(), &gpus)
            .snapshot()
            .faults()
            .is_empty());
        // An unreadable record: nothing carried, and the agent starts.
        std::fs::write(dir.path().join(STATE_FILE), "{").unwrap();
        assert!(Tracker::new(config, &gpus).snapshot().faults().is_empty());
    }

    #[test]
    fn samples_count_xid_errors_and_unknown_gpus_are_ignored() {
        let (mut t, now) = tracker(10);
        t.event("GPU-0", Event::Xid(Some(13)));
        t.event("GPU-0", Event::Xid(Some(31)));
        t.probe("GPU-0", Probe::Passed(sample()), now);
        assert_eq!(t.snapshot().gpus[0].sample.as_ref().unwrap().xid_errors, 2);
        assert!(!t.event("GPU-9", Event::Xid(Some(79))));
        assert!(!t.probe("GPU-9", Probe::Failed("x".into()), now));
        assert_eq!(t.snapshot().generation, 0);
    }
}
