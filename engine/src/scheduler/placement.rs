//! GPU-aware placement: which node and which GPUs for a task or a gang.
//! PURE and deterministic: the same views give the same answer.
//!
//! Rules:
//! - A node qualifies when it runs the task's runtime, allows what its
//!   security asks (root host-process tasks, each host mount), every constraint
//!   `KEY=GLOB` matches its attribute `KEY` (case-insensitive glob on the
//!   value), its driver meets what the job requires of it (`require_cuda`
//!   and the image's NVIDIA_REQUIRE_*, parsed once per job; see
//!   `gpuctl_core::cuda_req`), `free.fits(resources)`, and enough of its `free_gpus` are
//!   healthy and match: model glob (`*`, `?`, case-insensitive) and
//!   `memory_mib >= gpu_mem_min_mib`. All GPUs of one task are on one node;
//!   model and memory only apply to tasks that take GPUs.
//! - **Bundle** (default, best fit). GPU tasks: the node left with the
//!   fewest free matching GPUs; ties: more GPUs in use (`all_gpus` not in
//!   `free_gpus`), then node id. Small tasks fill partly used nodes and whole
//!   nodes stay free for big tasks. Tasks without GPUs: the node with the
//!   fewest free GPUs (none is best: GPU nodes stay free for GPU work), then
//!   the least free CPU, then memory, left over, then id.
//! - **Spread** (worst fit). GPU tasks: the most free matching GPUs; ties:
//!   fewest GPUs in use, then id. Tasks without GPUs: the most free CPU, then
//!   memory, then id. In a gang, spread first prefers nodes holding fewer of
//!   the gang's replicas.
//! - Inside the node, GPUs are chosen by topology ([`choose_gpus`], see
//!   [`super::topology`]).
//! - A gang ([`place_gang`]) is placed replica by replica on a running
//!   account of what the earlier replicas took (several may share a node);
//!   all or nothing. Replicas are identical, so placing one on any node that
//!   fits lowers the number that node can still take by exactly one: the
//!   greedy order never fails when some assignment exists.
//!
//! Bundle vs spread: "bundle is never worse than spread at fitting the
//! largest job" is false in general (see `bundle_vs_spread_counterexamples`):
//! spread may skip a task bundle places and keep more free (4+4, tasks 1, 1,
//! 4); with sizes 1, 2, 2, 4 on 8+8, bundle ends 3+4 and spread 5+2 (a
//! 5-GPU task fits only under spread); with a GPU down (3+2, tasks 1, 2)
//! bundle ends 1+1 and spread 2+0. It holds when (1) tasks take only GPUs
//! and any free GPU serves them, (2) task sizes form a divisibility chain
//! (1, 2, 4, 8) and every node starts with a multiple of the largest size
//! usable, (3) both policies have placed the same tasks so far (bundle never
//! skips first), and "fitting" counts tasks of the chain: for every chain
//! size s, bundle has room for at least as many more s-GPU tasks as spread.
//! Why: under (1) and (2) bundle keeps that room at `F / s` (F = free GPUs
//! in all), the most any placement can leave (the free counts' binary digits
//! below the largest size never collide), and spread has the same F under
//! (3). Checked by a property test, and over every stream on every cluster
//! of up to 3 nodes of 8 or 16 GPUs (`bundle_room_exhaustive_small_clusters`).

use std::collections::BTreeMap;

use gpuctl_core::cuda_req::{Expr, Facts, Version};
use gpuctl_core::types::{
    path_within, GpuFraction, GpuInfo, HostMount, IdRanges, MigDevice, PlacementPolicy, Resources,
    Runtime, UserIds, Wants,
};

pub use super::topology::choose_gpus;
use gpuctl_core::wait::{AgentCounts, DriverAsk, GpuAsk, NeverFits, Requirement};

use crate::state::AvoidGpu;

/// What one task needs.
#[derive(Debug, Clone, Copy)]
pub struct TaskRequest<'a> {
    /// `gpus` = GPUs per task.
    pub resources: Resources,
    pub runtime: Runtime,
    /// Glob on [`GpuInfo::model`]: `*` any run, `?` one char, case-insensitive.
    pub gpu_model: Option<&'a str>,
    /// 0: no minimum; each chosen GPU has `memory_mib >=` it.
    pub gpu_mem_min_mib: u64,
    /// Whole GPUs, MIG devices of a profile (their memory is the one
    /// `gpu_mem_min_mib` applies to; `gpu_model` is their parent's), or a
    /// fraction of one shared GPU (`resources.gpus` is then 0).
    pub wants: Wants<'a>,
    /// Agent attribute `KEY=VALUE`, the value may be a glob; all must match.
    pub constraints: &'a BTreeMap<String, String>,
    /// A host-process task that runs as root: only on agents that allow it.
    pub run_as_root: bool,
    /// The user the job names (`security.user`): only on agents that let
    /// jobs choose it (their `allowed_users`).
    pub user: Option<UserIds>,
    /// Host mounts: each under one of the agent's allowed mounts.
    pub mounts: &'a [HostMount],
    /// The job's checkpoint directory: under one of the agent's allowed
    /// mounts too (the agent creates and mounts it).
    pub checkpoint_dir: Option<&'a str>,
    /// The job's `require_cuda`: the node's driver must meet it.
    pub require_cuda: Option<&'a Expr>,
    /// What the job's image requires of the driver (learned): all must hold.
    pub image_requires: &'a [Expr],
    /// GPUs that failed under the job: not chosen while their entry holds
    /// at `now_ms` (they still count for "could it ever fit").
    pub avoid: &'a [AvoidGpu],
    /// The leader's clock (ms), for `avoid`.
    pub now_ms: u64,
}

impl TaskRequest<'_> {
    /// GPUs or MIG devices the task needs on one node; a fraction needs
    /// one shared GPU.
    pub fn devices_needed(&self) -> usize {
        self.wants.devices(self.resources.gpus)
    }

    /// Everything it requires of the driver.
    fn driver_requires(&self) -> impl Iterator<Item = &Expr> {
        self.require_cuda.into_iter().chain(self.image_requires)
    }

    fn asks_driver(&self) -> bool {
        self.require_cuda.is_some() || !self.image_requires.is_empty()
    }
}

/// A node's NVIDIA driver: its versions as the agent reported them, and
/// parsed once per view (unknown when absent or unparsable).
#[derive(Debug, Clone, Default)]
pub struct NodeDriver<'a> {
    pub version: Option<&'a str>,
    pub cuda: Option<&'a str>,
    pub facts: Facts,
}

impl<'a> NodeDriver<'a> {
    pub fn new(version: Option<&'a str>, cuda: Option<&'a str>) -> Self {
        NodeDriver {
            version,
            cuda,
            facts: Facts::reported(version, cuda),
        }
    }
}

/// One agent as the placer sees it.
#[derive(Debug, Clone)]
pub struct NodeView<'a> {
    pub id: &'a str,
    pub attributes: &'a BTreeMap<String, String>,
    pub runtimes: &'a [Runtime],
    /// It runs host-process tasks as root for jobs that ask.
    pub allow_root_tasks: bool,
    /// Host path prefixes its containers may mount.
    pub allowed_mounts: &'a [String],
    /// The ids a job may name there; `None`: the agent did not say (any).
    pub allowed_users: Option<&'a IdRanges>,
    /// Free cpus, memory and GPU count.
    pub free: Resources,
    /// GPUs usable now (healthy, not held, not offered to frameworks).
    pub free_gpus: Vec<&'a GpuInfo>,
    /// Every GPU of the node (scoring, topology, "could it ever fit").
    pub all_gpus: &'a [GpuInfo],
    /// MIG devices usable now, with their parents (GPUs in MIG mode are
    /// never in `free_gpus`).
    pub free_mig: Vec<(&'a GpuInfo, &'a MigDevice)>,
    /// Shared GPUs fractions may take now, with the memory (MiB) and
    /// compute (percent) their fractions leave (never in `free_gpus`).
    pub free_shared: Vec<(&'a GpuInfo, u64, u32)>,
    pub driver: NodeDriver<'a>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub node: String,
    /// UUIDs, in index order.
    pub gpus: Vec<String>,
}

/// A node that can take at least one replica, and what the gang has taken
/// from it so far.
struct Cand<'v, 'a> {
    node: &'v NodeView<'a>,
    /// Free matching (healthy) GPUs before the gang.
    matching: usize,
    /// GPUs not free before the gang.
    in_use: usize,
    /// What the gang's replicas took here.
    used: Resources,
    taken: Vec<String>,
    replicas: u32,
}

impl Cand<'_, '_> {
    fn free(&self) -> Resources {
        self.node.free.saturating_sub(&self.used)
    }

    /// Room for one more replica needing `need` and `n` GPU units.
    fn fits(&self, need: &Resources, n: usize) -> bool {
        self.free().fits(need) && self.matching >= self.taken.len() + n
    }
}

/// `Less` when `a` is the better node for one more replica.
fn compare(
    policy: PlacementPolicy,
    need: &Resources,
    n: usize,
    a: &Cand,
    b: &Cand,
) -> std::cmp::Ordering {
    let (fa, fb) = (a.free(), b.free());
    let left_a = a.matching.saturating_sub(a.taken.len() + n);
    let left_b = b.matching.saturating_sub(b.taken.len() + n);
    let in_use_a = a.in_use + a.taken.len();
    let in_use_b = b.in_use + b.taken.len();
    let cpus_a = fa.cpus - need.cpus;
    let cpus_b = fb.cpus - need.cpus;
    let mem_a = fa.mem_mib.saturating_sub(need.mem_mib);
    let mem_b = fb.mem_mib.saturating_sub(need.mem_mib);
    let by_id = || a.node.id.cmp(b.node.id);
    match (policy, n > 0) {
        (PlacementPolicy::Bundle, true) => left_a
            .cmp(&left_b)
            .then(in_use_b.cmp(&in_use_a))
            .then_with(by_id),
        (PlacementPolicy::Bundle, false) => {
            // The gang took no GPUs here: free_gpus is still exact.
            let gpus_a = a.node.free_gpus.len();
            let gpus_b = b.node.free_gpus.len();
            gpus_a
                .cmp(&gpus_b)
                .then(cpus_a.total_cmp(&cpus_b))
                .then(mem_a.cmp(&mem_b))
                .then_with(by_id)
        }
        (PlacementPolicy::Spread, true) => a
            .replicas
            .cmp(&b.replicas)
            .then(left_b.cmp(&left_a))
            .then(in_use_a.cmp(&in_use_b))
            .then_with(by_id),
        (PlacementPolicy::Spread, false) => a
            .replicas
            .cmp(&b.replicas)
            .then(cpus_b.total_cmp(&cpus_a))
            .then(mem_b.cmp(&mem_a))
            .then_with(by_id),
    }
}

/// Best node and GPUs for one task, or `None`. Deterministic.
pub fn place_task(
    req: &TaskRequest,
    nodes: &[NodeView],
    policy: PlacementPolicy,
) -> Option<Placement> {
    place_gang(req, 1, nodes, policy)?.pop()
}

/// An elastic gang: the most ranks in `min..=max` that [`place_gang`]
/// places (none if `min` does not fit). Fit is taken as monotone in the
/// size (any fit's first ranks are a fit of fewer), so the size is found
/// by bisection: O(log(max - min)) tries.
pub fn place_upto<'v, 'a>(
    req: &TaskRequest,
    min: u32,
    max: u32,
    nodes: &'v [NodeView<'a>],
    policy: PlacementPolicy,
) -> Option<Vec<Placement>> {
    if max <= min {
        return place_gang(req, min, nodes, policy);
    }
    if let Some(all) = place_gang(req, max, nodes, policy) {
        return Some(all);
    }
    let mut best = place_gang(req, min, nodes, policy)?;
    // `best` fits `lo` ranks; `hi` ranks do not.
    let (mut lo, mut hi) = (min, max);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match place_gang(req, mid, nodes, policy) {
            Some(p) => {
                best = p;
                lo = mid;
            }
            None => hi = mid,
        }
    }
    Some(best)
}

/// `replicas` tasks of a gang, all or nothing: distinct GPUs, each node's
/// free resources accounted across replicas (several replicas may share a
/// node if it fits; spread prefers distinct nodes). `Some(vec![])` for 0
/// replicas.
pub fn place_gang<'v, 'a>(
    req: &TaskRequest,
    replicas: u32,
    nodes: &'v [NodeView<'a>],
    policy: PlacementPolicy,
) -> Option<Vec<Placement>> {
    let need = req.resources;
    // A fraction counts as one unit of what the node's shared GPUs hold.
    let n = req.devices_needed();
    let mut filter = GpuFilter::new(req);
    let mut cand = |node: &'v NodeView<'a>| {
        // Scalars first: they need no look at the GPUs themselves.
        if !(node.free.fits(&need) && static_ok(req, node)) {
            return None;
        }
        let matching = if n == 0 { 0 } else { filter.count_free(node) };
        let c = Cand {
            node,
            matching,
            in_use: node.all_gpus.len().saturating_sub(node.free_gpus.len()),
            used: Resources::default(),
            taken: Vec::new(),
            replicas: 0,
        };
        c.fits(&need, n).then_some(c)
    };
    // One task (most jobs): the best node in one pass, without keeping
    // every candidate (the queue pass calls this for every queued job).
    let mut cands: Vec<Cand> = if replicas == 1 {
        let best = nodes
            .iter()
            .filter_map(&mut cand)
            .min_by(|a, b| compare(policy, &need, n, a, b));
        best.into_iter().collect()
    } else {
        nodes.iter().filter_map(&mut cand).collect()
    };
    let mut out = Vec::with_capacity(replicas as usize);
    for _ in 0..replicas {
        let best = cands
            .iter_mut()
            .filter(|c| c.fits(&need, n))
            .min_by(|a, b| compare(policy, &need, n, a, b))?;
        let gpus = match req.wants {
            Wants::Fraction(f) => vec![choose_share(
                best.node,
                &best.taken,
                &mut filter,
                f,
                policy,
            )?],
            _ if n == 0 => Vec::new(),
            Wants::Mig(_) => choose_mig(best.node, &best.taken, &mut filter, policy, n)?,
            Wants::Whole => {
                let free: Vec<&GpuInfo> = best
                    .node
                    .free_gpus
                    .iter()
                    .copied()
                    .filter(|g| {
                        g.healthy
                            && !best.taken.contains(&g.uuid)
                            && filter.allowed(&g.uuid)
                            && filter.matches(g)
                    })
                    .collect();
                choose_gpus(&free, best.node.all_gpus, n)?
            }
        };
        best.used = best.used.add(&need);
        best.taken.extend(gpus.iter().cloned());
        best.replicas += 1;
        out.push(Placement {
            node: best.node.id.to_string(),
            gpus,
        });
    }
    Some(out)
}

/// How many fractions `f` fit in `mem` MiB and `pct` percent of compute.
fn fractions_in(mem: u64, pct: u32, f: GpuFraction) -> usize {
    let by_mem = mem.checked_div(f.mem_mib).unwrap_or(0);
    // No compute asked: compute does not bound it.
    let by_pct = pct.checked_div(f.compute_pct).map_or(u64::MAX, u64::from);
    usize::try_from(by_mem.min(by_pct)).unwrap_or(usize::MAX)
}

/// The shared GPU of the node for one more fraction `f`, after `taken`
/// (the uuids earlier replicas of the gang took, one per fraction):
/// bundle takes the one it fills best (least memory left), spread the
/// emptiest; then by index.
fn choose_share(
    node: &NodeView,
    taken: &[String],
    filter: &mut GpuFilter,
    f: GpuFraction,
    policy: PlacementPolicy,
) -> Option<String> {
    node.free_shared
        .iter()
        .filter(|(g, _, _)| filter.allowed(&g.uuid) && filter.matches(g))
        .filter_map(|(g, m, c)| {
            let n = taken.iter().filter(|t| **t == g.uuid).count() as u64;
            let m = m.saturating_sub(f.mem_mib.saturating_mul(n));
            let c = c.saturating_sub(f.compute_pct.saturating_mul(n as u32));
            (fractions_in(m, c, f) >= 1).then_some((g, m))
        })
        .min_by_key(|(g, m)| match policy {
            PlacementPolicy::Bundle => (*m, g.index),
            PlacementPolicy::Spread => (u64::MAX - *m, g.index),
        })
        .map(|(g, _)| g.uuid.clone())
}

/// `n` free MIG devices of the node that `filter` takes and `taken` does
/// not hold. Bundle packs: the devices of the parent with the fewest free
/// ones left first, so that whole GPUs stay free to be split another way;
/// spread takes the parent with the most free ones first. Then by parent
/// index and GPU instance. `None` when fewer than `n` qualify.
fn choose_mig(
    node: &NodeView,
    taken: &[String],
    filter: &mut GpuFilter,
    policy: PlacementPolicy,
    n: usize,
) -> Option<Vec<String>> {
    let free_on = |parent: &str| {
        node.free_mig
            .iter()
            .filter(|(g, d)| g.uuid == parent && !taken.contains(&d.uuid))
            .count()
    };
    let mut cands: Vec<(usize, u32, u32, &str)> = node
        .free_mig
        .iter()
        .filter(|(g, d)| {
            g.healthy
                && !taken.contains(&d.uuid)
                && filter.allowed(&g.uuid)
                && filter.allowed(&d.uuid)
                && filter.matches_mig(g, d)
        })
        .map(|(g, d)| {
            let free = free_on(&g.uuid);
            let key = match policy {
                PlacementPolicy::Bundle => free,
                PlacementPolicy::Spread => usize::MAX - free,
            };
            (key, g.index, d.gi_id, d.uuid.as_str())
        })
        .collect();
    if cands.len() < n {
        return None;
    }
    cands.sort();
    Some(cands[..n].iter().map(|c| c.3.to_string()).collect())
}

mod filters;
mod why;

pub use filters::*;
pub use why::*;

#[cfg(test)]
mod tests;
