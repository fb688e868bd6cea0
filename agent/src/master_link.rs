//! The agent's side of the master connection: register, heartbeat, watch the
//! desired tasks, and deliver status updates reliably.
//!
//! Any failure sends the agent back to registration, which is idempotent: it
//! lists the tasks still running here so the master keeps them. Losing the
//! master never stops a task; only a desired-task list from a master does.
//! Status updates are queued and sent one at a time, in order, until the
//! master acknowledges each (it does so once the update is committed).
//!
//! Only the Raft leader serves agents. A follower answers `UNAVAILABLE`,
//! naming the leader when it knows it (`gpuctl_proto::leader`): the agent
//! goes there at once. Any other failure moves it on to the next address,
//! with backoff.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gpuctl_core::convert::MAX_STATUS_BATCH;
use gpuctl_core::time::Backoff;
use gpuctl_core::types::{AgentInfo, GpuInfo, RuntimeStatus, StatusUpdate};
use gpuctl_proto::follow::{Connect, Follower, Moved, Policy};
use gpuctl_proto::leader::{may_retry, FREE_REDIRECTS};
use gpuctl_proto::pb;
use gpuctl_proto::pb::agent_manager_client::AgentManagerClient;
use tokio::sync::{mpsc, watch};
use tonic::transport::{Channel, Endpoint};
use tonic::Status;

use crate::executor::Executor;
use crate::gpu::health::Snapshot;
use gpuctl_core::desired::DesiredSet;

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const RPC_TIMEOUT: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
const ELECTION_POLL: Duration = Duration::from_millis(200);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(3);

/// Where to go after a call to `addrs[current]` failed with `status`: to the
/// leader the status names (added to `addrs` if new), else to the next
/// address. Returns the new index and whether it followed a redirect.
pub fn next_master(
    addrs: &mut Vec<String>,
    current: usize,
    status: Option<&Status>,
) -> (usize, bool) {
    // A hint must be HOST:PORT with a usable port: it must not poison the list.
    gpuctl_proto::follow::next_index(addrs, current, status, gpuctl_proto::leader::host_port)
}

/// The masters this agent knows, which one it talks to now, and the
/// channel to it (the state half of `gpuctl_proto::follow::Follower`: the
/// agent paces its own tries, below). Over TLS the channel is made again
/// when the agent's certificate is renewed: the master refuses calls on a
/// connection whose certificate expired.
pub struct Masters(Follower);

/// How the agent follows the leader. Only `move_after` and the current
/// channel are used: the backoff, the election poll and the free
/// redirects are `run`'s and `status_sender`'s.
const POLICY: Policy = Policy {
    backoff_min: BACKOFF_MIN,
    backoff_max: BACKOFF_MAX,
    unknown_search_factor: 1,
    accept_hint: gpuctl_proto::leader::host_port,
    cache_channels: false,
    on_retry: |_, _, _| {},
};

/// The agent's channels: a 10 s limit on every call and HTTP/2 keepalive,
/// over TLS with its agent certificate when TLS is on.
fn connector(tls: Option<Arc<gpuctl_auth::tls::Tls>>) -> Connect {
    Arc::new(move |addr: &str| {
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| Status::invalid_argument(format!("master address {addr:?}: {e}")))?
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(RPC_TIMEOUT)
            // A master whose machine vanished sends no reset: pings find
            // out in seconds and end the task watch, so the agent moves on
            // to the new leader instead of waiting for a heartbeat timeout.
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true);
        // Over TLS the server must hold a master certificate.
        Ok(gpuctl_auth::tls::channel(
            &endpoint,
            tls.as_ref(),
            gpuctl_auth::CertRole::Master,
        ))
    })
}

impl Masters {
    pub fn new(addrs: Vec<String>) -> Masters {
        Self::with_tls(addrs, None)
    }

    pub fn with_tls(
        addrs: Vec<String>,
        tls: Option<std::sync::Arc<gpuctl_auth::tls::Tls>>,
    ) -> Masters {
        let follower = Follower::new(addrs, connector(tls.clone()), POLICY);
        Masters(match tls {
            // The end of validity of the certificate the channel is made
            // with: a renewed certificate needs a new connection.
            Some(tls) => follower.with_epoch(Arc::new(move || {
                tls.identity().map_or(0, |i| i.not_after_ms)
            })),
            None => follower,
        })
    }

    /// Masters reached through `connect` (tests: an in-memory network).
    #[cfg(test)]
    fn with_connect(addrs: Vec<String>, connect: Connect) -> Masters {
        Masters(Follower::new(addrs, connect, POLICY))
    }

    pub fn current_addr(&self) -> String {
        self.0.current_addr()
    }

    /// The current master's address and a client for it (the channel
    /// reconnects by itself).
    pub fn client(&self) -> Result<(String, AgentManagerClient<Channel>), String> {
        self.0
            .current()
            .map(|(addr, ch)| (addr, AgentManagerClient::new(ch)))
            .map_err(|s| s.message().to_string())
    }

    /// After a call to `failed` failed: goes to the leader `status` names,
    /// or to the next address. Returns true when the next try may follow at
    /// once: a redirect, or another caller already moved away from `failed`.
    pub fn after_failure(&self, failed: &str, status: Option<&Status>) -> bool {
        let moved = self.0.move_after(failed, status);
        if let Moved::Redirected(leader) = &moved {
            tracing::info!(from = %failed, leader = %leader, "following the master's redirect to the leader");
        }
        moved.at_once()
    }
}

/// 200 to 300 ms, spread over agents and time so they do not all call at once.
fn election_poll(agent_id: &str) -> Duration {
    let seed = agent_id.bytes().fold(
        u64::from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos()),
        ),
        |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)),
    );
    ELECTION_POLL + Duration::from_millis(seed % 100)
}

/// Why a session ended.
#[derive(Debug)]
struct SessionError {
    /// The master the session talked to.
    addr: String,
    message: String,
    /// The master's answer, when a call failed (it may name the leader).
    status: Option<Status>,
    /// Whether the session got as far as registering.
    registered: bool,
}

impl SessionError {
    fn rpc(addr: &str, what: &str, status: Status, registered: bool) -> Self {
        SessionError {
            addr: addr.to_string(),
            message: format!("{what}: {}", status.message()),
            status: Some(status),
            registered,
        }
    }

    fn other(addr: &str, message: String, registered: bool) -> Self {
        SessionError {
            addr: addr.to_string(),
            message,
            status: None,
            registered,
        }
    }
}

/// Registration, heartbeats and the desired-task watch, until shutdown.
pub async fn run(
    masters: Arc<Masters>,
    info: AgentInfo,
    executor: Arc<Executor>,
    health: watch::Receiver<Snapshot>,
    mut shutdown: watch::Receiver<bool>,
    mig: Option<Arc<crate::gpu::mig_apply::Applier>>,
) {
    let mut backoff = Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
    let mut redirects = 0;
    loop {
        if *shutdown.borrow() {
            return;
        }
        let e = tokio::select! {
            r = session(&masters, &info, &executor, health.clone(), mig.as_ref()) => r,
            _ = shutdown.changed() => return,
        };
        // A session that registered ran fine until now (e.g. its leader
        // stepped down): reconnect quickly.
        if e.registered {
            backoff.reset();
            redirects = 0;
        }
        let addr = &e.addr;
        if masters.after_failure(addr, e.status.as_ref()) && redirects < FREE_REDIRECTS {
            redirects += 1;
            tracing::info!(master = %addr, error = %e.message, next = %masters.current_addr(), "master connection ended; reconnecting now");
            continue;
        }
        redirects = 0;
        // A master answered that there is no leader yet (an election) or
        // that it is catching up: a leader is a moment away, so poll at a
        // short, jittered interval instead of backing off, and the agents
        // of a cluster come back together right after the election.
        let electing = e
            .status
            .as_ref()
            .is_some_and(gpuctl_proto::leader::not_proposed);
        let wait = retry_wait(&mut backoff, electing, &info.id);
        tracing::warn!(master = %addr, error = %e.message, retry_in_ms = wait.as_millis() as u64, "master connection failed");
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.changed() => return,
        }
    }
}

/// How long to wait after a failed session. A master that answered "no
/// leader yet" (an election) is polled at a short, jittered interval, and
/// the backoff starts again: the group is alive, so the dead master the
/// agent tries next on its way round costs one short wait, not a wait
/// that doubled through the whole election (the last agents came back up
/// to a second after the new leader did). Other failures back off.
fn retry_wait(backoff: &mut Backoff, electing: bool, agent_id: &str) -> Duration {
    if electing {
        backoff.reset();
        election_poll(agent_id)
    } else {
        backoff.next_wait()
    }
}

/// The registration: what the agent is and offers, its GPUs with the
/// health checks' verdict and their MIG state as layout changes left it,
/// and the tasks it runs; with the health generation it says.
fn register_request(
    info: &AgentInfo,
    executor: &Arc<Executor>,
    health: &mut watch::Receiver<Snapshot>,
    mig: Option<&Arc<crate::gpu::mig_apply::Applier>>,
) -> (pb::RegisterRequest, u64) {
    let (gpus, told) = {
        let now = mig.map_or_else(|| info.gpus.clone(), |m| m.gpus());
        let snapshot = health.borrow_and_update();
        (with_health(&now, &snapshot), snapshot.generation)
    };
    let total_gpus = gpuctl_core::types::device_count(&gpus);
    let mut req = pb::RegisterRequest {
        running_task_ids: executor.known_task_ids(),
        // The master checks that its fence timeout plus this grace ends
        // before it declares our tasks LOST.
        kill_grace_ms: u32::try_from(executor.kill_grace().as_millis()).unwrap_or(u32::MAX),
        ..AgentInfo {
            gpus,
            total: gpuctl_core::types::Resources {
                gpus: total_gpus,
                ..info.total
            },
            ..info.clone()
        }
        .into()
    };
    req.running_task_ids.sort();
    (req, told)
}

/// One registration and what follows it; returns on the first failure.
/// Tasks keep running meanwhile: nothing here tells the executor to stop.
async fn session(
    masters: &Masters,
    info: &AgentInfo,
    executor: &Arc<Executor>,
    mut health: watch::Receiver<Snapshot>,
    mig: Option<&Arc<crate::gpu::mig_apply::Applier>>,
) -> SessionError {
    let (addr, mut client) = match masters.client() {
        Ok(c) => c,
        Err(e) => return SessionError::other(&masters.current_addr(), e, false),
    };
    let (req, mut told) = register_request(info, executor, &mut health, mig);
    let sent_ms = crate::checkpoint::wall_ms();
    // Registering needs a commit, which a new leader over a slow link
    // between masters may take long to make; meanwhile heartbeats that a
    // leader answers keep the fence from falling.
    // The first before registering: a leader still catching up refuses
    // the registration at once, and answers this.
    contact_once(&mut client, &info.id, &health, executor).await;
    let keeping = keep_contact(client.clone(), &info.id, health.clone(), executor);
    let resp = tokio::select! {
        r = client.register(req) => match r {
            Ok(r) => r.into_inner(),
            Err(s) => return SessionError::rpc(&addr, "register", s, false),
        },
        never = keeping => match never {},
    };
    // 0 from a master that does not fence.
    let fence_timeout_ms = resp.fence_timeout_ms;
    let contact = |sent_ms| crate::checkpoint::Contact {
        last_contact_ms: sent_ms,
        fence_timeout_ms,
    };
    executor.record_contact(contact(sent_ms));
    let mut interval = Duration::from_millis(u64::from(resp.heartbeat_interval_ms.max(100)));
    tracing::info!(master = %addr, agent_id = %info.id, "registered with master");

    let mut watch = match client
        .watch_tasks(pb::WatchTasksRequest {
            agent_id: info.id.clone(),
            // A snapshot in bounded messages, then only differences: no
            // desired set, however large, outgrows the message limit.
            incremental: true,
        })
        .await
    {
        Ok(r) => r.into_inner(),
        Err(s) => return SessionError::rpc(&addr, "watch tasks", s, true),
    };
    let mut heartbeat = tokio::time::interval(interval);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut health_open = true;
    let mut desired = DesiredSet::new();
    loop {
        // A heartbeat to send now: at its tick, or at once when a GPU's
        // health changed (so the master stops placing work there at once).
        let req = tokio::select! {
            msg = watch.next() => {
                match msg {
                    Some(Ok(msg)) => match desired.apply_owned(msg) {
                        // Acted on only once complete: a half-received snapshot
                        // must not make the executor stop what it does not list.
                        Ok(true) => executor.set_desired(desired.desired().clone()),
                        Ok(false) => {}
                        // Skipping a bad spec would make the executor kill the
                        // task if it were running; better to fail loudly and
                        // start the session (and the snapshot) again.
                        Err(e) => return SessionError::other(&addr, format!("master sent an invalid task: {e}"), true),
                    },
                    Some(Err(s)) => return SessionError::rpc(&addr, "watch tasks", s, true),
                    // A leader that steps down ends its streams.
                    None => return SessionError::other(&addr, "watch tasks: stream ended".into(), true),
                }
                continue;
            },
            changed = health.changed(), if health_open => {
                if changed.is_err() {
                    health_open = false;
                    continue;
                }
                let snapshot = health.borrow();
                if snapshot.generation == told {
                    continue;
                }
                told = snapshot.generation;
                heartbeat.reset();
                heartbeat_request(&info.id, &snapshot, executor, mig)
            },
            _ = heartbeat.tick() => {
                let snapshot = health.borrow();
                told = snapshot.generation;
                heartbeat_request(&info.id, &snapshot, executor, mig)
            },
        };
        let sent_ms = crate::checkpoint::wall_ms();
        refresh(masters, &addr, &mut client);
        match client.heartbeat(req).await {
            Ok(r) => {
                let r = r.into_inner();
                mig_changes(mig, &r);
                if let Some(d) = new_interval(&r, interval) {
                    interval = d;
                    heartbeat = tokio::time::interval_at(tokio::time::Instant::now() + d, d);
                    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                }
            }
            Err(s) => {
                if gpuctl_proto::leader::heard(&s) {
                    executor.record_contact(contact(sent_ms));
                }
                return SessionError::rpc(&addr, "heartbeat", s, true);
            }
        }
        executor.record_contact(contact(sent_ms));
    }
}

/// The interval a heartbeat answer asks for, when it differs from the
/// current one (a master lengthens it as its cluster grows).
fn new_interval(r: &pb::HeartbeatResponse, current: Duration) -> Option<Duration> {
    let d = Duration::from_millis(u64::from(r.heartbeat_interval_ms));
    (r.heartbeat_interval_ms > 0 && d != current).then(|| d.max(Duration::from_millis(100)))
}

/// How often heartbeats keep the fence's clock while a registration waits.
const CONTACT_EVERY: Duration = Duration::from_secs(1);

/// Heartbeats `client`'s master every [`CONTACT_EVERY`] (see
/// [`contact_once`]). Never returns; dropped when the registration ends.
async fn keep_contact(
    mut client: AgentManagerClient<Channel>,
    agent_id: &str,
    health: watch::Receiver<Snapshot>,
    executor: &Arc<Executor>,
) -> std::convert::Infallible {
    loop {
        tokio::time::sleep(CONTACT_EVERY).await;
        contact_once(&mut client, agent_id, &health, executor).await;
    }
}

/// One heartbeat sent to keep the fence's clock, recording the contact
/// when a leader heard it: it answered, or refused with `gpuctl-heard`
/// (the agent must register again, but the leader's clock for it
/// restarted). Only a leader restarts that clock, serving or not; a
/// follower's answer does not count, since a leader this agent cannot
/// reach may be counting its silence. Nothing for an agent without a
/// fence yet (never registered, or `fence_timeout` 0).
async fn contact_once(
    client: &mut AgentManagerClient<Channel>,
    agent_id: &str,
    health: &watch::Receiver<Snapshot>,
    executor: &Arc<Executor>,
) {
    let fence_timeout_ms = executor.fence_timeout_ms();
    if fence_timeout_ms == 0 {
        return;
    }
    let req = heartbeat_request(agent_id, &health.borrow(), executor, None);
    let sent_ms = crate::checkpoint::wall_ms();
    let heard = match client.heartbeat(req).await {
        Ok(_) => true,
        Err(s) => gpuctl_proto::leader::heard(&s),
    };
    if heard {
        executor.record_contact(crate::checkpoint::Contact {
            last_contact_ms: sent_ms,
            fence_timeout_ms,
        });
    }
}

/// Takes the current client for `addr`: a new connection once the agent's
/// certificate was renewed (the master refuses new calls on a connection
/// whose certificate expired; the task watch already open goes on).
fn refresh(masters: &Masters, addr: &str, client: &mut AgentManagerClient<Channel>) {
    if let Ok((a, c)) = masters.client() {
        if a == addr {
            *client = c;
        }
    }
}

/// The discovered GPUs with the health checks' current verdict.
fn with_health(gpus: &[GpuInfo], health: &Snapshot) -> Vec<GpuInfo> {
    gpus.iter()
        .cloned()
        .map(|mut g| {
            if let Some(h) = health.gpus.iter().find(|h| h.uuid == g.uuid) {
                g.healthy = h.healthy;
                g.unhealthy_reason = h.reason.clone();
            }
            g
        })
        .collect()
}

/// Hands the MIG layout changes a heartbeat answer lists to the applier.
fn mig_changes(mig: Option<&Arc<crate::gpu::mig_apply::Applier>>, resp: &pb::HeartbeatResponse) {
    if let Some(m) = mig {
        m.on_changes(&resp.mig_changes);
    } else if !resp.mig_changes.is_empty() {
        tracing::warn!(
            changes = resp.mig_changes.len(),
            "the master asks MIG layout changes of GPUs this agent cannot change (no MIG)"
        );
    }
}

fn heartbeat_request(
    agent_id: &str,
    health: &Snapshot,
    executor: &Executor,
    mig: Option<&Arc<crate::gpu::mig_apply::Applier>>,
) -> pb::HeartbeatRequest {
    pb::HeartbeatRequest {
        agent_id: agent_id.to_string(),
        gpus: health.gpus.iter().map(|g| g.report().into()).collect(),
        // Whether Docker answers: a daemon restarting is shown in
        // `gpuctl agents`, not taken out on the tasks.
        runtimes: executor
            .runtime_status()
            .into_iter()
            .map(|(runtime, s)| {
                RuntimeStatus {
                    runtime,
                    available: s.available,
                    message: s.message,
                }
                .into()
            })
            .collect(),
        mig_results: mig.map(|m| m.results()).unwrap_or_default(),
    }
}

/// How often an update waiting for its framework's acknowledgement is
/// offered again (the answer says when it has been acknowledged).
const ACK_POLL: Duration = Duration::from_millis(500);

/// Sends status updates in order per task, each until it is acknowledged
/// (gpuctl's own jobs: once recorded; a framework's task: once its framework
/// acknowledged it), Mesos' status update manager in small. Updates of
/// different tasks do not wait for each other. Returns once the channel is
/// closed or `done` is true, and nothing is pending (the caller bounds that
/// wait at shutdown). `acknowledged` is told of each update the master
/// acknowledged or refused for good (the executor's
/// [`Executor::acknowledged`]).
pub async fn status_sender(
    masters: Arc<Masters>,
    mut rx: mpsc::Receiver<StatusUpdate>,
    acknowledged: impl Fn(&StatusUpdate),
    mut done: watch::Receiver<bool>,
) {
    let mut queues: BTreeMap<String, VecDeque<StatusUpdate>> = BTreeMap::new();
    let mut backoff = Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
    let mut redirects = 0;
    let mut closed = false;
    let mut batching = true;
    loop {
        while let Ok(u) = rx.try_recv() {
            queues.entry(u.task_id.clone()).or_default().push_back(u);
        }
        if queues.is_empty() {
            if closed || *done.borrow() {
                return;
            }
            tokio::select! {
                u = rx.recv() => match u {
                    Some(u) => queues.entry(u.task_id.clone()).or_default().push_back(u),
                    None => return,
                },
                r = done.changed() => if r.is_err() { return },
            }
            continue;
        }
        let sent = if batching {
            send_batch(&masters, &mut queues, &acknowledged).await
        } else {
            send_each(&masters, &mut queues, &acknowledged).await
        };
        let (mut progress, mut unreachable, mut redirected) = (false, false, false);
        match sent {
            Sent::Progress => progress = true,
            Sent::Waiting => {}
            Sent::Redirected => redirected = true,
            Sent::Unreachable => unreachable = true,
            Sent::Unsupported => {
                // A master that predates UpdateStatuses: one call each.
                batching = false;
                continue;
            }
        }
        queues.retain(|_, q| !q.is_empty());
        if progress {
            backoff.reset();
            redirects = 0;
            continue;
        }
        if redirected && redirects < FREE_REDIRECTS {
            redirects += 1;
            continue;
        }
        if redirected {
            unreachable = true;
        }
        let wait = if unreachable {
            backoff.next_wait()
        } else {
            ACK_POLL
        };
        tokio::select! {
            u = rx.recv(), if !closed => match u {
                Some(u) => queues.entry(u.task_id.clone()).or_default().push_back(u),
                None => closed = true,
            },
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// How one round of sending went.
#[derive(Debug, PartialEq)]
enum Sent {
    /// Some update was acknowledged (or refused for good).
    Progress,
    /// Delivered, waiting for frameworks' acknowledgements.
    Waiting,
    /// Sent elsewhere by a redirect: try again at once.
    Redirected,
    /// No master took it: back off.
    Unreachable,
    /// The master has no UpdateStatuses.
    Unsupported,
}

/// What to do after a failed call to `addr`.
fn after_error(masters: &Masters, addr: &str, s: &tonic::Status) -> Sent {
    // Not the leader, down, or the connection broke (a transport error):
    // go where the answer points.
    let moved = may_retry(s);
    if moved && masters.after_failure(addr, Some(s)) {
        Sent::Redirected
    } else {
        Sent::Unreachable
    }
}

/// The first update of every task in one `UpdateStatuses` call: the
/// master records them together (their commands share Raft's writes).
async fn send_batch(
    masters: &Masters,
    queues: &mut BTreeMap<String, VecDeque<StatusUpdate>>,
    acknowledged: &impl Fn(&StatusUpdate),
) -> Sent {
    let batch: Vec<StatusUpdate> = queues
        .values()
        .filter_map(with_latest_state)
        .take(MAX_STATUS_BATCH)
        .collect();
    let (addr, result) = match masters.client() {
        Ok((addr, mut c)) => {
            let req = pb::StatusUpdates {
                updates: batch.iter().cloned().map(Into::into).collect(),
            };
            (addr, c.update_statuses(req).await)
        }
        Err(e) => (masters.current_addr(), Err(tonic::Status::unavailable(e))),
    };
    let verdicts = match result {
        Ok(r) if r.get_ref().verdicts.len() == batch.len() => r.into_inner().verdicts,
        Ok(r) => {
            tracing::warn!(master = %addr, sent = batch.len(), verdicts = r.get_ref().verdicts.len(), "status verdicts do not match the updates; retrying");
            return Sent::Unreachable;
        }
        Err(s) if s.code() == tonic::Code::Unimplemented => return Sent::Unsupported,
        Err(s) => {
            tracing::debug!(updates = batch.len(), master = %addr, error = %s.message(), "status updates not delivered; retrying");
            return after_error(masters, &addr, &s);
        }
    };
    let mut sent = Sent::Waiting;
    for (update, verdict) in batch.iter().zip(verdicts) {
        use pb::status_verdict::Kind;
        match Kind::try_from(verdict.kind) {
            Ok(Kind::Recorded) => continue,
            Ok(Kind::Refused) => {
                // The master will never take it; retrying would block the
                // task's later updates. As good as acknowledged.
                tracing::warn!(task_id = %update.task_id, error = %verdict.message, "status update refused; dropped");
            }
            Ok(Kind::Acknowledged) => {}
            // A verdict this agent does not know: ask again later.
            Err(_) => continue,
        }
        if let Some(u) = queues
            .get_mut(&update.task_id)
            .and_then(VecDeque::pop_front)
        {
            acknowledged(&u);
        }
        sent = Sent::Progress;
    }
    sent
}

/// A task's next update to send, saying the state of the newest one
/// queued behind it: a task that ended while an earlier update waits for
/// its framework's acknowledgement frees its GPUs in the master at once.
fn with_latest_state(queue: &VecDeque<StatusUpdate>) -> Option<StatusUpdate> {
    let mut next = queue.front()?.clone();
    next.latest_state = queue
        .back()
        .filter(|_| queue.len() > 1)
        .map(|last| last.state);
    Some(next)
}

/// One `UpdateStatus` call per task, for a master without UpdateStatuses.
async fn send_each(
    masters: &Masters,
    queues: &mut BTreeMap<String, VecDeque<StatusUpdate>>,
    acknowledged: &impl Fn(&StatusUpdate),
) -> Sent {
    let mut sent = Sent::Waiting;
    for queue in queues.values_mut() {
        let Some(update) = with_latest_state(queue) else {
            continue;
        };
        let (addr, result) = match masters.client() {
            Ok((addr, mut c)) => {
                let r = c
                    .update_status(pb::StatusUpdate::from(update.clone()))
                    .await;
                (addr, r)
            }
            Err(e) => (masters.current_addr(), Err(tonic::Status::unavailable(e))),
        };
        match result {
            Ok(ack) if ack.get_ref().acknowledged => {}
            // Recorded; its framework has not acknowledged it yet.
            Ok(_) => continue,
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::InvalidArgument
                        | tonic::Code::FailedPrecondition
                        | tonic::Code::NotFound
                ) =>
            {
                tracing::warn!(task_id = %update.task_id, error = %s.message(), "status update refused; dropped");
            }
            Err(s) => {
                tracing::debug!(task_id = %update.task_id, master = %addr, error = %s.message(), "status update not delivered; retrying");
                return after_error(masters, &addr, &s);
            }
        }
        if let Some(u) = queue.pop_front() {
            acknowledged(&u);
        }
        sent = Sent::Progress;
    }
    sent
}

#[cfg(test)]
mod tests {
    use super::*;

    use gpuctl_proto::leader::not_leader;

    #[test]
    fn an_election_answer_starts_the_backoff_again() {
        let mut b = Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
        // A dead master, three times: 100, 200, 400 ms.
        let waits: Vec<Duration> = (0..3).map(|_| retry_wait(&mut b, false, "a")).collect();
        assert_eq!(
            waits,
            [100, 200, 400].map(Duration::from_millis),
            "other failures back off"
        );
        // A live master in an election: polled soon, and the dead one
        // next costs the shortest wait again.
        let poll = retry_wait(&mut b, true, "a");
        assert!(poll >= ELECTION_POLL && poll < ELECTION_POLL + Duration::from_millis(100));
        assert_eq!(retry_wait(&mut b, false, "a"), BACKOFF_MIN);
        assert_eq!(retry_wait(&mut b, false, "a"), BACKOFF_MIN * 2);
    }

    #[test]
    fn election_poll_is_short_and_jittered() {
        for id in ["a", "node-1", "gpu-host-17-abcdef01"] {
            let d = election_poll(id);
            assert!(
                d >= ELECTION_POLL && d < ELECTION_POLL + Duration::from_millis(100),
                "{d:?}"
            );
        }
    }

    fn list(addrs: &[&str]) -> Vec<String> {
        addrs.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn a_redirect_goes_to_the_named_leader() {
        let mut addrs = list(&["m1:7050", "m2:7050", "m3:7050"]);
        let s = not_leader(Some((3, "m3:7050")));
        assert_eq!(next_master(&mut addrs, 0, Some(&s)), (2, true));
        assert_eq!(addrs.len(), 3);
    }

    #[test]
    fn an_unknown_leader_is_added() {
        let mut addrs = list(&["m1:7050", "m2:7050"]);
        let s = not_leader(Some((4, "m4:7050")));
        assert_eq!(next_master(&mut addrs, 1, Some(&s)), (2, true));
        assert_eq!(addrs, list(&["m1:7050", "m2:7050", "m4:7050"]));
    }

    #[test]
    fn without_a_hint_the_next_address_is_tried() {
        let mut addrs = list(&["m1:7050", "m2:7050", "m3:7050"]);
        let election = not_leader(None);
        assert_eq!(next_master(&mut addrs, 0, Some(&election)), (1, false));
        assert_eq!(next_master(&mut addrs, 2, Some(&election)), (0, false));
        let down = Status::unavailable("tcp connect error");
        assert_eq!(next_master(&mut addrs, 1, Some(&down)), (2, false));
        // A stream that just ended: no status at all.
        assert_eq!(next_master(&mut addrs, 1, None), (2, false));
        let mut one = list(&["m1:7050"]);
        assert_eq!(next_master(&mut one, 0, None), (0, false));
    }

    #[test]
    fn useless_hints_are_ignored() {
        let mut addrs = list(&["m1:7050", "m2:7050"]);
        // Naming the master that just refused, or something that is not
        // HOST:PORT, is no redirect.
        for bad in ["m1:7050", "nonsense", "m9:0", ":7050", "http://m9:7050/x"] {
            let s = not_leader(Some((1, bad)));
            assert_eq!(next_master(&mut addrs, 0, Some(&s)), (1, false), "{bad}");
        }
        // A hint on an error that is not a redirect does not count either.
        let mut s = Status::internal("boom");
        s.metadata_mut().insert(
            gpuctl_proto::leader::LEADER_METADATA,
            tonic::metadata::MetadataValue::from_static("m2:7050"),
        );
        assert_eq!(next_master(&mut addrs, 0, Some(&s)), (1, false));
        assert_eq!(addrs.len(), 2);
    }

    #[tokio::test]
    async fn only_the_first_caller_to_fail_moves_the_agent() {
        let masters = Masters::new(list(&["m1:7050", "m2:7050", "m3:7050"]));
        assert!(!masters.after_failure("m1:7050", None));
        assert_eq!(masters.current_addr(), "m2:7050");
        // Another task's failure at m1 is old news: it just tries m2 now.
        assert!(masters.after_failure("m1:7050", None));
        assert_eq!(masters.current_addr(), "m2:7050");
        let s = not_leader(Some((3, "m3:7050")));
        assert!(masters.after_failure("m2:7050", Some(&s)));
        assert_eq!(masters.current_addr(), "m3:7050");
        let (addr, _client) = masters.client().unwrap();
        assert_eq!(addr, "m3:7050");
    }

    /// A master's AgentManager that answers `UpdateStatuses` from a script
    /// shared by every address, and logs when and where each call came.
    #[derive(Clone)]
    struct Scripted {
        addr: &'static str,
        script: Arc<std::sync::Mutex<VecDeque<Result<i32, Status>>>>,
        calls: Arc<std::sync::Mutex<Vec<Call>>>,
        started: tokio::time::Instant,
    }

    type Answer<T> = Result<tonic::Response<T>, Status>;
    /// Where a call came, when, and what it carried.
    type Call = (&'static str, Duration, Vec<pb::StatusUpdate>);

    #[tonic::async_trait]
    impl pb::agent_manager_server::AgentManager for Scripted {
        async fn register(
            &self,
            _: tonic::Request<pb::RegisterRequest>,
        ) -> Answer<pb::RegisterResponse> {
            Err(Status::unimplemented(""))
        }
        async fn heartbeat(
            &self,
            _: tonic::Request<pb::HeartbeatRequest>,
        ) -> Answer<pb::HeartbeatResponse> {
            Err(Status::unimplemented(""))
        }
        type WatchTasksStream = futures::stream::Empty<Result<pb::DesiredTasks, Status>>;
        async fn watch_tasks(
            &self,
            _: tonic::Request<pb::WatchTasksRequest>,
        ) -> Answer<Self::WatchTasksStream> {
            Err(Status::unimplemented(""))
        }
        async fn update_status(
            &self,
            _: tonic::Request<pb::StatusUpdate>,
        ) -> Answer<pb::StatusAck> {
            Err(Status::unimplemented(""))
        }
        async fn update_statuses(
            &self,
            r: tonic::Request<pb::StatusUpdates>,
        ) -> Answer<pb::StatusVerdicts> {
            let updates = r.into_inner().updates;
            let n = updates.len();
            self.calls
                .lock()
                .unwrap()
                .push((self.addr, self.started.elapsed(), updates));
            let kind = self
                .script
                .lock()
                .unwrap()
                .pop_front()
                .expect("a scripted answer")?;
            let verdicts = (0..n)
                .map(|_| pb::StatusVerdict {
                    kind,
                    message: String::new(),
                })
                .collect();
            Ok(tonic::Response::new(pb::StatusVerdicts { verdicts }))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_update_is_resent_with_backoff_follows_the_leader_and_polls_for_its_ack() {
        use gpuctl_core::types::TaskState;
        use pb::status_verdict::Kind;
        let net = gpuctl_proto::memnet::Net::new();
        let script = Arc::new(std::sync::Mutex::new(VecDeque::from([
            // An election at m1, twice: backoff of 100, then 200 ms.
            Err(not_leader(None)),
            Err(not_leader(None)),
            // m1 lost it to m2 and says so: there at once.
            Err(not_leader(Some((2, "m2:7050")))),
            // Recorded, its framework has not acknowledged it: asked
            // again after ACK_POLL.
            Ok(Kind::Recorded as i32),
            Ok(Kind::Acknowledged as i32),
        ])));
        let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
        let started = tokio::time::Instant::now();
        for addr in ["m1:7050", "m2:7050"] {
            let svc = Scripted {
                addr,
                script: script.clone(),
                calls: calls.clone(),
                started,
            };
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(pb::agent_manager_server::AgentManagerServer::new(svc))
                    .serve_with_incoming(net.listen(addr)),
            );
        }
        let masters = Arc::new(Masters::with_connect(vec!["m1:7050".into()], net.connect()));
        let (tx, rx) = mpsc::channel(8);
        let (done_tx, done) = watch::channel(false);
        let acked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = acked.clone();
        let sender = tokio::spawn(status_sender(
            masters.clone(),
            rx,
            move |u: &StatusUpdate| {
                sink.lock()
                    .unwrap()
                    .push((started.elapsed(), u.task_id.clone()))
            },
            done,
        ));
        let update = StatusUpdate {
            agent_id: "a1".into(),
            task_id: "job-1.0".into(),
            state: TaskState::Finished,
            exit_code: Some(0),
            message: String::new(),
            uuid: vec![7; 16],
            gpu_unhealthy: false,
            fenced: false,
            latest_state: None,
            requires: Vec::new(),
            enforcement: None,
            gpu_memory_limit: false,
            hung: false,
            failed_gpus: Vec::new(),
            runtime_restarted: false,
            liveness_failed: false,
            health: None,
        };
        tx.send(update.clone()).await.unwrap();
        done_tx.send(true).unwrap();
        // It returns once nothing is pending.
        tokio::time::timeout(Duration::from_secs(60), sender)
            .await
            .unwrap()
            .unwrap();
        let calls = calls.lock().unwrap();
        let seen: Vec<(&str, u64)> = calls
            .iter()
            .map(|(a, t, _)| (*a, t.as_millis() as u64))
            .collect();
        assert_eq!(
            seen,
            [
                ("m1:7050", 0),
                ("m1:7050", 100),
                ("m1:7050", 300),
                ("m2:7050", 300),
                ("m2:7050", 800)
            ]
        );
        // The same update every time, whole.
        for (_, _, sent) in calls.iter() {
            assert_eq!(sent.len(), 1);
            assert_eq!(sent[0], pb::StatusUpdate::from(update.clone()));
        }
        assert_eq!(
            *acked.lock().unwrap(),
            [(Duration::from_millis(800), "job-1.0".to_string())]
        );
        assert_eq!(
            masters.current_addr(),
            "m2:7050",
            "the next call starts at the leader"
        );
        assert!(script.lock().unwrap().is_empty());
    }
}
