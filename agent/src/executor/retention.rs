//! Sandboxes of ended tasks. A task's sandbox (`tasks/<id>/`, its
//! `output.log` among it) outlives the task so that `gpuctl jobs logs`
//! works after the end. When the executor forgets a task (its final status
//! acknowledged, the master no longer lists it) it records the time in
//! `retired/<id>`; `--task-retention` later the sweep removes the sandbox
//! and the record. The clock starts when the task is forgotten, not at the
//! log's last write, so a task quiet for days before it ended keeps its log
//! for the whole retention. A sandbox with no record (left by an older
//! agent, or a crash) gets one at the first sweep: kept at least as long.
//!
//! Nothing of a task the executor knows (or still has a checkpoint of) is
//! touched: the check and the sandbox's rename out of the way happen under
//! the executor's lock, so a launch reusing the id cannot slip in between;
//! the slow removal happens after, outside it. Errors are logged and the
//! sweep goes on; the next one tries again.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::Executor;
use crate::checkpoint::{self, RETIRED_DIR, SANDBOX_DIR};

/// A sandbox being removed is first renamed to this prefix and its id (no
/// task id starts with '.'), so a crash mid-removal leaves nothing that
/// looks like a task's.
const TRASH_PREFIX: &str = ".removing-";

/// What `retired/<id>` holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Retired {
    /// Wall clock (it must survive agent restarts).
    forgotten_at_ms: u64,
}

/// What to do with the sandbox of a task the executor does not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Keep,
    /// No record of when it was forgotten: its retention starts now.
    StartClock,
    Remove,
}

/// PURE: the sandbox of a task forgotten at `forgotten_at_ms` (`None`: no
/// readable record), at `now_ms`.
fn verdict(forgotten_at_ms: Option<u64>, now_ms: u64, retention: Duration) -> Verdict {
    let retention_ms = u64::try_from(retention.as_millis()).unwrap_or(u64::MAX);
    match forgotten_at_ms {
        None => Verdict::StartClock,
        Some(t) if t.saturating_add(retention_ms) <= now_ms => Verdict::Remove,
        Some(_) => Verdict::Keep,
    }
}

/// Makes `dir` (not what is in it) `uid:gid`'s, mode 0700, unless it is
/// already.
fn take_back(dir: &Path, uid: u32, gid: u32) -> std::io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let md = std::fs::symlink_metadata(dir)?;
    if md.uid() != uid || md.gid() != gid {
        std::os::unix::fs::chown(dir, Some(uid), Some(gid))?;
    }
    if md.mode() & 0o7777 != 0o700 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

fn record_path(work_dir: &Path, task_id: &str) -> std::path::PathBuf {
    work_dir.join(RETIRED_DIR).join(task_id)
}

fn write_record(work_dir: &Path, task_id: &str, now_ms: u64) {
    let dir = work_dir.join(RETIRED_DIR);
    let r = std::fs::create_dir_all(&dir)
        .map_err(|source| checkpoint::CheckpointError::Io {
            path: dir.clone(),
            source,
        })
        .and_then(|()| {
            checkpoint::write_json(
                &record_path(work_dir, task_id),
                &Retired {
                    forgotten_at_ms: now_ms,
                },
            )
        });
    if let Err(e) = r {
        // The next sweep starts the clock instead.
        tracing::warn!(task_id, error = %e, "could not record when the task was forgotten");
    }
}

fn read_record(work_dir: &Path, task_id: &str) -> Option<u64> {
    match checkpoint::read_json::<Retired>(&record_path(work_dir, task_id)) {
        Ok(r) => r.map(|r| r.forgotten_at_ms),
        Err(e) => {
            tracing::warn!(task_id, error = %e, "unreadable retirement record; its retention starts again");
            None
        }
    }
}

fn remove_file(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), error = %e, "could not remove");
        }
    }
}

fn names(dir: &Path) -> Vec<String> {
    match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => {
            tracing::warn!(path = %dir.display(), error = %e, "cannot list");
            Vec::new()
        }
    }
}

/// Removes under `work_dir` the sandboxes past `retention` at `now_ms`, and
/// records of sandboxes that are gone. `unknown(id)` is `Some(guard)` when
/// the executor does not know task `id`, the guard keeping it so while it
/// lives. Returns how many sandboxes were removed.
fn sweep<G>(
    work_dir: &Path,
    now_ms: u64,
    retention: Duration,
    unknown: impl Fn(&str) -> Option<G>,
) -> usize {
    let root = work_dir.join(SANDBOX_DIR);
    let mut removed = 0;
    for name in names(&root) {
        let path = root.join(&name);
        if name.starts_with(TRASH_PREFIX) {
            // Left by a sweep that did not finish.
            if let Err(e) = std::fs::remove_dir_all(&path) {
                tracing::warn!(path = %path.display(), error = %e, "could not remove a sandbox");
            }
            continue;
        }
        if name.starts_with('.') || !path.is_dir() {
            continue;
        }
        match verdict(read_record(work_dir, &name), now_ms, retention) {
            Verdict::Keep => {}
            Verdict::StartClock => {
                if unknown(&name).is_some() {
                    write_record(work_dir, &name, now_ms);
                }
            }
            Verdict::Remove => {
                let trash = root.join(format!("{TRASH_PREFIX}{name}"));
                {
                    let Some(_held) = unknown(&name) else {
                        continue;
                    };
                    if let Err(e) = std::fs::rename(&path, &trash) {
                        tracing::warn!(task_id = %name, error = %e, "could not remove the task's sandbox");
                        continue;
                    }
                }
                match std::fs::remove_dir_all(&trash) {
                    Ok(()) => {
                        tracing::info!(task_id = %name, retention_secs = retention.as_secs_f64(), "removed the sandbox and log of a task ended past the retention");
                        removed += 1;
                    }
                    // Renamed already: the next sweep finishes it.
                    Err(e) => {
                        tracing::warn!(task_id = %name, error = %e, "could not remove the task's sandbox")
                    }
                }
                remove_file(&record_path(work_dir, &name));
            }
        }
    }
    // Records whose sandbox is gone (a task refused before it had one, a
    // crash between the two removals).
    for name in names(&work_dir.join(RETIRED_DIR)) {
        if name.starts_with('.') || root.join(&name).exists() {
            continue;
        }
        if let Some(_held) = unknown(&name) {
            remove_file(&record_path(work_dir, &name));
        }
    }
    removed
}

impl Executor {
    /// The executor just forgot `task_id`: its sandbox's retention starts,
    /// and the sandbox is the agent's again (mode 0700), so that whoever is
    /// given the task's user next cannot reach what the task left in it.
    pub(super) fn retire(&self, task_id: &str) {
        let sandbox = self.sandbox(task_id);
        if sandbox.is_dir() {
            let agent = self.isolation.policy.agent_ids;
            if let Err(e) = take_back(&sandbox, agent.uid, agent.gid) {
                tracing::warn!(task_id, error = %e, "could not take the sandbox back from the task's user");
            }
            write_record(&self.work_dir, task_id, checkpoint::wall_ms());
        }
    }

    /// Removes the sandboxes of forgotten tasks past `--task-retention` at
    /// `now_ms` (wall clock); how many. Blocking I/O: off the async
    /// threads.
    pub fn sweep_sandboxes(&self, now_ms: u64) -> usize {
        sweep(&self.work_dir, now_ms, self.task_retention, |id| {
            let inner = self.lock();
            let known = inner.tasks.contains_key(id) || self.state_dir(id).exists();
            (!known).then_some(inner)
        })
    }

    /// How often the sweep runs: half the retention, between 1 s and 1 min.
    fn sweep_every(&self) -> Duration {
        (self.task_retention / 2).clamp(Duration::from_secs(1), Duration::from_secs(60))
    }

    /// Sweeps sandboxes until shutdown. Start it after `recover`.
    pub async fn sweep_sandboxes_until(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let mut interval = tokio::time::interval(self.sweep_every());
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = interval.tick() => {}
                _ = shutdown.changed() => return,
            }
            let me = self.clone();
            let swept =
                tokio::task::spawn_blocking(move || me.sweep_sandboxes(checkpoint::wall_ms()))
                    .await;
            if let Err(e) = swept {
                tracing::warn!(error = %e, "the sandbox sweep failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn verdicts() {
        let cases = [
            (None, 0, Verdict::StartClock),
            (Some(1_000), 1_000, Verdict::Keep),
            (Some(1_000), 3_600_999, Verdict::Keep),
            (Some(1_000), 3_601_000, Verdict::Remove),
            (Some(0), u64::MAX, Verdict::Remove),
            // A record from the future (the clock stepped back): kept.
            (Some(10_000_000), 0, Verdict::Keep),
        ];
        for (at, now, want) in cases {
            assert_eq!(verdict(at, now, HOUR), want, "{at:?} at {now}");
        }
    }

    /// A work dir with sandboxes (and their logs) as the agent leaves them.
    fn sandbox(work: &Path, id: &str, forgotten_at_ms: Option<u64>) {
        let dir = work.join(SANDBOX_DIR).join(id);
        std::fs::create_dir_all(dir.join("ckpt")).unwrap();
        std::fs::write(dir.join("output.log"), "hello\n").unwrap();
        std::fs::write(dir.join("ckpt/model.bin"), [0u8; 4096]).unwrap();
        if let Some(t) = forgotten_at_ms {
            write_record(work, id, t);
        }
    }

    fn ids(dir: &Path) -> Vec<String> {
        let mut v = names(dir);
        v.sort();
        v
    }

    #[test]
    fn the_sweep_removes_only_forgotten_sandboxes_past_the_retention() {
        let tmp = tempfile::tempdir().unwrap();
        let work = tmp.path();
        let now = 100 * 3_600_000;
        sandbox(work, "old", Some(now - 3_600_000));
        sandbox(work, "young", Some(now - 3_599_999));
        // Known to the executor (running again under the same id, or not
        // yet forgotten): never touched, whatever its record says.
        sandbox(work, "known", Some(0));
        // Left by an older agent: its clock starts now.
        sandbox(work, "legacy", None);
        // A record that cannot be read: its clock starts again.
        sandbox(work, "garbled", None);
        std::fs::write(work.join(RETIRED_DIR).join("garbled"), "{").unwrap();
        // A record whose sandbox is gone; a removal a crash interrupted; a
        // stray file.
        write_record(work, "orphan", 0);
        std::fs::create_dir_all(work.join(SANDBOX_DIR).join(".removing-gone/x")).unwrap();
        std::fs::write(work.join(SANDBOX_DIR).join("notes.txt"), "").unwrap();

        let known: BTreeSet<&str> = ["known"].into();
        let unknown = |id: &str| (!known.contains(id)).then_some(());
        assert_eq!(sweep(work, now, HOUR, unknown), 1);
        assert_eq!(
            ids(&work.join(SANDBOX_DIR)),
            vec!["garbled", "known", "legacy", "notes.txt", "young"]
        );
        assert_eq!(
            ids(&work.join(RETIRED_DIR)),
            vec!["garbled", "known", "legacy", "young"]
        );
        assert_eq!(read_record(work, "legacy"), Some(now));
        assert_eq!(read_record(work, "garbled"), Some(now));
        assert_eq!(read_record(work, "known"), Some(0), "left as it was");
        // An hour later everything unknown has gone; the known one stays.
        assert_eq!(sweep(work, now + 3_600_000, HOUR, unknown), 3);
        assert_eq!(ids(&work.join(SANDBOX_DIR)), vec!["known", "notes.txt"]);
        assert_eq!(ids(&work.join(RETIRED_DIR)), vec!["known"]);
        // A work dir with nothing to sweep yet.
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(sweep(empty.path(), now, HOUR, unknown), 0);
    }
}
