//! Finding the NVIDIA device nodes under `--dev-root`, with the major and
//! minor numbers read from the nodes themselves (the uvm major is dynamic).

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

/// Scans `dev_root` for `nvidia<N>` and the control devices. A missing
/// directory means no devices (a host without the driver).
pub fn scan(dev_root: &Path) -> Result<HostDevices, IsolationError> {
    let mut host = HostDevices::default();
    let entries = match std::fs::read_dir(dev_root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(host),
        Err(source) => {
            return Err(IsolationError::Io {
                path: dev_root.to_path_buf(),
                source,
            })
        }
    };
    for entry in entries {
        let entry = entry.map_err(|source| IsolationError::Io {
            path: dev_root.to_path_buf(),
            source,
        })?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(n) = name.strip_prefix("nvidia") else {
            continue;
        };
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Some(node) = char_node(&entry.path(), &name)? {
            // The number in the name is the GPU's minor (what NVML reports).
            if let Ok(gpu_minor) = n.parse::<u32>() {
                host.gpus.push((gpu_minor, node));
            }
        }
    }
    host.gpus.sort();
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
    fn a_missing_dev_root_has_no_devices() {
        assert!(scan(Path::new("/nonexistent/dev")).unwrap().is_empty());
    }
}
