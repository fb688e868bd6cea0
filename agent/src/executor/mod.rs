//! The executor: a reconcile loop between the tasks the master wants on this
//! agent and what actually runs here, read from the runtimes themselves
//! (containers by name and label, host processes through their
//! supervisors) and from the agent's checkpoints.
//!
//! The decision is pure code (`plan`); this module carries it out. It runs
//! on every change (a desired set, a task's end, an acknowledgement, a GPU
//! fault) and on a timer (`tick`), and every action is idempotent.
//!
//! Tasks outlive the agent. A restarted agent calls [`Executor::recover`]:
//! every task checkpointed under `<work-dir>/state` is found again in its
//! runtime and followed to its end; one that ended while the agent was down
//! is reported with its real exit code; a final status not yet acknowledged
//! is sent again, with the same uuid.

mod checks;
mod dirs;
mod drive;
mod hang;
mod notice;
mod outcome;
mod plan;
mod recover;
mod retention;
mod start;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuctl_core::types::{Runtime, ShareMode, StatusUpdate, TaskSpec, TaskState, UserIds};
use tokio::sync::{mpsc, watch};

use plan::{Action, Phase, TaskView};
pub use plan::{Desired, StopReason};

use crate::checkpoint::{self, Contact};
use crate::isolation::Isolator;
use crate::runtime::{ContainerRuntime, TaskRef};
use drive::*;
use outcome::*;

/// File name of a task's combined output inside its sandbox.
pub const LOG_FILE: &str = "output.log";
/// Written once the runtime has started the task: a task with it whose
/// runtime knows nothing of it vanished.
const STARTED_FILE: &str = "started";
/// How often the loop runs without a change (fence, strays).
pub const TICK: Duration = Duration::from_secs(1);
/// Strays (containers labelled for this agent that it has no record of) are
/// looked for every this many ticks.
const STRAY_SCAN_TICKS: u64 = 10;
const OUTAGE_BACKOFF_MIN: Duration = Duration::from_millis(200);
const OUTAGE_BACKOFF_MAX: Duration = Duration::from_secs(5);

struct LocalTask {
    spec: TaskSpec,
    phase: Phase,
    stop: watch::Sender<Option<StopReason>>,
    /// The uuid of its final update, once decided.
    final_uuid: Option<Vec<u8>>,
    /// The most GPU memory its processes were seen to use (MiB), for a
    /// fraction's failure message.
    gpu_mem_peak_mib: u64,
    /// With a hang timeout: what was last seen of it, from its first look
    /// while running.
    activity: Option<hang::Activity>,
    /// One of its GPUs was busy in a reading since the last look.
    gpu_busy_seen: bool,
}

impl LocalTask {
    fn new(spec: TaskSpec, phase: Phase) -> LocalTask {
        LocalTask {
            spec,
            phase,
            stop: watch::channel(None).0,
            final_uuid: None,
            gpu_mem_peak_mib: 0,
            activity: None,
            gpu_busy_seen: false,
        }
    }

    fn view(&self) -> TaskView {
        TaskView {
            phase: self.phase,
            stopping: self.stop.borrow().clone(),
            no_fence: self.spec.template.no_fence,
            gpus: self.spec.gpu_uuids.clone(),
        }
    }

    fn live(&self) -> bool {
        matches!(self.phase, Phase::Launching | Phase::Running)
    }
}

#[derive(Default)]
struct Inner {
    tasks: BTreeMap<String, LocalTask>,
    /// The master's latest complete desired set; `None` since start until
    /// the first one arrives.
    desired: Option<Desired>,
    /// This agent's unhealthy GPUs and why, by UUID.
    gpu_faults: BTreeMap<String, String>,
    contact: Option<Contact>,
}

/// What the executor needs to isolate tasks.
pub struct IsolationSetup {
    pub isolator: Arc<dyn Isolator>,
    /// What each GPU and MIG device of this agent gives a task, by UUID
    /// (`isolation::grants`): its node minor, and a MIG device's caps.
    pub gpu_grants: crate::isolation::grants::SharedGrants,
    /// The consolidated driver volume, when one could be built.
    pub driver_volume: Option<PathBuf>,
    /// What tasks may do here: users, root, mounts.
    pub policy: crate::security::TaskPolicy,
    /// Each GPU's CDI name, kept current by the CDI publisher; empty when
    /// CDI is off.
    pub cdi: crate::cdi::Names,
    /// The host's NVIDIA driver, for what images require of it.
    pub driver: crate::runtime::HostDriver,
    /// Users of their own for host-process tasks (`task_users`).
    pub users: crate::task_users::TaskUsers,
    /// MPS control daemons for GPUs shared in `mps` mode.
    pub mps: Arc<crate::gpu::mps::Mps>,
    /// The driver's per-cgroup GPU memory cap (r615+), for fractions.
    pub memcap: Arc<crate::gpu::memcap::DriverCap>,
    /// Where containers' cap hooks reach the agent; `None`: containers are
    /// not capped by the driver.
    pub cap_socket: Option<Arc<crate::gpu::cap_socket::CapSocket>>,
    /// The Docker runtime that adds the cap hook (`gpuctl`, registered
    /// with dockerd); `None`: off.
    pub cap_runtime: Option<String>,
    /// Where a task's preflight is asked for (the GPU health thread);
    /// `None`: no health checks here (simulated GPUs, no NVML), so a
    /// job's preflight is skipped, with a warning in the agent's log.
    pub preflight: Option<crate::gpu::health::PreflightTx>,
}

pub struct Executor {
    agent_id: String,
    work_dir: PathBuf,
    runtimes: BTreeMap<Runtime, Arc<dyn ContainerRuntime>>,
    kill_grace: Duration,
    /// How long an ended task's sandbox is kept once the task is forgotten.
    task_retention: Duration,
    isolation: IsolationSetup,
    inner: Mutex<Inner>,
    updates: mpsc::Sender<StatusUpdate>,
    /// Ticks whenever a task ends, for log followers.
    ended_tx: watch::Sender<u64>,
    /// True once the first complete desired set was applied.
    desired_ready: watch::Sender<bool>,
}

impl Executor {
    pub fn new(
        agent_id: String,
        work_dir: PathBuf,
        runtimes: BTreeMap<Runtime, Arc<dyn ContainerRuntime>>,
        kill_grace: Duration,
        task_retention: Duration,
        isolation: IsolationSetup,
        updates: mpsc::Sender<StatusUpdate>,
    ) -> Arc<Executor> {
        Arc::new(Executor {
            agent_id,
            work_dir,
            runtimes,
            kill_grace,
            task_retention,
            isolation,
            inner: Mutex::new(Inner::default()),
            updates,
            ended_tx: watch::channel(0).0,
            desired_ready: watch::channel(false).0,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn task_ref(&self, task_id: &str) -> TaskRef {
        TaskRef {
            task_id: task_id.to_string(),
            agent_id: self.agent_id.clone(),
            state_dir: self.state_dir(task_id),
            log_path: self.sandbox(task_id).join(LOG_FILE),
        }
    }

    /// Tasks the master should keep for this agent when it (re)registers:
    /// every task it knows, running or ended with a final update the
    /// master may not have applied yet.
    pub fn known_task_ids(&self) -> Vec<String> {
        self.lock().tasks.keys().cloned().collect()
    }

    pub fn is_active(&self, task_id: &str) -> bool {
        self.lock().tasks.get(task_id).is_some_and(LocalTask::live)
    }

    pub fn has_ended(&self, task_id: &str) -> bool {
        self.lock()
            .tasks
            .get(task_id)
            .is_some_and(|t| matches!(t.phase, Phase::Ended { .. }))
    }

    pub fn task_ended_watch(&self) -> watch::Receiver<u64> {
        self.ended_tx.subscribe()
    }

    /// The task (and its job) running on each GPU, by UUID.
    pub fn gpu_tasks(&self) -> HashMap<String, (String, String)> {
        let t = self.lock();
        let mut out = HashMap::new();
        // A fraction does not hold its GPU: the GPU's series would name
        // whichever of its tasks came last.
        for (id, task) in t
            .tasks
            .iter()
            .filter(|(_, t)| t.live() && t.spec.share.is_none())
        {
            for g in &task.spec.gpu_uuids {
                out.insert(g.clone(), (id.clone(), task.spec.job_id.clone()));
            }
        }
        out
    }

    /// The GPUs and MIG devices some live task uses, whole or a fraction.
    pub fn busy_gpus(&self) -> std::collections::BTreeSet<String> {
        self.lock()
            .tasks
            .values()
            .filter(|t| t.live())
            .flat_map(|t| t.spec.gpu_uuids.iter().cloned())
            .collect()
    }

    /// The job of each task launched and not yet ended.
    pub fn task_jobs(&self) -> HashMap<String, String> {
        self.lock()
            .tasks
            .iter()
            .filter(|(_, t)| t.live())
            .map(|(id, t)| (id.clone(), t.spec.job_id.clone()))
            .collect()
    }

    /// Tasks launched and not yet ended.
    pub fn active_tasks(&self) -> usize {
        self.lock().tasks.values().filter(|t| t.live()).count()
    }

    /// The master's latest complete desired set.
    pub fn set_desired(self: &Arc<Self>, desired: Desired) {
        self.lock().desired = Some(desired);
        self.reconcile();
        // After the reconcile: a task waiting for this (see `drive_inner`)
        // has its stop reason by now if it is no longer wanted.
        self.desired_ready.send_replace(true);
    }

    /// The health checks' latest view: tasks on a GPU that just turned
    /// unhealthy are stopped and end FAILED with the GPU's reason, and no
    /// task is started on an unhealthy GPU.
    pub fn set_gpu_faults(self: &Arc<Self>, faults: BTreeMap<String, String>) {
        self.lock().gpu_faults = faults;
        self.reconcile();
    }

    /// The memory watch's verdict, by task: a running task whose processes
    /// together use more GPU memory than its fraction is stopped, and ends
    /// FAILED with REASON_GPU_MEMORY_LIMIT and `why`.
    pub fn stop_over_memory(self: &Arc<Self>, over: BTreeMap<String, String>) {
        let t = self.lock();
        for (task_id, why) in over {
            let Some(task) = t.tasks.get(&task_id) else {
                continue;
            };
            if task.phase == Phase::Running && task.stop.borrow().is_none() {
                tracing::warn!(task_id, reason = %why, "stopping task over its GPU memory");
                task.stop
                    .send_replace(Some(StopReason::GpuMemoryLimit(why)));
            }
        }
    }

    /// Each task's GPU memory in the latest readings: the most seen is
    /// kept, for its failure message.
    pub fn note_gpu_memory(&self, gpus: &[crate::gpu::health::GpuHealth]) {
        let mut t = self.lock();
        let used = gpus
            .iter()
            .filter_map(|g| g.sample.as_ref())
            .flat_map(|s| s.task_memory_used_mib.iter());
        for (task, mib) in used {
            if let Some(task) = t.tasks.get_mut(task) {
                task.gpu_mem_peak_mib = task.gpu_mem_peak_mib.max(*mib);
            }
        }
        // GPUs (and MIG devices) that worked, for the hang check.
        let busy: std::collections::BTreeSet<&str> = gpus
            .iter()
            .filter(|g| g.sample.as_ref().is_some_and(|s| s.utilization_pct > 0))
            .map(|g| g.uuid.as_str())
            .chain(
                gpus.iter()
                    .flat_map(|g| &g.mig)
                    .filter(|m| m.utilization_pct.is_some_and(|u| u > 0))
                    .map(|m| m.uuid.as_str()),
            )
            .collect();
        if !busy.is_empty() {
            for task in t.tasks.values_mut() {
                if task
                    .spec
                    .gpu_uuids
                    .iter()
                    .any(|g| busy.contains(g.as_str()))
                {
                    task.gpu_busy_seen = true;
                }
            }
        }
    }

    /// Stops, as hung, each running task with a hang timeout whose log has
    /// not grown and whose GPUs have not worked for that long.
    fn stop_hung(&self) {
        let now = std::time::Instant::now();
        let mut t = self.lock();
        for (id, task) in t.tasks.iter_mut() {
            let Some(ms) = task.spec.template.hang_timeout_ms else {
                continue;
            };
            if task.phase != Phase::Running || task.stop.borrow().is_some() {
                continue;
            }
            let log_len = std::fs::metadata(self.sandbox(id).join(LOG_FILE)).map_or(0, |m| m.len());
            let beat = std::fs::metadata(self.heartbeat_dir(id).join(hang::HEARTBEAT_FILE))
                .and_then(|m| m.modified())
                .ok();
            let busy = std::mem::take(&mut task.gpu_busy_seen);
            let clock_path = self.state_dir(id).join(hang::CLOCK_FILE);
            let activity = task.activity.get_or_insert_with(|| {
                // An earlier agent process's clock, if it saved one.
                match checkpoint::read_json::<hang::Clock>(&clock_path) {
                    Ok(Some(c)) => hang::Activity::restored(&c, now, std::time::SystemTime::now()),
                    _ => hang::Activity::new(now),
                }
            });
            let hung = activity.look(now, log_len, beat, busy, Duration::from_millis(ms));
            if let Some(clock) = activity.clock_to_save(Duration::from_millis(ms / 10)) {
                // Once per quiet spell; a failure only costs the next
                // agent process the spell so far.
                if let Err(e) = checkpoint::write_json(&clock_path, &clock) {
                    tracing::warn!(task_id = %id, error = %e, "could not save the hang clock");
                }
            }
            if let Some(idle) = hung {
                let why = hang::hung_message(idle);
                tracing::warn!(task_id = %id, reason = %why, "stopping a hung task");
                task.stop.send_replace(Some(StopReason::Hung(why)));
            }
        }
    }

    /// The running tasks whose GPU memory this agent holds to their
    /// fraction: those on `mps` GPUs, when MPS runs here (they said
    /// `mps`). Time-sliced fractions say `none` and are only counted.
    pub fn memory_watched(&self) -> Vec<crate::gpu::procs::Watched> {
        if !self.isolation.mps.available() {
            return Vec::new();
        }
        self.lock()
            .tasks
            .iter()
            .filter(|(_, t)| t.phase == Phase::Running)
            .filter_map(|(id, t)| {
                let (gpu, share) = t.spec.holding().fraction()?;
                (share.mode == ShareMode::Mps).then(|| crate::gpu::procs::Watched {
                    task: id.clone(),
                    gpu: gpu.clone(),
                    limit_mib: share.fraction.mem_mib,
                })
            })
            .collect()
    }

    /// A leader answered a heartbeat sent at `sent_ms` (wall clock): the
    /// fence deadline moves on. Recorded on disk for the supervisors and for
    /// the next agent process.
    pub fn record_contact(&self, contact: Contact) {
        self.lock().contact = Some(contact);
        if let Err(e) = checkpoint::write_json(&checkpoint::contact_path(&self.work_dir), &contact)
        {
            tracing::warn!(error = %e, "could not record the master contact");
        }
    }

    pub fn kill_grace(&self) -> Duration {
        self.kill_grace
    }

    /// The fence timeout the master asked for, as last recorded.
    pub(crate) fn fence_timeout_ms(&self) -> u64 {
        self.lock().contact.map_or(0, |c| c.fence_timeout_ms)
    }

    /// The master acknowledged `update`: a final one need not be sent again.
    pub fn acknowledged(self: &Arc<Self>, update: &StatusUpdate) {
        if !update.state.is_terminal() {
            return;
        }
        {
            let mut t = self.lock();
            let Some(task) = t.tasks.get_mut(&update.task_id) else {
                return;
            };
            if task.final_uuid.as_deref() != Some(update.uuid.as_slice()) {
                return;
            }
            task.phase = Phase::Ended { acked: true };
        }
        let path = self.state_dir(&update.task_id).join(checkpoint::ACKED_FILE);
        if let Err(e) = checkpoint::write_atomic(&path, b"") {
            tracing::warn!(task_id = %update.task_id, error = %e, "could not record the acknowledgement");
        }
        self.reconcile();
    }

    /// Makes what runs here match what the master wants (see `plan`).
    pub fn reconcile(self: &Arc<Self>) {
        let mut launches = Vec::new();
        let mut refusals = Vec::new();
        let mut forgets = Vec::new();
        let fence_ms;
        // Read before the executor's lock: a MIG layout change replaces the
        // grants, and a task's MIG device must fail with its parent.
        let mig_parents = crate::isolation::grants::mig_parents(
            &self
                .isolation
                .gpu_grants
                .read()
                .unwrap_or_else(|p| p.into_inner()),
        );
        {
            let mut guard = self.lock();
            // Split borrows: the actions borrow the desired set while the
            // tasks change.
            let t: &mut Inner = &mut guard;
            fence_ms = t.contact.map_or(0, |c| c.fence_timeout_ms);
            let fenced = t
                .contact
                .is_some_and(|c| c.expired_at(checkpoint::wall_ms()));
            let views: BTreeMap<String, TaskView> = t
                .tasks
                .iter()
                .map(|(id, l)| (id.clone(), l.view()))
                .collect();
            let actions = plan::plan(&plan::Input {
                desired: t.desired.as_ref(),
                tasks: &views,
                gpu_faults: &t.gpu_faults,
                mig_parents: &mig_parents,
                fenced,
            });
            for action in actions {
                match action {
                    Action::Launch(spec) => {
                        let local = LocalTask::new(spec.clone(), Phase::Launching);
                        let stop = local.stop.subscribe();
                        t.tasks.insert(spec.task_id.clone(), local);
                        launches.push((spec.clone(), stop));
                    }
                    Action::Refuse {
                        task_id,
                        spec,
                        reason,
                    } => {
                        let spec = spec.cloned().unwrap_or_else(|| TaskSpec {
                            share: None,
                            task_id: task_id.clone(),
                            job_id: String::new(),
                            framework_id: String::new(),
                            gpu_uuids: Vec::new(),
                            template: Default::default(),
                        });
                        t.tasks
                            .insert(task_id, LocalTask::new(spec.clone(), Phase::Launching));
                        refusals.push((spec, reason));
                    }
                    Action::Stop { task_id, reason } => {
                        if let Some(task) = t.tasks.get(&task_id) {
                            tracing::info!(task_id = %task_id, reason = ?reason, "stopping task");
                            task.stop.send_replace(Some(reason));
                        }
                    }
                    Action::Forget(task_id) => {
                        t.tasks.remove(&task_id);
                        forgets.push(task_id);
                    }
                }
            }
        }
        for (spec, stop) in launches {
            let me = self.clone();
            tokio::spawn(async move { me.drive(spec, stop, false).await });
        }
        for (spec, reason) in refusals {
            let me = self.clone();
            tokio::spawn(async move {
                if let Err(e) = me.checkpoint_spec(&spec) {
                    tracing::warn!(task_id = %spec.task_id, error = %e, "could not checkpoint a refused task");
                }
                let outcome = Outcome::refused(&reason, fence_ms);
                me.finish(&spec.task_id, outcome).await;
            });
        }
        for id in forgets {
            // Before the checkpoint goes: a crash between the two forgets
            // the task again after recovery, restarting the clock. The
            // sandbox is the agent's again from here on.
            self.retire(&id);
            for (dir, what) in [
                (self.notice_dir(&id), "notice"),
                (self.heartbeat_dir(&id), "heartbeat"),
            ] {
                match std::fs::remove_dir_all(&dir) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        tracing::warn!(task_id = %id, error = %e, "could not remove the task's {what} directory")
                    }
                    _ => {}
                }
            }
            let dir = self.state_dir(&id);
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => self.isolation.users.release(&id),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    self.isolation.users.release(&id)
                }
                // Its user stays leased while its record does.
                Err(e) => {
                    tracing::warn!(task_id = %id, error = %e, "could not remove the task's checkpoint")
                }
            }
        }
    }

    /// Runs the loop on a timer: the fence deadline passes without any
    /// event, and strays are looked for now and then.
    pub async fn tick(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let mut interval = tokio::time::interval(TICK);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut n: u64 = 0;
        loop {
            tokio::select! {
                _ = interval.tick() => {}
                _ = shutdown.changed() => return,
            }
            self.reconcile();
            self.stop_hung();
            n += 1;
            if n % STRAY_SCAN_TICKS == 1 {
                self.remove_strays().await;
            }
        }
    }

    /// Containers labelled for this agent that it has no record of (their
    /// checkpoint was lost): nobody would ever report or stop them, and
    /// they may hold GPUs the master gives to others. Stopped and removed.
    async fn remove_strays(&self) {
        for rt in self.runtimes.values() {
            let Ok(ids) = rt.list(&self.agent_id).await else {
                continue;
            };
            let strays: Vec<String> = {
                let t = self.lock();
                ids.into_iter()
                    .filter(|id| !t.tasks.contains_key(id))
                    .collect()
            };
            for id in strays {
                tracing::warn!(task_id = %id, runtime = %rt.kind(), "a task this agent has no record of: removing it");
                let tref = self.task_ref(&id);
                let _ = rt.stop(&tref, self.kill_grace).await;
                if let Err(e) = rt.remove(&tref).await {
                    tracing::warn!(task_id = %id, error = %e, "could not remove a stray task");
                }
            }
        }
    }

    /// Whether the runtimes answer, for heartbeats.
    pub fn runtime_status(&self) -> Vec<(Runtime, crate::runtime::RuntimeStatus)> {
        self.runtimes
            .iter()
            .map(|(k, rt)| (*k, rt.status()))
            .collect()
    }

    /// Stops every task and waits up to `timeout` (an agent configured to
    /// take its tasks down with it, such as the one `gpuctl demo` runs).
    pub async fn kill_all(self: &Arc<Self>, timeout: Duration) {
        {
            let t = self.lock();
            for task in t.tasks.values().filter(|t| t.live()) {
                if task.stop.borrow().is_none() {
                    task.stop.send_replace(Some(StopReason::Killed));
                }
            }
        }
        let deadline = tokio::time::Instant::now() + timeout;
        while self.active_tasks() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn checkpoint_spec(&self, spec: &TaskSpec) -> Result<(), checkpoint::CheckpointError> {
        let dir = self.state_dir(&spec.task_id);
        std::fs::create_dir_all(&dir).map_err(|source| checkpoint::CheckpointError::Io {
            path: dir.clone(),
            source,
        })?;
        checkpoint::write_json(&dir.join(checkpoint::TASK_FILE), spec)
    }

    async fn send(&self, update: StatusUpdate) {
        let task_id = update.task_id.clone();
        if self.updates.send(update).await.is_err() {
            tracing::error!(task_id = %task_id, "status channel closed; update dropped");
        }
    }

    fn update(&self, task_id: &str, state: TaskState) -> StatusUpdate {
        StatusUpdate {
            enforcement: None,
            agent_id: self.agent_id.clone(),
            task_id: task_id.to_string(),
            state,
            exit_code: None,
            message: String::new(),
            uuid: uuid::Uuid::new_v4().as_bytes().to_vec(),
            gpu_unhealthy: false,
            fenced: false,
            gpu_memory_limit: false,
            hung: false,
            requires: Vec::new(),
            latest_state: None,
            failed_gpus: Vec::new(),
            runtime_restarted: false,
            liveness_failed: false,
            health: None,
        }
    }

    fn set_phase(&self, task_id: &str, phase: Phase) {
        if let Some(t) = self.lock().tasks.get_mut(task_id) {
            t.phase = phase;
        }
    }

    /// Removes the task's cgroup (its processes are gone by now), its claim
    /// on an MPS daemon, and first its driver memory cap.
    fn release(&self, task_id: &str) {
        self.isolation.mps.release(task_id);
        if let Err(e) = self.isolation.memcap.clear(task_id) {
            tracing::warn!(task_id, error = %e, "could not clear the task's driver memory cap");
        }
        if let Err(e) = self.isolation.isolator.release(task_id) {
            tracing::warn!(task_id, error = %e, "could not remove the task's cgroup");
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod shell_tests;
