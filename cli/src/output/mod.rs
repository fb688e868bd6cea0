//! What the CLI prints: the human tables, built from the wire messages, and
//! `--json`, whose shapes are `gpuctl_core::view`'s (the console's too).

use std::fmt::Write as _;

pub use gpuctl_core::convert::agent_state_name;
use gpuctl_core::convert::{job_state_name, runtime_name, task_state_name};
use gpuctl_proto::pb;
use serde::Serialize;

pub use gpuctl_core::view::*;
pub use gpuctl_core::wait_words::{short_require, wait_reason_words as wait_reason};

mod agents;
mod jobs;
mod services;

pub use agents::*;
pub use jobs::*;
pub use services::*;

// ---------------------------------------------------------------- JSON

/// Pretty JSON with a final newline.
pub fn to_json<T: Serialize + ?Sized>(value: &T) -> Result<String, serde_json::Error> {
    let mut s = serde_json::to_string_pretty(value)?;
    s.push('\n');
    Ok(s)
}

/// A plain text table: columns separated by two spaces, left aligned, no
/// trailing blanks. Cells never contain newlines (they are replaced).
#[derive(Debug, Clone, Default)]
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&str]) -> Self {
        Table {
            headers: headers.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let clean = |c: &str| -> String {
            if c.is_empty() {
                "-".to_string()
            } else {
                c.replace(['\n', '\r', '\t'], " ")
            }
        };
        let ncols = self.headers.len();
        let lines: Vec<Vec<String>> = std::iter::once(&self.headers)
            .chain(self.rows.iter())
            .map(|r| {
                (0..ncols)
                    .map(|i| clean(r.get(i).map_or("", |s| s)))
                    .collect()
            })
            .collect();
        let widths: Vec<usize> = (0..ncols)
            .map(|i| {
                lines
                    .iter()
                    .map(|l| l[i].chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for line in &lines {
            let mut s = String::new();
            for (i, cell) in line.iter().enumerate() {
                if i + 1 == ncols {
                    s.push_str(cell);
                } else {
                    let width = widths[i] + 2;
                    let _ = write!(s, "{cell:<width$}");
                }
            }
            out.push_str(s.trim_end());
            out.push('\n');
        }
        out
    }
}

/// Memory in MiB, as MiB below 1 GiB and as GiB (one decimal unless whole) above.
pub fn fmt_mib(mib: u64) -> String {
    if mib < 1024 {
        format!("{mib}MiB")
    } else if (mib / 1024) * 1024 == mib {
        format!("{}GiB", mib / 1024)
    } else {
        format!("{:.1}GiB", mib as f64 / 1024.0)
    }
}

/// CPUs: whole numbers without decimals, others with up to two.
pub fn fmt_cpus(c: f64) -> String {
    if (c - c.round()).abs() < 1e-9 {
        format!("{}", c.round() as i64)
    } else {
        let s = format!("{c:.2}");
        s.trim_end_matches('0').to_string()
    }
}

/// Age of something that happened at `then_ms`: "12s", "5m", "3h", "2d".
pub fn fmt_age(then_ms: u64, now_ms: u64) -> String {
    if then_ms == 0 {
        return "-".to_string();
    }
    let secs = now_ms.saturating_sub(then_ms) / 1000;
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 2 * 3600 => format!("{}m", s / 60),
        s if s < 2 * 86400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

/// Milliseconds since the epoch as `YYYY-MM-DDTHH:MM:SSZ` (UTC); `-` for 0.
pub fn fmt_timestamp(ms: u64) -> String {
    if ms == 0 {
        return "-".to_string();
    }
    gpuctl_core::types::utc_timestamp(ms)
}

/// Quotes an argument for a POSIX shell when it needs it.
pub fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@%+".contains(c));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

pub fn shell_join(args: &[String]) -> String {
    args.iter()
        .map(|a| shell_quote(a))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::collections::BTreeMap;

    fn job() -> pb::Job {
        pb::Job {
            id: "job-7".into(),
            spec: Some(pb::JobSpec {
                placement: None,
                name: "train".into(),
                image: "busybox:latest".into(),
                command: vec!["sh".into(), "-c".into(), "echo hi".into()],
                env: [("A".to_string(), "1".to_string())].into_iter().collect(),
                resources: Some(pb::Resources {
                    cpus: 1.5,
                    mem_mib: 2048,
                    gpus: 2,
                    ports: 0,
                }),
                ..Default::default()
            }),
            state: pb::JobState::JobSucceeded as i32,
            tasks: vec![pb::Task {
                enforcement: String::new(),
                id: "job-7.0".into(),
                agent_id: "agent-a".into(),
                gpu_uuids: vec!["GPU-1".into(), "GPU-2".into()],
                state: pb::TaskState::TaskFinished as i32,
                exit_code: Some(0),
                message: "exited".into(),
                updated_at_ms: 1_700_000_001_000,
                rank: 0,
                reason: pb::Reason::CommandExited as i32,
                ports: vec![],
                ready: false,
                check_failure: String::new(),
            }],
            submitted_at_ms: 1_700_000_000_000,
            message: String::new(),
            retries: 0,
            preemptions: 0,
            wait_reason: None,
            image_requires: Vec::new(),
            events: Vec::new(),
            events_dropped: 0,
            idle_since_ms: 0,
        }
    }

    fn gpu(i: u32) -> pb::Gpu {
        pb::Gpu {
            uuid: format!("GPU-{i}"),
            index: i,
            minor: i,
            model: "NVIDIA A100-SXM4-40GB".into(),
            memory_mib: 40960,
            healthy: true,
            pci_bus_id: format!("00000000:0{i}:00.0"),
            ..Default::default()
        }
    }

    fn agent() -> pb::Agent {
        pb::Agent {
            id: "agent-a".into(),
            hostname: "node1".into(),
            address: "10.0.0.1:7060".into(),
            state: pb::AgentState::AgentActive as i32,
            total: Some(pb::Resources {
                cpus: 16.0,
                mem_mib: 65536,
                gpus: 4,
                ports: 0,
            }),
            allocated: Some(pb::Resources {
                cpus: 1.5,
                mem_mib: 2048,
                gpus: 2,
                ports: 0,
            }),
            gpus: (0..4).map(gpu).collect(),
            runtimes: vec![pb::Runtime::Docker as i32, pb::Runtime::Process as i32],
            registered_at_ms: 1_700_000_000_000,
            simulated_gpus: true,
            ..Default::default()
        }
    }

    #[test]
    fn job_json_shape() {
        let v = serde_json::to_value(JobJson::from(&job())).unwrap();
        assert_eq!(v["id"], "job-7");
        assert_eq!(v["name"], "train");
        assert_eq!(v["state"], "SUCCEEDED");
        assert_eq!(v["image"], "busybox:latest");
        assert_eq!(v["command"], json!(["sh", "-c", "echo hi"]));
        assert_eq!(v["env"], json!({"A": "1"}));
        assert_eq!(
            v["resources"],
            json!({"cpus": 1.5, "mem_mib": 2048, "gpus": 2, "ports": 0})
        );
        assert_eq!(v["message"], "");
        assert_eq!(v["submitted_at_ms"], 1_700_000_000_000u64);
        let t = &v["tasks"][0];
        assert_eq!(t["id"], "job-7.0");
        assert_eq!(t["agent_id"], "agent-a");
        assert_eq!(t["gpus"], json!(["GPU-1", "GPU-2"]));
        assert_eq!(t["state"], "FINISHED");
        assert_eq!(t["exit_code"], 0);
        assert_eq!(t["message"], "exited");
    }

    #[test]
    fn host_process_job_has_null_image_and_running_task_null_exit() {
        let mut j = job();
        if let Some(s) = j.spec.as_mut() {
            s.image.clear();
        }
        j.tasks[0].exit_code = None;
        j.tasks[0].state = pb::TaskState::TaskRunning as i32;
        j.state = pb::JobState::JobRunning as i32;
        let v = serde_json::to_value(JobJson::from(&j)).unwrap();
        assert!(v["image"].is_null());
        assert!(v["tasks"][0]["exit_code"].is_null());
        assert_eq!(v["tasks"][0]["state"], "RUNNING");
        assert_eq!(v["state"], "RUNNING");
    }

    #[test]
    fn job_json_from_empty_message_does_not_panic() {
        let v = serde_json::to_value(JobJson::from(&pb::Job::default())).unwrap();
        assert_eq!(v["state"], "UNKNOWN");
        assert_eq!(v["resources"]["gpus"], 0);
        assert_eq!(v["tasks"], json!([]));
    }

    #[test]
    fn agent_json_shape() {
        let v = serde_json::to_value(AgentJson::from(&agent())).unwrap();
        assert_eq!(v["id"], "agent-a");
        assert_eq!(v["hostname"], "node1");
        assert_eq!(v["address"], "10.0.0.1:7060");
        assert_eq!(v["state"], "ACTIVE");
        assert_eq!(v["runtimes"], json!(["docker", "process"]));
        assert_eq!(v["simulated_gpus"], true);
        assert_eq!(v["total"]["gpus"], 4);
        assert_eq!(v["allocated"]["gpus"], 2);
        let g = &v["gpus"][1];
        assert_eq!(
            g,
            &json!({
                "uuid": "GPU-1", "index": 1, "minor": 1,
                "model": "NVIDIA A100-SXM4-40GB", "memory_mib": 40960,
                "healthy": true, "unhealthy_reason": "",
                "pci_bus_id": "00000000:01:00.0", "serial": "",
                "numa_node": null, "compute_capability": null, "peers": []
            })
        );
    }

    #[test]
    fn gpu_status_json_task_id_null_when_free() {
        let free = pb::GpuStatus {
            gpu: Some(gpu(0)),
            agent_id: "agent-a".into(),
            task_id: String::new(),
            cordoned: false,
            ..Default::default()
        };
        let busy = pb::GpuStatus {
            task_id: "job-7.0".into(),
            ..free.clone()
        };
        let v = serde_json::to_value(vec![GpuStatusJson::from(&free), GpuStatusJson::from(&busy)])
            .unwrap();
        assert!(v[0]["task_id"].is_null());
        assert_eq!(v[1]["task_id"], "job-7.0");
        for key in [
            "uuid",
            "agent_id",
            "index",
            "minor",
            "model",
            "memory_mib",
            "healthy",
        ] {
            assert!(v[0].get(key).is_some(), "missing {key}");
        }
        assert_eq!(v[0]["agent_id"], "agent-a");
    }

    #[test]
    fn table_aligns_columns_without_trailing_blanks() {
        let mut t = Table::new(&["A", "LONGER", "C"]);
        t.row(vec!["xxxx".into(), "".into(), "z".into()]);
        t.row(vec!["y".into(), "multi\nline".into(), "".into()]);
        assert_eq!(
            t.render(),
            "A     LONGER      C\n\
             xxxx  -           z\n\
             y     multi line  -\n"
        );
    }

    #[test]
    fn empty_table_is_the_header() {
        assert_eq!(
            jobs_table(&[], 0).render(),
            "ID  NAME  STATE  PRIO  GPUS  AGENT  AGE  EXIT  REASON\n"
        );
    }

    /// A fraction or a MIG job shows what each task holds, never "0".
    #[test]
    fn jobs_table_gpus_of_fractions_and_mig() {
        let cell = |placement: pb::Placement, gpus: u32, replicas: u32| {
            let mut j = job();
            let spec = j.spec.as_mut().unwrap();
            spec.placement = Some(placement);
            spec.resources.as_mut().unwrap().gpus = gpus;
            spec.replicas = replicas;
            let out = jobs_table(&[j], 1_700_000_065_000).render();
            out.lines()
                .nth(1)
                .unwrap()
                .split_whitespace()
                .nth(4)
                .unwrap()
                .to_string()
        };
        let frac = pb::Placement {
            gpu_mem_mib: 10 * 1024,
            ..Default::default()
        };
        assert_eq!(cell(frac.clone(), 0, 1), "frac:10GiB");
        let with_compute = pb::Placement {
            gpu_compute_pct: 30,
            ..frac
        };
        assert_eq!(cell(with_compute, 0, 2), "2xfrac:10GiB/30%");
        let mig = pb::Placement {
            mig: "1g.10gb".into(),
            ..Default::default()
        };
        assert_eq!(cell(mig, 1, 1), "mig:1g.10gb");
        assert_eq!(cell(pb::Placement::default(), 2, 4), "4x2");
    }

    #[test]
    fn jobs_table_row() {
        let out = jobs_table(&[job()], 1_700_000_065_000).render();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2);
        let cells: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            cells,
            vec![
                "job-7",
                "train",
                "SUCCEEDED",
                "0",
                "2",
                "agent-a",
                "65s",
                "0",
                "-"
            ]
        );
        // A queued job says why it waits; JSON has it as `reason`.
        let mut q = job();
        q.state = pb::JobState::JobQueued as i32;
        q.tasks.clear();
        q.message = "no agent has GPU model H100*".into();
        let out = jobs_table(&[q.clone()], 1_700_000_065_000).render();
        assert!(
            out.lines()
                .nth(1)
                .unwrap()
                .ends_with("no agent has GPU model H100*"),
            "{out}"
        );
        let v = serde_json::to_value(JobJson::from(&q)).unwrap();
        assert_eq!(v["reason"], "no agent has GPU model H100*");
        assert!(v["wait_reason"].is_null(), "a master without wait_reason");
        assert!(serde_json::to_value(JobJson::from(&job())).unwrap()["reason"].is_null());
        // From the data when the master sends it; the message then is the
        // state machine's (here, how the last attempt ended).
        q.message = "task job-7.0 exited with code 1".into();
        q.wait_reason = Some(pb::WaitReason {
            kind: Some(pb::wait_reason::Kind::Preempting(
                pb::wait_reason::Preempting {
                    reclaim_from: Vec::new(),
                    waiting_for_tasks: 2,
                },
            )),
            requeued: None,
        });
        let why = "Preempting: waiting for 2 tasks of lower priority to stop";
        let out = jobs_table(&[q.clone()], 1_700_000_065_000).render();
        assert!(out.lines().nth(1).unwrap().ends_with(why), "{out}");
        let v = serde_json::to_value(JobJson::from(&q)).unwrap();
        assert_eq!(v["reason"], why);
        assert_eq!(v["message"], why);
        assert_eq!(v["wait_reason"]["kind"], "preempting");
        let detail = job_detail(&q, 1_700_000_065_000);
        assert!(
            detail
                .lines()
                .any(|l| l.starts_with("Message:") && l.ends_with(why)),
            "{detail}"
        );
        // Other states ignore it.
        q.state = pb::JobState::JobFailed as i32;
        let v = serde_json::to_value(JobJson::from(&q)).unwrap();
        assert!(v["reason"].is_null() && v["wait_reason"].is_null(), "{v}");
        assert_eq!(v["message"], "task job-7.0 exited with code 1");
    }

    #[test]
    fn agents_table_shows_free_over_total() {
        let out = agents_table(&[agent()]).render();
        let cells: Vec<&str> = out.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(
            cells,
            vec![
                "agent-a",
                "node1",
                "ACTIVE",
                "2/4",
                "14.5/16",
                "62GiB/64GiB",
                "docker,process"
            ]
        );
        assert!(out.starts_with("ID "));
    }

    #[test]
    fn agents_show_unreachable_draining_and_runtime_health() {
        let mut a = agent();
        a.draining = true;
        a.drain_deadline_ms = 1_700_000_060_000;
        a.runtime_status = vec![
            pb::RuntimeStatus {
                runtime: pb::Runtime::Docker as i32,
                available: false,
                message: "Cannot connect to the Docker daemon".into(),
            },
            pb::RuntimeStatus {
                runtime: pb::Runtime::Process as i32,
                available: true,
                message: String::new(),
            },
        ];
        let out = agents_table(&[a.clone()]).render();
        let row = out.lines().nth(1).unwrap();
        assert!(row.contains(" DRAINING "), "{row}");
        assert!(
            row.ends_with("docker (down: Cannot connect to the Docker daemon),process"),
            "{row}"
        );
        let v = serde_json::to_value(AgentJson::from(&a)).unwrap();
        assert_eq!(v["state"], "ACTIVE");
        assert_eq!(v["draining"], true);
        assert_eq!(v["drain_deadline_ms"], 1_700_000_060_000u64);
        assert_eq!(v["unreachable_since_ms"], serde_json::Value::Null);
        assert_eq!(
            v["runtime_status"],
            json!([
                {"runtime": "docker", "available": false, "message": "Cannot connect to the Docker daemon"},
                {"runtime": "process", "available": true, "message": ""}
            ])
        );
        let d = agent_detail(&a, &BTreeMap::new());
        assert!(d.contains("State:       DRAINING"), "{d}");
        assert!(
            d.contains("running tasks killed at 2023-11-14T22:14:20Z"),
            "{d}"
        );
        // Unreachable, lost; a drained unreachable agent says both.
        for (state, draining, want) in [
            (pb::AgentState::AgentUnreachable, false, "UNREACHABLE"),
            (pb::AgentState::AgentLost, false, "LOST"),
            (
                pb::AgentState::AgentUnreachable,
                true,
                "UNREACHABLE,DRAINING",
            ),
            (pb::AgentState::AgentActive, false, "ACTIVE"),
        ] {
            let mut a = agent();
            a.state = state as i32;
            a.draining = draining;
            a.unreachable_since_ms = 1_700_000_000_000;
            assert_eq!(agent_display_state(&a), want);
            let row = agents_table(&[a.clone()]).render();
            assert!(row.contains(&format!(" {want} ")), "{row}");
            let v = serde_json::to_value(AgentJson::from(&a)).unwrap();
            assert_eq!(v["state"], want.split(',').next().unwrap());
            assert_eq!(v["unreachable_since_ms"], 1_700_000_000_000u64);
        }
        // A runtime down without a message.
        let mut a = agent();
        a.runtime_status = vec![pb::RuntimeStatus {
            runtime: pb::Runtime::Docker as i32,
            available: false,
            message: String::new(),
        }];
        assert_eq!(agent_runtimes(&a), "docker (down),process");
    }

    #[test]
    fn unreachable_tasks_and_no_fence_jobs_are_shown() {
        let mut j = job();
        j.spec.as_mut().unwrap().no_fence = true;
        j.tasks[0].state = pb::TaskState::TaskUnreachable as i32;
        j.tasks[0].reason = pb::Reason::AgentUnreachable as i32;
        let v = serde_json::to_value(JobJson::from(&j)).unwrap();
        assert_eq!(v["no_fence"], true);
        assert_eq!(v["tasks"][0]["state"], "UNREACHABLE");
        assert_eq!(v["tasks"][0]["reason"], "AGENT_UNREACHABLE");
        let d = job_detail(&j, 1_700_000_000_000);
        assert!(d.contains("Fencing:") && d.contains("--no-fence"), "{d}");
        assert!(d.contains("UNREACHABLE"), "{d}");
        j.spec.as_mut().unwrap().no_fence = false;
        let v = serde_json::to_value(JobJson::from(&j)).unwrap();
        assert_eq!(v["no_fence"], false);
    }

    #[test]
    fn gpus_table_marks_free_gpus() {
        let s = pb::GpuStatus {
            gpu: Some(gpu(3)),
            agent_id: "agent-a".into(),
            task_id: String::new(),
            cordoned: false,
            ..Default::default()
        };
        let cordoned = pb::GpuStatus {
            cordoned: true,
            ..s.clone()
        };
        let out = gpus_table(&[cordoned]).render();
        assert!(out.contains(" CORDONED "), "{out}");
        let out = gpus_table(&[s]).render();
        let mut lines = out.lines();
        assert_eq!(
            lines.next().unwrap().split_whitespace().collect::<Vec<_>>(),
            vec!["AGENT", "INDEX", "UUID", "MODEL", "MEMORY", "HEALTH", "TASK"]
        );
        assert_eq!(
            lines.next().unwrap(),
            "agent-a  3      GPU-3  NVIDIA A100-SXM4-40GB  40GiB   healthy  -"
        );
    }

    #[test]
    fn job_detail_has_fields_and_tasks() {
        let out = job_detail(&job(), 1_700_000_065_000);
        assert!(out.contains("ID:        job-7\n"), "{out}");
        assert!(out.contains("State:     SUCCEEDED\n"), "{out}");
        assert!(out.contains("Command:   sh -c 'echo hi'\n"), "{out}");
        assert!(out.contains("Memory:    2GiB\n"), "{out}");
        assert!(
            out.contains("Submitted: 2023-11-14T22:13:20Z (65s ago)\n"),
            "{out}"
        );
        assert!(out.contains("TASK     RANK  AGENT    STATE"), "{out}");
        assert!(out.contains("Retries:   0 of 0\n"), "{out}");
        // A gang shows replicas times GPUs per task, and its priority.
        let mut g = job();
        if let Some(spec) = g.spec.as_mut() {
            spec.replicas = 3;
            spec.priority = -5;
        }
        let row = jobs_table(&[g.clone()], 1_700_000_065_000).render();
        let cells: Vec<&str> = row.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(&cells[3..5], &["-5", "3x2"], "{row}");
        let v = serde_json::to_value(JobJson::from(&g)).unwrap();
        assert_eq!(
            (v["replicas"].as_u64(), v["priority"].as_i64()),
            (Some(3), Some(-5))
        );
        assert!(out.contains("GPU-1,GPU-2"), "{out}");
        assert!(out.contains("Driver:    any\n"), "{out}");
        // Options: every one set, in its own form; none: `-`.
        assert!(out.contains("Options:   -\n"), "{out}");
        if let Some(spec) = g.spec.as_mut() {
            spec.options = gpuctl_core::convert::options_to_pb(gpuctl_core::types::TaskOptions {
                shm_size: Some(gpuctl_core::types::MiB(1536)),
                port: vec!["http".into(), "metrics".into()],
                readiness: Some("http:http/healthz interval=2s".parse().unwrap()),
                liveness: Some("tcp:metrics".parse().unwrap()),
            });
        }
        let out = job_detail(&g, 1_700_000_065_000);
        assert!(
            out.contains(
                "Options:   liveness=tcp:metrics port=http,metrics \
                 readiness='http:http/healthz interval=2s' shm_size=1536MiB\n"
            ),
            "{out}"
        );
    }

    #[test]
    fn job_detail_ends_with_events_like_kubectl_describe() {
        let now = 1_700_000_600_000;
        let mut j = job();
        let out = job_detail(&j, now);
        assert!(out.ends_with("\nEvents: <none>\n"), "{out}");
        let ev = |kind: &str, warning, first_ms, last_ms, count, message: &str| pb::JobEvent {
            kind: kind.into(),
            warning,
            message: message.into(),
            first_ms,
            last_ms,
            count,
        };
        j.events = vec![
            ev(
                "Queued",
                false,
                1_700_000_000_000,
                1_700_000_000_000,
                1,
                "submitted",
            ),
            ev(
                "Preempted",
                true,
                1_700_000_060_000,
                1_700_000_540_000,
                5,
                "preempted by job-9 (priority 5)",
            ),
            ev(
                "Succeeded",
                false,
                1_700_000_590_000,
                1_700_000_590_000,
                1,
                "exited with code 0",
            ),
        ];
        j.events_dropped = 3;
        let out = job_detail(&j, now);
        let events = out.split("\nEvents:\n").nth(1).expect(&out);
        let lines: Vec<&str> = events.lines().collect();
        assert_eq!(lines[0], "(3 older events dropped)");
        assert_eq!(
            lines[1].split_whitespace().collect::<Vec<_>>(),
            ["TYPE", "REASON", "AGE", "MESSAGE"]
        );
        assert!(lines[2].starts_with("Normal   Queued"), "{events}");
        assert!(lines[2].contains("10m "), "{events}");
        assert!(
            lines[3].contains("Warning  Preempted  60s (x5 over 8m)  preempted by job-9"),
            "{events}"
        );
        assert!(lines[4].ends_with("exited with code 0"), "{events}");
        // --json: the same, as data.
        let v = serde_json::to_value(JobJson::from(&j)).unwrap();
        assert_eq!(v["events_dropped"], 3);
        assert_eq!(
            v["events"][1],
            json!({
                "type": "Warning",
                "reason": "Preempted",
                "message": "preempted by job-9 (priority 5)",
                "first_ms": 1_700_000_060_000u64,
                "last_ms": 1_700_000_540_000u64,
                "count": 5,
            })
        );
    }

    #[test]
    fn what_a_job_needs_of_the_driver_is_shown() {
        let mut j = job();
        if let Some(spec) = j.spec.as_mut() {
            spec.require_cuda = "driver>=535".into();
        }
        j.image_requires = vec![
            "cuda>=12.2 brand=tesla,driver>=470,driver<471".into(),
            "arch>=8.0".into(),
        ];
        let out = job_detail(&j, 1_700_000_065_000);
        assert!(
            out.contains(
                "Driver:    driver>=535 (--require-cuda); cuda>=12.2 (+1 alternative) \
                 and arch>=8.0 (its image's)\n"
            ),
            "{out}"
        );
        let v = serde_json::to_value(JobJson::from(&j)).unwrap();
        assert_eq!(v["require_cuda"], "driver>=535");
        assert_eq!(
            v["image_requires"],
            json!(["cuda>=12.2 brand=tesla,driver>=470,driver<471", "arch>=8.0"])
        );
        let plain = serde_json::to_value(JobJson::from(&job())).unwrap();
        assert_eq!(plain["require_cuda"], json!(null));
        assert_eq!(plain["image_requires"], json!([]));
    }

    #[test]
    fn formatting_helpers() {
        assert_eq!(fmt_mib(0), "0MiB");
        assert_eq!(fmt_mib(512), "512MiB");
        assert_eq!(fmt_mib(40960), "40GiB");
        assert_eq!(fmt_mib(1536), "1.5GiB");
        assert_eq!(fmt_cpus(1.0), "1");
        assert_eq!(fmt_cpus(0.25), "0.25");
        assert_eq!(fmt_cpus(0.5), "0.5");
        assert_eq!(fmt_age(0, 5), "-");
        assert_eq!(fmt_age(1000, 6000), "5s");
        assert_eq!(fmt_age(1, 1 + 3 * 3600 * 1000), "3h");
        assert_eq!(fmt_age(1, 1 + 10 * 60 * 1000), "10m");
        assert_eq!(fmt_age(1, 1 + 3 * 86400 * 1000), "3d");
        assert_eq!(fmt_timestamp(0), "-");
        assert_eq!(fmt_timestamp(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(shell_quote("abc"), "abc");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_join(&["echo".into(), "a b".into()]), "echo 'a b'");
    }

    #[test]
    fn topology_matrix_reads_like_nvidia_smi() {
        let mut a = gpu(0);
        let mut b = gpu(1);
        let c = pb::Gpu {
            numa_node: Some(1),
            ..gpu(2)
        };
        a.numa_node = Some(0);
        b.numa_node = Some(0);
        let peer = |u: &str, nvlinks, pcie: &str| pb::GpuPeer {
            uuid: u.into(),
            nvlinks,
            pcie: pcie.into(),
        };
        a.peers = vec![peer("GPU-1", 2, "PIX"), peer("GPU-2", 0, "SYS")];
        b.peers = vec![peer("GPU-0", 2, "PIX")];
        let m = topology_matrix(&[c, b, a]);
        let lines: Vec<Vec<&str>> = m
            .lines()
            .take(4)
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(lines[0], vec!["GPU0", "GPU1", "GPU2", "NUMA"]);
        assert_eq!(lines[1], vec!["GPU0", "X", "NV2", "SYS", "0"]);
        // GPU1 knows nothing about GPU2: shown as unknown, not guessed.
        assert_eq!(lines[2], vec!["GPU1", "NV2", "X", "?", "0"]);
        assert_eq!(lines[3], vec!["GPU2", "?", "?", "X", "1"]);
        assert!(m.contains("NV#  = connected by # NVLink links"));
    }

    #[test]
    fn agent_detail_shows_gpus_tasks_and_attributes() {
        let mut a = agent();
        a.driver_version = "535.129.03".into();
        a.attributes
            .insert("nvidia.com/gpu.count".into(), "4".into());
        a.gpus[3].healthy = false;
        a.gpus[3].unhealthy_reason = "name: GPU is lost".into();
        let holders: BTreeMap<String, String> =
            [("GPU-1".to_string(), "job-7.0".to_string())].into();
        let d = agent_detail(&a, &holders);
        assert!(d.contains("Root tasks:  no\n"), "{d}");
        assert!(d.contains("Mounts:      -\n"), "{d}");
        a.allow_root_tasks = true;
        a.allowed_mounts = vec!["/data".into(), "/scratch".into()];
        let d = agent_detail(&a, &holders);
        assert!(
            d.contains("Root tasks:  allowed (allow_root_tasks)\n"),
            "{d}"
        );
        assert!(d.contains("Mounts:      /data, /scratch\n"), "{d}");
        assert!(d.contains("Driver:      535.129.03"), "{d}");
        assert!(d.contains("CUDA:        -"), "{d}");
        assert!(d.contains("GPUs:        2 free of 4 (simulated)"), "{d}");
        let row1 = d.lines().find(|l| l.starts_with("1 ")).unwrap();
        assert!(row1.ends_with("job-7.0"), "{row1}");
        assert!(d.contains("UNHEALTHY: name: GPU is lost"), "{d}");
        assert!(d.contains("Topology:"), "{d}");
        assert!(d.contains("  nvidia.com/gpu.count=4"), "{d}");
        assert!(d.contains("Ports:       none\n"), "{d}");
        a.ports = Some(pb::PortRange {
            start: 31000,
            end: 32000,
        });
        a.total.as_mut().unwrap().ports = 1001;
        a.allocated.as_mut().unwrap().ports = 3;
        let d = agent_detail(&a, &holders);
        assert!(d.contains("Ports:       998 free of 31000-32000\n"), "{d}");
    }
}
