//! The state's tasks and agents, each with the indexes that keep the
//! per-agent and per-GPU questions from walking the whole cluster. The
//! indexes are derived: not serialized (a snapshot is the plain maps), built
//! again when a snapshot is read, and ignored by equality.
//!
//! Reads go through `Deref` to the map. Changes go through the methods
//! here, which keep the indexes right and note which agents' desired task
//! sets may have changed ([`Touched`]), so that the leader wakes only those
//! agents' task streams.

use std::collections::{BTreeSet, HashSet};

use imbl::{HashMap as PHashMap, OrdMap, OrdSet};
use std::ops::Deref;

use gpuctl_core::types::{AgentId, GpuUuid, JobId, TaskId};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{AgentRecord, JobRecord, TaskRecord};

/// Agents whose desired task set may have changed since the last
/// [`State::take_touched`](super::State::take_touched).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Touched {
    /// Every agent (a change that reaches beyond one agent's tasks).
    pub all: bool,
    pub agents: BTreeSet<AgentId>,
}

impl Touched {
    pub fn is_empty(&self) -> bool {
        !self.all && self.agents.is_empty()
    }

    /// Whether `agent` may have to hear of a change.
    pub fn contains(&self, agent: &str) -> bool {
        self.all || self.agents.contains(agent)
    }
}

/// Ids whose derived indexes (`state::capacity`, the queue) are out of
/// date: the state refreshes them after each applied command, so that work
/// follows what changed, not the size of the cluster.
#[derive(Debug, Clone, Default)]
pub struct Dirty {
    /// Every id.
    pub all: bool,
    pub ids: HashSet<String>,
}

impl Dirty {
    fn everything() -> Dirty {
        Dirty {
            all: true,
            ids: HashSet::new(),
        }
    }

    pub fn mark(&mut self, id: &str) {
        if !self.all && !self.ids.contains(id) {
            self.ids.insert(id.to_string());
        }
    }

    pub fn mark_all(&mut self) {
        self.all = true;
        self.ids.clear();
    }

    pub fn is_clean(&self) -> bool {
        !self.all && self.ids.is_empty()
    }

    /// Adds `other`'s ids.
    pub fn merge(&mut self, other: Dirty) {
        if other.all {
            self.mark_all();
        } else if !self.all {
            self.ids.extend(other.ids);
        }
    }
}

/// Every task by id, and the ids of each agent's tasks. A task's
/// `agent_id` never changes once it is inserted.
#[derive(Debug, Clone, Default)]
pub struct TaskTable {
    map: OrdMap<TaskId, TaskRecord>,
    // (Small std sets inside a persistent map: an `OrdSet` allocates a
    // whole B-tree node even for one id.)
    by_agent: PHashMap<AgentId, BTreeSet<TaskId>>,
    /// The tasks of frameworks other than gpuctl's jobs (`framework_id`
    /// set), which the framework loop follows: it looks at these, not at
    /// every task.
    of_frameworks: OrdSet<TaskId>,
    touched: Touched,
    /// Agents whose tasks changed, for the derived indexes.
    dirty: Dirty,
}

impl TaskTable {
    fn from_map(map: OrdMap<TaskId, TaskRecord>) -> TaskTable {
        let mut by_agent: PHashMap<AgentId, BTreeSet<TaskId>> = PHashMap::new();
        let mut of_frameworks = OrdSet::new();
        for t in map.values() {
            by_agent
                .entry(t.agent_id.clone())
                .or_default()
                .insert(t.id.clone());
            if !t.framework_id.is_empty() {
                of_frameworks.insert(t.id.clone());
            }
        }
        TaskTable {
            map,
            by_agent,
            of_frameworks,
            // Whoever reads a state built from a snapshot starts afresh.
            touched: Touched {
                all: true,
                agents: BTreeSet::new(),
            },
            dirty: Dirty::everything(),
        }
    }

    /// A task to change; its agent is told.
    pub fn get_mut(&mut self, id: &str) -> Option<&mut TaskRecord> {
        let t = self.map.get_mut(id)?;
        if !self.touched.all {
            self.touched.agents.insert(t.agent_id.clone());
        }
        self.dirty.mark(&t.agent_id);
        Some(t)
    }

    /// Changes every task that `which` picks; their agents are told.
    pub fn update_where(
        &mut self,
        which: impl Fn(&TaskRecord) -> bool,
        mut change: impl FnMut(&mut TaskRecord),
    ) {
        // (A persistent map has no `values_mut`: the picked ids first.)
        let picked: Vec<TaskId> = self
            .map
            .values()
            .filter(|t| which(t))
            .map(|t| t.id.clone())
            .collect();
        for id in picked {
            let Some(t) = self.map.get_mut(&id) else {
                continue;
            };
            change(t);
            let agent = t.agent_id.clone();
            self.touch(&agent);
        }
    }

    /// Changes the tasks on `agent` that `which` picks.
    pub fn update_on(
        &mut self,
        agent: &str,
        which: impl Fn(&TaskRecord) -> bool,
        mut change: impl FnMut(&mut TaskRecord),
    ) {
        let Some(ids) = self.by_agent.get(agent) else {
            return;
        };
        let mut changed = false;
        for id in ids {
            if let Some(t) = self.map.get_mut(id).filter(|t| which(t)) {
                change(t);
                changed = true;
            }
        }
        if changed {
            self.touch(agent);
        }
    }

    pub fn insert(&mut self, id: TaskId, task: TaskRecord) {
        debug_assert_eq!(id, task.id);
        let agent = task.agent_id.clone();
        if task.framework_id.is_empty() {
            self.of_frameworks.remove(&id);
        } else {
            self.of_frameworks.insert(id.clone());
        }
        if let Some(old) = self.map.insert(id.clone(), task) {
            if old.agent_id != agent {
                self.unindex(&old.agent_id, &id);
                self.touch(&old.agent_id);
            }
        }
        self.by_agent.entry(agent.clone()).or_default().insert(id);
        self.touch(&agent);
    }

    pub fn remove(&mut self, id: &str) -> Option<TaskRecord> {
        let t = self.map.remove(id)?;
        self.of_frameworks.remove(id);
        self.unindex(&t.agent_id, id);
        self.touch(&t.agent_id);
        Some(t)
    }

    /// The ids of the tasks placed on `agent`, in id order.
    pub fn ids_on(&self, agent: &str) -> impl Iterator<Item = &TaskId> + '_ {
        self.by_agent.get(agent).into_iter().flatten()
    }

    /// The tasks placed on `agent`, in id order.
    pub fn on(&self, agent: &str) -> impl Iterator<Item = &TaskRecord> + '_ {
        self.ids_on(agent).filter_map(|id| self.map.get(id))
    }

    /// The tasks of frameworks (not of gpuctl's jobs), in id order.
    pub fn of_frameworks(&self) -> impl Iterator<Item = &TaskRecord> + '_ {
        self.of_frameworks.iter().filter_map(|id| self.map.get(id))
    }

    /// Every agent may have to hear of a change.
    pub fn touch_all(&mut self) {
        self.touched.all = true;
        self.touched.agents.clear();
        self.dirty.mark_all();
    }

    /// Agents whose tasks changed since the last call.
    pub fn take_dirty(&mut self) -> Dirty {
        std::mem::take(&mut self.dirty)
    }

    pub fn is_clean(&self) -> bool {
        self.dirty.is_clean()
    }

    pub fn take_touched(&mut self) -> Touched {
        std::mem::take(&mut self.touched)
    }

    /// Whether the index says what the tasks say (for tests' invariants).
    #[cfg(any(test, feature = "testkit"))]
    pub fn index_agrees(&self) -> bool {
        let mut want: PHashMap<AgentId, BTreeSet<TaskId>> = PHashMap::new();
        for t in self.map.values() {
            want.entry(t.agent_id.clone())
                .or_default()
                .insert(t.id.clone());
        }
        let frameworks: OrdSet<TaskId> = self
            .map
            .values()
            .filter(|t| !t.framework_id.is_empty())
            .map(|t| t.id.clone())
            .collect();
        want == self.by_agent && frameworks == self.of_frameworks
    }

    fn touch(&mut self, agent: &str) {
        if !self.touched.all && !self.touched.agents.contains(agent) {
            self.touched.agents.insert(agent.to_string());
        }
        self.dirty.mark(agent);
    }

    fn unindex(&mut self, agent: &str, id: &str) {
        if let Some(ids) = self.by_agent.get_mut(agent) {
            ids.remove(id);
            if ids.is_empty() {
                self.by_agent.remove(agent);
            }
        }
    }
}

impl Deref for TaskTable {
    type Target = OrdMap<TaskId, TaskRecord>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl<'a> IntoIterator for &'a TaskTable {
    type Item = (&'a TaskId, &'a TaskRecord);
    type IntoIter = imbl::ordmap::Iter<'a, TaskId, TaskRecord, imbl::shared_ptr::DefaultSharedPtr>;
    fn into_iter(self) -> Self::IntoIter {
        self.map.iter()
    }
}

/// Equal when the tasks are: the rest is derived from them.
impl PartialEq for TaskTable {
    fn eq(&self, other: &Self) -> bool {
        self.map == other.map
    }
}

impl Serialize for TaskTable {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.map.serialize(s)
    }
}

impl<'de> Deserialize<'de> for TaskTable {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        OrdMap::deserialize(d).map(TaskTable::from_map)
    }
}

/// Every agent by id, and which agents claim each GPU. An agent's `info`
/// changes only through [`AgentTable::insert`]; other fields through
/// [`AgentTable::get_mut`].
#[derive(Debug, Clone, Default)]
pub struct AgentTable {
    map: OrdMap<AgentId, AgentRecord>,
    /// Usually one agent per GPU; a LOST agent's GPUs may be claimed again
    /// by the agent that replaced it.
    by_gpu: PHashMap<GpuUuid, BTreeSet<AgentId>>,
    /// Agents changed, for the derived indexes.
    dirty: Dirty,
}

impl AgentTable {
    fn from_map(map: OrdMap<AgentId, AgentRecord>) -> AgentTable {
        let mut t = AgentTable {
            map: OrdMap::new(),
            by_gpu: PHashMap::new(),
            dirty: Dirty::everything(),
        };
        for (id, a) in map {
            t.insert(id, a);
        }
        t
    }

    /// Agents changed since the last call.
    pub fn take_dirty(&mut self) -> Dirty {
        std::mem::take(&mut self.dirty)
    }

    pub fn is_clean(&self) -> bool {
        self.dirty.is_clean()
    }

    /// Something about this GPU changed outside the agent's record (a
    /// cordon, a share mode, a MIG change): its agents' capacity did.
    pub fn mark_gpu(&mut self, gpu: &str) {
        for id in self.by_gpu.get(gpu).into_iter().flatten() {
            self.dirty.mark(id);
        }
    }

    /// Adds or replaces an agent's record (its GPUs with it).
    pub fn insert(&mut self, id: AgentId, agent: AgentRecord) {
        debug_assert_eq!(id, agent.info.id);
        self.dirty.mark(&id);
        for g in &agent.info.gpus {
            self.by_gpu
                .entry(g.uuid.clone())
                .or_default()
                .insert(id.clone());
        }
        if let Some(old) = self.map.insert(id.clone(), agent) {
            let now: BTreeSet<&str> = self.map[&id]
                .info
                .gpus
                .iter()
                .map(|g| g.uuid.as_str())
                .collect();
            for g in old
                .info
                .gpus
                .iter()
                .filter(|g| !now.contains(g.uuid.as_str()))
            {
                if let Some(ids) = self.by_gpu.get_mut(&g.uuid) {
                    ids.remove(&id);
                    if ids.is_empty() {
                        self.by_gpu.remove(&g.uuid);
                    }
                }
            }
        }
    }

    /// An agent's record to change, but not its `info` (see the type).
    pub fn get_mut(&mut self, id: &str) -> Option<&mut AgentRecord> {
        let a = self.map.get_mut(id)?;
        self.dirty.mark(id);
        Some(a)
    }

    /// Whether the index says what the agents say (for tests' invariants).
    #[cfg(any(test, feature = "testkit"))]
    pub fn index_agrees(&self) -> bool {
        let mut want: PHashMap<GpuUuid, BTreeSet<AgentId>> = PHashMap::new();
        for a in self.map.values() {
            for g in &a.info.gpus {
                want.entry(g.uuid.clone())
                    .or_default()
                    .insert(a.info.id.clone());
            }
        }
        want == self.by_gpu
    }

    /// The agents whose `info` lists this GPU.
    pub fn claiming(&self, gpu: &str) -> impl Iterator<Item = &AgentRecord> + '_ {
        self.by_gpu
            .get(gpu)
            .into_iter()
            .flatten()
            .filter_map(|id| self.map.get(id))
    }
}

impl Deref for AgentTable {
    type Target = OrdMap<AgentId, AgentRecord>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl<'a> IntoIterator for &'a AgentTable {
    type Item = (&'a AgentId, &'a AgentRecord);
    type IntoIter =
        imbl::ordmap::Iter<'a, AgentId, AgentRecord, imbl::shared_ptr::DefaultSharedPtr>;
    fn into_iter(self) -> Self::IntoIter {
        self.map.iter()
    }
}

/// Equal when the agents are: the rest is derived from them.
impl PartialEq for AgentTable {
    fn eq(&self, other: &Self) -> bool {
        self.map == other.map
    }
}

impl Serialize for AgentTable {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.map.serialize(s)
    }
}

impl<'de> Deserialize<'de> for AgentTable {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        OrdMap::deserialize(d).map(AgentTable::from_map)
    }
}

/// Every job by id. Changes go through [`JobTable::get_mut`],
/// [`JobTable::insert`] and [`JobTable::remove`], which note the job for the
/// queue's index.
#[derive(Debug, Clone, Default)]
pub struct JobTable {
    map: OrdMap<JobId, JobRecord>,
    dirty: Dirty,
}

impl JobTable {
    pub fn get_mut(&mut self, id: &str) -> Option<&mut JobRecord> {
        let j = self.map.get_mut(id)?;
        self.dirty.mark(id);
        Some(j)
    }

    pub fn insert(&mut self, id: JobId, job: JobRecord) -> Option<JobRecord> {
        self.dirty.mark(&id);
        self.map.insert(id, job)
    }

    pub fn remove(&mut self, id: &str) -> Option<JobRecord> {
        self.dirty.mark(id);
        self.map.remove(id)
    }

    /// Jobs changed since the last call.
    pub fn take_dirty(&mut self) -> Dirty {
        std::mem::take(&mut self.dirty)
    }

    pub fn is_clean(&self) -> bool {
        self.dirty.is_clean()
    }
}

impl Deref for JobTable {
    type Target = OrdMap<JobId, JobRecord>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl<'a> IntoIterator for &'a JobTable {
    type Item = (&'a JobId, &'a JobRecord);
    type IntoIter = imbl::ordmap::Iter<'a, JobId, JobRecord, imbl::shared_ptr::DefaultSharedPtr>;
    fn into_iter(self) -> Self::IntoIter {
        self.map.iter()
    }
}

/// Equal when the jobs are.
impl PartialEq for JobTable {
    fn eq(&self, other: &Self) -> bool {
        self.map == other.map
    }
}

impl Serialize for JobTable {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.map.serialize(s)
    }
}

impl<'de> Deserialize<'de> for JobTable {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        OrdMap::deserialize(d).map(|map| JobTable {
            map,
            dirty: Dirty::everything(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{AgentState, TaskState};
    use gpuctl_core::types::{AgentInfo, GpuInfo, Resources};
    use std::collections::BTreeMap;

    fn task(id: &str, agent: &str) -> TaskRecord {
        TaskRecord {
            id: id.into(),
            job_id: "job-1".into(),
            agent_id: agent.into(),
            gpu_uuids: vec![],
            resources: Resources::default(),
            state: TaskState::Running,
            exit_code: None,
            message: String::new(),
            kill_requested: false,
            created_at_ms: 0,
            updated_at_ms: 0,
            framework_id: String::new(),
            framework_task_id: String::new(),
            launch: None,
            reason: Default::default(),
            last_update_uuid: vec![],
            acked_uuid: vec![],
            rank: 0,
            before_unreachable: None,
            holding: false,
            released: false,
            ports: Vec::new(),
            fraction: None,
            enforcement: None,
            gpu_sampled_ms: 0,
            gpu_busy_ms: 0,
            quiet: None,
            running_at_ms: None,
            health: None,
        }
    }

    fn agent(id: &str, gpus: &[&str]) -> AgentRecord {
        AgentRecord {
            info: AgentInfo {
                share_gpus: None,
                allowed_users: None,
                id: id.into(),
                hostname: id.into(),
                address: String::new(),
                total: Resources::default(),
                gpus: gpus
                    .iter()
                    .enumerate()
                    .map(|(i, u)| GpuInfo::new(u.to_string(), i as u32, "A100", 40960))
                    .collect(),
                runtimes: vec![],
                simulated_gpus: true,
                attributes: BTreeMap::new(),
                driver_version: None,
                cuda_driver_version: None,
                allow_root_tasks: false,
                allowed_mounts: Vec::new(),
                ports: None,
            },
            state: AgentState::Active,
            registered_at_ms: 0,
            allocated: Resources::default(),
            unreachable_since_ms: None,
            drain: None,
        }
    }

    #[test]
    fn tasks_are_indexed_by_agent_and_changes_touch_their_agent() {
        let mut t = TaskTable::default();
        t.insert("j.0".into(), task("j.0", "a"));
        t.insert("j.1".into(), task("j.1", "b"));
        t.insert("j.2".into(), task("j.2", "a"));
        let touched = t.take_touched();
        assert_eq!(touched.agents, ["a".to_string(), "b".to_string()].into());
        assert!(!touched.all);
        assert!(t.take_touched().is_empty(), "taken");
        let on_a: Vec<&str> = t.on("a").map(|t| t.id.as_str()).collect();
        assert_eq!(on_a, ["j.0", "j.2"]);
        // Reading does not touch; changing does.
        assert!(t.get("j.1").is_some());
        assert!(t.take_touched().is_empty());
        t.get_mut("j.1").unwrap().kill_requested = true;
        assert_eq!(t.take_touched().agents, ["b".to_string()].into());
        assert!(t.remove("j.0").is_some());
        assert_eq!(t.take_touched().agents, ["a".to_string()].into());
        assert_eq!(t.ids_on("a").collect::<Vec<_>>(), ["j.2"]);
        assert!(t.remove("j.2").is_some());
        assert_eq!(t.ids_on("a").count(), 0);
        assert!(!t.by_agent.contains_key("a"), "no empty sets left behind");
        t.touch_all();
        t.get_mut("j.1").unwrap().kill_requested = false;
        let touched = t.take_touched();
        assert!(touched.all && touched.contains("anyone"));
    }

    #[test]
    fn a_table_read_from_a_snapshot_has_its_index_and_touches_everyone() {
        let mut t = TaskTable::default();
        t.insert("j.0".into(), task("j.0", "a"));
        t.insert("k.0".into(), task("k.0", "b"));
        let json = serde_json::to_string(&t).unwrap();
        let plain: BTreeMap<TaskId, TaskRecord> = serde_json::from_str(&json).unwrap();
        assert_eq!(plain.len(), 2, "the snapshot is the plain map");
        let mut back: TaskTable = serde_json::from_str(&json).unwrap();
        assert_eq!(back, t);
        assert_eq!(back.on("b").count(), 1);
        assert!(back.take_touched().all);
    }

    #[test]
    fn agents_are_indexed_by_gpu_through_every_change_of_their_gpus() {
        let mut t = AgentTable::default();
        t.insert("a".into(), agent("a", &["GPU-1", "GPU-2"]));
        t.insert("b".into(), agent("b", &["GPU-2"]));
        let ids = |t: &AgentTable, g: &str| -> Vec<String> {
            t.claiming(g).map(|a| a.info.id.clone()).collect()
        };
        assert_eq!(ids(&t, "GPU-2"), ["a", "b"]);
        // a comes back without GPU-2 and with GPU-3.
        t.insert("a".into(), agent("a", &["GPU-1", "GPU-3"]));
        assert_eq!(ids(&t, "GPU-2"), ["b"]);
        assert_eq!(ids(&t, "GPU-3"), ["a"]);
        assert_eq!(ids(&t, "GPU-1"), ["a"]);
        let back: AgentTable = serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
        assert_eq!(back, t);
        assert_eq!(ids(&back, "GPU-3"), ["a"]);
        assert!(ids(&back, "GPU-9").is_empty());
    }
}
