//! Placement of one task (and one gang) among 1,000 and 10,000 agents of 8
//! GPUs with a DGX-like topology (two NVLinked quads). One agent in four is
//! half used (GPUs 0-3 held), one in ten is full; one in three has H100s,
//! the rest A100s; every other agent has an old driver (460, CUDA 11.2),
//! which the CUDA 12.2 image's NVIDIA_REQUIRE_CUDA (21 alternatives, all
//! looked at before it is refused) leaves out. Building the views is the
//! caller's cost and is done once, outside the measurement.
//!
//! Run: `cargo bench -p gpuctl-engine --bench placement`

use std::collections::BTreeMap;
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use gpuctl_core::cuda_req::Expr;
use gpuctl_core::types::{GpuInfo, GpuPeer, PlacementPolicy, Resources, Runtime, Wants};
use gpuctl_engine::scheduler::placement::{
    choose_gpus, place_gang, place_task, NodeDriver, NodeView, TaskRequest,
};

const GPUS: u32 = 8;

struct Agent {
    id: String,
    attributes: BTreeMap<String, String>,
    free: Resources,
    gpus: Vec<GpuInfo>,
    held: u32,
}

const RUNTIMES: [Runtime; 2] = [Runtime::Docker, Runtime::Process];

fn dgx(i: usize) -> Vec<GpuInfo> {
    let (model, mem) = if i % 3 == 0 {
        ("NVIDIA H100 80GB HBM3", 81_920)
    } else {
        ("NVIDIA A100-SXM4-40GB", 40_960)
    };
    let uuid = |g: u32| format!("GPU-{i:08x}-{g:04x}-4000-8000-000000000000");
    (0..GPUS)
        .map(|g| {
            let mut info = GpuInfo::new(uuid(g), g, model, mem);
            info.numa_node = Some(g / 4);
            info.peers = (0..GPUS)
                .filter(|&p| p != g)
                .map(|p| {
                    let same_quad = p / 4 == g / 4;
                    GpuPeer {
                        uuid: uuid(p),
                        nvlinks: if same_quad { 2 } else { 0 },
                        pcie: if same_quad { "NODE" } else { "SYS" }.into(),
                    }
                })
                .collect();
            info
        })
        .collect()
}

fn cluster(n: usize) -> Vec<Agent> {
    (0..n)
        .map(|i| {
            let held = if i % 10 == 3 {
                GPUS
            } else if i % 4 == 0 {
                GPUS / 2
            } else {
                0
            };
            Agent {
                id: format!("agent-{i:05}"),
                attributes: BTreeMap::from([("rack".to_string(), format!("r{}", i / 40))]),
                free: Resources {
                    cpus: 64.0 - 8.0 * f64::from(held),
                    mem_mib: 512 * 1024 - 64 * 1024 * u64::from(held),
                    gpus: GPUS - held,
                    ports: 0,
                },
                gpus: dgx(i),
                held,
            }
        })
        .collect()
}

fn views(agents: &[Agent]) -> Vec<NodeView<'_>> {
    agents
        .iter()
        .map(|a| NodeView {
            id: &a.id,
            attributes: &a.attributes,
            runtimes: &RUNTIMES,
            allow_root_tasks: false,
            allowed_mounts: &[],
            allowed_users: None,
            free: a.free,
            free_gpus: a.gpus[a.held as usize..].iter().collect(),
            all_gpus: &a.gpus,
            free_mig: Vec::new(),
            free_shared: Vec::new(),
            driver: if a.id.ends_with(['0', '2', '4', '6', '8']) {
                NodeDriver::new(Some("460.32.03"), Some("11.2"))
            } else {
                NodeDriver::new(Some("535.129.03"), Some("12.2"))
            },
        })
        .collect()
}

use gpuctl_core::cuda_req::examples::CUDA_12_2;

fn placement(c: &mut Criterion) {
    let none = BTreeMap::new();
    let image = [Expr::parse(CUDA_12_2).expect("NVIDIA's requirement parses")];
    let task = |gpus: u32, model: Option<&'static str>| TaskRequest {
        resources: Resources {
            cpus: 4.0,
            mem_mib: 32 * 1024,
            gpus,
            ports: 0,
        },
        runtime: Runtime::Docker,
        gpu_model: model,
        gpu_mem_min_mib: 0,
        wants: Wants::Whole,
        constraints: &none,
        run_as_root: false,
        user: None,
        mounts: &[],
        checkpoint_dir: None,
        require_cuda: None,
        image_requires: &[],
        avoid: &[],
        now_ms: 0,
    };
    let cases: [(&str, TaskRequest, u32, PlacementPolicy); 5] = [
        ("1gpu-bundle", task(1, None), 1, PlacementPolicy::Bundle),
        (
            "4gpu-h100-spread",
            task(4, Some("*h100*")),
            1,
            PlacementPolicy::Spread,
        ),
        ("8gpu-bundle", task(8, None), 1, PlacementPolicy::Bundle),
        (
            "1gpu-cuda12.2-image-bundle",
            TaskRequest {
                image_requires: &image,
                avoid: &[],
                now_ms: 0,
                ..task(1, None)
            },
            1,
            PlacementPolicy::Bundle,
        ),
        (
            "gang-16x8-bundle",
            task(8, Some("*A100*")),
            16,
            PlacementPolicy::Bundle,
        ),
    ];
    let mut group = c.benchmark_group("placement");
    group.sample_size(30);
    for n in [1_000, 10_000] {
        let agents = cluster(n);
        let v = views(&agents);
        for (name, req, replicas, policy) in &cases {
            let got = place_gang(req, *replicas, &v, *policy);
            eprintln!(
                "{n} agents, {name}: {}",
                match &got {
                    Some(p) => format!("{} on {} ({} GPUs)", p.len(), p[0].node, p[0].gpus.len()),
                    None => "none".into(),
                }
            );
            group.bench_with_input(BenchmarkId::new(*name, n), &v, |b, v| {
                if *replicas == 1 {
                    b.iter(|| place_task(black_box(req), black_box(v), *policy))
                } else {
                    b.iter(|| place_gang(black_box(req), *replicas, black_box(v), *policy))
                }
            });
        }
    }
    group.finish();

    // Inside one node: 4 of 8 (exhaustive, 70 sets), 8 of 16 (exhaustive,
    // 12,870 sets), 8 of 32 (greedy).
    let mut group = c.benchmark_group("choose_gpus");
    for (k, n) in [(8usize, 4usize), (16, 8), (32, 8)] {
        let all: Vec<GpuInfo> = (0..k.div_ceil(8)).flat_map(|i| dgx(i * 3 + 1)).collect();
        let free: Vec<&GpuInfo> = all.iter().collect();
        group.bench_function(BenchmarkId::new(format!("{n}-of"), k), |b| {
            b.iter(|| choose_gpus(black_box(&free), &all, n))
        });
    }
    group.finish();
}

criterion_group!(benches, placement);
criterion_main!(benches);
