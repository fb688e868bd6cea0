//! Why a queued job waits, as data: what the master's queue pass
//! (`scheduler::queue`) found while it placed, in the spirit of Nomad's `AllocMetric` (what was
//! asked, what the agents have, which agents were left out for what).
//! The master never turns it into words: it goes on the wire as
//! `pb::WaitReason` (the conversions are here, in the pure core beside the
//! others) and the CLI renders it.

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;

use crate::convert::{runtime_from_pb, runtime_name, ConvertError};
use crate::pb;
use crate::pb::wait_reason as wr;
use crate::types::{AgentId, JobId, Resources, Runtime, UserIds};

/// Most tenants a reclaim names in a wait reason.
pub const MAX_RECLAIM_FROM: usize = 8;
/// Why one queued job waits, and how it came back to the queue. Its JSON
/// (`wait_reason` in `jobs get/list --json` and the console's) is its serde
/// form: the reason's fields tagged `kind`, beside `requeued`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Waiting {
    #[serde(flatten)]
    pub reason: WaitReason,
    /// `None` for a job never started.
    pub requeued: Option<Requeued>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WaitReason {
    /// No agent that takes tasks could ever run it, even idle.
    NeverFits {
        why: NeverFits,
        /// Agents left out because they take no new tasks now: the job
        /// might fit there.
        set_aside: SetAside,
    },
    /// Starting it would take the jobs role past its quota.
    Quota {
        /// What gpuctl's jobs hold (tasks being stopped aside).
        used: Resources,
        /// What this job asks, all replicas.
        asked: Resources,
        limit: Resources,
        /// Where `used + asked > limit`.
        over: Vec<Dimension>,
    },
    /// Starting it would take its tenant past its GPU quota.
    TenantQuota {
        tenant: String,
        quota: u32,
        used: u32,
        asked: u32,
    },
    /// The resources are free: it is being placed.
    Starting,
    /// Its last attempt failed: it is restarted after a pause
    /// (`--restart-backoff`), at `until_ms` (wall clock).
    Backoff { until_ms: u64 },
    /// Tasks of lower priority are being stopped for it, or tasks of other
    /// tenants over their fair share (`reclaim_from`, those tenants).
    Preempting {
        waiting_for_tasks: u32,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        reclaim_from: Vec<String>,
    },
    /// It fits in what is free, but jobs ahead of it (higher priority, or
    /// older) take that first.
    Priority {
        /// The first job ahead of it that takes resources on an agent where
        /// it would fit now (or that the agent is kept for).
        blocked_by: Option<JobId>,
        /// That agent is kept for `blocked_by`, which is preempting there.
        kept_for_preemption: bool,
    },
    /// Some agent could run it, but not with what is free now.
    Resources(AgentCounts),
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum NeverFits {
    NoActiveAgent,
    /// The first requirement (runtime, constraints, GPU model, GPU memory,
    /// GPU count, cpus, memory) that no agent meets.
    Missing {
        need: Requirement,
        /// Earlier requirements that narrowed the agents, when some agent
        /// meets `need` alone but none of those left. The GPU ones are
        /// named once, as [`Requirement::Gpus`]; none when `need` is one.
        among: Vec<Requirement>,
        /// The most one of those agents has of `need`, in its unit: GPUs,
        /// MiB of one GPU, cpus, MiB of memory. `None` for the kinds
        /// without an amount.
        largest: Option<f64>,
    },
    /// A gang the agents cannot hold at once (each replica alone fits).
    Gang {
        replicas: u32,
        gpus: u32,
    },
}

/// One requirement of a job's task. Its JSON is tagged `kind`, each
/// kind's amount under its own name (written by hand below: serde's tag
/// cannot carry a bare number or `Runtime`'s log form).
#[derive(Debug, Clone, PartialEq)]
pub enum Requirement {
    Runtime(Runtime),
    /// A runtime this build does not know, by its wire number: read from a
    /// newer master's reason only (placement never makes it), so that the
    /// reason is still shown ("runs unknown(N)").
    UnknownRuntime(i32),
    /// An agent attribute matching a glob.
    Attribute {
        key: String,
        pattern: String,
    },
    /// Some GPU of the model.
    GpuModel(GpuAsk),
    /// Some GPU of the model with the memory.
    GpuMemory(GpuAsk),
    /// All the GPUs asked, of the model, with the memory.
    Gpus(GpuAsk),
    /// Cpus in all.
    Cpus(f64),
    /// MiB of memory in all.
    Memory(u64),
    /// Host ports in all (the agent's `--ports` range).
    Ports(u32),
    /// Allows root host-process tasks (the agent's `allow_root_tasks`).
    RootTasks,
    /// Lets jobs name this user (the agent's `allowed_users`).
    User(UserIds),
    /// Allows mounting this host path (the agent's `allowed_mounts`).
    Mount(String),
    /// A driver that meets the job's `require_cuda` and its image's
    /// requirements.
    Driver(DriverAsk),
}

/// What a job needs of the NVIDIA driver: its `require_cuda` and its
/// image's requirements (NVIDIA_REQUIRE_* expressions), all to hold; as
/// the missing need, the newest an agent looked at has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverAsk {
    pub requires: Vec<String>,
    pub newest_driver: Option<String>,
    pub newest_cuda: Option<String>,
}

/// The GPUs one task asks for: each GPU requirement carries the whole ask,
/// which is what an agent that meets it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuAsk {
    pub count: u32,
    pub model: Option<String>,
    pub mem_min_mib: u64,
    /// MIG devices of this profile rather than whole GPUs.
    pub mig: Option<String>,
    /// A fraction of a shared GPU rather than GPUs: memory (MiB) and
    /// compute (percent, 0: none asked).
    pub fraction: Option<(u64, u32)>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SetAside {
    pub draining: AgentIds,
    pub unreachable: AgentIds,
}

/// Agents named in a reason: the first few and how many in all (a reason
/// is one line, and a cluster may drain a whole rack).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct AgentIds {
    pub first: Vec<AgentId>,
    pub count: u32,
}

impl AgentIds {
    /// How many ids are kept.
    pub const SHOWN: usize = 3;

    pub fn of<'a>(ids: impl IntoIterator<Item = &'a str>) -> AgentIds {
        let mut out = AgentIds::default();
        for id in ids {
            if out.first.len() < Self::SHOWN {
                out.first.push(id.to_string());
            }
            out.count = out.count.saturating_add(1);
        }
        out
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dimension {
    Gpus,
    Cpus,
    Memory,
}

/// Every agent that takes tasks, counted once for the first thing it
/// lacks (Nomad's "nodes filtered" and "dimension exhausted").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct AgentCounts {
    pub agents: u32,
    /// Left out whatever is free, by the requirement they fail.
    pub filtered_runtime: u32,
    pub filtered_constraints: u32,
    pub filtered_gpu_model: u32,
    pub filtered_gpu_memory: u32,
    /// Fewer GPUs of the model and memory, cpus or memory in all than one
    /// task asks.
    pub filtered_too_small: u32,
    /// Could run a task, but short of it now.
    pub exhausted_gpus: u32,
    pub exhausted_cpus: u32,
    pub exhausted_memory: u32,
    /// Could run a task, but short of free host ports now.
    pub exhausted_ports: u32,
    /// A fraction: could hold it, but its shared GPUs are short of free
    /// GPU memory, or of compute with the memory free, now (instead of
    /// `exhausted_gpus`).
    pub exhausted_shared_memory: u32,
    pub exhausted_shared_compute: u32,
    /// Could take one task now: a gang waits for room for all replicas.
    pub fit_one: u32,
    /// Left out whatever is free: they do not allow the job's `security`
    /// (root host-process tasks, a mount). Counted after the runtime.
    pub filtered_security: u32,
    /// Left out whatever is free: their driver does not meet what the job
    /// requires of it. Counted after the constraints.
    pub filtered_driver: u32,
}

/// How a job came back to the queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Requeued {
    pub preempted_by: Option<JobId>,
    /// Failed attempts started again so far.
    pub retries: u32,
    pub max_retries: u32,
    /// How its last attempt ended, when that is why it is back.
    pub after: Option<String>,
}

// ------------------------------------------------------------- as JSON

impl Serialize for Requirement {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        match self {
            Requirement::Runtime(r) => {
                m.serialize_entry("kind", "runtime")?;
                m.serialize_entry("runtime", &r.to_string())?;
            }
            Requirement::UnknownRuntime(n) => {
                m.serialize_entry("kind", "runtime")?;
                m.serialize_entry("runtime", &runtime_name(*n))?;
            }
            Requirement::Attribute { key, pattern } => {
                m.serialize_entry("kind", "attribute")?;
                m.serialize_entry("key", key)?;
                m.serialize_entry("pattern", pattern)?;
            }
            Requirement::GpuModel(g) => {
                m.serialize_entry("kind", "gpu_model")?;
                g.entries(&mut m)?;
            }
            Requirement::GpuMemory(g) => {
                m.serialize_entry("kind", "gpu_memory")?;
                g.entries(&mut m)?;
            }
            Requirement::Gpus(g) => {
                m.serialize_entry("kind", "gpus")?;
                g.entries(&mut m)?;
            }
            Requirement::Cpus(c) => {
                m.serialize_entry("kind", "cpus")?;
                m.serialize_entry("cpus", c)?;
            }
            Requirement::Memory(x) => {
                m.serialize_entry("kind", "memory")?;
                m.serialize_entry("mem_mib", x)?;
            }
            Requirement::Ports(p) => {
                m.serialize_entry("kind", "ports")?;
                m.serialize_entry("ports", p)?;
            }
            Requirement::RootTasks => m.serialize_entry("kind", "root_tasks")?,
            Requirement::User(u) => {
                m.serialize_entry("kind", "user")?;
                m.serialize_entry("user", &u.to_string())?;
            }
            Requirement::Mount(p) => {
                m.serialize_entry("kind", "mount")?;
                m.serialize_entry("path", p)?;
            }
            Requirement::Driver(d) => {
                m.serialize_entry("kind", "driver")?;
                m.serialize_entry("requires", &d.requires)?;
                m.serialize_entry("newest_driver", &d.newest_driver)?;
                m.serialize_entry("newest_cuda", &d.newest_cuda)?;
            }
        }
        m.end()
    }
}

impl GpuAsk {
    /// Its JSON fields: `gpus`, `gpu_model`, `gpu_mem_min_mib`, and `mig`,
    /// `gpu_fraction_mem_mib`, `gpu_fraction_compute_pct` when set.
    fn entries<M: SerializeMap>(&self, m: &mut M) -> std::result::Result<(), M::Error> {
        m.serialize_entry("gpus", &self.count)?;
        m.serialize_entry("gpu_model", &self.model)?;
        m.serialize_entry("gpu_mem_min_mib", &self.mem_min_mib)?;
        if let Some(p) = &self.mig {
            m.serialize_entry("mig", p)?;
        }
        if let Some((mem, pct)) = self.fraction {
            if mem > 0 {
                m.serialize_entry("gpu_fraction_mem_mib", &mem)?;
            }
            if pct > 0 {
                m.serialize_entry("gpu_fraction_compute_pct", &pct)?;
            }
        }
        Ok(())
    }
}

// ------------------------------------------------------------ to the wire

fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}

impl From<&Waiting> for pb::WaitReason {
    fn from(w: &Waiting) -> Self {
        let kind = match &w.reason {
            WaitReason::NeverFits { why, set_aside } => wr::Kind::NeverFits(wr::NeverFits {
                why: Some(match why {
                    NeverFits::NoActiveAgent => {
                        wr::never_fits::Why::NoActiveAgent(wr::NoActiveAgent {})
                    }
                    NeverFits::Missing {
                        need,
                        among,
                        largest,
                    } => wr::never_fits::Why::Missing(wr::Missing {
                        need: Some(need.into()),
                        among: among.iter().map(Into::into).collect(),
                        largest: *largest,
                    }),
                    NeverFits::Gang { replicas, gpus } => wr::never_fits::Why::Gang(wr::Gang {
                        replicas: *replicas,
                        gpus: *gpus,
                    }),
                }),
                set_aside: Some(wr::SetAside {
                    draining: Some((&set_aside.draining).into()),
                    unreachable: Some((&set_aside.unreachable).into()),
                }),
            }),
            WaitReason::Quota {
                used,
                asked,
                limit,
                over,
            } => wr::Kind::Quota(wr::Quota {
                used: Some((*used).into()),
                asked: Some((*asked).into()),
                limit: Some((*limit).into()),
                over: over
                    .iter()
                    .map(|d| wr::Dimension::from(*d) as i32)
                    .collect(),
            }),
            WaitReason::TenantQuota {
                tenant,
                quota,
                used,
                asked,
            } => wr::Kind::TenantQuota(wr::TenantQuota {
                tenant: tenant.clone(),
                quota: *quota,
                used: *used,
                asked: *asked,
            }),
            WaitReason::Starting => wr::Kind::Starting(wr::Starting {}),
            WaitReason::Backoff { until_ms } => wr::Kind::Backoff(wr::Backoff {
                until_ms: *until_ms,
            }),
            WaitReason::Preempting {
                waiting_for_tasks,
                reclaim_from,
            } => wr::Kind::Preempting(wr::Preempting {
                waiting_for_tasks: *waiting_for_tasks,
                reclaim_from: reclaim_from
                    .iter()
                    .take(MAX_RECLAIM_FROM)
                    .cloned()
                    .collect(),
            }),
            WaitReason::Priority {
                blocked_by,
                kept_for_preemption,
            } => wr::Kind::Priority(wr::Priority {
                blocked_by: blocked_by.clone().unwrap_or_default(),
                kept_for_preemption: *kept_for_preemption,
            }),
            WaitReason::Resources(c) => wr::Kind::Resources(wr::Busy {
                agents: c.agents,
                filtered_runtime: c.filtered_runtime,
                filtered_constraints: c.filtered_constraints,
                filtered_gpu_model: c.filtered_gpu_model,
                filtered_gpu_memory: c.filtered_gpu_memory,
                filtered_too_small: c.filtered_too_small,
                exhausted_gpus: c.exhausted_gpus,
                exhausted_cpus: c.exhausted_cpus,
                exhausted_memory: c.exhausted_memory,
                exhausted_ports: c.exhausted_ports,
                exhausted_shared_memory: c.exhausted_shared_memory,
                exhausted_shared_compute: c.exhausted_shared_compute,
                fit_one: c.fit_one,
                filtered_security: c.filtered_security,
                filtered_driver: c.filtered_driver,
            }),
        };
        pb::WaitReason {
            kind: Some(kind),
            requeued: w.requeued.as_ref().map(|r| wr::Requeued {
                preempted_by: r.preempted_by.clone().unwrap_or_default(),
                retries: r.retries,
                max_retries: r.max_retries,
                after: r.after.clone().unwrap_or_default(),
            }),
        }
    }
}

impl From<&Requirement> for wr::Requirement {
    fn from(r: &Requirement) -> Self {
        use wr::requirement::Kind;
        let gpus = |kind: Kind, g: &GpuAsk| wr::Requirement {
            kind: kind as i32,
            gpus: g.count,
            gpu_model: g.model.clone().unwrap_or_default(),
            gpu_mem_min_mib: g.mem_min_mib,
            mig: g.mig.clone().unwrap_or_default(),
            gpu_fraction_mem_mib: g.fraction.map_or(0, |f| f.0),
            gpu_fraction_compute_pct: g.fraction.map_or(0, |f| f.1),
            ..Default::default()
        };
        match r {
            Requirement::Runtime(rt) => wr::Requirement {
                kind: Kind::Runtime as i32,
                runtime: pb::Runtime::from(*rt) as i32,
                ..Default::default()
            },
            Requirement::UnknownRuntime(n) => wr::Requirement {
                kind: Kind::Runtime as i32,
                runtime: *n,
                ..Default::default()
            },
            Requirement::Attribute { key, pattern } => wr::Requirement {
                kind: Kind::Attribute as i32,
                key: key.clone(),
                pattern: pattern.clone(),
                ..Default::default()
            },
            Requirement::GpuModel(g) => gpus(Kind::GpuModel, g),
            Requirement::GpuMemory(g) => gpus(Kind::GpuMemory, g),
            Requirement::Gpus(g) => gpus(Kind::Gpus, g),
            Requirement::Cpus(cpus) => wr::Requirement {
                kind: Kind::Cpus as i32,
                cpus: *cpus,
                ..Default::default()
            },
            Requirement::Memory(mem_mib) => wr::Requirement {
                kind: Kind::Memory as i32,
                mem_mib: *mem_mib,
                ..Default::default()
            },
            Requirement::Ports(ports) => wr::Requirement {
                kind: Kind::Ports as i32,
                ports: *ports,
                ..Default::default()
            },
            Requirement::RootTasks => wr::Requirement {
                kind: Kind::RootTasks as i32,
                ..Default::default()
            },
            Requirement::User(u) => wr::Requirement {
                kind: Kind::User as i32,
                user: u.to_string(),
                ..Default::default()
            },
            Requirement::Mount(path) => wr::Requirement {
                kind: Kind::Mount as i32,
                path: path.clone(),
                ..Default::default()
            },
            Requirement::Driver(d) => wr::Requirement {
                kind: Kind::Driver as i32,
                requires: d.requires.clone(),
                newest_driver: d.newest_driver.clone().unwrap_or_default(),
                newest_cuda: d.newest_cuda.clone().unwrap_or_default(),
                ..Default::default()
            },
        }
    }
}

impl From<&AgentIds> for wr::AgentIds {
    fn from(a: &AgentIds) -> Self {
        wr::AgentIds {
            first: a.first.clone(),
            count: a.count,
        }
    }
}

impl From<Dimension> for wr::Dimension {
    fn from(d: Dimension) -> Self {
        match d {
            Dimension::Gpus => wr::Dimension::Gpus,
            Dimension::Cpus => wr::Dimension::Cpus,
            Dimension::Memory => wr::Dimension::Memory,
        }
    }
}

// ---------------------------------------------------------- from the wire

type Result<T> = std::result::Result<T, ConvertError>;

fn missing(field: &str) -> ConvertError {
    ConvertError::new(field, "missing")
}

/// Plain copies: a reason's amounts are the master's own, not checked as a
/// job's ask (a quota may be unbounded); none reads as zeros.
pub fn resources(r: Option<&pb::Resources>) -> Resources {
    let r = r.copied().unwrap_or_default();
    Resources {
        cpus: r.cpus,
        mem_mib: r.mem_mib,
        gpus: r.gpus,
        ports: r.ports,
    }
}

fn ids(a: Option<&wr::AgentIds>) -> AgentIds {
    a.map(|a| AgentIds {
        first: a.first.clone(),
        count: a.count,
    })
    .unwrap_or_default()
}

impl TryFrom<&wr::Requirement> for Requirement {
    type Error = ConvertError;

    fn try_from(r: &wr::Requirement) -> Result<Self> {
        use wr::requirement::Kind;
        let gpus = || GpuAsk {
            count: r.gpus,
            model: non_empty(&r.gpu_model),
            mem_min_mib: r.gpu_mem_min_mib,
            mig: (!r.mig.is_empty()).then(|| r.mig.clone()),
            fraction: (r.gpu_fraction_mem_mib > 0)
                .then_some((r.gpu_fraction_mem_mib, r.gpu_fraction_compute_pct)),
        };
        Ok(match Kind::try_from(r.kind) {
            Ok(Kind::Runtime) => match runtime_from_pb("runtime", r.runtime) {
                Ok(rt) => Requirement::Runtime(rt),
                Err(_) => Requirement::UnknownRuntime(r.runtime),
            },
            Ok(Kind::Attribute) => Requirement::Attribute {
                key: r.key.clone(),
                pattern: r.pattern.clone(),
            },
            Ok(Kind::GpuModel) => Requirement::GpuModel(gpus()),
            Ok(Kind::GpuMemory) => Requirement::GpuMemory(gpus()),
            Ok(Kind::Gpus) => Requirement::Gpus(gpus()),
            Ok(Kind::Cpus) => Requirement::Cpus(r.cpus),
            Ok(Kind::Memory) => Requirement::Memory(r.mem_mib),
            Ok(Kind::Ports) => Requirement::Ports(r.ports),
            Ok(Kind::RootTasks) => Requirement::RootTasks,
            Ok(Kind::User) => Requirement::User(
                r.user
                    .parse()
                    .map_err(|e: String| ConvertError::new("user", e))?,
            ),
            Ok(Kind::Mount) => Requirement::Mount(r.path.clone()),
            Ok(Kind::Driver) => Requirement::Driver(DriverAsk {
                requires: r.requires.clone(),
                newest_driver: non_empty(&r.newest_driver),
                newest_cuda: non_empty(&r.newest_cuda),
            }),
            Ok(Kind::Unspecified) | Err(_) => {
                return Err(ConvertError::new(
                    "kind",
                    format!("unknown requirement {}", r.kind),
                ))
            }
        })
    }
}

impl TryFrom<&pb::WaitReason> for Waiting {
    type Error = ConvertError;

    fn try_from(w: &pb::WaitReason) -> Result<Self> {
        let reason = match w.kind.as_ref().ok_or_else(|| missing("kind"))? {
            wr::Kind::NeverFits(n) => WaitReason::NeverFits {
                why: match n.why.as_ref().ok_or_else(|| missing("never_fits.why"))? {
                    wr::never_fits::Why::NoActiveAgent(_) => NeverFits::NoActiveAgent,
                    wr::never_fits::Why::Missing(m) => NeverFits::Missing {
                        need: m
                            .need
                            .as_ref()
                            .ok_or_else(|| missing("never_fits.missing.need"))?
                            .try_into()?,
                        among: m
                            .among
                            .iter()
                            .map(Requirement::try_from)
                            .collect::<Result<_>>()?,
                        largest: m.largest,
                    },
                    wr::never_fits::Why::Gang(g) => NeverFits::Gang {
                        replicas: g.replicas,
                        gpus: g.gpus,
                    },
                },
                set_aside: SetAside {
                    draining: ids(n.set_aside.as_ref().and_then(|s| s.draining.as_ref())),
                    unreachable: ids(n.set_aside.as_ref().and_then(|s| s.unreachable.as_ref())),
                },
            },
            wr::Kind::Quota(q) => WaitReason::Quota {
                used: resources(q.used.as_ref()),
                asked: resources(q.asked.as_ref()),
                limit: resources(q.limit.as_ref()),
                // A dimension this build does not know (a newer master's)
                // is left out, the others still said.
                over: q
                    .over
                    .iter()
                    .filter_map(|d| match wr::Dimension::try_from(*d) {
                        Ok(wr::Dimension::Gpus) => Some(Dimension::Gpus),
                        Ok(wr::Dimension::Cpus) => Some(Dimension::Cpus),
                        Ok(wr::Dimension::Memory) => Some(Dimension::Memory),
                        _ => None,
                    })
                    .collect(),
            },
            wr::Kind::TenantQuota(q) => WaitReason::TenantQuota {
                tenant: q.tenant.clone(),
                quota: q.quota,
                used: q.used,
                asked: q.asked,
            },
            wr::Kind::Starting(_) => WaitReason::Starting,
            wr::Kind::Backoff(b) => WaitReason::Backoff {
                until_ms: b.until_ms,
            },
            wr::Kind::Preempting(p) => WaitReason::Preempting {
                waiting_for_tasks: p.waiting_for_tasks,
                // As sent: the master bounds it (`MAX_RECLAIM_FROM`).
                reclaim_from: p.reclaim_from.clone(),
            },
            wr::Kind::Priority(p) => WaitReason::Priority {
                blocked_by: non_empty(&p.blocked_by),
                kept_for_preemption: p.kept_for_preemption,
            },
            wr::Kind::Resources(b) => WaitReason::Resources(AgentCounts {
                agents: b.agents,
                filtered_runtime: b.filtered_runtime,
                filtered_constraints: b.filtered_constraints,
                filtered_gpu_model: b.filtered_gpu_model,
                filtered_gpu_memory: b.filtered_gpu_memory,
                filtered_too_small: b.filtered_too_small,
                exhausted_gpus: b.exhausted_gpus,
                exhausted_cpus: b.exhausted_cpus,
                exhausted_memory: b.exhausted_memory,
                exhausted_ports: b.exhausted_ports,
                exhausted_shared_memory: b.exhausted_shared_memory,
                exhausted_shared_compute: b.exhausted_shared_compute,
                fit_one: b.fit_one,
                filtered_security: b.filtered_security,
                filtered_driver: b.filtered_driver,
            }),
        };
        Ok(Waiting {
            reason,
            requeued: w.requeued.as_ref().map(|r| Requeued {
                preempted_by: non_empty(&r.preempted_by),
                retries: r.retries,
                max_retries: r.max_retries,
                after: non_empty(&r.after),
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus(count: u32, model: Option<&str>, mem_min_mib: u64) -> GpuAsk {
        GpuAsk {
            count,
            model: model.map(String::from),
            mem_min_mib,
            mig: None,
            fraction: None,
        }
    }

    fn round_trip(w: Waiting) {
        let wire = pb::WaitReason::from(&w);
        // Through the bytes too: what the CLI decodes.
        let bytes = prost::Message::encode_to_vec(&wire);
        let decoded: pb::WaitReason = prost::Message::decode(bytes.as_slice()).expect("decodes");
        assert_eq!(Waiting::try_from(&decoded), Ok(w));
    }

    #[test]
    fn every_kind_round_trips_through_the_wire() {
        let set_aside = SetAside {
            draining: AgentIds::of(["a1", "a2", "a3", "a4"]),
            unreachable: AgentIds::of(["b"]),
        };
        assert_eq!(set_aside.draining.first, ["a1", "a2", "a3"]);
        assert_eq!(set_aside.draining.count, 4);
        let res = |cpus, mem_mib, gpus| Resources {
            cpus,
            mem_mib,
            gpus,
            ports: 0,
        };
        let requeued = Some(Requeued {
            preempted_by: Some("job-3".into()),
            retries: 1,
            max_retries: 2,
            after: Some("task job-1.0 exited with code 2".into()),
        });
        let reasons = [
            WaitReason::NeverFits {
                why: NeverFits::NoActiveAgent,
                set_aside: set_aside.clone(),
            },
            WaitReason::NeverFits {
                why: NeverFits::Missing {
                    need: Requirement::Cpus(24.5),
                    among: vec![
                        Requirement::Runtime(Runtime::Docker),
                        Requirement::Attribute {
                            key: "zone".into(),
                            pattern: "us-*".into(),
                        },
                        Requirement::Gpus(gpus(8, Some("A100*"), 81920)),
                    ],
                    largest: Some(16.0),
                },
                set_aside: SetAside::default(),
            },
            WaitReason::NeverFits {
                why: NeverFits::Missing {
                    need: Requirement::GpuModel(gpus(1, Some("H100*"), 0)),
                    among: vec![Requirement::Runtime(Runtime::Process)],
                    largest: None,
                },
                set_aside: SetAside::default(),
            },
            WaitReason::NeverFits {
                why: NeverFits::Missing {
                    need: Requirement::GpuMemory(gpus(2, None, 98304)),
                    among: vec![Requirement::Memory(1 << 20)],
                    largest: Some(81920.0),
                },
                set_aside: SetAside::default(),
            },
            WaitReason::NeverFits {
                why: NeverFits::Missing {
                    need: Requirement::Mount("/data/sets".into()),
                    among: vec![
                        Requirement::Runtime(Runtime::Process),
                        Requirement::RootTasks,
                        Requirement::User(UserIds {
                            uid: 3000,
                            gid: 3001,
                        }),
                    ],
                    largest: None,
                },
                set_aside: SetAside::default(),
            },
            WaitReason::NeverFits {
                why: NeverFits::Missing {
                    need: Requirement::Driver(DriverAsk {
                        requires: vec!["cuda>=12.2 driver>=470,driver<471".into()],
                        newest_driver: Some("525.60.13".into()),
                        newest_cuda: Some("12.0".into()),
                    }),
                    among: vec![
                        Requirement::Runtime(Runtime::Docker),
                        Requirement::Driver(DriverAsk {
                            requires: vec!["cuda>=11".into(), "driver>=450".into()],
                            newest_driver: None,
                            newest_cuda: None,
                        }),
                    ],
                    largest: None,
                },
                set_aside: SetAside::default(),
            },
            WaitReason::NeverFits {
                why: NeverFits::Gang {
                    replicas: 3,
                    gpus: 2,
                },
                set_aside,
            },
            WaitReason::Quota {
                used: res(2.0, 1024, 2),
                asked: res(1.5, 0, 3),
                limit: res(f64::MAX, u64::MAX, 2),
                over: vec![Dimension::Gpus, Dimension::Cpus, Dimension::Memory],
            },
            WaitReason::TenantQuota {
                tenant: "vision".into(),
                quota: 4,
                used: 3,
                asked: 2,
            },
            WaitReason::Starting,
            WaitReason::Preempting {
                waiting_for_tasks: 2,
                reclaim_from: Vec::new(),
            },
            WaitReason::Preempting {
                waiting_for_tasks: 3,
                reclaim_from: vec!["vision".into(), "nlp".into()],
            },
            WaitReason::Priority {
                blocked_by: None,
                kept_for_preemption: false,
            },
            WaitReason::Priority {
                blocked_by: Some("job-7".into()),
                kept_for_preemption: true,
            },
            WaitReason::Resources(AgentCounts {
                agents: 57,
                filtered_runtime: 1,
                filtered_constraints: 2,
                filtered_gpu_model: 3,
                filtered_gpu_memory: 4,
                filtered_too_small: 5,
                exhausted_gpus: 6,
                exhausted_cpus: 7,
                exhausted_memory: 8,
                fit_one: 9,
                filtered_security: 10,
                filtered_driver: 11,
                exhausted_ports: 12,
                exhausted_shared_memory: 13,
                exhausted_shared_compute: 14,
            }),
            WaitReason::NeverFits {
                why: NeverFits::Missing {
                    need: Requirement::Ports(4),
                    among: vec![Requirement::Memory(1024)],
                    largest: Some(2.0),
                },
                set_aside: SetAside::default(),
            },
        ];
        for reason in reasons {
            round_trip(Waiting {
                reason: reason.clone(),
                requeued: None,
            });
            round_trip(Waiting {
                reason,
                requeued: requeued.clone(),
            });
        }
    }

    #[test]
    fn what_the_wire_lacks_is_named() {
        let err = Waiting::try_from(&pb::WaitReason::default()).unwrap_err();
        assert_eq!(err.field, "kind");
        let mut w = pb::WaitReason::from(&Waiting {
            reason: WaitReason::NeverFits {
                why: NeverFits::Missing {
                    need: Requirement::Cpus(1.0),
                    among: Vec::new(),
                    largest: None,
                },
                set_aside: SetAside::default(),
            },
            requeued: None,
        });
        if let Some(wr::Kind::NeverFits(n)) = &mut w.kind {
            if let Some(wr::never_fits::Why::Missing(m)) = &mut n.why {
                m.need = Some(wr::Requirement::default());
            }
        }
        let err = Waiting::try_from(&w).unwrap_err();
        assert!(err.reason.contains("unknown requirement 0"), "{err}");
    }
}
