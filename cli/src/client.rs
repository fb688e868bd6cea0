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

use gpuctl_proto::follow::{CallError, Connect, Follower, Policy};
use gpuctl_proto::leader::NextTry;
use std::sync::Arc;

use gpuctl_auth::tls::Tls;
use gpuctl_auth::CertRole;
use gpuctl_proto::pb::operator_client::OperatorClient;
use tokio::time::Instant;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::Status;

use crate::error::{CliError, ConnectError};

/// The default `--master`.
pub const DEFAULT_MASTER: &str = "127.0.0.1:7050";

/// How long one address may take to accept a connection before the next is tried.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a call keeps looking for the leader (redirects, an election, a
/// master down) before it reports the last error.
pub const LEADER_DEADLINE: Duration = Duration::from_secs(15);

/// Longest one attempt of an ordinary change may take.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one attempt of a call may take: a read moves on from a master
/// that does not answer (a frozen leader) after
/// [`gpuctl_proto::follow::READ_ATTEMPT`]; a change waits longer for its
/// commit.
pub fn attempt_limit(policy: Retry) -> Duration {
    match policy {
        Retry::Always => gpuctl_proto::follow::READ_ATTEMPT,
        Retry::Resend => RPC_TIMEOUT,
    }
}

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

/// When a failed call may be sent again (to the leader, or later):
/// [`Retry::Always`] for a read; [`Retry::Resend`] for a change that is
/// safe to send again (idempotent: a cancel, a cordon, a quota set, adding
/// a master by its id; or a create that carries a request id, which the
/// master dedupes). A `Resend` that fails in the end after a try that may
/// have been applied (the failure proves nothing: a connection lost
/// mid-call, no answer in time, a leader deposed while committing) has an
/// unknown outcome ([`CliError::Unknown`], exit 4), never an ordinary
/// failure; and from such a try on it looks for a leader
/// [`UNKNOWN_SEARCH_FACTOR`] times longer, since giving up then leaves the
/// user guessing.
pub use gpuctl_proto::follow::Retry;

/// How much longer a change keeps looking for a leader once a try may have
/// been applied: 15 s becomes 60 s, time for an election and the new
/// leader's catch-up to end well inside it.
pub const UNKNOWN_SEARCH_FACTOR: u32 = 4;

/// Whether a call that failed with `status` is sent again, to another
/// master or later (under either [`Retry`]: they differ in how a final
/// failure is reported). A master dying mid-call breaks the connection
/// with whatever code the transport error maps to ("h2 protocol error":
/// Unknown).
pub fn may_retry(status: &Status) -> bool {
    gpuctl_proto::leader::may_retry(status)
}

/// Whether the failure proves the call was not applied: the master said it
/// refused before proposing (a redirect, no leader elected yet, a new leader
/// still catching up), a full proposal queue, or a connection that was never
/// made. A leader's "leadership lost while committing" carries no such mark:
/// it may still commit.
#[cfg(test)]
pub fn not_applied(status: &Status) -> bool {
    gpuctl_proto::leader::not_applied(status)
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

/// A connected Operator client and the address it talks to: a facade over
/// [`Follower`], which follows the leader.
#[derive(Debug, Clone)]
pub struct Master {
    /// Every address of `--master`, leaders learned from redirects, the
    /// one calls go to now, and its connection.
    follower: Follower,
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
                    let follower = Follower::new(addrs.to_vec(), connector(creds), POLICY);
                    follower.seed(addr, channel);
                    return Ok(Master {
                        follower,
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

    /// The address calls go to now.
    pub fn addr(&self) -> String {
        self.follower.current_addr()
    }

    /// Every address of `--master`, and leaders learned from redirects.
    #[cfg(test)]
    pub fn addrs(&self) -> Vec<String> {
        self.follower.addrs()
    }

    /// Replaces the known addresses (the current one stays).
    #[cfg(test)]
    pub fn set_addrs(&mut self, addrs: Vec<String>) {
        self.follower.set_addrs(addrs)
    }

    /// The connection to the current master, carrying the credentials,
    /// for the other services' clients.
    pub fn conn(&self) -> Result<Conn, CliError> {
        match self.follower.current() {
            Ok((_, channel)) => Ok(InterceptedService::new(
                channel,
                AddToken(self.creds.token.clone()),
            )),
            Err(status) => Err(CliError::rpc(self.addr(), status)),
        }
    }

    /// An Operator client of the current master.
    pub fn client(&self) -> Result<OperatorClient<Conn>, CliError> {
        self.conn().map(operator_client)
    }

    /// Calls `f` with a client of the current master, following the leader
    /// under `policy`, each attempt bounded by [`attempt_limit`].
    pub async fn call<T, F, Fut>(&mut self, policy: Retry, f: F) -> Result<T, CliError>
    where
        F: FnMut(OperatorClient<Conn>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let deadline = Instant::now() + self.retry_for;
        self.call_until(policy, Some(attempt_limit(policy)), deadline, f)
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
        self.call_client(policy, Some(attempt_limit(policy)), deadline, make, f)
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
        let token = self.creds.token.clone();
        let call = |channel| {
            f(make(InterceptedService::new(
                channel,
                AddToken(token.clone()),
            )))
        };
        self.follower
            .call(policy, attempt, deadline, call)
            .await
            .map_err(|e| cli_error(policy, e))
    }

    /// Talks to `addr` from now on (a leader learned from a redirect joins
    /// the list). The connection is made by the next call: if it fails, that
    /// call fails before sending anything, which
    /// [`gpuctl_proto::leader::never_sent`] recognises. A bad address (only
    /// a redirect can bring an unchecked one) is ignored: ours is kept.
    pub fn switch_to(&mut self, addr: String) {
        // The connector logged why it refused the address.
        let _ = self.follower.switch_to(&addr);
    }
}

/// How gpuctl follows the leader.
const POLICY: Policy = Policy {
    backoff_min: BACKOFF_MIN,
    backoff_max: BACKOFF_MAX,
    unknown_search_factor: UNKNOWN_SEARCH_FACTOR,
    accept_hint,
    // A new channel on every move to another master (or to the same one
    // again after a failure).
    cache_channels: false,
    on_retry: log_retry,
};

fn accept_hint(hint: &str) -> Option<String> {
    parse_address(hint).ok()
}

fn log_retry(addr: &str, next: &NextTry, status: &Status) {
    tracing::debug!(
        addr = %addr,
        leader = ?next.redirected.then_some(&next.addr),
        error = %status.message(),
        "master cannot serve the call; trying another"
    );
}

/// Lazy channels to the masters, over TLS with the client certificate when
/// there is one.
fn connector(creds: &Credentials) -> Connect {
    let tls = creds.tls.clone();
    Arc::new(move |addr: &str| {
        let endpoint = match Endpoint::from_shared(format!("http://{addr}")) {
            Ok(e) => e.connect_timeout(CONNECT_TIMEOUT).tcp_nodelay(true),
            Err(e) => {
                // Only a redirect can bring an unchecked address; keep ours.
                tracing::debug!(addr = %addr, error = %e, "ignoring a bad master address");
                return Err(Status::invalid_argument(format!(
                    "master address {addr:?}: {e}"
                )));
            }
        };
        Ok(gpuctl_auth::tls::channel(
            &endpoint,
            tls.as_ref(),
            CertRole::Master,
        ))
    })
}

/// The CLI's error for a call that failed: the master's answer, or the
/// last one when the search gave up; an unknown outcome when a change
/// ([`Retry::Resend`]) may have been applied by some try.
fn cli_error(policy: Retry, e: CallError) -> CliError {
    let last = CliError::Rpc {
        addr: e.addr,
        status: e.status,
    };
    let err = match e.searched_for {
        None => last,
        Some(searched) => CliError::GaveUp {
            secs: searched.as_secs_f64().round() as u64,
            tried: e.tried.join(", "),
            last: Box::new(last),
        },
    };
    unknown_if(policy == Retry::Resend && e.maybe_applied, err)
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
