//! `gpuctl services ...`: replicas that run until the service is deleted,
//! each a job of one task that the master starts again whenever it ends
//! (restart policy `always`). As in `jobs.rs`, each command is a function
//! taking a connected [`Master`] and a writer.
//!
//! `services create` takes every per-task flag of `jobs submit` (its
//! [`SubmitArgs`], flattened), so that a replica is described exactly as a
//! job is; `--replicas` there is the service's number of replicas, and the
//! flags that only mean something for a job are refused, named.

use std::io::Write;

use clap::builder::Resettable;
use clap::{Arg, Args, Subcommand};
use gpuctl_core::convert::MAX_SERVICE_REPLICAS;
use gpuctl_proto::pb;

use super::jobfile::{JobFile, Kind, Replicas};
use super::submit::{in_file, read_job_file, SubmitArgs};
use super::{now_ms, CliError, JsonFlag, EXIT_OK};
use crate::client::{Master, Retry};
use crate::output::{self, ServiceJson};

#[derive(Debug, Subcommand)]
pub enum ServicesCommand {
    /// Create a service: replicas of one task, each a job that is started
    /// again whenever it ends, until the service is deleted. Takes the
    /// per-task flags of `jobs submit`; prints the service's id and name.
    // Boxed: the flags of `jobs submit` are large.
    Create(Box<CreateArgs>),
    /// List the services, by name.
    List(JsonFlag),
    /// Show a service: its template, each replica's job and its events.
    Get {
        /// Service name.
        name: String,
        #[command(flatten)]
        json: JsonFlag,
    },
    /// Set a service's number of replicas: more are queued as jobs, the
    /// newest are stopped for fewer.
    Scale {
        /// Service name.
        name: String,
        /// Replicas to run, 0 to 1024.
        #[arg(long, value_name = "N", value_parser = parse_replica_count)]
        replicas: u32,
        /// Print the service as JSON instead of one line.
        #[arg(long)]
        json: bool,
    },
    /// Delete a service: every replica is stopped and the name is free at
    /// once; prints the ids of the replicas' jobs being stopped.
    Delete {
        /// Service name.
        name: String,
    },
    /// Where a service's running replicas answer (its agent's host and the
    /// replica's port of the service's first --port name), and whether
    /// each is ready: what a proxy follows (Operator.WatchEndpoints).
    Endpoints {
        /// Service name; none: every service this token may see.
        name: Option<String>,
        /// Keep following: the endpoints again each time they change,
        /// across leader changes, until interrupted.
        #[arg(long)]
        watch: bool,
        /// JSON instead of a table (with --watch: one object per line).
        #[arg(long)]
        json: bool,
    },
}

/// `services create`: NAME, the service's own flags, and `jobs submit`'s
/// flags for what each replica runs. `jobs submit`'s `--replicas` becomes
/// the service's replica count (one number), `--file` the service's; its
/// job-only flags (and `--request-id`: a service's name is its create's
/// key) are hidden here and refused when given ([`CreateArgs::request`]).
#[derive(Debug, Clone, Args)]
#[command(
    mut_arg("replicas", replicas_flag),
    mut_arg("name", |a: Arg| a.required_unless_present(Resettable::Reset).hide(true)),
    mut_arg("max_retries", |a: Arg| a.hide(true)),
    mut_arg("restart_policy", |a: Arg| a.hide(true)),
    mut_arg("no_requeue", |a: Arg| a.hide(true)),
    mut_arg("request_id", |a: Arg| a.hide(true)),
    mut_arg("hang_timeout", |a: Arg| a.help(
        "Stop a replica as hung (FAILED, reason HUNG; it is started again) once it has gone \
         this long with no output and no GPU activity, e.g. 10m, 1h; 1s to 7d. Default: never"
    ).long_help(None::<&'static str>)),
    mut_arg("file", |a: Arg| a.help(
        "Read the service from this YAML job file with `kind: service` ('-': standard input); \
         its `name` is the service's, its `replicas` the number of replicas. Flags given here \
         override its values, NAME its name, a command after `--` its command."
    ).long_help(None::<&'static str>)),
)]
pub struct CreateArgs {
    /// Service name: 1 to 63 of lower-case letters, digits and '-',
    /// starting with a letter (a DNS label).
    #[arg(value_name = "NAME", required_unless_present = "file")]
    pub service: Option<String>,
    /// Print the service as JSON instead of its id and name.
    #[arg(long)]
    pub json: bool,
    /// How long a replica that leaves (scale down, delete) keeps running,
    /// out of the endpoints, before it is stopped, so that its requests in
    /// flight finish: e.g. 30s, 0s; at most 10m. Default: 5s when the
    /// service names a port (--port), else 0s.
    #[arg(long, value_name = "DURATION", value_parser = parse_drain)]
    pub drain: Option<u64>,
    /// What each replica runs: the flags of `jobs submit`.
    #[command(flatten)]
    pub task: SubmitArgs,
}

/// `services create --replicas`: `jobs submit`'s flag, given the service's
/// meaning (its value is still the pair `SubmitArgs` holds, N:N).
fn replicas_flag(a: Arg) -> Arg {
    a.value_parser(parse_replicas_flag)
        .value_name("N")
        .help(
            "Replicas to run, 0 to 1024, each one task [default: 1]. (A job's gang, \
             MIN:MAX, cannot be a replica.)",
        )
        .long_help(None::<&'static str>)
}

/// `services create --replicas N`, as `SubmitArgs` holds `--replicas`.
fn parse_replicas_flag(s: &str) -> Result<(u32, u32), String> {
    if s.contains(':') {
        return Err(format!(
            "{s:?}: a service's replicas are one number; MIN:MAX is a job's elastic gang, and \
             each replica is one task"
        ));
    }
    parse_replica_count(s).map(|n| (n, n))
}

/// `--drain`: a duration, as ms.
fn parse_drain(s: &str) -> Result<u64, String> {
    let d = gpuctl_core::time::parse_duration(s)?;
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if ms > gpuctl_core::types::MAX_DRAIN_MS {
        return Err(format!("{s:?} is more than 10m"));
    }
    Ok(ms)
}

/// A service's number of replicas: 0 to [`MAX_SERVICE_REPLICAS`].
pub fn parse_replica_count(s: &str) -> Result<u32, String> {
    s.trim()
        .parse::<u32>()
        .ok()
        .filter(|n| *n <= MAX_SERVICE_REPLICAS)
        .ok_or_else(|| format!("{s:?} is not a whole number in 0..={MAX_SERVICE_REPLICAS}"))
}

/// Why a replica has no use for a job's restart and retry settings.
const RESTARTED: &str =
    "a replica is started again whenever it ends (restart policy `always`), without a retry count";
/// Why a replica has no use for `--no-requeue`.
const REQUEUED: &str = "a preempted replica always goes back to the queue";
/// Why a service's create has no request id.
const KEYED: &str = "a service's name is its create's idempotency key (the same create sent \
                     again returns the service it made)";

impl CreateArgs {
    /// The request to send: the template from the flags over the job
    /// file's keys (as `jobs submit` makes a spec), NAME and the replica
    /// count. Job-only flags and keys are refused naming them, and the
    /// master's own check runs, so that bad input is refused before any
    /// call.
    pub fn request(&self) -> Result<pb::CreateServiceRequest, CliError> {
        let t = &self.task;
        let given = [
            (
                "--name",
                t.name.is_some(),
                "a replica is named as its service: give the service's NAME",
            ),
            ("--max-retries", t.max_retries.is_some(), RESTARTED),
            ("--restart-policy", t.restart_policy.is_some(), RESTARTED),
            ("--no-requeue", t.no_requeue, REQUEUED),
            ("--request-id", t.request_id.is_some(), KEYED),
        ];
        if let Some((flag, _, why)) = given.iter().find(|(_, set, _)| *set) {
            return Err(CliError::Usage(format!(
                "{flag} is a job's flag, not a service's: {why}"
            )));
        }
        let (origin, file) = match &t.file {
            Some(path) => {
                let (origin, file) = read_job_file(path)?;
                (Some(origin), file)
            }
            None => (None, JobFile::default()),
        };
        let named = |e: CliError| match &origin {
            Some(o) => in_file(o, e),
            None => e,
        };
        let (file, file_replicas) = service_keys(file).map_err(|m| named(CliError::Usage(m)))?;
        let name = match (&self.service, &file.name) {
            (Some(name), _) => name.clone(),
            (None, Some(name)) => name.0.clone(),
            (None, None) => {
                return Err(CliError::Usage(
                    "no service name: give NAME or `name:` in the job file".into(),
                ))
            }
        };
        gpuctl_core::types::check_service_name(&name)
            .map_err(|e| CliError::Other(format!("invalid name: {e}")))?;
        let replicas = t.replicas.map(|r| r.1).or(file_replicas).unwrap_or(1);
        // The template as `jobs submit` would make a job of it: one task,
        // named as the service (the master's rule).
        let task = SubmitArgs {
            name: Some(name.clone()),
            replicas: None,
            ..t.clone()
        };
        let template = task.spec_with(file).map_err(|e| match named(e) {
            // The master names the template's fields so.
            CliError::Other(m) => {
                CliError::Other(m.replacen("invalid spec.", "invalid template.", 1))
            }
            other => other,
        })?;
        let req = pb::CreateServiceRequest {
            name,
            replicas,
            template: Some(template),
            drain_ms: self.drain,
        };
        // The master's own check (its words, its exit code).
        gpuctl_core::types::ServiceSpec::try_from(req.clone())
            .map_err(|e| CliError::Other(e.to_string()))?;
        Ok(req)
    }
}

/// A service's job file: `kind: service` is required, and its `replicas`
/// (the service's count) comes out; the keys only a job has are refused.
fn service_keys(mut file: JobFile) -> Result<(JobFile, Option<u32>), String> {
    match file.kind {
        Some(Kind::Service) => {}
        // An empty file (every value from the flags) needs no kind.
        None if file == JobFile::default() => {}
        _ => {
            return Err(
                "is not a service's: add `kind: service` (then `replicas` is the number of \
                 replicas), or submit it as a job with `gpuctl jobs submit -f`"
                    .into(),
            )
        }
    }
    let given = [
        ("max_retries", file.max_retries.is_some(), RESTARTED),
        ("restart_policy", file.restart_policy.is_some(), RESTARTED),
        ("no_requeue", file.no_requeue.is_some(), REQUEUED),
        ("request_id", file.request_id.is_some(), KEYED),
    ];
    if let Some((key, _, why)) = given.iter().find(|(_, set, _)| *set) {
        return Err(format!("{key} is a job's key, not a service's: {why}"));
    }
    let replicas = match file.replicas.take() {
        Some(Replicas(min, max)) if min != max => {
            return Err(format!(
                "replicas: {min}:{max} is a job's elastic gang; a service's `replicas` is its \
                 number of replicas, one number"
            ))
        }
        other => other.map(|r| r.1),
    };
    file.kind = None;
    Ok((file, replicas))
}

pub async fn run(
    master: &mut Master,
    cmd: ServicesCommand,
    out: &mut dyn Write,
) -> Result<u8, CliError> {
    match cmd {
        ServicesCommand::Create(args) => {
            let req = args.request()?;
            create(master, req, args.json, out).await?;
        }
        ServicesCommand::List(JsonFlag { json }) => list(master, json, out).await?,
        ServicesCommand::Get {
            name,
            json: JsonFlag { json },
        } => {
            let svc = get(master, &name).await?;
            if json {
                out.write_all(output::to_json(&ServiceJson::from(&svc))?.as_bytes())?;
            } else {
                out.write_all(output::service_detail(&svc, now_ms()).as_bytes())?;
            }
        }
        ServicesCommand::Scale {
            name,
            replicas,
            json,
        } => {
            let svc = scale(master, &name, replicas).await?;
            if json {
                out.write_all(output::to_json(&ServiceJson::from(&svc))?.as_bytes())?;
            } else {
                writeln!(
                    out,
                    "{}: {} replicas asked, {} running",
                    svc.name, svc.replicas, svc.running
                )?;
            }
        }
        ServicesCommand::Delete { name } => {
            for id in delete(master, &name).await? {
                writeln!(out, "{id}")?;
            }
        }
        ServicesCommand::Endpoints { name, watch, json } => {
            return endpoints(master, name.as_deref(), watch, json, out).await;
        }
    }
    Ok(EXIT_OK)
}

/// How long `services endpoints --watch` waits before it watches again
/// after its stream broke (a leader change): the call then finds the new
/// leader itself.
const REWATCH_PAUSE: std::time::Duration = std::time::Duration::from_millis(200);

/// `services endpoints [NAME] [--watch] [--json]`: the endpoints of the
/// service (or of every service the token may see) once the watch has
/// said everything (`synced`), a table or one JSON object per service and
/// line; with `--watch`, each service again as it changes. A named service
/// that does not exist is not found (exit 3).
pub async fn endpoints(
    master: &mut Master,
    name: Option<&str>,
    watch: bool,
    json: bool,
    out: &mut dyn Write,
) -> Result<u8, CliError> {
    if let Some(name) = name {
        // The watch names no unknown service: ask first, for its error.
        get(master, name).await?;
    }
    let show = |all: &[&pb::ServiceEndpoints], out: &mut dyn Write| -> Result<(), CliError> {
        if json {
            for e in all {
                let line = serde_json::to_string(&output::EndpointsJson::from(*e))?;
                writeln!(out, "{line}")?;
            }
        } else {
            out.write_all(output::endpoints_table(all).render().as_bytes())?;
        }
        out.flush()?;
        Ok(())
    };
    loop {
        let req = pb::WatchEndpointsRequest {
            service: name.unwrap_or_default().to_string(),
        };
        let mut stream = master
            .call(Retry::Always, |mut c| {
                let req = req.clone();
                async move { c.watch_endpoints(req).await }
            })
            .await?;
        let mut now: std::collections::BTreeMap<String, pb::ServiceEndpoints> = Default::default();
        let mut synced = false;
        loop {
            match stream.message().await {
                Ok(Some(m)) if m.synced => {
                    synced = true;
                    show(&now.values().collect::<Vec<_>>(), out)?;
                    if !watch {
                        return Ok(EXIT_OK);
                    }
                }
                Ok(Some(m)) => {
                    if synced {
                        show(&[&m], out)?;
                    }
                    if m.deleted {
                        now.remove(&m.service);
                    } else {
                        now.insert(m.service.clone(), m);
                    }
                }
                // Ended: watch again.
                Ok(None) => break,
                // A leader change (the master says who leads now, or its
                // connection broke): watch again there.
                Err(status) if gpuctl_proto::leader::may_retry(&status) => {
                    if let Some(leader) = gpuctl_proto::leader::leader_hint(&status) {
                        master.switch_to(leader);
                    }
                    break;
                }
                Err(status) => return Err(CliError::rpc(master.addr(), status)),
            }
        }
        tokio::time::sleep(REWATCH_PAUSE).await;
    }
}

/// Creates the service; prints `ID NAME`, or the service as JSON. The
/// name is the create's idempotency key: the same create sent again is
/// answered with the service it made, so a resend after an unknown
/// outcome makes one service at most.
pub async fn create(
    master: &mut Master,
    req: pb::CreateServiceRequest,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let name = req.name.clone();
    let svc = master
        .call(Retry::Resend, |mut c| {
            let req = req.clone();
            async move { c.create_service(req).await }
        })
        .await
        .map_err(|e| {
            e.unknown_as(
                format!("service {name} may or may not have been created"),
                format!(
                    "look with `gpuctl services get {name}`, or run the same command again: \
                     the same create is answered with the service it made"
                ),
            )
        })?;
    if json {
        out.write_all(output::to_json(&ServiceJson::from(&svc))?.as_bytes())?;
    } else {
        writeln!(out, "{} {}", svc.id, svc.name)?;
    }
    Ok(())
}

/// The services, by name (their replicas' jobs and events left out).
pub async fn fetch(master: &mut Master) -> Result<Vec<pb::Service>, CliError> {
    let resp = master
        .call(Retry::Always, |mut c| async move {
            c.list_services(pb::ListServicesRequest {}).await
        })
        .await?;
    let mut services = resp.services;
    services.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(services)
}

/// `services list`: the table, or a JSON array of services.
pub async fn list(master: &mut Master, json: bool, out: &mut dyn Write) -> Result<(), CliError> {
    let services = fetch(master).await?;
    if json {
        let items: Vec<ServiceJson> = services.iter().map(ServiceJson::from).collect();
        out.write_all(output::to_json(&items)?.as_bytes())?;
    } else {
        out.write_all(
            output::services_table(&services, now_ms())
                .render()
                .as_bytes(),
        )?;
    }
    Ok(())
}

/// One service with its replicas' jobs and events (NOT_FOUND: exit 3).
pub async fn get(master: &mut Master, name: &str) -> Result<pb::Service, CliError> {
    master
        .call(Retry::Always, |mut c| {
            let req = pb::GetServiceRequest {
                name: name.to_string(),
            };
            async move { c.get_service(req).await }
        })
        .await
}

/// Sets the number of replicas; returns the service afterwards. Setting
/// the same number twice is the same: safe to resend.
pub async fn scale(
    master: &mut Master,
    name: &str,
    replicas: u32,
) -> Result<pb::Service, CliError> {
    master
        .call(Retry::Resend, |mut c| {
            let req = pb::ScaleServiceRequest {
                name: name.to_string(),
                replicas,
            };
            async move { c.scale_service(req).await }
        })
        .await
        .map_err(|e| {
            e.unknown_as(
                format!("service {name} may or may not have been scaled to {replicas} replicas"),
                format!("`gpuctl services scale {name} --replicas {replicas}` again is safe"),
            )
        })
}

/// Deletes the service; returns the ids of its replicas' jobs, being
/// stopped. A resend after a try that may have been applied can only be
/// answered NOT_FOUND, which then means that try deleted it: an unknown
/// outcome, saying so.
pub async fn delete(master: &mut Master, name: &str) -> Result<Vec<String>, CliError> {
    let resp = master
        .call(Retry::Resend, |mut c| {
            let req = pb::DeleteServiceRequest {
                name: name.to_string(),
            };
            async move { c.delete_service(req).await }
        })
        .await
        .map_err(|e| {
            e.unknown_as(
                format!("service {name} may or may not have been deleted"),
                format!(
                    "`gpuctl services get {name}` tells: not found means it was (its replicas' \
                     jobs are stopping; `gpuctl jobs list` shows them)"
                ),
            )
        })?;
    Ok(resp.job_ids)
}
