//! Dominant resource fairness: each role's share of the cluster, weighted,
//! and the order in which roles and their frameworks are offered what is
//! left, one unit at a time.

use super::*;

/// The dominant share of `alloc` in `total`; dimensions with total 0 skipped.
pub(super) fn dominant_share(alloc: &Resources, total: &Resources) -> f64 {
    let mut share: f64 = 0.0;
    if total.cpus > 0.0 {
        share = share.max(clean_cpus(alloc.cpus) / total.cpus);
    }
    if total.mem_mib > 0 {
        share = share.max(alloc.mem_mib as f64 / total.mem_mib as f64);
    }
    if total.gpus > 0 {
        share = share.max(f64::from(alloc.gpus) / f64::from(total.gpus));
    }
    share
}

/// A share as a set key: ordered by `total_cmp`, so always totally ordered.
#[derive(Debug, Clone, Copy)]
pub(super) struct Share(f64);

impl PartialEq for Share {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Share {}
impl PartialOrd for Share {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Share {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// (share, rank): rank is the position by id, the tie-break.
type Key = (Share, usize);

pub(super) struct RoleState {
    weight: f64,
    quota: Option<Resources>,
    /// All its frameworks' allocations, suppressed ones included.
    held: Resources,
    share: Share,
    /// In the role order: has frameworks to offer to, and quota room.
    listed: bool,
    /// Its frameworks that are not suppressed.
    all: BTreeSet<Key>,
    /// Those of them with GPU_RESOURCES.
    gpu: BTreeSet<Key>,
}

impl RoleState {
    pub(super) fn members(&self, gpu_only: bool) -> &BTreeSet<Key> {
        if gpu_only {
            &self.gpu
        } else {
            &self.all
        }
    }

    /// What the quota still lets the role take; None without quota.
    pub(super) fn room(&self) -> Option<Resources> {
        self.quota.map(|q| {
            let q = clean(&q);
            Resources {
                cpus: clean_cpus(q.cpus - self.held.cpus),
                mem_mib: q.mem_mib.saturating_sub(self.held.mem_mib),
                gpus: q.gpus.saturating_sub(self.held.gpus),
                ports: 0,
            }
        })
    }

    pub(super) fn out_of_quota(&self) -> bool {
        self.room()
            .is_some_and(|r| r.cpus <= 0.0 && r.mem_mib == 0 && r.gpus == 0)
    }
}

pub(super) struct FwState<'a> {
    /// Position by id: the tie-break in the sets.
    rank: usize,
    role: usize,
    gpu_capable: bool,
    /// In its role's sets (not suppressed).
    active: bool,
    allocated: Resources,
    share: Share,
    demand: Demand,
    filters: Option<&'a BTreeMap<String, Filter>>,
}

/// The hierarchical DRF sorter: roles keyed by (weighted share, name rank),
/// and within each role its frameworks keyed by (share, id rank). `pick`
/// merges roles of equal share, so the order is (role share, framework
/// share, id) whatever the role names.
pub(super) struct Sorter<'a> {
    total: Resources,
    roles: Vec<RoleState>,
    /// Frameworks in input order; `ranks[r]` is the index of the one of rank r.
    fws: Vec<FwState<'a>>,
    ranks: Vec<usize>,
    role_order: BTreeSet<Key>,
}

impl<'a> Sorter<'a> {
    pub(super) fn new(
        frameworks: &'a [FrameworkView],
        configs: &BTreeMap<String, RoleConfig>,
        filters: &'a Filters,
        total: Resources,
    ) -> Self {
        let mut ranks: Vec<usize> = (0..frameworks.len()).collect();
        ranks.sort_by(|&a, &b| natural_cmp(&frameworks[a].id, &frameworks[b].id));
        let names: BTreeSet<&str> = frameworks.iter().map(|f| f.role.as_str()).collect();
        let role_index: BTreeMap<&str, usize> =
            names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
        let mut roles: Vec<RoleState> = names
            .iter()
            .map(|name| {
                let config = configs.get(*name).cloned().unwrap_or_default();
                RoleState {
                    weight: if config.weight.is_finite() && config.weight > 0.0 {
                        config.weight
                    } else {
                        1.0
                    },
                    quota: config.quota,
                    held: Resources::default(),
                    share: Share(0.0),
                    listed: false,
                    all: BTreeSet::new(),
                    gpu: BTreeSet::new(),
                }
            })
            .collect();
        let mut fws: Vec<FwState<'a>> = frameworks
            .iter()
            .map(|f| {
                let allocated = clean(&f.allocated);
                let role = role_index.get(f.role.as_str()).copied().unwrap_or(0);
                if let Some(r) = roles.get_mut(role) {
                    r.held = r.held.add(&allocated);
                }
                FwState {
                    rank: 0,
                    role,
                    gpu_capable: f.gpu_capable,
                    active: !f.suppressed,
                    allocated,
                    share: Share(dominant_share(&allocated, &total)),
                    demand: f.demand,
                    filters: filters.for_framework(&f.id),
                }
            })
            .collect();
        for (rank, &i) in ranks.iter().enumerate() {
            let fw = &mut fws[i];
            fw.rank = rank;
            if !fw.active {
                continue;
            }
            let role = &mut roles[fw.role];
            role.all.insert((fw.share, rank));
            if fw.gpu_capable {
                role.gpu.insert((fw.share, rank));
            }
        }
        let mut role_order = BTreeSet::new();
        for (i, role) in roles.iter_mut().enumerate() {
            role.share = Share(dominant_share(&role.held, &total) / role.weight);
            role.listed = !role.all.is_empty() && !role.out_of_quota();
            if role.listed {
                role_order.insert((role.share, i));
            }
        }
        Sorter {
            total,
            roles,
            fws,
            ranks,
            role_order,
        }
    }

    /// The first eligible framework for this agent in (role share, framework
    /// share, id) order, and the slice it would get.
    pub(super) fn pick(
        &self,
        agent_id: &str,
        gpu_only: bool,
        left: &Free<'_>,
        served: &[usize],
        now_ms: u64,
    ) -> Option<(usize, Resources)> {
        self.pick_by(gpu_only, |rank| {
            self.offerable(rank, agent_id, left, served, now_ms)
        })
    }

    /// The frameworks that could be offered something of this agent.
    pub(super) fn contenders(
        &self,
        agent_id: &str,
        gpu_only: bool,
        left: &Free<'_>,
        now_ms: u64,
    ) -> Vec<usize> {
        self.role_order
            .iter()
            .flat_map(|&(_, r)| self.roles[r].members(gpu_only).iter())
            .filter_map(|&(_, rank)| self.offerable(rank, agent_id, left, &[], now_ms))
            .map(|(i, _)| i)
            .collect()
    }

    /// Several frameworks want this agent and one of them asks for less
    /// than a whole agent: the agent is split ([`split_agent`]).
    pub(super) fn contended(
        &self,
        agent_id: &str,
        gpu_only: bool,
        left: &Free<'_>,
        now_ms: u64,
    ) -> bool {
        let mut wanting = 0;
        let mut partial = false;
        for &(_, r) in &self.role_order {
            for &(_, rank) in self.roles[r].members(gpu_only) {
                if let Some((i, _)) = self.offerable(rank, agent_id, left, &[], now_ms) {
                    wanting += 1;
                    partial |= self.fws[i].demand != Demand::Whole;
                    if wanting > 1 && partial {
                        return true;
                    }
                }
            }
        }
        false
    }

    /// The first framework in (role share, framework share, id) order for
    /// which `offer` (given its rank) says what to offer.
    pub(super) fn pick_by(
        &self,
        gpu_only: bool,
        offer: impl Fn(usize) -> Option<(usize, Resources)>,
    ) -> Option<(usize, Resources)> {
        let mut roles = self.role_order.iter().peekable();
        while let Some(&(share, first)) = roles.next() {
            let tied = roles.peek().is_some_and(|&&(s, _)| s == share);
            let found = if !tied {
                self.roles[first]
                    .members(gpu_only)
                    .iter()
                    .find_map(|&(_, rank)| offer(rank))
            } else {
                // Roles with equal shares are merged so that the framework
                // share decides between them, as the (role, framework, id)
                // order says.
                let mut group = vec![first];
                while let Some(&&(s, r)) = roles.peek() {
                    if s != share {
                        break;
                    }
                    group.push(r);
                    roles.next();
                }
                let mut heads: Vec<_> = group
                    .iter()
                    .map(|&r| self.roles[r].members(gpu_only).iter().peekable())
                    .collect();
                let mut found = None;
                while found.is_none() {
                    let next = heads
                        .iter_mut()
                        .filter_map(|h| h.peek().copied().copied().map(|k| (k, h)))
                        .min_by_key(|(k, _)| *k);
                    let Some(((_, rank), head)) = next else {
                        break;
                    };
                    head.next();
                    found = offer(rank);
                }
                found
            };
            if found.is_some() {
                return found;
            }
        }
        None
    }

    /// The slice of `left` the framework of `rank` may take, if any.
    pub(super) fn offerable(
        &self,
        rank: usize,
        agent_id: &str,
        left: &Free<'_>,
        served: &[usize],
        now_ms: u64,
    ) -> Option<(usize, Resources)> {
        let i = self.ranks[rank];
        let fw = &self.fws[i];
        // The quota and GPU rules already keep a framework from a second
        // slice of one agent; this keeps it so whatever they become.
        if served.contains(&i) {
            return None;
        }
        let wanted = Resources {
            cpus: left.cpus,
            mem_mib: left.mem_mib,
            gpus: if fw.gpu_capable {
                left.gpus.len() as u32
            } else {
                0
            },
            ports: 0,
        };
        if fw
            .filters
            .and_then(|f| f.get(agent_id))
            .is_some_and(|f| f.refuses(&wanted, now_ms))
        {
            return None;
        }
        let slice = self.slice_for(i, left, wanted.gpus);
        if slice.cpus <= 0.0 && slice.mem_mib == 0 && slice.gpus == 0 {
            return None;
        }
        // A framework that asks for tasks of a size is offered at least
        // one: a smaller offer it can only decline (and a framework offered
        // crumbs again and again looks served to the reclaim planner).
        if let Some(unit) = self.unit(i, &left.reserve) {
            if !fits(&unit, &slice) {
                return None;
            }
        }
        Some((i, slice))
    }

    /// One task of framework `i`'s demand as offered on an agent whose
    /// GPUs each keep `reserve`: without GPUs for a framework that cannot
    /// take them, and a GPU with at least its reserve. `None` unless its
    /// demand is a task size.
    pub(super) fn unit(&self, i: usize, reserve: &Resources) -> Option<Resources> {
        let Demand::Task(shape) = self.fws[i].demand else {
            return None;
        };
        let mut shape = clean(&shape);
        if !self.fws[i].gpu_capable {
            shape.gpus = 0;
        }
        shape.cpus = shape.cpus.max(reserve.cpus * f64::from(shape.gpus));
        shape.mem_mib = shape
            .mem_mib
            .max(reserve.mem_mib.saturating_mul(u64::from(shape.gpus)));
        Some(shape)
    }

    /// What framework `i` may be offered of `left` taking at most `gpus` of
    /// its GPUs: capped by its role's quota, and keeping each GPU's reserve
    /// of cpus and memory: the GPUs it takes carry theirs, and those it
    /// leaves keep theirs for whoever takes them. A GPU whose reserve the
    /// agent no longer has is not offered.
    pub(super) fn slice_for(&self, i: usize, left: &Free<'_>, gpus: u32) -> Resources {
        let mut want = Resources {
            cpus: left.cpus,
            mem_mib: left.mem_mib,
            gpus,
            ports: 0,
        };
        if let Some(room) = self.roles[self.fws[i].role].room() {
            want = min_res(&clean(&want), &clean(&room));
        }
        let r = left.reserve;
        // GPUs the agent can still give their reserve to.
        let usable = covered(&r, left.cpus, left.mem_mib, left.gpus.len() as u32);
        let g = covered(&r, want.cpus, want.mem_mib, want.gpus.min(usable));
        let kept = usable - g;
        Resources {
            cpus: clean_cpus(want.cpus.min(left.cpus - r.cpus * f64::from(kept))),
            mem_mib: want.mem_mib.min(
                left.mem_mib
                    .saturating_sub(r.mem_mib.saturating_mul(u64::from(kept))),
            ),
            gpus: g,
            ports: 0,
        }
    }

    /// Adds an offered slice to the framework and its role, and re-keys them.
    pub(super) fn charge(&mut self, i: usize, slice: &Resources) {
        let total = self.total;
        let fw = &mut self.fws[i];
        let rank = fw.rank;
        let role = &mut self.roles[fw.role];
        let old = (fw.share, rank);
        fw.allocated = fw.allocated.add(slice);
        fw.share = Share(dominant_share(&fw.allocated, &total));
        if fw.active {
            role.all.remove(&old);
            role.all.insert((fw.share, rank));
            if fw.gpu_capable {
                role.gpu.remove(&old);
                role.gpu.insert((fw.share, rank));
            }
        }
        let role_idx = fw.role;
        if role.listed {
            self.role_order.remove(&(role.share, role_idx));
        }
        role.held = role.held.add(slice);
        role.share = Share(dominant_share(&role.held, &total) / role.weight);
        role.listed = !role.all.is_empty() && !role.out_of_quota();
        if role.listed {
            self.role_order.insert((role.share, role_idx));
        }
    }
}
