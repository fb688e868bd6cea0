//! The agent's identity: a certificate for its own agent id, got once with a
//! join token (`Identity.Join`, the key never leaves this host: the master
//! signs a request) and renewed before it expires (`Identity.Renew`, over
//! mutual TLS with the certificate it replaces).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpuctl_auth::pki::{now_ms, signing_request};
use gpuctl_auth::tls::{ClientAuth, Tls, TlsPaths};
use gpuctl_auth::CertRole;
use gpuctl_proto::follow::{Connect, Follower, Policy, Retry};
use gpuctl_proto::pb;
use tokio::sync::watch;
use tonic::transport::Endpoint;

use crate::config::AgentSecurity;
use crate::error::AgentError;

pub const CA_FILE: &str = "ca.crt";
/// The agent's certificate and key in one file, replaced by one rename, so
/// that a crash mid-renewal never leaves a key that does not match.
pub const IDENTITY_FILE: &str = "agent.pem";

const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Between failed renewals.
const RENEW_RETRY: Duration = Duration::from_secs(30);

fn paths(dir: &Path) -> TlsPaths {
    TlsPaths {
        ca: dir.join(CA_FILE),
        cert: dir.join(IDENTITY_FILE),
        key: dir.join(IDENTITY_FILE),
    }
}

fn config_err(msg: impl Into<String>) -> AgentError {
    AgentError::Config(msg.into())
}

/// Writes `data` to `path` atomically (a temporary file renamed over it),
/// readable by the owner only when `secret`.
pub fn write_file(path: &Path, data: &[u8], secret: bool) -> Result<(), AgentError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let io = |source| AgentError::WorkDir {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(&tmp)
        .map_err(io)?;
    f.write_all(data).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// The agent's TLS: from the files in `tls_dir`, joining first (with the
/// join token) when there is no certificate yet. The certificate must name
/// this agent.
pub async fn establish(
    sec: &AgentSecurity,
    agent_id: &str,
    masters: &[String],
) -> Result<Arc<Tls>, AgentError> {
    let p = paths(&sec.tls_dir);
    if !p.ca.exists() {
        return Err(config_err(format!(
            "{}: missing; copy the cluster's ca.crt there (from `gpuctl certs init`)",
            p.ca.display()
        )));
    }
    if !p.cert.exists() {
        let from_file = match &sec.join_token_file {
            Some(f) => Some(
                std::fs::read_to_string(f)
                    .map_err(|e| config_err(format!("join_token_file {}: {e}", f.display())))?
                    .trim()
                    .to_string(),
            ),
            None => None,
        };
        let Some(token) = sec.join_token.as_ref().or(from_file.as_ref()) else {
            return Err(config_err(format!(
                "no certificate in {} and no join token: run the agent once with \
                 --join-token (an admin makes one with `gpuctl tokens create --join`)",
                sec.tls_dir.display()
            )));
        };
        join(&p, token, agent_id, masters).await?;
    }
    let tls = Tls::from_files(&p, ClientAuth::Required).map_err(|e| config_err(e.to_string()))?;
    match tls.identity() {
        Some(id) if id.role == CertRole::Agent && id.name == agent_id => Ok(Arc::new(tls)),
        Some(id) => Err(config_err(format!(
            "{} names {} {}, but this agent is {agent_id} (its id is in the work dir); \
             join again with a token for it (`gpuctl tokens create --join --agent {agent_id}`) \
             after removing the old certificate",
            p.cert.display(),
            id.role,
            id.name
        ))),
        None => Err(config_err(format!("{}: no certificate", p.cert.display()))),
    }
}

/// How Join and Renew follow the leader: a fresh channel per try (the
/// certificate may be new), the agent's own backoff between tries.
const POLICY: Policy = Policy {
    backoff_min: Duration::from_millis(200),
    backoff_max: Duration::from_secs(2),
    unknown_search_factor: 1,
    accept_hint: gpuctl_proto::leader::host_port,
    cache_channels: false,
    on_retry: |addr, _, status| tracing::debug!(%addr, code = ?status.code(), "identity call: trying another master"),
};

/// How long Join or Renew looks for a master that answers: long enough for
/// an election, short enough that a refused join ends the agent's start.
const SEARCH: Duration = Duration::from_secs(30);

/// Calls `f` on the masters with gpuctl's leader-following client
/// (`gpuctl_proto::follow`): redirects followed, tried again while the
/// failure may pass elsewhere, the master's own refusal (a bad token) at
/// once. Join and Renew are safe to send again: a second certificate for
/// the same key pair is harmless.
async fn on_masters<T, F, Fut>(
    tls: &Arc<Tls>,
    masters: &[String],
    mut f: F,
) -> Result<T, tonic::Status>
where
    F: FnMut(pb::identity_client::IdentityClient<tonic::transport::Channel>) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let tls = Arc::clone(tls);
    let connect: Connect = Arc::new(move |addr: &str| {
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| tonic::Status::invalid_argument(format!("master address {addr}: {e}")))?
            .connect_timeout(CALL_TIMEOUT)
            .timeout(CALL_TIMEOUT);
        Ok(gpuctl_auth::tls::channel(
            &endpoint,
            Some(&tls),
            CertRole::Master,
        ))
    });
    let follower = Follower::new(masters.to_vec(), connect, POLICY);
    let deadline = tokio::time::Instant::now() + SEARCH;
    follower
        .call_among(
            masters.to_vec(),
            Retry::Resend,
            Some(CALL_TIMEOUT),
            deadline,
            |c| f(pb::identity_client::IdentityClient::new(c)),
        )
        .await
        .map_err(|e| e.status)
}

async fn join(
    p: &TlsPaths,
    token: &str,
    agent_id: &str,
    masters: &[String],
) -> Result<(), AgentError> {
    let ca = std::fs::read(&p.ca).map_err(|source| AgentError::WorkDir {
        path: p.ca.clone(),
        source,
    })?;
    // Trusts the cluster CA, shows no certificate: Join needs none.
    let anonymous = Arc::new(
        Tls::from_pem(&ca, None, ClientAuth::Required).map_err(|e| config_err(e.to_string()))?,
    );
    // The key is kept until the certificate is written: a join sent again
    // (its answer lost, or this agent restarted before it wrote the
    // certificate) is the same request, which the master lets through.
    let key_path = p.cert.with_file_name(JOIN_KEY_FILE);
    let key = match std::fs::read_to_string(&key_path) {
        Ok(k) if !k.trim().is_empty() => k,
        _ => {
            let k = gpuctl_auth::pki::new_key_pem().map_err(|e| config_err(e.to_string()))?;
            write_file(&key_path, k.as_bytes(), true)?;
            k
        }
    };
    let csr = gpuctl_auth::pki::signing_request_for(&key).map_err(|e| {
        config_err(format!(
            "{}: {e} (remove it to join with a new key)",
            key_path.display()
        ))
    })?;
    let resp = on_masters(&anonymous, masters, |mut c| {
        let req = pb::JoinRequest {
            token: token.to_string(),
            agent_id: agent_id.to_string(),
            csr_pem: csr.clone(),
        };
        async move { c.join(req).await }
    })
    .await
    .map_err(|s| config_err(format!("joining the cluster failed: {}", s.message())))?;
    write_file(&p.cert, format!("{}{key}", resp.cert_pem).as_bytes(), true)?;
    if let Err(e) = std::fs::remove_file(&key_path) {
        tracing::warn!(path = %key_path.display(), error = %e, "could not remove the joining key");
    }
    tracing::info!(%agent_id, not_after_ms = resp.not_after_ms, "joined the cluster: certificate written");
    Ok(())
}

/// The key of a join under way, beside the certificate it is for.
const JOIN_KEY_FILE: &str = "join-key.pem";

/// When to renew: after two thirds of the certificate's life.
fn renew_at_ms(not_before_ms: u64, not_after_ms: u64) -> u64 {
    not_before_ms + (not_after_ms.saturating_sub(not_before_ms)) * 2 / 3
}

/// Renews the certificate in `dir` before it expires, for as long as the
/// agent runs; each new one is written and put in use at once.
pub fn spawn_renewer(
    tls: Arc<Tls>,
    dir: PathBuf,
    masters: Vec<String>,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let wait = match tls.identity() {
                Some(id) => Duration::from_millis(
                    renew_at_ms(id.not_before_ms, id.not_after_ms).saturating_sub(now_ms()),
                ),
                None => RENEW_RETRY,
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = stop.changed() => return,
            }
            if *stop.borrow() {
                return;
            }
            match renew(&tls, &dir, &masters).await {
                Ok(not_after_ms) => {
                    tracing::info!(not_after_ms, "agent certificate renewed")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "renewing the agent certificate failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(RENEW_RETRY) => {}
                        _ = stop.changed() => return,
                    }
                }
            }
        }
    })
}

async fn renew(tls: &Arc<Tls>, dir: &Path, masters: &[String]) -> Result<u64, AgentError> {
    let p = paths(dir);
    let (csr, key) = signing_request().map_err(|e| config_err(e.to_string()))?;
    let resp = on_masters(tls, masters, |mut c| {
        let req = pb::RenewRequest {
            csr_pem: csr.clone(),
        };
        async move { c.renew(req).await }
    })
    .await
    .map_err(|s| config_err(format!("renewal refused: {}", s.message())))?;
    // The masters' CA bundle (during a CA rotation, old and new CA), else
    // the one we have.
    let ca = if resp.ca_pem.trim().is_empty() {
        std::fs::read(&p.ca).map_err(|source| AgentError::WorkDir {
            path: p.ca.clone(),
            source,
        })?
    } else {
        resp.ca_pem.clone().into_bytes()
    };
    // In use first (so the files never hold what failed to load), then kept.
    tls.replace(&ca, resp.cert_pem.as_bytes(), key.as_bytes())
        .map_err(|e| config_err(e.to_string()))?;
    write_file(&p.cert, format!("{}{key}", resp.cert_pem).as_bytes(), true)?;
    write_file(&p.ca, &ca, false)?;
    Ok(resp.not_after_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_comes_after_two_thirds_of_the_life() {
        assert_eq!(renew_at_ms(1000, 4000), 3000);
        assert_eq!(renew_at_ms(5000, 5000), 5000);
        assert_eq!(renew_at_ms(5000, 10), 5000);
    }
}
