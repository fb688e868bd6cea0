//! CDI (Container Device Interface): the agent describes its GPUs in a CDI
//! spec, so that any CDI runtime (Podman, Docker 25+, containerd, CRI-O)
//! can give a container one of them by name (`--device gpuctl.io/gpu=0`),
//! and gives its own Docker containers their GPUs through CDI when the
//! daemon takes CDI device requests.
//!
//! - [`spec`] (PURE): the spec format and the spec of this agent's GPUs;
//! - [`toolkit`]: the NVIDIA toolkit's own spec, whose names are preferred
//!   where it names our GPUs;
//! - [`Publisher`]: writes the spec (atomically, only when it changed) and
//!   keeps it in step with the device nodes, and publishes each GPU's name
//!   ([`Names`]) for task launch.
//!
//! See docs/isolation.md, "CDI".

pub mod spec;
pub mod toolkit;

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

pub use spec::{SpecGpu, SpecMig, KIND};

/// CDI's directory for specs that describe the running system (cleared at
/// boot, read after `/etc/cdi`, so it overrides it).
pub const DEFAULT_DIR: &str = "/var/run/cdi";
/// Where CDI runtimes look by default, lowest priority first.
pub const STANDARD_DIRS: &[&str] = &["/etc/cdi", "/var/run/cdi"];
/// gpuctl's spec file, named as CDI's own tools name them (`VENDOR-CLASS`).
pub const SPEC_FILE: &str = "gpuctl.io-gpu.json";
/// How often the spec is checked against the device nodes and the file.
pub const REFRESH: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a CDI spec: {reason}")]
    Parse { path: PathBuf, reason: String },
    #[error("CDI spec: {0}")]
    Spec(#[from] spec::SpecError),
}

/// A GPU's CDI name, and the directory of the spec that defines it (a
/// runtime must read that directory to resolve the name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdiDevice {
    /// Fully qualified: `gpuctl.io/gpu=GPU-...`.
    pub name: String,
    /// Symlinks resolved (Docker reports its directories resolved).
    pub spec_dir: PathBuf,
}

/// Each GPU's CDI name by UUID, as the last refresh found them; shared
/// between the [`Publisher`] and task launch.
#[derive(Debug, Clone, Default)]
pub struct Names(Arc<Mutex<BTreeMap<String, CdiDevice>>>);

impl Names {
    /// Replaces the names; whether they changed.
    pub fn set(&self, names: BTreeMap<String, CdiDevice>) -> bool {
        let mut n = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let changed = *n != names;
        *n = names;
        changed
    }

    pub fn get(&self) -> BTreeMap<String, CdiDevice> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The names of these GPUs, in their order; none unless every one has
    /// a name (a container gets all its GPUs one way).
    pub fn for_gpus(&self, uuids: &[String]) -> Vec<CdiDevice> {
        let n = self.0.lock().unwrap_or_else(|p| p.into_inner());
        uuids
            .iter()
            .map(|u| n.get(u).cloned())
            .collect::<Option<Vec<_>>>()
            .unwrap_or_default()
    }
}

/// Writes `bytes` to `dir/name` unless it already holds exactly that:
/// through a temporary file renamed into place, so that a runtime never
/// reads half a spec, mode 0644 (runtimes may read as another user). The
/// directory is made if missing. Whether the file changed.
pub fn write_spec(dir: &Path, name: &str, bytes: &[u8]) -> Result<bool, CdiError> {
    let path = dir.join(name);
    if std::fs::read(&path).is_ok_and(|old| old == bytes) {
        return Ok(false);
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(|source| CdiError::Io {
            op: "create directory",
            path: dir.to_path_buf(),
            source,
        })?;
    // Not *.json or *.yaml: runtimes watching the directory skip it.
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let io = |op, source| CdiError::Io {
        op,
        path: tmp.clone(),
        source,
    };
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&tmp)
            .map_err(|e| io("create", e))?;
        // The umask may have taken bits off.
        f.set_permissions(std::fs::Permissions::from_mode(0o644))
            .map_err(|e| io("chmod", e))?;
        f.write_all(bytes).map_err(|e| io("write", e))?;
        f.sync_all().map_err(|e| io("sync", e))?;
        std::fs::rename(&tmp, &path).map_err(|source| CdiError::Io {
            op: "rename into",
            path: path.clone(),
            source,
        })
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map(|()| true)
}

/// Removes `dir/name`; whether there was one.
pub fn remove_spec(dir: &Path, name: &str) -> Result<bool, CdiError> {
    let path = dir.join(name);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(CdiError::Io {
            op: "remove",
            path,
            source,
        }),
    }
}

/// What a refresh did with the spec file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpecFile {
    Written,
    Unchanged,
    /// No GPU has a node: there is nothing to describe; a spec left from
    /// before is removed.
    Removed,
    Absent,
    /// Could not be written (or removed): the reason.
    Failed(String),
}

/// Writes this agent's CDI spec and keeps it in step: the GPUs are those
/// discovery found at start, the nodes are scanned again each round (nodes
/// appear after the agent starts: `nvidia-uvm` on first use), and a file
/// someone removed or edited is written again.
#[derive(Debug)]
pub struct Publisher {
    dir: PathBuf,
    /// Where the NVIDIA toolkit's spec is looked for, lowest priority first.
    toolkit_dirs: Vec<PathBuf>,
    dev_root: PathBuf,
    /// Replaced when a MIG layout change makes new MIG devices.
    gpus: Mutex<Vec<SpecGpu>>,
    driver_volume: Option<PathBuf>,
    names: Names,
    /// The last problem logged, by kind, so that a lasting one (a
    /// directory that is not writable) is logged once, not every round.
    logged: Mutex<BTreeMap<&'static str, String>>,
}

impl Publisher {
    /// The toolkit's spec is looked for in the standard directories and in
    /// `dir`.
    pub fn new(
        dir: PathBuf,
        dev_root: PathBuf,
        gpus: Vec<SpecGpu>,
        driver_volume: Option<PathBuf>,
    ) -> Publisher {
        let mut toolkit_dirs: Vec<PathBuf> = STANDARD_DIRS.iter().map(PathBuf::from).collect();
        if !toolkit_dirs.contains(&dir) {
            toolkit_dirs.push(dir.clone());
        }
        Publisher {
            dir,
            toolkit_dirs,
            dev_root,
            gpus: Mutex::new(gpus),
            driver_volume,
            names: Names::default(),
            logged: Mutex::new(BTreeMap::new()),
        }
    }

    /// Looks for the toolkit's spec in these directories instead.
    pub fn with_toolkit_dirs(mut self, dirs: Vec<PathBuf>) -> Publisher {
        self.toolkit_dirs = dirs;
        self
    }

    fn gpus(&self) -> Vec<SpecGpu> {
        self.gpus.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The GPUs (and MIG devices) to describe from now on; the next
    /// refresh writes them.
    pub fn set_gpus(&self, gpus: Vec<SpecGpu>) {
        *self.gpus.lock().unwrap_or_else(|p| p.into_inner()) = gpus;
    }

    pub fn names(&self) -> Names {
        self.names.clone()
    }

    pub fn spec_path(&self) -> PathBuf {
        self.dir.join(SPEC_FILE)
    }

    pub fn has_gpus(&self) -> bool {
        !self.gpus().is_empty()
    }

    /// Logs `message` at warn level unless it is what was last logged for
    /// `kind`; `None` clears it.
    fn note(&self, kind: &'static str, message: Option<String>) {
        let mut logged = self.logged.lock().unwrap_or_else(|p| p.into_inner());
        match message {
            Some(m) if logged.get(kind) != Some(&m) => {
                tracing::warn!(spec = %self.spec_path().display(), "CDI: {m}");
                logged.insert(kind, m);
            }
            Some(_) => {}
            None => {
                logged.remove(kind);
            }
        }
    }

    /// One round: scan the nodes, write or remove the spec, read the
    /// toolkit's, publish the names. Blocking I/O; never fails (problems
    /// are logged: containers then get their GPUs through `--device`).
    pub fn refresh(&self) -> SpecFile {
        let (file, ours) = self.write_ours();
        let (found, problems) = toolkit::read_specs(&self.toolkit_dirs, &self.spec_path());
        for p in &problems {
            // Only a file that looks like the toolkit's is worth a warning;
            // other vendors' files are theirs to fix.
            let name = match p {
                CdiError::Io { path, .. } | CdiError::Parse { path, .. } => path.file_name(),
                CdiError::Spec(_) => None,
            };
            if name.is_some_and(|n| n.to_string_lossy().starts_with("nvidia")) {
                tracing::warn!(error = %p, "CDI: the NVIDIA toolkit's spec cannot be read; gpuctl's own names are used");
            } else {
                tracing::debug!(error = %p, "CDI: a spec cannot be read");
            }
        }
        let mut names = ours;
        names.extend(toolkit::toolkit_names(&found, &self.gpus()));
        let described: BTreeMap<&str, &str> = names
            .iter()
            .map(|(u, d)| (u.as_str(), d.name.as_str()))
            .collect();
        let summary = format!("{described:?}");
        if self.names.set(names) {
            tracing::info!(names = %summary, "CDI names of this agent's GPUs");
        }
        file
    }

    fn write_ours(&self) -> (SpecFile, BTreeMap<String, CdiDevice>) {
        let host = match crate::isolation::devices::scan(&self.dev_root) {
            Ok(h) => h,
            Err(e) => {
                self.note("scan", Some(format!("cannot scan the device nodes: {e}")));
                return (SpecFile::Failed(e.to_string()), BTreeMap::new());
            }
        };
        self.note("scan", None);
        let generated = match spec::generate(&self.gpus(), &host, self.driver_volume.as_deref()) {
            Ok(g) => g,
            Err(e) => {
                self.note("generate", Some(e.to_string()));
                return (SpecFile::Failed(e.to_string()), BTreeMap::new());
            }
        };
        self.note(
            "skipped",
            (!generated.skipped.is_empty()).then(|| generated.skipped.join("; ")),
        );
        if generated.spec.devices.is_empty() {
            let file = match remove_spec(&self.dir, SPEC_FILE) {
                Ok(true) => {
                    tracing::info!(spec = %self.spec_path().display(), "CDI spec removed: no GPU has a device node");
                    SpecFile::Removed
                }
                Ok(false) => SpecFile::Absent,
                Err(e) => {
                    self.note("write", Some(e.to_string()));
                    SpecFile::Failed(e.to_string())
                }
            };
            return (file, BTreeMap::new());
        }
        match write_spec(&self.dir, SPEC_FILE, &spec::to_json(&generated.spec)) {
            Ok(changed) => {
                self.note("write", None);
                if changed {
                    tracing::info!(
                        spec = %self.spec_path().display(),
                        devices = generated.spec.devices.len(),
                        "CDI spec written"
                    );
                }
                let dir = std::fs::canonicalize(&self.dir).unwrap_or_else(|_| self.dir.clone());
                let names = generated
                    .names
                    .into_iter()
                    .map(|(uuid, name)| {
                        let d = CdiDevice {
                            name,
                            spec_dir: dir.clone(),
                        };
                        (uuid, d)
                    })
                    .collect();
                let file = if changed {
                    SpecFile::Written
                } else {
                    SpecFile::Unchanged
                };
                (file, names)
            }
            Err(e) => {
                self.note(
                    "write",
                    Some(format!(
                        "cannot write the spec ({e}); GPU containers get their GPUs through --device, \
                         and other runtimes cannot use {KIND} (set --cdi-dir, or --no-cdi)"
                    )),
                );
                (SpecFile::Failed(e.to_string()), BTreeMap::new())
            }
        }
    }
}

/// Refreshes every `every` until `stop` turns true. The spec is left in
/// place when the agent stops: the GPUs are still there, tasks outlive the
/// agent, and the next agent process rewrites it.
pub async fn keep_in_step(
    publisher: Arc<Publisher>,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => {}
        }
        if *stop.borrow() {
            return;
        }
        let p = publisher.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || p.refresh()).await {
            tracing::warn!(error = %e, "CDI spec refresh panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_spec_is_written_whole_0644_and_only_when_it_changed() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("run/cdi");
        assert!(
            write_spec(&dir, SPEC_FILE, b"{\"a\":1}\n").unwrap(),
            "written"
        );
        let path = dir.join(SPEC_FILE);
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o644);
        let ino = std::fs::metadata(&path).unwrap().ino();
        assert!(
            !write_spec(&dir, SPEC_FILE, b"{\"a\":1}\n").unwrap(),
            "unchanged"
        );
        assert_eq!(
            std::fs::metadata(&path).unwrap().ino(),
            ino,
            "not rewritten"
        );
        assert!(write_spec(&dir, SPEC_FILE, b"{\"a\":2}\n").unwrap());
        assert_eq!(std::fs::read(&path).unwrap(), b"{\"a\":2}\n");
        assert_ne!(
            std::fs::metadata(&path).unwrap().ino(),
            ino,
            "renamed into place"
        );
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, [SPEC_FILE], "no temporary file left");
        assert!(remove_spec(&dir, SPEC_FILE).unwrap());
        assert!(!remove_spec(&dir, SPEC_FILE).unwrap());
    }

    #[test]
    fn an_unwritable_directory_is_an_error_naming_it() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("not-a-dir");
        std::fs::write(&file, "").unwrap();
        let e = write_spec(&file.join("cdi"), SPEC_FILE, b"{}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not-a-dir"), "{e}");
    }

    #[test]
    fn names_are_given_for_all_of_a_tasks_gpus_or_none() {
        let n = Names::default();
        let dev = |name: &str| CdiDevice {
            name: name.into(),
            spec_dir: "/run/cdi".into(),
        };
        assert!(n.set(BTreeMap::from([
            ("A".to_string(), dev("gpuctl.io/gpu=A")),
            ("B".to_string(), dev("nvidia.com/gpu=B")),
        ])));
        assert!(!n.set(n.get()), "same names: no change");
        let got = n.for_gpus(&["B".into(), "A".into()]);
        let got: Vec<&str> = got.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(got, ["nvidia.com/gpu=B", "gpuctl.io/gpu=A"]);
        assert!(n.for_gpus(&["A".into(), "C".into()]).is_empty());
        assert!(n.for_gpus(&[]).is_empty());
    }

    fn mknod(dir: &Path, name: &str, major: u64, minor: u64) {
        use nix::sys::stat::{makedev, Mode, SFlag};
        nix::sys::stat::mknod(
            &dir.join(name),
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            makedev(major, minor),
        )
        .unwrap();
    }

    #[test]
    fn the_publisher_keeps_the_spec_in_step_with_the_nodes() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: mknod needs root");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let (dev, dir, etc) = (
            t.path().join("dev"),
            t.path().join("cdi"),
            t.path().join("etc-cdi"),
        );
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::create_dir_all(&etc).unwrap();
        mknod(&dev, "nvidia0", 195, 0);
        mknod(&dev, "nvidiactl", 195, 255);
        let gpus = vec![SpecGpu::whole(0, "GPU-a", 0), SpecGpu::whole(1, "GPU-b", 1)];
        let p = Publisher::new(dir.clone(), dev.clone(), gpus, None)
            .with_toolkit_dirs(vec![etc.clone(), dir.clone()]);
        assert_eq!(p.refresh(), SpecFile::Written);
        let spec = toolkit::read_spec(&p.spec_path()).unwrap();
        let names: Vec<&str> = spec.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["0", "GPU-a", "all"], "GPU-b has no node yet");
        let real = std::fs::canonicalize(&dir).unwrap();
        assert_eq!(
            p.names().for_gpus(&["GPU-a".into()]),
            [CdiDevice {
                name: "gpuctl.io/gpu=GPU-a".into(),
                spec_dir: real.clone()
            }]
        );
        assert!(p
            .names()
            .for_gpus(&["GPU-a".into(), "GPU-b".into()])
            .is_empty());
        assert_eq!(p.refresh(), SpecFile::Unchanged);

        // A node appears (nvidia-uvm on first use; here GPU-b's).
        mknod(&dev, "nvidia1", 195, 1);
        mknod(&dev, "nvidia-uvm", 240, 0);
        assert_eq!(p.refresh(), SpecFile::Written);
        let spec = toolkit::read_spec(&p.spec_path()).unwrap();
        assert_eq!(spec.devices.len(), 5);
        assert_eq!(spec.container_edits.device_nodes.len(), 2);
        assert_eq!(
            p.names().for_gpus(&["GPU-a".into(), "GPU-b".into()]).len(),
            2
        );

        // Removed or edited by someone: written again.
        std::fs::remove_file(p.spec_path()).unwrap();
        assert_eq!(p.refresh(), SpecFile::Written);
        std::fs::write(p.spec_path(), "{}").unwrap();
        assert_eq!(p.refresh(), SpecFile::Written);

        // The toolkit's spec names GPU-b: its name is preferred.
        std::fs::write(
            etc.join("nvidia.yaml"),
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: GPU-b\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia1\n",
        )
        .unwrap();
        assert_eq!(p.refresh(), SpecFile::Unchanged);
        let got = p.names().for_gpus(&["GPU-a".into(), "GPU-b".into()]);
        assert_eq!(got[0].name, "gpuctl.io/gpu=GPU-a");
        assert_eq!(
            (got[1].name.as_str(), got[1].spec_dir.as_path()),
            (
                "nvidia.com/gpu=GPU-b",
                std::fs::canonicalize(&etc).unwrap().as_path()
            )
        );

        // Every GPU node gone: nothing to describe, the spec goes.
        for n in ["nvidia0", "nvidia1"] {
            std::fs::remove_file(dev.join(n)).unwrap();
        }
        assert_eq!(p.refresh(), SpecFile::Removed);
        assert!(!p.spec_path().exists());
        assert_eq!(p.refresh(), SpecFile::Absent);
        assert_eq!(p.names().get().len(), 1, "the toolkit's name stays");
    }

    #[test]
    fn an_unwritable_spec_directory_does_not_fail_the_refresh() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: mknod needs root");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let dev = t.path().join("dev");
        std::fs::create_dir_all(&dev).unwrap();
        mknod(&dev, "nvidia0", 195, 0);
        let blocker = t.path().join("file");
        std::fs::write(&blocker, "").unwrap();
        let gpus = vec![SpecGpu::whole(0, "GPU-a", 0)];
        let p = Publisher::new(blocker.join("cdi"), dev, gpus, None).with_toolkit_dirs(vec![]);
        assert!(matches!(p.refresh(), SpecFile::Failed(e) if e.contains("file")));
        assert!(p.names().get().is_empty(), "no name for a spec not written");
    }
}
