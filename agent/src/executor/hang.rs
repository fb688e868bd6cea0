//! Hung tasks (`--hang-timeout`): a running task whose output has not grown,
//! whose GPUs have shown no utilization and which has not touched its
//! heartbeat file (`GPUCTL_HEARTBEAT_FILE`) for its job's timeout is
//! stopped as hung. A gang whose ranks all wait in a collective at 0% GPU
//! writes nothing and computes nothing: without this it would hold its
//! GPUs until someone looked. Pure: the executor feeds it what it sees.

use std::time::{Duration, Instant, SystemTime};

/// The file a task may touch to say it is alive, in its heartbeat
/// directory (`GPUCTL_HEARTBEAT_FILE` names it, as the task sees it).
pub const HEARTBEAT_FILE: &str = "beat";
/// That directory in a container.
pub const CONTAINER_DIR: &str = "/run/gpuctl-heartbeat";
/// The variable that names the file.
pub const ENV: &str = "GPUCTL_HEARTBEAT_FILE";

/// What was last seen of one task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Activity {
    /// Its log's length at the last look.
    log_len: u64,
    /// Its heartbeat file's modification time at the last look.
    beat: Option<SystemTime>,
    /// When it last wrote or its GPUs last worked (or it started).
    last: Instant,
}

impl Activity {
    pub fn new(now: Instant) -> Activity {
        Activity {
            log_len: 0,
            beat: None,
            last: now,
        }
    }

    /// A look at the task: its log's length now, its heartbeat file's
    /// modification time, and whether one of its GPUs was busy since the
    /// last look. Returns how long it has been idle when that is at least
    /// `timeout`.
    pub fn look(
        &mut self,
        now: Instant,
        log_len: u64,
        beat: Option<SystemTime>,
        gpu_busy: bool,
        timeout: Duration,
    ) -> Option<Duration> {
        if log_len != self.log_len || beat != self.beat || gpu_busy {
            self.log_len = log_len;
            self.beat = beat;
            self.last = now;
            return None;
        }
        let idle = now.saturating_duration_since(self.last);
        (idle >= timeout).then_some(idle)
    }
}

/// The task's message when it is stopped as hung.
pub fn hung_message(idle: Duration) -> String {
    format!(
        "hung: no output, no GPU activity and no heartbeat for {} s (--hang-timeout)",
        idle.as_secs()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_or_gpu_work_keeps_a_task_alive_and_silence_past_the_timeout_does_not() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut a = Activity::new(t0);
        // Quiet, but not for long enough.
        assert_eq!(a.look(t0 + s(5), 0, None, false, s(10)), None);
        // It wrote: the clock starts again.
        assert_eq!(a.look(t0 + s(9), 120, None, false, s(10)), None);
        assert_eq!(a.look(t0 + s(18), 120, None, false, s(10)), None);
        // Its GPU worked: again.
        assert_eq!(a.look(t0 + s(18), 120, None, true, s(10)), None);
        assert_eq!(a.look(t0 + s(27), 120, None, false, s(10)), None);
        // It touched its heartbeat file: again, and again at each touch.
        let touched = SystemTime::UNIX_EPOCH + s(1_000);
        assert_eq!(a.look(t0 + s(27), 120, Some(touched), false, s(10)), None);
        assert_eq!(a.look(t0 + s(36), 120, Some(touched), false, s(10)), None);
        assert_eq!(
            a.look(t0 + s(36), 120, Some(touched + s(9)), false, s(10)),
            None
        );
        // Silent for 10 s: hung.
        assert_eq!(
            a.look(t0 + s(46), 120, Some(touched + s(9)), false, s(10)),
            Some(s(10))
        );
        assert_eq!(
            hung_message(s(10)),
            "hung: no output, no GPU activity and no heartbeat for 10 s (--hang-timeout)"
        );
    }
}
