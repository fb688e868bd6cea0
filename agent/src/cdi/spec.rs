//! The CDI spec format (the part gpuctl writes and reads), and the spec of
//! this agent's GPUs. PURE: plain data in, plain data out.
//!
//! Layout, after `nvidia-ctk cdi generate`: one device per GPU named by its
//! index (`gpuctl.io/gpu=0`) and one named by its UUID
//! (`gpuctl.io/gpu=GPU-...`), each adding only that GPU's node; the same
//! per MIG device (`gpuctl.io/gpu=0:1`, `gpuctl.io/gpu=MIG-...`), adding its
//! parent's node and its two caps nodes; plus `all`. What every GPU
//! container needs besides its GPUs is in the spec-wide edits: the control
//! nodes, the driver volume (read-only at `/usr/local/nvidia`) and
//! `NVIDIA_VISIBLE_DEVICES=void`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::isolation::grants::MIG_ACCESS_CAPS;
use crate::isolation::{DeviceNode as HostNode, HostDevices};

/// The version written: the newest that Podman 4.3 (Debian 12) accepts,
/// and the first with `hostPath` on device nodes, which lets the spec name
/// nodes under `--dev-root`. Later CDI versions read it too.
pub const CDI_VERSION: &str = "0.5.0";
pub const VENDOR: &str = "gpuctl.io";
pub const CLASS: &str = "gpu";
/// `nvidia.com/gpu` is the NVIDIA toolkit's; gpuctl names its own devices
/// under its own domain, as its attributes are (`gpuctl.io/...`).
pub const KIND: &str = "gpuctl.io/gpu";
/// The device holding every GPU of the host.
pub const ALL: &str = "all";
/// Options of the driver volume's mount, as the toolkit mounts the driver's
/// files: read-only, no set-uid programs, no device files.
pub const VOLUME_MOUNT_OPTIONS: &[&str] = &["ro", "nosuid", "nodev", "rbind", "rprivate"];

/// A CDI spec. Fields this code has no use for (hooks, annotations, later
/// versions' additions) are ignored when reading and never written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    #[serde(default)]
    pub devices: Vec<Device>,
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    pub name: String,
    /// Required by the schema, even when empty.
    #[serde(default)]
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// `NAME=VALUE`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

impl ContainerEdits {
    pub fn is_empty(&self) -> bool {
        self.env.is_empty() && self.device_nodes.is_empty() && self.mounts.is_empty()
    }
}

/// A device node. Type and numbers are left to the runtime, which reads
/// them from `hostPath` when it creates the container, so they are never
/// stale (nvidia-uvm's major is dynamic).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// In the container.
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

/// What the spec is made from: the GPUs discovery found, the nodes under
/// `--dev-root`, and the driver volume if one was built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecGpu {
    pub index: u32,
    pub uuid: String,
    /// NVML's minor number: its node is `nvidia<minor>`.
    pub minor: u32,
    /// Its MIG devices, in NVML's order (a MIG device's index is its place
    /// here, as the toolkit numbers them); none when MIG is off.
    pub mig: Vec<SpecMig>,
}

/// A MIG device, for the spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecMig {
    pub uuid: String,
    /// Its GPU and compute instance's access caps: the minors of
    /// `nvidia-caps/nvidia-cap<N>` (fewer than two: not known).
    pub caps: Vec<u32>,
}

impl SpecGpu {
    /// A GPU without MIG devices.
    pub fn whole(index: u32, uuid: impl Into<String>, minor: u32) -> SpecGpu {
        SpecGpu {
            index,
            uuid: uuid.into(),
            minor,
            mig: Vec::new(),
        }
    }
}

/// A generated spec, with what was left out of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generated {
    /// Without devices when no GPU has a node (nothing to write then).
    pub spec: Spec,
    /// The qualified name of each GPU and MIG device in the spec, by UUID:
    /// the UUID name when the UUID is a valid CDI name, else the index name.
    pub names: BTreeMap<String, String>,
    /// GPUs, or names of GPUs, left out, and why.
    pub skipped: Vec<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpecError {
    /// A path the spec must name is not UTF-8 (JSON strings are).
    #[error("{field}: path {path:?} is not UTF-8")]
    NotUtf8 { field: &'static str, path: String },
}

/// `KIND=NAME`.
pub fn qualified(kind: &str, name: &str) -> String {
    format!("{kind}={name}")
}

/// CDI's rule for device names: ASCII letters, digits, `_ - . :`, starting
/// and ending with a letter or digit.
pub fn valid_device_name(name: &str) -> bool {
    let b = name.as_bytes();
    let (Some(first), Some(last)) = (b.first(), b.last()) else {
        return false;
    };
    first.is_ascii_alphanumeric()
        && last.is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"_-.:".contains(c))
}

/// CDI's rule for a kind: `VENDOR/CLASS`, the vendor letters, digits and
/// `_ - .`, the class letters, digits and `_ -`, each starting with a letter
/// and ending with a letter or digit.
pub fn valid_kind(kind: &str) -> bool {
    let part = |s: &str, extra: &[u8]| {
        let b = s.as_bytes();
        matches!((b.first(), b.last()), (Some(f), Some(l)) if f.is_ascii_alphabetic() && l.is_ascii_alphanumeric())
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || extra.contains(c))
    };
    kind.split_once('/')
        .is_some_and(|(v, c)| part(v, b"_-.") && part(c, b"_-"))
}

fn utf8(field: &'static str, p: &Path) -> Result<String, SpecError> {
    p.to_str()
        .map(str::to_string)
        .ok_or_else(|| SpecError::NotUtf8 {
            field,
            path: p.display().to_string(),
        })
}

/// The devices of a spec being made, with the names taken and what was
/// left out.
#[derive(Default)]
struct Devices {
    devices: Vec<Device>,
    taken: BTreeSet<String>,
    skipped: Vec<String>,
}

impl Devices {
    /// Adds a device (`what`: "GPU", "MIG device") under its index name
    /// and, where CDI allows, its UUID name. The name task launch asks for
    /// (the UUID's, else the index's); `None` when the index name is
    /// another device's (then it is left out).
    fn add(
        &mut self,
        what: &str,
        index: String,
        uuid: &str,
        edits: ContainerEdits,
    ) -> Option<String> {
        if !self.taken.insert(index.clone()) {
            self.skipped.push(format!(
                "{what} {uuid}: name {index} is another device's too"
            ));
            return None;
        }
        self.devices.push(Device {
            name: index.clone(),
            container_edits: edits.clone(),
        });
        if !valid_device_name(uuid) || uuid == ALL {
            self.skipped.push(format!(
                "{what} {uuid:?} ({index}): its UUID is not a valid CDI device name; only {index} names it"
            ));
            return Some(index);
        }
        if !self.taken.insert(uuid.to_string()) {
            self.skipped
                .push(format!("{what} {uuid}: UUID named twice"));
            return Some(index);
        }
        self.devices.push(Device {
            name: uuid.to_string(),
            container_edits: edits,
        });
        Some(uuid.to_string())
    }
}

fn device_node(node: &HostNode) -> Result<DeviceNode, SpecError> {
    Ok(DeviceNode {
        path: node.container_path.clone(),
        host_path: Some(utf8("deviceNodes.hostPath", &node.host_path)?),
    })
}

/// A MIG device's caps nodes, or why it cannot be in the spec: caps not
/// known, or a caps node missing under the dev root. Never one without its
/// caps: the parent's node alone is no use, and a MIG device is named
/// only when it is isolated.
fn mig_caps<'a>(host: &'a HostDevices, m: &SpecMig) -> Result<Vec<&'a HostNode>, String> {
    if m.caps.len() < MIG_ACCESS_CAPS {
        return Err(format!(
            "MIG device {}: the minors of its nvidia-caps nodes are not known",
            m.uuid
        ));
    }
    m.caps
        .iter()
        .map(|c| {
            host.caps
                .iter()
                .find(|(n, _)| n == c)
                .map(|(_, node)| node)
                .ok_or_else(|| {
                    format!(
                        "MIG device {}: no device node {}",
                        m.uuid,
                        crate::isolation::devices::cap_node_name(*c)
                    )
                })
        })
        .collect()
}

/// The spec of these GPUs and their MIG devices. A GPU whose node is not
/// under the dev root is left out (a request for it could only fail), with
/// its MIG devices; so is a MIG device whose caps nodes are unknown or
/// missing, and a UUID name that CDI would refuse (the index name stays).
pub fn generate(
    gpus: &[SpecGpu],
    host: &HostDevices,
    driver_volume: Option<&Path>,
) -> Result<Generated, SpecError> {
    let mut gpus: Vec<&SpecGpu> = gpus.iter().collect();
    gpus.sort_by_key(|g| (g.index, g.minor));
    let mut out = Devices::default();
    let mut names = BTreeMap::new();
    let mut all_nodes: Vec<DeviceNode> = Vec::new();
    for g in gpus {
        let Some((_, node)) = host.gpus.iter().find(|(m, _)| *m == g.minor) else {
            out.skipped.push(format!(
                "GPU {} (index {}): no device node nvidia{}",
                g.uuid, g.index, g.minor
            ));
            continue;
        };
        let parent = device_node(node)?;
        let edits = ContainerEdits {
            device_nodes: vec![parent.clone()],
            ..Default::default()
        };
        let Some(name) = out.add("GPU", g.index.to_string(), &g.uuid, edits) else {
            continue;
        };
        names.insert(g.uuid.clone(), qualified(KIND, &name));
        all_nodes.push(parent.clone());
        for (j, m) in g.mig.iter().enumerate() {
            let caps = match mig_caps(host, m) {
                Ok(c) => c,
                Err(why) => {
                    out.skipped.push(why);
                    continue;
                }
            };
            let mut nodes = vec![parent.clone()];
            for c in caps {
                nodes.push(device_node(c)?);
            }
            let edits = ContainerEdits {
                device_nodes: nodes.clone(),
                ..Default::default()
            };
            if let Some(name) = out.add("MIG device", format!("{}:{j}", g.index), &m.uuid, edits) {
                names.insert(m.uuid.clone(), qualified(KIND, &name));
                all_nodes.extend(nodes.into_iter().skip(1));
            }
        }
    }
    let Devices {
        mut devices,
        skipped,
        ..
    } = out;
    let mut container_edits = ContainerEdits::default();
    if !devices.is_empty() {
        devices.push(Device {
            name: ALL.to_string(),
            container_edits: ContainerEdits {
                device_nodes: all_nodes,
                ..Default::default()
            },
        });
        for node in &host.control {
            container_edits.device_nodes.push(device_node(node)?);
        }
        if let Some(v) = driver_volume {
            container_edits.mounts.push(Mount {
                host_path: utf8("mounts.hostPath", v)?,
                container_path: crate::volume::CONTAINER_PATH.to_string(),
                options: VOLUME_MOUNT_OPTIONS.iter().map(|o| o.to_string()).collect(),
            });
        }
        // The devices come from CDI: keep the NVIDIA runtime's own hook
        // (an image saying NVIDIA_VISIBLE_DEVICES=all) from adding more.
        // PATH and LD_LIBRARY_PATH are not set: CDI replaces a variable
        // the image sets, and images that set their own would lose theirs.
        container_edits
            .env
            .push("NVIDIA_VISIBLE_DEVICES=void".to_string());
    }
    Ok(Generated {
        spec: Spec {
            cdi_version: CDI_VERSION.to_string(),
            kind: KIND.to_string(),
            devices,
            container_edits,
        },
        names,
        skipped,
    })
}

/// The spec as written: pretty JSON and a final newline, so that a spec
/// that did not change is byte for byte the same.
pub fn to_json(spec: &Spec) -> Vec<u8> {
    // Cannot fail: plain structs of strings, no maps with non-string keys.
    let mut out = serde_json::to_vec_pretty(spec).unwrap_or_default();
    out.push(b'\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isolation::rules::test_host;

    fn gpus(n: u32) -> Vec<SpecGpu> {
        (0..n)
            .map(|i| SpecGpu::whole(i, format!("GPU-0000000{i}-1111-2222-3333-444444444444"), i))
            .collect()
    }

    fn device<'a>(spec: &'a Spec, name: &str) -> &'a Device {
        spec.devices
            .iter()
            .find(|d| d.name == name)
            .unwrap_or_else(|| panic!("no device {name}"))
    }

    fn nodes(edits: &ContainerEdits) -> Vec<(&str, Option<&str>)> {
        edits
            .device_nodes
            .iter()
            .map(|n| (n.path.as_str(), n.host_path.as_deref()))
            .collect()
    }

    #[test]
    fn every_gpu_is_named_by_index_and_uuid_and_all_holds_them() {
        let volume = Path::new("/var/lib/gpuctl/agent/volumes/nvidia_535.129.03");
        let g = generate(&gpus(2), &test_host(), Some(volume)).unwrap();
        assert!(g.skipped.is_empty(), "{:?}", g.skipped);
        let s = &g.spec;
        assert_eq!((s.cdi_version.as_str(), s.kind.as_str()), ("0.5.0", KIND));
        let names: Vec<&str> = s.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "0",
                "GPU-00000000-1111-2222-3333-444444444444",
                "1",
                "GPU-00000001-1111-2222-3333-444444444444",
                "all"
            ]
        );
        for name in ["1", "GPU-00000001-1111-2222-3333-444444444444"] {
            assert_eq!(
                nodes(&device(s, name).container_edits),
                [("/dev/nvidia1", Some("/dev/nvidia1"))],
                "{name}: its GPU's node and nothing else"
            );
        }
        assert_eq!(
            nodes(&device(s, "all").container_edits),
            [
                ("/dev/nvidia0", Some("/dev/nvidia0")),
                ("/dev/nvidia1", Some("/dev/nvidia1"))
            ]
        );
        // Only GPUs this agent reports: the host's other two are not given.
        assert!(!names.contains(&"2"));
        let e = &s.container_edits;
        assert_eq!(
            nodes(e),
            [
                ("/dev/nvidiactl", Some("/dev/nvidiactl")),
                ("/dev/nvidia-uvm", Some("/dev/nvidia-uvm")),
                ("/dev/nvidia-uvm-tools", Some("/dev/nvidia-uvm-tools"))
            ]
        );
        assert_eq!(
            e.mounts,
            [Mount {
                host_path: volume.display().to_string(),
                container_path: "/usr/local/nvidia".into(),
                options: vec![
                    "ro".into(),
                    "nosuid".into(),
                    "nodev".into(),
                    "rbind".into(),
                    "rprivate".into()
                ],
            }]
        );
        assert_eq!(e.env, ["NVIDIA_VISIBLE_DEVICES=void"]);
        assert_eq!(
            g.names["GPU-00000001-1111-2222-3333-444444444444"],
            "gpuctl.io/gpu=GPU-00000001-1111-2222-3333-444444444444"
        );
    }

    /// GPUs 0 to 3; GPU 3 in MIG mode with MIG-a (caps 30, 31), MIG-b (39,
    /// 40), MIG-c (caps unknown) and MIG-d (caps 50, 51: no nodes).
    fn mig_gpus() -> Vec<SpecGpu> {
        let mut list = gpus(4);
        let mig = |uuid: &str, caps: &[u32]| SpecMig {
            uuid: uuid.into(),
            caps: caps.to_vec(),
        };
        list[3].mig = vec![
            mig("MIG-a", &[30, 31]),
            mig("MIG-b", &[39, 40]),
            mig("MIG-c", &[]),
            mig("MIG-d", &[50, 51]),
        ];
        list
    }

    #[test]
    fn mig_devices_are_named_by_place_and_uuid_with_their_parent_and_caps() {
        use crate::isolation::rules::test_mig_host;
        let g = generate(&mig_gpus(), &test_mig_host(), None).unwrap();
        let names: Vec<&str> = g.spec.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            &names[6..],
            [
                "3",
                "GPU-00000003-1111-2222-3333-444444444444",
                "3:0",
                "MIG-a",
                "3:1",
                "MIG-b",
                "all"
            ]
        );
        for name in ["3:0", "MIG-a"] {
            assert_eq!(
                nodes(&device(&g.spec, name).container_edits),
                [
                    ("/dev/nvidia3", Some("/dev/nvidia3")),
                    (
                        "/dev/nvidia-caps/nvidia-cap30",
                        Some("/dev/nvidia-caps/nvidia-cap30")
                    ),
                    (
                        "/dev/nvidia-caps/nvidia-cap31",
                        Some("/dev/nvidia-caps/nvidia-cap31")
                    ),
                ],
                "{name}"
            );
        }
        assert_eq!(g.names["MIG-b"], "gpuctl.io/gpu=MIG-b");
        // Never a MIG device without its caps.
        assert!(!g.names.contains_key("MIG-c") && !g.names.contains_key("MIG-d"));
        assert_eq!(g.skipped.len(), 2, "{:?}", g.skipped);
        assert!(g.skipped[0].contains("MIG-c") && g.skipped[0].contains("not known"));
        assert!(g.skipped[1].contains("MIG-d") && g.skipped[1].contains("nvidia-cap50"));
        // all: every GPU and the MIG devices' caps, never mig-config (1)
        // or mig-monitor (2).
        let all: Vec<&str> = device(&g.spec, "all")
            .container_edits
            .device_nodes
            .iter()
            .map(|n| n.path.as_str())
            .collect();
        assert_eq!(
            all,
            [
                "/dev/nvidia0",
                "/dev/nvidia1",
                "/dev/nvidia2",
                "/dev/nvidia3",
                "/dev/nvidia-caps/nvidia-cap30",
                "/dev/nvidia-caps/nvidia-cap31",
                "/dev/nvidia-caps/nvidia-cap39",
                "/dev/nvidia-caps/nvidia-cap40"
            ]
        );
    }

    #[test]
    fn host_paths_follow_the_dev_root_and_container_paths_do_not() {
        let mut host = test_host();
        for (_, n) in &mut host.gpus {
            n.host_path = Path::new("/tmp/fake-dev").join(&n.container_path[5..]);
        }
        let g = generate(&gpus(1), &host, None).unwrap();
        assert_eq!(
            nodes(&device(&g.spec, "0").container_edits),
            [("/dev/nvidia0", Some("/tmp/fake-dev/nvidia0"))]
        );
        assert!(
            g.spec.container_edits.mounts.is_empty(),
            "no volume, no mount"
        );
    }

    #[test]
    fn a_gpu_without_a_node_is_left_out_and_said() {
        let mut list = gpus(2);
        list[1].minor = 7;
        let g = generate(&list, &test_host(), None).unwrap();
        let names: Vec<&str> = g.spec.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            names,
            ["0", "GPU-00000000-1111-2222-3333-444444444444", "all"]
        );
        assert_eq!(g.skipped.len(), 1);
        assert!(g.skipped[0].contains("nvidia7"), "{:?}", g.skipped);
        assert!(!g
            .names
            .contains_key("GPU-00000001-1111-2222-3333-444444444444"));
    }

    #[test]
    fn no_gpu_node_gives_a_spec_without_devices_or_edits() {
        let g = generate(&gpus(2), &HostDevices::default(), None).unwrap();
        assert!(g.spec.devices.is_empty());
        assert!(g.spec.container_edits.is_empty());
        let none = generate(&[], &test_host(), None).unwrap();
        assert!(none.spec.devices.is_empty() && none.skipped.is_empty());
    }

    #[test]
    fn a_uuid_cdi_refuses_is_named_by_index_only() {
        let mut list = gpus(1);
        list[0].uuid = "GPU with spaces".into();
        let g = generate(&list, &test_host(), None).unwrap();
        let names: Vec<&str> = g.spec.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["0", "all"]);
        assert_eq!(g.names["GPU with spaces"], "gpuctl.io/gpu=0");
        assert!(g.skipped[0].contains("not a valid CDI device name"));
    }

    #[test]
    fn two_gpus_claiming_one_index_keep_the_first() {
        let mut list = gpus(2);
        list[1].index = 0;
        let g = generate(&list, &test_host(), None).unwrap();
        let zeros = g.spec.devices.iter().filter(|d| d.name == "0").count();
        assert_eq!(zeros, 1);
        assert_eq!(g.skipped.len(), 1, "{:?}", g.skipped);
    }

    #[test]
    fn a_path_that_is_not_utf8_is_an_error_naming_the_field() {
        use std::os::unix::ffi::OsStrExt;
        let bad = Path::new(std::ffi::OsStr::from_bytes(b"/var/lib/\xff"));
        let e = generate(&gpus(1), &test_host(), Some(bad)).unwrap_err();
        assert!(e.to_string().contains("mounts.hostPath"), "{e}");
    }

    #[test]
    fn names_follow_cdi_rules() {
        for ok in ["0", "all", "GPU-8e7a-11", "MIG-1:2", "a_b.c"] {
            assert!(valid_device_name(ok), "{ok}");
        }
        for bad in ["", "-0", "0-", "a b", "a/b", "a=b", "é"] {
            assert!(!valid_device_name(bad), "{bad:?}");
        }
        for ok in [KIND, "nvidia.com/gpu", "k8s.device-plugin.nvidia.com/gpu"] {
            assert!(valid_kind(ok), "{ok}");
        }
        for bad in ["gpu", "/gpu", "a/b.c", "1a/b", "a/b/c", "a/"] {
            assert!(!valid_kind(bad), "{bad:?}");
        }
    }

    /// The CDI schema of the version written (agent/tests/data/cdi-schema).
    fn cdi_schema() -> jsonschema::Validator {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/cdi-schema");
        let read = |f: &str| -> serde_json::Value {
            serde_json::from_slice(&std::fs::read(dir.join(f)).unwrap()).unwrap()
        };
        // schema.json refers to "defs.json#/definitions/...", relative to itself.
        let registry = jsonschema::Registry::new()
            .add("file:///cdi-schema/defs.json", read("defs.json"))
            .unwrap()
            .prepare()
            .unwrap();
        jsonschema::options()
            .with_base_uri("file:///cdi-schema/schema.json")
            .with_registry(&registry)
            .build(&read("schema.json"))
            .unwrap()
    }

    fn schema_errors(v: &jsonschema::Validator, spec: &serde_json::Value) -> Vec<String> {
        v.iter_errors(spec).map(|e| e.to_string()).collect()
    }

    #[test]
    fn generated_specs_are_valid_against_the_cdi_schema() {
        let v = cdi_schema();
        let volume = Path::new("/var/lib/gpuctl/agent/volumes/nvidia_535.129.03");
        let mut odd = gpus(3);
        odd[2].uuid = "not a name".into();
        for (what, g) in [
            (
                "two GPUs, a volume",
                generate(&gpus(2), &test_host(), Some(volume)),
            ),
            ("no volume", generate(&gpus(4), &test_host(), None)),
            (
                "no control nodes",
                generate(
                    &gpus(1),
                    &HostDevices {
                        control: vec![],
                        ..test_host()
                    },
                    None,
                ),
            ),
            ("a UUID that is no name", generate(&odd, &test_host(), None)),
            (
                "MIG devices",
                generate(&mig_gpus(), &crate::isolation::rules::test_mig_host(), None),
            ),
        ] {
            let json: serde_json::Value =
                serde_json::from_slice(&to_json(&g.unwrap().spec)).unwrap();
            assert_eq!(schema_errors(&v, &json), Vec::<String>::new(), "{what}");
        }
    }

    #[test]
    fn the_schema_check_refuses_broken_specs() {
        // The validator bites: each of these breaks one rule of the schema.
        let v = cdi_schema();
        let good =
            serde_json::to_value(generate(&gpus(1), &test_host(), None).unwrap().spec).unwrap();
        assert!(schema_errors(&v, &good).is_empty());
        let broken = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut s = good.clone();
            f(&mut s);
            schema_errors(&v, &s)
        };
        type Break<'a> = &'a dyn Fn(&mut serde_json::Value);
        let cases: [(&str, Break); 5] = [
            ("no cdiVersion", &|s| {
                s.as_object_mut().unwrap().remove("cdiVersion");
            }),
            ("no device name", &|s| {
                s["devices"][0].as_object_mut().unwrap().remove("name");
            }),
            ("no device edits", &|s| {
                s["devices"][0]
                    .as_object_mut()
                    .unwrap()
                    .remove("containerEdits");
            }),
            ("node without path", &|s| {
                s["devices"][0]["containerEdits"]["deviceNodes"][0] =
                    serde_json::json!({"hostPath": "/dev/nvidia0"});
            }),
            ("mount without containerPath", &|s| {
                s["devices"][0]["containerEdits"]["mounts"] =
                    serde_json::json!([{"hostPath": "/x"}]);
            }),
        ];
        for (what, f) in cases {
            assert!(!broken(f).is_empty(), "{what} passed the schema");
        }
    }

    #[test]
    fn the_json_is_stable_and_reads_back() {
        let g = generate(&gpus(2), &test_host(), None).unwrap();
        let a = to_json(&g.spec);
        assert_eq!(
            a,
            to_json(&generate(&gpus(2), &test_host(), None).unwrap().spec)
        );
        assert!(a.ends_with(b"}\n"));
        let back: Spec = serde_json::from_slice(&a).unwrap();
        assert_eq!(back, g.spec);
        let text = String::from_utf8(a).unwrap();
        assert!(text.contains("\"cdiVersion\": \"0.5.0\""), "{text}");
        assert!(text.contains("\"hostPath\": \"/dev/nvidia0\""), "{text}");
        assert!(text.contains("\"containerEdits\""), "{text}");
    }
}
