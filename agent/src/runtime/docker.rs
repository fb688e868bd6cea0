//! Docker runtime: one container per task, through the Docker Engine API
//! (bollard).
//!
//! Containers use the host network (agents may run Docker without a bridge)
//! and `init: true`, so that the task's command is not PID 1 and gets the
//! default SIGTERM behaviour when the container is stopped.
//!
//! What a container may do is decided here, in its host config, never by
//! its image: not privileged, every capability dropped but
//! [`crate::security::CONTAINER_CAPABILITIES`], `no-new-privileges`, the
//! job's user, and no host path but the driver volume and the mounts the
//! agent allowed (docs/isolation.md, "What a task may do").

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bollard::container::{
    Config, CreateContainerOptions, ListContainersOptions, LogOutput, LogsOptions,
    RemoveContainerOptions, StopContainerOptions, WaitContainerOptions,
};
use bollard::errors::Error as BollardError;
use bollard::image::CreateImageOptions;
use bollard::models::{ContainerStateStatusEnum, DeviceMapping, DeviceRequest, HostConfig};
use bollard::{ClientVersion, Docker};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use gpuctl_core::cuda_req;
use gpuctl_core::time::Backoff;
use gpuctl_core::types::Runtime;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use tokio::task::JoinHandle;

use super::{
    fence, ContainerRuntime, Ended, HostDriver, LaunchSpec, Observed, RuntimeError, RuntimeStatus,
    TaskRef, LABEL_AGENT_ID, LABEL_JOB_ID, LABEL_TASK_ID,
};

const DEFAULT_SOCKET: &str = "unix:///var/run/docker.sock";
/// bollard's default per-request timeout, in seconds.
const REQUEST_TIMEOUT_S: u64 = 120;
/// The API version we speak. bollard 0.18 defaults to 1.47, which Docker
/// 20.10 (API 1.41) refuses outright; 1.41 has everything used here and is
/// accepted by every newer daemon. `negotiate_version` lowers it further for
/// older daemons.
const API_VERSION: ClientVersion = ClientVersion {
    major_version: 1,
    minor_version: 41,
};
const PING_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a container whose device probe failed may take to be seen
/// ending (it was exiting) before the failure counts.
const PROBE_SETTLE: Duration = Duration::from_secs(3);
/// How long the output may keep flowing after the container has ended.
const LOG_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// Retries while the daemon does not answer.
const OUTAGE_BACKOFF_MIN: Duration = Duration::from_millis(200);
const OUTAGE_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// The log cursor is saved at most this often (and when the copy ends).
const CURSOR_SAVE: Duration = Duration::from_millis(250);
pub const LOG_CURSOR_FILE: &str = "log.cursor";

/// Runs tasks as Docker containers named `gpuctl-<agent_id>-<task_id>`.
#[derive(Debug, Clone)]
pub struct DockerRuntime {
    /// Made on first use: bollard refuses a socket path that does not exist,
    /// which is what a daemon in the middle of a restart looks like.
    docker: Arc<Mutex<Option<Docker>>>,
    addr: String,
    /// Learnt from the daemon the first time it answers: with the cgroupfs
    /// driver containers go inside the task's cgroup; the systemd driver
    /// only takes slices, so there they go into [`SYSTEMD_SLICE`] and
    /// Docker's own device rules are the ones that hold (see
    /// docs/isolation.md).
    cgroup_driver: Arc<OnceLock<CgroupDriver>>,
    /// Learnt with the cgroup driver: what the driver cap of containers
    /// needs of the daemon (`oci_hook`).
    cap_facts: Arc<OnceLock<CapFacts>>,
    health: Arc<Mutex<RuntimeStatus>>,
    /// The binary that runs each container's fence watcher
    /// (`<exe> fence-container DIR`); `None`: containers are fenced only by
    /// the agent process itself.
    fence_exe: Option<PathBuf>,
    /// The binary whose `probe-devices` checks each started container's
    /// device access from outside (`isolation::probe`); `None`: unchecked.
    device_check: Option<PathBuf>,
    /// How GPU containers got their GPUs last (CDI or `--device`, and why),
    /// so that the agent says so when it changes, not for every task.
    gpu_path: Arc<Mutex<Option<String>>>,
}

/// What the daemon said of itself that the containers' driver cap needs.
/// Whether a container has a cgroup v2 of its own to cap (a v2 host, or a
/// hybrid one where runc also makes one on the unified hierarchy) is found
/// per container, by its hook.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CapFacts {
    /// The OCI runtimes registered with the daemon (`--add-runtime`).
    pub runtimes: Vec<String>,
}

impl CapFacts {
    /// Whether containers can be created with runtime `name`.
    pub fn check(&self, name: &str) -> Result<(), String> {
        if !self.runtimes.iter().any(|r| r == name) {
            return Err(format!(
                "the Docker daemon has no runtime {name:?} (dockerd --add-runtime {name}=/usr/lib/gpuctl/gpuctl-runc)"
            ));
        }
        Ok(())
    }
}

/// Docker's cgroup driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupDriver {
    Cgroupfs,
    Systemd,
}

/// The slice task containers go into under the systemd driver, so they can
/// be told apart from other containers and limited together.
pub const SYSTEMD_SLICE: &str = "gpuctl.slice";

/// A transport failure (the daemon does not answer) as opposed to an
/// answer from the daemon.
fn is_outage(e: &BollardError) -> bool {
    matches!(
        e,
        BollardError::IOError { .. }
            | BollardError::HyperResponseError { .. }
            | BollardError::HyperLegacyError { .. }
            | BollardError::HttpClientError { .. }
            | BollardError::SocketNotFoundError(_)
            | BollardError::RequestTimeoutError
    )
}

impl DockerRuntime {
    /// A client for the local daemon (`DOCKER_HOST` if it is a `unix://`
    /// address, else `/var/run/docker.sock`). Does not need the daemon to
    /// answer: tasks outlive daemon restarts, and so does the agent's use of
    /// it.
    pub fn new() -> Result<DockerRuntime, RuntimeError> {
        let addr = std::env::var("DOCKER_HOST")
            .ok()
            .filter(|h| h.starts_with("unix://"))
            .unwrap_or_else(|| DEFAULT_SOCKET.to_string());
        DockerRuntime::with_socket(addr)
    }

    /// A client for the daemon at `addr` (`unix://PATH`).
    pub fn with_socket(addr: String) -> Result<DockerRuntime, RuntimeError> {
        Ok(DockerRuntime {
            docker: Arc::new(Mutex::new(None)),
            addr,
            cgroup_driver: Arc::new(OnceLock::new()),
            cap_facts: Arc::new(OnceLock::new()),
            health: Arc::new(Mutex::new(RuntimeStatus {
                available: false,
                message: "not contacted yet".into(),
            })),
            fence_exe: None,
            device_check: None,
            gpu_path: Arc::new(Mutex::new(None)),
        })
    }

    /// Gives every fenced container a watcher process (`runtime::fence`)
    /// that stops it when the agent's contact with the masters is older than
    /// the fence timeout, even while the agent itself is frozen or dead.
    pub fn with_fence_watcher(mut self, exe: PathBuf) -> DockerRuntime {
        self.fence_exe = Some(exe);
        self
    }

    /// Checks each started container's device access from outside, with
    /// `<exe> probe-devices` (see `isolation::probe`).
    pub fn with_device_check(mut self, exe: PathBuf) -> DockerRuntime {
        self.device_check = Some(exe);
        self
    }

    /// Starts the container's fence watcher unless one runs (a second one
    /// exits at once: the watcher holds a lock).
    fn ensure_fence_watcher(&self, state_dir: &Path) {
        let Some(exe) = &self.fence_exe else {
            return;
        };
        if !state_dir.join(fence::CONFIG_FILE).exists() {
            return; // not fenced (--no-fence)
        }
        let log = state_dir.join("fence.log");
        if let Err(e) = super::spawn_helper(exe, fence::SUBCOMMAND, state_dir, &log) {
            tracing::warn!(dir = %state_dir.display(), error = %e, "could not start the container's fence watcher");
        }
    }

    /// Records what the container's fence watcher needs.
    fn write_fence_config(&self, spec: &LaunchSpec) -> Result<(), RuntimeError> {
        let Some(contact) = &spec.fence else {
            return Ok(());
        };
        let config = fence::FenceConfig {
            container: container_name(&spec.agent_id, &spec.task.task_id),
            socket: PathBuf::from(self.addr.strip_prefix("unix://").unwrap_or(&self.addr)),
            contact: contact.clone(),
            kill_grace_ms: spec.kill_grace.as_millis() as u64,
            // The container is in the task's cgroups only with cgroupfs.
            cgroup_procs: if self.cgroup_driver.get() == Some(&CgroupDriver::Cgroupfs) {
                spec.isolation.cgroup_procs.clone()
            } else {
                Vec::new()
            },
        };
        crate::checkpoint::write_json(&spec.state_dir.join(fence::CONFIG_FILE), &config)
            .map_err(|e| RuntimeError::Other(e.to_string()))
    }

    /// Connects and checks that the daemon answers now.
    pub async fn connect() -> Result<DockerRuntime, RuntimeError> {
        let rt = DockerRuntime::new()?;
        rt.probe().await?;
        // Speak the daemon's version when it is older than ours.
        if let Ok(Ok(d)) =
            tokio::time::timeout(PING_TIMEOUT, rt.client()?.negotiate_version()).await
        {
            *rt.docker.lock().unwrap_or_else(|p| p.into_inner()) = Some(d);
        }
        Ok(rt)
    }

    /// The client, made now if it was not yet.
    pub fn client(&self) -> Result<Docker, RuntimeError> {
        let mut d = self.docker.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = d.as_ref() {
            return Ok(d.clone());
        }
        match Docker::connect_with_local(&self.addr, REQUEST_TIMEOUT_S, &API_VERSION) {
            Ok(c) => {
                *d = Some(c.clone());
                Ok(c)
            }
            Err(e) => {
                drop(d);
                Err(self.err(e))
            }
        }
    }

    /// Pings the daemon and learns its cgroup driver; records the answer
    /// in [`ContainerRuntime::status`].
    pub async fn probe(&self) -> Result<(), RuntimeError> {
        let docker = self.client()?;
        let res = tokio::time::timeout(PING_TIMEOUT, async {
            docker.ping().await?;
            if self.cgroup_driver.get().is_none() {
                let info = docker.info().await?;
                let mut runtimes: Vec<String> =
                    info.runtimes.unwrap_or_default().into_keys().collect();
                runtimes.sort();
                let _ = self.cap_facts.set(CapFacts { runtimes });
                let driver = info
                    .cgroup_driver
                    .map(|d| d.to_string())
                    .unwrap_or_default();
                let driver = if driver == "systemd" {
                    tracing::info!("Docker uses the systemd cgroup driver: task containers go into {SYSTEMD_SLICE} with Docker's device rules, checked after each start");
                    CgroupDriver::Systemd
                } else {
                    CgroupDriver::Cgroupfs
                };
                let _ = self.cgroup_driver.set(driver);
            }
            Ok::<_, BollardError>(())
        })
        .await;
        match res {
            Ok(Ok(())) => {
                self.set_health(true, String::new());
                Ok(())
            }
            Ok(Err(e)) => Err(self.err(e)),
            Err(_) => Err(self.unavailable(format!("no answer within {PING_TIMEOUT:?}"))),
        }
    }

    fn set_health(&self, available: bool, message: String) {
        let mut h = self.health.lock().unwrap_or_else(|p| p.into_inner());
        if h.available != available {
            if available {
                tracing::info!(docker = %self.addr, "Docker daemon answers again");
            } else {
                tracing::warn!(docker = %self.addr, reason = %message, "Docker daemon does not answer; tasks keep their state until it does");
            }
        }
        *h = RuntimeStatus { available, message };
    }

    fn unavailable(&self, reason: String) -> RuntimeError {
        self.set_health(false, reason.clone());
        RuntimeError::Unavailable {
            runtime: Runtime::Docker,
            reason: format!("docker at {}: {reason}", self.addr),
        }
    }

    /// Sorts a bollard error into an outage or an answer.
    fn err(&self, e: BollardError) -> RuntimeError {
        if is_outage(&e) {
            self.unavailable(e.to_string())
        } else {
            self.set_health(true, String::new());
            RuntimeError::Docker(e)
        }
    }

    /// Makes sure `image` is present locally, pulling it if not, and reads
    /// what the container's configuration depends on.
    async fn ensure_image(&self, image: &str) -> Result<ImageFacts, RuntimeError> {
        match self.client()?.inspect_image(image).await {
            Ok(info) => return Ok(ImageFacts::from(&info)),
            Err(e) if is_not_found(&e) => {}
            Err(e) => {
                return Err(RuntimeError::Image {
                    image: image.to_string(),
                    reason: format!("inspect: {e}"),
                })
            }
        }
        let (from_image, tag) = split_reference(image);
        tracing::info!(image, "image not present locally, pulling");
        let mut pull = self.client()?.create_image(
            Some(CreateImageOptions {
                from_image,
                tag,
                ..Default::default()
            }),
            None,
            None,
        );
        while let Some(progress) = pull.next().await {
            progress.map_err(|e| RuntimeError::Image {
                image: image.to_string(),
                reason: format!("not present on this host and the pull failed: {e}"),
            })?;
        }
        let info = self
            .client()?
            .inspect_image(image)
            .await
            .map_err(|e| RuntimeError::Image {
                image: image.to_string(),
                reason: format!("inspect after pull: {e}"),
            })?;
        Ok(ImageFacts::from(&info))
    }

    /// What the daemon says of CDI: its API version and the directories
    /// its CDI registry reads (empty: CDI off, or a Docker before 25).
    async fn daemon_cdi(&self) -> Result<DaemonCdi, RuntimeError> {
        let docker = self.client()?;
        let version = docker.version().await.map_err(|e| self.err(e))?;
        let info = docker.info().await.map_err(|e| self.err(e))?;
        Ok(DaemonCdi {
            api_version: version.api_version.unwrap_or_default(),
            // Docker resolves symlinks in its own (/var/run/cdi is /run/cdi).
            spec_dirs: info
                .cdi_spec_dirs
                .unwrap_or_default()
                .iter()
                .map(|d| std::fs::canonicalize(d).unwrap_or_else(|_| PathBuf::from(d)))
                .collect(),
        })
    }

    /// The CDI device request for a task's GPUs when the daemon takes one;
    /// `None`: they go with `--device`, as with every Docker before 25.
    async fn cdi_request(&self, devices: &[crate::cdi::CdiDevice]) -> Option<DeviceRequest> {
        if devices.is_empty() {
            return None;
        }
        let decision = match self.daemon_cdi().await {
            Ok(daemon) => cdi_device_request(&daemon, devices),
            Err(e) => Err(format!("the daemon's CDI support is unknown ({e})")),
        };
        let way = match &decision {
            Ok(_) => "CDI device requests (HostConfig.DeviceRequests, driver cdi)".to_string(),
            Err(why) => format!("--device, not CDI: {why}"),
        };
        let mut last = self.gpu_path.lock().unwrap_or_else(|p| p.into_inner());
        if last.as_deref() != Some(way.as_str()) {
            tracing::info!("GPU containers get their GPUs through {way}");
            *last = Some(way);
        }
        drop(last);
        if let Ok(r) = &decision {
            tracing::debug!(devices = ?r.device_ids, "CDI device request");
        }
        decision.ok()
    }

    /// Force-removes a container; a missing one is fine.
    async fn remove_container(&self, name: &str) -> Result<(), RuntimeError> {
        let opts = RemoveContainerOptions {
            force: true,
            ..Default::default()
        };
        match self.client()?.remove_container(name, Some(opts)).await {
            Err(e) if !is_not_found(&e) => Err(self.err(e)),
            _ => Ok(()),
        }
    }

    async fn start_task(&self, spec: &LaunchSpec) -> Result<(), RuntimeError> {
        let task_id = spec.task.task_id.as_str();
        let Some(image) = spec.task.image.as_deref() else {
            return Err(RuntimeError::Image {
                image: String::new(),
                reason: format!("task {task_id}: the docker runtime needs an image"),
            });
        };
        let name = container_name(&spec.agent_id, task_id);
        match self.client()?.inspect_container(&name, None).await {
            Ok(info) => {
                let created = info
                    .state
                    .and_then(|s| s.status)
                    .is_some_and(|s| s == ContainerStateStatusEnum::CREATED);
                if !created {
                    // Started before (by this or an earlier agent process).
                    return Ok(());
                }
                // Created by an agent that died before starting it.
            }
            Err(e) if is_not_found(&e) => {
                if self.cgroup_driver.get().is_none() {
                    self.probe().await?;
                }
                let facts = self.ensure_image(image).await?;
                // As NVIDIA's hook: checked in every container that gets
                // the driver, before anything is made for it.
                if spec.isolation.gpu_task || facts.wants_driver_volume {
                    check_driver(image, &facts, &spec.env, &spec.isolation.driver)?;
                }
                let driver = self
                    .cgroup_driver
                    .get()
                    .copied()
                    .unwrap_or(CgroupDriver::Cgroupfs);
                let cdi = self.cdi_request(&spec.isolation.cdi_devices).await;
                let created = self
                    .client()?
                    .create_container(
                        Some(CreateContainerOptions {
                            name: name.clone(),
                            platform: None,
                        }),
                        container_config(spec, image, &facts, driver, cdi.as_ref()),
                    )
                    .await
                    .map_err(|e| self.err(e))?;
                record_container_id(&spec.state_dir, &created.id);
                tracing::debug!(task_id, container = %name, image, "container created");
            }
            Err(e) => return Err(self.err(e)),
        }
        // The watcher's configuration is written before the container
        // starts, so a container never runs unfenced past an agent crash.
        self.write_fence_config(spec)?;
        self.client()?
            .start_container::<String>(&name, None)
            .await
            .map_err(|e| self.err(e))?;
        self.set_health(true, String::new());
        self.ensure_fence_watcher(&spec.state_dir);
        tracing::debug!(task_id, container = %name, "container started");
        if let Err(e) = self.check_devices(spec, &name).await {
            tracing::error!(task_id, container = %name, error = %e, "stopping a container whose device isolation does not hold");
            self.remove_container(&name).await?;
            return Err(e);
        }
        Ok(())
    }

    /// Opens every NVIDIA node of the host from the running container's
    /// cgroups: its own must open, every other one must be denied. A
    /// container that has already ended is not checked.
    async fn check_devices(&self, spec: &LaunchSpec, name: &str) -> Result<(), RuntimeError> {
        let Some(exe) = self.device_check.clone() else {
            return Ok(());
        };
        let iso = &spec.isolation;
        if iso.host_nodes.is_empty() {
            return Ok(());
        }
        let running_pid = |info: bollard::models::ContainerInspectResponse| {
            info.state
                .filter(|s| s.running == Some(true))
                .and_then(|s| s.pid)
                .filter(|p| *p > 0)
        };
        let info = self
            .client()?
            .inspect_container(name, None)
            .await
            .map_err(|e| self.err(e))?;
        let Some(pid) = running_pid(info) else {
            return Ok(());
        };
        let nodes = iso.host_nodes.clone();
        let seen =
            tokio::task::spawn_blocking(move || crate::isolation::probe::probe(&exe, pid, &nodes))
                .await
                .map_err(|e| RuntimeError::Other(format!("device probe: {e}")))?;
        let allowed: Vec<PathBuf> = iso.devices.iter().map(|d| d.host_path.clone()).collect();
        let verdict = seen
            .map_err(|e| e.to_string())
            .and_then(|seen| crate::isolation::probe::check(&seen, &allowed).map(|()| seen.len()));
        let e = match verdict {
            Ok(n) => {
                tracing::debug!(container = %name, nodes = n, "device isolation checked");
                return Ok(());
            }
            Err(e) => e,
        };
        // It may have ended between the inspection and the probe: its
        // cgroup is removed before the daemon marks it exited (the probe
        // fails), or, ending, it was no longer in it when the probe read
        // where it is (the probe ran outside its cgroup and saw too much:
        // CI saw a quick container's check fail so). A container that ended
        // uses no device; give the daemon a moment to say so.
        let settle = tokio::time::Instant::now() + PROBE_SETTLE;
        loop {
            let info = self
                .client()?
                .inspect_container(name, None)
                .await
                .map_err(|e| self.err(e))?;
            if running_pid(info) != Some(pid) {
                tracing::debug!(container = %name, "device check of a container that ended meanwhile: skipped");
                return Ok(());
            }
            if tokio::time::Instant::now() >= settle {
                return Err(RuntimeError::Isolation(e));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn observe_task(&self, task: &TaskRef) -> Result<Observed, RuntimeError> {
        let name = container_name(&task.agent_id, &task.task_id);
        let info = match self.client()?.inspect_container(&name, None).await {
            Ok(i) => i,
            Err(e) if is_not_found(&e) => return Ok(Observed::NotStarted),
            Err(e) => return Err(self.err(e)),
        };
        self.set_health(true, String::new());
        if let Some(id) = &info.id {
            record_container_id(&task.state_dir, id);
        }
        let state = info.state.unwrap_or_default();
        Ok(match state.status {
            Some(ContainerStateStatusEnum::CREATED) | None => Observed::NotStarted,
            Some(ContainerStateStatusEnum::EXITED | ContainerStateStatusEnum::DEAD) => {
                Observed::Ended(Ended {
                    code: state.exit_code.map(|c| i32::try_from(c).unwrap_or(-1)),
                    // Stopped by its fence watcher.
                    fenced: task.state_dir.join(fence::FENCED_FILE).exists(),
                    error: None,
                })
            }
            Some(_) => Observed::Running,
        })
    }

    /// Follows the container to its end, copying its output to the log,
    /// through any number of daemon restarts.
    async fn wait_task(&self, task: &TaskRef) -> Result<Ended, RuntimeError> {
        let name = container_name(&task.agent_id, &task.task_id);
        let mut backoff = Backoff::new(OUTAGE_BACKOFF_MIN, OUTAGE_BACKOFF_MAX);
        // Aborted if this future is dropped: one copy of the output at a time.
        let mut pump: Option<AbortOnDrop> = None;
        let ended = loop {
            match self.observe_task(task).await {
                Ok(Observed::Ended(e)) => break e,
                Ok(Observed::NotStarted) => {
                    break Ended {
                        code: None,
                        fenced: false,
                        error: Some(format!("container {name} vanished")),
                    }
                }
                Ok(Observed::Running) => {
                    backoff.reset();
                    if pump.is_none() {
                        // A reattached container gets its watcher back if
                        // it died with the old agent's process group.
                        self.ensure_fence_watcher(&task.state_dir);
                    }
                    if pump.as_ref().is_none_or(|p| p.0.is_finished()) {
                        pump = Some(AbortOnDrop(tokio::spawn(pump_logs(
                            self.clone(),
                            name.clone(),
                            task.clone(),
                        ))));
                    }
                    // The answer only comes when the container stops, but
                    // headers are sent at once, so the request timeout does
                    // not cut long tasks short.
                    let mut wait = self.client()?.wait_container(
                        &name,
                        Some(WaitContainerOptions {
                            condition: "not-running",
                        }),
                    );
                    match wait.next().await {
                        Some(Ok(_)) | None => {}
                        // A non-zero exit comes as an error; not one for us.
                        Some(Err(BollardError::DockerContainerWaitError { .. })) => {}
                        Some(Err(e)) if is_outage(&e) => {
                            let _ = self.err(e);
                            tokio::time::sleep(backoff.next_wait()).await;
                        }
                        Some(Err(e)) if is_not_found(&e) => {}
                        Some(Err(e)) => {
                            tracing::warn!(container = %name, error = %e, "waiting for the container failed; looking again");
                            tokio::time::sleep(backoff.next_wait()).await;
                        }
                    }
                }
                Err(e) if e.is_unavailable() => {
                    tokio::time::sleep(backoff.next_wait()).await;
                }
                Err(e) => return Err(e),
            }
        };
        // Copy what is left of the output (all of it after a reattach whose
        // copy was not running).
        let mut pump = match pump {
            Some(p) if !p.0.is_finished() => p,
            _ => AbortOnDrop(tokio::spawn(pump_logs(
                self.clone(),
                name.clone(),
                task.clone(),
            ))),
        };
        match tokio::time::timeout(LOG_DRAIN_TIMEOUT, &mut pump.0).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => {
                tracing::warn!(task_id = %task.task_id, error = %e, "copying container output failed")
            }
            Ok(Err(e)) => tracing::warn!(task_id = %task.task_id, error = %e, "log pump panicked"),
            Err(_) => tracing::warn!(
                task_id = %task.task_id,
                "container output still flowing after exit; log cut short"
            ),
        }
        Ok(ended)
    }

    /// `docker stop`: SIGTERM, SIGKILL after `grace`.
    async fn stop_task(&self, task: &TaskRef, grace: Duration) -> Result<(), RuntimeError> {
        let name = container_name(&task.agent_id, &task.task_id);
        let secs = grace.as_secs() + u64::from(grace.subsec_nanos() > 0);
        let t = i64::try_from(secs).unwrap_or(i64::MAX);
        // The daemon answers only once the container is down.
        let docker = self
            .client()?
            .with_timeout(Duration::from_secs(REQUEST_TIMEOUT_S.saturating_add(secs)));
        match docker
            .stop_container(&name, Some(StopContainerOptions { t }))
            .await
        {
            Ok(()) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            // 304: already stopped.
            Err(BollardError::DockerResponseServerError {
                status_code: 304, ..
            }) => Ok(()),
            Err(e) => Err(self.err(e)),
        }
    }

    async fn list_tasks(&self, agent_id: &str) -> Result<Vec<String>, RuntimeError> {
        let filters = HashMap::from([(
            "label".to_string(),
            vec![format!("{LABEL_AGENT_ID}={agent_id}")],
        )]);
        let containers = self
            .client()?
            .list_containers(Some(ListContainersOptions {
                all: true,
                filters,
                ..Default::default()
            }))
            .await
            .map_err(|e| self.err(e))?;
        Ok(containers
            .into_iter()
            .filter_map(|c| c.labels.and_then(|mut l| l.remove(LABEL_TASK_ID)))
            .collect())
    }
}

impl ContainerRuntime for DockerRuntime {
    fn kind(&self) -> Runtime {
        Runtime::Docker
    }

    fn start<'a>(&'a self, spec: &'a LaunchSpec) -> BoxFuture<'a, Result<(), RuntimeError>> {
        self.start_task(spec).boxed()
    }

    fn observe<'a>(&'a self, task: &'a TaskRef) -> BoxFuture<'a, Result<Observed, RuntimeError>> {
        self.observe_task(task).boxed()
    }

    fn wait<'a>(&'a self, task: &'a TaskRef) -> BoxFuture<'a, Result<Ended, RuntimeError>> {
        self.wait_task(task).boxed()
    }

    fn stop<'a>(
        &'a self,
        task: &'a TaskRef,
        grace: Duration,
    ) -> BoxFuture<'a, Result<(), RuntimeError>> {
        self.stop_task(task, grace).boxed()
    }

    fn remove<'a>(&'a self, task: &'a TaskRef) -> BoxFuture<'a, Result<(), RuntimeError>> {
        async move {
            self.remove_container(&container_name(&task.agent_id, &task.task_id))
                .await
        }
        .boxed()
    }

    fn list<'a>(&'a self, agent_id: &'a str) -> BoxFuture<'a, Result<Vec<String>, RuntimeError>> {
        self.list_tasks(agent_id).boxed()
    }

    fn cap_runtime(&self, name: &str) -> Result<(), String> {
        match self.cap_facts.get() {
            Some(f) => f.check(name),
            None => Err("the Docker daemon has not answered this agent yet".into()),
        }
    }

    fn status(&self) -> RuntimeStatus {
        self.health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// `gpuctl-<agent-id>-<task-id>`: task ids are unique in a cluster, agent
/// ids on a host, so agents of several clusters can share one daemon.
pub fn container_name(agent_id: &str, task_id: &str) -> String {
    format!("gpuctl-{agent_id}-{task_id}")
}

/// Where a task's container id is kept (beside its other state): a
/// container that Docker puts outside the task's cgroup (the systemd
/// driver) is known by its id in `/proc/<pid>/cgroup`, and the GPU memory
/// of its processes is the task's.
pub const CONTAINER_ID_FILE: &str = "container-id";

fn record_container_id(state_dir: &std::path::Path, id: &str) {
    let path = state_dir.join(CONTAINER_ID_FILE);
    if std::fs::read_to_string(&path).is_ok_and(|old| old == id) {
        return;
    }
    if let Err(e) = crate::checkpoint::write_atomic(&path, id.as_bytes()) {
        tracing::warn!(path = %path.display(), error = %e, "could not record the container id");
    }
}

/// The container id of each task that has one, by container id, from the
/// agent's state directory (`<work>/state/<task>/container-id`).
pub fn recorded_container_ids(
    state_root: &std::path::Path,
) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(state_root)
        .into_iter()
        .flatten()
        .flatten()
    {
        let Ok(id) = std::fs::read_to_string(entry.path().join(CONTAINER_ID_FILE)) else {
            continue;
        };
        let id = id.trim();
        if !id.is_empty() {
            out.insert(
                id.to_string(),
                entry.file_name().to_string_lossy().into_owned(),
            );
        }
    }
    out
}

/// What the container's configuration takes from its image.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ImageFacts {
    /// The image's PATH, which the driver volume's bin is put in front of.
    pub path: Option<String>,
    /// The image's LD_LIBRARY_PATH, kept ahead of the volume's (CUDA
    /// images put their forward-compatibility libraries there).
    pub ld_library_path: Option<String>,
    /// `com.nvidia.volumes.needed=nvidia_driver`.
    pub wants_driver_volume: bool,
    /// Its environment (`KEY=value`), where NVIDIA's images say what they
    /// require of the driver (`NVIDIA_REQUIRE_CUDA`...).
    pub env: Vec<String>,
}

/// Whether this host's driver meets what the container requires: the
/// NVIDIA_REQUIRE_* of its environment, the image's overridden by the
/// task's (`env`), as NVIDIA's hook reads the container's (so a job may
/// set NVIDIA_DISABLE_REQUIRE as with `docker run -e`). Requirements that
/// cannot be read cannot be checked: refused, naming the variable
/// (NVIDIA's hook refuses them too).
fn check_driver(
    image: &str,
    facts: &ImageFacts,
    env: &std::collections::BTreeMap<String, String>,
    host: &HostDriver,
) -> Result<(), RuntimeError> {
    let task_env: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let requires =
        cuda_req::image_requirements(facts.env.iter().chain(&task_env).map(String::as_str))
            .map_err(|e| RuntimeError::Image {
                image: image.to_string(),
                reason: format!("what it requires of the NVIDIA driver cannot be read: {e}"),
            })?;
    let have = host.facts();
    let unmet: Vec<String> = requires
        .iter()
        .filter(|(_, e)| !e.met_by(&have))
        .map(|(var, e)| format!("{var}={}", e.short()))
        .collect();
    if unmet.is_empty() {
        return Ok(());
    }
    Err(RuntimeError::DriverRequirement {
        image: image.to_string(),
        unmet: unmet.join(" and "),
        host: host.words(),
        requires: requires.iter().map(|(_, e)| e.text().to_string()).collect(),
    })
}

impl From<&bollard::models::ImageInspect> for ImageFacts {
    fn from(info: &bollard::models::ImageInspect) -> Self {
        let config = info.config.as_ref();
        let var = |name: &str| {
            let prefix = format!("{name}=");
            config
                .and_then(|c| c.env.as_ref())
                .and_then(|env| env.iter().find_map(|e| e.strip_prefix(prefix.as_str())))
                .map(str::to_string)
        };
        let (path, ld_library_path) = (var("PATH"), var("LD_LIBRARY_PATH"));
        let wants_driver_volume = config
            .and_then(|c| c.labels.as_ref())
            .and_then(|l| l.get(crate::volume::IMAGE_LABEL))
            .is_some_and(|v| v == "nvidia_driver");
        let env = config.and_then(|c| c.env.as_deref()).unwrap_or_default();
        ImageFacts {
            path,
            ld_library_path,
            wants_driver_volume,
            env: env.to_vec(),
        }
    }
}

/// What a daemon says of its CDI support.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DaemonCdi {
    /// Its API version, e.g. `1.47` (the newest it speaks, whatever the
    /// version gpuctl speaks to it).
    pub api_version: String,
    /// `CDISpecDirs` of `/info`, symlinks resolved: where its CDI registry
    /// reads specs; empty when CDI is off.
    pub spec_dirs: Vec<PathBuf>,
}

/// Docker takes CDI device requests from API 1.44 (Docker 25).
pub const CDI_MIN_API: (u32, u32) = (1, 44);

/// Whether an API version (`1.47`) is at least `min`.
pub fn api_at_least(version: &str, min: (u32, u32)) -> bool {
    let mut parts = version.trim().split('.').map(str::parse::<u32>);
    match (parts.next(), parts.next()) {
        (Some(Ok(major)), Some(Ok(minor))) => (major, minor) >= min,
        _ => false,
    }
}

/// The CDI device request for these devices (`HostConfig.DeviceRequests`,
/// driver `cdi`), or why the daemon cannot take it: an API before 1.44, CDI
/// not enabled, or a spec in a directory its registry does not read. PURE.
pub fn cdi_device_request(
    daemon: &DaemonCdi,
    devices: &[crate::cdi::CdiDevice],
) -> Result<DeviceRequest, String> {
    if devices.is_empty() {
        return Err("no CDI names for the task's GPUs".into());
    }
    if !api_at_least(&daemon.api_version, CDI_MIN_API) {
        return Err(format!(
            "Docker API {:?} is older than {}.{} (CDI needs Docker 25 or later)",
            daemon.api_version, CDI_MIN_API.0, CDI_MIN_API.1
        ));
    }
    if daemon.spec_dirs.is_empty() {
        return Err(
            "CDI is not enabled in Docker (no CDISpecDirs; the daemon's `cdi` feature)".into(),
        );
    }
    if let Some(d) = devices
        .iter()
        .find(|d| !daemon.spec_dirs.contains(&d.spec_dir))
    {
        return Err(format!(
            "Docker does not read CDI specs from {} ({}); its CDISpecDirs are {:?}",
            d.spec_dir.display(),
            d.name,
            daemon.spec_dirs
        ));
    }
    Ok(DeviceRequest {
        driver: Some("cdi".to_string()),
        device_ids: Some(devices.iter().map(|d| d.name.clone()).collect()),
        ..Default::default()
    })
}

/// A node a CDI device adds: a GPU's `/dev/nvidia<N>` or a MIG device's
/// `/dev/nvidia-caps/nvidia-cap<N>`, as opposed to a control node.
fn is_cdi_device_node(container_path: &str) -> bool {
    let numbered = |prefix: &str| {
        container_path
            .strip_prefix(prefix)
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    numbered("/dev/nvidia") || numbered("/dev/nvidia-caps/nvidia-cap")
}

fn container_config(
    spec: &LaunchSpec,
    image: &str,
    facts: &ImageFacts,
    driver: CgroupDriver,
    cdi: Option<&DeviceRequest>,
) -> Config<String> {
    let res = &spec.task.resources;
    let labels = HashMap::from([
        (LABEL_TASK_ID.to_string(), spec.task.task_id.clone()),
        (LABEL_JOB_ID.to_string(), spec.task.job_id.clone()),
        (LABEL_AGENT_ID.to_string(), spec.agent_id.clone()),
    ]);
    let iso = &spec.isolation;
    let volume = iso
        .driver_volume
        .as_ref()
        .filter(|_| iso.gpu_task || facts.wants_driver_volume);
    let host_config = HostConfig {
        network_mode: Some("host".to_string()),
        memory: (res.mem_mib > 0)
            .then(|| i64::try_from(res.mem_mib.saturating_mul(1024 * 1024)).unwrap_or(i64::MAX)),
        nano_cpus: (res.cpus > 0.0).then(|| (res.cpus * 1e9).round() as i64),
        // The agent's task_pids_max, whichever cgroup Docker puts it in.
        pids_limit: iso.pids_max.map(|n| i64::try_from(n).unwrap_or(i64::MAX)),
        init: Some(true),
        // The task's GPUs (a MIG device's parent and caps) and the control
        // devices, nothing else: Docker creates these nodes and allows them
        // in the container's cgroup. With CDI the GPUs and MIG devices come
        // from the request; the control nodes are passed here as well, so
        // that one that appeared since the spec was written is there (CDI
        // replaces a node passed twice).
        devices: Some(
            iso.devices
                .iter()
                .filter(|d| cdi.is_none() || !is_cdi_device_node(&d.container_path))
                .map(|d| DeviceMapping {
                    path_on_host: Some(d.host_path.display().to_string()),
                    path_in_container: Some(d.container_path.clone()),
                    cgroup_permissions: Some("rwm".to_string()),
                })
                .collect(),
        ),
        device_requests: cdi.map(|r| vec![r.clone()]),
        // cgroupfs: inside the task's cgroup, whose device rules deny the
        // other GPUs. systemd: gpuctl's slice (it takes only slices).
        cgroup_parent: match driver {
            CgroupDriver::Cgroupfs => iso.cgroup_parent.clone(),
            CgroupDriver::Systemd => Some(SYSTEMD_SLICE.to_string()),
        },
        // The driver volume and the allowed mounts: no other host path.
        binds: Some(
            volume
                .map(|v| crate::volume::docker_bind(v))
                .into_iter()
                .chain(spec.security.mounts.iter().map(|m| m.docker_bind()))
                .collect(),
        ),
        privileged: Some(false),
        cap_drop: Some(vec!["ALL".to_string()]),
        cap_add: Some(
            crate::security::CONTAINER_CAPABILITIES
                .iter()
                .map(|c| c.to_string())
                .collect(),
        ),
        security_opt: Some(vec!["no-new-privileges".to_string()]),
        runtime: iso.oci_runtime.clone(),
        ..Default::default()
    };
    let mut env = spec.env.clone();
    if volume.is_some() {
        env.extend(crate::volume::container_env_with(
            facts.path.as_deref(),
            facts.ld_library_path.as_deref(),
        ));
    }
    Config {
        image: Some(image.to_string()),
        // Empty: the image's own CMD.
        cmd: (!spec.task.command.is_empty()).then(|| spec.task.command.clone()),
        // Set explicitly, so the image's own NVIDIA_VISIBLE_DEVICES (often
        // "all") can never widen what the task was given.
        env: Some(env.iter().map(|(k, v)| format!("{k}={v}")).collect()),
        labels: Some(labels),
        // `None`: the image's user, with no more than the capabilities above.
        user: spec.security.user.map(|u| u.to_string()),
        stop_timeout: i64::try_from(spec.kill_grace.as_secs()).ok(),
        host_config: Some(host_config),
        ..Default::default()
    }
}

/// Aborts the task when dropped.
struct AbortOnDrop(JoinHandle<Result<(), RuntimeError>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How far a container's output has been copied to the task's log, as a
/// position in Docker's answer to `logs --since SINCE`: the first `skip`
/// lines of that answer were copied. Docker answers in the order lines were
/// written, and that order is not the timestamps' order: stdout and stderr
/// are stamped by two copiers before they take the log file's lock, so a
/// later-stamped stderr line can be written before an earlier stdout one. A
/// cursor of "the last timestamp copied" would drop such a line; a count in
/// the answer's own order does not.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogCursor {
    /// The container whose output this is: a task relaunched under the same
    /// name gets a new container, and its copy starts afresh.
    #[serde(default)]
    pub container: String,
    /// Whole seconds since the epoch, for Docker's `since`.
    #[serde(default)]
    pub since: i64,
    #[serde(default)]
    pub skip: u64,
}

/// How far the cursor's `since` stays behind the newest line seen: a line
/// stamped more than this before a line written ahead of it would be missed
/// by a copy resumed after a crash (never by an uninterrupted one).
const CURSOR_SLACK_S: i64 = 2;

/// Follows one answer to `logs --since`, line by line, and says which
/// lines are new and where a resumed copy should start.
#[derive(Debug)]
pub struct LogProgress {
    start: LogCursor,
    /// Lines of the answer seen so far.
    read: u64,
    /// Lines seen per second, for the seconds a later cursor may start at.
    per_sec: std::collections::BTreeMap<i64, u64>,
    newest: i64,
}

impl LogProgress {
    pub fn new(start: LogCursor) -> Self {
        LogProgress {
            newest: start.since,
            start,
            read: 0,
            per_sec: Default::default(),
        }
    }

    /// Records the next line of the answer, stamped `secs` (`None` when the
    /// stamp did not parse); whether it is to be copied.
    pub fn line(&mut self, secs: Option<i64>) -> bool {
        self.read += 1;
        let s = secs.unwrap_or(self.newest).max(self.start.since);
        self.newest = self.newest.max(s);
        *self.per_sec.entry(s).or_default() += 1;
        let floor = self.floor();
        if self.per_sec.keys().next().is_some_and(|k| *k < floor) {
            self.per_sec = self.per_sec.split_off(&floor);
        }
        self.read > self.start.skip
    }

    fn floor(&self) -> i64 {
        // Until the lines copied before are all seen again, the counts of
        // later seconds are incomplete: stay where the copy started.
        if self.read < self.start.skip {
            return self.start.since;
        }
        self.start.since.max(self.newest - CURSOR_SLACK_S)
    }

    /// Where a copy resumed now would start: the lines Docker's answer from
    /// `since` holds up to here are exactly those seen with that second or
    /// later, whatever order they came in.
    pub fn cursor(&self) -> LogCursor {
        let since = self.floor();
        let seen: u64 = self.per_sec.range(since..).map(|(_, n)| n).sum();
        LogCursor {
            container: self.start.container.clone(),
            since,
            skip: if since == self.start.since {
                seen.max(self.start.skip)
            } else {
                seen
            },
        }
    }
}

/// Seconds since the epoch of Docker's RFC 3339 timestamp
/// (`2024-05-01T12:34:56.123456789Z`, fraction of any length up to
/// nanoseconds).
pub fn timestamp_secs(ts: &str) -> Option<i64> {
    let ts = ts.strip_suffix('Z')?;
    let (secs, frac) = ts.split_once('.').unwrap_or((ts, ""));
    if secs.len() != 19 || frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    civil_secs(secs)
}

/// Seconds since the epoch of `YYYY-MM-DDTHH:MM:SS` (UTC).
fn civil_secs(key: &str) -> Option<i64> {
    let num = |r: std::ops::Range<usize>| key.get(r)?.parse::<i64>().ok();
    let (y, m, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hh, mm, ss) = (num(11..13)?, num(14..16)?, num(17..19)?);
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + hh * 3_600 + mm * 60 + ss)
}

/// Appends the container's stdout and stderr, in order, to the task's log
/// until the container stops, resuming after what an earlier copy wrote.
async fn pump_logs(rt: DockerRuntime, name: String, task: TaskRef) -> Result<(), RuntimeError> {
    let path = task.log_path.clone();
    let cursor_path = task.state_dir.join(LOG_CURSOR_FILE);
    let io_err = |source| RuntimeError::Io {
        path: path.clone(),
        source,
    };
    let docker = rt.client()?;
    let container = docker
        .inspect_container(&name, None)
        .await
        .map_err(|e| rt.err(e))?
        .id
        .unwrap_or_default();
    let start = match crate::checkpoint::read_json::<LogCursor>(&cursor_path) {
        Ok(Some(c)) if c.container == container => c,
        _ => LogCursor {
            container: container.clone(),
            ..Default::default()
        },
    };
    let mut file = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .await
        .map_err(io_err)?;
    let mut logs = docker.logs(
        &container,
        Some(LogsOptions::<String> {
            follow: true,
            stdout: true,
            stderr: true,
            timestamps: true,
            since: start.since,
            tail: "all".to_string(),
            ..Default::default()
        }),
    );
    let mut progress = LogProgress::new(start);
    // The first line after a quiet spell has its cursor saved at once.
    let mut saved = tokio::time::Instant::now()
        .checked_sub(CURSOR_SAVE)
        .unwrap_or_else(tokio::time::Instant::now);
    let mut dirty = false;
    let result = loop {
        // Output that stops flowing has its cursor saved at once, so a quiet
        // task's last lines are not copied again after an agent crash.
        let next = if dirty {
            match tokio::time::timeout(CURSOR_SAVE, logs.next()).await {
                Ok(next) => next,
                Err(_) => {
                    file.flush().await.map_err(io_err)?;
                    save_cursor(&cursor_path, &progress.cursor());
                    saved = tokio::time::Instant::now();
                    dirty = false;
                    continue;
                }
            }
        } else {
            logs.next().await
        };
        let Some(chunk) = next else {
            break Ok(());
        };
        let bytes = match chunk {
            Ok(LogOutput::StdOut { message } | LogOutput::StdErr { message })
            | Ok(LogOutput::Console { message }) => message,
            Ok(LogOutput::StdIn { .. }) => continue,
            Err(e) => break Err(rt.err(e)),
        };
        // "TIMESTAMP LINE"; a line without a stamp is copied as is.
        let split = bytes.iter().position(|b| *b == b' ');
        let stamped = split.and_then(|i| {
            std::str::from_utf8(&bytes[..i])
                .ok()
                .and_then(timestamp_secs)
                .map(|secs| (secs, &bytes[i + 1..]))
        });
        let (secs, line) = match stamped {
            Some((secs, line)) => (Some(secs), line),
            None => (None, &bytes[..]),
        };
        if !progress.line(secs) {
            continue;
        }
        file.write_all(line).await.map_err(io_err)?;
        dirty = true;
        if saved.elapsed() >= CURSOR_SAVE {
            file.flush().await.map_err(io_err)?;
            save_cursor(&cursor_path, &progress.cursor());
            saved = tokio::time::Instant::now();
            dirty = false;
        }
    };
    // tokio writes in the background; make sure it all landed.
    file.flush().await.map_err(io_err)?;
    if dirty {
        save_cursor(&cursor_path, &progress.cursor());
    }
    result
}

/// Without fsync: losing the last quarter second of cursor only repeats
/// those lines after a crash.
fn save_cursor(path: &Path, cursor: &LogCursor) {
    let tmp = path.with_extension("tmp");
    let res = serde_json::to_vec(cursor)
        .map_err(std::io::Error::other)
        .and_then(|b| std::fs::write(&tmp, b))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = res {
        tracing::warn!(path = %path.display(), error = %e, "could not save the log cursor");
    }
}

fn is_not_found(e: &BollardError) -> bool {
    matches!(
        e,
        BollardError::DockerResponseServerError {
            status_code: 404,
            ..
        }
    )
}

/// Splits `repo[:tag]` for a pull. Without a tag Docker would pull every tag,
/// so it is `latest`; a digest reference is passed whole.
fn split_reference(image: &str) -> (&str, &str) {
    if image.contains('@') {
        return (image, "");
    }
    let name_start = image.rfind('/').map_or(0, |i| i + 1);
    match image[name_start..].rfind(':') {
        Some(i) => (&image[..name_start + i], &image[name_start + i + 1..]),
        None => (image, "latest"),
    }
}

/// Connects to Docker for a test, or says why the test is skipped. With
/// `GPUCTL_REQUIRE_DOCKER=1` an unreachable daemon fails the test instead.
#[cfg(test)]
pub(crate) async fn connect_or_skip(test: &str) -> Option<DockerRuntime> {
    match DockerRuntime::connect().await {
        Ok(rt) => Some(rt),
        Err(e) if std::env::var("GPUCTL_REQUIRE_DOCKER").as_deref() == Ok("1") => {
            panic!("{test}: Docker required (GPUCTL_REQUIRE_DOCKER=1) but not reachable: {e}")
        }
        Err(e) => {
            eprintln!("{test}: skipped: Docker not reachable ({e})");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_ids_recorded_in_task_state_map_to_their_tasks() {
        let dir = tempfile::tempdir().unwrap();
        for (task, id) in [("job-1.0", "abc123"), ("job-2.0", "")] {
            let d = dir.path().join(task);
            std::fs::create_dir_all(&d).unwrap();
            record_container_id(&d, id);
        }
        std::fs::create_dir_all(dir.path().join("job-3.0")).unwrap();
        let got = recorded_container_ids(dir.path());
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got["abc123"], "job-1.0");
    }
    use std::collections::BTreeMap;
    use std::path::Path;
    use std::time::Instant;

    use gpuctl_core::types::{Resources, TaskSpec, UserIds};

    use crate::runtime::image::ensure_busybox_image;

    fn spec(dir: &Path, task_id: &str, image: &str, command: &[&str]) -> LaunchSpec {
        LaunchSpec {
            task: TaskSpec {
                share: None,
                stop_grace_ms: None,
                checkpoint_dir: None,
                task_id: task_id.to_string(),
                job_id: format!("job-{task_id}"),
                framework_id: String::new(),
                image: Some(image.to_string()),
                command: command.iter().map(|s| s.to_string()).collect(),
                env: BTreeMap::new(),
                resources: Resources {
                    cpus: 0.5,
                    mem_mib: 64,
                    gpus: 0,
                    ports: 0,
                },
                gpu_uuids: vec![],
                no_fence: false,
                security: Default::default(),
            },
            agent_id: format!("agent-{task_id}"),
            env: BTreeMap::from([("GPUCTL_TASK_ID".to_string(), task_id.to_string())]),
            sandbox: dir.to_path_buf(),
            log_path: dir.join("task.log"),
            kill_grace: Duration::from_secs(3),
            isolation: Default::default(),
            state_dir: dir.to_path_buf(),
            fence: None,
            security: Default::default(),
        }
    }

    #[test]
    fn who_gets_the_driver_volume() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spec(dir.path(), "t1", "img", &["true"]);
        s.isolation.driver_volume = Some(dir.path().join("vol"));
        let binds = |s: &LaunchSpec, facts: &ImageFacts| {
            container_config(s, "img", facts, CgroupDriver::Cgroupfs, None)
                .host_config
                .unwrap()
                .binds
                .unwrap()
                .iter()
                .any(|b| b.contains(":/usr/local/nvidia:ro"))
        };
        // No GPU, an image that says NVIDIA_VISIBLE_DEVICES=all: a CPU job.
        let all = ImageFacts {
            env: vec!["NVIDIA_VISIBLE_DEVICES=all".into()],
            ..Default::default()
        };
        assert!(!binds(&s, &all));
        // The nvidia-docker label asks for it.
        let labelled = ImageFacts {
            wants_driver_volume: true,
            ..Default::default()
        };
        assert!(binds(&s, &labelled));
        // A GPU task always gets it.
        s.isolation.gpu_task = true;
        assert!(binds(&s, &ImageFacts::default()));
    }

    #[test]
    fn the_cgroup_driver_decides_where_a_container_goes() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spec(dir.path(), "t1", "img", &["true"]);
        s.isolation.cgroup_parent = Some("/gpuctl/a/t1".into());
        let parent = |driver| {
            container_config(&s, "img", &ImageFacts::default(), driver, None)
                .host_config
                .unwrap()
                .cgroup_parent
        };
        // cgroupfs: inside the task's own cgroup (its device rules hold).
        assert_eq!(parent(CgroupDriver::Cgroupfs), Some("/gpuctl/a/t1".into()));
        // systemd takes only slices: gpuctl's.
        assert_eq!(parent(CgroupDriver::Systemd), Some("gpuctl.slice".into()));
    }

    /// Runs the task's container to its end (expecting `end`), removes it,
    /// and returns the host configuration Docker had for it.
    async fn run_and_inspect(
        rt: &DockerRuntime,
        s: &LaunchSpec,
        end: Ended,
    ) -> bollard::models::HostConfig {
        let t = s.task_ref();
        rt.start(s).await.unwrap();
        assert_eq!(rt.wait(&t).await.unwrap(), end);
        let name = container_name(&s.agent_id, &s.task.task_id);
        let info = rt
            .client()
            .unwrap()
            .inspect_container(&name, None)
            .await
            .unwrap();
        rt.remove(&t).await.unwrap();
        info.host_config.unwrap()
    }

    /// A task id no other test run uses at the same time.
    fn unique(name: &str) -> String {
        format!("rt-{name}-{}", std::process::id())
    }

    fn log_has(path: &Path, needle: &str) -> bool {
        std::fs::read_to_string(path).is_ok_and(|t| t.contains(needle))
    }

    async fn container_exists(rt: &DockerRuntime, name: &str) -> bool {
        match rt.client().unwrap().inspect_container(name, None).await {
            Ok(_) => true,
            Err(e) if is_not_found(&e) => false,
            Err(e) => panic!("inspect {name}: {e}"),
        }
    }

    fn cdi_dev(name: &str, dir: &str) -> crate::cdi::CdiDevice {
        crate::cdi::CdiDevice {
            name: name.into(),
            spec_dir: dir.into(),
        }
    }

    #[test]
    fn api_versions_compare_by_number() {
        for (v, want) in [
            ("1.44", true),
            ("1.47", true),
            ("1.100", true),
            ("2.0", true),
            ("1.43", false),
            ("1.41", false),
            ("1.4", false),
            ("", false),
            ("1", false),
            ("one.44", false),
        ] {
            assert_eq!(api_at_least(v, CDI_MIN_API), want, "{v:?}");
        }
    }

    #[test]
    fn gpus_go_through_cdi_only_when_the_daemon_reads_their_specs() {
        let run = cdi_dev("gpuctl.io/gpu=GPU-a", "/run/cdi");
        let etc = cdi_dev("nvidia.com/gpu=GPU-b", "/etc/cdi");
        let daemon = |api: &str, dirs: &[&str]| DaemonCdi {
            api_version: api.into(),
            spec_dirs: dirs.iter().map(PathBuf::from).collect(),
        };
        let both = daemon("1.47", &["/etc/cdi", "/run/cdi"]);
        let r = cdi_device_request(&both, &[run.clone(), etc.clone()]).unwrap();
        assert_eq!(
            r,
            DeviceRequest {
                driver: Some("cdi".into()),
                device_ids: Some(vec![
                    "gpuctl.io/gpu=GPU-a".into(),
                    "nvidia.com/gpu=GPU-b".into()
                ]),
                count: None,
                capabilities: None,
                options: None,
            }
        );
        for (what, d, devices, words) in [
            (
                "Docker 20.10",
                daemon("1.41", &["/etc/cdi", "/run/cdi"]),
                vec![run.clone()],
                "1.41",
            ),
            (
                "Docker 24",
                daemon("1.43", &[]),
                vec![run.clone()],
                "older than 1.44",
            ),
            (
                "CDI off",
                daemon("1.47", &[]),
                vec![run.clone()],
                "not enabled",
            ),
            (
                "a directory it does not read",
                daemon("1.47", &["/etc/cdi"]),
                vec![etc.clone(), run.clone()],
                "/run/cdi",
            ),
            ("no names", both.clone(), vec![], "no CDI names"),
        ] {
            let why = cdi_device_request(&d, &devices).unwrap_err();
            assert!(why.contains(words), "{what}: {why}");
        }
    }

    fn gpu_launch(dir: &Path, cdi: Vec<crate::cdi::CdiDevice>) -> LaunchSpec {
        use crate::isolation::DeviceNode;
        let node = |name: &str, major, minor| DeviceNode {
            host_path: dir.join(name),
            container_path: format!("/dev/{name}"),
            major,
            minor,
        };
        let mut s = spec(dir, "t-gpu", "img", &["true"]);
        s.task.gpu_uuids = vec!["GPU-a".into()];
        s.isolation = crate::runtime::TaskIsolation {
            devices: vec![
                node("nvidia1", 195, 1),
                node("nvidiactl", 195, 255),
                node("nvidia-uvm", 240, 0),
            ],
            cgroup_parent: Some("/gpuctl/a1/t-gpu".into()),
            driver_volume: Some(dir.join("volumes/nvidia_535.129.03")),
            gpu_task: true,
            cdi_devices: cdi,
            ..Default::default()
        };
        s
    }

    fn device_paths(c: &Config<String>) -> Vec<String> {
        c.host_config
            .as_ref()
            .and_then(|h| h.devices.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|d| d.path_in_container.clone())
            .collect()
    }

    #[test]
    fn without_cdi_the_container_config_is_the_device_one() {
        let dir = Path::new("/tmp/t");
        let s = gpu_launch(dir, vec![cdi_dev("gpuctl.io/gpu=GPU-a", "/run/cdi")]);
        let c = container_config(
            &s,
            "img",
            &ImageFacts::default(),
            CgroupDriver::Cgroupfs,
            None,
        );
        assert_eq!(
            device_paths(&c),
            ["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"]
        );
        let h = c.host_config.as_ref().unwrap();
        assert_eq!(h.device_requests, None, "nothing Docker 20.10 has not seen");
        assert_eq!(h.cgroup_parent.as_deref(), Some("/gpuctl/a1/t-gpu"));
        assert_eq!(
            h.binds.as_deref().unwrap(),
            ["/tmp/t/volumes/nvidia_535.129.03:/usr/local/nvidia:ro"]
        );
    }

    #[test]
    fn a_capped_fraction_is_created_with_the_cap_runtime_and_others_with_the_default() {
        let dir = Path::new("/tmp/t");
        let mut s = gpu_launch(dir, Vec::new());
        let config = |s: &LaunchSpec| {
            container_config(
                s,
                "img",
                &ImageFacts::default(),
                CgroupDriver::Cgroupfs,
                None,
            )
        };
        assert_eq!(config(&s).host_config.unwrap().runtime, None);
        s.isolation.oci_runtime = Some("gpuctl".into());
        assert_eq!(
            config(&s).host_config.unwrap().runtime.as_deref(),
            Some("gpuctl")
        );
        let facts = CapFacts {
            runtimes: vec!["gpuctl".into(), "runc".into()],
        };
        assert_eq!(facts.check("gpuctl"), Ok(()));
        let e = facts.check("other").unwrap_err();
        assert!(e.contains("--add-runtime other="), "{e}");
    }

    #[test]
    fn with_cdi_the_gpus_come_from_the_request_and_the_rest_stays() {
        let dir = Path::new("/tmp/t");
        let s = gpu_launch(dir, vec![cdi_dev("gpuctl.io/gpu=GPU-a", "/run/cdi")]);
        let daemon = DaemonCdi {
            api_version: "1.47".into(),
            spec_dirs: vec!["/etc/cdi".into(), "/run/cdi".into()],
        };
        let r = cdi_device_request(&daemon, &s.isolation.cdi_devices).unwrap();
        let facts = ImageFacts {
            path: Some("/opt/conda/bin:/usr/bin:/bin".into()),
            ..Default::default()
        };
        let with = container_config(&s, "img", &facts, CgroupDriver::Cgroupfs, Some(&r));
        let without = container_config(&s, "img", &facts, CgroupDriver::Cgroupfs, None);
        // The GPU's node is the request's; control nodes are passed too.
        assert_eq!(device_paths(&with), ["/dev/nvidiactl", "/dev/nvidia-uvm"]);
        let h = with.host_config.as_ref().unwrap();
        assert_eq!(h.device_requests.as_deref(), Some(&[r][..]));
        // Everything else is as without CDI: the cgroup parent, the volume
        // (a bind at the spec's mount point replaces the spec's mount), the
        // image-aware PATH, the capabilities.
        let w = without.host_config.as_ref().unwrap();
        assert_eq!(h.cgroup_parent, w.cgroup_parent);
        assert_eq!(h.binds, w.binds);
        assert_eq!(
            (&h.cap_add, &h.cap_drop, &h.security_opt),
            (&w.cap_add, &w.cap_drop, &w.security_opt)
        );
        assert_eq!(with.env, without.env);
        assert!(with
            .env
            .as_ref()
            .unwrap()
            .contains(&"PATH=/usr/local/nvidia/bin:/opt/conda/bin:/usr/bin:/bin".to_string()));
        assert!(
            is_cdi_device_node("/dev/nvidia12")
                && is_cdi_device_node("/dev/nvidia-caps/nvidia-cap30")
                && !is_cdi_device_node("/dev/nvidiactl")
                && !is_cdi_device_node("/dev/nvidia")
                && !is_cdi_device_node("/dev/nvidia-caps/nvidia-cap")
                && !is_cdi_device_node("/dev/nvidia-uvm")
        );
    }

    #[test]
    fn a_mig_container_gets_its_parent_and_caps_by_device_or_by_cdi() {
        use crate::isolation::DeviceNode;
        let dir = Path::new("/tmp/t");
        let mut s = gpu_launch(dir, vec![cdi_dev("gpuctl.io/gpu=MIG-a", "/run/cdi")]);
        s.task.gpu_uuids = vec!["MIG-a".into()];
        let cap = |n: u32| DeviceNode {
            host_path: dir.join(format!("nvidia-caps/nvidia-cap{n}")),
            container_path: format!("/dev/nvidia-caps/nvidia-cap{n}"),
            major: 240,
            minor: n,
        };
        s.isolation.devices.insert(1, cap(30));
        s.isolation.devices.insert(2, cap(31));
        let without = container_config(
            &s,
            "img",
            &ImageFacts::default(),
            CgroupDriver::Cgroupfs,
            None,
        );
        assert_eq!(
            device_paths(&without),
            [
                "/dev/nvidia1",
                "/dev/nvidia-caps/nvidia-cap30",
                "/dev/nvidia-caps/nvidia-cap31",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm"
            ]
        );
        let daemon = DaemonCdi {
            api_version: "1.47".into(),
            spec_dirs: vec!["/run/cdi".into()],
        };
        let r = cdi_device_request(&daemon, &s.isolation.cdi_devices).unwrap();
        assert_eq!(
            r.device_ids.as_deref(),
            Some(&["gpuctl.io/gpu=MIG-a".to_string()][..])
        );
        let with = container_config(
            &s,
            "img",
            &ImageFacts::default(),
            CgroupDriver::Cgroupfs,
            Some(&r),
        );
        // The parent and the caps are the CDI device's.
        assert_eq!(device_paths(&with), ["/dev/nvidiactl", "/dev/nvidia-uvm"]);
    }

    #[test]
    fn references_are_split_for_pulls() {
        assert_eq!(split_reference("busybox"), ("busybox", "latest"));
        assert_eq!(split_reference("busybox:1.36"), ("busybox", "1.36"));
        assert_eq!(
            split_reference("localhost:5000/team/img"),
            ("localhost:5000/team/img", "latest")
        );
        assert_eq!(
            split_reference("localhost:5000/team/img:v2"),
            ("localhost:5000/team/img", "v2")
        );
        assert_eq!(split_reference("img@sha256:abc"), ("img@sha256:abc", ""));
    }

    /// Starts the task, follows it to its end, removes the container.
    async fn run_to_end(rt: &DockerRuntime, s: &LaunchSpec) -> Result<Ended, RuntimeError> {
        let t = s.task_ref();
        rt.start(s).await?;
        let ended = rt.wait(&t).await?;
        rt.remove(&t).await?;
        Ok(ended)
    }

    fn exited(code: i32) -> Ended {
        Ended {
            code: Some(code),
            ..Default::default()
        }
    }

    #[test]
    fn docker_timestamps_convert_to_seconds() {
        // 2024-05-01T12:34:56Z is 1714566896.
        assert_eq!(timestamp_secs("2024-05-01T12:34:56Z"), Some(1_714_566_896));
        assert_eq!(
            timestamp_secs("2024-05-01T12:34:56.123456789Z"),
            Some(1_714_566_896)
        );
        assert_eq!(
            timestamp_secs("2024-03-01T00:00:00.5Z"),
            Some(1_709_251_200)
        );
        assert_eq!(timestamp_secs("garbage"), None);
        assert_eq!(timestamp_secs("2024-05-01T12:34:56.1234567890Z"), None);
        assert_eq!(timestamp_secs("2024-05-01T12:34:56.12a4Z"), None);
    }

    /// Docker's answer to `logs --since S`: the lines stamped S or later, in
    /// the order they were written.
    fn answer(file: &[(i64, u32)], since: i64) -> Vec<(i64, u32)> {
        file.iter().copied().filter(|(t, _)| *t >= since).collect()
    }

    /// Copies `lines` of one answer from `start`; what was copied and the
    /// cursor after each line.
    fn copy(start: LogCursor, lines: &[(i64, u32)]) -> (Vec<u32>, Vec<LogCursor>) {
        let mut p = LogProgress::new(start);
        let mut copied = Vec::new();
        let mut cursors = Vec::new();
        for (t, id) in lines {
            if p.line(Some(*t)) {
                copied.push(*id);
            }
            cursors.push(p.cursor());
        }
        (copied, cursors)
    }

    #[test]
    fn a_line_stamped_before_one_written_ahead_of_it_is_copied() {
        // stderr stamped 11 but written before stdout stamped 10 (seen in CI:
        // the stdout line was dropped by a cursor of timestamps).
        let file = [(10, 1), (11, 3), (10, 2), (12, 4)];
        let (copied, _) = copy(LogCursor::default(), &answer(&file, 0));
        assert_eq!(copied, vec![1, 3, 2, 4]);
    }

    #[test]
    fn a_copy_resumed_anywhere_copies_every_line_once() {
        // Seconds out of order by up to the slack, runs of one second, and
        // a long gap that moves the cursor on.
        let file: Vec<(i64, u32)> = [
            100, 100, 101, 100, 102, 101, 103, 103, 105, 104, 104, 200, 199, 200, 201, 199, 202,
            202,
        ]
        .into_iter()
        .zip(1..)
        .collect();
        let all: Vec<u32> = file.iter().map(|(_, id)| *id).collect();
        // Crash after k lines, resume (possibly crashing again after j more).
        for k in 0..=file.len() {
            let (first, cursors) = copy(LogCursor::default(), &answer(&file, 0)[..k]);
            let c = cursors.last().cloned().unwrap_or_default();
            let rest = answer(&file, c.since);
            assert!(c.skip as usize <= rest.len(), "k={k} {c:?}");
            for j in 0..=rest.len() {
                let (second, cursors2) = copy(c.clone(), &rest[..j]);
                let c2 = cursors2.last().cloned().unwrap_or(c.clone());
                let (third, _) = copy(c2.clone(), &answer(&file, c2.since));
                let mut got = first.clone();
                got.extend(&second);
                got.extend(&third);
                assert_eq!(got, all, "k={k} j={j} cursors {c:?} {c2:?}");
            }
        }
        // The cursor moves on: after the whole file it starts near the end.
        let (_, cursors) = copy(LogCursor::default(), &file);
        let last = cursors.last().unwrap();
        assert_eq!(last.since, 200);
        assert_eq!(last.skip, 5);
    }

    #[tokio::test]
    async fn docker_exit_code_and_output() {
        let Some(rt) = connect_or_skip("docker_exit_code_and_output").await else {
            return;
        };
        let image = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let task_id = unique("exit7");
        let s = spec(
            dir.path(),
            &task_id,
            &image,
            &[
                "sh",
                "-c",
                "echo out; echo err >&2; echo id=$GPUCTL_TASK_ID; exit 7",
            ],
        );
        let log = s.log_path.clone();
        assert_eq!(run_to_end(&rt, &s).await.unwrap(), exited(7));
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(text.contains("out\n"), "{text}");
        assert!(text.contains("err\n"), "{text}");
        assert!(text.contains(&format!("id={task_id}")), "{text}");
        assert!(
            !container_exists(&rt, &container_name(&format!("agent-{task_id}"), &task_id)).await
        );
    }

    #[tokio::test]
    async fn docker_exit_zero() {
        let Some(rt) = connect_or_skip("docker_exit_zero").await else {
            return;
        };
        let image = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let s = spec(dir.path(), &unique("exit0"), &image, &["true"]);
        assert_eq!(run_to_end(&rt, &s).await.unwrap(), exited(0));
    }

    #[tokio::test]
    async fn docker_stop_labels_and_removal() {
        let Some(rt) = connect_or_skip("docker_stop_labels_and_removal").await else {
            return;
        };
        let image = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let task_id = unique("kill");
        let s = spec(dir.path(), &task_id, &image, &["sleep", "300"]);
        let grace = s.kill_grace;
        let name = container_name(&format!("agent-{task_id}"), &task_id);
        let t = s.task_ref();
        rt.start(&s).await.unwrap();
        assert_eq!(rt.observe(&t).await.unwrap(), Observed::Running);
        assert_eq!(rt.list(&s.agent_id).await.unwrap(), vec![task_id.clone()]);

        let info = rt
            .client()
            .unwrap()
            .inspect_container(&name, None)
            .await
            .unwrap();
        let labels = info.config.and_then(|c| c.labels).unwrap();
        assert_eq!(labels.get(LABEL_TASK_ID), Some(&task_id));
        assert_eq!(labels.get(LABEL_JOB_ID), Some(&format!("job-{task_id}")));
        assert_eq!(
            labels.get(LABEL_AGENT_ID),
            Some(&format!("agent-{task_id}"))
        );
        let host = info.host_config.unwrap();
        assert_eq!(host.network_mode.as_deref(), Some("host"));
        assert_eq!(host.memory, Some(64 * 1024 * 1024));
        assert_eq!(host.nano_cpus, Some(500_000_000));
        assert_eq!(info.state.and_then(|s| s.running), Some(true));

        let started = Instant::now();
        rt.stop(&t, grace).await.unwrap();
        let ended = rt.wait(&t).await.unwrap();
        // `sleep` as a child of docker-init dies of the SIGTERM.
        assert_eq!(ended.code, Some(143), "{ended:?}");
        assert!(
            started.elapsed() < grace,
            "stop took {:?}, grace {grace:?}",
            started.elapsed()
        );
        assert!(matches!(rt.observe(&t).await.unwrap(), Observed::Ended(_)));
        rt.remove(&t).await.unwrap();
        assert!(!container_exists(&rt, &name).await);
        assert_eq!(rt.observe(&t).await.unwrap(), Observed::NotStarted);
    }

    /// A task is started at most once, whoever asks: a second start of a
    /// running or ended task changes nothing.
    #[tokio::test]
    async fn docker_start_is_idempotent() {
        let Some(rt) = connect_or_skip("docker_start_is_idempotent").await else {
            return;
        };
        let image = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let task_id = unique("once");
        let s = spec(dir.path(), &task_id, &image, &["sh", "-c", "echo ran-once"]);
        let t = s.task_ref();
        rt.start(&s).await.unwrap();
        assert_eq!(rt.wait(&t).await.unwrap(), exited(0));
        rt.start(&s).await.unwrap();
        assert_eq!(rt.wait(&t).await.unwrap(), exited(0));
        let text = std::fs::read_to_string(&s.log_path).unwrap();
        assert_eq!(text.matches("ran-once").count(), 1, "{text}");
        rt.remove(&t).await.unwrap();
    }

    /// What a restarted agent does: a new runtime value finds the running
    /// container by name, follows it to its end and copies each line of its
    /// output exactly once, though an earlier copy already wrote some.
    #[tokio::test]
    async fn docker_reattach_copies_each_line_once() {
        let Some(rt) = connect_or_skip("docker_reattach_copies_each_line_once").await else {
            return;
        };
        let image = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let task_id = unique("reattach");
        let s = spec(
            dir.path(),
            &task_id,
            &image,
            &[
                "sh",
                "-c",
                "for i in 1 2 3 4 5 6; do echo line-$i; sleep 0.4; done; exit 4",
            ],
        );
        let t = s.task_ref();
        rt.start(&s).await.unwrap();
        // The first agent copies part of the output, then dies.
        let first = tokio::spawn({
            let rt = rt.clone();
            let t = t.clone();
            async move { rt.wait(&t).await }
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while !log_has(&s.log_path, "line-2") {
            assert!(Instant::now() < deadline, "no output copied");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        first.abort();
        let _ = first.await;
        // The next one takes over.
        let rt2 = DockerRuntime::connect().await.unwrap();
        assert_eq!(rt2.observe(&t).await.unwrap(), Observed::Running);
        assert_eq!(rt2.wait(&t).await.unwrap(), exited(4));
        let text = std::fs::read_to_string(&s.log_path).unwrap();
        for i in 1..=6 {
            assert_eq!(
                text.matches(&format!("line-{i}\n")).count(),
                1,
                "line-{i} in {text:?}"
            );
        }
        rt2.remove(&t).await.unwrap();
    }

    /// With `init: true` the container does start (the init is its process);
    /// the init then fails to exec the command and exits 127, like a shell.
    #[tokio::test]
    async fn docker_missing_command_exits_127() {
        let Some(rt) = connect_or_skip("docker_missing_command_exits_127").await else {
            return;
        };
        let image = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let task_id = unique("nocmd");
        let s = spec(dir.path(), &task_id, &image, &["/no/such/program"]);
        let log = s.log_path.clone();
        assert_eq!(run_to_end(&rt, &s).await.unwrap(), exited(127));
        assert!(
            log_has(&log, "/no/such/program"),
            "{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    #[tokio::test]
    async fn docker_missing_image_is_image_error() {
        let Some(rt) = connect_or_skip("docker_missing_image_is_image_error").await else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let image = "gpuctl/no-such-image-for-tests:never";
        let s = spec(dir.path(), &unique("noimage"), image, &["true"]);
        match rt.start(&s).await {
            Err(RuntimeError::Image { image: got, .. }) => assert_eq!(got, image),
            other => panic!("expected an Image error, got {other:?}"),
        }
        assert_eq!(
            rt.observe(&s.task_ref()).await.unwrap(),
            Observed::NotStarted
        );
    }

    /// What a container may do is ours, whatever its image: not privileged,
    /// only the default capabilities, no new privileges, the job's user,
    /// and no host path but the mounts the agent allowed, read-only unless
    /// asked otherwise.
    #[tokio::test]
    async fn docker_gpu_task_with_cdi_names_falls_back_to_devices_here() {
        // The daemon's answers are read for real; its CDI registry does not
        // read the (temporary) spec directory named here, so on any Docker
        // (20.10 here: API 1.41) the GPU goes with --device, as before CDI.
        let Some(rt) =
            connect_or_skip("docker_gpu_task_with_cdi_names_falls_back_to_devices_here").await
        else {
            return;
        };
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: mknod needs root");
            return;
        }
        let daemon = rt.daemon_cdi().await.unwrap();
        assert!(api_at_least(&daemon.api_version, (1, 24)), "{daemon:?}");
        let image = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let dev = dir.path().join("dev");
        std::fs::create_dir_all(&dev).unwrap();
        for (name, minor) in [("nvidia1", 1), ("nvidiactl", 255)] {
            nix::sys::stat::mknod(
                &dev.join(name),
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(195, minor),
            )
            .unwrap();
        }
        let mut s = gpu_launch(
            &dev,
            vec![cdi_dev(
                "gpuctl.io/gpu=GPU-a",
                dir.path().join("cdi").to_str().unwrap(),
            )],
        );
        s.isolation.devices.truncate(2);
        s.isolation.cgroup_parent = None;
        s.isolation.driver_volume = None;
        s.task.task_id = unique("cdi-fallback");
        s.task.image = Some(image.clone());
        s.task.command = ["sh", "-c", "ls /dev; cat /dev/nvidia1"]
            .iter()
            .map(|a| a.to_string())
            .collect();
        s.sandbox = dir.path().to_path_buf();
        s.state_dir = dir.path().to_path_buf();
        s.log_path = dir.path().join("task.log");
        let host = run_and_inspect(&rt, &s, exited(1)).await;
        assert!(
            host.device_requests.unwrap_or_default().is_empty(),
            "no CDI request"
        );
        let devices: Vec<String> = host
            .devices
            .unwrap_or_default()
            .into_iter()
            .filter_map(|d| d.path_in_container)
            .collect();
        assert_eq!(devices, ["/dev/nvidia1", "/dev/nvidiactl"]);
        let text = std::fs::read_to_string(&s.log_path).unwrap();
        assert!(text.contains("nvidia1\n"), "{text}");
        assert!(text.contains("No such device or address"), "{text}");
        let way = rt.gpu_path.lock().unwrap().clone().unwrap();
        assert!(way.starts_with("--device, not CDI: "), "{way}");
    }

    #[tokio::test]
    async fn docker_containers_get_no_more_than_the_default_set() {
        use crate::security::{BindMount, CONTAINER_CAPABILITIES};
        let Some(rt) = connect_or_skip("docker_containers_get_no_more_than_the_default_set").await
        else {
            return;
        };
        let image = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (ro, rw) = (dir.path().join("ro"), dir.path().join("rw"));
        std::fs::create_dir_all(&ro).unwrap();
        std::fs::create_dir_all(&rw).unwrap();
        std::fs::write(ro.join("f"), "from-the-host\n").unwrap();
        let script = "grep -E '^(CapEff|NoNewPrivs):' /proc/self/status; id -u; id -g; \
             cat /in/f; touch /in/x 2>/dev/null && echo ro-written || echo ro-refused; \
             touch /out/x 2>/dev/null && echo rw-written || echo rw-refused";
        let mounts = vec![
            BindMount {
                host_path: ro.clone(),
                container_path: "/in".into(),
                read_only: true,
            },
            BindMount {
                host_path: rw.clone(),
                container_path: "/out".into(),
                read_only: false,
            },
        ];
        let run = |name: &str, user: Option<UserIds>| {
            let mut s = spec(dir.path(), &unique(name), &image, &["sh", "-c", script]);
            s.log_path = dir.path().join(format!("{name}.log"));
            s.security = crate::security::LaunchSecurity {
                user,
                mounts: mounts.clone(),
                ..Default::default()
            };
            s
        };
        // The image's user (root in the container).
        let s = run("caps", None);
        let host = run_and_inspect(&rt, &s, exited(0)).await;
        assert_eq!(host.privileged, Some(false));
        assert_eq!(host.cap_drop, Some(vec!["ALL".to_string()]));
        let caps: Vec<String> = CONTAINER_CAPABILITIES
            .iter()
            .map(|c| c.to_string())
            .collect();
        assert_eq!(host.cap_add, Some(caps));
        assert_eq!(
            host.security_opt,
            Some(vec!["no-new-privileges".to_string()])
        );
        assert_eq!(
            host.binds,
            Some(vec![
                format!("{}:/in:ro", ro.display()),
                format!("{}:/out:rw", rw.display())
            ])
        );
        let text = std::fs::read_to_string(&s.log_path).unwrap();
        // CHOWN 0, DAC_OVERRIDE 1, FOWNER 3, FSETID 4, KILL 5, SETGID 6,
        // SETUID 7, SETPCAP 8, SYS_CHROOT 18.
        assert!(text.contains("CapEff:\t00000000000401fb\n"), "{text}");
        assert!(text.contains("NoNewPrivs:\t1\n"), "{text}");
        assert!(text.contains("0\n0\nfrom-the-host\n"), "{text}");
        assert!(text.contains("ro-refused\n"), "{text}");
        assert!(text.contains("rw-written\n"), "{text}");
        assert!(!ro.join("x").exists());

        // A user of the job's: no capability in effect.
        let s = run(
            "user",
            Some(UserIds {
                uid: 1234,
                gid: 1234,
            }),
        );
        assert_eq!(run_to_end(&rt, &s).await.unwrap(), exited(0));
        let text = std::fs::read_to_string(&s.log_path).unwrap();
        assert!(text.contains("CapEff:\t0000000000000000\n"), "{text}");
        assert!(text.contains("1234\n1234\nfrom-the-host\n"), "{text}");
        assert!(text.contains("ro-refused\n"), "{text}");
        // /out is root's: the job's user may not write it. (Its stderr is
        // silenced: Docker may order another stream's lines before it.)
        assert!(text.contains("rw-refused\n"), "{text}");
    }

    /// A job's user runs with its group and no other, whatever the image's
    /// `/etc/group` says of it: Docker adds an image's supplementary groups
    /// only for a user given without a group, and the agent always gives
    /// both (`UID` is `UID:UID`).
    #[tokio::test]
    async fn docker_a_jobs_user_gets_no_groups_from_its_image() {
        let Some(rt) = connect_or_skip("docker_a_jobs_user_gets_no_groups_from_its_image").await
        else {
            return;
        };
        let base = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
        let image = "gpuctl-test/image-groups:1";
        build_image(
            &base,
            image,
            &[
                "RUN echo 'alice:x:2001:2001::/:/bin/sh' >> /etc/passwd && \\",
                "    echo 'alice:x:2001:' >> /etc/group && \\",
                "    echo 'shadow:x:42:alice' >> /etc/group && echo 'disk:x:6:alice' >> /etc/group",
            ],
        );
        let dir = tempfile::tempdir().unwrap();
        let mut s = spec(
            dir.path(),
            &unique("groups"),
            image,
            &["sh", "-c", "id -u; id -G"],
        );
        s.security.user = Some(UserIds {
            uid: 2001,
            gid: 2001,
        });
        assert_eq!(run_to_end(&rt, &s).await.unwrap(), exited(0));
        let text = std::fs::read_to_string(&s.log_path).unwrap();
        assert_eq!(text, "2001\n2001\n");
    }

    /// What an image's config says of the driver, as bollard reads it.
    fn inspect(env: &[&str], labels: &[(&str, &str)]) -> bollard::models::ImageInspect {
        bollard::models::ImageInspect {
            config: Some(bollard::models::ImageConfig {
                env: Some(env.iter().map(|e| e.to_string()).collect()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    const REQUIRE_12_2: &str =
        "NVIDIA_REQUIRE_CUDA=cuda>=12.2 brand=tesla,driver>=470,driver<471 brand=tesla,driver>=525,driver<526";

    fn host(driver: &str, cuda: &str) -> HostDriver {
        HostDriver {
            version: Some(driver.into()),
            cuda: Some(cuda.into()),
        }
    }

    #[test]
    fn the_host_driver_is_checked_against_the_image_requirements() {
        let facts = ImageFacts::from(&inspect(
            &[
                "PATH=/usr/bin",
                REQUIRE_12_2,
                "NVIDIA_REQUIRE_ARCH=arch>=7.0",
            ],
            &[("com.nvidia.volumes.needed", "nvidia_driver")],
        ));
        assert!(facts.wants_driver_volume);
        let img = "cuda:12.2";
        let none = BTreeMap::new();
        assert_eq!(
            check_driver(img, &facts, &none, &host("535.129.03", "12.2"))
                .map_err(|e| e.to_string()),
            Ok(())
        );
        // Forward compatibility: the 525 branch (brand unknown here).
        assert!(check_driver(img, &facts, &none, &host("525.60.13", "12.0")).is_ok());
        // Unknown versions (simulated GPUs, no NVML): nothing to check.
        assert!(check_driver(img, &facts, &none, &HostDriver::default()).is_ok());
        match check_driver(img, &facts, &none, &host("510.47.03", "11.6")) {
            Err(RuntimeError::DriverRequirement {
                image,
                unmet,
                host,
                requires,
            }) => {
                assert_eq!(image, img);
                assert_eq!(unmet, "NVIDIA_REQUIRE_CUDA=cuda>=12.2 (+2 alternatives)");
                assert_eq!(host, "driver 510.47.03, CUDA 11.6");
                // All of them, in full: the master learns what the image needs.
                assert_eq!(
                    requires,
                    [
                        "arch>=7.0",
                        REQUIRE_12_2.trim_start_matches("NVIDIA_REQUIRE_CUDA=")
                    ]
                );
            }
            other => panic!("{other:?}"),
        }
        let e = check_driver(img, &facts, &none, &host("510.47.03", "11.6")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "image cuda:12.2 requires NVIDIA_REQUIRE_CUDA=cuda>=12.2 (+2 alternatives) of the \
             NVIDIA driver; this agent has driver 510.47.03, CUDA 11.6"
        );
        // Disabled, as NVIDIA's toolkit allows.
        let off = ImageFacts::from(&inspect(
            &[REQUIRE_12_2, "NVIDIA_DISABLE_REQUIRE=true"],
            &[],
        ));
        assert!(check_driver(img, &off, &none, &host("450.80.02", "11.0")).is_ok());
        // Malformed: refused with the variable named, whatever the driver.
        let bad = ImageFacts::from(&inspect(&["NVIDIA_REQUIRE_CUDA=cuda>=12.2,drivr>=1"], &[]));
        match check_driver(img, &bad, &none, &host("535.129.03", "12.2")) {
            Err(RuntimeError::Image { reason, .. }) => {
                assert!(
                    reason.contains("NVIDIA_REQUIRE_CUDA: \"drivr>=1\": unknown key"),
                    "{reason}"
                )
            }
            other => panic!("{other:?}"),
        }
        // The task's environment overrides the image's, as `docker run -e`.
        let old = host("450.80.02", "11.0");
        let env = |k: &str, v: &str| BTreeMap::from([(k.to_string(), v.to_string())]);
        assert!(check_driver(img, &facts, &env("NVIDIA_DISABLE_REQUIRE", "1"), &old).is_ok());
        assert!(check_driver(img, &facts, &env("NVIDIA_REQUIRE_CUDA", "cuda>=11.0"), &old).is_ok());
        assert!(check_driver(
            img,
            &ImageFacts::default(),
            &env("NVIDIA_REQUIRE_X", "driver>=535"),
            &old
        )
        .is_err());
        // No image config at all: nothing required.
        let empty = ImageFacts::from(&bollard::models::ImageInspect::default());
        assert_eq!(empty, ImageFacts::default());
        assert!(check_driver(img, &empty, &none, &old).is_ok());
    }

    /// `docker build` of a local image from `base` with these Dockerfile
    /// lines (no registry: the base is the local busybox).
    fn build_image(base: &str, tag: &str, lines: &[&str]) {
        use std::io::Write;
        let dockerfile = format!("FROM {base}\n{}\n", lines.join("\n"));
        let mut build = std::process::Command::new("docker")
            .args(["build", "-q", "-t", tag, "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        build
            .stdin
            .take()
            .unwrap()
            .write_all(dockerfile.as_bytes())
            .unwrap();
        assert!(build.wait().unwrap().success(), "docker build of {tag}");
    }

    /// A container that gets the driver (it holds GPUs, or its image asks
    /// for the volume) is refused before it is made when the host's driver
    /// does not meet the image's NVIDIA_REQUIRE_CUDA; others are not
    /// checked. An image with the volume label and a requirement it meets
    /// gets the volume.
    #[tokio::test]
    async fn docker_refuses_an_image_the_driver_is_too_old_for() {
        let Some(rt) = connect_or_skip("docker_refuses_an_image_the_driver_is_too_old_for").await
        else {
            return;
        };
        let base = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
        let plain = "gpuctl-test/cuda-require:12.2";
        let labelled = "gpuctl-test/cuda-require-volume:12.2";
        let env = format!("ENV {}", REQUIRE_12_2.replacen('=', "=\"", 1) + "\"");
        build_image(&base, plain, &[&env]);
        build_image(
            &base,
            labelled,
            &[&env, "LABEL com.nvidia.volumes.needed=nvidia_driver"],
        );
        let dir = tempfile::tempdir().unwrap();
        let volume = dir.path().join("nvidia_535.129.03");
        std::fs::create_dir_all(volume.join("lib64")).unwrap();
        std::fs::write(volume.join("lib64/libnvidia-ml.so.1"), "").unwrap();
        let launch = |name: &str, image: &str, gpu_task: bool, driver: HostDriver| {
            let mut s = spec(
                dir.path(),
                &unique(name),
                image,
                &["sh", "-c", "ls /usr/local/nvidia/lib64 2>&1; echo done"],
            );
            s.log_path = dir.path().join(format!("{name}.log"));
            s.isolation.gpu_task = gpu_task;
            s.isolation.driver = driver;
            s.isolation.driver_volume = Some(volume.clone());
            s
        };
        let old = || host("510.47.03", "11.6");
        // A GPU task on an old driver: refused, no container made.
        let s = launch("gpu-old", plain, true, old());
        match rt.start(&s).await {
            Err(RuntimeError::DriverRequirement { requires, .. }) => {
                assert_eq!(requires.len(), 1);
                assert!(requires[0].starts_with("cuda>=12.2 "), "{requires:?}");
            }
            other => panic!("expected a DriverRequirement refusal, got {other:?}"),
        }
        let name = container_name(&s.agent_id, &s.task.task_id);
        assert!(!container_exists(&rt, &name).await);
        assert_eq!(
            rt.observe(&s.task_ref()).await.unwrap(),
            Observed::NotStarted
        );
        // The label alone gets the driver too: checked, refused.
        let s = launch("label-old", labelled, false, old());
        assert!(matches!(
            rt.start(&s).await,
            Err(RuntimeError::DriverRequirement { .. })
        ));
        // No GPU, no label: NVIDIA's hook would not touch it; neither do we.
        let s = launch("cpu-old", plain, false, old());
        assert_eq!(run_to_end(&rt, &s).await.unwrap(), exited(0));
        let text = std::fs::read_to_string(&s.log_path).unwrap();
        assert!(!text.contains("libnvidia-ml.so.1"), "{text}");
        // A new enough driver: the labelled image runs with the volume.
        let s = launch("label-new", labelled, false, host("535.129.03", "12.2"));
        assert_eq!(run_to_end(&rt, &s).await.unwrap(), exited(0));
        let text = std::fs::read_to_string(&s.log_path).unwrap();
        assert!(text.contains("libnvidia-ml.so.1\ndone"), "{text}");
    }

    /// A daemon that does not answer is an outage, not a task failure.
    #[tokio::test]
    async fn docker_unreachable_daemon_is_unavailable() {
        let rt = DockerRuntime::with_socket("unix:///nonexistent/gpuctl-test.sock".into()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let s = spec(dir.path(), &unique("down"), "busybox", &["true"]);
        let err = rt.observe(&s.task_ref()).await.unwrap_err();
        assert!(err.is_unavailable(), "{err:?}");
        assert!(!rt.status().available);
        assert!(rt.start(&s).await.unwrap_err().is_unavailable());
    }
}
