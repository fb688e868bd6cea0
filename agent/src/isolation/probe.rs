//! Checks a running container's device isolation from outside, the same
//! way on cgroup v1 and v2 and with either Docker cgroup driver: a probe
//! process (`gpuctl-agent probe-devices NODE...`) joins the cgroups that
//! decide the container's device access (v1 `devices`, the v2 unified
//! one) before it execs, opens every NVIDIA node of the host and reports
//! each errno. The kernel answers EPERM for a node the cgroup denies; a
//! node that opens (or gets ENXIO, a driver-less fake) is allowed. Whatever
//! Docker, runc or a runtime hook did, what counts is what the kernel
//! lets the container's cgroup open.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use super::IsolationError;

pub const SUBCOMMAND: &str = "probe-devices";

/// The probe's side: opens each node named on the command line and prints
/// `ERRNO PATH` per node (0 when it opened). Runs before any thread exists.
pub fn main_if_requested() -> Option<ExitCode> {
    let mut args = std::env::args_os().skip(1);
    if args.next()? != SUBCOMMAND {
        return None;
    }
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut out = std::io::stdout().lock();
    for node in args {
        let errno = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NONBLOCK | nix::libc::O_NOCTTY)
            .open(&node)
        {
            Ok(_) => 0,
            Err(e) => e.raw_os_error().unwrap_or(-1),
        };
        if writeln!(out, "{errno} {}", Path::new(&node).display()).is_err() {
            return Some(ExitCode::from(1));
        }
    }
    Some(ExitCode::SUCCESS)
}

/// Where the cgroup hierarchies that decide device access are mounted:
/// the v1 `devices` controller's and the v2 unified one's.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DeviceHierarchies {
    pub v1_devices: Option<PathBuf>,
    pub v2: Option<PathBuf>,
}

/// Reads the mount points from `/proc/self/mountinfo` text (the first of
/// each kind).
pub fn hierarchies(mountinfo: &str) -> DeviceHierarchies {
    let mut h = DeviceHierarchies::default();
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let mount_point = left.split(' ').nth(4).map(unescape);
        let mut right = right.split(' ');
        let (fstype, _source, options) = (right.next(), right.next(), right.next());
        match (fstype, mount_point) {
            (Some("cgroup2"), Some(mp)) if h.v2.is_none() => h.v2 = Some(mp),
            (Some("cgroup"), Some(mp))
                if h.v1_devices.is_none()
                    && options.is_some_and(|o| o.split(',').any(|x| x == "devices")) =>
            {
                h.v1_devices = Some(mp)
            }
            _ => {}
        }
    }
    h
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> PathBuf {
    let mut out = Vec::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    use std::os::unix::ffi::OsStringExt;
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// The `cgroup.procs` files a probe writes itself into to stand where a
/// process of `/proc/PID/cgroup` text stands for device access.
pub fn procs_files(proc_cgroup: &str, h: &DeviceHierarchies) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let rel = path.trim_start_matches('/');
        let root = if controllers.is_empty() {
            h.v2.as_ref()
        } else if controllers.split(',').any(|c| c == "devices") {
            h.v1_devices.as_ref()
        } else {
            None
        };
        if let Some(root) = root {
            out.push(root.join(rel).join("cgroup.procs"));
        }
    }
    out
}

/// What each node gave when opened from the cgroups of `pid`: `(path,
/// errno)`, 0 when it opened. `exe` is the agent binary.
pub fn probe(
    exe: &Path,
    pid: i64,
    nodes: &[PathBuf],
) -> Result<Vec<(PathBuf, i32)>, IsolationError> {
    let read = |p: PathBuf| {
        std::fs::read_to_string(&p).map_err(|source| IsolationError::Io { path: p, source })
    };
    let h = hierarchies(&read(PathBuf::from("/proc/self/mountinfo"))?);
    let cgroups = read(PathBuf::from(format!("/proc/{pid}/cgroup")))?;
    // A container's process in the root devices cgroup is one that is
    // ending (out of its cgroup already): probed there, it would see every
    // node allowed.
    if in_root_devices_cgroup(&cgroups) {
        return Err(IsolationError::Config(format!(
            "process {pid} is in the root devices cgroup (ending?)"
        )));
    }
    let procs = procs_files(&cgroups, &h);
    if procs.is_empty() {
        return Err(IsolationError::Config(format!(
            "process {pid} is in no device-controlling cgroup that is mounted here"
        )));
    }
    let mut cmd = std::process::Command::new(exe);
    cmd.arg(SUBCOMMAND).args(nodes);
    super::join::join_before_exec_std(&mut cmd, &procs)?;
    let out = cmd.output().map_err(|source| IsolationError::Io {
        path: exe.to_path_buf(),
        source,
    })?;
    if !out.status.success() {
        return Err(IsolationError::Config(format!(
            "the device probe failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (errno, path) = l.split_once(' ')?;
            Some((PathBuf::from(path), errno.parse().ok()?))
        })
        .collect())
}

/// Whether `/proc/<pid>/cgroup` puts the process in the root of the v1
/// devices hierarchy and nowhere below the root of the unified one. A
/// container of a cgroup v2 runtime on a host that also mounts a v1
/// devices hierarchy is in that v1 root while its v2 cgroup's device
/// program governs it (the kernel applies both): probed from both, it is
/// seen as it is. (On an H200 host with such a mount, every MPS container
/// was refused as "ending" before this looked at the v2 line.)
fn in_root_devices_cgroup(proc_cgroup: &str) -> bool {
    let mut v1_root = false;
    let mut v2_below_root = false;
    for l in proc_cgroup.lines() {
        let mut parts = l.splitn(3, ':');
        let (_, ctrls, path) = (parts.next(), parts.next(), parts.next());
        match ctrls {
            Some("") => v2_below_root |= path.is_some_and(|p| p != "/"),
            Some(c) if c.split(',').any(|c| c == "devices") => v1_root |= path == Some("/"),
            _ => {}
        }
    }
    v1_root && !v2_below_root
}

/// Whether what the probe saw is what the task was given: every node in
/// `allowed` opens (anything but EPERM), every other one is denied (EPERM).
/// The error names each node that is wrong.
pub fn check(seen: &[(PathBuf, i32)], allowed: &[PathBuf]) -> Result<(), String> {
    let eperm = nix::libc::EPERM;
    let wrong: Vec<String> = seen
        .iter()
        .filter_map(
            |(path, errno)| match (allowed.contains(path), *errno == eperm) {
                (true, true) => Some(format!("{} denied but given", path.display())),
                (false, false) => Some(format!(
                    "{} not given but {}",
                    path.display(),
                    if *errno == 0 {
                        "opens".to_string()
                    } else {
                        format!("allowed (errno {errno})")
                    }
                )),
                _ => None,
            },
        )
        .collect();
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(wrong.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
25 30 0:22 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
28 25 0:25 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
33 25 0:30 / /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices
40 25 0:31 / /tmp/a\\040b rw - cgroup2 none rw
";

    #[test]
    fn mountinfo_names_the_device_hierarchies() {
        let h = hierarchies(MOUNTINFO);
        assert_eq!(h.v1_devices, Some(PathBuf::from("/sys/fs/cgroup/devices")));
        assert_eq!(h.v2, Some(PathBuf::from("/sys/fs/cgroup/unified")));
        assert_eq!(unescape("/tmp/a\\040b"), PathBuf::from("/tmp/a b"));
        let v2only = hierarchies("26 1 0:23 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
        assert_eq!(v2only.v1_devices, None);
        assert_eq!(v2only.v2, Some(PathBuf::from("/sys/fs/cgroup")));
    }

    #[test]
    fn a_process_is_joined_where_its_devices_are_decided() {
        let h = hierarchies(MOUNTINFO);
        let cg = "12:devices:/gpuctl/a/t1/abc\n4:cpu,cpuacct:/gpuctl/a/t1/abc\n0::/system.slice/docker-abc.scope\n";
        assert_eq!(
            procs_files(cg, &h),
            vec![
                PathBuf::from("/sys/fs/cgroup/devices/gpuctl/a/t1/abc/cgroup.procs"),
                PathBuf::from("/sys/fs/cgroup/unified/system.slice/docker-abc.scope/cgroup.procs"),
            ]
        );
        // v2 only, systemd driver: the container's scope.
        let h = DeviceHierarchies {
            v1_devices: None,
            v2: Some("/sys/fs/cgroup".into()),
        };
        assert_eq!(
            procs_files("0::/gpuctl.slice/docker-abc.scope\n", &h),
            vec![PathBuf::from(
                "/sys/fs/cgroup/gpuctl.slice/docker-abc.scope/cgroup.procs"
            )]
        );
    }

    #[test]
    fn the_check_names_every_wrong_node() {
        let (n0, n1, ctl) = (
            PathBuf::from("/dev/nvidia0"),
            PathBuf::from("/dev/nvidia1"),
            PathBuf::from("/dev/nvidiactl"),
        );
        let enxio = nix::libc::ENXIO;
        let eperm = nix::libc::EPERM;
        let allowed = vec![n1.clone(), ctl.clone()];
        let good = vec![(n0.clone(), eperm), (n1.clone(), enxio), (ctl.clone(), 0)];
        assert_eq!(check(&good, &allowed), Ok(()));
        let leak = vec![(n0.clone(), 0), (n1.clone(), eperm), (ctl.clone(), enxio)];
        let err = check(&leak, &allowed).unwrap_err();
        assert!(err.contains("/dev/nvidia0 not given but opens"), "{err}");
        assert!(err.contains("/dev/nvidia1 denied but given"), "{err}");
        assert!(!err.contains("nvidiactl"), "{err}");
    }

    #[test]
    fn a_process_in_the_root_devices_cgroup_is_no_containers() {
        assert!(in_root_devices_cgroup("5:devices:/\n0::/\n"));
        assert!(!in_root_devices_cgroup("5:devices:/gpuctl/a/t/c1\n0::/\n"));
        assert!(
            !in_root_devices_cgroup("0::/\n"),
            "v2 only: no v1 devices line"
        );
        assert!(
            !in_root_devices_cgroup("5:devices:/\n0::/system.slice/docker-c1.scope\n"),
            "a v2 runtime's container beside a v1 devices mount"
        );
    }
}
