//! Docker runtime: one container per task, through the Docker Engine API
//! (bollard).
//!
//! Containers use the host network (agents may run Docker without a bridge)
//! and `init: true`, so that the task's command is not PID 1 and gets the
//! default SIGTERM behaviour when the container is stopped.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use bollard::container::{
    Config, CreateContainerOptions, ListContainersOptions, LogsOptions, RemoveContainerOptions,
    StopContainerOptions, WaitContainerOptions,
};
use bollard::errors::Error as BollardError;
use bollard::image::CreateImageOptions;
use bollard::models::{DeviceMapping, HostConfig};
use bollard::{ClientVersion, Docker};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use gpuctl_proto::types::Runtime;
use tokio::io::AsyncWriteExt;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use super::{
    ContainerRuntime, LaunchSpec, RuntimeError, TaskExit, LABEL_AGENT_ID, LABEL_JOB_ID,
    LABEL_TASK_ID,
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
/// How long the output may keep flowing after the container has ended.
const LOG_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs tasks as Docker containers named `gpuctl-<agent_id>-<task_id>`.
#[derive(Debug, Clone)]
pub struct DockerRuntime {
    docker: Docker,
    /// With the cgroupfs driver containers can be put inside the task's
    /// cgroup; the systemd driver only takes slices, so there Docker's own
    /// device rules are the only ones (see docs/isolation.md).
    cgroupfs: bool,
}

impl DockerRuntime {
    /// Connects to the local daemon (`DOCKER_HOST` if it is a `unix://`
    /// address, else `/var/run/docker.sock`) and checks that it answers.
    pub async fn connect() -> Result<DockerRuntime, RuntimeError> {
        let addr = std::env::var("DOCKER_HOST")
            .ok()
            .filter(|h| h.starts_with("unix://"))
            .unwrap_or_else(|| DEFAULT_SOCKET.to_string());
        let unreachable =
            |reason: String| RuntimeError::Other(format!("docker at {addr}: {reason}"));
        let docker = Docker::connect_with_local(&addr, REQUEST_TIMEOUT_S, &API_VERSION)
            .map_err(|e| unreachable(e.to_string()))?;
        let docker = tokio::time::timeout(PING_TIMEOUT, async {
            let docker = docker.negotiate_version().await?;
            docker.ping().await?;
            Ok::<_, BollardError>(docker)
        })
        .await
        .map_err(|_| unreachable(format!("no answer within {PING_TIMEOUT:?}")))?
        .map_err(|e| unreachable(e.to_string()))?;
        let driver = docker
            .info()
            .await
            .map_err(|e| unreachable(e.to_string()))?
            .cgroup_driver
            .map(|d| d.to_string())
            .unwrap_or_default();
        let cgroupfs = driver == "cgroupfs";
        if !cgroupfs {
            tracing::warn!(cgroup_driver = %driver, "Docker does not use the cgroupfs driver: containers are not placed in the task's cgroup and rely on Docker's own device rules");
        }
        Ok(DockerRuntime { docker, cgroupfs })
    }

    pub fn client(&self) -> &Docker {
        &self.docker
    }

    /// Makes sure `image` is present locally, pulling it if not, and reads
    /// what the container's configuration depends on.
    async fn ensure_image(&self, image: &str) -> Result<ImageFacts, RuntimeError> {
        match self.docker.inspect_image(image).await {
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
        let mut pull = self.docker.create_image(
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
            .docker
            .inspect_image(image)
            .await
            .map_err(|e| RuntimeError::Image {
                image: image.to_string(),
                reason: format!("inspect after pull: {e}"),
            })?;
        Ok(ImageFacts::from(&info))
    }

    /// Force-removes a container; a missing one is fine.
    async fn remove(&self, name: &str) -> Result<(), BollardError> {
        let opts = RemoveContainerOptions {
            force: true,
            ..Default::default()
        };
        match self.docker.remove_container(name, Some(opts)).await {
            Err(e) if !is_not_found(&e) => Err(e),
            _ => Ok(()),
        }
    }

    async fn run_container(
        &self,
        spec: LaunchSpec,
        running: oneshot::Sender<()>,
        mut kill: watch::Receiver<bool>,
    ) -> Result<TaskExit, RuntimeError> {
        let task_id = spec.task.task_id.as_str();
        let Some(image) = spec.task.image.as_deref() else {
            return Err(RuntimeError::Image {
                image: String::new(),
                reason: format!("task {task_id}: the docker runtime needs an image"),
            });
        };
        // Killed before it started: nothing to run, nothing to clean.
        if *kill.borrow() {
            return Ok(TaskExit::Killed);
        }
        let facts = tokio::select! {
            pulled = self.ensure_image(image) => pulled?,
            () = kill_requested(&mut kill) => return Ok(TaskExit::Killed),
        };

        let name = container_name(&spec.agent_id, task_id);
        // Left over from an agent that crashed while running this task.
        self.remove(&name).await?;
        // Opened before the container exists, so a bad path leaves nothing behind.
        let log = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&spec.log_path)
            .await
            .map_err(|source| RuntimeError::Io {
                path: spec.log_path.clone(),
                source,
            })?;

        let mut guard = RemoveOnDrop {
            docker: self.docker.clone(),
            name: name.clone(),
            armed: true,
        };
        self.docker
            .create_container(
                Some(CreateContainerOptions {
                    name: name.clone(),
                    platform: None,
                }),
                container_config(&spec, image, &facts, self.cgroupfs),
            )
            .await?;
        tracing::debug!(task_id, container = %name, image, "container created");

        let result = self.supervise(&name, &spec, log, running, &mut kill).await;
        guard.armed = false;
        if let Err(e) = self.remove(&name).await {
            // cleanup_orphans catches it on the next agent start.
            tracing::warn!(task_id, container = %name, error = %e, "could not remove container");
        }
        result
    }

    /// Starts the created container and follows it to its end.
    async fn supervise(
        &self,
        name: &str,
        spec: &LaunchSpec,
        log: tokio::fs::File,
        running: oneshot::Sender<()>,
        kill: &mut watch::Receiver<bool>,
    ) -> Result<TaskExit, RuntimeError> {
        let task_id = spec.task.task_id.as_str();
        self.docker.start_container::<String>(name, None).await?;
        tracing::debug!(task_id, container = %name, "container started");
        let _ = running.send(());

        let mut pump: JoinHandle<Result<(), RuntimeError>> = tokio::spawn(pump_logs(
            self.docker.clone(),
            name.to_string(),
            log,
            spec.log_path.clone(),
        ));

        let exit = tokio::select! {
            code = self.wait_exit(name) => match code {
                Ok(code) => TaskExit::Exited(code),
                Err(e) => {
                    pump.abort();
                    return Err(e);
                }
            },
            () = kill_requested(kill) => {
                self.stop(name, spec.kill_grace).await;
                TaskExit::Killed
            }
        };

        match tokio::time::timeout(LOG_DRAIN_TIMEOUT, &mut pump).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => {
                tracing::warn!(task_id, error = %e, "copying container output failed")
            }
            Ok(Err(e)) => tracing::warn!(task_id, error = %e, "log pump panicked"),
            Err(_) => {
                pump.abort();
                tracing::warn!(
                    task_id,
                    "container output still flowing after exit; log cut short"
                );
            }
        }
        tracing::debug!(task_id, ?exit, "container ended");
        Ok(exit)
    }

    /// Waits for the container to stop; its exit code from `inspect`.
    async fn wait_exit(&self, name: &str) -> Result<i32, RuntimeError> {
        // The answer only comes when the container stops, but headers are
        // sent at once, so the request timeout does not cut long tasks short.
        let mut wait = self.docker.wait_container(
            name,
            Some(WaitContainerOptions {
                condition: "not-running",
            }),
        );
        let waited = match wait.next().await {
            Some(Ok(resp)) => Some(resp.status_code),
            // bollard reports a non-zero exit code as an error; it is not one for us.
            Some(Err(BollardError::DockerContainerWaitError { code, .. })) => Some(code),
            Some(Err(e)) => return Err(e.into()),
            None => None,
        };
        let info = self.docker.inspect_container(name, None).await?;
        let code = info
            .state
            .and_then(|s| s.exit_code)
            .or(waited)
            .ok_or_else(|| RuntimeError::Other(format!("container {name}: no exit code")))?;
        Ok(i32::try_from(code).unwrap_or(-1))
    }

    /// `docker stop`: SIGTERM, SIGKILL after `grace`. Failures are only
    /// logged: the force-remove that follows kills the container anyway.
    async fn stop(&self, name: &str, grace: Duration) {
        let secs = grace.as_secs() + u64::from(grace.subsec_nanos() > 0);
        let t = i64::try_from(secs).unwrap_or(i64::MAX);
        // The daemon answers only once the container is down.
        let docker = self
            .docker
            .clone()
            .with_timeout(Duration::from_secs(REQUEST_TIMEOUT_S.saturating_add(secs)));
        if let Err(e) = docker
            .stop_container(name, Some(StopContainerOptions { t }))
            .await
        {
            if !is_not_found(&e) {
                tracing::warn!(container = %name, error = %e, "docker stop failed");
            }
        }
    }

    async fn remove_orphans(&self, agent_id: &str) -> Result<usize, RuntimeError> {
        let filters = HashMap::from([(
            "label".to_string(),
            vec![format!("{LABEL_AGENT_ID}={agent_id}")],
        )]);
        let containers = self
            .docker
            .list_containers(Some(ListContainersOptions {
                all: true,
                filters,
                ..Default::default()
            }))
            .await?;
        let mut removed = 0;
        let mut failed = vec![];
        for id in containers.into_iter().filter_map(|c| c.id) {
            match self.remove(&id).await {
                Ok(()) => removed += 1,
                Err(e) => failed.push(format!("{id}: {e}")),
            }
        }
        if !failed.is_empty() {
            return Err(RuntimeError::Other(format!(
                "agent {agent_id}: removed {removed} orphan containers, could not remove {}",
                failed.join("; ")
            )));
        }
        if removed > 0 {
            tracing::info!(agent_id, removed, "removed orphan containers");
        }
        Ok(removed)
    }
}

impl ContainerRuntime for DockerRuntime {
    fn kind(&self) -> Runtime {
        Runtime::Docker
    }

    fn run(
        &self,
        spec: LaunchSpec,
        running: oneshot::Sender<()>,
        kill: watch::Receiver<bool>,
    ) -> BoxFuture<'_, Result<TaskExit, RuntimeError>> {
        self.run_container(spec, running, kill).boxed()
    }

    fn cleanup_orphans<'a>(
        &'a self,
        agent_id: &'a str,
    ) -> BoxFuture<'a, Result<usize, RuntimeError>> {
        self.remove_orphans(agent_id).boxed()
    }
}

/// Removes the container if the run future is dropped half way (the
/// executor gave up on it); the normal paths remove it themselves.
struct RemoveOnDrop {
    docker: Docker,
    name: String,
    armed: bool,
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // No runtime (shutting down): cleanup_orphans handles it next start.
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let docker = self.docker.clone();
        let name = std::mem::take(&mut self.name);
        handle.spawn(async move {
            let opts = RemoveContainerOptions {
                force: true,
                ..Default::default()
            };
            if let Err(e) = docker.remove_container(&name, Some(opts)).await {
                if !is_not_found(&e) {
                    tracing::warn!(container = %name, error = %e, "could not remove container");
                }
            }
        });
    }
}

/// `gpuctl-<agent-id>-<task-id>`: task ids are unique in a cluster, agent
/// ids on a host, so agents of several clusters can share one daemon.
pub fn container_name(agent_id: &str, task_id: &str) -> String {
    format!("gpuctl-{agent_id}-{task_id}")
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
        ImageFacts {
            path,
            ld_library_path,
            wants_driver_volume,
        }
    }
}

fn container_config(
    spec: &LaunchSpec,
    image: &str,
    facts: &ImageFacts,
    cgroupfs: bool,
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
        init: Some(true),
        // The task's GPUs and the control devices, nothing else: Docker
        // creates these nodes and allows them in the container's cgroup.
        devices: Some(
            iso.devices
                .iter()
                .map(|d| DeviceMapping {
                    path_on_host: Some(d.host_path.display().to_string()),
                    path_in_container: Some(d.container_path.clone()),
                    cgroup_permissions: Some("rwm".to_string()),
                })
                .collect(),
        ),
        // Inside the task's cgroup, whose device rules deny the other GPUs.
        cgroup_parent: iso.cgroup_parent.clone().filter(|_| cgroupfs),
        binds: volume.map(|v| {
            vec![format!(
                "{}:{}:ro",
                v.display(),
                crate::volume::CONTAINER_PATH
            )]
        }),
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
        stop_timeout: i64::try_from(spec.kill_grace.as_secs()).ok(),
        host_config: Some(host_config),
        ..Default::default()
    }
}

/// Appends the container's stdout and stderr, in order, to the log file
/// until the container stops.
async fn pump_logs(
    docker: Docker,
    name: String,
    mut file: tokio::fs::File,
    path: PathBuf,
) -> Result<(), RuntimeError> {
    let io_err = |source| RuntimeError::Io {
        path: path.clone(),
        source,
    };
    let mut logs = docker.logs(
        &name,
        Some(LogsOptions::<String> {
            follow: true,
            stdout: true,
            stderr: true,
            tail: "all".to_string(),
            ..Default::default()
        }),
    );
    while let Some(chunk) = logs.next().await {
        file.write_all(&chunk?.into_bytes()).await.map_err(io_err)?;
    }
    // tokio writes in the background; make sure it all landed.
    file.flush().await.map_err(io_err)?;
    Ok(())
}

/// Resolves when the kill flag turns true; never if the sender is dropped
/// without asking.
async fn kill_requested(kill: &mut watch::Receiver<bool>) {
    if kill.wait_for(|k| *k).await.is_err() {
        futures::future::pending::<()>().await;
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
    use std::collections::BTreeMap;
    use std::path::Path;
    use std::time::Instant;

    use gpuctl_proto::types::{Resources, TaskSpec};

    use crate::runtime::image::ensure_busybox_image;

    fn spec(dir: &Path, task_id: &str, image: &str, command: &[&str]) -> LaunchSpec {
        LaunchSpec {
            task: TaskSpec {
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
                },
                gpu_uuids: vec![],
                no_fence: false,
            },
            agent_id: format!("agent-{task_id}"),
            env: BTreeMap::from([("GPUCTL_TASK_ID".to_string(), task_id.to_string())]),
            sandbox: dir.to_path_buf(),
            log_path: dir.join("task.log"),
            kill_grace: Duration::from_secs(3),
            isolation: Default::default(),
        }
    }

    /// A task id no other test run uses at the same time.
    fn unique(name: &str) -> String {
        format!("rt-{name}-{}", std::process::id())
    }

    fn log_has(path: &Path, needle: &str) -> bool {
        std::fs::read_to_string(path).is_ok_and(|t| t.contains(needle))
    }

    async fn container_exists(rt: &DockerRuntime, name: &str) -> bool {
        match rt.client().inspect_container(name, None).await {
            Ok(_) => true,
            Err(e) if is_not_found(&e) => false,
            Err(e) => panic!("inspect {name}: {e}"),
        }
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

    #[tokio::test]
    async fn docker_exit_code_and_output() {
        let Some(rt) = connect_or_skip("docker_exit_code_and_output").await else {
            return;
        };
        let image = ensure_busybox_image(rt.client()).await.unwrap();
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
        let (run_tx, run_rx) = oneshot::channel();
        let (_kill_tx, kill_rx) = watch::channel(false);
        let exit = rt.run(s, run_tx, kill_rx).await.unwrap();
        assert_eq!(exit, TaskExit::Exited(7));
        run_rx.await.expect("running was not sent");
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
        let image = ensure_busybox_image(rt.client()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let s = spec(dir.path(), &unique("exit0"), &image, &["true"]);
        let (run_tx, _run_rx) = oneshot::channel();
        let (_kill_tx, kill_rx) = watch::channel(false);
        assert_eq!(
            rt.run(s, run_tx, kill_rx).await.unwrap(),
            TaskExit::Exited(0)
        );
    }

    #[tokio::test]
    async fn docker_kill_labels_and_removal() {
        let Some(rt) = connect_or_skip("docker_kill_labels_and_removal").await else {
            return;
        };
        let image = ensure_busybox_image(rt.client()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let task_id = unique("kill");
        let s = spec(dir.path(), &task_id, &image, &["sleep", "300"]);
        let grace = s.kill_grace;
        let name = container_name(&format!("agent-{task_id}"), &task_id);
        let (run_tx, run_rx) = oneshot::channel();
        let (kill_tx, kill_rx) = watch::channel(false);
        let rt2 = rt.clone();
        let handle = tokio::spawn(async move { rt2.run(s, run_tx, kill_rx).await });
        run_rx.await.unwrap();

        let info = rt.client().inspect_container(&name, None).await.unwrap();
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
        kill_tx.send(true).unwrap();
        let exit = handle.await.unwrap().unwrap();
        assert_eq!(exit, TaskExit::Killed);
        assert!(
            started.elapsed() < grace,
            "kill took {:?}, grace {grace:?}",
            started.elapsed()
        );
        assert!(!container_exists(&rt, &name).await);
    }

    #[tokio::test]
    async fn docker_dropping_the_run_future_removes_the_container() {
        let Some(rt) =
            connect_or_skip("docker_dropping_the_run_future_removes_the_container").await
        else {
            return;
        };
        let image = ensure_busybox_image(rt.client()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let task_id = unique("drop");
        let s = spec(dir.path(), &task_id, &image, &["sleep", "300"]);
        let name = container_name(&format!("agent-{task_id}"), &task_id);
        let (run_tx, run_rx) = oneshot::channel();
        let (_kill_tx, kill_rx) = watch::channel(false);
        let rt2 = rt.clone();
        let handle = tokio::spawn(async move { rt2.run(s, run_tx, kill_rx).await });
        run_rx.await.unwrap();
        assert!(container_exists(&rt, &name).await);
        handle.abort();
        let _ = handle.await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while container_exists(&rt, &name).await {
            assert!(
                Instant::now() < deadline,
                "container {name} survived the dropped future"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    #[tokio::test]
    async fn docker_replaces_a_leftover_container() {
        let Some(rt) = connect_or_skip("docker_replaces_a_leftover_container").await else {
            return;
        };
        let image = ensure_busybox_image(rt.client()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let task_id = unique("leftover");
        let s = spec(dir.path(), &task_id, &image, &["echo", "second"]);
        rt.client()
            .create_container(
                Some(CreateContainerOptions {
                    name: container_name(&format!("agent-{task_id}"), &task_id),
                    platform: None,
                }),
                container_config(&s, &image, &ImageFacts::default(), true),
            )
            .await
            .unwrap();
        let log = s.log_path.clone();
        let (run_tx, _run_rx) = oneshot::channel();
        let (_kill_tx, kill_rx) = watch::channel(false);
        assert_eq!(
            rt.run(s, run_tx, kill_rx).await.unwrap(),
            TaskExit::Exited(0)
        );
        assert!(log_has(&log, "second"));
        assert!(
            !container_exists(&rt, &container_name(&format!("agent-{task_id}"), &task_id)).await
        );
    }

    #[tokio::test]
    async fn docker_cleanup_orphans_removes_labelled_containers() {
        let Some(rt) = connect_or_skip("docker_cleanup_orphans_removes_labelled_containers").await
        else {
            return;
        };
        let image = ensure_busybox_image(rt.client()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let task_id = unique("orphan");
        let s = spec(dir.path(), &task_id, &image, &["sleep", "300"]);
        let name = container_name(&format!("agent-{task_id}"), &task_id);
        rt.client()
            .create_container(
                Some(CreateContainerOptions {
                    name: name.clone(),
                    platform: None,
                }),
                container_config(&s, &image, &ImageFacts::default(), true),
            )
            .await
            .unwrap();
        rt.client()
            .start_container::<String>(&name, None)
            .await
            .unwrap();

        assert_eq!(rt.cleanup_orphans("agent-nobody-here").await.unwrap(), 0);
        assert!(container_exists(&rt, &name).await);
        assert_eq!(rt.cleanup_orphans(&s.agent_id).await.unwrap(), 1);
        assert!(!container_exists(&rt, &name).await);
    }

    /// With `init: true` the container does start (the init is its process);
    /// the init then fails to exec the command and exits 127, like a shell.
    #[tokio::test]
    async fn docker_missing_command_exits_127() {
        let Some(rt) = connect_or_skip("docker_missing_command_exits_127").await else {
            return;
        };
        let image = ensure_busybox_image(rt.client()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let task_id = unique("nocmd");
        let s = spec(dir.path(), &task_id, &image, &["/no/such/program"]);
        let log = s.log_path.clone();
        let (run_tx, _run_rx) = oneshot::channel();
        let (_kill_tx, kill_rx) = watch::channel(false);
        assert_eq!(
            rt.run(s, run_tx, kill_rx).await.unwrap(),
            TaskExit::Exited(127)
        );
        assert!(
            log_has(&log, "/no/such/program"),
            "{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        assert!(
            !container_exists(&rt, &container_name(&format!("agent-{task_id}"), &task_id)).await
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
        let (run_tx, run_rx) = oneshot::channel();
        let (_kill_tx, kill_rx) = watch::channel(false);
        match rt.run(s, run_tx, kill_rx).await {
            Err(RuntimeError::Image { image: got, .. }) => assert_eq!(got, image),
            other => panic!("expected an Image error, got {other:?}"),
        }
        assert!(
            run_rx.await.is_err(),
            "running sent for a task that never started"
        );
    }
}
