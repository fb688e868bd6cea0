//! Reclaim between frameworks (issue 35): which running tasks of
//! frameworks above their fair share to take back so that a framework
//! below its own can launch one more task. PURE, like the allocator.
//!
//! Offers alone give a framework that subscribed late only what others
//! release: with greedy frameworks and long tasks, whoever came first keeps
//! everything. Here, in DRF's terms (dominant shares over cpus, memory and
//! GPUs, divided by the role's weight):
//!
//! - a framework **wants** when it is not suppressed, its task size is
//!   known (its `demand`: declared, or learnt from its launches) and no
//!   agent has that much free;
//! - with one more task its share would be `after`; a **victim framework**
//!   is one whose share is above `after`, and it is never taken below
//!   `after` (so the transfer never reverses the order of the two);
//! - victims are tasks on one agent, each of a victim framework, that have
//!   run the minimum runtime: the most recently started first, until that
//!   agent has room for the task; never more than needed. The agent needing
//!   the fewest victims is chosen, then the first by id;
//! - the wanting frameworks are tried lowest share first; one reclaim at a
//!   time.
//!
//! The built-in scheduler's tasks (gpuctl jobs) are not taken here: tenants
//! get theirs back through the queue's own reclaim (`scheduler::queue`).

use std::collections::BTreeMap;

use gpuctl_core::types::Resources;

use super::{dominant_share, Demand, FrameworkView, RoleConfig};

/// A running task a reclaim may take.
#[derive(Debug, Clone, PartialEq)]
pub struct RunningTask {
    pub framework_id: String,
    /// The state's key of the task.
    pub task_id: String,
    pub agent_id: String,
    pub resources: Resources,
    pub started_ms: u64,
}

/// Take `victims` back for `for_framework`.
#[derive(Debug, Clone, PartialEq)]
pub struct Reclaim {
    pub for_framework: String,
    pub agent_id: String,
    /// Task keys, each of a framework above its share.
    pub victims: Vec<String>,
}

/// What a reclaim is decided on.
pub struct Inputs<'a> {
    pub total: Resources,
    pub frameworks: &'a [FrameworkView],
    pub roles: &'a BTreeMap<String, RoleConfig>,
    /// What each agent that takes tasks has free (outstanding offers count
    /// as free: an offer may be declined, and hides no room from the plan).
    pub free: &'a BTreeMap<String, Resources>,
    pub tasks: &'a [RunningTask],
    /// Frameworks whose tasks are never taken (the built-in scheduler).
    pub exempt: &'a [&'a str],
    pub now_ms: u64,
    pub min_runtime_ms: u64,
}

fn fits(free: &Resources, t: &Resources) -> bool {
    free.cpus + 1e-9 >= t.cpus && free.mem_mib >= t.mem_mib && free.gpus >= t.gpus
}

/// The reclaim to make now, if any (see the module's doc).
pub fn plan(i: &Inputs) -> Option<Reclaim> {
    let weight = |role: &str| {
        i.roles
            .get(role)
            .map(|r| r.weight)
            .filter(|w| w.is_finite() && *w > 0.0)
            .unwrap_or(1.0)
    };
    let share =
        |f: &FrameworkView, alloc: &Resources| dominant_share(alloc, &i.total) / weight(&f.role);
    let mut wanting: Vec<(&FrameworkView, Resources, f64)> = i
        .frameworks
        .iter()
        .filter(|f| !f.suppressed && !i.exempt.contains(&f.id.as_str()))
        .filter_map(|f| match f.demand {
            Demand::Task(t) => Some((f, t)),
            _ => None,
        })
        .filter(|(_, t)| !i.free.values().any(|free| fits(free, t)))
        .map(|(f, t)| (f, t, share(f, &f.allocated)))
        .collect();
    wanting.sort_by(|a, b| a.2.total_cmp(&b.2).then_with(|| a.0.id.cmp(&b.0.id)));
    for (g, t, _) in wanting {
        let after = share(g, &g.allocated.add(&t));
        // Frameworks above `after`, with what each holds.
        let above: BTreeMap<&str, (&FrameworkView, Resources)> = i
            .frameworks
            .iter()
            .filter(|f| f.id != g.id && !i.exempt.contains(&f.id.as_str()))
            .filter(|f| share(f, &f.allocated) > after + 1e-12)
            .map(|f| (f.id.as_str(), (f, f.allocated)))
            .collect();
        if above.is_empty() {
            continue;
        }
        let mut best: Option<Reclaim> = None;
        for (agent, free) in i.free {
            let mut cands: Vec<&RunningTask> = i
                .tasks
                .iter()
                .filter(|r| &r.agent_id == agent && above.contains_key(r.framework_id.as_str()))
                .filter(|r| r.started_ms.saturating_add(i.min_runtime_ms) <= i.now_ms)
                .collect();
            // The youngest first; then by key, for the same answer every time.
            cands.sort_by(|a, b| {
                b.started_ms
                    .cmp(&a.started_ms)
                    .then_with(|| a.task_id.cmp(&b.task_id))
            });
            let mut held = above.clone();
            let mut room = *free;
            let mut victims = Vec::new();
            for c in cands {
                if fits(&room, &t) {
                    break;
                }
                let Some((f, alloc)) = held.get_mut(c.framework_id.as_str()) else {
                    continue;
                };
                let left = alloc.saturating_sub(&c.resources);
                if share(f, &left) + 1e-12 < after {
                    continue; // would take it below the wanting framework
                }
                *alloc = left;
                room = room.add(&c.resources);
                victims.push(c.task_id.clone());
            }
            if victims.is_empty() || !fits(&room, &t) {
                continue;
            }
            if best
                .as_ref()
                .is_none_or(|b| victims.len() < b.victims.len())
            {
                best = Some(Reclaim {
                    for_framework: g.id.clone(),
                    agent_id: agent.clone(),
                    victims,
                });
            }
        }
        if best.is_some() {
            return best;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(cpus: f64, mem_gib: u64) -> Resources {
        Resources {
            cpus,
            mem_mib: mem_gib * 1024,
            gpus: 0,
            ports: 0,
        }
    }

    fn fw(id: &str, allocated: Resources, task: Resources) -> FrameworkView {
        FrameworkView {
            id: id.into(),
            role: id.into(),
            gpu_capable: false,
            suppressed: false,
            allocated,
            demand: Demand::Task(task),
        }
    }

    /// `n` tasks of `size` of `f` on agent a1, started at 1, 2, … s.
    fn tasks(f: &str, n: u32, size: Resources) -> Vec<RunningTask> {
        (0..n)
            .map(|k| RunningTask {
                framework_id: f.into(),
                task_id: format!("{f}.t{k}"),
                agent_id: "a1".into(),
                resources: size,
                started_ms: u64::from(k + 1) * 1000,
            })
            .collect()
    }

    fn times(r: Resources, n: u32) -> Resources {
        Resources {
            cpus: r.cpus * f64::from(n),
            mem_mib: r.mem_mib * u64::from(n),
            gpus: r.gpus * n,
            ports: 0,
        }
    }

    /// The DRF paper's example on one agent of 9 cpus and 18 GiB: A's tasks
    /// are <1 cpu, 4 GiB>, B's <3 cpus, 1 GiB>; the fair split is A3/B2.
    fn drf(
        a_n: u32,
        b_n: u32,
    ) -> (
        Vec<FrameworkView>,
        Vec<RunningTask>,
        BTreeMap<String, Resources>,
    ) {
        let (ta, tb) = (res(1.0, 4), res(3.0, 1));
        let fws = vec![fw("A", times(ta, a_n), ta), fw("B", times(tb, b_n), tb)];
        let mut ts = tasks("A", a_n, ta);
        ts.extend(tasks("B", b_n, tb));
        let used = times(ta, a_n).add(&times(tb, b_n));
        let free = BTreeMap::from([("a1".to_string(), res(9.0, 18).saturating_sub(&used))]);
        (fws, ts, free)
    }

    fn run(
        fws: &[FrameworkView],
        ts: &[RunningTask],
        free: &BTreeMap<String, Resources>,
        min: u64,
    ) -> Option<Reclaim> {
        plan(&Inputs {
            total: res(9.0, 18),
            frameworks: fws,
            roles: &BTreeMap::new(),
            free,
            tasks: ts,
            exempt: &["gpuctl-jobs"],
            now_ms: 100_000,
            min_runtime_ms: min,
        })
    }

    #[test]
    fn the_drf_example_is_reclaimed_to_a3_b2_whoever_came_first() {
        // A first: A4/B1. B wants; A's youngest goes; then nothing more.
        let (fws, ts, free) = drf(4, 1);
        let r = run(&fws, &ts, &free, 0).unwrap();
        assert_eq!(
            (r.for_framework.as_str(), r.victims.clone()),
            ("B", vec!["A.t3".to_string()])
        );
        let (fws, ts, free) = drf(3, 2);
        assert_eq!(
            run(&fws, &ts, &free, 0),
            None,
            "A3/B2 is fair: nothing more"
        );
        // B first: B3/A0. A wants; one of B's goes (A then takes three).
        let (fws, ts, free) = drf(0, 3);
        let r = run(&fws, &ts, &free, 0).unwrap();
        assert_eq!(
            (r.for_framework.as_str(), r.victims.clone()),
            ("A", vec!["B.t2".to_string()])
        );
    }

    #[test]
    fn young_tasks_suppressed_frameworks_and_unknown_demands_are_left_alone() {
        let (fws, ts, free) = drf(4, 1);
        // Every task started at most 4 s before now - 100 s: a 100 s
        // minimum spares them all; 96.5 s only the oldest three of A.
        assert_eq!(run(&fws, &ts, &free, 100_000), None);
        let r = run(&fws, &ts, &free, 97_500).unwrap();
        assert_eq!(r.victims, vec!["A.t1".to_string()]);
        let mut quiet = fws.clone();
        quiet[1].suppressed = true;
        assert_eq!(run(&quiet, &ts, &free, 0), None);
        let mut unknown = fws.clone();
        unknown[1].demand = Demand::Unknown;
        assert_eq!(run(&unknown, &ts, &free, 0), None);
        // Room for B's task somewhere: offers do it, no reclaim.
        let mut roomy = free.clone();
        roomy.insert("a2".into(), res(3.0, 1));
        assert_eq!(run(&fws, &ts, &roomy, 0), None);
    }

    #[test]
    fn the_built_in_scheduler_is_never_a_victim_and_weights_count() {
        let (mut fws, mut ts, free) = drf(4, 1);
        for f in &mut fws {
            if f.id == "A" {
                f.id = "gpuctl-jobs".into();
            }
        }
        for t in &mut ts {
            if t.framework_id == "A" {
                t.framework_id = "gpuctl-jobs".into();
            }
        }
        assert_eq!(run(&fws, &ts, &free, 0), None);
        // A of weight 3: its share is 0.89 / 3, below B's with one more.
        let (fws, ts, free) = drf(4, 1);
        let roles = BTreeMap::from([(
            "A".to_string(),
            RoleConfig {
                weight: 3.0,
                quota: None,
            },
        )]);
        let r = plan(&Inputs {
            total: res(9.0, 18),
            frameworks: &fws,
            roles: &roles,
            free: &free,
            tasks: &ts,
            exempt: &[],
            now_ms: 100_000,
            min_runtime_ms: 0,
        });
        assert_eq!(r, None);
    }
}
