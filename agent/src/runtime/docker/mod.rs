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
    CreateContainerOptions, ListContainersOptions, RemoveContainerOptions, StopContainerOptions,
    WaitContainerOptions,
};
use bollard::errors::Error as BollardError;
use bollard::image::CreateImageOptions;
use bollard::models::{ContainerStateStatusEnum, DeviceRequest};
use bollard::{ClientVersion, Docker};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use gpuctl_core::time::Backoff;
use gpuctl_core::types::Runtime;

use super::{
    fence, ContainerRuntime, Ended, LaunchSpec, Observed, RuntimeError, RuntimeStatus, TaskRef,
    LABEL_AGENT_ID, LABEL_TASK_ID,
};

mod config;
mod follow;
mod images;
mod logs;

pub use config::*;
pub use logs::*;

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

/// A transport failure (the daemon does not answer) as opposed to an
/// answer from the daemon.
/// Now, in seconds since the epoch (Docker's timestamps have that scale).
fn unix_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

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
        let Some(image) = spec.task.template.image.as_deref() else {
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

    /// `docker stop`: SIGTERM, SIGKILL after `grace`.
    /// `sh -c command` in the task's container (`docker exec`: its user,
    /// env and namespaces). One past its timeout is left to end by itself
    /// (Docker cannot kill an exec), as Kubernetes' exec probes are.
    async fn exec_in(
        &self,
        task: &TaskRef,
        command: &str,
        timeout: Duration,
    ) -> Result<super::ExecOutput, RuntimeError> {
        use bollard::exec::{CreateExecOptions, StartExecResults};
        let name = container_name(&task.agent_id, &task.task_id);
        let docker = self.client()?;
        let run = async {
            let created = docker
                .create_exec(
                    &name,
                    CreateExecOptions {
                        cmd: Some(vec!["sh", "-c", command]),
                        attach_stdout: Some(true),
                        attach_stderr: Some(true),
                        ..Default::default()
                    },
                )
                .await
                .map_err(|e| self.err(e))?;
            let mut out = Vec::new();
            if let StartExecResults::Attached { mut output, .. } = docker
                .start_exec(&created.id, None)
                .await
                .map_err(|e| self.err(e))?
            {
                while let Some(chunk) = output.next().await {
                    let chunk = chunk.map_err(|e| self.err(e))?;
                    if out.len() < super::EXEC_OUTPUT_MAX {
                        out.extend_from_slice(&chunk.into_bytes());
                    }
                }
            }
            let done = docker
                .inspect_exec(&created.id)
                .await
                .map_err(|e| self.err(e))?;
            let code = done.exit_code.map(|c| i32::try_from(c).unwrap_or(i32::MAX));
            Ok(super::ExecOutput::new(code, &out))
        };
        match tokio::time::timeout(timeout, run).await {
            Ok(r) => r,
            Err(_) => Ok(super::ExecOutput::new(None, b"")),
        }
    }

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
        // An answer: the daemon is back. This scan runs every few seconds
        // whatever the agent runs, so an agent with no container learns
        // it too (it would report Docker down until its next container).
        self.set_health(true, String::new());
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

    fn exec<'a>(
        &'a self,
        task: &'a TaskRef,
        command: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<super::ExecOutput, RuntimeError>> {
        self.exec_in(task, command, timeout).boxed()
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

fn is_not_found(e: &BollardError) -> bool {
    matches!(
        e,
        BollardError::DockerResponseServerError {
            status_code: 404,
            ..
        }
    )
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
mod tests;
