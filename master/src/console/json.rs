//! The console's JSON: the Operator API's answers as the browser reads
//! them, and the submit form as a `pb::JobSpec`. Pure: no I/O, no clock.
//!
//! Enums become the words gpuctl prints (`RUNNING`, `ACTIVE`), times stay
//! milliseconds since the epoch (the page shows ages in the reader's time),
//! and a queued job's wait reason, which the master sends as data, is in
//! gpuctl's words (`gpuctl_core::wait_words`, listed in docs/scheduling.md).

use std::collections::BTreeMap;

use gpuctl_core::convert::{agent_state_name, job_state_name, runtime_name, task_state_name};
use gpuctl_core::wait_words::wait_reason_words;
use gpuctl_proto::pb;
use serde::Deserialize;
use serde_json::{json, Value};

/// The same shape as `gpuctl --json`'s: the domain's `Resources`.
pub fn resources(r: Option<&pb::Resources>) -> Value {
    serde_json::to_value(gpuctl_core::wait_words::resources_of(r)).unwrap_or(Value::Null)
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
        // What its agent enforces of a fraction of a shared GPU; null for
        // whole GPUs and MIG devices.
        "enforcement": (!t.enforcement.is_empty()).then_some(&t.enforcement),
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
        "reason": wait_reason_words(j),
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
                enforcement: "mps".into(),
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
        assert_eq!(v["task_list"][0]["enforcement"], "mps");
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

    /// A queued job's reason is in gpuctl's words (the tables of words are
    /// tested with them in `gpuctl_core::wait_words`); other jobs have none.
    #[test]
    fn queued_jobs_say_why_in_gpuctls_words() {
        use pb::wait_reason as wr;
        let queued = |kind, requeued| pb::Job {
            state: pb::JobState::JobQueued as i32,
            wait_reason: Some(pb::WaitReason {
                kind: Some(kind),
                requeued,
            }),
            ..Default::default()
        };
        let busy = wr::Busy {
            agents: 3,
            exhausted_gpus: 2,
            exhausted_ports: 1,
            ..Default::default()
        };
        assert_eq!(
            job_summary(&queued(wr::Kind::Resources(busy), None))["reason"],
            "Resources: waiting for resources to be freed \
             (of 3 agents: 2 short of free GPUs, 1 short of free ports)"
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
                largest: Some(4.0),
                ..Default::default()
            })),
            set_aside: None,
        };
        assert_eq!(
            job_summary(&queued(wr::Kind::NeverFits(never), None))["reason"],
            "no agent has 8 GPUs of model H100* (at most 4)"
        );
        let requeued = wr::Requeued {
            preempted_by: "job-9".into(),
            retries: 0,
            max_retries: 3,
            after: String::new(),
        };
        let mut j = queued(wr::Kind::Starting(wr::Starting {}), Some(requeued));
        assert_eq!(
            job_summary(&j)["reason"],
            "PREEMPTED by job-9; Scheduling: resources are free; starting it"
        );
        j.state = pb::JobState::JobRunning as i32;
        assert_eq!(job_summary(&j)["reason"], Value::Null);
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
