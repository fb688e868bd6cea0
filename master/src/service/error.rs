//! The service layer's errors, as data. Every RPC's logic returns
//! [`ServiceError`]; the one `From<ServiceError> for Status` below decides
//! the gRPC code and the words a client sees, and nothing else in the
//! services builds a `Status`.

use gpuctl_core::ConvertError;
use tonic::Status;

use crate::leader::frameworks::TakeOffersError;
use crate::raft::ProposeError;
use crate::state::{ApplyError, Outcome, State};

/// What was looked for and not found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Missing {
    Job,
    Agent,
    Gpu,
    Token,
    Service,
}

impl std::fmt::Display for Missing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Missing::Job => "job",
            Missing::Agent => "agent",
            Missing::Gpu => "GPU",
            Missing::Token => "token",
            Missing::Service => "service",
        })
    }
}

/// Why an agent must register again before it may heartbeat or watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MustRegister {
    Unreachable,
    Lost,
    Unknown,
}

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// Bad input, naming the field (the conversion layer's verdict).
    #[error(transparent)]
    Invalid(#[from] ConvertError),
    /// A proposal that failed: not the leader, leadership lost, busy, or
    /// refused by the state machine.
    #[error(transparent)]
    Propose(#[from] ProposeError),
    #[error("{what} {id} not found")]
    NotFound { what: Missing, id: String },
    /// A job the master had and forgot (see `State::job_forgotten`).
    #[error("job {job_id} not found: it ended and was forgotten after the master's job retention (--job-retention, --job-retention-max)")]
    JobForgotten { job_id: String },
    /// Not the leader (or not done catching up): the client goes to
    /// `leader` when known.
    #[error("this master is not the leader")]
    NotLeader { leader: Option<(u64, String)> },
    #[error("this master is not the leader; subscribe to the leader")]
    FrameworkApiNotServed,
    #[error("framework {framework_id} is not subscribed to this master")]
    NotSubscribed { framework_id: String },
    #[error(transparent)]
    Offers(#[from] TakeOffersError),
    #[error("agent {agent_id} {}", match why {
        MustRegister::Unreachable => "was marked unreachable (no heartbeat in time); register again",
        MustRegister::Lost => "was marked lost; register again",
        MustRegister::Unknown => "is not registered; register again",
    })]
    MustRegister { agent_id: String, why: MustRegister },
    /// The agent could not stop its tasks before this master declares
    /// them LOST (see `MasterConfig::check_kill_grace`).
    #[error("agent {agent_id} refused: {reason}")]
    KillGrace { agent_id: String, reason: String },
    #[error("job {job_id} has not started yet (use --follow to wait for it)")]
    JobNotStarted { job_id: String },
    #[error("the agent running task {task_id} has no address for logs")]
    NoLogAddress { task_id: String },
    #[error("agent address {address}: {source}")]
    AgentAddress {
        address: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("cannot reach agent at {address} for logs: {source}")]
    AgentUnreachable {
        address: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// A status made elsewhere (an agent's answer to a proxied call, the
    /// verdict on one update of a batch), passed on as it came.
    #[error("{}", .0.message())]
    Relayed(Status),
    #[error("master is shutting down")]
    ShuttingDown,
    #[error("master {id} is already a voting member, at another address (see `gpuctl masters`)")]
    AlreadyVoter { id: u64 },
    #[error("master {id} at {address} has not caught up within {secs}s (it has index {matched} of {target}); it stays a learner. Check that it runs with --join and that the masters reach each other, then run `gpuctl masters add {id} {address}` again, or remove it")]
    CatchUpTimeout {
        id: u64,
        address: String,
        secs: u64,
        matched: u64,
        target: u64,
    },
    #[error("{field}: task id {task_id} is already used by a task of this framework")]
    TaskIdInUse { field: String, task_id: String },
    #[error("master {id} is not a member")]
    NotAMember { id: u64 },
    /// No create with this request id by this caller is remembered: it
    /// was never applied, was another caller's, or is older than a day.
    #[error("no {what} was created with request id {request_id} by this caller within the last 24 hours (it was not applied, or it was another token's)")]
    NoSuchRequest {
        what: &'static str,
        request_id: String,
    },
    /// A request id sent again for a create with other settings.
    #[error("request_id: {0}")]
    RequestIdReused(String),
    #[error("master {id} is the only voting member; add another before removing it")]
    LastVoter { id: u64 },
    #[error("no other voter to lead")]
    NoOtherVoter,
    #[error("leadership transfer to master {to} did not complete; retry")]
    TransferIncomplete { to: u64 },
    /// The caller may not do this (another agent's tasks, another
    /// tenant's job, another tenant's framework).
    #[error("{0}")]
    Forbidden(String),
    /// The caller proved nothing: a bad, unknown, expired or revoked token.
    #[error("{0}")]
    Unauthenticated(String),
    /// This master cannot sign certificates (no CA key) or read its CA.
    #[error("{0}")]
    CannotSign(String),
    /// A command answered with an outcome of another command: a bug.
    #[error("unexpected outcome of {command}: {outcome:?}")]
    UnexpectedOutcome {
        command: &'static str,
        outcome: Box<Outcome>,
    },
}

impl ServiceError {
    pub fn not_found(what: Missing, id: impl Into<String>) -> ServiceError {
        ServiceError::NotFound {
            what,
            id: id.into(),
        }
    }

    /// A job the state does not have; one it had and forgot says so.
    pub fn job_not_found(state: &State, id: &str) -> ServiceError {
        if state.job_forgotten(id) {
            ServiceError::JobForgotten {
                job_id: id.to_string(),
            }
        } else {
            ServiceError::not_found(Missing::Job, id)
        }
    }

    pub fn unexpected(command: &'static str, outcome: Outcome) -> ServiceError {
        ServiceError::UnexpectedOutcome {
            command,
            outcome: Box::new(outcome),
        }
    }
}

impl From<ServiceError> for Status {
    fn from(e: ServiceError) -> Status {
        use ServiceError as E;
        let message = e.to_string();
        match e {
            E::Invalid(_) => Status::invalid_argument(message),
            E::Propose(p) => propose_status(p),
            E::NotLeader { leader } => {
                gpuctl_proto::leader::not_leader(leader.as_ref().map(|(id, a)| (*id, a.as_str())))
            }
            E::NotFound { .. }
            | E::JobForgotten { .. }
            | E::NotAMember { .. }
            | E::NoSuchRequest { .. }
            | E::MustRegister { .. } => Status::not_found(message),
            E::Offers(TakeOffersError::NotOffering)
            | E::FrameworkApiNotServed
            | E::ShuttingDown
            | E::TransferIncomplete { .. } => Status::unavailable(message),
            E::NotSubscribed { .. }
            | E::Offers(TakeOffersError::Offer(_))
            | E::KillGrace { .. }
            | E::JobNotStarted { .. }
            | E::NoLogAddress { .. }
            | E::AgentUnreachable { .. }
            | E::LastVoter { .. }
            | E::RequestIdReused(_)
            | E::NoOtherVoter => Status::failed_precondition(message),
            E::Relayed(s) => s,
            E::Forbidden(_) => Status::permission_denied(message),
            E::Unauthenticated(_) => Status::unauthenticated(message),
            E::CannotSign(_) => Status::failed_precondition(message),
            E::AlreadyVoter { .. } | E::TaskIdInUse { .. } => Status::already_exists(message),
            E::CatchUpTimeout { .. } => Status::deadline_exceeded(message),
            E::AgentAddress { .. } | E::UnexpectedOutcome { .. } => Status::internal(message),
        }
    }
}

fn propose_status(e: ProposeError) -> Status {
    match e {
        // Never proposed: the client may retry at the leader.
        ProposeError::NotLeader { leader } => {
            gpuctl_proto::leader::not_leader(leader.as_ref().map(|(id, a)| (*id, a.as_str())))
        }
        // Proposed but not known to be committed: no leader hint, so
        // clients do not resubmit blindly.
        ProposeError::LeadershipLost | ProposeError::Stopped => Status::unavailable(e.to_string()),
        ProposeError::Membership(_) => Status::failed_precondition(e.to_string()),
        ProposeError::Encode(_) => Status::internal(e.to_string()),
        ProposeError::Busy => Status::resource_exhausted(e.to_string()),
        ProposeError::Rejected(a) => match a {
            ApplyError::JobNotFound(_)
            | ApplyError::AgentNotFound(_)
            | ApplyError::FrameworkNotFound(_)
            | ApplyError::TaskNotFound(_)
            | ApplyError::ServiceNotFound(_) => Status::not_found(a.to_string()),
            ApplyError::ServiceExists(_) => Status::already_exists(a.to_string()),
            ApplyError::Undecodable { .. } => Status::internal(a.to_string()),
            ApplyError::Invalid { .. } => Status::invalid_argument(a.to_string()),
            ApplyError::Unexpected(_) => Status::internal(a.to_string()),
            _ => Status::failed_precondition(a.to_string()),
        },
    }
}

/// An RPC's answer: the reply, or its error as a `Status`.
pub fn reply<T>(r: Result<T, ServiceError>) -> Result<tonic::Response<T>, Status> {
    r.map(tonic::Response::new).map_err(Status::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn each_error_has_its_code_and_names_what_failed() {
        let cases: Vec<(ServiceError, Code, &str)> = vec![
            (
                ConvertError::new("spec.command", "must not be empty").into(),
                Code::InvalidArgument,
                "invalid spec.command: must not be empty",
            ),
            (
                ServiceError::not_found(Missing::Job, "job-7"),
                Code::NotFound,
                "job job-7 not found",
            ),
            (
                ServiceError::JobForgotten {
                    job_id: "job-3".into(),
                },
                Code::NotFound,
                "job job-3 not found: it ended and was forgotten after the master's job retention",
            ),
            (
                ServiceError::MustRegister {
                    agent_id: "a1".into(),
                    why: MustRegister::Lost,
                },
                Code::NotFound,
                "agent a1 was marked lost; register again",
            ),
            (
                ServiceError::NotSubscribed {
                    framework_id: "f1".into(),
                },
                Code::FailedPrecondition,
                "framework f1 is not subscribed",
            ),
            (
                ProposeError::Rejected(ApplyError::JobNotFound("job-3".into())).into(),
                Code::NotFound,
                "job job-3 not found",
            ),
            (
                ProposeError::Busy.into(),
                Code::ResourceExhausted,
                "queue full",
            ),
            (
                ServiceError::AlreadyVoter { id: 2 },
                Code::AlreadyExists,
                "master 2",
            ),
            (
                ServiceError::TaskIdInUse {
                    field: "operations[0].tasks[1].task_id".into(),
                    task_id: "t1".into(),
                },
                Code::AlreadyExists,
                "operations[0].tasks[1].task_id: task id t1",
            ),
            (
                ServiceError::unexpected("submit_job", Outcome::Done),
                Code::Internal,
                "unexpected outcome of submit_job",
            ),
        ];
        for (e, code, words) in cases {
            let s = Status::from(e);
            assert_eq!(s.code(), code, "{s:?}");
            assert!(
                s.message().contains(words),
                "{:?} lacks {words:?}",
                s.message()
            );
        }
    }

    #[test]
    fn not_leader_redirects_to_the_leader() {
        let s = Status::from(ServiceError::NotLeader {
            leader: Some((2, "10.0.0.2:7050".into())),
        });
        assert_eq!(s.code(), Code::Unavailable);
        assert_eq!(
            gpuctl_proto::leader::leader_hint(&s).as_deref(),
            Some("10.0.0.2:7050")
        );
        assert!(gpuctl_proto::leader::not_proposed(&s));
    }
}
