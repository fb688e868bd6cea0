//! `gpuctl gpus`: every GPU of the cluster and the task holding it;
//! `gpuctl gpus cordon|uncordon UUID`.

use std::io::Write;

use clap::{Args, Subcommand};
use gpuctl_proto::pb;

use super::{CliError, JsonFlag};
use crate::client::{Master, Retry};
use crate::output::{self, GpuStatusJson};

/// `gpuctl gpus [--json]`, or one of its subcommands.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct GpusArgs {
    #[command(subcommand)]
    pub command: Option<GpusCommand>,
    #[command(flatten)]
    pub flags: JsonFlag,
}

#[derive(Debug, Subcommand)]
pub enum GpusCommand {
    /// Take a GPU out of service: no new task gets it (a task already on it
    /// keeps running). Prints the GPU.
    Cordon {
        /// The GPU's UUID (see `gpuctl gpus`).
        uuid: String,
        #[command(flatten)]
        flags: JsonFlag,
    },
    /// Put a cordoned GPU back in service. Prints the GPU.
    Uncordon {
        uuid: String,
        #[command(flatten)]
        flags: JsonFlag,
    },
}

pub async fn run(master: &mut Master, args: GpusArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let (uuid, cordon, flags) = match args.command {
        None => return list(master, args.flags.json, out).await,
        Some(GpusCommand::Cordon { uuid, flags }) => (uuid, true, flags),
        Some(GpusCommand::Uncordon { uuid, flags }) => (uuid, false, flags),
    };
    // Setting a flag to a value is idempotent: safe to resend.
    let status = master
        .call(Retry::Resend, |mut c| {
            let req = pb::CordonGpuRequest {
                uuid: uuid.clone(),
                cordon,
            };
            async move { c.cordon_gpu(req).await }
        })
        .await?;
    if flags.json {
        out.write_all(output::to_json(&GpuStatusJson::from(&status))?.as_bytes())?;
    } else {
        out.write_all(output::gpus_table(&[status]).render().as_bytes())?;
    }
    Ok(())
}

/// The GPUs, sorted by agent then index.
pub async fn fetch_gpus(master: &mut Master) -> Result<Vec<pb::GpuStatus>, CliError> {
    let resp = master
        .call(Retry::Always, |mut c| async move {
            c.list_gpus(pb::ListGpusRequest {}).await
        })
        .await?;
    let mut gpus = resp.gpus;
    gpus.sort_by_key(|s| {
        let index = s.gpu.as_ref().map_or(0, |g| g.index);
        (s.agent_id.clone(), index)
    });
    Ok(gpus)
}

pub async fn list(master: &mut Master, json: bool, out: &mut dyn Write) -> Result<(), CliError> {
    let gpus = fetch_gpus(master).await?;
    if json {
        let items: Vec<GpuStatusJson> = gpus.iter().map(GpuStatusJson::from).collect();
        out.write_all(output::to_json(&items)?.as_bytes())?;
    } else {
        out.write_all(output::gpus_table(&gpus).render().as_bytes())?;
    }
    Ok(())
}
