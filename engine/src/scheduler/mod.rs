//! The built-in job scheduler behind `gpuctl jobs`. Its decisions (this
//! module, [`placement`], [`queue`], [`topology`]) are PURE: they read a
//! state and return the launches and preemptions to propose; the master's
//! `scheduler::runner` is the loop that runs them against the leader's
//! offers, as a framework. The state machine re-checks every
//! command when it is applied, so a stale decision is refused there, never
//! double-booked.
//!
//! Queued jobs are taken highest priority first, then oldest; each is placed
//! by the engine in [`placement`] (bundle or spread, GPU model and memory,
//! agent attribute constraints, gangs all or nothing) with GPUs chosen by
//! interconnect ([`topology`]). A job that fits nowhere waits and does not
//! block smaller jobs behind it (backfill), except on agents where tasks are
//! being preempted for a job of higher priority: those are kept for it.
//! Which jobs to preempt, and why each queued job waits, is [`queue`]
//! (the why as data: `gpuctl_core::wait`).

pub mod elastic;
pub(crate) mod indexed;
pub mod mig_auto;
pub mod placement;
pub mod queue;
pub mod tenants;
pub mod topology;

use std::collections::{BTreeMap, BTreeSet};

use gpuctl_core::types::{
    devices, AgentId, GpuFraction, GpuInfo, Holding, JobId, JobSpec, PlacementPolicy, Resources,
};

use crate::state::{AgentRecord, JobRecord, Launch, State, Stopping};

/// What the scheduler may use on one agent: resources, exact GPUs and the
/// shared GPUs fractions may take (the built-in scheduler's offers).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Available {
    pub resources: Resources,
    pub gpus: Vec<String>,
    pub shared: Vec<String>,
}

/// The engine's policy for a job: its own, or the cluster's default.
pub fn policy_of(spec: &JobSpec, default: PlacementPolicy) -> PlacementPolicy {
    spec.placement.policy.unwrap_or(default)
}

/// What a job's task asks of the placement engine, at the leader's
/// `now_ms` (for the GPUs it avoids).
pub fn request(job: &JobRecord, now_ms: u64) -> placement::TaskRequest<'_> {
    let spec = &job.spec;
    placement::TaskRequest {
        resources: spec.template.resources,
        runtime: spec.runtime(),
        gpu_model: spec.placement.gpu_model.as_deref(),
        gpu_mem_min_mib: spec.placement.gpu_mem_min_mib,
        wants: spec.placement.wants(),
        constraints: &spec.placement.constraints,
        run_as_root: spec.template.security.run_as_root,
        // Checked when submitted: a user that does not parse names none.
        user: spec
            .template
            .security
            .user
            .as_deref()
            .and_then(|u| u.parse().ok()),
        mounts: &spec.template.security.mounts,
        checkpoint_dir: spec.template.checkpoint_dir.as_deref(),
        require_cuda: spec.require_cuda.as_ref(),
        image_requires: &job.image_requires,
        avoid: &job.avoid_gpus,
        now_ms,
    }
}

/// Free resources and GPUs per active agent, changed as a pass places
/// (takes) and preempts (gives back).
#[derive(Clone)]
pub(crate) struct Pool<'s> {
    nodes: BTreeMap<&'s str, PoolNode<'s>>,
    /// Views of all nodes, built once and then kept up to date node by
    /// node as the pool changes (rebuilding them all after every take made
    /// a pass over a big queue cost queue times agents).
    cache: Option<Vec<placement::NodeView<'s>>>,
    /// Where each node's view is in `cache` (the nodes' order).
    cache_at: std::collections::HashMap<&'s str, usize>,
    /// GPUs an operator took out of service: never given back to the pool.
    cordoned: &'s BTreeSet<String>,
}

/// Free memory (MiB) and compute (percent) of each usable shared GPU of a
/// node, by uuid: what fractions may still take.
type Shares<'s> = BTreeMap<&'s str, (u64, u32)>;

/// The shared GPUs of `a` that fractions may take now, with what their
/// fractions leave.
fn free_shares<'s>(state: &'s State, a: &'s AgentRecord) -> Shares<'s> {
    state
        .free_shares(a)
        .map(|s| (s.gpu.uuid.as_str(), (s.mem_mib, s.compute_pct)))
        .collect()
}

#[derive(Clone)]
pub(crate) struct PoolNode<'s> {
    pub agent: &'s AgentRecord,
    pub free: Resources,
    pub free_gpus: BTreeSet<&'s str>,
    /// Shared GPUs and what their fractions leave.
    pub shares: Shares<'s>,
}

impl<'s> Pool<'s> {
    /// What `available` (the offers) holds, on active agents.
    pub fn from_available(state: &'s State, available: &BTreeMap<String, Available>) -> Pool<'s> {
        let nodes = active_agents(state)
            .filter_map(|a| {
                let offered = available.get(&a.info.id)?;
                let free_gpus = devices(&a.info.gpus)
                    .filter(|d| {
                        state.device_schedulable(*d) && offered.gpus.iter().any(|u| u == d.uuid())
                    })
                    .map(|d| d.uuid())
                    .collect();
                Some((
                    a.info.id.as_str(),
                    PoolNode {
                        agent: a,
                        free: a.with_free_ports(offered.resources),
                        free_gpus,
                        // Only the shared GPUs offered to us: another
                        // framework may hold the others in its offer.
                        shares: free_shares(state, a)
                            .into_iter()
                            .filter(|(u, _)| offered.shared.iter().any(|o| o == u))
                            .collect(),
                    },
                ))
            })
            .collect();
        Pool {
            nodes,
            cache: None,
            cache_at: Default::default(),
            cordoned: state.cordoned(),
        }
    }

    /// What the state says is free, counting tasks being stopped
    /// (`kill_requested`) as gone already: they are.
    pub fn from_state(state: &'s State) -> Pool<'s> {
        let mut pool = Pool {
            nodes: active_agents(state)
                .map(|a| {
                    let free_gpus = devices(&a.info.gpus)
                        .filter(|d| state.device_free(*d))
                        .map(|d| d.uuid())
                        .collect();
                    (
                        a.info.id.as_str(),
                        PoolNode {
                            agent: a,
                            free: a.free(),
                            free_gpus,
                            shares: free_shares(state, a),
                        },
                    )
                })
                .collect(),
            cache: None,
            cache_at: Default::default(),
            cordoned: state.cordoned(),
        };
        for t in state
            .tasks()
            .values()
            .filter(|t| t.kill_requested && !t.state.is_terminal())
        {
            pool.give(&t.agent_id, &t.resources, t.holding());
        }
        pool
    }

    /// Engine views of the agents `usable` allows.
    pub fn views(&self, usable: &dyn Fn(&str) -> bool) -> Vec<placement::NodeView<'s>> {
        self.nodes
            .values()
            .filter(|n| usable(n.agent.info.id.as_str()))
            .map(|n| n.view())
            .collect()
    }

    /// Views of the agents `job` may use given the reservations.
    pub fn usable_views(
        &mut self,
        reserved: &BTreeMap<AgentId, (JobId, i32)>,
        job: &JobRecord,
    ) -> std::borrow::Cow<'_, [placement::NodeView<'s>]> {
        if !reserved.is_empty() {
            return std::borrow::Cow::Owned(self.views(&|id| may_use(reserved, job, id)));
        }
        if self.cache.is_none() {
            self.cache = Some(self.views(&|_| true));
            self.cache_at = self
                .nodes
                .keys()
                .enumerate()
                .map(|(i, id)| (*id, i))
                .collect();
        }
        std::borrow::Cow::Borrowed(self.cache.as_deref().unwrap_or_default())
    }

    pub fn node(&self, id: &str) -> Option<&PoolNode<'s>> {
        self.nodes.get(id)
    }

    /// Takes what a placement uses: resources, and its GPUs whole, or a
    /// fraction of its one shared GPU.
    pub fn take(&mut self, agent_id: &str, resources: &Resources, held: Holding<'_, GpuFraction>) {
        if let Some(n) = self.nodes.get_mut(agent_id) {
            n.take(resources, held);
        }
        self.refresh(agent_id);
    }

    /// A pool of these nodes.
    pub fn of_nodes(state: &'s State, nodes: BTreeMap<&'s str, PoolNode<'s>>) -> Pool<'s> {
        Pool {
            nodes,
            cache: None,
            cache_at: Default::default(),
            cordoned: state.cordoned(),
        }
    }

    /// Brings the cached view of one node up to date.
    fn refresh(&mut self, agent_id: &str) {
        let (Some(cache), Some(&i), Some(n)) = (
            self.cache.as_mut(),
            self.cache_at.get(agent_id),
            self.nodes.get(agent_id),
        ) else {
            return;
        };
        if let Some(v) = cache.get_mut(i) {
            *v = n.view();
        }
    }

    /// Gives back what a task held (only devices of the agent on healthy,
    /// uncordoned GPUs).
    pub fn give(&mut self, agent_id: &str, resources: &Resources, held: Holding<'_, GpuFraction>) {
        if let Some(n) = self.nodes.get_mut(agent_id) {
            n.free = n.free.add(resources);
            if let Some((gpu, f)) = held.fraction() {
                if let Some((m, c)) = n.shares.get_mut(gpu.as_str()) {
                    *m = m.saturating_add(f.mem_mib);
                    *c = c.saturating_add(f.compute_pct).min(100);
                }
            }
            let owned = held.owned();
            for d in devices(&n.agent.info.gpus).filter(|d| {
                let g = d.gpu();
                g.healthy && owned.iter().any(|u| u == d.uuid()) && !self.cordoned.contains(&g.uuid)
            }) {
                n.free_gpus.insert(d.uuid());
            }
        }
        self.refresh(agent_id);
    }
}

impl<'s> PoolNode<'s> {
    /// Takes what a placement uses: resources, and its GPUs whole, or a
    /// fraction of its one shared GPU.
    pub fn take(&mut self, resources: &Resources, held: Holding<'_, GpuFraction>) {
        self.free = self.free.saturating_sub(resources);
        if let Some((gpu, f)) = held.fraction() {
            if let Some((m, c)) = self.shares.get_mut(gpu.as_str()) {
                *m = m.saturating_sub(f.mem_mib);
                *c = c.saturating_sub(f.compute_pct);
            }
        }
        for g in held.owned() {
            self.free_gpus.remove(g.as_str());
        }
    }

    pub fn view(&self) -> placement::NodeView<'s> {
        let info = &self.agent.info;
        placement::NodeView {
            id: info.id.as_str(),
            attributes: &info.attributes,
            runtimes: &info.runtimes,
            allow_root_tasks: info.allow_root_tasks,
            allowed_mounts: &info.allowed_mounts,
            allowed_users: info.allowed_users.as_ref(),
            free: self.free,
            free_gpus: info
                .gpus
                .iter()
                .filter(|g| !g.mig.enabled && self.free_gpus.contains(g.uuid.as_str()))
                .collect::<Vec<&GpuInfo>>(),
            free_mig: gpuctl_core::types::mig_devices_of(&info.gpus)
                .filter(|(_, d)| self.free_gpus.contains(d.uuid.as_str()))
                .collect(),
            free_shared: info
                .gpus
                .iter()
                .filter_map(|g| {
                    let (m, c) = self.shares.get(g.uuid.as_str())?;
                    Some((g, *m, *c))
                })
                .collect(),
            all_gpus: &info.gpus,
            driver: placement::NodeDriver::new(
                info.driver_version.as_deref(),
                info.cuda_driver_version.as_deref(),
            ),
        }
    }
}

/// Agents that take new tasks: ACTIVE and not draining.
fn active_agents(state: &State) -> impl Iterator<Item = &AgentRecord> {
    state.agents().values().filter(|a| a.accepts_tasks())
}

/// Agents where tasks are being preempted for a queued job, with that job
/// and its priority (the highest, when several). Until the job starts they
/// are kept for it: nothing of lower or equal priority is placed there, so
/// what its victims free is not taken by somebody else.
pub fn reservations(state: &State) -> BTreeMap<AgentId, (JobId, i32)> {
    let mut out: BTreeMap<AgentId, (JobId, i32)> = BTreeMap::new();
    for victim in state.jobs().values() {
        let Some(Stopping::Preempted {
            by, reclaimed_for, ..
        }) = &victim.stopping
        else {
            continue;
        };
        let Some(preemptor) = state
            .job(by)
            .filter(|p| p.state == gpuctl_core::types::JobState::Queued && !p.cancel_requested)
        else {
            continue;
        };
        for t in victim
            .current_tasks()
            .iter()
            .filter_map(|t| state.task(t))
            .filter(|t| !t.state.is_terminal())
        {
            // What is reclaimed for a tenant is kept for its job alone: a
            // job of higher priority of the tenant it was taken from would
            // take it straight back.
            let p = if reclaimed_for.is_some() {
                i32::MAX
            } else {
                preemptor.spec.priority
            };
            match out.get(&t.agent_id) {
                Some((_, q)) if *q >= p => {}
                _ => {
                    out.insert(t.agent_id.clone(), (by.clone(), p));
                }
            }
        }
    }
    out
}

/// Whether `job` may be placed on `agent_id` given the reservations.
pub fn may_use(
    reserved: &BTreeMap<AgentId, (JobId, i32)>,
    job: &JobRecord,
    agent_id: &str,
) -> bool {
    reserved
        .get(agent_id)
        .is_none_or(|(by, p)| *by == job.id || *p < job.spec.priority)
}

/// Jobs alike in what they ask place alike: the key of what a job asks.
pub(crate) fn ask_key(job: &JobRecord) -> String {
    let spec = &job.spec;
    // Only what placement reads of `security`: root and the mounts' host
    // paths.
    let mounts: Vec<&str> = spec
        .template
        .security
        .mounts
        .iter()
        .map(|m| m.host_path.as_str())
        .collect();
    let driver: Vec<&str> = job.driver_requires().map(|e| e.text()).collect();
    // Every entry, expired or not: two jobs share a key only when they
    // avoid the same.
    let avoid: Vec<&str> = job.avoid_gpus.iter().map(|a| a.uuid.as_str()).collect();
    format!(
        "{:?}|{:?}|{:?}|{}:{}|{}|{:?}|{:?}|{:?}|{:?}",
        spec.template.resources,
        spec.runtime(),
        spec.placement,
        spec.min_replicas(),
        spec.replicas(),
        spec.template.security.run_as_root,
        mounts,
        spec.template.checkpoint_dir,
        driver,
        avoid
    )
}

/// Most launches the built-in scheduler places in one round of offers: it
/// bounds how long a round reads the state, and the size of the batch it
/// proposes; the jobs beyond wait for the next round (at once: the rest of
/// the round's offers are declined without a filter).
pub const MAX_LAUNCHES_PER_ROUND: usize = 2048;

/// Placements for queued jobs using exactly `available` (what the built-in
/// framework was offered): jobs in priority order, each placed by the
/// engine with its policy, constraints and GPU topology on what the jobs
/// before it left; a gang's `replicas` launches together, in rank order.
/// At most [`MAX_LAUNCHES_PER_ROUND`] launches (a gang is never cut).
/// Jobs in their restart backoff at `now_ms` (the leader's wall clock)
/// are left out.
pub fn place_in(
    state: &State,
    available: &BTreeMap<String, Available>,
    default_policy: PlacementPolicy,
    fair: bool,
    now_ms: u64,
) -> Vec<Launch> {
    let mut pool = Pool::from_available(state, available);
    place_on(state, &mut pool, default_policy, fair, now_ms)
}

/// Placements for queued jobs on what the state says is free, found
/// through the free-capacity index (`indexed`): the built-in scheduler's
/// own round when no other framework wants offers. The same placements as
/// [`place_in`] offered everything free, at a cost that does not grow with
/// the cluster for jobs of whole GPUs.
pub fn place_direct(
    state: &State,
    default_policy: PlacementPolicy,
    fair: bool,
    now_ms: u64,
) -> Vec<Launch> {
    let mut room = indexed::IndexRoom::new(state, default_policy);
    place_on(state, &mut room, default_policy, fair, now_ms)
}

/// Where a round's jobs may go, and what each placement takes from it:
/// the offers ([`Pool`]) or the free-capacity index
/// ([`indexed::IndexRoom`]).
pub(crate) trait Room<'s> {
    /// Views of the agents `job` may use (given the reservations), enough
    /// for the placement engine to choose as it would among all of them.
    fn views_for(
        &mut self,
        job: &JobRecord,
        reserved: &BTreeMap<AgentId, (JobId, i32)>,
    ) -> std::borrow::Cow<'_, [placement::NodeView<'s>]>;

    fn take(&mut self, agent_id: &str, resources: &Resources, held: Holding<'_, GpuFraction>);
}

impl<'s> Room<'s> for Pool<'s> {
    fn views_for(
        &mut self,
        job: &JobRecord,
        reserved: &BTreeMap<AgentId, (JobId, i32)>,
    ) -> std::borrow::Cow<'_, [placement::NodeView<'s>]> {
        self.usable_views(reserved, job)
    }

    fn take(&mut self, agent_id: &str, resources: &Resources, held: Holding<'_, GpuFraction>) {
        Pool::take(self, agent_id, resources, held);
    }
}

/// The round: jobs in queue order, each placed on what `room` holds.
fn place_on<'s>(
    state: &'s State,
    room: &mut impl Room<'s>,
    default_policy: PlacementPolicy,
    fair: bool,
    now_ms: u64,
) -> Vec<Launch> {
    let reserved = reservations(state);
    let mut out = Vec::new();
    // Asks (and priority) that found no room: what is free only shrinks
    // here, so a later job asking the same fails too, without placing.
    let mut misses = std::collections::HashSet::new();
    // GPUs of each tenant that has a limit (`gpuctl quota set`).
    let mut tenant_gpus: BTreeMap<String, u32> = if !state.has_tenant_limits() {
        BTreeMap::new()
    } else {
        tenants::usage(state)
            .into_iter()
            .map(|(t, u)| (t, u.gpus))
            .collect()
    };
    let shares = (fair && queue::may_reclaim(state)).then(|| tenants::fair_shares(state));
    for job in queue_order(state, shares.as_ref(), now_ms) {
        if out.len() >= MAX_LAUNCHES_PER_ROUND {
            break;
        }
        let tenant = job.spec.tenant.name();
        let gpus = tenants::job_quota_gpus(&job.spec);
        let mut quota_left = None;
        if let Some(cap) = state.tenant_cap(tenant) {
            let used = tenant_gpus.get(tenant).copied().unwrap_or(0);
            if gpus > 0 && used.saturating_add(gpus) > cap {
                continue;
            }
            quota_left = Some(cap.saturating_sub(used));
        }
        let most = tenants::ranks_within(&job.spec, quota_left);
        let preemptor = reserved.values().any(|(by, _)| *by == job.id);
        let miss = (!preemptor).then(|| (ask_key(job), job.spec.priority));
        if miss.as_ref().is_some_and(|m| misses.contains(m)) {
            continue;
        }
        let Some(placements) = placement::place_upto(
            &request(job, now_ms),
            job.spec.min_replicas(),
            most,
            &room.views_for(job, &reserved),
            policy_of(&job.spec, default_policy),
        ) else {
            misses.extend(miss);
            continue;
        };
        let placed = u32::try_from(placements.len()).unwrap_or(u32::MAX);
        *tenant_gpus.entry(tenant.to_string()).or_default() +=
            tenants::quota_gpus(&job.spec.template.resources, job.spec.placement.fraction)
                .saturating_mul(placed);
        for p in placements {
            room.take(
                &p.node,
                &job.spec.template.resources,
                Holding::of(&p.gpus, job.spec.placement.fraction.as_ref()),
            );
            out.push(Launch {
                job_id: job.id.clone(),
                agent_id: p.node,
                gpu_uuids: p.gpus,
            });
        }
    }
    out
}

/// Placements for as many queued jobs as fit on the agents' free resources
/// minus what is offered to frameworks (`offered_*`). The state's own view,
/// for tests.
pub fn place(
    state: &State,
    offered_gpus: &BTreeSet<String>,
    offered: &BTreeMap<String, Resources>,
) -> Vec<Launch> {
    place_with(state, offered_gpus, offered, false)
}

/// [`place`], with tenants below their fair share first when `fair`.
pub fn place_with(
    state: &State,
    offered_gpus: &BTreeSet<String>,
    offered: &BTreeMap<String, Resources>,
    fair: bool,
) -> Vec<Launch> {
    let available = available(state, offered_gpus, offered);
    // Tests: every backoff has passed.
    place_in(state, &available, PlacementPolicy::Bundle, fair, u64::MAX)
}

/// What each active agent has free, less what is offered to frameworks.
fn available(
    state: &State,
    offered_gpus: &BTreeSet<String>,
    offered: &BTreeMap<String, Resources>,
) -> BTreeMap<String, Available> {
    active_agents(state)
        .map(|a| {
            let o = offered.get(&a.info.id).copied().unwrap_or_default();
            let gpus = devices(&a.info.gpus)
                .filter(|d| state.gpu_owner(d.uuid()).is_none() && !offered_gpus.contains(d.uuid()))
                .map(|d| d.uuid().to_string())
                .collect();
            let shared = state
                .free_shares(a)
                .map(|s| s.gpu.uuid.clone())
                .filter(|u| !offered_gpus.contains(u))
                .collect();
            (
                a.info.id.clone(),
                Available {
                    resources: a.free().saturating_sub(&o),
                    gpus,
                    shared,
                },
            )
        })
        .collect()
}

/// The queued jobs in the order they are placed: by priority, then age
/// (`State::queued_jobs`); with fair shares (`shares`, reclaim on), the jobs
/// of tenants below their share first. Priorities order a tenant's own
/// jobs; across tenants the one further from its share goes first, so
/// that what is reclaimed for a tenant is not taken back by the tenant it
/// was reclaimed from.
pub fn queue_order<'s>(
    state: &'s State,
    shares: Option<&BTreeMap<String, tenants::FairShare>>,
    now_ms: u64,
) -> Vec<&'s JobRecord> {
    let mut q = state.queued_jobs();
    // Jobs in their restart backoff wait it out.
    q.retain(|j| j.not_before_ms <= now_ms);
    if let Some(shares) = shares {
        let below = |j: &JobRecord| {
            shares
                .get(j.spec.tenant.name())
                .is_some_and(|f| f.used < f.share)
        };
        // Stable: the order within each part stays.
        q.sort_by_key(|j| !below(j));
    }
    q
}

#[cfg(test)]
mod reclaim_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Command;
    use gpuctl_core::types::{AgentInfo, GpuInfo, JobSpec, Runtime};
    use gpuctl_core::wait as reason;

    fn agent(id: &str, gpus: u32, runtimes: Vec<Runtime>) -> Command {
        Command::RegisterAgent {
            info: AgentInfo {
                share_gpus: None,
                allowed_users: None,
                id: id.into(),
                hostname: id.into(),
                address: String::new(),
                total: Resources {
                    cpus: 16.0,
                    mem_mib: 65536,
                    gpus,
                    ports: 0,
                },
                gpus: (0..gpus)
                    .map(|i| GpuInfo::new(format!("GPU-{id}-{i}"), i, "A100", 40960))
                    .collect(),
                runtimes,
                simulated_gpus: true,
                attributes: Default::default(),
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

    fn job(gpus: u32, image: bool) -> Command {
        Command::SubmitJob {
            spec: JobSpec {
                placement: Default::default(),
                name: "j".into(),
                template: gpuctl_core::types::TaskTemplate {
                    image: image.then(|| "busybox".into()),
                    command: vec!["true".into()],
                    env: Default::default(),
                    resources: Resources {
                        cpus: 1.0,
                        mem_mib: 0,
                        gpus,
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

    /// [`job`] on host processes, its spec changed by `f`.
    fn job_with(gpus: u32, f: impl FnOnce(&mut JobSpec)) -> Command {
        let mut c = job(gpus, false);
        if let Command::SubmitJob { spec, .. } = &mut c {
            f(spec);
        }
        c
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
    fn a_round_in_one_entry_starts_each_job_whole_or_not_at_all() {
        let mut s = state(vec![
            agent("a", 4, both()),
            job(2, false),
            job(2, false),
            job(1, false),
        ]);
        let l = |job: &str, gpus: &[&str]| Launch {
            job_id: job.into(),
            agent_id: "a".into(),
            gpu_uuids: gpus.iter().map(|g| g.to_string()).collect(),
        };
        let before = s.clone();
        let out = s
            .apply(
                100,
                &Command::LaunchJobs {
                    jobs: vec![
                        vec![l("job-1", &["GPU-a-0", "GPU-a-1"])],
                        // GPU-a-1 is job-1's by now: refused, whole.
                        vec![l("job-2", &["GPU-a-1", "GPU-a-2"])],
                        vec![l("job-3", &["GPU-a-3"])],
                    ],
                    at_ms: 1,
                },
            )
            .unwrap();
        let crate::state::Outcome::JobsLaunched { refused } = out else {
            panic!("{out:?}");
        };
        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].0, "job-2");
        let state_of = |id: &str| s.job(id).unwrap().state;
        assert_eq!(state_of("job-1"), gpuctl_core::types::JobState::Starting);
        assert_eq!(state_of("job-3"), gpuctl_core::types::JobState::Starting);
        assert_eq!(state_of("job-2"), gpuctl_core::types::JobState::Queued);
        assert!(
            s.job("job-2").unwrap().task_ids.is_empty(),
            "nothing half applied"
        );
        assert_eq!(s.gpu_owner("GPU-a-2"), None);
        assert_eq!(s.queued_jobs().len(), 1);
        assert_ne!(s, before);
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
    fn a_round_places_at_most_its_cap_and_alike_misses_are_not_placed_again() {
        // 300 agents of 8 GPUs, 2,500 one-GPU jobs and then 500 of 9 GPUs
        // (fit nowhere: each found at once among the misses).
        let mut cmds: Vec<Command> = (0..300)
            .map(|i| agent(&format!("a{i:03}"), 8, both()))
            .collect();
        cmds.extend((0..2_500).map(|_| job(1, false)));
        cmds.extend((0..500).map(|_| job(9, false)));
        let s = state(cmds);
        let launches = place(&s, &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(launches.len(), MAX_LAUNCHES_PER_ROUND);
        // The first in the queue, each on a GPU of its own.
        let mut seen = BTreeSet::new();
        for (i, l) in launches.iter().enumerate() {
            assert_eq!(l.job_id, format!("job-{}", i + 1));
            assert!(l.gpu_uuids.iter().all(|g| seen.insert(g.clone())));
        }
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
        let a_or_b = s.tasks()["job-1.0"].agent_id.clone();
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
        assert_eq!(
            queue::wait_reason(&s, &Default::default(), "job-1").unwrap(),
            reason::Waiting {
                reason: reason::WaitReason::NeverFits {
                    why: reason::NeverFits::Missing {
                        need: reason::Requirement::Runtime(Runtime::Docker),
                        among: vec![],
                        largest: None,
                    },
                    set_aside: Default::default(),
                },
                requeued: None,
            }
        );
    }

    /// A root host-process job goes only to an agent that allows root
    /// tasks, and waits saying so when none does; alike jobs that differ
    /// in their security are not taken for each other's misses.
    #[test]
    fn root_jobs_go_only_to_agents_that_allow_them() {
        let root_job = || {
            let mut c = job(1, false);
            if let Command::SubmitJob { spec, .. } = &mut c {
                spec.template.security.run_as_root = true;
            }
            c
        };
        let mut allowing = agent("r", 2, both());
        if let Command::RegisterAgent { info, .. } = &mut allowing {
            info.allow_root_tasks = true;
        }
        let s = state(vec![agent("p", 2, both()), allowing, root_job()]);
        let l = place(&s, &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].agent_id, "r");

        // None allows it: it waits and says why; a plain job just like it
        // is placed all the same.
        let s = state(vec![agent("p", 2, both()), root_job(), job(1, false)]);
        let l = place(&s, &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].job_id, "job-2");
        assert_eq!(
            queue::wait_reason(&s, &Default::default(), "job-1")
                .unwrap()
                .reason,
            reason::WaitReason::NeverFits {
                why: reason::NeverFits::Missing {
                    need: reason::Requirement::RootTasks,
                    among: vec![],
                    largest: None,
                },
                set_aside: Default::default(),
            }
        );
    }

    #[test]
    fn a_job_too_big_waits_without_blocking_others() {
        let s = state(vec![agent("a", 2, both()), job(4, false), job(1, false)]);
        let l = place(&s, &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].job_id, "job-2");
        let why = queue::wait_reason(&s, &Default::default(), "job-1").unwrap();
        assert_eq!(
            why.reason,
            reason::WaitReason::NeverFits {
                why: reason::NeverFits::Missing {
                    need: reason::Requirement::Gpus(reason::GpuAsk {
                        count: 4,
                        model: None,
                        mem_min_mib: 0,
                        mig: None,
                        fraction: None,
                    }),
                    among: vec![],
                    largest: Some(2.0),
                },
                set_aside: Default::default(),
            }
        );
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

    /// A job requeued after a GPU failed is not placed on that GPU while
    /// the entry holds, even when it is the only one free; after, it is.
    #[test]
    fn a_job_is_not_placed_on_a_gpu_it_avoids() {
        use crate::state::testkit::status;
        use gpuctl_core::types::TaskState;
        let mut s = state(vec![agent("a", 2, both()), job(1, false)]);
        // It ran on GPU-a-0, which failed under it at 1000 ms (the agent
        // has not yet said the GPU is out).
        let launches = place(&s, &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(launches[0].gpu_uuids, vec!["GPU-a-0".to_string()]);
        s.apply(10, &Command::LaunchTasks { launches, at_ms: 0 })
            .unwrap();
        let mut failed = status("a", "job-1.0", TaskState::Failed);
        failed.gpu_unhealthy = true;
        failed.failed_gpus = vec!["GPU-a-0".into()];
        s.apply(
            11,
            &Command::UpdateTaskStatus {
                update: failed,
                at_ms: 1000,
            },
        )
        .unwrap();
        assert_eq!(
            s.job("job-1").unwrap().state,
            gpuctl_core::types::JobState::Queued
        );
        let at = |s: &State, now: u64| {
            place_in(
                s,
                &available(s, &BTreeSet::new(), &BTreeMap::new()),
                PlacementPolicy::Bundle,
                false,
                now,
            )
        };
        let l = at(&s, 1000);
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].gpu_uuids, vec!["GPU-a-1".to_string()]);
        // Only the avoided GPU is free: the job waits, until the entry
        // runs out.
        let a1_elsewhere = BTreeSet::from(["GPU-a-1".to_string()]);
        let offered_only = |s: &State, now: u64| {
            place_in(
                s,
                &available(s, &a1_elsewhere, &BTreeMap::new()),
                PlacementPolicy::Bundle,
                false,
                now,
            )
        };
        assert!(offered_only(&s, 1000).is_empty());
        let l = offered_only(&s, 1000 + crate::state::AVOID_GPU_MS);
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].gpu_uuids, vec!["GPU-a-0".to_string()]);
    }

    /// An elastic gang (2:4 of 1 GPU) takes as many ranks as fit, grows
    /// only into GPUs free for it (never before a queued job of its
    /// priority, never before `elastic_grow_after`), within its quota.
    #[test]
    fn an_elastic_gang_takes_what_fits_and_grows_into_free_gpus() {
        use crate::state::testkit::status;
        use gpuctl_core::types::TaskState;
        let elastic = |min: u32, max: u32, priority: i32| {
            job_with(1, |spec| {
                spec.replicas = max;
                spec.min_replicas = Some(min);
                spec.priority = priority;
            })
        };
        // 3 GPUs, a 1-GPU job holds one: the gang starts with 2 of 4.
        let mut s = state(vec![agent("a", 3, both()), job(1, false), elastic(2, 4, 0)]);
        let launches = place(&s, &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(launches.len(), 3);
        assert_eq!(launches.iter().filter(|l| l.job_id == "job-2").count(), 2);
        s.apply(
            10,
            &Command::LaunchTasks {
                launches,
                at_ms: 1_000,
            },
        )
        .unwrap();
        for t in ["job-1.0", "job-2.0", "job-2.1"] {
            let update = status("a", t, TaskState::Running);
            s.apply(
                11,
                &Command::UpdateTaskStatus {
                    update,
                    at_ms: 1_000,
                },
            )
            .unwrap();
        }
        assert_eq!(s.job("job-2").unwrap().world(), 2);
        let cfg = |now_ms: u64| queue::QueueConfig {
            elastic_grow_after_ms: Some(60_000),
            now_ms,
            ..Default::default()
        };
        // No GPU free: no growth.
        assert_eq!(elastic::growth(&s, &cfg(100_000)), None);
        let mut done = status("a", "job-1.0", TaskState::Finished);
        done.exit_code = Some(0);
        s.apply(
            12,
            &Command::UpdateTaskStatus {
                update: done,
                at_ms: 2_000,
            },
        )
        .unwrap();
        // One free: it may grow to 3, after it has run a minute, and not
        // while a queued job of its priority waits.
        assert_eq!(elastic::growth(&s, &cfg(30_000)), None, "too soon");
        assert_eq!(elastic::growth(&s, &cfg(61_000)), Some(("job-2".into(), 3)));
        let off = queue::QueueConfig {
            elastic_grow_after_ms: None,
            ..cfg(61_000)
        };
        assert_eq!(elastic::growth(&s, &off), None);
        s.apply(13, &job(2, false)).unwrap();
        assert_eq!(
            elastic::growth(&s, &cfg(61_000)),
            None,
            "a queued job comes first"
        );
        // A lower-priority one does not hold it back.
        let mut low = state(vec![]);
        std::mem::swap(&mut low, &mut s);
        let mut s = low;
        let Some(queued) = s.queued_jobs().first().map(|j| j.id.clone()) else {
            panic!("a queued job")
        };
        s.apply(
            14,
            &Command::CancelJob {
                job_id: queued,
                at_ms: 3_000,
            },
        )
        .unwrap();
        s.apply(15, &job_with(2, |spec| spec.priority = -1))
            .unwrap();
        assert_eq!(elastic::growth(&s, &cfg(61_000)), Some(("job-2".into(), 3)));
        // Growing: the GrowJob command, then the queue places 3.
        s.apply(
            16,
            &Command::GrowJob {
                job_id: "job-2".into(),
                to: 3,
                at_ms: 61_000,
            },
        )
        .unwrap();
        assert_eq!(elastic::growth(&s, &cfg(62_000)), None, "already stopping");
        for t in ["job-2.0", "job-2.1"] {
            let update = status("a", t, TaskState::Killed);
            s.apply(
                17,
                &Command::UpdateTaskStatus {
                    update,
                    at_ms: 62_000,
                },
            )
            .unwrap();
        }
        let launches = place(&s, &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(launches.iter().filter(|l| l.job_id == "job-2").count(), 3);
    }

    /// A failed attempt is restarted after its backoff (doubling), the
    /// queue says why it waits meanwhile, and `never` fails it at once.
    #[test]
    fn a_failed_job_restarts_after_its_backoff_and_never_means_never() {
        use crate::state::testkit::status;
        use gpuctl_core::types::{JobState, RestartPolicy, TaskState};
        let retried = |policy: RestartPolicy, retries: u32| {
            job_with(1, |spec| {
                spec.max_retries = retries;
                spec.restart_policy = policy;
                spec.restart_backoff_ms = Some(5_000);
            })
        };
        let mut s = state(vec![
            agent("a", 2, both()),
            retried(RestartPolicy::Gang, 2),
            retried(RestartPolicy::Never, 0),
        ]);
        let fail = |s: &mut State, task: &str, at_ms: u64| {
            let mut update = status("a", task, TaskState::Failed);
            update.exit_code = Some(1);
            s.apply(50, &Command::UpdateTaskStatus { update, at_ms })
                .unwrap();
        };
        let launch_at = |s: &mut State, now_ms: u64| {
            let launches = place_in(
                s,
                &available(s, &BTreeSet::new(), &BTreeMap::new()),
                PlacementPolicy::Bundle,
                false,
                now_ms,
            );
            let jobs: BTreeSet<String> = launches.iter().map(|l| l.job_id.clone()).collect();
            if !launches.is_empty() {
                s.apply(
                    40,
                    &Command::LaunchTasks {
                        launches,
                        at_ms: now_ms,
                    },
                )
                .unwrap();
            }
            jobs
        };
        assert_eq!(launch_at(&mut s, 1_000).len(), 2);
        fail(&mut s, "job-1.0", 10_000);
        fail(&mut s, "job-2.0", 10_000);
        assert_eq!(s.job("job-2").unwrap().state, JobState::Failed, "never");
        let j = s.job("job-1").unwrap();
        assert_eq!(
            (j.state, j.retries, j.not_before_ms),
            (JobState::Queued, 1, 15_000)
        );
        let retrying = j
            .events
            .iter()
            .find(|e| e.kind.as_str() == "Retrying")
            .unwrap();
        assert!(
            retrying.message.ends_with("retry 1 of 2 in 5s"),
            "{}",
            retrying.message
        );
        // Not before its backoff; the queue says so.
        assert!(launch_at(&mut s, 14_999).is_empty());
        let cfg = queue::QueueConfig {
            now_ms: 14_999,
            ..Default::default()
        };
        assert_eq!(
            queue::wait_reason(&s, &cfg, "job-1").unwrap().reason,
            reason::WaitReason::Backoff { until_ms: 15_000 }
        );
        assert_eq!(launch_at(&mut s, 15_000).len(), 1);
        // The second failure waits twice as long.
        fail(&mut s, "job-1.1", 20_000);
        assert_eq!(s.job("job-1").unwrap().not_before_ms, 30_000);
        assert!(launch_at(&mut s, 29_000).is_empty());
        assert_eq!(launch_at(&mut s, 30_000).len(), 1);
        assert_eq!(s.job("job-1").unwrap().not_before_ms, 0);
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
                    ports: 0,
                },
                gpus: vec!["GPU-b-2".into(), "GPU-b-3".into()],
                shared: Vec::new(),
            },
        )]);
        let l = place_in(&s, &available, PlacementPolicy::Bundle, false, u64::MAX);
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
        assert!(place_in(
            &s,
            &BTreeMap::new(),
            PlacementPolicy::Bundle,
            false,
            u64::MAX
        )
        .is_empty());
    }
}
