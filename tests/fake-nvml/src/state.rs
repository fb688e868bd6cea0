//! What the exported functions share: the init reference count, where the
//! config lives, device handles, the panic guard, and the only places that
//! touch caller memory (`out`, `out_str`, `out_array`, `in_str`).

use std::ffi::CStr;
use std::os::raw::{c_char, c_uint};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::ptr::{self, NonNull};

use crate::config::{self, Config, Gpu, GpuInstance};
use crate::ffi::*;

/// Result of an exported function's body; `Err` carries the NVML error code.
pub type Res<T> = Result<T, nvmlReturn_t>;

/// Env var naming the machine description.
pub const CONFIG_ENV: &str = "FAKE_NVML_CONFIG";

/// Runs an exported function's body: its `Res` becomes the return code, and
/// a panic becomes NVML_ERROR_UNKNOWN instead of crossing the FFI boundary.
pub fn guard(name: &str, body: impl FnOnce() -> Res<()>) -> nvmlReturn_t {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => NVML_SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => {
            eprintln!("fake-nvml: {name} panicked; returning NVML_ERROR_UNKNOWN");
            NVML_ERROR_UNKNOWN
        }
    }
}

// ----- init reference count and config path -----
//
// In the library these are process-wide. Under `cargo test` they are per
// thread (each test runs on its own thread), so that tests running in
// parallel neither share an init count nor race on FAKE_NVML_CONFIG:
// `set_test_config` points the calling thread at its own file.

#[cfg(not(test))]
static INIT_COUNT: std::sync::Mutex<u32> = std::sync::Mutex::new(0);

#[cfg(not(test))]
fn with_init_count<R>(f: impl FnOnce(&mut u32) -> R) -> R {
    let mut count = INIT_COUNT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    f(&mut count)
}

#[cfg(not(test))]
fn config_path() -> Option<PathBuf> {
    std::env::var_os(CONFIG_ENV).map(PathBuf::from)
}

#[cfg(test)]
thread_local! {
    static INIT_COUNT: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    static TEST_CONFIG: std::cell::RefCell<Option<PathBuf>> = const { std::cell::RefCell::new(None) };
}

#[cfg(test)]
fn with_init_count<R>(f: impl FnOnce(&mut u32) -> R) -> R {
    INIT_COUNT.with(|c| {
        let mut n = c.get();
        let r = f(&mut n);
        c.set(n);
        r
    })
}

/// Tests: the config file for calls made on this thread (None: fall back to
/// FAKE_NVML_CONFIG).
#[cfg(test)]
pub fn set_test_config(path: Option<PathBuf>) {
    TEST_CONFIG.with(|p| *p.borrow_mut() = path);
}

#[cfg(test)]
fn config_path() -> Option<PathBuf> {
    TEST_CONFIG
        .with(|p| p.borrow().clone())
        .or_else(|| std::env::var_os(CONFIG_ENV).map(PathBuf::from))
}

/// nvmlInit*: one more reference.
pub fn acquire() {
    with_init_count(|n| *n = n.saturating_add(1));
}

/// nvmlShutdown: one reference less; UNINITIALIZED when there was none.
pub fn release() -> Res<()> {
    with_init_count(|n| {
        if *n == 0 {
            Err(NVML_ERROR_UNINITIALIZED)
        } else {
            *n -= 1;
            Ok(())
        }
    })
}

/// Reads the machine description now (it is re-read on every call). A missing
/// or bad file is NVML_ERROR_UNKNOWN, with one line on stderr saying why.
pub fn load_config() -> Res<Config> {
    let Some(path) = config_path() else {
        eprintln!(
            "fake-nvml: {CONFIG_ENV} is not set; it must name the machine description (JSON)"
        );
        return Err(NVML_ERROR_UNKNOWN);
    };
    config::load(&path).map_err(|e| {
        eprintln!("fake-nvml: cannot use config {}: {e}", path.display());
        NVML_ERROR_UNKNOWN
    })
}

/// UNINITIALIZED before nvmlInit (and after the last nvmlShutdown).
pub fn require_init() -> Res<()> {
    if with_init_count(|n| *n) == 0 {
        return Err(NVML_ERROR_UNINITIALIZED);
    }
    Ok(())
}

/// The config, for any function but init/shutdown/nvmlErrorString:
/// UNINITIALIZED before nvmlInit.
pub fn session() -> Res<Config> {
    require_init()?;
    load_config()
}

// ----- device handles -----
//
// A handle is a pointer-sized tag, never dereferenced: HANDLE_BASE + index.
// Anything else (null, a stray pointer) is INVALID_ARGUMENT; a well-formed
// handle whose index is no longer in the config is GPU_IS_LOST.

const HANDLE_BASE: usize = 0x6e76_0000; // "nv"
const MAX_HANDLES: usize = 0x1_0000;

pub fn handle_for(index: usize) -> nvmlDevice_t {
    ptr::without_provenance_mut(HANDLE_BASE + index)
}

pub fn index_of(handle: nvmlDevice_t) -> Res<usize> {
    handle
        .addr()
        .checked_sub(HANDLE_BASE)
        .filter(|i| *i < MAX_HANDLES)
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)
}

/// The GPU at `index` as seen by function `func`: its `errors` override for
/// `func` first, then GPU_IS_LOST if it is `lost` (unless `readable_when_lost`).
pub fn gpu_at<'c>(
    cfg: &'c Config,
    index: usize,
    func: &str,
    readable_when_lost: bool,
) -> Res<&'c Gpu> {
    let gpu = cfg.gpus.get(index).ok_or(NVML_ERROR_GPU_IS_LOST)?;
    if let Some(e) = gpu.errors.get(func) {
        return Err(e.0);
    }
    if gpu.lost && !readable_when_lost {
        return Err(NVML_ERROR_GPU_IS_LOST);
    }
    Ok(gpu)
}

/// The GPU behind `handle`, for per-device function `func`. A MIG device
/// handle is NOT_SUPPORTED here: these functions are the ones real NVML
/// refuses for MIG devices.
pub fn device<'c>(cfg: &'c Config, handle: nvmlDevice_t, func: &str) -> Res<(usize, &'c Gpu)> {
    if mig_of(handle).is_some() {
        return Err(NVML_ERROR_NOT_SUPPORTED);
    }
    let index = index_of(handle)?;
    Ok((index, gpu_at(cfg, index, func, false)?))
}

/// Like [`device`], for the few functions that still answer for a lost GPU.
pub fn device_identity<'c>(
    cfg: &'c Config,
    handle: nvmlDevice_t,
    func: &str,
) -> Res<(usize, &'c Gpu)> {
    if mig_of(handle).is_some() {
        return Err(NVML_ERROR_NOT_SUPPORTED);
    }
    let index = index_of(handle)?;
    Ok((index, gpu_at(cfg, index, func, true)?))
}

// ----- MIG handles -----
//
// Tags like the GPU handles, in ranges of their own so that a MIG device, a
// GPU instance, a compute instance and a GPU can never be taken for one
// another: base + (gpu index << 9 | gi id << 3 | ci id), with gpu index <
// 0x1_0000, gi id <= 63 and ci id <= 7 (config::MAX_GI_ID, MAX_CI_ID), so
// each range spans 0x200_0000, below the GPU handles' 0x6e76_0000.

const MIG_HANDLE_BASE: usize = 0x4000_0000;
const GI_HANDLE_BASE: usize = 0x4400_0000;
const CI_HANDLE_BASE: usize = 0x4800_0000;
const INSTANCE_SPAN: usize = 0x200_0000;

fn pack(base: usize, gpu: usize, gi: u32, ci: u32) -> usize {
    base + ((gpu << 9) | ((gi as usize & 0x3F) << 3) | (ci as usize & 0x7))
}

fn unpack(base: usize, addr: usize) -> Option<(usize, u32, u32)> {
    let off = addr.checked_sub(base).filter(|o| *o < INSTANCE_SPAN)?;
    Some((off >> 9, ((off >> 3) & 0x3F) as u32, (off & 0x7) as u32))
}

/// The MIG device of GPU `gpu`, GPU instance `gi`, compute instance `ci`.
pub fn mig_handle(gpu: usize, gi: u32, ci: u32) -> nvmlDevice_t {
    ptr::without_provenance_mut(pack(MIG_HANDLE_BASE, gpu, gi, ci))
}

/// (GPU index, GI id, CI id) if `handle` is a MIG device handle.
pub fn mig_of(handle: nvmlDevice_t) -> Option<(usize, u32, u32)> {
    unpack(MIG_HANDLE_BASE, handle.addr())
}

pub fn gi_handle(gpu: usize, gi: u32) -> nvmlGpuInstance_t {
    ptr::without_provenance_mut(pack(GI_HANDLE_BASE, gpu, gi, 0))
}

/// (GPU index, GI id) of a GPU instance handle; anything else is
/// INVALID_ARGUMENT.
pub fn gi_of(handle: nvmlGpuInstance_t) -> Res<(usize, u32)> {
    match unpack(GI_HANDLE_BASE, handle.addr()) {
        Some((gpu, gi, 0)) => Ok((gpu, gi)),
        _ => Err(NVML_ERROR_INVALID_ARGUMENT),
    }
}

pub fn ci_handle(gpu: usize, gi: u32, ci: u32) -> nvmlComputeInstance_t {
    ptr::without_provenance_mut(pack(CI_HANDLE_BASE, gpu, gi, ci))
}

/// (GPU index, GI id, CI id) of a compute instance handle; anything else is
/// INVALID_ARGUMENT.
pub fn ci_of(handle: nvmlComputeInstance_t) -> Res<(usize, u32, u32)> {
    unpack(CI_HANDLE_BASE, handle.addr()).ok_or(NVML_ERROR_INVALID_ARGUMENT)
}

/// What a device handle names: a GPU, or a MIG device of a GPU.
pub enum Dev<'c> {
    Gpu(&'c Gpu),
    Mig(usize, &'c Gpu, &'c GpuInstance),
}

/// Resolves a GPU or MIG device handle for a function that accepts both.
/// A MIG device answers its parent's `errors` override and `lost`; one whose
/// compute instance no longer exists (or whose GPU left MIG mode) is
/// INVALID_ARGUMENT.
pub fn any_device<'c>(
    cfg: &'c Config,
    handle: nvmlDevice_t,
    func: &str,
    readable_when_lost: bool,
) -> Res<Dev<'c>> {
    if let Some((g, gi, ci)) = mig_of(handle) {
        let gpu = gpu_at(cfg, g, func, false)?;
        let inst = gpu
            .mig
            .instances
            .iter()
            .find(|i| i.gi_id == gi && i.ci_id == Some(ci))
            .filter(|_| gpu.mig.mode)
            .ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        return Ok(Dev::Mig(g, gpu, inst));
    }
    let index = index_of(handle)?;
    Ok(Dev::Gpu(gpu_at(cfg, index, func, readable_when_lost)?))
}

// ----- writing the config back (MIG create/destroy/set mode) -----

/// One writer at a time in this process. Writers in other processes are
/// not excluded: the last rename wins.
static WRITE_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A change to the machine: reads the config (as `session` does) and its
/// raw JSON, lets `change` edit the JSON, checks that the result is still a
/// valid config, and writes it back atomically (temp file in the same
/// directory, then rename). If `change` fails nothing is written.
pub fn transact<R>(change: impl FnOnce(&Config, &mut serde_json::Value) -> Res<R>) -> Res<R> {
    require_init()?;
    let Some(path) = config_path() else {
        // load_config says why on stderr.
        return Err(load_config().err().unwrap_or(NVML_ERROR_UNKNOWN));
    };
    let _lock = WRITE_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let cfg = load_config()?;
    let fail = |what: String| {
        eprintln!("fake-nvml: cannot write config {}: {what}", path.display());
        NVML_ERROR_UNKNOWN
    };
    let text = std::fs::read_to_string(&path).map_err(|e| fail(e.to_string()))?;
    let mut root: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| fail(e.to_string()))?;
    let r = change(&cfg, &mut root)?;
    let mut new = serde_json::to_string_pretty(&root).map_err(|e| fail(e.to_string()))?;
    new.push('\n');
    config::parse(&new).map_err(|e| fail(format!("the change would make it invalid: {e}")))?;
    let file = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{file}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, new).map_err(|e| fail(e.to_string()))?;
    std::fs::rename(&tmp, &path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        fail(e.to_string())
    })?;
    Ok(r)
}

// ----- caller memory -----

/// A checked, non-null out-pointer.
pub struct Out<T>(NonNull<T>);

/// Checks an out-pointer: null is INVALID_ARGUMENT.
///
/// # Safety
/// `p` must be null or valid for a write of one `T` (the NVML API contract,
/// passed on by every exported function's own `# Safety`).
pub unsafe fn out<T>(p: *mut T) -> Res<Out<T>> {
    NonNull::new(p).map(Out).ok_or(NVML_ERROR_INVALID_ARGUMENT)
}

impl<T> Out<T> {
    pub fn set(self, value: T) {
        // SAFETY: `out` checked non-null; its caller vouched for validity.
        unsafe { self.0.as_ptr().write(value) }
    }

    /// Reads an in/out parameter (a count the caller set, a struct version).
    pub fn get(&self) -> T
    where
        T: Copy,
    {
        // SAFETY: as for `set`; for in/out parameters the NVML contract also
        // has the caller initialize the value.
        unsafe { self.0.as_ptr().read() }
    }
}

/// Reads a caller's input struct: null is INVALID_ARGUMENT.
///
/// # Safety
/// `p` must be null or valid for a read of one initialized `T`.
pub unsafe fn in_value<T: Copy>(p: *const T) -> Res<T> {
    if p.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and valid per the caller's contract.
    Ok(unsafe { p.read() })
}

/// A checked caller buffer of `len` elements.
pub struct OutArray<T> {
    p: NonNull<T>,
    len: usize,
}

/// Checks a caller array: null is INVALID_ARGUMENT.
///
/// # Safety
/// `p` must be null or valid for writes of `len` elements.
pub unsafe fn out_array<T>(p: *mut T, len: c_uint) -> Res<OutArray<T>> {
    let p = NonNull::new(p).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    Ok(OutArray {
        p,
        len: len as usize,
    })
}

impl<T: Copy> OutArray<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    /// Writes `values` from the start; they must fit (checked, else
    /// INSUFFICIENT_SIZE and nothing is written).
    pub fn write(&self, values: &[T]) -> Res<()> {
        if values.len() > self.len {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        // SAFETY: the caller vouched for `len` writable elements (out_array);
        // values.len() <= len, and caller memory cannot overlap our slice.
        unsafe { ptr::copy_nonoverlapping(values.as_ptr(), self.p.as_ptr(), values.len()) };
        Ok(())
    }
}

/// Checks a caller string buffer of `len` bytes: null is INVALID_ARGUMENT.
///
/// # Safety
/// `p` must be null or valid for writes of `len` bytes.
pub unsafe fn out_str(p: *mut c_char, len: c_uint) -> Res<OutArray<c_char>> {
    // SAFETY: same contract.
    unsafe { out_array(p, len) }
}

impl OutArray<c_char> {
    /// Copies `s` and its NUL; INSUFFICIENT_SIZE (nothing written) when the
    /// buffer is shorter than `s.len() + 1`.
    pub fn set_str(&self, s: &str) -> Res<()> {
        let mut bytes: Vec<c_char> = s.bytes().map(|b| b as c_char).collect();
        bytes.push(0);
        self.write(&bytes)
    }
}

/// Reads a caller's C string: null or non-UTF-8 is INVALID_ARGUMENT.
///
/// # Safety
/// `p` must be null or point to a NUL-terminated string that outlives `'a`.
pub unsafe fn in_str<'a>(p: *const c_char) -> Res<&'a str> {
    if p.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and NUL-terminated per the caller's contract.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map_err(|_| NVML_ERROR_INVALID_ARGUMENT)
}

/// Fills an `nvmlPciInfo_t` for `bus` (busId, busIdLegacy, domain, bus,
/// device; pciSubSystemId 0).
pub fn pci_info(bus: &config::BusId, pci_device_id: u32) -> nvmlPciInfo_t {
    let mut info = nvmlPciInfo_t {
        busIdLegacy: [0; NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE],
        domain: bus.domain,
        bus: bus.bus,
        device: bus.device,
        pciDeviceId: pci_device_id,
        pciSubSystemId: 0,
        busId: [0; NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE],
    };
    // The strings are 16 and 12 chars (BusId::parse bounds every field), so
    // they fit with their NULs; writing at most len - 1 bytes keeps a NUL.
    for (d, s) in info.busId[..NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE - 1]
        .iter_mut()
        .zip(bus.canonical().bytes())
    {
        *d = s as c_char;
    }
    for (d, s) in info.busIdLegacy[..NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE - 1]
        .iter_mut()
        .zip(bus.legacy().bytes())
    {
        *d = s as c_char;
    }
    info
}
