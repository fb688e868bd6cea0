//! Job and task logs, relayed from agents line by line.

use super::*;

/// A line longer than this is sent in pieces.
pub(super) const MAX_LINE: usize = 64 * 1024;
/// A partial line waits this long for its end before it is sent as is (a
/// progress bar redrawn with `\r` never ends its line).
pub(super) const PARTIAL_LINE_WAIT: Duration = Duration::from_millis(500);

/// Copies one task's output into a job's log stream. With several tasks,
/// in whole lines, so that their outputs interleave by line; with one, as
/// it comes.
pub(super) struct LogRelay {
    tx: mpsc::Sender<Result<pb::LogChunk, Status>>,
    task_id: String,
    rank: u32,
    tasks: u32,
}

impl LogRelay {
    fn chunk(&self, data: Vec<u8>) -> pb::LogChunk {
        pb::LogChunk {
            data,
            task_id: self.task_id.clone(),
            rank: self.rank,
            tasks: self.tasks,
        }
    }

    async fn send(&self, data: Vec<u8>) -> bool {
        data.is_empty() || self.tx.send(Ok(self.chunk(data))).await.is_ok()
    }

    async fn run(
        self,
        mut upstream: tonic::Streaming<pb::TaskLogChunk>,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) {
        let by_line = self.tasks > 1;
        let mut partial: Vec<u8> = Vec::new();
        loop {
            // A follower must not hold up the master's shutdown.
            let item = tokio::select! {
                item = upstream.next() => item,
                _ = tokio::time::sleep(PARTIAL_LINE_WAIT), if !partial.is_empty() => {
                    if !self.send(std::mem::take(&mut partial)).await {
                        return;
                    }
                    continue;
                }
                _ = shutdown.changed() => return,
            };
            let data = match item {
                Some(Ok(c)) => c.data,
                Some(Err(status)) => {
                    let _ = self.send(std::mem::take(&mut partial)).await;
                    let _ = self.tx.send(Err(status)).await;
                    return;
                }
                None => break,
            };
            if !by_line {
                if !self.send(data).await {
                    return;
                }
                continue;
            }
            partial.extend_from_slice(&data);
            let whole = match partial.iter().rposition(|b| *b == b'\n') {
                Some(i) => i + 1,
                None if partial.len() >= MAX_LINE => partial.len(),
                None => 0,
            };
            if whole > 0 {
                let rest = partial.split_off(whole);
                if !self.send(std::mem::replace(&mut partial, rest)).await {
                    return;
                }
            }
        }
        let _ = self.send(partial).await;
    }
}

impl OperatorService {
    pub(super) async fn job_logs(
        &self,
        caller: &Caller,
        req: pb::JobLogsRequest,
    ) -> Result<LogStream, ServiceError> {
        job_id_arg(&req.job_id)?;
        if req.attempt == Some(0) {
            return Err(ConvertError::new("attempt", "attempts count from 1").into());
        }
        self.check_job_access(caller, &req.job_id)?;
        let raft = self.ctx.raft.clone();
        let job_id = req.job_id.clone();
        // The attempt's tasks and their agents; with --follow wait until
        // that attempt is placed.
        let mut applied = raft.applied();
        let tasks: Vec<(u32, String, String)> = loop {
            {
                let state = raft.state();
                let job = state
                    .job(&job_id)
                    .ok_or_else(|| ServiceError::job_not_found(&state, &job_id))?;
                let attempts = state.attempts(&job_id);
                let chosen = match req.attempt {
                    Some(n) => attempts.get(n as usize - 1),
                    None => attempts.last(),
                };
                if let Some(tasks) = chosen {
                    let picked: Vec<(u32, String, String)> = tasks
                        .iter()
                        .filter(|t| req.rank.is_none_or(|r| r == t.rank))
                        .map(|t| {
                            let addr = state
                                .agent(&t.agent_id)
                                .map(|a| a.info.address.clone())
                                .unwrap_or_default();
                            (t.rank, t.id.clone(), addr)
                        })
                        .collect();
                    if picked.is_empty() {
                        return Err(ConvertError::new(
                            "rank",
                            format!(
                                "job {job_id} has ranks 0 to {} in that attempt",
                                tasks.len().saturating_sub(1)
                            ),
                        )
                        .into());
                    }
                    break picked;
                }
                if job.state.is_terminal() {
                    return match req.attempt {
                        Some(n) => Err(ConvertError::new(
                            "attempt",
                            format!(
                                "job {job_id} ended after {} attempt(s), not {n}",
                                attempts.len()
                            ),
                        )
                        .into()),
                        None => Ok(Box::pin(futures::stream::empty())),
                    };
                }
                if !req.follow {
                    return Err(ServiceError::JobNotStarted { job_id });
                }
            }
            if applied.changed().await.is_err() {
                return Err(ServiceError::ShuttingDown);
            }
        };
        let count = tasks.len() as u32;
        let upstreams =
            futures::future::try_join_all(tasks.into_iter().map(|(rank, task_id, address)| {
                self.task_logs(rank, task_id, address, req.follow)
            }))
            .await?;
        let (tx, rx) = mpsc::channel(16);
        for (rank, task_id, upstream) in upstreams {
            let relay = LogRelay {
                tx: tx.clone(),
                task_id,
                rank,
                tasks: count,
            };
            tokio::spawn(relay.run(upstream, self.ctx.shutdown.clone()));
        }
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }

    /// Opens one task's output at its agent.
    pub(super) async fn task_logs(
        &self,
        rank: u32,
        task_id: String,
        address: String,
        follow: bool,
    ) -> Result<(u32, String, tonic::Streaming<pb::TaskLogChunk>), ServiceError> {
        if address.is_empty() {
            // Not a master problem: another master would not do better.
            return Err(ServiceError::NoLogAddress { task_id });
        }
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
            .map_err(|source| ServiceError::AgentAddress {
                address: address.clone(),
                source,
            })?
            .connect_timeout(Duration::from_secs(5));
        // The agent must hold an agent certificate (checked by the
        // connector); it checks ours is a master's.
        let channel =
            gpuctl_auth::tls::connect(&endpoint, self.ctx.tls(), gpuctl_auth::CertRole::Agent)
                .await
                .map_err(|source| ServiceError::AgentUnreachable {
                    address: address.clone(),
                    source,
                })?;
        let mut client = pb::agent_api_client::AgentApiClient::new(channel);
        let upstream = client
            .task_logs(pb::TaskLogsRequest {
                task_id: task_id.clone(),
                follow,
            })
            .await
            .map_err(ServiceError::Relayed)?
            .into_inner();
        Ok((rank, task_id, upstream))
    }
}
