//! The framework's protocol logic, without I/O.
//!
//! [`Plan`] keeps the state of every task and answers the master's events
//! with plain data: which offers to accept (and with which tasks) or decline,
//! whether an update needs an acknowledgement, when to relaunch a task, when
//! to suppress or revive offers, and when the run is over. `main.rs` turns
//! these answers into gRPC calls.

use std::collections::HashSet;

use gpuctl_proto::pb::{self, Reason, TaskState};

/// What each task asks for besides its GPUs.
pub const TASK_CPUS: f64 = 0.1;
pub const TASK_MEM_MIB: u64 = 32;
/// Filters sent with an Accept: the rest of a used offer comes back soon.
pub const ACCEPT_REFUSE_SECS: f64 = 1.0;
/// Filters sent with a Decline.
pub const DECLINE_REFUSE_SECS: f64 = 5.0;
/// A task that ends in ERROR or LOST is launched again this many times.
pub const MAX_RELAUNCHES: u32 = 1;

/// Tolerance when subtracting fractional CPUs.
const CPU_EPSILON: f64 = 1e-9;

/// What to run.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// How many tasks in all.
    pub tasks: usize,
    /// The first `gpu_tasks` tasks need `gpus_per_task` GPUs each; the rest none.
    pub gpu_tasks: usize,
    pub gpus_per_task: u32,
    /// Not 0: each GPU task takes this much (MiB) of a shared GPU's memory
    /// (`Offer.shared_gpus`, `TaskInfo.gpu_fraction`) instead of GPUs.
    pub gpu_mem_mib: u64,
    /// Container image; empty runs the command as a host process.
    pub image: String,
    pub command: Vec<String>,
}

impl Config {
    pub fn validate(&self) -> Result<(), String> {
        if self.tasks == 0 {
            return Err("--tasks must be at least 1".into());
        }
        if self.gpu_tasks > self.tasks {
            return Err(format!(
                "--gpu-tasks ({}) is more than --tasks ({})",
                self.gpu_tasks, self.tasks
            ));
        }
        if self.gpu_tasks > 0 && self.gpus_per_task == 0 {
            return Err("--gpus-per-task must be at least 1 when --gpu-tasks is set".into());
        }
        if self.gpu_mem_mib > 0 && self.gpus_per_task != 1 {
            return Err("--gpu-mem gives each GPU task a fraction of one shared GPU: --gpus-per-task must be 1".into());
        }
        if self.command.is_empty() {
            return Err("no command given (put it after --)".into());
        }
        Ok(())
    }

    fn gpus_for(&self, index: usize) -> usize {
        if index < self.gpu_tasks {
            self.gpus_per_task as usize
        } else {
            0
        }
    }
}

/// One of the tasks the user asked for, in its latest attempt.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    pub index: usize,
    /// 0 for the first launch, 1 after a relaunch.
    pub attempt: u32,
    /// `None`: waiting for an offer.
    pub state: Option<TaskState>,
    pub exit_code: Option<i32>,
    pub agent_id: String,
    pub gpus: Vec<String>,
}

impl Task {
    /// `task-<i>` for the first attempt, `task-<i>-r<n>` for relaunches.
    pub fn id(&self) -> String {
        match self.attempt {
            0 => format!("task-{}", self.index),
            n => format!("task-{}-r{n}", self.index),
        }
    }

    pub fn is_terminal(&self) -> bool {
        self.state.is_some_and(is_terminal)
    }

    /// FINISHED with exit code 0 (a FINISHED update without a code counts as 0).
    pub fn succeeded(&self) -> bool {
        self.state == Some(TaskState::TaskFinished) && self.exit_code.unwrap_or(0) == 0
    }

    /// `PENDING` before launch, otherwise the state without its `TASK_` prefix.
    pub fn state_name(&self) -> &'static str {
        self.state.map_or("PENDING", state_name)
    }
}

pub fn is_terminal(state: TaskState) -> bool {
    matches!(
        state,
        TaskState::TaskFinished
            | TaskState::TaskFailed
            | TaskState::TaskKilled
            | TaskState::TaskLost
            | TaskState::TaskError
    )
}

/// `RUNNING` for `TASK_RUNNING`.
pub fn state_name(state: TaskState) -> &'static str {
    let name = state.as_str_name();
    name.strip_prefix("TASK_").unwrap_or(name)
}

/// The answer to one OFFERS event: every offer is either accepted or declined.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Decision {
    /// One Accept per used offer: its id and the tasks to LAUNCH on it.
    pub accepts: Vec<(String, Vec<pb::TaskInfo>)>,
    /// Offers to Decline.
    pub declines: Vec<String>,
}

/// What to do about one UPDATE.
#[derive(Debug, Clone, PartialEq)]
pub struct UpdateOutcome {
    /// The line to print, e.g. `task-3 FINISHED exit=0`.
    pub line: String,
    /// Whether to Acknowledge it (it carries a uuid).
    pub ack: bool,
}

/// A call that changes whether the master sends offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OfferControl {
    Suppress,
    Revive,
}

/// What we believe about the master's offers to us.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OfferFlow {
    Flowing,
    Suppressed,
    /// After a re-subscription: the master may have kept either.
    Unknown,
}

#[derive(Debug)]
pub struct Plan {
    config: Config,
    tasks: Vec<Task>,
    offers: OfferFlow,
}

impl Plan {
    pub fn new(config: Config) -> Self {
        let tasks = (0..config.tasks)
            .map(|index| Task {
                index,
                attempt: 0,
                state: None,
                exit_code: None,
                agent_id: String::new(),
                gpus: Vec::new(),
            })
            .collect();
        Plan {
            config,
            tasks,
            offers: OfferFlow::Flowing,
        }
    }

    pub fn tasks(&self) -> &[Task] {
        &self.tasks
    }

    /// Packs the waiting tasks into `offers`, greedily and in task order.
    /// Launched tasks become STAGING.
    pub fn on_offers(&mut self, offers: &[pb::Offer]) -> Decision {
        let Plan { config, tasks, .. } = self;
        // GPUs our live tasks hold: never given out twice, even if an offer
        // (stale, or from a confused master) names them.
        let mut used: HashSet<String> = tasks
            .iter()
            .filter(|t| t.state.is_some() && !t.is_terminal())
            .flat_map(|t| t.gpus.iter().cloned())
            .collect();
        let mut decision = Decision::default();
        for offer in offers {
            let res = offer.resources.unwrap_or_default();
            let (mut cpus, mut mem) = (res.cpus, res.mem_mib);
            // What each offered shared GPU has left for our fractions.
            let mut room: Vec<(&str, u64)> = offer
                .shared_gpus
                .iter()
                .filter_map(|s| {
                    let g = s.gpu.as_ref().filter(|g| g.healthy)?;
                    Some((g.uuid.as_str(), s.free_mem_mib))
                })
                .collect();
            let mut launch = Vec::new();
            for task in tasks.iter_mut().filter(|t| t.state.is_none()) {
                if cpus + CPU_EPSILON < TASK_CPUS || mem < TASK_MEM_MIB {
                    break;
                }
                if config.gpu_mem_mib > 0 && config.gpus_for(task.index) > 0 {
                    let Some(r) = room.iter_mut().find(|(_, m)| *m >= config.gpu_mem_mib) else {
                        continue; // no room here: maybe a later task needs no GPU
                    };
                    r.1 -= config.gpu_mem_mib;
                    cpus -= TASK_CPUS;
                    mem -= TASK_MEM_MIB;
                    task.state = Some(TaskState::TaskStaging);
                    task.agent_id = offer.agent_id.clone();
                    task.gpus = vec![r.0.to_string()];
                    launch.push(task_info(config, task));
                    continue;
                }
                let free: Vec<&pb::Gpu> = offer
                    .gpus
                    .iter()
                    // Whole GPUs only: a GPU in MIG mode is offered as its
                    // MIG devices, which this framework does not use.
                    .filter(|g| {
                        g.healthy
                            && !used.contains(&g.uuid)
                            && g.mig.as_ref().is_none_or(|m| !m.enabled)
                    })
                    .collect();
                let Some(gpus) = choose_gpus(&free, config.gpus_for(task.index)) else {
                    continue; // not enough GPUs here: maybe a later task fits
                };
                cpus -= TASK_CPUS;
                mem -= TASK_MEM_MIB;
                used.extend(gpus.iter().cloned());
                task.state = Some(TaskState::TaskStaging);
                task.agent_id = offer.agent_id.clone();
                task.gpus = gpus;
                launch.push(task_info(config, task));
            }
            if launch.is_empty() {
                decision.declines.push(offer.id.clone());
            } else {
                decision.accepts.push((offer.id.clone(), launch));
            }
        }
        decision
    }

    /// An Accept call failed: its tasks wait for another offer. This does
    /// not count as a relaunch.
    pub fn launch_failed(&mut self, task_ids: &[String]) {
        for task in &mut self.tasks {
            if task.state == Some(TaskState::TaskStaging) && task_ids.contains(&task.id()) {
                task.state = None;
                task.agent_id.clear();
                task.gpus.clear();
            }
        }
    }

    /// Records an UPDATE. Updates of an older attempt, of unknown tasks, or
    /// that would move a task out of a terminal state change nothing, but
    /// are still acknowledged.
    pub fn on_update(&mut self, status: &pb::TaskStatus) -> UpdateOutcome {
        let state = TaskState::try_from(status.state).unwrap_or(TaskState::Unspecified);
        let mut line = format!("{} {}", status.task_id, state_name(state));
        if let Some(code) = status.exit_code {
            line.push_str(&format!(" exit={code}"));
        }
        let reason = Reason::try_from(status.reason).unwrap_or(Reason::Unspecified);
        if !matches!(reason, Reason::Unspecified | Reason::CommandExited) {
            line.push_str(&format!(" reason={}", reason.as_str_name()));
        }
        if !status.message.is_empty() {
            line.push_str(&format!(": {}", status.message));
        }
        let ack = !status.uuid.is_empty();

        let current = self
            .tasks
            .iter_mut()
            .find(|t| t.id() == status.task_id && !t.is_terminal());
        let Some(task) = current else {
            return UpdateOutcome { line, ack };
        };
        task.state = Some(state);
        task.exit_code = status.exit_code;
        if !status.agent_id.is_empty() {
            task.agent_id = status.agent_id.clone();
        }
        if matches!(state, TaskState::TaskError | TaskState::TaskLost)
            && task.attempt < MAX_RELAUNCHES
        {
            task.attempt += 1;
            task.state = None;
            task.exit_code = None;
            task.agent_id.clear();
            task.gpus.clear();
            line.push_str(&format!(" (relaunching as {})", task.id()));
        }
        UpdateOutcome { line, ack }
    }

    /// After a re-subscription or a failed Suppress/Revive we do not know
    /// whether the master sends us offers: the next `offer_control` says.
    pub fn offer_flow_unknown(&mut self) {
        self.offers = OfferFlow::Unknown;
    }

    /// Suppress once nothing waits for an offer; Revive when something
    /// does again (a relaunch).
    pub fn offer_control(&mut self) -> Option<OfferControl> {
        if self.is_done() {
            return None;
        }
        let waiting = self.tasks.iter().any(|t| t.state.is_none());
        let (want, call) = if waiting {
            (OfferFlow::Flowing, OfferControl::Revive)
        } else {
            (OfferFlow::Suppressed, OfferControl::Suppress)
        };
        if self.offers == want {
            return None;
        }
        self.offers = want;
        Some(call)
    }

    /// Every task is in a terminal state (and none waits for a relaunch).
    pub fn is_done(&self) -> bool {
        self.tasks.iter().all(Task::is_terminal)
    }

    /// `4 finished, 1 failed` (plus `, 2 unfinished` before the end).
    pub fn summary(&self) -> String {
        let finished = self.tasks.iter().filter(|t| t.succeeded()).count();
        let failed = self
            .tasks
            .iter()
            .filter(|t| t.is_terminal() && !t.succeeded())
            .count();
        let unfinished = self.tasks.len() - finished - failed;
        let mut s = format!("{finished} finished, {failed} failed");
        if unfinished > 0 {
            s.push_str(&format!(", {unfinished} unfinished"));
        }
        s
    }

    /// 0 when every task FINISHED with exit code 0, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        if self.tasks.iter().all(Task::succeeded) {
            0
        } else {
            1
        }
    }
}

fn task_info(config: &Config, task: &Task) -> pb::TaskInfo {
    let id = task.id();
    // A fraction names its shared GPU in gpu_fraction, and no GPUs.
    let fraction = (config.gpu_mem_mib > 0)
        .then(|| task.gpus.first())
        .flatten()
        .map(|uuid| pb::GpuFraction {
            gpu_uuid: uuid.clone(),
            mem_mib: config.gpu_mem_mib,
            compute_pct: 0,
        });
    let gpus = if fraction.is_some() {
        Vec::new()
    } else {
        task.gpus.clone()
    };
    pb::TaskInfo {
        name: id.clone(),
        task_id: id,
        agent_id: task.agent_id.clone(),
        image: config.image.clone(),
        command: config.command.clone(),
        env: [("TASK_INDEX".to_string(), task.index.to_string())].into(),
        resources: Some(pb::Resources {
            cpus: TASK_CPUS,
            mem_mib: TASK_MEM_MIB,
            gpus: gpus.len() as u32,
            ports: 0,
        }),
        gpu_uuids: gpus,
        gpu_fraction: fraction,
    }
}

/// Active NVLink links between two GPUs (as either of them reports it).
fn nvlinks(a: &pb::Gpu, b: &pb::Gpu) -> u32 {
    let one_way = |from: &pb::Gpu, to: &pb::Gpu| {
        from.peers
            .iter()
            .find(|p| p.uuid == to.uuid)
            .map_or(0, |p| p.nvlinks)
    };
    one_way(a, b).max(one_way(b, a))
}

/// Chooses `want` of the `free` GPUs, preferring a set joined by NVLink:
/// from each GPU as a seed, add the GPU with the most links to those
/// already chosen, and keep the set with the most links in all (the first
/// one on ties). `None` if there are too few.
fn choose_gpus(free: &[&pb::Gpu], want: usize) -> Option<Vec<String>> {
    if free.len() < want {
        return None;
    }
    if want <= 1 {
        return Some(free.iter().take(want).map(|g| g.uuid.clone()).collect());
    }
    let mut best: Option<(u32, Vec<usize>)> = None;
    for seed in 0..free.len() {
        let mut chosen = vec![seed];
        let mut links = 0;
        while chosen.len() < want {
            let mut pick: Option<(u32, usize)> = None;
            for c in (0..free.len()).filter(|c| !chosen.contains(c)) {
                let gain: u32 = chosen.iter().map(|&x| nvlinks(free[c], free[x])).sum();
                if pick.is_none_or(|(g, _)| gain > g) {
                    pick = Some((gain, c));
                }
            }
            let (gain, c) = pick?;
            links += gain;
            chosen.push(c);
        }
        if best.as_ref().is_none_or(|(l, _)| links > *l) {
            best = Some((links, chosen));
        }
    }
    best.map(|(_, chosen)| chosen.iter().map(|&i| free[i].uuid.clone()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(tasks: usize, gpu_tasks: usize, gpus_per_task: u32) -> Config {
        Config {
            tasks,
            gpu_tasks,
            gpus_per_task,
            gpu_mem_mib: 0,
            image: String::new(),
            command: vec!["true".into()],
        }
    }

    fn gpu(uuid: &str) -> pb::Gpu {
        pb::Gpu {
            uuid: uuid.into(),
            healthy: true,
            ..Default::default()
        }
    }

    /// Links `a` and `b` with `n` NVLinks (recorded on `a` only).
    fn link(gpus: &mut [pb::Gpu], a: usize, b: usize, n: u32) {
        let uuid = gpus[b].uuid.clone();
        gpus[a].peers.push(pb::GpuPeer {
            uuid,
            nvlinks: n,
            pcie: String::new(),
        });
    }

    fn offer(id: &str, agent: &str, cpus: f64, mem_mib: u64, gpus: Vec<pb::Gpu>) -> pb::Offer {
        pb::Offer {
            id: id.into(),
            agent_id: agent.into(),
            resources: Some(pb::Resources {
                cpus,
                mem_mib,
                gpus: gpus.len() as u32,
                ports: 0,
            }),
            gpus,
            ..Default::default()
        }
    }

    fn gpus(prefix: &str, n: usize) -> Vec<pb::Gpu> {
        (0..n).map(|i| gpu(&format!("{prefix}-{i}"))).collect()
    }

    fn ids(tasks: &[pb::TaskInfo]) -> Vec<&str> {
        tasks.iter().map(|t| t.task_id.as_str()).collect()
    }

    fn status(task_id: &str, state: TaskState, exit_code: Option<i32>) -> pb::TaskStatus {
        pb::TaskStatus {
            task_id: task_id.into(),
            agent_id: "a1".into(),
            state: state as i32,
            exit_code,
            uuid: vec![1, 2, 3],
            ..Default::default()
        }
    }

    #[test]
    fn validates_the_config() {
        assert!(config(2, 1, 1).validate().is_ok());
        assert!(config(0, 0, 1).validate().is_err());
        assert!(config(2, 3, 1).validate().is_err());
        assert!(config(2, 1, 0).validate().is_err());
        let mut c = config(1, 0, 1);
        c.command.clear();
        assert!(c.validate().is_err());
    }

    #[test]
    fn packs_cpu_tasks_into_an_offer_without_gpus() {
        let mut plan = Plan::new(config(3, 0, 1));
        let d = plan.on_offers(&[offer("o1", "a1", 4.0, 1024, vec![])]);
        assert!(d.declines.is_empty());
        assert_eq!(d.accepts.len(), 1);
        let (offer_id, tasks) = &d.accepts[0];
        assert_eq!(offer_id, "o1");
        assert_eq!(ids(tasks), ["task-0", "task-1", "task-2"]);
        let t = &tasks[1];
        assert_eq!(t.agent_id, "a1");
        assert_eq!(t.command, ["true"]);
        assert_eq!(t.env.get("TASK_INDEX").map(String::as_str), Some("1"));
        assert_eq!(
            t.resources,
            Some(pb::Resources {
                cpus: TASK_CPUS,
                mem_mib: TASK_MEM_MIB,
                gpus: 0,
                ports: 0,
            })
        );
        assert!(t.gpu_uuids.is_empty());
        assert!(plan
            .tasks()
            .iter()
            .all(|t| t.state == Some(TaskState::TaskStaging)));
    }

    /// With --gpu-mem, GPU tasks take fractions of the offer's shared GPU
    /// (never its whole GPUs), as many as its free memory holds.
    #[test]
    fn packs_fractions_into_an_offers_shared_gpus() {
        let mut plan = Plan::new(Config {
            gpu_mem_mib: 20480,
            ..config(4, 3, 1)
        });
        let mut o = offer("o1", "a1", 4.0, 1024, gpus("GPU", 1));
        o.shared_gpus = vec![pb::SharedGpu {
            gpu: Some(gpu("GPU-s")),
            mode: "mps".into(),
            free_mem_mib: 40960,
            free_compute_pct: 100,
        }];
        let d = plan.on_offers(&[o]);
        let tasks = &d.accepts[0].1;
        assert_eq!(ids(tasks), ["task-0", "task-1", "task-3"], "task-2 waits");
        for t in &tasks[..2] {
            assert!(t.gpu_uuids.is_empty());
            assert_eq!(t.resources.map(|r| r.gpus), Some(0));
            assert_eq!(
                t.gpu_fraction,
                Some(pb::GpuFraction {
                    gpu_uuid: "GPU-s".into(),
                    mem_mib: 20480,
                    compute_pct: 0,
                })
            );
        }
        assert_eq!(tasks[2].gpu_fraction, None, "a CPU task");
        assert_eq!(plan.tasks()[1].gpus, ["GPU-s"]);
        assert!(Config {
            gpu_mem_mib: 1,
            ..config(1, 1, 2)
        }
        .validate()
        .is_err());
    }

    #[test]
    fn stops_at_the_offers_cpus_and_memory() {
        let mut plan = Plan::new(config(5, 0, 1));
        // 0.3 CPUs fit three tasks (despite float rounding); 64 MiB fit two.
        let d = plan.on_offers(&[
            offer("o1", "a1", 0.3, 4096, vec![]),
            offer("o2", "a2", 8.0, 64, vec![]),
        ]);
        assert_eq!(ids(&d.accepts[0].1), ["task-0", "task-1", "task-2"]);
        assert_eq!(ids(&d.accepts[1].1), ["task-3", "task-4"]);
    }

    #[test]
    fn gpu_tasks_wait_for_gpus_and_cpu_tasks_take_the_rest() {
        let mut plan = Plan::new(config(3, 2, 1));
        let d = plan.on_offers(&[
            offer("cpu", "a1", 8.0, 4096, vec![]),
            offer("gpu", "a2", 8.0, 4096, gpus("G", 4)),
        ]);
        // The offer without GPUs gets only the CPU task; the GPU offer the rest.
        assert_eq!(d.accepts[0].0, "cpu");
        assert_eq!(ids(&d.accepts[0].1), ["task-2"]);
        assert_eq!(d.accepts[1].0, "gpu");
        let gpu_tasks = &d.accepts[1].1;
        assert_eq!(ids(gpu_tasks), ["task-0", "task-1"]);
        assert_eq!(gpu_tasks[0].gpu_uuids, ["G-0"]);
        assert_eq!(gpu_tasks[1].gpu_uuids, ["G-1"]);
        assert_eq!(gpu_tasks[1].resources.as_ref().map(|r| r.gpus), Some(1));
        assert_eq!(plan.tasks()[0].gpus, ["G-0"]);
        assert_eq!(plan.tasks()[0].agent_id, "a2");
    }

    #[test]
    fn declines_offers_it_does_not_use() {
        let mut plan = Plan::new(config(1, 1, 2));
        let d = plan.on_offers(&[
            offer("small", "a1", 8.0, 4096, gpus("S", 1)),
            offer("big", "a2", 8.0, 4096, gpus("B", 2)),
            offer("late", "a3", 8.0, 4096, gpus("L", 8)),
        ]);
        assert_eq!(d.declines, ["small", "late"]);
        assert_eq!(d.accepts.len(), 1);
        assert_eq!(d.accepts[0].1[0].gpu_uuids, ["B-0", "B-1"]);
    }

    #[test]
    fn prefers_gpus_joined_by_nvlink() {
        // G-0..G-3; only G-1 and G-3 are linked (recorded on one side).
        let mut g = gpus("G", 4);
        link(&mut g, 3, 1, 12);
        link(&mut g, 0, 2, 0);
        let mut plan = Plan::new(config(1, 1, 2));
        let d = plan.on_offers(&[offer("o1", "a1", 8.0, 4096, g)]);
        assert_eq!(d.accepts[0].1[0].gpu_uuids, ["G-1", "G-3"]);
    }

    #[test]
    fn prefers_the_most_linked_group_of_four() {
        // Two NVLink islands of 4 (DGX-like): 0-3 and 4-7, 1 link inside each,
        // except that island 4-7 has more links (2) per pair.
        let mut g = gpus("G", 8);
        for island in [0..4, 4..8] {
            for a in island.clone() {
                for b in island.clone().filter(|&b| b > a) {
                    link(&mut g, a, b, if a >= 4 { 2 } else { 1 });
                }
            }
        }
        let mut plan = Plan::new(config(2, 2, 4));
        let d = plan.on_offers(&[offer("o1", "a1", 8.0, 4096, g)]);
        let tasks = &d.accepts[0].1;
        assert_eq!(tasks[0].gpu_uuids, ["G-4", "G-5", "G-6", "G-7"]);
        assert_eq!(tasks[1].gpu_uuids, ["G-0", "G-1", "G-2", "G-3"]);
    }

    #[test]
    fn never_uses_a_gpu_twice_nor_an_unhealthy_one() {
        let mut g = gpus("G", 4);
        g[0].healthy = false;
        let mut plan = Plan::new(config(3, 3, 2));
        let d = plan.on_offers(&[offer("o1", "a1", 8.0, 4096, g.clone())]);
        // Three healthy GPUs: one task of two.
        assert_eq!(d.accepts[0].1.len(), 1);
        assert_eq!(d.accepts[0].1[0].gpu_uuids, ["G-1", "G-2"]);
        // A later offer that names the held GPUs again gives out only G-3.
        let d = plan.on_offers(&[offer("o2", "a1", 8.0, 4096, g)]);
        assert_eq!(d.declines, ["o2"]);
        let mut all: Vec<&String> = plan.tasks().iter().flat_map(|t| &t.gpus).collect();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n);
    }

    #[test]
    fn never_launches_more_tasks_than_asked() {
        let mut plan = Plan::new(config(2, 0, 1));
        let d = plan.on_offers(&[
            offer("o1", "a1", 64.0, 1 << 20, vec![]),
            offer("o2", "a2", 64.0, 1 << 20, vec![]),
        ]);
        assert_eq!(ids(&d.accepts[0].1), ["task-0", "task-1"]);
        assert_eq!(d.declines, ["o2"]);
        let d = plan.on_offers(&[offer("o3", "a1", 64.0, 1 << 20, vec![])]);
        assert!(d.accepts.is_empty());
        assert_eq!(d.declines, ["o3"]);
    }

    #[test]
    fn suppresses_when_all_launched_and_revives_for_a_relaunch() {
        let mut plan = Plan::new(config(2, 0, 1));
        assert_eq!(plan.offer_control(), None);
        plan.on_offers(&[offer("o1", "a1", 0.1, 1024, vec![])]);
        assert_eq!(plan.offer_control(), None); // task-1 still waits
        plan.on_offers(&[offer("o2", "a1", 0.1, 1024, vec![])]);
        assert_eq!(plan.offer_control(), Some(OfferControl::Suppress));
        assert_eq!(plan.offer_control(), None);
        plan.on_update(&status("task-1", TaskState::TaskLost, None));
        assert_eq!(plan.offer_control(), Some(OfferControl::Revive));
        assert_eq!(plan.offer_control(), None);
        // After a re-subscription, the state is asked for again.
        plan.offer_flow_unknown();
        assert_eq!(plan.offer_control(), Some(OfferControl::Revive));
    }

    #[test]
    fn relaunches_error_and_lost_once() {
        let mut plan = Plan::new(config(3, 0, 1));
        plan.on_offers(&[offer("o1", "a1", 8.0, 4096, vec![])]);

        let out = plan.on_update(&status("task-0", TaskState::TaskError, None));
        assert_eq!(out.line, "task-0 ERROR (relaunching as task-0-r1)");
        assert_eq!(plan.tasks()[0].state, None);
        assert_eq!(plan.tasks()[0].id(), "task-0-r1");
        plan.on_update(&status("task-1", TaskState::TaskLost, None));
        assert_eq!(plan.tasks()[1].id(), "task-1-r1");
        // FAILED and KILLED are final.
        plan.on_update(&status("task-2", TaskState::TaskFailed, Some(3)));
        assert_eq!(plan.tasks()[2].state, Some(TaskState::TaskFailed));
        assert_eq!(plan.tasks()[2].attempt, 0);

        // The relaunch keeps its index.
        let d = plan.on_offers(&[offer("o2", "a2", 8.0, 4096, vec![])]);
        let tasks = &d.accepts[0].1;
        assert_eq!(ids(tasks), ["task-0-r1", "task-1-r1"]);
        assert_eq!(
            tasks[0].env.get("TASK_INDEX").map(String::as_str),
            Some("0")
        );

        // A late update of the old attempt changes nothing (but is acked).
        let out = plan.on_update(&status("task-0", TaskState::TaskError, None));
        assert!(out.ack);
        assert_eq!(plan.tasks()[0].state, Some(TaskState::TaskStaging));

        // A second ERROR is final.
        let out = plan.on_update(&status("task-0-r1", TaskState::TaskError, None));
        assert_eq!(out.line, "task-0-r1 ERROR");
        assert_eq!(plan.tasks()[0].state, Some(TaskState::TaskError));
        assert_eq!(plan.tasks()[0].attempt, 1);
    }

    #[test]
    fn killed_is_final() {
        let mut plan = Plan::new(config(1, 0, 1));
        plan.on_offers(&[offer("o1", "a1", 8.0, 4096, vec![])]);
        plan.on_update(&status("task-0", TaskState::TaskKilled, None));
        assert!(plan.is_done());
        assert_eq!(plan.exit_code(), 1);
    }

    #[test]
    fn a_failed_accept_puts_its_tasks_back_without_a_relaunch() {
        let mut plan = Plan::new(config(2, 1, 1));
        let d = plan.on_offers(&[offer("o1", "a1", 8.0, 4096, gpus("G", 1))]);
        plan.launch_failed(&["task-0".into(), "task-1".into()]);
        assert!(plan.tasks().iter().all(|t| t.state.is_none()));
        assert!(plan
            .tasks()
            .iter()
            .all(|t| t.attempt == 0 && t.gpus.is_empty()));
        // The same GPU can be offered and used again.
        let d2 = plan.on_offers(&[offer("o2", "a1", 8.0, 4096, gpus("G", 1))]);
        assert_eq!(d.accepts[0].1, d2.accepts[0].1);
    }

    #[test]
    fn acks_only_updates_with_a_uuid() {
        let mut plan = Plan::new(config(1, 0, 1));
        plan.on_offers(&[offer("o1", "a1", 8.0, 4096, vec![])]);
        let out = plan.on_update(&status("task-0", TaskState::TaskRunning, None));
        assert_eq!(
            out,
            UpdateOutcome {
                line: "task-0 RUNNING".into(),
                ack: true
            }
        );
        // A reconciliation answer carries no uuid.
        let mut reconciled = status("task-0", TaskState::TaskRunning, None);
        reconciled.uuid.clear();
        reconciled.reason = Reason::Reconciliation as i32;
        let out = plan.on_update(&reconciled);
        assert!(!out.ack);
        assert_eq!(out.line, "task-0 RUNNING reason=REASON_RECONCILIATION");
        // Unknown tasks are acked too, so the agent stops resending.
        assert!(
            plan.on_update(&status("task-9", TaskState::TaskRunning, None))
                .ack
        );
    }

    #[test]
    fn a_terminal_task_stays_terminal() {
        let mut plan = Plan::new(config(1, 0, 1));
        plan.on_offers(&[offer("o1", "a1", 8.0, 4096, vec![])]);
        plan.on_update(&status("task-0", TaskState::TaskFinished, Some(0)));
        plan.on_update(&status("task-0", TaskState::TaskRunning, None));
        assert_eq!(plan.tasks()[0].state, Some(TaskState::TaskFinished));
    }

    #[test]
    fn done_when_all_terminal_and_exit_code() {
        let mut plan = Plan::new(config(2, 0, 1));
        plan.on_offers(&[offer("o1", "a1", 8.0, 4096, vec![])]);
        assert!(!plan.is_done());
        assert_eq!(plan.summary(), "0 finished, 0 failed, 2 unfinished");
        let out = plan.on_update(&status("task-0", TaskState::TaskFinished, Some(0)));
        assert_eq!(out.line, "task-0 FINISHED exit=0");
        assert!(!plan.is_done());
        plan.on_update(&status("task-1", TaskState::TaskFinished, Some(0)));
        assert!(plan.is_done());
        assert_eq!(plan.exit_code(), 0);
        assert_eq!(plan.summary(), "2 finished, 0 failed");
        assert_eq!(plan.offer_control(), None);
    }

    #[test]
    fn any_failure_makes_the_exit_code_one() {
        let mut plan = Plan::new(config(2, 0, 1));
        plan.on_offers(&[offer("o1", "a1", 8.0, 4096, vec![])]);
        plan.on_update(&status("task-0", TaskState::TaskFinished, Some(0)));
        let mut failed = status("task-1", TaskState::TaskFailed, Some(2));
        failed.reason = Reason::CommandExited as i32;
        failed.message = "exited with 2".into();
        let out = plan.on_update(&failed);
        assert_eq!(out.line, "task-1 FAILED exit=2: exited with 2");
        assert!(plan.is_done());
        assert_eq!(plan.exit_code(), 1);
        assert_eq!(plan.summary(), "1 finished, 1 failed");
        assert_eq!(plan.tasks()[1].state_name(), "FAILED");
    }

    #[test]
    fn a_relaunch_pending_is_not_done() {
        let mut plan = Plan::new(config(1, 0, 1));
        plan.on_offers(&[offer("o1", "a1", 8.0, 4096, vec![])]);
        plan.on_update(&status("task-0", TaskState::TaskLost, None));
        assert!(!plan.is_done());
        assert_eq!(plan.tasks()[0].state_name(), "PENDING");
        plan.on_offers(&[offer("o2", "a2", 8.0, 4096, vec![])]);
        plan.on_update(&status("task-0-r1", TaskState::TaskFinished, Some(0)));
        assert!(plan.is_done());
        assert_eq!(plan.exit_code(), 0);
    }
}
