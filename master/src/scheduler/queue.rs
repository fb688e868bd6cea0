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

use gpuctl_core::types::{find_device, Device, JobId, JobState, PlacementPolicy, Resources};

use super::placement::{self, model_matches, Placement, TaskRequest};
use super::{ask_key, may_use, policy_of, request, reservations, Pool};
use crate::state::access::tenant_of;
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
    for job in super::queue_order(state, ctx.shares.as_ref()) {
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
        .map(|j| tenant_of(&j.spec))
        .collect();
    !waiting.is_empty()
        && state.jobs().values().any(|j| {
            matches!(j.state, JobState::Starting | JobState::Running)
                && j.stopping.is_none()
                && waiting.iter().any(|t| *t != tenant_of(&j.spec))
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
            self.sim
                .take(&p.node, resources, &p.gpus, job.spec.placement.fraction);
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
        state,
        cfg,
        reserved,
        real,
        empty,
        ..
    } = *ctx;
    let spec = &job.spec;
    let req = request(job);
    let replicas = spec.replicas();
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
    let need = times(&spec.resources, replicas);
    if let Some(q) = cfg.jobs_quota {
        if !q.fits(&walk.usage.add(&need)) {
            return quota_reason(&q, &walk.usage, &need);
        }
    }
    let tenant = tenant_of(spec);
    let quota_need = crate::scheduler::tenants::job_quota_gpus(spec);
    if let Some(quota) = state.tenant_cap(tenant) {
        let used = walk.tenant_gpus.get(tenant).copied().unwrap_or(0);
        if quota_need > 0 && used.saturating_add(quota_need) > quota {
            return WaitReason::TenantQuota {
                tenant: tenant.to_string(),
                quota,
                used,
                asked: quota_need,
            };
        }
    }
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
        placement::place_gang(
            &req,
            replicas,
            &walk.sim.usable_views(reserved, job),
            policy,
        )
    };
    if fits.is_none() {
        walk.misses.extend(miss);
    }
    if let Some(ps) = fits {
        walk.take(job, &spec.resources, &ps);
        walk.usage = walk.usage.add(&need);
        *walk.tenant_gpus.entry(tenant.to_string()).or_default() += quota_need;
        return if stopping_for_it.tasks > 0 {
            preempting_reason(stopping_for_it)
        } else {
            WaitReason::Starting
        };
    }
    if out.preemption.is_none() {
        let found = find_victims(ctx, &walk.sim, job, &req, policy)
            .map(|f| (f, false))
            .or_else(|| find_reclaim(ctx, walk, job, &req, policy, quota_need).map(|f| (f, true)));
        if let Some(((victims, ps), reclaim)) = found {
            let mut freed = 0;
            let mut from = BTreeSet::new();
            walk.misses.clear();
            for v in &victims {
                let victim_tenant = state.job(v).map_or("", |j| tenant_of(&j.spec));
                from.insert(victim_tenant.to_string());
                for t in live_tasks(state, v) {
                    walk.sim
                        .give(&t.agent_id, &t.resources, &t.gpu_uuids, t.fraction);
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
            walk.take(job, &spec.resources, &ps);
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
            return preempting_reason(stopping);
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
            e.reclaim_from.insert(tenant_of(&j.spec).to_string());
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

/// A job that may be preempted, as the victim search sees it.
struct Victim<'s> {
    job: &'s JobRecord,
    /// Every GPU it holds, on any agent.
    gpus_total: u32,
    /// What it counts against its tenant (quota units).
    units: u32,
    /// When its attempt started (its tasks' launch).
    started_ms: u64,
}

/// Which victims a job may have, and how they are chosen.
enum Rule<'a> {
    /// Its own tenant's, of lower priority.
    Priority,
    /// Other tenants' over their fair share: at most `budget` units of
    /// each (what it holds beyond its share).
    Reclaim { budget: &'a BTreeMap<String, u32> },
}

/// What a victim frees on one agent, in the units of the deficit.
#[derive(Debug, Clone, Copy, Default)]
struct Amount {
    gpus: i64,
    cpus: f64,
    mem: i64,
}

impl Amount {
    fn covered_by(&self, got: &Amount) -> bool {
        got.gpus >= self.gpus && got.cpus + 1e-9 >= self.cpus && got.mem >= self.mem
    }
    fn helps(&self, by: &Amount) -> bool {
        (self.gpus > 0 && by.gpus > 0)
            || (self.cpus > 1e-9 && by.cpus > 1e-9)
            || (self.mem > 0 && by.mem > 0)
    }
    fn add(&self, o: &Amount) -> Amount {
        Amount {
            gpus: self.gpus + o.gpus,
            cpus: self.cpus + o.cpus,
            mem: self.mem + o.mem,
        }
    }
}

/// Whether the device serves the task: a healthy whole GPU for a task of
/// whole GPUs, a MIG device of its profile on a healthy GPU for a MIG task;
/// the memory is the device's, the model its GPU's.
fn gpu_matches(req: &TaskRequest, d: Device<'_>) -> bool {
    let g = d.gpu();
    g.healthy
        && d.mig_profile() == req.mig
        && !(req.mig.is_none() && g.mig.enabled)
        && d.memory_mib() >= req.gpu_mem_min_mib
        && req.gpu_model.is_none_or(|p| model_matches(p, &g.model))
}

/// How good an agent's victims are, lower first: their highest priority,
/// (for a reclaim) how recently the oldest of them started, the GPUs freed
/// beyond the need, how many, the agent's id.
type NodeScore = (i32, std::cmp::Reverse<u64>, i64, usize, String);

/// Victims (jobs) and the placements of all of the
/// job's replicas once they are gone; `None` when preempting every job
/// it may preempt would still not make it fit.
fn find_victims<'s>(
    ctx: &PassCtx<'_, 's>,
    sim: &Pool<'s>,
    job: &JobRecord,
    req: &TaskRequest,
    policy: PlacementPolicy,
) -> Option<(Vec<JobId>, Vec<Placement>)> {
    let state = ctx.state;
    let priority = job.spec.priority;
    // Priorities order a tenant's own jobs: a job never preempts another
    // tenant's (else any user could take every GPU by asking a high
    // priority). Without tokens every job is the default tenant's.
    let tenant = tenant_of(&job.spec);
    let cands = victims_among(
        state,
        ctx.preemptible
            .iter()
            .copied()
            .filter(|v| v.spec.priority < priority && tenant_of(&v.spec) == tenant),
    );
    choose_victims(ctx, sim, job, req, policy, cands, &Rule::Priority)
}

/// A reclaim for `job` (see the module's doc): victims of other tenants
/// over their fair share, when its tenant with the job (`units`) stays
/// within its own.
fn find_reclaim<'s>(
    ctx: &PassCtx<'_, 's>,
    walk: &Walk<'s>,
    job: &JobRecord,
    req: &TaskRequest,
    policy: PlacementPolicy,
    units: u32,
) -> Option<(Vec<JobId>, Vec<Placement>)> {
    let shares = ctx.shares.as_ref()?;
    let min_runtime = ctx.cfg.reclaim_min_runtime_ms?;
    let tenant = tenant_of(&job.spec);
    let held = |t: &str| walk.tenant_gpus.get(t).copied().unwrap_or(0);
    let share = shares.get(tenant)?.share;
    if units == 0 || held(tenant).saturating_add(units) > share {
        return None;
    }
    let budget: BTreeMap<String, u32> = shares
        .iter()
        .filter(|(t, f)| t.as_str() != tenant && held(t) > f.share)
        .map(|(t, f)| (t.clone(), held(t) - f.share))
        .collect();
    if budget.is_empty() {
        return None;
    }
    let state = ctx.state;
    let cands: Vec<Victim> = victims_among(
        state,
        ctx.preemptible
            .iter()
            .copied()
            .filter(|v| budget.contains_key(tenant_of(&v.spec))),
    )
    .into_iter()
    .filter(|v| {
        v.started_ms.saturating_add(min_runtime) <= ctx.cfg.now_ms
            && v.units <= budget[tenant_of(&v.job.spec)]
    })
    .collect();
    choose_victims(
        ctx,
        &walk.sim,
        job,
        req,
        policy,
        cands,
        &Rule::Reclaim { budget: &budget },
    )
}

/// The jobs among `jobs` with live tasks, as victims.
fn victims_among<'s>(
    state: &'s State,
    jobs: impl Iterator<Item = &'s JobRecord>,
) -> Vec<Victim<'s>> {
    jobs.filter_map(|v| {
        let tasks: Vec<_> = live_tasks(state, &v.id).collect();
        if tasks.is_empty() {
            return None;
        }
        Some(Victim {
            job: v,
            gpus_total: tasks.iter().map(|t| t.gpu_uuids.len() as u32).sum(),
            units: tasks
                .iter()
                .map(|t| crate::scheduler::tenants::quota_gpus(&t.resources, t.fraction))
                .sum(),
            started_ms: tasks.iter().map(|t| t.created_at_ms).max().unwrap_or(0),
        })
    })
    .collect()
}

/// Victims among `cands` and the placements of all of the job's replicas
/// once they are gone (see the module's doc).
fn choose_victims<'s>(
    ctx: &PassCtx<'_, 's>,
    sim: &Pool<'s>,
    job: &JobRecord,
    req: &TaskRequest,
    policy: PlacementPolicy,
    cands: Vec<Victim<'s>>,
    rule: &Rule,
) -> Option<(Vec<JobId>, Vec<Placement>)> {
    let (state, reserved) = (ctx.state, ctx.reserved);
    if cands.is_empty() {
        return None;
    }
    // The candidates with tasks on each agent: only those agents can gain.
    let mut by_node: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, v) in cands.iter().enumerate() {
        for t in live_tasks(state, &v.job.id) {
            let list = by_node.entry(t.agent_id.as_str()).or_default();
            if list.last() != Some(&i) {
                list.push(i);
            }
        }
    }
    let mut pool = sim.clone();
    let mut chosen: Vec<JobId> = Vec::new();
    let mut placements = Vec::new();
    let usable = |id: &str| may_use(reserved, job, id);
    for _ in 0..job.spec.replicas() {
        if let Some(p) = placement::place_task(req, &pool.views(&usable), policy) {
            pool.take(&p.node, &req.resources, &p.gpus, req.fraction);
            placements.push(p);
            continue;
        }
        let mut best: Option<(NodeScore, String, Vec<JobId>)> = None;
        for (node_id, idx) in &by_node {
            if !usable(node_id) {
                continue;
            }
            let Some(node) = pool.node(node_id) else {
                continue;
            };
            if !placement::node_matches(req, &node.view()) {
                continue;
            }
            let left: Vec<&Victim> = idx
                .iter()
                .map(|i| &cands[*i])
                .filter(|v| !chosen.contains(&v.job.id))
                .collect();
            let Some((set, excess)) = victims_on_node(state, &pool, node_id, req, &left, rule)
            else {
                continue;
            };
            if let Rule::Reclaim { budget } = rule {
                if !within_budget(budget, chosen.iter().chain(&set), &cands) {
                    continue;
                }
            }
            let top = set
                .iter()
                .filter_map(|id| state.job(id))
                .map(|j| j.spec.priority)
                .max()
                .unwrap_or(i32::MIN);
            let youth = match rule {
                Rule::Priority => 0,
                Rule::Reclaim { .. } => set
                    .iter()
                    .filter_map(|id| cands.iter().find(|c| &c.job.id == id))
                    .map(|c| c.started_ms)
                    .min()
                    .unwrap_or(0),
            };
            let score = (
                top,
                std::cmp::Reverse(youth),
                excess,
                set.len(),
                node_id.to_string(),
            );
            if best.as_ref().is_none_or(|(s, _, _)| score < *s) {
                best = Some((score, node_id.to_string(), set));
            }
        }
        let (_, node, set) = best?;
        for v in &set {
            for t in live_tasks(state, v) {
                pool.give(&t.agent_id, &t.resources, &t.gpu_uuids, t.fraction);
            }
        }
        chosen.extend(set);
        let view = pool.node(&node)?.view();
        let p = placement::place_task(req, std::slice::from_ref(&view), policy)?;
        pool.take(&p.node, &req.resources, &p.gpus, req.fraction);
        placements.push(p);
    }
    if chosen.is_empty() {
        return None; // it fits without preempting
    }
    Some((chosen, placements))
}

/// Whether `victims` take no tenant below its fair share: at most its
/// budget of units from each.
fn within_budget<'v>(
    budget: &BTreeMap<String, u32>,
    victims: impl Iterator<Item = &'v JobId>,
    cands: &[Victim],
) -> bool {
    let mut taken: BTreeMap<&str, u32> = BTreeMap::new();
    for id in victims {
        let Some(v) = cands.iter().find(|c| &c.job.id == id) else {
            continue;
        };
        *taken.entry(tenant_of(&v.job.spec)).or_default() += v.units;
    }
    taken
        .iter()
        .all(|(t, n)| budget.get(*t).is_some_and(|b| n <= b))
}

/// The fewest victims on `node_id` that make one task fit there (see the
/// module's doc), and the GPUs they free beyond the need.
fn victims_on_node(
    state: &State,
    pool: &Pool,
    node_id: &str,
    req: &TaskRequest,
    cands: &[&Victim],
    rule: &Rule,
) -> Option<(Vec<JobId>, i64)> {
    let node = pool.node(node_id)?;
    let need = req.resources;
    let gpu_of = |uuid: &str| find_device(&node.agent.info.gpus, uuid);
    let free_matching = node
        .free_gpus
        .iter()
        .filter(|u| gpu_of(u).is_some_and(|g| gpu_matches(req, g)))
        .count() as i64;
    let deficit = Amount {
        gpus: (i64::from(need.gpus) - free_matching).max(0),
        cpus: (need.cpus - node.free.cpus).max(0.0),
        mem: (need.mem_mib as i64 - node.free.mem_mib.min(i64::MAX as u64) as i64).max(0),
    };
    // What each candidate frees here.
    let local: Vec<(&Victim, Amount)> = cands
        .iter()
        .map(|v| {
            let mut a = Amount::default();
            for t in live_tasks(state, &v.job.id).filter(|t| t.agent_id == node_id) {
                a.cpus += t.resources.cpus;
                a.mem += t.resources.mem_mib.min(i64::MAX as u64) as i64;
                a.gpus += t
                    .gpu_uuids
                    .iter()
                    .filter(|u| gpu_of(u).is_some_and(|g| gpu_matches(req, g)))
                    .count() as i64;
            }
            (*v, a)
        })
        .filter(|(_, a)| deficit.helps(a))
        .collect();
    let mut got = Amount::default();
    let mut chosen: Vec<usize> = Vec::new();
    while !deficit.covered_by(&got) {
        let rest = Amount {
            gpus: (deficit.gpus - got.gpus).max(0),
            cpus: (deficit.cpus - got.cpus).max(0.0),
            mem: (deficit.mem - got.mem).max(0),
        };
        let pick = local
            .iter()
            .enumerate()
            .filter(|(i, (_, a))| !chosen.contains(i) && rest.helps(a))
            .min_by_key(|(_, (v, a))| {
                let covers = rest.covered_by(a);
                let excess = if covers {
                    i64::from(v.gpus_total) - rest.gpus
                } else {
                    0
                };
                let young = std::cmp::Reverse(v.started_ms);
                let seq = std::cmp::Reverse(job_seq(&v.job.id));
                match rule {
                    Rule::Priority => (v.job.spec.priority, !covers, excess, young, 0, seq),
                    // The lowest priority, the youngest, the fewest GPUs.
                    Rule::Reclaim { .. } => (
                        v.job.spec.priority,
                        false,
                        0,
                        young,
                        i64::from(v.gpus_total),
                        seq,
                    ),
                }
            })
            .map(|(i, _)| i)?;
        got = got.add(&local[pick].1);
        chosen.push(pick);
    }
    // Drop what is not needed: the least wanted victims first.
    let mut order = chosen.clone();
    order.sort_by_key(|i| {
        let v = local[*i].0;
        (
            std::cmp::Reverse(v.job.spec.priority),
            v.started_ms,
            job_seq(&v.job.id),
        )
    });
    for i in order {
        let without = chosen
            .iter()
            .filter(|j| **j != i)
            .fold(Amount::default(), |acc, j| acc.add(&local[*j].1));
        if deficit.covered_by(&without) {
            chosen.retain(|j| *j != i);
        }
    }
    let freed_gpus: i64 = chosen
        .iter()
        .map(|i| i64::from(local[*i].0.gpus_total))
        .sum();
    let ids: BTreeSet<usize> = chosen.iter().copied().collect();
    let victims = ids.iter().map(|i| local[*i].0.job.id.clone()).collect();
    Some((victims, freed_gpus - deficit.gpus))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::{place, place_in, Available};
    use crate::state::{Command, Launch, Outcome};
    use gpuctl_core::types::{JobSpec, StatusUpdate, TaskState};

    /// A state driven through commands, as the leader would.
    struct H {
        s: State,
        i: u64,
    }

    impl H {
        fn new(agents: &[(&str, u32)]) -> H {
            let mut h = H {
                s: State::new(),
                i: 0,
            };
            for (id, gpus) in agents {
                h.apply(crate::state::testkit::register(id, *gpus));
            }
            h
        }

        fn apply(&mut self, c: Command) -> Outcome {
            self.i += 1;
            match self.s.apply(self.i, &c) {
                Ok(o) => o,
                Err(e) => panic!("{c:?}: {e}"),
            }
        }

        fn submit(&mut self, gpus: u32, priority: i32, replicas: u32) -> String {
            self.submit_as("", gpus, priority, replicas)
        }

        /// Submits a job of `tenant` ("": the default tenant).
        fn submit_as(&mut self, tenant: &str, gpus: u32, priority: i32, replicas: u32) -> String {
            let mut spec = JobSpec::new(
                "j",
                vec!["sleep".into()],
                Resources {
                    cpus: 1.0,
                    mem_mib: 0,
                    gpus,
                    ports: 0,
                },
            );
            spec.priority = priority;
            spec.replicas = replicas;
            spec.tenant = tenant.into();
            let at_ms = self.i;
            match self.apply(Command::SubmitJob {
                spec,
                at_ms,
                request_id: None,
            }) {
                Outcome::JobSubmitted { job_id } => job_id,
                o => panic!("{o:?}"),
            }
        }

        /// Places what fits now, as the built-in scheduler would with
        /// everything offered; returns the jobs started.
        fn schedule(&mut self) -> Vec<String> {
            let launches = place(&self.s, &Default::default(), &Default::default());
            let mut started = Vec::new();
            let mut by_job: BTreeMap<String, Vec<Launch>> = BTreeMap::new();
            for l in launches {
                by_job.entry(l.job_id.clone()).or_default().push(l);
            }
            for (job, launches) in by_job {
                let at_ms = self.i * 10;
                self.apply(Command::LaunchTasks { launches, at_ms });
                started.push(job);
            }
            started
        }

        /// Submits a job and starts it (it must fit).
        fn running(&mut self, gpus: u32, priority: i32) -> String {
            let j = self.submit(gpus, priority, 1);
            assert_eq!(self.schedule(), vec![j.clone()]);
            j
        }

        fn plan(&self) -> QueuePlan {
            plan(&self.s, &QueueConfig::default())
        }

        fn victims(&self) -> Vec<String> {
            self.plan()
                .preemption
                .map(|p| p.victims)
                .unwrap_or_default()
        }

        fn agent_of(&self, job: &str) -> String {
            self.s.latest_task(job).unwrap().agent_id.clone()
        }

        /// The task's agent reports it ended in `state`.
        fn report(&mut self, task_id: &str, state: TaskState, exit_code: Option<i32>) {
            let agent_id = self.s.tasks()[task_id].agent_id.clone();
            self.apply(Command::UpdateTaskStatus {
                update: StatusUpdate {
                    gpu_memory_limit: false,
                    enforcement: None,
                    agent_id,
                    task_id: task_id.to_string(),
                    state,
                    exit_code,
                    message: String::new(),
                    uuid: Vec::new(),
                    gpu_unhealthy: false,
                    requires: Vec::new(),
                    fenced: false,
                    latest_state: None,
                },
                at_ms: 0,
            });
        }

        /// Applies the plan's preemption and has the agents report the
        /// victims' tasks killed.
        fn preempt_and_stop(&mut self) -> Vec<String> {
            let p = self.plan().preemption.expect("a preemption");
            let victims = p.victims.clone();
            self.apply(Command::PreemptJobs {
                job_id: p.job_id,
                victims: p.victims,
                at_ms: 0,
            });
            for v in &victims {
                for t in self.s.jobs()[v].current_tasks().to_vec() {
                    self.report(&t, TaskState::Killed, None);
                }
            }
            victims
        }
    }

    #[test]
    fn a_tenant_over_its_gpu_quota_waits_and_others_run() {
        let mut h = H::new(&[("a", 9)]);
        h.apply(Command::SetQuota {
            borrow: None,
            clear_borrow: false,
            weight: None,
            tenant: "vision".into(),
            gpus: 3,
        });
        let v1 = h.submit_as("vision", 2, 0, 1);
        let v2 = h.submit_as("vision", 2, 0, 1);
        let v3 = h.submit_as("vision", 1, 0, 1);
        let n1 = h.submit_as("nlp", 4, 0, 1);
        let mut started = h.schedule();
        started.sort();
        // 2 + 1 of vision's fit its 3; the second 2 would make 5.
        let mut want = vec![v1, v3, n1];
        want.sort();
        assert_eq!(started, want);
        assert_eq!(
            h.plan().reasons[&v2].reason,
            WaitReason::TenantQuota {
                tenant: "vision".into(),
                quota: 3,
                used: 3,
                asked: 2,
            }
        );
        // Raised: it runs.
        h.apply(Command::SetQuota {
            borrow: None,
            clear_borrow: false,
            weight: None,
            tenant: "vision".into(),
            gpus: 5,
        });
        assert_eq!(h.schedule(), vec![v2]);
    }

    /// A job that needs a newer driver than some agents have: placed only
    /// where it qualifies; waits, naming the newest driver, while none
    /// does; runs once an agent with a new enough driver joins.
    #[test]
    fn jobs_go_only_to_agents_whose_driver_qualifies() {
        use crate::state::testkit::register_with_driver;
        use gpuctl_core::cuda_req::Expr;
        use gpuctl_core::wait::{DriverAsk, Requirement};
        let mut h = H::new(&[]);
        h.apply(register_with_driver("old", 2, "470.57.02", "11.4"));
        let submit = |h: &mut H, require: &str| {
            let mut spec = JobSpec::new(
                "j",
                vec!["sleep".into()],
                Resources {
                    cpus: 1.0,
                    mem_mib: 0,
                    gpus: 1,
                    ports: 0,
                },
            );
            spec.require_cuda = Some(Expr::parse(require).unwrap());
            let at_ms = h.i;
            match h.apply(Command::SubmitJob {
                spec,
                at_ms,
                request_id: None,
            }) {
                Outcome::JobSubmitted { job_id } => job_id,
                o => panic!("{o:?}"),
            }
        };
        let j = submit(&mut h, "cuda>=12.2");
        let any = h.submit(1, 0, 1);
        // The job without requirements takes the old agent; the other waits.
        assert_eq!(h.schedule(), vec![any.clone()]);
        let newest = |driver: &str, cuda: &str| WaitReason::NeverFits {
            why: NeverFits::Missing {
                need: Requirement::Driver(DriverAsk {
                    requires: vec!["cuda>=12.2".into()],
                    newest_driver: Some(driver.into()),
                    newest_cuda: Some(cuda.into()),
                }),
                among: vec![],
                largest: None,
            },
            set_aside: SetAside::default(),
        };
        assert_eq!(h.plan().reasons[&j].reason, newest("470.57.02", "11.4"));
        h.apply(register_with_driver("mid", 1, "525.60.13", "12.0"));
        assert_eq!(h.plan().reasons[&j].reason, newest("525.60.13", "12.0"));
        assert!(h.schedule().is_empty());
        // A new enough agent joins: it runs there.
        h.apply(register_with_driver("new", 1, "535.129.03", "12.2"));
        assert_eq!(h.plan().reasons[&j].reason, WaitReason::Starting);
        assert_eq!(h.schedule(), vec![j.clone()]);
        assert_eq!(h.agent_of(&j), "new");
        // Another such job while that agent is busy waits for resources,
        // the others counted as left out for their driver.
        let j2 = submit(&mut h, "cuda>=12.2");
        match &h.plan().reasons[&j2].reason {
            WaitReason::Resources(c) => {
                assert_eq!((c.agents, c.filtered_driver, c.exhausted_gpus), (3, 2, 1))
            }
            other => panic!("{other:?}"),
        }
        assert!(h.schedule().is_empty(), "not on old or mid, which are free");
    }

    #[test]
    fn a_job_never_preempts_another_tenants() {
        let mut h = H::new(&[("a", 2)]);
        let theirs = h.submit_as("nlp", 2, 0, 1);
        assert_eq!(h.schedule(), vec![theirs.clone()]);
        let mine = h.submit_as("vision", 2, 100, 1);
        assert!(h.plan().preemption.is_none(), "preempted across tenants");
        assert_ne!(
            h.plan().reasons[&mine].reason,
            WaitReason::Preempting {
                reclaim_from: Vec::new(),
                waiting_for_tasks: 1
            }
        );
        // Within a tenant, priority preempts as before.
        let own_low = h.submit_as("nlp", 0, 0, 1);
        let _ = own_low;
        let hi = h.submit_as("nlp", 2, 100, 1);
        let p = h.plan().preemption.expect("preempts within its tenant");
        assert_eq!((p.job_id, p.victims), (hi, vec![theirs]));
    }

    #[test]
    fn the_lowest_priority_goes_first_even_when_a_higher_one_fits_better() {
        let mut h = H::new(&[("a", 4)]);
        let p1 = h.running(2, 1); // frees exactly 2
        let p0a = h.running(1, 0);
        let p0b = h.running(1, 0);
        let hi = h.submit(2, 5, 1);
        let mut v = h.victims();
        v.sort();
        assert_eq!(v, vec![p0a, p0b]);
        assert!(!v.contains(&p1));
        let r = &h.plan().reasons[&hi];
        assert_eq!(
            *r,
            Waiting {
                reason: WaitReason::Preempting {
                    reclaim_from: Vec::new(),
                    waiting_for_tasks: 2
                },
                requeued: None
            }
        );
    }

    #[test]
    fn among_equals_one_that_covers_alone_with_the_least_excess() {
        // 8 GPUs: 1, 1, 2 and 4 held at priority 0; a 2-GPU job needs 2.
        let mut h = H::new(&[("a", 8)]);
        let ones = [h.running(1, 0), h.running(1, 0)];
        let two = h.running(2, 0);
        let four = h.running(4, 0);
        h.submit(2, 1, 1);
        assert_eq!(h.victims(), vec![two.clone()], "not {ones:?} nor {four}");
        // Needing 3: nothing covers alone but the 4 (excess 1); with
        // priority first it takes the 4 rather than 2 + 1.
        let mut h = H::new(&[("a", 8)]);
        let _one = h.running(1, 0);
        let _one2 = h.running(1, 0);
        let _two = h.running(2, 0);
        let four = h.running(4, 0);
        h.submit(3, 1, 1);
        assert_eq!(h.victims(), vec![four]);
    }

    #[test]
    fn ties_go_to_the_most_recently_started() {
        let mut h = H::new(&[("a", 2)]);
        let _old = h.running(1, 0);
        let new = h.running(1, 0);
        h.submit(1, 3, 1);
        assert_eq!(h.victims(), vec![new]);
    }

    #[test]
    fn never_more_than_needed() {
        // The priority-0 1-GPU job comes first, but the priority-1 2-GPU
        // job alone covers the need: the first is dropped again.
        let mut h = H::new(&[("a", 3)]);
        let _low1 = h.running(1, 0);
        let mid2 = h.running(2, 1);
        h.submit(2, 5, 1);
        assert_eq!(h.victims(), vec![mid2]);
    }

    #[test]
    fn equal_or_higher_priority_is_never_preempted() {
        let mut h = H::new(&[("a", 2)]);
        h.running(2, 3);
        let eq = h.submit(1, 3, 1);
        let lower = h.submit(2, 0, 1);
        let p = h.plan();
        assert!(p.preemption.is_none());
        // The one agent could run them, but its GPUs are held.
        let busy = WaitReason::Resources(AgentCounts {
            agents: 1,
            exhausted_gpus: 1,
            ..Default::default()
        });
        assert_eq!(p.reasons[&eq].reason, busy, "{:?}", p.reasons);
        assert_eq!(p.reasons[&lower].reason, busy);
    }

    #[test]
    fn the_agent_with_the_cheapest_victims_is_chosen() {
        let mut h = H::new(&[("a", 2), ("b", 2)]);
        let on_a = h.running(2, 2);
        let on_b = h.running(2, 1);
        assert_ne!(h.agent_of(&on_a), h.agent_of(&on_b));
        h.submit(2, 5, 1);
        assert_eq!(h.victims(), vec![on_b]);
    }

    #[test]
    fn preempted_resources_are_kept_for_the_preemptor() {
        let mut h = H::new(&[("a", 4)]);
        let low = h.running(4, 0);
        let hi = h.submit(2, 5, 1);
        let p = h.plan().preemption.unwrap();
        assert_eq!(p.victims, vec![low.clone()]);
        h.apply(Command::PreemptJobs {
            job_id: p.job_id,
            victims: p.victims,
            at_ms: 0,
        });
        // While the victim stops: no second preemption, the preemptor
        // says why it waits, and the requeued victim cannot take the agent.
        let small = h.submit(1, 0, 1);
        let plan = h.plan();
        assert!(plan.preemption.is_none());
        assert_eq!(
            plan.reasons[&hi].reason,
            WaitReason::Preempting {
                reclaim_from: Vec::new(),
                waiting_for_tasks: 1
            }
        );
        h.report(&format!("{low}.0"), TaskState::Killed, None);
        // The victim, back in the queue, says by whom; the preemptor is
        // ahead of it on what is free.
        assert_eq!(
            h.plan().reasons[&low],
            Waiting {
                reason: WaitReason::Priority {
                    blocked_by: Some(hi.clone()),
                    kept_for_preemption: false
                },
                requeued: Some(Requeued {
                    preempted_by: Some(hi.clone()),
                    retries: 0,
                    max_retries: 0,
                    after: None
                })
            }
        );
        // Now the GPUs are free: the preemptor first, then what fits behind.
        let mut started = h.schedule();
        started.sort();
        assert_eq!(started, vec![hi.clone(), small.clone()]);
        assert_eq!(h.s.jobs()[&low].state, JobState::Queued);
    }

    #[test]
    fn reserved_agents_are_not_backfilled_by_lower_priority() {
        let mut h = H::new(&[("a", 4)]);
        let a = h.running(2, 0);
        let _b = h.running(2, 0);
        // Frees 2 of 4 now... the preemptor needs all 4.
        let hi = h.submit(4, 5, 1);
        let victims = h.victims();
        assert_eq!(victims.len(), 2);
        let p = h.plan().preemption.unwrap();
        h.apply(Command::PreemptJobs {
            job_id: hi.clone(),
            victims: p.victims,
            at_ms: 0,
        });
        // One victim stops; its 2 GPUs are free but kept for the preemptor.
        h.report(&format!("{a}.0"), TaskState::Killed, None);
        let filler = h.submit(2, 0, 1);
        assert!(
            h.schedule().is_empty(),
            "nothing placed on the reserved agent"
        );
        assert_eq!(
            h.plan().reasons[&filler].reason,
            WaitReason::Priority {
                blocked_by: Some(hi.clone()),
                kept_for_preemption: true
            }
        );
        // A job of higher priority than the preemptor may use it.
        let urgent = h.submit(2, 9, 1);
        assert_eq!(h.schedule(), vec![urgent]);
    }

    #[test]
    fn a_gang_preempts_all_it_needs_or_nothing() {
        let mut h = H::new(&[("a", 2), ("b", 2)]);
        let on_a = h.running(2, 0);
        let on_b = h.running(2, 0);
        h.submit(2, 5, 2);
        let mut v = h.victims();
        v.sort();
        assert_eq!(v, vec![on_a, on_b]);
        // With one agent held by a job of higher priority: no preemption at all.
        let mut h = H::new(&[("a", 2), ("b", 2)]);
        let _low = h.running(2, 0);
        let _high = h.running(2, 9);
        let g = h.submit(2, 5, 2);
        let p = h.plan();
        assert!(p.preemption.is_none());
        assert_eq!(
            p.reasons[&g].reason,
            WaitReason::Resources(AgentCounts {
                agents: 2,
                exhausted_gpus: 2,
                ..Default::default()
            })
        );
    }

    #[test]
    fn preempting_a_gang_frees_all_its_ranks() {
        let mut h = H::new(&[("a", 2), ("b", 2)]);
        let gang = h.submit(2, 0, 2);
        assert_eq!(h.schedule(), vec![gang.clone()]);
        let hi = h.submit(2, 1, 1);
        assert_eq!(h.preempt_and_stop(), vec![gang.clone()]);
        assert_eq!(h.s.jobs()[&gang].state, JobState::Queued);
        assert!(h.s.gpu_owners().is_empty());
        assert_eq!(h.schedule(), vec![hi]);
        // The gang cannot run on what is left (one agent of 2): it waits.
        assert!(h.schedule().is_empty());
    }

    #[test]
    fn a_gang_never_starts_partly() {
        let mut h = H::new(&[("a", 2), ("b", 2)]);
        let _filler = h.running(1, 0);
        let g = h.submit(2, 0, 2);
        assert!(h.schedule().is_empty());
        assert!(h.s.jobs()[&g].task_ids.is_empty());
        // One agent has room for one replica, not two.
        assert_eq!(
            h.plan().reasons[&g].reason,
            WaitReason::Resources(AgentCounts {
                agents: 2,
                exhausted_gpus: 1,
                fit_one: 1,
                ..Default::default()
            })
        );
        // One that could never fit says so.
        let big = h.submit(2, 0, 3);
        assert_eq!(
            h.plan().reasons[&big].reason,
            WaitReason::NeverFits {
                why: NeverFits::Gang {
                    replicas: 3,
                    gpus: 2
                },
                set_aside: SetAside::default()
            }
        );
    }

    #[test]
    fn higher_priority_is_placed_first() {
        let mut h = H::new(&[("a", 2)]);
        let low = h.submit(2, 0, 1);
        let high = h.submit(2, 1, 1);
        assert_eq!(h.schedule(), vec![high]);
        assert_eq!(h.s.jobs()[&low].state, JobState::Queued);
        // Offers name only some agents: place_in keeps to them.
        let none: BTreeMap<String, Available> = BTreeMap::new();
        assert!(place_in(&h.s, &none, PlacementPolicy::Bundle, false).is_empty());
    }

    #[test]
    fn quota_of_the_jobs_role_is_a_reason_and_blocks_preemption() {
        let mut h = H::new(&[("a", 4)]);
        let _low = h.running(2, 0);
        let hi = h.submit(2, 5, 1);
        let cfg = QueueConfig {
            jobs_quota: Some(Resources {
                cpus: f64::MAX,
                mem_mib: u64::MAX,
                gpus: 3,
                ports: 0,
            }),
            ..Default::default()
        };
        let p = plan(&h.s, &cfg);
        assert!(p.preemption.is_none());
        let res = |gpus| Resources {
            cpus: 1.0,
            mem_mib: 0,
            gpus,
            ports: 0,
        };
        assert_eq!(
            p.reasons[&hi].reason,
            WaitReason::Quota {
                used: res(2),
                asked: res(2),
                limit: cfg.jobs_quota.unwrap(),
                over: vec![Dimension::Gpus]
            }
        );
    }

    #[test]
    fn retried_jobs_say_so_and_keep_their_place() {
        let mut h = H::new(&[("a", 1)]);
        let mut spec = JobSpec::new("j", vec!["x".into()], Resources::default());
        spec.resources.gpus = 1;
        spec.max_retries = 2;
        let j = match h.apply(Command::SubmitJob {
            spec,
            at_ms: 0,
            request_id: None,
        }) {
            Outcome::JobSubmitted { job_id } => job_id,
            o => panic!("{o:?}"),
        };
        assert_eq!(h.schedule(), vec![j.clone()]);
        let later = h.submit(1, 0, 1);
        h.report(&format!("{j}.0"), TaskState::Failed, Some(2));
        let plan = h.plan();
        assert_eq!(
            plan.reasons[&j],
            Waiting {
                reason: WaitReason::Starting,
                requeued: Some(Requeued {
                    preempted_by: None,
                    retries: 1,
                    max_retries: 2,
                    after: Some(format!("task {j}.0 exited with code 2"))
                })
            }
        );
        assert_eq!(
            plan.reasons[&later],
            Waiting {
                reason: WaitReason::Priority {
                    blocked_by: Some(j.clone()),
                    kept_for_preemption: false
                },
                requeued: None
            }
        );
        assert_eq!(
            h.schedule(),
            vec![j.clone()],
            "submitted first, placed first"
        );
        assert_eq!(h.s.jobs()[&j].retries, 1);
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// Agents' GPU counts, running jobs (GPUs, priority) placed in
        /// order, and the job that arrives (GPUs, priority, replicas).
        type Scenario = (Vec<u32>, Vec<(u32, i32)>, (u32, i32, u32));

        fn scenario() -> impl Strategy<Value = Scenario> {
            (
                prop::collection::vec(1u32..=8, 1..=4),
                prop::collection::vec((1u32..=4, 0i32..4), 0..12),
                (1u32..=8, 0i32..5, 1u32..=3),
            )
        }

        fn build(agents: &[u32], running: &[(u32, i32)]) -> H {
            let names: Vec<String> = (0..agents.len()).map(|i| format!("n{i}")).collect();
            let list: Vec<(&str, u32)> = names
                .iter()
                .map(String::as_str)
                .zip(agents.iter().copied())
                .collect();
            let mut h = H::new(&list);
            for (gpus, prio) in running {
                let j = h.submit(*gpus, *prio, 1);
                h.schedule();
                if h.s.jobs()[&j].state == JobState::Queued {
                    h.apply(Command::CancelJob {
                        job_id: j,
                        at_ms: 0,
                    });
                }
            }
            h
        }

        /// Preempts `victims` for `job` (stopping their tasks) and says
        /// whether the job then starts.
        fn starts_after(h: &H, job: &str, victims: &[String]) -> bool {
            let mut h = H {
                s: h.s.clone(),
                i: h.i,
            };
            if !victims.is_empty() {
                h.apply(Command::PreemptJobs {
                    job_id: job.to_string(),
                    victims: victims.to_vec(),
                    at_ms: 0,
                });
                for v in victims {
                    for t in h.s.jobs()[v].current_tasks().to_vec() {
                        h.report(&t, TaskState::Killed, None);
                    }
                }
            }
            h.schedule().iter().any(|j| j == job)
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

            /// Victims are of lower priority, enough, and (for one task) no
            /// more than needed; and when no preemption is planned, even
            /// preempting every lower-priority job would not help.
            #[test]
            fn preemption_is_sufficient_minimal_and_complete((agents, running, (gpus, prio, replicas)) in scenario()) {
                let mut h = build(&agents, &running);
                let job = h.submit(gpus, prio, replicas);
                if h.clone_fits(&job) {
                    return Ok(());
                }
                let all_lower: Vec<String> = h
                    .s
                    .jobs()
                    .values()
                    .filter(|v| h.s.preemptible(prio, &v.id).is_ok())
                    .map(|v| v.id.clone())
                    .collect();
                match h.plan().preemption {
                    Some(p) => {
                        prop_assert_eq!(&p.job_id, &job);
                        for v in &p.victims {
                            prop_assert!(h.s.jobs()[v].spec.priority < prio);
                        }
                        prop_assert!(starts_after(&h, &job, &p.victims), "victims {:?} not enough", p.victims);
                        if replicas == 1 {
                            for v in &p.victims {
                                let fewer: Vec<String> = p.victims.iter().filter(|x| *x != v).cloned().collect();
                                prop_assert!(!starts_after(&h, &job, &fewer), "{v} was not needed in {:?}", p.victims);
                            }
                        }
                    }
                    None => {
                        if replicas == 1 {
                            prop_assert!(!starts_after(&h, &job, &all_lower), "a preemption was possible");
                        }
                    }
                }
            }
        }

        impl H {
            /// Whether the job would start without preempting.
            fn clone_fits(&mut self, job: &str) -> bool {
                starts_after(self, job, &[])
            }
        }
    }
}
