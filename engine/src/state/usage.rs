//! Accounting: what each task held, charged to its tenant, the token that
//! submitted its job and its GPU model, by the hour (issue 39).
//!
//! A task is charged when it ends, inside apply, so every master holds the
//! same ledger and it survives failover with the rest of the state. What
//! is charged is the allocation, from launch to end (Slurm's model: GPUs
//! held are GPUs used up, whether the program kept them busy or not):
//! - GPU-ms: one per whole GPU or MIG device per ms; a fraction of a shared
//!   GPU its compute share (`--gpu-compute`, none asked: its memory share);
//! - CPU-ms: its `--cpus` per ms; memory: its `--mem` MiB per ms.
//!
//! The task's time is split at hour boundaries (UTC), so a report over a
//! window is exact to the hour. The ledger keeps one row per hour, tenant,
//! token and GPU model: bounded by [`MAX_ROWS`] (the oldest hours go
//! first) and by [`RETENTION_MS`]. Jobs themselves are not in it: a report
//! by job reads the jobs the master still keeps, from their tasks.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// An hour, in ms.
pub const HOUR_MS: u64 = 3_600_000;
/// Rows kept at most (hours × tenants × tokens × models); ~100 bytes each.
pub const MAX_ROWS: usize = 200_000;
/// Hours kept: 400 days, a year's reports and then some.
pub const RETENTION_MS: u64 = 400 * 24 * HOUR_MS;

/// What a row adds up. Integers, so that every master's sums are the same.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Totals {
    /// GPU-milliseconds (a whole GPU for one ms is 1).
    pub gpu_ms: u64,
    /// CPU-milliseconds.
    pub cpu_ms: u64,
    /// MiB-milliseconds of memory.
    pub mem_mib_ms: u64,
    /// Tasks that ended in the row's hour.
    pub tasks: u64,
    /// GPU-ms with a utilization reading (`RecordUtilization`), and those
    /// weighted by it: their ratio is the mean utilization of the GPUs.
    #[serde(default)]
    pub gpu_sampled_ms: u64,
    #[serde(default)]
    pub gpu_busy_ms: u64,
    /// Of `gpu_ms`, what was held before the task ran: from its launch to
    /// its RUNNING (the image's pull, the preflight, the start), or to its
    /// end if it never ran. Charged all the same (the GPUs were held, nobody
    /// else could use them), and shown apart.
    #[serde(default)]
    pub gpu_startup_ms: u64,
}

impl Totals {
    pub fn add(&mut self, o: &Totals) {
        self.gpu_ms = self.gpu_ms.saturating_add(o.gpu_ms);
        self.cpu_ms = self.cpu_ms.saturating_add(o.cpu_ms);
        self.mem_mib_ms = self.mem_mib_ms.saturating_add(o.mem_mib_ms);
        self.tasks = self.tasks.saturating_add(o.tasks);
        self.gpu_sampled_ms = self.gpu_sampled_ms.saturating_add(o.gpu_sampled_ms);
        self.gpu_busy_ms = self.gpu_busy_ms.saturating_add(o.gpu_busy_ms);
        self.gpu_startup_ms = self.gpu_startup_ms.saturating_add(o.gpu_startup_ms);
    }

    /// What `self` has beyond `o`, field by field (0 where it has less).
    pub fn saturating_sub(&self, o: &Totals) -> Totals {
        Totals {
            gpu_ms: self.gpu_ms.saturating_sub(o.gpu_ms),
            cpu_ms: self.cpu_ms.saturating_sub(o.cpu_ms),
            mem_mib_ms: self.mem_mib_ms.saturating_sub(o.mem_mib_ms),
            tasks: self.tasks.saturating_sub(o.tasks),
            gpu_sampled_ms: self.gpu_sampled_ms.saturating_sub(o.gpu_sampled_ms),
            gpu_busy_ms: self.gpu_busy_ms.saturating_sub(o.gpu_busy_ms),
            gpu_startup_ms: self.gpu_startup_ms.saturating_sub(o.gpu_startup_ms),
        }
    }

    /// The GPUs' mean utilization over the sampled time, percent; `None`
    /// without readings.
    pub fn util_pct(&self) -> Option<f64> {
        (self.gpu_sampled_ms > 0)
            .then(|| 100.0 * self.gpu_busy_ms as f64 / self.gpu_sampled_ms as f64)
    }
}

/// A row's key: the hour (its first ms), tenant, token id ("" where no
/// token is needed) and GPU model ("" for tasks without GPUs).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RowKey {
    pub hour_ms: u64,
    pub tenant: String,
    pub user: String,
    pub gpu_model: String,
}

/// What one task held, per ms of its life.
#[derive(Debug, Clone, PartialEq)]
pub struct Charge {
    pub tenant: String,
    pub user: String,
    pub gpu_model: String,
    /// Thousandths of a GPU (1000: one whole GPU).
    pub gpu_milli: u64,
    /// Thousandths of a CPU.
    pub cpu_milli: u64,
    pub mem_mib: u64,
}

impl Charge {
    /// Its totals over `[from_ms, to_ms)`.
    pub fn over(&self, from_ms: u64, to_ms: u64) -> Totals {
        let ms = to_ms.saturating_sub(from_ms);
        Totals {
            gpu_ms: self.gpu_milli.saturating_mul(ms) / 1000,
            cpu_ms: self.cpu_milli.saturating_mul(ms) / 1000,
            mem_mib_ms: self.mem_mib.saturating_mul(ms),
            ..Totals::default()
        }
    }

    /// Its totals over `[from_ms, to_ms)` for a task that ran from
    /// `running_ms` on: the part before it is its startup too.
    pub fn over_running_from(&self, from_ms: u64, to_ms: u64, running_ms: u64) -> Totals {
        let mut t = self.over(from_ms, to_ms);
        t.gpu_startup_ms = self
            .over(from_ms, running_ms.clamp(from_ms, to_ms.max(from_ms)))
            .gpu_ms;
        t
    }

    /// `[from_ms, to_ms)` split at hour boundaries: (hour, totals) each,
    /// the part before `running_ms` counted as startup too.
    pub fn by_hour(
        &self,
        from_ms: u64,
        to_ms: u64,
        running_ms: u64,
    ) -> impl Iterator<Item = (u64, Totals)> + '_ {
        let mut at = from_ms;
        std::iter::from_fn(move || {
            if at >= to_ms {
                return None;
            }
            let hour = at - at % HOUR_MS;
            let end = to_ms.min(hour.saturating_add(HOUR_MS));
            let t = self.over_running_from(at, end, running_ms);
            at = end;
            Some((hour, t))
        })
    }

    fn key(&self, hour_ms: u64) -> RowKey {
        RowKey {
            hour_ms,
            tenant: self.tenant.clone(),
            user: self.user.clone(),
            gpu_model: self.gpu_model.clone(),
        }
    }
}

/// The hourly ledger.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Ledger {
    #[serde(with = "rows")]
    rows: BTreeMap<RowKey, Totals>,
}

/// JSON maps need string keys: the rows go as a list of pairs.
mod rows {
    use super::{RowKey, Totals};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::collections::BTreeMap;

    pub fn serialize<S: Serializer>(m: &BTreeMap<RowKey, Totals>, s: S) -> Result<S::Ok, S::Error> {
        let v: Vec<(&RowKey, &Totals)> = m.iter().collect();
        v.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<RowKey, Totals>, D::Error> {
        let v: Vec<(RowKey, Totals)> = Vec::deserialize(d)?;
        Ok(v.into_iter().collect())
    }
}

impl Ledger {
    /// Charges a task that held `charge` from `from_ms` until it ended at
    /// `to_ms`, running from `running_ms` (its startup before that); then
    /// forgets hours past retention and, over [`MAX_ROWS`], the oldest.
    pub fn charge(&mut self, charge: &Charge, from_ms: u64, to_ms: u64, running_ms: u64) {
        for (hour, t) in charge.by_hour(from_ms, to_ms, running_ms) {
            self.rows.entry(charge.key(hour)).or_default().add(&t);
        }
        let end_hour = to_ms - to_ms % HOUR_MS;
        self.rows.entry(charge.key(end_hour)).or_default().tasks += 1;
        let oldest_kept = to_ms.saturating_sub(RETENTION_MS);
        while let Some((k, _)) = self.rows.first_key_value() {
            if k.hour_ms >= oldest_kept && self.rows.len() <= MAX_ROWS {
                break;
            }
            self.rows.pop_first();
        }
    }

    /// One GPU of `charge`'s task was `util_pct` busy over the period at
    /// `at_ms`: its row of that hour gets the period as sampled GPU time.
    pub fn charge_busy(&mut self, charge: &Charge, at_ms: u64, period_ms: u64, util_pct: u8) {
        self.charge_busy_share(charge, at_ms, period_ms, util_pct, 1000);
    }

    /// [`Ledger::charge_busy`] for a task holding `share_milli`/1000 of
    /// the GPU (a fraction): sampled for its share of the period, busy for
    /// what it used of the whole GPU, at most its share. Returns the
    /// (sampled, busy) ms charged.
    pub fn charge_busy_share(
        &mut self,
        charge: &Charge,
        at_ms: u64,
        period_ms: u64,
        util_pct: u8,
        share_milli: u64,
    ) -> (u64, u64) {
        let sampled = period_ms * share_milli.min(1000) / 1000;
        let busy = (period_ms * u64::from(util_pct.min(100)) / 100).min(sampled);
        let row = self
            .rows
            .entry(charge.key(at_ms - at_ms % HOUR_MS))
            .or_default();
        row.gpu_sampled_ms = row.gpu_sampled_ms.saturating_add(sampled);
        row.gpu_busy_ms = row.gpu_busy_ms.saturating_add(busy);
        (sampled, busy)
    }

    /// Rows of hours that end after `since_ms`.
    pub fn since(&self, since_ms: u64) -> impl Iterator<Item = (&RowKey, &Totals)> {
        let first_hour = since_ms - since_ms % HOUR_MS;
        self.rows.range(
            RowKey {
                hour_ms: first_hour,
                tenant: String::new(),
                user: String::new(),
                gpu_model: String::new(),
            }..,
        )
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

/// How a report groups its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum By {
    Tenant,
    User,
    Job,
    GpuModel,
}

impl std::str::FromStr for By {
    type Err = String;
    fn from_str(s: &str) -> Result<By, String> {
        match s {
            "" | "tenant" => Ok(By::Tenant),
            "user" => Ok(By::User),
            "job" => Ok(By::Job),
            "gpu-model" => Ok(By::GpuModel),
            other => Err(format!(
                "{other:?} is not one of tenant, user, job, gpu-model"
            )),
        }
    }
}

/// One row of a report.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Row {
    pub key: String,
    /// By user and by job: the tenant charged.
    pub tenant: String,
    pub totals: Totals,
    /// Tasks still running, counted up to the report's end.
    pub running: u64,
}

/// Most rows in one report.
pub const MAX_REPORT_ROWS: usize = 10_000;

/// The row of a report by job that holds, per tenant, what no job the
/// state keeps accounts for: jobs forgotten by retention (the ledger
/// keeps no job) and framework tasks.
pub const OTHER_JOBS_KEY: &str = "(forgotten jobs, framework tasks)";

/// A task's busy time in `start..end` added to `t`: a fraction's own
/// readings (scaled to the part of its life in the window); whole GPUs'
/// from their history (a day of periods).
fn add_busy_time(
    state: &super::State,
    task: &super::TaskRecord,
    start: u64,
    end: u64,
    t: &mut Totals,
) {
    let holding = task.holding();
    if holding.fraction().is_some() {
        let life = end.saturating_sub(task.created_at_ms);
        let inside = end.saturating_sub(start);
        let part = |ms: u64| {
            if life == 0 || inside >= life {
                ms
            } else {
                u64::try_from(u128::from(ms) * u128::from(inside) / u128::from(life)).unwrap_or(ms)
            }
        };
        t.gpu_sampled_ms += part(task.gpu_sampled_ms);
        t.gpu_busy_ms += part(task.gpu_busy_ms);
    } else {
        for g in holding.owned() {
            if let Some(h) = state.util_history().gpu(g) {
                for (_, util, _) in h.points(start, end) {
                    t.gpu_sampled_ms += h.period_ms;
                    t.gpu_busy_ms += h.period_ms * u64::from(util) / 100;
                }
            }
        }
    }
}

/// A report over `[since_ms rounded down to its hour, now_ms)`: the
/// ledger's rows plus the tasks still running (up to `now_ms`); by job,
/// the jobs the state still keeps, from their tasks, and per tenant an
/// [`OTHER_JOBS_KEY`] row with the rest of what the ledger charged it, so
/// that a report by job adds up to the one by tenant. With `tenant`, only
/// that tenant's. Rows with the most GPU time first, at most
/// [`MAX_REPORT_ROWS`] (true when some were left out).
pub fn report(
    state: &super::State,
    since_ms: u64,
    now_ms: u64,
    by: By,
    tenant: Option<&str>,
) -> (Vec<Row>, u64, bool) {
    let from = since_ms - since_ms % HOUR_MS;
    let mut rows: BTreeMap<(String, String), Row> = BTreeMap::new();
    let mut add = |key: String, tenant: &str, t: &Totals, running: u64| {
        let row = rows
            .entry((key.clone(), tenant.to_string()))
            .or_insert_with(|| Row {
                key,
                tenant: tenant.to_string(),
                ..Default::default()
            });
        row.totals.add(t);
        row.running += running;
    };
    let key_of = |c_tenant: &str, user: &str, model: &str, job: &str| match by {
        By::Tenant => (c_tenant.to_string(), String::new()),
        By::User => (user.to_string(), c_tenant.to_string()),
        By::GpuModel => (model.to_string(), String::new()),
        By::Job => (job.to_string(), c_tenant.to_string()),
    };
    let mine = |t: &str| tenant.is_none_or(|only| only == t);
    let live = |t: &super::TaskRecord| !t.state.is_terminal();
    // Every charge of the window, (tenant, user, model, totals, running):
    // the ledger's rows, then the running tasks up to now.
    let each_charge = |f: &mut dyn FnMut(&str, &str, &str, &Totals, u64)| {
        for (k, t) in state.usage().since(from) {
            if mine(&k.tenant) {
                f(&k.tenant, &k.user, &k.gpu_model, t, 0);
            }
        }
        for task in state.tasks().values().filter(|t| live(t)) {
            let c = state.charge_of(task);
            if !mine(&c.tenant) {
                continue;
            }
            let t = c.over_running_from(
                task.created_at_ms.max(from),
                now_ms.max(from),
                task.running_at_ms.unwrap_or(now_ms),
            );
            f(&c.tenant, &c.user, &c.gpu_model, &t, 1);
        }
    };
    if by == By::Job {
        // What the kept jobs account for, per tenant.
        let mut of_jobs: BTreeMap<String, (Totals, u64)> = BTreeMap::new();
        for job in state.jobs().values() {
            for task in job.task_ids.iter().filter_map(|id| state.task(id)) {
                let c = state.charge_of(task);
                if !mine(&c.tenant) {
                    continue;
                }
                let end = if live(task) {
                    now_ms
                } else {
                    task.updated_at_ms
                };
                let start = task.created_at_ms.max(from);
                if end < from {
                    continue;
                }
                let mut t =
                    c.over_running_from(start, end.max(start), task.running_at_ms.unwrap_or(end));
                add_busy_time(state, task, start, end, &mut t);
                let running = u64::from(live(task));
                t.tasks = u64::from(!live(task));
                let (k, tn) = key_of(&c.tenant, &c.user, &c.gpu_model, &job.id);
                let e = of_jobs.entry(c.tenant.clone()).or_default();
                e.0.add(&t);
                e.1 += running;
                add(k, &tn, &t, running);
            }
        }
        let mut all: BTreeMap<String, (Totals, u64)> = BTreeMap::new();
        each_charge(&mut |tenant, _, _, t, running| {
            let e = all.entry(tenant.to_string()).or_default();
            e.0.add(t);
            e.1 += running;
        });
        for (tenant, (t, running)) in all {
            let (jobs, jobs_running) = of_jobs.get(&tenant).cloned().unwrap_or_default();
            let rest = t.saturating_sub(&jobs);
            let rest_running = running.saturating_sub(jobs_running);
            if rest.gpu_ms > 0
                || rest.cpu_ms > 0
                || rest.mem_mib_ms > 0
                || rest.tasks > 0
                || rest_running > 0
            {
                add(OTHER_JOBS_KEY.to_string(), &tenant, &rest, rest_running);
            }
        }
    } else {
        each_charge(&mut |tenant, user, model, t, running| {
            let (key, tn) = key_of(tenant, user, model, "");
            add(key, &tn, t, running);
        });
    }
    let mut out: Vec<Row> = rows.into_values().collect();
    out.sort_by(|a, b| {
        b.totals
            .gpu_ms
            .cmp(&a.totals.gpu_ms)
            .then_with(|| a.key.cmp(&b.key))
    });
    let truncated = out.len() > MAX_REPORT_ROWS;
    out.truncate(MAX_REPORT_ROWS);
    (out, from, truncated)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn charge(gpu_milli: u64) -> Charge {
        Charge {
            tenant: "vision".into(),
            user: "tok-1".into(),
            gpu_model: "A100".into(),
            gpu_milli,
            cpu_milli: 1500,
            mem_mib: 1024,
        }
    }

    #[test]
    fn a_task_is_split_at_hour_boundaries_and_adds_up() {
        let mut l = Ledger::default();
        // 2 GPUs from 00:30 to 02:15: 30 min, 60 min, 15 min.
        let from = HOUR_MS / 2;
        let to = 2 * HOUR_MS + HOUR_MS / 4;
        // It ran from 01:30: its first hour is startup, half the second.
        l.charge(&charge(2000), from, to, HOUR_MS + HOUR_MS / 2);
        let startup: Vec<u64> = l.since(0).map(|(_, t)| t.gpu_startup_ms).collect();
        assert_eq!(startup, [HOUR_MS, HOUR_MS, 0]);
        let rows: Vec<(u64, u64, u64)> = l
            .since(0)
            .map(|(k, t)| (k.hour_ms / HOUR_MS, t.gpu_ms, t.tasks))
            .collect();
        assert_eq!(
            rows,
            [(0, HOUR_MS, 0), (1, 2 * HOUR_MS, 0), (2, HOUR_MS / 2, 1)]
        );
        let mut sum = Totals::default();
        l.since(0).for_each(|(_, t)| sum.add(t));
        let ms = to - from;
        assert_eq!(sum.gpu_ms, 2 * ms);
        assert_eq!(sum.cpu_ms, ms * 3 / 2);
        assert_eq!(sum.mem_mib_ms, 1024 * ms);
        // A window starting inside hour 1 gets hours 1 and 2.
        assert_eq!(l.since(HOUR_MS + 5).count(), 2);
        // A fraction: a quarter of a GPU.
        assert_eq!(charge(250).over(0, 4000).gpu_ms, 1000);
        // The rows survive a snapshot.
        let back: Ledger = serde_json::from_slice(&serde_json::to_vec(&l).unwrap()).unwrap();
        assert_eq!(back, l);
    }

    /// A report: ended tasks from the ledger, running ones up to now, by
    /// tenant, token, job and model; a tenant sees only its own; the
    /// master's records give the tenant and the submitting token.
    #[test]
    fn reports_group_scope_and_count_running_tasks() {
        use crate::state::testkit::{status, Driver};
        use crate::state::Command;
        use gpuctl_core::types::{JobSpec, Resources, TaskState};
        let mut d = Driver::new(&[("a", 4)]);
        let spec = |tenant: &str, user: &str, gpus: u32| {
            let mut s = JobSpec::new(
                "j",
                vec!["true".into()],
                Resources {
                    cpus: 2.0,
                    mem_mib: 100,
                    gpus,
                    ports: 0,
                },
            );
            s.tenant = tenant.into();
            s.submitted_by = user.into();
            s
        };
        let vision = d.submit(spec("vision", "tok-v", 2));
        let nlp = d.submit(spec("nlp", "tok-n", 1));
        d.launch_at(&vision, &[("a", &["GPU-a-0", "GPU-a-1"])], HOUR_MS)
            .unwrap();
        d.launch_at(&nlp, &[("a", &["GPU-a-2"])], HOUR_MS).unwrap();
        // vision's task ends after 30 min; nlp's still runs.
        let mut done = status("a", "job-1.0", TaskState::Finished);
        done.exit_code = Some(0);
        d.apply(Command::UpdateTaskStatus {
            update: done,
            at_ms: HOUR_MS + HOUR_MS / 2,
        })
        .unwrap();
        let now = 2 * HOUR_MS;
        let (rows, from, truncated) = report(&d.s, HOUR_MS + 5, now, By::Tenant, None);
        assert_eq!((from, truncated), (HOUR_MS, false));
        let got: Vec<(&str, u64, u64, u64)> = rows
            .iter()
            .map(|r| (r.key.as_str(), r.totals.gpu_ms, r.totals.tasks, r.running))
            .collect();
        assert_eq!(got, [("nlp", HOUR_MS, 0, 1), ("vision", HOUR_MS, 1, 0)]);
        assert_eq!(rows[1].totals.cpu_ms, HOUR_MS);
        // A tenant's view, by its tokens.
        let (rows, ..) = report(&d.s, 0, now, By::User, Some("nlp"));
        assert_eq!(rows.len(), 1);
        assert_eq!(
            (rows[0].key.as_str(), rows[0].tenant.as_str()),
            ("tok-n", "nlp")
        );
        // By job and by model agree with the ledger.
        let (rows, ..) = report(&d.s, 0, now, By::Job, None);
        let jobs: Vec<(&str, u64)> = rows
            .iter()
            .map(|r| (r.key.as_str(), r.totals.gpu_ms))
            .collect();
        assert_eq!(jobs, [("job-1", HOUR_MS), ("job-2", HOUR_MS)]);
        let (rows, ..) = report(&d.s, 0, now, By::GpuModel, None);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].totals.gpu_ms, 2 * HOUR_MS);
        // A period of readings: nlp's GPU was 50% busy, a free GPU 90%
        // (history only). The report puts it beside the allocation.
        d.apply(Command::RecordUtilization {
            at_ms: now,
            period_ms: 60_000,
            points: vec![
                crate::state::util::UtilPoint {
                    gpu: "GPU-a-2".into(),
                    util_pct: 50,
                    mem_pct: 10,
                    tasks: Vec::new(),
                    task_mem: Vec::new(),
                },
                crate::state::util::UtilPoint {
                    gpu: "GPU-a-3".into(),
                    util_pct: 90,
                    mem_pct: 0,
                    tasks: Vec::new(),
                    task_mem: Vec::new(),
                },
            ],
            idle_window_ms: 0,
            idle_below_pct: 0,
        })
        .unwrap();
        assert_eq!(d.s.util_history().gpus.len(), 2);
        let (rows, ..) = report(&d.s, 0, now + 60_000, By::Tenant, Some("nlp"));
        assert_eq!(
            (rows[0].totals.gpu_sampled_ms, rows[0].totals.gpu_busy_ms),
            (60_000, 30_000)
        );
        assert_eq!(rows[0].totals.util_pct(), Some(50.0));
        let (rows, ..) = report(&d.s, 0, now + 60_000, By::Job, Some("nlp"));
        assert_eq!(rows[0].totals.util_pct(), Some(50.0));
        // A window after the end sees only the running task.
        let (rows, ..) = report(&d.s, now, now + HOUR_MS, By::Tenant, None);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].key, "nlp");
        assert_eq!(
            "team".parse::<By>().unwrap_err(),
            "\"team\" is not one of tenant, user, job, gpu-model"
        );
    }

    /// What a task held before it ran (launch to RUNNING) is charged and
    /// shown apart, as `gpu_startup_ms`, by the ledger and for a running
    /// task alike; a job forgotten by retention stays in reports by job, in
    /// its tenant's row of what no kept job accounts for, so that the
    /// report by job adds up to the one by tenant.
    #[test]
    fn startup_is_apart_and_forgotten_jobs_stay_in_reports_by_job() {
        use crate::state::testkit::{status, Driver};
        use crate::state::Command;
        use gpuctl_core::types::{JobSpec, Resources, TaskState};
        let mut d = Driver::new(&[("a", 2)]);
        let spec = || {
            let mut s = JobSpec::new(
                "j",
                vec!["true".into()],
                Resources {
                    cpus: 1.0,
                    mem_mib: 0,
                    gpus: 1,
                    ports: 0,
                },
            );
            s.tenant = "vision".into();
            s
        };
        let min = 60_000;
        let (old, live) = (d.submit(spec()), d.submit(spec()));
        d.launch_at(&old, &[("a", &["GPU-a-0"])], HOUR_MS).unwrap();
        d.launch_at(&live, &[("a", &["GPU-a-1"])], HOUR_MS).unwrap();
        // Each ran 5 minutes after its launch (an image pulled).
        for t in ["job-1.0", "job-2.0"] {
            d.apply(Command::UpdateTaskStatus {
                update: status("a", t, TaskState::Running),
                at_ms: HOUR_MS + 5 * min,
            })
            .unwrap();
        }
        let mut done = status("a", "job-1.0", TaskState::Finished);
        done.exit_code = Some(0);
        d.apply(Command::UpdateTaskStatus {
            update: done,
            at_ms: HOUR_MS + 20 * min,
        })
        .unwrap();
        let now = HOUR_MS + 30 * min;
        let (rows, ..) = report(&d.s, 0, now, By::Tenant, None);
        assert_eq!(
            (rows[0].totals.gpu_ms, rows[0].totals.gpu_startup_ms),
            (50 * min, 10 * min),
            "20 + 30 minutes held, 5 + 5 of them before running"
        );
        // job-1 is forgotten: its row by job goes, its charge stays.
        d.apply(Command::ForgetJobs {
            job_ids: vec![old.clone()],
            at_ms: now,
        })
        .unwrap();
        assert!(d.s.job(&old).is_none());
        let (rows, ..) = report(&d.s, 0, now, By::Job, None);
        let got: Vec<(&str, &str, u64, u64, u64, u64)> = rows
            .iter()
            .map(|r| {
                (
                    r.key.as_str(),
                    r.tenant.as_str(),
                    r.totals.gpu_ms,
                    r.totals.gpu_startup_ms,
                    r.totals.tasks,
                    r.running,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (live.as_str(), "vision", 30 * min, 5 * min, 0, 1),
                (OTHER_JOBS_KEY, "vision", 20 * min, 5 * min, 1, 0),
            ]
        );
        // Nothing left over while every job is kept.
        let (rows, ..) = report(&d.s, 0, now, By::Job, Some("nlp"));
        assert!(rows.is_empty(), "{rows:?}");
    }

    /// A running job whose GPUs all stay under the threshold for the
    /// window is flagged idle (once), and busy again at its first busy
    /// period; a job that has not run the window yet, or has one GPU busy,
    /// is not.
    #[test]
    fn idle_jobs_are_flagged_and_unflagged() {
        use crate::state::events::EventKind;
        use crate::state::testkit::{status, Driver};
        use crate::state::util::UtilPoint;
        use crate::state::Command;
        use gpuctl_core::types::{JobSpec, Resources, TaskState};
        let mut d = Driver::new(&[("a", 4)]);
        let spec = |gpus: u32| {
            JobSpec::new(
                "j",
                vec!["true".into()],
                Resources {
                    cpus: 1.0,
                    mem_mib: 1,
                    gpus,
                    ports: 0,
                },
            )
        };
        let idle = d.submit(spec(2));
        let half = d.submit(spec(1));
        let late = d.submit(spec(1));
        d.launch_at(&idle, &[("a", &["GPU-a-0", "GPU-a-1"])], 0)
            .unwrap();
        d.launch_at(&half, &[("a", &["GPU-a-2"])], 0).unwrap();
        d.launch_at(&late, &[("a", &["GPU-a-3"])], 1500).unwrap();
        for t in ["job-1.0", "job-2.0", "job-3.0"] {
            d.apply(Command::UpdateTaskStatus {
                update: status("a", t, TaskState::Running),
                at_ms: 1,
            })
            .unwrap();
        }
        let period = |d: &mut Driver, at: u64, utils: [u8; 4]| {
            let points = utils
                .iter()
                .enumerate()
                .map(|(i, u)| UtilPoint {
                    gpu: format!("GPU-a-{i}"),
                    util_pct: *u,
                    mem_pct: 0,
                    tasks: Vec::new(),
                    task_mem: Vec::new(),
                })
                .collect();
            d.apply(Command::RecordUtilization {
                at_ms: at,
                period_ms: 1000,
                points,
                idle_window_ms: 3000,
                idle_below_pct: 5,
            })
            .unwrap();
        };
        let kinds = |d: &Driver, j: &str| -> Vec<EventKind> {
            d.s.job(j).unwrap().events.iter().map(|e| e.kind).collect()
        };
        period(&mut d, 0, [1, 0, 10, 0]);
        period(&mut d, 1000, [2, 4, 1, 0]);
        assert!(
            d.s.job(&idle).unwrap().idle_since_ms.is_none(),
            "not a window yet"
        );
        period(&mut d, 2000, [0, 3, 2, 0]);
        let job = d.s.job(&idle).unwrap();
        assert_eq!(job.idle_since_ms, Some(0));
        let ev = job.events.iter().last().unwrap();
        assert_eq!(ev.kind, EventKind::Idle);
        assert!(
            ev.message
                .contains("2 GPU(s) stayed under 5% for 3 s (mean 1.7%)"),
            "{}",
            ev.message
        );
        // One busy period in the window: not idle; launched within it: not yet.
        assert!(d.s.job(&half).unwrap().idle_since_ms.is_none());
        assert!(d.s.job(&late).unwrap().idle_since_ms.is_none());
        // Still idle: no second event.
        period(&mut d, 3000, [0, 0, 0, 0]);
        assert_eq!(
            kinds(&d, &idle)
                .iter()
                .filter(|k| **k == EventKind::Idle)
                .count(),
            1
        );
        assert!(d.s.job(&half).unwrap().idle_since_ms.is_some());
        // Busy again on one of its GPUs.
        period(&mut d, 4000, [0, 60, 0, 0]);
        assert!(d.s.job(&idle).unwrap().idle_since_ms.is_none());
        assert_eq!(kinds(&d, &idle).last(), Some(&EventKind::Busy));
        // late, launched at 1.5 s: idle over the first whole window after
        // its launch, from 2 s.
        assert_eq!(d.s.job(&late).unwrap().idle_since_ms, Some(2000));
        // The default tenant stops jobs idle 2 s past their flag: late
        // (flagged at 5 s) is stopped at the period ending at 7 s, and
        // ends CANCELLED saying why, though its task exits 0.
        d.apply(Command::SetQuota {
            tenant: "default".into(),
            gpus: 0,
            borrow: None,
            clear_borrow: false,
            weight: None,
            stop_idle_after_ms: Some(2000),
            clear_stop_idle: false,
        })
        .unwrap();
        period(&mut d, 5000, [0, 60, 0, 0]);
        assert!(d.s.job(&late).unwrap().stopping.is_none());
        period(&mut d, 6000, [0, 60, 0, 0]);
        let job = d.s.job(&late).unwrap();
        assert!(job.stopping.is_some());
        assert!(d.s.task("job-3.0").unwrap().kill_requested);
        let mut ended = status("a", "job-3.0", TaskState::Finished);
        ended.exit_code = Some(0);
        d.apply(Command::UpdateTaskStatus {
            update: ended,
            at_ms: 6500,
        })
        .unwrap();
        let job = d.s.job(&late).unwrap();
        assert_eq!(job.state, gpuctl_core::types::JobState::Cancelled);
        assert!(
            job.message.contains("tenant default stops idle jobs"),
            "{}",
            job.message
        );
        // The busy job was never stopped.
        assert!(d.s.job(&idle).unwrap().stopping.is_none());
    }

    #[test]
    fn the_ledger_is_bounded_by_retention() {
        let mut l = Ledger::default();
        l.charge(&charge(1000), 0, HOUR_MS, 0);
        let later = RETENTION_MS + 3 * HOUR_MS;
        l.charge(&charge(1000), later, later + 10, later);
        assert!(l.since(0).all(|(k, _)| k.hour_ms >= later - RETENTION_MS));
        assert_eq!(l.len(), 1);
    }
}
