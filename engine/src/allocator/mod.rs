//! The framework API's allocator: Mesos' hierarchical DRF allocator, with
//! GPUs named by UUID. PURE: plain data in, plain data out; time is the
//! `now_ms` parameter; the same input gives the same output.
//!
//! # Allocation semantics
//!
//! [`allocate`] runs one cycle and returns the offers to make ([`OfferPlan`]).
//!
//! - **Shares.** A share is the dominant share: the largest of
//!   `allocated / cluster total` over cpus, mem and gpus, where the cluster
//!   total is the sum of the `total` of the agents given. A dimension whose
//!   total is 0 is skipped. A framework's `allocated` counts its running tasks
//!   and its outstanding offers.
//! - **Order (hierarchical DRF).** A role's share is the sum of its
//!   frameworks' allocations, as a dominant share, divided by the role's
//!   weight. Candidates are ordered by (role share, framework share,
//!   framework id), lowest first (Mesos breaks a tie between roles by role
//!   name; here the framework share, then the id, does). Roles absent from the role table have weight
//!   1 and no quota; a weight that is not a positive number counts as 1.
//! - **Offers.** Agents are visited by id. An agent that one eligible
//!   framework alone wants goes to it whole (Mesos' coarse-grained offer).
//!   An agent that several want is split by progressive filling
//!   (`split_agent`): the lowest framework in the order gets one unit of
//!   its [`Demand`], its share grows, and again, until no unit fits (at
//!   most [`MAX_UNITS_PER_AGENT`] units). A framework whose demand is a
//!   task size is never offered less than one task of it, on either path:
//!   what fits no framework's unit stays unoffered. Allocations grow as offers are
//!   made, so others come first for the next agent. A framework may
//!   receive several agents in one cycle. What a framework could not take
//!   of an agent (the rest of a quota slice, or the GPUs a framework
//!   without GPU_RESOURCES never sees) goes to the next eligible
//!   framework, so one agent may appear in several offers.
//! - **GPU reserve.** Each free GPU keeps [`AllocatorConfig::gpu_reserve`]
//!   cpus and memory (at most the agent's own per GPU): a slice without
//!   the GPU leaves them, a slice with it carries them, and a GPU whose
//!   reserve the agent no longer has is not offered.
//! - **Eligibility.** A framework is skipped when it is suppressed, when a
//!   filter refuses this agent to it ([`Filters`]; from Decline and Accept's
//!   `refuse_seconds`; only while the agent has no more than was declined), or, when [`AllocatorConfig::gpu_agents_for_gpu_frameworks_only`]
//!   is on (the default) and the agent has GPUs (`total.gpus > 0`), when it
//!   lacks GPU_RESOURCES. A framework without GPU_RESOURCES is never offered
//!   GPUs, even when that flag is off (it then gets the cpus and mem).
//! - **Quota** is a limit on what a role holds (allocated + offered). When the
//!   room left is smaller than the agent, the offer is a slice: cpus, mem and
//!   GPUs each capped to the room, the GPUs being the lowest-index free ones.
//!   A framework whose slice would be empty in every dimension is skipped.
//! - **GPUs.** Only `AgentView::free_gpus` are offered (the caller leaves out
//!   unhealthy, held and already offered GPUs), healthy ones only, each UUID
//!   at most once per cycle. An offer's `resources.gpus` always equals
//!   `gpu_uuids.len()`: a GPU that has no UUID in `free_gpus` is never offered.
//! - An agent whose free resources are all zero gets no offer.
//!
//! Cost: O(agents × (log frameworks + roles)) in the usual case; candidates
//! live in ordered sets keyed by share and re-keyed after each offer.

pub mod bench_cluster;
mod filters;
mod offers;
pub mod reclaim;
mod sorter;

use sorter::*;

#[cfg(test)]
mod harness;
#[cfg(test)]
mod tests;

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::hash::{BuildHasher, Hasher};

use gpuctl_core::types::{natural_cmp, GpuInfo, Resources};

pub use filters::{refuse_until, Filter, Filters, DEFAULT_REFUSE_SECONDS, MAX_REFUSE_SECONDS};
pub use offers::{Offer, OfferBook, OfferError, OfferedShare};

/// Below this many cpus a quantity counts as zero: sums of fractions leave
/// crumbs such as 1e-16 that must not become offers.
const CPU_EPSILON: f64 = 1e-9;

/// One agent as the allocator sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentView {
    pub id: String,
    pub hostname: String,
    /// Free: total less what tasks hold and what outstanding offers hold.
    pub free: Resources,
    /// Healthy GPUs that no task holds and no outstanding offer names.
    pub free_gpus: Vec<GpuInfo>,
    pub total: Resources,
    pub attributes: BTreeMap<String, String>,
}

/// One framework as the allocator sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct FrameworkView {
    pub id: String,
    pub role: String,
    /// The framework declared the GPU_RESOURCES capability.
    pub gpu_capable: bool,
    pub suppressed: bool,
    /// Its running tasks plus its outstanding offers.
    pub allocated: Resources,
    /// What it has shown it asks for, which sizes its offers when several
    /// frameworks want one agent.
    pub demand: Demand,
}

/// What a framework asks for, as the leader learnt it from its calls.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Demand {
    /// Nothing launched yet: when it shares an agent with others it is
    /// offered an equal part of it, once.
    #[default]
    Unknown,
    /// It launches tasks of (at least) this size: offered in units of it.
    Task(Resources),
    /// Offered whatever is left of an agent in its turn (Mesos' coarse
    /// offers): a framework that declined a part, and the built-in
    /// scheduler, whose queue holds jobs of every size.
    Whole,
}

/// The most units one agent is cut into in one cycle: a framework of tiny
/// tasks gets the rest at the next cycle rather than making this one long.
pub const MAX_UNITS_PER_AGENT: usize = 256;

#[derive(Debug, Clone, PartialEq)]
pub struct RoleConfig {
    /// Relative share of the cluster; > 0, default 1.
    pub weight: f64,
    /// A limit on what the role may hold (allocated + offered).
    pub quota: Option<Resources>,
}

impl Default for RoleConfig {
    fn default() -> Self {
        RoleConfig {
            weight: 1.0,
            quota: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct AllocatorConfig {
    /// Agents with GPUs are offered only to frameworks with GPU_RESOURCES,
    /// so that CPU-only work does not strand scarce GPUs (Mesos'
    /// `--filter_gpu_resources`).
    pub gpu_agents_for_gpu_frameworks_only: bool,
    /// Cpus and memory kept for each free GPU (its `gpus` unused): offers
    /// without that GPU leave them, an offer with it carries them. At most
    /// the agent's own cpus and memory per GPU.
    pub gpu_reserve: Resources,
}

/// Per GPU: 2 cpus and 8 GiB, well under what GPU hosts have per GPU.
pub const DEFAULT_GPU_RESERVE: Resources = Resources {
    cpus: 2.0,
    mem_mib: 8192,
    gpus: 0,
    ports: 0,
};

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            gpu_agents_for_gpu_frameworks_only: true,
            gpu_reserve: DEFAULT_GPU_RESERVE,
        }
    }
}

/// An offer to make: `resources` of `agent_id`, naming exactly `gpu_uuids`.
#[derive(Debug, Clone, PartialEq)]
pub struct OfferPlan {
    pub framework_id: String,
    pub agent_id: String,
    pub resources: Resources,
    pub gpu_uuids: Vec<String>,
    /// Shared GPUs offered for fractions: none from the allocator (fractions
    /// are outside its fair shares); the leader adds them to a plan.
    pub shares: Vec<OfferedShare>,
}

/// Runs one allocation cycle; see the module doc for the rules.
pub fn allocate(
    agents: &[AgentView],
    frameworks: &[FrameworkView],
    roles: &BTreeMap<String, RoleConfig>,
    filters: &Filters,
    config: &AllocatorConfig,
    now_ms: u64,
) -> Vec<OfferPlan> {
    let total = cluster_total(agents.iter().map(|a| &a.total));
    allocate_within(total, agents, frameworks, roles, filters, config, now_ms)
}

/// The total that shares are taken of: the sum of the agents' totals.
pub fn cluster_total<'a>(totals: impl IntoIterator<Item = &'a Resources>) -> Resources {
    totals
        .into_iter()
        .fold(Resources::default(), |acc, t| acc.add(&clean(t)))
}

/// [`allocate`] with the cluster total given ([`cluster_total`] of every
/// agent), so that a caller can leave out the agents with nothing free: at
/// 10,000 agents, building a view of each full one was most of a cycle.
pub fn allocate_within(
    total: Resources,
    agents: &[AgentView],
    frameworks: &[FrameworkView],
    roles: &BTreeMap<String, RoleConfig>,
    filters: &Filters,
    config: &AllocatorConfig,
    now_ms: u64,
) -> Vec<OfferPlan> {
    let mut sorter = Sorter::new(frameworks, roles, filters, total);

    let mut order: Vec<&AgentView> = agents.iter().collect();
    // Stable: agents with the same id keep the caller's order.
    order.sort_by(|a, b| a.id.cmp(&b.id));

    let mut plans = Vec::new();
    // Guards against a caller that lists one GPU on two agents (agents that
    // report the same UUIDs): the first agent by id keeps it.
    let gpu_count = agents.iter().map(|a| a.free_gpus.len()).sum();
    let mut seen_gpus: HashSet<&str, BuildFastHasher> =
        HashSet::with_capacity_and_hasher(gpu_count, BuildFastHasher);
    let mut served: Vec<usize> = Vec::new();
    let mut gpus: Vec<&GpuInfo> = Vec::new();
    for agent in order {
        gpus.clear();
        gpus.extend(agent.free_gpus.iter().filter(|g| g.healthy));
        gpus.sort_by(|a, b| (a.index, &a.uuid).cmp(&(b.index, &b.uuid)));
        // At most `free.gpus` of them, and only those no earlier agent named.
        let mut kept = 0;
        gpus.retain(|g| {
            let keep = kept < agent.free.gpus && seen_gpus.insert(g.uuid.as_str());
            kept += u32::from(keep);
            keep
        });
        let mut left = Free {
            cpus: clean_cpus(agent.free.cpus),
            mem_mib: agent.free.mem_mib,
            gpus: &gpus,
            reserve: gpu_reserve(config, &agent.total),
        };
        let gpu_only = config.gpu_agents_for_gpu_frameworks_only && agent.total.gpus > 0;
        served.clear();
        if sorter.contended(&agent.id, gpu_only, &left, now_ms) {
            split_agent(
                &mut sorter,
                agent,
                gpu_only,
                left,
                now_ms,
                frameworks,
                &mut plans,
            );
            continue;
        }
        while !left.is_empty() {
            let Some((fw, slice)) = sorter.pick(&agent.id, gpu_only, &left, &served, now_ms) else {
                break;
            };
            let (taken, rest) = left
                .gpus
                .split_at((slice.gpus as usize).min(left.gpus.len()));
            plans.push(OfferPlan {
                framework_id: frameworks[fw].id.clone(),
                agent_id: agent.id.clone(),
                resources: slice,
                gpu_uuids: taken.iter().map(|g| g.uuid.clone()).collect(),
                shares: Vec::new(),
            });
            left = Free {
                cpus: clean_cpus(left.cpus - slice.cpus),
                mem_mib: left.mem_mib.saturating_sub(slice.mem_mib),
                gpus: rest,
                reserve: left.reserve,
            };
            sorter.charge(fw, &slice);
            served.push(fw);
        }
    }
    plans
}

/// Shares one agent between several frameworks that want it, by
/// progressive filling (the DRF paper's): the framework lowest in the DRF
/// order gets one unit of its demand, its share grows, and again, until no
/// unit fits. A framework of unknown demand gets one equal part of the
/// agent; one that asks for whole agents gets what is left in its turn.
/// What fits no unit stays unoffered this cycle.
fn split_agent(
    sorter: &mut Sorter<'_>,
    agent: &AgentView,
    gpu_only: bool,
    mut left: Free<'_>,
    now_ms: u64,
    frameworks: &[FrameworkView],
    plans: &mut Vec<OfferPlan>,
) {
    let contenders = sorter.contenders(&agent.id, gpu_only, &left, now_ms);
    let start_gpus = left.gpus;
    let n = contenders.len().max(1);
    let part = Resources {
        cpus: left.cpus / n as f64,
        mem_mib: left.mem_mib / n as u64,
        gpus: (left.gpus.len() as u32).div_ceil(n as u32),
        ports: 0,
    };
    // Per framework index: what it got on this agent, in the order it first
    // got something (which hands out the GPUs).
    let mut given: Vec<(usize, Resources)> = Vec::new();
    let mut done: Vec<usize> = Vec::new();
    for _ in 0..MAX_UNITS_PER_AGENT {
        let picked = sorter.pick_by(gpu_only, |rank| {
            let (i, room) = sorter.offerable(rank, &agent.id, &left, &[], now_ms)?;
            if done.contains(&i) || !contenders.contains(&i) {
                return None;
            }
            let r = left.reserve;
            let unit = match frameworks[i].demand {
                Demand::Whole => room,
                Demand::Unknown => {
                    let g = covered(&r, part.cpus, part.mem_mib, part.gpus.min(room.gpus));
                    min_res(
                        &Resources { gpus: g, ..part },
                        &sorter.slice_for(i, &left, g),
                    )
                }
                Demand::Task(_) => {
                    let shape = sorter.unit(i, &r)?;
                    let fit = sorter.slice_for(i, &left, shape.gpus);
                    if fit.gpus != shape.gpus || !fits(&shape, &fit) {
                        return None;
                    }
                    shape
                }
            };
            (!is_zero(&unit)).then_some((i, unit))
        });
        let Some((i, unit)) = picked else {
            break;
        };
        if !matches!(frameworks[i].demand, Demand::Task(_)) {
            done.push(i);
        }
        match given.iter_mut().find(|(j, _)| *j == i) {
            Some((_, r)) => *r = r.add(&unit),
            None => given.push((i, unit)),
        }
        let (_, rest) = left
            .gpus
            .split_at((unit.gpus as usize).min(left.gpus.len()));
        left = Free {
            cpus: clean_cpus(left.cpus - unit.cpus),
            mem_mib: left.mem_mib.saturating_sub(unit.mem_mib),
            gpus: rest,
            reserve: left.reserve,
        };
        sorter.charge(i, &unit);
    }
    // The GPUs were counted off the front of the list; hand them out in the
    // same order.
    let mut gpus = start_gpus;
    for (i, r) in given {
        let (taken, rest) = gpus.split_at((r.gpus as usize).min(gpus.len()));
        gpus = rest;
        plans.push(OfferPlan {
            framework_id: frameworks[i].id.clone(),
            agent_id: agent.id.clone(),
            resources: r,
            gpu_uuids: taken.iter().map(|g| g.uuid.clone()).collect(),
            shares: Vec::new(),
        });
    }
}

/// How many of `gpus` GPUs `cpus` and `mem` give their reserve `r` to.
fn covered(r: &Resources, cpus: f64, mem: u64, gpus: u32) -> u32 {
    let mut g = gpus;
    if r.cpus > CPU_EPSILON {
        g = g.min(((cpus + CPU_EPSILON) / r.cpus).floor() as u32);
    }
    if let Some(n) = mem.checked_div(r.mem_mib) {
        g = g.min(u32::try_from(n).unwrap_or(u32::MAX));
    }
    g
}

/// The cpus and memory kept per GPU on an agent of `total`: the configured
/// reserve, at most the agent's own cpus and memory per GPU (so that a small
/// host still offers all its GPUs, each with its part).
fn gpu_reserve(config: &AllocatorConfig, total: &Resources) -> Resources {
    if total.gpus == 0 {
        return Resources::default();
    }
    let n = total.gpus;
    Resources {
        cpus: config
            .gpu_reserve
            .cpus
            .min(clean_cpus(total.cpus) / f64::from(n))
            .max(0.0),
        mem_mib: config.gpu_reserve.mem_mib.min(total.mem_mib / u64::from(n)),
        gpus: 0,
        ports: 0,
    }
}

fn min_res(a: &Resources, b: &Resources) -> Resources {
    Resources {
        cpus: a.cpus.min(b.cpus),
        mem_mib: a.mem_mib.min(b.mem_mib),
        gpus: a.gpus.min(b.gpus),
        ports: a.ports.min(b.ports),
    }
}

/// `a` fits in `b` in every dimension.
fn fits(a: &Resources, b: &Resources) -> bool {
    a.cpus <= b.cpus + CPU_EPSILON && a.mem_mib <= b.mem_mib && a.gpus <= b.gpus
}

fn is_zero(r: &Resources) -> bool {
    clean_cpus(r.cpus) <= 0.0 && r.mem_mib == 0 && r.gpus == 0
}

/// A fast, fixed hasher for the GPU guard: SipHash of 80,000 UUIDs was half
/// of a 10,000-agent cycle. Only membership is asked of the set, so the
/// output does not depend on the hash.
#[derive(Clone, Copy, Default)]
struct BuildFastHasher;

impl BuildHasher for BuildFastHasher {
    type Hasher = FastHasher;
    fn build_hasher(&self) -> FastHasher {
        FastHasher(0)
    }
}

/// Fx-style: 8 bytes per multiply, with murmur3's finalizer so that every
/// bit of the result depends on every input bit.
struct FastHasher(u64);

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = (self.0.rotate_left(5) ^ u64::from_le_bytes(word))
                .wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }

    fn finish(&self) -> u64 {
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
}

/// What is still free on the agent being allocated; GPUs lowest index first.
struct Free<'a> {
    cpus: f64,
    mem_mib: u64,
    gpus: &'a [&'a GpuInfo],
    /// The cpus and memory each GPU keeps (see [`AllocatorConfig`]).
    reserve: Resources,
}

impl Free<'_> {
    fn is_empty(&self) -> bool {
        self.cpus <= 0.0 && self.mem_mib == 0 && self.gpus.is_empty()
    }
}

/// cpus below the epsilon, negative or not a number count as 0.
fn clean_cpus(cpus: f64) -> f64 {
    if cpus.is_finite() && cpus > CPU_EPSILON {
        cpus
    } else {
        0.0
    }
}

fn clean(r: &Resources) -> Resources {
    Resources {
        cpus: clean_cpus(r.cpus),
        ..*r
    }
}
