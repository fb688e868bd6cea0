//! Device rules as plain data, displayed in the kernel's format
//! (`c 195:0 rw`), and the rule set of a task. PURE.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum DeviceKind {
    Char,
    Block,
    /// `a`: every device.
    All,
}

/// Read, write, mknod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Access {
    pub read: bool,
    pub write: bool,
    pub mknod: bool,
}

impl Access {
    pub const RW: Access = Access {
        read: true,
        write: true,
        mknod: false,
    };
    pub const RWM: Access = Access {
        read: true,
        write: true,
        mknod: true,
    };
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.read {
            f.write_str("r")?;
        }
        if self.write {
            f.write_str("w")?;
        }
        if self.mknod {
            f.write_str("m")?;
        }
        Ok(())
    }
}

/// One line of `devices.allow` / `devices.deny`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct DeviceRule {
    pub allow: bool,
    pub kind: DeviceKind,
    /// `None`: any (`*`).
    pub major: Option<u32>,
    pub minor: Option<u32>,
    pub access: Access,
}

impl fmt::Display for DeviceRule {
    /// The kernel's format, without allow/deny (that is the file written to).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            DeviceKind::Char => 'c',
            DeviceKind::Block => 'b',
            DeviceKind::All => return f.write_str("a"),
        };
        let num = |n: Option<u32>| n.map_or_else(|| "*".to_string(), |n| n.to_string());
        write!(
            f,
            "{kind} {}:{} {}",
            num(self.major),
            num(self.minor),
            self.access
        )
    }
}

/// A device node found on the host, with the numbers read from the node.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct DeviceNode {
    /// Path on the host (under `--dev-root`).
    pub host_path: std::path::PathBuf,
    /// Where it appears in a container, e.g. `/dev/nvidia0`.
    pub container_path: String,
    pub major: u32,
    pub minor: u32,
}

/// The NVIDIA device nodes of a host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostDevices {
    /// `/dev/nvidiaN`, by N (the GPU's minor number).
    pub gpus: Vec<(u32, DeviceNode)>,
    /// `/dev/nvidiactl`, `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools`,
    /// `/dev/nvidia-modeset`: whichever exist.
    pub control: Vec<DeviceNode>,
}

impl HostDevices {
    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty() && self.control.is_empty()
    }

    /// The nodes a task with GPUs of these minors gets: its GPUs and the
    /// control devices. A task without GPUs gets none.
    pub fn nodes_for(&self, minors: &[u32]) -> Vec<DeviceNode> {
        if minors.is_empty() {
            return Vec::new();
        }
        let mut out: Vec<DeviceNode> = self
            .gpus
            .iter()
            .filter(|(m, _)| minors.contains(m))
            .map(|(_, n)| n.clone())
            .collect();
        out.extend(self.control.iter().cloned());
        out
    }
}

fn rule(allow: bool, n: &DeviceNode, access: Access) -> DeviceRule {
    DeviceRule {
        allow,
        kind: DeviceKind::Char,
        major: Some(n.major),
        minor: Some(n.minor),
        access,
    }
}

/// The device rules of a task's cgroup, applied in order on top of the
/// parent's (which allows everything): deny read and write on every GPU
/// node that is not the task's (and, for a task without GPUs, on the
/// control devices too); allow the task's GPUs and the control devices.
/// `m` is never denied, so a container runtime's own defaults still apply
/// (creating a node is harmless when opening it is denied).
pub fn task_rules(host: &HostDevices, minors: &[u32]) -> Vec<DeviceRule> {
    let mut rules = Vec::new();
    for (m, node) in &host.gpus {
        if !minors.contains(m) {
            rules.push(rule(false, node, Access::RW));
        }
    }
    if minors.is_empty() {
        for node in &host.control {
            rules.push(rule(false, node, Access::RW));
        }
        return rules;
    }
    for node in host.nodes_for(minors) {
        rules.push(rule(true, &node, Access::RWM));
    }
    rules
}

/// A device node `/dev/NAME`, for tests.
#[cfg(test)]
pub(crate) fn test_node(name: &str, major: u32, minor: u32) -> DeviceNode {
    DeviceNode {
        host_path: format!("/dev/{name}").into(),
        container_path: format!("/dev/{name}"),
        major,
        minor,
    }
}

/// A host of four GPUs (195:0 to 195:3) and three control nodes
/// (nvidiactl 195:255, nvidia-uvm 508:0 and 508:1), for tests.
#[cfg(test)]
pub(crate) fn test_host() -> HostDevices {
    let node = test_node;
    HostDevices {
        gpus: (0..4)
            .map(|i| (i, node(&format!("nvidia{i}"), 195, i)))
            .collect(),
        control: vec![
            node("nvidiactl", 195, 255),
            node("nvidia-uvm", 508, 0),
            node("nvidia-uvm-tools", 508, 1),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_node as node;

    fn host() -> HostDevices {
        test_host()
    }

    fn text(rules: &[DeviceRule]) -> Vec<String> {
        rules
            .iter()
            .map(|r| format!("{} {r}", if r.allow { "allow" } else { "deny" }))
            .collect()
    }

    #[test]
    fn kernel_format() {
        let r = DeviceRule {
            allow: true,
            kind: DeviceKind::Char,
            major: Some(195),
            minor: None,
            access: Access::RWM,
        };
        assert_eq!(r.to_string(), "c 195:* rwm");
        let all = DeviceRule {
            kind: DeviceKind::All,
            ..r
        };
        assert_eq!(all.to_string(), "a");
        let b = DeviceRule {
            kind: DeviceKind::Block,
            major: None,
            minor: Some(3),
            access: Access::RW,
            ..r
        };
        assert_eq!(b.to_string(), "b *:3 rw");
    }

    #[test]
    fn a_one_gpu_task_is_denied_the_other_gpus() {
        assert_eq!(
            text(&task_rules(&host(), &[2])),
            vec![
                "deny c 195:0 rw",
                "deny c 195:1 rw",
                "deny c 195:3 rw",
                "allow c 195:2 rwm",
                "allow c 195:255 rwm",
                "allow c 508:0 rwm",
                "allow c 508:1 rwm",
            ]
        );
    }

    #[test]
    fn a_task_without_gpus_gets_no_gpu_and_no_control_device() {
        assert_eq!(
            text(&task_rules(&host(), &[])),
            vec![
                "deny c 195:0 rw",
                "deny c 195:1 rw",
                "deny c 195:2 rw",
                "deny c 195:3 rw",
                "deny c 195:255 rw",
                "deny c 508:0 rw",
                "deny c 508:1 rw",
            ]
        );
        assert!(host().nodes_for(&[]).is_empty());
    }

    #[test]
    fn nodes_for_a_task_are_its_gpus_and_the_control_devices() {
        let n = host().nodes_for(&[1, 3]);
        let names: Vec<&str> = n.iter().map(|n| n.container_path.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "/dev/nvidia1",
                "/dev/nvidia3",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools"
            ]
        );
    }

    #[test]
    fn no_rule_ever_denies_mknod() {
        for minors in [&[][..], &[0][..], &[0, 1, 2, 3][..]] {
            for r in task_rules(&host(), minors) {
                assert!(r.allow || !r.access.mknod, "{r}");
            }
        }
    }

    /// The kernel's v1 semantics for these rule sets, on top of a parent
    /// that allows everything: the read and write a device is left with.
    fn read_write_allowed(rules: &[DeviceRule], major: u32, minor: u32) -> (bool, bool) {
        let (mut read, mut write) = (true, true);
        for r in rules {
            let matches = r.kind != DeviceKind::Block
                && r.major.is_none_or(|m| m == major)
                && r.minor.is_none_or(|m| m == minor);
            if !matches {
                continue;
            }
            if r.access.read {
                read = r.allow;
            }
            if r.access.write {
                write = r.allow;
            }
        }
        (read, write)
    }

    proptest::proptest! {
        /// Whatever GPUs a host has and a task is given: every GPU not given
        /// is denied, every GPU given is allowed, and the control devices
        /// are allowed exactly when a GPU is given.
        #[test]
        fn rule_sets_deny_every_other_gpu(
            host_minors in proptest::collection::btree_set(0u32..16, 0..8),
            pick in proptest::collection::vec(proptest::bool::ANY, 16),
        ) {
            let host = HostDevices {
                gpus: host_minors
                    .iter()
                    .map(|&i| (i, node(&format!("nvidia{i}"), 195, i)))
                    .collect(),
                control: host().control,
            };
            let given: Vec<u32> = host_minors
                .iter()
                .copied()
                .filter(|m| pick[*m as usize])
                .collect();
            let rules = task_rules(&host, &given);
            for &m in &host_minors {
                let (r, w) = read_write_allowed(&rules, 195, m);
                if given.contains(&m) {
                    proptest::prop_assert!(r && w, "GPU {m} given but not allowed: {:?}", text(&rules));
                } else {
                    proptest::prop_assert!(!r && !w, "GPU {m} not given but open: {:?}", text(&rules));
                }
            }
            for c in &host.control {
                let (r, w) = read_write_allowed(&rules, c.major, c.minor);
                proptest::prop_assert_eq!(r && w, !given.is_empty(), "{:?}", text(&rules));
                proptest::prop_assert_eq!(r || w, !given.is_empty(), "{:?}", text(&rules));
            }
        }
    }
}
