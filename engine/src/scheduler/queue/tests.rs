use super::*;
use crate::scheduler::{place, place_in, Available};
use crate::state::{Command, Launch, Outcome};
use gpuctl_core::types::{JobSpec, StatusUpdate, TaskState};

/// A state driven through commands, as the leader would.
struct H {
    s: State,
    i: u64,
}

impl H {
    fn new(agents: &[(&str, u32)]) -> H {
        let mut h = H {
            s: State::new(),
            i: 0,
        };
        for (id, gpus) in agents {
            h.apply(crate::state::testkit::register(id, *gpus));
        }
        h
    }

    fn apply(&mut self, c: Command) -> Outcome {
        self.i += 1;
        match self.s.apply(self.i, &c) {
            Ok(o) => o,
            Err(e) => panic!("{c:?}: {e}"),
        }
    }

    fn submit(&mut self, gpus: u32, priority: i32, replicas: u32) -> String {
        self.submit_as("", gpus, priority, replicas)
    }

    /// Submits a job of `tenant` ("": the default tenant).
    fn submit_as(&mut self, tenant: &str, gpus: u32, priority: i32, replicas: u32) -> String {
        let mut spec = JobSpec::new(
            "j",
            vec!["sleep".into()],
            Resources {
                cpus: 1.0,
                mem_mib: 0,
                gpus,
                ports: 0,
            },
        );
        spec.priority = priority;
        spec.replicas = replicas;
        spec.tenant = tenant.into();
        let at_ms = self.i;
        match self.apply(Command::SubmitJob {
            spec,
            at_ms,
            request_id: None,
        }) {
            Outcome::JobSubmitted { job_id } => job_id,
            o => panic!("{o:?}"),
        }
    }

    /// Places what fits now, as the built-in scheduler would with
    /// everything offered; returns the jobs started.
    fn schedule(&mut self) -> Vec<String> {
        let launches = place(&self.s, &Default::default(), &Default::default());
        let mut started = Vec::new();
        let mut by_job: BTreeMap<String, Vec<Launch>> = BTreeMap::new();
        for l in launches {
            by_job.entry(l.job_id.clone()).or_default().push(l);
        }
        for (job, launches) in by_job {
            let at_ms = self.i * 10;
            self.apply(Command::LaunchTasks { launches, at_ms });
            started.push(job);
        }
        started
    }

    /// Submits a job and starts it (it must fit).
    fn running(&mut self, gpus: u32, priority: i32) -> String {
        let j = self.submit(gpus, priority, 1);
        assert_eq!(self.schedule(), vec![j.clone()]);
        j
    }

    fn plan(&self) -> QueuePlan {
        plan(&self.s, &QueueConfig::default())
    }

    fn victims(&self) -> Vec<String> {
        self.plan()
            .preemption
            .map(|p| p.victims)
            .unwrap_or_default()
    }

    fn agent_of(&self, job: &str) -> String {
        self.s.latest_task(job).unwrap().agent_id.clone()
    }

    /// The task's agent reports it ended in `state`.
    fn report(&mut self, task_id: &str, state: TaskState, exit_code: Option<i32>) {
        let agent_id = self.s.tasks()[task_id].agent_id.clone();
        self.apply(Command::UpdateTaskStatus {
            update: StatusUpdate {
                gpu_memory_limit: false,
                enforcement: None,
                agent_id,
                task_id: task_id.to_string(),
                state,
                exit_code,
                message: String::new(),
                uuid: Vec::new(),
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
            at_ms: 0,
        });
    }

    /// Applies the plan's preemption and has the agents report the
    /// victims' tasks killed.
    fn preempt_and_stop(&mut self) -> Vec<String> {
        let p = self.plan().preemption.expect("a preemption");
        let victims = p.victims.clone();
        self.apply(Command::PreemptJobs {
            job_id: p.job_id,
            victims: p.victims,
            at_ms: 0,
        });
        for v in &victims {
            for t in self.s.jobs()[v].current_tasks().to_vec() {
                self.report(&t, TaskState::Killed, None);
            }
        }
        victims
    }
}

#[test]
fn a_tenant_over_its_gpu_quota_waits_and_others_run() {
    let mut h = H::new(&[("a", 9)]);
    h.apply(Command::SetQuota {
        stop_idle_after_ms: None,
        clear_stop_idle: false,
        borrow: None,
        clear_borrow: false,
        weight: None,
        tenant: "vision".into(),
        gpus: 3,
    });
    let v1 = h.submit_as("vision", 2, 0, 1);
    let v2 = h.submit_as("vision", 2, 0, 1);
    let v3 = h.submit_as("vision", 1, 0, 1);
    let n1 = h.submit_as("nlp", 4, 0, 1);
    let mut started = h.schedule();
    started.sort();
    // 2 + 1 of vision's fit its 3; the second 2 would make 5.
    let mut want = vec![v1, v3, n1];
    want.sort();
    assert_eq!(started, want);
    assert_eq!(
        h.plan().reasons[&v2].reason,
        WaitReason::TenantQuota {
            tenant: "vision".into(),
            quota: 3,
            used: 3,
            asked: 2,
        }
    );
    // Raised: it runs.
    h.apply(Command::SetQuota {
        stop_idle_after_ms: None,
        clear_stop_idle: false,
        borrow: None,
        clear_borrow: false,
        weight: None,
        tenant: "vision".into(),
        gpus: 5,
    });
    assert_eq!(h.schedule(), vec![v2]);
}

/// A job that needs a newer driver than some agents have: placed only
/// where it qualifies; waits, naming the newest driver, while none
/// does; runs once an agent with a new enough driver joins.
#[test]
fn jobs_go_only_to_agents_whose_driver_qualifies() {
    use crate::state::testkit::register_with_driver;
    use gpuctl_core::cuda_req::Expr;
    use gpuctl_core::wait::{DriverAsk, Requirement};
    let mut h = H::new(&[]);
    h.apply(register_with_driver("old", 2, "470.57.02", "11.4"));
    let submit = |h: &mut H, require: &str| {
        let mut spec = JobSpec::new(
            "j",
            vec!["sleep".into()],
            Resources {
                cpus: 1.0,
                mem_mib: 0,
                gpus: 1,
                ports: 0,
            },
        );
        spec.require_cuda = Some(Expr::parse(require).unwrap());
        let at_ms = h.i;
        match h.apply(Command::SubmitJob {
            spec,
            at_ms,
            request_id: None,
        }) {
            Outcome::JobSubmitted { job_id } => job_id,
            o => panic!("{o:?}"),
        }
    };
    let j = submit(&mut h, "cuda>=12.2");
    let any = h.submit(1, 0, 1);
    // The job without requirements takes the old agent; the other waits.
    assert_eq!(h.schedule(), vec![any.clone()]);
    let newest = |driver: &str, cuda: &str| WaitReason::NeverFits {
        why: NeverFits::Missing {
            need: Requirement::Driver(DriverAsk {
                requires: vec!["cuda>=12.2".into()],
                newest_driver: Some(driver.into()),
                newest_cuda: Some(cuda.into()),
            }),
            among: vec![],
            largest: None,
        },
        set_aside: SetAside::default(),
    };
    assert_eq!(h.plan().reasons[&j].reason, newest("470.57.02", "11.4"));
    h.apply(register_with_driver("mid", 1, "525.60.13", "12.0"));
    assert_eq!(h.plan().reasons[&j].reason, newest("525.60.13", "12.0"));
    assert!(h.schedule().is_empty());
    // A new enough agent joins: it runs there.
    h.apply(register_with_driver("new", 1, "535.129.03", "12.2"));
    assert_eq!(h.plan().reasons[&j].reason, WaitReason::Starting);
    assert_eq!(h.schedule(), vec![j.clone()]);
    assert_eq!(h.agent_of(&j), "new");
    // Another such job while that agent is busy waits for resources,
    // the others counted as left out for their driver.
    let j2 = submit(&mut h, "cuda>=12.2");
    match &h.plan().reasons[&j2].reason {
        WaitReason::Resources(c) => {
            assert_eq!((c.agents, c.filtered_driver, c.exhausted_gpus), (3, 2, 1))
        }
        other => panic!("{other:?}"),
    }
    assert!(h.schedule().is_empty(), "not on old or mid, which are free");
}

#[test]
fn a_job_never_preempts_another_tenants() {
    let mut h = H::new(&[("a", 2)]);
    let theirs = h.submit_as("nlp", 2, 0, 1);
    assert_eq!(h.schedule(), vec![theirs.clone()]);
    let mine = h.submit_as("vision", 2, 100, 1);
    assert!(h.plan().preemption.is_none(), "preempted across tenants");
    assert_ne!(
        h.plan().reasons[&mine].reason,
        WaitReason::Preempting {
            reclaim_from: Vec::new(),
            waiting_for_tasks: 1
        }
    );
    // Within a tenant, priority preempts as before.
    let own_low = h.submit_as("nlp", 0, 0, 1);
    let _ = own_low;
    let hi = h.submit_as("nlp", 2, 100, 1);
    let p = h.plan().preemption.expect("preempts within its tenant");
    assert_eq!((p.job_id, p.victims), (hi, vec![theirs]));
}

#[test]
fn the_lowest_priority_goes_first_even_when_a_higher_one_fits_better() {
    let mut h = H::new(&[("a", 4)]);
    let p1 = h.running(2, 1); // frees exactly 2
    let p0a = h.running(1, 0);
    let p0b = h.running(1, 0);
    let hi = h.submit(2, 5, 1);
    let mut v = h.victims();
    v.sort();
    assert_eq!(v, vec![p0a, p0b]);
    assert!(!v.contains(&p1));
    let r = &h.plan().reasons[&hi];
    assert_eq!(
        *r,
        Waiting {
            reason: WaitReason::Preempting {
                reclaim_from: Vec::new(),
                waiting_for_tasks: 2
            },
            requeued: None
        }
    );
}

#[test]
fn among_equals_one_that_covers_alone_with_the_least_excess() {
    // 8 GPUs: 1, 1, 2 and 4 held at priority 0; a 2-GPU job needs 2.
    let mut h = H::new(&[("a", 8)]);
    let ones = [h.running(1, 0), h.running(1, 0)];
    let two = h.running(2, 0);
    let four = h.running(4, 0);
    h.submit(2, 1, 1);
    assert_eq!(h.victims(), vec![two.clone()], "not {ones:?} nor {four}");
    // Needing 3: nothing covers alone but the 4 (excess 1); with
    // priority first it takes the 4 rather than 2 + 1.
    let mut h = H::new(&[("a", 8)]);
    let _one = h.running(1, 0);
    let _one2 = h.running(1, 0);
    let _two = h.running(2, 0);
    let four = h.running(4, 0);
    h.submit(3, 1, 1);
    assert_eq!(h.victims(), vec![four]);
}

#[test]
fn ties_go_to_the_most_recently_started() {
    let mut h = H::new(&[("a", 2)]);
    let _old = h.running(1, 0);
    let new = h.running(1, 0);
    h.submit(1, 3, 1);
    assert_eq!(h.victims(), vec![new]);
}

#[test]
fn never_more_than_needed() {
    // The priority-0 1-GPU job comes first, but the priority-1 2-GPU
    // job alone covers the need: the first is dropped again.
    let mut h = H::new(&[("a", 3)]);
    let _low1 = h.running(1, 0);
    let mid2 = h.running(2, 1);
    h.submit(2, 5, 1);
    assert_eq!(h.victims(), vec![mid2]);
}

#[test]
fn equal_or_higher_priority_is_never_preempted() {
    let mut h = H::new(&[("a", 2)]);
    h.running(2, 3);
    let eq = h.submit(1, 3, 1);
    let lower = h.submit(2, 0, 1);
    let p = h.plan();
    assert!(p.preemption.is_none());
    // The one agent could run them, but its GPUs are held.
    let busy = WaitReason::Resources(AgentCounts {
        agents: 1,
        exhausted_gpus: 1,
        ..Default::default()
    });
    assert_eq!(p.reasons[&eq].reason, busy, "{:?}", p.reasons);
    assert_eq!(p.reasons[&lower].reason, busy);
}

#[test]
fn the_agent_with_the_cheapest_victims_is_chosen() {
    let mut h = H::new(&[("a", 2), ("b", 2)]);
    let on_a = h.running(2, 2);
    let on_b = h.running(2, 1);
    assert_ne!(h.agent_of(&on_a), h.agent_of(&on_b));
    h.submit(2, 5, 1);
    assert_eq!(h.victims(), vec![on_b]);
}

#[test]
fn preempted_resources_are_kept_for_the_preemptor() {
    let mut h = H::new(&[("a", 4)]);
    let low = h.running(4, 0);
    let hi = h.submit(2, 5, 1);
    let p = h.plan().preemption.unwrap();
    assert_eq!(p.victims, vec![low.clone()]);
    h.apply(Command::PreemptJobs {
        job_id: p.job_id,
        victims: p.victims,
        at_ms: 0,
    });
    // While the victim stops: no second preemption, the preemptor
    // says why it waits, and the requeued victim cannot take the agent.
    let small = h.submit(1, 0, 1);
    let plan = h.plan();
    assert!(plan.preemption.is_none());
    assert_eq!(
        plan.reasons[&hi].reason,
        WaitReason::Preempting {
            reclaim_from: Vec::new(),
            waiting_for_tasks: 1
        }
    );
    h.report(&format!("{low}.0"), TaskState::Killed, None);
    // The victim, back in the queue, says by whom; the preemptor is
    // ahead of it on what is free.
    assert_eq!(
        h.plan().reasons[&low],
        Waiting {
            reason: WaitReason::Priority {
                blocked_by: Some(hi.clone()),
                kept_for_preemption: false
            },
            requeued: Some(Requeued {
                preempted_by: Some(hi.clone()),
                retries: 0,
                max_retries: 0,
                after: None
            })
        }
    );
    // Now the GPUs are free: the preemptor first, then what fits behind.
    let mut started = h.schedule();
    started.sort();
    assert_eq!(started, vec![hi.clone(), small.clone()]);
    assert_eq!(h.s.jobs()[&low].state, JobState::Queued);
}

#[test]
fn reserved_agents_are_not_backfilled_by_lower_priority() {
    let mut h = H::new(&[("a", 4)]);
    let a = h.running(2, 0);
    let _b = h.running(2, 0);
    // Frees 2 of 4 now... the preemptor needs all 4.
    let hi = h.submit(4, 5, 1);
    let victims = h.victims();
    assert_eq!(victims.len(), 2);
    let p = h.plan().preemption.unwrap();
    h.apply(Command::PreemptJobs {
        job_id: hi.clone(),
        victims: p.victims,
        at_ms: 0,
    });
    // One victim stops; its 2 GPUs are free but kept for the preemptor.
    h.report(&format!("{a}.0"), TaskState::Killed, None);
    let filler = h.submit(2, 0, 1);
    assert!(
        h.schedule().is_empty(),
        "nothing placed on the reserved agent"
    );
    assert_eq!(
        h.plan().reasons[&filler].reason,
        WaitReason::Priority {
            blocked_by: Some(hi.clone()),
            kept_for_preemption: true
        }
    );
    // A job of higher priority than the preemptor may use it.
    let urgent = h.submit(2, 9, 1);
    assert_eq!(h.schedule(), vec![urgent]);
}

#[test]
fn a_gang_preempts_all_it_needs_or_nothing() {
    let mut h = H::new(&[("a", 2), ("b", 2)]);
    let on_a = h.running(2, 0);
    let on_b = h.running(2, 0);
    h.submit(2, 5, 2);
    let mut v = h.victims();
    v.sort();
    assert_eq!(v, vec![on_a, on_b]);
    // With one agent held by a job of higher priority: no preemption at all.
    let mut h = H::new(&[("a", 2), ("b", 2)]);
    let _low = h.running(2, 0);
    let _high = h.running(2, 9);
    let g = h.submit(2, 5, 2);
    let p = h.plan();
    assert!(p.preemption.is_none());
    assert_eq!(
        p.reasons[&g].reason,
        WaitReason::Resources(AgentCounts {
            agents: 2,
            exhausted_gpus: 2,
            ..Default::default()
        })
    );
}

#[test]
fn preempting_a_gang_frees_all_its_ranks() {
    let mut h = H::new(&[("a", 2), ("b", 2)]);
    let gang = h.submit(2, 0, 2);
    assert_eq!(h.schedule(), vec![gang.clone()]);
    let hi = h.submit(2, 1, 1);
    assert_eq!(h.preempt_and_stop(), vec![gang.clone()]);
    assert_eq!(h.s.jobs()[&gang].state, JobState::Queued);
    assert!(h.s.gpu_owners().is_empty());
    assert_eq!(h.schedule(), vec![hi]);
    // The gang cannot run on what is left (one agent of 2): it waits.
    assert!(h.schedule().is_empty());
}

#[test]
fn a_gang_never_starts_partly() {
    let mut h = H::new(&[("a", 2), ("b", 2)]);
    let _filler = h.running(1, 0);
    let g = h.submit(2, 0, 2);
    assert!(h.schedule().is_empty());
    assert!(h.s.jobs()[&g].task_ids.is_empty());
    // One agent has room for one replica, not two.
    assert_eq!(
        h.plan().reasons[&g].reason,
        WaitReason::Resources(AgentCounts {
            agents: 2,
            exhausted_gpus: 1,
            fit_one: 1,
            ..Default::default()
        })
    );
    // One that could never fit says so.
    let big = h.submit(2, 0, 3);
    assert_eq!(
        h.plan().reasons[&big].reason,
        WaitReason::NeverFits {
            why: NeverFits::Gang {
                replicas: 3,
                gpus: 2
            },
            set_aside: SetAside::default()
        }
    );
}

#[test]
fn higher_priority_is_placed_first() {
    let mut h = H::new(&[("a", 2)]);
    let low = h.submit(2, 0, 1);
    let high = h.submit(2, 1, 1);
    assert_eq!(h.schedule(), vec![high]);
    assert_eq!(h.s.jobs()[&low].state, JobState::Queued);
    // Offers name only some agents: place_in keeps to them.
    let none: BTreeMap<String, Available> = BTreeMap::new();
    assert!(place_in(&h.s, &none, PlacementPolicy::Bundle, false, u64::MAX).is_empty());
}

#[test]
fn quota_of_the_jobs_role_is_a_reason_and_blocks_preemption() {
    let mut h = H::new(&[("a", 4)]);
    let _low = h.running(2, 0);
    let hi = h.submit(2, 5, 1);
    let cfg = QueueConfig {
        jobs_quota: Some(Resources {
            cpus: f64::MAX,
            mem_mib: u64::MAX,
            gpus: 3,
            ports: 0,
        }),
        ..Default::default()
    };
    let p = plan(&h.s, &cfg);
    assert!(p.preemption.is_none());
    let res = |gpus| Resources {
        cpus: 1.0,
        mem_mib: 0,
        gpus,
        ports: 0,
    };
    assert_eq!(
        p.reasons[&hi].reason,
        WaitReason::Quota {
            used: res(2),
            asked: res(2),
            limit: cfg.jobs_quota.unwrap(),
            over: vec![Dimension::Gpus]
        }
    );
}

#[test]
fn retried_jobs_say_so_and_keep_their_place() {
    let mut h = H::new(&[("a", 1)]);
    let mut spec = JobSpec::new("j", vec!["x".into()], Resources::default());
    spec.template.resources.gpus = 1;
    spec.max_retries = 2;
    // Restarted at once (the backoff's own test: scheduler::tests).
    spec.restart_backoff_ms = Some(0);
    let j = match h.apply(Command::SubmitJob {
        spec,
        at_ms: 0,
        request_id: None,
    }) {
        Outcome::JobSubmitted { job_id } => job_id,
        o => panic!("{o:?}"),
    };
    assert_eq!(h.schedule(), vec![j.clone()]);
    let later = h.submit(1, 0, 1);
    h.report(&format!("{j}.0"), TaskState::Failed, Some(2));
    let plan = h.plan();
    assert_eq!(
        plan.reasons[&j],
        Waiting {
            reason: WaitReason::Starting,
            requeued: Some(Requeued {
                preempted_by: None,
                retries: 1,
                max_retries: 2,
                after: Some(format!("task {j}.0 exited with code 2"))
            })
        }
    );
    assert_eq!(
        plan.reasons[&later],
        Waiting {
            reason: WaitReason::Priority {
                blocked_by: Some(j.clone()),
                kept_for_preemption: false
            },
            requeued: None
        }
    );
    assert_eq!(
        h.schedule(),
        vec![j.clone()],
        "submitted first, placed first"
    );
    assert_eq!(h.s.jobs()[&j].retries, 1);
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    /// Agents' GPU counts, running jobs (GPUs, priority) placed in
    /// order, and the job that arrives (GPUs, priority, replicas).
    type Scenario = (Vec<u32>, Vec<(u32, i32)>, (u32, i32, u32));

    fn scenario() -> impl Strategy<Value = Scenario> {
        (
            prop::collection::vec(1u32..=8, 1..=4),
            prop::collection::vec((1u32..=4, 0i32..4), 0..12),
            (1u32..=8, 0i32..5, 1u32..=3),
        )
    }

    fn build(agents: &[u32], running: &[(u32, i32)]) -> H {
        let names: Vec<String> = (0..agents.len()).map(|i| format!("n{i}")).collect();
        let list: Vec<(&str, u32)> = names
            .iter()
            .map(String::as_str)
            .zip(agents.iter().copied())
            .collect();
        let mut h = H::new(&list);
        for (gpus, prio) in running {
            let j = h.submit(*gpus, *prio, 1);
            h.schedule();
            if h.s.jobs()[&j].state == JobState::Queued {
                h.apply(Command::CancelJob {
                    job_id: j,
                    at_ms: 0,
                });
            }
        }
        h
    }

    /// Preempts `victims` for `job` (stopping their tasks) and says
    /// whether the job then starts.
    fn starts_after(h: &H, job: &str, victims: &[String]) -> bool {
        let mut h = H {
            s: h.s.clone(),
            i: h.i,
        };
        if !victims.is_empty() {
            h.apply(Command::PreemptJobs {
                job_id: job.to_string(),
                victims: victims.to_vec(),
                at_ms: 0,
            });
            for v in victims {
                for t in h.s.jobs()[v].current_tasks().to_vec() {
                    h.report(&t, TaskState::Killed, None);
                }
            }
        }
        h.schedule().iter().any(|j| j == job)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// Victims are of lower priority, enough, and (for one task) no
        /// more than needed; and when no preemption is planned, even
        /// preempting every lower-priority job would not help.
        #[test]
        fn preemption_is_sufficient_minimal_and_complete((agents, running, (gpus, prio, replicas)) in scenario()) {
            let mut h = build(&agents, &running);
            let job = h.submit(gpus, prio, replicas);
            if h.clone_fits(&job) {
                return Ok(());
            }
            let all_lower: Vec<String> = h
                .s
                .jobs()
                .values()
                .filter(|v| h.s.preemptible(prio, &v.id).is_ok())
                .map(|v| v.id.clone())
                .collect();
            match h.plan().preemption {
                Some(p) => {
                    prop_assert_eq!(&p.job_id, &job);
                    for v in &p.victims {
                        prop_assert!(h.s.jobs()[v].spec.priority < prio);
                    }
                    prop_assert!(starts_after(&h, &job, &p.victims), "victims {:?} not enough", p.victims);
                    if replicas == 1 {
                        for v in &p.victims {
                            let fewer: Vec<String> = p.victims.iter().filter(|x| *x != v).cloned().collect();
                            prop_assert!(!starts_after(&h, &job, &fewer), "{v} was not needed in {:?}", p.victims);
                        }
                    }
                }
                None => {
                    if replicas == 1 {
                        prop_assert!(!starts_after(&h, &job, &all_lower), "a preemption was possible");
                    }
                }
            }
        }
    }

    impl H {
        /// Whether the job would start without preempting.
        fn clone_fits(&mut self, job: &str) -> bool {
            starts_after(self, job, &[])
        }
    }
}
