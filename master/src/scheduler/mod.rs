//! The built-in job scheduler's placement. PURE: reads a state, returns the
//! launches to propose. The state machine re-checks every launch when it is
//! applied, so a stale decision is refused there, never double-booked.
//!
//! Jobs are taken in submission order; each is placed by the engine in
//! [`placement`] (bundle or spread, GPU model and memory, agent attribute
//! constraints) with GPUs chosen by interconnect ([`topology`]). A job that
//! fits nowhere waits and does not block smaller jobs behind it. Not built
//! yet (the rest of the GPU-aware scheduling issue): priority and
//! preemption, gangs (`--replicas`), retries.

pub mod placement;
pub mod topology;

use std::collections::{BTreeMap, BTreeSet};

use gpuctl_proto::types::{JobSpec, PlacementPolicy, Resources};

use crate::state::{AgentState, Launch, State};

/// What the scheduler may use on one agent: resources and exact GPUs (the
/// built-in scheduler's offers).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Available {
    pub resources: Resources,
    pub gpus: Vec<String>,
}

/// Placements for as many queued jobs as fit, one launch per job, using
/// only the agents' free resources minus what is offered to frameworks
/// (`offered_*`). The state's own view; tests and `wait_reason` use it.
pub fn place(
    state: &State,
    offered_gpus: &BTreeSet<String>,
    offered: &BTreeMap<String, Resources>,
) -> Vec<Launch> {
    let available: BTreeMap<String, Available> = state
        .agents
        .values()
        .filter(|a| a.state == AgentState::Active)
        .map(|a| {
            let o = offered.get(&a.info.id).copied().unwrap_or_default();
            let gpus = a
                .info
                .gpus
                .iter()
                .filter(|g| {
                    g.healthy
                        && !state.gpu_owner.contains_key(&g.uuid)
                        && !offered_gpus.contains(&g.uuid)
                })
                .map(|g| g.uuid.clone())
                .collect();
            (
                a.info.id.clone(),
                Available {
                    resources: a.free().saturating_sub(&o),
                    gpus,
                },
            )
        })
        .collect();
    place_in(state, &available, PlacementPolicy::Bundle)
}

/// The engine's policy for a job: its own, or the cluster's default.
pub fn policy_of(spec: &JobSpec, default: PlacementPolicy) -> placement::Policy {
    match spec.placement.policy.unwrap_or(default) {
        PlacementPolicy::Bundle => placement::Policy::Bundle,
        PlacementPolicy::Spread => placement::Policy::Spread,
    }
}

/// What a job's task asks of the placement engine.
pub fn request(spec: &JobSpec) -> placement::TaskRequest<'_> {
    placement::TaskRequest {
        resources: spec.resources,
        runtime: spec.runtime(),
        gpu_model: spec.placement.gpu_model.as_deref(),
        gpu_mem_min_mib: spec.placement.gpu_mem_min_mib,
        constraints: &spec.placement.constraints,
    }
}

/// Placements for queued jobs using exactly `available` (what the built-in
/// framework was offered): jobs in submission order, each placed by the
/// engine (`placement`) with its policy, constraints and GPU topology, on
/// what the jobs before it left. A job that fits nowhere waits and does not
/// block smaller jobs behind it.
pub fn place_in(
    state: &State,
    available: &BTreeMap<String, Available>,
    default_policy: PlacementPolicy,
) -> Vec<Launch> {
    let mut free: BTreeMap<&str, Resources> = available
        .iter()
        .map(|(id, a)| (id.as_str(), a.resources))
        .collect();
    let mut used_gpus: BTreeSet<String> = BTreeSet::new();
    let agents: Vec<_> = state
        .agents
        .values()
        .filter(|a| a.state == AgentState::Active && available.contains_key(&a.info.id))
        .collect();
    let mut out = Vec::new();
    for job in state.queued_jobs() {
        let nodes: Vec<placement::NodeView> = agents
            .iter()
            .filter_map(|a| {
                let offered = available.get(&a.info.id)?;
                Some(placement::NodeView {
                    id: a.info.id.as_str(),
                    attributes: &a.info.attributes,
                    runtimes: &a.info.runtimes,
                    free: *free.get(a.info.id.as_str())?,
                    free_gpus: a
                        .info
                        .gpus
                        .iter()
                        .filter(|g| {
                            g.healthy
                                && offered.gpus.contains(&g.uuid)
                                && !used_gpus.contains(&g.uuid)
                        })
                        .collect(),
                    all_gpus: &a.info.gpus,
                })
            })
            .collect();
        let req = request(&job.spec);
        let Some(p) = placement::place_task(&req, &nodes, policy_of(&job.spec, default_policy))
        else {
            continue;
        };
        if let Some(f) = free.get_mut(p.node.as_str()) {
            *f = f.saturating_sub(&job.spec.resources);
        }
        used_gpus.extend(p.gpus.iter().cloned());
        out.push(Launch {
            job_id: job.id.clone(),
            agent_id: p.node,
            gpu_uuids: p.gpus,
        });
    }
    out
}

/// Why a queued job is not placed, in one line (for `gpuctl jobs list`,
/// like Slurm's squeue): a requirement no agent could ever meet ("no agent
/// has GPU model H100*"), or `Resources` when some agent could run it once
/// resources are freed.
pub fn wait_reason(state: &State, job_id: &str) -> Option<String> {
    let job = state.jobs.get(job_id)?;
    let active: Vec<_> = state
        .agents
        .values()
        .filter(|a| a.state == AgentState::Active)
        .collect();
    let nodes: Vec<placement::NodeView> = active
        .iter()
        .map(|a| placement::NodeView {
            id: a.info.id.as_str(),
            attributes: &a.info.attributes,
            runtimes: &a.info.runtimes,
            free: a.info.total,
            free_gpus: a.info.gpus.iter().collect(),
            all_gpus: &a.info.gpus,
        })
        .collect();
    let totals = |id: &str| {
        state
            .agents
            .get(id)
            .map(|a| a.info.total)
            .unwrap_or_default()
    };
    if let Some(why) = placement::unsatisfiable(&request(&job.spec), &nodes, &totals) {
        return Some(why);
    }
    Some("Resources: waiting for resources to be freed".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Command;
    use gpuctl_proto::types::{AgentInfo, GpuInfo, JobSpec, Runtime};

    fn agent(id: &str, gpus: u32, runtimes: Vec<Runtime>) -> Command {
        Command::RegisterAgent {
            info: AgentInfo {
                id: id.into(),
                hostname: id.into(),
                address: String::new(),
                total: Resources {
                    cpus: 16.0,
                    mem_mib: 65536,
                    gpus,
                },
                gpus: (0..gpus)
                    .map(|i| GpuInfo::new(format!("GPU-{id}-{i}"), i, "A100", 40960))
                    .collect(),
                runtimes,
                simulated_gpus: true,
                attributes: Default::default(),
                driver_version: None,
                cuda_driver_version: None,
            },
            running_task_ids: vec![],
            at_ms: 0,
        }
    }

    fn job(gpus: u32, image: bool) -> Command {
        Command::SubmitJob {
            spec: JobSpec {
                placement: Default::default(),
                name: "j".into(),
                image: image.then(|| "busybox".into()),
                command: vec!["true".into()],
                env: Default::default(),
                resources: Resources {
                    cpus: 1.0,
                    mem_mib: 0,
                    gpus,
                },
            },
            at_ms: 0,
            request_id: None,
        }
    }

    fn state(cmds: Vec<Command>) -> State {
        let mut s = State::new();
        for (i, c) in cmds.iter().enumerate() {
            s.apply(i as u64 + 1, c).unwrap();
        }
        s
    }

    fn both() -> Vec<Runtime> {
        vec![Runtime::Docker, Runtime::Process]
    }

    #[test]
    fn placements_never_share_a_gpu_and_all_apply() {
        let mut s = state(vec![
            agent("a", 4, both()),
            agent("b", 4, both()),
            job(2, false),
            job(2, false),
            job(3, false),
            job(1, false),
        ]);
        let launches = place(&s, &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(launches.len(), 4);
        let mut seen = BTreeSet::new();
        for l in &launches {
            for g in &l.gpu_uuids {
                assert!(seen.insert(g.clone()), "{g} given twice");
            }
        }
        s.apply(100, &Command::LaunchTasks { launches, at_ms: 1 })
            .unwrap();
        assert!(s.queued_jobs().is_empty());
    }

    #[test]
    fn bundle_packs_small_jobs_onto_the_fullest_node() {
        // a has 2 GPUs taken, so a 1-GPU job goes there and b stays whole.
        let mut s = state(vec![
            agent("a", 4, both()),
            agent("b", 4, both()),
            job(2, false),
        ]);
        let l = place(&s, &BTreeSet::new(), &BTreeMap::new());
        s.apply(
            10,
            &Command::LaunchTasks {
                launches: l,
                at_ms: 0,
            },
        )
        .unwrap();
        let a_or_b = s.tasks["job-1.0"].agent_id.clone();
        s.apply(11, &job(1, false)).unwrap();
        let l = place(&s, &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(l[0].agent_id, a_or_b);
        s.apply(
            12,
            &Command::LaunchTasks {
                launches: l,
                at_ms: 0,
            },
        )
        .unwrap();
        // A 4-GPU job still fits on the untouched node.
        s.apply(13, &job(4, false)).unwrap();
        let l = place(&s, &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(l.len(), 1);
        assert_ne!(l[0].agent_id, a_or_b);
    }

    #[test]
    fn image_jobs_go_only_to_docker_agents() {
        let s = state(vec![
            agent("p", 2, vec![Runtime::Process]),
            agent("d", 2, both()),
            job(1, true),
        ]);
        let l = place(&s, &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].agent_id, "d");
        let s = state(vec![agent("p", 2, vec![Runtime::Process]), job(1, true)]);
        assert!(place(&s, &BTreeSet::new(), &BTreeMap::new()).is_empty());
        assert_eq!(wait_reason(&s, "job-1").unwrap(), "no agent runs docker");
    }

    #[test]
    fn a_job_too_big_waits_without_blocking_others() {
        let s = state(vec![agent("a", 2, both()), job(4, false), job(1, false)]);
        let l = place(&s, &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].job_id, "job-2");
        let why = wait_reason(&s, "job-1").unwrap();
        assert!(why.contains("no agent has 4 GPUs"), "{why}");
    }

    #[test]
    fn unhealthy_gpus_are_not_placed() {
        let mut cmd = agent("a", 2, both());
        if let Command::RegisterAgent { info, .. } = &mut cmd {
            info.gpus[0].healthy = false;
        }
        let s = state(vec![cmd, job(1, false), job(1, false)]);
        let l = place(&s, &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].gpu_uuids, vec!["GPU-a-1".to_string()]);
    }

    #[test]
    fn place_in_uses_only_what_was_offered() {
        let s = state(vec![
            agent("a", 4, both()),
            agent("b", 4, both()),
            job(2, false),
            job(1, false),
        ]);
        // Only agent b was offered, and only two of its GPUs.
        let available = BTreeMap::from([(
            "b".to_string(),
            Available {
                resources: Resources {
                    cpus: 4.0,
                    mem_mib: 1024,
                    gpus: 2,
                },
                gpus: vec!["GPU-b-2".into(), "GPU-b-3".into()],
            },
        )]);
        let l = place_in(&s, &available, PlacementPolicy::Bundle);
        assert_eq!(
            l.len(),
            1,
            "the 2-GPU job takes both offered GPUs; the 1-GPU job waits"
        );
        assert_eq!(l[0].agent_id, "b");
        assert_eq!(
            l[0].gpu_uuids,
            vec!["GPU-b-2".to_string(), "GPU-b-3".to_string()]
        );
        assert!(place_in(&s, &BTreeMap::new(), PlacementPolicy::Bundle).is_empty());
    }
}
