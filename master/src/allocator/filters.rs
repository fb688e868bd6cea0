//! Offer filters: "do not offer this agent to this framework until T", set by
//! Decline and by Accept's `filters.refuse_seconds` (as in Mesos, where an
//! accepted offer's unused resources are declined with the same filter).

use std::collections::BTreeMap;

/// Mesos' default `Filters.refuse_seconds`.
pub const DEFAULT_REFUSE_SECONDS: f64 = 5.0;

/// The longest filter: a year. Longer asks are capped, so that no entry
/// outlives every `expire`.
pub const MAX_REFUSE_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

/// Per (framework, agent) "refuse until" times, in ms.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filters {
    by_framework: BTreeMap<String, BTreeMap<String, u64>>,
}

impl Filters {
    pub fn new() -> Self {
        Filters::default()
    }

    /// Refuses `agent_id` to `framework_id` until `until_ms`. An existing
    /// later time stays: filters coexist in Mesos, so the longest one rules.
    pub fn add(&mut self, framework_id: &str, agent_id: &str, until_ms: u64) {
        let agents = self
            .by_framework
            .entry(framework_id.to_string())
            .or_default();
        match agents.get_mut(agent_id) {
            Some(t) => *t = (*t).max(until_ms),
            None => {
                agents.insert(agent_id.to_string(), until_ms);
            }
        }
    }

    /// True while a filter refuses `agent_id` to `framework_id` (`now_ms < until`).
    pub fn is_filtered(&self, framework_id: &str, agent_id: &str, now_ms: u64) -> bool {
        self.by_framework
            .get(framework_id)
            .and_then(|a| a.get(agent_id))
            .is_some_and(|&until| until > now_ms)
    }

    /// Revive: the framework wants offers again, from every agent.
    pub fn revive(&mut self, framework_id: &str) {
        self.by_framework.remove(framework_id);
    }

    /// The framework is gone (removed or torn down).
    pub fn remove_framework(&mut self, framework_id: &str) {
        self.by_framework.remove(framework_id);
    }

    /// The agent is gone; its filters can never match again.
    pub fn remove_agent(&mut self, agent_id: &str) {
        self.by_framework.retain(|_, agents| {
            agents.remove(agent_id);
            !agents.is_empty()
        });
    }

    /// Drops the filters that no longer refuse anything at `now_ms`; call it
    /// once per cycle to keep memory bounded by the live filters.
    pub fn expire(&mut self, now_ms: u64) {
        self.by_framework.retain(|_, agents| {
            agents.retain(|_, until| *until > now_ms);
            !agents.is_empty()
        });
    }

    /// Number of (framework, agent) entries.
    pub fn len(&self) -> usize {
        self.by_framework.values().map(BTreeMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.by_framework.is_empty()
    }

    /// The framework's filters by agent id, for the allocator's inner loop.
    pub(crate) fn for_framework(&self, framework_id: &str) -> Option<&BTreeMap<String, u64>> {
        self.by_framework.get(framework_id)
    }
}

/// When a filter of `refuse_seconds` set at `now_ms` ends; None when no
/// filter is to be set. As Mesos: absent, negative or not a number means the
/// default 5 s, and 0 means no filter. Capped at [`MAX_REFUSE_SECONDS`].
pub fn refuse_until(now_ms: u64, refuse_seconds: Option<f64>) -> Option<u64> {
    let secs = match refuse_seconds {
        Some(s) if s.is_nan() || s < 0.0 => DEFAULT_REFUSE_SECONDS,
        Some(s) => s.min(MAX_REFUSE_SECONDS),
        None => DEFAULT_REFUSE_SECONDS,
    };
    if secs == 0.0 {
        return None;
    }
    // Within the cap, secs * 1000 fits a u64 exactly enough.
    let ms = (secs * 1000.0).ceil() as u64;
    Some(now_ms.saturating_add(ms))
}
