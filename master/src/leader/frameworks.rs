//! The leader's side of the framework API: connected frameworks and their
//! event streams, outstanding offers, filters, and the loop that forwards
//! task updates, rescinds stale offers, enforces failover timeouts and runs
//! allocation cycles when something changes (event driven, plus a tick).
//!
//! Nothing here is replicated: offers, filters and connections are
//! ephemeral (Mesos' rule). A new leader starts with none; frameworks
//! re-subscribe to it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpuctl_core::types::{Resources, TaskState};
use gpuctl_proto::pb;
use tokio::sync::{mpsc, watch, Notify};

use crate::allocator::{
    self, AgentView, AllocatorConfig, Demand, Filters, FrameworkView, OfferBook, RoleConfig,
};
use crate::now_ms;
use crate::raft::RaftHandle;
use crate::state::{Command, State, TaskRecord};

pub type EventSender = mpsc::Sender<Result<pb::Event, tonic::Status>>;

/// Event stream buffer per framework; a framework that does not read its
/// stream is disconnected rather than buffered without bound.
pub const EVENT_BUFFER: usize = 1024;
const TICK: Duration = Duration::from_secs(1);
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(10);
pub const DEFAULT_ALLOCATION_INTERVAL: Duration = Duration::from_millis(100);

#[derive(Debug, Clone)]
pub struct FrameworkSettings {
    pub roles: BTreeMap<String, RoleConfig>,
    pub allocator: AllocatorConfig,
    /// Outstanding offers older than this are rescinded.
    pub offer_timeout: Duration,
    /// Allocation runs in rounds at most this often, so that frameworks
    /// that come or call within one round share it; resources freed or
    /// added, and a Revive, start a round at once.
    pub allocation_interval: Duration,
    /// An update its framework has not acknowledged is sent again after
    /// this, then after twice as long each time, up to
    /// [`MAX_UPDATE_RESEND`] (Mesos' status update retry, 10 s to 10 min).
    pub update_resend_interval: Duration,
    /// Reclaim between frameworks (`allocator::reclaim`); `None`: off.
    pub reclaim: Option<ReclaimSettings>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReclaimSettings {
    /// Tasks younger than this are not taken.
    pub min_runtime: Duration,
    /// Between the inverse offer and the kill.
    pub notice: Duration,
}

/// Tasks of an inverse offer, killed at its deadline.
struct PendingReclaim {
    framework_id: String,
    for_framework: String,
    deadline_ms: u64,
}

/// The longest wait between two sends of an unacknowledged update.
pub const MAX_UPDATE_RESEND: Duration = Duration::from_secs(600);

impl Default for FrameworkSettings {
    fn default() -> Self {
        FrameworkSettings {
            roles: BTreeMap::new(),
            allocator: AllocatorConfig::default(),
            offer_timeout: Duration::from_secs(30),
            allocation_interval: DEFAULT_ALLOCATION_INTERVAL,
            update_resend_interval: Duration::from_secs(10),
            reclaim: None,
        }
    }
}

struct Conn {
    id: u64,
    tx: EventSender,
}

#[derive(Default)]
struct Inner {
    conns: BTreeMap<String, Conn>,
    next_conn: u64,
    disconnected_at: BTreeMap<String, Instant>,
    suppressed: BTreeSet<String>,
    filters: Filters,
    offers: Option<OfferBook>,
    /// The last update sent per task: each change is sent once, and again
    /// while unacknowledged.
    sent: BTreeMap<String, Sent>,
    lost_agents: BTreeSet<String>,
    last_heartbeat: Option<Instant>,
    /// Agents with accepted offers being launched on (see `Hub::launching`).
    launching: BTreeMap<String, usize>,
    /// What each framework has shown it asks for (see [`Demand`]).
    demands: BTreeMap<String, Demand>,
    /// A round is due at once (a Revive).
    prompt: bool,
    /// The free resources at the last round, to see what was freed since.
    last_free: FreeMark,
    /// Tasks under an inverse offer, by key; one reclaim at a time.
    reclaims: BTreeMap<String, PendingReclaim>,
    next_inverse_offer: u64,
}

/// A task's update as last sent to its framework.
struct Sent {
    /// (state, update uuid): a change of either is a new update.
    key: (TaskState, Vec<u8>),
    at: Instant,
    /// Sends of this update after the first.
    resends: u32,
}

impl Sent {
    /// When it is due again if still unacknowledged.
    fn due(&self, first: Duration) -> Instant {
        let wait = first
            .saturating_mul(1u32 << self.resends.min(16))
            .min(MAX_UPDATE_RESEND.max(first));
        self.at + wait
    }
}

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

/// Agents being launched on; dropping it makes them offerable again.
pub struct Launching<'h> {
    hub: &'h Hub,
    agents: BTreeSet<String>,
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
    inner: Mutex<Inner>,
    wake: Notify,
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

fn event(e: pb::event::Event) -> pb::Event {
    pb::Event { event: Some(e) }
}

/// Tells the framework an offer is withdrawn. Not the built-in scheduler:
/// it takes only what is still outstanding and ignores rescinds, and one
/// event per offer (thousands when a big cluster's offers time out
/// together) would fill its stream ahead of the next offers.
fn send_rescind(conns: &BTreeMap<String, Conn>, offer: allocator::Offer) {
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
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
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

    fn checked_offers(
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
    /// nothing of what it was offered, a whole agent.
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
        self.lock().demands.insert(framework_id.to_string(), demand);
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
    /// kept by the leader, like suppression.
    pub fn declare_demand(&self, framework_id: &str, task: Resources) {
        if task.cpus > 1e-9 || task.mem_mib > 0 || task.gpus > 0 {
            self.lock()
                .demands
                .insert(framework_id.to_string(), Demand::Task(task));
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
        if let Some(b) = g.offers.as_mut() {
            b.rescind_framework(framework_id);
        }
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
    forward_updates(
        &state,
        &mut g,
        Instant::now(),
        settings.update_resend_interval,
    );
    forward_failures(&state, &mut g);
    rescind_stale(&state, &mut g, now, settings.offer_timeout);
    heartbeat(&mut g);
    let expired = failover_expired(&state, &mut g);
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

/// Reclaim between frameworks: the kills of inverse offers whose deadline
/// passed, else, with none pending, a new inverse offer when a framework
/// below its fair share waits for room (`allocator::reclaim`).
fn reclaim(
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
    let offered = g.offers.as_ref();
    let free: BTreeMap<String, Resources> = accepting()
        .filter(|a| !g.launching.contains_key(&a.info.id))
        .map(|a| {
            let o = offered
                .map(|b| b.offered_on_agent(&a.info.id))
                .unwrap_or_default();
            (a.info.id.clone(), a.free().saturating_sub(&o))
        })
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

/// Sends each task's new update to its connected framework, and sends an
/// unacknowledged one again (its Acknowledge may have been lost) with a
/// growing wait, as Mesos' agents retry until the framework acknowledges.
fn forward_updates(state: &State, g: &mut Inner, now: Instant, resend_after: Duration) {
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
fn forward_failures(state: &State, g: &mut Inner) {
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
fn rescind_stale(state: &State, g: &mut Inner, now: u64, timeout: Duration) {
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

/// Whether the shared GPUs of an offer still have what it offered of them.
fn shares_hold(state: &State, o: &allocator::Offer) -> bool {
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
fn attach_shares(
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

fn heartbeat(g: &mut Inner) {
    if g.last_heartbeat
        .is_some_and(|t| t.elapsed() < HEARTBEAT_INTERVAL)
    {
        return;
    }
    g.last_heartbeat = Some(Instant::now());
    for c in g.conns.values() {
        let _ =
            c.tx.try_send(Ok(event(pb::event::Event::Heartbeat(pb::Heartbeat {}))));
    }
}

fn failover_expired(state: &State, g: &mut Inner) -> Vec<String> {
    // A framework this leader has never seen connected starts its clock now.
    for (id, f) in state.frameworks() {
        if id == crate::state::frameworks::BUILTIN_FRAMEWORK_ID {
            continue;
        }
        if !f.removed && !g.conns.contains_key(id) {
            g.disconnected_at
                .entry(id.clone())
                .or_insert_with(Instant::now);
        }
    }
    g.disconnected_at
        .iter()
        .filter(|(id, _)| id.as_str() != crate::state::frameworks::BUILTIN_FRAMEWORK_ID)
        .filter(|(id, since)| {
            state.framework(id).is_some_and(|f| {
                !f.removed && since.elapsed() > Duration::from_millis(f.info.failover_timeout_ms)
            })
        })
        .map(|(id, _)| id.clone())
        .collect()
}

/// Makes the offers the allocator plans; returns how many.
/// The connected frameworks as the allocator sees them: what each holds
/// (gpuctl jobs' tasks are the built-in scheduler's, so its role's share
/// and quota count them) and is offered, and what it asks for.
fn framework_views(state: &State, g: &Inner) -> Vec<FrameworkView> {
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

fn allocate(state: &State, g: &mut Inner, settings: &FrameworkSettings, now: u64) -> usize {
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
    // Views of the agents with something to offer only.
    let agents: Vec<AgentView> = accepting()
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
        .collect();
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
        let Some(agent) = state.agent(&o.agent_id) else {
            continue;
        };
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
        by_framework
            .entry(o.framework_id.clone())
            .or_default()
            .push(pb::Offer {
                id: o.id.clone(),
                framework_id: o.framework_id.clone(),
                agent_id: o.agent_id.clone(),
                hostname: agent.info.hostname.clone(),
                resources: Some(agent.with_free_ports(o.resources).into()),
                gpus,
                attributes: agent.info.attributes.clone().into_iter().collect(),
                shared_gpus,
            });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::testkit::register;
    use crate::state::{FrameworkTask, Outcome};
    use gpuctl_core::types::{FrameworkInfo, StatusUpdate};

    /// A framework task RUNNING on agent a (update uuid u1), in a state.
    fn running_task() -> (State, String) {
        let mut s = State::new();
        let mut i = 0;
        let mut apply = |s: &mut State, c: Command| {
            i += 1;
            s.apply(i, &c).unwrap()
        };
        apply(&mut s, register("a", 0));
        let Outcome::FrameworkSubscribed { framework_id } = apply(
            &mut s,
            Command::SubscribeFramework {
                request_id: None,
                info: FrameworkInfo {
                    id: String::new(),
                    name: "f".into(),
                    roles: vec![],
                    gpu_capable: true,
                    failover_timeout_ms: 1_000,
                    tenant: String::new(),
                },
                at_ms: 0,
            },
        ) else {
            panic!()
        };
        apply(
            &mut s,
            Command::LaunchFrameworkTasks {
                framework_id: framework_id.clone(),
                tasks: vec![FrameworkTask {
                    task_id: "t1".into(),
                    agent_id: "a".into(),
                    image: None,
                    command: vec!["true".into()],
                    env: Default::default(),
                    resources: Resources::default(),
                    gpu_uuids: vec![],
                    fraction: None,
                }],
                group: false,
                at_ms: 0,
            },
        );
        let key = crate::state::frameworks::task_key(&framework_id, "t1");
        apply(
            &mut s,
            Command::UpdateTaskStatus {
                update: StatusUpdate {
                    gpu_memory_limit: false,
                    enforcement: None,
                    agent_id: "a".into(),
                    task_id: key.clone(),
                    state: TaskState::Running,
                    exit_code: None,
                    message: String::new(),
                    uuid: b"u1".to_vec(),
                    gpu_unhealthy: false,
                    requires: Vec::new(),
                    fenced: false,
                    latest_state: None,
                },
                at_ms: 1,
            },
        );
        (s, key)
    }

    #[test]
    fn frameworks_hear_unreachable_without_a_uuid_then_running_again() {
        let (mut s, key) = running_task();
        let st = task_status(&s.tasks()[&key], None);
        assert_eq!(st.state, pb::TaskState::TaskRunning as i32);
        assert_eq!(st.uuid, b"u1");
        let i = s.applied_index() + 1;
        s.apply(
            i,
            &Command::AgentUnreachable {
                agent_id: "a".into(),
                at_ms: 2,
            },
        )
        .unwrap();
        let st = task_status(&s.tasks()[&key], None);
        assert_eq!(st.state, pb::TaskState::TaskUnreachable as i32);
        assert_eq!(st.reason, pb::Reason::AgentUnreachable as i32);
        assert!(
            st.uuid.is_empty(),
            "the master's word: nothing to acknowledge"
        );
        // Reconciliation answers say so too.
        let st = task_status(&s.tasks()[&key], Some(pb::Reason::Reconciliation));
        assert_eq!(st.state, pb::TaskState::TaskUnreachable as i32);
        let Command::RegisterAgent { info, .. } = register("a", 0) else {
            unreachable!()
        };
        let i = s.applied_index() + 1;
        s.apply(
            i,
            &Command::RegisterAgent {
                info,
                running_task_ids: vec![key.clone()],
                at_ms: 3,
            },
        )
        .unwrap();
        let st = task_status(&s.tasks()[&key], None);
        assert_eq!(st.state, pb::TaskState::TaskRunning as i32);
        assert_eq!(st.reason, pb::Reason::Unspecified as i32);
        assert_eq!(st.uuid, b"u1");
    }

    /// A hub making offers, with framework `f` (subscribed in `s`) connected.
    fn offering_hub(s: &State, f: &str) -> (Hub, mpsc::Receiver<Result<pb::Event, tonic::Status>>) {
        let hub = Hub::default();
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        hub.connect(f, tx);
        hub.lock().offers = Some(OfferBook::new());
        assert!(s.framework(f).is_some());
        (hub, rx)
    }

    fn offer_ids(hub: &Hub) -> Vec<String> {
        let g = hub.lock();
        g.offers
            .as_ref()
            .map(|b| b.iter().map(|o| o.id.clone()).collect())
            .unwrap_or_default()
    }

    #[test]
    fn agents_being_launched_on_are_not_offered_until_the_launch_ends() {
        let (s, key) = running_task();
        let f = s.task(&key).map(|t| t.framework_id.clone()).unwrap();
        let (hub, _rx) = offering_hub(&s, &f);
        let settings = FrameworkSettings::default();
        let agents: BTreeSet<String> = ["a".to_string()].into();
        let launching = hub.launching(&agents);
        assert_eq!(allocate(&s, &mut hub.lock(), &settings, 10), 0);
        drop(launching);
        assert_eq!(allocate(&s, &mut hub.lock(), &settings, 10), 1);
        assert_eq!(offer_ids(&hub).len(), 1);
    }

    #[test]
    fn offers_a_full_stream_cannot_take_are_not_left_outstanding() {
        let (s, key) = running_task();
        let f = s.task(&key).map(|t| t.framework_id.clone()).unwrap();
        let hub = Hub::default();
        let (tx, mut rx) = mpsc::channel(1);
        hub.connect(&f, tx); // SUBSCRIBED fills the stream
        hub.lock().offers = Some(OfferBook::new());
        let settings = FrameworkSettings::default();
        assert_eq!(allocate(&s, &mut hub.lock(), &settings, 10), 0);
        assert!(offer_ids(&hub).is_empty(), "nothing outstanding unsent");
        // Once the framework reads, the agent is offered at once.
        assert!(rx.try_recv().is_ok());
        assert_eq!(allocate(&s, &mut hub.lock(), &settings, 11), 1);
        assert_eq!(offer_ids(&hub).len(), 1);
        let Ok(Ok(pb::Event {
            event: Some(pb::event::Event::Offers(o)),
        })) = rx.try_recv()
        else {
            panic!("an Offers event")
        };
        assert_eq!(o.offers[0].id, offer_ids(&hub)[0]);
    }

    #[test]
    fn the_built_in_scheduler_gets_no_rescind_events() {
        let hub = Hub::default();
        let (tx, mut rx) = mpsc::channel(8);
        let builtin = crate::state::frameworks::BUILTIN_FRAMEWORK_ID;
        hub.connect(builtin, tx);
        assert!(rx.try_recv().is_ok(), "SUBSCRIBED");
        let mut book = OfferBook::new();
        book.record(
            vec![allocator::OfferPlan {
                framework_id: builtin.into(),
                agent_id: "a".into(),
                resources: Resources::default(),
                gpu_uuids: vec![],
                shares: vec![],
            }],
            0,
        );
        hub.lock().offers = Some(book);
        hub.suppress(builtin);
        assert!(offer_ids(&hub).is_empty(), "the offer is rescinded");
        assert!(rx.try_recv().is_err(), "but no event is sent for it");
    }

    /// The 10,000-agent benchmark's gang stall: the built-in scheduler's
    /// offers of more than EVENT_BUFFER agents expired together; one
    /// Rescind event each filled its stream, so the offers made again in
    /// the same cycle were dropped, stayed outstanding unseen, expired
    /// again 30 s later, and so on: nothing was placed again.
    #[test]
    fn offers_made_after_a_mass_expiry_reach_the_built_in_scheduler() {
        let builtin = crate::state::frameworks::BUILTIN_FRAMEWORK_ID;
        let agents = EVENT_BUFFER + 100;
        let mut s = State::new();
        let mut i = 0;
        let mut apply = |s: &mut State, c: Command| {
            i += 1;
            s.apply(i, &c).unwrap();
        };
        for n in 0..agents {
            apply(&mut s, register(&format!("a{n:05}"), 0));
        }
        apply(
            &mut s,
            Command::SubscribeFramework {
                request_id: None,
                info: FrameworkInfo {
                    id: builtin.into(),
                    name: "gpuctl jobs".into(),
                    roles: vec![crate::state::frameworks::JOBS_ROLE.into()],
                    gpu_capable: true,
                    failover_timeout_ms: 0,
                    tenant: String::new(),
                },
                at_ms: 0,
            },
        );
        let (hub, mut rx) = offering_hub(&s, builtin);
        let settings = FrameworkSettings::default();
        let offers_in = |rx: &mut mpsc::Receiver<_>| {
            let mut n = 0;
            while let Ok(Ok(pb::Event { event: Some(e) })) = rx.try_recv() {
                if let pb::event::Event::Offers(o) = e {
                    n += o.offers.len();
                }
            }
            n
        };
        assert_eq!(allocate(&s, &mut hub.lock(), &settings, 0), agents);
        assert_eq!(offers_in(&mut rx), agents);
        // The scheduler never answers them (busy); they all expire at once.
        let timeout = settings.offer_timeout;
        let later = timeout.as_millis() as u64;
        rescind_stale(&s, &mut hub.lock(), later, timeout);
        assert_eq!(allocate(&s, &mut hub.lock(), &settings, later), agents);
        assert_eq!(offers_in(&mut rx), agents, "the new offers reach it");
    }

    /// Resources freed on an agent whose rest the framework holds in an
    /// offer, or declined with a filter, are offered at the next round:
    /// the filter refuses only offers no larger than what was declined.
    #[test]
    fn freed_resources_are_offered_at_once_past_a_decline_filter() {
        let mut s = State::new();
        let mut i = 0;
        let mut apply = |s: &mut State, c: Command| {
            i += 1;
            s.apply(i, &c).unwrap()
        };
        apply(&mut s, register("a", 2));
        let Outcome::FrameworkSubscribed { framework_id: f } = apply(
            &mut s,
            Command::SubscribeFramework {
                request_id: None,
                info: FrameworkInfo {
                    id: String::new(),
                    name: "f".into(),
                    roles: vec![],
                    gpu_capable: true,
                    failover_timeout_ms: 1_000,
                    tenant: String::new(),
                },
                at_ms: 0,
            },
        ) else {
            panic!()
        };
        // One GPU runs a task of f's; the other is offered, and declined
        // with a long filter.
        let task = |id: &str, gpu: &str| FrameworkTask {
            task_id: id.into(),
            agent_id: "a".into(),
            image: None,
            command: vec!["true".into()],
            env: Default::default(),
            resources: Resources {
                cpus: 2.0,
                mem_mib: 1024,
                gpus: 1,
                ports: 0,
            },
            gpu_uuids: vec![gpu.into()],
            fraction: None,
        };
        apply(
            &mut s,
            Command::LaunchFrameworkTasks {
                framework_id: f.clone(),
                tasks: vec![task("t1", "GPU-a-0")],
                group: false,
                at_ms: 0,
            },
        );
        let (hub, _rx) = offering_hub(&s, &f);
        let settings = FrameworkSettings::default();
        assert_eq!(allocate(&s, &mut hub.lock(), &settings, 10), 1);
        let first = hub
            .lock()
            .offers
            .as_ref()
            .unwrap()
            .iter()
            .next()
            .cloned()
            .unwrap();
        assert_eq!(first.gpu_uuids, ["GPU-a-1"]);
        let taken = hub
            .take_offers(&f, std::slice::from_ref(&first.id))
            .unwrap();
        let refused: BTreeMap<String, Resources> = [("a".to_string(), taken[0].resources)].into();
        hub.filter_declined(&f, &refused, Some(3_600_000));
        assert_eq!(allocate(&s, &mut hub.lock(), &settings, 20), 0, "filtered");
        // t1 ends: its GPU, cpus and memory are free again; the agent now
        // has more than was declined, so it is offered at once, whole.
        apply(
            &mut s,
            Command::UpdateTaskStatus {
                update: StatusUpdate {
                    gpu_memory_limit: false,
                    enforcement: None,
                    agent_id: "a".into(),
                    task_id: crate::state::frameworks::task_key(&f, "t1"),
                    state: TaskState::Finished,
                    exit_code: Some(0),
                    message: String::new(),
                    uuid: b"u1".to_vec(),
                    gpu_unhealthy: false,
                    requires: Vec::new(),
                    fenced: false,
                    latest_state: None,
                },
                at_ms: 30,
            },
        );
        let freed = s.agent("a").unwrap().free();
        assert_eq!(freed.gpus, 2, "a terminal task frees its GPU");
        assert_eq!(allocate(&s, &mut hub.lock(), &settings, 40), 1);
        let again = hub
            .lock()
            .offers
            .as_ref()
            .unwrap()
            .iter()
            .next()
            .cloned()
            .unwrap();
        assert_eq!(again.gpu_uuids.len(), 2);
        // The book does not divide ports: the wire offer carries them all.
        assert_eq!(again.resources, Resources { ports: 0, ..freed });
    }

    /// Issue 34: an offer lists the agent's shared GPU with what its
    /// fractions leave, never as a whole GPU, and in one offer at a time
    /// (two frameworks never race for a fraction); an offer whose share
    /// shrank under it is rescinded and made again with the new room; a
    /// freed fraction starts a round.
    #[test]
    fn shared_gpus_are_offered_with_their_free_fractions_in_one_offer_at_a_time() {
        let mut s = State::new();
        let mut i = 0;
        let mut apply = |s: &mut State, c: Command| {
            i += 1;
            s.apply(i, &c).unwrap()
        };
        apply(&mut s, register("a", 2));
        apply(
            &mut s,
            Command::ShareGpu {
                gpu_uuid: "GPU-a-0".into(),
                mode: Some(gpuctl_core::types::ShareMode::Mps),
            },
        );
        let mut subscribe = |s: &mut State, name: &str| {
            let Outcome::FrameworkSubscribed { framework_id } = apply(
                s,
                Command::SubscribeFramework {
                    request_id: None,
                    info: FrameworkInfo {
                        id: String::new(),
                        name: name.into(),
                        roles: vec![],
                        gpu_capable: true,
                        failover_timeout_ms: 1_000,
                        tenant: String::new(),
                    },
                    at_ms: 0,
                },
            ) else {
                panic!()
            };
            framework_id
        };
        let f = subscribe(&mut s, "f");
        let g = subscribe(&mut s, "g");
        let (hub, mut rx) = offering_hub(&s, &f);
        let (tx, _rx_g) = mpsc::channel(EVENT_BUFFER);
        hub.connect(&g, tx);
        let settings = FrameworkSettings::default();
        assert_eq!(allocate(&s, &mut hub.lock(), &settings, 10), 2, "split");
        let offers: Vec<allocator::Offer> = hub
            .lock()
            .offers
            .as_ref()
            .unwrap()
            .iter()
            .cloned()
            .collect();
        let with_share: Vec<&allocator::Offer> =
            offers.iter().filter(|o| !o.shares.is_empty()).collect();
        assert_eq!(with_share.len(), 1, "{offers:?}");
        assert_eq!(
            with_share[0].shares,
            vec![allocator::OfferedShare {
                gpu_uuid: "GPU-a-0".into(),
                mem_mib: 40960,
                compute_pct: 100,
            }]
        );
        assert!(
            offers
                .iter()
                .all(|o| !o.gpu_uuids.contains(&"GPU-a-0".to_string())),
            "a shared GPU offered whole: {offers:?}"
        );
        // On the wire: the GPU in full, its mode and its room.
        let wire: Vec<pb::Offer> = std::iter::from_fn(|| rx.try_recv().ok())
            .filter_map(|e| match e.ok()?.event? {
                pb::event::Event::Offers(o) => Some(o.offers),
                _ => None,
            })
            .flatten()
            .collect();
        let shared: Vec<&pb::SharedGpu> = wire.iter().flat_map(|o| &o.shared_gpus).collect();
        if with_share[0].framework_id == f {
            assert_eq!(shared.len(), 1, "{wire:?}");
            let sh = shared[0];
            assert_eq!(sh.gpu.as_ref().map(|g| g.uuid.as_str()), Some("GPU-a-0"));
            assert_eq!(sh.gpu.as_ref().map(|g| g.memory_mib), Some(40960));
            assert_eq!(
                (sh.mode.as_str(), sh.free_mem_mib, sh.free_compute_pct),
                ("mps", 40960, 100)
            );
            assert!(wire
                .iter()
                .all(|o| o.gpus.iter().all(|g| g.uuid != "GPU-a-0")));
        } else {
            assert!(shared.is_empty(), "{wire:?}");
        }
        // A fraction taken since by another path (here, a launch straight
        // through the state): the offer promises more than is left, so it
        // is rescinded.
        let holder = with_share[0].framework_id.clone();
        let other = if holder == f { g.clone() } else { f.clone() };
        let task = |id: &str, mem_mib: u64| FrameworkTask {
            task_id: id.into(),
            agent_id: "a".into(),
            image: None,
            command: vec!["true".into()],
            env: Default::default(),
            resources: Resources::default(),
            gpu_uuids: vec!["GPU-a-0".into()],
            fraction: Some(gpuctl_core::types::GpuFraction {
                mem_mib,
                compute_pct: 0,
            }),
        };
        apply(
            &mut s,
            Command::LaunchFrameworkTasks {
                framework_id: other,
                tasks: vec![task("t1", 10240)],
                group: false,
                at_ms: 20,
            },
        );
        let before = FreeMark::of(&s);
        rescind_stale(&s, &mut hub.lock(), 20, settings.offer_timeout);
        let left: Vec<allocator::Offer> = hub
            .lock()
            .offers
            .as_ref()
            .unwrap()
            .iter()
            .cloned()
            .collect();
        assert!(left.iter().all(|o| o.shares.is_empty()), "{left:?}");
        // Made again, with the room left.
        allocate(&s, &mut hub.lock(), &settings, 30);
        let again: Vec<allocator::OfferedShare> = hub
            .lock()
            .offers
            .as_ref()
            .unwrap()
            .iter()
            .flat_map(|o| o.shares.clone())
            .collect();
        assert_eq!(
            again,
            vec![allocator::OfferedShare {
                gpu_uuid: "GPU-a-0".into(),
                mem_mib: 30720,
                compute_pct: 100,
            }]
        );
        // The fraction ends: more of the shared GPU is free, which alone
        // (the task held no cpus nor memory) starts a round.
        let mut end = crate::state::testkit::status(
            "a",
            &s.tasks()
                .values()
                .find(|t| t.fraction.is_some())
                .map(|t| t.id.clone())
                .unwrap(),
            TaskState::Finished,
        );
        end.uuid = b"u".to_vec();
        apply(
            &mut s,
            Command::UpdateTaskStatus {
                update: end,
                at_ms: 40,
            },
        );
        assert!(FreeMark::of(&s).grew_from(&before));
    }

    /// A subscription states the framework's suppression (a new leader
    /// knows nothing of it otherwise): suppressed, no offers; subscribed
    /// again unsuppressed, offers.
    #[test]
    fn a_subscription_states_suppression() {
        let (s, key) = running_task();
        let f = s.task(&key).map(|t| t.framework_id.clone()).unwrap();
        let hub = Hub::default();
        let (tx, _rx) = mpsc::channel(EVENT_BUFFER);
        hub.connect_suppressed(&f, tx, Some(true));
        hub.lock().offers = Some(OfferBook::new());
        let settings = FrameworkSettings::default();
        assert_eq!(allocate(&s, &mut hub.lock(), &settings, 10), 0);
        // Re-subscribing without saying keeps it; saying false ends it.
        let (tx, _rx2) = mpsc::channel(EVENT_BUFFER);
        hub.connect(&f, tx);
        assert_eq!(allocate(&s, &mut hub.lock(), &settings, 20), 0);
        let (tx, _rx3) = mpsc::channel(EVENT_BUFFER);
        hub.connect_suppressed(&f, tx, Some(false));
        assert_eq!(allocate(&s, &mut hub.lock(), &settings, 30), 1);
    }

    /// An update whose Acknowledge never came is sent again on the same
    /// connection after 10 s, then 20 s, 40 s, ...; once acknowledged, not.
    #[test]
    fn unacknowledged_updates_are_sent_again_with_a_growing_wait() {
        let (mut s, key) = running_task();
        let f = s.task(&key).map(|t| t.framework_id.clone()).unwrap();
        let (hub, mut rx) = offering_hub(&s, &f);
        let every = Duration::from_secs(10);
        let t0 = Instant::now();
        let _ = rx.try_recv(); // SUBSCRIBED
        let mut updates_at = |s: &State, secs: u64| {
            forward_updates(s, &mut hub.lock(), t0 + Duration::from_secs(secs), every);
            let mut n = 0;
            while let Ok(e) = rx.try_recv() {
                match e.unwrap().event {
                    Some(pb::event::Event::Update(u)) => {
                        assert_eq!(u.uuid, b"u1");
                        assert_eq!(u.state, pb::TaskState::TaskRunning as i32);
                        n += 1;
                    }
                    other => panic!("{other:?}"),
                }
            }
            n
        };
        assert_eq!(updates_at(&s, 0), 1, "sent");
        assert_eq!(updates_at(&s, 9), 0);
        assert_eq!(updates_at(&s, 10), 1, "again after 10 s");
        assert_eq!(updates_at(&s, 29), 0);
        assert_eq!(updates_at(&s, 30), 1, "then after 20 s");
        assert_eq!(updates_at(&s, 69), 0);
        assert_eq!(updates_at(&s, 70), 1, "then after 40 s");
        s.apply(
            100,
            &Command::AcknowledgeUpdate {
                framework_id: f.clone(),
                framework_task_id: "t1".into(),
                uuid: b"u1".to_vec(),
            },
        )
        .unwrap();
        assert_eq!(updates_at(&s, 1000), 0, "acknowledged: never again");
    }

    /// A framework hears once that an agent is LOST (from the capacity
    /// index's set), and again only if it is lost again after coming back.
    #[test]
    fn a_lost_agent_is_told_to_frameworks_once() {
        let (mut s, key) = running_task();
        let f = s.task(&key).map(|t| t.framework_id.clone()).unwrap();
        let (hub, mut rx) = offering_hub(&s, &f);
        let _ = rx.try_recv(); // SUBSCRIBED
        let mut failures = |s: &State| {
            forward_failures(s, &mut hub.lock());
            let mut agents = Vec::new();
            while let Ok(e) = rx.try_recv() {
                if let Some(pb::event::Event::Failure(f)) = e.unwrap().event {
                    agents.push(f.agent_id);
                }
            }
            agents
        };
        assert!(failures(&s).is_empty());
        let mut i = 1000;
        let mut apply = |s: &mut State, c: Command| {
            i += 1;
            s.apply(i, &c).unwrap();
        };
        apply(
            &mut s,
            Command::AgentUnreachable {
                agent_id: "a".into(),
                at_ms: 1,
            },
        );
        assert!(failures(&s).is_empty(), "unreachable is not lost");
        apply(
            &mut s,
            Command::AgentLostAfterTimeout {
                agent_id: "a".into(),
                at_ms: 2,
            },
        );
        assert_eq!(failures(&s), ["a"]);
        assert!(failures(&s).is_empty(), "once");
        apply(&mut s, register("a", 0));
        assert!(failures(&s).is_empty());
        apply(
            &mut s,
            Command::AgentUnreachable {
                agent_id: "a".into(),
                at_ms: 3,
            },
        );
        apply(
            &mut s,
            Command::AgentLostAfterTimeout {
                agent_id: "a".into(),
                at_ms: 4,
            },
        );
        assert_eq!(failures(&s), ["a"], "lost again");
        assert_eq!(*s.capacity(), crate::state::capacity::Capacity::build(&s));
    }

    #[test]
    fn a_failed_take_releases_the_callers_valid_offers() {
        let (s, key) = running_task();
        let f = s.task(&key).map(|t| t.framework_id.clone()).unwrap();
        let (hub, _rx) = offering_hub(&s, &f);
        let settings = FrameworkSettings::default();
        assert_eq!(allocate(&s, &mut hub.lock(), &settings, 10), 1);
        let mut ids = offer_ids(&hub);
        ids.push("offer-999".into());
        let err = hub.take_offers(&f, &ids).unwrap_err();
        assert!(err.to_string().contains("offer-999"), "{err}");
        assert!(offer_ids(&hub).is_empty(), "the valid offer is released");
        // Its agent is offered again at once.
        assert_eq!(allocate(&s, &mut hub.lock(), &settings, 11), 1);
        // The scheduler's partial take skips what is gone.
        let mut ids = offer_ids(&hub);
        ids.push("offer-999".into());
        assert_eq!(hub.take_outstanding(&f, &ids).len(), 1);
        assert!(offer_ids(&hub).is_empty());
    }
}
