//! GPU memory per task: NVML's per-process lists (compute and MPS), each
//! process attributed to the gpuctl task whose cgroup holds it, read from
//! `/proc/<pid>/cgroup`.
//!
//! A task's cgroup is `<parent>/<task-id>` (`isolation::cgroup`,
//! `cgroup2`): host processes join it, and Docker's cgroupfs driver on
//! cgroup v1 puts the container inside it. Containers outside it (cgroup
//! v2, Docker's systemd driver) are recognised by their container id
//! instead, which the caller maps to the task ([`TaskCgroups::containers`]).
//! NVML reports host pids whatever the container's pid namespace, so
//! `/proc` is the host's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::{Device, Nvml};

/// The host's `/proc`.
pub const PROC_ROOT: &str = "/proc";

const MIB: u64 = 1024 * 1024;

/// MiB used on each GPU by each task: task id -> GPU uuid -> MiB.
pub type TaskGpuMemory = BTreeMap<String, BTreeMap<String, u64>>;

/// One process on a GPU, with the memory NVML accounts to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuProcess {
    pub pid: u32,
    pub used_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ProcsError {
    #[error("GPU {uuid}: {source}")]
    Nvml {
        uuid: String,
        #[source]
        source: NvmlError,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// How a process is known to be a task's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskCgroups {
    /// The agent's task cgroup parent, as the isolator names it
    /// (`gpuctl/agent-1`): a task's cgroup is `<parent>/<task-id>`.
    pub parent: String,
    /// Task containers whose cgroup is not inside their task's: container
    /// id (64 hex digits) -> task id.
    pub containers: BTreeMap<String, String>,
}

/// Where the health probe finds the tasks of the processes it reads.
pub struct Attribution {
    /// The host's `/proc` (a directory of `<pid>/cgroup` files in tests).
    pub proc_root: PathBuf,
    /// Asked at every probe, since containers come and go.
    pub cgroups: Box<dyn Fn() -> TaskCgroups + Send>,
}

impl std::fmt::Debug for Attribution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attribution")
            .field("proc_root", &self.proc_root)
            .finish_non_exhaustive()
    }
}

// ----- NVML -----

/// Merges NVML's compute and MPS lists (an MPS client is in both) into one
/// entry per pid. A process whose memory NVML cannot tell
/// (NVML_VALUE_NOT_AVAILABLE) is left out.
pub fn merge(lists: &[&[ProcessInfo]]) -> Vec<GpuProcess> {
    let mut by_pid: BTreeMap<u32, u64> = BTreeMap::new();
    for p in lists.iter().flat_map(|l| l.iter()) {
        if let UsedGpuMemory::Used(bytes) = p.used_gpu_memory {
            let e = by_pid.entry(p.pid).or_insert(0);
            *e = (*e).max(bytes);
        }
    }
    by_pid
        .into_iter()
        .map(|(pid, used_bytes)| GpuProcess { pid, used_bytes })
        .collect()
}

/// The processes NVML lists on `dev` (compute and MPS, merged). A list the
/// driver or library does not offer counts as empty.
pub fn device_processes(dev: &Device) -> Result<Vec<GpuProcess>, NvmlError> {
    let optional = |r: Result<Vec<ProcessInfo>, NvmlError>| match r {
        Ok(l) => Ok(l),
        Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => Ok(Vec::new()),
        Err(e) => Err(e),
    };
    let compute = optional(dev.running_compute_processes())?;
    let mps = optional(dev.mps_running_compute_processes())?;
    Ok(merge(&[&compute, &mps]))
}

/// The processes NVML lists on the GPU `uuid`.
pub fn gpu_processes(nvml: &Nvml, uuid: &str) -> Result<Vec<GpuProcess>, ProcsError> {
    let err = |source| ProcsError::Nvml {
        uuid: uuid.to_string(),
        source,
    };
    let dev = nvml.device_by_uuid(uuid).map_err(err)?;
    device_processes(&dev).map_err(err)
}

// ----- /proc -----

/// The cgroup paths of a `/proc/<pid>/cgroup` file, one per line
/// (`hierarchy-id:controllers:path`; v2's single line is `0::path`).
pub fn cgroup_paths(text: &str) -> Vec<&str> {
    text.lines()
        .filter_map(|l| l.splitn(3, ':').nth(2))
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect()
}

/// The container id in one cgroup path component: the id itself (Docker's
/// cgroupfs driver: `/docker/<id>`) or a systemd scope named after it
/// (`docker-<id>.scope`, `libpod-<id>.scope`, `cri-containerd-<id>.scope`).
fn container_id(component: &str) -> Option<&str> {
    let name = component.strip_suffix(".scope").unwrap_or(component);
    let id = name.rsplit('-').next()?;
    (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(id)
}

/// The task a process in cgroup `path` belongs to: the component after the
/// task parent (`/<parent>/<task>/...`), else a component naming one of
/// the task containers.
pub fn task_of_cgroup(path: &str, cgroups: &TaskCgroups) -> Option<String> {
    let mut components = path.split('/').filter(|c| !c.is_empty());
    let parent: Vec<&str> = cgroups
        .parent
        .split('/')
        .filter(|c| !c.is_empty())
        .collect();
    if !parent.is_empty() {
        let mut under = components.clone();
        if parent.iter().all(|p| under.next() == Some(p)) {
            // Only what could be a task id (the master refuses others).
            return under
                .next()
                .filter(|t| gpuctl_core::convert::check_id("task_id", t).is_ok())
                .map(str::to_string);
        }
    }
    components.find_map(|c| {
        container_id(c)
            .and_then(|id| cgroups.containers.get(id))
            .cloned()
    })
}

/// The task process `pid` belongs to, from `<proc_root>/<pid>/cgroup`:
/// the first of its cgroups (one per v1 hierarchy) that names a task.
/// `None` when it is no task's or has already exited.
pub fn task_of_pid(
    proc_root: &Path,
    pid: u32,
    cgroups: &TaskCgroups,
) -> Result<Option<String>, ProcsError> {
    let path = proc_root.join(pid.to_string()).join("cgroup");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        // Gone between NVML's list and now.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(ProcsError::Io { path, source }),
    };
    Ok(cgroup_paths(&text)
        .into_iter()
        .find_map(|p| task_of_cgroup(p, cgroups)))
}

/// MiB used by each task among `processes` (one GPU's), summing its
/// processes. A process whose cgroup cannot be read is left out (logged).
pub fn task_memory(
    processes: &[GpuProcess],
    proc_root: &Path,
    cgroups: &TaskCgroups,
) -> BTreeMap<String, u64> {
    let mut bytes: BTreeMap<String, u64> = BTreeMap::new();
    for p in processes {
        match task_of_pid(proc_root, p.pid, cgroups) {
            Ok(Some(task)) => {
                let b = bytes.entry(task).or_insert(0);
                *b = b.saturating_add(p.used_bytes);
            }
            Ok(None) => {}
            Err(e) => tracing::debug!(pid = p.pid, error = %e, "GPU process not attributed"),
        }
    }
    bytes.into_iter().map(|(t, b)| (t, b / MIB)).collect()
}

/// Each task's processes' summed share of a GPU's SMs (percent, at most
/// 100), from `(pid, sm_util)` samples; processes of no task are left out.
pub fn task_utilization(
    samples: &[(u32, u32)],
    proc_root: &Path,
    cgroups: &TaskCgroups,
) -> BTreeMap<String, u32> {
    let mut pct: BTreeMap<String, u32> = BTreeMap::new();
    for &(pid, util) in samples {
        match task_of_pid(proc_root, pid, cgroups) {
            Ok(Some(task)) => {
                let u = pct.entry(task).or_insert(0);
                *u = u.saturating_add(util).min(100);
            }
            Ok(None) => {}
            Err(e) => tracing::debug!(pid, error = %e, "GPU process not attributed"),
        }
    }
    pct
}

/// MiB used by each task on each GPU of `gpus` (uuids). A GPU whose
/// processes cannot be read is left out (logged); the probe, not this,
/// decides its health.
pub fn task_gpu_memory(
    nvml: &Nvml,
    gpus: &[String],
    proc_root: &Path,
    cgroups: &TaskCgroups,
) -> TaskGpuMemory {
    let mut out = TaskGpuMemory::new();
    for uuid in gpus {
        let processes = match gpu_processes(nvml, uuid) {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(error = %e, "GPU processes not read");
                continue;
            }
        };
        for (task, mib) in task_memory(&processes, proc_root, cgroups) {
            out.entry(task).or_default().insert(uuid.clone(), mib);
        }
    }
    out
}

/// The `max` tasks using the most memory (all when there are fewer), for a
/// reading of bounded size.
pub fn largest(mut tasks: BTreeMap<String, u64>, max: usize) -> BTreeMap<String, u64> {
    if tasks.len() > max {
        let mut by_size: Vec<(String, u64)> = std::mem::take(&mut tasks).into_iter().collect();
        by_size.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        tasks = by_size.into_iter().take(max).collect();
    }
    tasks
}

/// A task whose processes' GPU memory together must stay within its
/// fraction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watched {
    pub task: String,
    pub gpu: String,
    pub limit_mib: u64,
}

/// The watched tasks over their fraction in the latest readings (each
/// GPU's by UUID), with why in words. A task with no figure (no process on
/// the GPU yet, or a GPU that failed its probe) is not over.
pub fn over_memory<'a>(
    readings: impl IntoIterator<Item = (&'a str, &'a gpuctl_core::types::GpuSample)>,
    watched: &[Watched],
) -> BTreeMap<String, String> {
    let readings: BTreeMap<&str, &gpuctl_core::types::GpuSample> = readings.into_iter().collect();
    let mut over = BTreeMap::new();
    for w in watched {
        let used = readings
            .get(w.gpu.as_str())
            .and_then(|s| s.task_memory_used_mib.get(&w.task).copied());
        if let Some(used) = used.filter(|u| *u > w.limit_mib) {
            over.insert(
                w.task.clone(),
                format!(
                    "its processes used {used} MiB of GPU memory on {}, over its fraction of {} MiB (GPU_MEMORY_LIMIT)",
                    w.gpu, w.limit_mib
                ),
            );
        }
    }
    over
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID_A: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    const ID_B: &str = "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210";

    fn cgroups() -> TaskCgroups {
        TaskCgroups {
            parent: "gpuctl/agent-1".into(),
            containers: [(ID_B.to_string(), "job-9.0".to_string())].into(),
        }
    }

    fn info(pid: u32, used: UsedGpuMemory) -> ProcessInfo {
        ProcessInfo {
            pid,
            used_gpu_memory: used,
            gpu_instance_id: None,
            compute_instance_id: None,
        }
    }

    /// A fake `/proc` with one `<pid>/cgroup` file per entry.
    fn proc_root(files: &[(u32, &str)]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for (pid, text) in files {
            let dir = d.path().join(pid.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("cgroup"), text).unwrap();
        }
        d
    }

    #[test]
    fn cgroup_files_of_both_versions_parse() {
        let v1 = "12:devices:/gpuctl/agent-1/job-1.0\n\
                  11:memory:/gpuctl/agent-1/job-1.0\n\
                  1:name=systemd:/system.slice/gpuctl-agent.service\n\
                  0::/\n";
        assert_eq!(
            cgroup_paths(v1),
            [
                "/gpuctl/agent-1/job-1.0",
                "/gpuctl/agent-1/job-1.0",
                "/system.slice/gpuctl-agent.service",
                "/"
            ]
        );
        assert_eq!(
            cgroup_paths("0::/gpuctl/agent-1/t\n"),
            ["/gpuctl/agent-1/t"]
        );
        // A path may hold ':'; malformed lines are skipped.
        assert_eq!(cgroup_paths("0::/a:b\ngarbage\n3:cpu:\n"), ["/a:b"]);
    }

    #[test]
    fn a_cgroup_names_its_task_by_parent_or_container() {
        let c = cgroups();
        let task = |p: &str| task_of_cgroup(p, &c);
        // A host process in its task's cgroup.
        assert_eq!(task("/gpuctl/agent-1/job-1.0").as_deref(), Some("job-1.0"));
        // A container inside its task's cgroup (cgroupfs driver, v1).
        assert_eq!(
            task(&format!("/gpuctl/agent-1/job-2.0/{ID_A}")).as_deref(),
            Some("job-2.0")
        );
        // Containers outside it, by their id.
        for p in [
            format!("/gpuctl.slice/docker-{ID_B}.scope"),
            format!("/docker/{ID_B}"),
            format!("/machine.slice/libpod-{ID_B}.scope/container"),
        ] {
            assert_eq!(task(&p).as_deref(), Some("job-9.0"), "{p}");
        }
        // Not a task's: the parent itself, another agent's, a look-alike
        // prefix, an unknown container, the agent's own cgroup.
        for p in [
            "/gpuctl/agent-1".to_string(),
            "/gpuctl/agent-2/job-1.0".into(),
            "/gpuctl/agent-10/job-1.0".into(),
            "/gpuctl/agent-1/bad:id".into(),
            format!("/docker/{ID_A}"),
            "/system.slice/gpuctl-agent.service".into(),
            "/".into(),
        ] {
            assert_eq!(task(&p), None, "{p}");
        }
        // The parent is compared by components, with or without slashes.
        let slashed = TaskCgroups {
            parent: "/gpuctl/agent-1/".into(),
            containers: BTreeMap::new(),
        };
        assert_eq!(
            task_of_cgroup("/gpuctl/agent-1/t", &slashed).as_deref(),
            Some("t")
        );
        // Without a parent only containers match.
        let none = TaskCgroups::default();
        assert_eq!(task_of_cgroup("/gpuctl/agent-1/t", &none), None);
    }

    #[test]
    fn compute_and_mps_lists_merge_by_pid_without_unknown_memory() {
        let compute = [
            info(10, UsedGpuMemory::Used(100 * MIB)),
            info(11, UsedGpuMemory::Unavailable),
            info(12, UsedGpuMemory::Used(0)),
        ];
        let mps = [
            info(10, UsedGpuMemory::Used(100 * MIB)),
            info(11, UsedGpuMemory::Used(7 * MIB)),
            info(13, UsedGpuMemory::Unavailable),
        ];
        assert_eq!(
            merge(&[&compute, &mps]),
            [
                GpuProcess {
                    pid: 10,
                    used_bytes: 100 * MIB
                },
                GpuProcess {
                    pid: 11,
                    used_bytes: 7 * MIB
                },
                GpuProcess {
                    pid: 12,
                    used_bytes: 0
                },
            ]
        );
    }

    #[test]
    fn processes_sum_per_task_and_strangers_are_left_out() {
        let root = proc_root(&[
            (100, "0::/gpuctl/agent-1/job-1.0\n"),
            (101, "0::/gpuctl/agent-1/job-1.0/worker\n"),
            (200, &format!("0::/gpuctl.slice/docker-{ID_B}.scope\n")),
            // The MPS server, a user's own process.
            (300, "0::/system.slice/nvidia-mps.service\n"),
            (301, "0::/user.slice/user-1000.slice/session-2.scope\n"),
        ]);
        let p = |pid, mib: u64| GpuProcess {
            pid,
            used_bytes: mib * MIB,
        };
        let procs = [
            p(100, 1024),
            p(101, 512),
            GpuProcess {
                pid: 200,
                used_bytes: 3 * MIB + MIB / 2,
            },
            p(300, 64),
            p(301, 2048),
            // Exited before its cgroup was read.
            p(999, 4096),
        ];
        let got = task_memory(&procs, root.path(), &cgroups());
        assert_eq!(
            got,
            BTreeMap::from([("job-1.0".to_string(), 1536), ("job-9.0".to_string(), 3)])
        );
        assert_eq!(task_of_pid(root.path(), 999, &cgroups()).unwrap(), None);
    }

    /// Per-process SM shares sum per task (at most 100%); processes of no
    /// task, and gone ones, are left out.
    #[test]
    fn utilization_sums_per_task_up_to_the_whole_gpu() {
        let root = proc_root(&[
            (100, "0::/gpuctl/agent-1/job-1.0\n"),
            (101, "0::/gpuctl/agent-1/job-1.0/worker\n"),
            (200, &format!("0::/gpuctl.slice/docker-{ID_B}.scope\n")),
            (301, "0::/user.slice/user-1000.slice/session-2.scope\n"),
        ]);
        let got = task_utilization(
            &[(100, 30), (101, 15), (200, 70), (301, 50), (999, 10)],
            root.path(),
            &cgroups(),
        );
        assert_eq!(
            got,
            BTreeMap::from([("job-1.0".to_string(), 45), ("job-9.0".to_string(), 70)])
        );
        let over = task_utilization(&[(100, 80), (101, 60)], root.path(), &cgroups());
        assert_eq!(over["job-1.0"], 100);
    }

    #[test]
    fn an_unreadable_cgroup_file_is_an_error_naming_it() {
        let root = proc_root(&[]);
        // A directory where the file should be: reading it fails.
        std::fs::create_dir_all(root.path().join("5/cgroup")).unwrap();
        let err = task_of_pid(root.path(), 5, &cgroups()).unwrap_err();
        assert!(err.to_string().contains("5/cgroup"), "{err}");
        let p = GpuProcess {
            pid: 5,
            used_bytes: MIB,
        };
        assert!(task_memory(&[p], root.path(), &cgroups()).is_empty());
    }

    #[test]
    fn the_largest_tasks_are_kept() {
        let tasks: BTreeMap<String, u64> = [("a", 5), ("b", 50), ("c", 1), ("d", 50)]
            .map(|(t, m)| (t.to_string(), m))
            .into();
        assert_eq!(largest(tasks.clone(), 4), tasks);
        assert_eq!(
            largest(tasks, 2),
            BTreeMap::from([("b".to_string(), 50), ("d".to_string(), 50)])
        );
    }

    #[test]
    fn only_a_watched_task_over_its_fraction_is_over() {
        let sample = |tasks: &[(&str, u64)]| gpuctl_core::types::GpuSample {
            task_memory_used_mib: tasks.iter().map(|(t, m)| (t.to_string(), *m)).collect(),
            ..Default::default()
        };
        // G1 gave no reading.
        let g0 = sample(&[("a", 10241), ("b", 10240), ("c", 99999)]);
        let w = |task: &str, gpu: &str| Watched {
            task: task.into(),
            gpu: gpu.into(),
            limit_mib: 10240,
        };
        // a: one MiB over; b: at its limit; c: not watched (time-slice);
        // d: no figure; e: its GPU gave no reading.
        let over = over_memory(
            [("G0", &g0)],
            &[w("a", "G0"), w("b", "G0"), w("d", "G0"), w("e", "G1")],
        );
        assert_eq!(over.keys().collect::<Vec<_>>(), vec!["a"]);
        assert!(
            over["a"].contains("10241 MiB") && over["a"].contains("10240 MiB"),
            "{}",
            over["a"]
        );
    }
}
