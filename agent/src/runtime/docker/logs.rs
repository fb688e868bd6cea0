//! A container's logs pumped into the task's log file, resumed after a
//! restart from a saved cursor (Docker's timestamps read without a date
//! library).

use std::path::Path;

use bollard::container::{LogOutput, LogsOptions};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use tokio::task::JoinHandle;

use crate::runtime::{RuntimeError, TaskRef};

use super::*;

/// Aborts the task when dropped.
pub(super) struct AbortOnDrop(pub(super) JoinHandle<Result<(), RuntimeError>>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
/// How far a container's output has been copied to the task's log, as a
/// position in Docker's answer to `logs --since SINCE`: the first `skip`
/// lines of that answer were copied. Docker answers in the order lines were
/// written, and that order is not the timestamps' order: stdout and stderr
/// are stamped by two copiers before they take the log file's lock, so a
/// later-stamped stderr line can be written before an earlier stdout one. A
/// cursor of "the last timestamp copied" would drop such a line; a count in
/// the answer's own order does not.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogCursor {
    /// The container whose output this is: a task relaunched under the same
    /// name gets a new container, and its copy starts afresh.
    #[serde(default)]
    pub container: String,
    /// Whole seconds since the epoch, for Docker's `since`.
    #[serde(default)]
    pub since: i64,
    #[serde(default)]
    pub skip: u64,
}
/// How far the cursor's `since` stays behind the newest line seen: a line
/// stamped more than this before a line written ahead of it would be missed
/// by a copy resumed after a crash (never by an uninterrupted one).
pub(super) const CURSOR_SLACK_S: i64 = 2;
/// Follows one answer to `logs --since`, line by line, and says which
/// lines are new and where a resumed copy should start.
#[derive(Debug)]
pub struct LogProgress {
    start: LogCursor,
    /// Lines of the answer seen so far.
    read: u64,
    /// Lines seen per second, for the seconds a later cursor may start at.
    per_sec: std::collections::BTreeMap<i64, u64>,
    newest: i64,
}
impl LogProgress {
    pub fn new(start: LogCursor) -> Self {
        LogProgress {
            newest: start.since,
            start,
            read: 0,
            per_sec: Default::default(),
        }
    }

    /// Records the next line of the answer, stamped `secs` (`None` when the
    /// stamp did not parse); whether it is to be copied.
    pub fn line(&mut self, secs: Option<i64>) -> bool {
        self.read += 1;
        let s = secs.unwrap_or(self.newest).max(self.start.since);
        self.newest = self.newest.max(s);
        *self.per_sec.entry(s).or_default() += 1;
        let floor = self.floor();
        if self.per_sec.keys().next().is_some_and(|k| *k < floor) {
            self.per_sec = self.per_sec.split_off(&floor);
        }
        self.read > self.start.skip
    }

    fn floor(&self) -> i64 {
        // Until the lines copied before are all seen again, the counts of
        // later seconds are incomplete: stay where the copy started.
        if self.read < self.start.skip {
            return self.start.since;
        }
        self.start.since.max(self.newest - CURSOR_SLACK_S)
    }

    /// Where a copy resumed now would start: the lines Docker's answer from
    /// `since` holds up to here are exactly those seen with that second or
    /// later, whatever order they came in.
    pub fn cursor(&self) -> LogCursor {
        let since = self.floor();
        let seen: u64 = self.per_sec.range(since..).map(|(_, n)| n).sum();
        LogCursor {
            container: self.start.container.clone(),
            since,
            skip: if since == self.start.since {
                seen.max(self.start.skip)
            } else {
                seen
            },
        }
    }
}
/// Seconds since the epoch of Docker's RFC 3339 timestamp
/// (`2024-05-01T12:34:56.123456789Z`, fraction of any length up to
/// nanoseconds).
pub fn timestamp_secs(ts: &str) -> Option<i64> {
    let ts = ts.strip_suffix('Z')?;
    let (secs, frac) = ts.split_once('.').unwrap_or((ts, ""));
    if secs.len() != 19 || frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    civil_secs(secs)
}
/// Seconds since the epoch of `YYYY-MM-DDTHH:MM:SS` (UTC).
pub(super) fn civil_secs(key: &str) -> Option<i64> {
    let num = |r: std::ops::Range<usize>| key.get(r)?.parse::<i64>().ok();
    let (y, m, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hh, mm, ss) = (num(11..13)?, num(14..16)?, num(17..19)?);
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + hh * 3_600 + mm * 60 + ss)
}
/// Appends the container's stdout and stderr, in order, to the task's log
/// until the container stops, resuming after what an earlier copy wrote.
pub(super) async fn pump_logs(
    rt: DockerRuntime,
    name: String,
    task: TaskRef,
) -> Result<(), RuntimeError> {
    let path = task.log_path.clone();
    let cursor_path = task.state_dir.join(LOG_CURSOR_FILE);
    let io_err = |source| RuntimeError::Io {
        path: path.clone(),
        source,
    };
    let docker = rt.client()?;
    let container = docker
        .inspect_container(&name, None)
        .await
        .map_err(|e| rt.err(e))?
        .id
        .unwrap_or_default();
    let start = match crate::checkpoint::read_json::<LogCursor>(&cursor_path) {
        Ok(Some(c)) if c.container == container => c,
        _ => LogCursor {
            container: container.clone(),
            ..Default::default()
        },
    };
    let mut file = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .await
        .map_err(io_err)?;
    let mut logs = docker.logs(
        &container,
        Some(LogsOptions::<String> {
            follow: true,
            stdout: true,
            stderr: true,
            timestamps: true,
            since: start.since,
            tail: "all".to_string(),
            ..Default::default()
        }),
    );
    let mut progress = LogProgress::new(start);
    // The first line after a quiet spell has its cursor saved at once.
    let mut saved = tokio::time::Instant::now()
        .checked_sub(CURSOR_SAVE)
        .unwrap_or_else(tokio::time::Instant::now);
    let mut dirty = false;
    let result = loop {
        // Output that stops flowing has its cursor saved at once, so a quiet
        // task's last lines are not copied again after an agent crash.
        let next = if dirty {
            match tokio::time::timeout(CURSOR_SAVE, logs.next()).await {
                Ok(next) => next,
                Err(_) => {
                    file.flush().await.map_err(io_err)?;
                    save_cursor(&cursor_path, &progress.cursor());
                    saved = tokio::time::Instant::now();
                    dirty = false;
                    continue;
                }
            }
        } else {
            logs.next().await
        };
        let Some(chunk) = next else {
            break Ok(());
        };
        let bytes = match chunk {
            Ok(LogOutput::StdOut { message } | LogOutput::StdErr { message })
            | Ok(LogOutput::Console { message }) => message,
            Ok(LogOutput::StdIn { .. }) => continue,
            Err(e) => break Err(rt.err(e)),
        };
        // "TIMESTAMP LINE"; a line without a stamp is copied as is.
        let split = bytes.iter().position(|b| *b == b' ');
        let stamped = split.and_then(|i| {
            std::str::from_utf8(&bytes[..i])
                .ok()
                .and_then(timestamp_secs)
                .map(|secs| (secs, &bytes[i + 1..]))
        });
        let (secs, line) = match stamped {
            Some((secs, line)) => (Some(secs), line),
            None => (None, &bytes[..]),
        };
        if !progress.line(secs) {
            continue;
        }
        file.write_all(line).await.map_err(io_err)?;
        dirty = true;
        if saved.elapsed() >= CURSOR_SAVE {
            file.flush().await.map_err(io_err)?;
            save_cursor(&cursor_path, &progress.cursor());
            saved = tokio::time::Instant::now();
            dirty = false;
        }
    };
    // tokio writes in the background; make sure it all landed.
    file.flush().await.map_err(io_err)?;
    if dirty {
        save_cursor(&cursor_path, &progress.cursor());
    }
    result
}
/// Without fsync: losing the last quarter second of cursor only repeats
/// those lines after a crash.
pub(super) fn save_cursor(path: &Path, cursor: &LogCursor) {
    let tmp = path.with_extension("tmp");
    let res = serde_json::to_vec(cursor)
        .map_err(std::io::Error::other)
        .and_then(|b| std::fs::write(&tmp, b))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = res {
        tracing::warn!(path = %path.display(), error = %e, "could not save the log cursor");
    }
}
