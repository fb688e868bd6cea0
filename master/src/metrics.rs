//! The master's Prometheus metrics (`--metrics-listen`). Gauges are read
//! from the applied state at scrape time, so every master, a follower too,
//! reports the cluster as it has applied it; counters and histograms are
//! observed by the leader's own loops and stay at zero on a follower.

use std::sync::atomic::{AtomicU64, Ordering};

use gpuctl_core::metrics::{Exposition, Histogram, Kind, LATENCY_BUCKETS};
use gpuctl_core::types::JobState;

use crate::raft::RaftHandle;
use crate::state::{AgentState, State};

#[derive(Debug)]
pub struct MasterMetrics {
    /// Offers made to frameworks (the built-in jobs framework included,
    /// when other frameworks want resources too).
    pub offers_made: AtomicU64,
    /// Launches the built-in scheduler proposed straight from the state
    /// (through the free-capacity index, while no other framework wants
    /// offers).
    pub direct_launches: AtomicU64,
    /// One allocation cycle of the leader: updates, rescinds, offers.
    pub allocation_cycle: Histogram,
    /// From a task's launch being committed to its agent reporting it
    /// RUNNING (image pull and container start included).
    pub task_launch: Histogram,
}

impl Default for MasterMetrics {
    fn default() -> Self {
        MasterMetrics {
            offers_made: AtomicU64::new(0),
            direct_launches: AtomicU64::new(0),
            allocation_cycle: Histogram::new(LATENCY_BUCKETS),
            task_launch: Histogram::new(LATENCY_BUCKETS),
        }
    }
}

const JOB_STATES: [JobState; 6] = [
    JobState::Queued,
    JobState::Starting,
    JobState::Running,
    JobState::Succeeded,
    JobState::Failed,
    JobState::Cancelled,
];

/// The exposition of one scrape. `round_trips`: the smoothed round trip of
/// Raft calls to each peer (the transport's).
pub fn render(
    raft: &RaftHandle,
    metrics: &MasterMetrics,
    offers_outstanding: usize,
    round_trips: &std::collections::BTreeMap<u64, std::time::Duration>,
) -> String {
    let mut out = Exposition::new();
    raft_metrics(&mut out, &raft.status(), round_trips);
    {
        let state = raft.state();
        agent_and_gpu_metrics(&mut out, &state);
        job_metrics(&mut out, &state);
        tenant_metrics(&mut out, &state);
    }
    leader_metrics(&mut out, metrics, offers_outstanding);
    out.finish()
}

/// A gauge without labels: its family and its one sample.
fn gauge(out: &mut Exposition, name: &str, help: &str, v: f64) {
    out.family(name, help, Kind::Gauge);
    out.sample(name, &[], v);
}

/// This master's Raft: term, leader, indexes, round trips to its peers.
fn raft_metrics(
    out: &mut Exposition,
    st: &crate::raft::NodeStatus,
    round_trips: &std::collections::BTreeMap<u64, std::time::Duration>,
) {
    out.family(
        "gpuctl_raft_peer_round_trip_seconds",
        "Smoothed round trip of Raft calls to each other master (set election_timeout_ms to ten of them or more).",
        Kind::Gauge,
    );
    for (peer, rtt) in round_trips {
        let peer = peer.to_string();
        out.sample(
            "gpuctl_raft_peer_round_trip_seconds",
            &[("peer", &peer)],
            rtt.as_secs_f64(),
        );
    }
    gauge(
        out,
        "gpuctl_raft_term",
        "Current Raft term.",
        st.term as f64,
    );
    gauge(
        out,
        "gpuctl_raft_leader",
        "1 if this master is the serving Raft leader, else 0.",
        if st.serving { 1.0 } else { 0.0 },
    );
    gauge(
        out,
        "gpuctl_raft_leader_id",
        "Raft id of the leader this master knows of (0: none).",
        st.leader_id as f64,
    );
    gauge(
        out,
        "gpuctl_raft_commit_index",
        "Highest Raft log index known to be committed.",
        st.commit_index as f64,
    );
    gauge(
        out,
        "gpuctl_raft_applied_index",
        "Highest Raft log index applied to this master's state.",
        st.applied_index as f64,
    );
}

/// Agents by state, and the GPUs of active ones.
fn agent_and_gpu_metrics(out: &mut Exposition, state: &State) {
    out.family("gpuctl_agents", "Agents by state.", Kind::Gauge);
    for (label, want) in [
        ("active", AgentState::Active),
        ("unreachable", AgentState::Unreachable),
        ("lost", AgentState::Lost),
    ] {
        let n = state.agents().values().filter(|a| a.state == want).count();
        out.sample("gpuctl_agents", &[("state", label)], n as f64);
    }
    gauge(
        out,
        "gpuctl_agents_draining",
        "Agents being drained (no new tasks), whatever their state.",
        state
            .agents()
            .values()
            .filter(|a| a.drain.is_some())
            .count() as f64,
    );
    gauge(
        out,
        "gpuctl_gpus_held_unconfirmed",
        "GPUs still held by tasks that ended LOST without their agent's word that they are gone.",
        state
            .tasks()
            .values()
            .filter(|t| t.holding)
            .map(|t| t.gpu_uuids.len())
            .sum::<usize>() as f64,
    );
    let gpus: Vec<_> = state
        .agents()
        .values()
        .filter(|a| a.state == AgentState::Active)
        .flat_map(|a| a.info.gpus.iter())
        .collect();
    gauge(
        out,
        "gpuctl_gpus",
        "GPUs of active agents.",
        gpus.len() as f64,
    );
    gauge(
        out,
        "gpuctl_gpus_allocated",
        "GPUs of active agents held by a task.",
        gpus.iter()
            .filter(|g| state.gpu_owner(&g.uuid).is_some())
            .count() as f64,
    );
    gauge(
        out,
        "gpuctl_gpus_unhealthy",
        "GPUs of active agents that fail their health checks.",
        gpus.iter().filter(|g| !g.healthy).count() as f64,
    );
    gauge(
        out,
        "gpuctl_gpus_cordoned",
        "GPUs of active agents taken out of service by an operator.",
        gpus.iter().filter(|g| state.is_cordoned(&g.uuid)).count() as f64,
    );
}

/// Jobs by state, and the idle ones.
fn job_metrics(out: &mut Exposition, state: &State) {
    out.family("gpuctl_jobs", "gpuctl jobs by state.", Kind::Gauge);
    for s in JOB_STATES {
        let n = state.jobs().values().filter(|j| j.state == s).count();
        let label = s.to_string().to_ascii_lowercase();
        out.sample("gpuctl_jobs", &[("state", &label)], n as f64);
    }
    gauge(
        out,
        "gpuctl_jobs_idle",
        "Running jobs whose GPUs stayed under the idle threshold for the idle window.",
        state
            .jobs()
            .values()
            .filter(|j| j.idle_since_ms.is_some())
            .count() as f64,
    );
}

/// Per tenant: what the Grafana dashboard's tenant rows draw.
fn tenant_metrics(out: &mut Exposition, state: &State) {
    let usage = crate::scheduler::tenants::usage(state);
    out.family(
        "gpuctl_tenant_gpus_allocated",
        "GPUs held by a tenant's live tasks.",
        Kind::Gauge,
    );
    for (tenant, u) in &usage {
        out.sample(
            "gpuctl_tenant_gpus_allocated",
            &[("tenant", tenant)],
            f64::from(u.gpus),
        );
    }
    out.family(
        "gpuctl_tenant_jobs",
        "A tenant's jobs running and queued.",
        Kind::Gauge,
    );
    for (tenant, u) in &usage {
        out.sample(
            "gpuctl_tenant_jobs",
            &[("tenant", tenant), ("state", "running")],
            f64::from(u.running),
        );
        out.sample(
            "gpuctl_tenant_jobs",
            &[("tenant", tenant), ("state", "queued")],
            f64::from(u.queued),
        );
    }
    out.family(
        "gpuctl_tenant_gpu_quota",
        "A tenant's GPU quota (tenants with one).",
        Kind::Gauge,
    );
    for (tenant, gpus) in state.quotas() {
        out.sample(
            "gpuctl_tenant_gpu_quota",
            &[("tenant", tenant)],
            f64::from(*gpus),
        );
    }
}

/// What the leader counts: offers, direct launches, allocation cycles and
/// task launches.
fn leader_metrics(out: &mut Exposition, metrics: &MasterMetrics, offers_outstanding: usize) {
    gauge(
        out,
        "gpuctl_offers_outstanding",
        "Offers made and not yet accepted, declined, rescinded or expired.",
        offers_outstanding as f64,
    );
    out.family(
        "gpuctl_offers_total",
        "Offers made to frameworks by this master while leader.",
        Kind::Counter,
    );
    out.sample(
        "gpuctl_offers_total",
        &[],
        metrics.offers_made.load(Ordering::Relaxed) as f64,
    );
    out.family(
        "gpuctl_scheduler_direct_launches_total",
        "Tasks the built-in scheduler launched straight from the state (no offer), while leader.",
        Kind::Counter,
    );
    out.sample(
        "gpuctl_scheduler_direct_launches_total",
        &[],
        metrics.direct_launches.load(Ordering::Relaxed) as f64,
    );
    out.family(
        "gpuctl_allocation_cycle_seconds",
        "Duration of the leader's allocation cycles.",
        Kind::Histogram,
    );
    metrics
        .allocation_cycle
        .write(out, "gpuctl_allocation_cycle_seconds", &[]);
    out.family(
        "gpuctl_task_launch_seconds",
        "From a task's launch being committed to its agent reporting it RUNNING.",
        Kind::Histogram,
    );
    metrics
        .task_launch
        .write(out, "gpuctl_task_launch_seconds", &[]);
}
