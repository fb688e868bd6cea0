//! The scale benchmark (issue 16): three real masters forming one Raft group
//! in this process (`gpuctl_tests::sim::InProcessMaster::start_group`, each
//! on a runtime and threads of its own, talking Raft and serving the real
//! APIs over loopback), many simulated agents (`gpuctl_tests::sim`: the real
//! AgentManager API, simulated GPUs, a runtime that runs nothing but
//! reports STARTING, RUNNING and, for `sleep SECONDS` jobs, FINISHED), and
//! jobs submitted through the real Operator API.
//!
//! Phases, in order (every figure is printed in a table and, at the end, in
//! one JSON line):
//!
//! 1. registration of `--agents` agents of `--gpus-per-agent` GPUs;
//! 2. latency on the idle cluster: `--latency-jobs` one-GPU jobs, one at a
//!    time, each from just before its SubmitJob to the master acknowledging
//!    its task's RUNNING (the agents record that instant); then cancelled;
//! 3. completions: `--short-jobs` one-GPU jobs `sleep --short-run-ms`, all
//!    at once, first submit to the last FINISHED acknowledged (the job is
//!    SUCCEEDED then);
//! 4. gangs: `--gangs` jobs of `--gang-replicas` tasks of `--gang-gpus`
//!    GPUs, first submit to the last task's RUNNING acknowledged; then
//!    cancelled;
//! 5. filler (`--filler-jobs`, off by default): jobs submitted and
//!    cancelled at once, so that the state holds that many more when
//!    ListJobs is timed, without a queue of as many;
//! 6. placements: `--jobs` one-GPU jobs that run until the end, first
//!    submit to the last RUNNING acknowledged (jobs beyond the cluster's
//!    GPUs stay queued, and count in the state);
//! 7. ListJobs' first page (the default request: 500 jobs) at the leader,
//!    with everything above in the state; the leader's allocation-cycle
//!    histogram (`/metrics`); each master's data dir;
//! 8. failover: the leader is killed (its runtime dropped at once, as a
//!    crash), until a survivor accepts a SubmitJob, and until every agent
//!    registered again with the new leader;
//! 9. the raft log and snapshot in each master's sled trees, once stopped;
//! 10. the allocation cycle: `gpuctl_engine::allocator::allocate` on views
//!     of `--alloc-agents` agents built as engine/benches/allocator.rs
//!     builds them (the pure cycle, no state to views);
//! 11. memory: three `gpuctl-master` release processes (not in this
//!     process, so that their RSS is theirs alone), VmRSS of each before
//!     agents, after `--memory-agents` agents with no GPUs, after as many
//!     with 8 GPUs, after `--memory-jobs` one-GPU jobs RUNNING.
//!
//! Calls go to the leader and follow its redirects as `gpuctl` does (a call
//! the master refused before proposing is sent again; one whose outcome is
//! unknown counts as an error), so a leader change under load shows in the
//! figures (errors, `leader.changed`) instead of ending the run.
//!
//! ```text
//! cargo run --release -p gpuctl-tests --bin scale-bench -- --agents 1000 --jobs 10000
//! cargo run --release -p gpuctl-tests --bin scale-bench -- --help
//! ```

use gpuctl_engine::allocator::bench_cluster as alloc_views;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use gpuctl_proto::leader::{leader_hint, not_proposed};
use gpuctl_proto::pb;
use gpuctl_proto::pb::operator_client::OperatorClient;
use gpuctl_tests::sim::{InProcessMaster, SimAgents, SimConfig, SimCounts};
use serde_json::{json, Map, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::{Channel, Endpoint};

const MASTERS: usize = 3;
/// Targets of issue 16.
const TARGET_PLACEMENTS_PER_SEC: f64 = 10_000.0;
const TARGET_LATENCY_P50_MS: f64 = 50.0;
const TARGET_ALLOC_CYCLE_MS: f64 = 50.0;
const TARGET_ALLOC_AGENTS: usize = 10_000;
const TARGET_LIST_JOBS_MS: f64 = 50.0;
const TARGET_LIST_JOBS_JOBS: usize = 100_000;
const TARGET_BYTES_PER_AGENT: f64 = 2048.0;
const FAILOVER_POLL: Duration = Duration::from_millis(20);

#[derive(Debug, Parser)]
#[command(
    name = "scale-bench",
    about = "gpuctl scale benchmark: three masters in process, simulated agents"
)]
struct Opts {
    /// Simulated agents.
    #[arg(long, default_value_t = 1000)]
    agents: usize,
    /// GPUs of each agent.
    #[arg(long, default_value_t = 8)]
    gpus_per_agent: u32,
    /// One-GPU jobs of the placement run (they run until the end; those
    /// beyond the cluster's GPUs stay queued).
    #[arg(long, default_value_t = 10_000)]
    jobs: usize,
    /// Gang jobs (default: enough for half the agents).
    #[arg(long)]
    gangs: Option<usize>,
    /// Tasks of each gang.
    #[arg(long, default_value_t = 8)]
    gang_replicas: u32,
    /// GPUs of each gang task.
    #[arg(long, default_value_t = 8)]
    gang_gpus: u32,
    /// Short one-GPU jobs of the completion run.
    #[arg(long, default_value_t = 2000)]
    short_jobs: usize,
    /// How long each short job runs (`sleep` on the simulated agent).
    #[arg(long, default_value_t = 200)]
    short_run_ms: u64,
    /// Jobs submitted one at a time on the idle cluster.
    #[arg(long, default_value_t = 200)]
    latency_jobs: usize,
    /// SubmitJob calls in flight at once.
    #[arg(long, default_value_t = 256)]
    submit_concurrency: usize,
    /// HTTP/2 connections per master shared by the agents (and by the
    /// benchmark's own calls). Default: one per 200 agents, at least 4. Real
    /// agents have a connection each; thousands on one connection fail
    /// together (when many of them time out at once, h2 closes the whole
    /// connection for too many locally reset streams), which a real
    /// cluster never sees, and the registration storm that follows is
    /// what such a run then measures.
    #[arg(long)]
    connections: Option<usize>,
    /// Agent counts of the allocator measurement.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000,50000")]
    alloc_agents: Vec<usize>,
    /// Cycles timed at each count.
    #[arg(long, default_value_t = 10)]
    alloc_iters: usize,
    /// Agents of the memory run (default: --agents).
    #[arg(long)]
    memory_agents: Option<usize>,
    /// One-GPU jobs of the memory run (default: as many as --jobs, at most
    /// the GPUs).
    #[arg(long)]
    memory_jobs: Option<usize>,
    /// Skip the memory run (gpuctl-master processes).
    #[arg(long)]
    no_memory: bool,
    /// Skip the failover.
    #[arg(long)]
    no_failover: bool,
    /// Skip the allocator measurement.
    #[arg(long)]
    no_alloc: bool,
    /// Give up a phase that made no progress for this long (seconds).
    #[arg(long, default_value_t = 120)]
    stall_secs: u64,
    /// Longest a phase may take (seconds).
    #[arg(long, default_value_t = 900)]
    phase_secs: u64,
    /// Log filter of the in-process masters (written to masters.log in the
    /// run's directory).
    #[arg(long, default_value = "info")]
    log: String,
    /// Keep the masters' data and logs here (default: a temp dir, removed).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Jobs submitted and cancelled at once (they ask for a GPU model no
    /// agent has, so they never run): the state then holds that many more
    /// jobs, CANCELLED, when ListJobs is timed, without a queue of as many
    /// (needs --job-retention-max above it, or they are forgotten).
    #[arg(long, default_value_t = 0)]
    filler_jobs: usize,
    /// The in-process masters' --job-retention-max (most finished jobs
    /// kept; default: the master's, 10,000). Raise it to keep 100,000 jobs
    /// in the state for ListJobs without a queue of 100,000.
    #[arg(long)]
    job_retention_max: Option<usize>,
    /// Run the benchmark at each of these agent counts (comma-separated,
    /// e.g. `1000,10000`), one process each, one after the other, with the
    /// other options as given; print each run, then one JSON line with
    /// every run's figures and each size's ratios to the first (the cost
    /// of a placement should not grow with the cluster). With `--plot
    /// FILE.svg` the curve is drawn too.
    #[arg(long, value_delimiter = ',')]
    compare: Vec<usize>,
    /// With --compare: draw placements/s, idle submit → RUNNING p50 and the
    /// idle allocation cycle against the agent count, as an SVG (and a PNG
    /// beside it when headless chromium is installed).
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// Simulated agents per HTTP/2 connection when `--connections` is not given.
const AGENTS_PER_CONNECTION: usize = 200;

impl Opts {
    /// Connections per master for `agents` simulated agents.
    fn connections(&self, agents: usize) -> usize {
        self.connections
            .unwrap_or_else(|| agents.div_ceil(AGENTS_PER_CONNECTION).max(4))
    }
}

type BenchResult<T> = Result<T, String>;

fn err<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// The figures: table rows and the JSON object.
#[derive(Default)]
struct Report {
    rows: Vec<[String; 4]>,
    json: Map<String, Value>,
}

impl Report {
    fn row(&mut self, figure: &str, value: String, size: String, target: String) {
        self.rows.push([figure.to_string(), value, size, target]);
    }

    fn set(&mut self, section: &str, value: Value) {
        self.json.insert(section.to_string(), value);
    }

    fn print_table(&self) {
        let head = ["figure", "value", "size", "target"];
        let mut w = head.map(str::len);
        for r in &self.rows {
            for (i, c) in r.iter().enumerate() {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let line = |cells: [&str; 4]| {
            let padded: Vec<String> = cells
                .iter()
                .enumerate()
                .map(|(i, c)| format!("{c:<width$}", width = w[i]))
                .collect();
            println!("| {} |", padded.join(" | "));
        };
        line(head);
        let dashes = w.map(|n| "-".repeat(n));
        line([&dashes[0], &dashes[1], &dashes[2], &dashes[3]]);
        for r in &self.rows {
            line([&r[0], &r[1], &r[2], &r[3]]);
        }
    }
}

fn met(ok: bool, what: &str) -> String {
    format!("{} ({what})", if ok { "MET" } else { "MISSED" })
}

/// 12345.6 -> "12,346".
fn n0(v: f64) -> String {
    if !v.is_finite() {
        return format!("{v}");
    }
    let s = format!("{:.0}", v.abs());
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if v < 0.0 && out != "0" {
        out.insert(0, '-');
    }
    out
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The `p` quantile (0..=1) of sorted values, nearest rank.
fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// VmRSS of a process (`None`: this one), in KiB.
fn rss_kib(pid: Option<i32>) -> Option<u64> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/status"),
        None => "/proc/self/status".to_string(),
    };
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// CPU time (user and system) of this process so far, in seconds, from
/// /proc/self/stat (in clock ticks of 1/100 s, Linux's USER_HZ).
fn cpu_secs() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return f64::NAN;
    };
    // The fields after the command (which may hold spaces) in parentheses.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return f64::NAN;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime: fields 14 and 15 of the line, 11 and 12 (from 0)
    // after the command.
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok());
    match (ticks(11), ticks(12)) {
        (Some(u), Some(s)) => (u + s) / 100.0,
        _ => f64::NAN,
    }
}

/// Bytes of the files under `dir` (their length, not their blocks).
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.filter_map(Result::ok)
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

fn mib(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / (1024.0 * 1024.0))
}

fn channel(addr: &str, connections: usize) -> BenchResult<Vec<OperatorClient<Channel>>> {
    (0..connections.max(1))
        .map(|_| {
            let ch = Endpoint::from_shared(format!("http://{addr}"))
                .map_err(err("operator endpoint"))?
                .connect_timeout(Duration::from_secs(1))
                .timeout(Duration::from_secs(30))
                .tcp_nodelay(true)
                .connect_lazy();
            Ok(OperatorClient::new(ch))
        })
        .collect()
}

/// Operator clients of every master, and which one leads now: calls go to
/// the leader and follow its redirects, as `gpuctl` does.
struct Ops {
    addrs: Vec<String>,
    /// `clients[master][k]`: `connections` channels per master.
    clients: Vec<Vec<OperatorClient<Channel>>>,
    leader: AtomicUsize,
    /// Calls retried after a redirect or "no leader yet".
    redirects: AtomicUsize,
}

impl Ops {
    fn new(addrs: &[String], leader: usize, connections: usize) -> BenchResult<Ops> {
        Ok(Ops {
            addrs: addrs.to_vec(),
            clients: addrs
                .iter()
                .map(|a| channel(a, connections))
                .collect::<BenchResult<_>>()?,
            leader: AtomicUsize::new(leader),
            redirects: AtomicUsize::new(0),
        })
    }

    fn leader(&self) -> usize {
        self.leader.load(Ordering::SeqCst)
    }

    /// Runs `call` on a client of the leader (the `n`th, round robin); when
    /// the master refused it before proposing anything (not the leader, no
    /// leader yet), follows the redirect or waits, and calls again, for at
    /// most `limit`. Any other failure is returned.
    async fn call<T, F, Fut>(&self, n: usize, limit: Duration, call: F) -> Result<T, tonic::Status>
    where
        F: Fn(OperatorClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<T, tonic::Status>>,
    {
        let deadline = Instant::now() + limit;
        loop {
            let m = self.leader();
            let per = &self.clients[m];
            match call(per[n % per.len()].clone()).await {
                Ok(v) => return Ok(v),
                Err(s) if not_proposed(&s) && Instant::now() < deadline => {
                    self.redirects.fetch_add(1, Ordering::Relaxed);
                    let hint =
                        leader_hint(&s).and_then(|h| self.addrs.iter().position(|a| *a == h));
                    match hint {
                        Some(i) if i != m => {
                            let _ = self.leader.compare_exchange(
                                m,
                                i,
                                Ordering::SeqCst,
                                Ordering::SeqCst,
                            );
                        }
                        _ => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                }
                Err(s) => return Err(s),
            }
        }
    }
}

fn status_text(s: &tonic::Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

fn one_gpu_job(name: String, command: Vec<String>) -> pb::JobSpec {
    pb::JobSpec {
        name,
        command,
        resources: Some(pb::Resources {
            cpus: 1.0,
            mem_mib: 0,
            gpus: 1,
            ports: 0,
        }),
        ..Default::default()
    }
}

fn forever() -> Vec<String> {
    vec!["sleep".into(), "infinity".into()]
}

/// The leader's index among `addrs`, asked of the masters in `live`, once
/// every live master applied what the leader committed.
async fn settled_leader(
    ops: &[OperatorClient<Channel>],
    addrs: &[String],
    live: &[usize],
    timeout: Duration,
) -> BenchResult<usize> {
    let deadline = Instant::now() + timeout;
    loop {
        for &i in live {
            let mut c = ops[i].clone();
            let call = c.list_masters(pb::ListMastersRequest {});
            let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(3), call).await else {
                continue;
            };
            let ms = r.into_inner().masters;
            let Some(leader) = ms.iter().find(|m| m.role == "leader" && m.reachable) else {
                continue;
            };
            let Some(li) = addrs.iter().position(|a| *a == leader.address) else {
                continue;
            };
            let caught_up = ms
                .iter()
                .filter(|m| {
                    addrs
                        .iter()
                        .position(|a| *a == m.address)
                        .is_some_and(|j| live.contains(&j))
                })
                .all(|m| m.reachable && m.applied_index >= leader.commit_index);
            if caught_up {
                return Ok(li);
            }
        }
        if Instant::now() > deadline {
            return Err(format!("no settled leader within {timeout:?}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Which count a phase waits for.
#[derive(Clone, Copy)]
enum Count {
    Running,
    Ended,
}

impl Count {
    fn of(self, c: &SimCounts) -> usize {
        match self {
            Count::Running => c.running_acked,
            Count::Ended => c.ended_acked,
        }
    }
}

/// How far a phase got.
struct Progress {
    reached: usize,
    complete: bool,
    why: String,
}

/// Polls the agents' counts until `count` reached `base + goal()` (`goal`
/// answers only once the submits are done), printing progress; gives up
/// after a stall or the phase limit.
async fn wait_for(
    sim: &SimAgents,
    label: &str,
    count: Count,
    base: usize,
    goal: impl Fn() -> Option<usize>,
    opts: &Opts,
) -> Progress {
    let started = Instant::now();
    let mut last = (Instant::now(), 0usize);
    let mut printed = Instant::now();
    loop {
        let now = count.of(&sim.counts()).saturating_sub(base);
        if now != last.1 {
            last = (Instant::now(), now);
        }
        if let Some(g) = goal() {
            if now >= g {
                return Progress {
                    reached: now,
                    complete: true,
                    why: String::new(),
                };
            }
        }
        if last.0.elapsed() > Duration::from_secs(opts.stall_secs) {
            return Progress {
                reached: now,
                complete: false,
                why: format!("no progress for {} s", opts.stall_secs),
            };
        }
        if started.elapsed() > Duration::from_secs(opts.phase_secs) {
            return Progress {
                reached: now,
                complete: false,
                why: format!("phase limit of {} s", opts.phase_secs),
            };
        }
        if printed.elapsed() > Duration::from_secs(5) {
            printed = Instant::now();
            eprintln!(
                "  [{label}] {:.0} s: {now} of {}",
                started.elapsed().as_secs_f64(),
                goal().map_or("?".to_string(), |g| g.to_string())
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// What a batch of submits did.
struct Submitted {
    /// Job id and when its SubmitJob was sent (since the agents' epoch).
    jobs: Vec<(String, Duration)>,
    errors: usize,
    first_error: Option<String>,
    first: Duration,
    done: Duration,
}

/// Submits every spec, `concurrency` calls in flight, at the leader;
/// counts the successes in `ok` as they come, sets `finished`.
async fn submit_all(
    sim: &SimAgents,
    ops: &Ops,
    specs: Vec<pb::JobSpec>,
    opts: &Opts,
    ok: &AtomicUsize,
    finished: &AtomicBool,
) -> Submitted {
    let first = sim.now();
    let limit = Duration::from_secs(opts.stall_secs);
    let results: Vec<(Duration, Result<String, String>)> =
        futures::stream::iter(specs.into_iter().enumerate())
            .map(|(n, spec)| async move {
                let at = sim.now();
                let r = ops
                    .call(n, limit, |mut c| {
                        let spec = spec.clone();
                        async move {
                            c.submit_job(pb::SubmitJobRequest {
                                spec: Some(spec),
                                ..Default::default()
                            })
                            .await
                        }
                    })
                    .await
                    .map(|r| r.into_inner().job_id)
                    .map_err(|s| status_text(&s));
                if r.is_ok() {
                    ok.fetch_add(1, Ordering::SeqCst);
                }
                (at, r)
            })
            .buffer_unordered(opts.submit_concurrency.max(1))
            .collect()
            .await;
    finished.store(true, Ordering::SeqCst);
    let done = sim.now();
    let mut out = Submitted {
        jobs: Vec::with_capacity(results.len()),
        errors: 0,
        first_error: None,
        first,
        done,
    };
    for (at, r) in results {
        match r {
            Ok(id) => out.jobs.push((id, at)),
            Err(e) => {
                out.errors += 1;
                out.first_error.get_or_insert(e);
            }
        }
    }
    out
}

/// One batch phase's figures.
struct Batch {
    submitted: Submitted,
    progress: Progress,
    /// Jobs that got there (all their tasks), and when, since the first
    /// submit; sorted.
    done_at: Vec<f64>,
    /// Per job: from its submit to its last task's event (ms), sorted.
    latency_ms: Vec<f64>,
    /// Tasks of these jobs the agents saw.
    tasks_seen: usize,
    /// CPU time of this process (masters, agents, benchmark) per second of
    /// the phase: how many of the machine's cores it kept busy.
    cores_busy: f64,
}

impl Batch {
    /// Jobs per second from the first submit to the last job done.
    fn rate(&self) -> f64 {
        match self.done_at.last() {
            Some(&t) if t > 0.0 => self.done_at.len() as f64 / t,
            _ => 0.0,
        }
    }

    /// Jobs per second between the 10th and the 90th percentile of the
    /// jobs done (the steady middle of the run).
    fn middle_rate(&self) -> f64 {
        let n = self.done_at.len();
        if n < 10 {
            return f64::NAN;
        }
        let (a, b) = (n / 10, n * 9 / 10);
        let dt = self.done_at[b] - self.done_at[a];
        if dt > 0.0 {
            (b - a) as f64 / dt
        } else {
            f64::NAN
        }
    }

    fn json(&self, tasks_per_job: usize) -> Value {
        json!({
            "submitted": self.submitted.jobs.len(),
            "submit_errors": self.submitted.errors,
            "first_submit_error": self.submitted.first_error,
            "submit_secs": (self.submitted.done - self.submitted.first).as_secs_f64(),
            "submits_per_sec": self.submitted.jobs.len() as f64
                / (self.submitted.done - self.submitted.first).as_secs_f64().max(1e-9),
            "jobs_done": self.done_at.len(),
            "tasks_per_job": tasks_per_job,
            "tasks_seen": self.tasks_seen,
            "complete": self.progress.complete,
            "incomplete_because": self.progress.why,
            "secs_first_submit_to_last": self.done_at.last().copied(),
            "jobs_per_sec": self.rate(),
            "tasks_per_sec": self.rate() * tasks_per_job as f64,
            "jobs_per_sec_10_to_90_pct": finite(self.middle_rate()),
            "job_latency_ms_p50": finite(pct(&self.latency_ms, 0.5)),
            "job_latency_ms_p99": finite(pct(&self.latency_ms, 0.99)),
            "job_latency_ms_max": finite(pct(&self.latency_ms, 1.0)),
            "process_cores_busy": self.cores_busy,
        })
    }
}

fn finite(v: f64) -> Value {
    if v.is_finite() {
        json!(v)
    } else {
        Value::Null
    }
}

/// The agents, and the clients that jobs are submitted through.
struct On<'a> {
    sim: &'a SimAgents,
    ops: &'a Ops,
}

/// Submits `specs` (`tasks_per_job` tasks each) and waits until `count`
/// rose by their tasks, at most `cap_jobs` jobs' worth.
async fn batch(
    on: On<'_>,
    label: &str,
    specs: Vec<pb::JobSpec>,
    tasks_per_job: usize,
    cap_jobs: usize,
    count: Count,
    opts: &Opts,
) -> Batch {
    let On { sim, ops } = on;
    let base = count.of(&sim.counts());
    let (cpu0, wall0) = (cpu_secs(), Instant::now());
    let ok = AtomicUsize::new(0);
    let finished = AtomicBool::new(false);
    let goal = || {
        finished
            .load(Ordering::SeqCst)
            .then(|| ok.load(Ordering::SeqCst).min(cap_jobs) * tasks_per_job)
    };
    let (submitted, progress) = tokio::join!(
        submit_all(sim, ops, specs, opts, &ok, &finished),
        wait_for(sim, label, count, base, goal, opts)
    );
    let cores_busy = (cpu_secs() - cpu0) / wall0.elapsed().as_secs_f64().max(1e-9);
    // When each job got there: its last task's event.
    let submit_at: HashMap<&str, Duration> = submitted
        .jobs
        .iter()
        .map(|(id, at)| (id.as_str(), *at))
        .collect();
    let mut per_job: HashMap<String, (usize, Duration)> = HashMap::new();
    let mut tasks_seen = 0;
    for t in sim.tasks() {
        if !submit_at.contains_key(t.job_id.as_str()) {
            continue;
        }
        tasks_seen += 1;
        let at = match count {
            Count::Running => t.running_acked,
            Count::Ended => t.ended_acked,
        };
        if let Some(at) = at {
            let e = per_job.entry(t.job_id).or_insert((0, Duration::ZERO));
            e.0 += 1;
            e.1 = e.1.max(at);
        }
    }
    let mut done_at = Vec::new();
    let mut latency_ms = Vec::new();
    for (job, (n, at)) in per_job {
        if n < tasks_per_job {
            continue;
        }
        done_at.push(at.saturating_sub(submitted.first).as_secs_f64());
        if let Some(s) = submit_at.get(job.as_str()) {
            latency_ms.push(ms(at.saturating_sub(*s)));
        }
    }
    Batch {
        submitted,
        progress,
        done_at: sorted(done_at),
        latency_ms: sorted(latency_ms),
        tasks_seen,
        cores_busy,
    }
}

/// Cancels the jobs and waits until the agents' final reports of their
/// `tasks` tasks were acknowledged (counted from `ended_base`).
async fn cancel_all(
    sim: &SimAgents,
    ops: &Ops,
    jobs: &[(String, Duration)],
    tasks: usize,
    ended_base: usize,
    opts: &Opts,
) -> BenchResult<()> {
    let limit = Duration::from_secs(opts.stall_secs);
    let errors: Vec<String> = futures::stream::iter(jobs.iter().enumerate())
        .map(|(n, (id, _))| async move {
            ops.call(n, limit, |mut c| async move {
                c.cancel_job(pb::CancelJobRequest { job_id: id.clone() })
                    .await
            })
            .await
            .err()
            .map(|s| format!("{id}: {}", status_text(&s)))
        })
        .buffer_unordered(opts.submit_concurrency.max(1))
        .filter_map(|e| async move { e })
        .collect()
        .await;
    if let Some(e) = errors.first() {
        return Err(format!("{} CancelJob calls failed, e.g. {e}", errors.len()));
    }
    let p = wait_for(
        sim,
        "cancel",
        Count::Ended,
        ended_base,
        || Some(tasks),
        opts,
    )
    .await;
    if p.complete {
        Ok(())
    } else {
        Err(format!(
            "cancelled tasks: {} of {tasks} ended ({})",
            p.reached, p.why
        ))
    }
}

/// A histogram as `/metrics` exposes it: cumulative buckets, sum, count.
#[derive(Debug, Clone, Default)]
struct Hist {
    buckets: Vec<(f64, f64)>,
    sum: f64,
    count: f64,
}

impl Hist {
    fn parse(text: &str, name: &str) -> Hist {
        let mut h = Hist::default();
        let bucket = format!("{name}_bucket{{le=\"");
        for line in text.lines() {
            let Some((key, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(v) = value.parse::<f64>() else {
                continue;
            };
            if let Some(le) = key.strip_prefix(&bucket) {
                let le = le.trim_end_matches("\"}");
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap_or(f64::NAN)
                };
                h.buckets.push((le, v));
            } else if key == format!("{name}_sum") {
                h.sum = v;
            } else if key == format!("{name}_count") {
                h.count = v;
            }
        }
        h
    }

    /// What was observed between `earlier` and `self`.
    fn since(&self, earlier: &Hist) -> Hist {
        Hist {
            buckets: self
                .buckets
                .iter()
                .map(|(le, v)| {
                    let before = earlier
                        .buckets
                        .iter()
                        .find(|(l, _)| l == le)
                        .map_or(0.0, |b| b.1);
                    (*le, v - before)
                })
                .collect(),
            sum: self.sum - earlier.sum,
            count: self.count - earlier.count,
        }
    }

    /// The upper bound of the bucket holding the `q` quantile (seconds).
    fn quantile_bound(&self, q: f64) -> f64 {
        let want = q * self.count;
        self.buckets
            .iter()
            .find(|(_, c)| *c >= want && *c > 0.0)
            .map_or(f64::NAN, |b| b.0)
    }

    fn json(&self) -> Value {
        json!({
            "cycles": self.count,
            "mean_ms": finite(self.sum / self.count * 1e3),
            "p50_le_ms": finite(self.quantile_bound(0.5) * 1e3),
            "p99_le_ms": finite(self.quantile_bound(0.99) * 1e3),
        })
    }

    fn describe(&self) -> String {
        format!(
            "mean {:.1} ms, p50 ≤ {} ms, p99 ≤ {} ms over {} cycles",
            self.sum / self.count * 1e3,
            self.quantile_bound(0.5) * 1e3,
            self.quantile_bound(0.99) * 1e3,
            n0(self.count)
        )
    }
}

/// GET http://addr/metrics.
async fn scrape(addr: &str) -> BenchResult<String> {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(err("metrics connect"))?;
    s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .map_err(err("metrics request"))?;
    let mut body = String::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_string(&mut body))
        .await
        .map_err(err("metrics read"))?
        .map_err(err("metrics read"))?;
    Ok(body)
}

/// The highest Raft term any master reports (`gpuctl_raft_term`): each
/// election begins a term.
async fn highest_term(metrics: &[String]) -> u64 {
    let mut term = 0u64;
    for addr in metrics {
        if let Ok(text) = scrape(addr).await {
            if let Some(t) = gauge(&text, "gpuctl_raft_term") {
                term = term.max(t as u64);
            }
        }
    }
    term
}

fn gauge(text: &str, key: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|v| v.trim().parse().ok()))
}

/// The in-process masters and what they share.
struct Masters {
    masters: Vec<InProcessMaster>,
    addrs: Vec<String>,
    metrics: Vec<String>,
    ops: Vec<OperatorClient<Channel>>,
}

/// A loopback listener (the master sets TCP_NODELAY on what it accepts).
fn listener() -> std::io::Result<std::net::TcpListener> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(([127, 0, 0, 1], 0).into())?;
    socket.listen(1024)?.into_std()
}

fn start_masters(root: &Path, opts: &Opts) -> BenchResult<Masters> {
    let metrics: Vec<String> = (0..MASTERS)
        .map(|_| format!("127.0.0.1:{}", gpuctl_tests::free_port()))
        .collect();
    let listeners = (0..MASTERS)
        .map(|_| listener())
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(err("listen"))?;
    let masters = InProcessMaster::start_group_on(listeners, root, |i, c| {
        c.metrics_listen = metrics[i].parse().ok();
        if let Some(n) = opts.job_retention_max {
            c.retention.max_finished = n;
        }
    })
    .map_err(err("start the masters"))?;
    let addrs: Vec<String> = masters.iter().map(|m| m.addr().to_string()).collect();
    let ops = addrs
        .iter()
        .map(|a| channel(a, 1).map(|mut v| v.remove(0)))
        .collect::<BenchResult<Vec<_>>>()?;
    Ok(Masters {
        masters,
        addrs,
        metrics,
        ops,
    })
}

/// The latency phase: one job at a time on the idle cluster.
async fn latency_phase(
    sim: &SimAgents,
    ops: &Ops,
    opts: &Opts,
    report: &mut Report,
) -> BenchResult<()> {
    let ended_base = sim.counts().ended_acked;
    let mut jobs: Vec<(String, Duration)> = Vec::new();
    let limit = Duration::from_secs(opts.stall_secs);
    for n in 0..opts.latency_jobs {
        let before = sim.counts().running_acked;
        let at = sim.now();
        let id = ops
            .call(0, limit, |mut c| async move {
                c.submit_job(pb::SubmitJobRequest {
                    spec: Some(one_gpu_job(format!("latency-{n}"), forever())),
                    ..Default::default()
                })
                .await
            })
            .await
            .map_err(|s| format!("SubmitJob (latency): {}", status_text(&s)))?
            .into_inner()
            .job_id;
        jobs.push((id, at));
        let deadline = Instant::now() + Duration::from_secs(opts.stall_secs);
        while sim.counts().running_acked <= before {
            if Instant::now() > deadline {
                return Err(format!(
                    "latency job {n} not RUNNING within {} s",
                    opts.stall_secs
                ));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let running: HashMap<String, Duration> = sim
        .tasks()
        .into_iter()
        .filter_map(|t| t.running_acked.map(|r| (t.job_id, r)))
        .collect();
    let lat = sorted(
        jobs.iter()
            .filter_map(|(id, at)| running.get(id).map(|r| ms(r.saturating_sub(*at))))
            .collect(),
    );
    let (p50, p99) = (pct(&lat, 0.5), pct(&lat, 0.99));
    let size = format!(
        "{} jobs one at a time, {} agents idle",
        lat.len(),
        n0(opts.agents as f64)
    );
    report.row(
        "submit → RUNNING p50 (idle)",
        format!("{p50:.1} ms"),
        size.clone(),
        met(p50 < TARGET_LATENCY_P50_MS, "< 50 ms"),
    );
    report.row(
        "submit → RUNNING p99 (idle)",
        format!("{p99:.1} ms"),
        size,
        String::new(),
    );
    report.set(
        "latency_idle",
        json!({
            "jobs": lat.len(),
            "p50_ms": finite(p50),
            "p90_ms": finite(pct(&lat, 0.9)),
            "p99_ms": finite(p99),
            "max_ms": finite(pct(&lat, 1.0)),
            "min_ms": finite(pct(&lat, 0.0)),
            "target_p50_ms": TARGET_LATENCY_P50_MS,
            "met": p50 < TARGET_LATENCY_P50_MS,
        }),
    );
    cancel_all(sim, ops, &jobs, jobs.len(), ended_base, opts).await
}

fn print_batch(label: &str, b: &Batch, tasks_per_job: usize) {
    println!(
        "{label}: {} submitted in {:.2} s ({} errors{}); {} jobs done{} in {:.2} s: {} jobs/s ({} tasks/s), middle 80%: {} jobs/s; per job p50 {:.0} ms, p99 {:.0} ms; this process kept {:.2} cores busy",
        b.submitted.jobs.len(),
        (b.submitted.done - b.submitted.first).as_secs_f64(),
        b.submitted.errors,
        b.submitted.first_error.as_deref().map_or(String::new(), |e| format!(", first: {e}")),
        b.done_at.len(),
        if b.progress.complete { String::new() } else { format!(" (incomplete: {})", b.progress.why) },
        b.done_at.last().copied().unwrap_or(0.0),
        n0(b.rate()),
        n0(b.rate() * tasks_per_job as f64),
        n0(b.middle_rate()),
        pct(&b.latency_ms, 0.5),
        pct(&b.latency_ms, 0.99),
        b.cores_busy,
    );
}

/// Submits and cancels `--filler-jobs` jobs that never run.
async fn filler_phase(ops: &Ops, opts: &Opts, report: &mut Report) -> BenchResult<()> {
    let limit = Duration::from_secs(opts.stall_secs);
    let started = Instant::now();
    let done = AtomicUsize::new(0);
    let progress = async {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            eprintln!(
                "  [filler] {:.0} s: {} of {}",
                started.elapsed().as_secs_f64(),
                done.load(Ordering::Relaxed),
                opts.filler_jobs
            );
        }
    };
    let work = futures::stream::iter(0..opts.filler_jobs)
        .map(|n| {
            let done = &done;
            async move {
                let id = ops
                    .call(n, limit, |mut c| async move {
                        c.submit_job(pb::SubmitJobRequest {
                            spec: Some(pb::JobSpec {
                                placement: Some(pb::Placement {
                                    gpu_model: "no-such-gpu*".into(),
                                    ..Default::default()
                                }),
                                ..one_gpu_job(format!("filler-{n}"), forever())
                            }),
                            ..Default::default()
                        })
                        .await
                    })
                    .await
                    .map_err(|s| format!("SubmitJob (filler): {}", status_text(&s)))?
                    .into_inner()
                    .job_id;
                ops.call(n, limit, |mut c| {
                    let id = id.clone();
                    async move { c.cancel_job(pb::CancelJobRequest { job_id: id }).await }
                })
                .await
                .map_err(|s| format!("CancelJob (filler): {}", status_text(&s)))?;
                done.fetch_add(1, Ordering::Relaxed);
                Ok::<(), String>(())
            }
        })
        .buffer_unordered(opts.submit_concurrency.max(1))
        .collect::<Vec<_>>();
    let results = tokio::select! {
        r = work => r,
        _ = progress => Vec::new(),
    };
    let secs = started.elapsed().as_secs_f64();
    let errors: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    let ok = results.len() - errors.len();
    println!(
        "filler: {ok} jobs submitted and cancelled in {secs:.1} s ({} pairs/s), {} errors{}",
        n0(ok as f64 / secs),
        errors.len(),
        errors
            .first()
            .map_or(String::new(), |e| format!(", first: {e}"))
    );
    report.row(
        "SubmitJob + CancelJob pairs/s (filler)",
        format!("{} /s", n0(ok as f64 / secs)),
        format!("{} jobs that never run", n0(ok as f64)),
        String::new(),
    );
    report.set(
        "filler",
        json!({
            "jobs": ok,
            "errors": errors.len(),
            "first_error": errors.first(),
            "secs": secs,
            "pairs_per_sec": ok as f64 / secs,
        }),
    );
    Ok(())
}

/// Phases 1 to 9: the in-process masters.
async fn cluster_phases(
    opts: &Opts,
    root: &Path,
    report: &mut Report,
    rss: &mut Vec<(String, u64)>,
) -> BenchResult<()> {
    let gpus = opts.agents * opts.gpus_per_agent as usize;
    let mut m = start_masters(root, opts)?;
    let all: Vec<usize> = (0..MASTERS).collect();
    let leader = settled_leader(&m.ops, &m.addrs, &all, Duration::from_secs(60)).await?;
    println!(
        "masters: {} (leader: {}), data in {}",
        m.addrs.join(", "),
        m.addrs[leader],
        root.display()
    );
    let mut note_rss = |what: &str| {
        if let Some(k) = rss_kib(None) {
            rss.push((what.to_string(), k));
        }
    };
    note_rss("masters elected, no agents");
    let term_at_start = highest_term(&m.metrics).await;

    // 1. Registration.
    let sim = SimAgents::start(
        &m.addrs,
        SimConfig {
            agents: opts.agents,
            gpus_per_agent: opts.gpus_per_agent,
            run_time: None,
            run_time_from_command: true,
            connections: opts.connections(opts.agents),
            id_prefix: "scale".into(),
            ..Default::default()
        },
    )
    .map_err(err("start the agents"))?;
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(opts.phase_secs);
    while sim.registered() < opts.agents {
        if Instant::now() > deadline {
            return Err(format!(
                "only {} of {} agents registered",
                sim.registered(),
                opts.agents
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let reg_secs = (0..opts.agents)
        .filter_map(|i| sim.registration(i))
        .map(|r| r.at.as_secs_f64())
        .fold(0.0, f64::max);
    println!(
        "{} agents of {} GPUs registered in {reg_secs:.2} s",
        opts.agents, opts.gpus_per_agent
    );
    report.row(
        "agents registered (cold start)",
        format!("{reg_secs:.2} s"),
        format!("{} agents", n0(opts.agents as f64)),
        String::new(),
    );
    report.set(
        "registration",
        json!({ "agents": opts.agents, "secs": reg_secs }),
    );
    // Heartbeats under way.
    tokio::time::sleep(Duration::from_secs(3)).await;
    note_rss("agents registered, idle");
    let ops = Ops::new(&m.addrs, leader, opts.connections(opts.agents))?;
    let metrics_before = scrape(&m.metrics[ops.leader()]).await?;

    // 2. Latency, idle.
    if opts.latency_jobs > 0 {
        latency_phase(&sim, &ops, opts, report).await?;
    }
    let metrics_idle = scrape(&m.metrics[ops.leader()]).await?;
    let cycles_idle = Hist::parse(&metrics_idle, "gpuctl_allocation_cycle_seconds").since(
        &Hist::parse(&metrics_before, "gpuctl_allocation_cycle_seconds"),
    );

    // 3. Completions.
    if opts.short_jobs > 0 {
        let secs = opts.short_run_ms as f64 / 1000.0;
        let specs = (0..opts.short_jobs)
            .map(|n| one_gpu_job(format!("short-{n}"), vec!["sleep".into(), secs.to_string()]))
            .collect();
        let b = batch(
            On {
                sim: &sim,
                ops: &ops,
            },
            "completions",
            specs,
            1,
            usize::MAX,
            Count::Ended,
            opts,
        )
        .await;
        print_batch("completions", &b, 1);
        // A few of them, as the master says.
        let mut not_succeeded = 0;
        let limit = Duration::from_secs(opts.stall_secs);
        for (id, _) in b.submitted.jobs.iter().rev().take(20) {
            let j = ops
                .call(0, limit, |mut c| async move {
                    c.get_job(pb::GetJobRequest {
                        job_id: id.clone(),
                        ..Default::default()
                    })
                    .await
                })
                .await
                .map_err(|s| format!("GetJob: {}", status_text(&s)))?
                .into_inner();
            if j.state != pb::JobState::JobSucceeded as i32 {
                not_succeeded += 1;
            }
        }
        report.row(
            "completions/s (submit → SUCCEEDED)",
            format!("{} jobs/s", n0(b.rate())),
            format!(
                "{} one-GPU jobs of {} ms on {} GPUs{}",
                n0(b.done_at.len() as f64),
                opts.short_run_ms,
                n0(gpus as f64),
                if b.progress.complete {
                    ""
                } else {
                    " (incomplete)"
                }
            ),
            String::new(),
        );
        let mut j = b.json(1);
        j["run_ms"] = json!(opts.short_run_ms);
        j["spot_check_not_succeeded"] = json!(not_succeeded);
        report.set("completions", j);
    }

    // 4. Gangs.
    let per_agent = (opts.gpus_per_agent / opts.gang_gpus.max(1)) as usize;
    let gang_cap = opts.agents * per_agent / opts.gang_replicas.max(1) as usize;
    let gangs = opts.gangs.unwrap_or(gang_cap / 2);
    if gangs > 0 {
        let ended_base = sim.counts().ended_acked;
        let specs = (0..gangs)
            .map(|n| pb::JobSpec {
                name: format!("gang-{n}"),
                command: forever(),
                resources: Some(pb::Resources {
                    cpus: 1.0,
                    mem_mib: 0,
                    gpus: opts.gang_gpus,
                    ports: 0,
                }),
                replicas: opts.gang_replicas,
                ..Default::default()
            })
            .collect();
        let replicas = opts.gang_replicas.max(1) as usize;
        let b = batch(
            On {
                sim: &sim,
                ops: &ops,
            },
            "gangs",
            specs,
            replicas,
            gang_cap,
            Count::Running,
            opts,
        )
        .await;
        print_batch("gangs", &b, replicas);
        report.row(
            "gang placements/s (submit → all RUNNING)",
            format!(
                "{} gangs/s = {} tasks/s",
                n0(b.rate()),
                n0(b.rate() * replicas as f64)
            ),
            format!(
                "{} gangs of {replicas} × {} GPUs on {} agents{}",
                n0(b.done_at.len() as f64),
                opts.gang_gpus,
                n0(opts.agents as f64),
                if b.progress.complete {
                    ""
                } else {
                    " (incomplete)"
                }
            ),
            String::new(),
        );
        let mut j = b.json(replicas);
        j["replicas"] = json!(replicas);
        j["gpus_per_task"] = json!(opts.gang_gpus);
        report.set("gangs", j);
        cancel_all(
            &sim,
            &ops,
            &b.submitted.jobs,
            b.tasks_seen,
            ended_base,
            opts,
        )
        .await?;
    }

    // 5. Filler: jobs in the state that hold nothing.
    if opts.filler_jobs > 0 {
        filler_phase(&ops, opts, report).await?;
    }

    // 6. Placements.
    let pre_leader = ops.leader();
    let metrics_pre = scrape(&m.metrics[pre_leader]).await?;
    let specs = (0..opts.jobs)
        .map(|n| one_gpu_job(format!("place-{n}"), forever()))
        .collect();
    let b = batch(
        On {
            sim: &sim,
            ops: &ops,
        },
        "placements",
        specs,
        1,
        gpus,
        Count::Running,
        opts,
    )
    .await;
    print_batch("placements", &b, 1);
    let rate = b.rate();
    report.row(
        "placements/s (submit → RUNNING), 3 masters",
        format!("{} jobs/s (middle 80%: {})", n0(rate), n0(b.middle_rate())),
        format!(
            "{} of {} one-GPU jobs placed on {} agents × {} GPUs{}",
            n0(b.done_at.len() as f64),
            n0(opts.jobs as f64),
            n0(opts.agents as f64),
            opts.gpus_per_agent,
            if b.progress.complete {
                ""
            } else {
                " (incomplete)"
            }
        ),
        met(rate >= TARGET_PLACEMENTS_PER_SEC, "≥ 10,000/s"),
    );
    report.row(
        "submit → RUNNING p50 / p99 under that load",
        format!(
            "{} / {} ms",
            n0(pct(&b.latency_ms, 0.5)),
            n0(pct(&b.latency_ms, 0.99))
        ),
        String::new(),
        String::new(),
    );
    report.row(
        "SubmitJob/s (the submitter alone)",
        format!(
            "{} /s",
            n0(b.submitted.jobs.len() as f64
                / (b.submitted.done - b.submitted.first)
                    .as_secs_f64()
                    .max(1e-9))
        ),
        format!("{} calls in flight", opts.submit_concurrency),
        String::new(),
    );
    let mut j = b.json(1);
    j["target_per_sec"] = json!(TARGET_PLACEMENTS_PER_SEC);
    j["met"] = json!(rate >= TARGET_PLACEMENTS_PER_SEC);
    report.set("placements", j);
    tokio::time::sleep(Duration::from_secs(2)).await;
    note_rss("placement run done");

    // 7. ListJobs, the cycle, the data dirs. The leader may have changed
    // under the load: what follows asks the leader of now.
    let first_leader = leader;
    let leader = settled_leader(&m.ops, &m.addrs, &all, Duration::from_secs(60)).await?;
    if leader != first_leader {
        println!(
            "THE LEADER CHANGED during the run: {} then {}",
            m.addrs[first_leader], m.addrs[leader]
        );
    }
    // Elections under the load: terms begun since the first leader
    // settled (the failover below is not counted).
    let elections = highest_term(&m.metrics).await.saturating_sub(term_at_start);
    report.row(
        "elections during the run (before the failover)",
        elections.to_string(),
        format!("{} agents", opts.agents),
        met(elections == 0, "target 0"),
    );
    report.set(
        "leader",
        json!({
            "elections": elections,
            "at_start": m.addrs[first_leader],
            "after_placements": m.addrs[leader],
            "changed": leader != first_leader,
            "calls_redirected_or_retried": ops.redirects.load(Ordering::Relaxed),
            "lost_leadership_in_log": std::fs::read_to_string(root.join("masters.log"))
                .map(|t| t.matches("lost leadership").count())
                .unwrap_or(0),
        }),
    );
    ops.leader.store(leader, Ordering::SeqCst);
    let metrics_post = scrape(&m.metrics[leader]).await?;
    let jobs_in_state: f64 = [
        "queued",
        "starting",
        "running",
        "succeeded",
        "failed",
        "cancelled",
    ]
    .iter()
    .filter_map(|s| gauge(&metrics_post, &format!("gpuctl_jobs{{state=\"{s}\"}}")))
    .sum();
    let mut c = ops.clients[leader][0].clone();
    let mut list_ms = Vec::new();
    let mut page_len = 0;
    for _ in 0..20 {
        let t = Instant::now();
        let page = c
            .list_jobs(pb::ListJobsRequest::default())
            .await
            .map_err(err("ListJobs"))?
            .into_inner();
        list_ms.push(ms(t.elapsed()));
        page_len = page.jobs.len();
    }
    let list_ms = sorted(list_ms);
    let list_p50 = pct(&list_ms, 0.5);
    let at_size = jobs_in_state as usize >= TARGET_LIST_JOBS_JOBS;
    report.row(
        "ListJobs first page, at the leader (p50 of 20)",
        format!("{list_p50:.1} ms (max {:.1})", pct(&list_ms, 1.0)),
        format!("{page_len} jobs of {} in the state", n0(jobs_in_state)),
        if at_size {
            met(list_p50 < TARGET_LIST_JOBS_MS, "< 50 ms at 100,000 jobs")
        } else {
            format!(
                "{} at this size (target is at 100,000 jobs)",
                if list_p50 < TARGET_LIST_JOBS_MS {
                    "under 50 ms"
                } else {
                    "over 50 ms"
                }
            )
        },
    );
    report.set(
        "list_jobs_first_page",
        json!({
            "jobs_in_state": jobs_in_state,
            "page_jobs": page_len,
            "p50_ms": list_p50,
            "max_ms": pct(&list_ms, 1.0),
            "min_ms": pct(&list_ms, 0.0),
            "target_ms": TARGET_LIST_JOBS_MS,
            "at_target_size": at_size,
            "met": at_size && list_p50 < TARGET_LIST_JOBS_MS,
        }),
    );
    let cycles_all = Hist::parse(&metrics_post, "gpuctl_allocation_cycle_seconds");
    // A new leader's histogram starts when it took over.
    let cycles_run = if leader == pre_leader {
        cycles_all.since(&Hist::parse(
            &metrics_pre,
            "gpuctl_allocation_cycle_seconds",
        ))
    } else {
        cycles_all.clone()
    };
    report.row(
        "live allocation cycle, idle (leader /metrics)",
        cycles_idle.describe(),
        format!("{} agents", n0(opts.agents as f64)),
        String::new(),
    );
    report.row(
        "live allocation cycle, during placements",
        cycles_run.describe(),
        format!("{} agents", n0(opts.agents as f64)),
        String::new(),
    );
    report.set(
        "live_allocation_cycle",
        json!({
            "agents": opts.agents,
            "idle": cycles_idle.json(),
            "during_placements": cycles_run.json(),
            "whole_run": cycles_all.json(),
        }),
    );
    let unreachable_gauge = gauge(&metrics_post, "gpuctl_agents{state=\"unreachable\"}");
    let dirs_after_run: Vec<u64> = m.masters.iter().map(|x| dir_bytes(x.data_dir())).collect();

    // 8. Failover.
    if !opts.no_failover {
        let survivors: Vec<usize> = all.iter().copied().filter(|i| *i != leader).collect();
        let t0 = sim.now();
        m.masters[leader].kill();
        let polls: Vec<_> = survivors
            .iter()
            .map(|&i| {
                let mut c = m.ops[i].clone();
                let sim = &sim;
                Box::pin(async move {
                    loop {
                        let started = Instant::now();
                        let call = c.submit_job(pb::SubmitJobRequest {
                            spec: Some(pb::JobSpec {
                                name: "failover-probe".into(),
                                // No agent here offers Docker: it stays queued.
                                image: "busybox".into(),
                                command: vec!["true".into()],
                                resources: Some(pb::Resources {
                                    cpus: 1.0,
                                    mem_mib: 0,
                                    gpus: 0,
                                    ports: 0,
                                }),
                                ..Default::default()
                            }),
                            ..Default::default()
                        });
                        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(1), call).await
                        {
                            return (sim.now(), i);
                        }
                        tokio::time::sleep(FAILOVER_POLL.saturating_sub(started.elapsed())).await;
                    }
                })
            })
            .collect();
        let limit = Duration::from_secs(opts.phase_secs);
        let ((written, new_leader), _, _) =
            tokio::time::timeout(limit, futures::future::select_all(polls))
                .await
                .map_err(|_| "no survivor accepted a write".to_string())?;
        let write_ms = ms(written.saturating_sub(t0));
        let deadline = Instant::now() + limit;
        let delays = loop {
            let d: Vec<f64> = (0..sim.len())
                .filter_map(|i| sim.registration(i))
                .filter(|r| r.at > t0 && r.master == new_leader)
                .map(|r| ms(r.at - t0))
                .collect();
            if d.len() == sim.len() || Instant::now() > deadline {
                break sorted(d);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let all_back = delays.len() == sim.len();
        println!(
            "failover: new leader {} accepts a write after {write_ms:.0} ms; {} of {} agents re-registered, the last after {:.0} ms",
            m.addrs[new_leader],
            delays.len(),
            sim.len(),
            pct(&delays, 1.0)
        );
        report.row(
            "failover: new leader accepts a write",
            format!("{write_ms:.0} ms"),
            format!("{} agents, leader killed", n0(opts.agents as f64)),
            String::new(),
        );
        report.row(
            "failover: all agents re-registered",
            if all_back {
                format!(
                    "{:.0} ms (per agent p50 {:.0}, p99 {:.0})",
                    pct(&delays, 1.0),
                    pct(&delays, 0.5),
                    pct(&delays, 0.99)
                )
            } else {
                format!("only {} of {}", delays.len(), sim.len())
            },
            format!("{} agents", n0(opts.agents as f64)),
            String::new(),
        );
        report.set(
            "failover",
            json!({
                "agents": opts.agents,
                "jobs_in_state": jobs_in_state,
                "new_leader_write_ms": write_ms,
                "agents_reregistered": delays.len(),
                "all_reregistered_ms": if all_back { finite(pct(&delays, 1.0)) } else { Value::Null },
                "per_agent_p50_ms": finite(pct(&delays, 0.5)),
                "per_agent_p99_ms": finite(pct(&delays, 0.99)),
            }),
        );
    }
    let counts = sim.counts();
    let violations = sim.violations();
    drop(sim);

    // 9. Log and snapshot sizes, once the masters stopped.
    let data_dirs: Vec<PathBuf> = m
        .masters
        .iter()
        .map(|x| x.data_dir().to_path_buf())
        .collect();
    m.masters.clear();
    let mut logs = Vec::new();
    for (i, d) in data_dirs.iter().enumerate() {
        let t = sled_sizes(&d.join("raft"));
        println!(
            "master{}: data dir {} after the placement run; {t}",
            i + 1,
            mib(dirs_after_run[i] as f64)
        );
        logs.push(json!({
            "master": i + 1,
            "data_dir_bytes_after_placements": dirs_after_run[i],
            "data_dir_bytes_at_end": dir_bytes(d),
            "sled": t.json(),
        }));
    }
    let leader_sled = sled_sizes(&data_dirs[leader].join("raft"));
    report.row(
        "raft data dir (leader, after placements)",
        mib(dirs_after_run[leader] as f64),
        format!("{} jobs in the state", n0(jobs_in_state)),
        String::new(),
    );
    report.row(
        "raft log kept / snapshot (leader, at end)",
        format!(
            "{} entries, {} / snapshot {}",
            n0(leader_sled.entries as f64),
            mib(leader_sled.entry_bytes as f64),
            mib(leader_sled.snapshot_bytes as f64)
        ),
        format!("sled on disk {}", mib(leader_sled.on_disk as f64)),
        String::new(),
    );
    report.set("raft_storage", Value::Array(logs));
    // The whole state at the end as a snapshot would store it (the last
    // snapshot taken may be older: the log after it is replayed here).
    match gpuctl_master::raft::state_at_rest(&data_dirs[leader]).and_then(|state| {
        let (stored, json) = gpuctl_master::raft::encode_snapshot(&state)?;
        Ok((state.jobs().len(), stored.len(), json))
    }) {
        Ok((jobs, stored, json)) => {
            println!(
                "state at the end as a snapshot: {jobs} jobs, {} of JSON, {} stored (zstd)",
                mib(json as f64),
                mib(stored as f64)
            );
            report.row(
                "snapshot of the state at the end (leader)",
                format!(
                    "{} stored (zstd), {} of JSON",
                    mib(stored as f64),
                    mib(json as f64)
                ),
                format!(
                    "{} jobs, {} agents",
                    n0(jobs as f64),
                    n0(opts.agents as f64)
                ),
                String::new(),
            );
            report.set(
                "snapshot_at_end",
                json!({"jobs": jobs, "stored_bytes": stored, "json_bytes": json}),
            );
        }
        Err(e) => println!("state at the end: not read: {e}"),
    }
    let unreachable_marks = std::fs::read_to_string(root.join("masters.log"))
        .map(|t| t.matches("marking it unreachable").count())
        .unwrap_or(0);
    report.set(
        "sim",
        json!({
            "tasks_seen": counts.seen,
            "running_acked": counts.running_acked,
            "ended_acked": counts.ended_acked,
            "gpu_invariant_violations": violations.len(),
            "agents_marked_unreachable_in_log": unreachable_marks,
            "agents_unreachable_after_placements": unreachable_gauge,
        }),
    );
    if !violations.is_empty() {
        println!("GPU INVARIANT VIOLATIONS: {violations:?}");
    }
    Ok(())
}

/// What one master's sled trees hold.
#[derive(Default)]
struct SledSizes {
    entries: u64,
    entry_bytes: u64,
    snapshot_bytes: u64,
    on_disk: u64,
    error: Option<String>,
}

impl std::fmt::Display for SledSizes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(e) = &self.error {
            return write!(f, "sled not readable: {e}");
        }
        write!(
            f,
            "log: {} entries, {}; snapshot {}; on disk (sled and the snapshot) {}",
            self.entries,
            mib(self.entry_bytes as f64),
            mib(self.snapshot_bytes as f64),
            mib(self.on_disk as f64)
        )
    }
}

impl SledSizes {
    fn json(&self) -> Value {
        json!({
            "log_entries": self.entries,
            "log_bytes": self.entry_bytes,
            "snapshot_bytes": self.snapshot_bytes,
            "size_on_disk": self.on_disk,
            "error": self.error,
        })
    }
}

/// Reads a stopped master's raft storage (master/src/raft/storage.rs: the
/// trees `entries` and `meta`, the snapshot under `snapshot_data`).
fn sled_sizes(path: &Path) -> SledSizes {
    let deadline = Instant::now() + Duration::from_secs(10);
    let db = loop {
        match sled::open(path) {
            Ok(db) => break db,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                return SledSizes {
                    error: Some(e.to_string()),
                    ..Default::default()
                }
            }
        }
    };
    let mut s = SledSizes::default();
    // The log: one key per append, each a run of (u32 length, entry).
    if let Ok(log) = db.open_tree("log") {
        for (_, v) in log.iter().flatten() {
            s.entry_bytes += v.len() as u64;
            let mut b: &[u8] = &v;
            while let Some((len, rest)) = b.split_first_chunk::<4>() {
                s.entries += 1;
                b = rest
                    .get(u32::from_be_bytes(*len) as usize..)
                    .unwrap_or_default();
            }
        }
    }
    // The latest snapshot, a file beside sled's directory (older ones are
    // removed once it is durable).
    let snaps = path.with_file_name("raft-snapshots");
    s.snapshot_bytes = std::fs::read_dir(&snaps)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".snap"))
        .max_by_key(|e| e.file_name())
        .and_then(|e| e.metadata().ok())
        .map_or(0, |m| m.len());
    s.on_disk = db.size_on_disk().unwrap_or(0) + s.snapshot_bytes;
    s
}

/// Phase 9: the allocator's cycle on views built as
/// engine/benches/allocator.rs builds them.
fn alloc_phase(opts: &Opts, report: &mut Report) {
    let mut out = Vec::new();
    for &n in &opts.alloc_agents {
        let c = alloc_views::cluster(n);
        let config = gpuctl_engine::allocator::AllocatorConfig::default();
        let run = || {
            gpuctl_engine::allocator::allocate(
                &c.agents,
                &c.frameworks,
                &c.roles,
                &c.filters,
                &config,
                1_000,
            )
        };
        let plans = run();
        let offered_gpus: usize = plans.iter().map(|p| p.gpu_uuids.len()).sum();
        drop(plans);
        let times = sorted(
            (0..opts.alloc_iters.max(1))
                .map(|_| {
                    let t = Instant::now();
                    let plans = std::hint::black_box(run());
                    let e = ms(t.elapsed());
                    drop(plans);
                    e
                })
                .collect(),
        );
        let median = pct(&times, 0.5);
        println!(
            "allocation cycle at {n} agents: median {median:.1} ms (min {:.1}, max {:.1}), {offered_gpus} GPUs offered",
            pct(&times, 0.0),
            pct(&times, 1.0)
        );
        report.row(
            "allocation cycle (allocator::allocate)",
            format!("{median:.1} ms (min {:.1})", pct(&times, 0.0)),
            format!("{} agents, 100 frameworks", n0(n as f64)),
            if n == TARGET_ALLOC_AGENTS {
                met(median < TARGET_ALLOC_CYCLE_MS, "< 50 ms at 10,000 agents")
            } else {
                String::new()
            },
        );
        out.push(json!({
            "agents": n,
            "frameworks": alloc_views::FRAMEWORKS,
            "iterations": times.len(),
            "median_ms": median,
            "min_ms": pct(&times, 0.0),
            "max_ms": pct(&times, 1.0),
            "offered_gpus": offered_gpus,
            "met": (n == TARGET_ALLOC_AGENTS).then_some(median < TARGET_ALLOC_CYCLE_MS),
        }));
    }
    report.set("allocation_cycle", Value::Array(out));
}

async fn wait_registered(sim: &SimAgents, opts: &Opts) -> BenchResult<()> {
    let n = sim.len();
    let deadline = Instant::now() + Duration::from_secs(opts.phase_secs);
    while sim.registered() < n {
        if Instant::now() > deadline {
            return Err(format!(
                "only {} of {n} agents registered",
                sim.registered()
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// How long the memory run waits before reading the masters' VmRSS: past
/// one of their malloc_trim passes (`master/src/main.rs`, every 30 s).
const SETTLE: Duration = Duration::from_secs(32);

/// Phase 10: memory of `gpuctl-master` processes.
async fn memory_phase(opts: &Opts, report: &mut Report) -> BenchResult<()> {
    let agents = opts.memory_agents.unwrap_or(opts.agents);
    let gpus = agents * opts.gpus_per_agent as usize;
    let jobs = opts.memory_jobs.unwrap_or(opts.jobs.min(gpus)).min(gpus);
    let bin = gpuctl_tests::release_bin("gpuctl-master", "gpuctl-master");
    let dir = tempfile::tempdir().map_err(err("temp dir"))?;
    let addrs: Vec<String> = (0..MASTERS)
        .map(|_| format!("127.0.0.1:{}", gpuctl_tests::free_port()))
        .collect();
    let peers = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{}={a}", i + 1))
        .collect::<Vec<_>>()
        .join(",");
    let daemons: Vec<gpuctl_tests::Daemon> = (0..MASTERS)
        .map(|i| {
            let args = vec![
                "--node-id".to_string(),
                (i + 1).to_string(),
                "--listen".into(),
                addrs[i].clone(),
                "--peers".into(),
                peers.clone(),
                "--data-dir".into(),
                dir.path()
                    .join(format!("master{}", i + 1))
                    .display()
                    .to_string(),
            ];
            gpuctl_tests::Daemon::spawn(
                &format!("master{}", i + 1),
                &bin,
                &args,
                &[],
                dir.path().join(format!("master{}.log", i + 1)),
            )
        })
        .collect();
    let ops = addrs
        .iter()
        .map(|a| channel(a, 1).map(|mut v| v.remove(0)))
        .collect::<BenchResult<Vec<_>>>()?;
    let all: Vec<usize> = (0..MASTERS).collect();
    let leader = settled_leader(&ops, &addrs, &all, Duration::from_secs(60)).await?;
    // Several readings a second apart once settled; the last is kept. Each
    // settles past the masters' periodic malloc_trim (every 30 s), so the
    // figures are the memory a master holds, not what malloc kept after
    // the burst that came before.
    let rss = |settle: Duration| {
        let pids: Vec<i32> = daemons.iter().map(|d| d.pid()).collect();
        async move {
            tokio::time::sleep(settle).await;
            let mut last = vec![0u64; pids.len()];
            for _ in 0..3 {
                last = pids
                    .iter()
                    .map(|p| rss_kib(Some(*p)).unwrap_or(0))
                    .collect();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            last
        }
    };
    let r0 = rss(SETTLE).await;
    let bare = SimAgents::start(
        &addrs,
        SimConfig {
            agents,
            gpus_per_agent: 0,
            connections: opts.connections(agents),
            id_prefix: "bare".into(),
            ..Default::default()
        },
    )
    .map_err(err("start the agents"))?;
    wait_registered(&bare, opts).await?;
    let r1 = rss(SETTLE).await;
    let with_gpus = SimAgents::start(
        &addrs,
        SimConfig {
            agents,
            gpus_per_agent: opts.gpus_per_agent,
            connections: opts.connections(agents),
            id_prefix: "gpus".into(),
            ..Default::default()
        },
    )
    .map_err(err("start the agents"))?;
    wait_registered(&with_gpus, opts).await?;
    let r2 = rss(SETTLE).await;
    let mops = Ops::new(&addrs, leader, opts.connections(agents))?;
    let specs = (0..jobs)
        .map(|n| one_gpu_job(format!("mem-{n}"), forever()))
        .collect();
    let b = batch(
        On {
            sim: &with_gpus,
            ops: &mops,
        },
        "memory jobs",
        specs,
        1,
        gpus,
        Count::Running,
        opts,
    )
    .await;
    let placed = b.done_at.len();
    let r3 = rss(SETTLE).await;
    drop(bare);
    drop(with_gpus);
    drop(daemons);
    let per = |a: &[u64], b: &[u64], i: usize, n: usize| {
        (b[i] as f64 - a[i] as f64) * 1024.0 / n.max(1) as f64
    };
    let mut masters = Vec::new();
    for i in 0..MASTERS {
        let agent = per(&r0, &r1, i, agents);
        let gpu_agent = per(&r1, &r2, i, agents);
        let per_gpu = (gpu_agent - agent) / f64::from(opts.gpus_per_agent.max(1));
        let job = per(&r2, &r3, i, placed);
        println!(
            "master{} ({}): VmRSS {} → {} ({agents} agents, no GPUs) → {} (+{agents} agents of {} GPUs) → {} (+{placed} jobs RUNNING) KiB; per agent {agent:.0} B, per agent with GPUs {gpu_agent:.0} B (per GPU {per_gpu:.0} B), per job {job:.0} B",
            i + 1,
            if i == leader { "leader" } else { "follower" },
            r0[i], r1[i], r2[i], opts.gpus_per_agent, r3[i]
        );
        masters.push(json!({
            "master": i + 1,
            "leader": i == leader,
            "rss_kib_no_agents": r0[i],
            "rss_kib_bare_agents": r1[i],
            "rss_kib_gpu_agents": r2[i],
            "rss_kib_jobs": r3[i],
            "bytes_per_agent_no_gpus": agent,
            "bytes_per_agent_with_gpus": gpu_agent,
            "bytes_per_gpu": per_gpu,
            "bytes_per_job": job,
        }));
        if i == leader {
            report.row(
                "master memory per idle agent, beyond GPUs (leader)",
                format!("{} B", n0(agent)),
                format!(
                    "{} agents without GPUs, gpuctl-master process VmRSS",
                    n0(agents as f64)
                ),
                met(agent < TARGET_BYTES_PER_AGENT, "< 2 KiB"),
            );
            report.row(
                "master memory per agent of 8 GPUs (leader)",
                format!("{} B ({} B per GPU)", n0(gpu_agent), n0(per_gpu)),
                format!("{} more agents", n0(agents as f64)),
                String::new(),
            );
            report.row(
                "master memory per RUNNING job (leader)",
                format!("{} B", n0(job)),
                format!("{} one-GPU jobs", n0(placed as f64)),
                String::new(),
            );
        }
    }
    report.set(
        "memory",
        json!({
            "how": "VmRSS of three gpuctl-master release processes (the simulated agents in this process): before agents, after agents without GPUs, after as many with GPUs, after one-GPU jobs RUNNING; differences divided by the count",
            "agents": agents,
            "gpus_per_agent": opts.gpus_per_agent,
            "jobs_running": placed,
            "masters": masters,
            "target_bytes_per_agent": TARGET_BYTES_PER_AGENT,
        }),
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    let opts = Opts::parse();
    let result = if opts.compare.is_empty() {
        run(&opts)
    } else {
        compare::run(&opts.compare, opts.plot.as_deref())
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("scale-bench: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[path = "scale-bench/compare.rs"]
mod compare;
#[path = "scale-bench/plot.rs"]
mod plot;

fn run(opts: &Opts) -> BenchResult<()> {
    if opts.filler_jobs > 10_000 && opts.job_retention_max.is_none_or(|n| n < opts.filler_jobs) {
        return Err(format!(
            "--filler-jobs {} needs --job-retention-max of at least as many (the master forgets finished jobs beyond its 10,000 by default)",
            opts.filler_jobs
        ));
    }
    let temp;
    let root = match &opts.dir {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(err("--dir"))?;
            d.clone()
        }
        None => {
            temp = tempfile::tempdir().map_err(err("temp dir"))?;
            temp.path().to_path_buf()
        }
    };
    let log = std::fs::File::create(root.join("masters.log")).map_err(err("masters.log"))?;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&opts.log))
        .with_ansi(false)
        .with_writer(Mutex::new(log))
        .try_init()
        .map_err(err("log"))?;
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(gpuctl_tests::workspace_root())
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let config = json!({
        "masters": MASTERS,
        "masters_in": "this process (gpuctl_tests::sim::InProcessMaster::start_group), default options but --metrics-listen",
        "agents": opts.agents,
        "gpus_per_agent": opts.gpus_per_agent,
        "jobs": opts.jobs,
        "gangs": opts.gangs,
        "gang_replicas": opts.gang_replicas,
        "gang_gpus": opts.gang_gpus,
        "short_jobs": opts.short_jobs,
        "short_run_ms": opts.short_run_ms,
        "latency_jobs": opts.latency_jobs,
        "submit_concurrency": opts.submit_concurrency,
        "connections": opts.connections(opts.agents),
        "cpus": cpus,
        "commit": commit,
        "log": opts.log,
        "job_retention_max": opts.job_retention_max,
        "filler_jobs": opts.filler_jobs,
    });
    println!("scale-bench: {config}");
    let mut report = Report::default();
    report.set("config", config);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("bench")
        .build()
        .map_err(err("runtime"))?;
    let mut rss = Vec::new();
    let started = Instant::now();
    let r = rt.block_on(cluster_phases(opts, &root, &mut report, &mut rss));
    if let Err(e) = &r {
        println!("cluster phases stopped: {e}");
        report.set("cluster_phases_error", json!(e));
    }
    report.set(
        "process_rss_kib",
        Value::Object(rss.iter().map(|(k, v)| (k.clone(), json!(v))).collect()),
    );
    println!(
        "whole process VmRSS (3 masters + agents + benchmark): {}",
        rss.iter()
            .map(|(k, v)| format!("{k}: {} MiB", v / 1024))
            .collect::<Vec<_>>()
            .join("; ")
    );
    println!(
        "cluster phases took {:.0} s",
        started.elapsed().as_secs_f64()
    );
    if !opts.no_alloc {
        alloc_phase(opts, &mut report);
    }
    if !opts.no_memory {
        if let Err(e) = rt.block_on(memory_phase(opts, &mut report)) {
            println!("memory run stopped: {e}");
            report.set("memory_error", json!(e));
        }
    }
    rt.shutdown_timeout(Duration::from_secs(5));
    println!();
    report.print_table();
    println!();
    println!("{}", Value::Object(report.json));
    r
}
