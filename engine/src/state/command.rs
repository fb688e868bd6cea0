//! Commands: the only way the replicated state changes. Each is decided by
//! the proposer (time, ids of things it names) and carried in the log, so
//! that applying it gives the same result on every master.

use std::collections::BTreeMap;

use gpuctl_core::types::{
    AgentId, AgentInfo, FrameworkId, FrameworkInfo, FrameworkTask, GpuInfo, GpuUuid, JobId,
    JobSpec, StatusUpdate, TaskId,
};
use serde::{Deserialize, Serialize};

/// Version of the encoding below. Bump it when a command changes shape or a
/// new one is added, and keep decoding the old forms, because old entries
/// stay in the log: a master applies entries of its own version and older,
/// and stops at one of a newer version (docs/operations.md, "Upgrading masters").
///
/// 2 (issue 38): applying an entry changed, so masters of version 1 must not
/// apply entries of version 2 beside masters of version 2: a committed
/// cancel ends its job CANCELLED however its tasks end, and a failed task's
/// job message names its rank and its agent's words. Version-1 entries
/// decode and apply as before.
///
/// 3 (issue 38, elastic gangs): `GrowJob`, and `LaunchJobs` may start an
/// elastic gang with fewer ranks than `replicas`.
///
/// 4 (issues 38, 39): `RecordUtilization`; a task's end charges the
/// accounting ledger, and a task ended by a GPU fault makes its job avoid
/// that GPU (applying changed: version-3 masters would keep other state).
///
/// 5 (issue 39): `RecordUtilization` names every fraction on a GPU whose
/// per-process readings were read (0: it used none), keeps each
/// fraction's own readings in its task and history, the cluster's hourly
/// means, and flags a job idle by its fractions' readings too (version-4
/// masters would flag other jobs).
///
/// 6 (issue 55): a task its container runtime stopped as the runtime
/// restarted (`StatusUpdate::runtime_restarted`) requeues its job without
/// using a retry (version-5 masters would count a failed attempt);
/// `UseJoinToken` names the request by its key, and the same request sent
/// again is let through (version-5 masters would refuse it).
///
/// 7 (issue 57): services (`CreateService`, `ScaleService`,
/// `DeleteService`), the `always` restart policy of their replicas' jobs,
/// and `CancelJob` refused for a live service's replica.
///
/// 8 (issue 57): a replica that leaves its service drains (`EndDrains`
/// stops it; version-7 masters would stop it at once).
pub const COMMAND_VERSION: u32 = 8;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Command {
    /// API addresses of masters (a new leader records those it was given by
    /// `--peers` and that the state lacks). Entries replace older ones.
    RecordMasters {
        masters: BTreeMap<u64, String>,
    },
    /// An agent (re)registers. Tasks the master placed on it that it does
    /// not list in `running_task_ids` are lost (the agent's word that they
    /// are gone: their GPUs are released); UNREACHABLE tasks it lists go
    /// back to the state they had; LOST tasks it still lists stay held and
    /// go on its kill list.
    RegisterAgent {
        info: AgentInfo,
        running_task_ids: Vec<TaskId>,
        at_ms: u64,
    },
    /// LEGACY, no longer proposed: written by masters before UNREACHABLE
    /// existed, when an agent missed heartbeats for the agent timeout. It
    /// is applied as it always was (the agent LOST, its tasks LOST and
    /// their GPUs freed at once) so that old log entries replay to the same
    /// state on every master. New masters propose `AgentUnreachable` and
    /// `AgentLostAfterTimeout` instead.
    AgentLost {
        agent_id: AgentId,
        at_ms: u64,
    },
    /// The leader has not heard from an ACTIVE agent for the agent timeout
    /// (`--agent-timeout-secs`): it becomes UNREACHABLE and so do its live
    /// tasks, which keep their GPUs and resources (their jobs stay as they
    /// are). Nothing new is placed on it. A no-op unless the agent is
    /// ACTIVE (it may have registered again since the leader decided).
    AgentUnreachable {
        agent_id: AgentId,
        at_ms: u64,
    },
    /// The leader has not heard from an UNREACHABLE agent for the lost
    /// timeout (`--agent-lost-timeout-secs`): it becomes LOST and its tasks
    /// LOST (their jobs follow their retry policy), except tasks of
    /// `no_fence` jobs, which stay UNREACHABLE. A LOST task keeps holding
    /// its GPUs until its agent confirms it is gone. A no-op unless the
    /// agent is UNREACHABLE.
    AgentLostAfterTimeout {
        agent_id: AgentId,
        at_ms: u64,
    },
    /// An operator drains an agent: no new tasks go to it. With `kill`
    /// its live tasks are killed now; else they are killed at `deadline_ms`
    /// (decided by the proposer: its clock plus `--deadline`) if they still
    /// run, or never when `None`. Repeating it replaces the deadline.
    DrainAgent {
        agent_id: AgentId,
        kill: bool,
        #[serde(default)]
        deadline_ms: Option<u64>,
        at_ms: u64,
    },
    /// An operator ends a drain: the agent takes new tasks again. Tasks
    /// already asked to stop stay so.
    UndrainAgent {
        agent_id: AgentId,
        at_ms: u64,
    },
    /// The leader saw a drained agent's deadline pass: its live tasks are
    /// killed. A no-op unless the agent is draining with a deadline at or
    /// before `at_ms` (it may have been undrained since).
    DrainDeadlinePassed {
        agent_id: AgentId,
        at_ms: u64,
    },
    SubmitJob {
        spec: JobSpec,
        at_ms: u64,
        /// The client's idempotency key (see `State::submit_requests`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request_id: Option<String>,
    },
    /// Place queued jobs: all launches in the command happen or none does.
    LaunchTasks {
        launches: Vec<Launch>,
        at_ms: u64,
    },
    /// Place several queued jobs in one entry (a round of the built-in
    /// scheduler): each job's launches happen or none of them does, as in
    /// `LaunchTasks`; one job refused does not refuse the others.
    LaunchJobs {
        jobs: Vec<Vec<Launch>>,
        at_ms: u64,
    },
    UpdateTaskStatus {
        update: StatusUpdate,
        at_ms: u64,
    },
    CancelJob {
        job_id: JobId,
        at_ms: u64,
    },
    /// An agent's health checks changed their verdict on some of its GPUs:
    /// an unhealthy GPU is neither offered nor placed on until it is
    /// healthy again. (The agent itself stops tasks on a failed GPU.)
    SetGpuHealth {
        agent_id: AgentId,
        gpus: Vec<GpuHealthChange>,
        at_ms: u64,
    },
    /// An operator cordons (`cordon`) or uncordons a GPU.
    CordonGpu {
        uuid: GpuUuid,
        cordon: bool,
    },
    /// Mark a GPU shareable by fractions with `mode`, or not (`None`):
    /// `gpuctl gpus share`. Refused for a GPU in MIG mode or held whole,
    /// and, to stop or change sharing, while fractions of it are held.
    ShareGpu {
        gpu_uuid: GpuUuid,
        mode: Option<gpuctl_core::types::ShareMode>,
    },
    /// Change a GPU's MIG layout (`gpuctl gpus mig set`, or the leader's
    /// `--mig-auto`): its MIG devices afterwards, by profile, or MIG mode
    /// off. Refused while anything holds the GPU or its MIG devices.
    SetMigLayout {
        gpu_uuid: GpuUuid,
        profiles: Vec<String>,
        disable: bool,
        /// Who asked: the operator, or `mig-auto`.
        by: String,
        at_ms: u64,
    },
    /// The agent applied (or failed to apply) layout change `generation`
    /// of a GPU; `gpu` is the GPU as NVML has it afterwards.
    MigLayoutDone {
        agent_id: AgentId,
        generation: u64,
        gpu: GpuInfo,
        /// Why it failed; `None`: it succeeded.
        error: Option<String>,
    },
    /// Stop the current attempts of `victims` (jobs of lower priority) so
    /// that the queued `job_id` can run: their tasks are killed (SIGTERM,
    /// then SIGKILL after the agent's grace) and they go back to the queue
    /// (or end FAILED with `--no-requeue`). All victims or none.
    PreemptJobs {
        job_id: JobId,
        victims: Vec<JobId>,
        at_ms: u64,
    },
    /// Restart the running elastic gang `job_id` to grow it up to `to`
    /// ranks (the leader saw GPUs free for more): its ranks are stopped and
    /// it is queued again without using a retry.
    GrowJob {
        job_id: JobId,
        to: u32,
        at_ms: u64,
    },
    /// Each GPU's mean utilization and memory over the period starting at
    /// `at_ms` (the leader's clock, a multiple of `period_ms`), from its
    /// agent's heartbeats: kept as history, and charged as busy time to
    /// the task holding the GPU.
    RecordUtilization {
        at_ms: u64,
        period_ms: u64,
        points: Vec<super::util::UtilPoint>,
        /// Running jobs whose GPUs all stayed under this (percent) for
        /// `idle_window_ms` are flagged idle (the leader's settings, so
        /// that every master decides alike); 0: no detection.
        #[serde(default)]
        idle_window_ms: u64,
        #[serde(default)]
        idle_below_pct: u8,
    },
    /// Kill `task_ids` (keys) of framework `framework_id`, above its fair
    /// share, to give their resources to `for_framework`, below its own:
    /// the leader's reclaim between frameworks (`allocator::reclaim`), once
    /// the inverse offer's deadline passed. Tasks already ending are left
    /// as they are.
    ReclaimFrameworkTasks {
        framework_id: String,
        task_ids: Vec<String>,
        for_framework: String,
        at_ms: u64,
    },
    /// Stop the current attempts of `victims`, jobs of tenants over their
    /// fair share, so that the queued `job_id`, of a tenant below its own,
    /// can run (`scheduler::queue`'s reclaim): as a preemption, but across
    /// tenants, and only victims that have run `min_runtime_ms` by `at_ms`.
    ReclaimJobs {
        job_id: JobId,
        victims: Vec<JobId>,
        at_ms: u64,
        min_runtime_ms: u64,
    },
    /// A framework subscribes: new (empty id: apply assigns `fw-<n>`) or
    /// re-attaching with its id.
    SubscribeFramework {
        info: FrameworkInfo,
        at_ms: u64,
        /// A new framework's idempotency key (`requests::request_key`): a
        /// subscription sent again with it re-attaches to the framework
        /// the first one made instead of making a second.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request_id: Option<String>,
    },
    UpdateFramework {
        info: FrameworkInfo,
        at_ms: u64,
    },
    /// Teardown, or its failover timeout passed: its tasks are killed.
    RemoveFramework {
        framework_id: FrameworkId,
        reason: String,
        at_ms: u64,
    },
    /// Tasks a framework launches on offered resources. With `group`, all
    /// start or none does. A task that does not fit is recorded in ERROR
    /// with the reason; nothing else changes.
    LaunchFrameworkTasks {
        framework_id: FrameworkId,
        tasks: Vec<FrameworkTask>,
        group: bool,
        at_ms: u64,
    },
    KillTask {
        framework_id: FrameworkId,
        framework_task_id: String,
        at_ms: u64,
    },
    /// The framework acknowledged a status update.
    AcknowledgeUpdate {
        framework_id: FrameworkId,
        framework_task_id: String,
        uuid: Vec<u8>,
    },
    /// Finished jobs past the retention (`--job-retention`,
    /// `--job-retention-max`), chosen by the leader at `at_ms`: each goes
    /// with all its tasks. Apply re-checks each and skips one that is gone
    /// already, has not ended, changed after `at_ms`, or has a task still
    /// holding GPUs or resources (its agent has not confirmed the end).
    ForgetJobs {
        job_ids: Vec<JobId>,
        at_ms: u64,
    },
    /// Ended framework tasks past the retention whose framework
    /// acknowledged their last update (or is gone): removed. The same
    /// re-checks as `ForgetJobs`.
    ForgetFrameworkTasks {
        task_ids: Vec<TaskId>,
        at_ms: u64,
    },
    /// An admin created a token (or the leader put the bootstrap admin
    /// token in place). Refused if the id exists.
    CreateToken {
        record: super::access::TokenRecord,
        /// The create's request id, remembered so that a resend answers
        /// this token (absent: none, and in entries older than request ids).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request: Option<super::requests::TokenRequest>,
    },
    /// The token stops working (revoking twice keeps the first time).
    RevokeToken {
        id: String,
        at_ms: u64,
    },
    /// An agent joins with a join token: marks it used. Committed before
    /// the master signs the agent's certificate. `key` (hex SHA-256 of the
    /// public key the agent asks a certificate for; empty from older
    /// masters) names the request: the same request sent again, its answer
    /// lost, is let through once more ([`JOIN_RETRY_MS`]).
    UseJoinToken {
        id: String,
        agent_id: AgentId,
        at_ms: u64,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        key: String,
    },
    /// An admin sets a tenant's GPU quota (0: none).
    SetQuota {
        tenant: String,
        gpus: u32,
        /// GPUs it may borrow beyond its quota; `None`: unchanged.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        borrow: Option<u32>,
        /// Back to no borrowing limit (none beyond a quota).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        clear_borrow: bool,
        /// Its weight in the fair split; `None`: unchanged.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        weight: Option<u32>,
        /// Stop its jobs idle this long (ms); `None`: unchanged.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stop_idle_after_ms: Option<u64>,
        /// Never stop its idle jobs.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        clear_stop_idle: bool,
    },
    /// A service and its replicas' jobs (`gpuctl services create`); the
    /// same spec again is the create resent.
    CreateService {
        spec: gpuctl_core::types::ServiceSpec,
        at_ms: u64,
    },
    /// A service's replica count (`gpuctl services scale`).
    ScaleService {
        name: String,
        replicas: u32,
        at_ms: u64,
    },
    /// A service gone: its replicas stopped, its name free.
    DeleteService {
        name: String,
        at_ms: u64,
    },
    /// Replicas that left their service and whose drain is over (or that
    /// ended by themselves) are stopped and forgotten as draining.
    EndDrains {
        at_ms: u64,
    },
}

/// One task of a job placed on one agent with exact GPUs. A job of
/// `replicas` tasks (a gang) needs that many launches in one command, in
/// rank order.
/// A GPU's new health, as its agent's checks see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuHealthChange {
    pub uuid: GpuUuid,
    pub healthy: bool,
    /// Why it is unhealthy; empty when healthy.
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Launch {
    pub job_id: JobId,
    pub agent_id: AgentId,
    pub gpu_uuids: Vec<GpuUuid>,
}

/// What goes into a log entry's data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EncodedCommand {
    pub version: u32,
    pub command: Command,
}

/// [`EncodedCommand`] as written: the same JSON, without a copy of the
/// command.
#[derive(Serialize)]
struct EncodedRef<'a> {
    version: u32,
    command: &'a Command,
}

/// An entry's version alone, read when the whole would not decode: an
/// entry from a newer master may hold a command this one does not know.
#[derive(Deserialize)]
struct VersionOnly {
    version: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error(
        "command encoding version {0} is newer than this master understands ({COMMAND_VERSION})"
    )]
    UnknownVersion(u32),
    #[error("malformed command: {0}")]
    Malformed(#[from] serde_json::Error),
}

/// A command that could not be encoded: it is not proposed, and the
/// proposer hears why (an empty entry would have looked like a leader's
/// no-op and vanished).
#[derive(Debug, thiserror::Error)]
#[error("encoding a {kind} command: {source}")]
pub struct EncodeError {
    pub kind: &'static str,
    pub source: serde_json::Error,
}

impl Command {
    pub fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let enc = EncodedRef {
            version: COMMAND_VERSION,
            command: self,
        };
        serde_json::to_vec(&enc).map_err(|source| EncodeError {
            kind: self.kind(),
            source,
        })
    }

    /// The command of an entry of this master's version or older.
    pub fn decode(data: &[u8]) -> Result<Command, DecodeError> {
        match serde_json::from_slice::<EncodedCommand>(data) {
            Ok(enc) if enc.version <= COMMAND_VERSION => Ok(enc.command),
            Ok(enc) => Err(DecodeError::UnknownVersion(enc.version)),
            Err(e) => match serde_json::from_slice::<VersionOnly>(data) {
                Ok(v) if v.version > COMMAND_VERSION => Err(DecodeError::UnknownVersion(v.version)),
                _ => Err(DecodeError::Malformed(e)),
            },
        }
    }

    /// Short name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Command::RecordMasters { .. } => "record_masters",
            Command::RegisterAgent { .. } => "register_agent",
            Command::AgentLost { .. } => "agent_lost",
            Command::AgentUnreachable { .. } => "agent_unreachable",
            Command::AgentLostAfterTimeout { .. } => "agent_lost_after_timeout",
            Command::DrainAgent { .. } => "drain_agent",
            Command::UndrainAgent { .. } => "undrain_agent",
            Command::DrainDeadlinePassed { .. } => "drain_deadline_passed",
            Command::SubmitJob { .. } => "submit_job",
            Command::LaunchTasks { .. } => "launch_tasks",
            Command::LaunchJobs { .. } => "launch_jobs",
            Command::UpdateTaskStatus { .. } => "update_task_status",
            Command::CancelJob { .. } => "cancel_job",
            Command::PreemptJobs { .. } => "preempt_jobs",
            Command::GrowJob { .. } => "grow_job",
            Command::RecordUtilization { .. } => "record_utilization",
            Command::ReclaimJobs { .. } => "reclaim_jobs",
            Command::ReclaimFrameworkTasks { .. } => "reclaim_framework_tasks",
            Command::CordonGpu { .. } => "cordon_gpu",
            Command::SetMigLayout { .. } => "set_mig_layout",
            Command::ShareGpu { .. } => "share_gpu",
            Command::MigLayoutDone { .. } => "mig_layout_done",
            Command::SetGpuHealth { .. } => "set_gpu_health",
            Command::SubscribeFramework { .. } => "subscribe_framework",
            Command::UpdateFramework { .. } => "update_framework",
            Command::RemoveFramework { .. } => "remove_framework",
            Command::LaunchFrameworkTasks { .. } => "launch_framework_tasks",
            Command::KillTask { .. } => "kill_task",
            Command::AcknowledgeUpdate { .. } => "acknowledge_update",
            Command::ForgetJobs { .. } => "forget_jobs",
            Command::ForgetFrameworkTasks { .. } => "forget_framework_tasks",
            Command::CreateToken { .. } => "create_token",
            Command::RevokeToken { .. } => "revoke_token",
            Command::UseJoinToken { .. } => "use_join_token",
            Command::SetQuota { .. } => "set_quota",
            Command::CreateService { .. } => "create_service",
            Command::ScaleService { .. } => "scale_service",
            Command::DeleteService { .. } => "delete_service",
            Command::EndDrains { .. } => "end_drains",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain() -> Command {
        Command::DrainAgent {
            agent_id: "a1".into(),
            kill: false,
            deadline_ms: Some(5),
            at_ms: 1,
        }
    }

    #[test]
    fn an_entry_is_written_as_before_and_read_back() {
        let c = drain();
        let written = c.encode().unwrap();
        // The same JSON as the owned form, so older masters read it.
        let owned = serde_json::to_vec(&EncodedCommand {
            version: COMMAND_VERSION,
            command: c.clone(),
        })
        .unwrap();
        assert_eq!(written, owned);
        assert_eq!(Command::decode(&written).unwrap(), c);
    }

    #[test]
    fn a_newer_entry_is_told_apart_from_a_malformed_one() {
        let newer = COMMAND_VERSION + 1;
        // A command this master knows, in a newer entry.
        let mut known: serde_json::Value =
            serde_json::from_slice(&drain().encode().unwrap()).unwrap();
        known["version"] = newer.into();
        // A command it has never heard of, in a newer entry: the whole does
        // not decode, the version still does.
        let unknown =
            format!(r#"{{"version":{newer},"command":{{"ResizeEverything":{{"to":3}}}}}}"#);
        for data in [serde_json::to_vec(&known).unwrap(), unknown.into_bytes()] {
            match Command::decode(&data) {
                Err(DecodeError::UnknownVersion(v)) => assert_eq!(v, newer),
                other => panic!("expected UnknownVersion, got {other:?}"),
            }
        }
        // Not a newer version: malformed.
        for data in [
            format!(r#"{{"version":{COMMAND_VERSION},"command":{{"ResizeEverything":{{}}}}}}"#),
            "not json".to_string(),
            r#"{"command":{}}"#.to_string(),
        ] {
            assert!(
                matches!(
                    Command::decode(data.as_bytes()),
                    Err(DecodeError::Malformed(_))
                ),
                "{data}"
            );
        }
    }
}
