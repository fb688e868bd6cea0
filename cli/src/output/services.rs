//! Services as gpuctl prints them: `services list`, `services get` and
//! their `--json`. A replica's job is shown as jobs are (`JobJson`).

use std::fmt::Write as _;

use super::*;

/// `services list`: NAME, READY (replicas running and ready, of those
/// asked), GPUS (per replica, as `jobs list` shows a task's), IMAGE, AGE.
pub fn services_table(services: &[pb::Service], now_ms: u64) -> Table {
    let mut t = Table::new(&["NAME", "READY", "GPUS", "IMAGE", "AGE"]);
    for s in services {
        let spec = s.template.clone().unwrap_or_default();
        t.row(vec![
            s.name.clone(),
            format!("{}/{}", s.ready, s.replicas),
            gpus_per_task(&spec),
            spec.image.clone(),
            fmt_age(s.created_at_ms, now_ms),
        ]);
    }
    t
}

/// `services get`: `Key: value` lines (the service, then its template),
/// one line per replica, then the service's events.
pub fn service_detail(s: &pb::Service, now_ms: u64) -> String {
    let spec = s.template.clone().unwrap_or_default();
    let res = spec.resources.unwrap_or_default();
    let fields = [
        ("ID", s.id.clone()),
        ("Name", s.name.clone()),
        ("Tenant", s.tenant.clone()),
        (
            "Replicas",
            format!(
                "{} asked, {} running, {} ready",
                s.replicas, s.running, s.ready
            ),
        ),
        (
            "Image",
            if spec.image.is_empty() {
                "- (host process)".to_string()
            } else {
                spec.image.clone()
            },
        ),
        ("Command", shell_join(&spec.command)),
        ("Env", env_words(&spec.env)),
        ("GPUs", gpus_words(&spec, &res)),
        ("CPUs", fmt_cpus(res.cpus)),
        (
            "Memory",
            if res.mem_mib == 0 {
                "no limit".to_string()
            } else {
                fmt_mib(res.mem_mib)
            },
        ),
        ("Ports", ports_words(&spec, &res)),
        ("Checks", checks_words(&spec)),
        ("Drain", drain_words(s)),
        ("Priority", spec.priority.to_string()),
        (
            "Security",
            security_words(&SecurityJson::from(spec.security.as_ref())),
        ),
        ("Driver", driver_words(&spec.require_cuda, &[])),
        (
            "Created",
            format!(
                "{} ({} ago)",
                fmt_timestamp(s.created_at_ms),
                fmt_age(s.created_at_ms, now_ms)
            ),
        ),
    ];
    let width = fields.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    let mut out = String::new();
    for (k, v) in fields {
        let _ = writeln!(out, "{:<width$} {v}", format!("{k}:"));
    }
    out.push('\n');
    if s.replica_jobs.is_empty() {
        out.push_str("Replica jobs: none\n");
    } else {
        out.push_str("Replica jobs:\n");
        out.push_str(&replicas_table(&s.replica_jobs).render());
    }
    out.push('\n');
    out.push_str(&events_of(&s.events, 0, now_ms));
    out
}

/// A leaving replica's drain, and the replicas draining now.
fn drain_words(s: &pb::Service) -> String {
    let drain = gpuctl_core::types::ms_text(s.drain_ms);
    if s.draining_jobs.is_empty() {
        drain
    } else {
        format!("{drain}; draining now: {}", s.draining_jobs.join(", "))
    }
}

/// The template's ports: their number and names.
fn ports_words(spec: &pb::JobSpec, res: &pb::Resources) -> String {
    let names = gpuctl_core::convert::options_view(spec.options.as_ref()).port;
    if names.is_empty() {
        res.ports.to_string()
    } else {
        format!("{} ({})", res.ports, names.join(", "))
    }
}

/// `readiness http:http/healthz; liveness tcp:http`, or `none`.
fn checks_words(spec: &pb::JobSpec) -> String {
    let o = gpuctl_core::convert::options_view(spec.options.as_ref());
    let words: Vec<String> = [("readiness", o.readiness), ("liveness", o.liveness)]
        .into_iter()
        .filter_map(|(k, c)| c.map(|c| format!("{k} {c}")))
        .collect();
    if words.is_empty() {
        "none (a running replica is ready)".into()
    } else {
        words.join("; ")
    }
}

/// One row per replica: REPLICA (its index), JOB, STATE, READY (a running
/// replica's readiness), AGENT (of its latest task), PORTS (its latest
/// task's host ports, when any replica has some: with AGENT, where to
/// reach it), RESTARTS (its job's retries), MESSAGE (why it waits, how its
/// last attempt ended, or why a running one is not ready).
pub fn replicas_table(replicas: &[pb::ServiceReplica]) -> Table {
    let last = |r: &pb::ServiceReplica| r.job.as_ref().and_then(|j| j.tasks.last().cloned());
    let ports = replicas
        .iter()
        .any(|r| last(r).is_some_and(|t| !t.ports.is_empty()));
    let mut head = vec!["REPLICA", "JOB", "STATE", "READY", "AGENT"];
    if ports {
        head.push("PORTS");
    }
    head.extend(["RESTARTS", "MESSAGE"]);
    let mut t = Table::new(&head);
    for r in replicas {
        let task = last(r).unwrap_or_default();
        let running = r
            .job
            .as_ref()
            .is_some_and(|j| j.state == pb::JobState::JobRunning as i32);
        let mut row = vec![
            r.index.to_string(),
            r.job_id.clone(),
            r.job
                .as_ref()
                .map(|j| job_state_name(j.state).to_string())
                .unwrap_or_default(),
            match (running, r.ready) {
                (false, _) => String::new(),
                (true, true) => "yes".into(),
                (true, false) => "no".into(),
            },
            task.agent_id.clone(),
        ];
        if ports {
            row.push(fmt_ports(&task.ports));
        }
        row.extend(match &r.job {
            Some(_) if running && !r.ready && !r.check_failure.is_empty() => {
                let j = r.job.as_ref().map_or(0, |j| j.retries);
                [j.to_string(), r.check_failure.clone()]
            }
            Some(j) => [j.retries.to_string(), job_message(j).replace('\n', " ")],
            None => [String::new(), String::new()],
        });
        t.row(row);
    }
    t
}

/// `services endpoints`: SERVICE, REPLICA, ADDRESS, READY, AGENT, TASK,
/// one row per running replica; a service deleted (in `--watch`) or
/// without one running has a row of its own.
pub fn endpoints_table(all: &[&pb::ServiceEndpoints]) -> Table {
    let mut t = Table::new(&["SERVICE", "REPLICA", "ADDRESS", "READY", "AGENT", "TASK"]);
    for e in all {
        if e.deleted || e.endpoints.is_empty() {
            let why = if e.deleted {
                "(deleted)"
            } else {
                "(none running)"
            };
            let mut row = vec![e.service.clone(), String::new(), why.into()];
            row.resize(6, String::new());
            t.row(row);
        }
        for p in &e.endpoints {
            t.row(vec![
                e.service.clone(),
                p.replica.to_string(),
                endpoint_address(p),
                if p.ready { "yes" } else { "no" }.to_string(),
                p.agent_id.clone(),
                p.task_id.clone(),
            ]);
        }
    }
    t
}

/// A service of 3 replicas: one running, one queued after 2 restarts,
/// one whose job is not said.
#[cfg(test)]
pub(crate) fn sample_service() -> pb::Service {
    let job = |id: &str, state: pb::JobState, agent: &str| pb::Job {
        id: id.into(),
        state: state as i32,
        tasks: if agent.is_empty() {
            Vec::new()
        } else {
            vec![pb::Task {
                id: format!("{id}.0"),
                agent_id: agent.into(),
                ..Default::default()
            }]
        },
        ..Default::default()
    };
    let mut queued = job("job-5", pb::JobState::JobQueued, "");
    queued.retries = 2;
    queued.message = "task job-5.0 exited with code 1".into();
    pb::Service {
        id: "svc-1".into(),
        name: "web".into(),
        tenant: "default".into(),
        replicas: 3,
        template: Some(pb::JobSpec {
            name: "web".into(),
            image: "nginx:1".into(),
            command: vec!["nginx".into(), "-g".into(), "daemon off;".into()],
            resources: Some(pb::Resources {
                cpus: 0.5,
                mem_mib: 512,
                gpus: 1,
                ports: 1,
            }),
            restart_policy: "always".into(),
            ..Default::default()
        }),
        created_at_ms: 1_700_000_000_000,
        replica_jobs: vec![
            pb::ServiceReplica {
                index: 0,
                job_id: "job-4".into(),
                job: Some(job("job-4", pb::JobState::JobRunning, "agent-a")),
                ready: true,
                check_failure: String::new(),
            },
            pb::ServiceReplica {
                index: 1,
                job_id: "job-5".into(),
                job: Some(queued),
                ready: false,
                check_failure: String::new(),
            },
            pb::ServiceReplica {
                index: 2,
                job_id: "job-6".into(),
                job: None,
                ready: false,
                check_failure: String::new(),
            },
        ],
        events: vec![pb::JobEvent {
            kind: "Created".into(),
            warning: false,
            message: "3 replicas".into(),
            first_ms: 1_700_000_000_000,
            last_ms: 1_700_000_000_000,
            count: 1,
        }],
        running: 1,
        ready: 1,
        drain_ms: 5_000,
        draining_jobs: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn endpoints_table_rows() {
        let e = |replica, host: &str, port, ready| pb::Endpoint {
            replica,
            job_id: format!("job-{replica}"),
            task_id: format!("job-{replica}.0"),
            agent_id: "a1".into(),
            host: host.into(),
            port,
            ready,
        };
        let web = pb::ServiceEndpoints {
            service: "web".into(),
            port_name: "http".into(),
            endpoints: vec![e(0, "10.0.0.7", 31000, true), e(1, "fd00::7", 31001, false)],
            ..Default::default()
        };
        let idle = pb::ServiceEndpoints {
            service: "idle".into(),
            ..Default::default()
        };
        let out = endpoints_table(&[&web, &idle]).render();
        let rows: Vec<Vec<&str>> = out
            .lines()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            rows[0],
            ["SERVICE", "REPLICA", "ADDRESS", "READY", "AGENT", "TASK"]
        );
        assert_eq!(
            rows[1],
            ["web", "0", "10.0.0.7:31000", "yes", "a1", "job-0.0"]
        );
        assert_eq!(
            rows[2],
            ["web", "1", "[fd00::7]:31001", "no", "a1", "job-1.0"]
        );
        assert_eq!(rows[3], ["idle", "-", "(none", "running)", "-", "-", "-"]);
        let json = serde_json::to_value(EndpointsJson::from(&web)).unwrap();
        assert_eq!(json["endpoints"][1]["address"], "[fd00::7]:31001");
        assert_eq!(json["port_name"], "http");
    }

    #[test]
    fn services_table_rows() {
        let mut host = sample_service();
        host.name = "probe".into();
        host.replicas = 0;
        host.running = 0;
        host.ready = 0;
        if let Some(t) = host.template.as_mut() {
            t.image.clear();
            t.placement = Some(pb::Placement {
                mig: "1g.10gb".into(),
                ..Default::default()
            });
        }
        let out = services_table(&[sample_service(), host], 1_700_000_065_000).render();
        let rows: Vec<Vec<&str>> = out
            .lines()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(rows[0], ["NAME", "READY", "GPUS", "IMAGE", "AGE"]);
        assert_eq!(rows[1], ["web", "1/3", "1", "nginx:1", "65s"]);
        assert_eq!(rows[2], ["probe", "0/0", "mig:1g.10gb", "-", "65s"]);
        assert_eq!(
            services_table(&[], 0).render(),
            "NAME  READY  GPUS  IMAGE  AGE\n"
        );
    }

    #[test]
    fn service_detail_has_the_template_each_replica_and_events() {
        let out = service_detail(&sample_service(), 1_700_000_065_000);
        for line in [
            "ID:       svc-1\n",
            "Tenant:   default\n",
            "Replicas: 3 asked, 1 running, 1 ready\n",
            "Checks:   none (a running replica is ready)\n",
            "Drain:    5s\n",
            "Image:    nginx:1\n",
            "Command:  nginx -g 'daemon off;'\n",
            "GPUs:     1\n",
            "Memory:   512MiB\n",
            "Created:  2023-11-14T22:13:20Z (65s ago)\n",
        ] {
            assert!(out.contains(line), "{line:?} in\n{out}");
        }
        let table = out.split("Replica jobs:\n").nth(1).expect(&out);
        let rows: Vec<Vec<&str>> = table
            .lines()
            .take(4)
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            rows[0],
            ["REPLICA", "JOB", "STATE", "READY", "AGENT", "RESTARTS", "MESSAGE"]
        );
        assert_eq!(
            rows[1],
            ["0", "job-4", "RUNNING", "yes", "agent-a", "0", "-"]
        );
        assert_eq!(
            rows[2],
            [
                "1", "job-5", "QUEUED", "-", "-", "2", "task", "job-5.0", "exited", "with", "code",
                "1"
            ]
        );
        assert_eq!(rows[3], ["2", "job-6", "-", "-", "-", "-", "-"]);
        let events = out.split("\nEvents:\n").nth(1).expect(&out);
        assert!(
            events.contains("Normal  Created  65s  3 replicas"),
            "{events}"
        );
        // Where to reach a replica: its agent and host ports.
        let mut served = sample_service();
        if let Some(j) = served.replica_jobs[0].job.as_mut() {
            j.tasks[0].ports = vec![31000];
        }
        let table = replicas_table(&served.replica_jobs).render();
        let rows: Vec<Vec<&str>> = table
            .lines()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(rows[0][4..6], ["AGENT", "PORTS"]);
        assert_eq!(
            rows[1],
            ["0", "job-4", "RUNNING", "yes", "agent-a", "31000", "0", "-"]
        );
        assert_eq!(rows[3], ["2", "job-6", "-", "-", "-", "-", "-", "-"]);
        // Running, not ready: why, in its check's words; the checks shown.
        let mut checked = sample_service();
        checked.replica_jobs[0].ready = false;
        checked.replica_jobs[0].check_failure =
            "readiness: GET /healthz (port 31000): HTTP 503".into();
        if let Some(t) = checked.template.as_mut() {
            t.options = gpuctl_core::convert::options_to_pb(gpuctl_core::types::TaskOptions {
                port: vec!["http".into()],
                readiness: Some("http:http/healthz".parse().unwrap()),
                liveness: Some("tcp:http failures=5".parse().unwrap()),
                ..Default::default()
            });
        }
        let out = service_detail(&checked, 1_700_000_065_000);
        assert!(out.contains("Ports:    1 (http)\n"), "{out}");
        assert!(
            out.contains("Checks:   readiness http:http/healthz; liveness tcp:http failures=5\n"),
            "{out}"
        );
        let row0 = out
            .lines()
            .find(|l| l.starts_with("0 "))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "));
        assert_eq!(
            row0.as_deref(),
            Some("0 job-4 RUNNING no agent-a 0 readiness: GET /healthz (port 31000): HTTP 503"),
            "{out}"
        );
        let mut none = sample_service();
        none.replica_jobs.clear();
        none.events.clear();
        let out = service_detail(&none, 1_700_000_065_000);
        assert!(out.contains("Replica jobs: none\n"), "{out}");
        assert!(out.ends_with("\nEvents: <none>\n"), "{out}");
    }

    #[test]
    fn service_json_shape_reuses_the_job_json() {
        let s = sample_service();
        let v = serde_json::to_value(ServiceJson::from(&s)).unwrap();
        assert_eq!(v["id"], "svc-1");
        assert_eq!(v["name"], "web");
        assert_eq!(
            (v["replicas"].as_u64(), v["running"].as_u64()),
            (Some(3), Some(1))
        );
        assert_eq!(v["template"]["image"], "nginx:1");
        assert_eq!(
            v["template"]["command"],
            json!(["nginx", "-g", "daemon off;"])
        );
        assert_eq!(
            v["template"]["resources"],
            json!({"cpus": 0.5, "mem_mib": 512, "gpus": 1, "ports": 1})
        );
        assert!(v["template"].get("restart_policy").is_none(), "{v}");
        assert_eq!(v["replica_jobs"][0]["index"], 0);
        assert_eq!(v["replica_jobs"][0]["job_id"], "job-4");
        let job = s.replica_jobs[0].job.as_ref().unwrap();
        assert_eq!(
            v["replica_jobs"][0]["job"],
            serde_json::to_value(JobJson::from(job)).unwrap()
        );
        assert_eq!(v["replica_jobs"][1]["job"]["retries"], 2);
        assert!(v["replica_jobs"][2]["job"].is_null());
        assert_eq!(v["events"][0]["reason"], "Created");
        assert_eq!(v["events"][0]["type"], "Normal");
        assert_eq!(v["created_at_ms"], 1_700_000_000_000u64);
        let empty = serde_json::to_value(ServiceJson::from(&pb::Service::default())).unwrap();
        assert!(empty["template"]["image"].is_null());
        assert_eq!(empty["replica_jobs"], json!([]));
    }
}
