//! Connecting to the masters.
//!
//! `--master` (or `GPUCTL_MASTER`) is a comma separated list of `HOST:PORT`.
//! The CLI talks to the first one that accepts a connection; any master will
//! do, because followers forward what they cannot answer to the leader.

use std::fmt;
use std::time::Duration;

use gpuctl_proto::pb::operator_client::OperatorClient;
use tonic::transport::{Channel, Endpoint};

/// The default `--master`.
pub const DEFAULT_MASTER: &str = "127.0.0.1:7050";

/// How long one address may take to accept a connection before the next is tried.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

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
        let entry = raw.trim();
        let entry = entry.strip_prefix("http://").unwrap_or(entry);
        if entry.is_empty() {
            return Err(format!(
                "empty address in {s:?} (expected HOST:PORT[,HOST:PORT...])"
            ));
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
            Ok(p) if p != 0 => {}
            _ => {
                return Err(format!(
                    "{entry:?}: port {port:?} is not a number in 1..65535"
                ))
            }
        }
        out.push(entry.to_string());
    }
    Ok(MasterList(out))
}

/// No master in the list accepted a connection.
#[derive(Debug, thiserror::Error)]
#[error("could not reach a master at {} ({last_error})", tried.join(", "))]
pub struct ConnectError {
    pub tried: Vec<String>,
    pub last_error: String,
}

/// A connected Operator client and the address it talks to.
#[derive(Debug, Clone)]
pub struct Master {
    /// The address that answered.
    pub addr: String,
    /// Every address of `--master`, for reconnecting after a failover.
    pub addrs: Vec<String>,
    pub client: OperatorClient<Channel>,
}

impl Master {
    /// Connects to the first address of `addrs` that answers.
    pub async fn connect(addrs: &[String]) -> Result<Master, ConnectError> {
        Self::connect_with_timeout(addrs, CONNECT_TIMEOUT).await
    }

    pub async fn connect_with_timeout(
        addrs: &[String],
        timeout: Duration,
    ) -> Result<Master, ConnectError> {
        let mut last_error = String::from("no address given");
        for addr in addrs {
            match connect_one(addr, timeout).await {
                Ok(channel) => {
                    let client = OperatorClient::new(channel)
                        .max_decoding_message_size(MAX_MESSAGE_BYTES)
                        .max_encoding_message_size(MAX_MESSAGE_BYTES);
                    return Ok(Master {
                        addr: addr.clone(),
                        addrs: addrs.to_vec(),
                        client,
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

    /// Connects again, to whichever master of the list answers first now.
    pub async fn reconnect(&mut self) -> Result<(), ConnectError> {
        let fresh = Self::connect(&self.addrs).await?;
        *self = fresh;
        Ok(())
    }
}

async fn connect_one(addr: &str, timeout: Duration) -> Result<Channel, String> {
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| error_chain(&e))?
        .connect_timeout(timeout)
        .tcp_nodelay(true);
    // The outer timeout also bounds name resolution.
    match tokio::time::timeout(timeout, endpoint.connect()).await {
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
        let err = Master::connect_with_timeout(&addrs, Duration::from_millis(500))
            .await
            .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&addrs[0]) && msg.contains(&addrs[1]), "{msg}");
        assert!(!msg.contains('\n'));
    }
}
