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
