//! A running task's health checks (`--readiness`, `--liveness`), run here
//! beside it so that they go on through a master failover: readiness is
//! reported to the master when it changes (a status update with `health`),
//! and a liveness check that fails `failures` times in a row stops the
//! task (FAILED, reason LIVENESS_FAILED).
//!
//! The counting is pure ([`Counter`]); [`Executor::follow_checks`] runs the
//! probes on their intervals.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuctl_core::types::{Check, Probe, TaskHealth, TaskSpec, TaskState};
use tokio::io::AsyncWriteExt;

use super::plan::StopReason;
use super::Executor;
use crate::runtime::{ContainerRuntime, TaskRef};

/// A failure's words are sent at most this often while they change (a
/// flapping check must not write the master's log at its interval).
const FAILURE_REPORT_EVERY: Duration = Duration::from_secs(30);
/// And any report at most this often per task: a check that flaps at 10
/// Hz costs the master one entry a second, the latest verdict.
const REPORT_GAP: Duration = Duration::from_secs(1);
/// What is kept of a failure's words.
const MAX_WORDS: usize = 300;

/// Which check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Readiness,
    Liveness,
}

impl Kind {
    fn word(self) -> &'static str {
        match self {
            Kind::Readiness => "readiness",
            Kind::Liveness => "liveness",
        }
    }
}

/// What one result changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Nothing to tell.
    Same,
    /// A readiness check passed `successes` times in a row.
    Ready,
    /// It failed `failures` times in a row past its start period: a
    /// readiness check's task is not ready; a liveness check's is stopped.
    Failed,
}

/// One check's count of passes and failures in a row.
#[derive(Debug)]
pub(super) struct Counter {
    kind: Kind,
    successes: u32,
    failures: u32,
    start_period: Duration,
    /// Failures count once a check passed or the start period is over.
    started: bool,
    passes_in_row: u32,
    failures_in_row: u32,
    /// A readiness check's verdict so far (`None`: none yet).
    ready: Option<bool>,
}

impl Counter {
    /// `resumed`: an agent that came back to a running task; its start
    /// period is long over.
    pub(super) fn new(kind: Kind, check: &Check, resumed: bool) -> Counter {
        Counter {
            kind,
            successes: check.successes,
            failures: check.failures,
            start_period: Duration::from_millis(check.start_period_ms),
            started: resumed || check.start_period_ms == 0,
            passes_in_row: 0,
            failures_in_row: 0,
            ready: None,
        }
    }

    /// One result, `since_start` after the task started.
    pub(super) fn record(&mut self, passed: bool, since_start: Duration) -> Verdict {
        if since_start >= self.start_period {
            self.started = true;
        }
        if passed {
            self.started = true;
            self.failures_in_row = 0;
            self.passes_in_row = self.passes_in_row.saturating_add(1);
            let enough = self.passes_in_row >= self.successes || self.ready.is_none();
            if self.kind == Kind::Readiness && self.ready != Some(true) && enough {
                self.ready = Some(true);
                return Verdict::Ready;
            }
            return Verdict::Same;
        }
        self.passes_in_row = 0;
        if !self.started {
            return Verdict::Same;
        }
        self.failures_in_row = self.failures_in_row.saturating_add(1);
        if self.failures_in_row < self.failures {
            return Verdict::Same;
        }
        match self.kind {
            Kind::Liveness => Verdict::Failed,
            Kind::Readiness if self.ready != Some(false) => {
                self.ready = Some(false);
                Verdict::Failed
            }
            Kind::Readiness => Verdict::Same,
        }
    }

    /// Whether a failure now is worth telling (past the start period).
    pub(super) fn counts(&self) -> bool {
        self.started
    }
}

/// What the checks decided and what the master was last told, shared by
/// a task's two checks.
#[derive(Debug, Default)]
struct Told {
    /// The latest verdict.
    health: Option<TaskHealth>,
    /// The last one sent, and when.
    sent: Option<TaskHealth>,
    sent_at: Option<Instant>,
    failure_at: Option<Instant>,
}

/// Why one probe did not pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ProbeError {
    /// Why, in words.
    Failed(String),
    /// Not the task's answer: its runtime is down (dockerd restarting
    /// under a live-restore container). Not counted either way.
    Unknown(String),
}

impl From<String> for ProbeError {
    fn from(w: String) -> ProbeError {
        ProbeError::Failed(w)
    }
}

/// One probe, up to its timeout.
pub(super) async fn probe(
    rt: &dyn ContainerRuntime,
    tref: &TaskRef,
    spec: &TaskSpec,
    check: &Check,
) -> Result<(), ProbeError> {
    let timeout = Duration::from_millis(check.timeout_ms);
    let port = |name: &str| -> Result<u16, ProbeError> {
        let key = format!(
            "GPUCTL_PORT_{}",
            name.to_ascii_uppercase().replace('-', "_")
        );
        spec.template
            .env
            .get(&key)
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| ProbeError::Failed(format!("the task has no port named {name}")))
    };
    let over = || {
        format!(
            "no answer in {}",
            gpuctl_core::types::ms_text(check.timeout_ms)
        )
    };
    match &check.probe {
        Probe::Tcp { port: name } => {
            let p = port(name)?;
            match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(("127.0.0.1", p)))
                .await
            {
                Ok(Ok(mut s)) => {
                    let _ = s.shutdown().await;
                    Ok(())
                }
                Ok(Err(e)) => Err(format!("TCP {name} (port {p}): {e}").into()),
                Err(_) => Err(format!("TCP {name} (port {p}): {}", over()).into()),
            }
        }
        Probe::Http { port: name, path } => {
            let p = port(name)?;
            match tokio::time::timeout(timeout, http_get(p, path)).await {
                Ok(Ok(status)) if (200..400).contains(&status) => Ok(()),
                Ok(Ok(status)) => Err(format!("GET {path} (port {p}): HTTP {status}").into()),
                Ok(Err(e)) => Err(format!("GET {path} (port {p}): {e}").into()),
                Err(_) => Err(format!("GET {path} (port {p}): {}", over()).into()),
            }
        }
        Probe::Exec { command } => match rt.exec(tref, command, timeout).await {
            Ok(out) if out.code == Some(0) => Ok(()),
            Ok(out) => {
                let said = one_line(&out.output);
                let how = match out.code {
                    Some(c) => format!("exited with code {c}"),
                    None => over(),
                };
                Err(ProbeError::Failed(if said.is_empty() {
                    format!("{command:?} {how}")
                } else {
                    format!("{command:?} {how}: {said}")
                }))
            }
            Err(e) if e.is_unavailable() => Err(ProbeError::Unknown(e.to_string())),
            Err(e) => Err(format!("{command:?}: {e}").into()),
        },
    }
}

/// `GET path` on 127.0.0.1:`port` over HTTP/1.1 (hyper's client): the
/// status code.
async fn http_get(port: u16, path: &str) -> Result<u16, String> {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    let conn = tokio::spawn(conn);
    let req = http::Request::get(path)
        .header(http::header::HOST, format!("127.0.0.1:{port}"))
        .header(http::header::USER_AGENT, "gpuctl-agent")
        .header(http::header::CONNECTION, "close")
        .body(String::new())
        .map_err(|e| e.to_string())?;
    let status = send
        .send_request(req)
        .await
        .map(|r| r.status().as_u16())
        .map_err(|e| e.to_string());
    conn.abort();
    status
}

fn one_line(s: &str) -> String {
    let s = s.split_whitespace().collect::<Vec<_>>().join(" ");
    gpuctl_core::convert::cut(&s, MAX_WORDS)
}

impl Executor {
    /// Runs the task's checks until it is stopped or ends (the caller
    /// aborts this); `resumed`: a task this agent process found running.
    pub(super) async fn follow_checks(
        self: Arc<Self>,
        spec: TaskSpec,
        rt: Arc<dyn ContainerRuntime>,
        tref: TaskRef,
        resumed: bool,
    ) {
        let opts = &spec.template.options;
        let told = Arc::new(Mutex::new(Told::default()));
        let has_readiness = opts.readiness.is_some();
        let one = |kind: Kind, check: &Option<Check>| {
            let check = check.clone();
            let (me, spec, rt, tref, told) = (
                self.clone(),
                spec.clone(),
                rt.clone(),
                tref.clone(),
                told.clone(),
            );
            async move {
                let Some(check) = check else { return };
                me.run_check(
                    kind,
                    &check,
                    &spec,
                    rt.as_ref(),
                    &tref,
                    &told,
                    has_readiness,
                    resumed,
                )
                .await;
            }
        };
        tokio::join!(
            one(Kind::Readiness, &opts.readiness),
            one(Kind::Liveness, &opts.liveness)
        );
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_check(
        &self,
        kind: Kind,
        check: &Check,
        spec: &TaskSpec,
        rt: &dyn ContainerRuntime,
        tref: &TaskRef,
        told: &Mutex<Told>,
        has_readiness: bool,
        resumed: bool,
    ) {
        let start = Instant::now();
        let interval = Duration::from_millis(check.interval_ms);
        let mut counter = Counter::new(kind, check, resumed);
        loop {
            let began = Instant::now();
            let (passed, words) = match probe(rt, tref, spec, check).await {
                Ok(()) => (true, None),
                Err(ProbeError::Failed(w)) => (false, Some(format!("{}: {w}", kind.word()))),
                Err(ProbeError::Unknown(w)) => {
                    tracing::debug!(task_id = %spec.task_id, reason = %w, "a check could not run");
                    tokio::time::sleep(interval.saturating_sub(began.elapsed())).await;
                    continue;
                }
            };
            let verdict = counter.record(passed, start.elapsed());
            match (&verdict, kind) {
                (Verdict::Failed, Kind::Liveness) => {
                    let why = format!(
                        "{} ({} in a row)",
                        words.clone().unwrap_or_default(),
                        check.failures
                    );
                    tracing::warn!(task_id = %spec.task_id, reason = %why, "stopping a task that failed its liveness check");
                    self.stop_task(&spec.task_id, StopReason::LivenessFailed(why));
                    return;
                }
                _ => {
                    let ready = match (&verdict, kind) {
                        (Verdict::Ready, _) => Some(true),
                        (Verdict::Failed, Kind::Readiness) => Some(false),
                        _ => None,
                    };
                    let words = words.filter(|_| counter.counts());
                    self.tell(spec, told, ready, words, has_readiness).await;
                }
            }
            tokio::time::sleep(interval.saturating_sub(began.elapsed())).await;
        }
    }

    /// Sends the task's health when readiness changed (at once, but at most
    /// every [`REPORT_GAP`]) or a new failure is to be told (at most every
    /// [`FAILURE_REPORT_EVERY`]).
    async fn tell(
        &self,
        spec: &TaskSpec,
        told: &Mutex<Told>,
        ready: Option<bool>,
        failure: Option<String>,
        has_readiness: bool,
    ) {
        let lock = || told.lock().unwrap_or_else(|p| p.into_inner());
        let wait = {
            let mut t = lock();
            let before = t.health.clone();
            let was_ready = before.as_ref().map(|h| h.ready);
            let mut next = before.clone().unwrap_or(TaskHealth {
                ready: !has_readiness,
                failure: String::new(),
            });
            if let Some(r) = ready {
                next.ready = r;
            }
            let readiness_changed = ready.is_some() && Some(next.ready) != was_ready;
            let mut failure_due = false;
            if let Some(f) = failure {
                if f != next.failure {
                    failure_due = t
                        .failure_at
                        .is_none_or(|at| at.elapsed() >= FAILURE_REPORT_EVERY);
                    if failure_due || readiness_changed {
                        next.failure = f;
                    }
                }
            }
            if !(readiness_changed || failure_due) || before.as_ref() == Some(&next) {
                return;
            }
            if next.failure != before.map(|b| b.failure).unwrap_or_default() {
                t.failure_at = Some(Instant::now());
            }
            t.health = Some(next);
            t.sent_at
                .map_or(Duration::ZERO, |at| REPORT_GAP.saturating_sub(at.elapsed()))
        };
        tokio::time::sleep(wait).await;
        // The latest verdict then, unless the other check sent it.
        let update = {
            let mut t = lock();
            if t.health == t.sent {
                return;
            }
            let health = t.health.clone();
            t.sent.clone_from(&health);
            t.sent_at = Some(Instant::now());
            let mut u = self.update(&spec.task_id, TaskState::Running);
            u.health = health;
            u
        };
        if !self.is_active(&spec.task_id) {
            return;
        }
        self.send(update).await;
    }

    /// Asks a running task to stop for `reason`, unless a stop is under way.
    fn stop_task(&self, task_id: &str, reason: StopReason) {
        let t = self.lock();
        if let Some(task) = t.tasks.get(task_id) {
            if task.stop.borrow().is_none() {
                task.stop.send_replace(Some(reason));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str) -> Check {
        text.parse().unwrap()
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn readiness_passes_at_once_and_fails_after_failures_in_a_row() {
        let mut c = Counter::new(Kind::Readiness, &check("tcp:p failures=2"), false);
        assert_eq!(c.record(false, S), Verdict::Same);
        assert_eq!(c.record(false, S), Verdict::Failed);
        assert_eq!(c.record(false, S), Verdict::Same, "said once");
        assert_eq!(c.record(true, S), Verdict::Ready);
        assert_eq!(c.record(true, S), Verdict::Same);
        assert_eq!(c.record(false, S), Verdict::Same);
        assert_eq!(
            c.record(true, S),
            Verdict::Same,
            "one failure is not enough"
        );
        assert_eq!(c.record(false, S), Verdict::Same);
        assert_eq!(c.record(false, S), Verdict::Failed);
    }

    #[test]
    fn a_failed_readiness_check_needs_successes_in_a_row_again() {
        let mut c = Counter::new(
            Kind::Readiness,
            &check("tcp:p failures=1 successes=3"),
            false,
        );
        // The first pass makes a new task ready (nothing to recover from).
        assert_eq!(c.record(true, S), Verdict::Ready);
        assert_eq!(c.record(false, S), Verdict::Failed);
        assert_eq!(c.record(true, S), Verdict::Same);
        assert_eq!(c.record(true, S), Verdict::Same);
        // Not ready already: no news.
        assert_eq!(c.record(false, S), Verdict::Same);
        assert_eq!(c.record(true, S), Verdict::Same);
        assert_eq!(c.record(true, S), Verdict::Same);
        assert_eq!(c.record(true, S), Verdict::Ready);
    }

    #[test]
    fn the_start_period_holds_failures_until_it_ends_or_a_check_passes() {
        let chk = check("tcp:p failures=1 start=60s");
        let mut live = Counter::new(Kind::Liveness, &chk, false);
        assert_eq!(live.record(false, S), Verdict::Same);
        assert!(!live.counts());
        assert_eq!(live.record(false, 59 * S), Verdict::Same);
        assert_eq!(live.record(false, 60 * S), Verdict::Failed);
        // A pass ends the start period early.
        let mut live = Counter::new(Kind::Liveness, &chk, false);
        assert_eq!(live.record(true, S), Verdict::Same);
        assert_eq!(live.record(false, 2 * S), Verdict::Failed);
        // An agent back at a running task: it is long started.
        let mut live = Counter::new(Kind::Liveness, &chk, true);
        assert_eq!(live.record(false, S), Verdict::Failed);
    }

    #[tokio::test]
    async fn probes_pass_on_a_real_server_and_fail_in_words() {
        use tokio::io::AsyncReadExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    let req = String::from_utf8_lossy(&buf[..n]).to_string();
                    let status = if req.starts_with("GET /ok ") {
                        "200 OK"
                    } else if req.starts_with("GET /slow ") {
                        tokio::time::sleep(Duration::from_secs(5)).await;
                        "200 OK"
                    } else {
                        "503 Service Unavailable"
                    };
                    let _ = s
                        .write_all(
                            format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n").as_bytes(),
                        )
                        .await;
                });
            }
        });
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut spec: TaskSpec = serde_json::from_value(serde_json::json!({
            "task_id": "t", "job_id": "j", "gpu_uuids": [],
            "command": ["x"], "env": {}, "resources": {"cpus": 0.0, "mem_mib": 0, "gpus": 0, "ports": 0},
        }))
        .unwrap();
        spec.template
            .env
            .insert("GPUCTL_PORT_HTTP".into(), port.to_string());
        spec.template
            .env
            .insert("GPUCTL_PORT_SHUT".into(), closed.to_string());
        let rt = crate::runtime::ProcessRuntime::new("/nonexistent".into());
        let tref = TaskRef {
            task_id: "t".into(),
            agent_id: "a".into(),
            state_dir: "/nonexistent".into(),
            log_path: "/nonexistent".into(),
        };
        let run = |c: &str| {
            let c = check(c);
            let (rt, tref, spec) = (rt.clone(), tref.clone(), spec.clone());
            async move { probe(&rt, &tref, &spec, &c).await }
        };
        let failed = |p: Result<(), ProbeError>| match p {
            Err(ProbeError::Failed(w)) => w,
            other => panic!("{other:?}"),
        };
        assert_eq!(run("http:http/ok").await, Ok(()));
        assert_eq!(run("tcp:http").await, Ok(()));
        let e = failed(run("http:http/down").await);
        assert_eq!(e, format!("GET /down (port {port}): HTTP 503"));
        let e = failed(run("http:http/slow timeout=200ms").await);
        assert!(e.ends_with("no answer in 200ms"), "{e}");
        let e = failed(run("tcp:shut").await);
        assert!(e.contains("refused"), "{e}");
        let e = failed(run("http:nope").await);
        assert_eq!(e, "the task has no port named nope");
        // A host task's command needs its launch record.
        let e = failed(run("exec:true").await);
        assert!(e.contains("\"true\""), "{e}");
    }
}
