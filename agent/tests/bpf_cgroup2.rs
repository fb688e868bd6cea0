//! The generated device program enforced by the real kernel: a cgroup v2
//! hierarchy is mounted beside the machine's v1 one, a task's program is
//! loaded and attached to a child cgroup, and a shell moved into it opens
//! fake NVIDIA nodes (made with mknod): its own GPU and the control node
//! give ENXIO (allowed; no driver behind them), another GPU EPERM (denied
//! by the program). Needs root; skipped without it unless
//! GPUCTL_REQUIRE_DOCKER=1.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

use gpuctl_agent::isolation::bpf::{program, task_rules_v2};
use gpuctl_agent::isolation::bpf_load::{attach, load};
use gpuctl_agent::isolation::rules::{DeviceNode, HostDevices};
use gpuctl_agent::isolation::TaskDevices;

fn required() -> bool {
    std::env::var("GPUCTL_REQUIRE_DOCKER").is_ok_and(|v| v == "1")
}

struct Mounted(std::path::PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

fn node(dev: &Path, name: &str, major: u32, minor: u32) -> DeviceNode {
    let path = dev.join(name);
    let ok = Command::new("mknod")
        .arg(&path)
        .args(["c", &major.to_string(), &minor.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "mknod {}", path.display());
    Command::new("chmod")
        .arg("666")
        .arg(&path)
        .status()
        .unwrap();
    DeviceNode {
        host_path: path,
        container_path: format!("/dev/{name}"),
        major,
        minor,
    }
}

/// What `cat NODE` says from inside the cgroup.
fn open_in(cgroup: &Path, node: &Path) -> String {
    let script = format!(
        "echo $$ > {}/cgroup.procs && exec cat {} 2>&1",
        cgroup.display(),
        node.display()
    );
    let out = Command::new("sh").args(["-c", &script]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn the_kernel_enforces_a_tasks_device_program() {
    if !nix::unistd::Uid::effective().is_root() {
        assert!(!required(), "needs root (GPUCTL_REQUIRE_DOCKER=1)");
        eprintln!("skipped: needs root");
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
    std::fs::create_dir_all(&dev).unwrap();
    let host = HostDevices {
        gpus: vec![
            (0, node(&dev, "nvidia0", 195, 0)),
            (1, node(&dev, "nvidia1", 195, 1)),
        ],
        control: vec![node(&dev, "nvidiactl", 195, 255)],
        caps: vec![],
    };
    let cgroup = root.join(format!("gpuctl-test-bpf-{}", std::process::id()));
    std::fs::create_dir_all(&cgroup).unwrap();
    let prog = load(&program(
        &task_rules_v2(&host, &TaskDevices::gpus(&[1])),
        false,
    ))
    .unwrap();
    attach(&prog, &cgroup).unwrap();

    let own = open_in(&cgroup, &dev.join("nvidia1"));
    let ctl = open_in(&cgroup, &dev.join("nvidiactl"));
    let other = open_in(&cgroup, &dev.join("nvidia0"));
    let null = open_in(&cgroup, Path::new("/dev/null"));
    // Outside the cgroup the same node opens as far as the (absent) driver.
    let outside = Command::new("cat")
        .arg(dev.join("nvidia0"))
        .output()
        .unwrap();
    let _ = std::fs::remove_dir(&cgroup);
    assert!(own.contains("No such device or address"), "own GPU: {own}");
    assert!(
        ctl.contains("No such device or address"),
        "nvidiactl: {ctl}"
    );
    assert!(
        other.contains("Operation not permitted"),
        "other GPU: {other}"
    );
    assert!(null.is_empty(), "/dev/null: {null}");
    assert!(
        String::from_utf8_lossy(&outside.stderr).contains("No such device or address"),
        "outside: {}",
        String::from_utf8_lossy(&outside.stderr)
    );
}
