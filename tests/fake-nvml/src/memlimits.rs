//! Per-cgroup memory limits (driver r615+): nvmlDeviceSetMemoryLimits_v1 and
//! nvmlDeviceGetMemoryLimits_v1.
//!
//! A Set is recorded in the GPU's `cgroup_memory_limits` in the config file
//! (written back through `state::transact`), so a test reads what the agent
//! set, and a Get answers it. Choices where NVIDIA documents no return code
//! (research §3.1):
//! - the config's `memory_limits` is false (an older driver, or memory
//!   partitioning off): NOT_SUPPORTED. A real pre-r615 library has no such
//!   symbols; a library cannot hide its exports, so this is the nearest;
//! - a MIG device handle, or a GPU in MIG mode: NOT_SUPPORTED (NVIDIA:
//!   "MIG handles are not supported", "non-MIG device" required);
//! - a null struct or `nameSpace`, a path that is not an absolute directory
//!   on a cgroup2 mount, or soft over hard: INVALID_ARGUMENT. The caller
//!   named something that is not a cgroup v2 group; the real driver's code
//!   for that is not documented (third parties saw NOT_FOUND for a group
//!   without dmem files), and INVALID_ARGUMENT is NVML's code for a bad
//!   argument;
//! - Get of a cgroup never set: SUCCESS with soft 0, hard
//!   NVML_DEVICE_MEMORY_LIMIT_MAX, used 0, what NVIDIA documents as "no
//!   limit" (a real driver may answer NOT_FOUND there instead).
//!
//! # Safety (both functions)
//!
//! As in `exports.rs`: `limits` is null or valid for a read (Set) or a read
//! and a write (Get) of the struct, and its `nameSpace` null or a
//! NUL-terminated string.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::path::{Path, PathBuf};

use crate::config::{Config, Gpu};
use crate::ffi::*;
use crate::state::{self, guard, in_str, in_value, out, Res};

/// The GPU behind `device` if it can have cgroup limits now.
fn limitable<'c>(cfg: &'c Config, device: nvmlDevice_t, func: &str) -> Res<(usize, &'c Gpu)> {
    let (i, gpu) = state::device(cfg, device, func)?;
    if !cfg.memory_limits || gpu.mig.mode {
        return Err(NVML_ERROR_NOT_SUPPORTED);
    }
    Ok((i, gpu))
}

/// The caller's cgroup path, checked: an absolute directory on a cgroup2
/// mount (else INVALID_ARGUMENT).
///
/// # Safety
/// `p` is null or a NUL-terminated string.
unsafe fn cgroup_path<'a>(p: *const std::os::raw::c_char) -> Res<&'a str> {
    let path = unsafe { in_str(p) }?;
    if on_cgroup2(Path::new(path)) {
        Ok(path)
    } else {
        Err(NVML_ERROR_INVALID_ARGUMENT)
    }
}

/// Whether `path` is an absolute directory whose mount (the longest mount
/// point above it in /proc/self/mountinfo; the later of equals, which is
/// mounted over the earlier) is a cgroup2.
pub fn on_cgroup2(path: &Path) -> bool {
    if !path.is_absolute() {
        return false;
    }
    let Ok(real) = std::fs::canonicalize(path) else {
        return false;
    };
    if !real.is_dir() {
        return false;
    }
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let mut best: Option<(usize, bool)> = None;
    for line in info.lines() {
        // "<id> <parent> <maj:min> <root> <mount point> <opts> ... - <fstype> ..."
        let Some((pre, post)) = line.split_once(" - ") else {
            continue;
        };
        let (Some(point), Some(fstype)) = (pre.split(' ').nth(4), post.split(' ').next()) else {
            continue;
        };
        let point = unescape(point);
        if real.starts_with(&point) {
            let depth = point.components().count();
            if best.is_none_or(|(d, _)| depth >= d) {
                best = Some((depth, fstype == "cgroup2"));
            }
        }
    }
    best.is_some_and(|(_, v)| v)
}

/// mountinfo's octal escapes (`\040` for a space).
fn unescape(s: &str) -> PathBuf {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    PathBuf::from(<std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(out))
}

/// Records soft and hard for `limits.nameSpace` on this GPU (the last Set of
/// a path wins; soft 0 and hard MAX is recorded too: that is the clear).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceSetMemoryLimits_v1(
    device: nvmlDevice_t,
    limits: *mut nvmlSetMemoryLimits_v1_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceSetMemoryLimits_v1";
    guard(NAME, || {
        state::transact(|cfg, root| {
            let (index, _) = limitable(cfg, device, NAME)?;
            let l = unsafe { in_value(limits.cast_const()) }?;
            let path = unsafe { cgroup_path(l.nameSpace) }?;
            if l.softLimit > l.hardLimit {
                return Err(NVML_ERROR_INVALID_ARGUMENT);
            }
            record(root, index, path, l.softLimit, l.hardLimit)
        })
    })
}

/// Writes one cgroup's limits into GPU `index`'s `cgroup_memory_limits`,
/// keeping its `used_bytes`.
fn record(root: &mut serde_json::Value, index: usize, path: &str, soft: u64, hard: u64) -> Res<()> {
    use serde_json::{json, Value};
    let gpu = root
        .get_mut("gpus")
        .and_then(|g| g.get_mut(index))
        .and_then(Value::as_object_mut)
        .ok_or(NVML_ERROR_UNKNOWN)?;
    let list = gpu
        .entry("cgroup_memory_limits")
        .or_insert_with(|| json!([]))
        .as_array_mut()
        .ok_or(NVML_ERROR_UNKNOWN)?;
    let at = list
        .iter()
        .position(|e| e.get("cgroup").and_then(Value::as_str) == Some(path));
    let entry = match at {
        Some(i) => &mut list[i],
        None => {
            list.push(json!({ "cgroup": path }));
            list.last_mut().ok_or(NVML_ERROR_UNKNOWN)?
        }
    };
    let obj = entry.as_object_mut().ok_or(NVML_ERROR_UNKNOWN)?;
    obj.insert("soft_bytes".into(), json!(soft));
    obj.insert("hard_bytes".into(), json!(hard));
    Ok(())
}

/// The limits last set for `limits.nameSpace` on this GPU and its
/// `used_bytes`; never set: soft 0, hard NVML_DEVICE_MEMORY_LIMIT_MAX, 0.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryLimits_v1(
    device: nvmlDevice_t,
    limits: *mut nvmlGetMemoryLimits_v1_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceGetMemoryLimits_v1";
    guard(NAME, || {
        let cfg = state::session()?;
        let (_, gpu) = limitable(&cfg, device, NAME)?;
        let slot = unsafe { out(limits) }?;
        let mut l = slot.get();
        let path = unsafe { cgroup_path(l.nameSpace) }?;
        let (soft, hard, used) = gpu
            .cgroup_memory_limits
            .iter()
            .find(|e| e.cgroup == path)
            .map_or((0, NVML_DEVICE_MEMORY_LIMIT_MAX, 0), |e| {
                (e.soft_bytes, e.hard_bytes, e.used_bytes)
            });
        l.softLimit = soft;
        l.hardLimit = hard;
        l.currentUsed = used;
        slot.set(l);
        Ok(())
    })
}
