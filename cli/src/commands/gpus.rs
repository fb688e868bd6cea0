//! `gpuctl gpus`: every GPU of the cluster and the task holding it;
//! `gpuctl gpus cordon|uncordon UUID`; `gpuctl gpus mig set UUID`.

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
    /// MIG: split a GPU into MIG devices (admins).
    #[command(subcommand)]
    Mig(MigCommand),
    /// Mark a GPU shareable by fractions (`jobs submit --gpu-mem`), or not
    /// (`--off`); admins. A shared GPU is never given whole nor split into
    /// MIG devices. Prints the GPU.
    Share {
        uuid: String,
        /// How it is shared: mps (MPS limits each process; the agent holds
        /// each task to its memory) or time-slice (no limit; the scheduler
        /// still counts).
        #[arg(long, value_parser = ["mps", "time-slice"], required_unless_present = "off")]
        mode: Option<String>,
        /// Stop sharing it (refused while fractions of it are held).
        #[arg(long, conflicts_with = "mode")]
        off: bool,
        #[command(flatten)]
        flags: JsonFlag,
    },
}

#[derive(Debug, Subcommand)]
pub enum MigCommand {
    /// Set a GPU's MIG devices: the GPU's agent destroys its GPU instances
    /// and creates these (all or nothing), turning MIG mode on if needed.
    /// Refused while a task holds the GPU or one of its MIG devices.
    /// Waits until the agent has applied it and prints the GPU.
    Set {
        /// The GPU's UUID (see `gpuctl gpus`).
        uuid: String,
        /// Its MIG devices afterwards, by profile, comma separated (e.g.
        /// 3g.40gb,2g.20gb,1g.10gb; the GPU's profiles: `gpuctl gpus
        /// --json`, `mig.profiles`). Empty: MIG mode on, no devices.
        #[arg(
            long,
            value_delimiter = ',',
            value_name = "PROFILES",
            required_unless_present = "disable"
        )]
        profiles: Vec<String>,
        /// Turn MIG mode off instead (its MIG devices are destroyed).
        #[arg(long, conflicts_with = "profiles")]
        disable: bool,
        /// Return once the change is recorded, without waiting for the agent.
        #[arg(long)]
        no_wait: bool,
        /// How long to wait for the agent, in seconds.
        #[arg(long, default_value_t = 120, value_name = "SECS")]
        timeout: u64,
        #[command(flatten)]
        flags: JsonFlag,
    },
}

pub async fn run(master: &mut Master, args: GpusArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let (uuid, cordon, flags) = match args.command {
        None => return list(master, args.flags.json, out).await,
        Some(GpusCommand::Cordon { uuid, flags }) => (uuid, true, flags),
        Some(GpusCommand::Uncordon { uuid, flags }) => (uuid, false, flags),
        Some(GpusCommand::Mig(MigCommand::Set {
            uuid,
            profiles,
            disable,
            no_wait,
            timeout,
            flags,
        })) => {
            let profiles: Vec<String> = profiles
                .into_iter()
                .map(|p| p.trim().to_string())
                .filter(|p| !p.is_empty())
                .collect();
            let wait = (!no_wait).then(|| std::time::Duration::from_secs(timeout));
            return mig_set(master, uuid, profiles, disable, wait, flags, out).await;
        }
        Some(GpusCommand::Share {
            uuid,
            mode,
            off: _,
            flags,
        }) => {
            // Setting a mode is idempotent: safe to resend.
            let status = master
                .call(Retry::Resend, |mut c| {
                    let req = pb::ShareGpuRequest {
                        uuid: uuid.clone(),
                        mode: mode.clone().unwrap_or_default(),
                    };
                    async move { c.share_gpu(req).await }
                })
                .await?;
            return print_gpu(&status, &flags, out);
        }
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
    print_gpu(&status, &flags, out)
}

/// One GPU after a change: its JSON object, or its rows of `gpus`.
fn print_gpu(
    status: &pb::GpuStatus,
    flags: &JsonFlag,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    if flags.json {
        out.write_all(output::to_json(&GpuStatusJson::from(status))?.as_bytes())?;
    } else {
        out.write_all(
            output::gpus_table(std::slice::from_ref(status))
                .render()
                .as_bytes(),
        )?;
    }
    Ok(())
}

/// `gpus mig set`: asks the change (the same change asked again is the
/// one under way, so a resend is safe), then follows the GPU until its
/// agent has applied it; a change the agent could not make is an error.
async fn mig_set(
    master: &mut Master,
    uuid: String,
    profiles: Vec<String>,
    disable: bool,
    wait: Option<std::time::Duration>,
    flags: JsonFlag,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let mut status = master
        .call(Retry::Resend, |mut c| {
            let req = pb::SetMigLayoutRequest {
                uuid: uuid.clone(),
                profiles: profiles.clone(),
                disable,
            };
            async move { c.set_mig_layout(req).await }
        })
        .await?;
    if let Some(limit) = wait {
        let deadline = std::time::Instant::now() + limit;
        while status.mig_change.is_some() {
            if std::time::Instant::now() >= deadline {
                return Err(CliError::Timeout(format!(
                    "GPU {uuid}: its agent has not applied the MIG layout change within {}s (it stays under way: `gpuctl gpus` shows it)",
                    limit.as_secs()
                )));
            }
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            status = fetch_gpus(master)
                .await?
                .into_iter()
                .find(|s| s.gpu.as_ref().is_some_and(|g| g.uuid == uuid))
                .ok_or_else(|| CliError::NotFound(format!("GPU {uuid} is gone")))?;
        }
    }
    print_gpu(&status, &flags, out)?;
    if wait.is_some() && !status.mig_error.is_empty() {
        return Err(CliError::Other(format!(
            "GPU {uuid}: the MIG layout change failed: {}",
            status.mig_error
        )));
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
