//! GPU discovery through the real nvml-wrapper against tests/fake-nvml, a
//! libnvidia-ml that describes the machine in a JSON file; and an agent
//! started on it, seen through gpuctl.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Mutex;

use gpuctl_agent::gpu::{discover, labels, Discovery};
use gpuctl_tests::Gpuctl;
use gpuctl_tests::{fake_nvml_config, fake_nvml_lib, AgentOpts, Cluster};
use serde_json::{json, Value};

/// FAKE_NVML_CONFIG is process-wide: one discovery at a time.
static ENV: Mutex<()> = Mutex::new(());

fn discover_with(config: &Path) -> Discovery {
    discover_in(config, Path::new("/nonexistent-proc"))
}

/// Discovery with the driver's /proc files (MIG's `mig-minors`) under
/// `proc_root`.
fn discover_in(config: &Path, proc_root: &Path) -> Discovery {
    let _guard = ENV.lock().unwrap_or_else(|p| p.into_inner());
    std::env::set_var("FAKE_NVML_CONFIG", config);
    discover(Some(&fake_nvml_lib()), proc_root)
}

fn config(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fake_nvml_config(name)).unwrap()).unwrap()
}

/// Writes `machine` to a temp file and discovers it.
fn discover_json(machine: &Value) -> Discovery {
    let dir = gpuctl_tests::test_dir();
    let path = dir.path().join("machine.json");
    std::fs::write(&path, machine.to_string()).unwrap();
    discover_with(&path)
}

fn nvlinks(d: &Discovery, a: usize, b: usize) -> u32 {
    let peer = &d.gpus[b].uuid;
    d.gpus[a]
        .peers
        .iter()
        .find(|p| &p.uuid == peer)
        .map_or(0, |p| p.nvlinks)
}

fn pcie(d: &Discovery, a: usize, b: usize) -> String {
    let peer = &d.gpus[b].uuid;
    d.gpus[a]
        .peers
        .iter()
        .find(|p| &p.uuid == peer)
        .map(|p| p.pcie.clone())
        .unwrap_or_default()
}

/// Every field discovery reports matches the machine description.
fn assert_matches_config(d: &Discovery, cfg: &Value) {
    assert!(d.error.is_none(), "{:?}", d.error);
    assert_eq!(d.driver_version.as_deref(), cfg["driver_version"].as_str());
    let cuda = cfg["cuda_driver_version"].as_u64().unwrap();
    assert_eq!(
        d.cuda_driver_version.as_deref(),
        Some(format!("{}.{}", cuda / 1000, (cuda % 1000) / 10).as_str())
    );
    let gpus = cfg["gpus"].as_array().unwrap();
    assert_eq!(d.gpus.len(), gpus.len());
    for (i, (g, c)) in d.gpus.iter().zip(gpus).enumerate() {
        assert_eq!(g.index as usize, i);
        assert_eq!(g.uuid, c["uuid"].as_str().unwrap());
        assert_eq!(g.model, c["name"].as_str().unwrap());
        assert_eq!(g.memory_mib, c["memory_total_mib"].as_u64().unwrap());
        assert_eq!(u64::from(g.minor), c["minor"].as_u64().unwrap());
        assert_eq!(g.pci_bus_id, c["pci_bus_id"].as_str().unwrap());
        assert_eq!(g.serial, c["serial"].as_str().unwrap());
        assert_eq!(g.numa_node.map(u64::from), c["numa_node"].as_u64());
        let cc = c["compute_capability"].as_array().unwrap();
        assert_eq!(
            g.compute_capability,
            Some((
                cc[0].as_u64().unwrap() as u32,
                cc[1].as_u64().unwrap() as u32
            ))
        );
        assert!(g.healthy, "{}: {}", g.uuid, g.unhealthy_reason);
        assert_eq!(g.peers.len(), gpus.len() - 1);
    }
}

#[test]
fn dgx_a100_eight_gpus_fully_connected_by_nvlink() {
    let cfg = config("dgx-a100");
    let d = discover_with(&fake_nvml_config("dgx-a100"));
    assert_matches_config(&d, &cfg);
    assert_eq!(d.gpus.len(), 8);
    for a in 0..8 {
        for b in 0..8 {
            if a != b {
                assert!(nvlinks(&d, a, b) > 0, "GPU{a} - GPU{b} has no NVLink");
                assert_eq!(nvlinks(&d, a, b), nvlinks(&d, b, a));
            }
        }
    }
    let l = labels(
        &d.gpus,
        d.driver_version.as_deref(),
        d.cuda_driver_version.as_deref(),
    );
    assert_eq!(l["nvidia.com/gpu.product"], "NVIDIA-A100-SXM4-40GB");
    assert_eq!(l["nvidia.com/gpu.count"], "8");
    assert_eq!(l["nvidia.com/gpu.memory"], "40960");
    assert_eq!(l["nvidia.com/gpu.family"], "ampere");
    assert_eq!(l["nvidia.com/gpu.compute.major"], "8");
}

#[test]
fn mixed_host_one_nvlink_pair_and_pcie_only_t4s() {
    let cfg = config("mixed");
    let d = discover_with(&fake_nvml_config("mixed"));
    assert_matches_config(&d, &cfg);
    assert_eq!(d.gpus.len(), 4);
    assert!(d.gpus[0].model.contains("V100"));
    assert!(d.gpus[2].model.contains("T4"));
    // The V100 pair: two NVLink links; nothing else has NVLink.
    assert_eq!(nvlinks(&d, 0, 1), 2);
    assert_eq!(nvlinks(&d, 1, 0), 2);
    for (a, b) in [(0, 2), (0, 3), (1, 2), (2, 3), (3, 1)] {
        assert_eq!(nvlinks(&d, a, b), 0, "GPU{a} - GPU{b}");
    }
    // PCIe paths come from NVML's common ancestor: the T4s sit behind
    // different switches of one NUMA node.
    assert_eq!(pcie(&d, 2, 3), "NODE");
    let l = labels(&d.gpus, None, None);
    assert_eq!(l["nvidia.com/gpu.product"], "Tesla-T4,Tesla-V100-SXM2-16GB");
    assert_eq!(l["nvidia.com/gpu.family"], "volta");
}

#[test]
fn a_driver_without_gpus_reports_none() {
    let d = discover_with(&fake_nvml_config("none"));
    assert!(d.error.is_none(), "{:?}", d.error);
    assert!(d.gpus.is_empty());
    assert!(d.driver_version.is_some());
}

#[test]
fn init_failure_and_missing_library_give_zero_gpus_and_a_reason() {
    let mut cfg = config("mixed");
    cfg["init_error"] = json!("DRIVER_NOT_LOADED");
    let d = discover_json(&cfg);
    assert!(d.gpus.is_empty());
    let err = d.error.unwrap();
    assert!(err.contains("NVML unavailable"), "{err}");
    assert!(err.to_lowercase().contains("driver"), "{err}");

    let d = discover(
        Some(Path::new("/nonexistent/libnvidia-ml.so.1")),
        Path::new("/proc"),
    );
    assert!(d.gpus.is_empty());
    assert!(d.error.unwrap().contains("/nonexistent/libnvidia-ml.so.1"));
}

#[test]
fn a_lost_gpu_is_reported_unhealthy_not_hidden() {
    let mut cfg = config("mixed");
    cfg["gpus"][2]["lost"] = json!(true);
    let d = discover_json(&cfg);
    assert_eq!(d.gpus.len(), 4);
    let lost = &d.gpus[2];
    assert_eq!(lost.uuid, cfg["gpus"][2]["uuid"].as_str().unwrap());
    assert!(!lost.healthy);
    assert!(
        lost.unhealthy_reason.to_lowercase().contains("lost"),
        "{}",
        lost.unhealthy_reason
    );
    assert!(d.gpus.iter().enumerate().all(|(i, g)| i == 2 || g.healthy));
}

#[test]
fn an_unsupported_optional_query_does_not_make_a_gpu_unhealthy() {
    let mut cfg = config("mixed");
    cfg["gpus"][3]["errors"] = json!({ "nvmlDeviceGetNumaNodeId": "NOT_SUPPORTED" });
    let d = discover_json(&cfg);
    assert!(d.gpus[3].healthy, "{}", d.gpus[3].unhealthy_reason);
    assert_eq!(d.gpus[3].numa_node, None);
}

#[test]
fn agent_on_fake_nvml_shows_its_gpus_in_gpuctl() {
    let cfg = config("mixed");
    let mut c = Cluster::start(&[]);
    let agent = c.add_agent(AgentOpts {
        simulate_gpus: None,
        extra: vec!["--nvml-lib".into(), fake_nvml_lib().display().to_string()],
        env: vec![(
            "FAKE_NVML_CONFIG".into(),
            fake_nvml_config("mixed").display().to_string(),
        )],
        ..Default::default()
    });
    let gpus = c.json(&["gpus", "--json"]);
    let gpus = gpus.as_array().unwrap();
    assert_eq!(gpus.len(), 4);
    for (g, want) in gpus.iter().zip(cfg["gpus"].as_array().unwrap()) {
        assert_eq!(g["uuid"], want["uuid"]);
        assert_eq!(g["model"], want["name"]);
        assert_eq!(g["memory_mib"], want["memory_total_mib"]);
        assert_eq!(g["minor"], want["minor"]);
        assert_eq!(g["agent_id"], agent.as_str());
        assert_eq!(g["healthy"], true);
        assert!(g["task_id"].is_null());
    }
    let described = c.json(&["agents", "describe", &agent, "--json"]);
    assert_eq!(described["simulated_gpus"], false);
    assert_eq!(described["driver_version"], cfg["driver_version"]);
    assert_eq!(described["attributes"]["nvidia.com/gpu.count"], json!("4"));
    let text = c.ok(&["agents", "describe", &agent]);
    let row0 = text
        .lines()
        .skip_while(|l| !l.starts_with("Topology:"))
        .find(|l| l.starts_with("GPU0"))
        .unwrap();
    assert_eq!(
        row0.split_whitespace().take(3).collect::<Vec<_>>(),
        vec!["GPU0", "X", "NV2"],
        "{text}"
    );
    // A job asking for a GPU gets one of the fake machine's GPUs.
    let j = c.submit(&["--name", "on-fake", "--gpus", "1", "--", "true"]);
    assert_eq!(c.wait_job(&j, 30).0, 0);
    let held = c.job(&j)["tasks"][0]["gpus"][0].clone();
    assert!(cfg["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .any(|g| g["uuid"] == held));
}

#[test]
fn agent_whose_nvml_init_fails_runs_with_zero_gpus_and_says_why_once() {
    let dir = gpuctl_tests::test_dir();
    let machine = dir.path().join("broken.json");
    let mut cfg = config("mixed");
    cfg["init_error"] = json!("DRIVER_NOT_LOADED");
    std::fs::write(&machine, cfg.to_string()).unwrap();
    let mut c = Cluster::start(&[]);
    let agent = c.add_agent(AgentOpts {
        simulate_gpus: None,
        extra: vec!["--nvml-lib".into(), fake_nvml_lib().display().to_string()],
        env: vec![("FAKE_NVML_CONFIG".into(), machine.display().to_string())],
        ..Default::default()
    });
    let described = c.json(&["agents", "describe", &agent, "--json"]);
    assert_eq!(described["gpus"], json!([]));
    assert_eq!(described["total"]["gpus"], 0);
    let log = c.agents[0].log_text();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("NVML unavailable"))
        .collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(lines[0].contains("reporting zero GPUs"), "{}", lines[0]);
    // It still runs CPU-only work.
    let j = c.submit(&["--name", "cpu-only", "--", "true"]);
    assert_eq!(c.wait_job(&j, 30).0, 0);
}

/// Issue 33: a GPU in MIG mode is reported with its MIG devices (through
/// the real nvml-wrapper and the raw calls it lacks): uuid, profile,
/// memory, slices, GPU and compute instance ids, the capability minors
/// from the driver's `mig-minors` (under the proc root given), and the
/// profiles it could still host. A GPU out of MIG mode reports it off.
#[test]
fn mig_devices_are_discovered_with_their_caps_and_free_profiles() {
    let proc_root = tempfile::tempdir().unwrap();
    let caps = proc_root.path().join("driver/nvidia-caps");
    std::fs::create_dir_all(&caps).unwrap();
    // As the driver writes it: the parent's /dev/nvidia minor, then the
    // GPU instance's and compute instance's access minors.
    std::fs::write(
        caps.join("mig-minors"),
        "config 1\nmonitor 2\ngpu0/gi2/access 21\ngpu0/gi2/ci0/access 22\n\
         gpu0/gi3/access 30\ngpu0/gi3/ci0/access 31\ngpu0/gi9/access 84\n\
         gpu0/gi9/ci0/access 85\ngpu1/gi1/access 147\ngpu1/gi1/ci0/access 148\n",
    )
    .unwrap();
    let d = discover_in(&fake_nvml_config("mig"), proc_root.path());
    assert!(d.error.is_none(), "{:?}", d.error);
    assert_eq!(d.gpus.len(), 3);

    let a100 = &d.gpus[0];
    assert!(a100.healthy, "{}", a100.unhealthy_reason);
    assert!(a100.mig.enabled);
    assert_eq!(a100.mig.pending, None);
    let got: Vec<String> = a100
        .mig
        .devices
        .iter()
        .map(|m| {
            format!(
                "{} {} MiB, {} slices, gi {} ci {}, caps {:?}",
                m.profile, m.memory_mib, m.gpu_slices, m.gi_id, m.ci_id, m.caps_minors
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            "3g.20gb 19968 MiB, 3 slices, gi 2 ci 0, caps [21, 22]",
            "2g.10gb 9856 MiB, 2 slices, gi 3 ci 0, caps [30, 31]",
            "1g.5gb 4864 MiB, 1 slices, gi 9 ci 0, caps [84, 85]",
        ]
    );
    for m in &a100.mig.devices {
        assert!(m.uuid.starts_with("MIG-"), "{}", m.uuid);
        assert_ne!(m.uuid, a100.uuid);
    }
    // Slices 0-1 (2g), 2 (1g) and 4-7 (3g) are taken: one 1g.5gb fits.
    let free: Vec<(&str, u32)> = a100
        .mig
        .free
        .iter()
        .map(|c| (c.profile.as_str(), c.count))
        .collect();
    assert_eq!(free, vec![("1g.5gb", 1)]);

    let h100 = &d.gpus[1];
    assert!(h100.mig.enabled);
    assert_eq!(h100.mig.devices.len(), 7);
    assert!(h100.mig.devices.iter().all(|m| m.profile == "1g.10gb"));
    assert_eq!(h100.mig.devices[0].caps_minors, vec![147, 148]);
    // Not in the file: no minors rather than wrong ones.
    assert!(h100.mig.devices[1].caps_minors.is_empty());
    assert!(h100.mig.free.is_empty(), "{:?}", h100.mig.free);
    let uuids: std::collections::BTreeSet<&str> =
        h100.mig.devices.iter().map(|m| m.uuid.as_str()).collect();
    assert_eq!(uuids.len(), 7);

    let plain = &d.gpus[2];
    assert!(!plain.mig.enabled);
    assert!(plain.mig.devices.is_empty());
}

/// Issue 33: an agent on a MIG machine reports its MIG devices, and
/// `gpuctl gpus` and `agents describe` show them under their parent, with
/// the profiles the parent could still host.
#[test]
fn gpuctl_shows_mig_devices_under_their_parent() {
    let proc_root = gpuctl_tests::test_dir();
    let caps = proc_root.path().join("driver/nvidia-caps");
    std::fs::create_dir_all(&caps).unwrap();
    std::fs::write(
        caps.join("mig-minors"),
        "gpu0/gi2/access 21\ngpu0/gi2/ci0/access 22\n",
    )
    .unwrap();
    let mut c = Cluster::start(&[]);
    let agent = c.add_agent(AgentOpts {
        simulate_gpus: None,
        extra: vec![
            "--nvml-lib".into(),
            fake_nvml_lib().display().to_string(),
            "--nvidia-proc-root".into(),
            proc_root.path().display().to_string(),
        ],
        env: vec![(
            "FAKE_NVML_CONFIG".into(),
            fake_nvml_config("mig").display().to_string(),
        )],
        ..Default::default()
    });
    let gpus = c.json(&["gpus", "--json"]);
    let gpus = gpus.as_array().unwrap();
    assert_eq!(gpus.len(), 3);
    let a100 = &gpus[0]["mig"];
    assert_eq!(a100["enabled"], true);
    let profiles: Vec<&str> = a100["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["profile"].as_str().unwrap())
        .collect();
    assert_eq!(profiles, vec!["3g.20gb", "2g.10gb", "1g.5gb"]);
    assert_eq!(a100["devices"][0]["caps_minors"], json!([21, 22]));
    assert_eq!(a100["free"], json!([{"profile": "1g.5gb", "count": 1}]));
    assert_eq!(gpus[1]["mig"]["devices"].as_array().unwrap().len(), 7);
    // An A100 out of MIG mode: it has MIG, off.
    assert_eq!(gpus[2]["mig"]["enabled"], false, "{}", gpus[2]);
    assert_eq!(gpus[2]["mig"]["capable"], true, "{}", gpus[2]);
    let names: Vec<&str> = gpus[1]["mig"]["profiles"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"1g.10gb") && names.contains(&"7g.80gb"),
        "{names:?}"
    );

    let table = c.ok(&["gpus"]);
    let mig_uuid = a100["devices"][0]["uuid"].as_str().unwrap();
    let row = table
        .lines()
        .find(|l| l.contains(mig_uuid))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(
        row.contains("└ gi2") && row.contains("MIG 3g.20gb"),
        "{row}"
    );
    assert!(
        table
            .lines()
            .any(|l| l.contains("└ free") && l.contains("1g.5gb x1")),
        "{table}"
    );
    assert!(table.contains("NVIDIA A100-SXM4-40GB [MIG]"), "{table}");
    let described = c.ok(&["agents", "describe", &agent]);
    assert!(described.contains(mig_uuid), "{described}");
    assert!(described.contains("MIG 1g.10gb"), "{described}");
    let json = c.json(&["agents", "describe", &agent, "--json"]);
    assert_eq!(json["gpus"][1]["mig"]["devices"][6]["profile"], "1g.10gb");
    // A whole-GPU job gets the one GPU out of MIG mode, never a parent.
    let j = c.submit(&["--name", "whole", "--gpus", "1", "--", "true"]);
    assert_eq!(c.wait_job(&j, 30).0, 0);
    assert_eq!(c.job(&j)["tasks"][0]["gpus"][0], gpus[2]["uuid"]);
}

/// NVML on the fake library with `config` (process-wide: one at a time).
fn with_nvml<R>(config: &Path, f: impl FnOnce(&nvml_wrapper::Nvml) -> R) -> R {
    let _guard = ENV.lock().unwrap_or_else(|p| p.into_inner());
    std::env::set_var("FAKE_NVML_CONFIG", config);
    let nvml = nvml_wrapper::Nvml::builder()
        .lib_path(fake_nvml_lib().as_os_str())
        .init()
        .unwrap();
    f(&nvml)
}

fn profiles_of(config: &Path, index: u32) -> Vec<String> {
    let mut p: Vec<String> = discover_with(config).gpus[index as usize]
        .mig
        .devices
        .iter()
        .map(|m| m.profile.clone())
        .collect();
    p.sort();
    p
}

/// Issue 33 (dynamic MIG, the NVML part): a GPU in MIG mode is
/// repartitioned all or nothing. A layout that fits replaces the old one;
/// one that cannot be made (a GPU instance in use, no room) puts the old
/// layout back at its placements and says why; an unknown profile or a GPU
/// out of MIG mode changes nothing.
#[test]
fn a_mig_layout_is_set_all_or_nothing() {
    use gpuctl_agent::gpu::mig_layout::{layout, set_layout, LayoutError};
    let dir = gpuctl_tests::test_dir();
    // The fake writes its layout back to the file: a copy of its own.
    let machine = dir.path().join("mig.json");
    std::fs::copy(fake_nvml_config("mig"), &machine).unwrap();
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();

    // The A100 (3g + 2g + 1g): two 3g.20gb instead.
    with_nvml(&machine, |nvml| {
        let dev = nvml.device_by_index(0).unwrap();
        set_layout(nvml, &dev, &names(&["3g.20gb", "3g.20gb"])).unwrap();
        let now = layout(nvml, &dev).unwrap();
        let starts: Vec<(String, u32)> = now.iter().map(|p| (p.profile.clone(), p.start)).collect();
        assert_eq!(
            starts,
            vec![("3g.20gb".to_string(), 0), ("3g.20gb".to_string(), 4)]
        );
        // The same again is nothing to do.
        set_layout(nvml, &dev, &names(&["3g.20gb", "3g.20gb"])).unwrap();
    });
    assert_eq!(profiles_of(&machine, 0), names(&["3g.20gb", "3g.20gb"]));
    let a100 = &discover_with(&machine).gpus[0];
    assert!(a100.mig.free.is_empty(), "{:?}", a100.mig.free);

    // No room for a 1g.5gb beside a 7g.40gb: the two 3g.20gb come back.
    with_nvml(&machine, |nvml| {
        let dev = nvml.device_by_index(0).unwrap();
        let before = layout(nvml, &dev).unwrap();
        let err = set_layout(nvml, &dev, &names(&["7g.40gb", "1g.5gb"])).unwrap_err();
        assert!(matches!(err, LayoutError::RolledBack { .. }), "{err}");
        assert!(err.to_string().contains("1g.5gb"), "{err}");
        assert_eq!(layout(nvml, &dev).unwrap(), before);
        // An unknown profile: refused before anything is touched.
        let err = set_layout(nvml, &dev, &names(&["9g.99gb"])).unwrap_err();
        assert!(matches!(err, LayoutError::UnknownProfile(..)), "{err}");
        assert!(err.to_string().contains("7g.40gb"), "{err}");
        assert_eq!(layout(nvml, &dev).unwrap(), before);
    });

    // The H100's last 1g.10gb is in use: nothing changes.
    with_nvml(&machine, |nvml| {
        let dev = nvml.device_by_index(1).unwrap();
        let before = layout(nvml, &dev).unwrap();
        assert_eq!(before.len(), 7);
        let err = set_layout(nvml, &dev, &names(&["7g.80gb"])).unwrap_err();
        assert!(matches!(err, LayoutError::RolledBack { .. }), "{err}");
        assert!(err.to_string().to_lowercase().contains("in use"), "{err}");
        assert_eq!(layout(nvml, &dev).unwrap(), before);
        // The GPU out of MIG mode is not repartitioned.
        let plain = nvml.device_by_index(2).unwrap();
        let err = set_layout(nvml, &plain, &names(&["1g.5gb"])).unwrap_err();
        assert!(matches!(err, LayoutError::NotMig), "{err}");
    });
    assert_eq!(profiles_of(&machine, 1), vec!["1g.10gb".to_string(); 7]);
}

/// Issue 34 item 4: each task's GPU memory through the real nvml-wrapper.
/// NVML's compute and MPS lists (the fake answers the same for both) are
/// read per GPU, each pid is given to the task whose cgroup holds it (a
/// fake `/proc`), memory NVML cannot tell is left out, and a GPU whose
/// list fails (lost, an error) is left out without hiding the others.
#[test]
fn each_tasks_gpu_memory_comes_from_nvmls_process_lists() {
    use gpuctl_agent::gpu::procs::{gpu_processes, task_gpu_memory, GpuProcess, TaskCgroups};
    let dir = gpuctl_tests::test_dir();
    let gpu = |i: usize, processes: Value| {
        json!({
            "uuid": format!("GPU-{i}"), "name": "NVIDIA A100-SXM4-40GB",
            "processes": processes,
        })
    };
    let mut machine = json!({ "gpus": [
        gpu(0, json!([
            {"pid": 100, "memory_used_mib": 3000},
            {"pid": 101, "memory_used_mib": 174},
            {"pid": 200, "memory_used_mib": 512},
            {"pid": 300, "memory_used_mib": 64},
            {"pid": 201},
        ])),
        gpu(1, json!([{"pid": 100, "memory_used_mib": 1024}])),
        gpu(2, json!([{"pid": 200, "memory_used_mib": 1}])),
        gpu(3, json!([])),
    ]});
    machine["gpus"][2]["lost"] = json!(true);
    let path = dir.path().join("machine.json");
    std::fs::write(&path, machine.to_string()).unwrap();
    // Host processes of job-1.0 (one in a child cgroup), a container of
    // job-2.0 inside its task's cgroup, the MPS daemon.
    let proc_root = dir.path().join("proc");
    for (pid, cgroup) in [
        (100, "0::/gpuctl/agent-1/job-1.0\n"),
        (101, "0::/gpuctl/agent-1/job-1.0/sub\n"),
        (
            200,
            "4:devices:/gpuctl/agent-1/job-2.0/0123abcd\n1:name=systemd:/\n",
        ),
        (201, "0::/gpuctl/agent-1/job-2.0\n"),
        (300, "0::/system.slice/nvidia-mps.service\n"),
    ] {
        std::fs::create_dir_all(proc_root.join(pid.to_string())).unwrap();
        std::fs::write(proc_root.join(format!("{pid}/cgroup")), cgroup).unwrap();
    }
    let cgroups = TaskCgroups {
        parent: "gpuctl/agent-1".into(),
        containers: Default::default(),
    };
    let uuids: Vec<String> = (0..5).map(|i| format!("GPU-{i}")).collect();
    let got = with_nvml(&path, |nvml| {
        let p = gpu_processes(nvml, "GPU-1").unwrap();
        assert_eq!(
            p,
            [GpuProcess {
                pid: 100,
                used_bytes: 1024 << 20
            }]
        );
        assert!(gpu_processes(nvml, "GPU-3").unwrap().is_empty());
        let lost = gpu_processes(nvml, "GPU-2").unwrap_err().to_string();
        assert!(lost.contains("GPU-2"), "{lost}");
        task_gpu_memory(nvml, &uuids, &proc_root, &cgroups)
    });
    let want: gpuctl_agent::gpu::procs::TaskGpuMemory = [
        (
            "job-1.0".to_string(),
            [("GPU-0".to_string(), 3174), ("GPU-1".to_string(), 1024)].into(),
        ),
        ("job-2.0".to_string(), [("GPU-0".to_string(), 512)].into()),
    ]
    .into();
    assert_eq!(got, want);

    // An error on the compute list hides the GPU's tasks; one on the MPS
    // list alone does not (the compute list has them).
    machine["gpus"][1]["errors"] =
        json!({"nvmlDeviceGetComputeRunningProcesses_v3": "NO_PERMISSION"});
    machine["gpus"][0]["errors"] =
        json!({"nvmlDeviceGetMPSComputeRunningProcesses_v3": "NOT_SUPPORTED"});
    std::fs::write(&path, machine.to_string()).unwrap();
    let got = with_nvml(&path, |nvml| {
        task_gpu_memory(nvml, &uuids, &proc_root, &cgroups)
    });
    assert_eq!(got["job-1.0"], [("GPU-0".to_string(), 3174)].into());
    assert_eq!(got["job-2.0"]["GPU-0"], 512);
}

/// `gpuctl-agent check` reports the machine NVML describes, through the
/// agent's own discovery (what `gpuctl demo` and an operator read).
#[test]
fn agent_check_reports_the_gpus_and_driver_nvml_finds() {
    let run = |machine: &str| {
        let out = std::process::Command::new(gpuctl_tests::bin("gpuctl-agent"))
            .args(["check", "--json", "--no-docker", "--nvml-lib"])
            .arg(fake_nvml_lib())
            .env("FAKE_NVML_CONFIG", fake_nvml_config(machine))
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let report: Value = serde_json::from_slice(&out.stdout).unwrap();
        report
    };
    let want = config("dgx-a100");
    let report = run("dgx-a100");
    let gpus = report["gpus"].as_array().unwrap();
    assert_eq!(
        gpus.len(),
        want["gpus"].as_array().unwrap().len(),
        "{report}"
    );
    assert!(gpus.iter().all(|g| g["healthy"] == json!(true)), "{report}");
    assert!(
        gpus[0]["model"].as_str().unwrap().contains("A100"),
        "{report}"
    );
    let uuids: Vec<&Value> = gpus.iter().map(|g| &g["uuid"]).collect();
    let want_uuids: Vec<&Value> = want["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| &g["uuid"])
        .collect();
    assert_eq!(uuids, want_uuids, "{report}");
    assert_eq!(report["driver_version"], want["driver_version"], "{report}");
    assert_eq!(report["nvml_error"], Value::Null, "{report}");
    assert_eq!(report["docker"], Value::Null, "--no-docker: {report}");

    let none = run("none");
    assert_eq!(none["gpus"], json!([]), "{none}");
}
