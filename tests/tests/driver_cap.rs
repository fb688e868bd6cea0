//! The driver's per-cgroup GPU memory cap (issue 34, enforcement `driver`)
//! end to end: real master, agent and gpuctl binaries; fake-nvml saying its
//! driver has cgroup memory limits (r615+) and recording each
//! nvmlDeviceSetMemoryLimits_v1; a cgroup2 mounted as the agent's cgroup
//! root. A fraction's host process runs in its own cgroup, capped there
//! before it starts: it says `driver`, the cap is soft = hard = its
//! fraction on that cgroup, and it is cleared before the cgroup is
//! removed. On a driver without the limits the same job says `none`.
//! Needs root (skipped without, unless GPUCTL_REQUIRE_DOCKER=1).
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuctl_tests::{
    fake_nvml_lib, make_dev_root, make_driver_tree, wait_for, AgentOpts, Cluster, Gpuctl,
};
use serde_json::{json, Value};

const GIB: u64 = 1 << 30;

fn machine(memory_limits: bool) -> Value {
    json!({
        "driver_version": "615.20.01",
        "cuda_driver_version": 13040,
        "memory_limits": memory_limits,
        "gpus": [
            { "uuid": "GPU-7e1a0000-1111-4222-8333-444455556666", "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960 },
            { "uuid": "GPU-7e1a0001-1111-4222-8333-444455556666", "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960 },
        ],
    })
}

fn write(path: &Path, v: &Value) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, v.to_string()).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The (soft, hard) the fake recorded for `cgroup` on GPU 0.
fn recorded(machine: &Path, cgroup: &Path) -> Option<(u64, u64)> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(machine).unwrap()).unwrap();
    v["gpus"][0]["cgroup_memory_limits"]
        .as_array()?
        .iter()
        .find(|e| e["cgroup"] == json!(cgroup.to_str().unwrap()))
        .map(|e| {
            (
                e["soft_bytes"].as_u64().unwrap(),
                e["hard_bytes"].as_u64().unwrap(),
            )
        })
}

/// An agent of `runtime` on fake-nvml's two A100s with the cgroup limits
/// (and their device nodes and an r615 driver tree): its id and the fake's
/// machine file.
fn fake_driver_agent(
    c: &mut Cluster,
    runtime: &'static str,
    extra: Vec<String>,
) -> (String, PathBuf) {
    let dev = c.dir.path().join("dev");
    make_dev_root(&dev, 2);
    let driver = c.dir.path().join("driver");
    make_driver_tree(&driver, "615.20.01");
    let fake = c.dir.path().join("machine.json");
    write(&fake, &machine(true));
    let mut args = vec![
        "--nvml-lib".into(),
        fake_nvml_lib().display().to_string(),
        "--dev-root".into(),
        dev.display().to_string(),
        "--driver-root".into(),
        driver.display().to_string(),
    ];
    args.extend(extra);
    let agent = c.add_agent(AgentOpts {
        simulate_gpus: None,
        runtime,
        extra: args,
        env: vec![("FAKE_NVML_CONFIG".into(), fake.display().to_string())],
        stop_tasks_on_shutdown: true,
    });
    (agent, fake)
}

#[test]
fn a_fractions_host_process_is_capped_by_the_driver_on_its_own_cgroup() {
    let required = std::env::var("GPUCTL_REQUIRE_DOCKER").as_deref() == Ok("1");
    if !nix::unistd::Uid::effective().is_root() {
        assert!(!required, "the driver cap test needs root");
        eprintln!("skipped: needs root");
        return;
    }
    let top = format!("gpuctl-test-drvcap-{}", std::process::id());
    let Some(cg2) = gpuctl_tests::Cgroup2::mount(&top) else {
        assert!(!required, "cannot mount cgroup2");
        eprintln!("skipped: cannot mount cgroup2");
        return;
    };
    let mut c = Cluster::start(&[]);
    let (agent, fake) = fake_driver_agent(
        &mut c,
        "process",
        vec![
            "--cgroup-root".into(),
            cg2.path().display().to_string(),
            "--cgroup-parent".into(),
            top.clone(),
        ],
    );
    let uuid = c.json(&["gpus", "--json"])[0]["uuid"]
        .as_str()
        .unwrap()
        .to_string();
    c.ok(&["gpus", "share", &uuid, "--mode", "time-slice"]);
    let fraction = |c: &Cluster, name: &str| {
        c.submit(&[
            "--name",
            name,
            "--gpu-mem",
            "10GiB",
            "--cpus",
            "0.1",
            "--",
            "sh",
            "-c",
            "cat /proc/self/cgroup; sleep 3",
        ])
    };
    let cgroup_of = |job: &Value| -> PathBuf {
        let task = job["tasks"][0]["id"].as_str().unwrap();
        cg2.path().join(&top).join(&agent).join(task)
    };

    let j = fraction(&c, "capped");
    let job = c.wait_state(&j, "RUNNING", Duration::from_secs(30));
    assert_eq!(job["tasks"][0]["enforcement"], "driver", "{job}");
    let got = c.ok(&["jobs", "get", &j]);
    assert!(
        got.contains(&format!("Enforcement of {j}.0: driver")),
        "{got}"
    );
    // Set on the task's own cgroup, which exists while it runs: soft =
    // hard = its fraction.
    let cgroup = cgroup_of(&job);
    assert!(cgroup.is_dir(), "{}", cgroup.display());
    assert_eq!(recorded(&fake, &cgroup), Some((10 * GIB, 10 * GIB)));
    assert_eq!(c.wait_job(&j, 30).0, 0);
    let out = c.ok(&["jobs", "logs", &j]);
    let rel = cgroup.strip_prefix(cg2.path()).unwrap();
    assert!(
        out.lines().any(|l| l == format!("0::/{}", rel.display())),
        "it ran in the capped cgroup:\n{out}"
    );
    // Cleared (soft 0, hard max) before its cgroup was removed.
    wait_for(Duration::from_secs(10), "the task's cgroup removed", || {
        !cgroup.exists()
    });
    assert_eq!(recorded(&fake, &cgroup), Some((0, u64::MAX)));

    // A driver without cgroup limits: the same job runs, and says so.
    let mut m: Value = serde_json::from_str(&std::fs::read_to_string(&fake).unwrap()).unwrap();
    m["memory_limits"] = json!(false);
    write(&fake, &m);
    let j = fraction(&c, "uncapped");
    let job = c.wait_state(&j, "RUNNING", Duration::from_secs(30));
    assert_eq!(job["tasks"][0]["enforcement"], "none", "{job}");
    assert_eq!(recorded(&fake, &cgroup_of(&job)), None);
    assert_eq!(c.wait_job(&j, 30).0, 0);
    drop(c);
}

/// The same cap for a fraction's container: Docker creates it with the
/// `gpuctl` runtime (`gpuctl-runc`, registered with dockerd as .ci/run
/// does), whose hook has the agent cap the container's own cgroup v2 before
/// its workload runs. The task says `none` while starting (time-slice holds
/// nothing) and `driver` once running; the cap is on the cgroup named after
/// its container. A job that sets the hook's variable itself gets nothing
/// from it.
#[test]
fn a_fractions_container_is_capped_by_the_driver_through_the_runtime_hook() {
    if !gpuctl_tests::docker_or_skip(
        "a_fractions_container_is_capped_by_the_driver_through_the_runtime_hook",
    ) {
        return;
    }
    let required = std::env::var("GPUCTL_REQUIRE_DOCKER").as_deref() == Ok("1");
    let runtimes = std::process::Command::new("docker")
        .args(["info", "--format", "{{json .Runtimes}}"])
        .output()
        .unwrap();
    if !String::from_utf8_lossy(&runtimes.stdout).contains("\"gpuctl\"") {
        assert!(!required, "dockerd has no runtime gpuctl (see .ci/run)");
        eprintln!("skipped: dockerd has no runtime gpuctl");
        return;
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    if gpuctl_agent::gpu::cap_socket::cgroup2_mount(&mounts).is_none() {
        assert!(
            !required,
            "no cgroup2 hierarchy: containers have no cgroup v2 to cap"
        );
        eprintln!("skipped: no cgroup2 hierarchy");
        return;
    }
    let image = gpuctl_tests::busybox_image();
    let mut c = Cluster::start(&[]);
    let (agent, fake) = fake_driver_agent(&mut c, "docker", Vec::new());
    let uuid = c.json(&["gpus", "--json"])[0]["uuid"]
        .as_str()
        .unwrap()
        .to_string();
    c.ok(&["gpus", "share", &uuid, "--mode", "time-slice"]);
    let j = c.submit(&[
        "--name",
        "capped",
        "--image",
        &image,
        "--gpu-mem",
        "10GiB",
        "--cpus",
        "0.1",
        "--",
        "sh",
        "-c",
        "env; echo ready; sleep 600",
    ]);
    c.wait_state(&j, "RUNNING", Duration::from_secs(60));
    wait_for(Duration::from_secs(30), "enforcement driver", || {
        c.job(&j)["tasks"][0]["enforcement"] == "driver"
    });
    let got = c.ok(&["jobs", "get", &j]);
    assert!(
        got.contains(&format!("Enforcement of {j}.0: driver")),
        "{got}"
    );
    let task = c.job(&j)["tasks"][0]["id"].as_str().unwrap().to_string();
    // Task ids repeat across test clusters: the agent's label too.
    let running = || {
        let out = std::process::Command::new("docker")
            .args(["ps", "-q", "--no-trunc"])
            .args(["--filter", &format!("label=gpuctl.agent_id={agent}")])
            .args(["--filter", &format!("label=gpuctl.task_id={task}")])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let id = running();
    assert_eq!(id.len(), 64, "one running container for {task}: {id:?}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&fake).unwrap()).unwrap();
    let on_container: Vec<&Value> = v["gpus"][0]["cgroup_memory_limits"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["cgroup"].as_str().is_some_and(|p| p.ends_with(&id)))
        .collect();
    assert_eq!(on_container.len(), 1, "{v}");
    assert_eq!(on_container[0]["hard_bytes"], json!(10 * GIB));
    // No reservation (soft 0): runc removes this cgroup, uncleared.
    assert_eq!(on_container[0]["soft_bytes"], json!(0));
    // The capped cgroup is the container's, with its process in it.
    let cgroup = PathBuf::from(on_container[0]["cgroup"].as_str().unwrap());
    let procs = std::fs::read_to_string(cgroup.join("cgroup.procs")).unwrap();
    assert!(!procs.trim().is_empty(), "{}", cgroup.display());
    wait_for(Duration::from_secs(30), "its output", || {
        c.ok(&["jobs", "logs", &j]).contains("ready")
    });
    let out = c.ok(&["jobs", "logs", &j]);
    assert!(!out.contains("GPUCTL_DRIVER_CAP"), "{out}");

    // The agent SIGKILLed under the capped container: the container runs
    // on (same id, still in its capped cgroup), the new agent keeps the
    // cap's record and serves the hook again for the next fraction.
    let record = c.dir.path().join(format!("agent0/memcap/{task}.json"));
    assert!(record.exists(), "{}", record.display());
    c.restart_agent(0);
    wait_for(Duration::from_secs(30), "the agent back", || {
        c.agents_json()
            .first()
            .is_some_and(|a| a["state"] == "ACTIVE")
    });
    assert_eq!(running(), id);
    assert!(!std::fs::read_to_string(cgroup.join("cgroup.procs"))
        .unwrap()
        .trim()
        .is_empty());
    assert_eq!(c.job(&j)["tasks"][0]["enforcement"], "driver");
    let k = c.submit(&[
        "--name",
        "after",
        "--image",
        &image,
        "--gpu-mem",
        "4GiB",
        "--cpus",
        "0.1",
        "--",
        "sh",
        "-c",
        "sleep 1",
    ]);
    assert_eq!(c.wait_job(&k, 60).0, 0);
    assert_eq!(
        c.job(&k)["tasks"][0]["enforcement"],
        "driver",
        "{}",
        c.job(&k)
    );
    // Its end forgets the cap (runc removed the cgroup with it).
    c.ok(&["jobs", "cancel", &j]);
    c.wait_state(&j, "CANCELLED", Duration::from_secs(60));
    wait_for(Duration::from_secs(30), "the cap's record gone", || {
        !record.exists()
    });
    assert!(!cgroup.exists());

    // A whole-GPU job that sets the hook's variable itself: scrubbed, no
    // hook, no cap, and it runs.
    let w = c.submit(&[
        "--name",
        "sneaky",
        "--image",
        &image,
        "--gpus",
        "1",
        "--cpus",
        "0.1",
        "--env",
        "GPUCTL_DRIVER_CAP=/nonexistent.sock|other",
        "--",
        "sh",
        "-c",
        "echo cap=${GPUCTL_DRIVER_CAP:-unset}",
    ]);
    assert_eq!(c.wait_job(&w, 60).0, 0);
    let out = c.ok(&["jobs", "logs", &w]);
    assert!(out.contains("cap=unset"), "{out}");
    drop(c);
}
