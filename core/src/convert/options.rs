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
    let TaskOptions {
        shm_size,
        port,
        readiness,
        liveness,
    } = o;
    Some(pb::TaskOptions {
        shm_size_mib: shm_size.map(|m| m.0),
        port_names: port,
        readiness: readiness.map(check_to_pb),
        liveness: liveness.map(check_to_pb),
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
        readiness,
        liveness,
    }) = o
    else {
        return Ok(TaskOptions::default());
    };
    let check = |name: &str, c: Option<pb::HealthCheck>| {
        c.map(|c| check_from_pb(&format!("{prefix}.options.{name}"), c, &port_names, checks))
            .transpose()
    };
    let (readiness, liveness) = (check("readiness", readiness)?, check("liveness", liveness)?);
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
        readiness,
        liveness,
    })
}

fn check_to_pb(c: Check) -> pb::HealthCheck {
    let (probe, port, path, command) = match c.probe {
        Probe::Http { port, path } => ("http", port, path, String::new()),
        Probe::Tcp { port } => ("tcp", port, String::new(), String::new()),
        Probe::Exec { command } => ("exec", String::new(), String::new(), command),
    };
    pb::HealthCheck {
        probe: probe.into(),
        port,
        path,
        command,
        start_period_ms: c.start_period_ms,
        interval_ms: c.interval_ms,
        timeout_ms: c.timeout_ms,
        failures: c.failures,
        successes: c.successes,
    }
}

/// A check from the wire, zeros as the defaults; a submitted one against
/// every bound and its task's port names.
fn check_from_pb(
    field: &str,
    c: pb::HealthCheck,
    port_names: &[String],
    checks: Checks,
) -> Result<Check> {
    let mine = |what: &str, v: &str| {
        if v.is_empty() {
            Ok(())
        } else {
            Err(ConvertError::new(
                format!("{field}.{what}"),
                format!("is not for a {:?} probe", c.probe),
            ))
        }
    };
    let probe = match c.probe.as_str() {
        "http" => {
            mine("command", &c.command)?;
            Probe::Http {
                port: c.port.clone(),
                path: if c.path.is_empty() {
                    "/".into()
                } else {
                    c.path.clone()
                },
            }
        }
        "tcp" => {
            mine("path", &c.path)?;
            mine("command", &c.command)?;
            Probe::Tcp {
                port: c.port.clone(),
            }
        }
        "exec" => {
            mine("port", &c.port)?;
            mine("path", &c.path)?;
            Probe::Exec {
                command: c.command.clone(),
            }
        }
        other => {
            return Err(ConvertError::new(
                format!("{field}.probe"),
                format!("{:?}: http, tcp or exec", cut(other, 32)),
            ))
        }
    };
    let or = |v: u64, d: u64| if v == 0 { d } else { v };
    let check = Check {
        probe,
        start_period_ms: c.start_period_ms,
        interval_ms: or(c.interval_ms, CHECK_INTERVAL_MS),
        timeout_ms: or(c.timeout_ms, CHECK_TIMEOUT_MS),
        failures: if c.failures == 0 {
            CHECK_FAILURES
        } else {
            c.failures
        },
        successes: if c.successes == 0 {
            CHECK_SUCCESSES
        } else {
            c.successes
        },
    };
    if checks == Checks::Submitted {
        check
            .validate()
            .map_err(|(key, why)| ConvertError::new(format!("{field}.{}", pb_key(key)), why))?;
        if let Some(port) = check.probe.port() {
            if !port_names.iter().any(|p| p == port) {
                return Err(ConvertError::new(
                    format!("{field}.port"),
                    format!(
                        "{:?} is not one of the task's port names ({}; name them with --port)",
                        cut(port, 32),
                        if port_names.is_empty() {
                            "it has none".to_string()
                        } else {
                            port_names.join(", ")
                        }
                    ),
                ));
            }
        }
    }
    Ok(check)
}

/// The wire's name of a check option.
fn pb_key(key: &str) -> &str {
    match key {
        "start" => "start_period_ms",
        "interval" => "interval_ms",
        "timeout" => "timeout_ms",
        other => other,
    }
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
        readiness,
        liveness,
    }) = o
    else {
        return TaskOptions::default();
    };
    let check = |c: &Option<pb::HealthCheck>| {
        c.clone()
            .and_then(|c| check_from_pb("", c, port_names, Checks::Shape).ok())
    };
    TaskOptions {
        shm_size: shm_size_mib.map(MiB),
        port: port_names.clone(),
        readiness: check(readiness),
        liveness: check(liveness),
    }
}
