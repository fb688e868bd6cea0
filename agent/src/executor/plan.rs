//! The executor's decision, as pure code: what the master wants on this
//! agent × what this agent has (from its checkpoints and the runtimes) →
//! what to do. No I/O, no clock; table-tested below. The executor applies
//! the actions and calls this again on every change and on a timer, so each
//! action must be safe to repeat: a stop already under way is not stopped
//! again (`stopping` is set), a launch already under way is not launched
//! again (the task is known).

use std::collections::BTreeMap;

use gpuctl_core::types::TaskSpec;

/// The master's wish for this agent (one type with the stream's receiver).
pub use gpuctl_core::desired::Desired;

/// Where a task known to this agent stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Launching: being prepared and started.
    Launching,
    /// Started (by this or an earlier agent process) and not seen to end.
    Running,
    /// Its final status is decided; `acked` once the master acknowledged it.
    Ended { acked: bool },
}

/// Why a task is being stopped; also what its final status will say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// The master asked (cancel, preemption, a framework's kill, a drain).
    Killed,
    /// No longer in the master's desired set (the master forgot it).
    NotWanted,
    /// One of its GPUs failed a health check (`why`: `GPU <uuid>
    /// unhealthy: ...`); `gpu`: which (a whole GPU), when known.
    GpuFailed { why: String, gpu: Option<String> },
    /// No contact with a master for the fence timeout.
    Fenced,
    /// Its processes together used more GPU memory than its fraction of a
    /// shared GPU: `why` says how much.
    GpuMemoryLimit(String),
    /// No output and no GPU activity for its job's hang timeout: `why`.
    Hung(String),
    /// Its liveness check failed too many times in a row: `why`.
    LivenessFailed(String),
}

/// What the plan needs to know of a local task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskView {
    pub phase: Phase,
    pub stopping: Option<StopReason>,
    pub no_fence: bool,
    pub gpus: Vec<String>,
}

/// What to do, carrying what the executor needs to do it: the spec of a
/// task to start (borrowed from the desired set), so nothing is looked up
/// again.
#[derive(Debug, Clone, PartialEq)]
pub enum Action<'a> {
    /// Start this task of the desired set.
    Launch(&'a TaskSpec),
    /// A task that must not start: it ends at once with this reason
    /// (KILLED "killed before it started", or FAILED on a failed GPU).
    /// `spec`: its spec when the desired set runs it (a kill of a task
    /// never seen here has none).
    Refuse {
        task_id: String,
        spec: Option<&'a TaskSpec>,
        reason: StopReason,
    },
    /// Stop a running or launching task.
    Stop { task_id: String, reason: StopReason },
    /// Its final status is acknowledged and the master no longer lists it:
    /// drop its checkpoint.
    Forget(String),
}

pub struct Input<'a> {
    /// `None` until the first complete desired set since the agent started:
    /// until then nothing is launched, refused, stopped as unwanted or
    /// forgotten (a restarted agent keeps its tasks until the master speaks).
    pub desired: Option<&'a Desired>,
    pub tasks: &'a BTreeMap<String, TaskView>,
    /// Unhealthy GPUs of this agent and why, by UUID.
    pub gpu_faults: &'a BTreeMap<String, String>,
    /// Each MIG device's parent GPU, by MIG device UUID: a MIG device has
    /// no health of its own, its parent's fault is its fault.
    pub mig_parents: &'a BTreeMap<String, String>,
    /// Past the fence deadline: no master heard from for the fence timeout.
    pub fenced: bool,
}

/// The first fault among a task's GPUs; a MIG device's is its parent's,
/// and the reason names the parent (the GPU that failed).
fn gpu_fault(gpus: &[String], input: &Input<'_>) -> Option<StopReason> {
    gpus.iter()
        .map(|g| input.mig_parents.get(g).unwrap_or(g))
        .find_map(|g| input.gpu_faults.get_key_value(g))
        .map(|(uuid, why)| StopReason::GpuFailed {
            why: format!("GPU {uuid} unhealthy: {why}"),
            gpu: Some(uuid.clone()),
        })
}

pub fn plan<'a>(input: &Input<'a>) -> Vec<Action<'a>> {
    let mut actions = Vec::new();
    for (id, t) in input.tasks {
        match t.phase {
            Phase::Launching | Phase::Running => {
                if t.stopping.is_some() {
                    continue;
                }
                let reason = if input.fenced && !t.no_fence {
                    Some(StopReason::Fenced)
                } else if let Some(r) = gpu_fault(&t.gpus, input) {
                    Some(r)
                } else {
                    input.desired.and_then(|d| {
                        if d.kill.contains(id) {
                            Some(StopReason::Killed)
                        } else if !d.run.contains_key(id) {
                            Some(StopReason::NotWanted)
                        } else {
                            None
                        }
                    })
                };
                if let Some(reason) = reason {
                    actions.push(Action::Stop {
                        task_id: id.clone(),
                        reason,
                    });
                }
            }
            Phase::Ended { acked } => {
                let listed = input
                    .desired
                    .is_none_or(|d| d.run.contains_key(id) || d.kill.contains(id));
                if acked && !listed {
                    actions.push(Action::Forget(id.clone()));
                }
            }
        }
    }
    let Some(desired) = input.desired else {
        return actions;
    };
    for (id, spec) in &desired.run {
        if input.tasks.contains_key(id) || desired.kill.contains(id) {
            continue;
        }
        if let Some(reason) = gpu_fault(&spec.gpu_uuids, input) {
            actions.push(Action::Refuse {
                task_id: id.clone(),
                spec: Some(spec),
                reason,
            });
        } else if input.fenced && !spec.template.no_fence {
            // Whatever the master wanted then, it may have given up on by
            // now: start nothing until it is heard from again.
            continue;
        } else {
            actions.push(Action::Launch(spec));
        }
    }
    for id in &desired.kill {
        if !input.tasks.contains_key(id) {
            actions.push(Action::Refuse {
                task_id: id.clone(),
                spec: None,
                reason: StopReason::Killed,
            });
        }
    }
    actions
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuctl_core::types::Resources;

    /// The plan's actions by task id (the specs they carry are the desired
    /// set's own, checked in `launches_and_refusals_carry_the_desired_spec`).
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Action {
        Launch(String),
        Refuse { task_id: String, reason: StopReason },
        Stop { task_id: String, reason: StopReason },
        Forget(String),
    }

    impl From<super::Action<'_>> for Action {
        fn from(a: super::Action<'_>) -> Action {
            match a {
                super::Action::Launch(spec) => Action::Launch(spec.task_id.clone()),
                super::Action::Refuse {
                    task_id, reason, ..
                } => Action::Refuse { task_id, reason },
                super::Action::Stop { task_id, reason } => Action::Stop { task_id, reason },
                super::Action::Forget(id) => Action::Forget(id),
            }
        }
    }

    fn spec(id: &str, gpus: &[&str]) -> TaskSpec {
        TaskSpec {
            share: None,
            task_id: id.into(),
            job_id: "job-1".into(),
            framework_id: String::new(),
            gpu_uuids: gpus.iter().map(|g| g.to_string()).collect(),
            template: gpuctl_core::types::TaskTemplate {
                stop_grace_ms: None,
                checkpoint_dir: None,
                image: None,
                command: vec!["true".into()],
                env: Default::default(),
                resources: Resources {
                    cpus: 1.0,
                    mem_mib: 1,
                    gpus: gpus.len() as u32,
                    ports: 0,
                },
                no_fence: false,
                security: Default::default(),
                hang_timeout_ms: None,
                preflight: false,
                options: Default::default(),
            },
        }
    }

    fn view(phase: Phase, gpus: &[&str]) -> TaskView {
        TaskView {
            phase,
            stopping: None,
            no_fence: false,
            gpus: gpus.iter().map(|g| g.to_string()).collect(),
        }
    }

    fn desired(run: &[TaskSpec], kill: &[&str]) -> Desired {
        Desired {
            run: run.iter().map(|s| (s.task_id.clone(), s.clone())).collect(),
            kill: kill.iter().map(|k| k.to_string()).collect(),
            notices: Default::default(),
        }
    }

    fn run_plan(
        desired: Option<&Desired>,
        tasks: &[(&str, TaskView)],
        faults: &[(&str, &str)],
        fenced: bool,
    ) -> Vec<Action> {
        let tasks: BTreeMap<String, TaskView> = tasks
            .iter()
            .map(|(id, v)| (id.to_string(), v.clone()))
            .collect();
        let faults: BTreeMap<String, String> = faults
            .iter()
            .map(|(g, r)| (g.to_string(), r.to_string()))
            .collect();
        plan(&Input {
            desired,
            tasks: &tasks,
            gpu_faults: &faults,
            mig_parents: &mig_parents(),
            fenced,
        })
        .into_iter()
        .map(Action::from)
        .collect()
    }

    /// MIG-a1 and MIG-a2 on GPU ga, MIG-b1 on GPU gb.
    fn mig_parents() -> BTreeMap<String, String> {
        [("MIG-a1", "ga"), ("MIG-a2", "ga"), ("MIG-b1", "gb")]
            .iter()
            .map(|(m, g)| (m.to_string(), g.to_string()))
            .collect()
    }

    fn stop(id: &str, reason: StopReason) -> Action {
        Action::Stop {
            task_id: id.into(),
            reason,
        }
    }

    fn refuse(id: &str, reason: StopReason) -> Action {
        Action::Refuse {
            task_id: id.into(),
            reason,
        }
    }

    #[test]
    fn desired_x_local_table() {
        let running = view(Phase::Running, &["g0"]);
        let acked = view(Phase::Ended { acked: true }, &[]);
        let unacked = view(Phase::Ended { acked: false }, &[]);
        let d = desired(&[spec("a", &["g0"]), spec("b", &[])], &["k"]);
        let empty = desired(&[], &[]);
        // (case, desired, local tasks, expected actions)
        type Case<'a> = (
            &'a str,
            Option<&'a Desired>,
            Vec<(&'a str, TaskView)>,
            Vec<Action>,
        );
        let cases: Vec<Case> =
            vec![
            (
                "new tasks launch, unknown kills are refused at once",
                Some(&d),
                vec![],
                vec![
                    Action::Launch("a".into()),
                    Action::Launch("b".into()),
                    refuse("k", StopReason::Killed),
                ],
            ),
            (
                "a running desired task is left alone",
                Some(&d),
                vec![("a", running.clone()), ("b", running.clone())],
                vec![refuse("k", StopReason::Killed)],
            ),
            (
                "a running task in the kill list is stopped",
                Some(&d),
                vec![("a", running.clone()), ("b", running.clone()), ("k", running.clone())],
                vec![stop("k", StopReason::Killed)],
            ),
            (
                "a running task the master no longer lists is stopped",
                Some(&empty),
                vec![("x", running.clone())],
                vec![stop("x", StopReason::NotWanted)],
            ),
            (
                "an ended task is not launched again while listed",
                Some(&d),
                vec![("a", unacked.clone()), ("b", acked.clone())],
                vec![refuse("k", StopReason::Killed)],
            ),
            (
                "an acknowledged ended task is forgotten once unlisted, an unacknowledged one kept",
                Some(&empty),
                vec![("x", acked.clone()), ("y", unacked.clone())],
                vec![Action::Forget("x".into())],
            ),
            (
                "before the master speaks nothing is launched, stopped or forgotten",
                None,
                vec![("x", running.clone()), ("y", acked.clone())],
                vec![],
            ),
        ];
        for (case, desired, tasks, want) in cases {
            assert_eq!(run_plan(desired, &tasks, &[], false), want, "{case}");
        }
    }

    #[test]
    fn stops_are_not_repeated() {
        let mut v = view(Phase::Running, &[]);
        v.stopping = Some(StopReason::Killed);
        let d = desired(&[], &["x"]);
        assert_eq!(run_plan(Some(&d), &[("x", v)], &[], false), vec![]);
    }

    #[test]
    fn failed_gpus_stop_tasks_and_refuse_launches() {
        let d = desired(&[spec("a", &["g0"]), spec("b", &["g1"])], &[]);
        let why = StopReason::GpuFailed {
            why: "GPU g0 unhealthy: XID 79".into(),
            gpu: Some("g0".into()),
        };
        // Running on the failed GPU: stopped, even before the master hears.
        assert_eq!(
            run_plan(
                None,
                &[("a", view(Phase::Running, &["g0"]))],
                &[("g0", "XID 79")],
                false
            ),
            vec![stop("a", why.clone())]
        );
        // Not started yet: refused, the other launches.
        assert_eq!(
            run_plan(Some(&d), &[], &[("g0", "XID 79")], false),
            vec![refuse("a", why), Action::Launch("b".into())]
        );
    }

    /// A MIG device fails with its parent: its tasks are stopped or
    /// refused with the parent's fault, named by the parent's UUID; MIG
    /// devices of other GPUs are untouched.
    #[test]
    fn a_failed_parent_takes_its_mig_devices_tasks() {
        let why = |g: &str| StopReason::GpuFailed {
            why: format!("GPU {g} unhealthy: GPU is lost"),
            gpu: Some(g.to_string()),
        };
        let d = desired(
            &[
                spec("a1", &["MIG-a1"]),
                spec("b1", &["MIG-b1"]),
                spec("whole", &["gc"]),
                spec("new-a2", &["MIG-a2"]),
                spec("new-b1", &["MIG-b1"]),
            ],
            &[],
        );
        let tasks = [
            ("a1", view(Phase::Running, &["MIG-a1"])),
            ("b1", view(Phase::Launching, &["MIG-b1"])),
            ("whole", view(Phase::Running, &["gc"])),
        ];
        // (case, faults, expected actions)
        type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, Vec<Action>);
        let cases: Vec<Case> = vec![
            (
                "no fault: the new tasks launch",
                vec![],
                vec![
                    Action::Launch("new-a2".into()),
                    Action::Launch("new-b1".into()),
                ],
            ),
            (
                "parent ga failed: its MIG tasks stopped or refused, gb's untouched",
                vec![("ga", "GPU is lost")],
                vec![
                    stop("a1", why("ga")),
                    refuse("new-a2", why("ga")),
                    Action::Launch("new-b1".into()),
                ],
            ),
            (
                "both parents failed",
                vec![("ga", "GPU is lost"), ("gb", "GPU is lost")],
                vec![
                    stop("a1", why("ga")),
                    stop("b1", why("gb")),
                    refuse("new-a2", why("ga")),
                    refuse("new-b1", why("gb")),
                ],
            ),
        ];
        for (case, faults, want) in cases {
            assert_eq!(run_plan(Some(&d), &tasks, &faults, false), want, "{case}");
        }
    }

    #[test]
    fn fencing_stops_fenced_tasks_only_and_launches_nothing() {
        let mut keep = view(Phase::Running, &[]);
        keep.no_fence = true;
        let d = desired(&[spec("n", &[]), spec("f", &[]), spec("new", &[])], &[]);
        let tasks = vec![("f", view(Phase::Launching, &[])), ("n", keep)];
        assert_eq!(
            run_plan(Some(&d), &tasks, &[], true),
            vec![stop("f", StopReason::Fenced)]
        );
        // Also with no desired set (an agent restarted during a cut).
        assert_eq!(
            run_plan(None, &tasks, &[], true),
            vec![stop("f", StopReason::Fenced)]
        );
        // A task that opted out may still be started while fenced.
        let mut nf = spec("nf", &[]);
        nf.template.no_fence = true;
        assert_eq!(
            run_plan(Some(&desired(&[nf], &[])), &[], &[], true),
            vec![Action::Launch("nf".into())]
        );
    }

    /// Whatever the inputs, a task is never both launched and stopped, and
    /// nothing known locally is launched again.
    #[test]
    fn plans_never_relaunch_known_tasks() {
        let phases = [
            Phase::Launching,
            Phase::Running,
            Phase::Ended { acked: false },
            Phase::Ended { acked: true },
        ];
        for (i, phase) in phases.iter().enumerate() {
            for listed in [0, 1, 2] {
                for fenced in [false, true] {
                    let d = match listed {
                        0 => desired(&[], &[]),
                        1 => desired(&[spec("t", &["g"])], &[]),
                        _ => desired(&[], &["t"]),
                    };
                    let actions = run_plan(
                        Some(&d),
                        &[("t", view(*phase, &["g"]))],
                        if i % 2 == 0 { &[] } else { &[("g", "bad")] },
                        fenced,
                    );
                    assert!(
                        !actions
                            .iter()
                            .any(|a| matches!(a, Action::Launch(_) | Action::Refuse { .. })),
                        "{phase:?} listed={listed} fenced={fenced}: {actions:?}"
                    );
                    assert!(actions.len() <= 1, "{actions:?}");
                }
            }
        }
    }

    #[test]
    fn launches_and_refusals_carry_the_desired_spec() {
        let d = desired(&[spec("a", &[]), spec("b", &["g0"])], &["k"]);
        let faults: BTreeMap<String, String> = [("g0".to_string(), "XID 79".to_string())].into();
        let (tasks, parents) = (BTreeMap::new(), BTreeMap::new());
        let actions = plan(&Input {
            desired: Some(&d),
            tasks: &tasks,
            gpu_faults: &faults,
            mig_parents: &parents,
            fenced: false,
        });
        assert_eq!(actions.len(), 3, "{actions:?}");
        for a in &actions {
            match a {
                super::Action::Launch(s) => assert!(std::ptr::eq(*s, &d.run["a"])),
                super::Action::Refuse {
                    task_id,
                    spec: Some(s),
                    ..
                } => {
                    assert_eq!(task_id, "b");
                    assert!(std::ptr::eq(*s, &d.run["b"]));
                }
                super::Action::Refuse {
                    task_id,
                    spec: None,
                    reason,
                } => assert_eq!((task_id.as_str(), reason), ("k", &StopReason::Killed)),
                other => panic!("{other:?}"),
            }
        }
    }
}
