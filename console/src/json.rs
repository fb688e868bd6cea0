//! The console's JSON: the Operator API's answers as the browser reads
//! them, and the submit form as a `pb::JobSpec`. Pure: no I/O, no clock.
//!
//! Jobs, agents, GPUs and masters have the shapes of `gpuctl --json`
//! (`gpuctl_core::view`, one view layer for both), with a few fields only
//! the page needs beside them (a GPU's latest reading, its host and job, a
//! master's `answered`). Services have the shape of `gpuctl services get
//! --json`, each replica's job a `JobJson`.

use std::collections::BTreeMap;

use gpuctl_core::view::{GpuStatusJson, MasterJson};
use gpuctl_proto::pb;
use serde::{Deserialize, Serialize};

pub use gpuctl_core::view::{AgentJson, JobJson, ServiceJson};

/// A GPU as `gpuctl gpus --json` shows it, with what the page's GPU table
/// adds: its host, its task's job, a health word and its latest reading.
#[derive(Debug, Serialize)]
pub struct GpuView {
    #[serde(flatten)]
    pub gpu: GpuStatusJson,
    pub hostname: String,
    /// The job of `task_id`; null when the GPU is free.
    pub job_id: Option<String>,
    /// `healthy`, `cordoned` or `unhealthy`, as `gpuctl top` says.
    pub health: &'static str,
    /// Null when there is none: simulated GPUs, or before the agent's
    /// first heartbeat.
    pub sample: Option<SampleView>,
}

/// A GPU's latest reading, from its agent's heartbeat.
#[derive(Debug, Serialize)]
pub struct SampleView {
    pub utilization_pct: u32,
    pub memory_used_mib: u64,
    pub memory_total_mib: u64,
    pub temperature_c: Option<u32>,
    pub power_w: Option<f64>,
    pub sampled_at_ms: u64,
    pub xid_errors: u64,
}

pub fn gpu_status(s: &pb::GpuStatus) -> GpuView {
    let healthy = s.gpu.as_ref().is_some_and(|g| g.healthy);
    GpuView {
        gpu: GpuStatusJson::from(s),
        hostname: s.hostname.clone(),
        job_id: (!s.job_id.is_empty()).then(|| s.job_id.clone()),
        health: health_word(healthy, s.cordoned),
        sample: s.sample.as_ref().map(|m| SampleView {
            utilization_pct: m.utilization_pct,
            memory_used_mib: m.memory_used_mib,
            memory_total_mib: m.memory_total_mib,
            temperature_c: m.temperature_c,
            power_w: m.power_w,
            sampled_at_ms: m.sampled_at_ms,
            xid_errors: m.xid_errors,
        }),
    }
}

/// The word `gpuctl top` shows for a GPU's health.
pub fn health_word(healthy: bool, cordoned: bool) -> &'static str {
    match (healthy, cordoned) {
        (false, _) => "unhealthy",
        (true, true) => "cordoned",
        (true, false) => "healthy",
    }
}

/// A master as `gpuctl masters --json` shows it, and whether it is the one
/// that answered.
#[derive(Debug, Serialize)]
pub struct MasterView {
    #[serde(flatten)]
    pub master: MasterJson,
    pub answered: bool,
}

pub fn master(m: &pb::MasterInfo) -> MasterView {
    MasterView {
        master: MasterJson::from(m),
        answered: m.answered,
    }
}

/// Who the browser's token is (`kind`: `token` or `open`).
#[derive(Debug, Serialize)]
pub struct WhoAmIView {
    pub kind: String,
    pub token: Option<TokenView>,
}

#[derive(Debug, Serialize)]
pub struct TokenView {
    pub id: String,
    /// `admin`, `user`, `framework`, `join` or `unknown`.
    pub role: &'static str,
    pub tenant: String,
    pub description: String,
}

pub fn whoami(w: &pb::WhoAmIResponse) -> WhoAmIView {
    WhoAmIView {
        kind: w.kind.clone(),
        token: w.token.as_ref().map(|t| TokenView {
            id: t.id.clone(),
            role: token_role(t.role),
            tenant: t.tenant.clone(),
            description: t.description.clone(),
        }),
    }
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

/// Whether a job in this state is over (no cancel, no more logs).
pub fn job_is_terminal(state: i32) -> bool {
    matches!(
        pb::JobState::try_from(state),
        Ok(pb::JobState::JobSucceeded | pb::JobState::JobFailed | pb::JobState::JobCancelled)
    )
}

/// The body of `POST /api/services/NAME/scale`. Unknown keys are refused.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScaleForm {
    /// Replicas to run from now on; the master says how many are allowed.
    pub replicas: u32,
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
    use gpuctl_core::convert::agent_state_name;
    use serde_json::{json, Value};

    /// A job as `GET /api/jobs/ID` answers it.
    fn job(j: &pb::Job) -> Value {
        serde_json::to_value(JobJson::from(j)).unwrap()
    }

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
        let v = job(&j);
        assert_eq!(v["state"], "RUNNING");
        assert_eq!(
            (&v["resources"]["gpus"], &v["replicas"]),
            (&json!(2), &json!(2))
        );
        assert_eq!(
            v["resources"],
            json!({"cpus": 1.5, "mem_mib": 10, "gpus": 2, "ports": 1})
        );
        assert_eq!(v["tasks"][0]["state"], "RUNNING");
        assert_eq!(v["tasks"][0]["exit_code"], Value::Null);
        assert_eq!(v["tasks"][0]["enforcement"], "mps");
        assert_eq!(v["events"][0]["reason"], "Started");
        assert_eq!(v["reason"], Value::Null);
        assert_eq!(
            v,
            serde_json::to_value(gpuctl_core::view::JobJson::from(&j)).unwrap()
        );
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
        let v = serde_json::to_value(gpu_status(&s)).unwrap();
        assert_eq!(v["sample"], Value::Null);
        assert_eq!(v["task_id"], Value::Null);
        assert_eq!(
            (&v["uuid"], &v["agent_id"]),
            (&json!("GPU-1"), &json!("a1"))
        );
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
        let v = serde_json::to_value(gpu_status(&s)).unwrap();
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
            job(&queued(wr::Kind::Resources(busy), None))["reason"],
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
            job(&queued(wr::Kind::NeverFits(never), None))["reason"],
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
            job(&j)["reason"],
            "PREEMPTED by job-9; Scheduling: resources are free; starting it"
        );
        j.state = pb::JobState::JobRunning as i32;
        assert_eq!(job(&j)["reason"], Value::Null);
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
