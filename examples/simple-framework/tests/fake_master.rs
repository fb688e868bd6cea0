//! Runs the `simple-framework` binary against a fake master: an in-process
//! Scheduler service that offers resources, answers launches with status
//! updates and records every call.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuctl_proto::pb::{self, event::Event, scheduler_server};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status};

/// How the fake master answers a launched task.
#[derive(Clone, Copy)]
enum Script {
    /// RUNNING, then FINISHED exit 0; `task-2` is LOST on its first attempt.
    AllFinishLosingOne,
    /// `task-1` FAILED with exit 3.
    OneFails,
    /// Never sends an offer.
    NoOffers,
    /// Sends ERROR right after SUBSCRIBED.
    Error,
    /// Ends the first stream right after SUBSCRIBED (a master losing
    /// leadership), then goes on like `AllFinishLosingOne`.
    FailoverOnce,
}

struct Fake {
    script: Script,
    subscriptions: Mutex<u32>,
    calls: Arc<Mutex<Vec<String>>>,
    events: Mutex<Option<mpsc::Sender<Result<pb::Event, Status>>>>,
}

fn event(e: Event) -> Result<pb::Event, Status> {
    Ok(pb::Event { event: Some(e) })
}

fn offer(id: &str, gpus: usize) -> Event {
    let gpus: Vec<pb::Gpu> = (0..gpus)
        .map(|i| pb::Gpu {
            uuid: format!("GPU-{i}"),
            healthy: true,
            ..Default::default()
        })
        .collect();
    Event::Offers(pb::Offers {
        offers: vec![pb::Offer {
            id: id.into(),
            framework_id: "fw-1".into(),
            agent_id: "a1".into(),
            resources: Some(pb::Resources {
                cpus: 1.0,
                mem_mib: 1024,
                gpus: gpus.len() as u32,
                ports: 0,
            }),
            gpus,
            ..Default::default()
        }],
    })
}

fn update(task_id: &str, state: pb::TaskState, exit_code: Option<i32>) -> Event {
    Event::Update(pb::TaskStatus {
        task_id: task_id.into(),
        agent_id: "a1".into(),
        state: state as i32,
        exit_code,
        uuid: format!("u-{task_id}-{}", state.as_str_name()).into_bytes(),
        ..Default::default()
    })
}

impl Fake {
    fn record(&self, call: String) {
        self.calls.lock().expect("calls").push(call);
    }

    async fn send(&self, e: Event) {
        let tx = self.events.lock().expect("events").clone();
        if let Some(tx) = tx {
            tx.send(event(e)).await.expect("stream open");
        }
    }
}

#[tonic::async_trait]
impl scheduler_server::Scheduler for Fake {
    type SubscribeStream = ReceiverStream<Result<pb::Event, Status>>;

    async fn subscribe(
        &self,
        request: Request<pb::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let info = request.into_inner().framework.unwrap_or_default();
        let nth = {
            let mut n = self.subscriptions.lock().expect("subscriptions");
            *n += 1;
            *n
        };
        if nth > 1 {
            self.record(format!("subscribe again as {:?}", info.id));
        } else {
            self.record(format!(
                "subscribe {} roles={:?} caps={:?} failover={}",
                info.name, info.roles, info.capabilities, info.failover_timeout_secs
            ));
        }
        let (tx, rx) = mpsc::channel(64);
        *self.events.lock().expect("events") = Some(tx);
        self.send(Event::Subscribed(pb::Subscribed {
            framework_id: "fw-1".into(),
            heartbeat_interval_secs: 15.0,
        }))
        .await;
        match self.script {
            Script::FailoverOnce if nth == 1 => {
                // Dropping the only sender ends the stream after SUBSCRIBED.
                *self.events.lock().expect("events") = None;
            }
            Script::NoOffers => {}
            Script::Error => self.send(Event::Error("framework removed".into())).await,
            _ => {
                self.send(offer("o1", 2)).await;
                self.send(offer("o-unused", 0)).await;
            }
        }
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn accept(
        &self,
        request: Request<pb::AcceptRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let r = request.into_inner();
        let mut tasks = Vec::new();
        for op in r.operations {
            if let Some(pb::operation::Operation::Launch(l)) = op.operation {
                tasks.extend(l.tasks);
            }
        }
        let described: Vec<String> = tasks
            .iter()
            .map(|t| format!("{}:{}", t.task_id, t.gpu_uuids.join("+")))
            .collect();
        self.record(format!(
            "accept {} {:?} refuse={:?}",
            r.offer_ids.join(","),
            described,
            r.filters.and_then(|f| f.refuse_seconds)
        ));
        for t in tasks {
            let id = t.task_id.as_str();
            match (self.script, id) {
                (Script::AllFinishLosingOne, "task-2") => {
                    self.send(update(id, pb::TaskState::TaskLost, None)).await
                }
                (Script::OneFails, "task-1") => {
                    self.send(update(id, pb::TaskState::TaskFailed, Some(3)))
                        .await
                }
                _ => {
                    self.send(update(id, pb::TaskState::TaskRunning, None))
                        .await;
                    self.send(update(id, pb::TaskState::TaskFinished, Some(0)))
                        .await;
                }
            }
        }
        Ok(Response::new(pb::CallResponse {}))
    }

    async fn decline(
        &self,
        request: Request<pb::DeclineRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let r = request.into_inner();
        self.record(format!(
            "decline {} refuse={:?}",
            r.offer_ids.join(","),
            r.filters.and_then(|f| f.refuse_seconds)
        ));
        Ok(Response::new(pb::CallResponse {}))
    }

    async fn revive(
        &self,
        _: Request<pb::ReviveRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        self.record("revive".into());
        self.send(offer("o2", 0)).await;
        Ok(Response::new(pb::CallResponse {}))
    }

    async fn suppress(
        &self,
        _: Request<pb::SuppressRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        self.record("suppress".into());
        Ok(Response::new(pb::CallResponse {}))
    }

    async fn kill(
        &self,
        _: Request<pb::KillRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        Err(Status::unimplemented("kill"))
    }

    async fn acknowledge(
        &self,
        request: Request<pb::AcknowledgeRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        let r = request.into_inner();
        self.record(format!(
            "ack {} {} {} {}",
            r.framework_id,
            r.agent_id,
            r.task_id,
            String::from_utf8_lossy(&r.uuid)
        ));
        Ok(Response::new(pb::CallResponse {}))
    }

    async fn reconcile(
        &self,
        _: Request<pb::ReconcileRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        Err(Status::unimplemented("reconcile"))
    }

    async fn teardown(
        &self,
        request: Request<pb::TeardownRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        self.record(format!("teardown {}", request.into_inner().framework_id));
        Ok(Response::new(pb::CallResponse {}))
    }

    async fn update_framework(
        &self,
        _: Request<pb::UpdateFrameworkRequest>,
    ) -> Result<Response<pb::CallResponse>, Status> {
        Err(Status::unimplemented("update_framework"))
    }
}

struct Run {
    code: Option<i32>,
    stdout: String,
    calls: Vec<String>,
}

/// Serves a fake master with `script` and runs the framework against it.
async fn run(script: Script, args: &[&str]) -> Run {
    run_with(script, args, false).await
}

/// A follower: answers every Scheduler call with a redirect to `leader`.
#[derive(Clone)]
struct Redirector {
    leader: String,
}

impl tonic::server::NamedService for Redirector {
    const NAME: &'static str = "gpuctl.v1.Scheduler";
}

impl tonic::codegen::Service<tonic::codegen::http::Request<tonic::body::BoxBody>> for Redirector {
    type Response = tonic::codegen::http::Response<tonic::body::BoxBody>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: tonic::codegen::http::Request<tonic::body::BoxBody>) -> Self::Future {
        let status = gpuctl_proto::leader::not_leader(Some((1, &self.leader)));
        std::future::ready(Ok(status.into_http()))
    }
}

/// Like `run`; with `redirect`, the framework is only given a follower
/// (after a dead address) that names the fake as the leader.
async fn run_with(script: Script, args: &[&str], redirect: bool) -> Run {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let calls = Arc::new(Mutex::new(Vec::new()));
    let fake = Fake {
        script,
        subscriptions: Mutex::new(0),
        calls: calls.clone(),
        events: Mutex::new(None),
    };
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(scheduler_server::SchedulerServer::new(fake))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    // An address where nobody listens comes first: the framework moves on.
    let mut masters = format!("127.0.0.1:1,{addr}");
    let mut follower = None;
    if redirect {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        masters = format!("127.0.0.1:1,{}", listener.local_addr().expect("addr"));
        follower = Some(tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(Redirector {
                    leader: addr.to_string(),
                })
                .serve_with_incoming(TcpListenerStream::new(listener)),
        ));
    }
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_simple-framework"))
            .args(["--master", &masters])
            .args(args)
            .output(),
    )
    .await
    .expect("the framework ends")
    .expect("the framework runs");
    server.abort();
    if let Some(f) = follower {
        f.abort();
    }
    eprintln!("{}", String::from_utf8_lossy(&output.stderr));
    let calls = calls.lock().expect("calls").clone();
    Run {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        calls,
    }
}

#[tokio::test]
async fn launches_acknowledges_relaunches_and_tears_down() {
    let r = run(
        Script::AllFinishLosingOne,
        &[
            "--tasks",
            "3",
            "--gpu-tasks",
            "2",
            "--json",
            "--",
            "sh",
            "-c",
            "true",
        ],
    )
    .await;
    assert_eq!(r.code, Some(0), "calls: {:#?}", r.calls);
    let expected = [
        "subscribe simple-framework roles=[\"default\"] caps=[1] failover=60",
        "accept o1 [\"task-0:GPU-0\", \"task-1:GPU-1\", \"task-2:\"] refuse=Some(1.0)",
        "suppress",
        "decline o-unused refuse=Some(5.0)",
        "ack fw-1 a1 task-0 u-task-0-TASK_RUNNING",
        "ack fw-1 a1 task-0 u-task-0-TASK_FINISHED",
        "ack fw-1 a1 task-1 u-task-1-TASK_RUNNING",
        "ack fw-1 a1 task-1 u-task-1-TASK_FINISHED",
        "ack fw-1 a1 task-2 u-task-2-TASK_LOST",
        "revive",
        "accept o2 [\"task-2-r1:\"] refuse=Some(1.0)",
        "suppress",
        "ack fw-1 a1 task-2-r1 u-task-2-r1-TASK_RUNNING",
        "ack fw-1 a1 task-2-r1 u-task-2-r1-TASK_FINISHED",
        "teardown fw-1",
    ];
    assert_eq!(r.calls, expected);
    let json: serde_json::Value = serde_json::from_str(&r.stdout).expect("JSON on stdout");
    assert_eq!(json["framework_id"], "fw-1");
    assert_eq!(json["tasks"][0]["gpus"], serde_json::json!(["GPU-0"]));
    assert_eq!(json["tasks"][2]["id"], "task-2-r1");
    for t in json["tasks"].as_array().expect("tasks") {
        assert_eq!(t["state"], "FINISHED");
        assert_eq!(t["exit_code"], 0);
        assert_eq!(t["agent_id"], "a1");
    }
}

#[tokio::test]
async fn a_failed_task_exits_one() {
    let r = run(Script::OneFails, &["--tasks", "2", "--", "false"]).await;
    assert_eq!(r.code, Some(1));
    assert!(r.stdout.contains("task-1 FAILED exit=3\n"), "{}", r.stdout);
    assert!(
        r.stdout.contains("task-0 FINISHED exit=0\n"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.ends_with("1 finished, 1 failed\n"), "{}", r.stdout);
    assert_eq!(r.calls.last().map(String::as_str), Some("teardown fw-1"));
}

#[tokio::test]
async fn a_timeout_exits_two_and_tears_down() {
    let r = run(Script::NoOffers, &["--timeout", "1", "--", "true"]).await;
    assert_eq!(r.code, Some(2));
    assert!(r.stdout.ends_with("0 finished, 0 failed, 1 unfinished\n"));
    assert_eq!(r.calls.last().map(String::as_str), Some("teardown fw-1"));
}

#[tokio::test]
async fn an_error_event_exits_one() {
    let r = run(Script::Error, &["--", "true"]).await;
    assert_eq!(r.code, Some(1));
}

#[tokio::test]
async fn follows_a_redirect_to_the_leader() {
    let r = run_with(
        Script::AllFinishLosingOne,
        &["--tasks", "1", "--", "true"],
        true,
    )
    .await;
    assert_eq!(r.code, Some(0), "calls: {:#?}", r.calls);
    assert!(
        r.calls[0].starts_with("subscribe simple-framework"),
        "{:#?}",
        r.calls
    );
    assert_eq!(r.calls.last().map(String::as_str), Some("teardown fw-1"));
}

#[tokio::test]
async fn subscribes_again_with_its_id_when_the_stream_ends() {
    let r = run(Script::FailoverOnce, &["--tasks", "1", "--", "true"]).await;
    assert_eq!(r.code, Some(0), "calls: {:#?}", r.calls);
    assert_eq!(r.calls[1], "subscribe again as \"fw-1\"", "{:#?}", r.calls);
    assert!(
        r.calls.iter().any(|c| c.starts_with("accept o1")),
        "{:#?}",
        r.calls
    );
    assert_eq!(r.calls.last().map(String::as_str), Some("teardown fw-1"));
}
