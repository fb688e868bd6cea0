//! The promise the leader's task streams rely on: after any command, an
//! agent that `take_touched` does not name has the same desired task set
//! as before. Checked over random command sequences against every agent,
//! together with the derived indexes (`capacity`, the queue's) that apply
//! keeps up to date: always equal to ones built from scratch.

use std::collections::BTreeMap;

use gpuctl_core::types::{
    AgentId, FrameworkInfo, FrameworkTask, JobSpec, JobState, Resources, TaskId, TaskSpec,
    TaskState,
};
use proptest::prelude::*;

use super::testkit::{register, status, Driver};
use super::{Command, GpuHealthChange, Launch, State};

const AGENTS: usize = 4;
const GPUS: u32 = 4;
/// Far past any retention, so that forgetting is allowed.
const LATE_MS: u64 = 1 << 50;

#[derive(Debug, Clone)]
enum Op {
    Submit {
        gpus: u32,
        replicas: u32,
        retries: u32,
    },
    Launch {
        job: usize,
        agent: usize,
    },
    Status {
        task: usize,
        state: usize,
        uuid: u8,
    },
    Cancel {
        job: usize,
    },
    Unreachable {
        agent: usize,
    },
    Lost {
        agent: usize,
    },
    Register {
        agent: usize,
        keep: bool,
        rename: bool,
    },
    Drain {
        agent: usize,
        kill: bool,
    },
    Undrain {
        agent: usize,
    },
    Preempt {
        job: usize,
        victim: usize,
    },
    Forget {
        job: usize,
    },
    GpuHealth {
        agent: usize,
        gpu: u32,
        healthy: bool,
    },
    FrameworkLaunch {
        agent: usize,
        id: u8,
    },
    FrameworkKill {
        id: u8,
    },
    FrameworkAck {
        task: usize,
    },
    FrameworkRemove,
    FrameworkForget {
        task: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let a = 0..AGENTS;
    prop_oneof![
        3 => (1..=2u32, 1..=2u32, 0..=1u32)
            .prop_map(|(gpus, replicas, retries)| Op::Submit { gpus, replicas, retries }),
        4 => (0..8usize, a.clone()).prop_map(|(job, agent)| Op::Launch { job, agent }),
        4 => (0..16usize, 0..5usize, any::<u8>())
            .prop_map(|(task, state, uuid)| Op::Status { task, state, uuid }),
        1 => (0..8usize).prop_map(|job| Op::Cancel { job }),
        1 => a.clone().prop_map(|agent| Op::Unreachable { agent }),
        1 => a.clone().prop_map(|agent| Op::Lost { agent }),
        2 => (a.clone(), any::<bool>(), any::<bool>())
            .prop_map(|(agent, keep, rename)| Op::Register { agent, keep, rename }),
        1 => (a.clone(), any::<bool>()).prop_map(|(agent, kill)| Op::Drain { agent, kill }),
        1 => a.clone().prop_map(|agent| Op::Undrain { agent }),
        1 => (0..8usize, 0..8usize).prop_map(|(job, victim)| Op::Preempt { job, victim }),
        1 => (0..8usize).prop_map(|job| Op::Forget { job }),
        1 => (a.clone(), 0..GPUS, any::<bool>())
            .prop_map(|(agent, gpu, healthy)| Op::GpuHealth { agent, gpu, healthy }),
        2 => (a.clone(), 0..4u8).prop_map(|(agent, id)| Op::FrameworkLaunch { agent, id }),
        1 => (0..4u8).prop_map(|id| Op::FrameworkKill { id }),
        1 => (0..16usize).prop_map(|task| Op::FrameworkAck { task }),
        1 => Just(Op::FrameworkRemove),
        1 => (0..16usize).prop_map(|task| Op::FrameworkForget { task }),
    ]
}

fn agent_id(i: usize) -> AgentId {
    format!("a{i}")
}

/// `n` GPUs of `agent` that nobody holds.
fn free_gpus(s: &State, agent: &str, n: usize) -> Vec<String> {
    s.agent(agent)
        .map(|a| {
            a.info
                .gpus
                .iter()
                .filter(|g| s.gpu_owner(&g.uuid).is_none())
                .take(n)
                .map(|g| g.uuid.clone())
                .collect()
        })
        .unwrap_or_default()
}

fn nth<'a>(ids: impl Iterator<Item = &'a String>, n: usize) -> Option<String> {
    let ids: Vec<&String> = ids.collect();
    (!ids.is_empty()).then(|| ids[n % ids.len()].clone())
}

/// The command `op` stands for in state `s` (None: nothing to do).
fn command(s: &State, op: &Op, at_ms: u64, fw: &str) -> Option<Command> {
    let tasks = || s.tasks().keys();
    let jobs = || s.jobs().keys();
    Some(match *op {
        Op::Submit {
            gpus,
            replicas,
            retries,
        } => {
            let mut spec = JobSpec::new(
                "j",
                vec!["true".into()],
                Resources {
                    cpus: 1.0,
                    mem_mib: 0,
                    gpus,
                    ports: 0,
                },
            );
            spec.replicas = replicas;
            spec.max_retries = retries;
            Command::SubmitJob {
                spec,
                at_ms,
                request_id: None,
            }
        }
        Op::Launch { job, agent } => {
            let queued: Vec<&String> = s
                .jobs()
                .values()
                .filter(|j| j.state == JobState::Queued)
                .map(|j| &j.id)
                .collect();
            let job_id = nth(queued.into_iter(), job)?;
            let spec = &s.job(&job_id)?.spec;
            let launches = (0..spec.replicas() as usize)
                .map(|r| {
                    let a = agent_id((agent + r) % AGENTS);
                    Launch {
                        job_id: job_id.clone(),
                        gpu_uuids: free_gpus(s, &a, spec.template.resources.gpus as usize),
                        agent_id: a,
                    }
                })
                .collect();
            Command::LaunchTasks { launches, at_ms }
        }
        Op::Status { task, state, uuid } => {
            let t = s.task(&nth(tasks(), task)?)?;
            let state = [
                TaskState::Starting,
                TaskState::Running,
                TaskState::Finished,
                TaskState::Failed,
                TaskState::Killed,
            ][state];
            let mut u = status(&t.agent_id, &t.id, state);
            u.uuid = vec![uuid];
            Command::UpdateTaskStatus { update: u, at_ms }
        }
        Op::Cancel { job } => Command::CancelJob {
            job_id: nth(jobs(), job)?,
            at_ms,
        },
        Op::Unreachable { agent } => Command::AgentUnreachable {
            agent_id: agent_id(agent),
            at_ms,
        },
        Op::Lost { agent } => Command::AgentLostAfterTimeout {
            agent_id: agent_id(agent),
            at_ms,
        },
        Op::Register {
            agent,
            keep,
            rename,
        } => {
            let id = agent_id(agent);
            let Command::RegisterAgent { mut info, .. } = register(&id, GPUS) else {
                unreachable!("register makes a RegisterAgent")
            };
            if rename {
                info.hostname = format!("{id}.renamed{at_ms}");
            }
            let running_task_ids = if keep {
                s.tasks()
                    .values()
                    .filter(|t| t.agent_id == id && t.holds_resources())
                    .map(|t| t.id.clone())
                    .collect()
            } else {
                Vec::new()
            };
            Command::RegisterAgent {
                info,
                running_task_ids,
                at_ms,
            }
        }
        Op::Drain { agent, kill } => Command::DrainAgent {
            agent_id: agent_id(agent),
            kill,
            deadline_ms: None,
            at_ms,
        },
        Op::Undrain { agent } => Command::UndrainAgent {
            agent_id: agent_id(agent),
            at_ms,
        },
        Op::Preempt { job, victim } => Command::PreemptJobs {
            job_id: nth(jobs(), job)?,
            victims: vec![nth(jobs(), victim)?],
            at_ms,
        },
        Op::Forget { job } => Command::ForgetJobs {
            job_ids: vec![nth(jobs(), job)?],
            at_ms: LATE_MS,
        },
        Op::GpuHealth {
            agent,
            gpu,
            healthy,
        } => {
            let id = agent_id(agent);
            Command::SetGpuHealth {
                gpus: vec![GpuHealthChange {
                    uuid: format!("GPU-{id}-{gpu}"),
                    healthy,
                    reason: if healthy { "" } else { "xid 79" }.into(),
                }],
                agent_id: id,
                at_ms,
            }
        }
        Op::FrameworkLaunch { agent, id } => {
            let a = agent_id(agent);
            Command::LaunchFrameworkTasks {
                framework_id: fw.into(),
                tasks: vec![FrameworkTask {
                    task_id: format!("t{id}"),
                    gpu_uuids: free_gpus(s, &a, 1),
                    fraction: None,
                    agent_id: a,
                    image: None,
                    command: vec!["true".into()],
                    env: BTreeMap::new(),
                    resources: Resources {
                        cpus: 0.5,
                        mem_mib: 0,
                        gpus: 1,
                        ports: 0,
                    },
                }],
                group: false,
                at_ms,
            }
        }
        Op::FrameworkKill { id } => Command::KillTask {
            framework_id: fw.into(),
            framework_task_id: format!("t{id}"),
            at_ms,
        },
        Op::FrameworkAck { task } => {
            let t = s.task(&nth(tasks(), task)?)?;
            Command::AcknowledgeUpdate {
                framework_id: fw.into(),
                framework_task_id: t.framework_task_id.clone(),
                uuid: t.last_update_uuid.clone(),
            }
        }
        Op::FrameworkRemove => Command::RemoveFramework {
            framework_id: fw.into(),
            reason: "test".into(),
            at_ms,
        },
        Op::FrameworkForget { task } => Command::ForgetFrameworkTasks {
            task_ids: vec![nth(tasks(), task)?],
            at_ms: LATE_MS,
        },
    })
}

type Desired = BTreeMap<AgentId, (Vec<TaskSpec>, Vec<TaskId>)>;

fn desired(s: &State) -> Desired {
    (0..AGENTS)
        .map(agent_id)
        .map(|a| {
            let d = s.desired_tasks(&a);
            (a, d)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn an_agent_left_untouched_keeps_its_desired_tasks(ops in prop::collection::vec(op(), 1..60)) {
        let ids: Vec<(&str, u32)> = vec![("a0", GPUS), ("a1", GPUS), ("a2", GPUS), ("a3", GPUS)];
        let mut d = Driver::new(&ids);
        let fw = match d.apply(Command::SubscribeFramework {
            request_id: None,
            info: FrameworkInfo {
                id: String::new(),
                name: "f".into(),
                roles: vec![],
                gpu_capable: true,
                failover_timeout_ms: 1000,
                tenant: Default::default(),
            },
            at_ms: 1,
        }) {
            Ok(super::Outcome::FrameworkSubscribed { framework_id }) => framework_id,
            other => panic!("subscribe: {other:?}"),
        };
        d.s.take_touched();
        // Build the derived indexes now, so that every command below
        // refreshes them incrementally.
        let _ = d.s.capacity();
        let _ = d.s.queue_index();
        let start = [
            Op::Submit { gpus: 2, replicas: 2, retries: 1 },
            Op::Submit { gpus: 1, replicas: 1, retries: 0 },
            Op::Launch { job: 0, agent: 0 },
            Op::Launch { job: 0, agent: 3 },
        ];
        let mut applied = 0;
        for (n, op) in start.iter().chain(&ops).enumerate() {
            let at_ms = 1000 + n as u64 * 1000;
            let Some(cmd) = command(&d.s, op, at_ms, &fw) else { continue };
            let before = desired(&d.s);
            let ok = d.apply(cmd.clone()).is_ok();
            applied += usize::from(ok);
            let touched = d.s.take_touched();
            // The indexes kept up to date agree with ones built afresh.
            let cap = d.s.capacity();
            prop_assert!(matches!(cap, std::borrow::Cow::Borrowed(_)), "refreshed by apply");
            prop_assert_eq!(&*cap, &super::capacity::Capacity::build(&d.s), "capacity after {:?}", cmd);
            drop(cap);
            let q = d.s.queue_index();
            prop_assert!(matches!(q, std::borrow::Cow::Borrowed(_)));
            prop_assert_eq!(&*q, &super::derived::QueueIndex::build(&d.s), "queue after {:?}", cmd);
            drop(q);
            let after = desired(&d.s);
            for (agent, want) in &after {
                if !touched.contains(agent) {
                    prop_assert_eq!(
                        &before[agent], want,
                        "{} changed without being touched by {:?}", agent, cmd
                    );
                }
            }
        }
        // Every run starts with launches that go through.
        prop_assert!(applied >= 2, "{} commands applied", applied);
    }
}
