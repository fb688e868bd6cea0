//! The values of a job's options, parsed one way for `jobs submit`'s flags
//! and for job files' keys (the master checks them again).

use gpuctl_proto::pb;

/// `--stop-grace`: a duration (`90s`, `5m`, `1500ms`; a bare number is
/// seconds), as ms. The cluster's maximum is the master's to check.
pub fn parse_stop_grace(s: &str) -> Result<u64, String> {
    let d = gpuctl_core::time::parse_duration(s)?;
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if ms > gpuctl_core::convert::MAX_STOP_GRACE_MS {
        return Err(format!("{s:?} is longer than a day"));
    }
    Ok(ms)
}

/// `--restart-policy`: `gang` or `never`.
pub fn parse_restart_policy(s: &str) -> Result<String, String> {
    s.parse::<gpuctl_core::types::RestartPolicy>()
        .map(|p| p.to_string())
}

/// `--restart-backoff`: a duration, as ms, at most an hour.
pub fn parse_restart_backoff(s: &str) -> Result<u64, String> {
    let d = gpuctl_core::time::parse_duration(s)?;
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if ms > gpuctl_core::convert::MAX_FIRST_RESTART_BACKOFF_MS {
        return Err(format!("{s:?} is longer than an hour"));
    }
    Ok(ms)
}

/// `--hang-timeout`: a duration, as ms, within the master's bounds.
pub fn parse_hang_timeout(s: &str) -> Result<u64, String> {
    use gpuctl_core::convert::{MAX_HANG_TIMEOUT_MS, MIN_HANG_TIMEOUT_MS};
    let d = gpuctl_core::time::parse_duration(s)?;
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if !(MIN_HANG_TIMEOUT_MS..=MAX_HANG_TIMEOUT_MS).contains(&ms) {
        return Err(format!("{s:?} is not between 1s and 7d"));
    }
    Ok(ms)
}

/// `--require-cuda`: checked here so that a typo is an error before the
/// request (the master checks it again).
pub fn parse_require_cuda(s: &str) -> Result<String, String> {
    let e = gpuctl_core::cuda_req::Expr::parse(s).map_err(|e| e.to_string())?;
    if e.is_empty() {
        return Err(format!("{s:?} has no condition"));
    }
    Ok(e.text().to_string())
}

/// `HOST:CONTAINER[:ro|:rw]` of `--mount`: read-only unless `rw`. The
/// paths themselves are checked by the master.
pub fn parse_mount(s: &str) -> Result<pb::HostMount, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let (host, container, read_write) = match parts[..] {
        [h, c] => (h, c, false),
        [h, c, "ro"] => (h, c, false),
        [h, c, "rw"] => (h, c, true),
        _ => return Err(format!("{s:?} is not HOST:CONTAINER[:rw]")),
    };
    if host.is_empty() || container.is_empty() {
        return Err(format!("{s:?} is not HOST:CONTAINER[:rw]"));
    }
    Ok(pb::HostMount {
        host_path: host.to_string(),
        container_path: container.to_string(),
        read_write,
    })
}

/// `KEY=VALUE` of `--constraint`: both sides non-empty.
pub fn parse_constraint(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() && !v.is_empty() => {
            Ok((k.trim().to_string(), v.to_string()))
        }
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

/// `K=V` of `--env`. The value may be empty or contain '='; the name may not be empty.
pub fn parse_env_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        Some(_) => Err(format!("{s:?} has an empty name (expected K=V)")),
        None => Err(format!("{s:?} has no '=' (expected K=V)")),
    }
}

/// `--gpu-mem`: MiB, or a number with a binary unit (`10GiB`, `10G`,
/// `512MiB`, `512M`), at least 1 MiB.
pub fn parse_gpu_mem(s: &str) -> Result<u64, String> {
    match s.parse::<gpuctl_core::types::MiB>()? {
        gpuctl_core::types::MiB(0) => Err(format!("{s:?}: a fraction has at least 1 MiB")),
        gpuctl_core::types::MiB(m) => Ok(m),
    }
}

/// `--gpu-compute`: a percent of one GPU, 1-100, with or without `%`.
pub fn parse_gpu_compute(s: &str) -> Result<u32, String> {
    match s.trim().trim_end_matches('%').trim().parse::<u32>() {
        Ok(p) if (1..=100).contains(&p) => Ok(p),
        _ => Err(format!("{s:?} is not a percent of a GPU (1-100)")),
    }
}

pub fn parse_cpus(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("{s:?} is not a number of CPUs >= 0")),
    }
}
