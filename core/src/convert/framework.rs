//! The framework API: a framework's info and the tasks it launches.

use std::collections::BTreeMap;

use super::*;
use crate::pb;
use crate::types::*;

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
        tenant: Tenant::default(),
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
pub(super) fn framework_fraction_from_pb(
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
