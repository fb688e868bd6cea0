//! Leader-only loops: agent liveness and job placement, and (in
//! `retention.rs`) forgetting finished work. They only read the applied
//! state and propose commands; apply has the last word.

pub mod board;
pub mod frameworks;
pub mod mig_auto;
pub mod retention;
pub mod scheduler;

use crate::state::util::UtilPoint;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpuctl_core::types::{GpuReport, GpuSample, RuntimeStatus};
use tokio::sync::watch;

use crate::raft::RaftHandle;
use crate::state::{AgentState, Command, State};
use crate::{now_ms, MasterConfig};

/// When the leader last heard from each agent. In memory only: a new leader
/// starts every agent's clock afresh, giving each a full timeout to show up
/// (later than the old leader would have: never earlier than the agent's
/// own fence clock, see `MasterConfig::check_timeouts`).
#[derive(Debug, Default)]
pub struct Liveness {
    last_seen: Mutex<HashMap<String, Instant>>,
    /// What each agent's last heartbeat said of its GPUs (their latest
    /// readings, for `gpuctl top`): leader memory only, like the clocks.
    gpu_reports: Mutex<HashMap<String, Vec<GpuReport>>>,
    /// What each agent's last heartbeat said of its runtimes (for
    /// `gpuctl agents list`): leader memory only.
    runtimes: Mutex<HashMap<String, Vec<RuntimeStatus>>>,
    /// GPU readings of the current utilization period, summed until the
    /// period ends and is proposed (`RecordUtilization`).
    util: Mutex<UtilAcc>,
}

/// Readings summed over one period, per GPU.
#[derive(Debug, Default)]
struct UtilAcc {
    /// The period's start (leader's clock); 0: not started.
    start_ms: u64,
    /// Per GPU: utilization and memory-percent sums, and their count.
    sums: HashMap<String, (u64, u64, u64)>,
    /// Per GPU, each task's per-process utilization sum over those
    /// readings (a reading without the task counts as 0).
    task_sums: HashMap<String, std::collections::BTreeMap<String, u64>>,
    /// Per GPU, how many of its readings had the per-process readings
    /// read (the tasks' means are over those).
    task_reads: HashMap<String, u64>,
    /// Per GPU, each task's memory-percent sum (of the GPU's) over all
    /// the readings (a reading without the task counts as 0).
    task_mem_sums: HashMap<String, std::collections::BTreeMap<String, u64>>,
    /// Per GPU, the agent that read it in this period.
    agents: HashMap<String, String>,
    /// Per GPU, the agent's time of the last reading counted: a heartbeat
    /// repeats its agent's latest reading until a new one is taken.
    last_at: HashMap<String, u64>,
}

impl Liveness {
    pub fn touch(&self, agent_id: &str) {
        self.touch_at(agent_id, Instant::now());
    }

    fn touch_at(&self, agent_id: &str, at: Instant) {
        let mut seen = self.lock();
        match seen.get_mut(agent_id) {
            Some(t) => *t = at,
            None => {
                seen.insert(agent_id.to_string(), at);
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.last_seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The liveness pass at `now` (this leader's monotonic clock) and
    /// `now_ms` (the commands' wall-clock time): starts the clock of every
    /// agent not heard of yet (never of a LOST one), then decides from each
    /// agent's silence (`liveness_commands`). No list or map of every agent
    /// per tick: each silence is read in place.
    fn commands_at(
        &self,
        state: &State,
        now: Instant,
        now_ms: u64,
        timeouts: &LivenessTimeouts,
    ) -> Vec<Command> {
        let mut seen = self.lock();
        for a in state.agents().values() {
            if a.state != AgentState::Lost && !seen.contains_key(&a.info.id) {
                seen.insert(a.info.id.clone(), now);
            }
        }
        let silent = |id: &str| {
            seen.get(id)
                .map_or(Duration::ZERO, |t| now.saturating_duration_since(*t))
        };
        liveness_commands(state, &silent, now_ms, timeouts)
    }

    fn reset(&self) {
        self.lock().clear();
        self.reports().clear();
        self.runtime_lock().clear();
        *self.util_lock() = UtilAcc::default();
    }

    fn util_lock(&self) -> std::sync::MutexGuard<'_, UtilAcc> {
        self.util.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts each new reading of `agent_id`'s `reports` in the current
    /// period.
    fn accumulate(&self, agent_id: &str, reports: &[GpuReport]) {
        let mut acc = self.util_lock();
        for r in reports {
            let Some(s) = &r.sample else { continue };
            if acc.last_at.get(&r.uuid) == Some(&s.sampled_at_ms) {
                continue;
            }
            acc.last_at.insert(r.uuid.clone(), s.sampled_at_ms);
            let mem_pct = (s.memory_used_mib * 100)
                .checked_div(s.memory_total_mib)
                .unwrap_or(0)
                .min(100);
            let e = acc.sums.entry(r.uuid.clone()).or_default();
            e.0 += u64::from(s.utilization_pct.min(100));
            e.1 += mem_pct;
            e.2 += 1;
            if acc.agents.get(&r.uuid).map(String::as_str) != Some(agent_id) {
                acc.agents.insert(r.uuid.clone(), agent_id.to_string());
            }
            if s.task_utilization_read {
                *acc.task_reads.entry(r.uuid.clone()).or_default() += 1;
            }
            if !s.task_memory_used_mib.is_empty() {
                let t = acc.task_mem_sums.entry(r.uuid.clone()).or_default();
                for (task, mib) in &s.task_memory_used_mib {
                    let pct = mib
                        .saturating_mul(100)
                        .checked_div(s.memory_total_mib)
                        .unwrap_or(0)
                        .min(100);
                    *t.entry(task.clone()).or_default() += pct;
                }
            }
            if !s.task_utilization_pct.is_empty() {
                let t = acc.task_sums.entry(r.uuid.clone()).or_default();
                for (task, u) in &s.task_utilization_pct {
                    *t.entry(task.clone()).or_default() += u64::from((*u).min(100));
                }
            }
        }
    }

    /// At `now_ms`, the period that ended (its start and each GPU's mean),
    /// once one has; the next period starts. Periods start at multiples
    /// of `period_ms`. On a GPU whose per-process readings were read, each
    /// task `holders(agent, gpu)` names (the fractions held) that no
    /// reading listed is given 0: it used none, which is a reading (and
    /// counts towards idle), where a GPU not read gives nothing. Each
    /// holder's memory mean comes too.
    pub fn take_period(
        &self,
        now_ms: u64,
        period_ms: u64,
        holders: impl Fn(&str, &str) -> Vec<String>,
    ) -> Option<(u64, Vec<UtilPoint>)> {
        let period_ms = period_ms.max(1);
        let mut acc = self.util_lock();
        let current = now_ms - now_ms % period_ms;
        if acc.start_ms == 0 {
            acc.start_ms = current;
            acc.sums.clear();
            acc.task_sums.clear();
            acc.task_reads.clear();
            acc.task_mem_sums.clear();
            acc.agents.clear();
            return None;
        }
        if current <= acc.start_ms {
            return None;
        }
        let start = std::mem::replace(&mut acc.start_ms, current);
        let mut task_sums = std::mem::take(&mut acc.task_sums);
        let mut task_reads = std::mem::take(&mut acc.task_reads);
        let mut task_mem_sums = std::mem::take(&mut acc.task_mem_sums);
        let agents = std::mem::take(&mut acc.agents);
        let mut points: Vec<UtilPoint> = std::mem::take(&mut acc.sums)
            .into_iter()
            .filter(|(_, (_, _, n))| *n > 0)
            .map(|(gpu, (u, m, n))| {
                let mut tasks = task_sums.remove(&gpu).unwrap_or_default();
                let held = agents
                    .get(&gpu)
                    .map(|agent| holders(agent, &gpu))
                    .unwrap_or_default();
                // Over the readings that were read (an agent of before
                // the flag: over all of them).
                let mut over = n;
                if let Some(reads) = task_reads.remove(&gpu) {
                    over = reads;
                    for t in &held {
                        tasks.entry(t.clone()).or_insert(0);
                    }
                }
                let mem = task_mem_sums.remove(&gpu).unwrap_or_default();
                let task_mem = held
                    .iter()
                    .map(|t| {
                        let sum = mem.get(t).copied().unwrap_or(0);
                        (t.clone(), u8::try_from(sum / n).unwrap_or(100))
                    })
                    .collect();
                UtilPoint {
                    task_mem,
                    tasks: tasks
                        .into_iter()
                        .map(|(t, sum)| (t, u8::try_from(sum / over.max(1)).unwrap_or(100)))
                        .collect(),
                    gpu,
                    util_pct: u8::try_from(u / n).unwrap_or(100),
                    mem_pct: u8::try_from(m / n).unwrap_or(100),
                }
            })
            .collect();
        points.sort_by(|a, b| a.gpu.cmp(&b.gpu));
        (!points.is_empty()).then_some((start, points))
    }

    fn reports(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<GpuReport>>> {
        self.gpu_reports.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn runtime_lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<RuntimeStatus>>> {
        self.runtimes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps an agent's latest GPU reports (an empty list keeps the old).
    pub fn record_gpus(&self, agent_id: &str, reports: Vec<GpuReport>) {
        self.accumulate(agent_id, &reports);
        if !reports.is_empty() {
            self.reports().insert(agent_id.to_string(), reports);
        }
    }

    /// Keeps an agent's latest runtime statuses (an empty list, from an
    /// agent that does not report them, keeps the old).
    pub fn record_runtimes(&self, agent_id: &str, runtimes: Vec<RuntimeStatus>) {
        if !runtimes.is_empty() {
            self.runtime_lock().insert(agent_id.to_string(), runtimes);
        }
    }

    /// The latest runtime statuses an agent reported (empty: none yet).
    pub fn runtime_status(&self, agent_id: &str) -> Vec<RuntimeStatus> {
        self.runtime_lock()
            .get(agent_id)
            .cloned()
            .unwrap_or_default()
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

/// The timeouts the liveness pass applies.
#[derive(Debug, Clone, Copy)]
pub struct LivenessTimeouts {
    /// Silence after which an ACTIVE agent becomes UNREACHABLE.
    pub unreachable: Duration,
    /// Silence after which an UNREACHABLE agent becomes LOST.
    pub lost: Duration,
}

impl LivenessTimeouts {
    pub fn of(config: &MasterConfig) -> Self {
        LivenessTimeouts {
            unreachable: config.agent_timeout,
            lost: config.agent_lost_timeout,
        }
    }
}

/// The leader's liveness decisions. PURE: from the state, how long each
/// agent has been silent (by the leader's clock; an agent missing from
/// `silence` counts as just heard from) and the time, the commands to
/// propose:
///
/// - an ACTIVE agent silent for more than `unreachable`: `AgentUnreachable`;
/// - an UNREACHABLE agent silent for more than `lost`: `AgentLostAfterTimeout`
///   (silence counts from the last heartbeat, not from when it became
///   unreachable);
/// - a drained agent whose deadline passed and that still has live tasks not
///   being stopped: `DrainDeadlinePassed` (whatever its liveness: the kill
///   reaches it when it is back).
///
/// Each command is re-checked when applied (a no-op if the agent came back
/// meanwhile), so a stale decision is harmless.
pub fn liveness_commands(
    state: &State,
    silence: &dyn Fn(&str) -> Duration,
    now_ms: u64,
    timeouts: &LivenessTimeouts,
) -> Vec<Command> {
    let mut out = Vec::new();
    for a in state.agents().values() {
        let id = &a.info.id;
        let silent = silence(id);
        match a.state {
            AgentState::Active if silent > timeouts.unreachable => {
                out.push(Command::AgentUnreachable {
                    agent_id: id.clone(),
                    at_ms: now_ms,
                });
            }
            AgentState::Unreachable if silent > timeouts.lost => {
                out.push(Command::AgentLostAfterTimeout {
                    agent_id: id.clone(),
                    at_ms: now_ms,
                });
            }
            _ => {}
        }
        let due = a
            .drain
            .as_ref()
            .and_then(|d| d.deadline_ms)
            .is_some_and(|d| d <= now_ms);
        if due && state.drain_victims(id).next().is_some() {
            out.push(Command::DrainDeadlinePassed {
                agent_id: id.clone(),
                at_ms: now_ms,
            });
        }
    }
    out
}

/// The agent liveness loop: marks agents unreachable, then lost, when they
/// stop heartbeating, and kills what drained agents still run once their
/// deadline passes. (Jobs are placed by the built-in framework, `jobs`.)
pub async fn run(
    raft: RaftHandle,
    config: MasterConfig,
    liveness: std::sync::Arc<Liveness>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut status = raft.role_watch();
    let mut liveness_tick = tokio::time::interval(config.heartbeat_interval);
    let mut drain_tick = tokio::time::interval(DRAIN_TICK);
    drain_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut was_leader = false;
    loop {
        // The status changes at every commit: it only tells when this
        // master starts to lead. Liveness is checked at the tick alone (a
        // pass over every agent per commit was 12% of an idle leader's CPU
        // at 10,000 agents).
        let tick = tokio::select! {
            _ = shutdown.changed() => return,
            _ = liveness_tick.tick() => true,
            _ = drain_tick.tick() => {
                if status.borrow().serving {
                    end_drains(&raft).await;
                }
                continue;
            }
            r = status.changed() => if r.is_err() { return } else { false },
        };
        let is_leader = status.borrow_and_update().serving;
        if is_leader && !was_leader {
            liveness.reset();
            record_masters(&raft).await;
        }
        was_leader = is_leader;
        if is_leader && tick {
            check_liveness(&raft, &liveness, &LivenessTimeouts::of(&config)).await;
            if let Some(period) = config.utilization_period {
                let idle = config.idle_window.map(|w| {
                    (
                        u64::try_from(w.as_millis()).unwrap_or(u64::MAX),
                        config.idle_below_pct,
                    )
                });
                record_utilization(&raft, &liveness, period, idle).await;
            }
        }
    }
}

/// How often the leader looks for drains that are over: a replica is
/// stopped within this of its drain's end.
const DRAIN_TICK: Duration = Duration::from_millis(250);

/// Stops the replicas whose drain is over (and forgets those that ended):
/// one `EndDrains` when any is due, on whichever master leads.
async fn end_drains(raft: &RaftHandle) {
    let now = now_ms();
    if !raft.state().drains_due(now) {
        return;
    }
    if let Err(e) = raft.propose(Command::EndDrains { at_ms: now }).await {
        tracing::warn!(error = %e, "could not end the drains that are due");
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
            .filter(|id| !state.masters().contains_key(id))
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

/// Proposes the utilization of the period that ended, if one did (in
/// commands of at most `MAX_POINTS_PER_COMMAND` GPUs). A period lost to a
/// failed proposal or a leader change is a gap in the history.
async fn record_utilization(
    raft: &RaftHandle,
    liveness: &Liveness,
    period: Duration,
    idle: Option<(u64, u8)>,
) {
    let period_ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX);
    let taken = {
        let state = raft.state();
        liveness.take_period(now_ms(), period_ms, |agent, gpu| {
            state
                .share_holders(agent, gpu)
                .map(|(t, _)| t.to_string())
                .collect()
        })
    };
    let Some((at_ms, points)) = taken else {
        return;
    };
    for chunk in points.chunks(crate::state::util::MAX_POINTS_PER_COMMAND) {
        let cmd = Command::RecordUtilization {
            at_ms,
            period_ms,
            points: chunk.to_vec(),
            idle_window_ms: idle.map_or(0, |(w, _)| w),
            idle_below_pct: idle.map_or(0, |(_, b)| b),
        };
        if let Err(e) = raft.propose(cmd).await {
            tracing::warn!(error = %e, "could not record a period of GPU utilization");
            return;
        }
    }
}

async fn check_liveness(raft: &RaftHandle, liveness: &Liveness, timeouts: &LivenessTimeouts) {
    let commands = {
        let state = raft.state();
        liveness.commands_at(&state, Instant::now(), now_ms(), timeouts)
    };
    for cmd in commands {
        match &cmd {
            Command::AgentUnreachable { agent_id, .. } => {
                tracing::warn!(agent_id = %agent_id, timeout_secs = timeouts.unreachable.as_secs_f64(), "agent missed heartbeats; marking it unreachable (its tasks keep their GPUs)");
            }
            Command::AgentLostAfterTimeout { agent_id, .. } => {
                tracing::warn!(agent_id = %agent_id, timeout_secs = timeouts.lost.as_secs_f64(), "agent silent past the lost timeout; marking it and its tasks lost (their GPUs stay held until it confirms)");
            }
            Command::DrainDeadlinePassed { agent_id, .. } => {
                tracing::info!(agent_id = %agent_id, "drain deadline passed; killing the agent's remaining tasks");
            }
            _ => {}
        }
        if let Err(e) = raft.propose(cmd.clone()).await {
            tracing::warn!(command = cmd.kind(), error = %e, "could not propose a liveness decision");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::testkit::register;
    use crate::state::{Launch, Outcome};
    use gpuctl_core::types::{JobSpec, Resources, TaskState};
    use std::collections::BTreeMap;

    /// Readings are averaged per GPU over a period, each counted once
    /// (heartbeats repeat the latest), and handed over when it ends.
    #[test]
    fn utilization_is_averaged_per_period_and_counted_once() {
        let l = Liveness::default();
        let none = |_: &str, _: &str| -> Vec<String> { vec![] };
        let report = |uuid: &str, util: u32, used: u64, at: u64| GpuReport {
            uuid: uuid.into(),
            healthy: true,
            unhealthy_reason: String::new(),
            sample: Some(gpuctl_core::types::GpuSample {
                utilization_pct: util,
                memory_used_mib: used,
                memory_total_mib: 1000,
                sampled_at_ms: at,
                ..Default::default()
            }),
        };
        assert_eq!(
            l.take_period(61_000, 60_000, none),
            None,
            "starts the period at 60 s"
        );
        l.record_gpus("a", vec![report("g0", 20, 100, 1), report("g1", 0, 0, 1)]);
        // The same reading again, then a new one.
        l.record_gpus("a", vec![report("g0", 20, 100, 1)]);
        l.record_gpus("a", vec![report("g0", 60, 300, 2)]);
        assert_eq!(l.take_period(119_999, 60_000, none), None, "not over yet");
        let (at, points) = l.take_period(120_500, 60_000, none).unwrap();
        assert_eq!(at, 60_000);
        let got: Vec<(&str, u8, u8)> = points
            .iter()
            .map(|p| (p.gpu.as_str(), p.util_pct, p.mem_pct))
            .collect();
        assert_eq!(got, [("g0", 40, 20), ("g1", 0, 0)]);
        // Per-process readings of a shared GPU: each task's mean over the
        // GPU's readings (absent from one: 0 there).
        let mut shared = report("g0", 50, 0, 10);
        if let Some(s) = shared.sample.as_mut() {
            s.task_utilization_pct = [("fw.t1".to_string(), 40), ("fw.t2".to_string(), 10)].into();
        }
        l.record_gpus("a", vec![shared]);
        let mut again = report("g0", 30, 0, 11);
        if let Some(s) = again.sample.as_mut() {
            s.task_utilization_pct = [("fw.t1".to_string(), 20)].into();
        }
        l.record_gpus("a", vec![again]);
        let (_, points) = l.take_period(180_500, 60_000, none).unwrap();
        assert_eq!(
            points[0].tasks,
            [("fw.t1".to_string(), 30), ("fw.t2".to_string(), 5)]
        );
        // Readings with the per-process readings read: a fraction held
        // there that none listed used nothing (0, a reading); the mean is
        // over the readings that were read. A GPU not read names nobody.
        let mut read = report("g0", 50, 0, 12);
        if let Some(s) = read.sample.as_mut() {
            s.task_utilization_pct = [("fw.t1".to_string(), 40)].into();
            s.task_utilization_read = true;
            s.task_memory_used_mib = [("fw.t1".to_string(), 200)].into();
        }
        l.record_gpus("a", vec![read, report("g1", 10, 0, 12)]);
        // One whose per-process readings failed: not counted for tasks
        // (their memory is: a list of processes of its own).
        let mut failed = report("g0", 50, 0, 13);
        if let Some(s) = failed.sample.as_mut() {
            s.task_memory_used_mib =
                [("fw.t1".to_string(), 400), ("fw.t3".to_string(), 100)].into();
        }
        l.record_gpus("a", vec![failed]);
        let holders = |agent: &str, gpu: &str| -> Vec<String> {
            assert_eq!(agent, "a");
            match gpu {
                "g0" => vec!["fw.t1".into(), "fw.t3".into()],
                _ => vec!["fw.t9".into()],
            }
        };
        let (_, points) = l.take_period(240_500, 60_000, holders).unwrap();
        assert_eq!(
            points[0].tasks,
            [("fw.t1".to_string(), 40), ("fw.t3".to_string(), 0)]
        );
        // Each holder's memory: its mean over all the GPU's readings, in
        // percent of the GPU's (20% and 40% of it; 0% and 10%).
        assert_eq!(
            points[0].task_mem,
            [("fw.t1".to_string(), 30), ("fw.t3".to_string(), 5)]
        );
        assert_eq!(points[1].task_mem, [("fw.t9".to_string(), 0)]);
        assert_eq!(points[1].gpu, "g1");
        assert!(points[1].tasks.is_empty(), "{:?}", points[1]);
        // A period with no new reading proposes nothing.
        l.record_gpus("a", vec![report("g0", 60, 300, 13)]);
        assert_eq!(l.take_period(300_000, 60_000, none), None);
    }

    #[test]
    fn liveness_measures_silence_from_the_last_heartbeat() {
        let s = state();
        let l = Liveness::default();
        let t0 = Instant::now();
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        // First sight starts the clocks.
        assert!(l.commands_at(&s, at(0), 0, &T).is_empty());
        l.touch_at("b", at(4));
        l.touch_at("c", at(4));
        // a: 11 s silent, past the 10 s timeout; b and c: 7 s.
        assert_eq!(
            agents_in(&l.commands_at(&s, at(11), 11_000, &T)),
            vec![("unreachable", "a".to_string())]
        );
        l.reset();
        assert!(
            l.commands_at(&s, at(11), 11_000, &T).is_empty(),
            "a new leader starts afresh"
        );
    }

    #[test]
    fn an_unreachable_agent_still_heard_is_never_lost_and_a_silent_one_is() {
        let mut s = state();
        let l = Liveness::default();
        let t0 = Instant::now();
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        assert!(
            l.commands_at(&s, at(0), 0, &T).is_empty(),
            "the first pass starts the clocks"
        );
        for id in ["a", "b"] {
            l.touch_at(id, at(9));
        }
        assert!(
            l.commands_at(&s, at(10), 10_000, &T).is_empty(),
            "not past the timeout"
        );
        let cmds = l.commands_at(&s, at(11), 11_000, &T);
        assert_eq!(agents_in(&cmds), vec![("unreachable", "c".to_string())]);
        for c in cmds {
            apply(&mut s, c);
        }
        // c's heartbeats are refused (it must register again) but heard.
        for secs in (15..=600).step_by(5) {
            for id in ["a", "b", "c"] {
                l.touch_at(id, at(secs));
            }
            assert!(
                l.commands_at(&s, at(secs), secs * 1000, &T).is_empty(),
                "at {secs}s"
            );
        }
        for id in ["a", "b"] {
            l.touch_at(id, at(720));
        }
        assert!(
            l.commands_at(&s, at(720), 720_000, &T).is_empty(),
            "silent 120 s: not yet"
        );
        let cmds = l.commands_at(&s, at(721), 721_000, &T);
        assert_eq!(agents_in(&cmds), vec![("lost", "c".to_string())]);
        for c in cmds {
            apply(&mut s, c);
        }
        // A new leader starts no clock for a LOST agent.
        l.reset();
        assert!(l.commands_at(&s, at(10_000), 10_000_000, &T).is_empty());
        assert!(!l.lock().contains_key("c"));
    }

    #[test]
    fn runtime_statuses_are_kept_per_agent() {
        let l = Liveness::default();
        let down = RuntimeStatus {
            runtime: gpuctl_core::types::Runtime::Docker,
            available: false,
            message: "daemon not answering".into(),
        };
        l.record_runtimes("a", vec![down.clone()]);
        l.record_runtimes("a", vec![]);
        assert_eq!(l.runtime_status("a"), vec![down]);
        assert!(l.runtime_status("b").is_empty());
        l.reset();
        assert!(l.runtime_status("a").is_empty());
    }

    const T: LivenessTimeouts = LivenessTimeouts {
        unreachable: Duration::from_secs(10),
        lost: Duration::from_secs(120),
    };

    fn state() -> State {
        let mut s = State::new();
        for (i, (id, g)) in [("a", 1), ("b", 1), ("c", 1)].into_iter().enumerate() {
            s.apply(i as u64 + 1, &register(id, g)).unwrap();
        }
        s
    }

    fn apply(s: &mut State, c: Command) {
        let i = s.applied_index() + 1;
        s.apply(i, &c).unwrap();
    }

    /// Silence by agent as `liveness_commands` reads it.
    fn lookup(m: BTreeMap<String, Duration>) -> impl Fn(&str) -> Duration {
        move |id| m.get(id).copied().unwrap_or_default()
    }

    fn silence(v: &[(&str, u64)]) -> BTreeMap<String, Duration> {
        v.iter()
            .map(|(id, secs)| (id.to_string(), Duration::from_secs(*secs)))
            .collect()
    }

    fn agents_in(cmds: &[Command]) -> Vec<(&'static str, String)> {
        cmds.iter()
            .map(|c| match c {
                Command::AgentUnreachable { agent_id, .. } => ("unreachable", agent_id.clone()),
                Command::AgentLostAfterTimeout { agent_id, .. } => ("lost", agent_id.clone()),
                Command::DrainDeadlinePassed { agent_id, .. } => ("deadline", agent_id.clone()),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn liveness_table() {
        let mut s = state();
        apply(
            &mut s,
            Command::AgentUnreachable {
                agent_id: "b".into(),
                at_ms: 1,
            },
        );
        apply(
            &mut s,
            Command::AgentUnreachable {
                agent_id: "c".into(),
                at_ms: 1,
            },
        );
        apply(
            &mut s,
            Command::AgentLostAfterTimeout {
                agent_id: "c".into(),
                at_ms: 2,
            },
        );
        // a ACTIVE, b UNREACHABLE, c LOST.
        type Case<'a> = (&'a [(&'a str, u64)], &'a [(&'a str, &'a str)]);
        let cases: &[Case] = &[
            (&[], &[]),
            (&[("a", 10), ("b", 120), ("c", 9999)], &[]),
            (&[("a", 11)], &[("unreachable", "a")]),
            (&[("b", 11)], &[]),
            (&[("b", 121)], &[("lost", "b")]),
            (
                &[("a", 500), ("b", 500), ("c", 500)],
                &[("unreachable", "a"), ("lost", "b")],
            ),
        ];
        for (quiet, want) in cases {
            let got = liveness_commands(&s, &lookup(silence(quiet)), 1_000, &T);
            let want: Vec<(&str, String)> = want.iter().map(|(k, a)| (*k, a.to_string())).collect();
            assert_eq!(agents_in(&got), want, "{quiet:?}");
            for c in &got {
                assert!(matches!(
                    c,
                    Command::AgentUnreachable { at_ms: 1_000, .. }
                        | Command::AgentLostAfterTimeout { at_ms: 1_000, .. }
                ));
            }
        }
    }

    #[test]
    fn liveness_then_apply_holds_gpus_through_unreachable_and_lost() {
        let mut s = state();
        apply(
            &mut s,
            Command::SubmitJob {
                spec: JobSpec::new(
                    "j",
                    vec!["true".into()],
                    Resources {
                        cpus: 1.0,
                        mem_mib: 0,
                        gpus: 1,
                        ports: 0,
                    },
                ),
                at_ms: 0,
                request_id: None,
            },
        );
        apply(
            &mut s,
            Command::LaunchTasks {
                launches: vec![Launch {
                    job_id: "job-1".into(),
                    agent_id: "a".into(),
                    gpu_uuids: vec!["GPU-a-0".into()],
                }],
                at_ms: 0,
            },
        );
        // Over time, with no heartbeat from a.
        for (secs, task_state) in [
            (5, TaskState::Staging),
            (11, TaskState::Unreachable),
            (100, TaskState::Unreachable),
            (121, TaskState::Lost),
            (500, TaskState::Lost),
        ] {
            for c in liveness_commands(&s, &lookup(silence(&[("a", secs)])), secs * 1000, &T) {
                let i = s.applied_index() + 1;
                assert_eq!(s.apply(i, &c), Ok(Outcome::Done));
            }
            assert_eq!(s.tasks()["job-1.0"].state, task_state, "after {secs}s");
            assert_eq!(
                s.gpu_owner("GPU-a-0").map(String::as_str),
                Some("job-1.0"),
                "after {secs}s"
            );
        }
    }

    #[test]
    fn a_passed_drain_deadline_is_proposed_once_while_tasks_remain() {
        let mut s = state();
        apply(
            &mut s,
            Command::SubmitJob {
                spec: JobSpec::new("j", vec!["true".into()], Resources::default()),
                at_ms: 0,
                request_id: None,
            },
        );
        apply(
            &mut s,
            Command::LaunchTasks {
                launches: vec![Launch {
                    job_id: "job-1".into(),
                    agent_id: "a".into(),
                    gpu_uuids: vec![],
                }],
                at_ms: 0,
            },
        );
        apply(
            &mut s,
            Command::DrainAgent {
                agent_id: "a".into(),
                kill: false,
                deadline_ms: Some(60_000),
                at_ms: 0,
            },
        );
        // Without a deadline, or with nothing to kill: nothing.
        apply(
            &mut s,
            Command::DrainAgent {
                agent_id: "b".into(),
                kill: false,
                deadline_ms: Some(1),
                at_ms: 0,
            },
        );
        let none = BTreeMap::new();
        assert!(liveness_commands(&s, &lookup(none.clone()), 59_999, &T).is_empty());
        let cmds = liveness_commands(&s, &lookup(none.clone()), 60_000, &T);
        assert_eq!(agents_in(&cmds), vec![("deadline", "a".to_string())]);
        for c in cmds {
            apply(&mut s, c);
        }
        assert!(s.tasks()["job-1.0"].kill_requested);
        assert!(liveness_commands(&s, &lookup(none.clone()), 70_000, &T).is_empty());
    }
}
