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

/// Parses a duration as operators write it: a number with a unit, `ms`,
/// `s`, `m`, `h` or `d` (`90s`, `30m`, `24h`, `7d`, `1.5h`), or a bare
/// number of seconds. The error says what was expected.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale = match unit.trim() {
        "ms" => 0.001,
        "" | "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        "d" => 86_400.0,
        _ => f64::NAN,
    };
    let secs = num.parse::<f64>().map(|n| n * scale).unwrap_or(f64::NAN);
    // At most 100 years: enough for any retention, far from overflow.
    if !secs.is_finite() || !(0.0..=3_153_600_000.0).contains(&secs) {
        return Err(format!(
            "{s:?} is not a duration (a number with a unit: ms, s, m, h or d, e.g. 90s, 24h, 7d)"
        ));
    }
    Ok(Duration::from_secs_f64(secs))
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
    fn durations_parse_with_units() {
        for (text, secs) in [
            ("90", 90.0),
            ("90s", 90.0),
            ("1500ms", 1.5),
            ("30m", 1800.0),
            (" 24h ", 86_400.0),
            ("7d", 604_800.0),
            ("1.5h", 5400.0),
            ("0s", 0.0),
        ] {
            assert_eq!(
                parse_duration(text),
                Ok(Duration::from_secs_f64(secs)),
                "{text}"
            );
        }
        for bad in [
            "",
            "h",
            "7w",
            "-1s",
            "1e3s",
            "3 days",
            "1.2.3s",
            "99999999999d",
        ] {
            let e = parse_duration(bad).unwrap_err();
            assert!(e.contains("not a duration"), "{bad}: {e}");
        }
    }

    #[test]
    fn now_is_after_2024() {
        assert!(now_ms() > 1_704_067_200_000);
    }
}
