//! The agent's Prometheus metrics (`--metrics-listen`): per GPU, its
//! latest health-probe reading and the task and job using it, rendered at
//! scrape time from the health checks' snapshot and the executor.

use std::sync::Arc;

use gpuctl_core::metrics::{Exposition, Kind};
use gpuctl_core::types::GpuInfo;
use tokio::sync::watch;

use crate::executor::Executor;
use crate::gpu::health::Snapshot;

const MIB: f64 = 1024.0 * 1024.0;

/// The exposition of one scrape. `gpus` is what discovery found; the
/// snapshot is empty for simulated GPUs (no probe, so no readings).
pub fn render(gpus: &[GpuInfo], health: &Snapshot, executor: &Executor) -> String {
    let tasks = executor.gpu_tasks();
    let mut out = Exposition::new();
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
        let (task, job) = tasks
            .get(&g.uuid)
            .map(|(t, j)| (t.as_str(), j.as_str()))
            .unwrap_or(("", ""));
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
    out.family(
        "gpuctl_agent_tasks_running",
        "Tasks launched on this agent and not yet ended.",
        Kind::Gauge,
    );
    out.sample(
        "gpuctl_agent_tasks_running",
        &[],
        executor.active_tasks() as f64,
    );
    out.finish()
}

/// A render function for [`gpuctl_core::metrics_server::serve`].
pub fn renderer(
    gpus: Vec<GpuInfo>,
    health: watch::Receiver<Snapshot>,
    executor: Arc<Executor>,
) -> Arc<dyn Fn() -> String + Send + Sync> {
    Arc::new(move || {
        let snapshot = health.borrow().clone();
        render(&gpus, &snapshot, &executor)
    })
}
