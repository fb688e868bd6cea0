//! Agents and GPUs: list, cordon, share, MIG layouts, drain.

use super::*;

impl OperatorService {
    pub(super) async fn list_agents(
        &self,
        _req: pb::ListAgentsRequest,
    ) -> Result<pb::ListAgentsResponse, ServiceError> {
        let state = self.ctx.raft.state();
        Ok(pb::ListAgentsResponse {
            agents: state
                .agents()
                .values()
                .map(|a| agent_to_pb(a, self.ctx.liveness.runtime_status(&a.info.id)))
                .collect(),
        })
    }

    pub(super) async fn list_gpus(
        &self,
        _req: pb::ListGpusRequest,
    ) -> Result<pb::ListGpusResponse, ServiceError> {
        let samples = self.ctx.liveness.gpu_samples();
        let state = self.ctx.raft.state();
        let mut gpus = Vec::new();
        for a in state.agents().values() {
            for g in &a.info.gpus {
                gpus.push(gpu_status(&state, a, g, &samples));
            }
        }
        Ok(pb::ListGpusResponse { gpus })
    }

    pub(super) async fn cordon_gpu(
        &self,
        req: pb::CordonGpuRequest,
    ) -> Result<pb::GpuStatus, ServiceError> {
        gpuctl_core::convert::check_id("uuid", &req.uuid)?;
        self.ctx
            .raft
            .propose(Command::CordonGpu {
                uuid: req.uuid.clone(),
                cordon: req.cordon,
            })
            .await?;
        tracing::info!(uuid = %req.uuid, cordon = req.cordon, "GPU cordon changed");
        self.gpu_status_of(&req.uuid)
    }

    /// One GPU as `gpus` shows it, after a change of it.
    pub(super) fn gpu_status_of(&self, uuid: &str) -> Result<pb::GpuStatus, ServiceError> {
        let samples = self.ctx.liveness.gpu_samples();
        let state = self.ctx.raft.state();
        state
            .agents()
            .values()
            .find_map(|a| {
                a.info
                    .gpus
                    .iter()
                    .find(|g| g.uuid == uuid)
                    .map(|g| gpu_status(&state, a, g, &samples))
            })
            .ok_or_else(|| ServiceError::not_found(Missing::Gpu, uuid))
    }

    pub(super) async fn share_gpu(
        &self,
        req: pb::ShareGpuRequest,
    ) -> Result<pb::GpuStatus, ServiceError> {
        gpuctl_core::convert::check_id("uuid", &req.uuid)?;
        let mode = if req.mode.is_empty() {
            None
        } else {
            Some(
                req.mode
                    .parse::<gpuctl_core::types::ShareMode>()
                    .map_err(|e| gpuctl_core::convert::ConvertError::new("mode", e))?,
            )
        };
        self.ctx
            .raft
            .propose(Command::ShareGpu {
                gpu_uuid: req.uuid.clone(),
                mode,
            })
            .await?;
        tracing::info!(uuid = %req.uuid, mode = ?mode, "GPU sharing changed");
        self.gpu_status_of(&req.uuid)
    }

    pub(super) async fn set_mig_layout(
        &self,
        caller: &Caller,
        req: pb::SetMigLayoutRequest,
    ) -> Result<pb::GpuStatus, ServiceError> {
        gpuctl_core::convert::check_id("uuid", &req.uuid)?;
        gpuctl_core::convert::check_mig_layout(&req.profiles, req.disable)?;
        let by = match caller {
            Caller::Token(t) => format!("token {}", t.id),
            _ => "operator".to_string(),
        };
        self.ctx
            .raft
            .propose(Command::SetMigLayout {
                gpu_uuid: req.uuid.clone(),
                profiles: req.profiles.clone(),
                disable: req.disable,
                by,
                at_ms: now_ms(),
            })
            .await?;
        tracing::info!(uuid = %req.uuid, profiles = ?req.profiles, disable = req.disable, "MIG layout change asked");
        self.gpu_status_of(&req.uuid)
    }

    pub(super) async fn drain_agent(
        &self,
        req: pb::DrainAgentRequest,
    ) -> Result<pb::Agent, ServiceError> {
        gpuctl_core::convert::check_id("agent_id", &req.agent_id)?;
        let at_ms = now_ms();
        let deadline_ms = drain_deadline(at_ms, req.deadline_secs)?;
        self.ctx
            .raft
            .propose(Command::DrainAgent {
                agent_id: req.agent_id.clone(),
                kill: req.kill,
                deadline_ms,
                at_ms,
            })
            .await?;
        tracing::info!(agent_id = %req.agent_id, kill = req.kill, deadline_ms = ?deadline_ms, "agent draining");
        // Its outstanding offers are rescinded by the next cycle.
        self.ctx.hub.wake();
        self.agent_reply(&req.agent_id)
    }

    pub(super) async fn undrain_agent(
        &self,
        req: pb::UndrainAgentRequest,
    ) -> Result<pb::Agent, ServiceError> {
        gpuctl_core::convert::check_id("agent_id", &req.agent_id)?;
        self.ctx
            .raft
            .propose(Command::UndrainAgent {
                agent_id: req.agent_id.clone(),
                at_ms: now_ms(),
            })
            .await?;
        tracing::info!(agent_id = %req.agent_id, "agent drain ended");
        self.ctx.hub.wake();
        self.agent_reply(&req.agent_id)
    }
}
