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

#[cfg(test)]
mod tests {
    use super::*;

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
