//! Event sets: nvmlEventSetCreate, nvmlDeviceRegisterEvents,
//! nvmlEventSetWait_v2, nvmlEventSetFree.
//!
//! A set is a `Box<EventSet>` leaked into the `nvmlEventSet_t` pointer and
//! freed by nvmlEventSetFree. Live sets are also listed in `LIVE_SETS`, so a
//! stray or already-freed pointer is INVALID_ARGUMENT instead of a crash.
//!
//! Events come from the config's `events` list. A set delivers each event
//! (by `id`) at most once, and only if the event's GPU is registered in the
//! set with the event's type in its mask; sets are independent.
//!
//! # Safety (every function here)
//!
//! As in `exports.rs`: pointer arguments are null or valid for NVML's use.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::collections::{BTreeMap, BTreeSet};
use std::os::raw::{c_uint, c_ulonglong};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::ffi::*;
use crate::state::{self, guard, out, Res};

/// How often a waiting nvmlEventSetWait_v2 re-reads the config.
const POLL: Duration = Duration::from_millis(50);

#[derive(Debug, Default)]
struct EventSet {
    /// GPU index -> registered nvmlEventType* mask.
    registered: BTreeMap<usize, c_ulonglong>,
    /// Ids of the config events this set has delivered.
    delivered: BTreeSet<u64>,
}

/// Addresses of the live sets. Every access to a set happens with this lock
/// held, which is what makes handing out `&mut EventSet` sound.
static LIVE_SETS: Mutex<BTreeSet<usize>> = Mutex::new(BTreeSet::new());

fn live_sets() -> MutexGuard<'static, BTreeSet<usize>> {
    LIVE_SETS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `f` on the set behind `set`; INVALID_ARGUMENT if it is not a live set.
fn with_set<R>(set: nvmlEventSet_t, f: impl FnOnce(&mut EventSet) -> R) -> Res<R> {
    let live = live_sets();
    if !live.contains(&set.addr()) {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: addresses in LIVE_SETS come from Box::into_raw in
    // nvmlEventSetCreate and leave it (under this lock) before the Box is
    // freed, so the set is alive; holding the lock makes this the only
    // reference to it.
    let s = unsafe { &mut *set.cast::<EventSet>() };
    let r = f(s);
    drop(live);
    Ok(r)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    guard("nvmlEventSetCreate", || {
        state::require_init()?;
        let out = unsafe { out(set) }?;
        let p = Box::into_raw(Box::<EventSet>::default());
        live_sets().insert(p.addr());
        out.set(p.cast());
        Ok(())
    })
}

/// Adds `eventTypes` to the GPU's mask in the set. Types outside
/// nvmlDeviceGetSupportedEventTypes are NOT_SUPPORTED (nothing recorded), as
/// in real NVML.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    eventTypes: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    const NAME: &str = "nvmlDeviceRegisterEvents";
    guard(NAME, || {
        let cfg = state::session()?;
        let (index, _) = state::device(&cfg, device, NAME)?;
        if eventTypes & !SUPPORTED_EVENT_TYPES != 0 {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        with_set(set, |s| {
            *s.registered.entry(index).or_insert(0) |= eventTypes
        })
    })
}

/// Delivers the first config event not yet delivered by this set whose GPU
/// is registered for its type; otherwise re-reads the config every 50 ms
/// until `timeoutms` has passed, then TIMEOUT.
#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeoutms: c_uint,
) -> nvmlReturn_t {
    guard("nvmlEventSetWait_v2", || {
        state::require_init()?;
        let out = unsafe { out(data) }?;
        with_set(set, |_| ())?;
        let deadline = Instant::now() + Duration::from_millis(timeoutms.into());
        loop {
            let cfg = state::load_config()?;
            let hit = with_set(set, |s| {
                let ev = cfg.events.iter().find(|e| {
                    !s.delivered.contains(&e.id)
                        && s.registered
                            .get(&e.gpu_index)
                            .is_some_and(|mask| mask & e.kind.mask() != 0)
                })?;
                s.delivered.insert(ev.id);
                Some(ev)
            })?;
            if let Some(ev) = hit {
                out.set(nvmlEventData_t {
                    device: state::handle_for(ev.gpu_index),
                    eventType: ev.kind.mask(),
                    eventData: ev.data,
                    gpuInstanceId: NO_INSTANCE,
                    computeInstanceId: NO_INSTANCE,
                });
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(NVML_ERROR_TIMEOUT);
            }
            std::thread::sleep(POLL.min(deadline - now));
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    guard("nvmlEventSetFree", || {
        state::require_init()?;
        let mut live = live_sets();
        if !live.remove(&set.addr()) {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: it was live, so it is a Box::into_raw from
        // nvmlEventSetCreate, not freed yet; removing it from LIVE_SETS under
        // the lock means no one else can reach it any more.
        drop(unsafe { Box::from_raw(set.cast::<EventSet>()) });
        Ok(())
    })
}
