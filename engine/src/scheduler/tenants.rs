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

/// What a job's attempt needs of its tenant's GPU quota to start: an
/// elastic gang's fewest ranks (it grows only within the quota left).
pub fn job_quota_gpus(spec: &gpuctl_core::types::JobSpec) -> u32 {
    quota_gpus(&spec.template.resources, spec.placement.fraction)
        .saturating_mul(spec.min_replicas())
}

/// The most ranks of an elastic gang (at least its fewest) that `room`
/// GPUs of its tenant's quota allow; `None`: no limit.
pub fn ranks_within(spec: &gpuctl_core::types::JobSpec, room: Option<u32>) -> u32 {
    let per_rank = quota_gpus(&spec.template.resources, spec.placement.fraction);
    match room {
        Some(room) if per_rank > 0 => (room / per_rank).clamp(spec.min_replicas(), spec.replicas()),
        _ => spec.replicas(),
    }
}

/// Every tenant with a job in the state, with what it uses.
pub fn usage(state: &State) -> BTreeMap<String, TenantUsage> {
    let mut out: BTreeMap<String, TenantUsage> = BTreeMap::new();
    for j in state.jobs().values() {
        let u = out.entry(j.spec.tenant.name().to_string()).or_default();
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
                let u = out.entry(j.spec.tenant.name().to_string()).or_default();
                u.gpus += gpus;
                u.job_gpus += gpus;
            }
        } else if let Some(f) = state.framework(&t.framework_id) {
            out.entry(f.info.tenant.name().to_string())
                .or_default()
                .gpus += gpus;
        }
    }
    out
}

/// A tenant's part in the fair split of the cluster's GPUs (in quota units:
/// a GPU, a MIG device, or a fraction each).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FairShare {
    /// What its live tasks hold (not those being killed).
    pub used: u32,
    /// `used` plus what its queued jobs ask, within its limit.
    pub demand: u32,
    pub share: u32,
}

/// What the cluster can give out, in quota units: the GPUs not in MIG mode
/// and the MIG devices of the agents that take tasks.
pub fn capacity(state: &State) -> u32 {
    let n: usize = state
        .agents()
        .values()
        .filter(|a| a.accepts_tasks())
        .map(|a| {
            a.info.gpus.iter().filter(|g| !g.mig.enabled).count()
                + gpuctl_core::types::mig_devices_of(&a.info.gpus).count()
        })
        .sum();
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Each tenant with work's fair share of the GPUs (`capacity`):
/// 1. its quota, as far as it asks (`demand`);
/// 2. then what is left, split by weight among the tenants that ask for
///    more (water-filling: a tenant that asks for less than its part gets
///    what it asks, and the rest goes round again), each within its limit
///    (quota + borrowing limit).
///
/// Deterministic: the last GPUs, fewer than the tenants still asking, go
/// one at a time to the tenant furthest below its weight, then by name.
pub fn fair_shares(state: &State) -> BTreeMap<String, FairShare> {
    let mut out: BTreeMap<String, FairShare> = usage(state)
        .into_iter()
        .map(|(t, u)| {
            let f = FairShare {
                used: u.gpus,
                demand: u.gpus,
                share: 0,
            };
            (t, f)
        })
        .collect();
    for j in state.queued_jobs() {
        let asks = job_quota_gpus(&j.spec);
        if asks > 0 {
            let f = out.entry(j.spec.tenant.name().to_string()).or_default();
            f.demand = f.demand.saturating_add(asks);
        }
    }
    let mut left = capacity(state);
    for (tenant, f) in out.iter_mut() {
        if let Some(cap) = state.tenant_cap(tenant) {
            f.demand = f.demand.min(cap);
        }
        let quota = state.quotas().get(tenant).copied().unwrap_or(0);
        f.share = f.demand.min(quota).min(left);
        left -= f.share;
    }
    let weight = |t: &str| u64::from(state.tenant_weight(t));
    while left > 0 {
        let hungry: Vec<String> = out
            .iter()
            .filter(|(_, f)| f.share < f.demand)
            .map(|(t, _)| t.clone())
            .collect();
        if hungry.is_empty() {
            break;
        }
        let total: u64 = hungry.iter().map(|t| weight(t)).sum();
        let mut given = 0;
        for t in &hungry {
            let part = u64::from(left) * weight(t) / total.max(1);
            if let Some(f) = out.get_mut(t) {
                let g = u32::try_from(part)
                    .unwrap_or(u32::MAX)
                    .min(f.demand - f.share);
                f.share += g;
                given += g;
            }
        }
        if given == 0 {
            // Fewer GPUs left than tenants asking: one to the furthest
            // below its weight.
            let lowest = hungry.iter().min_by(|a, b| {
                let (fa, fb) = (out[*a].share, out[*b].share);
                (u64::from(fa) * weight(b))
                    .cmp(&(u64::from(fb) * weight(a)))
                    .then_with(|| a.cmp(b))
            });
            if let Some(f) = lowest.and_then(|t| out.get_mut(t)) {
                f.share += 1;
                given = 1;
            }
        }
        left = left.saturating_sub(given);
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
    let limits: Vec<(&String, u32)> = state
        .quotas()
        .keys()
        .chain(state.tenant_terms().keys())
        .filter_map(|t| Some((t, state.tenant_cap(t)?)))
        .collect();
    if limits.is_empty() {
        return Cow::Borrowed(roles);
    }
    let usage = usage(state);
    let mut out = roles.clone();
    for (tenant, quota) in limits {
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
                stop_idle_after_ms: None,
                clear_stop_idle: false,
                borrow: None,
                clear_borrow: false,
                weight: None,
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
