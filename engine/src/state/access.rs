//! Access tokens and tenants' GPU quotas, replicated like everything else so
//! that a revocation holds on every master at once and survives failover.
//! Only the SHA-256 of each token's secret is kept (gpuctl-auth's `token`).

use gpuctl_core::types::IdRanges;
use serde::{Deserialize, Serialize};

use super::{ApplyError, Outcome, State};

/// What a token lets its holder do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TokenRole {
    /// Agents, masters, cordons, drains, tokens, quotas; every tenant.
    Admin,
    /// Its tenant's jobs: submit, see, follow, cancel, read logs.
    User,
    /// A framework of its tenant, with the allocator roles it allows.
    Framework,
    /// One agent joining, once.
    Join,
}

impl TokenRole {
    pub fn as_str(self) -> &'static str {
        match self {
            TokenRole::Admin => "admin",
            TokenRole::User => "user",
            TokenRole::Framework => "framework",
            TokenRole::Join => "join",
        }
    }
}

/// The largest weight a tenant may have.
pub const MAX_WEIGHT: u32 = 1000;

/// How a tenant shares beyond its quota.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantTerms {
    /// GPUs it may hold beyond its quota when others leave theirs idle
    /// (lent to it, reclaimed when their owners need them); `None`: no
    /// limit without a quota, none beyond a quota.
    #[serde(default)]
    pub borrow: Option<u32>,
    /// Its weight in the split of what quotas leave.
    #[serde(default = "one")]
    pub weight: u32,
    /// Its jobs flagged idle this long are stopped (`CANCELLED`, saying
    /// why); `None`: never (docs/usage.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_idle_after_ms: Option<u64>,
}

fn one() -> u32 {
    1
}

impl Default for TenantTerms {
    fn default() -> Self {
        TenantTerms {
            borrow: None,
            weight: 1,
            stop_idle_after_ms: None,
        }
    }
}

/// A token as the state keeps it: never its secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    pub id: String,
    /// Hex SHA-256 of the secret.
    pub hash: String,
    pub role: TokenRole,
    /// Empty only for admin tokens that name none.
    pub tenant: String,
    pub description: String,
    pub created_at_ms: u64,
    /// `None`: never expires.
    pub expires_at_ms: Option<u64>,
    pub revoked_at_ms: Option<u64>,
    /// Join tokens: the one agent id it may join as (`None`: any new id).
    #[serde(default)]
    pub agent_id: Option<String>,
    /// Join tokens: when and by which agent it was used.
    #[serde(default)]
    pub used: Option<(u64, String)>,
    /// Join tokens: the key of the request that used it (hex SHA-256 of
    /// its public key), which may send it again for a while.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_key: Option<String>,
    /// Framework tokens: the allocator roles it may subscribe with.
    #[serde(default)]
    pub framework_roles: Vec<String>,
    /// Whether its tenant's host-process jobs may run as root.
    #[serde(default)]
    pub allow_root: bool,
    /// The user ids its jobs may name (`security.user`); none for tokens
    /// made before the policy existed.
    #[serde(default)]
    pub allowed_uids: IdRanges,
    /// The group ids its jobs may name.
    #[serde(default)]
    pub allowed_gids: IdRanges,
    /// Token id of its creator; "bootstrap" for the first admin's.
    pub created_by: String,
}

impl TokenRecord {
    /// Whether it may be used at `now_ms`: not revoked, not expired, and
    /// (a join token) not used yet.
    pub fn usable_at(&self, now_ms: u64) -> Result<(), &'static str> {
        if self.revoked_at_ms.is_some() {
            return Err("the token was revoked");
        }
        if self.expires_at_ms.is_some_and(|t| now_ms >= t) {
            return Err("the token expired");
        }
        if self.used.is_some() {
            return Err("the join token was used already");
        }
        Ok(())
    }

    /// Whether an agent may join with it at `now_ms` as `agent_id` with a
    /// request for the key `key`: usable, or used by this same request no
    /// longer than [`JOIN_RETRY_MS`] ago (its answer was lost: an agent
    /// that never got its certificate asks again with the same key).
    pub fn joinable_at(&self, now_ms: u64, agent_id: &str, key: &str) -> Result<(), &'static str> {
        match (&self.used, &self.used_key) {
            (Some((at, by)), Some(k))
                if !key.is_empty()
                    && k == key
                    && by == agent_id
                    && now_ms <= at.saturating_add(JOIN_RETRY_MS) =>
            {
                let unused = TokenRecord {
                    used: None,
                    ..self.clone()
                };
                unused.usable_at(now_ms)
            }
            _ => self.usable_at(now_ms),
        }
    }
}

/// How long the request that used a join token may be sent again.
pub const JOIN_RETRY_MS: u64 = 10 * 60 * 1000;

pub use gpuctl_core::types::DEFAULT_TENANT;

/// Longest tenant name.
pub const MAX_TENANT_LEN: usize = 64;

/// Checks a tenant name: 1 to 64 of `[a-z0-9-]`, starting with a letter or
/// digit (it names an allocator role and appears in file and metric names).
pub fn check_tenant(tenant: &str) -> Result<(), String> {
    if tenant.is_empty() || tenant.len() > MAX_TENANT_LEN {
        return Err(format!(
            "must be 1 to {MAX_TENANT_LEN} characters, got {}",
            tenant.len()
        ));
    }
    if !tenant
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        || tenant.starts_with('-')
    {
        return Err(format!(
            "{tenant:?}: only a-z, 0-9 and '-' (not first) are allowed"
        ));
    }
    Ok(())
}

impl State {
    pub fn tokens(&self) -> &std::collections::BTreeMap<String, TokenRecord> {
        &self.tokens
    }

    pub fn token(&self, id: &str) -> Option<&TokenRecord> {
        self.tokens.get(id)
    }

    /// Tenants' GPU quotas (a tenant absent has none).
    pub fn quotas(&self) -> &std::collections::BTreeMap<String, u32> {
        &self.quotas
    }

    /// Each tenant's borrowing limit and weight, where set.
    pub fn tenant_terms(&self) -> &std::collections::BTreeMap<String, TenantTerms> {
        &self.tenant_terms
    }

    /// The most GPUs `tenant`'s work may hold: its quota plus what it may
    /// borrow; `None`: no limit (no quota and no borrowing limit).
    pub fn tenant_cap(&self, tenant: &str) -> Option<u32> {
        let quota = self.quotas.get(tenant).copied();
        match (quota, self.tenant_terms.get(tenant).and_then(|t| t.borrow)) {
            (q, Some(b)) => Some(q.unwrap_or(0).saturating_add(b)),
            (Some(q), None) => Some(q),
            (None, None) => None,
        }
    }

    /// Whether some tenant's GPUs are limited (a quota or a borrowing
    /// limit).
    pub fn has_tenant_limits(&self) -> bool {
        !self.quotas.is_empty() || self.tenant_terms.values().any(|t| t.borrow.is_some())
    }

    /// `tenant`'s weight in the fair split of GPUs (1 unless set).
    pub fn tenant_weight(&self, tenant: &str) -> u32 {
        self.tenant_terms.get(tenant).map_or(1, |t| t.weight.max(1))
    }

    pub(super) fn create_token(
        &mut self,
        record: &TokenRecord,
        request: Option<&super::requests::TokenRequest>,
    ) -> Result<Outcome, ApplyError> {
        // A resend of a create already applied: its token, not another.
        if let Some(r) = request {
            if let Some(c) = self.token_requests.get_at(&r.key, record.created_at_ms) {
                return Ok(Outcome::TokenCreated {
                    token_id: c.token_id.clone(),
                });
            }
        }
        if self.tokens.contains_key(&record.id) {
            return Err(ApplyError::Invalid {
                field: "id".into(),
                reason: format!("token {} exists already", record.id),
            });
        }
        // User and framework tokens act for a tenant; admin and join tokens
        // may name one (shown in lists) or not.
        let needs_tenant = matches!(record.role, TokenRole::User | TokenRole::Framework);
        if needs_tenant || !record.tenant.is_empty() {
            check_tenant(&record.tenant).map_err(|reason| ApplyError::Invalid {
                field: "tenant".into(),
                reason,
            })?;
        }
        self.tokens.insert(record.id.clone(), record.clone());
        if let Some(r) = request {
            self.token_requests.insert(
                &r.key,
                super::requests::CreatedToken {
                    token_id: record.id.clone(),
                    sealed: r.sealed.clone(),
                },
                record.created_at_ms,
            );
        }
        Ok(Outcome::TokenCreated {
            token_id: record.id.clone(),
        })
    }

    pub(super) fn revoke_token(&mut self, id: &str, at_ms: u64) -> Result<Outcome, ApplyError> {
        let t = self.tokens.get_mut(id).ok_or_else(|| ApplyError::Invalid {
            field: "id".into(),
            reason: format!("no token {id}"),
        })?;
        // Revoking twice keeps the first time.
        t.revoked_at_ms.get_or_insert(at_ms);
        Ok(Outcome::Done)
    }

    /// A join token is used by `agent_id`: refused unless it is a usable
    /// join token for that id, and (a token for any id) the id is new.
    /// Committed before the certificate is signed, so a token joins once
    /// even when two agents race with it through two leaders.
    pub(super) fn use_join_token(
        &mut self,
        id: &str,
        agent_id: &str,
        at_ms: u64,
        key: &str,
    ) -> Result<Outcome, ApplyError> {
        let invalid = |reason: String| ApplyError::Invalid {
            field: "token".into(),
            reason,
        };
        let known_agent = self.agents.contains_key(agent_id);
        let t = self
            .tokens
            .get_mut(id)
            .ok_or_else(|| invalid("unknown token".into()))?;
        if t.role != TokenRole::Join {
            return Err(invalid("not a join token".into()));
        }
        t.joinable_at(at_ms, agent_id, key)
            .map_err(|r| invalid(r.into()))?;
        if t.used.is_some() {
            // The same request again: let through, changing nothing (the
            // agent exists now, which is its own doing).
            return Ok(Outcome::Done);
        }
        match &t.agent_id {
            Some(only) if only != agent_id => {
                return Err(invalid(format!(
                    "this join token is for agent {only}, not {agent_id}"
                )))
            }
            Some(_) => {}
            None if known_agent => {
                return Err(invalid(format!(
                    "agent {agent_id} exists already; to join as it again, use a token made \
                     for it (gpuctl tokens create --join --agent {agent_id})"
                )))
            }
            None => {}
        }
        t.used = Some((at_ms, agent_id.to_string()));
        t.used_key = (!key.is_empty()).then(|| key.to_string());
        Ok(Outcome::Done)
    }

    /// Sets a tenant's quota (0: none) and, when given, its borrowing limit
    /// and weight (a weight of 1 and no borrowing limit are the defaults, not
    /// kept).
    pub(super) fn set_quota(
        &mut self,
        tenant: &str,
        gpus: u32,
        borrow: Option<Option<u32>>,
        weight: Option<u32>,
        stop_idle_after_ms: Option<Option<u64>>,
    ) -> Result<Outcome, ApplyError> {
        check_tenant(tenant).map_err(|reason| ApplyError::Invalid {
            field: "tenant".into(),
            reason,
        })?;
        if weight == Some(0) || weight.is_some_and(|w| w > MAX_WEIGHT) {
            return Err(ApplyError::Invalid {
                field: "weight".into(),
                reason: format!("must be 1 to {MAX_WEIGHT}"),
            });
        }
        if gpus == 0 {
            self.quotas.remove(tenant);
        } else {
            self.quotas.insert(tenant.to_string(), gpus);
        }
        let mut terms = self.tenant_terms.get(tenant).cloned().unwrap_or_default();
        if let Some(b) = borrow {
            terms.borrow = b;
        }
        if let Some(w) = weight {
            terms.weight = w;
        }
        if let Some(s) = stop_idle_after_ms {
            terms.stop_idle_after_ms = s;
        }
        if terms == TenantTerms::default() {
            self.tenant_terms.remove(tenant);
        } else {
            self.tenant_terms.insert(tenant.to_string(), terms);
        }
        Ok(Outcome::Done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Command;

    fn join_token(id: &str, agent: Option<&str>) -> TokenRecord {
        TokenRecord {
            id: id.into(),
            hash: "h".into(),
            role: TokenRole::Join,
            tenant: String::new(),
            description: String::new(),
            created_at_ms: 0,
            expires_at_ms: Some(1000),
            revoked_at_ms: None,
            agent_id: agent.map(str::to_string),
            used: None,
            used_key: None,
            framework_roles: Vec::new(),
            allow_root: false,
            allowed_uids: IdRanges::none(),
            allowed_gids: IdRanges::none(),
            created_by: "bootstrap".into(),
        }
    }

    fn token_request(key: &str) -> Option<crate::state::requests::TokenRequest> {
        Some(crate::state::requests::TokenRequest {
            key: key.into(),
            sealed: format!("sealed-{key}"),
        })
    }

    /// A create resent with its request id answers the first token and
    /// records no second one, per caller, until the key's TTL.
    #[test]
    fn a_token_create_resent_with_its_request_id_makes_one_token() {
        use crate::state::requests::REQUEST_TTL_MS;
        let mut s = State::new();
        let create = |id: &str, key: &str, at_ms: u64| {
            let mut record = join_token(id, None);
            record.created_at_ms = at_ms;
            Command::CreateToken {
                record,
                request: token_request(key),
            }
        };
        let first = s.apply(1, &create("t1", "admin1/h1", 1_000)).unwrap();
        assert_eq!(
            first,
            Outcome::TokenCreated {
                token_id: "t1".into()
            }
        );
        // The resend minted another secret (t2); the state keeps t1's.
        let again = s.apply(2, &create("t2", "admin1/h1", 2_000)).unwrap();
        assert_eq!(again, first);
        assert!(s.token("t2").is_none(), "no second token");
        let c = s.created_token("admin1/h1").unwrap();
        assert_eq!(
            (c.token_id.as_str(), c.sealed.as_str()),
            ("t1", "sealed-admin1/h1")
        );
        // Another caller's same request id is another token.
        s.apply(3, &create("t3", "admin2/h1", 2_001)).unwrap();
        assert!(s.token("t3").is_some());
        // Past the TTL the key is forgotten: the id makes a new token.
        let later = 1_000 + REQUEST_TTL_MS + 1;
        s.apply(4, &create("t4", "admin1/h1", later)).unwrap();
        assert!(s.token("t4").is_some());
        assert_eq!(s.created_token("admin1/h1").unwrap().token_id, "t4");
        // Without a request id: no memory at all.
        let mut record = join_token("t5", None);
        record.created_at_ms = later;
        s.apply(
            5,
            &Command::CreateToken {
                record,
                request: None,
            },
        )
        .unwrap();
        assert!(s.token("t5").is_some());
        assert_eq!(s.token_requests.len(), 2);
    }

    #[test]
    fn a_join_token_joins_once_before_it_expires() {
        let mut s = State::new();
        let record = join_token("j1", None);
        s.apply(
            1,
            &Command::CreateToken {
                record,
                request: None,
            },
        )
        .unwrap();
        assert!(
            s.apply(
                2,
                &Command::UseJoinToken {
                    id: "j1".into(),
                    agent_id: "a1".into(),
                    at_ms: 2000,
                    key: String::new(),
                }
            )
            .is_err(),
            "expired"
        );
        s.apply(
            3,
            &Command::UseJoinToken {
                id: "j1".into(),
                agent_id: "a1".into(),
                at_ms: 10,
                key: String::new(),
            },
        )
        .unwrap();
        let e = s
            .apply(
                4,
                &Command::UseJoinToken {
                    id: "j1".into(),
                    agent_id: "a2".into(),
                    at_ms: 11,
                    key: String::new(),
                },
            )
            .unwrap_err();
        assert!(e.to_string().contains("used already"), "{e}");
        assert_eq!(s.token("j1").unwrap().used, Some((10, "a1".into())));
    }

    #[test]
    fn a_join_token_for_an_agent_joins_only_as_it() {
        let mut s = State::new();
        let record = join_token("j2", Some("a9"));
        s.apply(
            1,
            &Command::CreateToken {
                record,
                request: None,
            },
        )
        .unwrap();
        let e = s
            .apply(
                2,
                &Command::UseJoinToken {
                    id: "j2".into(),
                    agent_id: "a1".into(),
                    at_ms: 1,
                    key: String::new(),
                },
            )
            .unwrap_err();
        assert!(e.to_string().contains("for agent a9"), "{e}");
        s.apply(
            3,
            &Command::UseJoinToken {
                id: "j2".into(),
                agent_id: "a9".into(),
                at_ms: 1,
                key: String::new(),
            },
        )
        .unwrap();
    }

    /// The request that used a join token, sent again with the same key
    /// by the same agent (its answer lost), is let through for
    /// [`JOIN_RETRY_MS`], changing nothing; another key, another agent, or
    /// later, is refused; an agent registered meanwhile is no obstacle.
    #[test]
    fn the_request_that_used_a_join_token_may_be_sent_again() {
        let mut s = State::new();
        let mut record = join_token("j3", None);
        record.expires_at_ms = None;
        s.apply(
            1,
            &Command::CreateToken {
                record,
                request: None,
            },
        )
        .unwrap();
        let join = |s: &mut State, i, agent: &str, at_ms, key: &str| {
            s.apply(
                i,
                &Command::UseJoinToken {
                    id: "j3".into(),
                    agent_id: agent.into(),
                    at_ms,
                    key: key.into(),
                },
            )
        };
        join(&mut s, 2, "a1", 100, "k1").unwrap();
        s.apply(3, &crate::state::testkit::register("a1", 1))
            .unwrap();
        join(&mut s, 4, "a1", 200, "k1").unwrap();
        join(&mut s, 5, "a1", 100 + JOIN_RETRY_MS, "k1").unwrap();
        let t = s.token("j3").unwrap();
        assert_eq!(t.used, Some((100, "a1".into())), "the first use stays");
        for (agent, at, key) in [
            ("a1", 300, "k2"),
            ("a2", 300, "k1"),
            ("a1", 101 + JOIN_RETRY_MS, "k1"),
            ("a1", 300, ""),
        ] {
            let e = join(&mut s, 6, agent, at, key).unwrap_err();
            assert!(
                e.to_string().contains("used already"),
                "{agent} {at} {key}: {e}"
            );
        }
    }

    #[test]
    fn revocation_and_bad_tenants() {
        let mut s = State::new();
        let mut record = join_token("t1", None);
        record.role = TokenRole::User;
        record.expires_at_ms = None;
        record.tenant = "Team A".into();
        let e = s
            .apply(
                1,
                &Command::CreateToken {
                    record: record.clone(),
                    request: None,
                },
            )
            .unwrap_err();
        assert!(e.to_string().contains("tenant"), "{e}");
        record.tenant = "team-a".into();
        s.apply(
            2,
            &Command::CreateToken {
                record: record.clone(),
                request: None,
            },
        )
        .unwrap();
        assert!(
            s.apply(
                3,
                &Command::CreateToken {
                    record,
                    request: None,
                }
            )
            .is_err(),
            "duplicate id"
        );
        s.apply(
            4,
            &Command::RevokeToken {
                id: "t1".into(),
                at_ms: 5,
            },
        )
        .unwrap();
        s.apply(
            5,
            &Command::RevokeToken {
                id: "t1".into(),
                at_ms: 9,
            },
        )
        .unwrap();
        let t = s.token("t1").unwrap();
        assert_eq!(t.revoked_at_ms, Some(5));
        assert_eq!(t.usable_at(6), Err("the token was revoked"));
        assert!(s
            .apply(
                6,
                &Command::RevokeToken {
                    id: "nope".into(),
                    at_ms: 5
                }
            )
            .is_err());
    }

    #[test]
    fn quotas_are_set_and_removed() {
        let mut s = State::new();
        s.apply(
            1,
            &Command::SetQuota {
                stop_idle_after_ms: None,
                clear_stop_idle: false,
                borrow: None,
                clear_borrow: false,
                weight: None,
                tenant: "ml".into(),
                gpus: 4,
            },
        )
        .unwrap();
        assert_eq!(s.quotas().get("ml"), Some(&4));
        s.apply(
            2,
            &Command::SetQuota {
                stop_idle_after_ms: None,
                clear_stop_idle: false,
                borrow: None,
                clear_borrow: false,
                weight: None,
                tenant: "ml".into(),
                gpus: 0,
            },
        )
        .unwrap();
        assert!(s.quotas().is_empty());
        assert!(s
            .apply(
                3,
                &Command::SetQuota {
                    stop_idle_after_ms: None,
                    clear_stop_idle: false,
                    borrow: None,
                    clear_borrow: false,
                    weight: None,
                    tenant: "".into(),
                    gpus: 1
                }
            )
            .is_err());
    }
}
