//! Jobs and their tasks as gpuctl prints them: the list, `jobs get`, events.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::*;

/// `jobs get`'s line: "user 1234:1234, mounts /data:/data:ro" or
/// "default".
pub(super) fn security_words(s: &SecurityJson) -> String {
    let mut parts = Vec::new();
    if s.run_as_root {
        parts.push("root (--run-as-root)".to_string());
    }
    if let Some(u) = &s.user {
        parts.push(format!("user {u}"));
    }
    if !s.mounts.is_empty() {
        let m: Vec<String> = s
            .mounts
            .iter()
            .map(|m| {
                let mode = if m.read_only { "ro" } else { "rw" };
                format!("{}:{}:{mode}", m.host_path, m.container_path)
            })
            .collect();
        parts.push(format!("mounts {}", m.join(" ")));
    }
    if parts.is_empty() {
        "default".to_string()
    } else {
        parts.join(", ")
    }
}

// ---------------------------------------------------------------- MIG rows

/// `jobs list`: ID, NAME, STATE, PRIO, GPUS, AGENT, AGE, EXIT, REASON.
/// GPUS is per task, `Rx` in front for a gang of R; AGENT and EXIT are
/// those of the job's latest task.
pub fn jobs_table(jobs: &[pb::Job], now_ms: u64) -> Table {
    let mut t = Table::new(&[
        "ID", "NAME", "STATE", "PRIO", "GPUS", "AGENT", "AGE", "EXIT", "REASON",
    ]);
    for j in jobs {
        let spec = j.spec.clone().unwrap_or_default();
        let gpus = gpus_per_task(&spec);
        let gpus = if spec.replicas > 1 {
            format!("{}x{gpus}", spec.replicas)
        } else {
            gpus
        };
        let last = j.tasks.last();
        t.row(vec![
            j.id.clone(),
            spec.name,
            job_state_name(j.state).to_string(),
            spec.priority.to_string(),
            gpus,
            last.map(|t| t.agent_id.clone()).unwrap_or_default(),
            fmt_age(j.submitted_at_ms, now_ms),
            last.and_then(|t| t.exit_code)
                .map(|c| c.to_string())
                .unwrap_or_default(),
            if j.idle_since_ms > 0 {
                format!("Idle: GPUs idle for {}", fmt_age(j.idle_since_ms, now_ms))
            } else {
                wait_reason(j).unwrap_or_default().replace('\n', " ")
            },
        ]);
    }
    t
}

/// What each task of a job holds, in a table cell: a GPU count, a MIG
/// profile (`mig:1g.10gb`) or a fraction's memory and compute
/// (`frac:10GiB`, `frac:10GiB/30%`), never 0 for a job that has GPUs.
pub(super) fn gpus_per_task(spec: &pb::JobSpec) -> String {
    let gpus = spec.resources.map_or(0, |r| r.gpus);
    match spec.placement.as_ref() {
        Some(p) if !p.mig.is_empty() => format!("mig:{}", p.mig),
        Some(p) if p.gpu_mem_mib > 0 => {
            let compute = if p.gpu_compute_pct > 0 {
                format!("/{}%", p.gpu_compute_pct)
            } else {
                String::new()
            };
            format!("frac:{}{compute}", fmt_mib(p.gpu_mem_mib))
        }
        _ => gpus.to_string(),
    }
}

/// A task table (inside `jobs get`).
pub fn tasks_table(tasks: &[pb::Task]) -> Table {
    let ports = tasks.iter().any(|t| !t.ports.is_empty());
    let mut head = vec!["TASK", "RANK", "AGENT", "STATE", "GPUS"];
    if ports {
        head.push("PORTS");
    }
    head.extend(["EXIT", "MESSAGE"]);
    let mut t = Table::new(&head);
    for task in tasks {
        let mut row = vec![
            task.id.clone(),
            task.rank.to_string(),
            task.agent_id.clone(),
            task_state_name(task.state).to_string(),
            task.gpu_uuids.join(","),
        ];
        if ports {
            row.push(fmt_ports(&task.ports));
        }
        row.extend([
            task.exit_code.map(|c| c.to_string()).unwrap_or_default(),
            task.message.clone(),
        ]);
        t.row(row);
    }
    t
}

/// Ports as `31000,31001` (`-` for none).
pub(super) fn fmt_ports(ports: &[u32]) -> String {
    if ports.is_empty() {
        return "-".into();
    }
    ports
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// A job's options as `key=value` words, in their own form (the job file's
/// keys and values), whatever options there are; `-` for none.
fn options_words(options: &gpuctl_core::types::TaskOptions) -> String {
    let words: Vec<String> = match serde_json::to_value(options) {
        Ok(serde_json::Value::Object(set)) => set
            .iter()
            .map(|(k, v)| format!("{k}={}", option_value(v)))
            .collect(),
        _ => Vec::new(),
    };
    if words.is_empty() {
        "-".to_string()
    } else {
        words.join(" ")
    }
}

/// One option's value as written in a job file: text as it is (quoted as
/// the shell would when it has spaces: a check), a list comma-separated.
fn option_value(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => shell_quote(s),
        serde_json::Value::Array(items) => {
            items.iter().map(option_value).collect::<Vec<_>>().join(",")
        }
        other => other.to_string(),
    }
}

/// `jobs get`: `Key: value` lines, then the task table.
pub fn job_detail(j: &pb::Job, now_ms: u64) -> String {
    let spec = j.spec.clone().unwrap_or_default();
    let res = spec.resources.unwrap_or_default();
    let image = if spec.image.is_empty() {
        "- (host process)".to_string()
    } else {
        spec.image.clone()
    };
    let mem = if res.mem_mib == 0 {
        "no limit".to_string()
    } else {
        fmt_mib(res.mem_mib)
    };
    let env = env_words(&spec.env);
    let fields = [
        ("ID", j.id.clone()),
        ("Name", spec.name.clone()),
        ("Tenant", spec.tenant.clone()),
        ("State", job_state_name(j.state).to_string()),
        ("Image", image),
        ("Command", shell_join(&spec.command)),
        ("Env", env),
        ("GPUs", gpus_words(&spec, &res)),
        ("CPUs", fmt_cpus(res.cpus)),
        ("Memory", mem),
        ("Ports", res.ports.to_string()),
        (
            "Replicas",
            match spec.min_replicas {
                m if m > 0 && m < spec.replicas => {
                    format!("{m}:{} (elastic)", spec.replicas)
                }
                _ => spec.replicas.max(1).to_string(),
            },
        ),
        (
            "Security",
            security_words(&SecurityJson::from(spec.security.as_ref())),
        ),
        (
            "Driver",
            driver_words(&spec.require_cuda, &j.image_requires),
        ),
        ("Priority", spec.priority.to_string()),
        ("Retries", format!("{} of {}", j.retries, spec.max_retries)),
        ("Restart", restart_words(&spec)),
        // (Labels of at most 9 characters keep the column.)
        (
            "Grace",
            spec.stop_grace_ms.map_or_else(
                || "the agent's kill grace".to_string(),
                |ms| format!("{} s (--stop-grace)", ms as f64 / 1000.0),
            ),
        ),
        (
            "Ckpt dir",
            if spec.checkpoint_dir.is_empty() {
                "-".to_string()
            } else {
                spec.checkpoint_dir.clone()
            },
        ),
        (
            "Options",
            options_words(&gpuctl_core::convert::options_view(spec.options.as_ref())),
        ),
        (
            "Fencing",
            if spec.no_fence {
                "off (--no-fence: never LOST by timeout)".to_string()
            } else {
                "on".to_string()
            },
        ),
        (
            "Preempted",
            format!(
                "{} time{}{}",
                j.preemptions,
                if j.preemptions == 1 { "" } else { "s" },
                if spec.no_requeue {
                    " (--no-requeue)"
                } else {
                    ""
                }
            ),
        ),
        (
            "Submitted",
            format!(
                "{} ({} ago)",
                fmt_timestamp(j.submitted_at_ms),
                fmt_age(j.submitted_at_ms, now_ms)
            ),
        ),
        (
            "Message",
            match job_message(j) {
                m if m.is_empty() => "-".to_string(),
                m => m.replace('\n', " "),
            },
        ),
    ];
    let width = fields.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    let mut out = String::new();
    for (k, v) in fields {
        let _ = writeln!(out, "{:<width$} {v}", format!("{k}:"));
    }
    out.push('\n');
    out.push_str(&tasks_section(j));
    out.push('\n');
    out.push_str(&events_section(j, now_ms));
    out
}

/// The job's environment as `K=V` words, shell-quoted, by name.
pub(super) fn env_words(env: &std::collections::HashMap<String, String>) -> String {
    let env: BTreeMap<_, _> = env.iter().collect();
    if env.is_empty() {
        return "-".to_string();
    }
    env.iter()
        .map(|(k, v)| format!("{k}={}", shell_quote(v)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// What each task holds: whole GPUs, a MIG device each, or a fraction.
pub(super) fn gpus_words(spec: &pb::JobSpec, res: &pb::Resources) -> String {
    match spec.placement.as_ref() {
        Some(p) if !p.mig.is_empty() => {
            format!("{} (a MIG device {} each)", res.gpus, p.mig)
        }
        Some(p) if p.gpu_mem_mib > 0 => format!(
            "a fraction of a shared GPU each: {}{}",
            fmt_mib(p.gpu_mem_mib),
            if p.gpu_compute_pct > 0 {
                format!(", {}% of compute", p.gpu_compute_pct)
            } else {
                String::new()
            }
        ),
        _ => res.gpus.to_string(),
    }
}

/// The restart policy and its first backoff.
fn restart_words(spec: &pb::JobSpec) -> String {
    format!(
        "{} (backoff {})",
        if spec.restart_policy.is_empty() {
            "gang"
        } else {
            spec.restart_policy.as_str()
        },
        spec.restart_backoff_ms
            .map_or("1s".to_string(), |ms| format!("{}s", ms as f64 / 1000.0))
    )
}

/// The task table, and what holds each fraction's limits.
fn tasks_section(j: &pb::Job) -> String {
    let mut out = String::new();
    if j.tasks.is_empty() {
        out.push_str("Tasks: none yet\n");
    } else {
        out.push_str("Tasks:\n");
        out.push_str(&tasks_table(&j.tasks).render());
        // What holds a fraction's limits, said per task.
        for t in j.tasks.iter().filter(|t| !t.enforcement.is_empty()) {
            let what = match t.enforcement.as_str() {
                "driver" => "the driver's memory cap, on all its processes together",
                "mps" => "MPS limits on each of its processes; its agent stops it when all of them together pass its memory (GPU_MEMORY_LIMIT)",
                "none" => "nothing: the scheduler counts its fraction, nothing limits it",
                other => other,
            };
            let _ = writeln!(out, "Enforcement of {}: {} ({what})", t.id, t.enforcement);
        }
    }
    out
}

/// `jobs get`'s Events, as `kubectl describe` shows them: a repeated event
/// is one row whose AGE reads `3m (x5 over 10m)`.
pub fn events_section(j: &pb::Job, now_ms: u64) -> String {
    events_of(&j.events, j.events_dropped, now_ms)
}

/// The Events section of any object with events (a job, a service).
pub(super) fn events_of(events: &[pb::JobEvent], dropped: u64, now_ms: u64) -> String {
    if events.is_empty() {
        return "Events: <none>\n".to_string();
    }
    let mut t = Table::new(&["TYPE", "REASON", "AGE", "MESSAGE"]);
    for e in events {
        let age = if e.count > 1 {
            format!(
                "{} (x{} over {})",
                fmt_age(e.last_ms, now_ms),
                e.count,
                fmt_age(e.first_ms, e.last_ms)
            )
        } else {
            fmt_age(e.last_ms, now_ms)
        };
        t.row(vec![
            event_type(e).to_string(),
            e.kind.clone(),
            age,
            e.message.replace('\n', " "),
        ]);
    }
    let mut out = String::from("Events:\n");
    if dropped > 0 {
        let _ = writeln!(out, "({dropped} older events dropped)");
    }
    out.push_str(&t.render());
    out
}

/// `jobs get`'s Driver line: what the job needs of the NVIDIA driver,
/// each requirement shortened (the whole text is in `--json`).
pub(super) fn driver_words(require_cuda: &str, image_requires: &[String]) -> String {
    let mut parts = Vec::new();
    if !require_cuda.is_empty() {
        parts.push(format!("{} (--require-cuda)", short_require(require_cuda)));
    }
    if !image_requires.is_empty() {
        let each: Vec<String> = image_requires.iter().map(|r| short_require(r)).collect();
        parts.push(format!("{} (its image's)", each.join(" and ")));
    }
    if parts.is_empty() {
        "any".to_string()
    } else {
        parts.join("; ")
    }
}
