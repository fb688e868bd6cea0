//! The agent-facing and operator services of one in-process master, over
//! gRPC on 127.0.0.1: the registration's fence contract (fence timeout
//! sent, kill grace checked), runtime health in heartbeats, the
//! UNREACHABLE agent sent back to registration, drains, finished jobs
//! forgotten after the job retention, a registration that changes nothing
//! left unwritten, status updates in batches and a job
//! followed with WatchJob.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use gpuctl_master::MasterConfig;
use gpuctl_proto::pb;
use gpuctl_proto::pb::agent_manager_client::AgentManagerClient;
use gpuctl_proto::pb::operator_client::OperatorClient;
use tonic::transport::Channel;

struct Master {
    addr: String,
    _dir: tempfile::TempDir,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Master {
    async fn start(tune: impl FnOnce(&mut MasterConfig)) -> Master {
        let dir = tempfile::tempdir().unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut config = MasterConfig::new(addr, dir.path().join("data"));
        config.heartbeat_interval = Duration::from_millis(100);
        config.election_timeout = Duration::from_millis(200);
        tune(&mut config);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            gpuctl_master::serve(config, listener, async {
                let _ = rx.await;
            })
            .await
            .unwrap();
        });
        let m = Master {
            addr: addr.to_string(),
            _dir: dir,
            stop: Some(tx),
            task,
        };
        // Serving once it answers a read.
        for _ in 0..200 {
            if let Ok(mut op) = m.operator().await {
                if op.list_agents(pb::ListAgentsRequest {}).await.is_ok() {
                    return m;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("master at {} never served", m.addr);
    }

    async fn channel(&self) -> Result<Channel, tonic::transport::Error> {
        Channel::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
    }

    async fn agents(&self) -> AgentManagerClient<Channel> {
        AgentManagerClient::new(self.channel().await.unwrap())
    }

    async fn operator(&self) -> Result<OperatorClient<Channel>, tonic::transport::Error> {
        Ok(OperatorClient::new(self.channel().await?))
    }

    async fn agent(&self, id: &str) -> pb::Agent {
        let mut op = self.operator().await.unwrap();
        op.list_agents(pb::ListAgentsRequest {})
            .await
            .unwrap()
            .into_inner()
            .agents
            .into_iter()
            .find(|a| a.id == id)
            .unwrap()
    }

    async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), self.task).await;
    }
}

fn register(id: &str, kill_grace_ms: u32) -> pb::RegisterRequest {
    pb::RegisterRequest {
        agent_id: id.into(),
        hostname: format!("{id}.host"),
        address: "127.0.0.1:9".into(),
        total: Some(pb::Resources {
            cpus: 4.0,
            mem_mib: 4096,
            gpus: 0,
            ports: 0,
        }),
        runtimes: vec![pb::Runtime::Docker as i32, pb::Runtime::Process as i32],
        kill_grace_ms,
        ..Default::default()
    }
}

#[tokio::test]
async fn registration_sends_the_fence_timeout_and_refuses_a_kill_grace_that_does_not_fit() {
    let m = Master::start(|_| {}).await;
    let mut agents = m.agents().await;
    // An older agent (no kill grace): 75 + 10 + 5 < 120.
    let r = agents
        .register(register("old", 0))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.fence_timeout_ms, 75_000);
    assert_eq!(r.heartbeat_interval_ms, 100);
    agents.register(register("quick", 39_000)).await.unwrap();
    // 75 + 40 + 5 = 120: refused, naming the numbers.
    let err = agents.register(register("slow", 40_000)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    for needle in ["slow", "75", "40", "120", "agent_lost_timeout_secs"] {
        assert!(
            err.message().contains(needle),
            "{needle}: {}",
            err.message()
        );
    }
    let mut op = m.operator().await.unwrap();
    let listed = op
        .list_agents(pb::ListAgentsRequest {})
        .await
        .unwrap()
        .into_inner()
        .agents;
    assert!(listed.iter().all(|a| a.id != "slow"));
    m.stop().await;
}

/// The master's applied Raft index, as it reports it.
async fn applied_index(m: &Master) -> u64 {
    let mut op = m.operator().await.unwrap();
    op.list_masters(pb::ListMastersRequest {})
        .await
        .unwrap()
        .into_inner()
        .masters
        .into_iter()
        .find(|x| x.answered)
        .unwrap()
        .applied_index
}

/// The applied index once it has not moved for 300 ms: the index
/// ListMasters reports is published a moment after an entry applies, and
/// a new leader writes entries of its own around the time it starts
/// serving.
async fn settled_applied_index(m: &Master) -> u64 {
    let mut last = applied_index(m).await;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = applied_index(m).await;
        if now == last {
            return now;
        }
        last = now;
    }
}

#[tokio::test]
async fn a_registration_that_changes_nothing_is_answered_without_a_raft_write() {
    let m = Master::start(|_| {}).await;
    let mut agents = m.agents().await;
    let first = agents
        .register(register("a1", 1_000))
        .await
        .unwrap()
        .into_inner();
    let written = settled_applied_index(&m).await;
    // What every agent does when a new leader takes over: the same again.
    let again = agents
        .register(register("a1", 1_000))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again, first, "the same answer");
    assert_eq!(settled_applied_index(&m).await, written, "nothing written");
    // Anything new is written: here its hostname.
    let mut moved = register("a1", 1_000);
    moved.hostname = "a1.elsewhere".into();
    agents.register(moved).await.unwrap();
    assert_eq!(m.agent("a1").await.hostname, "a1.elsewhere");
    // (The index ListMasters reports follows the apply by a moment.)
    assert!(settled_applied_index(&m).await > written);
    m.stop().await;
}

#[tokio::test]
async fn heartbeats_carry_runtime_health_and_an_unreachable_agent_must_register_again() {
    let m = Master::start(|c| {
        c.agent_timeout = Duration::from_millis(600);
        c.agent_fence_timeout = Duration::from_secs(5);
        c.agent_lost_timeout = Duration::from_secs(60);
    })
    .await;
    let mut agents = m.agents().await;
    agents.register(register("a1", 1_000)).await.unwrap();
    agents
        .heartbeat(pb::HeartbeatRequest {
            mig_results: vec![],
            agent_id: "a1".into(),
            gpus: vec![],
            runtimes: vec![
                pb::RuntimeStatus {
                    runtime: pb::Runtime::Docker as i32,
                    available: false,
                    message: "Cannot connect to the Docker daemon".into(),
                },
                pb::RuntimeStatus {
                    runtime: pb::Runtime::Process as i32,
                    available: true,
                    message: String::new(),
                },
            ],
        })
        .await
        .unwrap();
    let a = m.agent("a1").await;
    assert_eq!(a.state, pb::AgentState::AgentActive as i32);
    assert_eq!(a.runtime_status.len(), 2);
    assert!(!a.runtime_status[0].available);
    assert_eq!(
        a.runtime_status[0].message,
        "Cannot connect to the Docker daemon"
    );
    // A bad runtime in a heartbeat is refused naming the field.
    let err = agents
        .heartbeat(pb::HeartbeatRequest {
            mig_results: vec![],
            agent_id: "a1".into(),
            gpus: vec![],
            runtimes: vec![pb::RuntimeStatus {
                runtime: 42,
                available: true,
                message: String::new(),
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("runtimes.runtime"),
        "{}",
        err.message()
    );
    // Silent past the agent timeout: UNREACHABLE, and its heartbeat is
    // sent back to registration.
    let mut unreachable = None;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let a = m.agent("a1").await;
        if a.state == pb::AgentState::AgentUnreachable as i32 {
            unreachable = Some(a);
            break;
        }
    }
    let a = unreachable.expect("agent a1 never became UNREACHABLE");
    assert_ne!(a.unreachable_since_ms, 0);
    assert!(
        a.runtime_status.is_empty(),
        "a silent agent's report is stale"
    );
    let err = agents
        .heartbeat(pb::HeartbeatRequest {
            mig_results: vec![],
            agent_id: "a1".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    assert!(err.message().contains("unreachable"), "{}", err.message());
    // The leader heard it all the same: the agent's fence counts from it.
    assert!(gpuctl_proto::leader::heard(&err));
    // An agent the master never registered was not heard of.
    let err = agents
        .heartbeat(pb::HeartbeatRequest {
            mig_results: vec![],
            agent_id: "nobody".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    assert!(!gpuctl_proto::leader::heard(&err));
    agents.register(register("a1", 1_000)).await.unwrap();
    let a = m.agent("a1").await;
    assert_eq!(a.state, pb::AgentState::AgentActive as i32);
    assert_eq!(a.unreachable_since_ms, 0);
    m.stop().await;
}

/// Issue 32: an UNREACHABLE agent whose heartbeats the leader hears (while
/// it cannot register again, e.g. the masters are slow to commit) is not
/// declared LOST: its fence counts from those answers, so the lost timeout
/// must too.
#[tokio::test]
async fn an_unreachable_agent_that_keeps_heartbeating_is_not_declared_lost() {
    let m = Master::start(|c| {
        c.agent_timeout = Duration::from_millis(500);
        c.agent_fence_timeout = Duration::from_secs(1);
        c.agent_lost_timeout = Duration::from_secs(8);
    })
    .await;
    let mut agents = m.agents().await;
    agents.register(register("a1", 1_000)).await.unwrap();
    let mut unreachable = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if m.agent("a1").await.state == pb::AgentState::AgentUnreachable as i32 {
            unreachable = true;
            break;
        }
    }
    assert!(unreachable, "agent a1 never became UNREACHABLE");
    // Past the lost timeout, heartbeating (each refused: it must register).
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < until {
        let err = agents
            .heartbeat(pb::HeartbeatRequest {
                mig_results: vec![],
                agent_id: "a1".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert!(gpuctl_proto::leader::heard(&err), "{err:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(
        m.agent("a1").await.state,
        pb::AgentState::AgentUnreachable as i32,
        "declared lost while heard"
    );
    // Silent now: lost after the timeout, as before.
    let mut lost = false;
    for _ in 0..150 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if m.agent("a1").await.state == pb::AgentState::AgentLost as i32 {
            lost = true;
            break;
        }
    }
    assert!(lost, "a silent agent was never declared lost");
    m.stop().await;
}

#[tokio::test]
async fn drain_and_undrain_through_the_operator_api() {
    let m = Master::start(|_| {}).await;
    let mut agents = m.agents().await;
    agents.register(register("a1", 0)).await.unwrap();
    let mut op = m.operator().await.unwrap();
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let a = op
        .drain_agent(pb::DrainAgentRequest {
            agent_id: "a1".into(),
            kill: false,
            deadline_secs: Some(30.0),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(a.draining);
    assert!(
        a.drain_deadline_ms >= before + 30_000,
        "{}",
        a.drain_deadline_ms
    );
    assert!(m.agent("a1").await.draining);
    // It survives the agent registering again.
    agents.register(register("a1", 0)).await.unwrap();
    assert!(m.agent("a1").await.draining);
    let err = op
        .drain_agent(pb::DrainAgentRequest {
            agent_id: "a1".into(),
            kill: false,
            deadline_secs: Some(-1.0),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("deadline_secs"), "{}", err.message());
    let err = op
        .drain_agent(pb::DrainAgentRequest {
            agent_id: "nope".into(),
            kill: true,
            deadline_secs: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    let a = op
        .undrain_agent(pb::UndrainAgentRequest {
            agent_id: "a1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!a.draining);
    assert_eq!(a.drain_deadline_ms, 0);
    m.stop().await;
}

#[tokio::test]
async fn a_master_refuses_to_start_with_misordered_timeouts() {
    let dir = tempfile::tempdir().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut config = MasterConfig::new(listener.local_addr().unwrap(), dir.path().join("d"));
    config.agent_lost_timeout = config.agent_fence_timeout;
    let err = gpuctl_master::serve(config, listener, async {})
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("agent_lost_timeout_secs") && err.contains("agent_fence_timeout_secs"),
        "{err}"
    );
}

#[tokio::test]
async fn a_finished_job_is_forgotten_after_the_retention_and_get_says_so() {
    let m = Master::start(|c| {
        c.retention.max_age = Duration::from_millis(500);
    })
    .await;
    let mut op = m.operator().await.unwrap();
    let submit = |name: &str| pb::SubmitJobRequest {
        spec: Some(pb::JobSpec {
            name: name.into(),
            command: vec!["true".into()],
            resources: Some(pb::Resources {
                cpus: 0.5,
                mem_mib: 0,
                gpus: 0,
                ports: 0,
            }),
            ..Default::default()
        }),
        request_id: format!("key-{name}"),
    };
    // No agent: the first stays queued (never forgotten), the second is
    // cancelled at once (finished).
    let queued = op
        .submit_job(submit("queued"))
        .await
        .unwrap()
        .into_inner()
        .job_id;
    let done = op
        .submit_job(submit("done"))
        .await
        .unwrap()
        .into_inner()
        .job_id;
    op.cancel_job(pb::CancelJobRequest {
        job_id: done.clone(),
    })
    .await
    .unwrap();
    let listed = |op: &mut OperatorClient<Channel>| {
        let mut op = op.clone();
        async move {
            op.list_jobs(pb::ListJobsRequest::default())
                .await
                .unwrap()
                .into_inner()
                .jobs
                .into_iter()
                .map(|j| j.id)
                .collect::<Vec<_>>()
        }
    };
    // Recent: listed, newest first.
    assert_eq!(listed(&mut op).await, vec![done.clone(), queued.clone()]);
    let mut gone = false;
    for _ in 0..100 {
        if listed(&mut op).await == vec![queued.clone()] {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "{done} still listed after 10 s");
    let err = op
        .get_job(pb::GetJobRequest {
            job_id: done.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    assert!(
        err.message().contains(&format!("job {done} not found"))
            && err.message().contains("forgotten")
            && err.message().contains("--job-retention"),
        "{}",
        err.message()
    );
    // A job never submitted is merely not found.
    let err = op
        .get_job(pb::GetJobRequest {
            job_id: "job-99".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.message(), "job job-99 not found");
    // A resent submit of the forgotten job gets its id, not a second job.
    let again = op
        .submit_job(submit("done"))
        .await
        .unwrap()
        .into_inner()
        .job_id;
    assert_eq!(again, done);
    assert_eq!(listed(&mut op).await, vec![queued]);
    m.stop().await;
}

#[tokio::test]
async fn status_updates_in_one_call_get_one_verdict_each_and_a_watch_follows_the_job_to_its_end() {
    let m = Master::start(|_| {}).await;
    let mut agents = m.agents().await;
    agents.register(register("a1", 0)).await.unwrap();
    let mut op = m.operator().await.unwrap();
    let job_id = op
        .submit_job(pb::SubmitJobRequest {
            spec: Some(pb::JobSpec {
                name: "batched".into(),
                command: vec!["true".into()],
                resources: Some(pb::Resources {
                    cpus: 0.5,
                    mem_mib: 0,
                    gpus: 0,
                    ports: 0,
                }),
                ..Default::default()
            }),
            request_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .job_id;
    let mut watch = op
        .watch_job(pb::GetJobRequest {
            job_id: job_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(first.id, job_id);
    // The built-in scheduler places it on a1.
    let task_id = format!("{job_id}.0");
    let mut placed = false;
    for _ in 0..100 {
        let job = op
            .get_job(pb::GetJobRequest {
                job_id: job_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        if job.tasks.iter().any(|t| t.id == task_id) {
            placed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(placed, "{job_id} never placed");
    let update = |task: &str, state: pb::TaskState, uuid: &[u8]| pb::StatusUpdate {
        agent_id: "a1".into(),
        task_id: task.into(),
        state: state as i32,
        uuid: uuid.to_vec(),
        exit_code: (state == pb::TaskState::TaskFinished).then_some(0),
        ..Default::default()
    };
    use pb::status_verdict::Kind;
    let verdicts = agents
        .update_statuses(pb::StatusUpdates {
            updates: vec![
                update(&task_id, pb::TaskState::TaskRunning, b"u1"),
                // Another agent's word on a1's task: refused for good.
                pb::StatusUpdate {
                    agent_id: "a2".into(),
                    ..update(&task_id, pb::TaskState::TaskFailed, b"u2")
                },
            ],
        })
        .await
        .unwrap()
        .into_inner()
        .verdicts;
    let kinds: Vec<i32> = verdicts.iter().map(|v| v.kind).collect();
    // The jobs' own updates need no framework's acknowledgement.
    assert_eq!(
        kinds,
        vec![Kind::Acknowledged as i32, Kind::Refused as i32],
        "{verdicts:?}"
    );
    assert!(verdicts[1].message.contains("agent a2"), "{verdicts:?}");
    let ended = agents
        .update_statuses(pb::StatusUpdates {
            updates: vec![update(&task_id, pb::TaskState::TaskFinished, b"u3")],
        })
        .await
        .unwrap()
        .into_inner()
        .verdicts;
    assert_eq!(ended[0].kind, Kind::Acknowledged as i32, "{ended:?}");
    // The watch saw the changes and ends with the job.
    let mut last = first;
    while let Some(job) = tokio::time::timeout(Duration::from_secs(10), watch.message())
        .await
        .expect("the watch ends with the job")
        .unwrap()
    {
        last = job;
    }
    assert_eq!(last.state, pb::JobState::JobSucceeded as i32, "{last:?}");
    // A batch past the limit is refused whole, naming the field.
    let too_many = vec![update(&task_id, pb::TaskState::TaskRunning, b"x"); 1025];
    let err = agents
        .update_statuses(pb::StatusUpdates { updates: too_many })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("updates"), "{}", err.message());
    m.stop().await;
}
