//! TLS for tonic servers and channels, with our own rustls configurations
//! (ring only) so that a node's certificate and trusted CAs can be replaced
//! while it serves: an agent renews its certificate, an operator rotates
//! files and the node picks them up, and no connection needs rebuilding by
//! hand. Servers accept through [`incoming`]; channels connect through
//! [`Connector`], which checks that the server holds a certificate of the
//! expected role (its DNS SAN `ROLE.gpuctl`).

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::error::AuthError;
use crate::pki::{certs_from_pem, identity_of, Identity};
use crate::{read, CertRole};

/// Where a daemon listens: `given`, else every interface with TLS and
/// loopback without. Without TLS a non-loopback address is refused unless
/// `insecure`: whoever reaches the port could `why` (the error says so).
pub fn listen_address(
    given: Option<std::net::SocketAddr>,
    tls: bool,
    insecure: bool,
    port: u16,
    why: &str,
) -> Result<std::net::SocketAddr, String> {
    let listen = given.unwrap_or_else(|| {
        let ip = if tls {
            std::net::Ipv4Addr::UNSPECIFIED
        } else {
            std::net::Ipv4Addr::LOCALHOST
        };
        std::net::SocketAddr::from((ip, port))
    });
    if !tls && !listen.ip().is_loopback() && !insecure {
        return Err(format!(
            "listen {listen}: without TLS only a loopback address is served, because anyone \
             who reaches the port could {why}; set tls_dir (see docs/security.md), or listen \
             on 127.0.0.1, or (isolated labs only) insecure = true"
        ));
    }
    Ok(listen)
}

/// How long a TLS handshake may take before the connection is dropped: a
/// client that opens a connection and says nothing must not hold a slot.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a node's key material lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsPaths {
    /// The CA certificates to trust (one PEM file; several during a CA
    /// rotation).
    pub ca: PathBuf,
    /// This node's certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
}

/// Whether a server asks connecting clients for a certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// Every client must present a certificate signed by a trusted CA.
    Required,
    /// A client may connect without one (an agent that has not joined yet);
    /// each call then decides whether it needs one. A certificate that is
    /// presented must still be valid.
    Optional,
}

struct Material {
    roots: Arc<RootCertStore>,
    /// This node's certificate chain and key; none for a client that has
    /// no certificate yet (an agent joining with a token).
    own: Option<(Vec<CertificateDer<'static>>, Arc<PrivateKeyDer<'static>>)>,
    identity: Option<Identity>,
    server: Option<Arc<ServerConfig>>,
    /// The same certificate for browsers (the web console): HTTP/2 or
    /// HTTP/1.1, no client certificate asked (a browser would prompt for
    /// one).
    web: Option<Arc<ServerConfig>>,
    client: Arc<ClientConfig>,
}

/// A node's TLS configuration, replaceable while in use.
pub struct Tls {
    client_auth: ClientAuth,
    paths: Option<TlsPaths>,
    current: RwLock<Arc<Material>>,
    /// Modification times of the files when last loaded.
    loaded: RwLock<Option<[Option<SystemTime>; 3]>>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("identity", &self.identity())
            .field("paths", &self.paths)
            .finish_non_exhaustive()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn key_from_pem(pem: &[u8], what: &str) -> Result<PrivateKeyDer<'static>, AuthError> {
    use rustls::pki_types::pem::PemObject;
    PrivateKeyDer::from_pem_slice(pem)
        .map_err(|e| AuthError::invalid(what, format!("no PEM private key: {e:?}")))
}

fn build(
    ca_pem: &[u8],
    own: Option<(&[u8], &[u8])>,
    client_auth: ClientAuth,
) -> Result<Material, AuthError> {
    let mut roots = RootCertStore::empty();
    for c in certs_from_pem(ca_pem, "CA certificate")? {
        roots
            .add(c)
            .map_err(|e| AuthError::invalid("CA certificate", e))?;
    }
    let roots = Arc::new(roots);
    let own = match own {
        Some((cert_pem, key_pem)) => {
            let chain = certs_from_pem(cert_pem, "certificate")?;
            let key = key_from_pem(key_pem, "key")?;
            Some((chain, Arc::new(key)))
        }
        None => None,
    };
    let identity = match &own {
        Some((chain, _)) => Some(identity_of(&chain[0])?),
        None => None,
    };
    let versions = rustls::DEFAULT_VERSIONS;
    let client_builder = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(versions)?
        .with_root_certificates(roots.clone());
    let mut client = match &own {
        Some((chain, key)) => {
            client_builder.with_client_auth_cert(chain.clone(), key.clone_key())?
        }
        None => client_builder.with_no_client_auth(),
    };
    client.alpn_protocols = vec![b"h2".to_vec()];
    let server = match &own {
        Some((chain, key)) => {
            let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider());
            let verifier = match client_auth {
                ClientAuth::Required => verifier.build(),
                ClientAuth::Optional => verifier.allow_unauthenticated().build(),
            }
            .map_err(|e| AuthError::invalid("CA certificate", e))?;
            let mut server = ServerConfig::builder_with_provider(provider())
                .with_protocol_versions(versions)?
                .with_client_cert_verifier(verifier)
                .with_single_cert(chain.clone(), key.clone_key())?;
            server.alpn_protocols = vec![b"h2".to_vec()];
            Some(Arc::new(server))
        }
        None => None,
    };
    let web = match &own {
        Some((chain, key)) => {
            let mut web = ServerConfig::builder_with_provider(provider())
                .with_protocol_versions(versions)?
                .with_no_client_auth()
                .with_single_cert(chain.clone(), key.clone_key())?;
            web.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
            Some(Arc::new(web))
        }
        None => None,
    };
    Ok(Material {
        roots,
        own,
        identity,
        server: server.clone(),
        web,
        client: Arc::new(client),
    })
}

fn mtime(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

impl Tls {
    /// From PEM text: the trusted CAs and, optionally, this node's
    /// certificate and key.
    pub fn from_pem(
        ca_pem: &[u8],
        own: Option<(&[u8], &[u8])>,
        client_auth: ClientAuth,
    ) -> Result<Tls, AuthError> {
        Ok(Tls {
            client_auth,
            paths: None,
            current: RwLock::new(Arc::new(build(ca_pem, own, client_auth)?)),
            loaded: RwLock::new(None),
        })
    }

    /// From files; [`Tls::reload_if_changed`] picks up new contents.
    pub fn from_files(paths: &TlsPaths, client_auth: ClientAuth) -> Result<Tls, AuthError> {
        let stamps = [mtime(&paths.ca), mtime(&paths.cert), mtime(&paths.key)];
        let material = Self::load(paths, client_auth)?;
        Ok(Tls {
            client_auth,
            paths: Some(paths.clone()),
            current: RwLock::new(Arc::new(material)),
            loaded: RwLock::new(Some(stamps)),
        })
    }

    fn load(paths: &TlsPaths, client_auth: ClientAuth) -> Result<Material, AuthError> {
        let ca = read(&paths.ca)?;
        let cert = read(&paths.cert)?;
        let key = read(&paths.key)?;
        build(&ca, Some((&cert, &key)), client_auth).map_err(|e| match e {
            AuthError::Invalid { what, msg } => AuthError::Invalid {
                what: format!(
                    "{what} (from {}, {}, {})",
                    paths.ca.display(),
                    paths.cert.display(),
                    paths.key.display()
                ),
                msg,
            },
            e => e,
        })
    }

    /// Reloads the files if any changed since they were loaded. Returns
    /// whether it did; on an error the old material stays in use.
    pub fn reload_if_changed(&self) -> Result<bool, AuthError> {
        let Some(paths) = &self.paths else {
            return Ok(false);
        };
        let stamps = [mtime(&paths.ca), mtime(&paths.cert), mtime(&paths.key)];
        if self
            .loaded
            .read()
            .map(|l| *l == Some(stamps))
            .unwrap_or(false)
        {
            return Ok(false);
        }
        let material = Self::load(paths, self.client_auth)?;
        self.swap(material);
        if let Ok(mut l) = self.loaded.write() {
            *l = Some(stamps);
        }
        Ok(true)
    }

    /// Puts a new certificate and key (and CAs) in place: new connections
    /// use them; open ones keep theirs.
    pub fn replace(&self, ca_pem: &[u8], cert_pem: &[u8], key_pem: &[u8]) -> Result<(), AuthError> {
        let material = build(ca_pem, Some((cert_pem, key_pem)), self.client_auth)?;
        self.swap(material);
        Ok(())
    }

    fn swap(&self, material: Material) {
        if let Ok(mut cur) = self.current.write() {
            *cur = Arc::new(material);
        }
    }

    fn material(&self) -> Arc<Material> {
        match self.current.read() {
            Ok(m) => m.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Who this node's certificate says it is (none without a certificate).
    pub fn identity(&self) -> Option<Identity> {
        self.material().identity.clone()
    }

    /// Whether this node has a certificate (else it can only connect
    /// as an anonymous client, to join).
    pub fn has_certificate(&self) -> bool {
        self.material().own.is_some()
    }

    pub fn roots(&self) -> Arc<RootCertStore> {
        self.material().roots.clone()
    }

    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.material().client.clone()
    }

    pub fn server_config(&self) -> Option<Arc<ServerConfig>> {
        self.material().server.clone()
    }

    /// A server configuration with this node's certificate for HTTPS to
    /// browsers: HTTP/2 or HTTP/1.1 by ALPN, no client certificate asked.
    /// Follows reloads like the others.
    pub fn web_server_config(&self) -> Option<Arc<ServerConfig>> {
        self.material().web.clone()
    }
}

/// Watches the files behind `tls` every `every` and reloads them when they
/// change (an operator's rotation), until `stop` says so.
pub fn spawn_reloader(
    tls: Arc<Tls>,
    every: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            if *stop.borrow() {
                return;
            }
            match tls.reload_if_changed() {
                Ok(true) => {
                    tracing::info!(identity = ?tls.identity(), "TLS files changed: reloaded")
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(error = %e, "TLS files changed but cannot be loaded; keeping the old ones")
                }
            }
        }
    })
}

/// The TLS connections accepted on `listener`, handshakes done off the
/// accept loop (a slow client delays no one). Ends when the consumer drops
/// the stream.
pub fn incoming(
    listener: TcpListener,
    tls: Arc<Tls>,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<tokio_rustls::server::TlsStream<TcpStream>>>
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = tx.closed() => return,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: wait, go on.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let Some(config) = tls.server_config() else {
                tracing::error!("TLS server without a certificate: connection dropped");
                continue;
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let acceptor = TlsAcceptor::from(config);
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => tracing::info!(%peer, error = %e, "TLS handshake refused"),
                    Err(_) => tracing::info!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Connects a tonic channel over TLS to a server of role `server`.
#[derive(Clone)]
pub struct Connector {
    tls: Arc<Tls>,
    server: CertRole,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("server", &self.server)
            .finish_non_exhaustive()
    }
}

impl Connector {
    pub fn new(tls: Arc<Tls>, server: CertRole) -> Connector {
        Connector { tls, server }
    }
}

type Io = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;

impl tower_service::Service<http::Uri> for Connector {
    type Response = Io;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Io>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let config = self.tls.client_config();
        let server = self.server;
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "address has no host"))?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let port = uri.port_u16().unwrap_or(80);
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let name = ServerName::try_from(server.server_name())
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            let stream = TlsConnector::from(config).connect(name, tcp).await?;
            Ok(hyper_util::rt::TokioIo::new(stream))
        })
    }
}

/// A lazy channel to `endpoint`: over TLS to a server of role `server`
/// when `tls` is set, in clear otherwise.
pub fn channel(
    endpoint: &tonic::transport::Endpoint,
    tls: Option<&Arc<Tls>>,
    server: CertRole,
) -> tonic::transport::Channel {
    match tls {
        Some(tls) => endpoint.connect_with_connector_lazy(Connector::new(tls.clone(), server)),
        None => endpoint.connect_lazy(),
    }
}

/// Connects now (not lazily): like [`channel`], failing if the server
/// cannot be reached or refuses the handshake.
pub async fn connect(
    endpoint: &tonic::transport::Endpoint,
    tls: Option<&Arc<Tls>>,
    server: CertRole,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    match tls {
        Some(tls) => {
            endpoint
                .connect_with_connector(Connector::new(tls.clone(), server))
                .await
        }
        None => endpoint.connect().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_tls_only_loopback_is_served() {
        let l = |given: Option<&str>, tls, insecure| {
            listen_address(given.map(|g| g.parse().unwrap()), tls, insecure, 7050, "x")
        };
        assert_eq!(l(None, false, false).unwrap().to_string(), "127.0.0.1:7050");
        assert_eq!(l(None, true, false).unwrap().to_string(), "0.0.0.0:7050");
        assert!(l(Some("[::1]:1"), false, false).is_ok());
        let e = l(Some("0.0.0.0:1"), false, false).unwrap_err();
        assert!(e.contains("tls_dir") && e.contains("could x"), "{e}");
        assert!(l(Some("0.0.0.0:1"), false, true).is_ok());
        assert!(l(Some("10.0.0.1:1"), true, false).is_ok());
    }
}
