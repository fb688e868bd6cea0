//! The daemons' `/metrics` HTTP server (feature `metrics-server`, which
//! only the master and the agent turn on): serves the text that
//! `gpuctl_core::metrics::Exposition` renders at scrape time.

use std::future::Future;
use std::sync::Arc;

use axum::http::{header, StatusCode};
use axum::routing::get;
use axum::Router;
use gpuctl_core::metrics::CONTENT_TYPE;

/// Serves `GET /metrics` (the body `render()` returns) until `shutdown` resolves.
///
/// `GET /` answers a one-line pointer to `/metrics`; other paths answer 404.
pub async fn serve(
    listener: tokio::net::TcpListener,
    render: Arc<dyn Fn() -> String + Send + Sync>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let body = render();
                async move { ([(header::CONTENT_TYPE, CONTENT_TYPE)], body) }
            }),
        )
        .route(
            "/",
            get(|| async { "gpuctl metrics exporter: scrape /metrics\n" }),
        )
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found; scrape /metrics\n") });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Binds `addr` (so that a bad or taken address fails the daemon's start)
/// and serves [`serve`] in the background until `stop` turns true or its
/// sender goes.
pub async fn spawn_server(
    addr: std::net::SocketAddr,
    render: Arc<dyn Fn() -> String + Send + Sync>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving Prometheus metrics at /metrics");
    Ok(tokio::spawn(async move {
        let shutdown = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if let Err(e) = serve(listener, render, shutdown).await {
            tracing::error!(error = %e, "metrics server failed");
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuctl_core::metrics::{Exposition, Kind};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    async fn get(
        addr: std::net::SocketAddr,
        path: &str,
    ) -> (String, Vec<(String, String)>, String) {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .expect("write request");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.expect("read response");
        let raw = String::from_utf8(raw).expect("utf-8 response");
        let (head, body) = raw.split_once("\r\n\r\n").expect("header/body separator");
        let mut lines = head.split("\r\n");
        let status = lines.next().unwrap_or_default().to_owned();
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        (status, headers, body.to_owned())
    }

    fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    #[tokio::test]
    async fn metrics_serve_http() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let scrapes = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = scrapes.clone();
        let render: Arc<dyn Fn() -> String + Send + Sync> = Arc::new(move || {
            let n = counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            let mut e = Exposition::new();
            e.family("scrapes_total", "Scrapes served.", Kind::Counter);
            e.sample("scrapes_total", &[("who", "a \"b\"")], n as f64);
            e.finish()
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, render, async move {
            let _ = stop_rx.await;
        }));

        let (status, headers, body) = get(addr, "/metrics").await;
        assert_eq!(status, "HTTP/1.1 200 OK");
        assert_eq!(header(&headers, "content-type"), Some(CONTENT_TYPE));
        assert_eq!(
            body,
            "# HELP scrapes_total Scrapes served.\n# TYPE scrapes_total counter\n\
             scrapes_total{who=\"a \\\"b\\\"\"} 1\n"
        );
        // Rendered afresh on each scrape.
        let (_, _, body) = get(addr, "/metrics").await;
        assert!(body.ends_with("} 2\n"), "{body}");

        let (status, _, body) = get(addr, "/").await;
        assert_eq!(status, "HTTP/1.1 200 OK");
        assert!(body.contains("/metrics"), "{body}");

        let (status, _, _) = get(addr, "/nope").await;
        assert_eq!(status, "HTTP/1.1 404 Not Found");
        assert_eq!(scrapes.load(std::sync::atomic::Ordering::SeqCst), 2);

        stop_tx.send(()).expect("server still running");
        let result = tokio::time::timeout(std::time::Duration::from_secs(30), server)
            .await
            .expect("server stops after shutdown")
            .expect("server task");
        assert!(result.is_ok(), "{result:?}");
        // The listener is gone with the server.
        assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    }

    #[tokio::test]
    async fn metrics_spawn_server_fails_on_a_taken_port_and_stops_on_request() {
        let taken = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = taken.local_addr().unwrap();
        let render: Arc<dyn Fn() -> String + Send + Sync> = Arc::new(|| "x 1\n".to_string());
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        let err = spawn_server(addr, render.clone(), stop.clone())
            .await
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse);
        drop(taken);
        let task = spawn_server(addr, render, stop).await.unwrap();
        stop_tx.send(true).unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(30), task)
            .await
            .expect("server stops when asked")
            .unwrap();
    }
}
