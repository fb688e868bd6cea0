//! gpuctl agent: discovers this host's GPUs, registers with the master, and
//! runs the tasks the master places here (in Docker or as host processes).
//!
//! [`serve`] runs an agent on a bound listener until `shutdown` resolves, so
//! tests and `gpuctl demo` can run one in-process.

pub mod api;
pub mod cdi;
pub mod check;
pub mod checkpoint;
pub mod config;
mod error;
pub mod executor;
pub mod gpu;
pub mod identity;
pub mod isolation;
pub mod master_link;
pub mod metrics;
pub mod runtime;
pub mod security;
mod startup;
pub mod task_users;
pub mod volume;

pub use error::AgentError;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use config::AgentConfig;
use gpuctl_core::types::{AgentInfo, Resources, Runtime};
use gpuctl_proto::pb;
use runtime::{ContainerRuntime, DockerRuntime, ProcessRuntime};
use std::sync::atomic::Ordering;
use tokio::sync::{mpsc, watch};

const AGENT_ID_FILE: &str = "agent-id";

/// The agent's id, kept in its work dir so that a restarted agent is the
/// same agent to the master.
pub fn load_or_create_agent_id(work_dir: &Path, hostname: &str) -> Result<String, AgentError> {
    let path = work_dir.join(AGENT_ID_FILE);
    let io = |source| AgentError::WorkDir {
        path: path.clone(),
        source,
    };
    match std::fs::read_to_string(&path) {
        Ok(s) => {
            let id = s.trim().to_string();
            gpuctl_core::convert::check_id("agent_id", &id)
                .map_err(|e| AgentError::Config(format!("{}: {e}", path.display())))?;
            Ok(id)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let host: String = hostname
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '-' {
                        c
                    } else {
                        '-'
                    }
                })
                .take(40)
                .collect();
            let host = host.trim_matches('-');
            let suffix = uuid::Uuid::new_v4().simple().to_string();
            let id = if host.is_empty() {
                format!("agent-{}", &suffix[..8])
            } else {
                format!("{host}-{}", &suffix[..8])
            };
            std::fs::write(&path, format!("{id}\n")).map_err(io)?;
            Ok(id)
        }
        Err(e) => Err(io(e)),
    }
}

fn host_memory_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb / 1024)
}

/// Which runtimes this agent offers, connecting to Docker when asked for
/// (or, with no explicit choice, when its daemon answers).
///
/// A Docker daemon that is down when the agent starts does not stop it when
/// Docker was asked for explicitly, or when Docker tasks of an earlier agent
/// process are checkpointed here: their containers may well still run, and
/// the agent waits for the daemon to answer (its heartbeats say Docker is
/// down meanwhile).
async fn make_runtimes(
    wanted: Option<&[Runtime]>,
    supervisor_exe: PathBuf,
    has_docker_tasks: bool,
) -> Result<BTreeMap<Runtime, Arc<dyn ContainerRuntime>>, AgentError> {
    let mut out: BTreeMap<Runtime, Arc<dyn ContainerRuntime>> = BTreeMap::new();
    let want = |r| wanted.is_none_or(|w| w.contains(&r));
    if want(Runtime::Docker) {
        match DockerRuntime::connect().await {
            Ok(d) => {
                let d = d
                    .with_fence_watcher(supervisor_exe.clone())
                    .with_device_check(supervisor_exe.clone());
                out.insert(Runtime::Docker, Arc::new(d));
            }
            Err(e) if wanted.is_some() || has_docker_tasks => {
                tracing::warn!(error = %e, "Docker does not answer; its tasks wait until it does");
                let d = DockerRuntime::new()
                    .map_err(AgentError::Docker)?
                    .with_fence_watcher(supervisor_exe.clone())
                    .with_device_check(supervisor_exe.clone());
                out.insert(Runtime::Docker, Arc::new(d));
            }
            Err(e) => {
                tracing::info!(error = %e, "Docker not available; image jobs will not run on this agent")
            }
        }
    }
    if want(Runtime::Process) {
        out.insert(
            Runtime::Process,
            Arc::new(ProcessRuntime::new(supervisor_exe)),
        );
    }
    Ok(out)
}

/// Whether an earlier agent process left Docker tasks (with an image) in
/// the work dir's checkpoints.
fn checkpointed_docker_tasks(work_dir: &Path) -> bool {
    let root = work_dir.join(checkpoint::STATE_DIR);
    std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| {
            checkpoint::read_json::<gpuctl_core::types::TaskSpec>(
                &e.path().join(checkpoint::TASK_FILE),
            )
            .ok()
            .flatten()
            .is_some_and(|s| s.template.image.is_some())
        })
}

/// Hands the executor every change in the GPUs' health, so that tasks on a
/// GPU that failed are stopped at once, whether or not a master is
/// reachable; and every reading of the tasks' GPU memory, so that a
/// fraction over its memory is stopped (`GPU_MEMORY_LIMIT`).
async fn stop_tasks_on_failed_gpus(
    executor: Arc<executor::Executor>,
    mut health: watch::Receiver<gpu::health::Snapshot>,
) {
    let mut seen = None;
    loop {
        let (generation, faults, over) = {
            let s = health.borrow_and_update();
            executor.note_gpu_memory(&s.gpus);
            let readings = s
                .gpus
                .iter()
                .filter_map(|g| g.sample.as_ref().map(|r| (g.uuid.as_str(), r)));
            let over = gpu::procs::over_memory(readings, &executor.memory_watched());
            (s.generation, s.faults(), over)
        };
        if seen != Some(generation) {
            seen = Some(generation);
            executor.set_gpu_faults(faults);
        }
        if !over.is_empty() {
            executor.stop_over_memory(over);
        }
        if health.changed().await.is_err() {
            return;
        }
    }
}

/// Runs an agent until `shutdown` resolves. Its tasks keep running after it
/// (unless `config.stop_tasks_on_shutdown`). Its steps in order, each a
/// function (here or in `startup.rs`).
pub async fn serve(
    config: AgentConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AgentError> {
    let (hostname, agent_id) = identity(&config)?;
    // Before anything else talks to a master: join if need be.
    let tls = startup::join(&config, &agent_id).await?;
    let host = startup::prepare_host(&config, &agent_id).await?;
    let runtimes = startup::runtimes(&config).await?;
    let info = agent_info(&config, &listener, &hostname, &agent_id, &host, &runtimes)?;
    tracing::info!(agent_id = %info.id, address = %info.address, runtimes = ?info.runtimes, gpus = info.gpus.len(), "agent starting");

    let (stop_tx, stop_rx) = watch::channel(false);
    // With no GPU there is nothing to keep in step (the first refresh
    // removed a spec left from before).
    if let Some(p) = host.cdi.clone().filter(|p| p.has_gpus()) {
        tokio::spawn(cdi::keep_in_step(p, cdi::REFRESH, stop_rx.clone()));
    }
    let mps = host.isolation.mps.clone();
    let gpu_grants = host.isolation.gpu_grants.clone();
    let (updates_tx, updates_rx) = mpsc::channel(1024);
    let executor = executor::Executor::new(
        agent_id,
        config.work_dir.clone(),
        runtimes,
        config.kill_grace,
        config.task_retention,
        host.isolation,
        updates_tx,
    );
    let health = host.health;
    let _ = health.executor.set(executor.clone());
    if let Some(addr) = config.metrics_listen {
        let render = metrics::renderer(
            info.gpus.clone(),
            health.rx.clone(),
            executor.clone(),
            hostname.clone(),
        );
        gpuctl_proto::metrics_server::spawn_server(addr, render, stop_rx.clone())
            .await
            .map_err(|source| AgentError::Listen {
                addr: addr.to_string(),
                source,
            })?;
    }
    // Tasks of an earlier agent process are found and followed again
    // before the master hears from this one.
    executor.recover();
    let mig = (!host.simulated && info.gpus.iter().any(|g| g.mig.capable)).then(|| {
        mig_applier(
            host.nvidia,
            host.mig_dir,
            info.gpus.clone(),
            host.recovered,
            &executor,
            gpu_grants,
            host.cdi,
        )
    });
    let masters = Arc::new(master_link::Masters::with_tls(
        config.masters.clone(),
        tls.clone(),
    ));
    if let (Some(tls), Some(sec)) = (&tls, &config.security) {
        identity::spawn_renewer(
            tls.clone(),
            sec.tls_dir.clone(),
            config.masters.clone(),
            stop_rx.clone(),
        );
    }
    let (sender_done, sender_done_rx) = watch::channel(false);
    let acked = executor.clone();
    let sender = tokio::spawn(master_link::status_sender(
        masters.clone(),
        updates_rx,
        move |u| acked.acknowledged(u),
        sender_done_rx,
    ));
    tokio::spawn(executor.clone().tick(stop_rx.clone()));
    tokio::spawn(executor.clone().sweep_sandboxes_until(stop_rx.clone()));
    let link = tokio::spawn(master_link::run(
        masters,
        info,
        executor.clone(),
        health.rx.clone(),
        stop_rx.clone(),
        mig,
    ));
    tokio::spawn(stop_tasks_on_failed_gpus(
        executor.clone(),
        health.rx.clone(),
    ));

    let server = serve_api(listener, tls.as_ref(), executor.clone(), stop_rx.clone());
    shutdown.await;
    let _ = stop_tx.send(true);
    health.stop.store(true, Ordering::Relaxed);
    let _ = link.await;
    shut_down(&config, &executor, &mps, sender_done, sender).await;
    match server.await {
        Ok(r) => r?,
        Err(e) => tracing::error!(error = %e, "agent API server task failed"),
    }
    tracing::info!("agent stopped");
    Ok(())
}

/// This host's name and the agent's id (kept in its work dir, which is
/// made here).
fn identity(config: &AgentConfig) -> Result<(String, String), AgentError> {
    std::fs::create_dir_all(config.work_dir.join("tasks")).map_err(|source| {
        AgentError::WorkDir {
            path: config.work_dir.clone(),
            source,
        }
    })?;
    let hostname = hostname::get()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "localhost".into());
    let agent_id = load_or_create_agent_id(&config.work_dir, &hostname)?;
    Ok((hostname, agent_id))
}

/// What the agent tells the masters it is and offers.
fn agent_info(
    config: &AgentConfig,
    listener: &tokio::net::TcpListener,
    hostname: &str,
    agent_id: &str,
    host: &startup::Host,
    runtimes: &BTreeMap<Runtime, Arc<dyn ContainerRuntime>>,
) -> Result<AgentInfo, AgentError> {
    let address = startup::advertised_address(config, listener, hostname)?;
    let cpus = config
        .cpus
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64));
    let gpus = host.discovery.gpus.clone();
    let policy = &host.isolation.policy;
    Ok(AgentInfo {
        id: agent_id.to_string(),
        hostname: hostname.to_string(),
        address,
        total: Resources {
            cpus,
            mem_mib: config.mem_mib.unwrap_or_else(host_memory_mib),
            // Devices: a GPU in MIG mode counts as its MIG devices.
            gpus: gpuctl_core::types::device_count(&gpus),
            ports: config.ports.map_or(0, |r| r.len()),
        },
        gpus,
        runtimes: runtimes.keys().copied().collect(),
        simulated_gpus: host.simulated,
        attributes: host.attributes.clone(),
        driver_version: host.discovery.driver_version.clone(),
        cuda_driver_version: host.discovery.cuda_driver_version.clone(),
        // What the master places here: only what this agent will run.
        allow_root_tasks: policy.runs_root_tasks(),
        allowed_mounts: policy.allowed_mounts.clone(),
        allowed_users: Some(policy.allowed_users.clone()),
        share_gpus: config.share_gpus,
        ports: config.ports,
    })
}

/// The master's MIG layout changes, applied here: the device grants and
/// the CDI spec follow each new layout.
fn mig_applier(
    nvidia: gpu::mig_apply::Nvidia,
    mig_dir: PathBuf,
    gpus: Vec<gpuctl_core::types::GpuInfo>,
    recovered: Vec<gpu::mig_apply::Applied>,
    executor: &Arc<executor::Executor>,
    gpu_grants: isolation::grants::SharedGrants,
    cdi: Option<Arc<cdi::Publisher>>,
) -> Arc<gpu::mig_apply::Applier> {
    let exec = executor.clone();
    gpu::mig_apply::Applier::new(
        nvidia,
        mig_dir,
        gpus,
        recovered,
        Box::new(move || exec.busy_gpus()),
        Box::new(move |gpus| {
            *gpu_grants.write().unwrap_or_else(|p| p.into_inner()) =
                isolation::grants::device_grants(gpus);
            if let Some(p) = &cdi {
                p.set_gpus(spec_gpus(gpus));
                p.refresh();
            }
        }),
    )
}

/// The agent API: only masters may connect when TLS is on (a client
/// certificate is required at the handshake; api.rs checks it is a
/// master's). Serves until `stop`.
fn serve_api(
    listener: tokio::net::TcpListener,
    tls: Option<&Arc<gpuctl_auth::tls::Tls>>,
    executor: Arc<executor::Executor>,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<Result<(), tonic::transport::Error>> {
    let api = pb::agent_api_server::AgentApiServer::new(api::AgentApiService {
        executor,
        masters_only: tls.is_some(),
    });
    let stopped = async move {
        let _ = stop.changed().await;
    };
    let router = tonic::transport::Server::builder().add_service(api);
    match tls {
        Some(tls) => tokio::spawn(router.serve_with_incoming_shutdown(
            gpuctl_auth::tls::incoming(listener, tls.clone()),
            stopped,
        )),
        None => tokio::spawn(router.serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            stopped,
        )),
    }
}

/// What the agent leaves behind: with `stop_tasks_on_shutdown` its tasks
/// are killed (their MPS daemons with them) and their final statuses given
/// a moment to reach the master; otherwise they go on, for the next agent
/// process to take over.
async fn shut_down(
    config: &AgentConfig,
    executor: &Arc<executor::Executor>,
    mps: &Arc<gpu::mps::Mps>,
    sender_done: watch::Sender<bool>,
    sender: tokio::task::JoinHandle<()>,
) {
    if config.stop_tasks_on_shutdown {
        tracing::info!("agent shutting down: stopping its tasks");
        executor
            .kill_all(config.kill_grace + Duration::from_secs(5))
            .await;
        // Their MPS daemons go with them.
        let m = mps.clone();
        let _ = tokio::task::spawn_blocking(move || m.stop_all()).await;
        // Give the final KILLED updates a moment to reach the master.
        let _ = sender_done.send(true);
        if tokio::time::timeout(Duration::from_secs(3), sender)
            .await
            .is_err()
        {
            tracing::warn!("some task status updates were not delivered before shutdown");
        }
    } else {
        // Tasks go on under their supervisors and in Docker; the next agent
        // process takes them over (`Executor::recover`) and sends what was
        // not delivered (final statuses are checkpointed).
        tracing::info!(
            tasks = executor.active_tasks(),
            "agent shutting down; its tasks keep running"
        );
    }
}

/// The GPUs and MIG devices the CDI spec describes.
fn spec_gpus(gpus: &[gpuctl_core::types::GpuInfo]) -> Vec<cdi::SpecGpu> {
    gpus.iter()
        .map(|g| cdi::SpecGpu {
            index: g.index,
            uuid: g.uuid.clone(),
            minor: g.minor,
            mig: g
                .mig
                .devices
                .iter()
                .map(|m| cdi::SpecMig {
                    uuid: m.uuid.clone(),
                    caps: m.caps_minors.clone(),
                })
                .collect(),
        })
        .collect()
}
