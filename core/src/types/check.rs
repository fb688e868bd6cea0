//! A task's health checks (readiness and liveness), run by its agent next
//! to it: an HTTP GET or a TCP connect to one of its named ports, or a
//! command in its container (or beside its host process), every interval.
//!
//! One text form everywhere, the flag's (`--readiness`), the job file's
//! and the JSON's: the probe and its options, `key=value` words, only those
//! not at their default:
//!
//! ```text
//! http:http/healthz interval=2s failures=5 start=10m
//! tcp:grpc
//! timeout=5s exec:test -f /tmp/ready
//! ```
//!
//! (a command takes the rest of the text, so its options come first).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// What a check does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// `GET path` on 127.0.0.1 at the named port: 2xx and 3xx pass.
    Http { port: String, path: String },
    /// A TCP connection to 127.0.0.1 at the named port is accepted.
    Tcp { port: String },
    /// `sh -c command` in the task's container (a host task: as its user,
    /// in its cgroup and namespaces) exits 0.
    Exec { command: String },
}

impl Probe {
    /// The port it names, if any.
    pub fn port(&self) -> Option<&str> {
        match self {
            Probe::Http { port, .. } | Probe::Tcp { port } => Some(port),
            Probe::Exec { .. } => None,
        }
    }
}

/// One check and when it runs and counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub probe: Probe,
    /// From the task's start: failures do not count until this has passed
    /// or a check has passed (a model loading), `start=`.
    pub start_period_ms: u64,
    /// Between the starts of two checks, `interval=`.
    pub interval_ms: u64,
    /// A check that takes longer fails, `timeout=`.
    pub timeout_ms: u64,
    /// Failures in a row that make it fail (not ready; a liveness check's
    /// task is restarted), `failures=`.
    pub failures: u32,
    /// Passes in a row that make a failed readiness check pass again,
    /// `successes=`.
    pub successes: u32,
}

pub const CHECK_INTERVAL_MS: u64 = 10_000;
pub const CHECK_TIMEOUT_MS: u64 = 2_000;
pub const CHECK_FAILURES: u32 = 3;
pub const CHECK_SUCCESSES: u32 = 1;
/// Bounds: a check more often than 10 times a second is load, not news;
/// a start period past a day is a task that never started.
pub const CHECK_INTERVAL_RANGE_MS: (u64, u64) = (100, 3_600_000);
pub const CHECK_TIMEOUT_RANGE_MS: (u64, u64) = (100, 600_000);
pub const MAX_CHECK_START_PERIOD_MS: u64 = 86_400_000;
pub const MAX_CHECK_COUNT: u32 = 100;
pub const MAX_CHECK_PATH_LEN: usize = 1024;
pub const MAX_CHECK_COMMAND_LEN: usize = 4096;

impl Check {
    pub fn new(probe: Probe) -> Check {
        Check {
            probe,
            start_period_ms: 0,
            interval_ms: CHECK_INTERVAL_MS,
            timeout_ms: CHECK_TIMEOUT_MS,
            failures: CHECK_FAILURES,
            successes: CHECK_SUCCESSES,
        }
    }

    /// Every bound, as (the option's key, what is wrong).
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        let within = |key: &'static str, ms: u64, (lo, hi): (u64, u64)| {
            if (lo..=hi).contains(&ms) {
                Ok(())
            } else {
                Err((
                    key,
                    format!(
                        "is {}: from {} to {}",
                        ms_text(ms),
                        ms_text(lo),
                        ms_text(hi)
                    ),
                ))
            }
        };
        within("interval", self.interval_ms, CHECK_INTERVAL_RANGE_MS)?;
        within("timeout", self.timeout_ms, CHECK_TIMEOUT_RANGE_MS)?;
        within(
            "start",
            self.start_period_ms,
            (0, MAX_CHECK_START_PERIOD_MS),
        )?;
        for (key, n) in [("failures", self.failures), ("successes", self.successes)] {
            if !(1..=MAX_CHECK_COUNT).contains(&n) {
                return Err((key, format!("is {n}: from 1 to {MAX_CHECK_COUNT}")));
            }
        }
        match &self.probe {
            Probe::Http { port, path } => {
                check_port(port)?;
                let ok = path.starts_with('/')
                    && path.len() <= MAX_CHECK_PATH_LEN
                    && path.bytes().all(|b| b.is_ascii_graphic());
                if !ok {
                    return Err((
                        "path",
                        format!(
                            "{:?} must start with '/', be at most {MAX_CHECK_PATH_LEN} bytes, \
                             without spaces or control characters",
                            path.chars().take(64).collect::<String>()
                        ),
                    ));
                }
            }
            Probe::Tcp { port } => check_port(port)?,
            Probe::Exec { command } => {
                if command.trim().is_empty()
                    || command.len() > MAX_CHECK_COMMAND_LEN
                    || command.contains('\0')
                {
                    return Err((
                        "command",
                        format!("must be 1 to {MAX_CHECK_COMMAND_LEN} bytes, without NUL"),
                    ));
                }
            }
        }
        Ok(())
    }
}

fn check_port(port: &str) -> Result<(), (&'static str, String)> {
    if port.is_empty() {
        return Err(("port", "names none: a port name is needed".into()));
    }
    Ok(())
}

/// `90s`, `10m`, `500ms`: the largest unit that divides it.
pub fn ms_text(ms: u64) -> String {
    match ms {
        0 => "0s".into(),
        n if n % 3_600_000 == 0 => format!("{}h", n / 3_600_000),
        n if n % 60_000 == 0 => format!("{}m", n / 60_000),
        n if n % 1000 == 0 => format!("{}s", n / 1000),
        n => format!("{n}ms"),
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut opts = Vec::new();
        if self.start_period_ms != 0 {
            opts.push(format!("start={}", ms_text(self.start_period_ms)));
        }
        if self.interval_ms != CHECK_INTERVAL_MS {
            opts.push(format!("interval={}", ms_text(self.interval_ms)));
        }
        if self.timeout_ms != CHECK_TIMEOUT_MS {
            opts.push(format!("timeout={}", ms_text(self.timeout_ms)));
        }
        if self.failures != CHECK_FAILURES {
            opts.push(format!("failures={}", self.failures));
        }
        if self.successes != CHECK_SUCCESSES {
            opts.push(format!("successes={}", self.successes));
        }
        let probe = match &self.probe {
            Probe::Http { port, path } if path == "/" => format!("http:{port}"),
            Probe::Http { port, path } => format!("http:{port}{path}"),
            Probe::Tcp { port } => format!("tcp:{port}"),
            Probe::Exec { command } => format!("exec:{command}"),
        };
        let words = if matches!(self.probe, Probe::Exec { .. }) {
            opts.push(probe);
            opts
        } else {
            std::iter::once(probe).chain(opts).collect()
        };
        f.write_str(&words.join(" "))
    }
}

impl FromStr for Check {
    type Err = String;
    fn from_str(s: &str) -> Result<Check, String> {
        let mut probe = None;
        let mut check = Check::new(Probe::Tcp {
            port: String::new(),
        });
        let mut rest = s.trim_start();
        while !rest.is_empty() {
            let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
            let word = &rest[..end];
            if word.starts_with("exec:") && probe.is_none() {
                // The rest of the text is the command.
                probe = Some(Probe::Exec {
                    command: rest["exec:".len()..].trim().to_string(),
                });
                break;
            }
            if let Some(target) = word.strip_prefix("http:") {
                if probe.is_some() {
                    return Err(format!("{word:?}: one probe per check"));
                }
                let (port, path) = match target.find('/') {
                    Some(i) => (&target[..i], &target[i..]),
                    None => (target, "/"),
                };
                probe = Some(Probe::Http {
                    port: port.into(),
                    path: path.into(),
                });
            } else if let Some(port) = word.strip_prefix("tcp:") {
                if probe.is_some() {
                    return Err(format!("{word:?}: one probe per check"));
                }
                probe = Some(Probe::Tcp { port: port.into() });
            } else if let Some((key, value)) = word.split_once('=') {
                let ms = || crate::time::parse_duration(value).map(|d| d.as_millis() as u64);
                let count = || {
                    value
                        .parse::<u32>()
                        .map_err(|_| format!("{key}={value}: not a whole number"))
                };
                match key {
                    "start" => check.start_period_ms = ms()?,
                    "interval" => check.interval_ms = ms()?,
                    "timeout" => check.timeout_ms = ms()?,
                    "failures" => check.failures = count()?,
                    "successes" => check.successes = count()?,
                    _ => {
                        return Err(format!(
                        "{word:?}: unknown option (start, interval, timeout, failures, successes)"
                    ))
                    }
                }
            } else {
                return Err(format!(
                    "{word:?}: a check is http:PORT[/PATH], tcp:PORT or exec:COMMAND, \
                     with options key=value (start, interval, timeout, failures, successes)"
                ));
            }
            rest = rest[end..].trim_start();
        }
        check.probe = probe.ok_or_else(|| {
            format!("{s:?} has no probe: http:PORT[/PATH], tcp:PORT or exec:COMMAND")
        })?;
        check
            .validate()
            .map_err(|(key, why)| format!("{key} {why}"))?;
        Ok(check)
    }
}

impl Serialize for Check {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Check {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Check, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// What a task's checks say now, as its agent reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskHealth {
    /// Its readiness check passes (true for a task without one).
    pub ready: bool,
    /// The last failed check's words (`readiness: GET /healthz: 503`);
    /// empty when none failed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub failure: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_check_reads_and_writes_one_form() {
        for (text, shown) in [
            ("http:http", "http:http"),
            ("http:http/", "http:http"),
            ("http:web/healthz?x=1", "http:web/healthz?x=1"),
            ("  tcp:grpc  interval=2s ", "tcp:grpc interval=2s"),
            (
                "interval=500ms http:http/ready failures=5 start=10m timeout=1s successes=2",
                "http:http/ready start=10m interval=500ms timeout=1s failures=5 successes=2",
            ),
            ("exec:test -f /tmp/ready", "exec:test -f /tmp/ready"),
            (
                "timeout=5s exec:  sh -c 'a=b; echo $a'  ",
                "timeout=5s exec:sh -c 'a=b; echo $a'",
            ),
            // An `=` or `http:` inside the command is the command's.
            ("exec:x=1 http:y", "exec:x=1 http:y"),
            ("interval=10s tcp:p", "tcp:p"),
        ] {
            let c: Check = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(c.to_string(), shown, "{text}");
            assert_eq!(shown.parse::<Check>().unwrap(), c, "{shown}");
        }
        let c: Check = "exec:true".parse().unwrap();
        assert_eq!(
            c.probe,
            Probe::Exec {
                command: "true".into()
            }
        );
        assert_eq!(c.interval_ms, CHECK_INTERVAL_MS);
    }

    #[test]
    fn bad_checks_say_what_is_wrong() {
        for (bad, words) in [
            ("", "no probe"),
            ("interval=1s", "no probe"),
            ("ftp:x", "a check is"),
            ("http:", "port names none"),
            ("tcp:a tcp:b", "one probe"),
            ("tcp:a every=1s", "unknown option"),
            ("tcp:a interval=1ms", "interval is 1ms: from 100ms to 1h"),
            ("tcp:a interval=soon", "not a duration"),
            ("tcp:a failures=0", "failures is 0"),
            ("tcp:a successes=-1", "not a whole number"),
            ("tcp:a start=2d", "start is 48h"),
            ("tcp:a timeout=11m", "timeout is 11m"),
            ("exec:", "command must be"),
            ("exec:   ", "command must be"),
        ] {
            let e = bad.parse::<Check>().unwrap_err();
            assert!(e.contains(words), "{bad:?}: {e}");
        }
        let long = format!("http:p/{}", "a".repeat(MAX_CHECK_PATH_LEN));
        assert!(long.parse::<Check>().unwrap_err().contains("path"));
    }

    #[test]
    fn checks_serialize_as_their_text() {
        let c: Check = "http:http/healthz interval=2s".parse().unwrap();
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(json, r#""http:http/healthz interval=2s""#);
        assert_eq!(serde_json::from_str::<Check>(&json).unwrap(), c);
        assert!(serde_json::from_str::<Check>(r#""gopher:x""#).is_err());
    }
}
