//! What each tenant uses: GPUs its jobs' and its frameworks' live tasks
//! hold, and its jobs waiting and running. A tenant's GPU quota (`gpuctl
//! quota set`) covers both: the built-in scheduler places a job only within
//! it (placement and the queue pass), and the allocator offers the
//! tenant's role (a framework token's default role is its tenant) no more
//! than the quota leaves once the tenant's jobs are counted.
//! `gpuctl quota` shows it.

use std::borrow::Cow;
use std::collections::BTreeMap;

use gpuctl_core::types::{JobState, Resources};

use crate::allocator::RoleConfig;
use crate::state::access::{tenant_of, DEFAULT_TENANT};
use crate::state::State;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantUsage {
    /// GPUs held by its live tasks that are not being killed.
    pub gpus: u32,
    /// Of those, the GPUs of its jobs (the built-in scheduler's).
    pub job_gpus: u32,
    pub queued: u32,
    pub running: u32,
}

/// What a task counts against its tenant's GPU quota: its devices (GPUs,
/// MIG devices), or one for a fraction of a shared GPU (conservative, as
/// for a MIG device: weighting by size is left to fair shares, issue 35).
pub fn quota_gpus(resources: &Resources, fraction: Option<gpuctl_core::types::GpuFraction>) -> u32 {
    resources.gpus.saturating_add(u32::from(fraction.is_some()))
}

/// What a job's attempt counts against its tenant's GPU quota.
pub fn job_quota_gpus(spec: &gpuctl_core::types::JobSpec) -> u32 {
    quota_gpus(&spec.resources, spec.placement.fraction).saturating_mul(spec.replicas())
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
        if !t.holds_resources() || t.kill_requested {
            continue;
        }
        let gpus = quota_gpus(&t.resources, t.fraction);
        if t.framework_id.is_empty() {
            if let Some(j) = state.job(&t.job_id) {
                let u = out.entry(tenant_of(&j.spec).to_string()).or_default();
                u.gpus += gpus;
                u.job_gpus += gpus;
            }
        } else if let Some(f) = state.framework(&t.framework_id) {
            let tenant = if f.info.tenant.is_empty() {
                DEFAULT_TENANT
            } else {
                &f.info.tenant
            };
            out.entry(tenant.to_string()).or_default().gpus += gpus;
        }
    }
    out
}

/// The allocator's roles with each tenant's quota on the role of its name:
/// what the quota leaves once the tenant's jobs are counted (the allocator
/// counts the frameworks' own). Borrowed as is when no tenant has a quota.
pub fn roles_with_quotas<'r>(
    roles: &'r BTreeMap<String, RoleConfig>,
    state: &State,
) -> Cow<'r, BTreeMap<String, RoleConfig>> {
    if state.quotas().is_empty() {
        return Cow::Borrowed(roles);
    }
    let usage = usage(state);
    let mut out = roles.clone();
    for (tenant, &quota) in state.quotas() {
        let jobs = usage.get(tenant).map_or(0, |u| u.job_gpus);
        let role = out.entry(tenant.clone()).or_default();
        let mut limit = role.quota.unwrap_or(Resources {
            cpus: f64::MAX,
            mem_mib: u64::MAX,
            gpus: u32::MAX,
            ports: u32::MAX,
        });
        limit.gpus = limit.gpus.min(quota.saturating_sub(jobs));
        role.quota = Some(limit);
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Command;

    #[test]
    fn a_tenant_quota_caps_its_role_by_what_its_jobs_leave() {
        let mut s = State::new();
        let mut i = 0;
        let mut apply = |s: &mut State, c: Command| {
            i += 1;
            s.apply(i, &c).unwrap();
        };
        apply(&mut s, crate::state::testkit::register("a", 8));
        let roles: BTreeMap<String, RoleConfig> = BTreeMap::new();
        assert!(matches!(roles_with_quotas(&roles, &s), Cow::Borrowed(_)));
        apply(
            &mut s,
            Command::SetQuota {
                tenant: "vision".into(),
                gpus: 5,
            },
        );
        let mut spec = gpuctl_core::types::JobSpec::new(
            "j",
            vec!["true".into()],
            Resources {
                cpus: 1.0,
                mem_mib: 0,
                gpus: 2,
                ports: 0,
            },
        );
        spec.tenant = "vision".into();
        apply(
            &mut s,
            Command::SubmitJob {
                spec,
                at_ms: 1,
                request_id: None,
            },
        );
        let launches = crate::scheduler::place(&s, &Default::default(), &Default::default());
        assert_eq!(launches.len(), 1);
        apply(&mut s, Command::LaunchTasks { launches, at_ms: 2 });
        let u = &usage(&s)["vision"];
        assert_eq!((u.gpus, u.job_gpus, u.running), (2, 2, 1));
        let roles = roles_with_quotas(&roles, &s);
        assert_eq!(roles["vision"].quota.map(|q| q.gpus), Some(3));
        assert_eq!(roles["vision"].weight, 1.0);
    }
}
