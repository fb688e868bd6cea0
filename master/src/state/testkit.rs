//! What tests that drive a state through commands share.

use gpuctl_core::types::{AgentInfo, GpuInfo, Resources, Runtime, StatusUpdate, TaskState};

use super::{ApplyError, Command, Launch, Outcome, State};

/// A state driven by commands, the log index counting up from 1.
pub struct Driver {
    pub s: State,
    pub i: u64,
}

impl Driver {
    /// A state with these agents (id, GPUs) registered.
    pub fn new(agents: &[(&str, u32)]) -> Driver {
        let mut d = Driver {
            s: State::new(),
            i: 0,
        };
        for (id, g) in agents {
            d.apply(register(id, *g)).unwrap();
        }
        d
    }

    pub fn apply(&mut self, c: Command) -> Result<Outcome, ApplyError> {
        self.i += 1;
        self.s.apply(self.i, &c)
    }

    /// One `LaunchTasks` of `job`: a task per (agent, GPUs), in rank order.
    pub fn launch_at(
        &mut self,
        job: &str,
        at: &[(&str, &[&str])],
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        let launches = at
            .iter()
            .map(|(a, g)| Launch {
                job_id: job.into(),
                agent_id: (*a).into(),
                gpu_uuids: g.iter().map(|s| s.to_string()).collect(),
            })
            .collect();
        self.apply(Command::LaunchTasks { launches, at_ms })
    }
}

/// A plain status update from `agent` about `task`: no exit code, message,
/// uuid or reason (set the fields a test needs).
pub fn status(agent: &str, task: &str, state: TaskState) -> StatusUpdate {
    StatusUpdate {
        agent_id: agent.into(),
        task_id: task.into(),
        state,
        exit_code: None,
        message: String::new(),
        uuid: Vec::new(),
        gpu_unhealthy: false,
        fenced: false,
    }
}

/// An agent `id` (hostname `<id>.host`) with `gpus` simulated A100s
/// (`GPU-<id>-<n>`), 64 CPUs and 1 TiB, running host processes, registering.
pub fn register(id: &str, gpus: u32) -> Command {
    Command::RegisterAgent {
        info: AgentInfo {
            id: id.into(),
            hostname: format!("{id}.host"),
            address: String::new(),
            total: Resources {
                cpus: 64.0,
                mem_mib: 1 << 20,
                gpus,
            },
            gpus: (0..gpus)
                .map(|i| GpuInfo::new(format!("GPU-{id}-{i}"), i, "A100", 40960))
                .collect(),
            runtimes: vec![Runtime::Process],
            simulated_gpus: true,
            attributes: Default::default(),
            driver_version: None,
            cuda_driver_version: None,
        },
        running_task_ids: vec![],
        at_ms: 0,
    }
}
