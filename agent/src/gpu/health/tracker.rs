//! The pure state machine of each GPU's health: probes, XIDs and ECC errors in, healthy or not (with hysteresis) and resets out.

use super::*;

pub(super) struct Tracked {
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
pub(super) fn xid_meaning(xid: u64) -> &'static str {
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
    pub(super) fn gpu_of(&self, device: &str) -> Option<&GpuHealth> {
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
