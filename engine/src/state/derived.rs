//! Indexes derived from the state, never serialized (a snapshot is the
//! plain tables; they are built again on first use) and ignored by
//! equality: free capacity by agent ([`Capacity`]) and the queue in
//! placement order ([`QueueIndex`]). After each applied command the state
//! refreshes them from the tables' notes of what changed ([`super::tables::Dirty`]), so their cost follows
//! what changed. A state changed outside `apply` (tests) has notes not yet
//! refreshed: readers then get a copy built afresh, never a stale index.

use std::collections::{BTreeSet, HashMap};
use std::sync::OnceLock;

use gpuctl_core::types::JobId;

use super::capacity::Capacity;
use super::{waits, JobRecord, State};

#[derive(Debug, Default)]
pub struct Derived {
    pub capacity: OnceLock<Capacity>,
    pub queue: OnceLock<QueueIndex>,
}

/// A copy of the state starts without them: they are built on its first
/// read, by whoever reads it, so that the copy itself (taken under the
/// state's lock, which the Raft loop waits for) stays cheap.
impl Clone for Derived {
    fn clone(&self) -> Derived {
        Derived::default()
    }
}

impl PartialEq for Derived {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// Where a waiting job stands in the queue: highest priority first, then
/// oldest, then by sequence number.
pub type QueueKey = (std::cmp::Reverse<i32>, u64, u64);

pub fn queue_key(j: &JobRecord) -> QueueKey {
    (
        std::cmp::Reverse(j.spec.priority),
        j.submitted_at_ms,
        super::job_seq(&j.id),
    )
}

/// The jobs that wait for placement, in placement order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QueueIndex {
    keys: HashMap<JobId, QueueKey>,
    order: BTreeSet<(QueueKey, JobId)>,
}

impl QueueIndex {
    pub fn build(state: &State) -> QueueIndex {
        let mut q = QueueIndex::default();
        for j in state.jobs().values() {
            q.put(j);
        }
        q
    }

    pub fn refresh<'a>(&mut self, state: &State, jobs: impl IntoIterator<Item = &'a String>) {
        for id in jobs {
            if let Some(k) = self.keys.remove(id) {
                self.order.remove(&(k, id.clone()));
            }
            if let Some(j) = state.job(id) {
                self.put(j);
            }
        }
    }

    fn put(&mut self, j: &JobRecord) {
        if waits(&j) {
            let k = queue_key(j);
            self.keys.insert(j.id.clone(), k);
            self.order.insert((k, j.id.clone()));
        }
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn ids(&self) -> impl Iterator<Item = &JobId> + '_ {
        self.order.iter().map(|(_, id)| id)
    }
}

impl State {
    /// The capacity index, up to date.
    pub fn capacity(&self) -> std::borrow::Cow<'_, Capacity> {
        if self.derived_clean() {
            std::borrow::Cow::Borrowed(self.derived.capacity.get_or_init(|| Capacity::build(self)))
        } else {
            std::borrow::Cow::Owned(Capacity::build(self))
        }
    }

    /// The queue's index, up to date.
    pub fn queue_index(&self) -> std::borrow::Cow<'_, QueueIndex> {
        if self.derived_clean() {
            std::borrow::Cow::Borrowed(self.derived.queue.get_or_init(|| QueueIndex::build(self)))
        } else {
            std::borrow::Cow::Owned(QueueIndex::build(self))
        }
    }

    fn derived_clean(&self) -> bool {
        self.agents.is_clean() && self.tasks.is_clean() && self.jobs.is_clean()
    }

    /// Brings the indexes up to date with what the last command changed
    /// (an index not built yet is built when first read).
    pub(super) fn refresh_derived(&mut self) {
        let mut agents = self.agents.take_dirty();
        agents.merge(self.tasks.take_dirty());
        let jobs = self.jobs.take_dirty();
        if let Some(mut c) = self.derived.capacity.take() {
            if agents.all {
                c = Capacity::build(self);
            } else {
                c.refresh(self, &agents.ids);
            }
            let _ = self.derived.capacity.set(c);
        }
        if let Some(mut q) = self.derived.queue.take() {
            if jobs.all {
                q = QueueIndex::build(self);
            } else {
                q.refresh(self, &jobs.ids);
            }
            let _ = self.derived.queue.set(q);
        }
    }
}
