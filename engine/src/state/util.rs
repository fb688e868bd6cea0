//! GPU utilization over time (issue 39, item 2): the leader averages the
//! readings agents send with their heartbeats over each period (a minute
//! by default) and proposes them as one `RecordUtilization` command; every
//! master applies it into a bounded history per GPU, and charges each
//! task holding a whole GPU its busy time in the accounting ledger (so that
//! a report shows allocated GPU-hours beside how busy they were).
//!
//! The history is compact because it lives in every snapshot: per GPU a
//! ring of the last [`MAX_POINTS`] periods (a day at a minute each), one
//! byte of utilization and one of memory (percent of the GPU's) per period,
//! kept as hex; [`NO_DATA`] marks a period without a reading. And hourly
//! means for [`MAX_HOURS`] hours (a week). A GPU silent for a week goes.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

/// Periods kept per GPU (a day of minutes).
pub const MAX_POINTS: usize = 1440;
/// Hourly means kept per GPU (a week).
pub const MAX_HOURS: usize = 168;
/// A period with no reading.
pub const NO_DATA: u8 = 255;
/// Most points in one command (the leader sends more as several).
pub const MAX_POINTS_PER_COMMAND: usize = 4096;
const HOUR_MS: u64 = super::usage::HOUR_MS;

/// An unbroken run of a fraction's own readings (its processes') under the
/// idle threshold: periods from `from_ms` to `to_ms` (the end of the last
/// one), the sum and count of their readings. A period without a reading
/// of it, or one at or over the threshold, ends the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuietRun {
    pub from_ms: u64,
    pub to_ms: u64,
    pub sum: u64,
    pub n: u64,
}

impl QuietRun {
    /// The run after a period at `at_ms` read `util` (`below`: the
    /// threshold): extended when it follows on, begun again after a gap,
    /// none at or over the threshold.
    pub fn next(
        run: Option<QuietRun>,
        at_ms: u64,
        period_ms: u64,
        util: u8,
        below: u8,
    ) -> Option<QuietRun> {
        if util >= below {
            return None;
        }
        let to_ms = at_ms.saturating_add(period_ms);
        Some(match run {
            Some(r) if r.to_ms == at_ms => QuietRun {
                to_ms,
                sum: r.sum.saturating_add(u64::from(util)),
                n: r.n.saturating_add(1),
                ..r
            },
            _ => QuietRun {
                from_ms: at_ms,
                to_ms,
                sum: u64::from(util),
                n: 1,
            },
        })
    }
}

/// One GPU's mean over one period, as the leader proposes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UtilPoint {
    pub gpu: String,
    /// Mean SM utilization over the period, 0 to 100.
    pub util_pct: u8,
    /// Mean memory used, percent of the GPU's, 0 to 100.
    pub mem_pct: u8,
    /// On a shared GPU: each task's mean share of its SMs (NVML's
    /// per-process readings), percent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tasks: Vec<(String, u8)>,
    /// The GPU's fractions: each one's mean memory used by its processes,
    /// percent of the GPU's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub task_mem: Vec<(String, u8)>,
}

/// An hour's mean of one GPU; in a snapshot, `[hour_ms, util_sum,
/// mem_sum, n]` (a week of them is ~5 KB per GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "(u64, u32, u32, u32)", into = "(u64, u32, u32, u32)")]
pub struct HourMean {
    pub hour_ms: u64,
    /// Sums and count of the hour's readings: the mean is `sum / n`.
    pub util_sum: u32,
    pub mem_sum: u32,
    pub n: u32,
}

impl From<(u64, u32, u32, u32)> for HourMean {
    fn from((hour_ms, util_sum, mem_sum, n): (u64, u32, u32, u32)) -> HourMean {
        HourMean {
            hour_ms,
            util_sum,
            mem_sum,
            n,
        }
    }
}

impl From<HourMean> for (u64, u32, u32, u32) {
    fn from(h: HourMean) -> Self {
        (h.hour_ms, h.util_sum, h.mem_sum, h.n)
    }
}

impl HourMean {
    pub fn util_pct(&self) -> f64 {
        f64::from(self.util_sum) / f64::from(self.n.max(1))
    }
    pub fn mem_pct(&self) -> f64 {
        f64::from(self.mem_sum) / f64::from(self.n.max(1))
    }
}

/// One GPU's history.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuHistory {
    /// The time of the ring's first period.
    pub start_ms: u64,
    pub period_ms: u64,
    #[serde(with = "hex_bytes")]
    pub util: VecDeque<u8>,
    #[serde(with = "hex_bytes")]
    pub mem: VecDeque<u8>,
    pub hours: VecDeque<HourMean>,
}

mod hex_bytes {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::collections::VecDeque;

    pub fn serialize<S: Serializer>(v: &VecDeque<u8>, s: S) -> Result<S::Ok, S::Error> {
        let mut out = String::with_capacity(v.len() * 2);
        for b in v {
            out.push_str(&format!("{b:02x}"));
        }
        s.serialize_str(&out)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<VecDeque<u8>, D::Error> {
        let s = String::deserialize(d)?;
        if s.len() % 2 != 0 {
            return Err(serde::de::Error::custom("odd hex length"));
        }
        (0..s.len())
            .step_by(2)
            .map(|i| {
                s.get(i..i + 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| serde::de::Error::custom("not hex"))
            })
            .collect()
    }
}

impl GpuHistory {
    /// The time just past the ring's last period.
    pub fn end_ms(&self) -> u64 {
        self.start_ms + self.period_ms * self.util.len() as u64
    }

    /// Records the period starting at `at_ms` (a multiple of `period_ms`).
    fn record(&mut self, at_ms: u64, period_ms: u64, util: u8, mem: u8) {
        if period_ms == 0 {
            return;
        }
        if period_ms != self.period_ms || self.util.is_empty() {
            // A new ring: the first point, or the period changed.
            *self = GpuHistory {
                start_ms: at_ms,
                period_ms,
                hours: std::mem::take(&mut self.hours),
                ..Default::default()
            };
        }
        if at_ms < self.start_ms {
            return; // older than the ring: late, dropped
        }
        let slot = ((at_ms - self.start_ms) / period_ms) as usize;
        if slot < self.util.len() {
            return; // that period is recorded already
        }
        // Gaps, at most a ring's worth, then the point.
        let gap = (slot - self.util.len()).min(MAX_POINTS);
        if gap == MAX_POINTS {
            self.util.clear();
            self.mem.clear();
            self.start_ms = at_ms;
        } else {
            for _ in 0..gap {
                self.util.push_back(NO_DATA);
                self.mem.push_back(NO_DATA);
            }
        }
        self.util.push_back(util.min(100));
        self.mem.push_back(mem.min(100));
        while self.util.len() > MAX_POINTS {
            self.util.pop_front();
            self.mem.pop_front();
            self.start_ms += period_ms;
        }
        let hour_ms = at_ms - at_ms % HOUR_MS;
        match self.hours.back_mut() {
            Some(h) if h.hour_ms == hour_ms => {
                h.util_sum += u32::from(util.min(100));
                h.mem_sum += u32::from(mem.min(100));
                h.n += 1;
            }
            Some(h) if h.hour_ms > hour_ms => {}
            _ => {
                self.hours.push_back(HourMean {
                    hour_ms,
                    util_sum: u32::from(util.min(100)),
                    mem_sum: u32::from(mem.min(100)),
                    n: 1,
                });
                while self.hours.len() > MAX_HOURS {
                    self.hours.pop_front();
                }
            }
        }
    }

    /// The hourly means of the hours in `[from_ms, to_ms)` (an hour
    /// counts from its start): the first hour's start, then util and mem
    /// per hour, rounded, [`NO_DATA`] for an hour without a reading.
    pub fn hourly(&self, from_ms: u64, to_ms: u64) -> (u64, Vec<u8>, Vec<u8>) {
        let kept = self
            .hours
            .iter()
            .filter(|h| h.hour_ms.saturating_add(HOUR_MS) > from_ms && h.hour_ms < to_ms);
        let (mut util, mut mem) = (Vec::new(), Vec::new());
        let mut start = None;
        for h in kept {
            let first = *start.get_or_insert(h.hour_ms);
            let slot = ((h.hour_ms - first) / HOUR_MS) as usize;
            util.resize(slot, NO_DATA);
            mem.resize(slot, NO_DATA);
            let n = u64::from(h.n.max(1));
            let mean = |sum: u32| u8::try_from((u64::from(sum) * 2 + n) / (2 * n)).unwrap_or(100);
            util.push(mean(h.util_sum).min(100));
            mem.push(mean(h.mem_sum).min(100));
        }
        (start.unwrap_or(0), util, mem)
    }

    /// The recorded periods in `[from_ms, to_ms)`: (start, util, mem),
    /// periods without a reading left out.
    pub fn points(&self, from_ms: u64, to_ms: u64) -> impl Iterator<Item = (u64, u8, u8)> + '_ {
        self.util
            .iter()
            .zip(&self.mem)
            .enumerate()
            .map(|(i, (u, m))| (self.start_ms + self.period_ms * i as u64, *u, *m))
            .filter(move |(t, u, _)| *t >= from_ms && *t < to_ms && *u != NO_DATA)
    }
}

/// Every GPU's history, and the cluster's.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct History {
    pub gpus: BTreeMap<String, GpuHistory>,
    #[serde(default)]
    pub cluster: ClusterHistory,
    /// Each fraction task's own readings (its processes' share of the
    /// GPU's SMs and memory), as a GPU's: a shared GPU's history is the
    /// whole GPU's. Goes with its task, or a day after its last reading.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tasks: BTreeMap<String, GpuHistory>,
}

/// The cluster per period: devices held by tasks, and the sum of every
/// GPU's utilization (percent), for a day of periods; and their hourly
/// sums for a week.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterHistory {
    pub start_ms: u64,
    pub period_ms: u64,
    pub allocated: VecDeque<u32>,
    pub busy_pct_sum: VecDeque<u32>,
    #[serde(default, skip_serializing_if = "VecDeque::is_empty")]
    pub hours: VecDeque<ClusterHour>,
}

/// An hour of the cluster: sums over its periods; in a snapshot,
/// `[hour_ms, allocated_sum, busy_sum, n]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "(u64, u64, u64, u32)", into = "(u64, u64, u64, u32)")]
pub struct ClusterHour {
    pub hour_ms: u64,
    pub allocated_sum: u64,
    pub busy_sum: u64,
    pub n: u32,
}

impl From<(u64, u64, u64, u32)> for ClusterHour {
    fn from((hour_ms, allocated_sum, busy_sum, n): (u64, u64, u64, u32)) -> Self {
        ClusterHour {
            hour_ms,
            allocated_sum,
            busy_sum,
            n,
        }
    }
}

impl From<ClusterHour> for (u64, u64, u64, u32) {
    fn from(h: ClusterHour) -> Self {
        (h.hour_ms, h.allocated_sum, h.busy_sum, h.n)
    }
}

impl ClusterHistory {
    /// Records the period at `at_ms` (later points of a period add to it:
    /// a period's points may come in several commands).
    pub fn record(&mut self, at_ms: u64, period_ms: u64, allocated: u32, busy: u32) {
        if period_ms == 0 {
            return;
        }
        if period_ms != self.period_ms || self.allocated.is_empty() {
            *self = ClusterHistory {
                start_ms: at_ms,
                period_ms,
                hours: std::mem::take(&mut self.hours),
                ..Default::default()
            };
        }
        if at_ms < self.start_ms {
            return;
        }
        let slot = ((at_ms - self.start_ms) / period_ms) as usize;
        let hour_ms = at_ms - at_ms % HOUR_MS;
        if slot + 1 == self.allocated.len() {
            if let Some(b) = self.busy_pct_sum.back_mut() {
                *b = b.saturating_add(busy);
            }
            if let Some(h) = self.hours.back_mut().filter(|h| h.hour_ms == hour_ms) {
                h.busy_sum = h.busy_sum.saturating_add(u64::from(busy));
            }
            return;
        }
        if slot < self.allocated.len() {
            return;
        }
        match self.hours.back_mut() {
            Some(h) if h.hour_ms == hour_ms => {
                h.allocated_sum = h.allocated_sum.saturating_add(u64::from(allocated));
                h.busy_sum = h.busy_sum.saturating_add(u64::from(busy));
                h.n = h.n.saturating_add(1);
            }
            Some(h) if h.hour_ms > hour_ms => {}
            _ => {
                self.hours.push_back(ClusterHour {
                    hour_ms,
                    allocated_sum: u64::from(allocated),
                    busy_sum: u64::from(busy),
                    n: 1,
                });
                while self.hours.len() > MAX_HOURS {
                    self.hours.pop_front();
                }
            }
        }
        let gap = (slot - self.allocated.len()).min(MAX_POINTS);
        for _ in 0..gap {
            self.allocated.push_back(0);
            self.busy_pct_sum.push_back(0);
        }
        self.allocated.push_back(allocated);
        self.busy_pct_sum.push_back(busy);
        while self.allocated.len() > MAX_POINTS {
            self.allocated.pop_front();
            self.busy_pct_sum.pop_front();
            self.start_ms += period_ms;
        }
    }
}

impl ClusterHistory {
    /// The hourly means of the hours that end after `from_ms`: the first
    /// hour's start, then devices held and GPUs busy (percent sum) per
    /// hour, rounded; 0 for an hour without a period, as in the ring.
    pub fn hourly(&self, from_ms: u64) -> (u64, Vec<u32>, Vec<u32>) {
        let (mut allocated, mut busy) = (Vec::new(), Vec::new());
        let mut start = None;
        for h in self
            .hours
            .iter()
            .filter(|h| h.hour_ms.saturating_add(HOUR_MS) > from_ms)
        {
            let first = *start.get_or_insert(h.hour_ms);
            let slot = ((h.hour_ms - first) / HOUR_MS) as usize;
            allocated.resize(slot, 0);
            busy.resize(slot, 0);
            let n = u64::from(h.n.max(1));
            let mean =
                |sum: u64| u32::try_from((sum.saturating_mul(2) + n) / (2 * n)).unwrap_or(u32::MAX);
            allocated.push(mean(h.allocated_sum));
            busy.push(mean(h.busy_sum));
        }
        (start.unwrap_or(0), allocated, busy)
    }
}

impl History {
    /// Records one period's points; GPUs silent for [`MAX_HOURS`] go.
    pub fn record(&mut self, at_ms: u64, period_ms: u64, points: &[UtilPoint]) {
        for p in points {
            self.gpus
                .entry(p.gpu.clone())
                .or_default()
                .record(at_ms, period_ms, p.util_pct, p.mem_pct);
        }
        let oldest = at_ms.saturating_sub(MAX_HOURS as u64 * HOUR_MS);
        self.gpus.retain(|_, h| h.end_ms() > oldest);
        // A task's ring goes a day after its last reading (its periods
        // are all older by then): what the rings hold is then bounded by
        // the fractions' slots times a day, however many jobs ran.
        let day_ago = at_ms.saturating_sub(24 * HOUR_MS);
        self.tasks.retain(|_, h| h.end_ms() > day_ago);
    }

    /// Records a fraction task's own reading of the period at `at_ms`.
    pub fn record_task(&mut self, task_id: &str, at_ms: u64, period_ms: u64, util: u8, mem: u8) {
        self.tasks
            .entry(task_id.to_string())
            .or_default()
            .record(at_ms, period_ms, util, mem);
    }

    pub fn gpu(&self, uuid: &str) -> Option<&GpuHistory> {
        self.gpus.get(uuid)
    }

    pub fn task(&self, task_id: &str) -> Option<&GpuHistory> {
        self.tasks.get(task_id)
    }

    /// Drops a forgotten task's readings.
    pub fn forget_task(&mut self, task_id: &str) {
        self.tasks.remove(task_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(gpu: &str, util: u8) -> UtilPoint {
        UtilPoint {
            gpu: gpu.into(),
            util_pct: util,
            mem_pct: util / 2,
            tasks: Vec::new(),
            task_mem: Vec::new(),
        }
    }

    /// A week at an hour a point: each GPU's hourly means, gaps as
    /// no-reading, and the cluster's held and busy per hour (the busy of a
    /// period that came in two commands counted whole, its held once).
    #[test]
    fn hourly_means_serve_a_week() {
        let mut h = History::default();
        let m = 60_000;
        // Hour 0: 10% then 30%; hour 1: nothing; hour 2: 51% and 52%.
        h.record(0, m, &[point("g", 10)]);
        h.record(m, m, &[point("g", 30)]);
        h.record(2 * HOUR_MS, m, &[point("g", 51)]);
        h.record(2 * HOUR_MS + m, m, &[point("g", 52)]);
        let g = h.gpu("g").unwrap();
        let (start, util, mem) = g.hourly(0, u64::MAX);
        assert_eq!(start, 0);
        assert_eq!(util, [20, NO_DATA, 52]);
        assert_eq!(mem, [10, NO_DATA, 26]);
        // From within hour 2: that hour only; up to hour 2: hour 0 only.
        assert_eq!(
            g.hourly(2 * HOUR_MS + 1, u64::MAX),
            (2 * HOUR_MS, vec![52], vec![26])
        );
        assert_eq!(g.hourly(0, HOUR_MS).1, [20]);
        assert_eq!(History::default().gpus.len(), 0);
        let mut c = ClusterHistory::default();
        c.record(0, m, 2, 100);
        c.record(0, m, 2, 50); // the same period's second command
        c.record(m, m, 4, 250);
        c.record(2 * HOUR_MS, m, 1, 0);
        assert_eq!(c.hourly(0), (0, vec![3, 0, 1], vec![200, 0, 0]));
        assert_eq!(c.hourly(HOUR_MS + 1).0, 2 * HOUR_MS);
        let back: ClusterHistory =
            serde_json::from_slice(&serde_json::to_vec(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        // A period change keeps the hours.
        c.record(2 * HOUR_MS + 10 * m, 2 * m, 3, 0);
        assert_eq!(c.hourly(0).1, [3, 0, 2]);
    }

    /// A fraction task's own ring: recorded like a GPU's, gone with its
    /// task (`forget_task`) or a day after its last reading.
    #[test]
    fn a_tasks_own_readings_are_kept_like_a_gpus() {
        let mut h = History::default();
        let m = 60_000;
        h.record_task("job-1.0", 0, m, 20, 10);
        h.record_task("job-1.0", 2 * m, m, 40, 12);
        h.record_task("job-2.0", 0, m, 5, 1);
        let t = h.task("job-1.0").unwrap();
        let pts: Vec<(u64, u8, u8)> = t.points(0, u64::MAX).collect();
        assert_eq!(pts, [(0, 20, 10), (2 * m, 40, 12)]);
        let back: History = serde_json::from_slice(&serde_json::to_vec(&h).unwrap()).unwrap();
        assert_eq!(back, h);
        h.forget_task("job-2.0");
        assert!(h.task("job-2.0").is_none());
        // A day after its last reading: kept until then, then gone.
        h.record(3 * m + 23 * HOUR_MS, m, &[point("g", 1)]);
        assert!(h.task("job-1.0").is_some());
        h.record(3 * m + 24 * HOUR_MS, m, &[point("g", 1)]);
        assert!(h.task("job-1.0").is_none());
        // A history without tasks reads as before (older snapshots).
        let old: History = serde_json::from_str(r#"{"gpus":{}}"#).unwrap();
        assert!(old.tasks.is_empty());
    }

    #[test]
    fn a_ring_keeps_a_day_marks_gaps_and_means_hours() {
        let mut h = History::default();
        let m = 60_000;
        h.record(0, m, &[point("g", 10)]);
        h.record(m, m, &[point("g", 30)]);
        // Two silent minutes, then a reading.
        h.record(4 * m, m, &[point("g", 50)]);
        // A repeat of a recorded minute changes nothing.
        h.record(4 * m, m, &[point("g", 99)]);
        let g = h.gpu("g").unwrap();
        let pts: Vec<(u64, u8)> = g.points(0, u64::MAX).map(|(t, u, _)| (t / m, u)).collect();
        assert_eq!(pts, [(0, 10), (1, 30), (4, 50)]);
        assert_eq!(g.util.len(), 5);
        assert_eq!(g.hours.len(), 1);
        assert_eq!(g.hours[0].util_pct(), 30.0);
        // A day and more later: the ring holds a day, hours go on.
        for i in 0..(MAX_POINTS as u64 + 10) {
            h.record(HOUR_MS + i * m, m, &[point("g", 40)]);
        }
        let g = h.gpu("g").unwrap();
        assert_eq!(g.util.len(), MAX_POINTS);
        assert_eq!(g.end_ms(), HOUR_MS + (MAX_POINTS as u64 + 10) * m);
        assert!(g.hours.len() > 24 && g.hours.len() <= MAX_HOURS);
        // Compact in a snapshot, and back.
        let json = serde_json::to_vec(&h).unwrap();
        assert!(
            json.len() < MAX_POINTS * 4 + 32 * MAX_HOURS,
            "{}",
            json.len()
        );
        let back: History = serde_json::from_slice(&json).unwrap();
        assert_eq!(back, h);
        // Full: a day of minutes and a week of hours is under 11 KB.
        let mut full = History::default();
        for i in 0..(MAX_HOURS as u64 * 60) {
            full.record(
                i * m,
                m,
                &[point("GPU-0c5e6a3e-0000-4000-8000-000000000000", 99)],
            );
        }
        let g = full
            .gpu("GPU-0c5e6a3e-0000-4000-8000-000000000000")
            .unwrap();
        assert_eq!((g.util.len(), g.hours.len()), (MAX_POINTS, MAX_HOURS));
        let size = serde_json::to_vec(&full).unwrap().len();
        assert!(size < 11 * 1024, "{size}");
        // A GPU silent for a week goes.
        let later = g.end_ms() + MAX_HOURS as u64 * HOUR_MS + m;
        h.record(later, m, &[point("other", 1)]);
        assert!(h.gpu("g").is_none());
        assert!(h.gpu("other").is_some());
    }
}
