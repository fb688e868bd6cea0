//! What NVML says of a GPU: the periodic probe, per-task and MIG samples, and the critical-event watch.

use super::*;

use gpuctl_core::time::now_ms;

pub(super) const LOST: &str = "GPU is lost (fallen off the bus or inaccessible)";

pub(super) fn describe(what: &str, e: &NvmlError) -> String {
    match e {
        NvmlError::GpuLost => LOST.to_string(),
        e => format!("probe failed: {what}: {e}"),
    }
}

/// Reads a GPU's gauges, and its MIG devices' and its tasks' memory when
/// it passes.
pub(super) fn probe_device(
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
pub(super) fn probe_tasks(
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
pub(super) fn probe_task_utilization(
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
pub(super) fn probe_gpu(dev: &Device) -> Probe {
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

pub(super) const WATCHED_EVENTS: EventTypes =
    EventTypes::CRITICAL_XID_ERROR.union(EventTypes::DOUBLE_BIT_ECC_ERROR);

/// Reads the MIG devices NVML lists now under a GPU in MIG mode: their
/// memory, and their utilization where NVML gives it. What cannot be read
/// is left out (logged at debug): the parent's probe, not this, decides
/// its health.
pub(super) fn probe_mig(uuid: &str, dev: &Device) -> Vec<MigSample> {
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
pub(super) fn event_set<'n>(
    nvml: &'n Nvml,
    uuids: &[String],
) -> (Option<EventSet<'n>>, BTreeSet<String>) {
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
