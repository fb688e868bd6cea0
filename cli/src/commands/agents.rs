//! `gpuctl agents ...`.

use std::collections::BTreeMap;
use std::io::Write;

use clap::Subcommand;
use gpuctl_proto::pb;

use super::{CliError, JsonFlag, EXIT_OK};
use crate::client::{Master, Retry};
use crate::output::{self, AgentJson};

#[derive(Debug, Subcommand)]
pub enum AgentsCommand {
    /// List the agents: state, free/total GPUs, CPUs and memory, runtimes.
    List(JsonFlag),
    /// Show one agent: its GPUs, their topology (like `nvidia-smi topo -m`)
    /// and its attributes.
    Describe {
        /// Agent id (see `gpuctl agents list`).
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
    }
    Ok(EXIT_OK)
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
