//! Per-agent wake-ups for the leader's task streams (WatchTasks): after a
//! batch of entries is applied, only the agents whose desired task set may
//! have changed ([`State::take_touched`](crate::state::State::take_touched))
//! are woken, instead of every stream looking at every change.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

use crate::state::Touched;

/// Cheap to clone. A stream subscribes for its agent; the node notifies.
#[derive(Clone, Default)]
pub struct AgentWakeups {
    inner: Arc<Mutex<HashMap<String, watch::Sender<u64>>>>,
}

/// A stream's end: changes whenever its agent may have something new.
/// Dropping it forgets the agent once nobody else listens.
pub struct AgentWakeup {
    rx: watch::Receiver<u64>,
    agent: String,
    owner: AgentWakeups,
}

impl AgentWakeups {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, watch::Sender<u64>>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn subscribe(&self, agent: &str) -> AgentWakeup {
        let rx = self
            .lock()
            .entry(agent.to_string())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe();
        AgentWakeup {
            rx,
            agent: agent.to_string(),
            owner: self.clone(),
        }
    }

    /// Wakes the streams of the touched agents (all of them when
    /// `touched.all`), with the index applied.
    pub fn notify(&self, touched: &Touched, index: u64) {
        if touched.is_empty() {
            return;
        }
        let g = self.lock();
        if touched.all {
            for tx in g.values() {
                tx.send_replace(index);
            }
        } else {
            for agent in &touched.agents {
                if let Some(tx) = g.get(agent) {
                    tx.send_replace(index);
                }
            }
        }
    }

    /// Agents with a stream listening.
    pub fn listening(&self) -> usize {
        self.lock().len()
    }
}

impl AgentWakeup {
    /// Waits for the next wake-up (at once if one came since the last).
    pub async fn changed(&mut self) {
        // The sender stays in the map for as long as this receiver lives,
        // so this never fails; if it did, wait rather than spin.
        if self.rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for AgentWakeup {
    fn drop(&mut self) {
        let mut g = self.owner.lock();
        // Our receiver is still counted until this returns.
        if g.get(&self.agent)
            .is_some_and(|tx| tx.receiver_count() <= 1)
        {
            g.remove(&self.agent);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn touched(agents: &[&str]) -> Touched {
        Touched {
            all: false,
            agents: agents.iter().map(|s| s.to_string()).collect(),
        }
    }

    async fn woken(w: &mut AgentWakeup) -> bool {
        tokio::time::timeout(Duration::from_millis(50), w.changed())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn only_touched_agents_wake_and_the_last_listener_cleans_up() {
        let wakeups = AgentWakeups::default();
        let mut a = wakeups.subscribe("a");
        let mut b = wakeups.subscribe("b");
        let mut a2 = wakeups.subscribe("a");
        wakeups.notify(&touched(&["a", "nobody"]), 5);
        assert!(woken(&mut a).await && woken(&mut a2).await);
        assert!(!woken(&mut b).await, "b was not touched");
        assert!(!woken(&mut a).await, "one wake-up per notify");
        // A notify before the stream waits is not lost.
        wakeups.notify(&touched(&["b"]), 6);
        assert!(woken(&mut b).await);
        wakeups.notify(
            &Touched {
                all: true,
                agents: Default::default(),
            },
            7,
        );
        assert!(woken(&mut a).await && woken(&mut b).await);
        assert_eq!(wakeups.listening(), 2);
        drop(a);
        assert_eq!(wakeups.listening(), 2, "a2 still listens for a");
        drop(a2);
        drop(b);
        assert_eq!(wakeups.listening(), 0);
    }
}
