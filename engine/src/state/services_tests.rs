//! Services through the state machine: replicas as jobs that always
//! restart, scale, delete, and what a tenant may not do to a replica.

use gpuctl_core::types::{JobSpec, JobState, Resources, RestartPolicy, ServiceSpec, TaskState};

use super::testkit::{status, Driver};
use super::{ApplyError, Command, Outcome, KEPT_REPLICA_TASKS, REPLICA_BACKOFF_RESET_MS};

fn spec(name: &str, replicas: u32) -> ServiceSpec {
    let mut template = JobSpec::new(
        name,
        vec!["serve".into()],
        Resources {
            gpus: 1,
            cpus: 1.0,
            mem_mib: 256,
            ports: 0,
        },
    );
    template.restart_policy = RestartPolicy::Always;
    ServiceSpec {
        name: name.into(),
        replicas,
        template,
        drain_ms: None,
    }
}

fn create(d: &mut Driver, s: ServiceSpec, at_ms: u64) -> Result<String, ApplyError> {
    match d.apply(Command::CreateService { spec: s, at_ms })? {
        Outcome::ServiceCreated { id } => Ok(id),
        other => panic!("{other:?}"),
    }
}

fn replicas(d: &Driver, name: &str) -> Vec<String> {
    d.s.service_named(name).unwrap().replicas.clone()
}

/// Places and launches everything that fits, at `at_ms`.
fn run_all(d: &mut Driver, at_ms: u64) {
    let launches = d.place();
    d.apply(Command::LaunchTasks { launches, at_ms }).unwrap();
    let live: Vec<(String, String)> =
        d.s.tasks()
            .values()
            .filter(|t| t.state == TaskState::Staging)
            .map(|t| (t.agent_id.clone(), t.id.clone()))
            .collect();
    for (agent, task) in live {
        let update = status(&agent, &task, TaskState::Running);
        d.apply(Command::UpdateTaskStatus { update, at_ms })
            .unwrap();
    }
}

fn end(d: &mut Driver, job: &str, code: i32, at_ms: u64) {
    let task = d.s.job(job).unwrap().current_tasks()[0].clone();
    let agent = d.s.tasks()[&task].agent_id.clone();
    let mut update = status(&agent, &task, TaskState::Finished);
    if code != 0 {
        update.state = TaskState::Failed;
    }
    update.exit_code = Some(code);
    d.apply(Command::UpdateTaskStatus { update, at_ms })
        .unwrap();
}

#[test]
fn a_service_queues_one_job_per_replica_that_names_it() {
    let mut d = Driver::new(&[("a", 4)]);
    let id = create(&mut d, spec("llm", 3), 10).unwrap();
    assert_eq!(id, "svc-1");
    let jobs = replicas(&d, "llm");
    assert_eq!(jobs.len(), 3);
    for (i, j) in jobs.iter().enumerate() {
        let job = d.s.job(j).unwrap();
        assert_eq!(job.state, JobState::Queued);
        assert_eq!(job.spec.service.as_deref(), Some("svc-1"));
        assert_eq!(job.spec.restart_policy, RestartPolicy::Always);
        assert_eq!(job.spec.template.env["GPUCTL_SERVICE"], "llm");
        assert_eq!(job.spec.template.env["GPUCTL_REPLICA"], i.to_string());
    }
    // The same create again is the create resent; another spec is refused
    // without a change.
    assert_eq!(create(&mut d, spec("llm", 3), 20).unwrap(), "svc-1");
    let mut other = spec("llm", 3);
    other.template.template.command = vec!["other".into()];
    assert_eq!(
        create(&mut d, other, 30),
        Err(ApplyError::ServiceExists("llm".into()))
    );
    assert_eq!(d.s.jobs().len(), 3);
    run_all(&mut d, 40);
    assert!(jobs
        .iter()
        .all(|j| d.s.job(j).unwrap().state == JobState::Running));
    assert!(d.s.invariant_violations().is_empty());
}

#[test]
fn a_replica_that_ends_is_started_again_with_its_backoff_even_after_exit_0() {
    let mut d = Driver::new(&[("a", 1)]);
    create(&mut d, spec("llm", 1), 10).unwrap();
    let job = replicas(&d, "llm")[0].clone();
    run_all(&mut d, 20);
    end(&mut d, &job, 0, 1_000);
    let j = d.s.job(&job).unwrap();
    assert_eq!(j.state, JobState::Queued, "{}", j.message);
    assert_eq!(j.retries, 1);
    assert_eq!(j.not_before_ms, 2_000, "the first pause: 1 s");
    let last = j.events.iter().last().unwrap();
    assert_eq!(last.message, "exited with code 0; restart 1 in 1s");
    // Its GPU is free again, and it takes it back once its pause passed.
    run_all(&mut d, 2_000);
    end(&mut d, &job, 3, 3_000);
    let j = d.s.job(&job).unwrap();
    assert_eq!(j.state, JobState::Queued);
    assert_eq!((j.retries, j.not_before_ms), (2, 5_000), "doubled");
    // Far past any retry count a job may have: never FAILED.
    for n in 0..40u64 {
        let at = 10_000_000 * (n + 1);
        run_all(&mut d, at);
        end(&mut d, &job, 1, at + 1_000);
    }
    let j = d.s.job(&job).unwrap();
    assert_eq!(j.state, JobState::Queued);
    assert_eq!(j.retries, 42);
    // One that ran 10 minutes starts again from the first pause.
    let at = 1_000_000_000;
    run_all(&mut d, at);
    end(&mut d, &job, 1, at + REPLICA_BACKOFF_RESET_MS);
    let j = d.s.job(&job).unwrap();
    assert_eq!(j.retries, 1);
    assert_eq!(j.not_before_ms, at + REPLICA_BACKOFF_RESET_MS + 1_000);
    assert!(d.s.invariant_violations().is_empty());
}

#[test]
fn a_replica_keeps_its_latest_tasks_and_numbers_on() {
    let mut d = Driver::new(&[("a", 1)]);
    create(&mut d, spec("llm", 1), 10).unwrap();
    let job = replicas(&d, "llm")[0].clone();
    let runs = KEPT_REPLICA_TASKS as u64 + 5;
    for n in 0..runs {
        let at = 10_000_000 * (n + 1);
        run_all(&mut d, at);
        end(&mut d, &job, 1, at + 1_000);
    }
    let j = d.s.job(&job).unwrap();
    assert_eq!(j.task_ids.len(), KEPT_REPLICA_TASKS);
    assert_eq!(j.forgotten_tasks, 5);
    assert_eq!(j.task_ids[0], format!("{job}.5"));
    assert!(!d.s.tasks().contains_key(&format!("{job}.4")));
    run_all(&mut d, 10_000_000 * (runs + 1));
    let j = d.s.job(&job).unwrap();
    assert_eq!(j.current_tasks()[0], format!("{job}.{runs}"));
    assert_eq!(d.s.job(&job).unwrap().state, JobState::Running);
}

#[test]
fn a_replica_is_its_services_to_stop_and_scale_and_delete_stop_them() {
    let mut d = Driver::new(&[("a", 4)]);
    create(&mut d, spec("llm", 2), 10).unwrap();
    run_all(&mut d, 20);
    let jobs = replicas(&d, "llm");
    // A cancel of a replica (any caller's) is refused: nothing changes.
    let refused = d.apply(Command::CancelJob {
        job_id: jobs[0].clone(),
        at_ms: 30,
    });
    assert_eq!(
        refused,
        Err(ApplyError::ReplicaOfService {
            job_id: jobs[0].clone(),
            service: "llm".into()
        })
    );
    assert_eq!(d.s.job(&jobs[0]).unwrap().state, JobState::Running);
    // Up to 3: one more job; down to 1: the newest two are stopped.
    d.apply(Command::ScaleService {
        name: "llm".into(),
        replicas: 3,
        at_ms: 40,
    })
    .unwrap();
    let three = replicas(&d, "llm");
    assert_eq!(three.len(), 3);
    assert_eq!(three[..2], jobs[..]);
    d.apply(Command::ScaleService {
        name: "llm".into(),
        replicas: 1,
        at_ms: 50,
    })
    .unwrap();
    assert_eq!(replicas(&d, "llm"), vec![jobs[0].clone()]);
    assert!(d.s.job(&jobs[1]).unwrap().cancel_requested);
    assert_eq!(d.s.job(&three[2]).unwrap().state, JobState::Cancelled);
    assert_eq!(d.s.service_named("llm").unwrap().spec.replicas, 1);
    // The stopped replica's end is CANCELLED, not a restart.
    end(&mut d, &jobs[1], 0, 60);
    assert_eq!(d.s.job(&jobs[1]).unwrap().state, JobState::Cancelled);
    // Delete: the rest stopped, the name free for a new service.
    match d
        .apply(Command::DeleteService {
            name: "llm".into(),
            at_ms: 70,
        })
        .unwrap()
    {
        Outcome::ServiceDeleted { job_ids } => assert_eq!(job_ids, vec![jobs[0].clone()]),
        other => panic!("{other:?}"),
    }
    assert!(d.s.service_named("llm").is_none());
    assert!(d.s.job(&jobs[0]).unwrap().cancel_requested);
    end(&mut d, &jobs[0], 0, 80);
    assert_eq!(d.s.job(&jobs[0]).unwrap().state, JobState::Cancelled);
    assert_eq!(create(&mut d, spec("llm", 1), 90).unwrap(), "svc-2");
    for c in [
        Command::ScaleService {
            name: "gone".into(),
            replicas: 1,
            at_ms: 100,
        },
        Command::DeleteService {
            name: "gone".into(),
            at_ms: 100,
        },
    ] {
        assert_eq!(d.apply(c), Err(ApplyError::ServiceNotFound("gone".into())));
    }
    assert!(d.s.invariant_violations().is_empty());
}

#[test]
fn a_replica_on_a_lost_agent_is_placed_again_elsewhere() {
    let mut d = Driver::new(&[("a", 1), ("b", 1)]);
    create(&mut d, spec("llm", 1), 10).unwrap();
    let job = replicas(&d, "llm")[0].clone();
    run_all(&mut d, 20);
    let first = d.s.job(&job).unwrap().current_tasks()[0].clone();
    let agent = d.s.tasks()[&first].agent_id.clone();
    d.apply(Command::AgentUnreachable {
        agent_id: agent.clone(),
        at_ms: 30,
    })
    .unwrap();
    d.apply(Command::AgentLostAfterTimeout {
        agent_id: agent.clone(),
        at_ms: 40,
    })
    .unwrap();
    assert_eq!(d.s.job(&job).unwrap().state, JobState::Queued);
    run_all(&mut d, 100_000);
    let j = d.s.job(&job).unwrap();
    assert_eq!(j.state, JobState::Running);
    let now = &d.s.tasks()[&j.current_tasks()[0]];
    assert_ne!(now.agent_id, agent, "the lost agent's GPU is still held");
    assert!(d.s.invariant_violations().is_empty());
}

#[test]
fn replicas_beyond_the_tenants_cap_are_refused_naming_the_field() {
    let mut d = Driver::new(&[("a", 8)]);
    d.apply(Command::SetQuota {
        tenant: "team-a".into(),
        gpus: 2,
        borrow: None,
        clear_borrow: false,
        weight: None,
        stop_idle_after_ms: None,
        clear_stop_idle: false,
    })
    .unwrap();
    let mut s = spec("llm", 3);
    s.template.tenant = "team-a".into();
    match create(&mut d, s.clone(), 10) {
        Err(ApplyError::Invalid { field, reason }) => {
            assert_eq!(field, "replicas");
            assert!(reason.contains("need 3"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(d.s.service_named("llm").is_none());
    assert!(d.s.jobs().is_empty(), "nothing half-applied");
    s.replicas = 2;
    create(&mut d, s, 20).unwrap();
    let refused = d.apply(Command::ScaleService {
        name: "llm".into(),
        replicas: 3,
        at_ms: 30,
    });
    assert!(matches!(refused, Err(ApplyError::Invalid { ref field, .. }) if field == "replicas"));
    assert_eq!(replicas(&d, "llm").len(), 2);
}

/// A replica's readiness as its agent reports it: not ready until its
/// check passes, ready and not again as it changes (each change an event,
/// a repeat none), and a liveness stop restarts it, said as such.
#[test]
fn a_replica_serves_once_its_agent_says_ready_and_a_liveness_stop_restarts_it() {
    use gpuctl_core::types::TaskHealth;
    let mut d = Driver::new(&[("a", 2)]);
    let mut s = spec("llm", 1);
    s.template.template.options.port = vec!["http".into()];
    s.template.template.resources.ports = 1;
    s.template.template.options.readiness = Some("http:http/healthz".parse().unwrap());
    create(&mut d, s, 10).unwrap();
    run_all(&mut d, 20);
    let job = replicas(&d, "llm")[0].clone();
    let task = d.s.job(&job).unwrap().current_tasks()[0].clone();
    assert_eq!(d.s.job(&job).unwrap().state, JobState::Running);
    assert_eq!(
        d.s.job_ready(&job),
        (false, String::new()),
        "running, not yet ready"
    );
    let health = |d: &mut Driver, ready: bool, failure: &str, uuid: u8, at_ms: u64| {
        let mut u = status("a", &task, TaskState::Running);
        u.uuid = vec![uuid];
        u.health = Some(TaskHealth {
            ready,
            failure: failure.into(),
        });
        d.apply(Command::UpdateTaskStatus { update: u, at_ms })
            .unwrap()
    };
    let events = |d: &Driver| -> Vec<String> {
        d.s.job(&job)
            .unwrap()
            .events
            .iter()
            .filter(|e| e.kind.as_str() == "Ready" || e.kind.as_str() == "Unhealthy")
            .map(|e| format!("{} {}", e.kind.as_str(), e.message))
            .collect()
    };
    assert_eq!(health(&mut d, true, "", 1, 30), Outcome::Done);
    assert_eq!(d.s.job_ready(&job), (true, String::new()));
    // The same again (an agent restarted): no news.
    assert_eq!(health(&mut d, true, "", 2, 40), Outcome::StaleUpdate);
    assert_eq!(events(&d), ["Ready ready"]);
    let words = "readiness: GET /healthz (port 31000): HTTP 503";
    health(&mut d, false, words, 3, 50);
    assert_eq!(d.s.job_ready(&job), (false, words.to_string()));
    assert_eq!(
        events(&d),
        ["Ready ready", &format!("Unhealthy not ready: {words}")]
    );

    // Stopped for its liveness check: FAILED, LIVENESS_FAILED, restarted.
    let mut fin = status("a", &task, TaskState::Failed);
    fin.uuid = vec![4];
    fin.liveness_failed = true;
    fin.exit_code = Some(143);
    fin.message = "liveness: TCP http (port 31000): connection refused (3 in a row)".into();
    d.apply(Command::UpdateTaskStatus {
        update: fin,
        at_ms: 60,
    })
    .unwrap();
    let t = &d.s.tasks()[&task];
    assert_eq!(t.reason, super::TaskReason::LivenessFailed);
    assert!(!t.ready(true));
    let j = d.s.job(&job).unwrap();
    assert_eq!(j.state, JobState::Queued, "restarted: {:?}", j.message);
    assert!(
        events(&d)
            .last()
            .unwrap()
            .contains("connection refused (3 in a row)"),
        "{:?}",
        events(&d)
    );
    // A late report of the ended task changes nothing.
    assert_eq!(health(&mut d, true, "", 5, 70), Outcome::StaleUpdate);
    assert!(!d.s.job_ready(&job).0);
}

/// A service's endpoints: its replicas whose task runs, at the agent's
/// address host and the task's first host port, ready or not; an
/// unreachable one is left out.
#[test]
fn endpoints_are_the_running_replicas_at_their_agents_host_and_first_port() {
    use gpuctl_core::types::TaskHealth;
    let mut d = Driver::new(&[("a", 2), ("b", 2)]);
    let mut s = spec("llm", 2);
    s.template.template.options.port = vec!["http".into()];
    s.template.template.resources.ports = 1;
    s.template.template.options.readiness = Some("tcp:http".parse().unwrap());
    create(&mut d, s, 10).unwrap();
    assert!(
        d.s.service_endpoints(d.s.service_named("llm").unwrap())
            .is_empty(),
        "queued"
    );
    run_all(&mut d, 20);
    let eps = d.s.service_endpoints(d.s.service_named("llm").unwrap());
    assert_eq!(eps.len(), 2);
    for (i, e) in eps.iter().enumerate() {
        assert_eq!(e.replica as usize, i);
        assert_eq!(e.host, format!("{}.host", e.agent_id));
        assert_eq!(e.port, d.s.tasks()[&e.task_id].ports.first().copied());
        assert!(e.port.is_some());
        assert!(!e.ready, "not ready before its check passes");
    }
    let first = eps[0].clone();
    let mut u = status(&first.agent_id, &first.task_id, TaskState::Running);
    u.uuid = vec![9];
    u.health = Some(TaskHealth {
        ready: true,
        failure: String::new(),
    });
    d.apply(Command::UpdateTaskStatus {
        update: u,
        at_ms: 30,
    })
    .unwrap();
    let eps = d.s.service_endpoints(d.s.service_named("llm").unwrap());
    assert!(eps[0].ready && !eps[1].ready);
    // Its agent stops heartbeating: the replica is unreachable, not listed.
    d.apply(Command::AgentUnreachable {
        agent_id: first.agent_id.clone(),
        at_ms: 40,
    })
    .unwrap();
    let eps = d.s.service_endpoints(d.s.service_named("llm").unwrap());
    assert!(eps.iter().all(|e| e.agent_id != first.agent_id), "{eps:?}");
}

/// A replica that leaves a service with a port drains: it runs on, out of
/// the service and its endpoints, until its drain ends and `EndDrains`
/// stops it; one that ends meanwhile ends for good (no restart).
#[test]
fn a_leaving_replica_drains_before_it_is_stopped() {
    let mut d = Driver::new(&[("a", 4)]);
    let mut s = spec("llm", 3);
    s.template.template.options.port = vec!["http".into()];
    s.template.template.resources.ports = 1;
    s.drain_ms = Some(5_000);
    create(&mut d, s, 10).unwrap();
    run_all(&mut d, 20);
    let jobs = replicas(&d, "llm");
    d.apply(Command::ScaleService {
        name: "llm".into(),
        replicas: 1,
        at_ms: 100,
    })
    .unwrap();
    assert_eq!(replicas(&d, "llm"), vec![jobs[0].clone()]);
    for j in &jobs[1..] {
        let job = d.s.job(j).unwrap();
        assert_eq!(job.state, JobState::Running, "still serving what it has");
        assert!(!job.cancel_requested);
        assert!(job.events.iter().any(|e| e.kind.as_str() == "Draining"));
    }
    let eps = d.s.service_endpoints(d.s.service_named("llm").unwrap());
    assert_eq!(eps.len(), 1, "out of the endpoints at once");
    let last =
        d.s.service_named("llm")
            .unwrap()
            .events
            .iter()
            .last()
            .unwrap()
            .message
            .clone();
    assert_eq!(last, "from 3 to 1 (the leaving draining 5s)");
    assert!(!d.s.drains_due(5_099));
    // Replica 2 ends by itself while draining: for good, not restarted.
    end(&mut d, &jobs[2], 0, 2_000);
    assert_eq!(d.s.job(&jobs[2]).unwrap().state, JobState::Succeeded);
    assert!(d.s.drains_due(2_001), "an ended drain is forgotten");
    d.apply(Command::EndDrains { at_ms: 2_001 }).unwrap();
    assert_eq!(d.s.draining().count(), 1);
    assert!(!d.s.job(&jobs[1]).unwrap().cancel_requested);
    // Replica 1's drain ends: stopped, and its end is CANCELLED.
    assert!(d.s.drains_due(5_100));
    d.apply(Command::EndDrains { at_ms: 5_100 }).unwrap();
    assert!(d.s.job(&jobs[1]).unwrap().cancel_requested);
    assert_eq!(d.s.draining().count(), 0);
    end(&mut d, &jobs[1], 143, 5_200);
    assert_eq!(d.s.job(&jobs[1]).unwrap().state, JobState::Cancelled);

    // Delete: the service and its name go at once, its replica drains.
    d.apply(Command::DeleteService {
        name: "llm".into(),
        at_ms: 6_000,
    })
    .unwrap();
    assert!(d.s.service_named("llm").is_none());
    assert_eq!(d.s.job(&jobs[0]).unwrap().state, JobState::Running);
    assert_eq!(
        d.s.draining()
            .map(|(j, u)| (j.clone(), u))
            .collect::<Vec<_>>(),
        vec![(jobs[0].clone(), 11_000)]
    );
    d.apply(Command::EndDrains { at_ms: 11_000 }).unwrap();
    assert!(d.s.job(&jobs[0]).unwrap().cancel_requested);
}
