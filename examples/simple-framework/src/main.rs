//! simple-framework: a small external framework, the reference client of
//! the gpuctl framework API (docs/framework-api.md).
//!
//! It subscribes, packs N tasks into the offers it receives, prints and
//! acknowledges their status updates, relaunches a task that ends in ERROR
//! or LOST once, and tears itself down when every task has ended. The
//! decisions live in `plan.rs` (pure, tested); this file does the I/O.

mod plan;

use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, Parser};
use gpuctl_proto::pb::{self, event::Event, scheduler_client::SchedulerClient};
use tonic::transport::{Channel, Endpoint};
use tonic::Streaming;
use tracing::{debug, warn};

use plan::{Config, OfferControl, Plan};

/// How long one master may take to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Pause between attempts to subscribe again after the stream ended.
const RESUBSCRIBE_BACKOFF: Duration = Duration::from_secs(1);
/// Wait for the first event (SUBSCRIBED) at most this long.
const FIRST_EVENT_TIMEOUT: Duration = Duration::from_secs(30);
/// The stream counts as dead after this many heartbeat intervals of silence.
const MISSED_HEARTBEATS: f64 = 3.0;
/// How long the final Teardown may take.
const TEARDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs TASKS copies of a command on a gpuctl cluster through the framework API.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Masters, HOST:PORT[,HOST:PORT...]; the first that answers is used.
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
    Subscribe { tried: String, last: String },
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
        info: pb::FrameworkInfo {
            id: String::new(),
            name: args.name.clone(),
            roles: vec![args.role.clone()],
            capabilities: vec![pb::FrameworkCapability::GpuResources as i32],
            failover_timeout_secs: 60.0,
        },
        client: None,
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
    /// Our FrameworkInfo; `id` is set once SUBSCRIBED arrives.
    info: pb::FrameworkInfo,
    /// The master we subscribed at; calls go there too.
    client: Option<SchedulerClient<Channel>>,
    plan: Plan,
    json: bool,
}

impl Framework {
    /// Subscribes, handles events until every task has ended, and subscribes
    /// again (with our framework id, to keep our tasks) if the stream ends.
    async fn run(&mut self) -> Result<(), Error> {
        let mut events = self.subscribe().await?;
        while !self.follow(&mut events).await? {
            events = loop {
                tokio::time::sleep(RESUBSCRIBE_BACKOFF).await;
                match self.subscribe().await {
                    Ok(events) => break events,
                    Err(e) => warn!("{e}"),
                }
            };
        }
        Ok(())
    }

    /// Calls Subscribe at the first master that answers.
    async fn subscribe(&mut self) -> Result<Streaming<pb::Event>, Error> {
        let mut last = String::from("no address");
        for addr in &self.masters {
            let endpoint = match Endpoint::from_shared(format!("http://{addr}")) {
                Ok(e) => e.connect_timeout(CONNECT_TIMEOUT),
                Err(e) => {
                    last = format!("{addr}: {e}");
                    continue;
                }
            };
            let mut client = match endpoint.connect().await {
                Ok(channel) => SchedulerClient::new(channel),
                Err(e) => {
                    last = format!("{addr}: {}", with_sources(&e));
                    continue;
                }
            };
            let request = pb::SubscribeRequest {
                framework: Some(self.info.clone()),
            };
            match client.subscribe(request).await {
                Ok(response) => {
                    debug!(master = %addr, "subscribed");
                    self.client = Some(client);
                    return Ok(response.into_inner());
                }
                Err(status) => last = format!("{addr}: {}", status.message()),
            }
        }
        Err(Error::Subscribe {
            tried: self.masters.join(","),
            last,
        })
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
                Some(Event::Update(status)) => self.on_update(status).await,
                Some(Event::Failure(f)) => self.say(&format!("agent {} lost", f.agent_id)),
                Some(Event::Error(message)) => return Err(Error::Master(message)),
                Some(Event::Heartbeat(_)) | None => {}
            }
            if self.plan.is_done() {
                return Ok(true);
            }
            self.control_offers().await;
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
                })
                .await
                .map(drop),
        };
        if let Err(status) = result {
            warn!("Suppress/Revive failed (retried on the next event): {status}");
            self.plan.offer_flow_unknown();
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
        }
    }

    /// Removes the framework (the master kills whatever still runs).
    async fn teardown(&mut self) {
        let Some(mut client) = self.client.clone() else {
            return;
        };
        if self.info.id.is_empty() {
            return;
        }
        let request = pb::TeardownRequest {
            framework_id: self.info.id.clone(),
        };
        match tokio::time::timeout(TEARDOWN_TIMEOUT, client.teardown(request)).await {
            Ok(Ok(_)) => debug!("torn down"),
            Ok(Err(status)) => warn!("Teardown failed: {status}"),
            Err(_) => warn!("Teardown timed out"),
        }
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
