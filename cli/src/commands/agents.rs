//! `gpuctl agents ...`.

use std::io::Write;

use clap::Subcommand;
use gpuctl_proto::pb;

use super::{CliError, JsonFlag, EXIT_OK};
use crate::client::Master;
use crate::output::{self, AgentJson};

#[derive(Debug, Subcommand)]
pub enum AgentsCommand {
    /// List the agents: state, free/total GPUs, CPUs and memory, runtimes.
    List(JsonFlag),
}

pub async fn run(
    master: &mut Master,
    cmd: AgentsCommand,
    out: &mut dyn Write,
) -> Result<u8, CliError> {
    match cmd {
        AgentsCommand::List(flags) => list(master, flags.json, out).await?,
    }
    Ok(EXIT_OK)
}

/// The agents, sorted by hostname then id.
pub async fn fetch_agents(master: &mut Master) -> Result<Vec<pb::Agent>, CliError> {
    let resp = master
        .client
        .list_agents(pb::ListAgentsRequest {})
        .await
        .map_err(|s| CliError::rpc(master, s))?;
    let mut agents = resp.into_inner().agents;
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
