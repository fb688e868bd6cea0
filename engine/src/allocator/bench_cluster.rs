//! The cluster the allocator's benchmarks measure (`engine/benches/
//! allocator.rs`, the scale bench's pure allocation cycle): one
//! definition, so both measure the same thing. Not used by the master.

use std::collections::BTreeMap;

use super::{AgentView, Filters, FrameworkView, RoleConfig};
use gpuctl_core::types::{GpuInfo, Resources};

pub const FRAMEWORKS: usize = 100;
const ROLES: usize = 10;
const GPUS: u32 = 8;

fn res(cpus: f64, mem_mib: u64, gpus: u32) -> Resources {
    Resources {
        cpus,
        mem_mib,
        gpus,
        ports: 0,
    }
}

fn gpu_capable(j: usize) -> bool {
    (j / ROLES) % 2 == 0
}

pub struct Cluster {
    pub agents: Vec<AgentView>,
    pub frameworks: Vec<FrameworkView>,
    pub roles: BTreeMap<String, RoleConfig>,
    pub filters: Filters,
}

/// Agents of 64 cpus, 512 GiB and 8 A100s; one in four half used, one
/// in ten full; 100 frameworks in 10 roles, half GPU-capable, two roles
/// weighted, two with a quota; each framework declined 1% of the agents.
pub fn cluster(n_agents: usize) -> Cluster {
    let total = res(64.0, 512 * 1024, GPUS);
    let mut held_by = vec![Resources::default(); FRAMEWORKS];
    let capable: Vec<usize> = (0..FRAMEWORKS).filter(|&j| gpu_capable(j)).collect();
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
            let holder = capable[i % capable.len()];
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
            demand: super::Demand::Whole,
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
