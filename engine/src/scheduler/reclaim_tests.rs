//! Reclaim across tenants (issue 35): the fair split (`tenants::fair_shares`)
//! and the queue pass's choice of victims (`queue::plan`), through the
//! state's own commands, as the leader would drive them.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use gpuctl_core::types::{JobSpec, JobState, Resources, TaskState};
use gpuctl_core::wait::WaitReason;

use super::queue::{plan, Preemption, QueueConfig};
use super::tenants::{fair_shares, FairShare};
use crate::state::events::EventKind;
use crate::state::testkit::{status, Driver};
use crate::state::{Command, Launch, Outcome, TaskReason};

/// Milliseconds between two launches of a test (a job started later is
/// younger).
const STEP_MS: u64 = 1000;

struct T {
    d: Driver,
    now_ms: u64,
}

impl T {
    fn new(agents: &[(&str, u32)]) -> T {
        T {
            d: Driver::new(agents),
            now_ms: 0,
        }
    }

    fn quota(&mut self, tenant: &str, gpus: u32, borrow: Option<u32>, weight: Option<u32>) {
        self.d
            .apply(Command::SetQuota {
                stop_idle_after_ms: None,
                clear_stop_idle: false,
                tenant: tenant.into(),
                gpus,
                borrow,
                clear_borrow: false,
                weight,
            })
            .unwrap();
    }

    fn submit(&mut self, tenant: &str, gpus: u32, priority: i32) -> String {
        let mut spec = JobSpec::new(
            "j",
            vec!["sleep".into()],
            Resources {
                cpus: 1.0,
                mem_mib: 0,
                gpus,
                ports: 0,
            },
        );
        spec.tenant = tenant.into();
        spec.priority = priority;
        self.d.submit(spec)
    }

    /// Starts what the built-in scheduler places now, one step later each.
    fn schedule(&mut self) -> Vec<String> {
        let mut by_job: BTreeMap<String, Vec<Launch>> = BTreeMap::new();
        for l in super::place_with(&self.d.s, &Default::default(), &Default::default(), true) {
            by_job.entry(l.job_id.clone()).or_default().push(l);
        }
        let mut started = Vec::new();
        for (job, launches) in by_job {
            self.now_ms += STEP_MS;
            let at_ms = self.now_ms;
            self.d
                .apply(Command::LaunchTasks { launches, at_ms })
                .unwrap();
            started.push(job);
        }
        started
    }

    /// A job of `tenant` submitted and started (it must fit).
    fn running(&mut self, tenant: &str, gpus: u32, priority: i32) -> String {
        let j = self.submit(tenant, gpus, priority);
        assert_eq!(self.schedule(), vec![j.clone()]);
        j
    }

    fn cfg(&self, min_runtime_ms: u64) -> QueueConfig {
        QueueConfig {
            reclaim_min_runtime_ms: Some(min_runtime_ms),
            now_ms: self.now_ms,
            ..Default::default()
        }
    }

    fn found(&self, min_runtime_ms: u64) -> Option<Preemption> {
        plan(&self.d.s, &self.cfg(min_runtime_ms)).preemption
    }

    /// Applies the pass's reclaim and has the agents report the victims'
    /// tasks killed; returns the victims.
    fn reclaim_and_stop(&mut self, min_runtime_ms: u64) -> Vec<String> {
        let p = self.found(min_runtime_ms).expect("a reclaim");
        assert!(p.reclaim, "{p:?}");
        self.d
            .apply(Command::ReclaimJobs {
                job_id: p.job_id.clone(),
                victims: p.victims.clone(),
                at_ms: self.now_ms,
                min_runtime_ms,
            })
            .unwrap();
        for v in &p.victims {
            for t in self.d.s.jobs()[v].current_tasks().to_vec() {
                let agent = self.d.s.tasks()[&t].agent_id.clone();
                self.d
                    .apply(Command::UpdateTaskStatus {
                        update: status(&agent, &t, TaskState::Killed),
                        at_ms: self.now_ms,
                    })
                    .unwrap();
            }
        }
        p.victims
    }

    /// GPUs held by each tenant's running jobs.
    fn held(&self) -> BTreeMap<String, u32> {
        let mut out = BTreeMap::new();
        for (t, f) in fair_shares(&self.d.s) {
            out.insert(t, f.used);
        }
        out
    }
}

fn share(used: u32, demand: u32, share: u32) -> FairShare {
    FairShare {
        used,
        demand,
        share,
    }
}

#[test]
fn fair_shares_split_by_weight_within_quotas_and_limits() {
    struct Case {
        name: &'static str,
        /// (tenant, quota, borrow, weight)
        terms: &'static [(&'static str, u32, Option<u32>, Option<u32>)],
        /// (tenant, GPUs asked by queued jobs of one GPU each)
        queued: &'static [(&'static str, u32)],
        want: &'static [(&'static str, u32)],
    }
    let cases = [
        Case {
            name: "two tenants asking for all: half each",
            terms: &[],
            queued: &[("a", 8), ("b", 8)],
            want: &[("a", 4), ("b", 4)],
        },
        Case {
            name: "one asks for less than half: the other gets the rest",
            terms: &[],
            queued: &[("a", 8), ("b", 2)],
            want: &[("a", 6), ("b", 2)],
        },
        Case {
            name: "weights 3:1",
            terms: &[("a", 0, None, Some(3))],
            queued: &[("a", 8), ("b", 8)],
            want: &[("a", 6), ("b", 2)],
        },
        Case {
            name: "three tenants: the odd GPUs by name",
            terms: &[],
            queued: &[("a", 8), ("b", 8), ("c", 8)],
            want: &[("a", 3), ("b", 3), ("c", 2)],
        },
        Case {
            name: "a quota is guaranteed first, the rest split",
            terms: &[("b", 6, Some(8), None)],
            queued: &[("a", 8), ("b", 8)],
            want: &[("a", 1), ("b", 7)],
        },
        Case {
            name: "a quota without borrowing is also a limit",
            terms: &[("a", 2, None, None)],
            queued: &[("a", 8), ("b", 8)],
            want: &[("a", 2), ("b", 6)],
        },
        Case {
            name: "a borrowing limit caps what it may get beyond its quota",
            terms: &[("a", 2, Some(1), None)],
            queued: &[("a", 8), ("b", 8)],
            want: &[("a", 3), ("b", 5)],
        },
        Case {
            name: "asking for nothing: no share",
            terms: &[("c", 4, None, None)],
            queued: &[("a", 8)],
            want: &[("a", 8)],
        },
    ];
    for c in cases {
        let mut t = T::new(&[("n1", 4), ("n2", 4)]);
        for (tenant, q, b, w) in c.terms {
            t.quota(tenant, *q, *b, *w);
        }
        for (tenant, n) in c.queued {
            for _ in 0..*n {
                t.submit(tenant, 1, 0);
            }
        }
        let got: Vec<(String, u32)> = fair_shares(&t.d.s)
            .into_iter()
            .map(|(k, f)| (k, f.share))
            .collect();
        let want: Vec<(String, u32)> = c.want.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        assert_eq!(got, want, "{}", c.name);
    }
}

#[test]
fn the_victims_of_a_reclaim_are_chosen_by_the_rules() {
    struct Case {
        name: &'static str,
        /// Tenant a's running jobs of one GPU (their priorities), started
        /// in this order on an agent of 8 GPUs.
        a: &'static [i32],
        /// Tenant b's running jobs of one GPU.
        b: u32,
        /// Tenant b's queued job: GPUs.
        asks: u32,
        min_runtime_ms: u64,
        /// Indices into `a`; `None`: no reclaim.
        want: Option<&'static [usize]>,
    }
    let cases = [
        Case {
            name: "the youngest of the tenant over its share",
            a: &[0; 8],
            b: 0,
            asks: 1,
            min_runtime_ms: 0,
            want: Some(&[7]),
        },
        Case {
            name: "the lowest priority before the youngest",
            a: &[5, 5, 5, 0, 5, 5, 5, 5],
            b: 0,
            asks: 1,
            min_runtime_ms: 0,
            want: Some(&[3]),
        },
        Case {
            name: "no more than needed: two GPUs, two victims",
            a: &[0; 8],
            b: 0,
            asks: 2,
            min_runtime_ms: 0,
            want: Some(&[6, 7]),
        },
        Case {
            name: "jobs younger than the minimum runtime are spared",
            a: &[0; 8],
            b: 0,
            asks: 1,
            // The oldest started 8 steps before now: 8.5 steps spares all.
            min_runtime_ms: 8 * STEP_MS + STEP_MS / 2,
            want: None,
        },
        Case {
            name: "only those past the minimum runtime",
            a: &[0; 8],
            b: 0,
            asks: 1,
            // Started 8 and 7 steps before the last: those two qualify.
            min_runtime_ms: 7 * STEP_MS,
            want: Some(&[1]),
        },
        Case {
            name: "a tenant at its share does not reclaim",
            a: &[0; 4],
            b: 4,
            asks: 1,
            min_runtime_ms: 0,
            want: None,
        },
        Case {
            name: "a job past its tenant's share does not reclaim",
            a: &[0; 8],
            b: 0,
            asks: 5,
            min_runtime_ms: 0,
            want: None,
        },
    ];
    for c in cases {
        let mut t = T::new(&[("n1", 8)]);
        let a: Vec<String> = c.a.iter().map(|p| t.running("a", 1, *p)).collect();
        for _ in 0..c.b {
            t.running("b", 1, 0);
        }
        // The clock one step past the last start.
        t.now_ms += STEP_MS;
        t.submit("b", c.asks, 0);
        let got = t.found(c.min_runtime_ms);
        let want = c
            .want
            .map(|w| w.iter().map(|i| a[*i].clone()).collect::<Vec<_>>());
        match (&got, want) {
            (None, None) => {}
            (Some(p), Some(mut want)) => {
                assert!(p.reclaim, "{}: {p:?}", c.name);
                let mut victims = p.victims.clone();
                victims.sort();
                want.sort();
                assert_eq!(victims, want, "{}", c.name);
            }
            (got, want) => panic!("{}: got {got:?}, want {want:?}", c.name),
        }
    }
}

#[test]
fn a_reclaim_never_takes_a_tenant_below_its_share() {
    // a holds 8 GPUs in jobs of 2; b asks for 3 with a share of 3 (a's is
    // 5): a may lose 3 GPUs, but its jobs come in twos, and two of them
    // would leave it 4, below its 5.
    let mut t = T::new(&[("n1", 8)]);
    for _ in 0..4 {
        t.running("a", 2, 0);
    }
    t.now_ms += STEP_MS;
    let b = t.submit("b", 3, 0);
    let shares = fair_shares(&t.d.s);
    assert_eq!(shares["a"], share(8, 8, 5));
    assert_eq!(shares["b"], share(0, 3, 3));
    assert_eq!(t.found(0), None);
    // A job of 2 fits what a may lose: one victim.
    t.d.apply(Command::CancelJob {
        job_id: b,
        at_ms: t.now_ms,
    })
    .unwrap();
    t.submit("b", 2, 0);
    let p = t.found(0).unwrap();
    assert_eq!(p.victims.len(), 1, "{p:?}");
}

#[test]
fn priorities_stay_within_a_tenant_and_reclaim_crosses_tenants() {
    let mut t = T::new(&[("n1", 4)]);
    let low = t.running("b", 1, 0);
    for _ in 0..3 {
        t.running("a", 1, 0);
    }
    t.now_ms += STEP_MS;
    // b's own higher-priority job preempts b's own job first, not a reclaim.
    t.submit("b", 1, 9);
    let p = t.found(0).unwrap();
    assert!(!p.reclaim, "{p:?}");
    assert_eq!(p.victims, vec![low]);
    // With reclaim off, nothing crosses tenants.
    let mut t = T::new(&[("n1", 4)]);
    for _ in 0..4 {
        t.running("a", 1, 0);
    }
    t.submit("b", 1, 9);
    let off = QueueConfig {
        now_ms: 1_000_000,
        ..Default::default()
    };
    assert_eq!(plan(&t.d.s, &off).preemption, None);
}

/// The case: a filled the cluster before b came; with reclaim the
/// two converge to 4 and 4, each reclaimed job back in the queue without
/// using a retry, and the freed GPUs go to b, not back to a.
#[test]
fn two_tenants_converge_to_their_shares_whoever_came_first() {
    let mut t = T::new(&[("n1", 4), ("n2", 4)]);
    let a: Vec<String> = (0..8).map(|_| t.running("a", 1, 0)).collect();
    // a has more waiting, submitted before b's.
    for _ in 0..4 {
        t.submit("a", 1, 0);
    }
    t.now_ms += STEP_MS;
    let b: Vec<String> = (0..8).map(|_| t.submit("b", 1, 0)).collect();
    let mut reclaimed = Vec::new();
    for _ in 0..20 {
        if t.found(0).is_none() {
            break;
        }
        reclaimed.extend(t.reclaim_and_stop(0));
        // What was freed is kept for b's job.
        let started = t.schedule();
        assert!(
            started.iter().all(|j| b.contains(j)),
            "a took back what was reclaimed: {started:?}"
        );
        t.now_ms += STEP_MS;
        assert!(t.d.s.invariant_violations().is_empty());
    }
    assert_eq!(
        t.held(),
        BTreeMap::from([("a".to_string(), 4), ("b".to_string(), 4)])
    );
    assert_eq!(t.found(0), None, "nothing more once at the shares");
    // The youngest of a went first; each back in the queue, no retry used,
    // with what happened in its events and its task's reason.
    let mut want: Vec<String> = a[4..].to_vec();
    want.sort();
    reclaimed.sort();
    assert_eq!(reclaimed, want);
    for j in &reclaimed {
        let job = &t.d.s.jobs()[j];
        assert_eq!(job.state, JobState::Queued);
        assert_eq!(job.retries, 0);
        assert!(
            job.message.starts_with("reclaimed for tenant b by "),
            "{}",
            job.message
        );
        assert!(job.events.iter().any(|e| e.kind == EventKind::Reclaimed));
        let task = &t.d.s.tasks()[job.task_ids.last().unwrap()];
        assert_eq!(task.reason, TaskReason::Reclaimed);
    }
    // b's waiting jobs say why they wait: their share is reached.
    let reasons = plan(&t.d.s, &t.cfg(0)).reasons;
    let waiting_b: Vec<&WaitReason> = b
        .iter()
        .filter_map(|j| reasons.get(j))
        .map(|w| &w.reason)
        .collect();
    assert_eq!(waiting_b.len(), 4);
    assert!(
        waiting_b
            .iter()
            .all(|r| matches!(r, WaitReason::Resources(_) | WaitReason::Priority { .. })),
        "{waiting_b:?}"
    );
}

#[test]
fn a_reclaiming_job_says_whom_it_waits_for_and_the_events_say_both_sides() {
    let mut t = T::new(&[("n1", 2)]);
    t.running("a", 1, 0);
    let a = t.running("a", 1, 0);
    t.now_ms += STEP_MS;
    let b = t.submit("b", 1, 0);
    let p = t.found(0).unwrap();
    assert_eq!(p.victims, vec![a.clone()], "the youngest");
    t.d.apply(Command::ReclaimJobs {
        job_id: p.job_id,
        victims: p.victims,
        at_ms: t.now_ms,
        min_runtime_ms: 0,
    })
    .unwrap();
    let w = plan(&t.d.s, &t.cfg(0)).reasons.remove(&b).unwrap();
    assert_eq!(
        w.reason,
        WaitReason::Preempting {
            waiting_for_tasks: 1,
            reclaim_from: vec!["a".into()],
        }
    );
    let ev = |j: &str, k: EventKind| {
        t.d.s.jobs()[j]
            .events
            .iter()
            .find(|e| e.kind == k)
            .map(|e| e.message.clone())
            .unwrap_or_default()
    };
    assert!(
        ev(&b, EventKind::Reclaiming).contains(&a),
        "{}",
        ev(&b, EventKind::Reclaiming)
    );
    assert_eq!(
        ev(&a, EventKind::Reclaimed),
        format!("reclaimed for tenant b by {b}")
    );
}

#[test]
fn apply_refuses_a_reclaim_of_the_own_tenant_or_of_a_young_job() {
    let mut t = T::new(&[("n1", 2)]);
    let a1 = t.running("a", 1, 0);
    let a2 = t.running("a", 1, 0);
    let b = t.submit("b", 1, 0);
    let own = t.submit("a", 1, 0);
    let refuse = |t: &mut T, job: &str, victim: &str, min: u64| {
        let at_ms = t.now_ms;
        let e =
            t.d.apply(Command::ReclaimJobs {
                job_id: job.into(),
                victims: vec![victim.into()],
                at_ms,
                min_runtime_ms: min,
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("victims"), "{e}");
        e
    };
    assert!(refuse(&mut t, &own, &a1, 0).contains("own"));
    assert!(refuse(&mut t, &b, &a2, 60_000).contains("minimum"));
    // Nothing was stopped by the refusals.
    assert!(t.d.s.jobs()[&a1].stopping.is_none() && t.d.s.jobs()[&a2].stopping.is_none());
    assert!(matches!(
        t.d.apply(Command::ReclaimJobs {
            job_id: b,
            victims: vec![a2],
            at_ms: t.now_ms,
            min_runtime_ms: 0,
        }),
        Ok(Outcome::Done)
    ));
}
