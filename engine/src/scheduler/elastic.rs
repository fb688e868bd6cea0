//! Elastic gangs grow (`--replicas MIN:MAX`). A gang starts with as many
//! ranks as fit, at least MIN (`placement::place_upto`); while it runs
//! with fewer than MAX, the leader looks now and then for room to place
//! the whole gang again with more. When there is, it proposes `GrowJob`:
//! the ranks are stopped and the job queued again without using a retry,
//! and the queue places it with as many ranks as then fit. A training job
//! resumes from its checkpoint at the new world size (`WORLD_SIZE`,
//! `PET_NNODES`), as torchrun's elastic agent would restart its workers.
//!
//! Growing never takes from others: only GPUs free now count (never a
//! preemption), only when no queued job of its priority or higher waits
//! (they are placed first), and only after the attempt has run
//! `elastic_grow_after`, so that a cluster whose GPUs free one at a time
//! does not restart a gang at each.

use gpuctl_core::types::{JobId, JobState, RestartPolicy};

use super::queue::QueueConfig;
use super::{placement, policy_of, request, reservations, tenants, Pool};
use crate::state::State;

/// How often the leader looks for room to grow elastic gangs.
pub const CHECK_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// The elastic gang to grow now, and to how many ranks at most; `None`
/// when none may grow. One at a time: the next look sees what it took.
pub fn growth(state: &State, cfg: &QueueConfig) -> Option<(JobId, u32)> {
    let after = cfg.elastic_grow_after_ms?;
    let mut candidates = state
        .jobs()
        .values()
        .filter(|j| {
            j.spec.is_elastic()
                && j.spec.restart_policy == RestartPolicy::Gang
                && j.state == JobState::Running
                && j.stopping.is_none()
                && !j.cancel_requested
                && j.world() < j.spec.replicas()
        })
        .peekable();
    candidates.peek()?;
    // A queued job of the same priority or higher is placed first.
    let top_queued = state.queued_jobs().first().map(|j| j.spec.priority);
    let reserved = reservations(state);
    for job in candidates {
        if top_queued.is_some_and(|p| p >= job.spec.priority) {
            continue;
        }
        let tasks: Vec<_> = job
            .current_tasks()
            .iter()
            .filter_map(|t| state.task(t))
            .collect();
        let started = tasks.iter().map(|t| t.created_at_ms).max().unwrap_or(0);
        if tasks.is_empty() || cfg.now_ms.saturating_sub(started) < after {
            continue;
        }
        // The room the whole gang would have if it stopped now: what is
        // free plus what its own ranks hold.
        let mut pool = Pool::from_state(state);
        for t in &tasks {
            pool.give(&t.agent_id, &t.resources, t.holding());
        }
        let mut most = job.spec.replicas();
        let tenant = job.spec.tenant.name();
        if let Some(cap) = state.tenant_cap(tenant) {
            let used = tenants::usage(state)
                .get(tenant)
                .map_or(0, |u| u.gpus)
                .saturating_sub(
                    tenants::quota_gpus(&job.spec.template.resources, job.spec.placement.fraction)
                        .saturating_mul(job.world()),
                );
            most = most.min(tenants::ranks_within(
                &job.spec,
                Some(cap.saturating_sub(used)),
            ));
        }
        if cfg.jobs_quota.is_some() || most <= job.world() {
            // A quota on the jobs' role is the allocator's to enforce:
            // growing there is not worked out (the gang keeps its size).
            continue;
        }
        let placed = placement::place_upto(
            &request(job, cfg.now_ms),
            job.world() + 1,
            most,
            &pool.usable_views(&reserved, job),
            policy_of(&job.spec, cfg.default_policy),
        );
        if let Some(ps) = placed {
            return Some((job.id.clone(), u32::try_from(ps.len()).unwrap_or(u32::MAX)));
        }
    }
    None
}
