//! Why a task fits no node, requirement by requirement, and how many agents each requirement rules out: the wait reason's data.

use super::*;

/// One requirement of a task, checked on its own by [`unsatisfiable`].
pub(super) enum Need<'r> {
    Runtime(Runtime),
    RootTasks,
    User(UserIds),
    Mount(&'r str),
    Attribute(&'r str, &'r str),
    /// A driver that meets what the job requires of it.
    Driver,
    /// Some GPU of the model (memory aside).
    Model,
    /// Some GPU of the model with the memory.
    Memory,
    /// `gpus` GPUs of the model with the memory.
    Count,
    Cpus,
    Mem,
    Ports,
}

impl Need<'_> {
    fn is_gpu(&self) -> bool {
        matches!(self, Need::Model | Need::Memory | Need::Count)
    }
}

/// Why no node could EVER run this task (ignoring current usage: every GPU
/// of the node, healthy or not, and its total capacity from `totals`).
/// `None` when some node could.
///
/// Requirements are checked in order: runtime, root tasks, the user, each mount, each
/// constraint, the driver, GPU model, GPU memory, GPU count, cpus, memory. The first that no remaining node
/// meets is named ("no agent runs docker", "no agent has GPU model H100*"),
/// with the most a node has of it ("no agent has 9 GPUs (at most 8)");
/// [`NeverFits::NoActiveAgent`] when there are no nodes. When some node
/// meets it alone but none together with the earlier requirements, those
/// are named too: "no agent has 8 GPUs among those that run docker and
/// have zone=us-east" (the words are the CLI's).
pub fn unsatisfiable(
    req: &TaskRequest,
    nodes: &[NodeView],
    totals: &dyn Fn(&str) -> Resources,
) -> Option<NeverFits> {
    if nodes.is_empty() {
        return Some(NeverFits::NoActiveAgent);
    }
    let need = req.resources;
    let n = req.devices_needed();
    let model = req.gpu_model;
    let mem = req.gpu_mem_min_mib;
    let steps = steps(req, n);

    let ask = || GpuAsk {
        count: need.gpus,
        model: model.map(String::from),
        mem_min_mib: mem,
        mig: req.wants.mig().map(String::from),
        fraction: req.wants.fraction().map(|f| (f.mem_mib, f.compute_pct)),
    };
    let requirement = |step: &Need| match step {
        Need::Runtime(rt) => Requirement::Runtime(*rt),
        Need::RootTasks => Requirement::RootTasks,
        Need::User(u) => Requirement::User(*u),
        Need::Mount(p) => Requirement::Mount(p.to_string()),
        Need::Attribute(k, v) => Requirement::Attribute {
            key: k.to_string(),
            pattern: v.to_string(),
        },
        Need::Model => Requirement::GpuModel(ask()),
        Need::Memory => Requirement::GpuMemory(ask()),
        Need::Count => Requirement::Gpus(ask()),
        Need::Cpus => Requirement::Cpus(need.cpus),
        Need::Mem => Requirement::Memory(need.mem_mib),
        Need::Ports => Requirement::Ports(need.ports),
        Need::Driver => Requirement::Driver(DriverAsk {
            requires: req
                .driver_requires()
                .map(|e| e.text().to_string())
                .collect(),
            newest_driver: None,
            newest_cuda: None,
        }),
    };

    let mut filter = GpuFilter::new(req);
    let mut model_only = GpuFilter::new(&TaskRequest {
        gpu_mem_min_mib: 0,
        ..*req
    });
    let mut meets = |step: &Need, node: &NodeView| -> bool {
        match step {
            Need::Runtime(rt) => node.runtimes.contains(rt),
            Need::RootTasks => node.allow_root_tasks,
            Need::User(u) => user_ok(*u, node),
            Need::Mount(p) => path_within(node.allowed_mounts, p),
            Need::Attribute(k, pat) => node.attributes.get(*k).is_some_and(|v| glob_match(pat, v)),
            Need::Driver => driver_ok(req, node),
            Need::Model => node.all_gpus.iter().any(|g| model_only.matches(g)),
            Need::Memory => filter.count_all(node) > 0,
            Need::Count => filter.count_all(node) >= n,
            Need::Cpus => need.cpus <= totals(node.id).cpus + 1e-9,
            Need::Mem => need.mem_mib <= totals(node.id).mem_mib,
            Need::Ports => need.ports <= totals(node.id).ports,
        }
    };

    let mut left: Vec<&NodeView> = nodes.iter().collect();
    // What narrowed `left`; the GPU steps once, as the whole GPU need.
    let mut among: Vec<Requirement> = Vec::new();
    for step in &steps {
        let before = left.len();
        let kept: Vec<&NodeView> = left.iter().copied().filter(|n| meets(step, n)).collect();
        if kept.is_empty() {
            let alone = nodes.iter().any(|node| meets(step, node));
            if step.is_gpu() {
                among.retain(|r| !matches!(r, Requirement::Gpus(_)));
            }
            // The most is of the agents the words are about.
            let (among, looked_at) = if alone && !among.is_empty() {
                (among, left)
            } else {
                (Vec::new(), nodes.iter().collect())
            };
            let need = match requirement(step) {
                Requirement::Driver(ask) => Requirement::Driver(DriverAsk {
                    newest_driver: newest(&looked_at, |d| d.version),
                    newest_cuda: newest(&looked_at, |d| d.cuda),
                    ..ask
                }),
                other => other,
            };
            return Some(NeverFits::Missing {
                need,
                among,
                largest: largest(req, step, &looked_at, totals),
            });
        }
        if kept.len() < before {
            let r = if step.is_gpu() {
                Requirement::Gpus(ask())
            } else {
                requirement(step)
            };
            if !among.contains(&r) {
                among.push(r);
            }
        }
        left = kept;
    }
    None
}

/// The requirements of `req`, in the order they are looked at; `n`: the
/// GPUs (or the one shared GPU) each task needs.
fn steps<'r>(req: &TaskRequest<'r>, n: usize) -> Vec<Need<'r>> {
    let mut steps = vec![Need::Runtime(req.runtime)];
    if req.run_as_root {
        steps.push(Need::RootTasks);
    }
    steps.extend(req.user.map(Need::User));
    steps.extend(req.mounts.iter().map(|m| Need::Mount(m.host_path.as_str())));
    steps.extend(req.checkpoint_dir.map(Need::Mount));
    steps.extend(
        req.constraints
            .iter()
            .map(|(k, v)| Need::Attribute(k.as_str(), v.as_str())),
    );
    if req.asks_driver() {
        steps.push(Need::Driver);
    }
    if n > 0 {
        if req.gpu_model.is_some() {
            steps.push(Need::Model);
        }
        if req.gpu_mem_min_mib > 0 {
            steps.push(Need::Memory);
        }
        steps.push(Need::Count);
    }
    steps.push(Need::Cpus);
    steps.push(Need::Mem);
    if req.resources.ports > 0 {
        steps.push(Need::Ports);
    }
    steps
}

/// The newest version one of `nodes` reports (as it reports it), of its
/// driver or its CUDA: compared as versions, unparsable ones left out.
pub(super) fn newest<'a>(
    nodes: &[&NodeView<'a>],
    of: impl Fn(&NodeDriver<'a>) -> Option<&'a str>,
) -> Option<String> {
    nodes
        .iter()
        .filter_map(|n| {
            let text = of(&n.driver)?;
            Some((Version::parse(text.trim())?, text))
        })
        .max_by_key(|(v, _)| *v)
        .map(|(_, text)| text.to_string())
}

/// The most one of `nodes` has of what `step` asks, in its unit.
pub(super) fn largest(
    req: &TaskRequest,
    step: &Need,
    nodes: &[&NodeView],
    totals: &dyn Fn(&str) -> Resources,
) -> Option<f64> {
    let mut filter = GpuFilter::new(req);
    let mut model_only = GpuFilter::new(&TaskRequest {
        gpu_mem_min_mib: 0,
        ..*req
    });
    let mut of = |node: &NodeView| -> Option<f64> {
        match step {
            Need::Runtime(_)
            | Need::RootTasks
            | Need::User(_)
            | Need::Mount(_)
            | Need::Attribute(..)
            | Need::Driver
            | Need::Model => None,
            Need::Memory if req.wants.mig().is_some() => {
                gpuctl_core::types::mig_devices_of(node.all_gpus)
                    .filter(|(g, d)| model_only.matches_mig(g, d))
                    .map(|(_, d)| d.memory_mib)
                    .max()
                    .map(|m| m as f64)
            }
            Need::Memory => node
                .all_gpus
                .iter()
                .filter(|g| model_only.matches(g))
                .map(|g| g.memory_mib)
                .max()
                .map(|m| m as f64),
            Need::Count => Some(filter.count_all(node) as f64),
            Need::Cpus => Some(totals(node.id).cpus),
            Need::Mem => Some(totals(node.id).mem_mib as f64),
            Need::Ports => Some(f64::from(totals(node.id).ports)),
        }
    };
    nodes.iter().filter_map(|n| of(n)).max_by(f64::total_cmp)
}

/// Why each node cannot take one task now, counted once per node for the
/// first thing it lacks: its runtime, security, constraints, driver, GPU model, GPU memory,
/// its size in all (`totals`), then free GPUs, cpus, memory (a job waiting
/// for resources says where they are short).
pub fn agent_counts(
    req: &TaskRequest,
    nodes: &[NodeView],
    totals: &dyn Fn(&str) -> Resources,
) -> AgentCounts {
    let need = req.resources;
    let n = req.devices_needed();
    let mut filter = GpuFilter::new(req);
    let mut model_only = GpuFilter::new(&TaskRequest {
        gpu_mem_min_mib: 0,
        ..*req
    });
    let mut c = AgentCounts {
        agents: u32::try_from(nodes.len()).unwrap_or(u32::MAX),
        ..AgentCounts::default()
    };
    for node in nodes {
        let scalars = Resources { gpus: 0, ..need };
        let slot = if !node.runtimes.contains(&req.runtime) {
            &mut c.filtered_runtime
        } else if !security_ok(req, node) {
            &mut c.filtered_security
        } else if !constraints_ok(req.constraints, node.attributes) {
            &mut c.filtered_constraints
        } else if !driver_ok(req, node) {
            &mut c.filtered_driver
        } else if n > 0
            && req.gpu_model.is_some()
            && !node.all_gpus.iter().any(|g| model_only.matches(g))
        {
            &mut c.filtered_gpu_model
        } else if n > 0 && req.gpu_mem_min_mib > 0 && filter.count_all(node) == 0 {
            &mut c.filtered_gpu_memory
        } else if filter.count_all(node) < n || !totals(node.id).fits(&scalars) {
            &mut c.filtered_too_small
        } else if req.wants.fraction().is_some() && filter.count_free(node) < n {
            // What its shared GPUs lack: memory, or only compute.
            let memory_free = req.wants.fraction().is_some_and(|f| {
                node.free_shared.iter().any(|(g, m, _)| {
                    filter.allowed(&g.uuid) && filter.matches(g) && *m >= f.mem_mib
                })
            });
            if memory_free {
                &mut c.exhausted_shared_compute
            } else {
                &mut c.exhausted_shared_memory
            }
        } else if node.free.gpus < need.gpus || filter.count_free(node) < n {
            &mut c.exhausted_gpus
        } else if need.cpus > node.free.cpus + 1e-9 {
            &mut c.exhausted_cpus
        } else if need.mem_mib > node.free.mem_mib {
            &mut c.exhausted_memory
        } else if need.ports > node.free.ports {
            &mut c.exhausted_ports
        } else {
            &mut c.fit_one
        };
        *slot += 1;
    }
    c
}
