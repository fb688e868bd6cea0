//! The queue pass: one walk over the queued jobs, highest priority first,
//! on a simulated copy of what is free, that decides (1) which jobs to
//! preempt, if any, and (2) why each queued job waits. PURE.
//!
//! In the walk each job either fits on what the jobs before it left (it is
//! being started, or waits for tasks already being preempted for it), or it
//! may preempt, or it waits for a reason. At most one preemption comes out
//! of a pass; the leader proposes it and runs the pass again once it is
//! applied, when its victims count as free already.
//!
//! **Victims** are gpuctl jobs of strictly lower priority whose attempt is
//! running and not already stopping. Frameworks' tasks are never preempted.
//! A victim is a whole job: preempting a gang stops all its tasks. For one
//! task that does not fit, on each agent that could take it:
//! 1. the agent's deficit: GPUs (matching the job's model and memory), CPUs
//!    and memory it lacks;
//! 2. victims are taken one at a time, the lowest priority first; among
//!    equal priority, one that covers the rest of the deficit on its own
//!    first, the fewest GPUs freed beyond the need first (all the GPUs it
//!    holds, on any agent, count), then the most recently started;
//! 3. then any victim whose removal still leaves the deficit covered is
//!    dropped (the highest priority, then the longest running first), so no
//!    more is preempted than needed.
//!
//! The agent chosen is the one whose victims have the lowest highest
//! priority, then free the fewest GPUs beyond the need, then are fewest,
//! then the first by id. A gang is handled replica by replica: on free
//! resources when it fits, else with victims as above; all replicas or no
//! preemption at all.
//!
//! **Reclaim** (issue 35): a job that neither fits nor finds victims of
//! its own tenant may take GPUs back from other tenants when its tenant,
//! with the job, stays within its fair share (`tenants::fair_shares`).
//! Victims are other tenants' running jobs, of tenants over their share,
//! that have run the minimum runtime (`--reclaim-min-runtime-secs`, no
//! thrash), and never so many of one tenant that it drops below its
//! share. They are chosen as above, one agent at a time, but the lowest
//! priority, then the most recently started, then the fewest GPUs lost
//! first. The freed agents are kept for the reclaiming job alone.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use gpuctl_core::types::{
    find_device, Device, Holding, JobId, JobState, PlacementPolicy, Resources,
};

use super::placement::{self, model_matches, Placement, TaskRequest};
use super::{ask_key, may_use, policy_of, request, reservations, Pool};
use crate::state::{job_seq, JobRecord, State, Stopping};
use gpuctl_core::wait::{
    AgentCounts, AgentIds, Dimension, NeverFits, Requeued, SetAside, WaitReason, Waiting,
};

/// What the pass needs besides the state.
#[derive(Debug, Clone, Copy, Default)]
pub struct QueueConfig {
    pub default_policy: PlacementPolicy,
    /// The quota of the jobs' role (`gpuctl-master --role jobs=...`).
    pub jobs_quota: Option<Resources>,
    /// Reclaim across tenants, with victims that have run at least this
    /// long; `None`: off.
    pub reclaim_min_runtime_ms: Option<u64>,
    /// Grow elastic gangs whose attempt has run this long
    /// (`scheduler::elastic`); `None`: off.
    pub elastic_grow_after_ms: Option<u64>,
    /// The leader's clock at the pass (the minimum runtime's).
    pub now_ms: u64,
}

/// Stop `victims` so that `job_id` can run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preemption {
    pub job_id: JobId,
    pub victims: Vec<JobId>,
    /// Other tenants' jobs over their fair share (a reclaim), not lower
    /// priorities of its own tenant.
    pub reclaim: bool,
}

#[derive(Debug, Default)]
pub struct QueuePlan {
    pub preemption: Option<Preemption>,
    /// Why each queued job waits (`gpuctl jobs list` renders it).
    pub reasons: BTreeMap<JobId, Waiting>,
}

/// The pass over the queue (see the module's doc).
pub fn plan(state: &State, cfg: &QueueConfig) -> QueuePlan {
    let reserved = reservations(state);
    let real = Pool::from_state(state);
    let empty = empty_views(state);
    let real = real.views(&|_| true);
    let totals: HashMap<&str, Resources> = empty.iter().map(|n| (n.id, n.free)).collect();
    let preempted_for = tasks_preempted_for(state);
    let shares = cfg
        .reclaim_min_runtime_ms
        .filter(|_| may_reclaim(state))
        .map(|_| crate::scheduler::tenants::fair_shares(state));
    let ctx = PassCtx {
        state,
        cfg,
        reserved: &reserved,
        real: &real,
        empty: &empty,
        totals: &totals,
        preempted_for: &preempted_for,
        known: Default::default(),
        set_aside: set_aside(state),
        preemptible: state
            .jobs()
            .values()
            .filter(|v| state.preemptible(i32::MAX, &v.id).is_ok())
            .collect(),
        shares,
    };
    let mut walk = Walk {
        sim: Pool::from_state(state),
        usage: jobs_usage(state),
        // Counted only when some tenant has a limit or reclaim may run: a
        // pass over every job and task the queue pass otherwise spares.
        tenant_gpus: match &ctx.shares {
            Some(shares) => shares.iter().map(|(t, f)| (t.clone(), f.used)).collect(),
            None if state.has_tenant_limits() => crate::scheduler::tenants::usage(state)
                .into_iter()
                .map(|(t, u)| (t, u.gpus))
                .collect(),
            None => HashMap::new(),
        },
        first_taker: HashMap::new(),
        misses: Default::default(),
    };
    let mut out = QueuePlan::default();
    for job in state.queued_jobs() {
        if job.not_before_ms > cfg.now_ms {
            out.reasons.insert(
                job.id.clone(),
                Waiting {
                    reason: WaitReason::Backoff {
                        until_ms: job.not_before_ms,
                    },
                    requeued: requeued(job),
                },
            );
        }
    }
    for job in super::queue_order(state, ctx.shares.as_ref(), cfg.now_ms) {
        let reason = pass_job(&ctx, &mut walk, job, &mut out);
        out.reasons.insert(
            job.id.clone(),
            Waiting {
                reason,
                requeued: requeued(job),
            },
        );
    }
    out
}

/// Whether some queued job has a priority above some running job's: only
/// then can the pass find a preemption (a cheap test that spares the
/// leader the pass in a cluster that does not use priorities).
pub fn may_preempt(state: &State) -> bool {
    let Some(top) = state.queued_jobs().first().map(|j| j.spec.priority) else {
        return false;
    };
    state.jobs().values().any(|j| {
        j.spec.priority < top
            && matches!(j.state, JobState::Starting | JobState::Running)
            && j.stopping.is_none()
    })
}

/// Whether a reclaim may be found: a queued job asking for GPUs while
/// another tenant's job runs (cheap; the fair shares are worked out only
/// then).
pub fn may_reclaim(state: &State) -> bool {
    let waiting: BTreeSet<&str> = state
        .queued_jobs()
        .iter()
        .filter(|j| crate::scheduler::tenants::job_quota_gpus(&j.spec) > 0)
        .map(|j| j.spec.tenant.name())
        .collect();
    !waiting.is_empty()
        && state.jobs().values().any(|j| {
            matches!(j.state, JobState::Starting | JobState::Running)
                && j.stopping.is_none()
                && waiting.iter().any(|t| *t != j.spec.tenant.name())
        })
}

/// The reason for one job, for a caller that wants only that.
pub fn wait_reason(state: &State, cfg: &QueueConfig, job_id: &str) -> Option<Waiting> {
    plan(state, cfg).reasons.remove(job_id)
}

/// What stays the same over a pass.
struct PassCtx<'p, 's> {
    state: &'s State,
    cfg: &'p QueueConfig,
    reserved: &'p BTreeMap<String, (JobId, i32)>,
    /// What is free now, before the pass.
    real: &'p [placement::NodeView<'s>],
    /// Every agent as if empty.
    empty: &'p [placement::NodeView<'s>],
    /// Each active agent's total.
    totals: &'p HashMap<&'s str, Resources>,
    /// Tasks being preempted for each queued job.
    preempted_for: &'p HashMap<&'s str, StoppingFor>,
    /// What depends only on what a job asks (queues are often many copies
    /// of a few specs), by [`ask_key`].
    known: std::cell::RefCell<HashMap<String, Known>>,
    /// Agents left out because they take no new tasks now (draining or
    /// unreachable), for the reason of a job that fits nowhere else.
    set_aside: SetAside,
    /// The jobs that could be preempted by some priority (running, not
    /// stopping), found once per pass: looking through every job for each
    /// queued one made the pass quadratic in the number of jobs.
    preemptible: Vec<&'s JobRecord>,
    /// Each tenant's fair share, when a reclaim may be found.
    shares: Option<BTreeMap<String, crate::scheduler::tenants::FairShare>>,
}

#[derive(Default)]
struct Known {
    never_fits: Option<NeverFits>,
    /// Worked out for the first such job waiting for resources.
    busy: Option<AgentCounts>,
    /// Where it would go in what is free now, before the walk (constant
    /// over a pass).
    fits_now: Option<Option<Vec<Placement>>>,
}

/// What changes as the pass walks the queue.
struct Walk<'s> {
    /// What is free once the jobs before take theirs.
    sim: Pool<'s>,
    /// What gpuctl's jobs hold, for the quota.
    usage: Resources,
    /// The first job of the walk to take resources on each agent: who a
    /// job that fits what is free now waits behind.
    first_taker: HashMap<String, JobId>,
    /// Asks (with the priority, which decides the agents kept for a
    /// preemptor a job may use) that found no room in `sim`: what is free
    /// only shrinks as the walk goes on, so a later job asking the same
    /// fails too, without placing again. Emptied when `sim` gains (the
    /// victims of a preemption). A burst of alike jobs past the cluster's
    /// size is then linear in the queue, not queue times agents.
    misses: std::collections::HashSet<(String, i32)>,
    /// GPUs held by each tenant with a limit (every tenant when a reclaim
    /// may be found).
    tenant_gpus: HashMap<String, u32>,
}

impl<'s> Walk<'s> {
    fn take(&mut self, job: &JobRecord, resources: &Resources, ps: &[Placement]) {
        for p in ps {
            self.sim.take(
                &p.node,
                resources,
                Holding::of(&p.gpus, job.spec.placement.fraction.as_ref()),
            );
            if !self.first_taker.contains_key(&p.node) {
                self.first_taker.insert(p.node.clone(), job.id.clone());
            }
        }
    }
}

/// Agents that are not LOST but take no new tasks (draining, unreachable).
fn set_aside(state: &State) -> SetAside {
    use crate::state::AgentState;
    let mut draining = Vec::new();
    let mut unreachable = Vec::new();
    for a in state.agents().values() {
        match a.state {
            AgentState::Unreachable => unreachable.push(a.info.id.as_str()),
            AgentState::Active if a.drain.is_some() => draining.push(a.info.id.as_str()),
            _ => {}
        }
    }
    SetAside {
        draining: AgentIds::of(draining),
        unreachable: AgentIds::of(unreachable),
    }
}

fn pass_job<'s>(
    ctx: &PassCtx<'_, 's>,
    walk: &mut Walk<'s>,
    job: &'s JobRecord,
    out: &mut QueuePlan,
) -> WaitReason {
    let PassCtx {
        cfg,
        reserved,
        real,
        empty,
        ..
    } = *ctx;
    let spec = &job.spec;
    let req = request(job, cfg.now_ms);
    // An elastic gang needs its fewest ranks to start, and takes as many
    // more as fit (within its quotas); a fixed gang's are one number.
    let (replicas, max_replicas) = (spec.min_replicas(), spec.replicas());
    let policy = policy_of(spec, cfg.default_policy);
    let key = ask_key(job);
    let never = ctx
        .known
        .borrow_mut()
        .entry(key.clone())
        .or_insert_with(|| Known {
            never_fits: never_fits(ctx.totals, empty, &req, replicas),
            busy: None,
            fits_now: None,
        })
        .never_fits
        .clone();
    if let Some(why) = never {
        return WaitReason::NeverFits {
            why,
            set_aside: ctx.set_aside.clone(),
        };
    }
    let tenant = spec.tenant.name();
    let most = match most_within_quotas(ctx, walk, job, replicas, max_replicas) {
        Ok(most) => most,
        Err(why) => return why,
    };
    let stopping_for_it = ctx
        .preempted_for
        .get(job.id.as_str())
        .cloned()
        .unwrap_or_default();
    // The preemptor itself may use the agents kept for it: not alike.
    let miss =
        (!reserved.values().any(|(by, _)| *by == job.id)).then(|| (key.clone(), spec.priority));
    let fits = if miss.as_ref().is_some_and(|m| walk.misses.contains(m)) {
        None
    } else {
        placement::place_upto(
            &req,
            replicas,
            most,
            &walk.sim.usable_views(reserved, job),
            policy,
        )
    };
    if fits.is_none() {
        walk.misses.extend(miss);
    }
    if let Some(ps) = fits {
        let placed = u32::try_from(ps.len()).unwrap_or(u32::MAX);
        walk.take(job, &spec.template.resources, &ps);
        walk.usage = walk.usage.add(&times(&spec.template.resources, placed));
        *walk.tenant_gpus.entry(tenant.to_string()).or_default() +=
            crate::scheduler::tenants::quota_gpus(
                &spec.template.resources,
                spec.placement.fraction,
            )
            .saturating_mul(placed);
        return if stopping_for_it.tasks > 0 {
            preempting_reason(stopping_for_it)
        } else {
            WaitReason::Starting
        };
    }
    if out.preemption.is_none() {
        if let Some(why) = preempt_for(ctx, walk, job, &req, policy, &stopping_for_it, out) {
            return why;
        }
    }
    if stopping_for_it.tasks > 0 {
        return preempting_reason(stopping_for_it);
    }
    let fits_now = ctx
        .known
        .borrow_mut()
        .entry(key.clone())
        .or_default()
        .fits_now
        .get_or_insert_with(|| placement::place_gang(&req, replicas, real, policy))
        .clone();
    if let Some(ps) = fits_now {
        return priority_reason(ctx, walk, job, &ps);
    }
    let totals = |id: &str| ctx.totals.get(id).copied().unwrap_or_default();
    let counts = *ctx
        .known
        .borrow_mut()
        .entry(key)
        .or_default()
        .busy
        .get_or_insert_with(|| placement::agent_counts(&req, real, &totals));
    WaitReason::Resources(counts)
}

/// The most ranks the job may start within the cluster's quota for jobs
/// and its tenant's GPU quota, or why it waits for them.
fn most_within_quotas(
    ctx: &PassCtx<'_, '_>,
    walk: &Walk<'_>,
    job: &JobRecord,
    replicas: u32,
    max_replicas: u32,
) -> Result<u32, WaitReason> {
    let spec = &job.spec;
    let need = times(&spec.template.resources, replicas);
    let mut most = max_replicas;
    if let Some(q) = ctx.cfg.jobs_quota {
        if !q.fits(&walk.usage.add(&need)) {
            return Err(quota_reason(&q, &walk.usage, &need));
        }
        while most > replicas && !q.fits(&walk.usage.add(&times(&spec.template.resources, most))) {
            most -= 1;
        }
    }
    let tenant = spec.tenant.name();
    let quota_need = crate::scheduler::tenants::job_quota_gpus(spec);
    if let Some(quota) = ctx.state.tenant_cap(tenant) {
        let used = walk.tenant_gpus.get(tenant).copied().unwrap_or(0);
        if quota_need > 0 && used.saturating_add(quota_need) > quota {
            return Err(WaitReason::TenantQuota {
                tenant: tenant.to_string(),
                quota,
                used,
                asked: quota_need,
            });
        }
        most = most.min(crate::scheduler::tenants::ranks_within(
            spec,
            Some(quota.saturating_sub(used)),
        ));
    }
    Ok(most)
}

/// The pass's one preemption, when the job can have its room by stopping
/// lower-priority jobs (or by reclaiming from tenants over their share):
/// the victims' resources go back to the walk and the job takes its room.
fn preempt_for<'s>(
    ctx: &PassCtx<'_, 's>,
    walk: &mut Walk<'s>,
    job: &'s JobRecord,
    req: &placement::TaskRequest<'_>,
    policy: PlacementPolicy,
    stopping_for_it: &StoppingFor,
    out: &mut QueuePlan,
) -> Option<WaitReason> {
    let state = ctx.state;
    let spec = &job.spec;
    let need = times(&spec.template.resources, spec.min_replicas());
    let tenant = spec.tenant.name();
    let quota_need = crate::scheduler::tenants::job_quota_gpus(spec);
    let found = find_victims(ctx, &walk.sim, job, req, policy)
        .map(|f| (f, false))
        .or_else(|| find_reclaim(ctx, walk, job, req, policy, quota_need).map(|f| (f, true)));
    if let Some(((victims, ps), reclaim)) = found {
        let mut freed = 0;
        let mut from = BTreeSet::new();
        walk.misses.clear();
        for v in &victims {
            let victim_tenant = state.job(v).map_or("", |j| j.spec.tenant.name());
            from.insert(victim_tenant.to_string());
            for t in live_tasks(state, v) {
                walk.sim.give(&t.agent_id, &t.resources, t.holding());
                walk.usage = walk.usage.saturating_sub(&t.resources);
                if let Some(g) = walk.tenant_gpus.get_mut(victim_tenant) {
                    *g = g.saturating_sub(crate::scheduler::tenants::quota_gpus(
                        &t.resources,
                        t.fraction,
                    ));
                }
                freed += 1;
            }
        }
        walk.take(job, &spec.template.resources, &ps);
        walk.usage = walk.usage.add(&need);
        *walk.tenant_gpus.entry(tenant.to_string()).or_default() += quota_need;
        out.preemption = Some(Preemption {
            job_id: job.id.clone(),
            victims,
            reclaim,
        });
        let mut stopping = stopping_for_it.clone();
        stopping.tasks += freed;
        if reclaim {
            stopping.reclaim_from.extend(from);
        }
        return Some(preempting_reason(stopping));
    }
    None
}

/// A job that fits what is free now waits behind the first job of the walk
/// that took resources on one of the agents it would use, or behind the
/// preemptor an agent is kept for.
fn priority_reason(ctx: &PassCtx, walk: &Walk, job: &JobRecord, ps: &[Placement]) -> WaitReason {
    for p in ps {
        if !may_use(ctx.reserved, job, &p.node) {
            if let Some((by, _)) = ctx.reserved.get(&p.node) {
                return WaitReason::Priority {
                    blocked_by: Some(by.clone()),
                    kept_for_preemption: true,
                };
            }
        }
        if let Some(by) = walk.first_taker.get(&p.node) {
            return WaitReason::Priority {
                blocked_by: Some(by.clone()),
                kept_for_preemption: false,
            };
        }
    }
    WaitReason::Priority {
        blocked_by: None,
        kept_for_preemption: false,
    }
}

/// How a requeued job came back: preempted, retried after a failure, or
/// requeued without a retry (its GPU failed under it).
fn requeued(job: &JobRecord) -> Option<Requeued> {
    let preempted_by = job.preempted_by.clone();
    let after = (!job.message.is_empty()
        && preempted_by.is_none()
        && (job.retries > 0 || !job.task_ids.is_empty()))
    .then(|| job.message.clone());
    let back = preempted_by.is_some() || job.retries > 0 || after.is_some();
    back.then_some(Requeued {
        preempted_by,
        retries: job.retries,
        max_retries: job.spec.max_retries,
        after,
    })
}

fn preempting_reason(s: StoppingFor) -> WaitReason {
    WaitReason::Preempting {
        waiting_for_tasks: u32::try_from(s.tasks).unwrap_or(u32::MAX),
        reclaim_from: s.reclaim_from.into_iter().collect(),
    }
}

/// The tasks being stopped for a queued job, and the tenants they are
/// reclaimed from (none for a preemption).
#[derive(Debug, Clone, Default)]
struct StoppingFor {
    tasks: usize,
    reclaim_from: BTreeSet<String>,
}

fn quota_reason(q: &Resources, usage: &Resources, need: &Resources) -> WaitReason {
    let mut over = Vec::new();
    if need.gpus > 0 && usage.gpus.saturating_add(need.gpus) > q.gpus {
        over.push(Dimension::Gpus);
    }
    if usage.cpus + need.cpus > q.cpus + 1e-9 {
        over.push(Dimension::Cpus);
    }
    if usage.mem_mib.saturating_add(need.mem_mib) > q.mem_mib {
        over.push(Dimension::Memory);
    }
    WaitReason::Quota {
        used: *usage,
        asked: *need,
        limit: *q,
        over,
    }
}

/// Every agent that takes new tasks (active, not draining) as if empty:
/// what could ever run.
fn empty_views(state: &State) -> Vec<placement::NodeView<'_>> {
    state
        .agents()
        .values()
        .filter(|a| a.accepts_tasks())
        .map(|a| placement::NodeView {
            id: a.info.id.as_str(),
            attributes: &a.info.attributes,
            runtimes: &a.info.runtimes,
            allow_root_tasks: a.info.allow_root_tasks,
            allowed_mounts: &a.info.allowed_mounts,
            allowed_users: a.info.allowed_users.as_ref(),
            free: a.info.total,
            free_gpus: a.info.gpus.iter().filter(|g| !g.mig.enabled).collect(),
            all_gpus: &a.info.gpus,
            free_mig: gpuctl_core::types::mig_devices_of(&a.info.gpus).collect(),
            // Every shared GPU, as if none of its fractions were held.
            free_shared: a
                .info
                .gpus
                .iter()
                .filter(|g| state.share_mode(&g.uuid).is_some())
                .map(|g| (g, g.memory_mib, 100))
                .collect(),
            driver: placement::NodeDriver::new(
                a.info.driver_version.as_deref(),
                a.info.cuda_driver_version.as_deref(),
            ),
        })
        .collect()
}

/// What a requirement no agent could ever meet is, or a gang that could
/// not fit even on an empty cluster.
fn never_fits(
    totals: &HashMap<&str, Resources>,
    nodes: &[placement::NodeView],
    req: &TaskRequest,
    replicas: u32,
) -> Option<NeverFits> {
    let totals = |id: &str| totals.get(id).copied().unwrap_or_default();
    if let Some(why) = placement::unsatisfiable(req, nodes, &totals) {
        return Some(why);
    }
    if replicas > 1
        && placement::place_gang(req, replicas, nodes, PlacementPolicy::Bundle).is_none()
    {
        return Some(NeverFits::Gang {
            replicas,
            gpus: req.resources.gpus,
        });
    }
    None
}

fn times(r: &Resources, n: u32) -> Resources {
    Resources {
        cpus: r.cpus * f64::from(n),
        mem_mib: r.mem_mib.saturating_mul(u64::from(n)),
        gpus: r.gpus.saturating_mul(n),
        ports: r.ports.saturating_mul(n),
    }
}

/// What gpuctl's jobs hold, not counting tasks being stopped.
fn jobs_usage(state: &State) -> Resources {
    state
        .tasks()
        .values()
        .filter(|t| t.framework_id.is_empty() && !t.state.is_terminal() && !t.kill_requested)
        .fold(Resources::default(), |acc, t| acc.add(&t.resources))
}

/// Tasks still running that were preempted or reclaimed, by the job they
/// were stopped for.
fn tasks_preempted_for(state: &State) -> HashMap<&str, StoppingFor> {
    let mut out: HashMap<&str, StoppingFor> = HashMap::new();
    for j in state.jobs().values() {
        let Some(Stopping::Preempted {
            by, reclaimed_for, ..
        }) = &j.stopping
        else {
            continue;
        };
        let live = j
            .current_tasks()
            .iter()
            .filter(|t| state.task(t).is_some_and(|t| !t.state.is_terminal()))
            .count();
        let e = out.entry(by.as_str()).or_default();
        e.tasks += live;
        if reclaimed_for.is_some() && live > 0 {
            e.reclaim_from.insert(j.spec.tenant.name().to_string());
        }
    }
    out
}

/// The live tasks of a job's current attempt.
fn live_tasks<'s>(
    state: &'s State,
    job_id: &str,
) -> impl Iterator<Item = &'s crate::state::TaskRecord> {
    state
        .job(job_id)
        .map(|j| j.current_tasks())
        .unwrap_or_default()
        .iter()
        .filter_map(|t| state.task(t))
        .filter(|t| !t.state.is_terminal() && !t.kill_requested)
}

mod victims;
use victims::*;

#[cfg(test)]
mod tests;
