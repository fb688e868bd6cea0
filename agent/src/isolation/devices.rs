//! Finding the NVIDIA device nodes under `--dev-root`, with the major and
//! minor numbers read from the nodes themselves (the uvm and caps majors
//! are dynamic).

use std::path::Path;

use nix::sys::stat::{major, minor, stat, SFlag};

use super::rules::{DeviceNode, HostDevices};
use super::IsolationError;

const CONTROL: &[&str] = &[
    "nvidiactl",
    "nvidia-uvm",
    "nvidia-uvm-tools",
    "nvidia-modeset",
];

/// MIG's capability nodes, `nvidia-caps/nvidia-cap<N>`, under the dev root.
pub const CAPS_DIR: &str = "nvidia-caps";
const CAP_PREFIX: &str = "nvidia-cap";

/// `nvidia-caps/nvidia-cap<n>`, relative to the dev root: where the driver
/// (nvidia-modprobe) makes the node of caps minor `n`.
pub fn cap_node_name(n: u32) -> String {
    format!("{CAPS_DIR}/{CAP_PREFIX}{n}")
}

/// The number of a name made of `prefix` and digits only.
fn numbered(name: &str, prefix: &str) -> Option<u32> {
    let n = name.strip_prefix(prefix)?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

/// The char nodes `<prefix><N>` of `dir`, by N, each appearing in a
/// container as `/dev/<in_container><name>`. A missing directory has none.
fn numbered_nodes(
    dir: &Path,
    prefix: &str,
    in_container: &str,
) -> Result<Vec<(u32, DeviceNode)>, IsolationError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(IsolationError::Io {
                path: dir.to_path_buf(),
                source,
            })
        }
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| IsolationError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(n) = numbered(&name, prefix) else {
            continue;
        };
        // The number in the name is the minor NVML and mig-minors report.
        if let Some(node) = char_node(&entry.path(), &format!("{in_container}{name}"))? {
            out.push((n, node));
        }
    }
    out.sort();
    Ok(out)
}

fn char_node(path: &Path, name: &str) -> Result<Option<DeviceNode>, IsolationError> {
    let st = match stat(path) {
        Ok(st) => st,
        Err(nix::errno::Errno::ENOENT) => return Ok(None),
        Err(e) => {
            return Err(IsolationError::Io {
                path: path.to_path_buf(),
                source: e.into(),
            })
        }
    };
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFCHR {
        return Ok(None);
    }
    Ok(Some(DeviceNode {
        host_path: path.to_path_buf(),
        container_path: format!("/dev/{name}"),
        major: major(st.st_rdev) as u32,
        minor: minor(st.st_rdev) as u32,
    }))
}

/// Scans `dev_root` for `nvidia<N>`, the control devices and
/// `nvidia-caps/nvidia-cap<N>`. A missing directory means no devices (a
/// host without the driver).
pub fn scan(dev_root: &Path) -> Result<HostDevices, IsolationError> {
    let mut host = HostDevices {
        gpus: numbered_nodes(dev_root, "nvidia", "")?,
        caps: numbered_nodes(&dev_root.join(CAPS_DIR), CAP_PREFIX, "nvidia-caps/")?,
        ..HostDevices::default()
    };
    for name in CONTROL {
        if let Some(node) = char_node(&dev_root.join(name), name)? {
            host.control.push(node);
        }
    }
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::stat::{makedev, mknod, Mode};

    fn can_mknod() -> bool {
        nix::unistd::Uid::effective().is_root()
    }

    #[test]
    fn finds_gpu_and_control_nodes_with_their_numbers() {
        if !can_mknod() {
            eprintln!("skipped: mknod needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let mk = |name: &str, maj: u64, min: u64| {
            mknod(
                &dir.path().join(name),
                SFlag::S_IFCHR,
                Mode::from_bits_truncate(0o666),
                makedev(maj, min),
            )
            .unwrap();
        };
        mk("nvidia0", 195, 0);
        mk("nvidia3", 195, 3);
        mk("nvidiactl", 195, 255);
        mk("nvidia-uvm", 237, 0);
        std::fs::write(dir.path().join("nvidia7"), b"not a device").unwrap();
        std::fs::write(dir.path().join("nvidia-foo"), b"").unwrap();
        let h = scan(dir.path()).unwrap();
        let gpus: Vec<(u32, u32, u32)> =
            h.gpus.iter().map(|(m, n)| (*m, n.major, n.minor)).collect();
        assert_eq!(gpus, vec![(0, 195, 0), (3, 195, 3)]);
        let control: Vec<(&str, u32, u32)> = h
            .control
            .iter()
            .map(|n| (n.container_path.as_str(), n.major, n.minor))
            .collect();
        assert_eq!(
            control,
            vec![("/dev/nvidiactl", 195, 255), ("/dev/nvidia-uvm", 237, 0)]
        );
    }

    #[test]
    fn finds_the_caps_nodes_of_mig_with_their_numbers() {
        if !can_mknod() {
            eprintln!("skipped: mknod needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let caps = dir.path().join(CAPS_DIR);
        std::fs::create_dir(&caps).unwrap();
        let mk = |name: &str, maj: u64, min: u64| {
            mknod(
                &dir.path().join(name),
                SFlag::S_IFCHR,
                Mode::from_bits_truncate(0o666),
                makedev(maj, min),
            )
            .unwrap();
        };
        mk("nvidia0", 195, 0);
        mk(&cap_node_name(1), 240, 1);
        mk(&cap_node_name(31), 240, 31);
        mk(&cap_node_name(30), 240, 30);
        std::fs::write(caps.join("nvidia-cap9"), b"not a device").unwrap();
        std::fs::write(caps.join("nvidia-capx"), b"").unwrap();
        // Not under nvidia-caps: not a caps node, and not a GPU either.
        mk("nvidia-cap5", 240, 5);
        let h = scan(dir.path()).unwrap();
        let caps: Vec<(u32, &str, &Path, u32, u32)> = h
            .caps
            .iter()
            .map(|(m, n)| {
                (
                    *m,
                    n.container_path.as_str(),
                    n.host_path.strip_prefix(dir.path()).unwrap(),
                    n.major,
                    n.minor,
                )
            })
            .collect();
        assert_eq!(
            caps,
            vec![
                (
                    1,
                    "/dev/nvidia-caps/nvidia-cap1",
                    Path::new("nvidia-caps/nvidia-cap1"),
                    240,
                    1
                ),
                (
                    30,
                    "/dev/nvidia-caps/nvidia-cap30",
                    Path::new("nvidia-caps/nvidia-cap30"),
                    240,
                    30
                ),
                (
                    31,
                    "/dev/nvidia-caps/nvidia-cap31",
                    Path::new("nvidia-caps/nvidia-cap31"),
                    240,
                    31
                ),
            ]
        );
        assert_eq!(h.gpus.len(), 1);
        assert_eq!(h.all().count(), 4);
    }

    #[test]
    fn a_missing_dev_root_has_no_devices() {
        assert!(scan(Path::new("/nonexistent/dev")).unwrap().is_empty());
    }
}
