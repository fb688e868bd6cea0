//! An allocation round: views of the frameworks and of the agents with
//! something free, offers made and sent; shares attached; reclaims.

use std::collections::{BTreeMap, BTreeSet};

use gpuctl_core::types::Resources;
use gpuctl_proto::pb;

use crate::allocator::{self, AgentView, Demand, FrameworkView, OfferBook};
use crate::state::{Command, State};

use super::*;

/// Reclaim between frameworks: the kills of inverse offers whose deadline
/// passed, else, with none pending, a new inverse offer when a framework
/// below its fair share waits for room (`allocator::reclaim`).
pub(super) fn reclaim(
    state: &State,
    g: &mut Inner,
    settings: &FrameworkSettings,
    r: ReclaimSettings,
    now: u64,
) -> Vec<Command> {
    // Pending: ended tasks drop out; due ones are killed.
    g.reclaims.retain(|key, _| {
        state
            .task(key)
            .is_some_and(|t| !t.state.is_terminal() && !t.kill_requested)
    });
    let due: Vec<String> = g
        .reclaims
        .iter()
        .filter(|(_, p)| now >= p.deadline_ms)
        .map(|(k, _)| k.clone())
        .collect();
    let mut kills: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for key in due {
        if let Some(p) = g.reclaims.remove(&key) {
            kills
                .entry((p.framework_id, p.for_framework))
                .or_default()
                .push(key);
        }
    }
    if !kills.is_empty() || !g.reclaims.is_empty() {
        return kills
            .into_iter()
            .map(
                |((framework_id, for_framework), task_ids)| Command::ReclaimFrameworkTasks {
                    framework_id,
                    task_ids,
                    for_framework,
                    at_ms: now,
                },
            )
            .collect();
    }
    let frameworks = framework_views(state, g);
    let accepting = || state.agents().values().filter(|a| a.accepts_tasks());
    let total = allocator::cluster_total(accepting().map(|a| &a.info.total));
    // Outstanding offers count as room, not as used: room offered to a
    // framework that declines it is room a reclaim need not make, and an
    // offer does not hide an agent's room from the planner. (What a
    // framework is offered still counts in its own share: its offers are
    // at least one unit of its demand, so it is served by them.)
    let free: BTreeMap<String, Resources> = accepting()
        .filter(|a| !g.launching.contains_key(&a.info.id))
        .map(|a| (a.info.id.clone(), a.free()))
        .collect();
    let tasks: Vec<allocator::reclaim::RunningTask> = state
        .framework_tasks()
        .filter(|t| !t.state.is_terminal() && !t.kill_requested)
        .map(|t| allocator::reclaim::RunningTask {
            framework_id: t.framework_id.clone(),
            task_id: t.id.clone(),
            agent_id: t.agent_id.clone(),
            resources: t.resources,
            started_ms: t.created_at_ms,
        })
        .collect();
    let roles = crate::scheduler::tenants::roles_with_quotas(&settings.roles, state);
    let Some(plan) = allocator::reclaim::plan(&allocator::reclaim::Inputs {
        total,
        frameworks: &frameworks,
        roles: &roles,
        free: &free,
        tasks: &tasks,
        exempt: &[crate::state::frameworks::BUILTIN_FRAMEWORK_ID],
        now_ms: now,
        min_runtime_ms: u64::try_from(r.min_runtime.as_millis()).unwrap_or(u64::MAX),
    }) else {
        return Vec::new();
    };
    let deadline_ms = now.saturating_add(u64::try_from(r.notice.as_millis()).unwrap_or(u64::MAX));
    let reason = format!(
        "reclaimed for framework {} (below its fair share)",
        plan.for_framework
    );
    let mut by_framework: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for key in &plan.victims {
        let Some(t) = state.task(key) else { continue };
        by_framework
            .entry(t.framework_id.clone())
            .or_default()
            .push(t.framework_task_id.clone());
        g.reclaims.insert(
            key.clone(),
            PendingReclaim {
                framework_id: t.framework_id.clone(),
                for_framework: plan.for_framework.clone(),
                deadline_ms,
            },
        );
    }
    for (fw, task_ids) in by_framework {
        g.next_inverse_offer += 1;
        let id = format!("inverse-{now}-{}", g.next_inverse_offer);
        tracing::info!(framework_id = %fw, for_framework = %plan.for_framework, tasks = ?task_ids, deadline_ms, "inverse offer: reclaiming tasks for a framework below its fair share");
        if let Some(c) = g.conns.get(&fw) {
            let _ = c.tx.try_send(Ok(event(pb::event::Event::InverseOffer(
                pb::InverseOffer {
                    id,
                    agent_id: plan.agent_id.clone(),
                    task_ids,
                    deadline_unix_ms: deadline_ms,
                    reason: reason.clone(),
                },
            ))));
        }
    }
    Vec::new()
}

/// Whether the shared GPUs of an offer still have what it offered of them.
pub(super) fn shares_hold(state: &State, o: &allocator::Offer) -> bool {
    if o.shares.is_empty() {
        return true;
    }
    let Some(agent) = state.agent(&o.agent_id) else {
        return false;
    };
    o.shares.iter().all(|offered| {
        state.free_shares(agent).any(|f| {
            f.gpu.uuid == offered.gpu_uuid
                && f.mem_mib >= offered.mem_mib
                && f.compute_pct >= offered.compute_pct
        })
    })
}

/// Adds to the first plan on each agent of a framework with GPU_RESOURCES
/// the agent's shared GPUs that fractions may take and no outstanding
/// offer holds, with what their fractions leave: a shared GPU is in one
/// offer at a time, as a whole GPU is, so two frameworks never race for a
/// fraction. (Fractions are outside the allocator's fair shares: they count
/// no GPU, as `resources.gpus` is 0.)
pub(super) fn attach_shares(
    state: &State,
    book: &OfferBook,
    gpu_capable: &BTreeSet<&str>,
    plans: &mut [allocator::OfferPlan],
) {
    let mut served = BTreeSet::new();
    for p in plans.iter_mut() {
        if !gpu_capable.contains(p.framework_id.as_str()) || served.contains(&p.agent_id) {
            continue;
        }
        served.insert(p.agent_id.clone());
        let Some(agent) = state.agent(&p.agent_id) else {
            continue;
        };
        p.shares = state
            .free_shares(agent)
            .filter(|s| s.mem_mib > 0 && !book.is_gpu_offered(&s.gpu.uuid))
            .map(|s| allocator::OfferedShare {
                gpu_uuid: s.gpu.uuid.clone(),
                mem_mib: s.mem_mib,
                compute_pct: s.compute_pct,
            })
            .collect();
    }
}

/// Makes the offers the allocator plans; returns how many.
/// The connected frameworks as the allocator sees them: what each holds
/// (gpuctl jobs' tasks are the built-in scheduler's, so its role's share
/// and quota count them) and is offered, and what it asks for.
pub(super) fn framework_views(state: &State, g: &Inner) -> Vec<FrameworkView> {
    let offered_by = g
        .offers
        .as_ref()
        .map(|b| b.offered_by_framework())
        .unwrap_or_default();
    let mut held: BTreeMap<&str, Resources> = BTreeMap::new();
    for t in state.tasks().values().filter(|t| !t.state.is_terminal()) {
        let owner = if !t.framework_id.is_empty() {
            t.framework_id.as_str()
        } else if !t.job_id.is_empty() {
            crate::state::frameworks::BUILTIN_FRAMEWORK_ID
        } else {
            continue;
        };
        let e = held.entry(owner).or_default();
        *e = e.add(&t.resources);
    }
    state
        .frameworks()
        .values()
        .filter(|f| !f.removed && g.conns.contains_key(&f.info.id))
        .map(|f| FrameworkView {
            id: f.info.id.clone(),
            role: f.info.role().to_string(),
            gpu_capable: f.info.gpu_capable,
            suppressed: g.suppressed.contains(&f.info.id),
            // The built-in scheduler's queue holds jobs of every size.
            demand: if f.info.id == crate::state::frameworks::BUILTIN_FRAMEWORK_ID {
                Demand::Whole
            } else {
                g.demands.get(&f.info.id).copied().unwrap_or_default()
            },
            allocated: held
                .get(f.info.id.as_str())
                .copied()
                .unwrap_or_default()
                .add(&offered_by.get(&f.info.id).copied().unwrap_or_default()),
        })
        .collect()
}

/// Views of the agents with something to offer: taking tasks, not being
/// launched on, with resources or devices not yet offered.
fn offerable_agents(state: &State, g: &Inner, book: &OfferBook) -> Vec<AgentView> {
    state
        .agents()
        .values()
        .filter(|a| a.accepts_tasks())
        .filter(|a| !g.launching.contains_key(&a.info.id))
        .filter_map(|a| {
            let free = a.free().saturating_sub(&book.offered_on_agent(&a.info.id));
            if free.gpus == 0 && free.mem_mib == 0 && free.cpus <= 0.0 {
                return None;
            }
            Some(AgentView {
                id: a.info.id.clone(),
                hostname: a.info.hostname.clone(),
                free,
                // Devices: whole GPUs and MIG devices, one entry each.
                free_gpus: gpuctl_core::types::devices(&a.info.gpus)
                    .filter(|d| {
                        free.gpus > 0 && state.device_free(*d) && !book.is_gpu_offered(d.uuid())
                    })
                    .map(|d| d.to_gpu())
                    .collect(),
                total: a.info.total,
                attributes: a.info.attributes.clone(),
            })
        })
        .collect()
}

/// An offer as its framework gets it (`None` when its agent is gone).
fn offer_to_pb(state: &State, o: &allocator::Offer) -> Option<pb::Offer> {
    let agent = state.agent(&o.agent_id)?;
    // A MIG device is offered inside its parent's entry.
    let gpus = gpuctl_core::types::gpus_of_devices(&agent.info.gpus, &o.gpu_uuids)
        .into_iter()
        .map(Into::into)
        .collect();
    let shared_gpus = o
        .shares
        .iter()
        .filter_map(|sh| {
            let gpu = agent.info.gpus.iter().find(|g| g.uuid == sh.gpu_uuid)?;
            Some(pb::SharedGpu {
                gpu: Some(gpu.clone().into()),
                mode: state
                    .share_mode(&sh.gpu_uuid)
                    .map(|m| m.to_string())
                    .unwrap_or_default(),
                free_mem_mib: sh.mem_mib,
                free_compute_pct: sh.compute_pct,
            })
        })
        .collect();
    Some(pb::Offer {
        id: o.id.clone(),
        framework_id: o.framework_id.clone(),
        agent_id: o.agent_id.clone(),
        hostname: agent.info.hostname.clone(),
        resources: Some(agent.with_free_ports(o.resources).into()),
        gpus,
        attributes: agent.info.attributes.clone().into_iter().collect(),
        shared_gpus,
    })
}

pub(super) fn allocate(
    state: &State,
    g: &mut Inner,
    settings: &FrameworkSettings,
    now: u64,
) -> usize {
    if g.conns.is_empty() {
        return 0;
    }
    g.filters.expire(now);
    let Some(book) = g.offers.as_ref() else {
        return 0;
    };
    let frameworks = framework_views(state, g);
    // Nobody to offer to (the built-in scheduler suppresses offers while no
    // job waits): no need to look at the agents.
    if frameworks.iter().all(|f| f.suppressed) {
        return 0;
    }
    let accepting = || state.agents().values().filter(|a| a.accepts_tasks());
    let total = allocator::cluster_total(accepting().map(|a| &a.info.total));
    let agents = offerable_agents(state, g, book);
    // Tenants' GPU quotas apply to their roles too.
    let roles = crate::scheduler::tenants::roles_with_quotas(&settings.roles, state);
    let plans = allocator::allocate_within(
        total,
        &agents,
        &frameworks,
        &roles,
        &g.filters,
        &settings.allocator,
        now,
    );
    if plans.is_empty() {
        return 0;
    }
    let mut plans = plans;
    if state.has_shared_gpus() {
        let gpu_capable: BTreeSet<&str> = frameworks
            .iter()
            .filter(|f| f.gpu_capable)
            .map(|f| f.id.as_str())
            .collect();
        if let Some(book) = g.offers.as_ref() {
            attach_shares(state, book, &gpu_capable, &mut plans);
        }
    }
    let Some(book) = g.offers.as_mut() else {
        return 0;
    };
    let made = book.record(plans, now);
    let count = made.len();
    let mut by_framework: BTreeMap<String, Vec<pb::Offer>> = BTreeMap::new();
    for o in made {
        let Some(offer) = offer_to_pb(state, &o) else {
            continue;
        };
        by_framework
            .entry(o.framework_id.clone())
            .or_default()
            .push(offer);
    }
    let mut withdrawn = 0;
    for (fw, offers) in by_framework {
        let ids: Vec<String> = offers.iter().map(|o| o.id.clone()).collect();
        let sent = g.conns.get(&fw).is_some_and(|c| {
            c.tx.try_send(Ok(event(pb::event::Event::Offers(pb::Offers { offers }))))
                .is_ok()
        });
        if !sent {
            // Offers a framework never received would stay outstanding,
            // their agents offered to nobody, until the offer timeout:
            // they are withdrawn, and made again once its stream has room.
            let back = g
                .offers
                .as_mut()
                .map_or(0, |b| b.take_outstanding(&ids, &fw).len());
            withdrawn += back;
            tracing::warn!(framework_id = %fw, offers = back, "framework's event stream full; offers withdrawn");
        }
    }
    count - withdrawn
}
