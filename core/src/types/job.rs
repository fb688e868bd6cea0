//! What a user asks to run: the job, the template of its tasks, where they may run, and how failures are retried.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::*;

/// A job's first restart backoff when it names none (`--restart-backoff`).
pub const DEFAULT_RESTART_BACKOFF_MS: u64 = 1000;
/// The longest a doubled restart backoff grows (as Kubernetes' crash-loop
/// backoff), unless the job's first pause is longer.
pub const MAX_RESTART_BACKOFF_MS: u64 = 5 * 60 * 1000;

/// How a GPU an admin marked shareable (`gpuctl gpus share`) is shared
/// between the tasks that hold fractions of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ShareMode {
    /// CUDA MPS: one control daemon per GPU, each task's memory and
    /// active thread percentage set for its processes.
    Mps,
    /// Time-slicing: no limit; the scheduler still counts.
    TimeSlice,
}

impl fmt::Display for ShareMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ShareMode::Mps => "mps",
            ShareMode::TimeSlice => "time-slice",
        })
    }
}

impl std::str::FromStr for ShareMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "mps" => Ok(ShareMode::Mps),
            "time-slice" | "timeslice" | "time-slicing" => Ok(ShareMode::TimeSlice),
            _ => Err(format!("{s:?} is not a sharing mode (mps, time-slice)")),
        }
    }
}

/// A fraction of one shared GPU, as a task asks for it (`--gpu-mem`,
/// `--gpu-compute`): the scheduler never gives more of a GPU's memory, nor
/// more than 100% of its compute, than the GPU has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuFraction {
    /// Memory of the GPU, MiB (at least 1).
    pub mem_mib: u64,
    /// Percent of the GPU's compute (MPS active threads); 0: none asked
    /// (the task takes what is free, and counts for none).
    #[serde(default)]
    pub compute_pct: u32,
}

/// How the scheduler packs GPU jobs onto agents.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PlacementPolicy {
    /// Fewest agents: keeps whole agents free for big jobs.
    #[default]
    Bundle,
    /// Most free GPUs first: spreads jobs over agents.
    Spread,
}

impl fmt::Display for PlacementPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PlacementPolicy::Bundle => "bundle",
            PlacementPolicy::Spread => "spread",
        })
    }
}

impl std::str::FromStr for PlacementPolicy {
    type Err = String;
    /// `bundle` or `spread`, in any case, spaces around ignored.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "bundle" => Ok(PlacementPolicy::Bundle),
            "spread" => Ok(PlacementPolicy::Spread),
            _ => Err(format!("{s:?} is not a placement policy (bundle, spread)")),
        }
    }
}

/// Where a job may run and how it is placed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementSpec {
    /// `None`: the cluster's default policy.
    #[serde(default)]
    pub policy: Option<PlacementPolicy>,
    /// Glob on the GPU model (`A100*`), case-insensitive.
    #[serde(default)]
    pub gpu_model: Option<String>,
    /// Each GPU has at least this much memory; 0: any.
    #[serde(default)]
    pub gpu_mem_min_mib: u64,
    /// Agent attributes that must match (values may be globs).
    #[serde(default)]
    pub constraints: BTreeMap<String, String>,
    /// Each task's GPU is a MIG device of this profile (`1g.10gb`), not a
    /// whole GPU; `gpu_model` is then its parent's model and
    /// `gpu_mem_min_mib` the MIG device's memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<String>,
    /// Each task gets this fraction of one shared GPU instead of whole
    /// GPUs (`resources.gpus` is then 0: a fraction is not a device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fraction: Option<GpuFraction>,
}

impl PlacementSpec {
    pub fn is_default(&self) -> bool {
        *self == PlacementSpec::default()
    }
}

/// What each task runs and how: the one shape a job's tasks are made from
/// (`JobSpec::template`) and that an agent is given (`TaskSpec::template`,
/// with the task's own env and resources). A new per-task option is a
/// field here. Flattened into both, so the Raft log and the agent's state
/// read as before.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TaskTemplate {
    /// `None`: run as a host process.
    pub image: Option<String>,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub resources: Resources,
    /// Its tasks are not fenced: their agent keeps them running when it
    /// loses the masters, and the master never declares them LOST by
    /// timeout (they stay UNREACHABLE, holding their GPUs, until their
    /// agent comes back). There is no operator command to give such GPUs
    /// back while the agent stays away (out of scope for now).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_fence: bool,
    /// What its tasks may do on their agent (user, mounts, root).
    #[serde(default, skip_serializing_if = "TaskSecurity::is_default")]
    pub security: TaskSecurity,
    /// How long its tasks get between SIGTERM and SIGKILL when the cluster
    /// stops them (cancel, preemption, drain, a kill), in ms; `None`: their
    /// agent's kill grace (fence stops always use that). At most the
    /// master's `--max-stop-grace-secs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_grace_ms: Option<u64>,
    /// An absolute host path every attempt gets again at the same path
    /// (`GPUCTL_CHECKPOINT_DIR`; bind-mounted into containers), under one
    /// of its agent's `allowed_mounts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_dir: Option<String>,
    /// How long a task may go without output and GPU activity before its
    /// agent stops it as hung (`--hang-timeout`), in ms; `None`: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hang_timeout_ms: Option<u64>,
    /// Its GPUs are checked by their agent before it starts (`--preflight`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub preflight: bool,
    /// The options added since (one struct: flag, file key, JSON and log
    /// form at once); flattened, and absent when unset.
    #[serde(flatten)]
    pub options: TaskOptions,
}

impl TaskTemplate {
    /// A host process with the defaults.
    pub fn new(command: Vec<String>, resources: Resources) -> TaskTemplate {
        TaskTemplate {
            command,
            resources,
            ..TaskTemplate::default()
        }
    }

    pub fn runtime(&self) -> Runtime {
        if self.image.is_some() {
            Runtime::Docker
        } else {
            Runtime::Process
        }
    }
}

/// What a user asks to run: how many tasks of one template, where, and
/// what happens when they fail.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    pub name: String,
    /// What each task runs and how.
    #[serde(flatten)]
    pub template: TaskTemplate,
    #[serde(default, skip_serializing_if = "PlacementSpec::is_default")]
    pub placement: PlacementSpec,
    /// Higher is placed first and may preempt lower (default 0).
    #[serde(default, skip_serializing_if = "is_zero_i32")]
    pub priority: i32,
    /// Tasks started all or nothing (a gang); at least 1.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub replicas: u32,
    /// Failed attempts started again, at most this many times.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub max_retries: u32,
    /// When preempted, end FAILED instead of going back to QUEUED.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_requeue: bool,
    /// The tenant the job is charged to, set by the master from the
    /// submitter's token (an admin may name one).
    #[serde(default, skip_serializing_if = "Tenant::is_unset")]
    pub tenant: Tenant,
    /// The id of the token that submitted it, set by the master (never
    /// from the wire); its usage is charged to it. Empty: no token (no
    /// security configured, or submitted before accounting).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub submitted_by: String,
    /// Names of `env` variables whose values are secret: the task gets
    /// them, but the API shows them as `<secret>`, and they are never logged.
    #[serde(default, skip_serializing_if = "std::collections::BTreeSet::is_empty")]
    pub secret_env: std::collections::BTreeSet<String>,
    /// What its tasks need of the NVIDIA driver (`--require-cuda`): only
    /// agents whose driver meets it get them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub require_cuda: Option<crate::cuda_req::Expr>,
    /// An elastic gang (`--replicas MIN:MAX`): at least this many ranks
    /// (at most `replicas`) start, and it grows as GPUs free. `None`: a
    /// fixed gang of `replicas`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_replicas: Option<u32>,
    /// What a failed task leads to (`--restart-policy`).
    #[serde(default, skip_serializing_if = "RestartPolicy::is_default")]
    pub restart_policy: RestartPolicy,
    /// The pause before the first restart after a failure, in ms, doubled
    /// by each retry up to [`MAX_RESTART_BACKOFF_MS`];
    /// `None`: [`DEFAULT_RESTART_BACKOFF_MS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_backoff_ms: Option<u64>,
    /// The service (`svc-N`) this job is a replica of, set by the master
    /// (never from a submit); its `restart_policy` is then `Always`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
}

/// What a failed task of a job leads to (`--restart-policy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RestartPolicy {
    /// The whole gang is stopped and started again (all ranks: a
    /// collective cannot lose one), up to `max_retries`, after a backoff;
    /// an elastic gang is restarted to grow.
    #[default]
    Gang,
    /// The job fails at its first failure, and an elastic gang keeps the
    /// size it started with: gpuctl never restarts it.
    Never,
    /// A service's replica: started again whenever it ends, exit 0 or
    /// not, with the backoff (never more than its cap), and without a
    /// retry count.
    Always,
}

impl RestartPolicy {
    pub fn is_default(&self) -> bool {
        *self == RestartPolicy::Gang
    }
}

impl std::fmt::Display for RestartPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RestartPolicy::Gang => "gang",
            RestartPolicy::Never => "never",
            RestartPolicy::Always => "always",
        })
    }
}

impl std::str::FromStr for RestartPolicy {
    type Err = String;
    /// `gang`, `never` or `always`, in any case; "" is `gang`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "gang" => Ok(RestartPolicy::Gang),
            "never" => Ok(RestartPolicy::Never),
            "always" => Ok(RestartPolicy::Always),
            _ => Err(format!("{s:?} is not a restart policy (gang, never)")),
        }
    }
}

/// How a secret env value is shown.
pub const SECRET_PLACEHOLDER: &str = "<secret>";

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

fn is_zero_i32(n: &i32) -> bool {
    *n == 0
}

impl Default for JobSpec {
    fn default() -> Self {
        JobSpec::new("", Vec::new(), Resources::default())
    }
}

impl JobSpec {
    /// A plain job: one task, priority 0, no retries, default placement.
    pub fn new(name: impl Into<String>, command: Vec<String>, resources: Resources) -> JobSpec {
        JobSpec {
            name: name.into(),
            template: TaskTemplate::new(command, resources),
            placement: PlacementSpec::default(),
            priority: 0,
            replicas: 1,
            max_retries: 0,
            no_requeue: false,
            tenant: Tenant::default(),
            secret_env: Default::default(),
            require_cuda: None,
            min_replicas: None,
            restart_policy: RestartPolicy::Gang,
            restart_backoff_ms: None,
            service: None,
            submitted_by: String::new(),
        }
    }

    /// The spec as shown to people: secret env values replaced.
    pub fn redacted(&self) -> JobSpec {
        let mut s = self.clone();
        for (k, v) in s.template.env.iter_mut() {
            if self.secret_env.contains(k) {
                *v = SECRET_PLACEHOLDER.to_string();
            }
        }
        s
    }

    /// Tasks per attempt (at least 1).
    /// Its gang's size: the most ranks of an elastic gang.
    pub fn replicas(&self) -> u32 {
        self.replicas.max(1)
    }

    /// The fewest ranks an attempt may start with: `replicas` unless the
    /// gang is elastic.
    pub fn min_replicas(&self) -> u32 {
        self.min_replicas
            .map_or(self.replicas(), |m| m.clamp(1, self.replicas()))
    }

    /// The pause before restarting it after its `retries`-th failure (1 for
    /// the first): its backoff, doubled by each retry, at most
    /// [`MAX_RESTART_BACKOFF_MS`].
    pub fn restart_backoff(&self, retries: u32) -> u64 {
        let first = self
            .restart_backoff_ms
            .unwrap_or(DEFAULT_RESTART_BACKOFF_MS);
        let doubled = first.saturating_mul(1u64 << retries.saturating_sub(1).min(30));
        doubled.min(MAX_RESTART_BACKOFF_MS.max(first))
    }

    /// Whether its gang may start with fewer than `replicas` ranks.
    pub fn is_elastic(&self) -> bool {
        self.min_replicas() < self.replicas()
    }

    pub fn runtime(&self) -> Runtime {
        self.template.runtime()
    }
}
