//! What tests that drive a state through commands share: this crate's and,
//! through the `testkit` feature, the master's. Test support only, so it may
//! panic like a test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gpuctl_core::types::{
    AgentInfo, GpuInfo, PortRange, Resources, Runtime, StatusUpdate, TaskState,
};

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

    /// Submits `spec` (at 1 ms, no request id); returns the job's id.
    pub fn submit(&mut self, spec: gpuctl_core::types::JobSpec) -> String {
        match self.apply(Command::SubmitJob {
            spec,
            at_ms: 1,
            request_id: None,
        }) {
            Ok(Outcome::JobSubmitted { job_id }) => job_id,
            other => panic!("submit: {other:?}"),
        }
    }

    /// The built-in scheduler's launches on everything free.
    pub fn place(&self) -> Vec<Launch> {
        crate::scheduler::place(&self.s, &Default::default(), &Default::default())
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
        gpu_memory_limit: false,
        enforcement: None,
        agent_id: agent.into(),
        task_id: task.into(),
        state,
        exit_code: None,
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
    }
}

/// An agent `id` (hostname `<id>.host`, address `<id>.host:7051`) with
/// `gpus` simulated A100s (`GPU-<id>-<n>`), 64 CPUs, 1 TiB and ports
/// 31000-31009, running host processes, registering.
pub fn register(id: &str, gpus: u32) -> Command {
    Command::RegisterAgent {
        info: AgentInfo {
            share_gpus: None,
            allowed_users: None,
            id: id.into(),
            hostname: format!("{id}.host"),
            address: format!("{id}.host:7051"),
            total: Resources {
                cpus: 64.0,
                mem_mib: 1 << 20,
                gpus,
                ports: 10,
            },
            gpus: (0..gpus)
                .map(|i| GpuInfo::new(format!("GPU-{id}-{i}"), i, "A100", 40960))
                .collect(),
            runtimes: vec![Runtime::Process],
            simulated_gpus: true,
            attributes: Default::default(),
            driver_version: None,
            cuda_driver_version: None,
            allow_root_tasks: false,
            allowed_mounts: Vec::new(),
            ports: Some(PortRange {
                start: 31000,
                end: 31009,
            }),
        },
        running_task_ids: vec![],
        at_ms: 0,
    }
}

/// [`register`] with the driver and CUDA versions NVML would report.
pub fn register_with_driver(id: &str, gpus: u32, driver: &str, cuda: &str) -> Command {
    let mut c = register(id, gpus);
    if let Command::RegisterAgent { info, .. } = &mut c {
        info.driver_version = Some(driver.into());
        info.cuda_driver_version = Some(cuda.into());
    }
    c
}

impl State {
    /// What breaks the state's cross-references, in words (empty: none):
    /// a job naming a task that is missing or not its own, a job's task
    /// whose job does not list it, a GPU held by a missing task or by one
    /// that holds nothing, an agent's `allocated` that is not the sum of
    /// its holding tasks, a GPU in MIG mode held whole or together with one
    /// of its MIG devices, a submit key naming a job never given, or the two
    /// key indexes disagreeing.
    pub fn invariant_violations(&self) -> Vec<String> {
        let mut bad = Vec::new();
        if !self.tasks.index_agrees() {
            bad.push("the tasks' index by agent disagrees with the tasks".to_string());
        }
        if !self.agents.index_agrees() {
            bad.push("the agents' index by GPU disagrees with the agents".to_string());
        }
        for (id, j) in &self.jobs {
            for t in &j.task_ids {
                match self.tasks.get(t) {
                    None => bad.push(format!("job {id} names missing task {t}")),
                    Some(t) if &t.job_id != id => {
                        bad.push(format!("job {id} names task {} of {}", t.id, t.job_id))
                    }
                    Some(_) => {}
                }
            }
        }
        for (id, t) in &self.tasks {
            if !t.job_id.is_empty()
                && !self
                    .jobs
                    .get(&t.job_id)
                    .is_some_and(|j| j.task_ids.contains(id))
            {
                bad.push(format!("task {id} of job {} not listed by it", t.job_id));
            }
        }
        for (gpu, owner) in &self.gpu_owner {
            match self.tasks.get(owner) {
                None => bad.push(format!("GPU {gpu} held by missing task {owner}")),
                Some(t) if !t.holds_resources() => bad.push(format!(
                    "GPU {gpu} held by task {owner}, which holds nothing"
                )),
                Some(_) => {}
            }
        }
        // A GPU in MIG mode is never held whole, nor a MIG device with its
        // parent.
        for a in self.agents.values() {
            for g in &a.info.gpus {
                let whole = self.gpu_owner.get(&g.uuid);
                if let (true, Some(t)) = (g.mig.enabled, whole) {
                    bad.push(format!("GPU {} in MIG mode held whole by {t}", g.uuid));
                }
                for d in &g.mig.devices {
                    if let (Some(t), Some(p)) = (self.gpu_owner.get(&d.uuid), whole) {
                        bad.push(format!(
                            "MIG device {} held by {t} while its GPU is held by {p}",
                            d.uuid
                        ));
                    }
                }
            }
        }
        for (id, a) in &self.agents {
            let held = self
                .tasks
                .values()
                .filter(|t| &t.agent_id == id && t.holds_resources())
                .fold(gpuctl_core::types::Resources::default(), |acc, t| {
                    acc.add(&t.resources)
                });
            if held.gpus != a.allocated.gpus
                || held.mem_mib != a.allocated.mem_mib
                || held.ports != a.allocated.ports
                || (held.cpus - a.allocated.cpus).abs() > 1e-6
            {
                bad.push(format!(
                    "agent {id} allocated {:?}, its tasks hold {held:?}",
                    a.allocated
                ));
            }
        }
        // No host port held twice on one agent; each task holds as many
        // as it asked for.
        let mut port_owner: std::collections::BTreeMap<(&str, u16), &str> = Default::default();
        for t in self.tasks.values() {
            if !t.ports.is_empty() && t.ports.len() != t.resources.ports as usize {
                bad.push(format!(
                    "task {} holds {} ports, asked for {}",
                    t.id,
                    t.ports.len(),
                    t.resources.ports
                ));
            }
            if !t.holds_resources() {
                continue;
            }
            for p in &t.ports {
                if let Some(other) = port_owner.insert((t.agent_id.as_str(), *p), &t.id) {
                    bad.push(format!(
                        "port {p} of agent {} held by {other} and {}",
                        t.agent_id, t.id
                    ));
                }
            }
        }
        for (key, (job_id, at)) in &self.submit_requests {
            if !self.jobs.contains_key(job_id) && !self.job_forgotten(job_id) {
                bad.push(format!("submit key {key} names job {job_id}, never given"));
            }
            if !self.submit_request_order.contains(&(*at, key.clone())) {
                bad.push(format!("submit key {key} missing from the order"));
            }
        }
        if self.submit_request_order.len() != self.submit_requests.len() {
            bad.push("submit key indexes differ in size".into());
        }
        bad
    }
}
