//! GPUs shared by fractions (issue 34). An admin marks a GPU shareable
//! (`ShareGpu`, with its mode); from then on it is given only as
//! fractions (`--gpu-mem`, `--gpu-compute`), never whole nor split into
//! MIG devices. What a GPU's fractions hold is counted from the tasks that
//! hold them (`TaskRecord::fraction`), so it cannot drift from them; a
//! launch is refused unless the GPU's memory and its 100% of compute
//! hold every fraction on it.
//!
//! Frameworks are offered a shared GPU with what its fractions leave
//! ([`State::free_shares`]) and launch fractions of it, checked here alike.

use gpuctl_core::types::{GpuFraction, GpuInfo, ShareMode};

use super::{AgentRecord, ApplyError, Outcome, State};

/// A shared GPU that fractions may take now, with what its fractions leave.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FreeShare<'s> {
    pub gpu: &'s GpuInfo,
    pub mode: ShareMode,
    /// Memory no fraction holds, MiB.
    pub mem_mib: u64,
    /// Compute no fraction holds, percent.
    pub compute_pct: u32,
}

impl State {
    /// How a GPU is shared; `None`: it is not.
    pub fn share_mode(&self, gpu_uuid: &str) -> Option<ShareMode> {
        self.shared.get(gpu_uuid).copied()
    }

    /// What the fractions on a GPU of `agent_id` hold: memory (MiB) and
    /// compute (percent), over its tasks that hold resources.
    pub fn share_used(&self, agent_id: &str, gpu_uuid: &str) -> (u64, u32) {
        self.tasks
            .on(agent_id)
            .filter(|t| t.holds_resources() && t.gpu_uuids.iter().any(|g| g == gpu_uuid))
            .filter_map(|t| t.fraction)
            .fold((0, 0), |(m, c), f| {
                (m.saturating_add(f.mem_mib), c.saturating_add(f.compute_pct))
            })
    }

    /// The tasks holding fractions of a GPU of `agent_id`.
    pub fn share_holders<'s>(
        &'s self,
        agent_id: &'s str,
        gpu_uuid: &'s str,
    ) -> impl Iterator<Item = (&'s str, GpuFraction)> + 's {
        self.tasks
            .on(agent_id)
            .filter(move |t| t.holds_resources() && t.gpu_uuids.iter().any(|g| g == gpu_uuid))
            .filter_map(|t| Some((t.id.as_str(), t.fraction?)))
    }

    /// The shared GPUs of `agent` that fractions may take now (healthy,
    /// not cordoned, not in MIG mode nor being repartitioned, not held
    /// whole), with what their fractions leave. The same GPUs
    /// `check_fraction` accepts.
    pub fn free_shares<'s>(
        &'s self,
        agent: &'s AgentRecord,
    ) -> impl Iterator<Item = FreeShare<'s>> + 's {
        agent.info.gpus.iter().filter_map(move |g| {
            let mode = self.share_mode(&g.uuid)?;
            if !g.healthy
                || g.mig.enabled
                || self.cordoned.contains(&g.uuid)
                || self.mig_changes.contains_key(&g.uuid)
                || self.gpu_owner.contains_key(&g.uuid)
            {
                return None;
            }
            let (m, c) = self.share_used(&agent.info.id, &g.uuid);
            Some(FreeShare {
                gpu: g,
                mode,
                mem_mib: g.memory_mib.saturating_sub(m),
                compute_pct: 100u32.saturating_sub(c),
            })
        })
    }

    /// Whether any GPU is shared (most clusters: none, and the offer
    /// cycle skips looking for them).
    pub fn has_shared_gpus(&self) -> bool {
        !self.shared.is_empty()
    }

    /// Whether `f` fits beside `used` on `gpu`.
    pub fn fraction_fits(gpu: &GpuInfo, used: (u64, u32), f: GpuFraction) -> bool {
        used.0.saturating_add(f.mem_mib) <= gpu.memory_mib
            && used.1.saturating_add(f.compute_pct) <= 100
    }

    pub(super) fn share_gpu(
        &mut self,
        gpu_uuid: &str,
        mode: Option<ShareMode>,
    ) -> Result<Outcome, ApplyError> {
        let invalid = |reason: String| ApplyError::Invalid {
            field: "uuid".into(),
            reason,
        };
        let Some((agent_id, gpu)) = self.agents.values().find_map(|a| {
            a.info
                .gpus
                .iter()
                .find(|g| g.uuid == gpu_uuid)
                .map(|g| (a.info.id.as_str(), g))
        }) else {
            return Err(invalid(format!("no agent has GPU {gpu_uuid}")));
        };
        match mode {
            Some(_) => {
                if gpu.mig.enabled || gpu.mig.pending == Some(true) {
                    return Err(invalid(format!(
                        "GPU {gpu_uuid} is in MIG mode: it is shared through its MIG devices (gpuctl gpus mig set --disable first)"
                    )));
                }
                if let Some(c) = self.mig_changes.get(gpu_uuid) {
                    return Err(invalid(format!(
                        "GPU {gpu_uuid} is being repartitioned (change {})",
                        c.generation
                    )));
                }
                if let Some(t) = self.gpu_owner.get(gpu_uuid) {
                    return Err(invalid(format!(
                        "GPU {gpu_uuid} is held whole by task {t}: it can be shared once that ends"
                    )));
                }
                let current = self.shared.get(gpu_uuid).copied();
                if current.is_some() && current != mode {
                    if let Some((t, _)) = self.share_holders(agent_id, gpu_uuid).next() {
                        return Err(invalid(format!(
                            "GPU {gpu_uuid} has fractions held (task {t}): its mode changes once they end"
                        )));
                    }
                }
            }
            None => {
                if let Some((t, _)) = self.share_holders(agent_id, gpu_uuid).next() {
                    return Err(invalid(format!(
                        "GPU {gpu_uuid} has fractions held (task {t}): it stops being shared once they end"
                    )));
                }
            }
        }
        self.agents.mark_gpu(gpu_uuid);
        match mode {
            Some(m) => {
                self.share_off.remove(gpu_uuid);
                self.shared.insert(gpu_uuid.to_string(), m);
            }
            None => {
                self.share_off.insert(gpu_uuid.to_string());
                self.shared.remove(gpu_uuid);
            }
        }
        Ok(Outcome::Done)
    }

    /// An agent's default (`--share-gpus`), applied when it registers: each
    /// of its GPUs no admin decided on, not in MIG mode (nor going there or
    /// being repartitioned) and not held whole, is shared in that mode. A
    /// GPU already shared keeps its mode.
    pub(super) fn share_by_default(&mut self, info: &gpuctl_core::types::AgentInfo) {
        let Some(mode) = info.share_gpus else {
            return;
        };
        let unshared: Vec<String> = self.unshared_by_default(info).cloned().collect();
        for uuid in unshared {
            self.agents.mark_gpu(&uuid);
            self.shared.insert(uuid, mode);
        }
    }

    /// Whether `share_by_default` would share a GPU of `info`.
    pub(super) fn would_share_by_default(&self, info: &gpuctl_core::types::AgentInfo) -> bool {
        info.share_gpus.is_some() && self.unshared_by_default(info).next().is_some()
    }

    /// The GPUs of `info` its agent's default would share now: free (no
    /// MIG, no change pending, no task) and neither shared nor kept whole.
    fn unshared_by_default<'a>(
        &'a self,
        info: &'a gpuctl_core::types::AgentInfo,
    ) -> impl Iterator<Item = &'a String> + 'a {
        info.gpus
            .iter()
            .filter(|g| {
                !g.mig.enabled
                    && g.mig.pending != Some(true)
                    && !self.mig_changes.contains_key(&g.uuid)
                    && !self.gpu_owner.contains_key(&g.uuid)
                    && !self.share_off.contains(&g.uuid)
                    && !self.shared.contains_key(&g.uuid)
            })
            .map(|g| &g.uuid)
    }
}
