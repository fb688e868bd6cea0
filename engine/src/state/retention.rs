//! Forgetting what ended: finished jobs with their tasks, and ended
//! framework tasks, once the leader's retention pass chose them
//! (`leader/retention.rs`). Apply re-checks each: only what has ended and
//! holds nothing goes, so `gpu_owner` and the agents' `allocated` never name
//! a forgotten task, and no job keeps the id of a task that is gone.
//!
//! Submit idempotency keys (`submit_requests`) stay until their own TTL even
//! when their job is forgotten: a resent submit must get the job it created
//! (now forgotten, which `gpuctl jobs get` says), never start a second one.
//! They are bounded by that TTL, not by the job retention.

use gpuctl_core::types::{JobId, TaskId};

use super::{job_seq, JobRecord, Outcome, State, TaskRecord};

impl State {
    /// Whether a task holds nothing: it ended, its agent confirmed it (not
    /// `holding`), and no GPU is recorded as its.
    pub fn task_holds_nothing(&self, t: &TaskRecord) -> bool {
        !t.holds_resources()
            && !t
                .gpu_uuids
                .iter()
                .any(|g| self.gpu_owner.get(g) == Some(&t.id))
    }

    /// Whether a job may be forgotten: it ended and none of its tasks, of
    /// any attempt, holds anything.
    pub fn job_forgettable(&self, job: &JobRecord) -> bool {
        job.state.is_terminal()
            && job.task_ids.iter().all(|id| {
                self.tasks
                    .get(id)
                    .is_none_or(|t| self.task_holds_nothing(t))
            })
    }

    /// Whether a framework's task may be forgotten: it ended, holds
    /// nothing, and its framework acknowledged its last update (or has
    /// nothing to acknowledge, or is gone).
    pub fn framework_task_forgettable(&self, t: &TaskRecord) -> bool {
        t.job_id.is_empty()
            && !t.framework_id.is_empty()
            && t.state.is_terminal()
            && self.task_holds_nothing(t)
            && self.is_acknowledged(&t.id, &t.last_update_uuid)
    }

    /// Whether `id` names a job this state had and forgot: job ids
    /// (`job-<n>`) are given in sequence and never reused.
    pub fn job_forgotten(&self, id: &str) -> bool {
        let seq = job_seq(id);
        !self.jobs.contains_key(id)
            && (1..self.next_job_seq).contains(&seq)
            && id == format!("job-{seq}")
    }

    /// `Command::ForgetJobs`: removes each named job that may be forgotten
    /// (and did not change after the proposer looked, at `at_ms`) with its
    /// tasks; skips the others.
    pub(super) fn forget_jobs(&mut self, job_ids: &[JobId], at_ms: u64) -> Outcome {
        for id in job_ids {
            let Some(job) = self.jobs.get(id) else {
                continue; // forgotten already (an earlier leader's pass)
            };
            if job.updated_at_ms > at_ms || !self.job_forgettable(job) {
                continue;
            }
            if let Some(job) = self.jobs.remove(id) {
                for t in &job.task_ids {
                    self.tasks.remove(t);
                    self.util.forget_task(t);
                }
            }
        }
        Outcome::Done
    }

    /// `Command::ForgetFrameworkTasks`: removes each named framework task
    /// that may be forgotten; skips the others.
    pub(super) fn forget_framework_tasks(&mut self, task_ids: &[TaskId], at_ms: u64) -> Outcome {
        for id in task_ids {
            let Some(t) = self.tasks.get(id) else {
                continue;
            };
            if t.updated_at_ms > at_ms || !self.framework_task_forgettable(t) {
                continue;
            }
            self.tasks.remove(id);
            self.util.forget_task(id);
        }
        Outcome::Done
    }
}

#[cfg(test)]
mod tests {
    use gpuctl_core::types::{
        FrameworkInfo, FrameworkTask, JobSpec, JobState, Resources, TaskState,
    };

    use crate::state::testkit::{register, status, Driver};
    use crate::state::{Command, Outcome, State};

    fn spec(gpus: u32, max_retries: u32) -> JobSpec {
        let mut s = JobSpec::new(
            "j",
            vec!["true".into()],
            Resources {
                cpus: 1.0,
                mem_mib: 64,
                gpus,
                ports: 0,
            },
        );
        s.max_retries = max_retries;
        s
    }

    struct T(Driver);

    impl T {
        fn new() -> T {
            T(Driver::new(&[("a", 4)]))
        }
        fn apply(&mut self, c: Command) -> Outcome {
            let r = self.0.apply(c).unwrap();
            let bad = self.0.s.invariant_violations();
            assert!(bad.is_empty(), "{bad:#?}");
            r
        }
        fn submit(&mut self, s: JobSpec, key: Option<&str>, at_ms: u64) -> String {
            match self.apply(Command::SubmitJob {
                spec: s,
                at_ms,
                request_id: key.map(str::to_string),
            }) {
                Outcome::JobSubmitted { job_id } => job_id,
                o => panic!("{o:?}"),
            }
        }
        fn launch(&mut self, job: &str, gpus: &[&str], at_ms: u64) {
            self.0.launch_at(job, &[("a", gpus)], at_ms).unwrap();
            assert!(self.0.s.invariant_violations().is_empty());
        }
        fn report(&mut self, task: &str, state: TaskState, code: Option<i32>, at_ms: u64) {
            let mut update = status("a", task, state);
            update.exit_code = code;
            self.apply(Command::UpdateTaskStatus { update, at_ms });
        }
        fn forget(&mut self, jobs: &[&str], at_ms: u64) {
            self.apply(Command::ForgetJobs {
                job_ids: jobs.iter().map(|j| j.to_string()).collect(),
                at_ms,
            });
        }
        fn s(&self) -> &State {
            &self.0.s
        }
    }

    /// Jobs in every state, one of them retried and one whose task still
    /// holds its GPU; only the ended ones that hold nothing go.
    #[test]
    fn forget_jobs_removes_ended_jobs_with_their_tasks_and_nothing_else() {
        let mut t = T::new();
        // job-1: failed once, then succeeded (two tasks).
        let retried = t.submit(spec(1, 1), None, 1);
        t.launch(&retried, &["GPU-a-0"], 2);
        t.report("job-1.0", TaskState::Failed, Some(1), 3);
        t.launch(&retried, &["GPU-a-0"], 4);
        t.report("job-1.1", TaskState::Finished, Some(0), 5);
        // job-2 running, job-3 queued, job-4 cancelled before it started.
        let running = t.submit(spec(1, 0), None, 6);
        t.launch(&running, &["GPU-a-1"], 7);
        t.report("job-2.0", TaskState::Running, None, 8);
        let queued = t.submit(spec(8, 0), None, 9);
        let cancelled = t.submit(spec(0, 0), None, 10);
        t.apply(Command::CancelJob {
            job_id: cancelled.clone(),
            at_ms: 11,
        });
        // job-5: FAILED because its agent went silent; its task LOST but
        // holding GPU-a-2 until the agent confirms.
        let lost = t.submit(spec(1, 0), None, 12);
        t.launch(&lost, &["GPU-a-2"], 13);
        for c in [
            Command::AgentUnreachable {
                agent_id: "a".into(),
                at_ms: 14,
            },
            Command::AgentLostAfterTimeout {
                agent_id: "a".into(),
                at_ms: 15,
            },
        ] {
            t.apply(c);
        }
        assert_eq!(t.s().job(&lost).unwrap().state, JobState::Failed);
        assert!(t.s().task("job-5.0").unwrap().holding);
        // (job-2's task is LOST too now, but its agent kept holding it.)
        assert_eq!(t.s().job(&running).unwrap().state, JobState::Failed);

        let all = [
            retried.as_str(),
            &running,
            &queued,
            &cancelled,
            &lost,
            "job-99",
        ];
        t.forget(&all, 100);
        assert!(t.s().job(&retried).is_none());
        assert!(t.s().task("job-1.0").is_none() && t.s().task("job-1.1").is_none());
        assert!(t.s().job(&cancelled).is_none());
        assert!(t.s().job(&queued).is_some(), "not ended");
        assert!(t.s().job(&running).is_some(), "its task holds GPU-a-1");
        assert!(t.s().job(&lost).is_some(), "its task holds GPU-a-2");
        assert_eq!(
            t.s().gpu_owner("GPU-a-2").map(String::as_str),
            Some("job-5.0")
        );
        assert!(t.s().job_forgotten(&retried) && !t.s().job_forgotten(&lost));

        // The agent comes back without the tasks: its word that they are
        // gone releases the GPUs, and then the jobs can go too.
        t.apply(register("a", 4));
        assert!(t.s().gpu_owners().is_empty());
        t.forget(&all, 100);
        assert!(t.s().job(&running).is_none() && t.s().job(&lost).is_none());
        assert!(t.s().tasks().is_empty());
        assert_eq!(t.s().jobs().len(), 1, "only the queued job is left");
        // Repeating the command (a new leader's pass) changes nothing.
        let before = t.s().clone();
        t.forget(&all, 100);
        assert_eq!(t.s().jobs(), before.jobs());
        // Ids are never reused.
        assert_eq!(t.submit(spec(0, 0), None, 101), "job-6");
    }

    #[test]
    fn a_job_that_changed_after_the_proposers_look_is_kept() {
        let mut t = T::new();
        let j = t.submit(spec(0, 0), None, 1);
        t.launch(&j, &[], 2);
        t.report("job-1.0", TaskState::Finished, Some(0), 50);
        t.forget(&[&j], 49);
        assert!(t.s().job(&j).is_some());
        t.forget(&[&j], 50);
        assert!(t.s().job(&j).is_none());
    }

    /// A resent submit after its job was forgotten gets that job's id (now
    /// forgotten), not a second job, until the key's own TTL.
    #[test]
    fn submit_keys_outlive_their_forgotten_job_until_their_ttl() {
        let mut t = T::new();
        let j = t.submit(spec(0, 0), Some("k1"), 1_000);
        t.launch(&j, &[], 1_001);
        t.report("job-1.0", TaskState::Finished, Some(0), 1_002);
        t.forget(&[&j], 2_000);
        assert!(t.s().job_forgotten(&j));
        assert_eq!(t.submit(spec(0, 0), Some("k1"), 3_000), j);
        assert_eq!(t.s().submitted_job("k1"), Some(&j));
        assert!(t.s().jobs().is_empty(), "no second job");
        // Past the TTL the key goes; the same key now makes a new job.
        let later = 1_000 + crate::state::SUBMIT_REQUEST_TTL_MS + 1;
        assert_eq!(t.submit(spec(0, 0), Some("k2"), later), "job-2");
        assert_eq!(t.s().submitted_job("k1"), None);
        assert_eq!(t.submit(spec(0, 0), Some("k1"), later), "job-3");
    }

    #[test]
    fn forgotten_means_a_job_id_once_given() {
        let mut t = T::new();
        let j = t.submit(spec(0, 0), None, 1);
        assert!(!t.s().job_forgotten(&j), "still here");
        t.apply(Command::CancelJob {
            job_id: j.clone(),
            at_ms: 2,
        });
        t.forget(&[&j], 3);
        assert!(t.s().job_forgotten("job-1"));
        for never in ["job-0", "job-01", "job-2", "job-x", "1", ""] {
            assert!(!t.s().job_forgotten(never), "{never}");
        }
    }

    fn framework(t: &mut T) -> String {
        match t.apply(Command::SubscribeFramework {
            request_id: None,
            info: FrameworkInfo {
                id: String::new(),
                name: "fw".into(),
                roles: vec!["ml".into()],
                gpu_capable: true,
                failover_timeout_ms: 60_000,
                tenant: Default::default(),
            },
            at_ms: 0,
        }) {
            Outcome::FrameworkSubscribed { framework_id } => framework_id,
            o => panic!("{o:?}"),
        }
    }

    fn fw_task(id: &str, gpus: &[&str]) -> FrameworkTask {
        FrameworkTask {
            task_id: id.into(),
            agent_id: "a".into(),
            image: None,
            command: vec!["true".into()],
            env: Default::default(),
            resources: Resources {
                cpus: 1.0,
                mem_mib: 64,
                gpus: gpus.len() as u32,
                ports: 0,
            },
            gpu_uuids: gpus.iter().map(|g| g.to_string()).collect(),
            fraction: None,
        }
    }

    /// A framework's ended task goes once its last update is acknowledged
    /// (or needs no acknowledgement, or nobody is left to give it).
    #[test]
    fn framework_tasks_go_once_ended_and_acknowledged() {
        let mut t = T::new();
        let f = framework(&mut t);
        t.apply(Command::LaunchFrameworkTasks {
            framework_id: f.clone(),
            tasks: vec![
                fw_task("done", &["GPU-a-0"]),
                fw_task("acked", &["GPU-a-1"]),
                fw_task("running", &["GPU-a-2"]),
                // Refused (GPU-a-0 is taken above): ERROR at once, made by
                // the master, nothing to acknowledge.
                fw_task("refused", &["GPU-a-0"]),
            ],
            group: false,
            at_ms: 1,
        });
        for (task, uuid) in [("done", 1u8), ("acked", 2)] {
            let mut u = status("a", &format!("{f}.{task}"), TaskState::Finished);
            u.exit_code = Some(0);
            u.uuid = vec![uuid];
            t.apply(Command::UpdateTaskStatus {
                update: u,
                at_ms: 2,
            });
        }
        t.apply(Command::AcknowledgeUpdate {
            framework_id: f.clone(),
            framework_task_id: "acked".into(),
            uuid: vec![2],
        });
        let ids: Vec<String> = ["done", "acked", "running", "refused"]
            .iter()
            .map(|id| format!("{f}.{id}"))
            .collect();
        let forget = |t: &mut T| {
            t.apply(Command::ForgetFrameworkTasks {
                task_ids: ids.clone(),
                at_ms: 10,
            });
        };
        forget(&mut t);
        let left: Vec<&str> = t.s().tasks().keys().map(String::as_str).collect();
        assert_eq!(left, vec!["fw-1.done", "fw-1.running"]);
        // The framework is torn down: nobody will acknowledge "done"; the
        // running task is asked to stop and stays until it has ended.
        t.apply(Command::RemoveFramework {
            framework_id: f.clone(),
            reason: "bye".into(),
            at_ms: 11,
        });
        t.apply(Command::ForgetFrameworkTasks {
            task_ids: ids.clone(),
            at_ms: 11,
        });
        let left: Vec<&str> = t.s().tasks().keys().map(String::as_str).collect();
        assert_eq!(left, vec!["fw-1.running"]);
        t.report("fw-1.running", TaskState::Killed, None, 12);
        t.apply(Command::ForgetFrameworkTasks {
            task_ids: ids,
            at_ms: 12,
        });
        assert!(t.s().tasks().is_empty());
        // A job's task is never taken by this command.
        let j = t.submit(spec(0, 0), None, 13);
        t.launch(&j, &[], 13);
        t.report("job-1.0", TaskState::Finished, Some(0), 14);
        t.apply(Command::ForgetFrameworkTasks {
            task_ids: vec!["job-1.0".into()],
            at_ms: 20,
        });
        assert!(t.s().task("job-1.0").is_some());
    }

    /// What a snapshot holds goes back to about its size before the jobs
    /// were added once they are forgotten: the state grows with live work
    /// and the retention window, not with history.
    #[test]
    fn a_snapshot_shrinks_back_once_finished_jobs_are_forgotten() {
        let mut t = T::new();
        let size = |s: &State| serde_json::to_vec(s).unwrap().len();
        let empty = size(t.s());
        let mut ids = Vec::new();
        for i in 0..300u64 {
            let j = t.submit(spec(1, 0), None, i);
            t.launch(&j, &["GPU-a-0"], i);
            t.report(&format!("{j}.0"), TaskState::Finished, Some(0), i);
            ids.push(j);
        }
        let full = size(t.s());
        assert!(full > empty + 300 * 500, "{empty} -> {full}");
        for chunk in ids.chunks(100) {
            let chunk: Vec<&str> = chunk.iter().map(String::as_str).collect();
            t.forget(&chunk, 1_000);
        }
        let after = size(t.s());
        // Only the counters moved (next job id, applied index), and the
        // accounting ledger holds the jobs' usage in one row (one hour,
        // tenant, user and model), not one per job.
        assert_eq!(t.s().usage().len(), 1);
        let ledger = serde_json::to_vec(t.s().usage()).unwrap().len();
        assert!(ledger < 200, "{ledger}");
        assert!(after <= empty + 16 + ledger, "{empty} -> {full} -> {after}");
        assert!(t.s().jobs().is_empty() && t.s().tasks().is_empty());
    }

    /// The command's log form: new entries, fixed from now on (old entries
    /// of the other commands keep theirs).
    #[test]
    fn the_forget_commands_encoding_is_stable() {
        let c = Command::ForgetJobs {
            job_ids: vec!["job-1".into()],
            at_ms: 5,
        };
        assert_eq!(
            String::from_utf8(c.encode().unwrap()).unwrap(),
            format!(
                r#"{{"version":{},"command":{{"ForgetJobs":{{"job_ids":["job-1"],"at_ms":5}}}}}}"#,
                crate::state::COMMAND_VERSION
            )
        );
        let c = Command::ForgetFrameworkTasks {
            task_ids: vec!["fw-1.t".into()],
            at_ms: 5,
        };
        let text =
            r#"{"version":1,"command":{"ForgetFrameworkTasks":{"task_ids":["fw-1.t"],"at_ms":5}}}"#;
        assert_eq!(Command::decode(text.as_bytes()).unwrap(), c);
    }
}
