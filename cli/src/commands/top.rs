//! `gpuctl top`: a live table of every GPU of the cluster with the latest
//! reading of its gauges (utilization, memory, temperature, power), its
//! health and the task holding it; under a shared GPU, a row per task with
//! the memory its processes use next to its fraction.
//!
//! The figures come from the master's `ListGpus`: each agent's health probe
//! reads its GPUs and sends the readings to the leader with every heartbeat.
//! A GPU without a reading (simulated GPUs, a follower master, an agent that
//! has not sent one yet) shows `-`.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::io::{IsTerminal, Write};
use std::time::Duration;

use clap::Args;
use gpuctl_proto::pb;
use serde::{Deserialize, Serialize};
use tokio::time::{Instant, MissedTickBehavior};

use super::{now_ms, one_line, CliError, EXIT_OK};
use crate::client::{Master, Retry, LEADER_DEADLINE, RPC_TIMEOUT};
use crate::output::{self, Table};

/// Longest `--interval`, in seconds.
pub const MAX_INTERVAL_SECS: f64 = 3600.0;

/// Width of the utilization bar, in characters.
const BAR_WIDTH: u32 = 10;

/// Clears the screen and moves the cursor home.
const CLEAR: &str = "\x1b[H\x1b[2J";

/// `gpuctl top [--interval SECS] [--once] [--json] [--agent ID]`.
#[derive(Debug, Clone, Args)]
pub struct TopArgs {
    /// Seconds between refreshes: more than 0 and at most 3600; fractions
    /// are allowed (0.5).
    #[arg(
        long,
        value_name = "SECS",
        default_value = "2",
        allow_negative_numbers = true,
        value_parser = parse_interval
    )]
    pub interval: Duration,
    /// Print one table and exit.
    #[arg(long)]
    pub once: bool,
    /// Print one sample as JSON and exit (implies --once).
    #[arg(long)]
    pub json: bool,
    /// Only the GPUs of this agent (its id or its hostname).
    #[arg(long, value_name = "ID")]
    pub agent: Option<String>,
}

impl TopArgs {
    /// One sample only: `--once`, or `--json` (which implies it).
    pub fn is_once(&self) -> bool {
        self.once || self.json
    }
}

/// Parses `--interval`: a number of seconds, more than 0, at most 3600.
pub fn parse_interval(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| "not a number of seconds".to_string())?;
    let bad = || "must be more than 0 and at most 3600 seconds".to_string();
    if !v.is_finite() || v <= 0.0 || v > MAX_INTERVAL_SECS {
        return Err(bad());
    }
    let d = Duration::from_secs_f64(v);
    // Below a nanosecond rounds to nothing: a busy loop, and tokio's
    // interval refuses a zero period.
    if d.is_zero() {
        return Err(bad());
    }
    Ok(d)
}

/// One GPU in `gpuctl top --once --json` (and one row of the table).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopGpuJson {
    pub agent_id: String,
    /// Of the agent; empty when the master does not say.
    pub hostname: String,
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub healthy: bool,
    /// Why it is unhealthy; empty when healthy.
    pub unhealthy_reason: String,
    /// Taken out of service by an operator (`gpuctl gpus cordon`).
    pub cordoned: bool,
    /// The reading (all `null` when there is none): busy time, 0-100.
    pub utilization_pct: Option<u32>,
    pub memory_used_mib: Option<u64>,
    pub memory_total_mib: Option<u64>,
    /// Also `null` when the GPU does not report it.
    pub temperature_c: Option<u32>,
    /// Also `null` when the GPU does not report it.
    pub power_w: Option<f64>,
    /// Critical XID events seen since the agent started.
    pub xid_errors: Option<u64>,
    /// When the agent read it: ms since the Unix epoch, agent's clock.
    pub sampled_at_ms: Option<u64>,
    /// The task holding the GPU; `null` when it is free.
    pub task_id: Option<String>,
    /// The gpuctl job of that task; `null` when free or not a gpuctl job.
    pub job_id: Option<String>,
    /// `mps` or `time-slice` when the GPU is shared by fractions; `null`
    /// when it is not.
    #[serde(default)]
    pub share_mode: Option<String>,
    /// The fractions held of a shared GPU, by task; empty otherwise.
    #[serde(default)]
    pub shares: Vec<TopShareJson>,
}

/// A task's fraction of a shared GPU in `gpuctl top --json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopShareJson {
    pub task_id: String,
    /// The fraction's memory.
    pub mem_mib: u64,
    /// The fraction's compute; 0: none asked.
    pub compute_pct: u32,
    /// Memory its processes use on the GPU (NVML's per-process
    /// accounting); `null` when the reading does not have it (no reading,
    /// no process on the GPU, or one the agent could not attribute).
    pub memory_used_mib: Option<u64>,
}

fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}

impl From<&pb::GpuStatus> for TopGpuJson {
    fn from(s: &pb::GpuStatus) -> Self {
        let g = s.gpu.clone().unwrap_or_default();
        let r = s.sample.as_ref();
        TopGpuJson {
            agent_id: s.agent_id.clone(),
            hostname: s.hostname.clone(),
            index: g.index,
            uuid: g.uuid,
            model: g.model,
            healthy: g.healthy,
            unhealthy_reason: g.unhealthy_reason,
            cordoned: s.cordoned,
            utilization_pct: r.map(|r| r.utilization_pct),
            memory_used_mib: r.map(|r| r.memory_used_mib),
            memory_total_mib: r.map(|r| r.memory_total_mib),
            temperature_c: r.and_then(|r| r.temperature_c),
            power_w: r.and_then(|r| r.power_w).filter(|p| p.is_finite()),
            xid_errors: r.map(|r| r.xid_errors),
            sampled_at_ms: r.map(|r| r.sampled_at_ms),
            task_id: non_empty(&s.task_id),
            job_id: non_empty(&s.job_id),
            share_mode: non_empty(&s.share_mode),
            shares: s
                .shares
                .iter()
                .map(|h| TopShareJson {
                    task_id: h.task_id.clone(),
                    mem_mib: h.mem_mib,
                    compute_pct: h.compute_pct,
                    memory_used_mib: r
                        .and_then(|r| r.task_memory_used_mib.get(&h.task_id))
                        .copied(),
                })
                .collect(),
        }
    }
}

impl TopGpuJson {
    /// The AGENT column: the hostname, else the agent id.
    pub fn agent_name(&self) -> &str {
        if self.hostname.is_empty() {
            &self.agent_id
        } else {
            &self.hostname
        }
    }

    /// Held whole, or a fraction of it.
    fn busy(&self) -> bool {
        self.task_id.is_some() || !self.shares.is_empty()
    }

    fn has_reading(&self) -> bool {
        self.sampled_at_ms.is_some()
    }
}

/// The rows of `top`: the GPUs of `agent` (an id or a hostname; all when
/// `None`), sorted by agent (as shown), then index.
pub fn rows(gpus: &[pb::GpuStatus], agent: Option<&str>) -> Vec<TopGpuJson> {
    let mut rows: Vec<TopGpuJson> = gpus
        .iter()
        .map(TopGpuJson::from)
        .filter(|r| agent.is_none_or(|a| r.agent_id == a || r.hostname == a))
        .collect();
    rows.sort_by(|a, b| {
        (a.agent_name(), &a.agent_id, a.index).cmp(&(b.agent_name(), &b.agent_id, b.index))
    });
    rows
}

// ---------------------------------------------------------------- rendering

/// ` 87% [|||||||||.]`: the percentage, then a bar of 10 (no blanks in
/// it, so that `awk` sees two words).
pub fn fmt_util(pct: u32) -> String {
    let pct = pct.min(100);
    let filled = (pct * BAR_WIDTH + 50) / 100;
    format!(
        "{pct:>3}% [{}{}]",
        "|".repeat(filled as usize),
        ".".repeat((BAR_WIDTH - filled) as usize)
    )
}

/// GiB with one decimal, without a trailing `.0`.
fn gib(mib: u64) -> String {
    let s = format!("{:.1}", mib as f64 / 1024.0);
    s.strip_suffix(".0").map(str::to_string).unwrap_or(s)
}

/// `used/total`: in GiB (`12.5/40GiB`) from 1 GiB of total, else in MiB.
pub fn fmt_memory(used_mib: u64, total_mib: u64) -> String {
    if total_mib == 0 {
        output::fmt_mib(used_mib)
    } else if total_mib >= 1024 {
        format!("{}/{}GiB", gib(used_mib), gib(total_mib))
    } else {
        format!("{used_mib}/{total_mib}MiB")
    }
}

/// OK, UNHEALTHY, CORDONED, or UNHEALTHY,CORDONED.
pub fn health_word(healthy: bool, cordoned: bool) -> &'static str {
    match (healthy, cordoned) {
        (true, false) => "OK",
        (true, true) => "CORDONED",
        (false, false) => "UNHEALTHY",
        (false, true) => "UNHEALTHY,CORDONED",
    }
}

/// The TASK column: the task id, followed by its job id in parentheses
/// unless the task id already starts with it (`job-7.0` of `job-7`); empty
/// (shown `-`) when free.
pub fn fmt_task(task_id: Option<&str>, job_id: Option<&str>) -> String {
    match (task_id, job_id) {
        (None, _) => String::new(),
        (Some(t), None) => t.to_string(),
        (Some(t), Some(j)) if t.strip_prefix(j).is_some_and(|r| r.starts_with('.')) => {
            t.to_string()
        }
        (Some(t), Some(j)) => format!("{t} ({j})"),
    }
}

/// The AGENT label of each row: the hostname; the agent id when there is
/// no hostname or when several agents share it (two agents on one host).
pub fn agent_labels(rows: &[TopGpuJson]) -> Vec<String> {
    let mut ids: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for r in rows {
        ids.entry(r.hostname.as_str())
            .or_default()
            .insert(r.agent_id.as_str());
    }
    rows.iter()
        .map(|r| {
            let shared = ids.get(r.hostname.as_str()).is_some_and(|s| s.len() > 1);
            if r.hostname.is_empty() || shared {
                r.agent_id.clone()
            } else {
                r.hostname.clone()
            }
        })
        .collect()
}

/// A share row's MODEL cell: `└ share`, with the compute asked
/// (`└ share 30%`).
fn share_label(compute_pct: u32) -> String {
    if compute_pct > 0 {
        format!("└ share {compute_pct}%")
    } else {
        "└ share".to_string()
    }
}

/// The table: AGENT, IDX, MODEL, UTIL, MEMORY, TEMP, POWER, HEALTH, TASK.
/// A missing reading (or gauge) renders as `-`. Under a shared GPU, a row
/// per fraction held: its task, and the memory the task's processes use
/// over the fraction's (`3.1/10GiB`; `-/10GiB` without a figure).
pub fn top_table(rows: &[TopGpuJson]) -> Table {
    let mut t = Table::new(&[
        "AGENT", "IDX", "MODEL", "UTIL", "MEMORY", "TEMP", "POWER", "HEALTH", "TASK",
    ]);
    for (r, agent) in rows.iter().zip(agent_labels(rows)) {
        let memory = match (r.memory_used_mib, r.memory_total_mib) {
            (Some(used), Some(total)) => fmt_memory(used, total),
            _ => String::new(),
        };
        t.row(vec![
            agent.clone(),
            r.index.to_string(),
            // The vendor is the same on every row; keep the table narrow.
            r.model
                .strip_prefix("NVIDIA ")
                .unwrap_or(&r.model)
                .to_string(),
            r.utilization_pct.map(fmt_util).unwrap_or_default(),
            memory,
            r.temperature_c.map(|c| format!("{c}C")).unwrap_or_default(),
            r.power_w.map(|w| format!("{w:.0}W")).unwrap_or_default(),
            health_word(r.healthy, r.cordoned).to_string(),
            fmt_task(r.task_id.as_deref(), r.job_id.as_deref()),
        ]);
        for h in &r.shares {
            let memory = match h.memory_used_mib {
                Some(used) => fmt_memory(used, h.mem_mib),
                None => format!("-/{}", output::fmt_mib(h.mem_mib)),
            };
            t.row(vec![
                agent.clone(),
                r.index.to_string(),
                share_label(h.compute_pct),
                String::new(),
                memory,
                String::new(),
                String::new(),
                String::new(),
                h.task_id.clone(),
            ]);
        }
    }
    t
}

/// The header line: time, GPUs, how many are busy, unhealthy, cordoned and
/// without a reading; the refresh interval in live mode.
pub fn header(
    rows: &[TopGpuJson],
    at_ms: u64,
    agent: Option<&str>,
    interval: Option<Duration>,
) -> String {
    let count = |f: fn(&TopGpuJson) -> bool| rows.iter().filter(|r| f(r)).count();
    let n = rows.len();
    let mut s = format!(
        "{}  {n} GPU{}",
        output::fmt_timestamp(at_ms),
        if n == 1 { "" } else { "s" }
    );
    if let Some(a) = agent {
        s.push_str(&format!(" of agent {a}"));
    }
    s.push_str(&format!(
        ": {} busy, {} unhealthy",
        count(TopGpuJson::busy),
        count(|r| !r.healthy)
    ));
    let cordoned = count(|r| r.cordoned);
    if cordoned > 0 {
        s.push_str(&format!(", {cordoned} cordoned"));
    }
    let unread = count(|r| !r.has_reading());
    if unread > 0 {
        s.push_str(&format!(", {unread} without a reading"));
    }
    if let Some(i) = interval {
        s.push_str(&format!("  (every {}s)", i.as_secs_f64()));
    }
    s
}

/// One sample: the header, the table, and why each unhealthy GPU is.
pub fn render_sample(
    rows: &[TopGpuJson],
    at_ms: u64,
    agent: Option<&str>,
    interval: Option<Duration>,
) -> String {
    let mut s = header(rows, at_ms, agent, interval);
    s.push('\n');
    s.push_str(&top_table(rows).render());
    for (r, agent) in rows.iter().zip(agent_labels(rows)) {
        if r.healthy {
            continue;
        }
        let why = if r.unhealthy_reason.is_empty() {
            "no reason given".to_string()
        } else {
            one_line(&r.unhealthy_reason)
        };
        s.push_str(&format!("{agent} GPU {} UNHEALTHY: {why}\n", r.index));
    }
    s
}

// ---------------------------------------------------------------- running

/// Fetches every GPU. Live refreshes (`live` is the interval) give up
/// sooner than a one-off call, so that an error shows before the next
/// refresh is due rather than after the 15 s search for a leader.
async fn fetch(
    master: &mut Master,
    live: Option<Duration>,
) -> Result<Vec<pb::GpuStatus>, CliError> {
    let resp = match live {
        None => {
            master
                .call(Retry::Always, |mut c| async move {
                    c.list_gpus(pb::ListGpusRequest {}).await
                })
                .await?
        }
        Some(interval) => {
            let attempt = interval.clamp(Duration::from_secs(1), RPC_TIMEOUT);
            let deadline = Instant::now() + interval.clamp(Duration::from_secs(2), LEADER_DEADLINE);
            master
                .call_until(Retry::Always, Some(attempt), deadline, |mut c| async move {
                    c.list_gpus(pb::ListGpusRequest {}).await
                })
                .await?
        }
    };
    Ok(resp.gpus)
}

/// `gpuctl top`: one sample with `--once`/`--json`, else refreshes until
/// Ctrl-C.
pub async fn run(master: &mut Master, args: TopArgs, out: &mut dyn Write) -> Result<u8, CliError> {
    if args.is_once() {
        once(master, &args, out).await?;
        return Ok(EXIT_OK);
    }
    let tty = std::io::stdout().is_terminal();
    live(master, &args, out, tty, ctrl_c()).await
}

/// Resolves on Ctrl-C; never when the signal cannot be caught (then Ctrl-C
/// ends the process the default way).
async fn ctrl_c() {
    if tokio::signal::ctrl_c().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Prints one sample: the table, or the JSON array with `--json`.
pub async fn once(
    master: &mut Master,
    args: &TopArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let gpus = fetch(master, None).await?;
    let rows = rows(&gpus, args.agent.as_deref());
    if args.json {
        out.write_all(output::to_json(&rows)?.as_bytes())?;
    } else {
        let text = render_sample(&rows, now_ms(), args.agent.as_deref(), None);
        out.write_all(text.as_bytes())?;
    }
    Ok(())
}

/// Refreshes every `--interval` until `stop` resolves. On a terminal each
/// sample replaces the previous one (ANSI clear screen and cursor home);
/// otherwise samples follow one another, separated by a blank line. The
/// first sample must succeed (else the usual error); after that a failed
/// refresh keeps the last sample on screen with an error line under it (on
/// stderr when not a terminal) and is tried again at the next interval.
pub async fn live(
    master: &mut Master,
    args: &TopArgs,
    out: &mut dyn Write,
    tty: bool,
    stop: impl Future<Output = ()>,
) -> Result<u8, CliError> {
    let agent = args.agent.as_deref();
    let mut ticker = tokio::time::interval(args.interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    tokio::pin!(stop);
    // The last sample shown.
    let mut last: Option<String> = None;
    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = ticker.tick() => {}
        }
        // The first call may take the usual time to find the leader.
        let limit = last.as_ref().map(|_| args.interval);
        let fetched = tokio::select! {
            _ = &mut stop => break,
            r = fetch(master, limit) => r,
        };
        match fetched {
            Ok(gpus) => {
                let text = render_sample(&rows(&gpus, agent), now_ms(), agent, Some(args.interval));
                if tty {
                    out.write_all(format!("{CLEAR}{text}").as_bytes())?;
                } else {
                    out.write_all(format!("{text}\n").as_bytes())?;
                }
                last = Some(text);
            }
            Err(e) => {
                let Some(text) = &last else {
                    return Err(e);
                };
                let line = format!(
                    "error: {} (at {}; retrying every {}s)",
                    one_line(&e.to_string()),
                    output::fmt_timestamp(now_ms()),
                    args.interval.as_secs_f64()
                );
                if tty {
                    out.write_all(format!("{CLEAR}{text}\n{line}\n").as_bytes())?;
                } else {
                    eprintln!("{line}");
                }
            }
        }
        out.flush()?;
    }
    out.flush()?;
    Ok(EXIT_OK)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    use clap::Parser;
    use serde_json::json;

    use super::*;
    use crate::commands::{testkit, Cli, Command, EXIT_FAILURE};

    fn gpu(agent: &str, host: &str, index: u32) -> pb::GpuStatus {
        pb::GpuStatus {
            gpu: Some(pb::Gpu {
                uuid: format!("GPU-{agent}-{index}"),
                index,
                model: "NVIDIA A100-SXM4-40GB".into(),
                memory_mib: 40960,
                healthy: true,
                ..Default::default()
            }),
            agent_id: agent.into(),
            hostname: host.into(),
            ..Default::default()
        }
    }

    fn sample(util: u32, used: u64) -> pb::GpuSample {
        pb::GpuSample {
            utilization_pct: util,
            memory_used_mib: used,
            memory_total_mib: 40960,
            temperature_c: Some(61),
            power_w: Some(245.4),
            sampled_at_ms: 1_700_000_000_000,
            xid_errors: 0,
            task_memory_used_mib: Default::default(),
            task_utilization_pct: Default::default(),
            task_utilization_read: false,
        }
    }

    /// A busy GPU with a reading, a free one without, an unhealthy one and
    /// a cordoned one, in no order.
    fn cluster() -> Vec<pb::GpuStatus> {
        let mut busy = gpu("agent-b", "node1", 0);
        busy.sample = Some(sample(87, 12800));
        busy.task_id = "job-7.0".into();
        busy.job_id = "job-7".into();
        let free = gpu("agent-b", "node1", 1);
        let mut sick = gpu("agent-a", "node2", 0);
        if let Some(g) = sick.gpu.as_mut() {
            g.healthy = false;
            g.unhealthy_reason = "XID 79\n(fell off the bus)".into();
        }
        sick.sample = Some(pb::GpuSample {
            temperature_c: None,
            power_w: None,
            xid_errors: 2,
            ..sample(0, 0)
        });
        let mut cordoned = gpu("agent-a", "node2", 1);
        cordoned.cordoned = true;
        vec![cordoned, free, sick, busy]
    }

    fn cells(line: &str) -> Vec<String> {
        // Cells are separated by two spaces at least; the UTIL cell has
        // single spaces inside.
        line.split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(str::to_string)
            .collect()
    }

    fn table_lines(rows: &[TopGpuJson]) -> Vec<Vec<String>> {
        top_table(rows).render().lines().map(cells).collect()
    }

    #[test]
    fn top_interval_parses_and_is_bounded() {
        assert_eq!(parse_interval("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_interval("0.5"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_interval("3600"), Ok(Duration::from_secs(3600)));
        for bad in [
            "0", "-1", "3600.5", "3601", "soon", "", "inf", "nan", "1e-12",
        ] {
            assert!(parse_interval(bad).is_err(), "{bad:?} accepted");
        }
        let cli = Cli::try_parse_from(["gpuctl", "top"]).unwrap();
        let Command::Top(args) = cli.command else {
            panic!("not top");
        };
        assert_eq!(args.interval, Duration::from_secs(2));
        assert!(!args.is_once());
        for bad in ["0", "-3", "4000", "x"] {
            let err = Cli::try_parse_from(["gpuctl", "top", "--interval", bad]).unwrap_err();
            assert_eq!(err.exit_code(), 2);
            // main prints the first line: it must name the flag.
            let text = err.render().to_string();
            let first = text.lines().find(|l| !l.trim().is_empty()).unwrap();
            assert!(first.contains("--interval"), "{first}");
        }
    }

    #[test]
    fn top_json_implies_once_and_agent_filter_parses() {
        let cli = Cli::try_parse_from(["gpuctl", "top", "--json", "--agent", "node1"]).unwrap();
        let Command::Top(args) = cli.command else {
            panic!("not top");
        };
        assert!(args.is_once() && args.json && !args.once);
        assert_eq!(args.agent.as_deref(), Some("node1"));
        assert!(Cli::try_parse_from(["gpuctl", "top", "--once", "--interval", "1"]).is_ok());
    }

    #[test]
    fn top_rows_sorted_by_agent_then_index_and_filtered() {
        let r = rows(&cluster(), None);
        let order: Vec<(&str, u32)> = r.iter().map(|r| (r.agent_name(), r.index)).collect();
        assert_eq!(
            order,
            vec![("node1", 0), ("node1", 1), ("node2", 0), ("node2", 1)]
        );
        // Without hostnames, by agent id.
        let mut gpus = cluster();
        for g in &mut gpus {
            g.hostname.clear();
        }
        let r = rows(&gpus, None);
        let order: Vec<(&str, u32)> = r.iter().map(|r| (r.agent_name(), r.index)).collect();
        assert_eq!(
            order,
            vec![
                ("agent-a", 0),
                ("agent-a", 1),
                ("agent-b", 0),
                ("agent-b", 1)
            ]
        );
        // --agent matches the id or the hostname.
        assert_eq!(rows(&cluster(), Some("agent-a")).len(), 2);
        assert!(rows(&cluster(), Some("node1"))
            .iter()
            .all(|r| r.agent_id == "agent-b"));
        assert!(rows(&cluster(), Some("nope")).is_empty());
    }

    #[test]
    fn top_agents_sharing_a_hostname_show_their_ids() {
        let gpus = vec![
            gpu("agent-y", "vm", 0),
            gpu("agent-x", "vm", 0),
            gpu("agent-z", "", 0),
            gpu("agent-w", "other", 0),
        ];
        let r = rows(&gpus, None);
        assert_eq!(
            agent_labels(&r),
            vec!["agent-z", "other", "agent-x", "agent-y"]
        );
        let lines = table_lines(&r);
        assert_eq!(lines[3][0], "agent-x");
        assert_eq!(lines[4][0], "agent-y");
    }

    #[test]
    fn top_table_rows_with_and_without_reading() {
        let lines = table_lines(&rows(&cluster(), None));
        assert_eq!(
            lines[0],
            vec!["AGENT", "IDX", "MODEL", "UTIL", "MEMORY", "TEMP", "POWER", "HEALTH", "TASK"]
        );
        // Busy, with a reading.
        assert_eq!(
            lines[1],
            vec![
                "node1",
                "0",
                "A100-SXM4-40GB",
                "87% [|||||||||.]",
                "12.5/40GiB",
                "61C",
                "245W",
                "OK",
                "job-7.0"
            ]
        );
        // Free, no reading: every gauge and the task are "-".
        assert_eq!(
            lines[2],
            vec![
                "node1",
                "1",
                "A100-SXM4-40GB",
                "-",
                "-",
                "-",
                "-",
                "OK",
                "-"
            ]
        );
        // Unhealthy, a reading without temperature and power.
        assert_eq!(
            lines[3],
            vec![
                "node2",
                "0",
                "A100-SXM4-40GB",
                "0% [..........]",
                "0/40GiB",
                "-",
                "-",
                "UNHEALTHY",
                "-"
            ]
        );
        assert_eq!(lines[4][7], "CORDONED");
        assert_eq!(lines.len(), 5);
    }

    #[test]
    fn top_formats_cells() {
        assert_eq!(fmt_util(100), "100% [||||||||||]");
        assert_eq!(fmt_util(250), "100% [||||||||||]");
        assert_eq!(fmt_util(4), "  4% [..........]");
        assert_eq!(fmt_util(5), "  5% [|.........]");
        assert_eq!(fmt_memory(512, 40960), "0.5/40GiB");
        assert_eq!(fmt_memory(300, 1000), "300/1000MiB");
        assert_eq!(fmt_memory(300, 0), "300MiB");
        assert_eq!(health_word(false, true), "UNHEALTHY,CORDONED");
        assert_eq!(fmt_task(None, None), "");
        assert_eq!(fmt_task(Some("job-7.0"), Some("job-7")), "job-7.0");
        assert_eq!(
            fmt_task(Some("job-17.0"), Some("job-1")),
            "job-17.0 (job-1)"
        );
        assert_eq!(
            fmt_task(Some("fw-task-3"), Some("job-2")),
            "fw-task-3 (job-2)"
        );
        assert_eq!(fmt_task(Some("fw-task-3"), None), "fw-task-3");
    }

    #[test]
    fn top_header_counts_and_reasons() {
        let r = rows(&cluster(), None);
        let text = render_sample(&r, 951_782_400_000, None, Some(Duration::from_secs(2)));
        let first = text.lines().next().unwrap();
        assert_eq!(
            first,
            "2000-02-29T00:00:00Z  4 GPUs: 1 busy, 1 unhealthy, 1 cordoned, 2 without a reading  (every 2s)"
        );
        assert!(
            text.ends_with("node2 GPU 0 UNHEALTHY: XID 79; (fell off the bus)\n"),
            "{text}"
        );
        let one = rows(&cluster(), Some("node1"));
        let h = header(&one[..1], 951_782_400_000, Some("node1"), None);
        assert_eq!(
            h,
            "2000-02-29T00:00:00Z  1 GPU of agent node1: 1 busy, 0 unhealthy"
        );
        assert!(!render_sample(&one, 1, None, None).contains('\x1b'));
    }

    #[test]
    fn top_json_fields_and_nulls() {
        let v = serde_json::to_value(rows(&cluster(), None)).unwrap();
        assert_eq!(
            v[0],
            json!({
                "agent_id": "agent-b", "hostname": "node1", "index": 0,
                "uuid": "GPU-agent-b-0", "model": "NVIDIA A100-SXM4-40GB",
                "healthy": true, "unhealthy_reason": "", "cordoned": false,
                "utilization_pct": 87, "memory_used_mib": 12800,
                "memory_total_mib": 40960, "temperature_c": 61, "power_w": 245.4,
                "xid_errors": 0, "sampled_at_ms": 1_700_000_000_000u64,
                "task_id": "job-7.0", "job_id": "job-7",
                "share_mode": null, "shares": []
            })
        );
        // No reading: every gauge null; free: task and job null.
        let free = &v[1];
        for key in [
            "utilization_pct",
            "memory_used_mib",
            "memory_total_mib",
            "temperature_c",
            "power_w",
            "xid_errors",
            "sampled_at_ms",
            "task_id",
            "job_id",
        ] {
            assert!(free[key].is_null(), "{key}: {}", free[key]);
        }
        // A reading without temperature and power.
        assert!(v[2]["temperature_c"].is_null() && v[2]["power_w"].is_null());
        assert_eq!(v[2]["xid_errors"], 2);
        assert_eq!(v[2]["healthy"], false);
        assert_eq!(v[3]["cordoned"], true);
        // An empty GpuStatus does not panic.
        let e = serde_json::to_value(TopGpuJson::from(&pb::GpuStatus::default())).unwrap();
        assert_eq!(e["index"], 0);
    }

    /// GPU 0 of node3 shared by time-slicing: job-1.0 (10 GiB, its
    /// processes using 3.1 GiB), job-2.0 (512 MiB and 30% of the compute,
    /// no process of its own attributed), and a reading that has a figure
    /// for a task no longer there.
    fn shared() -> pb::GpuStatus {
        let mut g = gpu("agent-c", "node3", 0);
        let mut s = sample(40, 5000);
        s.task_memory_used_mib = [("job-1.0".to_string(), 3174), ("job-0.0".into(), 9)].into();
        g.sample = Some(s);
        g.share_mode = "time-slice".into();
        g.shares = vec![
            pb::GpuShareHolder {
                task_id: "job-1.0".into(),
                mem_mib: 10240,
                compute_pct: 0,
            },
            pb::GpuShareHolder {
                task_id: "job-2.0".into(),
                mem_mib: 512,
                compute_pct: 30,
            },
        ];
        g
    }

    #[test]
    fn top_shows_each_task_of_a_shared_gpu_with_its_memory() {
        let mut gpus = cluster();
        gpus.push(shared());
        let r = rows(&gpus, None);
        let lines = table_lines(&r);
        assert_eq!(lines.len(), 8, "{lines:?}");
        assert_eq!(
            lines[5],
            vec![
                "node3",
                "0",
                "A100-SXM4-40GB",
                "40% [||||......]",
                "4.9/40GiB",
                "61C",
                "245W",
                "OK",
                "-"
            ]
        );
        assert_eq!(
            lines[6],
            vec![
                "node3",
                "0",
                "└ share",
                "-",
                "3.1/10GiB",
                "-",
                "-",
                "-",
                "job-1.0"
            ]
        );
        assert_eq!(
            lines[7],
            vec![
                "node3",
                "0",
                "└ share 30%",
                "-",
                "-/512MiB",
                "-",
                "-",
                "-",
                "job-2.0"
            ]
        );
        // A shared GPU with holders is busy.
        let text = render_sample(&r, 951_782_400_000, None, None);
        assert!(text.contains("5 GPUs: 2 busy"), "{text}");
        // Without a reading, no task has a figure.
        let mut unread = shared();
        unread.sample = None;
        let lines = table_lines(&rows(&[unread], None));
        assert_eq!(lines[2][4], "-/10GiB");

        let v = serde_json::to_value(&r[4]).unwrap();
        assert_eq!(v["share_mode"], "time-slice");
        assert_eq!(
            v["shares"],
            json!([
                {"task_id": "job-1.0", "mem_mib": 10240, "compute_pct": 0, "memory_used_mib": 3174},
                {"task_id": "job-2.0", "mem_mib": 512, "compute_pct": 30, "memory_used_mib": null}
            ])
        );
    }

    // ------------------------------------------------ against a fake master

    /// An Operator that only lists GPUs, or fails when told to.
    #[derive(Default)]
    struct Fake {
        gpus: Mutex<Vec<pb::GpuStatus>>,
        fail: AtomicBool,
    }

    impl testkit::FakeOperator for Fake {
        fn list_gpus(&self, _: pb::ListGpusRequest) -> Result<pb::ListGpusResponse, tonic::Status> {
            if self.fail.load(Ordering::SeqCst) {
                return Err(tonic::Status::internal("state store on fire"));
            }
            Ok(pb::ListGpusResponse {
                gpus: self.gpus.lock().unwrap().clone(),
            })
        }
    }

    async fn serve(fake: Arc<Fake>) -> Master {
        Master::connect(&[testkit::serve(fake).await])
            .await
            .unwrap()
    }

    fn args(argv: &[&str]) -> TopArgs {
        let mut full = vec!["gpuctl", "top"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full).unwrap().command {
            Command::Top(a) => a,
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn top_once_json_against_a_fake_master() {
        let fake = Arc::new(Fake::default());
        *fake.gpus.lock().unwrap() = cluster();
        let mut master = serve(fake.clone()).await;
        let mut out = Vec::new();
        let code = run(&mut master, args(&["--once", "--json"]), &mut out)
            .await
            .unwrap();
        assert_eq!(code, EXIT_OK);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let items = v.as_array().unwrap();
        assert_eq!(items.len(), 4);
        assert_eq!(items[0]["hostname"], "node1");
        assert_eq!(items[0]["utilization_pct"], 87);
        assert!(items[1]["sampled_at_ms"].is_null());

        // The table, filtered.
        let mut out = Vec::new();
        run(&mut master, args(&["--once", "--agent", "node2"]), &mut out)
            .await
            .unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.lines()
                .next()
                .unwrap()
                .contains("2 GPUs of agent node2"),
            "{text}"
        );
        assert_eq!(
            text.lines().filter(|l| l.starts_with("node2  ")).count(),
            2,
            "{text}"
        );
        assert!(!text.contains('\x1b'));

        // A failing master: the usual error, a non-zero exit.
        fake.fail.store(true, Ordering::SeqCst);
        let err = run(&mut master, args(&["--once"]), &mut Vec::new())
            .await
            .unwrap_err();
        assert_eq!(err.to_string(), "state store on fire");
        assert_eq!(err.exit_code(), EXIT_FAILURE);
    }

    #[tokio::test]
    async fn top_live_refreshes_and_survives_errors() {
        let fake = Arc::new(Fake::default());
        *fake.gpus.lock().unwrap() = cluster();
        let mut master = serve(fake.clone()).await;
        let a = args(&["--interval", "0.05"]);

        // Not a terminal: samples one after another, no escape codes.
        let mut out = Vec::new();
        let stop = tokio::time::sleep(Duration::from_millis(300));
        let code = live(&mut master, &a, &mut out, false, stop).await.unwrap();
        assert_eq!(code, EXIT_OK);
        let text = String::from_utf8(out).unwrap();
        assert!(!text.contains('\x1b'), "{text}");
        let headers = text.lines().filter(|l| l.contains("4 GPUs:")).count();
        assert!(headers >= 2, "{text}");

        // A terminal: each sample clears the screen; once the master
        // fails, the last sample stays with an error line under it.
        let mut out = Vec::new();
        let flip = {
            let fake = fake.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(150)).await;
                fake.fail.store(true, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        };
        let code = live(&mut master, &a, &mut out, true, flip).await.unwrap();
        assert_eq!(code, EXIT_OK);
        let text = String::from_utf8(out).unwrap();
        let frames: Vec<&str> = text.split(CLEAR).filter(|f| !f.is_empty()).collect();
        assert!(frames.len() >= 3, "{text}");
        assert!(!frames[0].contains("error:"), "{text}");
        let last = frames[frames.len() - 1];
        assert!(last.contains("4 GPUs:"), "{last}");
        assert!(last.contains("node1  0"), "{last}");
        assert!(
            last.lines()
                .last()
                .unwrap()
                .starts_with("error: state store on fire (at "),
            "{last}"
        );

        // The first sample failing is the usual error.
        let err = live(
            &mut master,
            &a,
            &mut Vec::new(),
            true,
            std::future::pending(),
        )
        .await
        .unwrap_err();
        assert_eq!(err.exit_code(), EXIT_FAILURE);
    }
}
