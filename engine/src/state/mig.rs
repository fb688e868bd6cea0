//! MIG layout changes in the state machine. A change is replicated before
//! anything happens on the GPU: once `SetMigLayout` is applied, nothing
//! is placed on the GPU or its MIG devices until its agent reports what
//! NVML holds afterwards (`MigLayoutDone`), which then becomes the GPU's
//! MIG state. A GPU that anything holds (itself or a MIG device) is never
//! changed.

use serde::{Deserialize, Serialize};

use gpuctl_core::types::{device_count, AgentId, GpuInfo, GpuUuid};

use super::{AgentState, ApplyError, Outcome, State};

/// Most MIG devices a layout may ask for (NVML's most on one GPU is 7).
pub const MAX_LAYOUT_DEVICES: usize = 16;

/// A layout asked of a GPU and not yet applied by its agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigChange {
    pub agent_id: AgentId,
    pub gpu_uuid: GpuUuid,
    /// The log index that asked it: the agent applies each generation
    /// once and reports it, so a late report of an older one is ignored.
    pub generation: u64,
    /// Its MIG devices afterwards, by profile.
    pub profiles: Vec<String>,
    /// MIG mode off instead.
    pub disable: bool,
    pub asked_at_ms: u64,
    /// Who asked: an operator's name, or `mig-auto`.
    #[serde(default)]
    pub by: String,
}

impl State {
    /// The layout change under way on a GPU, if any.
    pub fn mig_change(&self, gpu_uuid: &str) -> Option<&MigChange> {
        self.mig_changes.get(gpu_uuid)
    }

    /// Every layout change under way.
    pub fn mig_changes(&self) -> impl Iterator<Item = &MigChange> {
        self.mig_changes.values()
    }

    /// The changes under way on an agent's GPUs (its heartbeat answer).
    pub fn mig_changes_of<'s>(&'s self, agent_id: &'s str) -> impl Iterator<Item = &'s MigChange> {
        self.mig_changes
            .values()
            .filter(move |c| c.agent_id == agent_id)
    }

    /// Why the last layout change of a GPU failed, if it did.
    pub fn mig_error(&self, gpu_uuid: &str) -> Option<&str> {
        self.mig_errors.get(gpu_uuid).map(String::as_str)
    }

    /// Who holds the GPU or one of its MIG devices, as `(device, task)`.
    pub(crate) fn mig_holder<'a>(&'a self, gpu: &'a GpuInfo) -> Option<(&'a str, &'a str)> {
        std::iter::once(gpu.uuid.as_str())
            .chain(gpu.mig.devices.iter().map(|d| d.uuid.as_str()))
            .find_map(|u| self.gpu_owner.get(u).map(|t| (u, t.as_str())))
    }

    /// An agent registered without a GPU that a change under way is of:
    /// the change can never be applied (a change of a GPU it still has
    /// stays: a restarted agent finishes it and reports).
    pub(super) fn forget_mig_changes_of_gone_gpus(&mut self, info: &gpuctl_core::types::AgentInfo) {
        self.mig_changes
            .retain(|uuid, c| c.agent_id != info.id || info.gpus.iter().any(|g| &g.uuid == uuid));
    }

    pub(super) fn set_mig_layout(
        &mut self,
        index: u64,
        gpu_uuid: &str,
        profiles: &[String],
        disable: bool,
        by: &str,
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        let invalid = |field: &str, reason: String| ApplyError::Invalid {
            field: field.into(),
            reason,
        };
        if disable && !profiles.is_empty() {
            return Err(invalid(
                "profiles",
                "MIG mode off leaves no MIG devices: name no profile with disable".into(),
            ));
        }
        if profiles.len() > MAX_LAYOUT_DEVICES {
            return Err(invalid(
                "profiles",
                format!(
                    "names {} MIG devices, at most {MAX_LAYOUT_DEVICES}",
                    profiles.len()
                ),
            ));
        }
        let Some(agent) = self
            .agents
            .values()
            .find(|a| a.info.gpus.iter().any(|g| g.uuid == gpu_uuid))
        else {
            return Err(invalid("uuid", format!("no agent has GPU {gpu_uuid}")));
        };
        if agent.state != AgentState::Active {
            return Err(invalid(
                "uuid",
                format!(
                    "the agent of GPU {gpu_uuid}, {}, is {:?}: its GPUs change only while it is connected",
                    agent.info.id, agent.state
                ),
            ));
        }
        let Some(gpu) = agent.info.gpus.iter().find(|g| g.uuid == gpu_uuid) else {
            return Err(invalid("uuid", format!("no agent has GPU {gpu_uuid}")));
        };
        if let Some(m) = self.shared.get(gpu_uuid) {
            return Err(invalid(
                "uuid",
                format!(
                    "GPU {gpu_uuid} is shared ({m}): unshare it first (gpuctl gpus share --off)"
                ),
            ));
        }
        if !gpu.mig.capable {
            return Err(invalid(
                "uuid",
                format!("GPU {gpu_uuid} ({}) has no MIG", gpu.model),
            ));
        }
        if let Some(c) = self.mig_changes.get(gpu_uuid) {
            // The same change asked again (a resend): it is under way.
            let mut a = c.profiles.clone();
            let mut b = profiles.to_vec();
            a.sort();
            b.sort();
            if a == b && c.disable == disable {
                return Ok(Outcome::Done);
            }
            return Err(invalid(
                "uuid",
                format!(
                    "GPU {gpu_uuid} is already being repartitioned (change {}, asked by {})",
                    c.generation, c.by
                ),
            ));
        }
        if let Some((device, task)) = self.mig_holder(gpu) {
            return Err(invalid(
                "uuid",
                format!(
                    "GPU {gpu_uuid} has running work ({device} is held by task {task}): a GPU is repartitioned only when nothing holds it or its MIG devices"
                ),
            ));
        }
        let agent_id = agent.info.id.clone();
        self.agents.mark_gpu(gpu_uuid);
        self.mig_changes.insert(
            gpu_uuid.to_string(),
            MigChange {
                agent_id,
                gpu_uuid: gpu_uuid.to_string(),
                generation: index,
                profiles: profiles.to_vec(),
                disable,
                asked_at_ms: at_ms,
                by: by.to_string(),
            },
        );
        Ok(Outcome::Done)
    }

    /// An agent reports what it made of change `generation` of a GPU: the
    /// GPU's MIG state becomes what NVML holds now (`gpu`), whether the
    /// change succeeded, rolled back or failed part way. A report of
    /// another generation, or from another agent, changes nothing.
    pub(super) fn mig_layout_done(
        &mut self,
        agent_id: &str,
        generation: u64,
        gpu: &GpuInfo,
        error: Option<&str>,
    ) -> Result<Outcome, ApplyError> {
        let current = self
            .mig_changes
            .get(&gpu.uuid)
            .is_some_and(|c| c.generation == generation && c.agent_id == agent_id);
        if !current {
            return Ok(Outcome::Done);
        }
        let agent = self.agent_mut(agent_id)?;
        if let Some(g) = agent.info.gpus.iter_mut().find(|g| g.uuid == gpu.uuid) {
            // The agent's word on MIG only: health and identity stay ours.
            g.mig = gpu.mig.clone();
        }
        agent.info.total.gpus = device_count(&agent.info.gpus);
        self.agents.mark_gpu(&gpu.uuid);
        self.mig_changes.remove(&gpu.uuid);
        match error {
            Some(e) => self.mig_errors.insert(gpu.uuid.clone(), e.to_string()),
            None => self.mig_errors.remove(&gpu.uuid),
        };
        Ok(Outcome::Done)
    }
}
