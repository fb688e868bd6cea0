//! Raft groups of real nodes (sled storage in temp dirs) over the in-process
//! network of `sim`: elections, partitions, catching up from a snapshot and
//! membership changes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuctl_core::types::{JobSpec, Resources};
use raft::eraftpb::{ConfChange, ConfChangeType};
use tokio::sync::watch;

use super::node::start;
use super::sim::SimNet;
use super::NodeError;
use super::{Addresses, ProposeError, RaftHandle, RaftNodeConfig, Role, SledStorage};
use crate::state::events::EventKind;
use crate::state::{Command, Outcome};

struct Member {
    handle: RaftHandle,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), NodeError>>,
}

struct Group {
    net: Arc<SimNet>,
    dir: tempfile::TempDir,
    members: BTreeMap<u64, Member>,
    snapshot_every: u64,
}

fn submit(name: &str) -> Command {
    Command::SubmitJob {
        spec: JobSpec {
            placement: Default::default(),
            name: name.into(),
            template: gpuctl_core::types::TaskTemplate {
                image: None,
                command: vec!["true".into()],
                env: Default::default(),
                resources: Resources::default(),
                ..Default::default()
            },
            ..Default::default()
        },
        at_ms: 1,
        request_id: None,
    }
}

async fn eventually(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

impl Group {
    fn new(snapshot_every: u64) -> Group {
        Group {
            net: SimNet::new(),
            dir: tempfile::tempdir().unwrap(),
            members: BTreeMap::new(),
            snapshot_every,
        }
    }

    /// Starts (or restarts, from its data dir) node `id`; `voters` is only
    /// used for a new data dir.
    fn start(&mut self, id: u64, voters: &[u64]) {
        let dir = self.dir.path().join(format!("n{id}"));
        std::fs::create_dir_all(&dir).unwrap();
        let storage = SledStorage::open(&dir, voters).unwrap();
        let mut config = RaftNodeConfig::new(id);
        // Fast elections keep the tests short: 100 to 200 ms.
        config.tick = Duration::from_millis(10);
        config.snapshot_every = self.snapshot_every;
        let (stop, stop_rx) = watch::channel(false);
        let (handle, task, _) = start(
            config,
            storage,
            self.net.transport(id),
            Addresses::default(),
            stop_rx,
        )
        .unwrap();
        self.net.attach(id, handle.clone());
        self.members.insert(id, Member { handle, stop, task });
    }

    async fn stop(&mut self, id: u64) {
        self.net.detach(id);
        let m = self.members.remove(&id).unwrap();
        m.stop.send(true).unwrap();
        m.task.await.unwrap().unwrap();
    }

    fn h(&self, id: u64) -> &RaftHandle {
        &self.members[&id].handle
    }

    /// The one leader among `among`, once they agree on it.
    async fn leader(&self, among: &[u64]) -> u64 {
        let mut found = 0;
        eventually("a leader", Duration::from_secs(10), || {
            let leaders: Vec<u64> = among
                .iter()
                .filter(|id| self.h(**id).status().role == Role::Leader)
                .copied()
                .collect();
            if leaders.len() != 1 {
                return false;
            }
            found = leaders[0];
            among
                .iter()
                .all(|id| self.h(*id).status().leader_id == found)
        })
        .await;
        found
    }

    /// Waits until every node of `ids` has applied what `of` has.
    async fn converge(&self, of: u64, ids: &[u64]) {
        let target = self.h(of).state().applied_index();
        eventually("followers to catch up", Duration::from_secs(10), || {
            ids.iter()
                .all(|id| self.h(*id).state().applied_index() >= target)
        })
        .await;
        let reference = self.h(of).state().jobs().clone();
        for id in ids {
            assert_eq!(self.h(*id).state().jobs(), &reference, "node {id} differs");
        }
    }
}

async fn propose_ok(h: &RaftHandle, name: &str) -> String {
    match h.propose(submit(name)).await.unwrap() {
        Outcome::JobSubmitted { job_id } => job_id,
        other => panic!("unexpected outcome {other:?}"),
    }
}

#[tokio::test]
async fn three_masters_elect_one_leader_and_replicate() {
    let mut g = Group::new(10_000);
    for id in 1..=3 {
        g.start(id, &[1, 2, 3]);
    }
    let leader = g.leader(&[1, 2, 3]).await;
    for i in 0..5 {
        propose_ok(g.h(leader), &format!("j{i}")).await;
    }
    g.converge(leader, &[1, 2, 3]).await;
    assert_eq!(g.h(1).state().jobs().len(), 5);
    // Only the leader serves, and only once it has applied its term's start.
    for id in 1..=3 {
        assert_eq!(g.h(id).status().serving, id == leader, "node {id}");
    }
    // A follower refuses to propose and names the leader.
    let follower = (1..=3).find(|id| *id != leader).unwrap();
    match g.h(follower).propose(submit("x")).await {
        Err(ProposeError::NotLeader { leader: l }) => {
            assert_eq!(l.map(|(id, _)| id), None, "no address book in this test");
        }
        other => panic!("follower proposed: {other:?}"),
    }
    assert_eq!(g.h(follower).status().leader_id, leader);
}

#[tokio::test]
async fn an_isolated_leader_steps_down_cannot_commit_and_rejoins() {
    let mut g = Group::new(10_000);
    for id in 1..=3 {
        g.start(id, &[1, 2, 3]);
    }
    let old = g.leader(&[1, 2, 3]).await;
    propose_ok(g.h(old), "before").await;
    let rest: Vec<u64> = (1..=3).filter(|id| *id != old).collect();
    g.net.isolate(old, &rest);

    // The minority (the old leader alone) cannot commit: its proposal fails
    // once it notices it lost the quorum, and never reaches the others.
    let stranded = g.h(old).propose(submit("stranded")).await;
    assert!(
        matches!(
            stranded,
            Err(ProposeError::LeadershipLost) | Err(ProposeError::NotLeader { .. })
        ),
        "{stranded:?}"
    );
    eventually(
        "the old leader to step down",
        Duration::from_secs(5),
        || g.h(old).status().role != Role::Leader,
    )
    .await;

    // The majority elects a new leader and keeps committing.
    let new = g.leader(&rest).await;
    assert_ne!(new, old);
    propose_ok(g.h(new), "during").await;

    // Healed: the old leader follows, drops its uncommitted entry, catches up.
    g.net.heal();
    g.converge(new, &[1, 2, 3]).await;
    let jobs = g.h(old).state().jobs().clone();
    let names: Vec<&str> = jobs.values().map(|j| j.spec.name.as_str()).collect();
    assert_eq!(names, vec!["before", "during"]);
    assert_eq!(g.leader(&[1, 2, 3]).await, new, "pre-vote: no disruption");
}

#[tokio::test]
async fn a_leader_cut_off_one_way_is_replaced_and_the_group_heals() {
    let mut g = Group::new(10_000);
    for id in 1..=3 {
        g.start(id, &[1, 2, 3]);
    }
    let old = g.leader(&[1, 2, 3]).await;
    // The leader hears the others but they never hear it.
    for id in (1..=3).filter(|id| *id != old) {
        g.net.cut_one_way(old, id);
    }
    let rest: Vec<u64> = (1..=3).filter(|id| *id != old).collect();
    let new = g.leader(&rest).await;
    assert_ne!(new, old);
    propose_ok(g.h(new), "after").await;
    g.net.heal();
    g.converge(new, &[1, 2, 3]).await;
}

#[tokio::test]
async fn a_lagging_master_catches_up_from_a_snapshot_and_restarts_from_it() {
    let mut g = Group::new(5);
    for id in 1..=3 {
        g.start(id, &[1, 2, 3]);
    }
    let leader = g.leader(&[1, 2, 3]).await;
    let lagging = (1..=3).find(|id| *id != leader).unwrap();
    g.net.isolate(lagging, &[1, 2, 3]);
    let behind = g.h(lagging).state().applied_index();
    for i in 0..23 {
        propose_ok(g.h(leader), &format!("j{i}")).await;
    }
    // The leader's log no longer has what the lagging master needs.
    assert!(g.h(leader).status().snapshot_index > behind + 1);
    g.net.heal();
    g.converge(leader, &[1, 2, 3]).await;
    assert_eq!(g.h(lagging).state().jobs().len(), 23);
    // Their events came in the snapshot too (converge compared them).
    assert!(g
        .h(lagging)
        .state()
        .jobs()
        .values()
        .all(|j| j.events.iter().any(|e| e.kind == EventKind::Queued)));
    assert!(g.h(lagging).status().snapshot_index > behind);

    // Restarted, it comes back from its own storage with the same state.
    let before = g.h(lagging).state().jobs().clone();
    g.stop(lagging).await;
    g.start(lagging, &[]);
    eventually("replay", Duration::from_secs(5), || {
        g.h(lagging).state().jobs() == &before
    })
    .await;
    propose_ok(g.h(g.leader(&[1, 2, 3]).await), "more").await;
    g.converge(leader, &[1, 2, 3]).await;
}

#[tokio::test]
async fn an_entry_of_a_newer_command_version_stops_every_master_unapplied() {
    let mut g = Group::new(10_000);
    for id in 1..=3 {
        g.start(id, &[1, 2, 3]);
    }
    let leader = g.leader(&[1, 2, 3]).await;
    propose_ok(g.h(leader), "before").await;
    g.converge(leader, &[1, 2, 3]).await;
    let applied = g.h(leader).state().applied_index();

    // What a newer master would write: a command this one has never heard of.
    let newer = crate::state::COMMAND_VERSION + 1;
    let data = format!(r#"{{"version":{newer},"command":{{"SubmitJobV2":{{"name":"x"}}}}}}"#);
    let r = g.h(leader).propose_raw(data.into_bytes()).await;
    assert!(matches!(r, Err(ProposeError::Stopped)), "{r:?}");
    let entry = applied + 1;
    g.newer_entry_stops(entry, newer).await;
    // Restarted with the same version, they elect a leader, learn that the
    // entry is committed and stop at it again.
    for id in 1..=3 {
        g.start(id, &[]);
    }
    g.newer_entry_stops(entry, newer).await;
}

impl Group {
    /// Every master either stops at `entry` with `NewerCommand` or, if it
    /// never learnt that the entry committed (a leader may stop before it
    /// tells), runs on without applying it; a majority stops. None applies
    /// or skips it. Leaves the group with no member.
    async fn newer_entry_stops(&mut self, entry: u64, version: u32) {
        eventually("a majority to stop", Duration::from_secs(10), || {
            self.members
                .values()
                .filter(|m| m.task.is_finished())
                .count()
                >= 2
        })
        .await;
        for id in 1..=3 {
            let m = self.members.remove(&id).unwrap();
            self.net.detach(id);
            assert!(
                m.handle.state().applied_index() < entry,
                "master {id} applied it"
            );
            assert_eq!(m.handle.state().jobs().len(), 1, "master {id}");
            // Stops one still running (it may have stopped since).
            let _ = m.stop.send(true);
            match m.task.await.unwrap() {
                Err(NodeError::NewerCommand { index, version: v }) => {
                    assert_eq!((index, v), (entry, version), "master {id}");
                }
                Ok(()) => assert!(
                    m.handle.status().commit_index < entry,
                    "master {id} knew the entry committed and went on"
                ),
                Err(e) => panic!("master {id}: {e}"),
            }
        }
    }
}

fn cc(kind: ConfChangeType, id: u64, addr: &str) -> ConfChange {
    let mut c = ConfChange {
        node_id: id,
        context: addr.as_bytes().to_vec().into(),
        ..Default::default()
    };
    c.set_change_type(kind);
    c
}

#[tokio::test]
async fn a_master_joins_as_learner_becomes_voter_and_is_removed() {
    // No compaction by itself: the join must bring its own snapshot, or the
    // new master would never learn the bootstrap configuration (not in the log).
    let mut g = Group::new(10_000);
    g.start(1, &[1]);
    let leader = g.leader(&[1]).await;
    for i in 0..10 {
        propose_ok(g.h(leader), &format!("j{i}")).await;
    }
    // Started with no configuration: it waits to be added.
    g.start(2, &[]);
    g.h(1)
        .propose_conf_change(cc(ConfChangeType::AddLearnerNode, 2, "m2:7050"))
        .await
        .unwrap();
    eventually("the learner to catch up", Duration::from_secs(10), || {
        g.h(2).state().applied_index() >= g.h(1).state().applied_index()
    })
    .await;
    assert_eq!(g.h(1).status().learners, vec![2]);
    g.h(1)
        .propose_conf_change(cc(ConfChangeType::AddNode, 2, "m2:7050"))
        .await
        .unwrap();
    eventually("both to see two voters", Duration::from_secs(5), || {
        g.h(1).status().voters == [1, 2] && g.h(2).status().voters == [1, 2]
    })
    .await;
    g.converge(1, &[1, 2]).await;
    assert!(
        g.h(2).status().snapshot_index >= 10,
        "joined from a snapshot"
    );
    assert_eq!(
        g.h(2).state().masters().get(&2).map(String::as_str),
        Some("m2:7050")
    );
    assert_eq!(g.h(2).addresses().get(2).as_deref(), Some("m2:7050"));
    // Two voters: both are needed to commit.
    propose_ok(g.h(1), "with two").await;

    g.h(1)
        .propose_conf_change(cc(ConfChangeType::RemoveNode, 2, ""))
        .await
        .unwrap();
    assert_eq!(g.h(1).status().voters, vec![1]);
    assert!(!g.h(1).state().masters().contains_key(&2));
    // Removing the last voter is refused before anything is proposed.
    let err = g
        .h(1)
        .propose_conf_change(cc(ConfChangeType::RemoveNode, 1, ""))
        .await;
    assert!(err.is_err(), "{err:?}");
    // Alone again, it commits by itself.
    g.stop(2).await;
    propose_ok(g.h(1), "alone").await;
}

#[tokio::test]
async fn leadership_moves_on_request() {
    let mut g = Group::new(10_000);
    for id in 1..=3 {
        g.start(id, &[1, 2, 3]);
    }
    let old = g.leader(&[1, 2, 3]).await;
    propose_ok(g.h(old), "a").await;
    g.converge(old, &[1, 2, 3]).await;
    let to = (1..=3).find(|id| *id != old).unwrap();
    g.h(old).transfer_leader(to).unwrap();
    eventually("the transferee to lead", Duration::from_secs(5), || {
        g.h(to).status().role == Role::Leader
    })
    .await;
    assert_eq!(g.leader(&[1, 2, 3]).await, to);
    propose_ok(g.h(to), "b").await;
}

/// `caught_up` on the leader returns once every proposal made before it is
/// applied (here 50 in flight, none awaited yet); a follower refuses it.
#[tokio::test]
async fn caught_up_waits_for_the_proposals_made_before_it() {
    let mut g = Group::new(10_000);
    for id in 1..=3 {
        g.start(id, &[1, 2, 3]);
    }
    let leader = g.leader(&[1, 2, 3]).await;
    let h = g.h(leader).clone();
    let mut in_flight = Vec::new();
    for i in 0..50 {
        let mut p = Box::pin(h.propose(submit(&format!("j{i}"))));
        // Polled once: sent to the Raft loop, not yet committed.
        assert!(futures::poll!(p.as_mut()).is_pending());
        in_flight.push(p);
    }
    h.caught_up().await.unwrap();
    assert_eq!(h.state().jobs().len(), 50, "all applied before it returned");
    for p in in_flight {
        p.await.unwrap();
    }
    let follower = (1..=3).find(|id| *id != leader).unwrap();
    assert!(matches!(
        g.h(follower).caught_up().await,
        Err(ProposeError::NotLeader { .. })
    ));
}
