//! GPU isolation: a task sees and can open exactly the GPUs it was given.
//!
//! - `grants`: what each GPU or MIG device UUID gives a task, in nodes;
//! - `rules`: device rules as plain data (kernel format) and a task's rule set;
//! - `devices`: the NVIDIA device nodes under `--dev-root` (MIG's caps too);
//! - `cgroup`: per-task cgroups (v1) through cgroups-rs;
//! - `cgroup2`, `bpf`, `bpf_load`: per-task cgroups on v2, with the device
//!   rules as an eBPF program.
//!
//! On cgroup v1 every task gets `<parent>/<task-id>` in the devices, memory,
//! cpu and pids hierarchies, denying every GPU that is not its own. Docker
//! containers are created inside it (`--cgroup-parent`), so the kernel keeps
//! them from the other GPUs whatever Docker allows; host processes join it
//! before they exec. On cgroup v2 a host-process task gets
//! `<parent>/<task-id>` with a device program gpuctl generates and attaches
//! before the process joins; containers get Docker's own device program
//! (only the devices passed are allowed). See docs/isolation.md.

pub mod bpf;
pub mod bpf_load;
pub mod cgroup;
pub mod cgroup2;
pub mod devices;
#[cfg(test)]
pub(crate) mod fake;
pub mod grants;
pub mod join;
pub mod probe;
pub mod rules;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use gpuctl_core::types::{Resources, Runtime};

pub use cgroup::{detect_version, CgroupManager, CgroupVersion, TaskCgroup};
pub use cgroup2::CgroupV2Manager;
pub use grants::{DeviceGrant, TaskDevices};
pub use rules::{DeviceNode, DeviceRule, HostDevices};

#[derive(Debug, thiserror::Error)]
pub enum IsolationError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cgroup {what}: {reason}")]
    Cgroup { what: String, reason: String },
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Unsupported(String),
    #[error(transparent)]
    Bpf(#[from] bpf_load::BpfError),
}

#[derive(Debug)]
enum Mode {
    V1(CgroupManager),
    /// Host processes get a cgroup of their own; containers Docker's.
    V2(CgroupV2Manager),
    /// No usable cgroups (not mounted, not root): only hosts without NVIDIA
    /// devices can run tasks then, as there is nothing to isolate.
    Unavailable(String),
}

/// What a task gets before its runtime starts it.
#[derive(Debug, Default)]
pub struct Prepared {
    /// Device nodes to pass into a container: the task's GPUs (a MIG
    /// device's parent), its MIG devices' caps and the control devices
    /// (none for a task without GPUs).
    pub devices: Vec<DeviceNode>,
    pub cgroup: Option<TaskCgroup>,
    /// Every NVIDIA node of the host (GPUs, caps and control nodes).
    pub host_nodes: Vec<PathBuf>,
}

/// What the executor needs of isolation. [`CgroupIsolator`] is the real
/// one; the executor's tests use `fake::FakeIsolator`.
pub trait Isolator: Send + Sync + std::fmt::Debug {
    /// One line for the agent's start-up log.
    fn describe(&self) -> String;
    fn dev_root(&self) -> &Path;
    /// Each task's limit of processes and threads, if any.
    fn pids_max(&self) -> Option<u64>;
    /// Prepares isolation for a task holding `task`'s GPUs and MIG devices.
    fn prepare(
        &self,
        task_id: &str,
        task: &TaskDevices,
        resources: &Resources,
        runtime: Runtime,
    ) -> Result<Prepared, IsolationError>;
    /// Removes what an earlier agent process left for tasks not in `keep`;
    /// returns how many.
    fn remove_stale(&self, keep: &BTreeSet<String>) -> Result<usize, IsolationError>;
    /// Removes what `prepare` made, once the task has ended. Idempotent.
    fn release(&self, task_id: &str) -> Result<(), IsolationError>;
    /// How many processes of the task the kernel's OOM killer has killed
    /// (its memory cgroup's count); read before `release`. 0 when unknown.
    fn oom_kills(&self, _task_id: &str) -> u64 {
        0
    }
}

/// Per-task cgroups (v1, or v2 with a device program) and device nodes.
#[derive(Debug)]
pub struct CgroupIsolator {
    dev_root: PathBuf,
    mode: Mode,
    /// Each task's `pids.max` (processes and threads); `None`: unlimited.
    pids_max: Option<u64>,
}

impl CgroupIsolator {
    /// `privileged`: whether this process may manage cgroups (root); the
    /// caller decides, so that tests and the agent say it the same way.
    pub fn new(
        cgroup_root: &Path,
        parent: &str,
        dev_root: &Path,
        privileged: bool,
    ) -> Result<CgroupIsolator, IsolationError> {
        let mode = match detect_version(cgroup_root) {
            CgroupVersion::V1 if privileged => Mode::V1(CgroupManager::new(cgroup_root, parent)?),
            CgroupVersion::V2 if privileged => Mode::V2(CgroupV2Manager::new(cgroup_root, parent)?),
            CgroupVersion::V1 | CgroupVersion::V2 => {
                cgroup::check_parent(parent)?;
                Mode::Unavailable("not running as root".into())
            }
            CgroupVersion::None => {
                Mode::Unavailable(format!("no cgroup hierarchy at {}", cgroup_root.display()))
            }
        };
        Ok(CgroupIsolator {
            dev_root: dev_root.to_path_buf(),
            mode,
            pids_max: None,
        })
    }

    /// Each task may have at most `n` processes and threads (its cgroup's
    /// `pids.max`; a container's `PidsLimit`): one task cannot use up the
    /// host's pids under the others.
    pub fn with_pids_max(mut self, n: Option<u64>) -> CgroupIsolator {
        self.pids_max = n;
        self
    }

    fn describe_mode(&self) -> String {
        match &self.mode {
            Mode::V1(m) => format!(
                "cgroup v1 device isolation under {} (dev root {})",
                m.root().display(),
                self.dev_root.display()
            ),
            Mode::V2(m) => format!(
                "cgroup v2 under {}: host processes get a gpuctl device program and limits ({}), containers Docker's device program (dev root {})",
                m.root().display(),
                match m.controllers() {
                    c if c.is_empty() => "no limit controller offered".to_string(),
                    c => c.join(", "),
                },
                self.dev_root.display()
            ),
            Mode::Unavailable(why) => format!(
                "no cgroup isolation ({why}); tasks are refused on a host with NVIDIA devices"
            ),
        }
    }
}

impl Isolator for CgroupIsolator {
    /// One line for the agent's start-up log.
    fn describe(&self) -> String {
        let pids = match self.pids_max {
            Some(n) => format!("; at most {n} processes and threads per task"),
            None => "; no limit of processes per task".into(),
        };
        self.describe_mode() + &pids
    }

    fn pids_max(&self) -> Option<u64> {
        self.pids_max
    }

    fn dev_root(&self) -> &Path {
        &self.dev_root
    }

    /// Prepares isolation for a task holding `task`'s GPUs and MIG devices.
    /// On a host with NVIDIA nodes, a node the task needs that is missing is
    /// an error naming it, and so is a MIG device whose caps are not known
    /// (it would run without its caps, or not at all).
    fn prepare(
        &self,
        task_id: &str,
        task: &TaskDevices,
        resources: &Resources,
        runtime: Runtime,
    ) -> Result<Prepared, IsolationError> {
        let host = devices::scan(&self.dev_root)?;
        if !host.gpus.is_empty() {
            if let Some(m) = task
                .gpus
                .iter()
                .find(|m| !host.gpus.iter().any(|(g, _)| g == *m))
            {
                return Err(IsolationError::Config(format!(
                    "GPU with minor {m} has no device node {}/nvidia{m}",
                    self.dev_root.display()
                )));
            }
        }
        // Simulated GPUs have no nodes at all: nothing to isolate, nothing
        // to refuse.
        if !host.is_empty() {
            if let Some(uuid) = task.unknown_caps.first() {
                return Err(IsolationError::Config(format!(
                    "MIG device {uuid}: the minors of its nvidia-caps nodes are not known \
                     (the driver's {} under the agent's --nvidia-proc-root does not list them), \
                     so it cannot be isolated from its parent's other MIG devices",
                    crate::gpu::mig::MIG_MINORS
                )));
            }
            if let Some(m) = task
                .caps
                .iter()
                .find(|m| !host.caps.iter().any(|(c, _)| c == *m))
            {
                return Err(IsolationError::Config(format!(
                    "MIG device's caps minor {m} has no device node {}/{}",
                    self.dev_root.display(),
                    devices::cap_node_name(*m)
                )));
            }
        }
        let devices = host.nodes_for(task);
        let cgroup = match &self.mode {
            Mode::V1(m) => Some(m.create(
                task_id,
                &rules::task_rules(&host, task),
                resources,
                self.pids_max,
            )?),
            Mode::V2(m) if runtime == Runtime::Process => Some(m.create(
                task_id,
                &bpf::task_rules_v2(&host, task),
                resources,
                self.pids_max,
            )?),
            Mode::V2(_) => None,
            Mode::Unavailable(why) if !host.is_empty() => {
                return Err(IsolationError::Unsupported(format!(
                    "cannot isolate GPUs on this host ({why})"
                )))
            }
            Mode::Unavailable(_) => None,
        };
        let host_nodes = host.all().map(|n| n.host_path.clone()).collect();
        Ok(Prepared {
            devices,
            cgroup,
            host_nodes,
        })
    }

    /// Removes task cgroups an earlier agent process left (see
    /// `CgroupManager::remove_all_except`), but those of `keep`; returns how many.
    fn remove_stale(&self, keep: &BTreeSet<String>) -> Result<usize, IsolationError> {
        match &self.mode {
            Mode::V1(m) => m.remove_all_except(keep),
            Mode::V2(m) => m.remove_all_except(keep),
            Mode::Unavailable(_) => Ok(0),
        }
    }

    /// Removes what `prepare` made, once the task has ended. Whatever is
    /// still in the task's cgroups (a process that left the task's process
    /// group, say) is killed first: the GPU is released on the agent's
    /// report that the task is gone, so nothing of it may stay. Idempotent.
    fn release(&self, task_id: &str) -> Result<(), IsolationError> {
        let (strays, removed) = match &self.mode {
            Mode::V1(m) => (m.kill_all_in(task_id), m.remove(task_id)),
            Mode::V2(m) => (m.kill_all_in(task_id), m.remove(task_id)),
            Mode::Unavailable(_) => return Ok(()),
        };
        if strays > 0 {
            tracing::warn!(
                task_id,
                strays,
                "killed processes left in an ended task's cgroup"
            );
        }
        removed
    }

    fn oom_kills(&self, task_id: &str) -> u64 {
        match &self.mode {
            Mode::V1(m) => m.oom_kills(task_id),
            Mode::V2(m) => m.oom_kills(task_id),
            Mode::Unavailable(_) => 0,
        }
    }
}

/// The `oom_kill N` line of a cgroup's `memory.oom_control` (v1) or
/// `memory.events` (v2); 0 when the file or the line is missing.
pub(crate) fn oom_kill_count(file: &Path) -> u64 {
    std::fs::read_to_string(file)
        .ok()
        .and_then(|text| {
            text.lines().find_map(|l| {
                l.strip_prefix("oom_kill ")
                    .and_then(|n| n.trim().parse().ok())
            })
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real isolator under `gpuctl/a`, managing cgroups when root.
    fn isolator(root: &Path, dev: &Path) -> CgroupIsolator {
        CgroupIsolator::new(
            root,
            "gpuctl/a",
            dev,
            nix::unistd::Uid::effective().is_root(),
        )
        .unwrap()
    }

    fn v2_root() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        d
    }

    fn res() -> Resources {
        Resources::default()
    }

    #[test]
    fn on_cgroup_v2_a_process_task_without_its_device_program_is_refused() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        // Looks like a v2 root but is a plain directory: the program cannot
        // be attached, so the task must not run (agent/tests/bpf_cgroup2.rs
        // runs tasks on a real cgroup2 mount).
        let root = v2_root();
        let dev = tempfile::tempdir().unwrap();
        let iso = isolator(root.path(), dev.path());
        assert!(iso.describe().contains("cgroup v2"));
        let err = iso
            .prepare("t1", &TaskDevices::default(), &res(), Runtime::Process)
            .unwrap_err()
            .to_string();
        assert!(err.contains("device program"), "{err}");
        assert!(!root.path().join("gpuctl/a/t1").exists(), "half made");
    }

    #[test]
    fn on_cgroup_v2_containers_get_their_devices_and_dockers_program() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: mknod needs root");
            return;
        }
        use nix::sys::stat::{makedev, mknod, Mode, SFlag};
        let root = v2_root();
        let dev = tempfile::tempdir().unwrap();
        for (name, min) in [("nvidia0", 0), ("nvidia1", 1), ("nvidiactl", 255)] {
            mknod(
                &dev.path().join(name),
                SFlag::S_IFCHR,
                Mode::from_bits_truncate(0o600),
                makedev(195, min),
            )
            .unwrap();
        }
        let iso = isolator(root.path(), dev.path());
        // Containers get exactly their GPU and the control device; Docker's
        // own device program does the rest.
        let p = iso
            .prepare("t3", &TaskDevices::gpus(&[1]), &res(), Runtime::Docker)
            .unwrap();
        assert!(p.cgroup.is_none());
        let names: Vec<&str> = p
            .devices
            .iter()
            .map(|d| d.container_path.as_str())
            .collect();
        assert_eq!(names, vec!["/dev/nvidia1", "/dev/nvidiactl"]);
        // A GPU whose node is missing is an error, not a silent no-device.
        let err = iso
            .prepare("t4", &TaskDevices::gpus(&[5]), &res(), Runtime::Docker)
            .unwrap_err();
        assert!(err.to_string().contains("nvidia5"), "{err}");
    }

    #[test]
    fn a_mig_task_gets_its_parent_and_caps_and_missing_ones_are_refused() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: mknod needs root");
            return;
        }
        use nix::sys::stat::{makedev, mknod, Mode, SFlag};
        let root = v2_root();
        let dev = tempfile::tempdir().unwrap();
        std::fs::create_dir(dev.path().join("nvidia-caps")).unwrap();
        for (name, major, min) in [
            ("nvidia0", 195, 0),
            ("nvidiactl", 195, 255),
            ("nvidia-caps/nvidia-cap1", 240, 1),
            ("nvidia-caps/nvidia-cap30", 240, 30),
            ("nvidia-caps/nvidia-cap31", 240, 31),
            ("nvidia-caps/nvidia-cap39", 240, 39),
        ] {
            mknod(
                &dev.path().join(name),
                SFlag::S_IFCHR,
                Mode::from_bits_truncate(0o600),
                makedev(major, min),
            )
            .unwrap();
        }
        let iso = isolator(root.path(), dev.path());
        let mig = |caps: &[u32], unknown: &[&str]| TaskDevices {
            gpus: vec![0],
            caps: caps.to_vec(),
            unknown_caps: unknown.iter().map(|u| u.to_string()).collect(),
        };
        let p = iso
            .prepare("t1", &mig(&[30, 31], &[]), &res(), Runtime::Docker)
            .unwrap();
        let names: Vec<&str> = p
            .devices
            .iter()
            .map(|d| d.container_path.as_str())
            .collect();
        assert_eq!(
            names,
            vec![
                "/dev/nvidia0",
                "/dev/nvidia-caps/nvidia-cap30",
                "/dev/nvidia-caps/nvidia-cap31",
                "/dev/nvidiactl"
            ]
        );
        assert_eq!(p.host_nodes.len(), 6, "{:?}", p.host_nodes);
        assert!(p
            .host_nodes
            .contains(&dev.path().join("nvidia-caps/nvidia-cap39")));
        // Its CI's cap (40) has no node.
        let err = iso
            .prepare("t2", &mig(&[39, 40], &[]), &res(), Runtime::Docker)
            .unwrap_err()
            .to_string();
        assert!(err.contains("nvidia-caps/nvidia-cap40"), "{err}");
        // Caps not known: refused, naming the MIG device.
        let err = iso
            .prepare("t3", &mig(&[], &["MIG-x"]), &res(), Runtime::Docker)
            .unwrap_err()
            .to_string();
        assert!(err.contains("MIG-x") && err.contains("mig-minors"), "{err}");
        // On a host without any NVIDIA node (simulated GPUs) there is
        // nothing to isolate and nothing to refuse.
        let empty = tempfile::tempdir().unwrap();
        let sim = isolator(root.path(), empty.path());
        let p = sim
            .prepare("t4", &mig(&[], &["MIG-x"]), &res(), Runtime::Docker)
            .unwrap();
        assert!(p.devices.is_empty() && p.host_nodes.is_empty());
    }

    #[test]
    fn without_cgroups_only_hosts_without_nvidia_devices_run_tasks() {
        let none = tempfile::tempdir().unwrap();
        let dev = tempfile::tempdir().unwrap();
        let iso = isolator(none.path(), dev.path());
        assert!(iso.describe().contains("no cgroup isolation"));
        assert!(iso
            .prepare("t1", &TaskDevices::default(), &res(), Runtime::Process)
            .is_ok());
    }
}
