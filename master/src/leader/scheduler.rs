//! The built-in job scheduler behind `gpuctl jobs`, as a framework like any
//! other: it subscribes to the leader's offers (in process, through the same
//! Hub the gRPC service uses) and suppresses them while it is alone.
//!
//! - **Alone** (no other framework connected and wanting offers, none
//!   holding any, and no quota on the jobs' role, which the allocator
//!   enforces): it places straight from the state after each change
//!   that may let a waiting job start (`scheduler::place_direct`: agents
//!   found through the free-capacity index, O(log agents) per job of whole
//!   GPUs), and proposes the launches; the state machine re-checks each.
//!   Agents being launched on are marked in the Hub, so a framework that
//!   subscribes meanwhile is not offered them before the launches commit.
//! - **With other frameworks**: it revives offers and places queued jobs on
//!   what it is offered (`scheduler::place_in`: priority order, placement
//!   policy, gangs whole), declines the rest, and the allocator's DRF
//!   divides the cluster, the jobs' tasks counting as this framework's
//!   allocation.
//!
//! Preemption does not wait for offers (a full cluster makes none): after
//! the state changes, while jobs wait, the queue pass (`scheduler::queue`)
//! runs on the whole state, its preemption, if any, is proposed, and why
//! each job waits is published on the `WaitBoard` that the API reads.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use gpuctl_core::time::Backoff;
use gpuctl_core::types::{FrameworkInfo, Resources};
use gpuctl_proto::pb;
use tokio::sync::{mpsc, watch};

use super::board::WaitBoard;
use crate::allocator::refuse_until;
use crate::leader::frameworks::{Hub, EVENT_BUFFER};
use crate::now_ms;
use crate::raft::RaftHandle;
use crate::scheduler::elastic;
use crate::scheduler::queue::{self, QueueConfig};
use crate::scheduler::{place_in, Available, MAX_LAUNCHES_PER_ROUND};
use crate::state::frameworks::{BUILTIN_FRAMEWORK_ID, JOBS_ROLE};
use crate::state::{Command, Launch, Outcome, State};
use gpuctl_core::types::PlacementPolicy;

/// Declined agents come back quickly: a job submitted meanwhile revives
/// offers anyway, and the allocator's other frameworks come first by DRF.
const DECLINE_SECONDS: f64 = 1.0;

fn info() -> FrameworkInfo {
    FrameworkInfo {
        id: BUILTIN_FRAMEWORK_ID.to_string(),
        name: "gpuctl jobs".to_string(),
        roles: vec![JOBS_ROLE.to_string()],
        gpu_capable: true,
        failover_timeout_ms: 0,
        tenant: Default::default(),
    }
}

/// How often, at most, the queue pass runs (reasons, preemptions); less often
/// when a pass is slow (a huge cluster): its cost times [`PASS_SPACING`], so
/// the pass (on a copy of the state, on a blocking thread) takes at most a
/// tenth of the leader's time.
const PASS_EVERY: Duration = Duration::from_millis(250);
const PASS_SPACING: u32 = 10;
/// A queue pass at least this often while reclaim is on, even when
/// nothing changed (a pass over an empty queue returns at once).
const RECHECK_EVERY: Duration = Duration::from_secs(2);
/// While jobs wait and nothing changed, a round straight from the state
/// this often (as declined offers come back after [`DECLINE_SECONDS`]).
const DIRECT_RETRY: Duration = Duration::from_secs(1);
/// While the built-in scheduler places straight from the state, the queue
/// pass waits until some job has been queued this long: one queued just
/// now is about to start, its reason would be stale before anyone read
/// it, and a pass costs a copy of the whole state and views of every
/// agent (5% of a busy leader at 10,000 agents).
const PASS_AFTER_QUEUED: Duration = Duration::from_secs(1);

pub async fn run(
    raft: RaftHandle,
    hub: Arc<Hub>,
    board: Arc<WaitBoard>,
    cfg: QueueConfig,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut status = raft.role_watch();
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    loop {
        // Wait to lead.
        while !status.borrow_and_update().serving {
            tokio::select! {
                _ = shutdown.changed() => return,
                r = status.changed() => if r.is_err() { return },
            }
        }
        if let Err(e) = raft
            .propose(Command::SubscribeFramework {
                request_id: None,
                info: info(),
                at_ms: now_ms(),
            })
            .await
        {
            tracing::warn!(error = %e, "built-in scheduler could not subscribe; retrying");
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tokio::time::sleep(backoff.next_wait()) => {}
            }
            continue;
        }
        backoff.reset();
        if lead(&raft, &hub, &board, cfg, &mut status, &mut shutdown).await == Led::Stop {
            return;
        }
    }
}

/// How a term of leading ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Led {
    /// The master stops.
    Stop,
    /// No longer the leader (or the hub dropped the connection): wait to
    /// lead again.
    Deposed,
}

/// The scheduler while this master leads, subscribed as a framework:
/// places straight from the state or takes offers, runs the queue pass,
/// grows elastic gangs.
async fn lead(
    raft: &RaftHandle,
    hub: &Arc<Hub>,
    board: &Arc<WaitBoard>,
    cfg: QueueConfig,
    status: &mut watch::Receiver<crate::raft::RoleStatus>,
    shutdown: &mut watch::Receiver<bool>,
) -> Led {
    let default_policy = cfg.default_policy;
    // With reclaim on, tenants below their fair share are placed first.
    let fair = cfg.reclaim_min_runtime_ms.is_some();
    let (tx, mut rx) = mpsc::channel(EVENT_BUFFER);
    // Suppressed from the start: while no other framework wants
    // offers, it places straight from the state (`direct`), and a
    // whole-cluster offer would only be declined.
    let conn = hub.connect_suppressed(BUILTIN_FRAMEWORK_ID, tx, Some(true));
    // A round straight from the state is due.
    let mut direct_due = true;
    let mut last_direct = tokio::time::Instant::now();
    let mut applied = raft.applied();
    let mut next_pass = tokio::time::Instant::now();
    // Something changed since the last queue pass.
    let mut dirty = true;
    let mut seen = Revival::of(&raft.state());
    // The pass in progress: it runs beside the offers, not before them.
    let mut running: Option<tokio::task::JoinHandle<Pass>> = None;
    let mut last_grow = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = shutdown.changed() => {
                hub.disconnect(BUILTIN_FRAMEWORK_ID, conn);
                running.take().inspect(|p| p.abort());
                return Led::Stop;
            }
            r = status.changed() => {
                if r.is_err() || !status.borrow_and_update().serving {
                    hub.disconnect(BUILTIN_FRAMEWORK_ID, conn);
                    running.take().inspect(|p| p.abort());
                    board.clear();
                    return Led::Deposed;
                }
            }
            r = applied.changed() => {
                if r.is_err() {
                    return Led::Stop;
                }
                // A job submitted or resources freed while jobs wait:
                // clear our filters and ask for offers again, so they
                // meet at once. Other changes (a job started, an update)
                // do not revive: offers of agents that could not take
                // a waiting job would only come back to be declined
                // (the declines' 1 s filters expire anyway).
                let now = Revival::of(&raft.state());
                if now.worth_reviving_after(&seen) {
                    direct_due = true;
                }
                seen = now;
                // The reasons on the board may be out of date (a job
                // submitted, started or gone).
                dirty = true;
            }
            // Nothing changed, but time passes: a reclaim waits for its
            // victims' minimum runtime.
            _ = tokio::time::sleep_until(next_pass + RECHECK_EVERY),
                if !dirty && running.is_none() && cfg.reclaim_min_runtime_ms.is_some() => {
                dirty = true;
            }
            // Jobs wait and nothing changed: try again now and then.
            _ = tokio::time::sleep_until(last_direct + DIRECT_RETRY), if !direct_due => {
                direct_due = raft.state().has_queued();
                last_direct = tokio::time::Instant::now();
            }
            _ = std::future::ready(()), if direct_due => {
                direct_due = false;
                last_direct = tokio::time::Instant::now();
                if places_directly(&cfg, hub) {
                    if !hub.is_suppressed(BUILTIN_FRAMEWORK_ID) {
                        hub.suppress(BUILTIN_FRAMEWORK_ID);
                    }
                    // A full round: more may fit at once.
                    direct_due = place_direct_round(raft, hub, default_policy, fair).await;
                } else if raft.state().has_queued() {
                    hub.revive(BUILTIN_FRAMEWORK_ID);
                }
            }
            // Elastic gangs below their most ranks: room for more?
            _ = tokio::time::sleep_until(last_grow + elastic::CHECK_EVERY),
                if cfg.elastic_grow_after_ms.is_some() => {
                last_grow = tokio::time::Instant::now();
                grow(raft, cfg).await;
            }
            _ = tokio::time::sleep_until(next_pass), if dirty && running.is_none() => {
                dirty = false;
                let direct = places_directly(&cfg, hub);
                running = Some(tokio::spawn(pass(raft.clone(), cfg, board.clone(), direct)));
            }
            cost = async {
                match running.as_mut() {
                    Some(p) => p.await,
                    None => std::future::pending().await,
                }
            }, if running.is_some() => {
                running = None;
                let cost = cost.unwrap_or_else(|e| {
                    tracing::error!(error = %e, "queue pass failed");
                    Pass::Done(PASS_EVERY)
                });
                let cost = match cost {
                    Pass::Done(cost) => cost,
                    // Jobs that are about to start: look again soon.
                    Pass::Deferred => {
                        dirty = true;
                        Duration::ZERO
                    }
                };
                next_pass = tokio::time::Instant::now() + PASS_EVERY.max(cost * PASS_SPACING);
            }
            e = rx.recv() => match e {
                Some(Ok(pb::Event { event: Some(pb::event::Event::Offers(offers)) })) => {
                    handle_offers(raft, hub, offers.offers, default_policy, fair).await;
                }
                Some(_) => {}
                None => return Led::Deposed,
            },
        }
    }
}

/// What decides whether a state change is worth asking for offers again.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Revival {
    queued: usize,
    submitted: u64,
    free: Resources,
    /// MIG layout changes under way: one that ends made new MIG devices
    /// (fewer devices in all, maybe, but of the profile jobs wait for).
    mig_changes: usize,
}

impl Revival {
    fn of(state: &State) -> Revival {
        Revival {
            queued: state.count_queued(),
            submitted: state.jobs_submitted(),
            free: state.free_total(),
            mig_changes: state.mig_changes().count(),
        }
    }

    /// Jobs wait, and one was submitted or came back to the queue (a
    /// retry, a preemption, its agent lost), something was freed, or a MIG
    /// layout change ended.
    fn worth_reviving_after(&self, before: &Revival) -> bool {
        let (now, was) = (&self.free, &before.free);
        self.queued > 0
            && (self.submitted != before.submitted
                || self.queued > before.queued
                || self.mig_changes < before.mig_changes
                || now.gpus > was.gpus
                || now.cpus > was.cpus
                || now.mem_mib > was.mem_mib)
    }
}

/// Places queued jobs on the offers; with nothing waiting, declines them and
/// suppresses offers until a job is submitted.
///
/// Every offer it is sent is answered: those still outstanding are taken
/// first (an offer rescinded meanwhile is skipped, never a reason to leave
/// the others outstanding until the offer timeout), what is not launched
/// on is declined, and the launches of the whole batch are proposed
/// together so that Raft commits them in few entries.
async fn handle_offers(
    raft: &RaftHandle,
    hub: &Hub,
    offers: Vec<pb::Offer>,
    default_policy: PlacementPolicy,
    fair: bool,
) {
    let ids: Vec<String> = offers.iter().map(|o| o.id.clone()).collect();
    let taken = hub.take_outstanding(BUILTIN_FRAMEWORK_ID, &ids);
    if taken.is_empty() {
        return;
    }
    let agents: BTreeSet<String> = taken.iter().map(|o| o.agent_id.clone()).collect();
    let decline = |hub: &Hub| {
        hub.filter(
            BUILTIN_FRAMEWORK_ID,
            &agents,
            refuse_until(now_ms(), Some(DECLINE_SECONDS)),
        )
    };
    let launches = {
        let state = raft.state();
        if !state.has_queued() {
            drop(state);
            decline(hub);
            hub.suppress(BUILTIN_FRAMEWORK_ID);
            return;
        }
        let mut available: BTreeMap<String, Available> = BTreeMap::new();
        for o in &taken {
            let a = available.entry(o.agent_id.clone()).or_default();
            a.resources = a.resources.add(&o.resources);
            a.gpus.extend(o.gpu_uuids.iter().cloned());
            a.shared.extend(o.shares.iter().map(|s| s.gpu_uuid.clone()));
        }
        place_in(&state, &available, default_policy, fair, now_ms())
    };
    // A full round: more jobs may fit what is left of these offers.
    let capped = launches.len() >= MAX_LAUNCHES_PER_ROUND;
    // Until the launches commit, nothing of these agents is offered again.
    let launching = hub.launching(&agents);
    propose_launches(raft, launches).await;
    // What was not launched on is declined: briefly (a job submitted or
    // resources freed revive offers), or not at all after a full round, so
    // the next round has it at once.
    if !capped {
        decline(hub);
    }
    drop(launching);
}

/// A round straight from the state (`scheduler::place_direct`, through the
/// free-capacity index), while no other framework wants offers. Returns
/// whether it was full (more may fit at once).
async fn place_direct_round(
    raft: &RaftHandle,
    hub: &Hub,
    default_policy: PlacementPolicy,
    fair: bool,
) -> bool {
    let launches = {
        let state = raft.state();
        if !state.has_queued() {
            return false;
        }
        crate::scheduler::place_direct(&state, default_policy, fair, now_ms())
    };
    if launches.is_empty() {
        return false;
    }
    let capped = launches.len() >= MAX_LAUNCHES_PER_ROUND;
    let agents: BTreeSet<String> = launches.iter().map(|l| l.agent_id.clone()).collect();
    // Nothing of these agents is offered to a framework that subscribes
    // meanwhile until the launches commit.
    let launching = hub.launching(&agents);
    hub.metrics
        .direct_launches
        .fetch_add(launches.len() as u64, std::sync::atomic::Ordering::Relaxed);
    propose_launches(raft, launches).await;
    drop(launching);
    capped
}

/// Jobs per `LaunchJobs` entry: a round of 2,048 one-GPU launches is 8
/// entries of a few tens of KiB, not 2,048 entries.
const JOBS_PER_ENTRY: usize = 256;

/// Proposes the launches, a job's together (a gang's launches start
/// together or not at all), up to [`JOBS_PER_ENTRY`] jobs per log entry.
async fn propose_launches(raft: &RaftHandle, launches: Vec<Launch>) {
    let mut per_job: Vec<Vec<Launch>> = Vec::new();
    for launch in launches {
        match per_job.last_mut() {
            Some(group) if group[0].job_id == launch.job_id => group.push(launch),
            _ => per_job.push(vec![launch]),
        }
    }
    let at_ms = now_ms();
    let mut chunks = Vec::new();
    while !per_job.is_empty() {
        let rest = per_job.split_off(per_job.len().min(JOBS_PER_ENTRY));
        chunks.push(std::mem::replace(&mut per_job, rest));
    }
    let proposals = chunks.into_iter().map(|jobs| async move {
        let placed: Vec<(String, Vec<String>)> = jobs
            .iter()
            .map(|g| {
                (
                    g[0].job_id.clone(),
                    g.iter().map(|l| l.agent_id.clone()).collect(),
                )
            })
            .collect();
        match raft.propose(Command::LaunchJobs { jobs, at_ms }).await {
            Ok(Outcome::JobsLaunched { refused }) => {
                for (job_id, agents) in placed {
                    match refused.iter().find(|(j, _)| *j == job_id) {
                        Some((_, why)) => {
                            tracing::warn!(job_id = %job_id, agents = ?agents, error = %why, "placement refused")
                        }
                        None => tracing::info!(job_id = %job_id, agents = ?agents, "job placed"),
                    }
                }
            }
            Ok(_) => {}
            Err(e) => {
                let jobs: Vec<&String> = placed.iter().map(|(j, _)| j).collect();
                tracing::warn!(jobs = ?jobs, error = %e, "placements refused")
            }
        }
    });
    futures::future::join_all(proposals).await;
}

/// Proposes growing the elastic gang that has room for more ranks, if any.
async fn grow(raft: &RaftHandle, cfg: QueueConfig) {
    let cfg = QueueConfig {
        now_ms: now_ms(),
        ..cfg
    };
    let Some((job_id, to)) = elastic::growth(&raft.state(), &cfg) else {
        return;
    };
    tracing::info!(job_id = %job_id, to, "growing an elastic gang: restarting it with more ranks");
    let command = Command::GrowJob {
        job_id: job_id.clone(),
        to,
        at_ms: cfg.now_ms,
    };
    if let Err(e) = raft.propose(command).await {
        tracing::warn!(job_id = %job_id, error = %e, "growing refused");
    }
}

/// Whether the built-in scheduler places straight from the state: no other
/// framework wants offers, and no quota on the jobs' role (the allocator's
/// to enforce: with one, jobs go through offers).
fn places_directly(cfg: &QueueConfig, hub: &Hub) -> bool {
    cfg.jobs_quota.is_none() && hub.alone(BUILTIN_FRAMEWORK_ID)
}

/// What a queue pass did.
enum Pass {
    /// It ran (or found no queue), in this long.
    Done(Duration),
    /// Every queued job was queued less than [`PASS_AFTER_QUEUED`] ago
    /// while placing straight from the state: not run.
    Deferred,
}

/// Runs the queue pass, publishes why each queued job waits, and proposes
/// the preemption it finds, if any; returns how long the pass took.
async fn pass(raft: RaftHandle, cfg: QueueConfig, board: Arc<WaitBoard>, direct: bool) -> Pass {
    let started = std::time::Instant::now();
    // The pass works on a copy, off the async threads: the state's lock is
    // held only while copying, so applying the log never waits for a pass
    // over a big queue (seconds at 10,000 agents and 100,000 jobs).
    let snapshot = {
        let state = raft.state();
        if !state.has_queued() {
            drop(state);
            board.clear();
            return Pass::Done(started.elapsed());
        }
        let fresh_since = now_ms().saturating_sub(PASS_AFTER_QUEUED.as_millis() as u64);
        if direct
            && state
                .queued_jobs()
                .iter()
                .all(|j| j.updated_at_ms > fresh_since)
        {
            return Pass::Deferred;
        }
        state.clone()
    };
    let cfg = QueueConfig {
        now_ms: now_ms(),
        ..cfg
    };
    let planned = tokio::task::spawn_blocking(move || {
        let plan = queue::plan(&snapshot, &cfg);
        let preemption = plan
            .preemption
            .filter(|p| p.reclaim || queue::may_preempt(&snapshot));
        (plan.reasons, preemption)
    })
    .await;
    let cost = started.elapsed();
    let preemption = match planned {
        Ok((reasons, preemption)) => {
            board.publish(reasons);
            preemption
        }
        Err(e) => {
            tracing::error!(error = %e, "queue pass failed");
            None
        }
    };
    let Some(p) = preemption else {
        return Pass::Done(cost);
    };
    let command = if p.reclaim {
        tracing::info!(job_id = %p.job_id, victims = ?p.victims, "reclaiming GPUs from tenants over their fair share");
        Command::ReclaimJobs {
            job_id: p.job_id.clone(),
            victims: p.victims,
            at_ms: cfg.now_ms,
            min_runtime_ms: cfg.reclaim_min_runtime_ms.unwrap_or(0),
        }
    } else {
        tracing::info!(job_id = %p.job_id, victims = ?p.victims, "preempting jobs of lower priority");
        Command::PreemptJobs {
            job_id: p.job_id.clone(),
            victims: p.victims,
            at_ms: now_ms(),
        }
    };
    if let Err(e) = raft.propose(command).await {
        tracing::warn!(job_id = %p.job_id, error = %e, "preemption refused");
    }
    Pass::Done(cost)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn revival(queued: usize, submitted: u64, gpus: u32) -> Revival {
        Revival {
            queued,
            submitted,
            free: Resources {
                cpus: 8.0,
                mem_mib: 1024,
                gpus,
                ports: 0,
            },
            mig_changes: 0,
        }
    }

    #[test]
    fn offers_are_asked_for_again_only_when_a_waiting_job_may_now_start() {
        let before = revival(2, 10, 2);
        // A job submitted, or GPUs freed, while jobs wait.
        assert!(revival(3, 11, 2).worth_reviving_after(&before));
        assert!(revival(2, 10, 3).worth_reviving_after(&before));
        // A job back in the queue (its agent lost, a retry): it may fit
        // what the others do not.
        assert!(revival(3, 10, 2).worth_reviving_after(&before));
        assert!(revival(1, 10, 2).worth_reviving_after(&revival(0, 10, 2)));
        // A job started (less free, one less waiting), or nothing that
        // matters changed.
        assert!(!revival(1, 10, 1).worth_reviving_after(&before));
        assert!(!revival(2, 10, 2).worth_reviving_after(&before));
        // Nothing waits.
        assert!(!revival(0, 11, 8).worth_reviving_after(&before));
        // CPUs or memory freed count too (jobs may ask for no GPU).
        let mut more_cpus = before;
        more_cpus.free.cpus += 1.0;
        assert!(more_cpus.worth_reviving_after(&before));
        // A MIG layout change ended: new MIG devices, maybe fewer in all.
        let mut changing = before;
        changing.mig_changes = 1;
        assert!(revival(2, 10, 1).worth_reviving_after(&changing));
        assert!(!changing.worth_reviving_after(&before));
    }
}
