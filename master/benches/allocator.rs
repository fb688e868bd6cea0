//! One allocation cycle of the framework API's allocator (hierarchical DRF,
//! GPUs named by UUID) at 1,000 and 10,000 agents. Building the views is the
//! caller's cost and is done once, outside the measurement.
//!
//! Run: `cargo bench -p gpuctl-master --bench allocator`

use std::collections::BTreeMap;
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use gpuctl_core::types::{GpuInfo, Resources};
use gpuctl_master::allocator::{
    allocate, AgentView, AllocatorConfig, Filters, FrameworkView, RoleConfig,
};

const FRAMEWORKS: usize = 100;
const ROLES: usize = 10;
const GPUS: u32 = 8;

fn res(cpus: f64, mem_mib: u64, gpus: u32) -> Resources {
    Resources {
        cpus,
        mem_mib,
        gpus,
    }
}

/// Half of each role's frameworks: 0-9, 20-29, ... (roles are `j % 10`).
fn gpu_capable(j: usize) -> bool {
    (j / ROLES) % 2 == 0
}

struct Cluster {
    agents: Vec<AgentView>,
    frameworks: Vec<FrameworkView>,
    roles: BTreeMap<String, RoleConfig>,
    filters: Filters,
}

/// Agents of 64 cpus, 512 GiB and 8 A100 40 GB. One in four is half used
/// (GPUs 0-3 held), one in ten is fully used; the holders are GPU-capable
/// frameworks. 100 frameworks in 10 roles, half GPU-capable; two roles
/// weighted, two with a quota; each framework has declined 1% of the agents.
fn cluster(n_agents: usize) -> Cluster {
    let total = res(64.0, 512 * 1024, GPUS);
    let mut held_by = vec![Resources::default(); FRAMEWORKS];
    let gpu_capable_frameworks: Vec<usize> = (0..FRAMEWORKS).filter(|&j| gpu_capable(j)).collect();
    let agents = (0..n_agents)
        .map(|i| {
            let id = format!("agent-{i:05}");
            let used = if i % 10 == 3 {
                total
            } else if i % 4 == 0 {
                res(24.0, 192 * 1024, GPUS / 2)
            } else {
                Resources::default()
            };
            let holder = gpu_capable_frameworks[i % gpu_capable_frameworks.len()];
            held_by[holder] = held_by[holder].add(&used);
            AgentView {
                hostname: format!("{id}.cluster.local"),
                free: total.saturating_sub(&used),
                free_gpus: (used.gpus..GPUS)
                    .map(|g| {
                        GpuInfo::new(
                            format!("GPU-{i:08x}-{g:04x}-4000-8000-000000000000"),
                            g,
                            "NVIDIA A100-SXM4-40GB",
                            40_960,
                        )
                    })
                    .collect(),
                total,
                attributes: BTreeMap::from([("rack".to_string(), format!("r{}", i / 40))]),
                id,
            }
        })
        .collect();
    let frameworks = (0..FRAMEWORKS)
        .map(|j| FrameworkView {
            id: format!("framework-{j:03}"),
            role: format!("role-{}", j % ROLES),
            gpu_capable: gpu_capable(j),
            suppressed: false,
            allocated: held_by[j],
        })
        .collect();
    let n = n_agents as f64;
    let roles = BTreeMap::from([
        (
            "role-0".to_string(),
            RoleConfig {
                weight: 2.0,
                quota: None,
            },
        ),
        (
            "role-1".to_string(),
            RoleConfig {
                weight: 3.0,
                quota: None,
            },
        ),
        (
            "role-2".to_string(),
            RoleConfig {
                weight: 1.0,
                quota: Some(res(n * 2.0, (n as u64) * 16 * 1024, n_agents as u32 / 4)),
            },
        ),
        (
            "role-3".to_string(),
            RoleConfig {
                weight: 1.0,
                quota: Some(res(n, (n as u64) * 8 * 1024, n_agents as u32 / 8)),
            },
        ),
    ]);
    let mut filters = Filters::new();
    for i in 0..n_agents {
        let j = i % FRAMEWORKS;
        filters.add(
            &format!("framework-{j:03}"),
            &format!("agent-{i:05}"),
            60_000,
        );
    }
    Cluster {
        agents,
        frameworks,
        roles,
        filters,
    }
}

fn allocation_cycle(c: &mut Criterion) {
    let config = AllocatorConfig::default();
    let mut group = c.benchmark_group("allocation_cycle");
    group.sample_size(30);
    for n in [1_000, 10_000] {
        let cl = cluster(n);
        let plans = allocate(
            &cl.agents,
            &cl.frameworks,
            &cl.roles,
            &cl.filters,
            &config,
            1_000,
        );
        let gpus: usize = plans.iter().map(|p| p.gpu_uuids.len()).sum();
        eprintln!(
            "{n} agents, {FRAMEWORKS} frameworks: {} offers naming {gpus} GPUs per cycle",
            plans.len()
        );
        group.bench_with_input(BenchmarkId::new("agents", n), &cl, |b, cl| {
            b.iter(|| {
                allocate(
                    black_box(&cl.agents),
                    black_box(&cl.frameworks),
                    &cl.roles,
                    &cl.filters,
                    &config,
                    black_box(1_000),
                )
            })
        });
    }
    group.finish();
}

criterion_group!(benches, allocation_cycle);
criterion_main!(benches);
