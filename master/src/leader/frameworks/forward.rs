//! What frameworks are told: task updates (sent again until acknowledged),
//! lost agents, rescinded offers, heartbeats, and the frameworks whose
//! failover timeout passed.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use gpuctl_core::types::TaskState;
use gpuctl_proto::pb;

use crate::state::{State, TaskRecord};

use super::*;

/// Why a task is in its state, as the API says it: an UNREACHABLE task's
/// reason is its agent (the record keeps the reason it had, for when it
/// comes back).
pub fn wire_reason(t: &TaskRecord) -> pb::Reason {
    if t.state == TaskState::Unreachable {
        pb::Reason::AgentUnreachable
    } else {
        pb::Reason::from(t.reason)
    }
}

/// A task's status as its framework sees it. UNREACHABLE is the master's
/// word, not an agent's update: it carries no uuid and needs no
/// acknowledgement.
pub fn task_status(t: &TaskRecord, reason_override: Option<pb::Reason>) -> pb::TaskStatus {
    let reason = reason_override.unwrap_or(wire_reason(t));
    let uuid = if t.state == TaskState::Unreachable {
        Vec::new()
    } else {
        t.last_update_uuid.clone()
    };
    pb::TaskStatus {
        task_id: t.framework_task_id.clone(),
        agent_id: t.agent_id.clone(),
        state: pb::TaskState::from(t.state) as i32,
        reason: reason as i32,
        message: t.message.clone(),
        exit_code: t.exit_code,
        uuid,
        timestamp_ms: t.updated_at_ms,
    }
}

/// Sends each task's new update to its connected framework, and sends an
/// unacknowledged one again (its Acknowledge may have been lost) with a
/// growing wait, as Mesos' agents retry until the framework acknowledges.
pub(super) fn forward_updates(state: &State, g: &mut Inner, now: Instant, resend_after: Duration) {
    let Inner { conns, sent, .. } = g;
    // Tasks forgotten by the retention pass would stay here for as long as
    // their framework stays connected.
    sent.retain(|id, _| state.task(id).is_some());
    for t in state.framework_tasks() {
        let Some(conn) = conns.get(&t.framework_id) else {
            continue;
        };
        let key = (t.state, t.last_update_uuid.clone());
        let send = || {
            conn.tx
                .try_send(Ok(event(pb::event::Event::Update(task_status(t, None)))))
                .is_ok()
        };
        if let Some(s) = sent.get_mut(&t.id).filter(|s| s.key == key) {
            // UNREACHABLE is the master's word: nothing to acknowledge.
            let unacked = t.state != TaskState::Unreachable
                && !t.last_update_uuid.is_empty()
                && t.acked_uuid != t.last_update_uuid;
            if unacked && now >= s.due(resend_after) && send() {
                s.at = now;
                s.resends += 1;
            }
            continue;
        }
        let first = Sent {
            key,
            at: now,
            resends: 0,
        };
        // Nothing new for a task that ended and was acknowledged before the
        // framework (re)connected.
        if t.state.is_terminal()
            && !t.last_update_uuid.is_empty()
            && t.acked_uuid == t.last_update_uuid
        {
            sent.insert(t.id.clone(), first);
            continue;
        }
        if send() {
            sent.insert(t.id.clone(), first);
        }
    }
}

/// Tells every connected framework of each agent newly LOST, from the
/// capacity index's set of them (not a walk over every agent per pass).
pub(super) fn forward_failures(state: &State, g: &mut Inner) {
    let capacity = state.capacity();
    if *capacity.lost() == g.lost_agents {
        return;
    }
    let lost = capacity.lost().clone();
    for agent in lost.difference(&g.lost_agents) {
        for c in g.conns.values() {
            let _ =
                c.tx.try_send(Ok(event(pb::event::Event::Failure(pb::Failure {
                    agent_id: agent.clone(),
                }))));
        }
    }
    g.lost_agents = lost;
}

/// Withdraws offers that timed out or whose resources are gone (agent
/// unreachable, lost or draining, a GPU taken by a launch that went through another path, a GPU
/// unhealthy or cordoned, a shared GPU no longer shared or with less free
/// than offered).
pub(super) fn rescind_stale(state: &State, g: &mut Inner, now: u64, timeout: Duration) {
    let Some(book) = g.offers.as_mut() else {
        return;
    };
    let mut gone = book.expired(now, timeout.as_millis() as u64);
    let stale_agents: BTreeSet<String> = book
        .iter()
        .filter(|o| {
            state
                .agent(&o.agent_id)
                .is_none_or(|a| !a.accepts_tasks())
                || o.gpu_uuids.iter().any(|u| state.gpu_owner(u).is_some())
                // A GPU turned unhealthy or was cordoned since.
                || state.agent(&o.agent_id).is_some_and(|a| {
                    a.info
                        .gpus
                        .iter()
                        .any(|g| o.gpu_uuids.contains(&g.uuid) && !state.schedulable(g))
                })
                || !shares_hold(state, o)
        })
        .map(|o| o.agent_id.clone())
        .collect();
    for a in stale_agents {
        gone.extend(book.rescind_agent(&a));
    }
    for o in gone {
        send_rescind(&g.conns, o);
    }
}

/// A heartbeat to every connected framework, at most one per
/// `HEARTBEAT_INTERVAL` (`now`: the leader's monotonic clock).
pub(super) fn heartbeat(g: &mut Inner, now: Instant) {
    if g.last_heartbeat
        .is_some_and(|t| now.saturating_duration_since(t) < HEARTBEAT_INTERVAL)
    {
        return;
    }
    g.last_heartbeat = Some(now);
    for c in g.conns.values() {
        let _ =
            c.tx.try_send(Ok(event(pb::event::Event::Heartbeat(pb::Heartbeat {}))));
    }
}

/// Frameworks disconnected for longer than their failover timeout at `now`
/// (the leader's monotonic clock), to be removed.
pub(super) fn failover_expired(state: &State, g: &mut Inner, now: Instant) -> Vec<String> {
    // A framework this leader has never seen connected starts its clock now.
    for (id, f) in state.frameworks() {
        if id == crate::state::frameworks::BUILTIN_FRAMEWORK_ID {
            continue;
        }
        if !f.removed && !g.conns.contains_key(id) {
            g.disconnected_at.entry(id.clone()).or_insert(now);
        }
    }
    g.disconnected_at
        .iter()
        .filter(|(id, _)| id.as_str() != crate::state::frameworks::BUILTIN_FRAMEWORK_ID)
        .filter(|(id, since)| {
            state.framework(id).is_some_and(|f| {
                !f.removed
                    && now.saturating_duration_since(**since)
                        > Duration::from_millis(f.info.failover_timeout_ms)
            })
        })
        .map(|(id, _)| id.clone())
        .collect()
}
