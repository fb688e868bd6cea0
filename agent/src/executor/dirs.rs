//! A task's directories on the agent: its sandbox, its state, and those it
//! is given (the stop notice, the heartbeat), made with the owner and mode
//! its user needs and no more; and the notice written before a stop.

use super::*;

impl Executor {
    pub fn sandbox(&self, task_id: &str) -> PathBuf {
        self.work_dir.join(checkpoint::SANDBOX_DIR).join(task_id)
    }

    pub(super) fn state_dir(&self, task_id: &str) -> PathBuf {
        self.work_dir.join(checkpoint::STATE_DIR).join(task_id)
    }

    /// Where the task's notice before a stop is written (`notice`).
    pub(super) fn notice_dir(&self, task_id: &str) -> PathBuf {
        self.work_dir.join(checkpoint::NOTICE_DIR).join(task_id)
    }

    /// Where a task with a hang timeout may touch its heartbeat file: one
    /// of the two roots, whichever [`Self::make_heartbeat_dir`] used.
    pub(super) fn heartbeat_dir(&self, task_id: &str) -> PathBuf {
        let unknown_user = self.heartbeat_dir_in(checkpoint::CONTAINER_HEARTBEAT_DIR, task_id);
        if unknown_user.is_dir() {
            return unknown_user;
        }
        self.heartbeat_dir_in(checkpoint::HEARTBEAT_DIR, task_id)
    }

    pub(super) fn heartbeat_dir_in(&self, root: &str, task_id: &str) -> PathBuf {
        self.work_dir.join(root).join(task_id)
    }

    /// Makes the task's heartbeat directory, the task's to write: its
    /// user's alone, under a root that tasks pass through without listing;
    /// or, for a container whose user is its image's (unknown here), root's
    /// and `group`'s (a group of the task's own, which the container gets
    /// as a supplementary group), under a root only root may pass (the
    /// container gets it mounted): no other task can reach it, nor write it
    /// if it could. A task of no user and no group (a host task running as
    /// root) gets one only root may write.
    pub(super) fn make_heartbeat_dir(
        &self,
        task_id: &str,
        user: Option<UserIds>,
        group: Option<u32>,
    ) -> std::io::Result<PathBuf> {
        let (root, mode) = match user {
            Some(_) => (checkpoint::HEARTBEAT_DIR, 0o711),
            None => (checkpoint::CONTAINER_HEARTBEAT_DIR, 0o700),
        };
        let root_dir = self.work_dir.join(root);
        std::fs::create_dir_all(&root_dir)?;
        set_mode(&root_dir, mode)?;
        let dir = self.heartbeat_dir_in(root, task_id);
        std::fs::create_dir_all(&dir)?;
        match user {
            Some(u) if !u.is_root() => {
                std::os::unix::fs::chown(&dir, Some(u.uid), Some(u.gid))?;
                set_mode(&dir, 0o700)?;
            }
            Some(_) => set_mode(&dir, 0o700)?,
            None => match group {
                Some(g) => {
                    std::os::unix::fs::chown(&dir, Some(0), Some(g))?;
                    set_mode(&dir, 0o770)?;
                }
                None => set_mode(&dir, 0o700)?,
            },
        }
        Ok(dir)
    }

    /// The grace of a stop for `reason`: the job's for what the master
    /// asked (its kill, or its forgetting the task), the agent's kill grace
    /// otherwise. A fence stop keeps the agent's: the master's lost timeout
    /// is checked against it (`check_kill_grace`).
    pub(super) fn stop_grace(&self, spec: &TaskSpec, reason: Option<&StopReason>) -> Duration {
        match reason {
            Some(StopReason::Killed | StopReason::NotWanted) => spec
                .template
                .stop_grace_ms
                .map_or(self.kill_grace, Duration::from_millis),
            _ => self.kill_grace,
        }
    }

    /// Writes the task's notice (atomically: a reader sees all or none of
    /// it) before its stop begins. A task whose notice cannot be written is
    /// stopped all the same.
    pub(super) fn write_notice(&self, task_id: &str, reason: &StopReason, grace: Duration) {
        let from_master = self
            .lock()
            .desired
            .as_ref()
            .and_then(|d| d.notices.get(task_id).cloned());
        let n = notice::of(reason, from_master.as_ref());
        let text = notice::text(&n, grace, checkpoint::wall_ms());
        let dir = self.notice_dir(task_id);
        match checkpoint::write_atomic_mode(&dir.join(notice::FILE), text.as_bytes(), 0o644) {
            Ok(()) => {
                tracing::info!(task_id, kind = %n.kind, grace_ms = grace.as_millis() as u64, "stop notice written")
            }
            // Made at start by an agent that knew of notices; an older
            // one's task has none.
            Err(e) => {
                tracing::warn!(task_id, error = %e, "could not write the task's stop notice")
            }
        }
    }

    /// Makes the task's notice directory, the agent's: `user`'s group may
    /// read it (anyone, when the task's user is not known, as a container's
    /// image user), nobody but the agent write it.
    pub(super) fn make_notice_dir(
        &self,
        task_id: &str,
        user: Option<UserIds>,
    ) -> std::io::Result<PathBuf> {
        let root = self.work_dir.join(checkpoint::NOTICE_DIR);
        std::fs::create_dir_all(&root)?;
        // Tasks pass through, without listing the others'.
        set_mode(&root, 0o711)?;
        let dir = self.notice_dir(task_id);
        std::fs::create_dir_all(&dir)?;
        // A notice of an earlier agent process's start of this task goes.
        match std::fs::remove_file(dir.join(notice::FILE)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        match user {
            Some(u) if !u.is_root() => {
                std::os::unix::fs::chown(&dir, None, Some(u.gid))?;
                set_mode(&dir, 0o750)?;
            }
            _ => set_mode(&dir, 0o755)?,
        }
        Ok(dir)
    }
}
