//! A container followed to its end: observed, waited for through daemon outages, and an end blamed on a restart of Docker itself.

use super::*;

impl DockerRuntime {
    pub(super) async fn observe_task(&self, task: &TaskRef) -> Result<Observed, RuntimeError> {
        let name = container_name(&task.agent_id, &task.task_id);
        let info = match self.client()?.inspect_container(&name, None).await {
            Ok(i) => i,
            Err(e) if is_not_found(&e) => return Ok(Observed::NotStarted),
            Err(e) => return Err(self.err(e)),
        };
        self.set_health(true, String::new());
        if let Some(id) = &info.id {
            record_container_id(&task.state_dir, id);
        }
        let state = info.state.unwrap_or_default();
        Ok(match state.status {
            Some(ContainerStateStatusEnum::CREATED) | None => Observed::NotStarted,
            Some(ContainerStateStatusEnum::EXITED | ContainerStateStatusEnum::DEAD) => {
                Observed::Ended(Ended {
                    code: state.exit_code.map(|c| i32::try_from(c).unwrap_or(-1)),
                    // Stopped by its fence watcher.
                    fenced: task.state_dir.join(fence::FENCED_FILE).exists(),
                    error: None,
                    // Docker knows only the code (128 + signal) of a kill.
                    signal: None,
                    oom_killed: state.oom_killed.unwrap_or(false),
                    runtime_restarted: false,
                })
            }
            Some(_) => Observed::Running,
        })
    }

    /// A container that ended by a SIGTERM or SIGKILL (exit 143 or 137,
    /// through docker-init) that Docker recorded at or after `since`, when
    /// this agent saw the daemon down, was stopped by the restarted daemon:
    /// dockerd without live-restore stops the containers still running when
    /// it starts. (A task that exits 143 on its own during the outage reads
    /// the same: the agent cannot tell the two apart, and says so.)
    pub(super) async fn blame_restart(&self, name: &str, mut ended: Ended, since: i64) -> Ended {
        if !matches!(ended.code, Some(137 | 143)) {
            return ended;
        }
        let finished = match self.client() {
            Ok(c) => c
                .inspect_container(name, None)
                .await
                .ok()
                .and_then(|i| i.state?.finished_at)
                .and_then(|t| logs::timestamp_secs(&t)),
            Err(_) => None,
        };
        if finished.is_some_and(|f| f >= since) {
            tracing::info!(container = %name, code = ?ended.code, "container stopped by the Docker daemon's restart");
            ended.runtime_restarted = true;
        }
        ended
    }

    /// Follows the container to its end, copying its output to the log,
    /// through any number of daemon restarts.
    pub(super) async fn wait_task(&self, task: &TaskRef) -> Result<Ended, RuntimeError> {
        let name = container_name(&task.agent_id, &task.task_id);
        let mut backoff = Backoff::new(OUTAGE_BACKOFF_MIN, OUTAGE_BACKOFF_MAX);
        // Aborted if this future is dropped: one copy of the output at a time.
        let mut pump: Option<AbortOnDrop> = None;
        // When this wait first found the daemon down (seconds since the
        // epoch): a kill recorded after it is the restarted daemon's.
        let mut outage_since: Option<i64> = None;
        let ended = loop {
            match self.observe_task(task).await {
                Ok(Observed::Ended(e)) => {
                    break match outage_since {
                        Some(since) => self.blame_restart(&name, e, since).await,
                        None => e,
                    }
                }
                Ok(Observed::NotStarted) => {
                    break Ended {
                        code: None,
                        fenced: false,
                        error: Some(format!("container {name} vanished")),
                        ..Default::default()
                    }
                }
                Ok(Observed::Running) => {
                    backoff.reset();
                    if pump.is_none() {
                        // A reattached container gets its watcher back if
                        // it died with the old agent's process group.
                        self.ensure_fence_watcher(&task.state_dir);
                    }
                    if pump.as_ref().is_none_or(|p| p.0.is_finished()) {
                        pump = Some(AbortOnDrop(tokio::spawn(pump_logs(
                            self.clone(),
                            name.clone(),
                            task.clone(),
                        ))));
                    }
                    // The answer only comes when the container stops, but
                    // headers are sent at once, so the request timeout does
                    // not cut long tasks short.
                    let mut wait = self.client()?.wait_container(
                        &name,
                        Some(WaitContainerOptions {
                            condition: "not-running",
                        }),
                    );
                    match wait.next().await {
                        Some(Ok(_)) | None => {}
                        // A non-zero exit comes as an error; not one for us.
                        Some(Err(BollardError::DockerContainerWaitError { .. })) => {}
                        Some(Err(e)) if is_outage(&e) => {
                            let _ = self.err(e);
                            outage_since.get_or_insert_with(unix_secs);
                            tokio::time::sleep(backoff.next_wait()).await;
                        }
                        Some(Err(e)) if is_not_found(&e) => {}
                        Some(Err(e)) => {
                            tracing::warn!(container = %name, error = %e, "waiting for the container failed; looking again");
                            tokio::time::sleep(backoff.next_wait()).await;
                        }
                    }
                }
                Err(e) if e.is_unavailable() => {
                    outage_since.get_or_insert_with(unix_secs);
                    tokio::time::sleep(backoff.next_wait()).await;
                }
                Err(e) => return Err(e),
            }
        };
        // Copy what is left of the output (all of it after a reattach whose
        // copy was not running).
        let mut pump = match pump {
            Some(p) if !p.0.is_finished() => p,
            _ => AbortOnDrop(tokio::spawn(pump_logs(
                self.clone(),
                name.clone(),
                task.clone(),
            ))),
        };
        match tokio::time::timeout(LOG_DRAIN_TIMEOUT, &mut pump.0).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => {
                tracing::warn!(task_id = %task.task_id, error = %e, "copying container output failed")
            }
            Ok(Err(e)) => tracing::warn!(task_id = %task.task_id, error = %e, "log pump panicked"),
            Err(_) => tracing::warn!(
                task_id = %task.task_id,
                "container output still flowing after exit; log cut short"
            ),
        }
        Ok(ended)
    }
}
