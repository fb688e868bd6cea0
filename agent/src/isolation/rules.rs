//! Device rules as plain data, displayed in the kernel's format
//! (`c 195:0 rw`), and the rule set of a task. PURE.

use std::fmt;

use super::grants::TaskDevices;

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
    /// `/dev/nvidia-caps/nvidia-capN`, by N: MIG's capability nodes (the
    /// access caps of GPU and compute instances, and the driver's
    /// `mig-config` and `mig-monitor` caps, which no task gets).
    pub caps: Vec<(u32, DeviceNode)>,
}

impl HostDevices {
    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty() && self.control.is_empty() && self.caps.is_empty()
    }

    /// Every NVIDIA node of the host: GPUs, caps, control nodes.
    pub fn all(&self) -> impl Iterator<Item = &DeviceNode> {
        self.gpus
            .iter()
            .chain(&self.caps)
            .map(|(_, n)| n)
            .chain(&self.control)
    }

    /// The nodes a task gets: its GPUs (for a MIG device, its parent), its
    /// MIG devices' caps and the control devices. A task without GPUs or
    /// MIG devices gets none.
    pub fn nodes_for(&self, task: &TaskDevices) -> Vec<DeviceNode> {
        if task.is_empty() {
            return Vec::new();
        }
        let pick = |nodes: &[(u32, DeviceNode)], given: &[u32]| {
            nodes
                .iter()
                .filter(|(m, _)| given.contains(m))
                .map(|(_, n)| n.clone())
                .collect::<Vec<_>>()
        };
        let mut out = pick(&self.gpus, &task.gpus);
        out.extend(pick(&self.caps, &task.caps));
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
/// node and every caps node that is not the task's (and, for a task
/// without GPUs, on the control devices too); allow the task's nodes
/// ([`HostDevices::nodes_for`]). `m` is never denied, so a container
/// runtime's own defaults still apply (creating a node is harmless when
/// opening it is denied).
pub fn task_rules(host: &HostDevices, task: &TaskDevices) -> Vec<DeviceRule> {
    let mut rules = Vec::new();
    for (nodes, given) in [(&host.gpus, &task.gpus), (&host.caps, &task.caps)] {
        for (m, node) in nodes {
            if !given.contains(m) {
                rules.push(rule(false, node, Access::RW));
            }
        }
    }
    if task.is_empty() {
        for node in &host.control {
            rules.push(rule(false, node, Access::RW));
        }
        return rules;
    }
    for node in host.nodes_for(task) {
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
/// (nvidiactl 195:255, nvidia-uvm 508:0 and 508:1), without MIG, for tests.
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
        caps: Vec::new(),
    }
}

/// [`test_host`] with GPU 3 in MIG mode: the caps nodes (major 240) of the
/// driver's `mig-config` (1) and `mig-monitor` (2), and of two MIG devices
/// of GPU 3, one with caps 30 and 31, the other 39 and 40.
#[cfg(test)]
pub(crate) fn test_mig_host() -> HostDevices {
    HostDevices {
        caps: [1, 2, 30, 31, 39, 40]
            .into_iter()
            .map(|i| {
                let mut n = test_node(&format!("nvidia-cap{i}"), 240, i);
                n.host_path = format!("/dev/nvidia-caps/nvidia-cap{i}").into();
                n.container_path = format!("/dev/nvidia-caps/nvidia-cap{i}");
                (i, n)
            })
            .collect(),
        ..test_host()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_node as node;

    fn mig(gpus: &[u32], caps: &[u32]) -> TaskDevices {
        TaskDevices {
            gpus: gpus.to_vec(),
            caps: caps.to_vec(),
            ..TaskDevices::default()
        }
    }

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
            text(&task_rules(&host(), &TaskDevices::gpus(&[2]))),
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
            text(&task_rules(&host(), &TaskDevices::default())),
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
        assert!(host().nodes_for(&TaskDevices::default()).is_empty());
    }

    #[test]
    fn nodes_for_a_task_are_its_gpus_and_the_control_devices() {
        let n = host().nodes_for(&TaskDevices::gpus(&[1, 3]));
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
            for r in task_rules(&host(), &TaskDevices::gpus(minors)) {
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

    #[test]
    fn a_mig_task_gets_its_parent_and_its_caps_and_no_other_caps() {
        // MIG device of GPU 3 with caps 30 and 31; the host also has
        // another MIG device's caps (39, 40) and mig-config/monitor (1, 2).
        assert_eq!(
            text(&task_rules(&test_mig_host(), &mig(&[3], &[30, 31]))),
            vec![
                "deny c 195:0 rw",
                "deny c 195:1 rw",
                "deny c 195:2 rw",
                "deny c 240:1 rw",
                "deny c 240:2 rw",
                "deny c 240:39 rw",
                "deny c 240:40 rw",
                "allow c 195:3 rwm",
                "allow c 240:30 rwm",
                "allow c 240:31 rwm",
                "allow c 195:255 rwm",
                "allow c 508:0 rwm",
                "allow c 508:1 rwm",
            ]
        );
        let names: Vec<String> = test_mig_host()
            .nodes_for(&mig(&[3], &[39, 40]))
            .into_iter()
            .map(|n| n.container_path)
            .collect();
        assert_eq!(
            names,
            vec![
                "/dev/nvidia3",
                "/dev/nvidia-caps/nvidia-cap39",
                "/dev/nvidia-caps/nvidia-cap40",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools"
            ]
        );
    }

    #[test]
    fn tasks_without_mig_devices_are_denied_every_caps_node() {
        // (task, caps minors it may open)
        let table: &[(TaskDevices, &[u32])] = &[
            (TaskDevices::default(), &[]),
            (TaskDevices::gpus(&[0]), &[]),
            (TaskDevices::gpus(&[3]), &[]),
            (mig(&[3], &[30, 31]), &[30, 31]),
            (mig(&[3], &[30, 31, 39, 40]), &[30, 31, 39, 40]),
        ];
        let host = test_mig_host();
        for (task, open) in table {
            let rules = task_rules(&host, task);
            for (m, n) in &host.caps {
                let (r, w) = read_write_allowed(&rules, n.major, n.minor);
                let want = open.contains(m);
                assert_eq!(
                    (r, w),
                    (want, want),
                    "cap {m} for {task:?}: {:?}",
                    text(&rules)
                );
            }
        }
        let none = task_rules(&host, &TaskDevices::default());
        assert!(none.iter().all(|r| !r.allow), "{:?}", text(&none));
        assert_eq!(none.len(), 4 + 6 + 3, "every GPU, caps and control node");
    }

    proptest::proptest! {
        /// Whatever GPUs and caps nodes a host has and a task is given:
        /// every GPU and caps node not given is denied, every one given is
        /// allowed, and the control devices are allowed exactly when a GPU
        /// or MIG device is given.
        #[test]
        fn rule_sets_deny_every_other_gpu_and_cap(
            host_minors in proptest::collection::btree_set(0u32..16, 0..8),
            host_caps in proptest::collection::btree_set(0u32..16, 0..8),
            pick in proptest::collection::vec(proptest::bool::ANY, 16),
            pick_caps in proptest::collection::vec(proptest::bool::ANY, 16),
        ) {
            let host = HostDevices {
                gpus: host_minors
                    .iter()
                    .map(|&i| (i, node(&format!("nvidia{i}"), 195, i)))
                    .collect(),
                control: host().control,
                caps: host_caps
                    .iter()
                    .map(|&i| (i, node(&format!("nvidia-caps/nvidia-cap{i}"), 240, i)))
                    .collect(),
            };
            let subset = |all: &std::collections::BTreeSet<u32>, pick: &[bool]| -> Vec<u32> {
                all.iter().copied().filter(|m| pick[*m as usize]).collect()
            };
            let task = mig(&subset(&host_minors, &pick), &subset(&host_caps, &pick_caps));
            let rules = task_rules(&host, &task);
            for (major, all, given) in [(195, &host_minors, &task.gpus), (240, &host_caps, &task.caps)] {
                for &m in all {
                    let (r, w) = read_write_allowed(&rules, major, m);
                    if given.contains(&m) {
                        proptest::prop_assert!(r && w, "{major}:{m} given but not allowed: {:?}", text(&rules));
                    } else {
                        proptest::prop_assert!(!r && !w, "{major}:{m} not given but open: {:?}", text(&rules));
                    }
                }
            }
            for c in &host.control {
                let (r, w) = read_write_allowed(&rules, c.major, c.minor);
                proptest::prop_assert_eq!(r && w, !task.is_empty(), "{:?}", text(&rules));
                proptest::prop_assert_eq!(r || w, !task.is_empty(), "{:?}", text(&rules));
            }
        }
    }
}
