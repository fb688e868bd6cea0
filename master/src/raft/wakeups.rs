//! Per-agent wake-ups for the leader's task streams (WatchTasks): after a
//! batch of entries is applied, only the agents whose desired task set may
//! have changed ([`State::take_touched`](crate::state::State::take_touched))
//! are woken, instead of every stream looking at every change.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use crate::state::Touched;

/// Cheap to clone. A stream subscribes for its agent; the node notifies.
#[derive(Clone, Default)]
pub struct AgentWakeups {
    inner: Arc<Mutex<HashMap<Arc<str>, Arc<Wake>>>>,
}

/// One agent's wake-up: the index of its last notify and the streams
/// waiting. About 60 bytes (a `watch` channel was 350 per agent, and the
/// leader holds one for every connected agent, idle or not).
#[derive(Default)]
struct Wake {
    index: AtomicU64,
    notify: Notify,
}

/// A stream's end: changes whenever its agent may have something new.
/// Dropping it forgets the agent once nobody else listens.
pub struct AgentWakeup {
    agent: Arc<str>,
    wake: Arc<Wake>,
    seen: u64,
    owner: AgentWakeups,
}

impl AgentWakeups {
    fn lock(&self) -> MutexGuard<'_, HashMap<Arc<str>, Arc<Wake>>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn subscribe(&self, agent: &str) -> AgentWakeup {
        let mut g = self.lock();
        let (agent, wake) = match g.get_key_value(agent) {
            Some((k, w)) => (k.clone(), w.clone()),
            None => {
                let (k, w): (Arc<str>, Arc<Wake>) = (agent.into(), Arc::default());
                g.insert(k.clone(), w.clone());
                (k, w)
            }
        };
        // Only notifies after this one wake the new stream, as with a
        // fresh `watch` receiver: the caller looks at the state next.
        let seen = wake.index.load(Ordering::Acquire);
        AgentWakeup {
            agent,
            wake,
            seen,
            owner: self.clone(),
        }
    }

    /// Wakes the streams of the touched agents (all of them when
    /// `touched.all`), with the index applied.
    pub fn notify(&self, touched: &Touched, index: u64) {
        if touched.is_empty() {
            return;
        }
        let wake = |w: &Wake| {
            // Distinct from every earlier value even if indexes repeat
            // (tests notify with any index): the stream compares for change.
            let before = w.index.load(Ordering::Acquire);
            w.index.store(index.max(before + 1), Ordering::Release);
            w.notify.notify_waiters();
        };
        let g = self.lock();
        if touched.all {
            g.values().for_each(|w| wake(w));
        } else {
            for agent in &touched.agents {
                if let Some(w) = g.get(agent.as_str()) {
                    wake(w);
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
        loop {
            let notified = self.wake.notify.notified();
            tokio::pin!(notified);
            // Registered before the check: a notify between the check and
            // the wait is not lost.
            notified.as_mut().enable();
            let now = self.wake.index.load(Ordering::Acquire);
            if now != self.seen {
                self.seen = now;
                return;
            }
            notified.await;
        }
    }
}

impl Drop for AgentWakeup {
    fn drop(&mut self) {
        let mut g = self.owner.lock();
        // The map's reference and ours: nobody else listens.
        if g.get(&self.agent)
            .is_some_and(|w| Arc::ptr_eq(w, &self.wake) && Arc::strong_count(w) <= 2)
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
