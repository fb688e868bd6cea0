//! Security commands: `gpuctl certs` (the cluster CA and certificates, made
//! locally), `gpuctl tokens`, `gpuctl whoami`, `gpuctl quota`, `gpuctl
//! login`; and where the CLI finds its own credentials.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Subcommand};
use gpuctl_auth::pki::Ca;
use gpuctl_auth::tls::{ClientAuth, Tls, TlsPaths};
use gpuctl_auth::token::Token;
use gpuctl_auth::CertRole;
use gpuctl_proto::pb;
use serde::Deserialize;

use super::CliError;
use crate::client::{Conn, Credentials, Master, Retry};
use crate::output::{fmt_timestamp, Table};

const DAY: u64 = 86_400;

/// The CLI's config file (`--config`, GPUCTL_CONFIG, else
/// ~/.config/gpuctl/config.toml when it exists).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    pub master: Option<String>,
    pub token: Option<String>,
    /// Holds ca.crt, client.crt and client.key.
    pub tls_dir: Option<PathBuf>,
}

/// The default config file, if there is one.
pub fn default_config() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))?;
    let p = base.join("gpuctl").join("config.toml");
    p.exists().then_some(p)
}

pub fn read_config(path: &Path) -> Result<ConfigFile, CliError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::Other(format!("{}: {e}", path.display())))?;
    toml::from_str(&text).map_err(|e| CliError::Other(format!("{}: {e}", path.display())))
}

/// The CLI's credentials from a TLS dir (ca.crt, client.crt, client.key)
/// and a token.
pub fn credentials(tls_dir: Option<&Path>, token: Option<&str>) -> Result<Credentials, CliError> {
    let mut creds = Credentials::default();
    if let Some(dir) = tls_dir {
        let paths = TlsPaths {
            ca: dir.join("ca.crt"),
            cert: dir.join("client.crt"),
            key: dir.join("client.key"),
        };
        let tls = Tls::from_files(&paths, ClientAuth::Required)
            .map_err(|e| CliError::Other(format!("tls_dir: {e}")))?;
        creds.tls = Some(Arc::new(tls));
    }
    if let Some(t) = token.filter(|t| !t.trim().is_empty()) {
        creds = creds.with_token(t).map_err(CliError::Other)?;
    }
    Ok(creds)
}

#[derive(Debug, Subcommand)]
pub enum CertsCommand {
    /// Create a cluster CA, a certificate for each master, an admin client
    /// certificate and the first admin token, in DIR. Masters start with
    /// `--tls-dir DIR`; gpuctl with `--config DIR/gpuctl.toml`.
    Init {
        /// Where to write (created; files are not overwritten).
        #[arg(long)]
        dir: PathBuf,
        /// Node ids of the masters to make certificates for.
        #[arg(long, value_delimiter = ',', default_value = "1")]
        masters: Vec<u64>,
        /// Host names or IP addresses the masters are reached at, added to
        /// their certificates (clients check the role, not the name).
        #[arg(long, value_delimiter = ',')]
        san: Vec<String>,
        /// The master address(es) to put in gpuctl.toml.
        #[arg(long = "for-master", default_value = "127.0.0.1:7050")]
        for_master: String,
        /// Days the CA is valid.
        #[arg(long, default_value_t = 3650)]
        ca_days: u64,
        /// Days the master and admin certificates are valid.
        #[arg(long, default_value_t = 365)]
        days: u64,
    },
    /// Make a certificate with the CA in DIR (ca.crt, ca.key): for a new
    /// master, an agent without a join token, or a client.
    Issue {
        #[arg(long)]
        dir: PathBuf,
        /// master, agent or client.
        #[arg(long)]
        role: String,
        /// A master's node id, an agent's id, a client's name.
        #[arg(long)]
        name: String,
        #[arg(long, value_delimiter = ',')]
        san: Vec<String>,
        #[arg(long, default_value_t = 365)]
        days: u64,
        /// Where to write NAME.crt and NAME.key (default: DIR).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
pub enum TokensCommand {
    /// Make a token; its secret is printed once (admin).
    Create(CreateTokenArgs),
    /// List tokens, without secrets (admin).
    List {
        /// Also revoked, expired and used ones.
        #[arg(long)]
        all: bool,
    },
    /// Revoke a token at once (admin).
    Revoke { id: String },
}

#[derive(Debug, Args)]
pub struct CreateTokenArgs {
    /// admin, user or framework (not with --join).
    #[arg(long, default_value = "user")]
    pub role: String,
    /// The tenant the token acts for (user and framework tokens).
    #[arg(long)]
    pub tenant: Option<String>,
    /// A single-use token for an agent to join with.
    #[arg(long)]
    pub join: bool,
    /// With --join: the only agent id it may join as.
    #[arg(long)]
    pub agent: Option<String>,
    /// Lifetime, e.g. 30d, 12h (default: never; join tokens 1h).
    #[arg(long)]
    pub ttl: Option<String>,
    #[arg(long, default_value = "")]
    pub description: String,
    /// Framework tokens: an allocator role it may subscribe with
    /// (repeatable; default: the tenant's).
    #[arg(long = "framework-role")]
    pub framework_roles: Vec<String>,
    /// The tenant's host-process jobs may run as root (where agents allow).
    #[arg(long)]
    pub allow_root: bool,
    /// User ids its jobs may name with --user, e.g. 2000-2999,3100
    /// (default: none; jobs then run as their agent gives them, a host
    /// process under a user of its own).
    #[arg(long, value_name = "IDS", default_value = "none")]
    pub allow_uids: String,
    /// Group ids its jobs may name with --user UID:GID (default: none).
    #[arg(long, value_name = "IDS", default_value = "none")]
    pub allow_gids: String,
    /// Idempotency key, at least 32 characters (gpuctl makes 32 random hex
    /// digits): a create sent again by the same token with the same KEY
    /// within 24 hours prints the token the first one made, secret
    /// included, instead of making another.
    #[arg(long, value_name = "KEY", value_parser = parse_token_request_id)]
    pub request_id: Option<String>,
}

/// `tokens create --request-id`: an id, and long enough to seal a secret
/// (the master keeps the token's secret sealed with it for a resend).
pub fn parse_token_request_id(s: &str) -> Result<String, String> {
    let id = super::parse_request_id(s)?;
    let min = gpuctl_auth::token::MIN_SEALING_REQUEST_ID;
    if id.len() < min {
        return Err(format!(
            "at least {min} characters: it seals the token's secret for a resend, so it must be \
             as hard to guess as the 32 random hex digits gpuctl makes"
        ));
    }
    Ok(id)
}

#[derive(Debug, Args)]
pub struct LoginArgs {
    /// The cluster's CA certificate (ca.crt, from an admin).
    #[arg(long, value_name = "FILE")]
    pub ca: PathBuf,
    /// Where to write tls/ (ca.crt, client.crt, client.key) and config.toml
    /// (default: ~/.config/gpuctl).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct QuotaArgs {
    #[command(subcommand)]
    pub command: Option<QuotaCommand>,
}

#[derive(Debug, Subcommand)]
pub enum QuotaCommand {
    /// Set a tenant's GPU quota (admin): what it is guaranteed, and without
    /// --borrow also the most it may hold; 0 removes it.
    Set {
        tenant: String,
        #[arg(long)]
        gpus: u32,
        /// GPUs it may hold beyond its quota while others leave theirs
        /// idle (taken back when they need them); `none`: no limit without
        /// a quota, nothing beyond one (the default).
        #[arg(long, value_name = "GPUS|none")]
        borrow: Option<String>,
        /// Its weight in the fair split of what quotas leave (1 to 1000;
        /// 1 by default).
        #[arg(long)]
        weight: Option<u32>,
        /// Stop its jobs once they have been flagged idle this long (their
        /// GPUs under the masters' --idle-below for --idle-window first):
        /// `1h`, `30m`; `off`: never (the default).
        #[arg(long, value_name = "DURATION|off")]
        stop_idle_after: Option<String>,
    },
}

fn write_new(path: &Path, data: &str, secret: bool) -> Result<(), CliError> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(path)
        .map_err(|e| CliError::Other(format!("{}: {e}", path.display())))?;
    f.write_all(data.as_bytes())
        .map_err(|e| CliError::Other(format!("{}: {e}", path.display())))
}

fn auth_err(e: gpuctl_auth::AuthError) -> CliError {
    CliError::Other(e.to_string())
}

pub fn run_certs(cmd: CertsCommand, out: &mut dyn Write) -> Result<u8, CliError> {
    match cmd {
        CertsCommand::Init {
            dir,
            masters,
            san,
            for_master,
            ca_days,
            days,
        } => {
            if dir.join("ca.key").exists() {
                return Err(CliError::Other(format!(
                    "{} already holds a CA (ca.key); pick another --dir",
                    dir.display()
                )));
            }
            std::fs::create_dir_all(&dir)
                .map_err(|e| CliError::Other(format!("{}: {e}", dir.display())))?;
            let ca =
                Ca::generate("cluster", Duration::from_secs(ca_days * DAY)).map_err(auth_err)?;
            write_new(&dir.join("ca.crt"), ca.cert_pem(), false)?;
            write_new(&dir.join("ca.key"), &ca.key_pem(), true)?;
            let ttl = Duration::from_secs(days * DAY);
            for id in &masters {
                let issued = ca
                    .issue(CertRole::Master, &id.to_string(), ttl, &san)
                    .map_err(auth_err)?;
                write_new(
                    &dir.join(format!("master-{id}.crt")),
                    &issued.cert_pem,
                    false,
                )?;
                write_new(
                    &dir.join(format!("master-{id}.key")),
                    issued.key_pem.as_deref().unwrap_or_default(),
                    true,
                )?;
            }
            let admin = ca
                .issue(CertRole::Client, "admin", ttl, &[])
                .map_err(auth_err)?;
            write_new(&dir.join("client.crt"), &admin.cert_pem, false)?;
            write_new(
                &dir.join("client.key"),
                admin.key_pem.as_deref().unwrap_or_default(),
                true,
            )?;
            let token = Token::generate().map_err(auth_err)?;
            write_new(
                &dir.join("bootstrap.token"),
                &format!("{}\n", token.reveal()),
                true,
            )?;
            let config = format!(
                "# gpuctl's config: gpuctl --config {}/gpuctl.toml (or GPUCTL_CONFIG)\n\
                 master = {:?}\ntls_dir = {:?}\ntoken = {:?}\n",
                dir.display(),
                for_master,
                dir.display().to_string(),
                token.reveal()
            );
            write_new(&dir.join("gpuctl.toml"), &config, true)?;
            writeln!(
                out,
                "Wrote the cluster CA, certificates for master(s) {}, an admin client \
                 certificate and the first admin token to {}.\n\n\
                 Start each master with:  gpuctl-master --tls-dir {} --node-id ID ...\n\
                 Use gpuctl with:         export GPUCTL_CONFIG={}/gpuctl.toml\n\
                 Let an agent join:       gpuctl tokens create --join   (then, on the agent \
                 host, with ca.crt copied to its --tls-dir: gpuctl-agent --tls-dir DIR \
                 --join-token TOKEN ...)\n\n\
                 Keep ca.key, bootstrap.token and gpuctl.toml secret (mode 0600).",
                masters
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                dir.display(),
                dir.display(),
                dir.display()
            )?;
            Ok(super::EXIT_OK)
        }
        CertsCommand::Issue {
            dir,
            role,
            name,
            san,
            days,
            out: out_dir,
        } => {
            let role = CertRole::parse(&role).ok_or_else(|| {
                CliError::Other(format!("--role {role:?}: one of master, agent, client"))
            })?;
            let ca = Ca::load(&dir.join("ca.crt"), &dir.join("ca.key")).map_err(auth_err)?;
            let issued = ca
                .issue(role, &name, Duration::from_secs(days * DAY), &san)
                .map_err(auth_err)?;
            let target = out_dir.unwrap_or(dir);
            let base = match role {
                CertRole::Master => format!("master-{name}"),
                _ => name.clone(),
            };
            write_new(&target.join(format!("{base}.crt")), &issued.cert_pem, false)?;
            write_new(
                &target.join(format!("{base}.key")),
                issued.key_pem.as_deref().unwrap_or_default(),
                true,
            )?;
            writeln!(
                out,
                "Wrote {base}.crt and {base}.key ({role} {name}, until {}) to {}",
                fmt_timestamp(issued.not_after_ms),
                target.display()
            )?;
            Ok(super::EXIT_OK)
        }
    }
}

fn access_client(c: Conn) -> pb::access_client::AccessClient<Conn> {
    pb::access_client::AccessClient::new(c)
}

fn role_name(r: i32) -> &'static str {
    match pb::TokenRole::try_from(r) {
        Ok(pb::TokenRole::Admin) => "admin",
        Ok(pb::TokenRole::User) => "user",
        Ok(pb::TokenRole::Framework) => "framework",
        Ok(pb::TokenRole::Join) => "join",
        _ => "?",
    }
}

fn token_state(t: &pb::TokenInfo, now: u64) -> String {
    if t.revoked_at_ms != 0 {
        return format!("revoked {}", fmt_timestamp(t.revoked_at_ms));
    }
    if t.used_at_ms != 0 {
        return format!("used by {}", t.used_by);
    }
    if t.expires_at_ms != 0 && now >= t.expires_at_ms {
        return "expired".into();
    }
    "active".into()
}

/// `tokens create`: the token, printed once.
async fn create_token(
    master: &mut Master,
    a: CreateTokenArgs,
    out: &mut dyn Write,
) -> Result<u8, CliError> {
    let role = if a.join {
        pb::TokenRole::Join
    } else {
        match a.role.as_str() {
            "admin" => pb::TokenRole::Admin,
            "user" => pb::TokenRole::User,
            "framework" => pb::TokenRole::Framework,
            other => {
                return Err(CliError::Other(format!(
                    "--role {other:?}: one of admin, user, framework (or --join)"
                )))
            }
        }
    };
    let ttl_secs = match &a.ttl {
        None => 0,
        Some(t) => gpuctl_core::time::parse_duration(t)
            .map_err(|e| CliError::Other(format!("--ttl: {e}")))?
            .as_secs()
            .max(1),
    };
    let ids = |flag: &str, text: &str| {
        gpuctl_core::types::IdRanges::parse(text)
            .map(|r| gpuctl_core::convert::id_ranges_to_pb(&r))
            .map_err(|e| CliError::Other(format!("{flag}: {e}")))
    };
    let allowed_uids = ids("--allow-uids", &a.allow_uids)?;
    let allowed_gids = ids("--allow-gids", &a.allow_gids)?;
    let req = pb::CreateTokenRequest {
        role: role as i32,
        tenant: a.tenant.clone().unwrap_or_default(),
        ttl_secs,
        description: a.description.clone(),
        agent_id: a.agent.clone().unwrap_or_default(),
        framework_roles: a.framework_roles.clone(),
        allow_root: a.allow_root,
        allowed_uids,
        allowed_gids,
        request_id: a
            .request_id
            .clone()
            .unwrap_or_else(gpuctl_proto::new_request_id),
    };
    // Every try carries one request id: the master makes one token
    // and answers a resend with it, so resending is safe.
    let resp = master
        .call_service(Retry::Resend, access_client, |mut c| {
            let req = req.clone();
            async move { c.create_token(req).await }
        })
        .await
        .map_err(|e| {
            e.unknown_as(
                format!(
                    "the token may or may not have been created (request id {})",
                    req.request_id
                ),
                format!(
                    "run the same command again with `--request-id {}` added: it prints \
                     the token the first try made, secret included, or makes it (request \
                     ids are remembered for 24 hours)",
                    req.request_id
                ),
            )
        })?;
    let info = resp.info.unwrap_or_default();
    writeln!(out, "{}", resp.token)?;
    let _ = writeln!(
        std::io::stderr(),
        "token {} ({}{}) created; the line above is its secret, shown only now",
        info.id,
        role_name(info.role),
        if info.tenant.is_empty() {
            String::new()
        } else {
            format!(", tenant {}", info.tenant)
        }
    );
    Ok(super::EXIT_OK)
}

pub async fn run_tokens(
    master: &mut Master,
    cmd: TokensCommand,
    out: &mut dyn Write,
) -> Result<u8, CliError> {
    match cmd {
        TokensCommand::Create(a) => create_token(master, a, out).await,
        TokensCommand::List { all } => {
            let resp = master
                .call_service(Retry::Always, access_client, |mut c| async move {
                    c.list_tokens(pb::ListTokensRequest { all }).await
                })
                .await?;
            let now = super::now_ms();
            let mut t = Table::new(&[
                "ID",
                "ROLE",
                "TENANT",
                "STATE",
                "EXPIRES",
                "UIDS",
                "GIDS",
                "DESCRIPTION",
            ]);
            for tok in &resp.tokens {
                t.row(vec![
                    tok.id.clone(),
                    role_name(tok.role).into(),
                    tok.tenant.clone(),
                    token_state(tok, now),
                    if tok.expires_at_ms == 0 {
                        "never".into()
                    } else {
                        fmt_timestamp(tok.expires_at_ms)
                    },
                    id_ranges_text(&tok.allowed_uids),
                    id_ranges_text(&tok.allowed_gids),
                    tok.description.clone(),
                ]);
            }
            out.write_all(t.render().as_bytes())?;
            Ok(super::EXIT_OK)
        }
        TokensCommand::Revoke { id } => {
            // Revoking twice keeps the first time: safe to resend.
            let info = master
                .call_service(Retry::Resend, access_client, |mut c| {
                    let id = id.clone();
                    async move { c.revoke_token(pb::RevokeTokenRequest { id }).await }
                })
                .await?;
            writeln!(out, "token {} revoked", info.id)?;
            Ok(super::EXIT_OK)
        }
    }
}

pub async fn run_whoami(master: &mut Master, out: &mut dyn Write) -> Result<u8, CliError> {
    let resp = master
        .call_service(Retry::Always, access_client, |mut c| async move {
            c.who_am_i(pb::WhoAmIRequest {}).await
        })
        .await?;
    match (resp.kind.as_str(), &resp.token) {
        ("token", Some(t)) => writeln!(
            out,
            "token {} role {}{}{}",
            t.id,
            role_name(t.role),
            if t.tenant.is_empty() {
                String::new()
            } else {
                format!(" tenant {}", t.tenant)
            },
            if t.allowed_uids.is_empty() && t.allowed_gids.is_empty() {
                String::new()
            } else {
                format!(
                    " (--user: uids {}, gids {})",
                    id_ranges_text(&t.allowed_uids),
                    id_ranges_text(&t.allowed_gids)
                )
            }
        )?,
        ("open", _) => writeln!(
            out,
            "no security configured on this cluster: every caller may do everything"
        )?,
        (kind, _) => writeln!(out, "{kind} {}", resp.cert_name)?,
    }
    Ok(super::EXIT_OK)
}

pub async fn run_quota(
    master: &mut Master,
    args: QuotaArgs,
    out: &mut dyn Write,
) -> Result<u8, CliError> {
    if let Some(QuotaCommand::Set {
        tenant,
        gpus,
        borrow,
        weight,
        stop_idle_after,
    }) = args.command
    {
        let (stop_idle_after_ms, clear_stop_idle) = match stop_idle_after.as_deref() {
            None => (None, false),
            Some("off") => (None, true),
            Some(d) => (
                Some(
                    gpuctl_core::time::parse_duration(d)
                        .ok()
                        .filter(|d| d.as_secs() >= 1)
                        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
                        .ok_or_else(|| {
                            CliError::Usage(format!(
                                "--stop-idle-after: {d:?} is not a duration of 1s or more (e.g. 1h) or off"
                            ))
                        })?,
                ),
                false,
            ),
        };
        let (borrow, clear_borrow) = match borrow.as_deref() {
            None => (None, false),
            Some("none") => (None, true),
            Some(n) => (
                Some(n.parse::<u32>().map_err(|_| {
                    CliError::Usage(format!("--borrow: {n:?} is not a number of GPUs or none"))
                })?),
                false,
            ),
        };
        // A set: sending it twice sets the same quota.
        let q = master
            .call_service(Retry::Resend, access_client, |mut c| {
                let req = pb::SetQuotaRequest {
                    tenant: tenant.clone(),
                    gpus,
                    borrow,
                    clear_borrow,
                    weight,
                    stop_idle_after_ms,
                    clear_stop_idle,
                };
                async move { c.set_quota(req).await }
            })
            .await?;
        writeln!(
            out,
            "tenant {}: {} GPUs in use, quota {}, limit {}, weight {}, fair share {}, idle jobs stopped after {}",
            q.tenant,
            q.gpus_used,
            dash_if_zero(q.gpu_quota),
            q.gpu_limit.map_or("none".to_string(), |l| l.to_string()),
            q.weight,
            q.fair_share,
            if q.stop_idle_after_ms == 0 {
                "never".to_string()
            } else {
                format!("{} s", q.stop_idle_after_ms as f64 / 1000.0)
            }
        )?;
        return Ok(super::EXIT_OK);
    }
    let resp = master
        .call_service(Retry::Always, access_client, |mut c| async move {
            c.list_quotas(pb::ListQuotasRequest {}).await
        })
        .await?;
    let mut t = Table::new(&[
        "TENANT",
        "GPUS USED",
        "GPU QUOTA",
        "LIMIT",
        "WEIGHT",
        "FAIR SHARE",
        "BORROWED",
        "LENT",
        "RUNNING",
        "QUEUED",
    ]);
    for q in &resp.tenants {
        t.row(vec![
            q.tenant.clone(),
            q.gpus_used.to_string(),
            dash_if_zero(q.gpu_quota),
            q.gpu_limit.map_or("-".to_string(), |l| l.to_string()),
            q.weight.max(1).to_string(),
            q.fair_share.to_string(),
            q.gpus_borrowed.to_string(),
            q.gpus_lent.to_string(),
            q.jobs_running.to_string(),
            q.jobs_queued.to_string(),
        ]);
    }
    out.write_all(t.render().as_bytes())?;
    Ok(super::EXIT_OK)
}

/// `gpuctl login`: a new key pair here, a client certificate for it from a
/// master (`Identity.Join` with the token: the key never leaves this host),
/// and a config file naming the masters, the certificate and the token.
pub async fn run_login(
    masters: &[String],
    token: Option<&str>,
    args: LoginArgs,
    out: &mut dyn Write,
) -> Result<u8, CliError> {
    let token = token.ok_or_else(|| {
        CliError::Other("login needs a token: --token or GPUCTL_TOKEN (from an admin)".into())
    })?;
    Token::parse(token).map_err(|e| CliError::Other(e.to_string()))?;
    let dir = match args.dir {
        Some(d) => d,
        None => std::env::var_os("XDG_CONFIG_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
            .ok_or_else(|| CliError::Other("no --dir and no HOME".into()))?
            .join("gpuctl"),
    };
    let ca = std::fs::read(&args.ca)
        .map_err(|e| CliError::Other(format!("--ca {}: {e}", args.ca.display())))?;
    let anonymous = Arc::new(Tls::from_pem(&ca, None, ClientAuth::Required).map_err(auth_err)?);
    let (csr, key) = gpuctl_auth::pki::signing_request().map_err(auth_err)?;
    let creds = Credentials {
        tls: Some(anonymous),
        token: None,
    };
    let mut master = Master::connect_as(masters, &creds).await?;
    let resp = master
        .call_service(
            Retry::Always,
            pb::identity_client::IdentityClient::new,
            |mut c| {
                let req = pb::JoinRequest {
                    token: token.trim().to_string(),
                    agent_id: String::new(),
                    csr_pem: csr.clone(),
                };
                async move { c.join(req).await }
            },
        )
        .await?;
    let tls = dir.join("tls");
    std::fs::create_dir_all(&tls)
        .map_err(|e| CliError::Other(format!("{}: {e}", tls.display())))?;
    let write = |name: &str, data: &[u8], mode: u32| -> Result<(), CliError> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = tls.join(name);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&path)
            .map_err(|e| CliError::Other(format!("{}: {e}", path.display())))?;
        f.write_all(data)
            .map_err(|e| CliError::Other(format!("{}: {e}", path.display())))
    };
    write("client.key", key.as_bytes(), 0o600)?;
    write("client.crt", resp.cert_pem.as_bytes(), 0o644)?;
    let bundle = if resp.ca_pem.trim().is_empty() {
        ca
    } else {
        resp.ca_pem.into_bytes()
    };
    write("ca.crt", &bundle, 0o644)?;
    let config = dir.join("config.toml");
    let text = format!(
        "master = {:?}\ntls_dir = {:?}\ntoken = {:?}\n",
        masters.join(","),
        tls.display().to_string(),
        token.trim()
    );
    {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&config)
            .map_err(|e| CliError::Other(format!("{}: {e}", config.display())))?;
        f.write_all(text.as_bytes())
            .map_err(|e| CliError::Other(format!("{}: {e}", config.display())))?;
    }
    writeln!(
        out,
        "Logged in: a client certificate until {} in {}, and {} (mode 0600).",
        fmt_timestamp(resp.not_after_ms),
        tls.display(),
        config.display()
    )?;
    Ok(super::EXIT_OK)
}

/// A token's allowed ids as `tokens list` and `whoami` show them
/// (`none`, or `2000-2999,3100`).
fn id_ranges_text(ranges: &[pb::IdRange]) -> String {
    gpuctl_core::convert::id_ranges_from_pb("", ranges)
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "?".into())
}

fn dash_if_zero(n: u32) -> String {
    if n == 0 {
        "-".into()
    } else {
        n.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_request_id_must_be_long_enough_to_seal_a_secret() {
        let made = gpuctl_proto::new_request_id();
        assert_eq!(parse_token_request_id(&made).unwrap(), made);
        let err = parse_token_request_id("short-key").unwrap_err();
        assert!(err.contains("at least 32"), "{err}");
        assert!(parse_token_request_id(&format!("{made} x")).is_err());
    }
}
