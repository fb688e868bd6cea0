//! Real TLS handshakes over loopback between [`incoming`] and [`Connector`].
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gpuctl_auth::pki::{identity_of, Ca};
use gpuctl_auth::tls::{incoming, ClientAuth, Connector, Tls};
use gpuctl_auth::CertRole;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower_service::Service;

const DAY: Duration = Duration::from_secs(86_400);

fn node(ca: &Ca, role: CertRole, name: &str, auth: ClientAuth) -> Arc<Tls> {
    let issued = ca.issue(role, name, DAY, &[]).unwrap();
    let key = issued.key_pem.unwrap();
    Arc::new(
        Tls::from_pem(
            ca.cert_pem().as_bytes(),
            Some((issued.cert_pem.as_bytes(), key.as_bytes())),
            auth,
        )
        .unwrap(),
    )
}

/// Starts a server; returns its address and a receiver of the client
/// identities it accepted (None: anonymous).
async fn serve(
    tls: Arc<Tls>,
) -> (
    String,
    tokio::sync::mpsc::UnboundedReceiver<Option<(CertRole, String)>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let mut conns = incoming(listener, tls);
    tokio::spawn(async move {
        while let Some(Ok(mut s)) = conns.next().await {
            let who = s.get_ref().1.peer_certificates().map(|c| {
                let id = identity_of(&c[0]).unwrap();
                (id.role, id.name)
            });
            let _ = tx.send(who);
            let mut buf = [0u8; 4];
            if s.read_exact(&mut buf).await.is_ok() {
                let _ = s.write_all(&buf).await;
            }
        }
    });
    (addr, rx)
}

async fn talk(client: Arc<Tls>, server_role: CertRole, addr: &str) -> std::io::Result<()> {
    let uri: http::Uri = format!("http://{addr}").parse().unwrap();
    let io = Connector::new(client, server_role).call(uri).await?;
    let mut s = io.into_inner();
    s.write_all(b"ping").await?;
    let mut buf = [0u8; 4];
    s.read_exact(&mut buf).await?;
    assert_eq!(&buf, b"ping");
    Ok(())
}

#[tokio::test]
async fn peers_of_one_ca_see_each_others_roles() {
    let ca = Ca::generate("t", DAY).unwrap();
    let (addr, mut seen) = serve(node(&ca, CertRole::Master, "1", ClientAuth::Optional)).await;
    talk(
        node(&ca, CertRole::Agent, "a1", ClientAuth::Required),
        CertRole::Master,
        &addr,
    )
    .await
    .unwrap();
    assert_eq!(
        seen.recv().await.unwrap(),
        Some((CertRole::Agent, "a1".into()))
    );
    // Anonymous (a joining agent) is let in where client auth is optional.
    let anon =
        Arc::new(Tls::from_pem(ca.cert_pem().as_bytes(), None, ClientAuth::Required).unwrap());
    talk(anon, CertRole::Master, &addr).await.unwrap();
    assert_eq!(seen.recv().await.unwrap(), None);
}

#[tokio::test]
async fn a_server_of_the_wrong_role_is_refused_by_the_client() {
    let ca = Ca::generate("t", DAY).unwrap();
    // An agent's certificate cannot pass for a master's.
    let (addr, _seen) = serve(node(&ca, CertRole::Agent, "a1", ClientAuth::Optional)).await;
    let e = talk(
        node(&ca, CertRole::Client, "c", ClientAuth::Required),
        CertRole::Master,
        &addr,
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("certificate"), "{e}");
}

#[tokio::test]
async fn a_certificate_of_another_ca_is_refused_both_ways() {
    let ca = Ca::generate("t", DAY).unwrap();
    let other = Ca::generate("evil", DAY).unwrap();
    let (addr, mut seen) = serve(node(&ca, CertRole::Master, "1", ClientAuth::Optional)).await;
    // A client certificate from another CA: the server refuses the handshake.
    let stranger = node(&other, CertRole::Agent, "a1", ClientAuth::Required);
    // The stranger must trust our CA to get that far.
    let issued = other.issue(CertRole::Agent, "a1", DAY, &[]).unwrap();
    let key = issued.key_pem.unwrap();
    let trusting = Arc::new(
        Tls::from_pem(
            ca.cert_pem().as_bytes(),
            Some((issued.cert_pem.as_bytes(), key.as_bytes())),
            ClientAuth::Required,
        )
        .unwrap(),
    );
    assert!(talk(trusting, CertRole::Master, &addr).await.is_err());
    // A server from another CA: the client refuses it.
    assert!(talk(stranger.clone(), CertRole::Master, &addr)
        .await
        .is_err());
    assert!(
        tokio::time::timeout(Duration::from_millis(300), seen.recv())
            .await
            .is_err(),
        "no connection may have been accepted"
    );
}

#[tokio::test]
async fn required_client_auth_refuses_anonymous_clients() {
    let ca = Ca::generate("t", DAY).unwrap();
    let (addr, mut seen) = serve(node(&ca, CertRole::Agent, "a1", ClientAuth::Required)).await;
    let anon =
        Arc::new(Tls::from_pem(ca.cert_pem().as_bytes(), None, ClientAuth::Required).unwrap());
    assert!(talk(anon, CertRole::Agent, &addr).await.is_err());
    talk(
        node(&ca, CertRole::Master, "1", ClientAuth::Required),
        CertRole::Agent,
        &addr,
    )
    .await
    .unwrap();
    assert_eq!(
        seen.recv().await.unwrap(),
        Some((CertRole::Master, "1".into()))
    );
}

#[tokio::test]
async fn a_replaced_certificate_is_used_for_new_connections() {
    let ca = Ca::generate("t", DAY).unwrap();
    let server = node(&ca, CertRole::Master, "1", ClientAuth::Optional);
    let (addr, mut seen) = serve(server).await;
    let client = node(&ca, CertRole::Agent, "a1", ClientAuth::Required);
    talk(client.clone(), CertRole::Master, &addr).await.unwrap();
    assert_eq!(
        seen.recv().await.unwrap(),
        Some((CertRole::Agent, "a1".into()))
    );
    let renewed = ca.issue(CertRole::Agent, "a2", DAY, &[]).unwrap();
    client
        .replace(
            ca.cert_pem().as_bytes(),
            renewed.cert_pem.as_bytes(),
            renewed.key_pem.unwrap().as_bytes(),
        )
        .unwrap();
    talk(client.clone(), CertRole::Master, &addr).await.unwrap();
    assert_eq!(
        seen.recv().await.unwrap(),
        Some((CertRole::Agent, "a2".into()))
    );
    assert_eq!(client.identity().unwrap().name, "a2");
}

#[tokio::test]
async fn changed_files_are_reloaded() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::generate("t", DAY).unwrap();
    let write = |name: &str| {
        let issued = ca.issue(CertRole::Master, name, DAY, &[]).unwrap();
        std::fs::write(dir.path().join("ca.crt"), ca.cert_pem()).unwrap();
        std::fs::write(dir.path().join("m.crt"), &issued.cert_pem).unwrap();
        std::fs::write(dir.path().join("m.key"), issued.key_pem.unwrap()).unwrap();
    };
    write("1");
    let paths = gpuctl_auth::tls::TlsPaths {
        ca: dir.path().join("ca.crt"),
        cert: dir.path().join("m.crt"),
        key: dir.path().join("m.key"),
    };
    let tls = Tls::from_files(&paths, ClientAuth::Optional).unwrap();
    assert!(!tls.reload_if_changed().unwrap());
    // mtime granularity: make sure the new files look newer.
    std::thread::sleep(Duration::from_millis(20));
    write("2");
    let later = std::time::SystemTime::now() + Duration::from_secs(2);
    for p in [&paths.ca, &paths.cert, &paths.key] {
        std::fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_modified(later)
            .unwrap();
    }
    assert!(tls.reload_if_changed().unwrap());
    assert_eq!(tls.identity().unwrap().name, "2");
    // A broken file keeps the old material in place.
    std::fs::write(&paths.key, "garbage").unwrap();
    std::fs::File::options()
        .write(true)
        .open(&paths.key)
        .unwrap()
        .set_modified(later + Duration::from_secs(2))
        .unwrap();
    let e = tls.reload_if_changed().unwrap_err().to_string();
    assert!(e.contains("m.key"), "{e}");
    assert_eq!(tls.identity().unwrap().name, "2");
}
