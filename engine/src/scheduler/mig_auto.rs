//! `--mig-auto`'s decision (the leader's loop is
//! `gpuctl_master::leader::mig_auto`): queued jobs that wait for a MIG
//! profile no free MIG device offers make an idle GPU repartition. The decision is pure
//! ([`mig_auto_commands`]) and goes through the log like an operator's
//! `gpus mig set` (`Command::SetMigLayout`, asked by `mig-auto`), so apply
//! re-checks that nothing holds the GPU.
//!
//! How it decides, per profile P that queued jobs ask for:
//! - enough already: the free MIG devices of P (on agents taking tasks)
//!   cover the tasks waiting for P, or a change under way makes P: wait;
//! - else one GPU is split into as many devices of P as it holds (NVML's
//!   most instances of P on an empty GPU), chosen among GPUs that are in
//!   MIG mode already (turning MIG mode on is an operator's decision: it
//!   may need a reset), healthy, not cordoned, idle (nothing holds the GPU
//!   or its MIG devices), with no change under way, that offer P, whose
//!   agent qualifies for the first waiting job (runtime, constraints,
//!   model, memory, driver), and none of whose MIG devices are of a
//!   profile that queued jobs want (what waits is never taken from);
//! - among those, the GPU with the fewest MIG devices (the least taken
//!   apart), then by agent and index.
//!
//! At most one change per profile per pass, and a GPU is never changed
//! twice at once; once a change is recorded its devices are placed by the
//! scheduler before the next pass could want them for something else
//! (their profile is then wanted, so they are not taken from).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use gpuctl_core::types::{devices, GpuInfo, JobState, MigDevice};

use crate::scheduler::placement::{self, NodeDriver, NodeView};
use crate::state::{Command, State};

/// Who the changes are asked by (`MigChange::by`).
pub const BY: &str = "mig-auto";

/// How often the leader looks.
pub const PASS_EVERY: Duration = Duration::from_secs(2);

/// The layout changes to ask now (see the module's doc).
pub fn mig_auto_commands(state: &State, now_ms: u64) -> Vec<Command> {
    // Tasks waiting per profile, and the first job of each (queue order).
    let mut waiting: BTreeMap<&str, (u32, &crate::state::JobRecord)> = BTreeMap::new();
    for j in state.queued_jobs() {
        if j.state != JobState::Queued || j.cancel_requested {
            continue;
        }
        if let Some(p) = j.spec.placement.mig.as_deref() {
            let e = waiting.entry(p).or_insert((0, j));
            e.0 = e.0.saturating_add(j.spec.replicas());
        }
    }
    if waiting.is_empty() {
        return Vec::new();
    }
    let active: Vec<_> = state
        .agents()
        .values()
        .filter(|a| a.accepts_tasks())
        .collect();
    let mut chosen: BTreeSet<&str> = BTreeSet::new();
    let mut out = Vec::new();
    for (profile, (tasks, first)) in &waiting {
        let free = active
            .iter()
            .flat_map(|a| devices(&a.info.gpus))
            .filter(|d| d.mig_profile() == Some(*profile) && state.device_free(*d))
            .count();
        let coming = state
            .mig_changes()
            .any(|c| c.profiles.iter().any(|p| p == profile));
        if free >= *tasks as usize || coming {
            continue;
        }
        let req = crate::scheduler::request(first, now_ms);
        let mut best: Option<(usize, &str, u32, &GpuInfo, u32)> = None;
        for a in &active {
            for g in &a.info.gpus {
                let Some(p) = g.mig.profiles.iter().find(|p| p.name == *profile) else {
                    continue;
                };
                let wanted_here = g
                    .mig
                    .devices
                    .iter()
                    .any(|d| waiting.contains_key(d.profile.as_str()));
                let usable = g.mig.enabled
                    && g.healthy
                    && p.max_count > 0
                    && !state.is_cordoned(&g.uuid)
                    && state.mig_change(&g.uuid).is_none()
                    && state.mig_holder(g).is_none()
                    && !wanted_here
                    && !chosen.contains(g.uuid.as_str());
                if !usable {
                    continue;
                }
                // The GPU as it would be, for the job's placement checks.
                let split = split_into(g, profile, p.memory_mib, p.max_count);
                let view = NodeView {
                    id: &a.info.id,
                    attributes: &a.info.attributes,
                    runtimes: &a.info.runtimes,
                    allow_root_tasks: a.info.allow_root_tasks,
                    allowed_mounts: &a.info.allowed_mounts,
                    allowed_users: a.info.allowed_users.as_ref(),
                    free: a.info.total,
                    free_gpus: Vec::new(),
                    all_gpus: std::slice::from_ref(&split),
                    free_mig: Vec::new(),
                    free_shared: Vec::new(),
                    driver: NodeDriver::new(
                        a.info.driver_version.as_deref(),
                        a.info.cuda_driver_version.as_deref(),
                    ),
                };
                if !placement::node_matches(&req, &view) {
                    continue;
                }
                let key = (g.mig.devices.len(), a.info.id.as_str(), g.index);
                if best.as_ref().is_none_or(|b| key < (b.0, b.1, b.2)) {
                    best = Some((key.0, key.1, key.2, g, p.max_count));
                }
            }
        }
        if let Some((_, _, _, g, count)) = best {
            chosen.insert(g.uuid.as_str());
            out.push(Command::SetMigLayout {
                gpu_uuid: g.uuid.clone(),
                profiles: vec![(*profile).to_string(); count as usize],
                disable: false,
                by: BY.to_string(),
                at_ms: now_ms,
            });
        }
    }
    out
}

/// `g` holding `count` MIG devices of `profile` (placeholders).
fn split_into(g: &GpuInfo, profile: &str, memory_mib: u64, count: u32) -> GpuInfo {
    let mut out = g.clone();
    out.mig.devices = (0..count)
        .map(|i| MigDevice {
            uuid: format!("{}-planned-{i}", g.uuid),
            profile: profile.to_string(),
            memory_mib,
            gpu_slices: 0,
            compute_slices: 0,
            gi_id: 0,
            ci_id: 0,
            caps_minors: Vec::new(),
        })
        .collect();
    out
}
