use bollard::container::Config;

use super::images::split_reference;
use super::*;
use crate::runtime::{HostDriver, LABEL_JOB_ID};

#[test]
fn container_ids_recorded_in_task_state_map_to_their_tasks() {
    let dir = tempfile::tempdir().unwrap();
    for (task, id) in [("job-1.0", "abc123"), ("job-2.0", "")] {
        let d = dir.path().join(task);
        std::fs::create_dir_all(&d).unwrap();
        record_container_id(&d, id);
    }
    std::fs::create_dir_all(dir.path().join("job-3.0")).unwrap();
    let got = recorded_container_ids(dir.path());
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got["abc123"], "job-1.0");
}
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use gpuctl_core::types::{Resources, TaskSpec, UserIds};

use crate::runtime::image::ensure_busybox_image;

fn spec(dir: &Path, task_id: &str, image: &str, command: &[&str]) -> LaunchSpec {
    LaunchSpec {
        task: TaskSpec {
            share: None,
            task_id: task_id.to_string(),
            job_id: format!("job-{task_id}"),
            framework_id: String::new(),
            gpu_uuids: vec![],
            template: gpuctl_core::types::TaskTemplate {
                stop_grace_ms: None,
                checkpoint_dir: None,
                image: Some(image.to_string()),
                command: command.iter().map(|s| s.to_string()).collect(),
                env: BTreeMap::new(),
                resources: Resources {
                    cpus: 0.5,
                    mem_mib: 64,
                    gpus: 0,
                    ports: 0,
                },
                no_fence: false,
                security: Default::default(),
                hang_timeout_ms: None,
                preflight: false,
                options: Default::default(),
            },
        },
        agent_id: format!("agent-{task_id}"),
        env: BTreeMap::from([("GPUCTL_TASK_ID".to_string(), task_id.to_string())]),
        sandbox: dir.to_path_buf(),
        log_path: dir.join("task.log"),
        kill_grace: Duration::from_secs(3),
        isolation: Default::default(),
        state_dir: dir.to_path_buf(),
        fence: None,
        security: Default::default(),
    }
}

#[test]
fn who_gets_the_driver_volume() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = spec(dir.path(), "t1", "img", &["true"]);
    s.isolation.driver_volume = Some(dir.path().join("vol"));
    let binds = |s: &LaunchSpec, facts: &ImageFacts| {
        container_config(s, "img", facts, CgroupDriver::Cgroupfs, None)
            .host_config
            .unwrap()
            .binds
            .unwrap()
            .iter()
            .any(|b| b.contains(":/usr/local/nvidia:ro"))
    };
    // No GPU, an image that says NVIDIA_VISIBLE_DEVICES=all: a CPU job.
    let all = ImageFacts {
        env: vec!["NVIDIA_VISIBLE_DEVICES=all".into()],
        ..Default::default()
    };
    assert!(!binds(&s, &all));
    // The nvidia-docker label asks for it.
    let labelled = ImageFacts {
        wants_driver_volume: true,
        ..Default::default()
    };
    assert!(binds(&s, &labelled));
    // A GPU task always gets it.
    s.isolation.gpu_task = true;
    assert!(binds(&s, &ImageFacts::default()));
}

#[test]
fn shm_size_sizes_the_containers_dev_shm_and_unset_leaves_dockers() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = spec(dir.path(), "t1", "img", &["true"]);
    let shm = |s: &LaunchSpec| {
        container_config(
            s,
            "img",
            &ImageFacts::default(),
            CgroupDriver::Cgroupfs,
            None,
        )
        .host_config
        .unwrap()
        .shm_size
    };
    assert_eq!(shm(&s), None);
    s.task.template.options.shm_size = Some(gpuctl_core::types::MiB(8192));
    assert_eq!(shm(&s), Some(8 << 30));
}

#[test]
fn the_cgroup_driver_decides_where_a_container_goes() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = spec(dir.path(), "t1", "img", &["true"]);
    s.isolation.cgroup_parent = Some("/gpuctl/a/t1".into());
    let parent = |driver| {
        container_config(&s, "img", &ImageFacts::default(), driver, None)
            .host_config
            .unwrap()
            .cgroup_parent
    };
    // cgroupfs: inside the task's own cgroup (its device rules hold).
    assert_eq!(parent(CgroupDriver::Cgroupfs), Some("/gpuctl/a/t1".into()));
    // systemd takes only slices: gpuctl's.
    assert_eq!(parent(CgroupDriver::Systemd), Some("gpuctl.slice".into()));
}

/// Runs the task's container to its end (expecting `end`), removes it,
/// and returns the host configuration Docker had for it.
async fn run_and_inspect(
    rt: &DockerRuntime,
    s: &LaunchSpec,
    end: Ended,
) -> bollard::models::HostConfig {
    let t = s.task_ref();
    rt.start(s).await.unwrap();
    assert_eq!(rt.wait(&t).await.unwrap(), end);
    let name = container_name(&s.agent_id, &s.task.task_id);
    let info = rt
        .client()
        .unwrap()
        .inspect_container(&name, None)
        .await
        .unwrap();
    rt.remove(&t).await.unwrap();
    info.host_config.unwrap()
}

/// A task id no other test run uses at the same time.
fn unique(name: &str) -> String {
    format!("rt-{name}-{}", std::process::id())
}

fn log_has(path: &Path, needle: &str) -> bool {
    std::fs::read_to_string(path).is_ok_and(|t| t.contains(needle))
}

async fn container_exists(rt: &DockerRuntime, name: &str) -> bool {
    match rt.client().unwrap().inspect_container(name, None).await {
        Ok(_) => true,
        Err(e) if is_not_found(&e) => false,
        Err(e) => panic!("inspect {name}: {e}"),
    }
}

fn cdi_dev(name: &str, dir: &str) -> crate::cdi::CdiDevice {
    crate::cdi::CdiDevice {
        name: name.into(),
        spec_dir: dir.into(),
    }
}

#[test]
fn api_versions_compare_by_number() {
    for (v, want) in [
        ("1.44", true),
        ("1.47", true),
        ("1.100", true),
        ("2.0", true),
        ("1.43", false),
        ("1.41", false),
        ("1.4", false),
        ("", false),
        ("1", false),
        ("one.44", false),
    ] {
        assert_eq!(api_at_least(v, CDI_MIN_API), want, "{v:?}");
    }
}

#[test]
fn gpus_go_through_cdi_only_when_the_daemon_reads_their_specs() {
    let run = cdi_dev("gpuctl.io/gpu=GPU-a", "/run/cdi");
    let etc = cdi_dev("nvidia.com/gpu=GPU-b", "/etc/cdi");
    let daemon = |api: &str, dirs: &[&str]| DaemonCdi {
        api_version: api.into(),
        spec_dirs: dirs.iter().map(PathBuf::from).collect(),
    };
    let both = daemon("1.47", &["/etc/cdi", "/run/cdi"]);
    let r = cdi_device_request(&both, &[run.clone(), etc.clone()]).unwrap();
    assert_eq!(
        r,
        DeviceRequest {
            driver: Some("cdi".into()),
            device_ids: Some(vec![
                "gpuctl.io/gpu=GPU-a".into(),
                "nvidia.com/gpu=GPU-b".into()
            ]),
            count: None,
            capabilities: None,
            options: None,
        }
    );
    for (what, d, devices, words) in [
        (
            "Docker 20.10",
            daemon("1.41", &["/etc/cdi", "/run/cdi"]),
            vec![run.clone()],
            "1.41",
        ),
        (
            "Docker 24",
            daemon("1.43", &[]),
            vec![run.clone()],
            "older than 1.44",
        ),
        (
            "CDI off",
            daemon("1.47", &[]),
            vec![run.clone()],
            "not enabled",
        ),
        (
            "a directory it does not read",
            daemon("1.47", &["/etc/cdi"]),
            vec![etc.clone(), run.clone()],
            "/run/cdi",
        ),
        ("no names", both.clone(), vec![], "no CDI names"),
    ] {
        let why = cdi_device_request(&d, &devices).unwrap_err();
        assert!(why.contains(words), "{what}: {why}");
    }
}

fn gpu_launch(dir: &Path, cdi: Vec<crate::cdi::CdiDevice>) -> LaunchSpec {
    use crate::isolation::DeviceNode;
    let node = |name: &str, major, minor| DeviceNode {
        host_path: dir.join(name),
        container_path: format!("/dev/{name}"),
        major,
        minor,
    };
    let mut s = spec(dir, "t-gpu", "img", &["true"]);
    s.task.gpu_uuids = vec!["GPU-a".into()];
    s.isolation = crate::runtime::TaskIsolation {
        devices: vec![
            node("nvidia1", 195, 1),
            node("nvidiactl", 195, 255),
            node("nvidia-uvm", 240, 0),
        ],
        cgroup_parent: Some("/gpuctl/a1/t-gpu".into()),
        driver_volume: Some(dir.join("volumes/nvidia_535.129.03")),
        gpu_task: true,
        cdi_devices: cdi,
        ..Default::default()
    };
    s
}

fn device_paths(c: &Config<String>) -> Vec<String> {
    c.host_config
        .as_ref()
        .and_then(|h| h.devices.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|d| d.path_in_container.clone())
        .collect()
}

#[test]
fn without_cdi_the_container_config_is_the_device_one() {
    let dir = Path::new("/tmp/t");
    let s = gpu_launch(dir, vec![cdi_dev("gpuctl.io/gpu=GPU-a", "/run/cdi")]);
    let c = container_config(
        &s,
        "img",
        &ImageFacts::default(),
        CgroupDriver::Cgroupfs,
        None,
    );
    assert_eq!(
        device_paths(&c),
        ["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    );
    let h = c.host_config.as_ref().unwrap();
    assert_eq!(h.device_requests, None, "nothing Docker 20.10 has not seen");
    assert_eq!(h.cgroup_parent.as_deref(), Some("/gpuctl/a1/t-gpu"));
    assert_eq!(
        h.binds.as_deref().unwrap(),
        ["/tmp/t/volumes/nvidia_535.129.03:/usr/local/nvidia:ro"]
    );
}

#[test]
fn a_capped_fraction_is_created_with_the_cap_runtime_and_others_with_the_default() {
    let dir = Path::new("/tmp/t");
    let mut s = gpu_launch(dir, Vec::new());
    let config = |s: &LaunchSpec| {
        container_config(
            s,
            "img",
            &ImageFacts::default(),
            CgroupDriver::Cgroupfs,
            None,
        )
    };
    assert_eq!(config(&s).host_config.unwrap().runtime, None);
    s.isolation.oci_runtime = Some("gpuctl".into());
    assert_eq!(
        config(&s).host_config.unwrap().runtime.as_deref(),
        Some("gpuctl")
    );
    let facts = CapFacts {
        runtimes: vec!["gpuctl".into(), "runc".into()],
    };
    assert_eq!(facts.check("gpuctl"), Ok(()));
    let e = facts.check("other").unwrap_err();
    assert!(e.contains("--add-runtime other="), "{e}");
}

#[test]
fn with_cdi_the_gpus_come_from_the_request_and_the_rest_stays() {
    let dir = Path::new("/tmp/t");
    let s = gpu_launch(dir, vec![cdi_dev("gpuctl.io/gpu=GPU-a", "/run/cdi")]);
    let daemon = DaemonCdi {
        api_version: "1.47".into(),
        spec_dirs: vec!["/etc/cdi".into(), "/run/cdi".into()],
    };
    let r = cdi_device_request(&daemon, &s.isolation.cdi_devices).unwrap();
    let facts = ImageFacts {
        path: Some("/opt/conda/bin:/usr/bin:/bin".into()),
        ..Default::default()
    };
    let with = container_config(&s, "img", &facts, CgroupDriver::Cgroupfs, Some(&r));
    let without = container_config(&s, "img", &facts, CgroupDriver::Cgroupfs, None);
    // The GPU's node is the request's; control nodes are passed too.
    assert_eq!(device_paths(&with), ["/dev/nvidiactl", "/dev/nvidia-uvm"]);
    let h = with.host_config.as_ref().unwrap();
    assert_eq!(h.device_requests.as_deref(), Some(&[r][..]));
    // Everything else is as without CDI: the cgroup parent, the volume
    // (a bind at the spec's mount point replaces the spec's mount), the
    // image-aware PATH, the capabilities.
    let w = without.host_config.as_ref().unwrap();
    assert_eq!(h.cgroup_parent, w.cgroup_parent);
    assert_eq!(h.binds, w.binds);
    assert_eq!(
        (&h.cap_add, &h.cap_drop, &h.security_opt),
        (&w.cap_add, &w.cap_drop, &w.security_opt)
    );
    assert_eq!(with.env, without.env);
    assert!(with
        .env
        .as_ref()
        .unwrap()
        .contains(&"PATH=/usr/local/nvidia/bin:/opt/conda/bin:/usr/bin:/bin".to_string()));
    assert!(
        is_cdi_device_node("/dev/nvidia12")
            && is_cdi_device_node("/dev/nvidia-caps/nvidia-cap30")
            && !is_cdi_device_node("/dev/nvidiactl")
            && !is_cdi_device_node("/dev/nvidia")
            && !is_cdi_device_node("/dev/nvidia-caps/nvidia-cap")
            && !is_cdi_device_node("/dev/nvidia-uvm")
    );
}

#[test]
fn a_mig_container_gets_its_parent_and_caps_by_device_or_by_cdi() {
    use crate::isolation::DeviceNode;
    let dir = Path::new("/tmp/t");
    let mut s = gpu_launch(dir, vec![cdi_dev("gpuctl.io/gpu=MIG-a", "/run/cdi")]);
    s.task.gpu_uuids = vec!["MIG-a".into()];
    let cap = |n: u32| DeviceNode {
        host_path: dir.join(format!("nvidia-caps/nvidia-cap{n}")),
        container_path: format!("/dev/nvidia-caps/nvidia-cap{n}"),
        major: 240,
        minor: n,
    };
    s.isolation.devices.insert(1, cap(30));
    s.isolation.devices.insert(2, cap(31));
    let without = container_config(
        &s,
        "img",
        &ImageFacts::default(),
        CgroupDriver::Cgroupfs,
        None,
    );
    assert_eq!(
        device_paths(&without),
        [
            "/dev/nvidia1",
            "/dev/nvidia-caps/nvidia-cap30",
            "/dev/nvidia-caps/nvidia-cap31",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm"
        ]
    );
    let daemon = DaemonCdi {
        api_version: "1.47".into(),
        spec_dirs: vec!["/run/cdi".into()],
    };
    let r = cdi_device_request(&daemon, &s.isolation.cdi_devices).unwrap();
    assert_eq!(
        r.device_ids.as_deref(),
        Some(&["gpuctl.io/gpu=MIG-a".to_string()][..])
    );
    let with = container_config(
        &s,
        "img",
        &ImageFacts::default(),
        CgroupDriver::Cgroupfs,
        Some(&r),
    );
    // The parent and the caps are the CDI device's.
    assert_eq!(device_paths(&with), ["/dev/nvidiactl", "/dev/nvidia-uvm"]);
}

#[test]
fn references_are_split_for_pulls() {
    assert_eq!(split_reference("busybox"), ("busybox", "latest"));
    assert_eq!(split_reference("busybox:1.36"), ("busybox", "1.36"));
    assert_eq!(
        split_reference("localhost:5000/team/img"),
        ("localhost:5000/team/img", "latest")
    );
    assert_eq!(
        split_reference("localhost:5000/team/img:v2"),
        ("localhost:5000/team/img", "v2")
    );
    assert_eq!(split_reference("img@sha256:abc"), ("img@sha256:abc", ""));
}

/// Starts the task, follows it to its end, removes the container.
async fn run_to_end(rt: &DockerRuntime, s: &LaunchSpec) -> Result<Ended, RuntimeError> {
    let t = s.task_ref();
    rt.start(s).await?;
    let ended = rt.wait(&t).await?;
    rt.remove(&t).await?;
    Ok(ended)
}

fn exited(code: i32) -> Ended {
    Ended {
        code: Some(code),
        ..Default::default()
    }
}

#[test]
fn docker_timestamps_convert_to_seconds() {
    // 2024-05-01T12:34:56Z is 1714566896.
    assert_eq!(timestamp_secs("2024-05-01T12:34:56Z"), Some(1_714_566_896));
    assert_eq!(
        timestamp_secs("2024-05-01T12:34:56.123456789Z"),
        Some(1_714_566_896)
    );
    assert_eq!(
        timestamp_secs("2024-03-01T00:00:00.5Z"),
        Some(1_709_251_200)
    );
    assert_eq!(timestamp_secs("garbage"), None);
    assert_eq!(timestamp_secs("2024-05-01T12:34:56.1234567890Z"), None);
    assert_eq!(timestamp_secs("2024-05-01T12:34:56.12a4Z"), None);
}

/// Docker's answer to `logs --since S`: the lines stamped S or later, in
/// the order they were written.
fn answer(file: &[(i64, u32)], since: i64) -> Vec<(i64, u32)> {
    file.iter().copied().filter(|(t, _)| *t >= since).collect()
}

/// Copies `lines` of one answer from `start`; what was copied and the
/// cursor after each line.
fn copy(start: LogCursor, lines: &[(i64, u32)]) -> (Vec<u32>, Vec<LogCursor>) {
    let mut p = LogProgress::new(start);
    let mut copied = Vec::new();
    let mut cursors = Vec::new();
    for (t, id) in lines {
        if p.line(Some(*t)) {
            copied.push(*id);
        }
        cursors.push(p.cursor());
    }
    (copied, cursors)
}

#[test]
fn a_line_stamped_before_one_written_ahead_of_it_is_copied() {
    // stderr stamped 11 but written before stdout stamped 10 (seen in CI:
    // the stdout line was dropped by a cursor of timestamps).
    let file = [(10, 1), (11, 3), (10, 2), (12, 4)];
    let (copied, _) = copy(LogCursor::default(), &answer(&file, 0));
    assert_eq!(copied, vec![1, 3, 2, 4]);
}

#[test]
fn a_copy_resumed_anywhere_copies_every_line_once() {
    // Seconds out of order by up to the slack, runs of one second, and
    // a long gap that moves the cursor on.
    let file: Vec<(i64, u32)> = [
        100, 100, 101, 100, 102, 101, 103, 103, 105, 104, 104, 200, 199, 200, 201, 199, 202, 202,
    ]
    .into_iter()
    .zip(1..)
    .collect();
    let all: Vec<u32> = file.iter().map(|(_, id)| *id).collect();
    // Crash after k lines, resume (possibly crashing again after j more).
    for k in 0..=file.len() {
        let (first, cursors) = copy(LogCursor::default(), &answer(&file, 0)[..k]);
        let c = cursors.last().cloned().unwrap_or_default();
        let rest = answer(&file, c.since);
        assert!(c.skip as usize <= rest.len(), "k={k} {c:?}");
        for j in 0..=rest.len() {
            let (second, cursors2) = copy(c.clone(), &rest[..j]);
            let c2 = cursors2.last().cloned().unwrap_or(c.clone());
            let (third, _) = copy(c2.clone(), &answer(&file, c2.since));
            let mut got = first.clone();
            got.extend(&second);
            got.extend(&third);
            assert_eq!(got, all, "k={k} j={j} cursors {c:?} {c2:?}");
        }
    }
    // The cursor moves on: after the whole file it starts near the end.
    let (_, cursors) = copy(LogCursor::default(), &file);
    let last = cursors.last().unwrap();
    assert_eq!(last.since, 200);
    assert_eq!(last.skip, 5);
}

#[tokio::test]
async fn docker_exit_code_and_output() {
    let Some(rt) = connect_or_skip("docker_exit_code_and_output").await else {
        return;
    };
    let image = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let task_id = unique("exit7");
    let s = spec(
        dir.path(),
        &task_id,
        &image,
        &[
            "sh",
            "-c",
            "echo out; echo err >&2; echo id=$GPUCTL_TASK_ID; exit 7",
        ],
    );
    let log = s.log_path.clone();
    assert_eq!(run_to_end(&rt, &s).await.unwrap(), exited(7));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("out\n"), "{text}");
    assert!(text.contains("err\n"), "{text}");
    assert!(text.contains(&format!("id={task_id}")), "{text}");
    assert!(!container_exists(&rt, &container_name(&format!("agent-{task_id}"), &task_id)).await);
}

#[tokio::test]
async fn docker_exit_zero() {
    let Some(rt) = connect_or_skip("docker_exit_zero").await else {
        return;
    };
    let image = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let s = spec(dir.path(), &unique("exit0"), &image, &["true"]);
    assert_eq!(run_to_end(&rt, &s).await.unwrap(), exited(0));
}

#[tokio::test]
async fn docker_stop_labels_and_removal() {
    let Some(rt) = connect_or_skip("docker_stop_labels_and_removal").await else {
        return;
    };
    let image = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let task_id = unique("kill");
    let s = spec(dir.path(), &task_id, &image, &["sleep", "300"]);
    let grace = s.kill_grace;
    let name = container_name(&format!("agent-{task_id}"), &task_id);
    let t = s.task_ref();
    rt.start(&s).await.unwrap();
    assert_eq!(rt.observe(&t).await.unwrap(), Observed::Running);
    assert_eq!(rt.list(&s.agent_id).await.unwrap(), vec![task_id.clone()]);

    let info = rt
        .client()
        .unwrap()
        .inspect_container(&name, None)
        .await
        .unwrap();
    let labels = info.config.and_then(|c| c.labels).unwrap();
    assert_eq!(labels.get(LABEL_TASK_ID), Some(&task_id));
    assert_eq!(labels.get(LABEL_JOB_ID), Some(&format!("job-{task_id}")));
    assert_eq!(
        labels.get(LABEL_AGENT_ID),
        Some(&format!("agent-{task_id}"))
    );
    let host = info.host_config.unwrap();
    assert_eq!(host.network_mode.as_deref(), Some("host"));
    assert_eq!(host.memory, Some(64 * 1024 * 1024));
    assert_eq!(host.nano_cpus, Some(500_000_000));
    assert_eq!(info.state.and_then(|s| s.running), Some(true));

    let started = Instant::now();
    rt.stop(&t, grace).await.unwrap();
    let ended = rt.wait(&t).await.unwrap();
    // `sleep` as a child of docker-init dies of the SIGTERM.
    assert_eq!(ended.code, Some(143), "{ended:?}");
    assert!(
        started.elapsed() < grace,
        "stop took {:?}, grace {grace:?}",
        started.elapsed()
    );
    assert!(matches!(rt.observe(&t).await.unwrap(), Observed::Ended(_)));
    rt.remove(&t).await.unwrap();
    assert!(!container_exists(&rt, &name).await);
    assert_eq!(rt.observe(&t).await.unwrap(), Observed::NotStarted);
}

/// A task is started at most once, whoever asks: a second start of a
/// running or ended task changes nothing.
#[tokio::test]
async fn docker_start_is_idempotent() {
    let Some(rt) = connect_or_skip("docker_start_is_idempotent").await else {
        return;
    };
    let image = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let task_id = unique("once");
    let s = spec(dir.path(), &task_id, &image, &["sh", "-c", "echo ran-once"]);
    let t = s.task_ref();
    rt.start(&s).await.unwrap();
    assert_eq!(rt.wait(&t).await.unwrap(), exited(0));
    rt.start(&s).await.unwrap();
    assert_eq!(rt.wait(&t).await.unwrap(), exited(0));
    let text = std::fs::read_to_string(&s.log_path).unwrap();
    assert_eq!(text.matches("ran-once").count(), 1, "{text}");
    rt.remove(&t).await.unwrap();
}

/// What a restarted agent does: a new runtime value finds the running
/// container by name, follows it to its end and copies each line of its
/// output exactly once, though an earlier copy already wrote some.
#[tokio::test]
async fn docker_reattach_copies_each_line_once() {
    let Some(rt) = connect_or_skip("docker_reattach_copies_each_line_once").await else {
        return;
    };
    let image = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let task_id = unique("reattach");
    let s = spec(
        dir.path(),
        &task_id,
        &image,
        &[
            "sh",
            "-c",
            "for i in 1 2 3 4 5 6; do echo line-$i; sleep 0.4; done; exit 4",
        ],
    );
    let t = s.task_ref();
    rt.start(&s).await.unwrap();
    // The first agent copies part of the output, then dies.
    let first = tokio::spawn({
        let rt = rt.clone();
        let t = t.clone();
        async move { rt.wait(&t).await }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !log_has(&s.log_path, "line-2") {
        assert!(Instant::now() < deadline, "no output copied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.abort();
    let _ = first.await;
    // The next one takes over.
    let rt2 = DockerRuntime::connect().await.unwrap();
    assert_eq!(rt2.observe(&t).await.unwrap(), Observed::Running);
    assert_eq!(rt2.wait(&t).await.unwrap(), exited(4));
    let text = std::fs::read_to_string(&s.log_path).unwrap();
    for i in 1..=6 {
        assert_eq!(
            text.matches(&format!("line-{i}\n")).count(),
            1,
            "line-{i} in {text:?}"
        );
    }
    rt2.remove(&t).await.unwrap();
}

/// With `init: true` the container does start (the init is its process);
/// the init then fails to exec the command and exits 127, like a shell.
#[tokio::test]
async fn docker_missing_command_exits_127() {
    let Some(rt) = connect_or_skip("docker_missing_command_exits_127").await else {
        return;
    };
    let image = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let task_id = unique("nocmd");
    let s = spec(dir.path(), &task_id, &image, &["/no/such/program"]);
    let log = s.log_path.clone();
    assert_eq!(run_to_end(&rt, &s).await.unwrap(), exited(127));
    assert!(
        log_has(&log, "/no/such/program"),
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
}

#[tokio::test]
async fn docker_missing_image_is_image_error() {
    let Some(rt) = connect_or_skip("docker_missing_image_is_image_error").await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let image = "gpuctl/no-such-image-for-tests:never";
    let s = spec(dir.path(), &unique("noimage"), image, &["true"]);
    match rt.start(&s).await {
        Err(RuntimeError::Image { image: got, .. }) => assert_eq!(got, image),
        other => panic!("expected an Image error, got {other:?}"),
    }
    assert_eq!(
        rt.observe(&s.task_ref()).await.unwrap(),
        Observed::NotStarted
    );
}

/// What a container may do is ours, whatever its image: not privileged,
/// only the default capabilities, no new privileges, the job's user,
/// and no host path but the mounts the agent allowed, read-only unless
/// asked otherwise.
#[tokio::test]
async fn docker_gpu_task_with_cdi_names_falls_back_to_devices_here() {
    // The daemon's answers are read for real; its CDI registry does not
    // read the (temporary) spec directory named here, so on any Docker
    // (20.10 here: API 1.41) the GPU goes with --device, as before CDI.
    let Some(rt) =
        connect_or_skip("docker_gpu_task_with_cdi_names_falls_back_to_devices_here").await
    else {
        return;
    };
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipped: mknod needs root");
        return;
    }
    let daemon = rt.daemon_cdi().await.unwrap();
    assert!(api_at_least(&daemon.api_version, (1, 24)), "{daemon:?}");
    let image = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let dev = dir.path().join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    for (name, minor) in [("nvidia1", 1), ("nvidiactl", 255)] {
        nix::sys::stat::mknod(
            &dev.join(name),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
            nix::sys::stat::makedev(195, minor),
        )
        .unwrap();
    }
    let mut s = gpu_launch(
        &dev,
        vec![cdi_dev(
            "gpuctl.io/gpu=GPU-a",
            dir.path().join("cdi").to_str().unwrap(),
        )],
    );
    s.isolation.devices.truncate(2);
    s.isolation.cgroup_parent = None;
    s.isolation.driver_volume = None;
    s.task.task_id = unique("cdi-fallback");
    s.task.template.image = Some(image.clone());
    s.task.template.command = ["sh", "-c", "ls /dev; cat /dev/nvidia1"]
        .iter()
        .map(|a| a.to_string())
        .collect();
    s.sandbox = dir.path().to_path_buf();
    s.state_dir = dir.path().to_path_buf();
    s.log_path = dir.path().join("task.log");
    let host = run_and_inspect(&rt, &s, exited(1)).await;
    assert!(
        host.device_requests.unwrap_or_default().is_empty(),
        "no CDI request"
    );
    let devices: Vec<String> = host
        .devices
        .unwrap_or_default()
        .into_iter()
        .filter_map(|d| d.path_in_container)
        .collect();
    assert_eq!(devices, ["/dev/nvidia1", "/dev/nvidiactl"]);
    let text = std::fs::read_to_string(&s.log_path).unwrap();
    assert!(text.contains("nvidia1\n"), "{text}");
    assert!(text.contains("No such device or address"), "{text}");
    let way = rt.gpu_path.lock().unwrap().clone().unwrap();
    assert!(way.starts_with("--device, not CDI: "), "{way}");
}

#[tokio::test]
async fn docker_containers_get_no_more_than_the_default_set() {
    use crate::security::{BindMount, CONTAINER_CAPABILITIES};
    let Some(rt) = connect_or_skip("docker_containers_get_no_more_than_the_default_set").await
    else {
        return;
    };
    let image = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (ro, rw) = (dir.path().join("ro"), dir.path().join("rw"));
    std::fs::create_dir_all(&ro).unwrap();
    std::fs::create_dir_all(&rw).unwrap();
    std::fs::write(ro.join("f"), "from-the-host\n").unwrap();
    let script = "grep -E '^(CapEff|NoNewPrivs):' /proc/self/status; id -u; id -g; \
             cat /in/f; touch /in/x 2>/dev/null && echo ro-written || echo ro-refused; \
             touch /out/x 2>/dev/null && echo rw-written || echo rw-refused";
    let mounts = vec![
        BindMount {
            host_path: ro.clone(),
            container_path: "/in".into(),
            read_only: true,
        },
        BindMount {
            host_path: rw.clone(),
            container_path: "/out".into(),
            read_only: false,
        },
    ];
    let run = |name: &str, user: Option<UserIds>| {
        let mut s = spec(dir.path(), &unique(name), &image, &["sh", "-c", script]);
        s.log_path = dir.path().join(format!("{name}.log"));
        s.security = crate::security::LaunchSecurity {
            user,
            mounts: mounts.clone(),
            ..Default::default()
        };
        s
    };
    // The image's user (root in the container).
    let s = run("caps", None);
    let host = run_and_inspect(&rt, &s, exited(0)).await;
    assert_eq!(host.privileged, Some(false));
    assert_eq!(host.cap_drop, Some(vec!["ALL".to_string()]));
    let caps: Vec<String> = CONTAINER_CAPABILITIES
        .iter()
        .map(|c| c.to_string())
        .collect();
    assert_eq!(host.cap_add, Some(caps));
    assert_eq!(
        host.security_opt,
        Some(vec!["no-new-privileges".to_string()])
    );
    assert_eq!(
        host.binds,
        Some(vec![
            format!("{}:/in:ro", ro.display()),
            format!("{}:/out:rw", rw.display())
        ])
    );
    let text = std::fs::read_to_string(&s.log_path).unwrap();
    // CHOWN 0, DAC_OVERRIDE 1, FOWNER 3, FSETID 4, KILL 5, SETGID 6,
    // SETUID 7, SETPCAP 8, SYS_CHROOT 18.
    assert!(text.contains("CapEff:\t00000000000401fb\n"), "{text}");
    assert!(text.contains("NoNewPrivs:\t1\n"), "{text}");
    assert!(text.contains("0\n0\nfrom-the-host\n"), "{text}");
    assert!(text.contains("ro-refused\n"), "{text}");
    assert!(text.contains("rw-written\n"), "{text}");
    assert!(!ro.join("x").exists());

    // A user of the job's: no capability in effect.
    let s = run(
        "user",
        Some(UserIds {
            uid: 1234,
            gid: 1234,
        }),
    );
    assert_eq!(run_to_end(&rt, &s).await.unwrap(), exited(0));
    let text = std::fs::read_to_string(&s.log_path).unwrap();
    assert!(text.contains("CapEff:\t0000000000000000\n"), "{text}");
    assert!(text.contains("1234\n1234\nfrom-the-host\n"), "{text}");
    assert!(text.contains("ro-refused\n"), "{text}");
    // /out is root's: the job's user may not write it. (Its stderr is
    // silenced: Docker may order another stream's lines before it.)
    assert!(text.contains("rw-refused\n"), "{text}");
}

/// A job's user runs with its group and no other, whatever the image's
/// `/etc/group` says of it: Docker adds an image's supplementary groups
/// only for a user given without a group, and the agent always gives
/// both (`UID` is `UID:UID`).
#[tokio::test]
async fn docker_a_jobs_user_gets_no_groups_from_its_image() {
    let Some(rt) = connect_or_skip("docker_a_jobs_user_gets_no_groups_from_its_image").await else {
        return;
    };
    let base = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
    let image = "gpuctl-test/image-groups:1";
    build_image(
        &base,
        image,
        &[
            "RUN echo 'alice:x:2001:2001::/:/bin/sh' >> /etc/passwd && \\",
            "    echo 'alice:x:2001:' >> /etc/group && \\",
            "    echo 'shadow:x:42:alice' >> /etc/group && echo 'disk:x:6:alice' >> /etc/group",
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let mut s = spec(
        dir.path(),
        &unique("groups"),
        image,
        &["sh", "-c", "id -u; id -G"],
    );
    s.security.user = Some(UserIds {
        uid: 2001,
        gid: 2001,
    });
    assert_eq!(run_to_end(&rt, &s).await.unwrap(), exited(0));
    let text = std::fs::read_to_string(&s.log_path).unwrap();
    assert_eq!(text, "2001\n2001\n");
}

/// What an image's config says of the driver, as bollard reads it.
fn inspect(env: &[&str], labels: &[(&str, &str)]) -> bollard::models::ImageInspect {
    bollard::models::ImageInspect {
        config: Some(bollard::models::ImageConfig {
            env: Some(env.iter().map(|e| e.to_string()).collect()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        }),
        ..Default::default()
    }
}

const REQUIRE_12_2: &str =
        "NVIDIA_REQUIRE_CUDA=cuda>=12.2 brand=tesla,driver>=470,driver<471 brand=tesla,driver>=525,driver<526";

fn host(driver: &str, cuda: &str) -> HostDriver {
    HostDriver {
        version: Some(driver.into()),
        cuda: Some(cuda.into()),
    }
}

#[test]
fn the_host_driver_is_checked_against_the_image_requirements() {
    let facts = ImageFacts::from(&inspect(
        &[
            "PATH=/usr/bin",
            REQUIRE_12_2,
            "NVIDIA_REQUIRE_ARCH=arch>=7.0",
        ],
        &[("com.nvidia.volumes.needed", "nvidia_driver")],
    ));
    assert!(facts.wants_driver_volume);
    let img = "cuda:12.2";
    let none = BTreeMap::new();
    assert_eq!(
        check_driver(img, &facts, &none, &host("535.129.03", "12.2")).map_err(|e| e.to_string()),
        Ok(())
    );
    // Forward compatibility: the 525 branch (brand unknown here).
    assert!(check_driver(img, &facts, &none, &host("525.60.13", "12.0")).is_ok());
    // Unknown versions (simulated GPUs, no NVML): nothing to check.
    assert!(check_driver(img, &facts, &none, &HostDriver::default()).is_ok());
    match check_driver(img, &facts, &none, &host("510.47.03", "11.6")) {
        Err(RuntimeError::DriverRequirement {
            image,
            unmet,
            host,
            requires,
        }) => {
            assert_eq!(image, img);
            assert_eq!(unmet, "NVIDIA_REQUIRE_CUDA=cuda>=12.2 (+2 alternatives)");
            assert_eq!(host, "driver 510.47.03, CUDA 11.6");
            // All of them, in full: the master learns what the image needs.
            assert_eq!(
                requires,
                [
                    "arch>=7.0",
                    REQUIRE_12_2.trim_start_matches("NVIDIA_REQUIRE_CUDA=")
                ]
            );
        }
        other => panic!("{other:?}"),
    }
    let e = check_driver(img, &facts, &none, &host("510.47.03", "11.6")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "image cuda:12.2 requires NVIDIA_REQUIRE_CUDA=cuda>=12.2 (+2 alternatives) of the \
             NVIDIA driver; this agent has driver 510.47.03, CUDA 11.6"
    );
    // Disabled, as NVIDIA's toolkit allows.
    let off = ImageFacts::from(&inspect(
        &[REQUIRE_12_2, "NVIDIA_DISABLE_REQUIRE=true"],
        &[],
    ));
    assert!(check_driver(img, &off, &none, &host("450.80.02", "11.0")).is_ok());
    // Malformed: refused with the variable named, whatever the driver.
    let bad = ImageFacts::from(&inspect(&["NVIDIA_REQUIRE_CUDA=cuda>=12.2,drivr>=1"], &[]));
    match check_driver(img, &bad, &none, &host("535.129.03", "12.2")) {
        Err(RuntimeError::Image { reason, .. }) => {
            assert!(
                reason.contains("NVIDIA_REQUIRE_CUDA: \"drivr>=1\": unknown key"),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
    // The task's environment overrides the image's, as `docker run -e`.
    let old = host("450.80.02", "11.0");
    let env = |k: &str, v: &str| BTreeMap::from([(k.to_string(), v.to_string())]);
    assert!(check_driver(img, &facts, &env("NVIDIA_DISABLE_REQUIRE", "1"), &old).is_ok());
    assert!(check_driver(img, &facts, &env("NVIDIA_REQUIRE_CUDA", "cuda>=11.0"), &old).is_ok());
    assert!(check_driver(
        img,
        &ImageFacts::default(),
        &env("NVIDIA_REQUIRE_X", "driver>=535"),
        &old
    )
    .is_err());
    // No image config at all: nothing required.
    let empty = ImageFacts::from(&bollard::models::ImageInspect::default());
    assert_eq!(empty, ImageFacts::default());
    assert!(check_driver(img, &empty, &none, &old).is_ok());
}

/// `docker build` of a local image from `base` with these Dockerfile
/// lines (no registry: the base is the local busybox).
fn build_image(base: &str, tag: &str, lines: &[&str]) {
    use std::io::Write;
    let dockerfile = format!("FROM {base}\n{}\n", lines.join("\n"));
    let mut build = std::process::Command::new("docker")
        .args(["build", "-q", "-t", tag, "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    build
        .stdin
        .take()
        .unwrap()
        .write_all(dockerfile.as_bytes())
        .unwrap();
    assert!(build.wait().unwrap().success(), "docker build of {tag}");
}

/// A container that gets the driver (it holds GPUs, or its image asks
/// for the volume) is refused before it is made when the host's driver
/// does not meet the image's NVIDIA_REQUIRE_CUDA; others are not
/// checked. An image with the volume label and a requirement it meets
/// gets the volume.
#[tokio::test]
async fn docker_refuses_an_image_the_driver_is_too_old_for() {
    let Some(rt) = connect_or_skip("docker_refuses_an_image_the_driver_is_too_old_for").await
    else {
        return;
    };
    let base = ensure_busybox_image(&rt.client().unwrap()).await.unwrap();
    let plain = "gpuctl-test/cuda-require:12.2";
    let labelled = "gpuctl-test/cuda-require-volume:12.2";
    let env = format!("ENV {}", REQUIRE_12_2.replacen('=', "=\"", 1) + "\"");
    build_image(&base, plain, &[&env]);
    build_image(
        &base,
        labelled,
        &[&env, "LABEL com.nvidia.volumes.needed=nvidia_driver"],
    );
    let dir = tempfile::tempdir().unwrap();
    let volume = dir.path().join("nvidia_535.129.03");
    std::fs::create_dir_all(volume.join("lib64")).unwrap();
    std::fs::write(volume.join("lib64/libnvidia-ml.so.1"), "").unwrap();
    let launch = |name: &str, image: &str, gpu_task: bool, driver: HostDriver| {
        let mut s = spec(
            dir.path(),
            &unique(name),
            image,
            &["sh", "-c", "ls /usr/local/nvidia/lib64 2>&1; echo done"],
        );
        s.log_path = dir.path().join(format!("{name}.log"));
        s.isolation.gpu_task = gpu_task;
        s.isolation.driver = driver;
        s.isolation.driver_volume = Some(volume.clone());
        s
    };
    let old = || host("510.47.03", "11.6");
    // A GPU task on an old driver: refused, no container made.
    let s = launch("gpu-old", plain, true, old());
    match rt.start(&s).await {
        Err(RuntimeError::DriverRequirement { requires, .. }) => {
            assert_eq!(requires.len(), 1);
            assert!(requires[0].starts_with("cuda>=12.2 "), "{requires:?}");
        }
        other => panic!("expected a DriverRequirement refusal, got {other:?}"),
    }
    let name = container_name(&s.agent_id, &s.task.task_id);
    assert!(!container_exists(&rt, &name).await);
    assert_eq!(
        rt.observe(&s.task_ref()).await.unwrap(),
        Observed::NotStarted
    );
    // The label alone gets the driver too: checked, refused.
    let s = launch("label-old", labelled, false, old());
    assert!(matches!(
        rt.start(&s).await,
        Err(RuntimeError::DriverRequirement { .. })
    ));
    // No GPU, no label: NVIDIA's hook would not touch it; neither do we.
    let s = launch("cpu-old", plain, false, old());
    assert_eq!(run_to_end(&rt, &s).await.unwrap(), exited(0));
    let text = std::fs::read_to_string(&s.log_path).unwrap();
    assert!(!text.contains("libnvidia-ml.so.1"), "{text}");
    // A new enough driver: the labelled image runs with the volume.
    let s = launch("label-new", labelled, false, host("535.129.03", "12.2"));
    assert_eq!(run_to_end(&rt, &s).await.unwrap(), exited(0));
    let text = std::fs::read_to_string(&s.log_path).unwrap();
    assert!(text.contains("libnvidia-ml.so.1\ndone"), "{text}");
}

/// A daemon that does not answer is an outage, not a task failure.
#[tokio::test]
async fn docker_unreachable_daemon_is_unavailable() {
    let rt = DockerRuntime::with_socket("unix:///nonexistent/gpuctl-test.sock".into()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let s = spec(dir.path(), &unique("down"), "busybox", &["true"]);
    let err = rt.observe(&s.task_ref()).await.unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
    assert!(!rt.status().available);
    assert!(rt.start(&s).await.unwrap_err().is_unavailable());
}
