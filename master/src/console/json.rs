//! The console's JSON: the Operator API's answers as the browser reads
//! them, and the submit form as a `pb::JobSpec`. Pure: no I/O, no clock.
//!
//! Enums become the words gpuctl prints (`RUNNING`, `ACTIVE`), times stay
//! milliseconds since the epoch (the page shows ages in the reader's time),
//! and a queued job's wait reason, which the master sends as data, gets a
//! one-line summary here (gpuctl's full words are in
//! `cli/src/output/wait_reason.rs` and docs/scheduling.md).

use std::collections::BTreeMap;

use gpuctl_core::convert::{agent_state_name, job_state_name, runtime_from_pb, task_state_name};
use gpuctl_proto::pb;
use gpuctl_proto::pb::wait_reason as wr;
use serde::Deserialize;
use serde_json::{json, Value};

fn runtime_name(v: i32) -> String {
    runtime_from_pb("runtime", v).map_or_else(|_| format!("unknown({v})"), |r| r.to_string())
}

pub fn resources(r: Option<&pb::Resources>) -> Value {
    let r = r.copied().unwrap_or_default();
    json!({ "cpus": r.cpus, "mem_mib": r.mem_mib, "gpus": r.gpus, "ports": r.ports })
}

fn gpu(g: &pb::Gpu) -> Value {
    json!({
        "uuid": g.uuid,
        "index": g.index,
        "model": g.model,
        "memory_mib": g.memory_mib,
        "healthy": g.healthy,
        "unhealthy_reason": g.unhealthy_reason,
        "pci_bus_id": g.pci_bus_id,
    })
}

pub fn agent(a: &pb::Agent) -> Value {
    json!({
        "id": a.id,
        "hostname": a.hostname,
        "address": a.address,
        "state": agent_state_name(a.state),
        "total": resources(a.total.as_ref()),
        "allocated": resources(a.allocated.as_ref()),
        "gpus": a.gpus.iter().map(gpu).collect::<Vec<_>>(),
        "runtimes": a.runtimes.iter().map(|r| runtime_name(*r)).collect::<Vec<_>>(),
        "runtime_status": a.runtime_status.iter().map(|r| json!({
            "runtime": runtime_name(r.runtime),
            "available": r.available,
            "message": r.message,
        })).collect::<Vec<_>>(),
        "registered_at_ms": a.registered_at_ms,
        "simulated_gpus": a.simulated_gpus,
        "driver_version": a.driver_version,
        "cuda_driver_version": a.cuda_driver_version,
        "draining": a.draining,
        "unreachable_since_ms": a.unreachable_since_ms,
    })
}

/// One GPU with its latest reading (`sample` null when there is none:
/// simulated GPUs, or before the agent's first heartbeat) and its task.
pub fn gpu_status(s: &pb::GpuStatus) -> Value {
    let sample = s.sample.as_ref().map(|m| {
        json!({
            "utilization_pct": m.utilization_pct,
            "memory_used_mib": m.memory_used_mib,
            "memory_total_mib": m.memory_total_mib,
            "temperature_c": m.temperature_c,
            "power_w": m.power_w,
            "sampled_at_ms": m.sampled_at_ms,
            "xid_errors": m.xid_errors,
        })
    });
    let g = s.gpu.clone().unwrap_or_default();
    json!({
        "agent_id": s.agent_id,
        "hostname": s.hostname,
        "gpu": gpu(&g),
        "task_id": non_empty(&s.task_id),
        "job_id": non_empty(&s.job_id),
        "cordoned": s.cordoned,
        "health": health_word(g.healthy, s.cordoned),
        "sample": sample,
    })
}

/// The word `gpuctl top` shows for a GPU's health.
pub fn health_word(healthy: bool, cordoned: bool) -> &'static str {
    match (healthy, cordoned) {
        (false, _) => "unhealthy",
        (true, true) => "cordoned",
        (true, false) => "healthy",
    }
}

fn non_empty(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

pub fn master(m: &pb::MasterInfo) -> Value {
    json!({
        "id": m.id,
        "address": m.address,
        "role": m.role,
        "term": m.term,
        "commit_index": m.commit_index,
        "applied_index": m.applied_index,
        "answered": m.answered,
        "voter": m.voter,
        "reachable": m.reachable,
    })
}

pub fn whoami(w: &pb::WhoAmIResponse) -> Value {
    let token = w.token.as_ref().map(|t| {
        json!({
            "id": t.id,
            "role": token_role(t.role),
            "tenant": t.tenant,
            "description": t.description,
        })
    });
    json!({ "kind": w.kind, "token": token })
}

fn token_role(r: i32) -> &'static str {
    match pb::TokenRole::try_from(r) {
        Ok(pb::TokenRole::Admin) => "admin",
        Ok(pb::TokenRole::User) => "user",
        Ok(pb::TokenRole::Framework) => "framework",
        Ok(pb::TokenRole::Join) => "join",
        _ => "unknown",
    }
}

fn task(t: &pb::Task) -> Value {
    json!({
        "id": t.id,
        "agent_id": t.agent_id,
        "gpu_uuids": t.gpu_uuids,
        "state": task_state_name(t.state),
        "exit_code": t.exit_code,
        "message": t.message,
        "updated_at_ms": t.updated_at_ms,
        "rank": t.rank,
        "ports": t.ports,
    })
}

fn event(e: &pb::JobEvent) -> Value {
    json!({
        "kind": e.kind,
        "warning": e.warning,
        "message": e.message,
        "first_ms": e.first_ms,
        "last_ms": e.last_ms,
        "count": e.count,
    })
}

/// A job as the jobs page lists it: no tasks' details, no events.
pub fn job_summary(j: &pb::Job) -> Value {
    let spec = j.spec.clone().unwrap_or_default();
    let res = spec.resources.unwrap_or_default();
    let replicas = spec.replicas.max(1);
    json!({
        "id": j.id,
        "name": spec.name,
        "state": job_state_name(j.state),
        "tenant": spec.tenant,
        "image": spec.image,
        "gpus": res.gpus.saturating_mul(replicas),
        "replicas": replicas,
        "priority": spec.priority,
        "submitted_at_ms": j.submitted_at_ms,
        "message": j.message,
        "reason": j.wait_reason.as_ref().map(wait_text),
        "tasks": j.tasks.len(),
    })
}

/// A job with its spec, tasks and events (a job's page).
pub fn job_detail(j: &pb::Job) -> Value {
    let spec = j.spec.clone().unwrap_or_default();
    let placement = spec.placement.clone().unwrap_or_default();
    let mut v = job_summary(j);
    let extra = json!({
        "spec": {
            "name": spec.name,
            "image": spec.image,
            "command": spec.command,
            "env": spec.env.iter().collect::<BTreeMap<_, _>>(),
            "resources": resources(spec.resources.as_ref()),
            "priority": spec.priority,
            "replicas": spec.replicas.max(1),
            "max_retries": spec.max_retries,
            "tenant": spec.tenant,
            "gpu_model": placement.gpu_model,
            "placement": placement.policy,
            "require_cuda": spec.require_cuda,
        },
        "retries": j.retries,
        "preemptions": j.preemptions,
        "task_list": j.tasks.iter().map(task).collect::<Vec<_>>(),
        "events": j.events.iter().map(event).collect::<Vec<_>>(),
        "events_dropped": j.events_dropped,
    });
    if let (Value::Object(base), Value::Object(more)) = (&mut v, extra) {
        base.extend(more);
    }
    v
}

/// Whether a job in this state is over (no cancel, no more logs).
pub fn job_is_terminal(state: i32) -> bool {
    matches!(
        pb::JobState::try_from(state),
        Ok(pb::JobState::JobSucceeded | pb::JobState::JobFailed | pb::JobState::JobCancelled)
    )
}

fn plural(n: u64) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// What a requirement no agent meets asks, after "no agent ".
fn missing(r: &wr::Requirement) -> String {
    use wr::requirement::Kind;
    let model = if r.gpu_model.is_empty() {
        String::new()
    } else {
        format!(" of model {}", r.gpu_model)
    };
    let mem = if r.gpu_mem_min_mib > 0 {
        format!(" with at least {} MiB", r.gpu_mem_min_mib)
    } else {
        String::new()
    };
    match Kind::try_from(r.kind) {
        Ok(Kind::Runtime) => format!("runs {}", runtime_name(r.runtime)),
        Ok(Kind::Attribute) => format!("has attribute {}={}", r.key, r.pattern),
        Ok(Kind::GpuModel) => format!("has GPU model {}", non_empty(&r.gpu_model).unwrap_or("*")),
        Ok(Kind::GpuMemory) => format!("has a GPU{model}{mem}"),
        Ok(Kind::Gpus) => format!("has {} GPU{}{model}{mem}", r.gpus, plural(r.gpus.into())),
        Ok(Kind::Cpus) => format!("has {} cpus", r.cpus),
        Ok(Kind::Memory) => format!("has {} MiB of memory", r.mem_mib),
        Ok(Kind::RootTasks) => "allows root tasks (agent option allow_root_tasks)".into(),
        Ok(Kind::Mount) => format!("allows mounting {} (agent option allowed_mounts)", r.path),
        Ok(Kind::Driver) => format!("has a driver for {}", r.requires.join(" and ")),
        _ => "meets its requirements".into(),
    }
}

fn busy_words(b: &wr::Busy) -> Option<String> {
    let parts: Vec<String> = [
        (b.exhausted_gpus, "short of free GPUs"),
        (b.exhausted_cpus, "short of free cpus"),
        (b.exhausted_memory, "short of free memory"),
        (b.fit_one, "with room for one replica"),
        (b.filtered_runtime, "without the runtime"),
        (b.filtered_security, "not allowing its root or mounts"),
        (b.filtered_constraints, "not matching the constraints"),
        (b.filtered_driver, "whose driver does not qualify"),
        (b.filtered_gpu_model, "without the GPU model"),
        (b.filtered_gpu_memory, "without a GPU with the memory"),
        (b.filtered_too_small, "too small"),
    ]
    .into_iter()
    .filter(|(n, _)| *n > 0)
    .map(|(n, what)| format!("{n} {what}"))
    .collect();
    (b.agents > 0 && !parts.is_empty()).then(|| {
        format!(
            "of {} agent{}: {}",
            b.agents,
            plural(b.agents.into()),
            parts.join(", ")
        )
    })
}

fn kind_text(k: &wr::Kind) -> String {
    match k {
        wr::Kind::NeverFits(n) => {
            let why = match &n.why {
                Some(wr::never_fits::Why::NoActiveAgent(_)) | None => "no active agent".into(),
                Some(wr::never_fits::Why::Missing(m)) => match &m.need {
                    Some(need) => format!("no agent {}", missing(need)),
                    None => "no agent meets its requirements".into(),
                },
                Some(wr::never_fits::Why::Gang(g)) => format!(
                    "the agents cannot hold {} replicas of {} GPU{} at once",
                    g.replicas,
                    g.gpus,
                    plural(g.gpus.into())
                ),
            };
            why
        }
        wr::Kind::Quota(q) => {
            let n = |r: &Option<pb::Resources>| r.unwrap_or_default();
            let (used, asked, limit) = (n(&q.used), n(&q.asked), n(&q.limit));
            let parts: Vec<String> = q
                .over
                .iter()
                .filter_map(|d| match wr::Dimension::try_from(*d) {
                    Ok(wr::Dimension::Gpus) => Some(format!(
                        "{} GPUs in use + {} asked > {}",
                        used.gpus, asked.gpus, limit.gpus
                    )),
                    Ok(wr::Dimension::Cpus) => Some(format!(
                        "{} cpus in use + {} asked > {}",
                        used.cpus, asked.cpus, limit.cpus
                    )),
                    Ok(wr::Dimension::Memory) => Some(format!(
                        "{} MiB in use + {} asked > {}",
                        used.mem_mib, asked.mem_mib, limit.mem_mib
                    )),
                    _ => None,
                })
                .collect();
            format!("Quota: the jobs role's quota: {}", parts.join(", "))
        }
        wr::Kind::TenantQuota(t) => format!(
            "Quota: tenant {}'s GPU quota: {} GPUs in use + {} asked > {}",
            t.tenant, t.used, t.asked, t.quota
        ),
        wr::Kind::Starting(_) => "Scheduling: resources are free; starting it".into(),
        wr::Kind::Preempting(p) => format!(
            "Preempting: waiting for {} task{} of lower priority to stop",
            p.waiting_for_tasks,
            plural(p.waiting_for_tasks.into())
        ),
        wr::Kind::Priority(p) => {
            let mut s = "Priority: the free resources it fits go to jobs ahead of it \
                         (higher priority, or older)"
                .to_string();
            if !p.blocked_by.is_empty() {
                s.push_str(&format!(", first {}", p.blocked_by));
                if p.kept_for_preemption {
                    s.push_str(" (kept for its preemption)");
                }
            }
            s
        }
        wr::Kind::Resources(b) => {
            let mut s = "Resources: waiting for resources to be freed".to_string();
            if let Some(w) = busy_words(b) {
                s.push_str(&format!(" ({w})"));
            }
            s
        }
    }
}

/// One line saying why a queued job waits.
pub fn wait_text(w: &pb::WaitReason) -> String {
    let kind = w
        .kind
        .as_ref()
        .map_or_else(|| "waiting".to_string(), kind_text);
    let Some(r) = &w.requeued else {
        return kind;
    };
    let mut s = String::new();
    if !r.preempted_by.is_empty() {
        s.push_str(&format!("PREEMPTED by {}; ", r.preempted_by));
    }
    s.push_str(&kind);
    if r.retries > 0 {
        s.push_str(&format!(" (retry {} of {}", r.retries, r.max_retries));
        if !r.after.is_empty() {
            s.push_str(&format!(" after {}", r.after));
        }
        s.push(')');
    } else if !r.after.is_empty() {
        s.push_str(&format!(" (requeued after {})", r.after));
    }
    s
}

/// The submit form as the browser posts it. Unknown keys are refused (a
/// typo must not be dropped silently); the values are checked by the
/// master, whose errors name the field.
#[derive(Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SubmitForm {
    pub name: String,
    /// Empty: a host process.
    #[serde(default)]
    pub image: String,
    pub command: Vec<String>,
    #[serde(default)]
    pub gpus: u32,
    /// Absent: 1, as gpuctl's default.
    pub cpus: Option<f64>,
    #[serde(default)]
    pub mem_mib: u64,
    /// Host ports per task (GPUCTL_PORTS); a gang gets at least 1.
    #[serde(default)]
    pub ports: u32,
    #[serde(default)]
    pub priority: i32,
    /// Absent or 0: 1.
    #[serde(default)]
    pub replicas: u32,
    #[serde(default)]
    pub max_retries: u32,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub gpu_model: String,
    /// The idempotency key: a submit sent again with it (a retry after an
    /// unknown outcome, a double click) makes no second job.
    #[serde(default)]
    pub request_id: String,
}

/// gpuctl's default cpus for a job.
pub const DEFAULT_CPUS: f64 = 1.0;

impl SubmitForm {
    pub fn to_spec(&self) -> pb::JobSpec {
        let resources = pb::Resources {
            cpus: self.cpus.unwrap_or(DEFAULT_CPUS),
            mem_mib: self.mem_mib,
            gpus: self.gpus,
            ports: self.ports,
        };
        let placement = (!self.gpu_model.is_empty()).then(|| pb::Placement {
            gpu_model: self.gpu_model.clone(),
            ..Default::default()
        });
        pb::JobSpec {
            name: self.name.clone(),
            image: self.image.clone(),
            command: self.command.clone(),
            env: self.env.clone().into_iter().collect(),
            resources: Some(resources),
            placement,
            priority: self.priority,
            replicas: self.replicas.max(1),
            max_retries: self.max_retries,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_become_gpuctls_words() {
        assert_eq!(
            agent_state_name(pb::AgentState::AgentUnreachable as i32),
            "UNREACHABLE"
        );
        assert_eq!(agent_state_name(99), "UNKNOWN");
        let j = pb::Job {
            id: "job-7".into(),
            state: pb::JobState::JobRunning as i32,
            spec: Some(pb::JobSpec {
                name: "train".into(),
                replicas: 2,
                resources: Some(pb::Resources {
                    gpus: 2,
                    cpus: 1.5,
                    mem_mib: 10,
                    ports: 1,
                }),
                ..Default::default()
            }),
            tasks: vec![pb::Task {
                id: "job-7-0".into(),
                state: pb::TaskState::TaskRunning as i32,
                exit_code: None,
                ..Default::default()
            }],
            events: vec![pb::JobEvent {
                kind: "Started".into(),
                count: 1,
                ..Default::default()
            }],
            ..Default::default()
        };
        let v = job_detail(&j);
        assert_eq!(v["state"], "RUNNING");
        assert_eq!(v["gpus"], 4, "all replicas");
        assert_eq!(
            v["spec"]["resources"],
            json!({"cpus": 1.5, "mem_mib": 10, "gpus": 2, "ports": 1})
        );
        assert_eq!(v["task_list"][0]["state"], "RUNNING");
        assert_eq!(v["task_list"][0]["exit_code"], Value::Null);
        assert_eq!(v["events"][0]["kind"], "Started");
        assert_eq!(v["reason"], Value::Null);
        let s = job_summary(&j);
        assert!(s.get("events").is_none() && s.get("spec").is_none());
    }

    #[test]
    fn a_gpu_without_a_reading_has_a_null_sample() {
        let mut s = pb::GpuStatus {
            gpu: Some(pb::Gpu {
                uuid: "GPU-1".into(),
                healthy: true,
                ..Default::default()
            }),
            agent_id: "a1".into(),
            ..Default::default()
        };
        let v = gpu_status(&s);
        assert_eq!(v["sample"], Value::Null);
        assert_eq!(v["task_id"], Value::Null);
        assert_eq!(v["health"], "healthy");
        s.task_id = "job-1-0".into();
        s.job_id = "job-1".into();
        s.cordoned = true;
        s.sample = Some(pb::GpuSample {
            utilization_pct: 87,
            memory_used_mib: 12288,
            memory_total_mib: 40960,
            temperature_c: Some(67),
            power_w: None,
            ..Default::default()
        });
        let v = gpu_status(&s);
        assert_eq!(v["sample"]["utilization_pct"], 87);
        assert_eq!(v["sample"]["temperature_c"], 67);
        assert_eq!(v["sample"]["power_w"], Value::Null);
        assert_eq!(
            (v["task_id"].as_str(), v["job_id"].as_str()),
            (Some("job-1-0"), Some("job-1"))
        );
        assert_eq!(v["health"], "cordoned");
        assert_eq!(health_word(false, true), "unhealthy");
    }

    #[test]
    fn wait_reasons_read_as_one_line() {
        let w = |kind, requeued| pb::WaitReason {
            kind: Some(kind),
            requeued,
        };
        let busy = wr::Busy {
            agents: 3,
            exhausted_gpus: 2,
            filtered_too_small: 1,
            ..Default::default()
        };
        assert_eq!(
            wait_text(&w(wr::Kind::Resources(busy), None)),
            "Resources: waiting for resources to be freed \
             (of 3 agents: 2 short of free GPUs, 1 too small)"
        );
        let need = wr::Requirement {
            kind: wr::requirement::Kind::Gpus as i32,
            gpus: 8,
            gpu_model: "H100*".into(),
            ..Default::default()
        };
        let never = wr::NeverFits {
            why: Some(wr::never_fits::Why::Missing(wr::Missing {
                need: Some(need),
                ..Default::default()
            })),
            set_aside: None,
        };
        assert_eq!(
            wait_text(&w(wr::Kind::NeverFits(never), None)),
            "no agent has 8 GPUs of model H100*"
        );
        let requeued = wr::Requeued {
            preempted_by: "job-9".into(),
            retries: 1,
            max_retries: 3,
            after: "exit code 2".into(),
        };
        assert_eq!(
            wait_text(&w(wr::Kind::Starting(wr::Starting {}), Some(requeued))),
            "PREEMPTED by job-9; Scheduling: resources are free; starting it \
             (retry 1 of 3 after exit code 2)"
        );
        let t = wr::TenantQuota {
            tenant: "ml".into(),
            quota: 4,
            used: 4,
            asked: 1,
        };
        assert_eq!(
            wait_text(&w(wr::Kind::TenantQuota(t), None)),
            "Quota: tenant ml's GPU quota: 4 GPUs in use + 1 asked > 4"
        );
        let j = pb::Job {
            state: pb::JobState::JobQueued as i32,
            wait_reason: Some(w(
                wr::Kind::Preempting(wr::Preempting {
                    waiting_for_tasks: 1,
                }),
                None,
            )),
            ..Default::default()
        };
        assert_eq!(
            job_summary(&j)["reason"],
            "Preempting: waiting for 1 task of lower priority to stop"
        );
    }

    #[test]
    fn the_form_becomes_a_spec_with_gpuctls_defaults() {
        let f: SubmitForm = serde_json::from_value(json!({
            "name": "t", "command": ["sh", "-c", "echo hi"], "gpus": 1,
            "env": {"A": "1"}, "gpu_model": "A100*", "ports": 2
        }))
        .unwrap();
        let s = f.to_spec();
        assert_eq!(s.command, ["sh", "-c", "echo hi"]);
        assert_eq!(s.image, "", "no image: a host process");
        let r = s.resources.unwrap();
        assert_eq!(
            (r.cpus, r.mem_mib, r.gpus, r.ports),
            (DEFAULT_CPUS, 0, 1, 2)
        );
        assert_eq!(s.replicas, 1);
        assert_eq!(s.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(s.placement.unwrap().gpu_model, "A100*");
        let e = serde_json::from_value::<SubmitForm>(json!({"name": "t", "command": [], "gpu": 1}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `gpu`"), "{e}");
        let e =
            serde_json::from_value::<SubmitForm>(json!({"name": "t", "command": [], "gpus": -1}))
                .unwrap_err()
                .to_string();
        assert!(e.contains("-1"), "{e}");
    }
}
