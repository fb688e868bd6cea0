//! MIG devices in the state machine and the built-in scheduler: a MIG
//! device is given once, only to a job of its profile, never together with
//! its parent; placement, gangs, bundle/spread, wait reasons and
//! preemption treat it as a device of its parent GPU.

use gpuctl_core::types::{
    device_count, GpuInfo, JobSpec, MigDevice, MigInfo, MigProfile, PlacementPolicy, Resources,
    TaskState,
};
use gpuctl_core::wait::{NeverFits, Requirement, WaitReason};

use super::testkit::{register, status, Driver};
use super::{ApplyError, Command, Outcome};
use crate::scheduler::queue::{self, QueueConfig};

fn mig(uuid: &str, profile: &str, memory_mib: u64, gi: u32) -> MigDevice {
    let slices = profile
        .split('g')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1);
    MigDevice {
        uuid: uuid.into(),
        profile: profile.into(),
        memory_mib,
        gpu_slices: slices,
        compute_slices: slices,
        gi_id: gi,
        ci_id: 0,
        caps_minors: vec![gi * 10 + 1, gi * 10 + 2],
    }
}

fn mig_gpu(uuid: &str, index: u32, model: &str, devices: Vec<MigDevice>) -> GpuInfo {
    let mut g = GpuInfo::new(uuid, index, model, 81920);
    let table: &[(&str, u32, u64, u32)] = if model.contains("H100") {
        &[("1g.10gb", 1, 9984, 7), ("3g.40gb", 3, 40192, 2)]
    } else {
        &[
            ("1g.5gb", 1, 4864, 7),
            ("2g.10gb", 2, 9856, 3),
            ("3g.20gb", 3, 20096, 2),
        ]
    };
    g.mig = MigInfo {
        enabled: true,
        pending: None,
        devices,
        free: Vec::new(),
        capable: true,
        profiles: table
            .iter()
            .map(|(name, gpu_slices, memory_mib, max_count)| MigProfile {
                name: name.to_string(),
                gpu_slices: *gpu_slices,
                memory_mib: *memory_mib,
                max_count: *max_count,
            })
            .collect(),
    };
    g
}

/// Agent `id`: GPU 0 an A100 split 3g.20gb + 2g.10gb + 1g.5gb, GPU 1 an
/// H100 in seven 1g.10gb (`MIG-<id>-h<n>`), GPU 2 a whole A100.
fn mig_agent(id: &str) -> Command {
    let a100 = mig_gpu(
        &format!("GPU-{id}-a"),
        0,
        "NVIDIA A100-SXM4-40GB",
        vec![
            mig(&format!("MIG-{id}-a3"), "3g.20gb", 20096, 2),
            mig(&format!("MIG-{id}-a2"), "2g.10gb", 9856, 3),
            mig(&format!("MIG-{id}-a1"), "1g.5gb", 4864, 9),
        ],
    );
    let h100 = mig_gpu(
        &format!("GPU-{id}-h"),
        1,
        "NVIDIA H100 80GB HBM3",
        (0..7)
            .map(|i| mig(&format!("MIG-{id}-h{i}"), "1g.10gb", 9984, 7 + i))
            .collect(),
    );
    let whole = GpuInfo::new(format!("GPU-{id}-w"), 2, "NVIDIA A100-SXM4-40GB", 40960);
    let mut c = register(id, 0);
    if let Command::RegisterAgent { info, .. } = &mut c {
        info.gpus = vec![a100, h100, whole];
        info.total.gpus = device_count(&info.gpus);
    }
    c
}

fn spec(mig: Option<&str>, gpus: u32, replicas: u32, priority: i32) -> JobSpec {
    let mut s = JobSpec::new(
        "j",
        vec!["true".into()],
        Resources {
            cpus: 1.0,
            mem_mib: 64,
            gpus,
            ports: 0,
        },
    );
    s.placement.mig = mig.map(String::from);
    s.replicas = replicas;
    s.priority = priority;
    s
}

fn driver() -> Driver {
    let mut d = Driver::new(&[]);
    d.apply(mig_agent("m")).unwrap();
    d
}

/// A refused launch changes nothing but the applied index.
fn refused(d: &mut Driver, job: &str, gpus: &[&str]) -> String {
    let before = d.s.clone();
    let err = d.launch_at(job, &[("m", gpus)], 5).unwrap_err();
    let mut after = d.s.clone();
    after.applied_index = before.applied_index;
    assert_eq!(after, before, "a refused launch changed the state: {err}");
    err.to_string()
}

#[test]
fn the_agent_counts_its_devices() {
    let d = driver();
    // 3 + 7 MIG devices and one whole GPU; the MIG-mode GPUs not whole.
    assert_eq!(d.s.agent("m").unwrap().info.total.gpus, 11);
}

#[test]
fn a_mig_device_is_given_once_only_to_its_profile_and_never_with_its_parent() {
    let mut d = driver();
    let j1 = d.submit(spec(Some("1g.10gb"), 1, 1, 0));
    d.launch_at(&j1, &[("m", &["MIG-m-h0"])], 5).unwrap();
    assert_eq!(d.s.gpu_owner("MIG-m-h0"), Some(&format!("{j1}.0")));

    let j2 = d.submit(spec(Some("1g.10gb"), 1, 1, 0));
    let err = refused(&mut d, &j2, &["MIG-m-h0"]);
    assert!(err.contains("MIG-m-h0"), "{err}");
    // Its parent, whole, to a job of the profile or to a whole-GPU job.
    let err = refused(&mut d, &j2, &["GPU-m-h"]);
    assert!(err.contains("whole GPU"), "{err}");
    let whole = d.submit(spec(None, 1, 1, 0));
    let err = refused(&mut d, &whole, &["GPU-m-h"]);
    assert!(err.contains("MIG mode"), "{err}");
    // Another profile's device, and a MIG device to a whole-GPU job.
    let err = refused(&mut d, &j2, &["MIG-m-a1"]);
    assert!(err.contains("1g.5gb"), "{err}");
    let err = refused(&mut d, &whole, &["MIG-m-h1"]);
    assert!(err.contains("MIG device"), "{err}");
    // Two launches of one command naming one device.
    let j3 = d.submit(spec(Some("1g.10gb"), 1, 1, 0));
    let before = d.s.clone();
    let err = d
        .apply(Command::LaunchTasks {
            launches: [&j2, &j3]
                .iter()
                .map(|j| crate::state::Launch {
                    job_id: (*j).clone(),
                    agent_id: "m".into(),
                    gpu_uuids: vec!["MIG-m-h1".into()],
                })
                .collect(),
            at_ms: 5,
        })
        .unwrap_err();
    assert!(matches!(err, ApplyError::GpuTaken { .. }), "{err}");
    assert_eq!(d.s.gpu_owners(), before.gpu_owners());

    // Its task ends: the device is free for the next job of the profile.
    d.apply(Command::UpdateTaskStatus {
        update: status("m", &format!("{j1}.0"), TaskState::Finished),
        at_ms: 6,
    })
    .unwrap();
    assert_eq!(d.s.gpu_owner("MIG-m-h0"), None);
    d.launch_at(&j2, &[("m", &["MIG-m-h0"])], 7).unwrap();
    assert!(
        d.s.invariant_violations().is_empty(),
        "{:?}",
        d.s.invariant_violations()
    );
}

#[test]
fn a_mig_device_of_a_cordoned_or_failing_parent_is_not_given() {
    let mut d = driver();
    let j = d.submit(spec(Some("1g.10gb"), 1, 1, 0));
    d.apply(Command::CordonGpu {
        uuid: "GPU-m-h".into(),
        cordon: true,
    })
    .unwrap();
    let err = refused(&mut d, &j, &["MIG-m-h2"]);
    assert!(err.contains("cordoned"), "{err}");
    assert!(d.place().is_empty(), "placed on a cordoned parent");
}

#[test]
fn the_scheduler_places_each_profile_on_its_devices() {
    let mut d = driver();
    let gang = d.submit(spec(Some("1g.10gb"), 1, 3, 0));
    let two = d.submit(spec(Some("2g.10gb"), 1, 1, 0));
    let whole = d.submit(spec(None, 1, 1, 0));
    let l = d.place();
    let of = |job: &str| -> Vec<String> {
        l.iter()
            .filter(|x| x.job_id == job)
            .flat_map(|x| x.gpu_uuids.clone())
            .collect()
    };
    let g = of(&gang);
    assert_eq!(g.len(), 3, "{l:?}");
    assert!(g.iter().all(|u| u.starts_with("MIG-m-h")), "{g:?}");
    let mut distinct = g.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 3, "a device given twice: {g:?}");
    assert_eq!(of(&two), vec!["MIG-m-a2".to_string()]);
    assert_eq!(of(&whole), vec!["GPU-m-w".to_string()]);
    // The state takes the scheduler's launches as they are.
    d.apply(Command::LaunchTasks {
        launches: l,
        at_ms: 5,
    })
    .unwrap();
    assert!(d.s.invariant_violations().is_empty());
    // Two whole GPUs: only one is not in MIG mode.
    let big = d.submit(spec(None, 2, 1, 0));
    assert!(d.place().iter().all(|x| x.job_id != big));
}

#[test]
fn bundle_packs_mig_devices_and_spread_spreads_them() {
    let mut d = Driver::new(&[]);
    // Two H100s in seven 1g.10gb each, one device of the second held.
    let mut c = mig_agent("m");
    if let Command::RegisterAgent { info, .. } = &mut c {
        let mut second = info.gpus[1].clone();
        second.uuid = "GPU-m-h2nd".into();
        second.index = 3;
        for d in &mut second.mig.devices {
            d.uuid = d.uuid.replace("MIG-m-h", "MIG-m-x");
        }
        info.gpus.push(second);
        info.total.gpus = device_count(&info.gpus);
    }
    d.apply(c).unwrap();
    let first = d.submit(spec(Some("1g.10gb"), 1, 1, 0));
    d.launch_at(&first, &[("m", &["MIG-m-x3"])], 5).unwrap();

    let mut next = |policy| {
        let mut s = spec(Some("1g.10gb"), 1, 1, 0);
        s.placement.policy = Some(policy);
        let j = d.submit(s);
        let l = d.place();
        let got = l
            .iter()
            .find(|x| x.job_id == j)
            .map(|x| x.gpu_uuids[0].clone())
            .unwrap();
        d.apply(Command::CancelJob {
            job_id: j,
            at_ms: 6,
        })
        .unwrap();
        got
    };
    // Bundle: next to the held device, keeping the other GPU whole.
    assert!(next(PlacementPolicy::Bundle).starts_with("MIG-m-x"));
    // Spread: on the GPU with the most free devices.
    assert!(next(PlacementPolicy::Spread).starts_with("MIG-m-h"));
}

#[test]
fn a_missing_profile_is_named_in_the_wait_reason() {
    let mut d = driver();
    let j = d.submit(spec(Some("7g.80gb"), 1, 1, 0));
    let w = queue::wait_reason(&d.s, &QueueConfig::default(), &j).unwrap();
    match &w.reason {
        WaitReason::NeverFits {
            why:
                NeverFits::Missing {
                    need: Requirement::Gpus(ask),
                    ..
                },
            ..
        } => assert_eq!(ask.mig.as_deref(), Some("7g.80gb")),
        other => panic!("{other:?}"),
    }
    // In words, as `gpuctl jobs get` shows it.
    let wire = gpuctl_core::pb::WaitReason::from(&w);
    let words = gpuctl_core::wait::Waiting::try_from(&wire)
        .unwrap()
        .to_string();
    assert!(words.contains("MIG device 7g.80gb"), "{words}");
}

#[test]
fn a_busy_profile_waits_for_a_device_and_preempts_only_its_kind() {
    let mut d = driver();
    // The only 1g.5gb is held by a low-priority job; the whole GPU by
    // another.
    let low = d.submit(spec(Some("1g.5gb"), 1, 1, 0));
    d.launch_at(&low, &[("m", &["MIG-m-a1"])], 5).unwrap();
    let low_whole = d.submit(spec(None, 1, 1, 0));
    d.launch_at(&low_whole, &[("m", &["GPU-m-w"])], 5).unwrap();
    let high = d.submit(spec(Some("1g.5gb"), 1, 1, 10));
    assert!(d.place().is_empty());
    let plan = queue::plan(&d.s, &QueueConfig::default());
    let p = plan.preemption.expect("a preemption for the high job");
    assert_eq!(p.job_id, high);
    assert_eq!(p.victims, vec![low], "only the holder of a 1g.5gb");
}

fn set_layout(d: &mut Driver, gpu: &str, profiles: &[&str]) -> Result<Outcome, ApplyError> {
    d.apply(Command::SetMigLayout {
        gpu_uuid: gpu.into(),
        profiles: profiles.iter().map(|p| p.to_string()).collect(),
        disable: false,
        by: "test".into(),
        at_ms: 10,
    })
}

#[test]
fn a_layout_change_is_refused_while_anything_holds_the_gpu() {
    let mut d = driver();
    let j = d.submit(spec(Some("1g.10gb"), 1, 1, 0));
    d.launch_at(&j, &[("m", &["MIG-m-h4"])], 5).unwrap();
    let before = d.s.clone();
    let err = set_layout(&mut d, "GPU-m-h", &["3g.40gb", "3g.40gb"]).unwrap_err();
    assert!(err.to_string().contains("MIG-m-h4"), "{err}");
    assert!(err.to_string().contains(&format!("{j}.0")), "{err}");
    assert_eq!(d.s.mig_change("GPU-m-h"), None);
    assert_eq!(d.s.gpu_owners(), before.gpu_owners());
    // A GPU without MIG, and one nobody has.
    let err = set_layout(&mut d, "GPU-m-w", &["1g.5gb"]).unwrap_err();
    assert!(err.to_string().contains("has no MIG"), "{err}");
    assert!(set_layout(&mut d, "GPU-nope", &[]).is_err());
}

#[test]
fn a_gpu_being_repartitioned_gets_nothing_until_its_agent_reports() {
    let mut d = driver();
    set_layout(&mut d, "GPU-m-h", &["3g.40gb", "3g.40gb"]).unwrap();
    let generation = d.s.mig_change("GPU-m-h").unwrap().generation;
    assert_eq!(generation, d.i, "the change is named by its log index");
    // A second change waits for the first.
    assert!(set_layout(&mut d, "GPU-m-h", &[]).is_err());
    // Neither the old devices nor the GPU are given meanwhile.
    let j = d.submit(spec(Some("1g.10gb"), 1, 1, 0));
    let err = refused(&mut d, &j, &["MIG-m-h0"]);
    assert!(err.contains("repartitioned"), "{err}");
    assert!(d.place().is_empty(), "placed on a GPU being repartitioned");

    // The agent reports what NVML holds now: two 3g.40gb.
    let mut after = d.s.agent("m").unwrap().info.gpus[1].clone();
    after.mig.devices = vec![
        mig("MIG-m-n0", "3g.40gb", 40192, 1),
        mig("MIG-m-n1", "3g.40gb", 40192, 2),
    ];
    // A report of another generation changes nothing.
    d.apply(Command::MigLayoutDone {
        agent_id: "m".into(),
        generation: generation + 100,
        gpu: after.clone(),
        error: None,
    })
    .unwrap();
    assert!(d.s.mig_change("GPU-m-h").is_some());
    d.apply(Command::MigLayoutDone {
        agent_id: "m".into(),
        generation,
        gpu: after,
        error: None,
    })
    .unwrap();
    assert!(d.s.mig_change("GPU-m-h").is_none());
    // 3 (A100) + 2 (new) + 1 whole.
    assert_eq!(d.s.agent("m").unwrap().info.total.gpus, 6);
    let big = d.submit(spec(Some("3g.40gb"), 1, 2, 0));
    let l = d.place();
    let mut got: Vec<String> = l
        .iter()
        .filter(|x| x.job_id == big)
        .flat_map(|x| x.gpu_uuids.clone())
        .collect();
    got.sort();
    assert_eq!(got, ["MIG-m-n0", "MIG-m-n1"]);
    assert!(d.s.invariant_violations().is_empty());
}

#[test]
fn a_failed_change_keeps_what_nvml_holds_and_says_why() {
    let mut d = driver();
    set_layout(&mut d, "GPU-m-h", &["7g.80gb", "7g.80gb"]).unwrap();
    let generation = d.s.mig_change("GPU-m-h").unwrap().generation;
    let now = d.s.agent("m").unwrap().info.gpus[1].clone();
    d.apply(Command::MigLayoutDone {
        agent_id: "m".into(),
        generation,
        gpu: now,
        error: Some("no room for 7g.80gb; the previous layout was put back".into()),
    })
    .unwrap();
    assert!(d.s.mig_error("GPU-m-h").unwrap().contains("put back"));
    assert_eq!(d.s.agent("m").unwrap().info.total.gpus, 11);
    // The old devices are given again.
    let j = d.submit(spec(Some("1g.10gb"), 1, 1, 0));
    d.launch_at(&j, &[("m", &["MIG-m-h0"])], 20).unwrap();
}

fn auto(d: &Driver) -> Vec<(String, Vec<String>)> {
    crate::scheduler::mig_auto::mig_auto_commands(&d.s, 50)
        .into_iter()
        .map(|c| match c {
            Command::SetMigLayout {
                gpu_uuid,
                profiles,
                by,
                ..
            } => {
                assert_eq!(by, "mig-auto");
                (gpu_uuid, profiles)
            }
            other => panic!("{other:?}"),
        })
        .collect()
}

#[test]
fn mig_auto_splits_an_idle_gpu_for_a_profile_nothing_offers() {
    let mut d = driver();
    // 1g.10gb: seven free devices cover it; nothing to do.
    d.submit(spec(Some("1g.10gb"), 1, 1, 0));
    assert!(auto(&d).is_empty());
    let big = d.submit(spec(Some("3g.40gb"), 1, 2, 0));
    // The only GPU that offers 3g.40gb is the H100, and a queued job
    // wants its 1g.10gb devices: never taken from what waits.
    assert!(auto(&d).is_empty());
    d.apply(Command::CancelJob {
        job_id: "job-1".into(),
        at_ms: 5,
    })
    .unwrap();
    assert_eq!(
        auto(&d),
        [("GPU-m-h".to_string(), vec!["3g.40gb".to_string(); 2])]
    );
    // Asked (through the log, as the leader does), it is not asked twice.
    for c in crate::scheduler::mig_auto::mig_auto_commands(&d.s, 50) {
        d.apply(c).unwrap();
    }
    assert!(auto(&d).is_empty(), "a change under way makes the profile");
    let generation = d.s.mig_change("GPU-m-h").unwrap().generation;
    let mut after = d.s.agent("m").unwrap().info.gpus[1].clone();
    after.mig.devices = vec![
        mig("MIG-m-n0", "3g.40gb", 40192, 1),
        mig("MIG-m-n1", "3g.40gb", 40192, 2),
    ];
    d.apply(Command::MigLayoutDone {
        agent_id: "m".into(),
        generation,
        gpu: after,
        error: None,
    })
    .unwrap();
    let l = d.place();
    assert_eq!(l.iter().filter(|x| x.job_id == big).count(), 2, "{l:?}");
    assert!(auto(&d).is_empty());
}

#[test]
fn mig_auto_never_touches_a_busy_gpu_or_one_that_does_not_qualify() {
    let mut d = driver();
    let held = d.submit(spec(Some("1g.10gb"), 1, 1, 0));
    d.launch_at(&held, &[("m", &["MIG-m-h6"])], 5).unwrap();
    d.submit(spec(Some("3g.40gb"), 1, 1, 0));
    assert!(auto(&d).is_empty(), "the H100 has running work");
    d.apply(Command::CancelJob {
        job_id: held.clone(),
        at_ms: 6,
    })
    .unwrap();
    d.apply(Command::UpdateTaskStatus {
        update: status("m", &format!("{held}.0"), TaskState::Killed),
        at_ms: 7,
    })
    .unwrap();
    assert_eq!(auto(&d).len(), 1);
    // A job on another model, or a cordoned GPU: no candidate.
    let mut other = spec(Some("3g.40gb"), 1, 1, 0);
    other.placement.gpu_model = Some("A100*".into());
    let mut d2 = driver();
    d2.submit(other);
    assert!(auto(&d2).is_empty(), "no A100 offers 3g.40gb");
    d.apply(Command::CordonGpu {
        uuid: "GPU-m-h".into(),
        cordon: true,
    })
    .unwrap();
    assert!(auto(&d).is_empty());
}

#[test]
fn a_change_of_a_gpu_its_agent_no_longer_has_is_forgotten() {
    let mut d = driver();
    set_layout(&mut d, "GPU-m-h", &["3g.40gb"]).unwrap();
    // Registering again with it: the change stays (the agent finishes it).
    d.apply(mig_agent("m")).unwrap();
    assert!(d.s.mig_change("GPU-m-h").is_some());
    // Without it (the GPU fell off the bus and the agent restarted).
    let mut c = mig_agent("m");
    if let Command::RegisterAgent { info, .. } = &mut c {
        info.gpus.remove(1);
        info.total.gpus = device_count(&info.gpus);
    }
    d.apply(c).unwrap();
    assert!(d.s.mig_change("GPU-m-h").is_none());
}

#[test]
fn a_framework_launches_on_a_mig_device_and_never_on_its_parent() {
    use gpuctl_core::types::{FrameworkInfo, FrameworkTask};
    let mut d = driver();
    let f = match d
        .apply(Command::SubscribeFramework {
            request_id: None,
            info: FrameworkInfo {
                id: String::new(),
                name: "fw".into(),
                roles: vec!["ml".into()],
                gpu_capable: true,
                failover_timeout_ms: 60_000,
                tenant: Default::default(),
            },
            at_ms: 1,
        })
        .unwrap()
    {
        Outcome::FrameworkSubscribed { framework_id } => framework_id,
        o => panic!("{o:?}"),
    };
    let task = |id: &str, gpu: &str| FrameworkTask {
        task_id: id.into(),
        agent_id: "m".into(),
        image: None,
        command: vec!["true".into()],
        env: Default::default(),
        resources: Resources {
            cpus: 1.0,
            mem_mib: 64,
            gpus: 1,
            ports: 0,
        },
        gpu_uuids: vec![gpu.into()],
        fraction: None,
    };
    let launch = |d: &mut Driver, t: FrameworkTask| match d
        .apply(Command::LaunchFrameworkTasks {
            framework_id: f.clone(),
            tasks: vec![t],
            group: false,
            at_ms: 2,
        })
        .unwrap()
    {
        Outcome::FrameworkTasksLaunched {
            launched, refused, ..
        } => (launched, refused),
        o => panic!("{o:?}"),
    };
    let (ok, _) = launch(&mut d, task("t1", "MIG-m-h3"));
    assert_eq!(ok, ["t1"]);
    assert!(d.s.gpu_owner("MIG-m-h3").is_some());
    // The same device again, and the parent whole: refused.
    let (ok, refused) = launch(&mut d, task("t2", "MIG-m-h3"));
    assert!(ok.is_empty(), "{refused:?}");
    let (ok, refused) = launch(&mut d, task("t3", "GPU-m-h"));
    assert!(ok.is_empty());
    assert!(format!("{refused:?}").contains("MIG mode"), "{refused:?}");
    assert!(d.s.invariant_violations().is_empty());
}
