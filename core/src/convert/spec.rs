//! A job's spec and a task's, to and from the wire: the task template's
//! fields listed once for both messages, the job's own rules around them.

use std::collections::BTreeMap;

use super::job::*;
use super::options::{options_from_pb, options_to_pb};
use super::*;
use crate::pb;
use crate::types::*;

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
    options: Option<pb::TaskOptions>,
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
            options: $s.options,
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
            options: w.options,
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
            options: options_to_pb(t.options),
        }
    }
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
            options: options_from_pb(prefix, self.options, runtime, checks)?,
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
        // Each named port is one of the task's host ports.
        let named = u32::try_from(template.options.port.len()).unwrap_or(u32::MAX);
        if resources.ports == 0 {
            resources.ports = named;
        } else if resources.ports < named {
            return Err(ConvertError::new(
                "spec.resources.ports",
                format!(
                    "is {}, fewer than the {named} port names (spec.options.port_names)",
                    resources.ports
                ),
            ));
        }
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
        let (restart_policy, service) =
            restart_from_pb(&s.restart_policy, &s.service, s.max_retries)?;
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
        let secret_env = secret_env_from_pb(s.secret_env, &template.env)?;
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
            service,
        })
    }
}

/// A spec's restart policy and the service it is a replica of: `always`
/// goes with a service, and only with one; `never` with no retries.
fn restart_from_pb(
    policy: &str,
    service: &str,
    max_retries: u32,
) -> Result<(RestartPolicy, Option<String>)> {
    let restart_policy: RestartPolicy = policy
        .parse()
        .map_err(|e: String| ConvertError::new("spec.restart_policy", e))?;
    let service = if service.is_empty() {
        None
    } else {
        check_id("spec.service", service)?;
        Some(service.to_string())
    };
    if (restart_policy == RestartPolicy::Always) != service.is_some() {
        return Err(ConvertError::new(
            "spec.restart_policy",
            "always is a service's replicas' policy, and theirs only (gpuctl services create)",
        ));
    }
    if restart_policy == RestartPolicy::Never && max_retries > 0 {
        return Err(ConvertError::new(
            "spec.max_retries",
            format!(
                "is {max_retries}, but spec.restart_policy never restarts a job (leave one out)"
            ),
        ));
    }
    Ok((restart_policy, service))
}

/// The names of `env`'s variables whose values are secret: each a
/// variable of `env`, at most [`MAX_ENV_VARS`] names.
fn secret_env_from_pb(
    names: Vec<String>,
    env: &BTreeMap<String, String>,
) -> Result<std::collections::BTreeSet<String>> {
    // A name may be repeated, so the count is not bounded by env's.
    if names.len() > MAX_ENV_VARS {
        return Err(ConvertError::new(
            "spec.secret_env",
            format!("has {} names, at most {MAX_ENV_VARS}", names.len()),
        ));
    }
    let mut secret_env = std::collections::BTreeSet::new();
    for (i, k) in names.into_iter().enumerate() {
        if !env.contains_key(&k) {
            return Err(ConvertError::new(
                format!("spec.secret_env[{i}]"),
                format!("{:?} is not a variable of spec.env", cut(&k, 64)),
            ));
        }
        secret_env.insert(k);
    }
    Ok(secret_env)
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
            service: s.service.unwrap_or_default(),
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
