//! The console's way into the cluster: a gRPC client of the masters' API,
//! like gpuctl. Every browser request becomes calls of the Operator and
//! Access services carrying the browser's token, so the masters' auth
//! layer decides what the browser may do, exactly as for gpuctl.
//!
//! Only the leader serves the API; the client starts at the leader this
//! master knows of and follows redirects (`gpuctl_proto::leader`) as
//! gpuctl does, so a console on a follower works, and goes on working
//! when the leader changes.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use std::path::PathBuf;

use gpuctl_auth::pki::Ca;
use gpuctl_auth::tls::{ClientAuth, Tls};
use gpuctl_auth::CertRole;
use gpuctl_proto::follow::{Connect, Follower, Policy, Retry};
use gpuctl_proto::leader::NextTry;
use tokio::time::Instant;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Channel, Endpoint};
use tonic::Status;

/// How long a call keeps looking for the leader before it reports the
/// last error (gpuctl's `LEADER_DEADLINE`).
pub const LEADER_DEADLINE: Duration = Duration::from_secs(15);
/// Longest one attempt of an ordinary call may take.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Lifetime of the client certificate a master with the CA key makes for
/// its console; a new one is made after a third of it.
const CONSOLE_CERT_TTL: Duration = Duration::from_secs(24 * 3600);

/// Largest answer the console accepts from a master (a big job list).
const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// The Operator service on `channel`, as the console calls it.
pub fn operator(channel: Channel) -> gpuctl_proto::pb::operator_client::OperatorClient<Channel> {
    gpuctl_proto::pb::operator_client::OperatorClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
}

/// The Access service on `channel`, as the console calls it.
pub fn access(channel: Channel) -> gpuctl_proto::pb::access_client::AccessClient<Channel> {
    gpuctl_proto::pb::access_client::AccessClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
}

/// The master API addresses to try, best first (the leader when known).
pub type AddressBook = Arc<dyn Fn() -> Vec<String> + Send + Sync>;

/// Why the console cannot get a client certificate.
#[derive(Debug, thiserror::Error)]
pub enum CredsError {
    #[error(
        "the web console needs a client certificate to call the API over TLS: this master has \
         no CA key to make one, and {cert} / {key} cannot be read ({reason}); make them with \
         `gpuctl certs issue --dir DIR --role client --name console --out {dir}` (see docs/console.md)"
    )]
    NoCertificate {
        cert: String,
        key: String,
        dir: String,
        reason: String,
    },
    #[error("the web console's client certificate: {0}")]
    Auth(#[from] gpuctl_auth::AuthError),
    #[error("the cluster CA file: {0}")]
    Io(#[from] std::io::Error),
}

/// What the console's TLS is made of, handed over by the master it runs in.
pub struct Credentials {
    /// The master's own TLS: browsers are served its certificate.
    pub server: Arc<Tls>,
    /// The cluster CA file, trusted by the console's client (during a CA
    /// rotation it holds the old and the new CA).
    pub ca_file: PathBuf,
    /// Where `console.crt` and `console.key` are looked for when there is
    /// no CA key (beside the master's own certificate).
    pub cert_dir: PathBuf,
    /// The cluster CA with its key, when the master has it: the console
    /// then makes its own client certificate.
    pub ca: Option<Arc<Ca>>,
    /// Names that certificate (`console-<node id>`).
    pub node_id: u64,
}

/// The console's TLS as a client: a certificate of role client made with
/// the CA key (`gpuctl://client/console-<node id>`, made again in memory
/// after a third of its life), or else `console.crt` and `console.key` in
/// [`Credentials::cert_dir`] (reloaded when they change). The certificate
/// only opens the connection: what a call may do comes from the browser's
/// token.
pub fn console_tls(
    creds: Arc<Credentials>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(Arc<Tls>, tokio::task::JoinHandle<()>), CredsError> {
    if creds.ca.is_some() {
        let (ca, cert, key) = mint(&creds)?;
        let tls = Arc::new(Tls::from_pem(
            ca.as_bytes(),
            Some((cert.as_bytes(), key.as_bytes())),
            ClientAuth::Required,
        )?);
        let task = tokio::spawn(renew(tls.clone(), creds, stop));
        return Ok((tls, task));
    }
    let dir = &creds.cert_dir;
    let paths = gpuctl_auth::tls::TlsPaths {
        ca: creds.ca_file.clone(),
        cert: dir.join("console.crt"),
        key: dir.join("console.key"),
    };
    let tls =
        Tls::from_files(&paths, ClientAuth::Required).map_err(|e| CredsError::NoCertificate {
            cert: paths.cert.display().to_string(),
            key: paths.key.display().to_string(),
            dir: dir.display().to_string(),
            reason: e.to_string(),
        })?;
    let tls = Arc::new(tls);
    let task = gpuctl_auth::tls::spawn_reloader(tls.clone(), Duration::from_secs(30), stop);
    Ok((tls, task))
}

/// A new console certificate: the CA bundle to trust, the certificate and
/// its key, in PEM.
fn mint(creds: &Credentials) -> Result<(String, String, String), CredsError> {
    let ca = creds
        .ca
        .as_ref()
        .ok_or_else(|| gpuctl_auth::AuthError::Invalid {
            what: "CA key".into(),
            msg: "this master has none".into(),
        })?;
    let issued = ca.issue(
        CertRole::Client,
        &format!("console-{}", creds.node_id),
        CONSOLE_CERT_TTL,
        &[],
    )?;
    // The trusted file as it is now: during a CA rotation it holds both.
    let bundle = std::fs::read_to_string(&creds.ca_file)?;
    Ok((bundle, issued.cert_pem, issued.key_pem.unwrap_or_default()))
}

/// Makes a new certificate after each third of the old one's life; open
/// connections keep theirs, new ones use the new one.
async fn renew(
    tls: Arc<Tls>,
    creds: Arc<Credentials>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(CONSOLE_CERT_TTL / 3) => {}
            _ = stop.changed() => return,
        }
        let renewed = mint(&creds).and_then(|(ca, cert, key)| {
            Ok(tls.replace(ca.as_bytes(), cert.as_bytes(), key.as_bytes())?)
        });
        match renewed {
            Ok(()) => tracing::info!("web console: client certificate renewed"),
            Err(e) => {
                tracing::error!(error = %e, "web console: cannot renew its client certificate")
            }
        }
    }
}

/// A gRPC client of the masters that follows the leader and carries each
/// browser request's token.
pub struct Gateway {
    addresses: AddressBook,
    tls: Option<Arc<Tls>>,
    /// One channel per master address (HTTP/2: calls share it), and the
    /// search for the leader. It holds no token: each request carries its
    /// browser's own ([`Token::request`]).
    follower: Follower,
    pub deadline: Duration,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

/// The browser's credentials for one call: its `Authorization` header.
#[derive(Clone, Default)]
pub struct Token(pub Option<MetadataValue<Ascii>>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Token(<hidden>)"
        } else {
            "Token(none)"
        })
    }
}

impl Token {
    /// `msg` as a request carrying the token.
    pub fn request<M>(&self, msg: M) -> tonic::Request<M> {
        let mut req = tonic::Request::new(msg);
        if let Some(t) = &self.0 {
            req.metadata_mut().insert("authorization", t.clone());
        }
        req
    }
}

/// A call that did not succeed: the master's answer, or the last one when
/// no master could serve it in time.
#[derive(Debug)]
pub struct CallError {
    pub status: Status,
    /// The master that answered last.
    pub addr: String,
    /// Gave up looking for the leader after this long.
    pub gave_up_after: Option<Duration>,
    /// Some try failed without proof that nothing was applied
    /// (`gpuctl_proto::leader::not_applied`): for a change, its outcome is
    /// unknown.
    pub maybe_applied: bool,
}

impl Gateway {
    pub fn new(addresses: AddressBook, tls: Option<Arc<Tls>>) -> Gateway {
        let follower = Follower::new(Vec::new(), connector(tls.clone()), POLICY);
        // The console's certificate is renewed in place (minted, or
        // reloaded from console.crt); the master refuses calls on a
        // connection whose certificate expired, so a renewal needs new
        // connections.
        let follower = match &tls {
            Some(t) => {
                let t = t.clone();
                follower.with_epoch(Arc::new(move || t.identity().map_or(0, |i| i.not_after_ms)))
            }
            None => follower,
        };
        Gateway {
            addresses,
            follower,
            tls,
            deadline: LEADER_DEADLINE,
        }
    }

    /// Calls `f` on a channel to the leader, following redirects, until
    /// it succeeds, fails with an answer that another master would give
    /// too, or [`Gateway::deadline`] passes; each attempt bounded by
    /// `attempt` (`None`: a stream that may take long to open). Only calls
    /// that are safe to send twice come here: reads, cancel, and submit
    /// with its idempotency key.
    pub async fn call<T, F, Fut>(&self, attempt: Option<Duration>, f: F) -> Result<T, CallError>
    where
        F: FnMut(Channel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let deadline = Instant::now() + self.deadline;
        // Read again for every call: the leader this master knows now.
        let addrs = (self.addresses)();
        if addrs.is_empty() {
            return Err(CallError {
                status: Status::unavailable("this master knows no master address"),
                addr: String::new(),
                gave_up_after: None,
                maybe_applied: false,
            });
        }
        self.follower
            .call_among(addrs, Retry::Always, attempt, deadline, f)
            .await
            .map_err(|e| CallError {
                status: e.status,
                addr: e.addr,
                gave_up_after: e.searched_for.map(|_| e.elapsed),
                maybe_applied: e.maybe_applied,
            })
    }
}

/// How the console follows the leader: any hint is followed, channels are
/// kept per master (dropped after a transport error), and a failure that
/// may have been applied is reported (`CallError::maybe_applied`) without
/// searching longer.
const POLICY: Policy = Policy {
    backoff_min: BACKOFF_MIN,
    backoff_max: BACKOFF_MAX,
    unknown_search_factor: 1,
    accept_hint: accept_any_hint,
    cache_channels: true,
    on_retry: log_retry,
};

fn accept_any_hint(hint: &str) -> Option<String> {
    Some(hint.to_string())
}

fn log_retry(addr: &str, next: &NextTry, status: &Status) {
    tracing::debug!(%addr, next = %next.addr, error = %status.message(), "console: master cannot serve the call; trying another");
}

/// Lazy channels to the masters, with the console's client certificate
/// when TLS is on.
fn connector(tls: Option<Arc<Tls>>) -> Connect {
    Arc::new(move |addr: &str| {
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| Status::invalid_argument(format!("master address {addr:?}: {e}")))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true);
        Ok(gpuctl_auth::tls::channel(
            &endpoint,
            tls.as_ref(),
            CertRole::Master,
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A master's TLS dir as `gpuctl certs init` writes it, and the
    /// credentials a master hands its console, with or without the CA key.
    fn credentials(dir: &std::path::Path, with_ca_key: bool) -> Arc<Credentials> {
        let ca = Ca::generate("test", Duration::from_secs(3600)).unwrap();
        let master = ca
            .issue(CertRole::Master, "1", Duration::from_secs(3600), &[])
            .unwrap();
        std::fs::write(dir.join("ca.crt"), ca.cert_pem()).unwrap();
        std::fs::write(dir.join("ca.key"), ca.key_pem()).unwrap();
        std::fs::write(dir.join("master-1.crt"), &master.cert_pem).unwrap();
        std::fs::write(dir.join("master-1.key"), master.key_pem.unwrap()).unwrap();
        let paths = gpuctl_auth::tls::TlsPaths {
            ca: dir.join("ca.crt"),
            cert: dir.join("master-1.crt"),
            key: dir.join("master-1.key"),
        };
        let server = Tls::from_files(&paths, ClientAuth::Optional).unwrap();
        Arc::new(Credentials {
            server: Arc::new(server),
            ca_file: paths.ca,
            cert_dir: dir.to_path_buf(),
            ca: with_ca_key.then(|| Arc::new(ca)),
            node_id: 1,
        })
    }

    use gpuctl_proto::pb;
    use tonic::{Request, Response};

    /// A master's Access service that either answers WhoAmI with its name
    /// and the token it got, or redirects to `leader`.
    struct FakeMaster {
        name: &'static str,
        leader: Option<String>,
    }

    type Answer<T> = Result<Response<T>, Status>;

    #[tonic::async_trait]
    impl pb::access_server::Access for FakeMaster {
        async fn who_am_i(&self, req: Request<pb::WhoAmIRequest>) -> Answer<pb::WhoAmIResponse> {
            if let Some(l) = &self.leader {
                return Err(gpuctl_proto::leader::not_leader(Some((1, l))));
            }
            let token = req
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            Ok(Response::new(pb::WhoAmIResponse {
                kind: format!("{} {token}", self.name),
                ..Default::default()
            }))
        }
        async fn create_token(
            &self,
            _: Request<pb::CreateTokenRequest>,
        ) -> Answer<pb::CreateTokenResponse> {
            Err(Status::unimplemented(""))
        }
        async fn list_tokens(
            &self,
            _: Request<pb::ListTokensRequest>,
        ) -> Answer<pb::ListTokensResponse> {
            Err(Status::unimplemented(""))
        }
        async fn revoke_token(&self, _: Request<pb::RevokeTokenRequest>) -> Answer<pb::TokenInfo> {
            Err(Status::unimplemented(""))
        }
        async fn set_quota(&self, _: Request<pb::SetQuotaRequest>) -> Answer<pb::TenantQuota> {
            Err(Status::unimplemented(""))
        }
        async fn list_quotas(
            &self,
            _: Request<pb::ListQuotasRequest>,
        ) -> Answer<pb::ListQuotasResponse> {
            Err(Status::permission_denied(
                "a join token cannot call ListQuotas",
            ))
        }
    }

    async fn serve(name: &'static str, leader: Option<String>) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let svc = pb::access_server::AccessServer::new(FakeMaster { name, leader });
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
        );
        addr
    }

    async fn who(gw: &Gateway, token: &'static str) -> Result<String, CallError> {
        let t = Token(Some(MetadataValue::from_static(token)));
        let r = gw
            .call(Some(RPC_TIMEOUT), |c| {
                let req = t.request(pb::WhoAmIRequest {});
                async move { pb::access_client::AccessClient::new(c).who_am_i(req).await }
            })
            .await?;
        Ok(r.kind)
    }

    #[tokio::test]
    async fn calls_follow_the_leaders_redirect_with_the_token() {
        let leader = serve("leader", None).await;
        let follower = serve("follower", Some(leader.clone())).await;
        // A master that is down, first in the book: the next one is tried.
        let down = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        let book: AddressBook = Arc::new(move || vec![down.clone(), follower.clone()]);
        let gw = Gateway::new(book, None);
        assert_eq!(
            who(&gw, "Bearer gct_a").await.unwrap(),
            "leader Bearer gct_a"
        );
        // A master's own refusal is the answer: not retried elsewhere.
        let e = gw
            .call(Some(RPC_TIMEOUT), |c| async move {
                pb::access_client::AccessClient::new(c)
                    .list_quotas(pb::ListQuotasRequest {})
                    .await
            })
            .await
            .unwrap_err();
        assert_eq!(e.status.code(), tonic::Code::PermissionDenied);
        assert_eq!(e.gave_up_after, None);
    }

    #[tokio::test]
    async fn without_a_leader_the_call_gives_up_at_its_deadline() {
        // A follower naming a leader that is down.
        let follower = serve("follower", Some("127.0.0.1:9".into())).await;
        let book: AddressBook = Arc::new(move || vec![follower.clone()]);
        let mut gw = Gateway::new(book, None);
        gw.deadline = Duration::from_millis(800);
        let e = who(&gw, "Bearer x").await.unwrap_err();
        assert_eq!(e.status.code(), tonic::Code::Unavailable);
        assert!(e.gave_up_after.is_some(), "{e:?}");
    }

    #[tokio::test]
    async fn a_master_with_the_ca_key_makes_its_consoles_client_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let (_stop_tx, stop) = tokio::sync::watch::channel(false);
        let (tls, task) = console_tls(credentials(dir.path(), true), stop).unwrap();
        let id = tls.identity().unwrap();
        assert_eq!((id.role, id.name.as_str()), (CertRole::Client, "console-1"));
        task.abort();
    }

    #[tokio::test]
    async fn without_the_ca_key_it_reads_console_crt_or_says_how_to_make_it() {
        let dir = tempfile::tempdir().unwrap();
        let creds = credentials(dir.path(), false);
        let (_stop_tx, stop) = tokio::sync::watch::channel(false);
        let e = console_tls(creds.clone(), stop.clone())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("console.crt")
                && e.contains("gpuctl certs issue")
                && e.contains("--role client"),
            "{e}"
        );
        let ca = Ca::load(&dir.path().join("ca.crt"), &dir.path().join("ca.key")).unwrap();
        let c = ca
            .issue(CertRole::Client, "console", Duration::from_secs(3600), &[])
            .unwrap();
        std::fs::write(dir.path().join("console.crt"), &c.cert_pem).unwrap();
        std::fs::write(dir.path().join("console.key"), c.key_pem.unwrap()).unwrap();
        let (tls, task) = console_tls(creds, stop).unwrap();
        assert_eq!(tls.identity().unwrap().name, "console");
        task.abort();
    }
}
