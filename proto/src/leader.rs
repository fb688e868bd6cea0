//! The leader redirect, shared by the master (which answers with it) and
//! every client (gpuctl, agents, frameworks), which follows it.
//!
//! Only the leader serves the API. A follower answers any call except
//! `Operator.ListMasters` with `UNAVAILABLE` and, when it knows the leader,
//! the leader's API address in the `gpuctl-leader` metadata entry. A client
//! given several master addresses goes to the hinted leader, or tries the
//! next address when there is no hint (an election in progress, or the
//! master it called is down).

use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

/// Metadata key of the leader's API address (`HOST:PORT`) in a redirect.
pub const LEADER_METADATA: &str = "gpuctl-leader";

/// Metadata key present when the master refused the call before proposing
/// anything, so sending it again (submit included) cannot apply it twice.
pub const NOT_PROPOSED_METADATA: &str = "gpuctl-not-proposed";

/// Metadata key on a heartbeat's answer, success or refusal, when a leader
/// heard it and restarted its clock for the agent: the agent's fence may
/// count from it (see `gpuctl-agent`'s master link).
pub const HEARD_METADATA: &str = "gpuctl-heard";

/// Marks a heartbeat's refusal as heard by the leader.
pub fn mark_heard(mut s: Status) -> Status {
    s.metadata_mut()
        .insert(HEARD_METADATA, MetadataValue::from_static("1"));
    s
}

/// Whether a leader heard the heartbeat this refusal answers.
pub fn heard(status: &Status) -> bool {
    status.metadata().get(HEARD_METADATA).is_some()
}

fn mark_not_proposed(mut s: Status) -> Status {
    s.metadata_mut()
        .insert(NOT_PROPOSED_METADATA, MetadataValue::from_static("1"));
    s
}

/// Whether the master said it refused the call before proposing anything.
pub fn not_proposed(status: &Status) -> bool {
    status.metadata().get(NOT_PROPOSED_METADATA).is_some()
}

/// The answer of a leader just elected, still applying what earlier leaders
/// committed (it serves once it has).
pub fn catching_up() -> Status {
    mark_not_proposed(Status::unavailable(
        "this master was just elected leader and is catching up; retry",
    ))
}

/// The answer of a master that is not the leader. `leader` is the leader's
/// node id and API address when known.
pub fn not_leader(leader: Option<(u64, &str)>) -> Status {
    let s = match leader {
        Some((id, addr)) => {
            let mut s = Status::unavailable(format!(
                "this master is not the leader; the leader is master {id} at {addr}"
            ));
            if let Ok(v) = MetadataValue::try_from(addr) {
                s.metadata_mut().insert(LEADER_METADATA, v);
            }
            s
        }
        None => {
            Status::unavailable("this master is not the leader and no leader is elected yet; retry")
        }
    };
    mark_not_proposed(s)
}

/// The leader's address carried by a redirect, if any.
pub fn leader_hint(status: &Status) -> Option<String> {
    if status.code() != Code::Unavailable {
        return None;
    }
    let v = status.metadata().get(LEADER_METADATA)?.to_str().ok()?;
    (!v.is_empty()).then(|| v.to_string())
}

/// Whether a call that failed with `status` may succeed at another master or
/// later: no leader here, the master is down or unreachable, or it was busy.
pub fn retry_elsewhere(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::Cancelled | Code::DeadlineExceeded | Code::ResourceExhausted
    ) || (status.code() == Code::Unknown && status.message().contains("transport"))
}

/// Whether a call failed on the connection (the master died, the network
/// broke) rather than with the master's own answer.
pub fn is_transport_error(status: &Status) -> bool {
    std::error::Error::source(status).is_some()
}

/// Whether a call that failed with `status` is sent again, to another
/// master or later: [`retry_elsewhere`], or a broken connection (a master
/// dying mid-call breaks it with whatever code the transport error maps
/// to, e.g. "h2 protocol error": Unknown).
pub fn may_retry(status: &Status) -> bool {
    retry_elsewhere(status) || is_transport_error(status)
}

/// A hinted leader address (trimmed) when it is `HOST:PORT` with a usable
/// port and no path: a hint must not poison a client's address list.
pub fn host_port(hint: &str) -> Option<String> {
    let h = hint.trim();
    matches!(h.rsplit_once(':'), Some((host, port))
        if !host.is_empty() && !host.contains('/') && port.parse::<u16>().is_ok_and(|p| p != 0))
    .then(|| h.to_string())
}

/// Whether the call failed while connecting, so no byte of it was sent.
pub fn never_sent(status: &Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        if e.downcast_ref::<tonic::ConnectError>().is_some() {
            return true;
        }
        source = e.source();
    }
    false
}

/// Whether a failed call provably changed nothing, so that its outcome is
/// known: the master said it refused before proposing (a redirect, no
/// leader elected yet, a new leader still catching up), its proposal queue
/// was full, or the connection was never made. Anything else (a connection
/// lost mid-call, no answer in time, a leader deposed while committing)
/// leaves the outcome unknown: the call may yet be applied.
pub fn not_applied(status: &Status) -> bool {
    if not_proposed(status) || never_sent(status) {
        return true;
    }
    if is_transport_error(status) {
        return false;
    }
    // The master's "proposal queue full": refused before proposing.
    status.code() == Code::ResourceExhausted
}

/// Redirects followed at once, without a pause; more in a row means the
/// hints are stale (a leader change in progress), so back off.
pub const FREE_REDIRECTS: u32 = 3;

/// One call's search for the leader, after a failure that may succeed
/// elsewhere: where to send it next and how long to wait first. The same
/// rules for every client that follows the leader (gpuctl, the master's web
/// console): follow a hint at once (up to [`FREE_REDIRECTS`] in a row),
/// never to a master that refused a connection during this call (a
/// follower may still name the leader that just died); without a usable
/// hint, back off and try the next known address.
#[derive(Debug, Clone)]
pub struct LeaderSearch {
    backoff: gpuctl_core::time::Backoff,
    redirects: u32,
    /// Addresses that refused a connection during this call.
    down: Vec<String>,
}

/// Where a [`LeaderSearch`] sends the call next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NextTry {
    /// The address to call: a leader's hint, or the next known address.
    pub addr: String,
    /// Whether `addr` came from a redirect (it may be new to the caller).
    pub redirected: bool,
    /// How long to wait before calling it.
    pub pause: std::time::Duration,
}

impl LeaderSearch {
    /// `min`, `max`: the pauses between tries that got no hint.
    pub fn new(min: std::time::Duration, max: std::time::Duration) -> LeaderSearch {
        LeaderSearch {
            backoff: gpuctl_core::time::Backoff::new(min, max),
            redirects: 0,
            down: Vec::new(),
        }
    }

    /// The call failed at `current` with `status` (which may be retried):
    /// where to go next among `addrs`. `accept_hint` checks a hinted
    /// address (`None`: unusable).
    pub fn next(
        &mut self,
        current: &str,
        status: &Status,
        addrs: &[String],
        accept_hint: impl Fn(&str) -> Option<String>,
    ) -> NextTry {
        if never_sent(status) && !self.down.iter().any(|d| d == current) {
            self.down.push(current.to_string());
        }
        let redirect = leader_hint(status)
            .and_then(|h| accept_hint(&h))
            .filter(|h| h != current && !self.down.contains(h));
        match redirect {
            Some(addr) => {
                let pause = if self.redirects < FREE_REDIRECTS {
                    self.redirects += 1;
                    std::time::Duration::ZERO
                } else {
                    self.backoff.next_wait()
                };
                NextTry {
                    addr,
                    redirected: true,
                    pause,
                }
            }
            None => NextTry {
                addr: next_address(current, addrs),
                redirected: false,
                pause: self.backoff.next_wait(),
            },
        }
    }
}

/// The address after `current` in `addrs`, round the list (the first when
/// `current` is not in it; `current` itself when the list is empty).
pub fn next_address(current: &str, addrs: &[String]) -> String {
    let next = addrs
        .iter()
        .position(|a| a == current)
        .map_or(0, |i| (i + 1) % addrs.len().max(1));
    addrs
        .get(next)
        .cloned()
        .unwrap_or_else(|| current.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn accept(h: &str) -> Option<String> {
        Some(h.to_string())
    }

    #[test]
    fn a_search_follows_hints_at_once_then_backs_off() {
        let addrs: Vec<String> = ["a:1", "b:1", "c:1"].map(String::from).to_vec();
        let mut s = LeaderSearch::new(Duration::from_millis(100), Duration::from_secs(1));
        let hint = not_leader(Some((2, "b:1")));
        for _ in 0..FREE_REDIRECTS {
            let n = s.next("a:1", &hint, &addrs, accept);
            assert_eq!(
                (n.addr.as_str(), n.redirected, n.pause),
                ("b:1", true, Duration::ZERO)
            );
        }
        let n = s.next("a:1", &hint, &addrs, accept);
        assert_eq!(n.addr, "b:1");
        assert_eq!(n.pause, Duration::from_millis(100), "stale hints: back off");
        // No hint: the next address, round the list, with a growing pause.
        let n = s.next("c:1", &not_leader(None), &addrs, accept);
        assert_eq!((n.addr.as_str(), n.redirected), ("a:1", false));
        assert_eq!(n.pause, Duration::from_millis(200));
        // A hint naming the master called, or one refused by accept_hint,
        // is no hint.
        let n = s.next("b:1", &hint, &addrs, accept);
        assert_eq!((n.addr.as_str(), n.redirected), ("c:1", false));
        let n = s.next("a:1", &hint, &addrs, |_| None);
        assert_eq!((n.addr.as_str(), n.redirected), ("b:1", false));
        assert_eq!(next_address("x:1", &addrs), "a:1");
        assert_eq!(next_address("x:1", &[]), "x:1");
    }

    #[test]
    fn redirect_names_the_leader_and_carries_its_address() {
        let s = not_leader(Some((2, "10.0.0.2:7050")));
        assert_eq!(s.code(), Code::Unavailable);
        assert!(
            s.message().contains("master 2 at 10.0.0.2:7050"),
            "{}",
            s.message()
        );
        assert_eq!(leader_hint(&s).as_deref(), Some("10.0.0.2:7050"));
        assert!(retry_elsewhere(&s));
        assert!(not_proposed(&s));
        assert!(not_proposed(&catching_up()));
        assert!(!not_proposed(&Status::unavailable("leadership lost")));
    }

    #[test]
    fn no_hint_without_a_leader_or_for_other_errors() {
        let s = not_leader(None);
        assert_eq!(leader_hint(&s), None);
        assert!(retry_elsewhere(&s));
        let mut other = Status::not_found("job-9");
        other
            .metadata_mut()
            .insert(LEADER_METADATA, MetadataValue::from_static("x:1"));
        assert_eq!(leader_hint(&other), None);
        assert!(!retry_elsewhere(&other));
    }
}
