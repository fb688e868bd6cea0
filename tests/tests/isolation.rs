//! GPU isolation end to end: real Docker, real cgroups (v1), device nodes
//! made with mknod in a temp dev root, fake-nvml, and a fake driver tree
//! whose ld.so cache is written by the real ldconfig. A process allowed a
//! GPU node gets ENXIO when it opens it (no driver behind it); a denied one
//! gets EPERM. A container cannot make device nodes (no CAP_MKNOD): its
//! cgroup's rules are tried from the host, by a process put in it.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuctl_tests::Gpuctl;
use gpuctl_tests::{
    agent_cdi_dir, busybox_image, cgroup_dirs, cgroup_v1_or_skip, docker_or_skip, fake_nvml_config,
    fake_nvml_lib, make_dev_root, make_driver_tree, task_containers, try_wait_for, wait_for,
    AgentOpts, Cluster,
};
use serde_json::Value;

const ENXIO: &str = "No such device or address";
const EPERM: &str = "Operation not permitted";

struct Setup {
    c: Cluster,
    dev: PathBuf,
    parent: String,
    /// GPU minor by UUID.
    minors: BTreeMap<String, u32>,
}

/// A master and one agent on the fake `mixed` machine (4 GPUs, minors 0-3),
/// with its own dev root, driver root and cgroup parent.
fn setup(name: &str, runtime: &str) -> Setup {
    setup_with(name, runtime, vec![])
}

/// [`setup`] with more agent flags.
fn setup_with(name: &str, runtime: &str, more: Vec<String>) -> Setup {
    let mut c = Cluster::start(&[]);
    let dev = c.dir.path().join("dev");
    make_dev_root(&dev, 4);
    let driver = c.dir.path().join("driver");
    make_driver_tree(&driver, "535.129.03");
    let parent = format!("gpuctl-test-{name}-{}", std::process::id());
    let agent = c.add_agent(AgentOpts {
        simulate_gpus: None,
        runtime,
        extra: vec![
            "--nvml-lib".into(),
            fake_nvml_lib().display().to_string(),
            "--dev-root".into(),
            dev.display().to_string(),
            "--driver-root".into(),
            driver.display().to_string(),
            "--cgroup-parent".into(),
            parent.clone(),
        ]
        .into_iter()
        .chain(more)
        .collect(),
        env: vec![(
            "FAKE_NVML_CONFIG".into(),
            fake_nvml_config("mixed").display().to_string(),
        )],
        stop_tasks_on_shutdown: true,
    });
    let described = c.json(&["agents", "describe", &agent, "--json"]);
    // Task cgroups are <cgroup-parent>/<agent-id>/<task-id>.
    let parent = format!("{parent}/{agent}");
    let minors = described["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["uuid"].as_str().unwrap().to_string(),
                g["minor"].as_u64().unwrap() as u32,
            )
        })
        .collect();
    Setup {
        c,
        dev,
        parent,
        minors,
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        for ctrl in std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = std::fs::remove_dir(ctrl.path().join(&self.parent));
        }
    }
}

/// A script that tries every GPU (0-3) through `dir` (the container's /dev
/// or, for host processes, the dev root), and mknod'ed copies of them.
fn probe_script(dir: &str) -> String {
    format!(
        r#"for i in 0 1 2 3; do
  [ -e {dir}/nvidia$i ] && echo "node$i present"
  if cat {dir}/nvidia$i 2>/tmp/gpuctl-e$$; then echo "open$i ok"; else echo "open$i $(cat /tmp/gpuctl-e$$)"; fi
done
if cat {dir}/nvidiactl 2>/tmp/gpuctl-e$$; then echo "ctl ok"; else echo "ctl $(cat /tmp/gpuctl-e$$)"; fi
echo "visible=$NVIDIA_VISIBLE_DEVICES"
echo "cuda=$CUDA_VISIBLE_DEVICES"
echo "caps=$NVIDIA_DRIVER_CAPABILITIES"
"#
    )
}

/// The container cannot make a node for any GPU (it has no CAP_MKNOD).
const MKNOD_SCRIPT: &str = r#"for i in 0 1 2 3; do
  if mknod /tmp/n$i c 195 $i 2>/tmp/e; then echo "mknod$i made"; else echo "mknod$i $(cat /tmp/e)"; fi
done
"#;

/// The devices cgroup of the running container of `task` (inside the
/// task's).
fn container_devices_cgroup(parent: &str, task: &str) -> PathBuf {
    let devices = Path::new("/sys/fs/cgroup/devices").join(parent).join(task);
    let mut found = None;
    wait_for(Duration::from_secs(10), "the container's cgroup", || {
        found = std::fs::read_dir(&devices)
            .into_iter()
            .flatten()
            .flatten()
            .find(|e| e.path().is_dir())
            .map(|e| e.path());
        found.is_some()
    });
    found.unwrap()
}

/// What the container's cgroup lets a process do with each GPU: a shell
/// run from the host as root joins it, makes a node for every GPU in a
/// temp dir (root may; the container may not) and opens each.
fn probe_from_cgroup(cgroup: &Path) -> String {
    let dir = gpuctl_tests::test_dir();
    let d = dir.path().display();
    let script = format!(
        r#"echo $$ > {procs} || exit 9
for i in 0 1 2 3; do
  mknod {d}/n$i c 195 $i
  if cat {d}/n$i 2>{d}/e; then echo "mk$i ok"; else echo "mk$i $(cat {d}/e)"; fi
done
"#,
        procs = cgroup.join("cgroup.procs").display()
    );
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(&script)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "joining {}: {out:?}",
        cgroup.display()
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn line<'a>(out: &'a str, prefix: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line {prefix:?} in:\n{out}"))
}

/// What the probe script printed says the task opened GPU `minor` and
/// the control node with it (neither without a GPU), and no other GPU.
fn assert_only_its_gpu(out: &str, minor: Option<u32>) {
    for i in 0..4u32 {
        let want = if Some(i) == minor { ENXIO } else { EPERM };
        assert!(
            line(out, &format!("open{i} ")).contains(want),
            "open{i}:\n{out}"
        );
    }
    let ctl = if minor.is_some() { ENXIO } else { EPERM };
    assert!(line(out, "ctl ").contains(ctl), "{out}");
}

fn task_of(job: &Value) -> (String, Vec<String>) {
    let t = &job["tasks"][0];
    (
        t["id"].as_str().unwrap().to_string(),
        t["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g.as_str().unwrap().to_string())
            .collect(),
    )
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn docker_tasks_see_and_open_only_their_own_gpus() {
    if !docker_or_skip("docker_tasks_see_and_open_only_their_own_gpus")
        || !cgroup_v1_or_skip("docker isolation")
    {
        return;
    }
    let image = busybox_image();
    let s = setup("docker", "docker,process");
    // Each opens its own node and cannot make nodes for the others; while
    // it runs, a process put in its cgroup from the host makes them and
    // finds them refused there too.
    let script = format!(
        "{}\n{MKNOD_SCRIPT}ls /usr/local/nvidia/lib64 /usr/local/nvidia/bin\ntouch /usr/local/nvidia/x 2>&1 || true\necho \"path=$PATH\"\necho \"ld=$LD_LIBRARY_PATH\"\nsleep 3\n",
        probe_script("/dev")
    );
    let jobs: Vec<String> = (0..2)
        .map(|i| {
            s.c.submit(&[
                "--name",
                &format!("iso{i}"),
                "--image",
                &image,
                "--gpus",
                "1",
                "--mem",
                "64",
                "--",
                "sh",
                "-c",
                &script,
            ])
        })
        .collect();
    // While they run: each has its cgroup with the memory limit, and its
    // container's device list holds its own GPU only.
    let mut from_cgroup = BTreeMap::new();
    for j in &jobs {
        let job = s.c.wait_state(j, "RUNNING", Duration::from_secs(60));
        let (task, gpus) = task_of(&job);
        let minor = s.minors[&gpus[0]];
        let mem = Path::new("/sys/fs/cgroup/memory")
            .join(&s.parent)
            .join(&task);
        assert_eq!(read(&mem.join("memory.limit_in_bytes")).trim(), "67108864");
        let devices = Path::new("/sys/fs/cgroup/devices")
            .join(&s.parent)
            .join(&task);
        assert!(devices.is_dir(), "{}", devices.display());
        let container_list = std::fs::read_dir(&devices)
            .unwrap()
            .flatten()
            .find(|e| e.path().is_dir())
            .map(|e| read(&e.path().join("devices.list")))
            .expect("the container's cgroup is inside the task's");
        assert!(
            container_list.contains(&format!("c 195:{minor} rwm")),
            "{container_list}"
        );
        for other in (0..4).filter(|m| *m != minor) {
            assert!(
                !container_list.contains(&format!("c 195:{other} ")),
                "{container_list}"
            );
        }
        from_cgroup.insert(
            j.clone(),
            probe_from_cgroup(&container_devices_cgroup(&s.parent, &task)),
        );
    }
    let mut seen = Vec::new();
    for j in &jobs {
        assert_eq!(
            s.c.wait_job(j, 60).0,
            0,
            "{}\n{}",
            s.c.job(j),
            s.c.ok(&["jobs", "logs", j])
        );
        let out = s.c.ok(&["jobs", "logs", j]);
        let (task, gpus) = task_of(&s.c.job(j));
        let minor = s.minors[&gpus[0]];
        seen.push(minor);
        for i in 0..4u32 {
            let present = out.contains(&format!("node{i} present"));
            assert_eq!(present, i == minor, "node{i} for GPU {minor}:\n{out}");
            let mk = line(&from_cgroup[j], &format!("mk{i} "));
            let want = if i == minor { ENXIO } else { EPERM };
            assert!(mk.contains(want), "mk{i} for GPU {minor}: {mk}");
            let mknod = line(&out, &format!("mknod{i} "));
            assert!(mknod.contains(EPERM), "{mknod}");
        }
        assert!(line(&out, &format!("open{minor} ")).contains(ENXIO));
        assert!(line(&out, "ctl ").contains(ENXIO), "{out}");
        assert_eq!(line(&out, "visible="), format!("visible={}", gpus[0]));
        assert_eq!(line(&out, "cuda="), format!("cuda={}", gpus[0]));
        assert_eq!(line(&out, "caps="), "caps=compute,utility");
        // The driver volume: consolidated files, read-only, on PATH.
        assert!(out.contains("libnvidia-ml.so.1"), "{out}");
        assert!(out.contains("libcuda.so.1"), "{out}");
        assert!(out.contains("nvidia-smi"), "{out}");
        assert!(out.contains("Read-only file system"), "{out}");
        assert!(
            line(&out, "path=").starts_with("path=/usr/local/nvidia/bin:"),
            "{out}"
        );
        assert!(
            line(&out, "ld=").contains("/usr/local/nvidia/lib64"),
            "{out}"
        );
        // Afterwards nothing is left: no cgroup in any hierarchy, no container.
        wait_for(Duration::from_secs(10), "task cgroups removed", || {
            cgroup_dirs(&s.parent, &task).is_empty()
        });
        assert!(
            task_containers(s.parent.rsplit('/').next().unwrap(), &task).is_empty(),
            "container of {task} left: {}",
            s.c.diagnostics()
        );
        // The volume was bound inside the container's mount namespace only.
        let mounts = read(Path::new("/proc/self/mountinfo"));
        assert!(!mounts.contains("nvidia_535.129.03"), "{mounts}");
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 2, "two tasks, two different GPUs");
    // The agent described its GPUs in a CDI spec (nodes under its dev
    // root), and this Docker (20.10, API 1.41) got them with --device.
    let spec = agent_cdi_dir(s.c.dir.path(), 0).join("gpuctl.io-gpu.json");
    let spec: Value = serde_json::from_str(&read(&spec)).unwrap();
    assert_eq!(spec["kind"], "gpuctl.io/gpu");
    let names: Vec<&str> = spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    for (uuid, minor) in &s.minors {
        assert!(names.contains(&uuid.as_str()), "{uuid} in {names:?}");
        let node = &spec["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == uuid.as_str())
            .unwrap()["containerEdits"]["deviceNodes"][0];
        assert_eq!(node["path"], format!("/dev/nvidia{minor}"));
        assert_eq!(
            node["hostPath"],
            s.dev.join(format!("nvidia{minor}")).display().to_string()
        );
    }
    let docker_version = std::process::Command::new("docker")
        .args(["version", "--format", "{{.Server.APIVersion}}"])
        .output()
        .unwrap();
    let api = String::from_utf8_lossy(&docker_version.stdout)
        .trim()
        .to_string();
    if !gpuctl_agent::runtime::docker::api_at_least(&api, (1, 44)) {
        let log = s.c.agents[0].log_text();
        assert!(
            log.contains("GPU containers get their GPUs through --device, not CDI")
                && log.contains("older than 1.44"),
            "{log}"
        );
    }
}

#[test]
fn a_task_without_gpus_gets_none_even_if_its_image_says_all() {
    if !docker_or_skip("a_task_without_gpus_gets_none_even_if_its_image_says_all")
        || !cgroup_v1_or_skip("no-GPU isolation")
    {
        return;
    }
    let base = busybox_image();
    let image = "gpuctl-test/env-all:local";
    let dockerfile = format!(
        "FROM {base}\nENV NVIDIA_VISIBLE_DEVICES=all\nLABEL com.nvidia.volumes.needed=nvidia_driver\n"
    );
    gpuctl_tests::docker_build(image, &dockerfile);

    let s = setup("nogpu", "docker,process");
    let script = format!(
        "{}\n{MKNOD_SCRIPT}ls /usr/local/nvidia/lib64\nsleep 2\n",
        probe_script("/dev")
    );
    let j = s.c.submit(&[
        "--name", "nogpu", "--image", image, "--", "sh", "-c", &script,
    ]);
    let (task, _) = task_of(&s.c.wait_state(&j, "RUNNING", Duration::from_secs(60)));
    let from_cgroup = probe_from_cgroup(&container_devices_cgroup(&s.parent, &task));
    assert_eq!(
        s.c.wait_job(&j, 60).0,
        0,
        "{}\n{}",
        s.c.job(&j),
        s.c.ok(&["jobs", "logs", &j])
    );
    let out = s.c.ok(&["jobs", "logs", &j]);
    assert!(
        !out.contains("present"),
        "no GPU node in the container:\n{out}"
    );
    for i in 0..4 {
        assert!(line(&out, &format!("mknod{i} ")).contains(EPERM), "{out}");
        let mk = line(&from_cgroup, &format!("mk{i} "));
        assert!(mk.contains(EPERM), "{from_cgroup}");
    }
    assert_eq!(line(&out, "visible="), "visible=void");
    assert_eq!(line(&out, "cuda="), "cuda=");
    // The image asked for the driver volume: it gets the libraries, and
    // still no device.
    assert!(out.contains("libnvidia-ml.so.1"), "{out}");
    wait_for(Duration::from_secs(10), "cgroup removed", || {
        cgroup_dirs(&s.parent, &task).is_empty()
    });
}

#[test]
fn host_processes_are_confined_to_their_gpus_too() {
    if !cgroup_v1_or_skip("process isolation") || !nix::unistd::Uid::effective().is_root() {
        if std::env::var("GPUCTL_REQUIRE_DOCKER").as_deref() == Ok("1") {
            panic!("host process isolation needs root");
        }
        return;
    }
    let s = setup("process", "process");
    let dev = s.dev.display().to_string();
    let script = format!("{}\ncat /proc/self/cgroup\nsleep 2\n", probe_script(&dev));
    let j = s.c.submit(&[
        "--name", "p1", "--gpus", "1", "--mem", "32", "--", "sh", "-c", &script,
    ]);
    let job = s.c.wait_state(&j, "RUNNING", Duration::from_secs(30));
    let (task, gpus) = task_of(&job);
    let minor = s.minors[&gpus[0]];
    let mem = Path::new("/sys/fs/cgroup/memory")
        .join(&s.parent)
        .join(&task);
    assert_eq!(read(&mem.join("memory.limit_in_bytes")).trim(), "33554432");
    assert_eq!(s.c.wait_job(&j, 30).0, 0);
    let out = s.c.ok(&["jobs", "logs", &j]);
    assert_only_its_gpu(&out, Some(minor));
    // It ran inside its cgroup from its first instruction.
    assert!(
        out.lines()
            .any(|l| l.contains(":devices:") && l.ends_with(&format!("/{}/{task}", s.parent))),
        "{out}"
    );
    wait_for(Duration::from_secs(10), "cgroup removed", || {
        cgroup_dirs(&s.parent, &task).is_empty()
    });

    // Without GPUs: every GPU and the control device are denied.
    let j =
        s.c.submit(&["--name", "p0", "--", "sh", "-c", &probe_script(&dev)]);
    assert_eq!(s.c.wait_job(&j, 30).0, 0);
    let out = s.c.ok(&["jobs", "logs", &j]);
    assert_only_its_gpu(&out, None);
    assert_eq!(line(&out, "visible="), "visible=void");

    // A killed process task leaves no cgroup either.
    let j =
        s.c.submit(&["--name", "p-kill", "--gpus", "1", "--", "sleep", "300"]);
    let job = s.c.wait_state(&j, "RUNNING", Duration::from_secs(30));
    let (task, _) = task_of(&job);
    assert!(!cgroup_dirs(&s.parent, &task).is_empty());
    s.c.ok(&["jobs", "cancel", &j]);
    assert_eq!(s.c.wait_job(&j, 30).1, "CANCELLED");
    assert!(try_wait_for(Duration::from_secs(10), || cgroup_dirs(
        &s.parent, &task
    )
    .is_empty()));
}

/// Issue 34 item 3: fractions of a shared GPU are isolated as whole GPUs
/// are. Two fractions of one GPU each open that GPU's node (ENXIO: no
/// driver) and no other (EPERM), while a whole-GPU task beside them keeps
/// its own.
#[test]
fn fractions_of_a_shared_gpu_open_only_that_gpu() {
    if !cgroup_v1_or_skip("fraction isolation") || !nix::unistd::Uid::effective().is_root() {
        if std::env::var("GPUCTL_REQUIRE_DOCKER").as_deref() == Ok("1") {
            panic!("host process isolation needs root");
        }
        return;
    }
    let s = setup("fraction", "process");
    let dev = s.dev.display().to_string();
    // The GPU of minor 2, shared.
    let shared = s
        .minors
        .iter()
        .find(|(_, m)| **m == 2)
        .map(|(u, _)| u.clone())
        .unwrap();
    s.c.ok(&["gpus", "share", &shared, "--mode", "time-slice"]);
    let script = format!("{}\nsleep 2\n", probe_script(&dev));
    let fractions: Vec<String> = (0..2)
        .map(|i| {
            s.c.submit(&[
                "--name",
                &format!("f{i}"),
                "--gpu-mem",
                "1GiB",
                "--mem",
                "32",
                "--",
                "sh",
                "-c",
                &script,
            ])
        })
        .collect();
    let whole = s.c.submit(&[
        "--name", "w", "--gpus", "1", "--mem", "32", "--", "sh", "-c", &script,
    ]);
    for j in &fractions {
        assert_eq!(s.c.wait_job(j, 30).0, 0, "{}", s.c.job(j));
        let out = s.c.ok(&["jobs", "logs", j]);
        assert_only_its_gpu(&out, Some(2));
        assert_eq!(line(&out, "visible="), format!("visible={shared}"));
    }
    assert_eq!(s.c.wait_job(&whole, 30).0, 0);
    let (_, gpus) = task_of(&s.c.job(&whole));
    assert_ne!(gpus[0], shared, "a shared GPU given whole");
    assert_only_its_gpu(&s.c.ok(&["jobs", "logs", &whole]), Some(s.minors[&gpus[0]]));
}

/// The pids in a v2 cgroup.
fn procs(cgroup: &Path) -> Vec<i32> {
    std::fs::read_to_string(cgroup.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// cgroup v2, where most GPU hosts are now: the agent's cgroup root is a
/// unified hierarchy, and a host-process task runs in its own cgroup with
/// the device program gpuctl generates. Checked from outside (the cgroup's
/// members, /proc/PID/cgroup) and from inside (what opens), also across a
/// SIGKILLed and restarted agent.
#[test]
fn host_processes_on_cgroup_v2_are_confined_by_gpuctls_device_program() {
    let required = std::env::var("GPUCTL_REQUIRE_DOCKER").as_deref() == Ok("1");
    if !nix::unistd::Uid::effective().is_root() {
        assert!(!required, "cgroup v2 isolation needs root");
        eprintln!("skipped: needs root");
        return;
    }
    let top = format!("gpuctl-test-v2-{}", std::process::id());
    let Some(cg2) = gpuctl_tests::Cgroup2::mount(&top) else {
        assert!(!required, "cannot mount cgroup2");
        eprintln!("skipped: cannot mount cgroup2");
        return;
    };
    let mut s = setup_with(
        "v2",
        "process",
        vec!["--cgroup-root".into(), cg2.path().display().to_string()],
    );
    // setup() named the parent gpuctl-test-v2-PID/AGENT.
    assert!(s.parent.starts_with(&top), "{}", s.parent);
    let dev = s.dev.display().to_string();
    let script = format!("{}\ncat /proc/self/cgroup\nsleep 2\n", probe_script(&dev));
    let j = s.c.submit(&[
        "--name", "v2", "--gpus", "1", "--mem", "32", "--", "sh", "-c", &script,
    ]);
    let job = s.c.wait_state(&j, "RUNNING", Duration::from_secs(30));
    let (task, gpus) = task_of(&job);
    let minor = s.minors[&gpus[0]];
    let cgroup = cg2.path().join(&s.parent).join(&task);
    // From outside: the task's process is a member, and nothing else is.
    let members = procs(&cgroup);
    assert!(!members.is_empty(), "no process in {}", cgroup.display());
    for pid in &members {
        let own = read(Path::new(&format!("/proc/{pid}/cgroup")));
        assert!(
            own.lines().any(|l| l == format!("0::/{}/{task}", s.parent)),
            "{pid}: {own}"
        );
    }
    // memory.max where the memory controller is on v2 (here it is bound to
    // the v1 hierarchy, so the file is absent; the limit unit test covers
    // the write).
    if let Ok(max) = std::fs::read_to_string(cgroup.join("memory.max")) {
        assert_eq!(max.trim(), "33554432");
    }
    assert_eq!(s.c.wait_job(&j, 30).0, 0);
    let out = s.c.ok(&["jobs", "logs", &j]);
    assert_only_its_gpu(&out, Some(minor));
    assert!(
        out.lines().any(|l| l == format!("0::/{}/{task}", s.parent)),
        "it ran in its cgroup from its first instruction:\n{out}"
    );
    wait_for(Duration::from_secs(10), "the task's cgroup removed", || {
        !cgroup.exists()
    });

    // Without GPUs: every GPU and the control device are denied.
    let j =
        s.c.submit(&["--name", "v2-none", "--", "sh", "-c", &probe_script(&dev)]);
    assert_eq!(s.c.wait_job(&j, 30).0, 0);
    let out = s.c.ok(&["jobs", "logs", &j]);
    assert_only_its_gpu(&out, None);

    // The agent is SIGKILLed and restarted under a running task: the task
    // lives on in its cgroup, still confined (the kernel keeps the program
    // attached with no agent holding it).
    let looping = format!(
        "while true; do\n{}echo round\nsleep 0.3\ndone\n",
        probe_script(&dev)
    );
    let j = s.c.submit(&[
        "--name", "v2-long", "--gpus", "1", "--", "sh", "-c", &looping,
    ]);
    let job = s.c.wait_state(&j, "RUNNING", Duration::from_secs(30));
    let (task, gpus) = task_of(&job);
    let minor = s.minors[&gpus[0]];
    let cgroup = cg2.path().join(&s.parent).join(&task);
    let before = procs(&cgroup);
    assert!(!before.is_empty());
    s.c.restart_agent(0);
    wait_for(Duration::from_secs(30), "the agent back", || {
        s.c.json(&["agents", "list", "--json"])[0]["state"] == "ACTIVE"
    });
    assert_eq!(procs(&cgroup), before, "the task's processes, unchanged");
    let rounds = |out: &str| out.lines().filter(|l| *l == "round").count();
    let seen = rounds(&s.c.ok(&["jobs", "logs", &j]));
    wait_for(
        Duration::from_secs(20),
        "more rounds after the restart",
        || rounds(&s.c.ok(&["jobs", "logs", &j])) >= seen + 3,
    );
    let out = s.c.ok(&["jobs", "logs", &j]);
    let last: Vec<&str> = out.lines().rev().take(40).collect();
    for i in 0..4u32 {
        let want = if i == minor { ENXIO } else { EPERM };
        let l = last
            .iter()
            .find(|l| l.starts_with(&format!("open{i} ")))
            .unwrap_or_else(|| panic!("no open{i} in:\n{out}"));
        assert!(l.contains(want), "open{i} after the restart: {l}");
    }
    s.c.ok(&["jobs", "cancel", &j]);
    assert_eq!(s.c.wait_job(&j, 30).1, "CANCELLED");
    wait_for(
        Duration::from_secs(10),
        "the cancelled task's cgroup removed",
        || !cgroup.exists(),
    );
    drop(s);
    drop(cg2);
}

/// The agent's check of a started container (`gpuctl-agent probe-devices`
/// from the container's cgroups), against real containers: one given its
/// GPU and the control node passes; one whose cgroup allows every NVIDIA
/// device (what a wrong runtime or driver setting gives) is caught, and
/// the error names each GPU it could open. The agent runs the same check
/// after every container it starts, so the Docker tests above pass it too.
#[test]
fn the_device_check_catches_a_container_that_can_open_other_gpus() {
    use gpuctl_agent::isolation::probe::{check, probe};
    if !docker_or_skip("the_device_check_catches_a_container_that_can_open_other_gpus") {
        return;
    }
    let image = gpuctl_tests::busybox_image();
    let dir = gpuctl_tests::test_dir();
    let dev = dir.path().join("dev");
    make_dev_root(&dev, 2);
    let nodes: Vec<PathBuf> = ["nvidia0", "nvidia1", "nvidiactl"]
        .iter()
        .map(|n| dev.join(n))
        .collect();
    let name = |what: &str| format!("gpuctl-test-probe-{what}-{}", std::process::id());
    let run = |what: &str, args: &[String]| -> i64 {
        let _ = std::process::Command::new("docker")
            .args(["rm", "-f", &name(what)])
            .output();
        let out = std::process::Command::new("docker")
            .args(["run", "-d", "--name", &name(what)])
            .args(args)
            .args([image.as_str(), "sleep", "60"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let pid = std::process::Command::new("docker")
            .args(["inspect", "--format", "{{.State.Pid}}", &name(what)])
            .output()
            .unwrap();
        String::from_utf8_lossy(&pid.stdout).trim().parse().unwrap()
    };
    struct Remove(Vec<String>);
    impl Drop for Remove {
        fn drop(&mut self) {
            for n in &self.0 {
                let _ = std::process::Command::new("docker")
                    .args(["rm", "-f", n])
                    .output();
            }
        }
    }
    let _cleanup = Remove(vec![name("good"), name("leaky")]);
    let exe = gpuctl_tests::bin("gpuctl-agent");

    let given = |n: &str| format!("{}:/dev/{n}", dev.join(n).display());
    let good = run(
        "good",
        &[
            "--device".into(),
            given("nvidia1"),
            "--device".into(),
            given("nvidiactl"),
        ],
    );
    let seen = probe(&exe, good, &nodes).unwrap();
    let errno = |p: &Path| seen.iter().find(|(n, _)| n == p).unwrap().1;
    assert_eq!(errno(&nodes[0]), nix::libc::EPERM, "{seen:?}");
    assert_eq!(errno(&nodes[1]), nix::libc::ENXIO, "{seen:?}");
    assert_eq!(errno(&nodes[2]), nix::libc::ENXIO, "{seen:?}");
    check(&seen, &nodes[1..]).unwrap();

    let leaky = run(
        "leaky",
        &[
            "--device".into(),
            given("nvidia1"),
            "--device-cgroup-rule".into(),
            "c 195:* rwm".into(),
        ],
    );
    let seen = probe(&exe, leaky, &nodes).unwrap();
    let err = check(&seen, &[nodes[1].clone()]).unwrap_err();
    assert!(
        err.contains(&format!("{} not given", nodes[0].display())),
        "{err}"
    );
    assert!(
        err.contains(&format!("{} not given", nodes[2].display())),
        "{err}"
    );
    assert!(!err.contains("nvidia1"), "{err}");
}
