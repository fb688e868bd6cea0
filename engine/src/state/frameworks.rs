//! The framework part of the state machine: frameworks subscribe, launch
//! tasks on offered resources (re-checked here: no GPU is ever given
//! twice), kill them, acknowledge their updates, and are removed.

use gpuctl_core::types::{FrameworkInfo, Holding, Runtime, TaskState};

use super::fit::Pending;
use super::{
    ApplyError, FrameworkRecord, FrameworkTask, Outcome, State, TaskLaunch, TaskReason, TaskRecord,
};

/// The built-in job scheduler's framework id (reserved: no other framework
/// may use it). Its tasks are the jobs' tasks.
pub use gpuctl_core::types::BUILTIN_FRAMEWORK_ID;
/// The built-in scheduler's role: `--role jobs=...` sets its weight and quota.
pub const JOBS_ROLE: &str = "jobs";

/// The state's id of a framework's task.
pub fn task_key(framework_id: &str, framework_task_id: &str) -> String {
    format!("{framework_id}.{framework_task_id}")
}

impl State {
    fn active_framework(&self, id: &str) -> Result<&FrameworkRecord, ApplyError> {
        let f = self
            .frameworks
            .get(id)
            .ok_or_else(|| ApplyError::FrameworkNotFound(id.to_string()))?;
        if f.removed {
            return Err(ApplyError::FrameworkRemoved(id.to_string()));
        }
        Ok(f)
    }

    pub(super) fn subscribe_framework(
        &mut self,
        info: &FrameworkInfo,
        at_ms: u64,
        request_id: Option<&str>,
    ) -> Result<Outcome, ApplyError> {
        if info.id == BUILTIN_FRAMEWORK_ID {
            // Always there for a leader to use; never removed for good.
            self.frameworks.insert(
                info.id.clone(),
                FrameworkRecord {
                    info: info.clone(),
                    registered_at_ms: at_ms,
                    removed: false,
                },
            );
            return Ok(Outcome::FrameworkSubscribed {
                framework_id: info.id.clone(),
            });
        }
        if info.id.is_empty() {
            // Sent again after an unknown outcome: the framework the first
            // one made, re-attached (unless it is gone since).
            let made = request_id.and_then(|key| self.framework_requests.get_at(key, at_ms));
            if let Some(id) = made.filter(|id| self.active_framework(id).is_ok()).cloned() {
                let mut info = info.clone();
                info.id = id.clone();
                if let Some(f) = self.frameworks.get_mut(&id) {
                    f.info = info;
                }
                return Ok(Outcome::FrameworkSubscribed { framework_id: id });
            }
            let id = format!("fw-{}", self.next_framework_seq);
            if let Some(key) = request_id {
                self.framework_requests.insert(key, id.clone(), at_ms);
            }
            self.next_framework_seq += 1;
            let mut info = info.clone();
            info.id = id.clone();
            self.frameworks.insert(
                id.clone(),
                FrameworkRecord {
                    info,
                    registered_at_ms: at_ms,
                    removed: false,
                },
            );
            return Ok(Outcome::FrameworkSubscribed { framework_id: id });
        }
        // Re-attaching: same framework, possibly new name/roles/timeout.
        self.active_framework(&info.id)?;
        if let Some(f) = self.frameworks.get_mut(&info.id) {
            f.info = info.clone();
        }
        Ok(Outcome::FrameworkSubscribed {
            framework_id: info.id.clone(),
        })
    }

    pub(super) fn update_framework(&mut self, info: &FrameworkInfo) -> Result<Outcome, ApplyError> {
        self.active_framework(&info.id)?;
        if let Some(f) = self.frameworks.get_mut(&info.id) {
            f.info = info.clone();
        }
        Ok(Outcome::Done)
    }

    pub(super) fn remove_framework(
        &mut self,
        id: &str,
        reason: &str,
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        if id == BUILTIN_FRAMEWORK_ID {
            return Err(ApplyError::Invalid {
                field: "framework_id".into(),
                reason: "gpuctl's own job scheduler cannot be removed".into(),
            });
        }
        self.active_framework(id)?;
        if let Some(f) = self.frameworks.get_mut(id) {
            f.removed = true;
        }
        self.tasks.update_where(
            |t| t.framework_id == id && !t.state.is_terminal(),
            |t| {
                t.kill_requested = true;
                t.reason = TaskReason::FrameworkRemoved;
                t.message = format!("framework removed: {reason}");
                t.updated_at_ms = at_ms;
            },
        );
        Ok(Outcome::Done)
    }

    pub(super) fn launch_framework_tasks(
        &mut self,
        framework_id: &str,
        tasks: &[FrameworkTask],
        group: bool,
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        self.active_framework(framework_id)?;
        // Check every task first (each against the state and the tasks
        // before it in this command), then record.
        let verdicts = self.framework_task_verdicts(framework_id, tasks);
        let group_failed = group && verdicts.iter().any(Result::is_err);
        let mut launched = Vec::new();
        let mut refused = Vec::new();
        let mut unrecorded = Vec::new();
        for (t, verdict) in tasks.iter().zip(verdicts) {
            let key = task_key(framework_id, &t.task_id);
            let (refusal, ports) = match verdict {
                Err(reason) => (Some(reason), Vec::new()),
                Ok(_) if group_failed => (
                    Some("another task of its group could not be launched".to_string()),
                    Vec::new(),
                ),
                Ok(ports) => (None, ports),
            };
            // A refused task whose id is taken is reported, not recorded
            // (it would overwrite the task that has the id).
            if self.tasks.contains_key(&key) {
                if let Some(reason) = refusal {
                    unrecorded.push((t.task_id.clone(), reason));
                }
                continue;
            }
            let mut record = framework_task_record(framework_id, t, key.clone(), ports, at_ms);
            match refusal {
                Some(reason) => {
                    // Recorded in ERROR so the framework hears why; it holds
                    // nothing.
                    record.state = TaskState::Error;
                    record.reason = if reason.contains("GPU")
                        || reason.contains("free")
                        || reason.contains("draining")
                        || reason.contains("unreachable")
                    {
                        TaskReason::ResourcesUnavailable
                    } else {
                        TaskReason::TaskInvalid
                    };
                    record.message = reason.clone();
                    record.gpu_uuids.clear();
                    record.fraction = None;
                    refused.push((t.task_id.clone(), reason));
                }
                None => {
                    // A fraction shares its GPU: it is counted from the
                    // tasks (`State::share_used`), never owned.
                    for g in Holding::of(&t.gpu_uuids, t.fraction.as_ref()).owned() {
                        self.gpu_owner.insert(g.clone(), key.clone());
                    }
                    if let Some(agent) = self.agents.get_mut(&t.agent_id) {
                        agent.allocated = agent.allocated.add(&t.resources);
                    }
                    launched.push(t.task_id.clone());
                }
            }
            self.tasks.insert(key, record);
        }
        Ok(Outcome::FrameworkTasksLaunched {
            launched,
            refused,
            unrecorded,
        })
    }

    /// Each task's verdict against the state and the tasks before it in
    /// the same command: the ports it would get, or why it is refused.
    fn framework_task_verdicts(
        &self,
        framework_id: &str,
        tasks: &[FrameworkTask],
    ) -> Vec<Result<Vec<u16>, String>> {
        let mut pending = Pending::default();
        let mut verdicts: Vec<Result<Vec<u16>, String>> = Vec::with_capacity(tasks.len());
        let mut seen = std::collections::BTreeSet::new();
        // Each task's shape (ids, command, env, image, resources) was
        // checked where it entered (`convert::framework_task_from_pb`);
        // here, only what depends on the state.
        for t in tasks {
            let verdict = (|| {
                if !seen.insert(t.task_id.as_str())
                    || self.tasks.contains_key(&task_key(framework_id, &t.task_id))
                {
                    return Err(format!("task id {} is already used", t.task_id));
                }
                let runtime = if t.image.is_some() {
                    Runtime::Docker
                } else {
                    Runtime::Process
                };
                // A fraction is checked as a job's is (`check_fraction`).
                let wants = t.fraction.map(gpuctl_core::types::Wants::Fraction);
                self.check_fit(
                    &t.agent_id,
                    runtime,
                    &t.resources,
                    &t.gpu_uuids,
                    wants,
                    &mut pending,
                )
                .map_err(|e| e.to_string())
            })();
            verdicts.push(verdict);
        }
        verdicts
    }

    pub(super) fn kill_framework_task(
        &mut self,
        framework_id: &str,
        framework_task_id: &str,
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        self.active_framework(framework_id)?;
        let key = task_key(framework_id, framework_task_id);
        let t = self
            .tasks
            .get_mut(&key)
            .ok_or_else(|| ApplyError::TaskNotFound(framework_task_id.to_string()))?;
        if !t.state.is_terminal() {
            t.kill_requested = true;
            t.reason = TaskReason::KilledByFramework;
            t.updated_at_ms = at_ms;
        }
        Ok(Outcome::Done)
    }

    /// See [`Command::ReclaimFrameworkTasks`]: each named task of the
    /// framework that still runs is killed, with reason `Reclaimed`.
    pub(super) fn reclaim_framework_tasks(
        &mut self,
        framework_id: &str,
        task_ids: &[String],
        for_framework: &str,
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        if task_ids.is_empty() {
            return Err(ApplyError::Invalid {
                field: "task_ids".into(),
                reason: "none named".into(),
            });
        }
        // All checked before any is touched: nothing half applied.
        if let Some(key) = task_ids.iter().find(|k| {
            self.tasks
                .get(*k)
                .is_some_and(|t| t.framework_id != framework_id)
        }) {
            return Err(ApplyError::Invalid {
                field: "task_ids".into(),
                reason: format!("task {key} is not framework {framework_id}'s"),
            });
        }
        let why = format!("reclaimed for framework {for_framework} (below its fair share)");
        for key in task_ids {
            let Some(t) = self.tasks.get_mut(key) else {
                continue; // ended and forgotten since
            };
            if !t.state.is_terminal() && !t.kill_requested {
                t.kill_requested = true;
                t.reason = TaskReason::Reclaimed;
                t.message = why.clone();
                t.updated_at_ms = at_ms;
            }
        }
        Ok(Outcome::Done)
    }

    pub(super) fn acknowledge_update(
        &mut self,
        framework_id: &str,
        framework_task_id: &str,
        uuid: &[u8],
    ) -> Result<Outcome, ApplyError> {
        self.active_framework(framework_id)?;
        let key = task_key(framework_id, framework_task_id);
        let t = self
            .tasks
            .get_mut(&key)
            .ok_or_else(|| ApplyError::TaskNotFound(framework_task_id.to_string()))?;
        if t.last_update_uuid != uuid {
            return Err(ApplyError::Invalid {
                field: "uuid".into(),
                reason: format!(
                    "not the latest update of task {framework_task_id} (already acknowledged or unknown)"
                ),
            });
        }
        t.acked_uuid = uuid.to_vec();
        Ok(Outcome::Done)
    }
}

/// A framework task's record as launched (`Staging`); a refused one is
/// turned to `Error` by the caller.
fn framework_task_record(
    framework_id: &str,
    t: &FrameworkTask,
    key: String,
    ports: Vec<u16>,
    at_ms: u64,
) -> TaskRecord {
    TaskRecord {
        id: key,
        job_id: String::new(),
        agent_id: t.agent_id.clone(),
        gpu_uuids: t.gpu_uuids.clone(),
        resources: t.resources,
        state: TaskState::Staging,
        exit_code: None,
        message: String::new(),
        kill_requested: false,
        created_at_ms: at_ms,
        updated_at_ms: at_ms,
        framework_id: framework_id.to_string(),
        framework_task_id: t.task_id.clone(),
        launch: Some(TaskLaunch {
            image: t.image.clone(),
            command: t.command.clone(),
            env: t.env.clone(),
        }),
        reason: TaskReason::Unspecified,
        last_update_uuid: Vec::new(),
        acked_uuid: Vec::new(),
        rank: 0,
        before_unreachable: None,
        holding: false,
        released: false,
        ports,
        fraction: t.fraction,
        enforcement: None,
        gpu_sampled_ms: 0,
        gpu_busy_ms: 0,
        quiet: None,
        running_at_ms: None,
        health: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Command;
    use gpuctl_core::types::{AgentInfo, GpuInfo, PortRange, Resources, StatusUpdate};

    fn state() -> State {
        let mut s = State::new();
        let info = AgentInfo {
            share_gpus: None,
            allowed_users: None,
            id: "a1".into(),
            hostname: "h".into(),
            address: String::new(),
            total: Resources {
                cpus: 4.0,
                mem_mib: 4096,
                gpus: 2,
                ports: 0,
            },
            gpus: (0..2)
                .map(|i| GpuInfo::new(format!("GPU-{i}"), i, "A100", 40960))
                .collect(),
            runtimes: vec![Runtime::Process, Runtime::Docker],
            simulated_gpus: true,
            attributes: Default::default(),
            driver_version: None,
            cuda_driver_version: None,
            allow_root_tasks: false,
            allowed_mounts: Vec::new(),
            ports: None,
        };
        s.apply(
            1,
            &Command::RegisterAgent {
                info,
                running_task_ids: vec![],
                at_ms: 0,
            },
        )
        .unwrap();
        s
    }

    fn fw(id: &str) -> FrameworkInfo {
        FrameworkInfo {
            id: id.into(),
            name: "test".into(),
            roles: vec!["ml".into()],
            gpu_capable: true,
            failover_timeout_ms: 60_000,
            tenant: Default::default(),
        }
    }

    fn subscribe(s: &mut State) -> String {
        subscribe_at(s, 2)
    }

    /// A new framework subscribed by the log entry at `index`.
    fn subscribe_at(s: &mut State, index: u64) -> String {
        match s
            .apply(
                index,
                &Command::SubscribeFramework {
                    request_id: None,
                    info: fw(""),
                    at_ms: 0,
                },
            )
            .unwrap()
        {
            Outcome::FrameworkSubscribed { framework_id } => framework_id,
            o => panic!("{o:?}"),
        }
    }

    fn task(id: &str, gpus: &[&str]) -> FrameworkTask {
        FrameworkTask {
            task_id: id.into(),
            agent_id: "a1".into(),
            image: None,
            command: vec!["true".into()],
            env: Default::default(),
            resources: Resources {
                cpus: 1.0,
                mem_mib: 128,
                gpus: gpus.len() as u32,
                ports: 0,
            },
            gpu_uuids: gpus.iter().map(|g| g.to_string()).collect(),
            fraction: None,
        }
    }

    fn launch(s: &mut State, f: &str, tasks: Vec<FrameworkTask>, group: bool) -> Outcome {
        s.apply(
            3,
            &Command::LaunchFrameworkTasks {
                framework_id: f.into(),
                tasks,
                group,
                at_ms: 5,
            },
        )
        .unwrap()
    }

    /// The leader's reclaim between frameworks: the named tasks are
    /// killed as reclaimed; a task of another framework refuses the whole
    /// command, touching none; one already ended or gone is passed over.
    #[test]
    fn reclaimed_framework_tasks_are_killed_all_or_none() {
        let mut s = state();
        let f = subscribe(&mut s);
        launch(&mut s, &f, vec![task("t1", &[]), task("t2", &[])], false);
        let other = subscribe_at(&mut s, 4);
        let (k1, k2) = (task_key(&f, "t1"), task_key(&f, "t2"));
        let reclaim = |tasks: Vec<String>, fw: &str| Command::ReclaimFrameworkTasks {
            framework_id: fw.into(),
            task_ids: tasks,
            for_framework: "fw-9".into(),
            at_ms: 7,
        };
        let e = s
            .apply(5, &reclaim(vec![k1.clone()], &other))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("task_ids") && e.contains("is not framework"),
            "{e}"
        );
        assert!(!s.tasks()[&k1].kill_requested, "nothing touched");
        assert!(s.apply(6, &reclaim(vec![], &f)).is_err());
        s.apply(7, &reclaim(vec![k1.clone(), "fw-x.gone".into()], &f))
            .unwrap();
        let t1 = &s.tasks()[&k1];
        assert!(t1.kill_requested);
        assert_eq!(t1.reason, TaskReason::Reclaimed);
        assert_eq!(
            t1.message,
            "reclaimed for framework fw-9 (below its fair share)"
        );
        assert!(!s.tasks()[&k2].kill_requested);
    }

    /// A framework's task asking for ports gets the lowest free numbers of
    /// its agent's range, in GPUCTL_PORTS; one asking more than are free
    /// is refused and holds nothing.
    /// Issue 32: a new framework's subscription sent again with its
    /// request id re-attaches to the framework the first one made, while
    /// the id is remembered and the framework is not removed.
    #[test]
    fn a_resent_subscription_reattaches_by_its_request_id() {
        let mut s = state();
        let mut index = 2;
        let mut sub = |s: &mut State, key: Option<&str>, at_ms: u64| {
            index += 1;
            match s
                .apply(
                    index,
                    &Command::SubscribeFramework {
                        request_id: key.map(str::to_string),
                        info: fw(""),
                        at_ms,
                    },
                )
                .unwrap()
            {
                Outcome::FrameworkSubscribed { framework_id } => framework_id,
                o => panic!("{o:?}"),
            }
        };
        let first = sub(&mut s, Some("k"), 1_000);
        assert_eq!(sub(&mut s, Some("k"), 2_000), first);
        let other = sub(&mut s, Some("k2"), 2_000);
        assert_ne!(other, first);
        assert_ne!(sub(&mut s, None, 2_000), first, "no key: a new framework");
        // Past the TTL the key is forgotten: a new framework.
        let late = 1_001 + crate::state::requests::REQUEST_TTL_MS;
        let after_ttl = sub(&mut s, Some("k"), late);
        assert_ne!(after_ttl, first);
        // A removed framework is not re-attached to.
        s.apply(
            100,
            &Command::RemoveFramework {
                framework_id: other.clone(),
                reason: "teardown".into(),
                at_ms: late,
            },
        )
        .unwrap();
        assert_ne!(sub(&mut s, Some("k2"), late), other);
    }

    #[test]
    fn framework_tasks_get_host_ports_from_the_agents_range() {
        let mut s = state();
        let mut info = s.agent("a1").unwrap().info.clone();
        info.ports = Some(PortRange {
            start: 40000,
            end: 40002,
        });
        info.total.ports = 3;
        s.apply(
            2,
            &Command::RegisterAgent {
                info,
                running_task_ids: vec![],
                at_ms: 0,
            },
        )
        .unwrap();
        let f = match s
            .apply(
                3,
                &Command::SubscribeFramework {
                    request_id: None,
                    info: fw(""),
                    at_ms: 0,
                },
            )
            .unwrap()
        {
            Outcome::FrameworkSubscribed { framework_id } => framework_id,
            o => panic!("{o:?}"),
        };
        let with_ports = |id: &str, n: u32| {
            let mut t = task(id, &[]);
            t.resources.ports = n;
            t
        };
        let out = s
            .apply(
                4,
                &Command::LaunchFrameworkTasks {
                    framework_id: f.clone(),
                    tasks: vec![with_ports("t1", 2), with_ports("t2", 2)],
                    group: false,
                    at_ms: 5,
                },
            )
            .unwrap();
        let Outcome::FrameworkTasksLaunched {
            launched, refused, ..
        } = out
        else {
            panic!("{out:?}")
        };
        assert_eq!(launched, ["t1"]);
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(refused[0].1.contains("ports"), "{refused:?}");
        let key = task_key(&f, "t1");
        assert_eq!(s.tasks[&key].ports, [40000, 40001]);
        assert!(s.tasks[&task_key(&f, "t2")].ports.is_empty());
        assert_eq!(
            s.task_spec(&key).unwrap().template.env["GPUCTL_PORTS"],
            "40000,40001"
        );
        assert_eq!(s.agent("a1").unwrap().free().ports, 1);
        assert!(
            s.invariant_violations().is_empty(),
            "{:?}",
            s.invariant_violations()
        );
    }

    #[test]
    fn subscribe_assigns_ids_and_reattaches_but_not_after_removal() {
        let mut s = state();
        let f = subscribe(&mut s);
        assert_eq!(f, "fw-1");
        assert_eq!(subscribe(&mut s), "fw-2");
        assert!(s
            .apply(
                4,
                &Command::SubscribeFramework {
                    request_id: None,
                    info: fw(&f),
                    at_ms: 1
                }
            )
            .is_ok());
        assert!(matches!(
            s.apply(
                4,
                &Command::SubscribeFramework {
                    request_id: None,
                    info: fw("fw-9"),
                    at_ms: 1
                }
            ),
            Err(ApplyError::FrameworkNotFound(_))
        ));
        // The built-in scheduler's framework cannot be removed, and comes
        // back on subscribe whatever happened.
        assert!(s
            .apply(
                5,
                &Command::RemoveFramework {
                    framework_id: BUILTIN_FRAMEWORK_ID.into(),
                    reason: "x".into(),
                    at_ms: 2
                }
            )
            .is_err());
        s.apply(
            5,
            &Command::RemoveFramework {
                framework_id: f.clone(),
                reason: "teardown".into(),
                at_ms: 2,
            },
        )
        .unwrap();
        assert!(matches!(
            s.apply(
                6,
                &Command::SubscribeFramework {
                    request_id: None,
                    info: fw(&f),
                    at_ms: 3
                }
            ),
            Err(ApplyError::FrameworkRemoved(_))
        ));
    }

    #[test]
    fn a_double_booking_launch_is_refused_with_an_error_status_and_nothing_else_changes() {
        let mut s = state();
        let f = subscribe(&mut s);
        let o = launch(&mut s, &f, vec![task("t1", &["GPU-0"])], false);
        assert_eq!(
            o,
            Outcome::FrameworkTasksLaunched {
                launched: vec!["t1".into()],
                refused: vec![],
                unrecorded: vec![]
            }
        );
        let owners = s.gpu_owner.clone();
        let allocated = s.agents["a1"].allocated;
        let o = launch(&mut s, &f, vec![task("t2", &["GPU-0"])], false);
        let Outcome::FrameworkTasksLaunched {
            launched, refused, ..
        } = o
        else {
            panic!()
        };
        assert!(launched.is_empty());
        assert_eq!(refused[0].0, "t2");
        assert!(refused[0].1.contains("GPU-0"), "{}", refused[0].1);
        let t2 = &s.tasks[&task_key(&f, "t2")];
        assert_eq!(t2.state, TaskState::Error);
        assert_eq!(t2.reason, TaskReason::ResourcesUnavailable);
        assert!(t2.gpu_uuids.is_empty());
        // The GPU still belongs to t1 alone; nothing else moved.
        assert_eq!(s.gpu_owner, owners);
        assert_eq!(s.agents["a1"].allocated, allocated);
        // The same GPU twice in one command: the second is refused.
        let o = launch(
            &mut s,
            &f,
            vec![task("t3", &["GPU-1"]), task("t4", &["GPU-1"])],
            false,
        );
        let Outcome::FrameworkTasksLaunched {
            launched, refused, ..
        } = o
        else {
            panic!()
        };
        assert_eq!(launched, vec!["t3".to_string()]);
        assert_eq!(refused.len(), 1);
    }

    #[test]
    fn a_launch_group_starts_all_or_none() {
        let mut s = state();
        let f = subscribe(&mut s);
        let o = launch(
            &mut s,
            &f,
            vec![task("g1", &["GPU-0"]), task("g2", &["GPU-7"])],
            true,
        );
        let Outcome::FrameworkTasksLaunched {
            launched, refused, ..
        } = o
        else {
            panic!()
        };
        assert!(launched.is_empty());
        assert_eq!(refused.len(), 2);
        assert!(s.gpu_owner.is_empty());
        assert!(s.tasks.values().all(|t| t.state == TaskState::Error));
        let o = launch(
            &mut s,
            &f,
            vec![task("g3", &["GPU-0"]), task("g4", &["GPU-1"])],
            true,
        );
        let Outcome::FrameworkTasksLaunched { launched, .. } = o else {
            panic!()
        };
        assert_eq!(launched.len(), 2);
    }

    #[test]
    fn updates_need_the_frameworks_acknowledgement_and_repeats_are_not_news() {
        let mut s = state();
        let f = subscribe(&mut s);
        launch(&mut s, &f, vec![task("t1", &[])], false);
        let key = task_key(&f, "t1");
        let up = |uuid: &[u8], state| Command::UpdateTaskStatus {
            update: StatusUpdate {
                gpu_memory_limit: false,
                enforcement: None,
                agent_id: "a1".into(),
                task_id: key.clone(),
                state,
                exit_code: None,
                message: String::new(),
                uuid: uuid.to_vec(),
                gpu_unhealthy: false,
                requires: Vec::new(),
                fenced: false,
                latest_state: None,
                hung: false,
                failed_gpus: Vec::new(),
                runtime_restarted: false,
                liveness_failed: false,
                health: None,
            },
            at_ms: 9,
        };
        assert_eq!(
            s.apply(10, &up(b"u1", TaskState::Running)).unwrap(),
            Outcome::Done
        );
        assert!(!s.is_acknowledged(&key, b"u1"));
        assert_eq!(
            s.apply(11, &up(b"u1", TaskState::Running)).unwrap(),
            Outcome::StaleUpdate
        );
        // Acknowledging anything but the latest update is refused.
        assert!(s
            .apply(
                12,
                &Command::AcknowledgeUpdate {
                    framework_id: f.clone(),
                    framework_task_id: "t1".into(),
                    uuid: b"zz".to_vec()
                }
            )
            .is_err());
        s.apply(
            13,
            &Command::AcknowledgeUpdate {
                framework_id: f.clone(),
                framework_task_id: "t1".into(),
                uuid: b"u1".to_vec(),
            },
        )
        .unwrap();
        assert!(s.is_acknowledged(&key, b"u1"));
        // gpuctl's own jobs and unknown tasks need no acknowledgement.
        assert!(s.is_acknowledged("job-1.0", b"x"));
    }

    /// A framework's task refused by its agent for its driver ends FAILED
    /// with that reason, which its framework hears; nothing else changes.
    #[test]
    fn a_driver_refusal_of_a_framework_task_keeps_its_reason() {
        let mut s = state();
        let f = subscribe(&mut s);
        launch(&mut s, &f, vec![task("t1", &["GPU-0"])], false);
        let key = task_key(&f, "t1");
        let update = StatusUpdate {
            gpu_memory_limit: false,
            enforcement: None,
            agent_id: "a1".into(),
            task_id: key.clone(),
            state: TaskState::Failed,
            exit_code: None,
            message: "image x requires cuda>=12.2".into(),
            uuid: b"u1".to_vec(),
            gpu_unhealthy: false,
            requires: vec!["cuda>=12.2".into()],
            fenced: false,
            latest_state: None,
            hung: false,
            failed_gpus: Vec::new(),
            runtime_restarted: false,
            liveness_failed: false,
            health: None,
        };
        s.apply(10, &Command::UpdateTaskStatus { update, at_ms: 9 })
            .unwrap();
        let t = &s.tasks[&key];
        assert_eq!(t.state, TaskState::Failed);
        assert_eq!(t.reason, TaskReason::DriverRequirementUnmet);
        assert!(s.gpu_owner.is_empty());
    }

    /// The agent resends an unacknowledged RUNNING saying the task ended
    /// behind it: its GPU and resources are free at once, the task stays
    /// RUNNING for its framework until the final update itself comes, and
    /// nothing is freed twice.
    #[test]
    fn a_final_latest_state_frees_the_gpus_before_the_final_update() {
        let mut s = state();
        let f = subscribe(&mut s);
        launch(&mut s, &f, vec![task("t1", &["GPU-0"])], false);
        let key = task_key(&f, "t1");
        let free_before = s.agents["a1"].free();
        let up = |uuid: &[u8], state, latest: Option<TaskState>| Command::UpdateTaskStatus {
            update: StatusUpdate {
                gpu_memory_limit: false,
                enforcement: None,
                agent_id: "a1".into(),
                task_id: key.clone(),
                state,
                exit_code: state.is_terminal().then_some(0),
                message: String::new(),
                uuid: uuid.to_vec(),
                gpu_unhealthy: false,
                requires: Vec::new(),
                fenced: false,
                latest_state: latest,
                hung: false,
                failed_gpus: Vec::new(),
                runtime_restarted: false,
                liveness_failed: false,
                health: None,
            },
            at_ms: 9,
        };
        s.apply(10, &up(b"u1", TaskState::Running, None)).unwrap();
        assert_eq!(s.gpu_owner.get("GPU-0"), Some(&key));
        // A resend with a live latest state changes nothing.
        assert_eq!(
            s.apply(11, &up(b"u1", TaskState::Running, Some(TaskState::Running)))
                .unwrap(),
            Outcome::StaleUpdate
        );
        assert_eq!(
            s.apply(
                12,
                &up(b"u1", TaskState::Running, Some(TaskState::Finished))
            )
            .unwrap(),
            Outcome::Done
        );
        let t = &s.tasks[&key];
        assert_eq!(t.state, TaskState::Running, "the framework has not heard");
        assert!(t.released && !t.holds_resources());
        assert!(s.gpu_owner.is_empty(), "GPU-0 is free");
        let freed = s.agents["a1"].free();
        assert_eq!(freed.gpus, free_before.gpus + 1);
        assert!(
            s.invariant_violations().is_empty(),
            "{:?}",
            s.invariant_violations()
        );
        // Said again: nothing more.
        assert_eq!(
            s.apply(
                13,
                &up(b"u1", TaskState::Running, Some(TaskState::Finished))
            )
            .unwrap(),
            Outcome::StaleUpdate
        );
        // Another task may take GPU-0 now.
        let o = launch(&mut s, &f, vec![task("t2", &["GPU-0"])], false);
        assert!(
            matches!(&o, Outcome::FrameworkTasksLaunched { launched, .. } if launched == &["t2"]),
            "{o:?}"
        );
        let with_t2 = s.agents["a1"].free();
        // The acknowledgement comes; then the final update: t1 ends and
        // nothing is freed again (t2 keeps GPU-0 and its resources).
        s.apply(
            14,
            &Command::AcknowledgeUpdate {
                framework_id: f.clone(),
                framework_task_id: "t1".into(),
                uuid: b"u1".to_vec(),
            },
        )
        .unwrap();
        s.apply(15, &up(b"u2", TaskState::Finished, None)).unwrap();
        let t = &s.tasks[&key];
        assert_eq!(t.state, TaskState::Finished);
        assert!(!t.holding);
        assert_eq!(s.gpu_owner.get("GPU-0"), Some(&task_key(&f, "t2")));
        assert_eq!(s.agents["a1"].free(), with_t2);
        assert!(
            s.invariant_violations().is_empty(),
            "{:?}",
            s.invariant_violations()
        );
    }

    #[test]
    fn kill_and_removal_put_tasks_on_the_agents_kill_list() {
        let mut s = state();
        let f = subscribe(&mut s);
        launch(
            &mut s,
            &f,
            vec![task("t1", &["GPU-0"]), task("t2", &[])],
            false,
        );
        let (run, kill) = s.desired_tasks("a1");
        assert_eq!(run.len(), 2);
        assert!(kill.is_empty());
        assert!(run
            .iter()
            .all(|t| t.framework_id == f && t.job_id.is_empty()));
        s.apply(
            20,
            &Command::KillTask {
                framework_id: f.clone(),
                framework_task_id: "t1".into(),
                at_ms: 1,
            },
        )
        .unwrap();
        let (run, kill) = s.desired_tasks("a1");
        assert_eq!(run.len(), 1);
        assert_eq!(kill, vec![task_key(&f, "t1")]);
        s.apply(
            21,
            &Command::RemoveFramework {
                framework_id: f.clone(),
                reason: "teardown".into(),
                at_ms: 2,
            },
        )
        .unwrap();
        let (run, kill) = s.desired_tasks("a1");
        assert!(run.is_empty());
        assert_eq!(kill.len(), 2);
        assert_eq!(
            s.tasks[&task_key(&f, "t2")].reason,
            TaskReason::FrameworkRemoved
        );
        // Once removed, nobody acknowledges: agents may forget its updates.
        assert!(s.is_acknowledged(&task_key(&f, "t2"), b"u"));
    }
}
