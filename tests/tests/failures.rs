//! Failures that explain themselves (issue 38, item 5), end to end with the
//! real binaries and host-process tasks: a SIGKILLed task is named as
//! killed by the signal, an OOM kill as one (from the task's memory
//! cgroup), `jobs wait` on a failed gang names the rank that failed first,
//! `jobs cancel` answers CANCELLED and the job ends so even if its task
//! exits 0 on the SIGTERM, a launch the task's user cannot reach names the
//! user and the path, and host tasks get a plain PATH and OMP_NUM_THREADS
//! from `--cpus`. Needs root (cgroups, task users).
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use gpuctl_tests::Gpuctl;
use gpuctl_tests::{root_or_skip, AgentOpts, Cluster};

fn message(c: &Cluster, job: &str) -> String {
    c.job(job)["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn failures_say_what_happened() {
    if !root_or_skip("failures_say_what_happened") {
        return;
    }
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts::default());

    // A task killed by SIGKILL: named as such, not "exited with code 137";
    // its environment has the plain PATH and OMP_NUM_THREADS from --cpus.
    let killed = c.submit(&[
        "--name",
        "killed",
        "--cpus",
        "2",
        "--",
        "sh",
        "-c",
        "echo \"omp=$OMP_NUM_THREADS path=$PATH\"; kill -9 $$",
    ]);
    assert_eq!(c.wait_job(&killed, 30), (1, "FAILED".to_string()));
    let job = c.job(&killed);
    assert_eq!(job["tasks"][0]["exit_code"], 137, "{job}");
    assert_eq!(
        job["tasks"][0]["message"], "killed by signal 9 (SIGKILL)",
        "{job}"
    );
    assert!(
        message(&c, &killed).contains("killed by signal 9 (SIGKILL)"),
        "{job}"
    );
    let logs = c.ok(&["jobs", "logs", &killed]);
    assert!(
        logs.contains("omp=2 path=/usr/local/bin:/usr/bin:/bin\n"),
        "{logs}"
    );
    // A job's own OMP_NUM_THREADS is kept.
    let own = c.submit(&[
        "--name",
        "own-omp",
        "--cpus",
        "2",
        "--env",
        "OMP_NUM_THREADS=7",
        "--",
        "sh",
        "-c",
        "echo omp=$OMP_NUM_THREADS",
    ]);
    assert_eq!(c.wait_job(&own, 30), (0, "SUCCEEDED".to_string()));
    assert!(c.ok(&["jobs", "logs", &own]).contains("omp=7\n"));

    // Past its memory limit: OOM-killed, from the task's memory cgroup.
    // `tail` of /dev/zero keeps one endless line in memory.
    let oom = c.submit(&["--name", "oom", "--mem", "64", "--", "tail", "/dev/zero"]);
    assert_eq!(c.wait_job(&oom, 60), (1, "FAILED".to_string()));
    let job = c.job(&oom);
    let words = job["tasks"][0]["message"].as_str().unwrap();
    assert!(
        words.starts_with("OOM-killed (exit code 137)") && words.ends_with("of 64 MiB (--mem)"),
        "{job}"
    );

    // A gang whose rank 1 fails: `jobs wait` names rank 1 and why, not
    // rank 0, which was stopped because of it.
    let gang = c.submit(&[
        "--name",
        "gang",
        "--replicas",
        "2",
        "--",
        "sh",
        "-c",
        "if [ \"$GPUCTL_RANK\" = 1 ]; then sleep 1; exit 3; fi; sleep 60",
    ]);
    let out = c.gpuctl(&["jobs", "wait", &gang, "--timeout", "60"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("job {gang} FAILED: rank 1 of 2: task "))
            && err.contains("exited with code 3"),
        "{err}"
    );

    // Cancel answers CANCELLED at once (the cancel decides the end), and
    // the job ends so, its task stopped, although it exits 0 on the SIGTERM.
    let polite = c.submit(&[
        "--name",
        "polite",
        "--",
        "sh",
        "-c",
        "trap 'exit 0' TERM; echo up; while :; do sleep 0.1; done",
    ]);
    c.wait_state(&polite, "RUNNING", Duration::from_secs(30));
    assert_eq!(c.ok(&["jobs", "cancel", &polite]).trim(), "CANCELLED");
    assert_eq!(c.wait_job(&polite, 30), (1, "CANCELLED".to_string()));
    assert_eq!(c.job(&polite)["tasks"][0]["state"], "KILLED");
    // --wait: the final state, once the task has stopped.
    let long = c.submit(&["--name", "long", "--", "sleep", "300"]);
    c.wait_state(&long, "RUNNING", Duration::from_secs(30));
    assert_eq!(
        c.ok(&["jobs", "cancel", "--wait", &long]).trim(),
        "CANCELLED"
    );
    assert_eq!(c.job(&long)["state"], "CANCELLED");
    assert_eq!(c.job(&long)["tasks"][0]["state"], "KILLED");

    // A script whose interpreter sits in a directory the task's user
    // cannot search: the error names the user and that directory.
    let dir = gpuctl_tests::test_dir();
    let private = dir.path().join("private");
    std::fs::create_dir(&private).unwrap();
    std::fs::write(private.join("python"), "#!/bin/sh\necho never\n").unwrap();
    std::fs::set_permissions(
        private.join("python"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    let script = dir.path().join("train.py");
    std::fs::write(
        &script,
        format!("#!{}\nprint('hi')\n", private.join("python").display()),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let denied = c.submit(&["--name", "denied", "--", script.to_str().unwrap()]);
    assert_eq!(c.wait_job(&denied, 30), (1, "FAILED".to_string()));
    let job = c.job(&denied);
    let words = job["tasks"][0]["message"].as_str().unwrap();
    assert!(
        words.contains("the task runs as user ")
            && words.contains(&format!(
                "cannot search the directory {} (mode 700",
                private.display()
            ))
            && words.contains("its interpreter"),
        "{job}"
    );
}

/// Issue 38, item 2: a gang that says nothing (and, on simulated GPUs,
/// computes nothing) for its `--hang-timeout` is stopped as HUNG, with an
/// event, and started again by its retry policy; a task that keeps
/// writing is never stopped, however long it runs.
#[test]
fn a_silent_gang_is_stopped_as_hung_and_retried_and_a_chatty_task_is_not() {
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts::default());
    let chatty = c.submit(&[
        "--name",
        "chatty",
        "--hang-timeout",
        "2s",
        "--",
        "sh",
        "-c",
        "for i in 1 2 3 4 5 6 7 8 9 10; do echo $i; sleep 0.5; done",
    ]);
    let hung = c.submit(&[
        "--name",
        "hung",
        "--replicas",
        "2",
        "--hang-timeout",
        "2s",
        "--max-retries",
        "1",
        "--",
        "sh",
        "-c",
        "echo started; exec sleep 120",
    ]);
    assert_eq!(c.wait_job(&hung, 60), (1, "FAILED".to_string()));
    let j = c.job(&hung);
    assert_eq!(j["retries"], 1, "{j}");
    let tasks = j["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 4, "two attempts of two ranks: {j}");
    // In each attempt a rank was stopped as hung (both are silent: the
    // other may be too, or be stopped because of it).
    for attempt in tasks.chunks(2) {
        assert!(
            attempt.iter().any(|t| t["reason"] == "HUNG"
                && t["message"]
                    .as_str()
                    .unwrap()
                    .starts_with("hung: no output, no GPU activity and no heartbeat for ")),
            "{j}"
        );
    }
    let events: Vec<&str> = j["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["reason"].as_str().unwrap())
        .collect();
    assert!(
        events.contains(&"Hung") && events.contains(&"Retrying"),
        "{j}"
    );
    assert!(message(&c, &hung).contains("hung: no output"), "{j}");
    // Ten half-second lines, 5 s in all, with a 2 s timeout: never hung.
    assert_eq!(c.wait_job(&chatty, 60), (0, "SUCCEEDED".to_string()));
}
