//! The leader's retention pass. Finished jobs (with their tasks) and ended
//! framework tasks are kept for `--job-retention`, and at most
//! `--job-retention-max` of each (the oldest go first), then forgotten
//! through the log (`ForgetJobs`, `ForgetFrameworkTasks`), so that the state
//! and its snapshots grow with live work and the retention window, not with
//! history. What still holds GPUs or resources, and a framework task whose
//! last update is not acknowledged, is kept past both limits. The decision
//! is pure ([`retention_commands`]); apply re-checks it.

use std::time::Duration;

use tokio::sync::watch;

use crate::now_ms;
use crate::raft::RaftHandle;
use crate::state::{job_seq, Command, State};

/// Most ids in one command: a pass that finds more proposes several, so no
/// log entry (nor its apply) grows with the backlog.
pub const FORGET_BATCH: usize = 1000;

/// Default of `--job-retention`.
pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
/// Default of `--job-retention-max`.
pub const DEFAULT_MAX_FINISHED: usize = 10_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// How long after its end a finished job (or framework task) is kept.
    pub max_age: Duration,
    /// Most finished jobs kept, and most ended framework tasks kept.
    pub max_finished: usize,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            max_age: DEFAULT_MAX_AGE,
            max_finished: DEFAULT_MAX_FINISHED,
        }
    }
}

impl Retention {
    /// How often the pass runs: half the retention, between 1 s and 1 min.
    /// A finished job goes within its retention plus this.
    pub fn pass_every(&self) -> Duration {
        (self.max_age / 2).clamp(Duration::from_secs(1), Duration::from_secs(60))
    }
}

/// One finished thing, as the pass sees it.
struct Finished<'a> {
    ended_ms: u64,
    /// Ties on `ended_ms` broken by age of the id.
    order: (u64, &'a str),
    forgettable: bool,
}

/// Which of `finished` go: those past the retention, and the oldest beyond
/// the count, that may be forgotten; oldest first.
fn pick<'a>(mut finished: Vec<Finished<'a>>, now_ms: u64, r: &Retention) -> Vec<&'a str> {
    finished.sort_unstable_by_key(|f| (f.ended_ms, f.order));
    let excess = finished.len().saturating_sub(r.max_finished);
    let max_age_ms = u64::try_from(r.max_age.as_millis()).unwrap_or(u64::MAX);
    finished
        .iter()
        .enumerate()
        .filter(|(i, f)| {
            f.forgettable && (*i < excess || f.ended_ms.saturating_add(max_age_ms) <= now_ms)
        })
        .map(|(_, f)| f.order.1)
        .collect()
}

/// The leader's retention decisions. PURE: from the state, the time and
/// the limits, the commands to propose, each with at most
/// [`FORGET_BATCH`] ids, oldest first:
///
/// - finished jobs (`JobState::is_terminal`) that ended (`updated_at_ms`)
///   at least `max_age` before `now_ms`, and the oldest beyond
///   `max_finished`, unless a task of theirs still holds GPUs or resources:
///   `ForgetJobs`;
/// - the same for ended framework tasks, which must also have their last
///   update acknowledged by their framework (or have none, or no framework
///   left to acknowledge it): `ForgetFrameworkTasks`.
///
/// Jobs still queued or running are never named.
pub fn retention_commands(state: &State, now_ms: u64, r: &Retention) -> Vec<Command> {
    let jobs: Vec<Finished> = state
        .jobs()
        .values()
        .filter(|j| j.state.is_terminal())
        .map(|j| Finished {
            ended_ms: j.updated_at_ms,
            order: (job_seq(&j.id), &j.id),
            forgettable: state.job_forgettable(j),
        })
        .collect();
    let tasks: Vec<Finished> = state
        .framework_tasks()
        .filter(|t| t.job_id.is_empty() && t.state.is_terminal())
        .map(|t| Finished {
            ended_ms: t.updated_at_ms,
            order: (0, &t.id),
            forgettable: state.framework_task_forgettable(t),
        })
        .collect();
    let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let mut out: Vec<Command> = pick(jobs, now_ms, r)
        .chunks(FORGET_BATCH)
        .map(|c| Command::ForgetJobs {
            job_ids: ids(c),
            at_ms: now_ms,
        })
        .collect();
    out.extend(pick(tasks, now_ms, r).chunks(FORGET_BATCH).map(|c| {
        Command::ForgetFrameworkTasks {
            task_ids: ids(c),
            at_ms: now_ms,
        }
    }));
    out
}

/// The retention loop: while this master leads, forgets what is past the
/// retention every [`Retention::pass_every`].
pub async fn run(raft: RaftHandle, retention: Retention, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(retention.pass_every());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = tick.tick() => {}
        }
        if raft.status().serving {
            forget_finished(&raft, &retention).await;
        }
    }
}

async fn forget_finished(raft: &RaftHandle, retention: &Retention) {
    let commands = {
        let state = raft.state();
        retention_commands(&state, now_ms(), retention)
    };
    for cmd in commands {
        let count = match &cmd {
            Command::ForgetJobs { job_ids, .. } => job_ids.len(),
            Command::ForgetFrameworkTasks { task_ids, .. } => task_ids.len(),
            _ => 0,
        };
        match raft.propose(cmd.clone()).await {
            Ok(_) => {
                tracing::info!(
                    command = cmd.kind(),
                    count,
                    "forgot finished work past its retention"
                )
            }
            Err(e) => {
                // The next pass (here or at the next leader) decides again.
                tracing::warn!(command = cmd.kind(), error = %e, "could not forget finished work");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::testkit::{register, status, Driver};
    use crate::state::Outcome;
    use gpuctl_core::types::{FrameworkInfo, FrameworkTask, JobSpec, Resources, TaskState};

    fn spec(gpus: u32) -> JobSpec {
        JobSpec::new(
            "j",
            vec!["true".into()],
            Resources {
                cpus: 1.0,
                mem_mib: 0,
                gpus,
                ports: 0,
            },
        )
    }

    fn submit(d: &mut Driver, gpus: u32, at_ms: u64) -> String {
        match d
            .apply(Command::SubmitJob {
                spec: spec(gpus),
                at_ms,
                request_id: None,
            })
            .unwrap()
        {
            Outcome::JobSubmitted { job_id } => job_id,
            o => panic!("{o:?}"),
        }
    }

    fn report(d: &mut Driver, agent: &str, task: &str, state: TaskState, at_ms: u64) {
        let mut update = status(agent, task, state);
        update.exit_code = (state == TaskState::Finished).then_some(0);
        d.apply(Command::UpdateTaskStatus { update, at_ms })
            .unwrap();
    }

    /// Agents a and b. job-1, job-2, job-3 ended at 1, 2 and 3 s; job-4
    /// runs on a; job-5 is queued; job-6 FAILED at 5 s when b was lost, its
    /// task still holding b's GPU; job-7 ended at 6 s.
    fn cluster() -> Driver {
        let mut d = Driver::new(&[("a", 2), ("b", 1)]);
        let j1 = submit(&mut d, 0, 0);
        d.launch_at(&j1, &[("a", &[])], 0).unwrap();
        report(&mut d, "a", "job-1.0", TaskState::Finished, 1_000);
        let j2 = submit(&mut d, 0, 0);
        d.launch_at(&j2, &[("a", &[])], 0).unwrap();
        report(&mut d, "a", "job-2.0", TaskState::Failed, 2_000);
        let j3 = submit(&mut d, 0, 0);
        d.apply(Command::CancelJob {
            job_id: j3,
            at_ms: 3_000,
        })
        .unwrap();
        let j4 = submit(&mut d, 1, 0);
        d.launch_at(&j4, &[("a", &["GPU-a-0"])], 0).unwrap();
        report(&mut d, "a", "job-4.0", TaskState::Running, 0);
        submit(&mut d, 8, 0);
        let j6 = submit(&mut d, 1, 0);
        d.launch_at(&j6, &[("b", &["GPU-b-0"])], 0).unwrap();
        for c in [
            Command::AgentUnreachable {
                agent_id: "b".into(),
                at_ms: 4_000,
            },
            Command::AgentLostAfterTimeout {
                agent_id: "b".into(),
                at_ms: 5_000,
            },
        ] {
            d.apply(c).unwrap();
        }
        let j7 = submit(&mut d, 0, 0);
        d.launch_at(&j7, &[("a", &[])], 0).unwrap();
        report(&mut d, "a", "job-7.0", TaskState::Finished, 6_000);
        d
    }

    fn forgotten_jobs(cmds: &[Command]) -> Vec<String> {
        cmds.iter()
            .flat_map(|c| match c {
                Command::ForgetJobs { job_ids, .. } => job_ids.clone(),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn which_jobs_are_forgotten() {
        let d = cluster();
        let s = &d.s;
        assert!(s.task("job-6.0").unwrap().holding);
        let r = |age_secs: u64, max: usize| Retention {
            max_age: Duration::from_secs(age_secs),
            max_finished: max,
        };
        // (retention, now in ms, jobs forgotten, oldest first)
        let cases: &[(Retention, u64, &[&str])] = &[
            // By age: ended at least 10 s ago.
            (r(10, 100), 10_999, &[]),
            (r(10, 100), 11_000, &["job-1"]),
            (r(10, 100), 13_000, &["job-1", "job-2", "job-3"]),
            // Never what runs, waits, or holds a GPU.
            (r(10, 100), 1_000_000, &["job-1", "job-2", "job-3", "job-7"]),
            // By count: 5 finished (job-6 among them), the oldest go.
            (r(3600, 5), 7_000, &[]),
            (r(3600, 4), 7_000, &["job-1"]),
            (r(3600, 2), 7_000, &["job-1", "job-2", "job-3"]),
            // job-6 is over the count but holds a GPU: kept, and not
            // replaced by a younger one.
            (r(3600, 1), 7_000, &["job-1", "job-2", "job-3"]),
            (r(3600, 0), 7_000, &["job-1", "job-2", "job-3", "job-7"]),
        ];
        for (ret, now, want) in cases {
            let cmds = retention_commands(s, *now, ret);
            assert_eq!(forgotten_jobs(&cmds), *want, "{ret:?} at {now}");
            for c in &cmds {
                assert!(matches!(c, Command::ForgetJobs { at_ms, .. } if at_ms == now));
            }
        }
    }

    #[test]
    fn decisions_applied_leave_live_work_and_free_nothing() {
        let mut d = cluster();
        let r = Retention {
            max_age: Duration::from_secs(1),
            max_finished: 0,
        };
        for c in retention_commands(&d.s, 1_000_000, &r) {
            d.apply(c).unwrap();
        }
        let left: Vec<&str> = d.s.jobs().keys().map(String::as_str).collect();
        assert_eq!(left, vec!["job-4", "job-5", "job-6"]);
        assert_eq!(
            d.s.gpu_owner("GPU-b-0").map(String::as_str),
            Some("job-6.0")
        );
        assert!(d.s.invariant_violations().is_empty());
        assert!(retention_commands(&d.s, 1_000_000, &r).is_empty());
        // b returns without the task: now job-6 goes too.
        d.apply(register("b", 1)).unwrap();
        let cmds = retention_commands(&d.s, 1_000_000, &r);
        assert_eq!(forgotten_jobs(&cmds), vec!["job-6"]);
    }

    #[test]
    fn a_backlog_is_forgotten_in_bounded_batches() {
        let mut d = Driver::new(&[]);
        for i in 0..2_500u64 {
            let j = submit(&mut d, 0, i);
            d.apply(Command::CancelJob {
                job_id: j,
                at_ms: i,
            })
            .unwrap();
        }
        let r = Retention {
            max_age: Duration::from_secs(3600),
            max_finished: 10,
        };
        let cmds = retention_commands(&d.s, 3_000, &r);
        let sizes: Vec<usize> = cmds
            .iter()
            .map(|c| match c {
                Command::ForgetJobs { job_ids, .. } => job_ids.len(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(sizes, vec![1000, 1000, 490]);
        let all = forgotten_jobs(&cmds);
        assert_eq!(all.first().map(String::as_str), Some("job-1"));
        assert_eq!(all.last().map(String::as_str), Some("job-2490"));
    }

    #[test]
    fn framework_tasks_by_age_and_count_once_acknowledged() {
        let mut d = Driver::new(&[("a", 0)]);
        let f = match d
            .apply(Command::SubscribeFramework {
                request_id: None,
                info: FrameworkInfo {
                    id: String::new(),
                    name: "fw".into(),
                    roles: vec!["ml".into()],
                    gpu_capable: false,
                    failover_timeout_ms: 60_000,
                    tenant: Default::default(),
                },
                at_ms: 0,
            })
            .unwrap()
        {
            Outcome::FrameworkSubscribed { framework_id } => framework_id,
            o => panic!("{o:?}"),
        };
        let task = |id: &str| FrameworkTask {
            task_id: id.into(),
            agent_id: "a".into(),
            image: None,
            command: vec!["true".into()],
            env: Default::default(),
            resources: Resources {
                cpus: 1.0,
                mem_mib: 0,
                gpus: 0,
                ports: 0,
            },
            gpu_uuids: vec![],
            fraction: None,
        };
        d.apply(Command::LaunchFrameworkTasks {
            framework_id: f.clone(),
            tasks: vec![task("t1"), task("t2"), task("t3"), task("live")],
            group: false,
            at_ms: 0,
        })
        .unwrap();
        for (i, t) in ["t1", "t2", "t3"].iter().enumerate() {
            let mut u = status("a", &format!("{f}.{t}"), TaskState::Finished);
            u.uuid = vec![i as u8 + 1];
            let at_ms = 1_000 * (i as u64 + 1);
            d.apply(Command::UpdateTaskStatus { update: u, at_ms })
                .unwrap();
        }
        // t1 and t3 acknowledged; t2 not yet.
        for (t, uuid) in [("t1", 1u8), ("t3", 3)] {
            d.apply(Command::AcknowledgeUpdate {
                framework_id: f.clone(),
                framework_task_id: t.into(),
                uuid: vec![uuid],
            })
            .unwrap();
        }
        let tasks = |age_secs: u64, max: usize, now: u64| -> Vec<String> {
            let r = Retention {
                max_age: Duration::from_secs(age_secs),
                max_finished: max,
            };
            retention_commands(&d.s, now, &r)
                .into_iter()
                .flat_map(|c| match c {
                    Command::ForgetFrameworkTasks { task_ids, .. } => task_ids,
                    other => panic!("{other:?}"),
                })
                .collect()
        };
        assert!(tasks(10, 100, 10_999).is_empty());
        assert_eq!(tasks(10, 100, 11_000), vec!["fw-1.t1"]);
        assert_eq!(tasks(10, 100, 99_000), vec!["fw-1.t1", "fw-1.t3"]);
        assert_eq!(tasks(3600, 1, 5_000), vec!["fw-1.t1"]);
        assert_eq!(tasks(3600, 0, 5_000), vec!["fw-1.t1", "fw-1.t3"]);
    }

    #[test]
    fn the_pass_runs_often_enough_for_the_retention() {
        let every = |secs: u64| {
            Retention {
                max_age: Duration::from_secs(secs),
                max_finished: 1,
            }
            .pass_every()
        };
        assert_eq!(every(1), Duration::from_secs(1));
        assert_eq!(every(30), Duration::from_secs(15));
        assert_eq!(every(7 * 24 * 3600), Duration::from_secs(60));
    }
}
