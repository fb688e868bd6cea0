//! The registry of connected frameworks and what the loop keeps for them:
//! event streams, offers outstanding, filters, demands, launches under way.
//! The API calls and the loop share it behind one lock.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpuctl_core::types::{Resources, TaskState};
use gpuctl_proto::pb;
use tokio::sync::Notify;

use crate::allocator::{self, Demand, Filters, OfferBook};

use super::*;

/// Tasks of an inverse offer, killed at its deadline.
pub(super) struct PendingReclaim {
    pub(super) framework_id: String,
    pub(super) for_framework: String,
    pub(super) deadline_ms: u64,
}

pub(super) struct Conn {
    pub(super) id: u64,
    pub(super) tx: EventSender,
}

#[derive(Default)]
pub(super) struct Inner {
    pub(super) conns: BTreeMap<String, Conn>,
    pub(super) next_conn: u64,
    pub(super) disconnected_at: BTreeMap<String, Instant>,
    pub(super) suppressed: BTreeSet<String>,
    pub(super) filters: Filters,
    pub(super) offers: Option<OfferBook>,
    /// The last update sent per task: each change is sent once, and again
    /// while unacknowledged.
    pub(super) sent: BTreeMap<String, Sent>,
    pub(super) lost_agents: BTreeSet<String>,
    pub(super) last_heartbeat: Option<Instant>,
    /// Agents with accepted offers being launched on (see `Hub::launching`).
    pub(super) launching: BTreeMap<String, usize>,
    /// What each framework has shown it asks for (see [`Demand`]).
    pub(super) demands: BTreeMap<String, Demand>,
    /// Frameworks whose demand is their own statement (Subscribe, Revive):
    /// what they launch or decline does not change it, so that a framework
    /// that declines what it cannot use keeps its unit (and its claim to a
    /// reclaim) rather than becoming one that takes whole agents.
    pub(super) declared: BTreeSet<String>,
    /// A round is due at once (a Revive).
    pub(super) prompt: bool,
    /// The free resources at the last round, to see what was freed since.
    pub(super) last_free: FreeMark,
    /// Tasks under an inverse offer, by key; one reclaim at a time.
    pub(super) reclaims: BTreeMap<String, PendingReclaim>,
    pub(super) next_inverse_offer: u64,
}

/// A task's update as last sent to its framework.
pub(super) struct Sent {
    /// (state, update uuid): a change of either is a new update.
    pub(super) key: (TaskState, Vec<u8>),
    pub(super) at: Instant,
    /// Sends of this update after the first.
    pub(super) resends: u32,
}

impl Sent {
    /// When it is due again if still unacknowledged.
    pub(super) fn due(&self, first: Duration) -> Instant {
        let wait = first
            .saturating_mul(1u32 << self.resends.min(16))
            .min(MAX_UPDATE_RESEND.max(first));
        self.at + wait
    }
}

/// Agents being launched on; dropping it makes them offerable again.
pub struct Launching<'h> {
    pub(super) hub: &'h Hub,
    pub(super) agents: BTreeSet<String>,
}

impl Drop for Launching<'_> {
    fn drop(&mut self) {
        let mut g = self.hub.lock();
        for a in &self.agents {
            if let Some(n) = g.launching.get_mut(a) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    g.launching.remove(a);
                }
            }
        }
        drop(g);
        self.hub.wake();
    }
}

pub struct Hub {
    pub(super) inner: Mutex<Inner>,
    pub(super) wake: Notify,
    /// The leader loops' counters and histograms, for `/metrics`.
    pub metrics: crate::metrics::MasterMetrics,
}

impl Default for Hub {
    fn default() -> Self {
        Hub {
            inner: Mutex::new(Inner::default()),
            wake: Notify::new(),
            metrics: Default::default(),
        }
    }
}

/// Why offers could not be taken for Accept or Decline.
#[derive(Debug, thiserror::Error)]
pub enum TakeOffersError {
    /// Not the leader, or not yet making offers.
    #[error("this master is not making offers")]
    NotOffering,
    #[error("invalid offer_ids: {0}")]
    Offer(#[from] allocator::OfferError),
}

pub(super) fn event(e: pb::event::Event) -> pb::Event {
    pb::Event { event: Some(e) }
}

/// Tells the framework an offer is withdrawn. Not the built-in scheduler:
/// it takes only what is still outstanding and ignores rescinds, and one
/// event per offer (thousands when a big cluster's offers time out
/// together) would fill its stream ahead of the next offers.
pub(super) fn send_rescind(conns: &BTreeMap<String, Conn>, offer: allocator::Offer) {
    if offer.framework_id == crate::state::frameworks::BUILTIN_FRAMEWORK_ID {
        return;
    }
    if let Some(c) = conns.get(&offer.framework_id) {
        let _ =
            c.tx.try_send(Ok(event(pb::event::Event::Rescind(pb::Rescind {
                offer_id: offer.id,
            }))));
    }
}

impl Hub {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Offers made and still open (0 on a follower).
    pub fn offers_outstanding(&self) -> usize {
        self.lock().offers.as_ref().map_or(0, |b| b.len())
    }

    /// Something changed that may make new offers possible.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Attaches a framework's event stream (replacing an older one) and
    /// queues SUBSCRIBED. Returns the connection id.
    pub fn connect(&self, framework_id: &str, tx: EventSender) -> u64 {
        self.connect_suppressed(framework_id, tx, None)
    }

    /// [`connect`](Self::connect), the subscription stating whether the
    /// framework wants offers (`Some`), as Mesos' SUBSCRIBE states its
    /// suppressed roles: suppression is the leader's memory, not Raft's, so
    /// a framework restates it when it subscribes at a new leader. `None`
    /// keeps what this leader knew.
    pub fn connect_suppressed(
        &self,
        framework_id: &str,
        tx: EventSender,
        suppressed: Option<bool>,
    ) -> u64 {
        let mut g = self.lock();
        match suppressed {
            Some(true) => {
                g.suppressed.insert(framework_id.to_string());
            }
            Some(false) => {
                g.suppressed.remove(framework_id);
            }
            None => {}
        }
        g.next_conn += 1;
        let id = g.next_conn;
        let _ = tx.try_send(Ok(event(pb::event::Event::Subscribed(pb::Subscribed {
            framework_id: framework_id.to_string(),
            heartbeat_interval_secs: HEARTBEAT_INTERVAL.as_secs_f64(),
        }))));
        if let Some(old) = g.conns.insert(framework_id.to_string(), Conn { id, tx }) {
            let _ = old.tx.try_send(Ok(event(pb::event::Event::Error(
                "another connection subscribed as this framework".into(),
            ))));
        }
        g.disconnected_at.remove(framework_id);
        // Resend what it may have missed: every update of its tasks.
        let prefix = format!("{framework_id}.");
        g.sent.retain(|k, _| !k.starts_with(&prefix));
        drop(g);
        self.wake();
        id
    }

    /// The stream `conn` ended: the framework is disconnected (its tasks
    /// keep running until its failover timeout) and its offers withdrawn.
    pub fn disconnect(&self, framework_id: &str, conn: u64) {
        let mut g = self.lock();
        if g.conns.get(framework_id).is_some_and(|c| c.id == conn) {
            g.conns.remove(framework_id);
            // The built-in scheduler has no failover timeout: it is part of
            // the master and comes back with the next leader.
            if framework_id != crate::state::frameworks::BUILTIN_FRAMEWORK_ID {
                g.disconnected_at
                    .insert(framework_id.to_string(), Instant::now());
            }
            if let Some(book) = g.offers.as_mut() {
                book.rescind_framework(framework_id);
            }
        }
        drop(g);
        self.wake();
    }

    pub fn is_connected(&self, framework_id: &str) -> bool {
        self.lock().conns.contains_key(framework_id)
    }

    /// Takes offers for Accept/Decline: all or nothing, as the API says.
    /// When one is at fault, the caller's others are released all the same
    /// (as Mesos recovers the valid offers of a bad Accept), so that no
    /// agent waits out the offer timeout behind an offer nobody holds.
    pub fn take_offers(
        &self,
        framework_id: &str,
        offer_ids: &[String],
    ) -> Result<Vec<allocator::Offer>, TakeOffersError> {
        self.checked_offers(framework_id, offer_ids, true)
    }

    /// The offers Accept names, left outstanding: checked like
    /// [`take_offers`](Self::take_offers), with the same release of the
    /// caller's valid offers when one is at fault.
    pub fn peek_offers(
        &self,
        framework_id: &str,
        offer_ids: &[String],
    ) -> Result<Vec<allocator::Offer>, TakeOffersError> {
        self.checked_offers(framework_id, offer_ids, false)
    }

    pub(super) fn checked_offers(
        &self,
        framework_id: &str,
        offer_ids: &[String],
        take: bool,
    ) -> Result<Vec<allocator::Offer>, TakeOffersError> {
        let mut g = self.lock();
        let book = g.offers.as_mut().ok_or(TakeOffersError::NotOffering)?;
        let checked = if take {
            book.take(offer_ids, framework_id)
        } else {
            book.peek(offer_ids, framework_id)
        };
        match checked {
            Ok(offers) => Ok(offers),
            Err(e) => {
                let released = book.take_outstanding(offer_ids, framework_id);
                drop(g);
                if !released.is_empty() {
                    self.wake();
                }
                Err(e.into())
            }
        }
    }

    /// Takes those of the offers still outstanding (some may have been
    /// rescinded since they were sent), for the built-in scheduler.
    pub fn take_outstanding(
        &self,
        framework_id: &str,
        offer_ids: &[String],
    ) -> Vec<allocator::Offer> {
        let mut g = self.lock();
        g.offers
            .as_mut()
            .map(|b| b.take_outstanding(offer_ids, framework_id))
            .unwrap_or_default()
    }

    /// Marks agents as launching what was accepted on them until the guard
    /// drops: nothing of theirs is offered meanwhile, since what is being
    /// launched is not in the state until its command commits.
    pub fn launching(&self, agents: &BTreeSet<String>) -> Launching<'_> {
        let mut g = self.lock();
        for a in agents {
            *g.launching.entry(a.clone()).or_default() += 1;
        }
        Launching {
            hub: self,
            agents: agents.clone(),
        }
    }

    /// Don't offer these agents to the framework until `until_ms`, unless
    /// one has more than what it declined there (`refused`, by agent).
    pub fn filter_declined(
        &self,
        framework_id: &str,
        refused: &BTreeMap<String, Resources>,
        until_ms: Option<u64>,
    ) {
        if let Some(until) = until_ms {
            let mut g = self.lock();
            for (a, r) in refused {
                g.filters.add_refusing(framework_id, a, until, Some(*r));
            }
        }
        self.wake();
    }

    /// What the framework's last call showed it asks for: the tasks it
    /// launched (the smallest of each resource), or, when it launched
    /// nothing of what it was offered, a whole agent. A declared demand
    /// stays as declared.
    pub fn learn_demand(&self, framework_id: &str, launched: &[Resources]) {
        let demand = launched
            .iter()
            .copied()
            .reduce(|a, b| Resources {
                cpus: a.cpus.min(b.cpus),
                mem_mib: a.mem_mib.min(b.mem_mib),
                gpus: a.gpus.min(b.gpus),
                ports: a.ports.min(b.ports),
            })
            .filter(|r| r.cpus > 1e-9 || r.mem_mib > 0 || r.gpus > 0)
            .map_or(Demand::Whole, Demand::Task);
        let mut g = self.lock();
        if !g.declared.contains(framework_id) {
            g.demands.insert(framework_id.to_string(), demand);
        }
    }

    /// Don't offer these agents to the framework until `until_ms`.
    pub fn filter(&self, framework_id: &str, agents: &BTreeSet<String>, until_ms: Option<u64>) {
        if let Some(until) = until_ms {
            let mut g = self.lock();
            for a in agents {
                g.filters.add(framework_id, a, until);
            }
        }
        self.wake();
    }

    /// Whether `framework_id` (the built-in scheduler) may place straight
    /// from the state: no other framework is connected and wanting offers,
    /// and none holds any, so what the state says is free is free for it.
    /// Otherwise it takes offers like the others and DRF divides.
    pub fn alone(&self, framework_id: &str) -> bool {
        let g = self.lock();
        let Some(book) = g.offers.as_ref() else {
            return false;
        };
        !g.conns
            .keys()
            .any(|f| f != framework_id && !g.suppressed.contains(f))
            && !book.iter().any(|o| o.framework_id != framework_id)
    }

    pub fn is_suppressed(&self, framework_id: &str) -> bool {
        self.lock().suppressed.contains(framework_id)
    }

    pub fn revive(&self, framework_id: &str) {
        let mut g = self.lock();
        g.filters.revive(framework_id);
        g.suppressed.remove(framework_id);
        g.prompt = true;
        drop(g);
        self.wake();
    }

    pub fn suppress(&self, framework_id: &str) {
        let mut g = self.lock();
        g.suppressed.insert(framework_id.to_string());
        let rescinded = g
            .offers
            .as_mut()
            .map(|b| b.rescind_framework(framework_id))
            .unwrap_or_default();
        for o in rescinded {
            send_rescind(&g.conns, o);
        }
    }

    /// The framework's own statement of its task size (Subscribe, Revive):
    /// kept by the leader, like suppression, until it declares another. It
    /// is the unit of its offers: none is smaller.
    pub fn declare_demand(&self, framework_id: &str, task: Resources) {
        if task.cpus > 1e-9 || task.mem_mib > 0 || task.gpus > 0 {
            let mut g = self.lock();
            g.demands
                .insert(framework_id.to_string(), Demand::Task(task));
            g.declared.insert(framework_id.to_string());
        }
    }

    /// Sends an event to a connected framework (dropped if it is not).
    pub fn send(&self, framework_id: &str, e: pb::event::Event) {
        if let Some(c) = self.lock().conns.get(framework_id) {
            let _ = c.tx.try_send(Ok(event(e)));
        }
    }

    /// Ends the framework's stream (Teardown, removal) with an ERROR event
    /// saying why.
    pub fn close(&self, framework_id: &str, why: &str) {
        let mut g = self.lock();
        if let Some(c) = g.conns.remove(framework_id) {
            let _ = c.tx.try_send(Ok(event(pb::event::Event::Error(format!(
                "framework {framework_id} removed: {why}"
            )))));
        }
        g.disconnected_at.remove(framework_id);
        g.filters.remove_framework(framework_id);
        g.suppressed.remove(framework_id);
        g.demands.remove(framework_id);
        g.declared.remove(framework_id);
        if let Some(b) = g.offers.as_mut() {
            b.rescind_framework(framework_id);
        }
    }
}
