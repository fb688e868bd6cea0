//! What a launch must satisfy before it changes anything: the devices
//! it names free, healthy and of the kind it asks for, the fractions and
//! ports it takes within what is left, the resources within the agent's.

use std::collections::BTreeSet;

use gpuctl_core::types::{find_device, Device, Resources, Runtime, Wants};

use super::ApplyError;
use super::{AgentState, State};

/// What the launches checked so far in one command take.
#[derive(Debug, Default)]
pub(super) struct Pending {
    pub(super) resources: std::collections::BTreeMap<String, Resources>,
    pub(super) gpus: BTreeSet<String>,
    /// Fractions given, by GPU: memory (MiB) and compute (percent).
    pub(super) shares: std::collections::BTreeMap<String, (u64, u32)>,
    /// Host ports given, by agent.
    pub(super) ports: std::collections::BTreeMap<String, BTreeSet<u16>>,
}

impl State {
    /// Whether `resources` with exactly the devices `gpus` (GPUs, or MIG
    /// devices, as `wants` allows; `None`: a framework's task, which may
    /// name either) fit on the agent now, counting what
    /// earlier launches of the same command (`pending`) took. On success
    /// `pending` includes this launch.
    ///
    /// The device invariant: a GPU or MIG device is never given twice, a
    /// GPU in MIG mode is never given whole, and a MIG device only while
    /// its parent is in MIG mode and not held whole (which the first two
    /// make impossible, and is checked anyway).
    pub(super) fn check_fit(
        &self,
        agent_id: &str,
        runtime: Runtime,
        resources: &Resources,
        gpus: &[String],
        wants: Option<Wants<'_>>,
        pending: &mut Pending,
    ) -> Result<Vec<u16>, ApplyError> {
        let agent = self.known_agent(agent_id)?;
        match agent.state {
            AgentState::Active => {}
            AgentState::Unreachable => {
                return Err(ApplyError::AgentUnreachable(agent_id.to_string()))
            }
            AgentState::Lost => return Err(ApplyError::AgentLost(agent_id.to_string())),
        }
        if agent.drain.is_some() {
            return Err(ApplyError::AgentDraining(agent_id.to_string()));
        }
        if !agent.info.runtimes.contains(&runtime) {
            return Err(ApplyError::DoesNotFit(format!(
                "agent {agent_id} has no {runtime} runtime"
            )));
        }
        let fraction = wants.and_then(Wants::fraction);
        if let Some(f) = fraction {
            self.check_fraction(agent, gpus, f, pending)?;
        } else if gpus.len() != resources.gpus as usize {
            return Err(ApplyError::DoesNotFit(format!(
                "{} GPUs asked for, {} named",
                resources.gpus,
                gpus.len()
            )));
        }
        // (A fraction's GPU was checked above.)
        let devices = if fraction.is_some() { &[][..] } else { gpus };
        for uuid in devices {
            self.check_device(agent_id, agent, uuid, wants, pending)?;
        }
        let more = pending
            .resources
            .get(agent_id)
            .copied()
            .unwrap_or_default()
            .add(resources);
        if !agent.free().fits(&more) {
            return Err(ApplyError::DoesNotFit(format!(
                "agent {agent_id} has {:.2} cpus, {} MiB and {} ports free",
                agent.free().cpus,
                agent.free().mem_mib,
                agent.free().ports
            )));
        }
        let taken = pending.ports.entry(agent_id.to_string()).or_default();
        let ports = self.pick_ports(agent_id, resources.ports, taken)?;
        taken.extend(&ports);
        pending.resources.insert(agent_id.to_string(), more);
        pending.gpus.extend(gpus.iter().cloned());
        Ok(ports)
    }

    /// One GPU or MIG device of a launch: on the agent, what the task
    /// asks for (whole, a MIG device of its profile), healthy, in service,
    /// not being repartitioned, not shared, and held by no one (nor its
    /// parent, nor an earlier launch of the same command).
    fn check_device(
        &self,
        agent_id: &str,
        agent: &super::AgentRecord,
        uuid: &String,
        wants: Option<Wants<'_>>,
        pending: &Pending,
    ) -> Result<(), ApplyError> {
        let Some(device) = find_device(&agent.info.gpus, uuid) else {
            return Err(ApplyError::DoesNotFit(format!(
                "GPU {uuid} is not on agent {agent_id}"
            )));
        };
        let gpu = device.gpu();
        match (device, wants) {
            (Device::Gpu(_), Some(Wants::Mig(p))) => {
                return Err(ApplyError::DoesNotFit(format!(
                    "GPU {uuid} is a whole GPU, the job asks for a MIG device {p}"
                )))
            }
            (Device::Mig { .. }, Some(Wants::Whole)) => {
                return Err(ApplyError::DoesNotFit(format!(
                    "{uuid} is a MIG device, the job asks for whole GPUs"
                )))
            }
            (Device::Mig { device, .. }, Some(Wants::Mig(p))) if device.profile != p => {
                return Err(ApplyError::DoesNotFit(format!(
                    "MIG device {uuid} is a {}, the job asks for a {p}",
                    device.profile
                )))
            }
            (Device::Gpu(g), _) if g.mig.enabled => {
                return Err(ApplyError::DoesNotFit(format!(
                    "GPU {uuid} is in MIG mode: it is used through its MIG devices, never whole"
                )))
            }
            _ => {}
        }
        if !gpu.healthy {
            return Err(ApplyError::DoesNotFit(format!(
                "GPU {} is unhealthy",
                gpu.uuid
            )));
        }
        if self.cordoned.contains(&gpu.uuid) {
            return Err(ApplyError::DoesNotFit(format!(
                "GPU {} is cordoned",
                gpu.uuid
            )));
        }
        if self.mig_changes.contains_key(&gpu.uuid) {
            return Err(ApplyError::DoesNotFit(format!(
                "GPU {} is being repartitioned (MIG layout change)",
                gpu.uuid
            )));
        }
        if let Some(m) = self.shared.get(&gpu.uuid) {
            return Err(ApplyError::DoesNotFit(format!(
                "GPU {} is shared ({m}): it is given only as fractions",
                gpu.uuid
            )));
        }
        // A MIG device's parent must not be held whole, nor the device.
        for held in [uuid.as_str(), gpu.uuid.as_str()] {
            if let Some(owner) = self.gpu_owner.get(held) {
                return Err(ApplyError::GpuTaken {
                    gpu: held.to_string(),
                    task_id: owner.clone(),
                });
            }
        }
        if pending.gpus.contains(uuid) {
            return Err(ApplyError::GpuTaken {
                gpu: uuid.clone(),
                task_id: "another launch in the same command".into(),
            });
        }
        Ok(())
    }

    /// A fraction's one GPU: shared, healthy, not cordoned, and holding
    /// it beside the fractions already there (and those of earlier
    /// launches of the same command, which `pending` gains on success).
    pub(super) fn check_fraction(
        &self,
        agent: &super::AgentRecord,
        gpus: &[String],
        f: gpuctl_core::types::GpuFraction,
        pending: &mut Pending,
    ) -> Result<(), ApplyError> {
        let agent_id = agent.info.id.as_str();
        let [uuid] = gpus else {
            return Err(ApplyError::DoesNotFit(format!(
                "a fraction is of one GPU, {} named",
                gpus.len()
            )));
        };
        let Some(gpu) = agent.info.gpus.iter().find(|g| &g.uuid == uuid) else {
            return Err(ApplyError::DoesNotFit(format!(
                "GPU {uuid} is not on agent {agent_id}"
            )));
        };
        if !self.shared.contains_key(uuid) {
            return Err(ApplyError::DoesNotFit(format!(
                "GPU {uuid} is not shared: fractions go only to GPUs marked shareable (gpuctl gpus share)"
            )));
        }
        if !gpu.healthy {
            return Err(ApplyError::DoesNotFit(format!("GPU {uuid} is unhealthy")));
        }
        if self.cordoned.contains(uuid) {
            return Err(ApplyError::DoesNotFit(format!("GPU {uuid} is cordoned")));
        }
        // Sharing is refused for these; checked anyway.
        if gpu.mig.enabled {
            return Err(ApplyError::DoesNotFit(format!("GPU {uuid} is in MIG mode")));
        }
        if let Some(owner) = self.gpu_owner.get(uuid) {
            return Err(ApplyError::GpuTaken {
                gpu: uuid.clone(),
                task_id: owner.clone(),
            });
        }
        let (mem, pct) = self.share_used(agent_id, uuid);
        let (pm, pp) = pending.shares.get(uuid).copied().unwrap_or_default();
        let used = (mem.saturating_add(pm), pct.saturating_add(pp));
        if !State::fraction_fits(gpu, used, f) {
            return Err(ApplyError::DoesNotFit(format!(
                "GPU {uuid} has {} MiB and {}% of compute left, the fraction asks {} MiB and {}%",
                gpu.memory_mib.saturating_sub(used.0),
                100u32.saturating_sub(used.1),
                f.mem_mib,
                f.compute_pct
            )));
        }
        let e = pending.shares.entry(uuid.clone()).or_default();
        *e = (
            e.0.saturating_add(f.mem_mib),
            e.1.saturating_add(f.compute_pct),
        );
        Ok(())
    }

    /// The `n` lowest ports of the agent's range that no task holding
    /// resources there holds and that are not in `taken`. Deterministic, so
    /// every replica picks the same. The count check (`Resources::ports`)
    /// comes first; this also refuses when the numbers run out (a range
    /// that shrank under tasks holding ports outside it).
    pub(super) fn pick_ports(
        &self,
        agent_id: &str,
        n: u32,
        taken: &BTreeSet<u16>,
    ) -> Result<Vec<u16>, ApplyError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let range = self
            .agents
            .get(agent_id)
            .and_then(|a| a.info.ports)
            .ok_or_else(|| ApplyError::DoesNotFit(format!("agent {agent_id} offers no ports")))?;
        let held: BTreeSet<u16> = self
            .tasks
            .on(agent_id)
            .filter(|t| t.holds_resources())
            .flat_map(|t| t.ports.iter().copied())
            .collect();
        let picked: Vec<u16> = (range.start..=range.end)
            .filter(|p| !held.contains(p) && !taken.contains(p))
            .take(n as usize)
            .collect();
        if picked.len() < n as usize {
            return Err(ApplyError::DoesNotFit(format!(
                "agent {agent_id} has {} of its ports {range} free, {n} asked for",
                picked.len()
            )));
        }
        Ok(picked)
    }
}
