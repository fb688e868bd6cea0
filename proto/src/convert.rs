//! Wire <-> domain conversions. Every check of input that arrives over the
//! wire lives here, and every failure names the field it is about.

use crate::pb;
use crate::types::*;

/// Bad input: which field, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid {field}: {reason}")]
pub struct ConvertError {
    pub field: String,
    pub reason: String,
}

impl ConvertError {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ConvertError {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl From<ConvertError> for tonic::Status {
    fn from(e: ConvertError) -> Self {
        tonic::Status::invalid_argument(e.to_string())
    }
}

type Result<T> = std::result::Result<T, ConvertError>;

pub const MAX_NAME_LEN: usize = 128;
pub const MAX_ARGS: usize = 4096;
pub const MAX_ENV: usize = 1024;
pub const MAX_CPUS: f64 = 4096.0;
pub const MAX_GPUS: u32 = 64;

/// An identifier chosen by the system or a user: 1..=128 chars of
/// `[A-Za-z0-9._-]`, not starting with `-` or `.`.
pub fn check_id(field: &str, s: &str) -> Result<()> {
    if s.is_empty() {
        return Err(ConvertError::new(field, "must not be empty"));
    }
    if s.len() > MAX_NAME_LEN {
        return Err(ConvertError::new(
            field,
            format!("longer than {MAX_NAME_LEN} characters"),
        ));
    }
    if s.starts_with(['-', '.']) {
        return Err(ConvertError::new(field, "must not start with '-' or '.'"));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(ConvertError::new(
            field,
            format!("character {c:?} not allowed (use letters, digits, '.', '_', '-')"),
        ));
    }
    Ok(())
}

pub fn resources_from_pb(field: &str, r: Option<pb::Resources>) -> Result<Resources> {
    let r = r.unwrap_or_default();
    if !r.cpus.is_finite() || r.cpus < 0.0 {
        return Err(ConvertError::new(
            format!("{field}.cpus"),
            "must be a number >= 0",
        ));
    }
    if r.cpus > MAX_CPUS {
        return Err(ConvertError::new(
            format!("{field}.cpus"),
            format!("must be <= {MAX_CPUS}"),
        ));
    }
    Ok(Resources {
        cpus: r.cpus,
        mem_mib: r.mem_mib,
        gpus: r.gpus,
    })
}

impl From<Resources> for pb::Resources {
    fn from(r: Resources) -> Self {
        pb::Resources {
            cpus: r.cpus,
            mem_mib: r.mem_mib,
            gpus: r.gpus,
        }
    }
}

fn check_command(field: &str, command: &[String]) -> Result<()> {
    if command.is_empty() {
        return Err(ConvertError::new(field, "must not be empty"));
    }
    if command.len() > MAX_ARGS {
        return Err(ConvertError::new(
            field,
            format!("more than {MAX_ARGS} arguments"),
        ));
    }
    if command[0].is_empty() {
        return Err(ConvertError::new(
            format!("{field}[0]"),
            "program must not be empty",
        ));
    }
    if let Some(i) = command.iter().position(|a| a.contains('\0')) {
        return Err(ConvertError::new(
            format!("{field}[{i}]"),
            "contains a NUL byte",
        ));
    }
    Ok(())
}

fn check_env<'a>(field: &str, env: impl Iterator<Item = (&'a String, &'a String)>) -> Result<()> {
    for (n, (k, v)) in env.enumerate() {
        if n >= MAX_ENV {
            return Err(ConvertError::new(
                field,
                format!("more than {MAX_ENV} variables"),
            ));
        }
        if k.is_empty() || k.contains(['=', '\0']) {
            return Err(ConvertError::new(
                format!("{field}[{k:?}]"),
                "name must be non-empty without '=' or NUL",
            ));
        }
        if v.contains('\0') {
            return Err(ConvertError::new(
                format!("{field}[{k:?}]"),
                "value contains a NUL byte",
            ));
        }
    }
    Ok(())
}

fn check_image(field: &str, image: &str) -> Result<()> {
    if image.len() > 512 {
        return Err(ConvertError::new(field, "longer than 512 characters"));
    }
    if image.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(ConvertError::new(
            field,
            "must not contain whitespace or control characters",
        ));
    }
    Ok(())
}

impl TryFrom<pb::JobSpec> for JobSpec {
    type Error = ConvertError;
    fn try_from(s: pb::JobSpec) -> Result<Self> {
        check_id("spec.name", &s.name)?;
        let image = if s.image.is_empty() {
            None
        } else {
            check_image("spec.image", &s.image)?;
            Some(s.image)
        };
        check_command("spec.command", &s.command)?;
        check_env("spec.env", s.env.iter())?;
        let resources = resources_from_pb("spec.resources", s.resources)?;
        if resources.gpus > MAX_GPUS {
            return Err(ConvertError::new(
                "spec.resources.gpus",
                format!("must be <= {MAX_GPUS}"),
            ));
        }
        let placement = match s.placement {
            None => PlacementSpec::default(),
            Some(p) => placement_from_pb(p)?,
        };
        let replicas = s.replicas.max(1);
        if replicas > MAX_REPLICAS {
            return Err(ConvertError::new(
                "spec.replicas",
                format!("must be <= {MAX_REPLICAS}"),
            ));
        }
        if s.max_retries > MAX_RETRIES {
            return Err(ConvertError::new(
                "spec.max_retries",
                format!("must be <= {MAX_RETRIES}"),
            ));
        }
        Ok(JobSpec {
            name: s.name,
            image,
            command: s.command,
            env: s.env.into_iter().collect(),
            resources,
            placement,
            priority: s.priority,
            replicas,
            max_retries: s.max_retries,
            no_requeue: s.no_requeue,
            no_fence: s.no_fence,
        })
    }
}

/// Most tasks in one gang.
pub const MAX_REPLICAS: u32 = 4096;
/// Most retries of one job.
pub const MAX_RETRIES: u32 = 1000;

/// Longest GPU model pattern, attribute key or value.
const MAX_ATTR_LEN: usize = 256;
/// A GPU's unhealthy reason, as an agent reports it.
const MAX_REASON_LEN: usize = 4096;

fn check_printable(field: &str, s: &str, allow_space: bool) -> Result<()> {
    if s.len() > MAX_ATTR_LEN {
        return Err(ConvertError::new(
            field,
            format!("longer than {MAX_ATTR_LEN} characters"),
        ));
    }
    if let Some(c) = s
        .chars()
        .find(|c| c.is_control() || (!allow_space && c.is_whitespace()))
    {
        return Err(ConvertError::new(field, format!("contains {c:?}")));
    }
    Ok(())
}

fn placement_from_pb(p: pb::Placement) -> Result<PlacementSpec> {
    let policy = if p.policy.is_empty() {
        None
    } else {
        Some(
            p.policy
                .parse::<PlacementPolicy>()
                .map_err(|e| ConvertError::new("spec.placement.policy", e))?,
        )
    };
    let gpu_model = if p.gpu_model.is_empty() {
        None
    } else {
        check_printable("spec.placement.gpu_model", &p.gpu_model, false)?;
        Some(p.gpu_model)
    };
    for (k, v) in &p.constraints {
        if k.is_empty() {
            return Err(ConvertError::new(
                "spec.placement.constraints",
                "a key is empty",
            ));
        }
        check_printable("spec.placement.constraints", k, false)?;
        check_printable(&format!("spec.placement.constraints[{k}]"), v, true)?;
    }
    Ok(PlacementSpec {
        policy,
        gpu_model,
        gpu_mem_min_mib: p.gpu_mem_min_mib,
        constraints: p.constraints.into_iter().collect(),
    })
}

impl From<PlacementSpec> for pb::Placement {
    fn from(p: PlacementSpec) -> Self {
        pb::Placement {
            policy: p.policy.map(|x| x.to_string()).unwrap_or_default(),
            gpu_model: p.gpu_model.unwrap_or_default(),
            gpu_mem_min_mib: p.gpu_mem_min_mib,
            constraints: p.constraints.into_iter().collect(),
        }
    }
}

impl From<JobSpec> for pb::JobSpec {
    fn from(s: JobSpec) -> Self {
        pb::JobSpec {
            name: s.name,
            image: s.image.unwrap_or_default(),
            command: s.command,
            env: s.env.into_iter().collect(),
            resources: Some(s.resources.into()),
            placement: (!s.placement.is_default()).then(|| s.placement.into()),
            priority: s.priority,
            replicas: s.replicas,
            max_retries: s.max_retries,
            no_requeue: s.no_requeue,
            no_fence: s.no_fence,
        }
    }
}

impl TryFrom<pb::TaskSpec> for TaskSpec {
    type Error = ConvertError;
    fn try_from(s: pb::TaskSpec) -> Result<Self> {
        check_id("task.task_id", &s.task_id)?;
        if !s.job_id.is_empty() {
            check_id("task.job_id", &s.job_id)?;
        }
        if !s.framework_id.is_empty() {
            check_id("task.framework_id", &s.framework_id)?;
        }
        if s.job_id.is_empty() == s.framework_id.is_empty() {
            return Err(ConvertError::new(
                "task.job_id",
                "a task belongs to a job or to a framework, exactly one",
            ));
        }
        let image = if s.image.is_empty() {
            None
        } else {
            check_image("task.image", &s.image)?;
            Some(s.image)
        };
        check_command("task.command", &s.command)?;
        check_env("task.env", s.env.iter())?;
        let resources = resources_from_pb("task.resources", s.resources)?;
        if s.gpu_uuids.len() != resources.gpus as usize {
            return Err(ConvertError::new(
                "task.gpu_uuids",
                format!(
                    "names {} GPUs but resources.gpus is {}",
                    s.gpu_uuids.len(),
                    resources.gpus
                ),
            ));
        }
        Ok(TaskSpec {
            task_id: s.task_id,
            job_id: s.job_id,
            framework_id: s.framework_id,
            image,
            command: s.command,
            env: s.env.into_iter().collect(),
            resources,
            gpu_uuids: s.gpu_uuids,
            no_fence: s.no_fence,
        })
    }
}

impl From<TaskSpec> for pb::TaskSpec {
    fn from(s: TaskSpec) -> Self {
        pb::TaskSpec {
            task_id: s.task_id,
            job_id: s.job_id,
            framework_id: s.framework_id,
            image: s.image.unwrap_or_default(),
            command: s.command,
            env: s.env.into_iter().collect(),
            resources: Some(s.resources.into()),
            gpu_uuids: s.gpu_uuids,
            no_fence: s.no_fence,
        }
    }
}

impl TryFrom<pb::Gpu> for GpuInfo {
    type Error = ConvertError;
    fn try_from(g: pb::Gpu) -> Result<Self> {
        if g.uuid.is_empty() {
            return Err(ConvertError::new("gpus[].uuid", "must not be empty"));
        }
        let compute_capability = if g.compute_capability.is_empty() {
            None
        } else {
            let parsed = g
                .compute_capability
                .split_once('.')
                .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
            Some(parsed.ok_or_else(|| {
                ConvertError::new(
                    "gpus[].compute_capability",
                    format!("{:?} is not MAJOR.MINOR", g.compute_capability),
                )
            })?)
        };
        let mut peers = Vec::with_capacity(g.peers.len());
        for p in g.peers {
            if p.uuid.is_empty() {
                return Err(ConvertError::new(
                    "gpus[].peers[].uuid",
                    "must not be empty",
                ));
            }
            peers.push(GpuPeer {
                uuid: p.uuid,
                nvlinks: p.nvlinks,
                pcie: p.pcie,
            });
        }
        Ok(GpuInfo {
            uuid: g.uuid,
            index: g.index,
            minor: g.minor,
            model: g.model,
            memory_mib: g.memory_mib,
            healthy: g.healthy,
            pci_bus_id: g.pci_bus_id,
            serial: g.serial,
            numa_node: g.numa_node,
            compute_capability,
            peers,
            unhealthy_reason: g.unhealthy_reason,
        })
    }
}

impl From<GpuInfo> for pb::Gpu {
    fn from(g: GpuInfo) -> Self {
        pb::Gpu {
            uuid: g.uuid,
            index: g.index,
            minor: g.minor,
            model: g.model,
            memory_mib: g.memory_mib,
            healthy: g.healthy,
            pci_bus_id: g.pci_bus_id,
            serial: g.serial,
            numa_node: g.numa_node,
            compute_capability: g
                .compute_capability
                .map(|(a, b)| format!("{a}.{b}"))
                .unwrap_or_default(),
            peers: g
                .peers
                .into_iter()
                .map(|p| pb::GpuPeer {
                    uuid: p.uuid,
                    nvlinks: p.nvlinks,
                    pcie: p.pcie,
                })
                .collect(),
            unhealthy_reason: g.unhealthy_reason,
        }
    }
}

pub fn runtime_from_pb(field: &str, v: i32) -> Result<Runtime> {
    match pb::Runtime::try_from(v) {
        Ok(pb::Runtime::Docker) => Ok(Runtime::Docker),
        Ok(pb::Runtime::Process) => Ok(Runtime::Process),
        _ => Err(ConvertError::new(field, format!("unknown runtime {v}"))),
    }
}

impl From<Runtime> for pb::Runtime {
    fn from(r: Runtime) -> Self {
        match r {
            Runtime::Docker => pb::Runtime::Docker,
            Runtime::Process => pb::Runtime::Process,
        }
    }
}

impl TryFrom<pb::RegisterRequest> for AgentInfo {
    type Error = ConvertError;
    fn try_from(r: pb::RegisterRequest) -> Result<Self> {
        check_id("agent_id", &r.agent_id)?;
        if r.hostname.is_empty() {
            return Err(ConvertError::new("hostname", "must not be empty"));
        }
        let total = resources_from_pb("total", r.total)?;
        let mut gpus = Vec::with_capacity(r.gpus.len());
        let mut seen = std::collections::BTreeSet::new();
        for g in r.gpus {
            let g = GpuInfo::try_from(g)?;
            if !seen.insert(g.uuid.clone()) {
                return Err(ConvertError::new(
                    "gpus[].uuid",
                    format!("{} listed twice", g.uuid),
                ));
            }
            gpus.push(g);
        }
        if total.gpus as usize != gpus.len() {
            return Err(ConvertError::new(
                "total.gpus",
                format!("is {} but {} GPUs are listed", total.gpus, gpus.len()),
            ));
        }
        let runtimes = r
            .runtimes
            .iter()
            .map(|v| runtime_from_pb("runtimes", *v))
            .collect::<Result<Vec<_>>>()?;
        let known: std::collections::BTreeSet<&str> =
            gpus.iter().map(|g| g.uuid.as_str()).collect();
        for g in &gpus {
            if let Some(p) = g.peers.iter().find(|p| !known.contains(p.uuid.as_str())) {
                return Err(ConvertError::new(
                    "gpus[].peers[].uuid",
                    format!("{} is not a GPU of this agent", p.uuid),
                ));
            }
        }
        if let Some(k) = r.attributes.keys().find(|k| k.is_empty() || k.len() > 256) {
            return Err(ConvertError::new(
                "attributes",
                format!("key {k:?} must be 1..=256 characters"),
            ));
        }
        let opt = |s: String| (!s.is_empty()).then_some(s);
        Ok(AgentInfo {
            id: r.agent_id,
            hostname: r.hostname,
            address: r.address,
            total,
            gpus,
            runtimes,
            simulated_gpus: r.simulated_gpus,
            attributes: r.attributes.into_iter().collect(),
            driver_version: opt(r.driver_version),
            cuda_driver_version: opt(r.cuda_driver_version),
        })
    }
}

pub fn task_state_from_pb(field: &str, v: i32) -> Result<TaskState> {
    use pb::TaskState as P;
    Ok(match P::try_from(v) {
        Ok(P::TaskStaging) => TaskState::Staging,
        Ok(P::TaskStarting) => TaskState::Starting,
        Ok(P::TaskRunning) => TaskState::Running,
        Ok(P::TaskFinished) => TaskState::Finished,
        Ok(P::TaskFailed) => TaskState::Failed,
        Ok(P::TaskKilled) => TaskState::Killed,
        Ok(P::TaskLost) => TaskState::Lost,
        Ok(P::TaskError) => TaskState::Error,
        Ok(P::TaskUnreachable) => TaskState::Unreachable,
        _ => return Err(ConvertError::new(field, format!("unknown task state {v}"))),
    })
}

impl From<TaskState> for pb::TaskState {
    fn from(s: TaskState) -> Self {
        use pb::TaskState as P;
        match s {
            TaskState::Staging => P::TaskStaging,
            TaskState::Starting => P::TaskStarting,
            TaskState::Running => P::TaskRunning,
            TaskState::Finished => P::TaskFinished,
            TaskState::Failed => P::TaskFailed,
            TaskState::Killed => P::TaskKilled,
            TaskState::Lost => P::TaskLost,
            TaskState::Error => P::TaskError,
            TaskState::Unreachable => P::TaskUnreachable,
        }
    }
}

impl From<JobState> for pb::JobState {
    fn from(s: JobState) -> Self {
        use pb::JobState as P;
        match s {
            JobState::Queued => P::JobQueued,
            JobState::Starting => P::JobStarting,
            JobState::Running => P::JobRunning,
            JobState::Succeeded => P::JobSucceeded,
            JobState::Failed => P::JobFailed,
            JobState::Cancelled => P::JobCancelled,
        }
    }
}

/// Job state as the user-facing upper-case word (`QUEUED`, ...), from the wire value.
pub fn job_state_name(v: i32) -> &'static str {
    use pb::JobState as P;
    match P::try_from(v) {
        Ok(P::JobQueued) => "QUEUED",
        Ok(P::JobStarting) => "STARTING",
        Ok(P::JobRunning) => "RUNNING",
        Ok(P::JobSucceeded) => "SUCCEEDED",
        Ok(P::JobFailed) => "FAILED",
        Ok(P::JobCancelled) => "CANCELLED",
        _ => "UNKNOWN",
    }
}

/// Task state as the upper-case word (`RUNNING`, ...), from the wire value.
pub fn task_state_name(v: i32) -> &'static str {
    match task_state_from_pb("state", v) {
        Ok(TaskState::Staging) => "STAGING",
        Ok(TaskState::Starting) => "STARTING",
        Ok(TaskState::Running) => "RUNNING",
        Ok(TaskState::Finished) => "FINISHED",
        Ok(TaskState::Failed) => "FAILED",
        Ok(TaskState::Killed) => "KILLED",
        Ok(TaskState::Lost) => "LOST",
        Ok(TaskState::Error) => "ERROR",
        Ok(TaskState::Unreachable) => "UNREACHABLE",
        Err(_) => "UNKNOWN",
    }
}

impl TryFrom<pb::StatusUpdate> for StatusUpdate {
    type Error = ConvertError;
    fn try_from(u: pb::StatusUpdate) -> Result<Self> {
        check_id("agent_id", &u.agent_id)?;
        check_id("task_id", &u.task_id)?;
        let state = task_state_from_pb("state", u.state)?;
        if state == TaskState::Unreachable {
            return Err(ConvertError::new(
                "state",
                "TASK_UNREACHABLE is set by the master, not reported by agents",
            ));
        }
        let fenced = u.reason == pb::Reason::Fenced as i32;
        if fenced && !state.is_terminal() {
            return Err(ConvertError::new(
                "reason",
                format!("REASON_FENCED needs a final state (KILLED), not {state}"),
            ));
        }
        Ok(StatusUpdate {
            agent_id: u.agent_id,
            task_id: u.task_id,
            state,
            exit_code: u.exit_code,
            message: u.message,
            uuid: u.uuid,
            gpu_unhealthy: u.reason == pb::Reason::GpuUnhealthy as i32,
            fenced,
        })
    }
}

impl From<StatusUpdate> for pb::StatusUpdate {
    fn from(u: StatusUpdate) -> Self {
        pb::StatusUpdate {
            agent_id: u.agent_id,
            task_id: u.task_id,
            state: pb::TaskState::from(u.state) as i32,
            exit_code: u.exit_code,
            message: u.message,
            uuid: u.uuid,
            reason: if u.gpu_unhealthy {
                pb::Reason::GpuUnhealthy as i32
            } else if u.fenced {
                pb::Reason::Fenced as i32
            } else {
                pb::Reason::Unspecified as i32
            },
        }
    }
}

impl TryFrom<pb::RuntimeStatus> for RuntimeStatus {
    type Error = ConvertError;
    fn try_from(r: pb::RuntimeStatus) -> Result<Self> {
        if r.message.len() > MAX_REASON_LEN {
            return Err(ConvertError::new(
                "runtimes.message",
                format!("longer than {MAX_REASON_LEN} bytes"),
            ));
        }
        Ok(RuntimeStatus {
            runtime: runtime_from_pb("runtimes.runtime", r.runtime)?,
            available: r.available,
            message: r.message,
        })
    }
}

impl From<RuntimeStatus> for pb::RuntimeStatus {
    fn from(r: RuntimeStatus) -> Self {
        pb::RuntimeStatus {
            runtime: pb::Runtime::from(r.runtime) as i32,
            available: r.available,
            message: r.message,
        }
    }
}

impl From<pb::GpuSample> for GpuSample {
    fn from(s: pb::GpuSample) -> Self {
        GpuSample {
            utilization_pct: s.utilization_pct.min(100),
            memory_used_mib: s.memory_used_mib,
            memory_total_mib: s.memory_total_mib,
            temperature_c: s.temperature_c,
            power_w: s.power_w.filter(|w| w.is_finite() && *w >= 0.0),
            sampled_at_ms: s.sampled_at_ms,
            xid_errors: s.xid_errors,
        }
    }
}

impl From<GpuSample> for pb::GpuSample {
    fn from(s: GpuSample) -> Self {
        pb::GpuSample {
            utilization_pct: s.utilization_pct,
            memory_used_mib: s.memory_used_mib,
            memory_total_mib: s.memory_total_mib,
            temperature_c: s.temperature_c,
            power_w: s.power_w,
            sampled_at_ms: s.sampled_at_ms,
            xid_errors: s.xid_errors,
        }
    }
}

impl TryFrom<pb::GpuReport> for GpuReport {
    type Error = ConvertError;
    fn try_from(r: pb::GpuReport) -> Result<Self> {
        check_printable("gpus.uuid", &r.uuid, false)?;
        if r.uuid.is_empty() {
            return Err(ConvertError::new("gpus.uuid", "must not be empty"));
        }
        if r.unhealthy_reason.len() > MAX_REASON_LEN {
            return Err(ConvertError::new(
                "gpus.unhealthy_reason",
                format!("longer than {MAX_REASON_LEN} bytes"),
            ));
        }
        Ok(GpuReport {
            uuid: r.uuid,
            healthy: r.healthy,
            unhealthy_reason: r.unhealthy_reason,
            sample: r.sample.map(Into::into),
        })
    }
}

impl From<GpuReport> for pb::GpuReport {
    fn from(r: GpuReport) -> Self {
        pb::GpuReport {
            uuid: r.uuid,
            healthy: r.healthy,
            unhealthy_reason: r.unhealthy_reason,
            sample: r.sample.map(Into::into),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> pb::JobSpec {
        pb::JobSpec {
            placement: None,
            name: "train-1".into(),
            image: "busybox:latest".into(),
            command: vec!["sh".into(), "-c".into(), "echo hi".into()],
            env: Default::default(),
            resources: Some(pb::Resources {
                cpus: 1.0,
                mem_mib: 256,
                gpus: 2,
            }),
            priority: -3,
            replicas: 4,
            max_retries: 2,
            no_requeue: true,
            no_fence: true,
        }
    }

    #[test]
    fn valid_job_spec_converts_and_round_trips() {
        let s = JobSpec::try_from(spec()).unwrap();
        assert_eq!(s.image.as_deref(), Some("busybox:latest"));
        assert_eq!(s.resources.gpus, 2);
        assert_eq!(
            (
                s.priority,
                s.replicas,
                s.max_retries,
                s.no_requeue,
                s.no_fence
            ),
            (-3, 4, 2, true, true)
        );
        assert_eq!(pb::JobSpec::from(s), spec());
        // An old client's spec (no replicas) is one task.
        let mut old = spec();
        old.replicas = 0;
        assert_eq!(JobSpec::try_from(old).unwrap().replicas, 1);
    }

    #[test]
    fn empty_image_means_host_process() {
        let mut p = spec();
        p.image.clear();
        assert_eq!(JobSpec::try_from(p).unwrap().runtime(), Runtime::Process);
    }

    #[test]
    fn bad_job_specs_name_the_field() {
        type Mutation = fn(&mut pb::JobSpec);
        let cases: Vec<(Mutation, &str)> = vec![
            (|s| s.name.clear(), "spec.name"),
            (|s| s.name = "a b".into(), "spec.name"),
            (|s| s.name = "x".repeat(200), "spec.name"),
            (|s| s.command.clear(), "spec.command"),
            (|s| s.command = vec![String::new()], "spec.command[0]"),
            (|s| s.image = "bad image".into(), "spec.image"),
            (
                |s| s.resources.as_mut().unwrap().cpus = -1.0,
                "spec.resources.cpus",
            ),
            (
                |s| s.resources.as_mut().unwrap().cpus = f64::NAN,
                "spec.resources.cpus",
            ),
            (
                |s| s.resources.as_mut().unwrap().gpus = 1000,
                "spec.resources.gpus",
            ),
            (
                |s| {
                    s.env.insert("A=B".into(), "x".into());
                },
                "spec.env[\"A=B\"]",
            ),
            (|s| s.replicas = MAX_REPLICAS + 1, "spec.replicas"),
            (|s| s.max_retries = MAX_RETRIES + 1, "spec.max_retries"),
        ];
        for (mutate, field) in cases {
            let mut p = spec();
            mutate(&mut p);
            let err = JobSpec::try_from(p).unwrap_err();
            assert_eq!(err.field, field, "{err}");
            let status = tonic::Status::from(err);
            assert_eq!(status.code(), tonic::Code::InvalidArgument);
            assert!(status.message().contains(field));
        }
    }

    #[test]
    fn register_rejects_gpu_count_mismatch_and_duplicates() {
        let gpu = |u: &str| pb::Gpu {
            uuid: u.into(),
            ..Default::default()
        };
        let mut r = pb::RegisterRequest {
            agent_id: "a1".into(),
            hostname: "h".into(),
            address: "127.0.0.1:1".into(),
            total: Some(pb::Resources {
                cpus: 2.0,
                mem_mib: 1024,
                gpus: 2,
            }),
            gpus: vec![gpu("GPU-1"), gpu("GPU-1")],
            runtimes: vec![pb::Runtime::Process as i32],
            running_task_ids: vec![],
            simulated_gpus: false,
            ..Default::default()
        };
        assert_eq!(
            AgentInfo::try_from(r.clone()).unwrap_err().field,
            "gpus[].uuid"
        );
        r.gpus = vec![gpu("GPU-1")];
        assert_eq!(
            AgentInfo::try_from(r.clone()).unwrap_err().field,
            "total.gpus"
        );
        r.gpus.push(gpu("GPU-2"));
        let a = AgentInfo::try_from(r.clone()).unwrap();
        assert_eq!(a.gpus.len(), 2);
        r.runtimes = vec![42];
        assert_eq!(AgentInfo::try_from(r).unwrap_err().field, "runtimes");
    }

    #[test]
    fn task_spec_gpu_list_must_match_count() {
        let t = pb::TaskSpec {
            task_id: "job-1.0".into(),
            job_id: "job-1".into(),
            image: String::new(),
            command: vec!["true".into()],
            env: Default::default(),
            resources: Some(pb::Resources {
                cpus: 0.0,
                mem_mib: 0,
                gpus: 1,
            }),
            gpu_uuids: vec![],
            framework_id: String::new(),
            no_fence: true,
        };
        assert_eq!(
            TaskSpec::try_from(t.clone()).unwrap_err().field,
            "task.gpu_uuids"
        );
        // A task belongs to a job or a framework, never both or neither.
        let mut both = t.clone();
        both.gpu_uuids = vec!["GPU-1".into()];
        both.framework_id = "fw-1".into();
        assert_eq!(
            TaskSpec::try_from(both.clone()).unwrap_err().field,
            "task.job_id"
        );
        both.job_id.clear();
        let ok = TaskSpec::try_from(both.clone()).unwrap();
        assert!(ok.no_fence);
        assert_eq!(pb::TaskSpec::from(ok), both);
        both.framework_id.clear();
        assert_eq!(TaskSpec::try_from(both).unwrap_err().field, "task.job_id");
    }

    #[test]
    fn state_names() {
        assert_eq!(
            job_state_name(pb::JobState::JobSucceeded as i32),
            "SUCCEEDED"
        );
        assert_eq!(task_state_name(pb::TaskState::TaskKilled as i32), "KILLED");
        assert_eq!(
            task_state_name(pb::TaskState::TaskUnreachable as i32),
            "UNREACHABLE"
        );
        assert!(!TaskState::Unreachable.is_terminal());
        assert_eq!(TaskState::Unreachable.to_string(), "UNREACHABLE");
        assert_eq!(task_state_name(99), "UNKNOWN");
    }

    fn update(state: pb::TaskState, reason: pb::Reason) -> pb::StatusUpdate {
        pb::StatusUpdate {
            agent_id: "a1".into(),
            task_id: "job-1.0".into(),
            state: state as i32,
            exit_code: None,
            message: "no leader for 75s".into(),
            uuid: b"u".to_vec(),
            reason: reason as i32,
        }
    }

    #[test]
    fn fenced_updates_round_trip_and_agents_cannot_send_unreachable() {
        let u =
            StatusUpdate::try_from(update(pb::TaskState::TaskKilled, pb::Reason::Fenced)).unwrap();
        assert!(u.fenced && !u.gpu_unhealthy);
        assert_eq!(u.state, TaskState::Killed);
        assert_eq!(
            pb::StatusUpdate::from(u),
            update(pb::TaskState::TaskKilled, pb::Reason::Fenced)
        );
        let plain =
            StatusUpdate::try_from(update(pb::TaskState::TaskKilled, pb::Reason::Unspecified))
                .unwrap();
        assert!(!plain.fenced);
        let err = StatusUpdate::try_from(update(pb::TaskState::TaskRunning, pb::Reason::Fenced))
            .unwrap_err();
        assert_eq!(err.field, "reason", "{err}");
        let err = StatusUpdate::try_from(update(
            pb::TaskState::TaskUnreachable,
            pb::Reason::Unspecified,
        ))
        .unwrap_err();
        assert_eq!(err.field, "state", "{err}");
    }

    #[test]
    fn runtime_status_converts_and_checks_its_fields() {
        let wire = pb::RuntimeStatus {
            runtime: pb::Runtime::Docker as i32,
            available: false,
            message: "cannot connect to /var/run/docker.sock".into(),
        };
        let r = RuntimeStatus::try_from(wire.clone()).unwrap();
        assert_eq!(r.runtime, Runtime::Docker);
        assert!(!r.available);
        assert_eq!(pb::RuntimeStatus::from(r), wire);
        let mut bad = wire.clone();
        bad.runtime = 42;
        assert_eq!(
            RuntimeStatus::try_from(bad).unwrap_err().field,
            "runtimes.runtime"
        );
        let mut long = wire;
        long.message = "x".repeat(MAX_REASON_LEN + 1);
        assert_eq!(
            RuntimeStatus::try_from(long).unwrap_err().field,
            "runtimes.message"
        );
    }
}
