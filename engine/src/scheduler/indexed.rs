//! The built-in scheduler's room when it places straight from the state:
//! agents come from the free-capacity index (`state::capacity`) in the
//! placement engine's own order, so a job of whole GPUs looks at the first
//! agents that can take it, not at every agent.
//!
//! Why the answer is the engine's: the index walks agents by (free GPUs,
//! GPUs in use, id), the keys bundle and spread compare, and skips none
//! that could fit. For one task the first agent that can take it is the one
//! a scan of all agents picks. For a gang of R tasks the first R such
//! agents are enough: under bundle a node that took a task only gets better
//! (fewer left), so the engine moves to the next node only when one is
//! full; under spread every node with no task of the gang comes before any
//! with one. Either way no task goes beyond the R-th agent. The engine then
//! chooses among those R exactly as among all of them.
//!
//! Jobs the index does not order (MIG devices, fractions, no GPUs, or a
//! model or memory filter while some agent mixes GPU kinds) are placed on
//! views of every agent, built once per round when first needed.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};

use gpuctl_core::types::{
    devices, AgentId, GpuFraction, Holding, JobId, PlacementPolicy, Resources,
};

use super::placement::{self, NodeView};
use super::{free_shares, may_use, policy_of, request, Pool, PoolNode, Room};
use crate::state::capacity::{Capacity, ClassGroups, GpuClass};
use crate::state::{AgentRecord, JobRecord, State};

pub(crate) struct IndexRoom<'s> {
    state: &'s State,
    capacity: Cow<'s, Capacity>,
    default_policy: PlacementPolicy,
    /// Agents this round placed on, as they are now.
    changed: HashMap<&'s str, PoolNode<'s>>,
    /// The same agents by class and (free, in use) now; the index still
    /// has them as they were.
    overlay: ClassGroups,
    /// Every agent, for the jobs the index does not order.
    full: Option<Pool<'s>>,
}

/// What the state says is free on an agent.
fn node_of<'s>(state: &'s State, a: &'s AgentRecord) -> PoolNode<'s> {
    PoolNode {
        agent: a,
        free: a.free(),
        free_gpus: devices(&a.info.gpus)
            .filter(|d| state.device_free(*d))
            .map(|d| d.uuid())
            .collect(),
        shares: free_shares(state, a),
    }
}

/// (free whole GPUs, GPUs not free) of a node as the index counts them.
fn counts(n: &PoolNode) -> (u32, u32) {
    let gpus = &n.agent.info.gpus;
    let free = gpus
        .iter()
        .filter(|g| !g.mig.enabled && n.free_gpus.contains(g.uuid.as_str()))
        .count();
    (
        u32::try_from(free).unwrap_or(u32::MAX),
        u32::try_from(gpus.len().saturating_sub(free)).unwrap_or(u32::MAX),
    )
}

impl<'s> IndexRoom<'s> {
    pub fn new(state: &'s State, default_policy: PlacementPolicy) -> IndexRoom<'s> {
        IndexRoom {
            state,
            capacity: state.capacity(),
            default_policy,
            changed: HashMap::new(),
            overlay: ClassGroups::default(),
            full: None,
        }
    }

    /// Whether the index orders this job's candidates exactly.
    fn indexable(&self, job: &JobRecord) -> bool {
        let p = &job.spec.placement;
        let filtered = p.gpu_model.is_some() || p.gpu_mem_min_mib > 0;
        job.spec.template.resources.gpus > 0
            && job.avoid_gpus.is_empty()
            && p.mig.is_none()
            && p.fraction.is_none()
            && !(filtered && self.capacity.has_mixed())
    }

    fn full_pool(&mut self) -> &mut Pool<'s> {
        let state = self.state;
        let changed = &self.changed;
        self.full.get_or_insert_with(|| {
            let nodes = state
                .agents()
                .values()
                .filter(|a| a.accepts_tasks())
                .map(|a| {
                    let id = a.info.id.as_str();
                    let node = changed
                        .get(id)
                        .cloned()
                        .unwrap_or_else(|| node_of(state, a));
                    (id, node)
                })
                .collect();
            Pool::of_nodes(state, nodes)
        })
    }
}

impl<'s> Room<'s> for IndexRoom<'s> {
    fn views_for(
        &mut self,
        job: &JobRecord,
        reserved: &BTreeMap<AgentId, (JobId, i32)>,
    ) -> Cow<'_, [NodeView<'s>]> {
        if !self.indexable(job) {
            return self.full_pool().usable_views(reserved, job);
        }
        // Not indexable while it avoids GPUs, so none are avoided here.
        let req = request(job, 0);
        let policy = policy_of(&job.spec, self.default_policy);
        let n = job.spec.template.resources.gpus;
        let want = job.spec.replicas() as usize;
        let class_ok = |c: &GpuClass| match c {
            GpuClass::Same { model, memory_mib } => {
                placement::gpu_kind_matches(&req, model, *memory_mib)
            }
            // Only without filters (see `indexable`).
            GpuClass::Mixed => true,
        };
        let index = self
            .capacity
            .candidates(n, policy, class_ok, &job.spec.placement.constraints);
        let from_index = index.streams();
        let walk = index.with(self.overlay.walk(n, policy, class_ok));
        let mut views = Vec::with_capacity(want);
        for (id, stream) in walk {
            if views.len() == want {
                break;
            }
            // The index has an agent this round changed as it was: the
            // overlay has it as it is.
            if (stream < from_index && self.changed.contains_key(id)) || !may_use(reserved, job, id)
            {
                continue;
            }
            let view = match self.changed.get(id) {
                Some(n) => n.view(),
                None => match self.state.agent(id) {
                    Some(a) => node_of(self.state, a).view(),
                    None => continue,
                },
            };
            if placement::takes_one(&req, &view) {
                views.push(view);
            }
        }
        Cow::Owned(views)
    }

    fn take(&mut self, agent_id: &str, resources: &Resources, held: Holding<'_, GpuFraction>) {
        if let Some(full) = self.full.as_mut() {
            full.take(agent_id, resources, held);
        }
        let state = self.state;
        let Some(a) = state.agent(agent_id) else {
            return;
        };
        let id = a.info.id.as_str();
        let class = self
            .capacity
            .class_of(id)
            .cloned()
            .unwrap_or(GpuClass::Mixed);
        let node = self.changed.entry(id).or_insert_with(|| node_of(state, a));
        let before = counts(node);
        node.take(resources, held);
        let after = counts(node);
        self.overlay.remove(&class, before, id);
        self.overlay.insert(&class, after, id);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use gpuctl_core::types::{AgentInfo, GpuInfo, JobSpec, PlacementSpec, Runtime};
    use proptest::prelude::*;

    use super::super::{place, place_direct};
    use super::*;
    use crate::state::{Command, Launch};

    /// An agent: GPUs of one kind, or of two (`mixed`), some unhealthy.
    fn agent(i: usize, gpus: u32, h100: bool, mixed: bool, down: u32, cpus: f64) -> Command {
        agent_in(i, gpus, h100, mixed, down, cpus, None)
    }

    /// The same, with a `zone` attribute when given.
    fn agent_in(
        i: usize,
        gpus: u32,
        h100: bool,
        mixed: bool,
        down: u32,
        cpus: f64,
        zone: Option<&str>,
    ) -> Command {
        let id = format!("a{i:02}");
        Command::RegisterAgent {
            info: AgentInfo {
                share_gpus: None,
                allowed_users: None,
                id: id.clone(),
                hostname: id.clone(),
                address: String::new(),
                total: Resources {
                    cpus,
                    mem_mib: 65536,
                    gpus,
                    ports: 0,
                },
                gpus: (0..gpus)
                    .map(|g| {
                        let h = h100 ^ (mixed && g % 2 == 1);
                        let (model, mem) = if h { ("H100", 81920) } else { ("A100", 40960) };
                        let mut info = GpuInfo::new(format!("GPU-{id}-{g}"), g, model, mem);
                        info.healthy = g >= down;
                        info
                    })
                    .collect(),
                runtimes: vec![Runtime::Docker],
                simulated_gpus: true,
                attributes: zone
                    .map(|z| BTreeMap::from([("zone".to_string(), z.to_string())]))
                    .unwrap_or_default(),
                driver_version: None,
                cuda_driver_version: None,
                allow_root_tasks: false,
                allowed_mounts: Vec::new(),
                ports: None,
            },
            running_task_ids: vec![],
            at_ms: 0,
        }
    }

    #[derive(Debug, Clone)]
    struct Ask {
        gpus: u32,
        replicas: u32,
        spread: bool,
        model: Option<&'static str>,
        mem_min: u64,
        priority: i32,
        cpus: f64,
        /// A `zone` constraint (a pattern).
        zone: Option<&'static str>,
    }

    impl Ask {
        /// One task of `gpus` whole GPUs, bundled, no filter.
        fn whole(gpus: u32) -> Ask {
            Ask {
                gpus,
                replicas: 1,
                spread: false,
                model: None,
                mem_min: 0,
                priority: 0,
                cpus: 1.0,
                zone: None,
            }
        }
    }

    fn job(a: &Ask) -> Command {
        Command::SubmitJob {
            spec: JobSpec {
                name: "j".into(),
                replicas: a.replicas,
                priority: a.priority,
                placement: PlacementSpec {
                    policy: Some(if a.spread {
                        PlacementPolicy::Spread
                    } else {
                        PlacementPolicy::Bundle
                    }),
                    gpu_model: a.model.map(str::to_string),
                    gpu_mem_min_mib: a.mem_min,
                    constraints: a
                        .zone
                        .map(|z| BTreeMap::from([("zone".to_string(), z.to_string())]))
                        .unwrap_or_default(),
                    ..Default::default()
                },
                template: gpuctl_core::types::TaskTemplate {
                    image: Some("busybox".into()),
                    command: vec!["true".into()],
                    resources: Resources {
                        cpus: a.cpus,
                        mem_mib: 0,
                        gpus: a.gpus,
                        ports: 0,
                    },
                    ..Default::default()
                },
                ..Default::default()
            },
            at_ms: 0,
            request_id: None,
        }
    }

    fn ask() -> impl Strategy<Value = Ask> {
        (
            0u32..=8,
            1u32..=3,
            any::<bool>(),
            prop::option::of(prop::sample::select(vec!["*h100*", "A100", "*"])),
            prop::sample::select(vec![0u64, 50_000]),
            0i32..3,
            prop::sample::select(vec![1.0f64, 6.0]),
            // Exact values (one nobody has, one in another case), globs.
            prop::sample::select(vec![
                None,
                None,
                Some("a"),
                Some("B"),
                Some("c"),
                Some("?"),
                Some("*"),
            ]),
        )
            .prop_map(
                |(gpus, replicas, spread, model, mem_min, priority, cpus, zone)| Ask {
                    gpus,
                    replicas,
                    spread,
                    model,
                    mem_min,
                    priority,
                    cpus,
                    zone,
                },
            )
    }

    type AgentSpec = (u32, bool, bool, u32, f64, Option<&'static str>);

    fn agent_spec() -> impl Strategy<Value = AgentSpec> {
        (
            prop::sample::select(vec![0u32, 2, 4, 8]),
            any::<bool>(),
            prop::bool::weighted(0.15),
            prop::sample::select(vec![0u32, 0, 0, 1]),
            prop::sample::select(vec![16.0f64, 16.0, 8.0]),
            prop::sample::select(vec![None, Some("a"), Some("b"), Some("B")]),
        )
    }

    fn gpus_of(launches: &[Launch]) -> BTreeSet<&str> {
        launches
            .iter()
            .flat_map(|l| l.gpu_uuids.iter().map(String::as_str))
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

        /// The index finds exactly what a scan of every agent finds, over
        /// clusters part used (an earlier round placed and launched), with
        /// unhealthy GPUs, GPU kinds mixed within agents, model and memory
        /// filters, attribute constraints (exact, of another case, of a
        /// value nobody has, globs), both policies, gangs, priorities and
        /// jobs that fit nowhere.
        #[test]
        fn the_index_places_as_a_scan_of_every_agent_does(
            agents in prop::collection::vec(agent_spec(), 1..14),
            first in prop::collection::vec(ask(), 0..10),
            queue in prop::collection::vec(ask(), 1..16),
        ) {
            let mut s = State::new();
            let mut i = 0u64;
            let mut apply = |s: &mut State, c: Command| {
                i += 1;
                s.apply(i, &c)
            };
            for (n, (g, h, m, d, c, z)) in agents.iter().enumerate() {
                apply(&mut s, agent_in(n, *g, *h, *m, *d, *c, *z)).unwrap();
            }
            // A first round, launched: the cluster is part used.
            for a in &first {
                apply(&mut s, job(a)).unwrap();
            }
            let launches = place_direct(&s, PlacementPolicy::Bundle, false, u64::MAX);
            let mut by_job: BTreeMap<String, Vec<Launch>> = BTreeMap::new();
            for l in launches {
                by_job.entry(l.job_id.clone()).or_default().push(l);
            }
            for (_, group) in by_job {
                apply(&mut s, Command::LaunchTasks { launches: group, at_ms: 1 }).unwrap();
            }
            for a in &queue {
                apply(&mut s, job(a)).unwrap();
            }
            let scan = place(&s, &BTreeSet::new(), &BTreeMap::new());
            let indexed = place_direct(&s, PlacementPolicy::Bundle, false, u64::MAX);
            prop_assert_eq!(&indexed, &scan);
            // And the placements hold: no GPU twice, each job's launch applies.
            prop_assert_eq!(gpus_of(&indexed).len(), indexed.iter().map(|l| l.gpu_uuids.len()).sum::<usize>());
        }
    }

    #[test]
    fn cordons_and_shares_move_an_agent_in_the_index() {
        let mut s = State::new();
        s.apply(1, &agent(0, 4, false, false, 0, 16.0)).unwrap();
        s.apply(2, &agent(1, 4, false, false, 0, 16.0)).unwrap();
        let _ = s.capacity();
        // Agents with 4 whole GPUs free.
        let free_of = |s: &State| -> Vec<String> {
            s.capacity()
                .candidates(4, PlacementPolicy::Bundle, |_| true, &BTreeMap::new())
                .map(|(id, _)| id.to_string())
                .collect()
        };
        assert_eq!(free_of(&s), ["a00", "a01"]);
        s.apply(
            3,
            &Command::CordonGpu {
                uuid: "GPU-a00-1".into(),
                cordon: true,
            },
        )
        .unwrap();
        // a00 has 3 whole GPUs free now: no longer a candidate for 4.
        assert_eq!(free_of(&s), ["a01"]);
        assert_eq!(*s.capacity(), Capacity::build(&s));
        s.apply(
            4,
            &Command::ShareGpu {
                gpu_uuid: "GPU-a01-0".into(),
                mode: Some(gpuctl_core::types::ShareMode::Mps),
            },
        )
        .unwrap();
        assert!(free_of(&s).is_empty(), "a shared GPU is never given whole");
        assert_eq!(*s.capacity(), Capacity::build(&s));
        assert_eq!(
            s.free_total().gpus,
            8,
            "the totals count resources, not whole GPUs"
        );
        s.apply(
            5,
            &Command::CordonGpu {
                uuid: "GPU-a00-1".into(),
                cordon: false,
            },
        )
        .unwrap();
        assert_eq!(free_of(&s), ["a00"]);
        assert_eq!(*s.capacity(), Capacity::build(&s));
    }

    #[test]
    fn a_job_looks_at_the_first_agents_that_fit_not_at_every_agent() {
        // 2,000 agents: the one with a single free GPU is found for a
        // one-GPU job; a gang of 3 × 8 takes the three lowest ids among
        // the idle ones (bundle: the full fit, then ids).
        let mut s = State::new();
        for n in 0..2000 {
            s.apply(n as u64 + 1, &agent(n, 8, false, false, 0, 64.0))
                .unwrap();
        }
        let mut idx = 3000;
        let mut run = |s: &mut State, a: &Ask| {
            idx += 1;
            s.apply(idx, &job(a)).unwrap();
            let launches = place_direct(s, PlacementPolicy::Bundle, false, u64::MAX);
            idx += 1;
            s.apply(
                idx,
                &Command::LaunchTasks {
                    launches: launches.clone(),
                    at_ms: 1,
                },
            )
            .unwrap();
            launches
        };
        let seven = Ask::whole(7);
        let first = run(&mut s, &seven);
        assert_eq!(first[0].agent_id, "a00");
        let one = Ask {
            gpus: 1,
            ..seven.clone()
        };
        // The agent with one free GPU left is the best fit, found first.
        assert_eq!(run(&mut s, &one)[0].agent_id, "a00");
        let gang = Ask {
            gpus: 8,
            replicas: 3,
            ..seven
        };
        let placed: Vec<String> = run(&mut s, &gang).into_iter().map(|l| l.agent_id).collect();
        assert_eq!(placed, ["a01", "a02", "a03"]);
    }

    /// A job constrained to an attribute value walks only the agents that
    /// have it (3 of 2,000 here), in the index's order; a glob walks all;
    /// an agent that moves zone moves in the index.
    #[test]
    fn an_exact_constraint_walks_only_the_agents_with_the_value() {
        let mut s = State::new();
        let mut i = 0;
        for n in 0..2000 {
            let zone = if n % 700 == 5 { "rare" } else { "common" };
            i += 1;
            s.apply(i, &agent_in(n, 8, false, false, 0, 64.0, Some(zone)))
                .unwrap();
        }
        let walk = |s: &State, zone: &str| -> Vec<String> {
            let c = BTreeMap::from([("zone".to_string(), zone.to_string())]);
            s.capacity()
                .candidates(1, PlacementPolicy::Bundle, |_| true, &c)
                .map(|(id, _)| id.to_string())
                .collect()
        };
        assert_eq!(walk(&s, "rare"), ["a05", "a1405", "a705"]);
        assert_eq!(walk(&s, "RARE"), ["a05", "a1405", "a705"], "any case");
        assert_eq!(
            walk(&s, "r*").len(),
            2000,
            "a glob is checked agent by agent"
        );
        assert!(walk(&s, "nowhere").is_empty());
        // The agent's own GPU labels are checked agent by agent.
        let label = BTreeMap::from([("nvidia.com/gpu.product".to_string(), "x".to_string())]);
        assert_eq!(
            s.capacity()
                .candidates(1, PlacementPolicy::Bundle, |_| true, &label)
                .count(),
            2000
        );
        // Placed where the constraint holds.
        i += 1;
        s.apply(
            i,
            &job(&Ask {
                zone: Some("rare"),
                ..Ask::whole(2)
            }),
        )
        .unwrap();
        let placed = place_direct(&s, PlacementPolicy::Bundle, false, u64::MAX);
        assert_eq!(placed.len(), 1);
        assert_eq!(placed[0].agent_id, "a05");
        // a05 leaves the zone: gone from its walk, in the other's.
        i += 1;
        s.apply(i, &agent_in(5, 8, false, false, 0, 64.0, Some("common")))
            .unwrap();
        assert_eq!(walk(&s, "rare"), ["a1405", "a705"]);
        assert_eq!(walk(&s, "common").len(), 1998);
        assert_eq!(*s.capacity(), Capacity::build(&s));
    }
}
