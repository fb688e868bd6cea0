//! The web console (the master's `--http-listen`, docs/console.md): three
//! static files (`console/static/`: index.html, app.js, style.css, built
//! into the binary, no JavaScript toolchain) and a JSON gateway under `/api`
//! (api.rs, services.rs) that is a gRPC client of the cluster like gpuctl
//! (client.rs): the browser's token goes with every call, so the masters'
//! auth layer decides what it may see and do, and the gateway follows the
//! leader.
//!
//! HTTPS with this master's certificate when TLS is configured (browsers
//! must trust the cluster CA and the certificate must name the host they
//! use), plain HTTP on loopback otherwise (the master's config checks).
//!
//! It knows nothing of the master it runs in but what [`spawn`] is given:
//! the masters' addresses to try ([`AddressBook`]) and the TLS credentials
//! ([`Credentials`]). HTTP/2 where the
//! browser speaks it (over TLS): a page with its log streams then holds one
//! connection, not one of the six HTTP/1.1 allows per host.

pub mod api;
pub mod client;
pub mod json;
pub mod logs;
pub mod services;
#[cfg(test)]
mod testkit;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use gpuctl_auth::tls::Tls;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;

use api::ApiError;
use client::Gateway;
pub use client::{AddressBook, Credentials, CredsError};

/// Connections served at once; more wait in the kernel's backlog.
const MAX_CONNECTIONS: usize = 256;
/// Requests (log streams included) at once on one HTTP/2 connection.
const MAX_STREAMS: u32 = 64;
/// How long a client may take to send a request's headers, and a TLS
/// handshake: a silent connection must not hold a slot.
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

const INDEX_HTML: &str = include_str!("../static/index.html");
const APP_JS: &str = include_str!("../static/app.js");
const STYLE_CSS: &str = include_str!("../static/style.css");

/// Same-origin only: no inline script, nothing from elsewhere, no framing.
const CSP: &str = "default-src 'self'; img-src 'self' data:; object-src 'none'; \
                   base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// The console of a running master.
pub struct Console {
    /// Where it listens (the bound address: a port 0 resolved).
    pub addr: SocketAddr,
    /// Its tasks, aborted when the master stops.
    pub tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// Why the console cannot start.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    #[error("listen on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Credentials(#[from] CredsError),
}

/// Binds `listen` (a bad or taken address fails the master's start) and
/// serves the console until `stop` turns true.
pub async fn spawn(
    listen: SocketAddr,
    addresses: AddressBook,
    credentials: Option<Arc<Credentials>>,
    stop: watch::Receiver<bool>,
) -> Result<Console, ConsoleError> {
    let mut tasks = Vec::new();
    let (client_tls, server_tls) = match credentials {
        Some(creds) => {
            let server = creds.server.clone();
            let (tls, task) = client::console_tls(creds, stop.clone())?;
            tasks.push(task);
            (Some(tls), Some(server))
        }
        None => (None, None),
    };
    let gateway = Arc::new(Gateway::new(addresses, client_tls));
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| ConsoleError::Listen {
            addr: listen.to_string(),
            source,
        })?;
    let addr = listener.local_addr().unwrap_or(listen);
    let checks = Arc::new(Checks {
        loopback_host_only: server_tls.is_none() && addr.ip().is_loopback(),
    });
    let app = router(gateway, checks);
    let scheme = if server_tls.is_some() {
        "https"
    } else {
        "http"
    };
    tracing::info!(url = %format!("{scheme}://{addr}/"), "serving the web console");
    tasks.push(tokio::spawn(accept_loop(listener, app, server_tls, stop)));
    Ok(Console { addr, tasks })
}

/// What the checks on each request need to know.
#[derive(Debug)]
struct Checks {
    /// Plain HTTP on loopback: only requests naming a loopback host are
    /// served, so that a web page cannot reach the console through a name
    /// of its own that resolves to 127.0.0.1 (DNS rebinding).
    loopback_host_only: bool,
}

#[cfg(test)]
fn router_for_tests(gateway: Arc<Gateway>, loopback_host_only: bool) -> Router {
    router(gateway, Arc::new(Checks { loopback_host_only }))
}

fn router(gateway: Arc<Gateway>, checks: Arc<Checks>) -> Router {
    let page = |body: &'static str, content_type: &'static str| {
        get(move || async move { ([(header::CONTENT_TYPE, content_type)], body) })
    };
    Router::new()
        .route("/", page(INDEX_HTML, "text/html; charset=utf-8"))
        .route("/app.js", page(APP_JS, "text/javascript; charset=utf-8"))
        .route("/style.css", page(STYLE_CSS, "text/css; charset=utf-8"))
        .route("/favicon.ico", get(|| async { StatusCode::NO_CONTENT }))
        .merge(api::routes(gateway.clone()))
        .merge(services::routes(gateway))
        .layer(DefaultBodyLimit::max(api::MAX_BODY))
        .layer(axum::middleware::from_fn(move |req, next| {
            let checks = checks.clone();
            async move { guard(&checks, req, next).await }
        }))
}

/// The host part of a `Host` header or an origin's authority.
fn host_of(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    authority.rsplit_once(':').map_or(authority, |(h, _)| h)
}

fn is_loopback_host(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Refuses what a browser must not be tricked into sending, then adds the
/// headers every answer carries.
async fn guard(checks: &Checks, req: Request, next: Next) -> Response {
    let h = req.headers();
    // HTTP/2 carries the host in the URI (`:authority`), HTTP/1.1 in Host.
    let host = h
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().authority().map(|a| a.to_string()))
        .unwrap_or_default();
    let refusal = if checks.loopback_host_only && !is_loopback_host(host_of(&host)) {
        Some(ApiError::Forbidden(format!(
            "this console serves loopback names only (127.0.0.1, localhost), not {host:?}"
        )))
    } else if req.method() == Method::POST {
        // A form of another site may post text/plain without asking; JSON
        // from another origin needs a preflight, which is not answered.
        let json = h
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|t| t.trim_start().starts_with("application/json"));
        let origin = h.get(header::ORIGIN).and_then(|v| v.to_str().ok());
        let same_origin = origin.is_none_or(|o| {
            o.split_once("://")
                .is_some_and(|(_, authority)| authority.eq_ignore_ascii_case(&host))
        });
        if !json {
            Some(ApiError::UnsupportedMediaType(
                "send the request's body as application/json".into(),
            ))
        } else if !same_origin {
            Some(ApiError::Forbidden(format!(
                "a request from another origin ({}) is refused",
                origin.unwrap_or_default()
            )))
        } else {
            None
        }
    } else {
        None
    };
    let mut resp = match refusal {
        Some(e) => e.into_response(),
        None => next.run(req).await,
    };
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    resp
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    tls: Option<Arc<Tls>>,
    mut stop: watch::Receiver<bool>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => s,
            _ = stop.wait_for(|s| *s) => return,
        };
        let Ok(slot) = slot else { return };
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.wait_for(|s| *s) => return,
        };
        let (tcp, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors and the like: wait, go on.
                tracing::warn!(error = %e, "console: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let (app, tls, stop) = (app.clone(), tls.clone(), stop.clone());
        tokio::spawn(async move {
            let _slot = slot;
            match tls {
                None => serve_connection(tcp, app, stop).await,
                Some(tls) => {
                    let Some(config) = tls.web_server_config() else {
                        return;
                    };
                    let acceptor = tokio_rustls::TlsAcceptor::from(config);
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => serve_connection(stream, app, stop).await,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "console: TLS handshake refused")
                        }
                        Err(_) => tracing::debug!(%peer, "console: TLS handshake timed out"),
                    }
                }
            }
        });
    }
}

async fn serve_connection<I>(io: I, app: Router, mut stop: watch::Receiver<bool>)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper_util::service::TowerToHyperService::new(app);
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS);
    let conn = builder.serve_connection(TokioIo::new(io), service);
    tokio::select! {
        r = conn => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "console: connection ended with an error");
            }
        }
        // A log stream may be open for hours: end it with the master.
        _ = stop.wait_for(|s| *s) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower_service::Service as _;

    fn app(loopback_only: bool) -> Router {
        let book: AddressBook = Arc::new(Vec::new);
        router_for_tests(Arc::new(Gateway::new(book, None)), loopback_only)
    }

    async fn send(
        app: &mut Router,
        req: axum::http::Request<axum::body::Body>,
    ) -> (StatusCode, String, Response) {
        let resp = app.call(req).await.unwrap();
        let status = resp.status();
        let (parts, body) = resp.into_parts();
        let body = axum::body::to_bytes(body, 1 << 22).await.unwrap();
        let text = String::from_utf8_lossy(&body).into_owned();
        (
            status,
            text,
            Response::from_parts(parts, axum::body::Body::empty()),
        )
    }

    fn get(path: &str, host: &str) -> axum::http::Request<axum::body::Body> {
        axum::http::Request::get(path)
            .header(header::HOST, host)
            .body(axum::body::Body::empty())
            .unwrap()
    }

    #[tokio::test]
    async fn the_pages_are_served_with_their_types_and_headers() {
        let mut app = app(true);
        for (path, ty) in [
            ("/", "text/html"),
            ("/app.js", "text/javascript"),
            ("/style.css", "text/css"),
        ] {
            let (status, body, resp) = send(&mut app, get(path, "127.0.0.1:8080")).await;
            assert_eq!(status, StatusCode::OK, "{path}");
            assert!(!body.is_empty());
            let h = resp.headers();
            assert!(
                h[header::CONTENT_TYPE].to_str().unwrap().starts_with(ty),
                "{path}"
            );
            assert!(h[header::CONTENT_SECURITY_POLICY]
                .to_str()
                .unwrap()
                .contains("default-src 'self'"));
            assert_eq!(h[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
        }
        let (status, body, _) = send(&mut app, get("/api/nothing", "localhost:1")).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(body, r#"{"error":"no such API call"}"#);
    }

    #[tokio::test]
    async fn a_loopback_console_answers_loopback_names_only() {
        let mut app = app(true);
        for host in [
            "127.0.0.1:8080",
            "localhost:8080",
            "[::1]:8080",
            "LOCALHOST",
        ] {
            let (status, _, _) = send(&mut app, get("/", host)).await;
            assert_eq!(status, StatusCode::OK, "{host}");
        }
        let (status, body, _) = send(&mut app, get("/api/jobs", "evil.example:8080")).await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        assert!(body.contains("evil.example"), "{body}");
        // Behind TLS, or insecure on another address, any name is served.
        let (status, _, _) = send(&mut app_any(), get("/", "console.example:443")).await;
        assert_eq!(status, StatusCode::OK);
    }

    fn app_any() -> Router {
        app(false)
    }

    fn post(
        path: &str,
        content_type: Option<&str>,
        origin: Option<&str>,
        body: &str,
    ) -> axum::http::Request<axum::body::Body> {
        let mut b = axum::http::Request::post(path).header(header::HOST, "127.0.0.1:8080");
        if let Some(t) = content_type {
            b = b.header(header::CONTENT_TYPE, t);
        }
        if let Some(o) = origin {
            b = b.header(header::ORIGIN, o);
        }
        b.body(axum::body::Body::from(body.to_string())).unwrap()
    }

    #[tokio::test]
    async fn posts_must_be_json_from_the_same_origin_and_small() {
        let mut app = app(true);
        let (status, body, _) =
            send(&mut app, post("/api/jobs", Some("text/plain"), None, "{}")).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{body}");
        let (status, body, _) = send(
            &mut app,
            post(
                "/api/jobs/job-1/cancel",
                Some("application/json"),
                Some("https://evil.example"),
                "{}",
            ),
        )
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        // Same origin, but not a job: the form's own error, before any call.
        let (status, body, _) = send(
            &mut app,
            post(
                "/api/jobs",
                Some("application/json"),
                Some("http://127.0.0.1:8080"),
                r#"{"name": 1}"#,
            ),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert!(body.contains("job: invalid type"), "{body}");
        let big = format!(r#"{{"name": "{}"}}"#, "x".repeat(api::MAX_BODY + 1));
        let (status, _, _) = send(
            &mut app,
            post("/api/jobs", Some("application/json"), None, &big),
        )
        .await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[tokio::test]
    async fn an_http2_request_names_its_host_in_the_uri() {
        let mut app = app(true);
        let req = |uri: &str, origin: &str| {
            axum::http::Request::post(uri)
                .header(header::CONTENT_TYPE, "application/json")
                .header(header::ORIGIN, origin)
                .body(axum::body::Body::from("{}"))
                .unwrap()
        };
        let (status, body, _) = send(
            &mut app,
            req("https://127.0.0.1:8443/api/jobs", "https://127.0.0.1:8443"),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "past the checks: {body}");
        let (status, _, _) = send(
            &mut app,
            req(
                "https://evil.example:8443/api/jobs",
                "https://evil.example:8443",
            ),
        )
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN);
    }

    #[tokio::test]
    async fn no_master_to_call_is_unavailable() {
        let mut app = app(true);
        let (status, body, _) = send(&mut app, get("/api/agents", "127.0.0.1:1")).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("knows no master address"), "{body}");
    }

    #[test]
    fn hosts_are_read_from_authorities() {
        assert_eq!(host_of("127.0.0.1:80"), "127.0.0.1");
        assert_eq!(host_of("[::1]:80"), "::1");
        assert_eq!(host_of("localhost"), "localhost");
        assert!(is_loopback_host("::1") && is_loopback_host("127.0.0.2"));
        assert!(!is_loopback_host("10.0.0.1") && !is_loopback_host("localhost.evil"));
    }
}
