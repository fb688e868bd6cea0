//! A task's options ([`TaskOptions`]) to and from the wire: the copy both
//! ways and the checks of a submitted job's. A new option is a line in
//! each function here.

use super::*;
use crate::pb;
use crate::types::*;

/// The options as sent; `None` when every option is unset, so the wire of
/// a job without options is what it was before they existed.
pub fn options_to_pb(o: TaskOptions) -> Option<pb::TaskOptions> {
    if o.is_default() {
        return None;
    }
    let TaskOptions { shm_size, port } = o;
    Some(pb::TaskOptions {
        shm_size_mib: shm_size.map(|m| m.0),
        port_names: port,
    })
}

/// The options as received, uncopied fields checked: a submitted job's
/// against every bound (`prefix` names its spec), a task from the master
/// for shape only (its job's were checked on submit).
pub(super) fn options_from_pb(
    prefix: &str,
    o: Option<pb::TaskOptions>,
    runtime: Runtime,
    checks: Checks,
) -> Result<TaskOptions> {
    let Some(pb::TaskOptions {
        shm_size_mib,
        port_names,
    }) = o
    else {
        return Ok(TaskOptions::default());
    };
    if checks == Checks::Submitted {
        check_port_names(&format!("{prefix}.options.port_names"), &port_names)?;
        if let Some(mib) = shm_size_mib {
            let field = format!("{prefix}.options.shm_size_mib");
            if !(1..=MAX_SHM_SIZE_MIB).contains(&mib) {
                return Err(ConvertError::new(
                    field,
                    format!("is {mib} MiB: from 1 to {MAX_SHM_SIZE_MIB} (1 TiB)"),
                ));
            }
            if runtime != Runtime::Docker {
                return Err(ConvertError::new(
                    field,
                    "is for a container (spec.image); a host task's /dev/shm is a tmpfs of its own, \
                     bounded by its memory",
                ));
            }
        }
    }
    Ok(TaskOptions {
        shm_size: shm_size_mib.map(MiB),
        port: port_names,
    })
}

/// Port names: each 1 to 15 of a-z, 0-9 and '-', starting with a letter
/// (as Kubernetes' port names), none twice, at most a task's ports.
fn check_port_names(field: &str, names: &[String]) -> Result<()> {
    if names.len() > MAX_TASK_PORTS as usize {
        return Err(ConvertError::new(
            field,
            format!("has {} names: at most {MAX_TASK_PORTS}", names.len()),
        ));
    }
    for (i, name) in names.iter().enumerate() {
        let ok = (1..=15).contains(&name.len())
            && name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !ok {
            return Err(ConvertError::new(
                format!("{field}[{i}]"),
                format!(
                    "{:?} must be 1 to 15 of a-z, 0-9 and '-', starting with a letter",
                    cut(name, 64)
                ),
            ));
        }
        if names[..i].contains(name) {
            return Err(ConvertError::new(
                format!("{field}[{i}]"),
                format!("{name:?} names two ports"),
            ));
        }
    }
    Ok(())
}

/// The options as a view shows them (`jobs get --json`, the console): as
/// sent, unchecked.
pub fn options_view(o: Option<&pb::TaskOptions>) -> TaskOptions {
    let Some(pb::TaskOptions {
        shm_size_mib,
        port_names,
    }) = o
    else {
        return TaskOptions::default();
    };
    TaskOptions {
        shm_size: shm_size_mib.map(MiB),
        port: port_names.clone(),
    }
}
