//! Agent options: from flags, environment variables or a TOML file
//! (`--config`), in that order of precedence.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use gpuctl_core::types::{IdRanges, PortRange, Runtime, UserIds};

use crate::error::AgentError;
use crate::gpu::health::HealthConfig;

#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Master addresses, HOST:PORT; the agent follows them in order on failure.
    pub masters: Vec<String>,
    pub work_dir: PathBuf,
    pub listen: SocketAddr,
    /// Address the master uses to reach this agent; default from `listen`.
    pub advertise: Option<String>,
    /// Mutual TLS with the masters; `None`: none (loopback only).
    pub security: Option<AgentSecurity>,
    /// `COUNTxMODEL[:MEMORY],...`: report simulated GPUs instead of NVML's.
    pub simulate_gpus: Option<String>,
    /// Which runtimes to offer; `None`: Docker when its daemon answers, plus
    /// host processes.
    pub runtimes: Option<Vec<Runtime>>,
    pub nvml_lib: Option<PathBuf>,
    /// The MPS control program for GPUs shared in `mps` mode; `None`: the
    /// driver volume's or PATH's; empty: none (MPS off here).
    pub mps_control: Option<PathBuf>,
    /// The Docker runtime whose hook has the driver cap a fraction's
    /// container (`gpuctl-runc`, registered with dockerd under this name);
    /// empty: containers are not capped by the driver.
    pub docker_cap_runtime: String,
    pub cpus: Option<f64>,
    pub mem_mib: Option<u64>,
    /// Between SIGTERM and SIGKILL when a task is killed.
    pub kill_grace: Duration,
    /// How long an ended task's sandbox and log are kept once the master no
    /// longer wants the task and acknowledged its end.
    pub task_retention: Duration,
    /// Task cgroups live under `<cgroup_root>/<controller>/<cgroup_parent>`
    /// on v1, `<cgroup_root>/<cgroup_parent>` on v2.
    pub cgroup_parent: String,
    pub cgroup_root: PathBuf,
    /// Where `nvidia<N>`, `nvidiactl`, ... are found.
    pub dev_root: PathBuf,
    /// Where the driver's `/proc` files are read (`driver/nvidia-caps/
    /// mig-minors`): `/proc`, or a directory of fakes in tests.
    pub nvidia_proc_root: PathBuf,
    /// Root under which the driver's ld.so cache, libraries and binaries are.
    pub driver_root: PathBuf,
    /// Where the agent writes the CDI spec of its GPUs; `None`: no spec,
    /// and containers never get their GPUs through CDI (`--no-cdi`).
    pub cdi_dir: Option<PathBuf>,
    /// Operator-set attributes (rack, zone...), for `--constraint`; they
    /// override discovered ones of the same name.
    pub attributes: std::collections::BTreeMap<String, String>,
    /// GPU health checks (NVML GPUs only).
    pub health: HealthConfig,
    /// Where to serve Prometheus metrics (`/metrics`); none when unset.
    pub metrics_listen: Option<SocketAddr>,
    /// The binary that runs host-process supervisors (`<exe> supervise
    /// DIR`); `None`: this process's own executable.
    pub supervisor_exe: Option<PathBuf>,
    /// Stop every task when the agent stops. Off for a real agent (tasks
    /// outlive it; emptying a node is `gpuctl agents drain`); on for the
    /// throwaway agent of `gpuctl demo`.
    pub stop_tasks_on_shutdown: bool,
    /// Host-process tasks run as this user when their job names none and
    /// `task_users` is none.
    pub task_user: UserIds,
    /// Each host-process task whose job names no user runs under a uid
    /// (and gid of the same number) of its own from these, leased until
    /// the task is forgotten; none: they all run as `task_user`.
    pub task_users: IdRanges,
    /// The uids and gids a job may name (`security.user`), whatever the
    /// master allowed: no system account, nor an id of `task_users`.
    pub allowed_users: IdRanges,
    /// Each task's limit of processes and threads; `None`: unlimited.
    pub task_pids_max: Option<u64>,
    /// Jobs that ask (`security.run_as_root`) may run host-process tasks
    /// as root here.
    pub allow_root_tasks: bool,
    /// Host path prefixes containers may bind-mount.
    pub allowed_mounts: Vec<String>,
    /// Host ports tasks may be given (`--ports`); `None`: none.
    pub ports: Option<PortRange>,
    /// This agent's GPUs are shareable by fractions in this mode when it
    /// registers, unless an admin decided otherwise (`--share-gpus`).
    pub share_gpus: Option<gpuctl_core::types::ShareMode>,
}

impl AgentConfig {
    /// What tasks may do here (`security.rs`): these options, for this
    /// process's effective user and group.
    pub fn task_policy(&self) -> crate::security::TaskPolicy {
        let agent_ids = UserIds {
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
        };
        crate::security::TaskPolicy::new(
            self.task_user,
            self.allow_root_tasks,
            self.allowed_mounts.clone(),
            agent_ids,
        )
        .with_users(self.task_users.clone(), self.allowed_users.clone())
    }

    pub fn new(masters: Vec<String>, work_dir: PathBuf) -> AgentConfig {
        AgentConfig {
            masters,
            work_dir,
            listen: SocketAddr::from(([0, 0, 0, 0], 7051)),
            advertise: None,
            security: None,
            simulate_gpus: None,
            runtimes: None,
            nvml_lib: None,
            mps_control: None,
            docker_cap_runtime: DEFAULT_CAP_RUNTIME.to_string(),
            cpus: None,
            mem_mib: None,
            kill_grace: Duration::from_secs(10),
            task_retention: DEFAULT_TASK_RETENTION,
            cgroup_parent: "gpuctl".into(),
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            dev_root: PathBuf::from("/dev"),
            nvidia_proc_root: PathBuf::from("/proc"),
            driver_root: PathBuf::from("/"),
            cdi_dir: Some(PathBuf::from(crate::cdi::DEFAULT_DIR)),
            attributes: Default::default(),
            health: HealthConfig::default(),
            metrics_listen: None,
            supervisor_exe: None,
            stop_tasks_on_shutdown: false,
            task_user: crate::security::DEFAULT_TASK_USER,
            task_users: IdRanges::parse(DEFAULT_TASK_USERS).unwrap_or_default(),
            allowed_users: IdRanges::parse(DEFAULT_ALLOWED_USERS).unwrap_or_default(),
            task_pids_max: Some(DEFAULT_TASK_PIDS_MAX),
            allow_root_tasks: false,
            allowed_mounts: Vec::new(),
            ports: PortRange::parse(DEFAULT_PORTS).ok(),
            share_gpus: None,
        }
    }
}

/// Where an agent keeps its certificate, and how it gets one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentSecurity {
    /// Holds ca.crt (the cluster CA, given by the operator), and agent.pem
    /// (its certificate and key, written when the agent joins, replaced when
    /// it renews).
    pub tls_dir: PathBuf,
    /// A join token (`gpuctl tokens create --join`), used when the agent
    /// has no certificate yet.
    pub join_token: Option<String>,
    /// Or a file holding it, read only then.
    pub join_token_file: Option<PathBuf>,
}

/// The agent API's port unless told otherwise.
pub const DEFAULT_PORT: u16 = 7051;
/// The name `gpuctl-runc` is registered with dockerd under by default.
pub const DEFAULT_CAP_RUNTIME: &str = "gpuctl";

/// Default of `--task-retention`.
pub const DEFAULT_TASK_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// gpuctl-agent: runs gpuctl tasks on this host's GPUs.
#[derive(Debug, Parser)]
#[command(
    name = "gpuctl-agent",
    version,
    about,
    after_help = "Also: gpuctl-agent check [--json] [--no-docker] [--busybox-image] reports what \
                  this host offers an agent (GPUs through NVML, the driver, Docker) without \
                  starting one."
)]
pub struct Options {
    /// TOML file with any of the options below (keys as the long flag names,
    /// with '_' for '-'). Flags and environment variables override it.
    #[arg(long, env = "GPUCTL_AGENT_CONFIG")]
    pub config: Option<PathBuf>,
    /// Master address(es), HOST:PORT[,HOST:PORT...].
    #[arg(long, env = "GPUCTL_MASTER", default_value = "127.0.0.1:7050")]
    pub master: String,
    /// Task sandboxes, logs and the agent id live here.
    #[arg(
        long,
        env = "GPUCTL_AGENT_WORK_DIR",
        default_value = "/var/lib/gpuctl/agent"
    )]
    pub work_dir: PathBuf,
    /// Address for the agent API (task logs), HOST:PORT. Default:
    /// 0.0.0.0:7051 with TLS, 127.0.0.1:7051 without (only --insecure lets
    /// an agent without TLS listen beyond loopback).
    #[arg(long, env = "GPUCTL_AGENT_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Directory for TLS: ca.crt (the cluster's CA, from the operator), and
    /// agent.pem (certificate and key), which the agent writes when it joins
    /// with --join-token and renews before it expires. Turns on mutual TLS.
    #[arg(long, env = "GPUCTL_AGENT_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,
    /// A join token (`gpuctl tokens create --join`), used once, when the
    /// agent has no certificate in tls_dir yet.
    #[arg(long, env = "GPUCTL_AGENT_JOIN_TOKEN", hide_env_values = true)]
    pub join_token: Option<String>,
    /// A file holding the join token (instead of --join-token).
    #[arg(long, env = "GPUCTL_AGENT_JOIN_TOKEN_FILE")]
    pub join_token_file: Option<PathBuf>,
    /// Serve without TLS on a non-loopback address. For isolated labs only.
    #[arg(long, env = "GPUCTL_AGENT_INSECURE")]
    pub insecure: bool,
    /// Address the master uses to reach this agent (default: the listen
    /// address, with this host's name when listening on all interfaces).
    #[arg(long, env = "GPUCTL_AGENT_ADVERTISE")]
    pub advertise: Option<String>,
    /// Report simulated GPUs, e.g. 4xA100-SXM4-40GB or 2xT4:16GiB,1xH100.
    #[arg(long, env = "GPUCTL_AGENT_SIMULATE_GPUS")]
    pub simulate_gpus: Option<String>,
    /// Runtimes to offer: docker, process, or both comma separated
    /// (default: docker when its daemon answers, plus process).
    #[arg(long, env = "GPUCTL_AGENT_RUNTIME")]
    pub runtime: Option<String>,
    /// Path of libnvidia-ml to load (default: the system's).
    #[arg(long, env = "GPUCTL_AGENT_NVML_LIB")]
    pub nvml_lib: Option<PathBuf>,
    /// The MPS control program (nvidia-cuda-mps-control) for GPUs shared in
    /// mps mode (default: the driver volume's, else the first on PATH; ""
    /// turns MPS off: tasks on mps GPUs then run unenforced and say so).
    #[arg(long, env = "GPUCTL_AGENT_MPS_CONTROL")]
    pub mps_control: Option<PathBuf>,
    /// The Docker runtime (registered with dockerd --add-runtime) that caps
    /// a fraction's container with the driver's GPU memory cap: a link named
    /// gpuctl-runc to gpuctl-agent (default: gpuctl; "" turns it off).
    #[arg(long, env = "GPUCTL_AGENT_DOCKER_CAP_RUNTIME", value_name = "NAME")]
    pub docker_cap_runtime: Option<String>,
    /// Mark this agent's GPUs shareable by fractions when it registers:
    /// mps or time-slice (docs/sharing.md). A GPU an admin set with
    /// `gpuctl gpus share` (--off included), in MIG mode or held whole is
    /// left as it is.
    #[arg(long, env = "GPUCTL_AGENT_SHARE_GPUS", value_name = "MODE")]
    pub share_gpus: Option<String>,
    /// CPUs to offer (default: all of this host's).
    #[arg(long, env = "GPUCTL_AGENT_CPUS")]
    pub cpus: Option<f64>,
    /// Memory to offer in MiB (default: all of this host's).
    #[arg(long, env = "GPUCTL_AGENT_MEM_MIB")]
    pub mem_mib: Option<u64>,
    /// Seconds between SIGTERM and SIGKILL when a task is killed.
    #[arg(long, env = "GPUCTL_AGENT_KILL_GRACE_SECS", default_value_t = 10.0)]
    pub kill_grace_secs: f64,
    /// How long an ended task's sandbox (`tasks/<id>/`, its output.log
    /// among it) is kept once the master acknowledged its end and no longer
    /// wants it, e.g. 24h, 7d, 30m; then it is removed.
    #[arg(long, env = "GPUCTL_AGENT_TASK_RETENTION", default_value = "24h")]
    pub task_retention: String,
    /// Task cgroups are created under this parent in each hierarchy.
    #[arg(long, env = "GPUCTL_AGENT_CGROUP_PARENT", default_value = "gpuctl")]
    pub cgroup_parent: String,
    /// Where the cgroup hierarchies are mounted.
    #[arg(
        long,
        env = "GPUCTL_AGENT_CGROUP_ROOT",
        default_value = "/sys/fs/cgroup"
    )]
    pub cgroup_root: PathBuf,
    /// Directory holding the NVIDIA device nodes (nvidia0, nvidiactl, ...).
    #[arg(long, env = "GPUCTL_AGENT_DEV_ROOT", default_value = "/dev")]
    pub dev_root: PathBuf,
    /// Where the NVIDIA driver's /proc files are read: the MIG devices'
    /// capability minors in driver/nvidia-caps/mig-minors (tests point it
    /// at a directory of their own).
    #[arg(long, env = "GPUCTL_AGENT_NVIDIA_PROC_ROOT", default_value = "/proc")]
    pub nvidia_proc_root: PathBuf,
    /// Root under which the driver's ld.so cache, libraries and binaries are
    /// found (like the NVIDIA container toolkit's driver root).
    #[arg(long, env = "GPUCTL_AGENT_DRIVER_ROOT", default_value = "/")]
    pub driver_root: PathBuf,
    /// Directory the CDI spec of this machine's GPUs (gpuctl.io/gpu) is
    /// written to, for Docker and other CDI runtimes. /var/run/cdi is
    /// CDI's directory for specs generated at run time.
    #[arg(long, env = "GPUCTL_AGENT_CDI_DIR", default_value = crate::cdi::DEFAULT_DIR)]
    pub cdi_dir: PathBuf,
    /// Write no CDI spec, and give containers their GPUs with --device only.
    #[arg(long, env = "GPUCTL_AGENT_NO_CDI")]
    pub no_cdi: bool,
    /// Log filter (tracing EnvFilter syntax), e.g. `info`.
    #[arg(long, env = "GPUCTL_LOG", default_value = "info")]
    pub log: String,
    /// An attribute of this agent that jobs can require with
    /// `gpuctl jobs submit --constraint KEY=VALUE`, e.g. `zone=us-east`;
    /// repeatable (in the file: `attributes = ["zone=us-east"]`).
    #[arg(long = "attribute", value_name = "KEY=VALUE")]
    pub attributes: Vec<String>,
    /// Seconds between two NVML health probes of every GPU.
    #[arg(long, env = "GPUCTL_AGENT_HEALTH_INTERVAL_SECS", default_value_t = 5.0)]
    pub health_interval_secs: f64,
    /// Seconds an unhealthy GPU must pass its probes, with no new fault,
    /// before it returns to service.
    #[arg(
        long,
        env = "GPUCTL_AGENT_HEALTH_RECOVERY_SECS",
        default_value_t = 60.0
    )]
    pub health_recovery_secs: f64,
    /// Critical XID errors that do not make a GPU unhealthy (caused by
    /// applications), comma separated; "none" to ignore none.
    #[arg(
        long,
        env = "GPUCTL_AGENT_HEALTH_IGNORE_XIDS",
        default_value = "13,31,43,45,68,109"
    )]
    pub health_ignore_xids: String,
    /// Critical XID errors that mean the node needs service (NVIDIA's
    /// RESTART_BM): every GPU of it is withdrawn until the agent restarts;
    /// comma separated, "none" for none. Other XIDs not ignored call for a
    /// GPU reset.
    #[arg(long, env = "GPUCTL_AGENT_HEALTH_NODE_XIDS", default_value = "none")]
    pub health_node_xids: String,
    /// How the agent resets a GPU that needs it, once nothing runs on it:
    /// a command and its arguments, `{uuid}` and `{index}` replaced; "none"
    /// to never reset (such a GPU stays out until the agent restarts).
    #[arg(
        long,
        env = "GPUCTL_AGENT_GPU_RESET_COMMAND",
        default_value = "nvidia-smi --gpu-reset -i {uuid}"
    )]
    pub gpu_reset_command: String,
    /// Resets of one GPU before it stays out of service (until the agent
    /// restarts).
    #[arg(long, env = "GPUCTL_AGENT_GPU_MAX_RESETS", default_value_t = 3)]
    pub gpu_max_resets: u32,
    /// What a job's preflight (`--preflight`) runs per GPU besides the
    /// NVML checks: a command and its arguments, `{uuid}` and `{index}`
    /// replaced (e.g. a tiny CUDA or NCCL test, a memory test); it fails
    /// the GPU by exiting non-zero. "none": the NVML checks only.
    #[arg(long, env = "GPUCTL_AGENT_PREFLIGHT_COMMAND", default_value = "none")]
    pub preflight_command: String,
    /// How long the preflight command may run per GPU.
    #[arg(
        long,
        env = "GPUCTL_AGENT_PREFLIGHT_TIMEOUT_SECS",
        default_value_t = 60.0
    )]
    pub preflight_timeout_secs: f64,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics.
    #[arg(long, env = "GPUCTL_AGENT_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Stop every task when the agent stops (SIGTERM). Off by default:
    /// tasks outlive the agent, and `gpuctl agents drain` empties a machine.
    /// For throwaway agents (tests, trials).
    #[arg(long, env = "GPUCTL_AGENT_STOP_TASKS_ON_SHUTDOWN")]
    pub stop_tasks_on_shutdown: bool,
    /// The user host-process tasks run as when their job names none,
    /// UID[:GID] (numeric; never root). Applies when the agent runs as root.
    #[arg(
        long,
        env = "GPUCTL_AGENT_TASK_USER",
        default_value = "65534:65534",
        value_name = "UID[:GID]"
    )]
    pub task_user: String,
    /// The uids host-process tasks whose job names no user run under, one
    /// per task (with a gid of the same number), e.g. 80000-89999 (comma
    /// separated ranges), or `none` to run them all as --task-user. Keep
    /// them clear of the host's users and of other services' ranges.
    #[arg(
        long,
        env = "GPUCTL_AGENT_TASK_USERS",
        default_value = DEFAULT_TASK_USERS,
        value_name = "IDS|none"
    )]
    pub task_users: String,
    /// The uids and gids jobs may choose with `--user` on this agent
    /// (whatever their token allows), e.g. 1000-59999, or `none`. Must not
    /// overlap --task-users.
    #[arg(
        long,
        env = "GPUCTL_AGENT_ALLOWED_USERS",
        default_value = DEFAULT_ALLOWED_USERS,
        value_name = "IDS|none"
    )]
    pub allowed_users: String,
    /// The most processes and threads one task may have at once (its
    /// cgroup's pids.max, a container's PidsLimit), or `none`: one task
    /// cannot use up the host's pids (kernel.pid_max) under the others.
    #[arg(
        long,
        env = "GPUCTL_AGENT_TASK_PIDS_MAX",
        default_value_t = DEFAULT_TASK_PIDS_MAX.to_string(),
        value_name = "N|none"
    )]
    pub task_pids_max: String,
    /// Run host-process tasks as root for jobs that ask for it
    /// (`gpuctl jobs submit --run-as-root`). Off: such jobs are not placed
    /// here, and refused if they come.
    #[arg(long, env = "GPUCTL_AGENT_ALLOW_ROOT_TASKS")]
    pub allow_root_tasks: bool,
    /// Host path prefixes that jobs' containers may bind-mount (`gpuctl
    /// jobs submit --mount`), comma separated or repeated; none by default.
    #[arg(
        long,
        env = "GPUCTL_AGENT_ALLOWED_MOUNTS",
        value_delimiter = ',',
        value_name = "PATH"
    )]
    pub allowed_mounts: Vec<String>,
    /// Host ports tasks may be given, START-END (inclusive), or `none`.
    /// Tasks use the host network: keep it clear of other services and of
    /// the kernel's ephemeral range (`net.ipv4.ip_local_port_range`).
    #[arg(
        long,
        env = "GPUCTL_AGENT_PORTS",
        default_value = DEFAULT_PORTS,
        value_name = "START-END|none"
    )]
    pub ports: String,
}

/// Splits `a,b,c` into trimmed non-empty parts.
pub fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_string)
        .collect()
}

pub fn parse_runtimes(s: &str) -> Result<Vec<Runtime>, AgentError> {
    let mut out = Vec::new();
    for part in split_list(s) {
        let r: Runtime = part
            .parse()
            .map_err(|e: String| AgentError::Config(format!("runtime: {e}")))?;
        if !out.contains(&r) {
            out.push(r);
        }
    }
    if out.is_empty() {
        return Err(AgentError::Config("runtime: empty list".into()));
    }
    Ok(out)
}

impl Options {
    pub fn load() -> Result<Options, AgentError> {
        Self::load_from(std::env::args_os())
    }

    pub fn load_from<I, T>(args: I) -> Result<Options, AgentError>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        gpuctl_proto::options::parse_with_file(args, "config").map_err(AgentError::Config)
    }

    pub fn to_config(&self) -> Result<AgentConfig, AgentError> {
        let masters = split_list(&self.master);
        if masters.is_empty() {
            return Err(AgentError::Config("master: no address given".into()));
        }
        if !self.kill_grace_secs.is_finite() || !(0.0..=3600.0).contains(&self.kill_grace_secs) {
            return Err(AgentError::Config(format!(
                "kill_grace_secs must be between 0 and 3600, got {}",
                self.kill_grace_secs
            )));
        }
        if let Some(c) = self.cpus {
            if !c.is_finite() || c <= 0.0 {
                return Err(AgentError::Config(format!("cpus must be > 0, got {c}")));
            }
        }
        if let Some(spec) = &self.simulate_gpus {
            crate::gpu::parse_spec(spec).map_err(|e| AgentError::Config(e.to_string()))?;
        }
        let health = self.health_config()?;
        let attributes = parse_attributes(&self.attributes)?;
        let task_retention = gpuctl_core::time::parse_duration(&self.task_retention)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                AgentError::Config(format!(
                    "task_retention: {:?} is not a duration above 0 (a number with a unit: s, m, h or d, e.g. 24h)",
                    self.task_retention
                ))
            })?;
        let security = self.security()?;
        let listen = gpuctl_auth::tls::listen_address(
            self.listen,
            security.is_some(),
            self.insecure,
            DEFAULT_PORT,
            "read every task's output",
        )
        .map_err(AgentError::Config)?;
        let (task_user, task_users, allowed_users) = self.task_users()?;
        let task_pids_max = match self.task_pids_max.trim() {
            "none" => None,
            n => match n.parse::<u64>() {
                Ok(n) if n >= MIN_TASK_PIDS => Some(n),
                _ => {
                    return Err(AgentError::Config(format!(
                        "task_pids_max: {n:?} is not a number of {MIN_TASK_PIDS} or more, nor none"
                    )))
                }
            },
        };
        let allowed_mounts = parse_allowed_mounts(&self.allowed_mounts)?;
        let share_gpus = self
            .share_gpus
            .as_deref()
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<gpuctl_core::types::ShareMode>()
                    .map_err(|e| AgentError::Config(format!("share_gpus: {e}")))
            })
            .transpose()?;
        if !self.cdi_dir.is_absolute() {
            return Err(AgentError::Config(format!(
                "cdi_dir: {} is not an absolute path",
                self.cdi_dir.display()
            )));
        }
        Ok(AgentConfig {
            cdi_dir: (!self.no_cdi).then(|| self.cdi_dir.clone()),
            task_user,
            task_users,
            allowed_users,
            task_pids_max,
            allow_root_tasks: self.allow_root_tasks,
            allowed_mounts,
            share_gpus,
            ports: parse_ports(&self.ports)?,
            task_retention,
            masters,
            work_dir: self.work_dir.clone(),
            listen,
            security,
            advertise: self.advertise.clone(),
            simulate_gpus: self.simulate_gpus.clone(),
            runtimes: self.runtime.as_deref().map(parse_runtimes).transpose()?,
            nvml_lib: self.nvml_lib.clone(),
            mps_control: self.mps_control.clone(),
            docker_cap_runtime: self
                .docker_cap_runtime
                .clone()
                .unwrap_or_else(|| DEFAULT_CAP_RUNTIME.to_string()),
            cpus: self.cpus,
            mem_mib: self.mem_mib,
            kill_grace: Duration::from_secs_f64(self.kill_grace_secs),
            cgroup_parent: self.cgroup_parent.clone(),
            cgroup_root: self.cgroup_root.clone(),
            dev_root: self.dev_root.clone(),
            nvidia_proc_root: self.nvidia_proc_root.clone(),
            driver_root: self.driver_root.clone(),
            attributes,
            health,
            metrics_listen: self.metrics_listen,
            supervisor_exe: None,
            stop_tasks_on_shutdown: self.stop_tasks_on_shutdown,
        })
    }

    /// GPU health checks and resets.
    fn health_config(&self) -> Result<HealthConfig, AgentError> {
        let secs = |name: &str, v: f64, min: f64| {
            if v.is_finite() && (min..=86_400.0).contains(&v) {
                Ok(Duration::from_secs_f64(v))
            } else {
                Err(AgentError::Config(format!(
                    "{name} must be between {min} and 86400, got {v}"
                )))
            }
        };
        Ok(HealthConfig {
            interval: secs("health_interval_secs", self.health_interval_secs, 0.05)?,
            recovery: secs("health_recovery_secs", self.health_recovery_secs, 0.0)?,
            ignored_xids: parse_xids("health_ignore_xids", &self.health_ignore_xids)?,
            node_xids: parse_xids("health_node_xids", &self.health_node_xids)?,
            reset_command: parse_reset_command(&self.gpu_reset_command)?,
            max_resets: self.gpu_max_resets,
            preflight_command: parse_preflight_command(&self.preflight_command),
            preflight_timeout: secs("preflight_timeout_secs", self.preflight_timeout_secs, 0.1)?,
            // The agent's start puts it in the work dir.
            state_file: None,
        })
    }

    /// TLS and joining: `tls_dir`, with a join token when the agent has no
    /// certificate yet.
    fn security(&self) -> Result<Option<AgentSecurity>, AgentError> {
        if self.join_token.is_some() && self.join_token_file.is_some() {
            return Err(AgentError::Config(
                "join_token and join_token_file: give one of them".into(),
            ));
        }
        let join_token = self.join_token.as_ref().map(|t| t.trim().to_string());
        Ok(match &self.tls_dir {
            Some(dir) => Some(AgentSecurity {
                tls_dir: dir.clone(),
                join_token,
                join_token_file: self.join_token_file.clone(),
            }),
            None if join_token.is_some() || self.join_token_file.is_some() => {
                return Err(AgentError::Config(
                    "join_token needs tls_dir: the directory that holds the cluster's ca.crt \
                     and where the agent keeps its certificate"
                        .into(),
                ))
            }
            None => None,
        })
    }

    /// The user host tasks run as, the users of their own they get, and
    /// those a job may name (never the same ids).
    fn task_users(&self) -> Result<(UserIds, IdRanges, IdRanges), AgentError> {
        let task_user: UserIds = self
            .task_user
            .parse()
            .map_err(|e| AgentError::Config(format!("task_user: {e}")))?;
        if task_user.is_root() {
            return Err(AgentError::Config(format!(
                "task_user: {task_user} is root (uid or gid 0); host-process tasks run as root only for jobs that ask, with allow_root_tasks"
            )));
        }
        let task_users = IdRanges::parse(&self.task_users)
            .map_err(|e| AgentError::Config(format!("task_users: {e}")))?;
        let allowed_users = IdRanges::parse(&self.allowed_users)
            .map_err(|e| AgentError::Config(format!("allowed_users: {e}")))?;
        if task_users.overlaps(&allowed_users) {
            return Err(AgentError::Config(format!(
                "allowed_users ({allowed_users}) overlaps task_users ({task_users}): a job could \
                 choose the uid another task was given"
            )));
        }
        Ok((task_user, task_users, allowed_users))
    }
}

/// `--attribute KEY=VALUE`s, as the agent's attributes.
fn parse_attributes(
    list: &[String],
) -> Result<std::collections::BTreeMap<String, String>, AgentError> {
    let mut attributes = std::collections::BTreeMap::new();
    for a in list {
        match a.split_once('=') {
            Some((k, v))
                if !k.trim().is_empty()
                    && !k.contains(char::is_whitespace)
                    && !v.chars().any(char::is_control) =>
            {
                attributes.insert(k.trim().to_string(), v.to_string());
            }
            _ => {
                return Err(AgentError::Config(format!(
                    "attribute: {a:?} is not KEY=VALUE"
                )))
            }
        }
    }
    Ok(attributes)
}

/// The default `--task-users`: Nomad's default for its dynamic workload
/// users, clear of Debian's users (1000-59999), its reserved ids
/// (60000-64999), nobody (65534) and the first subordinate ids (100000+).
pub const DEFAULT_TASK_USERS: &str = "80000-89999";

/// The default `--task-pids-max`: processes and threads of one task. A
/// training process has a few hundred threads, its data loader workers
/// as many again; a fork bomb stops here.
pub const DEFAULT_TASK_PIDS_MAX: u64 = 8192;
/// Fewer would not start a shell and its task-init.
const MIN_TASK_PIDS: u64 = 16;

/// The default `--allowed-users`: Debian's (and most distributions') range
/// for people's accounts; system accounts and groups (`shadow`, `docker`,
/// `disk`) lie below it.
pub const DEFAULT_ALLOWED_USERS: &str = "1000-59999";

/// The default `--ports`: Mesos' default range, below Linux's ephemeral
/// ports (32768-60999).
pub const DEFAULT_PORTS: &str = "31000-32000";

/// `--ports`: `START-END`, or `none` (or empty) for no ports.
pub fn parse_ports(s: &str) -> Result<Option<PortRange>, AgentError> {
    let s = s.trim();
    if s.is_empty() || s.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    PortRange::parse(s)
        .map(Some)
        .map_err(|e| AgentError::Config(format!("ports: {e}")))
}

/// Absolute plain paths (as a job's mount host paths must be), trimmed,
/// at most [`gpuctl_core::convert::MAX_ALLOWED_MOUNTS`].
pub fn parse_allowed_mounts(paths: &[String]) -> Result<Vec<String>, AgentError> {
    use gpuctl_core::convert::{check_abs_path, MAX_ALLOWED_MOUNTS};
    let paths: Vec<String> = paths
        .iter()
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect();
    if paths.len() > MAX_ALLOWED_MOUNTS {
        return Err(AgentError::Config(format!(
            "allowed_mounts: {} paths, at most {MAX_ALLOWED_MOUNTS}",
            paths.len()
        )));
    }
    for (i, p) in paths.iter().enumerate() {
        check_abs_path(&format!("allowed_mounts[{i}]"), p)
            .map_err(|e| AgentError::Config(e.to_string()))?;
    }
    Ok(paths)
}

/// `13,31,43` or `none`, for the option `field`.
pub fn parse_xids(field: &str, s: &str) -> Result<std::collections::BTreeSet<u64>, AgentError> {
    if s.trim().eq_ignore_ascii_case("none") {
        return Ok(Default::default());
    }
    let parts = split_list(s);
    if parts.is_empty() {
        return Err(AgentError::Config(format!(
            "{field}: empty list (write \"none\" for no XID)"
        )));
    }
    parts
        .iter()
        .map(|p| {
            p.parse::<u64>()
                .map_err(|_| AgentError::Config(format!("{field}: {p:?} is not an XID number")))
        })
        .collect()
}

/// The preflight command, split on spaces; `none` (or nothing): none.
pub fn parse_preflight_command(s: &str) -> Vec<String> {
    if s.trim().eq_ignore_ascii_case("none") {
        return Vec::new();
    }
    s.split_whitespace().map(str::to_string).collect()
}

/// The reset command, split on spaces; `none`: no resets.
pub fn parse_reset_command(s: &str) -> Result<Vec<String>, AgentError> {
    if s.trim().eq_ignore_ascii_case("none") {
        return Ok(Vec::new());
    }
    let words: Vec<String> = s.split_whitespace().map(str::to_string).collect();
    if words.is_empty() {
        return Err(AgentError::Config(
            "gpu_reset_command: empty (write \"none\" to never reset)".into(),
        ));
    }
    Ok(words)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_retention_defaults_and_comes_from_flags_and_file() {
        let c = Options::load_from(["gpuctl-agent"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.task_retention, Duration::from_secs(24 * 3600));
        assert_eq!(
            AgentConfig::new(vec![], "/x".into()).task_retention,
            c.task_retention
        );
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("agent.toml");
        std::fs::write(&f, "task_retention = \"3d\"\n").unwrap();
        let file = ["gpuctl-agent", "--config", f.to_str().unwrap()];
        let c = Options::load_from(file).unwrap().to_config().unwrap();
        assert_eq!(c.task_retention, Duration::from_secs(3 * 24 * 3600));
        let mut flags = file.to_vec();
        flags.extend(["--task-retention", "90m"]);
        let c = Options::load_from(flags).unwrap().to_config().unwrap();
        assert_eq!(c.task_retention, Duration::from_secs(90 * 60), "flag wins");
        for bad in ["0", "1y", "later"] {
            let e = Options::load_from(["gpuctl-agent", "--task-retention", bad])
                .unwrap()
                .to_config()
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("task_retention") && e.contains(bad),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn the_docker_cap_runtime_defaults_to_gpuctl_and_empty_turns_it_off() {
        let load = |args: &[&str]| {
            let mut a = vec!["gpuctl-agent"];
            a.extend(args);
            Options::load_from(a).unwrap().to_config().unwrap()
        };
        assert_eq!(load(&[]).docker_cap_runtime, "gpuctl");
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("agent.toml");
        std::fs::write(&f, "docker_cap_runtime = \"\"\n").unwrap();
        let file = f.to_str().unwrap();
        assert_eq!(load(&["--config", file]).docker_cap_runtime, "");
        let c = load(&["--config", file, "--docker-cap-runtime", "nv"]);
        assert_eq!(c.docker_cap_runtime, "nv", "flag wins");
    }

    #[test]
    fn share_gpus_is_a_mode_from_flag_or_file() {
        use gpuctl_core::types::ShareMode;
        let load = |args: &[&str]| {
            let mut a = vec!["gpuctl-agent"];
            a.extend(args);
            Options::load_from(a).unwrap().to_config()
        };
        assert_eq!(load(&[]).unwrap().share_gpus, None);
        assert_eq!(
            load(&["--share-gpus", "mps"]).unwrap().share_gpus,
            Some(ShareMode::Mps)
        );
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("agent.toml");
        std::fs::write(&f, "share_gpus = \"time-slice\"\n").unwrap();
        assert_eq!(
            load(&["--config", f.to_str().unwrap()]).unwrap().share_gpus,
            Some(ShareMode::TimeSlice)
        );
        let e = load(&["--share-gpus", "half"]).unwrap_err().to_string();
        assert!(e.contains("share_gpus"), "{e}");
    }

    #[test]
    fn ports_default_to_mesos_range_and_come_from_flags_and_file() {
        let load = |args: &[&str]| {
            let mut a = vec!["gpuctl-agent"];
            a.extend(args);
            Options::load_from(a).unwrap().to_config()
        };
        let range = |s: u16, e: u16| Some(PortRange { start: s, end: e });
        assert_eq!(load(&[]).unwrap().ports, range(31000, 32000));
        assert_eq!(
            AgentConfig::new(vec![], "/x".into()).ports,
            range(31000, 32000)
        );
        assert_eq!(load(&["--ports", "none"]).unwrap().ports, None);
        assert_eq!(
            load(&["--ports", "5000-5009"]).unwrap().ports,
            range(5000, 5009)
        );
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("agent.toml");
        std::fs::write(&f, "ports = \"6000-6001\"\n").unwrap();
        let file = f.to_str().unwrap();
        assert_eq!(load(&["--config", file]).unwrap().ports, range(6000, 6001));
        for bad in ["5000", "9-1", "0-10", "70000-70001"] {
            let e = load(&["--ports", bad]).unwrap_err().to_string();
            assert!(
                e.starts_with("ports:") || e.contains("ports: "),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn task_user_ranges_default_come_from_flags_and_file_and_never_overlap() {
        let load = |args: &[&str]| {
            let mut a = vec!["gpuctl-agent"];
            a.extend(args);
            Options::load_from(a).unwrap().to_config()
        };
        let c = load(&[]).unwrap();
        assert_eq!(c.task_users.to_string(), "80000-89999");
        assert_eq!(c.allowed_users.to_string(), "1000-59999");
        let fresh = AgentConfig::new(vec![], "/x".into());
        assert_eq!(
            (fresh.task_users, fresh.allowed_users),
            (c.task_users, c.allowed_users)
        );
        let c = load(&["--task-users", "none", "--allowed-users", "2000-2999,5000"]).unwrap();
        assert!(c.task_users.is_empty());
        assert_eq!(c.allowed_users.to_string(), "2000-2999,5000");
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("agent.toml");
        std::fs::write(
            &f,
            "task_users = \"70000-70009\"\nallowed_users = \"none\"\ntask_pids_max = 100\n",
        )
        .unwrap();
        let c = load(&["--config", f.to_str().unwrap()]).unwrap();
        assert_eq!(c.task_users.to_string(), "70000-70009");
        assert!(c.allowed_users.is_empty());
        assert_eq!(c.task_pids_max, Some(100));
        std::fs::write(&f, "task_pids_max = \"none\"\n").unwrap();
        let c = load(&["--config", f.to_str().unwrap()]).unwrap();
        assert_eq!(c.task_pids_max, None);
        let e = load(&["--task-users", "50000-50100"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("overlaps task_users"), "{e}");
        let e = load(&["--task-users", "0-10"]).unwrap_err().to_string();
        assert!(
            e.starts_with("task_users:") || e.contains("task_users: "),
            "{e}"
        );
        let e = load(&["--allowed-users", "x"]).unwrap_err().to_string();
        assert!(e.contains("allowed_users: "), "{e}");
        assert_eq!(load(&[]).unwrap().task_pids_max, Some(8192));
        assert_eq!(
            load(&["--task-pids-max", "none"]).unwrap().task_pids_max,
            None
        );
        assert_eq!(
            load(&["--task-pids-max", "64"]).unwrap().task_pids_max,
            Some(64)
        );
        for bad in ["0", "15", "1e3", "lots"] {
            let e = load(&["--task-pids-max", bad]).unwrap_err().to_string();
            assert!(e.contains("task_pids_max"), "{bad}: {e}");
        }
    }

    #[test]
    fn task_security_options_default_and_come_from_flags_env_and_file() {
        let c = Options::load_from(["gpuctl-agent"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(
            c.task_user,
            UserIds {
                uid: 65534,
                gid: 65534
            }
        );
        assert!(!c.allow_root_tasks);
        assert!(c.allowed_mounts.is_empty());
        let d = AgentConfig::new(vec![], "/x".into());
        assert_eq!(
            (d.task_user, d.allow_root_tasks, d.allowed_mounts.len()),
            (c.task_user, false, 0)
        );

        let c = Options::load_from([
            "gpuctl-agent",
            "--task-user",
            "1000",
            "--allow-root-tasks",
            "--allowed-mounts",
            "/data,/scratch",
            "--allowed-mounts",
            "/models",
        ])
        .unwrap()
        .to_config()
        .unwrap();
        assert_eq!(
            c.task_user,
            UserIds {
                uid: 1000,
                gid: 1000
            }
        );
        assert!(c.allow_root_tasks);
        assert_eq!(c.allowed_mounts, ["/data", "/scratch", "/models"]);

        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("agent.toml");
        std::fs::write(
            &f,
            "task_user = \"2000:3000\"\nallow_root_tasks = true\nallowed_mounts = [\"/datasets\"]\n",
        )
        .unwrap();
        let file = ["gpuctl-agent", "--config", f.to_str().unwrap()];
        let c = Options::load_from(file).unwrap().to_config().unwrap();
        assert_eq!(
            c.task_user,
            UserIds {
                uid: 2000,
                gid: 3000
            }
        );
        assert!(c.allow_root_tasks);
        assert_eq!(c.allowed_mounts, ["/datasets"]);
        let mut flags = file.to_vec();
        flags.extend(["--task-user", "4000:4000", "--allowed-mounts", "/x"]);
        let c = Options::load_from(flags).unwrap().to_config().unwrap();
        assert_eq!(
            c.task_user,
            UserIds {
                uid: 4000,
                gid: 4000
            },
            "flag wins"
        );
        assert_eq!(c.allowed_mounts, ["/x"], "flag wins");

        for (flag, bad, words) in [
            ("--task-user", "0", "root"),
            ("--task-user", "1000:0", "root"),
            ("--task-user", "nobody", "UID"),
            ("--allowed-mounts", "data", "allowed_mounts[0]"),
            ("--allowed-mounts", "/a,/b/../etc", "allowed_mounts[1]"),
        ] {
            let e = Options::load_from(["gpuctl-agent", flag, bad])
                .unwrap()
                .to_config()
                .unwrap_err()
                .to_string();
            let name = flag.trim_start_matches("--").replace('-', "_");
            assert!(e.contains(&name) && e.contains(words), "{flag} {bad}: {e}");
        }
    }

    #[test]
    fn cdi_options_default_and_come_from_flags_env_and_file() {
        let c = Options::load_from(["gpuctl-agent"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.cdi_dir, Some(PathBuf::from("/var/run/cdi")));
        assert_eq!(AgentConfig::new(vec![], "/x".into()).cdi_dir, c.cdi_dir);
        let c = Options::load_from(["gpuctl-agent", "--cdi-dir", "/etc/cdi"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.cdi_dir, Some(PathBuf::from("/etc/cdi")));
        let c = Options::load_from(["gpuctl-agent", "--no-cdi"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.cdi_dir, None);

        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("agent.toml");
        std::fs::write(&f, "cdi_dir = \"/run/gpuctl-cdi\"\nno_cdi = false\n").unwrap();
        let file = ["gpuctl-agent", "--config", f.to_str().unwrap()];
        let c = Options::load_from(file).unwrap().to_config().unwrap();
        assert_eq!(c.cdi_dir, Some(PathBuf::from("/run/gpuctl-cdi")));
        let mut flags = file.to_vec();
        flags.push("--no-cdi");
        let c = Options::load_from(flags).unwrap().to_config().unwrap();
        assert_eq!(c.cdi_dir, None, "flag wins");
        std::fs::write(&f, "no_cdi = true\n").unwrap();
        let c = Options::load_from(file).unwrap().to_config().unwrap();
        assert_eq!(c.cdi_dir, None);

        let e = Options::load_from(["gpuctl-agent", "--cdi-dir", "cdi"])
            .unwrap()
            .to_config()
            .unwrap_err()
            .to_string();
        assert!(e.contains("cdi_dir") && e.contains("absolute"), "{e}");
    }

    #[test]
    fn attributes_are_key_value_pairs() {
        let o = Options::load_from([
            "gpuctl-agent",
            "--attribute",
            "zone=us-east",
            "--attribute",
            "rack=r 7",
        ])
        .unwrap();
        let c = o.to_config().unwrap();
        assert_eq!(c.attributes["zone"], "us-east");
        assert_eq!(c.attributes["rack"], "r 7");
        for bad in ["zone", "=x", "a b=c"] {
            let o = Options::load_from(["gpuctl-agent", "--attribute", bad]).unwrap();
            let e = o.to_config().unwrap_err().to_string();
            assert!(e.contains("attribute"), "{bad}: {e}");
        }
    }

    #[test]
    fn file_fills_unset_options_and_flags_win() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("agent.toml");
        std::fs::write(
            &f,
            "master = \"m1:7050, m2:7050\"\nsimulate_gpus = \"2xT4\"\nruntime = \"process\"\nkill_grace_secs = 3\n",
        )
        .unwrap();
        let o = Options::load_from([
            "gpuctl-agent",
            "--config",
            f.to_str().unwrap(),
            "--work-dir",
            "/tmp/w",
        ])
        .unwrap();
        let c = o.to_config().unwrap();
        assert_eq!(c.masters, vec!["m1:7050", "m2:7050"]);
        assert_eq!(c.work_dir, PathBuf::from("/tmp/w"));
        assert_eq!(c.runtimes, Some(vec![Runtime::Process]));
        assert_eq!(c.kill_grace, Duration::from_secs(3));
    }

    #[test]
    fn bad_values_name_the_option() {
        let o = Options::load_from(["gpuctl-agent", "--runtime", "podman"]).unwrap();
        assert!(o.to_config().unwrap_err().to_string().contains("runtime"));
        let o = Options::load_from(["gpuctl-agent", "--simulate-gpus", "lots"]).unwrap();
        assert!(o
            .to_config()
            .unwrap_err()
            .to_string()
            .contains("--simulate-gpus"));
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("agent.toml");
        std::fs::write(&f, "gpus = 3\n").unwrap();
        let err = Options::load_from(["gpuctl-agent", "--config", f.to_str().unwrap()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("gpus"), "{err}");
    }

    #[test]
    fn health_options_parse_and_bad_ones_are_named() {
        let c = Options::load_from(["gpuctl-agent"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.health, HealthConfig::default());
        assert_eq!(
            c.health.ignored_xids.iter().copied().collect::<Vec<_>>(),
            vec![13, 31, 43, 45, 68, 109]
        );
        let c = Options::load_from([
            "gpuctl-agent",
            "--health-interval-secs",
            "0.5",
            "--health-recovery-secs",
            "0",
            "--health-ignore-xids",
            "none",
            "--health-node-xids",
            "140,154",
            "--gpu-reset-command",
            "none",
            "--gpu-max-resets",
            "5",
            "--metrics-listen",
            "127.0.0.1:9400",
        ])
        .unwrap()
        .to_config()
        .unwrap();
        assert_eq!(c.health.interval, Duration::from_millis(500));
        assert_eq!(c.health.recovery, Duration::ZERO);
        assert!(c.health.ignored_xids.is_empty());
        assert_eq!(c.health.node_xids, [140, 154].into_iter().collect());
        assert!(c.health.reset_command.is_empty());
        assert_eq!(c.health.max_resets, 5);
        let r = Options::load_from(["gpuctl-agent", "--gpu-reset-command", "/bin/r -i {uuid}"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(r.health.reset_command, ["/bin/r", "-i", "{uuid}"]);
        assert_eq!(c.metrics_listen, Some("127.0.0.1:9400".parse().unwrap()));
        for (flag, bad) in [
            ("--health-interval-secs", "0"),
            ("--health-recovery-secs", "1e9"),
            ("--health-ignore-xids", "13,x"),
            ("--health-ignore-xids", ","),
            ("--health-node-xids", "79,x"),
            ("--gpu-reset-command", " "),
        ] {
            let e = Options::load_from(["gpuctl-agent", flag, bad])
                .unwrap()
                .to_config()
                .unwrap_err()
                .to_string();
            let name = flag.trim_start_matches("--").replace('-', "_");
            assert!(e.contains(&name), "{flag} {bad}: {e}");
        }
    }
}
