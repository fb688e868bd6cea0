//! A task's start: may it start, what it may do, its MPS server, its
//! directories, its isolation, its environment and launch, and the start in
//! its runtime with backoff while the runtime is down (`drive.rs` drives
//! it from there to its end).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use gpuctl_core::time::Backoff;
use gpuctl_core::types::{Runtime, ShareMode, TaskSpec, TaskState, UserIds};
use tokio::sync::watch;

use super::plan::StopReason;
use crate::checkpoint::{self};
use crate::gpu::health::PreflightFailed;
use crate::runtime::{ContainerRuntime, LaunchSpec, RuntimeError, TaskIsolation};
use crate::task_users;

use super::*;

/// What a preflight may take beyond its commands: the health thread
/// answers between two probes, and NVML's checks are quick.
const PREFLIGHT_SLACK: std::time::Duration = std::time::Duration::from_secs(30);

impl Executor {
    /// The task's preflight (`--preflight`) by the GPU health thread; `Err`
    /// says which GPU failed and why (it has been withdrawn). Without
    /// health checks here it is skipped, and the log says so.
    async fn preflight(&self, spec: &TaskSpec) -> Result<(), PreflightFailed> {
        let failed = |why: String| PreflightFailed { gpu: None, why };
        let Some(tx) = &self.isolation.preflight else {
            tracing::warn!(task_id = %spec.task_id, "preflight asked, but this agent has no GPU health checks (no NVML): skipped");
            return Ok(());
        };
        let (reply, answer) = tokio::sync::oneshot::channel();
        let request = crate::gpu::health::PreflightRequest {
            devices: spec.gpu_uuids.clone(),
            reply,
        };
        if tx.tx.send(request).is_err() {
            return Err(failed(
                "preflight: the GPU health checks have stopped".into(),
            ));
        }
        // Each device's command may take its timeout; NVML's checks are
        // quick. A health thread that does not answer fails it.
        let n = u32::try_from(spec.gpu_uuids.len()).unwrap_or(u32::MAX);
        let bound = PREFLIGHT_SLACK + tx.timeout.saturating_mul(n);
        match tokio::time::timeout(bound, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(failed(
                "preflight: the GPU health checks have stopped".into(),
            )),
            Err(_) => Err(failed(format!("preflight: no answer within {bound:?}"))),
        }
    }

    /// A fraction of an `mps` GPU gets the MPS daemon of its GPU, tenant
    /// and user, started if need be; without a control program here it
    /// runs unenforced, and says so (`None`).
    async fn acquire_mps(
        &self,
        spec: &TaskSpec,
        user: Option<UserIds>,
    ) -> Result<Option<crate::gpu::mps::MpsServer>, Outcome> {
        let task_id = spec.task_id.as_str();
        let Some((gpu, sh)) = spec.holding().fraction() else {
            return Ok(None);
        };
        if sh.mode != ShareMode::Mps || !self.isolation.mps.available() {
            return Ok(None);
        }
        let mps = self.isolation.mps.clone();
        let group = mps_group(sh, user);
        // Recorded first: an agent restarted under the task finds its
        // daemon by it.
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
            Ok(server) => Ok(Some(server)),
            Err(e) => {
                self.release(task_id);
                tracing::warn!(task_id, error = %e, "no MPS daemon for the task");
                Err(Outcome::failed(format!("MPS: {e}")))
            }
        }
    }

    /// The task's environment, and the mounts a container needs for what
    /// it names: the notice before a stop, the heartbeat of a task that may
    /// be stopped as hung, the checkpoint directory at the path the job
    /// named, the MPS pipe directory, and the driver-cap hook's value. A
    /// host process sees the same paths where they are.
    fn task_env(
        &self,
        spec: &TaskSpec,
        kind: Runtime,
        security: &mut crate::security::LaunchSecurity,
        dirs: TaskDirs,
        mps: Option<&crate::gpu::mps::MpsServer>,
        cap_value: Option<&String>,
    ) -> BTreeMap<String, String> {
        let docker = kind == Runtime::Docker;
        let mut env = Self::gpu_env(spec);
        let notice_at = if docker {
            security.mounts.push(crate::security::BindMount {
                host_path: dirs.notice.clone(),
                container_path: notice::CONTAINER_DIR.to_string(),
                read_only: true,
            });
            PathBuf::from(notice::CONTAINER_DIR).join(notice::FILE)
        } else {
            security.keep_visible.push(dirs.notice.clone());
            dirs.notice.join(notice::FILE)
        };
        env.insert(notice::ENV.into(), notice_at.display().to_string());
        if let Some(dir) = dirs.heartbeat {
            let beat_at = if docker {
                security.mounts.push(crate::security::BindMount {
                    host_path: dir.clone(),
                    container_path: super::hang::CONTAINER_DIR.to_string(),
                    read_only: false,
                });
                PathBuf::from(super::hang::CONTAINER_DIR).join(super::hang::HEARTBEAT_FILE)
            } else {
                security.keep_visible.push(dir.clone());
                dir.join(super::hang::HEARTBEAT_FILE)
            };
            env.insert(super::hang::ENV.into(), beat_at.display().to_string());
        }
        if let (Some(dir), Some(asked)) = (&dirs.checkpoint, &spec.template.checkpoint_dir) {
            if docker {
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
        if let (Some(server), Some(sh)) = (mps, &spec.share) {
            crate::gpu::mps::scrub_env(&mut env);
            // A container sees the pipe directory where the agent mounts
            // it (with the daemon's shm as its /dev/shm); a host process
            // where it is.
            let pipe = if docker {
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
        if let (Some(value), Some(_)) = (cap_value, &self.isolation.cap_socket) {
            env.insert(crate::runtime::oci_hook::CAP_ENV.to_string(), value.clone());
        }
        env
    }

    /// Prepares and starts a task; `Err` with its final outcome when it
    /// ends before it ran. Its steps in order: may it start, its spec
    /// checkpointed, what it may do, its MPS server, its directories, its
    /// isolation, STARTING, its launch, the start itself.
    pub(super) async fn start(
        &self,
        spec: &TaskSpec,
        rt: &Arc<dyn ContainerRuntime>,
        stop: &mut watch::Receiver<Option<StopReason>>,
        fence_ms: u64,
    ) -> Result<Option<gpuctl_core::types::Enforcement>, Outcome> {
        let task_id = spec.task_id.as_str();
        self.admit(spec, stop, fence_ms).await?;
        self.checkpoint_spec(spec)
            .map_err(|e| Outcome::failed(format!("checkpoint: {e}")))?;
        let (mut security, checkpoint_dir) = self.task_security(spec).await?;
        let mps = self.acquire_mps(spec, security.user).await?;
        let (sandbox, dirs) = self
            .make_task_dirs(spec, rt.kind(), &mut security, checkpoint_dir)
            .await?;
        let isolated = self.isolate(spec, rt.as_ref()).await?;
        let mut starting = self.update(task_id, TaskState::Starting);
        starting.enforcement =
            spec.share
                .as_ref()
                .map(|_| match (isolated.driver_cap, mps.is_some()) {
                    (true, _) => gpuctl_core::types::Enforcement::Driver,
                    (false, true) => gpuctl_core::types::Enforcement::Mps,
                    (false, false) => gpuctl_core::types::Enforcement::None,
                });
        self.send(starting).await;
        let env = self.task_env(
            spec,
            rt.kind(),
            &mut security,
            dirs,
            mps.as_ref(),
            isolated.container_cap.as_ref().map(|(_, value)| value),
        );
        let container_cap = isolated.container_cap.clone();
        let launch = self.launch_spec(spec, env, sandbox, security, isolated);
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

    /// Whether the task may start now: not stopped, not past the fence,
    /// and its GPUs through their preflight when it asks for one.
    async fn admit(
        &self,
        spec: &TaskSpec,
        stop: &watch::Receiver<Option<StopReason>>,
        fence_ms: u64,
    ) -> Result<(), Outcome> {
        if let Some(r) = stop.borrow().clone() {
            return Err(Outcome::refused(&r, fence_ms));
        }
        // Nothing starts past the fence: the master may have given up on it.
        let fenced = self
            .lock()
            .contact
            .is_some_and(|c| c.expired_at(checkpoint::wall_ms()));
        if fenced && !spec.template.no_fence {
            return Err(Outcome::refused(&StopReason::Fenced, fence_ms));
        }
        if spec.template.preflight && !spec.gpu_uuids.is_empty() {
            self.preflight(spec).await.map_err(|f| {
                tracing::warn!(task_id = %spec.task_id, reason = %f.why, "preflight failed: the task does not start");
                Outcome::refused(
                    &StopReason::GpuFailed {
                        why: f.why,
                        gpu: f.gpu,
                    },
                    fence_ms,
                )
            })?;
        }
        Ok(())
    }

    /// What the task may do here (`security.rs`), with a user of its own
    /// leased when it gets one, and its checkpoint directory; refused
    /// before anything is made for it when it asks for more than this
    /// agent allows.
    async fn task_security(
        &self,
        spec: &TaskSpec,
    ) -> Result<(crate::security::LaunchSecurity, Option<PathBuf>), Outcome> {
        let task_id = spec.task_id.as_str();
        let refused = |why: String| {
            tracing::warn!(task_id, reason = %why, "task refused");
            Outcome::failed(why)
        };
        let policy = &self.isolation.policy;
        let mut security = policy
            .resolve(spec, &crate::security::RealHost)
            .map_err(refused)?;
        let checkpoint_dir = policy
            .checkpoint_dir(spec, &crate::security::RealHost)
            .map_err(refused)?;
        if security.own_user {
            // The owner of the job's checkpoint directory, made by an
            // earlier attempt, again if it is free: it owns what is there.
            let owner = checkpoint_dir
                .as_deref()
                .and_then(|d| std::fs::metadata(d).ok())
                .map(|m| std::os::unix::fs::MetadataExt::uid(&m));
            let job = Some(spec.job_id.as_str()).filter(|j| !j.is_empty());
            let ids = self.own_user(task_id, job, owner).await.map_err(refused)?;
            security.user = Some(ids);
        }
        Ok((security, checkpoint_dir))
    }

    /// The task's sandbox and the directories it is told of: its stop
    /// notice's, its heartbeat's (with a hang timeout) and its checkpoint
    /// directory, each its user's.
    async fn make_task_dirs(
        &self,
        spec: &TaskSpec,
        runtime: Runtime,
        security: &mut crate::security::LaunchSecurity,
        checkpoint_dir: Option<PathBuf>,
    ) -> Result<(PathBuf, TaskDirs), Outcome> {
        let task_id = spec.task_id.as_str();
        let sandbox = self.sandbox(task_id);
        tokio::fs::create_dir_all(&sandbox)
            .await
            .and_then(|()| set_mode(&sandbox, 0o700))
            .map_err(|e| Outcome::failed(format!("create sandbox {}: {e}", sandbox.display())))?;
        let notice = self
            .make_notice_dir(task_id, security.user)
            .map_err(|e| Outcome::failed(format!("create the stop notice directory: {e}")))?;
        let heartbeat = match spec.template.hang_timeout_ms {
            Some(_) => {
                // A container of its image's user writes its heartbeat
                // through a group of its own: an id leased from task_users
                // for the task (held, recorded and released like a host
                // task's own user), given to the container as a
                // supplementary group.
                let group = if security.user.is_none() && runtime == Runtime::Docker {
                    let ids = self.own_user(task_id, None, None).await.map_err(|why| {
                        tracing::warn!(task_id, reason = %why, "task refused");
                        Outcome::failed(format!("a group for its heartbeat directory: {why}"))
                    })?;
                    security.groups.push(ids.gid);
                    Some(ids.gid)
                } else {
                    None
                };
                Some(
                    self.make_heartbeat_dir(task_id, security.user, group)
                        .map_err(|e| {
                            Outcome::failed(format!("create the heartbeat directory: {e}"))
                        })?,
                )
            }
            None => None,
        };
        if let Some(dir) = &checkpoint_dir {
            make_checkpoint_dir(dir, security.user).map_err(|e| {
                Outcome::failed(format!("checkpoint_dir: create {}: {e}", dir.display()))
            })?;
        }
        Ok((
            sandbox,
            TaskDirs {
                notice,
                heartbeat,
                checkpoint: checkpoint_dir,
            },
        ))
    }

    /// The task's devices and cgroups prepared, and a fraction's memory
    /// capped by the driver where it can be.
    async fn isolate(
        &self,
        spec: &TaskSpec,
        rt: &dyn ContainerRuntime,
    ) -> Result<Isolated, Outcome> {
        let task_id = spec.task_id.as_str();
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
            .prepare(task_id, &devices, &spec.template.resources, rt.kind())
            .map_err(|e| Outcome::failed(format!("isolation: {e}")))?;
        // A fraction's memory capped by the driver on the task's own cgroup
        // v2 (host processes; r615+), before anything runs in it. What this
        // agent enforces is said with STARTING, so only once that is known.
        let unified = prepared
            .cgroup
            .as_ref()
            .and_then(|c| c.unified_dir.as_deref());
        let fraction = spec.holding().fraction();
        let driver_cap = match (fraction, unified) {
            (Some((gpu, sh)), Some(dir)) => {
                let cap = &self.isolation.memcap;
                cap.cap_task(task_id, gpu, dir, sh.fraction.mem_mib).await
            }
            _ => false,
        };
        // A container's own cgroup exists only once runc creates it: there
        // the `gpuctl-runc` runtime's hook has it capped before the workload
        // runs (runtime::oci_hook). STARTING says what holds without it;
        // RUNNING says `driver` once the cap held.
        let container_cap = match fraction {
            Some((gpu, sh)) if !driver_cap && rt.kind() == Runtime::Docker => {
                self.container_cap(task_id, rt, gpu, sh.fraction.mem_mib)
            }
            _ => None,
        };
        Ok(Isolated {
            prepared,
            driver_cap,
            container_cap,
        })
    }

    /// What the runtime is asked to start.
    fn launch_spec(
        &self,
        spec: &TaskSpec,
        env: BTreeMap<String, String>,
        sandbox: PathBuf,
        security: crate::security::LaunchSecurity,
        isolated: Isolated,
    ) -> LaunchSpec {
        let task_id = spec.task_id.as_str();
        let Isolated {
            prepared,
            container_cap,
            ..
        } = isolated;
        LaunchSpec {
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
                oci_runtime: container_cap.map(|(name, _)| name),
            },
            state_dir: self.state_dir(task_id),
            fence: (!spec.template.no_fence).then(|| checkpoint::contact_path(&self.work_dir)),
            security,
            task: spec.clone(),
        }
    }

    /// Task `task_id`'s container capped by the driver through the
    /// `gpuctl-runc` hook, when this agent and its Docker daemon can: the
    /// runtime's name and the container's `GPUCTL_DRIVER_CAP`. The cap is
    /// expected from here until the start is over.
    pub(super) fn container_cap(
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
    pub(super) async fn start_with_backoff(
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
    pub(super) async fn own_user(
        &self,
        task_id: &str,
        job: Option<&str>,
        owner: Option<u32>,
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
        let host = tokio::task::spawn_blocking(self.isolation.users.host_ids())
            .await
            .map_err(|e| format!("reading the host's users: {e}"))?;
        let ids = self
            .isolation
            .users
            .lease_in_job(task_id, job, owner, &host)?;
        if let Err(e) = checkpoint::write_json(&path, &ids) {
            self.isolation.users.release(task_id);
            return Err(format!("task user record: {e}"));
        }
        tracing::info!(task_id, user = %ids, "task user leased");
        Ok(ids)
    }
}

/// Makes a job's checkpoint directory if it is missing, its last part
/// owned by the task's user (root's when that is not known: a container
/// without a user of its job's), readable by nobody else. One that exists is
/// left as it is: the agent never takes over a directory it did not make.
pub(super) fn make_checkpoint_dir(
    dir: &std::path::Path,
    user: Option<UserIds>,
) -> std::io::Result<()> {
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

/// A task's isolation as prepared for its start: its devices and cgroups,
/// whether the driver caps its fraction's memory already, and the
/// container runtime (and its `GPUCTL_DRIVER_CAP`) that caps a container's.
struct Isolated {
    prepared: crate::isolation::Prepared,
    driver_cap: bool,
    container_cap: Option<(String, String)>,
}

/// The directories a task is given, made before it starts.
struct TaskDirs {
    notice: PathBuf,
    heartbeat: Option<PathBuf>,
    checkpoint: Option<PathBuf>,
}
