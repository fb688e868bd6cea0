//! Elastic gangs and gang restarts under faults, on a real cluster (master
//! and agents as processes, simulated GPUs, host-process tasks): a 2:4 gang
//! starts with the 2 ranks that fit, grows to 4 when GPUs free (a restart
//! with the new world size, no retry used), and a gang whose restart is
//! under way survives its agent being SIGKILLed. Checked from outside the
//! master: the ranks' own files and `/proc` (never a GPU held by two live
//! tasks, never two attempts of a gang alive at once).
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuctl_tests::{live_tasks, task_ids, AgentOpts, Cluster, Gpuctl};

const T: Duration = Duration::from_secs(40);
const MARKER: &str = "GPUCTL_TEST_ELASTIC";

/// Samples the live tasks of the jobs marked `mark` every 50 ms until
/// dropped, and keeps what breaks the promise: a GPU used by two live
/// tasks, or live tasks of two attempts of a job (`attempt` maps a task
/// id to its attempt).
struct Watch {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<String>>>,
    samples: Arc<Mutex<usize>>,
}

impl Watch {
    fn start(mark: &str, attempt: fn(&str) -> u32) -> Watch {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let samples = Arc::new(Mutex::new(0));
        let (s, v, n, mark) = (
            stop.clone(),
            seen.clone(),
            samples.clone(),
            mark.to_string(),
        );
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                let live = live_tasks(MARKER, &mark);
                let mut gpus: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
                let mut attempts: BTreeMap<&str, BTreeSet<u32>> = BTreeMap::new();
                for t in &live {
                    for g in &t.gpus {
                        gpus.entry(g).or_default().insert(&t.task_id);
                    }
                    attempts
                        .entry(&t.job_id)
                        .or_default()
                        .insert(attempt(&t.task_id));
                }
                let mut bad = v.lock().unwrap();
                for (g, tasks) in gpus.iter().filter(|(_, t)| t.len() > 1) {
                    bad.push(format!("GPU {g} used by live tasks {tasks:?}"));
                }
                for (j, a) in attempts.iter().filter(|(_, a)| a.len() > 1) {
                    bad.push(format!("job {j} has live tasks of attempts {a:?}"));
                }
                *n.lock().unwrap() += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        Watch {
            stop,
            seen,
            samples,
        }
    }

    fn finish(self) {
        self.stop.store(true, Ordering::SeqCst);
        let samples = *self.samples.lock().unwrap();
        assert!(samples > 10, "the watch sampled {samples} times");
        let bad = self.seen.lock().unwrap();
        assert!(bad.is_empty(), "seen from /proc: {bad:?}");
    }
}

fn events(c: &Cluster, id: &str) -> Vec<(String, String)> {
    c.job(id)["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["reason"].as_str().unwrap_or_default().to_string(),
                e["message"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// What each rank wrote: task id to `world=W rank=R`.
fn written(out: &std::path::Path) -> BTreeMap<String, String> {
    std::fs::read_dir(out)
        .unwrap()
        .flatten()
        .map(|e| {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            (
                e.file_name().to_string_lossy().to_string(),
                text.trim().to_string(),
            )
        })
        .collect()
}

/// A 2:4 gang on 4 GPUs of which a filler holds 2: it starts with 2 ranks
/// (WORLD_SIZE=2), and when the filler ends it is restarted with 4
/// (WORLD_SIZE=4, PET_NNODES=4) without using a retry; its ranks exit 0
/// on the SIGTERM of the restart, as a trainer that saves a checkpoint
/// would, and the job does not end SUCCEEDED for it.
#[test]
fn an_elastic_gang_starts_with_what_fits_and_grows_when_gpus_free() {
    let mut c = Cluster::start(&["--elastic-grow-after", "1s"]);
    for _ in 0..2 {
        c.add_agent(AgentOpts {
            simulate_gpus: Some("2xA100-SXM4-40GB"),
            ..Default::default()
        });
    }
    let out = gpuctl_tests::task_writable_dir(&c.dir.path().join("out"));
    let mark = format!("{}", std::process::id());
    let env_mark = format!("{MARKER}={mark}");
    let filler = c.submit(&[
        "--name",
        "filler",
        "--cpus",
        "0.1",
        "--gpus",
        "2",
        "--env",
        &env_mark,
        "--",
        "sh",
        "-c",
        "while true; do sleep 0.2; done",
    ]);
    c.wait_state(&filler, "RUNNING", T);
    // Task ids: attempt 1 is .0 and .1, attempt 2 is .2 to .5.
    let watch = Watch::start(&mark, |task| {
        let n: u32 = task.rsplit('.').next().unwrap().parse().unwrap();
        u32::from(n >= 2)
    });
    let env_out = format!("OUT={}", out.display());
    let gang = c.submit(&[
        "--name",
        "elastic",
        "--cpus",
        "0.1",
        "--gpus",
        "1",
        "--replicas",
        "2:4",
        "--env",
        &env_out,
        "--env",
        &env_mark,
        "--",
        "sh",
        "-c",
        "echo \"world=$WORLD_SIZE rank=$RANK nnodes=$PET_NNODES min=$GPUCTL_MIN_REPLICAS max=$GPUCTL_MAX_REPLICAS\" \
         > \"$OUT/$GPUCTL_TASK_ID\"; \
         [ \"$WORLD_SIZE\" = 4 ] && exit 0; \
         trap 'echo saved; exit 0' TERM; while true; do sleep 0.1; done",
    ]);
    let j = c.wait_job_until(&gang, T, "it runs 2 ranks", |j| j["state"] == "RUNNING");
    assert_eq!(
        task_ids(&j),
        [format!("{gang}.0"), format!("{gang}.1")],
        "{j}"
    );
    assert_eq!(
        (j["replicas"].as_u64(), j["min_replicas"].as_u64()),
        (Some(4), Some(2)),
        "{j}"
    );
    let shown = c.ok(&["jobs", "get", &gang]);
    assert!(shown.contains("2:4 (elastic)"), "{shown}");
    c.wait_job_until(&gang, T, "both ranks wrote", |_| written(&out).len() == 2);
    for rank in 0..2 {
        assert_eq!(
            written(&out)[&format!("{gang}.{rank}")],
            format!("world=2 rank={rank} nnodes=2 min=2 max=4")
        );
    }
    // Still 2 a while later: no room to grow.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(task_ids(&c.job(&gang)).len(), 2);

    c.ok(&["jobs", "cancel", &filler]);
    assert_eq!(c.wait_job(&gang, 60), (0, "SUCCEEDED".to_string()));
    let j = c.job(&gang);
    assert_eq!(task_ids(&j).len(), 6, "{j}");
    assert_eq!(j["retries"], 0, "growing uses no retry: {j}");
    let files = written(&out);
    for rank in 0..4 {
        assert_eq!(
            files[&format!("{gang}.{}", rank + 2)],
            format!("world=4 rank={rank} nnodes=4 min=2 max=4")
        );
    }
    let kinds: Vec<String> = events(&c, &gang).into_iter().map(|(k, _)| k).collect();
    let growing = kinds
        .iter()
        .position(|k| k == "Growing")
        .unwrap_or_else(|| panic!("{kinds:?}"));
    assert_eq!(kinds[growing + 1], "Requeued", "{kinds:?}");
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("Succeeded"),
        "{kinds:?}"
    );
    watch.finish();
}

/// A 2-rank gang with a retry on two agents: rank 1 fails, and while the
/// gang is being restarted (rank 0 takes 2 s to stop) rank 0's agent is
/// SIGKILLed and started again. The restart completes: the new attempt
/// runs and succeeds, and no GPU is ever held by two live tasks nor two
/// attempts alive at once.
#[test]
fn a_gang_restart_survives_its_agent_being_killed() {
    let mut c = Cluster::start(&[]);
    for _ in 0..2 {
        c.add_agent(AgentOpts {
            simulate_gpus: Some("1xA100-SXM4-40GB"),
            ..Default::default()
        });
    }
    let out = gpuctl_tests::task_writable_dir(&c.dir.path().join("out"));
    let mark = format!("{}-restart", std::process::id());
    let env_mark = format!("{MARKER}={mark}");
    let env_out = format!("OUT={}", out.display());
    let watch = Watch::start(&mark, |task| {
        let n: u32 = task.rsplit('.').next().unwrap().parse().unwrap();
        n / 2
    });
    // Attempt 1: rank 1 fails at once once rank 0 is up; rank 0 takes 2 s
    // over its SIGTERM. Attempt 2: both succeed.
    let gang = c.submit(&[
        "--name",
        "restart",
        "--cpus",
        "0.1",
        "--gpus",
        "1",
        "--replicas",
        "2",
        "--max-retries",
        "1",
        "--env",
        &env_out,
        "--env",
        &env_mark,
        "--",
        "sh",
        "-c",
        "n=${GPUCTL_TASK_ID##*.}; \
         if [ \"$n\" -ge 2 ]; then echo ok > \"$OUT/$GPUCTL_TASK_ID\"; exit 0; fi; \
         if [ \"$RANK\" = 1 ]; then while [ ! -e \"$OUT/up\" ]; do sleep 0.1; done; exit 3; fi; \
         trap 'sleep 2; exit 143' TERM; touch \"$OUT/up\"; while true; do sleep 0.1; done",
    ]);
    let j = c.wait_job_until(&gang, T, "rank 1 failed", |j| {
        j["tasks"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["state"] == "FAILED"))
    });
    // Rank 0 is being stopped: kill its agent now, start it again.
    let rank0_agent = j["tasks"][0]["agent_id"].as_str().unwrap().to_string();
    let n = c
        .agents_json()
        .iter()
        .position(|a| a["id"] == rank0_agent.as_str())
        .unwrap();
    c.restart_agent(n);
    assert_eq!(c.wait_job(&gang, 60), (0, "SUCCEEDED".to_string()));
    let j = c.job(&gang);
    assert_eq!(j["retries"], 1, "{j}");
    assert_eq!(task_ids(&j).len(), 4, "{j}");
    let files = written(&out);
    assert_eq!(
        files.get(&format!("{gang}.2")).map(String::as_str),
        Some("ok"),
        "{files:?}"
    );
    assert_eq!(
        files.get(&format!("{gang}.3")).map(String::as_str),
        Some("ok"),
        "{files:?}"
    );
    let message = j["tasks"][1]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(message.contains("code 3"), "{j}");
    watch.finish();
}

/// `--restart-backoff 2s`: each restart after a failure waits at least its
/// pause, doubling (2 s, then 4 s), and the queue says `Backoff`
/// meanwhile; `--restart-policy never` fails the job at its first failure,
/// and asking it for retries too is refused before anything is submitted.
#[test]
fn restarts_wait_their_backoff_and_never_means_never() {
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts {
        simulate_gpus: Some("1xA100-SXM4-40GB"),
        ..Default::default()
    });
    let out = gpuctl_tests::task_writable_dir(&c.dir.path().join("out"));
    let env_out = format!("OUT={}", out.display());
    let flaky = c.submit(&[
        "--name",
        "flaky",
        "--cpus",
        "0.1",
        "--max-retries",
        "2",
        "--restart-backoff",
        "2s",
        "--env",
        &env_out,
        "--",
        "sh",
        "-c",
        // A file per attempt: each runs as a task user of its own.
        "date +%s.%N > \"$OUT/$GPUCTL_TASK_ID\"; exit 1",
    ]);
    let j = c.wait_job_until(&flaky, T, "it waits out its backoff", |j| {
        j["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("Backoff:"))
    });
    assert_eq!(j["state"], "QUEUED", "{j}");
    assert_eq!(c.wait_job(&flaky, 60), (1, "FAILED".to_string()));
    let j = c.job(&flaky);
    assert_eq!(
        (j["retries"].as_u64(), task_ids(&j).len()),
        (Some(2), 3),
        "{j}"
    );
    let starts: Vec<f64> = written(&out).values().map(|l| l.parse().unwrap()).collect();
    assert_eq!(starts.len(), 3, "{starts:?}");
    // Each restart comes after its pause (the failure is later than the
    // start, so start to start is longer still).
    assert!(starts[1] - starts[0] >= 2.0, "{starts:?}");
    assert!(starts[2] - starts[1] >= 4.0, "{starts:?}");
    let retrying: Vec<String> = events(&c, &flaky)
        .into_iter()
        .filter(|(k, _)| k == "Retrying")
        .map(|(_, m)| m)
        .collect();
    assert!(retrying[0].ends_with("retry 1 of 2 in 2s"), "{retrying:?}");
    assert!(retrying[1].ends_with("retry 2 of 2 in 4s"), "{retrying:?}");

    let once = c.submit(&[
        "--name",
        "once",
        "--cpus",
        "0.1",
        "--restart-policy",
        "never",
        "--",
        "sh",
        "-c",
        "exit 5",
    ]);
    assert_eq!(c.wait_job(&once, 30), (1, "FAILED".to_string()));
    let j = c.job(&once);
    assert_eq!(
        (j["retries"].as_u64(), task_ids(&j).len()),
        (Some(0), 1),
        "{j}"
    );
    assert_eq!(j["restart_policy"], "never", "{j}");
    let refused = c.gpuctl(&[
        "jobs",
        "submit",
        "--name",
        "refused",
        "--restart-policy",
        "never",
        "--max-retries",
        "1",
        "--",
        "true",
    ]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{err}");
    assert!(
        err.contains("max_retries") && err.contains("never"),
        "{err}"
    );
    assert_eq!(
        c.json(&["jobs", "list", "--json"])
            .as_array()
            .unwrap()
            .len(),
        2
    );
}
