//! Services end to end (issue 57), with the real binaries and host-process
//! replicas: a replica that exits is started again, one whose agent is
//! SIGKILLed is placed on another agent once the first is lost, a replica
//! cannot be cancelled, scale and delete stop the right replicas, and the
//! GPU invariant holds throughout, checked from outside the master (live
//! processes, their cgroups and GPUs). Needs root (cgroups).
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use gpuctl_tests::{
    invariant_violations, live_tasks, root_or_skip, test_marker, wait_for, AgentOpts, Cluster,
    Gpuctl,
};
use serde_json::Value;

fn service(c: &Cluster, name: &str) -> Value {
    c.json(&["services", "get", name, "--json"])
}

/// Replica `i`'s job as `services get --json` shows it.
fn replica(c: &Cluster, name: &str, i: usize) -> Value {
    service(c, name)["replica_jobs"][i]["job"].clone()
}

fn running_on(job: &Value) -> Option<String> {
    (job["state"] == "RUNNING")
        .then(|| {
            job["tasks"].as_array()?.last()?["agent_id"]
                .as_str()
                .map(String::from)
        })
        .flatten()
}

/// The violations of the GPU invariant among the test's live tasks but
/// "job runs twice": a replica on a SIGKILLed agent lives on, unreachable,
/// while its successor runs elsewhere, until that agent is back and stops
/// it (as a job's task does; see docs/services.md).
fn gpu_violations(marker: &str, value: &str) -> Vec<String> {
    invariant_violations(&live_tasks(marker, value))
        .into_iter()
        .filter(|v| !v.contains("runs twice"))
        .collect()
}

#[test]
fn replicas_outlive_exits_and_a_lost_agent_and_only_their_service_stops_them() {
    if !root_or_skip("replicas_outlive_exits_and_a_lost_agent") {
        return;
    }
    // Unreachable after 1.5 s, lost after 18 s (as e2e_process's lost
    // agent: fence 2 s, the assumed kill grace 10 s and the margin).
    let mut c = Cluster::start(&[
        "--heartbeat-interval-secs",
        "0.2",
        "--agent-timeout-secs",
        "1.5",
        "--agent-fence-timeout-secs",
        "2",
        "--agent-lost-timeout-secs",
        "18",
    ]);
    // Their ids in the order of `c.agents`.
    let agents: Vec<String> = (0..3)
        .map(|_| {
            c.add_agent(AgentOpts {
                simulate_gpus: Some("1xA100-SXM4-40GB"),
                stop_tasks_on_shutdown: false,
                ..Default::default()
            })
        })
        .collect();
    let marker = test_marker("services");
    let env = format!("SVC_MARKER={marker}");

    // Replica 0 exits 0 after a second, replica 1 runs on: both serve
    // until their service says otherwise.
    let created = c.ok(&[
        "services",
        "create",
        "web",
        "--replicas",
        "2",
        "--gpus",
        "1",
        "--restart-backoff",
        "200ms",
        "--port",
        "http",
        "--env",
        &env,
        "--",
        "sh",
        "-c",
        "echo \"replica $GPUCTL_REPLICA of $GPUCTL_SERVICE on port $GPUCTL_PORT_HTTP\"; \
         if [ \"$GPUCTL_REPLICA\" = 0 ]; then sleep 1; exit 0; fi; exec sleep 600",
    ]);
    assert!(created.contains("web"), "{created}");
    wait_for(Duration::from_secs(60), "replica 0 restarted twice", || {
        let j = replica(&c, "web", 0);
        j["retries"].as_u64().unwrap_or(0) >= 2 && j["state"] != "SUCCEEDED"
    });
    let r0 = replica(&c, "web", 0);
    let r0_id = r0["id"].as_str().unwrap().to_string();
    assert_eq!(r0["restart_policy"], "always", "{r0}");
    assert!(
        r0["events"].as_array().unwrap().iter().any(|e| e["message"]
            .as_str()
            .unwrap_or("")
            .contains("exited with code 0; restart")),
        "{r0}"
    );
    let logs = c.ok(&["jobs", "logs", &r0_id]);
    assert!(logs.contains("replica 0 of web on port 3"), "{logs}");
    assert!(gpu_violations("SVC_MARKER", &marker).is_empty());

    // A replica is the service's to stop: a cancel is refused, nothing
    // changes.
    let out = c.gpuctl(&["jobs", "cancel", &r0_id]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("replica of service \"web\""), "{err}");
    assert_ne!(c.job(&r0_id)["state"], "CANCELLED");

    // SIGKILL the agent under replica 1: once it is lost, the replica runs
    // on the third agent (the lost one's GPU stays held).
    let r1 = c.wait_state(
        service(&c, "web")["replica_jobs"][1]["job_id"]
            .as_str()
            .unwrap(),
        "RUNNING",
        Duration::from_secs(30),
    );
    let r1_id = r1["id"].as_str().unwrap().to_string();
    let first = running_on(&r1).unwrap();
    let n = agents.iter().position(|a| *a == first).unwrap();
    c.agents[n].kill();
    wait_for(Duration::from_secs(60), "replica 1 runs elsewhere", || {
        running_on(&c.job(&r1_id)).is_some_and(|a| a != first)
    });
    assert!(gpu_violations("SVC_MARKER", &marker).is_empty());
    // Back, the agent stops the lost replica's old task.
    c.restart_agent(n);
    wait_for(Duration::from_secs(60), "one live task per replica", || {
        let live = live_tasks("SVC_MARKER", &marker);
        live.iter().filter(|t| t.job_id == r1_id).count() == 1
    });

    // Scale to 1: the newest replica leaves the endpoints at once, drains
    // (5 s: the service names a port) still running, then is stopped;
    // delete: the rest, and the name is free for another service.
    c.ok(&["services", "scale", "web", "--replicas", "1"]);
    let svc = service(&c, "web");
    assert_eq!(svc["draining_jobs"], serde_json::json!([r1_id]), "{svc}");
    let eps = c.ok(&["services", "endpoints", "web", "--json"]);
    assert!(!eps.contains(&r1_id), "{eps}");
    assert!(
        live_tasks("SVC_MARKER", &marker)
            .iter()
            .any(|t| t.job_id == r1_id),
        "a draining replica runs on"
    );
    assert!(c
        .ok(&["jobs", "get", &r1_id])
        .contains("left its service: out of its endpoints, stopped in 5s"));
    assert_eq!(c.wait_job(&r1_id, 60).1, "CANCELLED");
    assert_eq!(service(&c, "web")["replicas"], 1);
    let deleted = c.ok(&["services", "delete", "web"]);
    assert!(deleted.contains(&r0_id), "{deleted}");
    assert_eq!(c.wait_job(&r0_id, 60).1, "CANCELLED");
    wait_for(Duration::from_secs(30), "no replica left", || {
        live_tasks("SVC_MARKER", &marker).is_empty()
    });
    let out = c.gpuctl(&["services", "get", "web"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));

    // Bad input names its field, and nothing is made.
    for (args, field) in [
        (vec!["services", "create", "Web_1", "--", "true"], "name"),
        (
            vec![
                "services",
                "create",
                "web",
                "--max-retries",
                "3",
                "--",
                "true",
            ],
            "--max-retries",
        ),
        (
            vec![
                "jobs",
                "submit",
                "--name",
                "x",
                "--restart-policy",
                "always",
                "--",
                "true",
            ],
            "restart_policy",
        ),
        // A check of a port the replica does not name.
        (
            vec![
                "services",
                "create",
                "web",
                "--port",
                "http",
                "--readiness",
                "http:grpc/ready",
                "--",
                "true",
            ],
            "template.options.readiness.port: \"grpc\" is not one of the task's port names (http",
        ),
        (
            vec![
                "services",
                "create",
                "web",
                "--liveness",
                "tcp:http every=1s",
                "--",
                "true",
            ],
            "unknown option",
        ),
    ] {
        let out = c.gpuctl(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(err.contains(field), "{args:?}: {err}");
    }
    assert_eq!(
        c.json(&["services", "list", "--json"]),
        serde_json::json!([])
    );
}

/// A replica serves only once its readiness check passes (an HTTP GET of
/// its named port), and one whose liveness check fails is stopped
/// (LIVENESS_FAILED) and restarted. The liveness check reads a file in the
/// task's private /tmp: run on the host, outside the task's namespaces,
/// it would never fail.
#[test]
fn a_replica_serves_once_ready_and_a_failed_liveness_check_restarts_it() {
    if !root_or_skip("a_replica_serves_once_ready") {
        return;
    }
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts {
        simulate_gpus: Some("1xA100-SXM4-40GB"),
        ..Default::default()
    });
    let marker = test_marker("svc-checks");
    let env = format!("SVC_CHECKS={marker}");
    // /ready is there 3 s in; 4 s later the task marks itself dead.
    c.ok(&[
        "services",
        "create",
        "model",
        "--gpus",
        "1",
        "--port",
        "http",
        "--restart-backoff",
        "200ms",
        "--readiness",
        "http:http/ready interval=200ms failures=1",
        "--liveness",
        "interval=200ms failures=2 exec:test ! -f /tmp/dead",
        "--env",
        &env,
        "--",
        "sh",
        "-c",
        "mkdir -p www; cd www; (sleep 3; touch ready; sleep 4; touch /tmp/dead) & \
         exec python3 -m http.server \"$GPUCTL_PORT_HTTP\" --bind 127.0.0.1",
    ]);
    // What a proxy follows: the endpoints, each time they change.
    let watcher = EndpointsWatch::start(&c.master_addr, "model");
    let get = || service(&c, "model");
    wait_for(Duration::from_secs(60), "the replica ready", || {
        get()["replica_jobs"][0]["ready"] == true
    });
    let svc = get();
    assert_eq!(svc["ready"], 1, "{svc}");
    let list = c.ok(&["services", "list"]);
    assert!(list.lines().nth(1).unwrap().contains("1/1"), "{list}");
    let job = &svc["replica_jobs"][0]["job"];
    assert_eq!(job["tasks"][0]["ready"], true, "{job}");
    let port = job["tasks"][0]["ports"][0].as_u64().unwrap();
    let events = |job: &Value| -> Vec<String> {
        job["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                format!(
                    "{} {}",
                    e["reason"].as_str().unwrap_or(""),
                    e["message"].as_str().unwrap_or("")
                )
            })
            .collect()
    };
    // Not ready before /ready was there, in its check's words (the
    // server not yet listening, or its 404).
    let said = events(job);
    let not_ready = format!("Unhealthy not ready: readiness: GET /ready (port {port}): ");
    assert!(said.iter().any(|e| e.starts_with(&not_ready)), "{said:?}");
    assert!(said.contains(&"Ready ready".to_string()), "{said:?}");
    assert!(gpu_violations("SVC_CHECKS", &marker).is_empty());

    // Dead in its own /tmp: stopped for it, and started again.
    let job_id = svc["replica_jobs"][0]["job_id"]
        .as_str()
        .unwrap()
        .to_string();
    wait_for(Duration::from_secs(60), "the replica restarted", || {
        replica(&c, "model", 0)["retries"].as_u64().unwrap_or(0) >= 1
    });
    let j = c.json(&["jobs", "get", &job_id, "--json"]);
    let first = &j["tasks"][0];
    assert_eq!(first["state"], "FAILED", "{j}");
    assert_eq!(first["reason"], "LIVENESS_FAILED", "{j}");
    assert_eq!(
        first["message"], "liveness: \"test ! -f /tmp/dead\" exited with code 1 (2 in a row)",
        "{j}"
    );
    assert!(
        events(&j)
            .iter()
            .any(|e| e.starts_with("Unhealthy task ") && e.contains(" liveness: ")),
        "{:?}",
        events(&j)
    );
    // Its successor has a /tmp of its own: ready again.
    wait_for(
        Duration::from_secs(60),
        "the restarted replica ready",
        || {
            let s = get();
            s["replica_jobs"][0]["ready"] == true
                && s["replica_jobs"][0]["job"]["tasks"]
                    .as_array()
                    .map_or(0, Vec::len)
                    >= 2
        },
    );
    let shown = c.ok(&["services", "get", "model"]);
    assert!(
        shown.contains("readiness http:http/ready interval=200ms failures=1; liveness interval=200ms failures=2 exec:test ! -f /tmp/dead"),
        "{shown}"
    );
    let table = c.ok(&["services", "endpoints", "model"]);
    let row: Vec<&str> = table
        .lines()
        .nth(1)
        .unwrap_or("")
        .split_whitespace()
        .collect();
    assert_eq!(row[..2], ["model", "0"], "{table}");
    assert!(row[2].starts_with("127.0.0.1:"), "{table}");
    assert_eq!(row[3], "yes", "{table}");

    // The watch saw it: not ready, ready at its port, gone, its successor
    // not ready and then ready, in that order.
    let first_task = format!("{job_id}.0");
    let successor_ready = |seen: &[Value]| {
        seen.iter().any(|l| {
            l["endpoints"].as_array().is_some_and(|e| {
                e.iter()
                    .any(|e| e["task_id"] != first_task.as_str() && e["ready"] == true)
            })
        })
    };
    let seen = watcher.stop("the successor ready", successor_ready);
    let states: Vec<(String, bool)> = seen
        .iter()
        .filter_map(|l| {
            let e = l["endpoints"].as_array()?.first()?;
            Some((e["task_id"].as_str()?.to_string(), e["ready"].as_bool()?))
        })
        .collect();
    let pos = |ready: bool| {
        states
            .iter()
            .position(|(t, r)| *t == first_task && *r == ready)
            .unwrap_or_else(|| panic!("no {first_task} ready={ready} in {seen:#?}"))
    };
    let (down, up) = (pos(false), pos(true));
    assert!(down < up, "{seen:#?}");
    let address = seen
        .iter()
        .flat_map(|l| l["endpoints"].as_array().cloned().unwrap_or_default())
        .find(|e| e["task_id"] == first_task.as_str())
        .map(|e| e["address"].as_str().unwrap_or("").to_string())
        .unwrap();
    assert_eq!(address, format!("127.0.0.1:{port}"), "{seen:#?}");
    assert!(
        states.iter().skip(up).any(|(t, r)| *t != first_task && *r),
        "its successor ready: {seen:#?}"
    );
    c.ok(&["services", "delete", "model"]);
    wait_for(Duration::from_secs(30), "no replica left", || {
        live_tasks("SVC_CHECKS", &marker).is_empty()
    });
}

/// `gpuctl services endpoints NAME --watch --json` run beside a test: its
/// lines as they come.
struct EndpointsWatch {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<Value>,
    seen: Vec<Value>,
}

impl EndpointsWatch {
    fn start(masters: &str, name: &str) -> EndpointsWatch {
        use std::io::BufRead;
        let mut child = std::process::Command::new(gpuctl_tests::bin("gpuctl"))
            .args(["--master", masters, "services", "endpoints", name])
            .args(["--watch", "--json"])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    let _ = tx.send(v);
                }
            }
        });
        EndpointsWatch {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits up to 60 s until what it said so far satisfies `done`.
    fn wait(&mut self, what: &str, done: impl Fn(&[Value]) -> bool) {
        let until = std::time::Instant::now() + Duration::from_secs(60);
        while !done(&self.seen) {
            let left = until.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(v) => self.seen.push(v),
                Err(_) => {
                    use std::io::Read;
                    let _ = self.child.kill();
                    let mut err = String::new();
                    if let Some(mut e) = self.child.stderr.take() {
                        let _ = e.read_to_string(&mut err);
                    }
                    panic!(
                        "the endpoints watch never said {what}: {:#?}\n{err}",
                        self.seen
                    );
                }
            }
        }
    }

    /// Everything it said (waiting up to 60 s for `done`); it is stopped.
    fn stop(mut self, what: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        self.wait(what, done);
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::mem::take(&mut self.seen)
    }
}

/// A tenant can neither see nor touch another's service, nor make a job
/// that restarts for ever outside a service.
#[test]
fn another_tenant_can_neither_see_nor_touch_a_service() {
    if !root_or_skip("another_tenant_can_neither_see_nor_touch_a_service") {
        return;
    }
    let c = gpuctl_tests::SecureSingle::start(&[], "2xA100-SXM4-40GB");
    let token = |tenant: &str| c.ok(&["tokens", "create", "--role", "user", "--tenant", tenant]);
    let (alpha, beta) = (token("alpha"), token("beta"));
    let as_ = |token: &str, args: &[&str]| {
        std::process::Command::new(gpuctl_tests::bin("gpuctl"))
            .arg("--config")
            .arg(c.pki.join("gpuctl.toml"))
            .args(args)
            .env("GPUCTL_TOKEN", token)
            .env_remove("GPUCTL_MASTER")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    let ok = |token: &str, args: &[&str]| {
        let out = as_(token, args);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{args:?}: {err}");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let refused = |token: &str, args: &[&str], words: &str| {
        let out = as_(token, args);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{args:?} was let through");
        assert!(err.contains(words), "{args:?}: {err}");
    };
    ok(
        &alpha,
        &[
            "services",
            "create",
            "api",
            "--replicas",
            "1",
            "--gpus",
            "1",
            "--",
            "sleep",
            "300",
        ],
    );
    let svc: Value =
        serde_json::from_str(&ok(&alpha, &["services", "get", "api", "--json"])).unwrap();
    assert_eq!(svc["tenant"], "alpha");
    let job = svc["replica_jobs"][0]["job_id"]
        .as_str()
        .unwrap()
        .to_string();

    // To beta the service is not there; alpha's replica is not beta's.
    let list: Value = serde_json::from_str(&ok(&beta, &["services", "list", "--json"])).unwrap();
    assert_eq!(list, serde_json::json!([]));
    refused(&beta, &["services", "get", "api"], "not found");
    refused(
        &beta,
        &["services", "scale", "api", "--replicas", "0"],
        "not found",
    );
    refused(&beta, &["services", "delete", "api"], "not found");
    refused(&beta, &["services", "endpoints", "api"], "not found");
    // Nor in the watch of every service beta may see (a gateway's).
    assert_eq!(ok(&beta, &["services", "endpoints", "--json"]), "");
    let alphas = ok(&alpha, &["services", "endpoints", "--json"]);
    assert!(alphas.contains("\"service\":\"api\""), "{alphas}");
    refused(&beta, &["jobs", "cancel", &job], "another tenant");
    // Names are the cluster's: beta's create of the name is refused, and
    // changes nothing of alpha's.
    refused(
        &beta,
        &[
            "services", "create", "api", "--gpus", "1", "--", "sleep", "1",
        ],
        "exists",
    );
    // Nor may anyone cancel a replica, or submit a job that restarts for
    // ever outside a service.
    refused(&alpha, &["jobs", "cancel", &job], "replica of service");
    refused(
        &beta,
        &[
            "jobs",
            "submit",
            "--name",
            "forever",
            "--restart-policy",
            "always",
            "--",
            "true",
        ],
        "restart_policy",
    );
    let svc: Value =
        serde_json::from_str(&ok(&alpha, &["services", "get", "api", "--json"])).unwrap();
    assert_eq!(svc["replicas"], 1);
    assert_eq!(
        svc["template"]["command"],
        serde_json::json!(["sleep", "300"])
    );
    assert_ne!(svc["replica_jobs"][0]["job"]["state"], "CANCELLED");
    ok(&alpha, &["services", "delete", "api"]);
}

/// The leader SIGKILLed under a running service: its replicas run on,
/// untouched, and the new leader scales and deletes it.
#[test]
fn a_service_goes_on_across_a_leader_sigkill() {
    let mut c = gpuctl_tests::HaCluster::start(3, &[]);
    c.add_agent(AgentOpts {
        stop_tasks_on_shutdown: false,
        ..Default::default()
    });
    let m = test_marker("svc-ha");
    let env = format!("SVC_HA={m}");
    let watch = gpuctl_tests::InvariantWatch::start("SVC_HA", &m);
    // Replicas are ready while this directory has no `down`: a flag the
    // test sets after the leader is gone (in /run, which a task sees).
    let flags = std::path::PathBuf::from(format!("/run/{m}"));
    std::fs::create_dir_all(&flags).unwrap();
    let down = flags.join("down");
    let readiness = format!(
        "interval=200ms failures=1 exec:test ! -e {}",
        down.display()
    );
    c.ok(&[
        "services",
        "create",
        "api",
        "--replicas",
        "2",
        "--gpus",
        "1",
        // The test agent has this machine's 2 CPUs: room for 3 replicas.
        "--cpus",
        "0.25",
        "--readiness",
        &readiness,
        "--env",
        &env,
        "--",
        "sleep",
        "300",
    ]);
    let live = |c: &gpuctl_tests::HaCluster, n: usize| {
        let ok = gpuctl_tests::try_wait_for(Duration::from_secs(60), || {
            live_tasks("SVC_HA", &m).len() == n
        });
        assert!(
            ok,
            "{n} replicas never live: {:?}\n{}",
            live_tasks("SVC_HA", &m),
            c.ok(&["services", "get", "api"])
        );
        live_tasks("SVC_HA", &m)
            .into_iter()
            .map(|t| t.task_id)
            .collect::<std::collections::BTreeSet<_>>()
    };
    let before = live(&c, 2);
    let ready = |c: &gpuctl_tests::HaCluster, n: u64| {
        let ok = gpuctl_tests::try_wait_for(Duration::from_secs(30), || {
            c.json(&["services", "get", "api", "--json"])["ready"] == n
        });
        assert!(
            ok,
            "never {n} ready:\n{}",
            c.ok(&["services", "get", "api"])
        );
    };
    ready(&c, 2);
    let mut watcher = EndpointsWatch::start(&c.addrs(), "api");
    let ready_count = |l: &Value| {
        l["endpoints"]
            .as_array()
            .map_or(0, |e| e.iter().filter(|e| e["ready"] == true).count())
    };
    watcher.wait("both ready", |seen| {
        seen.iter().any(|l| ready_count(l) == 2)
    });
    let old = c.leader_id();
    c.kill_master(old);
    // The checks run on the agent: the new leader hears them change.
    std::fs::write(&down, b"").unwrap();
    ready(&c, 0);
    let svc = c.json(&["services", "get", "api", "--json"]);
    let failure = svc["replica_jobs"][0]["check_failure"]
        .as_str()
        .unwrap_or("");
    assert!(failure.contains("exited with code 1"), "{svc}");
    std::fs::remove_file(&down).unwrap();
    ready(&c, 2);
    // The watch went on across the leader change: it saw both replicas
    // leave readiness and come back, from the new leader.
    let none_then_both = |seen: &[Value]| {
        seen.iter()
            .position(|l| ready_count(l) == 0)
            .is_some_and(|i| seen[i..].iter().any(|l| ready_count(l) == 2))
    };
    let seen = watcher.stop("none ready, then both", none_then_both);
    let none = seen.iter().position(|l| {
        l["endpoints"].as_array().is_some_and(|e| e.len() == 2) && ready_count(l) == 0
    });
    let none = none.unwrap_or_else(|| panic!("never 0 ready: {seen:#?}"));
    assert!(
        seen.iter().skip(none).any(|l| ready_count(l) == 2),
        "{seen:#?}"
    );
    // gpuctl finds the new leader itself.
    c.ok(&["services", "scale", "api", "--replicas", "3"]);
    let after = live(&c, 3);
    assert!(before.is_subset(&after), "{before:?} -> {after:?}");
    let svc = c.json(&["services", "get", "api", "--json"]);
    assert_eq!(svc["replicas"], 3);
    c.ok(&["services", "delete", "api"]);
    wait_for(Duration::from_secs(30), "no replica left", || {
        live_tasks("SVC_HA", &m).is_empty()
    });
    let _ = std::fs::remove_dir_all(&flags);
    watch.assert_held();
}
