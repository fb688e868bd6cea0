//! Hung tasks (`--hang-timeout`): a running task whose output has not grown,
//! whose GPUs have shown no utilization and which has not touched its
//! heartbeat file (`GPUCTL_HEARTBEAT_FILE`) for its job's timeout is
//! stopped as hung. A gang whose ranks all wait in a collective at 0% GPU
//! writes nothing and computes nothing: without this it would hold its
//! GPUs until someone looked. Pure: the executor feeds it what it sees.

use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

/// Where a task's hang clock is kept across agent restarts (its state
/// directory).
pub const CLOCK_FILE: &str = "hang.json";

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
    /// The same on the wall clock, which survives the agent.
    last_wall: SystemTime,
    /// The `last_wall` on disk, if any.
    saved: Option<SystemTime>,
    /// The last look saw nothing new.
    quiet: bool,
}

/// A task's hang clock as kept on disk: what it had written, its heartbeat
/// and when it was last active, written when a quiet spell begins and,
/// while it is busy, at most once per tenth of its timeout (not at every
/// look). A restarted agent goes on from it: a task that has written
/// nothing and touched no heartbeat since has been quiet since `last_ms`
/// (which is behind the truth by at most that tenth, when only its GPUs
/// were busy); one that has is active now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Clock {
    pub log_len: u64,
    /// Its heartbeat file's modification time, ms since the epoch.
    pub beat_ms: Option<u64>,
    /// When it was last active, ms since the epoch.
    pub last_ms: u64,
}

fn epoch_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Activity {
    pub fn new(now: Instant) -> Activity {
        Activity {
            log_len: 0,
            beat: None,
            last: now,
            last_wall: SystemTime::now(),
            saved: None,
            quiet: false,
        }
    }

    /// The clock an earlier agent process saved, at `now` (`wall` on the
    /// wall clock): quiet since its `last_ms` (a wall clock set back counts
    /// as no time).
    pub fn restored(c: &Clock, now: Instant, wall: SystemTime) -> Activity {
        let since = Duration::from_millis(epoch_ms(wall).saturating_sub(c.last_ms));
        Activity {
            log_len: c.log_len,
            beat: c
                .beat_ms
                .map(|ms| SystemTime::UNIX_EPOCH + Duration::from_millis(ms)),
            last: now.checked_sub(since).unwrap_or(now),
            last_wall: SystemTime::UNIX_EPOCH + Duration::from_millis(c.last_ms),
            saved: Some(SystemTime::UNIX_EPOCH + Duration::from_millis(c.last_ms)),
            quiet: false,
        }
    }

    /// The clock to save, if the one on disk is stale: at the first look of
    /// a quiet spell, and while the task is busy once the disk's is `slack`
    /// behind (`None` otherwise).
    pub fn clock_to_save(&mut self, slack: Duration) -> Option<Clock> {
        let due = match self.saved {
            None => true,
            Some(s) if s == self.last_wall => false,
            Some(s) => {
                self.quiet
                    || self
                        .last_wall
                        .duration_since(s)
                        .ok()
                        .is_none_or(|behind| behind >= slack)
            }
        };
        if !due {
            return None;
        }
        self.saved = Some(self.last_wall);
        Some(Clock {
            log_len: self.log_len,
            beat_ms: self.beat.map(epoch_ms),
            last_ms: epoch_ms(self.last_wall),
        })
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
            self.last_wall = SystemTime::now();
            self.quiet = false;
            return None;
        }
        self.quiet = true;
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

    /// The clock is saved once per quiet spell, and a restarted agent goes
    /// on from it: quiet since then if nothing changed, active if the task
    /// wrote meanwhile.
    #[test]
    fn a_quiet_spell_survives_a_restart_and_output_meanwhile_ends_it() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let slack = s(6);
        let mut a = Activity::new(t0);
        assert!(a.clock_to_save(slack).is_some(), "a new task's clock");
        assert_eq!(a.look(t0 + s(1), 50, None, false, s(60)), None);
        // Busy, saved less than the slack ago: nothing to save; the first
        // quiet look saves, once.
        assert_eq!(a.clock_to_save(slack), None);
        assert_eq!(a.look(t0 + s(2), 50, None, false, s(60)), None);
        let clock = a.clock_to_save(slack).expect("a quiet spell began");
        assert_eq!(clock.log_len, 50);
        assert_eq!(a.clock_to_save(slack), None, "saved once per spell");
        assert_eq!(a.look(t0 + s(3), 60, None, false, s(60)), None);
        assert_eq!(a.look(t0 + s(4), 60, None, false, s(60)), None);
        assert!(a.clock_to_save(slack).is_some(), "a new spell after output");
        // A restart 50 s after the saved clock: quiet for 50 s already.
        let wall = SystemTime::UNIX_EPOCH + Duration::from_millis(clock.last_ms) + s(50);
        let later = t0 + s(1000);
        let mut back = Activity::restored(&clock, later, wall);
        assert_eq!(back.look(later, 50, None, false, s(60)), None);
        assert_eq!(
            back.look(later + s(10), 50, None, false, s(60)),
            Some(s(60))
        );
        // Written meanwhile: active at the restart.
        let mut wrote = Activity::restored(&clock, later, wall);
        assert_eq!(wrote.look(later, 70, None, false, s(60)), None);
        assert_eq!(wrote.look(later + s(59), 70, None, false, s(60)), None);
        // A wall clock set back: no time has passed.
        let mut early = Activity::restored(&clock, later, SystemTime::UNIX_EPOCH);
        assert_eq!(early.look(later + s(59), 50, None, false, s(60)), None);
    }
}
