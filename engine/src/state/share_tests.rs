//! Fractions of shared GPUs in the state machine and the built-in
//! scheduler: never more memory nor more than 100% of compute given than
//! a GPU has, a shared GPU never given whole nor split into MIG devices.

use gpuctl_core::types::{
    FrameworkInfo, GpuFraction, JobSpec, Resources, ShareMode, TaskReason, TaskShare, TaskState,
};
use proptest::prelude::*;

use super::frameworks::task_key;
use super::testkit::{register, status, Driver};
use super::{ApplyError, Command, FrameworkTask, Outcome, State};

/// Agent `a` with two A100s of 40960 MiB (`GPU-a-0`, `GPU-a-1`).
fn driver() -> Driver {
    Driver::new(&[("a", 2)])
}

fn share(d: &mut Driver, gpu: &str, mode: Option<ShareMode>) -> Result<Outcome, ApplyError> {
    d.apply(Command::ShareGpu {
        gpu_uuid: gpu.into(),
        mode,
    })
}

fn spec(fraction: Option<(u64, u32)>, gpus: u32) -> JobSpec {
    let mut s = JobSpec::new(
        "f",
        vec!["true".into()],
        Resources {
            cpus: 0.5,
            mem_mib: 64,
            gpus,
            ports: 0,
        },
    );
    s.placement.fraction = fraction.map(|(mem_mib, compute_pct)| GpuFraction {
        mem_mib,
        compute_pct,
    });
    s
}

/// What breaks the fraction invariant, in words.
fn violations(s: &State) -> Vec<String> {
    let mut bad = s.invariant_violations();
    for a in s.agents().values() {
        for g in &a.info.gpus {
            let (m, c) = s.share_used(&a.info.id, &g.uuid);
            if m > g.memory_mib || c > 100 {
                bad.push(format!("{} over-committed: {m} MiB, {c}%", g.uuid));
            }
            if s.share_mode(&g.uuid).is_some() && s.gpu_owner(&g.uuid).is_some() {
                bad.push(format!("{} shared and held whole", g.uuid));
            }
            if s.share_mode(&g.uuid).is_none() && m > 0 {
                bad.push(format!("{} not shared but holds fractions", g.uuid));
            }
        }
    }
    bad
}

#[test]
fn a_shared_gpu_takes_fractions_up_to_its_memory_and_compute_only() {
    let mut d = driver();
    share(&mut d, "GPU-a-0", Some(ShareMode::TimeSlice)).unwrap();
    // Four quarters of 40960 MiB fit; a fifth does not.
    for _ in 0..4 {
        let j = d.submit(spec(Some((10240, 0)), 0));
        d.launch_at(&j, &[("a", &["GPU-a-0"])], 2).unwrap();
    }
    assert_eq!(d.s.share_used("a", "GPU-a-0"), (40960, 0));
    let j = d.submit(spec(Some((1, 0)), 0));
    let before = d.s.clone();
    let err = d.launch_at(&j, &[("a", &["GPU-a-0"])], 2).unwrap_err();
    assert!(err.to_string().contains("0 MiB"), "{err}");
    let mut after = d.s.clone();
    after.applied_index = before.applied_index;
    assert_eq!(after, before, "a refused fraction changed the state");
    // Not to a GPU that is not shared, nor to two GPUs.
    let err = d.launch_at(&j, &[("a", &["GPU-a-1"])], 2).unwrap_err();
    assert!(err.to_string().contains("not shared"), "{err}");
    let err = d
        .launch_at(&j, &[("a", &["GPU-a-0", "GPU-a-1"])], 2)
        .unwrap_err();
    assert!(err.to_string().contains("one GPU"), "{err}");
    // Compute: 60% + 50% is over.
    share(&mut d, "GPU-a-1", Some(ShareMode::TimeSlice)).unwrap();
    let a = d.submit(spec(Some((100, 60)), 0));
    d.launch_at(&a, &[("a", &["GPU-a-1"])], 2).unwrap();
    let b = d.submit(spec(Some((100, 50)), 0));
    let err = d.launch_at(&b, &[("a", &["GPU-a-1"])], 2).unwrap_err();
    assert!(err.to_string().contains("40%"), "{err}");
    // Two fractions in one command count together.
    let c = d.submit(spec(Some((100, 30)), 0));
    let e = d.submit(spec(Some((100, 30)), 0));
    let err = d
        .apply(Command::LaunchTasks {
            launches: [&c, &e]
                .iter()
                .map(|j| crate::state::Launch {
                    job_id: (*j).clone(),
                    agent_id: "a".into(),
                    gpu_uuids: vec!["GPU-a-1".into()],
                })
                .collect(),
            at_ms: 3,
        })
        .unwrap_err();
    assert!(err.to_string().contains("compute"), "{err}");
    assert!(violations(&d.s).is_empty(), "{:?}", violations(&d.s));
}

#[test]
fn a_shared_gpu_is_never_given_whole_nor_split_and_stays_shared_while_held() {
    let mut d = driver();
    let whole = d.submit(spec(None, 1));
    d.launch_at(&whole, &[("a", &["GPU-a-1"])], 2).unwrap();
    // Held whole: not shared until that ends.
    let err = share(&mut d, "GPU-a-1", Some(ShareMode::TimeSlice)).unwrap_err();
    assert!(err.to_string().contains("held whole"), "{err}");
    share(&mut d, "GPU-a-0", Some(ShareMode::TimeSlice)).unwrap();
    let w2 = d.submit(spec(None, 1));
    let err = d.launch_at(&w2, &[("a", &["GPU-a-0"])], 2).unwrap_err();
    assert!(err.to_string().contains("shared"), "{err}");
    assert!(
        d.place().iter().all(|l| l.job_id != w2),
        "placed whole on a shared GPU"
    );
    let err = d
        .apply(Command::SetMigLayout {
            gpu_uuid: "GPU-a-0".into(),
            profiles: vec![],
            disable: false,
            by: "t".into(),
            at_ms: 2,
        })
        .unwrap_err();
    assert!(err.to_string().contains("shared"), "{err}");
    // A fraction held: not unshared, nor switched to another mode.
    let f = d.submit(spec(Some((512, 0)), 0));
    d.launch_at(&f, &[("a", &["GPU-a-0"])], 2).unwrap();
    assert!(share(&mut d, "GPU-a-0", None).is_err());
    assert!(share(&mut d, "GPU-a-0", Some(ShareMode::Mps)).is_err());
    d.apply(Command::UpdateTaskStatus {
        update: status("a", &format!("{f}.0"), TaskState::Finished),
        at_ms: 4,
    })
    .unwrap();
    share(&mut d, "GPU-a-0", None).unwrap();
    assert!(violations(&d.s).is_empty(), "{:?}", violations(&d.s));
}

#[test]
fn the_scheduler_packs_fractions_onto_the_fewest_gpus_and_the_fifth_waits() {
    let mut d = Driver::new(&[]);
    d.apply(register("a", 3)).unwrap();
    share(&mut d, "GPU-a-0", Some(ShareMode::TimeSlice)).unwrap();
    share(&mut d, "GPU-a-1", Some(ShareMode::TimeSlice)).unwrap();
    // One quarter already on GPU-a-1: bundle fills it first.
    let first = d.submit(spec(Some((10240, 0)), 0));
    d.launch_at(&first, &[("a", &["GPU-a-1"])], 2).unwrap();
    let jobs: Vec<String> = (0..3)
        .map(|_| d.submit(spec(Some((10240, 0)), 0)))
        .collect();
    let whole = d.submit(spec(None, 1));
    let l = d.place();
    for j in &jobs {
        let got = l.iter().find(|x| &x.job_id == j).expect("placed");
        assert_eq!(got.gpu_uuids, ["GPU-a-1"], "{l:?}");
    }
    let got = l.iter().find(|x| x.job_id == whole).unwrap();
    assert_eq!(
        got.gpu_uuids,
        ["GPU-a-2"],
        "whole GPUs only where not shared"
    );
    d.apply(Command::LaunchTasks {
        launches: l,
        at_ms: 3,
    })
    .unwrap();
    assert_eq!(d.s.share_used("a", "GPU-a-1"), (40960, 0));
    // The next goes to the other shared GPU; one bigger than any waits.
    let next = d.submit(spec(Some((10240, 0)), 0));
    let l = d.place();
    assert_eq!(
        l.iter().find(|x| x.job_id == next).unwrap().gpu_uuids,
        ["GPU-a-0"]
    );
    let huge = d.submit(spec(Some((81920, 0)), 0));
    let w = crate::scheduler::queue::wait_reason(&d.s, &Default::default(), &huge).unwrap();
    let wire = gpuctl_core::pb::WaitReason::from(&w);
    let words = gpuctl_core::wait::Waiting::try_from(&wire)
        .unwrap()
        .to_string();
    assert!(
        words.contains("a shared GPU with room for 81920 MiB"),
        "{words}"
    );
    assert!(violations(&d.s).is_empty());
}

#[test]
fn a_fraction_counts_as_one_gpu_against_a_quota() {
    let mut d = driver();
    share(&mut d, "GPU-a-0", Some(ShareMode::TimeSlice)).unwrap();
    d.apply(Command::SetQuota {
        stop_idle_after_ms: None,
        clear_stop_idle: false,
        borrow: None,
        clear_borrow: false,
        weight: None,
        tenant: "default".into(),
        gpus: 1,
    })
    .unwrap();
    let a = d.submit(spec(Some((1024, 0)), 0));
    let b = d.submit(spec(Some((1024, 0)), 0));
    let l = d.place();
    assert_eq!(l.len(), 1, "{l:?}");
    assert_eq!(l[0].job_id, a);
    assert!(l.iter().all(|x| x.job_id != b));
}

/// A framework of tenant `team`, subscribed; its id.
fn subscribe(d: &mut Driver) -> String {
    match d.apply(Command::SubscribeFramework {
        request_id: None,
        info: FrameworkInfo {
            id: String::new(),
            name: "fw".into(),
            roles: vec![],
            gpu_capable: true,
            failover_timeout_ms: 60_000,
            tenant: "team".into(),
        },
        at_ms: 0,
    }) {
        Ok(Outcome::FrameworkSubscribed { framework_id }) => framework_id,
        other => panic!("subscribe: {other:?}"),
    }
}

/// A framework task on agent `a`: a fraction of `gpu`, or (`None`) the
/// whole GPU.
fn fw_task(id: &str, gpu: &str, fraction: Option<(u64, u32)>) -> FrameworkTask {
    FrameworkTask {
        task_id: id.into(),
        agent_id: "a".into(),
        image: None,
        command: vec!["true".into()],
        env: Default::default(),
        resources: Resources {
            cpus: 0.5,
            mem_mib: 64,
            gpus: u32::from(fraction.is_none()),
            ports: 0,
        },
        gpu_uuids: vec![gpu.into()],
        fraction: fraction.map(|(mem_mib, compute_pct)| GpuFraction {
            mem_mib,
            compute_pct,
        }),
    }
}

/// Launches framework tasks; the ids launched and the refusals.
fn fw_launch(
    d: &mut Driver,
    f: &str,
    tasks: Vec<FrameworkTask>,
    group: bool,
) -> (Vec<String>, Vec<(String, String)>) {
    match d.apply(Command::LaunchFrameworkTasks {
        framework_id: f.into(),
        tasks,
        group,
        at_ms: 2,
    }) {
        Ok(Outcome::FrameworkTasksLaunched {
            launched, refused, ..
        }) => (launched, refused),
        other => panic!("launch: {other:?}"),
    }
}

/// Issue 34, frameworks: a framework's fractions of a shared GPU are
/// checked as jobs' are (the same `check_fraction`, counting jobs' and
/// frameworks' fractions together): up to the GPU's memory, the next
/// refused with the figures and holding nothing; the agent gets the
/// fraction with the GPU's mode and the framework's tenant.
#[test]
fn a_framework_launches_fractions_up_to_the_gpus_memory_and_the_next_is_refused() {
    let mut d = driver();
    share(&mut d, "GPU-a-0", Some(ShareMode::Mps)).unwrap();
    let f = subscribe(&mut d);
    let q = |i: usize| fw_task(&format!("q{i}"), "GPU-a-0", Some((10240, 20)));
    let (launched, refused) = fw_launch(&mut d, &f, vec![q(0), q(1)], false);
    assert_eq!((launched.len(), refused), (2, vec![]));
    // A job's quarter beside them: counted together.
    let j = d.submit(spec(Some((10240, 20)), 0));
    d.launch_at(&j, &[("a", &["GPU-a-0"])], 2).unwrap();
    let (launched, refused) = fw_launch(&mut d, &f, vec![q(3)], false);
    assert_eq!((launched.len(), refused), (1, vec![]));
    assert_eq!(d.s.share_used("a", "GPU-a-0"), (40960, 80));
    assert_eq!(d.s.gpu_owner("GPU-a-0"), None, "a fraction owns no GPU");
    let key = task_key(&f, "q0");
    let spec0 = d.s.task_spec(&key).unwrap();
    assert_eq!(spec0.gpu_uuids, vec!["GPU-a-0".to_string()]);
    assert_eq!(spec0.template.resources.gpus, 0);
    assert_eq!(
        spec0.share,
        Some(TaskShare {
            fraction: GpuFraction {
                mem_mib: 10240,
                compute_pct: 20
            },
            mode: ShareMode::Mps,
            tenant: "team".into(),
        })
    );

    // The GPU is full: the next fraction, however small, is refused with
    // the figures, recorded in ERROR holding nothing.
    let (launched, refused) = fw_launch(
        &mut d,
        &f,
        vec![fw_task("q4", "GPU-a-0", Some((1, 0)))],
        false,
    );
    assert!(launched.is_empty());
    assert_eq!(
        refused,
        vec![(
            "q4".to_string(),
            "launch does not fit: GPU GPU-a-0 has 0 MiB and 20% of compute left, the fraction asks 1 MiB and 0%".to_string()
        )]
    );
    let t = d.s.task(&task_key(&f, "q4")).unwrap();
    assert_eq!(
        (t.state, t.reason, t.fraction, t.gpu_uuids.len()),
        (TaskState::Error, TaskReason::ResourcesUnavailable, None, 0)
    );
    assert_eq!(d.s.share_used("a", "GPU-a-0"), (40960, 80));

    // Not of a GPU that is not shared; a shared GPU never whole.
    let (_, refused) = fw_launch(
        &mut d,
        &f,
        vec![fw_task("n", "GPU-a-1", Some((1, 0)))],
        false,
    );
    assert!(
        refused[0].1.contains("GPU GPU-a-1 is not shared"),
        "{refused:?}"
    );
    let (_, refused) = fw_launch(&mut d, &f, vec![fw_task("w", "GPU-a-0", None)], false);
    assert!(
        refused[0]
            .1
            .contains("GPU GPU-a-0 is shared (mps): it is given only as fractions"),
        "{refused:?}"
    );
    assert!(violations(&d.s).is_empty(), "{:?}", violations(&d.s));

    // One quarter ends: its share is free, and a fraction takes it.
    d.apply(Command::UpdateTaskStatus {
        update: status("a", &key, TaskState::Finished),
        at_ms: 3,
    })
    .unwrap();
    assert_eq!(d.s.share_used("a", "GPU-a-0"), (30720, 60));
    let (launched, _) = fw_launch(
        &mut d,
        &f,
        vec![fw_task("q5", "GPU-a-0", Some((10240, 0)))],
        false,
    );
    assert_eq!(launched, vec!["q5".to_string()]);
    assert!(violations(&d.s).is_empty(), "{:?}", violations(&d.s));
}

/// A launch decided on an offer the state has moved past (the GPU's room
/// taken by a launch before it, the GPU cordoned since) is refused when
/// applied, never over-committed; fractions of one command count
/// together, and a group of them is launched whole or not at all.
#[test]
fn a_framework_fraction_decided_on_a_stale_offer_is_refused() {
    let mut d = driver();
    share(&mut d, "GPU-a-0", Some(ShareMode::TimeSlice)).unwrap();
    share(&mut d, "GPU-a-1", Some(ShareMode::TimeSlice)).unwrap();
    let f = subscribe(&mut d);
    let g = subscribe(&mut d);
    // Both saw 40960 MiB free; f's launch commits first.
    let (launched, _) = fw_launch(
        &mut d,
        &f,
        vec![fw_task("big", "GPU-a-0", Some((30720, 0)))],
        false,
    );
    assert_eq!(launched.len(), 1);
    let (launched, refused) = fw_launch(
        &mut d,
        &g,
        vec![fw_task("late", "GPU-a-0", Some((20480, 0)))],
        false,
    );
    assert!(launched.is_empty());
    assert!(
        refused[0].1.contains("GPU GPU-a-0 has 10240 MiB"),
        "{refused:?}"
    );
    // Two of one command count together; a group is all or nothing.
    let (launched, refused) = fw_launch(
        &mut d,
        &g,
        vec![
            fw_task("g1", "GPU-a-1", Some((100, 60))),
            fw_task("g2", "GPU-a-1", Some((100, 60))),
        ],
        true,
    );
    assert!(launched.is_empty());
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert!(refused[1].1.contains("40% of compute left"), "{refused:?}");
    assert_eq!(d.s.share_used("a", "GPU-a-1"), (0, 0));
    // Cordoned since the offer.
    d.apply(Command::CordonGpu {
        uuid: "GPU-a-1".into(),
        cordon: true,
    })
    .unwrap();
    let (_, refused) = fw_launch(
        &mut d,
        &g,
        vec![fw_task("c", "GPU-a-1", Some((100, 0)))],
        false,
    );
    assert!(
        refused[0].1.contains("GPU GPU-a-1 is cordoned"),
        "{refused:?}"
    );
    assert!(violations(&d.s).is_empty(), "{:?}", violations(&d.s));
}

#[derive(Debug, Clone)]
enum Step {
    /// A job of this fraction launched on GPU `g` (0 or 1).
    Launch { mem: u64, pct: u32, g: u8 },
    /// A framework's task of this fraction launched on GPU `g`.
    FwLaunch { mem: u64, pct: u32, g: u8 },
    /// The n-th live fraction task ends.
    End(usize),
    /// Share or unshare GPU `g`.
    Share(u8, bool),
    /// A whole-GPU job launched on GPU `g`.
    Whole(u8),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (1u64..30_000, 0u32..70, 0u8..2).prop_map(|(mem, pct, g)| Step::Launch { mem, pct, g }),
        3 => (1u64..30_000, 0u32..70, 0u8..2).prop_map(|(mem, pct, g)| Step::FwLaunch { mem, pct, g }),
        3 => (0usize..8).prop_map(Step::End),
        1 => (0u8..2, any::<bool>()).prop_map(|(g, on)| Step::Share(g, on)),
        1 => (0u8..2).prop_map(Step::Whole),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Whatever is asked in whatever order, a GPU's fractions never hold
    /// more memory than it has nor more than 100% of its compute, a shared
    /// GPU is never held whole, and a refused command changes nothing.
    #[test]
    fn fractions_never_over_commit_a_gpu(steps in proptest::collection::vec(step(), 1..40)) {
        let mut d = driver();
        let f = subscribe(&mut d);
        let mut live: Vec<String> = Vec::new();
        for (n, s) in steps.into_iter().enumerate() {
            let before = d.s.clone();
            let r = match s {
                Step::Launch { mem, pct, g } => {
                    let j = d.submit(spec(Some((mem, pct)), 0));
                    let uuid = format!("GPU-a-{g}");
                    let r = d.launch_at(&j, &[("a", &[uuid.as_str()])], 2);
                    if r.is_ok() {
                        live.push(format!("{j}.0"));
                    }
                    r.map(|_| ())
                }
                Step::FwLaunch { mem, pct, g } => {
                    let id = format!("t{n}");
                    let t = fw_task(&id, &format!("GPU-a-{g}"), Some((mem, pct)));
                    let (launched, _) = fw_launch(&mut d, &f, vec![t], false);
                    if !launched.is_empty() {
                        live.push(task_key(&f, &id));
                    }
                    Ok(())
                }
                Step::End(n) if !live.is_empty() => {
                    let t = live.remove(n % live.len());
                    d.apply(Command::UpdateTaskStatus {
                        update: status("a", &t, TaskState::Finished),
                        at_ms: 3,
                    })
                    .map(|_| ())
                }
                Step::End(_) => Ok(()),
                Step::Share(g, on) => share(
                    &mut d,
                    &format!("GPU-a-{g}"),
                    on.then_some(ShareMode::TimeSlice),
                )
                .map(|_| ()),
                Step::Whole(g) => {
                    let j = d.submit(spec(None, 1));
                    let uuid = format!("GPU-a-{g}");
                    d.launch_at(&j, &[("a", &[uuid.as_str()])], 2).map(|_| ())
                }
            };
            if r.is_err() && !matches!(s, Step::Launch { .. } | Step::Whole(_)) {
                let mut after = d.s.clone();
                after.applied_index = before.applied_index;
                prop_assert_eq!(after, before);
            }
            let bad = violations(&d.s);
            prop_assert!(bad.is_empty(), "{:?}", bad);
        }
    }
}

#[test]
fn a_fractions_enforcement_is_recorded_as_its_agent_says() {
    let mut d = driver();
    share(&mut d, "GPU-a-0", Some(ShareMode::TimeSlice)).unwrap();
    let f = d.submit(spec(Some((1024, 0)), 0));
    d.launch_at(&f, &[("a", &["GPU-a-0"])], 2).unwrap();
    let whole = d.submit(spec(None, 1));
    d.launch_at(&whole, &[("a", &["GPU-a-1"])], 2).unwrap();
    for (job, uuid) in [(&f, 1u8), (&whole, 2)] {
        let mut u = status("a", &format!("{job}.0"), TaskState::Starting);
        u.uuid = vec![uuid];
        u.enforcement = Some(gpuctl_core::types::Enforcement::None);
        d.apply(Command::UpdateTaskStatus {
            update: u,
            at_ms: 3,
        })
        .unwrap();
    }
    assert_eq!(
        d.s.task(&format!("{f}.0")).unwrap().enforcement,
        Some(gpuctl_core::types::Enforcement::None)
    );
    // Only a fraction has an enforcement level.
    assert_eq!(d.s.task(&format!("{whole}.0")).unwrap().enforcement, None);
}

#[test]
fn a_fraction_over_its_memory_fails_with_gpu_memory_limit_and_frees_its_share() {
    let mut d = driver();
    share(&mut d, "GPU-a-0", Some(ShareMode::Mps)).unwrap();
    let f = d.submit(spec(Some((10240, 25)), 0));
    d.launch_at(&f, &[("a", &["GPU-a-0"])], 2).unwrap();
    assert_eq!(d.s.share_used("a", "GPU-a-0"), (10240, 25));
    let mut u = status("a", &format!("{f}.0"), TaskState::Failed);
    u.uuid = vec![9];
    u.exit_code = Some(137);
    u.gpu_memory_limit = true;
    u.message = "used 12288 MiB of GPU memory, over its 10240 MiB".into();
    d.apply(Command::UpdateTaskStatus {
        update: u,
        at_ms: 3,
    })
    .unwrap();
    let t = d.s.task(&format!("{f}.0")).unwrap();
    assert_eq!(t.reason, gpuctl_core::types::TaskReason::GpuMemoryLimit);
    assert_eq!(d.s.share_used("a", "GPU-a-0"), (0, 0));
    let job = d.s.job(&f).unwrap();
    assert!(
        job.message.contains("over its 10240 MiB"),
        "{}",
        job.message
    );
}

#[test]
fn a_fractions_task_spec_names_its_mode_and_tenant_for_its_mps_server() {
    let mut d = driver();
    share(&mut d, "GPU-a-0", Some(ShareMode::Mps)).unwrap();
    let mut a = spec(Some((1024, 10)), 0);
    a.tenant = "team-a".into();
    let a = d.submit(a);
    let b = d.submit(spec(Some((1024, 0)), 0));
    for j in [&a, &b] {
        d.launch_at(j, &[("a", &["GPU-a-0"])], 2).unwrap();
    }
    let share_of = |job: &str| d.s.task_spec(&format!("{job}.0")).unwrap().share.unwrap();
    let sa = share_of(&a);
    assert_eq!(sa.mode, ShareMode::Mps);
    assert_eq!(sa.tenant.as_recorded(), "team-a");
    assert_eq!((sa.fraction.mem_mib, sa.fraction.compute_pct), (1024, 10));
    // No tenant: the default one, never an empty name for a directory.
    assert_eq!(share_of(&b).tenant.as_recorded(), "default");
    // A whole-GPU task has no share.
    let w = d.submit(spec(None, 1));
    d.launch_at(&w, &[("a", &["GPU-a-1"])], 2).unwrap();
    assert!(d.s.task_spec(&format!("{w}.0")).unwrap().share.is_none());
}

/// Agent `b` with two GPUs and the default `mode`, registering (again).
fn register_sharing(mode: Option<ShareMode>, running: &[&str]) -> Command {
    let mut c = register("b", 2);
    if let Command::RegisterAgent {
        info,
        running_task_ids,
        ..
    } = &mut c
    {
        info.share_gpus = mode;
        *running_task_ids = running.iter().map(|t| t.to_string()).collect();
    }
    c
}

#[test]
fn an_agents_default_shares_its_gpus_unless_an_admin_said_otherwise() {
    let mut d = driver();
    d.apply(register_sharing(Some(ShareMode::Mps), &[]))
        .unwrap();
    assert_eq!(d.s.share_mode("GPU-b-0"), Some(ShareMode::Mps));
    assert_eq!(d.s.share_mode("GPU-b-1"), Some(ShareMode::Mps));
    // An admin's choice stands over it at the next registration: one GPU
    // off, the other in another mode.
    share(&mut d, "GPU-b-0", None).unwrap();
    share(&mut d, "GPU-b-1", Some(ShareMode::TimeSlice)).unwrap();
    d.apply(register_sharing(Some(ShareMode::Mps), &[]))
        .unwrap();
    assert_eq!(d.s.share_mode("GPU-b-0"), None);
    assert_eq!(d.s.share_mode("GPU-b-1"), Some(ShareMode::TimeSlice));
    // Without a default, nothing changes either way.
    d.apply(register_sharing(None, &[])).unwrap();
    assert_eq!(d.s.share_mode("GPU-b-1"), Some(ShareMode::TimeSlice));
    assert!(violations(&d.s).is_empty(), "{:?}", violations(&d.s));
}

#[test]
fn an_agents_default_leaves_a_gpu_held_whole_alone() {
    let mut d = Driver::new(&[("b", 2)]);
    let whole = d.submit(spec(None, 1));
    d.launch_at(&whole, &[("b", &["GPU-b-0"])], 2).unwrap();
    let task = format!("{whole}.0");
    d.apply(register_sharing(
        Some(ShareMode::TimeSlice),
        &[task.as_str()],
    ))
    .unwrap();
    assert_eq!(d.s.share_mode("GPU-b-0"), None, "held whole");
    assert_eq!(d.s.share_mode("GPU-b-1"), Some(ShareMode::TimeSlice));
    assert!(violations(&d.s).is_empty(), "{:?}", violations(&d.s));
}

/// Issue 39: a fraction's busy time comes from its own processes' readings
/// (NVML's per-process utilization, per task in `RecordUtilization`),
/// against its share of the GPU: a 25% fraction whose processes used 20% of
/// the GPU was 80% busy; one over its share counts as fully busy; a task
/// named on another GPU is not charged.
#[test]
fn a_fractions_busy_time_is_its_own_against_its_share() {
    use crate::state::usage::{report, By};
    use crate::state::util::UtilPoint;
    let mut d = driver();
    share(&mut d, "GPU-a-0", Some(ShareMode::Mps)).unwrap();
    let mut small = spec(Some((1024, 25)), 0);
    small.tenant = "small".into();
    let mut over = spec(Some((1024, 10)), 0);
    over.tenant = "over".into();
    let a = d.submit(small);
    let b = d.submit(over);
    d.launch_at(&a, &[("a", &["GPU-a-0"])], 0).unwrap();
    d.launch_at(&b, &[("a", &["GPU-a-0"])], 0).unwrap();
    let point = |gpu: &str, tasks: Vec<(String, u8)>| UtilPoint {
        gpu: gpu.into(),
        util_pct: 60,
        mem_pct: 5,
        task_mem: tasks.iter().map(|(t, _)| (t.clone(), 3)).collect(),
        tasks,
    };
    d.apply(Command::RecordUtilization {
        at_ms: 60_000,
        period_ms: 60_000,
        points: vec![
            point(
                "GPU-a-0",
                vec![("job-1.0".into(), 20), ("job-2.0".into(), 40)],
            ),
            // Named on a GPU it does not hold: ignored.
            point("GPU-a-1", vec![("job-1.0".into(), 90)]),
        ],
        idle_window_ms: 0,
        idle_below_pct: 0,
    })
    .unwrap();
    let (rows, ..) = report(&d.s, 0, 120_000, By::Tenant, None);
    let util = |t: &str| {
        let r = rows.iter().find(|r| r.key == t).unwrap();
        (r.totals.gpu_sampled_ms, r.totals.util_pct())
    };
    assert_eq!(util("small"), (15_000, Some(80.0)));
    assert_eq!(util("over"), (6_000, Some(100.0)));
    // By job: each task's own readings (the shared GPU's history is the
    // whole GPU's 60%, which is neither's).
    let (rows, ..) = report(&d.s, 0, 120_000, By::Job, None);
    let util = |j: &str| {
        let r = rows.iter().find(|r| r.key == j).unwrap();
        (r.totals.gpu_sampled_ms, r.totals.util_pct())
    };
    assert_eq!(util(&a), (15_000, Some(80.0)));
    assert_eq!(util(&b), (6_000, Some(100.0)));
    // Two hours on, a window of the last hour holds half of the running
    // task's life: half of its readings, the same mean.
    let hour = crate::state::usage::HOUR_MS;
    let (rows, ..) = report(&d.s, hour, 2 * hour, By::Job, None);
    let r = rows.iter().find(|r| r.key == a).unwrap();
    assert_eq!(
        (r.totals.gpu_sampled_ms, r.totals.util_pct()),
        (7_500, Some(80.0))
    );
    // The readings are the task's, in its record, so they outlive it.
    assert_eq!(d.s.task("job-1.0").unwrap().gpu_busy_ms, 12_000);
    // And its own curve (a job's page draws it): its processes' 20% of
    // the GPU and 3% of its memory, not the GPU's 60% and 5%; none for the
    // task named on a GPU it does not hold.
    let own: Vec<(u64, u8, u8)> =
        d.s.util_history()
            .task("job-1.0")
            .unwrap()
            .points(0, u64::MAX)
            .collect();
    assert_eq!(own, [(60_000, 20, 3)]);
    let gpu: Vec<(u64, u8, u8)> =
        d.s.util_history()
            .gpu("GPU-a-1")
            .unwrap()
            .points(0, u64::MAX)
            .collect();
    assert_eq!(gpu, [(60_000, 60, 5)]);
    assert_eq!(d.s.util_history().tasks.len(), 2, "job-1.0 and job-2.0");
}

/// Issue 39, item 3, on a shared GPU: a job's fraction is idle by its own
/// processes' readings (0 where the leader read the GPU and no process of
/// it was listed), whatever the whole GPU reads; a period without a
/// reading of it (the GPU not read) breaks the run, so the window starts
/// again; a reading at or over the threshold makes it busy again.
#[test]
fn a_fraction_is_flagged_idle_by_its_own_readings() {
    use crate::state::events::EventKind;
    use crate::state::util::UtilPoint;
    let mut d = driver();
    share(&mut d, "GPU-a-0", Some(ShareMode::TimeSlice)).unwrap();
    let quiet = d.submit(spec(Some((1024, 25)), 0));
    let busy = d.submit(spec(Some((1024, 25)), 0));
    d.launch_at(&quiet, &[("a", &["GPU-a-0"])], 0).unwrap();
    d.launch_at(&busy, &[("a", &["GPU-a-0"])], 0).unwrap();
    for t in ["job-1.0", "job-2.0"] {
        d.apply(Command::UpdateTaskStatus {
            update: status("a", t, TaskState::Running),
            at_ms: 1,
        })
        .unwrap();
    }
    let period = |d: &mut Driver, at: u64, tasks: &[(&str, u8)]| {
        d.apply(Command::RecordUtilization {
            at_ms: at,
            period_ms: 1000,
            points: vec![UtilPoint {
                gpu: "GPU-a-0".into(),
                util_pct: 90,
                mem_pct: 0,
                tasks: tasks.iter().map(|(t, u)| (t.to_string(), *u)).collect(),
                task_mem: Vec::new(),
            }],
            idle_window_ms: 3000,
            idle_below_pct: 5,
        })
        .unwrap();
    };
    let readings = [("job-1.0", 0), ("job-2.0", 40)];
    period(&mut d, 0, &readings);
    period(&mut d, 1000, &[("job-1.0", 2), ("job-2.0", 40)]);
    // The GPU's per-process readings not read: no reading of either.
    period(&mut d, 2000, &[]);
    period(&mut d, 3000, &readings);
    period(&mut d, 4000, &readings);
    assert_eq!(
        d.s.job(&quiet).unwrap().idle_since_ms,
        None,
        "the gap at 2 s starts the window again"
    );
    period(&mut d, 5000, &readings);
    let job = d.s.job(&quiet).unwrap();
    assert_eq!(job.idle_since_ms, Some(3000));
    let ev = job.events.iter().last().unwrap();
    assert_eq!(ev.kind, EventKind::Idle);
    assert!(
        ev.message.contains("1 GPU(s) stayed under 5% for 3 s"),
        "{}",
        ev.message
    );
    // Its neighbour used 40% of the GPU all along: never idle, and the
    // whole GPU's 90% made neither busy.
    assert_eq!(d.s.job(&busy).unwrap().idle_since_ms, None);
    period(&mut d, 6000, &[("job-1.0", 30), ("job-2.0", 40)]);
    let job = d.s.job(&quiet).unwrap();
    assert_eq!(job.idle_since_ms, None);
    assert_eq!(job.events.iter().last().unwrap().kind, EventKind::Busy);
    assert_eq!(d.s.task("job-1.0").unwrap().quiet, None);
    // The fractions' own curves go with their jobs.
    assert_eq!(d.s.util_history().tasks.len(), 2);
    for t in ["job-1.0", "job-2.0"] {
        d.apply(Command::UpdateTaskStatus {
            update: status("a", t, TaskState::Finished),
            at_ms: 7000,
        })
        .unwrap();
    }
    d.apply(Command::ForgetJobs {
        job_ids: vec![quiet.clone(), busy.clone()],
        at_ms: 8000,
    })
    .unwrap();
    assert!(d.s.job(&quiet).is_none(), "forgotten");
    assert!(d.s.util_history().tasks.is_empty());
}
