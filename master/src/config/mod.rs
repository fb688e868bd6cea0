//! Master options: from flags, environment variables (`GPUCTL_MASTER_*`) or a
//! TOML file (`--config`), in that order of precedence.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use gpuctl_core::convert::check_host_port;

use crate::allocator::{AllocatorConfig, RoleConfig};
use crate::error::MasterError;
use crate::leader::frameworks::FrameworkSettings;
use gpuctl_core::types::{PlacementPolicy, Resources};

mod options;
pub use options::*;

#[derive(Debug, Clone)]
pub struct MasterConfig {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    pub node_id: u64,
    /// How often agents heartbeat.
    pub heartbeat_interval: Duration,
    /// An agent silent for this long is UNREACHABLE: its tasks too, still
    /// holding their GPUs; nothing new goes to it.
    pub agent_timeout: Duration,
    /// An agent silent for this long is LOST and its tasks LOST (their
    /// GPUs stay held until the agent confirms they are gone). Larger than
    /// `agent_fence_timeout` plus every agent's kill grace plus
    /// [`FENCE_MARGIN`] (checked at registration).
    pub agent_lost_timeout: Duration,
    /// Sent to agents at registration: an agent that hears from no leader
    /// for this long kills its tasks itself (the fence).
    pub agent_fence_timeout: Duration,
    /// Offers to frameworks: roles, GPU scarcity, offer timeout.
    pub frameworks: crate::leader::frameworks::FrameworkSettings,
    /// The Raft group at bootstrap: node id to API address (empty: this
    /// master alone).
    pub peers: BTreeMap<u64, String>,
    /// The address other masters and clients reach this one at.
    pub advertise: String,
    /// Start with no members and wait to be added (`gpuctl masters add`).
    pub join: bool,
    /// A follower that hears nothing from a leader for this long (times a
    /// random factor in [1, 2)) starts an election.
    pub election_timeout: Duration,
    /// Entries between snapshots of the state machine.
    pub snapshot_every: u64,
    /// The most heartbeats a second the leader asks of all agents together:
    /// beyond `agents / heartbeat_interval` of them, agents are asked to
    /// beat less often (see [`MasterConfig::heartbeat_interval_for`]). 0:
    /// every agent at `heartbeat_interval`.
    pub max_heartbeats_per_sec: u32,
    /// How the built-in scheduler places jobs that do not choose.
    pub placement: PlacementPolicy,
    /// Idle GPUs in MIG mode are repartitioned for queued jobs that wait
    /// for a MIG profile no free MIG device offers (`leader::mig_auto`).
    pub mig_auto: bool,
    /// Reclaim across tenants, from jobs that have run this long; `None`:
    /// off.
    pub reclaim_min_runtime: Option<Duration>,
    /// An elastic gang below its most ranks is restarted with more once it
    /// has run this long and GPUs are free for them; `None`: never grown.
    pub elastic_grow_after: Option<Duration>,
    /// The leader records each GPU's mean utilization over periods this
    /// long (docs/usage.md); `None`: no utilization history.
    pub utilization_period: Option<Duration>,
    /// A running job whose GPUs all stay under `idle_below_pct` for this
    /// long is flagged idle; `None`: no detection.
    pub idle_window: Option<Duration>,
    pub idle_below_pct: u8,
    /// Where to serve Prometheus metrics (`/metrics`); none when unset.
    pub metrics_listen: Option<SocketAddr>,
    /// Where to serve the web console (`console/`); none when unset. HTTPS
    /// with this master's certificate when TLS is configured.
    pub http_listen: Option<SocketAddr>,
    /// How long, and how many, finished jobs and ended framework tasks are
    /// kept before they are forgotten.
    pub retention: crate::leader::retention::Retention,
    /// Mutual TLS and tokens; `None`: neither (loopback only, every caller
    /// may do everything).
    pub security: Option<SecurityConfig>,
    /// The longest `stop_grace` a job may ask for (`--max-stop-grace-secs`).
    pub max_stop_grace: Duration,
}

/// Default of `max_stop_grace_secs`.
pub const DEFAULT_MAX_STOP_GRACE: Duration = Duration::from_secs(300);

/// Where a master's key material is and how long what it signs lasts.
#[derive(Debug, Clone, PartialEq)]
pub struct SecurityConfig {
    pub tls: gpuctl_auth::tls::TlsPaths,
    /// The CA's private key: lets this master sign agents' certificates
    /// when they join or renew. Without it agents need certificates made
    /// offline (`gpuctl certs issue`).
    pub ca_key: Option<PathBuf>,
    /// A file holding the first admin token (`gpuctl certs init` writes
    /// it): the leader puts it in the replicated state once.
    pub bootstrap_token: Option<PathBuf>,
    pub agent_cert_ttl: Duration,
    pub client_cert_ttl: Duration,
}

/// Default lifetime of the certificates agents get when they join or renew.
pub const DEFAULT_AGENT_CERT_TTL: Duration = Duration::from_secs(7 * 86_400);
/// Default lifetime of client certificates got with an access token.
pub const DEFAULT_CLIENT_CERT_TTL: Duration = Duration::from_secs(30 * 86_400);
/// The port masters listen on unless told otherwise.
pub const DEFAULT_PORT: u16 = 7050;

/// Default of `agent_lost_timeout_secs`.
pub const DEFAULT_AGENT_LOST_TIMEOUT: Duration = Duration::from_secs(120);
/// Default of `max_heartbeats_per_sec`: 10,000 agents then beat every
/// 3.3 s (the most the default agent timeout of 10 s allows), 3,000 a
/// second in all instead of 10,000.
pub const DEFAULT_MAX_HEARTBEATS_PER_SEC: u32 = 1_000;
/// Default of `agent_fence_timeout_secs`.
pub const DEFAULT_AGENT_FENCE_TIMEOUT: Duration = Duration::from_secs(75);
/// What the master adds, beyond an agent's fence timeout and kill grace,
/// before it may declare that agent's tasks LOST: clock rates, scheduling
/// delays, the time the kill itself takes.
pub const FENCE_MARGIN: Duration = Duration::from_secs(5);
/// The kill grace assumed for an agent that does not say (an older agent,
/// `kill_grace_ms` 0): the agents' default `--kill-grace-secs`.
pub const DEFAULT_KILL_GRACE: Duration = Duration::from_secs(10);

impl MasterConfig {
    /// How often the leader asks each of `agents` agents to heartbeat: the
    /// configured interval, or longer when `agents` beating that often
    /// would pass `max_heartbeats_per_sec` (as Nomad stretches its
    /// heartbeat TTLs), but never longer than a third of the agent
    /// timeout, so that an agent is called unreachable only after missing
    /// at least three heartbeats. The timeouts themselves do not change:
    /// the fence and lost rules above hold as configured.
    pub fn heartbeat_interval_for(&self, agents: usize) -> Duration {
        let base = self.heartbeat_interval;
        if self.max_heartbeats_per_sec == 0 {
            return base;
        }
        let wanted =
            Duration::from_secs_f64(agents as f64 / f64::from(self.max_heartbeats_per_sec));
        wanted.min(self.agent_timeout / 3).max(base)
    }

    /// The three agent timeouts must be ordered:
    /// `agent_timeout < agent_fence_timeout < agent_lost_timeout`.
    ///
    /// Why. An agent measures its fence clock from the *send* time of its
    /// last successful heartbeat to the leader, which is never later than
    /// the leader's receipt of it (the leader's clock for the agent starts
    /// at the receipt; a new leader starts every clock afresh, later still).
    /// So when the leader has heard nothing for `agent_lost_timeout`, the
    /// agent has heard nothing for at least as long, and it began killing
    /// its tasks at `agent_fence_timeout` and finished within its kill grace
    /// (SIGTERM, then SIGKILL). Registration checks the rest:
    /// `agent_fence_timeout + kill_grace + FENCE_MARGIN < agent_lost_timeout`
    /// (see [`MasterConfig::check_kill_grace`]), so that the tasks are gone
    /// before the master declares them LOST. (Their GPUs are given again
    /// only once the agent confirms anyway; the fence is what lets their
    /// jobs be retried elsewhere without two copies running.) The fence
    /// must be longer than the agent timeout: an agent that is merely
    /// UNREACHABLE for a moment must not kill anything.
    pub fn check_timeouts(&self) -> Result<(), MasterError> {
        if self.agent_fence_timeout <= self.agent_timeout {
            return Err(MasterError::Config(format!(
                "agent_fence_timeout_secs ({}) must be larger than agent_timeout_secs ({}): \
                 an agent must not stop its tasks before the master even calls it unreachable",
                self.agent_fence_timeout.as_secs_f64(),
                self.agent_timeout.as_secs_f64()
            )));
        }
        if self.agent_lost_timeout <= self.agent_fence_timeout {
            return Err(MasterError::Config(format!(
                "agent_lost_timeout_secs ({}) must be larger than agent_fence_timeout_secs ({}) \
                 (plus the agents' kill grace and a {} s margin): an agent's tasks must be \
                 stopped by its fence before the master declares them LOST",
                self.agent_lost_timeout.as_secs_f64(),
                self.agent_fence_timeout.as_secs_f64(),
                self.fence_margin().as_secs_f64()
            )));
        }
        Ok(())
    }

    /// The margin the fence needs beyond the fence timeout and the kill
    /// grace: [`FENCE_MARGIN`], plus two election timeouts, the most a
    /// leader that lost its majority may go on answering heartbeats (a
    /// contact for the agent's fence) before it notices and steps down,
    /// while a new leader's clock for the agent already runs.
    pub fn fence_margin(&self) -> Duration {
        FENCE_MARGIN + self.election_timeout * 2
    }

    /// Whether an agent with this kill grace (`kill_grace_ms` of its
    /// registration; 0: [`DEFAULT_KILL_GRACE`]) stops its fenced tasks in
    /// time: `agent_fence_timeout + kill_grace + fence_margin()` must be
    /// less than `agent_lost_timeout`. The error names the numbers.
    pub fn check_kill_grace(&self, kill_grace_ms: u32) -> Result<(), String> {
        let grace = if kill_grace_ms == 0 {
            DEFAULT_KILL_GRACE
        } else {
            Duration::from_millis(u64::from(kill_grace_ms))
        };
        let needed = self.agent_fence_timeout + grace + self.fence_margin();
        if needed >= self.agent_lost_timeout {
            return Err(format!(
                "the agent's kill grace is too long for this master: fence timeout {} s + \
                 kill grace {} s + margin {} s = {} s, which is not less than the agent lost \
                 timeout {} s (agent_lost_timeout_secs); lower the agent's --kill-grace-secs \
                 or raise the master's agent_lost_timeout_secs",
                self.agent_fence_timeout.as_secs_f64(),
                grace.as_secs_f64(),
                self.fence_margin().as_secs_f64(),
                needed.as_secs_f64(),
                self.agent_lost_timeout.as_secs_f64()
            ));
        }
        Ok(())
    }

    /// What the built-in scheduler's queue pass needs of the configuration.
    pub fn queue_config(&self) -> crate::scheduler::queue::QueueConfig {
        crate::scheduler::queue::QueueConfig {
            default_policy: self.placement,
            jobs_quota: self
                .frameworks
                .roles
                .get(crate::state::frameworks::JOBS_ROLE)
                .and_then(|r| r.quota),
            reclaim_min_runtime_ms: self
                .reclaim_min_runtime
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            elastic_grow_after_ms: self
                .elastic_grow_after
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            now_ms: 0,
        }
    }

    pub fn new(listen: SocketAddr, data_dir: PathBuf) -> Self {
        MasterConfig {
            listen,
            data_dir,
            node_id: 1,
            heartbeat_interval: Duration::from_secs(1),
            agent_timeout: Duration::from_secs(10),
            agent_lost_timeout: DEFAULT_AGENT_LOST_TIMEOUT,
            agent_fence_timeout: DEFAULT_AGENT_FENCE_TIMEOUT,
            frameworks: Default::default(),
            peers: BTreeMap::new(),
            advertise: listen.to_string(),
            join: false,
            election_timeout: Duration::from_secs(1),
            snapshot_every: 10_000,
            max_heartbeats_per_sec: DEFAULT_MAX_HEARTBEATS_PER_SEC,
            placement: PlacementPolicy::Bundle,
            mig_auto: false,
            reclaim_min_runtime: Some(Duration::from_secs(60)),
            elastic_grow_after: Some(Duration::from_secs(60)),
            utilization_period: Some(Duration::from_secs(60)),
            idle_window: Some(Duration::from_secs(30 * 60)),
            idle_below_pct: 5,
            metrics_listen: None,
            http_listen: None,
            retention: Default::default(),
            security: None,
            max_stop_grace: DEFAULT_MAX_STOP_GRACE,
        }
    }

    /// A job's `stop_grace_ms` within this master's maximum, or why not.
    pub fn check_stop_grace(&self, ms: Option<u64>) -> Result<(), String> {
        let max = self.max_stop_grace.as_millis();
        match ms {
            Some(ms) if u128::from(ms) > max => Err(format!(
                "is {} s, above this cluster's maximum of {} s (gpuctl-master --max-stop-grace-secs)",
                ms as f64 / 1000.0,
                self.max_stop_grace.as_secs_f64(),
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_big_cluster_is_asked_for_fewer_heartbeats_but_never_fewer_than_three_per_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("master.toml");
        std::fs::write(&f, "max_heartbeats_per_sec = 500\n").unwrap();
        let o = Options::load_from(["gpuctl-master", "--config", f.to_str().unwrap()]).unwrap();
        let c = o.to_config().unwrap();
        assert_eq!(c.max_heartbeats_per_sec, 500, "from the file");
        let s = Duration::from_secs_f64;
        // 500 agents or fewer: the configured second.
        assert_eq!(c.heartbeat_interval_for(0), s(1.0));
        assert_eq!(c.heartbeat_interval_for(500), s(1.0));
        // 1,000 agents at 500 a second: every 2 s.
        assert_eq!(c.heartbeat_interval_for(1000), s(2.0));
        // 100,000: capped at a third of the 10 s agent timeout.
        assert_eq!(
            c.heartbeat_interval_for(100_000),
            Duration::from_secs(10) / 3
        );
        let off = MasterConfig {
            max_heartbeats_per_sec: 0,
            ..c
        };
        assert_eq!(off.heartbeat_interval_for(100_000), s(1.0));
    }

    #[test]
    fn file_fills_what_flags_do_not_set() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("master.toml");
        std::fs::write(
            &f,
            "listen = \"127.0.0.1:9000\"\ndata_dir = \"/tmp/x\"\nagent_timeout_secs = 30\n",
        )
        .unwrap();
        let o = Options::load_from([
            "gpuctl-master",
            "--config",
            f.to_str().unwrap(),
            "--data-dir",
            "/tmp/flag",
        ])
        .unwrap();
        assert_eq!(o.listen.unwrap().to_string(), "127.0.0.1:9000");
        assert_eq!(o.data_dir, PathBuf::from("/tmp/flag"));
        let c = o.to_config().unwrap();
        assert_eq!(c.agent_timeout, Duration::from_secs(30));
    }

    #[test]
    fn roles_parse_weights_and_quotas() {
        let (name, r) = parse_role("ml=weight:2,gpus:8").unwrap();
        assert_eq!(name, "ml");
        assert_eq!(r.weight, 2.0);
        let q = r.quota.unwrap();
        assert_eq!(q.gpus, 8);
        assert_eq!(q.mem_mib, u64::MAX, "not named: not limited");
        let (_, r) = parse_role("batch").unwrap();
        assert_eq!((r.weight, r.quota), (1.0, None));
        for (bad, needle) in [
            ("ml=weight:0", "weight"),
            ("ml=gpus:x", "not a number"),
            ("ml=disk:3", "unknown key"),
            ("=weight:1", "role"),
            ("ml=weight", "KEY:VALUE"),
        ] {
            let e = parse_role(bad).unwrap_err().to_string();
            assert!(e.contains(needle), "{bad}: {e}");
        }
        let o = Options::load_from([
            "gpuctl-master",
            "--role",
            "ml=weight:3",
            "--role",
            "dev=cpus:4",
            "--offer-gpu-agents-to-all",
        ])
        .unwrap();
        let c = o.to_config().unwrap();
        assert_eq!(c.frameworks.roles.len(), 2);
        assert!(!c.frameworks.allocator.gpu_agents_for_gpu_frameworks_only);
    }

    #[test]
    fn peers_parse_and_must_name_this_master() {
        let p = parse_peers("1=m1:7050, 2=10.0.0.2:7050,3=[::1]:7052").unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!(p[&3], "[::1]:7052");
        assert!(parse_peers("").unwrap().is_empty());
        for (bad, needle) in [
            ("1=m1", "HOST:PORT"),
            ("0=m1:1", "node id"),
            ("x=m1:1", "node id"),
            ("1=m1:1,1=m2:1", "twice"),
            ("m1:1", "ID=HOST:PORT"),
            ("1=m1:99999", "port"),
        ] {
            let e = parse_peers(bad).unwrap_err().to_string();
            assert!(e.contains(needle) && e.contains("peers"), "{bad}: {e}");
        }
        let o = Options::load_from([
            "gpuctl-master",
            "--node-id",
            "2",
            "--peers",
            "1=m1:7050,2=m2:7050,3=m3:7050",
        ])
        .unwrap();
        let c = o.to_config().unwrap();
        assert_eq!(
            c.advertise, "m2:7050",
            "advertise defaults to our peer entry"
        );
        assert_eq!(c.peers.len(), 3);
        let o = Options::load_from(["gpuctl-master", "--node-id", "4", "--peers", "1=m1:7050"])
            .unwrap();
        let e = o.to_config().unwrap_err().to_string();
        assert!(e.contains("node_id 4"), "{e}");
        // Joining: our own entry may be absent.
        let o = Options::load_from([
            "gpuctl-master",
            "--node-id",
            "4",
            "--join",
            "--advertise",
            "m4:7050",
            "--peers",
            "1=m1:7050",
        ])
        .unwrap();
        assert!(o.to_config().unwrap().join);
        let o = Options::load_from(["gpuctl-master", "--election-timeout-ms", "5"]).unwrap();
        let e = o.to_config().unwrap_err().to_string();
        assert!(e.contains("election_timeout_ms"), "{e}");
    }

    #[test]
    fn the_agent_timeouts_default_and_come_from_flags_file_and_env() {
        let c = Options::load_from(["gpuctl-master"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.agent_timeout, Duration::from_secs(10));
        assert_eq!(c.agent_fence_timeout, Duration::from_secs(75));
        assert_eq!(c.agent_lost_timeout, Duration::from_secs(120));
        assert_eq!(
            MasterConfig::new("127.0.0.1:1".parse().unwrap(), "/x".into()).agent_lost_timeout,
            c.agent_lost_timeout
        );
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("master.toml");
        std::fs::write(
            &f,
            "agent_lost_timeout_secs = 300\nagent_fence_timeout_secs = 200\n",
        )
        .unwrap();
        let c = Options::load_from([
            "gpuctl-master",
            "--config",
            f.to_str().unwrap(),
            "--agent-fence-timeout-secs",
            "100",
        ])
        .unwrap()
        .to_config()
        .unwrap();
        assert_eq!(c.agent_lost_timeout, Duration::from_secs(300));
        assert_eq!(c.agent_fence_timeout, Duration::from_secs(100), "flag wins");
    }

    #[test]
    fn the_agent_timeouts_must_be_ordered() {
        type Case<'a> = (&'a [&'a str], Option<(&'a str, &'a str)>);
        let cases: &[Case] = &[
            (&[], None),
            // lost <= fence: names both keys.
            (
                &["--agent-lost-timeout-secs", "75"],
                Some((
                    "agent_lost_timeout_secs (75)",
                    "agent_fence_timeout_secs (75)",
                )),
            ),
            (
                &["--agent-lost-timeout-secs", "60"],
                Some((
                    "agent_lost_timeout_secs (60)",
                    "agent_fence_timeout_secs (75)",
                )),
            ),
            // fence <= agent timeout.
            (
                &["--agent-fence-timeout-secs", "10"],
                Some(("agent_fence_timeout_secs (10)", "agent_timeout_secs (10)")),
            ),
            (
                &[
                    "--agent-timeout-secs",
                    "3",
                    "--agent-fence-timeout-secs",
                    "4",
                    "--agent-lost-timeout-secs",
                    "20",
                ],
                None,
            ),
        ];
        for (flags, want) in cases {
            let mut args = vec!["gpuctl-master"];
            args.extend_from_slice(flags);
            let r = Options::load_from(args).unwrap().to_config();
            match (want, r) {
                (None, Ok(_)) => {}
                (Some((a, b)), Err(e)) => {
                    let e = e.to_string();
                    assert!(e.contains(a) && e.contains(b), "{flags:?}: {e}");
                }
                (want, r) => panic!("{flags:?}: wanted {want:?}, got {r:?}"),
            }
        }
    }

    #[test]
    fn a_jobs_stop_grace_is_bounded_by_the_masters_maximum() {
        let config = |flags: &[&str]| {
            let mut args = vec!["gpuctl-master"];
            args.extend_from_slice(flags);
            Options::load_from(args).and_then(|o| o.to_config())
        };
        let c = config(&[]).unwrap();
        assert_eq!(c.max_stop_grace, Duration::from_secs(300));
        assert!(c.check_stop_grace(None).is_ok());
        assert!(c.check_stop_grace(Some(300_000)).is_ok());
        let e = c.check_stop_grace(Some(300_001)).unwrap_err();
        assert!(
            e.contains("300.001 s") && e.contains("maximum of 300 s"),
            "{e}"
        );
        assert!(e.contains("--max-stop-grace-secs"), "{e}");
        let c = config(&["--max-stop-grace-secs", "30"]).unwrap();
        assert!(c.check_stop_grace(Some(31_000)).is_err());
    }

    #[test]
    fn registration_needs_fence_plus_kill_grace_plus_margin_below_the_lost_timeout() {
        let c = MasterConfig::new("127.0.0.1:1".parse().unwrap(), "/x".into());
        // 75 + 10 (assumed for an old agent) + 5 + 2 x 1 (election) < 120.
        assert!(c.check_kill_grace(0).is_ok());
        assert!(c.check_kill_grace(37_999).is_ok());
        // 75 + 38 + 7 = 120: not less.
        let e = c.check_kill_grace(38_000).unwrap_err();
        for needle in [
            "75",
            "38",
            "margin 7",
            "120",
            "agent_lost_timeout_secs",
            "kill grace",
        ] {
            assert!(e.contains(needle), "{needle}: {e}");
        }
        let mut short = c.clone();
        short.agent_lost_timeout = Duration::from_secs(92);
        assert!(short.check_kill_grace(0).is_err(), "75 + 10 + 7 = 92");
        assert!(short.check_kill_grace(9_000).is_ok());
        // A slow link's election timeout widens the margin.
        let mut slow = c.clone();
        slow.election_timeout = Duration::from_secs(4);
        assert_eq!(slow.fence_margin(), Duration::from_secs(13));
        assert!(slow.check_kill_grace(31_999).is_ok());
        assert!(slow.check_kill_grace(32_000).is_err(), "75 + 32 + 13 = 120");
    }

    #[test]
    fn reclaim_min_runtime_defaults_to_a_minute_and_off_turns_it_off() {
        let load = |args: &[&str]| {
            let mut a = vec!["gpuctl-master"];
            a.extend(args);
            Options::load_from(a).unwrap().to_config()
        };
        let c = load(&[]).unwrap();
        assert_eq!(c.reclaim_min_runtime, Some(Duration::from_secs(60)));
        assert_eq!(c.queue_config().reclaim_min_runtime_ms, Some(60_000));
        assert_eq!(
            MasterConfig::new("127.0.0.1:1".parse().unwrap(), "/x".into()).reclaim_min_runtime,
            c.reclaim_min_runtime
        );
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("master.toml");
        std::fs::write(&f, "reclaim_min_runtime = \"off\"\n").unwrap();
        let file = f.to_str().unwrap();
        assert_eq!(load(&["--config", file]).unwrap().reclaim_min_runtime, None);
        let c = load(&["--config", file, "--reclaim-min-runtime", "5s"]).unwrap();
        assert_eq!(
            c.reclaim_min_runtime,
            Some(Duration::from_secs(5)),
            "flag wins"
        );
        let e = load(&["--reclaim-min-runtime", "soon"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("reclaim_min_runtime") && e.contains("soon"),
            "{e}"
        );
        // Between frameworks: the same minimum, a notice of 10 s by default.
        let r = load(&[]).unwrap().frameworks.reclaim.unwrap();
        assert_eq!(
            (r.min_runtime, r.notice),
            (Duration::from_secs(60), Duration::from_secs(10))
        );
        let r = load(&["--reclaim-notice", "3s"])
            .unwrap()
            .frameworks
            .reclaim
            .unwrap();
        assert_eq!(r.notice, Duration::from_secs(3));
        assert!(load(&["--reclaim-min-runtime", "off"])
            .unwrap()
            .frameworks
            .reclaim
            .is_none());
        let e = load(&["--reclaim-notice", "x"]).unwrap_err().to_string();
        assert!(e.contains("reclaim_notice"), "{e}");
    }

    #[test]
    fn job_retention_defaults_and_comes_from_flags_file_and_env() {
        let c = Options::load_from(["gpuctl-master"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.retention.max_age, Duration::from_secs(7 * 24 * 3600));
        assert_eq!(c.retention.max_finished, 10_000);
        assert_eq!(
            MasterConfig::new("127.0.0.1:1".parse().unwrap(), "/x".into()).retention,
            c.retention
        );
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("master.toml");
        std::fs::write(&f, "job_retention = \"36h\"\njob_retention_max = 500\n").unwrap();
        let file = ["gpuctl-master", "--config", f.to_str().unwrap()];
        let c = Options::load_from(file).unwrap().to_config().unwrap();
        assert_eq!(c.retention.max_age, Duration::from_secs(36 * 3600));
        assert_eq!(c.retention.max_finished, 500);
        let mut flags = file.to_vec();
        flags.extend(["--job-retention", "1s", "--job-retention-max", "7"]);
        let c = Options::load_from(flags).unwrap().to_config().unwrap();
        assert_eq!(c.retention.max_age, Duration::from_secs(1), "flag wins");
        assert_eq!(c.retention.max_finished, 7);
        for bad in ["0s", "7w", "soon"] {
            let e = Options::load_from(["gpuctl-master", "--job-retention", bad])
                .unwrap()
                .to_config()
                .unwrap_err()
                .to_string();
            assert!(e.contains("job_retention") && e.contains(bad), "{bad}: {e}");
        }
        std::fs::write(&f, "job_retention_max = 0\n").unwrap();
        let e = Options::load_from(["gpuctl-master", "--config", f.to_str().unwrap()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("job_retention_max"), "{e}");
    }

    #[test]
    fn http_listen_is_off_by_default_loopback_only_without_tls() {
        let c = Options::load_from(["gpuctl-master"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.http_listen, None, "the console is off unless asked for");
        let c = Options::load_from(["gpuctl-master", "--http-listen", "127.0.0.1:8080"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.http_listen, Some("127.0.0.1:8080".parse().unwrap()));
        let e = Options::load_from(["gpuctl-master", "--http-listen", "0.0.0.0:8080"])
            .unwrap()
            .to_config()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("http_listen 0.0.0.0:8080")
                && e.contains("loopback")
                && e.contains("tls_dir"),
            "{e}"
        );
        let c = Options::load_from([
            "gpuctl-master",
            "--http-listen",
            "0.0.0.0:8080",
            "--insecure",
        ])
        .unwrap()
        .to_config()
        .unwrap();
        assert!(c.http_listen.is_some());
        // With TLS the console serves HTTPS, on any address.
        let c = Options::load_from([
            "gpuctl-master",
            "--tls-dir",
            "/etc/gpuctl/tls",
            "--http-listen",
            "0.0.0.0:8443",
        ])
        .unwrap()
        .to_config()
        .unwrap();
        assert_eq!(c.http_listen, Some("0.0.0.0:8443".parse().unwrap()));
        // From the config file, under the flag.
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("master.toml");
        std::fs::write(&f, "http_listen = \"[::1]:8081\"\n").unwrap();
        let file = ["gpuctl-master", "--config", f.to_str().unwrap()];
        let c = Options::load_from(file).unwrap().to_config().unwrap();
        assert_eq!(c.http_listen, Some("[::1]:8081".parse().unwrap()));
        let mut flags = file.to_vec();
        flags.extend(["--http-listen", "127.0.0.1:9"]);
        let c = Options::load_from(flags).unwrap().to_config().unwrap();
        assert_eq!(
            c.http_listen,
            Some("127.0.0.1:9".parse().unwrap()),
            "flag wins"
        );
        std::fs::write(&f, "http_listen = \"10.0.0.1:8080\"\n").unwrap();
        let e = Options::load_from(file)
            .unwrap()
            .to_config()
            .unwrap_err()
            .to_string();
        assert!(e.contains("http_listen 10.0.0.1:8080"), "{e}");
    }

    #[test]
    fn unknown_key_and_bad_values_are_errors_naming_them() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("master.toml");
        std::fs::write(&f, "lisen = \"x\"\n").unwrap();
        let err = Options::load_from(["gpuctl-master", "--config", f.to_str().unwrap()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("lisen"), "{err}");
        let o = Options::load_from(["gpuctl-master", "--agent-timeout-secs", "0.5"]).unwrap();
        let err = o.to_config().unwrap_err().to_string();
        assert!(err.contains("agent_timeout_secs"), "{err}");
    }
}
