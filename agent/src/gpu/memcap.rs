//! The driver's per-cgroup GPU memory cap, the `driver` enforcement level:
//! `nvmlDeviceSetMemoryLimits_v1` (driver r615+, CUDA 13.4) on a task's own
//! cgroup v2 holds all of the task's processes together to its fraction, at
//! allocation.
//!
//! The two functions are newer than nvml-wrapper, so they are resolved at
//! run time from the NVML library the agent loads (`--nvml-lib`, else
//! `libnvidia-ml.so.1`); an older driver lacks them and the task keeps what
//! else holds (`mps`, `none`). Their structs are copied from NVIDIA's NVML
//! reference (docs/research/mps-fractions.md §3.1), sizes asserted below.
//!
//! A cap counts once it is read back. Each cap is recorded in
//! `<dir>/<task>.json` before it is set, so `clear` (soft 0, hard max) also
//! works for a task an earlier agent process capped: on the kernel's dmem
//! backend a cgroup removed with its soft limit still set leaves its
//! reservation in its ancestors.

use std::ffi::{c_char, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nvml_wrapper::error::{nvml_try, NvmlError};
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{nvmlDevice_t, nvmlReturn_t};
use serde::{Deserialize, Serialize};

/// `NVML_DEVICE_MEMORY_LIMIT_MAX`, "no hard limit". Its value was not seen
/// in a header; the sources bound it to ~0ULL (research §3.1).
pub const LIMIT_MAX: u64 = u64::MAX;

/// What nvml-wrapper loads when no `--nvml-lib` is given.
const DEFAULT_LIB: &str = "libnvidia-ml.so.1";
const SET_SYMBOL: &str = "nvmlDeviceSetMemoryLimits_v1";
const GET_SYMBOL: &str = "nvmlDeviceGetMemoryLimits_v1";
const MIB: u64 = 1024 * 1024;

/// `nvmlSetMemoryLimits_v1_t`.
#[repr(C)]
struct SetLimits {
    /// Full path of the cgroup v2 directory.
    name_space: *const c_char,
    soft_limit: u64,
    hard_limit: u64,
}

/// `nvmlGetMemoryLimits_v1_t`.
#[repr(C)]
struct GetLimits {
    name_space: *const c_char,
    soft_limit: u64,
    hard_limit: u64,
    current_used: u64,
}

// NVIDIA's layout on LP64 (the agent runs on 64-bit Linux only).
#[cfg(target_pointer_width = "64")]
const _: () = {
    assert!(std::mem::size_of::<SetLimits>() == 24);
    assert!(std::mem::offset_of!(SetLimits, hard_limit) == 16);
    assert!(std::mem::size_of::<GetLimits>() == 32);
    assert!(std::mem::offset_of!(GetLimits, current_used) == 24);
};

type SetFn = unsafe extern "C" fn(nvmlDevice_t, *mut SetLimits) -> nvmlReturn_t;
type GetFn = unsafe extern "C" fn(nvmlDevice_t, *mut GetLimits) -> nvmlReturn_t;

#[derive(Debug, thiserror::Error)]
pub enum MemCapError {
    #[error("the driver's memory cap is off on this agent (no NVML GPUs)")]
    Off,
    #[error("NVML: {0}")]
    Nvml(#[source] NvmlError),
    #[error("{lib}: {reason}")]
    Library { lib: String, reason: String },
    #[error("{lib} has no {symbol}: the driver is older than r615")]
    Missing { lib: String, symbol: &'static str },
    #[error("GPU {0}: {1}")]
    Gpu(String, #[source] NvmlError),
    #[error("{0} is a MIG device or in MIG mode: the driver's cap does not apply")]
    Mig(String),
    #[error("{}: not a cgroup v2 directory", .0.display())]
    NotCgroup2(PathBuf),
    #[error("{call} on GPU {gpu} for {}: {source}", .cgroup.display())]
    Call {
        call: &'static str,
        gpu: String,
        cgroup: PathBuf,
        #[source]
        source: NvmlError,
    },
    #[error("GPU {gpu}, {}: read back a hard limit of {got} bytes, not at most {want}", .cgroup.display())]
    ReadBack {
        gpu: String,
        cgroup: PathBuf,
        got: u64,
        want: u64,
    },
    #[error("cap record: {0}")]
    Record(#[from] crate::checkpoint::CheckpointError),
}

/// A cap as read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capped {
    pub hard_bytes: u64,
    /// What the cgroup used on the GPU when it was read.
    pub used_bytes: u64,
}

/// What was capped for a task, recorded before the Set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Record {
    gpu_uuid: String,
    cgroup: PathBuf,
}

/// The driver's cap for this agent's tasks.
#[derive(Debug)]
pub struct DriverCap {
    /// None: never caps (simulated GPUs).
    lib: Option<String>,
    dir: PathBuf,
}

/// NVML opened, with the two functions resolved from the same library.
struct Session {
    nvml: Nvml,
    set: SetFn,
    get: GetFn,
    /// Keeps the library mapped while `set` and `get` are used.
    _lib: libloading::Library,
}

impl DriverCap {
    /// `nvml_lib`: the agent's `--nvml-lib`; `dir`: where caps are recorded.
    pub fn new(nvml_lib: Option<&Path>, dir: PathBuf) -> DriverCap {
        let lib = nvml_lib.map_or_else(
            || DEFAULT_LIB.to_string(),
            |p| p.to_string_lossy().into_owned(),
        );
        DriverCap {
            lib: Some(lib),
            dir,
        }
    }

    /// An agent without NVML GPUs: nothing is capped, nothing to clear.
    pub fn off(dir: PathBuf) -> DriverCap {
        DriverCap { lib: None, dir }
    }

    fn record_path(&self, task_id: &str) -> PathBuf {
        self.dir.join(format!("{task_id}.json"))
    }

    fn open(&self) -> Result<Session, MemCapError> {
        let lib = self.lib.as_deref().ok_or(MemCapError::Off)?;
        // nvml-wrapper inits NVML; the same path opened again is the same
        // loaded library, so the two functions run in that session.
        let nvml = Nvml::builder()
            .lib_path(std::ffi::OsStr::new(lib))
            .init()
            .map_err(MemCapError::Nvml)?;
        let (set, get, library) = resolve(lib)?;
        Ok(Session {
            nvml,
            set,
            get,
            _lib: library,
        })
    }

    /// Whether a cap can be set for `gpu_uuid` on `cgroup`: the driver has
    /// the functions, the GPU is not in MIG mode (nor a MIG device), and
    /// `cgroup` is a cgroup v2 directory.
    pub fn supported(&self, gpu_uuid: &str, cgroup: &Path) -> Result<(), MemCapError> {
        let s = self.open()?;
        whole_gpu(&s.nvml, gpu_uuid)?;
        cgroup_v2(cgroup).map(|_| ())
    }

    /// Whether this agent's NVML has the functions (one line for its log).
    pub fn probe(&self) -> Result<(), MemCapError> {
        self.open().map(|_| ())
    }

    /// Caps `cgroup` on `gpu_uuid` at `mem_mib` and reads it back. Ok only
    /// when the read-back hard limit is set and at most the cap; a cap set
    /// but not confirmed is cleared again. The soft limit is the hard one
    /// (a strict partition, no eviction) for a cgroup the agent removes
    /// itself, after `clear`; 0 for one that runc removes (a container's),
    /// which nothing clears first: on the dmem backend a soft limit left at
    /// removal stays reserved in the ancestors.
    pub fn apply(
        &self,
        task_id: &str,
        gpu_uuid: &str,
        cgroup: &Path,
        mem_mib: u64,
        cleared_before_removal: bool,
    ) -> Result<Capped, MemCapError> {
        let s = self.open()?;
        let dev = whole_gpu(&s.nvml, gpu_uuid)?;
        let name = cgroup_v2(cgroup)?;
        let want = mem_mib.saturating_mul(MIB);
        let record = Record {
            gpu_uuid: gpu_uuid.to_string(),
            cgroup: cgroup.to_path_buf(),
        };
        std::fs::create_dir_all(&self.dir).map_err(|source| {
            crate::checkpoint::CheckpointError::Io {
                path: self.dir.clone(),
                source,
            }
        })?;
        crate::checkpoint::write_json(&self.record_path(task_id), &record)?;
        let call_err = |call, source| MemCapError::Call {
            call,
            gpu: gpu_uuid.to_string(),
            cgroup: cgroup.to_path_buf(),
            source,
        };
        let soft = if cleared_before_removal { want } else { 0 };
        if let Err(e) = set_limits(&s, &dev, &name, soft, want) {
            self.forget(task_id);
            return Err(call_err(SET_SYMBOL, e));
        }
        let checked = match get_limits(&s, &dev, &name) {
            Err(e) => Err(call_err(GET_SYMBOL, e)),
            Ok(got) if got.hard_limit == 0 || got.hard_limit > want => Err(MemCapError::ReadBack {
                gpu: gpu_uuid.to_string(),
                cgroup: cgroup.to_path_buf(),
                got: got.hard_limit,
                want,
            }),
            Ok(got) => Ok(Capped {
                hard_bytes: got.hard_limit,
                used_bytes: got.current_used,
            }),
        };
        if checked.is_err() && set_limits(&s, &dev, &name, 0, LIMIT_MAX).is_ok() {
            // Not confirmed, so not claimed: leave no cap behind either.
            self.forget(task_id);
        }
        checked
    }

    /// Clears the cap `apply` set for `task_id` (soft 0, hard max), if any;
    /// call before the task's cgroup is removed. Says whether there was one.
    /// The record goes whatever happens: the cgroup is removed next, which
    /// clears what is left (research §2.3).
    pub fn clear(&self, task_id: &str) -> Result<bool, MemCapError> {
        let path = self.record_path(task_id);
        let Some(r) = crate::checkpoint::read_json::<Record>(&path)? else {
            return Ok(false);
        };
        let result = if r.cgroup.is_dir() {
            self.open().and_then(|s| {
                let dev = s
                    .nvml
                    .device_by_uuid(r.gpu_uuid.as_str())
                    .map_err(|e| MemCapError::Gpu(r.gpu_uuid.clone(), e))?;
                let name = cgroup_v2(&r.cgroup)?;
                set_limits(&s, &dev, &name, 0, LIMIT_MAX).map_err(|source| MemCapError::Call {
                    call: SET_SYMBOL,
                    gpu: r.gpu_uuid.clone(),
                    cgroup: r.cgroup.clone(),
                    source,
                })
            })
        } else {
            Ok(())
        };
        self.forget(task_id);
        result.map(|()| true)
    }

    fn forget(&self, task_id: &str) {
        let _ = std::fs::remove_file(self.record_path(task_id));
    }

    /// For the executor: caps the task's cgroup (blocking NVML calls on a
    /// blocking thread) and says whether the cap holds. Any failure means
    /// no `driver` level for this task, logged, not fatal to it.
    pub async fn cap_task(
        self: &Arc<Self>,
        task_id: &str,
        gpu_uuid: &str,
        cgroup: &Path,
        mem_mib: u64,
    ) -> bool {
        if self.lib.is_none() {
            return false;
        }
        let me = self.clone();
        let (task, gpu, dir) = (
            task_id.to_string(),
            gpu_uuid.to_string(),
            cgroup.to_path_buf(),
        );
        let r =
            tokio::task::spawn_blocking(move || me.apply(&task, &gpu, &dir, mem_mib, true)).await;
        match r {
            Ok(Ok(c)) => {
                tracing::info!(task_id, gpu_uuid, cgroup = %cgroup.display(), hard_bytes = c.hard_bytes, "the driver caps the task's GPU memory");
                true
            }
            Ok(Err(e)) => {
                tracing::info!(task_id, gpu_uuid, reason = %e, "no driver memory cap for the task");
                false
            }
            Err(e) => {
                tracing::warn!(task_id, error = %e, "driver memory cap panicked");
                false
            }
        }
    }
}

/// The two functions from the library at `lib` (already loaded by
/// nvml-wrapper, so this maps nothing new).
#[allow(unsafe_code)]
fn resolve(lib: &str) -> Result<(SetFn, GetFn, libloading::Library), MemCapError> {
    let lib_err = |e: libloading::Error| MemCapError::Library {
        lib: lib.to_string(),
        reason: e.to_string(),
    };
    // SAFETY: NVML's library, which nvml-wrapper has just loaded and
    // initialized from the same path: its initializers have run already.
    let library = unsafe { libloading::Library::new(lib) }.map_err(lib_err)?;
    let missing = |symbol| MemCapError::Missing {
        lib: lib.to_string(),
        symbol,
    };
    // SAFETY: the types are NVML's declarations of these two functions
    // (research §3.1); the pointers are used only while `library` lives.
    let set = unsafe { library.get::<SetFn>(SET_SYMBOL.as_bytes()) }
        .map(|s| *s)
        .map_err(|_| missing(SET_SYMBOL))?;
    // SAFETY: as above.
    let get = unsafe { library.get::<GetFn>(GET_SYMBOL.as_bytes()) }
        .map(|s| *s)
        .map_err(|_| missing(GET_SYMBOL))?;
    Ok((set, get, library))
}

#[allow(unsafe_code)]
fn set_limits(
    s: &Session,
    dev: &Device<'_>,
    cgroup: &CString,
    soft: u64,
    hard: u64,
) -> Result<(), NvmlError> {
    let mut l = SetLimits {
        name_space: cgroup.as_ptr(),
        soft_limit: soft,
        hard_limit: hard,
    };
    // SAFETY: a live device handle of `s.nvml`; `l` has NVML's layout and
    // its string outlives the call.
    nvml_try(unsafe { (s.set)(dev.handle(), &mut l) })
}

#[allow(unsafe_code)]
fn get_limits(s: &Session, dev: &Device<'_>, cgroup: &CString) -> Result<GetLimits, NvmlError> {
    let mut l = GetLimits {
        name_space: cgroup.as_ptr(),
        soft_limit: 0,
        hard_limit: 0,
        current_used: 0,
    };
    // SAFETY: as in `set_limits`; NVML writes the three outputs of `l`.
    nvml_try(unsafe { (s.get)(dev.handle(), &mut l) })?;
    Ok(l)
}

/// The GPU, refused when it is a MIG device or in MIG mode.
fn whole_gpu<'n>(nvml: &'n Nvml, gpu_uuid: &str) -> Result<Device<'n>, MemCapError> {
    if gpu_uuid.starts_with("MIG-") {
        return Err(MemCapError::Mig(gpu_uuid.to_string()));
    }
    let dev = nvml
        .device_by_uuid(gpu_uuid)
        .map_err(|e| MemCapError::Gpu(gpu_uuid.to_string(), e))?;
    // No MIG on the model (NOT_SUPPORTED) is fine.
    if dev.mig_mode().is_ok_and(|m| m.current != 0) {
        return Err(MemCapError::Mig(gpu_uuid.to_string()));
    }
    Ok(dev)
}

/// `cgroup` as NVML takes it, if it is a directory on a cgroup2 mount.
fn cgroup_v2(cgroup: &Path) -> Result<CString, MemCapError> {
    use nix::sys::statfs::{statfs, CGROUP2_SUPER_MAGIC};
    let not = || MemCapError::NotCgroup2(cgroup.to_path_buf());
    let v2 = cgroup.is_absolute()
        && cgroup.is_dir()
        && statfs(cgroup).is_ok_and(|s| s.filesystem_type() == CGROUP2_SUPER_MAGIC);
    if !v2 {
        return Err(not());
    }
    CString::new(cgroup.as_os_str().as_bytes()).map_err(|_| not())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_without_the_functions_is_a_driver_older_than_r615() {
        // libc has neither symbol: what a pre-r615 libnvidia-ml looks like.
        match resolve("libc.so.6") {
            Err(MemCapError::Missing { symbol, .. }) => assert_eq!(symbol, SET_SYMBOL),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("libc has no NVML"),
        }
        let err = resolve("/nonexistent/libnvidia-ml.so.1").err().unwrap();
        assert!(matches!(err, MemCapError::Library { .. }), "{err}");
    }

    #[test]
    fn only_cgroup_v2_directories_are_capped() {
        let d = tempfile::tempdir().unwrap();
        for p in [
            d.path(),
            Path::new("relative/dir"),
            Path::new("/nonexistent"),
        ] {
            assert!(
                matches!(cgroup_v2(p), Err(MemCapError::NotCgroup2(_))),
                "{}",
                p.display()
            );
        }
    }

    #[test]
    fn an_agent_without_nvml_caps_nothing_and_clears_what_it_recorded() {
        let d = tempfile::tempdir().unwrap();
        let cap = DriverCap::off(d.path().to_path_buf());
        let err = cap.apply("t1", "GPU-1", d.path(), 1024, true).unwrap_err();
        assert!(matches!(err, MemCapError::Off), "{err}");
        assert!(!cap.clear("t1").unwrap(), "nothing recorded");
        // A record whose cgroup is gone (removed with the task): nothing left
        // to clear, and the record goes.
        let r = Record {
            gpu_uuid: "GPU-1".into(),
            cgroup: d.path().join("gone"),
        };
        crate::checkpoint::write_json(&cap.record_path("t2"), &r).unwrap();
        assert!(cap.clear("t2").unwrap());
        assert!(!cap.record_path("t2").exists());
    }
}
