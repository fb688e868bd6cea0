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
use super::{Cli, CliError, Command};
use crate::client::{may_retry, not_applied, Master, Retry};
use crate::error::{EXIT_FAILURE, EXIT_NOT_FOUND, EXIT_OK, EXIT_UNKNOWN};
use gpuctl_proto::leader::never_sent;

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
        if !r.request_id.is_empty() {
            // Found when some submit carried it.
            if !self.submit_keys.lock().unwrap().contains(&r.request_id) {
                return Err(Status::not_found(format!(
                    "no job was created with request id {} by this caller within the last 24 hours",
                    r.request_id
                )));
            }
            return Ok(pb::Job {
                id: "job-7".into(),
                state: pb::JobState::JobQueued as i32,
                ..Default::default()
            });
        }
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
        if !members.iter().any(|m| m.id == r.id) {
            return Err(Status::not_found(format!(
                "master {} is not a member",
                r.id
            )));
        }
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
    assert_eq!(m.addr(), leader_addr);
    assert_eq!(m.addrs(), vec![follower_addr, leader_addr]);
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
    assert_eq!(m.addr(), leader_addr);
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
    let mut addrs = m.addrs();
    addrs.insert(0, dead.clone());
    m.set_addrs(addrs);
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
    assert!(may_retry(&ambiguous));
    for s in [
        Status::deadline_exceeded("no answer"),
        Status::cancelled("connection closed"),
        Status::unknown("transport error"),
    ] {
        assert!(may_retry(&s), "{s:?}");
        assert!(!not_applied(&s), "{s:?}");
    }
    // A master dying mid-call: a transport error the client made.
    let mut broken = Status::unknown("h2 protocol error: error reading a body from connection");
    broken.set_source(Arc::new(std::io::Error::from(
        std::io::ErrorKind::ConnectionReset,
    )));
    assert!(may_retry(&broken));
    assert!(!not_applied(&broken));
    assert!(!may_retry(&Status::invalid_argument("bad")));
    assert!(!may_retry(&Status::failed_precondition("no")));
    // A real refused connection, made by tonic.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", dead_addr()))
        .unwrap()
        .connect_lazy();
    let status = pb::operator_client::OperatorClient::new(channel)
        .submit_job(pb::SubmitJobRequest::default())
        .await
        .unwrap_err();
    assert!(never_sent(&status), "{status:?}");
    assert!(not_applied(&status), "{status:?}");
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
    assert_eq!(m.addr(), new_addr);
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
    assert_eq!(m.addr(), leader_addr);
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
    assert_eq!(m.addr(), addr);
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
    assert_eq!(m.addr(), leader_addr);
    assert_eq!(stale.count("submit"), 2);
    assert_eq!(leader.count("submit"), 1);
}

#[tokio::test]
async fn a_submit_refused_by_every_master_is_an_ordinary_failure() {
    // No leader anywhere: every try was refused before proposing.
    let a = Node::new(Role::Follower(None));
    let b = Node::new(Role::Follower(None));
    let mut m = Master::connect(&[serve(a.clone()).await, serve(b.clone()).await])
        .await
        .unwrap();
    m.retry_for = Duration::from_millis(700);
    let started = std::time::Instant::now();
    let (r, _) = run_cmd(&mut m, &["jobs", "submit", "--name", "x", "--", "true"]).await;
    let err = r.unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "no longer search"
    );
    assert_eq!(err.exit_code(), EXIT_FAILURE, "{err}");
    let msg = err.to_string();
    assert!(!msg.contains("unknown"), "{msg}");
    assert!(msg.contains("no leader is elected yet"), "{msg}");
}

#[tokio::test]
async fn a_submit_that_may_have_been_applied_ends_with_an_unknown_outcome() {
    // The leader lost leadership while committing, then no master leads.
    let ambiguous = Node::new(Role::Ambiguous);
    let electing = Node::new(Role::Follower(None));
    let mut m = Master::connect(&[
        serve(ambiguous.clone()).await,
        serve(electing.clone()).await,
    ])
    .await
    .unwrap();
    m.retry_for = Duration::from_millis(500);
    let started = std::time::Instant::now();
    let (r, out) = run_cmd(&mut m, &["jobs", "submit", "--name", "x", "--", "true"]).await;
    let err = r.unwrap_err();
    let took = started.elapsed();
    assert_eq!(out, "", "no job id printed");
    assert_eq!(err.exit_code(), EXIT_UNKNOWN, "{err}");
    // Every try carried one key, and the error names it and what to run.
    let keys: Vec<String> = ambiguous
        .submit_keys
        .lock()
        .unwrap()
        .iter()
        .chain(electing.submit_keys.lock().unwrap().iter())
        .cloned()
        .collect();
    assert!(keys.len() >= 2, "{keys:?}");
    assert!(keys.iter().all(|k| *k == keys[0]), "{keys:?}");
    let msg = err.to_string();
    assert!(msg.starts_with("the outcome is unknown"), "{msg}");
    assert!(
        msg.contains(&format!("gpuctl jobs get --request-id {}", keys[0])),
        "{msg}"
    );
    assert!(msg.contains(&format!("--request-id {}", keys[0])), "{msg}");
    assert!(
        msg.contains("Last error: no master served the call within 2s"),
        "{msg}"
    );
    assert!(!msg.contains('\n'), "{msg}");
    // Once a try may have been applied the search lasts 4 times as long.
    assert!(took >= Duration::from_millis(1500), "{took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
}

#[tokio::test]
async fn a_given_request_id_is_sent_and_finds_its_job() {
    let leader = Node::new(Role::Leader);
    let mut m = Master::connect(&[serve(leader.clone()).await])
        .await
        .unwrap();
    let (r, out) = run_cmd(
        &mut m,
        &[
            "jobs",
            "submit",
            "--name",
            "x",
            "--request-id",
            "nightly-2026-11-26",
            "--",
            "true",
        ],
    )
    .await;
    assert_eq!(r.unwrap(), EXIT_OK);
    assert_eq!(out, "job-7\n");
    assert_eq!(
        *leader.submit_keys.lock().unwrap(),
        vec!["nightly-2026-11-26".to_string()]
    );
    let (r, out) = run_cmd(
        &mut m,
        &[
            "jobs",
            "get",
            "--request-id",
            "nightly-2026-11-26",
            "--json",
        ],
    )
    .await;
    assert_eq!(r.unwrap(), EXIT_OK);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["id"], "job-7");
    // A key no submit carried: not found, exit 3, naming the key.
    let (r, _) = run_cmd(&mut m, &["jobs", "get", "--request-id", "never-sent"]).await;
    let err = r.unwrap_err();
    assert_eq!(err.exit_code(), EXIT_NOT_FOUND);
    assert!(err.to_string().contains("never-sent"), "{err}");
}

#[tokio::test]
async fn a_removal_resent_after_an_unknown_outcome_that_finds_it_gone_succeeds() {
    // The first try's outcome is unknown (it did remove master 2); the
    // resend finds master 2 no member.
    let ambiguous = Node::new(Role::Ambiguous);
    let leader = Node::new(Role::Leader);
    leader.members.lock().unwrap().retain(|m| m.id != 2);
    let mut m = Master::connect(&[serve(ambiguous.clone()).await, serve(leader.clone()).await])
        .await
        .unwrap();
    let (r, out) = run_cmd(&mut m, &["masters", "remove", "2", "--json"]).await;
    assert_eq!(r.unwrap(), EXIT_OK);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v.as_array().map(Vec::len), Some(1), "{out}");
    assert_eq!(ambiguous.count("remove"), 1);
    assert_eq!(leader.count("remove"), 1);
    // Without an unknown try before, a non-member is not found.
    let (r, _) = run_cmd(&mut m, &["masters", "remove", "5"]).await;
    let err = r.unwrap_err();
    assert_eq!(err.exit_code(), EXIT_NOT_FOUND, "{err}");
}

#[tokio::test]
async fn idempotent_changes_with_an_unknown_outcome_say_so_too() {
    let ambiguous = Node::new(Role::Ambiguous);
    let mut m = Master::connect(&[serve(ambiguous.clone()).await])
        .await
        .unwrap();
    m.retry_for = Duration::from_millis(300);
    let (r, _) = run_cmd(&mut m, &["jobs", "cancel", "job-7"]).await;
    let err = r.unwrap_err();
    assert_eq!(err.exit_code(), EXIT_UNKNOWN, "{err}");
    assert!(
        err.to_string()
            .contains("`gpuctl jobs cancel job-7` again is safe"),
        "{err}"
    );
    // A read after the same failures is an ordinary failure.
    let (r, _) = run_cmd(&mut m, &["jobs", "list"]).await;
    assert_eq!(r.unwrap_err().exit_code(), EXIT_FAILURE);
}
