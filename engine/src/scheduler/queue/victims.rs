//! Who may be stopped for a job that waits: preemption by priority within
//! a tenant and reclaim across tenants, the fewest and least costly
//! victims that make the room, node by node.

use super::*;

/// A job that may be preempted, as the victim search sees it.
pub(super) struct Victim<'s> {
    job: &'s JobRecord,
    /// Every GPU it holds, on any agent.
    gpus_total: u32,
    /// What it counts against its tenant (quota units).
    units: u32,
    /// When its attempt started (its tasks' launch).
    started_ms: u64,
}

/// Which victims a job may have, and how they are chosen.
pub(super) enum Rule<'a> {
    /// Its own tenant's, of lower priority.
    Priority,
    /// Other tenants' over their fair share: at most `budget` units of
    /// each (what it holds beyond its share).
    Reclaim { budget: &'a BTreeMap<String, u32> },
}

/// What a victim frees on one agent, in the units of the deficit.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Amount {
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
pub(super) fn gpu_matches(req: &TaskRequest, d: Device<'_>) -> bool {
    let g = d.gpu();
    g.healthy
        && d.mig_profile() == req.wants.mig()
        && !(req.wants.mig().is_none() && g.mig.enabled)
        && d.memory_mib() >= req.gpu_mem_min_mib
        && req.gpu_model.is_none_or(|p| model_matches(p, &g.model))
}

/// How good an agent's victims are, lower first: their highest priority,
/// (for a reclaim) how recently the oldest of them started, the GPUs freed
/// beyond the need, how many, the agent's id.
pub(super) type NodeScore = (i32, std::cmp::Reverse<u64>, i64, usize, String);

/// Victims (jobs) and the placements of all of the
/// job's replicas once they are gone; `None` when preempting every job
/// it may preempt would still not make it fit.
pub(super) fn find_victims<'s>(
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
    let tenant = job.spec.tenant.name();
    let cands = victims_among(
        state,
        ctx.preemptible
            .iter()
            .copied()
            .filter(|v| v.spec.priority < priority && v.spec.tenant.name() == tenant),
    );
    choose_victims(ctx, sim, job, req, policy, cands, &Rule::Priority)
}

/// A reclaim for `job` (see the module's doc): victims of other tenants
/// over their fair share, when its tenant with the job (`units`) stays
/// within its own.
pub(super) fn find_reclaim<'s>(
    ctx: &PassCtx<'_, 's>,
    walk: &Walk<'s>,
    job: &JobRecord,
    req: &TaskRequest,
    policy: PlacementPolicy,
    units: u32,
) -> Option<(Vec<JobId>, Vec<Placement>)> {
    let shares = ctx.shares.as_ref()?;
    let min_runtime = ctx.cfg.reclaim_min_runtime_ms?;
    let tenant = job.spec.tenant.name();
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
            .filter(|v| budget.contains_key(v.spec.tenant.name())),
    )
    .into_iter()
    .filter(|v| {
        v.started_ms.saturating_add(min_runtime) <= ctx.cfg.now_ms
            && v.units <= budget[v.job.spec.tenant.name()]
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
pub(super) fn victims_among<'s>(
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
pub(super) fn choose_victims<'s>(
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
    // An elastic gang preempts for its fewest ranks only.
    for _ in 0..job.spec.min_replicas() {
        if let Some(p) = placement::place_task(req, &pool.views(&usable), policy) {
            pool.take(
                &p.node,
                &req.resources,
                Holding::of(&p.gpus, req.wants.fraction().as_ref()),
            );
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
                pool.give(&t.agent_id, &t.resources, t.holding());
            }
        }
        chosen.extend(set);
        let view = pool.node(&node)?.view();
        let p = placement::place_task(req, std::slice::from_ref(&view), policy)?;
        pool.take(
            &p.node,
            &req.resources,
            Holding::of(&p.gpus, req.wants.fraction().as_ref()),
        );
        placements.push(p);
    }
    if chosen.is_empty() {
        return None; // it fits without preempting
    }
    Some((chosen, placements))
}

/// Whether `victims` take no tenant below its fair share: at most its
/// budget of units from each.
pub(super) fn within_budget<'v>(
    budget: &BTreeMap<String, u32>,
    victims: impl Iterator<Item = &'v JobId>,
    cands: &[Victim],
) -> bool {
    let mut taken: BTreeMap<&str, u32> = BTreeMap::new();
    for id in victims {
        let Some(v) = cands.iter().find(|c| &c.job.id == id) else {
            continue;
        };
        *taken.entry(v.job.spec.tenant.name()).or_default() += v.units;
    }
    taken
        .iter()
        .all(|(t, n)| budget.get(*t).is_some_and(|b| n <= b))
}

/// The fewest victims on `node_id` that make one task fit there (see the
/// module's doc), and the GPUs they free beyond the need.
pub(super) fn victims_on_node(
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
