//! The queue pass (`scheduler::queue::plan`): why every queued job waits,
//! and the preemption to make, over 1,000 and 10,000 agents of 8 GPUs that
//! running jobs of priority 0 fill (1, 2, 4 or 8 GPUs each, nearly full),
//! with 100 queued jobs of mixed sizes, half of them of priority 5 (so the
//! pass looks for victims). `gpuctl jobs list` runs this pass once; the
//! leader runs it after state changes while jobs wait, at most every 250 ms.
//!
//! And a queue far beyond the cluster (50 agents of 8 GPUs, 4,000 and
//! 16,000 queued one-GPU jobs of one priority): the pass must stay linear
//! in the queue (it was quadratic: 1.8 s at 4,000 before the preemptible
//! jobs were found once per pass).
//!
//! And the built-in scheduler placing straight from the free-capacity
//! index (`place_direct`) one job constrained to a zone that 10 agents of
//! 1,000 or 10,000 have (`zone=rare`): the index walks those 10, not every
//! agent; with a glob (`rar*`), agent by agent until one fits.
//!
//! Run: `cargo bench -p gpuctl-engine --bench queue`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use gpuctl_core::types::{AgentInfo, GpuInfo, JobSpec, Resources, Runtime};
use gpuctl_engine::scheduler::queue::{plan, QueueConfig};
use gpuctl_engine::scheduler::{place, place_direct};
use gpuctl_engine::state::{Command, Launch, Outcome, State};

const GPUS: u32 = 8;

/// Agent `a`: 8 simulated A100s.
fn agent(a: usize) -> AgentInfo {
    let id = format!("agent-{a:05}");
    AgentInfo {
        share_gpus: None,
        allowed_users: None,
        id: id.clone(),
        hostname: id,
        address: String::new(),
        total: Resources {
            cpus: 128.0,
            mem_mib: 1 << 20,
            gpus: GPUS,
            ports: 0,
        },
        gpus: (0..GPUS)
            .map(|g| GpuInfo::new(format!("GPU-{a:05}-{g}"), g, "NVIDIA A100", 40_960))
            .collect(),
        runtimes: vec![Runtime::Process],
        simulated_gpus: true,
        attributes: Default::default(),
        driver_version: None,
        cuda_driver_version: None,
        allow_root_tasks: false,
        allowed_mounts: Vec::new(),
        ports: None,
    }
}

fn state(agents: usize, queued: usize) -> State {
    let mut s = State::new();
    let mut i = 0u64;
    let mut apply = |s: &mut State, c: Command| {
        i += 1;
        s.apply(i, &c)
    };
    for a in 0..agents {
        let info = agent(a);
        let _ = apply(
            &mut s,
            Command::RegisterAgent {
                info,
                running_task_ids: vec![],
                at_ms: 0,
            },
        );
    }
    let spec = |gpus: u32, priority: i32| {
        let mut s = JobSpec::new(
            "bench",
            vec!["true".into()],
            Resources {
                cpus: 1.0,
                mem_mib: 0,
                gpus,
                ports: 0,
            },
        );
        s.priority = priority;
        s
    };
    // Fill each agent: 8 = 4 + 2 + 1 (+ 1 left free on one agent in four).
    for a in 0..agents {
        let sizes: &[u32] = if a % 4 == 0 {
            &[4, 2, 1]
        } else {
            &[4, 2, 1, 1]
        };
        let mut next = 0;
        for &g in sizes {
            let Ok(Outcome::JobSubmitted { job_id }) = apply(
                &mut s,
                Command::SubmitJob {
                    spec: spec(g, 0),
                    at_ms: 0,
                    request_id: None,
                },
            ) else {
                continue;
            };
            let gpus = (next..next + g)
                .map(|x| format!("GPU-{a:05}-{x}"))
                .collect();
            next += g;
            let _ = apply(
                &mut s,
                Command::LaunchTasks {
                    launches: vec![Launch {
                        job_id,
                        agent_id: format!("agent-{a:05}"),
                        gpu_uuids: gpus,
                    }],
                    at_ms: 1,
                },
            );
        }
    }
    for q in 0..queued {
        let gpus = [1, 2, 4, 8][q % 4];
        let priority = if q % 2 == 0 { 5 } else { 0 };
        let _ = apply(
            &mut s,
            Command::SubmitJob {
                spec: spec(gpus, priority),
                at_ms: 2,
                request_id: None,
            },
        );
    }
    s
}

/// Empty agents and a queue of one-GPU jobs of one priority.
fn burst(agents: usize, queued: usize) -> State {
    let mut s = State::new();
    let mut i = 0u64;
    for a in 0..agents {
        i += 1;
        let register = Command::RegisterAgent {
            info: agent(a),
            running_task_ids: vec![],
            at_ms: 0,
        };
        s.apply(i, &register).expect("register");
    }
    for _ in 0..queued {
        i += 1;
        let spec = JobSpec::new(
            "burst",
            vec!["true".into()],
            Resources {
                cpus: 1.0,
                mem_mib: 0,
                gpus: 1,
                ports: 0,
            },
        );
        let submit = Command::SubmitJob {
            spec,
            at_ms: 2,
            request_id: None,
        };
        s.apply(i, &submit).expect("submit");
    }
    s
}

/// `agents` idle agents, every 1 in `agents / 10` in zone `rare` (the
/// last ones, so that a walk of every agent reaches them last), the others
/// in `common`, and one queued 8-GPU job asking for `zone=pattern`.
fn zoned(agents: usize, pattern: &str) -> State {
    let mut s = State::new();
    let mut i = 0u64;
    for a in 0..agents {
        i += 1;
        let mut info = agent(a);
        let zone = if a >= agents - 10 { "rare" } else { "common" };
        info.attributes.insert("zone".into(), zone.into());
        let register = Command::RegisterAgent {
            info,
            running_task_ids: vec![],
            at_ms: 0,
        };
        s.apply(i, &register).expect("register");
    }
    let mut spec = JobSpec::new(
        "zoned",
        vec!["true".into()],
        Resources {
            cpus: 1.0,
            mem_mib: 0,
            gpus: GPUS,
            ports: 0,
        },
    );
    spec.placement
        .constraints
        .insert("zone".into(), pattern.into());
    let submit = Command::SubmitJob {
        spec,
        at_ms: 2,
        request_id: None,
    };
    s.apply(i + 1, &submit).expect("submit");
    s
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("queue_pass");
    g.sample_size(10);
    for agents in [1_000usize, 10_000] {
        let s = state(agents, 100);
        let p = plan(&s, &QueueConfig::default());
        assert_eq!(p.reasons.len(), 100);
        assert!(
            p.preemption.is_some(),
            "the bench must exercise the victim search"
        );
        g.bench_with_input(BenchmarkId::new("plan_100_queued", agents), &s, |b, s| {
            b.iter(|| black_box(plan(s, &QueueConfig::default())))
        });
        g.bench_with_input(BenchmarkId::new("place_100_queued", agents), &s, |b, s| {
            b.iter(|| black_box(place(s, &Default::default(), &Default::default())))
        });
    }
    for queued in [4_000usize, 16_000] {
        let s = burst(50, queued);
        assert_eq!(plan(&s, &QueueConfig::default()).reasons.len(), queued);
        g.bench_with_input(
            BenchmarkId::new("plan_burst_50_agents", queued),
            &s,
            |b, s| b.iter(|| black_box(plan(s, &QueueConfig::default()))),
        );
    }
    for agents in [1_000usize, 10_000] {
        for pattern in ["rare", "rar*"] {
            let s = zoned(agents, pattern);
            let placed = place_direct(&s, Default::default(), false, u64::MAX);
            assert_eq!(placed.len(), 1);
            assert!(placed[0].agent_id >= format!("agent-{:05}", agents - 10));
            g.bench_with_input(
                BenchmarkId::new(format!("place_direct_zone_{pattern}"), agents),
                &s,
                |b, s| b.iter(|| black_box(place_direct(s, Default::default(), false, u64::MAX))),
            );
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
