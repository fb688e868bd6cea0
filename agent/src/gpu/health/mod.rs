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

mod commands;
mod probes;
mod tracker;

pub use commands::Busy;
use commands::*;
use probes::*;
pub use tracker::*;

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
    let Some(nvml) = init_nvml(
        nvml_lib.as_deref(),
        &gpus,
        &mut tracker,
        &tx,
        &stop,
        interval,
    ) else {
        return;
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
                let Some((uuid, event)) = event_of(&ev, &gpus) else {
                    tracing::warn!(kind = ?ev.event_type, "NVML event for a GPU not known here; ignored");
                    continue;
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

/// NVML, once it loads: until then every GPU fails its probe, every
/// `interval`; `None` when `stop` is set first.
fn init_nvml(
    nvml_lib: Option<&std::path::Path>,
    gpus: &[GpuInfo],
    tracker: &mut Tracker,
    tx: &watch::Sender<Snapshot>,
    stop: &AtomicBool,
    interval: Duration,
) -> Option<Nvml> {
    loop {
        let init = match nvml_lib {
            Some(p) => Nvml::builder().lib_path(p.as_os_str()).init(),
            None => Nvml::init(),
        };
        match init {
            Ok(n) => return Some(n),
            Err(e) => {
                for g in gpus {
                    tracker.probe(
                        &g.uuid,
                        Probe::Failed(format!("NVML unavailable: {e}")),
                        Instant::now(),
                    );
                }
                tx.send_replace(tracker.snapshot());
                if sleep_unless_stopped(stop, interval) {
                    return None;
                }
            }
        }
    }
}

/// An NVML event as the tracker takes it, with its GPU's UUID (found by
/// index when the event's device gives none); `None` for a GPU not known
/// here.
fn event_of(
    ev: &nvml_wrapper::struct_wrappers::event::EventData<'_>,
    gpus: &[GpuInfo],
) -> Option<(String, Event)> {
    let uuid = ev.device.uuid().or_else(|_| {
        ev.device
            .index()
            .ok()
            .and_then(|i| gpus.iter().find(|g| g.index == i))
            .map(|g| g.uuid.clone())
            .ok_or(NvmlError::NotFound)
    });
    let uuid = uuid.ok()?;
    let event = if ev.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
        Event::Xid(match ev.event_data {
            Some(XidError::Value(x)) => Some(x),
            _ => None,
        })
    } else {
        Event::DoubleBitEcc
    };
    Some((uuid, event))
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
