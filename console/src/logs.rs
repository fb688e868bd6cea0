//! A job's output for the browser: the `JobLogs` stream relayed as
//! newline-delimited JSON (`{"text": ...}` pieces, then `{"end": true}` or
//! `{"error": ...}`), read by the page with `fetch` (an `EventSource` could
//! not send the token).
//!
//! As `gpuctl jobs logs` does (cli/src/commands/jobs.rs, `stream_logs`):
//! with several tasks (a gang) each line gets its rank's prefix, a line
//! left open by one rank is ended before another rank's; a stream broken by
//! a master failover is opened again at the leader and what was already
//! sent of each task is skipped; with `follow`, a stream that ends while the
//! job's tasks still run (a master lost its leadership) is opened again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use gpuctl_proto::leader::may_retry;
use gpuctl_proto::pb;
use serde_json::json;
use tokio::sync::mpsc;

use super::client::{operator, CallError, Gateway, Token, RPC_TIMEOUT};

/// Streams opened in a row that brought nothing new before giving up.
const MAX_FRUITLESS_STREAMS: u32 = 5;
/// Pause before opening a stream again after one that brought nothing.
const REOPEN_PAUSE: Duration = Duration::from_millis(500);

pub use gpuctl_core::logs::LogSelection;

#[derive(Debug, Default)]
struct TaskOutput {
    /// Bytes of it taken so far (sent, or held in `carry`).
    written: u64,
    /// Bytes of it the current stream has carried.
    seen: u64,
    /// Whether the last byte sent left a line open.
    mid_line: bool,
    /// The start of a UTF-8 character whose rest is in the next chunk.
    carry: Vec<u8>,
}

/// Turns chunks of several tasks' output into text for the page. Pure.
#[derive(Debug, Default)]
pub struct Relay {
    tasks: BTreeMap<String, TaskOutput>,
    /// The task sent last, when it left a line open.
    open_line: Option<String>,
}

impl Relay {
    /// A new stream starts: each task's output comes from its first byte
    /// again.
    pub fn restart(&mut self) {
        for t in self.tasks.values_mut() {
            t.seen = 0;
        }
    }

    /// Bytes taken of all tasks.
    pub fn total(&self) -> u64 {
        self.tasks.values().map(|t| t.written).sum()
    }

    /// The text to show for one chunk (empty when it was all sent before).
    pub fn chunk(&mut self, task_id: &str, rank: u32, tasks: u32, data: &[u8]) -> String {
        let at = self.tasks.entry(task_id.to_string()).or_default();
        let skip = at.written.saturating_sub(at.seen).min(data.len() as u64) as usize;
        at.seen += data.len() as u64;
        let fresh = &data[skip..];
        if fresh.is_empty() {
            return String::new();
        }
        at.written += fresh.len() as u64;
        let mut bytes = std::mem::take(&mut at.carry);
        bytes.extend_from_slice(fresh);
        let text = match std::str::from_utf8(&bytes) {
            Ok(t) => t.to_string(),
            // Incomplete at the end: keep the tail for the next chunk.
            Err(e) if e.error_len().is_none() => {
                let (done, tail) = bytes.split_at(e.valid_up_to());
                at.carry = tail.to_vec();
                String::from_utf8_lossy(done).into_owned()
            }
            Err(_) => String::from_utf8_lossy(&bytes).into_owned(),
        };
        if text.is_empty() {
            return text;
        }
        let mut out = String::new();
        let prefix = (tasks > 1).then(|| format!("[rank {rank}] "));
        if let Some(other) = self.open_line.take().filter(|o| o != task_id) {
            out.push('\n');
            if let Some(o) = self.tasks.get_mut(&other) {
                o.mid_line = false;
            }
        }
        let Some(at) = self.tasks.get_mut(task_id) else {
            return out;
        };
        match &prefix {
            None => out.push_str(&text),
            Some(p) => {
                for piece in text.split_inclusive('\n') {
                    if !at.mid_line {
                        out.push_str(p);
                    }
                    out.push_str(piece);
                    at.mid_line = !piece.ends_with('\n');
                }
                if at.mid_line {
                    self.open_line = Some(task_id.to_string());
                }
            }
        }
        out
    }
}

fn line(v: serde_json::Value) -> Bytes {
    let mut s = v.to_string();
    s.push('\n');
    Bytes::from(s)
}

/// Opens the job's log stream at the leader.
pub async fn open(
    gateway: &Gateway,
    token: &Token,
    job_id: &str,
    which: LogSelection,
) -> Result<tonic::Streaming<pb::LogChunk>, CallError> {
    // With follow the master answers once the job is placed: no limit.
    let attempt = (!which.follow).then_some(RPC_TIMEOUT);
    gateway
        .call(attempt, |channel| {
            let req = token.request(pb::JobLogsRequest {
                job_id: job_id.to_string(),
                follow: which.follow,
                rank: which.rank,
                attempt: which.attempt,
            });
            async move { operator(channel).job_logs(req).await }
        })
        .await
}

/// Whether the tasks `which` selects have all ended (or the job has).
async fn selection_ended(
    gateway: &Gateway,
    token: &Token,
    job_id: &str,
    which: LogSelection,
) -> bool {
    let job = gateway
        .call(Some(RPC_TIMEOUT), |channel| {
            let req = token.request(pb::GetJobRequest {
                job_id: job_id.to_string(),
                ..Default::default()
            });
            async move { operator(channel).get_job(req).await }
        })
        .await;
    match job {
        Ok(job) => super::json::job_is_terminal(job.state) || which.ended(&job.tasks),
        // The job is gone or may not be read any more: nothing to follow.
        Err(e) => !may_retry(&e.status),
    }
}

/// Relays `first` (and the streams opened after it breaks) to `out` until
/// the output ends, an error that no other master would mend, or the
/// browser goes (`out` closed).
pub async fn relay(
    gateway: Arc<Gateway>,
    token: Token,
    job_id: String,
    which: LogSelection,
    first: tonic::Streaming<pb::LogChunk>,
    out: mpsc::Sender<Bytes>,
) {
    let mut relay = Relay::default();
    let mut stream = first;
    let mut fruitless = 0;
    let last = loop {
        relay.restart();
        let before = relay.total();
        let broken = loop {
            let next = tokio::select! {
                m = stream.message() => m,
                _ = out.closed() => return,
            };
            match next {
                Ok(Some(c)) => {
                    let text = relay.chunk(&c.task_id, c.rank, c.tasks, &c.data);
                    if !text.is_empty() && out.send(line(json!({ "text": text }))).await.is_err() {
                        return;
                    }
                }
                Ok(None) => break None,
                Err(s) => break Some(s),
            }
        };
        fruitless = if relay.total() > before {
            0
        } else {
            fruitless + 1
        };
        match broken {
            Some(s) if !may_retry(&s) => break json!({ "error": s.message() }),
            Some(s) if fruitless >= MAX_FRUITLESS_STREAMS => break json!({ "error": s.message() }),
            Some(s) => {
                tracing::debug!(job_id, error = %s.message(), "console: log stream broke; opening it again")
            }
            None if !which.follow => break json!({ "end": true }),
            None => {
                if fruitless >= MAX_FRUITLESS_STREAMS
                    || selection_ended(&gateway, &token, &job_id, which).await
                {
                    break json!({ "end": true });
                }
            }
        }
        if fruitless > 0 {
            tokio::select! {
                _ = tokio::time::sleep(REOPEN_PAUSE) => {}
                _ = out.closed() => return,
            }
        }
        stream = tokio::select! {
            s = open(&gateway, &token, &job_id, which) => match s {
                Ok(s) => s,
                Err(e) => break json!({ "error": e.status.message() }),
            },
            _ = out.closed() => return,
        };
    };
    let _ = out.send(line(last)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_task_passes_through_unprefixed() {
        let mut r = Relay::default();
        assert_eq!(r.chunk("t0", 0, 1, b"hello\nwor"), "hello\nwor");
        assert_eq!(r.chunk("t0", 0, 1, b"ld\n"), "ld\n");
        assert_eq!(r.total(), 12);
    }

    #[test]
    fn each_line_of_a_gang_gets_its_rank_and_open_lines_are_ended() {
        let mut r = Relay::default();
        assert_eq!(r.chunk("a", 0, 2, b"one\ntw"), "[rank 0] one\n[rank 0] tw");
        // Rank 1 speaks while rank 0's line is open: it is ended first.
        assert_eq!(r.chunk("b", 1, 2, b"x\n"), "\n[rank 1] x\n");
        // Rank 0's rest comes with its prefix again.
        assert_eq!(r.chunk("a", 0, 2, b"o\n"), "[rank 0] o\n");
    }

    #[test]
    fn a_new_stream_skips_what_was_sent_of_each_task() {
        let mut r = Relay::default();
        r.chunk("a", 0, 2, b"1\n2\n");
        r.chunk("b", 1, 2, b"x\n");
        r.restart();
        // The new stream starts each task from its first byte.
        assert_eq!(r.chunk("b", 1, 2, b"x\ny\n"), "[rank 1] y\n");
        assert_eq!(r.chunk("a", 0, 2, b"1\n"), "");
        assert_eq!(r.chunk("a", 0, 2, b"2\n3\n"), "[rank 0] 3\n");
    }

    #[test]
    fn a_character_split_between_chunks_is_kept_whole() {
        let mut r = Relay::default();
        let text = "é\n".as_bytes();
        assert_eq!(r.chunk("t", 0, 1, &text[..1]), "");
        assert_eq!(r.chunk("t", 0, 1, &text[1..]), "é\n");
        // Bytes that are not UTF-8 at all are shown replaced.
        assert_eq!(r.chunk("t", 0, 1, b"\xff\n"), "\u{fffd}\n");
    }
}
