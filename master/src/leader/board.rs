//! Why each queued job waits, as the leader's last queue pass found it.
//!
//! The pass runs in the built-in scheduler's loop after state changes
//! (paced: at most every 250 ms, and less often when it is slow), and
//! publishes its reasons here; `GetJob`, `ListJobs` and `WatchJob` only
//! read them. A read never runs the pass, so clients polling or watching
//! jobs cost the leader next to nothing and never hold the state's lock
//! for long. A job submitted since the last pass has no reason yet.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use gpuctl_core::types::JobId;
use gpuctl_core::wait::Waiting;

pub type Reasons = BTreeMap<JobId, Waiting>;

#[derive(Debug)]
pub struct WaitBoard {
    reasons: RwLock<Arc<Reasons>>,
    /// Bumped on every publish, for watchers (`WatchJob`).
    published: tokio::sync::watch::Sender<u64>,
}

impl Default for WaitBoard {
    fn default() -> Self {
        WaitBoard {
            reasons: RwLock::default(),
            published: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl WaitBoard {
    /// The reasons of the latest pass (shared, never copied).
    pub fn reasons(&self) -> Arc<Reasons> {
        self.reasons
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn publish(&self, reasons: Reasons) {
        *self.reasons.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(reasons);
        self.published.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Changes each time new reasons are published.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.published.subscribe()
    }

    /// On losing leadership: what a next leader says may differ.
    pub fn clear(&self) {
        self.publish(Reasons::new());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuctl_core::wait::WaitReason;

    #[test]
    fn readers_keep_the_reasons_they_read_while_new_ones_are_published() {
        let board = WaitBoard::default();
        assert!(board.reasons().is_empty());
        let waiting = Waiting {
            reason: WaitReason::Starting,
            requeued: None,
        };
        board.publish([("job-1".to_string(), waiting.clone())].into());
        let read = board.reasons();
        board.clear();
        assert_eq!(read.get("job-1"), Some(&waiting));
        assert!(board.reasons().is_empty());
    }
}
