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

mod notice;
mod plan;
mod retention;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuctl_core::time::Backoff;
use gpuctl_core::types::{
    Runtime, ShareMode, StatusUpdate, TaskShare, TaskSpec, TaskState, UserIds,
};
use tokio::sync::{mpsc, watch};

use plan::{Action, Phase, TaskView};
pub use plan::{Desired, StopReason};

use crate::checkpoint::{self, Contact};
use crate::isolation::Isolator;
use crate::runtime::{
    ContainerRuntime, Ended, LaunchSpec, Observed, RuntimeError, TaskIsolation, TaskRef,
};
use crate::task_users;

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
}

impl LocalTask {
    fn new(spec: TaskSpec, phase: Phase) -> LocalTask {
        LocalTask {
            spec,
            phase,
            stop: watch::channel(None).0,
            final_uuid: None,
            gpu_mem_peak_mib: 0,
        }
    }

    fn view(&self) -> TaskView {
        TaskView {
            phase: self.phase,
            stopping: self.stop.borrow().clone(),
            no_fence: self.spec.no_fence,
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
    pub isolator: Isolator,
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
}

/// How a task ended, as reported to the master.
#[derive(Debug, Clone, PartialEq)]
struct Outcome {
    state: TaskState,
    exit_code: Option<i32>,
    message: String,
    gpu_unhealthy: bool,
    /// Stopped by the fence (REASON_FENCED).
    fenced: bool,
    /// Stopped for using more GPU memory than its fraction
    /// (REASON_GPU_MEMORY_LIMIT).
    gpu_memory_limit: bool,
    /// Refused because the host's driver does not meet what the image
    /// requires: all the image's requirements
    /// (REASON_DRIVER_REQUIREMENT_UNMET).
    requires: Vec<String>,
}

impl Outcome {
    fn failed(message: impl Into<String>) -> Outcome {
        Outcome {
            state: TaskState::Failed,
            exit_code: None,
            message: message.into(),
            gpu_unhealthy: false,
            fenced: false,
            gpu_memory_limit: false,
            requires: Vec::new(),
        }
    }

    /// A task that ends without having started.
    fn refused(reason: &StopReason, fence_timeout_ms: u64) -> Outcome {
        match reason {
            StopReason::GpuFailed(why) => Outcome {
                gpu_unhealthy: true,
                ..Outcome::failed(why.clone())
            },
            StopReason::Fenced => Outcome {
                state: TaskState::Killed,
                fenced: true,
                ..Outcome::failed(fence_message(fence_timeout_ms))
            },
            StopReason::Killed | StopReason::NotWanted => Outcome {
                state: TaskState::Killed,
                ..Outcome::failed("killed before it started")
            },
            StopReason::GpuMemoryLimit(why) => Outcome {
                gpu_memory_limit: true,
                ..Outcome::failed(why.clone())
            },
        }
    }

    /// A task that ran, ended as `ended`, while being stopped for `reason`.
    fn ran(ended: Ended, reason: Option<&StopReason>, fence_timeout_ms: u64) -> Outcome {
        if let Some(e) = ended.error {
            return Outcome::failed(e);
        }
        let code = ended.code;
        if ended.fenced || reason == Some(&StopReason::Fenced) {
            return Outcome {
                state: TaskState::Killed,
                exit_code: code,
                message: fence_message(fence_timeout_ms),
                gpu_unhealthy: false,
                fenced: true,
                gpu_memory_limit: false,
                requires: Vec::new(),
            };
        }
        match reason {
            // One that finished cleanly first succeeded all the same.
            Some(StopReason::GpuFailed(why)) if code != Some(0) => Outcome {
                gpu_unhealthy: true,
                exit_code: code,
                ..Outcome::failed(why.clone())
            },
            Some(StopReason::GpuMemoryLimit(why)) if code != Some(0) => Outcome {
                gpu_memory_limit: true,
                exit_code: code,
                ..Outcome::failed(why.clone())
            },
            Some(StopReason::Killed | StopReason::NotWanted) => Outcome {
                state: TaskState::Killed,
                exit_code: None,
                message: "killed".into(),
                gpu_unhealthy: false,
                fenced: false,
                gpu_memory_limit: false,
                requires: Vec::new(),
            },
            _ => match code {
                Some(0) => Outcome {
                    state: TaskState::Finished,
                    exit_code: Some(0),
                    message: String::new(),
                    gpu_unhealthy: false,
                    fenced: false,
                    gpu_memory_limit: false,
                    requires: Vec::new(),
                },
                Some(c) => Outcome {
                    exit_code: Some(c),
                    ..Outcome::failed(format!("exited with code {c}"))
                },
                None => Outcome::failed("ended without an exit code"),
            },
        }
    }
}

/// For a fraction that failed after its processes were seen using at least
/// 95% of its memory: a likely cause, said as such. A cap at allocation
/// (MPS's, the driver's) makes CUDA answer out-of-memory and the task exit
/// with its own code, which the agent cannot tell apart from any other.
fn near_fraction(peak_mib: u64, fraction_mib: u64) -> Option<String> {
    (fraction_mib > 0 && peak_mib.saturating_mul(100) >= fraction_mib.saturating_mul(95)).then(
        || {
            format!(
                "its GPU memory was seen at {peak_mib} MiB of its {fraction_mib} MiB fraction: \
             an allocation past the fraction fails with out-of-memory"
            )
        },
    )
}

fn fence_message(fence_timeout_ms: u64) -> String {
    format!(
        "fenced: the agent had no contact with a master for {:.0} s",
        fence_timeout_ms as f64 / 1000.0
    )
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

    pub fn sandbox(&self, task_id: &str) -> PathBuf {
        self.work_dir.join(checkpoint::SANDBOX_DIR).join(task_id)
    }

    fn state_dir(&self, task_id: &str) -> PathBuf {
        self.work_dir.join(checkpoint::STATE_DIR).join(task_id)
    }

    /// Where the task's notice before a stop is written (`notice`).
    fn notice_dir(&self, task_id: &str) -> PathBuf {
        self.work_dir.join(checkpoint::NOTICE_DIR).join(task_id)
    }

    /// The grace of a stop for `reason`: the job's for what the master
    /// asked (its kill, or its forgetting the task), the agent's kill grace
    /// otherwise. A fence stop keeps the agent's: the master's lost timeout
    /// is checked against it (`check_kill_grace`).
    fn stop_grace(&self, spec: &TaskSpec, reason: Option<&StopReason>) -> Duration {
        match reason {
            Some(StopReason::Killed | StopReason::NotWanted) => spec
                .stop_grace_ms
                .map_or(self.kill_grace, Duration::from_millis),
            _ => self.kill_grace,
        }
    }

    /// Writes the task's notice (atomically: a reader sees all or none of
    /// it) before its stop begins. A task whose notice cannot be written is
    /// stopped all the same.
    fn write_notice(&self, task_id: &str, reason: &StopReason, grace: Duration) {
        let from_master = self
            .lock()
            .desired
            .as_ref()
            .and_then(|d| d.notices.get(task_id).cloned());
        let n = notice::of(reason, from_master.as_ref());
        let text = notice::text(&n, grace, checkpoint::wall_ms());
        let dir = self.notice_dir(task_id);
        match checkpoint::write_atomic_mode(&dir.join(notice::FILE), text.as_bytes(), 0o644) {
            Ok(()) => {
                tracing::info!(task_id, kind = %n.kind, grace_ms = grace.as_millis() as u64, "stop notice written")
            }
            // Made at start by an agent that knew of notices; an older
            // one's task has none.
            Err(e) => {
                tracing::warn!(task_id, error = %e, "could not write the task's stop notice")
            }
        }
    }

    /// Makes the task's notice directory, the agent's: `user`'s group may
    /// read it (anyone, when the task's user is not known, as a container's
    /// image user), nobody but the agent write it.
    fn make_notice_dir(&self, task_id: &str, user: Option<UserIds>) -> std::io::Result<PathBuf> {
        let root = self.work_dir.join(checkpoint::NOTICE_DIR);
        std::fs::create_dir_all(&root)?;
        // Tasks pass through, without listing the others'.
        set_mode(&root, 0o711)?;
        let dir = self.notice_dir(task_id);
        std::fs::create_dir_all(&dir)?;
        // A notice of an earlier agent process's start of this task goes.
        match std::fs::remove_file(dir.join(notice::FILE)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        match user {
            Some(u) if !u.is_root() => {
                std::os::unix::fs::chown(&dir, None, Some(u.gid))?;
                set_mode(&dir, 0o750)?;
            }
            _ => set_mode(&dir, 0o755)?,
        }
        Ok(dir)
    }

    fn task_ref(&self, task_id: &str) -> TaskRef {
        TaskRef {
            task_id: task_id.to_string(),
            agent_id: self.agent_id.clone(),
            state_dir: self.state_dir(task_id),
            log_path: self.sandbox(task_id).join(LOG_FILE),
        }
    }

    /// Finds every task an earlier agent process left in `<work-dir>/state`
    /// and takes it over: running ones are followed to their end, final
    /// statuses not yet acknowledged are sent again. Also removes the task
    /// cgroups of tasks it does not know. Call once, before the master link.
    pub fn recover(self: &Arc<Self>) {
        let root = self.work_dir.join(checkpoint::STATE_DIR);
        if let Err(e) = std::fs::create_dir_all(&root) {
            tracing::error!(path = %root.display(), error = %e, "cannot create the state directory");
        }
        // Launch records hold every task's environment: no task reads them.
        if let Err(e) = set_mode(&root, 0o700) {
            tracing::warn!(path = %root.display(), error = %e, "cannot make the state directory private");
        }
        match checkpoint::read_contact(&checkpoint::contact_path(&self.work_dir)) {
            Ok(c) => self.lock().contact = c,
            Err(e) => tracing::warn!(error = %e, "unreadable contact record; starting without one"),
        }
        let mut resend = Vec::new();
        let mut follow = Vec::new();
        let entries = std::fs::read_dir(&root).into_iter().flatten().flatten();
        for entry in entries {
            let dir = entry.path();
            let id = entry.file_name().to_string_lossy().into_owned();
            let spec = match checkpoint::read_json::<TaskSpec>(&dir.join(checkpoint::TASK_FILE)) {
                Ok(Some(s)) if s.task_id == id => s,
                Ok(_) => {
                    // Made by an agent that died before it wrote the spec:
                    // nothing was started from it.
                    let _ = std::fs::remove_dir_all(&dir);
                    continue;
                }
                Err(e) => {
                    tracing::error!(task_id = %id, error = %e, "unreadable task checkpoint; left alone");
                    continue;
                }
            };
            // Whatever may still run under its user keeps it.
            match checkpoint::read_json::<UserIds>(&dir.join(task_users::USER_FILE)) {
                Ok(Some(ids)) => self.isolation.users.restore(&id, ids),
                Ok(None) => {}
                Err(e) => {
                    tracing::error!(task_id = %id, error = %e, "unreadable task user record; left alone");
                    continue;
                }
            }
            let final_update =
                checkpoint::read_json::<StatusUpdate>(&dir.join(checkpoint::FINAL_FILE))
                    .ok()
                    .flatten();
            let mut t = self.lock();
            match final_update {
                Some(u) => {
                    let acked = dir.join(checkpoint::ACKED_FILE).exists();
                    let mut local = LocalTask::new(spec, Phase::Ended { acked });
                    local.final_uuid = Some(u.uuid.clone());
                    t.tasks.insert(id.clone(), local);
                    if !acked {
                        resend.push(u);
                    }
                }
                None => {
                    let local = LocalTask::new(spec.clone(), Phase::Running);
                    let stop = local.stop.subscribe();
                    t.tasks.insert(id.clone(), local);
                    follow.push((spec, stop));
                }
            }
        }
        let known: BTreeSet<String> = self.lock().tasks.keys().cloned().collect();
        match self.isolation.isolator.remove_stale(&known) {
            Ok(0) => {}
            Ok(n) => tracing::info!(removed = n, "removed task cgroups of tasks no longer here"),
            Err(e) => tracing::warn!(error = %e, "could not remove every stale task cgroup"),
        }
        tracing::info!(
            reattached = follow.len(),
            unacknowledged = resend.len(),
            known = known.len(),
            "recovered tasks from the work dir"
        );
        for (spec, stop) in follow {
            let me = self.clone();
            tokio::spawn(async move { me.drive(spec, stop, true).await });
        }
        let updates = self.updates.clone();
        tokio::spawn(async move {
            for u in resend {
                if updates.send(u).await.is_err() {
                    return;
                }
            }
        });
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
                let share = t.spec.share.as_ref().filter(|s| s.mode == ShareMode::Mps)?;
                Some(crate::gpu::procs::Watched {
                    task: id.clone(),
                    gpu: t.spec.gpu_uuids.first()?.clone(),
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
            let mut t = self.lock();
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
                    Action::Launch(id) => {
                        let Some(spec) = t.desired.as_ref().and_then(|d| d.run.get(&id)).cloned()
                        else {
                            continue;
                        };
                        let local = LocalTask::new(spec.clone(), Phase::Launching);
                        let stop = local.stop.subscribe();
                        t.tasks.insert(id, local);
                        launches.push((spec, stop));
                    }
                    Action::Refuse { task_id, reason } => {
                        let spec = t
                            .desired
                            .as_ref()
                            .and_then(|d| d.run.get(&task_id))
                            .cloned()
                            .unwrap_or_else(|| TaskSpec {
                                share: None,
                                stop_grace_ms: None,
                                checkpoint_dir: None,
                                task_id: task_id.clone(),
                                job_id: String::new(),
                                framework_id: String::new(),
                                image: None,
                                command: Vec::new(),
                                env: BTreeMap::new(),
                                resources: Default::default(),
                                gpu_uuids: Vec::new(),
                                no_fence: false,
                                security: Default::default(),
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
            match std::fs::remove_dir_all(self.notice_dir(&id)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    tracing::warn!(task_id = %id, error = %e, "could not remove the task's notice directory")
                }
                _ => {}
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
            requires: Vec::new(),
            latest_state: None,
        }
    }

    /// Decides the task's final status once: checkpointed first, then sent
    /// until acknowledged (again by the next agent process if need be).
    async fn finish(self: &Arc<Self>, task_id: &str, outcome: Outcome) {
        let mut u = self.update(task_id, outcome.state);
        u.exit_code = outcome.exit_code;
        u.message = outcome.message;
        u.gpu_unhealthy = outcome.gpu_unhealthy;
        u.fenced = outcome.fenced;
        u.gpu_memory_limit = outcome.gpu_memory_limit;
        u.requires = outcome.requires;
        let path = self.state_dir(task_id).join(checkpoint::FINAL_FILE);
        if let Err(e) = checkpoint::write_json(&path, &u) {
            tracing::error!(task_id, error = %e, "could not checkpoint the final status; sending it anyway");
        }
        {
            let mut t = self.lock();
            if let Some(task) = t.tasks.get_mut(task_id) {
                task.phase = Phase::Ended { acked: false };
                task.final_uuid = Some(u.uuid.clone());
            }
        }
        tracing::info!(task_id, state = %u.state, exit_code = ?u.exit_code, message = %u.message, "task ended");
        self.ended_tx.send_modify(|n| *n += 1);
        self.send(u).await;
        self.reconcile();
    }

    fn gpu_env(spec: &TaskSpec) -> BTreeMap<String, String> {
        let mut env = spec.env.clone();
        let ids = spec.gpu_uuids.join(",");
        // A task without GPUs gets "void" (never inherit an image's "all").
        env.insert(
            "NVIDIA_VISIBLE_DEVICES".into(),
            if ids.is_empty() {
                "void".into()
            } else {
                ids.clone()
            },
        );
        env.insert("CUDA_VISIBLE_DEVICES".into(), ids.clone());
        env.insert("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into());
        env.insert(
            "NVIDIA_DRIVER_CAPABILITIES".into(),
            "compute,utility".into(),
        );
        env.insert("GPUCTL_GPUS".into(), ids);
        env.insert("GPUCTL_TASK_ID".into(), spec.task_id.clone());
        env.insert("GPUCTL_JOB_ID".into(), spec.job_id.clone());
        // Only the agent asks for the driver's cap.
        env.remove(crate::runtime::oci_hook::CAP_ENV);
        env
    }

    /// One task from launch (or reattachment) to its final status.
    async fn drive(
        self: Arc<Self>,
        spec: TaskSpec,
        mut stop: watch::Receiver<Option<StopReason>>,
        reattach: bool,
    ) {
        let task_id = spec.task_id.clone();
        let outcome = self.drive_inner(&spec, &mut stop, reattach).await;
        self.finish(&task_id, outcome).await;
    }

    async fn drive_inner(
        &self,
        spec: &TaskSpec,
        stop: &mut watch::Receiver<Option<StopReason>>,
        reattach: bool,
    ) -> Outcome {
        let task_id = spec.task_id.as_str();
        let fence_ms = self.fence_timeout_ms();
        let kind = if spec.image.is_some() {
            Runtime::Docker
        } else {
            Runtime::Process
        };
        let Some(rt) = self.runtimes.get(&kind).cloned() else {
            return Outcome::failed(format!("this agent has no {kind} runtime"));
        };
        let tref = self.task_ref(task_id);
        let mut started = false;
        if reattach {
            // Its MPS daemon outlived the agent too: kept for it from now,
            // before the runtime answers (Docker may be down a while, and
            // an unclaimed daemon is quit as idle).
            let group = std::fs::read_to_string(self.state_dir(task_id).join(MPS_GROUP_FILE));
            if let (Some(sh), Some(gpu), Ok(group)) = (&spec.share, spec.gpu_uuids.first(), group) {
                if sh.mode == ShareMode::Mps && self.isolation.mps.available() {
                    self.isolation.mps.adopt(task_id, gpu, group.trim());
                }
            }
            let mut backoff = Backoff::new(OUTAGE_BACKOFF_MIN, OUTAGE_BACKOFF_MAX);
            loop {
                match rt.observe(&tref).await {
                    Ok(Observed::NotStarted) => {
                        if tref.state_dir.join(STARTED_FILE).exists() {
                            self.release(task_id);
                            return Outcome::failed("the task vanished while the agent was down");
                        }
                        break;
                    }
                    Ok(Observed::Running | Observed::Ended(_)) => {
                        started = true;
                        break;
                    }
                    Err(e) if e.is_unavailable() => {
                        tokio::time::sleep(backoff.next_wait()).await;
                    }
                    Err(e) => return Outcome::failed(e.to_string()),
                }
            }
        }
        let mut enforcement = None;
        if !started {
            if reattach {
                // Checkpointed by an agent that died before the runtime
                // started it: start it only if the master still wants it,
                // which the first desired set says (a stop comes with it).
                let mut ready = self.desired_ready.subscribe();
                tokio::select! {
                    _ = ready.wait_for(|r| *r) => {}
                    _ = stop.wait_for(|s| s.is_some()) => {}
                }
            }
            match self.start(spec, &rt, stop, fence_ms).await {
                Ok(e) => enforcement = e,
                Err(o) => {
                    // What was made for it before it failed (its cgroup, its
                    // claim on an MPS daemon, a driver cap) goes with it.
                    self.release(task_id);
                    return o;
                }
            }
        }
        self.set_phase(task_id, Phase::Running);
        let mut running = self.update(task_id, TaskState::Running);
        // A level known only once the container was made (its driver cap).
        running.enforcement = enforcement;
        self.send(running).await;

        // Follow it to its end; a stop request is carried out beside.
        let wait = rt.wait(&tref);
        tokio::pin!(wait);
        let mut stopping = false;
        let ended = loop {
            let reason = stop.borrow().clone();
            if let (false, Some(reason)) = (stopping, reason) {
                stopping = true;
                // The notice first: it is there when SIGTERM comes.
                let grace = self.stop_grace(spec, Some(&reason));
                self.write_notice(task_id, &reason, grace);
                tokio::spawn(stop_until_done(rt.clone(), tref.clone(), grace));
            }
            tokio::select! {
                r = &mut wait => break r,
                r = stop.changed() => if r.is_err() {
                    // The task was forgotten; it still runs to its end.
                    break (&mut wait).await;
                },
            }
        };
        // The container first (Docker removes its own cgroup, inside the
        // task's), then what is left in the task's cgroups.
        remove_until_done(&rt, &tref).await;
        self.release(task_id);
        let reason = stop.borrow().clone();
        let mut outcome = match ended {
            Ok(e) => Outcome::ran(e, reason.as_ref(), fence_ms),
            Err(e) => Outcome::failed(e.to_string()),
        };
        if let (Some(sh), Some(_)) = (&spec.share, outcome.exit_code.filter(|c| *c != 0)) {
            let peak = self
                .lock()
                .tasks
                .get(task_id)
                .map_or(0, |t| t.gpu_mem_peak_mib);
            if let Some(hint) = near_fraction(peak, sh.fraction.mem_mib) {
                outcome.message = format!("{}; {hint}", outcome.message);
            }
        }
        outcome
    }

    /// Prepares and starts a task; `Err` with its final outcome when it
    /// ends before it ran.
    async fn start(
        &self,
        spec: &TaskSpec,
        rt: &Arc<dyn ContainerRuntime>,
        stop: &mut watch::Receiver<Option<StopReason>>,
        fence_ms: u64,
    ) -> Result<Option<gpuctl_core::types::Enforcement>, Outcome> {
        let task_id = spec.task_id.as_str();
        if let Some(r) = stop.borrow().clone() {
            return Err(Outcome::refused(&r, fence_ms));
        }
        // Nothing starts past the fence: the master may have given up on it.
        let fenced = self
            .lock()
            .contact
            .is_some_and(|c| c.expired_at(checkpoint::wall_ms()));
        if fenced && !spec.no_fence {
            return Err(Outcome::refused(&StopReason::Fenced, fence_ms));
        }
        self.checkpoint_spec(spec)
            .map_err(|e| Outcome::failed(format!("checkpoint: {e}")))?;
        // Refused before anything is made for it when it asks for more
        // than this agent allows.
        let mut security = self
            .isolation
            .policy
            .resolve(spec, &crate::security::RealHost)
            .map_err(|why| {
                tracing::warn!(task_id, reason = %why, "task refused");
                Outcome::failed(why)
            })?;
        let checkpoint_dir = self
            .isolation
            .policy
            .checkpoint_dir(spec, &crate::security::RealHost)
            .map_err(|why| {
                tracing::warn!(task_id, reason = %why, "task refused");
                Outcome::failed(why)
            })?;
        if security.own_user {
            // The owner of the job's checkpoint directory, made by an
            // earlier attempt, again if it is free: it owns what is there.
            let prefer = checkpoint_dir
                .as_deref()
                .and_then(|d| std::fs::metadata(d).ok())
                .map(|m| {
                    (
                        spec.job_id.as_str(),
                        std::os::unix::fs::MetadataExt::uid(&m),
                    )
                });
            let ids = self.own_user(task_id, prefer).await.map_err(|why| {
                tracing::warn!(task_id, reason = %why, "task refused");
                Outcome::failed(why)
            })?;
            security.user = Some(ids);
        }
        // A fraction of an `mps` GPU gets the MPS daemon of its GPU, tenant
        // and user, started if need be; without a control program here it
        // runs unenforced, and says so.
        let mps = match (&spec.share, spec.gpu_uuids.first()) {
            (Some(sh), Some(gpu))
                if sh.mode == ShareMode::Mps && self.isolation.mps.available() =>
            {
                let mps = self.isolation.mps.clone();
                let group = mps_group(sh, security.user);
                // Recorded first: an agent restarted under the task finds
                // its daemon by it.
                let recorded = checkpoint::write_atomic(
                    &self.state_dir(task_id).join(MPS_GROUP_FILE),
                    group.as_bytes(),
                )
                .map_err(|e| format!("record its MPS daemon: {e}"));
                let (task, gpu) = (task_id.to_string(), gpu.clone());
                let got = match recorded {
                    Err(e) => Err(e),
                    Ok(()) => tokio::task::spawn_blocking(move || mps.acquire(&task, &gpu, &group))
                        .await
                        .map_err(|e| e.to_string())
                        .and_then(|r| r.map_err(|e| e.to_string())),
                };
                match got {
                    Ok(server) => Some(server),
                    Err(e) => {
                        self.release(task_id);
                        tracing::warn!(task_id, error = %e, "no MPS daemon for the task");
                        return Err(Outcome::failed(format!("MPS: {e}")));
                    }
                }
            }
            _ => None,
        };
        let sandbox = self.sandbox(task_id);
        tokio::fs::create_dir_all(&sandbox)
            .await
            .and_then(|()| set_mode(&sandbox, 0o700))
            .map_err(|e| Outcome::failed(format!("create sandbox {}: {e}", sandbox.display())))?;
        let notice_dir = self
            .make_notice_dir(task_id, security.user)
            .map_err(|e| Outcome::failed(format!("create the stop notice directory: {e}")))?;
        if let Some(dir) = &checkpoint_dir {
            make_checkpoint_dir(dir, security.user).map_err(|e| {
                Outcome::failed(format!("checkpoint_dir: create {}: {e}", dir.display()))
            })?;
        }
        let grants = self
            .isolation
            .gpu_grants
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let devices = crate::isolation::grants::resolve(&grants, &spec.gpu_uuids).map_err(|u| {
            Outcome::failed(format!(
                "GPU {u} is neither a GPU nor a MIG device of this agent"
            ))
        })?;
        let prepared = self
            .isolation
            .isolator
            .prepare(task_id, &devices, &spec.resources, rt.kind())
            .map_err(|e| Outcome::failed(format!("isolation: {e}")))?;
        // A fraction's memory capped by the driver on the task's own cgroup
        // v2 (host processes; r615+), before anything runs in it. What this
        // agent enforces is said with STARTING, so only once that is known.
        let unified = prepared
            .cgroup
            .as_ref()
            .and_then(|c| c.unified_dir.as_deref());
        let driver = match (&spec.share, spec.gpu_uuids.first(), unified) {
            (Some(sh), Some(gpu), Some(dir)) => {
                let cap = &self.isolation.memcap;
                cap.cap_task(task_id, gpu, dir, sh.fraction.mem_mib).await
            }
            _ => false,
        };
        // A container's own cgroup exists only once runc creates it: there
        // the `gpuctl-runc` runtime's hook has it capped before the workload
        // runs (runtime::oci_hook). STARTING says what holds without it;
        // RUNNING says `driver` once the cap held.
        let container_cap = match (&spec.share, spec.gpu_uuids.first()) {
            (Some(sh), Some(gpu)) if !driver && rt.kind() == Runtime::Docker => {
                self.container_cap(task_id, rt.as_ref(), gpu, sh.fraction.mem_mib)
            }
            _ => None,
        };
        let mut starting = self.update(task_id, TaskState::Starting);
        starting.enforcement = spec.share.as_ref().map(|_| match (driver, mps.is_some()) {
            (true, _) => gpuctl_core::types::Enforcement::Driver,
            (false, true) => gpuctl_core::types::Enforcement::Mps,
            (false, false) => gpuctl_core::types::Enforcement::None,
        });
        self.send(starting).await;
        let mut env = Self::gpu_env(spec);
        // The notice before a stop, and the checkpoint directory at the
        // path the job named, for a container as for a host process.
        let notice_at = if rt.kind() == Runtime::Docker {
            security.mounts.push(crate::security::BindMount {
                host_path: notice_dir.clone(),
                container_path: notice::CONTAINER_DIR.to_string(),
                read_only: true,
            });
            PathBuf::from(notice::CONTAINER_DIR).join(notice::FILE)
        } else {
            security.keep_visible.push(notice_dir.clone());
            notice_dir.join(notice::FILE)
        };
        env.insert(notice::ENV.into(), notice_at.display().to_string());
        if let (Some(dir), Some(asked)) = (&checkpoint_dir, &spec.checkpoint_dir) {
            if rt.kind() == Runtime::Docker {
                security.mounts.push(crate::security::BindMount {
                    host_path: dir.clone(),
                    container_path: asked.clone(),
                    read_only: false,
                });
            } else {
                security.keep_visible.push(dir.clone());
            }
            env.insert(notice::CHECKPOINT_ENV.into(), asked.clone());
        }
        if let (Some(server), Some(sh)) = (&mps, &spec.share) {
            crate::gpu::mps::scrub_env(&mut env);
            // A container sees the pipe directory where the agent mounts
            // it (with the daemon's shm as its /dev/shm); a host process
            // where it is.
            let pipe = if rt.kind() == Runtime::Docker {
                security.mounts.push(crate::security::BindMount {
                    host_path: server.pipe_dir.clone(),
                    container_path: crate::gpu::mps::CONTAINER_PIPE_DIR.to_string(),
                    read_only: false,
                });
                security.mounts.push(crate::security::BindMount {
                    host_path: server.shm_dir.clone(),
                    container_path: "/dev/shm".to_string(),
                    read_only: false,
                });
                crate::gpu::mps::CONTAINER_PIPE_DIR.to_string()
            } else {
                server.pipe_dir.display().to_string()
            };
            env.extend(crate::gpu::mps::client_env(&pipe, &sh.fraction));
        }
        if let (Some((_, value)), Some(_)) = (&container_cap, &self.isolation.cap_socket) {
            env.insert(crate::runtime::oci_hook::CAP_ENV.to_string(), value.clone());
        }
        let launch = LaunchSpec {
            env,
            log_path: sandbox.join(LOG_FILE),
            sandbox,
            agent_id: self.agent_id.clone(),
            kill_grace: self.kill_grace,
            isolation: TaskIsolation {
                devices: prepared.devices,
                cgroup_parent: prepared.cgroup.as_ref().map(|c| c.docker_parent()),
                cgroup_procs: prepared
                    .cgroup
                    .as_ref()
                    .map(|c| c.procs_files.clone())
                    .unwrap_or_default(),
                driver_volume: self.isolation.driver_volume.clone(),
                gpu_task: !spec.gpu_uuids.is_empty(),
                host_nodes: prepared.host_nodes,
                cdi_devices: self.isolation.cdi.for_gpus(&spec.gpu_uuids),
                driver: self.isolation.driver.clone(),
                dev_root: Some(self.isolation.isolator.dev_root().to_path_buf()),
                pids_max: self.isolation.isolator.pids_max(),
                oci_runtime: container_cap.as_ref().map(|(name, _)| name.clone()),
            },
            state_dir: self.state_dir(task_id),
            fence: (!spec.no_fence).then(|| checkpoint::contact_path(&self.work_dir)),
            security,
            task: spec.clone(),
        };
        let started = self
            .start_with_backoff(task_id, rt.as_ref(), &launch, stop, fence_ms)
            .await;
        let capped = container_cap
            .and(self.isolation.cap_socket.as_ref())
            .map(|s| s.done(task_id));
        started?;
        if let Err(e) = checkpoint::write_atomic(&launch.state_dir.join(STARTED_FILE), b"") {
            tracing::warn!(task_id, error = %e, "could not record that the task started");
        }
        Ok(match capped {
            Some(Ok(())) => Some(gpuctl_core::types::Enforcement::Driver),
            Some(Err(why)) => {
                tracing::info!(task_id, reason = %why, "the container is not capped by the driver");
                None
            }
            None => None,
        })
    }

    /// Task `task_id`'s container capped by the driver through the
    /// `gpuctl-runc` hook, when this agent and its Docker daemon can: the
    /// runtime's name and the container's `GPUCTL_DRIVER_CAP`. The cap is
    /// expected from here until the start is over.
    fn container_cap(
        &self,
        task_id: &str,
        rt: &dyn crate::runtime::ContainerRuntime,
        gpu_uuid: &str,
        mem_mib: u64,
    ) -> Option<(String, String)> {
        let socket = self.isolation.cap_socket.as_ref()?;
        let name = self.isolation.cap_runtime.as_deref()?;
        if let Err(why) = rt.cap_runtime(name) {
            tracing::info!(task_id, reason = %why, "no driver memory cap for the container");
            return None;
        }
        socket.expect(task_id, gpu_uuid, mem_mib);
        Some((name.to_string(), socket.env_value(task_id)))
    }

    /// Starts the task, waiting out runtime outages until it is no longer
    /// wanted.
    async fn start_with_backoff(
        &self,
        task_id: &str,
        rt: &dyn crate::runtime::ContainerRuntime,
        launch: &LaunchSpec,
        stop: &mut watch::Receiver<Option<StopReason>>,
        fence_ms: u64,
    ) -> Result<(), Outcome> {
        let mut backoff = Backoff::new(OUTAGE_BACKOFF_MIN, OUTAGE_BACKOFF_MAX);
        loop {
            match rt.start(launch).await {
                Ok(()) => break,
                // The runtime is down: not the task's fault; try again
                // until it answers or the task is no longer wanted.
                Err(e) if e.is_unavailable() => {
                    tracing::warn!(task_id, error = %e, "runtime unavailable; the launch waits");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff.next_wait()) => {}
                        _ = stop.changed() => {}
                    }
                    if let Some(r) = stop.borrow().clone() {
                        self.release(task_id);
                        return Err(Outcome::refused(&r, fence_ms));
                    }
                }
                Err(e) => {
                    self.release(task_id);
                    let requires = match &e {
                        RuntimeError::DriverRequirement { requires, .. } => requires.clone(),
                        _ => Vec::new(),
                    };
                    tracing::warn!(task_id, error = %e, "task could not start");
                    return Err(Outcome {
                        requires,
                        ..Outcome::failed(e.to_string())
                    });
                }
            }
        }
        Ok(())
    }

    /// The task's own user: the one its checkpoint records (an agent
    /// restarted before the task started), else a new lease, recorded
    /// before the task can start.
    async fn own_user(
        &self,
        task_id: &str,
        prefer: Option<(&str, u32)>,
    ) -> Result<UserIds, String> {
        let path = self.state_dir(task_id).join(task_users::USER_FILE);
        match checkpoint::read_json::<UserIds>(&path) {
            Ok(Some(ids)) => {
                self.isolation.users.restore(task_id, ids);
                return Ok(ids);
            }
            Ok(None) => {}
            Err(e) => return Err(format!("task user record: {e}")),
        }
        let host = tokio::task::spawn_blocking(task_users::HostIds::of_host)
            .await
            .map_err(|e| format!("reading the host's users: {e}"))?;
        let ids = self
            .isolation
            .users
            .lease_preferring(task_id, prefer, &host)?;
        if let Err(e) = checkpoint::write_json(&path, &ids) {
            self.isolation.users.release(task_id);
            return Err(format!("task user record: {e}"));
        }
        tracing::info!(task_id, user = %ids, "task user leased");
        Ok(ids)
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

/// Makes a job's checkpoint directory if it is missing, its last part
/// owned by the task's user (root's when that is not known: a container
/// without a user of its job's), readable by nobody else. One that exists is
/// left as it is: the agent never takes over a directory it did not make.
fn make_checkpoint_dir(dir: &std::path::Path, user: Option<UserIds>) -> std::io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::create_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(()),
        r => r?,
    }
    if let Some(u) = user {
        std::os::unix::fs::chown(dir, Some(u.uid), Some(u.gid))?;
    }
    set_mode(dir, 0o700)
}

fn set_mode(path: &std::path::Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// Asks the runtime to stop the task until it has taken the request (the
/// Docker daemon may be restarting).
async fn stop_until_done(rt: Arc<dyn ContainerRuntime>, tref: TaskRef, grace: Duration) {
    let mut backoff = Backoff::new(OUTAGE_BACKOFF_MIN, OUTAGE_BACKOFF_MAX);
    loop {
        match rt.stop(&tref, grace).await {
            Ok(()) => return,
            Err(e) if e.is_unavailable() => {
                tokio::time::sleep(backoff.next_wait()).await;
            }
            Err(e) => {
                tracing::warn!(task_id = %tref.task_id, error = %e, "could not stop the task");
                return;
            }
        }
    }
}

/// Removes an ended task's container, waiting out a short outage or a
/// daemon still busy with it ("removal already in progress"); one left
/// behind is removed by the stray scan once the task is forgotten.
async fn remove_until_done(rt: &Arc<dyn ContainerRuntime>, tref: &TaskRef) {
    let mut backoff = Backoff::new(OUTAGE_BACKOFF_MIN, OUTAGE_BACKOFF_MAX);
    for attempt in 0..10 {
        match rt.remove(tref).await {
            Ok(()) => return,
            Err(e) => {
                if attempt == 9 {
                    tracing::warn!(task_id = %tref.task_id, error = %e, "could not remove the ended task");
                    return;
                }
                tracing::debug!(task_id = %tref.task_id, error = %e, "removing the ended task; retrying");
                tokio::time::sleep(backoff.next_wait()).await;
            }
        }
    }
}

/// Which MPS daemon of its GPU the task's record names (`mps_group`).
const MPS_GROUP_FILE: &str = "mps-group";

/// The MPS daemon of a GPU a shared task uses: its tenant's (tenants never
/// share one), and of its Linux user: an MPS daemon serves one user at a
/// time and makes another user's clients wait until the first's are gone,
/// so tasks running as different users get daemons of their own (which
/// the GPU time-slices). `None`: the image's user, not known here.
fn mps_group(share: &TaskShare, user: Option<UserIds>) -> String {
    let tenant = if share.tenant.is_empty() {
        "default"
    } else {
        share.tenant.as_str()
    };
    match user {
        Some(u) => format!("{tenant}.u{}", u.uid),
        None => format!("{tenant}.image"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mps_daemons_are_per_tenant_and_user() {
        let share = |tenant: &str| TaskShare {
            fraction: gpuctl_core::types::GpuFraction {
                mem_mib: 1024,
                compute_pct: 0,
            },
            mode: ShareMode::Mps,
            tenant: tenant.into(),
        };
        let u = |uid| Some(UserIds { uid, gid: uid });
        assert_eq!(mps_group(&share("team-a"), u(65534)), "team-a.u65534");
        // An MPS daemon serves one user at a time: two users, two daemons.
        assert_ne!(
            mps_group(&share("team-a"), u(1000)),
            mps_group(&share("team-a"), u(1001))
        );
        assert_ne!(
            mps_group(&share("team-a"), u(1000)),
            mps_group(&share("team-b"), u(1000))
        );
        assert_eq!(mps_group(&share(""), None), "default.image");
    }

    #[test]
    fn a_fraction_seen_near_its_memory_is_told_why_it_may_have_failed() {
        assert_eq!(near_fraction(9000, 10240), None);
        let hint = near_fraction(9800, 10240).unwrap();
        assert!(
            hint.contains("9800 MiB of its 10240 MiB fraction") && hint.contains("out-of-memory"),
            "{hint}"
        );
        assert!(near_fraction(10240, 10240).is_some());
        assert_eq!(near_fraction(0, 0), None);
    }

    #[test]
    fn outcomes_of_a_task_that_ran() {
        let code = |c| Ended {
            code: Some(c),
            ..Default::default()
        };
        let o = Outcome::ran(code(0), None, 0);
        assert_eq!((o.state, o.exit_code), (TaskState::Finished, Some(0)));
        let o = Outcome::ran(code(3), None, 0);
        assert_eq!((o.state, o.exit_code), (TaskState::Failed, Some(3)));
        assert_eq!(o.message, "exited with code 3");
        let o = Outcome::ran(code(143), Some(&StopReason::Killed), 0);
        assert_eq!(o.state, TaskState::Killed);
        let gpu = StopReason::GpuFailed("GPU g unhealthy: lost".into());
        let o = Outcome::ran(code(143), Some(&gpu), 0);
        assert_eq!((o.state, o.gpu_unhealthy), (TaskState::Failed, true));
        assert_eq!(o.message, "GPU g unhealthy: lost");
        // Finished cleanly before the GPU's failure stopped it.
        let o = Outcome::ran(code(0), Some(&gpu), 0);
        assert_eq!(o.state, TaskState::Finished);
        // Fenced by its supervisor while the agent was away.
        let fenced = Ended {
            code: Some(143),
            fenced: true,
            error: None,
        };
        let o = Outcome::ran(fenced, None, 75_000);
        assert_eq!((o.state, o.fenced), (TaskState::Killed, true));
        assert!(o.message.contains("75 s"), "{}", o.message);
        let o = Outcome::ran(
            Ended {
                error: Some("container gpuctl-a-t vanished".into()),
                ..Default::default()
            },
            None,
            0,
        );
        assert_eq!((o.state, o.exit_code), (TaskState::Failed, None));
    }

    #[test]
    fn outcomes_of_a_task_that_never_ran() {
        let o = Outcome::refused(&StopReason::Killed, 0);
        assert_eq!(
            (o.state, o.message.as_str()),
            (TaskState::Killed, "killed before it started")
        );
        let o = Outcome::refused(&StopReason::GpuFailed("GPU g unhealthy: x".into()), 0);
        assert_eq!((o.state, o.gpu_unhealthy), (TaskState::Failed, true));
    }
}

/// The executor's shell with an in-memory runtime: launch, report, forget,
/// recovery after a restart, the fence and a runtime that is down, without
/// processes or Docker (those are in `agent/tests` and `tests/`).
#[cfg(test)]
mod shell_tests {
    use super::*;
    use crate::runtime::RuntimeStatus;
    use futures::future::BoxFuture;
    use futures::FutureExt;
    use gpuctl_core::types::{IdRanges, Resources};

    /// Tasks by id; `Ended` ones end their `wait`.
    #[derive(Default)]
    struct Fake {
        tasks: Mutex<BTreeMap<String, Observed>>,
        /// Starts that fail as Unavailable before one succeeds.
        down_for: Mutex<u32>,
        changed: tokio::sync::Notify,
        /// What each task was started with.
        launched: Mutex<BTreeMap<String, LaunchSpec>>,
    }

    impl Fake {
        fn set(&self, id: &str, o: Observed) {
            self.tasks.lock().unwrap().insert(id.into(), o);
            self.changed.notify_waiters();
        }
        fn get(&self, id: &str) -> Observed {
            self.tasks
                .lock()
                .unwrap()
                .get(id)
                .cloned()
                .unwrap_or(Observed::NotStarted)
        }
    }

    /// The fake, standing in for the runtime of this kind.
    struct FakeRuntime(Arc<Fake>, Runtime);

    impl ContainerRuntime for FakeRuntime {
        fn kind(&self) -> Runtime {
            self.1
        }
        fn start<'a>(
            &'a self,
            spec: &'a LaunchSpec,
        ) -> BoxFuture<'a, Result<(), crate::runtime::RuntimeError>> {
            let mut down = self.0.down_for.lock().unwrap();
            if *down > 0 {
                *down -= 1;
                return futures::future::ready(Err(crate::runtime::RuntimeError::Unavailable {
                    runtime: Runtime::Process,
                    reason: "down".into(),
                }))
                .boxed();
            }
            drop(down);
            self.0
                .launched
                .lock()
                .unwrap()
                .insert(spec.task.task_id.clone(), spec.clone());
            if self.0.get(&spec.task.task_id) == Observed::NotStarted {
                self.0.set(&spec.task.task_id, Observed::Running);
            }
            futures::future::ready(Ok(())).boxed()
        }
        fn observe<'a>(
            &'a self,
            t: &'a TaskRef,
        ) -> BoxFuture<'a, Result<Observed, crate::runtime::RuntimeError>> {
            futures::future::ready(Ok(self.0.get(&t.task_id))).boxed()
        }
        fn wait<'a>(
            &'a self,
            t: &'a TaskRef,
        ) -> BoxFuture<'a, Result<Ended, crate::runtime::RuntimeError>> {
            async move {
                loop {
                    let notified = self.0.changed.notified();
                    if let Observed::Ended(e) = self.0.get(&t.task_id) {
                        return Ok(e);
                    }
                    notified.await;
                }
            }
            .boxed()
        }
        fn stop<'a>(
            &'a self,
            t: &'a TaskRef,
            _g: Duration,
        ) -> BoxFuture<'a, Result<(), crate::runtime::RuntimeError>> {
            self.0.set(
                &t.task_id,
                Observed::Ended(Ended {
                    code: Some(143),
                    ..Default::default()
                }),
            );
            futures::future::ready(Ok(())).boxed()
        }
        fn remove<'a>(
            &'a self,
            _t: &'a TaskRef,
        ) -> BoxFuture<'a, Result<(), crate::runtime::RuntimeError>> {
            futures::future::ready(Ok(())).boxed()
        }
        fn list<'a>(
            &'a self,
            _a: &'a str,
        ) -> BoxFuture<'a, Result<Vec<String>, crate::runtime::RuntimeError>> {
            futures::future::ready(Ok(Vec::new())).boxed()
        }
        fn status(&self) -> RuntimeStatus {
            RuntimeStatus {
                available: true,
                message: String::new(),
            }
        }
    }

    struct Harness {
        dir: tempfile::TempDir,
        fake: Arc<Fake>,
        exec: Arc<Executor>,
        updates: mpsc::Receiver<StatusUpdate>,
    }

    /// An executor on `dir` (a new agent process on the same work dir).
    fn harness_on(dir: tempfile::TempDir, fake: Arc<Fake>) -> Harness {
        let isolator = no_isolation(dir.path());
        harness_with(dir, fake, isolator, HashMap::new())
    }

    /// No cgroup hierarchy and no NVIDIA devices under `dir`: nothing to
    /// isolate (a host with simulated GPUs).
    fn no_isolation(dir: &std::path::Path) -> Isolator {
        Isolator::new(&dir.join("no-cgroups"), "gpuctl/a1", &dir.join("dev")).unwrap()
    }

    /// An executor with this isolator and these GPUs and MIG devices.
    fn harness_with(
        dir: tempfile::TempDir,
        fake: Arc<Fake>,
        isolator: Isolator,
        gpu_grants: HashMap<String, crate::isolation::DeviceGrant>,
    ) -> Harness {
        let mut runtimes: BTreeMap<Runtime, Arc<dyn ContainerRuntime>> = BTreeMap::new();
        for kind in [Runtime::Process, Runtime::Docker] {
            runtimes.insert(kind, Arc::new(FakeRuntime(fake.clone(), kind)));
        }
        // Two users of their own for host tasks.
        let users = IdRanges::parse("80000-80001").unwrap();
        let (tx, updates) = mpsc::channel(64);
        let exec = Executor::new(
            "a1".into(),
            dir.path().to_path_buf(),
            runtimes,
            Duration::from_secs(1),
            Duration::from_secs(3600),
            IsolationSetup {
                isolator,
                gpu_grants: Arc::new(std::sync::RwLock::new(gpu_grants)),
                driver_volume: None,
                policy: crate::security::TaskPolicy::new(
                    crate::security::DEFAULT_TASK_USER,
                    false,
                    Vec::new(),
                    gpuctl_core::types::UserIds { uid: 0, gid: 0 },
                )
                .with_users(users.clone(), IdRanges::parse("1000-59999").unwrap()),
                cdi: Default::default(),
                driver: Default::default(),
                users: crate::task_users::TaskUsers::new(users, dir.path()),
                mps: Arc::new(crate::gpu::mps::Mps::new(None, dir.path().join("mps"))),
                memcap: Arc::new(crate::gpu::memcap::DriverCap::off(
                    dir.path().join("memcap"),
                )),
                cap_socket: None,
                cap_runtime: None,
            },
            tx,
        );
        Harness {
            dir,
            fake,
            exec,
            updates,
        }
    }

    fn spec(id: &str) -> TaskSpec {
        TaskSpec {
            share: None,
            stop_grace_ms: None,
            checkpoint_dir: None,
            task_id: id.into(),
            job_id: "job-1".into(),
            framework_id: String::new(),
            image: None,
            command: vec!["true".into()],
            env: BTreeMap::new(),
            resources: Resources::default(),
            gpu_uuids: vec![],
            no_fence: false,
            security: Default::default(),
        }
    }

    fn wants(ids: &[&str], kill: &[&str]) -> Desired {
        Desired {
            run: ids.iter().map(|i| (i.to_string(), spec(i))).collect(),
            kill: kill.iter().map(|k| k.to_string()).collect(),
            notices: Default::default(),
        }
    }

    /// The next update, or a failure after 5 s.
    async fn next(h: &mut Harness) -> StatusUpdate {
        tokio::time::timeout(Duration::from_secs(5), h.updates.recv())
            .await
            .expect("no update within 5 s")
            .expect("channel closed")
    }

    async fn until_state(h: &mut Harness, state: TaskState) -> StatusUpdate {
        loop {
            let u = next(h).await;
            if u.state == state {
                return u;
            }
        }
    }

    #[tokio::test]
    async fn a_task_runs_ends_is_acknowledged_and_forgotten() {
        let mut h = harness_on(tempfile::tempdir().unwrap(), Arc::default());
        h.exec.set_desired(wants(&["t1"], &[]));
        assert_eq!(next(&mut h).await.state, TaskState::Starting);
        assert_eq!(next(&mut h).await.state, TaskState::Running);
        h.fake.set(
            "t1",
            Observed::Ended(Ended {
                code: Some(3),
                ..Default::default()
            }),
        );
        let fin = next(&mut h).await;
        assert_eq!((fin.state, fin.exit_code), (TaskState::Failed, Some(3)));
        let state_dir = h.dir.path().join("state/t1");
        let saved: StatusUpdate = checkpoint::read_json(&state_dir.join(checkpoint::FINAL_FILE))
            .unwrap()
            .unwrap();
        assert_eq!(saved, fin, "the final status is checkpointed as sent");
        // Still listed by the master: kept, never launched again.
        h.exec.acknowledged(&fin);
        assert!(state_dir.join(checkpoint::ACKED_FILE).exists());
        h.exec.set_desired(wants(&["t1"], &[]));
        assert!(h.exec.has_ended("t1"));
        // No longer listed: forgotten, checkpoint gone.
        h.exec.set_desired(wants(&[], &[]));
        assert!(h.exec.known_task_ids().is_empty());
        assert!(!state_dir.exists());
    }

    /// Host tasks get users of their own, recorded before they start, held
    /// across an agent restart and until the task is forgotten, never two
    /// at once; with every id held, a task fails saying so.
    #[tokio::test]
    async fn host_tasks_hold_users_of_their_own_until_forgotten() {
        let fake: Arc<Fake> = Arc::default();
        let mut h = harness_on(tempfile::tempdir().unwrap(), fake.clone());
        let user_of = |h: &Harness, id: &str| {
            checkpoint::read_json::<UserIds>(&h.dir.path().join("state").join(id).join("user.json"))
                .unwrap()
        };
        h.exec.set_desired(wants(&["a", "b"], &[]));
        until_state(&mut h, TaskState::Running).await;
        until_state(&mut h, TaskState::Running).await;
        let (a, b) = (user_of(&h, "a").unwrap(), user_of(&h, "b").unwrap());
        assert_ne!(a.uid, b.uid);
        for u in [a, b] {
            assert!((80000..=80001).contains(&u.uid) && u.gid == u.uid, "{u}");
        }
        // The agent restarts with both running: both keep theirs, and a
        // third task finds none free.
        let Harness { dir, .. } = h;
        let mut h = harness_on(dir, fake.clone());
        h.exec.recover();
        assert_eq!(h.exec.isolation.users.of("a"), Some(a));
        assert_eq!(h.exec.isolation.users.of("b"), Some(b));
        h.exec.set_desired(wants(&["a", "b", "c"], &[]));
        let refused = until_state(&mut h, TaskState::Failed).await;
        assert_eq!(refused.task_id, "c");
        assert!(
            refused.message.contains("no free user"),
            "{}",
            refused.message
        );
        assert_eq!(fake.get("c"), Observed::NotStarted);
        // "a" ends and is forgotten: its user is free again (and its
        // sandbox the agent's).
        fake.set(
            "a",
            Observed::Ended(Ended {
                code: Some(0),
                ..Default::default()
            }),
        );
        let fin = until_state(&mut h, TaskState::Finished).await;
        h.exec.acknowledged(&fin);
        h.exec.set_desired(wants(&["b"], &[]));
        assert_eq!(h.exec.isolation.users.of("a"), None);
        assert_eq!(h.exec.isolation.users.held(), 1);
        h.exec.set_desired(wants(&["b", "d"], &[]));
        until_state(&mut h, TaskState::Running).await;
        assert_eq!(user_of(&h, "d"), Some(a), "the freed id");
    }

    /// A task asking for more than the agent allows ends FAILED with a
    /// message naming the option, and the runtime never sees it.
    #[tokio::test]
    async fn a_task_asking_for_more_than_the_agent_allows_is_refused() {
        let mut h = harness_on(tempfile::tempdir().unwrap(), Arc::default());
        let mut root = spec("root");
        root.security.run_as_root = true;
        h.exec.set_desired(Desired {
            run: [("root".to_string(), root)].into(),
            kill: Default::default(),
            notices: Default::default(),
        });
        let u = next(&mut h).await;
        assert_eq!(u.state, TaskState::Failed, "{u:?}");
        assert!(u.message.contains("allow_root_tasks"), "{}", u.message);
        assert_eq!(h.fake.get("root"), Observed::NotStarted);
        assert!(!h.exec.sandbox("root").exists(), "nothing made for it");

        let mut mount = spec("mount");
        mount.image = Some("img".into());
        mount.security.mounts = vec![gpuctl_core::types::HostMount {
            host_path: "/".into(),
            container_path: "/host".into(),
            read_only: true,
        }];
        h.exec.set_desired(Desired {
            run: [("mount".to_string(), mount)].into(),
            kill: Default::default(),
            notices: Default::default(),
        });
        let u = next(&mut h).await;
        assert_eq!(u.state, TaskState::Failed, "{u:?}");
        assert!(u.message.contains("allowed_mounts"), "{}", u.message);
        assert!(
            u.message.contains("security.mounts[0].host_path"),
            "{}",
            u.message
        );
    }

    #[tokio::test]
    async fn an_ended_tasks_sandbox_goes_a_retention_after_it_is_forgotten() {
        let mut h = harness_on(tempfile::tempdir().unwrap(), Arc::default());
        h.exec.set_desired(wants(&["t1", "t2"], &[]));
        until_state(&mut h, TaskState::Running).await;
        until_state(&mut h, TaskState::Running).await;
        let work = h.dir.path().to_path_buf();
        let sandbox = |id: &str| work.join(checkpoint::SANDBOX_DIR).join(id);
        std::fs::write(sandbox("t1").join(LOG_FILE), "done\n").unwrap();
        h.fake.set(
            "t1",
            Observed::Ended(Ended {
                code: Some(0),
                ..Default::default()
            }),
        );
        let fin = until_state(&mut h, TaskState::Finished).await;
        // Ended but not yet acknowledged, then acknowledged but still
        // listed: kept whatever the time.
        let far = checkpoint::wall_ms() + 10 * 3_600_000;
        assert_eq!(h.exec.sweep_sandboxes(far), 0);
        h.exec.acknowledged(&fin);
        assert_eq!(h.exec.sweep_sandboxes(far), 0);
        assert!(sandbox("t1").join(LOG_FILE).exists());
        // No longer listed: forgotten, and its retention (an hour) starts.
        h.exec.set_desired(wants(&["t2"], &[]));
        let forgotten = checkpoint::wall_ms();
        let retired = work.join(checkpoint::RETIRED_DIR);
        assert!(retired.join("t1").exists());
        // The running task's sandbox stays even with a stale record.
        std::fs::write(retired.join("t2"), r#"{"forgotten_at_ms":0}"#).unwrap();
        assert_eq!(h.exec.sweep_sandboxes(forgotten + 3_599_000), 0);
        assert!(sandbox("t1").join(LOG_FILE).exists());
        assert_eq!(h.exec.sweep_sandboxes(forgotten + 3_601_000), 1);
        assert!(!sandbox("t1").exists() && !retired.join("t1").exists());
        assert!(sandbox("t2").exists() && h.exec.is_active("t2"));
    }

    #[tokio::test]
    async fn a_restarted_agent_reattaches_and_resends_what_was_not_acknowledged() {
        let fake: Arc<Fake> = Arc::default();
        let mut h = harness_on(tempfile::tempdir().unwrap(), fake.clone());
        h.exec.set_desired(wants(&["run", "done"], &[]));
        until_state(&mut h, TaskState::Running).await;
        until_state(&mut h, TaskState::Running).await;
        fake.set(
            "done",
            Observed::Ended(Ended {
                code: Some(0),
                ..Default::default()
            }),
        );
        let fin = until_state(&mut h, TaskState::Finished).await;
        // The agent dies: no acknowledgement reached it.
        let Harness { dir, .. } = h;
        let mut h = harness_on(dir, fake.clone());
        h.exec.recover();
        let mut ids = h.exec.known_task_ids();
        ids.sort();
        assert_eq!(ids, vec!["done".to_string(), "run".to_string()]);
        // The unacknowledged final goes out again, same uuid; the running
        // task is followed again (RUNNING, no STARTING: never started twice).
        let mut seen = Vec::new();
        for _ in 0..2 {
            seen.push(next(&mut h).await);
        }
        assert!(
            seen.iter()
                .any(|u| u.task_id == "done" && u.uuid == fin.uuid),
            "{seen:?}"
        );
        assert!(
            seen.iter()
                .any(|u| u.task_id == "run" && u.state == TaskState::Running),
            "{seen:?}"
        );
        assert!(h.exec.is_active("run"));
        // The master kills it: stopped, reported KILLED.
        h.exec.set_desired(wants(&[], &["run"]));
        let killed = until_state(&mut h, TaskState::Killed).await;
        assert_eq!(killed.task_id, "run");
    }

    #[tokio::test]
    async fn past_the_fence_tasks_stop_and_nothing_starts() {
        let mut h = harness_on(tempfile::tempdir().unwrap(), Arc::default());
        h.exec.record_contact(Contact {
            last_contact_ms: checkpoint::wall_ms(),
            fence_timeout_ms: 60_000,
        });
        h.exec.set_desired(wants(&["t1"], &[]));
        until_state(&mut h, TaskState::Running).await;
        // The last contact is long past.
        h.exec.record_contact(Contact {
            last_contact_ms: checkpoint::wall_ms() - 120_000,
            fence_timeout_ms: 60_000,
        });
        h.exec.reconcile();
        let u = until_state(&mut h, TaskState::Killed).await;
        assert!(u.fenced && u.message.contains("fenced"), "{u:?}");
        h.exec.set_desired(wants(&["t1", "t2"], &[]));
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!h.exec.is_active("t2"), "launched past the fence");
    }

    #[tokio::test]
    async fn a_runtime_that_is_down_delays_the_launch_without_failing_it() {
        let fake: Arc<Fake> = Arc::default();
        *fake.down_for.lock().unwrap() = 2;
        let mut h = harness_on(tempfile::tempdir().unwrap(), fake);
        h.exec.set_desired(wants(&["t1"], &[]));
        assert_eq!(next(&mut h).await.state, TaskState::Starting);
        let u = next(&mut h).await;
        assert_eq!(u.state, TaskState::Running, "{u:?}");
    }

    /// GPU-0 (minor 0) in MIG mode: MIG-a (caps 30, 31), MIG-b (caps 39,
    /// 40) and MIG-c, whose caps the host did not list.
    fn mig_grants() -> HashMap<String, crate::isolation::DeviceGrant> {
        use gpuctl_core::types::{GpuInfo, MigDevice, MigInfo};
        let mig = |uuid: &str, gi: u32, caps: &[u32]| MigDevice {
            uuid: uuid.into(),
            profile: "1g.10gb".into(),
            memory_mib: 9856,
            gpu_slices: 1,
            compute_slices: 1,
            gi_id: gi,
            ci_id: 0,
            caps_minors: caps.to_vec(),
        };
        let mut g = GpuInfo::new("GPU-0", 0, "A100", 40960);
        g.mig = MigInfo {
            enabled: true,
            devices: vec![
                mig("MIG-a", 1, &[30, 31]),
                mig("MIG-b", 2, &[39, 40]),
                mig("MIG-c", 3, &[]),
            ],
            ..MigInfo::default()
        };
        crate::isolation::grants::device_grants(&[g])
    }

    fn run(h: &Harness, specs: Vec<TaskSpec>) {
        h.exec.set_desired(Desired {
            run: specs.into_iter().map(|s| (s.task_id.clone(), s)).collect(),
            kill: Default::default(),
            notices: Default::default(),
        });
    }

    fn with_gpus(id: &str, uuids: &[&str]) -> TaskSpec {
        TaskSpec {
            image: Some("img".into()),
            gpu_uuids: uuids.iter().map(|u| u.to_string()).collect(),
            ..spec(id)
        }
    }

    /// A MIG UUID is a GPU of the task like any: its environment names it
    /// as it is, and an unknown UUID is refused before anything starts.
    #[tokio::test]
    async fn a_mig_uuid_resolves_and_its_environment_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let isolator = no_isolation(dir.path());
        let mut h = harness_with(dir, Arc::default(), isolator, mig_grants());
        // No NVIDIA node here (simulated): MIG-c's unknown caps do not matter.
        run(&h, vec![with_gpus("t1", &["MIG-a", "MIG-c"])]);
        let u = until_state(&mut h, TaskState::Running).await;
        assert_eq!(u.task_id, "t1");
        let launched = h.fake.launched.lock().unwrap()["t1"].clone();
        for var in [
            "NVIDIA_VISIBLE_DEVICES",
            "CUDA_VISIBLE_DEVICES",
            "GPUCTL_GPUS",
        ] {
            assert_eq!(launched.env[var], "MIG-a,MIG-c", "{var}");
        }
        assert!(launched.isolation.gpu_task);
        assert!(launched.isolation.devices.is_empty(), "no node to give");

        run(&h, vec![with_gpus("t2", &["MIG-zz"])]);
        let u = until_state(&mut h, TaskState::Failed).await;
        assert_eq!(u.task_id, "t2");
        assert!(
            u.message
                .contains("MIG-zz is neither a GPU nor a MIG device of this agent"),
            "{}",
            u.message
        );
        assert_eq!(h.fake.get("t2"), Observed::NotStarted);
    }

    /// The parent GPU of a task's MIG device fails: the task is stopped and
    /// ends FAILED with GPU_UNHEALTHY naming the parent, and a new task on
    /// another MIG device of that parent is refused.
    #[tokio::test]
    async fn a_failed_parent_gpu_stops_its_mig_tasks() {
        let dir = tempfile::tempdir().unwrap();
        let isolator = no_isolation(dir.path());
        let mut h = harness_with(dir, Arc::default(), isolator, mig_grants());
        run(&h, vec![with_gpus("t1", &["MIG-a"])]);
        until_state(&mut h, TaskState::Running).await;
        h.exec
            .set_gpu_faults([("GPU-0".to_string(), "GPU is lost".to_string())].into());
        let u = until_state(&mut h, TaskState::Failed).await;
        assert_eq!(u.task_id, "t1");
        assert!(u.gpu_unhealthy, "{u:?}");
        assert_eq!(u.message, "GPU GPU-0 unhealthy: GPU is lost");
        run(
            &h,
            vec![with_gpus("t1", &["MIG-a"]), with_gpus("t2", &["MIG-b"])],
        );
        let u = until_state(&mut h, TaskState::Failed).await;
        assert_eq!((u.task_id.as_str(), u.gpu_unhealthy), ("t2", true));
        assert_eq!(h.fake.get("t2"), Observed::NotStarted);
    }

    /// On a host with NVIDIA nodes (fake ones, mknod), a MIG task's
    /// container gets its parent's node and its caps; one whose caps node
    /// is missing, or whose caps are not known, is refused naming it.
    #[tokio::test]
    async fn a_mig_task_gets_its_parent_and_caps_or_is_refused() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: mknod needs root");
            return;
        }
        use nix::sys::stat::{makedev, mknod, Mode, SFlag};
        let dir = tempfile::tempdir().unwrap();
        // A v2-looking root: containers get Docker's own device program,
        // so no cgroup is made and the devices are what is checked.
        let cg = dir.path().join("cg2");
        let dev = dir.path().join("dev");
        std::fs::create_dir_all(&cg).unwrap();
        std::fs::write(cg.join("cgroup.controllers"), "").unwrap();
        std::fs::create_dir_all(dev.join("nvidia-caps")).unwrap();
        for (name, major, minor) in [
            ("nvidia0", 195, 0),
            ("nvidiactl", 195, 255),
            ("nvidia-caps/nvidia-cap30", 240, 30),
            ("nvidia-caps/nvidia-cap31", 240, 31),
            ("nvidia-caps/nvidia-cap39", 240, 39),
        ] {
            mknod(
                &dev.join(name),
                SFlag::S_IFCHR,
                Mode::from_bits_truncate(0o600),
                makedev(major, minor),
            )
            .unwrap();
        }
        let isolator = Isolator::new(&cg, "gpuctl/a1", &dev).unwrap();
        let mut h = harness_with(dir, Arc::default(), isolator, mig_grants());
        run(&h, vec![with_gpus("a", &["MIG-a"])]);
        until_state(&mut h, TaskState::Running).await;
        let launched = h.fake.launched.lock().unwrap()["a"].clone();
        let given: Vec<&str> = launched
            .isolation
            .devices
            .iter()
            .map(|d| d.container_path.as_str())
            .collect();
        assert_eq!(
            given,
            [
                "/dev/nvidia0",
                "/dev/nvidia-caps/nvidia-cap30",
                "/dev/nvidia-caps/nvidia-cap31",
                "/dev/nvidiactl"
            ]
        );
        // The check after start tries every node, caps included.
        assert_eq!(launched.isolation.host_nodes.len(), 5);

        for (id, uuid, says) in [("b", "MIG-b", "nvidia-cap40"), ("c", "MIG-c", "MIG-c")] {
            run(&h, vec![with_gpus("a", &["MIG-a"]), with_gpus(id, &[uuid])]);
            let u = until_state(&mut h, TaskState::Failed).await;
            assert_eq!(u.task_id, id);
            assert!(u.message.contains(says), "{}", u.message);
            assert_eq!(h.fake.get(id), Observed::NotStarted);
        }
    }
}
