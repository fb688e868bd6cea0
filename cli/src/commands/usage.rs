//! `gpuctl usage`: who used what, from the masters' accounting ledger
//! (docs/usage.md).

use std::io::Write;

use clap::{Args, ValueEnum};
use gpuctl_proto::pb;

use super::CliError;
use crate::client::{Master, Retry};
use crate::output::Table;

/// How rows are grouped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum By {
    Tenant,
    User,
    Job,
    GpuModel,
}

impl By {
    fn wire(self) -> &'static str {
        match self {
            By::Tenant => "tenant",
            By::User => "user",
            By::Job => "job",
            By::GpuModel => "gpu-model",
        }
    }

    fn header(self) -> &'static str {
        match self {
            By::Tenant => "TENANT",
            By::User => "USER",
            By::Job => "JOB",
            By::GpuModel => "GPU MODEL",
        }
    }
}

#[derive(Debug, Args)]
pub struct UsageArgs {
    /// The window: this long back from now, rounded down to the hour
    /// (`24h`, `7d`, `30d`); `all` for all the masters keep (400 days).
    #[arg(long, default_value = "7d", value_parser = parse_since)]
    pub since: Since,
    /// Group rows by tenant, user (the submitting token), job (jobs the
    /// masters still keep) or GPU model.
    #[arg(long, value_enum, default_value = "tenant")]
    pub by: By,
    /// Print JSON instead of a table.
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,
    /// Print CSV (hours as decimals) instead of a table.
    #[arg(long)]
    pub csv: bool,
}

/// How far back a report goes; `All`: everything kept.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Since {
    All,
    Ago(std::time::Duration),
}

fn parse_since(s: &str) -> Result<Since, String> {
    if s == "all" {
        return Ok(Since::All);
    }
    gpuctl_core::time::parse_duration(s).map(Since::Ago)
}

const HOUR_MS: f64 = 3_600_000.0;

/// The report as `--json` prints it: hours, not milliseconds.
#[derive(serde::Serialize)]
struct Report<'a> {
    since_ms: u64,
    until_ms: u64,
    by: &'a str,
    truncated: bool,
    rows: Vec<RowJson>,
}

#[derive(serde::Serialize)]
struct RowJson {
    key: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    tenant: String,
    gpu_hours: f64,
    /// Of `gpu_hours`, held before the tasks ran (pull, preflight).
    gpu_startup_hours: f64,
    cpu_hours: f64,
    mem_gib_hours: f64,
    /// Mean utilization of the GPU time with readings; absent without.
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu_util_pct: Option<f64>,
    tasks: u64,
    running: u64,
    gpu_ms: u64,
    gpu_sampled_ms: u64,
    gpu_busy_ms: u64,
    gpu_startup_ms: u64,
    cpu_ms: u64,
    mem_mib_ms: u64,
}

fn hours(ms: u64) -> f64 {
    ms as f64 / HOUR_MS
}

pub async fn run(
    master: &mut Master,
    args: UsageArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let since_ms = match args.since {
        Since::All => 0,
        Since::Ago(d) => {
            super::now_ms().saturating_sub(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        }
    };
    let by = args.by.wire();
    let resp = master
        .call(Retry::Always, |mut c| async move {
            c.usage(pb::UsageRequest {
                since_ms,
                by: by.to_string(),
            })
            .await
        })
        .await?;
    let rows: Vec<RowJson> = resp.rows.iter().map(RowJson::of).collect();
    let with_tenant = matches!(args.by, By::User | By::Job);
    if args.json {
        let report = Report {
            since_ms: resp.since_ms,
            until_ms: resp.until_ms,
            by,
            truncated: resp.truncated,
            rows,
        };
        serde_json::to_writer_pretty(&mut *out, &report)
            .map_err(|e| CliError::Other(format!("json: {e}")))?;
        writeln!(out)?;
        return Ok(());
    }
    if args.csv {
        return write_csv(out, by, with_tenant, &rows);
    }
    let t = usage_table(&args.by, with_tenant, &rows);
    write!(out, "{}", t.render())?;
    if resp.truncated {
        writeln!(
            out,
            "(more rows than one answer holds; the smallest are left out)"
        )?;
    }
    Ok(())
}

impl RowJson {
    fn of(r: &pb::UsageRow) -> RowJson {
        RowJson {
            key: r.key.clone(),
            tenant: r.tenant.clone(),
            gpu_hours: hours(r.gpu_ms),
            gpu_startup_hours: hours(r.gpu_startup_ms),
            cpu_hours: hours(r.cpu_ms),
            mem_gib_hours: hours(r.mem_mib_ms) / 1024.0,
            gpu_util_pct: (r.gpu_sampled_ms > 0)
                .then(|| 100.0 * r.gpu_busy_ms as f64 / r.gpu_sampled_ms as f64),
            tasks: r.tasks,
            running: r.running,
            gpu_ms: r.gpu_ms,
            gpu_sampled_ms: r.gpu_sampled_ms,
            gpu_busy_ms: r.gpu_busy_ms,
            gpu_startup_ms: r.gpu_startup_ms,
            cpu_ms: r.cpu_ms,
            mem_mib_ms: r.mem_mib_ms,
        }
    }
}

/// The report as CSV: a header, then a line per row.
fn write_csv(
    out: &mut dyn Write,
    by: &str,
    with_tenant: bool,
    rows: &[RowJson],
) -> Result<(), CliError> {
    let mut header = vec![by];
    if with_tenant {
        header.push("tenant");
    }
    header.extend([
        "gpu_hours",
        "gpu_startup_hours",
        "gpu_util_pct",
        "cpu_hours",
        "mem_gib_hours",
        "tasks",
        "running",
    ]);
    writeln!(out, "{}", header.join(","))?;
    for r in rows {
        let mut cells = vec![csv_cell(&r.key)];
        if with_tenant {
            cells.push(csv_cell(&r.tenant));
        }
        cells.extend([
            format!("{:.4}", r.gpu_hours),
            format!("{:.4}", r.gpu_startup_hours),
            r.gpu_util_pct.map_or(String::new(), |u| format!("{u:.1}")),
            format!("{:.4}", r.cpu_hours),
            format!("{:.4}", r.mem_gib_hours),
            r.tasks.to_string(),
            r.running.to_string(),
        ]);
        writeln!(out, "{}", cells.join(","))?;
    }
    Ok(())
}

/// The report as a table, with a TOTAL row.
fn usage_table(by: &By, with_tenant: bool, rows: &[RowJson]) -> Table {
    let mut headers = vec![by.header()];
    if with_tenant {
        headers.push("TENANT");
    }
    headers.extend([
        "GPU-HOURS",
        "STARTUP",
        "GPU UTIL",
        "CPU-HOURS",
        "MEM GIB-HOURS",
        "TASKS",
        "RUNNING",
    ]);
    let mut t = Table::new(&headers);
    let mut total = (0.0, 0.0, 0.0, 0, 0);
    let mut startup = 0.0;
    let (mut sampled, mut busy) = (0u64, 0u64);
    for r in rows {
        let mut cells = vec![if r.key.is_empty() {
            "(no GPU)".to_string()
        } else {
            r.key.clone()
        }];
        if with_tenant {
            cells.push(r.tenant.clone());
        }
        cells.extend([
            format!("{:.2}", r.gpu_hours),
            format!("{:.2}", r.gpu_startup_hours),
            r.gpu_util_pct.map_or(String::new(), |u| format!("{u:.0}%")),
            format!("{:.2}", r.cpu_hours),
            format!("{:.2}", r.mem_gib_hours),
            r.tasks.to_string(),
            r.running.to_string(),
        ]);
        t.row(cells);
        sampled += r.gpu_sampled_ms;
        busy += r.gpu_busy_ms;
        total.0 += r.gpu_hours;
        startup += r.gpu_startup_hours;
        total.1 += r.cpu_hours;
        total.2 += r.mem_gib_hours;
        total.3 += r.tasks;
        total.4 += r.running;
    }
    let mut cells = vec!["TOTAL".to_string()];
    if with_tenant {
        cells.push(String::new());
    }
    cells.extend([
        format!("{:.2}", total.0),
        format!("{:.2}", startup),
        if sampled > 0 {
            format!("{:.0}%", 100.0 * busy as f64 / sampled as f64)
        } else {
            String::new()
        },
        format!("{:.2}", total.1),
        format!("{:.2}", total.2),
        total.3.to_string(),
        total.4.to_string(),
    ]);
    t.row(cells);
    t
}

/// A CSV field, quoted when it holds a comma, quote or line break.
fn csv_cell(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_and_csv_cells() {
        assert_eq!(parse_since("all"), Ok(Since::All));
        assert_eq!(
            parse_since("7d"),
            Ok(Since::Ago(std::time::Duration::from_secs(7 * 86_400)))
        );
        assert!(parse_since("soon").is_err());
        assert_eq!(csv_cell("A100"), "A100");
        assert_eq!(csv_cell("a,b"), "\"a,b\"");
        assert_eq!(csv_cell("say \"x\""), "\"say \"\"x\"\"\"");
    }
}
