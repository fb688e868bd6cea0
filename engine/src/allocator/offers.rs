//! Outstanding offers. Leader-only and ephemeral: never replicated. A new
//! leader starts an empty book; what frameworks still hold from the old one
//! is unknown to it and refused.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use gpuctl_core::types::Resources;

use super::OfferPlan;

/// An offer made to a framework and not yet accepted, declined or rescinded.
#[derive(Debug, Clone, PartialEq)]
pub struct Offer {
    /// `offer-<n>`, from the book's counter.
    pub id: String,
    pub framework_id: String,
    pub agent_id: String,
    pub resources: Resources,
    pub gpu_uuids: Vec<String>,
    /// Shared GPUs whose free fractions it holds (never in `gpu_uuids`).
    pub shares: Vec<OfferedShare>,
    pub created_ms: u64,
}

/// A shared GPU in an offer, with what its fractions left when offered:
/// a launch's fractions on it must fit in that.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OfferedShare {
    pub gpu_uuid: String,
    pub mem_mib: u64,
    pub compute_pct: u32,
}

impl Offer {
    /// The GPUs it holds: whole GPUs and MIG devices, and shared GPUs.
    pub fn held_gpus(&self) -> impl Iterator<Item = &String> {
        self.gpu_uuids
            .iter()
            .chain(self.shares.iter().map(|s| &s.gpu_uuid))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OfferError {
    #[error("offer {offer_id} is unknown")]
    Unknown { offer_id: String },
    #[error(
        "offer {offer_id} is no longer outstanding (already accepted or declined, rescinded or expired)"
    )]
    NotOutstanding { offer_id: String },
    #[error("offer {offer_id} was not made to framework {framework_id}")]
    OtherFramework {
        offer_id: String,
        framework_id: String,
    },
    #[error("offer {offer_id} is named twice")]
    Duplicate { offer_id: String },
}

/// The outstanding offers, by number (the `<n>` of `offer-<n>`), so that
/// iteration goes oldest first.
#[derive(Debug, Clone)]
pub struct OfferBook {
    first: u64,
    next: u64,
    offers: BTreeMap<u64, Offer>,
    /// The offers of each agent, and the offer naming each GPU: what an
    /// allocation cycle asks of every agent it views, without building
    /// sets of the whole book (80,000 UUIDs at 10,000 agents) each cycle.
    by_agent: HashMap<String, BTreeSet<u64>>,
    by_gpu: HashMap<String, u64>,
}

impl Default for OfferBook {
    fn default() -> Self {
        OfferBook::new()
    }
}

impl OfferBook {
    /// A book whose first offer is `offer-1`.
    pub fn new() -> Self {
        OfferBook::starting_at(1)
    }

    /// A book whose first offer is `offer-<first>`. A new leader can start
    /// past every number an earlier leader used (e.g. `term << 32`), so that
    /// a framework's stale offer id is refused as unknown rather than taken
    /// for a new offer.
    pub fn starting_at(first: u64) -> Self {
        OfferBook {
            first,
            next: first,
            offers: BTreeMap::new(),
            by_agent: HashMap::new(),
            by_gpu: HashMap::new(),
        }
    }

    fn insert(&mut self, n: u64, offer: Offer) {
        self.by_agent
            .entry(offer.agent_id.clone())
            .or_default()
            .insert(n);
        for g in offer.held_gpus() {
            self.by_gpu.insert(g.clone(), n);
        }
        self.offers.insert(n, offer);
    }

    fn remove(&mut self, n: u64) -> Option<Offer> {
        let offer = self.offers.remove(&n)?;
        if let Some(ns) = self.by_agent.get_mut(&offer.agent_id) {
            ns.remove(&n);
            if ns.is_empty() {
                self.by_agent.remove(&offer.agent_id);
            }
        }
        for g in offer.held_gpus() {
            // Only this offer's own entry (a caller could list one UUID in
            // two offers; the allocator never does).
            if self.by_gpu.get(g) == Some(&n) {
                self.by_gpu.remove(g);
            }
        }
        Some(offer)
    }

    /// Turns plans into offers, numbered in plan order.
    pub fn record(&mut self, plans: Vec<OfferPlan>, now_ms: u64) -> Vec<Offer> {
        let mut made = Vec::with_capacity(plans.len());
        for plan in plans {
            let n = self.next;
            self.next = self.next.saturating_add(1);
            let offer = Offer {
                id: format!("offer-{n}"),
                framework_id: plan.framework_id,
                agent_id: plan.agent_id,
                resources: plan.resources,
                gpu_uuids: plan.gpu_uuids,
                shares: plan.shares,
                created_ms: now_ms,
            };
            made.push(offer.clone());
            self.insert(n, offer);
        }
        made
    }

    /// Removes and returns the offers `offer_ids` of `framework_id` (Accept,
    /// Decline). All or nothing: on error the book is unchanged, and the
    /// error names the first offer id at fault.
    pub fn take<S: AsRef<str>>(
        &mut self,
        offer_ids: &[S],
        framework_id: &str,
    ) -> Result<Vec<Offer>, OfferError> {
        let numbers = self.check(offer_ids, framework_id)?;
        Ok(numbers.into_iter().filter_map(|n| self.remove(n)).collect())
    }

    /// What [`take`](Self::take) would take, leaving the book unchanged:
    /// a caller checks what it will do with the offers first, so that a
    /// refusal leaves them outstanding.
    pub fn peek<S: AsRef<str>>(
        &self,
        offer_ids: &[S],
        framework_id: &str,
    ) -> Result<Vec<Offer>, OfferError> {
        let numbers = self.check(offer_ids, framework_id)?;
        Ok(numbers
            .into_iter()
            .filter_map(|n| self.offers.get(&n).cloned())
            .collect())
    }

    /// The numbers of `offer_ids`, all outstanding offers of `framework_id`
    /// named once, or the error naming the first at fault.
    fn check<S: AsRef<str>>(
        &self,
        offer_ids: &[S],
        framework_id: &str,
    ) -> Result<Vec<u64>, OfferError> {
        let mut numbers = Vec::with_capacity(offer_ids.len());
        let mut seen = BTreeSet::new();
        for id in offer_ids {
            let id = id.as_ref();
            let n = self.number(id).ok_or_else(|| OfferError::Unknown {
                offer_id: id.to_string(),
            })?;
            if !seen.insert(n) {
                return Err(OfferError::Duplicate {
                    offer_id: id.to_string(),
                });
            }
            let offer = self
                .offers
                .get(&n)
                .ok_or_else(|| OfferError::NotOutstanding {
                    offer_id: id.to_string(),
                })?;
            if offer.framework_id != framework_id {
                return Err(OfferError::OtherFramework {
                    offer_id: id.to_string(),
                    framework_id: framework_id.to_string(),
                });
            }
            numbers.push(n);
        }
        Ok(numbers)
    }

    /// Removes and returns those of `offer_ids` that are still outstanding
    /// offers of `framework_id`, ignoring the rest (unknown, rescinded,
    /// taken, another framework's). What a failed [`take`](Self::take)
    /// releases, and what a scheduler that may race with rescinds uses:
    /// no offer it was sent is ever left outstanding by a bad neighbour.
    pub fn take_outstanding<S: AsRef<str>>(
        &mut self,
        offer_ids: &[S],
        framework_id: &str,
    ) -> Vec<Offer> {
        let mut taken = Vec::new();
        for id in offer_ids {
            let Some(n) = self.number(id.as_ref()) else {
                continue;
            };
            if self
                .offers
                .get(&n)
                .is_some_and(|o| o.framework_id == framework_id)
            {
                taken.extend(self.remove(n));
            }
        }
        taken
    }

    /// The number of an id this book issued, if it did.
    fn number(&self, id: &str) -> Option<u64> {
        let digits = id.strip_prefix("offer-")?;
        let n: u64 = digits.parse().ok()?;
        // "offer-01" or "offer-+1" parse, but were never issued.
        let canonical = n.to_string() == digits;
        (canonical && n >= self.first && n < self.next).then_some(n)
    }

    pub fn get(&self, offer_id: &str) -> Option<&Offer> {
        self.number(offer_id).and_then(|n| self.offers.get(&n))
    }

    /// Removes and returns the offers made at least `timeout_ms` ago, to
    /// rescind: an offer made at t lives until t + timeout.
    pub fn expired(&mut self, now_ms: u64, timeout_ms: u64) -> Vec<Offer> {
        self.remove_where(|o| now_ms.saturating_sub(o.created_ms) >= timeout_ms)
    }

    /// Removes and returns the offers of an agent (lost, removed, or its
    /// resources changed), to rescind.
    pub fn rescind_agent(&mut self, agent_id: &str) -> Vec<Offer> {
        let numbers: Vec<u64> = self
            .by_agent
            .get(agent_id)
            .map(|ns| ns.iter().copied().collect())
            .unwrap_or_default();
        numbers.into_iter().filter_map(|n| self.remove(n)).collect()
    }

    /// Removes and returns the offers of a framework (gone, or suppressed).
    pub fn rescind_framework(&mut self, framework_id: &str) -> Vec<Offer> {
        self.remove_where(|o| o.framework_id == framework_id)
    }

    fn remove_where(&mut self, f: impl Fn(&Offer) -> bool) -> Vec<Offer> {
        let numbers: Vec<u64> = self
            .offers
            .iter()
            .filter(|(_, o)| f(o))
            .map(|(n, _)| *n)
            .collect();
        numbers.into_iter().filter_map(|n| self.remove(n)).collect()
    }

    /// Offered resources by framework: add them to `FrameworkView::allocated`.
    pub fn offered_by_framework(&self) -> BTreeMap<String, Resources> {
        sum_by(
            self.offers
                .values()
                .map(|o| (&o.framework_id, &o.resources)),
        )
    }

    /// Every GPU named by an outstanding offer (shared GPUs included):
    /// leave them out of `free_gpus`.
    pub fn offered_gpus(&self) -> BTreeSet<String> {
        self.offers
            .values()
            .flat_map(|o| o.held_gpus().cloned())
            .collect()
    }

    /// Offered resources of one agent: subtract them from `AgentView::free`.
    pub fn offered_on_agent(&self, agent_id: &str) -> Resources {
        self.by_agent
            .get(agent_id)
            .into_iter()
            .flatten()
            .filter_map(|n| self.offers.get(n))
            .fold(Resources::default(), |acc, o| acc.add(&o.resources))
    }

    /// Whether an outstanding offer names the GPU (whole, a MIG device, or
    /// shared).
    pub fn is_gpu_offered(&self, uuid: &str) -> bool {
        self.by_gpu.contains_key(uuid)
    }

    /// Whether the indexes say what the offers say (for tests).
    #[cfg(test)]
    pub fn index_agrees(&self) -> bool {
        let mut by_agent: HashMap<String, BTreeSet<u64>> = HashMap::new();
        let mut by_gpu: HashMap<String, u64> = HashMap::new();
        for (n, o) in &self.offers {
            by_agent.entry(o.agent_id.clone()).or_default().insert(*n);
            for g in o.held_gpus() {
                by_gpu.insert(g.clone(), *n);
            }
        }
        by_agent == self.by_agent && by_gpu == self.by_gpu
    }

    /// Offered resources by agent, in one pass.
    pub fn offered_by_agent(&self) -> BTreeMap<String, Resources> {
        sum_by(self.offers.values().map(|o| (&o.agent_id, &o.resources)))
    }

    /// Outstanding offers, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &Offer> {
        self.offers.values()
    }

    pub fn len(&self) -> usize {
        self.offers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.offers.is_empty()
    }
}

fn sum_by<'a>(
    items: impl Iterator<Item = (&'a String, &'a Resources)>,
) -> BTreeMap<String, Resources> {
    let mut by = BTreeMap::<String, Resources>::new();
    for (key, r) in items {
        match by.get_mut(key) {
            Some(sum) => *sum = sum.add(r),
            None => {
                by.insert(key.clone(), *r);
            }
        }
    }
    by
}
