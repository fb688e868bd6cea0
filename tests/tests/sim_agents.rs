//! The simulated agents (`gpuctl_tests::sim`) against a real master in
//! process: tasks that end by themselves (FINISHED, their GPUs given again)
//! and a cancelled one (KILLED) end their jobs as a real agent's would, and
//! the agents record when each step was acknowledged.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use gpuctl_proto::pb;
use gpuctl_proto::pb::operator_client::OperatorClient;
use gpuctl_tests::sim::{InProcessMaster, SimAgents, SimConfig};
use tonic::transport::Endpoint;

async fn eventually<F: std::future::Future<Output = bool>>(what: &str, mut f: impl FnMut() -> F) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sim_agents_run_finish_and_kill_tasks() {
    let dir = tempfile::tempdir().unwrap();
    let master = InProcessMaster::start(dir.path().join("master"), |_| {}).unwrap();
    let ch = Endpoint::from_shared(format!("http://{}", master.addr()))
        .unwrap()
        .connect_lazy();
    let ops = OperatorClient::new(ch);
    // Two agents of two GPUs; six one-GPU jobs, so some wait for GPUs freed
    // by tasks that finished.
    let sim = SimAgents::start(
        &[master.addr().to_string()],
        SimConfig {
            agents: 2,
            gpus_per_agent: 2,
            // Long enough that the cancel below comes first.
            run_time: Some(Duration::from_secs(2)),
            ..Default::default()
        },
    )
    .unwrap();
    eventually("both agents registered", || async { sim.registered() == 2 }).await;
    let mut ids = Vec::new();
    for n in 0..6 {
        let job = pb::JobSpec {
            name: format!("sim-{n}"),
            command: vec!["sleep".into(), "2".into()],
            resources: Some(pb::Resources {
                cpus: 1.0,
                mem_mib: 0,
                gpus: 1,
            }),
            ..Default::default()
        };
        let r = ops
            .clone()
            .submit_job(pb::SubmitJobRequest {
                spec: Some(job),
                ..Default::default()
            })
            .await
            .unwrap();
        ids.push(r.into_inner().job_id);
    }
    // Cancel the first job once it runs: its task is killed.
    eventually("a task RUNNING", || async {
        sim.counts().running_acked > 0
    })
    .await;
    let victim = sim
        .tasks()
        .into_iter()
        .find(|t| t.running_acked.is_some())
        .unwrap();
    ops.clone()
        .cancel_job(pb::CancelJobRequest {
            job_id: victim.job_id.clone(),
        })
        .await
        .unwrap();

    let state = |id: &str| {
        let (id, mut ops) = (id.to_string(), ops.clone());
        async move {
            ops.get_job(pb::GetJobRequest { job_id: id })
                .await
                .unwrap()
                .into_inner()
                .state
        }
    };
    eventually("every job ended", || async {
        sim.counts().ended_acked == 6
    })
    .await;
    for id in &ids {
        let want = if *id == victim.job_id {
            pb::JobState::JobCancelled
        } else {
            pb::JobState::JobSucceeded
        };
        assert_eq!(state(id).await, want as i32, "job {id}");
    }

    let tasks = sim.tasks();
    assert_eq!(tasks.len(), 6);
    for t in &tasks {
        let want = if t.job_id == victim.job_id {
            pb::TaskState::TaskKilled
        } else {
            pb::TaskState::TaskFinished
        };
        assert_eq!(t.end_state, Some(want), "{t:?}");
        let (running, ended) = (t.running_acked.unwrap(), t.ended_acked.unwrap());
        assert!(t.seen <= running && running <= ended, "{t:?}");
        assert_eq!(t.gpu_uuids.len(), 1);
    }
    // Four GPUs, six tasks: some GPU was given again once its task ended.
    let mut gpus: Vec<&String> = tasks.iter().flat_map(|t| &t.gpu_uuids).collect();
    gpus.sort();
    gpus.dedup();
    assert!(gpus.len() <= 4);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    drop(sim);
    drop(master);
}
