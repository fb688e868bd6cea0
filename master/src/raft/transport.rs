//! Carrying raft messages between masters.
//!
//! [`GrpcTransport`] keeps one queue and one sending task per peer, so that
//! messages to a peer leave in order and a slow or dead peer never holds up
//! the node or the others. Delivery is best effort: a full queue or a failed
//! call drops messages, which Raft resends; the node is told a peer is
//! unreachable, or that a snapshot failed, so it can retry sooner.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuctl_auth::tls::Tls;
use gpuctl_auth::CertRole;
use gpuctl_proto::pb;
use gpuctl_proto::pb::raft_transport_client::RaftTransportClient;
use protobuf::Message as _;
use raft::eraftpb::{Message, MessageType};
use tokio::sync::mpsc;
use tonic::transport::Endpoint;

use super::node::Reporter;
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
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// Failures to reach a peer are logged at most this often.
const WARN_EVERY: Duration = Duration::from_secs(10);

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
}

impl GrpcTransport {
    pub fn new(
        id: u64,
        address: String,
        addresses: Addresses,
        tls: Option<Arc<Tls>>,
    ) -> GrpcTransport {
        GrpcTransport {
            id,
            address,
            addresses,
            peers: Mutex::new(HashMap::new()),
            tls,
        }
    }

    fn spawn_peer(&self, to: u64, addr: String, reporter: Reporter) -> Peer {
        let (tx, rx) = mpsc::channel(PEER_QUEUE);
        tokio::spawn(peer_loop(
            self.id,
            self.address.clone(),
            to,
            addr.clone(),
            rx,
            reporter,
            self.tls.clone(),
        ));
        Peer { addr, tx }
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

async fn peer_loop(
    from: u64,
    from_address: String,
    to: u64,
    addr: String,
    mut rx: mpsc::Receiver<Message>,
    reporter: Reporter,
    tls: Option<Arc<Tls>>,
) {
    let endpoint = match Endpoint::from_shared(format!("http://{addr}")) {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!(to, addr = %addr, error = %e, "bad raft peer address");
            return;
        }
    };
    let endpoint = endpoint
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(CALL_TIMEOUT)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(1))
        .keep_alive_timeout(Duration::from_secs(3));
    // The peer must hold a master certificate (checked by the connector).
    let connect = || {
        RaftTransportClient::new(gpuctl_auth::tls::channel(
            &endpoint,
            tls.as_ref(),
            CertRole::Master,
        ))
        .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES)
        .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
    };
    // A rotated certificate needs a new connection: peers refuse calls on
    // one whose certificate expired.
    let cert_of = || {
        tls.as_ref()
            .and_then(|t| t.identity())
            .map_or(0, |i| i.not_after_ms)
    };
    let mut client = connect();
    let mut cert = cert_of();
    let mut last_warn: Option<Instant> = None;
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match rx.try_recv() {
                Ok(m) => batch.push(m),
                Err(_) => break,
            }
        }
        let snapshots = batch
            .iter()
            .filter(|m| m.get_msg_type() == MessageType::MsgSnapshot)
            .count();
        let mut messages = Vec::with_capacity(batch.len());
        for m in &batch {
            match m.write_to_bytes() {
                Ok(b) => messages.push(b),
                Err(e) => tracing::error!(to, error = %e, "cannot encode raft message"),
            }
        }
        if cert_of() != cert {
            client = connect();
            cert = cert_of();
        }
        let req = pb::StepRequest {
            from,
            from_address: from_address.clone(),
            messages,
        };
        match client.step(req).await {
            Ok(_) => {
                for _ in 0..snapshots {
                    reporter.snapshot(to, true);
                }
                if last_warn.take().is_some() {
                    tracing::info!(to, addr = %addr, "raft peer reachable again");
                }
            }
            Err(status) => {
                reporter.unreachable(to, snapshots > 0);
                if last_warn.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
                    tracing::warn!(to, addr = %addr, error = %status.message(), "cannot reach raft peer");
                    last_warn = Some(Instant::now());
                }
            }
        }
    }
}
