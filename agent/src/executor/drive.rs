//! One task driven from launch to its end: its start (`start.rs`), the
//! wait, the stop and the final status.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gpuctl_core::time::Backoff;
use gpuctl_core::types::{Runtime, ShareMode, TaskShare, TaskSpec, TaskState, UserIds};
use tokio::sync::watch;

use super::plan::Phase;
use super::plan::StopReason;

use crate::checkpoint::{self};
use crate::runtime::{ContainerRuntime, Observed, TaskRef};

use super::*;

impl Executor {
    /// Decides the task's final status once: checkpointed first, then sent
    /// until acknowledged (again by the next agent process if need be).
    pub(super) async fn finish(self: &Arc<Self>, task_id: &str, outcome: Outcome) {
        let mut u = self.update(task_id, outcome.state);
        u.exit_code = outcome.exit_code;
        u.message = outcome.message;
        u.gpu_unhealthy = outcome.gpu_unhealthy;
        u.fenced = outcome.fenced;
        u.gpu_memory_limit = outcome.gpu_memory_limit;
        u.hung = outcome.hung;
        u.runtime_restarted = outcome.runtime_restarted;
        u.liveness_failed = outcome.liveness_failed;
        u.requires = outcome.requires;
        u.failed_gpus = outcome.failed_gpus;
        let path = self.state_dir(task_id).join(checkpoint::FINAL_FILE);
        if let Err(e) = checkpoint::write_json(&path, &u) {
            tracing::error!(task_id, error = %e, "could not checkpoint the final status; sending it anyway");
        }
        {
            let mut t = self.lock();
            if let Some(task) = t.tasks.get_mut(task_id) {
                task.phase = Phase::Ended { acked: false };
                task.final_uuid = Some(u.uuid.clone());
            }
        }
        tracing::info!(task_id, state = %u.state, exit_code = ?u.exit_code, message = %u.message, "task ended");
        self.ended_tx.send_modify(|n| *n += 1);
        self.send(u).await;
        self.reconcile();
    }

    pub(super) fn gpu_env(spec: &TaskSpec) -> BTreeMap<String, String> {
        let mut env = spec.template.env.clone();
        let ids = spec.gpu_uuids.join(",");
        // A task without GPUs gets "void" (never inherit an image's "all").
        env.insert(
            "NVIDIA_VISIBLE_DEVICES".into(),
            if ids.is_empty() {
                "void".into()
            } else {
                ids.clone()
            },
        );
        env.insert("CUDA_VISIBLE_DEVICES".into(), ids.clone());
        env.insert("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into());
        env.insert(
            "NVIDIA_DRIVER_CAPABILITIES".into(),
            "compute,utility".into(),
        );
        env.insert("GPUCTL_GPUS".into(), ids);
        env.insert("GPUCTL_TASK_ID".into(), spec.task_id.clone());
        env.insert("GPUCTL_JOB_ID".into(), spec.job_id.clone());
        // Only the agent asks for the driver's cap.
        env.remove(crate::runtime::oci_hook::CAP_ENV);
        env
    }

    /// One task from launch (or reattachment) to its final status.
    pub(super) async fn drive(
        self: Arc<Self>,
        spec: TaskSpec,
        mut stop: watch::Receiver<Option<StopReason>>,
        reattach: bool,
    ) {
        let task_id = spec.task_id.clone();
        let outcome = self.drive_inner(&spec, &mut stop, reattach).await;
        self.finish(&task_id, outcome).await;
    }

    pub(super) async fn drive_inner(
        self: &Arc<Self>,
        spec: &TaskSpec,
        stop: &mut watch::Receiver<Option<StopReason>>,
        reattach: bool,
    ) -> Outcome {
        let task_id = spec.task_id.as_str();
        let fence_ms = self.fence_timeout_ms();
        let kind = if spec.template.image.is_some() {
            Runtime::Docker
        } else {
            Runtime::Process
        };
        let Some(rt) = self.runtimes.get(&kind).cloned() else {
            return Outcome::failed(format!("this agent has no {kind} runtime"));
        };
        let tref = self.task_ref(task_id);
        let started = if reattach {
            match self.reattach(spec, rt.as_ref(), &tref).await {
                Ok(started) => started,
                Err(o) => return o,
            }
        } else {
            false
        };
        let mut enforcement = None;
        if !started {
            if reattach {
                // Checkpointed by an agent that died before the runtime
                // started it: start it only if the master still wants it,
                // which the first desired set says (a stop comes with it).
                let mut ready = self.desired_ready.subscribe();
                tokio::select! {
                    _ = ready.wait_for(|r| *r) => {}
                    _ = stop.wait_for(|s| s.is_some()) => {}
                }
            }
            match self.start(spec, &rt, stop, fence_ms).await {
                Ok(e) => enforcement = e,
                Err(o) => {
                    // What was made for it before it failed (its cgroup, its
                    // claim on an MPS daemon, a driver cap) goes with it.
                    self.release(task_id);
                    return o;
                }
            }
        }
        self.set_phase(task_id, Phase::Running);
        let mut running = self.update(task_id, TaskState::Running);
        // A level known only once the container was made (its driver cap).
        running.enforcement = enforcement;
        self.send(running).await;

        // Its health checks run beside it until it ends.
        let opts = &spec.template.options;
        let checks = (opts.readiness.is_some() || opts.liveness.is_some()).then(|| {
            let me = self.clone();
            tokio::spawn(me.follow_checks(spec.clone(), rt.clone(), tref.clone(), started))
        });
        let _abort_checks = checks.map(|h| AbortOnDrop(h.abort_handle()));

        // Follow it to its end; a stop request is carried out beside.
        let wait = rt.wait(&tref);
        tokio::pin!(wait);
        let mut stopping = false;
        let ended = loop {
            let reason = stop.borrow().clone();
            if let (false, Some(reason)) = (stopping, reason) {
                stopping = true;
                // The notice first: it is there when SIGTERM comes.
                let grace = self.stop_grace(spec, Some(&reason));
                self.write_notice(task_id, &reason, grace);
                tokio::spawn(stop_until_done(rt.clone(), tref.clone(), grace));
            }
            tokio::select! {
                r = &mut wait => break r,
                r = stop.changed() => if r.is_err() {
                    // The task was forgotten; it still runs to its end.
                    break (&mut wait).await;
                },
            }
        };
        // The container first (Docker removes its own cgroup, inside the
        // task's), then what is left in the task's cgroups.
        remove_until_done(&rt, &tref).await;
        // Counted in the task's memory cgroup, which `release` removes.
        let oom_kills = self.isolation.isolator.oom_kills(task_id);
        self.release(task_id);
        let reason = stop.borrow().clone();
        let mut outcome = match ended {
            Ok(mut e) => {
                e.oom_killed |= oom_kills > 0;
                let oom = e.oom_killed;
                let mut o = Outcome::ran(e, reason.as_ref(), fence_ms);
                if oom && o.state == TaskState::Failed && spec.template.resources.mem_mib > 0 {
                    o.message = format!(
                        "{} of {} MiB (--mem)",
                        o.message, spec.template.resources.mem_mib
                    );
                }
                o
            }
            Err(e) => Outcome::failed(e.to_string()),
        };
        if let (Some(sh), Some(_)) = (&spec.share, outcome.exit_code.filter(|c| *c != 0)) {
            let peak = self
                .lock()
                .tasks
                .get(task_id)
                .map_or(0, |t| t.gpu_mem_peak_mib);
            if let Some(hint) = near_fraction(peak, sh.fraction.mem_mib) {
                outcome.message = format!("{}; {hint}", outcome.message);
            }
        }
        outcome
    }

    /// A task checkpointed by an earlier agent process: its MPS daemon
    /// claimed again, and whether its runtime started it (`Err`: its end,
    /// when it vanished or cannot be looked at). Waits out runtime outages.
    async fn reattach(
        &self,
        spec: &TaskSpec,
        rt: &dyn ContainerRuntime,
        tref: &TaskRef,
    ) -> Result<bool, Outcome> {
        let task_id = spec.task_id.as_str();
        // Its MPS daemon outlived the agent too: kept for it from now,
        // before the runtime answers (Docker may be down a while, and
        // an unclaimed daemon is quit as idle).
        let group = std::fs::read_to_string(self.state_dir(task_id).join(MPS_GROUP_FILE));
        if let (Some((gpu, sh)), Ok(group)) = (spec.holding().fraction(), group) {
            if sh.mode == ShareMode::Mps && self.isolation.mps.available() {
                self.isolation.mps.adopt(task_id, gpu, group.trim());
            }
        }
        let mut backoff = Backoff::new(OUTAGE_BACKOFF_MIN, OUTAGE_BACKOFF_MAX);
        loop {
            match rt.observe(tref).await {
                Ok(Observed::NotStarted) => {
                    if tref.state_dir.join(STARTED_FILE).exists() {
                        self.release(task_id);
                        return Err(Outcome::failed(
                            "the task vanished while the agent was down",
                        ));
                    }
                    return Ok(false);
                }
                Ok(Observed::Running | Observed::Ended(_)) => return Ok(true),
                Err(e) if e.is_unavailable() => {
                    tokio::time::sleep(backoff.next_wait()).await;
                }
                Err(e) => return Err(Outcome::failed(e.to_string())),
            }
        }
    }
}

/// Aborts a task's helper (its checks) when the task's drive ends.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub(super) fn set_mode(path: &std::path::Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// Asks the runtime to stop the task until it has taken the request (the
/// Docker daemon may be restarting).
pub(super) async fn stop_until_done(rt: Arc<dyn ContainerRuntime>, tref: TaskRef, grace: Duration) {
    let mut backoff = Backoff::new(OUTAGE_BACKOFF_MIN, OUTAGE_BACKOFF_MAX);
    loop {
        match rt.stop(&tref, grace).await {
            Ok(()) => return,
            Err(e) if e.is_unavailable() => {
                tokio::time::sleep(backoff.next_wait()).await;
            }
            Err(e) => {
                tracing::warn!(task_id = %tref.task_id, error = %e, "could not stop the task");
                return;
            }
        }
    }
}

/// Removes an ended task's container, waiting out a short outage or a
/// daemon still busy with it ("removal already in progress"); one left
/// behind is removed by the stray scan once the task is forgotten.
pub(super) async fn remove_until_done(rt: &Arc<dyn ContainerRuntime>, tref: &TaskRef) {
    let mut backoff = Backoff::new(OUTAGE_BACKOFF_MIN, OUTAGE_BACKOFF_MAX);
    for attempt in 0..10 {
        match rt.remove(tref).await {
            Ok(()) => return,
            Err(e) => {
                if attempt == 9 {
                    tracing::warn!(task_id = %tref.task_id, error = %e, "could not remove the ended task");
                    return;
                }
                tracing::debug!(task_id = %tref.task_id, error = %e, "removing the ended task; retrying");
                tokio::time::sleep(backoff.next_wait()).await;
            }
        }
    }
}

/// Which MPS daemon of its GPU the task's record names (`mps_group`).
pub(super) const MPS_GROUP_FILE: &str = "mps-group";

/// The MPS daemon of a GPU a shared task uses: its tenant's (tenants never
/// share one), and of its Linux user: an MPS daemon serves one user at a
/// time and makes another user's clients wait until the first's are gone,
/// so tasks running as different users get daemons of their own (which
/// the GPU time-slices). `None`: the image's user, not known here.
pub(super) fn mps_group(share: &TaskShare, user: Option<UserIds>) -> String {
    let tenant = share.tenant.name();
    match user {
        Some(u) => format!("{tenant}.u{}", u.uid),
        None => format!("{tenant}.image"),
    }
}
