//! End to end with the real binaries and host-process tasks (no Docker
//! needed): submit, logs, failure, bad input, agent loss, master restart.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use serde_json::Value;

use gpuctl_tests::Gpuctl;
use gpuctl_tests::{wait_for, AgentOpts, Cluster};

#[test]
fn process_jobs_run_and_state_survives_a_master_restart() {
    let mut c = Cluster::start(&[]);
    let agent = c.add_agent(AgentOpts::default());

    let ok = c.submit(&[
        "--name",
        "hello",
        "--gpus",
        "2",
        "--",
        "sh",
        "-c",
        "echo \"gpus=$NVIDIA_VISIBLE_DEVICES task=$GPUCTL_TASK_ID\"",
    ]);
    assert_eq!(c.wait_job(&ok, 30), (0, "SUCCEEDED".to_string()));
    let job = c.job(&ok);
    assert_eq!(job["name"], "hello");
    let task = &job["tasks"][0];
    assert_eq!(task["agent_id"], agent.as_str());
    assert_eq!(task["state"], "FINISHED");
    assert_eq!(task["exit_code"], 0);
    let gpus: Vec<String> = task["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g.as_str().unwrap().to_string())
        .collect();
    assert_eq!(gpus.len(), 2);
    // The task saw exactly its GPUs, and they are GPUs of its agent.
    let logs = c.ok(&["jobs", "logs", &ok]);
    assert!(logs.contains(&format!("gpus={}", gpus.join(","))), "{logs}");
    assert!(logs.contains(&format!("task={}", task["id"].as_str().unwrap())));
    let agents = c.json(&["agents", "list", "--json"]);
    let agent_gpus: Vec<&str> = agents[0]["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["uuid"].as_str().unwrap())
        .collect();
    assert_eq!(agent_gpus.len(), 4);
    assert!(gpus.iter().all(|g| agent_gpus.contains(&g.as_str())));

    // A failing job: FAILED with its exit code, and `jobs wait` exits 1.
    let bad = c.submit(&["--name", "bad", "--", "sh", "-c", "exit 3"]);
    let (code, state) = c.wait_job(&bad, 30);
    assert_eq!((code, state.as_str()), (1, "FAILED"));
    assert_eq!(c.job(&bad)["tasks"][0]["exit_code"], 3);

    // A job that cannot start waits with a reason.
    let big = c.submit(&["--name", "big", "--gpus", "8", "--", "true"]);
    let job = c.job_with_reason(&big);
    assert_eq!(job["state"], "QUEUED");
    assert!(
        job["message"]
            .as_str()
            .unwrap()
            .contains("no agent has 8 GPUs"),
        "{job}"
    );
    assert_eq!(job["reason"], job["message"]);
    // A constraint nothing satisfies is named, like squeue's reasons.
    let h100 = c.submit(&[
        "--name",
        "h100",
        "--gpus",
        "1",
        "--gpu-model",
        "H100*",
        "--",
        "true",
    ]);
    let job = c.job_with_reason(&h100);
    assert_eq!(job["state"], "QUEUED");
    assert_eq!(job["reason"], "no agent has GPU model H100*", "{job}");
    assert_eq!(job["placement"]["gpu_model"], "H100*");
    c.ok(&["jobs", "cancel", &h100]);

    // The master reports itself as the Raft group's leader.
    let masters = c.json(&["masters", "--json"]);
    assert_eq!(masters.as_array().unwrap().len(), 1);
    assert_eq!(masters[0]["role"], "leader");
    assert_eq!(masters[0]["address"], c.master_addr.as_str());
    assert!(masters[0]["term"].as_u64().unwrap() >= 1);
    assert!(masters[0]["commit_index"].as_u64().unwrap() > 0);

    // Restart the master: every job and the agent are still known.
    let before = c.json(&["jobs", "list", "--json"]);
    c.restart_master();
    let after = c.json(&["jobs", "list", "--json"]);
    assert_eq!(before, after);
    let agents = c.json(&["agents", "list", "--json"]);
    assert_eq!(agents[0]["id"], agent.as_str());
    // The agent reconnects on its own and new work runs; ids keep counting.
    wait_for(Duration::from_secs(20), "agent back ACTIVE", || {
        c.json(&["agents", "list", "--json"])[0]["state"] == "ACTIVE"
    });
    let next = c.submit(&["--name", "after-restart", "--gpus", "1", "--", "true"]);
    assert_eq!(next, "job-5", "after job-1..job-4");
    let (code, _) = c.wait_job(&next, 30);
    assert_eq!(
        code,
        0,
        "{}\n--- master ---\n{}\n--- agent ---\n{}",
        c.job(&next),
        gpuctl_tests::tail(&c.master.log_text(), 30),
        gpuctl_tests::tail(&c.agents[0].log_text(), 30)
    );
    // The queued job is still queued (and can be cancelled).
    assert_eq!(c.ok(&["jobs", "cancel", &big]).trim(), "CANCELLED");
}

#[test]
fn follow_streams_output_and_cancel_kills_a_running_process() {
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts::default());
    let j = c.submit(&[
        "--name",
        "ticker",
        "--",
        "sh",
        "-c",
        "for i in 1 2 3; do echo tick $i; sleep 0.3; done",
    ]);
    // --follow returns once the task has ended, with all of its output.
    let logs = c.ok(&["jobs", "logs", &j, "--follow"]);
    assert_eq!(logs, "tick 1\ntick 2\ntick 3\n");
    assert_eq!(c.job(&j)["state"], "SUCCEEDED");

    let long = c.submit(&[
        "--name",
        "long",
        "--gpus",
        "1",
        "--",
        "sh",
        "-c",
        "readlink /proc/self/ns/pid > ns; exec sleep 300",
    ]);
    let running = c.wait_state(&long, "RUNNING", Duration::from_secs(30));
    // Found from outside by its PID namespace (inside it, it is pid 2).
    let ns = task_pid_ns(&c, &running);
    assert!(!gpuctl_tests::pid_ns_members(&ns).is_empty());
    // The cancel decides the end: CANCELLED, while its task is stopped.
    assert_eq!(c.ok(&["jobs", "cancel", &long]).trim(), "CANCELLED");
    let (code, state) = c.wait_job(&long, 30);
    assert_eq!((code, state.as_str()), (1, "CANCELLED"));
    let job = c.job(&long);
    assert_eq!(job["tasks"][0]["state"], "KILLED");
    // Its GPU is free again.
    let gpus = c.json(&["gpus", "--json"]);
    assert!(gpus
        .as_array()
        .unwrap()
        .iter()
        .all(|g| g["task_id"].is_null()));
    // And the process is gone.
    let left = gpuctl_tests::pid_ns_members(&ns);
    assert!(left.is_empty(), "{left:?}");
}

/// The PID namespace a running task of agent 0 wrote to `ns` in its
/// sandbox.
fn task_pid_ns(c: &Cluster, job: &Value) -> String {
    let sandbox = c
        .dir
        .path()
        .join("agent0/tasks")
        .join(job["tasks"][0]["id"].as_str().unwrap());
    let mut ns = String::new();
    wait_for(Duration::from_secs(10), "the task's ns file", || {
        ns = std::fs::read_to_string(sandbox.join("ns")).unwrap_or_default();
        ns.ends_with('\n')
    });
    ns.trim().to_string()
}

#[test]
fn a_lost_agent_loses_its_tasks_but_its_gpus_wait_for_its_word() {
    // Unreachable after 1.5 s, lost after 18 s: the fence (2 s) plus the
    // kill grace the master assumes for an agent that sends none (10 s)
    // plus the 5 s margin must stay below the lost timeout.
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
    c.add_agent(AgentOpts::default());
    let j = c.submit(&[
        "--name",
        "long",
        "--gpus",
        "1",
        "--",
        "sh",
        "-c",
        "readlink /proc/self/ns/pid > ns; exec sleep 300",
    ]);
    let job = c.wait_state(&j, "RUNNING", Duration::from_secs(30));
    let task_id = job["tasks"][0]["id"].as_str().unwrap().to_string();
    let ns = task_pid_ns(&c, &job);
    let live = || gpuctl_tests::pid_ns_members(&ns);
    assert!(!live().is_empty());
    c.agents[0].kill();
    // First UNREACHABLE: the job stays RUNNING, the GPU stays held.
    wait_for(Duration::from_secs(10), "agent UNREACHABLE", || {
        c.json(&["agents", "list", "--json"])[0]["state"] == "UNREACHABLE"
    });
    let job_mid = c.job(&j);
    assert_eq!(job_mid["state"], "RUNNING");
    assert_eq!(job_mid["tasks"][0]["state"], "UNREACHABLE");
    // The tasks holding the agent's GPUs.
    let held_by = |c: &Cluster| -> Vec<Value> {
        c.json(&["gpus", "--json"])
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["task_id"].clone())
            .filter(|t| !t.is_null())
            .collect()
    };
    assert_eq!(held_by(&c), vec![Value::from(task_id.clone())]);
    // The crashed agent cannot stop its task, but the task's supervisor
    // can: its fence (2 s after the agent's last contact) stops it, long
    // before the master declares it lost.
    wait_for(Duration::from_secs(10), "the fence stops the task", || {
        live().is_empty()
    });
    // Then LOST: the job fails (no retries), but the crashed agent has not
    // said the task is gone, so its GPU stays held.
    let job_after = c.wait_state(&j, "FAILED", Duration::from_secs(40));
    assert_eq!(job_after["tasks"][0]["state"], "LOST");
    let agents = c.json(&["agents", "list", "--json"]);
    assert_eq!(agents[0]["state"], "LOST");
    assert_eq!(held_by(&c), vec![Value::from(task_id.clone())]);

    // The agent comes back, finds the task ended (fenced) and reports it:
    // its word that the task is gone, and the GPU is free again.
    c.restart_agent(0);
    wait_for(Duration::from_secs(20), "agent ACTIVE again", || {
        c.json(&["agents", "list", "--json"])[0]["state"] == "ACTIVE"
    });
    wait_for(Duration::from_secs(10), "GPU released", || {
        held_by(&c).is_empty()
    });
    // The LOST task keeps the master's verdict.
    assert_eq!(c.job(&j)["tasks"][0]["state"], "LOST");
}

#[test]
fn bad_input_is_refused_with_the_field_named() {
    let c = Cluster::start(&[]);
    let cases: &[(&[&str], &str)] = &[
        (
            &["jobs", "submit", "--name", "bad name", "--", "true"],
            "spec.name",
        ),
        (
            &[
                "jobs", "submit", "--name", "x", "--gpus", "1000", "--", "true",
            ],
            "spec.resources.gpus",
        ),
        (
            &[
                "jobs", "submit", "--name", "x", "--cpus", "-1", "--", "true",
            ],
            "cpus",
        ),
        (&["jobs", "get", "job-404"], "not found"),
        (&["jobs", "get", "../etc"], "job_id"),
    ];
    for (args, needle) in cases {
        let out = c.gpuctl(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "one-line error: {err}");
    }
    // Nothing was created by the refused submits.
    assert_eq!(c.json(&["jobs", "list", "--json"]), serde_json::json!([]));
    // An unreachable master is a clear error too.
    let out = std::process::Command::new(gpuctl_tests::bin("gpuctl"))
        .args(["--master", "127.0.0.1:1", "jobs", "list"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("127.0.0.1:1"));
}

#[test]
fn image_jobs_wait_for_an_agent_with_docker() {
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts::default()); // process runtime only
    let j = c.submit(&["--name", "img", "--image", "busybox", "--", "true"]);
    let job = c.job_with_reason(&j);
    assert_eq!(job["state"], "QUEUED");
    assert_eq!(job["reason"], "no agent runs docker", "{job}");
    // Host-process jobs still run beside it.
    let p = c.submit(&["--name", "p", "--", "true"]);
    assert_eq!(c.wait_job(&p, 30).0, 0);
}

#[test]
fn finished_jobs_and_their_sandboxes_are_forgotten_after_the_retention() {
    let mut c = Cluster::start(&["--job-retention", "3s"]);
    c.add_agent(AgentOpts {
        extra: vec!["--task-retention".into(), "3s".into()],
        ..AgentOpts::default()
    });
    let j = c.submit(&["--name", "brief", "--", "sh", "-c", "echo kept-for-now"]);
    assert_eq!(c.wait_job(&j, 30), (0, "SUCCEEDED".to_string()));
    let task = format!("{j}.0");
    // Recent: listed, with its log.
    let listed = |c: &Cluster| {
        c.json(&["jobs", "list", "--json"])
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["id"] == j.as_str())
    };
    assert!(listed(&c));
    assert!(c.ok(&["jobs", "logs", &j]).contains("kept-for-now"));
    let sandbox = c.dir.path().join("agent0/tasks").join(&task);
    assert!(sandbox.join("output.log").exists());
    // Then the master forgets the job and the agent removes its sandbox.
    wait_for(Duration::from_secs(30), "the job leaves the list", || {
        !listed(&c)
    });
    let out = c.gpuctl(&["jobs", "get", &j]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains(&format!("job {j} not found")) && err.contains("--job-retention"),
        "{err}"
    );
    wait_for(Duration::from_secs(30), "the sandbox is removed", || {
        !sandbox.exists()
    });
    assert!(!c.dir.path().join("agent0/retired").join(&task).exists());
    // The cluster goes on: a new job gets the next id.
    let next = c.submit(&["--name", "next", "--", "true"]);
    assert_eq!(c.wait_job(&next, 30).0, 0);
    assert_ne!(next, j);
}
