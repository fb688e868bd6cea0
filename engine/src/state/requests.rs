//! Request ids: what the state remembers of creates that carried one, so
//! that a create sent again after an unknown outcome (a connection lost
//! mid-call, a leader deposed while committing) makes nothing twice.
//!
//! Each kind of create has its own table (submits, tokens), keyed by
//! [`request_key`]: the caller's scope and its id, so that two callers who
//! choose the same id never meet. An id is remembered for
//! [`REQUEST_TTL_MS`] by the proposer's clock carried in the commands, and
//! at most [`MAX_REMEMBERED`] per kind (the oldest go first), so that the
//! tables stay bounded.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// How long a request id is remembered: at least a day, so that a person
/// can look a request up or resend it the next morning.
pub const REQUEST_TTL_MS: u64 = 24 * 60 * 60 * 1000;

/// Most request ids remembered per kind. Past it the oldest are forgotten
/// before their TTL: only a cluster taking more than a million submits a
/// day gets there, and its state and snapshots stay bounded.
pub const MAX_REMEMBERED: usize = 1_000_000;

/// The key a request id is remembered under. The scope names the caller
/// (its token id); the empty scope (a cluster without tokens) keeps the
/// bare id, as keys were written before scopes existed.
pub fn request_key(scope: &str, request_id: &str) -> String {
    if scope.is_empty() {
        request_id.to_string()
    } else {
        format!("{scope}/{request_id}")
    }
}

/// Forgets the entries of `by_key`/`by_time` remembered longer than the
/// TTL before `now_ms`, and the oldest past `cap` once one more is added.
pub(super) fn forget_expired<T>(
    by_key: &mut BTreeMap<String, (T, u64)>,
    by_time: &mut BTreeSet<(u64, String)>,
    now_ms: u64,
    cap: usize,
) {
    while let Some((t, _)) = by_time.first() {
        if live(*t, now_ms) && by_time.len() < cap {
            break;
        }
        if let Some((_, key)) = by_time.pop_first() {
            by_key.remove(&key);
        }
    }
}

/// Whether an entry remembered at `t` still counts at `now_ms`.
pub(super) fn live(t: u64, now_ms: u64) -> bool {
    t.saturating_add(REQUEST_TTL_MS) >= now_ms
}

/// Remembers `value` under `key` at `at_ms` (replacing an older entry).
pub(super) fn remember<T>(
    by_key: &mut BTreeMap<String, (T, u64)>,
    by_time: &mut BTreeSet<(u64, String)>,
    key: &str,
    value: T,
    at_ms: u64,
) {
    if let Some((_, old)) = by_key.insert(key.to_string(), (value, at_ms)) {
        by_time.remove(&(old, key.to_string()));
    }
    by_time.insert((at_ms, key.to_string()));
}

/// The remembered request ids of one kind of create: key to (what it made,
/// when), and the same keys by time, to forget them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Remembered<T> {
    by_key: BTreeMap<String, (T, u64)>,
    by_time: BTreeSet<(u64, String)>,
}

impl<T> Default for Remembered<T> {
    fn default() -> Self {
        Remembered {
            by_key: BTreeMap::new(),
            by_time: BTreeSet::new(),
        }
    }
}

impl<T> Remembered<T> {
    /// What the request with this key made, while it is remembered.
    pub fn get(&self, key: &str) -> Option<&T> {
        self.by_key.get(key).map(|(v, _)| v)
    }

    /// [`Remembered::get`] as of `now_ms`: nothing once the TTL passed,
    /// even before the entry is forgotten.
    pub fn get_at(&self, key: &str, now_ms: u64) -> Option<&T> {
        self.by_key
            .get(key)
            .filter(|(_, t)| live(*t, now_ms))
            .map(|(v, _)| v)
    }

    /// Forgets what is past the TTL at `now_ms` (and the oldest past the
    /// cap), then remembers `value` under `key`.
    pub fn insert(&mut self, key: &str, value: T, at_ms: u64) {
        self.insert_capped(key, value, at_ms, MAX_REMEMBERED);
    }

    fn insert_capped(&mut self, key: &str, value: T, at_ms: u64, cap: usize) {
        forget_expired(&mut self.by_key, &mut self.by_time, at_ms, cap);
        remember(&mut self.by_key, &mut self.by_time, key, value, at_ms);
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
}

/// A token made by a create that carried a request id: enough to answer a
/// resend with the same token, secret included, without the state holding
/// the secret or the id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRequest {
    /// [`request_key`] of the creator's token id and the hash of the
    /// request id (`gpuctl_auth::token::request_id_hash`).
    pub key: String,
    /// The new token's secret sealed with the request id
    /// (`gpuctl_auth::token::Token::seal`).
    pub sealed: String,
}

/// What a remembered token create made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatedToken {
    pub token_id: String,
    pub sealed: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_scoped_by_caller_and_bare_without_one() {
        assert_eq!(request_key("", "abc"), "abc");
        assert_eq!(
            request_key("0123456789abcdef", "abc"),
            "0123456789abcdef/abc"
        );
        assert_ne!(request_key("a", "x"), request_key("b", "x"));
    }

    #[test]
    fn entries_live_for_the_ttl_then_go() {
        let mut r: Remembered<u32> = Remembered::default();
        r.insert("k1", 1, 1_000);
        r.insert("k2", 2, 2_000);
        assert_eq!(r.get("k1"), Some(&1));
        assert_eq!(r.get_at("k1", 1_000 + REQUEST_TTL_MS), Some(&1));
        assert_eq!(r.get_at("k1", 1_001 + REQUEST_TTL_MS), None, "past its TTL");
        // Forgotten by the next insert past its TTL, and only it.
        r.insert("k3", 3, 1_001 + REQUEST_TTL_MS);
        assert_eq!(r.get("k1"), None);
        assert_eq!(r.get("k2"), Some(&2));
        assert_eq!(r.len(), 2);
        assert_eq!(r.by_time.len(), 2);
        // Remembered again: one entry, at its new time.
        r.insert("k2", 22, 5_000);
        assert_eq!(r.get("k2"), Some(&22));
        assert_eq!(r.by_time.len(), 2);
    }

    #[test]
    fn the_table_is_bounded_oldest_first() {
        let mut r: Remembered<u32> = Remembered::default();
        for (i, k) in ["k0", "k1", "k2"].into_iter().enumerate() {
            r.insert_capped(k, 0, i as u64, 3);
        }
        r.insert_capped("new", 1, 3, 3);
        assert_eq!(r.len(), 3);
        assert_eq!(r.get("k0"), None, "the oldest went first");
        assert_eq!(r.get("k1"), Some(&0));
        assert_eq!(r.get("new"), Some(&1));
    }
}
