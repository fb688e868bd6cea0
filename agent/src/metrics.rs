//! The agent's Prometheus metrics (`--metrics-listen`): per GPU and per
//! MIG device, its latest health-probe reading and the task and job using
//! it; per task, the GPU memory its processes use on each GPU. Rendered at
//! scrape time from the health checks' snapshot and the executor.

use std::collections::HashMap;
use std::sync::Arc;

use gpuctl_core::metrics::{Exposition, Kind};
use gpuctl_core::types::GpuInfo;
use tokio::sync::watch;

use crate::executor::Executor;
use crate::gpu::health::Snapshot;

const MIB: f64 = 1024.0 * 1024.0;

/// The exposition of one scrape. `gpus` is what discovery found; the
/// snapshot is empty for simulated GPUs (no probe, so no readings).
pub fn render(gpus: &[GpuInfo], health: &Snapshot, executor: &Executor, host: &str) -> String {
    let mut text = render_with(
        gpus,
        health,
        &executor.gpu_tasks(),
        &executor.task_jobs(),
        executor.active_tasks(),
    );
    text.push_str(&render_dcgm(gpus, health, &executor.gpu_tasks(), host));
    text
}

/// A DCGM family: its name, help and value from a reading (None: none).
type DcgmFamily = (
    &'static str,
    &'static str,
    fn(&gpuctl_core::types::GpuSample) -> Option<f64>,
);

/// The same readings under the names and labels of NVIDIA's DCGM exporter
/// (`DCGM_FI_DEV_*`; labels `gpu` (index), `UUID`, `device`, `modelName`,
/// `Hostname`, `pci_bus_id`, and `hpc_job`, its HPC job mapping's label,
/// for the job holding the GPU), so that dashboards made for it work on
/// gpuctl's agents. Units are DCGM's: percent, MiB, Celsius, watts.
fn render_dcgm(
    gpus: &[GpuInfo],
    health: &Snapshot,
    tasks: &HashMap<String, (String, String)>,
    host: &str,
) -> String {
    let mut out = Exposition::new();
    let families: [DcgmFamily; 5] = [
        ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", |s| {
            Some(f64::from(s.utilization_pct))
        }),
        (
            "DCGM_FI_DEV_FB_USED",
            "Framebuffer memory used (in MiB).",
            |s| Some(s.memory_used_mib as f64),
        ),
        (
            "DCGM_FI_DEV_FB_FREE",
            "Framebuffer memory free (in MiB).",
            |s| Some(s.memory_total_mib.saturating_sub(s.memory_used_mib) as f64),
        ),
        ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", |s| {
            s.temperature_c.map(f64::from)
        }),
        ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", |s| {
            s.power_w
        }),
    ];
    for (name, help, value) in families {
        out.family(name, help, Kind::Gauge);
        for g in gpus {
            let Some(sample) = health
                .gpus
                .iter()
                .find(|h| h.uuid == g.uuid)
                .and_then(|h| h.sample.as_ref())
            else {
                continue;
            };
            let Some(v) = value(sample) else { continue };
            let index = g.index.to_string();
            let device = format!("nvidia{}", g.minor);
            let job = tasks.get(&g.uuid).map_or("", |(_, j)| j.as_str());
            out.sample(
                name,
                &[
                    ("gpu", index.as_str()),
                    ("UUID", g.uuid.as_str()),
                    ("device", device.as_str()),
                    ("modelName", g.model.as_str()),
                    ("Hostname", host),
                    ("pci_bus_id", g.pci_bus_id.as_str()),
                    ("hpc_job", job),
                ],
                v,
            );
        }
    }
    out.finish()
}

/// [`render`] on plain data: `tasks` is the task and job holding each GPU
/// or MIG device, by UUID (a shared GPU's fractions hold none alone);
/// `jobs` names the job of each task's memory series (a task it does not
/// name gets `job=""`).
fn render_with(
    gpus: &[GpuInfo],
    health: &Snapshot,
    tasks: &HashMap<String, (String, String)>,
    jobs: &HashMap<String, String>,
    active_tasks: usize,
) -> String {
    let mut out = Exposition::new();
    gpu_metrics(&mut out, gpus, health, tasks);
    mig_metrics(&mut out, health, tasks);
    task_memory_metrics(&mut out, health, jobs);
    error_counters(&mut out, health);
    out.family(
        "gpuctl_agent_tasks_running",
        "Tasks launched on this agent and not yet ended.",
        Kind::Gauge,
    );
    out.sample("gpuctl_agent_tasks_running", &[], active_tasks as f64);
    out.finish()
}

/// The task and job holding a GPU or MIG device (`""` for none).
fn task_of<'a>(tasks: &'a HashMap<String, (String, String)>, uuid: &str) -> (&'a str, &'a str) {
    tasks
        .get(uuid)
        .map(|(t, j)| (t.as_str(), j.as_str()))
        .unwrap_or(("", ""))
}

/// Each GPU's health, utilization, memory, temperature and power.
fn gpu_metrics(
    out: &mut Exposition,
    gpus: &[GpuInfo],
    health: &Snapshot,
    tasks: &HashMap<String, (String, String)>,
) {
    let families = [
        (
            "gpuctl_gpu_healthy",
            "1 if the GPU passes its health checks, else 0.",
        ),
        (
            "gpuctl_gpu_utilization_ratio",
            "Fraction of the last sample period the GPU was busy (0 to 1).",
        ),
        ("gpuctl_gpu_memory_used_bytes", "GPU memory in use."),
        ("gpuctl_gpu_memory_total_bytes", "GPU memory in all."),
        ("gpuctl_gpu_temperature_celsius", "GPU temperature."),
        ("gpuctl_gpu_power_watts", "GPU power draw."),
    ];
    for (name, help) in families {
        out.family(name, help, Kind::Gauge);
    }
    for g in gpus {
        let h = health.gpus.iter().find(|h| h.uuid == g.uuid);
        let index = g.index.to_string();
        let (task, job) = task_of(tasks, &g.uuid);
        let labels = [
            ("uuid", g.uuid.as_str()),
            ("index", index.as_str()),
            ("model", g.model.as_str()),
            ("task", task),
            ("job", job),
        ];
        let healthy = h.map_or(g.healthy, |h| h.healthy);
        out.sample("gpuctl_gpu_healthy", &labels, f64::from(u8::from(healthy)));
        let sample = h.and_then(|h| h.sample.as_ref());
        let total_mib = sample.map_or(g.memory_mib, |s| s.memory_total_mib);
        out.sample(
            "gpuctl_gpu_memory_total_bytes",
            &labels,
            total_mib as f64 * MIB,
        );
        let Some(s) = sample else {
            continue;
        };
        out.sample(
            "gpuctl_gpu_utilization_ratio",
            &labels,
            f64::from(s.utilization_pct) / 100.0,
        );
        out.sample(
            "gpuctl_gpu_memory_used_bytes",
            &labels,
            s.memory_used_mib as f64 * MIB,
        );
        if let Some(t) = s.temperature_c {
            out.sample("gpuctl_gpu_temperature_celsius", &labels, f64::from(t));
        }
        if let Some(w) = s.power_w {
            out.sample("gpuctl_gpu_power_watts", &labels, w);
        }
    }
}

/// MIG devices as NVML listed them at the last probe (the layout may have
/// changed since discovery), under their parent.
fn mig_metrics(out: &mut Exposition, health: &Snapshot, tasks: &HashMap<String, (String, String)>) {
    let mig_families = [
        ("gpuctl_mig_memory_used_bytes", "MIG device memory in use."),
        (
            "gpuctl_mig_memory_total_bytes",
            "MIG device memory in all (its profile's share of the GPU).",
        ),
        (
            "gpuctl_mig_utilization_ratio",
            "Fraction of the last sample period the MIG device was busy, where NVML gives it (current drivers do not).",
        ),
    ];
    // Each family's samples together, as the text format wants.
    let migs: Vec<_> = health
        .gpus
        .iter()
        .flat_map(|h| h.mig.iter().map(move |m| (h, m)))
        .collect();
    for (name, help) in mig_families {
        out.family(name, help, Kind::Gauge);
        for (h, m) in &migs {
            let value = match name {
                "gpuctl_mig_memory_used_bytes" => Some(m.memory_used_mib as f64 * MIB),
                "gpuctl_mig_memory_total_bytes" => Some(m.memory_total_mib as f64 * MIB),
                _ => m.utilization_pct.map(|u| f64::from(u) / 100.0),
            };
            let Some(value) = value else {
                continue;
            };
            let index = h.index.to_string();
            let (task, job) = task_of(tasks, &m.uuid);
            let labels = [
                ("uuid", m.uuid.as_str()),
                ("gpu", h.uuid.as_str()),
                ("index", index.as_str()),
                ("profile", m.profile.as_str()),
                ("task", task),
                ("job", job),
            ];
            out.sample(name, &labels, value);
        }
    }
}

/// Per task, so that the tasks sharing a GPU are told apart.
fn task_memory_metrics(out: &mut Exposition, health: &Snapshot, jobs: &HashMap<String, String>) {
    out.family(
        "gpuctl_task_gpu_memory_used_bytes",
        "GPU memory used by a task's processes on a GPU (NVML's per-process accounting), at the last probe.",
        Kind::Gauge,
    );
    for h in &health.gpus {
        let Some(s) = &h.sample else {
            continue;
        };
        for (task, mib) in &s.task_memory_used_mib {
            let job = jobs.get(task.as_str()).map_or("", String::as_str);
            out.sample(
                "gpuctl_task_gpu_memory_used_bytes",
                &[
                    ("task", task.as_str()),
                    ("job", job),
                    ("gpu", h.uuid.as_str()),
                ],
                *mib as f64 * MIB,
            );
        }
    }
}

/// XID and double-bit ECC errors since the agent started.
fn error_counters(out: &mut Exposition, health: &Snapshot) {
    // Counters do not carry the task: a series that changed labels with
    // every task would restart at zero each time and break rate().
    out.family(
        "gpuctl_gpu_xid_errors_total",
        "Critical XID errors reported by NVML since the agent started, by XID (ignored ones included).",
        Kind::Counter,
    );
    out.family(
        "gpuctl_gpu_double_bit_ecc_errors_total",
        "Double-bit ECC errors reported by NVML since the agent started.",
        Kind::Counter,
    );
    for h in &health.gpus {
        let index = h.index.to_string();
        for (xid, n) in &h.xid_errors {
            let xid = xid.to_string();
            out.sample(
                "gpuctl_gpu_xid_errors_total",
                &[
                    ("uuid", h.uuid.as_str()),
                    ("index", index.as_str()),
                    ("model", h.model.as_str()),
                    ("xid", xid.as_str()),
                ],
                *n as f64,
            );
        }
        out.sample(
            "gpuctl_gpu_double_bit_ecc_errors_total",
            &[
                ("uuid", h.uuid.as_str()),
                ("index", index.as_str()),
                ("model", h.model.as_str()),
            ],
            h.double_bit_ecc_errors as f64,
        );
    }
}

/// A render function for [`gpuctl_core::metrics_server::serve`].
pub fn renderer(
    gpus: Vec<GpuInfo>,
    health: watch::Receiver<Snapshot>,
    executor: Arc<Executor>,
    host: String,
) -> Arc<dyn Fn() -> String + Send + Sync> {
    Arc::new(move || {
        let snapshot = health.borrow().clone();
        render(&gpus, &snapshot, &executor, &host)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::health::{GpuHealth, MigSample};
    use gpuctl_core::types::GpuSample;

    /// GPU-p in MIG mode with two MIG devices read (one busy with a task),
    /// one of them with a utilization (no driver gives one today).
    fn snapshot() -> Snapshot {
        let mig = |uuid: &str, used, util| MigSample {
            uuid: uuid.into(),
            profile: "1g.10gb".into(),
            memory_used_mib: used,
            memory_total_mib: 9856,
            utilization_pct: util,
        };
        Snapshot {
            gpus: vec![GpuHealth {
                uuid: "GPU-p".into(),
                index: 1,
                model: "H100".into(),
                healthy: true,
                reason: String::new(),
                sample: Some(GpuSample {
                    memory_total_mib: 81559,
                    ..Default::default()
                }),
                mig: vec![mig("MIG-a", 2048, None), mig("MIG-b", 0, Some(25))],
                xid_errors: Default::default(),
                double_bit_ecc_errors: 0,
            }],
            generation: 0,
        }
    }

    #[test]
    fn mig_devices_have_their_own_series_under_their_parent() {
        let gpus = [GpuInfo::new("GPU-p", 1, "H100", 81559)];
        let tasks: HashMap<String, (String, String)> = [(
            "MIG-a".to_string(),
            ("job-3.0".to_string(), "job-3".to_string()),
        )]
        .into();
        let text = render_with(&gpus, &snapshot(), &tasks, &HashMap::new(), 1);
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("gpuctl_mig_"))
            .collect();
        assert_eq!(
            lines,
            [
                r#"gpuctl_mig_memory_used_bytes{uuid="MIG-a",gpu="GPU-p",index="1",profile="1g.10gb",task="job-3.0",job="job-3"} 2147483648"#,
                r#"gpuctl_mig_memory_used_bytes{uuid="MIG-b",gpu="GPU-p",index="1",profile="1g.10gb",task="",job=""} 0"#,
                r#"gpuctl_mig_memory_total_bytes{uuid="MIG-a",gpu="GPU-p",index="1",profile="1g.10gb",task="job-3.0",job="job-3"} 10334765056"#,
                r#"gpuctl_mig_memory_total_bytes{uuid="MIG-b",gpu="GPU-p",index="1",profile="1g.10gb",task="",job=""} 10334765056"#,
                r#"gpuctl_mig_utilization_ratio{uuid="MIG-b",gpu="GPU-p",index="1",profile="1g.10gb",task="",job=""} 0.25"#,
            ]
        );
        // One HELP and TYPE per family (a family with no sample has them too).
        assert!(text.contains("# TYPE gpuctl_task_gpu_memory_used_bytes gauge\n"));
        for f in [
            "gpuctl_mig_memory_used_bytes",
            "gpuctl_mig_memory_total_bytes",
            "gpuctl_mig_utilization_ratio",
        ] {
            assert_eq!(
                text.matches(&format!("# TYPE {f} gauge\n")).count(),
                1,
                "{f}"
            );
        }
    }

    #[test]
    fn each_task_on_a_shared_gpu_has_its_memory_series() {
        let gpus = [
            GpuInfo::new("GPU-s", 0, "A100", 40960),
            GpuInfo::new("GPU-x", 1, "A100", 40960),
        ];
        let mut s = snapshot();
        let mut shared = s.gpus[0].clone();
        shared.uuid = "GPU-s".into();
        shared.index = 0;
        shared.mig.clear();
        if let Some(sample) = shared.sample.as_mut() {
            sample.task_memory_used_mib =
                [("job-1.0".to_string(), 3174), ("job-2.0".into(), 0)].into();
        }
        // A GPU that failed its probe has no reading, so no series.
        let mut failed = shared.clone();
        failed.uuid = "GPU-x".into();
        failed.sample = None;
        s.gpus = vec![shared, failed];
        // Fractions hold no GPU alone; each task's series names its job.
        let jobs: HashMap<String, String> = [
            ("job-1.0".to_string(), "job-1".to_string()),
            ("job-2.0".to_string(), "job-2".to_string()),
        ]
        .into();
        let text = render_with(&gpus, &s, &HashMap::new(), &jobs, 2);
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("gpuctl_task_"))
            .collect();
        assert_eq!(
            lines,
            [
                r#"gpuctl_task_gpu_memory_used_bytes{task="job-1.0",job="job-1",gpu="GPU-s"} 3328180224"#,
                r#"gpuctl_task_gpu_memory_used_bytes{task="job-2.0",job="job-2",gpu="GPU-s"} 0"#,
            ]
        );
        assert_eq!(
            text.matches("# TYPE gpuctl_task_gpu_memory_used_bytes gauge\n")
                .count(),
            1
        );
    }
}
