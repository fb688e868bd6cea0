//! A task's notice before a stop (docs/scheduling.md, "Notice before a
//! stop"): a small file the agent writes, atomically, before it sends the
//! task SIGTERM, saying why and how long the task has before SIGKILL. The
//! task finds it at `GPUCTL_STOP_NOTICE`, given to every task at start; the
//! file exists only once a stop has begun. An environment variable cannot
//! change under a running process, so the file is the notice.
//!
//! The text is PURE (tested below); where it lies is the executor's:
//! `<work-dir>/notices/<task-id>/stop`, a directory of the agent's that
//! the task may read and not write, bind-mounted read-only at
//! [`CONTAINER_DIR`] into a container.

use std::time::Duration;

use gpuctl_core::types::StopNotice;

use super::StopReason;

/// The notice file's name in its directory.
pub const FILE: &str = "stop";
/// Where a container sees its notice directory.
pub const CONTAINER_DIR: &str = "/run/gpuctl";
/// The variable that names the notice file.
pub const ENV: &str = "GPUCTL_STOP_NOTICE";
/// The variable that names the job's checkpoint directory.
pub const CHECKPOINT_ENV: &str = "GPUCTL_CHECKPOINT_DIR";

/// Why the agent stops a task, as the notice says it: the master's notice
/// for a stop the master asked for (`None` when it said nothing: `killed`),
/// or the agent's own reason.
pub fn of(reason: &StopReason, from_master: Option<&StopNotice>) -> StopNotice {
    let own = |kind: &str, message: &str| StopNotice {
        kind: kind.to_string(),
        message: message.to_string(),
    };
    match reason {
        StopReason::Killed => from_master
            .filter(|n| !n.kind.is_empty())
            .cloned()
            .unwrap_or_else(|| own("killed", "killed")),
        StopReason::NotWanted => own("killed", "no longer wanted by the master"),
        StopReason::GpuFailed { why, .. } => own("gpu_failed", why),
        StopReason::Fenced => own("fenced", "the agent had no contact with a master"),
        StopReason::GpuMemoryLimit(why) => own("gpu_memory_limit", why),
        StopReason::Hung(why) => own("hung", why),
        StopReason::LivenessFailed(why) => own("liveness_failed", why),
    }
}

/// The notice file's text: `key=value` lines, values on one line.
/// `deadline_unix_ms` is when SIGKILL comes at the latest (wall clock).
pub fn text(notice: &StopNotice, grace: Duration, now_unix_ms: u64) -> String {
    let one_line = |s: &str| s.replace(['\n', '\r'], " ");
    let ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
    let secs = if ms % 1000 == 0 {
        (ms / 1000).to_string()
    } else {
        format!("{:.3}", grace.as_secs_f64())
    };
    format!(
        "reason={}\nmessage={}\ngrace_secs={secs}\ndeadline_unix_ms={}\n",
        one_line(&notice.kind),
        one_line(&notice.message),
        now_unix_ms.saturating_add(ms)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_says_why_and_until_when() {
        let n = StopNotice {
            kind: "preempted".into(),
            message: "preempted by job-7 (priority 5)".into(),
        };
        assert_eq!(
            text(&n, Duration::from_secs(60), 1_000),
            "reason=preempted\nmessage=preempted by job-7 (priority 5)\ngrace_secs=60\ndeadline_unix_ms=61000\n"
        );
        let n = StopNotice {
            kind: "gpu_failed".into(),
            message: "GPU g unhealthy:\nXID 79".into(),
        };
        let t = text(&n, Duration::from_millis(1500), 0);
        assert!(t.contains("message=GPU g unhealthy: XID 79\n"), "{t}");
        assert!(
            t.contains("grace_secs=1.500\ndeadline_unix_ms=1500\n"),
            "{t}"
        );
        assert_eq!(t.lines().count(), 4);
    }

    #[test]
    fn the_master_says_why_it_kills_and_the_agent_why_it_stops() {
        let m = StopNotice {
            kind: "cancelled".into(),
            message: "cancelled".into(),
        };
        assert_eq!(of(&StopReason::Killed, Some(&m)), m);
        assert_eq!(of(&StopReason::Killed, None).kind, "killed");
        let empty = StopNotice::default();
        assert_eq!(of(&StopReason::Killed, Some(&empty)).kind, "killed");
        assert_eq!(of(&StopReason::Fenced, Some(&m)).kind, "fenced");
        let g = of(
            &StopReason::GpuFailed {
                why: "GPU g unhealthy: lost".into(),
                gpu: Some("g".into()),
            },
            None,
        );
        assert_eq!(
            (g.kind.as_str(), g.message.as_str()),
            ("gpu_failed", "GPU g unhealthy: lost")
        );
        assert_eq!(of(&StopReason::NotWanted, None).kind, "killed");
    }
}
