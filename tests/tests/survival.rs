//! Training outlives the agent: an agent SIGKILLed or SIGTERMed under
//! running Docker and host-process tasks loses none of them; a task that
//! ends while the agent is down is reported with its real exit code; an
//! agent frozen (SIGSTOP) past the agent timeout gets its tasks back, and
//! one frozen past the lost timeout has fenced them before the job runs
//! elsewhere. Throughout, a watcher reads every live process's environment
//! from /proc (containers included) and checks that no GPU is used by two
//! live tasks and no job runs twice at once: the invariant from outside
//! the master. Needs root and Docker (skipped otherwise; required in CI).
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use gpuctl_tests::{
    busybox_image, docker_or_skip, live_tasks, wait_for, AgentOpts, Cluster, InvariantWatch,
};
use gpuctl_tests::{test_marker, Gpuctl};

const MARKER: &str = "GPUCTL_SURVIVAL_TEST";

/// A master with short timeouts (unreachable after 1.5 s, tasks fenced 4 s
/// after the agent's last contact, + 2 s grace; lost after `lost_secs`,
/// which must exceed 4 + 2 + 5 + 2 x 1 (the election timeout)) and one agent of one GPU whose tasks
/// outlive it.
fn fencing_cluster(lost_secs: &str, runtime: &str) -> Cluster {
    let mut c = Cluster::start(&[
        "--heartbeat-interval-secs",
        "0.2",
        "--agent-timeout-secs",
        "1.5",
        "--agent-fence-timeout-secs",
        "4",
        "--agent-lost-timeout-secs",
        lost_secs,
    ]);
    c.add_agent(AgentOpts {
        runtime,
        simulate_gpus: Some("1xA100-SXM4-40GB"),
        stop_tasks_on_shutdown: false,
        ..Default::default()
    });
    c
}

/// Exactly one task ran for the job, and it ended as expected.
fn assert_ran_once(c: &Cluster, job: &str, state: &str, exit_code: i64) {
    let j = c.wait_state(job, state, Duration::from_secs(60));
    let tasks = j["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 1, "{job} ran more than once: {j}");
    assert_eq!(tasks[0]["exit_code"], exit_code, "{j}");
}

#[test]
fn tasks_survive_agent_sigkill_and_sigterm_with_their_real_exit_codes() {
    let test = "tasks_survive_agent_sigkill_and_sigterm_with_their_real_exit_codes";
    if !docker_or_skip(test) {
        return;
    }
    let image = busybox_image();
    let m = test_marker("kill");
    let env = format!("{MARKER}={m}");
    let mut c = Cluster::start(&["--heartbeat-interval-secs", "0.2"]);
    c.add_agent(AgentOpts {
        runtime: "docker,process",
        stop_tasks_on_shutdown: false,
        ..Default::default()
    });
    let watch = InvariantWatch::start(MARKER, &m);
    // Each writes a line when it starts, so a second start would show.
    let proc_job = c.submit(&[
        "--name",
        "proc",
        "--gpus",
        "1",
        "--env",
        &env,
        "--",
        "sh",
        "-c",
        "echo started; sleep 8; exit 3",
    ]);
    let docker_job = c.submit(&[
        "--name",
        "ctr",
        "--gpus",
        "1",
        "--image",
        &image,
        "--env",
        &env,
        "--",
        "sh",
        "-c",
        "echo started; sleep 8; exit 5",
    ]);
    c.wait_state(&proc_job, "RUNNING", Duration::from_secs(60));
    c.wait_state(&docker_job, "RUNNING", Duration::from_secs(60));
    wait_for(Duration::from_secs(10), "both tasks live", || {
        live_tasks(MARKER, &m)
            .iter()
            .map(|t| &t.task_id)
            .collect::<std::collections::BTreeSet<_>>()
            .len()
            == 2
    });

    // The container's output is copied at least once: a crash within a
    // quarter second of a line may copy that line again (docs/operations.md).
    std::thread::sleep(Duration::from_millis(500));
    // A crash: both tasks keep running, seen from outside.
    c.agents[0].kill();
    std::thread::sleep(Duration::from_secs(1));
    let live = live_tasks(MARKER, &m);
    let ids: std::collections::BTreeSet<_> = live.iter().map(|t| t.task_id.clone()).collect();
    assert_eq!(ids.len(), 2, "tasks died with the agent: {live:?}");
    // Seen from the kernel too: every process of both tasks (the container's
    // included) is in its own task's cgroup.
    assert!(
        live.iter()
            .all(|t| t.task_cgroup.as_deref() == Some(t.task_id.as_str())),
        "{live:?}"
    );
    c.restart_agent(0);
    assert_ran_once(&c, &proc_job, "FAILED", 3);
    assert_ran_once(&c, &docker_job, "FAILED", 5);
    // The output survives the crash, each line copied once (the cursor
    // is saved as soon as the output pauses).
    let logs = c.ok(&["jobs", "logs", &docker_job]);
    assert_eq!(logs.matches("started").count(), 1, "{logs}");
    let logs = c.ok(&["jobs", "logs", &proc_job]);
    assert_eq!(logs.matches("started").count(), 1, "{logs}");

    // A graceful stop (an upgrade): the task ends while no agent runs and
    // is reported by the next one with its real exit code.
    let quick = c.submit(&[
        "--name",
        "quick",
        "--gpus",
        "1",
        "--env",
        &env,
        "--",
        "sh",
        "-c",
        "sleep 3; exit 0",
    ]);
    c.wait_state(&quick, "RUNNING", Duration::from_secs(60));
    c.agents[0].stop();
    let live = live_tasks(MARKER, &m);
    assert!(
        !live.is_empty() && live.iter().all(|t| t.job_id == quick),
        "the task died with a SIGTERMed agent: {live:?}"
    );
    wait_for(
        Duration::from_secs(15),
        "the task ends while the agent is down",
        || live_tasks(MARKER, &m).is_empty(),
    );
    assert_eq!(
        c.job(&quick)["state"],
        "RUNNING",
        "nobody could have told the master"
    );
    c.restart_agent(0);
    assert_ran_once(&c, &quick, "SUCCEEDED", 0);
    watch.assert_held();
}

#[test]
fn a_frozen_agent_keeps_its_tasks_until_fenced_and_the_job_never_runs_twice() {
    let test = "a_frozen_agent_keeps_its_tasks_until_fenced_and_the_job_never_runs_twice";
    if !docker_or_skip(test) {
        return;
    }
    let m = test_marker("freeze");
    let env = format!("{MARKER}={m}");
    let mut c = fencing_cluster("14", "process");
    let watch = InvariantWatch::start(MARKER, &m);
    let j = c.submit(&[
        "--name",
        "train",
        "--gpus",
        "1",
        "--max-retries",
        "1",
        "--env",
        &env,
        "--",
        "sh",
        "-c",
        "exec sleep 300",
    ]);
    let job = c.wait_state(&j, "RUNNING", Duration::from_secs(60));
    let first = job["tasks"][0]["id"].as_str().unwrap().to_string();
    let pid = c.agents[0].pid();
    let signal = |s| nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), s).unwrap();

    // A short freeze (past the agent timeout, within the fence): the task
    // is UNREACHABLE, still held, and RUNNING again when the agent is back.
    signal(nix::sys::signal::Signal::SIGSTOP);
    wait_for(Duration::from_secs(10), "task UNREACHABLE", || {
        c.job(&j)["tasks"][0]["state"] == "UNREACHABLE"
    });
    assert_eq!(c.job(&j)["state"], "RUNNING");
    signal(nix::sys::signal::Signal::SIGCONT);
    wait_for(Duration::from_secs(10), "task RUNNING again", || {
        c.job(&j)["tasks"][0]["state"] == "RUNNING"
    });
    assert_eq!(live_tasks(MARKER, &m).len(), 1);

    // A second agent where the job may go once its task is LOST.
    c.add_agent(AgentOpts {
        simulate_gpus: Some("1xA100-SXM4-40GB"),
        ..Default::default()
    });
    // A long freeze: the supervisor fences the task (the agent cannot), and
    // only then does the master declare it LOST and start the job again.
    signal(nix::sys::signal::Signal::SIGSTOP);
    wait_for(
        Duration::from_secs(15),
        "the fence stops the frozen agent's task",
        || !live_tasks(MARKER, &m).iter().any(|t| t.task_id == first),
    );
    wait_for(
        Duration::from_secs(30),
        "the job runs again elsewhere",
        || live_tasks(MARKER, &m).iter().any(|t| t.task_id != first),
    );
    signal(nix::sys::signal::Signal::SIGCONT);
    wait_for(Duration::from_secs(20), "the old task is released", || {
        let j = c.job(&j);
        j["tasks"][0]["id"] == first.as_str() && j["tasks"][0]["state"] != "UNREACHABLE"
    });
    // The new task's RUNNING may still be on its way from its agent (its
    // process is live, checked above).
    let j2 = c.wait_state(&j, "RUNNING", Duration::from_secs(30));
    assert_eq!(j2["tasks"].as_array().unwrap().len(), 2, "{j2}");
    c.ok(&["jobs", "cancel", &j]);
    c.wait_state(&j, "CANCELLED", Duration::from_secs(30));
    watch.assert_held();
}

#[test]
fn a_frozen_agents_container_is_fenced_by_its_watcher() {
    let test = "a_frozen_agents_container_is_fenced_by_its_watcher";
    if !docker_or_skip(test) {
        return;
    }
    let image = busybox_image();
    let m = test_marker("ctr-fence");
    let env = format!("{MARKER}={m}");
    let c = fencing_cluster("30", "docker,process");
    let watch = InvariantWatch::start(MARKER, &m);
    let j = c.submit(&[
        "--name", "ctr", "--gpus", "1", "--image", &image, "--env", &env, "--", "sleep", "300",
    ]);
    let job = c.wait_state(&j, "RUNNING", Duration::from_secs(60));
    let first = job["tasks"][0]["id"].as_str().unwrap().to_string();
    wait_for(Duration::from_secs(10), "the container runs", || {
        live_tasks(MARKER, &m).iter().any(|t| t.task_id == first)
    });
    let pid = c.agents[0].pid();
    let signal = |s| nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), s).unwrap();
    // Frozen: the agent cannot stop anything; the container's own watcher
    // stops it once the last contact is 4 s old (+ the 2 s grace).
    signal(nix::sys::signal::Signal::SIGSTOP);
    let frozen_at = std::time::Instant::now();
    wait_for(
        Duration::from_secs(20),
        "the watcher stops the container",
        || live_tasks(MARKER, &m).is_empty(),
    );
    assert!(
        frozen_at.elapsed() >= Duration::from_secs(3),
        "stopped before the fence: {:?}",
        frozen_at.elapsed()
    );
    // Back before the lost timeout: the agent reports the task KILLED by
    // the fence, with its reason.
    signal(nix::sys::signal::Signal::SIGCONT);
    wait_for(
        Duration::from_secs(30),
        "the fenced task is reported",
        || c.job(&j)["tasks"][0]["state"] == "KILLED",
    );
    let job = c.job(&j);
    let msg = job["tasks"][0]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(msg.contains("fenced"), "{job}");
    watch.assert_held();
}
