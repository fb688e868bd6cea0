//! End to end with real Docker: a GPU job in a container, its logs, and a
//! cancelled container that is gone afterwards. Needs root and a Docker
//! daemon (skipped otherwise; required with GPUCTL_REQUIRE_DOCKER=1).
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use gpuctl_tests::Gpuctl;
use gpuctl_tests::{
    busybox_image, containers_with_label, docker_or_skip, task_containers, wait_for, AgentOpts,
    Cluster,
};

#[test]
fn docker_job_runs_logs_and_cancel_removes_its_container() {
    if !docker_or_skip("docker_job_runs_logs_and_cancel_removes_its_container") {
        return;
    }
    let image = busybox_image();
    let mut c = Cluster::start(&[]);
    let agent = c.add_agent(AgentOpts {
        runtime: "docker,process",
        ..Default::default()
    });
    let runtimes = c.json(&["agents", "list", "--json"])[0]["runtimes"].clone();
    assert_eq!(runtimes, serde_json::json!(["docker", "process"]));

    let j = c.submit(&[
        "--name",
        "in-docker",
        "--image",
        &image,
        "--gpus",
        "2",
        "--",
        "sh",
        "-c",
        "echo visible=$NVIDIA_VISIBLE_DEVICES; echo to-stderr >&2",
    ]);
    // Follow while it runs: returns when the container has exited.
    let logs = c.ok(&["jobs", "logs", &j, "--follow"]);
    assert_eq!(c.wait_job(&j, 60), (0, "SUCCEEDED".to_string()));
    let job = c.job(&j);
    let gpus: Vec<&str> = job["tasks"][0]["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g.as_str().unwrap())
        .collect();
    assert_eq!(gpus.len(), 2);
    assert!(
        logs.contains(&format!("visible={}", gpus.join(","))),
        "{logs}"
    );
    assert!(logs.contains("to-stderr"), "{logs}");
    let task_id = job["tasks"][0]["id"].as_str().unwrap().to_string();
    assert!(task_containers(&agent, &task_id).is_empty());

    // A failing container reports its exit code.
    let f = c.submit(&[
        "--name", "fails", "--image", &image, "--", "sh", "-c", "exit 7",
    ]);
    assert_eq!(c.wait_job(&f, 60).0, 1);
    assert_eq!(c.job(&f)["tasks"][0]["exit_code"], 7);

    // --shm-size sizes the container's /dev/shm (Docker's default: 64 MiB),
    // seen from inside it.
    let shm = c.submit(&[
        "--name",
        "shm",
        "--image",
        &image,
        "--shm-size",
        "256MiB",
        "--",
        "sh",
        "-c",
        "df -m /dev/shm | tail -n 1",
    ]);
    assert_eq!(c.wait_job(&shm, 60).0, 0);
    let out = c.ok(&["jobs", "logs", &shm]);
    let row: Vec<&str> = out
        .lines()
        .last()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    assert_eq!(row.get(1), Some(&"256"), "{out}");
    assert_eq!(c.job(&shm)["shm_size"], "256MiB");

    // Cancel a long job: its container is gone afterwards.
    let long = c.submit(&[
        "--name", "long", "--image", &image, "--gpus", "1", "--", "sleep", "300",
    ]);
    let job = c.wait_state(&long, "RUNNING", Duration::from_secs(60));
    let task_id = job["tasks"][0]["id"].as_str().unwrap().to_string();
    let ids = task_containers(&agent, &task_id);
    assert_eq!(ids.len(), 1, "one container for {task_id}");
    if gpuctl_tests::cgroup_v1_or_skip("task cgroup of a container") {
        assert!(!gpuctl_tests::cgroup_dirs(&format!("gpuctl/{agent}"), &task_id).is_empty());
    }
    assert_eq!(
        containers_with_label("gpuctl.agent_id", &agent).len(),
        1,
        "labelled with the agent"
    );
    c.ok(&["jobs", "cancel", &long]);
    let (code, state) = c.wait_job(&long, 60);
    assert_eq!((code, state.as_str()), (1, "CANCELLED"));
    wait_for(Duration::from_secs(10), "container removed", || {
        task_containers(&agent, &task_id).is_empty()
    });
    assert_eq!(c.job(&long)["tasks"][0]["state"], "KILLED");
    // And so is its cgroup (default parent: gpuctl/<agent-id>/<task-id>).
    wait_for(Duration::from_secs(10), "task cgroup removed", || {
        gpuctl_tests::cgroup_dirs(&format!("gpuctl/{agent}"), &task_id).is_empty()
    });
}

#[test]
fn agent_asked_for_docker_starts_while_docker_is_down() {
    // A Docker daemon that is down (restarting, say) when the agent starts
    // is a runtime condition, not a startup error: containers of an earlier
    // agent process may still run, and the agent waits for the daemon,
    // saying so in its log and heartbeats. DOCKER_HOST names a socket that
    // is not there yet. Then it appears (a link to this machine's daemon):
    // the agent, which runs no container, finds the daemon back by itself
    // (its scan for strays, every 10 s), rather than reporting Docker down
    // until its next container (seen beside a demo cluster whose daemon a
    // test restarted).
    let dir = gpuctl_tests::test_dir();
    let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
    let work = dir.path().join("work");
    let socket = dir.path().join("docker.sock");
    /// Kills the agent however the test ends (a failed assertion too: a
    /// leaked agent would hold the test's output open).
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let agent = std::process::Command::new(gpuctl_tests::bin("gpuctl-agent"))
        .env("DOCKER_HOST", format!("unix://{}", socket.display()))
        .args([
            "--master",
            "127.0.0.1:1",
            "--work-dir",
            work.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--runtime",
            "docker",
        ])
        .stderr(log)
        .spawn()
        .unwrap();
    let mut agent = Killed(agent);
    let read = || std::fs::read_to_string(dir.path().join("agent.log")).unwrap_or_default();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let text = loop {
        let text = read();
        if text.contains("agent starting") {
            break text;
        }
        assert!(
            agent.0.try_wait().unwrap().is_none(),
            "the agent exited: {text}"
        );
        assert!(std::time::Instant::now() < deadline, "no start: {text}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert!(text.contains("Docker does not answer"), "{text}");
    assert!(
        agent.0.try_wait().unwrap().is_none(),
        "the agent exited: {text}"
    );
    if docker_or_skip("agent_asked_for_docker_starts_while_docker_is_down (the daemon back)") {
        std::os::unix::fs::symlink("/var/run/docker.sock", &socket).unwrap();
        let back = gpuctl_tests::try_wait_for(std::time::Duration::from_secs(30), || {
            read().contains("Docker daemon answers again")
        });
        assert!(back, "the daemon's return went unseen: {}", read());
    }
}

/// A container that runs as its image's user (unknown to the agent) and has
/// a hang timeout writes its heartbeat through a group of its own: the
/// heartbeat directory is root's and that group's (mode 0770, nobody else
/// may write it), and the container's process carries the group. Checked
/// from outside: the directory's owner and mode, the process's ids in
/// /proc; and the task, touching its heartbeat and printing nothing, is not
/// stopped as hung.
#[test]
fn a_container_of_its_images_user_writes_its_heartbeat_through_a_group_of_its_own() {
    if !docker_or_skip(
        "a_container_of_its_images_user_writes_its_heartbeat_through_a_group_of_its_own",
    ) {
        return;
    }
    use std::os::unix::fs::MetadataExt;
    // An image whose user is 4321, not root: made from the test image.
    let base = busybox_image();
    let image = "gpuctl/busybox:user4321";
    let maker = format!("gpuctl-test-user-image-{}", std::process::id());
    let docker = |args: &[&str]| {
        let out = std::process::Command::new("docker")
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "docker {args:?}: {out:?}");
    };
    docker(&["create", "--name", &maker, &base, "true"]);
    docker(&["commit", "--change", "USER 4321:4321", &maker, image]);
    docker(&["rm", &maker]);

    let marker = gpuctl_tests::test_marker("heartbeat-group");
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts {
        runtime: "docker,process",
        ..Default::default()
    });
    let j = c.submit(&[
        "--name",
        "beating",
        "--image",
        image,
        "--hang-timeout",
        "3s",
        "--env",
        &format!("GPUCTL_HB_TEST={marker}"),
        "--",
        "sh",
        "-c",
        "while touch \"$GPUCTL_HEARTBEAT_FILE\"; do sleep 0.5; done; echo cannot touch; sleep 60",
    ]);
    let job = c.wait_state(&j, "RUNNING", Duration::from_secs(60));
    let task_id = job["tasks"][0]["id"].as_str().unwrap().to_string();
    let mut live = Vec::new();
    wait_for(Duration::from_secs(20), "the container's process", || {
        live = gpuctl_tests::live_tasks("GPUCTL_HB_TEST", &marker);
        !live.is_empty()
    });
    let status = std::fs::read_to_string(format!("/proc/{}/status", live[0].pid)).unwrap();
    let field = |name: &str| -> Vec<u32> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|n| n.parse().ok())
            .collect()
    };
    assert_eq!(field("Uid:")[0], 4321, "{status}");
    let dir = c
        .dir
        .path()
        .join("agent0/heartbeats-containers")
        .join(&task_id);
    let md = std::fs::metadata(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    assert_eq!(
        (md.uid(), md.mode() & 0o7777),
        (0, 0o770),
        "{}",
        dir.display()
    );
    assert!(
        gpuctl_tests::TASK_USERS.contains(&md.gid()),
        "the group is leased from task_users: {}",
        md.gid()
    );
    assert!(
        field("Groups:").contains(&md.gid()),
        "the container carries group {}: {status}",
        md.gid()
    );
    // Past its 3 s timeout, silent but beating: still running, once.
    std::thread::sleep(Duration::from_secs(5));
    let job = c.job(&j);
    assert_eq!(job["state"], "RUNNING", "{job}");
    assert_eq!(job["tasks"].as_array().unwrap().len(), 1, "{job}");
    assert!(!c.ok(&["jobs", "logs", &j]).contains("cannot touch"));
    c.ok(&["jobs", "cancel", &j]);
    c.wait_state(&j, "CANCELLED", Duration::from_secs(60));
}

/// A container's checks: an HTTP GET of its named port (busybox httpd) and
/// a command run in it through `docker exec` (it reads the container's own
/// /tmp): ready once its page is there, stopped and restarted once the
/// command fails.
#[test]
fn a_containers_checks_run_beside_it_by_http_and_docker_exec() {
    if !docker_or_skip("a_containers_checks_run_beside_it") {
        return;
    }
    let image = busybox_image();
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts {
        runtime: "docker,process",
        ..Default::default()
    });
    c.ok(&[
        "services",
        "create",
        "page",
        "--image",
        &image,
        "--port",
        "http",
        "--restart-backoff",
        "200ms",
        "--readiness",
        "http:http/index.html interval=200ms failures=1",
        "--liveness",
        "interval=200ms failures=2 exec:test ! -f /tmp/dead",
        "--",
        "sh",
        "-c",
        "mkdir -p /tmp/www; (sleep 2; echo hi > /tmp/www/index.html; sleep 3; touch /tmp/dead) & \
         exec httpd -f -p \"$GPUCTL_PORT_HTTP\" -h /tmp/www",
    ]);
    let get = || c.json(&["services", "get", "page", "--json"]);
    wait_for(Duration::from_secs(90), "the container ready", || {
        get()["replica_jobs"][0]["ready"] == true
    });
    let job_id = get()["replica_jobs"][0]["job_id"]
        .as_str()
        .unwrap()
        .to_string();
    wait_for(Duration::from_secs(60), "the container restarted", || {
        c.job(&job_id)["retries"].as_u64().unwrap_or(0) >= 1
    });
    let j = c.job(&job_id);
    assert_eq!(j["tasks"][0]["reason"], "LIVENESS_FAILED", "{j}");
    assert_eq!(
        j["tasks"][0]["message"],
        "liveness: \"test ! -f /tmp/dead\" exited with code 1 (2 in a row)",
        "{j}"
    );
    c.ok(&["services", "delete", "page"]);
    assert_eq!(c.wait_job(&job_id, 60).1, "CANCELLED");
}
