//! `--mig-auto`'s loop: while this master leads, asks the layout changes
//! that the pure decision (`gpuctl_engine::scheduler::mig_auto`, where the
//! rules are written) finds.

use gpuctl_engine::scheduler::mig_auto::mig_auto_commands;
pub use gpuctl_engine::scheduler::mig_auto::{BY, PASS_EVERY};
use tokio::sync::watch;

use crate::raft::RaftHandle;
use crate::state::Command;

/// The loop: while this master leads (and `--mig-auto` is on), asks the
/// changes [`mig_auto_commands`] finds every [`PASS_EVERY`].
pub async fn run(raft: RaftHandle, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(PASS_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = tick.tick() => {}
        }
        if !raft.status().serving {
            continue;
        }
        let commands = {
            let state = raft.state();
            mig_auto_commands(&state, gpuctl_core::time::now_ms())
        };
        for cmd in commands {
            if let Command::SetMigLayout {
                gpu_uuid, profiles, ..
            } = &cmd
            {
                tracing::info!(gpu = %gpu_uuid, profiles = ?profiles, "mig-auto: repartitioning an idle GPU for queued jobs");
            }
            if let Err(e) = raft.propose(cmd).await {
                // The next pass (here or at the next leader) decides again.
                tracing::warn!(error = %e, "mig-auto: the layout change was not made");
                break;
            }
        }
    }
}
