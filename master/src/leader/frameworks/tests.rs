use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use gpuctl_core::types::{FrameworkInfo, Resources, StatusUpdate, TaskState};
use gpuctl_proto::pb;
use tokio::sync::mpsc;

use super::*;
use crate::allocator::{self, Demand, OfferBook};
use crate::state::testkit::register;
use crate::state::{Command, FrameworkTask, Outcome, State};

/// A framework task RUNNING on agent a (update uuid u1), in a state.
fn running_task() -> (State, String) {
    let mut s = State::new();
    let mut i = 0;
    let mut apply = |s: &mut State, c: Command| {
        i += 1;
        s.apply(i, &c).unwrap()
    };
    apply(&mut s, register("a", 0));
    let Outcome::FrameworkSubscribed { framework_id } = apply(
        &mut s,
        Command::SubscribeFramework {
            request_id: None,
            info: FrameworkInfo {
                id: String::new(),
                name: "f".into(),
                roles: vec![],
                gpu_capable: true,
                failover_timeout_ms: 1_000,
                tenant: Default::default(),
            },
            at_ms: 0,
        },
    ) else {
        panic!()
    };
    apply(
        &mut s,
        Command::LaunchFrameworkTasks {
            framework_id: framework_id.clone(),
            tasks: vec![FrameworkTask {
                task_id: "t1".into(),
                agent_id: "a".into(),
                image: None,
                command: vec!["true".into()],
                env: Default::default(),
                resources: Resources::default(),
                gpu_uuids: vec![],
                fraction: None,
            }],
            group: false,
            at_ms: 0,
        },
    );
    let key = crate::state::frameworks::task_key(&framework_id, "t1");
    apply(
        &mut s,
        Command::UpdateTaskStatus {
            update: StatusUpdate {
                gpu_memory_limit: false,
                enforcement: None,
                agent_id: "a".into(),
                task_id: key.clone(),
                state: TaskState::Running,
                exit_code: None,
                message: String::new(),
                uuid: b"u1".to_vec(),
                gpu_unhealthy: false,
                requires: Vec::new(),
                fenced: false,
                latest_state: None,
                hung: false,
                failed_gpus: Vec::new(),
                runtime_restarted: false,
                liveness_failed: false,
                health: None,
            },
            at_ms: 1,
        },
    );
    (s, key)
}

#[test]
fn frameworks_hear_unreachable_without_a_uuid_then_running_again() {
    let (mut s, key) = running_task();
    let st = task_status(&s.tasks()[&key], None);
    assert_eq!(st.state, pb::TaskState::TaskRunning as i32);
    assert_eq!(st.uuid, b"u1");
    let i = s.applied_index() + 1;
    s.apply(
        i,
        &Command::AgentUnreachable {
            agent_id: "a".into(),
            at_ms: 2,
        },
    )
    .unwrap();
    let st = task_status(&s.tasks()[&key], None);
    assert_eq!(st.state, pb::TaskState::TaskUnreachable as i32);
    assert_eq!(st.reason, pb::Reason::AgentUnreachable as i32);
    assert!(
        st.uuid.is_empty(),
        "the master's word: nothing to acknowledge"
    );
    // Reconciliation answers say so too.
    let st = task_status(&s.tasks()[&key], Some(pb::Reason::Reconciliation));
    assert_eq!(st.state, pb::TaskState::TaskUnreachable as i32);
    let Command::RegisterAgent { info, .. } = register("a", 0) else {
        unreachable!()
    };
    let i = s.applied_index() + 1;
    s.apply(
        i,
        &Command::RegisterAgent {
            info,
            running_task_ids: vec![key.clone()],
            at_ms: 3,
        },
    )
    .unwrap();
    let st = task_status(&s.tasks()[&key], None);
    assert_eq!(st.state, pb::TaskState::TaskRunning as i32);
    assert_eq!(st.reason, pb::Reason::Unspecified as i32);
    assert_eq!(st.uuid, b"u1");
}

/// A hub making offers, with framework `f` (subscribed in `s`) connected.
fn offering_hub(s: &State, f: &str) -> (Hub, mpsc::Receiver<Result<pb::Event, tonic::Status>>) {
    let hub = Hub::default();
    let (tx, rx) = mpsc::channel(EVENT_BUFFER);
    hub.connect(f, tx);
    hub.lock().offers = Some(OfferBook::new());
    assert!(s.framework(f).is_some());
    (hub, rx)
}

fn offer_ids(hub: &Hub) -> Vec<String> {
    let g = hub.lock();
    g.offers
        .as_ref()
        .map(|b| b.iter().map(|o| o.id.clone()).collect())
        .unwrap_or_default()
}

#[test]
fn agents_being_launched_on_are_not_offered_until_the_launch_ends() {
    let (s, key) = running_task();
    let f = s.task(&key).map(|t| t.framework_id.clone()).unwrap();
    let (hub, _rx) = offering_hub(&s, &f);
    let settings = FrameworkSettings::default();
    let agents: BTreeSet<String> = ["a".to_string()].into();
    let launching = hub.launching(&agents);
    assert_eq!(allocate(&s, &mut hub.lock(), &settings, 10), 0);
    drop(launching);
    assert_eq!(allocate(&s, &mut hub.lock(), &settings, 10), 1);
    assert_eq!(offer_ids(&hub).len(), 1);
}

#[test]
fn offers_a_full_stream_cannot_take_are_not_left_outstanding() {
    let (s, key) = running_task();
    let f = s.task(&key).map(|t| t.framework_id.clone()).unwrap();
    let hub = Hub::default();
    let (tx, mut rx) = mpsc::channel(1);
    hub.connect(&f, tx); // SUBSCRIBED fills the stream
    hub.lock().offers = Some(OfferBook::new());
    let settings = FrameworkSettings::default();
    assert_eq!(allocate(&s, &mut hub.lock(), &settings, 10), 0);
    assert!(offer_ids(&hub).is_empty(), "nothing outstanding unsent");
    // Once the framework reads, the agent is offered at once.
    assert!(rx.try_recv().is_ok());
    assert_eq!(allocate(&s, &mut hub.lock(), &settings, 11), 1);
    assert_eq!(offer_ids(&hub).len(), 1);
    let Ok(Ok(pb::Event {
        event: Some(pb::event::Event::Offers(o)),
    })) = rx.try_recv()
    else {
        panic!("an Offers event")
    };
    assert_eq!(o.offers[0].id, offer_ids(&hub)[0]);
}

#[test]
fn the_built_in_scheduler_gets_no_rescind_events() {
    let hub = Hub::default();
    let (tx, mut rx) = mpsc::channel(8);
    let builtin = crate::state::frameworks::BUILTIN_FRAMEWORK_ID;
    hub.connect(builtin, tx);
    assert!(rx.try_recv().is_ok(), "SUBSCRIBED");
    let mut book = OfferBook::new();
    book.record(
        vec![allocator::OfferPlan {
            framework_id: builtin.into(),
            agent_id: "a".into(),
            resources: Resources::default(),
            gpu_uuids: vec![],
            shares: vec![],
        }],
        0,
    );
    hub.lock().offers = Some(book);
    hub.suppress(builtin);
    assert!(offer_ids(&hub).is_empty(), "the offer is rescinded");
    assert!(rx.try_recv().is_err(), "but no event is sent for it");
}

/// The 10,000-agent benchmark's gang stall: the built-in scheduler's
/// offers of more than EVENT_BUFFER agents expired together; one
/// Rescind event each filled its stream, so the offers made again in
/// the same cycle were dropped, stayed outstanding unseen, expired
/// again 30 s later, and so on: nothing was placed again.
#[test]
fn offers_made_after_a_mass_expiry_reach_the_built_in_scheduler() {
    let builtin = crate::state::frameworks::BUILTIN_FRAMEWORK_ID;
    let agents = EVENT_BUFFER + 100;
    let mut s = State::new();
    let mut i = 0;
    let mut apply = |s: &mut State, c: Command| {
        i += 1;
        s.apply(i, &c).unwrap();
    };
    for n in 0..agents {
        apply(&mut s, register(&format!("a{n:05}"), 0));
    }
    apply(
        &mut s,
        Command::SubscribeFramework {
            request_id: None,
            info: FrameworkInfo {
                id: builtin.into(),
                name: "gpuctl jobs".into(),
                roles: vec![crate::state::frameworks::JOBS_ROLE.into()],
                gpu_capable: true,
                failover_timeout_ms: 0,
                tenant: Default::default(),
            },
            at_ms: 0,
        },
    );
    let (hub, mut rx) = offering_hub(&s, builtin);
    let settings = FrameworkSettings::default();
    let offers_in = |rx: &mut mpsc::Receiver<_>| {
        let mut n = 0;
        while let Ok(Ok(pb::Event { event: Some(e) })) = rx.try_recv() {
            if let pb::event::Event::Offers(o) = e {
                n += o.offers.len();
            }
        }
        n
    };
    assert_eq!(allocate(&s, &mut hub.lock(), &settings, 0), agents);
    assert_eq!(offers_in(&mut rx), agents);
    // The scheduler never answers them (busy); they all expire at once.
    let timeout = settings.offer_timeout;
    let later = timeout.as_millis() as u64;
    rescind_stale(&s, &mut hub.lock(), later, timeout);
    assert_eq!(allocate(&s, &mut hub.lock(), &settings, later), agents);
    assert_eq!(offers_in(&mut rx), agents, "the new offers reach it");
}

/// Resources freed on an agent whose rest the framework holds in an
/// offer, or declined with a filter, are offered at the next round:
/// the filter refuses only offers no larger than what was declined.
#[test]
fn freed_resources_are_offered_at_once_past_a_decline_filter() {
    let mut s = State::new();
    let mut i = 0;
    let mut apply = |s: &mut State, c: Command| {
        i += 1;
        s.apply(i, &c).unwrap()
    };
    apply(&mut s, register("a", 2));
    let Outcome::FrameworkSubscribed { framework_id: f } = apply(
        &mut s,
        Command::SubscribeFramework {
            request_id: None,
            info: FrameworkInfo {
                id: String::new(),
                name: "f".into(),
                roles: vec![],
                gpu_capable: true,
                failover_timeout_ms: 1_000,
                tenant: Default::default(),
            },
            at_ms: 0,
        },
    ) else {
        panic!()
    };
    // One GPU runs a task of f's; the other is offered, and declined
    // with a long filter.
    let task = |id: &str, gpu: &str| FrameworkTask {
        task_id: id.into(),
        agent_id: "a".into(),
        image: None,
        command: vec!["true".into()],
        env: Default::default(),
        resources: Resources {
            cpus: 2.0,
            mem_mib: 1024,
            gpus: 1,
            ports: 0,
        },
        gpu_uuids: vec![gpu.into()],
        fraction: None,
    };
    apply(
        &mut s,
        Command::LaunchFrameworkTasks {
            framework_id: f.clone(),
            tasks: vec![task("t1", "GPU-a-0")],
            group: false,
            at_ms: 0,
        },
    );
    let (hub, _rx) = offering_hub(&s, &f);
    let settings = FrameworkSettings::default();
    assert_eq!(allocate(&s, &mut hub.lock(), &settings, 10), 1);
    let first = hub
        .lock()
        .offers
        .as_ref()
        .unwrap()
        .iter()
        .next()
        .cloned()
        .unwrap();
    assert_eq!(first.gpu_uuids, ["GPU-a-1"]);
    let taken = hub
        .take_offers(&f, std::slice::from_ref(&first.id))
        .unwrap();
    let refused: BTreeMap<String, Resources> = [("a".to_string(), taken[0].resources)].into();
    hub.filter_declined(&f, &refused, Some(3_600_000));
    assert_eq!(allocate(&s, &mut hub.lock(), &settings, 20), 0, "filtered");
    // t1 ends: its GPU, cpus and memory are free again; the agent now
    // has more than was declined, so it is offered at once, whole.
    apply(
        &mut s,
        Command::UpdateTaskStatus {
            update: StatusUpdate {
                gpu_memory_limit: false,
                enforcement: None,
                agent_id: "a".into(),
                task_id: crate::state::frameworks::task_key(&f, "t1"),
                state: TaskState::Finished,
                exit_code: Some(0),
                message: String::new(),
                uuid: b"u1".to_vec(),
                gpu_unhealthy: false,
                requires: Vec::new(),
                fenced: false,
                latest_state: None,
                hung: false,
                failed_gpus: Vec::new(),
                runtime_restarted: false,
                liveness_failed: false,
                health: None,
            },
            at_ms: 30,
        },
    );
    let freed = s.agent("a").unwrap().free();
    assert_eq!(freed.gpus, 2, "a terminal task frees its GPU");
    assert_eq!(allocate(&s, &mut hub.lock(), &settings, 40), 1);
    let again = hub
        .lock()
        .offers
        .as_ref()
        .unwrap()
        .iter()
        .next()
        .cloned()
        .unwrap();
    assert_eq!(again.gpu_uuids.len(), 2);
    // The book does not divide ports: the wire offer carries them all.
    assert_eq!(again.resources, Resources { ports: 0, ..freed });
}

/// Issue 34: an offer lists the agent's shared GPU with what its
/// fractions leave, never as a whole GPU, and in one offer at a time
/// (two frameworks never race for a fraction); an offer whose share
/// shrank under it is rescinded and made again with the new room; a
/// freed fraction starts a round.
#[test]
fn shared_gpus_are_offered_with_their_free_fractions_in_one_offer_at_a_time() {
    let mut s = State::new();
    let mut i = 0;
    let mut apply = |s: &mut State, c: Command| {
        i += 1;
        s.apply(i, &c).unwrap()
    };
    apply(&mut s, register("a", 2));
    apply(
        &mut s,
        Command::ShareGpu {
            gpu_uuid: "GPU-a-0".into(),
            mode: Some(gpuctl_core::types::ShareMode::Mps),
        },
    );
    let mut subscribe = |s: &mut State, name: &str| {
        let Outcome::FrameworkSubscribed { framework_id } = apply(
            s,
            Command::SubscribeFramework {
                request_id: None,
                info: FrameworkInfo {
                    id: String::new(),
                    name: name.into(),
                    roles: vec![],
                    gpu_capable: true,
                    failover_timeout_ms: 1_000,
                    tenant: Default::default(),
                },
                at_ms: 0,
            },
        ) else {
            panic!()
        };
        framework_id
    };
    let f = subscribe(&mut s, "f");
    let g = subscribe(&mut s, "g");
    let (hub, mut rx) = offering_hub(&s, &f);
    let (tx, _rx_g) = mpsc::channel(EVENT_BUFFER);
    hub.connect(&g, tx);
    let settings = FrameworkSettings::default();
    assert_eq!(allocate(&s, &mut hub.lock(), &settings, 10), 2, "split");
    let offers: Vec<allocator::Offer> = hub
        .lock()
        .offers
        .as_ref()
        .unwrap()
        .iter()
        .cloned()
        .collect();
    let with_share: Vec<&allocator::Offer> =
        offers.iter().filter(|o| !o.shares.is_empty()).collect();
    assert_eq!(with_share.len(), 1, "{offers:?}");
    assert_eq!(
        with_share[0].shares,
        vec![allocator::OfferedShare {
            gpu_uuid: "GPU-a-0".into(),
            mem_mib: 40960,
            compute_pct: 100,
        }]
    );
    assert!(
        offers
            .iter()
            .all(|o| !o.gpu_uuids.contains(&"GPU-a-0".to_string())),
        "a shared GPU offered whole: {offers:?}"
    );
    // On the wire: the GPU in full, its mode and its room.
    let wire: Vec<pb::Offer> = std::iter::from_fn(|| rx.try_recv().ok())
        .filter_map(|e| match e.ok()?.event? {
            pb::event::Event::Offers(o) => Some(o.offers),
            _ => None,
        })
        .flatten()
        .collect();
    let shared: Vec<&pb::SharedGpu> = wire.iter().flat_map(|o| &o.shared_gpus).collect();
    if with_share[0].framework_id == f {
        assert_eq!(shared.len(), 1, "{wire:?}");
        let sh = shared[0];
        assert_eq!(sh.gpu.as_ref().map(|g| g.uuid.as_str()), Some("GPU-a-0"));
        assert_eq!(sh.gpu.as_ref().map(|g| g.memory_mib), Some(40960));
        assert_eq!(
            (sh.mode.as_str(), sh.free_mem_mib, sh.free_compute_pct),
            ("mps", 40960, 100)
        );
        assert!(wire
            .iter()
            .all(|o| o.gpus.iter().all(|g| g.uuid != "GPU-a-0")));
    } else {
        assert!(shared.is_empty(), "{wire:?}");
    }
    // A fraction taken since by another path (here, a launch straight
    // through the state): the offer promises more than is left, so it
    // is rescinded.
    let holder = with_share[0].framework_id.clone();
    let other = if holder == f { g.clone() } else { f.clone() };
    let task = |id: &str, mem_mib: u64| FrameworkTask {
        task_id: id.into(),
        agent_id: "a".into(),
        image: None,
        command: vec!["true".into()],
        env: Default::default(),
        resources: Resources::default(),
        gpu_uuids: vec!["GPU-a-0".into()],
        fraction: Some(gpuctl_core::types::GpuFraction {
            mem_mib,
            compute_pct: 0,
        }),
    };
    apply(
        &mut s,
        Command::LaunchFrameworkTasks {
            framework_id: other,
            tasks: vec![task("t1", 10240)],
            group: false,
            at_ms: 20,
        },
    );
    let before = FreeMark::of(&s);
    rescind_stale(&s, &mut hub.lock(), 20, settings.offer_timeout);
    let left: Vec<allocator::Offer> = hub
        .lock()
        .offers
        .as_ref()
        .unwrap()
        .iter()
        .cloned()
        .collect();
    assert!(left.iter().all(|o| o.shares.is_empty()), "{left:?}");
    // Made again, with the room left.
    allocate(&s, &mut hub.lock(), &settings, 30);
    let again: Vec<allocator::OfferedShare> = hub
        .lock()
        .offers
        .as_ref()
        .unwrap()
        .iter()
        .flat_map(|o| o.shares.clone())
        .collect();
    assert_eq!(
        again,
        vec![allocator::OfferedShare {
            gpu_uuid: "GPU-a-0".into(),
            mem_mib: 30720,
            compute_pct: 100,
        }]
    );
    // The fraction ends: more of the shared GPU is free, which alone
    // (the task held no cpus nor memory) starts a round.
    let mut end = crate::state::testkit::status(
        "a",
        &s.tasks()
            .values()
            .find(|t| t.fraction.is_some())
            .map(|t| t.id.clone())
            .unwrap(),
        TaskState::Finished,
    );
    end.uuid = b"u".to_vec();
    apply(
        &mut s,
        Command::UpdateTaskStatus {
            update: end,
            at_ms: 40,
        },
    );
    assert!(FreeMark::of(&s).grew_from(&before));
}

/// A subscription states the framework's suppression (a new leader
/// knows nothing of it otherwise): suppressed, no offers; subscribed
/// again unsuppressed, offers.
#[test]
fn a_subscription_states_suppression() {
    let (s, key) = running_task();
    let f = s.task(&key).map(|t| t.framework_id.clone()).unwrap();
    let hub = Hub::default();
    let (tx, _rx) = mpsc::channel(EVENT_BUFFER);
    hub.connect_suppressed(&f, tx, Some(true));
    hub.lock().offers = Some(OfferBook::new());
    let settings = FrameworkSettings::default();
    assert_eq!(allocate(&s, &mut hub.lock(), &settings, 10), 0);
    // Re-subscribing without saying keeps it; saying false ends it.
    let (tx, _rx2) = mpsc::channel(EVENT_BUFFER);
    hub.connect(&f, tx);
    assert_eq!(allocate(&s, &mut hub.lock(), &settings, 20), 0);
    let (tx, _rx3) = mpsc::channel(EVENT_BUFFER);
    hub.connect_suppressed(&f, tx, Some(false));
    assert_eq!(allocate(&s, &mut hub.lock(), &settings, 30), 1);
}

/// An update whose Acknowledge never came is sent again on the same
/// connection after 10 s, then 20 s, 40 s, ...; once acknowledged, not.
#[test]
fn unacknowledged_updates_are_sent_again_with_a_growing_wait() {
    let (mut s, key) = running_task();
    let f = s.task(&key).map(|t| t.framework_id.clone()).unwrap();
    let (hub, mut rx) = offering_hub(&s, &f);
    let every = Duration::from_secs(10);
    let t0 = Instant::now();
    let _ = rx.try_recv(); // SUBSCRIBED
    let mut updates_at = |s: &State, secs: u64| {
        forward_updates(s, &mut hub.lock(), t0 + Duration::from_secs(secs), every);
        let mut n = 0;
        while let Ok(e) = rx.try_recv() {
            match e.unwrap().event {
                Some(pb::event::Event::Update(u)) => {
                    assert_eq!(u.uuid, b"u1");
                    assert_eq!(u.state, pb::TaskState::TaskRunning as i32);
                    n += 1;
                }
                other => panic!("{other:?}"),
            }
        }
        n
    };
    assert_eq!(updates_at(&s, 0), 1, "sent");
    assert_eq!(updates_at(&s, 9), 0);
    assert_eq!(updates_at(&s, 10), 1, "again after 10 s");
    assert_eq!(updates_at(&s, 29), 0);
    assert_eq!(updates_at(&s, 30), 1, "then after 20 s");
    assert_eq!(updates_at(&s, 69), 0);
    assert_eq!(updates_at(&s, 70), 1, "then after 40 s");
    s.apply(
        100,
        &Command::AcknowledgeUpdate {
            framework_id: f.clone(),
            framework_task_id: "t1".into(),
            uuid: b"u1".to_vec(),
        },
    )
    .unwrap();
    assert_eq!(updates_at(&s, 1000), 0, "acknowledged: never again");
}

/// A framework hears once that an agent is LOST (from the capacity
/// index's set), and again only if it is lost again after coming back.
#[test]
fn a_lost_agent_is_told_to_frameworks_once() {
    let (mut s, key) = running_task();
    let f = s.task(&key).map(|t| t.framework_id.clone()).unwrap();
    let (hub, mut rx) = offering_hub(&s, &f);
    let _ = rx.try_recv(); // SUBSCRIBED
    let mut failures = |s: &State| {
        forward_failures(s, &mut hub.lock());
        let mut agents = Vec::new();
        while let Ok(e) = rx.try_recv() {
            if let Some(pb::event::Event::Failure(f)) = e.unwrap().event {
                agents.push(f.agent_id);
            }
        }
        agents
    };
    assert!(failures(&s).is_empty());
    let mut i = 1000;
    let mut apply = |s: &mut State, c: Command| {
        i += 1;
        s.apply(i, &c).unwrap();
    };
    apply(
        &mut s,
        Command::AgentUnreachable {
            agent_id: "a".into(),
            at_ms: 1,
        },
    );
    assert!(failures(&s).is_empty(), "unreachable is not lost");
    apply(
        &mut s,
        Command::AgentLostAfterTimeout {
            agent_id: "a".into(),
            at_ms: 2,
        },
    );
    assert_eq!(failures(&s), ["a"]);
    assert!(failures(&s).is_empty(), "once");
    apply(&mut s, register("a", 0));
    assert!(failures(&s).is_empty());
    apply(
        &mut s,
        Command::AgentUnreachable {
            agent_id: "a".into(),
            at_ms: 3,
        },
    );
    apply(
        &mut s,
        Command::AgentLostAfterTimeout {
            agent_id: "a".into(),
            at_ms: 4,
        },
    );
    assert_eq!(failures(&s), ["a"], "lost again");
    assert_eq!(*s.capacity(), crate::state::capacity::Capacity::build(&s));
}

#[test]
fn a_failed_take_releases_the_callers_valid_offers() {
    let (s, key) = running_task();
    let f = s.task(&key).map(|t| t.framework_id.clone()).unwrap();
    let (hub, _rx) = offering_hub(&s, &f);
    let settings = FrameworkSettings::default();
    assert_eq!(allocate(&s, &mut hub.lock(), &settings, 10), 1);
    let mut ids = offer_ids(&hub);
    ids.push("offer-999".into());
    let err = hub.take_offers(&f, &ids).unwrap_err();
    assert!(err.to_string().contains("offer-999"), "{err}");
    assert!(offer_ids(&hub).is_empty(), "the valid offer is released");
    // Its agent is offered again at once.
    assert_eq!(allocate(&s, &mut hub.lock(), &settings, 11), 1);
    // The scheduler's partial take skips what is gone.
    let mut ids = offer_ids(&hub);
    ids.push("offer-999".into());
    assert_eq!(hub.take_outstanding(&f, &ids).len(), 1);
    assert!(offer_ids(&hub).is_empty());
}

#[test]
fn frameworks_get_a_heartbeat_every_interval() {
    let (s, key) = running_task();
    let f = s.task(&key).map(|t| t.framework_id.clone()).unwrap();
    let (hub, mut rx) = offering_hub(&s, &f);
    while rx.try_recv().is_ok() {}
    let t0 = Instant::now();
    let mut beats_at = |after: Duration| {
        heartbeat(&mut hub.lock(), t0 + after);
        let mut n = 0;
        while let Ok(e) = rx.try_recv() {
            match e.unwrap().event {
                Some(pb::event::Event::Heartbeat(_)) => n += 1,
                other => panic!("{other:?}"),
            }
        }
        n
    };
    let ms = Duration::from_millis(1);
    assert_eq!(beats_at(Duration::ZERO), 1, "the first pass");
    assert_eq!(beats_at(HEARTBEAT_INTERVAL - ms), 0);
    assert_eq!(beats_at(HEARTBEAT_INTERVAL), 1);
    assert_eq!(beats_at(HEARTBEAT_INTERVAL * 2 - ms), 0);
    assert_eq!(beats_at(HEARTBEAT_INTERVAL * 2), 1);
}

#[test]
fn a_framework_is_removed_only_once_disconnected_past_its_failover_timeout() {
    let (s, key) = running_task(); // failover_timeout_ms: 1_000
    let f = s.task(&key).map(|t| t.framework_id.clone()).unwrap();
    let hub = Hub::default();
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    // Never seen connected by this leader: its clock starts at the first pass.
    assert!(failover_expired(&s, &mut hub.lock(), ms(0)).is_empty());
    assert!(
        failover_expired(&s, &mut hub.lock(), ms(1_000)).is_empty(),
        "not before the timeout"
    );
    assert_eq!(
        failover_expired(&s, &mut hub.lock(), ms(1_001)),
        vec![f.clone()]
    );
    // Connected: no clock at all.
    let (tx, _rx) = mpsc::channel(EVENT_BUFFER);
    let conn = hub.connect(&f, tx);
    assert!(failover_expired(&s, &mut hub.lock(), ms(60_000)).is_empty());
    // Disconnected: counted from the disconnection.
    hub.disconnect(&f, conn);
    let since = hub.lock().disconnected_at[&f];
    let after = |n: u64| since + Duration::from_millis(n);
    assert!(failover_expired(&s, &mut hub.lock(), after(1_000)).is_empty());
    assert_eq!(failover_expired(&s, &mut hub.lock(), after(1_001)), vec![f]);
}

/// A declared task size is kept through launches and declines (which
/// would otherwise make the framework one of "whole agents"), until it
/// declares another; an undeclared framework's demand is learnt.
#[test]
fn a_declared_demand_stays_through_declines_and_launches() {
    let hub = Hub::default();
    let task = Resources {
        cpus: 1.0,
        mem_mib: 4096,
        gpus: 0,
        ports: 0,
    };
    let demand = |f: &str| hub.lock().demands.get(f).copied().unwrap_or_default();
    hub.declare_demand("declared", task);
    hub.learn_demand("declared", &[]);
    assert_eq!(demand("declared"), Demand::Task(task), "a decline");
    let small = Resources { cpus: 0.5, ..task };
    hub.learn_demand("declared", &[small]);
    assert_eq!(demand("declared"), Demand::Task(task), "a launch");
    hub.declare_demand("declared", small);
    assert_eq!(demand("declared"), Demand::Task(small), "declared again");
    hub.learn_demand("learnt", &[small]);
    assert_eq!(demand("learnt"), Demand::Task(small));
    hub.learn_demand("learnt", &[]);
    assert_eq!(demand("learnt"), Demand::Whole);
    hub.close("declared", "test");
    hub.learn_demand("declared", &[]);
    assert_eq!(demand("declared"), Demand::Whole, "forgotten when removed");
}
