//! The receiving end of the agent's task stream (WatchTasks): the desired
//! task set, rebuilt from the master's messages. PURE: plain data in, plain
//! data out.
//!
//! An agent keeps one [`DesiredSet`] per stream (a new one on every
//! WatchTasks call), [`apply`](DesiredSet::apply)s every message in order,
//! and acts on [`run`](DesiredSet::run) and [`kill`](DesiredSet::kill) only
//! when `apply` answers `true` (the message completed a snapshot or a batch
//! of differences). The protocol is described on `DesiredTasks` in
//! `proto/gpuctl/v1/agent.proto`.
//!
//! A master that predates incremental streams sends the full set in every
//! message and never sets `reset`: when the first message of a stream has
//! no `reset`, every message is read as the full set, complete.

use std::collections::{BTreeMap, BTreeSet};

use crate::convert::ConvertError;
use crate::pb;
use crate::types::{StopNotice, TaskId, TaskSpec};

/// A message of the task stream that cannot be applied. The set is left
/// as it was.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DesiredError {
    #[error("the master sent an invalid task {task_id:?}: {source}")]
    InvalidTask {
        task_id: String,
        #[source]
        source: ConvertError,
    },
}

/// How the master streams, as learnt from the stream's first message.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Mode {
    /// No message yet.
    #[default]
    Unknown,
    /// Snapshot, then differences.
    Incremental,
    /// Every message is the full set (masters before incremental streams).
    Full,
}

/// The master's wish for an agent: tasks to run and tasks to stop. The
/// agent's executor acts on it; [`DesiredSet`] rebuilds it from the stream.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Desired {
    pub run: BTreeMap<TaskId, TaskSpec>,
    pub kill: BTreeSet<TaskId>,
    /// Why, for tasks of `kill` the master said why (once, with the kill).
    pub notices: BTreeMap<TaskId, StopNotice>,
}

/// The [`Desired`] set as the task stream builds it, message by message.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DesiredSet {
    set: Desired,
    mode: Mode,
}

impl DesiredSet {
    /// An empty set, for a new stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one message of the stream. `Ok(true)`: the message completed
    /// a snapshot or a batch, the set is the master's desired set and the
    /// agent may act on it; `Ok(false)`: more messages of the batch follow.
    /// On an error (a task spec that does not convert) nothing is changed.
    pub fn apply(&mut self, msg: &pb::DesiredTasks) -> Result<bool, DesiredError> {
        self.apply_owned(msg.clone())
    }

    /// [`apply`](Self::apply), taking the message (no copy of its specs).
    pub fn apply_owned(&mut self, msg: pb::DesiredTasks) -> Result<bool, DesiredError> {
        // Convert every spec first, so that an error changes nothing.
        let mut specs = Vec::with_capacity(msg.tasks.len());
        for t in msg.tasks {
            let task_id = t.task_id.clone();
            let spec = TaskSpec::try_from(t)
                .map_err(|source| DesiredError::InvalidTask { task_id, source })?;
            specs.push(spec);
        }
        if self.mode == Mode::Unknown {
            self.mode = if msg.reset {
                Mode::Incremental
            } else {
                Mode::Full
            };
        }
        let full = self.mode == Mode::Full;
        if msg.reset || full {
            self.set.run.clear();
            self.set.kill.clear();
            // A reset's kills come with their notices again.
            self.set.notices.clear();
        }
        for spec in specs {
            self.set.kill.remove(&spec.task_id);
            self.set.notices.remove(&spec.task_id);
            self.set.run.insert(spec.task_id.clone(), spec);
        }
        let mut notices = msg.kill_notices;
        for id in msg.kill {
            self.set.run.remove(&id);
            if let Some(n) = notices.remove(&id) {
                self.set.notices.insert(
                    id.clone(),
                    StopNotice {
                        kind: n.kind,
                        message: n.message,
                    },
                );
            }
            self.set.kill.insert(id);
        }
        for id in &msg.removed {
            self.set.run.remove(id);
            self.set.kill.remove(id);
            self.set.notices.remove(id);
        }
        Ok(msg.complete || full)
    }

    /// Tasks to run, by id.
    pub fn run(&self) -> &BTreeMap<TaskId, TaskSpec> {
        &self.set.run
    }

    /// Tasks to kill.
    pub fn kill(&self) -> &BTreeSet<TaskId> {
        &self.set.kill
    }

    /// Why the master wants tasks of [`kill`](Self::kill) stopped, for
    /// those it said.
    pub fn notices(&self) -> &BTreeMap<TaskId, StopNotice> {
        &self.set.notices
    }

    /// The whole set, as the agent's executor takes it.
    pub fn desired(&self) -> &Desired {
        &self.set
    }

    /// The tasks to run, in id order (a copy, e.g. for an executor's
    /// reconcile).
    pub fn tasks(&self) -> Vec<TaskSpec> {
        self.set.run.values().cloned().collect()
    }

    /// The ids to kill, in order (a copy).
    #[cfg(test)]
    pub fn kill_ids(&self) -> Vec<TaskId> {
        self.set.kill.iter().cloned().collect()
    }

    /// Whether the master sends the full set in every message (a master
    /// that predates incremental streams). False before the first message.
    #[cfg(test)]
    pub fn is_full_mode(&self) -> bool {
        self.mode == Mode::Full
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(id: &str, arg: &str) -> pb::TaskSpec {
        pb::TaskSpec {
            task_id: id.into(),
            job_id: "job-1".into(),
            command: vec!["echo".into(), arg.into()],
            ..Default::default()
        }
    }

    fn ids(s: &DesiredSet) -> (Vec<&str>, Vec<&str>) {
        (
            s.run().keys().map(String::as_str).collect(),
            s.kill().iter().map(String::as_str).collect(),
        )
    }

    fn msg(tasks: Vec<pb::TaskSpec>, kill: &[&str], removed: &[&str]) -> pb::DesiredTasks {
        pb::DesiredTasks {
            tasks,
            kill: kill.iter().map(|s| s.to_string()).collect(),
            removed: removed.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn kill_notices_come_with_their_kill_and_go_with_it() {
        let mut s = DesiredSet::new();
        let mut m = msg(vec![spec("a", "1")], &["k", "j"], &[]);
        m.reset = true;
        m.complete = true;
        m.kill_notices.insert(
            "k".into(),
            pb::StopNotice {
                kind: "preempted".into(),
                message: "preempted by job-7 (priority 5)".into(),
            },
        );
        // A notice for an id not killed in the message is ignored.
        m.kill_notices.insert("a".into(), pb::StopNotice::default());
        assert!(s.apply(&m).unwrap());
        let want = StopNotice {
            kind: "preempted".into(),
            message: "preempted by job-7 (priority 5)".into(),
        };
        assert_eq!(s.notices().get("k"), Some(&want));
        assert_eq!(s.notices().len(), 1, "j has none, a is not killed");
        // Wanted again: no notice; removed: gone.
        let mut m = msg(vec![spec("k", "1")], &[], &[]);
        m.complete = true;
        assert!(s.apply(&m).unwrap());
        assert!(s.notices().is_empty());
    }

    #[test]
    fn snapshot_in_parts_then_differences() {
        let mut s = DesiredSet::new();
        let mut first = msg(vec![spec("a", "1")], &[], &[]);
        first.reset = true;
        assert!(!s.apply(&first).unwrap(), "not complete yet");
        let mut last = msg(vec![spec("b", "1")], &["k"], &[]);
        last.complete = true;
        assert!(s.apply(&last).unwrap());
        assert_eq!(ids(&s), (vec!["a", "b"], vec!["k"]));
        assert!(!s.is_full_mode());

        // A batch: a changes, b is killed, k is gone, c is new.
        assert!(!s.apply(&msg(vec![spec("a", "2")], &["b"], &[])).unwrap());
        let mut end = msg(vec![spec("c", "1")], &[], &["k"]);
        end.complete = true;
        assert!(s.apply(&end).unwrap());
        assert_eq!(ids(&s), (vec!["a", "c"], vec!["b"]));
        assert_eq!(s.run()["a"].template.command[1], "2");

        // A killed task wanted again; a removed one leaves both sets.
        let mut back = msg(vec![spec("b", "1")], &[], &["c"]);
        back.complete = true;
        assert!(s.apply(&back).unwrap());
        assert_eq!(ids(&s), (vec!["a", "b"], vec![]));
        assert_eq!(s.tasks().len(), 2);
        assert!(s.kill_ids().is_empty());

        // A reset later starts over.
        let mut again = msg(vec![spec("z", "1")], &[], &[]);
        again.reset = true;
        again.complete = true;
        assert!(s.apply(&again).unwrap());
        assert_eq!(ids(&s), (vec!["z"], vec![]));
    }

    #[test]
    fn an_old_master_sends_full_sets() {
        let mut s = DesiredSet::new();
        assert!(s
            .apply(&msg(vec![spec("a", "1"), spec("b", "1")], &["k"], &[]))
            .unwrap());
        assert!(s.is_full_mode());
        assert!(s.apply(&msg(vec![spec("b", "1")], &[], &[])).unwrap());
        assert_eq!(ids(&s), (vec!["b"], vec![]));
    }

    #[test]
    fn an_invalid_spec_changes_nothing() {
        let mut s = DesiredSet::new();
        let mut first = msg(vec![spec("a", "1")], &["k"], &[]);
        first.reset = true;
        first.complete = true;
        s.apply(&first).unwrap();
        let before = s.clone();
        let mut bad = spec("b", "1");
        bad.command.clear();
        let err = s
            .apply(&msg(vec![spec("c", "1"), bad], &["a"], &["k"]))
            .unwrap_err();
        assert!(matches!(&err, DesiredError::InvalidTask { task_id, source }
            if task_id == "b" && source.field == "task.command"));
        assert_eq!(s, before);
    }

    #[test]
    fn an_empty_snapshot_is_complete() {
        let mut s = DesiredSet::new();
        let m = pb::DesiredTasks {
            reset: true,
            complete: true,
            ..Default::default()
        };
        assert!(s.apply(&m).unwrap());
        assert_eq!(ids(&s), (vec![], vec![]));
        assert!(!s.is_full_mode());
    }
}
