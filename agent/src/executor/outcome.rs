//! What a task's end becomes in its final status: its state, exit code and
//! message (refused, failed before it ran, ran and ended, fenced).

use gpuctl_core::types::TaskState;

use super::plan::StopReason;

use crate::runtime::Ended;

/// How a task ended, as reported to the master.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Outcome {
    pub(super) state: TaskState,
    pub(super) exit_code: Option<i32>,
    pub(super) message: String,
    pub(super) gpu_unhealthy: bool,
    /// Stopped by the fence (REASON_FENCED).
    pub(super) fenced: bool,
    /// Stopped for using more GPU memory than its fraction
    /// (REASON_GPU_MEMORY_LIMIT).
    pub(super) gpu_memory_limit: bool,
    /// Stopped as hung (REASON_HUNG).
    pub(super) hung: bool,
    /// Refused because the host's driver does not meet what the image
    /// requires: all the image's requirements
    /// (REASON_DRIVER_REQUIREMENT_UNMET).
    pub(super) requires: Vec<String>,
    /// With `gpu_unhealthy`: the GPU that failed, when known.
    pub(super) failed_gpus: Vec<String>,
    /// Stopped by its runtime's restart (REASON_RUNTIME_RESTARTED).
    pub(super) runtime_restarted: bool,
    /// Stopped for its liveness check (REASON_LIVENESS_FAILED).
    pub(super) liveness_failed: bool,
}

impl Outcome {
    pub(super) fn failed(message: impl Into<String>) -> Outcome {
        Outcome {
            state: TaskState::Failed,
            exit_code: None,
            message: message.into(),
            gpu_unhealthy: false,
            fenced: false,
            gpu_memory_limit: false,
            hung: false,
            requires: Vec::new(),
            failed_gpus: Vec::new(),
            runtime_restarted: false,
            liveness_failed: false,
        }
    }

    /// A task that ends without having started.
    pub(super) fn refused(reason: &StopReason, fence_timeout_ms: u64) -> Outcome {
        match reason {
            StopReason::GpuFailed { why, gpu } => Outcome {
                gpu_unhealthy: true,
                failed_gpus: gpu.iter().cloned().collect(),
                ..Outcome::failed(why.clone())
            },
            StopReason::Fenced => Outcome {
                state: TaskState::Killed,
                fenced: true,
                ..Outcome::failed(fence_message(fence_timeout_ms))
            },
            StopReason::Killed | StopReason::NotWanted => Outcome {
                state: TaskState::Killed,
                ..Outcome::failed("killed before it started")
            },
            StopReason::GpuMemoryLimit(why) => Outcome {
                gpu_memory_limit: true,
                ..Outcome::failed(why.clone())
            },
            StopReason::Hung(why) => Outcome {
                hung: true,
                ..Outcome::failed(why.clone())
            },
            StopReason::LivenessFailed(why) => Outcome {
                liveness_failed: true,
                ..Outcome::failed(why.clone())
            },
        }
    }

    /// A task that ran, ended as `ended`, while being stopped for `reason`.
    pub(super) fn ran(ended: Ended, reason: Option<&StopReason>, fence_timeout_ms: u64) -> Outcome {
        if let Some(e) = ended.error {
            return Outcome::failed(e);
        }
        let code = ended.code;
        if ended.fenced || reason == Some(&StopReason::Fenced) {
            return Outcome {
                state: TaskState::Killed,
                exit_code: code,
                message: fence_message(fence_timeout_ms),
                gpu_unhealthy: false,
                fenced: true,
                gpu_memory_limit: false,
                hung: false,
                requires: Vec::new(),
                failed_gpus: Vec::new(),
                runtime_restarted: false,
                liveness_failed: false,
            };
        }
        match reason {
            // One that finished cleanly first succeeded all the same.
            Some(StopReason::GpuFailed { why, gpu }) if code != Some(0) => Outcome {
                gpu_unhealthy: true,
                failed_gpus: gpu.iter().cloned().collect(),
                exit_code: code,
                ..Outcome::failed(why.clone())
            },
            // Hung is the agent's verdict: a task that exits 0 on the
            // SIGTERM it got for it did not succeed.
            Some(StopReason::Hung(why)) => Outcome {
                hung: true,
                exit_code: code,
                ..Outcome::failed(why.clone())
            },
            // The same for a failed liveness check.
            Some(StopReason::LivenessFailed(why)) => Outcome {
                liveness_failed: true,
                exit_code: code,
                ..Outcome::failed(why.clone())
            },
            Some(StopReason::GpuMemoryLimit(why)) if code != Some(0) => Outcome {
                gpu_memory_limit: true,
                exit_code: code,
                ..Outcome::failed(why.clone())
            },
            Some(StopReason::Killed | StopReason::NotWanted) => Outcome {
                state: TaskState::Killed,
                exit_code: None,
                message: "killed".into(),
                gpu_unhealthy: false,
                fenced: false,
                gpu_memory_limit: false,
                hung: false,
                requires: Vec::new(),
                failed_gpus: Vec::new(),
                runtime_restarted: false,
                liveness_failed: false,
            },
            // Nobody here asked it to stop: its runtime did, restarting.
            _ if ended.runtime_restarted && code != Some(0) => Outcome {
                exit_code: code,
                runtime_restarted: true,
                ..Outcome::failed(format!(
                    "was stopped by its container runtime as the runtime restarted ({}; \
                     dockerd without live-restore stops the containers still running when it \
                     starts): not the task's own failure",
                    code.map_or("no exit code".to_string(), |c| ended_words(&ended, c))
                ))
            },
            _ => match code {
                Some(0) => Outcome {
                    state: TaskState::Finished,
                    exit_code: Some(0),
                    message: String::new(),
                    gpu_unhealthy: false,
                    fenced: false,
                    gpu_memory_limit: false,
                    hung: false,
                    requires: Vec::new(),
                    failed_gpus: Vec::new(),
                    runtime_restarted: false,
                    liveness_failed: false,
                },
                Some(c) => Outcome {
                    exit_code: Some(c),
                    ..Outcome::failed(ended_words(&ended, c))
                },
                None => Outcome::failed("ended without an exit code"),
            },
        }
    }
}

/// How a task that ran ended with code `c` (not 0), in words: an OOM kill
/// and a signal named as such, since "exited with code 137" says neither.
/// Docker reports a kill only as 128 + signal; that is said as what it
/// most likely is, with the code.
pub(super) fn ended_words(e: &Ended, c: i32) -> String {
    if e.oom_killed {
        return format!(
            "OOM-killed (exit code {c}): the kernel killed it for using more memory than its limit"
        );
    }
    match e.signal {
        Some(sig) => format!("killed by signal {sig} ({})", signal_name(sig)),
        None if (129..=128 + 64).contains(&c) => format!(
            "exited with code {c}, as a process killed by signal {} ({}) does",
            c - 128,
            signal_name(c - 128)
        ),
        None => format!("exited with code {c}"),
    }
}

/// `SIGKILL` for 9; `signal N` for one without a name here.
fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("signal {sig}"))
}

/// For a fraction that failed after its processes were seen using at least
/// 95% of its memory: a likely cause, said as such. A cap at allocation
/// (MPS's, the driver's) makes CUDA answer out-of-memory and the task exit
/// with its own code, which the agent cannot tell apart from any other.
pub(super) fn near_fraction(peak_mib: u64, fraction_mib: u64) -> Option<String> {
    (fraction_mib > 0 && peak_mib.saturating_mul(100) >= fraction_mib.saturating_mul(95)).then(
        || {
            format!(
                "its GPU memory was seen at {peak_mib} MiB of its {fraction_mib} MiB fraction: \
             an allocation past the fraction fails with out-of-memory"
            )
        },
    )
}

pub(super) fn fence_message(fence_timeout_ms: u64) -> String {
    format!(
        "fenced: the agent had no contact with a master for {:.0} s",
        fence_timeout_ms as f64 / 1000.0
    )
}
