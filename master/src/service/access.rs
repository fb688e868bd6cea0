//! Identity (agents join and renew their certificates) and Access (tokens,
//! who am I, tenants' quotas).

use std::time::Duration;

use gpuctl_auth::token::{request_id_hash, Token, MIN_SEALING_REQUEST_ID};
use gpuctl_auth::CertRole;
use gpuctl_core::convert::{check_id, id_ranges_from_pb, id_ranges_to_pb};
use gpuctl_core::ConvertError;
use gpuctl_proto::pb;
use tonic::{Request, Response, Status};

use super::auth::{Caller, TokenCaller};
use super::{reply, Ctx, Missing, ServiceError};
use crate::now_ms;
use crate::state::access::{check_tenant, TokenRecord, TokenRole};
use crate::state::requests::{self, CreatedToken, TokenRequest};
use crate::state::{Command, Outcome};

/// Join tokens last this long unless asked otherwise.
pub const DEFAULT_JOIN_TOKEN_TTL: Duration = Duration::from_secs(3600);
/// Longest lifetime a token may be given.
const MAX_TOKEN_TTL_SECS: u64 = 10 * 365 * 86_400;
/// Longest description.
const MAX_DESCRIPTION: usize = 256;
/// Most framework roles one token may allow.
const MAX_FRAMEWORK_ROLES: usize = 32;
/// Largest signing request accepted.
const MAX_CSR_BYTES: usize = 16 * 1024;

pub struct IdentityService {
    pub(super) ctx: Ctx,
}

pub struct AccessService {
    pub(super) ctx: Ctx,
}

fn role_to_pb(r: TokenRole) -> pb::TokenRole {
    match r {
        TokenRole::Admin => pb::TokenRole::Admin,
        TokenRole::User => pb::TokenRole::User,
        TokenRole::Framework => pb::TokenRole::Framework,
        TokenRole::Join => pb::TokenRole::Join,
    }
}

pub fn token_info(t: &TokenRecord) -> pb::TokenInfo {
    pb::TokenInfo {
        id: t.id.clone(),
        role: role_to_pb(t.role) as i32,
        tenant: t.tenant.clone(),
        description: t.description.clone(),
        created_at_ms: t.created_at_ms,
        expires_at_ms: t.expires_at_ms.unwrap_or(0),
        revoked_at_ms: t.revoked_at_ms.unwrap_or(0),
        used_at_ms: t.used.as_ref().map(|u| u.0).unwrap_or(0),
        used_by: t.used.as_ref().map(|u| u.1.clone()).unwrap_or_default(),
        agent_id: t.agent_id.clone().unwrap_or_default(),
        framework_roles: t.framework_roles.clone(),
        allow_root: t.allow_root,
        created_by: t.created_by.clone(),
        allowed_uids: id_ranges_to_pb(&t.allowed_uids),
        allowed_gids: id_ranges_to_pb(&t.allowed_gids),
    }
}

/// Whether a create asked for what `made` was made with: everything but
/// the id, the secret and the times (a lifetime counts, not its start).
fn same_settings(made: &TokenRecord, asked: &TokenRecord) -> bool {
    let ttl = |r: &TokenRecord| r.expires_at_ms.map(|e| e.saturating_sub(r.created_at_ms));
    made.role == asked.role
        && made.tenant == asked.tenant
        && made.description == asked.description
        && ttl(made) == ttl(asked)
        && made.agent_id == asked.agent_id
        && made.framework_roles == asked.framework_roles
        && made.allow_root == asked.allow_root
        && made.allowed_uids == asked.allowed_uids
        && made.allowed_gids == asked.allowed_gids
        && made.created_by == asked.created_by
}

fn check_csr(csr: &str) -> Result<(), ServiceError> {
    if csr.is_empty() || csr.len() > MAX_CSR_BYTES {
        return Err(ConvertError::new(
            "csr_pem",
            format!("must be 1 to {MAX_CSR_BYTES} bytes of PEM"),
        )
        .into());
    }
    Ok(())
}

impl IdentityService {
    fn security(&self) -> Result<&crate::security::Security, ServiceError> {
        self.ctx.security.as_deref().ok_or_else(|| {
            ServiceError::CannotSign(
                "this master runs without TLS: agents and clients need no certificate".into(),
            )
        })
    }

    /// Signs `csr` as `role`/`name` for at most `ttl`.
    fn sign(
        &self,
        csr: &str,
        role: CertRole,
        name: &str,
        ttl: Duration,
    ) -> Result<pb::JoinResponse, ServiceError> {
        let sec = self.security()?;
        let ca = sec.ca.as_ref().ok_or_else(|| {
            ServiceError::CannotSign(
                "this master has no CA key (ca_key) and cannot sign certificates; make them \
                 with `gpuctl certs issue` where the CA key is"
                    .into(),
            )
        })?;
        let issued = ca
            .sign_request(csr, role, name, ttl, &[])
            .map_err(|e| ConvertError::new("csr_pem", e.to_string()))?;
        let ca_pem = sec
            .ca_bundle()
            .map_err(|e| ServiceError::CannotSign(format!("cannot read the CA file: {e}")))?;
        Ok(pb::JoinResponse {
            cert_pem: issued.cert_pem,
            ca_pem,
            not_after_ms: issued.not_after_ms,
        })
    }

    async fn join(&self, req: pb::JoinRequest) -> Result<pb::JoinResponse, ServiceError> {
        let sec = self.security()?;
        check_csr(&req.csr_pem)?;
        let token =
            Token::parse(&req.token).map_err(|e| ServiceError::Unauthenticated(e.to_string()))?;
        let now = now_ms();
        let record = {
            let state = self.ctx.raft.state();
            state
                .token(token.id())
                .filter(|r| token.matches(&r.hash))
                .cloned()
                .ok_or_else(|| ServiceError::Unauthenticated("unknown token".into()))?
        };
        let unusable =
            |why: &str| ServiceError::Unauthenticated(format!("{why} (token {})", record.id));
        if record.role == TokenRole::Join {
            check_id("agent_id", &req.agent_id)?;
            // The request is named by the key it asks a certificate for: the
            // same request sent again (its answer lost) may use the token
            // once more, for a while; no other request may.
            let key = gpuctl_auth::pki::csr_key_hash(&req.csr_pem)
                .map_err(|e| ConvertError::new("csr_pem", e.to_string()))?;
            record
                .joinable_at(now, &req.agent_id, &key)
                .map_err(unusable)?;
            // Single use, decided by the replicated log before anything is
            // signed: two agents racing with one token cannot both join.
            self.ctx
                .raft
                .propose(Command::UseJoinToken {
                    id: record.id.clone(),
                    agent_id: req.agent_id.clone(),
                    at_ms: now,
                    key,
                })
                .await
                .map_err(|e| match e {
                    crate::raft::ProposeError::Rejected(a) => {
                        ServiceError::Unauthenticated(a.to_string())
                    }
                    e => e.into(),
                })?;
            tracing::info!(agent_id = %req.agent_id, token_id = %record.id, "agent joined");
            return self.sign(
                &req.csr_pem,
                CertRole::Agent,
                &req.agent_id,
                sec.config.agent_cert_ttl,
            );
        }
        record.usable_at(now).map_err(unusable)?;
        // An access token: a client certificate for its holder, lasting no
        // longer than the token.
        let mut ttl = sec.config.client_cert_ttl;
        if let Some(exp) = record.expires_at_ms {
            ttl = ttl.min(Duration::from_millis(exp.saturating_sub(now)));
        }
        let tenant = if record.tenant.is_empty() {
            "admin"
        } else {
            &record.tenant
        };
        let name = format!("{tenant}.{}", record.id);
        tracing::info!(%name, "client certificate issued");
        self.sign(&req.csr_pem, CertRole::Client, &name, ttl)
    }

    async fn renew(
        &self,
        caller: &Caller,
        req: pb::RenewRequest,
    ) -> Result<pb::JoinResponse, ServiceError> {
        let sec = self.security()?;
        check_csr(&req.csr_pem)?;
        let Caller::Agent { agent_id } = caller else {
            return Err(ServiceError::Forbidden(
                "only an agent renews its certificate this way".into(),
            ));
        };
        tracing::info!(%agent_id, "agent certificate renewed");
        self.sign(
            &req.csr_pem,
            CertRole::Agent,
            agent_id,
            sec.config.agent_cert_ttl,
        )
    }
}

#[tonic::async_trait]
impl pb::identity_server::Identity for IdentityService {
    async fn join(
        &self,
        req: Request<pb::JoinRequest>,
    ) -> Result<Response<pb::JoinResponse>, Status> {
        reply(self.join(req.into_inner()).await)
    }

    async fn renew(
        &self,
        req: Request<pb::RenewRequest>,
    ) -> Result<Response<pb::JoinResponse>, Status> {
        let caller = Caller::of(&req);
        reply(self.renew(&caller, req.into_inner()).await)
    }
}

/// The role a token is created with.
fn token_role(role: i32) -> Result<TokenRole, ServiceError> {
    let role = match pb::TokenRole::try_from(role) {
        Ok(pb::TokenRole::Admin) => TokenRole::Admin,
        Ok(pb::TokenRole::User) => TokenRole::User,
        Ok(pb::TokenRole::Framework) => TokenRole::Framework,
        Ok(pb::TokenRole::Join) => TokenRole::Join,
        _ => {
            return Err(
                ConvertError::new("role", "must be one of admin, user, framework, join").into(),
            )
        }
    };
    Ok(role)
}

/// A create's request key, when it names a request id.
fn token_request_key(caller: &Caller, request_id: &str) -> Result<Option<String>, ServiceError> {
    // The key is the caller's and holds only a hash of the request id,
    // which seals the secret (gpuctl_auth::token::Token::seal).
    let request_key = if request_id.is_empty() {
        None
    } else {
        check_id("request_id", request_id)?;
        if request_id.len() < MIN_SEALING_REQUEST_ID {
            return Err(ConvertError::new(
                "request_id",
                format!(
                    "at least {MIN_SEALING_REQUEST_ID} characters: it seals the token's secret \
                     for a resend, so it must be as hard to guess as 128 random bits (as gpuctl \
                     makes them)"
                ),
            )
            .into());
        }
        Some(requests::request_key(
            caller.request_scope(),
            &request_id_hash(request_id),
        ))
    };
    Ok(request_key)
}

/// A new token and its record, once every field of the request is
/// checked (each error names its field).
fn new_token(
    caller: &Caller,
    req: &pb::CreateTokenRequest,
    role: TokenRole,
) -> Result<(Token, TokenRecord), ServiceError> {
    let tenant = req.tenant.trim().to_string();
    match role {
        TokenRole::User | TokenRole::Framework if tenant.is_empty() => {
            return Err(ConvertError::new(
                "tenant",
                "a user or framework token must name its tenant",
            )
            .into())
        }
        TokenRole::Join if !tenant.is_empty() => {
            return Err(ConvertError::new("tenant", "join tokens have no tenant").into())
        }
        _ => {}
    }
    if !tenant.is_empty() {
        check_tenant(&tenant).map_err(|r| ConvertError::new("tenant", r))?;
    }
    if req.ttl_secs > MAX_TOKEN_TTL_SECS {
        return Err(ConvertError::new(
            "ttl_secs",
            format!("at most {MAX_TOKEN_TTL_SECS} (10 years)"),
        )
        .into());
    }
    if req.description.len() > MAX_DESCRIPTION || req.description.chars().any(char::is_control) {
        return Err(ConvertError::new(
            "description",
            format!("at most {MAX_DESCRIPTION} bytes, no control characters"),
        )
        .into());
    }
    let agent_id = if req.agent_id.is_empty() {
        None
    } else if role != TokenRole::Join {
        return Err(ConvertError::new("agent_id", "only join tokens name an agent").into());
    } else {
        check_id("agent_id", &req.agent_id)?;
        Some(req.agent_id.clone())
    };
    if !req.framework_roles.is_empty() && role != TokenRole::Framework {
        return Err(
            ConvertError::new("framework_roles", "only framework tokens allow roles").into(),
        );
    }
    if req.framework_roles.len() > MAX_FRAMEWORK_ROLES {
        return Err(
            ConvertError::new("framework_roles", format!("at most {MAX_FRAMEWORK_ROLES}")).into(),
        );
    }
    for (i, r) in req.framework_roles.iter().enumerate() {
        check_id(&format!("framework_roles[{i}]"), r)?;
    }
    let framework_roles = if role == TokenRole::Framework && req.framework_roles.is_empty() {
        vec![tenant.clone()]
    } else {
        req.framework_roles.clone()
    };
    if req.allow_root && !matches!(role, TokenRole::User | TokenRole::Admin) {
        return Err(ConvertError::new("allow_root", "only user and admin tokens run jobs").into());
    }
    let allowed_uids = id_ranges_from_pb("allowed_uids", &req.allowed_uids)?;
    let allowed_gids = id_ranges_from_pb("allowed_gids", &req.allowed_gids)?;
    for (field, ids) in [
        ("allowed_uids", &allowed_uids),
        ("allowed_gids", &allowed_gids),
    ] {
        if !ids.is_empty() && !matches!(role, TokenRole::User | TokenRole::Admin) {
            return Err(ConvertError::new(field, "only user and admin tokens run jobs").into());
        }
    }
    let now = now_ms();
    let ttl_ms = match (req.ttl_secs, role) {
        (0, TokenRole::Join) => Some(DEFAULT_JOIN_TOKEN_TTL.as_millis() as u64),
        (0, _) => None,
        (s, _) => Some(s * 1000),
    };
    let token = Token::generate().map_err(|e| ServiceError::CannotSign(e.to_string()))?;
    let creator = match caller {
        Caller::Token(t) => t.id.clone(),
        Caller::Open => "open".into(),
        _ => String::new(),
    };
    let record = TokenRecord {
        id: token.id().to_string(),
        hash: token.hash(),
        role,
        tenant,
        description: req.description.clone(),
        created_at_ms: now,
        expires_at_ms: ttl_ms.map(|t| now + t),
        revoked_at_ms: None,
        agent_id,
        used: None,
        used_key: None,
        framework_roles,
        allow_root: req.allow_root,
        allowed_uids,
        allowed_gids,
        created_by: creator,
    };
    Ok((token, record))
}

impl AccessService {
    async fn create_token(
        &self,
        caller: &Caller,
        req: pb::CreateTokenRequest,
    ) -> Result<pb::CreateTokenResponse, ServiceError> {
        let role = token_role(req.role)?;
        let request_key = token_request_key(caller, &req.request_id)?;
        let (token, record) = new_token(caller, &req, role)?;
        let Some(request_key) = request_key else {
            self.ctx
                .raft
                .propose(Command::CreateToken {
                    record: record.clone(),
                    request: None,
                })
                .await?;
            tracing::info!(token_id = %record.id, role = record.role.as_str(), tenant = %record.tenant, "token created");
            return Ok(pb::CreateTokenResponse {
                info: Some(token_info(&record)),
                token: token.reveal(),
            });
        };
        // A resend of a create already applied: the token it made, with
        // its secret, never a second one.
        let earlier = self.ctx.raft.state().created_token(&request_key).cloned();
        if let Some(c) = earlier {
            return self.created_again(&c, &record, &req.request_id);
        }
        let sealed = token
            .seal(&req.request_id)
            .map_err(|e| ServiceError::CannotSign(e.to_string()))?;
        let outcome = self
            .ctx
            .raft
            .propose(Command::CreateToken {
                record: record.clone(),
                request: Some(TokenRequest {
                    key: request_key.clone(),
                    sealed,
                }),
            })
            .await?;
        match outcome {
            Outcome::TokenCreated { token_id } if token_id == record.id => {
                tracing::info!(token_id = %record.id, role = record.role.as_str(), tenant = %record.tenant, "token created");
                Ok(pb::CreateTokenResponse {
                    info: Some(token_info(&record)),
                    token: token.reveal(),
                })
            }
            // A resend raced its first send: the first one's token.
            Outcome::TokenCreated { .. } => {
                let c = self
                    .ctx
                    .raft
                    .state()
                    .created_token(&request_key)
                    .cloned()
                    .ok_or_else(|| ServiceError::NoSuchRequest {
                        what: "token",
                        request_id: req.request_id.clone(),
                    })?;
                self.created_again(&c, &record, &req.request_id)
            }
            other => Err(ServiceError::unexpected("create_token", other)),
        }
    }

    /// The answer to a create sent again with the request id of one that
    /// made token `c`: that token and its secret, opened with the request
    /// id, when the settings asked (`asked`) are the ones it was made with.
    fn created_again(
        &self,
        c: &CreatedToken,
        asked: &TokenRecord,
        request_id: &str,
    ) -> Result<pb::CreateTokenResponse, ServiceError> {
        let record = self
            .ctx
            .raft
            .state()
            .token(&c.token_id)
            .cloned()
            .ok_or_else(|| ServiceError::not_found(Missing::Token, &c.token_id))?;
        if !same_settings(&record, asked) {
            return Err(ServiceError::RequestIdReused(format!(
                "this token already created token {} with this request id and other settings; \
                 give another request id (or none) for another token",
                record.id
            )));
        }
        let token = Token::unseal(&record.id, &c.sealed, request_id)
            .map_err(|e| ServiceError::CannotSign(e.to_string()))?;
        tracing::info!(token_id = %record.id, "token create resent: answered with the token it made");
        Ok(pb::CreateTokenResponse {
            info: Some(token_info(&record)),
            token: token.reveal(),
        })
    }

    fn list_tokens(&self, req: pb::ListTokensRequest) -> pb::ListTokensResponse {
        let now = now_ms();
        let state = self.ctx.raft.state();
        let tokens = state
            .tokens()
            .values()
            .filter(|t| req.all || t.usable_at(now).is_ok())
            .map(token_info)
            .collect();
        pb::ListTokensResponse { tokens }
    }

    async fn revoke_token(
        &self,
        req: pb::RevokeTokenRequest,
    ) -> Result<pb::TokenInfo, ServiceError> {
        if !gpuctl_auth::token::is_token_id(&req.id) {
            return Err(ConvertError::new("id", "not a token id (16 hex digits)").into());
        }
        if self.ctx.raft.state().token(&req.id).is_none() {
            return Err(ServiceError::not_found(Missing::Token, req.id));
        }
        self.ctx
            .raft
            .propose(Command::RevokeToken {
                id: req.id.clone(),
                at_ms: now_ms(),
            })
            .await?;
        tracing::info!(token_id = %req.id, "token revoked");
        let state = self.ctx.raft.state();
        state
            .token(&req.id)
            .map(token_info)
            .ok_or_else(|| ServiceError::not_found(Missing::Token, &req.id))
    }

    fn who_am_i(&self, caller: &Caller) -> pb::WhoAmIResponse {
        match caller {
            Caller::Token(TokenCaller { id, .. }) => {
                let state = self.ctx.raft.state();
                pb::WhoAmIResponse {
                    kind: "token".into(),
                    token: state.token(id).map(token_info),
                    cert_role: CertRole::Client.to_string(),
                    cert_name: String::new(),
                }
            }
            Caller::Open => pb::WhoAmIResponse {
                kind: "open".into(),
                ..Default::default()
            },
            Caller::Master { node_id } => pb::WhoAmIResponse {
                kind: "master".into(),
                cert_role: "master".into(),
                cert_name: node_id.to_string(),
                ..Default::default()
            },
            Caller::Agent { agent_id } => pb::WhoAmIResponse {
                kind: "agent".into(),
                cert_role: "agent".into(),
                cert_name: agent_id.clone(),
                ..Default::default()
            },
            Caller::Anonymous => pb::WhoAmIResponse {
                kind: "anonymous".into(),
                ..Default::default()
            },
        }
    }

    async fn set_quota(&self, req: pb::SetQuotaRequest) -> Result<pb::TenantQuota, ServiceError> {
        check_tenant(&req.tenant).map_err(|r| ConvertError::new("tenant", r))?;
        let max = crate::state::access::MAX_WEIGHT;
        if req.weight.is_some_and(|w| w == 0 || w > max) {
            return Err(ConvertError::new("weight", format!("must be 1 to {max}")).into());
        }
        if req.stop_idle_after_ms.is_some_and(|ms| ms < 1000) {
            return Err(
                ConvertError::new("stop_idle_after_ms", "must be at least 1000 (1 s)").into(),
            );
        }
        if req.stop_idle_after_ms.is_some() && req.clear_stop_idle {
            return Err(ConvertError::new(
                "stop_idle_after_ms",
                "give a time or clear it, not both",
            )
            .into());
        }
        if req.borrow.is_some() && req.clear_borrow {
            return Err(ConvertError::new(
                "borrow",
                "give a borrowing limit or clear it, not both",
            )
            .into());
        }
        self.ctx
            .raft
            .propose(Command::SetQuota {
                tenant: req.tenant.clone(),
                gpus: req.gpus,
                borrow: req.borrow,
                clear_borrow: req.clear_borrow,
                weight: req.weight,
                stop_idle_after_ms: req.stop_idle_after_ms,
                clear_stop_idle: req.clear_stop_idle,
            })
            .await?;
        tracing::info!(tenant = %req.tenant, gpus = req.gpus, borrow = ?req.borrow, weight = ?req.weight, "quota set");
        let all = self.list_quotas(&Caller::Open);
        Ok(all
            .tenants
            .into_iter()
            .find(|t| t.tenant == req.tenant)
            .unwrap_or(pb::TenantQuota {
                tenant: req.tenant,
                gpu_quota: req.gpus,
                ..Default::default()
            }))
    }

    fn list_quotas(&self, caller: &Caller) -> pb::ListQuotasResponse {
        let state = self.ctx.raft.state();
        let usage = crate::scheduler::tenants::usage(&state);
        let shares = crate::scheduler::tenants::fair_shares(&state);
        let mut tenants: std::collections::BTreeMap<String, pb::TenantQuota> = usage
            .into_iter()
            .map(|(tenant, u)| {
                (
                    tenant.clone(),
                    pb::TenantQuota {
                        tenant,
                        gpus_used: u.gpus,
                        jobs_queued: u.queued,
                        jobs_running: u.running,
                        ..Default::default()
                    },
                )
            })
            .collect();
        for tenant in state.quotas().keys().chain(state.tenant_terms().keys()) {
            tenants
                .entry(tenant.clone())
                .or_insert_with(|| pb::TenantQuota {
                    tenant: tenant.clone(),
                    ..Default::default()
                });
        }
        // Borrowed: held beyond its quota; lent: quota left idle while
        // others borrow (no more than they borrow in all).
        let quota = |t: &str| state.quotas().get(t).copied().unwrap_or(0);
        let borrowed: u32 = tenants
            .values()
            .map(|q| q.gpus_used.saturating_sub(quota(&q.tenant)))
            .sum();
        let mut lendable = borrowed;
        for q in tenants.values_mut() {
            q.gpu_quota = quota(&q.tenant);
            q.gpu_limit = state.tenant_cap(&q.tenant);
            q.weight = state.tenant_weight(&q.tenant);
            q.stop_idle_after_ms = state
                .tenant_terms()
                .get(&q.tenant)
                .and_then(|t| t.stop_idle_after_ms)
                .unwrap_or(0);
            q.fair_share = shares.get(&q.tenant).map_or(0, |f| f.share);
            q.gpus_borrowed = q.gpus_used.saturating_sub(q.gpu_quota);
            q.gpus_lent = q.gpu_quota.saturating_sub(q.gpus_used).min(lendable);
            lendable -= q.gpus_lent;
        }
        pb::ListQuotasResponse {
            tenants: tenants
                .into_values()
                .filter(|t| caller.may_access(&t.tenant))
                .collect(),
        }
    }
}

#[tonic::async_trait]
impl pb::access_server::Access for AccessService {
    async fn create_token(
        &self,
        req: Request<pb::CreateTokenRequest>,
    ) -> Result<Response<pb::CreateTokenResponse>, Status> {
        let caller = Caller::of(&req);
        reply(self.create_token(&caller, req.into_inner()).await)
    }

    async fn list_tokens(
        &self,
        req: Request<pb::ListTokensRequest>,
    ) -> Result<Response<pb::ListTokensResponse>, Status> {
        Ok(Response::new(self.list_tokens(req.into_inner())))
    }

    async fn revoke_token(
        &self,
        req: Request<pb::RevokeTokenRequest>,
    ) -> Result<Response<pb::TokenInfo>, Status> {
        reply(self.revoke_token(req.into_inner()).await)
    }

    async fn who_am_i(
        &self,
        req: Request<pb::WhoAmIRequest>,
    ) -> Result<Response<pb::WhoAmIResponse>, Status> {
        let caller = Caller::of(&req);
        Ok(Response::new(self.who_am_i(&caller)))
    }

    async fn set_quota(
        &self,
        req: Request<pb::SetQuotaRequest>,
    ) -> Result<Response<pb::TenantQuota>, Status> {
        reply(self.set_quota(req.into_inner()).await)
    }

    async fn list_quotas(
        &self,
        req: Request<pb::ListQuotasRequest>,
    ) -> Result<Response<pb::ListQuotasResponse>, Status> {
        let caller = Caller::of(&req);
        Ok(Response::new(self.list_quotas(&caller)))
    }
}
