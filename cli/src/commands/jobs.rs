//! `gpuctl jobs ...`. Each command is a function taking a connected
//! [`Master`] and a writer, so `gpuctl demo` reuses them as they are.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::time::Duration;

use clap::{Args, Subcommand};
use gpuctl_core::convert::job_state_name;
pub use gpuctl_core::logs::LogSelection;
use gpuctl_core::time::Backoff;
use gpuctl_proto::leader::leader_hint;
use gpuctl_proto::{new_request_id, pb};
use tokio::time::Instant;
use tonic::{Code, Status};

use super::jobfile;
pub use super::submit::SubmitArgs;
use super::{now_ms, parse_secs, CliError, EXIT_FAILURE, EXIT_OK};
use crate::client::{may_retry, Master, Retry, RPC_TIMEOUT};
use crate::output::{self, JobJson};

/// How often `jobs wait` asks for the job.
pub const WAIT_POLL: Duration = Duration::from_millis(200);
/// How long `jobs wait` keeps trying while no master can serve it.
const UNREACHABLE_GRACE: Duration = Duration::from_secs(60);
/// Log streams opened again in a row that brought no new output before
/// `jobs logs` stops (a stream that keeps failing, or a task that ended
/// while the master has not heard of it yet).
const MAX_FRUITLESS_STREAMS: u32 = 5;

#[derive(Debug, Subcommand)]
pub enum JobsCommand {
    /// Submit a job; prints its id.
    // Boxed: by far the largest command's arguments.
    Submit(Box<SubmitArgs>),
    /// List the jobs, oldest first (all of them unless --limit).
    List(ListArgs),
    /// Show one job and its tasks.
    Get {
        /// Job id.
        #[arg(required_unless_present = "request_id")]
        id: Option<String>,
        /// Instead of a job id: the job this token submitted with this
        /// request id (`jobs submit --request-id`, or the one an unknown
        /// outcome named) within 24 hours. Not found: exit 3.
        #[arg(long, value_name = "KEY", conflicts_with = "id", value_parser = super::parse_request_id)]
        request_id: Option<String>,
        /// Print JSON instead of the details (as `-o json`).
        #[arg(long, conflicts_with = "output")]
        json: bool,
        /// Print the job as json, or as yaml: its spec as a job file that
        /// `gpuctl jobs submit -f` submits again (secret values left out).
        #[arg(long, short = 'o', value_enum, value_name = "FORMAT")]
        output: Option<GetFormat>,
    },
    /// Print a job's output (stdout and stderr of its tasks). A gang's
    /// ranks are interleaved by line, each line prefixed with `[rank N]`.
    Logs {
        /// Job id.
        id: String,
        /// Keep printing until the tasks end.
        #[arg(long, short)]
        follow: bool,
        /// Only this rank's output.
        #[arg(long, value_name = "N")]
        rank: Option<u32>,
        /// The output of this attempt (1 is the first); the latest when
        /// not given.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        attempt: Option<u32>,
    },
    /// Cancel a job; prints CANCELLED once the cancel is committed (its
    /// tasks are then being stopped), or the state of a job that had
    /// already ended.
    Cancel {
        /// Job id.
        id: String,
        /// Wait until its tasks have stopped and it has ended; prints its
        /// final state.
        #[arg(long)]
        wait: bool,
    },
    /// Wait until a job ends; prints its final state. Exit 0 if it
    /// SUCCEEDED, 1 if it FAILED or was CANCELLED, 2 on timeout.
    Wait {
        /// Job id.
        id: String,
        /// Give up after this many seconds (fractions allowed).
        #[arg(long, value_name = "SECS", value_parser = parse_secs)]
        timeout: Option<Duration>,
    },
}

/// `jobs get -o FORMAT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GetFormat {
    Json,
    Yaml,
}

/// Filters of `jobs list`.
#[derive(Debug, Clone, Default, Args)]
pub struct ListArgs {
    /// Only jobs in this state: QUEUED, STARTING, RUNNING, SUCCEEDED,
    /// FAILED or CANCELLED (any case); repeatable or comma separated.
    #[arg(long = "state", value_name = "STATE", value_delimiter = ',', value_parser = parse_job_state)]
    pub states: Vec<pb::JobState>,
    /// Only jobs of exactly this name.
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    /// At most N jobs: the N most recently submitted. Default: all.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub limit: Option<u32>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// A job state as `jobs list --state` takes it: the upper-case word, any case.
pub fn parse_job_state(s: &str) -> Result<pb::JobState, String> {
    use pb::JobState as P;
    let all = [
        P::JobQueued,
        P::JobStarting,
        P::JobRunning,
        P::JobSucceeded,
        P::JobFailed,
        P::JobCancelled,
    ];
    let word = s.trim().to_ascii_uppercase();
    all.into_iter()
        .find(|st| job_state_name(*st as i32) == word)
        .ok_or_else(|| {
            format!("{s:?} is not a job state (QUEUED, STARTING, RUNNING, SUCCEEDED, FAILED, CANCELLED)")
        })
}

pub async fn run(
    master: &mut Master,
    cmd: JobsCommand,
    out: &mut dyn Write,
) -> Result<u8, CliError> {
    match cmd {
        JobsCommand::Submit(args) => {
            let (spec, request_id) = args.submission()?;
            let id = submit(master, spec, request_id).await?;
            writeln!(out, "{id}")?;
        }
        JobsCommand::List(args) => list_filtered(master, &args, out).await?,
        JobsCommand::Get {
            id,
            request_id,
            json,
            output,
        } => {
            let format = if json { Some(GetFormat::Json) } else { output };
            let which = match (id, request_id) {
                (_, Some(key)) => JobRef::Request(key),
                (Some(id), None) => JobRef::Id(id),
                // The parser requires one of them.
                (None, None) => {
                    return Err(CliError::Usage("give a job id or --request-id KEY".into()))
                }
            };
            get_as(master, &which, format, out).await?
        }
        JobsCommand::Logs {
            id,
            follow,
            rank,
            attempt,
        } => {
            let which = LogSelection {
                follow,
                rank,
                attempt,
            };
            stream_logs(master, &id, &which, |data| {
                out.write_all(data)?;
                out.flush()
            })
            .await?
        }
        JobsCommand::Cancel { id, wait: false } => {
            let state = cancel(master, &id).await?;
            writeln!(out, "{}", job_state_name(state))?;
        }
        JobsCommand::Cancel { id, wait: true } => {
            cancel(master, &id).await?;
            let job = wait(master, &id, None, WAIT_POLL).await?;
            writeln!(out, "{}", job_state_name(job.state))?;
        }
        JobsCommand::Wait { id, timeout } => {
            let job = wait(master, &id, timeout, WAIT_POLL).await?;
            writeln!(out, "{}", job_state_name(job.state))?;
            out.flush()?;
            let code = wait_exit_code(job.state);
            if code != EXIT_OK {
                // The master's words name the first task that failed
                // (the others were stopped because of it).
                let why = Some(job.message.as_str())
                    .filter(|m| !m.is_empty())
                    .or_else(|| job.tasks.last().map(|t| t.message.as_str()))
                    .unwrap_or_default();
                if why.is_empty() {
                    eprintln!("job {id} {}", job_state_name(job.state));
                } else {
                    eprintln!(
                        "job {id} {}: {}",
                        job_state_name(job.state),
                        super::one_line(why)
                    );
                }
            }
            return Ok(code);
        }
    }
    Ok(EXIT_OK)
}

/// Submits `spec`; returns the job's id. Every try carries the same
/// idempotency key (`request_id`, else a new one), so the master creates the
/// job at most once even when a try failed with an unknown outcome (a
/// connection lost mid-call, a leader deposed while committing): resending
/// is always safe. Giving up after such a try is an unknown outcome naming
/// the key, never an ordinary failure.
pub async fn submit(
    master: &mut Master,
    spec: pb::JobSpec,
    request_id: Option<String>,
) -> Result<String, CliError> {
    let request_id = request_id.unwrap_or_else(new_request_id);
    let resp = master
        .call(Retry::Resend, |mut c| {
            let req = pb::SubmitJobRequest {
                spec: Some(spec.clone()),
                request_id: request_id.clone(),
            };
            async move { c.submit_job(req).await }
        })
        .await
        .map_err(|e| {
            e.unknown_as(
                format!("the job may or may not have been created (request id {request_id})"),
                unknown_submit_next(&request_id),
            )
        })?;
    Ok(resp.job_id)
}

/// What to do after a submit with an unknown outcome.
pub fn unknown_submit_next(request_id: &str) -> String {
    format!(
        "look it up with `gpuctl jobs get --request-id {request_id}`, or submit again with \
         `--request-id {request_id}` added to the same command: it makes at most one job \
         (request ids are remembered for 24 hours)"
    )
}

/// A job named by its id, or by the request id of its submit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobRef {
    Id(String),
    Request(String),
}

/// Most jobs asked for in one ListJobs call (the master's maximum page).
const PAGE_LIMIT: u32 = 1000;

/// The jobs `args` selects, oldest first: page by page, following the
/// master's page tokens (the master answers newest first), until the last
/// page or `args.limit` jobs. A page is one call, retried and redirected
/// to the leader like any read; the tokens hold for any master.
pub async fn fetch_jobs(master: &mut Master, args: &ListArgs) -> Result<Vec<pb::Job>, CliError> {
    let mut jobs: Vec<pb::Job> = Vec::new();
    let mut token = String::new();
    loop {
        let want = args
            .limit
            .map_or(PAGE_LIMIT, |l| (l - jobs.len() as u32).min(PAGE_LIMIT));
        let req = pb::ListJobsRequest {
            states: args.states.iter().map(|s| *s as i32).collect(),
            name: args.name.clone().unwrap_or_default(),
            limit: want,
            page_token: token.clone(),
        };
        let resp = master
            .call(Retry::Always, |mut c| {
                let req = req.clone();
                async move { c.list_jobs(req).await }
            })
            .await?;
        let got = resp.jobs.len();
        jobs.extend(resp.jobs);
        if let Some(limit) = args.limit {
            // A master before paging answers with every job, oldest first.
            jobs.sort_by_key(|j| std::cmp::Reverse(job_number(&j.id)));
            jobs.truncate(limit as usize);
            if jobs.len() >= limit as usize {
                break;
            }
        }
        // The last page; or a page that makes no progress (never from a
        // sound master), rather than asking forever.
        if resp.next_page_token.is_empty() || got == 0 || resp.next_page_token == token {
            break;
        }
        token = resp.next_page_token;
    }
    jobs.sort_by_key(|j| (j.submitted_at_ms, job_number(&j.id), j.id.clone()));
    Ok(jobs)
}

/// N of `job-N` (jobs are numbered in submission order).
fn job_number(id: &str) -> u64 {
    id.strip_prefix("job-")
        .and_then(|n| n.parse().ok())
        .unwrap_or(u64::MAX)
}

/// `jobs list` with no filter.
pub async fn list(master: &mut Master, json: bool, out: &mut dyn Write) -> Result<(), CliError> {
    let args = ListArgs {
        json,
        ..ListArgs::default()
    };
    list_filtered(master, &args, out).await
}

pub async fn list_filtered(
    master: &mut Master,
    args: &ListArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let jobs = fetch_jobs(master, args).await?;
    if args.json {
        let items: Vec<JobJson> = jobs.iter().map(JobJson::from).collect();
        out.write_all(output::to_json(&items)?.as_bytes())?;
    } else {
        out.write_all(output::jobs_table(&jobs, now_ms()).render().as_bytes())?;
    }
    Ok(())
}

pub async fn get_job(master: &mut Master, id: &str) -> Result<pb::Job, CliError> {
    let deadline = Instant::now() + master.retry_for;
    get_job_until(master, id, RPC_TIMEOUT, deadline).await
}

async fn get_job_until(
    master: &mut Master,
    id: &str,
    attempt: Duration,
    deadline: Instant,
) -> Result<pb::Job, CliError> {
    master
        .call_until(Retry::Always, Some(attempt), deadline, |mut c| {
            let req = pb::GetJobRequest {
                job_id: id.to_string(),
                ..Default::default()
            };
            async move { c.get_job(req).await }
        })
        .await
}

/// The job its submit's request id names: the one this token submitted
/// with it within 24 hours (NOT_FOUND, naming the key, otherwise).
pub async fn get_job_by_request(master: &mut Master, key: &str) -> Result<pb::Job, CliError> {
    master
        .call(Retry::Always, |mut c| {
            let req = pb::GetJobRequest {
                request_id: key.to_string(),
                ..Default::default()
            };
            async move { c.get_job(req).await }
        })
        .await
}

/// `jobs get`: the details, or the job in `format`.
pub async fn get_as(
    master: &mut Master,
    which: &JobRef,
    format: Option<GetFormat>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let job = match which {
        JobRef::Id(id) => get_job(master, id).await?,
        JobRef::Request(key) => get_job_by_request(master, key).await?,
    };
    match format {
        Some(GetFormat::Json) => {
            out.write_all(output::to_json(&JobJson::from(&job))?.as_bytes())?
        }
        Some(GetFormat::Yaml) => {
            out.write_all(jobfile::to_yaml(&job).map_err(CliError::Other)?.as_bytes())?
        }
        None => out.write_all(output::job_detail(&job, now_ms()).as_bytes())?,
    }
    Ok(())
}

/// Where each task's output stands in what was written.
#[derive(Debug, Default)]
struct TaskOutput {
    /// Bytes of it written so far.
    written: u64,
    /// Bytes of it the current stream has carried.
    seen: u64,
    /// Whether the last byte written ended a line (a prefix comes next).
    mid_line: bool,
}

/// Writes one task's bytes, each line prefixed when `prefix` is given.
fn write_task_output<F>(
    sink: &mut F,
    prefix: Option<&str>,
    data: &[u8],
    at: &mut TaskOutput,
) -> io::Result<()>
where
    F: FnMut(&[u8]) -> io::Result<()>,
{
    let Some(prefix) = prefix else {
        return sink(data);
    };
    for piece in data.split_inclusive(|b| *b == b'\n') {
        if !at.mid_line {
            sink(prefix.as_bytes())?;
        }
        sink(piece)?;
        at.mid_line = !piece.ends_with(b"\n");
    }
    Ok(())
}

/// Streams a job's output to `sink` until the master ends the stream (at
/// once without `follow`, when the tasks end with it). With several tasks
/// each line is prefixed with its task's rank.
///
/// Survives a master failover: a stream that breaks is opened again at the
/// leader. A new stream starts each task from its first byte, so what was
/// already written of each is skipped (counted per task: the interleaving
/// of tasks may differ from one stream to the next). With `follow`, a
/// stream that ends while the job says its task still runs was ended by a
/// master losing leadership, and is opened again too.
pub async fn stream_logs<F>(
    master: &mut Master,
    id: &str,
    which: &LogSelection,
    mut sink: F,
) -> Result<(), CliError>
where
    F: FnMut(&[u8]) -> io::Result<()>,
{
    let mut tasks: BTreeMap<String, TaskOutput> = BTreeMap::new();
    // The task written last, when it stopped mid-line.
    let mut open_line: Option<String> = None;
    let total =
        |tasks: &BTreeMap<String, TaskOutput>| tasks.values().map(|t| t.written).sum::<u64>();
    let mut fruitless = 0;
    loop {
        let mut stream = open_logs(master, id, which).await?;
        let before = total(&tasks);
        for t in tasks.values_mut() {
            t.seen = 0;
        }
        let broken = loop {
            match stream.message().await {
                Ok(Some(chunk)) => {
                    let data = &chunk.data[..];
                    let at = tasks.entry(chunk.task_id.clone()).or_default();
                    let skip = at.written.saturating_sub(at.seen).min(data.len() as u64) as usize;
                    at.seen += data.len() as u64;
                    if skip < data.len() {
                        let prefix = (chunk.tasks > 1).then(|| format!("[rank {}] ", chunk.rank));
                        // Another task's line left open is ended here; its
                        // rest comes later with its prefix again.
                        if let Some(other) = open_line.take().filter(|o| *o != chunk.task_id) {
                            sink(b"\n")?;
                            if let Some(o) = tasks.get_mut(&other) {
                                o.mid_line = false;
                            }
                        }
                        let at = tasks.entry(chunk.task_id.clone()).or_default();
                        write_task_output(&mut sink, prefix.as_deref(), &data[skip..], at)?;
                        at.written += (data.len() - skip) as u64;
                        if at.mid_line && prefix.is_some() {
                            open_line = Some(chunk.task_id.clone());
                        }
                    }
                }
                Ok(None) => break None,
                // Reading again is harmless: any failure another master
                // may not have (the master died: a transport error) counts.
                Err(status) if may_retry(&status) => break Some(status),
                Err(status) => return Err(CliError::rpc(master.addr(), status)),
            }
        };
        fruitless = if total(&tasks) > before {
            0
        } else {
            fruitless + 1
        };
        match broken {
            Some(status) => {
                if fruitless >= MAX_FRUITLESS_STREAMS {
                    return Err(CliError::rpc(master.addr(), status));
                }
                tracing::debug!(addr = %master.addr(), error = %status.message(), "log stream broke; opening it again");
                if let Some(leader) = leader_hint(&status) {
                    master.switch_to(leader);
                }
            }
            None if !which.follow => return Ok(()),
            None => {
                if fruitless >= MAX_FRUITLESS_STREAMS || selection_ended(master, id, which).await? {
                    return Ok(());
                }
                tracing::debug!(addr = %master.addr(), "log stream ended before the task; opening it again");
            }
        }
        if fruitless > 0 {
            tokio::time::sleep(WAIT_POLL).await;
        }
    }
}

async fn open_logs(
    master: &mut Master,
    id: &str,
    which: &LogSelection,
) -> Result<tonic::Streaming<pb::LogChunk>, CliError> {
    // With --follow the master answers once the job is placed: no limit.
    let attempt = (!which.follow).then_some(RPC_TIMEOUT);
    let deadline = Instant::now() + master.retry_for;
    master
        .call_until(Retry::Always, attempt, deadline, |mut c| {
            let req = pb::JobLogsRequest {
                job_id: id.to_string(),
                follow: which.follow,
                rank: which.rank,
                attempt: which.attempt,
            };
            async move { c.job_logs(req).await }
        })
        .await
}

/// Whether the job, or every task whose output `which` selects, has ended.
async fn selection_ended(
    master: &mut Master,
    id: &str,
    which: &LogSelection,
) -> Result<bool, CliError> {
    let job = get_job(master, id).await?;
    Ok(is_terminal(job.state) || which.ended(&job.tasks))
}

/// Cancels a job; returns its state afterwards (wire value).
pub async fn cancel(master: &mut Master, id: &str) -> Result<i32, CliError> {
    // Cancelling twice answers the same state: safe to resend.
    let resp = master
        .call(Retry::Resend, |mut c| {
            let req = pb::CancelJobRequest {
                job_id: id.to_string(),
            };
            async move { c.cancel_job(req).await }
        })
        .await
        .map_err(|e| {
            e.unknown_as(
                format!("job {id} may or may not have been asked to stop"),
                format!("`gpuctl jobs cancel {id}` again is safe"),
            )
        })?;
    Ok(resp.state)
}

pub fn is_terminal(state: i32) -> bool {
    matches!(
        pb::JobState::try_from(state),
        Ok(pb::JobState::JobSucceeded | pb::JobState::JobFailed | pb::JobState::JobCancelled)
    )
}

/// Exit code of `jobs wait` for a terminal job state.
pub fn wait_exit_code(state: i32) -> u8 {
    match pb::JobState::try_from(state) {
        Ok(pb::JobState::JobSucceeded) => EXIT_OK,
        _ => EXIT_FAILURE,
    }
}

/// How a job's current state reads in a `jobs wait` timeout.
fn still(job: &pb::Job) -> String {
    match crate::output::wait_reason(job) {
        Some(why) => format!("still {}: {why}", job_state_name(job.state)),
        None => format!("still {}", job_state_name(job.state)),
    }
}

/// How following the job's watch stream ended.
enum Watched {
    Ended(Box<pb::Job>),
    /// `--timeout` passed.
    TimedOut,
    /// A master without `WatchJob`: poll instead.
    Unsupported,
}

/// Waits until the job is terminal and returns it, following the master's
/// `WatchJob` stream (one message per change, no polling); a broken stream
/// (the leader changed, the master died) is opened again at the leader.
/// A master too old to watch is polled every `poll`.
pub async fn wait(
    master: &mut Master,
    id: &str,
    timeout: Option<Duration>,
    poll: Duration,
) -> Result<pb::Job, CliError> {
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut last_state = String::from("unknown state");
    match watch(master, id, deadline, &mut last_state).await? {
        Watched::Ended(job) => Ok(*job),
        Watched::TimedOut => {
            let waited = timeout.unwrap_or_default().as_secs_f64();
            Err(CliError::Timeout(format!(
                "timed out after {waited}s waiting for job {id} ({last_state})"
            )))
        }
        Watched::Unsupported => {
            poll_until_done(master, id, timeout, deadline, poll, last_state).await
        }
    }
}

async fn watch(
    master: &mut Master,
    id: &str,
    deadline: Option<Instant>,
    last_state: &mut String,
) -> Result<Watched, CliError> {
    let remaining = || deadline.map(|d| d.saturating_duration_since(Instant::now()));
    // Streams in a row that ended with nothing new: a master that keeps
    // ending them is given up on, with a pause between tries.
    let mut fruitless = 0;
    let mut seen: Option<pb::Job> = None;
    let mut pause = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    loop {
        let search_until = {
            let grace = Instant::now() + UNREACHABLE_GRACE;
            deadline.map_or(grace, |d| d.min(grace))
        };
        let opened = master
            .call_until(Retry::Always, Some(RPC_TIMEOUT), search_until, |mut c| {
                let req = pb::GetJobRequest {
                    job_id: id.to_string(),
                    ..Default::default()
                };
                async move { c.watch_job(req).await }
            })
            .await;
        let mut stream = match opened {
            Ok(s) => s,
            Err(CliError::Rpc { status, .. }) if status.code() == Code::Unimplemented => {
                return Ok(Watched::Unsupported)
            }
            // Gave up because --timeout came first: a timeout, not an error.
            Err(CliError::GaveUp { last, .. }) if deadline.is_some_and(|d| d <= search_until) => {
                last_state.push_str(&format!("; last error: {last}"));
                return Ok(Watched::TimedOut);
            }
            Err(e) => return Err(e),
        };
        let broken = loop {
            let next = match remaining() {
                Some(r) => match tokio::time::timeout(r, stream.message()).await {
                    Ok(m) => m,
                    Err(_) => return Ok(Watched::TimedOut),
                },
                None => stream.message().await,
            };
            match next {
                Ok(Some(job)) => {
                    if is_terminal(job.state) {
                        return Ok(Watched::Ended(Box::new(job)));
                    }
                    if seen.as_ref() != Some(&job) {
                        fruitless = 0;
                        pause.reset();
                        *last_state = still(&job);
                        seen = Some(job);
                    }
                }
                // The master ended the stream without the end: watch again.
                Ok(None) => break None,
                Err(status) if may_retry(&status) => break Some(status),
                Err(status) => return Err(CliError::rpc(master.addr(), status)),
            }
        };
        fruitless += 1;
        if fruitless >= MAX_FRUITLESS_STREAMS {
            let status = broken.unwrap_or_else(|| Status::unavailable("the watch kept ending"));
            return Err(CliError::rpc(master.addr(), status));
        }
        if let Some(leader) = broken.as_ref().and_then(leader_hint) {
            master.switch_to(leader);
        }
        let wait = remaining().map_or(pause.peek(), |r| r.min(pause.peek()));
        if remaining().is_some_and(|r| r.is_zero()) {
            return Ok(Watched::TimedOut);
        }
        tokio::time::sleep(wait).await;
        pause.next_wait();
    }
}

/// Polls the job every `poll` until it is terminal and returns it. Rides
/// out a master failover: each poll follows the leader, for up to a minute
/// while no master can serve it.
async fn poll_until_done(
    master: &mut Master,
    id: &str,
    timeout: Option<Duration>,
    deadline: Option<Instant>,
    poll: Duration,
    mut last_state: String,
) -> Result<pb::Job, CliError> {
    let remaining = || deadline.map(|d| d.saturating_duration_since(Instant::now()));
    loop {
        let now = Instant::now();
        let grace = now + UNREACHABLE_GRACE;
        let search_until = deadline.map_or(grace, |d| d.min(grace));
        let attempt = remaining()
            .map_or(RPC_TIMEOUT, |r| r.min(RPC_TIMEOUT))
            .max(Duration::from_millis(50));
        match get_job_until(master, id, attempt, search_until).await {
            Ok(job) => {
                if is_terminal(job.state) {
                    return Ok(job);
                }
                last_state = still(&job);
            }
            // Gave up because --timeout came first: a timeout, not an error.
            Err(CliError::GaveUp { last, .. }) if deadline.is_some_and(|d| d <= grace) => {
                let waited = timeout.unwrap_or_default().as_secs_f64();
                return Err(CliError::Timeout(format!(
                    "timed out after {waited}s waiting for job {id} ({last_state}; last error: {last})"
                )));
            }
            Err(e) => return Err(e),
        }
        if let Some(r) = remaining() {
            if r.is_zero() {
                let waited = timeout.unwrap_or_default().as_secs_f64();
                return Err(CliError::Timeout(format!(
                    "timed out after {waited}s waiting for job {id} ({last_state})"
                )));
            }
        }
        let pause = remaining().map_or(poll, |r| r.min(poll));
        tokio::time::sleep(pause).await;
    }
}

#[cfg(test)]
#[allow(clippy::result_large_err)]
mod tests {
    use super::*;
    use crate::commands::job_values::*;
    use crate::commands::jobfile::JobFile;
    use crate::commands::testkit::{chunks, dead_addr, serve, FakeOperator};
    use crate::commands::{Cli, Command};
    use crate::error::{EXIT_FAILURE, EXIT_NOT_FOUND, EXIT_TIMEOUT, EXIT_USAGE};
    use clap::Parser;
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("gpuctl").chain(args.iter().copied()))
    }

    fn submit_args(args: &[&str]) -> SubmitArgs {
        match parse(args).unwrap().command {
            Command::Jobs(JobsCommand::Submit(a)) => *a,
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn env_pairs() {
        assert_eq!(
            parse_env_pair("A=1").unwrap(),
            ("A".to_string(), "1".to_string())
        );
        assert_eq!(
            parse_env_pair("A=").unwrap(),
            ("A".to_string(), String::new())
        );
        assert_eq!(
            parse_env_pair("A=b=c").unwrap(),
            ("A".to_string(), "b=c".to_string())
        );
        assert!(parse_env_pair("A").is_err());
        assert!(parse_env_pair("=1").is_err());
    }

    #[test]
    fn env_without_equals_is_a_usage_error_naming_env() {
        let err = parse(&[
            "jobs", "submit", "--name", "x", "--env", "FOO", "--", "true",
        ])
        .unwrap_err();
        assert_eq!(err.exit_code(), i32::from(EXIT_USAGE));
        assert!(err.to_string().contains("--env"), "{err}");
    }

    #[test]
    fn a_spec_the_master_would_refuse_is_refused_here_naming_the_field() {
        // Rules that live only in `convert`, not in the flags' parsers.
        for (args, field) in [
            (vec!["--name", "has space"], "name"),
            (vec!["--name", "x", "--image", "bad image"], "image"),
            (vec!["--name", "x", "--tenant", "has space"], "tenant"),
        ] {
            let mut all = vec!["jobs", "submit"];
            all.extend(args);
            all.extend(["--", "true"]);
            match submit_args(&all).to_spec() {
                Err(e @ CliError::Other(_)) => {
                    assert_eq!(e.exit_code(), EXIT_FAILURE, "as the master's refusal");
                    let m = e.to_string();
                    assert!(m.contains(&format!("invalid spec.{field}")), "{all:?}: {m}")
                }
                other => panic!("{all:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn submit_defaults() {
        let a = submit_args(&["jobs", "submit", "--name", "x", "--", "echo", "hi"]);
        let spec = a.to_spec().unwrap();
        assert_eq!(spec.name, "x");
        assert_eq!(spec.image, "");
        assert_eq!(spec.command, vec!["echo", "hi"]);
        assert_eq!(
            spec.resources,
            Some(pb::Resources {
                cpus: 1.0,
                mem_mib: 0,
                gpus: 0,
                ports: 0,
            })
        );
        assert!(spec.env.is_empty());
        assert!(!spec.no_fence);
        assert_eq!(spec.security, None, "the defaults are not sent");
    }

    #[test]
    fn submit_require_cuda() {
        let a = submit_args(&[
            "jobs",
            "submit",
            "--name",
            "x",
            "--require-cuda",
            "cuda>=12.2 driver>=470,driver<471",
            "--",
            "true",
        ]);
        assert_eq!(
            a.to_spec().unwrap().require_cuda,
            "cuda>=12.2 driver>=470,driver<471"
        );
        let none = submit_args(&["jobs", "submit", "--name", "x", "--", "true"]);
        assert_eq!(none.to_spec().unwrap().require_cuda, "");
        for (bad, why) in [
            ("cuda>=12.x", "not a version"),
            ("cudnn>=8", "unknown key"),
            (",", "no condition"),
        ] {
            let err = parse(&[
                "jobs",
                "submit",
                "--name",
                "x",
                "--require-cuda",
                bad,
                "--",
                "true",
            ])
            .unwrap_err();
            assert_eq!(err.exit_code(), i32::from(EXIT_USAGE));
            let text = err.to_string();
            assert!(
                text.contains("--require-cuda") && text.contains(why),
                "{text}"
            );
        }
    }

    #[test]
    fn submit_security_flags() {
        let a = submit_args(&[
            "jobs",
            "submit",
            "--name",
            "x",
            "--image",
            "img",
            "--user",
            "1234:5",
            "--mount",
            "/data/sets:/data",
            "--mount",
            "/scratch:/out:rw",
            "--mount",
            "/models:/m:ro",
            "--",
            "true",
        ]);
        let s = a.to_spec().unwrap().security.unwrap();
        assert_eq!(s.user, "1234:5");
        let m = |h: &str, c: &str, rw: bool| pb::HostMount {
            host_path: h.into(),
            container_path: c.into(),
            read_write: rw,
        };
        assert_eq!(
            s.mounts,
            [
                m("/data/sets", "/data", false),
                m("/scratch", "/out", true),
                m("/models", "/m", false)
            ]
        );
        assert!(!s.run_as_root && !s.privileged);
        let a = submit_args(&["jobs", "submit", "--name", "x", "--run-as-root", "--", "id"]);
        assert!(a.to_spec().unwrap().security.unwrap().run_as_root);
        for bad in ["/a", "/a:/b:x", ":/b", "/a:", "/a:/b:rw:x"] {
            let err = parse(&[
                "jobs", "submit", "--name", "x", "--mount", bad, "--", "true",
            ])
            .unwrap_err();
            assert_eq!(err.exit_code(), i32::from(EXIT_USAGE));
            assert!(err.to_string().contains("--mount"), "{bad}: {err}");
        }
    }

    #[test]
    fn submit_no_fence() {
        let a = submit_args(&["jobs", "submit", "--name", "x", "--no-fence", "--", "true"]);
        assert!(a.to_spec().unwrap().no_fence);
    }

    #[test]
    fn submit_all_flags_and_command_with_dashes() {
        let a = submit_args(&[
            "jobs",
            "submit",
            "--name",
            "t",
            "--image",
            "busybox",
            "--gpus",
            "2",
            "--cpus",
            "0.5",
            "--mem",
            "1024",
            "--env",
            "A=1",
            "--env",
            "B=x=y",
            "--",
            "sh",
            "-c",
            "echo --gpus",
        ]);
        let spec = a.to_spec().unwrap();
        assert_eq!(spec.image, "busybox");
        assert_eq!(spec.command, vec!["sh", "-c", "echo --gpus"]);
        assert_eq!(
            spec.resources,
            Some(pb::Resources {
                cpus: 0.5,
                mem_mib: 1024,
                gpus: 2,
                ports: 0,
            })
        );
        assert_eq!(spec.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(spec.env.get("B").map(String::as_str), Some("x=y"));
    }

    #[test]
    fn submit_mig_gives_each_task_one_mig_device() {
        let spec = |args: &[&str]| {
            let mut all = vec!["jobs", "submit", "--name", "x"];
            all.extend_from_slice(args);
            all.extend_from_slice(&["--", "true"]);
            submit_args(&all).to_spec()
        };
        let s = spec(&["--mig", "1g.10gb", "--replicas", "3"]).unwrap();
        assert_eq!(s.placement.unwrap().mig, "1g.10gb");
        assert_eq!(s.resources.unwrap().gpus, 1);
        assert_eq!(s.replicas, 3);
        assert_eq!(
            spec(&["--mig", "1g.10gb", "--gpus", "1"])
                .unwrap()
                .resources
                .unwrap()
                .gpus,
            1
        );
        let err = spec(&["--mig", "1g.10gb", "--gpus", "2"]).unwrap_err();
        assert!(matches!(err, CliError::Usage(_)), "{err}");
        assert!(err.to_string().contains("--mig 1g.10gb"), "{err}");
        // From a job file.
        let file = jobfile::parse(
            "j.yaml",
            "name: m
command: [true]
mig: 2g.20gb
",
        )
        .unwrap();
        let s = submit_args(&["jobs", "submit", "-f", "j.yaml"])
            .spec_with(file)
            .unwrap();
        assert_eq!(s.placement.unwrap().mig, "2g.20gb");
        assert_eq!(s.resources.unwrap().gpus, 1);
    }

    #[test]
    fn submit_gpu_mem_asks_a_fraction_of_a_shared_gpu() {
        let spec = |args: &[&str]| {
            let mut all = vec!["jobs", "submit", "--name", "x"];
            all.extend_from_slice(args);
            all.extend_from_slice(&["--", "true"]);
            submit_args(&all).to_spec()
        };
        let s = spec(&["--gpu-mem", "10GiB", "--gpu-compute", "25%"]).unwrap();
        let p = s.placement.unwrap();
        assert_eq!((p.gpu_mem_mib, p.gpu_compute_pct), (10240, 25));
        assert_eq!(s.resources.unwrap().gpus, 0);
        assert_eq!(parse_gpu_mem("512"), Ok(512));
        assert_eq!(parse_gpu_mem("512MiB"), Ok(512));
        assert_eq!(parse_gpu_mem("2G"), Ok(2048));
        for bad in ["", "0", "ten", "5XB", "-1GiB"] {
            assert!(parse_gpu_mem(bad).is_err(), "{bad}");
        }
        for bad in ["0", "101", "50.5", "x%"] {
            assert!(parse_gpu_compute(bad).is_err(), "{bad}");
        }
        assert!(matches!(
            spec(&["--gpu-mem", "1GiB", "--gpus", "1"]),
            Err(CliError::Usage(_))
        ));
        assert!(matches!(
            spec(&["--gpu-mem", "1GiB", "--mig", "1g.10gb"]),
            Err(CliError::Usage(_))
        ));
        // Compute alone is refused by the argument parser's check too.
        assert!(matches!(
            spec(&["--gpu-compute", "10"]),
            Err(CliError::Usage(_))
        ));
        let file = jobfile::parse(
            "j.yaml",
            "name: m\ncommand: [true]\ngpu_mem: 4GiB\ngpu_compute: 10%\n",
        )
        .unwrap();
        let s = submit_args(&["jobs", "submit", "-f", "j.yaml"])
            .spec_with(file)
            .unwrap();
        let p = s.placement.unwrap();
        assert_eq!((p.gpu_mem_mib, p.gpu_compute_pct), (4096, 10));
    }

    #[test]
    fn stop_grace_and_checkpoint_dir_flags_reach_the_spec() {
        let s = submit_args(&[
            "jobs",
            "submit",
            "--name",
            "x",
            "--stop-grace",
            "90s",
            "--checkpoint-dir",
            "/ckpt/x",
            "--",
            "true",
        ])
        .to_spec()
        .unwrap();
        assert_eq!(s.stop_grace_ms, Some(90_000));
        assert_eq!(s.checkpoint_dir, "/ckpt/x");
        let s = submit_args(&["jobs", "submit", "--name", "x", "--", "true"])
            .to_spec()
            .unwrap();
        assert_eq!((s.stop_grace_ms, s.checkpoint_dir.as_str()), (None, ""));
        assert_eq!(parse_stop_grace("5m"), Ok(300_000));
        assert_eq!(parse_stop_grace("20"), Ok(20_000));
        assert!(parse_stop_grace("soon").is_err());
        assert!(parse_stop_grace("2d")
            .unwrap_err()
            .contains("longer than a day"));
        assert!(parse(&[
            "jobs",
            "submit",
            "--name",
            "x",
            "--stop-grace",
            "x",
            "--",
            "true"
        ])
        .is_err());
    }

    #[test]
    fn submit_needs_name_and_command() {
        assert!(parse(&["jobs", "submit", "--", "true"]).is_err());
        assert!(parse(&["jobs", "submit", "--name", "x"]).is_err());
        assert!(parse(&["jobs", "submit", "--name", "x", "--cpus", "-1", "--", "true"]).is_err());
    }

    #[test]
    fn job_file_under_flags() {
        let file = jobfile::parse(
            "j.yaml",
            "name: from-file\nimage: busybox\ncommand: [sh, -c, 'echo $A']\ngpus: 2\n\
             cpus: 0.5\nmem: 64\nenv: {A: 1, B: 2}\nsecret_env: {S: s3cret}\n\
             constraint: {k: v}\nmount: ['/d:/e:rw']\npriority: 5\nreplicas: 2\n\
             max_retries: 3\nno_fence: true\nplacement: spread\nrequire_cuda: cuda>=12.0\n",
        )
        .unwrap();
        // -f alone: no --name, no command needed on the command line.
        let a = submit_args(&["jobs", "submit", "-f", "j.yaml"]);
        let spec = a.spec_with(file.clone()).unwrap();
        assert_eq!(spec.name, "from-file");
        assert_eq!(spec.command, ["sh", "-c", "echo $A"]);
        assert_eq!(spec.image, "busybox");
        assert_eq!(
            spec.resources,
            Some(pb::Resources {
                cpus: 0.5,
                mem_mib: 64,
                gpus: 2,
                ports: 0,
            })
        );
        assert_eq!(spec.env["A"], "1");
        assert_eq!(spec.env["S"], "s3cret");
        assert_eq!(spec.secret_env, ["S"]);
        assert_eq!((spec.priority, spec.replicas, spec.max_retries), (5, 2, 3));
        assert!(spec.no_fence && !spec.no_requeue);
        let p = spec.placement.unwrap();
        assert_eq!(
            (p.policy.as_str(), p.constraints["k"].as_str()),
            ("spread", "v")
        );
        assert_eq!(spec.require_cuda, "cuda>=12.0");
        assert!(spec.security.unwrap().mounts[0].read_write);

        // Flags win; maps merge key by key; a command after -- replaces it.
        let a = submit_args(&[
            "jobs",
            "submit",
            "-f",
            "j.yaml",
            "--gpus",
            "1",
            "--env",
            "B=x",
            "--name",
            "n",
            "--priority",
            "-1",
            "--",
            "true",
        ]);
        let spec = a.spec_with(file.clone()).unwrap();
        assert_eq!(spec.name, "n");
        assert_eq!(spec.resources.unwrap().gpus, 1);
        assert_eq!(spec.resources.unwrap().cpus, 0.5, "the file's value stays");
        assert_eq!((spec.env["A"].as_str(), spec.env["B"].as_str()), ("1", "x"));
        assert_eq!(spec.priority, -1);
        assert_eq!(spec.command, ["true"]);

        // The placeholder of `jobs get -o yaml` is refused unless replaced.
        let hidden =
            jobfile::parse("j", "name: x\ncommand: [x]\nsecret_env: {S: <secret>}\n").unwrap();
        let a = submit_args(&["jobs", "submit", "-f", "j"]);
        let err = a.spec_with(hidden.clone()).unwrap_err();
        assert_eq!(err.exit_code(), EXIT_USAGE);
        assert!(err.to_string().contains("--secret-env S=VALUE"), "{err}");
        let a = submit_args(&["jobs", "submit", "-f", "j", "--secret-env", "S=v"]);
        assert_eq!(a.spec_with(hidden).unwrap().env["S"], "v");

        // A file without a name or command, and no flags for them.
        let a = submit_args(&["jobs", "submit", "-f", "j"]);
        let err = a.spec_with(JobFile::default()).unwrap_err();
        assert!(err.to_string().contains("--name"), "{err}");
        let named = jobfile::parse("j", "name: x\n").unwrap();
        let err = a.spec_with(named).unwrap_err();
        assert!(err.to_string().contains("no command"), "{err}");
    }

    #[test]
    fn job_file_read_errors_are_usage_errors_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job.yaml");
        std::fs::write(&path, "name: x\ncommand: [true]\ngpu: 1\n").unwrap();
        let p = path.to_str().unwrap();
        let err = submit_args(&["jobs", "submit", "-f", p])
            .submission()
            .unwrap_err();
        assert_eq!(err.exit_code(), EXIT_USAGE);
        let text = err.to_string();
        assert!(
            text.contains(p) && text.contains("`gpu`") && text.contains("line 3"),
            "{text}"
        );
        let missing = dir.path().join("nope.yaml");
        let m = missing.to_str().unwrap();
        let err = submit_args(&["jobs", "submit", "-f", m])
            .submission()
            .unwrap_err();
        assert!(err.to_string().contains("cannot read job file"), "{err}");
        std::fs::write(
            &path,
            "name: x\ncommand: [true]\nsecret_env: {S: <secret>}\n",
        )
        .unwrap();
        let err = submit_args(&["jobs", "submit", "-f", p])
            .submission()
            .unwrap_err();
        assert!(
            err.to_string()
                .starts_with(&format!("job file {p}: secret_env S")),
            "{err}"
        );
    }

    #[test]
    fn a_request_id_comes_from_the_flag_over_the_job_file_and_is_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job.yaml");
        std::fs::write(&path, "name: x\ncommand: [true]\nrequest_id: from-file\n").unwrap();
        let p = path.to_str().unwrap();
        let (_, key) = submit_args(&["jobs", "submit", "-f", p])
            .submission()
            .unwrap();
        assert_eq!(key.as_deref(), Some("from-file"));
        let (_, key) = submit_args(&["jobs", "submit", "-f", p, "--request-id", "flag"])
            .submission()
            .unwrap();
        assert_eq!(key.as_deref(), Some("flag"));
        let (_, key) = submit_args(&["jobs", "submit", "--name", "x", "--", "true"])
            .submission()
            .unwrap();
        assert_eq!(key, None, "none given: submit makes one");
        // The master's rules, as a usage error naming the flag or the key.
        for bad in ["", "-x", ".x", "a b", "ä", &"k".repeat(129)] {
            let flag = format!("--request-id={bad}");
            let err = parse(&["jobs", "submit", "--name", "x", &flag, "--", "true"]).unwrap_err();
            assert_eq!(err.exit_code(), i32::from(EXIT_USAGE), "{bad:?}");
            assert!(err.to_string().contains("--request-id"), "{err}");
        }
        std::fs::write(&path, "name: x\ncommand: [true]\nrequest_id: \"a b\"\n").unwrap();
        let err = submit_args(&["jobs", "submit", "-f", p])
            .submission()
            .unwrap_err();
        assert_eq!(err.exit_code(), EXIT_USAGE);
        assert!(
            err.to_string().contains("request_id") && err.to_string().contains("line 3"),
            "{err}"
        );
    }

    #[test]
    fn get_takes_a_job_id_or_a_request_id() {
        match parse(&["jobs", "get", "--request-id", "k1"])
            .unwrap()
            .command
        {
            Command::Jobs(JobsCommand::Get { id, request_id, .. }) => {
                assert_eq!((id, request_id.as_deref()), (None, Some("k1")));
            }
            other => panic!("parsed as {other:?}"),
        }
        for bad in [
            &["jobs", "get", "job-1", "--request-id", "k1"][..],
            &["jobs", "get"][..],
            &["jobs", "get", "--request-id", "a b"][..],
        ] {
            let err = parse(bad).unwrap_err();
            assert_eq!(err.exit_code(), i32::from(EXIT_USAGE), "{bad:?}");
        }
    }

    #[test]
    fn get_output_formats() {
        let get = |args: &[&str]| match parse(args).unwrap().command {
            Command::Jobs(JobsCommand::Get { json, output, .. }) => (json, output),
            other => panic!("parsed as {other:?}"),
        };
        assert_eq!(
            get(&["jobs", "get", "j", "-o", "yaml"]),
            (false, Some(GetFormat::Yaml))
        );
        assert_eq!(
            get(&["jobs", "get", "j", "--output", "json"]),
            (false, Some(GetFormat::Json))
        );
        assert_eq!(get(&["jobs", "get", "j", "--json"]), (true, None));
        assert!(parse(&["jobs", "get", "j", "--json", "-o", "yaml"]).is_err());
        assert!(parse(&["jobs", "get", "j", "-o", "xml"]).is_err());
    }

    #[test]
    fn wait_exit_codes() {
        assert_eq!(wait_exit_code(pb::JobState::JobSucceeded as i32), 0);
        assert_eq!(wait_exit_code(pb::JobState::JobFailed as i32), 1);
        assert_eq!(wait_exit_code(pb::JobState::JobCancelled as i32), 1);
        assert!(is_terminal(pb::JobState::JobCancelled as i32));
        assert!(!is_terminal(pb::JobState::JobRunning as i32));
        assert!(!is_terminal(pb::JobState::JobQueued as i32));
        assert!(!is_terminal(0));
    }

    // ------------------------------------------------ against a fake master

    /// An Operator that serves canned jobs: `GetJob` walks through `states`
    /// one step per call and then stays on the last one.
    #[derive(Default)]
    struct Fake {
        states: Mutex<HashMap<String, Vec<pb::JobState>>>,
        submitted: Mutex<Vec<pb::JobSpec>>,
    }

    fn job(id: &str, state: pb::JobState) -> pb::Job {
        // A queued job waits for resources, as the master says it.
        let wait_reason = (state == pb::JobState::JobQueued).then(|| pb::WaitReason {
            kind: Some(pb::wait_reason::Kind::Resources(Default::default())),
            requeued: None,
        });
        pb::Job {
            id: id.into(),
            spec: Some(pb::JobSpec {
                placement: None,
                name: format!("name-{id}"),
                ..Default::default()
            }),
            state: state as i32,
            wait_reason,
            ..Default::default()
        }
    }

    impl FakeOperator for Fake {
        fn submit_job(
            &self,
            r: pb::SubmitJobRequest,
        ) -> Result<pb::SubmitJobResponse, tonic::Status> {
            let spec = r.spec.unwrap_or_default();
            if spec.name.is_empty() {
                return Err(tonic::Status::invalid_argument(
                    "invalid spec.name: must not be empty",
                ));
            }
            self.submitted.lock().unwrap().push(spec);
            Ok(pb::SubmitJobResponse {
                job_id: "job-1".into(),
            })
        }
        fn get_job(&self, r: pb::GetJobRequest) -> Result<pb::Job, tonic::Status> {
            let id = r.job_id;
            let mut states = self.states.lock().unwrap();
            let Some(seq) = states.get_mut(&id) else {
                return Err(tonic::Status::not_found(format!("job {id} not found")));
            };
            let s = if seq.len() > 1 { seq.remove(0) } else { seq[0] };
            Ok(job(&id, s))
        }
        fn list_jobs(&self, _: pb::ListJobsRequest) -> Result<pb::ListJobsResponse, tonic::Status> {
            Ok(pb::ListJobsResponse {
                jobs: vec![job("b", pb::JobState::JobQueued)],
                next_page_token: String::new(),
            })
        }
        fn cancel_job(
            &self,
            _: pb::CancelJobRequest,
        ) -> Result<pb::CancelJobResponse, tonic::Status> {
            Ok(pb::CancelJobResponse {
                state: pb::JobState::JobCancelled as i32,
            })
        }
        fn job_logs(
            &self,
            _: pb::JobLogsRequest,
        ) -> Result<Vec<Result<pb::LogChunk, tonic::Status>>, tonic::Status> {
            Ok(chunks(&["hello ", "world\n", "bye\n"]))
        }
    }

    /// A master at the second address; nobody listens at the first.
    async fn connect(fake: Arc<Fake>) -> Master {
        connect_to(fake).await
    }

    async fn connect_to<F: FakeOperator>(fake: Arc<F>) -> Master {
        let live = serve(fake).await;
        let m = Master::connect(&[dead_addr(), live.clone()]).await.unwrap();
        assert_eq!(m.addr(), live);
        m
    }

    fn fake_with(id: &str, states: Vec<pb::JobState>) -> Arc<Fake> {
        let fake = Arc::new(Fake::default());
        fake.states.lock().unwrap().insert(id.into(), states);
        fake
    }

    async fn run_cmd(m: &mut Master, args: &[&str]) -> (Result<u8, CliError>, String) {
        let Command::Jobs(cmd) = parse(args).unwrap().command else {
            panic!("not a jobs command")
        };
        let mut out = Vec::new();
        let r = run(m, cmd, &mut out).await;
        (r, String::from_utf8(out).unwrap())
    }

    /// A master with WatchJob: it streams each change; `get_job` is never
    /// called (the fake refuses it).
    struct Watcher {
        items: Vec<Result<pb::Job, tonic::Status>>,
        opened: Mutex<u32>,
    }

    impl FakeOperator for Watcher {
        fn watch_job(
            &self,
            r: pb::GetJobRequest,
        ) -> Result<Vec<Result<pb::Job, tonic::Status>>, tonic::Status> {
            assert_eq!(r.job_id, "j");
            *self.opened.lock().unwrap() += 1;
            Ok(self.items.clone())
        }
    }

    #[tokio::test]
    async fn wait_follows_the_watch_stream_without_polling() {
        use pb::JobState::*;
        let fake = Arc::new(Watcher {
            items: [JobQueued, JobRunning, JobFailed]
                .into_iter()
                .map(|s| Ok(job("j", s)))
                .collect(),
            opened: Mutex::new(0),
        });
        let addr = serve(fake.clone()).await;
        let mut m = Master::connect(&[addr]).await.unwrap();
        let (r, out) = run_cmd(&mut m, &["jobs", "wait", "j"]).await;
        assert_eq!(r.unwrap(), 1, "FAILED exits 1");
        assert_eq!(out, "FAILED\n");
        assert_eq!(*fake.opened.lock().unwrap(), 1);
    }

    #[tokio::test]
    async fn a_watch_that_keeps_ending_early_is_opened_again_then_given_up() {
        let fake = Arc::new(Watcher {
            items: vec![Ok(job("j", pb::JobState::JobQueued))],
            opened: Mutex::new(0),
        });
        let addr = serve(fake.clone()).await;
        let mut m = Master::connect(&[addr]).await.unwrap();
        let (r, _) = run_cmd(&mut m, &["jobs", "wait", "j"]).await;
        assert!(r.is_err());
        assert_eq!(*fake.opened.lock().unwrap(), MAX_FRUITLESS_STREAMS);
    }

    #[tokio::test]
    async fn a_watch_stops_at_the_timeout_saying_why_the_job_waits() {
        // One item, then the stream stays open with nothing new.
        struct Quiet;
        impl FakeOperator for Quiet {
            fn watch_job(
                &self,
                _: pb::GetJobRequest,
            ) -> Result<Vec<Result<pb::Job, tonic::Status>>, tonic::Status> {
                Ok(vec![Ok(job("j", pb::JobState::JobQueued))])
            }
            fn watch_stays_open(&self) -> bool {
                true
            }
        }
        let addr = serve(Arc::new(Quiet)).await;
        let mut m = Master::connect(&[addr]).await.unwrap();
        let (r, _) = run_cmd(&mut m, &["jobs", "wait", "j", "--timeout", "1"]).await;
        let err = r.unwrap_err();
        assert_eq!(err.exit_code(), EXIT_TIMEOUT, "{err}");
        assert!(err.to_string().contains("still QUEUED"), "{err}");
    }

    #[tokio::test]
    async fn wait_until_succeeded() {
        use pb::JobState::*;
        let fake = fake_with("j", vec![JobQueued, JobRunning, JobSucceeded]);
        let mut m = connect(fake).await;
        let (r, out) = run_cmd(&mut m, &["jobs", "wait", "j"]).await;
        assert_eq!(r.unwrap(), EXIT_OK);
        assert_eq!(out, "SUCCEEDED\n");
    }

    #[tokio::test]
    async fn wait_failed_and_cancelled_exit_1() {
        use pb::JobState::*;
        for (state, word) in [(JobFailed, "FAILED\n"), (JobCancelled, "CANCELLED\n")] {
            let mut m = connect(fake_with("j", vec![JobRunning, state])).await;
            let (r, out) = run_cmd(&mut m, &["jobs", "wait", "j"]).await;
            assert_eq!(r.unwrap(), EXIT_FAILURE);
            assert_eq!(out, word);
        }
    }

    #[tokio::test]
    async fn wait_times_out_with_exit_2() {
        let mut m = connect(fake_with("j", vec![pb::JobState::JobRunning])).await;
        let started = std::time::Instant::now();
        let (r, out) = run_cmd(&mut m, &["jobs", "wait", "j", "--timeout", "0.5"]).await;
        let err = r.unwrap_err();
        assert_eq!(err.exit_code(), EXIT_TIMEOUT);
        assert!(err.to_string().contains("timed out"), "{err}");
        assert!(err.to_string().contains("RUNNING"), "{err}");
        assert_eq!(out, "");
        assert!(started.elapsed() < Duration::from_secs(3));
    }

    #[tokio::test]
    async fn wait_times_out_saying_why_a_queued_job_waits() {
        let mut m = connect(fake_with("j", vec![pb::JobState::JobQueued])).await;
        let (r, _) = run_cmd(&mut m, &["jobs", "wait", "j", "--timeout", "0.3"]).await;
        let err = r.unwrap_err();
        assert_eq!(err.exit_code(), EXIT_TIMEOUT);
        assert!(
            err.to_string()
                .contains("(still QUEUED: Resources: waiting for resources to be freed)"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn unknown_job_is_not_found() {
        let mut m = connect(Arc::new(Fake::default())).await;
        let (r, _) = run_cmd(&mut m, &["jobs", "get", "nope"]).await;
        let err = r.unwrap_err();
        assert_eq!(err.exit_code(), EXIT_NOT_FOUND);
        assert_eq!(err.to_string(), "job nope not found");
        let (r, _) = run_cmd(&mut m, &["jobs", "wait", "nope"]).await;
        assert_eq!(r.unwrap_err().exit_code(), EXIT_NOT_FOUND);
    }

    #[tokio::test]
    async fn submit_prints_only_the_id() {
        let fake = Arc::new(Fake::default());
        let mut m = connect(fake.clone()).await;
        let (r, out) = run_cmd(
            &mut m,
            &[
                "jobs", "submit", "--name", "x", "--gpus", "1", "--", "echo", "hi",
            ],
        )
        .await;
        assert_eq!(r.unwrap(), EXIT_OK);
        assert_eq!(out, "job-1\n");
        let sent = fake.submitted.lock().unwrap().clone();
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].command, vec!["echo", "hi"]);
        assert_eq!(sent[0].resources.map(|r| r.gpus), Some(1));
    }

    /// A master holding `n` jobs (`job-1`..`job-n`, named `even`/`odd`,
    /// every third one RUNNING, the rest QUEUED) that pages like the real
    /// one and records the requests.
    #[derive(Default)]
    struct Paged {
        jobs: Vec<pb::Job>,
        requests: Mutex<Vec<pb::ListJobsRequest>>,
    }

    impl Paged {
        fn new(n: u64) -> Arc<Paged> {
            let jobs = (1..=n)
                .map(|i| pb::Job {
                    id: format!("job-{i}"),
                    spec: Some(pb::JobSpec {
                        name: if i % 2 == 0 { "even" } else { "odd" }.into(),
                        ..Default::default()
                    }),
                    state: if i % 3 == 0 {
                        pb::JobState::JobRunning
                    } else {
                        pb::JobState::JobQueued
                    } as i32,
                    submitted_at_ms: 1000 + i,
                    ..Default::default()
                })
                .collect();
            Arc::new(Paged {
                jobs,
                requests: Mutex::new(Vec::new()),
            })
        }
        fn requests(&self) -> Vec<pb::ListJobsRequest> {
            self.requests.lock().unwrap().clone()
        }
    }

    impl FakeOperator for Paged {
        fn list_jobs(&self, r: pb::ListJobsRequest) -> Result<pb::ListJobsResponse, tonic::Status> {
            self.requests.lock().unwrap().push(r.clone());
            Ok(crate::commands::testkit::jobs_page(&self.jobs, &r))
        }
    }

    fn listed_ids(out: &str) -> Vec<String> {
        let v: serde_json::Value = serde_json::from_str(out).unwrap();
        v.as_array()
            .unwrap()
            .iter()
            .map(|j| j["id"].as_str().unwrap().to_string())
            .collect()
    }

    fn job_ids(range: impl Iterator<Item = u64>) -> Vec<String> {
        range.map(|i| format!("job-{i}")).collect()
    }

    #[tokio::test]
    async fn list_fetches_every_page_and_shows_oldest_first() {
        let fake = Paged::new(2345);
        let mut m = connect_to(fake.clone()).await;
        let (r, out) = run_cmd(&mut m, &["jobs", "list", "--json"]).await;
        r.unwrap();
        assert_eq!(listed_ids(&out), job_ids(1..=2345));
        let reqs = fake.requests();
        let tokens: Vec<&str> = reqs.iter().map(|r| r.page_token.as_str()).collect();
        assert_eq!(tokens, vec!["", "1346", "346"]);
        assert!(reqs.iter().all(|r| r.limit == 1000 && r.states.is_empty()));
        // The table too.
        let (r, out) = run_cmd(&mut m, &["jobs", "list"]).await;
        r.unwrap();
        assert_eq!(out.lines().count(), 2346, "a header and every job");
    }

    #[tokio::test]
    async fn list_limit_takes_the_newest_n() {
        let fake = Paged::new(2345);
        let mut m = connect_to(fake.clone()).await;
        let (r, out) = run_cmd(&mut m, &["jobs", "list", "--json", "--limit", "5"]).await;
        r.unwrap();
        assert_eq!(listed_ids(&out), job_ids(2341..=2345));
        assert_eq!(fake.requests().len(), 1);
        assert_eq!(fake.requests()[0].limit, 5);

        let fake = Paged::new(2345);
        let mut m = connect_to(fake.clone()).await;
        let (r, out) = run_cmd(&mut m, &["jobs", "list", "--json", "--limit", "1500"]).await;
        r.unwrap();
        assert_eq!(listed_ids(&out), job_ids(846..=2345));
        let limits: Vec<u32> = fake.requests().iter().map(|r| r.limit).collect();
        assert_eq!(limits, vec![1000, 500]);

        // More than there are: all of them.
        let fake = Paged::new(7);
        let mut m = connect_to(fake.clone()).await;
        let (r, out) = run_cmd(&mut m, &["jobs", "list", "--json", "--limit", "100"]).await;
        r.unwrap();
        assert_eq!(listed_ids(&out), job_ids(1..=7));
    }

    #[tokio::test]
    async fn list_filters_by_state_and_name() {
        let fake = Paged::new(30);
        let mut m = connect_to(fake.clone()).await;
        let (r, out) = run_cmd(&mut m, &["jobs", "list", "--json", "--state", "running"]).await;
        r.unwrap();
        assert_eq!(listed_ids(&out), job_ids((3..=30).step_by(3)));
        assert_eq!(
            fake.requests()[0].states,
            vec![pb::JobState::JobRunning as i32]
        );

        // Repeated and comma separated; with a name and a limit.
        let (r, out) = run_cmd(
            &mut m,
            &[
                "jobs",
                "list",
                "--json",
                "--state",
                "QUEUED,running",
                "--state",
                "Failed",
                "--name",
                "even",
                "--limit",
                "4",
            ],
        )
        .await;
        r.unwrap();
        assert_eq!(listed_ids(&out), job_ids([24, 26, 28, 30].into_iter()));
        let last = fake.requests().pop().unwrap();
        assert_eq!(
            last.states,
            vec![
                pb::JobState::JobQueued as i32,
                pb::JobState::JobRunning as i32,
                pb::JobState::JobFailed as i32
            ]
        );
        assert_eq!(last.name, "even");
    }

    /// A master from before paging: every job, oldest first, no token.
    struct Unpaged(Arc<Paged>);

    impl FakeOperator for Unpaged {
        fn list_jobs(&self, r: pb::ListJobsRequest) -> Result<pb::ListJobsResponse, tonic::Status> {
            self.0.requests.lock().unwrap().push(r);
            Ok(pb::ListJobsResponse {
                jobs: self.0.jobs.clone(),
                next_page_token: String::new(),
            })
        }
    }

    #[tokio::test]
    async fn list_works_with_a_master_before_paging() {
        let fake = Arc::new(Unpaged(Paged::new(10)));
        let mut m = connect_to(fake.clone()).await;
        let (r, out) = run_cmd(&mut m, &["jobs", "list", "--json"]).await;
        r.unwrap();
        assert_eq!(listed_ids(&out), job_ids(1..=10));
        let (r, out) = run_cmd(&mut m, &["jobs", "list", "--json", "--limit", "3"]).await;
        r.unwrap();
        assert_eq!(listed_ids(&out), job_ids(8..=10));
        assert_eq!(fake.0.requests().len(), 2);
    }

    #[test]
    fn list_flags_are_checked() {
        for bad in [
            vec!["jobs", "list", "--state", "DONE"],
            vec!["jobs", "list", "--limit", "0"],
            vec!["jobs", "list", "--limit", "-3"],
        ] {
            let err = parse(&bad).unwrap_err();
            assert_eq!(err.exit_code(), i32::from(EXIT_USAGE), "{bad:?}");
        }
        let err = parse(&["jobs", "list", "--state", "DONE"]).unwrap_err();
        assert!(err.to_string().contains("--state"), "{err}");
        assert_eq!(
            parse_job_state(" succeeded ").unwrap(),
            pb::JobState::JobSucceeded
        );
    }

    #[test]
    fn each_line_of_a_task_gets_its_prefix_across_chunks() {
        let mut out = Vec::new();
        let mut sink = |d: &[u8]| {
            out.extend_from_slice(d);
            Ok(())
        };
        let mut at = TaskOutput::default();
        write_task_output(&mut sink, Some("[rank 1] "), b"a\nb", &mut at).unwrap();
        assert!(at.mid_line);
        write_task_output(&mut sink, Some("[rank 1] "), b"c\nd\n", &mut at).unwrap();
        assert!(!at.mid_line);
        write_task_output(&mut sink, None, b"raw", &mut at).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "[rank 1] a\n[rank 1] bc\n[rank 1] d\nraw"
        );
    }

    #[tokio::test]
    async fn logs_cancel_list_get() {
        let fake = fake_with("j", vec![pb::JobState::JobRunning]);
        let mut m = connect(fake).await;
        let (r, out) = run_cmd(&mut m, &["jobs", "logs", "j", "--follow"]).await;
        r.unwrap();
        assert_eq!(out, "hello world\nbye\n");
        let (r, out) = run_cmd(&mut m, &["jobs", "cancel", "j"]).await;
        r.unwrap();
        assert_eq!(out, "CANCELLED\n");
        let (r, out) = run_cmd(&mut m, &["jobs", "list", "--json"]).await;
        r.unwrap();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v[0]["id"], "b");
        assert_eq!(v[0]["state"], "QUEUED");
        let (r, out) = run_cmd(&mut m, &["jobs", "list"]).await;
        r.unwrap();
        assert!(out.starts_with("ID "), "{out}");
        assert!(out.contains("name-b"), "{out}");
        let (r, out) = run_cmd(&mut m, &["jobs", "get", "j", "--json"]).await;
        r.unwrap();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["state"], "RUNNING");
        let (r, out) = run_cmd(&mut m, &["jobs", "get", "j"]).await;
        r.unwrap();
        assert!(out.contains("State:     RUNNING"), "{out}");
    }
}
