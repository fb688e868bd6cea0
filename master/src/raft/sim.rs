//! An in-process network for raft tests: nodes exchange messages directly,
//! and links can be cut (one way or both) to make partitions.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use raft::eraftpb::{Message, MessageType};

use super::transport::Transport;
use super::types::Reporter;
use super::RaftHandle;

#[derive(Default)]
struct Inner {
    nodes: HashMap<u64, RaftHandle>,
    /// Links that drop everything: (from, to).
    cut: HashSet<(u64, u64)>,
}

#[derive(Default)]
pub struct SimNet {
    inner: Mutex<Inner>,
}

impl SimNet {
    pub fn new() -> Arc<SimNet> {
        Arc::new(SimNet::default())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn transport(self: &Arc<Self>, from: u64) -> Arc<dyn Transport> {
        Arc::new(SimTransport {
            net: self.clone(),
            from,
        })
    }

    pub fn attach(&self, id: u64, handle: RaftHandle) {
        self.lock().nodes.insert(id, handle);
    }

    pub fn detach(&self, id: u64) {
        self.lock().nodes.remove(&id);
    }

    /// Cuts `id` off from every node in `others`, both ways.
    pub fn isolate(&self, id: u64, others: &[u64]) {
        let mut g = self.lock();
        for o in others {
            g.cut.insert((id, *o));
            g.cut.insert((*o, id));
        }
    }

    pub fn cut_one_way(&self, from: u64, to: u64) {
        self.lock().cut.insert((from, to));
    }

    pub fn heal(&self) {
        self.lock().cut.clear();
    }
}

struct SimTransport {
    net: Arc<SimNet>,
    from: u64,
}

impl Transport for SimTransport {
    fn send(&self, msgs: Vec<Message>, reporter: &Reporter) {
        let g = self.net.lock();
        for m in msgs {
            let to = m.to;
            let is_snapshot = m.get_msg_type() == MessageType::MsgSnapshot;
            let delivered = !g.cut.contains(&(self.from, to))
                && g.nodes.get(&to).is_some_and(|h| h.step(m).is_ok());
            if !delivered {
                reporter.unreachable(to, is_snapshot);
            } else if is_snapshot {
                reporter.snapshot(to, true);
            }
        }
    }
}
