//! `gpuctl gpus`: every GPU of the cluster and the task holding it.

use std::io::Write;

use gpuctl_proto::pb;

use super::CliError;
use crate::client::{Master, Retry};
use crate::output::{self, GpuStatusJson};

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
