//! simple-framework: a small external framework, the reference client of
//! the gpuctl framework API (docs/framework-api.md).
//!
//! It subscribes, packs N tasks into the offers it receives, prints and
//! acknowledges their status updates, relaunches a task that ends in ERROR
//! or LOST once, and tears itself down when every task has ended. The
//! decisions live in `plan.rs` (pure, tested); this file does the I/O.
//!
//! With several masters only the Raft leader serves: a follower answers
//! `UNAVAILABLE`, naming the leader in the `gpuctl-leader` metadata when it
//! knows it. The framework subscribes at the leader and, when its stream
//! ends or a call is redirected, subscribes again there with its framework
//! id (a failover: it keeps its tasks).

mod plan;

use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, Parser};
use gpuctl_proto::leader::leader_hint;
use gpuctl_proto::pb::{self, event::Event, scheduler_client::SchedulerClient};
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status, Streaming};
use tracing::{debug, warn};

use plan::{Config, OfferControl, Plan};

/// How long one master may take to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Pause between attempts to subscribe again when no master took it, and
/// the least time between two subscriptions (a stream that ends at once
/// must not make a busy loop).
const RESUBSCRIBE_BACKOFF: Duration = Duration::from_secs(1);
/// How long the first subscription waits for a leader to be elected.
const FIRST_SUBSCRIBE_PATIENCE: Duration = Duration::from_secs(15);
/// Redirects followed by one subscription attempt, beyond one try per address.
const FREE_REDIRECTS: usize = 3;
/// Wait for the first event (SUBSCRIBED) at most this long.
const FIRST_EVENT_TIMEOUT: Duration = Duration::from_secs(30);
/// The stream counts as dead after this many heartbeat intervals of silence.
const MISSED_HEARTBEATS: f64 = 3.0;
/// How long the final Teardown may take (looking for the leader included).
const TEARDOWN_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause between Teardown attempts that got no leader hint.
const TEARDOWN_RETRY: Duration = Duration::from_millis(200);

/// Runs TASKS copies of a command on a gpuctl cluster through the framework API.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Masters, HOST:PORT[,HOST:PORT...]; the framework finds their leader.
    #[arg(long, env = "GPUCTL_MASTER", default_value = "127.0.0.1:7050")]
    master: String,
    /// How many tasks to run.
    #[arg(long, default_value_t = 1)]
    tasks: usize,
    /// How many of the tasks (the first ones) need GPUs.
    #[arg(long, default_value_t = 0)]
    gpu_tasks: usize,
    /// GPUs for each GPU task.
    #[arg(long, default_value_t = 1)]
    gpus_per_task: u32,
    /// Each GPU task takes this much (MiB) of a shared GPU's memory
    /// (`gpuctl gpus share`) instead of whole GPUs.
    #[arg(long, value_name = "MIB", default_value_t = 0)]
    gpu_mem: u64,
    /// Container image (default: run the command as a host process).
    #[arg(long)]
    image: Option<String>,
    /// Framework name.
    #[arg(long, default_value = "simple-framework")]
    name: String,
    /// Role to subscribe with.
    #[arg(long, default_value = "default")]
    role: String,
    /// Give up (exit 2) after this many seconds.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// Print the result as JSON on stdout (progress goes to stderr).
    #[arg(long)]
    json: bool,
    /// The command each task runs; $TASK_INDEX tells it which one it is.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error("could not subscribe at any master ({tried}): {last}")]
    Subscribe {
        tried: String,
        last: String,
        /// A master answered that it is not the leader: one may be elected soon.
        no_leader: bool,
    },
    #[error("the master sent an error: {0}")]
    Master(String),
}

/// How a run ended, other than with an error.
enum Ending {
    Done,
    TimedOut,
    Interrupted,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();

    let config = Config {
        tasks: args.tasks,
        gpu_tasks: args.gpu_tasks,
        gpus_per_task: args.gpus_per_task,
        gpu_mem_mib: args.gpu_mem,
        image: args.image.clone().unwrap_or_default(),
        command: args.command.clone(),
    };
    let masters: Vec<String> = args
        .master
        .split(',')
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .map(String::from)
        .collect();
    let usage = config.validate().and_then(|()| match masters.is_empty() {
        true => Err("--master names no address".to_string()),
        false => Ok(()),
    });
    if let Err(message) = usage {
        Args::command()
            .error(clap::error::ErrorKind::ValueValidation, message)
            .exit();
    }

    let mut fw = Framework {
        masters,
        current: 0,
        info: pb::FrameworkInfo {
            id: String::new(),
            name: args.name.clone(),
            roles: vec![args.role.clone()],
            capabilities: vec![pb::FrameworkCapability::GpuResources as i32],
            failover_timeout_secs: 60.0,
        },
        request_id: gpuctl_proto::new_request_id(),
        client: None,
        resubscribe: false,
        plan: Plan::new(config),
        json: args.json,
    };

    let timeout = Duration::from_secs(args.timeout);
    let ending = tokio::select! {
        run = tokio::time::timeout(timeout, fw.run()) => match run {
            Ok(Ok(())) => Ok(Ending::Done),
            Ok(Err(e)) => Err(e),
            Err(_) => Ok(Ending::TimedOut),
        },
        _ = tokio::signal::ctrl_c() => Ok(Ending::Interrupted),
    };
    fw.teardown().await;

    let code = match &ending {
        Ok(Ending::Done) => fw.plan.exit_code(),
        Ok(Ending::TimedOut) => {
            eprintln!("simple-framework: timed out after {} s", args.timeout);
            2
        }
        Ok(Ending::Interrupted) => {
            eprintln!("simple-framework: interrupted");
            130
        }
        Err(e) => {
            eprintln!("simple-framework: {e}");
            1
        }
    };
    fw.say(&fw.plan.summary());
    if args.json {
        println!("{}", fw.json());
    }
    ExitCode::from(code)
}

struct Framework {
    masters: Vec<String>,
    /// Index in `masters` of the master we subscribe at (the leader, once known).
    current: usize,
    /// Our FrameworkInfo; `id` is set once SUBSCRIBED arrives.
    info: pb::FrameworkInfo,
    /// The idempotency key of our first subscription.
    request_id: String,
    /// The master we subscribed at; calls go there too.
    client: Option<SchedulerClient<Channel>>,
    /// A call was redirected: subscribe again, at the leader.
    resubscribe: bool,
    plan: Plan,
    json: bool,
}

impl Framework {
    /// Subscribes, handles events until every task has ended, and subscribes
    /// again (with our framework id, to keep our tasks) if the stream ends:
    /// the master may have lost leadership.
    async fn run(&mut self) -> Result<(), Error> {
        let first_deadline = Instant::now() + FIRST_SUBSCRIBE_PATIENCE;
        let mut events = loop {
            match self.subscribe().await {
                Ok(events) => break events,
                // An election: wait for it rather than give up.
                Err(Error::Subscribe {
                    no_leader: true, ..
                }) if Instant::now() + RESUBSCRIBE_BACKOFF < first_deadline => {
                    debug!("no leader elected yet");
                    tokio::time::sleep(RESUBSCRIBE_BACKOFF).await;
                }
                Err(e) => return Err(e),
            }
        };
        loop {
            let subscribed = Instant::now();
            if self.follow(&mut events).await? {
                return Ok(());
            }
            tokio::time::sleep(RESUBSCRIBE_BACKOFF.saturating_sub(subscribed.elapsed())).await;
            events = loop {
                match self.subscribe().await {
                    Ok(events) => break events,
                    Err(e) => warn!("{e}"),
                }
                tokio::time::sleep(RESUBSCRIBE_BACKOFF).await;
            };
        }
    }

    /// Calls Subscribe, starting at the current master: follows the leader a
    /// redirect names, else tries the next address.
    async fn subscribe(&mut self) -> Result<Streaming<pb::Event>, Error> {
        let mut last = String::from("no address");
        let mut tried: Vec<String> = Vec::new();
        let mut no_leader = false;
        let mut down: Vec<String> = Vec::new();
        let mut i = self.current;
        for _ in 0..self.masters.len() + FREE_REDIRECTS {
            let Some(addr) = self.masters.get(i).cloned() else {
                break;
            };
            if !tried.contains(&addr) {
                tried.push(addr.clone());
            }
            let mut client = match connect(&addr).await {
                Ok(client) => client,
                Err(e) => {
                    last = format!("{addr}: {e}");
                    down.push(addr);
                    i = next_master(&mut self.masters, i, None);
                    continue;
                }
            };
            let request = pb::SubscribeRequest {
                framework: Some(self.info.clone()),
                suppressed: false,
                // Learnt from its launches.
                demand: None,
                // One key for this process's first subscription, however
                // often it is sent: a Subscribe whose answer was lost
                // re-attaches to the framework it made (ignored once the
                // framework has its id).
                request_id: self.request_id.clone(),
            };
            match client.subscribe(request).await {
                Ok(response) => {
                    debug!(master = %addr, "subscribed");
                    self.current = i;
                    self.client = Some(client);
                    return Ok(response.into_inner());
                }
                Err(status) => {
                    last = format!("{addr}: {}", status.message());
                    no_leader |= status.code() == Code::Unavailable;
                    let next = next_master(&mut self.masters, i, Some(&status));
                    // A follower may still name the leader that just died.
                    i = match down.contains(&self.masters[next]) {
                        true => next_master(&mut self.masters, i, None),
                        false => next,
                    };
                }
            }
        }
        Err(Error::Subscribe {
            tried: tried.join(","),
            last,
            no_leader,
        })
    }

    /// After a call failed: a redirect or a master gone means our stream is
    /// at a master that no longer leads; subscribe again (at the leader the
    /// answer names, if any). Returns whether to.
    fn after_call_failure(&mut self, status: &Status) -> bool {
        if status.code() != Code::Unavailable {
            return false;
        }
        if leader_hint(status).is_some() {
            self.current = next_master(&mut self.masters, self.current, Some(status));
        }
        self.resubscribe = true;
        true
    }

    /// Handles events until every task has ended (`true`) or the stream
    /// ends or falls silent (`false`).
    async fn follow(&mut self, events: &mut Streaming<pb::Event>) -> Result<bool, Error> {
        let mut silence = FIRST_EVENT_TIMEOUT;
        loop {
            let event = match tokio::time::timeout(silence, events.message()).await {
                Ok(Ok(Some(event))) => event,
                Ok(Ok(None)) => {
                    warn!("the master closed the event stream");
                    return Ok(false);
                }
                Ok(Err(status)) => {
                    warn!("event stream: {status}");
                    if leader_hint(&status).is_some() {
                        self.current = next_master(&mut self.masters, self.current, Some(&status));
                    }
                    return Ok(false);
                }
                Err(_) => {
                    warn!("no event for {silence:?}");
                    return Ok(false);
                }
            };
            match event.event {
                Some(Event::Subscribed(s)) => {
                    let again = !self.info.id.is_empty();
                    self.info.id = s.framework_id;
                    self.say(&format!("subscribed as framework {}", self.info.id));
                    if let Some(d) =
                        Duration::try_from_secs_f64(s.heartbeat_interval_secs * MISSED_HEARTBEATS)
                            .ok()
                            .filter(|d| !d.is_zero())
                    {
                        silence = d;
                    }
                    if again {
                        self.reconcile().await;
                    }
                }
                Some(Event::Offers(offers)) => self.on_offers(&offers.offers).await,
                // We answer offers as soon as they come and hold none, so
                // there is nothing to forget.
                Some(Event::Rescind(r)) => debug!(offer_id = %r.offer_id, "offer rescinded"),
                // Its tasks are short: the master's kill at the deadline
                // is as good as any.
                Some(Event::InverseOffer(i)) => self.say(&format!(
                    "the master reclaims {} at {} ms: {}",
                    i.task_ids.join(", "),
                    i.deadline_unix_ms,
                    i.reason
                )),
                Some(Event::Update(status)) => self.on_update(status).await,
                Some(Event::Failure(f)) => self.say(&format!("agent {} lost", f.agent_id)),
                Some(Event::Error(message)) => return Err(Error::Master(message)),
                Some(Event::Heartbeat(_)) | None => {}
            }
            if self.plan.is_done() {
                return Ok(true);
            }
            if !self.resubscribe {
                self.control_offers().await;
            }
            if std::mem::take(&mut self.resubscribe) {
                warn!("the master no longer leads; subscribing again");
                return Ok(false);
            }
        }
    }

    async fn on_offers(&mut self, offers: &[pb::Offer]) {
        let Some(mut client) = self.client.clone() else {
            return;
        };
        let decision = self.plan.on_offers(offers);
        for (offer_id, tasks) in decision.accepts {
            let task_ids: Vec<String> = tasks.iter().map(|t| t.task_id.clone()).collect();
            for t in &tasks {
                let gpus = match t.gpu_uuids.is_empty() {
                    true => String::new(),
                    false => format!(" with {}", t.gpu_uuids.join(",")),
                };
                self.say(&format!("{} launching on {}{gpus}", t.task_id, t.agent_id));
            }
            let request = pb::AcceptRequest {
                framework_id: self.info.id.clone(),
                offer_ids: vec![offer_id.clone()],
                operations: vec![pb::Operation {
                    operation: Some(pb::operation::Operation::Launch(pb::Launch { tasks })),
                }],
                filters: Some(pb::Filters {
                    refuse_seconds: Some(plan::ACCEPT_REFUSE_SECS),
                }),
            };
            if let Err(status) = client.accept(request).await {
                warn!(%offer_id, "Accept failed, the tasks wait for another offer: {status}");
                self.plan.launch_failed(&task_ids);
                if self.after_call_failure(&status) {
                    // The offers came from a master that no longer leads.
                    return;
                }
            }
        }
        if !decision.declines.is_empty() {
            let request = pb::DeclineRequest {
                framework_id: self.info.id.clone(),
                offer_ids: decision.declines,
                filters: Some(pb::Filters {
                    refuse_seconds: Some(plan::DECLINE_REFUSE_SECS),
                }),
            };
            if let Err(status) = client.decline(request).await {
                warn!("Decline failed: {status}");
                self.after_call_failure(&status);
            }
        }
    }

    async fn on_update(&mut self, status: pb::TaskStatus) {
        let outcome = self.plan.on_update(&status);
        self.say(&outcome.line);
        let Some(mut client) = self.client.clone() else {
            return;
        };
        if outcome.ack {
            let request = pb::AcknowledgeRequest {
                framework_id: self.info.id.clone(),
                agent_id: status.agent_id,
                task_id: status.task_id,
                uuid: status.uuid,
            };
            // If this fails the agent resends the update, and we ack it then.
            if let Err(status) = client.acknowledge(request).await {
                warn!("Acknowledge failed: {status}");
                self.after_call_failure(&status);
            }
        }
    }

    /// Suppresses offers when nothing waits for one; revives them for a relaunch.
    async fn control_offers(&mut self) {
        let Some(mut client) = self.client.clone() else {
            return;
        };
        let (framework_id, roles) = (self.info.id.clone(), self.info.roles.clone());
        let result = match self.plan.offer_control() {
            None => return,
            Some(OfferControl::Suppress) => client
                .suppress(pb::SuppressRequest {
                    framework_id,
                    roles,
                })
                .await
                .map(drop),
            Some(OfferControl::Revive) => client
                .revive(pb::ReviveRequest {
                    framework_id,
                    roles,
                    demand: None,
                })
                .await
                .map(drop),
        };
        if let Err(status) = result {
            warn!("Suppress/Revive failed (retried on the next event): {status}");
            self.plan.offer_flow_unknown();
            self.after_call_failure(&status);
        }
    }

    /// After subscribing again: asks for the latest state of all our tasks
    /// (implicit reconciliation) and for offers again if something waits.
    async fn reconcile(&mut self) {
        self.plan.offer_flow_unknown();
        let Some(mut client) = self.client.clone() else {
            return;
        };
        let request = pb::ReconcileRequest {
            framework_id: self.info.id.clone(),
            tasks: Vec::new(),
        };
        if let Err(status) = client.reconcile(request).await {
            warn!("Reconcile failed: {status}");
            self.after_call_failure(&status);
        }
    }

    /// Removes the framework (the master kills whatever still runs). When
    /// the master we are subscribed at no longer leads or is gone, the
    /// leader is looked for: left behind, the framework's tasks would run
    /// until its failover timeout.
    async fn teardown(&mut self) {
        let Some(client) = self.client.clone() else {
            return;
        };
        if self.info.id.is_empty() {
            return;
        }
        let deadline = Instant::now() + TEARDOWN_TIMEOUT;
        let mut client = Some(client);
        let mut i = self.current;
        let mut last = String::from("no master answered");
        while Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(addr) = self.masters.get(i).cloned() else {
                break;
            };
            let mut c = match client.take() {
                Some(c) => c,
                None => match tokio::time::timeout(left, connect(&addr)).await {
                    Ok(Ok(c)) => c,
                    Ok(Err(e)) => {
                        last = format!("{addr}: {e}");
                        i = next_master(&mut self.masters, i, None);
                        tokio::time::sleep(TEARDOWN_RETRY.min(left)).await;
                        continue;
                    }
                    Err(_) => break,
                },
            };
            let request = pb::TeardownRequest {
                framework_id: self.info.id.clone(),
            };
            let status = match tokio::time::timeout(left, c.teardown(request)).await {
                Ok(Ok(_)) => {
                    debug!(master = %addr, "torn down");
                    return;
                }
                Ok(Err(status)) => status,
                Err(_) => break,
            };
            // Not the leader (now), or the connection broke: ask another.
            let elsewhere =
                status.code() == Code::Unavailable || std::error::Error::source(&status).is_some();
            if !elsewhere {
                warn!("Teardown failed: {status}");
                return;
            }
            last = format!("{addr}: {}", status.message());
            let redirected = leader_hint(&status).is_some();
            i = next_master(&mut self.masters, i, Some(&status));
            if !redirected {
                tokio::time::sleep(TEARDOWN_RETRY.min(left)).await;
            }
        }
        warn!("Teardown failed within {TEARDOWN_TIMEOUT:?}: {last}");
    }

    /// Progress goes to stdout, or to stderr when stdout carries the JSON.
    fn say(&self, line: &str) {
        if self.json {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    }

    fn json(&self) -> serde_json::Value {
        let tasks: Vec<serde_json::Value> = self
            .plan
            .tasks()
            .iter()
            .map(|t| {
                serde_json::json!({
                    "id": t.id(),
                    "state": t.state_name(),
                    "exit_code": t.exit_code,
                    "agent_id": t.agent_id,
                    "gpus": t.gpus,
                })
            })
            .collect();
        serde_json::json!({ "framework_id": self.info.id, "tasks": tasks })
    }
}

/// Connects to one master.
async fn connect(addr: &str) -> Result<SchedulerClient<Channel>, String> {
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| e.to_string())?
        .connect_timeout(CONNECT_TIMEOUT);
    match endpoint.connect().await {
        Ok(channel) => Ok(SchedulerClient::new(channel)),
        Err(e) => Err(with_sources(&e)),
    }
}

/// Where to subscribe after `masters[current]` failed with `status`: at the
/// leader the answer names (added to the list if new), else at the next
/// address. Returns its index.
fn next_master(masters: &mut Vec<String>, current: usize, status: Option<&Status>) -> usize {
    let hint = status
        .and_then(leader_hint)
        .filter(|h| is_host_port(h) && masters.get(current) != Some(h));
    if let Some(leader) = hint {
        return match masters.iter().position(|m| *m == leader) {
            Some(i) => i,
            None => {
                masters.push(leader);
                masters.len() - 1
            }
        };
    }
    (current + 1) % masters.len().max(1)
}

/// `HOST:PORT` with a usable port: a bad hint must not join the list.
fn is_host_port(s: &str) -> bool {
    matches!(s.rsplit_once(':'), Some((host, port))
        if !host.is_empty() && !host.contains('/') && port.parse::<u16>().is_ok_and(|p| p != 0))
}

/// `e: its source: its source's source...` (tonic's transport errors say
/// little more than "transport error" on their own).
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuctl_proto::leader::not_leader;

    fn list(addrs: &[&str]) -> Vec<String> {
        addrs.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn follows_the_named_leader_else_the_next_address() {
        let mut m = list(&["m1:1", "m2:1", "m3:1"]);
        assert_eq!(
            next_master(&mut m, 0, Some(&not_leader(Some((3, "m3:1"))))),
            2
        );
        assert_eq!(next_master(&mut m, 0, Some(&not_leader(None))), 1);
        assert_eq!(next_master(&mut m, 2, None), 0);
        // A leader not in --master joins the list.
        assert_eq!(
            next_master(&mut m, 1, Some(&not_leader(Some((4, "m4:1"))))),
            3
        );
        assert_eq!(m, list(&["m1:1", "m2:1", "m3:1", "m4:1"]));
        // A hint naming the refusing master itself, or no HOST:PORT, is ignored.
        assert_eq!(
            next_master(&mut m, 0, Some(&not_leader(Some((1, "m1:1"))))),
            1
        );
        assert_eq!(
            next_master(&mut m, 0, Some(&not_leader(Some((1, "junk"))))),
            1
        );
        assert_eq!(m.len(), 4);
    }
}
