//! Simulated agents, in process: many agents in one tokio runtime, each
//! speaking the real AgentManager API of a master, for tests and benchmarks
//! of the master at scale (the agents cost almost nothing, so 10,000 fit).
//!
//! Each simulated agent does what `gpuctl-agent` does on the wire
//! (agent/src/master_link.rs), with no GPUs, processes or containers behind
//! it:
//!
//! - registers with `gpus_per_agent` simulated GPUs (uuids unique to it,
//!   `GPU-{prefix}-{agent:06}-{n}`), the process runtime (and Docker when
//!   asked), its live tasks in `running_task_ids`, and a kill grace;
//! - watches its tasks with an incremental WatchTasks stream, rebuilding the
//!   desired set with [`DesiredSet`], and acts only on complete sets;
//! - heartbeats at the interval the RegisterResponse asks for;
//! - "launches" each task it has not seen: reports STARTING then RUNNING;
//!   after [`SimConfig::run_time`], if set (or the `SECONDS` of a task
//!   whose command is `sleep SECONDS`, with
//!   [`SimConfig::run_time_from_command`]), the task ends with exit code 0
//!   (FINISHED); a task in the kill list, or a live one in neither set, is
//!   reported KILLED;
//! - sends each status update (a fresh uuid per update) until the master
//!   acknowledges it, in order per task, one call at a time per agent, as
//!   the agent's status sender does;
//! - on a failed call or stream, registers again: at once where a
//!   `gpuctl-leader` redirect points (three in a row), after 200-300 ms
//!   when the master said "no leader yet" (the backoff then starts again),
//!   else at the next address after a backoff (100 ms doubling to
//!   [`SimConfig::backoff_max`]).
//!
//! Simplifications: redirects to an address not given to
//! [`SimAgents::start`] are not followed (the next known address is tried);
//! agents do not fence (a task keeps "running" however long the master is
//! away); task records are kept for the life of the [`SimAgents`], as they
//! are the benchmark's data.
//!
//! [`InProcessMaster`] runs a real master in the same process, for tests
//! that want one without building and starting the binary;
//! [`InProcessMaster::start_group`] runs several forming one Raft group.
//!
//! All agents share a few HTTP/2 connections per master
//! ([`SimConfig::connections`]; the master does not limit streams per
//! connection, so 10,000 agents over 4 carry 2,500 task streams each). What they saw is read back through
//! [`SimAgents`]: registrations, per-task timestamps ([`SimTask`]) and
//! violations of the GPU invariant seen from the agents' side (a task
//! naming a GPU of another agent, or one a live task of this agent holds).
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpuctl_core::desired::DesiredSet;
use gpuctl_core::time::Backoff;
use gpuctl_proto::leader::{leader_hint, not_proposed};
use gpuctl_proto::pb;
use gpuctl_proto::pb::agent_manager_client::AgentManagerClient;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};
use tonic::Status;

/// `gpuctl-agent`'s reconnection policy (agent/src/master_link.rs).
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const FREE_REDIRECTS: u32 = 3;
const ELECTION_POLL: Duration = Duration::from_millis(200);
const RPC_TIMEOUT: Duration = Duration::from_secs(10);
/// How often an update recorded but not yet acknowledged is sent again.
const ACK_POLL: Duration = Duration::from_millis(500);
/// The kill grace the agents say they have (`gpuctl-agent`'s default).
const KILL_GRACE_MS: u32 = 10_000;
/// At most this many violations are kept (the rest are only counted).
const MAX_VIOLATIONS: usize = 1000;

/// What to simulate.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub agents: usize,
    pub gpus_per_agent: u32,
    /// Offer the Docker runtime besides the process runtime.
    pub docker: bool,
    /// How long a task runs before it ends with exit code 0; `None`: until
    /// it is killed.
    pub run_time: Option<Duration>,
    /// A task whose command is `sleep SECONDS` (a finite number, as
    /// `sleep 0.5`) ends after that long with exit code 0, whatever
    /// `run_time` says; others follow `run_time`. Lets one set of agents
    /// run short and long jobs side by side.
    pub run_time_from_command: bool,
    /// HTTP/2 connections per master shared by all agents.
    pub connections: usize,
    /// The longest pause between registration attempts.
    pub backoff_max: Duration,
    /// Names the agents (`{prefix}-agent-{n:06}`) and their GPUs, so that
    /// several sets of simulated agents can share a master.
    pub id_prefix: String,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            agents: 1,
            gpus_per_agent: 8,
            docker: false,
            run_time: None,
            run_time_from_command: false,
            connections: 4,
            backoff_max: Duration::from_secs(5),
            id_prefix: "sim".into(),
        }
    }
}

/// One task as a simulated agent saw it. Times are since
/// [`SimAgents::epoch`].
#[derive(Debug, Clone, PartialEq)]
pub struct SimTask {
    pub task_id: String,
    pub job_id: String,
    /// Index of the agent.
    pub agent: usize,
    pub gpu_uuids: Vec<String>,
    /// First seen in a complete desired set (to run, or to kill).
    pub seen: Duration,
    /// When the master acknowledged its RUNNING.
    pub running_acked: Option<Duration>,
    /// Its final state as reported (FINISHED or KILLED), once decided.
    pub end_state: Option<pb::TaskState>,
    /// When the master acknowledged the final state.
    pub ended_acked: Option<Duration>,
}

/// An agent's latest successful registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    /// Since [`SimAgents::epoch`].
    pub at: Duration,
    /// Index of the master (in the addresses given to [`SimAgents::start`]).
    pub master: usize,
}

/// Counts over all agents, cheap to poll.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimCounts {
    /// Tasks seen (to run or to kill).
    pub seen: usize,
    /// Tasks whose RUNNING was acknowledged.
    pub running_acked: usize,
    /// Tasks whose final state was acknowledged.
    pub ended_acked: usize,
}

/// Why simulated agents could not start.
#[derive(Debug)]
pub enum SimError {
    /// [`SimAgents::start`] was called outside a tokio runtime.
    NoRuntime,
    /// A master address that does not make a URI.
    Address {
        addr: String,
        error: tonic::transport::Error,
    },
}

impl std::fmt::Display for SimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SimError::NoRuntime => write!(f, "simulated agents need a tokio runtime"),
            SimError::Address { addr, error } => write!(f, "master address {addr:?}: {error}"),
        }
    }
}

impl std::error::Error for SimError {}

/// Simulated agents running in the current tokio runtime; they stop when
/// this is dropped.
pub struct SimAgents {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
}

struct Shared {
    epoch: Instant,
    config: SimConfig,
    addrs: Vec<String>,
    /// `channels[master][k]`: the connections the agents share.
    channels: Vec<Vec<Channel>>,
    agents: Vec<Agent>,
    seen: AtomicUsize,
    running_acked: AtomicUsize,
    ended_acked: AtomicUsize,
    violations: Mutex<(usize, Vec<String>)>,
}

struct Agent {
    id: String,
    gpus: Vec<String>,
    /// Nanoseconds after the epoch of the latest successful Register (0:
    /// never), and the master it was made at.
    registered_ns: AtomicU64,
    registered_master: AtomicUsize,
    /// The master this agent talks to now (its session and its status
    /// sender both follow it).
    master: AtomicUsize,
    tasks: Mutex<Tasks>,
    /// Wakes the status sender: an update was queued.
    queued: Notify,
}

#[derive(Default)]
struct Tasks {
    known: BTreeMap<String, Entry>,
    /// Updates not yet acknowledged, in order per task: at most three per
    /// task (STARTING, RUNNING, the final state), so bounded by the tasks.
    pending: BTreeMap<String, VecDeque<pb::StatusUpdate>>,
}

struct Entry {
    task: SimTask,
    /// "Running" here: holds its GPUs.
    live: bool,
    /// When it ends by itself.
    finish_at: Option<tokio::time::Instant>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl SimAgents {
    /// Starts `config.agents` agents against the masters at `masters`
    /// (`HOST:PORT`), beginning with the first, in the current tokio
    /// runtime.
    pub fn start(masters: &[String], config: SimConfig) -> Result<SimAgents, SimError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| SimError::NoRuntime)?;
        let conns = config.connections.max(1);
        let mut channels = Vec::with_capacity(masters.len());
        for addr in masters {
            let mut per = Vec::with_capacity(conns);
            for _ in 0..conns {
                let endpoint =
                    Endpoint::from_shared(format!("http://{addr}")).map_err(|error| {
                        SimError::Address {
                            addr: addr.clone(),
                            error,
                        }
                    })?;
                per.push(
                    endpoint
                        .connect_timeout(Duration::from_secs(1))
                        .tcp_nodelay(true)
                        .connect_lazy(),
                );
            }
            channels.push(per);
        }
        let prefix = &config.id_prefix;
        let agents = (0..config.agents)
            .map(|i| Agent {
                id: format!("{prefix}-agent-{i:06}"),
                gpus: (0..config.gpus_per_agent)
                    .map(|g| format!("GPU-{prefix}-{i:06}-{g}"))
                    .collect(),
                registered_ns: AtomicU64::new(0),
                registered_master: AtomicUsize::new(0),
                master: AtomicUsize::new(0),
                tasks: Mutex::new(Tasks::default()),
                queued: Notify::new(),
            })
            .collect();
        let shared = Arc::new(Shared {
            epoch: Instant::now(),
            config,
            addrs: masters.to_vec(),
            channels,
            agents,
            seen: AtomicUsize::new(0),
            running_acked: AtomicUsize::new(0),
            ended_acked: AtomicUsize::new(0),
            violations: Mutex::new((0, Vec::new())),
        });
        let mut handles = Vec::with_capacity(2 * shared.agents.len());
        if !shared.addrs.is_empty() {
            for i in 0..shared.agents.len() {
                handles.push(runtime.spawn(run_agent(shared.clone(), i)));
                handles.push(runtime.spawn(run_status_sender(shared.clone(), i)));
            }
        }
        Ok(SimAgents { shared, handles })
    }

    /// What all times are measured from: when the agents were started.
    pub fn epoch(&self) -> Instant {
        self.shared.epoch
    }

    /// Time since [`epoch`](Self::epoch).
    pub fn now(&self) -> Duration {
        self.shared.epoch.elapsed()
    }

    pub fn len(&self) -> usize {
        self.shared.agents.len()
    }

    pub fn is_empty(&self) -> bool {
        self.shared.agents.is_empty()
    }

    /// The id agent `i` registers with.
    pub fn agent_id(&self, i: usize) -> Option<&str> {
        self.shared.agents.get(i).map(|a| a.id.as_str())
    }

    /// Agent `i`'s latest successful registration.
    pub fn registration(&self, i: usize) -> Option<Registration> {
        let a = self.shared.agents.get(i)?;
        let ns = a.registered_ns.load(Ordering::SeqCst);
        (ns > 0).then(|| Registration {
            at: Duration::from_nanos(ns),
            master: a.registered_master.load(Ordering::SeqCst),
        })
    }

    /// How many agents have registered at least once.
    pub fn registered(&self) -> usize {
        self.shared
            .agents
            .iter()
            .filter(|a| a.registered_ns.load(Ordering::SeqCst) > 0)
            .count()
    }

    pub fn counts(&self) -> SimCounts {
        SimCounts {
            seen: self.shared.seen.load(Ordering::SeqCst),
            running_acked: self.shared.running_acked.load(Ordering::SeqCst),
            ended_acked: self.shared.ended_acked.load(Ordering::SeqCst),
        }
    }

    /// Every task the agents have seen, by agent, then task id.
    pub fn tasks(&self) -> Vec<SimTask> {
        self.shared
            .agents
            .iter()
            .flat_map(|a| {
                lock(&a.tasks)
                    .known
                    .values()
                    .map(|e| e.task.clone())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Violations of the GPU invariant seen so far (the first thousand,
    /// then a count of the rest).
    pub fn violations(&self) -> Vec<String> {
        let v = lock(&self.shared.violations);
        let mut out = v.1.clone();
        if v.0 > v.1.len() {
            out.push(format!("... and {} more", v.0 - v.1.len()));
        }
        out
    }

    /// Stops every agent at once (no goodbye: like killed agents).
    pub fn stop(&mut self) {
        for h in self.handles.drain(..) {
            h.abort();
        }
    }
}

impl Drop for SimAgents {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Shared {
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn client(&self, agent: usize) -> AgentManagerClient<Channel> {
        let master = self.agents[agent].master.load(Ordering::SeqCst);
        let per = &self.channels[master % self.channels.len()];
        AgentManagerClient::new(per[agent % per.len()].clone())
    }

    fn violation(&self, what: String) {
        let mut v = lock(&self.violations);
        v.0 += 1;
        if v.1.len() < MAX_VIOLATIONS {
            v.1.push(what);
        }
    }

    fn register_request(&self, i: usize) -> pb::RegisterRequest {
        let agent = &self.agents[i];
        let prefix = &self.config.id_prefix;
        let gpus = agent
            .gpus
            .iter()
            .zip(0u32..)
            .map(|(uuid, g)| pb::Gpu {
                uuid: uuid.clone(),
                index: g,
                minor: g,
                model: "NVIDIA A100-SXM4-40GB".into(),
                memory_mib: 40_960,
                healthy: true,
                pci_bus_id: format!("00000000:{:02X}:00.0", g + 1),
                serial: format!("{prefix}{i}{g}"),
                compute_capability: "8.0".into(),
                ..Default::default()
            })
            .collect();
        let mut runtimes = vec![pb::Runtime::Process as i32];
        if self.config.docker {
            runtimes.push(pb::Runtime::Docker as i32);
        }
        let running_task_ids = lock(&agent.tasks)
            .known
            .iter()
            .filter(|(_, e)| e.live)
            .map(|(id, _)| id.clone())
            .collect();
        pb::RegisterRequest {
            agent_id: agent.id.clone(),
            hostname: format!("{prefix}-{i:06}"),
            // Nobody fetches task logs from a simulated agent.
            address: "127.0.0.1:9".into(),
            total: Some(pb::Resources {
                cpus: 32.0,
                mem_mib: 262_144,
                gpus: self.config.gpus_per_agent,
                // The real agent's default range (a gang holds a port a rank).
                ports: 1001,
            }),
            ports: Some(pb::PortRange {
                start: 31000,
                end: 32000,
            }),
            gpus,
            runtimes,
            running_task_ids,
            simulated_gpus: true,
            kill_grace_ms: KILL_GRACE_MS,
            ..Default::default()
        }
    }

    fn heartbeat_request(&self, i: usize) -> pb::HeartbeatRequest {
        let mut runtimes = vec![pb::Runtime::Process];
        if self.config.docker {
            runtimes.push(pb::Runtime::Docker);
        }
        pb::HeartbeatRequest {
            agent_id: self.agents[i].id.clone(),
            // Simulated GPUs have no health checks, as in `gpuctl-agent`.
            gpus: vec![],
            mig_results: vec![],
            runtimes: runtimes
                .into_iter()
                .map(|r| pb::RuntimeStatus {
                    runtime: r as i32,
                    available: true,
                    message: String::new(),
                })
                .collect(),
        }
    }

    /// How long a task with this command runs (`None`: until killed).
    fn run_time(&self, command: &[String]) -> Option<Duration> {
        if self.config.run_time_from_command {
            if let [sleep, secs] = command {
                if let Some(d) = (sleep == "sleep")
                    .then(|| secs.parse::<f64>().ok())
                    .flatten()
                    .and_then(|s| Duration::try_from_secs_f64(s).ok())
                {
                    return Some(d);
                }
            }
        }
        self.config.run_time
    }

    /// Acts on a complete desired set, as the agent's executor plans:
    /// launches what it has not seen, kills what is in the kill list or in
    /// neither set. Updates are queued for the status sender.
    fn reconcile(&self, i: usize, desired: &DesiredSet) {
        let agent = &self.agents[i];
        let now = self.now();
        let mut t = lock(&agent.tasks);
        let t = &mut *t;
        let mut queued = false;
        for (id, spec) in desired.run() {
            if t.known.contains_key(id) {
                continue;
            }
            for g in &spec.gpu_uuids {
                if !agent.gpus.contains(g) {
                    self.violation(format!(
                        "task {id} on {} names GPU {g}, which is not that agent's",
                        agent.id
                    ));
                }
                if let Some(other) = t
                    .known
                    .values()
                    .find(|e| e.live && e.task.gpu_uuids.contains(g))
                {
                    self.violation(format!(
                        "GPU {g} of {} given to task {id} while task {} holds it",
                        agent.id, other.task.task_id
                    ));
                }
            }
            self.seen.fetch_add(1, Ordering::SeqCst);
            t.known.insert(
                id.clone(),
                Entry {
                    task: SimTask {
                        task_id: id.clone(),
                        job_id: spec.job_id.clone(),
                        agent: i,
                        gpu_uuids: spec.gpu_uuids.clone(),
                        seen: now,
                        running_acked: None,
                        end_state: None,
                        ended_acked: None,
                    },
                    live: true,
                    finish_at: self
                        .run_time(&spec.template.command)
                        .map(|d| tokio::time::Instant::now() + d),
                },
            );
            let q = t.pending.entry(id.clone()).or_default();
            q.push_back(status_update(
                &agent.id,
                id,
                pb::TaskState::TaskStarting,
                None,
            ));
            q.push_back(status_update(
                &agent.id,
                id,
                pb::TaskState::TaskRunning,
                None,
            ));
            queued = true;
        }
        let mut kill: Vec<String> = desired.kill().iter().cloned().collect();
        // A live task the master no longer lists at all: the agent stops it.
        kill.extend(
            t.known
                .iter()
                .filter(|(id, e)| {
                    e.live && !desired.run().contains_key(*id) && !desired.kill().contains(*id)
                })
                .map(|(id, _)| id.clone()),
        );
        for id in kill {
            let entry = t.known.entry(id.clone()).or_insert_with(|| {
                // One never started here is reported KILLED at once.
                self.seen.fetch_add(1, Ordering::SeqCst);
                Entry {
                    task: SimTask {
                        task_id: id.clone(),
                        job_id: String::new(),
                        agent: i,
                        gpu_uuids: vec![],
                        seen: now,
                        running_acked: None,
                        end_state: None,
                        ended_acked: None,
                    },
                    live: true,
                    finish_at: None,
                }
            });
            if !entry.live {
                continue;
            }
            entry.live = false;
            entry.finish_at = None;
            entry.task.end_state = Some(pb::TaskState::TaskKilled);
            t.pending
                .entry(id.clone())
                .or_default()
                .push_back(status_update(
                    &agent.id,
                    &id,
                    pb::TaskState::TaskKilled,
                    None,
                ));
            queued = true;
        }
        if queued {
            agent.queued.notify_one();
        }
    }

    /// Ends the tasks whose run time is over (exit code 0); returns when
    /// the next one ends.
    fn finish_due(&self, i: usize) -> Option<tokio::time::Instant> {
        let agent = &self.agents[i];
        let now = tokio::time::Instant::now();
        let mut t = lock(&agent.tasks);
        let t = &mut *t;
        let mut next = None;
        let mut ended = Vec::new();
        for (id, e) in t.known.iter_mut() {
            match e.finish_at {
                Some(at) if e.live && at <= now => {
                    e.live = false;
                    e.finish_at = None;
                    e.task.end_state = Some(pb::TaskState::TaskFinished);
                    ended.push(id.clone());
                }
                Some(at) if e.live => {
                    next = Some(next.map_or(at, |n: tokio::time::Instant| n.min(at)))
                }
                _ => {}
            }
        }
        for id in ended {
            t.pending
                .entry(id.clone())
                .or_default()
                .push_back(status_update(
                    &agent.id,
                    &id,
                    pb::TaskState::TaskFinished,
                    Some(0),
                ));
        }
        next
    }

    /// An update was acknowledged (or refused for good): it leaves the
    /// queue and its time is recorded.
    fn acknowledged(&self, i: usize, update: &pb::StatusUpdate) {
        let now = self.now();
        let mut t = lock(&self.agents[i].tasks);
        let t = &mut *t;
        if let Some(q) = t.pending.get_mut(&update.task_id) {
            if q.front().is_some_and(|u| u.uuid == update.uuid) {
                q.pop_front();
            }
            if q.is_empty() {
                t.pending.remove(&update.task_id);
            }
        }
        let Some(e) = t.known.get_mut(&update.task_id) else {
            return;
        };
        if update.state == pb::TaskState::TaskRunning as i32 && e.task.running_acked.is_none() {
            e.task.running_acked = Some(now);
            self.running_acked.fetch_add(1, Ordering::SeqCst);
        } else if update.state == pb::TaskState::TaskFinished as i32
            || update.state == pb::TaskState::TaskKilled as i32
        {
            e.task.ended_acked = Some(now);
            self.ended_acked.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn status_update(
    agent_id: &str,
    task_id: &str,
    state: pb::TaskState,
    exit_code: Option<i32>,
) -> pb::StatusUpdate {
    pb::StatusUpdate {
        agent_id: agent_id.to_string(),
        task_id: task_id.to_string(),
        state: state as i32,
        exit_code,
        uuid: uuid::Uuid::new_v4().as_bytes().to_vec(),
        ..Default::default()
    }
}

/// How a session ended: the failed call's status, if any, and whether it
/// got as far as registering.
struct SessionEnd {
    status: Option<Status>,
    registered: bool,
}

/// One registration and what follows, until something fails.
async fn session(shared: &Shared, i: usize) -> SessionEnd {
    let end = |status, registered| SessionEnd { status, registered };
    let agent = &shared.agents[i];
    let master = agent.master.load(Ordering::SeqCst);
    let mut client = shared.client(i);
    let resp = match tokio::time::timeout(RPC_TIMEOUT, client.register(shared.register_request(i)))
        .await
    {
        Ok(Ok(r)) => r.into_inner(),
        Ok(Err(s)) => return end(Some(s), false),
        Err(_) => return end(None, false),
    };
    agent.registered_master.store(master, Ordering::SeqCst);
    agent.registered_ns.store(
        u64::try_from(shared.now().as_nanos())
            .unwrap_or(u64::MAX)
            .max(1),
        Ordering::SeqCst,
    );
    let mut stream = match client
        .watch_tasks(pb::WatchTasksRequest {
            agent_id: agent.id.clone(),
            incremental: true,
        })
        .await
    {
        Ok(r) => r.into_inner(),
        Err(s) => return end(Some(s), true),
    };
    let mut interval = Duration::from_millis(u64::from(resp.heartbeat_interval_ms.max(100)));
    let mut heartbeat = tokio::time::interval(interval);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut desired = DesiredSet::new();
    loop {
        tokio::select! {
            msg = stream.message() => match msg {
                Ok(Some(msg)) => match desired.apply_owned(msg) {
                    Ok(true) => shared.reconcile(i, &desired),
                    Ok(false) => {}
                    // As the agent: start the session (and the snapshot) again.
                    Err(e) => return end(Some(Status::internal(e.to_string())), true),
                },
                Ok(None) => return end(None, true),
                Err(s) => return end(Some(s), true),
            },
            _ = heartbeat.tick() => {
                let call = client.heartbeat(shared.heartbeat_request(i));
                match tokio::time::timeout(RPC_TIMEOUT, call).await {
                    Ok(Ok(r)) => {
                        // As the agent: the interval the master asks for now.
                        let ms = r.into_inner().heartbeat_interval_ms;
                        let d = Duration::from_millis(u64::from(ms.max(100)));
                        if ms > 0 && d != interval {
                            interval = d;
                            heartbeat = tokio::time::interval_at(tokio::time::Instant::now() + d, d);
                            heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                        }
                    }
                    Ok(Err(s)) => return end(Some(s), true),
                    Err(_) => return end(None, true),
                }
            }
        }
    }
}

/// 200 to 300 ms, spread over agents and time.
fn election_poll(i: usize) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let jitter = (i as u64).wrapping_mul(7919).wrapping_add(u64::from(nanos)) % 100;
    ELECTION_POLL + Duration::from_millis(jitter)
}

/// A simulated agent: sessions forever, reconnecting like `gpuctl-agent`.
async fn run_agent(shared: Arc<Shared>, i: usize) {
    let agent = &shared.agents[i];
    let mut backoff = Backoff::new(BACKOFF_MIN, shared.config.backoff_max.max(BACKOFF_MIN));
    let mut redirects = 0;
    loop {
        let e = session(&shared, i).await;
        if e.registered {
            backoff.reset();
            redirects = 0;
        }
        let master = agent.master.load(Ordering::SeqCst);
        let hint = e
            .status
            .as_ref()
            .and_then(leader_hint)
            .and_then(|h| shared.addrs.iter().position(|a| *a == h))
            .filter(|m| *m != master);
        match hint {
            Some(m) => {
                agent.master.store(m, Ordering::SeqCst);
                if redirects < FREE_REDIRECTS {
                    redirects += 1;
                    continue;
                }
            }
            None => agent
                .master
                .store((master + 1) % shared.addrs.len(), Ordering::SeqCst),
        }
        redirects = 0;
        // "No leader yet" / "catching up": a leader is a moment away.
        if e.status.as_ref().is_some_and(not_proposed) {
            backoff.reset();
            tokio::time::sleep(election_poll(i)).await;
            continue;
        }
        tokio::time::sleep(backoff.next_wait()).await;
    }
}

/// What one pass over the pending updates achieved.
enum Sent {
    /// Something was acknowledged: go on at once.
    Progress,
    /// Recorded but not acknowledged yet: ask again after [`ACK_POLL`].
    Waiting,
    /// The master did not answer or refused: back off.
    Failed,
}

/// Sends the front update of each task once, one call at a time.
async fn send_pending(shared: &Shared, i: usize) -> Sent {
    let agent = &shared.agents[i];
    // The front update of every task, in one UpdateStatuses call, as the
    // agent sends them.
    let fronts: Vec<pb::StatusUpdate> = lock(&agent.tasks)
        .pending
        .values()
        .filter_map(|q| q.front().cloned())
        .take(gpuctl_core::convert::MAX_STATUS_BATCH)
        .collect();
    if fronts.is_empty() {
        return Sent::Waiting;
    }
    let mut client = shared.client(i);
    let call = client.update_statuses(pb::StatusUpdates {
        updates: fronts.clone(),
    });
    let verdicts = match tokio::time::timeout(RPC_TIMEOUT, call).await {
        Ok(Ok(r)) if r.get_ref().verdicts.len() == fronts.len() => r.into_inner().verdicts,
        Ok(Ok(_)) => return Sent::Failed,
        Ok(Err(s)) => {
            let master = agent.master.load(Ordering::SeqCst);
            if let Some(m) = leader_hint(&s)
                .and_then(|h| shared.addrs.iter().position(|a| *a == h))
                .filter(|m| *m != master)
            {
                agent.master.store(m, Ordering::SeqCst);
            }
            return Sent::Failed;
        }
        Err(_) => return Sent::Failed,
    };
    let mut progress = false;
    for (update, verdict) in fronts.iter().zip(verdicts) {
        use pb::status_verdict::Kind;
        // Acknowledged, or refused for good (the agent drops it: retrying
        // would block the task's later updates).
        if matches!(
            Kind::try_from(verdict.kind),
            Ok(Kind::Acknowledged | Kind::Refused)
        ) {
            shared.acknowledged(i, update);
            progress = true;
        }
    }
    if progress {
        Sent::Progress
    } else {
        Sent::Waiting
    }
}

/// The agent's executor and status sender in one: ends tasks whose run
/// time is over and sends queued updates until acknowledged.
async fn run_status_sender(shared: Arc<Shared>, i: usize) {
    let agent = &shared.agents[i];
    let mut backoff = Backoff::new(BACKOFF_MIN, shared.config.backoff_max.max(BACKOFF_MIN));
    loop {
        let next_finish = shared.finish_due(i);
        let pending = !lock(&agent.tasks).pending.is_empty();
        let wait = if pending {
            match send_pending(&shared, i).await {
                Sent::Progress => {
                    backoff.reset();
                    continue;
                }
                Sent::Waiting => Some(ACK_POLL),
                Sent::Failed => Some(backoff.next_wait()),
            }
        } else {
            None
        };
        // As the agent's sender, a new update is tried at once.
        let far = tokio::time::Instant::now() + Duration::from_secs(3600);
        tokio::select! {
            _ = agent.queued.notified() => {}
            _ = tokio::time::sleep(wait.unwrap_or_default()), if wait.is_some() => {}
            _ = tokio::time::sleep_until(next_finish.unwrap_or(far)) => {}
        }
    }
}

/// A real master serving in this process (`gpuctl_master::serve`) on
/// 127.0.0.1, on a runtime and threads of its own, as the binary runs it, so
/// that simulated agents in the caller's runtime do not take its threads.
/// Stopped (gracefully) when dropped, or at once with [`kill`](Self::kill).
/// Logs go wherever the process's `tracing` subscriber sends them.
pub struct InProcessMaster {
    addr: String,
    data_dir: std::path::PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    abort: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl InProcessMaster {
    /// Starts a master with its data in `data_dir` and the options of
    /// `MasterConfig::new` (the binary's defaults), changed by `tweak`.
    pub fn start(
        data_dir: std::path::PathBuf,
        tweak: impl FnOnce(&mut gpuctl_master::MasterConfig),
    ) -> std::io::Result<InProcessMaster> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let mut config = gpuctl_master::MasterConfig::new(addr, data_dir);
        tweak(&mut config);
        InProcessMaster::spawn(listener, config)
    }

    /// Starts `n` masters forming one Raft group on loopback, as
    /// `gpuctl-master --node-id I --peers 1=ADDR,2=ADDR,...` would: master
    /// `i` (0-based) is node `i + 1`, keeps its data in
    /// `data_root/master{i+1}` and advertises its own address. Each starts
    /// with the binary's defaults, changed by `tweak(i, config)`. They elect
    /// a leader among themselves; the caller waits for it.
    pub fn start_group(
        n: usize,
        data_root: &std::path::Path,
        tweak: impl Fn(usize, &mut gpuctl_master::MasterConfig),
    ) -> std::io::Result<Vec<InProcessMaster>> {
        // Every address is known before any master starts.
        let listeners = (0..n)
            .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
            .collect::<std::io::Result<Vec<_>>>()?;
        InProcessMaster::start_group_on(listeners, data_root, tweak)
    }

    /// [`start_group`](Self::start_group) on listeners the caller bound
    /// (one master per listener), e.g. with socket options of its own.
    pub fn start_group_on(
        listeners: Vec<std::net::TcpListener>,
        data_root: &std::path::Path,
        tweak: impl Fn(usize, &mut gpuctl_master::MasterConfig),
    ) -> std::io::Result<Vec<InProcessMaster>> {
        let n = listeners.len();
        let addrs = listeners
            .iter()
            .map(|l| l.local_addr())
            .collect::<std::io::Result<Vec<_>>>()?;
        let peers: BTreeMap<u64, String> = (1u64..)
            .zip(&addrs)
            .map(|(id, a)| (id, a.to_string()))
            .collect();
        let mut out = Vec::with_capacity(n);
        for (i, (listener, addr)) in listeners.into_iter().zip(addrs).enumerate() {
            let mut config =
                gpuctl_master::MasterConfig::new(addr, data_root.join(format!("master{}", i + 1)));
            config.node_id = i as u64 + 1;
            config.peers = peers.clone();
            config.advertise = addr.to_string();
            tweak(i, &mut config);
            out.push(InProcessMaster::spawn(listener, config)?);
        }
        Ok(out)
    }

    fn spawn(
        listener: std::net::TcpListener,
        config: gpuctl_master::MasterConfig,
    ) -> std::io::Result<InProcessMaster> {
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let data_dir = config.data_dir.clone();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("master")
            .build()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (abort, mut aborted) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("master".into())
            .spawn(move || {
                let crashed = runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            eprintln!("in-process master: {e}");
                            return false;
                        }
                    };
                    let shutdown = async move {
                        let _ = stopped.await;
                    };
                    tokio::select! {
                        r = gpuctl_master::serve(config, listener, shutdown) => {
                            if let Err(e) = r {
                                eprintln!("in-process master: {e}");
                            }
                            false
                        }
                        // A dropped sender (a graceful stop) disables this.
                        Ok(()) = &mut aborted => true,
                    }
                });
                if crashed {
                    // Its tasks, connections and listener are dropped
                    // without a goodbye, as when the process dies.
                    runtime.shutdown_background();
                } else {
                    runtime.shutdown_timeout(Duration::from_secs(5));
                }
            })?;
        Ok(InProcessMaster {
            addr: addr.to_string(),
            data_dir,
            stop: Some(stop),
            abort: Some(abort),
            thread: Some(thread),
        })
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Where it keeps its log and state.
    pub fn data_dir(&self) -> &std::path::Path {
        &self.data_dir
    }

    /// Stops it at once, as a crash would: its runtime is dropped with
    /// every task, stream and connection, without the graceful shutdown of
    /// the server (what was flushed stays on disk, as after SIGKILL).
    /// Returns once its thread ended.
    pub fn kill(&mut self) {
        if let Some(abort) = self.abort.take() {
            let _ = abort.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Whether it is still serving (not killed or stopped).
    pub fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }
}

impl Drop for InProcessMaster {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
