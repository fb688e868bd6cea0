//! `gpuctl agents ...`.

use std::collections::BTreeMap;
use std::io::Write;

use clap::Subcommand;
use gpuctl_proto::pb;

use super::{parse_secs, CliError, JsonFlag, EXIT_OK};
use crate::client::{Master, Retry};
use crate::output::{self, AgentJson};

#[derive(Debug, Subcommand)]
pub enum AgentsCommand {
    /// List the agents: state (ACTIVE, UNREACHABLE, LOST, DRAINING),
    /// free/total GPUs, CPUs and memory, runtimes and their health.
    List(JsonFlag),
    /// Show one agent: its GPUs, their topology (like `nvidia-smi topo -m`)
    /// and its attributes.
    Describe {
        /// Agent id (see `gpuctl agents list`).
        id: String,
        #[command(flatten)]
        flags: JsonFlag,
    },
    /// Drain an agent: no new task is placed or offered on it. Its tasks
    /// run until they end, unless --kill (now) or --deadline (then): killed
    /// tasks' jobs go back to the queue without using a retry (FAILED with
    /// --no-requeue). Prints the agent.
    Drain {
        /// Agent id (see `gpuctl agents list`).
        id: String,
        /// Kill the tasks still running after this many seconds.
        #[arg(long, value_name = "SECS", value_parser = parse_secs)]
        deadline: Option<std::time::Duration>,
        /// Kill its tasks now.
        #[arg(long)]
        kill: bool,
        #[command(flatten)]
        flags: JsonFlag,
    },
    /// End a drain: the agent takes new tasks again. Prints the agent.
    Undrain {
        /// Agent id.
        id: String,
        #[command(flatten)]
        flags: JsonFlag,
    },
}

pub async fn run(
    master: &mut Master,
    cmd: AgentsCommand,
    out: &mut dyn Write,
) -> Result<u8, CliError> {
    match cmd {
        AgentsCommand::List(flags) => list(master, flags.json, out).await?,
        AgentsCommand::Describe { id, flags } => describe(master, &id, flags.json, out).await?,
        AgentsCommand::Drain {
            id,
            deadline,
            kill,
            flags,
        } => {
            let agent = drain(master, &id, deadline, kill).await?;
            print_agent(&agent, flags.json, out)?;
        }
        AgentsCommand::Undrain { id, flags } => {
            let agent = undrain(master, &id).await?;
            print_agent(&agent, flags.json, out)?;
        }
    }
    Ok(EXIT_OK)
}

/// Drains an agent; returns it as the master has it now. Resending is
/// harmless (a deadline is counted again from the resend).
pub async fn drain(
    master: &mut Master,
    id: &str,
    deadline: Option<std::time::Duration>,
    kill: bool,
) -> Result<pb::Agent, CliError> {
    master
        .call(Retry::Resend, |mut c| {
            let req = pb::DrainAgentRequest {
                agent_id: id.to_string(),
                kill,
                deadline_secs: deadline.map(|d| d.as_secs_f64()),
            };
            async move { c.drain_agent(req).await }
        })
        .await
}

/// Ends an agent's drain; returns the agent.
pub async fn undrain(master: &mut Master, id: &str) -> Result<pb::Agent, CliError> {
    master
        .call(Retry::Resend, |mut c| {
            let req = pb::UndrainAgentRequest {
                agent_id: id.to_string(),
            };
            async move { c.undrain_agent(req).await }
        })
        .await
}

fn print_agent(agent: &pb::Agent, json: bool, out: &mut dyn Write) -> Result<(), CliError> {
    if json {
        out.write_all(output::to_json(&AgentJson::from(agent))?.as_bytes())?;
    } else {
        out.write_all(
            output::agents_table(std::slice::from_ref(agent))
                .render()
                .as_bytes(),
        )?;
    }
    Ok(())
}

/// The agents, sorted by hostname then id.
pub async fn fetch_agents(master: &mut Master) -> Result<Vec<pb::Agent>, CliError> {
    let resp = master
        .call(Retry::Always, |mut c| async move {
            c.list_agents(pb::ListAgentsRequest {}).await
        })
        .await?;
    let mut agents = resp.agents;
    agents.sort_by(|a, b| (&a.hostname, &a.id).cmp(&(&b.hostname, &b.id)));
    Ok(agents)
}

pub async fn list(master: &mut Master, json: bool, out: &mut dyn Write) -> Result<(), CliError> {
    let agents = fetch_agents(master).await?;
    if json {
        let items: Vec<AgentJson> = agents.iter().map(AgentJson::from).collect();
        out.write_all(output::to_json(&items)?.as_bytes())?;
    } else {
        out.write_all(output::agents_table(&agents).render().as_bytes())?;
    }
    Ok(())
}

pub async fn describe(
    master: &mut Master,
    id: &str,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let agents = fetch_agents(master).await?;
    let agent = agents
        .iter()
        .find(|a| a.id == id)
        .ok_or_else(|| CliError::NotFound(format!("agent {id} not found")))?;
    if json {
        out.write_all(output::to_json(&AgentJson::from(agent))?.as_bytes())?;
        return Ok(());
    }
    // Which task holds each GPU comes from the cluster-wide GPU list.
    let holders: BTreeMap<String, String> = super::gpus::fetch_gpus(master)
        .await?
        .into_iter()
        .filter(|s| s.agent_id == id && !s.task_id.is_empty())
        .filter_map(|s| Some((s.gpu?.uuid, s.task_id)))
        .collect();
    out.write_all(output::agent_detail(agent, &holders).as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use clap::Parser;

    use super::*;
    use crate::commands::testkit::{serve, FakeOperator};
    use crate::commands::{Cli, Command};

    /// A master with one agent that records drain calls.
    #[derive(Default)]
    struct Fake {
        drains: Mutex<Vec<pb::DrainAgentRequest>>,
        draining: Mutex<bool>,
    }

    impl Fake {
        fn agent(&self) -> pb::Agent {
            let draining = *self.draining.lock().unwrap();
            pb::Agent {
                id: "a1".into(),
                hostname: "node1".into(),
                state: pb::AgentState::AgentActive as i32,
                draining,
                drain_deadline_ms: if draining { 1_700_000_060_000 } else { 0 },
                runtimes: vec![pb::Runtime::Docker as i32],
                runtime_status: vec![pb::RuntimeStatus {
                    runtime: pb::Runtime::Docker as i32,
                    available: false,
                    message: "daemon down".into(),
                }],
                ..Default::default()
            }
        }
    }

    impl FakeOperator for Fake {
        fn drain_agent(&self, r: pb::DrainAgentRequest) -> Result<pb::Agent, Status> {
            if r.agent_id != "a1" {
                return Err(Status::not_found(format!("agent {} not found", r.agent_id)));
            }
            self.drains.lock().unwrap().push(r);
            *self.draining.lock().unwrap() = true;
            Ok(self.agent())
        }
        fn undrain_agent(&self, r: pb::UndrainAgentRequest) -> Result<pb::Agent, Status> {
            assert_eq!(r.agent_id, "a1");
            *self.draining.lock().unwrap() = false;
            Ok(self.agent())
        }
        fn list_agents(&self, _: pb::ListAgentsRequest) -> Result<pb::ListAgentsResponse, Status> {
            Ok(pb::ListAgentsResponse {
                agents: vec![self.agent()],
            })
        }
    }

    use tonic::Status;

    fn parse(args: &[&str]) -> AgentsCommand {
        let mut argv = vec!["gpuctl", "agents"];
        argv.extend_from_slice(args);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Agents(c) => c,
            other => panic!("{other:?}"),
        }
    }

    async fn run_cmd(addr: &str, args: &[&str]) -> Result<String, CliError> {
        let mut master = Master::connect(&[addr.to_string()]).await?;
        let mut out = Vec::new();
        run(&mut master, parse(args), &mut out).await?;
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn drain_flags_parse() {
        match parse(&["drain", "a1", "--deadline", "90", "--kill"]) {
            AgentsCommand::Drain {
                id, deadline, kill, ..
            } => {
                assert_eq!(id, "a1");
                assert_eq!(deadline, Some(std::time::Duration::from_secs(90)));
                assert!(kill);
            }
            other => panic!("{other:?}"),
        }
        let argv = ["gpuctl", "agents", "drain", "a1", "--deadline", "soon"];
        assert!(Cli::try_parse_from(argv).is_err());
        assert!(Cli::try_parse_from(["gpuctl", "agents", "drain"]).is_err());
        assert!(matches!(
            parse(&["undrain", "a1", "--json"]),
            AgentsCommand::Undrain { .. }
        ));
    }

    #[tokio::test]
    async fn drain_and_undrain_call_the_master_and_print_the_agent() {
        let fake = Arc::new(Fake::default());
        let addr = serve(fake.clone()).await;
        let out = run_cmd(&addr, &["drain", "a1", "--deadline", "60"])
            .await
            .unwrap();
        assert!(out.starts_with("ID "), "{out}");
        assert!(out.contains("DRAINING"), "{out}");
        assert!(out.contains("docker (down: daemon down)"), "{out}");
        {
            let calls = fake.drains.lock().unwrap();
            assert_eq!(calls.len(), 1);
            assert_eq!(calls[0].deadline_secs, Some(60.0));
            assert!(!calls[0].kill);
        }
        let out = run_cmd(&addr, &["drain", "a1", "--kill", "--json"])
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["draining"], true);
        assert_eq!(v["runtime_status"][0]["available"], false);
        {
            let calls = fake.drains.lock().unwrap();
            assert!(calls[1].kill);
            assert_eq!(calls[1].deadline_secs, None);
        }
        let out = run_cmd(&addr, &["list"]).await.unwrap();
        assert!(out.contains("DRAINING"), "{out}");
        let out = run_cmd(&addr, &["undrain", "a1"]).await.unwrap();
        assert!(out.contains(" ACTIVE "), "{out}");
        let err = run_cmd(&addr, &["drain", "a9"]).await.unwrap_err();
        assert_eq!(err.exit_code(), crate::error::EXIT_NOT_FOUND);
        assert!(err.to_string().contains("agent a9 not found"), "{err}");
    }
}
