//! Free capacity by agent, an index derived from the state and kept up to
//! date as commands apply (only the agents a command changed are looked at
//! again), so that the scheduler finds where a job fits in O(log agents)
//! and the leader's loops read the cluster's free totals without walking
//! every agent.
//!
//! Agents that take tasks are grouped by [`GpuClass`] (the model and
//! memory of their GPUs) and, within a class, by (free whole GPUs, GPUs not
//! free): the two numbers the placement engine's bundle and spread orders
//! compare first (`scheduler::placement`). [`Capacity::candidates`] walks
//! the agents of the classes a job may use in exactly that order, so the
//! first agents that fit are the ones a scan of the whole cluster would
//! have chosen.
//!
//! The same groups are kept per agent attribute value (`zone=b`; not the
//! agent's own `nvidia.com/` GPU labels), so that a job constrained to an
//! exact value walks only the agents that have it, in the same order,
//! however few they are among the cluster's.

use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};

use gpuctl_core::types::{AgentId, Device, GpuInfo, PlacementPolicy, Resources};

use super::{AgentRecord, State};

/// What kind of GPUs an agent has: the placement engine's model and memory
/// filters hold for all of an agent's GPUs or none when it is `Same`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GpuClass {
    Same {
        model: String,
        memory_mib: u64,
    },
    /// GPUs of several models or sizes: a filter may hold for some.
    Mixed,
}

impl GpuClass {
    fn of(gpus: &[GpuInfo]) -> GpuClass {
        let mut it = gpus.iter();
        let Some(first) = it.next() else {
            return GpuClass::Mixed;
        };
        if it.all(|g| g.model == first.model && g.memory_mib == first.memory_mib) {
            GpuClass::Same {
                model: first.model.clone(),
                memory_mib: first.memory_mib,
            }
        } else {
            GpuClass::Mixed
        }
    }
}

/// One agent's entry.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    class: GpuClass,
    /// Whole GPUs new tasks may get now (schedulable, not held).
    free_gpus: u32,
    /// The agent's other GPUs (held, down, in MIG mode, shared, cordoned).
    in_use: u32,
    free: Resources,
    /// Memory of its shared GPUs that no fraction holds.
    shared_mem_mib: u64,
    /// Its attributes as indexed ([`attr_key`]), to leave the index by.
    attrs: Vec<(String, String)>,
}

impl Entry {
    fn of(state: &State, a: &AgentRecord) -> Entry {
        let gpus = &a.info.gpus;
        let free_gpus = gpus
            .iter()
            .filter(|g| !g.mig.enabled && state.device_free(Device::Gpu(g)))
            .count();
        Entry {
            class: GpuClass::of(gpus),
            free_gpus: u32::try_from(free_gpus).unwrap_or(u32::MAX),
            in_use: u32::try_from(gpus.len().saturating_sub(free_gpus)).unwrap_or(u32::MAX),
            free: a.free(),
            shared_mem_mib: state
                .free_shares(a)
                .fold(0u64, |sum, s| sum.saturating_add(s.mem_mib)),
            attrs: a
                .info
                .attributes
                .iter()
                .filter(|(k, _)| indexed(k))
                .map(|(k, v)| attr_key(k, v))
                .collect(),
        }
    }
}

/// The cluster's free resources, summed over the agents that take tasks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FreeTotals {
    pub agents: usize,
    /// Thousandths of a CPU (exact under adds and removes).
    pub milli_cpus: i64,
    pub mem_mib: u64,
    pub gpus: u64,
    pub shared_mem_mib: u64,
}

impl FreeTotals {
    fn add(&mut self, e: &Entry) {
        self.agents += 1;
        self.milli_cpus += milli(e.free.cpus);
        self.mem_mib = self.mem_mib.saturating_add(e.free.mem_mib);
        self.gpus = self.gpus.saturating_add(u64::from(e.free.gpus));
        self.shared_mem_mib = self.shared_mem_mib.saturating_add(e.shared_mem_mib);
    }

    fn remove(&mut self, e: &Entry) {
        self.agents = self.agents.saturating_sub(1);
        self.milli_cpus -= milli(e.free.cpus);
        self.mem_mib = self.mem_mib.saturating_sub(e.free.mem_mib);
        self.gpus = self.gpus.saturating_sub(u64::from(e.free.gpus));
        self.shared_mem_mib = self.shared_mem_mib.saturating_sub(e.shared_mem_mib);
    }

    /// As resources (ports are not summed).
    pub fn resources(&self) -> Resources {
        Resources {
            cpus: self.milli_cpus as f64 / 1000.0,
            mem_mib: self.mem_mib,
            gpus: u32::try_from(self.gpus).unwrap_or(u32::MAX),
            ports: 0,
        }
    }
}

fn milli(cpus: f64) -> i64 {
    (cpus * 1000.0).round() as i64
}

/// An attribute as the index keeps it: constraints match values without
/// regard to case (`placement::glob_match` lowers both, char by char).
fn attr_key(key: &str, value: &str) -> (String, String) {
    (
        key.to_string(),
        value.chars().flat_map(char::to_lowercase).collect(),
    )
}

/// The GPU labels the agent adds itself (`nvidia.com/gpu.product`, ...)
/// are not indexed: the GPU kind is (classes), and the rest (driver and
/// compute versions, counts) mostly match every agent of a kind, so an
/// index of them would cost a dozen entries per agent and narrow nothing.
/// Operators' attributes (zones, racks, pools) are what picks few agents.
const UNINDEXED_PREFIX: &str = "nvidia.com/";

fn indexed(key: &str) -> bool {
    !key.starts_with(UNINDEXED_PREFIX)
}

/// A constraint's pattern as an exact value, when it has no wildcard.
fn exact(pattern: &str) -> Option<&str> {
    (!pattern.contains(['*', '?'])).then_some(pattern)
}

/// The agents with one attribute value, grouped as all agents are.
#[derive(Debug, Clone, Default, PartialEq)]
struct AttrGroups {
    groups: ClassGroups,
    agents: usize,
}

/// Agents of one class by (free whole GPUs, GPUs not free), ids in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Groups(BTreeMap<(u32, u32), BTreeSet<AgentId>>);

impl Groups {
    pub fn insert(&mut self, key: (u32, u32), id: &str) {
        self.0.entry(key).or_default().insert(id.to_string());
    }

    pub fn remove(&mut self, key: (u32, u32), id: &str) {
        if let Some(ids) = self.0.get_mut(&key) {
            ids.remove(id);
            if ids.is_empty() {
                self.0.remove(&key);
            }
        }
    }

    /// Agents with at least `n` free GPUs, in `policy`'s order: bundle
    /// takes the fewest free first, then the most in use; spread the most
    /// free first, then the fewest in use; ids ascending within.
    fn walk(&self, n: u32, policy: PlacementPolicy) -> impl Iterator<Item = (SortKey, &str)> + '_ {
        let mut keys: Vec<(SortKey, &BTreeSet<AgentId>)> = self
            .0
            .range((n, 0)..)
            .map(|(&(f, u), ids)| (sort_key(policy, f, u), ids))
            .collect();
        keys.sort_by_key(|(k, _)| *k);
        keys.into_iter()
            .flat_map(|(k, ids)| ids.iter().map(move |id| (k, id.as_str())))
    }
}

/// The order of (free, in use) under a policy, ascending = better.
type SortKey = (i64, i64);

fn sort_key(policy: PlacementPolicy, free: u32, in_use: u32) -> SortKey {
    let (f, u) = (i64::from(free), i64::from(in_use));
    match policy {
        PlacementPolicy::Bundle => (f, -u),
        PlacementPolicy::Spread => (-f, u),
    }
}

/// Agents by class, each class by [`Groups`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClassGroups(HashMap<GpuClass, Groups>);

impl ClassGroups {
    pub fn insert(&mut self, class: &GpuClass, key: (u32, u32), id: &str) {
        self.0.entry(class.clone()).or_default().insert(key, id);
    }

    pub fn remove(&mut self, class: &GpuClass, key: (u32, u32), id: &str) {
        if let Some(g) = self.0.get_mut(class) {
            g.remove(key, id);
            if g.0.is_empty() {
                self.0.remove(class);
            }
        }
    }

    pub fn classes(&self) -> impl Iterator<Item = &GpuClass> {
        self.0.keys()
    }

    /// The agents of the classes `usable` allows with at least `n` free
    /// GPUs, merged in `policy`'s order (see [`Groups::walk`]).
    pub fn walk<'a>(
        &'a self,
        n: u32,
        policy: PlacementPolicy,
        usable: impl Fn(&GpuClass) -> bool,
    ) -> Walk<'a> {
        Walk::merge(
            self.0
                .iter()
                .filter(|(c, _)| usable(c))
                .map(|(_, g)| Box::new(g.walk(n, policy)) as Stream<'a>)
                .collect(),
        )
    }
}

type Stream<'a> = Box<dyn Iterator<Item = (SortKey, &'a str)> + 'a>;

/// A k-way merge of ordered streams of agents (one per class, and the
/// scheduler's own overlay of agents it changed in a round).
pub struct Walk<'a> {
    streams: Vec<Stream<'a>>,
    heads: BinaryHeap<std::cmp::Reverse<(SortKey, &'a str, usize)>>,
}

impl<'a> Walk<'a> {
    pub fn merge(mut streams: Vec<Stream<'a>>) -> Walk<'a> {
        let mut heads = BinaryHeap::new();
        for (i, s) in streams.iter_mut().enumerate() {
            if let Some((k, id)) = s.next() {
                heads.push(std::cmp::Reverse((k, id, i)));
            }
        }
        Walk { streams, heads }
    }

    /// How many streams it merges (the streams of a walk merged in with
    /// [`Walk::with`] come after these).
    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    /// Merges another walk's streams in.
    pub fn with(mut self, other: Walk<'a>) -> Walk<'a> {
        let base = self.streams.len();
        for std::cmp::Reverse((k, id, i)) in other.heads {
            self.heads.push(std::cmp::Reverse((k, id, base + i)));
        }
        self.streams.extend(other.streams);
        self
    }
}

/// Agent ids, best first, each with the stream it came from.
impl<'a> Iterator for Walk<'a> {
    type Item = (&'a str, usize);

    fn next(&mut self) -> Option<(&'a str, usize)> {
        let std::cmp::Reverse((_, id, i)) = self.heads.pop()?;
        if let Some((k, next)) = self.streams.get_mut(i).and_then(|s| s.next()) {
            self.heads.push(std::cmp::Reverse((k, next, i)));
        }
        Some((id, i))
    }
}

/// The index: every agent that takes tasks, its entry, the groups and the
/// totals.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Capacity {
    entries: HashMap<AgentId, Entry>,
    groups: ClassGroups,
    /// The agents of each attribute value ([`attr_key`]).
    by_attr: HashMap<(String, String), AttrGroups>,
    /// The LOST agents (frameworks hear of each once).
    lost: BTreeSet<AgentId>,
    totals: FreeTotals,
}

impl Capacity {
    pub fn build(state: &State) -> Capacity {
        let mut c = Capacity::default();
        for a in state.agents().values() {
            c.put(state, a);
        }
        c
    }

    /// Looks at these agents again (gone ones leave the index).
    pub fn refresh<'a>(&mut self, state: &State, agents: impl IntoIterator<Item = &'a String>) {
        for id in agents {
            self.drop_entry(id);
            if let Some(a) = state.agent(id) {
                self.put(state, a);
            }
        }
    }

    fn put(&mut self, state: &State, a: &AgentRecord) {
        if a.state == super::AgentState::Lost {
            self.lost.insert(a.info.id.clone());
        }
        if !a.accepts_tasks() {
            return;
        }
        let e = Entry::of(state, a);
        let key = (e.free_gpus, e.in_use);
        self.groups.insert(&e.class, key, &a.info.id);
        for attr in &e.attrs {
            let g = self.by_attr.entry(attr.clone()).or_default();
            g.groups.insert(&e.class, key, &a.info.id);
            g.agents += 1;
        }
        self.totals.add(&e);
        self.entries.insert(a.info.id.clone(), e);
    }

    fn drop_entry(&mut self, id: &str) {
        self.lost.remove(id);
        if let Some(e) = self.entries.remove(id) {
            let key = (e.free_gpus, e.in_use);
            self.groups.remove(&e.class, key, id);
            for attr in &e.attrs {
                if let Some(g) = self.by_attr.get_mut(attr) {
                    g.groups.remove(&e.class, key, id);
                    g.agents = g.agents.saturating_sub(1);
                    if g.agents == 0 {
                        self.by_attr.remove(attr);
                    }
                }
            }
            self.totals.remove(&e);
        }
    }

    pub fn totals(&self) -> FreeTotals {
        self.totals
    }

    /// The agents that are LOST.
    pub fn lost(&self) -> &BTreeSet<AgentId> {
        &self.lost
    }

    /// Whether some agent that takes tasks has GPUs of several kinds.
    pub fn has_mixed(&self) -> bool {
        self.groups.classes().any(|c| *c == GpuClass::Mixed)
    }

    pub fn class_of(&self, agent: &str) -> Option<&GpuClass> {
        self.entries.get(agent).map(|e| &e.class)
    }

    /// Agents with at least `n` free whole GPUs in the classes `usable`
    /// allows, best first under `policy`. With `constraints` (attribute to
    /// pattern), only the agents of the rarest value an exact pattern names
    /// (none when no agent has it); the rest of the constraints are the
    /// caller's to check.
    pub fn candidates<'a>(
        &'a self,
        n: u32,
        policy: PlacementPolicy,
        usable: impl Fn(&GpuClass) -> bool,
        constraints: &BTreeMap<String, String>,
    ) -> Walk<'a> {
        // Each exact pattern's agents (none: no agent has the value); the
        // fewest win.
        let narrowest = constraints
            .iter()
            .filter(|(k, _)| indexed(k))
            .filter_map(|(k, pattern)| exact(pattern).map(|v| self.by_attr.get(&attr_key(k, v))))
            .min_by_key(|g| g.map_or(0, |g| g.agents));
        match narrowest {
            None => self.groups.walk(n, policy, usable),
            Some(Some(g)) => g.groups.walk(n, policy, usable),
            Some(None) => Walk::merge(Vec::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn groups(entries: &[(&str, u32, u32)]) -> Groups {
        let mut g = Groups::default();
        for (id, f, u) in entries {
            g.insert((*f, *u), id);
        }
        g
    }

    #[test]
    fn walks_follow_the_placement_orders() {
        let g = groups(&[
            ("a", 8, 0),
            ("b", 2, 6),
            ("c", 2, 4),
            ("d", 1, 7),
            ("e", 2, 6),
        ]);
        let bundle: Vec<&str> = g
            .walk(2, PlacementPolicy::Bundle)
            .map(|(_, id)| id)
            .collect();
        // Fewest free first; among equals the most in use; then ids.
        assert_eq!(bundle, ["b", "e", "c", "a"]);
        let spread: Vec<&str> = g
            .walk(1, PlacementPolicy::Spread)
            .map(|(_, id)| id)
            .collect();
        assert_eq!(spread, ["a", "c", "b", "e", "d"]);
    }

    #[test]
    fn classes_merge_in_order() {
        let mut cg = ClassGroups::default();
        let a100 = GpuClass::Same {
            model: "A100".into(),
            memory_mib: 40960,
        };
        let h100 = GpuClass::Same {
            model: "H100".into(),
            memory_mib: 81920,
        };
        cg.insert(&a100, (3, 5), "a1");
        cg.insert(&a100, (1, 7), "a2");
        cg.insert(&h100, (3, 5), "a0");
        cg.insert(&h100, (2, 6), "h1");
        let all: Vec<&str> = cg
            .walk(1, PlacementPolicy::Bundle, |_| true)
            .map(|(id, _)| id)
            .collect();
        assert_eq!(all, ["a2", "h1", "a0", "a1"]);
        let only_h: Vec<&str> = cg
            .walk(1, PlacementPolicy::Bundle, |c| *c == h100)
            .map(|(id, _)| id)
            .collect();
        assert_eq!(only_h, ["h1", "a0"]);
        cg.remove(&h100, (2, 6), "h1");
        cg.remove(&h100, (3, 5), "a0");
        assert_eq!(cg.classes().count(), 1, "an empty class goes");
    }
}
