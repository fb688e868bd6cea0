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
    Runtime, UserIds,
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
    /// Each GPU is a MIG device of this profile (its memory is the one
    /// `gpu_mem_min_mib` applies to; `gpu_model` is its parent's).
    pub mig: Option<&'a str>,
    /// Each task takes this fraction of one shared GPU (`resources.gpus`
    /// is then 0).
    pub fraction: Option<GpuFraction>,
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

/// Case-insensitive glob: `*` matches any run (also empty), `?` one char.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    glob_chars(&lower(pattern), &lower(text))
}

fn lower(s: &str) -> Vec<char> {
    s.chars().flat_map(char::to_lowercase).collect()
}

fn glob_chars(p: &[char], t: &[char]) -> bool {
    let (mut pi, mut ti) = (0, 0);
    // Last '*' seen and the text position it is currently matched up to.
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        match p.get(pi) {
            Some('*') => {
                star = Some((pi, ti));
                pi += 1;
            }
            Some(&c) if c == '?' || c == t[ti] => {
                pi += 1;
                ti += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    pi = sp + 1;
                    ti = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// NVML names models with the vendor first ("NVIDIA A100-SXM4-40GB",
/// "Tesla V100-SXM2-16GB"); a pattern may leave it out ("A100*").
fn strip_vendor(model: &str) -> Option<&str> {
    ["NVIDIA ", "Tesla "]
        .iter()
        .find_map(|v| model.strip_prefix(v))
        .map(str::trim_start)
}

/// Whether a GPU model matches a `--gpu-model` pattern: the glob on the
/// whole model name, or on the name without the vendor word.
pub fn model_matches(pattern: &str, model: &str) -> bool {
    glob_match(pattern, model) || strip_vendor(model).is_some_and(|m| glob_match(pattern, m))
}

/// The task's per-GPU filter (model glob, memory), with the glob's answer
/// remembered per model string: a cluster has few models and many GPUs.
struct GpuFilter {
    model: Option<Vec<char>>,
    mem_min: u64,
    /// MIG devices of this profile rather than whole GPUs.
    mig: Option<String>,
    /// A fraction of a shared GPU rather than whole GPUs.
    fraction: Option<GpuFraction>,
    cache: Vec<(String, bool)>,
    /// GPUs (or MIG devices) the task may not be given now.
    avoid: Vec<String>,
}

impl GpuFilter {
    fn new(req: &TaskRequest) -> Self {
        GpuFilter {
            model: req.gpu_model.map(lower),
            mem_min: req.gpu_mem_min_mib,
            mig: req.mig.map(str::to_string),
            fraction: req.fraction,
            cache: Vec::new(),
            avoid: req
                .avoid
                .iter()
                .filter(|a| a.until_ms > req.now_ms)
                .map(|a| a.uuid.clone())
                .collect(),
        }
    }

    /// Not a GPU the job avoids now.
    fn allowed(&self, uuid: &str) -> bool {
        !self.avoid.iter().any(|a| a == uuid)
    }

    fn model_ok(&mut self, model: &str) -> bool {
        let Some(p) = &self.model else {
            return true;
        };
        if let Some((_, ok)) = self.cache.iter().find(|(m, _)| m == model) {
            return *ok;
        }
        let ok = glob_chars(p, &lower(model))
            || strip_vendor(model).is_some_and(|m| glob_chars(p, &lower(m)));
        if self.cache.len() < 64 {
            self.cache.push((model.to_string(), ok));
        }
        ok
    }

    /// Model and memory; health is the caller's business.
    fn matches(&mut self, g: &GpuInfo) -> bool {
        g.memory_mib >= self.mem_min && self.model_ok(&g.model)
    }

    /// A MIG device of the profile asked, with the memory, on a GPU of the
    /// model.
    fn matches_mig(&mut self, parent: &GpuInfo, d: &MigDevice) -> bool {
        self.mig.as_deref() == Some(d.profile.as_str())
            && d.memory_mib >= self.mem_min
            && self.model_ok(&parent.model)
    }

    /// How many devices of the node match, busy or not, healthy or not
    /// ("could it ever fit"): MIG devices of the profile, or GPUs.
    fn count_all(&mut self, node: &NodeView) -> usize {
        if let Some(f) = self.fraction {
            // The fractions its shared GPUs hold when none is held.
            return node
                .free_shared
                .iter()
                .filter(|(g, _, _)| self.matches(g))
                .map(|(g, _, _)| fractions_in(g.memory_mib, 100, f))
                .sum();
        }
        if self.mig.is_some() {
            gpuctl_core::types::mig_devices_of(node.all_gpus)
                .filter(|(g, d)| self.matches_mig(g, d))
                .count()
        } else {
            node.all_gpus.iter().filter(|g| self.matches(g)).count()
        }
    }

    /// How many matching devices of the node are free and healthy now
    /// (for a fraction: how many fractions its shared GPUs still hold).
    fn count_free(&mut self, node: &NodeView) -> usize {
        if let Some(f) = self.fraction {
            return node
                .free_shared
                .iter()
                .filter(|(g, _, _)| self.allowed(&g.uuid) && self.matches(g))
                .map(|(_, m, c)| fractions_in(*m, *c, f))
                .sum();
        }
        if self.mig.is_some() {
            node.free_mig
                .iter()
                .filter(|(g, d)| {
                    g.healthy
                        && self.allowed(&g.uuid)
                        && self.allowed(&d.uuid)
                        && self.matches_mig(g, d)
                })
                .count()
        } else {
            node.free_gpus
                .iter()
                .filter(|g| g.healthy && self.allowed(&g.uuid) && self.matches(g))
                .count()
        }
    }
}

/// Runtime, security, constraints and driver.
fn static_ok(req: &TaskRequest, node: &NodeView) -> bool {
    node.runtimes.contains(&req.runtime)
        && security_ok(req, node)
        && constraints_ok(req.constraints, node.attributes)
        && driver_ok(req, node)
}

/// The node's driver meets everything the job requires of it.
fn driver_ok(req: &TaskRequest, node: &NodeView) -> bool {
    req.driver_requires().all(|e| e.met_by(&node.driver.facts))
}

/// The agent allows what the task's security asks: root, its mounts.
/// Whether `node` lets a job name `user`: each of its ids (0 is asked for
/// with `run_as_root`, not here) within the node's `allowed_users`, as the
/// agent checks before it starts the task.
fn user_ok(user: UserIds, node: &NodeView) -> bool {
    node.allowed_users.is_none_or(|allowed| {
        [user.uid, user.gid]
            .iter()
            .all(|&id| id == 0 || allowed.contains(id))
    })
}

fn security_ok(req: &TaskRequest, node: &NodeView) -> bool {
    (!req.run_as_root || node.allow_root_tasks)
        && req.user.is_none_or(|u| user_ok(u, node))
        && req
            .mounts
            .iter()
            .all(|m| path_within(node.allowed_mounts, &m.host_path))
        && req
            .checkpoint_dir
            .is_none_or(|p| path_within(node.allowed_mounts, p))
}

fn constraints_ok(
    constraints: &BTreeMap<String, String>,
    attributes: &BTreeMap<String, String>,
) -> bool {
    constraints
        .iter()
        .all(|(k, pat)| attributes.get(k).is_some_and(|v| glob_match(pat, v)))
}

/// Whether a node satisfies the task's static requirements: runtime,
/// security, constraints, and enough GPUs of the model/memory among ALL its GPUs
/// (healthy or not, busy or not).
pub fn node_matches(req: &TaskRequest, node: &NodeView) -> bool {
    let n = if req.fraction.is_some() {
        1
    } else {
        req.resources.gpus as usize
    };
    let mut filter = GpuFilter::new(req);
    static_ok(req, node) && (n == 0 || filter.count_all(node) >= n)
}

/// Whether a GPU of this model and memory meets the task's model and
/// memory filters (a whole agent's, when all its GPUs are alike).
pub fn gpu_kind_matches(req: &TaskRequest, model: &str, memory_mib: u64) -> bool {
    let mut f = GpuFilter::new(req);
    memory_mib >= f.mem_min && f.model_ok(model)
}

/// Whether the node can take one task now: exactly the nodes
/// [`place_gang`] considers (resources, static requirements, enough free
/// matching devices).
pub fn takes_one(req: &TaskRequest, node: &NodeView) -> bool {
    let n = if req.fraction.is_some() {
        1
    } else {
        req.resources.gpus as usize
    };
    node.free.fits(&req.resources)
        && static_ok(req, node)
        && (n == 0 || GpuFilter::new(req).count_free(node) >= n)
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
    let n = if req.fraction.is_some() {
        1
    } else {
        need.gpus as usize
    };
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
        let gpus = if let Some(f) = req.fraction {
            vec![choose_share(
                best.node,
                &best.taken,
                &mut filter,
                f,
                policy,
            )?]
        } else if n == 0 {
            Vec::new()
        } else if req.mig.is_some() {
            choose_mig(best.node, &best.taken, &mut filter, policy, n)?
        } else {
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

/// One requirement of a task, checked on its own by [`unsatisfiable`].
enum Need<'r> {
    Runtime(Runtime),
    RootTasks,
    User(UserIds),
    Mount(&'r str),
    Attribute(&'r str, &'r str),
    /// A driver that meets what the job requires of it.
    Driver,
    /// Some GPU of the model (memory aside).
    Model,
    /// Some GPU of the model with the memory.
    Memory,
    /// `gpus` GPUs of the model with the memory.
    Count,
    Cpus,
    Mem,
    Ports,
}

impl Need<'_> {
    fn is_gpu(&self) -> bool {
        matches!(self, Need::Model | Need::Memory | Need::Count)
    }
}

/// Why no node could EVER run this task (ignoring current usage: every GPU
/// of the node, healthy or not, and its total capacity from `totals`).
/// `None` when some node could.
///
/// Requirements are checked in order: runtime, root tasks, the user, each mount, each
/// constraint, the driver, GPU model, GPU memory, GPU count, cpus, memory. The first that no remaining node
/// meets is named ("no agent runs docker", "no agent has GPU model H100*"),
/// with the most a node has of it ("no agent has 9 GPUs (at most 8)");
/// [`NeverFits::NoActiveAgent`] when there are no nodes. When some node
/// meets it alone but none together with the earlier requirements, those
/// are named too: "no agent has 8 GPUs among those that run docker and
/// have zone=us-east" (the words are the CLI's).
pub fn unsatisfiable(
    req: &TaskRequest,
    nodes: &[NodeView],
    totals: &dyn Fn(&str) -> Resources,
) -> Option<NeverFits> {
    if nodes.is_empty() {
        return Some(NeverFits::NoActiveAgent);
    }
    let need = req.resources;
    let n = if req.fraction.is_some() {
        1
    } else {
        need.gpus as usize
    };
    let model = req.gpu_model;
    let mem = req.gpu_mem_min_mib;
    let mut steps = vec![Need::Runtime(req.runtime)];
    if req.run_as_root {
        steps.push(Need::RootTasks);
    }
    steps.extend(req.user.map(Need::User));
    steps.extend(req.mounts.iter().map(|m| Need::Mount(m.host_path.as_str())));
    steps.extend(req.checkpoint_dir.map(Need::Mount));
    steps.extend(
        req.constraints
            .iter()
            .map(|(k, v)| Need::Attribute(k.as_str(), v.as_str())),
    );
    if req.asks_driver() {
        steps.push(Need::Driver);
    }
    if n > 0 {
        if model.is_some() {
            steps.push(Need::Model);
        }
        if mem > 0 {
            steps.push(Need::Memory);
        }
        steps.push(Need::Count);
    }
    steps.push(Need::Cpus);
    steps.push(Need::Mem);
    if need.ports > 0 {
        steps.push(Need::Ports);
    }

    let ask = || GpuAsk {
        count: need.gpus,
        model: model.map(String::from),
        mem_min_mib: mem,
        mig: req.mig.map(String::from),
        fraction: req.fraction.map(|f| (f.mem_mib, f.compute_pct)),
    };
    let requirement = |step: &Need| match step {
        Need::Runtime(rt) => Requirement::Runtime(*rt),
        Need::RootTasks => Requirement::RootTasks,
        Need::User(u) => Requirement::User(*u),
        Need::Mount(p) => Requirement::Mount(p.to_string()),
        Need::Attribute(k, v) => Requirement::Attribute {
            key: k.to_string(),
            pattern: v.to_string(),
        },
        Need::Model => Requirement::GpuModel(ask()),
        Need::Memory => Requirement::GpuMemory(ask()),
        Need::Count => Requirement::Gpus(ask()),
        Need::Cpus => Requirement::Cpus(need.cpus),
        Need::Mem => Requirement::Memory(need.mem_mib),
        Need::Ports => Requirement::Ports(need.ports),
        Need::Driver => Requirement::Driver(DriverAsk {
            requires: req
                .driver_requires()
                .map(|e| e.text().to_string())
                .collect(),
            newest_driver: None,
            newest_cuda: None,
        }),
    };

    let mut filter = GpuFilter::new(req);
    let mut model_only = GpuFilter::new(&TaskRequest {
        gpu_mem_min_mib: 0,
        ..*req
    });
    let mut meets = |step: &Need, node: &NodeView| -> bool {
        match step {
            Need::Runtime(rt) => node.runtimes.contains(rt),
            Need::RootTasks => node.allow_root_tasks,
            Need::User(u) => user_ok(*u, node),
            Need::Mount(p) => path_within(node.allowed_mounts, p),
            Need::Attribute(k, pat) => node.attributes.get(*k).is_some_and(|v| glob_match(pat, v)),
            Need::Driver => driver_ok(req, node),
            Need::Model => node.all_gpus.iter().any(|g| model_only.matches(g)),
            Need::Memory => filter.count_all(node) > 0,
            Need::Count => filter.count_all(node) >= n,
            Need::Cpus => need.cpus <= totals(node.id).cpus + 1e-9,
            Need::Mem => need.mem_mib <= totals(node.id).mem_mib,
            Need::Ports => need.ports <= totals(node.id).ports,
        }
    };

    let mut left: Vec<&NodeView> = nodes.iter().collect();
    // What narrowed `left`; the GPU steps once, as the whole GPU need.
    let mut among: Vec<Requirement> = Vec::new();
    for step in &steps {
        let before = left.len();
        let kept: Vec<&NodeView> = left.iter().copied().filter(|n| meets(step, n)).collect();
        if kept.is_empty() {
            let alone = nodes.iter().any(|node| meets(step, node));
            if step.is_gpu() {
                among.retain(|r| !matches!(r, Requirement::Gpus(_)));
            }
            // The most is of the agents the words are about.
            let (among, looked_at) = if alone && !among.is_empty() {
                (among, left)
            } else {
                (Vec::new(), nodes.iter().collect())
            };
            let need = match requirement(step) {
                Requirement::Driver(ask) => Requirement::Driver(DriverAsk {
                    newest_driver: newest(&looked_at, |d| d.version),
                    newest_cuda: newest(&looked_at, |d| d.cuda),
                    ..ask
                }),
                other => other,
            };
            return Some(NeverFits::Missing {
                need,
                among,
                largest: largest(req, step, &looked_at, totals),
            });
        }
        if kept.len() < before {
            let r = if step.is_gpu() {
                Requirement::Gpus(ask())
            } else {
                requirement(step)
            };
            if !among.contains(&r) {
                among.push(r);
            }
        }
        left = kept;
    }
    None
}

/// The newest version one of `nodes` reports (as it reports it), of its
/// driver or its CUDA: compared as versions, unparsable ones left out.
fn newest<'a>(
    nodes: &[&NodeView<'a>],
    of: impl Fn(&NodeDriver<'a>) -> Option<&'a str>,
) -> Option<String> {
    nodes
        .iter()
        .filter_map(|n| {
            let text = of(&n.driver)?;
            Some((Version::parse(text.trim())?, text))
        })
        .max_by_key(|(v, _)| *v)
        .map(|(_, text)| text.to_string())
}

/// The most one of `nodes` has of what `step` asks, in its unit.
fn largest(
    req: &TaskRequest,
    step: &Need,
    nodes: &[&NodeView],
    totals: &dyn Fn(&str) -> Resources,
) -> Option<f64> {
    let mut filter = GpuFilter::new(req);
    let mut model_only = GpuFilter::new(&TaskRequest {
        gpu_mem_min_mib: 0,
        ..*req
    });
    let mut of = |node: &NodeView| -> Option<f64> {
        match step {
            Need::Runtime(_)
            | Need::RootTasks
            | Need::User(_)
            | Need::Mount(_)
            | Need::Attribute(..)
            | Need::Driver
            | Need::Model => None,
            Need::Memory if req.mig.is_some() => gpuctl_core::types::mig_devices_of(node.all_gpus)
                .filter(|(g, d)| model_only.matches_mig(g, d))
                .map(|(_, d)| d.memory_mib)
                .max()
                .map(|m| m as f64),
            Need::Memory => node
                .all_gpus
                .iter()
                .filter(|g| model_only.matches(g))
                .map(|g| g.memory_mib)
                .max()
                .map(|m| m as f64),
            Need::Count => Some(filter.count_all(node) as f64),
            Need::Cpus => Some(totals(node.id).cpus),
            Need::Mem => Some(totals(node.id).mem_mib as f64),
            Need::Ports => Some(f64::from(totals(node.id).ports)),
        }
    };
    nodes.iter().filter_map(|n| of(n)).max_by(f64::total_cmp)
}

/// Why each node cannot take one task now, counted once per node for the
/// first thing it lacks: its runtime, security, constraints, driver, GPU model, GPU memory,
/// its size in all (`totals`), then free GPUs, cpus, memory (a job waiting
/// for resources says where they are short).
pub fn agent_counts(
    req: &TaskRequest,
    nodes: &[NodeView],
    totals: &dyn Fn(&str) -> Resources,
) -> AgentCounts {
    let need = req.resources;
    let n = if req.fraction.is_some() {
        1
    } else {
        need.gpus as usize
    };
    let mut filter = GpuFilter::new(req);
    let mut model_only = GpuFilter::new(&TaskRequest {
        gpu_mem_min_mib: 0,
        ..*req
    });
    let mut c = AgentCounts {
        agents: u32::try_from(nodes.len()).unwrap_or(u32::MAX),
        ..AgentCounts::default()
    };
    for node in nodes {
        let scalars = Resources { gpus: 0, ..need };
        let slot = if !node.runtimes.contains(&req.runtime) {
            &mut c.filtered_runtime
        } else if !security_ok(req, node) {
            &mut c.filtered_security
        } else if !constraints_ok(req.constraints, node.attributes) {
            &mut c.filtered_constraints
        } else if !driver_ok(req, node) {
            &mut c.filtered_driver
        } else if n > 0
            && req.gpu_model.is_some()
            && !node.all_gpus.iter().any(|g| model_only.matches(g))
        {
            &mut c.filtered_gpu_model
        } else if n > 0 && req.gpu_mem_min_mib > 0 && filter.count_all(node) == 0 {
            &mut c.filtered_gpu_memory
        } else if filter.count_all(node) < n || !totals(node.id).fits(&scalars) {
            &mut c.filtered_too_small
        } else if req.fraction.is_some() && filter.count_free(node) < n {
            // What its shared GPUs lack: memory, or only compute.
            let memory_free = req.fraction.is_some_and(|f| {
                node.free_shared.iter().any(|(g, m, _)| {
                    filter.allowed(&g.uuid) && filter.matches(g) && *m >= f.mem_mib
                })
            });
            if memory_free {
                &mut c.exhausted_shared_compute
            } else {
                &mut c.exhausted_shared_memory
            }
        } else if node.free.gpus < need.gpus || filter.count_free(node) < n {
            &mut c.exhausted_gpus
        } else if need.cpus > node.free.cpus + 1e-9 {
            &mut c.exhausted_cpus
        } else if need.mem_mib > node.free.mem_mib {
            &mut c.exhausted_memory
        } else if need.ports > node.free.ports {
            &mut c.exhausted_ports
        } else {
            &mut c.fit_one
        };
        *slot += 1;
    }
    c
}

#[cfg(test)]
mod tests;
