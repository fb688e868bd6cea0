//! Scheduling throughput (issue 16): 400 one-GPU jobs submitted within a
//! second to a master with 50 agents of 8 GPUs must all be RUNNING well
//! before the offer timeout (30 s by default). The bug this guards against:
//! some RUNNING at once, then nothing until the offer timeout rescinded
//! offers the built-in scheduler had left unanswered.
//!
//! The master is the real one, in process (`gpuctl_master::serve` on its
//! own runtime and threads, as the binary runs it, with default options);
//! the agents are simulated (`gpuctl_tests::sim`), speaking its real agent
//! API, and the jobs go through the real Operator API. The bound is on
//! progress, generous for a loaded machine yet below the offer timeout,
//! which is what a stall would wait for. `GPUCTL_LOG` sets the master's log
//! filter; a failed run keeps the log.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpuctl_proto::pb;
use gpuctl_proto::pb::operator_client::OperatorClient;
use gpuctl_tests::sim::{InProcessMaster, SimAgents, SimConfig};
use tonic::transport::{Channel, Endpoint};

const AGENTS: usize = 50;
const GPUS_PER_AGENT: u32 = 8;
const JOBS: usize = 400;
/// Every job must be RUNNING this long after the submits began: well below
/// the 30 s offer timeout, well above what a working scheduler needs (a few
/// seconds, with a debug build on a busy machine).
const BOUND: Duration = Duration::from_secs(20);
const WAVES: usize = 8;
const WAVE_GAP: Duration = Duration::from_millis(100);

/// The master, in process, logging to a file in its temp dir.
struct Master {
    inner: Option<InProcessMaster>,
    log: std::path::PathBuf,
    dir: Option<tempfile::TempDir>,
}

impl Master {
    fn start() -> Master {
        let dir = gpuctl_tests::test_dir();
        let log = dir.path().join("master.log");
        // One test per binary: the subscriber is this process's.
        let file = std::fs::File::create(&log).unwrap();
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("GPUCTL_LOG")
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
            )
            .with_ansi(false)
            .with_writer(Mutex::new(file))
            .try_init();
        let inner = InProcessMaster::start(dir.path().join("master"), |_| {}).unwrap();
        Master {
            inner: Some(inner),
            log,
            dir: Some(dir),
        }
    }

    fn addr(&self) -> String {
        self.inner
            .as_ref()
            .map(|m| m.addr().to_string())
            .unwrap_or_default()
    }

    /// The log's size and its last warnings and errors.
    fn log_summary(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let bad: Vec<&str> = text
            .lines()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            .collect();
        let tail = &bad[bad.len().saturating_sub(20)..];
        format!(
            "master log {}: {} lines, {} warnings/errors, last ones:\n{}",
            self.log.display(),
            text.lines().count(),
            bad.len(),
            tail.join("\n")
        )
    }
}

impl Drop for Master {
    fn drop(&mut self) {
        drop(self.inner.take());
        // A failed test leaves its master's log and data to look at.
        if std::thread::panicking() {
            if let Some(dir) = self.dir.take() {
                eprintln!("master log and data kept in {}", dir.keep().display());
            }
        }
    }
}

fn operator(addr: &str) -> OperatorClient<Channel> {
    let ch = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(30))
        .connect_lazy();
    OperatorClient::new(ch)
}

fn job(n: usize) -> pb::JobSpec {
    pb::JobSpec {
        name: format!("throughput-{n}"),
        command: vec!["sleep".into(), "infinity".into()],
        resources: Some(pb::Resources {
            cpus: 1.0,
            mem_mib: 0,
            gpus: 1,
            ports: 0,
        }),
        ..Default::default()
    }
}

/// Every job, through ListJobs' pages.
async fn all_jobs(ops: &mut OperatorClient<Channel>) -> Vec<pb::Job> {
    let mut out = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = ops
            .list_jobs(pb::ListJobsRequest {
                limit: 1000,
                page_token: page_token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        out.extend(page.jobs);
        if page.next_page_token.is_empty() {
            return out;
        }
        page_token = page.next_page_token;
    }
}

async fn wait_until(what: &str, timeout: Duration, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn four_hundred_one_gpu_jobs_all_run_well_before_the_offer_timeout() {
    let master = Master::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let addr = master.addr();
        let mut ops = operator(&addr);
        wait_until("the master serves", Duration::from_secs(30), async || {
            ops.list_jobs(pb::ListJobsRequest::default()).await.is_ok()
        })
        .await;
        let sim = SimAgents::start(
            std::slice::from_ref(&addr),
            SimConfig {
                agents: AGENTS,
                gpus_per_agent: GPUS_PER_AGENT,
                ..Default::default()
            },
        )
        .unwrap();
        wait_until(
            "every agent registered",
            Duration::from_secs(30),
            async || sim.registered() == AGENTS,
        )
        .await;

        // Fifty at a time, a wave every 100 ms (a script or several users
        // submitting at once). A single burst of 400 lands in ~0.1 s and
        // strands the scheduler's offers only in some runs; waves make every
        // placement race the next offers, so a stall shows every time.
        let t0 = Instant::now();
        let submitter = tokio::spawn({
            let ops = ops.clone();
            async move {
                for (w, wave) in (0..JOBS)
                    .collect::<Vec<_>>()
                    .chunks(JOBS / WAVES)
                    .enumerate()
                {
                    tokio::time::sleep_until((t0 + WAVE_GAP * w as u32).into()).await;
                    let submits = wave.iter().map(|&n| {
                        let mut ops = ops.clone();
                        async move {
                            ops.submit_job(pb::SubmitJobRequest {
                                spec: Some(job(n)),
                                ..Default::default()
                            })
                            .await
                        }
                    });
                    for r in futures::future::join_all(submits).await {
                        r.expect("SubmitJob");
                    }
                }
                t0.elapsed()
            }
        });

        // Progress, as the agents see it: RUNNING acknowledged by the master.
        let mut timeline: Vec<(Duration, usize)> = vec![(Duration::ZERO, 0)];
        let mut running = 0;
        while running < JOBS && t0.elapsed() < BOUND {
            tokio::time::sleep(Duration::from_millis(20)).await;
            running = sim.counts().running_acked;
            if timeline.last().map(|l| l.1) != Some(running) {
                timeline.push((t0.elapsed(), running));
            }
        }
        let submitted = submitter.await.expect("every SubmitJob succeeded");
        let took = t0.elapsed();
        // The longest time nothing moved (up to the end, if it never did).
        let mut stall = (Duration::ZERO, 0);
        for (i, &(at, n)) in timeline.iter().enumerate() {
            let until = timeline.get(i + 1).map_or(took, |next| next.0);
            if until - at > stall.0 {
                stall = (until - at, n);
            }
        }
        let summary = format!(
            "{JOBS} jobs submitted in {:.2}s; {running} RUNNING after {:.2}s ({:.0} jobs/s); \
             longest stall {:.2}s at {} RUNNING",
            submitted.as_secs_f64(),
            took.as_secs_f64(),
            running as f64 / took.as_secs_f64(),
            stall.0.as_secs_f64(),
            stall.1,
        );
        println!("{summary}");
        let violations = sim.violations();
        assert!(
            violations.is_empty(),
            "GPU invariant broken: {violations:#?}"
        );
        let progress: Vec<String> = timeline
            .iter()
            .map(|(t, n)| format!("{:.2}s:{n}", t.as_secs_f64()))
            .collect();
        assert!(
            running == JOBS,
            "{summary}: not all RUNNING within {}s (the offer timeout is 30 s); \
             progress (seconds since the first submit:RUNNING): {}\n{}",
            BOUND.as_secs(),
            progress.join(" "),
            master.log_summary()
        );

        // The master agrees, and no GPU is in two tasks (none has ended).
        let jobs = all_jobs(&mut ops).await;
        assert_eq!(jobs.len(), JOBS);
        let not_running: Vec<_> = jobs
            .iter()
            .filter(|j| j.state != pb::JobState::JobRunning as i32)
            .map(|j| (&j.id, j.state))
            .collect();
        assert!(not_running.is_empty(), "not RUNNING: {not_running:?}");
        let tasks = sim.tasks();
        assert_eq!(tasks.len(), JOBS);
        let mut gpus: Vec<&String> = tasks.iter().flat_map(|t| &t.gpu_uuids).collect();
        assert_eq!(gpus.len(), JOBS, "each task has one GPU");
        gpus.sort();
        gpus.dedup();
        assert_eq!(gpus.len(), JOBS, "a GPU is in two live tasks' specs");
    });
    rt.shutdown_timeout(Duration::from_secs(5));
    drop(master);
}
