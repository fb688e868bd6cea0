//! One allocation cycle of the framework API's allocator (hierarchical DRF,
//! GPUs named by UUID) at 1,000 and 10,000 agents. Building the views is the
//! caller's cost and is done once, outside the measurement. The cluster is
//! `gpuctl_engine::allocator::bench_cluster` (the scale bench uses it too).
//!
//! Run: `cargo bench -p gpuctl-engine --bench allocator`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use gpuctl_engine::allocator::bench_cluster::{cluster, FRAMEWORKS};
use gpuctl_engine::allocator::{allocate, AllocatorConfig};

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
