//! The leader's side of the framework API: connected frameworks and their
//! event streams, outstanding offers, filters, and the loop that forwards
//! task updates, rescinds stale offers, enforces failover timeouts and runs
//! allocation cycles when something changes (event driven, plus a tick).
//!
//! Nothing here is replicated: offers, filters and connections are
//! ephemeral (Mesos' rule). A new leader starts with none; frameworks
//! re-subscribe to it.

use std::time::{Duration, Instant};

use gpuctl_proto::pb;
use tokio::sync::{mpsc, watch};

use crate::allocator::OfferBook;
use crate::now_ms;
use crate::raft::RaftHandle;
use crate::state::{Command, State};

mod forward;
mod hub;
mod offers;
mod settings;

pub use forward::{task_status, wire_reason};
pub use hub::{Hub, Launching, TakeOffersError};
pub use settings::{FrameworkSettings, ReclaimSettings};

use forward::*;
use hub::*;
use offers::*;

pub type EventSender = mpsc::Sender<Result<pb::Event, tonic::Status>>;

/// Event stream buffer per framework; a framework that does not read its
/// stream is disconnected rather than buffered without bound.
pub const EVENT_BUFFER: usize = 1024;
const TICK: Duration = Duration::from_secs(1);
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(10);
pub const DEFAULT_ALLOCATION_INTERVAL: Duration = Duration::from_millis(100);

/// The longest wait between two sends of an unacknowledged update.
pub const MAX_UPDATE_RESEND: Duration = Duration::from_secs(600);

/// The cluster's free resources, summed: when any grows, a round starts.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct FreeMark {
    agents: usize,
    cpus: f64,
    mem_mib: u64,
    gpus: u64,
    /// Memory of shared GPUs that no fraction holds: a freed fraction is
    /// offered again at once, as a freed GPU is.
    shared_mem_mib: u64,
}

impl FreeMark {
    /// From the state's capacity index: no walk over the agents.
    fn of(state: &State) -> FreeMark {
        let t = state.capacity().totals();
        FreeMark {
            agents: t.agents,
            cpus: t.milli_cpus as f64 / 1000.0,
            mem_mib: t.mem_mib,
            gpus: t.gpus,
            shared_mem_mib: t.shared_mem_mib,
        }
    }

    fn grew_from(&self, before: &FreeMark) -> bool {
        self.agents > before.agents
            || self.cpus > before.cpus + 1e-9
            || self.mem_mib > before.mem_mib
            || self.gpus > before.gpus
            || self.shared_mem_mib > before.shared_mem_mib
    }
}

/// The leader's framework loop.
pub async fn run(
    raft: RaftHandle,
    hub: std::sync::Arc<Hub>,
    settings: FrameworkSettings,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut applied = raft.applied();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let interval = settings.allocation_interval;
    // A change not yet allocated for, since when: its round comes one
    // interval later, so that what arrives within it is allocated together.
    let mut pending: Option<tokio::time::Instant> = Some(tokio::time::Instant::now());
    let mut last_round = tokio::time::Instant::now();
    loop {
        let due = pending.map(|since| (since + interval).max(last_round + interval));
        tokio::select! {
            _ = shutdown.changed() => return,
            r = applied.changed() => if r.is_err() { return },
            _ = hub.wake.notified() => {}
            _ = tick.tick() => {}
            _ = tokio::time::sleep_until(due.unwrap_or_else(tokio::time::Instant::now)), if due.is_some() => {}
        }
        let now = tokio::time::Instant::now();
        pending.get_or_insert(now);
        if !raft.status().serving {
            // No round is due on a follower: without this, `due` stays in
            // the past and the loop spins (it did, taking two of three
            // masters' CPU in the scale benchmark).
            pending = None;
            // Offers are the leader's; a deposed leader withdraws them and
            // sends its frameworks to the new leader.
            let mut g = hub.lock();
            g.offers = None;
            if !g.conns.is_empty() {
                let leader = raft.leader();
                let redirect = gpuctl_proto::leader::not_leader(
                    leader.as_ref().map(|(id, a)| (*id, a.as_str())),
                );
                for (_, c) in std::mem::take(&mut g.conns) {
                    let _ = c.tx.try_send(Err(redirect.clone()));
                }
            }
            continue;
        }
        let started = std::time::Instant::now();
        let round = {
            let state = raft.state();
            let mark = FreeMark::of(&state);
            let mut g = hub.lock();
            let prompt = std::mem::take(&mut g.prompt) || mark.grew_from(&g.last_free);
            g.last_free = mark;
            prompt || due.is_some_and(|d| now >= d)
        };
        let (expired, reclaims) = cycle(&raft, &hub, &settings, round);
        for c in reclaims {
            if let Err(e) = raft.propose(c).await {
                tracing::warn!(error = %e, "reclaim between frameworks refused");
            }
        }
        if round {
            pending = None;
            last_round = now;
            hub.metrics
                .allocation_cycle
                .observe(started.elapsed().as_secs_f64());
        }
        for framework_id in expired {
            tracing::warn!(framework_id = %framework_id, "framework failover timeout passed; removing it");
            if let Err(e) = raft
                .propose(Command::RemoveFramework {
                    framework_id: framework_id.clone(),
                    reason: "failover timeout passed".into(),
                    at_ms: now_ms(),
                })
                .await
            {
                tracing::warn!(framework_id = %framework_id, error = %e, "could not remove framework");
            }
        }
        // Coalesce bursts of changes into one pass.
        tokio::time::sleep(Duration::from_millis(20).min(interval)).await;
    }
}

/// One pass: updates, failures, rescinds, heartbeats, and, when `round`,
/// allocation and reclaim. Returns frameworks whose failover timeout
/// passed, and the kills of reclaims whose notice is over.
fn cycle(
    raft: &RaftHandle,
    hub: &Hub,
    settings: &FrameworkSettings,
    round: bool,
) -> (Vec<String>, Vec<Command>) {
    let state = raft.state();
    let mut g = hub.lock();
    let now = now_ms();
    if g.offers.is_none() {
        // Ids unique across leaders: start from the clock.
        g.offers = Some(OfferBook::starting_at(now));
    }
    let mono = Instant::now();
    forward_updates(&state, &mut g, mono, settings.update_resend_interval);
    forward_failures(&state, &mut g);
    rescind_stale(&state, &mut g, now, settings.offer_timeout);
    heartbeat(&mut g, mono);
    let expired = failover_expired(&state, &mut g, mono);
    let made = if round {
        allocate(&state, &mut g, settings, now)
    } else {
        0
    };
    hub.metrics
        .offers_made
        .fetch_add(made as u64, std::sync::atomic::Ordering::Relaxed);
    let reclaims = match settings.reclaim {
        Some(r) if round => reclaim(&state, &mut g, settings, r, now),
        _ => Vec::new(),
    };
    (expired, reclaims)
}

#[cfg(test)]
mod tests;
