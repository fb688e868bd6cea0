//! MIG isolation enforced by the real kernel, on cgroup v1 (this machine's
//! devices hierarchy), v2 (a cgroup2 mounted beside it, the task's eBPF
//! device program) and in Docker containers. Fake nodes made with mknod:
//! two GPUs (195:0, 195:1), nvidiactl, and the caps nodes of MIG (major
//! 240): the driver's mig-config and mig-monitor caps (1, 2) and two MIG
//! devices of GPU 0, caps 30+31 and 39+40. The tasks' cgroups are made by
//! `CgroupIsolator::prepare` from the UUIDs, as the executor makes them; a shell
//! that joins one opens each node: ENXIO is allowed (no driver behind the
//! node), EPERM denied. Needs root (and Docker for the container tests);
//! skipped without unless GPUCTL_REQUIRE_DOCKER=1.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use gpuctl_agent::isolation::grants::{device_grants, resolve};
use gpuctl_agent::isolation::probe::{check, probe};
use gpuctl_agent::isolation::{
    detect_version, CgroupIsolator, CgroupVersion, Isolator, TaskDevices,
};
use gpuctl_agent::runtime::{ContainerRuntime, DockerRuntime, LaunchSpec, TaskIsolation};
use gpuctl_core::types::{GpuInfo, MigDevice, MigInfo, Resources, Runtime, TaskSpec};

const CAPS_MAJOR: u32 = 240;
const ALLOWED: &str = "No such device or address";
const DENIED: &str = "Operation not permitted";

fn required() -> bool {
    std::env::var("GPUCTL_REQUIRE_DOCKER").is_ok_and(|v| v == "1")
}

fn root_or_skip() -> bool {
    if nix::unistd::Uid::effective().is_root() {
        return true;
    }
    assert!(!required(), "needs root (GPUCTL_REQUIRE_DOCKER=1)");
    eprintln!("skipped: needs root");
    false
}

fn mknod(path: &Path, major: u32, minor: u32) {
    let ok = Command::new("mknod")
        .arg(path)
        .args(["c", &major.to_string(), &minor.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "mknod {}", path.display());
    Command::new("chmod").arg("666").arg(path).status().unwrap();
}

/// The fake dev root; its nodes, by name relative to it.
fn make_dev(dir: &Path) -> Vec<&'static str> {
    std::fs::create_dir_all(dir.join("nvidia-caps")).unwrap();
    mknod(&dir.join("nvidia0"), 195, 0);
    mknod(&dir.join("nvidia1"), 195, 1);
    mknod(&dir.join("nvidiactl"), 195, 255);
    for n in [1, 2, 30, 31, 39, 40] {
        mknod(
            &dir.join(format!("nvidia-caps/nvidia-cap{n}")),
            CAPS_MAJOR,
            n,
        );
    }
    vec![
        "nvidia0",
        "nvidia1",
        "nvidiactl",
        "nvidia-caps/nvidia-cap1",
        "nvidia-caps/nvidia-cap2",
        "nvidia-caps/nvidia-cap30",
        "nvidia-caps/nvidia-cap31",
        "nvidia-caps/nvidia-cap39",
        "nvidia-caps/nvidia-cap40",
    ]
}

/// GPU 0 in MIG mode with MIG-a (caps 30, 31) and MIG-b (39, 40); GPU 1 whole.
fn gpus() -> Vec<GpuInfo> {
    let mig = |uuid: &str, gi: u32, caps: [u32; 2]| MigDevice {
        uuid: uuid.into(),
        profile: "3g.20gb".into(),
        memory_mib: 19968,
        gpu_slices: 3,
        compute_slices: 3,
        gi_id: gi,
        ci_id: 0,
        caps_minors: caps.to_vec(),
    };
    let mut g0 = GpuInfo::new("GPU-0", 0, "A100", 40960);
    g0.mig = MigInfo {
        enabled: true,
        devices: vec![mig("MIG-a", 1, [30, 31]), mig("MIG-b", 2, [39, 40])],
        ..MigInfo::default()
    };
    vec![g0, GpuInfo::new("GPU-1", 1, "A100", 40960)]
}

fn devices_of(uuids: &[&str]) -> TaskDevices {
    let uuids: Vec<String> = uuids.iter().map(|u| u.to_string()).collect();
    resolve(&device_grants(&gpus()), &uuids).unwrap()
}

/// What opening `node` gives a shell that joined `procs` first.
fn open_in(procs: &[PathBuf], node: &Path) -> String {
    let joins: String = procs
        .iter()
        .map(|p| format!("echo $$ > {} && ", p.display()))
        .collect();
    let script = format!("{joins}exec cat {} 2>&1", node.display());
    let out = Command::new("sh").args(["-c", &script]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Each task (UUIDs, the nodes it may open) in its own cgroup: every
/// node of the host is tried from it.
fn check_tasks(iso: &dyn Isolator, dev: &Path, nodes: &[&str], prefix: &str) {
    let tasks: &[(&str, &[&str], &[&str])] = &[
        (
            "mig-a",
            &["MIG-a"],
            &[
                "nvidia0",
                "nvidiactl",
                "nvidia-caps/nvidia-cap30",
                "nvidia-caps/nvidia-cap31",
            ],
        ),
        (
            "mig-b",
            &["MIG-b"],
            &[
                "nvidia0",
                "nvidiactl",
                "nvidia-caps/nvidia-cap39",
                "nvidia-caps/nvidia-cap40",
            ],
        ),
        ("whole", &["GPU-1"], &["nvidia1", "nvidiactl"]),
        ("none", &[], &[]),
    ];
    let mut wrong = Vec::new();
    for (name, uuids, open) in tasks {
        let id = format!("{prefix}-{name}");
        let p = iso
            .prepare(
                &id,
                &devices_of(uuids),
                &Resources::default(),
                Runtime::Process,
            )
            .unwrap();
        let procs = p.cgroup.as_ref().unwrap().procs_files.clone();
        for node in nodes {
            let got = open_in(&procs, &dev.join(node));
            let want = if open.contains(node) { ALLOWED } else { DENIED };
            if !got.contains(want) {
                wrong.push(format!("{name} {node}: {got:?}, not {want}"));
            }
        }
        iso.release(&id).unwrap();
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn on_cgroup_v1_a_mig_task_opens_its_own_caps_only() {
    if !root_or_skip() || !v1_or_skip() {
        return;
    }
    let cgroup_root = Path::new("/sys/fs/cgroup");
    let dir = tempfile::tempdir().unwrap();
    let dev = dir.path().join("dev");
    let nodes = make_dev(&dev);
    let parent = format!("gpuctl-test-mig-{}", std::process::id());
    let iso = CgroupIsolator::new(
        cgroup_root,
        &parent,
        &dev,
        nix::unistd::Uid::effective().is_root(),
    )
    .unwrap();
    assert!(iso.describe().contains("cgroup v1"), "{}", iso.describe());
    check_tasks(&iso, &dev, &nodes, "v1");
    remove_v1_parent(&parent);
}

struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn on_cgroup_v2_a_mig_tasks_program_opens_its_own_caps_only() {
    if !root_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("cg2");
    std::fs::create_dir_all(&root).unwrap();
    let ok = Command::new("mount")
        .args(["-t", "cgroup2", "none"])
        .arg(&root)
        .status()
        .unwrap()
        .success();
    if !ok {
        assert!(!required(), "cannot mount cgroup2");
        eprintln!("skipped: cannot mount cgroup2");
        return;
    }
    let _mounted = Mounted(root.clone());
    let dev = dir.path().join("dev");
    let nodes = make_dev(&dev);
    let parent = format!("gpuctl-test-mig-{}", std::process::id());
    let iso = CgroupIsolator::new(
        &root,
        &parent,
        &dev,
        nix::unistd::Uid::effective().is_root(),
    )
    .unwrap();
    assert!(iso.describe().contains("cgroup v2"), "{}", iso.describe());
    check_tasks(&iso, &dev, &nodes, "v2");
    let _ = std::fs::remove_dir(root.join(&parent));
}

/// Removes `<hierarchy>/<parent>` and what is below it from every v1
/// hierarchy (Docker makes a container's cgroups in all of them, not only
/// where the agent made the task's).
fn remove_v1_parent(parent: &str) {
    fn rmdir_tree(dir: &Path) {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    rmdir_tree(&e.path());
                }
            }
        }
        let _ = std::fs::remove_dir(dir);
    }
    for h in std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
        rmdir_tree(&h.path().join(parent));
    }
}

fn v1_or_skip() -> bool {
    if detect_version(Path::new("/sys/fs/cgroup")) == CgroupVersion::V1 {
        return true;
    }
    assert!(!required(), "cgroup v1 is required here");
    eprintln!("skipped: needs cgroup v1 at /sys/fs/cgroup");
    false
}

async fn docker_or_skip() -> Option<DockerRuntime> {
    match DockerRuntime::connect().await {
        Ok(rt) => Some(rt),
        Err(e) => {
            assert!(!required(), "Docker required but not reachable: {e}");
            eprintln!("skipped: Docker not reachable ({e})");
            None
        }
    }
}

/// A MIG task's container started by the agent's Docker runtime inside its
/// task cgroup, with the agent's check after start (the probe joins the
/// container's cgroup and opens every NVIDIA node of the host): its
/// parent's node and its two caps nodes are there and open, the other MIG
/// device's caps and the config/monitor caps are neither there nor open.
#[tokio::test]
async fn a_mig_container_gets_its_caps_and_passes_the_device_check() {
    if !root_or_skip() || !v1_or_skip() {
        return;
    }
    let Some(rt) = docker_or_skip().await else {
        return;
    };
    let rt = rt.with_device_check(PathBuf::from(env!("CARGO_BIN_EXE_gpuctl-agent")));
    let image = gpuctl_agent::runtime::image::ensure_busybox_image(&rt.client().unwrap())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let dev = dir.path().join("dev");
    make_dev(&dev);
    let parent = format!("gpuctl-test-mig-docker-{}", std::process::id());
    let iso = CgroupIsolator::new(
        Path::new("/sys/fs/cgroup"),
        &parent,
        &dev,
        nix::unistd::Uid::effective().is_root(),
    )
    .unwrap();
    let id = format!("mig-docker-{}", std::process::id());
    let p = iso
        .prepare(
            &id,
            &devices_of(&["MIG-a"]),
            &Resources::default(),
            Runtime::Docker,
        )
        .unwrap();
    let spec = LaunchSpec {
        task: TaskSpec {
            share: None,
            task_id: id.clone(),
            job_id: "job-mig".into(),
            framework_id: String::new(),
            gpu_uuids: vec!["MIG-a".into()],
            template: gpuctl_core::types::TaskTemplate {
                stop_grace_ms: None,
                checkpoint_dir: None,
                hang_timeout_ms: None,
                preflight: false,
                image: Some(image),
                command: ["sh", "-c", "ls /dev /dev/nvidia-caps; sleep 30"]
                    .iter()
                    .map(|a| a.to_string())
                    .collect(),
                env: Default::default(),
                resources: Resources::default(),
                no_fence: true,
                security: Default::default(),
                options: Default::default(),
            },
        },
        agent_id: "agent-mig-test".into(),
        env: Default::default(),
        sandbox: dir.path().to_path_buf(),
        log_path: dir.path().join("task.log"),
        kill_grace: std::time::Duration::from_secs(1),
        isolation: TaskIsolation {
            devices: p.devices.clone(),
            cgroup_parent: p.cgroup.as_ref().map(|c| c.docker_parent()),
            gpu_task: true,
            host_nodes: p.host_nodes.clone(),
            ..Default::default()
        },
        state_dir: dir.path().to_path_buf(),
        fence: None,
        security: Default::default(),
    };
    let t = spec.task_ref();
    let started = rt.start(&spec).await;
    let name = gpuctl_agent::runtime::docker::container_name(&spec.agent_id, &id);
    let mut listed = String::new();
    for _ in 0..100 {
        let out = Command::new("docker")
            .args(["logs", &name])
            .output()
            .unwrap();
        listed = String::from_utf8_lossy(&out.stdout).to_string();
        if listed.contains("nvidia-cap31") || started.is_err() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let _ = rt.stop(&t, std::time::Duration::from_secs(1)).await;
    let _ = rt.remove(&t).await;
    iso.release(&id).unwrap();
    remove_v1_parent(&parent);
    started.unwrap();
    let caps: Vec<&str> = listed
        .lines()
        .filter(|l| {
            l.strip_prefix("nvidia-cap")
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect();
    assert_eq!(caps, ["nvidia-cap30", "nvidia-cap31"], "{listed}");
    assert!(listed.lines().any(|l| l == "nvidia0"), "{listed}");
    assert!(!listed.lines().any(|l| l == "nvidia1"), "{listed}");
}

/// The check itself catches a container whose cgroup allows caps nodes
/// it was not given (what a wrong runtime setting gives): each is named.
#[tokio::test]
async fn the_device_check_catches_a_container_that_can_open_other_caps() {
    if !root_or_skip() || !v1_or_skip() {
        return;
    }
    let Some(rt) = docker_or_skip().await else {
        return;
    };
    let image = gpuctl_agent::runtime::image::ensure_busybox_image(&rt.client().unwrap())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let dev = dir.path().join("dev");
    let nodes: Vec<PathBuf> = make_dev(&dev).iter().map(|n| dev.join(n)).collect();
    let given: Vec<PathBuf> = [
        "nvidia0",
        "nvidiactl",
        "nvidia-caps/nvidia-cap30",
        "nvidia-caps/nvidia-cap31",
    ]
    .iter()
    .map(|n| dev.join(n))
    .collect();
    let name = format!("gpuctl-test-mig-leaky-{}", std::process::id());
    struct Remove(String);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = Command::new("docker").args(["rm", "-f", &self.0]).output();
        }
    }
    let _cleanup = Remove(name.clone());
    let mut args: Vec<String> = vec!["run".into(), "-d".into(), "--name".into(), name.clone()];
    for g in &given {
        let inside = format!("/dev/{}", g.strip_prefix(&dev).unwrap().display());
        args.extend(["--device".into(), format!("{}:{inside}", g.display())]);
    }
    args.extend([
        "--device-cgroup-rule".into(),
        format!("c {CAPS_MAJOR}:* rwm"),
        image,
        "sleep".into(),
        "60".into(),
    ]);
    let out = Command::new("docker").args(&args).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let pid = Command::new("docker")
        .args(["inspect", "--format", "{{.State.Pid}}", &name])
        .output()
        .unwrap();
    let pid: i64 = String::from_utf8_lossy(&pid.stdout).trim().parse().unwrap();
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_gpuctl-agent"));
    let seen = probe(&exe, pid, &nodes).unwrap();
    let err = check(&seen, &given).unwrap_err();
    for leaked in ["nvidia-cap1", "nvidia-cap2", "nvidia-cap39", "nvidia-cap40"] {
        assert!(
            err.contains(&format!("{leaked} not given but allowed")),
            "{leaked}: {err}"
        );
    }
    assert!(
        !err.contains("nvidia-cap30") && !err.contains("nvidia-cap31"),
        "{err}"
    );
    assert!(!err.contains("nvidia1"), "{err}");
}
