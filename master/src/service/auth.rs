//! Who may call what. A tower layer over the whole server, so no handler
//! can forget it: it finds the caller (the role and name in its client
//! certificate; for people and programs also the bearer token), checks the
//! call's rule in [`rule`], and hands the handlers a [`Caller`] in the
//! request's extensions for the finer checks (an agent's own id, a
//! tenant's own jobs, a framework's own id).
//!
//! Without TLS configured every caller is [`Caller::Open`] and may do
//! everything: the master then listens on loopback only (config.rs).

use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::{Either, Ready};
use gpuctl_auth::token::Token;
use gpuctl_auth::CertRole;
use tonic::body::BoxBody;
use tonic::Status;

use crate::raft::RaftHandle;
use crate::security::Security;
use crate::state::access::TokenRole;

/// The caller of a request, as the auth layer established it.
#[derive(Debug, Clone, PartialEq)]
pub enum Caller {
    /// No security configured: anything goes.
    Open,
    /// A master of the group (its node id).
    Master { node_id: u64 },
    /// An agent (its id, from its certificate).
    Agent { agent_id: String },
    /// A person or program with a client certificate and a token.
    Token(TokenCaller),
    /// A TLS connection without a client certificate (only `Identity.Join`).
    Anonymous,
}

/// What a token lets its holder do.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenCaller {
    pub id: String,
    pub role: TokenRole,
    /// Empty only for admin tokens that name no tenant.
    pub tenant: String,
    pub framework_roles: Vec<String>,
    pub allow_root: bool,
    /// The user and group ids its jobs may name.
    pub allowed_uids: gpuctl_core::types::IdRanges,
    pub allowed_gids: gpuctl_core::types::IdRanges,
}

pub use crate::state::access::DEFAULT_TENANT;

impl Caller {
    /// The caller found by the layer; a request that somehow bypassed it
    /// gets the least: anonymous.
    pub fn of<T>(req: &tonic::Request<T>) -> Caller {
        req.extensions()
            .get::<Caller>()
            .cloned()
            .unwrap_or(Caller::Anonymous)
    }

    /// The id of its token, for a caller with one.
    pub fn token_id(&self) -> Option<&str> {
        match self {
            Caller::Token(t) => Some(&t.id),
            _ => None,
        }
    }

    /// Whether it may act on every tenant's things.
    pub fn is_admin(&self) -> bool {
        match self {
            Caller::Open => true,
            Caller::Token(t) => t.role == TokenRole::Admin,
            _ => false,
        }
    }

    /// The tenant whose things it may act on; `None`: all (admin, open).
    pub fn tenant_scope(&self) -> Option<&str> {
        match self {
            Caller::Open => None,
            Caller::Token(t) if t.role == TokenRole::Admin => None,
            Caller::Token(t) => Some(&t.tenant),
            // Agents and masters call no tenant-scoped API (rule() keeps
            // them out); scope them to nothing.
            _ => Some(""),
        }
    }

    /// The tenant new things it creates are charged to.
    pub fn tenant(&self) -> &str {
        match self {
            Caller::Token(t) if !t.tenant.is_empty() => &t.tenant,
            _ => DEFAULT_TENANT,
        }
    }

    /// Whether it may see or touch something of `tenant`.
    pub fn may_access(&self, tenant: &str) -> bool {
        match self.tenant_scope() {
            None => true,
            Some(mine) => !mine.is_empty() && mine == tenant,
        }
    }

    /// Whose request ids these are: a request id names one request of one
    /// caller (its token id), so that two callers choosing the same id
    /// never see each other's requests. Empty without tokens (everyone is
    /// one caller then), and for callers that create nothing.
    pub fn request_scope(&self) -> &str {
        match self {
            Caller::Token(t) => &t.id,
            _ => "",
        }
    }

    /// The agent id an agent caller may act as; `None` for open callers,
    /// who may act as any (and `Some("")` for others, who may act as none).
    pub fn agent_scope(&self) -> Option<&str> {
        match self {
            Caller::Open => None,
            Caller::Agent { agent_id } => Some(agent_id),
            _ => Some(""),
        }
    }

    /// Refuses unless the caller may act as agent `agent_id`.
    pub fn check_agent(&self, agent_id: &str) -> Result<(), Status> {
        match self.agent_scope() {
            None => Ok(()),
            Some(mine) if mine == agent_id => Ok(()),
            Some(mine) => Err(Status::permission_denied(format!(
                "the certificate is agent {mine:?}'s: it cannot act as agent {agent_id:?}"
            ))),
        }
    }
}

/// What a call needs of its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// A master's certificate.
    Masters,
    /// An agent's certificate.
    Agents,
    /// Nothing (the call checks a token itself): `Identity.Join`.
    Anyone,
    /// A client certificate and a token of one of these roles.
    Tokens(&'static [TokenRole]),
}

const ADMIN: &[TokenRole] = &[TokenRole::Admin];
const JOBS: &[TokenRole] = &[TokenRole::Admin, TokenRole::User];
const FRAMEWORKS: &[TokenRole] = &[TokenRole::Admin, TokenRole::Framework];
const ANY_TOKEN: &[TokenRole] = &[TokenRole::Admin, TokenRole::User, TokenRole::Framework];

/// The rule of each call; `None`: no such call (refused).
pub fn rule(path: &str) -> Option<Rule> {
    let (service, method) = path.strip_prefix('/')?.split_once('/')?;
    Some(match service {
        "gpuctl.v1.RaftTransport" => Rule::Masters,
        "gpuctl.v1.AgentManager" => Rule::Agents,
        "gpuctl.v1.Identity" => match method {
            "Join" => Rule::Anyone,
            "Renew" => Rule::Agents,
            _ => return None,
        },
        "gpuctl.v1.Access" => match method {
            "WhoAmI" | "ListQuotas" => Rule::Tokens(ANY_TOKEN),
            "CreateToken" | "ListTokens" | "RevokeToken" | "SetQuota" => Rule::Tokens(ADMIN),
            _ => return None,
        },
        "gpuctl.v1.Operator" => match method {
            "AddMaster" | "RemoveMaster" | "CordonGpu" | "SetMigLayout" | "ShareGpu"
            | "DrainAgent" | "UndrainAgent" => Rule::Tokens(ADMIN),
            "SubmitJob" | "GetJob" | "WatchJob" | "ListJobs" | "CancelJob" | "JobLogs"
            | "CreateService" | "GetService" | "ListServices" | "ScaleService"
            | "DeleteService" => Rule::Tokens(JOBS),
            // Usage: a tenant's token sees its tenant's rows only; a
            // gateway's token (any role) its tenant's services' endpoints.
            "ListAgents" | "ListGpus" | "ListMasters" | "Usage" | "Utilization"
            | "WatchEndpoints" => Rule::Tokens(ANY_TOKEN),
            _ => return None,
        },
        "gpuctl.v1.Scheduler" => Rule::Tokens(FRAMEWORKS),
        _ => return None,
    })
}

#[derive(Clone)]
pub struct AuthLayer {
    pub raft: RaftHandle,
    pub security: Option<Arc<Security>>,
}

impl<S> tower_layer::Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Auth<S> {
        Auth {
            inner,
            raft: self.raft.clone(),
            security: self.security.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Auth<S> {
    inner: S,
    raft: RaftHandle,
    security: Option<Arc<Security>>,
}

/// The bearer token of a request, if it carries one.
fn bearer(headers: &http::HeaderMap) -> Option<Result<Token, Status>> {
    let value = headers.get(http::header::AUTHORIZATION)?;
    let value = match value.to_str() {
        Ok(v) => v,
        Err(_) => {
            return Some(Err(Status::unauthenticated(
                "the authorization header is not text",
            )))
        }
    };
    let token = value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .unwrap_or(value);
    Some(Token::parse(token).map_err(|e| Status::unauthenticated(e.to_string())))
}

/// Decides who is calling `path` and whether they may; `Err` is the answer.
pub fn authenticate(
    raft: &RaftHandle,
    extensions: &http::Extensions,
    headers: &http::HeaderMap,
    path: &str,
    now_ms: u64,
) -> Result<Caller, Status> {
    let Some(rule) = rule(path) else {
        return Err(Status::unimplemented(format!("no call {path}")));
    };
    let cert = match gpuctl_auth::peer::identity(extensions) {
        None => None,
        Some(Ok(id)) => Some(id),
        Some(Err(e)) => return Err(Status::unauthenticated(e.to_string())),
    };
    if let Some(id) = &cert {
        // rustls checked validity at the handshake; a long-lived connection
        // must not outlive its certificate.
        if now_ms >= id.not_after_ms {
            return Err(Status::unauthenticated(format!(
                "the {} certificate of {} expired; renew it",
                id.role, id.name
            )));
        }
    }
    let need_cert = |role: CertRole| -> Result<&gpuctl_auth::pki::Identity, Status> {
        match &cert {
            None => Err(Status::unauthenticated(format!(
                "{path} needs a {role} certificate of this cluster; the connection has none"
            ))),
            Some(id) if id.role != role => Err(Status::permission_denied(format!(
                "a {} certificate cannot call {path} (it needs a {role} certificate)",
                id.role
            ))),
            Some(id) => Ok(id),
        }
    };
    match rule {
        Rule::Anyone => Ok(match &cert {
            None => Caller::Anonymous,
            Some(id) => cert_caller(id),
        }),
        Rule::Masters => {
            let id = need_cert(CertRole::Master)?;
            let node_id = id.name.parse().map_err(|_| {
                Status::permission_denied(format!("master certificate names {:?}", id.name))
            })?;
            Ok(Caller::Master { node_id })
        }
        Rule::Agents => {
            let id = need_cert(CertRole::Agent)?;
            Ok(Caller::Agent {
                agent_id: id.name.clone(),
            })
        }
        Rule::Tokens(roles) => {
            need_cert(CertRole::Client)?;
            let token = match bearer(headers) {
                None => {
                    return Err(Status::unauthenticated(
                        "no token: set GPUCTL_TOKEN, or `token` in gpuctl's config file \
                         (an admin makes one with `gpuctl tokens create`)",
                    ))
                }
                Some(t) => t?,
            };
            let state = raft.state();
            let record = state
                .token(token.id())
                .filter(|r| token.matches(&r.hash))
                .ok_or_else(|| Status::unauthenticated("unknown token"))?;
            record
                .usable_at(now_ms)
                .map_err(|why| Status::unauthenticated(format!("{why} (token {})", record.id)))?;
            if !roles.contains(&record.role) {
                return Err(Status::permission_denied(format!(
                    "a {} token cannot call {path}",
                    record.role.as_str()
                )));
            }
            Ok(Caller::Token(TokenCaller {
                id: record.id.clone(),
                role: record.role,
                tenant: record.tenant.clone(),
                framework_roles: record.framework_roles.clone(),
                allow_root: record.allow_root,
                allowed_uids: record.allowed_uids.clone(),
                allowed_gids: record.allowed_gids.clone(),
            }))
        }
    }
}

fn cert_caller(id: &gpuctl_auth::pki::Identity) -> Caller {
    match id.role {
        CertRole::Master => id
            .name
            .parse()
            .map(|node_id| Caller::Master { node_id })
            .unwrap_or(Caller::Anonymous),
        CertRole::Agent => Caller::Agent {
            agent_id: id.name.clone(),
        },
        CertRole::Client => Caller::Anonymous,
    }
}

impl<S, B> tower_service::Service<http::Request<B>> for Auth<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<BoxBody>>,
{
    type Response = http::Response<BoxBody>;
    type Error = S::Error;
    type Future = Either<Ready<Result<Self::Response, Self::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let caller = if self.security.is_none() {
            Ok(Caller::Open)
        } else {
            authenticate(
                &self.raft,
                req.extensions(),
                req.headers(),
                req.uri().path(),
                crate::now_ms(),
            )
        };
        match caller {
            Ok(c) => {
                req.extensions_mut().insert(c);
                Either::Right(self.inner.call(req))
            }
            Err(status) => {
                tracing::debug!(path = req.uri().path(), error = %status.message(), "call refused");
                Either::Left(futures::future::ready(Ok(status.into_http())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_call_of_every_service_has_a_rule() {
        let calls = [
            ("gpuctl.v1.RaftTransport", vec!["Step", "Status"]),
            (
                "gpuctl.v1.AgentManager",
                vec![
                    "Register",
                    "Heartbeat",
                    "WatchTasks",
                    "UpdateStatus",
                    "UpdateStatuses",
                ],
            ),
            ("gpuctl.v1.Identity", vec!["Join", "Renew"]),
            (
                "gpuctl.v1.Access",
                vec![
                    "CreateToken",
                    "ListTokens",
                    "RevokeToken",
                    "WhoAmI",
                    "SetQuota",
                    "ListQuotas",
                ],
            ),
            (
                "gpuctl.v1.Operator",
                vec![
                    "SubmitJob",
                    "GetJob",
                    "WatchJob",
                    "ListJobs",
                    "CancelJob",
                    "ListAgents",
                    "ListGpus",
                    "CordonGpu",
                    "SetMigLayout",
                    "ShareGpu",
                    "DrainAgent",
                    "UndrainAgent",
                    "JobLogs",
                    "ListMasters",
                    "AddMaster",
                    "RemoveMaster",
                    "Usage",
                    "Utilization",
                    "CreateService",
                    "GetService",
                    "ListServices",
                    "ScaleService",
                    "DeleteService",
                    "WatchEndpoints",
                ],
            ),
            (
                "gpuctl.v1.Scheduler",
                vec![
                    "Subscribe",
                    "Accept",
                    "Decline",
                    "Revive",
                    "Suppress",
                    "Kill",
                    "Acknowledge",
                    "Reconcile",
                    "Teardown",
                    "UpdateFramework",
                ],
            ),
        ];
        for (service, methods) in calls {
            for m in methods {
                assert!(rule(&format!("/{service}/{m}")).is_some(), "{service}/{m}");
            }
        }
        assert_eq!(rule("/gpuctl.v1.Operator/Nope"), None);
        assert_eq!(rule("/grpc.reflection.v1.ServerReflection/X"), None);
        assert_eq!(rule("garbage"), None);
    }

    #[test]
    fn operator_calls_need_admin_and_jobs_need_a_user() {
        assert_eq!(
            rule("/gpuctl.v1.Operator/RemoveMaster"),
            Some(Rule::Tokens(ADMIN))
        );
        assert_eq!(
            rule("/gpuctl.v1.Operator/DrainAgent"),
            Some(Rule::Tokens(ADMIN))
        );
        assert_eq!(
            rule("/gpuctl.v1.Access/CreateToken"),
            Some(Rule::Tokens(ADMIN))
        );
        assert_eq!(
            rule("/gpuctl.v1.Operator/SubmitJob"),
            Some(Rule::Tokens(JOBS))
        );
        assert_eq!(
            rule("/gpuctl.v1.Scheduler/Teardown"),
            Some(Rule::Tokens(FRAMEWORKS))
        );
        assert_eq!(
            rule("/gpuctl.v1.AgentManager/UpdateStatus"),
            Some(Rule::Agents)
        );
        assert_eq!(rule("/gpuctl.v1.RaftTransport/Step"), Some(Rule::Masters));
        assert_eq!(rule("/gpuctl.v1.Identity/Join"), Some(Rule::Anyone));
    }

    #[test]
    fn tenants_scope_what_a_caller_reaches() {
        let user = Caller::Token(TokenCaller {
            id: "t".into(),
            role: TokenRole::User,
            tenant: "vision".into(),
            framework_roles: vec![],
            allow_root: false,
            allowed_uids: Default::default(),
            allowed_gids: Default::default(),
        });
        assert!(user.may_access("vision"));
        assert!(!user.may_access("nlp"));
        assert!(!user.is_admin());
        assert_eq!(user.tenant(), "vision");
        assert!(Caller::Open.may_access("nlp"));
        assert_eq!(Caller::Open.tenant(), DEFAULT_TENANT);
        let agent = Caller::Agent {
            agent_id: "a1".into(),
        };
        assert!(!agent.may_access(""));
        assert!(agent.check_agent("a1").is_ok());
        assert_eq!(
            agent.check_agent("a2").unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        assert!(Caller::Open.check_agent("a2").is_ok());
        assert!(Caller::Anonymous.check_agent("a2").is_err());
    }
}
