//! Leader-only loops: agent liveness and job placement. Both only read the
//! applied state and propose commands; apply has the last word.

pub mod frameworks;
pub mod jobs;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpuctl_proto::types::{GpuReport, GpuSample};
use tokio::sync::watch;

use crate::raft::RaftHandle;
use crate::state::{AgentState, Command};
use crate::{now_ms, MasterConfig};

/// When the leader last heard from each agent. In memory only: a new leader
/// starts every agent's clock afresh, giving each a full timeout to show up.
#[derive(Debug, Default)]
pub struct Liveness {
    last_seen: Mutex<HashMap<String, Instant>>,
    /// What each agent's last heartbeat said of its GPUs (their latest
    /// readings, for `gpuctl top`): leader memory only, like the clocks.
    gpu_reports: Mutex<HashMap<String, Vec<GpuReport>>>,
}

impl Liveness {
    pub fn touch(&self, agent_id: &str) {
        self.touch_at(agent_id, Instant::now());
    }

    fn touch_at(&self, agent_id: &str, at: Instant) {
        self.lock().insert(agent_id.to_string(), at);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.last_seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Agents silent for longer than `timeout`; unknown agents start now.
    fn expired(&self, agents: &[String], timeout: Duration, now: Instant) -> Vec<String> {
        let mut map = self.lock();
        agents
            .iter()
            .filter(|id| now.duration_since(*map.entry((*id).clone()).or_insert(now)) > timeout)
            .cloned()
            .collect()
    }

    fn reset(&self) {
        self.lock().clear();
        self.reports().clear();
    }

    fn reports(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<GpuReport>>> {
        self.gpu_reports.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps an agent's latest GPU reports (an empty list keeps the old).
    pub fn record_gpus(&self, agent_id: &str, reports: Vec<GpuReport>) {
        if !reports.is_empty() {
            self.reports().insert(agent_id.to_string(), reports);
        }
    }

    /// The latest reading of every GPU heard of, by UUID.
    pub fn gpu_samples(&self) -> HashMap<String, GpuSample> {
        self.reports()
            .values()
            .flatten()
            .filter_map(|r| r.sample.clone().map(|s| (r.uuid.clone(), s)))
            .collect()
    }
}

/// The agent liveness loop: marks agents lost that stopped heartbeating.
/// (Jobs are placed by the built-in framework, `jobs`.)
pub async fn run(
    raft: RaftHandle,
    config: MasterConfig,
    liveness: std::sync::Arc<Liveness>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut status = raft.status_watch();
    let mut liveness_tick = tokio::time::interval(config.heartbeat_interval);
    let mut was_leader = false;
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = liveness_tick.tick() => {}
            r = status.changed() => if r.is_err() { return },
        }
        let is_leader = raft.status().serving;
        if is_leader && !was_leader {
            liveness.reset();
            record_masters(&raft).await;
        }
        was_leader = is_leader;
        if is_leader {
            check_liveness(&raft, &liveness, config.agent_timeout).await;
        }
    }
}

/// A new leader writes the addresses of members that the replicated state
/// lacks (those given by `--peers` at bootstrap), so that every master, one
/// that joins later too, can reach every other.
async fn record_masters(raft: &RaftHandle) {
    let st = raft.status();
    let known = raft.addresses().all();
    let masters: std::collections::BTreeMap<u64, String> = {
        let state = raft.state();
        st.voters
            .iter()
            .chain(&st.learners)
            .filter(|id| !state.masters.contains_key(id))
            .filter_map(|id| known.get(id).map(|a| (*id, a.clone())))
            .collect()
    };
    if masters.is_empty() {
        return;
    }
    if let Err(e) = raft.propose(Command::RecordMasters { masters }).await {
        tracing::warn!(error = %e, "could not record the masters' addresses");
    }
}

async fn check_liveness(raft: &RaftHandle, liveness: &Liveness, timeout: Duration) {
    let active: Vec<String> = raft
        .state()
        .agents
        .values()
        .filter(|a| a.state == AgentState::Active)
        .map(|a| a.info.id.clone())
        .collect();
    for agent_id in liveness.expired(&active, timeout, Instant::now()) {
        tracing::warn!(agent_id = %agent_id, timeout_secs = timeout.as_secs_f64(), "agent missed heartbeats; marking it lost");
        if let Err(e) = raft
            .propose(Command::AgentLost {
                agent_id: agent_id.clone(),
                at_ms: now_ms(),
            })
            .await
        {
            tracing::warn!(agent_id = %agent_id, error = %e, "could not mark agent lost");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn liveness_expires_only_silent_agents() {
        let l = Liveness::default();
        let t0 = Instant::now();
        let agents = vec!["a".to_string(), "b".to_string()];
        // First sight starts the clock.
        assert!(l.expired(&agents, Duration::from_secs(5), t0).is_empty());
        l.touch_at("b", t0 + Duration::from_secs(4));
        let later = t0 + Duration::from_secs(6);
        assert_eq!(l.expired(&agents, Duration::from_secs(5), later), vec!["a"]);
        l.reset();
        assert!(l.expired(&agents, Duration::from_secs(5), later).is_empty());
    }
}
