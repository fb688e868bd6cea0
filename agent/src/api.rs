//! AgentApi: what the master asks of this agent directly (task output).

use gpuctl_proto::invalid_argument;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use gpuctl_proto::pb;
use tokio::io::AsyncReadExt;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use crate::executor::{Executor, LOG_FILE};

const CHUNK: usize = 32 * 1024;
/// How often a follower looks for new output when nothing else wakes it.
const POLL: Duration = Duration::from_millis(200);
const WAIT_FOR_START: Duration = Duration::from_secs(60);

pub struct AgentApiService {
    pub executor: Arc<Executor>,
    /// With TLS: only masters (which check the caller's tenant) may read
    /// task output.
    pub masters_only: bool,
}

type LogStream = Pin<Box<dyn Stream<Item = Result<pb::TaskLogChunk, Status>> + Send>>;

#[tonic::async_trait]
impl pb::agent_api_server::AgentApi for AgentApiService {
    type TaskLogsStream = LogStream;

    async fn task_logs(
        &self,
        req: Request<pb::TaskLogsRequest>,
    ) -> Result<Response<Self::TaskLogsStream>, Status> {
        if self.masters_only {
            match gpuctl_auth::peer::identity(req.extensions()) {
                Some(Ok(id)) if id.role == gpuctl_auth::CertRole::Master => {}
                Some(Ok(id)) => {
                    return Err(Status::permission_denied(format!(
                        "a {} certificate cannot read task output (masters only)",
                        id.role
                    )))
                }
                _ => {
                    return Err(Status::unauthenticated(
                        "task output needs a master certificate of this cluster",
                    ))
                }
            }
        }
        let req = req.into_inner();
        // The id becomes a path: only plain identifiers, never "../x".
        gpuctl_core::convert::check_id("task_id", &req.task_id).map_err(invalid_argument)?;
        let exec = self.executor.clone();
        let path = exec.sandbox(&req.task_id).join(LOG_FILE);
        if !req.follow && !exec.is_active(&req.task_id) && !path.exists() {
            return Err(Status::not_found(format!(
                "no output for task {} on this agent",
                req.task_id
            )));
        }
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            if let Err(s) = pump(&exec, &req.task_id, &path, req.follow, &tx).await {
                let _ = tx.send(Err(s)).await;
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// Opens a task's log for reading. A host-process task's user owns its
/// sandbox and could put a symlink (to /etc/shadow, say) or a FIFO where
/// the log was, or a hard link to a file it cannot read itself: the agent,
/// root, must not read through those. `None` for anything but a plain file
/// with one name.
async fn open_log(path: &std::path::Path) -> Option<tokio::fs::File> {
    use std::os::unix::fs::MetadataExt;
    let file = tokio::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
        .await
        .ok()?;
    let md = file.metadata().await.ok()?;
    if md.is_file() && md.nlink() == 1 {
        Some(file)
    } else {
        tracing::warn!(path = %path.display(), "a task's log is not a plain file: not served");
        None
    }
}

/// Copies the log file to the stream; when following, keeps going until the
/// task has ended and the file is read to its end.
async fn pump(
    exec: &Executor,
    task_id: &str,
    path: &std::path::Path,
    follow: bool,
    tx: &mpsc::Sender<Result<pb::TaskLogChunk, Status>>,
) -> Result<(), Status> {
    let mut ended = exec.task_ended_watch();
    // A follower may ask before this agent has received the task.
    let deadline = tokio::time::Instant::now() + WAIT_FOR_START;
    let mut file = None;
    let mut buf = vec![0u8; CHUNK];
    loop {
        // Read the state before reading the file: if the task had ended
        // already, what we read next is all there will ever be.
        let active = exec.is_active(task_id);
        if file.is_none() {
            file = open_log(path).await;
        }
        if let Some(f) = file.as_mut() {
            loop {
                let n = f
                    .read(&mut buf)
                    .await
                    .map_err(|e| Status::internal(format!("read {}: {e}", path.display())))?;
                if n == 0 {
                    break;
                }
                let chunk = pb::TaskLogChunk {
                    data: buf[..n].to_vec(),
                };
                if tx.send(Ok(chunk)).await.is_err() {
                    return Ok(()); // the reader went away
                }
            }
        }
        if !follow {
            return Ok(());
        }
        if !active {
            if file.is_some() || exec.has_ended(task_id) {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(Status::not_found(format!(
                    "task {task_id} did not start on this agent"
                )));
            }
        }
        tokio::select! {
            _ = ended.changed() => {}
            _ = tokio::time::sleep(POLL) => {}
            _ = tx.closed() => return Ok(()),
        }
    }
}
