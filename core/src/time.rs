//! The one clock reading and the one retry backoff every daemon and client
//! uses. (The state machine never reads a clock: time is the proposer's,
//! carried in commands.)

use std::time::Duration;

/// Milliseconds since the Unix epoch (wall clock), 0 if the clock is
/// before it.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Exponential backoff between retries: `min`, then doubling up to `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub const fn new(min: Duration, max: Duration) -> Backoff {
        Backoff {
            min,
            max,
            next: min,
        }
    }

    /// The wait before the next try; the one after doubles (up to `max`).
    pub fn next_wait(&mut self) -> Duration {
        let wait = self.next;
        self.next = (self.next * 2).min(self.max);
        wait
    }

    /// The wait `next_wait` would return now.
    pub fn peek(&self) -> Duration {
        self.next
    }

    /// After a success: start again from `min`.
    pub fn reset(&mut self) {
        self.next = self.min;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_max_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let waits: Vec<u128> = (0..4).map(|_| b.next_wait().as_millis()).collect();
        assert_eq!(waits, vec![100, 200, 350, 350]);
        b.reset();
        assert_eq!(b.peek(), Duration::from_millis(100));
    }

    #[test]
    fn now_is_after_2024() {
        assert!(now_ms() > 1_704_067_200_000);
    }
}
