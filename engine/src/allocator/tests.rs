use std::collections::{BTreeMap, BTreeSet};

use gpuctl_core::types::Resources;

use super::harness::{agent, fw, gpu, idle_agent, res, Harness};
use super::*;

const GIB: u64 = 1024;

fn no_roles() -> BTreeMap<String, RoleConfig> {
    BTreeMap::new()
}

fn run(agents: &[AgentView], frameworks: &[FrameworkView]) -> Vec<OfferPlan> {
    allocate(
        agents,
        frameworks,
        &no_roles(),
        &Filters::new(),
        &AllocatorConfig::default(),
        0,
    )
}

/// (agent, framework) of each plan, in order.
fn pairs(plans: &[OfferPlan]) -> Vec<(&str, &str)> {
    plans
        .iter()
        .map(|p| (p.agent_id.as_str(), p.framework_id.as_str()))
        .collect()
}

fn role(weight: f64, quota: Option<Resources>) -> RoleConfig {
    RoleConfig { weight, quota }
}

// ---- DRF order ----

#[test]
fn drf_table() {
    let cpu8 = res(8.0, 8 * GIB, 0);
    struct Case {
        name: &'static str,
        agents: Vec<AgentView>,
        frameworks: Vec<FrameworkView>,
        want: Vec<(&'static str, &'static str)>,
    }
    let cases = vec![
        Case {
            name: "the framework with more allocated gets the agent second",
            agents: vec![
                agent("a0", res(0.0, 0, 0), res(10.0, 10 * GIB, 0)),
                idle_agent("a1", res(16.0, 16 * GIB, 0)),
                idle_agent("a2", res(16.0, 16 * GIB, 0)),
            ],
            frameworks: vec![
                fw("busy", "r", false, res(10.0, 10 * GIB, 0)),
                fw("idle", "r", false, Resources::default()),
            ],
            want: vec![("a1", "idle"), ("a2", "busy")],
        },
        Case {
            name: "equal shares: the lower id first, then alternate",
            agents: vec![
                idle_agent("a1", cpu8),
                idle_agent("a2", cpu8),
                idle_agent("a3", cpu8),
            ],
            frameworks: vec![
                fw("f-b", "r", false, Resources::default()),
                fw("f-a", "r", false, Resources::default()),
            ],
            want: vec![("a1", "f-a"), ("a2", "f-b"), ("a3", "f-a")],
        },
        Case {
            name: "the dominant dimension decides (mem here)",
            agents: vec![
                agent("a0", res(0.0, 0, 0), res(10.0, 100 * GIB, 0)),
                idle_agent("a1", res(10.0, 100 * GIB, 0)),
            ],
            frameworks: vec![
                // cpu share 0.4, mem share 0.05: dominant 0.4
                fw("cpu-heavy", "r", false, res(8.0, 10 * GIB, 0)),
                // cpu share 0.05, mem share 0.45: dominant 0.45
                fw("mem-heavy", "r", false, res(1.0, 90 * GIB, 0)),
            ],
            want: vec![("a1", "cpu-heavy")],
        },
        Case {
            name: "role share comes before framework share",
            agents: vec![
                agent("a0", res(0.0, 0, 0), res(20.0, 20 * GIB, 0)),
                idle_agent("a1", cpu8),
            ],
            frameworks: vec![
                // role r1 holds 12 in total, but each of its frameworks only 6
                fw("r1-x", "r1", false, res(6.0, 6 * GIB, 0)),
                fw("r1-y", "r1", false, res(6.0, 6 * GIB, 0)),
                fw("r2-z", "r2", false, res(8.0, 8 * GIB, 0)),
            ],
            want: vec![("a1", "r2-z")],
        },
        Case {
            name: "equal role shares: the framework share decides across roles",
            agents: vec![
                agent("a0", res(0.0, 0, 0), res(8.0, 8 * GIB, 0)),
                idle_agent("a1", cpu8),
            ],
            frameworks: vec![
                fw("z1", "r1", false, res(4.0, 4 * GIB, 0)),
                fw("b2", "r2", false, res(2.0, 2 * GIB, 0)),
                fw("c2", "r2", false, res(2.0, 2 * GIB, 0)),
            ],
            want: vec![("a1", "b2")],
        },
        Case {
            name: "a dimension with total 0 is skipped (not an infinite share)",
            agents: vec![
                agent("a0", res(0.0, 0, 0), res(10.0, 0, 0)),
                idle_agent("a1", res(10.0, 0, 0)),
            ],
            frameworks: vec![
                // mem share would be 5/0; cpu share 0.05
                fw("a", "r1", false, res(1.0, 5, 0)),
                fw("b", "r2", false, res(2.0, 0, 0)),
            ],
            want: vec![("a1", "a")],
        },
    ];
    for c in cases {
        let plans = run(&c.agents, &c.frameworks);
        assert_eq!(pairs(&plans), c.want, "{}", c.name);
    }
}

#[test]
fn a_whole_agent_is_offered() {
    let plans = run(
        &[idle_agent("a1", res(64.0, 512 * GIB, 8))],
        &[fw("f", "r", true, Resources::default())],
    );
    assert_eq!(plans.len(), 1);
    assert_eq!(plans[0].resources, res(64.0, 512 * GIB, 8));
    let want: Vec<String> = (0..8).map(|i| format!("a1-gpu{i}")).collect();
    assert_eq!(plans[0].gpu_uuids, want);
}

#[test]
fn agents_with_nothing_free_get_no_offer() {
    let plans = run(
        &[
            agent("full", res(0.0, 0, 0), res(8.0, GIB, 0)),
            agent("crumbs", res(1e-12, 0, 0), res(8.0, GIB, 0)),
            agent("nan", res(f64::NAN, 0, 0), res(8.0, GIB, 0)),
            idle_agent("free", res(8.0, GIB, 0)),
        ],
        &[fw("f", "r", false, Resources::default())],
    );
    assert_eq!(pairs(&plans), vec![("free", "f")]);
}

#[test]
fn weights_give_a_role_twice_the_share() {
    let agents: Vec<AgentView> = (0..30)
        .map(|i| idle_agent(&format!("a{i:02}"), res(4.0, 4 * GIB, 0)))
        .collect();
    let frameworks = [
        fw("heavy", "r-heavy", false, Resources::default()),
        fw("light", "r-light", false, Resources::default()),
    ];
    let roles = BTreeMap::from([
        ("r-heavy".to_string(), role(2.0, None)),
        ("r-light".to_string(), role(1.0, None)),
    ]);
    let plans = allocate(
        &agents,
        &frameworks,
        &roles,
        &Filters::new(),
        &AllocatorConfig::default(),
        0,
    );
    let count = |f: &str| plans.iter().filter(|p| p.framework_id == f).count();
    assert_eq!((count("heavy"), count("light")), (20, 10));

    // Without weights they split evenly; an invalid weight counts as 1.
    for weight in [1.0, 0.0, -3.0, f64::NAN] {
        let roles = BTreeMap::from([("r-heavy".to_string(), role(weight, None))]);
        let plans = allocate(
            &agents,
            &frameworks,
            &roles,
            &Filters::new(),
            &AllocatorConfig::default(),
            0,
        );
        let count = |f: &str| plans.iter().filter(|p| p.framework_id == f).count();
        assert_eq!(
            (count("heavy"), count("light")),
            (15, 15),
            "weight {weight}"
        );
    }
}

// ---- quota ----

#[test]
fn quota_table() {
    let big = res(64.0, 512 * GIB, 8);
    struct Case {
        name: &'static str,
        quota: Resources,
        held: Resources,
        gpu_capable: bool,
        /// What the quota'd framework is offered (None: nothing).
        want: Option<(Resources, Vec<u32>)>,
    }
    let cases = vec![
        Case {
            name: "room for all of it: the whole agent",
            quota: res(100.0, 1024 * GIB, 16),
            held: Resources::default(),
            gpu_capable: true,
            want: Some((big, (0..8).collect())),
        },
        Case {
            name: "a slice capped in every dimension, lowest-index GPUs",
            quota: res(10.0, 20 * GIB, 2),
            held: Resources::default(),
            gpu_capable: true,
            want: Some((res(10.0, 20 * GIB, 2), vec![0, 1])),
        },
        Case {
            name: "the room is quota less what the role holds",
            quota: res(10.0, 20 * GIB, 4),
            held: res(4.0, 5 * GIB, 1),
            gpu_capable: true,
            want: Some((res(6.0, 15 * GIB, 3), vec![0, 1, 2])),
        },
        Case {
            name: "no GPU room: cpus and mem only",
            quota: res(10.0, 20 * GIB, 0),
            held: Resources::default(),
            gpu_capable: true,
            want: Some((res(10.0, 20 * GIB, 0), vec![])),
        },
        Case {
            name: "quota reached: nothing",
            quota: res(10.0, 20 * GIB, 2),
            held: res(10.0, 20 * GIB, 2),
            gpu_capable: true,
            want: None,
        },
        Case {
            name: "over quota (quota lowered): nothing",
            quota: res(10.0, 20 * GIB, 2),
            held: res(12.0, 30 * GIB, 3),
            gpu_capable: true,
            want: None,
        },
        Case {
            name: "only GPU room left, framework without GPUs: empty slice, skipped",
            quota: res(10.0, 20 * GIB, 2),
            held: res(10.0, 20 * GIB, 0),
            gpu_capable: false,
            want: None,
        },
    ];
    for c in cases {
        let roles = BTreeMap::from([("q".to_string(), role(1.0, Some(c.quota)))]);
        let agents = [
            agent("a0", Resources::default(), res(64.0, 512 * GIB, 0)),
            idle_agent("a1", big),
        ];
        let frameworks = [fw("quota-fw", "q", c.gpu_capable, c.held)];
        let config = AllocatorConfig {
            gpu_agents_for_gpu_frameworks_only: false,
            gpu_reserve: Resources::default(),
        };
        let plans = allocate(&agents, &frameworks, &roles, &Filters::new(), &config, 0);
        let got = plans.first().map(|p| {
            let indices: Vec<u32> = p
                .gpu_uuids
                .iter()
                .map(|u| u.trim_start_matches("a1-gpu").parse().expect("index"))
                .collect();
            (p.resources, indices)
        });
        assert_eq!(got, c.want, "{}", c.name);
        if let Some(p) = plans.first() {
            let after = c.held.add(&p.resources);
            assert!(after.cpus <= c.quota.cpus + 1e-9, "{}", c.name);
            assert!(after.mem_mib <= c.quota.mem_mib, "{}", c.name);
            assert!(after.gpus <= c.quota.gpus, "{}", c.name);
        }
    }
}

#[test]
fn the_rest_of_a_quota_slice_goes_to_the_next_framework() {
    let roles = BTreeMap::from([("small".to_string(), role(1.0, Some(res(4.0, 8 * GIB, 1))))]);
    let agents = [idle_agent("a1", res(64.0, 512 * GIB, 8))];
    let frameworks = [
        fw("f-small", "small", true, Resources::default()),
        fw("f-big", "big", true, Resources::default()),
    ];
    let plans = allocate(
        &agents,
        &frameworks,
        &roles,
        &Filters::new(),
        &AllocatorConfig::default(),
        0,
    );
    // Tie at share 0: "f-big" < "f-small" by id, so f-big takes it all.
    assert_eq!(pairs(&plans), vec![("a1", "f-big")]);

    // With f-big already holding something, f-small goes first, gets its
    // slice, and f-big gets the rest of the same agent.
    let frameworks = [
        fw("f-small", "small", true, Resources::default()),
        fw("f-big", "big", true, res(1.0, GIB, 0)),
    ];
    let plans = allocate(
        &agents,
        &frameworks,
        &roles,
        &Filters::new(),
        &AllocatorConfig::default(),
        0,
    );
    assert_eq!(pairs(&plans), vec![("a1", "f-small"), ("a1", "f-big")]);
    assert_eq!(plans[0].resources, res(4.0, 8 * GIB, 1));
    assert_eq!(plans[0].gpu_uuids, vec!["a1-gpu0".to_string()]);
    assert_eq!(plans[1].resources, res(60.0, 504 * GIB, 7));
    assert_eq!(plans[1].gpu_uuids.len(), 7);
    assert!(!plans[1].gpu_uuids.contains(&"a1-gpu0".to_string()));
}

#[test]
fn quota_holds_across_agents_in_one_cycle() {
    let roles = BTreeMap::from([("q".to_string(), role(1.0, Some(res(20.0, 64 * GIB, 3))))]);
    let agents: Vec<AgentView> = (0..5)
        .map(|i| idle_agent(&format!("a{i}"), res(8.0, 32 * GIB, 2)))
        .collect();
    let frameworks = [fw("f", "q", true, Resources::default())];
    let plans = allocate(
        &agents,
        &frameworks,
        &roles,
        &Filters::new(),
        // Without GPU reserves, which would keep cpus and memory of the
        // GPUs the quota leaves (tested below).
        &AllocatorConfig {
            gpu_reserve: Resources::default(),
            ..AllocatorConfig::default()
        },
        0,
    );
    let sum = plans
        .iter()
        .fold(Resources::default(), |acc, p| acc.add(&p.resources));
    assert_eq!(sum, res(20.0, 64 * GIB, 3));
    assert_eq!(pairs(&plans), vec![("a0", "f"), ("a1", "f"), ("a2", "f")]);
    assert_eq!(plans[1].resources, res(8.0, 32 * GIB, 1));
    assert_eq!(plans[2].resources, res(4.0, 0, 0));
}

#[test]
fn unknown_role_has_weight_one_and_no_quota() {
    let roles = BTreeMap::from([("other".to_string(), role(5.0, Some(Resources::default())))]);
    let plans = allocate(
        &[idle_agent("a1", res(8.0, GIB, 0))],
        &[fw("f", "not-configured", false, Resources::default())],
        &roles,
        &Filters::new(),
        &AllocatorConfig::default(),
        0,
    );
    assert_eq!(plans[0].resources, res(8.0, GIB, 0));
}

// ---- filters, suppress ----

#[test]
fn declined_agent_is_filtered_until_expiry_and_revive_clears() {
    let mut h = Harness::new();
    h.add_agent("a1", 8.0, 8 * GIB, 0)
        .add_framework("f1", "r", false)
        .add_framework("f2", "r", false);
    h.frameworks[1].running = res(1.0, GIB, 0); // f2 comes second

    let offers = h.cycle();
    assert_eq!(offers.len(), 1);
    assert_eq!(offers[0].framework_id, "f1");
    h.decline("f1", &[offers[0].id.clone()], None); // default 5 s

    h.advance(1_000);
    let offers = h.cycle();
    assert_eq!(offers.len(), 1, "the agent goes to the other framework");
    assert_eq!(offers[0].framework_id, "f2");
    h.decline("f2", &[offers[0].id.clone()], Some(60.0));

    h.advance(1_000);
    assert!(h.cycle().is_empty(), "both filtered");

    h.advance(3_000); // 5 s after f1's decline
    let offers = h.cycle();
    assert_eq!(offers.len(), 1);
    assert_eq!(offers[0].framework_id, "f1");
    h.decline("f1", &[offers[0].id.clone()], Some(3600.0));

    h.advance(1_000);
    assert!(h.cycle().is_empty());
    h.filters.revive("f2");
    let offers = h.cycle();
    assert_eq!(offers.len(), 1);
    assert_eq!(offers[0].framework_id, "f2");
    assert_eq!(
        h.log.iter().map(Vec::len).collect::<Vec<_>>(),
        vec![1, 1, 0, 1, 0, 1]
    );
}

#[test]
fn refuse_seconds_zero_sets_no_filter() {
    let mut h = Harness::new();
    h.add_agent("a1", 8.0, 8 * GIB, 0)
        .add_framework("f1", "r", false);
    let offers = h.cycle();
    h.decline("f1", &[offers[0].id.clone()], Some(0.0));
    assert!(h.filters.is_empty());
    assert_eq!(h.cycle().len(), 1);
}

#[test]
fn filters_table() {
    let mut f = Filters::new();
    f.add("f1", "a1", 5_000);
    f.add("f1", "a1", 2_000); // a shorter filter does not shorten it
    f.add("f1", "a2", 1_000);
    f.add("f2", "a1", 9_000);
    assert!(f.is_filtered("f1", "a1", 4_999));
    assert!(!f.is_filtered("f1", "a1", 5_000));
    assert!(!f.is_filtered("f1", "a3", 0));
    assert!(!f.is_filtered("f3", "a1", 0));
    assert_eq!(f.len(), 3);

    f.expire(1_000);
    assert_eq!(f.len(), 2, "f1/a2 expired");
    f.remove_agent("a1");
    assert!(f.is_empty());

    f.add("f1", "a1", 5_000);
    f.add("f2", "a1", 5_000);
    f.revive("f1");
    assert!(!f.is_filtered("f1", "a1", 0));
    assert!(f.is_filtered("f2", "a1", 0));
    f.remove_framework("f2");
    assert!(f.is_empty());
}

#[test]
fn refuse_until_table() {
    let cases: &[(Option<f64>, Option<u64>)] = &[
        (None, Some(15_000)),
        (Some(5.0), Some(15_000)),
        (Some(0.5), Some(10_500)),
        (Some(0.0), None),
        (Some(-1.0), Some(15_000)),
        (Some(f64::NAN), Some(15_000)),
        (Some(f64::INFINITY), Some(10_000 + 365 * 24 * 3_600_000)),
        (Some(1e300), Some(10_000 + 365 * 24 * 3_600_000)),
    ];
    for (secs, want) in cases {
        assert_eq!(refuse_until(10_000, *secs), *want, "{secs:?}");
    }
}

#[test]
fn filters_in_allocate_use_now() {
    let agents = [idle_agent("a1", res(8.0, GIB, 0))];
    let frameworks = [fw("f", "r", false, Resources::default())];
    let mut filters = Filters::new();
    filters.add("f", "a1", 1_000);
    let at = |now| {
        allocate(
            &agents,
            &frameworks,
            &no_roles(),
            &filters,
            &AllocatorConfig::default(),
            now,
        )
        .len()
    };
    assert_eq!((at(0), at(999), at(1_000)), (0, 0, 1));
}

#[test]
fn suppressed_framework_gets_nothing_but_its_allocation_counts() {
    let agents = [
        agent("a0", Resources::default(), res(32.0, 32 * GIB, 0)),
        idle_agent("a1", res(8.0, 8 * GIB, 0)),
        idle_agent("a2", res(8.0, 8 * GIB, 0)),
    ];
    let mut quiet = fw("quiet", "r1", false, Resources::default());
    quiet.suppressed = true;
    // r1's suppressed framework holds a lot, so r2 goes before r1's other one.
    let mut loud = fw("loud", "r1", false, Resources::default());
    let mut holder = fw("holder", "r1", false, res(16.0, 16 * GIB, 0));
    holder.suppressed = true;
    let other = fw("other", "r2", false, res(4.0, 4 * GIB, 0));
    let plans = run(&agents, &[quiet.clone(), loud.clone(), holder, other]);
    assert_eq!(pairs(&plans), vec![("a1", "other"), ("a2", "other")]);

    loud.suppressed = true;
    assert!(run(&agents, &[quiet, loud]).is_empty());
}

// ---- GPUs ----

#[test]
fn gpu_scarcity_flag() {
    let agents = [
        idle_agent("cpu-agent", res(16.0, 64 * GIB, 0)),
        idle_agent("gpu-agent", res(64.0, 512 * GIB, 8)),
    ];
    let frameworks = [fw("cpu-only", "r", false, Resources::default())];
    let on = allocate(
        &agents,
        &frameworks,
        &no_roles(),
        &Filters::new(),
        &AllocatorConfig::default(),
        0,
    );
    assert_eq!(pairs(&on), vec![("cpu-agent", "cpu-only")]);

    // Off: the CPU-only framework sees the GPU agent, but never its GPUs.
    let off = allocate(
        &agents,
        &frameworks,
        &no_roles(),
        &Filters::new(),
        &AllocatorConfig {
            gpu_agents_for_gpu_frameworks_only: false,
            gpu_reserve: Resources::default(),
        },
        0,
    );
    assert_eq!(
        pairs(&off),
        vec![("cpu-agent", "cpu-only"), ("gpu-agent", "cpu-only")]
    );
    assert_eq!(off[1].resources, res(64.0, 512 * GIB, 0));
    assert!(off[1].gpu_uuids.is_empty());
}

#[test]
fn gpu_framework_receives_any_agent_and_cpu_framework_waits() {
    let agents = [
        idle_agent("a1", res(16.0, 64 * GIB, 0)),
        idle_agent("a2", res(64.0, 512 * GIB, 8)),
        idle_agent("a3", res(16.0, 64 * GIB, 0)),
    ];
    // The GPU framework has the lowest share and a lower id: it gets a1, then
    // the GPU agent (the CPU framework may not have it), then a3 goes to the
    // CPU framework, whose share is now the lower.
    let frameworks = [
        fw("a-gpu", "r", true, Resources::default()),
        fw("b-cpu", "r", false, Resources::default()),
    ];
    let plans = run(&agents, &frameworks);
    assert_eq!(
        pairs(&plans),
        vec![("a1", "a-gpu"), ("a2", "a-gpu"), ("a3", "b-cpu")]
    );
}

#[test]
fn with_the_flag_off_the_gpus_a_cpu_framework_cannot_take_go_to_a_gpu_framework() {
    let agents = [idle_agent("a1", res(64.0, 512 * GIB, 8))];
    let frameworks = [
        fw("a-cpu", "r", false, Resources::default()),
        fw("b-gpu", "r", true, Resources::default()),
    ];
    let config = AllocatorConfig {
        gpu_agents_for_gpu_frameworks_only: false,
        gpu_reserve: Resources::default(),
    };
    let plans = allocate(
        &agents,
        &frameworks,
        &no_roles(),
        &Filters::new(),
        &config,
        0,
    );
    assert_eq!(pairs(&plans), vec![("a1", "a-cpu"), ("a1", "b-gpu")]);
    assert_eq!(plans[1].resources, res(0.0, 0, 8));
}

#[test]
fn only_free_healthy_gpus_are_offered_each_once() {
    let mut a1 = agent("a1", res(64.0, 512 * GIB, 4), res(64.0, 512 * GIB, 8));
    // GPUs 0..3 are held; the caller lists 4..7, one of them unhealthy, in
    // no particular order.
    a1.free_gpus = vec![gpu("a1-gpu6", 6), gpu("a1-gpu4", 4), gpu("a1-gpu7", 7), {
        let mut g = gpu("a1-gpu5", 5);
        g.healthy = false;
        g
    }];
    // A caller bug: a2 lists a GPU of a1 too.
    let mut a2 = agent("a2", res(64.0, 512 * GIB, 2), res(64.0, 512 * GIB, 8));
    a2.free_gpus = vec![gpu("a1-gpu4", 0), gpu("a2-gpu1", 1)];
    let plans = run(
        &[a2, a1],
        &[
            fw("f1", "r", true, Resources::default()),
            fw("f2", "r", true, Resources::default()),
        ],
    );
    assert_eq!(pairs(&plans), vec![("a1", "f1"), ("a2", "f2")]);
    assert_eq!(plans[0].gpu_uuids, vec!["a1-gpu4", "a1-gpu6", "a1-gpu7"]);
    assert_eq!(plans[0].resources.gpus, 3, "gpus == named GPUs");
    assert_eq!(plans[1].gpu_uuids, vec!["a2-gpu1"]);
    assert_eq!(plans[1].resources.gpus, 1);
}

#[test]
fn free_gpus_beyond_the_free_count_are_not_offered() {
    let mut a1 = agent("a1", res(8.0, GIB, 2), res(8.0, GIB, 8));
    a1.free_gpus = (0..8).map(|i| gpu(&format!("g{i}"), i)).collect();
    let plans = run(&[a1], &[fw("f", "r", true, Resources::default())]);
    assert_eq!(plans[0].gpu_uuids, vec!["g0", "g1"]);
    assert_eq!(plans[0].resources.gpus, 2);
}

#[test]
fn harness_never_offers_a_gpu_twice_or_a_held_gpu() {
    let mut h = Harness::new();
    h.add_agent("a1", 64.0, 512 * GIB, 8)
        .add_agent("a2", 64.0, 512 * GIB, 8)
        .add_framework("f1", "r1", true)
        .add_framework("f2", "r2", true);
    let first = h.cycle();
    assert_eq!(first.len(), 2);
    h.accept("f1", &first[0].id);
    // a1's GPUs are now held; f2's offer of a2 is outstanding.
    h.advance(1_000);
    assert!(
        h.cycle().is_empty(),
        "nothing free that is not offered or held"
    );
    let expired = h.book.expired(h.now_ms, 1_000);
    assert_eq!(expired.len(), 1);
    let third = h.cycle();
    assert_eq!(third.len(), 1);
    assert_eq!(third[0].agent_id, "a2");
    let mut all = BTreeSet::new();
    for cycle in &h.log {
        for o in cycle {
            for g in &o.gpu_uuids {
                // a2's GPUs come back after expiry; nothing else repeats.
                assert!(all.insert(g.clone()) || g.starts_with("a2-"), "{g}");
            }
        }
    }
    for o in &third {
        for g in &o.gpu_uuids {
            assert!(!h.agents[0].held_gpus.contains(g));
        }
    }
}

// ---- determinism ----

#[test]
fn same_input_same_output_whatever_the_input_order() {
    let mut agents: Vec<AgentView> = (0..50)
        .map(|i| {
            let gpus = if i % 3 == 0 { 0 } else { 8 };
            idle_agent(&format!("agent-{i}"), res(32.0, 128 * GIB, gpus))
        })
        .collect();
    let mut frameworks: Vec<FrameworkView> = (0..12u32)
        .map(|i| {
            fw(
                &format!("fw-{i}"),
                &format!("role-{}", i % 3),
                i % 2 == 0,
                res(f64::from(i), u64::from(i) * GIB, 0),
            )
        })
        .collect();
    let roles = BTreeMap::from([(
        "role-1".to_string(),
        role(2.0, Some(res(100.0, 400 * GIB, 12))),
    )]);
    let go = |a: &[AgentView], f: &[FrameworkView]| {
        allocate(
            a,
            f,
            &roles,
            &Filters::new(),
            &AllocatorConfig::default(),
            7,
        )
    };
    let first = go(&agents, &frameworks);
    assert_eq!(first, go(&agents, &frameworks));
    agents.reverse();
    frameworks.reverse();
    assert_eq!(first, go(&agents, &frameworks));
}

// ---- offer book ----

fn plan(fw: &str, agent: &str, gpus: &[&str]) -> OfferPlan {
    OfferPlan {
        framework_id: fw.to_string(),
        agent_id: agent.to_string(),
        resources: res(4.0, GIB, gpus.len() as u32),
        gpu_uuids: gpus.iter().map(|g| g.to_string()).collect(),
        shares: Vec::new(),
    }
}

#[test]
fn offer_book_ids_and_take() {
    let mut book = OfferBook::new();
    let offers = book.record(
        vec![
            plan("f1", "a1", &["g1"]),
            plan("f1", "a2", &[]),
            plan("f2", "a3", &["g3", "g4"]),
        ],
        100,
    );
    let ids: Vec<&str> = offers.iter().map(|o| o.id.as_str()).collect();
    assert_eq!(ids, vec!["offer-1", "offer-2", "offer-3"]);
    assert!(offers.iter().all(|o| o.created_ms == 100));
    assert_eq!(book.get("offer-3").map(|o| o.agent_id.as_str()), Some("a3"));

    let err = |ids: &[&str], fw: &str, book: &mut OfferBook| {
        book.take(ids, fw).expect_err("should fail").to_string()
    };
    let cases: &[(&[&str], &str, &str)] = &[
        (&["offer-9"], "f1", "offer offer-9 is unknown"),
        (&["offer-0"], "f1", "offer offer-0 is unknown"),
        (&["offer-01"], "f1", "offer offer-01 is unknown"),
        (&["bogus"], "f1", "offer bogus is unknown"),
        (
            &["offer-3"],
            "f1",
            "offer offer-3 was not made to framework f1",
        ),
        (
            &["offer-1", "offer-1"],
            "f1",
            "offer offer-1 is named twice",
        ),
        // All or nothing: offer-1 is fine, offer-3 is not f1's.
        (
            &["offer-1", "offer-3"],
            "f1",
            "offer offer-3 was not made to framework f1",
        ),
    ];
    for (ids, fw, want) in cases {
        assert_eq!(err(ids, fw, &mut book), *want, "{ids:?}");
    }
    assert_eq!(book.len(), 3, "failed takes change nothing");

    let taken = book.take(&["offer-2", "offer-1"], "f1").expect("take");
    let ids: Vec<&str> = taken.iter().map(|o| o.id.as_str()).collect();
    assert_eq!(ids, vec!["offer-2", "offer-1"]);
    assert_eq!(
        err(&["offer-1"], "f1", &mut book),
        "offer offer-1 is no longer outstanding (already accepted or declined, rescinded or expired)"
    );
    assert_eq!(book.len(), 1);
    assert!(book.take::<&str>(&[], "f1").expect("empty").is_empty());

    // Numbers keep going; a book started later refuses earlier numbers.
    let next = book.record(vec![plan("f1", "a1", &[])], 200);
    assert_eq!(next[0].id, "offer-4");
    // Taking what is still outstanding skips the rest: offer-1 was taken,
    // offer-3 is f2's, offer-9 was never made.
    let taken = book.take_outstanding(&["offer-1", "offer-3", "offer-4", "offer-9"], "f1");
    let ids: Vec<&str> = taken.iter().map(|o| o.id.as_str()).collect();
    assert_eq!(ids, vec!["offer-4"]);
    assert_eq!(book.len(), 1, "only f2's offer-3 is left");
    let mut later = OfferBook::starting_at(1 << 32);
    let o = later.record(vec![plan("f1", "a1", &[])], 0);
    assert_eq!(o[0].id, format!("offer-{}", 1u64 << 32));
    assert_eq!(
        err(&["offer-1"], "f1", &mut later),
        "offer offer-1 is unknown"
    );
}

#[test]
fn offer_book_expiry_rescind_and_accounting() {
    let mut book = OfferBook::new();
    book.record(
        vec![plan("f1", "a1", &["g1"]), plan("f2", "a2", &["g2"])],
        1_000,
    );
    book.record(
        vec![plan("f1", "a2", &["g3", "g4"]), plan("f3", "a3", &[])],
        2_000,
    );

    assert_eq!(
        book.offered_gpus(),
        BTreeSet::from(["g1", "g2", "g3", "g4"].map(String::from))
    );
    let by_fw = book.offered_by_framework();
    assert_eq!(by_fw["f1"], res(8.0, 2 * GIB, 3));
    assert_eq!(by_fw["f2"], res(4.0, GIB, 1));
    assert_eq!(book.offered_on_agent("a2"), res(8.0, 2 * GIB, 3));
    assert_eq!(book.offered_on_agent("nowhere"), Resources::default());
    assert_eq!(book.offered_by_agent()["a2"], res(8.0, 2 * GIB, 3));
    assert!(book.is_gpu_offered("g3") && !book.is_gpu_offered("g9"));
    assert!(book.index_agrees());

    assert!(book.expired(1_999, 1_000).is_empty());
    let gone: Vec<String> = book
        .expired(2_000, 1_000)
        .into_iter()
        .map(|o| o.id)
        .collect();
    assert_eq!(gone, vec!["offer-1", "offer-2"]);
    assert!(!book.is_gpu_offered("g1") && book.is_gpu_offered("g4"));
    assert!(book.index_agrees());

    let gone: Vec<String> = book.rescind_agent("a2").into_iter().map(|o| o.id).collect();
    assert_eq!(gone, vec!["offer-3"]);
    assert_eq!(book.offered_on_agent("a2"), Resources::default());
    assert!(!book.is_gpu_offered("g3") && book.index_agrees());
    let gone: Vec<String> = book
        .rescind_framework("f3")
        .into_iter()
        .map(|o| o.id)
        .collect();
    assert_eq!(gone, vec!["offer-4"]);
    assert!(book.is_empty());
    assert!(book.index_agrees());
    assert!(book.offered_gpus().is_empty());
    assert!(book.offered_by_framework().is_empty());
}

// ---- property test over generated clusters ----

/// Knuth's MMIX LCG: deterministic, no dependency.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

struct Generated {
    agents: Vec<AgentView>,
    frameworks: Vec<FrameworkView>,
    roles: BTreeMap<String, RoleConfig>,
    filters: Filters,
    config: AllocatorConfig,
    now_ms: u64,
}

fn generate(rng: &mut Lcg) -> Generated {
    let agents = (0..1 + rng.below(30))
        .map(|i| {
            let gpus = [0, 0, 1, 4, 8][rng.below(5) as usize];
            let total = res(
                [4.0, 16.0, 64.0][rng.below(3) as usize],
                [8, 64, 512][rng.below(3) as usize] * GIB,
                gpus,
            );
            let held_gpus = rng.below(u64::from(gpus) + 1) as u32;
            let mut free = res(
                total.cpus * rng.below(5) as f64 / 4.0,
                total.mem_mib * rng.below(5) / 4,
                gpus - held_gpus,
            );
            let mut free_gpus: Vec<_> = (held_gpus..gpus)
                .map(|g| {
                    let mut info = gpu(&format!("agent-{i}-gpu{g}"), g);
                    info.healthy = !rng.chance(10);
                    info
                })
                .collect();
            if rng.chance(20) {
                free_gpus.reverse();
            }
            if rng.chance(10) {
                free.gpus = free.gpus.saturating_sub(1);
            }
            AgentView {
                id: format!("agent-{i}"),
                hostname: String::new(),
                free,
                free_gpus,
                total,
                attributes: BTreeMap::new(),
            }
        })
        .collect();
    let frameworks = (0..1 + rng.below(10))
        .map(|i| FrameworkView {
            id: format!("fw-{i}"),
            role: format!("role-{}", rng.below(4)),
            gpu_capable: rng.chance(50),
            suppressed: rng.chance(15),
            demand: Demand::Whole,
            allocated: res(
                rng.below(64) as f64 * 0.5,
                rng.below(256) * GIB,
                rng.below(8) as u32,
            ),
        })
        .collect();
    let mut roles = BTreeMap::new();
    for r in 0..4 {
        if rng.chance(60) {
            let quota = rng.chance(60).then(|| {
                res(
                    rng.below(200) as f64 * 0.5,
                    rng.below(1024) * GIB,
                    rng.below(24) as u32,
                )
            });
            roles.insert(format!("role-{r}"), role(1.0 + rng.below(3) as f64, quota));
        }
    }
    let now_ms = 10_000;
    let mut filters = Filters::new();
    for _ in 0..rng.below(20) {
        filters.add(
            &format!("fw-{}", rng.below(10)),
            &format!("agent-{}", rng.below(30)),
            now_ms - 5_000 + rng.below(10_000),
        );
    }
    Generated {
        agents,
        frameworks,
        roles,
        filters,
        config: AllocatorConfig {
            gpu_agents_for_gpu_frameworks_only: rng.chance(70),
            gpu_reserve: Resources::default(),
        },
        now_ms,
    }
}

#[test]
fn property_generated_clusters() {
    let mut rng = Lcg(0x5eed);
    let mut offers_made = 0;
    for case in 0..500 {
        let g = generate(&mut rng);
        let plans = allocate(
            &g.agents,
            &g.frameworks,
            &g.roles,
            &g.filters,
            &g.config,
            g.now_ms,
        );
        offers_made += plans.len();
        check(&g, &plans, case);

        let mut agents = g.agents.clone();
        let mut frameworks = g.frameworks.clone();
        agents.reverse();
        frameworks.reverse();
        let again = allocate(
            &agents,
            &frameworks,
            &g.roles,
            &g.filters,
            &g.config,
            g.now_ms,
        );
        assert_eq!(plans, again, "case {case}: deterministic");
    }
    assert!(
        offers_made > 500,
        "the generator makes offers: {offers_made}"
    );
}

fn check(g: &Generated, plans: &[OfferPlan], case: usize) {
    let agents: BTreeMap<&str, &AgentView> = g.agents.iter().map(|a| (a.id.as_str(), a)).collect();
    let fws: BTreeMap<&str, &FrameworkView> =
        g.frameworks.iter().map(|f| (f.id.as_str(), f)).collect();
    let mut gpus_seen = BTreeSet::new();
    let mut per_agent: BTreeMap<&str, Resources> = BTreeMap::new();
    let mut per_role: BTreeMap<&str, Resources> = BTreeMap::new();
    let mut served = BTreeSet::new();
    for p in plans {
        let a = agents[p.agent_id.as_str()];
        let f = fws[p.framework_id.as_str()];
        let ctx = format!("case {case}: {p:?}");
        assert!(
            served.insert((&p.agent_id, &p.framework_id)),
            "{ctx}: twice"
        );
        assert!(!f.suppressed, "{ctx}: suppressed");
        assert!(
            !g.filters.is_filtered(&f.id, &a.id, g.now_ms),
            "{ctx}: filtered"
        );
        if g.config.gpu_agents_for_gpu_frameworks_only && a.total.gpus > 0 {
            assert!(f.gpu_capable, "{ctx}: GPU agent to a CPU framework");
        }
        if !f.gpu_capable {
            assert_eq!(p.resources.gpus, 0, "{ctx}: GPUs to a CPU framework");
        }
        assert_eq!(p.resources.gpus as usize, p.gpu_uuids.len(), "{ctx}");
        assert!(
            p.resources.cpus > 0.0 || p.resources.mem_mib > 0 || p.resources.gpus > 0,
            "{ctx}: empty"
        );
        for u in &p.gpu_uuids {
            assert!(gpus_seen.insert(u.clone()), "{ctx}: GPU {u} twice");
            assert!(
                a.free_gpus.iter().any(|g| &g.uuid == u && g.healthy),
                "{ctx}: GPU {u} not free and healthy on the agent"
            );
        }
        let sum = per_agent.entry(a.id.as_str()).or_default();
        *sum = sum.add(&p.resources);
        let sum = per_role.entry(f.role.as_str()).or_default();
        *sum = sum.add(&p.resources);
    }
    for (id, sum) in &per_agent {
        let free = agents[id].free;
        assert!(
            sum.cpus <= free.cpus + 1e-9,
            "case {case}: {id} cpus {sum:?} > {free:?}"
        );
        assert!(sum.mem_mib <= free.mem_mib, "case {case}: {id} mem");
        assert!(sum.gpus <= free.gpus, "case {case}: {id} gpus");
    }
    let held = |role: &str| {
        g.frameworks
            .iter()
            .filter(|f| f.role == role)
            .fold(Resources::default(), |acc, f| acc.add(&f.allocated))
    };
    for (role, offered) in &per_role {
        let Some(quota) = g.roles.get(*role).and_then(|r| r.quota) else {
            continue;
        };
        let after = held(role).add(offered);
        let ctx = format!("case {case}: role {role} quota {quota:?} after {after:?}");
        assert!(
            offered.cpus == 0.0 || after.cpus <= quota.cpus + 1e-9,
            "{ctx}"
        );
        assert!(
            offered.mem_mib == 0 || after.mem_mib <= quota.mem_mib,
            "{ctx}"
        );
        assert!(offered.gpus == 0 || after.gpus <= quota.gpus, "{ctx}");
    }

    // Work-conserving: what is left on an agent, no eligible framework that
    // has not had it could take (rooms only shrink during a cycle, so the
    // room at the end bounds the room it had then).
    for a in &g.agents {
        let offered = per_agent.get(a.id.as_str()).copied().unwrap_or_default();
        let left_cpus = (a.free.cpus - offered.cpus).max(0.0);
        let left_mem = a.free.mem_mib - offered.mem_mib;
        let named = a.free_gpus.iter().filter(|x| x.healthy).count() as u32;
        let left_gpus = a.free.gpus.min(named).saturating_sub(offered.gpus);
        for f in &g.frameworks {
            if f.suppressed
                || served.contains(&(&a.id, &f.id))
                || g.filters.is_filtered(&f.id, &a.id, g.now_ms)
                || (g.config.gpu_agents_for_gpu_frameworks_only
                    && a.total.gpus > 0
                    && !f.gpu_capable)
            {
                continue;
            }
            let mut could = res(
                left_cpus,
                left_mem,
                if f.gpu_capable { left_gpus } else { 0 },
            );
            if let Some(q) = g.roles.get(&f.role).and_then(|r| r.quota) {
                let end =
                    held(&f.role).add(&per_role.get(f.role.as_str()).copied().unwrap_or_default());
                let room = res(
                    (q.cpus - end.cpus).max(0.0),
                    q.mem_mib.saturating_sub(end.mem_mib),
                    q.gpus.saturating_sub(end.gpus),
                );
                could = res(
                    could.cpus.min(room.cpus),
                    could.mem_mib.min(room.mem_mib),
                    could.gpus.min(room.gpus),
                );
            }
            assert!(
                could.cpus <= 1e-9 && could.mem_mib == 0 && could.gpus == 0,
                "case {case}: {} could still take {could:?} of {}",
                f.id,
                a.id
            );
        }
    }
}

/// The DRF paper's example, one round at a time: two frameworks of
/// unknown demand get half the agent each; once their task sizes are
/// known, progressive filling ends A at 3 tasks and B at 2.
#[test]
fn contended_agents_are_split_by_progressive_filling() {
    let total = res(9.0, 18 * GIB, 0);
    let mut a = fw("A", "r", false, Resources::default());
    let mut b = fw("B", "r", false, Resources::default());
    a.demand = Demand::Unknown;
    b.demand = Demand::Unknown;
    let plans = run(&[idle_agent("x", total)], &[a.clone(), b.clone()]);
    let split: Vec<_> = plans
        .iter()
        .map(|p| (p.framework_id.as_str(), p.resources))
        .collect();
    assert_eq!(
        split,
        [("A", res(4.5, 9 * GIB, 0)), ("B", res(4.5, 9 * GIB, 0))]
    );
    // Greedy, they launched what fit: A 2 of <1, 4 GiB>, B 1 of <3, 1 GiB>.
    a.demand = Demand::Task(res(1.0, 4 * GIB, 0));
    b.demand = Demand::Task(res(3.0, GIB, 0));
    a.allocated = res(2.0, 8 * GIB, 0);
    b.allocated = res(3.0, GIB, 0);
    let free = res(4.0, 9 * GIB, 0);
    for order in [[a.clone(), b.clone()], [b.clone(), a.clone()]] {
        let plans = run(&[agent("x", free, total)], &order);
        let mut got: Vec<_> = plans
            .iter()
            .map(|p| (p.framework_id.as_str(), p.resources))
            .collect();
        got.sort_by(|x, y| x.0.cmp(y.0));
        assert_eq!(got, [("A", res(1.0, 4 * GIB, 0)), ("B", res(3.0, GIB, 0))]);
    }
    // A framework asking for whole agents gets the rest in its turn.
    b.demand = Demand::Whole;
    let plans = run(&[agent("x", free, total)], &[a, b]);
    let got: Vec<_> = plans
        .iter()
        .map(|p| (p.framework_id.as_str(), p.resources))
        .collect();
    assert_eq!(
        got,
        [("B", free)],
        "B is lower (1/3 < 4/9) and takes it all"
    );
}

/// Each free GPU keeps its reserve of cpus and memory: a framework without
/// GPUs gets only what is beyond it, and an offer of GPUs carries theirs.
#[test]
fn gpus_keep_their_reserve_of_cpus_and_memory() {
    let total = res(64.0, 256 * GIB, 8);
    let config = AllocatorConfig {
        gpu_agents_for_gpu_frameworks_only: false,
        gpu_reserve: res(2.0, 8 * GIB, 0),
    };
    let plans = allocate(
        &[idle_agent("x", total)],
        &[fw("cpu", "r", false, Resources::default())],
        &no_roles(),
        &Filters::new(),
        &config,
        0,
    );
    assert_eq!(plans[0].resources, res(48.0, 192 * GIB, 0));
    // What is left: 16 cpus and 64 GiB for the 8 GPUs, all offered.
    let left = res(16.0, 64 * GIB, 8);
    let plans = allocate(
        &[agent("x", left, total)],
        &[fw("gpu", "r", true, Resources::default())],
        &no_roles(),
        &Filters::new(),
        &config,
        0,
    );
    assert_eq!(plans[0].resources, left);
    // With cpus for only 3 GPUs' reserves, only 3 GPUs are offered.
    let short = res(6.5, 64 * GIB, 8);
    let plans = allocate(
        &[agent("x", short, total)],
        &[fw("gpu", "r", true, Resources::default())],
        &no_roles(),
        &Filters::new(),
        &config,
        0,
    );
    assert_eq!(plans[0].resources.gpus, 3);
    assert_eq!(plans[0].gpu_uuids.len(), 3);
    // A small host (2 cpus, 8 GPUs): the reserve is its own share per GPU,
    // so a whole offer still carries all its GPUs.
    let small = res(2.0, 24 * GIB, 8);
    let plans = allocate(
        &[idle_agent("y", small)],
        &[fw("gpu", "r", true, Resources::default())],
        &no_roles(),
        &Filters::new(),
        &config,
        0,
    );
    assert_eq!(plans[0].resources, small);
}

/// A framework whose demand is a task size is never offered less than one
/// task, alone or beside others, and whatever fits no framework's unit is
/// offered to nobody: B3 on the DRF example's agent leaves <0 cpus,
/// 15 GiB>, which A (<1 cpu, 4 GiB>) cannot use.
#[test]
fn no_offer_is_smaller_than_its_frameworks_task() {
    let total = res(9.0, 18 * GIB, 0);
    let mut a = fw("A", "r", false, Resources::default());
    let mut b = fw("B", "r", false, res(9.0, 3 * GIB, 0));
    a.demand = Demand::Task(res(1.0, 4 * GIB, 0));
    b.demand = Demand::Task(res(3.0, GIB, 0));
    let crumbs = agent("x", res(0.0, 15 * GIB, 0), total);
    assert_eq!(run(std::slice::from_ref(&crumbs), &[a.clone()]), []);
    assert_eq!(run(&[crumbs], &[a.clone(), b.clone()]), []);
    // One unit's room: offered, whole, to the one it fits.
    let room = agent("x", res(1.0, 15 * GIB, 0), total);
    let plans = run(&[room], &[a.clone(), b.clone()]);
    assert_eq!(pairs(&plans), [("x", "A")]);
    assert_eq!(plans[0].resources, res(1.0, 15 * GIB, 0));
    // A unit with GPUs carries their reserve: 1 GPU and 1 cpu is not a
    // unit of <1 cpu, 1 GPU> on a host that keeps 2 cpus per GPU.
    let mut g = fw("G", "r", true, Resources::default());
    g.demand = Demand::Task(res(1.0, GIB, 1));
    let gpu_host = res(16.0, 64 * GIB, 8);
    let short = agent("y", res(1.0, 32 * GIB, 1), gpu_host);
    assert_eq!(run(&[short], std::slice::from_ref(&g)), []);
    let enough = agent("y", res(2.0, 32 * GIB, 1), gpu_host);
    assert_eq!(pairs(&run(&[enough], &[g])), [("y", "G")]);
}
