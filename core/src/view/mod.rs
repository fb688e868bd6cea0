//! The JSON views of the Operator API's answers: what `gpuctl --json`
//! prints and what the web console's `/api` answers, one shape for each
//! message. Enums become gpuctl's words (`RUNNING`, `ACTIVE`), times stay
//! milliseconds since the epoch, an empty string that means "none" is
//! `null`. Pure: built from the wire messages, no I/O, no clock.

mod service;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::convert::{agent_state_name, job_state_name, runtime_name, task_state_name};
use crate::pb;
use crate::types::Resources;
use crate::wait::Waiting;
pub use service::{
    endpoint_address, EndpointJson, EndpointsJson, ReplicaJson, ServiceJson, TemplateJson,
};

use crate::wait_words::{resources_of, wait_reason_data, wait_reason_words as wait_reason};

/// One task of a job (`jobs get --json`, `jobs list --json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskJson {
    pub id: String,
    pub agent_id: String,
    /// UUIDs of the GPUs the task holds.
    pub gpus: Vec<String>,
    /// STAGING, STARTING, RUNNING, UNREACHABLE (its agent stopped
    /// heartbeating; not final), FINISHED, FAILED, KILLED, LOST or ERROR.
    pub state: String,
    pub exit_code: Option<i32>,
    pub message: String,
    pub updated_at_ms: u64,
    /// Its rank in the job's gang (`GPUCTL_RANK`).
    pub rank: u32,
    /// Why it is in its state, e.g. `GPU_UNHEALTHY`, `PREEMPTED`,
    /// `COMMAND_EXITED`; `null` when there is none.
    pub reason: Option<String>,
    /// Host ports it holds (`GPUCTL_PORTS`).
    #[serde(default)]
    pub ports: Vec<u32>,
    /// A task holding a fraction of a shared GPU: what its agent enforces
    /// of it (`driver`, `mps`, `none`); absent otherwise, or not said yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforcement: Option<String>,
    /// RUNNING and its readiness check passes (none: RUNNING is ready).
    #[serde(default)]
    pub ready: bool,
    /// Its health checks' last failure's words; absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check_failure: Option<String>,
}

impl From<&pb::Task> for TaskJson {
    fn from(t: &pb::Task) -> Self {
        TaskJson {
            id: t.id.clone(),
            agent_id: t.agent_id.clone(),
            gpus: t.gpu_uuids.clone(),
            state: task_state_name(t.state).to_string(),
            exit_code: t.exit_code,
            message: t.message.clone(),
            updated_at_ms: t.updated_at_ms,
            rank: t.rank,
            reason: pb::Reason::try_from(t.reason)
                .ok()
                .filter(|r| *r != pb::Reason::Unspecified)
                .map(|r| r.as_str_name().trim_start_matches("REASON_").to_string()),
            ports: t.ports.clone(),
            enforcement: (!t.enforcement.is_empty()).then(|| t.enforcement.clone()),
            ready: t.ready,
            check_failure: (!t.check_failure.is_empty()).then(|| t.check_failure.clone()),
        }
    }
}

/// A job (`jobs get --json`, items of `jobs list --json`). Written only:
/// its wait reason is the domain's `Waiting`, which serializes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobJson {
    pub id: String,
    pub name: String,
    /// The tenant it is charged to ("" from a master without tenants).
    #[serde(default)]
    pub tenant: String,
    /// QUEUED, STARTING, RUNNING, SUCCEEDED, FAILED or CANCELLED.
    pub state: String,
    /// `null` for a job that runs as a host process.
    pub image: Option<String>,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub resources: Resources,
    pub placement: PlacementJson,
    pub priority: i32,
    /// Tasks started together (a gang); 1 for a plain job. An elastic
    /// gang's most.
    pub replicas: u32,
    /// An elastic gang's fewest ranks (`--replicas MIN:MAX`); `null`: a
    /// fixed gang.
    #[serde(default)]
    pub min_replicas: Option<u32>,
    /// `gang` or `never` (`--restart-policy`).
    pub restart_policy: String,
    /// `--restart-backoff` in ms; `null`: the default (1 s).
    #[serde(default)]
    pub restart_backoff_ms: Option<u64>,
    /// `--preflight`: its GPUs are checked before its tasks start.
    pub preflight: bool,
    pub max_retries: u32,
    /// Failed attempts started again so far.
    pub retries: u32,
    pub no_requeue: bool,
    /// Submitted with `--no-fence`: its tasks are not stopped by their
    /// agent's fence and never LOST by timeout.
    pub no_fence: bool,
    /// `--stop-grace` in ms; `null`: its agent's kill grace.
    #[serde(default)]
    pub stop_grace_ms: Option<u64>,
    /// `--checkpoint-dir`; `null`: none.
    #[serde(default)]
    pub checkpoint_dir: Option<String>,
    /// `--hang-timeout` in ms; absent: never stopped as hung.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hang_timeout_ms: Option<u64>,
    /// The service (`svc-N`) it is a replica of; absent for a job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// Each task's options, in their own form (`TaskOptions`); an unset
    /// one is absent.
    #[serde(flatten)]
    pub options: crate::types::TaskOptions,
    /// Its user, host mounts and root (`--user`, `--mount`, `--run-as-root`).
    #[serde(default)]
    pub security: SecurityJson,
    /// What it needs of the NVIDIA driver (`--require-cuda`); `null`: none.
    #[serde(default)]
    pub require_cuda: Option<String>,
    /// What its image requires of the NVIDIA driver (its NVIDIA_REQUIRE_*
    /// values), learned from agents whose driver did not meet it.
    #[serde(default)]
    pub image_requires: Vec<String>,
    /// Times its tasks were preempted.
    pub preemptions: u32,
    /// Why it is in its state; for a QUEUED job, the same as `reason`.
    pub message: String,
    /// Why a QUEUED job waits, in words (`Resources: ...`, `Priority: ...`,
    /// `Preempting: ...`, `Quota: ...`, `PREEMPTED by job-N; ...`, or the
    /// requirement no agent meets, e.g. `no agent has GPU model H100*`);
    /// `null` otherwise.
    pub reason: Option<String>,
    /// The same as data (docs/cli.md); `null` when not QUEUED, or from a
    /// master that does not send it.
    pub wait_reason: Option<Waiting>,
    pub submitted_at_ms: u64,
    pub tasks: Vec<TaskJson>,
    /// What happened to it, oldest first (`jobs get` only; `[]` in
    /// `jobs list`).
    pub events: Vec<EventJson>,
    /// Older events the master dropped to keep at most 50.
    pub events_dropped: u64,
    /// A RUNNING job whose GPUs stayed under the idle threshold for the
    /// idle window: since when (ms); absent when not idle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_since_ms: Option<u64>,
}

/// One event of a job (`jobs get --json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventJson {
    /// `Normal` or `Warning`, as kubectl says.
    #[serde(rename = "type")]
    pub kind_type: String,
    /// What happened: `Scheduled`, `Started`, `Preempted`, ...
    pub reason: String,
    pub message: String,
    pub first_ms: u64,
    pub last_ms: u64,
    pub count: u32,
}

impl From<&pb::JobEvent> for EventJson {
    fn from(e: &pb::JobEvent) -> Self {
        EventJson {
            kind_type: event_type(e).to_string(),
            reason: e.kind.clone(),
            message: e.message.clone(),
            first_ms: e.first_ms,
            last_ms: e.last_ms,
            count: e.count.max(1),
        }
    }
}

pub fn event_type(e: &pb::JobEvent) -> &'static str {
    if e.warning {
        "Warning"
    } else {
        "Normal"
    }
}

/// Where a job may run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlacementJson {
    /// `bundle`, `spread`, or `null`: the cluster's default.
    pub policy: Option<String>,
    pub gpu_model: Option<String>,
    pub gpu_mem_min_mib: u64,
    pub constraints: BTreeMap<String, String>,
    /// Each task's GPU is a MIG device of this profile; `null`: whole GPUs.
    #[serde(default)]
    pub mig: Option<String>,
    /// Each task holds a fraction of a shared GPU: this much of its memory
    /// (MiB); `null`: no fraction.
    #[serde(default)]
    pub gpu_mem_mib: Option<u64>,
    /// With `gpu_mem_mib`: percent of its compute; `null`: none asked.
    #[serde(default)]
    pub gpu_compute_pct: Option<u32>,
}

impl From<Option<&pb::Placement>> for PlacementJson {
    fn from(p: Option<&pb::Placement>) -> Self {
        let p = p.cloned().unwrap_or_default();
        PlacementJson {
            policy: (!p.policy.is_empty()).then_some(p.policy),
            gpu_model: (!p.gpu_model.is_empty()).then_some(p.gpu_model),
            gpu_mem_min_mib: p.gpu_mem_min_mib,
            constraints: p.constraints.into_iter().collect(),
            mig: (!p.mig.is_empty()).then_some(p.mig),
            gpu_mem_mib: (p.gpu_mem_mib > 0).then_some(p.gpu_mem_mib),
            gpu_compute_pct: (p.gpu_compute_pct > 0).then_some(p.gpu_compute_pct),
        }
    }
}

/// What a job's tasks may do (`security`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SecurityJson {
    /// `UID:GID` or `UID`; `null`: the image's user, or a user of its own
    /// for a host process.
    pub user: Option<String>,
    pub mounts: Vec<MountJson>,
    pub run_as_root: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MountJson {
    pub host_path: String,
    pub container_path: String,
    pub read_only: bool,
}

impl From<Option<&pb::TaskSecurity>> for SecurityJson {
    fn from(s: Option<&pb::TaskSecurity>) -> Self {
        let s = s.cloned().unwrap_or_default();
        SecurityJson {
            user: (!s.user.is_empty()).then_some(s.user),
            mounts: s
                .mounts
                .into_iter()
                .map(|m| MountJson {
                    host_path: m.host_path,
                    container_path: m.container_path,
                    read_only: !m.read_write,
                })
                .collect(),
            run_as_root: s.run_as_root,
        }
    }
}

/// The job's message as gpuctl shows it: why it waits for a QUEUED job.
pub fn job_message(j: &pb::Job) -> String {
    wait_reason(j).unwrap_or_else(|| j.message.clone())
}

impl From<&pb::Job> for JobJson {
    fn from(j: &pb::Job) -> Self {
        let spec = j.spec.clone().unwrap_or_default();
        JobJson {
            id: j.id.clone(),
            tenant: spec.tenant.clone(),
            name: spec.name,
            state: job_state_name(j.state).to_string(),
            image: (!spec.image.is_empty()).then_some(spec.image),
            command: spec.command,
            env: spec.env.into_iter().collect(),
            resources: resources_of(spec.resources.as_ref()),
            placement: PlacementJson::from(spec.placement.as_ref()),
            priority: spec.priority,
            replicas: spec.replicas.max(1),
            min_replicas: (spec.min_replicas > 0 && spec.min_replicas < spec.replicas)
                .then_some(spec.min_replicas),
            // The default is RestartPolicy's; a word this build does not
            // know is shown as sent.
            restart_policy: spec
                .restart_policy
                .parse::<crate::types::RestartPolicy>()
                .map_or_else(|_| spec.restart_policy.clone(), |p| p.to_string()),
            restart_backoff_ms: spec.restart_backoff_ms,
            preflight: spec.preflight,
            max_retries: spec.max_retries,
            retries: j.retries,
            no_requeue: spec.no_requeue,
            no_fence: spec.no_fence,
            stop_grace_ms: spec.stop_grace_ms,
            checkpoint_dir: (!spec.checkpoint_dir.is_empty()).then(|| spec.checkpoint_dir.clone()),
            hang_timeout_ms: spec.hang_timeout_ms,
            service: (!spec.service.is_empty()).then(|| spec.service.clone()),
            options: crate::convert::options_view(spec.options.as_ref()),
            security: SecurityJson::from(spec.security.as_ref()),
            require_cuda: (!spec.require_cuda.is_empty()).then(|| spec.require_cuda.clone()),
            image_requires: j.image_requires.clone(),
            preemptions: j.preemptions,
            message: job_message(j),
            reason: wait_reason(j),
            wait_reason: wait_reason_data(j),
            submitted_at_ms: j.submitted_at_ms,
            tasks: j.tasks.iter().map(TaskJson::from).collect(),
            events: j.events.iter().map(EventJson::from).collect(),
            events_dropped: j.events_dropped,
            idle_since_ms: (j.idle_since_ms > 0).then_some(j.idle_since_ms),
        }
    }
}

/// How a GPU reaches another GPU of its host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerJson {
    pub uuid: String,
    pub nvlinks: u32,
    /// PIX, PXB, PHB, NODE, SYS, or "" when unknown.
    pub pcie: String,
}

/// One GPU of an agent (`agents list --json`, `agents describe --json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuJson {
    pub uuid: String,
    pub index: u32,
    pub minor: u32,
    pub model: String,
    pub memory_mib: u64,
    pub healthy: bool,
    /// Why it is unhealthy; empty when healthy.
    pub unhealthy_reason: String,
    pub pci_bus_id: String,
    pub serial: String,
    pub numa_node: Option<u32>,
    /// "MAJOR.MINOR", or null when unknown.
    pub compute_capability: Option<String>,
    pub peers: Vec<PeerJson>,
    /// Its MIG mode, MIG devices and free profiles; absent without MIG.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigJson>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigChangeJson {
    pub generation: u64,
    pub profiles: Vec<String>,
    pub disable: bool,
}

impl From<&pb::Gpu> for GpuJson {
    fn from(g: &pb::Gpu) -> Self {
        GpuJson {
            uuid: g.uuid.clone(),
            index: g.index,
            minor: g.minor,
            model: g.model.clone(),
            memory_mib: g.memory_mib,
            healthy: g.healthy,
            unhealthy_reason: g.unhealthy_reason.clone(),
            pci_bus_id: g.pci_bus_id.clone(),
            serial: g.serial.clone(),
            numa_node: g.numa_node,
            compute_capability: (!g.compute_capability.is_empty())
                .then(|| g.compute_capability.clone()),
            peers: g
                .peers
                .iter()
                .map(|p| PeerJson {
                    uuid: p.uuid.clone(),
                    nvlinks: p.nvlinks,
                    pcie: p.pcie.clone(),
                })
                .collect(),
            mig: MigJson::of(g),
        }
    }
}

/// Whether one of an agent's runtimes works, as its last heartbeat said.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RuntimeStatusJson {
    /// "docker", "process".
    pub runtime: String,
    pub available: bool,
    /// Why it is down (or a note); empty when there is none.
    pub message: String,
}

impl From<&pb::RuntimeStatus> for RuntimeStatusJson {
    fn from(r: &pb::RuntimeStatus) -> Self {
        RuntimeStatusJson {
            runtime: runtime_name(r.runtime),
            available: r.available,
            message: r.message.clone(),
        }
    }
}

/// An agent (items of `agents list --json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentJson {
    pub id: String,
    pub hostname: String,
    pub address: String,
    /// ACTIVE, UNREACHABLE (no heartbeat for the agent timeout) or LOST.
    /// A drained agent is ACTIVE with `draining` true.
    pub state: String,
    /// Drained (`gpuctl agents drain`): it gets no new tasks.
    pub draining: bool,
    /// When a drain kills the tasks still running (ms since the epoch);
    /// `null`: no deadline (or not draining).
    pub drain_deadline_ms: Option<u64>,
    /// Since when it is UNREACHABLE or LOST (ms since the epoch); `null`
    /// while ACTIVE.
    pub unreachable_since_ms: Option<u64>,
    /// "docker", "process".
    pub runtimes: Vec<String>,
    /// Each runtime's health from the agent's latest heartbeat; empty when
    /// the agent does not report it (or the answering master is not the
    /// leader).
    pub runtime_status: Vec<RuntimeStatusJson>,
    pub simulated_gpus: bool,
    pub total: Resources,
    pub allocated: Resources,
    pub gpus: Vec<GpuJson>,
    pub registered_at_ms: u64,
    /// GPU feature labels (nvidia.com/gpu.product, ...).
    pub attributes: BTreeMap<String, String>,
    pub driver_version: Option<String>,
    pub cuda_driver_version: Option<String>,
    /// It runs host-process tasks as root for jobs that ask.
    #[serde(default)]
    pub allow_root_tasks: bool,
    /// Host path prefixes its containers may mount.
    #[serde(default)]
    pub allowed_mounts: Vec<String>,
    /// The ids jobs may name there (`1000-59999`, `none`); `null`: the
    /// agent did not say (any).
    #[serde(default)]
    pub allowed_users: Option<String>,
    /// Host ports its tasks may be given, `START-END`; `null`: none.
    #[serde(default)]
    pub ports: Option<String>,
}

impl From<&pb::Agent> for AgentJson {
    fn from(a: &pb::Agent) -> Self {
        AgentJson {
            id: a.id.clone(),
            hostname: a.hostname.clone(),
            address: a.address.clone(),
            state: agent_state_name(a.state).to_string(),
            draining: a.draining,
            drain_deadline_ms: (a.draining && a.drain_deadline_ms != 0)
                .then_some(a.drain_deadline_ms),
            unreachable_since_ms: (a.unreachable_since_ms != 0).then_some(a.unreachable_since_ms),
            runtimes: a.runtimes.iter().map(|r| runtime_name(*r)).collect(),
            runtime_status: a
                .runtime_status
                .iter()
                .map(RuntimeStatusJson::from)
                .collect(),
            simulated_gpus: a.simulated_gpus,
            total: resources_of(a.total.as_ref()),
            allocated: resources_of(a.allocated.as_ref()),
            gpus: a.gpus.iter().map(GpuJson::from).collect(),
            registered_at_ms: a.registered_at_ms,
            attributes: a
                .attributes
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            driver_version: (!a.driver_version.is_empty()).then(|| a.driver_version.clone()),
            cuda_driver_version: (!a.cuda_driver_version.is_empty())
                .then(|| a.cuda_driver_version.clone()),
            allow_root_tasks: a.allow_root_tasks,
            allowed_mounts: a.allowed_mounts.clone(),
            allowed_users: (!a.allowed_users.is_empty()).then(|| a.allowed_users.clone()),
            ports: a.ports.map(|r| format!("{}-{}", r.start, r.end)),
        }
    }
}

/// A GPU of the cluster and who holds it (items of `gpus --json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuStatusJson {
    pub uuid: String,
    pub agent_id: String,
    pub index: u32,
    pub minor: u32,
    pub model: String,
    pub memory_mib: u64,
    pub healthy: bool,
    /// Why it is unhealthy; empty when healthy.
    pub unhealthy_reason: String,
    pub pci_bus_id: String,
    /// The task holding the GPU; `null` when it is free.
    pub task_id: Option<String>,
    /// Taken out of service by an operator (`gpuctl gpus cordon`).
    pub cordoned: bool,
    /// Its MIG mode, MIG devices and free profiles; absent without MIG.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigJson>,
    /// A MIG layout change under way (`gpus mig set`); absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_change: Option<MigChangeJson>,
    /// Why its last MIG layout change failed; absent: it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_error: Option<String>,
    /// `mps` or `time-slice` when shared by fractions; absent: not shared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_mode: Option<String>,
    /// The fractions held, by task.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shares: Vec<ShareJson>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShareJson {
    pub task_id: String,
    pub mem_mib: u64,
    /// Percent of the GPU's compute; 0: none asked.
    pub compute_pct: u32,
}

/// A GPU's MIG state (the `mig` of `gpus --json` and `agents describe --json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigJson {
    pub enabled: bool,
    /// The mode after the next GPU reset, when it differs; else null.
    pub pending: Option<bool>,
    pub devices: Vec<MigDeviceJson>,
    /// Profiles that still fit, and how many of each.
    pub free: Vec<MigFreeJson>,
    /// The GPU has MIG (its mode may be off).
    #[serde(default)]
    pub capable: bool,
    /// The GPU instance profiles it offers (what `gpus mig set` takes).
    #[serde(default)]
    pub profiles: Vec<MigProfileJson>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigProfileJson {
    pub name: String,
    pub gpu_slices: u32,
    pub memory_mib: u64,
    /// Most instances of it on an empty GPU.
    pub max_count: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigDeviceJson {
    pub uuid: String,
    pub profile: String,
    pub memory_mib: u64,
    pub gpu_slices: u32,
    pub compute_slices: u32,
    pub gi_id: u32,
    pub ci_id: u32,
    /// Minors of the /dev/nvidia-caps/nvidia-capN nodes granting access.
    pub caps_minors: Vec<u32>,
    /// The task holding it (`gpus --json`); absent when free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigFreeJson {
    pub profile: String,
    pub count: u32,
}

impl MigJson {
    /// `None` for a GPU without MIG.
    pub fn of(g: &pb::Gpu) -> Option<MigJson> {
        let m = g.mig.as_ref()?;
        Some(MigJson {
            enabled: m.enabled,
            pending: m.pending,
            devices: m
                .devices
                .iter()
                .map(|d| MigDeviceJson {
                    uuid: d.uuid.clone(),
                    profile: d.profile.clone(),
                    memory_mib: d.memory_mib,
                    gpu_slices: d.gpu_slices,
                    compute_slices: d.compute_slices,
                    gi_id: d.gi_id,
                    ci_id: d.ci_id,
                    caps_minors: d.caps_minors.clone(),
                    task_id: None,
                })
                .collect(),
            free: m
                .free
                .iter()
                .map(|c| MigFreeJson {
                    profile: c.profile.clone(),
                    count: c.count,
                })
                .collect(),
            capable: m.capable,
            profiles: m
                .profiles
                .iter()
                .map(|p| MigProfileJson {
                    name: p.name.clone(),
                    gpu_slices: p.gpu_slices,
                    memory_mib: p.memory_mib,
                    max_count: p.max_count,
                })
                .collect(),
        })
    }
}

impl From<&pb::GpuStatus> for GpuStatusJson {
    fn from(s: &pb::GpuStatus) -> Self {
        let g = s.gpu.clone().unwrap_or_default();
        let mut mig = MigJson::of(&g);
        for d in mig.iter_mut().flat_map(|m| &mut m.devices) {
            d.task_id = s.mig_tasks.get(&d.uuid).cloned();
        }
        GpuStatusJson {
            uuid: g.uuid,
            agent_id: s.agent_id.clone(),
            index: g.index,
            minor: g.minor,
            model: g.model,
            memory_mib: g.memory_mib,
            healthy: g.healthy,
            unhealthy_reason: g.unhealthy_reason,
            pci_bus_id: g.pci_bus_id,
            task_id: (!s.task_id.is_empty()).then(|| s.task_id.clone()),
            cordoned: s.cordoned,
            mig,
            mig_change: s.mig_change.as_ref().map(|c| MigChangeJson {
                generation: c.generation,
                profiles: c.profiles.clone(),
                disable: c.disable,
            }),
            mig_error: (!s.mig_error.is_empty()).then(|| s.mig_error.clone()),
            share_mode: (!s.share_mode.is_empty()).then(|| s.share_mode.clone()),
            shares: s
                .shares
                .iter()
                .map(|h| ShareJson {
                    task_id: h.task_id.clone(),
                    mem_mib: h.mem_mib,
                    compute_pct: h.compute_pct,
                })
                .collect(),
        }
    }
}

/// Items of `masters --json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MasterJson {
    pub id: u64,
    pub address: String,
    /// `leader`, `follower`, `candidate`, or `unknown` when unreachable.
    pub role: String,
    pub term: u64,
    pub commit_index: u64,
    pub applied_index: u64,
    /// False: a learner still catching up, without a vote.
    pub voter: bool,
    /// False: it did not answer; role and indexes are unknown.
    pub reachable: bool,
}

impl From<&pb::MasterInfo> for MasterJson {
    fn from(m: &pb::MasterInfo) -> Self {
        MasterJson {
            id: m.id,
            address: m.address.clone(),
            role: m.role.clone(),
            term: m.term,
            commit_index: m.commit_index,
            applied_index: m.applied_index,
            voter: m.voter,
            reachable: m.reachable,
        }
    }
}
