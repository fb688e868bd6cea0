//! Agents in the state machine: registration, liveness (ACTIVE,
//! UNREACHABLE, LOST) and drains.
//!
//! The rule that keeps a GPU from serving two live tasks: a GPU whose task
//! was killed or lost is given again only once the task's agent said the
//! task's processes are gone, by registering without it or by a final
//! status update for it. Until then the task holds its GPUs (`gpu_owner`)
//! and resources (its agent's `allocated`), even after it is LOST:
//!
//! - after `--agent-timeout-secs` of silence the agent is UNREACHABLE, its
//!   live tasks UNREACHABLE: they hold everything, their jobs do not move,
//!   nothing new goes to the agent;
//! - after `--agent-lost-timeout-secs` of silence the agent is LOST and its
//!   tasks LOST (their jobs follow their retry policy) but they keep
//!   holding ([`TaskRecord::holding`]); tasks of `no_fence` jobs stay
//!   UNREACHABLE instead, for as long as the agent stays away;
//! - the agent's own fence (it kills its tasks after the fence timeout
//!   without a leader) is what makes the wait finite in practice: the
//!   master's configuration keeps the lost timeout above the fence timeout
//!   plus the agent's kill grace plus a margin (see `config.rs`).

use std::collections::BTreeSet;

use gpuctl_core::types::{utc_timestamp, AgentId, AgentInfo, TaskId, TaskState};

use super::events::EventKind;
use super::{
    AgentRecord, AgentState, ApplyError, Drain, Outcome, State, Stopping, TaskReason, TaskRecord,
};

/// What a registration does to the tasks the state has on the agent, given
/// the tasks the agent says it runs.
struct Reconcile {
    /// UNREACHABLE tasks it still runs: back to the state they had.
    back: Vec<TaskId>,
    /// Live tasks it does not run (and that are not STAGING): LOST.
    forgotten: Vec<TaskId>,
    /// UNREACHABLE tasks that were STAGING and that it does not run: STAGING
    /// again (they reach the agent through its desired set).
    staged_back: Vec<TaskId>,
    /// Ended tasks still holding that it no longer runs: released.
    confirmed: Vec<TaskId>,
}

impl Reconcile {
    fn is_empty(&self) -> bool {
        self.back.is_empty()
            && self.forgotten.is_empty()
            && self.staged_back.is_empty()
            && self.confirmed.is_empty()
    }
}

impl State {
    fn reconcile(&self, agent: &str, running: &BTreeSet<&str>) -> Reconcile {
        // (A live task released early, on its agent's latest_state, is
        // still the agent's to end.)
        let mine: Vec<&TaskRecord> = self
            .tasks
            .on(agent)
            .filter(|t| t.holds_resources() || !t.state.is_terminal())
            .collect();
        // A STAGING task (or one that was STAGING when the agent went away)
        // may simply not have reached the agent yet: it stays.
        let staging = |t: &TaskRecord| {
            t.state == TaskState::Staging
                || (t.state == TaskState::Unreachable
                    && t.before_unreachable == Some(TaskState::Staging))
        };
        let ids = |keep: &dyn Fn(&TaskRecord) -> bool| -> Vec<TaskId> {
            mine.iter()
                .filter(|t| keep(t))
                .map(|t| t.id.clone())
                .collect()
        };
        let runs = |t: &TaskRecord| running.contains(t.id.as_str());
        Reconcile {
            back: ids(&|t| t.state == TaskState::Unreachable && runs(t)),
            forgotten: ids(&|t| !t.state.is_terminal() && !staging(t) && !runs(t)),
            staged_back: ids(&|t| t.state == TaskState::Unreachable && staging(t) && !runs(t)),
            confirmed: ids(&|t| t.state.is_terminal() && !runs(t)),
        }
    }

    /// Whether registering `info` with `running` would leave the state as it
    /// is: an ACTIVE agent registering again, unchanged, with the tasks the
    /// state has on it (what every agent does when a new leader takes over).
    /// The leader answers such a registration without a Raft write; at
    /// 10,000 agents a failover was 10,000 writes of each agent's GPUs.
    pub fn registration_changes_nothing(&self, info: &AgentInfo, running: &[TaskId]) -> bool {
        let Some(agent) = self.agents.get(&info.id) else {
            return false;
        };
        if agent.state != AgentState::Active || agent.info != *info {
            return false;
        }
        let running: BTreeSet<&str> = running.iter().map(String::as_str).collect();
        if !self.reconcile(&info.id, &running).is_empty() {
            return false;
        }
        // What register's apply does besides (see `apply_command`).
        let gone_gpu_mig_change = self
            .mig_changes
            .iter()
            .any(|(uuid, c)| c.agent_id == info.id && !info.gpus.iter().any(|g| &g.uuid == uuid));
        !gone_gpu_mig_change && !self.would_share_by_default(info)
    }

    pub(super) fn register_agent(
        &mut self,
        info: &AgentInfo,
        running: &[TaskId],
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        // A GPU belongs to one agent: two agents claiming the same device
        // would let two tasks use it. An unreachable agent still has its
        // GPUs (its tasks may run on them).
        for gpu in &info.gpus {
            if let Some(other) = self
                .agents
                .claiming(&gpu.uuid)
                .find(|a| a.info.id != info.id && a.state != AgentState::Lost)
            {
                return Err(ApplyError::GpuClaimed {
                    gpu: gpu.uuid.clone(),
                    agent_id: other.info.id.clone(),
                });
            }
        }
        let running: BTreeSet<&str> = running.iter().map(String::as_str).collect();
        let Reconcile {
            back,
            forgotten,
            staged_back,
            confirmed,
        } = self.reconcile(&info.id, &running);
        let (registered_at_ms, drain) = self
            .agents
            .get(&info.id)
            .map(|a| (a.registered_at_ms, a.drain.clone()))
            .unwrap_or((at_ms, None));
        // Gang tasks elsewhere name this agent's hostname (GPUCTL_PEERS).
        if self
            .agents
            .get(&info.id)
            .is_some_and(|a| a.info.hostname != info.hostname)
        {
            self.tasks.touch_all();
        }
        self.agents.insert(
            info.id.clone(),
            AgentRecord {
                info: info.clone(),
                state: AgentState::Active,
                registered_at_ms,
                allocated: Default::default(),
                unreachable_since_ms: None,
                drain,
            },
        );
        for id in back.iter().chain(&staged_back) {
            if let Some(t) = self.tasks.get_mut(id) {
                t.state = t.before_unreachable.take().unwrap_or(TaskState::Running);
                t.updated_at_ms = at_ms;
                if !t.kill_requested {
                    t.message.clear();
                }
            }
        }
        let mut returned = BTreeSet::new();
        for id in &back {
            let job_id = self.tasks.get(id).map(|t| t.job_id.clone());
            if let Some(job_id) = job_id.filter(|j| !j.is_empty()) {
                self.job_task_progressed(&job_id, id, at_ms);
                returned.insert(job_id);
            }
        }
        for job_id in returned {
            let words = format!(
                "agent {} registered again, still running its tasks",
                info.id
            );
            self.job_event(&job_id, EventKind::AgentReturned, words, at_ms);
        }
        for t in confirmed {
            self.release(&t);
        }
        for t in forgotten {
            self.end_task(
                &t,
                TaskState::Lost,
                None,
                "agent re-registered without this task",
                at_ms,
            );
        }
        self.recompute_allocated(&info.id);
        Ok(Outcome::Done)
    }

    /// The legacy `AgentLost` (see its doc): exactly what it always did.
    pub(super) fn agent_lost_legacy(
        &mut self,
        agent_id: &AgentId,
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        let agent = self.agent_mut(agent_id)?;
        agent.state = AgentState::Lost;
        let tasks: Vec<TaskId> = self
            .tasks
            .on(agent_id)
            .filter(|t| !t.state.is_terminal())
            .map(|t| t.id.clone())
            .collect();
        for t in tasks {
            self.end_task(&t, TaskState::Lost, None, "agent lost", at_ms);
        }
        Ok(Outcome::Done)
    }

    pub(super) fn agent_unreachable(
        &mut self,
        agent_id: &str,
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        let agent = self.agent_mut(agent_id)?;
        if agent.state != AgentState::Active {
            return Ok(Outcome::Done);
        }
        agent.state = AgentState::Unreachable;
        agent.unreachable_since_ms = Some(at_ms);
        let note = format!(
            "agent {agent_id} unreachable since {}",
            utc_timestamp(at_ms)
        );
        let jobs: BTreeSet<String> = self
            .tasks
            .on(agent_id)
            .filter(|t| !t.state.is_terminal() && !t.job_id.is_empty())
            .map(|t| t.job_id.clone())
            .collect();
        for job_id in jobs {
            let words = format!("agent {agent_id} stopped heartbeating; its tasks keep their GPUs");
            self.job_event(&job_id, EventKind::AgentUnreachable, words, at_ms);
        }
        self.tasks.update_on(
            agent_id,
            |t| !t.state.is_terminal(),
            |t| {
                t.before_unreachable = Some(t.state);
                t.state = TaskState::Unreachable;
                t.updated_at_ms = at_ms;
                // A task being stopped keeps the master's reason for it.
                if !t.kill_requested {
                    t.message = note.clone();
                }
            },
        );
        Ok(Outcome::Done)
    }

    pub(super) fn agent_lost_after_timeout(
        &mut self,
        agent_id: &str,
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        let agent = self.agent_mut(agent_id)?;
        if agent.state != AgentState::Unreachable {
            return Ok(Outcome::Done);
        }
        agent.state = AgentState::Lost;
        let since = agent.unreachable_since_ms.unwrap_or(at_ms);
        let message = format!(
            "agent {agent_id} lost (unreachable since {}); its GPUs stay held until the agent confirms the task is gone",
            utc_timestamp(since)
        );
        let tasks: Vec<TaskId> = self
            .tasks
            .on(agent_id)
            .filter(|t| !t.state.is_terminal())
            .filter(|t| !self.no_fence(t))
            .map(|t| t.id.clone())
            .collect();
        let jobs: BTreeSet<String> = tasks
            .iter()
            .filter_map(|t| self.tasks.get(t))
            .filter(|t| !t.job_id.is_empty())
            .map(|t| t.job_id.clone())
            .collect();
        for job_id in jobs {
            let words = format!(
                "agent {agent_id} unreachable since {}: its tasks are LOST",
                utc_timestamp(since)
            );
            self.job_event(&job_id, EventKind::AgentLost, words, at_ms);
        }
        for t in tasks {
            // The master's word, not the agent's: a message of its own even
            // for a task being stopped.
            if let Some(task) = self.tasks.get_mut(&t) {
                task.message.clear();
            }
            self.end_task_with(&t, TaskState::Lost, None, &message, at_ms, true);
        }
        Ok(Outcome::Done)
    }

    pub(super) fn drain_agent(
        &mut self,
        agent_id: &str,
        kill: bool,
        deadline_ms: Option<u64>,
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        let agent = self.agent_mut(agent_id)?;
        let since_ms = agent.drain.as_ref().map_or(at_ms, |d| d.since_ms);
        agent.drain = Some(Drain {
            since_ms,
            deadline_ms,
        });
        if kill || deadline_ms.is_some_and(|d| d <= at_ms) {
            self.kill_drained(agent_id, at_ms);
        }
        Ok(Outcome::Done)
    }

    pub(super) fn undrain_agent(&mut self, agent_id: &str) -> Result<Outcome, ApplyError> {
        let agent = self.agent_mut(agent_id)?;
        agent.drain = None;
        Ok(Outcome::Done)
    }

    pub(super) fn drain_deadline_passed(
        &mut self,
        agent_id: &str,
        at_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        let agent = self.known_agent(agent_id)?;
        let due = agent
            .drain
            .as_ref()
            .and_then(|d| d.deadline_ms)
            .is_some_and(|d| d <= at_ms);
        if due {
            self.kill_drained(agent_id, at_ms);
        }
        Ok(Outcome::Done)
    }

    /// Live tasks on a drained agent that are not being stopped yet (the
    /// leader's test for proposing `DrainDeadlinePassed`).
    pub fn drain_victims<'a>(
        &'a self,
        agent_id: &'a str,
    ) -> impl Iterator<Item = &'a TaskRecord> + 'a {
        self.tasks
            .on(agent_id)
            .filter(|t| !t.state.is_terminal() && !t.kill_requested)
    }

    /// Kills the live tasks of a drained agent. A job with a task there
    /// stops its whole attempt and goes back to the queue without using a
    /// retry (unless `--no-requeue`), as when preempted.
    fn kill_drained(&mut self, agent_id: &str, at_ms: u64) {
        let why = format!("agent {agent_id} drained");
        let victims: Vec<(TaskId, String)> = self
            .drain_victims(agent_id)
            .map(|t| (t.id.clone(), t.job_id.clone()))
            .collect();
        for (task_id, job_id) in victims {
            let mut tasks = vec![task_id];
            if let Some(job) = self.jobs.get_mut(&job_id) {
                if !job.cancel_requested && job.stopping.is_none() && !job.state.is_terminal() {
                    job.stopping = Some(Stopping::Drained {
                        agent_id: agent_id.to_string(),
                        requeue: !job.spec.no_requeue,
                    });
                    job.updated_at_ms = at_ms;
                    job.events.record(
                        EventKind::Drained,
                        format!("agent {agent_id} drained: stopping its attempt"),
                        at_ms,
                    );
                    tasks = job.current_tasks().to_vec();
                }
            }
            self.kill_live(&tasks, &why, Some(TaskReason::AgentDrained), at_ms);
        }
    }
}

impl State {
    /// The agent a command names, or the error that names it.
    pub(super) fn agent_mut(&mut self, agent_id: &str) -> Result<&mut AgentRecord, ApplyError> {
        self.agents
            .get_mut(agent_id)
            .ok_or_else(|| ApplyError::AgentNotFound(agent_id.to_string()))
    }

    pub(super) fn known_agent(&self, agent_id: &str) -> Result<&AgentRecord, ApplyError> {
        self.agents
            .get(agent_id)
            .ok_or_else(|| ApplyError::AgentNotFound(agent_id.to_string()))
    }
}

impl State {
    /// Records an agent's new verdict on some of its GPUs. All or nothing:
    /// a GPU the agent does not have refuses the whole command.
    pub(super) fn set_gpu_health(
        &mut self,
        agent_id: &str,
        changes: &[super::command::GpuHealthChange],
    ) -> Result<Outcome, ApplyError> {
        let agent = self.agent_mut(agent_id)?;
        if let Some(c) = changes
            .iter()
            .find(|c| !agent.info.gpus.iter().any(|g| g.uuid == c.uuid))
        {
            return Err(ApplyError::Invalid {
                field: "gpus".into(),
                reason: format!("agent {agent_id} has no GPU {}", c.uuid),
            });
        }
        for c in changes {
            if let Some(g) = agent.info.gpus.iter_mut().find(|g| g.uuid == c.uuid) {
                g.healthy = c.healthy;
                g.unhealthy_reason = if c.healthy {
                    String::new()
                } else {
                    c.reason.clone()
                };
            }
        }
        // A GPU back in service (reset and probed) is no longer avoided by
        // the jobs that failed on it.
        let back: Vec<&str> = changes
            .iter()
            .filter(|c| c.healthy)
            .map(|c| c.uuid.as_str())
            .collect();
        if !back.is_empty() {
            let avoiding: Vec<String> = self
                .jobs
                .values()
                .filter(|j| j.avoid_gpus.iter().any(|a| back.contains(&a.uuid.as_str())))
                .map(|j| j.id.clone())
                .collect();
            for id in avoiding {
                if let Some(job) = self.jobs.get_mut(&id) {
                    job.avoid_gpus.retain(|a| !back.contains(&a.uuid.as_str()));
                }
            }
        }
        Ok(Outcome::Done)
    }

    pub(super) fn recompute_allocated(&mut self, agent_id: &str) {
        let total = self
            .tasks
            .on(agent_id)
            .filter(|t| t.holds_resources())
            .fold(gpuctl_core::types::Resources::default(), |acc, t| {
                acc.add(&t.resources)
            });
        if let Some(a) = self.agents.get_mut(agent_id) {
            a.allocated = total;
        }
    }
}

impl State {
    /// A GPU taken out of placement (or given back), whoever holds it.
    pub(super) fn cordon_gpu(&mut self, uuid: &str, cordon: bool) -> Result<Outcome, ApplyError> {
        if !self
            .agents
            .values()
            .any(|a| a.info.gpus.iter().any(|g| g.uuid == uuid))
        {
            return Err(ApplyError::Invalid {
                field: "uuid".into(),
                reason: format!("no agent has GPU {uuid}"),
            });
        }
        self.agents.mark_gpu(uuid);
        if cordon {
            self.cordoned.insert(uuid.to_string());
        } else {
            self.cordoned.remove(uuid);
        }
        Ok(Outcome::Done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::testkit::{register, status, Driver};
    use crate::state::Command;
    use gpuctl_core::types::{JobSpec, JobState, Resources, StatusUpdate};

    /// The shared driver, and what these tests add to it.
    struct T(Driver);

    impl std::ops::Deref for T {
        type Target = Driver;
        fn deref(&self) -> &Driver {
            &self.0
        }
    }

    impl std::ops::DerefMut for T {
        fn deref_mut(&mut self) -> &mut Driver {
            &mut self.0
        }
    }

    impl T {
        fn new(agents: &[(&str, u32)]) -> T {
            T(Driver::new(agents))
        }
        fn submit(&mut self, gpus: u32, f: impl FnOnce(&mut JobSpec)) -> String {
            let mut spec = JobSpec::new(
                "j",
                vec!["true".into()],
                Resources {
                    cpus: 1.0,
                    mem_mib: 0,
                    gpus,
                    ports: 0,
                },
            );
            f(&mut spec);
            match self.apply(Command::SubmitJob {
                spec,
                at_ms: 1,
                request_id: None,
            }) {
                Ok(Outcome::JobSubmitted { job_id }) => job_id,
                o => panic!("{o:?}"),
            }
        }
        fn launch(&mut self, job: &str, at: &[(&str, &[&str])]) -> Result<Outcome, ApplyError> {
            self.launch_at(job, at, 2)
        }
        fn update(
            &mut self,
            task: &str,
            state: TaskState,
            f: impl FnOnce(&mut StatusUpdate),
        ) -> Outcome {
            let mut u = status(&self.s.tasks[task].agent_id, task, state);
            f(&mut u);
            self.apply(Command::UpdateTaskStatus {
                update: u,
                at_ms: 3,
            })
            .unwrap()
        }
        fn report(&mut self, task: &str, state: TaskState) -> Outcome {
            self.update(task, state, |_| {})
        }
        fn unreachable(&mut self, agent: &str, at_ms: u64) {
            self.apply(Command::AgentUnreachable {
                agent_id: agent.into(),
                at_ms,
            })
            .unwrap();
        }
        fn lost(&mut self, agent: &str, at_ms: u64) {
            self.apply(Command::AgentLostAfterTimeout {
                agent_id: agent.into(),
                at_ms,
            })
            .unwrap();
        }
        /// The agent registers again, still running `running`.
        fn back(&mut self, agent: &str, gpus: u32, running: &[&str]) {
            let Command::RegisterAgent { info, .. } = register(agent, gpus) else {
                unreachable!()
            };
            self.apply(Command::RegisterAgent {
                info,
                running_task_ids: running.iter().map(|s| s.to_string()).collect(),
                at_ms: 500_000,
            })
            .unwrap();
        }
        fn drain(&mut self, agent: &str, kill: bool, deadline_ms: Option<u64>, at_ms: u64) {
            self.apply(Command::DrainAgent {
                agent_id: agent.into(),
                kill,
                deadline_ms,
                at_ms,
            })
            .unwrap();
        }
        fn task(&self, id: &str) -> &TaskRecord {
            &self.s.tasks[id]
        }
        fn job_state(&self, id: &str) -> JobState {
            self.s.jobs[id].state
        }
        fn owner(&self, gpu: &str) -> Option<&str> {
            self.s.gpu_owner.get(gpu).map(String::as_str)
        }
    }

    /// A running single-task job on `a` holding GPU-a-0 and GPU-a-1.
    fn running(max_retries: u32, no_fence: bool) -> (T, String) {
        let mut t = T::new(&[("a", 2), ("b", 2)]);
        let j = t.submit(2, |s| {
            s.max_retries = max_retries;
            s.template.no_fence = no_fence;
        });
        t.launch(&j, &[("a", &["GPU-a-0", "GPU-a-1"])]).unwrap();
        t.report("job-1.0", TaskState::Running);
        assert_eq!(t.job_state(&j), JobState::Running);
        (t, j)
    }

    #[test]
    fn an_unreachable_agent_keeps_its_tasks_gpus_and_jobs() {
        let (mut t, j) = running(3, false);
        t.unreachable("a", 1_700_000_000_000);
        let a = &t.s.agents["a"];
        assert_eq!(a.state, AgentState::Unreachable);
        assert_eq!(a.unreachable_since_ms, Some(1_700_000_000_000));
        assert_eq!(a.allocated.gpus, 2, "resources stay held");
        let task = t.task("job-1.0");
        assert_eq!(task.state, TaskState::Unreachable);
        assert_eq!(task.before_unreachable, Some(TaskState::Running));
        assert!(
            task.message
                .contains("unreachable since 2023-11-14T22:13:20Z"),
            "{}",
            task.message
        );
        assert_eq!(t.job_state(&j), JobState::Running);
        assert_eq!(t.owner("GPU-a-0"), Some("job-1.0"));
        // Still desired on the agent (it must not kill it when it is back).
        assert_eq!(t.s.desired_tasks("a").0.len(), 1);
        // Nothing new goes there; the GPUs stay taken for any agent.
        let j2 = t.submit(1, |_| {});
        let err = t.launch(&j2, &[("a", &["GPU-a-0"])]).unwrap_err();
        assert!(matches!(err, ApplyError::AgentUnreachable(_)), "{err}");
        assert!(err.to_string().contains("unreachable"), "{err}");
        assert!(
            crate::scheduler::place(&t.s, &Default::default(), &Default::default())
                .iter()
                .all(|l| l.agent_id == "b")
        );
        // A repeat (or a stale proposal) changes nothing.
        let before = t.s.clone();
        t.unreachable("a", 1_700_000_009_000);
        assert_eq!(t.s.agents, before.agents);
        assert_eq!(t.s.tasks, before.tasks);
    }

    #[test]
    fn an_agent_back_in_time_gets_its_listed_tasks_back_and_loses_the_rest() {
        let mut t = T::new(&[("a", 3)]);
        let run = t.submit(1, |_| {});
        let start = t.submit(1, |_| {});
        let gone = t.submit(1, |s| s.max_retries = 1);
        t.launch(&run, &[("a", &["GPU-a-0"])]).unwrap();
        t.launch(&start, &[("a", &["GPU-a-1"])]).unwrap();
        t.launch(&gone, &[("a", &["GPU-a-2"])]).unwrap();
        t.report("job-1.0", TaskState::Running);
        t.report("job-2.0", TaskState::Starting);
        t.report("job-3.0", TaskState::Running);
        t.unreachable("a", 10_000);
        // Sent before the agent noticed: remembered, still UNREACHABLE.
        assert_eq!(t.report("job-2.0", TaskState::Running), Outcome::Done);
        assert_eq!(t.task("job-2.0").state, TaskState::Unreachable);
        assert_eq!(
            t.task("job-2.0").before_unreachable,
            Some(TaskState::Running)
        );
        t.back("a", 3, &["job-1.0", "job-2.0"]);
        assert_eq!(t.s.agents["a"].state, AgentState::Active);
        assert_eq!(t.s.agents["a"].unreachable_since_ms, None);
        for (task, job) in [("job-1.0", &run), ("job-2.0", &start)] {
            assert_eq!(t.task(task).state, TaskState::Running, "{task}");
            assert_eq!(t.task(task).before_unreachable, None);
            assert!(t.task(task).message.is_empty());
            assert_eq!(t.job_state(job), JobState::Running, "{job}");
        }
        // Not listed: the agent's word that it is gone: LOST, released,
        // and the job retried.
        let lost = t.task("job-3.0");
        assert_eq!(lost.state, TaskState::Lost);
        assert!(!lost.holding);
        assert_eq!(t.owner("GPU-a-2"), None);
        assert_eq!(t.job_state(&gone), JobState::Queued);
        assert_eq!(t.s.jobs[&gone].retries, 1);
        assert_eq!(t.s.agents["a"].allocated.gpus, 2);
    }

    #[test]
    fn a_gang_stays_running_while_its_agents_come_back_one_by_one() {
        let mut t = T::new(&[("a", 1), ("b", 1)]);
        let j = t.submit(1, |s| s.replicas = 2);
        t.launch(&j, &[("a", &["GPU-a-0"]), ("b", &["GPU-b-0"])])
            .unwrap();
        t.report("job-1.0", TaskState::Running);
        t.report("job-1.1", TaskState::Running);
        t.unreachable("a", 1);
        t.unreachable("b", 1);
        t.back("a", 1, &["job-1.0"]);
        assert_eq!(t.job_state(&j), JobState::Running);
        t.back("b", 1, &["job-1.1"]);
        assert_eq!(t.job_state(&j), JobState::Running);
        assert_eq!(t.task("job-1.1").state, TaskState::Running);
    }

    #[test]
    fn a_staging_task_of_an_unreachable_agent_stays_staging_when_not_listed() {
        let mut t = T::new(&[("a", 1)]);
        let j = t.submit(1, |_| {});
        t.launch(&j, &[("a", &["GPU-a-0"])]).unwrap();
        t.unreachable("a", 10);
        assert_eq!(t.task("job-1.0").state, TaskState::Unreachable);
        t.back("a", 1, &[]);
        assert_eq!(t.task("job-1.0").state, TaskState::Staging);
        assert_eq!(t.job_state(&j), JobState::Starting);
        assert_eq!(t.owner("GPU-a-0"), Some("job-1.0"));
        assert_eq!(t.s.desired_tasks("a").0.len(), 1);
    }

    #[test]
    fn lost_after_the_timeout_retries_the_job_but_holds_the_gpus_until_the_agent_confirms() {
        let (mut t, j) = running(1, false);
        t.unreachable("a", 10_000);
        t.lost("a", 120_000);
        assert_eq!(t.s.agents["a"].state, AgentState::Lost);
        let task = t.task("job-1.0");
        assert_eq!(task.state, TaskState::Lost);
        assert_eq!(task.reason, TaskReason::AgentLost);
        assert!(task.holding);
        assert!(task.message.contains("GPUs stay held"), "{}", task.message);
        // The job follows its retry policy at once...
        assert_eq!(t.job_state(&j), JobState::Queued);
        assert_eq!(t.s.jobs[&j].retries, 1);
        // ...but the GPUs are not given again: any launch naming them is
        // refused, on any agent (the UUID is what counts).
        assert_eq!(t.owner("GPU-a-0"), Some("job-1.0"));
        assert_eq!(t.s.agents["a"].allocated.gpus, 2);
        // The agent comes back: the GPUs are still taken.
        t.back("a", 2, &["job-1.0"]);
        let err = t.launch(&j, &[("a", &["GPU-a-0", "GPU-a-1"])]).unwrap_err();
        assert!(
            matches!(&err, ApplyError::GpuTaken { task_id, .. } if task_id == "job-1.0"),
            "{err}"
        );
        assert!(
            crate::scheduler::place(&t.s, &Default::default(), &Default::default())
                .iter()
                .all(|l| !l.gpu_uuids.iter().any(|g| g.starts_with("GPU-a-")))
        );
        // It still runs it: on its kill list (and not to run).
        let (run, kill) = t.s.desired_tasks("a");
        assert!(run.is_empty());
        assert_eq!(kill, vec!["job-1.0".to_string()]);
        // Its final report releases the GPUs; the task stays LOST.
        let late_running = t.report("job-1.0", TaskState::Running);
        assert_eq!(late_running, Outcome::StaleUpdate);
        assert_eq!(t.owner("GPU-a-0"), Some("job-1.0"));
        assert_eq!(t.report("job-1.0", TaskState::Killed), Outcome::Done);
        assert_eq!(t.task("job-1.0").state, TaskState::Lost);
        assert!(!t.task("job-1.0").holding);
        assert!(t.s.gpu_owner.is_empty());
        assert_eq!(t.s.agents["a"].allocated, Resources::default());
        assert!(t.s.desired_tasks("a").1.is_empty());
        t.launch(&j, &[("a", &["GPU-a-0", "GPU-a-1"])]).unwrap();
        // A second final report is stale again.
        assert_eq!(t.report("job-1.0", TaskState::Killed), Outcome::StaleUpdate);
        assert_eq!(t.owner("GPU-a-0"), Some("job-1.1"));
    }

    #[test]
    fn a_lost_tasks_gpus_are_released_when_its_agent_registers_without_it() {
        let (mut t, j) = running(0, false);
        t.unreachable("a", 10_000);
        t.lost("a", 120_000);
        assert_eq!(t.job_state(&j), JobState::Failed);
        assert_eq!(t.owner("GPU-a-1"), Some("job-1.0"));
        t.back("a", 2, &[]);
        assert!(!t.task("job-1.0").holding);
        assert!(t.s.gpu_owner.is_empty());
        assert_eq!(t.s.agents["a"].allocated, Resources::default());
        assert_eq!(t.job_state(&j), JobState::Failed, "the job does not move");
    }

    #[test]
    fn a_lost_timeout_is_a_noop_for_an_agent_that_came_back() {
        let (mut t, _) = running(0, false);
        // Never unreachable: nothing happens.
        t.lost("a", 1);
        assert_eq!(t.s.agents["a"].state, AgentState::Active);
        t.unreachable("a", 2);
        t.back("a", 2, &["job-1.0"]);
        let before = t.s.clone();
        t.lost("a", 3);
        assert_eq!(t.s.tasks, before.tasks);
        assert_eq!(t.s.agents, before.agents);
        assert!(t
            .apply(Command::AgentLostAfterTimeout {
                agent_id: "nope".into(),
                at_ms: 4
            })
            .is_err());
    }

    #[test]
    fn no_fence_tasks_are_never_lost_by_timeout() {
        let (mut t, j) = running(3, true);
        assert!(t.s.desired_tasks("a").0[0].template.no_fence);
        t.unreachable("a", 10_000);
        t.lost("a", 120_000);
        assert_eq!(t.s.agents["a"].state, AgentState::Lost);
        assert_eq!(t.task("job-1.0").state, TaskState::Unreachable);
        assert_eq!(t.job_state(&j), JobState::Running);
        assert_eq!(t.owner("GPU-a-0"), Some("job-1.0"));
        // Still desired on the agent; back in RUNNING when it returns.
        t.back("a", 2, &["job-1.0"]);
        assert_eq!(t.task("job-1.0").state, TaskState::Running);
        assert_eq!(t.job_state(&j), JobState::Running);
        assert_eq!(t.s.jobs[&j].retries, 0);
    }

    #[test]
    fn a_fenced_task_counts_like_a_lost_one_for_its_job() {
        for (retries, want) in [(1, JobState::Queued), (0, JobState::Failed)] {
            let (mut t, j) = running(retries, false);
            t.unreachable("a", 10_000);
            // The agent fenced itself and reports when it is back.
            t.update("job-1.0", TaskState::Killed, |u| {
                u.fenced = true;
                u.message = "no leader for 75s: fenced".into();
            });
            let task = t.task("job-1.0");
            assert_eq!(task.state, TaskState::Killed);
            assert_eq!(task.reason, TaskReason::Fenced);
            assert!(t.s.gpu_owner.is_empty(), "the agent's word releases");
            let job = &t.s.jobs[&j];
            assert_eq!(job.state, want);
            assert_eq!(job.retries, retries);
            assert!(job.message.contains("fence"), "{}", job.message);
        }
        // A fenced report for a task already LOST by timeout releases it.
        let (mut t, _) = running(0, false);
        t.unreachable("a", 10_000);
        t.lost("a", 120_000);
        assert_eq!(
            t.update("job-1.0", TaskState::Killed, |u| u.fenced = true),
            Outcome::Done
        );
        assert!(t.s.gpu_owner.is_empty());
        assert_eq!(t.task("job-1.0").reason, TaskReason::AgentLost);
    }

    #[test]
    fn an_unreachable_agents_gpus_cannot_be_claimed_by_another_agent() {
        let (mut t, _) = running(0, false);
        t.unreachable("a", 1);
        let Command::RegisterAgent { mut info, .. } = register("c", 1) else {
            unreachable!()
        };
        info.gpus[0].uuid = "GPU-a-0".into();
        let err = t
            .apply(Command::RegisterAgent {
                info,
                running_task_ids: vec![],
                at_ms: 1,
            })
            .unwrap_err();
        assert!(matches!(err, ApplyError::GpuClaimed { .. }), "{err}");
    }

    #[test]
    fn a_draining_agent_takes_no_new_tasks_and_undrain_gives_it_back() {
        let (mut t, j) = running(0, false);
        t.drain("a", false, None, 5);
        let d = t.s.agents["a"].drain.clone().unwrap();
        assert_eq!((d.since_ms, d.deadline_ms), (5, None));
        // Running tasks keep running.
        assert!(!t.task("job-1.0").kill_requested);
        assert_eq!(t.job_state(&j), JobState::Running);
        let j2 = t.submit(1, |_| {});
        let err = t.launch(&j2, &[("a", &[])]).unwrap_err();
        assert!(matches!(err, ApplyError::AgentDraining(_)), "{err}");
        assert!(err.to_string().contains("undrain"), "{err}");
        // Placement skips it.
        let l = crate::scheduler::place(&t.s, &Default::default(), &Default::default());
        assert!(l.iter().all(|l| l.agent_id == "b"), "{l:?}");
        // It survives the agent registering again.
        t.back("a", 2, &["job-1.0"]);
        assert!(t.s.agents["a"].drain.is_some());
        t.apply(Command::UndrainAgent {
            agent_id: "a".into(),
            at_ms: 9,
        })
        .unwrap();
        assert!(t.s.agents["a"].drain.is_none());
        t.report("job-1.0", TaskState::Finished);
        t.launch(&j2, &[("a", &["GPU-a-0"])]).unwrap();
        assert!(t
            .apply(Command::UndrainAgent {
                agent_id: "nope".into(),
                at_ms: 9
            })
            .is_err());
    }

    #[test]
    fn a_job_that_fits_only_on_agents_set_aside_says_so() {
        use gpuctl_core::wait::{AgentIds, GpuAsk, NeverFits, Requirement, SetAside, WaitReason};
        let mut t = T::new(&[("a", 4), ("b", 1)]);
        let j = t.submit(4, |_| {});
        t.drain("a", false, None, 1);
        let cfg = Default::default();
        let why =
            |t: &T| match crate::scheduler::queue::wait_reason(&t.s, &cfg, &j).map(|w| w.reason) {
                Some(WaitReason::NeverFits { why, set_aside }) => (why, set_aside),
                other => panic!("{other:?}"),
            };
        let (never, set_aside) = why(&t);
        assert_eq!(
            never,
            NeverFits::Missing {
                need: Requirement::Gpus(GpuAsk {
                    count: 4,
                    model: None,
                    mem_min_mib: 0,
                    mig: None,
                    fraction: None,
                }),
                among: vec![],
                largest: Some(1.0)
            }
        );
        assert_eq!(
            set_aside,
            SetAside {
                draining: AgentIds::of(["a"]),
                unreachable: AgentIds::default()
            }
        );
        t.unreachable("b", 2);
        let (never, set_aside) = why(&t);
        assert_eq!(never, NeverFits::NoActiveAgent);
        assert_eq!(
            set_aside,
            SetAside {
                draining: AgentIds::of(["a"]),
                unreachable: AgentIds::of(["b"])
            }
        );
    }

    #[test]
    fn drain_with_kill_stops_tasks_and_requeues_their_jobs_without_a_retry() {
        let mut t = T::new(&[("a", 2), ("b", 2)]);
        // A gang across both agents, and a job that must not requeue.
        let gang = t.submit(1, |s| s.replicas = 2);
        let once = t.submit(1, |s| s.no_requeue = true);
        let elsewhere = t.submit(1, |_| {});
        t.launch(&gang, &[("a", &["GPU-a-0"]), ("b", &["GPU-b-0"])])
            .unwrap();
        t.launch(&once, &[("a", &["GPU-a-1"])]).unwrap();
        t.launch(&elsewhere, &[("b", &["GPU-b-1"])]).unwrap();
        t.drain("a", true, None, 5);
        for task in ["job-1.0", "job-1.1", "job-2.0"] {
            let task = t.task(task);
            assert!(task.kill_requested, "{}", task.id);
            assert_eq!(task.reason, TaskReason::AgentDrained);
            assert_eq!(task.message, "agent a drained");
        }
        assert!(!t.task("job-3.0").kill_requested);
        assert_eq!(t.s.desired_tasks("a").1.len(), 2);
        // GPUs are given back only on the agents' reports.
        assert_eq!(t.owner("GPU-a-0"), Some("job-1.0"));
        for task in ["job-1.0", "job-1.1", "job-2.0"] {
            t.report(task, TaskState::Killed);
        }
        assert_eq!(t.task("job-1.0").reason, TaskReason::AgentDrained);
        let g = &t.s.jobs[&gang];
        assert_eq!((g.state, g.retries), (JobState::Queued, 0));
        assert!(g.message.contains("agent a drained"), "{}", g.message);
        let o = &t.s.jobs[&once];
        assert_eq!(o.state, JobState::Failed);
        assert!(o.message.contains("--no-requeue"), "{}", o.message);
        assert_eq!(t.job_state(&elsewhere), JobState::Starting);
    }

    #[test]
    fn a_drain_deadline_kills_what_still_runs_once_passed() {
        let (mut t, j) = running(0, false);
        t.drain("a", false, Some(60_000), 1_000);
        // Too early, or for an agent not draining: nothing.
        t.apply(Command::DrainDeadlinePassed {
            agent_id: "a".into(),
            at_ms: 59_999,
        })
        .unwrap();
        assert!(!t.task("job-1.0").kill_requested);
        t.apply(Command::DrainDeadlinePassed {
            agent_id: "b".into(),
            at_ms: 70_000,
        })
        .unwrap();
        t.apply(Command::DrainDeadlinePassed {
            agent_id: "a".into(),
            at_ms: 60_000,
        })
        .unwrap();
        assert!(t.task("job-1.0").kill_requested);
        assert_eq!(t.s.drain_victims("a").count(), 0);
        t.report("job-1.0", TaskState::Killed);
        assert_eq!(t.job_state(&j), JobState::Queued);
        // An undrained agent's old deadline does nothing.
        let (mut t, _) = running(0, false);
        t.drain("a", false, Some(10), 1);
        t.apply(Command::UndrainAgent {
            agent_id: "a".into(),
            at_ms: 2,
        })
        .unwrap();
        t.apply(Command::DrainDeadlinePassed {
            agent_id: "a".into(),
            at_ms: 20,
        })
        .unwrap();
        assert!(!t.task("job-1.0").kill_requested);
        // A deadline already past when asked: killed at once.
        t.drain("a", false, Some(5), 30);
        assert!(t.task("job-1.0").kill_requested);
    }

    #[test]
    fn old_log_entries_decode_and_legacy_agent_lost_still_frees_at_once() {
        // An entry written before the new fields existed.
        let old = br#"{"version":1,"command":{"AgentLost":{"agent_id":"a","at_ms":9}}}"#;
        let cmd = Command::decode(old).unwrap();
        let (mut t, _) = running(0, false);
        t.apply(cmd).unwrap();
        assert_eq!(t.task("job-1.0").state, TaskState::Lost);
        assert!(t.s.gpu_owner.is_empty());
        // Records written before: the new fields take their defaults.
        let mut v = serde_json::to_value(t.task("job-1.0")).unwrap();
        let o = v.as_object_mut().unwrap();
        o.remove("holding");
        o.remove("before_unreachable");
        let task: TaskRecord = serde_json::from_value(v).unwrap();
        assert!(!task.holding && task.before_unreachable.is_none());
        let mut v = serde_json::to_value(&t.s.agents["a"]).unwrap();
        let o = v.as_object_mut().unwrap();
        o.remove("drain");
        o.remove("unreachable_since_ms");
        let agent: AgentRecord = serde_json::from_value(v).unwrap();
        assert!(agent.drain.is_none());
        let drain =
            br#"{"version":1,"command":{"DrainAgent":{"agent_id":"a","kill":false,"at_ms":1}}}"#;
        assert!(matches!(
            Command::decode(drain).unwrap(),
            Command::DrainAgent {
                deadline_ms: None,
                ..
            }
        ));
    }

    /// The leader leaves out a registration `registration_changes_nothing`
    /// says changes nothing: checked against the apply itself, in each
    /// situation an agent may come back to, with the tasks it runs, without
    /// one, and with one more.
    #[test]
    fn a_registration_said_to_change_nothing_changes_nothing() {
        let again =
            |t: &T, agent: &str, gpus: u32, running: &[&str], f: &dyn Fn(&mut AgentInfo)| {
                let Command::RegisterAgent { mut info, .. } = register(agent, gpus) else {
                    unreachable!()
                };
                f(&mut info);
                let running: Vec<TaskId> = running.iter().map(|s| s.to_string()).collect();
                let said = t.s.registration_changes_nothing(&info, &running);
                let mut after = t.s.clone();
                let applied = after.applied_index();
                let out = after.apply(
                    applied,
                    &Command::RegisterAgent {
                        info,
                        running_task_ids: running,
                        at_ms: 900_000,
                    },
                );
                let changed = out.is_err() || after != t.s;
                if said {
                    assert!(!changed, "said to change nothing, but it did ({out:?})");
                }
                said
            };
        let same = &|_: &mut AgentInfo| {};
        // A running task on a, b idle.
        let (mut t, _) = running(3, false);
        assert!(again(&t, "a", 2, &["job-1.0"], same));
        assert!(again(&t, "b", 2, &[], same));
        assert!(!again(&t, "a", 2, &[], same), "its task would be LOST");
        // A task of another agent it says it runs is not this agent's to
        // change (its desired set has it killed).
        assert!(again(&t, "b", 2, &["job-1.0"], same));
        assert!(!again(&t, "a", 3, &["job-1.0"], same), "one more GPU");
        assert!(!again(&t, "a", 2, &["job-1.0"], &|i| i.hostname = "moved".into()));
        assert!(!again(&t, "c", 2, &[], same), "unknown agent");
        // A STAGING task the agent has not seen yet stays: nothing changes.
        let j = t.submit(1, |_| {});
        t.launch(&j, &[("b", &["GPU-b-0"])]).unwrap();
        assert!(again(&t, "b", 2, &[], same));
        assert!(again(&t, "b", 2, &["job-2.0"], same));
        // Unreachable: registering brings it back.
        t.unreachable("a", 1_000);
        assert!(!again(&t, "a", 2, &["job-1.0"], same));
        t.back("a", 2, &["job-1.0"]);
        assert!(again(&t, "a", 2, &["job-1.0"], same));
        // Lost: a LOST task still holds its GPUs until its agent says it is
        // gone.
        t.unreachable("a", 2_000);
        t.lost("a", 3_000);
        assert_eq!(t.s.agents["a"].state, AgentState::Lost);
        assert!(!again(&t, "a", 2, &["job-1.0"], same));
        t.back("a", 2, &["job-1.0"]);
        assert_eq!(t.task("job-1.0").state, TaskState::Lost);
        assert_eq!(t.owner("GPU-a-0"), Some("job-1.0"));
        assert!(again(&t, "a", 2, &["job-1.0"], same));
        assert!(!again(&t, "a", 2, &[], same), "its GPUs would be released");
        // An agent sharing its GPUs by default: a GPU freed since its last
        // registration would be shared now.
        let mut t = T::new(&[("s", 2)]);
        let j = t.submit(1, |_| {});
        t.launch(&j, &[("s", &["GPU-s-0"])]).unwrap();
        let shares =
            &|i: &mut AgentInfo| i.share_gpus = Some(gpuctl_core::types::ShareMode::TimeSlice);
        t.back("s", 2, &[]);
        assert!(!again(&t, "s", 2, &[], shares), "GPU-s-1 would be shared");
    }

    /// A copy of the state (what a snapshot serializes, what the queue
    /// pass reads) serializes as the state does, restores to an equal
    /// state, and stays as it was taken while the state changes on: its
    /// maps are persistent, shared and copied on write.
    #[test]
    fn a_copy_of_the_state_is_the_state_as_it_was_taken() {
        let (mut t, j) = running(3, false);
        t.submit(1, |s| s.name = "queued".into());
        let before = serde_json::to_string(&t.s).unwrap();
        let copy = t.s.clone();
        assert_eq!(serde_json::to_string(&copy).unwrap(), before);
        let restored: State = serde_json::from_str(&before).unwrap();
        assert!(restored == t.s);
        // The state changes in every table: the copy does not.
        t.report("job-1.0", TaskState::Finished);
        assert_eq!(t.job_state(&j), JobState::Succeeded);
        t.back("b", 3, &[]);
        t.submit(2, |_| {});
        assert_ne!(serde_json::to_string(&t.s).unwrap(), before);
        assert_eq!(serde_json::to_string(&copy).unwrap(), before);
        // Its indexes are built afresh on first read, from what it holds.
        assert_eq!(
            *copy.capacity(),
            crate::state::capacity::Capacity::build(&copy)
        );
        assert!(copy.invariant_violations().is_empty());
    }
}
