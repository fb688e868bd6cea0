//! MIG end to end: real master, agent and gpuctl binaries; the fake NVML
//! machine `mig` (an A100 split 3g.20gb + 2g.10gb + 1g.5gb, an H100 in
//! seven 1g.10gb, an A100 out of MIG mode) on a copy of its config, which
//! the fake rewrites as GPU instances are created and destroyed (NVML's
//! own view, read here from outside gpuctl); device nodes made with mknod
//! (`nvidiaN`, and every `nvidia-caps/nvidia-capN` the driver's
//! `mig-minors` names); real cgroup v1 device rules. A node a task may
//! open gives ENXIO (no driver behind it), a denied one EPERM.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuctl_tests::{
    cgroup_v1_or_skip, fake_nvml_config, fake_nvml_lib, make_dev_root, root_or_skip, wait_for,
    AgentOpts, Cluster, Gpuctl,
};
use serde_json::Value;

const ENXIO: &str = "No such device or address";
const EPERM: &str = "Operation not permitted";
/// The caps nodes' major (dynamic on a real host; free on this one).
const CAPS_MAJOR: u64 = 241;

struct Setup {
    c: Cluster,
    /// The fake's config: NVML's state, rewritten by its create/destroy.
    machine: PathBuf,
    dev: PathBuf,
    parent: String,
}

impl Drop for Setup {
    fn drop(&mut self) {
        for ctrl in std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = std::fs::remove_dir_all(ctrl.path().join(&self.parent));
        }
    }
}

/// The caps minor of a GPU instance (`ci: None`) or of a compute instance,
/// as this test's `mig-minors` numbers them.
fn caps_minor(gpu_minor: u32, gi: u32, ci: Option<u32>) -> u32 {
    3 + gpu_minor * 200 + gi * 9 + ci.map_or(0, |c| c + 1)
}

/// `mig-minors` for GPUs 0 and 1, every GPU instance id (0-14) and compute
/// instance id (0-7), as the driver lists them, and their nodes.
fn make_caps(proc_root: &Path, dev: &Path) {
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    let mut lines = vec!["config 1".to_string(), "monitor 2".to_string()];
    let mut minors = vec![1, 2];
    for gpu in 0..2 {
        for gi in 0..15 {
            let m = caps_minor(gpu, gi, None);
            lines.push(format!("gpu{gpu}/gi{gi}/access {m}"));
            minors.push(m);
            for ci in 0..8 {
                let m = caps_minor(gpu, gi, Some(ci));
                lines.push(format!("gpu{gpu}/gi{gi}/ci{ci}/access {m}"));
                minors.push(m);
            }
        }
    }
    let dir = proc_root.join("driver/nvidia-caps");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("mig-minors"), lines.join("\n") + "\n").unwrap();
    std::fs::create_dir_all(dev.join("nvidia-caps")).unwrap();
    for m in minors {
        mknod(
            &dev.join(format!("nvidia-caps/nvidia-cap{m}")),
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            makedev(CAPS_MAJOR, u64::from(m)),
        )
        .unwrap();
    }
}

/// A master and an agent on a copy of the `mig` machine whose H100 has no
/// busy instance (the stock config keeps one busy, as a process outside
/// gpuctl would), with `env` for the agent.
fn setup(name: &str, env: Vec<(String, String)>) -> Setup {
    setup_with(name, env, &[], vec![])
}

/// [`setup`], with flags for the master and `args` for the agent.
fn setup_with(name: &str, env: Vec<(String, String)>, master: &[&str], args: Vec<String>) -> Setup {
    let mut c = Cluster::start(master);
    let machine = c.dir.path().join("mig.json");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(fake_nvml_config("mig")).unwrap()).unwrap();
    for i in cfg["gpus"][1]["mig"]["instances"].as_array_mut().unwrap() {
        i.as_object_mut().unwrap().remove("busy");
    }
    std::fs::write(&machine, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    let dev = c.dir.path().join("dev");
    make_dev_root(&dev, 3);
    let proc_root = c.dir.path().join("proc");
    make_caps(&proc_root, &dev);
    let parent = format!("gpuctl-test-{name}-{}", std::process::id());
    let mut extra = vec![
        "--nvml-lib".into(),
        fake_nvml_lib().display().to_string(),
        "--dev-root".into(),
        dev.display().to_string(),
        "--nvidia-proc-root".into(),
        proc_root.display().to_string(),
        "--cgroup-parent".into(),
        parent.clone(),
    ];
    extra.extend(args);
    let mut agent_env = vec![(
        "FAKE_NVML_CONFIG".to_string(),
        machine.display().to_string(),
    )];
    agent_env.extend(env);
    c.add_agent(AgentOpts {
        simulate_gpus: None,
        extra,
        env: agent_env,
        ..Default::default()
    });
    Setup {
        c,
        machine,
        dev,
        parent,
    }
}

impl Setup {
    /// `gpus --json`, by index.
    fn gpus(&self) -> Vec<Value> {
        let mut g = self.c.json(&["gpus", "--json"]).as_array().unwrap().clone();
        g.sort_by_key(|g| g["index"].as_u64());
        g
    }

    /// The profiles of GPU `index`'s MIG devices, as the master has them.
    fn master_profiles(&self, index: usize) -> Vec<String> {
        let mut p: Vec<String> = self.gpus()[index]["mig"]["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["profile"].as_str().unwrap().to_string())
            .collect();
        p.sort();
        p
    }

    /// The profiles of GPU `index`'s GPU instances, as NVML (the fake's
    /// file) has them, and its MIG mode.
    fn nvml_profiles(&self, index: usize) -> (bool, Vec<String>) {
        let cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(&self.machine).unwrap()).unwrap();
        let mig = &cfg["gpus"][index]["mig"];
        let mut p: Vec<String> = mig["instances"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|i| i["profile"].as_str().unwrap().to_string())
                    .collect()
            })
            .unwrap_or_default();
        p.sort();
        (mig["mode"].as_bool().unwrap_or(false), p)
    }

    fn uuid(&self, index: usize) -> String {
        self.gpus()[index]["uuid"].as_str().unwrap().to_string()
    }

    /// `gpuctl gpus mig set`, its exit code and output.
    fn mig_set(&self, args: &[&str]) -> (i32, String) {
        let mut all = vec!["gpus", "mig", "set"];
        all.extend_from_slice(args);
        let out = self.c.gpuctl(&all);
        (
            out.status.code().unwrap_or(-1),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    }
}

/// A script that opens each of `nodes` (relative to `dev`) and says how.
fn probe(dev: &Path, nodes: &[String]) -> String {
    let mut s = String::new();
    for n in nodes {
        s.push_str(&format!(
            "if cat {dev}/{n} 2>/tmp/gpuctl-e$$; then echo \"{n}: ok\"; else echo \"{n}: $(cat /tmp/gpuctl-e$$)\"; fi\n",
            dev = dev.display()
        ));
    }
    s.push_str("echo \"visible=$NVIDIA_VISIBLE_DEVICES\"\necho \"cuda=$CUDA_VISIBLE_DEVICES\"\n");
    s
}

fn line<'a>(out: &'a str, prefix: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line {prefix:?} in:\n{out}"))
}

fn cap(m: u32) -> String {
    format!("nvidia-caps/nvidia-cap{m}")
}

/// A job asking for a MIG profile gets one MIG device of it: its
/// variables name the MIG device, and its cgroup lets it open exactly its
/// parent's node, its two caps and the control node; every other GPU and
/// caps node (another MIG device's, the driver's config and monitor caps)
/// is denied.
#[test]
fn a_mig_job_gets_its_device_and_only_its_caps() {
    if !root_or_skip("a_mig_job_gets_its_device_and_only_its_caps")
        || !cgroup_v1_or_skip("a_mig_job_gets_its_device_and_only_its_caps")
    {
        return;
    }
    let s = setup("mig-iso", vec![]);
    let gpus = s.gpus();
    let a100 = &gpus[0]["mig"]["devices"];
    let small = a100
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["profile"] == "1g.5gb")
        .unwrap();
    let other = a100
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["profile"] == "3g.20gb")
        .unwrap();
    let caps_of = |d: &Value| -> Vec<u32> {
        d["caps_minors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_u64().unwrap() as u32)
            .collect()
    };
    let (mine, theirs) = (caps_of(small), caps_of(other));
    assert_eq!(mine.len(), 2, "{small}");
    let mut nodes = vec![
        "nvidia0".to_string(),
        "nvidia1".into(),
        "nvidia2".into(),
        "nvidiactl".into(),
        cap(1),
        cap(2),
    ];
    nodes.extend(mine.iter().map(|m| cap(*m)));
    nodes.extend(theirs.iter().map(|m| cap(*m)));
    let script = probe(&s.dev, &nodes);
    let j = s.c.submit(&[
        "--name", "mig", "--mig", "1g.5gb", "--", "sh", "-c", &script,
    ]);
    assert_eq!(s.c.wait_job(&j, 60).0, 0, "{}", s.c.diagnostics());
    let job = s.c.job(&j);
    let uuid = small["uuid"].as_str().unwrap();
    assert_eq!(job["tasks"][0]["gpus"], serde_json::json!([uuid]), "{job}");
    let out = s.c.ok(&["jobs", "logs", &j]);
    assert_eq!(line(&out, "visible="), format!("visible={uuid}"));
    assert_eq!(line(&out, "cuda="), format!("cuda={uuid}"));
    for (node, want) in [
        ("nvidia0:", ENXIO),
        ("nvidiactl:", ENXIO),
        ("nvidia1:", EPERM),
        ("nvidia2:", EPERM),
        ("nvidia-caps/nvidia-cap1:", EPERM),
        ("nvidia-caps/nvidia-cap2:", EPERM),
    ] {
        assert!(line(&out, node).contains(want), "{node} {want}:\n{out}");
    }
    for m in &mine {
        let l = line(&out, &format!("{}:", cap(*m)));
        assert!(l.contains(ENXIO), "its own cap {m}: {l}\n{out}");
    }
    for m in &theirs {
        let l = line(&out, &format!("{}:", cap(*m)));
        assert!(l.contains(EPERM), "another's cap {m}: {l}\n{out}");
    }
    // A profile no GPU has waits, and says which.
    let w =
        s.c.submit(&["--name", "huge", "--mig", "7g.80gb", "--", "true"]);
    s.c.wait_state(&w, "QUEUED", Duration::from_secs(10));
    let mut text = String::new();
    wait_for(Duration::from_secs(15), "its wait reason", || {
        text = s.c.ok(&["jobs", "get", &w]);
        text.contains("no agent has 1 MIG device 7g.80gb")
    });
    assert!(
        text.contains("GPUs:      1 (a MIG device 7g.80gb each)"),
        "{text}"
    );
}

/// `gpus mig set` repartitions an idle GPU through NVML and the master
/// places the new devices; a GPU with running work is refused, a GPU that
/// needs a reset to enter MIG mode says so and is left as it was, and
/// `--disable` gives a GPU back whole.
#[test]
fn gpus_mig_set_repartitions_idle_gpus_only() {
    if !root_or_skip("gpus_mig_set_repartitions_idle_gpus_only") {
        return;
    }
    let s = setup("mig-set", vec![]);
    let h100 = s.uuid(1);
    // Busy: a task on one of its MIG devices.
    let busy =
        s.c.submit(&["--name", "busy", "--mig", "1g.10gb", "--", "sleep", "60"]);
    s.c.wait_state(&busy, "RUNNING", Duration::from_secs(30));
    let (code, out) = s.mig_set(&[&h100, "--profiles", "3g.40gb,3g.40gb"]);
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("running work"), "{out}");
    assert_eq!(s.nvml_profiles(1).1.len(), 7, "NVML untouched");
    s.c.ok(&["jobs", "cancel", &busy]);
    s.c.wait_state(&busy, "CANCELLED", Duration::from_secs(30));

    // Idle: repartitioned, and the master's view is NVML's.
    let (code, out) = s.mig_set(&[&h100, "--profiles", "3g.40gb,3g.40gb"]);
    assert_eq!(code, 0, "{out}\n{}", s.c.diagnostics());
    assert_eq!(
        s.nvml_profiles(1),
        (true, vec!["3g.40gb".into(), "3g.40gb".into()])
    );
    assert_eq!(s.master_profiles(1), ["3g.40gb", "3g.40gb"]);
    let gang = s.c.submit(&[
        "--name",
        "gang",
        "--mig",
        "3g.40gb",
        "--replicas",
        "2",
        "--",
        "true",
    ]);
    assert_eq!(s.c.wait_job(&gang, 60).0, 0, "{}", s.c.diagnostics());
    let job = s.c.job(&gang);
    let new: Vec<String> = s.gpus()[1]["mig"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["uuid"].as_str().unwrap().to_string())
        .collect();
    for t in job["tasks"].as_array().unwrap() {
        let g = t["gpus"][0].as_str().unwrap();
        assert!(new.iter().any(|n| n == g), "{g} not one of {new:?}");
    }

    // An A100 needs a reset to enter MIG mode: said, and nothing changed.
    let plain = s.uuid(2);
    let (code, out) = s.mig_set(&[&plain, "--profiles", "1g.5gb"]);
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("reset"), "{out}");
    assert_eq!(s.nvml_profiles(2), (false, vec![]));
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(&s.machine).unwrap()).unwrap();
    assert_ne!(
        cfg["gpus"][2]["mig"]["pending"], true,
        "pending mode left set"
    );
    assert_eq!(s.gpus()[2]["mig"]["enabled"], false);

    // --disable: the H100 whole again, and a 2-GPU job gets it.
    let (code, out) = s.mig_set(&[&h100, "--disable"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(s.nvml_profiles(1), (false, vec![]));
    let whole =
        s.c.submit(&["--name", "whole", "--gpus", "2", "--", "true"]);
    assert_eq!(s.c.wait_job(&whole, 60).0, 0, "{}", s.c.diagnostics());
    let mut got: Vec<String> = s.c.job(&whole)["tasks"][0]["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g.as_str().unwrap().to_string())
        .collect();
    got.sort();
    let mut want = vec![h100, plain];
    want.sort();
    assert_eq!(got, want);
}

/// The agent SIGKILLed part way through a repartition (each GPU instance
/// destroy and create takes 400 ms here, and is written to NVML's state at
/// once): the next agent process finishes the change, and afterwards the
/// master's view of the GPU and NVML's agree, with the change recorded.
#[test]
fn an_agent_killed_mid_repartition_finishes_it() {
    if !root_or_skip("an_agent_killed_mid_repartition_finishes_it") {
        return;
    }
    let mut s = setup(
        "mig-kill",
        vec![("FAKE_NVML_MIG_DELAY_MS".into(), "400".into())],
    );
    let h100 = s.uuid(1);
    let (code, out) = s.mig_set(&[&h100, "--profiles", "2g.20gb,2g.20gb,2g.20gb", "--no-wait"]);
    assert_eq!(code, 0, "{out}");
    let intent = s.c.dir.path().join(format!("agent0/mig/{h100}.json"));
    // Part way: the intent written and some of the seven 1g.10gb gone.
    wait_for(Duration::from_secs(30), "the repartition under way", || {
        intent.exists() && (1..7).contains(&s.nvml_profiles(1).1.len())
    });
    s.c.agents[0].kill();
    let (_, half) = s.nvml_profiles(1);
    assert!(half.len() < 7, "{half:?}");
    s.c.restart_agent(0);
    wait_for(Duration::from_secs(60), "the change recorded", || {
        s.gpus()[1]["mig_change"].is_null()
    });
    let (mode, nvml) = s.nvml_profiles(1);
    assert!(mode);
    assert_eq!(nvml, ["2g.20gb", "2g.20gb", "2g.20gb"], "finished");
    assert_eq!(s.master_profiles(1), nvml, "the master's view is NVML's");
    assert!(s.gpus()[1]["mig_error"].is_null(), "{}", s.gpus()[1]);
    assert!(!intent.exists());
    let log = s.c.agents[0].log_text();
    assert!(
        log.contains("a MIG layout change was interrupted: finishing it"),
        "the restarted agent did not find the change part way:\n{log}"
    );
    // And it is used.
    let j =
        s.c.submit(&["--name", "after", "--mig", "2g.20gb", "--", "true"]);
    assert_eq!(s.c.wait_job(&j, 60).0, 0, "{}", s.c.diagnostics());
}

/// `--mig-auto`: a job waiting for a profile no free MIG device offers
/// makes an idle GPU in MIG mode split into that profile, and runs on it;
/// the A100s (one splits another way and is busy, one is out of MIG mode)
/// are left alone.
#[test]
fn mig_auto_repartitions_an_idle_gpu_for_a_waiting_job() {
    if !root_or_skip("mig_auto_repartitions_an_idle_gpu_for_a_waiting_job") {
        return;
    }
    let s = setup_with("mig-auto", vec![], &["--mig-auto"], vec![]);
    // Small cpus: the agent has as many as this machine (2).
    let busy = s.c.submit(&[
        "--name", "busy", "--mig", "1g.5gb", "--cpus", "0.1", "--", "sleep", "60",
    ]);
    s.c.wait_state(&busy, "RUNNING", Duration::from_secs(30));
    let before_a100 = s.nvml_profiles(0);
    let j = s.c.submit(&[
        "--name",
        "wide",
        "--mig",
        "3g.40gb",
        "--replicas",
        "2",
        "--cpus",
        "0.1",
        "--",
        "true",
    ]);
    assert_eq!(s.c.wait_job(&j, 30).0, 0, "{}", s.c.diagnostics());
    assert_eq!(s.c.job(&busy)["state"], "RUNNING");
    assert_eq!(
        s.nvml_profiles(1),
        (true, vec!["3g.40gb".into(), "3g.40gb".into()])
    );
    assert_eq!(s.master_profiles(1), ["3g.40gb", "3g.40gb"]);
    assert_eq!(s.nvml_profiles(0), before_a100, "the busy A100 was touched");
    assert_eq!(s.nvml_profiles(2), (false, vec![]));
    let master_log = s.c.master.log_text();
    assert!(master_log.contains("mig-auto"), "{master_log}");
    s.c.ok(&["jobs", "cancel", &busy]);
}

/// The agent's health probe, in this process on the fake: each MIG device
/// of a GPU in MIG mode is read (memory used and in all, as NVML gives them
/// for the instance; utilization absent, as real drivers do not give it),
/// the set follows NVML's layout at each probe, and a lost parent gives
/// no MIG readings and is unhealthy.
#[test]
fn the_health_probe_reads_each_mig_device_as_nvml_lists_it() {
    use gpuctl_agent::gpu::health::{self, HealthConfig, Snapshot};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    let dir = tempfile::tempdir().unwrap();
    let machine = dir.path().join("mig.json");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(fake_nvml_config("mig")).unwrap()).unwrap();
    cfg["gpus"][1]["mig"]["instances"][0]["memory_used_mib"] = 2048.into();
    let write = |cfg: &Value| {
        let tmp = machine.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(cfg).unwrap()).unwrap();
        std::fs::rename(&tmp, &machine).unwrap();
    };
    write(&cfg);
    // Process-wide, and no other test of this file loads NVML here.
    std::env::set_var("FAKE_NVML_CONFIG", &machine);
    let lib = fake_nvml_lib();
    let discover = || gpuctl_agent::gpu::discover(Some(&lib), dir.path()).gpus;
    let gpus = discover();
    assert_eq!(gpus.len(), 3);
    let (tx, rx) = tokio::sync::watch::channel(Snapshot::default());
    let stop = Arc::new(AtomicBool::new(false));
    let config = HealthConfig {
        interval: Duration::from_millis(100),
        ..Default::default()
    };
    let thread = health::spawn(
        Some(lib.clone()),
        gpus.clone(),
        config,
        None,
        Box::new(Default::default),
        tx,
        std::sync::mpsc::channel().1,
        stop.clone(),
    )
    .unwrap();
    let mig_uuids = |s: &Snapshot, i: usize| -> Vec<String> {
        s.gpus[i].mig.iter().map(|m| m.uuid.clone()).collect()
    };
    let want = |gpus: &[gpuctl_core::types::GpuInfo], i: usize| -> Vec<String> {
        gpus[i].mig.devices.iter().map(|d| d.uuid.clone()).collect()
    };
    let snapshot = || rx.borrow().clone();
    wait_for(Duration::from_secs(10), "the first probe", || {
        let s = snapshot();
        !s.gpus.is_empty() && s.gpus.iter().all(|g| g.sample.is_some())
    });
    let s = snapshot();
    assert_eq!(mig_uuids(&s, 0), want(&gpus, 0));
    assert_eq!(mig_uuids(&s, 1), want(&gpus, 1));
    assert!(s.gpus[2].mig.is_empty(), "out of MIG mode: {:?}", s.gpus[2]);
    let small = s.gpus[0]
        .mig
        .iter()
        .find(|m| m.profile == "1g.5gb")
        .unwrap();
    let d = gpus[0]
        .mig
        .devices
        .iter()
        .find(|d| d.uuid == small.uuid)
        .unwrap();
    assert_eq!(d.profile, "1g.5gb");
    assert_eq!(
        (small.memory_used_mib, small.memory_total_mib),
        (1024, d.memory_mib)
    );
    let first = &s.gpus[1].mig[0];
    assert_eq!(
        (first.memory_used_mib, first.profile.as_str()),
        (2048, "1g.10gb")
    );
    assert_eq!(s.gpus[1].mig[1].memory_used_mib, 0);
    for m in s.gpus.iter().flat_map(|g| &g.mig) {
        assert_eq!(m.utilization_pct, None, "{m:?}");
    }
    assert!(s.gpus.iter().all(|g| g.healthy), "{s:?}");

    // A layout change under the probe: it reads what NVML lists now.
    cfg["gpus"][1]["mig"]["instances"]
        .as_array_mut()
        .unwrap()
        .truncate(3);
    write(&cfg);
    let now = discover();
    assert_eq!(want(&now, 1).len(), 3);
    wait_for(Duration::from_secs(10), "the new layout read", || {
        mig_uuids(&snapshot(), 1) == want(&now, 1)
    });

    // The parent lost: unhealthy, and no MIG readings.
    cfg["gpus"][1]["lost"] = true.into();
    write(&cfg);
    wait_for(Duration::from_secs(10), "the parent lost", || {
        let s = snapshot();
        !s.gpus[1].healthy && s.gpus[1].mig.is_empty()
    });
    assert!(snapshot().gpus[0].healthy);
    stop.store(true, Ordering::Relaxed);
    thread.join().unwrap();
}

/// `/metrics` of `addr`, parsed by an independent parser.
fn scrape(addr: &str) -> prometheus_parse::Scrape {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string())))
        .expect("valid Prometheus text")
}

/// The labels and value of `metric`'s sample for device `uuid`.
fn series(
    scrape: &prometheus_parse::Scrape,
    metric: &str,
    uuid: &str,
) -> Option<(std::collections::HashMap<String, String>, f64)> {
    scrape
        .samples
        .iter()
        .find(|s| s.metric == metric && s.labels.get("uuid") == Some(uuid))
        .map(|s| {
            let v = match s.value {
                prometheus_parse::Value::Gauge(v) | prometheus_parse::Value::Untyped(v) => v,
                ref other => panic!("{metric}: {other:?}"),
            };
            let labels = ["uuid", "gpu", "index", "profile", "task", "job"]
                .iter()
                .filter_map(|k| s.labels.get(k).map(|v| (k.to_string(), v.to_string())))
                .collect();
            (labels, v)
        })
}

/// A MIG job runs; its MIG device's gauges on the agent's `/metrics` name
/// its task. The parent GPU is lost: the task ends FAILED GPU_UNHEALTHY
/// naming the parent, the job is requeued (no retry used) and waits, and
/// no job is given a MIG device of that GPU while it is unhealthy; its MIG
/// devices' gauges are gone.
#[test]
fn a_lost_parent_gpu_fails_its_mig_tasks_and_withdraws_its_mig_devices() {
    if !root_or_skip("a_lost_parent_gpu_fails_its_mig_tasks_and_withdraws_its_mig_devices") {
        return;
    }
    let metrics = format!("127.0.0.1:{}", gpuctl_tests::free_port());
    let s = setup_with(
        "mig-health",
        vec![],
        &[],
        vec![
            "--health-interval-secs".into(),
            "0.2".into(),
            "--health-recovery-secs".into(),
            "3600".into(),
            "--metrics-listen".into(),
            metrics.clone(),
        ],
    );
    let h100 = s.uuid(1);
    let profile_mib = s.gpus()[1]["mig"]["devices"][0]["memory_mib"]
        .as_u64()
        .unwrap();
    // Only the H100 has 1g.10gb devices.
    let job =
        s.c.submit(&["--name", "small", "--mig", "1g.10gb", "--", "sleep", "600"]);
    let j = s.c.wait_state(&job, "RUNNING", Duration::from_secs(30));
    let task = j["tasks"][0]["id"].as_str().unwrap().to_string();
    let mig = j["tasks"][0]["gpus"][0].as_str().unwrap().to_string();
    assert!(mig.starts_with("MIG-"), "{j}");
    let mut seen = None;
    wait_for(Duration::from_secs(20), "the MIG device's gauges", || {
        seen = series(&scrape(&metrics), "gpuctl_mig_memory_total_bytes", &mig);
        seen.as_ref().is_some_and(|(l, _)| l["task"] == task)
    });
    let (labels, total) = seen.unwrap();
    assert_eq!(labels["gpu"], h100, "{labels:?}");
    assert_eq!(labels["index"], "1", "{labels:?}");
    assert_eq!(labels["profile"], "1g.10gb", "{labels:?}");
    assert_eq!(labels["job"], job, "{labels:?}");
    assert_eq!(total, profile_mib as f64 * 1024.0 * 1024.0);
    let a = scrape(&metrics);
    assert_eq!(
        series(&a, "gpuctl_mig_memory_used_bytes", &mig).map(|(_, v)| v),
        Some(0.0)
    );
    assert!(
        series(&a, "gpuctl_mig_utilization_ratio", &mig).is_none(),
        "NVML gives no utilization for a MIG device"
    );

    // The parent falls off the bus.
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(&s.machine).unwrap()).unwrap();
    cfg["gpus"][1]["lost"] = true.into();
    let tmp = s.machine.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    std::fs::rename(&tmp, &s.machine).unwrap();

    wait_for(Duration::from_secs(20), "the H100 unhealthy", || {
        s.gpus()[1]["healthy"] == false
    });
    s.c.wait_state(&job, "QUEUED", Duration::from_secs(30));
    let j = s.c.job_with_reason(&job);
    let t = &j["tasks"][0];
    assert_eq!(t["state"], "FAILED", "{j}");
    assert_eq!(t["reason"], "GPU_UNHEALTHY", "{j}");
    let msg = t["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("GPU {h100} unhealthy")) && msg.contains("GPU is lost"),
        "{msg}"
    );
    assert_eq!(j["retries"], 0, "{j}");
    let reason = j["reason"].as_str().unwrap();
    assert!(reason.contains("requeued after task"), "{reason}");

    // Nothing is placed on its MIG devices meanwhile.
    let other =
        s.c.submit(&["--name", "other", "--mig", "1g.10gb", "--", "true"]);
    std::thread::sleep(Duration::from_secs(3));
    for id in [&job, &other] {
        let j = s.c.job(id);
        assert_eq!(j["state"], "QUEUED", "{j}");
        assert!(
            j["tasks"].as_array().unwrap().len() <= 1,
            "given a MIG device of the lost GPU: {j}"
        );
    }
    let a = scrape(&metrics);
    assert!(
        series(&a, "gpuctl_mig_memory_total_bytes", &mig).is_none(),
        "gauges of a lost GPU's MIG device"
    );
    assert_eq!(
        series(&a, "gpuctl_gpu_healthy", &h100).map(|(_, v)| v),
        Some(0.0)
    );
    // The other GPUs' MIG devices are still read.
    let a100 = s.uuid(0);
    assert!(
        a.samples
            .iter()
            .any(|x| x.metric == "gpuctl_mig_memory_total_bytes"
                && x.labels.get("gpu") == Some(a100.as_str())),
        "the A100's MIG devices"
    );
}
