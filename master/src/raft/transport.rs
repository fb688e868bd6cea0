//! Carrying raft messages between masters.
//!
//! [`GrpcTransport`] keeps one queue and one sending task per peer, so that
//! messages to a peer leave in order and a slow or dead peer never holds up
//! the node or the others. Delivery is best effort: a full queue or a failed
//! call drops messages, which Raft resends; the node is told a peer is
//! unreachable, or that a snapshot failed, so it can retry sooner.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuctl_auth::tls::Tls;
use gpuctl_auth::CertRole;
use gpuctl_proto::pb;
use gpuctl_proto::pb::raft_transport_client::RaftTransportClient;
use protobuf::Message as _;
use raft::eraftpb::{Message, MessageType};
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint};

use super::types::Reporter;
use super::Addresses;

/// Where the node hands its outgoing messages.
pub trait Transport: Send + Sync + 'static {
    /// Sends `msgs` (each names its destination in `to`); never blocks.
    fn send(&self, msgs: Vec<Message>, reporter: &Reporter);
}

/// Messages queued per peer before newer ones are dropped.
const PEER_QUEUE: usize = 4096;
/// Messages sent in one call.
const BATCH: usize = 256;
/// Largest raft call (a snapshot is one message).
pub const MAX_RAFT_MESSAGE_BYTES: usize = 1024 * 1024 * 1024;
/// Connections (lanes) to one peer at most, each with one call in flight.
/// A lost packet stalls one TCP connection until it is retransmitted (a
/// round trip or more, doubling with each loss); the next messages go out
/// on another lane meanwhile. A fast link needs one: a lane is opened only
/// when every open one is busy.
pub const MAX_LANES: usize = 8;
/// Failures to reach a peer are logged at most this often.
const WARN_EVERY: Duration = Duration::from_secs(10);
/// A round trip warned about at most this often per peer.
const RTT_WARN_EVERY: Duration = Duration::from_secs(60);

/// The transport's timeouts, all derived from the election timeout, so
/// that a cluster set for a slow link (`--election-timeout-ms`) gets a
/// transport that waits as long.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransportTimeouts {
    pub election: Duration,
    /// Connecting to a peer: two election timeouts (at least 1 s), so
    /// that a lost SYN, retransmitted after 1 s, still connects.
    pub connect: Duration,
    /// One call of ordinary messages: ten election timeouts (at least
    /// 5 s). A call stuck longer holds a lane whose connection is dead.
    pub call: Duration,
    /// One call carrying a snapshot (up to 1 GiB): at least 5 minutes.
    pub snapshot_call: Duration,
    /// HTTP/2 pings on an idle connection, and how long one may go
    /// unanswered before the connection is dropped (lanes reconnect).
    pub keep_alive_interval: Duration,
    pub keep_alive_timeout: Duration,
    /// A lane unused this long is closed: the extra lanes a burst of
    /// losses opened, and every lane to a peer this master no longer talks
    /// to (followers talk to each other only in elections), so that no
    /// idle connection pings forever. Thirty election timeouts (at least
    /// 30 s): a leader's lanes carry heartbeats ten times an election
    /// timeout and are never idle that long.
    pub lane_idle: Duration,
}

impl TransportTimeouts {
    pub fn from_election(election: Duration) -> TransportTimeouts {
        TransportTimeouts {
            election,
            connect: (election * 2).max(Duration::from_secs(1)),
            call: (election * 10).max(Duration::from_secs(5)),
            snapshot_call: (election * 100).max(Duration::from_secs(300)),
            keep_alive_interval: election.max(Duration::from_millis(500)),
            keep_alive_timeout: (election * 5).max(Duration::from_secs(3)),
            lane_idle: (election * 30).max(Duration::from_secs(30)),
        }
    }

    /// A smoothed round trip this large or larger makes elections likely
    /// on a link that also loses packets: heartbeats go out every tenth of
    /// an election timeout, and a retransmission takes a round trip or two.
    pub fn rtt_warning(&self) -> Duration {
        self.election / 5
    }
}

struct Peer {
    addr: String,
    tx: mpsc::Sender<Message>,
}

pub struct GrpcTransport {
    id: u64,
    /// This master's API address, sent along so peers can answer.
    address: String,
    addresses: Addresses,
    peers: Mutex<HashMap<u64, Peer>>,
    /// This master's TLS (its master certificate) when TLS is on.
    tls: Option<Arc<Tls>>,
    timeouts: TransportTimeouts,
    /// Smoothed round trip to each peer, for status and metrics.
    rtts: Rtts,
    /// Connections (lanes) open to each peer.
    lanes_open: LanesOpen,
}

/// Smoothed round trip to each peer and when it was last measured.
type Rtts = Arc<Mutex<BTreeMap<u64, (Duration, Instant)>>>;

/// Lanes open to each peer, kept by its link.
type LanesOpen = Arc<Mutex<BTreeMap<u64, usize>>>;

/// A round trip not measured for this long is left out: followers talk
/// to each other only in elections, and a figure from then would stand
/// for a link nobody uses any more.
const RTT_FRESH: Duration = Duration::from_secs(20);

impl GrpcTransport {
    pub fn new(
        id: u64,
        address: String,
        addresses: Addresses,
        tls: Option<Arc<Tls>>,
        election_timeout: Duration,
    ) -> GrpcTransport {
        GrpcTransport {
            id,
            address,
            addresses,
            peers: Mutex::new(HashMap::new()),
            tls,
            timeouts: TransportTimeouts::from_election(election_timeout),
            rtts: Arc::default(),
            lanes_open: Arc::default(),
        }
    }

    /// The same, closing lanes idle for `idle` (tests).
    #[cfg(test)]
    fn with_lane_idle(mut self, idle: Duration) -> GrpcTransport {
        self.timeouts.lane_idle = idle;
        self
    }

    /// The connections (lanes) open to each peer now.
    pub fn connections(&self) -> BTreeMap<u64, usize> {
        self.lanes_open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The smoothed round trip of Raft calls to each peer heard from.
    pub fn round_trips(&self) -> RoundTrips {
        RoundTrips(self.rtts.clone())
    }

    fn spawn_peer(&self, to: u64, addr: String, reporter: Reporter) -> Peer {
        let (tx, rx) = mpsc::channel(PEER_QUEUE);
        let link = PeerLink {
            from: self.id,
            from_address: self.address.clone(),
            to,
            addr: addr.clone(),
            reporter,
            tls: self.tls.clone(),
            timeouts: self.timeouts,
            rtts: self.rtts.clone(),
            lanes_open: self.lanes_open.clone(),
        };
        tokio::spawn(link.run(rx));
        Peer { addr, tx }
    }
}

/// A shared view of the transport's round trips, by peer id.
#[derive(Clone, Default)]
pub struct RoundTrips(Rtts);

impl RoundTrips {
    /// The round trips measured in the last [`RTT_FRESH`].
    pub fn get(&self) -> BTreeMap<u64, Duration> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, (_, at))| at.elapsed() < RTT_FRESH)
            .map(|(peer, (rtt, _))| (*peer, *rtt))
            .collect()
    }
}

impl Transport for GrpcTransport {
    fn send(&self, msgs: Vec<Message>, reporter: &Reporter) {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        for m in msgs {
            let to = m.to;
            let is_snapshot = m.get_msg_type() == MessageType::MsgSnapshot;
            let Some(addr) = self.addresses.get(to) else {
                tracing::debug!(to, "no address for raft peer; message dropped");
                peers.remove(&to);
                reporter.unreachable(to, is_snapshot);
                continue;
            };
            // A new address (the peer moved, or was re-added) gets a new
            // connection; dropping the old queue ends its task.
            if peers.get(&to).is_none_or(|p| p.addr != addr) {
                let peer = self.spawn_peer(to, addr, reporter.clone());
                peers.insert(to, peer);
            }
            let Some(peer) = peers.get(&to) else { continue };
            if peer.tx.try_send(m).is_err() {
                reporter.unreachable(to, is_snapshot);
            }
        }
    }
}

/// One peer's sending side: its queue, its lanes, its round trip.
struct PeerLink {
    from: u64,
    from_address: String,
    to: u64,
    addr: String,
    reporter: Reporter,
    tls: Option<Arc<Tls>>,
    timeouts: TransportTimeouts,
    rtts: Rtts,
    lanes_open: LanesOpen,
}

/// One connection to the peer, with at most one call in flight.
struct Lane {
    client: RaftTransportClient<Channel>,
    /// The certificate expiry the connection was made with.
    cert: u64,
    busy: bool,
    /// When its last call started or ended.
    last_used: Instant,
}

/// A peer's lanes by slot: a slot's index names its lane in the calls in
/// flight, so a closed lane leaves its slot empty (`None`) for the next.
type Lanes = Vec<Option<Lane>>;

/// A batch, and when its oldest message was queued.
struct Batch {
    messages: Vec<Message>,
    queued: Instant,
}

/// What a link knows of its peer's health, for its logs and round trips.
struct PeerHealth {
    last_ok: Instant,
    last_warn: Option<Instant>,
    last_rtt_warn: Option<Instant>,
    srtt: Option<Duration>,
}

/// How a call ended.
enum CallEnd {
    Delivered(Duration),
    /// Failed before a byte left: the batch may go again.
    NeverSent(tonic::Status),
    Failed(tonic::Status),
}

impl PeerLink {
    async fn run(self, mut rx: mpsc::Receiver<Message>) {
        let endpoint = match Endpoint::from_shared(format!("http://{}", self.addr)) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(to = self.to, addr = %self.addr, error = %e, "bad raft peer address");
                return;
            }
        };
        let t = self.timeouts;
        let endpoint = endpoint
            .connect_timeout(t.connect)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(t.keep_alive_interval)
            .keep_alive_timeout(t.keep_alive_timeout)
            .keep_alive_while_idle(true);
        let mut lanes: Lanes = Vec::new();
        let mut next_idle_check = tokio::time::Instant::now() + t.lane_idle / 4;
        let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(usize, Batch, CallEnd)>();
        // A batch that failed before it was sent goes first next time.
        let mut retry: Option<Batch> = None;
        let mut health = PeerHealth {
            last_ok: Instant::now(),
            last_warn: None,
            last_rtt_warn: None,
            srtt: None,
        };
        let mut open = true;
        loop {
            let free = lanes
                .iter()
                .position(|l| l.as_ref().is_some_and(|l| !l.busy));
            let can_send = free.is_some() || lanes.iter().flatten().count() < MAX_LANES;
            tokio::select! {
                _ = tokio::time::sleep_until(next_idle_check) => {
                    next_idle_check = tokio::time::Instant::now() + t.lane_idle / 4;
                    self.close_idle_lanes(&mut lanes);
                }
                first = rx.recv(), if open && can_send && retry.is_none() => {
                    let Some(first) = first else {
                        open = false;
                        continue;
                    };
                    let mut messages = vec![first];
                    while messages.len() < BATCH {
                        match rx.try_recv() {
                            Ok(m) => messages.push(m),
                            Err(_) => break,
                        }
                    }
                    let batch = Batch { messages, queued: Instant::now() };
                    let lane = self.lane(&mut lanes, free, &endpoint);
                    if let Some(l) = lanes[lane].as_mut() {
                        self.send(l, lane, batch, done_tx.clone());
                    }
                }
                _ = std::future::ready(()), if can_send && retry.is_some() => {
                    if let Some(batch) = retry.take() {
                        let lane = self.lane(&mut lanes, free, &endpoint);
                        if let Some(l) = lanes[lane].as_mut() {
                            self.send(l, lane, batch, done_tx.clone());
                        }
                    }
                }
                done = done_rx.recv() => {
                    let Some((lane, batch, sent)) = done else { break };
                    if let Some(l) = lanes.get_mut(lane).and_then(Option::as_mut) {
                        l.busy = false;
                        l.last_used = Instant::now();
                    }
                    let snapshots = batch
                        .messages
                        .iter()
                        .filter(|m| m.get_msg_type() == MessageType::MsgSnapshot)
                        .count();
                    match sent {
                        CallEnd::Delivered(rtt) => self.delivered(rtt, snapshots, &mut health),
                        CallEnd::NeverSent(status) if snapshots == 0 && batch.queued.elapsed() < t.election => {
                            // Never sent (no connection yet): keep it
                            // rather than lose a round of heartbeats and
                            // appends; stale after an election timeout,
                            // when Raft has sent newer ones.
                            self.failed(&status, snapshots, health.last_ok, &mut health.last_warn);
                            retry = Some(batch);
                            // Do not spin on a peer that refuses: the
                            // next try waits for the connect timeout or
                            // for new messages.
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        CallEnd::NeverSent(status) | CallEnd::Failed(status) => {
                            self.failed(&status, snapshots, health.last_ok, &mut health.last_warn);
                        }
                    }
                }
            }
        }
    }

    /// Closes the lanes idle for `lane_idle`: dropping its client closes a
    /// connection (no call holds a clone: it is not busy).
    fn close_idle_lanes(&self, lanes: &mut Lanes) {
        let idle = self.timeouts.lane_idle;
        let mut closed = 0;
        for slot in lanes.iter_mut() {
            if slot
                .as_ref()
                .is_some_and(|l| !l.busy && l.last_used.elapsed() >= idle)
            {
                *slot = None;
                closed += 1;
            }
        }
        if closed > 0 {
            tracing::debug!(to = self.to, closed, "idle raft peer connections closed");
            self.count_lanes(lanes);
        }
    }

    /// A batch arrived: the peer is reachable, its snapshots are reported,
    /// and (without snapshots, which take as long as their size) the round
    /// trip is smoothed, kept and warned of when it is long for the
    /// election timeout.
    fn delivered(&self, rtt: Duration, snapshots: usize, h: &mut PeerHealth) {
        let t = self.timeouts;
        h.last_ok = Instant::now();
        for _ in 0..snapshots {
            self.reporter.snapshot(self.to, true);
        }
        if h.last_warn.take().is_some() {
            tracing::info!(to = self.to, addr = %self.addr, "raft peer reachable again");
        }
        // Snapshots take as long as their size, not the link.
        if snapshots == 0 {
            let s = smooth(h.srtt, rtt);
            h.srtt = Some(s);
            self.rtts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(self.to, (s, Instant::now()));
            if s >= t.rtt_warning()
                && h.last_rtt_warn
                    .is_none_or(|w| w.elapsed() >= RTT_WARN_EVERY)
            {
                h.last_rtt_warn = Some(Instant::now());
                tracing::warn!(
                    to = self.to,
                    addr = %self.addr,
                    round_trip_ms = s.as_millis() as u64,
                    election_timeout_ms = t.election.as_millis() as u64,
                    suggested_election_timeout_ms = (s * 10).as_millis() as u64,
                    "the round trip to this raft peer is a fifth of the election timeout or more: \
                     a lossy link will cause elections; set --election-timeout-ms to ten round trips \
                     or more on every master (docs/deployment.md)"
                );
            }
        }
    }

    /// The slot of the lane to send on: `free`, else a new lane in an
    /// empty slot or a new one.
    fn lane(&self, lanes: &mut Lanes, free: Option<usize>, endpoint: &Endpoint) -> usize {
        if let Some(i) = free {
            // A rotated certificate needs a new connection: peers refuse
            // calls on one whose certificate expired.
            if lanes[i].as_ref().is_some_and(|l| l.cert != self.cert()) {
                lanes[i] = Some(self.connect(endpoint));
            }
            return i;
        }
        let i = match lanes.iter().position(Option::is_none) {
            Some(i) => {
                lanes[i] = Some(self.connect(endpoint));
                i
            }
            None => {
                lanes.push(Some(self.connect(endpoint)));
                lanes.len() - 1
            }
        };
        self.count_lanes(lanes);
        i
    }

    /// Records how many lanes are open to the peer.
    fn count_lanes(&self, lanes: &Lanes) {
        self.lanes_open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(self.to, lanes.iter().flatten().count());
    }

    fn cert(&self) -> u64 {
        self.tls
            .as_ref()
            .and_then(|t| t.identity())
            .map_or(0, |i| i.not_after_ms)
    }

    fn connect(&self, endpoint: &Endpoint) -> Lane {
        // The peer must hold a master certificate (checked by the connector).
        let client = RaftTransportClient::new(gpuctl_auth::tls::channel(
            endpoint,
            self.tls.as_ref(),
            CertRole::Master,
        ))
        .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES)
        .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES);
        Lane {
            client,
            cert: self.cert(),
            busy: false,
            last_used: Instant::now(),
        }
    }

    fn send(
        &self,
        lane: &mut Lane,
        index: usize,
        batch: Batch,
        done: mpsc::UnboundedSender<(usize, Batch, CallEnd)>,
    ) {
        lane.busy = true;
        lane.last_used = Instant::now();
        let mut messages = Vec::with_capacity(batch.messages.len());
        let mut snapshot = false;
        for m in &batch.messages {
            snapshot |= m.get_msg_type() == MessageType::MsgSnapshot;
            match m.write_to_bytes() {
                Ok(b) => messages.push(b),
                Err(e) => tracing::error!(to = self.to, error = %e, "cannot encode raft message"),
            }
        }
        let req = pb::StepRequest {
            from: self.from,
            from_address: self.from_address.clone(),
            messages,
        };
        let limit = if snapshot {
            self.timeouts.snapshot_call
        } else {
            self.timeouts.call
        };
        let mut client = lane.client.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let sent = match tokio::time::timeout(limit, client.step(req)).await {
                Ok(Ok(_)) => CallEnd::Delivered(started.elapsed()),
                Ok(Err(s)) if gpuctl_proto::leader::never_sent(&s) => CallEnd::NeverSent(s),
                Ok(Err(s)) => CallEnd::Failed(s),
                Err(_) => CallEnd::Failed(tonic::Status::deadline_exceeded(format!(
                    "no answer within {} ms",
                    limit.as_millis()
                ))),
            };
            let _ = done.send((index, batch, sent));
        });
    }

    /// Tells the node the peer is unreachable once nothing got through
    /// for an election timeout (one lane failing while others deliver is
    /// no reason to slow replication down), or a snapshot was lost.
    fn failed(
        &self,
        status: &tonic::Status,
        snapshots: usize,
        last_ok: Instant,
        last_warn: &mut Option<Instant>,
    ) {
        if snapshots > 0 || last_ok.elapsed() >= self.timeouts.election {
            self.reporter.unreachable(self.to, snapshots > 0);
        }
        if last_warn.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            tracing::warn!(to = self.to, addr = %self.addr, error = %status.message(), "cannot reach raft peer");
            *last_warn = Some(Instant::now());
        }
    }
}

/// The smoothed round trip: TCP's estimator (RFC 6298), 7/8 old, 1/8 new.
fn smooth(old: Option<Duration>, sample: Duration) -> Duration {
    match old {
        None => sample,
        Some(o) => (o * 7 + sample) / 8,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_follow_the_election_timeout() {
        let t = TransportTimeouts::from_election(Duration::from_secs(1));
        assert_eq!(t.connect, Duration::from_secs(2));
        assert_eq!(t.call, Duration::from_secs(10));
        assert_eq!(t.keep_alive_timeout, Duration::from_secs(5));
        assert_eq!(t.lane_idle, Duration::from_secs(30));
        assert_eq!(t.rtt_warning(), Duration::from_millis(200));
        let slow = TransportTimeouts::from_election(Duration::from_secs(4));
        assert_eq!(slow.connect, Duration::from_secs(8));
        assert_eq!(slow.call, Duration::from_secs(40));
        assert_eq!(slow.keep_alive_timeout, Duration::from_secs(20));
        assert_eq!(slow.rtt_warning(), Duration::from_millis(800));
        // Short election timeouts (tests) keep sane floors.
        let fast = TransportTimeouts::from_election(Duration::from_millis(100));
        assert_eq!(fast.connect, Duration::from_secs(1));
        assert_eq!(fast.call, Duration::from_secs(5));
        assert_eq!(fast.keep_alive_timeout, Duration::from_secs(3));
    }

    /// A peer that records the indexes it is sent, its first `slow` calls
    /// taking `stall` each.
    #[derive(Clone, Default)]
    struct RecordingPeer {
        slow: usize,
        stall: Duration,
        calls: Arc<std::sync::atomic::AtomicUsize>,
        got: Arc<Mutex<Vec<u64>>>,
    }

    #[tonic::async_trait]
    impl pb::raft_transport_server::RaftTransport for RecordingPeer {
        async fn step(
            &self,
            req: tonic::Request<pb::StepRequest>,
        ) -> Result<tonic::Response<pb::StepResponse>, tonic::Status> {
            let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if n < self.slow {
                tokio::time::sleep(self.stall).await;
            }
            for b in req.into_inner().messages {
                let m = Message::parse_from_bytes(&b).unwrap();
                self.got.lock().unwrap().push(m.index);
            }
            Ok(tonic::Response::new(pb::StepResponse {}))
        }
        async fn status(
            &self,
            _: tonic::Request<pb::StatusRequest>,
        ) -> Result<tonic::Response<pb::MasterInfo>, tonic::Status> {
            Ok(tonic::Response::new(pb::MasterInfo::default()))
        }
    }

    impl RecordingPeer {
        /// Serves it on a loopback port; returns the port.
        async fn serve(&self) -> u16 {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(pb::raft_transport_server::RaftTransportServer::new(
                        self.clone(),
                    ))
                    .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
            );
            port
        }
    }

    /// A peer whose first call hangs (a TCP connection stalled by a lost
    /// packet): what is sent after it still arrives, on another lane.
    #[tokio::test]
    async fn a_stalled_call_does_not_hold_up_the_next_messages() {
        use std::sync::atomic::Ordering;
        let peer = RecordingPeer {
            slow: 1,
            stall: Duration::from_secs(3600),
            ..Default::default()
        };
        let addr = format!("127.0.0.1:{}", peer.serve().await);
        let addresses = Addresses::default();
        addresses.set(2, &addr);
        let t = GrpcTransport::new(1, "me".into(), addresses, None, Duration::from_secs(1));
        let (reporter, mut reports) = Reporter::counting();
        let msg = |index| Message {
            to: 2,
            index,
            ..Default::default()
        };
        t.send(vec![msg(1)], &reporter);
        let stuck = tokio::time::timeout(Duration::from_secs(10), async {
            while peer.calls.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(stuck.is_ok(), "the first call never arrived");
        // Sent one by one, each while the lanes before it are busy or free.
        for i in 2..=4 {
            t.send(vec![msg(i)], &reporter);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let arrived = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if peer.got.lock().unwrap().len() >= 3 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(
            arrived.is_ok(),
            "messages behind the stalled call did not arrive: {:?}",
            peer.got.lock().unwrap()
        );
        let mut got = peer.got.lock().unwrap().clone();
        got.sort_unstable();
        assert_eq!(got, vec![2, 3, 4]);
        // One stalled lane while the others deliver: not unreachable.
        assert_eq!(reports(), 0);
        assert!(t.round_trips().get().contains_key(&2));
    }

    /// Server-side TCP connections to `port` that are established, from
    /// /proc/net/tcp (what the kernel holds, not what the transport says).
    fn established_to(port: u16) -> usize {
        let text = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
        text.lines()
            .skip(1)
            .filter(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() > 3
                    && f[3] == "01"
                    && f[1]
                        .rsplit(':')
                        .next()
                        .and_then(|p| u16::from_str_radix(p, 16).ok())
                        == Some(port)
            })
            .count()
    }

    /// A burst of slow calls opens several lanes; once idle for the lane
    /// idle time every one of them is closed (seen in the kernel's table
    /// of connections, not only in the transport's count), and the next
    /// message opens one again and arrives.
    #[tokio::test]
    async fn idle_lanes_are_closed_and_opened_again_when_needed() {
        let peer = RecordingPeer {
            slow: 3,
            stall: Duration::from_millis(300),
            ..Default::default()
        };
        let port = peer.serve().await;
        let addresses = Addresses::default();
        addresses.set(2, &format!("127.0.0.1:{port}"));
        let t = GrpcTransport::new(1, "me".into(), addresses, None, Duration::from_secs(1))
            .with_lane_idle(Duration::from_secs(3));
        let (reporter, _reports) = Reporter::counting();
        let msg = |index| Message {
            to: 2,
            index,
            ..Default::default()
        };
        async fn until(what: &str, check: impl Fn() -> bool) {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !check() {
                assert!(Instant::now() < deadline, "{what}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        for i in 1..=3 {
            t.send(vec![msg(i)], &reporter);
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        until("three arrived", || peer.got.lock().unwrap().len() == 3).await;
        let opened = t.connections().get(&2).copied().unwrap_or(0);
        assert!(opened >= 2, "a burst of slow calls opened {opened} lanes");
        assert!(
            established_to(port) >= 2,
            "{} connections",
            established_to(port)
        );
        until("idle lanes closed", || {
            established_to(port) == 0 && t.connections().get(&2) == Some(&0)
        })
        .await;
        t.send(vec![msg(4)], &reporter);
        until("the next message arrived", || {
            peer.got.lock().unwrap().len() == 4
        })
        .await;
        assert_eq!(t.connections().get(&2), Some(&1));
        assert_eq!(established_to(port), 1);
    }

    #[test]
    fn round_trips_not_measured_lately_are_left_out() {
        let rtts: Rtts = Arc::default();
        let now = Instant::now();
        let old = now.checked_sub(RTT_FRESH * 2).unwrap();
        rtts.lock()
            .unwrap()
            .insert(2, (Duration::from_millis(3), old));
        rtts.lock()
            .unwrap()
            .insert(3, (Duration::from_millis(400), now));
        let got = RoundTrips(rtts).get();
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got.get(&3), Some(&Duration::from_millis(400)));
    }

    #[test]
    fn round_trips_are_smoothed() {
        let ms = Duration::from_millis;
        assert_eq!(smooth(None, ms(400)), ms(400));
        assert_eq!(smooth(Some(ms(400)), ms(1200)), ms(500));
        assert_eq!(smooth(Some(ms(800)), ms(0)), ms(700));
    }
}
