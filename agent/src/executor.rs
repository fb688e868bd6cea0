//! The executor: a reconcile loop between the tasks the master wants on this
//! agent and the tasks running here. Level triggered and idempotent: given
//! the full desired set it launches what is missing and kills what is not
//! listed, so a lost or repeated message never leaves a stray task.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuctl_proto::types::{Runtime, StatusUpdate, TaskSpec, TaskState};
use tokio::sync::{mpsc, oneshot, watch};

use crate::isolation::Isolator;
use crate::runtime::{ContainerRuntime, LaunchSpec, TaskExit, TaskIsolation};

/// File name of a task's combined output inside its sandbox.
pub const LOG_FILE: &str = "output.log";

struct LocalTask {
    kill: watch::Sender<bool>,
    job_id: String,
    gpus: Vec<String>,
    /// Set when one of its GPUs failed a health check: why it is stopped.
    gpu_failure: Option<String>,
}

#[derive(Default)]
struct Tasks {
    /// Launched and not yet ended.
    active: HashMap<String, LocalTask>,
    /// Ended here; kept until the master stops listing them, so that a
    /// desired set computed before our final update was applied does not
    /// launch them again.
    ended: HashSet<String>,
    /// This agent's unhealthy GPUs and why, by UUID (the health checks'
    /// latest view).
    gpu_faults: BTreeMap<String, String>,
}

fn gpu_failure(uuid: &str, reason: &str) -> String {
    format!("GPU {uuid} unhealthy: {reason}")
}

/// What the executor needs to isolate tasks.
pub struct IsolationSetup {
    pub isolator: Isolator,
    /// Minor number (hence /dev/nvidiaN) of each GPU of this agent, by UUID.
    pub gpu_minors: HashMap<String, u32>,
    /// The consolidated driver volume, when one could be built.
    pub driver_volume: Option<PathBuf>,
}

pub struct Executor {
    agent_id: String,
    work_dir: PathBuf,
    runtimes: BTreeMap<Runtime, Arc<dyn ContainerRuntime>>,
    kill_grace: Duration,
    isolation: IsolationSetup,
    tasks: Mutex<Tasks>,
    updates: mpsc::Sender<StatusUpdate>,
    /// Ticks whenever a task ends, for log followers.
    ended_tx: watch::Sender<u64>,
}

impl Executor {
    pub fn new(
        agent_id: String,
        work_dir: PathBuf,
        runtimes: BTreeMap<Runtime, Arc<dyn ContainerRuntime>>,
        kill_grace: Duration,
        isolation: IsolationSetup,
        updates: mpsc::Sender<StatusUpdate>,
    ) -> Arc<Executor> {
        Arc::new(Executor {
            agent_id,
            work_dir,
            runtimes,
            kill_grace,
            isolation,
            tasks: Mutex::new(Tasks::default()),
            updates,
            ended_tx: watch::channel(0).0,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tasks> {
        self.tasks.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn sandbox(&self, task_id: &str) -> PathBuf {
        self.work_dir.join("tasks").join(task_id)
    }

    /// Tasks the master should keep for this agent when it (re)registers:
    /// those running, and those ended whose final update may not be applied yet.
    pub fn known_task_ids(&self) -> Vec<String> {
        let t = self.lock();
        let mut ids: Vec<String> = t.active.keys().chain(t.ended.iter()).cloned().collect();
        ids.sort();
        ids
    }

    pub fn is_active(&self, task_id: &str) -> bool {
        self.lock().active.contains_key(task_id)
    }

    pub fn has_ended(&self, task_id: &str) -> bool {
        self.lock().ended.contains(task_id)
    }

    pub fn task_ended_watch(&self) -> watch::Receiver<u64> {
        self.ended_tx.subscribe()
    }

    /// Makes the running set match `desired`; stops the tasks in `kill`,
    /// reporting KILLED at once for those it never started (so every kill
    /// ends in a final status).
    pub fn reconcile(self: &Arc<Self>, desired: Vec<TaskSpec>, kill: Vec<String>) {
        let wanted: HashSet<String> = desired.iter().map(|t| t.task_id.clone()).collect();
        let mut to_launch = Vec::new();
        let mut never_started = Vec::new();
        {
            let mut t = self.lock();
            for id in &kill {
                if !t.active.contains_key(id) && !t.ended.contains(id) {
                    t.ended.insert(id.clone());
                    never_started.push(id.clone());
                }
            }
            for (id, task) in &t.active {
                if !wanted.contains(id) && !*task.kill.borrow() {
                    tracing::info!(task_id = %id, "task no longer wanted by the master; killing it");
                    let _ = task.kill.send(true);
                }
            }
            let kill_set: HashSet<&String> = kill.iter().collect();
            t.ended
                .retain(|id| wanted.contains(id) || kill_set.contains(id));
            for spec in desired {
                if t.active.contains_key(&spec.task_id) || t.ended.contains(&spec.task_id) {
                    continue;
                }
                let (kill, kill_rx) = watch::channel(false);
                // Never start a task on a GPU known to be unhealthy (the
                // master may not have heard yet).
                let gpu_failure = spec
                    .gpu_uuids
                    .iter()
                    .find_map(|g| t.gpu_faults.get_key_value(g))
                    .map(|(uuid, reason)| gpu_failure(uuid, reason));
                if gpu_failure.is_some() {
                    let _ = kill.send(true);
                }
                t.active.insert(
                    spec.task_id.clone(),
                    LocalTask {
                        kill,
                        job_id: spec.job_id.clone(),
                        gpus: spec.gpu_uuids.clone(),
                        gpu_failure,
                    },
                );
                to_launch.push((spec, kill_rx));
            }
        }
        for id in never_started {
            let me = self.clone();
            tokio::spawn(async move {
                me.send(
                    &id,
                    TaskState::Killed,
                    None,
                    "killed before it started".into(),
                    false,
                )
                .await;
            });
        }
        for (spec, kill_rx) in to_launch {
            let me = self.clone();
            tokio::spawn(async move { me.run_task(spec, kill_rx).await });
        }
    }

    /// The task (and its job) running on each GPU, by UUID.
    pub fn gpu_tasks(&self) -> HashMap<String, (String, String)> {
        let t = self.lock();
        let mut out = HashMap::new();
        for (id, task) in &t.active {
            for g in &task.gpus {
                out.insert(g.clone(), (id.clone(), task.job_id.clone()));
            }
        }
        out
    }

    /// Tasks launched and not yet ended.
    pub fn active_tasks(&self) -> usize {
        self.lock().active.len()
    }

    /// The health checks' latest view: tasks on a GPU that just turned
    /// unhealthy are stopped and will end FAILED with the GPU's reason, and
    /// no task is started on an unhealthy GPU.
    pub fn set_gpu_faults(&self, faults: BTreeMap<String, String>) {
        let mut t = self.lock();
        for (id, task) in t.active.iter_mut() {
            if task.gpu_failure.is_some() {
                continue;
            }
            if let Some((uuid, reason)) = task.gpus.iter().find_map(|g| faults.get_key_value(g)) {
                let why = gpu_failure(uuid, reason);
                tracing::warn!(task_id = %id, reason = %why, "stopping task: its GPU failed");
                task.gpu_failure = Some(why);
                let _ = task.kill.send(true);
            }
        }
        t.gpu_faults = faults;
    }

    /// Kills every task (agent shutdown) and waits up to `timeout` for them.
    pub async fn kill_all(&self, timeout: Duration) {
        {
            let t = self.lock();
            for task in t.active.values() {
                let _ = task.kill.send(true);
            }
        }
        let deadline = tokio::time::Instant::now() + timeout;
        while !self.lock().active.is_empty() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn send(
        &self,
        task_id: &str,
        state: TaskState,
        exit_code: Option<i32>,
        message: String,
        gpu_unhealthy: bool,
    ) {
        let u = StatusUpdate {
            agent_id: self.agent_id.clone(),
            task_id: task_id.to_string(),
            state,
            exit_code,
            message,
            uuid: uuid::Uuid::new_v4().as_bytes().to_vec(),
            gpu_unhealthy,
            // The fence is the agent side's (not built yet).
            fenced: false,
        };
        if self.updates.send(u).await.is_err() {
            tracing::error!(task_id, "status channel closed; update dropped");
        }
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
        env
    }

    async fn run_task(self: Arc<Self>, spec: TaskSpec, kill: watch::Receiver<bool>) {
        let task_id = spec.task_id.clone();
        let (mut state, code, mut message) = self.run_task_inner(spec, kill).await;
        let gpu_failure = {
            let mut t = self.lock();
            let local = t.active.remove(&task_id);
            t.ended.insert(task_id.clone());
            local.and_then(|l| l.gpu_failure)
        };
        // A task stopped (or dying by itself) because its GPU failed fails
        // with the GPU's reason; one that finished cleanly first succeeded.
        let gpu_unhealthy = gpu_failure.is_some() && state != TaskState::Finished;
        if let (Some(why), true) = (gpu_failure, gpu_unhealthy) {
            state = TaskState::Failed;
            message = why;
        }
        tracing::info!(task_id = %task_id, state = %state, exit_code = ?code, "task ended");
        self.ended_tx.send_modify(|n| *n += 1);
        self.send(&task_id, state, code, message, gpu_unhealthy)
            .await;
    }

    async fn run_task_inner(
        &self,
        spec: TaskSpec,
        kill: watch::Receiver<bool>,
    ) -> (TaskState, Option<i32>, String) {
        let task_id = spec.task_id.clone();
        let kind = if spec.image.is_some() {
            Runtime::Docker
        } else {
            Runtime::Process
        };
        let Some(runtime) = self.runtimes.get(&kind).cloned() else {
            return (
                TaskState::Failed,
                None,
                format!("this agent has no {kind} runtime"),
            );
        };
        if *kill.borrow() {
            return (TaskState::Killed, None, "killed before it started".into());
        }
        self.send(&task_id, TaskState::Starting, None, String::new(), false)
            .await;
        let sandbox = self.sandbox(&task_id);
        if let Err(e) = tokio::fs::create_dir_all(&sandbox).await {
            return (
                TaskState::Failed,
                None,
                format!("create sandbox {}: {e}", sandbox.display()),
            );
        }
        let minors: Vec<u32> = match spec
            .gpu_uuids
            .iter()
            .map(|u| self.isolation.gpu_minors.get(u).copied().ok_or(u))
            .collect::<Result<_, _>>()
        {
            Ok(m) => m,
            Err(u) => {
                return (
                    TaskState::Failed,
                    None,
                    format!("GPU {u} is not a GPU of this agent"),
                )
            }
        };
        let prepared =
            match self
                .isolation
                .isolator
                .prepare(&task_id, &minors, &spec.resources, kind)
            {
                Ok(p) => p,
                Err(e) => return (TaskState::Failed, None, format!("isolation: {e}")),
            };
        let isolation = TaskIsolation {
            devices: prepared.devices,
            cgroup_parent: prepared.cgroup.as_ref().map(|c| c.docker_parent()),
            cgroup_procs: prepared
                .cgroup
                .as_ref()
                .map(|c| c.procs_files.clone())
                .unwrap_or_default(),
            driver_volume: self.isolation.driver_volume.clone(),
            gpu_task: !spec.gpu_uuids.is_empty(),
        };
        let launch = LaunchSpec {
            env: Self::gpu_env(&spec),
            log_path: sandbox.join(LOG_FILE),
            sandbox,
            agent_id: self.agent_id.clone(),
            kill_grace: self.kill_grace,
            isolation,
            task: spec,
        };
        let (running_tx, running_rx) = oneshot::channel();
        let run = runtime.run(launch, running_tx, kill);
        let report_running = async {
            if running_rx.await.is_ok() {
                self.send(&task_id, TaskState::Running, None, String::new(), false)
                    .await;
            }
            std::future::pending::<std::convert::Infallible>().await
        };
        // Biased so that RUNNING goes out before a quick exit's final state.
        let result = tokio::select! {
            biased;
            never = report_running => match never {},
            r = run => r,
        };
        // The runtime has stopped everything in the cgroup by now.
        if let Err(e) = self.isolation.isolator.release(&task_id) {
            tracing::warn!(task_id = %task_id, error = %e, "could not remove the task's cgroup");
        }
        match result {
            Ok(TaskExit::Exited(0)) => (TaskState::Finished, Some(0), String::new()),
            Ok(TaskExit::Exited(c)) => {
                (TaskState::Failed, Some(c), format!("exited with code {c}"))
            }
            Ok(TaskExit::Killed) => (TaskState::Killed, None, "killed".into()),
            Err(e) => (TaskState::Failed, None, e.to_string()),
        }
    }
}
