//! The master's options as given: flags, environment variables and the
//! TOML file, one declaration (`Options`), and their check into a
//! [`MasterConfig`] (`to_config`).

use super::*;

/// gpuctl-master: the gpuctl cluster master.
#[derive(Debug, Parser)]
#[command(name = "gpuctl-master", version, about)]
pub struct Options {
    /// TOML file with any of the options below (keys as the long flag names,
    /// with '_' for '-'). Flags and environment variables override it.
    #[arg(long, env = "GPUCTL_MASTER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address for the gRPC API (gpuctl, agents, frameworks). Default:
    /// 0.0.0.0:7050 with TLS, 127.0.0.1:7050 without (only --insecure lets
    /// a master without TLS listen beyond loopback).
    #[arg(long, env = "GPUCTL_MASTER_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Directory of this master's TLS files as `gpuctl certs init` writes
    /// them: ca.crt, master-<node_id>.crt and .key, and if present ca.key
    /// (to sign agents' certificates) and bootstrap.token (the first admin
    /// token). Turns on mutual TLS and tokens.
    #[arg(long, env = "GPUCTL_MASTER_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,
    /// The CA certificates to trust (default: <tls_dir>/ca.crt).
    #[arg(long, env = "GPUCTL_MASTER_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// This master's certificate (default: <tls_dir>/master-<node_id>.crt).
    #[arg(long, env = "GPUCTL_MASTER_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// Its key (default: <tls_dir>/master-<node_id>.key).
    #[arg(long, env = "GPUCTL_MASTER_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The CA's key, to sign agents' certificates (default:
    /// <tls_dir>/ca.key when it exists).
    #[arg(long, env = "GPUCTL_MASTER_CA_KEY")]
    pub ca_key: Option<PathBuf>,
    /// File with the first admin token (default: <tls_dir>/bootstrap.token
    /// when it exists).
    #[arg(long, env = "GPUCTL_MASTER_BOOTSTRAP_TOKEN_FILE")]
    pub bootstrap_token_file: Option<PathBuf>,
    /// Lifetime of agents' certificates (renewed after two thirds), e.g. 7d.
    #[arg(long, env = "GPUCTL_MASTER_AGENT_CERT_TTL", default_value = "7d")]
    pub agent_cert_ttl: String,
    /// Lifetime of client certificates got with `gpuctl login`, e.g. 30d.
    #[arg(long, env = "GPUCTL_MASTER_CLIENT_CERT_TTL", default_value = "30d")]
    pub client_cert_ttl: String,
    /// Serve without TLS on a non-loopback address: anyone who reaches the
    /// port can run anything as root on every agent. For isolated labs only.
    #[arg(long, env = "GPUCTL_MASTER_INSECURE")]
    pub insecure: bool,
    /// Where the replicated log and state are kept.
    #[arg(
        long,
        env = "GPUCTL_MASTER_DATA_DIR",
        default_value = "/var/lib/gpuctl/master"
    )]
    pub data_dir: PathBuf,
    /// This master's Raft node id (>= 1).
    #[arg(long, env = "GPUCTL_MASTER_NODE_ID", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub node_id: u64,
    /// Seconds between agent heartbeats.
    #[arg(
        long,
        env = "GPUCTL_MASTER_HEARTBEAT_INTERVAL_SECS",
        default_value_t = 1.0
    )]
    pub heartbeat_interval_secs: f64,
    /// Seconds without a heartbeat before an agent is marked UNREACHABLE
    /// (its tasks too; they keep their GPUs and nothing new goes there).
    #[arg(long, env = "GPUCTL_MASTER_AGENT_TIMEOUT_SECS", default_value_t = 10.0)]
    pub agent_timeout_secs: f64,
    /// Seconds without a heartbeat before an agent is marked LOST and its
    /// tasks LOST (their jobs are retried; their GPUs stay held until the
    /// agent confirms the tasks are gone). Must exceed
    /// agent_fence_timeout_secs plus the agents' kill grace plus 5 s plus
    /// two election timeouts.
    #[arg(
        long,
        env = "GPUCTL_MASTER_AGENT_LOST_TIMEOUT_SECS",
        default_value_t = 120.0
    )]
    pub agent_lost_timeout_secs: f64,
    /// Seconds without a leader after which an agent kills its tasks itself
    /// (sent to agents when they register). Must exceed agent_timeout_secs.
    #[arg(
        long,
        env = "GPUCTL_MASTER_AGENT_FENCE_TIMEOUT_SECS",
        default_value_t = 75.0
    )]
    pub agent_fence_timeout_secs: f64,
    /// A role of the framework API: `NAME=weight:W[,cpus:N][,mem_mib:N][,gpus:N]`
    /// (weight for DRF, default 1; the others a quota limit). Repeatable.
    #[arg(long = "role", value_name = "SPEC")]
    pub roles: Vec<String>,
    /// Offer agents that have GPUs to frameworks without the GPU_RESOURCES
    /// capability too (by default they are kept for GPU work).
    #[arg(long, env = "GPUCTL_MASTER_OFFER_GPU_AGENTS_TO_ALL")]
    pub offer_gpu_agents_to_all: bool,
    /// Seconds before an unanswered offer is rescinded.
    #[arg(long, env = "GPUCTL_MASTER_OFFER_TIMEOUT_SECS", default_value_t = 30.0)]
    pub offer_timeout_secs: f64,
    /// Milliseconds between allocation rounds (10 to 10000); freed or new
    /// resources and a Revive start a round at once.
    #[arg(
        long,
        env = "GPUCTL_MASTER_ALLOCATION_INTERVAL_MS",
        default_value_t = 100
    )]
    pub allocation_interval_ms: u64,
    /// Seconds before a task update its framework has not acknowledged is
    /// sent to it again (then twice as long each time, up to 600 s).
    #[arg(long, env = "GPUCTL_MASTER_UPDATE_RESEND_SECS", default_value_t = 10.0)]
    pub update_resend_secs: f64,
    /// Cpus kept for each free GPU of an agent (at most the agent's cpus
    /// per GPU): offers without the GPU leave them, an offer with it
    /// carries them.
    #[arg(long, env = "GPUCTL_MASTER_GPU_RESERVED_CPUS", default_value_t = 2.0)]
    pub gpu_reserved_cpus: f64,
    /// MiB of memory kept for each free GPU, like `--gpu-reserved-cpus`.
    #[arg(
        long,
        env = "GPUCTL_MASTER_GPU_RESERVED_MEM_MIB",
        default_value_t = 8192
    )]
    pub gpu_reserved_mem_mib: u64,
    /// The masters of the Raft group at bootstrap, this one included:
    /// `ID=HOST:PORT,ID=HOST:PORT,...` (their API addresses, which also carry
    /// Raft). Only read when the data dir is new; later changes go through
    /// `gpuctl masters add/remove`. Empty: a group of this master alone.
    #[arg(long, env = "GPUCTL_MASTER_PEERS", default_value = "")]
    pub peers: String,
    /// `HOST:PORT` at which other masters and clients reach this one.
    /// Default: this master's entry in `--peers`, else `--listen`.
    #[arg(long, env = "GPUCTL_MASTER_ADVERTISE")]
    pub advertise: Option<String>,
    /// Join an existing group: start with no members and wait for
    /// `gpuctl masters add ID HOST:PORT` at the leader.
    #[arg(long, env = "GPUCTL_MASTER_JOIN")]
    pub join: bool,
    /// Milliseconds without a leader before a follower stands for election
    /// (randomized up to twice that). Every master of a group should agree.
    #[arg(
        long,
        env = "GPUCTL_MASTER_ELECTION_TIMEOUT_MS",
        default_value_t = 1000
    )]
    pub election_timeout_ms: u64,
    /// Log entries between snapshots of the state (and log compaction).
    #[arg(long, env = "GPUCTL_MASTER_SNAPSHOT_EVERY", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub snapshot_every: u64,
    /// The most heartbeats a second the leader asks of all agents: a big
    /// cluster's agents are asked to beat less often (never less than
    /// three times per --agent-timeout-secs), so that the leader's cost of
    /// hearing them does not grow with the cluster. 0: no limit.
    #[arg(long, env = "GPUCTL_MASTER_MAX_HEARTBEATS_PER_SEC", default_value_t = DEFAULT_MAX_HEARTBEATS_PER_SEC)]
    pub max_heartbeats_per_sec: u32,
    /// How jobs are placed unless they choose: `bundle` packs GPU jobs onto
    /// the fewest agents (whole agents stay free for big jobs), `spread`
    /// does the opposite.
    #[arg(long, env = "GPUCTL_MASTER_PLACEMENT", default_value = "bundle", value_parser = ["bundle", "spread"])]
    pub placement: String,
    /// Repartition idle GPUs that are in MIG mode for queued jobs waiting
    /// for a MIG profile that no free MIG device offers (docs/sharing.md).
    #[arg(long, env = "GPUCTL_MASTER_MIG_AUTO")]
    pub mig_auto: bool,
    /// Take GPUs back from tenants over their fair share for tenants below
    /// theirs, from jobs that have run at least this long (`1m`, `30s`);
    /// `off`: never (docs/scheduling.md).
    #[arg(
        long,
        env = "GPUCTL_MASTER_RECLAIM_MIN_RUNTIME",
        default_value = "1m",
        value_name = "DURATION|off"
    )]
    pub reclaim_min_runtime: String,
    /// Restart an elastic gang (`--replicas MIN:MAX`) with more ranks once
    /// its attempt has run this long and GPUs are free for more (none that
    /// a queued job of its priority or higher waits for); `off`: elastic
    /// gangs keep the size they started with (docs/scheduling.md).
    #[arg(
        long,
        env = "GPUCTL_MASTER_ELASTIC_GROW_AFTER",
        default_value = "1m",
        value_name = "DURATION|off"
    )]
    pub elastic_grow_after: String,
    /// The leader records each GPU's mean utilization over periods this
    /// long, in the replicated state (a day of periods per GPU; hourly
    /// means for a week), for `gpuctl usage` and the console; `off`: none.
    /// From 1s to 1h.
    #[arg(
        long,
        env = "GPUCTL_MASTER_UTILIZATION_PERIOD",
        default_value = "1m",
        value_name = "DURATION|off"
    )]
    pub utilization_period: String,
    /// A running job whose GPUs all stay under `--idle-below` percent for
    /// this long is flagged idle: an `Idle` event and a flag in `jobs list`
    /// and the console (needs `--utilization-period`); `off`: none.
    #[arg(
        long,
        env = "GPUCTL_MASTER_IDLE_WINDOW",
        default_value = "30m",
        value_name = "DURATION|off"
    )]
    pub idle_window: String,
    /// The utilization (percent, 1 to 100) under which a GPU counts as
    /// idle for `--idle-window`.
    #[arg(
        long,
        env = "GPUCTL_MASTER_IDLE_BELOW",
        default_value_t = 5,
        value_name = "PCT"
    )]
    pub idle_below: u8,
    /// How long a framework is told before its tasks are reclaimed for a
    /// framework below its fair share (the inverse offer's deadline).
    #[arg(
        long,
        env = "GPUCTL_MASTER_RECLAIM_NOTICE",
        default_value = "10s",
        value_name = "DURATION"
    )]
    pub reclaim_notice: String,
    /// Log filter (tracing EnvFilter syntax), e.g. `info` or `gpuctl_master=debug`.
    #[arg(long, env = "GPUCTL_LOG", default_value = "info")]
    pub log: String,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics.
    #[arg(long, env = "GPUCTL_MASTER_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Serve the web console at HOST:PORT (docs/console.md): HTTPS with
    /// this master's certificate when TLS is configured, else HTTP on a
    /// loopback address only (unless --insecure). Off when unset.
    #[arg(long, env = "GPUCTL_MASTER_HTTP_LISTEN")]
    pub http_listen: Option<SocketAddr>,
    /// How long a finished job (with its tasks) is kept after it ended,
    /// e.g. 7d, 24h, 90m; then it is forgotten (`gpuctl jobs get` says so).
    /// Ended framework tasks too, once acknowledged.
    #[arg(long, env = "GPUCTL_MASTER_JOB_RETENTION", default_value = "7d")]
    pub job_retention: String,
    /// Most finished jobs kept (and most ended framework tasks): beyond it
    /// the oldest are forgotten before their retention ends.
    #[arg(long, env = "GPUCTL_MASTER_JOB_RETENTION_MAX", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub job_retention_max: u64,
    /// The longest stop grace a job may ask for (`gpuctl jobs submit
    /// --stop-grace`), in seconds: the time between SIGTERM and SIGKILL
    /// when the cluster stops its tasks. A job asking more is refused.
    #[arg(long, env = "GPUCTL_MASTER_MAX_STOP_GRACE_SECS", default_value_t = 300, value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub max_stop_grace_secs: u64,
}

/// Parses `ID=HOST:PORT[,ID=HOST:PORT...]` (empty: none).
pub fn parse_peers(spec: &str) -> Result<BTreeMap<u64, String>, MasterError> {
    let mut out = BTreeMap::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = |why: String| MasterError::Config(format!("peers: {part:?}: {why}"));
        let (id, addr) = part
            .split_once('=')
            .ok_or_else(|| bad("expected ID=HOST:PORT".into()))?;
        let id: u64 = id
            .trim()
            .parse()
            .ok()
            .filter(|i| *i >= 1)
            .ok_or_else(|| bad(format!("node id {id:?} is not a number >= 1")))?;
        let addr = addr.trim();
        check_host_port("peers", addr).map_err(|e| bad(e.to_string()))?;
        if out.insert(id, addr.to_string()).is_some() {
            return Err(bad(format!("node id {id} appears twice")));
        }
    }
    Ok(out)
}

/// Parses `NAME=weight:W[,cpus:N][,mem_mib:N][,gpus:N]`.
pub fn parse_role(spec: &str) -> Result<(String, RoleConfig), MasterError> {
    let bad = |why: String| MasterError::Config(format!("role {spec:?}: {why}"));
    let (name, rest) = spec.split_once('=').unwrap_or((spec, ""));
    gpuctl_core::convert::check_id("role", name.trim()).map_err(|e| bad(e.to_string()))?;
    let mut role = RoleConfig::default();
    let mut quota = Resources::default();
    let mut limited = false;
    for part in rest.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (key, value) = part
            .split_once(':')
            .ok_or_else(|| bad(format!("{part:?} is not KEY:VALUE")))?;
        let num: f64 = value
            .trim()
            .parse()
            .map_err(|_| bad(format!("{key}: {value:?} is not a number")))?;
        if !num.is_finite() || num < 0.0 {
            return Err(bad(format!("{key} must be a number >= 0")));
        }
        match key.trim() {
            "weight" if num > 0.0 => role.weight = num,
            "weight" => return Err(bad("weight must be > 0".into())),
            "cpus" => {
                quota.cpus = num;
                limited = true;
            }
            "mem_mib" => {
                quota.mem_mib = num as u64;
                limited = true;
            }
            "gpus" => {
                quota.gpus = num as u32;
                limited = true;
            }
            other => {
                return Err(bad(format!(
                    "unknown key {other:?} (weight, cpus, mem_mib, gpus)"
                )))
            }
        }
    }
    if limited {
        // Dimensions not named are not limited.
        role.quota = Some(Resources {
            cpus: if rest.contains("cpus:") {
                quota.cpus
            } else {
                f64::MAX
            },
            mem_mib: if rest.contains("mem_mib:") {
                quota.mem_mib
            } else {
                u64::MAX
            },
            gpus: if rest.contains("gpus:") {
                quota.gpus
            } else {
                u32::MAX
            },
            // Ports are not a quota dimension (they are per host).
            ports: u32::MAX,
        });
    }
    Ok((name.trim().to_string(), role))
}

pub(super) fn secs(field: &str, v: f64) -> Result<Duration, MasterError> {
    if !v.is_finite() || v <= 0.0 || v > 86400.0 {
        return Err(MasterError::Config(format!(
            "{field} must be between 0 and 86400 seconds, got {v}"
        )));
    }
    Ok(Duration::from_secs_f64(v))
}

impl Options {
    /// Parses argv and the environment, then fills unset options from the
    /// config file.
    pub fn load() -> Result<Options, MasterError> {
        Self::load_from(std::env::args_os())
    }

    pub fn load_from<I, T>(args: I) -> Result<Options, MasterError>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        gpuctl_proto::options::parse_with_file(args, "config").map_err(MasterError::Config)
    }

    /// The security options, resolved: `None` when no TLS is configured.
    pub fn security(&self) -> Result<Option<SecurityConfig>, MasterError> {
        let dir = self.tls_dir.as_deref();
        let in_dir = |name: String| dir.map(|d| d.join(name));
        let ca = self.tls_ca.clone().or_else(|| in_dir("ca.crt".into()));
        let cert = self
            .tls_cert
            .clone()
            .or_else(|| in_dir(format!("master-{}.crt", self.node_id)));
        let key = self
            .tls_key
            .clone()
            .or_else(|| in_dir(format!("master-{}.key", self.node_id)));
        let (ca, cert, key) = match (ca, cert, key) {
            (None, None, None) => {
                if self.ca_key.is_some() || self.bootstrap_token_file.is_some() {
                    return Err(MasterError::Config(
                        "ca_key and bootstrap_token_file need TLS: set tls_dir (or tls_ca, \
                         tls_cert and tls_key)"
                            .into(),
                    ));
                }
                return Ok(None);
            }
            (Some(ca), Some(cert), Some(key)) => (ca, cert, key),
            _ => {
                return Err(MasterError::Config(
                    "tls_ca, tls_cert and tls_key go together (or tls_dir for all three)".into(),
                ))
            }
        };
        let existing = |p: Option<PathBuf>| p.filter(|p| p.exists());
        let ca_key = match &self.ca_key {
            Some(p) => Some(p.clone()),
            None => existing(in_dir("ca.key".into())),
        };
        let bootstrap_token = match &self.bootstrap_token_file {
            Some(p) => Some(p.clone()),
            None => existing(in_dir("bootstrap.token".into())),
        };
        let ttl = |field: &str, v: &str| {
            gpuctl_core::time::parse_duration(v)
                .ok()
                .filter(|d| *d >= Duration::from_secs(10))
                .ok_or_else(|| {
                    MasterError::Config(format!(
                        "{field}: {v:?} is not a duration of at least 10 s (e.g. 7d, 12h)"
                    ))
                })
        };
        Ok(Some(SecurityConfig {
            tls: gpuctl_auth::tls::TlsPaths { ca, cert, key },
            ca_key,
            bootstrap_token,
            agent_cert_ttl: ttl("agent_cert_ttl", &self.agent_cert_ttl)?,
            client_cert_ttl: ttl("client_cert_ttl", &self.client_cert_ttl)?,
        }))
    }

    pub fn to_config(&self) -> Result<MasterConfig, MasterError> {
        let security = self.security()?;
        let listen = gpuctl_auth::tls::listen_address(
            self.listen,
            security.is_some(),
            self.insecure,
            DEFAULT_PORT,
            "run anything as root on every agent",
        )
        .map_err(MasterError::Config)?;
        let http_listen = self
            .http_listen
            .map(|a| check_http_listen(a, security.is_some(), self.insecure))
            .transpose()?;
        let heartbeat_interval = secs("heartbeat_interval_secs", self.heartbeat_interval_secs)?;
        let agent_timeout = secs("agent_timeout_secs", self.agent_timeout_secs)?;
        if agent_timeout <= heartbeat_interval {
            return Err(MasterError::Config(
                "agent_timeout_secs must be larger than heartbeat_interval_secs".into(),
            ));
        }
        let agent_lost_timeout = secs("agent_lost_timeout_secs", self.agent_lost_timeout_secs)?;
        let agent_fence_timeout = secs("agent_fence_timeout_secs", self.agent_fence_timeout_secs)?;
        let peers = parse_peers(&self.peers)?;
        if !peers.is_empty() && !self.join && !peers.contains_key(&self.node_id) {
            return Err(MasterError::Config(format!(
                "peers must include this master (node_id {})",
                self.node_id
            )));
        }
        let advertise = self.advertise_address(listen, &peers)?;
        between(
            "allocation_interval_ms",
            self.allocation_interval_ms,
            10,
            10_000,
        )?;
        if !(self.gpu_reserved_cpus.is_finite() && (0.0..=4096.0).contains(&self.gpu_reserved_cpus))
        {
            return Err(MasterError::Config(format!(
                "gpu_reserved_cpus must be between 0 and 4096, got {}",
                self.gpu_reserved_cpus
            )));
        }
        between("election_timeout_ms", self.election_timeout_ms, 100, 60_000)?;
        let placement = self
            .placement
            .parse::<PlacementPolicy>()
            .map_err(|e| MasterError::Config(format!("placement: {e}")))?;
        let retention = self.retention()?;
        let any = |_: Duration| true;
        let reclaim_min_runtime = off_or_duration(
            "reclaim_min_runtime",
            &self.reclaim_min_runtime,
            any,
            "a duration (e.g. 1m, 30s, 0s)",
        )?;
        let elastic_grow_after = off_or_duration(
            "elastic_grow_after",
            &self.elastic_grow_after,
            any,
            "a duration (e.g. 1m, 30s, 0s)",
        )?;
        let utilization_period = off_or_duration(
            "utilization_period",
            &self.utilization_period,
            |d| (Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&d),
            "a duration from 1s to 1h (e.g. 1m)",
        )?;
        let idle_window = off_or_duration(
            "idle_window",
            &self.idle_window,
            |d| !d.is_zero(),
            "a duration (e.g. 30m)",
        )?;
        if !(1..=100).contains(&self.idle_below) {
            return Err(MasterError::Config(format!(
                "idle_below: {} is not a percent from 1 to 100",
                self.idle_below
            )));
        }
        let reclaim_notice =
            gpuctl_core::time::parse_duration(&self.reclaim_notice).map_err(|_| {
                MasterError::Config(format!(
                    "reclaim_notice: {:?} is not a duration (e.g. 10s, 1m, 0s)",
                    self.reclaim_notice
                ))
            })?;
        let config = MasterConfig {
            reclaim_min_runtime,
            elastic_grow_after,
            utilization_period,
            idle_window,
            idle_below_pct: self.idle_below,
            max_stop_grace: Duration::from_secs(self.max_stop_grace_secs),
            retention,
            metrics_listen: self.metrics_listen,
            http_listen,
            placement,
            mig_auto: self.mig_auto,
            peers,
            advertise,
            join: self.join,
            election_timeout: Duration::from_millis(self.election_timeout_ms),
            snapshot_every: self.snapshot_every,
            max_heartbeats_per_sec: self.max_heartbeats_per_sec,
            listen,
            security,
            data_dir: self.data_dir.clone(),
            node_id: self.node_id,
            heartbeat_interval,
            agent_timeout,
            agent_lost_timeout,
            agent_fence_timeout,
            frameworks: self.framework_settings(reclaim_min_runtime, reclaim_notice)?,
        };
        config.check_timeouts()?;
        Ok(config)
    }

    /// How long and how many finished jobs are kept.
    fn retention(&self) -> Result<crate::leader::retention::Retention, MasterError> {
        let max_age = gpuctl_core::time::parse_duration(&self.job_retention)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                MasterError::Config(format!(
                    "job_retention: {:?} is not a duration above 0 (a number with a unit: s, m, h or d, e.g. 7d)",
                    self.job_retention
                ))
            })?;
        Ok(crate::leader::retention::Retention {
            max_age,
            max_finished: usize::try_from(self.job_retention_max).unwrap_or(usize::MAX),
        })
    }

    /// Where the other masters and the agents reach this one: `advertise`,
    /// else its address in `peers`, else the listen address (this host's
    /// name when it listens on all addresses).
    fn advertise_address(
        &self,
        listen: SocketAddr,
        peers: &BTreeMap<u64, String>,
    ) -> Result<String, MasterError> {
        Ok(match (&self.advertise, peers.get(&self.node_id)) {
            (Some(a), _) => {
                check_host_port("advertise", a).map_err(|e| MasterError::Config(e.to_string()))?;
                a.clone()
            }
            (None, Some(a)) => a.clone(),
            (None, None) if listen.ip().is_unspecified() => {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|h| h.trim().to_string())
                    .unwrap_or_else(|_| "localhost".into());
                format!("{host}:{}", listen.port())
            }
            (None, None) => listen.to_string(),
        })
    }

    /// The framework API's settings: reclaim, roles, the allocator, offers.
    fn framework_settings(
        &self,
        reclaim_min_runtime: Option<Duration>,
        reclaim_notice: Duration,
    ) -> Result<FrameworkSettings, MasterError> {
        Ok(FrameworkSettings {
            reclaim: reclaim_min_runtime.map(|min_runtime| {
                crate::leader::frameworks::ReclaimSettings {
                    min_runtime,
                    notice: reclaim_notice,
                }
            }),
            roles: self
                .roles
                .iter()
                .map(|r| parse_role(r))
                .collect::<Result<_, _>>()?,
            allocator: AllocatorConfig {
                gpu_agents_for_gpu_frameworks_only: !self.offer_gpu_agents_to_all,
                gpu_reserve: gpuctl_core::types::Resources {
                    cpus: self.gpu_reserved_cpus,
                    mem_mib: self.gpu_reserved_mem_mib,
                    gpus: 0,
                    ports: 0,
                },
            },
            offer_timeout: secs("offer_timeout_secs", self.offer_timeout_secs)?,
            allocation_interval: Duration::from_millis(self.allocation_interval_ms),
            update_resend_interval: secs("update_resend_secs", self.update_resend_secs)?,
        })
    }
}

/// `value` of option `key` within `lo..=hi`.
fn between(key: &str, value: u64, lo: u64, hi: u64) -> Result<(), MasterError> {
    if (lo..=hi).contains(&value) {
        Ok(())
    } else {
        Err(MasterError::Config(format!(
            "{key} must be between {lo} and {hi}, got {value}"
        )))
    }
}

/// Option `key`: `off`, or a duration that `ok` takes; else an error
/// saying what it takes (`what`).
fn off_or_duration(
    key: &str,
    value: &str,
    ok: impl Fn(Duration) -> bool,
    what: &str,
) -> Result<Option<Duration>, MasterError> {
    match value {
        "off" => Ok(None),
        s => gpuctl_core::time::parse_duration(s)
            .ok()
            .filter(|d| ok(*d))
            .map(Some)
            .ok_or_else(|| MasterError::Config(format!("{key}: {s:?} is not {what} or off"))),
    }
}

/// The console's address: like the API's, without TLS only loopback
/// unless `insecure`, because whoever reaches it may do what the API lets
/// an unauthenticated caller do on such a cluster: everything.
pub(super) fn check_http_listen(
    addr: SocketAddr,
    tls: bool,
    insecure: bool,
) -> Result<SocketAddr, MasterError> {
    if !tls && !addr.ip().is_loopback() && !insecure {
        return Err(MasterError::Config(format!(
            "http_listen {addr}: without TLS the web console is served on a loopback address \
             only, because anyone who reaches it could run anything as root on every agent; \
             set tls_dir (the console then serves HTTPS, see docs/console.md), or listen on \
             127.0.0.1, or (isolated labs only) insecure = true"
        )));
    }
    Ok(addr)
}
