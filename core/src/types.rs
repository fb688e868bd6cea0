//! Domain types. Serializable (the master's replicated log and snapshots carry
//! them), plain data, no I/O.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

pub type AgentId = String;
pub type JobId = String;
pub type TaskId = String;
pub type GpuUuid = String;
pub type FrameworkId = String;

/// Scalar resources of an agent or asked for by a task.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Resources {
    pub cpus: f64,
    pub mem_mib: u64,
    pub gpus: u32,
    /// Host ports (a count; the numbers come from the agent's range,
    /// [`AgentInfo::ports`], chosen by the master when a task launches).
    #[serde(default)]
    pub ports: u32,
}

impl Resources {
    /// True when `self` can hold `need`.
    pub fn fits(&self, need: &Resources) -> bool {
        // A small epsilon keeps 0.1 + 0.2 style sums from refusing an exact fit.
        need.cpus <= self.cpus + 1e-9
            && need.mem_mib <= self.mem_mib
            && need.gpus <= self.gpus
            && need.ports <= self.ports
    }

    pub fn saturating_sub(&self, other: &Resources) -> Resources {
        Resources {
            cpus: (self.cpus - other.cpus).max(0.0),
            mem_mib: self.mem_mib.saturating_sub(other.mem_mib),
            gpus: self.gpus.saturating_sub(other.gpus),
            ports: self.ports.saturating_sub(other.ports),
        }
    }

    pub fn add(&self, other: &Resources) -> Resources {
        Resources {
            cpus: self.cpus + other.cpus,
            mem_mib: self.mem_mib.saturating_add(other.mem_mib),
            gpus: self.gpus.saturating_add(other.gpus),
            ports: self.ports.saturating_add(other.ports),
        }
    }
}

/// An agent's host ports for tasks, `start..=end` (`--ports START-END`).
/// Tasks run on the host network, so a port is a host-wide resource: the
/// master gives each number to one live task at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortRange {
    pub start: u16,
    pub end: u16,
}

impl PortRange {
    /// How many ports it holds.
    pub fn len(&self) -> u32 {
        (u32::from(self.end) + 1).saturating_sub(u32::from(self.start))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn contains(&self, port: u16) -> bool {
        (self.start..=self.end).contains(&port)
    }

    /// Parses `START-END` (inclusive, 1..=65535, START <= END).
    pub fn parse(s: &str) -> Result<PortRange, String> {
        let (a, b) = s
            .split_once('-')
            .ok_or_else(|| format!("{s:?}: expected START-END, e.g. 31000-32000"))?;
        let num = |v: &str| -> Result<u16, String> {
            match v.trim().parse::<u16>() {
                Ok(0) | Err(_) => Err(format!("{s:?}: {v:?} is not a port (1-65535)")),
                Ok(p) => Ok(p),
            }
        };
        let (start, end) = (num(a)?, num(b)?);
        if start > end {
            return Err(format!("{s:?}: the range is empty ({start} > {end})"));
        }
        Ok(PortRange { start, end })
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.start, self.end)
    }
}

/// Fields added after the first release carry `#[serde(default)]`: the
/// master's log holds these structs, and old entries must still decode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub uuid: GpuUuid,
    pub index: u32,
    pub minor: u32,
    pub model: String,
    pub memory_mib: u64,
    pub healthy: bool,
    pub pci_bus_id: String,
    #[serde(default)]
    pub serial: String,
    #[serde(default)]
    pub numa_node: Option<u32>,
    /// `(major, minor)`, e.g. `(8, 0)` for an A100.
    #[serde(default)]
    pub compute_capability: Option<(u32, u32)>,
    #[serde(default)]
    pub peers: Vec<GpuPeer>,
    #[serde(default)]
    pub unhealthy_reason: String,
    /// MIG: the GPU's mode, its MIG devices and what it could still host.
    /// Default (off, none) for a GPU without MIG.
    #[serde(default, skip_serializing_if = "MigInfo::is_off")]
    pub mig: MigInfo,
}

/// A GPU's MIG state as its agent discovered it through NVML.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigInfo {
    /// MIG mode is on (NVML's current mode).
    #[serde(default)]
    pub enabled: bool,
    /// The mode after the next GPU reset, when it differs (A100: a mode
    /// change waits for a reset).
    #[serde(default)]
    pub pending: Option<bool>,
    #[serde(default)]
    pub devices: Vec<MigDevice>,
    /// The profiles the GPU could still host next to its devices, and how
    /// many of each (NVML's remaining capacity); empty when none fits.
    #[serde(default)]
    pub free: Vec<MigCapacity>,
    /// The GPU has MIG (NVML reports a mode), whether or not it is on.
    #[serde(default)]
    pub capable: bool,
    /// The GPU instance profiles it offers (an empty GPU's table).
    #[serde(default)]
    pub profiles: Vec<MigProfile>,
}

/// A GPU instance profile of a MIG-capable GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigProfile {
    pub name: String,
    pub gpu_slices: u32,
    pub memory_mib: u64,
    /// Most instances of it on an empty GPU.
    pub max_count: u32,
}

impl MigInfo {
    pub fn is_off(&self) -> bool {
        *self == MigInfo::default()
    }
}

/// One MIG device: a GPU instance and the compute instance spanning it,
/// which CUDA sees as a device of its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigDevice {
    /// `MIG-…`, as in `NVIDIA_VISIBLE_DEVICES`.
    pub uuid: String,
    /// The profile's name, e.g. `1g.10gb`: compute slices and memory.
    pub profile: String,
    pub memory_mib: u64,
    /// Slices of the GPU's compute (out of 7) and of its compute instance.
    pub gpu_slices: u32,
    pub compute_slices: u32,
    /// NVML's GPU instance and compute instance ids.
    pub gi_id: u32,
    pub ci_id: u32,
    /// Minors of the `/dev/nvidia-caps/nvidia-capN` nodes that grant
    /// access to it (its GPU instance's and its compute instance's); empty
    /// when the host does not say (no `mig-minors` file).
    pub caps_minors: Vec<u32>,
}

/// A device a task can be given: a whole GPU that is not in MIG mode, or
/// one MIG device of a GPU that is. `Resources::gpus` counts devices, so a
/// MIG device counts as one GPU in totals, quotas and fair shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device<'a> {
    Gpu(&'a GpuInfo),
    Mig {
        parent: &'a GpuInfo,
        device: &'a MigDevice,
    },
}

impl<'a> Device<'a> {
    pub fn uuid(&self) -> &'a str {
        match self {
            Device::Gpu(g) => &g.uuid,
            Device::Mig { device, .. } => &device.uuid,
        }
    }

    /// The physical GPU: itself, or the MIG device's parent.
    pub fn gpu(&self) -> &'a GpuInfo {
        match self {
            Device::Gpu(g) => g,
            Device::Mig { parent, .. } => parent,
        }
    }

    /// The MIG profile; `None` for a whole GPU.
    pub fn mig_profile(&self) -> Option<&'a str> {
        match self {
            Device::Gpu(_) => None,
            Device::Mig { device, .. } => Some(&device.profile),
        }
    }

    pub fn memory_mib(&self) -> u64 {
        match self {
            Device::Gpu(g) => g.memory_mib,
            Device::Mig { device, .. } => device.memory_mib,
        }
    }

    /// The device as one entry of a list of GPUs (the allocator's unit):
    /// a MIG device is its parent narrowed to it (its uuid and memory, MIG
    /// mode with only this device, no peers).
    pub fn to_gpu(&self) -> GpuInfo {
        match self {
            Device::Gpu(g) => (*g).clone(),
            Device::Mig { parent, device } => GpuInfo {
                uuid: device.uuid.clone(),
                memory_mib: device.memory_mib,
                peers: Vec::new(),
                mig: MigInfo {
                    enabled: true,
                    pending: None,
                    devices: vec![(*device).clone()],
                    free: Vec::new(),
                    capable: true,
                    profiles: Vec::new(),
                },
                ..(*parent).clone()
            },
        }
    }
}

/// What a list of GPUs says of the devices `uuids` (an offer's): each
/// whole GPU named, and each parent of a MIG device named with only its
/// named MIG devices listed. In the order of `gpus`.
pub fn gpus_of_devices(gpus: &[GpuInfo], uuids: &[String]) -> Vec<GpuInfo> {
    let named = |u: &str| uuids.iter().any(|x| x == u);
    let mut out = Vec::new();
    for g in gpus {
        if !g.mig.enabled {
            if named(&g.uuid) {
                out.push(g.clone());
            }
            continue;
        }
        if g.mig.devices.iter().any(|d| named(&d.uuid)) {
            let mut p = g.clone();
            p.mig.devices.retain(|d| named(&d.uuid));
            out.push(p);
        }
    }
    out
}

/// Every device `gpus` give tasks: each GPU not in MIG mode, and each MIG
/// device of those that are (a GPU in MIG mode is never given whole).
pub fn devices(gpus: &[GpuInfo]) -> impl Iterator<Item = Device<'_>> {
    gpus.iter().flat_map(|g| {
        let whole = (!g.mig.enabled).then_some(Device::Gpu(g));
        whole
            .into_iter()
            .chain(g.mig_devices().iter().map(move |d| Device::Mig {
                parent: g,
                device: d,
            }))
    })
}

/// Every MIG device `gpus` give tasks, with its parent GPU.
pub fn mig_devices_of(gpus: &[GpuInfo]) -> impl Iterator<Item = (&GpuInfo, &MigDevice)> {
    gpus.iter()
        .flat_map(|g| g.mig_devices().iter().map(move |d| (g, d)))
}

/// How many devices `gpus` give tasks (an agent's `total.gpus`).
pub fn device_count(gpus: &[GpuInfo]) -> u32 {
    u32::try_from(devices(gpus).count()).unwrap_or(u32::MAX)
}

/// The device `uuid` names among `gpus`: a whole GPU (also one in MIG
/// mode, which callers refuse by its mode) or a MIG device of a GPU in
/// MIG mode.
pub fn find_device<'a>(gpus: &'a [GpuInfo], uuid: &str) -> Option<Device<'a>> {
    gpus.iter().find_map(|g| {
        if g.uuid == uuid {
            return Some(Device::Gpu(g));
        }
        g.mig_devices()
            .iter()
            .find(|d| d.uuid == uuid)
            .map(|d| Device::Mig {
                parent: g,
                device: d,
            })
    })
}

/// How many more MIG devices of a profile a GPU could host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigCapacity {
    pub profile: String,
    pub count: u32,
}

impl GpuInfo {
    /// Its MIG devices that tasks may be given: those of a GPU in MIG mode.
    pub fn mig_devices(&self) -> &[MigDevice] {
        if self.mig.enabled {
            &self.mig.devices
        } else {
            &[]
        }
    }

    /// A GPU known only by identity; the rest is filled by discovery.
    pub fn new(
        uuid: impl Into<String>,
        index: u32,
        model: impl Into<String>,
        memory_mib: u64,
    ) -> Self {
        GpuInfo {
            uuid: uuid.into(),
            index,
            minor: index,
            model: model.into(),
            memory_mib,
            healthy: true,
            pci_bus_id: String::new(),
            serial: String::new(),
            numa_node: None,
            compute_capability: None,
            peers: Vec::new(),
            unhealthy_reason: String::new(),
            mig: MigInfo::default(),
        }
    }
}

/// How one GPU reaches another GPU of the same host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuPeer {
    pub uuid: GpuUuid,
    /// Active NVLink links between the two.
    pub nvlinks: u32,
    /// PCIe path: PIX, PXB, PHB, NODE or SYS (as `nvidia-smi topo -m`);
    /// empty when unknown.
    pub pcie: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Runtime {
    Docker,
    Process,
}

impl fmt::Display for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Runtime::Docker => "docker",
            Runtime::Process => "process",
        })
    }
}

impl std::str::FromStr for Runtime {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "docker" => Ok(Runtime::Docker),
            "process" => Ok(Runtime::Process),
            other => Err(format!(
                "unknown runtime {other:?} (expected docker or process)"
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TaskState {
    Staging,
    Starting,
    Running,
    Finished,
    Failed,
    Killed,
    Lost,
    Error,
    /// Its agent stopped heartbeating: NOT terminal. The task may still run
    /// and keeps its GPUs; it goes back to the state it had when its agent
    /// re-registers listing it, or LOST when its agent is declared lost.
    Unreachable,
}

impl TaskState {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskState::Finished
                | TaskState::Failed
                | TaskState::Killed
                | TaskState::Lost
                | TaskState::Error
        )
    }
}

impl fmt::Display for TaskState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TaskState::Staging => "STAGING",
            TaskState::Starting => "STARTING",
            TaskState::Running => "RUNNING",
            TaskState::Finished => "FINISHED",
            TaskState::Failed => "FAILED",
            TaskState::Killed => "KILLED",
            TaskState::Lost => "LOST",
            TaskState::Error => "ERROR",
            TaskState::Unreachable => "UNREACHABLE",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum JobState {
    Queued,
    Starting,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed | JobState::Cancelled
        )
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            JobState::Queued => "QUEUED",
            JobState::Starting => "STARTING",
            JobState::Running => "RUNNING",
            JobState::Succeeded => "SUCCEEDED",
            JobState::Failed => "FAILED",
            JobState::Cancelled => "CANCELLED",
        })
    }
}

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
    /// submitter's token (an admin may name one). Empty: the default tenant
    /// (no security configured, or submitted before tenants existed).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tenant: String,
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
    /// by each retry up to [`crate::convert::MAX_RESTART_BACKOFF_MS`];
    /// `None`: [`crate::convert::DEFAULT_RESTART_BACKOFF_MS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_backoff_ms: Option<u64>,
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
        })
    }
}

impl std::str::FromStr for RestartPolicy {
    type Err = String;
    /// `gang` or `never`, in any case; "" is `gang`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "gang" => Ok(RestartPolicy::Gang),
            "never" => Ok(RestartPolicy::Never),
            _ => Err(format!("{s:?} is not a restart policy (gang, never)")),
        }
    }
}

/// What a task may do on its agent beyond the defaults (docs/isolation.md,
/// "What a task may do"). Checked when a job enters the cluster
/// (`convert::check_security`) and enforced by the agent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSecurity {
    /// Run as `UID` or `UID:GID` (numeric: names differ between hosts and
    /// images; `UID` alone is `UID:UID`). A container gets it as Docker's
    /// `User`; a host process switches to it before exec. `None`: the
    /// image's user, or the agent's `task_user` for a host process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Host paths bind-mounted into a container (containers only); the
    /// agent refuses any outside its `allowed_mounts`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<HostMount>,
    /// Only so that asking is refused clearly: never allowed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub privileged: bool,
    /// A host-process task runs as root; only on agents with
    /// `allow_root_tasks`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub run_as_root: bool,
}

impl TaskSecurity {
    pub fn is_default(&self) -> bool {
        *self == TaskSecurity::default()
    }
}

/// A host path bind-mounted into a container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostMount {
    pub host_path: String,
    pub container_path: String,
    /// Read-only unless asked otherwise.
    #[serde(default = "yes")]
    pub read_only: bool,
}

fn yes() -> bool {
    true
}

/// Whether `path` is one of `prefixes` or below one, by whole components:
/// `/data` covers `/data` and `/data/x`, not `/database`; `/` covers all.
/// Paths are compared as written (the agent resolves symlinks first).
pub fn path_within<S: AsRef<str>>(prefixes: &[S], path: &str) -> bool {
    prefixes.iter().any(|p| {
        let p = p.as_ref().trim_end_matches('/');
        path == p
            || path
                .strip_prefix(p)
                .is_some_and(|rest| rest.starts_with('/'))
    })
}

/// A numeric user and group, as `UID:GID`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserIds {
    pub uid: u32,
    pub gid: u32,
}

impl UserIds {
    /// Root: uid 0, or gid 0 (the root group reads what root's files share
    /// with it).
    pub fn is_root(&self) -> bool {
        self.uid == 0 || self.gid == 0
    }
}

impl fmt::Display for UserIds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.uid, self.gid)
    }
}

impl std::str::FromStr for UserIds {
    type Err = String;
    /// `UID` (read as `UID:UID`) or `UID:GID`, decimal.
    fn from_str(s: &str) -> Result<Self, String> {
        let num = |p: &str| {
            if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("{s:?} is not UID or UID:GID (numbers)"));
            }
            p.parse::<u32>()
                .ok()
                // (u32::MAX is -1 to the kernel: "leave unchanged".)
                .filter(|n| *n != u32::MAX)
                .ok_or_else(|| format!("{s:?}: {p} is not a valid id"))
        };
        match s.split_once(':') {
            Some((u, g)) => Ok(UserIds {
                uid: num(u)?,
                gid: num(g)?,
            }),
            None => {
                let uid = num(s)?;
                Ok(UserIds { uid, gid: uid })
            }
        }
    }
}

/// Numeric user or group ids as inclusive ranges (`1000-1999,2500`), kept
/// sorted and merged; empty is "none". Used for the ids a token lets its
/// holder choose (`gpuctl tokens create --allow-uids`), the ids an agent
/// lets jobs choose (`allowed_users`) and an agent's own range for tasks
/// (`task_users`). Never 0 (root is asked for with `run_as_root`) nor
/// 4294967295 (-1 to the kernel: "leave unchanged").
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IdRanges(Vec<(u32, u32)>);

impl IdRanges {
    /// Most ranges one list may hold (a token's and an agent's lists are
    /// replicated and shown; a short list is all a policy needs).
    pub const MAX_RANGES: usize = 32;

    /// No id at all.
    pub fn none() -> IdRanges {
        IdRanges(Vec::new())
    }

    /// Every id a job may name: 1 to 4294967294.
    pub fn all() -> IdRanges {
        IdRanges(vec![(1, u32::MAX - 1)])
    }

    /// From `(first, last)` pairs, checked (each first <= last, within
    /// 1..=4294967294, at most [`Self::MAX_RANGES`]); overlapping and
    /// touching ranges are merged.
    pub fn from_ranges(mut ranges: Vec<(u32, u32)>) -> Result<IdRanges, String> {
        if ranges.len() > Self::MAX_RANGES {
            return Err(format!(
                "{} ranges, at most {}",
                ranges.len(),
                Self::MAX_RANGES
            ));
        }
        for &(a, b) in &ranges {
            if a == 0 || b == u32::MAX {
                return Err(format!(
                    "{a}-{b}: ids are 1 to 4294967294 (0 is root, asked for with run_as_root)"
                ));
            }
            if a > b {
                return Err(format!("{a}-{b}: the range is empty ({a} > {b})"));
            }
        }
        ranges.sort_unstable();
        let mut merged: Vec<(u32, u32)> = Vec::with_capacity(ranges.len());
        for (a, b) in ranges {
            match merged.last_mut() {
                Some(last) if a <= last.1.saturating_add(1) => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        Ok(IdRanges(merged))
    }

    /// Parses `none` (or nothing) or a comma-separated list of `ID` and
    /// `FIRST-LAST`, decimal.
    pub fn parse(s: &str) -> Result<IdRanges, String> {
        let t = s.trim();
        if t.is_empty() || t == "none" {
            return Ok(IdRanges::none());
        }
        let num = |v: &str| -> Result<u32, String> {
            let v = v.trim();
            if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!(
                    "{s:?}: {v:?} is not an id (expected ID or FIRST-LAST, comma separated, or none)"
                ));
            }
            v.parse::<u32>()
                .map_err(|_| format!("{s:?}: {v} is not a valid id"))
        };
        let ranges = t
            .split(',')
            .map(|part| match part.split_once('-') {
                Some((a, b)) => Ok((num(a)?, num(b)?)),
                None => num(part).map(|n| (n, n)),
            })
            .collect::<Result<Vec<_>, String>>()?;
        IdRanges::from_ranges(ranges).map_err(|e| format!("{s:?}: {e}"))
    }

    pub fn ranges(&self) -> &[(u32, u32)] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn contains(&self, id: u32) -> bool {
        self.0.iter().any(|&(a, b)| (a..=b).contains(&id))
    }

    /// Whether some id is in both.
    pub fn overlaps(&self, other: &IdRanges) -> bool {
        self.0
            .iter()
            .any(|&(a, b)| other.0.iter().any(|&(c, d)| a <= d && c <= b))
    }

    /// How many ids it holds.
    pub fn count(&self) -> u64 {
        self.0
            .iter()
            .map(|&(a, b)| u64::from(b) - u64::from(a) + 1)
            .sum()
    }

    /// Its ids in order, from the first one at or after `from`, then
    /// around from the start: the order in which an agent tries ids for
    /// tasks, so the one most recently given out is tried last.
    pub fn ids_from(&self, from: u32) -> impl Iterator<Item = u32> + '_ {
        let after = self
            .0
            .iter()
            .filter(move |&&(_, b)| b >= from)
            .flat_map(move |&(a, b)| a.max(from)..=b);
        let before = self
            .0
            .iter()
            .filter(move |&&(a, _)| a < from)
            .flat_map(move |&(a, b)| a..=b.min(from.saturating_sub(1)));
        after.chain(before)
    }
}

impl fmt::Display for IdRanges {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        for (i, &(a, b)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            if a == b {
                write!(f, "{a}")?;
            } else {
                write!(f, "{a}-{b}")?;
            }
        }
        Ok(())
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
            tenant: String::new(),
            secret_env: Default::default(),
            require_cuda: None,
            min_replicas: None,
            restart_policy: RestartPolicy::Gang,
            restart_backoff_ms: None,
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
    /// [`crate::convert::MAX_RESTART_BACKOFF_MS`].
    pub fn restart_backoff(&self, retries: u32) -> u64 {
        let first = self
            .restart_backoff_ms
            .unwrap_or(crate::convert::DEFAULT_RESTART_BACKOFF_MS);
        let doubled = first.saturating_mul(1u64 << retries.saturating_sub(1).min(30));
        doubled.min(crate::convert::MAX_RESTART_BACKOFF_MS.max(first))
    }

    /// Whether its gang may start with fewer than `replicas` ranks.
    pub fn is_elastic(&self) -> bool {
        self.min_replicas() < self.replicas()
    }

    pub fn runtime(&self) -> Runtime {
        self.template.runtime()
    }
}

/// What an agent runs: a job's spec bound to an agent and exact GPUs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskSpec {
    pub task_id: TaskId,
    /// The gpuctl job; empty for a framework's task.
    pub job_id: JobId,
    /// The framework that launched it; empty for gpuctl jobs.
    #[serde(default)]
    pub framework_id: FrameworkId,
    /// Its job's template with the task's own env (rank, peers, ports) and
    /// resources; a framework's task has the defaults but for what it
    /// launched with.
    #[serde(flatten)]
    pub template: TaskTemplate,
    pub gpu_uuids: Vec<GpuUuid>,
    /// A fraction of its one GPU, and how that GPU is shared; `None`:
    /// whole GPUs or MIG devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<TaskShare>,
}

/// Why the master wants a task stopped, as its agent tells the task in its
/// notice file: `kind` is machine-readable (`preempted`, `drained`,
/// `cancelled`, `killed`, or the lower-case name of any other reason the
/// master records), `message` the task's message (`preempted by job-7
/// (priority 5)`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopNotice {
    pub kind: String,
    pub message: String,
}

/// What a task holds of a shared GPU, as its agent enforces it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskShare {
    pub fraction: GpuFraction,
    pub mode: ShareMode,
    /// The tenant the task is charged to: tasks of different tenants never
    /// share an MPS server. Empty: the default tenant.
    #[serde(default)]
    pub tenant: String,
}

/// What an agent says about itself when it registers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentInfo {
    pub id: AgentId,
    pub hostname: String,
    pub address: String,
    pub total: Resources,
    pub gpus: Vec<GpuInfo>,
    pub runtimes: Vec<Runtime>,
    pub simulated_gpus: bool,
    /// GPU feature labels (see the agent's `gpu::labels`).
    #[serde(default)]
    pub attributes: BTreeMap<String, String>,
    #[serde(default)]
    pub driver_version: Option<String>,
    #[serde(default)]
    pub cuda_driver_version: Option<String>,
    /// Host-process tasks may run as root here (`allow_root_tasks`).
    #[serde(default)]
    pub allow_root_tasks: bool,
    /// Host path prefixes containers may mount here (`allowed_mounts`).
    #[serde(default)]
    pub allowed_mounts: Vec<String>,
    /// Host ports tasks may be given here (`total.ports` is its size);
    /// `None` from agents that offer none.
    #[serde(default)]
    pub ports: Option<PortRange>,
    /// Its default for its GPUs (`--share-gpus`): shareable in this mode
    /// unless an admin said otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_gpus: Option<ShareMode>,
    /// The ids a job may name here (`allowed_users`); `None` from agents
    /// that do not say (any).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_users: Option<IdRanges>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusUpdate {
    pub agent_id: AgentId,
    pub task_id: TaskId,
    pub state: TaskState,
    pub exit_code: Option<i32>,
    pub message: String,
    /// Identifies this update for acknowledgement; empty from old agents.
    #[serde(default)]
    pub uuid: Vec<u8>,
    /// The task ended because one of its GPUs failed a health check.
    #[serde(default)]
    pub gpu_unhealthy: bool,
    /// The agent killed the task because it heard from no leader for its
    /// fence timeout (wire: state KILLED, reason REASON_FENCED).
    #[serde(default)]
    pub fenced: bool,
    /// The state of a newer update the agent holds behind this one (until
    /// this one is acknowledged); a final one means the task's processes
    /// are gone and its GPUs may be given again. None: this is the latest.
    #[serde(default)]
    pub latest_state: Option<TaskState>,
    /// Not empty: the agent refused to start the task because its driver
    /// does not meet what the image requires (wire: state FAILED, reason
    /// REASON_DRIVER_REQUIREMENT_UNMET); these are all the image's
    /// requirements, as text (the master parses them when it applies the
    /// update, so that an agent's bad text never makes the log unreadable).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requires: Vec<String>,
    /// For a task holding a fraction of a shared GPU: what its agent
    /// enforces of it (sent with STARTING).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforcement: Option<Enforcement>,
    /// The agent stopped the task for using more GPU memory than its
    /// fraction (wire: state FAILED, reason REASON_GPU_MEMORY_LIMIT).
    #[serde(default)]
    pub gpu_memory_limit: bool,
    /// The agent stopped the task as hung (wire: state FAILED, reason
    /// REASON_HUNG).
    #[serde(default)]
    pub hung: bool,
    /// With `gpu_unhealthy`: the GPUs that failed (whole GPUs), which the
    /// job avoids when placed again; empty: all of the task's are suspect.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed_gpus: Vec<String>,
    /// Its container runtime stopped it as the runtime restarted (wire:
    /// state FAILED, reason REASON_RUNTIME_RESTARTED): not its own failure.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub runtime_restarted: bool,
}

/// What an agent enforces of a fraction of a shared GPU, stated per task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Enforcement {
    /// The driver's per-cgroup memory cap: the task's processes together.
    Driver,
    /// MPS limits, per process of the task.
    Mps,
    /// Nothing: the scheduler counts, nothing limits (time-slicing).
    None,
}

impl fmt::Display for Enforcement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Enforcement::Driver => "driver",
            Enforcement::Mps => "mps",
            Enforcement::None => "none",
        })
    }
}

impl std::str::FromStr for Enforcement {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "driver" => Ok(Enforcement::Driver),
            "mps" => Ok(Enforcement::Mps),
            "none" => Ok(Enforcement::None),
            _ => Err(format!(
                "{s:?} is not an enforcement level (driver, mps, none)"
            )),
        }
    }
}

/// Whether one of an agent's container runtimes works now, as its last
/// heartbeat said.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeStatus {
    pub runtime: Runtime,
    pub available: bool,
    /// Why it is not available (or a note); may be empty.
    pub message: String,
}

/// One reading of a GPU's gauges, by the agent's health probe.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuSample {
    /// GPU (SM) busy time over NVML's last sample period, 0 to 100.
    pub utilization_pct: u32,
    pub memory_used_mib: u64,
    pub memory_total_mib: u64,
    pub temperature_c: Option<u32>,
    pub power_w: Option<f64>,
    /// Agent clock, ms since the Unix epoch.
    pub sampled_at_ms: u64,
    /// Critical XID events seen since the agent started.
    pub xid_errors: u64,
    /// GPU memory used by each task's processes (NVML's per-process
    /// accounting), MiB by task id; only tasks with a process on the GPU.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub task_memory_used_mib: BTreeMap<TaskId, u64>,
    /// Each task's processes' share of the GPU's SMs over the last sample
    /// period (NVML's per-process utilization), percent by task id; only
    /// tasks NVML sampled (what a fraction of a shared GPU used).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub task_utilization_pct: BTreeMap<TaskId, u32>,
    /// Whether the per-process readings were read: a task on the GPU
    /// absent from `task_utilization_pct` then used none of it.
    #[serde(default)]
    pub task_utilization_read: bool,
}

/// A GPU's health as its agent sees it now, with its latest reading.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuReport {
    pub uuid: GpuUuid,
    pub healthy: bool,
    pub unhealthy_reason: String,
    pub sample: Option<GpuSample>,
}

/// Why a task is in its state (the API's `Reason`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaskReason {
    #[default]
    Unspecified,
    CommandExited,
    TaskInvalid,
    ResourcesUnavailable,
    AgentLost,
    FrameworkRemoved,
    KilledByFramework,
    ContainerLaunchFailed,
    /// Stopped for a job of higher priority.
    Preempted,
    /// One of its GPUs failed a health check.
    GpuUnhealthy,
    /// Killed by its own agent, which heard from no leader for its fence
    /// timeout. For its job it counts like LOST (the retry policy).
    Fenced,
    /// Killed because its agent is drained (`--kill` or the deadline).
    AgentDrained,
    /// Refused before it started: its image requires of the NVIDIA driver
    /// what its agent's does not offer. Its job goes back to the queue
    /// without using a retry, placed from then on only where the driver
    /// qualifies.
    DriverRequirementUnmet,
    /// Stopped by its agent: its processes together used more GPU memory
    /// than its fraction of a shared GPU.
    GpuMemoryLimit,
    /// Stopped to give GPUs back to a tenant below its fair share: its own
    /// tenant held more than its share.
    Reclaimed,
    /// Stopped by its agent: no output and no GPU activity for its job's
    /// hang timeout.
    Hung,
    /// Stopped by its container runtime as the runtime restarted (dockerd
    /// without live-restore): its job goes back to the queue without using
    /// a retry.
    RuntimeRestarted,
}

/// The id of gpuctl's own job scheduler, which runs as a framework; no
/// other framework may take it.
pub const BUILTIN_FRAMEWORK_ID: &str = "gpuctl-jobs";

/// A task as a framework launches it (checked in `convert`; checked
/// against the accepted offers and the state by the master).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrameworkTask {
    /// The framework's own id for it.
    pub task_id: String,
    pub agent_id: AgentId,
    pub image: Option<String>,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub resources: Resources,
    /// Whole GPUs and MIG devices; for a fraction, its one shared GPU (as
    /// a fraction's task record names it).
    pub gpu_uuids: Vec<GpuUuid>,
    /// A fraction of its one shared GPU instead of devices
    /// (`resources.gpus` 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fraction: Option<GpuFraction>,
}

/// A checked ListJobs request.
#[derive(Debug, Clone, PartialEq)]
pub struct JobsQuery {
    /// Empty: any state.
    pub states: std::collections::HashSet<JobState>,
    pub name: Option<String>,
    pub limit: usize,
    /// Only jobs with a smaller sequence number (from the page token).
    pub before: Option<u64>,
}

/// A framework as it registers (the framework API).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrameworkInfo {
    /// Empty when subscribing for the first time: the master assigns one.
    pub id: FrameworkId,
    pub name: String,
    pub roles: Vec<String>,
    /// Capability GPU_RESOURCES.
    pub gpu_capable: bool,
    pub failover_timeout_ms: u64,
    /// The tenant it acts for, set by the master from its token (not part
    /// of the API: a framework cannot choose it). Empty: the default tenant.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tenant: String,
}

impl FrameworkInfo {
    /// The role its resources are accounted to (the first; "default" when none).
    pub fn role(&self) -> &str {
        self.roles.first().map_or("default", String::as_str)
    }
}

/// Orders ids as people read them: runs of digits by their value, so
/// `fw-2` < `fw-10`; the rest byte by byte. Ties (`fw-01`, `fw-1`) fall
/// back to the plain byte order, so the order is total.
pub fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    let (x, y) = (a.as_bytes(), b.as_bytes());
    let (mut i, mut j) = (0, 0);
    while i < x.len() && j < y.len() {
        if x[i].is_ascii_digit() && y[j].is_ascii_digit() {
            let (si, sj) = (i, j);
            while i < x.len() && x[i].is_ascii_digit() {
                i += 1;
            }
            while j < y.len() && y[j].is_ascii_digit() {
                j += 1;
            }
            // Compare values without parsing: strip leading zeros, then
            // the longer run is larger, then digit by digit.
            let strip = |d: &[u8]| {
                let z = d.iter().take_while(|&&c| c == b'0').count();
                d[z..].to_vec()
            };
            let (p, q) = (strip(&x[si..i]), strip(&y[sj..j]));
            let o = p.len().cmp(&q.len()).then_with(|| p.cmp(&q));
            if o != Ordering::Equal {
                return o;
            }
        } else {
            let o = x[i].cmp(&y[j]);
            if o != Ordering::Equal {
                return o;
            }
            i += 1;
            j += 1;
        }
    }
    (x.len() - i).cmp(&(y.len() - j)).then_with(|| a.cmp(b))
}

/// Milliseconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ` (UTC). Pure:
/// the state machine writes it into messages.
pub fn utc_timestamp(ms: u64) -> String {
    let secs = ms / 1000;
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day); Howard Hinnant's algorithm.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_gpu_in_mig_mode_gives_its_mig_devices_never_itself() {
        use super::*;
        let dev = |uuid: &str, profile: &str| MigDevice {
            uuid: uuid.into(),
            profile: profile.into(),
            memory_mib: 9984,
            gpu_slices: 1,
            compute_slices: 1,
            gi_id: 7,
            ci_id: 0,
            caps_minors: vec![66, 67],
        };
        let mut split = GpuInfo::new("GPU-a", 0, "H100", 81920);
        split.mig.enabled = true;
        split.mig.devices = vec![dev("MIG-1", "1g.10gb"), dev("MIG-2", "2g.20gb")];
        let whole = GpuInfo::new("GPU-b", 1, "H100", 81920);
        // MIG mode off: its listed devices (none should be) are not given.
        let mut off = GpuInfo::new("GPU-c", 2, "H100", 81920);
        off.mig.devices = vec![dev("MIG-3", "1g.10gb")];
        let gpus = vec![split, whole, off];
        let uuids: Vec<&str> = devices(&gpus).map(|d| d.uuid()).collect();
        assert_eq!(uuids, ["MIG-1", "MIG-2", "GPU-b", "GPU-c"]);
        assert_eq!(device_count(&gpus), 4);
        let d = find_device(&gpus, "MIG-2").unwrap();
        assert_eq!(
            (d.gpu().uuid.as_str(), d.mig_profile()),
            ("GPU-a", Some("2g.20gb"))
        );
        assert!(find_device(&gpus, "MIG-3").is_none());
        // As an offer's entry: the parent narrowed to the device.
        let g = d.to_gpu();
        assert_eq!((g.uuid.as_str(), g.index, g.memory_mib), ("MIG-2", 0, 9984));
        assert_eq!(g.mig.devices.len(), 1);
        // An offer's GPUs: the parent with only the offered device.
        let offered = gpus_of_devices(&gpus, &["MIG-1".into(), "GPU-b".into()]);
        let names: Vec<(&str, usize)> = offered
            .iter()
            .map(|g| (g.uuid.as_str(), g.mig.devices.len()))
            .collect();
        assert_eq!(names, [("GPU-a", 1), ("GPU-b", 0)]);
        assert_eq!(offered[0].mig.devices[0].uuid, "MIG-1");
    }

    #[test]
    fn port_ranges_parse_inclusive_and_refuse_nonsense() {
        use super::{PortRange, Resources};
        let r = PortRange::parse("31000-32000").unwrap();
        assert_eq!((r.start, r.end, r.len()), (31000, 32000, 1001));
        assert!(r.contains(31000) && r.contains(32000) && !r.contains(32001));
        assert_eq!(r.to_string(), "31000-32000");
        assert_eq!(PortRange::parse(" 7 - 7 ").unwrap().len(), 1);
        assert_eq!(PortRange::parse("1-65535").unwrap().len(), 65535);
        for bad in ["", "31000", "0-10", "10-5", "1-65536", "a-b", "-5"] {
            assert!(PortRange::parse(bad).is_err(), "{bad:?}");
        }
        // Ports count like the other scalars.
        let free = Resources {
            ports: 2,
            ..Default::default()
        };
        let three = Resources {
            ports: 3,
            ..Default::default()
        };
        assert!(!free.fits(&three));
        assert_eq!(free.add(&three).saturating_sub(&free).ports, 3);
    }

    #[test]
    fn ids_are_ordered_by_their_numbers() {
        use super::natural_cmp;
        let mut ids = vec![
            "fw-10",
            "fw-2",
            "fw-1",
            "gpuctl-jobs",
            "fw-02",
            "fw-1a",
            "fw",
        ];
        ids.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            ids,
            [
                "fw",
                "fw-1",
                "fw-1a",
                "fw-02",
                "fw-2",
                "fw-10",
                "gpuctl-jobs"
            ]
        );
        assert_eq!(
            natural_cmp("a99999999999999999999", "a100000000000000000000"),
            std::cmp::Ordering::Less
        );
    }
    use super::*;

    #[test]
    fn id_ranges_parse_merge_and_show() {
        let r = IdRanges::parse("2000-2999, 1000-1999,5000,3000-3100").unwrap();
        assert_eq!(r.ranges(), &[(1000, 3100), (5000, 5000)]);
        assert_eq!(r.to_string(), "1000-3100,5000");
        assert_eq!(IdRanges::parse(&r.to_string()).unwrap(), r);
        assert_eq!(r.count(), 2102);
        assert!(r.contains(1000) && r.contains(3100) && r.contains(5000));
        assert!(!r.contains(999) && !r.contains(3101) && !r.contains(4999));
        assert!(IdRanges::parse("none").unwrap().is_empty());
        assert!(IdRanges::parse("").unwrap().is_empty());
        assert_eq!(IdRanges::none().to_string(), "none");
        for bad in [
            "0",
            "0-10",
            "5-4294967295",
            "10-5",
            "a",
            "1-",
            "-1",
            "1,,2",
            "1-2-3",
            "99999999999",
        ] {
            assert!(IdRanges::parse(bad).is_err(), "{bad:?}");
        }
        let many = (1..=33).map(|i| (i * 10).to_string()).collect::<Vec<_>>();
        let err = IdRanges::parse(&many.join(",")).unwrap_err();
        assert!(err.contains("at most 32"), "{err}");
        let a = IdRanges::parse("100-200").unwrap();
        assert!(a.overlaps(&IdRanges::parse("200-300").unwrap()));
        assert!(a.overlaps(&IdRanges::parse("1-100").unwrap()));
        assert!(!a.overlaps(&IdRanges::parse("201-300,1-99").unwrap()));
        assert!(!a.overlaps(&IdRanges::none()));
    }

    #[test]
    fn id_ranges_are_walked_round_robin() {
        let r = IdRanges::parse("10-12,20-21").unwrap();
        let from = |n| r.ids_from(n).collect::<Vec<_>>();
        assert_eq!(from(0), [10, 11, 12, 20, 21]);
        assert_eq!(from(11), [11, 12, 20, 21, 10]);
        assert_eq!(from(15), [20, 21, 10, 11, 12]);
        assert_eq!(from(21), [21, 10, 11, 12, 20]);
        assert_eq!(from(99), [10, 11, 12, 20, 21]);
        assert_eq!(IdRanges::none().ids_from(5).count(), 0);
    }

    #[test]
    fn user_ids_parse() {
        assert_eq!(
            "1234".parse(),
            Ok(UserIds {
                uid: 1234,
                gid: 1234
            })
        );
        assert_eq!("1234:5".parse(), Ok(UserIds { uid: 1234, gid: 5 }));
        assert_eq!(
            "65534:65534".parse::<UserIds>().unwrap().to_string(),
            "65534:65534"
        );
        for bad in [
            "",
            ":",
            "1:",
            ":1",
            "a",
            "1:b",
            "-1",
            "+1",
            "1 ",
            "1:2:3",
            "4294967295",
            "99999999999",
        ] {
            assert!(bad.parse::<UserIds>().is_err(), "{bad:?}");
        }
        assert!("0:5".parse::<UserIds>().unwrap().is_root());
        assert!("5:0".parse::<UserIds>().unwrap().is_root());
        assert!(!"5".parse::<UserIds>().unwrap().is_root());
    }

    #[test]
    fn paths_are_within_prefixes_by_whole_components() {
        let allowed = ["/data", "/scratch/"];
        assert!(path_within(&allowed, "/data"));
        assert!(path_within(&allowed, "/data/x/y"));
        assert!(path_within(&allowed, "/scratch"));
        assert!(path_within(&allowed, "/scratch/a"));
        assert!(!path_within(&allowed, "/database"));
        assert!(!path_within(&allowed, "/"));
        assert!(!path_within(&allowed, "/etc"));
        assert!(path_within(&["/"], "/etc/shadow"));
        assert!(!path_within::<&str>(&[], "/data"));
    }

    #[test]
    fn utc_timestamps() {
        assert_eq!(utc_timestamp(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_timestamp(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(utc_timestamp(1_700_000_000_999), "2023-11-14T22:13:20Z");
    }
}
