//! WatchTasks over the wire, against a real master in process: an agent
//! whose tasks carry more environment than gRPC's 4 MiB default message
//! limit gets them all through an incremental stream, and cancels reach it.
//! (The full-set stream of agents before incremental streams cannot carry
//! them: that is the failure the incremental stream exists for.)
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use gpuctl_core::desired::DesiredSet;
use gpuctl_proto::pb;
use gpuctl_proto::pb::agent_manager_client::AgentManagerClient;
use gpuctl_proto::pb::operator_client::OperatorClient;
use tonic::transport::Channel;

const JOBS: usize = 24;
/// Each job's env: 7 values of 32000 bytes, near the 256 KiB limit. 24
/// jobs: 5.4 MB.
const VARS: usize = 7;
const VALUE_BYTES: usize = 32_000;

fn env() -> std::collections::HashMap<String, String> {
    (0..VARS)
        .map(|i| (format!("BIG{i}"), "x".repeat(VALUE_BYTES)))
        .collect()
}

async fn start_master() -> (String, tempfile::TempDir, tokio::sync::oneshot::Sender<()>) {
    let dir = tempfile::tempdir().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = gpuctl_master::MasterConfig::new(addr, dir.path().join("data"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(gpuctl_master::serve(config, listener, async move {
        let _ = stopped.await;
    }));
    (format!("http://{addr}"), dir, stop)
}

async fn channel(addr: &str) -> Channel {
    for _ in 0..100 {
        if let Ok(c) = Channel::from_shared(addr.to_string())
            .unwrap()
            .connect()
            .await
        {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("master at {addr} did not come up");
}

fn register_request() -> pb::RegisterRequest {
    pb::RegisterRequest {
        agent_id: "a1".into(),
        hostname: "a1.host".into(),
        address: "127.0.0.1:1".into(),
        total: Some(pb::Resources {
            cpus: 64.0,
            mem_mib: 1 << 20,
            gpus: 0,
            ports: 0,
        }),
        runtimes: vec![pb::Runtime::Process as i32],
        simulated_gpus: true,
        ..Default::default()
    }
}

/// Retries `f` until it succeeds (the master elects itself first).
async fn until_ok<T, F, Fut>(mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let mut last = None;
    for _ in 0..200 {
        match f().await {
            Ok(v) => return v,
            Err(s) => last = Some(s),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never succeeded: {last:?}");
}

/// Applies stream messages until a complete set satisfies `done`.
async fn until_set(
    stream: &mut tonic::Streaming<pb::DesiredTasks>,
    set: &mut DesiredSet,
    done: impl Fn(&DesiredSet) -> bool,
) {
    let wait = async {
        loop {
            let msg = stream.message().await.unwrap().expect("stream ended");
            if set.apply_owned(msg).unwrap() && done(set) {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), wait)
        .await
        .expect("the desired set never arrived");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_gets_more_than_4_mib_of_tasks_incrementally() {
    let (addr, _dir, _stop) = start_master().await;
    let ch = channel(&addr).await;
    // Default limits: 4 MiB per message, as the agent has.
    let mut agents = AgentManagerClient::new(ch.clone());
    let mut operator = OperatorClient::new(ch);
    until_ok(|| {
        let mut c = agents.clone();
        async move { c.register(register_request()).await }
    })
    .await;
    // Keep the agent alive while the test runs.
    let mut hb = agents.clone();
    let beats = tokio::spawn(async move {
        loop {
            let _ = hb
                .heartbeat(pb::HeartbeatRequest {
                    mig_results: vec![],
                    agent_id: "a1".into(),
                    gpus: vec![],
                    runtimes: vec![],
                })
                .await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });

    let mut job_ids = Vec::new();
    for i in 0..JOBS {
        let spec = pb::JobSpec {
            name: format!("big-{i}"),
            command: vec!["sleep".into(), "600".into()],
            env: env(),
            resources: Some(pb::Resources {
                cpus: 0.5,
                mem_mib: 0,
                gpus: 0,
                ports: 0,
            }),
            ..Default::default()
        };
        let resp = operator
            .submit_job(pb::SubmitJobRequest {
                spec: Some(spec),
                request_id: String::new(),
            })
            .await
            .unwrap()
            .into_inner();
        job_ids.push(resp.job_id);
    }

    // An incremental stream brings every task, in messages under 1 MiB.
    let mut stream = agents
        .watch_tasks(pb::WatchTasksRequest {
            agent_id: "a1".into(),
            incremental: true,
        })
        .await
        .unwrap()
        .into_inner();
    let mut set = DesiredSet::new();
    until_set(&mut stream, &mut set, |s| s.run().len() == JOBS).await;
    assert!(set
        .run()
        .values()
        .all(|t| t.template.env.get("BIG6").map(String::len) == Some(VALUE_BYTES)));

    // Cancels reach it: the tasks move to the kill set.
    for id in &job_ids[..3] {
        operator
            .cancel_job(pb::CancelJobRequest { job_id: id.clone() })
            .await
            .unwrap();
    }
    until_set(&mut stream, &mut set, |s| {
        s.kill().len() == 3 && s.run().len() == JOBS - 3
    })
    .await;

    // An agent before incremental streams asks for the full set in one
    // message: more than 4 MiB, which its default limit refuses.
    let mut old = agents
        .watch_tasks(pb::WatchTasksRequest {
            agent_id: "a1".into(),
            incremental: false,
        })
        .await
        .unwrap()
        .into_inner();
    let err = old.message().await.unwrap_err();
    assert!(
        err.message().contains("message length too large"),
        "{err:?}"
    );
    beats.abort();
}
