//! A restarted agent finds its tasks again: every checkpoint under
//! `<work-dir>/state` looked up in its runtime and followed to its end.

use std::collections::BTreeSet;
use std::sync::Arc;

use gpuctl_core::types::{StatusUpdate, TaskSpec, UserIds};

use super::plan::Phase;

use crate::checkpoint::{self};
use crate::task_users;

use super::*;

impl Executor {
    /// Finds every task an earlier agent process left in `<work-dir>/state`
    /// and takes it over: running ones are followed to their end, final
    /// statuses not yet acknowledged are sent again. Also removes the task
    /// cgroups of tasks it does not know. Call once, before the master link.
    pub fn recover(self: &Arc<Self>) {
        let root = self.work_dir.join(checkpoint::STATE_DIR);
        if let Err(e) = std::fs::create_dir_all(&root) {
            tracing::error!(path = %root.display(), error = %e, "cannot create the state directory");
        }
        // Launch records hold every task's environment: no task reads them.
        if let Err(e) = set_mode(&root, 0o700) {
            tracing::warn!(path = %root.display(), error = %e, "cannot make the state directory private");
        }
        match checkpoint::read_contact(&checkpoint::contact_path(&self.work_dir)) {
            Ok(c) => self.lock().contact = c,
            Err(e) => tracing::warn!(error = %e, "unreadable contact record; starting without one"),
        }
        let mut resend = Vec::new();
        let mut follow = Vec::new();
        let entries = std::fs::read_dir(&root).into_iter().flatten().flatten();
        for entry in entries {
            let dir = entry.path();
            let id = entry.file_name().to_string_lossy().into_owned();
            let spec = match checkpoint::read_json::<TaskSpec>(&dir.join(checkpoint::TASK_FILE)) {
                Ok(Some(s)) if s.task_id == id => s,
                Ok(_) => {
                    // Made by an agent that died before it wrote the spec:
                    // nothing was started from it.
                    let _ = std::fs::remove_dir_all(&dir);
                    continue;
                }
                Err(e) => {
                    tracing::error!(task_id = %id, error = %e, "unreadable task checkpoint; left alone");
                    continue;
                }
            };
            // Whatever may still run under its user keeps it.
            match checkpoint::read_json::<UserIds>(&dir.join(task_users::USER_FILE)) {
                Ok(Some(ids)) => self.isolation.users.restore(&id, ids),
                Ok(None) => {}
                Err(e) => {
                    tracing::error!(task_id = %id, error = %e, "unreadable task user record; left alone");
                    continue;
                }
            }
            let final_update =
                checkpoint::read_json::<StatusUpdate>(&dir.join(checkpoint::FINAL_FILE))
                    .ok()
                    .flatten();
            let mut t = self.lock();
            match final_update {
                Some(u) => {
                    let acked = dir.join(checkpoint::ACKED_FILE).exists();
                    let mut local = LocalTask::new(spec, Phase::Ended { acked });
                    local.final_uuid = Some(u.uuid.clone());
                    t.tasks.insert(id.clone(), local);
                    if !acked {
                        resend.push(u);
                    }
                }
                None => {
                    let local = LocalTask::new(spec.clone(), Phase::Running);
                    let stop = local.stop.subscribe();
                    t.tasks.insert(id.clone(), local);
                    follow.push((spec, stop));
                }
            }
        }
        let known: BTreeSet<String> = self.lock().tasks.keys().cloned().collect();
        match self.isolation.isolator.remove_stale(&known) {
            Ok(0) => {}
            Ok(n) => tracing::info!(removed = n, "removed task cgroups of tasks no longer here"),
            Err(e) => tracing::warn!(error = %e, "could not remove every stale task cgroup"),
        }
        tracing::info!(
            reattached = follow.len(),
            unacknowledged = resend.len(),
            known = known.len(),
            "recovered tasks from the work dir"
        );
        for (spec, stop) in follow {
            let me = self.clone();
            tokio::spawn(async move { me.drive(spec, stop, true).await });
        }
        let updates = self.updates.clone();
        tokio::spawn(async move {
            for u in resend {
                if updates.send(u).await.is_err() {
                    return;
                }
            }
        });
    }
}
