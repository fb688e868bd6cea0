//! Which nodes and GPUs a task may use at all: model globs, the GPU filter, the driver, users, security and constraints.

use super::*;

/// Case-insensitive glob: `*` matches any run (also empty), `?` one char.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    glob_chars(&lower(pattern), &lower(text))
}

pub(super) fn lower(s: &str) -> Vec<char> {
    s.chars().flat_map(char::to_lowercase).collect()
}

pub(super) fn glob_chars(p: &[char], t: &[char]) -> bool {
    let (mut pi, mut ti) = (0, 0);
    // Last '*' seen and the text position it is currently matched up to.
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        match p.get(pi) {
            Some('*') => {
                star = Some((pi, ti));
                pi += 1;
            }
            Some(&c) if c == '?' || c == t[ti] => {
                pi += 1;
                ti += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    pi = sp + 1;
                    ti = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// NVML names models with the vendor first ("NVIDIA A100-SXM4-40GB",
/// "Tesla V100-SXM2-16GB"); a pattern may leave it out ("A100*").
pub(super) fn strip_vendor(model: &str) -> Option<&str> {
    ["NVIDIA ", "Tesla "]
        .iter()
        .find_map(|v| model.strip_prefix(v))
        .map(str::trim_start)
}

/// Whether a GPU model matches a `--gpu-model` pattern: the glob on the
/// whole model name, or on the name without the vendor word.
pub fn model_matches(pattern: &str, model: &str) -> bool {
    glob_match(pattern, model) || strip_vendor(model).is_some_and(|m| glob_match(pattern, m))
}

/// The task's per-GPU filter (model glob, memory), with the glob's answer
/// remembered per model string: a cluster has few models and many GPUs.
pub(super) struct GpuFilter<'a> {
    model: Option<Vec<char>>,
    mem_min: u64,
    /// Whole GPUs, MIG devices of a profile, or a fraction of a shared GPU.
    wants: Wants<'a>,
    cache: Vec<(String, bool)>,
    /// GPUs (or MIG devices) the task may not be given now.
    avoid: Vec<String>,
}

impl<'a> GpuFilter<'a> {
    pub(super) fn new(req: &TaskRequest<'a>) -> Self {
        GpuFilter {
            model: req.gpu_model.map(lower),
            mem_min: req.gpu_mem_min_mib,
            wants: req.wants,
            cache: Vec::new(),
            avoid: req
                .avoid
                .iter()
                .filter(|a| a.until_ms > req.now_ms)
                .map(|a| a.uuid.clone())
                .collect(),
        }
    }

    /// Not a GPU the job avoids now.
    pub(super) fn allowed(&self, uuid: &str) -> bool {
        !self.avoid.iter().any(|a| a == uuid)
    }

    pub(super) fn model_ok(&mut self, model: &str) -> bool {
        let Some(p) = &self.model else {
            return true;
        };
        if let Some((_, ok)) = self.cache.iter().find(|(m, _)| m == model) {
            return *ok;
        }
        let ok = glob_chars(p, &lower(model))
            || strip_vendor(model).is_some_and(|m| glob_chars(p, &lower(m)));
        if self.cache.len() < 64 {
            self.cache.push((model.to_string(), ok));
        }
        ok
    }

    /// Model and memory; health is the caller's business.
    pub(super) fn matches(&mut self, g: &GpuInfo) -> bool {
        g.memory_mib >= self.mem_min && self.model_ok(&g.model)
    }

    /// A MIG device of the profile asked, with the memory, on a GPU of the
    /// model.
    pub(super) fn matches_mig(&mut self, parent: &GpuInfo, d: &MigDevice) -> bool {
        self.wants.mig() == Some(d.profile.as_str())
            && d.memory_mib >= self.mem_min
            && self.model_ok(&parent.model)
    }

    /// How many devices of the node match, busy or not, healthy or not
    /// ("could it ever fit"): MIG devices of the profile, or GPUs.
    pub(super) fn count_all(&mut self, node: &NodeView) -> usize {
        match self.wants {
            // The fractions its shared GPUs hold when none is held.
            Wants::Fraction(f) => node
                .free_shared
                .iter()
                .filter(|(g, _, _)| self.matches(g))
                .map(|(g, _, _)| fractions_in(g.memory_mib, 100, f))
                .sum(),
            Wants::Mig(_) => gpuctl_core::types::mig_devices_of(node.all_gpus)
                .filter(|(g, d)| self.matches_mig(g, d))
                .count(),
            Wants::Whole => node.all_gpus.iter().filter(|g| self.matches(g)).count(),
        }
    }

    /// How many matching devices of the node are free and healthy now
    /// (for a fraction: how many fractions its shared GPUs still hold).
    pub(super) fn count_free(&mut self, node: &NodeView) -> usize {
        match self.wants {
            Wants::Fraction(f) => node
                .free_shared
                .iter()
                .filter(|(g, _, _)| self.allowed(&g.uuid) && self.matches(g))
                .map(|(_, m, c)| fractions_in(*m, *c, f))
                .sum(),
            Wants::Mig(_) => node
                .free_mig
                .iter()
                .filter(|(g, d)| {
                    g.healthy
                        && self.allowed(&g.uuid)
                        && self.allowed(&d.uuid)
                        && self.matches_mig(g, d)
                })
                .count(),
            Wants::Whole => node
                .free_gpus
                .iter()
                .filter(|g| g.healthy && self.allowed(&g.uuid) && self.matches(g))
                .count(),
        }
    }
}

/// Runtime, security, constraints and driver.
pub(super) fn static_ok(req: &TaskRequest, node: &NodeView) -> bool {
    node.runtimes.contains(&req.runtime)
        && security_ok(req, node)
        && constraints_ok(req.constraints, node.attributes)
        && driver_ok(req, node)
}

/// The node's driver meets everything the job requires of it.
pub(super) fn driver_ok(req: &TaskRequest, node: &NodeView) -> bool {
    req.driver_requires().all(|e| e.met_by(&node.driver.facts))
}

/// The agent allows what the task's security asks: root, its mounts.
/// Whether `node` lets a job name `user`: each of its ids (0 is asked for
/// with `run_as_root`, not here) within the node's `allowed_users`, as the
/// agent checks before it starts the task.
pub(super) fn user_ok(user: UserIds, node: &NodeView) -> bool {
    node.allowed_users.is_none_or(|allowed| {
        [user.uid, user.gid]
            .iter()
            .all(|&id| id == 0 || allowed.contains(id))
    })
}

pub(super) fn security_ok(req: &TaskRequest, node: &NodeView) -> bool {
    (!req.run_as_root || node.allow_root_tasks)
        && req.user.is_none_or(|u| user_ok(u, node))
        && req
            .mounts
            .iter()
            .all(|m| path_within(node.allowed_mounts, &m.host_path))
        && req
            .checkpoint_dir
            .is_none_or(|p| path_within(node.allowed_mounts, p))
}

pub(super) fn constraints_ok(
    constraints: &BTreeMap<String, String>,
    attributes: &BTreeMap<String, String>,
) -> bool {
    constraints
        .iter()
        .all(|(k, pat)| attributes.get(k).is_some_and(|v| glob_match(pat, v)))
}

/// Whether a node satisfies the task's static requirements: runtime,
/// security, constraints, and enough GPUs of the model/memory among ALL its GPUs
/// (healthy or not, busy or not).
pub fn node_matches(req: &TaskRequest, node: &NodeView) -> bool {
    let n = req.devices_needed();
    let mut filter = GpuFilter::new(req);
    static_ok(req, node) && (n == 0 || filter.count_all(node) >= n)
}

/// Whether a GPU of this model and memory meets the task's model and
/// memory filters (a whole agent's, when all its GPUs are alike).
pub fn gpu_kind_matches(req: &TaskRequest, model: &str, memory_mib: u64) -> bool {
    let mut f = GpuFilter::new(req);
    memory_mib >= f.mem_min && f.model_ok(model)
}

/// Whether the node can take one task now: exactly the nodes
/// [`place_gang`] considers (resources, static requirements, enough free
/// matching devices).
pub fn takes_one(req: &TaskRequest, node: &NodeView) -> bool {
    let n = req.devices_needed();
    node.free.fits(&req.resources)
        && static_ok(req, node)
        && (n == 0 || GpuFilter::new(req).count_free(node) >= n)
}
