//! Offer filters: "do not offer this agent to this framework until T, unless
//! it has more than what was declined", set by Decline and by Accept's
//! `filters.refuse_seconds` (as in Mesos, where an accepted offer's unused
//! resources are declined with the same filter).

use std::collections::BTreeMap;

use gpuctl_core::types::Resources;

/// Mesos' default `Filters.refuse_seconds`.
pub const DEFAULT_REFUSE_SECONDS: f64 = 5.0;

/// The longest filter: a year. Longer asks are capped, so that no entry
/// outlives every `expire`.
pub const MAX_REFUSE_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

/// One (framework, agent) filter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Filter {
    pub until_ms: u64,
    /// What was declined: offers no larger than it are refused, larger ones
    /// (resources freed since) go through, as with Mesos' filters. None:
    /// the agent is refused whatever it has.
    pub refused: Option<Resources>,
}

impl Filter {
    /// Whether an offer of `offered` is refused at `now_ms`.
    pub fn refuses(&self, offered: &Resources, now_ms: u64) -> bool {
        self.until_ms > now_ms
            && self.refused.is_none_or(|r| {
                offered.cpus <= r.cpus + 1e-9
                    && offered.mem_mib <= r.mem_mib
                    && offered.gpus <= r.gpus
            })
    }
}

/// Per (framework, agent) filters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Filters {
    by_framework: BTreeMap<String, BTreeMap<String, Filter>>,
}

impl Filters {
    pub fn new() -> Self {
        Filters::default()
    }

    /// Refuses `agent_id` to `framework_id` until `until_ms`, whatever it
    /// has. An existing later time stays: filters coexist in Mesos, so the
    /// longest one rules.
    pub fn add(&mut self, framework_id: &str, agent_id: &str, until_ms: u64) {
        self.add_refusing(framework_id, agent_id, until_ms, None);
    }

    /// Refuses offers of `agent_id` no larger than `refused` to
    /// `framework_id` until `until_ms`. Two filters of one agent merge into
    /// one that refuses what either declined (the larger of each resource)
    /// until the later time: it may refuse a little more than Mesos' pair
    /// would, never less.
    pub fn add_refusing(
        &mut self,
        framework_id: &str,
        agent_id: &str,
        until_ms: u64,
        refused: Option<Resources>,
    ) {
        let agents = self
            .by_framework
            .entry(framework_id.to_string())
            .or_default();
        match agents.get_mut(agent_id) {
            Some(f) => {
                f.until_ms = f.until_ms.max(until_ms);
                f.refused = match (f.refused, refused) {
                    (Some(a), Some(b)) => Some(Resources {
                        cpus: a.cpus.max(b.cpus),
                        mem_mib: a.mem_mib.max(b.mem_mib),
                        gpus: a.gpus.max(b.gpus),
                        ports: a.ports.max(b.ports),
                    }),
                    _ => None,
                };
            }
            None => {
                agents.insert(agent_id.to_string(), Filter { until_ms, refused });
            }
        }
    }

    /// True while a filter of `agent_id` for `framework_id` lasts (`now_ms <
    /// until`), whatever it refuses.
    pub fn is_filtered(&self, framework_id: &str, agent_id: &str, now_ms: u64) -> bool {
        self.by_framework
            .get(framework_id)
            .and_then(|a| a.get(agent_id))
            .is_some_and(|f| f.until_ms > now_ms)
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
            agents.retain(|_, f| f.until_ms > now_ms);
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
    pub(crate) fn for_framework(&self, framework_id: &str) -> Option<&BTreeMap<String, Filter>> {
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
