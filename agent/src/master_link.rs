//! The agent's side of the master connection: register, heartbeat, watch the
//! desired tasks, and deliver status updates reliably.
//!
//! Any failure sends the agent back to registration (with backoff), which is
//! idempotent: it lists the tasks still running here so the master keeps
//! them. Status updates are queued and sent one at a time, in order, until
//! the master acknowledges each (it does so once the update is committed).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use gpuctl_proto::pb;
use gpuctl_proto::pb::agent_manager_client::AgentManagerClient;
use gpuctl_proto::types::{AgentInfo, StatusUpdate, TaskSpec};
use tokio::sync::{mpsc, watch};
use tonic::transport::{Channel, Endpoint};

use crate::executor::Executor;

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const RPC_TIMEOUT: Duration = Duration::from_secs(10);

/// The masters this agent knows, and which one it talks to now.
pub struct Masters {
    addrs: Vec<String>,
    current: Mutex<(usize, Option<Channel>)>,
}

impl Masters {
    pub fn new(addrs: Vec<String>) -> Masters {
        Masters {
            addrs,
            current: Mutex::new((0, None)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, Option<Channel>)> {
        self.current.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn current_addr(&self) -> String {
        let i = self.lock().0;
        self.addrs.get(i).cloned().unwrap_or_default()
    }

    /// A client for the current master (the channel reconnects by itself).
    pub fn client(&self) -> Result<AgentManagerClient<Channel>, String> {
        let mut cur = self.lock();
        if let Some(ch) = &cur.1 {
            return Ok(AgentManagerClient::new(ch.clone()));
        }
        let addr = self.addrs.get(cur.0).cloned().unwrap_or_default();
        let ch = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| format!("master address {addr:?}: {e}"))?
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(RPC_TIMEOUT)
            .connect_lazy();
        cur.1 = Some(ch.clone());
        Ok(AgentManagerClient::new(ch))
    }

    /// Moves on to the next master address (after a failure).
    pub fn rotate(&self) {
        let mut cur = self.lock();
        if self.addrs.len() > 1 {
            cur.0 = (cur.0 + 1) % self.addrs.len();
            cur.1 = None;
        }
    }
}

fn next_backoff(b: Duration) -> Duration {
    (b * 2).min(BACKOFF_MAX)
}

/// Registration, heartbeats and the desired-task watch, until shutdown.
pub async fn run(
    masters: Arc<Masters>,
    info: AgentInfo,
    executor: Arc<Executor>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut backoff = BACKOFF_MIN;
    loop {
        if *shutdown.borrow() {
            return;
        }
        let result = tokio::select! {
            r = session(&masters, &info, &executor) => r,
            _ = shutdown.changed() => return,
        };
        if let Err(e) = result {
            tracing::warn!(master = %masters.current_addr(), error = %e, retry_in_ms = backoff.as_millis() as u64, "master connection failed");
            masters.rotate();
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = shutdown.changed() => return,
            }
            backoff = next_backoff(backoff);
        } else {
            backoff = BACKOFF_MIN;
        }
    }
}

/// One registration and what follows it; returns on the first failure.
async fn session(
    masters: &Masters,
    info: &AgentInfo,
    executor: &Arc<Executor>,
) -> Result<(), String> {
    let mut client = masters.client()?;
    let mut req = pb::RegisterRequest {
        agent_id: info.id.clone(),
        hostname: info.hostname.clone(),
        address: info.address.clone(),
        total: Some(info.total.into()),
        gpus: info.gpus.iter().cloned().map(Into::into).collect(),
        runtimes: info
            .runtimes
            .iter()
            .map(|r| pb::Runtime::from(*r) as i32)
            .collect(),
        running_task_ids: executor.known_task_ids(),
        simulated_gpus: info.simulated_gpus,
        attributes: info.attributes.clone().into_iter().collect(),
        driver_version: info.driver_version.clone().unwrap_or_default(),
        cuda_driver_version: info.cuda_driver_version.clone().unwrap_or_default(),
    };
    req.running_task_ids.sort();
    let resp = client
        .register(req)
        .await
        .map_err(|s| format!("register: {}", s.message()))?
        .into_inner();
    let interval = Duration::from_millis(u64::from(resp.heartbeat_interval_ms.max(100)));
    tracing::info!(master = %masters.current_addr(), agent_id = %info.id, "registered with master");

    let mut watch = client
        .watch_tasks(pb::WatchTasksRequest {
            agent_id: info.id.clone(),
        })
        .await
        .map_err(|s| format!("watch tasks: {}", s.message()))?
        .into_inner();
    let mut heartbeat = tokio::time::interval(interval);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            msg = watch.next() => match msg {
                Some(Ok(desired)) => {
                    let mut tasks = Vec::with_capacity(desired.tasks.len());
                    for t in desired.tasks {
                        match TaskSpec::try_from(t) {
                            Ok(t) => tasks.push(t),
                            // Skipping a bad spec would make the executor
                            // kill the task if it were running; better to
                            // fail loudly and retry the whole session.
                            Err(e) => return Err(format!("master sent an invalid task: {e}")),
                        }
                    }
                    executor.reconcile(tasks, desired.kill);
                }
                Some(Err(s)) => return Err(format!("watch tasks: {}", s.message())),
                None => return Err("watch tasks: stream ended".into()),
            },
            _ = heartbeat.tick() => {
                client
                    .heartbeat(pb::HeartbeatRequest { agent_id: info.id.clone() })
                    .await
                    .map_err(|s| format!("heartbeat: {}", s.message()))?;
            }
        }
    }
}

/// How often an update waiting for its framework's acknowledgement is
/// offered again (the answer says when it has been acknowledged).
const ACK_POLL: Duration = Duration::from_millis(500);

/// Sends status updates in order per task, each until it is acknowledged
/// (gpuctl's own jobs: once recorded; a framework's task: once its framework
/// acknowledged it), Mesos' status update manager in small. Updates of
/// different tasks do not wait for each other. Returns once the channel is
/// closed and nothing is pending (the caller bounds that wait at shutdown).
pub async fn status_sender(masters: Arc<Masters>, mut rx: mpsc::Receiver<StatusUpdate>) {
    let mut queues: BTreeMap<String, VecDeque<StatusUpdate>> = BTreeMap::new();
    let mut backoff = BACKOFF_MIN;
    let mut closed = false;
    loop {
        while let Ok(u) = rx.try_recv() {
            queues.entry(u.task_id.clone()).or_default().push_back(u);
        }
        if queues.is_empty() {
            if closed {
                return;
            }
            match rx.recv().await {
                Some(u) => queues.entry(u.task_id.clone()).or_default().push_back(u),
                None => return,
            }
            continue;
        }
        let mut progress = false;
        let mut unreachable = false;
        for queue in queues.values_mut() {
            let Some(update) = queue.front() else {
                continue;
            };
            let result = match masters.client() {
                Ok(mut c) => {
                    c.update_status(pb::StatusUpdate::from(update.clone()))
                        .await
                }
                Err(e) => Err(tonic::Status::unavailable(e)),
            };
            match result {
                Ok(ack) if ack.get_ref().acknowledged => {
                    queue.pop_front();
                    progress = true;
                }
                // Recorded; its framework has not acknowledged it yet.
                Ok(_) => {}
                Err(s)
                    if matches!(
                        s.code(),
                        tonic::Code::InvalidArgument
                            | tonic::Code::FailedPrecondition
                            | tonic::Code::NotFound
                    ) =>
                {
                    // The master will never accept it; retrying would block
                    // the task's later updates.
                    tracing::warn!(task_id = %update.task_id, error = %s.message(), "status update refused; dropped");
                    queue.pop_front();
                    progress = true;
                }
                Err(s) => {
                    tracing::debug!(task_id = %update.task_id, error = %s.message(), "status update not delivered; retrying");
                    unreachable = true;
                    break;
                }
            }
        }
        queues.retain(|_, q| !q.is_empty());
        if progress {
            backoff = BACKOFF_MIN;
            continue;
        }
        let wait = if unreachable {
            let b = backoff;
            backoff = next_backoff(backoff);
            b
        } else {
            ACK_POLL
        };
        tokio::select! {
            u = rx.recv(), if !closed => match u {
                Some(u) => queues.entry(u.task_id.clone()).or_default().push_back(u),
                None => closed = true,
            },
            _ = tokio::time::sleep(wait) => {}
        }
    }
}
