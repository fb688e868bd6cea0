//! Wire <-> domain conversions. Every check of input that arrives over the
//! wire lives here, and every failure names the field it is about. By
//! subject: `limits.rs`, `job.rs`, `agent.rs`, `status.rs`, `framework.rs`,
//! `query.rs`, `service.rs`; the checks they share are below.

mod agent;
mod framework;
mod job;
mod limits;
mod options;
mod query;
mod service;
mod spec;
mod status;

pub use agent::*;
pub use framework::*;
pub use job::*;
pub use limits::*;
pub use options::{options_to_pb, options_view};
pub use query::*;
pub use status::*;

/// How much a template is checked as it is read.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Checks {
    /// Entering the cluster: shape and every size limit.
    Submitted,
    /// A task from the master: shape only (its job's were checked on
    /// submit; the master adds env, and jobs submitted before a limit may
    /// exceed it; the message is bounded by the gRPC limit).
    Shape,
}

/// Bad input: which field, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid {field}: {reason}")]
pub struct ConvertError {
    pub field: String,
    pub reason: String,
}

impl ConvertError {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ConvertError {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

type Result<T> = std::result::Result<T, ConvertError>;

/// An env name as a field label: quoted, cut to 64 bytes.
fn env_label(field: &str, key: &str) -> String {
    format!("{field}[{:?}]", cut(key, 64))
}

/// At most `n` bytes of `s` (on a char boundary), with "..." when cut.
pub fn cut(s: &str, n: usize) -> String {
    if s.len() <= n {
        return s.to_string();
    }
    let mut end = n;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// `field` is `len` bytes where `max` are allowed; `what` names the part
/// of the field that is (empty: the field itself).
fn too_long(field: impl Into<String>, what: &str, len: usize, max: usize) -> ConvertError {
    let what = if what.is_empty() {
        String::new()
    } else {
        format!("{what} ")
    };
    ConvertError::new(field, format!("{what}is {len} bytes, at most {max}"))
}

/// An identifier chosen by the system or a user: 1..=128 chars of
/// `[A-Za-z0-9._-]`, not starting with `-` or `.`.
pub fn check_id(field: &str, s: &str) -> Result<()> {
    if s.is_empty() {
        return Err(ConvertError::new(field, "must not be empty"));
    }
    if s.len() > MAX_NAME_LEN {
        return Err(ConvertError::new(
            field,
            format!("longer than {MAX_NAME_LEN} characters"),
        ));
    }
    if s.starts_with(['-', '.']) {
        return Err(ConvertError::new(field, "must not start with '-' or '.'"));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(ConvertError::new(
            field,
            format!("character {c:?} not allowed (use letters, digits, '.', '_', '-')"),
        ));
    }
    Ok(())
}

/// At most `max` bytes, no control characters, and no whitespace unless
/// `allow_space`.
fn check_text(field: &str, s: &str, max: usize, allow_space: bool) -> Result<()> {
    if s.len() > max {
        return Err(too_long(field, "", s.len(), max));
    }
    if let Some(c) = s
        .chars()
        .find(|c| c.is_control() || (!allow_space && c.is_whitespace()))
    {
        return Err(ConvertError::new(field, format!("contains {c:?}")));
    }
    Ok(())
}

fn check_printable(field: &str, s: &str, allow_space: bool) -> Result<()> {
    check_text(field, s, MAX_ATTR_LEN, allow_space)
}

#[cfg(test)]
mod tests;
