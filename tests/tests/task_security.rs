//! What a task may do (issue 18, "tasks cannot escape"), end to end with
//! the real binaries: host-process tasks run as an unprivileged user unless
//! an agent allows root and the job asks; containers are not privileged,
//! keep only the default capabilities, get no new privileges, run as the
//! job's user and see no host path but the mounts their agent allows.
//! Needs root (to switch users) and, for containers, a Docker daemon.
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use gpuctl_tests::Gpuctl;
use gpuctl_tests::{
    busybox_image, docker_or_skip, root_or_skip, task_containers, AgentOpts, Cluster,
};

/// What a task prints about itself.
const WHO_AM_I: &str = "id -u; id -g; id -G; grep -E '^(CapEff|NoNewPrivs):' /proc/self/status; \
    if cat /etc/shadow >/dev/null 2>&1; then echo shadow-read; else echo shadow-denied; fi; \
    echo mine > file-of-mine && echo wrote-sandbox";

fn first_lines(out: &str, n: usize) -> Vec<&str> {
    out.lines().take(n).collect()
}

fn task_field<'a>(job: &'a Value, field: &str) -> &'a str {
    job["tasks"][0][field].as_str().unwrap_or_default()
}

#[test]
fn host_tasks_run_unprivileged_unless_an_agent_allows_root_and_the_job_asks() {
    if !root_or_skip("host_tasks_run_unprivileged_unless_an_agent_allows_root_and_the_job_asks") {
        return;
    }
    let mut c = Cluster::start(&[]);
    let plain = c.add_agent(AgentOpts::default());
    let agents = c.json(&["agents", "list", "--json"]);
    assert_eq!(agents[0]["allow_root_tasks"], false);

    // By default: a user of its own (uid and gid of one number from the
    // agent's task_users), no other group, no way up, its sandbox
    // writable.
    let j = c.submit(&["--name", "who", "--", "sh", "-c", WHO_AM_I]);
    assert_eq!(c.wait_job(&j, 30), (0, "SUCCEEDED".to_string()));
    let out = c.ok(&["jobs", "logs", &j]);
    let ids = first_lines(&out, 3);
    let own: u32 = ids[0].parse().unwrap();
    assert!(gpuctl_tests::TASK_USERS.contains(&own), "{out}");
    assert_eq!(ids, [ids[0]; 3], "{out}");
    assert!(out.contains("NoNewPrivs:\t1\n"), "{out}");
    assert!(out.contains("CapEff:\t0000000000000000\n"), "{out}");
    assert!(out.contains("shadow-denied\n"), "{out}");
    assert!(out.contains("wrote-sandbox\n"), "{out}");
    assert_eq!(c.job(&j)["security"]["user"], Value::Null);

    // The job's own user.
    let j = c.submit(&[
        "--name",
        "as-1234",
        "--user",
        "1234:1234",
        "--",
        "sh",
        "-c",
        WHO_AM_I,
    ]);
    assert_eq!(c.wait_job(&j, 30), (0, "SUCCEEDED".to_string()));
    let out = c.ok(&["jobs", "logs", &j]);
    assert_eq!(first_lines(&out, 3), ["1234", "1234", "1234"], "{out}");
    assert!(out.contains("shadow-denied\n"), "{out}");
    assert_eq!(c.job(&j)["security"]["user"], "1234:1234");
    assert!(c.ok(&["jobs", "get", &j]).contains("user 1234:1234"));

    // Root by another name is refused when submitted, naming the field.
    let out = c.gpuctl(&["jobs", "submit", "--name", "r", "--user", "0", "--", "id"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("spec.security.user"), "{err}");

    // Asking for root where no agent allows it: not placed, and it says
    // why.
    let root = c.submit(&[
        "--name",
        "root",
        "--run-as-root",
        "--",
        "sh",
        "-c",
        WHO_AM_I,
    ]);
    let job = c.job_with_reason(&root);
    assert_eq!(job["state"], "QUEUED", "{job}");
    assert_eq!(
        job["reason"], "no agent allows root tasks (agent option allow_root_tasks)",
        "{job}"
    );
    assert_eq!(job["wait_reason"]["why"]["need"]["kind"], "root_tasks");
    assert_eq!(job["security"]["run_as_root"], true);

    // An agent that allows root takes it, and it runs as root there.
    let allowing = c.add_agent(AgentOpts {
        extra: vec!["--allow-root-tasks".into()],
        ..Default::default()
    });
    assert_ne!(allowing, plain);
    assert_eq!(c.wait_job(&root, 30), (0, "SUCCEEDED".to_string()));
    let job = c.job(&root);
    assert_eq!(task_field(&job, "agent_id"), allowing);
    let out = c.ok(&["jobs", "logs", &root]);
    assert_eq!(first_lines(&out, 2), ["0", "0"], "{out}");
    assert!(out.contains("shadow-read\n"), "{out}");
    let agents = c.json(&["agents", "list", "--json"]);
    let described = agents
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["id"] == allowing.as_str())
        .unwrap();
    assert_eq!(described["allow_root_tasks"], true);

    // Jobs that do not ask still run unprivileged on that agent.
    let j = c.submit(&["--name", "who-2", "--", "sh", "-c", WHO_AM_I]);
    assert_eq!(c.wait_job(&j, 30), (0, "SUCCEEDED".to_string()));
    let out = c.ok(&["jobs", "logs", &j]);
    let uid: u32 = first_lines(&out, 1)[0].parse().unwrap();
    assert!(gpuctl_tests::TASK_USERS.contains(&uid), "{out}");
}

/// `docker inspect` of a task's running container, `{{json .KEY}}`.
fn inspect(container: &str, key: &str) -> Value {
    let out = Command::new("docker")
        .args([
            "inspect",
            "--format",
            &format!("{{{{json .{key}}}}}"),
            container,
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "docker inspect {container}: {out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The container of the job's (running) task.
fn container_of(c: &Cluster, agent: &str, job: &str) -> String {
    let j = c.wait_state(job, "RUNNING", Duration::from_secs(60));
    let task = task_field(&j, "id").to_string();
    let ids = task_containers(agent, &task);
    assert_eq!(ids.len(), 1, "containers of {task}: {ids:?}");
    ids[0].clone()
}

#[test]
fn containers_keep_only_the_default_capabilities_and_allowed_mounts() {
    if !docker_or_skip("containers_keep_only_the_default_capabilities_and_allowed_mounts") {
        return;
    }
    let image = busybox_image();
    let mut c = Cluster::start(&[]);
    let allowed = c.dir.path().join("datasets");
    let outside = c.dir.path().join("secrets");
    std::fs::create_dir_all(&allowed).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(allowed.join("data"), "dataset-bytes\n").unwrap();
    std::fs::write(outside.join("key"), "secret\n").unwrap();
    // A way out of the allowed prefix that only resolving it reveals.
    std::os::unix::fs::symlink(&outside, allowed.join("escape")).unwrap();
    let allowed_s = allowed.display().to_string();
    let agent = c.add_agent(AgentOpts {
        runtime: "docker,process",
        extra: vec!["--allowed-mounts".into(), allowed_s.clone()],
        ..Default::default()
    });
    let agents = c.json(&["agents", "list", "--json"]);
    assert_eq!(agents[0]["allowed_mounts"], serde_json::json!([allowed_s]));

    let script = "grep -E '^(CapEff|NoNewPrivs):' /proc/self/status; id -u; id -g; cat /in/data; \
        if touch /in/x 2>/dev/null; then echo ro-written; else echo ro-refused; fi; sleep 3";
    let mount = format!("{allowed_s}:/in");
    let j = c.submit(&[
        "--name", "caps", "--image", &image, "--mount", &mount, "--", "sh", "-c", script,
    ]);
    let ctr = container_of(&c, &agent, &j);
    let host = inspect(&ctr, "HostConfig");
    assert_eq!(host["Privileged"], false, "{host}");
    assert_eq!(host["CapDrop"], serde_json::json!(["ALL"]), "{host}");
    assert_eq!(
        host["CapAdd"],
        serde_json::json!(gpuctl_agent::security::CONTAINER_CAPABILITIES),
        "{host}"
    );
    assert_eq!(
        host["SecurityOpt"],
        serde_json::json!(["no-new-privileges"])
    );
    // Its mount and, read-only, the agent's notice directory for it (its
    // stop notice: docs/scheduling.md), nothing else (simulated GPUs: no
    // driver volume).
    let task = c.job(&j)["tasks"][0]["id"].as_str().unwrap().to_string();
    let notices = c.dir.path().join("agent0/notices").join(&task);
    assert_eq!(
        host["Binds"],
        serde_json::json!([
            format!("{allowed_s}:/in:ro"),
            format!("{}:/run/gpuctl:ro", notices.display())
        ])
    );
    assert_eq!(inspect(&ctr, "Config.User"), "");
    assert_eq!(c.wait_job(&j, 60), (0, "SUCCEEDED".to_string()));
    let out = c.ok(&["jobs", "logs", &j]);
    // CHOWN, DAC_OVERRIDE, FOWNER, FSETID, KILL, SETGID, SETUID, SETPCAP,
    // SYS_CHROOT: bits 0, 1, 3-8 and 18.
    assert!(out.contains("CapEff:\t00000000000401fb\n"), "{out}");
    assert!(out.contains("NoNewPrivs:\t1\n"), "{out}");
    assert!(out.contains("0\n0\ndataset-bytes\n"), "{out}");
    assert!(out.contains("ro-refused\n"), "{out}");
    assert!(!allowed.join("x").exists());

    // The job's user: no capability in effect.
    let j = c.submit(&[
        "--name",
        "user",
        "--image",
        &image,
        "--user",
        "1234:1234",
        "--mount",
        &mount,
        "--",
        "sh",
        "-c",
        script,
    ]);
    let ctr = container_of(&c, &agent, &j);
    assert_eq!(inspect(&ctr, "Config.User"), "1234:1234");
    assert_eq!(c.wait_job(&j, 60), (0, "SUCCEEDED".to_string()));
    let out = c.ok(&["jobs", "logs", &j]);
    assert!(out.contains("CapEff:\t0000000000000000\n"), "{out}");
    assert!(out.contains("1234\n1234\ndataset-bytes\n"), "{out}");

    // A mount no agent allows: not placed, and it says why.
    let secret = format!("{}:/in", outside.display());
    let j = c.submit(&[
        "--name", "out", "--image", &image, "--mount", &secret, "--", "cat", "/in/key",
    ]);
    let job = c.job_with_reason(&j);
    assert_eq!(job["state"], "QUEUED", "{job}");
    assert_eq!(
        job["reason"],
        format!(
            "no agent allows mounting {} (agent option allowed_mounts)",
            outside.display()
        ),
        "{job}"
    );
    c.ok(&["jobs", "cancel", &j]);

    // One that looks allowed but leads out: the agent refuses it itself.
    let escape = format!("{allowed_s}/escape:/in");
    let j = c.submit(&[
        "--name", "esc", "--image", &image, "--mount", &escape, "--", "cat", "/in/key",
    ]);
    assert_eq!(c.wait_job(&j, 60).1, "FAILED");
    let job = c.job(&j);
    let msg = task_field(&job, "message");
    assert!(msg.contains("allowed_mounts"), "{job}");
    assert!(
        msg.contains(&format!("resolves to {}", outside.display())),
        "{job}"
    );
    // Nothing of it ran: it has no output at all.
    let logs = c.gpuctl(&["jobs", "logs", &j]);
    assert!(!logs.status.success() && logs.stdout.is_empty(), "{logs:?}");

    // A file system mounted below a read-only mount would stay writable in
    // the container (Docker makes only the top read-only): refused.
    let nested = allowed.join("nested");
    let fs = nested.join("fs");
    std::fs::create_dir_all(&fs).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "tmpfs"])
        .arg(&fs)
        .status()
        .unwrap();
    assert!(mounted.success(), "mount a tmpfs at {}", fs.display());
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(fs.clone());
    let ro = format!("{}:/in", nested.display());
    let j = c.submit(&[
        "--name", "sub", "--image", &image, "--mount", &ro, "--", "touch", "/in/fs/x",
    ]);
    assert_eq!(c.wait_job(&j, 60).1, "FAILED");
    let job = c.job(&j);
    let msg = task_field(&job, "message");
    assert!(
        msg.contains(&format!("file system mounted below it ({})", fs.display())),
        "{job}"
    );
    assert!(!fs.join("x").exists());

    // What is never allowed is refused when submitted, naming the field.
    for (args, field) in [
        (
            vec!["--mount", "data:/in"],
            "spec.security.mounts[0].host_path",
        ),
        (
            vec!["--mount", "/a/../etc:/in"],
            "spec.security.mounts[0].host_path",
        ),
        (vec!["--run-as-root"], "spec.security.run_as_root"),
    ] {
        let mut all = vec!["jobs", "submit", "--name", "bad", "--image", &image];
        all.extend(args);
        all.extend(["--", "true"]);
        let out = c.gpuctl(&all);
        assert!(!out.status.success(), "{all:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(field), "{all:?}: {err}");
    }
}
