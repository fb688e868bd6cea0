//! Connecting to the masters and following the leader.
//!
//! `--master` (or `GPUCTL_MASTER`) is a comma separated list of `HOST:PORT`.
//! The CLI connects to the first one that accepts a connection. Only the
//! Raft leader serves the API: a follower answers `UNAVAILABLE`, naming the
//! leader in the `gpuctl-leader` metadata when it knows it
//! (`gpuctl_proto::leader`). [`Master::call`] follows such redirects, tries
//! the next address when there is no hint (an election, a master down) and
//! gives up after [`LEADER_DEADLINE`].

use std::fmt;
use std::future::Future;
use std::time::Duration;

use gpuctl_proto::leader::{retry_elsewhere, LeaderSearch};
use std::sync::Arc;

use gpuctl_auth::tls::Tls;
use gpuctl_auth::CertRole;
use gpuctl_proto::pb::operator_client::OperatorClient;
use tokio::time::Instant;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::Status;

use crate::commands::CliError;

/// The default `--master`.
pub const DEFAULT_MASTER: &str = "127.0.0.1:7050";

/// How long one address may take to accept a connection before the next is tried.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a call keeps looking for the leader (redirects, an election, a
/// master down) before it reports the last error.
pub const LEADER_DEADLINE: Duration = Duration::from_secs(15);

/// Longest one attempt of an ordinary call may take.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest `AddMaster`/`RemoveMaster` may take: a new master first catches
/// up as a learner, removing the leader first hands leadership on.
pub const MEMBERSHIP_TIMEOUT: Duration = Duration::from_secs(60);

/// Pauses between attempts that got no leader hint.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Largest reply the CLI accepts (a big cluster's job list is large).
const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// The parsed value of `--master`: at least one `HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MasterList(pub Vec<String>);

impl fmt::Display for MasterList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join(","))
    }
}

/// Parses `HOST:PORT[,HOST:PORT...]`. A leading `http://` is accepted and
/// dropped; whitespace around entries is ignored; empty entries, a missing
/// or bad port are errors.
pub fn parse_master_list(s: &str) -> Result<MasterList, String> {
    let mut out = Vec::new();
    for raw in s.split(',') {
        if raw.trim().is_empty() {
            return Err(format!(
                "empty address in {s:?} (expected HOST:PORT[,HOST:PORT...])"
            ));
        }
        out.push(parse_address(raw)?);
    }
    Ok(MasterList(out))
}

/// Parses one `HOST:PORT` (a leading `http://` is dropped).
pub fn parse_address(raw: &str) -> Result<String, String> {
    let entry = raw.trim();
    let entry = entry.strip_prefix("http://").unwrap_or(entry);
    if entry.is_empty() {
        return Err("empty address (expected HOST:PORT)".to_string());
    }
    let Some((host, port)) = entry.rsplit_once(':') else {
        return Err(format!("{entry:?} has no port (expected HOST:PORT)"));
    };
    if host.is_empty() {
        return Err(format!("{entry:?} has no host (expected HOST:PORT)"));
    }
    // A bare IPv6 address must be bracketed: "[::1]:7050".
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err(format!(
            "{entry:?}: write an IPv6 address in brackets, e.g. [::1]:7050"
        ));
    }
    match port.parse::<u16>() {
        Ok(p) if p != 0 => Ok(entry.to_string()),
        _ => Err(format!(
            "{entry:?}: port {port:?} is not a number in 1..65535"
        )),
    }
}

/// When a failed call may be sent again (to the leader, or later).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// A read: retried after any error that another master or a later try
    /// may not have.
    Always,
    /// A change that is safe to send again: idempotent (a cancel, a
    /// cordon, a quota set, adding a master by its id), or a create that
    /// carries a request id, which the master dedupes. Retried like a
    /// read. When it fails in the end after a try that may have been
    /// applied (the failure proves nothing: a connection lost mid-call, no
    /// answer in time, a leader deposed while committing), its outcome is
    /// unknown ([`CliError::Unknown`], exit 4), never an ordinary failure;
    /// and from such a try on it looks for a leader
    /// [`UNKNOWN_SEARCH_FACTOR`] times longer, since giving up then leaves
    /// the user guessing.
    Resend,
}

/// How much longer a change keeps looking for a leader once a try may have
/// been applied: 15 s becomes 60 s, time for an election and the new
/// leader's catch-up to end well inside it.
pub const UNKNOWN_SEARCH_FACTOR: u32 = 4;

/// Whether a call that failed with `status` is sent again, to another
/// master or later (under either [`Retry`]: they differ in how a final
/// failure is reported).
pub fn may_retry(status: &Status) -> bool {
    // A master dying mid-call breaks the connection with whatever code
    // the transport error maps to ("h2 protocol error": Unknown).
    retry_elsewhere(status) || crate::commands::is_transport_error(status)
}

/// Whether the failure proves the call was not applied: the master said it
/// refused before proposing (a redirect, no leader elected yet, a new leader
/// still catching up), a full proposal queue, or a connection that was never
/// made. A leader's "leadership lost while committing" carries no such mark:
/// it may still commit.
pub fn not_applied(status: &Status) -> bool {
    gpuctl_proto::leader::not_applied(status)
}

/// No master in the list accepted a connection.
#[derive(Debug, thiserror::Error)]
#[error("could not reach a master at {} ({last_error})", tried.join(", "))]
pub struct ConnectError {
    pub tried: Vec<String>,
    pub last_error: String,
}

/// What the CLI proves itself with: a client certificate (mutual TLS) and
/// a bearer token. Both absent for a cluster without security.
#[derive(Clone, Default)]
pub struct Credentials {
    pub tls: Option<Arc<Tls>>,
    /// `Bearer <token>`, ready for the `authorization` header.
    pub token: Option<MetadataValue<Ascii>>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("tls", &self.tls.as_ref().map(|t| t.identity()))
            .field("token", &self.token.as_ref().map(|_| "<hidden>"))
            .finish()
    }
}

impl Credentials {
    pub fn with_token(mut self, token: &str) -> Result<Credentials, String> {
        let token = gpuctl_auth::token::Token::parse(token).map_err(|e| e.to_string())?;
        self.token = Some(
            format!("Bearer {}", token.reveal())
                .parse()
                .map_err(|_| "token: not valid in a header".to_string())?,
        );
        Ok(self)
    }
}

/// Adds the token to every call.
#[derive(Clone)]
pub struct AddToken(Option<MetadataValue<Ascii>>);

impl tonic::service::Interceptor for AddToken {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(t) = &self.0 {
            req.metadata_mut().insert("authorization", t.clone());
        }
        Ok(req)
    }
}

/// A channel to a master that carries the credentials.
pub type Conn = InterceptedService<Channel, AddToken>;

/// A connected Operator client and the address it talks to.
#[derive(Debug, Clone)]
pub struct Master {
    /// The address calls go to now.
    pub addr: String,
    /// Every address of `--master`, and leaders learned from redirects.
    pub addrs: Vec<String>,
    pub client: OperatorClient<Conn>,
    /// The same connection, for the other services' clients.
    pub conn: Conn,
    pub creds: Credentials,
    /// How long a call follows the leader before giving up.
    pub retry_for: Duration,
}

impl Master {
    /// Connects to the first address of `addrs` that answers.
    pub async fn connect(addrs: &[String]) -> Result<Master, ConnectError> {
        Self::connect_as(addrs, &Credentials::default()).await
    }

    /// Connects with credentials.
    pub async fn connect_as(addrs: &[String], creds: &Credentials) -> Result<Master, ConnectError> {
        Self::connect_with_timeout(addrs, CONNECT_TIMEOUT, creds).await
    }

    pub async fn connect_with_timeout(
        addrs: &[String],
        timeout: Duration,
        creds: &Credentials,
    ) -> Result<Master, ConnectError> {
        let mut last_error = String::from("no address given");
        for addr in addrs {
            match connect_one(addr, timeout, creds).await {
                Ok(channel) => {
                    let conn = InterceptedService::new(channel, AddToken(creds.token.clone()));
                    return Ok(Master {
                        addr: addr.clone(),
                        addrs: addrs.to_vec(),
                        client: operator_client(conn.clone()),
                        conn,
                        creds: creds.clone(),
                        retry_for: LEADER_DEADLINE,
                    });
                }
                Err(e) => {
                    tracing::debug!(addr = %addr, error = %e, "master did not answer");
                    last_error = format!("{addr}: {e}");
                }
            }
        }
        Err(ConnectError {
            tried: addrs.to_vec(),
            last_error,
        })
    }

    /// Calls `f` with a client of the current master, following the leader
    /// under `policy`, each attempt bounded by [`RPC_TIMEOUT`].
    pub async fn call<T, F, Fut>(&mut self, policy: Retry, f: F) -> Result<T, CliError>
    where
        F: FnMut(OperatorClient<Conn>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let deadline = Instant::now() + self.retry_for;
        self.call_until(policy, Some(RPC_TIMEOUT), deadline, f)
            .await
    }

    /// [`Master::call`] with its own limits: `attempt` bounds each try
    /// (`None`: a stream that may take long to open), `deadline` the search
    /// for the leader.
    pub async fn call_until<T, F, Fut>(
        &mut self,
        policy: Retry,
        attempt: Option<Duration>,
        deadline: Instant,
        f: F,
    ) -> Result<T, CliError>
    where
        F: FnMut(OperatorClient<Conn>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        self.call_client(policy, attempt, deadline, operator_client, f)
            .await
    }

    /// Like [`Master::call`] for another service's client, made by `make`
    /// from the connection.
    pub async fn call_service<C, T, F, Fut>(
        &mut self,
        policy: Retry,
        make: fn(Conn) -> C,
        f: F,
    ) -> Result<T, CliError>
    where
        F: FnMut(C) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let deadline = Instant::now() + self.retry_for;
        self.call_client(policy, Some(RPC_TIMEOUT), deadline, make, f)
            .await
    }

    async fn call_client<C, T, F, Fut>(
        &mut self,
        policy: Retry,
        attempt: Option<Duration>,
        deadline: Instant,
        make: fn(Conn) -> C,
        mut f: F,
    ) -> Result<T, CliError>
    where
        F: FnMut(C) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let started = Instant::now();
        let mut deadline = deadline;
        let mut search = LeaderSearch::new(BACKOFF_MIN, BACKOFF_MAX);
        // Some try of a change failed without proof that it was not applied.
        let mut maybe_applied = false;
        loop {
            let call = f(make(self.conn.clone()));
            let result = match attempt {
                Some(limit) => tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
                    Err(Status::deadline_exceeded(format!(
                        "master {} did not answer within {}s",
                        self.addr,
                        limit.as_secs_f64()
                    )))
                }),
                None => call.await,
            };
            let status = match result {
                Ok(response) => return Ok(response.into_inner()),
                Err(status) => status,
            };
            if !may_retry(&status) {
                // The master's own answer: definite for this try, not for
                // the earlier ones.
                return Err(unknown_if(maybe_applied, CliError::rpc(self, status)));
            }
            if policy == Retry::Resend && !maybe_applied && !not_applied(&status) {
                maybe_applied = true;
                let searched = deadline.saturating_duration_since(started);
                deadline = started + searched * UNKNOWN_SEARCH_FACTOR;
            }
            let next = search.next(&self.addr, &status, &self.addrs, |h| parse_address(h).ok());
            if Instant::now() + next.pause >= deadline {
                let gave_up = CliError::GaveUp {
                    secs: deadline
                        .saturating_duration_since(started)
                        .as_secs_f64()
                        .round() as u64,
                    tried: self.addrs.join(", "),
                    last: Box::new(CliError::rpc(self, status)),
                };
                return Err(unknown_if(maybe_applied, gave_up));
            }
            tracing::debug!(
                addr = %self.addr,
                leader = ?next.redirected.then_some(&next.addr),
                error = %status.message(),
                "master cannot serve the call; trying another"
            );
            tokio::time::sleep(next.pause).await;
            self.switch_to(next.addr);
        }
    }

    /// Talks to `addr` from now on (a leader learned from a redirect joins
    /// the list). The connection is made by the next call: if it fails, that
    /// call fails before sending anything, which
    /// [`gpuctl_proto::leader::never_sent`] recognises.
    pub fn switch_to(&mut self, addr: String) {
        let endpoint = match Endpoint::from_shared(format!("http://{addr}")) {
            Ok(e) => e.connect_timeout(CONNECT_TIMEOUT).tcp_nodelay(true),
            Err(e) => {
                // Only a redirect can bring an unchecked address; keep ours.
                tracing::debug!(addr = %addr, error = %e, "ignoring a bad master address");
                return;
            }
        };
        if !self.addrs.contains(&addr) {
            self.addrs.push(addr.clone());
        }
        let channel =
            gpuctl_auth::tls::channel(&endpoint, self.creds.tls.as_ref(), CertRole::Master);
        self.conn = InterceptedService::new(channel, AddToken(self.creds.token.clone()));
        self.client = operator_client(self.conn.clone());
        self.addr = addr;
    }
}

/// `err`, or an unknown outcome ending with it when some try may have
/// been applied.
fn unknown_if(maybe_applied: bool, err: CliError) -> CliError {
    if maybe_applied {
        CliError::unknown(err)
    } else {
        err
    }
}

fn operator_client(channel: Conn) -> OperatorClient<Conn> {
    OperatorClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

async fn connect_one(
    addr: &str,
    timeout: Duration,
    creds: &Credentials,
) -> Result<Channel, String> {
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| error_chain(&e))?
        .connect_timeout(timeout)
        .tcp_nodelay(true);
    // The outer timeout also bounds name resolution.
    let connect = gpuctl_auth::tls::connect(&endpoint, creds.tls.as_ref(), CertRole::Master);
    match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(channel)) => Ok(channel),
        Ok(Err(e)) => Err(error_chain(&e)),
        Err(_) => Err(format!("no answer within {}s", timeout.as_secs_f64())),
    }
}

/// An error and its sources on one line: "transport error: tcp connect
/// error: Connection refused (os error 111)".
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let text = inner.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        source = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_one_address() {
        assert_eq!(
            parse_master_list("127.0.0.1:7050").unwrap().0,
            vec!["127.0.0.1:7050"]
        );
    }

    #[test]
    fn parses_a_list_with_spaces_and_scheme() {
        let l = parse_master_list("m1:7050, http://m2:7051 ,[::1]:7052").unwrap();
        assert_eq!(l.0, vec!["m1:7050", "m2:7051", "[::1]:7052"]);
        assert_eq!(l.to_string(), "m1:7050,m2:7051,[::1]:7052");
    }

    #[test]
    fn rejects_bad_addresses() {
        for bad in [
            "",
            "m1",
            "m1:",
            ":7050",
            "m1:abc",
            "m1:70000",
            "m1:0",
            "m1:7050,",
            "m1:7050,,m2:7050",
            "::1:7050",
        ] {
            assert!(parse_master_list(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[tokio::test]
    async fn connect_error_names_every_address() {
        // Two ports nobody listens on.
        let mut addrs = Vec::new();
        for _ in 0..2 {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            addrs.push(l.local_addr().unwrap().to_string());
        }
        let err = Master::connect_with_timeout(
            &addrs,
            Duration::from_millis(500),
            &Credentials::default(),
        )
        .await
        .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&addrs[0]) && msg.contains(&addrs[1]), "{msg}");
        assert!(!msg.contains('\n'));
    }
}
