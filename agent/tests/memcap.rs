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

/// The fake libnvidia-ml, built once.
fn fake_nvml() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let ok = Command::new(env!("CARGO"))
            .current_dir(root)
            .args(["build", "-p", "fake-nvml"])
            .status()
            .unwrap()
            .success();
        assert!(ok, "building fake-nvml failed");
        let meta = Command::new(env!("CARGO"))
            .current_dir(root)
            .args(["metadata", "--format-version", "1", "--no-deps"])
            .output()
            .unwrap();
        let meta: Value = serde_json::from_slice(&meta.stdout).unwrap();
        PathBuf::from(meta["target_directory"].as_str().unwrap()).join("debug/libfake_nvml.so")
    })
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
    let c = cap.apply("t1", GPU, &cg.group, 10 * 1024).unwrap();
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
    let err = cap.apply("t1", GPU, &cg.group, 1024).unwrap_err();
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
        let err = cap.apply("t1", gpu, &cg.group, 1024).unwrap_err();
        assert!(matches!(err, MemCapError::Mig(_)), "{err}");
        assert!(cap.supported(gpu, &cg.group).is_err());
    }
    // Not a cgroup v2 group.
    let err = cap.apply("t1", GPU, dir.path(), 1024).unwrap_err();
    assert!(matches!(err, MemCapError::NotCgroup2(_)), "{err}");
    // Not a GPU of this host.
    let err = cap.apply(
        "t1",
        "GPU-ffffffff-0000-4000-8000-000000000000",
        &cg.group,
        1024,
    );
    assert!(matches!(err, Err(MemCapError::Gpu(..))), "{err:?}");
    assert!(no_record());
    assert_eq!(f.recorded(&cg.group), None, "nothing was set");
    // Set but not read back: not claimed, and cleared again.
    let mut m = machine(true);
    m["gpus"][0]["errors"] = json!({ "nvmlDeviceGetMemoryLimits_v1": "UNKNOWN" });
    f.write(&m);
    let err = cap.apply("t1", GPU, &cg.group, 1024).unwrap_err();
    assert!(
        matches!(err, MemCapError::Call { call, .. } if call == "nvmlDeviceGetMemoryLimits_v1"),
        "{err}"
    );
    assert_eq!(f.recorded(&cg.group), Some((0, LIMIT_MAX)));
    assert!(no_record());
    // Setting needs privileges the agent may lack.
    m["gpus"][0]["errors"] = json!({ "nvmlDeviceSetMemoryLimits_v1": "NO_PERMISSION" });
    f.write(&m);
    let err = cap.apply("t1", GPU, &cg.group, 1024).unwrap_err();
    assert!(matches!(err, MemCapError::Call { .. }), "{err}");
    assert!(no_record());
}
