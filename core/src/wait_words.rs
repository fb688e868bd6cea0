//! Why a queued job waits: the master sends it as data
//! (`pb::WaitReason`, read here into the domain's [`Waiting`], whose serde
//! form is the JSON: `wait_reason` in `jobs get/list --json`, and the web
//! console's) and this is the one place it becomes words (gpuctl's `REASON`
//! column, `reason` in JSON, `jobs get`, `jobs wait`, the console's pages).
//! The words of each kind are listed in docs/scheduling.md.

use std::fmt;

use crate::pb;
use crate::wait::{
    AgentCounts, AgentIds, Dimension, GpuAsk, NeverFits, Requirement, SetAside, WaitReason, Waiting,
};

/// Scalar resources as JSON shows them (`jobs get --json`, the console):
/// a plain copy, none reading as zeros.
pub use crate::wait::resources as resources_of;

/// Why a queued job waits, as data, if the master sent one this build can
/// read (a kind it does not know reads as none).
pub fn wait_reason_data(j: &pb::Job) -> Option<Waiting> {
    (j.state == pb::JobState::JobQueued as i32)
        .then_some(j.wait_reason.as_ref())
        .flatten()
        .and_then(|w| Waiting::try_from(w).ok())
}

/// Why a queued job waits, in words; `None` for a job not queued. A master
/// older than `wait_reason` (or newer, with a kind this build does not
/// know) said it in words in the job's message: that is given then.
pub fn wait_reason_words(j: &pb::Job) -> Option<String> {
    if j.state != pb::JobState::JobQueued as i32 {
        return None;
    }
    match wait_reason_data(j) {
        Some(w) => Some(w.to_string()),
        None => (!j.message.is_empty()).then(|| j.message.clone()),
    }
}

/// A requirement as NVIDIA's own error names it: its first alternative,
/// and how many others (`cuda>=12.2 (+20 alternatives)`); the text as
/// given when this gpuctl cannot read it.
pub fn short_require(text: &str) -> String {
    crate::cuda_req::Expr::parse(text).map_or_else(|_| text.to_string(), |e| e.short())
}

fn shorts(requires: &[String]) -> String {
    requires
        .iter()
        .map(|r| short_require(r))
        .collect::<Vec<_>>()
        .join(" and ")
}

fn plural(n: impl Into<u64>) -> &'static str {
    if n.into() == 1 {
        ""
    } else {
        "s"
    }
}

impl GpuAsk {
    /// "8 GPUs of model A100* with at least 81920 MiB".
    fn words(&self) -> String {
        if let Some((m, pct)) = self.fraction {
            let compute = if pct > 0 {
                format!(" and {pct}% of compute")
            } else {
                String::new()
            };
            return format!(
                "a shared GPU{} with room for {m} MiB{compute}",
                self.of_model_with_mem()
            );
        }
        let mut s = match &self.mig {
            Some(p) => format!("{} MIG device{} {p}", self.count, plural(self.count)),
            None => format!("{} GPU{}", self.count, plural(self.count)),
        };
        s.push_str(&self.of_model_with_mem());
        s
    }

    fn of_model_with_mem(&self) -> String {
        let mut s = String::new();
        if let Some(m) = &self.model {
            s.push_str(&format!(" of model {m}"));
        }
        if self.mem_min_mib > 0 {
            s.push_str(&format!(" with at least {} MiB", self.mem_min_mib));
        }
        s
    }
}

impl Requirement {
    /// What no agent has: "has GPU model H100*" (after "no agent").
    fn missing(&self) -> String {
        match self {
            Requirement::Runtime(runtime) => format!("runs {runtime}"),
            Requirement::UnknownRuntime(n) => format!("runs {}", crate::convert::runtime_name(*n)),
            Requirement::Attribute { key, pattern } => {
                format!("has attribute {key}={pattern}")
            }
            Requirement::GpuModel(g) => {
                format!("has GPU model {}", g.model.as_deref().unwrap_or("*"))
            }
            Requirement::GpuMemory(g) => match &g.mig {
                Some(p) => format!("has a MIG device {p}{}", g.of_model_with_mem()),
                None => format!("has a GPU{}", g.of_model_with_mem()),
            },
            Requirement::Gpus(g) => format!("has {}", g.words()),
            Requirement::Cpus(cpus) => format!("has {cpus} cpus"),
            Requirement::Memory(mem_mib) => format!("has {mem_mib} MiB of memory"),
            Requirement::Ports(ports) => {
                format!("offers {ports} host ports (agent option --ports)")
            }
            Requirement::RootTasks => {
                "allows root tasks (agent option allow_root_tasks)".to_string()
            }
            Requirement::User(u) => {
                format!("lets jobs run as user {u} (agent option allowed_users)")
            }
            Requirement::Mount(path) => {
                format!("allows mounting {path} (agent option allowed_mounts)")
            }
            Requirement::Driver(d) => {
                format!("has a driver for {}", shorts(&d.requires))
            }
        }
    }

    /// The agents it leaves: "have zone=us-*" (after "among those that").
    fn qualifier(&self) -> String {
        match self {
            Requirement::Runtime(runtime) => format!("run {runtime}"),
            Requirement::UnknownRuntime(n) => format!("run {}", crate::convert::runtime_name(*n)),
            Requirement::Attribute { key, pattern } => format!("have {key}={pattern}"),
            Requirement::GpuModel(g) | Requirement::GpuMemory(g) | Requirement::Gpus(g) => {
                format!("have {}", g.words())
            }
            Requirement::Cpus(cpus) => format!("have {cpus} cpus"),
            Requirement::Memory(mem_mib) => format!("have {mem_mib} MiB of memory"),
            Requirement::Ports(ports) => format!("offer {ports} host ports"),
            Requirement::RootTasks => "allow root tasks".to_string(),
            Requirement::User(u) => format!("let jobs run as user {u}"),
            Requirement::Mount(path) => format!("allow mounting {path}"),
            Requirement::Driver(d) => {
                format!("have a driver for {}", shorts(&d.requires))
            }
        }
    }

    /// "newest: driver 525.60.13, CUDA 12.0" for a driver no agent has.
    fn newest(&self) -> Option<String> {
        let Requirement::Driver(d) = self else {
            return None;
        };
        let parts: Vec<String> = [("driver", &d.newest_driver), ("CUDA", &d.newest_cuda)]
            .into_iter()
            .filter_map(|(what, v)| v.as_ref().map(|v| format!("{what} {v}")))
            .collect();
        (!parts.is_empty()).then(|| format!("newest: {}", parts.join(", ")))
    }

    /// "at most 8" for the largest amount an agent has of it.
    fn at_most(&self, largest: f64) -> Option<String> {
        match self {
            Requirement::Gpus(_) | Requirement::Cpus(_) | Requirement::Ports(_) => {
                Some(format!("at most {largest}"))
            }
            Requirement::GpuMemory(_) | Requirement::Memory(_) => {
                Some(format!("at most {largest} MiB"))
            }
            _ => None,
        }
    }
}

impl AgentIds {
    /// "a1, a2, a3 and 2 more".
    fn words(&self) -> String {
        let more = (self.count as usize).saturating_sub(self.first.len());
        let mut s = self.first.join(", ");
        if more > 0 {
            s.push_str(&format!(" and {more} more"));
        }
        s
    }
}

impl SetAside {
    /// "not counting agents draining: a1; unreachable: a2", or `None`.
    fn words(&self) -> Option<String> {
        let parts: Vec<String> = [
            ("draining", &self.draining),
            ("unreachable", &self.unreachable),
        ]
        .into_iter()
        .filter(|(_, ids)| ids.count > 0)
        .map(|(what, ids)| format!("{what}: {}", ids.words()))
        .collect();
        (!parts.is_empty()).then(|| format!("not counting agents {}", parts.join("; ")))
    }
}

impl AgentCounts {
    /// "of 4 agents: 3 short of free GPUs, 1 too small", or `None`.
    fn words(&self) -> Option<String> {
        let parts: Vec<String> = [
            (self.exhausted_gpus, "short of free GPUs"),
            (self.exhausted_cpus, "short of free cpus"),
            (self.exhausted_memory, "short of free memory"),
            (self.exhausted_ports, "short of free ports"),
            (
                self.exhausted_shared_memory,
                "short of free GPU memory on shared GPUs",
            ),
            (
                self.exhausted_shared_compute,
                "short of free GPU compute on shared GPUs",
            ),
            (self.fit_one, "with room for one replica"),
            (self.filtered_runtime, "without the runtime"),
            (
                self.filtered_security,
                "not allowing its user, root or mounts",
            ),
            (self.filtered_constraints, "not matching the constraints"),
            (self.filtered_driver, "whose driver does not qualify"),
            (self.filtered_gpu_model, "without the GPU model"),
            (self.filtered_gpu_memory, "without a GPU with the memory"),
            (self.filtered_too_small, "too small"),
        ]
        .into_iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, what)| format!("{n} {what}"))
        .collect();
        (self.agents > 0 && !parts.is_empty()).then(|| {
            format!(
                "of {} agent{}: {}",
                self.agents,
                plural(self.agents),
                parts.join(", ")
            )
        })
    }
}

impl fmt::Display for WaitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitReason::NeverFits { why, set_aside } => {
                let mut notes = Vec::new();
                match why {
                    NeverFits::NoActiveAgent => write!(f, "no active agent")?,
                    NeverFits::Missing {
                        need,
                        among,
                        largest,
                    } => {
                        write!(f, "no agent {}", need.missing())?;
                        if !among.is_empty() {
                            let q: Vec<String> = among.iter().map(|r| r.qualifier()).collect();
                            write!(f, " among those that {}", q.join(" and "))?;
                        }
                        notes.extend(largest.and_then(|l| need.at_most(l)));
                        notes.extend(need.newest());
                    }
                    NeverFits::Gang { replicas, gpus } => write!(
                        f,
                        "the agents cannot hold {replicas} replicas of {gpus} GPU{} at once",
                        plural(*gpus)
                    )?,
                }
                notes.extend(set_aside.words());
                if !notes.is_empty() {
                    write!(f, " ({})", notes.join("; "))?;
                }
                Ok(())
            }
            WaitReason::Quota {
                used,
                asked,
                limit,
                over,
            } => {
                let parts: Vec<String> = over
                    .iter()
                    .map(|d| match d {
                        Dimension::Gpus => format!(
                            "{} GPUs in use + {} asked > {}",
                            used.gpus, asked.gpus, limit.gpus
                        ),
                        Dimension::Cpus => format!(
                            "{} cpus in use + {} asked > {}",
                            used.cpus, asked.cpus, limit.cpus
                        ),
                        Dimension::Memory => format!(
                            "{} MiB in use + {} asked > {}",
                            used.mem_mib, asked.mem_mib, limit.mem_mib
                        ),
                    })
                    .collect();
                write!(f, "Quota: the jobs role's quota: {}", parts.join(", "))
            }
            WaitReason::TenantQuota {
                tenant,
                quota,
                used,
                asked,
            } => write!(
                f,
                "Quota: tenant {tenant}'s GPU quota: {used} GPUs in use + {asked} asked > {quota} \
                 (gpuctl quota)"
            ),
            WaitReason::Starting => write!(f, "Scheduling: resources are free; starting it"),
            WaitReason::Backoff { until_ms } => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
                let left = until_ms.saturating_sub(now);
                write!(
                    f,
                    "Backoff: its last attempt failed; restarting it in {:.1}s (--restart-backoff)",
                    left as f64 / 1000.0
                )
            }
            WaitReason::Preempting {
                waiting_for_tasks,
                reclaim_from,
            } if reclaim_from.is_empty() => write!(
                f,
                "Preempting: waiting for {waiting_for_tasks} task{} of lower priority to stop",
                plural(*waiting_for_tasks)
            ),
            WaitReason::Preempting {
                waiting_for_tasks,
                reclaim_from,
            } => write!(
                f,
                "Reclaiming: waiting for {waiting_for_tasks} task{} of tenant{} {} (over their \
                 fair share) to stop",
                plural(*waiting_for_tasks),
                plural(reclaim_from.len() as u32),
                reclaim_from.join(", ")
            ),
            WaitReason::Priority {
                blocked_by,
                kept_for_preemption,
            } => {
                write!(
                    f,
                    "Priority: the free resources it fits go to jobs ahead of it \
                     (higher priority, or older)"
                )?;
                if let Some(by) = blocked_by {
                    write!(f, ", first {by}")?;
                    if *kept_for_preemption {
                        write!(f, " (kept for its preemption)")?;
                    }
                }
                Ok(())
            }
            WaitReason::Resources(busy) => {
                write!(f, "Resources: waiting for resources to be freed")?;
                if let Some(w) = busy.words() {
                    write!(f, " ({w})")?;
                }
                Ok(())
            }
        }
    }
}

/// One line, as `gpuctl jobs list` shows it under `REASON`.
impl fmt::Display for Waiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(r) = &self.requeued else {
            return write!(f, "{}", self.reason);
        };
        if let Some(by) = &r.preempted_by {
            write!(f, "PREEMPTED by {by}; ")?;
        }
        write!(f, "{}", self.reason)?;
        if r.retries > 0 {
            write!(f, " (retry {} of {}", r.retries, r.max_retries)?;
            if let Some(after) = &r.after {
                write!(f, " after {after}")?;
            }
            write!(f, ")")
        } else if let Some(after) = &r.after {
            write!(f, " (requeued after {after})")
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::wait_reason as wr;
    use wr::requirement::Kind as R;

    fn text(kind: wr::Kind, requeued: Option<wr::Requeued>) -> String {
        let w = pb::WaitReason {
            kind: Some(kind),
            requeued,
        };
        Waiting::try_from(&w).expect("a known kind").to_string()
    }

    fn req(kind: R) -> wr::Requirement {
        wr::Requirement {
            kind: kind as i32,
            ..Default::default()
        }
    }

    fn gpus(kind: R, n: u32, model: &str, mem: u64) -> wr::Requirement {
        wr::Requirement {
            gpus: n,
            gpu_model: model.into(),
            gpu_mem_min_mib: mem,
            ..req(kind)
        }
    }

    fn missing(
        need: wr::Requirement,
        among: Vec<wr::Requirement>,
        largest: Option<f64>,
        set_aside: Option<wr::SetAside>,
    ) -> wr::Kind {
        wr::Kind::NeverFits(wr::NeverFits {
            why: Some(wr::never_fits::Why::Missing(wr::Missing {
                need: Some(need),
                among,
                largest,
            })),
            set_aside,
        })
    }

    #[test]
    fn never_fits_names_what_no_agent_has() {
        let runtime = wr::Requirement {
            runtime: pb::Runtime::Docker as i32,
            ..req(R::Runtime)
        };
        assert_eq!(
            text(missing(runtime.clone(), vec![], None, None), None),
            "no agent runs docker"
        );
        let zone = wr::Requirement {
            key: "zone".into(),
            pattern: "us-*".into(),
            ..req(R::Attribute)
        };
        assert_eq!(
            text(missing(zone.clone(), vec![], None, None), None),
            "no agent has attribute zone=us-*"
        );
        assert_eq!(
            text(
                missing(gpus(R::GpuModel, 1, "H100*", 0), vec![runtime], None, None),
                None
            ),
            "no agent has GPU model H100* among those that run docker"
        );
        assert_eq!(
            text(
                missing(
                    gpus(R::GpuMemory, 4, "A100*", 98304),
                    vec![],
                    Some(81920.0),
                    None
                ),
                None
            ),
            "no agent has a GPU of model A100* with at least 98304 MiB (at most 81920 MiB)"
        );
        assert_eq!(
            text(
                missing(gpus(R::Gpus, 9, "", 0), vec![], Some(8.0), None),
                None
            ),
            "no agent has 9 GPUs (at most 8)"
        );
        assert_eq!(
            text(
                missing(gpus(R::Gpus, 8, "", 0), vec![zone], Some(4.0), None),
                None
            ),
            "no agent has 8 GPUs among those that have zone=us-* (at most 4)"
        );
        let cpus = wr::Requirement {
            cpus: 24.0,
            ..req(R::Cpus)
        };
        assert_eq!(
            text(
                missing(
                    cpus,
                    vec![gpus(R::Gpus, 8, "A100*", 81920)],
                    Some(16.0),
                    None
                ),
                None
            ),
            "no agent has 24 cpus among those that have 8 GPUs of model A100* \
             with at least 81920 MiB (at most 16)"
        );
        let mem = wr::Requirement {
            mem_mib: 1 << 20,
            ..req(R::Memory)
        };
        assert_eq!(
            text(missing(mem, vec![], Some(524288.0), None), None),
            "no agent has 1048576 MiB of memory (at most 524288 MiB)"
        );
        assert_eq!(
            text(missing(req(R::RootTasks), vec![], None, None), None),
            "no agent allows root tasks (agent option allow_root_tasks)"
        );
        let user = wr::Requirement {
            user: "3000:3000".into(),
            ..req(R::User)
        };
        assert_eq!(
            text(missing(user, vec![], None, None), None),
            "no agent lets jobs run as user 3000:3000 (agent option allowed_users)"
        );
        let mount = |p: &str| wr::Requirement {
            path: p.into(),
            ..req(R::Mount)
        };
        assert_eq!(
            text(
                missing(mount("/data/b"), vec![mount("/data/a")], None, None),
                None
            ),
            "no agent allows mounting /data/b (agent option allowed_mounts) \
             among those that allow mounting /data/a"
        );
    }

    /// `nvidia/cuda:12.2.0`'s NVIDIA_REQUIRE_CUDA, cut to two branches.
    const CUDA_12_2: &str = "cuda>=12.2 brand=tesla,driver>=470,driver<471 \
                             brand=tesla,driver>=525,driver<526";

    #[test]
    fn a_driver_no_agent_has_is_named_shortly_with_the_newest() {
        let driver = |requires: &[&str], newest: Option<(&str, &str)>| wr::Requirement {
            requires: requires.iter().map(|r| r.to_string()).collect(),
            newest_driver: newest.map(|n| n.0.to_string()).unwrap_or_default(),
            newest_cuda: newest.map(|n| n.1.to_string()).unwrap_or_default(),
            ..req(R::Driver)
        };
        assert_eq!(
            text(
                missing(
                    driver(&[CUDA_12_2], Some(("470.57.02", "11.4"))),
                    vec![],
                    None,
                    None
                ),
                None
            ),
            "no agent has a driver for cuda>=12.2 (+2 alternatives) \
             (newest: driver 470.57.02, CUDA 11.4)"
        );
        let runtime = wr::Requirement {
            runtime: pb::Runtime::Docker as i32,
            ..req(R::Runtime)
        };
        assert_eq!(
            text(
                missing(
                    gpus(R::Gpus, 8, "", 0),
                    vec![runtime, driver(&["driver>=535", CUDA_12_2], None)],
                    Some(4.0),
                    None
                ),
                None
            ),
            "no agent has 8 GPUs among those that run docker and have a driver for \
             driver>=535 and cuda>=12.2 (+2 alternatives) (at most 4)"
        );
        // Text this gpuctl cannot read is shown as it is.
        assert_eq!(
            text(
                missing(driver(&["cuda~12"], None), vec![], None, None),
                None
            ),
            "no agent has a driver for cuda~12"
        );
        let busy = wr::Kind::Resources(wr::Busy {
            agents: 3,
            exhausted_gpus: 1,
            filtered_driver: 2,
            ..Default::default()
        });
        assert_eq!(
            text(busy, None),
            "Resources: waiting for resources to be freed \
             (of 3 agents: 1 short of free GPUs, 2 whose driver does not qualify)"
        );
        // Back from an agent that refused it: said how.
        let refused = wr::Requeued {
            after: "task job-1.0 refused by agent a1: image cuda:12.2 requires ...".into(),
            ..Default::default()
        };
        assert!(text(
            missing(
                driver(&[CUDA_12_2], Some(("470.57.02", "11.4"))),
                vec![],
                None,
                None
            ),
            Some(refused)
        )
        .ends_with(
            "(requeued after task job-1.0 refused by agent a1: image cuda:12.2 requires ...)"
        ));
    }

    #[test]
    fn never_fits_without_agents_a_gang_and_agents_set_aside() {
        let set_aside = wr::SetAside {
            draining: Some(wr::AgentIds {
                first: vec!["a1".into(), "a2".into(), "a3".into()],
                count: 5,
            }),
            unreachable: Some(wr::AgentIds {
                first: vec!["b".into()],
                count: 1,
            }),
        };
        let none = wr::Kind::NeverFits(wr::NeverFits {
            why: Some(wr::never_fits::Why::NoActiveAgent(wr::NoActiveAgent {})),
            set_aside: Some(set_aside.clone()),
        });
        assert_eq!(
            text(none, None),
            "no active agent (not counting agents draining: a1, a2, a3 and 2 more; unreachable: b)"
        );
        let gang = wr::Kind::NeverFits(wr::NeverFits {
            why: Some(wr::never_fits::Why::Gang(wr::Gang {
                replicas: 3,
                gpus: 1,
            })),
            set_aside: None,
        });
        assert_eq!(
            text(gang, None),
            "the agents cannot hold 3 replicas of 1 GPU at once"
        );
        let draining_only = wr::SetAside {
            draining: Some(wr::AgentIds {
                first: vec!["a".into()],
                count: 1,
            }),
            unreachable: None,
        };
        assert_eq!(
            text(
                missing(
                    gpus(R::Gpus, 4, "", 0),
                    vec![],
                    Some(1.0),
                    Some(draining_only)
                ),
                None
            ),
            "no agent has 4 GPUs (at most 1; not counting agents draining: a)"
        );
    }

    #[test]
    fn the_other_kinds() {
        let res = |cpus, mem_mib, gpus| {
            Some(pb::Resources {
                cpus,
                mem_mib,
                gpus,
                ports: 0,
            })
        };
        let quota = wr::Kind::Quota(wr::Quota {
            used: res(3.0, 1024, 2),
            asked: res(1.5, 512, 2),
            limit: res(4.0, 1 << 20, 3),
            over: vec![wr::Dimension::Gpus as i32, wr::Dimension::Cpus as i32],
        });
        assert_eq!(
            text(quota, None),
            "Quota: the jobs role's quota: 2 GPUs in use + 2 asked > 3, \
             3 cpus in use + 1.5 asked > 4"
        );
        let quota = wr::Kind::Quota(wr::Quota {
            used: res(0.0, 4096, 0),
            asked: res(0.0, 2048, 0),
            limit: res(0.0, 5000, 0),
            over: vec![wr::Dimension::Memory as i32],
        });
        assert_eq!(
            text(quota, None),
            "Quota: the jobs role's quota: 4096 MiB in use + 2048 asked > 5000"
        );
        assert_eq!(
            text(wr::Kind::Starting(wr::Starting {}), None),
            "Scheduling: resources are free; starting it"
        );
        for (n, words) in [(1, "1 task"), (2, "2 tasks")] {
            let k = wr::Kind::Preempting(wr::Preempting {
                waiting_for_tasks: n,
                reclaim_from: vec![],
            });
            assert_eq!(
                text(k, None),
                format!("Preempting: waiting for {words} of lower priority to stop")
            );
        }
        let k = wr::Kind::Preempting(wr::Preempting {
            waiting_for_tasks: 4,
            reclaim_from: vec!["vision".into()],
        });
        assert_eq!(
            text(k, None),
            "Reclaiming: waiting for 4 tasks of tenant vision (over their fair share) to stop"
        );
        let prio = "Priority: the free resources it fits go to jobs ahead of it \
                    (higher priority, or older)";
        assert_eq!(
            text(wr::Kind::Priority(wr::Priority::default()), None),
            prio
        );
        let k = wr::Kind::Priority(wr::Priority {
            blocked_by: "job-7".into(),
            kept_for_preemption: false,
        });
        assert_eq!(text(k, None), format!("{prio}, first job-7"));
        let k = wr::Kind::Priority(wr::Priority {
            blocked_by: "job-7".into(),
            kept_for_preemption: true,
        });
        assert_eq!(
            text(k, None),
            format!("{prio}, first job-7 (kept for its preemption)")
        );
        assert_eq!(
            text(wr::Kind::Resources(wr::Busy::default()), None),
            "Resources: waiting for resources to be freed"
        );
        let busy = wr::Busy {
            agents: 7,
            filtered_runtime: 1,
            filtered_constraints: 1,
            filtered_gpu_model: 1,
            filtered_gpu_memory: 1,
            filtered_too_small: 1,
            exhausted_gpus: 1,
            exhausted_cpus: 0,
            exhausted_memory: 0,
            fit_one: 1,
            filtered_security: 1,
            filtered_driver: 0,
            exhausted_ports: 0,
            exhausted_shared_memory: 0,
            exhausted_shared_compute: 0,
        };
        assert_eq!(
            text(wr::Kind::Resources(busy), None),
            "Resources: waiting for resources to be freed (of 7 agents: 1 short of free GPUs, \
             1 with room for one replica, 1 without the runtime, 1 not allowing its user, root or mounts, \
             1 not matching the constraints, 1 without the GPU model, \
             1 without a GPU with the memory, 1 too small)"
        );
        let busy = wr::Busy {
            agents: 1,
            exhausted_cpus: 1,
            ..Default::default()
        };
        assert_eq!(
            text(wr::Kind::Resources(busy), None),
            "Resources: waiting for resources to be freed (of 1 agent: 1 short of free cpus)"
        );
        let busy = wr::Busy {
            agents: 2,
            exhausted_ports: 2,
            ..Default::default()
        };
        assert_eq!(
            text(wr::Kind::Resources(busy), None),
            "Resources: waiting for resources to be freed (of 2 agents: 2 short of free ports)"
        );
        // A fraction waits for room on shared GPUs, not for free GPUs.
        let busy = wr::Busy {
            agents: 3,
            exhausted_shared_memory: 2,
            exhausted_shared_compute: 1,
            ..Default::default()
        };
        assert_eq!(
            text(wr::Kind::Resources(busy), None),
            "Resources: waiting for resources to be freed (of 3 agents: 2 short of free GPU \
             memory on shared GPUs, 1 short of free GPU compute on shared GPUs)"
        );
    }

    #[test]
    fn requeued_jobs_say_how_they_came_back() {
        let starting = || wr::Kind::Starting(wr::Starting {});
        let requeued = |by: &str, retries, after: &str| {
            Some(wr::Requeued {
                preempted_by: by.into(),
                retries,
                max_retries: 2,
                after: after.into(),
            })
        };
        assert_eq!(
            text(
                starting(),
                requeued("", 1, "task job-1.0 exited with code 2")
            ),
            "Scheduling: resources are free; starting it \
             (retry 1 of 2 after task job-1.0 exited with code 2)"
        );
        assert_eq!(
            text(starting(), requeued("job-3", 1, "")),
            "PREEMPTED by job-3; Scheduling: resources are free; starting it (retry 1 of 2)"
        );
        assert_eq!(
            text(starting(), requeued("", 0, "GPU GPU-1 unhealthy")),
            "Scheduling: resources are free; starting it (requeued after GPU GPU-1 unhealthy)"
        );
        assert_eq!(
            text(starting(), requeued("job-3", 0, "")),
            "PREEMPTED by job-3; Scheduling: resources are free; starting it"
        );
    }

    #[test]
    fn json_is_tagged_by_kind() {
        let w = pb::WaitReason {
            kind: Some(missing(
                gpus(R::Gpus, 9, "A100*", 0),
                vec![],
                Some(8.0),
                None,
            )),
            requeued: Some(wr::Requeued {
                preempted_by: "job-3".into(),
                ..Default::default()
            }),
        };
        let j = Waiting::try_from(&w).unwrap();
        let v = serde_json::to_value(&j).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "kind": "never_fits",
                "why": {
                    "kind": "missing",
                    "need": {"kind": "gpus", "gpus": 9, "gpu_model": "A100*", "gpu_mem_min_mib": 0},
                    "among": [],
                    "largest": 8.0
                },
                "set_aside": {
                    "draining": {"first": [], "count": 0},
                    "unreachable": {"first": [], "count": 0}
                },
                "requeued": {"preempted_by": "job-3", "retries": 0, "max_retries": 0, "after": null}
            })
        );
        let v = serde_json::to_value(
            Waiting::try_from(&pb::WaitReason {
                kind: Some(wr::Kind::Preempting(wr::Preempting {
                    waiting_for_tasks: 2,
                    reclaim_from: vec![],
                })),
                requeued: None,
            })
            .unwrap(),
        )
        .unwrap();
        assert_eq!(
            v,
            serde_json::json!({"kind": "preempting", "waiting_for_tasks": 2, "requeued": null})
        );
    }

    #[test]
    fn an_unknown_kind_reads_as_none() {
        assert!(Waiting::try_from(&pb::WaitReason::default()).is_err());
        let w = pb::WaitReason {
            kind: Some(missing(req(R::Unspecified), vec![], None, None)),
            requeued: None,
        };
        assert!(Waiting::try_from(&w).is_err());
    }

    #[test]
    fn what_a_newer_master_adds_is_still_shown() {
        // A runtime this build does not know: named by its number.
        let mut r = req(R::Runtime);
        r.runtime = 99;
        let w = pb::WaitReason {
            kind: Some(missing(r, vec![], None, None)),
            requeued: None,
        };
        let j = Waiting::try_from(&w).unwrap();
        assert_eq!(j.to_string(), "no agent runs unknown(99)");
        assert_eq!(
            serde_json::to_value(&j).unwrap()["why"]["need"],
            serde_json::json!({"kind": "runtime", "runtime": "unknown(99)"})
        );
        // A quota dimension it does not know is left out; the others said.
        let q = pb::WaitReason {
            kind: Some(wr::Kind::Quota(wr::Quota {
                used: None,
                asked: Some(pb::Resources {
                    gpus: 2,
                    ..Default::default()
                }),
                limit: None,
                over: vec![wr::Dimension::Gpus as i32, 42],
            })),
            requeued: None,
        };
        let j = Waiting::try_from(&q).unwrap();
        assert_eq!(
            j.to_string(),
            "Quota: the jobs role's quota: 0 GPUs in use + 2 asked > 0"
        );
        assert_eq!(
            serde_json::to_value(&j).unwrap()["over"],
            serde_json::json!(["gpus"])
        );
    }
}
