//! Wire <-> domain conversions. Every check of input that arrives over the
//! wire lives here, and every failure names the field it is about.

use std::collections::BTreeMap;

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

type Result<T> = std::result::Result<T, ConvertError>;

// ------------------------------------------------------------------ limits
//
// Every bound on the size of what a client or an agent sends, in one place
// (documented in docs/cli.md and docs/framework-api.md). A job and a
// framework's task are checked against the same limits when they enter the
// cluster (SubmitJob, Accept). They are far above what a real training job
// needs, and they keep one task's spec, as the master streams it to its
// agent, well under 1 MiB: at most about 600 KiB, of which the env is
// 256 KiB plus its 1024 names, the command 64 KiB, and GPUCTL_PEERS of a
// 4096-task gang (hostnames of at most 64 bytes) 260 KiB. They also stay
// within what Linux can exec: one env string under MAX_ARG_STRLEN (128 KiB),
// command and env together far under ARG_MAX (2 MiB by default).

/// Ids and job names: 1 to 128 characters.
pub const MAX_NAME_LEN: usize = 128;
/// Most status updates in one `UpdateStatuses` call.
pub const MAX_STATUS_BATCH: usize = 1024;
/// A container image reference (`registry/name:tag@sha256:...`), bytes.
pub const MAX_IMAGE_LEN: usize = 512;
/// Arguments of a command (argv), the program included.
pub const MAX_COMMAND_ARGS: usize = 1024;
/// Bytes of all arguments of a command together.
pub const MAX_COMMAND_BYTES: usize = 64 * 1024;
/// Variables of a job's (or a framework task's) environment.
pub const MAX_ENV_VARS: usize = 1024;
/// Bytes of one environment variable's name.
pub const MAX_ENV_KEY_BYTES: usize = 256;
/// Bytes of one environment variable's value.
pub const MAX_ENV_VALUE_BYTES: usize = 32 * 1024;
/// Bytes of all names and values of an environment together.
pub const MAX_ENV_TOTAL_BYTES: usize = 256 * 1024;
/// CPUs of a task (or an agent).
pub const MAX_CPUS: f64 = 4096.0;
/// Memory of a task (or an agent), in MiB: 2^40 MiB is 1 EiB.
pub const MAX_MEM_MIB: u64 = 1 << 40;
/// GPUs of one task of a job.
pub const MAX_GPUS: u32 = 64;
/// Most host ports one task may ask for.
pub const MAX_TASK_PORTS: u32 = 256;
/// Most tasks in one gang.
pub const MAX_REPLICAS: u32 = 4096;
/// Most retries of one job.
pub const MAX_RETRIES: u32 = 1000;
/// Constraints of one job.
pub const MAX_CONSTRAINTS: usize = 64;
/// A GPU model pattern, a constraint's key or value, an agent attribute's
/// key, a GPU's uuid, model, PCI bus id, serial; a driver version. Bytes.
pub const MAX_ATTR_LEN: usize = 256;
/// An agent attribute's value, bytes (GPU feature labels list models).
pub const MAX_ATTR_VALUE_LEN: usize = 1024;
/// Attributes of one agent.
pub const MAX_AGENT_ATTRIBUTES: usize = 256;
/// GPUs of one agent (as many as `--simulate-gpus` allows); each GPU lists
/// each other GPU at most once as a peer.
pub const MAX_AGENT_GPUS: usize = 64;
/// A GPU's UUID, bytes (NVML's are 40).
pub const MAX_GPU_UUID_LEN: usize = 128;
/// A peer's PCIe path (`PIX`, `PXB`, `PHB`, `NODE`, `SYS`), bytes.
pub const MAX_PCIE_LEN: usize = 16;
/// Most MIG devices (and profiles) one GPU may report: an A100 or H100
/// has at most 7 GPU instances; room for future parts.
pub const MAX_MIG_DEVICES: usize = 16;
/// Longest MIG profile name ("1g.10gb+me" is 10).
pub const MAX_MIG_PROFILE_LEN: usize = 32;
/// Most `nvidia-caps` minors one MIG device may name.
pub const MAX_MIG_CAPS: usize = 8;
/// Runtimes an agent lists.
pub const MAX_AGENT_RUNTIMES: usize = 16;
/// Task ids an agent reports running when it registers.
pub const MAX_AGENT_TASKS: usize = 65536;
/// An agent's hostname, bytes: Linux's HOST_NAME_MAX. Every rank of a gang
/// gets all its ranks' hostnames in GPUCTL_PEERS, so this bounds that too.
pub const MAX_HOSTNAME_LEN: usize = 64;
/// An agent's address (`HOST:PORT`), bytes.
pub const MAX_ADDRESS_LEN: usize = 512;
/// A GPU's unhealthy reason, as an agent reports it, bytes.
pub const MAX_REASON_LEN: usize = 4096;
/// Tasks whose memory one GPU reading carries (`task_memory_used_mib`).
pub const MAX_SAMPLE_TASKS: usize = 256;
/// Host mounts of one job's containers.
pub const MAX_MOUNTS: usize = 16;
/// A mount's host or container path, an allowed mount prefix, bytes.
pub const MAX_PATH_LEN: usize = 1024;
/// A job's `security.user` (`UID:GID` is at most 21 bytes), bytes.
pub const MAX_USER_LEN: usize = 32;
/// Mount prefixes an agent allows.
pub const MAX_ALLOWED_MOUNTS: usize = 64;
/// Longest stop grace a job may ask for anywhere, in ms (a day); each
/// master bounds it further (`--max-stop-grace-secs`).
pub const MAX_STOP_GRACE_MS: u64 = 24 * 3600 * 1000;
/// Where GPU containers get the driver volume: no job mounts there.
pub const DRIVER_VOLUME_PATH: &str = "/usr/local/nvidia";

/// An env name as a field label: quoted, cut to 64 bytes.
fn env_label(field: &str, key: &str) -> String {
    format!("{field}[{:?}]", cut(key, 64))
}

/// At most `n` bytes of `s` (on a char boundary), with "..." when cut.
pub fn cut(s: &str, n: usize) -> String {
    if s.len() <= n {
        return s.to_string();
    }
    let mut end = n;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// `field` is `len` bytes where `max` are allowed; `what` names the part
/// of the field that is (empty: the field itself).
fn too_long(field: impl Into<String>, what: &str, len: usize, max: usize) -> ConvertError {
    let what = if what.is_empty() {
        String::new()
    } else {
        format!("{what} ")
    };
    ConvertError::new(field, format!("{what}is {len} bytes, at most {max}"))
}

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

/// Scalar resources: `cpus` finite, 0 to [`MAX_CPUS`]; `mem_mib` at most
/// [`MAX_MEM_MIB`]. The callers bound `gpus` (per task, per agent).
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
    if r.mem_mib > MAX_MEM_MIB {
        return Err(ConvertError::new(
            format!("{field}.mem_mib"),
            format!("is {}, at most {MAX_MEM_MIB} (2^40 MiB)", r.mem_mib),
        ));
    }
    Ok(Resources {
        cpus: r.cpus,
        mem_mib: r.mem_mib,
        gpus: r.gpus,
        ports: r.ports,
    })
}

impl From<Resources> for pb::Resources {
    fn from(r: Resources) -> Self {
        pb::Resources {
            cpus: r.cpus,
            mem_mib: r.mem_mib,
            gpus: r.gpus,
            ports: r.ports,
        }
    }
}

/// What any command must be: a program, no NUL bytes. Sizes are checked
/// where it enters the cluster ([`check_payload`]).
fn check_command_shape(field: &str, command: &[String]) -> Result<()> {
    let Some(program) = command.first() else {
        return Err(ConvertError::new(field, "must not be empty"));
    };
    if program.is_empty() {
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

fn check_command_size(field: &str, command: &[String]) -> Result<()> {
    if command.len() > MAX_COMMAND_ARGS {
        return Err(ConvertError::new(
            field,
            format!(
                "has {} arguments, at most {MAX_COMMAND_ARGS}",
                command.len()
            ),
        ));
    }
    let bytes: usize = command.iter().map(String::len).sum();
    if bytes > MAX_COMMAND_BYTES {
        return Err(too_long(field, "", bytes, MAX_COMMAND_BYTES));
    }
    Ok(())
}

/// What any environment must be: names non-empty without '=' or NUL,
/// values without NUL.
fn check_env_shape(field: &str, env: &BTreeMap<String, String>) -> Result<()> {
    for (k, v) in env {
        if k.is_empty() || k.contains(['=', '\0']) {
            return Err(ConvertError::new(
                env_label(field, k),
                "name must be non-empty without '=' or NUL",
            ));
        }
        if v.contains('\0') {
            return Err(ConvertError::new(
                env_label(field, k),
                "value contains a NUL byte",
            ));
        }
    }
    Ok(())
}

/// Checked before the variables are sorted into a map: a request of a
/// million variables is refused at once.
fn check_env_count(field: &str, n: usize) -> Result<()> {
    if n > MAX_ENV_VARS {
        return Err(ConvertError::new(
            field,
            format!("has {n} variables, at most {MAX_ENV_VARS}"),
        ));
    }
    Ok(())
}

fn check_env_size(field: &str, env: &BTreeMap<String, String>) -> Result<()> {
    check_env_count(field, env.len())?;
    let mut total = 0;
    for (k, v) in env {
        if k.len() > MAX_ENV_KEY_BYTES {
            return Err(too_long(
                env_label(field, k),
                "name",
                k.len(),
                MAX_ENV_KEY_BYTES,
            ));
        }
        if v.len() > MAX_ENV_VALUE_BYTES {
            return Err(too_long(
                env_label(field, k),
                "value",
                v.len(),
                MAX_ENV_VALUE_BYTES,
            ));
        }
        total += k.len() + v.len();
    }
    if total > MAX_ENV_TOTAL_BYTES {
        return Err(too_long(field, "", total, MAX_ENV_TOTAL_BYTES));
    }
    Ok(())
}

fn check_image(field: &str, image: &str) -> Result<()> {
    if image.len() > MAX_IMAGE_LEN {
        return Err(too_long(field, "", image.len(), MAX_IMAGE_LEN));
    }
    if image.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(ConvertError::new(
            field,
            "must not contain whitespace or control characters",
        ));
    }
    Ok(())
}

/// What a job or a framework's task runs, as it enters the cluster: the
/// image (empty: a host process), the command and the environment, each
/// well formed and within the limits above. Fields are named under
/// `prefix` (`spec` gives `spec.image`, `spec.command`, `spec.env["K"]`).
pub fn check_payload(
    prefix: &str,
    image: &str,
    command: &[String],
    env: &BTreeMap<String, String>,
) -> Result<()> {
    if !image.is_empty() {
        check_image(&format!("{prefix}.image"), image)?;
    }
    let field = format!("{prefix}.command");
    check_command_shape(&field, command)?;
    check_command_size(&field, command)?;
    let field = format!("{prefix}.env");
    check_env_shape(&field, env)?;
    check_env_size(&field, env)
}

/// An absolute path in plain form, as a mount or an allowed mount prefix:
/// starts with '/', has no empty, '.' or '..' part (so no '//' and no
/// trailing '/', "/" itself aside), no ':' or ',' (Docker's bind syntax),
/// no control characters, at most [`MAX_PATH_LEN`] bytes.
pub fn check_abs_path(field: &str, p: &str) -> Result<()> {
    if p.len() > MAX_PATH_LEN {
        return Err(too_long(field, "", p.len(), MAX_PATH_LEN));
    }
    if !p.starts_with('/') || p.split('/').any(|part| part == "..") {
        return Err(ConvertError::new(
            field,
            "must be an absolute path without '..'",
        ));
    }
    if p != "/"
        && p.split('/')
            .skip(1)
            .any(|part| part.is_empty() || part == ".")
    {
        return Err(ConvertError::new(
            field,
            "must be a plain path (no '.' part, '//' or trailing '/')",
        ));
    }
    if let Some(c) = p.chars().find(|c| c.is_control() || matches!(c, ':' | ',')) {
        return Err(ConvertError::new(field, format!("must not contain {c:?}")));
    }
    Ok(())
}

/// What a job asks to be allowed (`security`), checked for a job of
/// `runtime` as it enters the cluster; fields are named under `prefix`
/// (`spec` gives `spec.security.user`). Says only whether the ask is well
/// formed and ever allowed: whether a tenant may ask it is the caller's
/// business, and whether an agent allows it the agent's.
pub fn check_security(prefix: &str, s: &TaskSecurity, runtime: Runtime) -> Result<()> {
    let field = |f: &str| format!("{prefix}.security.{f}");
    if s.privileged {
        return Err(ConvertError::new(
            field("privileged"),
            "privileged containers are never allowed",
        ));
    }
    if let Some(user) = &s.user {
        if user.len() > MAX_USER_LEN {
            return Err(too_long(field("user"), "", user.len(), MAX_USER_LEN));
        }
        let ids: UserIds = user
            .parse()
            .map_err(|e| ConvertError::new(field("user"), e))?;
        if s.run_as_root {
            return Err(ConvertError::new(
                field("run_as_root"),
                "cannot be asked together with security.user",
            ));
        }
        if runtime == Runtime::Process && ids.is_root() {
            return Err(ConvertError::new(
                field("user"),
                format!("{user} is root (uid or gid 0); a host-process job asks for security.run_as_root instead"),
            ));
        }
    }
    if s.run_as_root && runtime != Runtime::Process {
        return Err(ConvertError::new(
            field("run_as_root"),
            "only for host-process jobs (a container runs as its image's user or security.user)",
        ));
    }
    if !s.mounts.is_empty() && runtime != Runtime::Docker {
        return Err(ConvertError::new(
            field("mounts"),
            "only containers take host mounts (this job has no image)",
        ));
    }
    if s.mounts.len() > MAX_MOUNTS {
        return Err(ConvertError::new(
            field("mounts"),
            format!("has {} mounts, at most {MAX_MOUNTS}", s.mounts.len()),
        ));
    }
    let mut targets = std::collections::BTreeSet::new();
    for (i, m) in s.mounts.iter().enumerate() {
        let f = |part: &str| field(&format!("mounts[{i}].{part}"));
        check_abs_path(&f("host_path"), &m.host_path)?;
        check_abs_path(&f("container_path"), &m.container_path)?;
        if m.container_path == "/" {
            return Err(ConvertError::new(
                f("container_path"),
                "must not be / (the container's root)",
            ));
        }
        if path_within(&[DRIVER_VOLUME_PATH], &m.container_path) {
            return Err(ConvertError::new(
                f("container_path"),
                format!("{DRIVER_VOLUME_PATH} is where the driver volume goes"),
            ));
        }
        if !targets.insert(m.container_path.as_str()) {
            return Err(ConvertError::new(
                f("container_path"),
                format!("{} is mounted twice", m.container_path),
            ));
        }
    }
    Ok(())
}

fn security_from_pb(s: Option<pb::TaskSecurity>) -> TaskSecurity {
    let s = s.unwrap_or_default();
    TaskSecurity {
        user: (!s.user.is_empty()).then_some(s.user),
        mounts: s
            .mounts
            .into_iter()
            .map(|m| HostMount {
                host_path: m.host_path,
                container_path: m.container_path,
                read_only: !m.read_write,
            })
            .collect(),
        privileged: s.privileged,
        run_as_root: s.run_as_root,
    }
}

impl From<TaskSecurity> for pb::TaskSecurity {
    fn from(s: TaskSecurity) -> Self {
        pb::TaskSecurity {
            user: s.user.unwrap_or_default(),
            mounts: s
                .mounts
                .into_iter()
                .map(|m| pb::HostMount {
                    host_path: m.host_path,
                    container_path: m.container_path,
                    read_write: !m.read_only,
                })
                .collect(),
            privileged: s.privileged,
            run_as_root: s.run_as_root,
        }
    }
}

fn security_to_pb(s: TaskSecurity) -> Option<pb::TaskSecurity> {
    (!s.is_default()).then(|| s.into())
}

impl TryFrom<pb::JobSpec> for JobSpec {
    type Error = ConvertError;
    fn try_from(s: pb::JobSpec) -> Result<Self> {
        check_id("spec.name", &s.name)?;
        check_env_count("spec.env", s.env.len())?;
        let env: BTreeMap<String, String> = s.env.into_iter().collect();
        check_payload("spec", &s.image, &s.command, &env)?;
        let image = (!s.image.is_empty()).then_some(s.image);
        let mut resources = resources_from_pb("spec.resources", s.resources)?;
        if resources.gpus > MAX_GPUS {
            return Err(ConvertError::new(
                "spec.resources.gpus",
                format!("must be <= {MAX_GPUS}"),
            ));
        }
        check_task_ports("spec.resources.ports", resources.ports)?;
        let placement = match s.placement {
            None => PlacementSpec::default(),
            Some(p) => placement_from_pb(p)?,
        };
        // A fraction is a share of one GPU, not a device.
        if placement.fraction.is_some() && resources.gpus != 0 {
            return Err(ConvertError::new(
                "spec.resources.gpus",
                format!(
                    "is {}, but a task with spec.placement.gpu_mem_mib gets a fraction of one shared GPU, not GPUs (0)",
                    resources.gpus
                ),
            ));
        }
        // CUDA uses one MIG device per process, so a task gets one.
        if placement.mig.is_some() && resources.gpus != 1 {
            return Err(ConvertError::new(
                "spec.resources.gpus",
                format!(
                    "is {}, but a task with spec.placement.mig gets exactly 1 (one MIG device)",
                    resources.gpus
                ),
            ));
        }
        let replicas = s.replicas.max(1);
        // A gang's rank 0 needs a port for the others to meet it at
        // (MASTER_PORT), so every rank of a gang holds at least one.
        if replicas > 1 {
            resources.ports = resources.ports.max(1);
        }
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
        if !s.tenant.is_empty() {
            check_id("spec.tenant", &s.tenant)?;
        }
        // A name may be repeated, so the count is not bounded by env's.
        if s.secret_env.len() > MAX_ENV_VARS {
            return Err(ConvertError::new(
                "spec.secret_env",
                format!("has {} names, at most {MAX_ENV_VARS}", s.secret_env.len()),
            ));
        }
        let mut secret_env = std::collections::BTreeSet::new();
        for (i, k) in s.secret_env.into_iter().enumerate() {
            if !env.contains_key(&k) {
                return Err(ConvertError::new(
                    format!("spec.secret_env[{i}]"),
                    format!("{:?} is not a variable of spec.env", cut(&k, 64)),
                ));
            }
            secret_env.insert(k);
        }
        let security = security_from_pb(s.security);
        let runtime = if image.is_some() {
            Runtime::Docker
        } else {
            Runtime::Process
        };
        check_security("spec", &security, runtime)?;
        let require_cuda = require_cuda_from_pb(&s.require_cuda)?;
        let stop_grace_ms = check_stop_grace("spec.stop_grace_ms", s.stop_grace_ms)?;
        let checkpoint_dir = checkpoint_dir_from_pb("spec.checkpoint_dir", s.checkpoint_dir)?;
        Ok(JobSpec {
            name: s.name,
            image,
            command: s.command,
            env,
            resources,
            placement,
            priority: s.priority,
            replicas,
            max_retries: s.max_retries,
            no_requeue: s.no_requeue,
            no_fence: s.no_fence,
            tenant: s.tenant,
            secret_env,
            security,
            require_cuda,
            stop_grace_ms,
            checkpoint_dir,
        })
    }
}

/// A stop grace: at most [`MAX_STOP_GRACE_MS`].
fn check_stop_grace(field: &str, ms: Option<u64>) -> Result<Option<u64>> {
    match ms {
        Some(ms) if ms > MAX_STOP_GRACE_MS => Err(ConvertError::new(
            field,
            format!("is {ms} ms, at most {MAX_STOP_GRACE_MS} (a day)"),
        )),
        _ => Ok(ms),
    }
}

/// A checkpoint directory: "" is none, else a plain absolute path other
/// than `/` (the agent bind-mounts it and may create it).
fn checkpoint_dir_from_pb(field: &str, p: String) -> Result<Option<String>> {
    if p.is_empty() {
        return Ok(None);
    }
    check_abs_path(field, &p)?;
    if p == "/" {
        return Err(ConvertError::new(field, "must not be /"));
    }
    Ok(Some(p))
}

/// The kind of a stop the master asks for, as the task's notice says it:
/// `cancelled` for a task of a cancelled job, `drained`, `killed` when no
/// reason is recorded (a framework's kill, a gang's failed rank), else the
/// lower-case wire name of the task's reason (`preempted`, and any reason
/// added later without more work here).
pub fn stop_kind(reason: TaskReason, job_cancelled: bool) -> String {
    match reason {
        TaskReason::Unspecified if job_cancelled => "cancelled".into(),
        TaskReason::Unspecified | TaskReason::KilledByFramework => "killed".into(),
        TaskReason::AgentDrained => "drained".into(),
        r => {
            let name = pb::Reason::from(r).as_str_name();
            name.strip_prefix("REASON_")
                .unwrap_or(name)
                .to_ascii_lowercase()
        }
    }
}

/// A task's host ports: at most [`MAX_TASK_PORTS`].
fn check_task_ports(field: &str, ports: u32) -> Result<()> {
    if ports > MAX_TASK_PORTS {
        return Err(ConvertError::new(
            field,
            format!("is {ports}, at most {MAX_TASK_PORTS}"),
        ));
    }
    Ok(())
}

/// An agent's port range: `start..=end` within 1..=65535, and its size
/// `total.ports`.
fn port_range_from_pb(r: Option<pb::PortRange>, total: u32) -> Result<Option<PortRange>> {
    let Some(r) = r else {
        if total != 0 {
            return Err(ConvertError::new(
                "total.ports",
                format!("is {total} but no port range is given"),
            ));
        }
        return Ok(None);
    };
    let port = |field: &str, v: u32| -> Result<u16> {
        u16::try_from(v)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| ConvertError::new(field, format!("{v} is not a port (1-65535)")))
    };
    let range = PortRange {
        start: port("ports.start", r.start)?,
        end: port("ports.end", r.end)?,
    };
    if range.start > range.end {
        return Err(ConvertError::new(
            "ports",
            format!("{}-{} is empty", range.start, range.end),
        ));
    }
    if range.len() != total {
        return Err(ConvertError::new(
            "total.ports",
            format!("is {total} but the range {range} holds {}", range.len()),
        ));
    }
    Ok(Some(range))
}

impl From<PortRange> for pb::PortRange {
    fn from(r: PortRange) -> Self {
        pb::PortRange {
            start: r.start.into(),
            end: r.end.into(),
        }
    }
}

/// Id ranges from the wire (a token's allowed uids or gids), checked like
/// [`IdRanges::from_ranges`], the error naming `field`.
pub fn id_ranges_from_pb(field: &str, ranges: &[pb::IdRange]) -> Result<IdRanges> {
    IdRanges::from_ranges(ranges.iter().map(|r| (r.first, r.last)).collect())
        .map_err(|e| ConvertError::new(field, e))
}

pub fn id_ranges_to_pb(ranges: &IdRanges) -> Vec<pb::IdRange> {
    ranges
        .ranges()
        .iter()
        .map(|&(first, last)| pb::IdRange { first, last })
        .collect()
}

/// A job's `require_cuda`: `None` when blank; an error naming the field and
/// the faulty condition when it does not parse or asks nothing.
fn require_cuda_from_pb(text: &str) -> Result<Option<crate::cuda_req::Expr>> {
    const FIELD: &str = "spec.require_cuda";
    if text.trim().is_empty() {
        return Ok(None);
    }
    check_text(FIELD, text, crate::cuda_req::MAX_EXPR_LEN, true)?;
    let e =
        crate::cuda_req::Expr::parse(text).map_err(|e| ConvertError::new(FIELD, e.to_string()))?;
    if e.is_empty() {
        return Err(ConvertError::new(
            FIELD,
            format!("{:?} has no condition", cut(text, 64)),
        ));
    }
    Ok(Some(e))
}

/// At most `max` bytes, no control characters, and no whitespace unless
/// `allow_space`.
fn check_text(field: &str, s: &str, max: usize, allow_space: bool) -> Result<()> {
    if s.len() > max {
        return Err(too_long(field, "", s.len(), max));
    }
    if let Some(c) = s
        .chars()
        .find(|c| c.is_control() || (!allow_space && c.is_whitespace()))
    {
        return Err(ConvertError::new(field, format!("contains {c:?}")));
    }
    Ok(())
}

fn check_printable(field: &str, s: &str, allow_space: bool) -> Result<()> {
    check_text(field, s, MAX_ATTR_LEN, allow_space)
}

fn placement_from_pb(p: pb::Placement) -> Result<PlacementSpec> {
    let policy = if p.policy.is_empty() {
        None
    } else {
        check_printable("spec.placement.policy", &p.policy, false)?;
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
    if p.gpu_mem_min_mib > MAX_MEM_MIB {
        return Err(ConvertError::new(
            "spec.placement.gpu_mem_min_mib",
            format!("is {}, at most {MAX_MEM_MIB}", p.gpu_mem_min_mib),
        ));
    }
    if p.constraints.len() > MAX_CONSTRAINTS {
        return Err(ConvertError::new(
            "spec.placement.constraints",
            format!(
                "has {} constraints, at most {MAX_CONSTRAINTS}",
                p.constraints.len()
            ),
        ));
    }
    let constraints: BTreeMap<String, String> = p.constraints.into_iter().collect();
    for (k, v) in &constraints {
        if k.is_empty() {
            return Err(ConvertError::new(
                "spec.placement.constraints",
                "a key is empty",
            ));
        }
        check_printable("spec.placement.constraints", k, false)?;
        check_printable(
            &format!("spec.placement.constraints[{}]", cut(k, 64)),
            v,
            true,
        )?;
    }
    let mig = if p.mig.is_empty() {
        None
    } else {
        check_mig_profile("spec.placement.mig", &p.mig)?;
        Some(p.mig)
    };
    if p.gpu_mem_mib > MAX_MEM_MIB {
        return Err(ConvertError::new(
            "spec.placement.gpu_mem_mib",
            format!("is {}, at most {MAX_MEM_MIB}", p.gpu_mem_mib),
        ));
    }
    if p.gpu_compute_pct > 100 {
        return Err(ConvertError::new(
            "spec.placement.gpu_compute_pct",
            format!("is {}, a percent of one GPU (1-100)", p.gpu_compute_pct),
        ));
    }
    if p.gpu_compute_pct > 0 && p.gpu_mem_mib == 0 {
        return Err(ConvertError::new(
            "spec.placement.gpu_compute_pct",
            "asks compute of a GPU fraction without its memory (spec.placement.gpu_mem_mib)",
        ));
    }
    let fraction = (p.gpu_mem_mib > 0).then_some(GpuFraction {
        mem_mib: p.gpu_mem_mib,
        compute_pct: p.gpu_compute_pct,
    });
    if fraction.is_some() && mig.is_some() {
        return Err(ConvertError::new(
            "spec.placement.gpu_mem_mib",
            "a task gets a MIG device (spec.placement.mig) or a fraction of a shared GPU, not both",
        ));
    }
    Ok(PlacementSpec {
        policy,
        gpu_model,
        gpu_mem_min_mib: p.gpu_mem_min_mib,
        constraints,
        mig,
        fraction,
    })
}

/// A layout asked of a GPU: at most 16 MIG devices (NVML's most is 7),
/// each a profile name; none with `disable`.
pub fn check_mig_layout(profiles: &[String], disable: bool) -> Result<()> {
    if disable && !profiles.is_empty() {
        return Err(ConvertError::new(
            "profiles",
            "MIG mode off leaves no MIG devices: name no profile with disable",
        ));
    }
    if profiles.len() > MAX_MIG_DEVICES {
        return Err(ConvertError::new(
            "profiles",
            format!(
                "names {} MIG devices, at most {MAX_MIG_DEVICES}",
                profiles.len()
            ),
        ));
    }
    for (i, p) in profiles.iter().enumerate() {
        check_mig_profile(&format!("profiles[{i}]"), p)?;
    }
    Ok(())
}

/// A MIG profile's name as NVML gives it: `[<C>c.]<G>g.<M>gb`, then
/// optional suffixes such as `+me`, `-me`, `+gfx` (`1g.10gb`, `1g.10gb+me`,
/// `1c.3g.40gb`).
fn check_mig_profile(field: &str, name: &str) -> Result<()> {
    check_text(field, name, MAX_MIG_PROFILE_LEN, false)?;
    fn number_then<'a>(s: &'a str, unit: &str) -> Option<&'a str> {
        let digits = s.bytes().take_while(u8::is_ascii_digit).count();
        (digits > 0).then(|| s[digits..].strip_prefix(unit))?
    }
    let core = name.split(['+', '-']).next().unwrap_or("");
    let suffix = &name[core.len()..];
    let body = number_then(core, "c.").unwrap_or(core);
    let ok = number_then(body, "g.")
        .and_then(|m| number_then(m, "gb"))
        .is_some_and(str::is_empty)
        && suffix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'-' || b == b'.');
    if !ok {
        return Err(ConvertError::new(
            field,
            format!(
                "{:?} is not a MIG profile (one like 1g.10gb or 3g.40gb)",
                cut(name, 64)
            ),
        ));
    }
    Ok(())
}

impl From<PlacementSpec> for pb::Placement {
    fn from(p: PlacementSpec) -> Self {
        pb::Placement {
            policy: p.policy.map(|x| x.to_string()).unwrap_or_default(),
            gpu_model: p.gpu_model.unwrap_or_default(),
            gpu_mem_min_mib: p.gpu_mem_min_mib,
            constraints: p.constraints.into_iter().collect(),
            mig: p.mig.unwrap_or_default(),
            gpu_mem_mib: p.fraction.map_or(0, |f| f.mem_mib),
            gpu_compute_pct: p.fraction.map_or(0, |f| f.compute_pct),
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
            tenant: s.tenant,
            secret_env: s.secret_env.into_iter().collect(),
            security: security_to_pb(s.security),
            require_cuda: s
                .require_cuda
                .map(|e| e.text().to_string())
                .unwrap_or_default(),
            stop_grace_ms: s.stop_grace_ms,
            checkpoint_dir: s.checkpoint_dir.unwrap_or_default(),
        }
    }
}

/// A task as the master sends it to its agent. Checked for shape only:
/// sizes were checked when its job or launch entered the cluster (the
/// master adds GPUCTL_RANK, GPUCTL_WORLD_SIZE and GPUCTL_PEERS to a job's
/// env, and jobs submitted before the limits may exceed them), and the
/// message carrying it is bounded by the gRPC limit.
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
        check_command_shape("task.command", &s.command)?;
        let env: BTreeMap<String, String> = s.env.into_iter().collect();
        check_env_shape("task.env", &env)?;
        let resources = resources_from_pb("task.resources", s.resources)?;
        let share = match s.share {
            None => None,
            Some(sh) => Some(TaskShare {
                // It names the task's MPS server's directory on the agent.
                tenant: if sh.tenant.is_empty() {
                    sh.tenant
                } else {
                    check_id("task.share.tenant", &sh.tenant)?;
                    sh.tenant
                },
                fraction: GpuFraction {
                    mem_mib: sh.mem_mib,
                    compute_pct: sh.compute_pct,
                },
                mode: sh
                    .mode
                    .parse()
                    .map_err(|e| ConvertError::new("task.share.mode", e))?,
            }),
        };
        // A fraction names its one GPU with no device counted.
        let named = resources.gpus as usize + usize::from(share.is_some());
        if s.gpu_uuids.len() != named || (share.is_some() && resources.gpus != 0) {
            return Err(ConvertError::new(
                "task.gpu_uuids",
                format!(
                    "names {} GPUs but resources.gpus is {}{}",
                    s.gpu_uuids.len(),
                    resources.gpus,
                    if share.is_some() {
                        " and it holds a fraction of one"
                    } else {
                        ""
                    }
                ),
            ));
        }
        let security = security_from_pb(s.security);
        let runtime = if image.is_some() {
            Runtime::Docker
        } else {
            Runtime::Process
        };
        check_security("task", &security, runtime)?;
        Ok(TaskSpec {
            task_id: s.task_id,
            job_id: s.job_id,
            framework_id: s.framework_id,
            image,
            command: s.command,
            env,
            resources,
            gpu_uuids: s.gpu_uuids,
            no_fence: s.no_fence,
            security,
            share,
            stop_grace_ms: check_stop_grace("task.stop_grace_ms", s.stop_grace_ms)?,
            checkpoint_dir: checkpoint_dir_from_pb("task.checkpoint_dir", s.checkpoint_dir)?,
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
            security: security_to_pb(s.security),
            share: s.share.map(|sh| pb::TaskShare {
                mem_mib: sh.fraction.mem_mib,
                compute_pct: sh.fraction.compute_pct,
                mode: sh.mode.to_string(),
                tenant: sh.tenant,
            }),
            stop_grace_ms: s.stop_grace_ms,
            checkpoint_dir: s.checkpoint_dir.unwrap_or_default(),
        }
    }
}

impl TryFrom<pb::Gpu> for GpuInfo {
    type Error = ConvertError;
    fn try_from(g: pb::Gpu) -> Result<Self> {
        gpu_from_pb("gpu", g)
    }
}

/// A GPU as its agent describes it, its fields named under `field`
/// (`gpus[2]` gives `gpus[2].model`).
pub fn gpu_from_pb(field: &str, g: pb::Gpu) -> Result<GpuInfo> {
    if g.uuid.is_empty() {
        return Err(ConvertError::new(
            format!("{field}.uuid"),
            "must not be empty",
        ));
    }
    check_text(&format!("{field}.uuid"), &g.uuid, MAX_GPU_UUID_LEN, false)?;
    check_printable(&format!("{field}.model"), &g.model, true)?;
    check_printable(&format!("{field}.pci_bus_id"), &g.pci_bus_id, true)?;
    check_printable(&format!("{field}.serial"), &g.serial, true)?;
    check_text(
        &format!("{field}.unhealthy_reason"),
        &g.unhealthy_reason,
        MAX_REASON_LEN,
        true,
    )?;
    let compute_capability = if g.compute_capability.is_empty() {
        None
    } else {
        let parsed = g
            .compute_capability
            .split_once('.')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
        Some(parsed.ok_or_else(|| {
            ConvertError::new(
                format!("{field}.compute_capability"),
                format!("{:?} is not MAJOR.MINOR", cut(&g.compute_capability, 64)),
            )
        })?)
    };
    if g.peers.len() > MAX_AGENT_GPUS {
        return Err(ConvertError::new(
            format!("{field}.peers"),
            format!("has {} peers, at most {MAX_AGENT_GPUS}", g.peers.len()),
        ));
    }
    let mut peers = Vec::with_capacity(g.peers.len());
    let mut seen = std::collections::BTreeSet::new();
    for (i, p) in g.peers.into_iter().enumerate() {
        let uuid_field = format!("{field}.peers[{i}].uuid");
        if p.uuid.is_empty() {
            return Err(ConvertError::new(uuid_field, "must not be empty"));
        }
        check_text(&uuid_field, &p.uuid, MAX_GPU_UUID_LEN, false)?;
        if p.uuid == g.uuid {
            return Err(ConvertError::new(uuid_field, "a GPU is not its own peer"));
        }
        if !seen.insert(p.uuid.clone()) {
            return Err(ConvertError::new(
                uuid_field,
                format!("{} listed twice", p.uuid),
            ));
        }
        check_text(
            &format!("{field}.peers[{i}].pcie"),
            &p.pcie,
            MAX_PCIE_LEN,
            false,
        )?;
        peers.push(GpuPeer {
            uuid: p.uuid,
            nvlinks: p.nvlinks,
            pcie: p.pcie,
        });
    }
    let mig = match g.mig {
        Some(m) => mig_from_pb(&format!("{field}.mig"), &g.uuid, m)?,
        None => MigInfo::default(),
    };
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
        mig,
    })
}

/// A GPU's MIG state, its fields named under `field`: bounded lists,
/// non-empty distinct device uuids (never the parent's), printable names.
fn mig_from_pb(field: &str, parent: &str, m: pb::MigInfo) -> Result<MigInfo> {
    if m.devices.len() > MAX_MIG_DEVICES {
        return Err(ConvertError::new(
            format!("{field}.devices"),
            format!("has {} devices, at most {MAX_MIG_DEVICES}", m.devices.len()),
        ));
    }
    if m.free.len() > MAX_MIG_DEVICES {
        return Err(ConvertError::new(
            format!("{field}.free"),
            format!("has {} profiles, at most {MAX_MIG_DEVICES}", m.free.len()),
        ));
    }
    if !m.enabled && !m.devices.is_empty() {
        return Err(ConvertError::new(
            format!("{field}.devices"),
            "MIG devices on a GPU whose MIG mode is off",
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut devices = Vec::with_capacity(m.devices.len());
    for (i, d) in m.devices.into_iter().enumerate() {
        let f = format!("{field}.devices[{i}]");
        if d.uuid.is_empty() {
            return Err(ConvertError::new(format!("{f}.uuid"), "must not be empty"));
        }
        check_text(&format!("{f}.uuid"), &d.uuid, MAX_GPU_UUID_LEN, false)?;
        if d.uuid == parent || !seen.insert(d.uuid.clone()) {
            return Err(ConvertError::new(
                format!("{f}.uuid"),
                format!("{} is not unique on its GPU", d.uuid),
            ));
        }
        check_text(
            &format!("{f}.profile"),
            &d.profile,
            MAX_MIG_PROFILE_LEN,
            false,
        )?;
        if d.caps_minors.len() > MAX_MIG_CAPS {
            return Err(ConvertError::new(
                format!("{f}.caps_minors"),
                format!("has {} minors, at most {MAX_MIG_CAPS}", d.caps_minors.len()),
            ));
        }
        devices.push(MigDevice {
            uuid: d.uuid,
            profile: d.profile,
            memory_mib: d.memory_mib,
            gpu_slices: d.gpu_slices,
            compute_slices: d.compute_slices,
            gi_id: d.gi_id,
            ci_id: d.ci_id,
            caps_minors: d.caps_minors,
        });
    }
    let mut free = Vec::with_capacity(m.free.len());
    for (i, c) in m.free.into_iter().enumerate() {
        check_text(
            &format!("{field}.free[{i}].profile"),
            &c.profile,
            MAX_MIG_PROFILE_LEN,
            false,
        )?;
        free.push(MigCapacity {
            profile: c.profile,
            count: c.count,
        });
    }
    if m.profiles.len() > MAX_MIG_DEVICES {
        return Err(ConvertError::new(
            format!("{field}.profiles"),
            format!(
                "has {} profiles, at most {MAX_MIG_DEVICES}",
                m.profiles.len()
            ),
        ));
    }
    let mut profiles = Vec::with_capacity(m.profiles.len());
    for (i, p) in m.profiles.into_iter().enumerate() {
        check_text(
            &format!("{field}.profiles[{i}].name"),
            &p.name,
            MAX_MIG_PROFILE_LEN,
            false,
        )?;
        profiles.push(MigProfile {
            name: p.name,
            gpu_slices: p.gpu_slices,
            memory_mib: p.memory_mib,
            max_count: p.max_count,
        });
    }
    Ok(MigInfo {
        enabled: m.enabled,
        pending: m.pending,
        devices,
        free,
        capable: m.capable || m.enabled || m.pending.is_some(),
        profiles,
    })
}

impl From<MigInfo> for pb::MigInfo {
    fn from(m: MigInfo) -> Self {
        pb::MigInfo {
            enabled: m.enabled,
            pending: m.pending,
            devices: m
                .devices
                .into_iter()
                .map(|d| pb::MigDevice {
                    uuid: d.uuid,
                    profile: d.profile,
                    memory_mib: d.memory_mib,
                    gpu_slices: d.gpu_slices,
                    compute_slices: d.compute_slices,
                    gi_id: d.gi_id,
                    ci_id: d.ci_id,
                    caps_minors: d.caps_minors,
                })
                .collect(),
            free: m
                .free
                .into_iter()
                .map(|c| pb::MigCapacity {
                    profile: c.profile,
                    count: c.count,
                })
                .collect(),
            capable: m.capable,
            profiles: m
                .profiles
                .into_iter()
                .map(|p| pb::MigProfile {
                    name: p.name,
                    gpu_slices: p.gpu_slices,
                    memory_mib: p.memory_mib,
                    max_count: p.max_count,
                })
                .collect(),
        }
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
            mig: (!g.mig.is_off()).then(|| g.mig.into()),
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

/// The registration of an agent; the agent adds what is not its info
/// (`running_task_ids`, `kill_grace_ms`).
impl From<AgentInfo> for pb::RegisterRequest {
    fn from(a: AgentInfo) -> Self {
        pb::RegisterRequest {
            agent_id: a.id,
            hostname: a.hostname,
            address: a.address,
            total: Some(a.total.into()),
            gpus: a.gpus.into_iter().map(Into::into).collect(),
            runtimes: a
                .runtimes
                .into_iter()
                .map(|r| pb::Runtime::from(r) as i32)
                .collect(),
            simulated_gpus: a.simulated_gpus,
            attributes: a.attributes.into_iter().collect(),
            driver_version: a.driver_version.unwrap_or_default(),
            cuda_driver_version: a.cuda_driver_version.unwrap_or_default(),
            running_task_ids: Vec::new(),
            kill_grace_ms: 0,
            allow_root_tasks: a.allow_root_tasks,
            allowed_mounts: a.allowed_mounts,
            ports: a.ports.map(Into::into),
            share_gpus: a.share_gpus.map(|m| m.to_string()).unwrap_or_default(),
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
        check_text("hostname", &r.hostname, MAX_HOSTNAME_LEN, false)?;
        if r.hostname.contains(',') {
            // GPUCTL_PEERS lists hostnames comma separated.
            return Err(ConvertError::new("hostname", "contains ','"));
        }
        check_text("address", &r.address, MAX_ADDRESS_LEN, false)?;
        check_printable("driver_version", &r.driver_version, true)?;
        check_printable("cuda_driver_version", &r.cuda_driver_version, true)?;
        let total = resources_from_pb("total", r.total)?;
        if r.gpus.len() > MAX_AGENT_GPUS {
            return Err(ConvertError::new(
                "gpus",
                format!("has {} GPUs, at most {MAX_AGENT_GPUS}", r.gpus.len()),
            ));
        }
        let mut gpus = Vec::with_capacity(r.gpus.len());
        let mut seen = std::collections::BTreeSet::new();
        for (i, g) in r.gpus.into_iter().enumerate() {
            let field = format!("gpus[{i}]");
            let g = gpu_from_pb(&field, g)?;
            if !seen.insert(g.uuid.clone()) {
                return Err(ConvertError::new(
                    format!("{field}.uuid"),
                    format!("{} listed twice", g.uuid),
                ));
            }
            gpus.push(g);
        }
        let mut mig_seen = std::collections::BTreeSet::new();
        for (i, g) in gpus.iter().enumerate() {
            for (j, d) in g.mig.devices.iter().enumerate() {
                if seen.contains(&d.uuid) || !mig_seen.insert(d.uuid.as_str()) {
                    return Err(ConvertError::new(
                        format!("gpus[{i}].mig.devices[{j}].uuid"),
                        format!("{} is listed twice on the agent", d.uuid),
                    ));
                }
            }
        }
        // Devices, not GPUs: a GPU in MIG mode counts as its MIG devices.
        let devices = crate::types::device_count(&gpus);
        if total.gpus != devices {
            return Err(ConvertError::new(
                "total.gpus",
                format!(
                    "is {} but the GPUs listed give {devices} devices (GPUs not in MIG mode and MIG devices)",
                    total.gpus
                ),
            ));
        }
        if r.runtimes.len() > MAX_AGENT_RUNTIMES {
            return Err(ConvertError::new(
                "runtimes",
                format!(
                    "has {} entries, at most {MAX_AGENT_RUNTIMES}",
                    r.runtimes.len()
                ),
            ));
        }
        let runtimes = r
            .runtimes
            .iter()
            .map(|v| runtime_from_pb("runtimes", *v))
            .collect::<Result<Vec<_>>>()?;
        let known: std::collections::BTreeSet<&str> =
            gpus.iter().map(|g| g.uuid.as_str()).collect();
        for (i, g) in gpus.iter().enumerate() {
            if let Some((j, p)) = g
                .peers
                .iter()
                .enumerate()
                .find(|(_, p)| !known.contains(p.uuid.as_str()))
            {
                return Err(ConvertError::new(
                    format!("gpus[{i}].peers[{j}].uuid"),
                    format!("{} is not a GPU of this agent", p.uuid),
                ));
            }
        }
        if r.attributes.len() > MAX_AGENT_ATTRIBUTES {
            return Err(ConvertError::new(
                "attributes",
                format!(
                    "has {} attributes, at most {MAX_AGENT_ATTRIBUTES}",
                    r.attributes.len()
                ),
            ));
        }
        let attributes: BTreeMap<String, String> = r.attributes.into_iter().collect();
        for (k, v) in &attributes {
            if k.is_empty() || k.len() > MAX_ATTR_LEN {
                return Err(ConvertError::new(
                    "attributes",
                    format!("key {:?} must be 1..={MAX_ATTR_LEN} bytes", cut(k, 64)),
                ));
            }
            check_text(
                &format!("attributes[{:?}]", cut(k, 64)),
                v,
                MAX_ATTR_VALUE_LEN,
                true,
            )?;
        }
        if r.running_task_ids.len() > MAX_AGENT_TASKS {
            return Err(ConvertError::new(
                "running_task_ids",
                format!(
                    "has {} ids, at most {MAX_AGENT_TASKS}",
                    r.running_task_ids.len()
                ),
            ));
        }
        // A task id is `job-N.R` or `<framework-id>.<its own id>`.
        if let Some(i) = r
            .running_task_ids
            .iter()
            .position(|t| t.len() > 2 * MAX_NAME_LEN + 1)
        {
            return Err(ConvertError::new(
                format!("running_task_ids[{i}]"),
                format!("longer than {} bytes", 2 * MAX_NAME_LEN + 1),
            ));
        }
        if r.allowed_mounts.len() > MAX_ALLOWED_MOUNTS {
            return Err(ConvertError::new(
                "allowed_mounts",
                format!(
                    "has {} entries, at most {MAX_ALLOWED_MOUNTS}",
                    r.allowed_mounts.len()
                ),
            ));
        }
        for (i, p) in r.allowed_mounts.iter().enumerate() {
            check_abs_path(&format!("allowed_mounts[{i}]"), p)?;
        }
        let ports = port_range_from_pb(r.ports, total.ports)?;
        let share_gpus = if r.share_gpus.is_empty() {
            None
        } else {
            Some(
                r.share_gpus
                    .parse()
                    .map_err(|e| ConvertError::new("share_gpus", e))?,
            )
        };
        let opt = |s: String| (!s.is_empty()).then_some(s);
        Ok(AgentInfo {
            share_gpus,
            id: r.agent_id,
            hostname: r.hostname,
            address: r.address,
            total,
            gpus,
            runtimes,
            simulated_gpus: r.simulated_gpus,
            attributes,
            driver_version: opt(r.driver_version),
            cuda_driver_version: opt(r.cuda_driver_version),
            allow_root_tasks: r.allow_root_tasks,
            allowed_mounts: r.allowed_mounts,
            ports,
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

impl From<TaskReason> for pb::Reason {
    fn from(r: TaskReason) -> Self {
        match r {
            TaskReason::Unspecified => pb::Reason::Unspecified,
            TaskReason::CommandExited => pb::Reason::CommandExited,
            TaskReason::TaskInvalid => pb::Reason::TaskInvalid,
            TaskReason::ResourcesUnavailable => pb::Reason::ResourcesUnavailable,
            TaskReason::AgentLost => pb::Reason::AgentLost,
            TaskReason::FrameworkRemoved => pb::Reason::FrameworkRemoved,
            TaskReason::KilledByFramework => pb::Reason::KilledByFramework,
            TaskReason::ContainerLaunchFailed => pb::Reason::ContainerLaunchFailed,
            TaskReason::Preempted => pb::Reason::Preempted,
            TaskReason::GpuUnhealthy => pb::Reason::GpuUnhealthy,
            TaskReason::Fenced => pb::Reason::Fenced,
            TaskReason::AgentDrained => pb::Reason::AgentDraining,
            TaskReason::DriverRequirementUnmet => pb::Reason::DriverRequirementUnmet,
            TaskReason::GpuMemoryLimit => pb::Reason::GpuMemoryLimit,
            TaskReason::Reclaimed => pb::Reason::Reclaimed,
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

/// A job state from the wire; unknown values (and UNSPECIFIED) are refused.
pub fn job_state_from_pb(field: &str, v: i32) -> Result<JobState> {
    use pb::JobState as P;
    Ok(match P::try_from(v) {
        Ok(P::JobQueued) => JobState::Queued,
        Ok(P::JobStarting) => JobState::Starting,
        Ok(P::JobRunning) => JobState::Running,
        Ok(P::JobSucceeded) => JobState::Succeeded,
        Ok(P::JobFailed) => JobState::Failed,
        Ok(P::JobCancelled) => JobState::Cancelled,
        _ => return Err(ConvertError::new(field, format!("unknown job state {v}"))),
    })
}

/// Job state as the user-facing upper-case word (`QUEUED`, ...), from the wire value.
/// A runtime's name (`docker`, `process`), or `unknown(N)`.
pub fn runtime_name(v: i32) -> String {
    match runtime_from_pb("runtime", v) {
        Ok(r) => r.to_string(),
        Err(_) => format!("unknown({v})"),
    }
}

/// An agent's state in gpuctl's words (`ACTIVE`, `UNREACHABLE`, `LOST`).
pub fn agent_state_name(v: i32) -> &'static str {
    match pb::AgentState::try_from(v) {
        Ok(pb::AgentState::AgentActive) => "ACTIVE",
        Ok(pb::AgentState::AgentLost) => "LOST",
        Ok(pb::AgentState::AgentUnreachable) => "UNREACHABLE",
        _ => "UNKNOWN",
    }
}

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
        let latest_state = match u.latest_state {
            0 => None,
            v => match task_state_from_pb("latest_state", v)? {
                TaskState::Unreachable => {
                    return Err(ConvertError::new(
                        "latest_state",
                        "TASK_UNREACHABLE is set by the master, not reported by agents",
                    ))
                }
                s => Some(s),
            },
        };
        let unmet = u.reason == pb::Reason::DriverRequirementUnmet as i32;
        if unmet == u.requires.is_empty() {
            return Err(ConvertError::new(
                "requires",
                "is set with REASON_DRIVER_REQUIREMENT_UNMET, and only with it",
            ));
        }
        if unmet && state != TaskState::Failed {
            return Err(ConvertError::new(
                "reason",
                format!("REASON_DRIVER_REQUIREMENT_UNMET needs state FAILED, not {state}"),
            ));
        }
        if u.requires.len() > crate::cuda_req::MAX_EXPRS {
            return Err(ConvertError::new(
                "requires",
                format!(
                    "has {} requirements, at most {}",
                    u.requires.len(),
                    crate::cuda_req::MAX_EXPRS
                ),
            ));
        }
        for (i, r) in u.requires.iter().enumerate() {
            check_text(
                &format!("requires[{i}]"),
                r,
                crate::cuda_req::MAX_EXPR_LEN,
                true,
            )?;
        }
        let gpu_memory_limit = u.reason == pb::Reason::GpuMemoryLimit as i32;
        if gpu_memory_limit && state != TaskState::Failed {
            return Err(ConvertError::new(
                "reason",
                format!("REASON_GPU_MEMORY_LIMIT needs state FAILED, not {state}"),
            ));
        }
        let enforcement = if u.enforcement.is_empty() {
            None
        } else {
            Some(
                u.enforcement
                    .parse()
                    .map_err(|e| ConvertError::new("enforcement", e))?,
            )
        };
        Ok(StatusUpdate {
            agent_id: u.agent_id,
            task_id: u.task_id,
            state,
            exit_code: u.exit_code,
            message: u.message,
            uuid: u.uuid,
            gpu_unhealthy: u.reason == pb::Reason::GpuUnhealthy as i32,
            fenced,
            latest_state,
            requires: u.requires,
            enforcement,
            gpu_memory_limit,
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
            } else if !u.requires.is_empty() {
                pb::Reason::DriverRequirementUnmet as i32
            } else if u.gpu_memory_limit {
                pb::Reason::GpuMemoryLimit as i32
            } else {
                pb::Reason::Unspecified as i32
            },
            latest_state: u
                .latest_state
                .map_or(pb::TaskState::Unspecified as i32, |s| {
                    pb::TaskState::from(s) as i32
                }),
            requires: u.requires,
            enforcement: u.enforcement.map(|e| e.to_string()).unwrap_or_default(),
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
            task_memory_used_mib: s.task_memory_used_mib.into_iter().collect(),
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
            task_memory_used_mib: s.task_memory_used_mib.into_iter().collect(),
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
        if let Some(s) = &r.sample {
            const FIELD: &str = "gpus.sample.task_memory_used_mib";
            if s.task_memory_used_mib.len() > MAX_SAMPLE_TASKS {
                return Err(ConvertError::new(
                    FIELD,
                    format!("more than {MAX_SAMPLE_TASKS} tasks"),
                ));
            }
            for task in s.task_memory_used_mib.keys() {
                check_id(FIELD, task)?;
            }
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

/// Checks a master's `HOST:PORT` (a bracketed IPv6 host is fine).
pub fn check_host_port(field: &str, addr: &str) -> Result<()> {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(ConvertError::new(
            field,
            format!("{addr:?} is not HOST:PORT"),
        ));
    };
    if host.is_empty() || (host.contains(':') && !(host.starts_with('[') && host.ends_with(']'))) {
        return Err(ConvertError::new(
            field,
            format!("{addr:?} has no valid host"),
        ));
    }
    match port.parse::<u16>() {
        Ok(p) if p != 0 => Ok(()),
        _ => Err(ConvertError::new(
            field,
            format!("{addr:?} has no valid port"),
        )),
    }
}

// ------------------------------------------------------------ framework API

/// Longest failover timeout a framework may ask for: a week.
pub const MAX_FAILOVER_SECS: f64 = 7.0 * 24.0 * 3600.0;
/// Longest framework name.
pub const MAX_FRAMEWORK_NAME: usize = 128;

/// A framework as it subscribes (`framework`, required).
pub fn framework_info_from_pb(f: Option<pb::FrameworkInfo>) -> Result<FrameworkInfo> {
    let f = f.ok_or_else(|| ConvertError::new("framework", "missing"))?;
    if !f.id.is_empty() {
        check_id("framework.id", &f.id)?;
    }
    if f.id == BUILTIN_FRAMEWORK_ID {
        return Err(ConvertError::new(
            "framework.id",
            "reserved for gpuctl's own job scheduler",
        ));
    }
    if f.name.trim().is_empty() || f.name.len() > MAX_FRAMEWORK_NAME {
        return Err(ConvertError::new(
            "framework.name",
            format!("1 to {MAX_FRAMEWORK_NAME} characters"),
        ));
    }
    for r in &f.roles {
        check_id("framework.roles[]", r)?;
    }
    if !f.failover_timeout_secs.is_finite()
        || !(0.0..=MAX_FAILOVER_SECS).contains(&f.failover_timeout_secs)
    {
        return Err(ConvertError::new(
            "framework.failover_timeout_secs",
            format!("must be 0..={MAX_FAILOVER_SECS}"),
        ));
    }
    Ok(FrameworkInfo {
        id: f.id,
        name: f.name,
        roles: f.roles,
        gpu_capable: f
            .capabilities
            .contains(&(pb::FrameworkCapability::GpuResources as i32)),
        failover_timeout_ms: (f.failover_timeout_secs * 1000.0) as u64,
        tenant: String::new(),
    })
}

/// A framework's task as it enters the cluster (`field` names it, e.g.
/// `operations[0].tasks[1]`): the same checks of image, command and
/// environment as a job's ([`check_payload`]), its ids, its resources, and
/// as many GPUs named as it asks for, or a fraction of one shared GPU and
/// none. Whether its agent and GPUs were offered is the master's to check.
pub fn framework_task_from_pb(field: &str, t: pb::TaskInfo) -> Result<FrameworkTask> {
    check_id(&format!("{field}.task_id"), &t.task_id)?;
    check_id(&format!("{field}.agent_id"), &t.agent_id)?;
    let resources = resources_from_pb(&format!("{field}.resources"), t.resources)?;
    check_task_ports(&format!("{field}.resources.ports"), resources.ports)?;
    let fraction = match t.gpu_fraction {
        None => None,
        Some(f) => Some(framework_fraction_from_pb(
            field,
            f,
            &resources,
            &t.gpu_uuids,
        )?),
    };
    if t.gpu_uuids.len() != resources.gpus as usize {
        return Err(ConvertError::new(
            format!("{field}.gpu_uuids"),
            format!(
                "names {} GPUs, resources.gpus is {}",
                t.gpu_uuids.len(),
                resources.gpus
            ),
        ));
    }
    for (i, g) in t.gpu_uuids.iter().enumerate() {
        check_id(&format!("{field}.gpu_uuids[{i}]"), g)?;
        // One GPU twice would count as two and be visible as two.
        if t.gpu_uuids[..i].contains(g) {
            return Err(ConvertError::new(
                format!("{field}.gpu_uuids[{i}]"),
                format!("GPU {g} is named twice"),
            ));
        }
    }
    check_env_count(&format!("{field}.env"), t.env.len())?;
    let env: BTreeMap<String, String> = t.env.into_iter().collect();
    check_payload(field, &t.image, &t.command, &env)?;
    // A fraction's task names its one GPU, as its task record does.
    let (gpu_uuids, fraction) = match fraction {
        Some((uuid, f)) => (vec![uuid], Some(f)),
        None => (t.gpu_uuids, None),
    };
    Ok(FrameworkTask {
        task_id: t.task_id,
        agent_id: t.agent_id,
        image: (!t.image.is_empty()).then_some(t.image),
        command: t.command,
        env,
        resources,
        gpu_uuids,
        fraction,
    })
}

/// A framework task's `gpu_fraction`: its GPU's uuid and the fraction, with
/// no device asked beside it (a fraction is not a device).
fn framework_fraction_from_pb(
    field: &str,
    f: pb::GpuFraction,
    resources: &Resources,
    gpu_uuids: &[String],
) -> Result<(String, GpuFraction)> {
    let at = |name: &str| format!("{field}.gpu_fraction.{name}");
    check_id(&at("gpu_uuid"), &f.gpu_uuid)?;
    if f.mem_mib == 0 || f.mem_mib > MAX_MEM_MIB {
        return Err(ConvertError::new(
            at("mem_mib"),
            format!(
                "is {}, MiB of the GPU's memory (1 to {MAX_MEM_MIB})",
                f.mem_mib
            ),
        ));
    }
    if f.compute_pct > 100 {
        return Err(ConvertError::new(
            at("compute_pct"),
            format!("is {}, a percent of one GPU (0-100)", f.compute_pct),
        ));
    }
    if resources.gpus != 0 {
        return Err(ConvertError::new(
            format!("{field}.resources.gpus"),
            format!(
                "is {}, but a task with gpu_fraction gets a fraction of one shared GPU, not GPUs (0)",
                resources.gpus
            ),
        ));
    }
    if !gpu_uuids.is_empty() {
        return Err(ConvertError::new(
            format!("{field}.gpu_uuids"),
            "names GPUs, but a task with gpu_fraction names its GPU in gpu_fraction.gpu_uuid",
        ));
    }
    Ok((
        f.gpu_uuid,
        GpuFraction {
            mem_mib: f.mem_mib,
            compute_pct: f.compute_pct,
        },
    ))
}

// ---------------------------------------------------------------- operator

/// Jobs in a ListJobs page when the request says 0.
pub const DEFAULT_PAGE_LIMIT: u32 = 500;
/// Most jobs in a ListJobs page; a larger limit is read as this.
pub const MAX_PAGE_LIMIT: u32 = 1000;

impl TryFrom<pb::ListJobsRequest> for JobsQuery {
    type Error = ConvertError;
    fn try_from(r: pb::ListJobsRequest) -> Result<Self> {
        let states = r
            .states
            .iter()
            .enumerate()
            .map(|(i, v)| job_state_from_pb(&format!("states[{i}]"), *v))
            .collect::<Result<std::collections::HashSet<_>>>()?;
        let name = if r.name.is_empty() {
            None
        } else {
            check_id("name", &r.name)?;
            Some(r.name)
        };
        let limit = match r.limit {
            0 => DEFAULT_PAGE_LIMIT,
            n => n.min(MAX_PAGE_LIMIT),
        } as usize;
        let before = if r.page_token.is_empty() {
            None
        } else {
            Some(r.page_token.parse::<u64>().map_err(|_| {
                ConvertError::new(
                    "page_token",
                    "not a token from a ListJobs response (send it as it came)",
                )
            })?)
        };
        Ok(JobsQuery {
            states,
            name,
            limit,
            before,
        })
    }
}

/// Longest drain deadline accepted: a year.
pub const MAX_DRAIN_DEADLINE_SECS: f64 = 365.0 * 86400.0;

/// A drain's `deadline_secs`, checked, as the deadline counted from `at_ms`.
pub fn drain_deadline(at_ms: u64, secs: Option<f64>) -> Result<Option<u64>> {
    match secs {
        None => Ok(None),
        Some(s) if s.is_finite() && (0.0..=MAX_DRAIN_DEADLINE_SECS).contains(&s) => {
            Ok(Some(at_ms.saturating_add((s * 1000.0) as u64)))
        }
        Some(s) => Err(ConvertError::new(
            "deadline_secs",
            format!("{s} is not a number of seconds between 0 and {MAX_DRAIN_DEADLINE_SECS}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mig_gpu() -> GpuInfo {
        let mut g = GpuInfo::new("GPU-a", 0, "NVIDIA A100-SXM4-40GB", 40960);
        g.mig = MigInfo {
            enabled: true,
            pending: None,
            devices: vec![MigDevice {
                uuid: "MIG-1".into(),
                profile: "3g.20gb".into(),
                memory_mib: 19968,
                gpu_slices: 3,
                compute_slices: 3,
                gi_id: 1,
                ci_id: 0,
                caps_minors: vec![12, 13],
            }],
            free: vec![MigCapacity {
                profile: "1g.5gb".into(),
                count: 2,
            }],
            capable: true,
            profiles: vec![MigProfile {
                name: "1g.5gb".into(),
                gpu_slices: 1,
                memory_mib: 4864,
                max_count: 7,
            }],
        };
        g
    }

    #[test]
    fn mig_devices_round_trip_and_bad_ones_are_refused_naming_the_field() {
        let g = mig_gpu();
        assert_eq!(gpu_from_pb("gpus[0]", g.clone().into()).unwrap(), g);
        // A GPU without MIG sends none and reads back as off.
        let plain = GpuInfo::new("GPU-b", 1, "T4", 15360);
        let pb_plain: pb::Gpu = plain.clone().into();
        assert!(pb_plain.mig.is_none());
        assert_eq!(gpu_from_pb("gpus[1]", pb_plain).unwrap(), plain);
        let bad = |edit: fn(&mut pb::MigInfo), field: &str| {
            let mut p: pb::Gpu = mig_gpu().into();
            edit(p.mig.as_mut().unwrap());
            let e = gpu_from_pb("gpus[0]", p).unwrap_err();
            assert_eq!(e.field, field, "{e}");
        };
        bad(|m| m.enabled = false, "gpus[0].mig.devices");
        bad(
            |m| m.devices.push(m.devices[0].clone()),
            "gpus[0].mig.devices[1].uuid",
        );
        bad(
            |m| m.devices[0].uuid = "GPU-a".into(),
            "gpus[0].mig.devices[0].uuid",
        );
        bad(|m| m.devices[0].uuid.clear(), "gpus[0].mig.devices[0].uuid");
        bad(
            |m| m.devices[0].profile = "x".repeat(33),
            "gpus[0].mig.devices[0].profile",
        );
        bad(
            |m| m.devices[0].caps_minors = vec![1; 9],
            "gpus[0].mig.devices[0].caps_minors",
        );
        bad(
            |m| m.devices = vec![m.devices[0].clone(); 17],
            "gpus[0].mig.devices",
        );
        bad(
            |m| m.free[0].profile = "bad\nname".into(),
            "gpus[0].mig.free[0].profile",
        );
    }

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
                ports: 0,
            }),
            priority: -3,
            replicas: 4,
            max_retries: 2,
            no_requeue: true,
            no_fence: true,
            security: Some(pb::TaskSecurity {
                user: "1234:1234".into(),
                mounts: vec![pb::HostMount {
                    host_path: "/data/sets".into(),
                    container_path: "/data".into(),
                    read_write: false,
                }],
                ..Default::default()
            }),
            ..Default::default()
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
        assert_eq!(s.security.user.as_deref(), Some("1234:1234"));
        assert_eq!(
            s.security.mounts,
            [HostMount {
                host_path: "/data/sets".into(),
                container_path: "/data".into(),
                read_only: true,
            }]
        );
        // A gang asked no port: each rank holds one, for MASTER_PORT.
        assert_eq!(s.resources.ports, 1);
        let mut want = spec();
        want.resources.as_mut().unwrap().ports = 1;
        assert_eq!(pb::JobSpec::from(s), want);
        // An old client's spec (no replicas) is one task.
        let mut old = spec();
        old.replicas = 0;
        assert_eq!(JobSpec::try_from(old).unwrap().replicas, 1);
    }

    #[test]
    fn empty_image_means_host_process() {
        let mut p = spec();
        p.image.clear();
        // (Host processes take no mounts.)
        p.security = None;
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
            (
                |s| s.stop_grace_ms = Some(MAX_STOP_GRACE_MS + 1),
                "spec.stop_grace_ms",
            ),
            (|s| s.checkpoint_dir = "ckpt".into(), "spec.checkpoint_dir"),
            (
                |s| s.checkpoint_dir = "/a/../b".into(),
                "spec.checkpoint_dir",
            ),
            (|s| s.checkpoint_dir = "/a:b".into(), "spec.checkpoint_dir"),
            (|s| s.checkpoint_dir = "/".into(), "spec.checkpoint_dir"),
        ];
        for (mutate, field) in cases {
            let mut p = spec();
            mutate(&mut p);
            let err = JobSpec::try_from(p).unwrap_err();
            assert_eq!(err.field, field, "{err}");
            assert!(err.to_string().contains(field), "{err}");
        }
    }

    #[test]
    fn stop_grace_and_checkpoint_dir_go_to_the_spec_and_back() {
        let mut p = spec();
        p.stop_grace_ms = Some(90_000);
        p.checkpoint_dir = "/ckpt/run-1".into();
        let s = JobSpec::try_from(p.clone()).unwrap();
        assert_eq!(s.stop_grace_ms, Some(90_000));
        assert_eq!(s.checkpoint_dir.as_deref(), Some("/ckpt/run-1"));
        let back = pb::JobSpec::from(s);
        assert_eq!(
            (back.stop_grace_ms, back.checkpoint_dir.as_str()),
            (Some(90_000), "/ckpt/run-1")
        );
        let none = JobSpec::try_from(spec()).unwrap();
        assert_eq!((none.stop_grace_ms, none.checkpoint_dir), (None, None));
        // 0 is a grace too: SIGKILL at once.
        p.stop_grace_ms = Some(0);
        assert_eq!(JobSpec::try_from(p).unwrap().stop_grace_ms, Some(0));
    }

    #[test]
    fn stop_kinds_name_the_reason_generically() {
        assert_eq!(stop_kind(TaskReason::Preempted, false), "preempted");
        assert_eq!(stop_kind(TaskReason::AgentDrained, false), "drained");
        assert_eq!(stop_kind(TaskReason::Unspecified, true), "cancelled");
        assert_eq!(stop_kind(TaskReason::Unspecified, false), "killed");
        assert_eq!(stop_kind(TaskReason::KilledByFramework, false), "killed");
        assert_eq!(stop_kind(TaskReason::Reclaimed, false), "reclaimed");
        // Any other reason by its wire name: one added later needs nothing
        // here.
        assert_eq!(stop_kind(TaskReason::GpuUnhealthy, false), "gpu_unhealthy");
        // A cancel of a job whose task was already being preempted keeps
        // what the task recorded first.
        assert_eq!(stop_kind(TaskReason::Preempted, true), "preempted");
    }

    /// A job with `security` as `edit` makes it, host process or container.
    fn with_security(image: &str, edit: impl FnOnce(&mut pb::TaskSecurity)) -> pb::JobSpec {
        let mut s = spec();
        s.image = image.into();
        let mut sec = pb::TaskSecurity::default();
        edit(&mut sec);
        s.security = Some(sec);
        s
    }

    fn mount(host: &str, container: &str) -> pb::HostMount {
        pb::HostMount {
            host_path: host.into(),
            container_path: container.into(),
            read_write: false,
        }
    }

    #[test]
    fn every_security_error_names_its_field() {
        type Edit = Box<dyn Fn(&mut pb::TaskSecurity)>;
        let long = format!("/{}", "p".repeat(MAX_PATH_LEN));
        // (image, edit, field, words in the reason)
        let cases: Vec<(&str, Edit, &str, &str)> = vec![
            (
                "img",
                Box::new(|s| s.privileged = true),
                "spec.security.privileged",
                "privileged containers are never allowed",
            ),
            (
                "",
                Box::new(|s| s.privileged = true),
                "spec.security.privileged",
                "never allowed",
            ),
            (
                "img",
                Box::new(|s| s.user = "nobody".into()),
                "spec.security.user",
                "not UID or UID:GID",
            ),
            (
                "",
                Box::new(|s| s.user = "12:x".into()),
                "spec.security.user",
                "not UID or UID:GID",
            ),
            (
                "",
                Box::new(|s| s.user = "4294967295".into()),
                "spec.security.user",
                "not a valid id",
            ),
            (
                "",
                Box::new(|s| s.user = "1".repeat(33)),
                "spec.security.user",
                "at most 32",
            ),
            (
                "",
                Box::new(|s| s.user = "0".into()),
                "spec.security.user",
                "security.run_as_root instead",
            ),
            (
                "",
                Box::new(|s| s.user = "1000:0".into()),
                "spec.security.user",
                "root",
            ),
            (
                "",
                Box::new(|s| {
                    s.user = "1000".into();
                    s.run_as_root = true;
                }),
                "spec.security.run_as_root",
                "together with security.user",
            ),
            (
                "img",
                Box::new(|s| s.run_as_root = true),
                "spec.security.run_as_root",
                "only for host-process jobs",
            ),
            (
                "",
                Box::new(|s| s.mounts = vec![mount("/data", "/data")]),
                "spec.security.mounts",
                "only containers",
            ),
            (
                "img",
                Box::new(|s| s.mounts = vec![mount("/data", "/data"); MAX_MOUNTS + 1]),
                "spec.security.mounts",
                "at most 16",
            ),
            (
                "img",
                Box::new(|s| s.mounts = vec![mount("data", "/data")]),
                "spec.security.mounts[0].host_path",
                "must be an absolute path without '..'",
            ),
            (
                "img",
                Box::new(|s| s.mounts = vec![mount("/data", "/d"), mount("/data/../etc", "/data")]),
                "spec.security.mounts[1].host_path",
                "must be an absolute path without '..'",
            ),
            (
                "img",
                Box::new(|s| s.mounts = vec![mount("", "/data")]),
                "spec.security.mounts[0].host_path",
                "absolute",
            ),
            (
                "img",
                Box::new(|s| s.mounts = vec![mount("/data//x", "/data")]),
                "spec.security.mounts[0].host_path",
                "plain path",
            ),
            (
                "img",
                Box::new(|s| s.mounts = vec![mount("/data/./x", "/data")]),
                "spec.security.mounts[0].host_path",
                "plain path",
            ),
            (
                "img",
                Box::new(|s| s.mounts = vec![mount("/data/", "/data")]),
                "spec.security.mounts[0].host_path",
                "plain path",
            ),
            (
                "img",
                Box::new(|s| s.mounts = vec![mount("/data:/etc", "/data")]),
                "spec.security.mounts[0].host_path",
                "':'",
            ),
            (
                "img",
                Box::new(|s| s.mounts = vec![mount("/a,b", "/data")]),
                "spec.security.mounts[0].host_path",
                "','",
            ),
            (
                "img",
                Box::new(|s| s.mounts = vec![mount("/a\nb", "/data")]),
                "spec.security.mounts[0].host_path",
                "'\\n'",
            ),
            (
                "img",
                Box::new(move |s| s.mounts = vec![mount(&long, "/data")]),
                "spec.security.mounts[0].host_path",
                "at most 1024",
            ),
            (
                "img",
                Box::new(|s| s.mounts = vec![mount("/data", "data")]),
                "spec.security.mounts[0].container_path",
                "absolute path without '..'",
            ),
            (
                "img",
                Box::new(|s| s.mounts = vec![mount("/data", "/x/..")]),
                "spec.security.mounts[0].container_path",
                "absolute path without '..'",
            ),
            (
                "img",
                Box::new(|s| s.mounts = vec![mount("/data", "/")]),
                "spec.security.mounts[0].container_path",
                "must not be /",
            ),
            (
                "img",
                Box::new(|s| s.mounts = vec![mount("/data", "/usr/local/nvidia/lib")]),
                "spec.security.mounts[0].container_path",
                "driver volume",
            ),
            (
                "img",
                Box::new(|s| s.mounts = vec![mount("/a", "/data"), mount("/b", "/data")]),
                "spec.security.mounts[1].container_path",
                "mounted twice",
            ),
        ];
        for (image, edit, field, words) in cases {
            let err = JobSpec::try_from(with_security(image, edit)).unwrap_err();
            assert_eq!(err.field, field, "{err}");
            assert!(err.reason.contains(words), "{field}: {err}");
        }
        // The issue's wording.
        let err = JobSpec::try_from(with_security("img", |s| {
            s.mounts = vec![mount("/data/../etc", "/data")]
        }))
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid spec.security.mounts[0].host_path: must be an absolute path without '..'"
        );
    }

    #[test]
    fn allowed_security_passes_and_limits_hold_at_the_edge() {
        let ok: Vec<pb::JobSpec> = vec![
            with_security("", |_| {}),
            with_security("", |s| s.user = "1234".into()),
            with_security("", |s| s.user = "65534:65534".into()),
            with_security("", |s| s.run_as_root = true),
            // A container may run as its own root: it has no more than the
            // default capabilities.
            with_security("img", |s| s.user = "0:0".into()),
            with_security("img", |s| {
                s.mounts = (0..MAX_MOUNTS)
                    .map(|i| mount("/", &format!("/m{i}")))
                    .collect()
            }),
            with_security("img", |s| {
                s.mounts = vec![mount(
                    &format!("/{}", "p".repeat(MAX_PATH_LEN - 1)),
                    "/usr/local/nvidiax",
                )]
            }),
        ];
        for spec in ok {
            let sec = spec.security.clone();
            let j = JobSpec::try_from(spec).unwrap_or_else(|e| panic!("{sec:?}: {e}"));
            // What the master sends the agent passes the agent's check too.
            let task = pb::TaskSpec::from(TaskSpec {
                share: None,
                stop_grace_ms: None,
                checkpoint_dir: None,
                task_id: "job-1.0".into(),
                job_id: "job-1".into(),
                framework_id: String::new(),
                image: j.image.clone(),
                command: j.command.clone(),
                env: j.env.clone(),
                resources: Resources::default(),
                gpu_uuids: vec![],
                no_fence: false,
                security: j.security.clone(),
            });
            assert_eq!(TaskSpec::try_from(task).unwrap().security, j.security);
        }
        // The default is not sent, and an absent one is the default.
        let mut s = spec();
        s.security = None;
        let j = JobSpec::try_from(s).unwrap();
        assert!(j.security.is_default());
        assert_eq!(pb::JobSpec::from(j).security, None);
    }

    #[test]
    fn old_specs_without_security_still_decode() {
        // A job as stored (log, snapshot) before `security` existed.
        let old = r#"{"name":"j","image":null,"command":["true"],"env":{},"resources":{"cpus":1.0,"mem_mib":0,"gpus":0}}"#;
        let j: JobSpec = serde_json::from_str(old).unwrap();
        assert!(j.security.is_default());
        // And a default one is not written, so specs stay as they were.
        assert!(!serde_json::to_string(&j).unwrap().contains("security"));
        let t = r#"{"task_id":"t","job_id":"j","image":null,"command":["true"],"env":{},"resources":{"cpus":1.0,"mem_mib":0,"gpus":0},"gpu_uuids":[]}"#;
        let t: TaskSpec = serde_json::from_str(t).unwrap();
        assert!(t.security.is_default());
        // A mount without read_only is read-only.
        let m: HostMount =
            serde_json::from_str(r#"{"host_path":"/a","container_path":"/b"}"#).unwrap();
        assert!(m.read_only);
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
                ports: 0,
            }),
            gpus: vec![gpu("GPU-1"), gpu("GPU-1")],
            runtimes: vec![pb::Runtime::Process as i32],
            running_task_ids: vec![],
            simulated_gpus: false,
            ..Default::default()
        };
        assert_eq!(
            AgentInfo::try_from(r.clone()).unwrap_err().field,
            "gpus[1].uuid"
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
    fn a_shares_tenant_must_be_a_safe_name_and_survives_the_wire() {
        let t = |tenant: &str| pb::TaskSpec {
            share: Some(pb::TaskShare {
                mem_mib: 1024,
                compute_pct: 0,
                mode: "mps".into(),
                tenant: tenant.into(),
            }),
            task_id: "job-1.0".into(),
            job_id: "job-1".into(),
            command: vec!["true".into()],
            resources: Some(pb::Resources::default()),
            gpu_uuids: vec!["GPU-1".into()],
            no_fence: true,
            ..Default::default()
        };
        // It names the agent's MPS directory: nothing that leaves it.
        for bad in ["..", "a/b", ".x"] {
            assert_eq!(
                TaskSpec::try_from(t(bad)).unwrap_err().field,
                "task.share.tenant",
                "{bad}"
            );
        }
        let ok = TaskSpec::try_from(t("team-a")).unwrap();
        assert_eq!(ok.share.as_ref().unwrap().tenant, "team-a");
        let back = pb::TaskSpec::from(ok);
        assert_eq!(back.share.unwrap().tenant, "team-a");
    }

    #[test]
    fn task_spec_gpu_list_must_match_count() {
        let t = pb::TaskSpec {
            share: None,
            task_id: "job-1.0".into(),
            job_id: "job-1".into(),
            image: String::new(),
            command: vec!["true".into()],
            env: Default::default(),
            resources: Some(pb::Resources {
                cpus: 0.0,
                mem_mib: 0,
                gpus: 1,
                ports: 0,
            }),
            gpu_uuids: vec![],
            framework_id: String::new(),
            no_fence: true,
            security: None,
            stop_grace_ms: None,
            checkpoint_dir: String::new(),
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

    /// `ok` applied to a valid spec passes; `bad` fails naming `field`.
    fn boundary<T: Clone>(
        base: &T,
        ok: impl Fn(&mut T),
        bad: impl Fn(&mut T),
        field: &str,
        convert: impl Fn(T) -> Result<()>,
    ) {
        let mut at = base.clone();
        ok(&mut at);
        if let Err(e) = convert(at) {
            panic!("at the limit of {field}: {e}");
        }
        let mut past = base.clone();
        bad(&mut past);
        let err = convert(past).expect_err(field);
        assert_eq!(err.field, field, "{err}");
        assert!(err.to_string().contains(field), "{err}");
    }

    fn job(s: pb::JobSpec) -> Result<()> {
        JobSpec::try_from(s).map(|_| ())
    }

    fn env_of(pairs: &[(&str, usize)]) -> std::collections::HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, n)| (k.to_string(), "v".repeat(*n)))
            .collect()
    }

    #[test]
    fn job_spec_limits_pass_at_and_fail_past() {
        let base = spec();
        boundary(
            &base,
            |s| s.name = "n".repeat(MAX_NAME_LEN),
            |s| s.name = "n".repeat(MAX_NAME_LEN + 1),
            "spec.name",
            job,
        );
        boundary(
            &base,
            |s| s.image = "i".repeat(MAX_IMAGE_LEN),
            |s| s.image = "i".repeat(MAX_IMAGE_LEN + 1),
            "spec.image",
            job,
        );
        boundary(
            &base,
            |s| s.command = vec!["a".into(); MAX_COMMAND_ARGS],
            |s| s.command = vec!["a".into(); MAX_COMMAND_ARGS + 1],
            "spec.command",
            job,
        );
        let half = MAX_COMMAND_BYTES / 2;
        boundary(
            &base,
            |s| s.command = vec!["a".repeat(half), "b".repeat(half)],
            |s| s.command = vec!["a".repeat(half), "b".repeat(half + 1)],
            "spec.command",
            job,
        );
        boundary(
            &base,
            |s| s.env = env_of(&[(&"K".repeat(MAX_ENV_KEY_BYTES), 1)]),
            |s| s.env = env_of(&[(&"K".repeat(MAX_ENV_KEY_BYTES + 1), 1)]),
            // The name is cut in the field label.
            &format!("spec.env[\"{}...\"]", "K".repeat(64)),
            job,
        );
        boundary(
            &base,
            |s| s.env = env_of(&[("FOO", MAX_ENV_VALUE_BYTES)]),
            |s| s.env = env_of(&[("FOO", MAX_ENV_VALUE_BYTES + 1)]),
            "spec.env[\"FOO\"]",
            job,
        );
        // 8 variables of 2 + 32766 bytes: exactly the total.
        let full: Vec<(String, usize)> = (0..8)
            .map(|i| (format!("K{i}"), MAX_ENV_VALUE_BYTES - 2))
            .collect();
        let full_ref: Vec<(&str, usize)> = full.iter().map(|(k, n)| (k.as_str(), *n)).collect();
        assert_eq!(8 * MAX_ENV_VALUE_BYTES, MAX_ENV_TOTAL_BYTES);
        boundary(
            &base,
            |s| s.env = env_of(&full_ref),
            |s| {
                s.env = env_of(&full_ref);
                s.env.insert("X".into(), String::new());
            },
            "spec.env",
            job,
        );
        boundary(
            &base,
            |s| {
                s.env = (0..MAX_ENV_VARS)
                    .map(|i| (format!("V{i}"), String::new()))
                    .collect()
            },
            |s| {
                s.env = (0..=MAX_ENV_VARS)
                    .map(|i| (format!("V{i}"), String::new()))
                    .collect()
            },
            "spec.env",
            job,
        );
        boundary(
            &base,
            |s| {
                s.env = [("A".to_string(), String::new())].into();
                s.secret_env = vec!["A".into(); MAX_ENV_VARS];
            },
            |s| {
                s.env = [("A".to_string(), String::new())].into();
                s.secret_env = vec!["A".into(); MAX_ENV_VARS + 1];
            },
            "spec.secret_env",
            job,
        );
        boundary(
            &base,
            |s| s.replicas = MAX_REPLICAS,
            |s| s.replicas = MAX_REPLICAS + 1,
            "spec.replicas",
            job,
        );
        boundary(
            &base,
            |s| s.max_retries = MAX_RETRIES,
            |s| s.max_retries = MAX_RETRIES + 1,
            "spec.max_retries",
            job,
        );
        boundary(
            &base,
            |s| s.resources.as_mut().unwrap().cpus = MAX_CPUS,
            |s| s.resources.as_mut().unwrap().cpus = MAX_CPUS + 0.5,
            "spec.resources.cpus",
            job,
        );
        boundary(
            &base,
            |s| s.resources.as_mut().unwrap().cpus = 0.0,
            |s| s.resources.as_mut().unwrap().cpus = f64::INFINITY,
            "spec.resources.cpus",
            job,
        );
        boundary(
            &base,
            |s| s.resources.as_mut().unwrap().mem_mib = MAX_MEM_MIB,
            |s| s.resources.as_mut().unwrap().mem_mib = MAX_MEM_MIB + 1,
            "spec.resources.mem_mib",
            job,
        );
        boundary(
            &base,
            |s| s.resources.as_mut().unwrap().mem_mib = 0,
            |s| s.resources.as_mut().unwrap().mem_mib = u64::MAX,
            "spec.resources.mem_mib",
            job,
        );
        boundary(
            &base,
            |s| s.resources.as_mut().unwrap().gpus = MAX_GPUS,
            |s| s.resources.as_mut().unwrap().gpus = MAX_GPUS + 1,
            "spec.resources.gpus",
            job,
        );
        boundary(
            &base,
            |s| s.resources.as_mut().unwrap().ports = MAX_TASK_PORTS,
            |s| s.resources.as_mut().unwrap().ports = MAX_TASK_PORTS + 1,
            "spec.resources.ports",
            job,
        );
        boundary(
            &base,
            |s| {
                s.placement.get_or_insert_with(Default::default).gpu_model =
                    "m".repeat(MAX_ATTR_LEN)
            },
            |s| {
                s.placement.get_or_insert_with(Default::default).gpu_model =
                    "m".repeat(MAX_ATTR_LEN + 1)
            },
            "spec.placement.gpu_model",
            job,
        );
        boundary(
            &base,
            |s| {
                s.placement
                    .get_or_insert_with(Default::default)
                    .gpu_mem_min_mib = MAX_MEM_MIB
            },
            |s| {
                s.placement
                    .get_or_insert_with(Default::default)
                    .gpu_mem_min_mib = MAX_MEM_MIB + 1
            },
            "spec.placement.gpu_mem_min_mib",
            job,
        );
        boundary(
            &base,
            |s| {
                s.placement.get_or_insert_with(Default::default).constraints = (0..MAX_CONSTRAINTS)
                    .map(|i| (format!("k{i}"), "v".into()))
                    .collect()
            },
            |s| {
                s.placement.get_or_insert_with(Default::default).constraints = (0..=MAX_CONSTRAINTS)
                    .map(|i| (format!("k{i}"), "v".into()))
                    .collect()
            },
            "spec.placement.constraints",
            job,
        );
        boundary(
            &base,
            |s| {
                s.placement.get_or_insert_with(Default::default).constraints =
                    [("k".repeat(MAX_ATTR_LEN), "v".into())].into()
            },
            |s| {
                s.placement.get_or_insert_with(Default::default).constraints =
                    [("k".repeat(MAX_ATTR_LEN + 1), "v".into())].into()
            },
            "spec.placement.constraints",
            job,
        );
        boundary(
            &base,
            |s| {
                s.placement.get_or_insert_with(Default::default).constraints =
                    [("zone".into(), "v".repeat(MAX_ATTR_LEN))].into()
            },
            |s| {
                s.placement.get_or_insert_with(Default::default).constraints =
                    [("zone".into(), "v".repeat(MAX_ATTR_LEN + 1))].into()
            },
            "spec.placement.constraints[zone]",
            job,
        );
    }

    #[test]
    fn the_issue_s_env_error_reads_as_documented() {
        let mut s = spec();
        s.env = env_of(&[("FOO", 40000)]);
        assert_eq!(
            JobSpec::try_from(s).unwrap_err().to_string(),
            "invalid spec.env[\"FOO\"]: value is 40000 bytes, at most 32768"
        );
    }

    #[test]
    fn a_maximal_task_spec_encodes_under_one_mib() {
        use prost::Message as _;
        // Every limit at once, plus what the master adds to a gang's env.
        let env: BTreeMap<String, String> = (0..MAX_ENV_VARS - 3)
            .map(|i| {
                (
                    format!("{i:0>8}"),
                    "v".repeat(MAX_ENV_TOTAL_BYTES / MAX_ENV_VARS - 8),
                )
            })
            .collect();
        let total: usize = env.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert!(total <= MAX_ENV_TOTAL_BYTES);
        let mut env = env;
        let peers = vec!["h".repeat(MAX_HOSTNAME_LEN); MAX_REPLICAS as usize].join(",");
        env.insert("GPUCTL_PEERS".into(), peers);
        env.insert("GPUCTL_RANK".into(), "4095".into());
        env.insert("GPUCTL_WORLD_SIZE".into(), "4096".into());
        let command: Vec<String> = (0..MAX_COMMAND_ARGS)
            .map(|_| "c".repeat(MAX_COMMAND_BYTES / MAX_COMMAND_ARGS))
            .collect();
        let t = pb::TaskSpec::from(TaskSpec {
            share: None,
            stop_grace_ms: None,
            checkpoint_dir: None,
            task_id: "t".repeat(2 * MAX_NAME_LEN + 1),
            job_id: "j".repeat(MAX_NAME_LEN),
            framework_id: String::new(),
            image: Some("i".repeat(MAX_IMAGE_LEN)),
            command,
            env,
            resources: Resources {
                cpus: MAX_CPUS,
                mem_mib: MAX_MEM_MIB,
                gpus: MAX_GPUS,
                ports: 0,
            },
            gpu_uuids: (0..MAX_GPUS).map(|i| format!("GPU-{i:0>36}")).collect(),
            no_fence: false,
            security: TaskSecurity {
                user: Some("4294967294:4294967294".into()),
                mounts: (0..MAX_MOUNTS)
                    .map(|i| HostMount {
                        host_path: format!("/{i:0>1023}"),
                        container_path: format!("/{i:1>1023}"),
                        read_only: false,
                    })
                    .collect(),
                privileged: false,
                run_as_root: false,
            },
        });
        let len = t.encoded_len();
        assert!(len < 700 * 1024, "{len} bytes");
    }

    fn register_request() -> pb::RegisterRequest {
        pb::RegisterRequest {
            agent_id: "a1".into(),
            hostname: "h".into(),
            address: "127.0.0.1:1".into(),
            total: Some(pb::Resources {
                cpus: 2.0,
                mem_mib: 1024,
                gpus: 1,
                ports: 0,
            }),
            gpus: vec![pb::Gpu {
                uuid: "GPU-0".into(),
                ..Default::default()
            }],
            runtimes: vec![pb::Runtime::Process as i32],
            ..Default::default()
        }
    }

    #[test]
    fn agent_info_round_trips_through_its_registration() {
        let mut r = register_request();
        r.attributes = [("gpu.family".to_string(), "hopper".to_string())].into();
        r.driver_version = "550.54".into();
        r.allow_root_tasks = true;
        r.allowed_mounts = vec!["/data".into(), "/".into()];
        let info = AgentInfo::try_from(r).unwrap();
        assert!(info.allow_root_tasks);
        assert_eq!(info.allowed_mounts, ["/data", "/"]);
        let back = AgentInfo::try_from(pb::RegisterRequest::from(info.clone())).unwrap();
        assert_eq!(back, info);
        assert_eq!(back.driver_version.as_deref(), Some("550.54"));
        assert_eq!(back.cuda_driver_version, None);
    }

    fn register(r: pb::RegisterRequest) -> Result<()> {
        AgentInfo::try_from(r).map(|_| ())
    }

    fn gpus(n: usize) -> Vec<pb::Gpu> {
        (0..n)
            .map(|i| pb::Gpu {
                uuid: format!("GPU-{i}"),
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn mig_jobs_name_a_profile_and_get_one_device() {
        let base = pb::JobSpec {
            name: "m".into(),
            command: vec!["true".into()],
            resources: Some(pb::Resources {
                gpus: 1,
                ..Default::default()
            }),
            placement: Some(pb::Placement {
                mig: "1g.10gb".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        for good in [
            "1g.10gb",
            "7g.80gb",
            "1g.10gb+me",
            "1g.23gb-me",
            "1c.3g.40gb",
        ] {
            let mut s = base.clone();
            s.placement.as_mut().unwrap().mig = good.into();
            if let Err(e) = job(s) {
                panic!("{good}: {e}");
            }
        }
        let spec = JobSpec::try_from(base.clone()).unwrap();
        assert_eq!(spec.placement.mig.as_deref(), Some("1g.10gb"));
        assert_eq!(
            JobSpec::try_from(pb::JobSpec::from(spec.clone())).unwrap(),
            spec
        );
        boundary(
            &base,
            |s| s.resources.as_mut().unwrap().gpus = 1,
            |s| s.resources.as_mut().unwrap().gpus = 2,
            "spec.resources.gpus",
            job,
        );
        boundary(
            &base,
            |s| s.resources.as_mut().unwrap().gpus = 1,
            |s| s.resources.as_mut().unwrap().gpus = 0,
            "spec.resources.gpus",
            job,
        );
        for bad in [
            "10gb",
            "1g 10gb",
            "g.10gb",
            "1g/10gb",
            "1g.10gb\n",
            "1g.gb",
            "1g.10",
            "+me",
        ] {
            let mut s = base.clone();
            s.placement.as_mut().unwrap().mig = bad.into();
            let err = job(s).expect_err(bad);
            assert_eq!(err.field, "spec.placement.mig", "{bad}: {err}");
        }
        boundary(
            &base,
            |s| {
                s.placement.as_mut().unwrap().mig =
                    format!("1g.{}gb", "1".repeat(MAX_MIG_PROFILE_LEN - 5))
            },
            |s| {
                s.placement.as_mut().unwrap().mig =
                    format!("1g.{}gb", "1".repeat(MAX_MIG_PROFILE_LEN - 4))
            },
            "spec.placement.mig",
            job,
        );
    }

    #[test]
    fn a_fraction_asks_memory_of_one_shared_gpu_not_gpus() {
        let base = pb::JobSpec {
            name: "f".into(),
            command: vec!["true".into()],
            placement: Some(pb::Placement {
                gpu_mem_mib: 10240,
                gpu_compute_pct: 25,
                ..Default::default()
            }),
            ..Default::default()
        };
        let spec = JobSpec::try_from(base.clone()).unwrap();
        assert_eq!(
            spec.placement.fraction,
            Some(GpuFraction {
                mem_mib: 10240,
                compute_pct: 25
            })
        );
        assert_eq!(
            JobSpec::try_from(pb::JobSpec::from(spec.clone())).unwrap(),
            spec
        );
        boundary(
            &base,
            |_| {},
            |s| {
                s.resources = Some(pb::Resources {
                    gpus: 1,
                    ..Default::default()
                })
            },
            "spec.resources.gpus",
            job,
        );
        boundary(
            &base,
            |s| s.placement.as_mut().unwrap().gpu_compute_pct = 100,
            |s| s.placement.as_mut().unwrap().gpu_compute_pct = 101,
            "spec.placement.gpu_compute_pct",
            job,
        );
        boundary(
            &base,
            |s| s.placement.as_mut().unwrap().gpu_mem_mib = MAX_MEM_MIB,
            |s| s.placement.as_mut().unwrap().gpu_mem_mib = MAX_MEM_MIB + 1,
            "spec.placement.gpu_mem_mib",
            job,
        );
        boundary(
            &base,
            |_| {},
            |s| s.placement.as_mut().unwrap().gpu_mem_mib = 0,
            "spec.placement.gpu_compute_pct",
            job,
        );
        boundary(
            &base,
            |_| {},
            |s| s.placement.as_mut().unwrap().mig = "1g.10gb".into(),
            "spec.placement.gpu_mem_mib",
            job,
        );
    }

    #[test]
    fn an_agent_counts_its_mig_devices_and_names_each_once() {
        let dev = |uuid: &str| pb::MigDevice {
            uuid: uuid.into(),
            profile: "1g.10gb".into(),
            ..Default::default()
        };
        let mut base = register_request();
        base.gpus = vec![
            pb::Gpu {
                uuid: "GPU-0".into(),
                mig: Some(pb::MigInfo {
                    enabled: true,
                    devices: vec![dev("MIG-0"), dev("MIG-1")],
                    ..Default::default()
                }),
                ..Default::default()
            },
            pb::Gpu {
                uuid: "GPU-1".into(),
                ..Default::default()
            },
        ];
        // Two MIG devices and one whole GPU; GPU-0 is not given whole.
        boundary(
            &base,
            |r| r.total.as_mut().unwrap().gpus = 3,
            |r| r.total.as_mut().unwrap().gpus = 2,
            "total.gpus",
            register,
        );
        base.total.as_mut().unwrap().gpus = 3;
        boundary(
            &base,
            |_| {},
            |r| {
                r.gpus[1].mig = Some(pb::MigInfo {
                    enabled: true,
                    devices: vec![dev("MIG-1")],
                    ..Default::default()
                })
            },
            "gpus[1].mig.devices[0].uuid",
            register,
        );
    }

    #[test]
    fn an_agents_share_default_is_a_mode_or_nothing() {
        let mut r = register_request();
        r.share_gpus = "mps".into();
        let info = AgentInfo::try_from(r.clone()).unwrap();
        assert_eq!(info.share_gpus, Some(ShareMode::Mps));
        assert_eq!(pb::RegisterRequest::from(info).share_gpus, "mps");
        r.share_gpus = "half".into();
        assert_eq!(AgentInfo::try_from(r).unwrap_err().field, "share_gpus");
        assert_eq!(
            AgentInfo::try_from(register_request()).unwrap().share_gpus,
            None
        );
    }

    #[test]
    fn register_limits_pass_at_and_fail_past() {
        let base = register_request();
        let n = |r: &mut pb::RegisterRequest, count: usize| {
            r.gpus = gpus(count);
            r.total.as_mut().unwrap().gpus = count as u32;
        };
        boundary(
            &base,
            |r| n(r, MAX_AGENT_GPUS),
            |r| n(r, MAX_AGENT_GPUS + 1),
            "gpus",
            register,
        );
        let ports = |r: &mut pb::RegisterRequest, start: u32, end: u32, total: u32| {
            r.ports = Some(pb::PortRange { start, end });
            r.total.as_mut().unwrap().ports = total;
        };
        boundary(
            &base,
            |r| ports(r, 31000, 32000, 1001),
            |r| ports(r, 31000, 32000, 1000),
            "total.ports",
            register,
        );
        boundary(
            &base,
            |r| ports(r, 1, 65535, 65535),
            |r| ports(r, 0, 65535, 65536),
            "ports.start",
            register,
        );
        boundary(
            &base,
            |r| ports(r, 9, 9, 1),
            |r| ports(r, 9, 65536, 65528),
            "ports.end",
            register,
        );
        boundary(
            &base,
            |r| ports(r, 9, 9, 1),
            |r| ports(r, 10, 9, 0),
            "ports",
            register,
        );
        boundary(
            &base,
            |r| r.total.as_mut().unwrap().ports = 0,
            |r| r.total.as_mut().unwrap().ports = 5,
            "total.ports",
            register,
        );
        boundary(
            &base,
            |r| r.allowed_mounts = vec!["/data".into(); MAX_ALLOWED_MOUNTS],
            |r| r.allowed_mounts = vec!["/data".into(); MAX_ALLOWED_MOUNTS + 1],
            "allowed_mounts",
            register,
        );
        boundary(
            &base,
            |r| r.allowed_mounts = vec!["/a".into(), "/data".into()],
            |r| r.allowed_mounts = vec!["/a".into(), "data/../x".into()],
            "allowed_mounts[1]",
            register,
        );
        boundary(
            &base,
            |r| r.hostname = "h".repeat(MAX_HOSTNAME_LEN),
            |r| r.hostname = "h".repeat(MAX_HOSTNAME_LEN + 1),
            "hostname",
            register,
        );
        boundary(
            &base,
            |r| r.hostname = "h-1.example".into(),
            |r| r.hostname = "a,b".into(),
            "hostname",
            register,
        );
        boundary(
            &base,
            |r| r.address = "a".repeat(MAX_ADDRESS_LEN),
            |r| r.address = "a".repeat(MAX_ADDRESS_LEN + 1),
            "address",
            register,
        );
        boundary(
            &base,
            |r| {
                r.attributes = (0..MAX_AGENT_ATTRIBUTES)
                    .map(|i| (format!("k{i}"), "v".into()))
                    .collect()
            },
            |r| {
                r.attributes = (0..=MAX_AGENT_ATTRIBUTES)
                    .map(|i| (format!("k{i}"), "v".into()))
                    .collect()
            },
            "attributes",
            register,
        );
        boundary(
            &base,
            |r| r.attributes = [("k".repeat(MAX_ATTR_LEN), "v".into())].into(),
            |r| r.attributes = [("k".repeat(MAX_ATTR_LEN + 1), "v".into())].into(),
            "attributes",
            register,
        );
        boundary(
            &base,
            |r| r.attributes = [("zone".into(), "v".repeat(MAX_ATTR_VALUE_LEN))].into(),
            |r| r.attributes = [("zone".into(), "v".repeat(MAX_ATTR_VALUE_LEN + 1))].into(),
            "attributes[\"zone\"]",
            register,
        );
        boundary(
            &base,
            |r| r.gpus[0].model = "m".repeat(MAX_ATTR_LEN),
            |r| r.gpus[0].model = "m".repeat(MAX_ATTR_LEN + 1),
            "gpus[0].model",
            register,
        );
        boundary(
            &base,
            |r| r.gpus[0].unhealthy_reason = "r".repeat(MAX_REASON_LEN),
            |r| r.gpus[0].unhealthy_reason = "r".repeat(MAX_REASON_LEN + 1),
            "gpus[0].unhealthy_reason",
            register,
        );
        let peer = |u: &str| pb::GpuPeer {
            uuid: u.into(),
            nvlinks: 1,
            pcie: "SYS".into(),
        };
        // The most GPUs, each the peer of every other.
        let mesh = |r: &mut pb::RegisterRequest| {
            n(r, MAX_AGENT_GPUS);
            for i in 0..MAX_AGENT_GPUS {
                r.gpus[i].peers = (0..MAX_AGENT_GPUS)
                    .filter(|j| *j != i)
                    .map(|j| peer(&format!("GPU-{j}")))
                    .collect();
            }
        };
        boundary(
            &base,
            mesh,
            |r| {
                mesh(r);
                r.gpus[0].peers = vec![peer("GPU-1"); MAX_AGENT_GPUS + 1];
            },
            "gpus[0].peers",
            register,
        );
        boundary(
            &base,
            mesh,
            |r| {
                mesh(r);
                r.gpus[3].peers[5] = peer("GPU-1");
            },
            "gpus[3].peers[5].uuid",
            register,
        );
        boundary(
            &base,
            mesh,
            |r| {
                mesh(r);
                r.gpus[2].peers[0] = peer("GPU-2");
            },
            "gpus[2].peers[0].uuid",
            register,
        );
        boundary(
            &base,
            mesh,
            |r| {
                mesh(r);
                r.gpus[2].peers[0].pcie = "P".repeat(MAX_PCIE_LEN + 1);
            },
            "gpus[2].peers[0].pcie",
            register,
        );
        boundary(
            &base,
            |r| r.gpus[0].uuid = "G".repeat(MAX_GPU_UUID_LEN),
            |r| r.gpus[0].uuid = "G".repeat(MAX_GPU_UUID_LEN + 1),
            "gpus[0].uuid",
            register,
        );
        boundary(
            &base,
            |r| r.driver_version = "5".repeat(MAX_ATTR_LEN),
            |r| r.driver_version = "5".repeat(MAX_ATTR_LEN + 1),
            "driver_version",
            register,
        );
        boundary(
            &base,
            |r| r.total.as_mut().unwrap().mem_mib = MAX_MEM_MIB,
            |r| r.total.as_mut().unwrap().mem_mib = u64::MAX,
            "total.mem_mib",
            register,
        );
        boundary(
            &base,
            |r| r.running_task_ids = vec!["t".repeat(2 * MAX_NAME_LEN + 1)],
            |r| r.running_task_ids = vec!["t".into(), "t".repeat(2 * MAX_NAME_LEN + 2)],
            "running_task_ids[1]",
            register,
        );
        boundary(
            &base,
            |r| r.running_task_ids = vec!["t".into(); MAX_AGENT_TASKS],
            |r| r.running_task_ids = vec!["t".into(); MAX_AGENT_TASKS + 1],
            "running_task_ids",
            register,
        );
        boundary(
            &base,
            |r| r.runtimes = vec![pb::Runtime::Process as i32; MAX_AGENT_RUNTIMES],
            |r| r.runtimes = vec![pb::Runtime::Process as i32; MAX_AGENT_RUNTIMES + 1],
            "runtimes",
            register,
        );
    }

    #[test]
    fn payload_check_names_fields_under_its_prefix() {
        let env: BTreeMap<String, String> =
            [("FOO".to_string(), "v".repeat(MAX_ENV_VALUE_BYTES + 1))].into();
        let err = check_payload("operations[0].tasks[1]", "", &["true".into()], &env).unwrap_err();
        assert_eq!(err.field, "operations[0].tasks[1].env[\"FOO\"]");
        let err = check_payload("p", "bad image", &["true".into()], &BTreeMap::new()).unwrap_err();
        assert_eq!(err.field, "p.image");
        let err = check_payload("p", "", &[], &BTreeMap::new()).unwrap_err();
        assert_eq!(err.field, "p.command");
        assert!(check_payload("p", "busybox", &["true".into()], &BTreeMap::new()).is_ok());
    }

    #[test]
    fn too_many_env_variables_are_refused_before_they_are_read() {
        // Every name is bad and the image too: the count alone answers,
        // before a million variables would be sorted and read.
        let env: std::collections::HashMap<String, String> = (0..=MAX_ENV_VARS)
            .map(|i| (format!("V={i}"), String::new()))
            .collect();
        let spec = pb::JobSpec {
            name: "j".into(),
            image: "bad image".into(),
            command: vec!["true".into()],
            env: env.clone(),
            ..Default::default()
        };
        let err = JobSpec::try_from(spec).unwrap_err();
        assert_eq!(err.field, "spec.env");
        assert!(err.to_string().contains("has 1025 variables"), "{err}");
        let task = pb::TaskInfo {
            task_id: "t".into(),
            agent_id: "a".into(),
            image: "bad image".into(),
            command: vec!["true".into()],
            env,
            ..Default::default()
        };
        let err = framework_task_from_pb("operations[0].tasks[0]", task).unwrap_err();
        assert_eq!(err.field, "operations[0].tasks[0].env");
    }

    #[test]
    fn task_specs_from_the_master_are_checked_for_shape_not_size() {
        // A job's env at its limit, plus the GPUCTL_* variables the master
        // adds: the agent must take it.
        let env = (0..MAX_ENV_VARS + 3)
            .map(|i| (format!("V{i}"), String::new()))
            .collect();
        let t = pb::TaskSpec {
            task_id: "job-1.0".into(),
            job_id: "job-1".into(),
            command: vec!["true".into()],
            env,
            ..Default::default()
        };
        assert!(TaskSpec::try_from(t.clone()).is_ok());
        let mut bad = t;
        bad.env.insert("A=B".into(), String::new());
        assert_eq!(
            TaskSpec::try_from(bad).unwrap_err().field,
            "task.env[\"A=B\"]"
        );
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
            enforcement: String::new(),
            agent_id: "a1".into(),
            task_id: "job-1.0".into(),
            state: state as i32,
            exit_code: None,
            message: "no leader for 75s".into(),
            uuid: b"u".to_vec(),
            reason: reason as i32,
            latest_state: 0,
            requires: Vec::new(),
        }
    }

    #[test]
    fn driver_refusals_carry_the_image_requirements() {
        let mut wire = update(
            pb::TaskState::TaskFailed,
            pb::Reason::DriverRequirementUnmet,
        );
        wire.requires = vec!["cuda>=12.2 brand=tesla,driver>=470,driver<471".into()];
        let u = StatusUpdate::try_from(wire.clone()).unwrap();
        assert_eq!(u.requires, wire.requires);
        assert_eq!(pb::StatusUpdate::from(u), wire);
        // The reason without requirements, requirements without the
        // reason, another state, too many: refused, naming the field.
        let mut bad = wire.clone();
        bad.requires.clear();
        assert_eq!(StatusUpdate::try_from(bad).unwrap_err().field, "requires");
        let mut bad = wire.clone();
        bad.reason = pb::Reason::Unspecified as i32;
        assert_eq!(StatusUpdate::try_from(bad).unwrap_err().field, "requires");
        let mut bad = wire.clone();
        bad.state = pb::TaskState::TaskKilled as i32;
        assert_eq!(StatusUpdate::try_from(bad).unwrap_err().field, "reason");
        let mut bad = wire.clone();
        bad.requires = vec!["cuda>=1".into(); crate::cuda_req::MAX_EXPRS + 1];
        assert_eq!(StatusUpdate::try_from(bad).unwrap_err().field, "requires");
        let mut bad = wire;
        bad.requires = vec!["cuda>=1\n".into()];
        assert_eq!(
            StatusUpdate::try_from(bad).unwrap_err().field,
            "requires[0]"
        );
    }

    #[test]
    fn require_cuda_is_checked_at_submit() {
        let spec = |require_cuda: &str| pb::JobSpec {
            name: "j".into(),
            command: vec!["true".into()],
            resources: Some(pb::Resources {
                cpus: 1.0,
                mem_mib: 0,
                gpus: 0,
                ports: 0,
            }),
            require_cuda: require_cuda.into(),
            ..Default::default()
        };
        let ok = JobSpec::try_from(spec("cuda>=12.2 driver>=470,driver<471")).unwrap();
        assert_eq!(
            ok.require_cuda.as_ref().map(|e| e.text()),
            Some("cuda>=12.2 driver>=470,driver<471")
        );
        assert_eq!(
            pb::JobSpec::from(ok).require_cuda,
            "cuda>=12.2 driver>=470,driver<471"
        );
        assert_eq!(JobSpec::try_from(spec("  ")).unwrap().require_cuda, None);
        for (bad, why) in [
            ("cuda>=twelve", "not a version"),
            ("cudnn>=8", "unknown key"),
            ("cuda=>12", "unknown operator"),
            (",", "has no condition"),
            ("cuda>=12\tdriver>=1", "contains"),
        ] {
            let err = JobSpec::try_from(spec(bad)).unwrap_err();
            assert_eq!(err.field, "spec.require_cuda", "{bad}");
            assert!(err.reason.contains(why), "{bad}: {err}");
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

    #[test]
    fn gpu_reports_carry_task_memory_and_bound_it() {
        let wire = pb::GpuReport {
            uuid: "GPU-1".into(),
            healthy: true,
            unhealthy_reason: String::new(),
            sample: Some(pb::GpuSample {
                memory_used_mib: 3000,
                task_memory_used_mib: [("job-1.0".to_string(), 1024), ("job-2.0".into(), 512)]
                    .into(),
                ..Default::default()
            }),
        };
        let r = GpuReport::try_from(wire.clone()).unwrap();
        let s = r.sample.clone().unwrap();
        assert_eq!(s.task_memory_used_mib["job-1.0"], 1024);
        assert_eq!(s.task_memory_used_mib.len(), 2);
        assert_eq!(pb::GpuReport::from(r), wire);
        let with_tasks = |tasks: Vec<(String, u64)>| {
            let mut w = wire.clone();
            if let Some(s) = w.sample.as_mut() {
                s.task_memory_used_mib = tasks.into_iter().collect();
            }
            GpuReport::try_from(w).map_err(|e| e.field)
        };
        let many = |n: usize| (0..n).map(|i| (format!("t{i}"), 1)).collect::<Vec<_>>();
        assert!(with_tasks(many(MAX_SAMPLE_TASKS)).is_ok());
        assert_eq!(
            with_tasks(many(MAX_SAMPLE_TASKS + 1)).unwrap_err(),
            "gpus.sample.task_memory_used_mib"
        );
        assert_eq!(
            with_tasks(vec![("bad id".into(), 1)]).unwrap_err(),
            "gpus.sample.task_memory_used_mib"
        );
    }

    type Mutate<T> = fn(&mut T);

    fn framework_task() -> pb::TaskInfo {
        pb::TaskInfo {
            task_id: "t1".into(),
            agent_id: "a1".into(),
            command: vec!["true".into()],
            resources: Some(pb::Resources {
                cpus: 1.0,
                mem_mib: 64,
                gpus: 0,
                ports: 0,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn framework_tasks_are_checked_like_jobs() {
        let field = "operations[0].tasks[1]";
        let convert = |t| framework_task_from_pb("operations[0].tasks[1]", t).map(|_| ());
        // The same limits as a job's, at the limit and one past it.
        boundary(
            &framework_task(),
            |t| t.env = [("FOO".into(), "v".repeat(MAX_ENV_VALUE_BYTES))].into(),
            |t| t.env = [("FOO".into(), "v".repeat(MAX_ENV_VALUE_BYTES + 1))].into(),
            &format!("{field}.env[\"FOO\"]"),
            convert,
        );
        boundary(
            &framework_task(),
            |t| t.command = vec!["a".into(); MAX_COMMAND_ARGS],
            |t| t.command = vec!["a".into(); MAX_COMMAND_ARGS + 1],
            &format!("{field}.command"),
            convert,
        );
        let cases: Vec<(Mutate<pb::TaskInfo>, &str)> = vec![
            (|t| t.image = "bad image".into(), "image"),
            (|t| t.command.clear(), "command"),
            (|t| t.command = vec!["a\0".into()], "command[0]"),
            (
                |t| t.env = [("A=B".into(), "x".into())].into(),
                "env[\"A=B\"]",
            ),
            (|t| t.task_id = "../x".into(), "task_id"),
            (|t| t.agent_id = String::new(), "agent_id"),
            (
                |t| {
                    if let Some(r) = t.resources.as_mut() {
                        r.mem_mib = u64::MAX;
                    }
                },
                "resources.mem_mib",
            ),
            (|t| t.gpu_uuids = vec!["GPU-0".into()], "gpu_uuids"),
            (
                |t| {
                    t.gpu_uuids = vec!["GPU 0".into()];
                    if let Some(r) = t.resources.as_mut() {
                        r.gpus = 1;
                    }
                },
                "gpu_uuids[0]",
            ),
            // The same GPU twice: the second is named.
            (
                |t| {
                    t.gpu_uuids = vec!["GPU-0".into(), "GPU-0".into()];
                    if let Some(r) = t.resources.as_mut() {
                        r.gpus = 2;
                    }
                },
                "gpu_uuids[1]",
            ),
        ];
        for (mutate, sub) in cases {
            let mut t = framework_task();
            mutate(&mut t);
            let err = framework_task_from_pb(field, t).expect_err(sub);
            assert_eq!(err.field, format!("{field}.{sub}"), "{err}");
        }
        let ok = framework_task_from_pb(field, framework_task()).unwrap();
        assert_eq!((ok.image, ok.command), (None, vec!["true".to_string()]));
    }

    /// Issue 34: a framework's task may ask a fraction of one shared GPU
    /// instead of GPUs; it names the GPU there, and bad input names the
    /// field.
    #[test]
    fn a_framework_task_asks_a_fraction_of_a_named_shared_gpu() {
        let field = "operations[0].tasks[1]";
        let with = |mem_mib, compute_pct| {
            let mut t = framework_task();
            t.gpu_fraction = Some(pb::GpuFraction {
                gpu_uuid: "GPU-0".into(),
                mem_mib,
                compute_pct,
            });
            t
        };
        let ok = framework_task_from_pb(field, with(10240, 25)).unwrap();
        assert_eq!(ok.gpu_uuids, vec!["GPU-0".to_string()]);
        assert_eq!(
            ok.fraction,
            Some(GpuFraction {
                mem_mib: 10240,
                compute_pct: 25
            })
        );
        assert_eq!(ok.resources.gpus, 0);
        assert_eq!(
            framework_task_from_pb(field, framework_task())
                .unwrap()
                .fraction,
            None
        );
        boundary(
            &with(MAX_MEM_MIB, 100),
            |_| {},
            |t| t.gpu_fraction.as_mut().unwrap().compute_pct = 101,
            &format!("{field}.gpu_fraction.compute_pct"),
            |t| framework_task_from_pb(field, t).map(|_| ()),
        );
        let cases: Vec<(Mutate<pb::TaskInfo>, &str)> = vec![
            (
                |t| t.gpu_fraction.as_mut().unwrap().mem_mib = 0,
                "gpu_fraction.mem_mib",
            ),
            (
                |t| t.gpu_fraction.as_mut().unwrap().mem_mib = MAX_MEM_MIB + 1,
                "gpu_fraction.mem_mib",
            ),
            (
                |t| t.gpu_fraction.as_mut().unwrap().gpu_uuid = String::new(),
                "gpu_fraction.gpu_uuid",
            ),
            (
                |t| t.gpu_fraction.as_mut().unwrap().gpu_uuid = "GPU 0/..".into(),
                "gpu_fraction.gpu_uuid",
            ),
            // A fraction is not a device: no GPUs beside it.
            (
                |t| {
                    t.gpu_uuids = vec!["GPU-1".into()];
                    if let Some(r) = t.resources.as_mut() {
                        r.gpus = 1;
                    }
                },
                "resources.gpus",
            ),
            (|t| t.gpu_uuids = vec!["GPU-0".into()], "gpu_uuids"),
        ];
        for (mutate, sub) in cases {
            let mut t = with(1024, 0);
            mutate(&mut t);
            let err = framework_task_from_pb(field, t).expect_err(sub);
            assert_eq!(err.field, format!("{field}.{sub}"), "{err}");
        }
    }

    #[test]
    fn framework_info_is_checked() {
        let info = || pb::FrameworkInfo {
            name: "trainer".into(),
            roles: vec!["research".into()],
            failover_timeout_secs: 60.0,
            capabilities: vec![pb::FrameworkCapability::GpuResources as i32],
            ..Default::default()
        };
        let ok = framework_info_from_pb(Some(info())).unwrap();
        assert!(ok.gpu_capable);
        assert_eq!(ok.failover_timeout_ms, 60_000);
        assert_eq!(framework_info_from_pb(None).unwrap_err().field, "framework");
        let cases: Vec<(Mutate<pb::FrameworkInfo>, &str)> = vec![
            (|f| f.id = BUILTIN_FRAMEWORK_ID.into(), "framework.id"),
            (|f| f.id = "a/b".into(), "framework.id"),
            (|f| f.name = " ".into(), "framework.name"),
            (
                |f| f.name = "n".repeat(MAX_FRAMEWORK_NAME + 1),
                "framework.name",
            ),
            (|f| f.roles = vec!["".into()], "framework.roles[]"),
            (
                |f| f.failover_timeout_secs = f64::NAN,
                "framework.failover_timeout_secs",
            ),
            (
                |f| f.failover_timeout_secs = MAX_FAILOVER_SECS + 1.0,
                "framework.failover_timeout_secs",
            ),
        ];
        for (mutate, field) in cases {
            let mut f = info();
            mutate(&mut f);
            assert_eq!(framework_info_from_pb(Some(f)).unwrap_err().field, field);
        }
    }

    #[test]
    fn drain_deadlines_are_checked() {
        assert_eq!(drain_deadline(1_000, None), Ok(None));
        assert_eq!(drain_deadline(1_000, Some(0.0)), Ok(Some(1_000)));
        assert_eq!(drain_deadline(1_000, Some(2.5)), Ok(Some(3_500)));
        for bad in [-1.0, f64::INFINITY, f64::NAN, MAX_DRAIN_DEADLINE_SECS * 2.0] {
            assert_eq!(
                drain_deadline(0, Some(bad)).unwrap_err().field,
                "deadline_secs"
            );
        }
    }

    #[test]
    fn task_reasons_have_their_wire_names() {
        assert_eq!(pb::Reason::from(TaskReason::Fenced), pb::Reason::Fenced);
        assert_eq!(
            pb::Reason::from(TaskReason::AgentDrained),
            pb::Reason::AgentDraining
        );
        assert_eq!(
            pb::Reason::from(TaskReason::default()),
            pb::Reason::Unspecified
        );
    }
}
