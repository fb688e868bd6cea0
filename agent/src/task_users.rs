//! Users of their own for host-process tasks, like systemd's `DynamicUser`
//! and Nomad's dynamic workload users: a task whose job names no user runs
//! under a uid, with a gid of the same number, from the agent's
//! `task_users` range, which no task of another job on this agent holds
//! (the tasks of one job share theirs: ranks share a checkpoint directory).
//!
//! A task holds its id from before it starts until the executor forgets it
//! (its final status acknowledged and the master done with it), by which
//! time its processes are gone (the PID namespace's end kills them all)
//! and its sandbox has been taken back by the agent (`Executor::retire`).
//! The lease is recorded in the task's checkpoint (`state/<task>/user.json`)
//! before the task starts, so an agent restarted while it runs holds the
//! same id again ([`TaskUsers::restore`]). Ids are handed out round robin
//! from where the last one was (kept in `task-users.json`), so one comes
//! back into use as late as possible; an id that the host's `/etc/passwd`
//! or `/etc/group` names, or that any process runs as, is skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use gpuctl_core::types::{IdRanges, UserIds};
use serde::{Deserialize, Serialize};

use crate::checkpoint;

/// In a task's checkpoint directory: the user it was given.
pub const USER_FILE: &str = "user.json";
/// In the work dir: where the round robin goes on from.
const CURSOR_FILE: &str = "task-users.json";

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Cursor {
    next: u32,
}

/// Ids in use on the host outside the agent's leases.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostIds {
    pub uids: BTreeSet<u32>,
    pub gids: BTreeSet<u32>,
}

impl HostIds {
    /// The host as it is: the users and groups of `/etc/passwd` and
    /// `/etc/group` (names from elsewhere, LDAP say, are not seen: keep
    /// `task_users` clear of them) and the real, effective, saved and file
    /// ids of every process.
    pub fn of_host() -> HostIds {
        let mut ids = HostIds::default();
        let field = |line: &str| line.split(':').nth(2).and_then(|n| n.parse::<u32>().ok());
        for (path, set) in [
            ("/etc/passwd", &mut ids.uids),
            ("/etc/group", &mut ids.gids),
        ] {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            set.extend(text.lines().filter_map(field));
        }
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let name = entry.file_name();
            if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else {
                continue; // gone meanwhile
            };
            for line in status.lines() {
                let (set, rest) = if let Some(r) = line.strip_prefix("Uid:") {
                    (&mut ids.uids, r)
                } else if let Some(r) = line.strip_prefix("Gid:") {
                    (&mut ids.gids, r)
                } else {
                    continue;
                };
                set.extend(
                    rest.split_whitespace()
                        .filter_map(|n| n.parse::<u32>().ok()),
                );
            }
        }
        ids
    }
}

/// PURE: the id to give next, trying `range` from `next` round robin:
/// the first that no lease holds and the host uses neither as a uid nor
/// as a gid.
pub fn pick(range: &IdRanges, next: u32, held: &BTreeSet<u32>, host: &HostIds) -> Option<u32> {
    range
        .ids_from(next)
        .find(|id| !held.contains(id) && !host.uids.contains(id) && !host.gids.contains(id))
}

#[derive(Debug, Default)]
struct Leases {
    by_task: BTreeMap<String, u32>,
    held: BTreeSet<u32>,
    next: u32,
}

/// The agent's leases of `task_users`.
#[derive(Debug)]
pub struct TaskUsers {
    range: IdRanges,
    cursor_path: PathBuf,
    inner: Mutex<Leases>,
    /// Reads the ids the host uses: [`HostIds::of_host`], or a fixed set
    /// in tests, which must not depend on what else runs on the machine
    /// (another agent's tasks hold ids of the same default range).
    host_ids: fn() -> HostIds,
}

impl TaskUsers {
    /// The leases of the agent with `work_dir` (none yet: the executor
    /// restores what its checkpoints hold).
    pub fn new(range: IdRanges, work_dir: &Path) -> TaskUsers {
        let cursor_path = work_dir.join(CURSOR_FILE);
        let next = match checkpoint::read_json::<Cursor>(&cursor_path) {
            Ok(Some(c)) => c.next,
            Ok(None) => 0,
            Err(e) => {
                tracing::warn!(error = %e, "unreadable task user cursor; starting from the range's start");
                0
            }
        };
        TaskUsers {
            range,
            cursor_path,
            inner: Mutex::new(Leases {
                next,
                ..Default::default()
            }),
            host_ids: HostIds::of_host,
        }
    }

    /// The same leases, with the host's ids read by `host_ids`.
    pub fn with_host_ids(self, host_ids: fn() -> HostIds) -> TaskUsers {
        TaskUsers { host_ids, ..self }
    }

    /// The ids the host uses now (blocking: it reads `/proc`).
    pub fn host_ids(&self) -> fn() -> HostIds {
        self.host_ids
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Leases> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn range(&self) -> &IdRanges {
        &self.range
    }

    /// How many ids are leased now.
    pub fn held(&self) -> usize {
        self.lock().held.len()
    }

    /// The id `task_id` holds, if any.
    pub fn of(&self, task_id: &str) -> Option<UserIds> {
        self.lock()
            .by_task
            .get(task_id)
            .map(|&id| UserIds { uid: id, gid: id })
    }

    /// `task_id` holds `ids` again (read from its checkpoint after a
    /// restart). Held even when the range changed meanwhile: what may still
    /// run under it keeps it.
    pub fn restore(&self, task_id: &str, ids: UserIds) {
        let mut l = self.lock();
        l.by_task.insert(task_id.to_string(), ids.uid);
        l.held.insert(ids.uid);
    }

    /// An id for `task_id`: the one it holds, else a new lease; `host` says
    /// what else on the machine uses ids. Refused when every id of the
    /// range is taken.
    pub fn lease(&self, task_id: &str, host: &HostIds) -> Result<UserIds, String> {
        self.lease_in_job(task_id, None, None, host)
    }

    /// [`lease`](Self::lease) for a task of `job` (task ids `<job>.<n>`):
    /// the tasks of one job on this agent share one user, so that ranks
    /// of a gang share what they write (a checkpoint directory above all).
    /// The job's id is, in order: `owner` (the owner of the job's
    /// checkpoint directory, made by an earlier attempt) when that id is of
    /// the range, unused by the host and held by no task of another job;
    /// the one its other tasks here hold; a new lease.
    pub fn lease_in_job(
        &self,
        task_id: &str,
        job: Option<&str>,
        owner: Option<u32>,
        host: &HostIds,
    ) -> Result<UserIds, String> {
        let mut l = self.lock();
        if let Some(&id) = l.by_task.get(task_id) {
            return Ok(UserIds { uid: id, gid: id });
        }
        let of_job = job.map(|j| format!("{j}."));
        let shared = of_job.as_deref().and_then(|of_job| {
            let only_this_job = |id: u32| {
                l.by_task
                    .iter()
                    .all(|(t, held)| *held != id || t.starts_with(of_job))
            };
            owner
                .filter(|&id| {
                    self.range.contains(id)
                        && !host.uids.contains(&id)
                        && !host.gids.contains(&id)
                        && only_this_job(id)
                })
                .or_else(|| {
                    l.by_task
                        .iter()
                        .find(|(t, _)| t.starts_with(of_job))
                        .map(|(_, &id)| id)
                })
        });
        if let Some(id) = shared {
            l.by_task.insert(task_id.to_string(), id);
            l.held.insert(id);
            return Ok(UserIds { uid: id, gid: id });
        }
        let Some(id) = pick(&self.range, l.next, &l.held, host) else {
            return Err(format!(
                "no free user for the task in this agent's task_users ({}): {} held by tasks this agent still keeps, the rest used on the host; widen --task-users or lower --task-retention",
                self.range,
                l.held.len()
            ));
        };
        l.by_task.insert(task_id.to_string(), id);
        l.held.insert(id);
        l.next = id.saturating_add(1);
        let cursor = Cursor { next: l.next };
        drop(l);
        if let Err(e) = checkpoint::write_json(&self.cursor_path, &cursor) {
            // Only the order suffers: ids are still never given twice.
            tracing::warn!(error = %e, "could not record the task user cursor");
        }
        Ok(UserIds { uid: id, gid: id })
    }

    /// `task_id` is forgotten: its id may be given again (last, in the
    /// round robin).
    pub fn release(&self, task_id: &str) {
        let mut l = self.lock();
        if let Some(id) = l.by_task.remove(task_id) {
            // Another task could hold the same id only through `restore`
            // of inconsistent checkpoints; keep it held for that one.
            if !l.by_task.values().any(|&other| other == id) {
                l.held.remove(&id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ids: &[u32]) -> BTreeSet<u32> {
        ids.iter().copied().collect()
    }

    #[test]
    fn picks_round_robin_skipping_held_and_host_ids() {
        let r = IdRanges::parse("100-104").unwrap();
        let none = HostIds::default();
        assert_eq!(pick(&r, 0, &set(&[]), &none), Some(100));
        assert_eq!(pick(&r, 102, &set(&[]), &none), Some(102));
        assert_eq!(pick(&r, 102, &set(&[102, 103]), &none), Some(104));
        assert_eq!(pick(&r, 104, &set(&[104]), &none), Some(100), "wraps");
        let host = HostIds {
            uids: set(&[100]),
            gids: set(&[101]),
        };
        assert_eq!(
            pick(&r, 0, &set(&[]), &host),
            Some(102),
            "uid or gid in use"
        );
        assert_eq!(pick(&r, 0, &set(&[102, 103, 104]), &host), None, "full");
        assert_eq!(pick(&IdRanges::none(), 0, &set(&[]), &none), None);
    }

    #[test]
    fn a_preferred_id_is_given_when_only_its_job_holds_it() {
        let dir = tempfile::tempdir().unwrap();
        let users = TaskUsers::new(IdRanges::parse("100-104").unwrap(), dir.path());
        let none = HostIds::default();
        let a = users.lease("job-1.0", &none).unwrap().uid;
        assert_eq!(a, 100);
        // The next attempt of job-1 gets 100 again, even while job-1.0's
        // record is kept; job-2 does not.
        let again = users
            .lease_in_job("job-1.1", Some("job-1"), Some(100), &none)
            .unwrap();
        assert_eq!(again.uid, 100);
        let other = users
            .lease_in_job("job-2.0", Some("job-2"), Some(100), &none)
            .unwrap();
        assert_ne!(other.uid, 100);
        // Outside the range, or used by the host: a lease as usual.
        let out = users
            .lease_in_job("job-3.0", Some("job-3"), Some(7), &none)
            .unwrap();
        assert!(out.uid != 7 && out.uid >= 100);
        let host = HostIds {
            uids: set(&[104]),
            gids: BTreeSet::new(),
        };
        let used = users
            .lease_in_job("job-4.0", Some("job-4"), Some(104), &host)
            .unwrap_or(UserIds { uid: 0, gid: 0 });
        assert_ne!(used.uid, 104);
        // Released by one holder, it stays held by the other.
        users.release("job-1.0");
        assert_eq!(users.of("job-1.1").unwrap().uid, 100);
        assert!(users.held() >= 2);
    }

    /// Ranks of one job on one agent share a user (they share its
    /// checkpoint directory); another job's tasks, and tasks of no job,
    /// never do; "job-1" is not a prefix of "job-10"'s tasks.
    #[test]
    fn tasks_of_one_job_share_a_user_and_no_other_task_does() {
        let dir = tempfile::tempdir().unwrap();
        let users = TaskUsers::new(IdRanges::parse("100-109").unwrap(), dir.path());
        let none = HostIds::default();
        let lease =
            |task: &str, job: Option<&str>| users.lease_in_job(task, job, None, &none).unwrap().uid;
        let r0 = lease("job-1.0", Some("job-1"));
        let r1 = lease("job-1.1", Some("job-1"));
        assert_eq!(r0, r1);
        let other = lease("job-10.0", Some("job-10"));
        assert_ne!(other, r0);
        let framework = lease("fw-task", None);
        assert!(framework != r0 && framework != other);
        // A later attempt's rank shares it too, while any rank holds it;
        // once all are released, the job's next task gets a new one.
        users.release("job-1.0");
        assert_eq!(lease("job-1.2", Some("job-1")), r0);
        users.release("job-1.1");
        users.release("job-1.2");
        assert_ne!(lease("job-1.3", Some("job-1")), r0);
    }

    #[test]
    fn leases_hold_until_released_survive_restarts_and_go_round() {
        let dir = tempfile::tempdir().unwrap();
        let range = IdRanges::parse("100-102").unwrap();
        let users = TaskUsers::new(range.clone(), dir.path());
        let none = HostIds::default();
        let a = users.lease("a", &none).unwrap();
        assert_eq!(a, UserIds { uid: 100, gid: 100 });
        assert_eq!(users.lease("a", &none).unwrap(), a, "same task, same id");
        let b = users.lease("b", &none).unwrap().uid;
        let c = users.lease("c", &none).unwrap().uid;
        assert_eq!((b, c), (101, 102));
        let err = users.lease("d", &none).unwrap_err();
        assert!(err.contains("100-102") && err.contains("3 held"), "{err}");
        users.release("b");
        assert_eq!(users.held(), 2);
        // The freed id is the only one; it comes back.
        assert_eq!(users.lease("d", &none).unwrap().uid, 101);
        users.release("a");
        users.release("c");
        // Round robin goes on after the last one given (101), not from 100.
        assert_eq!(users.lease("e", &none).unwrap().uid, 102);

        // A new agent process: the cursor is read back, the leases restored
        // from checkpoints.
        let again = TaskUsers::new(range, dir.path());
        again.restore("d", UserIds { uid: 101, gid: 101 });
        again.restore("e", UserIds { uid: 102, gid: 102 });
        assert_eq!(again.of("d"), Some(UserIds { uid: 101, gid: 101 }));
        assert_eq!(again.lease("f", &none).unwrap().uid, 100);
        assert!(again.lease("g", &none).is_err());
    }
}
