//! The CLI against fake masters of a Raft group: followers that redirect
//! (with or without naming the leader), a leader, and one that fails
//! ambiguously. Checks that calls end up at the leader, that a submission
//! is never resent when it may have been applied, and that streams survive
//! a failover.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use gpuctl_proto::leader::not_leader;
use gpuctl_proto::pb;
use tonic::Status;

use super::testkit::{chunks, dead_addr, serve, FakeOperator};
use super::{Cli, CliError, Command, EXIT_FAILURE, EXIT_OK};
use crate::client::{may_retry, never_sent, not_applied, Master, Retry};

const AMBIGUOUS: &str = "leadership lost while committing; the outcome is unknown";

#[derive(Clone, Debug)]
enum Role {
    Leader,
    /// Redirects, naming the leader's address when known.
    Follower(Option<String>),
    /// Fails every call like a leader that lost leadership mid-commit.
    Ambiguous,
}

#[derive(Clone, Debug)]
enum Logs {
    /// The whole output, then the end.
    Whole(Vec<&'static str>),
    /// These chunks, then the stream fails with a redirect to the address.
    BreakAfter(Vec<&'static str>, String),
    /// These chunks, then the stream ends and this master becomes a
    /// follower of the address (a leader stepping down).
    StepDownAfter(Vec<&'static str>, String),
}

struct Node {
    role: Mutex<Role>,
    calls: Mutex<Vec<String>>,
    /// GetJob walks through these, then stays on the last.
    job_states: Mutex<Vec<pb::JobState>>,
    logs: Mutex<Logs>,
    members: Mutex<Vec<pb::MasterInfo>>,
    /// The idempotency key of every submit received.
    submit_keys: Mutex<Vec<String>>,
}

impl Node {
    fn new(role: Role) -> Arc<Node> {
        Arc::new(Node {
            role: Mutex::new(role),
            calls: Mutex::new(Vec::new()),
            job_states: Mutex::new(vec![pb::JobState::JobSucceeded]),
            logs: Mutex::new(Logs::Whole(vec!["hello ", "world\n"])),
            members: Mutex::new(vec![member(1, "leader"), member(2, "follower")]),
            submit_keys: Mutex::new(Vec::new()),
        })
    }

    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    fn count(&self, call: &str) -> usize {
        self.calls().iter().filter(|c| *c == call).count()
    }

    /// Records the call; refuses it unless this node is the leader.
    fn gate(&self, call: &str) -> Result<(), Status> {
        self.calls.lock().unwrap().push(call.to_string());
        match &*self.role.lock().unwrap() {
            Role::Leader => Ok(()),
            Role::Follower(hint) => Err(not_leader(hint.as_deref().map(|a| (9, a)))),
            Role::Ambiguous => Err(Status::unavailable(AMBIGUOUS)),
        }
    }
}

fn member(id: u64, role: &str) -> pb::MasterInfo {
    pb::MasterInfo {
        id,
        address: format!("10.0.0.{id}:7050"),
        role: role.into(),
        term: 2,
        commit_index: 10,
        applied_index: 10,
        answered: id == 1,
        voter: true,
        reachable: true,
    }
}

impl FakeOperator for Node {
    fn submit_job(&self, r: pb::SubmitJobRequest) -> Result<pb::SubmitJobResponse, Status> {
        self.submit_keys.lock().unwrap().push(r.request_id);
        self.gate("submit")?;
        Ok(pb::SubmitJobResponse {
            job_id: "job-7".into(),
        })
    }
    fn get_job(&self, r: pb::GetJobRequest) -> Result<pb::Job, Status> {
        self.gate("get")?;
        let mut states = self.job_states.lock().unwrap();
        let state = if states.len() > 1 {
            states.remove(0)
        } else {
            states[0]
        };
        Ok(pb::Job {
            id: r.job_id,
            state: state as i32,
            ..Default::default()
        })
    }
    fn list_jobs(&self, _: pb::ListJobsRequest) -> Result<pb::ListJobsResponse, Status> {
        self.gate("list")?;
        Ok(pb::ListJobsResponse {
            jobs: vec![pb::Job {
                id: "job-7".into(),
                ..Default::default()
            }],
            next_page_token: String::new(),
        })
    }
    fn cancel_job(&self, _: pb::CancelJobRequest) -> Result<pb::CancelJobResponse, Status> {
        self.gate("cancel")?;
        Ok(pb::CancelJobResponse {
            state: pb::JobState::JobCancelled as i32,
        })
    }
    fn job_logs(&self, _: pb::JobLogsRequest) -> Result<Vec<Result<pb::LogChunk, Status>>, Status> {
        self.gate("logs")?;
        let logs = self.logs.lock().unwrap().clone();
        Ok(match logs {
            Logs::Whole(data) => chunks(&data),
            Logs::BreakAfter(data, leader) => {
                let mut items = chunks(&data);
                items.push(Err(not_leader(Some((9, &leader)))));
                items
            }
            Logs::StepDownAfter(data, leader) => {
                *self.role.lock().unwrap() = Role::Follower(Some(leader));
                chunks(&data)
            }
        })
    }
    fn list_masters(&self, _: pb::ListMastersRequest) -> Result<pb::ListMastersResponse, Status> {
        // Any master answers this one.
        self.calls.lock().unwrap().push("masters".into());
        Ok(pb::ListMastersResponse {
            masters: self.members.lock().unwrap().clone(),
        })
    }
    fn add_master(&self, r: pb::AddMasterRequest) -> Result<pb::ListMastersResponse, Status> {
        self.gate("add")?;
        let mut members = self.members.lock().unwrap();
        members.push(pb::MasterInfo {
            id: r.id,
            address: r.address,
            role: "follower".into(),
            voter: false,
            reachable: true,
            ..Default::default()
        });
        Ok(pb::ListMastersResponse {
            masters: members.clone(),
        })
    }
    fn remove_master(&self, r: pb::RemoveMasterRequest) -> Result<pb::ListMastersResponse, Status> {
        self.gate("remove")?;
        let mut members = self.members.lock().unwrap();
        members.retain(|m| m.id != r.id);
        Ok(pb::ListMastersResponse {
            masters: members.clone(),
        })
    }
}

async fn run_cmd(m: &mut Master, args: &[&str]) -> (Result<u8, CliError>, String) {
    let cli = Cli::try_parse_from(std::iter::once("gpuctl").chain(args.iter().copied())).unwrap();
    let mut out = Vec::new();
    let r = match cli.command {
        Command::Jobs(cmd) => super::jobs::run(m, cmd, &mut out).await,
        Command::Masters(args) => super::masters::run(m, args, &mut out)
            .await
            .map(|()| EXIT_OK),
        other => panic!("not used here: {other:?}"),
    };
    (r, String::from_utf8(out).unwrap())
}

#[tokio::test]
async fn a_redirect_leads_to_the_leader_it_names() {
    let leader = Node::new(Role::Leader);
    let leader_addr = serve(leader.clone()).await;
    let follower = Node::new(Role::Follower(Some(leader_addr.clone())));
    let follower_addr = serve(follower.clone()).await;
    // Only the follower is given: the leader is learned from the redirect.
    let mut m = Master::connect(std::slice::from_ref(&follower_addr))
        .await
        .unwrap();
    let (r, out) = run_cmd(&mut m, &["jobs", "list", "--json"]).await;
    assert_eq!(r.unwrap(), EXIT_OK);
    assert!(out.contains("job-7"), "{out}");
    assert_eq!(m.addr, leader_addr);
    assert_eq!(m.addrs, vec![follower_addr, leader_addr]);
    assert_eq!(follower.calls(), ["list"]);
    assert_eq!(leader.calls(), ["list"]);
    // Later calls go straight to the leader.
    let (r, out) = run_cmd(&mut m, &["jobs", "cancel", "job-7"]).await;
    assert_eq!(r.unwrap(), EXIT_OK);
    assert_eq!(out, "CANCELLED\n");
    assert_eq!(follower.calls(), ["list"]);
}

#[tokio::test]
async fn without_a_hint_the_next_addresses_are_tried() {
    let leader = Node::new(Role::Leader);
    let leader_addr = serve(leader.clone()).await;
    let follower = Node::new(Role::Follower(None));
    let follower_addr = serve(follower.clone()).await;
    // An election (no hint), then a master that is down, then the leader.
    let mut m = Master::connect(&[follower_addr, dead_addr(), leader_addr.clone()])
        .await
        .unwrap();
    let (r, out) = run_cmd(&mut m, &["jobs", "get", "job-7", "--json"]).await;
    assert_eq!(r.unwrap(), EXIT_OK);
    assert!(out.contains("SUCCEEDED"), "{out}");
    assert_eq!(m.addr, leader_addr);
    assert_eq!(follower.count("get"), 1);
    assert_eq!(leader.count("get"), 1);
}

#[tokio::test]
async fn gives_up_after_the_deadline_naming_the_last_error() {
    let a = serve(Node::new(Role::Follower(None))).await;
    let b = serve(Node::new(Role::Follower(None))).await;
    let mut m = Master::connect(&[a.clone(), b.clone()]).await.unwrap();
    m.retry_for = Duration::from_millis(700);
    let started = std::time::Instant::now();
    let (r, _) = run_cmd(&mut m, &["jobs", "list"]).await;
    let err = r.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(3));
    let msg = err.to_string();
    assert!(msg.contains("no leader is elected yet"), "{msg}");
    assert!(msg.contains(&a) && msg.contains(&b), "{msg}");
    assert!(!msg.contains('\n'), "{msg}");
    assert_eq!(err.exit_code(), EXIT_FAILURE);
}

#[tokio::test]
async fn errors_that_are_not_about_the_leader_return_at_once() {
    let leader = Node::new(Role::Leader);
    let addr = serve(leader.clone()).await;
    let mut m = Master::connect(&[addr]).await.unwrap();
    let err = m
        .call(Retry::Always, |_c| async {
            Err::<tonic::Response<()>, _>(Status::not_found("job job-9 not found"))
        })
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "job job-9 not found");
}

#[tokio::test]
async fn a_submit_follows_a_redirect_and_is_applied_once() {
    let leader = Node::new(Role::Leader);
    let leader_addr = serve(leader.clone()).await;
    let hinting = Node::new(Role::Follower(Some(leader_addr.clone())));
    let electing = Node::new(Role::Follower(None));
    let mut m = Master::connect(&[serve(electing.clone()).await, serve(hinting.clone()).await])
        .await
        .unwrap();
    let (r, out) = run_cmd(&mut m, &["jobs", "submit", "--name", "x", "--", "true"]).await;
    assert_eq!(r.unwrap(), EXIT_OK);
    assert_eq!(out, "job-7\n");
    assert_eq!(electing.count("submit"), 1);
    assert_eq!(hinting.count("submit"), 1);
    assert_eq!(leader.count("submit"), 1);
}

#[tokio::test]
async fn a_submit_is_resent_after_a_refused_connection() {
    let leader = Node::new(Role::Leader);
    let leader_addr = serve(leader.clone()).await;
    let mut m = Master::connect(std::slice::from_ref(&leader_addr))
        .await
        .unwrap();
    // The master it talks to goes down: the connection is refused, so
    // nothing was sent.
    let dead = dead_addr();
    m.addrs.insert(0, dead.clone());
    m.switch_to(dead);
    let (r, out) = run_cmd(&mut m, &["jobs", "submit", "--name", "x", "--", "true"]).await;
    assert_eq!(r.unwrap(), EXIT_OK);
    assert_eq!(out, "job-7\n");
    assert_eq!(leader.count("submit"), 1);
}

#[tokio::test]
async fn a_submit_is_resent_with_the_same_key_after_an_ambiguous_failure() {
    let leader = Node::new(Role::Leader);
    let ambiguous = Node::new(Role::Ambiguous);
    let mut m = Master::connect(&[serve(ambiguous.clone()).await, serve(leader.clone()).await])
        .await
        .unwrap();
    let (r, out) = run_cmd(&mut m, &["jobs", "submit", "--name", "x", "--", "true"]).await;
    assert_eq!(r.unwrap(), EXIT_OK);
    assert_eq!(out.trim(), "job-7");
    assert_eq!(ambiguous.count("submit"), 1);
    assert_eq!(leader.count("submit"), 1);
    // The master dedupes by key: the resend carries the first one's key.
    let first = ambiguous.submit_keys.lock().unwrap().clone();
    let second = leader.submit_keys.lock().unwrap().clone();
    assert_eq!(first.len(), 1);
    assert!(!first[0].is_empty());
    assert_eq!(first, second);
    // Another submit gets another key.
    let (r, _) = run_cmd(&mut m, &["jobs", "submit", "--name", "y", "--", "true"]).await;
    assert_eq!(r.unwrap(), EXIT_OK);
    let keys = leader.submit_keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 2);
    assert_ne!(keys[0], keys[1]);
    // A read may be retried after the same error.
    let (r, _) = run_cmd(&mut m, &["jobs", "list"]).await;
    assert_eq!(r.unwrap(), EXIT_OK);
    assert_eq!(leader.count("list"), 1);
}

#[tokio::test]
async fn which_failures_prove_nothing_was_applied() {
    assert!(not_applied(&not_leader(Some((2, "m2:7050")))));
    assert!(not_applied(&not_leader(None)));
    assert!(not_applied(&gpuctl_proto::leader::catching_up()));
    // The same words without the master's mark prove nothing.
    assert!(!not_applied(&Status::unavailable(
        gpuctl_proto::leader::catching_up().message()
    )));
    assert!(not_applied(&Status::resource_exhausted(
        "proposal queue full, try again"
    )));
    assert!(!not_applied(&Status::unavailable("raft node stopped")));
    let ambiguous = Status::unavailable(AMBIGUOUS);
    assert!(!not_applied(&ambiguous));
    assert!(may_retry(Retry::Always, &ambiguous));
    assert!(!may_retry(Retry::IfNotApplied, &ambiguous));
    for s in [
        Status::deadline_exceeded("no answer"),
        Status::cancelled("connection closed"),
        Status::unknown("transport error"),
    ] {
        assert!(!may_retry(Retry::IfNotApplied, &s), "{s:?}");
    }
    // A master dying mid-call: a transport error the client made.
    let mut broken = Status::unknown("h2 protocol error: error reading a body from connection");
    broken.set_source(Arc::new(std::io::Error::from(
        std::io::ErrorKind::ConnectionReset,
    )));
    assert!(may_retry(Retry::Always, &broken));
    assert!(!may_retry(Retry::IfNotApplied, &broken));
    assert!(!may_retry(Retry::Always, &Status::invalid_argument("bad")));
    assert!(!may_retry(
        Retry::Always,
        &Status::failed_precondition("no")
    ));
    // A real refused connection, made by tonic.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", dead_addr()))
        .unwrap()
        .connect_lazy();
    let status = pb::operator_client::OperatorClient::new(channel)
        .submit_job(pb::SubmitJobRequest::default())
        .await
        .unwrap_err();
    assert!(never_sent(&status), "{status:?}");
    assert!(may_retry(Retry::IfNotApplied, &status), "{status:?}");
}

#[tokio::test]
async fn followed_logs_survive_a_broken_stream() {
    let new_leader = Node::new(Role::Leader);
    *new_leader.logs.lock().unwrap() = Logs::Whole(vec!["hel", "lo wor", "ld\n", "bye\n"]);
    let new_addr = serve(new_leader.clone()).await;
    let old = Node::new(Role::Leader);
    *old.logs.lock().unwrap() = Logs::BreakAfter(vec!["hello ", "w"], new_addr.clone());
    let mut m = Master::connect(&[serve(old.clone()).await]).await.unwrap();
    let (r, out) = run_cmd(&mut m, &["jobs", "logs", "job-7", "--follow"]).await;
    assert_eq!(r.unwrap(), EXIT_OK);
    assert_eq!(out, "hello world\nbye\n");
    assert_eq!(m.addr, new_addr);
    assert_eq!(new_leader.count("logs"), 1);
}

#[tokio::test]
async fn followed_logs_survive_a_leader_stepping_down() {
    let new_leader = Node::new(Role::Leader);
    *new_leader.logs.lock().unwrap() = Logs::Whole(vec!["hello world\n"]);
    // Still running when asked after the old stream ended, then done.
    *new_leader.job_states.lock().unwrap() =
        vec![pb::JobState::JobRunning, pb::JobState::JobSucceeded];
    let new_addr = serve(new_leader.clone()).await;
    let old = Node::new(Role::Leader);
    *old.logs.lock().unwrap() = Logs::StepDownAfter(vec!["hello "], new_addr.clone());
    let mut m = Master::connect(&[serve(old.clone()).await]).await.unwrap();
    let (r, out) = run_cmd(&mut m, &["jobs", "logs", "job-7", "--follow"]).await;
    assert_eq!(r.unwrap(), EXIT_OK);
    assert_eq!(out, "hello world\n");
    assert_eq!(new_leader.count("logs"), 1);
    assert_eq!(new_leader.count("get"), 2);
}

#[tokio::test]
async fn wait_follows_the_leader() {
    let leader = Node::new(Role::Leader);
    *leader.job_states.lock().unwrap() = vec![pb::JobState::JobRunning, pb::JobState::JobSucceeded];
    let leader_addr = serve(leader.clone()).await;
    let follower = serve(Node::new(Role::Follower(Some(leader_addr.clone())))).await;
    let mut m = Master::connect(&[follower]).await.unwrap();
    let (r, out) = run_cmd(&mut m, &["jobs", "wait", "job-7", "--timeout", "5"]).await;
    assert_eq!(r.unwrap(), EXIT_OK);
    assert_eq!(out, "SUCCEEDED\n");
    assert_eq!(m.addr, leader_addr);
}

#[tokio::test]
async fn wait_times_out_while_no_leader_is_elected() {
    let follower = serve(Node::new(Role::Follower(None))).await;
    let mut m = Master::connect(&[follower]).await.unwrap();
    let started = std::time::Instant::now();
    let (r, _) = run_cmd(&mut m, &["jobs", "wait", "job-7", "--timeout", "0.6"]).await;
    let err = r.unwrap_err();
    assert!(matches!(err, CliError::Timeout(_)), "{err:?}");
    assert!(
        err.to_string().contains("no leader is elected yet"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn masters_are_listed_by_any_master() {
    let follower = Node::new(Role::Follower(None));
    let addr = serve(follower.clone()).await;
    let mut m = Master::connect(std::slice::from_ref(&addr)).await.unwrap();
    let (r, out) = run_cmd(&mut m, &["masters", "--json"]).await;
    assert_eq!(r.unwrap(), EXIT_OK);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["role"], "leader");
    assert_eq!(v[1]["voter"], true);
    assert_eq!(m.addr, addr);
}

#[tokio::test]
async fn masters_add_goes_to_the_leader() {
    let leader = Node::new(Role::Leader);
    let leader_addr = serve(leader.clone()).await;
    let follower = serve(Node::new(Role::Follower(Some(leader_addr)))).await;
    let mut m = Master::connect(&[follower]).await.unwrap();
    let (r, out) = run_cmd(&mut m, &["masters", "add", "3", "10.0.0.3:7050"]).await;
    assert_eq!(r.unwrap(), EXIT_OK);
    let row = out.lines().find(|l| l.starts_with('3')).unwrap_or_default();
    assert!(
        row.contains("10.0.0.3:7050") && row.contains("learner"),
        "{out}"
    );
    assert_eq!(leader.count("add"), 1);
}

#[tokio::test]
async fn removing_the_leader_is_sent_again_to_the_next_leader() {
    let next = Node::new(Role::Leader);
    let next_addr = serve(next.clone()).await;
    // The leader hands leadership on and redirects to its successor.
    let old = Node::new(Role::Follower(Some(next_addr.clone())));
    let mut m = Master::connect(&[serve(old.clone()).await]).await.unwrap();
    let (r, out) = run_cmd(&mut m, &["masters", "remove", "1", "--json"]).await;
    assert_eq!(r.unwrap(), EXIT_OK);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v.as_array().map(Vec::len), Some(1), "{out}");
    assert_eq!(v[0]["id"], 2);
    assert_eq!(old.count("remove"), 1);
    assert_eq!(next.count("remove"), 1);
}

#[tokio::test]
async fn a_stale_hint_naming_a_dead_leader_is_not_followed_twice() {
    let leader = Node::new(Role::Leader);
    let leader_addr = serve(leader.clone()).await;
    // The follower has not noticed yet that the leader it names died.
    let stale = Node::new(Role::Follower(Some(dead_addr())));
    let mut m = Master::connect(&[serve(stale.clone()).await, leader_addr.clone()])
        .await
        .unwrap();
    let (r, _) = run_cmd(&mut m, &["jobs", "submit", "--name", "x", "--", "true"]).await;
    assert_eq!(r.unwrap(), EXIT_OK);
    assert_eq!(m.addr, leader_addr);
    assert_eq!(stale.count("submit"), 2);
    assert_eq!(leader.count("submit"), 1);
}
