//! The sending end of an agent's incremental task stream (WatchTasks with
//! `incremental`): a snapshot, then only the differences, in messages of
//! bounded size. PURE: no I/O, no clock. The receiving end is
//! `gpuctl_core::desired::DesiredSet`; the protocol is described on
//! `DesiredTasks` in `proto/gpuctl/v1/agent.proto`.

use std::collections::BTreeSet;

use gpuctl_core::types::{StopNotice, TaskId, TaskSpec};
use gpuctl_proto::pb;
use prost::encoding::{encoded_len_varint, key_len};

/// Most bytes of one encoded message (a quarter of gRPC's default 4 MiB
/// limit). A task spec is at most about 600 KiB within the limits of
/// `gpuctl_core::convert`; one bigger than this would be sent alone.
pub const MESSAGE_BUDGET: usize = 1024 * 1024;

/// `reset` and `complete`, when set: one key byte and one value byte each.
const FLAG_BYTES: usize = 4;

/// One change of the receiver's sets, as it goes on the wire.
enum Item {
    Run(Box<pb::TaskSpec>),
    /// With why, when the master knows.
    Kill(TaskId, Option<pb::StopNotice>),
    Removed(TaskId),
}

impl Item {
    /// Bytes it adds to a `DesiredTasks` message (its field, tag included).
    fn encoded_len(&self) -> usize {
        match self {
            Item::Run(t) => field_len(1, prost::Message::encoded_len(t.as_ref())),
            Item::Kill(id, notice) => {
                field_len(2, id.len())
                    + notice.as_ref().map_or(0, |n| {
                        // A map entry: key 1 (the id), value 2 (the notice).
                        let entry =
                            field_len(1, id.len()) + field_len(2, prost::Message::encoded_len(n));
                        field_len(6, entry)
                    })
            }
            Item::Removed(id) => field_len(5, id.len()),
        }
    }
}

/// Bytes a length-delimited field `tag` of `len` bytes adds to a message.
fn field_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

/// One stream's sender: remembers which tasks the receiver holds.
///
/// A task's spec is sent once, when it enters the run set: the agent starts
/// a task from the first spec it gets and ignores later ones, so the specs
/// of tasks already sent are neither built nor compared again (a change of
/// one, such as a gang peer's new hostname, reaches an agent that
/// reconnects, in its snapshot).
#[derive(Debug)]
pub struct TaskStream {
    budget: usize,
    /// The run and kill sets the receiver holds after the messages
    /// returned so far; `None` before the snapshot.
    sent: Option<(BTreeSet<TaskId>, BTreeSet<TaskId>)>,
}

impl TaskStream {
    pub fn new(budget: usize) -> Self {
        TaskStream { budget, sent: None }
    }

    /// [`TaskStream::update_with`] given the specs themselves.
    #[cfg(test)]
    pub fn update(&mut self, run: Vec<TaskSpec>, kill: Vec<TaskId>) -> Vec<pb::DesiredTasks> {
        let ids = run.iter().map(|t| t.task_id.clone()).collect();
        let mut specs: std::collections::BTreeMap<TaskId, TaskSpec> =
            run.into_iter().map(|t| (t.task_id.clone(), t)).collect();
        let kill = kill
            .into_iter()
            .map(|id| (id, StopNotice::default()))
            .collect();
        self.update_with(ids, kill, |id| specs.remove(id))
    }

    /// The messages that take the receiver to the desired set (`run`,
    /// `kill` with why, sent with the kill once; an id in both is killed),
    /// asking `spec` for the specs of
    /// the tasks new to the run set (one it has no spec for is left out).
    /// The first call gives the snapshot (first message `reset`, last
    /// `complete`, at least one message); later calls the differences, last
    /// message `complete`, or nothing when nothing changed. Every message
    /// encodes to at most the budget, unless it holds a single task spec
    /// bigger than the budget.
    pub fn update_with(
        &mut self,
        run: Vec<TaskId>,
        kill: Vec<(TaskId, StopNotice)>,
        mut spec: impl FnMut(&TaskId) -> Option<TaskSpec>,
    ) -> Vec<pb::DesiredTasks> {
        let mut notices: std::collections::BTreeMap<TaskId, StopNotice> =
            kill.into_iter().collect();
        let kill: BTreeSet<TaskId> = notices.keys().cloned().collect();
        let empty = BTreeSet::new();
        let (reset, sent_run, sent_kill) = match &self.sent {
            None => (true, &empty, &empty),
            Some((r, k)) => (false, r, k),
        };
        let mut items = Vec::new();
        let mut now_run = BTreeSet::new();
        for id in run {
            if kill.contains(&id) {
                continue;
            }
            if !sent_run.contains(&id) {
                let Some(t) = spec(&id) else { continue };
                items.push(Item::Run(Box::new(t.into())));
            }
            now_run.insert(id);
        }
        items.extend(kill.iter().filter(|id| !sent_kill.contains(*id)).map(|id| {
            let notice =
                notices
                    .remove(id)
                    .filter(|n| !n.kind.is_empty())
                    .map(|n| pb::StopNotice {
                        kind: n.kind,
                        message: n.message,
                    });
            Item::Kill(id.clone(), notice)
        }));
        items.extend(
            sent_run
                .iter()
                .chain(sent_kill.iter())
                .filter(|id| !now_run.contains(*id) && !kill.contains(*id))
                .cloned()
                .map(Item::Removed),
        );
        self.sent = Some((now_run, kill));
        if !reset && items.is_empty() {
            return Vec::new();
        }
        pack(items, reset, self.budget)
    }
}

/// Packs `items` into messages of at most `budget` bytes (a single item
/// bigger than that goes alone); the first is `reset` when asked, the last
/// `complete`. Never empty.
fn pack(items: Vec<Item>, reset: bool, budget: usize) -> Vec<pb::DesiredTasks> {
    let mut out = Vec::new();
    let mut msg = pb::DesiredTasks {
        reset,
        ..Default::default()
    };
    let mut size = FLAG_BYTES;
    let mut empty = true;
    for item in items {
        let len = item.encoded_len();
        if !empty && size + len > budget {
            out.push(std::mem::take(&mut msg));
            size = FLAG_BYTES;
        }
        match item {
            Item::Run(t) => msg.tasks.push(*t),
            Item::Kill(id, notice) => {
                if let Some(n) = notice {
                    msg.kill_notices.insert(id.clone(), n);
                }
                msg.kill.push(id);
            }
            Item::Removed(id) => msg.removed.push(id),
        }
        size += len;
        empty = false;
    }
    msg.complete = true;
    out.push(msg);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuctl_core::desired::DesiredSet;
    use gpuctl_core::types::Resources;
    use proptest::prelude::*;
    use prost::Message as _;
    use std::collections::BTreeMap;

    fn task(id: &str, env_bytes: usize) -> TaskSpec {
        TaskSpec {
            share: None,
            task_id: id.into(),
            job_id: "job-1".into(),
            framework_id: String::new(),
            gpu_uuids: vec![],
            template: gpuctl_core::types::TaskTemplate {
                stop_grace_ms: None,
                checkpoint_dir: None,
                image: None,
                command: vec!["true".into()],
                env: [("BIG".to_string(), "x".repeat(env_bytes))].into(),
                resources: Resources::default(),
                no_fence: false,
                security: Default::default(),
                hang_timeout_ms: None,
                preflight: false,
                options: Default::default(),
            },
        }
    }

    fn ids(v: &[&str]) -> Vec<TaskId> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// Applies the messages to `set`; whether the last completed it, and
    /// that no earlier one did.
    fn apply_all(set: &mut DesiredSet, msgs: &[pb::DesiredTasks]) -> bool {
        let mut complete = false;
        for (i, m) in msgs.iter().enumerate() {
            complete = set.apply(m).unwrap();
            assert_eq!(complete, i + 1 == msgs.len(), "complete only on the last");
        }
        complete
    }

    fn holds(set: &DesiredSet, run: &[TaskSpec], kill: &[TaskId]) {
        let want_run: BTreeMap<TaskId, TaskSpec> = run
            .iter()
            .filter(|t| !kill.contains(&t.task_id))
            .map(|t| (t.task_id.clone(), t.clone()))
            .collect();
        let want_kill: BTreeSet<TaskId> = kill.iter().cloned().collect();
        assert_eq!(set.run(), &want_run);
        assert_eq!(set.kill(), &want_kill);
    }

    #[test]
    fn kill_notices_go_with_the_kill_once() {
        let mut stream = TaskStream::new(MESSAGE_BUDGET);
        let notice = StopNotice {
            kind: "preempted".into(),
            message: "preempted by job-7 (priority 5)".into(),
        };
        let msgs = stream.update_with(
            vec![],
            vec![
                ("k".into(), notice.clone()),
                ("j".into(), StopNotice::default()),
            ],
            |_| None,
        );
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0].kill, ["j", "k"]);
        let sent = &msgs[0].kill_notices;
        assert_eq!(sent.len(), 1, "an empty notice is not sent");
        assert_eq!(
            (sent["k"].kind.as_str(), sent["k"].message.as_str()),
            ("preempted", "preempted by job-7 (priority 5)")
        );
        let mut set = DesiredSet::new();
        assert!(set.apply(&msgs[0]).unwrap());
        assert_eq!(set.notices()["k"], notice);
        // Nothing changed: nothing sent again.
        assert!(stream
            .update_with(
                vec![],
                vec![("k".into(), notice), ("j".into(), StopNotice::default())],
                |_| None
            )
            .is_empty());
        // The size estimate holds with notices: each message within budget.
        let many: Vec<(TaskId, StopNotice)> = (0..2000)
            .map(|i| {
                (
                    format!("job-{i}.0"),
                    StopNotice {
                        kind: "cancelled".into(),
                        message: "x".repeat(100),
                    },
                )
            })
            .collect();
        let msgs = TaskStream::new(4096).update_with(vec![], many, |_| None);
        assert!(msgs.len() > 1);
        for m in &msgs {
            assert!(
                prost::Message::encoded_len(m) <= 4096,
                "{}",
                prost::Message::encoded_len(m)
            );
        }
    }

    #[test]
    fn a_snapshot_of_big_tasks_is_chunked_under_the_budget() {
        // 40 tasks with 200 KiB of env each: 8 MB, twice gRPC's limit.
        let run: Vec<TaskSpec> = (0..40)
            .map(|i| task(&format!("job-{i}.0"), 200 * 1024))
            .collect();
        let kill = ids(&["job-99.0"]);
        let mut stream = TaskStream::new(MESSAGE_BUDGET);
        let msgs = stream.update(run.clone(), kill.clone());
        assert!(msgs.len() >= 8, "{} messages", msgs.len());
        for m in &msgs {
            assert!(m.encoded_len() <= MESSAGE_BUDGET, "{}", m.encoded_len());
        }
        assert!(msgs[0].reset && msgs[1..].iter().all(|m| !m.reset));
        assert!(msgs.last().unwrap().complete);
        let mut set = DesiredSet::new();
        assert!(apply_all(&mut set, &msgs));
        holds(&set, &run, &kill);
    }

    #[test]
    fn the_budget_is_met_exactly() {
        // Messages as full as the budget allows, measured by prost.
        let run: Vec<TaskSpec> = (0..50).map(|i| task(&format!("t{i}"), 997)).collect();
        let budget = 10_000;
        let msgs = TaskStream::new(budget).update(run, vec![]);
        let sizes: Vec<usize> = msgs.iter().map(|m| m.encoded_len()).collect();
        assert!(sizes.iter().all(|s| *s <= budget), "{sizes:?}");
        // Packed tight: no message but the last could take one more task.
        let one = field_len(1, pb::TaskSpec::from(task("t10", 997)).encoded_len());
        for s in &sizes[..sizes.len() - 1] {
            assert!(s + one + FLAG_BYTES > budget, "{sizes:?}");
        }
    }

    #[test]
    fn an_empty_set_is_one_message_reset_and_complete() {
        let msgs = TaskStream::new(MESSAGE_BUDGET).update(vec![], vec![]);
        assert_eq!(
            msgs,
            vec![pb::DesiredTasks {
                reset: true,
                complete: true,
                ..Default::default()
            }]
        );
    }

    #[test]
    fn a_task_bigger_than_the_budget_goes_alone() {
        let run = vec![task("a", 10), task("b", 5000), task("c", 10)];
        let msgs = TaskStream::new(1000).update(run.clone(), vec![]);
        assert_eq!(msgs.len(), 3);
        assert_eq!(msgs[1].tasks.len(), 1);
        assert_eq!(msgs[1].tasks[0].task_id, "b");
        let mut set = DesiredSet::new();
        assert!(apply_all(&mut set, &msgs));
        holds(&set, &run, &[]);
    }

    #[test]
    fn differences_only_then_nothing_when_unchanged() {
        let mut stream = TaskStream::new(MESSAGE_BUDGET);
        let mut set = DesiredSet::new();
        let v1 = vec![task("a", 1), task("b", 1), task("c", 1)];
        apply_all(&mut set, &stream.update(v1.clone(), ids(&["k"])));

        // Unchanged: no message at all.
        assert!(stream.update(v1.clone(), ids(&["k"])).is_empty());

        // a's spec changed (not sent again: the agent keeps the first), b
        // killed (run -> kill), c unchanged, d new, k gone.
        let v2 = vec![task("a", 2), task("c", 1), task("d", 1)];
        let msgs = stream.update(v2.clone(), ids(&["b"]));
        assert_eq!(msgs.len(), 1);
        let m = &msgs[0];
        assert!(!m.reset && m.complete);
        let sent: Vec<&str> = m.tasks.iter().map(|t| t.task_id.as_str()).collect();
        assert_eq!(sent, vec!["d"]);
        assert_eq!(m.kill, ids(&["b"]));
        assert_eq!(m.removed, ids(&["k"]));
        assert!(apply_all(&mut set, &msgs));
        let v2_held = vec![task("a", 1), task("c", 1), task("d", 1)];
        holds(&set, &v2_held, &ids(&["b"]));

        // b ends (gone from both sets); a kill for a wins over its spec.
        let v3 = vec![task("a", 2), task("c", 1), task("d", 1)];
        let msgs = stream.update(v3.clone(), ids(&["a"]));
        assert_eq!(msgs[0].kill, ids(&["a"]));
        assert_eq!(msgs[0].removed, ids(&["b"]));
        assert!(msgs[0].tasks.is_empty());
        assert!(apply_all(&mut set, &msgs));
        holds(&set, &v3, &ids(&["a"]));

        // A killed task wanted again (kill -> run): its spec as it is now.
        let msgs = stream.update(v3.clone(), vec![]);
        assert_eq!(msgs[0].tasks.len(), 1);
        assert_eq!(msgs[0].tasks[0], task("a", 2).into());
        assert!(msgs[0].kill.is_empty() && msgs[0].removed.is_empty());
        assert!(apply_all(&mut set, &msgs));
        holds(&set, &v3, &[]);

        // Everything gone.
        let msgs = stream.update(vec![], vec![]);
        assert_eq!(msgs[0].removed, ids(&["a", "c", "d"]));
        assert!(apply_all(&mut set, &msgs));
        holds(&set, &[], &[]);
    }

    #[test]
    fn a_big_batch_of_differences_is_chunked_too() {
        let mut stream = TaskStream::new(MESSAGE_BUDGET);
        let mut set = DesiredSet::new();
        apply_all(&mut set, &stream.update(vec![], vec![]));
        let run: Vec<TaskSpec> = (0..30)
            .map(|i| task(&format!("t{i}"), 300 * 1024))
            .collect();
        let msgs = stream.update(run.clone(), vec![]);
        assert!(msgs.len() >= 9, "{}", msgs.len());
        assert!(msgs
            .iter()
            .all(|m| !m.reset && m.encoded_len() <= MESSAGE_BUDGET));
        assert!(apply_all(&mut set, &msgs));
        holds(&set, &run, &[]);
    }

    /// A desired set drawn from a few ids and spec versions, so that
    /// successive sets overlap, change and drop tasks.
    fn desired() -> impl Strategy<Value = (Vec<TaskSpec>, Vec<TaskId>)> {
        let entry = (0..12usize, 0..3u8, 0..3u8);
        proptest::collection::vec(entry, 0..12).prop_map(|entries| {
            let mut run = BTreeMap::new();
            let mut kill = Vec::new();
            for (id, what, version) in entries {
                let id = format!("job-{id}.0");
                match what {
                    0 => kill.push(id),
                    _ => {
                        // Sizes that make a small budget split messages.
                        let t = task(&id, usize::from(version) * 300);
                        run.insert(id, t);
                    }
                }
            }
            (run.into_values().collect(), kill)
        })
    }

    proptest! {
        /// Any sequence of desired sets, encoded and applied in order,
        /// leaves the receiver holding the latest set after each batch; a
        /// fresh receiver given the stream from its start agrees.
        #[test]
        fn applying_the_stream_reproduces_the_latest_set(
            sets in proptest::collection::vec(desired(), 1..8),
            budget in prop_oneof![Just(400usize), Just(2000), Just(MESSAGE_BUDGET)],
        ) {
            let mut stream = TaskStream::new(budget);
            let mut set = DesiredSet::new();
            let mut all = Vec::new();
            // What the receiver should hold: a task keeps the spec it had
            // when it entered the run set.
            let mut held: BTreeMap<TaskId, TaskSpec> = BTreeMap::new();
            for (run, kill) in &sets {
                let msgs = stream.update(run.clone(), kill.clone());
                held = run
                    .iter()
                    .filter(|t| !kill.contains(&t.task_id))
                    .map(|t| (t.task_id.clone(), held.get(&t.task_id).unwrap_or(t).clone()))
                    .collect();
                let run = &held.values().cloned().collect::<Vec<_>>();
                for m in &msgs {
                    // Over budget only alone.
                    let items = m.tasks.len() + m.kill.len() + m.removed.len();
                    prop_assert!(m.encoded_len() <= budget || items == 1);
                }
                if !msgs.is_empty() {
                    prop_assert!(apply_all(&mut set, &msgs));
                }
                holds(&set, run, kill);
                all.extend(msgs);
            }
            let mut fresh = DesiredSet::new();
            for m in &all {
                fresh.apply(m).unwrap();
            }
            let (_, kill) = sets.last().unwrap();
            holds(&fresh, &held.into_values().collect::<Vec<_>>(), kill);
        }
    }
}
