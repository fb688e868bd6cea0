//! An isolator for the executor's tests: it records what it was asked to
//! prepare and release, and refuses the tasks it is told to, without cgroups.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use gpuctl_core::types::{Resources, Runtime};

use super::{IsolationError, Isolator, Prepared, TaskDevices};

#[derive(Debug, Default)]
pub(crate) struct FakeIsolator {
    pub(crate) dev_root: PathBuf,
    /// Tasks whose `prepare` fails, with the reason.
    pub(crate) refuse: Mutex<BTreeMap<String, String>>,
    /// Tasks prepared and not released yet.
    pub(crate) held: Mutex<BTreeSet<String>>,
    /// Every `release` call, in order (it must be idempotent).
    pub(crate) released: Mutex<Vec<String>>,
}

impl Isolator for FakeIsolator {
    fn describe(&self) -> String {
        "fake isolation (tests)".into()
    }
    fn dev_root(&self) -> &Path {
        &self.dev_root
    }
    fn pids_max(&self) -> Option<u64> {
        None
    }
    fn prepare(
        &self,
        task_id: &str,
        _task: &TaskDevices,
        _resources: &Resources,
        _runtime: Runtime,
    ) -> Result<Prepared, IsolationError> {
        let refused = self.refuse.lock().map(|r| r.get(task_id).cloned());
        if let Ok(Some(why)) = refused {
            return Err(IsolationError::Config(why));
        }
        if let Ok(mut held) = self.held.lock() {
            held.insert(task_id.to_string());
        }
        Ok(Prepared::default())
    }
    fn remove_stale(&self, keep: &BTreeSet<String>) -> Result<usize, IsolationError> {
        let Ok(mut held) = self.held.lock() else {
            return Ok(0);
        };
        let before = held.len();
        held.retain(|t| keep.contains(t));
        Ok(before - held.len())
    }
    fn release(&self, task_id: &str) -> Result<(), IsolationError> {
        if let Ok(mut held) = self.held.lock() {
            held.remove(task_id);
        }
        if let Ok(mut r) = self.released.lock() {
            r.push(task_id.to_string());
        }
        Ok(())
    }
}
