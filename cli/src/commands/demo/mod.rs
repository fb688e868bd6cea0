//! `gpuctl demo`: a whole cluster on this machine. Asks `gpuctl-agent check`
//! what the host offers, starts `gpuctl-master` and `gpuctl-agent` on
//! loopback ports with a temporary data directory (`daemons.rs`), runs a
//! 1-GPU and a 2-GPU job, streams their output, and prints the cluster with
//! the same code as `jobs list`, `agents list` and `gpus`.

mod daemons;

use std::ffi::OsString;
use std::io::{self, Write};
use std::path::Path;
use std::time::Duration;

use clap::Args;
use gpuctl_core::convert::job_state_name;
use gpuctl_core::host::{DockerCheck, HostCheck};
use gpuctl_core::types::Runtime;
use gpuctl_proto::pb;
use tokio::time::Instant;

use daemons::Daemon;

use super::{agents, gpus, jobs, one_line, parse_secs, CliError, EXIT_FAILURE, EXIT_OK};
use crate::client::Master;

/// GPUs simulated when the host has none.
pub const SIMULATED_GPUS: &str = "4xA100-SXM4-40GB";
/// What each demo job runs.
pub const DEMO_SCRIPT: &str =
    r#"echo "job $GPUCTL_JOB_ID on $(hostname): GPUs $NVIDIA_VISIBLE_DEVICES"; sleep 1; echo done"#;
/// How long the agent may take to register.
const AGENT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the master may take to answer.
const MASTER_TIMEOUT: Duration = Duration::from_secs(30);
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(15);
const POLL: Duration = Duration::from_millis(200);

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Simulate these GPUs even if the host has real ones (e.g. 8xH100-SXM5-80GB).
    #[arg(long, value_name = "SPEC")]
    pub simulate_gpus: Option<String>,
    /// Run the jobs as host processes even if Docker is available.
    #[arg(long)]
    pub no_docker: bool,
    /// Give up if the jobs have not finished after this many seconds.
    #[arg(long, value_name = "SECS", default_value = "120", value_parser = parse_secs)]
    pub timeout: Duration,
    /// Also serve the web console at this loopback address (e.g.
    /// 127.0.0.1:8080), and keep the cluster running after the jobs until
    /// Ctrl-C, to look at them there (docs/console.md).
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_console)]
    pub console: Option<std::net::SocketAddr>,
}

/// The demo's console address: loopback only, as any master without TLS.
fn parse_console(s: &str) -> Result<std::net::SocketAddr, String> {
    let addr: std::net::SocketAddr = s
        .parse()
        .map_err(|_| format!("{s:?} is not HOST:PORT with an IP address, e.g. 127.0.0.1:8080"))?;
    if !addr.ip().is_loopback() {
        return Err(format!(
            "{addr}: the demo's cluster has no TLS and no tokens, so its console serves a \
             loopback address only (e.g. 127.0.0.1:8080)"
        ));
    }
    Ok(addr)
}

/// One line of the demo's narration.
fn say(msg: impl AsRef<str>) {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "==> {}", msg.as_ref());
    let _ = out.flush();
}

/// Which GPUs the agent offers, and how many the second job asks for.
#[derive(Debug, Clone, PartialEq)]
struct GpuPlan {
    simulate: Option<String>,
    second_job_gpus: u32,
}

/// How the jobs run.
#[derive(Debug, Clone, PartialEq)]
struct RuntimePlan {
    runtimes: Vec<Runtime>,
    image: Option<String>,
}

pub async fn run(args: DemoArgs) -> Result<u8, CliError> {
    daemons::build_if_run_by_cargo()?;
    let master_bin = daemons::binary(daemons::MASTER)?;
    let agent_bin = daemons::binary(daemons::AGENT)?;
    let tmp = tempfile::Builder::new()
        .prefix("gpuctl-demo-")
        .tempdir()
        .map_err(|e| CliError::Other(format!("creating a temporary directory: {e}")))?;
    say(format!(
        "Temporary data directory: {} (removed on exit)",
        tmp.path().display()
    ));

    let gpu_plan;
    let runtime_plan;
    if let Some(spec) = &args.simulate_gpus {
        say(format!("Simulating GPUs {spec} (--simulate-gpus)"));
        gpu_plan = GpuPlan {
            simulate: Some(spec.clone()),
            second_job_gpus: 2,
        };
        if args.no_docker {
            runtime_plan = choose_runtimes(&args, None);
        } else {
            say("Checking for Docker (gpuctl-agent check)");
            let host = daemons::host_check(&agent_bin, false).await?;
            runtime_plan = choose_runtimes(&args, host.docker.as_ref());
        }
    } else {
        say(if args.no_docker {
            "Looking for NVIDIA GPUs (gpuctl-agent check: NVML)"
        } else {
            "Looking for NVIDIA GPUs and Docker (gpuctl-agent check: NVML, the Docker daemon)"
        });
        let host = daemons::host_check(&agent_bin, args.no_docker).await?;
        gpu_plan = choose_gpus(&host);
        runtime_plan = choose_runtimes(&args, host.docker.as_ref());
    }

    let (master_addr, mut master, mut agent) = start_daemons(
        tmp.path(),
        &master_bin,
        &agent_bin,
        &gpu_plan,
        &runtime_plan,
        args.console,
    )?;

    let outcome = tokio::select! {
        r = drive(&master_addr, &gpu_plan, &runtime_plan, args.timeout) => r,
        how = master.exited() => Err(CliError::Other(how)),
        how = agent.exited() => Err(CliError::Other(how)),
        _ = tokio::signal::ctrl_c() => Err(CliError::Other("interrupted".to_string())),
    };
    if let (Some(addr), Ok(_)) = (args.console, &outcome) {
        say(format!(
            "The cluster keeps running for the web console at http://{addr}/ ; Ctrl-C stops it"
        ));
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            how = master.exited() => say(how),
            how = agent.exited() => say(how),
        }
    }

    // The agent stops first: it may have containers to stop.
    say("Stopping the agent and the master");
    for daemon in [agent, master] {
        if let Some(warning) = daemon.stop(SHUTDOWN_TIMEOUT).await {
            say(format!("warning: {warning}"));
        }
    }
    drop(tmp);

    let both_succeeded = outcome?;
    if both_succeeded {
        say("Both jobs SUCCEEDED");
        Ok(EXIT_OK)
    } else {
        say("Not every job succeeded (see above)");
        Ok(EXIT_FAILURE)
    }
}

/// Real GPUs when NVML finds healthy ones, else simulated ones.
fn choose_gpus(host: &HostCheck) -> GpuPlan {
    let healthy = host.healthy_gpus();
    if healthy == 0 {
        let why = match (&host.nvml_error, host.gpus.len()) {
            (Some(e), _) => one_line(e),
            (None, 0) => "NVML reports none".to_string(),
            (None, n) => format!("{n} found, none healthy"),
        };
        say(format!(
            "No usable NVIDIA GPU on this host ({why}); simulating {SIMULATED_GPUS} instead"
        ));
        return GpuPlan {
            simulate: Some(SIMULATED_GPUS.to_string()),
            second_job_gpus: 2,
        };
    }
    let mut models: Vec<&str> = host.gpus.iter().map(|g| g.model.as_str()).collect();
    models.dedup();
    let driver = host
        .driver_version
        .as_deref()
        .map(|v| format!(", driver {v}"))
        .unwrap_or_default();
    say(format!(
        "Found {} real GPU(s) ({}{driver}); the demo uses them",
        host.gpus.len(),
        models.join(", ")
    ));
    let second_job_gpus = if healthy >= 2 {
        2
    } else {
        say("Only one healthy GPU: the second job asks for 1 GPU instead of 2");
        1
    };
    GpuPlan {
        simulate: None,
        second_job_gpus,
    }
}

/// Docker when the daemon answers and the demo image is ready, else host
/// processes.
fn choose_runtimes(args: &DemoArgs, docker: Option<&DockerCheck>) -> RuntimePlan {
    let processes = RuntimePlan {
        runtimes: vec![Runtime::Process],
        image: None,
    };
    if args.no_docker {
        say("Jobs run as host processes (--no-docker)");
        return processes;
    }
    let Some(docker) = docker else {
        say("Docker was not checked; jobs run as host processes");
        return processes;
    };
    match (&docker.error, &docker.image, &docker.image_error) {
        (Some(e), _, _) => say(format!(
            "Docker is not available ({}); jobs run as host processes",
            one_line(e)
        )),
        (None, Some(image), _) => {
            say(format!("Jobs run in Docker containers from image {image}"));
            return RuntimePlan {
                runtimes: vec![Runtime::Docker, Runtime::Process],
                image: Some(image.clone()),
            };
        }
        (None, None, e) => say(format!(
            "The demo image could not be prepared ({}); jobs run as host processes",
            one_line(e.as_deref().unwrap_or("no reason given"))
        )),
    }
    processes
}

/// Starts the master, then the agent, each on a free loopback port with
/// its data directory and log under `dir`.
fn start_daemons(
    dir: &Path,
    master_bin: &Path,
    agent_bin: &Path,
    gpu_plan: &GpuPlan,
    runtime_plan: &RuntimePlan,
    console: Option<std::net::SocketAddr>,
) -> Result<(String, Daemon, Daemon), CliError> {
    // The daemons log at RUST_LOG's level when it is set.
    let log = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".to_string());
    let master_addr = format!("127.0.0.1:{}", daemons::free_port()?);
    let master_dir = dir.join("master");
    let mut args: Vec<OsString> = vec![
        "--listen".into(),
        master_addr.clone().into(),
        "--data-dir".into(),
        master_dir.clone().into(),
        "--log".into(),
        log.clone().into(),
    ];
    if let Some(addr) = console {
        args.extend(["--http-listen".into(), addr.to_string().into()]);
    }
    let master = Daemon::spawn("master", master_bin, &args, dir)?;
    say(format!(
        "Master ({}) started on {master_addr} (data in {}, log in {})",
        master_bin.display(),
        master_dir.display(),
        master.log.display()
    ));
    if let Some(addr) = console {
        say(format!("Web console: http://{addr}/"));
    }

    let agent_addr = format!("127.0.0.1:{}", daemons::free_port()?);
    let runtimes: Vec<String> = runtime_plan
        .runtimes
        .iter()
        .map(|r| r.to_string())
        .collect();
    let mut args: Vec<OsString> = vec![
        "--master".into(),
        master_addr.clone().into(),
        "--listen".into(),
        agent_addr.clone().into(),
        "--work-dir".into(),
        dir.join("agent").into(),
        "--runtime".into(),
        runtimes.join(",").into(),
        // A throwaway agent: its tasks go when the demo ends.
        "--stop-tasks-on-shutdown".into(),
        "--log".into(),
        log.into(),
    ];
    if let Some(spec) = &gpu_plan.simulate {
        args.extend(["--simulate-gpus".into(), spec.into()]);
    }
    let agent = Daemon::spawn("agent", agent_bin, &args, dir)?;
    say(format!(
        "Agent started on {agent_addr} (runtimes: {}, log in {})",
        runtimes.join(", "),
        agent.log.display()
    ));
    Ok((master_addr, master, agent))
}

/// Connects once the master answers.
async fn connect_when_up(addr: &str, timeout: Duration) -> Result<Master, CliError> {
    let deadline = Instant::now() + timeout;
    loop {
        match Master::connect(&[addr.to_string()]).await {
            Ok(m) => return Ok(m),
            Err(e) if Instant::now() >= deadline => {
                return Err(CliError::Timeout(format!(
                    "the master did not answer within {}s ({e})",
                    timeout.as_secs()
                )))
            }
            Err(_) => tokio::time::sleep(POLL).await,
        }
    }
}

/// Everything done against the running cluster. Ok(true) when both jobs SUCCEEDED.
async fn drive(
    master_addr: &str,
    gpu_plan: &GpuPlan,
    runtime_plan: &RuntimePlan,
    timeout: Duration,
) -> Result<bool, CliError> {
    let mut master = connect_when_up(master_addr, MASTER_TIMEOUT).await?;
    let agent = wait_for_agent(&mut master, AGENT_TIMEOUT).await?;
    let total_gpus = agent.total.map_or(0, |t| t.gpus);
    say(format!(
        "Agent {} ({}) registered with {total_gpus} {}GPU(s)",
        agent.id,
        agent.hostname,
        if agent.simulated_gpus {
            "simulated "
        } else {
            ""
        }
    ));

    let mut ids = Vec::new();
    for (name, gpus) in [("demo-1gpu", 1), ("demo-2gpu", gpu_plan.second_job_gpus)] {
        let spec = demo_spec(name, gpus, runtime_plan.image.as_deref());
        let id = jobs::submit(&mut master, spec, None).await?;
        say(format!("Submitted job {name} ({gpus} GPU) as {id}"));
        ids.push((name, id));
    }

    let followers: Vec<_> = ids
        .iter()
        .map(|(name, id)| {
            let master = master.clone();
            let (name, id) = (name.to_string(), id.clone());
            tokio::spawn(async move { follow_job(master, &id, &name, timeout).await })
        })
        .collect();
    let mut finished = Vec::new();
    for ((name, _), follower) in ids.iter().zip(followers) {
        let job = follower
            .await
            .map_err(|e| CliError::Other(format!("following {name}: {e}")))??;
        finished.push((name, job));
    }
    for (name, job) in &finished {
        say(format!("{name}: {}", job_summary(job)));
    }

    let mut out = io::stdout();
    say("gpuctl jobs list");
    jobs::list(&mut master, false, &mut out).await?;
    say("gpuctl agents list");
    agents::list(&mut master, false, &mut out).await?;
    say("gpuctl gpus");
    gpus::list(&mut master, false, &mut out).await?;
    out.flush()?;

    Ok(finished
        .iter()
        .all(|(_, j)| j.state == pb::JobState::JobSucceeded as i32))
}

/// The spec of a demo job.
fn demo_spec(name: &str, gpus: u32, image: Option<&str>) -> pb::JobSpec {
    pb::JobSpec {
        placement: None,
        name: name.to_string(),
        image: image.unwrap_or_default().to_string(),
        command: vec!["sh".into(), "-c".into(), DEMO_SCRIPT.into()],
        env: Default::default(),
        resources: Some(pb::Resources {
            cpus: 0.5,
            mem_mib: 0,
            gpus,
            ports: 0,
        }),
        ..Default::default()
    }
}

fn job_summary(job: &pb::Job) -> String {
    let state = job_state_name(job.state);
    match job.tasks.last() {
        Some(t) => {
            let exit = t
                .exit_code
                .map(|c| format!(", exit {c}"))
                .unwrap_or_default();
            let msg = if t.message.is_empty() {
                String::new()
            } else {
                format!(": {}", one_line(&t.message))
            };
            format!(
                "{state} on {} with GPUs [{}]{exit}{msg}",
                t.agent_id,
                t.gpu_uuids.join(", ")
            )
        }
        None => match crate::output::job_message(job) {
            m if m.is_empty() => state.to_string(),
            m => format!("{state}: {}", one_line(&m)),
        },
    }
}

/// Polls ListAgents until an ACTIVE agent is there.
async fn wait_for_agent(master: &mut Master, timeout: Duration) -> Result<pb::Agent, CliError> {
    say(format!(
        "Waiting for the agent to register (up to {}s)",
        timeout.as_secs()
    ));
    let deadline = Instant::now() + timeout;
    let mut last_error = String::new();
    loop {
        let mut client = master.client()?;
        let call = client.list_agents(pb::ListAgentsRequest {});
        match tokio::time::timeout(Duration::from_secs(5), call).await {
            Ok(Ok(resp)) => {
                let active = resp
                    .into_inner()
                    .agents
                    .into_iter()
                    .find(|a| a.state == pb::AgentState::AgentActive as i32);
                if let Some(agent) = active {
                    return Ok(agent);
                }
                last_error.clear();
            }
            Ok(Err(status)) => last_error = CliError::rpc(master.addr(), status).to_string(),
            Err(_) => last_error = "ListAgents did not answer within 5s".to_string(),
        }
        if Instant::now() >= deadline {
            let why = if last_error.is_empty() {
                String::new()
            } else {
                format!(" (last error: {last_error})")
            };
            return Err(CliError::Timeout(format!(
                "the agent did not register with the master within {}s{why}",
                timeout.as_secs()
            )));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Waits for the job's task, streams its output prefixed with `[name] `,
/// then waits for the job to end and returns it.
async fn follow_job(
    mut master: Master,
    id: &str,
    name: &str,
    timeout: Duration,
) -> Result<pb::Job, CliError> {
    let deadline = Instant::now() + timeout;
    loop {
        let job = jobs::get_job(&mut master, id).await?;
        if !job.tasks.is_empty() || jobs::is_terminal(job.state) {
            break;
        }
        if Instant::now() >= deadline {
            return Err(CliError::Timeout(format!(
                "job {name} ({id}) was not placed within {}s (still {})",
                timeout.as_secs(),
                job_summary(&job)
            )));
        }
        tokio::time::sleep(POLL).await;
    }

    let mut prefixer = LinePrefixer::new(format!("[{name}] "));
    let left = deadline.saturating_duration_since(Instant::now());
    let follow = jobs::LogSelection {
        follow: true,
        ..Default::default()
    };
    let logs = jobs::stream_logs(&mut master, id, &follow, |data| {
        prefixer.feed(data, &mut io::stdout())
    });
    match tokio::time::timeout(left, logs).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => say(format!(
            "warning: could not stream the output of {name}: {e}"
        )),
        Err(_) => say(format!(
            "warning: the output of {name} was still open at the timeout"
        )),
    }
    prefixer.finish(&mut io::stdout())?;

    let left = deadline.saturating_duration_since(Instant::now());
    jobs::wait(&mut master, id, Some(left), jobs::WAIT_POLL).await
}

/// Turns a byte stream into lines that start with a prefix. Each line is
/// written with one call, so lines of jobs streamed at once do not mix.
#[derive(Debug)]
struct LinePrefixer {
    prefix: String,
    partial: Vec<u8>,
}

impl LinePrefixer {
    fn new(prefix: String) -> Self {
        LinePrefixer {
            prefix,
            partial: Vec::new(),
        }
    }

    fn feed(&mut self, data: &[u8], out: &mut dyn Write) -> io::Result<()> {
        self.partial.extend_from_slice(data);
        while let Some(pos) = self.partial.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=pos).collect();
            let mut buf = self.prefix.clone().into_bytes();
            buf.extend_from_slice(&line);
            out.write_all(&buf)?;
        }
        out.flush()
    }

    /// Writes what is left of an unfinished last line.
    fn finish(&mut self, out: &mut dyn Write) -> io::Result<()> {
        if self.partial.is_empty() {
            return Ok(());
        }
        let mut buf = self.prefix.clone().into_bytes();
        buf.append(&mut self.partial);
        buf.push(b'\n');
        out.write_all(&buf)?;
        out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_lines_across_chunks() {
        let mut p = LinePrefixer::new("[a] ".into());
        let mut out = Vec::new();
        p.feed(b"hel", &mut out).unwrap();
        assert!(out.is_empty());
        p.feed(b"lo\nwor", &mut out).unwrap();
        p.feed(b"ld\n\nlast", &mut out).unwrap();
        p.finish(&mut out).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "[a] hello\n[a] world\n[a] \n[a] last\n"
        );
    }

    #[test]
    fn demo_jobs() {
        let s = demo_spec("demo-2gpu", 2, Some("img"));
        assert_eq!(s.image, "img");
        assert_eq!(s.command[..2], ["sh", "-c"]);
        assert!(s.command[2].contains("$NVIDIA_VISIBLE_DEVICES"));
        assert_eq!(s.resources.map(|r| r.gpus), Some(2));
        assert_eq!(demo_spec("demo-1gpu", 1, None).image, "");
        // The names pass the master's validation.
        let domain = gpuctl_core::types::JobSpec::try_from(s);
        assert!(domain.is_ok(), "{domain:?}");
    }
}
