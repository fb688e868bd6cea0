//! The steps of an agent's start, in the order `serve` takes them: what it
//! finds on the host (GPUs, a MIG change left part way, the driver), what
//! it builds from that (the driver volume, the CDI spec, MPS, the driver's
//! memory cap) and the health thread. Each logs what it found.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::config::AgentConfig;
use crate::error::AgentError;
use crate::{cdi, checkpoint, executor, gpu, runtime, spec_gpus, volume};

/// The GPUs to report: simulated ones (`--simulate-gpus`), or NVML's (none,
/// with a warning, where NVML cannot be loaded). `true`: simulated.
pub(crate) fn discover_gpus(
    config: &AgentConfig,
    agent_id: &str,
) -> Result<(gpu::Discovery, bool), AgentError> {
    if let Some(spec) = &config.simulate_gpus {
        let specs = gpu::parse_spec(spec).map_err(|e| AgentError::Config(e.to_string()))?;
        let gpus = gpu::simulated_gpus(&specs, agent_id);
        tracing::info!(count = gpus.len(), spec = %spec, "reporting simulated GPUs");
        let d = gpu::Discovery {
            gpus,
            ..Default::default()
        };
        return Ok((d, true));
    }
    let d = gpu::discover(config.nvml_lib.as_deref(), &config.nvidia_proc_root);
    match &d.error {
        Some(e) => tracing::warn!("{e}; reporting zero GPUs"),
        None => {
            for g in d.gpus.iter().filter(|g| !g.healthy) {
                tracing::warn!(uuid = %g.uuid, index = g.index, reason = %g.unhealthy_reason, "GPU unhealthy");
            }
            tracing::info!(count = d.gpus.len(), driver = ?d.driver_version, cuda = ?d.cuda_driver_version, "GPUs discovered through NVML");
        }
    }
    Ok((d, false))
}

/// Finishes (or undoes) a MIG layout change an earlier agent process left
/// part way, before the GPUs are reported.
pub(crate) async fn recover_mig(
    nvidia: &gpu::mig_apply::Nvidia,
    mig_dir: &std::path::Path,
    discovery: &mut gpu::Discovery,
) -> Result<Vec<gpu::mig_apply::Applied>, AgentError> {
    let (nv, dir) = (nvidia.clone(), mig_dir.to_path_buf());
    let mut gpus = std::mem::take(&mut discovery.gpus);
    let (gpus, recovered) = tokio::task::spawn_blocking(move || {
        let r = gpu::mig_apply::recover(&nv, &dir, &mut gpus);
        (gpus, r)
    })
    .await
    .map_err(|e| AgentError::Config(format!("MIG recovery: {e}")))?;
    discovery.gpus = gpus;
    Ok(recovered)
}

/// The consolidated, read-only driver volume for containers; `None` (GPU
/// containers get none) without a driver or when it cannot be built.
pub(crate) async fn driver_volume(
    config: &AgentConfig,
    driver_version: Option<&str>,
) -> Option<PathBuf> {
    let version = driver_version?.to_string();
    let (root, work) = (config.driver_root.clone(), config.work_dir.clone());
    match tokio::task::spawn_blocking(move || volume::build(&root, &work, &version)).await {
        Ok(Ok(v)) => {
            tracing::info!(path = %v.path.display(), "driver volume ready");
            Some(v.path)
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "no driver volume: GPU containers get none");
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "driver volume build panicked");
            None
        }
    }
}

/// The CDI spec's publisher, its spec written before any task starts (so
/// that its names are known); `None` with `no_cdi` or simulated GPUs,
/// which have no nodes to describe.
pub(crate) async fn cdi_publisher(
    config: &AgentConfig,
    simulated: bool,
    gpus: &[gpuctl_core::types::GpuInfo],
    driver_volume: Option<PathBuf>,
) -> Option<Arc<cdi::Publisher>> {
    let Some(dir) = &config.cdi_dir else {
        tracing::info!(
            "CDI off (no_cdi): no CDI spec is written; containers get their GPUs with --device"
        );
        return None;
    };
    if simulated {
        return None;
    }
    let p = Arc::new(cdi::Publisher::new(
        dir.clone(),
        config.dev_root.clone(),
        spec_gpus(gpus),
        driver_volume,
    ));
    let first = p.clone();
    if let Err(e) = tokio::task::spawn_blocking(move || first.refresh()).await {
        tracing::warn!(error = %e, "CDI spec refresh panicked");
    }
    Some(p)
}

/// MPS control daemons for GPUs shared in `mps` mode, supervised every 5 s
/// when the control binary is found.
pub(crate) fn start_mps(
    config: &AgentConfig,
    driver_volume: Option<&std::path::Path>,
) -> Arc<gpu::mps::Mps> {
    let mps = Arc::new(gpu::mps::Mps::new(
        gpu::mps::Mps::find_control(config.mps_control.as_deref(), driver_volume),
        config.work_dir.join("mps"),
    ));
    match mps.control() {
        Some(c) => match gpu::mps::socket_path_problem(&config.work_dir.join("mps")) {
            None => tracing::info!(control = %c.display(), "MPS: GPUs shared in mps mode get a control daemon per tenant and user"),
            Some(why) => tracing::warn!(control = %c.display(), "MPS cannot start: {why}; tasks on GPUs shared in mps mode will fail"),
        },
        None => tracing::info!("MPS off (no nvidia-cuda-mps-control): tasks on GPUs shared in mps mode run unenforced and say so"),
    }
    if mps.available() {
        let mps = mps.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                let mps = mps.clone();
                if let Err(e) = tokio::task::spawn_blocking(move || mps.supervise()).await {
                    tracing::warn!(error = %e, "MPS supervision panicked");
                }
            }
        });
    }
    mps
}

/// The driver's GPU memory cap for fractions (r615+ NVML, cgroup v2): tried
/// per task, said once here.
pub(crate) struct DriverCapSetup {
    pub memcap: Arc<gpu::memcap::DriverCap>,
    /// The Docker runtime whose hook caps containers (`docker_cap_runtime`).
    pub cap_runtime: Option<String>,
    /// Where that hook reaches the agent (gpu::cap_socket, runtime::oci_hook).
    pub cap_socket: Option<Arc<gpu::cap_socket::CapSocket>>,
}

pub(crate) fn driver_cap(config: &AgentConfig, simulated: bool) -> DriverCapSetup {
    let memcap = if simulated {
        gpu::memcap::DriverCap::off(config.work_dir.join("memcap"))
    } else {
        gpu::memcap::DriverCap::new(config.nvml_lib.as_deref(), config.work_dir.join("memcap"))
    };
    match memcap.probe() {
        Ok(()) => tracing::info!("driver memory cap available: fractions of host-process tasks on cgroup v2 are capped by the driver"),
        Err(e) => tracing::info!(reason = %e, "no driver memory cap: fractions are enforced by MPS or not at all"),
    }
    let memcap = Arc::new(memcap);
    let cap_runtime = Some(config.docker_cap_runtime.clone()).filter(|n| !n.is_empty());
    let cap_socket = match (&cap_runtime, memcap.probe()) {
        (Some(_), Ok(())) => {
            match gpu::cap_socket::CapSocket::start(&config.work_dir, memcap.clone()) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(error = %e, "no driver memory cap for containers: its socket");
                    None
                }
            }
        }
        _ => None,
    };
    DriverCapSetup {
        memcap,
        cap_runtime,
        cap_socket,
    }
}

/// The health thread's side of the agent: the snapshots it publishes, the
/// flag that stops it, and the executor it learns of once made (until then
/// every GPU counts as busy: no reset before the agent knows its tasks).
pub(crate) struct Health {
    pub rx: watch::Receiver<gpu::health::Snapshot>,
    pub stop: Arc<AtomicBool>,
    pub executor: Arc<std::sync::OnceLock<Arc<executor::Executor>>>,
}

/// Starts GPU health checks when `on` (NVML GPUs only: simulated ones
/// cannot fail), answering preflights from `preflight_rx`.
pub(crate) fn start_health(
    config: &AgentConfig,
    on: bool,
    gpus: &[gpuctl_core::types::GpuInfo],
    task_cgroup_parent: &str,
    preflight_rx: std::sync::mpsc::Receiver<gpu::health::PreflightRequest>,
) -> Result<Health, AgentError> {
    let (tx, rx) = watch::channel(gpu::health::Snapshot::default());
    let health = Health {
        rx,
        stop: Arc::new(AtomicBool::new(false)),
        executor: Arc::default(),
    };
    if !on {
        return Ok(health);
    }
    tracing::info!(
        interval_secs = config.health.interval.as_secs_f64(),
        recovery_secs = config.health.recovery.as_secs_f64(),
        ignored_xids = ?config.health.ignored_xids,
        "GPU health checks on"
    );
    // Each task's GPU memory, from its processes' cgroups: the task's own,
    // or its container's (by the id the Docker runtime recorded), for
    // containers Docker puts outside it (its systemd driver).
    let parent = task_cgroup_parent.to_string();
    let state_root = config.work_dir.join(checkpoint::STATE_DIR);
    let tasks = gpu::procs::Attribution {
        proc_root: PathBuf::from(gpu::procs::PROC_ROOT),
        cgroups: Box::new(move || gpu::procs::TaskCgroups {
            parent: parent.clone(),
            containers: runtime::docker::recorded_container_ids(&state_root),
        }),
    };
    let executor_cell = health.executor.clone();
    let all: std::collections::BTreeSet<String> = gpus.iter().map(|g| g.uuid.clone()).collect();
    let busy: gpu::health::Busy = Box::new(move || match executor_cell.get() {
        Some(e) => e.busy_gpus(),
        None => all.clone(),
    });
    let health_config = gpu::health::HealthConfig {
        state_file: Some(config.work_dir.join(gpu::health::STATE_FILE)),
        ..config.health.clone()
    };
    gpu::health::spawn(
        config.nvml_lib.clone(),
        gpus.to_vec(),
        health_config,
        Some(tasks),
        busy,
        tx,
        preflight_rx,
        health.stop.clone(),
    )
    .map_err(AgentError::HealthThread)?;
    Ok(health)
}

/// With TLS configured, the agent's certificate (joining the cluster with
/// its token if it has none yet); without, a warning.
pub(crate) async fn join(
    config: &AgentConfig,
    agent_id: &str,
) -> Result<Option<Arc<gpuctl_auth::tls::Tls>>, AgentError> {
    match &config.security {
        Some(sec) => Ok(Some(
            crate::identity::establish(sec, agent_id, &config.masters).await?,
        )),
        None => {
            tracing::warn!(
                listen = %config.listen,
                "no TLS configured: the agent API serves loopback only unless --insecure \
                 (see docs/security.md)"
            );
            Ok(None)
        }
    }
}

/// The agent's attributes: its GPUs' and driver's labels, whether the GPUs
/// are simulated, and the operator's own (which win).
pub(crate) fn attributes(
    config: &AgentConfig,
    discovery: &gpu::Discovery,
    simulated: bool,
) -> std::collections::BTreeMap<String, String> {
    let mut attributes = gpu::labels(
        &discovery.gpus,
        discovery.driver_version.as_deref(),
        discovery.cuda_driver_version.as_deref(),
    );
    if simulated {
        attributes.insert("gpuctl.io/simulated-gpus".into(), "true".into());
    }
    attributes.extend(config.attributes.clone());
    attributes
}

/// The device isolation of tasks under `task_cgroup_parent`.
pub(crate) fn isolator(
    config: &AgentConfig,
    task_cgroup_parent: &str,
) -> Result<Arc<dyn crate::isolation::Isolator>, AgentError> {
    let isolator = crate::isolation::CgroupIsolator::new(
        &config.cgroup_root,
        task_cgroup_parent,
        &config.dev_root,
        nix::unistd::Uid::effective().is_root(),
    )?
    .with_pids_max(config.task_pids_max);
    let isolator: Arc<dyn crate::isolation::Isolator> = Arc::new(isolator);
    tracing::info!("{}", isolator.describe());
    Ok(isolator)
}

/// What tasks may do here, as this process can grant it.
pub(crate) fn task_policy(config: &AgentConfig) -> crate::security::TaskPolicy {
    let policy = config.task_policy();
    if config.allow_root_tasks && !policy.agent_is_root() {
        tracing::warn!(
            "allow_root_tasks is set but the agent does not run as root: no task runs as root here"
        );
    }
    tracing::info!("{}", policy.describe());
    policy
}

/// The runtimes this agent offers, the host-process one supervised by this
/// binary (or `supervisor_exe`).
pub(crate) async fn runtimes(
    config: &AgentConfig,
) -> Result<
    std::collections::BTreeMap<gpuctl_core::types::Runtime, Arc<dyn runtime::ContainerRuntime>>,
    AgentError,
> {
    let supervisor_exe = match &config.supervisor_exe {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(|source| AgentError::WorkDir {
            path: PathBuf::from("/proc/self/exe"),
            source,
        })?,
    };
    crate::make_runtimes(
        config.runtimes.as_deref(),
        supervisor_exe,
        crate::checkpointed_docker_tasks(&config.work_dir),
    )
    .await
}

/// Where masters reach the agent: `advertise`, else the listen address
/// (its port on this host's name when it listens on all addresses).
pub(crate) fn advertised_address(
    config: &AgentConfig,
    listener: &tokio::net::TcpListener,
    hostname: &str,
) -> Result<String, AgentError> {
    let local = listener.local_addr().map_err(|e| AgentError::WorkDir {
        path: PathBuf::from("<listener>"),
        source: e,
    })?;
    Ok(config.advertise.clone().unwrap_or_else(|| {
        if local.ip().is_unspecified() {
            format!("{hostname}:{}", local.port())
        } else {
            local.to_string()
        }
    }))
}

/// The host made ready for tasks: [`prepare_host`]'s result.
pub(crate) struct Host {
    pub discovery: gpu::Discovery,
    /// `--simulate-gpus`: no NVML, no MIG, no health checks.
    pub simulated: bool,
    pub attributes: std::collections::BTreeMap<String, String>,
    pub nvidia: gpu::mig_apply::Nvidia,
    pub mig_dir: PathBuf,
    /// MIG changes an earlier agent process left, finished or undone.
    pub recovered: Vec<gpu::mig_apply::Applied>,
    pub isolation: executor::IsolationSetup,
    pub cdi: Option<Arc<cdi::Publisher>>,
    pub health: Health,
}

/// The steps before the agent can report and run anything, in order: its
/// GPUs, a MIG change left part way, the isolator, the driver volume, the
/// CDI spec, the task policy, MPS, the driver's memory cap, the health
/// thread.
pub(crate) async fn prepare_host(config: &AgentConfig, agent_id: &str) -> Result<Host, AgentError> {
    let (mut discovery, simulated) = discover_gpus(config, agent_id)?;
    let nvidia = gpu::mig_apply::Nvidia {
        lib: config.nvml_lib.clone(),
        proc_root: config.nvidia_proc_root.clone(),
    };
    let mig_dir = config.work_dir.join("mig");
    let recovered = if simulated {
        Vec::new()
    } else {
        recover_mig(&nvidia, &mig_dir, &mut discovery).await?
    };
    let attributes = attributes(config, &discovery, simulated);
    // One level per agent, so that agents sharing a host never touch each
    // other's cgroups and each can sweep what it left itself.
    let task_cgroup_parent = format!("{}/{agent_id}", config.cgroup_parent.trim_matches('/'));
    let isolator = isolator(config, &task_cgroup_parent)?;
    let driver_volume = driver_volume(config, discovery.driver_version.as_deref()).await;
    let cdi = cdi_publisher(config, simulated, &discovery.gpus, driver_volume.clone()).await;
    let gpu_grants: crate::isolation::grants::SharedGrants = Arc::new(std::sync::RwLock::new(
        crate::isolation::grants::device_grants(&discovery.gpus),
    ));
    let policy = task_policy(config);
    let mps = start_mps(config, driver_volume.as_deref());
    let DriverCapSetup {
        memcap,
        cap_runtime,
        cap_socket,
    } = driver_cap(config, simulated);
    // Health checks run on NVML GPUs only: simulated ones cannot fail.
    let health_on = !simulated && !discovery.gpus.is_empty();
    let (preflight_tx, preflight_rx) = std::sync::mpsc::channel();
    let isolation = executor::IsolationSetup {
        preflight: health_on.then(|| gpu::health::PreflightTx {
            tx: preflight_tx,
            timeout: config.health.preflight_timeout,
        }),
        cap_socket,
        cap_runtime,
        memcap,
        mps,
        isolator,
        gpu_grants,
        driver_volume,
        policy,
        cdi: cdi.as_ref().map(|p| p.names()).unwrap_or_default(),
        driver: runtime::HostDriver {
            version: discovery.driver_version.clone(),
            cuda: discovery.cuda_driver_version.clone(),
        },
        users: crate::task_users::TaskUsers::new(config.task_users.clone(), &config.work_dir),
    };
    let health = start_health(
        config,
        health_on,
        &discovery.gpus,
        &task_cgroup_parent,
        preflight_rx,
    )?;
    Ok(Host {
        discovery,
        simulated,
        attributes,
        nvidia,
        mig_dir,
        recovered,
        isolation,
        cdi,
        health,
    })
}
