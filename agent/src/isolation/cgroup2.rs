//! Per-task cgroups on the unified hierarchy (cgroup v2), the way runc and
//! youki make them: `<root>/<parent>/<task-id>`, with the task's device
//! rules as a `BPF_PROG_TYPE_CGROUP_DEVICE` program attached before any
//! process joins, and `memory.max` and `cpu.weight` where those controllers
//! are available. The root is a parameter, so tests use a cgroup2 mounted
//! beside the machine's v1 hierarchy.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuctl_core::types::Resources;

use super::cgroup::{check_parent, remove_tree, sigkill_all, sweep, TaskCgroup};
use super::rules::DeviceRule;
use super::{bpf, bpf_load, IsolationError};

/// The controllers whose limits gpuctl sets, enabled for the task cgroups
/// where the hierarchy offers them (a controller bound to a v1 hierarchy
/// is not offered on v2).
const CONTROLLERS: &[&str] = &["memory", "cpu", "pids"];

/// cgroup v2's `cpu.weight` range; 100 is the default, one CPU's worth.
const WEIGHT_MIN: u64 = 1;
const WEIGHT_MAX: u64 = 10_000;
const WEIGHT_PER_CPU: f64 = 100.0;

#[derive(Debug, Clone)]
pub struct CgroupV2Manager {
    root: PathBuf,
    parent: String,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> IsolationError + '_ {
    move |source| IsolationError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The controllers a cgroup offers its children (`cgroup.controllers`).
fn offered(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("cgroup.controllers"))
        .map(|s| s.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// `cpu.weight` for a task asking for `cpus`: proportional, like the v1
/// shares (1024 per CPU there, 100 per CPU here).
pub fn cpu_weight(cpus: f64) -> u64 {
    ((cpus * WEIGHT_PER_CPU).round() as u64).clamp(WEIGHT_MIN, WEIGHT_MAX)
}

/// Writes the task's limits into its cgroup directory, for the controllers
/// that are enabled there (their interface files exist): `memory.max` in
/// bytes, `cpu.weight` (a weight, not a quota: idle CPUs stay usable, as
/// on v1), `pids.max` (processes and threads). A limit whose controller is
/// not enabled is not set.
pub fn write_limits(
    dir: &Path,
    resources: &Resources,
    pids_max: Option<u64>,
) -> Result<(), IsolationError> {
    let write = |file: &str, value: String| -> Result<(), IsolationError> {
        let path = dir.join(file);
        if !path.exists() {
            return Ok(());
        }
        std::fs::write(&path, value).map_err(io_err(&path))
    };
    if resources.mem_mib > 0 {
        let bytes = resources.mem_mib.saturating_mul(1024 * 1024);
        write("memory.max", bytes.to_string())?;
    }
    if resources.cpus > 0.0 {
        write("cpu.weight", cpu_weight(resources.cpus).to_string())?;
    }
    if let Some(n) = pids_max {
        write("pids.max", n.to_string())?;
    }
    Ok(())
}

impl CgroupV2Manager {
    /// `parent` is one or more plain path components (`gpuctl/agent-1`).
    pub fn new(root: &Path, parent: &str) -> Result<CgroupV2Manager, IsolationError> {
        Ok(CgroupV2Manager {
            root: root.to_path_buf(),
            parent: check_parent(parent)?,
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn dir(&self, task_id: &str) -> PathBuf {
        self.root.join(&self.parent).join(task_id)
    }

    /// The limit controllers the task cgroups get, as far as the root
    /// offers them.
    pub fn controllers(&self) -> Vec<String> {
        let offered = offered(&self.root);
        CONTROLLERS
            .iter()
            .filter(|c| offered.iter().any(|o| o == *c))
            .map(|c| c.to_string())
            .collect()
    }

    /// Makes the parent chain and enables the limit controllers in each
    /// level's `cgroup.subtree_control`, so a task's cgroup has them. The
    /// parents hold no process (v2 allows controllers only there).
    fn prepare_parents(&self) -> Result<(), IsolationError> {
        let mut dir = self.root.clone();
        let mut levels = vec![dir.clone()];
        for c in self.parent.split('/') {
            dir.push(c);
            levels.push(dir.clone());
        }
        std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        for level in &levels {
            let offered = offered(level);
            let control = level.join("cgroup.subtree_control");
            let enabled = std::fs::read_to_string(&control).unwrap_or_default();
            for c in CONTROLLERS {
                if !offered.iter().any(|o| o == c) || enabled.split_whitespace().any(|e| e == *c) {
                    continue;
                }
                // One write per controller: one the kernel refuses does not
                // keep the others off.
                if let Err(e) = std::fs::write(&control, format!("+{c}")) {
                    tracing::warn!(cgroup = %level.display(), controller = c, error = %e, "could not enable a cgroup controller; its limit is not set");
                }
            }
        }
        Ok(())
    }

    /// Creates the task's cgroup, sets its limits and attaches its device
    /// program (`rules`, first match decides, deny when none matches). A
    /// cgroup of the same name (left by a task that was not cleaned up) is
    /// emptied and made afresh: its program would hold other GPUs' rules.
    pub fn create(
        &self,
        task_id: &str,
        rules: &[DeviceRule],
        resources: &Resources,
        pids_max: Option<u64>,
    ) -> Result<TaskCgroup, IsolationError> {
        gpuctl_core::convert::check_id("task_id", task_id)
            .map_err(|e| IsolationError::Config(e.to_string()))?;
        self.prepare_parents()?;
        let dir = self.dir(task_id);
        if dir.exists() {
            self.kill_all_in(task_id);
            self.remove(task_id)?;
        }
        std::fs::create_dir(&dir).map_err(io_err(&dir))?;
        let result = write_limits(&dir, resources, pids_max).and_then(|()| {
            let prog = bpf_load::load(&bpf::program(rules, false))?;
            // The kernel keeps an attached program as long as the cgroup:
            // the descriptor may close, and a restarted agent finds its
            // running tasks still confined.
            bpf_load::attach(&prog, &dir)?;
            Ok(())
        });
        if let Err(e) = result {
            // Nothing half made is left behind.
            let _ = self.remove(task_id);
            return Err(e);
        }
        Ok(TaskCgroup {
            rel: format!("{}/{task_id}", self.parent),
            procs_files: vec![dir.join("cgroup.procs")],
            unified_dir: Some(dir),
        })
    }

    /// Removes the task's cgroup (and any below it). Retries briefly: the
    /// kernel refuses while the last processes are exiting.
    pub fn remove(&self, task_id: &str) -> Result<(), IsolationError> {
        let dir = self.dir(task_id);
        let mut last = Ok(());
        for attempt in 0..40 {
            if !dir.exists() {
                return Ok(());
            }
            last = remove_tree(&dir);
            if last.is_ok() {
                return Ok(());
            }
            if attempt < 39 {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        last
    }

    /// OOM kills in the task's cgroup and below (`memory.events`, which
    /// counts its descendants').
    pub fn oom_kills(&self, task_id: &str) -> u64 {
        super::oom_kill_count(&self.dir(task_id).join("memory.events"))
    }

    /// SIGKILLs every process in the task's cgroup and below; returns how
    /// many it signalled.
    pub fn kill_all_in(&self, task_id: &str) -> usize {
        let mut pids = std::collections::BTreeSet::new();
        collect_pids(&self.dir(task_id), &mut pids);
        sigkill_all(pids)
    }

    /// Kills what is left in, and removes, every task cgroup under the
    /// parent except those of `keep` (tasks a restarted agent reattached).
    pub fn remove_all_except(
        &self,
        keep: &std::collections::BTreeSet<String>,
    ) -> Result<usize, IsolationError> {
        let parent = self.root.join(&self.parent);
        let entries = match std::fs::read_dir(&parent) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(source) => {
                return Err(IsolationError::Io {
                    path: parent,
                    source,
                })
            }
        };
        let names: Vec<String> = entries
            .flatten()
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !keep.contains(n))
            .collect();
        sweep(names.iter(), |name| {
            self.kill_all_in(name);
            self.remove(name)
        })
    }

    pub fn exists(&self, task_id: &str) -> bool {
        self.dir(task_id).is_dir()
    }
}

fn collect_pids(dir: &Path, out: &mut std::collections::BTreeSet<i32>) {
    if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        out.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                collect_pids(&e.path(), out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_weight_is_proportional_and_in_range() {
        assert_eq!(cpu_weight(1.0), 100);
        assert_eq!(cpu_weight(2.5), 250);
        assert_eq!(cpu_weight(0.001), 1);
        assert_eq!(cpu_weight(1e9), 10_000);
    }

    #[test]
    fn limits_are_written_where_their_controller_is_enabled() {
        let d = tempfile::tempdir().unwrap();
        // Enabled controllers show their interface files.
        std::fs::write(d.path().join("memory.max"), "max\n").unwrap();
        let r = Resources {
            cpus: 2.0,
            mem_mib: 512,
            ..Default::default()
        };
        write_limits(d.path(), &r, Some(100)).unwrap();
        assert_eq!(
            std::fs::read_to_string(d.path().join("memory.max")).unwrap(),
            (512u64 * 1024 * 1024).to_string()
        );
        // cpu is not enabled: nothing made up.
        assert!(!d.path().join("cpu.weight").exists());
        assert!(!d.path().join("pids.max").exists());
        std::fs::write(d.path().join("cpu.weight"), "100\n").unwrap();
        std::fs::write(d.path().join("pids.max"), "max\n").unwrap();
        write_limits(d.path(), &r, Some(100)).unwrap();
        assert_eq!(
            std::fs::read_to_string(d.path().join("pids.max")).unwrap(),
            "100"
        );
        assert_eq!(
            std::fs::read_to_string(d.path().join("cpu.weight")).unwrap(),
            "200"
        );
    }

    #[test]
    fn parent_names_are_checked() {
        for bad in ["", "/", "../x", "a//b", "a b"] {
            assert!(
                CgroupV2Manager::new(Path::new("/x"), bad).is_err(),
                "{bad:?}"
            );
        }
    }
}
