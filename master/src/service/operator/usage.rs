//! Utilization curves and usage reports, scoped to what the caller may see.

use super::*;

/// The curves `req` asks for, as `scope` (the caller's tenant; `None`:
/// every tenant's) may see them: a job's GPUs while its tasks held them;
/// per GPU, every GPU's whole curve for an admin, and for a tenant's token
/// only the GPUs its own jobs held, for the time they held them: a GPU's
/// curve shows whoever held it, and a tenant sees only its own jobs. PURE.
pub(super) fn wanted_series(
    state: &State,
    scope: Option<&str>,
    req: &pb::UtilizationRequest,
) -> Result<Vec<WantedSeries>, ServiceError> {
    let mut wanted = Vec::new();
    // A task's GPUs while it held them: a fraction's own curve, or none
    // (it goes a day after the task's last reading), since a shared GPU's
    // is its neighbours' too, never the fraction's.
    let held_by = |t: &TaskRecord, wanted: &mut Vec<WantedSeries>| {
        let to = if t.state.is_terminal() {
            t.updated_at_ms
        } else {
            u64::MAX
        };
        for g in &t.gpu_uuids {
            wanted.push(WantedSeries {
                gpu: g.clone(),
                task_id: t.id.clone(),
                from: t.created_at_ms.max(req.since_ms),
                to,
                own: t.fraction.is_some(),
            });
        }
    };
    if !req.job_id.is_empty() {
        let job = state
            .job(&req.job_id)
            .ok_or_else(|| ServiceError::not_found(Missing::Job, &req.job_id))?;
        for t in job.task_ids.iter().filter_map(|t| state.task(t)) {
            held_by(t, &mut wanted);
        }
    } else if let Some(tenant) = scope {
        let mine = state.tasks().values().filter(|t| {
            !t.job_id.is_empty()
                && !t.gpu_uuids.is_empty()
                && (!t.state.is_terminal() || t.updated_at_ms >= req.since_ms)
                && state
                    .job(&t.job_id)
                    .is_some_and(|j| !tenant.is_empty() && j.spec.tenant.name() == tenant)
        });
        for t in mine {
            held_by(t, &mut wanted);
        }
        if !req.gpus.is_empty() {
            wanted.retain(|w| req.gpus.contains(&w.gpu));
        }
    } else {
        let history = state.util_history();
        let all: Vec<&String> = if req.gpus.is_empty() {
            history.gpus.keys().collect()
        } else {
            req.gpus.iter().collect()
        };
        wanted.extend(all.into_iter().map(|g| WantedSeries {
            gpu: g.clone(),
            task_id: String::new(),
            from: req.since_ms,
            to: u64::MAX,
            own: false,
        }));
    }
    Ok(wanted)
}

impl OperatorService {
    /// GPU utilization history, from this master's state.
    pub(super) fn utilization(
        &self,
        caller: &Caller,
        req: pb::UtilizationRequest,
    ) -> Result<pb::UtilizationResponse, ServiceError> {
        /// Most GPUs in one answer (a day of minutes each is ~3 KB).
        const MAX_GPUS: usize = 256;
        if req.gpus.len() > MAX_GPUS {
            return Err(ConvertError::new("gpus", format!("at most {MAX_GPUS}")).into());
        }
        if !req.job_id.is_empty() {
            job_id_arg(&req.job_id)?;
            self.check_job_access(caller, &req.job_id)?;
        }
        let state = self.ctx.raft.state();
        let history = state.util_history();
        let mut wanted = wanted_series(&state, caller.tenant_scope(), &req)?;
        let truncated = wanted.len() > MAX_GPUS;
        wanted.truncate(MAX_GPUS);
        let gpus = wanted
            .into_iter()
            .filter_map(
                |WantedSeries {
                     gpu,
                     task_id,
                     from,
                     to,
                     own,
                 }| {
                    let h = if own {
                        history.task(&task_id)?
                    } else {
                        history.gpu(&gpu)?
                    };
                    if req.hourly {
                        let (start_ms, util, mem) = h.hourly(from, to);
                        return (!util.is_empty()).then_some(pb::GpuSeries {
                            start_ms,
                            period_ms: crate::state::usage::HOUR_MS,
                            util,
                            mem,
                            gpu,
                            task_id,
                            own,
                        });
                    }
                    let first =
                        from.saturating_sub(h.start_ms).div_ceil(h.period_ms.max(1)) as usize;
                    let last = if to == u64::MAX {
                        h.util.len()
                    } else {
                        (to.saturating_sub(h.start_ms) / h.period_ms.max(1)) as usize + 1
                    };
                    let range = first.min(h.util.len())..last.min(h.util.len());
                    Some(pb::GpuSeries {
                        start_ms: h.start_ms + h.period_ms * range.start as u64,
                        period_ms: h.period_ms,
                        util: h.util.range(range.clone()).copied().collect(),
                        mem: h.mem.range(range).copied().collect(),
                        gpu,
                        task_id,
                        own,
                    })
                },
            )
            .collect();
        let c = &history.cluster;
        if req.hourly {
            let (cluster_start_ms, allocated, busy_pct_sum) = c.hourly(req.since_ms);
            return Ok(pb::UtilizationResponse {
                gpus,
                cluster_start_ms,
                cluster_period_ms: crate::state::usage::HOUR_MS,
                allocated,
                busy_pct_sum,
                truncated,
            });
        }
        let first = (req.since_ms.saturating_sub(c.start_ms))
            .div_ceil(c.period_ms.max(1))
            .min(c.allocated.len() as u64) as usize;
        Ok(pb::UtilizationResponse {
            gpus,
            cluster_start_ms: c.start_ms + c.period_ms * first as u64,
            cluster_period_ms: c.period_ms,
            allocated: c.allocated.range(first..).copied().collect(),
            busy_pct_sum: c.busy_pct_sum.range(first..).copied().collect(),
            truncated,
        })
    }

    /// The accounting report, from this master's state.
    pub(super) fn usage(
        &self,
        caller: &Caller,
        req: pb::UsageRequest,
    ) -> Result<pb::UsageResponse, ServiceError> {
        use crate::state::usage;
        let by: usage::By = req
            .by
            .parse()
            .map_err(|e: String| ConvertError::new("by", e))?;
        let now = now_ms();
        if req.since_ms > now {
            return Err(ConvertError::new("since_ms", "is in the future").into());
        }
        let state = self.ctx.raft.state();
        let (rows, since, truncated) =
            usage::report(&state, req.since_ms, now, by, caller.tenant_scope());
        Ok(pb::UsageResponse {
            rows: rows
                .into_iter()
                .map(|r| pb::UsageRow {
                    key: r.key,
                    tenant: r.tenant,
                    gpu_ms: r.totals.gpu_ms,
                    cpu_ms: r.totals.cpu_ms,
                    mem_mib_ms: r.totals.mem_mib_ms,
                    tasks: r.totals.tasks,
                    running: r.running,
                    gpu_sampled_ms: r.totals.gpu_sampled_ms,
                    gpu_busy_ms: r.totals.gpu_busy_ms,
                    gpu_startup_ms: r.totals.gpu_startup_ms,
                })
                .collect(),
            since_ms: since,
            until_ms: now,
            truncated,
        })
    }
}
