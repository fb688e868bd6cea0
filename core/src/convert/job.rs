//! Jobs and tasks: resources, command, env, image, security, placement,
//! ports, and the specs themselves.

use std::collections::BTreeMap;

use super::*;
use crate::pb;
use crate::types::*;

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
pub(super) fn check_command_shape(field: &str, command: &[String]) -> Result<()> {
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

pub(super) fn check_command_size(field: &str, command: &[String]) -> Result<()> {
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
pub(super) fn check_env_shape(field: &str, env: &BTreeMap<String, String>) -> Result<()> {
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
pub(super) fn check_env_count(field: &str, n: usize) -> Result<()> {
    if n > MAX_ENV_VARS {
        return Err(ConvertError::new(
            field,
            format!("has {n} variables, at most {MAX_ENV_VARS}"),
        ));
    }
    Ok(())
}

pub(super) fn check_env_size(field: &str, env: &BTreeMap<String, String>) -> Result<()> {
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

pub(super) fn check_image(field: &str, image: &str) -> Result<()> {
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

pub(super) fn security_from_pb(s: Option<pb::TaskSecurity>) -> TaskSecurity {
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

pub(super) fn security_to_pb(s: TaskSecurity) -> Option<pb::TaskSecurity> {
    (!s.is_default()).then(|| s.into())
}

/// A task template's fields as the wire carries them: `pb::JobSpec` and
/// `pb::TaskSpec` declare each under the same name and type. The wire stays
/// flat (a nested message would not read on older masters and agents), so
/// these two macros are the one place that lists them; a field added to
/// [`TaskTemplate`] but to only one message does not compile.
pub(super) struct WireTemplate {
    image: String,
    command: Vec<String>,
    env: std::collections::HashMap<String, String>,
    resources: Option<pb::Resources>,
    no_fence: bool,
    security: Option<pb::TaskSecurity>,
    stop_grace_ms: Option<u64>,
    checkpoint_dir: String,
    hang_timeout_ms: Option<u64>,
    preflight: bool,
}

/// Moves the template's fields out of a `pb::JobSpec` or `pb::TaskSpec`
/// (the rest of it stays usable).
macro_rules! wire_template {
    ($s:ident) => {
        WireTemplate {
            image: $s.image,
            command: $s.command,
            env: $s.env,
            resources: $s.resources,
            no_fence: $s.no_fence,
            security: $s.security,
            stop_grace_ms: $s.stop_grace_ms,
            checkpoint_dir: $s.checkpoint_dir,
            hang_timeout_ms: $s.hang_timeout_ms,
            preflight: $s.preflight,
        }
    };
}

/// A `pb::JobSpec` or `pb::TaskSpec` of a template and the message's own
/// fields.
macro_rules! with_template {
    ($msg:path, $t:expr, { $($field:ident: $value:expr),* $(,)? }) => {{
        let w = WireTemplate::from($t);
        $msg {
            image: w.image,
            command: w.command,
            env: w.env,
            resources: w.resources,
            no_fence: w.no_fence,
            security: w.security,
            stop_grace_ms: w.stop_grace_ms,
            checkpoint_dir: w.checkpoint_dir,
            hang_timeout_ms: w.hang_timeout_ms,
            preflight: w.preflight,
            $($field: $value),*
        }
    }};
}

impl From<TaskTemplate> for WireTemplate {
    fn from(t: TaskTemplate) -> Self {
        WireTemplate {
            image: t.image.unwrap_or_default(),
            command: t.command,
            env: t.env.into_iter().collect(),
            resources: Some(t.resources.into()),
            no_fence: t.no_fence,
            security: security_to_pb(t.security),
            stop_grace_ms: t.stop_grace_ms,
            checkpoint_dir: t.checkpoint_dir.unwrap_or_default(),
            hang_timeout_ms: t.hang_timeout_ms,
            preflight: t.preflight,
        }
    }
}

/// How much a template is checked as it is read.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Checks {
    /// Entering the cluster: shape and every size limit.
    Submitted,
    /// A task from the master: shape only (its job's were checked on
    /// submit; the master adds env, and jobs submitted before a limit may
    /// exceed it; the message is bounded by the gRPC limit).
    Shape,
}

impl WireTemplate {
    /// The domain template, its fields named under `prefix` (`spec`,
    /// `task`).
    pub(super) fn check(self, prefix: &str, checks: Checks) -> Result<TaskTemplate> {
        let env: BTreeMap<String, String> = match checks {
            Checks::Submitted => {
                check_env_count(&format!("{prefix}.env"), self.env.len())?;
                let env = self.env.into_iter().collect();
                check_payload(prefix, &self.image, &self.command, &env)?;
                env
            }
            Checks::Shape => {
                if !self.image.is_empty() {
                    check_image(&format!("{prefix}.image"), &self.image)?;
                }
                check_command_shape(&format!("{prefix}.command"), &self.command)?;
                let env = self.env.into_iter().collect();
                check_env_shape(&format!("{prefix}.env"), &env)?;
                env
            }
        };
        let image = (!self.image.is_empty()).then_some(self.image);
        let resources = resources_from_pb(&format!("{prefix}.resources"), self.resources)?;
        let security = security_from_pb(self.security);
        let runtime = if image.is_some() {
            Runtime::Docker
        } else {
            Runtime::Process
        };
        check_security(prefix, &security, runtime)?;
        Ok(TaskTemplate {
            image,
            command: self.command,
            env,
            resources,
            no_fence: self.no_fence,
            security,
            stop_grace_ms: check_stop_grace(
                &format!("{prefix}.stop_grace_ms"),
                self.stop_grace_ms,
            )?,
            checkpoint_dir: checkpoint_dir_from_pb(
                &format!("{prefix}.checkpoint_dir"),
                self.checkpoint_dir,
            )?,
            hang_timeout_ms: check_hang_timeout(
                &format!("{prefix}.hang_timeout_ms"),
                self.hang_timeout_ms,
            )?,
            preflight: self.preflight,
        })
    }
}

impl TryFrom<pb::JobSpec> for JobSpec {
    type Error = ConvertError;
    fn try_from(s: pb::JobSpec) -> Result<Self> {
        check_id("spec.name", &s.name)?;
        let mut template = wire_template!(s).check("spec", Checks::Submitted)?;
        let resources = &mut template.resources;
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
        // MIN of `--replicas MIN:MAX`: 1 up to MAX; MAX itself is no
        // elasticity.
        let min_replicas = match s.min_replicas {
            0 => None,
            m if m > replicas => {
                return Err(ConvertError::new(
                    "spec.min_replicas",
                    format!("is {m}, more than spec.replicas ({replicas})"),
                ))
            }
            m if m == replicas => None,
            m => Some(m),
        };
        let restart_policy: RestartPolicy = s
            .restart_policy
            .parse()
            .map_err(|e: String| ConvertError::new("spec.restart_policy", e))?;
        if restart_policy == RestartPolicy::Never && s.max_retries > 0 {
            return Err(ConvertError::new(
                "spec.max_retries",
                format!(
                    "is {}, but spec.restart_policy never restarts a job (leave one out)",
                    s.max_retries
                ),
            ));
        }
        let restart_backoff_ms = match s.restart_backoff_ms {
            Some(ms) if ms > MAX_FIRST_RESTART_BACKOFF_MS => {
                return Err(ConvertError::new(
                    "spec.restart_backoff_ms",
                    format!("is {ms} ms: at most {MAX_FIRST_RESTART_BACKOFF_MS} (an hour)"),
                ))
            }
            other => other,
        };
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
            if !template.env.contains_key(&k) {
                return Err(ConvertError::new(
                    format!("spec.secret_env[{i}]"),
                    format!("{:?} is not a variable of spec.env", cut(&k, 64)),
                ));
            }
            secret_env.insert(k);
        }
        let require_cuda = require_cuda_from_pb(&s.require_cuda)?;
        Ok(JobSpec {
            name: s.name,
            template,
            placement,
            priority: s.priority,
            replicas,
            max_retries: s.max_retries,
            no_requeue: s.no_requeue,
            tenant: Tenant::new(s.tenant),
            // The master's to set, from the caller's token.
            submitted_by: String::new(),
            secret_env,
            require_cuda,
            min_replicas,
            restart_policy,
            restart_backoff_ms,
        })
    }
}

/// A stop grace: at most [`MAX_STOP_GRACE_MS`].
pub(super) fn check_stop_grace(field: &str, ms: Option<u64>) -> Result<Option<u64>> {
    match ms {
        Some(ms) if ms > MAX_STOP_GRACE_MS => Err(ConvertError::new(
            field,
            format!("is {ms} ms, at most {MAX_STOP_GRACE_MS} (a day)"),
        )),
        _ => Ok(ms),
    }
}

/// A hang timeout: between [`MIN_HANG_TIMEOUT_MS`] and
/// [`MAX_HANG_TIMEOUT_MS`].
pub(super) fn check_hang_timeout(field: &str, ms: Option<u64>) -> Result<Option<u64>> {
    match ms {
        Some(ms) if !(MIN_HANG_TIMEOUT_MS..=MAX_HANG_TIMEOUT_MS).contains(&ms) => {
            Err(ConvertError::new(
                field,
                format!(
                    "is {ms} ms: between {MIN_HANG_TIMEOUT_MS} (a second) and {MAX_HANG_TIMEOUT_MS} (a week)"
                ),
            ))
        }
        _ => Ok(ms),
    }
}

/// A checkpoint directory: "" is none, else a plain absolute path other
/// than `/` (the agent bind-mounts it and may create it).
pub(super) fn checkpoint_dir_from_pb(field: &str, p: String) -> Result<Option<String>> {
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
pub(super) fn check_task_ports(field: &str, ports: u32) -> Result<()> {
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
pub(super) fn port_range_from_pb(
    r: Option<pb::PortRange>,
    total: u32,
) -> Result<Option<PortRange>> {
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
pub(super) fn require_cuda_from_pb(text: &str) -> Result<Option<crate::cuda_req::Expr>> {
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

pub(super) fn placement_from_pb(p: pb::Placement) -> Result<PlacementSpec> {
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

/// A gang's size as written (`--replicas`, a job file's `replicas`): `N`
/// (a fixed gang) or `MIN:MAX` (elastic), as (MIN, MAX).
pub fn parse_replicas(s: &str) -> std::result::Result<(u32, u32), String> {
    let number = |t: &str| {
        t.trim()
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=MAX_REPLICAS).contains(n))
            .ok_or_else(|| format!("{s:?}: {t:?} is not a whole number in 1..={MAX_REPLICAS}"))
    };
    match s.split_once(':') {
        None => number(s).map(|n| (n, n)),
        Some((min, max)) => {
            let (min, max) = (number(min)?, number(max)?);
            if min > max {
                return Err(format!("{s:?}: MIN is more than MAX (MIN:MAX)"));
            }
            Ok((min, max))
        }
    }
}

impl From<JobSpec> for pb::JobSpec {
    fn from(s: JobSpec) -> Self {
        with_template!(pb::JobSpec, s.template, {
            name: s.name,
            placement: (!s.placement.is_default()).then(|| s.placement.into()),
            priority: s.priority,
            replicas: s.replicas,
            max_retries: s.max_retries,
            no_requeue: s.no_requeue,
            tenant: s.tenant.into_recorded(),
            secret_env: s.secret_env.into_iter().collect(),
            require_cuda: s
                .require_cuda
                .map(|e| e.text().to_string())
                .unwrap_or_default(),
            min_replicas: s.min_replicas.unwrap_or(0),
            restart_policy: if s.restart_policy.is_default() {
                String::new()
            } else {
                s.restart_policy.to_string()
            },
            restart_backoff_ms: s.restart_backoff_ms,
        })
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
        let template = wire_template!(s).check("task", Checks::Shape)?;
        let resources = template.resources;
        let share = match s.share {
            None => None,
            Some(sh) => Some(TaskShare {
                // It names the task's MPS server's directory on the agent.
                tenant: if sh.tenant.is_empty() {
                    Tenant::default()
                } else {
                    check_id("task.share.tenant", &sh.tenant)?;
                    Tenant::new(sh.tenant)
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
        Ok(TaskSpec {
            task_id: s.task_id,
            job_id: s.job_id,
            framework_id: s.framework_id,
            template,
            gpu_uuids: s.gpu_uuids,
            share,
        })
    }
}

impl From<TaskSpec> for pb::TaskSpec {
    fn from(s: TaskSpec) -> Self {
        with_template!(pb::TaskSpec, s.template, {
            task_id: s.task_id,
            job_id: s.job_id,
            framework_id: s.framework_id,
            gpu_uuids: s.gpu_uuids,
            share: s.share.map(|sh| pb::TaskShare {
                mem_mib: sh.fraction.mem_mib,
                compute_pct: sh.fraction.compute_pct,
                mode: sh.mode.to_string(),
                tenant: sh.tenant.into_recorded(),
            }),
        })
    }
}
