//! The NVIDIA container toolkit's own spec (`nvidia-ctk cdi generate`,
//! kind `nvidia.com/gpu`), where a host has one: it is what the operator
//! set up for their runtimes, so where it names one of this agent's GPUs
//! its name is the one gpuctl asks Docker for.
//!
//! A GPU is the toolkit's device of the same UUID (`nvidia.com/gpu=GPU-...`,
//! `--device-name-strategy=uuid`), else the device named by its index whose
//! nodes include the GPU's own node (`nvidia.com/gpu=0`, the default
//! strategy; the node check keeps an index NVML renumbered from naming
//! another GPU). A MIG device likewise: by its UUID
//! (`nvidia.com/gpu=MIG-...`), else by `<gpu-index>:<mig-index>` whose
//! nodes include its parent's node and both its caps nodes. As in CDI, a
//! spec in a later directory overrides one in an earlier; a name defined
//! twice in one directory is refused by CDI, and so is not used.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::spec::{qualified, Device, Spec, SpecGpu};
use super::{CdiDevice, CdiError};
use crate::isolation::devices::cap_node_name;
use crate::isolation::grants::MIG_ACCESS_CAPS;

pub const TOOLKIT_KIND: &str = "nvidia.com/gpu";
/// A spec file larger than this is not read (the toolkit's are a few KiB).
pub const MAX_SPEC_SIZE: u64 = 16 << 20;

/// A spec read from a CDI directory.
#[derive(Debug, Clone)]
pub struct Found {
    /// The directory's place in the search order: higher overrides lower.
    pub priority: usize,
    /// The directory, symlinks resolved (Docker reports its own resolved).
    pub dir: PathBuf,
    pub path: PathBuf,
    pub spec: Spec,
}

/// Where a device name is defined: the directory's priority, and the
/// device with its spec's directory (`None` when two specs of one directory
/// both define it).
type Definition<'a> = (usize, Option<(&'a Device, &'a Path)>);

/// The toolkit's name for each GPU and MIG device it names, by UUID. PURE.
pub fn toolkit_names(found: &[Found], gpus: &[SpecGpu]) -> BTreeMap<String, CdiDevice> {
    let mut defs: BTreeMap<&str, Definition> = BTreeMap::new();
    for f in found.iter().filter(|f| f.spec.kind == TOOLKIT_KIND) {
        for d in &f.spec.devices {
            let new = (f.priority, Some((d, f.dir.as_path())));
            match defs.get(d.name.as_str()) {
                Some((p, _)) if *p > f.priority => {}
                Some((p, _)) if *p == f.priority => {
                    defs.insert(&d.name, (f.priority, None));
                }
                _ => {
                    defs.insert(&d.name, new);
                }
            }
        }
    }
    let lookup = |name: &str| defs.get(name).and_then(|(_, d)| *d);
    // (UUID, index name, the nodes the index name's device must have)
    let mut wanted: Vec<(&str, String, Vec<String>)> = Vec::new();
    for g in gpus {
        let node = format!("/dev/nvidia{}", g.minor);
        wanted.push((&g.uuid, g.index.to_string(), vec![node.clone()]));
        for (j, m) in g.mig.iter().enumerate() {
            // Without its caps a MIG device's index name cannot be told
            // from another's of the same parent: by UUID only then.
            let nodes = if m.caps.len() < MIG_ACCESS_CAPS {
                Vec::new()
            } else {
                std::iter::once(node.clone())
                    .chain(m.caps.iter().map(|c| format!("/dev/{}", cap_node_name(*c))))
                    .collect()
            };
            wanted.push((&m.uuid, format!("{}:{j}", g.index), nodes));
        }
    }
    let mut out = BTreeMap::new();
    for (uuid, index, nodes) in wanted {
        let by_uuid = lookup(uuid).map(|d| (uuid.to_string(), d));
        let by_index = || {
            lookup(&index)
                .filter(|(d, _)| {
                    !nodes.is_empty()
                        && nodes.iter().all(|want| {
                            d.container_edits
                                .device_nodes
                                .iter()
                                .any(|n| &n.path == want)
                        })
                })
                .map(|d| (index.clone(), d))
        };
        if let Some((name, (_, dir))) = by_uuid.or_else(by_index) {
            out.insert(
                uuid.to_string(),
                CdiDevice {
                    name: qualified(TOOLKIT_KIND, &name),
                    spec_dir: dir.to_path_buf(),
                },
            );
        }
    }
    out
}

/// Reads every CDI spec file (`*.json`, `*.yaml`) of `dirs`, in that
/// order of priority, but `skip` (gpuctl's own). A missing directory has
/// none. Returns what was read and, per file, why it could not be.
pub fn read_specs(dirs: &[PathBuf], skip: &Path) -> (Vec<Found>, Vec<CdiError>) {
    let mut found = Vec::new();
    let mut problems = Vec::new();
    let mut seen = Vec::new();
    // Compared with paths under the resolved directories.
    let skip = skip
        .parent()
        .and_then(|d| std::fs::canonicalize(d).ok())
        .zip(skip.file_name())
        .map(|(d, name)| d.join(name));
    for (priority, dir) in dirs.iter().enumerate() {
        let Ok(real) = std::fs::canonicalize(dir) else {
            continue; // missing: no specs there
        };
        if seen.contains(&real) {
            continue;
        }
        seen.push(real.clone());
        let entries = match std::fs::read_dir(&real) {
            Ok(e) => e,
            Err(source) => {
                problems.push(CdiError::Io {
                    op: "read directory",
                    path: dir.clone(),
                    source,
                });
                continue;
            }
        };
        let mut paths: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                matches!(
                    p.extension().and_then(|e| e.to_str()),
                    Some("json" | "yaml")
                )
            })
            .collect();
        paths.sort();
        for path in paths {
            if skip.as_ref() == Some(&path) {
                continue;
            }
            match read_spec(&path) {
                Ok(spec) => found.push(Found {
                    priority,
                    dir: real.clone(),
                    path,
                    spec,
                }),
                Err(e) => problems.push(e),
            }
        }
    }
    (found, problems)
}

/// One spec file, YAML or JSON by its extension.
pub fn read_spec(path: &Path) -> Result<Spec, CdiError> {
    let io = |op, source| CdiError::Io {
        op,
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(|e| io("stat", e))?;
    if !meta.is_file() {
        return Err(CdiError::Parse {
            path: path.to_path_buf(),
            reason: "not a regular file".into(),
        });
    }
    if meta.len() > MAX_SPEC_SIZE {
        return Err(CdiError::Parse {
            path: path.to_path_buf(),
            reason: format!("{} bytes, more than {MAX_SPEC_SIZE}", meta.len()),
        });
    }
    let data = std::fs::read(path).map_err(|e| io("read", e))?;
    let parsed = if path.extension().is_some_and(|e| e == "json") {
        serde_json::from_slice(&data).map_err(|e| e.to_string())
    } else {
        serde_yaml_ng::from_slice(&data).map_err(|e| e.to_string())
    };
    parsed.map_err(|reason| CdiError::Parse {
        path: path.to_path_buf(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `nvidia-ctk cdi generate --device-name-strategy=index
    /// --device-name-strategy=uuid` writes for two GPUs (hooks and most
    /// mounts cut; the parser must skip what it does not use).
    fn nvidia_ctk_yaml(driver_version: &str) -> String {
        format!(
            r#"---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
    - name: "0"
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia0
            - path: /dev/dri/card1
            - path: /dev/dri/renderD128
        hooks:
            - hookName: createContainer
              path: /usr/bin/nvidia-cdi-hook
              args: [nvidia-cdi-hook, create-symlinks, --link, ../card1::/dev/dri/by-path/pci-0000:07:00.0-card]
    - name: GPU-aaaaaaaa-0000-0000-0000-000000000000
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia0
    - name: "1"
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia1
    - name: GPU-bbbbbbbb-0000-0000-0000-000000000000
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia1
    - name: all
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia0
            - path: /dev/nvidia1
containerEdits:
    env:
        - NVIDIA_VISIBLE_DEVICES=void
    deviceNodes:
        - path: /dev/nvidia-modeset
        - path: /dev/nvidia-uvm
        - path: /dev/nvidia-uvm-tools
        - path: /dev/nvidiactl
    hooks:
        - hookName: createContainer
          path: /usr/bin/nvidia-cdi-hook
          args: [nvidia-cdi-hook, update-ldcache, --folder, /usr/lib/x86_64-linux-gnu]
          env: [NVIDIA_CTK_DEBUG=false]
    mounts:
        - hostPath: /usr/lib/x86_64-linux-gnu/libcuda.so.{driver_version}
          containerPath: /usr/lib/x86_64-linux-gnu/libcuda.so.{driver_version}
          options: [ro, nosuid, nodev, rbind, rprivate]
"#
        )
    }

    fn gpu(index: u32, uuid: &str, minor: u32) -> SpecGpu {
        SpecGpu::whole(index, uuid, minor)
    }

    const A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
    const B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000000";

    fn found(priority: usize, dir: &str, spec: Spec) -> Found {
        Found {
            priority,
            dir: dir.into(),
            path: Path::new(dir).join("nvidia.yaml"),
            spec,
        }
    }

    fn yaml(text: &str) -> Spec {
        serde_yaml_ng::from_str(text).unwrap()
    }

    fn names(m: &BTreeMap<String, CdiDevice>) -> Vec<(&str, &str, &Path)> {
        m.iter()
            .map(|(u, d)| (u.as_str(), d.name.as_str(), d.spec_dir.as_path()))
            .collect()
    }

    #[test]
    fn the_toolkit_names_our_gpus_by_uuid_first() {
        let f = [found(1, "/run/cdi", yaml(&nvidia_ctk_yaml("535.129.03")))];
        let ours = [gpu(0, A, 0), gpu(1, B, 1), gpu(2, "GPU-cccc", 2)];
        assert_eq!(
            names(&toolkit_names(&f, &ours)),
            [
                (
                    A,
                    "nvidia.com/gpu=GPU-aaaaaaaa-0000-0000-0000-000000000000",
                    Path::new("/run/cdi")
                ),
                (
                    B,
                    "nvidia.com/gpu=GPU-bbbbbbbb-0000-0000-0000-000000000000",
                    Path::new("/run/cdi")
                ),
            ],
            "a GPU the toolkit does not name keeps gpuctl's own"
        );
    }

    #[test]
    fn an_index_name_counts_only_when_its_node_is_the_gpus() {
        // The default strategy: index names only.
        let text = nvidia_ctk_yaml("535.129.03")
            .replace(&format!("    - name: {A}\n"), "    - name: x-a\n")
            .replace(&format!("    - name: {B}\n"), "    - name: x-b\n");
        let f = [found(0, "/etc/cdi", yaml(&text))];
        // GPU index 1 has minor 1: the toolkit's "1" is it.
        // GPU index 0 has minor 3 here: the toolkit's "0" holds nvidia0,
        // another GPU, so it is not used.
        let ours = [gpu(0, A, 3), gpu(1, B, 1)];
        assert_eq!(
            names(&toolkit_names(&f, &ours)),
            [(B, "nvidia.com/gpu=1", Path::new("/etc/cdi"))]
        );
    }

    /// What the toolkit writes for a MIG device (`<gpu>:<mig>` and, with
    /// the uuid strategy, its UUID): the parent's node and its GI and CI
    /// access caps.
    const MIG_YAML: &str = r#"---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
    - name: "0:0"
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia0
            - path: /dev/nvidia-caps/nvidia-cap21
            - path: /dev/nvidia-caps/nvidia-cap22
    - name: "0:1"
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia0
            - path: /dev/nvidia-caps/nvidia-cap30
            - path: /dev/nvidia-caps/nvidia-cap31
    - name: MIG-11111111-0000-0000-0000-000000000000
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia0
            - path: /dev/nvidia-caps/nvidia-cap21
            - path: /dev/nvidia-caps/nvidia-cap22
"#;

    #[test]
    fn the_toolkit_names_mig_devices_by_uuid_or_by_place_with_their_caps() {
        use super::super::spec::SpecMig;
        let f = [found(1, "/run/cdi", yaml(MIG_YAML))];
        let mig = |uuid: &str, caps: &[u32]| SpecMig {
            uuid: uuid.into(),
            caps: caps.to_vec(),
        };
        let mut g = gpu(0, A, 0);
        g.mig = vec![
            // By UUID.
            mig("MIG-11111111-0000-0000-0000-000000000000", &[21, 22]),
            // Not named by UUID: "0:1" holds its caps.
            mig("MIG-2", &[30, 31]),
            // "0:2" is not in the spec.
            mig("MIG-3", &[39, 40]),
        ];
        let n = toolkit_names(&f, std::slice::from_ref(&g));
        assert_eq!(
            names(&n),
            [
                (
                    "MIG-11111111-0000-0000-0000-000000000000",
                    "nvidia.com/gpu=MIG-11111111-0000-0000-0000-000000000000",
                    Path::new("/run/cdi")
                ),
                ("MIG-2", "nvidia.com/gpu=0:1", Path::new("/run/cdi")),
            ]
        );
        // Its place names a device with other caps (NVML numbered them
        // otherwise), or its caps are unknown: not that name.
        g.mig = vec![mig("MIG-x", &[39, 40]), mig("MIG-y", &[])];
        assert!(toolkit_names(&f, &[g]).is_empty());
    }

    #[test]
    fn later_directories_override_and_same_directory_duplicates_are_dropped() {
        let one = |name: &str, node: &str| {
            yaml(&format!(
                "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n  - name: \"{name}\"\n    containerEdits:\n      deviceNodes:\n        - path: {node}\n"
            ))
        };
        let ours = [gpu(0, A, 0)];
        // /var/run/cdi (priority 1) overrides /etc/cdi (0).
        let f = [
            found(0, "/etc/cdi", one(A, "/dev/nvidia0")),
            found(1, "/run/cdi", one(A, "/dev/nvidia0")),
        ];
        assert_eq!(names(&toolkit_names(&f, &ours))[0].2, Path::new("/run/cdi"));
        let f = [
            found(1, "/run/cdi", one(A, "/dev/nvidia0")),
            found(0, "/etc/cdi", one(A, "/dev/nvidia0")),
        ];
        assert_eq!(names(&toolkit_names(&f, &ours))[0].2, Path::new("/run/cdi"));
        // Two files in one directory: CDI refuses the name; so do we.
        let f = [
            found(1, "/run/cdi", one(A, "/dev/nvidia0")),
            found(1, "/run/cdi", one(A, "/dev/nvidia0")),
        ];
        assert!(toolkit_names(&f, &ours).is_empty());
        // Another kind (the Kubernetes device plugin's) is not the toolkit's.
        let mut other = one(A, "/dev/nvidia0");
        other.kind = "k8s.device-plugin.nvidia.com/gpu".into();
        assert!(toolkit_names(&[found(1, "/run/cdi", other)], &ours).is_empty());
    }

    #[test]
    fn specs_are_read_from_directories_in_order_and_bad_files_are_named() {
        let etc = tempfile::tempdir().unwrap();
        let run = tempfile::tempdir().unwrap();
        std::fs::write(
            etc.path().join("nvidia.yaml"),
            nvidia_ctk_yaml("535.129.03"),
        )
        .unwrap();
        let as_json = serde_json::to_string(&yaml(&nvidia_ctk_yaml("550.54.15"))).unwrap();
        std::fs::write(run.path().join("nvidia.json"), as_json).unwrap();
        std::fs::write(run.path().join("broken.yaml"), "cdiVersion: [").unwrap();
        std::fs::write(run.path().join("notes.txt"), "not a spec").unwrap();
        let ours = run.path().join("gpuctl.io-gpu.json");
        std::fs::write(&ours, "{}").unwrap();
        let missing = etc.path().join("missing");
        let dirs = [etc.path().to_path_buf(), run.path().to_path_buf(), missing];
        let (found, problems) = read_specs(&dirs, &ours);
        let read: Vec<(usize, &str)> = found
            .iter()
            .map(|f| (f.priority, f.path.file_name().unwrap().to_str().unwrap()))
            .collect();
        assert_eq!(read, [(0, "nvidia.yaml"), (1, "nvidia.json")]);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].to_string().contains("broken.yaml"),
            "{}",
            problems[0]
        );
        let n = toolkit_names(&found, &[gpu(0, A, 0)]);
        assert_eq!(n[A].spec_dir, std::fs::canonicalize(run.path()).unwrap());
    }

    #[test]
    fn a_huge_or_odd_file_is_refused_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("d.yaml");
        std::fs::create_dir(&sub).unwrap();
        let e = read_spec(&sub).unwrap_err().to_string();
        assert!(
            e.contains("d.yaml") && e.contains("not a regular file"),
            "{e}"
        );
        let big = dir.path().join("big.json");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(MAX_SPEC_SIZE + 1).unwrap();
        let e = read_spec(&big).unwrap_err().to_string();
        assert!(e.contains("big.json") && e.contains("bytes"), "{e}");
    }
}
