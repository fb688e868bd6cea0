use super::*;
use crate::state::AgentState;
use crate::state::Launch;
use gpuctl_core::types::{
    AgentInfo, GpuInfo, JobSpec, Resources, Runtime, StatusUpdate, TaskState,
};

fn agent(id: &str, gpus: u32) -> AgentInfo {
    AgentInfo {
        share_gpus: None,
        allowed_users: None,
        id: id.into(),
        hostname: format!("{id}.local"),
        address: "127.0.0.1:7051".into(),
        total: Resources {
            cpus: 8.0,
            mem_mib: 16384,
            gpus,
            ports: 0,
        },
        gpus: (0..gpus)
            .map(|i| GpuInfo::new(format!("GPU-{id}-{i}"), i, "A100", 40960))
            .collect(),
        runtimes: vec![Runtime::Docker, Runtime::Process],
        simulated_gpus: true,
        attributes: Default::default(),
        driver_version: None,
        cuda_driver_version: None,
        allow_root_tasks: false,
        allowed_mounts: Vec::new(),
        ports: None,
    }
}

#[test]
fn a_repeated_submit_key_returns_the_first_job_until_it_expires() {
    let mut t = T::new();
    let submit = |key: &str, at_ms: u64| Command::SubmitJob {
        spec: spec(0),
        at_ms,
        request_id: Some(key.into()),
    };
    let first = t.apply(submit("k1", 1_000)).unwrap();
    let again = t.apply(submit("k1", 2_000)).unwrap();
    assert_eq!(first, again);
    assert_eq!(t.s.jobs.len(), 1, "no second job");
    t.apply(submit("k2", 3_000)).unwrap();
    assert_eq!(t.s.jobs.len(), 2);
    // After the TTL the key is forgotten (and only the old one).
    let later = 1_000 + super::super::SUBMIT_REQUEST_TTL_MS + 1;
    t.apply(submit("k3", later)).unwrap();
    assert!(!t.s.submit_requests.contains_key("k1"));
    assert!(t.s.submit_requests.contains_key("k2"));
    assert_eq!(t.s.submit_request_order.len(), 2);
    let fresh = t.apply(submit("k1", later + 1)).unwrap();
    assert_ne!(fresh, first);
    assert_eq!(t.s.jobs.len(), 4);
}

/// Request ids are scoped by their caller (`requests::request_key`):
/// two callers' same id makes two jobs, each caller's resend its own.
#[test]
fn submit_keys_are_per_caller() {
    let mut t = T::new();
    let submit = |scope: &str, at_ms: u64| Command::SubmitJob {
        spec: spec(0),
        at_ms,
        request_id: Some(super::super::requests::request_key(scope, "nightly")),
    };
    let a = t.apply(submit("aaaa", 1_000)).unwrap();
    let b = t.apply(submit("bbbb", 1_001)).unwrap();
    assert_ne!(a, b, "another caller's same id is another request");
    assert_eq!(t.apply(submit("aaaa", 1_002)).unwrap(), a);
    assert_eq!(t.apply(submit("bbbb", 1_003)).unwrap(), b);
    assert_eq!(t.s.jobs.len(), 2);
    let Outcome::JobSubmitted { job_id } = &a else {
        panic!("{a:?}")
    };
    assert_eq!(t.s.submitted_job("aaaa/nightly"), Some(job_id));
    assert_eq!(t.s.submitted_job("nightly"), None);
}

/// A key sent again with another spec (a job file edited, a form
/// changed after an unknown outcome) is refused, changing nothing,
/// rather than answered with the first job.
#[test]
fn a_submit_key_reused_for_another_spec_is_refused() {
    let mut t = T::new();
    let submit = |gpus: u32, at_ms: u64| Command::SubmitJob {
        spec: spec(gpus),
        at_ms,
        request_id: Some("k1".into()),
    };
    t.apply(submit(0, 1_000)).unwrap();
    let before = t.s.clone();
    let err = t.apply(submit(1, 2_000)).unwrap_err();
    assert_eq!(
        err,
        ApplyError::RequestIdReused {
            job_id: "job-1".into()
        }
    );
    assert!(err.to_string().contains("request_id"), "{err}");
    let mut after = t.s.clone();
    after.applied_index = before.applied_index;
    assert_eq!(after, before, "a refused submit changes nothing");
    // Past the TTL the key is free for another job.
    let later = 1_000 + super::super::SUBMIT_REQUEST_TTL_MS + 1;
    assert_eq!(
        t.apply(submit(1, later)).unwrap(),
        Outcome::JobSubmitted {
            job_id: "job-2".into()
        }
    );
}

fn spec(gpus: u32) -> JobSpec {
    JobSpec {
        placement: Default::default(),
        name: "j".into(),
        template: gpuctl_core::types::TaskTemplate {
            image: None,
            command: vec!["true".into()],
            env: Default::default(),
            resources: Resources {
                cpus: 1.0,
                mem_mib: 128,
                gpus,
                ports: 0,
            },
            ..Default::default()
        },
        ..Default::default()
    }
}

struct T {
    s: State,
    i: u64,
}

impl T {
    fn new() -> T {
        T {
            s: State::new(),
            i: 0,
        }
    }
    fn apply(&mut self, c: Command) -> Result<Outcome, ApplyError> {
        self.i += 1;
        self.s.apply(self.i, &c)
    }
    fn register(&mut self, id: &str, gpus: u32) {
        self.apply(Command::RegisterAgent {
            info: agent(id, gpus),
            running_task_ids: vec![],
            at_ms: 1,
        })
        .unwrap();
    }
    fn submit(&mut self, gpus: u32) -> String {
        match self
            .apply(Command::SubmitJob {
                spec: spec(gpus),
                at_ms: 2,
                request_id: None,
            })
            .unwrap()
        {
            Outcome::JobSubmitted { job_id } => job_id,
            o => panic!("{o:?}"),
        }
    }
    fn launch(&mut self, job: &str, agent: &str, gpus: &[&str]) -> Result<Outcome, ApplyError> {
        self.apply(Command::LaunchTasks {
            launches: vec![Launch {
                job_id: job.into(),
                agent_id: agent.into(),
                gpu_uuids: gpus.iter().map(|s| s.to_string()).collect(),
            }],
            at_ms: 3,
        })
    }
    fn status(&mut self, task: &str, agent: &str, state: TaskState, code: Option<i32>) -> Outcome {
        self.apply(Command::UpdateTaskStatus {
            update: StatusUpdate {
                gpu_memory_limit: false,
                enforcement: None,
                agent_id: agent.into(),
                task_id: task.into(),
                state,
                exit_code: code,
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
            at_ms: 4,
        })
        .unwrap()
    }
}

#[test]
fn job_lifecycle_to_success_frees_gpus() {
    let mut t = T::new();
    t.register("a1", 4);
    let j = t.submit(2);
    assert_eq!(j, "job-1");
    assert_eq!(t.s.queued_jobs().len(), 1);
    t.launch(&j, "a1", &["GPU-a1-0", "GPU-a1-1"]).unwrap();
    assert_eq!(t.s.jobs[&j].state, JobState::Starting);
    assert_eq!(t.s.gpu_owner.len(), 2);
    assert_eq!(t.s.agents["a1"].allocated.gpus, 2);
    assert_eq!(t.s.desired_tasks("a1").0.len(), 1);
    t.status("job-1.0", "a1", TaskState::Running, None);
    assert_eq!(t.s.jobs[&j].state, JobState::Running);
    t.status("job-1.0", "a1", TaskState::Finished, Some(0));
    assert_eq!(t.s.jobs[&j].state, JobState::Succeeded);
    assert!(t.s.gpu_owner.is_empty());
    assert_eq!(t.s.agents["a1"].allocated, Resources::default());
    assert!(t.s.desired_tasks("a1").0.is_empty());
    // A repeated final update is accepted and changes nothing.
    let before = t.s.clone();
    assert_eq!(
        t.status("job-1.0", "a1", TaskState::Finished, Some(0)),
        Outcome::StaleUpdate
    );
    assert_eq!(t.s.jobs, before.jobs);
}

#[test]
fn nonzero_exit_fails_the_job() {
    let mut t = T::new();
    t.register("a1", 0);
    let j = t.submit(0);
    t.launch(&j, "a1", &[]).unwrap();
    t.status("job-1.0", "a1", TaskState::Failed, Some(3));
    assert_eq!(t.s.jobs[&j].state, JobState::Failed);
    assert!(t.s.jobs[&j].message.contains("code 3"));
    assert_eq!(t.s.tasks["job-1.0"].exit_code, Some(3));
}

#[test]
fn a_gpu_is_never_given_twice() {
    let mut t = T::new();
    t.register("a1", 2);
    let j1 = t.submit(1);
    let j2 = t.submit(1);
    t.launch(&j1, "a1", &["GPU-a1-0"]).unwrap();
    let before = t.s.clone();
    let err = t.launch(&j2, "a1", &["GPU-a1-0"]).unwrap_err();
    assert!(matches!(err, ApplyError::GpuTaken { .. }), "{err}");
    // Refused: nothing changed but the applied index.
    assert_eq!(t.s.jobs, before.jobs);
    assert_eq!(t.s.gpu_owner, before.gpu_owner);
    // The same GPU twice in one command is refused too, all or nothing.
    let j3 = t.submit(1);
    let err = t
        .apply(Command::LaunchTasks {
            launches: vec![
                Launch {
                    job_id: j2.clone(),
                    agent_id: "a1".into(),
                    gpu_uuids: vec!["GPU-a1-1".into()],
                },
                Launch {
                    job_id: j3.clone(),
                    agent_id: "a1".into(),
                    gpu_uuids: vec!["GPU-a1-1".into()],
                },
            ],
            at_ms: 5,
        })
        .unwrap_err();
    assert!(matches!(err, ApplyError::GpuTaken { .. }));
    assert_eq!(t.s.jobs[&j2].state, JobState::Queued);
    assert_eq!(t.s.jobs[&j3].state, JobState::Queued);
}

#[test]
fn launch_checks_fit_runtime_and_gpu_ownership() {
    let mut t = T::new();
    t.register("a1", 1);
    t.register("a2", 1);
    let j = t.submit(1);
    assert!(matches!(
        t.launch(&j, "a1", &["GPU-a2-0"]),
        Err(ApplyError::DoesNotFit(_))
    ));
    assert!(matches!(
        t.launch(&j, "a1", &[]),
        Err(ApplyError::DoesNotFit(_))
    ));
    assert!(matches!(
        t.launch(&j, "nope", &["GPU-a1-0"]),
        Err(ApplyError::AgentNotFound(_))
    ));
    assert!(matches!(
        t.launch("job-99", "a1", &["GPU-a1-0"]),
        Err(ApplyError::JobNotFound(_))
    ));
    // CPU and memory count too.
    let mut big = spec(0);
    big.template.resources.cpus = 100.0;
    t.apply(Command::SubmitJob {
        spec: big,
        at_ms: 1,
        request_id: None,
    })
    .unwrap();
    assert!(matches!(
        t.launch("job-2", "a1", &[]),
        Err(ApplyError::DoesNotFit(_))
    ));
    // An image job needs an agent with Docker.
    let mut info = agent("a3", 0);
    info.runtimes = vec![Runtime::Process];
    t.apply(Command::RegisterAgent {
        info,
        running_task_ids: vec![],
        at_ms: 1,
    })
    .unwrap();
    let mut img = spec(0);
    img.template.image = Some("busybox".into());
    t.apply(Command::SubmitJob {
        spec: img,
        at_ms: 1,
        request_id: None,
    })
    .unwrap();
    let err = t.launch("job-3", "a3", &[]).unwrap_err();
    assert!(err.to_string().contains("docker"), "{err}");
}

#[test]
fn lost_agent_loses_its_tasks_but_holds_gpus_until_it_registers_again() {
    let mut t = T::new();
    t.register("a1", 2);
    let j = t.submit(2);
    t.launch(&j, "a1", &["GPU-a1-0", "GPU-a1-1"]).unwrap();
    t.status("job-1.0", "a1", TaskState::Running, None);
    t.apply(Command::AgentUnreachable {
        agent_id: "a1".into(),
        at_ms: 8,
    })
    .unwrap();
    assert_eq!(t.s.jobs[&j].state, JobState::Running);
    t.apply(Command::AgentLostAfterTimeout {
        agent_id: "a1".into(),
        at_ms: 9,
    })
    .unwrap();
    assert_eq!(t.s.agents["a1"].state, AgentState::Lost);
    assert_eq!(t.s.tasks["job-1.0"].state, TaskState::Lost);
    assert_eq!(t.s.jobs[&j].state, JobState::Failed);
    // The agent has not said the task is gone: its GPUs stay held.
    assert_eq!(t.s.gpu_owner.len(), 2);
    // A lost agent gets no launches until it registers again.
    let j2 = t.submit(1);
    assert!(matches!(
        t.launch(&j2, "a1", &["GPU-a1-0"]),
        Err(ApplyError::AgentLost(_))
    ));
    // Back without the task: its word that the task is gone.
    t.register("a1", 2);
    assert!(t.s.gpu_owner.is_empty());
    t.launch(&j2, "a1", &["GPU-a1-0"]).unwrap();
}

#[test]
fn reregistration_keeps_listed_tasks_and_loses_the_rest() {
    let mut t = T::new();
    t.register("a1", 2);
    let j1 = t.submit(1);
    let j2 = t.submit(1);
    t.launch(&j1, "a1", &["GPU-a1-0"]).unwrap();
    t.launch(&j2, "a1", &["GPU-a1-1"]).unwrap();
    let j3 = t.submit(0);
    t.launch(&j3, "a1", &[]).unwrap();
    t.status("job-2.0", "a1", TaskState::Running, None);
    t.apply(Command::RegisterAgent {
        info: agent("a1", 2),
        running_task_ids: vec!["job-1.0".into()],
        at_ms: 5,
    })
    .unwrap();
    assert_eq!(t.s.tasks["job-1.0"].state, TaskState::Staging);
    // It ran there and the agent no longer has it: lost.
    assert_eq!(t.s.tasks["job-2.0"].state, TaskState::Lost);
    // Placed while the agent was away: not lost, still to be delivered.
    assert_eq!(t.s.tasks["job-3.0"].state, TaskState::Staging);
    assert_eq!(t.s.desired_tasks("a1").0.len(), 2);
    assert_eq!(t.s.gpu_owner.len(), 1);
    assert_eq!(t.s.agents["a1"].allocated.gpus, 1);
}

#[test]
fn two_agents_cannot_claim_one_gpu() {
    let mut t = T::new();
    t.register("a1", 1);
    let mut info = agent("a2", 1);
    info.gpus[0].uuid = "GPU-a1-0".into();
    let err = t
        .apply(Command::RegisterAgent {
            info,
            running_task_ids: vec![],
            at_ms: 1,
        })
        .unwrap_err();
    assert!(matches!(err, ApplyError::GpuClaimed { .. }));
    assert!(!t.s.agents.contains_key("a2"));
}

#[test]
fn cancel_queued_and_running_jobs() {
    let mut t = T::new();
    t.register("a1", 1);
    let j1 = t.submit(1);
    let j2 = t.submit(1);
    t.launch(&j1, "a1", &["GPU-a1-0"]).unwrap();
    t.status("job-1.0", "a1", TaskState::Running, None);
    // Queued: cancelled at once.
    assert_eq!(
        t.apply(Command::CancelJob {
            job_id: j2.clone(),
            at_ms: 5
        })
        .unwrap(),
        Outcome::JobCancelled {
            state: JobState::Cancelled
        }
    );
    // Running: the task leaves the agent's desired set; the job is
    // CANCELLED once the agent reports it killed.
    t.apply(Command::CancelJob {
        job_id: j1.clone(),
        at_ms: 6,
    })
    .unwrap();
    assert!(t.s.desired_tasks("a1").0.is_empty());
    assert_eq!(t.s.jobs[&j1].state, JobState::Running);
    t.status("job-1.0", "a1", TaskState::Killed, None);
    assert_eq!(t.s.jobs[&j1].state, JobState::Cancelled);
    assert!(t.s.gpu_owner.is_empty());
    assert!(matches!(
        t.apply(Command::CancelJob {
            job_id: "job-42".into(),
            at_ms: 7
        }),
        Err(ApplyError::JobNotFound(_))
    ));
}

#[test]
fn updates_from_the_wrong_agent_or_backwards_are_refused() {
    let mut t = T::new();
    t.register("a1", 0);
    t.register("a2", 0);
    let j = t.submit(0);
    t.launch(&j, "a1", &[]).unwrap();
    assert!(matches!(
        t.apply(Command::UpdateTaskStatus {
            update: StatusUpdate {
                gpu_memory_limit: false,
                enforcement: None,
                agent_id: "a2".into(),
                task_id: "job-1.0".into(),
                state: TaskState::Finished,
                exit_code: Some(0),
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
            at_ms: 1
        }),
        Err(ApplyError::WrongAgent { .. })
    ));
    t.status("job-1.0", "a1", TaskState::Running, None);
    assert_eq!(
        t.status("job-1.0", "a1", TaskState::Starting, None),
        Outcome::StaleUpdate
    );
    assert_eq!(t.s.tasks["job-1.0"].state, TaskState::Running);
    assert_eq!(
        t.status("job-9.0", "a1", TaskState::Running, None),
        Outcome::StaleUpdate
    );
}

/// Issue 33: a GPU in MIG mode is never given whole, neither by the
/// scheduler nor by a launch naming it (CUDA would see none of it).
#[test]
fn a_gpu_in_mig_mode_is_never_given_whole() {
    let mut t = T::new();
    let mut info = agent("a1", 2);
    info.gpus[0].mig.enabled = true;
    t.apply(Command::RegisterAgent {
        info,
        running_task_ids: vec![],
        at_ms: 1,
    })
    .unwrap();
    let j = t.submit(1);
    let err = t.launch(&j, "a1", &["GPU-a1-0"]).unwrap_err();
    assert!(err.to_string().contains("MIG mode"), "{err}");
    assert!(t.s.gpu_owner.is_empty());
    let l = crate::scheduler::place(&t.s, &Default::default(), &Default::default());
    assert_eq!(l[0].gpu_uuids, vec!["GPU-a1-1".to_string()]);
    // A job needing both GPUs cannot be placed.
    let j2 = t.submit(2);
    let l = crate::scheduler::place(&t.s, &Default::default(), &Default::default());
    assert!(l.iter().all(|p| p.job_id != j2), "{l:?}");
}

#[test]
fn a_cordoned_gpu_is_not_launched_on_until_uncordoned() {
    let mut t = T::new();
    t.register("a1", 2);
    let j = t.submit(1);
    let cordon = |uuid: &str, cordon: bool| Command::CordonGpu {
        uuid: uuid.into(),
        cordon,
    };
    let err = t.apply(cordon("GPU-nope", true)).unwrap_err();
    assert!(err.to_string().contains("uuid"), "{err}");
    assert!(t.s.cordoned.is_empty());
    t.apply(cordon("GPU-a1-0", true)).unwrap();
    let err = t.launch(&j, "a1", &["GPU-a1-0"]).unwrap_err();
    assert!(err.to_string().contains("cordoned"), "{err}");
    // The scheduler does not pick it either.
    let l = crate::scheduler::place(&t.s, &Default::default(), &Default::default());
    assert_eq!(l[0].gpu_uuids, vec!["GPU-a1-1".to_string()]);
    // It survives the agent registering again; uncordon gives it back.
    t.register("a1", 2);
    assert!(t.s.cordoned.contains("GPU-a1-0"));
    t.apply(cordon("GPU-a1-0", false)).unwrap();
    t.launch(&j, "a1", &["GPU-a1-0"]).unwrap();
}

#[test]
fn gpu_health_changes_are_recorded_all_or_nothing() {
    let mut t = T::new();
    t.register("a1", 2);
    t.register("a2", 1);
    let j = t.submit(1);
    let health = |agent: &str, gpus: &[(&str, bool)]| Command::SetGpuHealth {
        agent_id: agent.into(),
        gpus: gpus
            .iter()
            .map(|(uuid, healthy)| crate::state::GpuHealthChange {
                uuid: uuid.to_string(),
                healthy: *healthy,
                reason: if *healthy {
                    String::new()
                } else {
                    "XID 79".into()
                },
            })
            .collect(),
        at_ms: 5,
    };
    // A GPU of another agent (or none): nothing is applied.
    let before = t.s.clone();
    let err = t
        .apply(health("a1", &[("GPU-a1-0", false), ("GPU-a2-0", false)]))
        .unwrap_err();
    assert!(err.to_string().contains("gpus"), "{err}");
    assert_eq!(t.s.agents, before.agents);
    assert!(t.apply(health("nope", &[])).is_err());
    t.apply(health("a1", &[("GPU-a1-0", false)])).unwrap();
    let g = &t.s.agents["a1"].info.gpus[0];
    assert!(!g.healthy);
    assert_eq!(g.unhealthy_reason, "XID 79");
    // Neither launched on nor chosen by the scheduler.
    let err = t.launch(&j, "a1", &["GPU-a1-0"]).unwrap_err();
    assert!(err.to_string().contains("unhealthy"), "{err}");
    let l = crate::scheduler::place(&t.s, &Default::default(), &Default::default());
    assert_ne!(l[0].gpu_uuids, vec!["GPU-a1-0".to_string()]);
    // Healthy again: the reason goes and the GPU can be used.
    t.apply(health("a1", &[("GPU-a1-0", true)])).unwrap();
    let g = &t.s.agents["a1"].info.gpus[0];
    assert!(g.healthy && g.unhealthy_reason.is_empty());
    t.launch(&j, "a1", &["GPU-a1-0"]).unwrap();
}

#[test]
fn apply_is_deterministic() {
    let cmds = [
        Command::RegisterAgent {
            info: agent("a1", 4),
            running_task_ids: vec![],
            at_ms: 1,
        },
        Command::SubmitJob {
            spec: spec(2),
            at_ms: 2,
            request_id: None,
        },
        Command::LaunchTasks {
            launches: vec![Launch {
                job_id: "job-1".into(),
                agent_id: "a1".into(),
                gpu_uuids: vec!["GPU-a1-2".into(), "GPU-a1-3".into()],
            }],
            at_ms: 3,
        },
        Command::AgentUnreachable {
            agent_id: "a1".into(),
            at_ms: 4,
        },
        Command::DrainAgent {
            agent_id: "a1".into(),
            kill: false,
            deadline_ms: Some(9),
            at_ms: 5,
        },
        Command::AgentLostAfterTimeout {
            agent_id: "a1".into(),
            at_ms: 6,
        },
        Command::AgentLost {
            agent_id: "a1".into(),
            at_ms: 7,
        },
        Command::ForgetJobs {
            job_ids: vec!["job-1".into()],
            at_ms: 8,
        },
    ];
    let run = || {
        let mut s = State::new();
        for (i, c) in cmds.iter().enumerate() {
            // Round-trip through the log encoding, as replay does.
            let c = Command::decode(&c.encode().unwrap()).unwrap();
            let _ = s.apply(i as u64 + 1, &c);
        }
        s
    };
    assert_eq!(run(), run());
    assert_eq!(run().applied_index, 8);
    // Its task is LOST but holds its GPUs (unconfirmed): kept.
    assert!(run().jobs.contains_key("job-1"));
}
