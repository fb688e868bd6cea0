//! NVIDIA's images unchanged, end to end: real master and agents over
//! loopback, real Docker, fake NVML reporting an old driver on one agent
//! and a new one on the other. A local image carries NVIDIA's
//! `NVIDIA_REQUIRE_CUDA` (and the driver volume label); an agent whose
//! driver does not meet it refuses the task, the master learns the image's
//! requirement without counting a failed attempt, and the job waits
//! (saying why) until an agent qualifies, then runs there with the driver
//! volume. `--require-cuda` does the same for a host process. Needs root,
//! Docker and cgroup v1 (skipped otherwise; required with
//! GPUCTL_REQUIRE_DOCKER=1).
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use gpuctl_tests::Gpuctl;
use gpuctl_tests::{
    busybox_image, cgroup_v1_or_skip, docker_or_skip, fake_nvml_lib, make_dev_root,
    make_driver_tree, try_wait_for, AgentOpts, Cluster,
};
use serde_json::Value;

use gpuctl_core::cuda_req::examples::CUDA_12_2 as REQUIRE_CUDA_12_2;

const IMAGE: &str = "gpuctl-test/nvidia-cuda-like:12.2";

/// The busybox image with NVIDIA's variables and label, as the official
/// CUDA images have them (no registry: built on the local busybox).
fn build_cuda_like_image() {
    let dockerfile = format!(
        "FROM {}\nENV NVIDIA_REQUIRE_CUDA=\"{REQUIRE_CUDA_12_2}\" CUDA_VERSION=12.2.0 \
         NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility\n\
         LABEL com.nvidia.volumes.needed=nvidia_driver\n",
        busybox_image()
    );
    gpuctl_tests::docker_build(IMAGE, &dockerfile);
}

/// An agent on a fake NVML machine of `gpus` GPUs with this driver (and
/// CUDA as NVML's integer, 12020 for 12.2), its own dev root and a fake
/// driver tree of that version (so GPU containers get the driver volume).
fn add_agent(c: &mut Cluster, name: &str, driver: &str, cuda: u32, gpus: u32) -> String {
    let dir = c.dir.path().join(name);
    let dev = dir.join("dev");
    make_dev_root(&dev, gpus);
    let root = dir.join("driver");
    make_driver_tree(&root, driver);
    let machine = serde_json::json!({
        "driver_version": driver,
        "cuda_driver_version": cuda,
        "gpus": (0..gpus).map(|i| serde_json::json!({
            "uuid": format!("GPU-{:08x}-0000-4000-8000-{:012x}", cuda, i),
            "name": "Tesla T4",
            "pci_bus_id": format!("00000000:{:02X}:00.0", i + 1),
        })).collect::<Vec<_>>(),
    });
    let config = dir.join("nvml.json");
    std::fs::write(&config, machine.to_string()).unwrap();
    let path = |p: &Path| p.display().to_string();
    c.add_agent(AgentOpts {
        simulate_gpus: None,
        runtime: "docker,process",
        extra: vec![
            "--nvml-lib".into(),
            path(&fake_nvml_lib()),
            "--dev-root".into(),
            path(&dev),
            "--driver-root".into(),
            path(&root),
            "--cgroup-parent".into(),
            cgroup_parent(name),
        ],
        env: vec![("FAKE_NVML_CONFIG".into(), path(&config))],
        stop_tasks_on_shutdown: true,
    })
}

fn cgroup_parent(agent: &str) -> String {
    format!("gpuctl-test-cuda-{agent}-{}", std::process::id())
}

/// Removes the agents' cgroup parents (in every v1 controller) once the
/// cluster is gone: declared before it, dropped after it.
struct CgroupCleanup(Vec<String>);

impl Drop for CgroupCleanup {
    fn drop(&mut self) {
        fn rmdir_tree(p: &Path) {
            for e in std::fs::read_dir(p).into_iter().flatten().flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    rmdir_tree(&e.path());
                }
            }
            let _ = std::fs::remove_dir(p);
        }
        for ctrl in std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
        {
            for parent in &self.0 {
                rmdir_tree(&ctrl.path().join(parent));
            }
        }
    }
}

/// The job once its queue reason names the driver (the leader publishes
/// reasons after changes, at most every 250 ms).
fn waiting_for_driver(c: &Cluster, id: &str) -> Value {
    let mut last = Value::Null;
    let found = try_wait_for(Duration::from_secs(30), || {
        last = c.job(id);
        last["wait_reason"]["why"]["need"]["kind"] == "driver"
    });
    assert!(
        found,
        "job {id} does not wait for a driver; last: {last}\n{}",
        c.diagnostics()
    );
    last
}

fn agents_of(job: &Value) -> Vec<String> {
    job["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["agent_id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn nvidia_require_cuda_places_jobs_only_where_the_driver_qualifies() {
    if !docker_or_skip("nvidia_require_cuda_places_jobs_only_where_the_driver_qualifies")
        || !cgroup_v1_or_skip("GPU containers on fake NVML")
    {
        return;
    }
    build_cuda_like_image();
    let _cleanup = CgroupCleanup(vec![cgroup_parent("old"), cgroup_parent("new")]);
    let mut c = Cluster::start(&[]);
    // Older than every branch of the image's requirement (470, 525, 12.2).
    let old = add_agent(&mut c, "old", "460.32.03", 11020, 1);

    // 1. Only the old agent: it refuses the container; the job learns the
    // image's requirement, uses no retry, and waits naming the newest
    // driver there is.
    let script = "ls /usr/local/nvidia/lib64; echo visible=$NVIDIA_VISIBLE_DEVICES";
    let j = c.submit(&[
        "--name", "cuda", "--image", IMAGE, "--gpus", "1", "--", "sh", "-c", script,
    ]);
    let job = waiting_for_driver(&c, &j);
    assert_eq!(job["state"], "QUEUED");
    assert_eq!(
        job["retries"], 0,
        "a refusal is not a failed attempt: {job}"
    );
    assert_eq!(
        job["image_requires"],
        serde_json::json!([REQUIRE_CUDA_12_2])
    );
    let refused = &job["tasks"][0];
    assert_eq!(refused["agent_id"], old.as_str());
    assert_eq!(refused["state"], "FAILED");
    assert_eq!(refused["reason"], "DRIVER_REQUIREMENT_UNMET");
    let message = refused["message"].as_str().unwrap();
    assert!(
        message.contains("requires NVIDIA_REQUIRE_CUDA=cuda>=12.2 (+20 alternatives)")
            && message.contains("this agent has driver 460.32.03, CUDA 11.2"),
        "{message}"
    );
    let reason = job["reason"].as_str().unwrap();
    assert!(
        reason.starts_with(
            "no agent has a driver for cuda>=12.2 (+20 alternatives) \
             (newest: driver 460.32.03, CUDA 11.2)"
        ),
        "{reason}"
    );
    assert!(reason.contains("requeued after task"), "{reason}");
    let list = c.ok(&["jobs", "list"]);
    assert!(
        list.contains("no agent has a driver for cuda>=12.2"),
        "{list}"
    );
    let get = c.ok(&["jobs", "get", &j]);
    assert!(
        get.contains("Driver:    cuda>=12.2 (+20 alternatives) (its image's)"),
        "{get}"
    );
    // The same asked with --require-cuda by a host process: it waits too,
    // never tried on the old agent.
    let p = c.submit(&[
        "--name",
        "host",
        "--require-cuda",
        "cuda>=12.0",
        "--",
        "true",
    ]);
    let host = waiting_for_driver(&c, &p);
    assert!(host["tasks"].as_array().unwrap().is_empty(), "{host}");
    assert!(
        host["reason"]
            .as_str()
            .unwrap()
            .starts_with("no agent has a driver for cuda>=12.0 (newest: driver 460.32.03"),
        "{host}"
    );

    // 2. A new enough agent joins: both run there; the container got the
    // driver volume (the image's label) and only its GPU.
    let new = add_agent(&mut c, "new", "535.129.03", 12020, 2);
    for (id, secs) in [(&j, 90), (&p, 60)] {
        let end = c.wait_job(id, secs);
        assert_eq!(end, (0, "SUCCEEDED".to_string()), "{}", c.job(id));
    }
    let job = c.job(&j);
    assert_eq!(agents_of(&job), [old.clone(), new.clone()]);
    assert_eq!(job["retries"], 0);
    assert_eq!(agents_of(&c.job(&p)), std::slice::from_ref(&new));
    let logs = c.ok(&["jobs", "logs", &j]);
    assert!(
        logs.contains("libnvidia-ml.so.1"),
        "the driver volume: {logs}"
    );
    let gpu = job["tasks"][1]["gpus"][0].as_str().unwrap();
    assert!(logs.contains(&format!("visible={gpu}")), "{logs}");

    // 3. Both agents there, the old one preferred by bundle (it would be
    // left with no free GPU): a new job of the image is tried there first,
    // refused, and ends on the new agent without a failed attempt.
    let k = c.submit(&[
        "--name", "cuda2", "--image", IMAGE, "--gpus", "1", "--", "sh", "-c", script,
    ]);
    let end = c.wait_job(&k, 90);
    assert_eq!(end, (0, "SUCCEEDED".to_string()), "{}", c.job(&k));
    let job = c.job(&k);
    assert_eq!(job["retries"], 0, "{job}");
    assert_eq!(agents_of(&job), [old, new], "{job}");
    assert_eq!(job["tasks"][0]["reason"], "DRIVER_REQUIREMENT_UNMET");
    // Each job learns for itself, from its own refusal.
    assert_eq!(
        job["image_requires"],
        serde_json::json!([REQUIRE_CUDA_12_2])
    );
}
