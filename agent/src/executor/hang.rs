//! Hung tasks (`--hang-timeout`): a running task whose output has not grown
//! and whose GPUs have shown no utilization for its job's timeout is
//! stopped as hung. A gang whose ranks all wait in a collective at 0% GPU
//! writes nothing and computes nothing: without this it would hold its
//! GPUs until someone looked. Pure: the executor feeds it what it sees.

use std::time::{Duration, Instant};

/// What was last seen of one task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Activity {
    /// Its log's length at the last look.
    log_len: u64,
    /// When it last wrote or its GPUs last worked (or it started).
    last: Instant,
}

impl Activity {
    pub fn new(now: Instant) -> Activity {
        Activity {
            log_len: 0,
            last: now,
        }
    }

    /// A look at the task: its log's length now, and whether one of its
    /// GPUs was busy since the last look. Returns how long it has been
    /// idle when that is at least `timeout`.
    pub fn look(
        &mut self,
        now: Instant,
        log_len: u64,
        gpu_busy: bool,
        timeout: Duration,
    ) -> Option<Duration> {
        if log_len != self.log_len || gpu_busy {
            self.log_len = log_len;
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
        "hung: no output and no GPU activity for {} s (--hang-timeout)",
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
        assert_eq!(a.look(t0 + s(5), 0, false, s(10)), None);
        // It wrote: the clock starts again.
        assert_eq!(a.look(t0 + s(9), 120, false, s(10)), None);
        assert_eq!(a.look(t0 + s(18), 120, false, s(10)), None);
        // Its GPU worked: again.
        assert_eq!(a.look(t0 + s(18), 120, true, s(10)), None);
        assert_eq!(a.look(t0 + s(27), 120, false, s(10)), None);
        // Silent for 10 s: hung.
        assert_eq!(a.look(t0 + s(28), 120, false, s(10)), Some(s(10)));
        assert_eq!(
            hung_message(s(10)),
            "hung: no output and no GPU activity for 10 s (--hang-timeout)"
        );
    }
}
