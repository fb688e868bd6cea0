//! A master's key material at run time: its TLS configuration (reloaded when
//! the files change), the CA key that signs joining agents' certificates,
//! and the bootstrap admin token the leader puts in the state once.

use std::sync::Arc;
use std::time::Duration;

use gpuctl_auth::pki::Ca;
use gpuctl_auth::tls::{ClientAuth, Tls};
use gpuctl_auth::token::Token;
use gpuctl_auth::CertRole;
use tokio::sync::watch;

use crate::config::SecurityConfig;
use crate::error::MasterError;
use crate::raft::{RaftHandle, Role};
use crate::state::access::{TokenRecord, TokenRole};
use crate::state::Command;

/// How often the TLS files are checked for changes.
const RELOAD_EVERY: Duration = Duration::from_secs(30);

pub struct Security {
    pub tls: Arc<Tls>,
    /// Signs agents' (and clients') certificates; none without `ca_key`.
    pub ca: Option<Arc<Ca>>,
    pub config: SecurityConfig,
}

impl std::fmt::Debug for Security {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Security")
            .field("identity", &self.tls.identity())
            .field("signs", &self.ca.is_some())
            .finish()
    }
}

fn auth(e: gpuctl_auth::AuthError) -> MasterError {
    MasterError::Config(e.to_string())
}

impl Security {
    /// Loads the files; the certificate must be this master's
    /// (`gpuctl://master/<node_id>`).
    pub fn load(config: &SecurityConfig, node_id: u64) -> Result<Security, MasterError> {
        // Optional: a joining agent connects before it has a certificate;
        // each call checks what it needs (service::auth).
        let tls = Tls::from_files(&config.tls, ClientAuth::Optional).map_err(auth)?;
        match tls.identity() {
            Some(id) if id.role == CertRole::Master && id.name == node_id.to_string() => {}
            other => {
                return Err(MasterError::Config(format!(
                    "{}: not a certificate of master {node_id} (it names {}); make one with \
                     `gpuctl certs issue --role master --name {node_id}`",
                    config.tls.cert.display(),
                    other
                        .map(|i| format!("{} {}", i.role, i.name))
                        .unwrap_or_else(|| "no one".into())
                )))
            }
        }
        let ca = match &config.ca_key {
            Some(key) => Some(Arc::new(Ca::load(&config.tls.ca, key).map_err(auth)?)),
            None => None,
        };
        Ok(Security {
            tls: Arc::new(tls),
            ca,
            config: config.clone(),
        })
    }

    /// The CA certificates to hand to a joining agent: the trusted file as
    /// it is now (during a rotation it holds the old and the new CA).
    pub fn ca_bundle(&self) -> Result<String, std::io::Error> {
        std::fs::read_to_string(&self.config.tls.ca)
    }

    /// The bootstrap admin token, if a file names one.
    pub fn bootstrap_token(&self) -> Result<Option<Token>, MasterError> {
        let Some(path) = &self.config.bootstrap_token else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| MasterError::Config(format!("{}: {e}", path.display())))?;
        Token::parse(&text)
            .map(Some)
            .map_err(|e| MasterError::Config(format!("{}: {e}", path.display())))
    }

    /// What the web console's TLS is made of: this master's certificate,
    /// the cluster CA (and its key, when this master has it), and the
    /// directory of `console.crt` otherwise.
    pub fn console_credentials(&self, node_id: u64) -> gpuctl_console::Credentials {
        gpuctl_console::Credentials {
            server: self.tls.clone(),
            ca_file: self.config.tls.ca.clone(),
            cert_dir: self
                .config
                .tls
                .cert
                .parent()
                .map(|d| d.to_path_buf())
                .unwrap_or_default(),
            ca: self.ca.clone(),
            node_id,
        }
    }

    pub fn spawn_reloader(&self, stop: watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
        gpuctl_auth::tls::spawn_reloader(self.tls.clone(), RELOAD_EVERY, stop)
    }
}

/// The record of the bootstrap admin token.
pub fn bootstrap_record(token: &Token, now_ms: u64) -> TokenRecord {
    TokenRecord {
        id: token.id().to_string(),
        hash: token.hash(),
        role: TokenRole::Admin,
        tenant: String::new(),
        description: "bootstrap admin token (gpuctl certs init)".into(),
        created_at_ms: now_ms,
        expires_at_ms: None,
        revoked_at_ms: None,
        agent_id: None,
        used: None,
        used_key: None,
        framework_roles: Vec::new(),
        allow_root: true,
        // Every id: the admin may make any token anyway. Agents still run
        // only ids within their own `allowed_users`.
        allowed_uids: gpuctl_core::types::IdRanges::all(),
        allowed_gids: gpuctl_core::types::IdRanges::all(),
        created_by: "bootstrap".into(),
    }
}

/// While this master leads, makes sure the bootstrap token is in the state
/// (once: a revoked one stays revoked, because its record stays).
pub async fn seed_bootstrap_token(raft: RaftHandle, token: Token, mut stop: watch::Receiver<bool>) {
    let mut status = raft.status_watch();
    loop {
        let st = status.borrow_and_update().clone();
        if st.role == Role::Leader && st.serving {
            if raft.state().token(token.id()).is_some() {
                return;
            }
            let cmd = Command::CreateToken {
                record: bootstrap_record(&token, crate::now_ms()),
                request: None,
            };
            match raft.propose(cmd).await {
                Ok(_) => {
                    tracing::info!(token_id = token.id(), "bootstrap admin token recorded");
                    return;
                }
                // Another master recorded it first, or we lost the lead.
                Err(e) => tracing::debug!(error = %e, "bootstrap token not recorded yet"),
            }
        }
        tokio::select! {
            _ = status.changed() => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
    }
}
