//! What can go wrong in gpuctl, and the exit code each ends with.

use std::io;

use tonic::Code;

/// Success; for `jobs wait`, the job SUCCEEDED.
pub const EXIT_OK: u8 = 0;
/// Any error without a more specific code; for `jobs wait`, the job FAILED
/// or was CANCELLED.
pub const EXIT_FAILURE: u8 = 1;
/// A usage error (clap uses 2 as well) or a timeout (`jobs wait --timeout`).
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_TIMEOUT: u8 = 2;
/// The job (or other object) named does not exist.
pub const EXIT_NOT_FOUND: u8 = 3;
/// Only for a change whose outcome is unknown: gpuctl gave up while some
/// try may have been applied (`CliError::Unknown`). Running the same
/// command again is safe (a create: with the request id it names).
pub const EXIT_UNKNOWN: u8 = 4;

/// No master in the list accepted a connection.
#[derive(Debug, thiserror::Error)]
#[error("could not reach a master at {} ({last_error})", tried.join(", "))]
pub struct ConnectError {
    pub tried: Vec<String>,
    pub last_error: String,
}

/// Everything that can go wrong; shown as one line `error: <message>`.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{0}")]
    Connect(#[from] ConnectError),
    #[error("{}", rpc_message(addr, status))]
    Rpc { addr: String, status: tonic::Status },
    /// No master served the call before the leader-following deadline.
    #[error("no master served the call within {secs}s (tried {tried}): {last}")]
    GaveUp {
        secs: u64,
        tried: String,
        last: Box<CliError>,
    },
    #[error("{0}")]
    Timeout(String),
    #[error("writing output: {0}")]
    Io(#[from] io::Error),
    #[error("encoding JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{0}")]
    NotFound(String),
    /// Bad input found after parsing the flags (a job file): exit 2, like
    /// the argument parser's own usage errors.
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Other(String),
    /// A change that may or may not have been made: some try failed
    /// without proof that the master did not apply it, and no later try
    /// settled it. `what` says what may have happened, `next` what to do;
    /// `last` is the last error.
    #[error("the outcome is unknown: {what}; {next}. Last error: {last}")]
    Unknown {
        what: String,
        next: String,
        last: Box<CliError>,
    },
}

/// True when the status was made by the client from a transport error (no
/// connection, connection lost) rather than sent by the master.
pub fn is_transport_error(status: &tonic::Status) -> bool {
    gpuctl_proto::leader::is_transport_error(status)
}

fn rpc_message(addr: &str, status: &tonic::Status) -> String {
    let msg = status.message().trim();
    let text = match status.code() {
        Code::Unavailable if is_transport_error(status) || msg.is_empty() => {
            if msg.is_empty() {
                format!("master {addr} could not be reached")
            } else {
                format!("master {addr} could not be reached: {msg}")
            }
        }
        _ if is_transport_error(status) => {
            format!("connection to master {addr} failed: {msg}")
        }
        _ if msg.contains("grpc-status header missing") => {
            format!("{addr} did not answer as a gpuctl master ({msg})")
        }
        Code::Unimplemented if msg.is_empty() => {
            format!("master {addr} does not implement this call")
        }
        code if msg.is_empty() => format!("master {addr} answered {code:?}"),
        _ => msg.to_string(),
    };
    one_line(&text)
}

/// Joins the lines of a message so that an error stays on one line.
pub fn one_line(s: &str) -> String {
    s.split(['\n', '\r'])
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

impl CliError {
    /// `status` as the master at `addr` answered it.
    pub fn rpc(addr: String, status: tonic::Status) -> Self {
        CliError::Rpc { addr, status }
    }

    /// An unknown outcome ending with `last`, in general words; the
    /// command that knows more rewords it ([`CliError::unknown_as`]).
    pub fn unknown(last: CliError) -> Self {
        CliError::Unknown {
            what: "the change may or may not have been made".into(),
            next: "running the same command again is safe".into(),
            last: Box::new(last),
        }
    }

    /// An unknown outcome said in the words of the command that had it
    /// (`what` may have happened, `next` to do); other errors as they are.
    pub fn unknown_as(self, what: impl Into<String>, next: impl Into<String>) -> Self {
        match self {
            CliError::Unknown { last, .. } => CliError::Unknown {
                what: what.into(),
                next: next.into(),
                last,
            },
            other => other,
        }
    }

    /// The last error of an unknown outcome (itself otherwise).
    pub fn last(&self) -> &CliError {
        match self {
            CliError::Unknown { last, .. } => last.last(),
            other => other,
        }
    }

    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Unknown { .. } => EXIT_UNKNOWN,
            CliError::Rpc { status, .. } => match status.code() {
                Code::NotFound => EXIT_NOT_FOUND,
                Code::DeadlineExceeded => EXIT_TIMEOUT,
                _ => EXIT_FAILURE,
            },
            CliError::GaveUp { last, .. } => last.exit_code(),
            CliError::Timeout(_) => EXIT_TIMEOUT,
            CliError::NotFound(_) => EXIT_NOT_FOUND,
            CliError::Usage(_) => EXIT_USAGE,
            _ => EXIT_FAILURE,
        }
    }

    /// Output closed early (`gpuctl jobs list | head -1`): not worth a message.
    pub fn is_broken_pipe(&self) -> bool {
        matches!(self, CliError::Io(e) if e.kind() == io::ErrorKind::BrokenPipe)
    }
}
