//! What each tenant uses: GPUs its jobs' live tasks hold, and its jobs
//! waiting and running. Quotas (`gpuctl quota set`) are checked against it
//! by the queue pass; `gpuctl quota` shows it.

use std::collections::BTreeMap;

use gpuctl_core::types::JobState;

use crate::state::access::tenant_of;
use crate::state::State;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantUsage {
    /// GPUs held by its jobs' live tasks that are not being killed.
    pub gpus: u32,
    pub queued: u32,
    pub running: u32,
}

/// Every tenant with a job in the state, with what it uses.
pub fn usage(state: &State) -> BTreeMap<String, TenantUsage> {
    let mut out: BTreeMap<String, TenantUsage> = BTreeMap::new();
    for j in state.jobs().values() {
        let u = out.entry(tenant_of(&j.spec).to_string()).or_default();
        match j.state {
            JobState::Queued => u.queued += 1,
            JobState::Starting | JobState::Running => u.running += 1,
            _ => {}
        }
    }
    for t in state.tasks().values() {
        if !t.framework_id.is_empty() || t.state.is_terminal() || t.kill_requested {
            continue;
        }
        if let Some(j) = state.job(&t.job_id) {
            out.entry(tenant_of(&j.spec).to_string()).or_default().gpus += t.resources.gpus;
        }
    }
    out
}
