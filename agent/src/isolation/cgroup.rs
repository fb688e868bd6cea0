//! Per-task cgroups (v1) through cgroups-rs, under
//! `<cgroup-root>/<controller>/<parent>/<task-id>`. The cgroup root is a
//! parameter (cgroups-rs' own hierarchies always read /proc/self/mountinfo).

use std::path::{Path, PathBuf};
use std::time::Duration;

use cgroups_rs::cpu::CpuController;
use cgroups_rs::devices::DevicesController;
use cgroups_rs::memory::MemController;
use cgroups_rs::pid::PidController;
use cgroups_rs::Controller;
use cgroups_rs::{Cgroup, Hierarchy, Subsystem};
use gpuctl_core::types::Resources;

use super::rules::DeviceRule;
use super::IsolationError;

/// The controllers gpuctl configures. Others (cpuset, blkio, ...) may get
/// directories from Docker under the task's cgroup; removal sweeps them too.
const CONTROLLERS: &[&str] = &["devices", "memory", "cpu", "pids"];

/// cgroup v1 rooted at a given directory (normally /sys/fs/cgroup).
#[derive(Debug, Clone)]
struct RootedV1 {
    root: PathBuf,
}

impl Hierarchy for RootedV1 {
    fn subsystems(&self) -> Vec<Subsystem> {
        let mut subs = Vec::new();
        for name in CONTROLLERS {
            let dir = self.root.join(name);
            if !dir.is_dir() {
                continue;
            }
            subs.push(match *name {
                "devices" => Subsystem::Devices(DevicesController::new(dir)),
                "memory" => Subsystem::Mem(MemController::new(dir, false)),
                "cpu" => Subsystem::Cpu(CpuController::new(dir, false)),
                _ => Subsystem::Pid(PidController::new(dir, false)),
            });
        }
        subs
    }

    fn root(&self) -> PathBuf {
        self.root.clone()
    }

    fn root_control_group(&self) -> Cgroup {
        Cgroup::load(Box::new(self.clone()), "")
    }

    fn parent_control_group(&self, path: &str) -> Cgroup {
        let parent = Path::new(path)
            .parent()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        Cgroup::load(Box::new(self.clone()), parent)
    }

    fn v2(&self) -> bool {
        false
    }
}

/// Which cgroup version a root holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    /// The unified hierarchy: device rules are eBPF programs there.
    V2,
    /// Neither (not mounted, or not a cgroup root).
    None,
}

/// Writes each rule, in order, as its own text (the kernel's format, the
/// rule's `Display`: what the tests check is what the kernel reads) to the
/// cgroup's `devices.allow` or `devices.deny`, one write per rule.
pub fn write_device_rules(dir: &Path, rules: &[DeviceRule]) -> Result<(), IsolationError> {
    use std::io::Write;
    for r in rules {
        let path = dir.join(if r.allow {
            "devices.allow"
        } else {
            "devices.deny"
        });
        let io = |source| IsolationError::Io {
            path: path.clone(),
            source,
        };
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(io)?;
        f.write_all(r.to_string().as_bytes()).map_err(io)?;
    }
    Ok(())
}

pub fn detect_version(root: &Path) -> CgroupVersion {
    if root.join("cgroup.controllers").is_file() {
        CgroupVersion::V2
    } else if root.join("devices").join("devices.allow").exists() {
        CgroupVersion::V1
    } else {
        CgroupVersion::None
    }
}

/// Creates and removes task cgroups under `<root>/<controller>/<parent>`.
#[derive(Debug, Clone)]
pub struct CgroupManager {
    root: PathBuf,
    parent: String,
}

/// A task's cgroup, as created.
#[derive(Debug, Clone)]
pub struct TaskCgroup {
    /// Relative path in every hierarchy: `<parent>/<task-id>`.
    pub rel: String,
    /// The `cgroup.procs` files a process writes itself into to join.
    pub procs_files: Vec<PathBuf>,
    /// Its directory on the unified hierarchy (cgroup v2); None on v1.
    /// What the driver's GPU memory cap is set on (`gpu::memcap`).
    pub unified_dir: Option<PathBuf>,
}

impl TaskCgroup {
    /// Docker's `--cgroup-parent` (cgroupfs driver): an absolute cgroup path.
    pub fn docker_parent(&self) -> String {
        format!("/{}", self.rel)
    }
}

fn cg_err(what: String) -> impl FnOnce(cgroups_rs::error::Error) -> IsolationError {
    move |e| IsolationError::Cgroup {
        what,
        reason: format!("{e}{}", e.source_text()),
    }
}

trait SourceText {
    fn source_text(&self) -> String;
}

impl SourceText for cgroups_rs::error::Error {
    fn source_text(&self) -> String {
        std::error::Error::source(self).map_or_else(String::new, |s| format!(": {s}"))
    }
}

impl CgroupManager {
    /// `parent` is one or more plain path components (`gpuctl`, `ci/gpuctl`).
    pub fn new(root: &Path, parent: &str) -> Result<CgroupManager, IsolationError> {
        Ok(CgroupManager {
            root: root.to_path_buf(),
            parent: check_parent(parent)?,
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn hierarchy(&self) -> Box<dyn Hierarchy> {
        Box::new(RootedV1 {
            root: self.root.clone(),
        })
    }

    /// Creates `<parent>/<task_id>` in every controller gpuctl uses, applies
    /// the device rules in order, the memory limit and the CPU weight.
    pub fn create(
        &self,
        task_id: &str,
        rules: &[DeviceRule],
        resources: &Resources,
        pids_max: Option<u64>,
    ) -> Result<TaskCgroup, IsolationError> {
        gpuctl_core::convert::check_id("task_id", task_id)
            .map_err(|e| IsolationError::Config(e.to_string()))?;
        let rel = format!("{}/{task_id}", self.parent);
        let cg = Cgroup::new(self.hierarchy(), &rel).map_err(cg_err(format!("create {rel}")))?;
        let result = self.configure(&cg, &rel, rules, resources, pids_max);
        if let Err(e) = result {
            // Nothing half made is left behind.
            let _ = self.remove(task_id);
            return Err(e);
        }
        let procs_files = CONTROLLERS
            .iter()
            .map(|c| self.root.join(c).join(&rel).join("cgroup.procs"))
            .filter(|p| p.exists())
            .collect();
        Ok(TaskCgroup {
            rel,
            procs_files,
            unified_dir: None,
        })
    }

    fn configure(
        &self,
        cg: &Cgroup,
        rel: &str,
        rules: &[DeviceRule],
        resources: &Resources,
        pids_max: Option<u64>,
    ) -> Result<(), IsolationError> {
        let devices: &DevicesController =
            cg.controller_of().ok_or_else(|| IsolationError::Cgroup {
                what: format!("{rel}: devices controller"),
                reason: format!("not mounted under {}", self.root.display()),
            })?;
        write_device_rules(devices.path(), rules)?;
        if resources.mem_mib > 0 {
            if let Some(mem) = cg.controller_of::<MemController>() {
                let bytes = (resources.mem_mib as i64).saturating_mul(1024 * 1024);
                mem.set_limit(bytes)
                    .map_err(cg_err(format!("{rel}: memory limit {bytes}")))?;
            }
        }
        if resources.cpus > 0.0 {
            if let Some(cpu) = cg.controller_of::<CpuController>() {
                // A weight, not a quota: idle CPUs stay usable; under
                // contention tasks share in proportion to what they asked.
                let shares = ((resources.cpus * 1024.0).round() as u64).max(2);
                cpu.set_shares(shares)
                    .map_err(cg_err(format!("{rel}: cpu shares {shares}")))?;
            }
        }
        // Hierarchical: a container in the task's cgroup counts too.
        if let (Some(n), Some(pids)) = (pids_max, cg.controller_of::<PidController>()) {
            let n = i64::try_from(n).unwrap_or(i64::MAX);
            pids.set_pid_max(cgroups_rs::MaxValue::Value(n))
                .map_err(cg_err(format!("{rel}: pids.max {n}")))?;
        }
        Ok(())
    }

    /// Removes the task's cgroup from every hierarchy under the root (also
    /// directories a container runtime made below it), deepest first. Retries
    /// briefly: the kernel refuses while the last processes are exiting.
    pub fn remove(&self, task_id: &str) -> Result<(), IsolationError> {
        let rel = format!("{}/{task_id}", self.parent);
        let mut last_err = None;
        for attempt in 0..40 {
            last_err = None;
            let entries = std::fs::read_dir(&self.root).map_err(|source| IsolationError::Io {
                path: self.root.clone(),
                source,
            })?;
            for entry in entries.flatten() {
                let dir = entry.path().join(&rel);
                if dir.is_dir() {
                    if let Err(e) = remove_tree(&dir) {
                        last_err = Some(e);
                    }
                }
            }
            if last_err.is_none() {
                return Ok(());
            }
            if attempt < 39 {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Err(last_err.unwrap_or_else(|| IsolationError::Config("unreachable".into())))
    }

    /// Removes every task cgroup under the parent, killing what still runs
    /// in them: what an earlier agent process (killed, crashed) left. Called
    /// at start, before any task of this process exists.
    /// Kills what is left in, and removes, every task cgroup under the
    /// parent except those of `keep` (tasks that still run, reattached by a
    /// restarted agent). Goes on past a cgroup it cannot remove (a busy
    /// container's) and reports the first failure at the end.
    pub fn remove_all_except(
        &self,
        keep: &std::collections::BTreeSet<String>,
    ) -> Result<usize, IsolationError> {
        let mut names = std::collections::BTreeSet::new();
        let entries = std::fs::read_dir(&self.root).map_err(|source| IsolationError::Io {
            path: self.root.clone(),
            source,
        })?;
        for entry in entries.flatten() {
            if let Ok(children) = std::fs::read_dir(entry.path().join(&self.parent)) {
                for c in children.flatten() {
                    if c.path().is_dir() {
                        names.insert(c.file_name().to_string_lossy().into_owned());
                    }
                }
            }
        }
        sweep(names.iter().filter(|n| !keep.contains(*n)), |name| {
            self.kill_all_in(name);
            self.remove(name)
        })
    }

    /// SIGKILLs every process in the task's cgroup (orphans of a crashed
    /// agent, strays of an ended task; a running task is stopped by its
    /// runtime, not here). Returns how many it signalled.
    pub fn kill_all_in(&self, task_id: &str) -> usize {
        // A process is listed in every hierarchy it is in: once is enough.
        let mut pids = std::collections::BTreeSet::new();
        for ctrl in CONTROLLERS {
            let procs = self
                .root
                .join(ctrl)
                .join(&self.parent)
                .join(task_id)
                .join("cgroup.procs");
            if let Ok(text) = std::fs::read_to_string(&procs) {
                pids.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
            }
        }
        sigkill_all(pids)
    }

    /// OOM kills in the task's memory cgroup (`memory.oom_control`).
    pub fn oom_kills(&self, task_id: &str) -> u64 {
        super::oom_kill_count(
            &self
                .root
                .join("memory")
                .join(&self.parent)
                .join(task_id)
                .join("memory.oom_control"),
        )
    }

    /// Whether any hierarchy still has the task's cgroup.
    pub fn exists(&self, task_id: &str) -> bool {
        let rel = format!("{}/{task_id}", self.parent);
        std::fs::read_dir(&self.root)
            .map(|entries| entries.flatten().any(|e| e.path().join(&rel).is_dir()))
            .unwrap_or(false)
    }
}

/// SIGKILLs each pid; how many it signalled.
pub(crate) fn sigkill_all(pids: std::collections::BTreeSet<i32>) -> usize {
    pids.into_iter()
        .filter(|pid| {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid),
                nix::sys::signal::Signal::SIGKILL,
            )
            .is_ok()
        })
        .count()
}

/// Kills and removes each stale task cgroup of `names` with
/// `kill_and_remove`, going on past one it cannot remove (a busy
/// container's); how many went, or the first failure at the end.
pub(crate) fn sweep<'a>(
    names: impl Iterator<Item = &'a String>,
    mut kill_and_remove: impl FnMut(&str) -> Result<(), IsolationError>,
) -> Result<usize, IsolationError> {
    let mut removed = 0;
    let mut first_err = None;
    for name in names {
        match kill_and_remove(name) {
            Ok(()) => removed += 1,
            Err(e) => {
                tracing::warn!(cgroup = %name, error = %e, "could not remove a stale task cgroup");
                first_err.get_or_insert(e);
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(removed),
    }
}

/// A cgroup parent as one or more plain path components, without slashes
/// at either end.
pub(crate) fn check_parent(parent: &str) -> Result<String, IsolationError> {
    let parent = parent.trim_matches('/').to_string();
    if parent.is_empty()
        || parent.split('/').any(|c| {
            c.is_empty()
                || c == "."
                || c == ".."
                || gpuctl_core::convert::check_id("cgroup_parent", c).is_err()
        })
    {
        return Err(IsolationError::Config(format!(
            "cgroup parent {parent:?} must be plain path components of [A-Za-z0-9._-]"
        )));
    }
    Ok(parent)
}

/// rmdir of a cgroup directory and its sub-cgroups (cgroupfs directories
/// hold only kernel files, so rmdir, not unlink, is what removes them).
pub(crate) fn remove_tree(dir: &Path) -> Result<(), IsolationError> {
    let io = |source| IsolationError::Io {
        path: dir.to_path_buf(),
        source,
    };
    for entry in std::fs::read_dir(dir).map_err(io)?.flatten() {
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            remove_tree(&entry.path())?;
        }
    }
    match std::fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(IsolationError::Io {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isolation::rules::{DeviceNode, HostDevices};

    const ROOT: &str = "/sys/fs/cgroup";

    fn v1_or_skip() -> bool {
        let ok = nix::unistd::Uid::effective().is_root()
            && detect_version(Path::new(ROOT)) == CgroupVersion::V1;
        if !ok {
            if std::env::var("GPUCTL_REQUIRE_DOCKER").as_deref() == Ok("1") {
                panic!("cgroup v1 and root are required here (GPUCTL_REQUIRE_DOCKER=1)");
            }
            eprintln!("skipped: needs root and cgroup v1 at {ROOT}");
        }
        ok
    }

    fn read(p: PathBuf) -> String {
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    #[test]
    fn parent_names_are_checked() {
        for bad in ["", "/", "../x", "a//b", "a b"] {
            assert!(CgroupManager::new(Path::new(ROOT), bad).is_err(), "{bad:?}");
        }
        assert!(CgroupManager::new(Path::new(ROOT), "/ci/gpuctl/").is_ok());
    }

    #[test]
    fn version_detection_reads_the_root() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(detect_version(dir.path()), CgroupVersion::None);
        std::fs::write(dir.path().join("cgroup.controllers"), "cpu memory\n").unwrap();
        assert_eq!(detect_version(dir.path()), CgroupVersion::V2);
    }

    #[test]
    fn creates_limits_and_removes_a_task_cgroup() {
        if !v1_or_skip() {
            return;
        }
        let parent = format!("gpuctl-test-{}", std::process::id());
        let m = CgroupManager::new(Path::new(ROOT), &parent).unwrap();
        let host = HostDevices {
            gpus: (0..2)
                .map(|i| {
                    (
                        i,
                        DeviceNode {
                            host_path: format!("/dev/nvidia{i}").into(),
                            container_path: format!("/dev/nvidia{i}"),
                            major: 195,
                            minor: i,
                        },
                    )
                })
                .collect(),
            control: vec![],
            caps: vec![],
        };
        let rules =
            crate::isolation::rules::task_rules(&host, &crate::isolation::TaskDevices::gpus(&[1]));
        let res = Resources {
            cpus: 1.5,
            mem_mib: 64,
            gpus: 1,
            ports: 0,
        };
        let t = m.create("t-1", &rules, &res, Some(77)).unwrap();
        let dir = |c: &str| Path::new(ROOT).join(c).join(&parent).join("t-1");
        assert_eq!(
            read(dir("memory").join("memory.limit_in_bytes")).trim(),
            "67108864"
        );
        assert_eq!(read(dir("cpu").join("cpu.shares")).trim(), "1536");
        if Path::new(ROOT).join("pids").is_dir() {
            assert_eq!(read(dir("pids").join("pids.max")).trim(), "77");
        }
        assert!(t.procs_files.iter().any(|p| p.starts_with(dir("devices"))));
        assert_eq!(t.docker_parent(), format!("/{parent}/t-1"));
        // A child in deny-by-default mode may allow its own GPU but the
        // kernel refuses to let it allow the GPU its parent denied.
        let child = dir("devices").join("probe");
        std::fs::create_dir(&child).unwrap();
        std::fs::write(child.join("devices.deny"), "a").unwrap();
        std::fs::write(child.join("devices.allow"), "c 195:1 rw").unwrap();
        assert!(std::fs::write(child.join("devices.allow"), "c 195:0 rw").is_err());
        let list = read(child.join("devices.list"));
        assert!(
            list.contains("c 195:1 rw") && !list.contains("c 195:0"),
            "{list}"
        );
        assert!(m.exists("t-1"));
        m.remove("t-1").unwrap();
        assert!(!m.exists("t-1"));
        for c in CONTROLLERS {
            let _ = std::fs::remove_dir(Path::new(ROOT).join(c).join(&parent));
        }
    }

    /// What the kernel reads is each rule's own text, one write per rule,
    /// to the file of its kind; checked without root on plain files.
    #[test]
    fn device_rules_are_written_as_their_own_text() {
        use crate::isolation::rules::{Access, DeviceKind};
        let dir = tempfile::tempdir().unwrap();
        for f in ["devices.allow", "devices.deny"] {
            std::fs::write(dir.path().join(f), "").unwrap();
        }
        let r = |allow, major, minor, access| DeviceRule {
            allow,
            kind: DeviceKind::Char,
            major,
            minor,
            access,
        };
        let rules = [
            r(false, Some(195), Some(1), Access::RW),
            r(true, Some(195), Some(0), Access::RWM),
            r(true, Some(508), None, Access::RWM),
        ];
        write_device_rules(dir.path(), &rules).unwrap();
        let read = |f: &str| std::fs::read_to_string(dir.path().join(f)).unwrap();
        assert_eq!(read("devices.deny"), "c 195:1 rw");
        assert_eq!(read("devices.allow"), "c 195:0 rwmc 508:* rwm");
        // A missing file (no devices controller) names the path.
        let err = write_device_rules(&dir.path().join("nope"), &rules).unwrap_err();
        assert!(err.to_string().contains("nope/devices.deny"), "{err}");
    }

    #[test]
    fn processes_left_in_an_ended_tasks_cgroup_are_killed_before_it_is_removed() {
        if !v1_or_skip() {
            return;
        }
        let parent = format!("gpuctl-test-strays-{}/agent-x", std::process::id());
        let m = CgroupManager::new(Path::new(ROOT), &parent).unwrap();
        let t = m
            .create("t-ended", &[], &Resources::default(), None)
            .unwrap();
        let mut stray = std::process::Command::new("sleep")
            .arg("300")
            .spawn()
            .unwrap();
        for f in &t.procs_files {
            std::fs::write(f, stray.id().to_string()).unwrap();
        }
        assert_eq!(m.kill_all_in("t-ended"), 1);
        assert!(!stray.wait().unwrap().success());
        m.remove("t-ended").unwrap();
        assert!(!m.exists("t-ended"));
        let top = parent.split('/').next().unwrap();
        for c in CONTROLLERS {
            let _ = std::fs::remove_dir(Path::new(ROOT).join(c).join(&parent));
            let _ = std::fs::remove_dir(Path::new(ROOT).join(c).join(top));
        }
    }

    #[test]
    fn stale_cgroups_of_an_earlier_agent_are_swept_and_their_processes_killed() {
        if !v1_or_skip() {
            return;
        }
        let parent = format!("gpuctl-test-stale-{}/agent-x", std::process::id());
        let m = CgroupManager::new(Path::new(ROOT), &parent).unwrap();
        let t = m.create("t-old", &[], &Resources::default(), None).unwrap();
        let mut orphan = std::process::Command::new("sleep")
            .arg("300")
            .spawn()
            .unwrap();
        for f in &t.procs_files {
            std::fs::write(f, orphan.id().to_string()).unwrap();
        }
        // A task a restarted agent reattached to keeps its cgroup.
        m.create("t-live", &[], &Resources::default(), None)
            .unwrap();
        let keep = std::collections::BTreeSet::from(["t-live".to_string()]);
        assert_eq!(m.remove_all_except(&keep).unwrap(), 1);
        assert!(!m.exists("t-old"));
        assert!(m.exists("t-live"));
        m.remove("t-live").unwrap();
        // The orphan was killed, not left running outside any task.
        let status = orphan.wait().unwrap();
        assert!(!status.success());
        assert_eq!(m.remove_all_except(&Default::default()).unwrap(), 0);
        let top = parent.split('/').next().unwrap();
        for c in CONTROLLERS {
            let _ = std::fs::remove_dir(Path::new(ROOT).join(c).join(&parent));
            let _ = std::fs::remove_dir(Path::new(ROOT).join(c).join(top));
        }
    }
}
