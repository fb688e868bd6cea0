//! placeholder, written last
use clap::Args;
use super::CliError;
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {}
pub async fn run(_args: DemoArgs) -> Result<u8, CliError> { Err(CliError::Other("demo not ready".into())) }
