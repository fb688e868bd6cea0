//! The driver's per-cgroup memory cap (`gpu::memcap`) through the real
//! nvml-wrapper against tests/fake-nvml, whose config records each
//! nvmlDeviceSetMemoryLimits_v1. The caps go on groups of a cgroup2
//! mounted on a temp dir (root; skipped without it unless
//! GPUCTL_REQUIRE_DOCKER=1).
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use gpuctl_agent::gpu::memcap::{DriverCap, MemCapError, LIMIT_MAX};
use nvml_wrapper::error::NvmlError;
use serde_json::{json, Value};

/// FAKE_NVML_CONFIG is process-wide: one test at a time.
static ENV: Mutex<()> = Mutex::new(());

const GPU: &str = "GPU-00000000-1111-4222-8333-444455556666";
const MIG_GPU: &str = "GPU-00000001-1111-4222-8333-444455556666";
const GIB: u64 = 1 << 30;

fn required() -> bool {
    std::env::var("GPUCTL_REQUIRE_DOCKER").is_ok_and(|v| v == "1")
}

/// The fake libnvidia-ml, built once, with the workspace's binaries as
/// `gpuctl_tests::bin_dir` builds them (dev-dependencies included, as
/// `cargo test --workspace` resolves features): the same build, so the
/// suite never resolves features two ways and rebuilds half the workspace
/// (`cargo build -p fake-nvml` did, for a minute of CI).
fn fake_nvml() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let ok = cargo(root)
            .args(["build", "--workspace", "--bins", "--lib", "--tests"])
            .status()
            .unwrap()
            .success();
        assert!(ok, "building fake-nvml failed");
        let meta = cargo(root)
            .args(["metadata", "--format-version", "1", "--no-deps"])
            .output()
            .unwrap();
        let meta: Value = serde_json::from_slice(&meta.stdout).unwrap();
        PathBuf::from(meta["target_directory"].as_str().unwrap()).join("debug/libfake_nvml.so")
    })
}

/// Cargo without the variables cargo set for this test (as
/// `gpuctl_tests::cargo`, which this package cannot depend on): ring's build
/// script reruns when `CARGO_MANIFEST_DIR` and the like differ from the
/// top-level `cargo test`'s, and rebuilt the TLS stack mid-suite.
fn cargo(root: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO"));
    cmd.current_dir(root);
    for (key, _) in std::env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        let per_crate = key.starts_with("CARGO_PKG_")
            || key.starts_with("CARGO_BIN_")
            || key.starts_with("CARGO_MANIFEST_")
            || matches!(
                key,
                "CARGO_CRATE_NAME" | "CARGO_PRIMARY_PACKAGE" | "CARGO_TARGET_TMPDIR" | "OUT_DIR"
            );
        if per_crate {
            cmd.env_remove(key);
        }
    }
    cmd
}

/// A machine with a plain A100 and one in MIG mode (no instances).
fn machine(memory_limits: bool) -> Value {
    json!({
        "driver_version": "615.20.01",
        "memory_limits": memory_limits,
        "gpus": [
            { "uuid": GPU, "name": "NVIDIA A100-SXM4-40GB" },
            { "uuid": MIG_GPU, "name": "NVIDIA A100-SXM4-40GB", "mig": { "mode": true } },
        ],
    })
}

struct Fake {
    path: PathBuf,
}

impl Fake {
    fn write(&self, v: &Value) {
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, v.to_string()).unwrap();
        std::fs::rename(&tmp, &self.path).unwrap();
    }

    fn read(&self) -> Value {
        serde_json::from_str(&std::fs::read_to_string(&self.path).unwrap()).unwrap()
    }

    /// GPU 0's recorded (soft, hard) for `cgroup`.
    fn recorded(&self, cgroup: &Path) -> Option<(u64, u64)> {
        let v = self.read();
        let list = v["gpus"][0]["cgroup_memory_limits"].as_array()?.clone();
        list.iter()
            .find(|e| e["cgroup"] == json!(cgroup.to_str().unwrap()))
            .map(|e| {
                (
                    e["soft_bytes"].as_u64().unwrap(),
                    e["hard_bytes"].as_u64().unwrap(),
                )
            })
    }
}

/// Points the fake at `dir/machine.json` holding `v`.
fn fake(dir: &Path, v: &Value) -> Fake {
    let f = Fake {
        path: dir.join("machine.json"),
    };
    f.write(v);
    std::env::set_var("FAKE_NVML_CONFIG", &f.path);
    f
}

/// A cgroup2 mounted on a temp dir, with a group of its own.
struct Cgroup2 {
    mount: PathBuf,
    group: PathBuf,
}

impl Cgroup2 {
    fn mount(dir: &Path) -> Option<Cgroup2> {
        if !nix::unistd::Uid::effective().is_root() {
            assert!(!required(), "needs root (GPUCTL_REQUIRE_DOCKER=1)");
            eprintln!("skipped: needs root");
            return None;
        }
        let mount = dir.join("cg2");
        std::fs::create_dir_all(&mount).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "cgroup2", "none"])
            .arg(&mount)
            .status()
            .unwrap()
            .success();
        if !ok {
            assert!(!required(), "cannot mount cgroup2");
            eprintln!("skipped: cannot mount cgroup2");
            return None;
        }
        let group = mount.join(format!("gpuctl-test-memcap-{}", std::process::id()));
        std::fs::create_dir_all(&group).unwrap();
        Some(Cgroup2 { mount, group })
    }
}

impl Drop for Cgroup2 {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.group);
        let _ = Command::new("umount").arg(&self.mount).status();
    }
}

#[test]
fn a_cap_is_set_read_back_and_cleared_by_a_later_agent() {
    let _env = ENV.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let Some(cg) = Cgroup2::mount(dir.path()) else {
        return;
    };
    let f = fake(dir.path(), &machine(true));
    let records = dir.path().join("memcap");
    let cap = DriverCap::new(Some(fake_nvml()), records.clone());
    cap.probe().unwrap();
    cap.supported(GPU, &cg.group).unwrap();
    let c = cap.apply("t1", GPU, &cg.group, 10 * 1024, true).unwrap();
    assert_eq!((c.hard_bytes, c.used_bytes), (10 * GIB, 0));
    // soft = hard: a strict partition.
    assert_eq!(f.recorded(&cg.group), Some((10 * GIB, 10 * GIB)));
    assert!(records.join("t1.json").exists());
    // A restarted agent (a new DriverCap) clears it from the record.
    let later = DriverCap::new(Some(fake_nvml()), records.clone());
    assert!(later.clear("t1").unwrap());
    assert_eq!(f.recorded(&cg.group), Some((0, LIMIT_MAX)));
    assert!(!records.join("t1.json").exists());
    assert!(!later.clear("t1").unwrap(), "cleared once");
}

#[test]
fn what_the_driver_refuses_gives_no_cap_and_leaves_nothing() {
    let _env = ENV.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let Some(cg) = Cgroup2::mount(dir.path()) else {
        return;
    };
    let records = dir.path().join("memcap");
    let cap = DriverCap::new(Some(fake_nvml()), records.clone());
    let no_record = || {
        std::fs::read_dir(&records)
            .map(|d| d.count())
            .unwrap_or_default()
            == 0
    };
    // A driver without cgroup limits.
    let f = fake(dir.path(), &machine(false));
    let err = cap.apply("t1", GPU, &cg.group, 1024, true).unwrap_err();
    assert!(
        matches!(
            err,
            MemCapError::Call {
                source: NvmlError::NotSupported,
                ..
            }
        ),
        "{err}"
    );
    assert!(no_record());
    f.write(&machine(true));
    // MIG: a GPU in MIG mode, a MIG device.
    for gpu in [MIG_GPU, "MIG-0c2671da-0000-4000-8000-000000000000"] {
        let err = cap.apply("t1", gpu, &cg.group, 1024, true).unwrap_err();
        assert!(matches!(err, MemCapError::Mig(_)), "{err}");
        assert!(cap.supported(gpu, &cg.group).is_err());
    }
    // Not a cgroup v2 group.
    let err = cap.apply("t1", GPU, dir.path(), 1024, true).unwrap_err();
    assert!(matches!(err, MemCapError::NotCgroup2(_)), "{err}");
    // Not a GPU of this host.
    let err = cap.apply(
        "t1",
        "GPU-ffffffff-0000-4000-8000-000000000000",
        &cg.group,
        1024,
        true,
    );
    assert!(matches!(err, Err(MemCapError::Gpu(..))), "{err:?}");
    assert!(no_record());
    assert_eq!(f.recorded(&cg.group), None, "nothing was set");
    // Set but not read back: not claimed, and cleared again.
    let mut m = machine(true);
    m["gpus"][0]["errors"] = json!({ "nvmlDeviceGetMemoryLimits_v1": "UNKNOWN" });
    f.write(&m);
    let err = cap.apply("t1", GPU, &cg.group, 1024, true).unwrap_err();
    assert!(
        matches!(err, MemCapError::Call { call, .. } if call == "nvmlDeviceGetMemoryLimits_v1"),
        "{err}"
    );
    assert_eq!(f.recorded(&cg.group), Some((0, LIMIT_MAX)));
    assert!(no_record());
    // Setting needs privileges the agent may lack.
    m["gpus"][0]["errors"] = json!({ "nvmlDeviceSetMemoryLimits_v1": "NO_PERMISSION" });
    f.write(&m);
    let err = cap.apply("t1", GPU, &cg.group, 1024, true).unwrap_err();
    assert!(matches!(err, MemCapError::Call { .. }), "{err}");
    assert!(no_record());
}

/// A runc bundle of busybox running `script`, asking for the cap of `task`
/// through `socket`, in cgroup `cgroup` (runc's cgroupsPath), with `fake`
/// (the fake NVML's directory) bound read-only at /fake.
fn bundle(dir: &Path, name: &str, script: &str, ask: &str, cgroup: &str, fake: &Path) -> PathBuf {
    let b = dir.join(name);
    let bin = b.join("rootfs/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::copy("/bin/busybox", bin.join("busybox")).unwrap();
    for tool in ["sh", "cat", "env", "echo", "grep"] {
        std::os::unix::fs::symlink("busybox", bin.join(tool)).unwrap();
    }
    let ok = Command::new("runc")
        .args(["spec", "--bundle"])
        .arg(&b)
        .status()
        .unwrap()
        .success();
    assert!(ok, "runc spec");
    let path = b.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    c["process"]["terminal"] = json!(false);
    c["process"]["args"] = json!(["sh", "-c", script]);
    c["process"]["env"]
        .as_array_mut()
        .unwrap()
        .push(json!(format!("GPUCTL_DRIVER_CAP={ask}")));
    c["linux"]["cgroupsPath"] = json!(cgroup);
    c["mounts"].as_array_mut().unwrap().push(json!({
        "destination": "/fake", "type": "bind", "source": fake, "options": ["rbind", "ro"],
    }));
    std::fs::write(&path, c.to_string()).unwrap();
    b
}

/// `gpuctl-runc run` of `bundle` as container `id`, in a mount namespace
/// whose /sys/fs/cgroup is the cgroup2 hierarchy, so that runc makes the
/// container's cgroup there (this host's Docker and runc use cgroup v1).
fn runc_run(runtime: &Path, root: &Path, bundle: &Path, id: &str) -> std::process::Output {
    Command::new("unshare")
        .args(["-m", "sh", "-c"])
        .arg(
            "mount --make-rprivate / && mount -t cgroup2 none /sys/fs/cgroup && \
             exec \"$0\" --root \"$1\" run --bundle \"$2\" \"$3\"",
        )
        .arg(runtime)
        .arg(root)
        .arg(bundle)
        .arg(id)
        .output()
        .unwrap()
}

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The whole path of a container's cap with real runc: `gpuctl-runc` adds
/// the hook to the bundle, runc runs it once the container's init is in its
/// own cgroup v2, the agent's socket caps that cgroup through NVML, and only
/// then does the workload start (it reads the fake driver's record of its
/// own cap). A container whose task the agent does not expect never runs.
#[test]
fn a_container_is_capped_by_its_runc_hook_before_its_workload_runs() {
    use gpuctl_agent::gpu::cap_socket::{cgroup2_mount, CapSocket};
    let _env = ENV.lock().unwrap_or_else(|p| p.into_inner());
    if !nix::unistd::Uid::effective().is_root()
        || !["runc", "unshare"].iter().all(|t| have(t))
        || !Path::new("/bin/busybox").exists()
    {
        assert!(!required(), "needs root, runc, unshare and /bin/busybox");
        eprintln!("skipped: needs root, runc, unshare and /bin/busybox");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let fake_dir = dir.path().join("nvml");
    std::fs::create_dir_all(&fake_dir).unwrap();
    let f = fake(&fake_dir, &machine(true));
    let records = dir.path().join("memcap");
    let cap = std::sync::Arc::new(DriverCap::new(Some(fake_nvml()), records.clone()));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let socket = rt
        .block_on(async { CapSocket::start(dir.path(), cap.clone()) })
        .unwrap();
    let runtime = dir.path().join("gpuctl-runc");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_gpuctl-agent"), &runtime).unwrap();
    let parent = format!("gpuctl-runc-test-{}", std::process::id());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let host_cg2 = cgroup2_mount(&mounts).expect("a cgroup2 mount on this host");
    let runc_root = dir.path().join("runc");

    socket.expect("t1", GPU, 2048);
    let script = "cat /proc/self/cgroup; echo BEGIN; cat /fake/machine.json; echo; echo END; env";
    let b = bundle(
        dir.path(),
        "c1",
        script,
        &socket.env_value("t1"),
        &format!("/{parent}/c1"),
        &fake_dir,
    );
    let out = runc_run(&runtime, &runc_root, &b, "c1");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "runc run: {stdout}\n{stderr}");
    assert!(stdout.contains(&format!("0::/{parent}/c1")), "{stdout}");
    let capped = host_cg2.join(&parent).join("c1");
    // What the workload saw of the driver when it started: its cap.
    let seen = stdout
        .split_once("BEGIN\n")
        .and_then(|(_, rest)| rest.split_once("END\n"))
        .map(|(file, _)| file)
        .expect("the fake driver's file in the container's output");
    let seen: Value = serde_json::from_str(seen).unwrap();
    let limits = seen["gpus"][0]["cgroup_memory_limits"].as_array().unwrap();
    assert!(
        limits
            .iter()
            .any(|e| e["cgroup"] == json!(capped) && e["hard_bytes"] == json!(2 * GIB)),
        "the workload started before its cap: {limits:?}"
    );
    assert!(
        !stdout.contains("GPUCTL_DRIVER_CAP"),
        "the hook's variable reached the workload: {stdout}"
    );
    // Soft 0: runc removes the cgroup, with nothing cleared first.
    assert_eq!(f.recorded(&capped), Some((0, 2 * GIB)));
    assert!(
        records.join("t1.json").exists(),
        "the cap is recorded for its clear"
    );
    // runc removed the container's cgroup; the agent's clear forgets it.
    assert!(!capped.exists());
    assert!(cap.clear("t1").unwrap());
    assert_eq!(socket.done("t1"), Ok(()), "the executor is told it held");

    // A task the agent is not starting with a cap: the hook fails, runc
    // fails the create, and the workload never runs.
    let b = bundle(
        dir.path(),
        "c2",
        "echo WORKLOAD-RAN",
        &socket.env_value("t1"),
        &format!("/{parent}/c2"),
        &fake_dir,
    );
    let out = runc_run(&runtime, &runc_root, &b, "c2");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "runc ran an uncapped container: {stdout}"
    );
    assert!(!stdout.contains("WORKLOAD-RAN"), "{stdout}");
    assert!(
        stderr.contains("task t1 is not being started with a driver cap"),
        "{stderr}"
    );
    assert_eq!(f.recorded(&host_cg2.join(&parent).join("c2")), None);
    let _ = Command::new("runc")
        .arg("--root")
        .arg(&runc_root)
        .args(["delete", "--force", "c2"])
        .status();
    // The failed container's init may take a moment to be reaped.
    for _ in 0..50 {
        let _ = std::fs::remove_dir(host_cg2.join(&parent).join("c2"));
        if std::fs::remove_dir(host_cg2.join(&parent)).is_ok() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Docker's own path to the hook: dockerd → containerd's shim →
/// `gpuctl-runc` (registered as runtime `gpuctl`, as .ci/run and
/// docs/deployment.md do) → runc → the hook → the agent's socket, with
/// Docker's real arguments and container ids. A container that asks
/// nothing runs as under runc; one that asks is capped (Docker on cgroup
/// v2) or refused with the reason (this host's Docker is on v1, where the
/// container has no cgroup v2 of its own); one whose task is not expected
/// never runs.
#[test]
fn docker_runs_containers_through_gpuctl_runc_and_its_hook() {
    use gpuctl_agent::gpu::cap_socket::CapSocket;
    use gpuctl_agent::runtime::docker::DockerRuntime;
    let _env = ENV.lock().unwrap_or_else(|p| p.into_inner());
    let info = Command::new("docker")
        .args(["info", "--format", "{{json .Runtimes}} {{.CgroupVersion}}"])
        .output();
    let Some(info) = info
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
    else {
        assert!(!required(), "no Docker daemon answers");
        eprintln!("skipped: no Docker daemon");
        return;
    };
    if !info.contains("\"gpuctl\"") {
        assert!(
            !required(),
            "dockerd has no runtime gpuctl: start it with \
             --add-runtime gpuctl=<a link named gpuctl-runc to gpuctl-agent>, as .ci/run does ({info})"
        );
        eprintln!("skipped: dockerd has no runtime gpuctl");
        return;
    }
    // runc gives a container a cgroup v2 of its own on a v2 host, and on a
    // hybrid one (v1 controllers plus the unified hierarchy) as well.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let own_v2 = gpuctl_agent::gpu::cap_socket::cgroup2_mount(&mounts).is_some_and(|m| {
        m == Path::new("/sys/fs/cgroup") || m == Path::new("/sys/fs/cgroup/unified")
    });
    let dir = tempfile::tempdir().unwrap();
    let f = fake(dir.path(), &machine(true));
    let cap = std::sync::Arc::new(DriverCap::new(Some(fake_nvml()), dir.path().join("memcap")));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (socket, image) = rt.block_on(async {
        let docker = DockerRuntime::new().unwrap();
        let image = gpuctl_agent::runtime::image::ensure_busybox_image(&docker.client().unwrap())
            .await
            .unwrap();
        (CapSocket::start(dir.path(), cap.clone()).unwrap(), image)
    });
    let run = |name: &str, env: Option<String>, script: &str| {
        let mut c = Command::new("docker");
        c.args([
            "run",
            "--name",
            name,
            "--runtime",
            "gpuctl",
            "--network",
            "none",
        ]);
        if let Some(e) = env {
            c.arg("-e").arg(format!("GPUCTL_DRIVER_CAP={e}"));
        }
        let out = c.arg(&image).args(["sh", "-c", script]).output().unwrap();
        let id = Command::new("docker")
            .args(["inspect", "--format", "{{.Id}}", name])
            .output()
            .unwrap();
        let _ = Command::new("docker").args(["rm", "-f", name]).output();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
            String::from_utf8_lossy(&id.stdout).trim().to_string(),
        )
    };
    let pid = std::process::id();

    let (ok, out, err, _) = run(&format!("gpuctl-runc-plain-{pid}"), None, "echo PLAIN");
    assert!(ok && out.contains("PLAIN"), "{out}\n{err}");

    socket.expect("t1", GPU, 1024);
    let (ok, out, err, id) = run(
        &format!("gpuctl-runc-asked-{pid}"),
        Some(socket.env_value("t1")),
        "echo RAN; env",
    );
    // Capped or not, it runs, and the executor learns which.
    assert!(ok && out.contains("RAN"), "{out}\n{err}");
    assert!(!out.contains("GPUCTL_DRIVER_CAP"), "{out}");
    assert!(!id.is_empty());
    let v = f.read();
    let on_it = v["gpus"][0]["cgroup_memory_limits"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|e| {
            e["cgroup"].as_str().is_some_and(|c| c.ends_with(&id)) && e["hard_bytes"] == json!(GIB)
        });
    let done = socket.done("t1");
    if own_v2 {
        assert_eq!(done, Ok(()), "info {info}");
        assert!(on_it, "no cap on container {id}'s cgroup: {v}");
    } else {
        let why = done.unwrap_err();
        assert!(why.contains("no cgroup v2"), "{why}");
        assert!(!on_it);
    }
    assert!(
        cap.clear("t1").unwrap(),
        "the cap is recorded for its clear"
    );

    let (ok, out, err, _) = run(
        &format!("gpuctl-runc-unexpected-{pid}"),
        Some(socket.env_value("t2")),
        "echo RAN",
    );
    assert!(!ok && !out.contains("RAN"), "{out}\n{err}");
    assert!(
        err.contains("task t2 is not being started with a driver cap"),
        "{err}"
    );
}
