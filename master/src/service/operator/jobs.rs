//! Jobs: submit, watch, get, list, cancel.

use super::*;

impl OperatorService {
    pub(super) async fn submit_job(
        &self,
        caller: &Caller,
        req: pb::SubmitJobRequest,
    ) -> Result<pb::SubmitJobResponse, ServiceError> {
        // The key is the caller's: another token's same id is another key.
        let request_id = if req.request_id.is_empty() {
            None
        } else {
            gpuctl_core::convert::check_id("request_id", &req.request_id)?;
            Some(request_key(caller.request_scope(), &req.request_id))
        };
        let spec = req
            .spec
            .ok_or_else(|| ConvertError::new("spec", "missing"))?;
        let mut spec = JobSpec::try_from(spec)?;
        if spec.service.is_some() {
            return Err(ConvertError::new(
                "spec.restart_policy",
                "always is a service's replicas' policy (gpuctl services create)",
            )
            .into());
        }
        self.admit(caller, &mut spec, "spec")?;
        // A resend of a submit already committed: answer from the state
        // (apply dedupes too, for a resend racing its first send).
        if let Some(key) = &request_id {
            let state = self.ctx.raft.state();
            if let Some(job_id) = state
                .resubmitted(key, &spec, None)
                .map_err(crate::raft::ProposeError::Rejected)?
            {
                return Ok(pb::SubmitJobResponse {
                    job_id: job_id.clone(),
                });
            }
        }
        match self
            .ctx
            .raft
            .propose(Command::SubmitJob {
                spec,
                at_ms: now_ms(),
                request_id,
            })
            .await?
        {
            Outcome::JobSubmitted { job_id } => {
                tracing::info!(job_id = %job_id, "job submitted");
                Ok(pb::SubmitJobResponse { job_id })
            }
            other => Err(ServiceError::unexpected("submit_job", other)),
        }
    }

    /// What the caller may ask of a job (or a service's template, under
    /// `field`): its tenant (the caller's, or one an admin names), root
    /// and a chosen user as its token allows, a stop grace within the
    /// master's; the token that submitted it is recorded.
    pub(super) fn admit(
        &self,
        caller: &Caller,
        spec: &mut JobSpec,
        field: &str,
    ) -> Result<(), ServiceError> {
        spec.submitted_by = caller.token_id().unwrap_or_default().to_string();
        // Charged to the caller's tenant; only an admin may name another.
        if spec.tenant.is_unset() {
            spec.tenant = caller.tenant().into();
        } else if !caller.may_access(spec.tenant.name()) {
            return Err(ServiceError::Forbidden(format!(
                "{field}.tenant: your token is tenant {}'s; it cannot submit work for tenant {}",
                caller.tenant(),
                spec.tenant
            )));
        }
        // Root on a host needs the agent's consent (allow_root_tasks, in
        // placement) and the tenant's: its token must allow it.
        if spec.template.security.run_as_root {
            if let Caller::Token(t) = caller {
                if !t.allow_root {
                    return Err(ServiceError::Forbidden(format!(
                        "{field}.security.run_as_root: tenant {}'s token does not allow root \
                         tasks (an admin makes one with `gpuctl tokens create --allow-root`)",
                        caller.tenant()
                    )));
                }
            }
        }
        if let Caller::Token(t) = caller {
            check_chosen_user(t, &spec.template.security)?;
        }
        self.ctx
            .config
            .check_stop_grace(spec.template.stop_grace_ms)
            .map_err(|why| ConvertError::new(format!("{field}.stop_grace_ms"), why))?;
        Ok(())
    }

    /// The job, then each change of it, until it ends. Wakes on applied
    /// entries and on newly published wait reasons; sends only when what
    /// the client would see differs. Bounded: one message in flight.
    pub(super) async fn watch_job(
        &self,
        caller: &Caller,
        req: pb::GetJobRequest,
    ) -> Result<JobStream, ServiceError> {
        let first = self.get_job(caller, req).await?;
        let id = first.id.clone();
        let (tx, rx) = mpsc::channel(1);
        let ctx = self.ctx.clone();
        tokio::spawn(async move {
            let mut applied = ctx.raft.applied();
            let mut published = ctx.waits.subscribe();
            let mut status = ctx.raft.status_watch();
            let mut shutdown = ctx.shutdown.clone();
            let mut last = first;
            if tx.send(Ok(last.clone())).await.is_err() {
                return;
            }
            while !job_state_from_pb("state", last.state).is_ok_and(|s| s.is_terminal()) {
                tokio::select! {
                    r = applied.changed() => if r.is_err() { return },
                    r = published.changed() => if r.is_err() { return },
                    r = status.changed() => if r.is_err() { return },
                    _ = shutdown.changed() => return,
                    _ = tx.closed() => return,
                }
                if !ctx.raft.status().serving {
                    let _ = tx.send(Err(ctx.not_leader().into())).await;
                    return;
                }
                let job = {
                    let state = ctx.raft.state();
                    match state.job(&id) {
                        Some(j) => Ok(job_detail_to_pb(&state, j, &ctx.waits.reasons())),
                        // Forgotten (--job-retention) while watched.
                        None => Err(ServiceError::job_not_found(&state, &id)),
                    }
                };
                let job = match job {
                    Ok(job) => job,
                    Err(gone) => {
                        let _ = tx.send(Err(gone.into())).await;
                        return;
                    }
                };
                if job != last {
                    last = job;
                    if tx.send(Ok(last.clone())).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }

    pub(super) async fn get_job(
        &self,
        caller: &Caller,
        req: pb::GetJobRequest,
    ) -> Result<pb::Job, ServiceError> {
        let id = self.job_id_of(caller, req)?;
        job_id_arg(&id)?;
        self.check_job_access(caller, &id)?;
        let state = self.ctx.raft.state();
        let job = state
            .job(&id)
            .ok_or_else(|| ServiceError::job_not_found(&state, &id))?;
        let reasons = self.ctx.waits.reasons();
        Ok(job_detail_to_pb(&state, job, &reasons))
    }

    pub(super) async fn list_jobs(
        &self,
        caller: &Caller,
        req: pb::ListJobsRequest,
    ) -> Result<pb::ListJobsResponse, ServiceError> {
        let req = JobsQuery::try_from(req)?;
        let state = self.ctx.raft.state();
        let reasons = self.ctx.waits.reasons();
        Ok(jobs_page::page(
            &state,
            &req,
            caller.tenant_scope(),
            jobs_page::PAGE_BYTES,
            |j| job_to_pb(&state, j, &reasons),
        ))
    }

    pub(super) async fn cancel_job(
        &self,
        caller: &Caller,
        req: pb::CancelJobRequest,
    ) -> Result<pb::CancelJobResponse, ServiceError> {
        let job_id = req.job_id;
        job_id_arg(&job_id)?;
        self.check_job_access(caller, &job_id)?;
        match self
            .ctx
            .raft
            .propose(Command::CancelJob {
                job_id,
                at_ms: now_ms(),
            })
            .await?
        {
            Outcome::JobCancelled { state } => Ok(pb::CancelJobResponse {
                state: pb::JobState::from(state) as i32,
            }),
            other => Err(ServiceError::unexpected("cancel_job", other)),
        }
    }
}
