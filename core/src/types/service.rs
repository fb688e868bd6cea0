//! A service: replicas that run until it is deleted. Each replica is a job
//! of one task made from the service's template, whose restart policy is
//! `Always`; the state machine keeps which job is which replica.

use serde::{Deserialize, Serialize};

use super::JobSpec;

/// A service as asked: its name (a DNS label, unique among the cluster's
/// services), how many replicas, and what each runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceSpec {
    pub name: String,
    pub replicas: u32,
    /// Each replica's job: one task, named as the service, restart policy
    /// `Always`; its `service` is set when the service gets its id.
    pub template: JobSpec,
    /// How long a replica that leaves (scale down, delete) keeps running,
    /// out of the endpoints, before it is stopped: its requests in flight
    /// finish. `None`: [`DEFAULT_DRAIN_MS`] when the template names a
    /// port, else none (nothing can route to it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_ms: Option<u64>,
}

/// A leaving replica's drain when the service does not say.
pub const DEFAULT_DRAIN_MS: u64 = 5_000;
/// The longest drain a service may ask.
pub const MAX_DRAIN_MS: u64 = 600_000;

impl ServiceSpec {
    /// How long a leaving replica drains (see `drain_ms`).
    pub fn drain(&self) -> u64 {
        match self.drain_ms {
            Some(ms) => ms,
            None if self.template.template.options.port.is_empty() => 0,
            None => DEFAULT_DRAIN_MS,
        }
    }
}

/// Whether `name` may name a service: 1 to 63 of `a-z`, `0-9` and `-`,
/// starting with a letter and not ending with `-` (a DNS label, so that a
/// gateway can route `NAME.` hosts to it).
pub fn check_service_name(name: &str) -> Result<(), String> {
    let ok_chars = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if name.is_empty() || name.len() > 63 {
        return Err(format!("{name:?} must be 1 to 63 characters"));
    }
    if !ok_chars || !name.starts_with(|c: char| c.is_ascii_lowercase()) || name.ends_with('-') {
        return Err(format!(
            "{name:?} must be lower-case letters, digits and '-', starting with a letter and \
             not ending with '-' (a DNS label)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_name_is_a_dns_label() {
        for good in ["llm", "llama-70b", "a", "x1", &"a".repeat(63)] {
            assert!(check_service_name(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "Llm",
            "1llm",
            "llm-",
            "l.m",
            "l_m",
            "llm/x",
            &"a".repeat(64),
        ] {
            assert!(check_service_name(bad).is_err(), "{bad}");
        }
    }
}
