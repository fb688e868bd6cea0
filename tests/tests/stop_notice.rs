//! Notice before a stop, on a real cluster (docs/scheduling.md, "Notice
//! before a stop"): a stop the cluster asks for (cancel, preemption) first
//! writes the task's notice file ($GPUCTL_STOP_NOTICE), then sends SIGTERM,
//! and SIGKILL only after the job's --stop-grace; the job's checkpoint
//! directory ($GPUCTL_CHECKPOINT_DIR) is the same path for every attempt,
//! and a preempted job goes back to the queue without using a retry, its
//! next attempt finding what the last one wrote.
//!
//! Test agents stop with a 2 s kill grace (`--kill-grace-secs 2`): a task
//! whose SIGTERM handler takes 4 s before it writes its checkpoint writes it
//! only if the job's grace applied.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuctl_tests::{
    busybox_image, docker_or_skip, live_tasks, root_or_skip, test_marker, try_wait_for, AgentOpts,
    Cluster, Gpuctl,
};

const T: Duration = Duration::from_secs(30);

/// On SIGTERM: copies the notice into the checkpoint directory, takes 4 s
/// (twice the agent's kill grace), writes its checkpoint and exits. On
/// start: says whether a checkpoint of an earlier attempt is there.
const CHECKPOINTER: &str = r#"
if [ -f "$GPUCTL_CHECKPOINT_DIR/ckpt" ]; then echo "$GPUCTL_TASK_ID" > "$GPUCTL_CHECKPOINT_DIR/resumed"; fi
trap 'cp "$GPUCTL_STOP_NOTICE" "$GPUCTL_CHECKPOINT_DIR/notice"; sleep 4; echo "$GPUCTL_TASK_ID" > "$GPUCTL_CHECKPOINT_DIR/ckpt"; exit 143' TERM
echo started
while true; do sleep 0.2; done
"#;

/// A cluster with one agent whose allowed mounts cover `<dir>/ckpt`; the
/// checkpoint root's path.
fn cluster(runtime: &'static str, gpus: &'static str) -> (Cluster, PathBuf) {
    let mut c = Cluster::start(&[]);
    let root = c.dir.path().join("ckpt");
    std::fs::create_dir_all(&root).unwrap();
    c.add_agent(AgentOpts {
        simulate_gpus: Some(gpus),
        runtime,
        extra: vec!["--allowed-mounts".into(), root.display().to_string()],
        ..Default::default()
    });
    (c, root)
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Waits until the file has some text; its text.
fn wait_file(c: &Cluster, p: &Path) -> String {
    // Written by `echo > file`: made empty first, then written.
    let ok = try_wait_for(T, || {
        std::fs::read_to_string(p).is_ok_and(|s| !s.trim().is_empty())
    });
    assert!(ok, "{} never written\n{}", p.display(), c.diagnostics());
    read(p)
}

/// Cancels a running checkpointing job and checks what its task got: the
/// notice (cancelled, the job's grace), then the time to checkpoint.
fn cancel_and_check(c: &Cluster, job: &str, dir: &Path) {
    c.wait_state(job, "RUNNING", T);
    // The task has trapped SIGTERM once it printed `started`.
    let ok = try_wait_for(T, || {
        c.gpuctl(&["jobs", "logs", job])
            .stdout
            .starts_with(b"started")
    });
    assert!(ok, "never started\n{}", c.diagnostics());
    c.ok(&["jobs", "cancel", job]);
    let notice = wait_file(c, &dir.join("notice"));
    assert!(notice.contains("reason=cancelled\n"), "{notice}");
    assert!(notice.contains("message=cancelled\n"), "{notice}");
    assert!(notice.contains("grace_secs=20\n"), "{notice}");
    let deadline: u64 = notice
        .lines()
        .find_map(|l| l.strip_prefix("deadline_unix_ms="))
        .unwrap()
        .parse()
        .unwrap();
    let now = gpuctl_core::time::now_ms();
    assert!(
        deadline > now && deadline <= now + 20_000,
        "{deadline} vs {now}"
    );
    // Written 4 s after SIGTERM: the agent waited longer than its own 2 s.
    let ckpt = wait_file(c, &dir.join("ckpt"));
    assert_eq!(ckpt.trim(), format!("{job}.0"));
    c.wait_state(job, "CANCELLED", T);
}

#[test]
fn a_cancelled_host_task_gets_its_notice_and_grace_and_checkpoints() {
    if !root_or_skip("a_cancelled_host_task_gets_its_notice_and_grace_and_checkpoints") {
        return;
    }
    let (c, root) = cluster("process", "1xA100-SXM4-40GB");
    let dir = root.join("host");
    let dir_s = dir.display().to_string();
    let job = c.submit(&[
        "--name",
        "ckpt",
        "--cpus",
        "0.1",
        "--stop-grace",
        "20s",
        "--checkpoint-dir",
        &dir_s,
        "--",
        "sh",
        "-c",
        CHECKPOINTER,
    ]);
    cancel_and_check(&c, &job, &dir);
    // Made by the agent for the task's own user, who wrote into it.
    use std::os::unix::fs::MetadataExt;
    let owner = std::fs::metadata(&dir).unwrap().uid();
    assert_ne!(owner, 0, "the task's user owns it");
    assert_eq!(std::fs::metadata(dir.join("ckpt")).unwrap().uid(), owner);
}

#[test]
fn a_cancelled_container_gets_its_notice_and_grace_and_checkpoints() {
    if !docker_or_skip("a_cancelled_container_gets_its_notice_and_grace_and_checkpoints") {
        return;
    }
    let image = busybox_image();
    let (c, root) = cluster("docker", "1xA100-SXM4-40GB");
    let dir = root.join("container");
    let dir_s = dir.display().to_string();
    let job = c.submit(&[
        "--name",
        "ckpt",
        "--cpus",
        "0.1",
        "--image",
        &image,
        "--stop-grace",
        "20s",
        "--checkpoint-dir",
        &dir_s,
        "--",
        "sh",
        "-c",
        CHECKPOINTER,
    ]);
    cancel_and_check(&c, &job, &dir);
}

/// The task processes of the job whose MARKER is `value`.
fn alive(value: &str) -> bool {
    !live_tasks("MARKER", value).is_empty()
}

#[test]
fn sigkill_comes_after_the_jobs_grace_not_before() {
    if !root_or_skip("sigkill_comes_after_the_jobs_grace_not_before") {
        return;
    }
    let (c, _) = cluster("process", "2xA100-SXM4-40GB");
    let marker = test_marker("grace");
    // Both ignore SIGTERM (their children inherit that): only SIGKILL
    // ends them.
    let stubborn = |name: &str, grace: &str| {
        let env = format!("MARKER={marker}-{name}");
        c.submit(&[
            "--name",
            name,
            "--cpus",
            "0.1",
            "--stop-grace",
            grace,
            "--env",
            &env,
            "--",
            "sh",
            "-c",
            "trap '' TERM; echo started; while true; do sleep 0.2; done",
        ])
    };
    // Above the cluster's maximum (5 minutes by default): refused, saying so.
    let out = c.gpuctl(&[
        "jobs",
        "submit",
        "--name",
        "x",
        "--stop-grace",
        "10m",
        "--",
        "true",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("stop_grace") && err.contains("600 s") && err.contains("300 s"),
        "{err}"
    );
    let short = stubborn("short", "3s");
    let long = stubborn("long", "12s");
    for j in [&short, &long] {
        c.wait_state(j, "RUNNING", T);
    }
    let (s, l) = (format!("{marker}-short"), format!("{marker}-long"));
    assert!(
        try_wait_for(T, || alive(&s) && alive(&l)),
        "{}",
        c.diagnostics()
    );
    let t0 = Instant::now();
    c.ok(&["jobs", "cancel", &short]);
    c.ok(&["jobs", "cancel", &long]);
    // The short one: killed about 3 s after the cancel (not at once: it
    // ignores SIGTERM; not after the long one's grace).
    assert!(
        try_wait_for(Duration::from_secs(11), || !alive(&s)),
        "the 3 s job outlived 11 s\n{}",
        c.diagnostics()
    );
    let short_took = t0.elapsed();
    assert!(short_took >= Duration::from_millis(2500), "{short_took:?}");
    // The long one still runs well past the short one's grace and the
    // agent's own 2 s.
    while t0.elapsed() < Duration::from_secs(6) {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(alive(&l), "the 12 s job was killed before 6 s");
    assert!(
        try_wait_for(T, || !alive(&l)),
        "the 12 s job outlived its grace by far\n{}",
        c.diagnostics()
    );
    let long_took = t0.elapsed();
    assert!(long_took >= Duration::from_secs(11), "{long_took:?}");
    c.wait_state(&short, "CANCELLED", T);
    c.wait_state(&long, "CANCELLED", T);
}

#[test]
fn a_preempted_job_checkpoints_requeues_without_a_retry_and_resumes() {
    if !root_or_skip("a_preempted_job_checkpoints_requeues_without_a_retry_and_resumes") {
        return;
    }
    let (c, root) = cluster("process", "1xA100-SXM4-40GB");
    let dir = root.join("preempted");
    let dir_s = dir.display().to_string();
    let low = c.submit(&[
        "--name",
        "low",
        "--cpus",
        "0.1",
        "--gpus",
        "1",
        "--max-retries",
        "0",
        "--stop-grace",
        "20s",
        "--checkpoint-dir",
        &dir_s,
        "--",
        "sh",
        "-c",
        CHECKPOINTER,
    ]);
    c.wait_state(&low, "RUNNING", T);
    assert!(try_wait_for(T, || {
        c.gpuctl(&["jobs", "logs", &low])
            .stdout
            .starts_with(b"started")
    }));
    let high = c.submit(&[
        "--name",
        "high",
        "--cpus",
        "0.1",
        "--gpus",
        "1",
        "--priority",
        "10",
        "--",
        "sleep",
        "1",
    ]);
    let notice = wait_file(&c, &dir.join("notice"));
    assert!(notice.contains("reason=preempted\n"), "{notice}");
    assert!(
        notice.contains(&format!("message=preempted by {high} (priority 10)\n")),
        "{notice}"
    );
    assert!(notice.contains("grace_secs=20\n"), "{notice}");
    assert_eq!(wait_file(&c, &dir.join("ckpt")).trim(), format!("{low}.0"));
    c.wait_state(&high, "SUCCEEDED", T);
    // Back in the queue without using a retry (it has none), then its
    // next attempt finds the checkpoint, as the same user.
    let resumed = wait_file(&c, &dir.join("resumed"));
    assert_eq!(resumed.trim(), format!("{low}.1"));
    let j = c.wait_state(&low, "RUNNING", T);
    assert_eq!(j["retries"], 0, "{j}");
    assert_eq!(j["preemptions"], 1, "{j}");
    c.ok(&["jobs", "cancel", &low]);
    c.wait_state(&low, "CANCELLED", T);
}
