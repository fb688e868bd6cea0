//! `scale-bench --compare 1000,10000`: the same benchmark at several
//! cluster sizes, one process each (so that each size has the machine and
//! the process's memory to itself), then the figures side by side and each
//! size's ratio to the first: a master whose cost follows the work, not the
//! cluster, keeps the placement rate and the latencies where they were.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::{json, Map, Value};

use super::BenchResult;

/// The figures compared, as (name, JSON pointer in a run's last line).
const FIGURES: &[(&str, &str)] = &[
    ("placements_per_sec", "/placements/jobs_per_sec"),
    (
        "placements_per_sec_10_to_90_pct",
        "/placements/jobs_per_sec_10_to_90_pct",
    ),
    ("idle_submit_to_running_p50_ms", "/latency_idle/p50_ms"),
    ("idle_submit_to_running_p99_ms", "/latency_idle/p99_ms"),
    (
        "idle_allocation_cycle_mean_ms",
        "/live_allocation_cycle/idle/mean_ms",
    ),
    (
        "placing_allocation_cycle_mean_ms",
        "/live_allocation_cycle/during_placements/mean_ms",
    ),
    ("gang_tasks_per_sec", "/gangs/tasks_per_sec"),
    ("completions_per_sec", "/completions/jobs_per_sec"),
    ("elections", "/leader/elections"),
    ("failover_write_ms", "/failover/new_leader_write_ms"),
    ("failover_all_agents_ms", "/failover/all_reregistered_ms"),
];

/// The arguments of this process, without `--compare`, `--plot` and
/// `--agents` (each run gets its own `--agents`).
fn passed_on() -> Vec<String> {
    let mut out = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let takes_value = ["--compare", "--plot", "--agents"].contains(&a.as_str());
        let inline = ["--compare=", "--plot=", "--agents="]
            .iter()
            .any(|p| a.starts_with(p));
        if takes_value {
            args.next();
        } else if !inline {
            out.push(a);
        }
    }
    out
}

/// Runs one size, echoing its output; returns its last JSON line.
fn one(agents: usize) -> BenchResult<Value> {
    let exe = std::env::current_exe().map_err(|e| format!("this executable: {e}"))?;
    println!("=== scale-bench --agents {agents} ===");
    let mut child = Command::new(exe)
        .args(passed_on())
        .arg("--agents")
        .arg(agents.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("start the run at {agents} agents: {e}"))?;
    let mut last = None;
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines() {
            let line = line.map_err(|e| format!("read the run's output: {e}"))?;
            println!("{line}");
            if line.starts_with('{') {
                last = Some(line);
            }
        }
    }
    let status = child
        .wait()
        .map_err(|e| format!("wait for the run at {agents} agents: {e}"))?;
    let line =
        last.ok_or_else(|| format!("the run at {agents} agents printed no JSON ({status})"))?;
    serde_json::from_str(&line).map_err(|e| format!("the run at {agents} agents: {e}"))
}

pub fn run(sizes: &[usize], plot: Option<&Path>) -> BenchResult<()> {
    let mut runs = Vec::new();
    for &n in sizes {
        runs.push((n, one(n)?));
    }
    let figure = |run: &Value, pointer: &str| run.pointer(pointer).and_then(Value::as_f64);
    let mut by_size = Vec::new();
    println!();
    println!(
        "| figure | {} |",
        sizes
            .iter()
            .map(|n| format!("{n} agents"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---|{}", "---:|".repeat(sizes.len()));
    for (name, pointer) in FIGURES {
        let cells: Vec<String> = runs
            .iter()
            .map(|(_, r)| figure(r, pointer).map_or("-".into(), |v| format!("{v:.1}")))
            .collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
    let (first_n, first) = &runs[0];
    let mut ratios = Map::new();
    for (n, r) in &runs[1..] {
        let mut m = Map::new();
        for (name, pointer) in FIGURES {
            if let (Some(a), Some(b)) = (figure(first, pointer), figure(r, pointer)) {
                if a != 0.0 {
                    m.insert((*name).to_string(), json!(b / a));
                }
            }
        }
        ratios.insert(format!("{n}_to_{first_n}"), Value::Object(m));
    }
    for (n, r) in &runs {
        let mut m = Map::new();
        for (name, pointer) in FIGURES {
            m.insert(
                (*name).to_string(),
                figure(r, pointer).map_or(Value::Null, |v| json!(v)),
            );
        }
        by_size.push(json!({ "agents": n, "figures": m }));
    }
    if let Some(path) = plot {
        super::plot::draw(path, &by_size)?;
    }
    let out = json!({
        "compare": sizes,
        "sizes": by_size,
        "ratios": ratios,
        "runs": runs.iter().map(|(_, r)| r.clone()).collect::<Vec<_>>(),
    });
    println!();
    println!("{out}");
    Ok(())
}
