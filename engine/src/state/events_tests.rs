//! Job events as the apply paths record them: each kind by the command
//! that causes it, with the command's time; bounded; repeats collapsed;
//! carried by a snapshot.

use gpuctl_core::types::{JobSpec, Resources, TaskState};

use super::events::{EventKind, MAX_EVENTS};
use super::testkit::{register, status, Driver};
use super::{Command, Outcome, State};

fn spec(gpus: u32, f: impl FnOnce(&mut JobSpec)) -> JobSpec {
    let mut s = JobSpec::new(
        "j",
        vec!["true".into()],
        Resources {
            cpus: 1.0,
            mem_mib: 0,
            gpus,
            ports: 0,
        },
    );
    f(&mut s);
    s
}

fn submit(d: &mut Driver, s: JobSpec, at_ms: u64) -> String {
    match d.apply(Command::SubmitJob {
        spec: s,
        at_ms,
        request_id: None,
    }) {
        Ok(Outcome::JobSubmitted { job_id }) => job_id,
        o => panic!("{o:?}"),
    }
}

fn report(d: &mut Driver, task: &str, state: TaskState, code: Option<i32>, at_ms: u64) {
    let mut update = status(&d.s.tasks[task].agent_id, task, state);
    update.exit_code = code;
    d.apply(Command::UpdateTaskStatus { update, at_ms })
        .unwrap();
}

/// (kind, message, last time, count) of each event of the job.
fn events(d: &Driver, job: &str) -> Vec<(EventKind, String, u64, u32)> {
    d.s.jobs[job]
        .events
        .iter()
        .map(|e| (e.kind, e.message.clone(), e.last_ms, e.count))
        .collect()
}

fn kinds(d: &Driver, job: &str) -> Vec<EventKind> {
    d.s.jobs[job].events.iter().map(|e| e.kind).collect()
}

#[test]
fn a_job_that_runs_and_exits_tells_its_story_with_the_commands_times() {
    let mut d = Driver::new(&[("a", 2)]);
    let j = submit(&mut d, spec(2, |_| {}), 100);
    d.launch_at(&j, &[("a", &["GPU-a-0", "GPU-a-1"])], 200)
        .unwrap();
    report(&mut d, "job-1.0", TaskState::Starting, None, 300);
    report(&mut d, "job-1.0", TaskState::Running, None, 400);
    report(&mut d, "job-1.0", TaskState::Finished, Some(0), 500);
    use EventKind::*;
    assert_eq!(
        events(&d, &j),
        vec![
            (
                Queued,
                "submitted: 2 GPUs, priority 0; waiting for placement".into(),
                100,
                1
            ),
            (
                Scheduled,
                "placed on agent a (GPUs GPU-a-0,GPU-a-1)".into(),
                200,
                1
            ),
            (Started, "running on agent a".into(), 400, 1),
            (Succeeded, "exited with code 0".into(), 500, 1),
        ]
    );
    // The same commands give the same events elsewhere (a replica).
    let mut other = Driver::new(&[("a", 2)]);
    submit(&mut other, spec(2, |_| {}), 100);
    other
        .launch_at(&j, &[("a", &["GPU-a-0", "GPU-a-1"])], 200)
        .unwrap();
    report(&mut other, "job-1.0", TaskState::Starting, None, 300);
    report(&mut other, "job-1.0", TaskState::Running, None, 400);
    report(&mut other, "job-1.0", TaskState::Finished, Some(0), 500);
    assert_eq!(other.s.jobs[&j].events, d.s.jobs[&j].events);
}

#[test]
fn a_gang_names_each_rank_and_a_failure_says_the_exit_code_and_retry() {
    let mut d = Driver::new(&[("a", 1), ("b", 1)]);
    let j = submit(
        &mut d,
        spec(1, |s| {
            s.replicas = 2;
            s.max_retries = 1;
        }),
        1,
    );
    d.launch_at(&j, &[("b", &["GPU-b-0"]), ("a", &["GPU-a-0"])], 2)
        .unwrap();
    report(&mut d, "job-1.0", TaskState::Running, None, 3);
    report(&mut d, "job-1.1", TaskState::Running, None, 4);
    report(&mut d, "job-1.1", TaskState::Failed, Some(3), 5);
    report(&mut d, "job-1.0", TaskState::Killed, None, 6);
    d.launch_at(&j, &[("a", &["GPU-a-0"]), ("b", &["GPU-b-0"])], 7)
        .unwrap();
    report(&mut d, "job-1.2", TaskState::Failed, Some(4), 8);
    report(&mut d, "job-1.3", TaskState::Killed, None, 9);
    let ev = events(&d, &j);
    assert_eq!(
        ev[1].1,
        "2 tasks placed: rank 0 on agent b (GPUs GPU-b-0); rank 1 on agent a (GPUs GPU-a-0)"
    );
    assert_eq!(ev[2].1, "all 2 tasks running on agents a, b");
    assert_eq!(
        (ev[3].0, ev[3].1.as_str(), ev[3].2),
        (
            EventKind::Retrying,
            "rank 1 of 2: task job-1.1 exited with code 3; retry 1 of 1 in 1s",
            6
        )
    );
    assert_eq!(ev[4].0, EventKind::Scheduled);
    assert_eq!(
        ev[5],
        (
            EventKind::Failed,
            "rank 0 of 2: task job-1.2 exited with code 4".into(),
            9,
            1
        )
    );
    assert_eq!(ev.len(), 6);
}

#[test]
fn preemption_names_the_preempting_job_on_both_sides() {
    let mut d = Driver::new(&[("a", 1)]);
    let low = submit(&mut d, spec(1, |_| {}), 1);
    d.launch_at(&low, &[("a", &["GPU-a-0"])], 2).unwrap();
    report(&mut d, "job-1.0", TaskState::Running, None, 3);
    let high = submit(&mut d, spec(1, |s| s.priority = 5), 4);
    d.apply(Command::PreemptJobs {
        job_id: high.clone(),
        victims: vec![low.clone()],
        at_ms: 5,
    })
    .unwrap();
    report(&mut d, "job-1.0", TaskState::Killed, None, 6);
    use EventKind::*;
    assert_eq!(
        kinds(&d, &low),
        [Queued, Scheduled, Started, Preempted, Requeued]
    );
    let ev = events(&d, &low);
    assert_eq!(ev[3].1, "preempted by job-2 (priority 5)");
    assert_eq!(ev[3].2, 5);
    assert_eq!(
        ev[4].1,
        "preempted by job-2: back in the queue (no retry used)"
    );
    assert!(d.s.jobs[&low]
        .events
        .iter()
        .nth(3)
        .unwrap()
        .kind
        .is_warning());
    assert_eq!(
        events(&d, &high)[1],
        (
            Preempting,
            "stopping lower-priority job-1 to make room".into(),
            5,
            1
        )
    );
}

#[test]
fn a_gpu_failure_then_requeue() {
    let mut d = Driver::new(&[("a", 1)]);
    let j = submit(&mut d, spec(1, |_| {}), 1);
    d.launch_at(&j, &[("a", &["GPU-a-0"])], 2).unwrap();
    let mut u = status("a", "job-1.0", TaskState::Failed);
    u.gpu_unhealthy = true;
    u.message = "GPU GPU-a-0 unhealthy: XID 79".into();
    d.apply(Command::UpdateTaskStatus {
        update: u,
        at_ms: 3,
    })
    .unwrap();
    let ev = events(&d, &j);
    assert_eq!(
        (ev[2].0, ev[2].1.as_str()),
        (
            EventKind::GpuFailed,
            "task job-1.0 failed: GPU GPU-a-0 unhealthy: XID 79"
        )
    );
    assert_eq!(
        (ev[3].0, ev[3].1.as_str()),
        (
            EventKind::Requeued,
            "after its GPU failed: back in the queue (no retry used); avoiding GPU GPU-a-0 \
             until it is back in service (at most 10 min)"
        )
    );
}

/// A task its container runtime stopped as the runtime restarted: the job
/// is back in the queue without using a retry (it has none), and says
/// why; with --no-requeue it fails saying so.
#[test]
fn a_runtime_restart_requeues_without_a_retry() {
    for no_requeue in [false, true] {
        let mut d = Driver::new(&[("a", 1)]);
        let j = submit(&mut d, spec(1, |s| s.no_requeue = no_requeue), 1);
        d.launch_at(&j, &[("a", &["GPU-a-0"])], 2).unwrap();
        report(&mut d, "job-1.0", TaskState::Running, None, 3);
        let mut u = status("a", "job-1.0", TaskState::Failed);
        u.exit_code = Some(143);
        u.runtime_restarted = true;
        u.message = "was stopped by its container runtime as the runtime restarted".into();
        d.apply(Command::UpdateTaskStatus {
            update: u,
            at_ms: 4,
        })
        .unwrap();
        let job = &d.s.jobs[&j];
        assert_eq!(
            d.s.tasks["job-1.0"].reason,
            gpuctl_core::types::TaskReason::RuntimeRestarted
        );
        assert_eq!(job.retries, 0, "no retry used");
        let last = events(&d, &j).last().cloned().unwrap();
        if no_requeue {
            assert_eq!(job.state, gpuctl_core::types::JobState::Failed);
            assert!(
                job.message.ends_with("(submitted with --no-requeue)"),
                "{}",
                job.message
            );
        } else {
            assert_eq!(job.state, gpuctl_core::types::JobState::Queued);
            assert_eq!(
                (last.0, last.1.as_str()),
                (
                    EventKind::Requeued,
                    "after its container runtime restarted under it: back in the queue (no retry used)"
                )
            );
            assert!(
                job.message.contains("was stopped by its container runtime"),
                "{}",
                job.message
            );
        }
    }
}

#[test]
fn an_agent_unreachable_then_back_then_lost() {
    let mut d = Driver::new(&[("a", 1)]);
    let j = submit(&mut d, spec(1, |s| s.max_retries = 1), 1);
    d.launch_at(&j, &[("a", &["GPU-a-0"])], 2).unwrap();
    report(&mut d, "job-1.0", TaskState::Running, None, 3);
    d.apply(Command::AgentUnreachable {
        agent_id: "a".into(),
        at_ms: 10_000,
    })
    .unwrap();
    // Back, still running it.
    let mut back = register("a", 1);
    if let Command::RegisterAgent {
        running_task_ids,
        at_ms,
        ..
    } = &mut back
    {
        *running_task_ids = vec!["job-1.0".into()];
        *at_ms = 11_000;
    }
    d.apply(back).unwrap();
    d.apply(Command::AgentUnreachable {
        agent_id: "a".into(),
        at_ms: 20_000,
    })
    .unwrap();
    d.apply(Command::AgentLostAfterTimeout {
        agent_id: "a".into(),
        at_ms: 30_000,
    })
    .unwrap();
    use EventKind::*;
    let ev = events(&d, &j);
    // The second unreachable is the first again: counted, moved last.
    assert_eq!(
        ev.iter().map(|e| e.0).collect::<Vec<_>>(),
        [
            Queued,
            Scheduled,
            Started,
            AgentReturned,
            AgentUnreachable,
            AgentLost,
            Retrying
        ]
    );
    assert_eq!(
        (ev[4].1.as_str(), ev[4].2, ev[4].3),
        (
            "agent a stopped heartbeating; its tasks keep their GPUs",
            20_000,
            2
        )
    );
    assert_eq!(d.s.jobs[&j].events.iter().nth(4).unwrap().first_ms, 10_000);
    assert_eq!(
        ev[5].1,
        "agent a unreachable since 1970-01-01T00:00:20Z: its tasks are LOST"
    );
    assert!(
        ev[6].1.starts_with("task job-1.0 lost: agent a lost"),
        "{}",
        ev[6].1
    );
    assert!(ev[6].1.ends_with("; retry 1 of 1 in 1s"), "{}", ev[6].1);
}

#[test]
fn cancel_and_drain() {
    let mut d = Driver::new(&[("a", 2)]);
    let queued = submit(&mut d, spec(1, |_| {}), 1);
    let running = submit(&mut d, spec(1, |_| {}), 1);
    let drained = submit(&mut d, spec(1, |_| {}), 1);
    d.apply(Command::CancelJob {
        job_id: queued.clone(),
        at_ms: 2,
    })
    .unwrap();
    d.launch_at(&running, &[("a", &["GPU-a-0"])], 3).unwrap();
    d.launch_at(&drained, &[("a", &["GPU-a-1"])], 3).unwrap();
    d.apply(Command::CancelJob {
        job_id: running.clone(),
        at_ms: 4,
    })
    .unwrap();
    report(&mut d, "job-2.0", TaskState::Killed, None, 5);
    use EventKind::*;
    assert_eq!(kinds(&d, &queued), [Queued, Cancelled]);
    assert_eq!(
        kinds(&d, &running),
        [Queued, Scheduled, Cancelling, Cancelled]
    );
    d.apply(Command::DrainAgent {
        agent_id: "a".into(),
        kill: true,
        deadline_ms: None,
        at_ms: 6,
    })
    .unwrap();
    report(&mut d, "job-3.0", TaskState::Killed, None, 7);
    assert_eq!(kinds(&d, &drained), [Queued, Scheduled, Drained, Requeued]);
    assert_eq!(
        events(&d, &drained)[3].1,
        "agent a drained: back in the queue (no retry used)"
    );
}

#[test]
fn events_stay_bounded_and_repeats_collapse_through_apply() {
    let mut d = Driver::new(&[("a", 1)]);
    let low = submit(&mut d, spec(1, |_| {}), 1);
    let mut t = 10;
    // Preempted by a new job each time: distinct words, so the ring fills
    // and the oldest go; the placement and start repeat, so they collapse.
    for n in 0..40 {
        d.launch_at(&low, &[("a", &["GPU-a-0"])], t).unwrap();
        let task = d.s.jobs[&low].task_ids.last().unwrap().clone();
        report(&mut d, &task, TaskState::Running, None, t + 1);
        let high = submit(&mut d, spec(1, |s| s.priority = 1), t + 2);
        d.apply(Command::PreemptJobs {
            job_id: high.clone(),
            victims: vec![low.clone()],
            at_ms: t + 3,
        })
        .unwrap();
        report(&mut d, &task, TaskState::Killed, None, t + 4);
        d.apply(Command::CancelJob {
            job_id: high,
            at_ms: t + 5,
        })
        .unwrap();
        t += 10;
        assert!(d.s.jobs[&low].events.len() <= MAX_EVENTS, "round {n}");
    }
    let ev = &d.s.jobs[&low].events;
    assert_eq!(ev.len(), MAX_EVENTS);
    assert!(ev.dropped() > 0);
    let scheduled = ev.iter().find(|e| e.kind == EventKind::Scheduled).unwrap();
    assert_eq!(scheduled.count, 40);
    assert_eq!((scheduled.first_ms, scheduled.last_ms), (10, 400));
    // Listed by last time.
    let last: Vec<u64> = ev.iter().map(|e| e.last_ms).collect();
    assert!(last.windows(2).all(|w| w[0] <= w[1]), "{last:?}");
}

#[test]
fn a_snapshot_carries_the_events_and_an_old_one_has_none() {
    let mut d = Driver::new(&[("a", 1)]);
    let j = submit(&mut d, spec(1, |_| {}), 1);
    d.launch_at(&j, &[("a", &["GPU-a-0"])], 2).unwrap();
    report(&mut d, "job-1.0", TaskState::Running, None, 3);
    let bytes = serde_json::to_vec(&d.s).unwrap();
    let restored: State = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(restored, d.s);
    assert_eq!(restored.jobs[&j].events.len(), 3);
    // A snapshot written before events existed restores with none.
    let mut v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    v["jobs"][&j].as_object_mut().unwrap().remove("events");
    let old: State = serde_json::from_value(v).unwrap();
    assert!(old.jobs[&j].events.is_empty());
    assert_eq!(old.jobs[&j].state, d.s.jobs[&j].state);
}
