//! Building `<work_dir>/volumes/nvidia_<version>` from a driver root.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::io::{ErrorKind, Read};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::ldcache::{self, ElfClass};
use super::manifest::{self, Capability};

/// Where the volume is mounted in containers, read-only.
pub const CONTAINER_PATH: &str = "/usr/local/nvidia";
/// Docker's PATH for an image that sets none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The image label with which nvidia-docker 1 images (and Mesos) ask for
/// the volume; its value is `nvidia_driver`.
pub const IMAGE_LABEL: &str = "com.nvidia.volumes.needed";
/// Where driver programs are looked for, in order, inside the driver root.
pub const BIN_DIRS: &[&str] = &["usr/bin", "usr/sbin", "bin", "sbin", "usr/local/bin"];
/// As Linux's own limit on nested symlinks (ELOOP).
const MAX_SYMLINKS: usize = 40;

/// A built volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverVolume {
    pub version: String,
    /// `<work_dir>/volumes/nvidia_<version>`, holding `bin`, `lib`, `lib64`.
    pub path: PathBuf,
}

/// The Docker bind that mounts the volume at `path` read-only at
/// [`CONTAINER_PATH`].
pub fn docker_bind(path: &Path) -> String {
    format!("{}:{CONTAINER_PATH}:ro", path.display())
}

#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("driver version {0:?} is not a version (digits and dots, like 535.129.03)")]
    BadVersion(String),
    #[error(
        "no ld.so cache at {path}: cannot find the driver libraries in driver root {root} \
         (is the driver installed there? `ldconfig -r {root}` writes the cache)"
    )]
    NoLdCache { path: PathBuf, root: PathBuf },
    #[error(transparent)]
    LdCache(#[from] ldcache::Error),
    #[error("no NVIDIA driver library usable in {cache} (driver root {root})")]
    NoDriverLibraries { cache: PathBuf, root: PathBuf },
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("copying {from} to {to}: {source}")]
    Copy {
        from: PathBuf,
        to: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path} has {found} bytes but {src} has {want}: the volume disagrees with the driver \
         of the same version; remove it once no container uses it"
    )]
    Conflict {
        path: PathBuf,
        src: PathBuf,
        found: u64,
        want: u64,
    },
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> VolumeError + 'a {
    move |source| VolumeError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// Checks a driver version before it becomes a path component.
pub fn validate_version(version: &str) -> Result<(), VolumeError> {
    let ok = version.len() <= 64
        && !version.is_empty()
        && version
            .split('.')
            .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()));
    if ok {
        Ok(())
    } else {
        Err(VolumeError::BadVersion(version.to_string()))
    }
}

/// The volume's directory for a driver version under `work_dir`.
pub fn volume_path(work_dir: &Path, driver_version: &str) -> PathBuf {
    work_dir
        .join("volumes")
        .join(format!("nvidia_{driver_version}"))
}

/// The class of an ELF file from the start of its header.
pub fn elf_class(header: &[u8]) -> Option<ElfClass> {
    match header {
        [0x7f, b'E', b'L', b'F', 1, ..] => Some(ElfClass::Elf32),
        [0x7f, b'E', b'L', b'F', 2, ..] => Some(ElfClass::Elf64),
        _ => None,
    }
}

fn file_elf_class(path: &Path) -> Result<Option<ElfClass>, VolumeError> {
    let mut header = Vec::with_capacity(5);
    std::fs::File::open(path)
        .and_then(|f| f.take(5).read_to_end(&mut header))
        .map_err(io("reading", path))?;
    Ok(elf_class(&header))
}

/// Resolves `path`, absolute as seen inside `root`, the way a chroot into
/// `root` would: every symlink on the way is followed, and absolute targets
/// and `..` stay inside `root` (a driver root's `/lib64` or its symlinks to
/// `/usr/lib` must not lead to the host's). `None` when it does not exist.
pub fn resolve_in_root(root: &Path, path: &Path) -> Result<Option<PathBuf>, VolumeError> {
    let mut todo: Vec<OsString> = Vec::new(); // reversed: next component last
    push_components(&mut todo, path);
    let mut done: Vec<OsString> = Vec::new();
    let mut hops = 0;
    while let Some(name) = todo.pop() {
        if name == ".." {
            done.pop();
            continue;
        }
        let here: PathBuf = std::iter::once(root.as_os_str())
            .chain(done.iter().map(OsString::as_os_str))
            .chain(std::iter::once(name.as_os_str()))
            .collect();
        match std::fs::symlink_metadata(&here) {
            Ok(m) if m.file_type().is_symlink() => {
                hops += 1;
                if hops > MAX_SYMLINKS {
                    return Err(VolumeError::Io {
                        op: "resolving",
                        path: here,
                        source: std::io::Error::from(nix::errno::Errno::ELOOP),
                    });
                }
                let target = std::fs::read_link(&here).map_err(io("reading link", &here))?;
                if target.is_absolute() {
                    done.clear();
                }
                push_components(&mut todo, &target);
            }
            Ok(_) => done.push(name),
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => {
                return Ok(None)
            }
            Err(e) => return Err(io("resolving", &here)(e)),
        }
    }
    Ok(Some(
        std::iter::once(root.as_os_str())
            .chain(done.iter().map(OsString::as_os_str))
            .collect(),
    ))
}

fn push_components(todo: &mut Vec<OsString>, path: &Path) {
    let parts: Vec<OsString> = path
        .components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_os_string()),
            Component::ParentDir => Some("..".into()),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
        })
        .collect();
    todo.extend(parts.into_iter().rev());
}

/// What goes into the volume, relative to its root.
#[derive(Debug, Default)]
struct Plan {
    /// (dir, file name) -> the real file on the host.
    files: BTreeMap<(&'static str, OsString), PathBuf>,
    /// (dir, link name) -> link target (a file name in the same dir).
    links: BTreeMap<(&'static str, OsString), OsString>,
}

impl Plan {
    fn add_link(&mut self, dir: &'static str, name: &OsStr, target: &OsStr) {
        if name != target && !self.files.contains_key(&(dir, name.to_os_string())) {
            self.links
                .entry((dir, name.to_os_string()))
                .or_insert_with(|| target.to_os_string());
        }
    }
}

/// The driver's programs, found in `dirs` under the driver root, under
/// the names they are run as.
fn add_binaries(driver_root: &Path, dirs: &[PathBuf], plan: &mut Plan) -> Result<(), VolumeError> {
    for b in manifest::BINARIES {
        // The first ELF file wins; a script only when there is none. A
        // host's wrapper script (a GPU sandbox's `/usr/bin/nvidia-smi` runs
        // `/usr/local/nvidia/bin/nvidia-smi`) would run in the container,
        // where that path is the volume's own copy of the script.
        let mut script = None;
        let mut elf = None;
        for dir in dirs {
            let candidate = dir.join(b.name);
            let Some(real) = resolve_in_root(driver_root, &candidate)? else {
                continue;
            };
            if !real.is_file() {
                continue;
            }
            if file_elf_class(&real)?.is_some() {
                elf = Some(real);
                break;
            }
            script.get_or_insert((candidate, real));
        }
        let chosen = match (elf, script) {
            (Some(real), _) => real,
            (None, Some((candidate, real))) => {
                tracing::warn!(
                    program = %candidate.display(),
                    root = %driver_root.display(),
                    "driver program is not an ELF file (a wrapper?); taken, as there is no other"
                );
                real
            }
            (None, None) => continue,
        };
        // Under the name it is run as, whatever the real file is called.
        plan.files.insert(("bin", b.name.into()), chosen);
    }
    Ok(())
}

/// Reads the driver root and decides what the volume holds.
fn plan(driver_root: &Path) -> Result<Plan, VolumeError> {
    let cache_path = driver_root.join("etc/ld.so.cache");
    let cache = match ldcache::read(&cache_path) {
        Err(ldcache::Error::Read { source, .. }) if source.kind() == ErrorKind::NotFound => {
            return Err(VolumeError::NoLdCache {
                path: cache_path,
                root: driver_root.to_path_buf(),
            })
        }
        other => other?,
    };
    let mut plan = Plan::default();
    // Where the driver's libraries are: a driver installed under a prefix
    // (`/usr/local/nvidia/lib64`) has its programs in that prefix's `bin`.
    let mut lib_dirs: Vec<PathBuf> = Vec::new();
    let selected = manifest::select_libraries(
        cache
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_path())),
        &Capability::ALL,
    );
    for s in selected {
        let skip = |why: &str| {
            tracing::warn!(
                name = s.name,
                path = %s.path.display(),
                root = %driver_root.display(),
                "driver library skipped: {why}"
            )
        };
        let Some(real) = resolve_in_root(driver_root, s.path)? else {
            skip("missing (stale ld.so cache?)");
            continue;
        };
        let meta = std::fs::metadata(&real).map_err(io("reading", &real))?;
        let (Some(file_name), true) = (real.file_name(), meta.is_file()) else {
            skip("not a regular file");
            continue;
        };
        // The file's own header, not its directory, says 32 or 64 bits.
        let dir = match file_elf_class(&real)? {
            Some(ElfClass::Elf32) => "lib",
            Some(ElfClass::Elf64) => "lib64",
            None => {
                skip("not an ELF file");
                continue;
            }
        };
        let file_name = file_name.to_os_string();
        if let Some(prefix_bin) = s
            .path
            .parent()
            .and_then(Path::parent)
            .map(|p| p.join("bin"))
        {
            if !lib_dirs.contains(&prefix_bin) {
                lib_dirs.push(prefix_bin);
            }
        }
        plan.files
            .entry((dir, file_name.clone()))
            .or_insert_with(|| real.clone());
        let soname = OsStr::new(s.name);
        plan.add_link(dir, soname, &file_name);
        // An unversioned name, pointing at the soname as a driver install
        // does: where the driver root has one, and always for libcuda.so.
        let unversioned = s.library.name;
        let has_unversioned = || {
            let beside = s.path.with_file_name(unversioned);
            matches!(resolve_in_root(driver_root, &beside), Ok(Some(p)) if p.is_file())
        };
        if manifest::ALWAYS_UNVERSIONED.contains(&unversioned) || has_unversioned() {
            plan.add_link(dir, OsStr::new(unversioned), soname);
        }
        // GLVND's indirect GLX loads libGLX_indirect; NVIDIA serves it too.
        if unversioned == "libGLX_nvidia.so" {
            let indirect = s.name.replace("GLX_nvidia", "GLX_indirect");
            plan.add_link(dir, OsStr::new(&indirect), &file_name);
        }
    }
    if plan.files.is_empty() {
        return Err(VolumeError::NoDriverLibraries {
            cache: cache_path,
            root: driver_root.to_path_buf(),
        });
    }
    let dirs: Vec<PathBuf> = BIN_DIRS
        .iter()
        .map(|d| Path::new("/").join(d))
        .chain(lib_dirs)
        .collect();
    add_binaries(driver_root, &dirs, &mut plan)?;
    Ok(plan)
}

/// Builds, or completes, the volume for `driver_version` from the driver
/// installed under `driver_root` (`/` on most hosts; the root of a driver
/// container otherwise).
///
/// The volume only gains files: what is already there is left alone, a
/// new driver version gets a new directory, and concurrent builds of the
/// same version are safe.
pub fn build(
    driver_root: &Path,
    work_dir: &Path,
    driver_version: &str,
) -> Result<DriverVolume, VolumeError> {
    validate_version(driver_version)?;
    let plan = plan(driver_root)?;
    let volumes = work_dir.join("volumes");
    std::fs::create_dir_all(&volumes).map_err(io("creating", &volumes))?;
    let path = volume_path(work_dir, driver_version);

    let mut added = None;
    if !exists(&path)? {
        // Build it aside and rename it into place, so that nobody ever
        // mounts a half-built volume.
        let tmp = volumes.join(format!(".nvidia_{driver_version}.{}", unique()));
        let filled = make_dirs(&tmp).and_then(|()| fill(&tmp, &plan));
        let renamed = filled.and_then(|n| {
            std::fs::rename(&tmp, &path)
                .map(|()| n)
                .map_err(io("renaming into place", &path))
        });
        match renamed {
            Ok(n) => added = Some(n),
            Err(e) => {
                // Our own scratch directory: removing it deletes no volume file.
                let _ = std::fs::remove_dir_all(&tmp);
                // Another build won the race; complete its volume below.
                if !exists(&path)? {
                    return Err(e);
                }
            }
        }
    }
    let added = match added {
        Some(n) => n,
        None => {
            make_dirs(&path)?;
            fill(&path, &plan)?
        }
    };
    tracing::info!(
        volume = %path.display(),
        version = driver_version,
        files = plan.files.len(),
        links = plan.links.len(),
        added,
        "NVIDIA driver volume ready"
    );
    Ok(DriverVolume {
        version: driver_version.to_string(),
        path,
    })
}

fn exists(path: &Path) -> Result<bool, VolumeError> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io("reading", path)(e)),
    }
}

fn make_dirs(volume: &Path) -> Result<(), VolumeError> {
    for dir in ["bin", "lib", "lib64"] {
        let d = volume.join(dir);
        std::fs::create_dir_all(&d).map_err(io("creating", &d))?;
    }
    Ok(())
}

/// A name no other build (in this or another process) uses.
fn unique() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{}.{nanos}.{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Adds what the plan has and the volume lacks; returns how many entries
/// were added.
fn fill(volume: &Path, plan: &Plan) -> Result<usize, VolumeError> {
    let mut added = 0;
    for ((dir, name), src) in &plan.files {
        added += usize::from(place_file(volume, src, &volume.join(dir).join(name))?);
    }
    for ((dir, name), target) in &plan.links {
        let link = volume.join(dir).join(name);
        match std::os::unix::fs::symlink(target, &link) {
            Ok(()) => added += 1,
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io("creating symlink", &link)(e)),
        }
    }
    Ok(added)
}

/// Puts `src` at `dest`: a hard link (no copy, and the driver's own
/// inode), else a copy staged in the volume and linked into place, so
/// that `dest` never exists half-written. False when `dest` was there.
fn place_file(volume: &Path, src: &Path, dest: &Path) -> Result<bool, VolumeError> {
    match std::fs::hard_link(src, dest) {
        Ok(()) => return Ok(true),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {
            return same_size(src, dest).map(|()| false)
        }
        // Another filesystem, or hard links refused: copy.
        Err(_) => {}
    }
    let staged = volume.join(format!(".partial.{}", unique()));
    let result = std::fs::copy(src, &staged)
        .map_err(|source| VolumeError::Copy {
            from: src.to_path_buf(),
            to: staged.clone(),
            source,
        })
        .and_then(|_| match std::fs::hard_link(&staged, dest) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => same_size(src, dest).map(|()| false),
            Err(e) => Err(io("linking", dest)(e)),
        });
    // The staged name is ours alone; dest keeps the data.
    let _ = std::fs::remove_file(&staged);
    result
}

/// A file already in the volume is kept when its size matches the driver's.
fn same_size(src: &Path, dest: &Path) -> Result<(), VolumeError> {
    let want = std::fs::metadata(src).map_err(io("reading", src))?.len();
    let found = std::fs::symlink_metadata(dest).map_err(io("reading", dest))?;
    if found.is_file() && found.len() == want {
        Ok(())
    } else {
        Err(VolumeError::Conflict {
            path: dest.to_path_buf(),
            src: src.to_path_buf(),
            found: found.len(),
            want,
        })
    }
}

/// The environment a container with the volume needs: `PATH` with the
/// volume's `bin` first (the image's PATH, or Docker's default, after it)
/// and `LD_LIBRARY_PATH` naming the volume's `lib` and `lib64`.
pub fn container_env(image_path: Option<&str>) -> Vec<(String, String)> {
    container_env_with(image_path, None)
}

/// [`container_env`] for an image that sets its own `LD_LIBRARY_PATH`: its
/// entries come first, as in Mesos, so that an image's CUDA
/// forward-compatibility libraries (`/usr/local/cuda/compat`) win over the
/// host's; the volume's directories are appended unless already there.
pub fn container_env_with(
    image_path: Option<&str>,
    image_ld_library_path: Option<&str>,
) -> Vec<(String, String)> {
    let bin = format!("{CONTAINER_PATH}/bin");
    let path = image_path.filter(|p| !p.is_empty()).unwrap_or(DEFAULT_PATH);
    let path = if path.split(':').any(|p| p == bin) {
        path.to_string()
    } else {
        format!("{bin}:{path}")
    };
    let mut ld: Vec<String> = image_ld_library_path
        .unwrap_or("")
        .split(':')
        .filter(|p| !p.is_empty())
        .map(str::to_string)
        .collect();
    for dir in ["lib", "lib64"] {
        let d = format!("{CONTAINER_PATH}/{dir}");
        if !ld.contains(&d) {
            ld.push(d);
        }
    }
    vec![
        ("PATH".to_string(), path),
        ("LD_LIBRARY_PATH".to_string(), ld.join(":")),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volume::ldcache::testing::encode;
    use crate::volume::ldcache::{Format, FLAG_ELF_LIBC6, FLAG_X8664_LIB64};
    use std::os::unix::fs::{symlink, MetadataExt};

    const X64: i32 = FLAG_ELF_LIBC6 | FLAG_X8664_LIB64;

    /// A minimal ELF header: enough for the class check, not for a loader.
    fn elf(class: u8, size: usize) -> Vec<u8> {
        let mut b = vec![0x7f, b'E', b'L', b'F', class, 1, 1];
        b.resize(size, 0);
        b
    }

    fn write(path: &Path, bytes: &[u8]) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }

    /// A driver root with a 64-bit and a 32-bit libcuda, an NVML reached
    /// through absolute symlinks and a directory symlink, and a cache.
    fn fake_root(root: &Path) {
        let l64 = root.join("usr/lib/x86_64-linux-gnu");
        let l32 = root.join("usr/lib/i386-linux-gnu");
        write(&l64.join("libcuda.so.535.129.03"), &elf(2, 4096));
        write(&l32.join("libcuda.so.535.129.03"), &elf(1, 3000));
        write(&l64.join("libnvidia-ml.so.535.129.03"), &elf(2, 2048));
        write(&l64.join("libfoo.so.1"), &elf(2, 100));
        write(&l64.join("libnvidia-notes.so.1"), b"not an elf file");
        symlink("libcuda.so.535.129.03", l64.join("libcuda.so.1")).unwrap();
        symlink("libcuda.so.535.129.03", l32.join("libcuda.so.1")).unwrap();
        // Absolute targets must resolve inside the root, not on the host.
        symlink(
            "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.535.129.03",
            l64.join("libnvidia-ml.so.1"),
        )
        .unwrap();
        symlink("libnvidia-ml.so.1", l64.join("libnvidia-ml.so")).unwrap();
        symlink("/usr/lib/x86_64-linux-gnu", root.join("lib64")).unwrap();
        write(&root.join("usr/bin/nvidia-smi.real"), &elf(2, 777));
        symlink("nvidia-smi.real", root.join("usr/bin/nvidia-smi")).unwrap();
        write(&root.join("sbin/nvidia-persistenced"), b"#!/bin/sh\n");
        let cache = encode(
            Format::New,
            &[
                (X64, "libfoo.so.1", "/usr/lib/x86_64-linux-gnu/libfoo.so.1"),
                (
                    X64,
                    "libcuda.so.1",
                    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                ),
                (
                    FLAG_ELF_LIBC6,
                    "libcuda.so.1",
                    "/usr/lib/i386-linux-gnu/libcuda.so.1",
                ),
                (X64, "libnvidia-ml.so.1", "/lib64/libnvidia-ml.so.1"),
                (
                    X64,
                    "libnvidia-notes.so.1",
                    "/usr/lib/x86_64-linux-gnu/libnvidia-notes.so.1",
                ),
                (
                    X64,
                    "libnvidia-gone.so.1",
                    "/usr/lib/x86_64-linux-gnu/libnvidia-gone.so.1",
                ),
            ],
        );
        write(&root.join("etc/ld.so.cache"), &cache);
    }

    /// Every entry under `dir`: (relative path, inode, mtime, link target).
    fn listing(dir: &Path) -> Vec<(String, u64, i64, Option<PathBuf>)> {
        let mut out = Vec::new();
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                let m = std::fs::symlink_metadata(&p).unwrap();
                let rel = p.strip_prefix(dir).unwrap().display().to_string();
                out.push((
                    rel,
                    m.ino(),
                    m.mtime_nsec() + m.mtime() * 1_000_000_000,
                    std::fs::read_link(&p).ok(),
                ));
                if m.is_dir() {
                    todo.push(p);
                }
            }
        }
        out.sort();
        out
    }

    fn link(p: &Path) -> String {
        std::fs::read_link(p).unwrap().display().to_string()
    }

    #[test]
    fn elf_class_reads_ei_class() {
        assert_eq!(elf_class(&elf(1, 64)), Some(ElfClass::Elf32));
        assert_eq!(elf_class(&elf(2, 64)), Some(ElfClass::Elf64));
        assert_eq!(elf_class(&elf(2, 5)), Some(ElfClass::Elf64));
        assert_eq!(elf_class(&elf(0, 64)), None);
        assert_eq!(elf_class(&elf(3, 64)), None);
        assert_eq!(elf_class(b"\x7fELF"), None);
        assert_eq!(elf_class(b"#!/bin/sh\n"), None);
        assert_eq!(elf_class(b""), None);
    }

    #[test]
    fn versions_are_digits_and_dots() {
        for ok in ["535.129.03", "550", "470.82.01", "0.0"] {
            assert!(validate_version(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            ".",
            "535.",
            ".535",
            "535..1",
            "535/../x",
            "../x",
            "535-1",
            "v535",
            "535.129.03 ",
            "٣",
        ] {
            let e = validate_version(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
        assert!(validate_version(&"1".repeat(65)).is_err());
    }

    #[test]
    fn resolves_symlinks_inside_the_root() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        fake_root(root);
        let real = root.join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.535.129.03");
        let r = |p: &str| resolve_in_root(root, Path::new(p)).unwrap();
        assert_eq!(r("/lib64/libnvidia-ml.so.1"), Some(real.clone()));
        assert_eq!(r("/lib64/libnvidia-ml.so"), Some(real.clone()));
        assert_eq!(r("/../../../usr/../lib64/./libnvidia-ml.so"), Some(real));
        // `..` after a symlinked directory leaves its target, as in the kernel.
        assert_eq!(
            r("/lib64/../x86_64-linux-gnu/libcuda.so.1"),
            r("/lib64/libcuda.so.1")
        );
        assert!(r("/lib64/libcuda.so.1").is_some());
        assert_eq!(r("/lib64/nothing"), None);
        assert_eq!(r("/usr/bin/nvidia-smi/x"), None);
        symlink("loop", root.join("loop")).unwrap();
        let e = resolve_in_root(root, Path::new("/loop")).unwrap_err();
        assert!(e.to_string().contains("loop"), "{e}");
    }

    #[test]
    fn builds_lib_lib64_bin_and_links() {
        let t = tempfile::tempdir().unwrap();
        let (root, work) = (t.path().join("root"), t.path().join("work"));
        fake_root(&root);
        let v = build(&root, &work, "535.129.03").unwrap();
        assert_eq!(v.path, work.join("volumes/nvidia_535.129.03"));
        assert_eq!(
            docker_bind(&v.path),
            format!("{}:/usr/local/nvidia:ro", v.path.display())
        );
        let p = &v.path;
        let l64 = root.join("usr/lib/x86_64-linux-gnu");
        // Same inode: hard links to the driver's files.
        let ino = |p: &Path| std::fs::metadata(p).unwrap().ino();
        assert_eq!(
            ino(&p.join("lib64/libcuda.so.535.129.03")),
            ino(&l64.join("libcuda.so.535.129.03"))
        );
        assert_eq!(
            std::fs::metadata(p.join("lib/libcuda.so.535.129.03"))
                .unwrap()
                .len(),
            3000
        );
        assert_eq!(link(&p.join("lib64/libcuda.so.1")), "libcuda.so.535.129.03");
        assert_eq!(link(&p.join("lib/libcuda.so.1")), "libcuda.so.535.129.03");
        // libcuda.so always; libnvidia-ml.so because the root has one.
        assert_eq!(link(&p.join("lib64/libcuda.so")), "libcuda.so.1");
        assert_eq!(link(&p.join("lib/libcuda.so")), "libcuda.so.1");
        assert_eq!(link(&p.join("lib64/libnvidia-ml.so")), "libnvidia-ml.so.1");
        assert_eq!(
            link(&p.join("lib64/libnvidia-ml.so.1")),
            "libnvidia-ml.so.535.129.03"
        );
        assert_eq!(
            std::fs::read(p.join("bin/nvidia-smi")).unwrap(),
            elf(2, 777)
        );
        assert!(p.join("bin/nvidia-persistenced").is_file());
        let names: Vec<String> = listing(p).into_iter().map(|e| e.0).collect();
        assert_eq!(
            names,
            [
                "bin",
                "bin/nvidia-persistenced",
                "bin/nvidia-smi",
                "lib",
                "lib/libcuda.so",
                "lib/libcuda.so.1",
                "lib/libcuda.so.535.129.03",
                "lib64",
                "lib64/libcuda.so",
                "lib64/libcuda.so.1",
                "lib64/libcuda.so.535.129.03",
                "lib64/libnvidia-ml.so",
                "lib64/libnvidia-ml.so.1",
                "lib64/libnvidia-ml.so.535.129.03",
            ]
        );
        // Nothing left over beside the volume.
        let volumes: Vec<_> = std::fs::read_dir(work.join("volumes"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(volumes, ["nvidia_535.129.03"]);
    }

    /// A driver installed under a prefix, with a wrapper script in
    /// `/usr/bin` (as a GPU sandbox had): the volume takes the real program
    /// from the prefix's `bin`, beside its `lib64`, over the script.
    #[test]
    fn programs_are_elf_files_found_beside_the_libraries_too() {
        let t = tempfile::tempdir().unwrap();
        let (root, work) = (t.path().join("root"), t.path().join("work"));
        let prefix = root.join("usr/local/nvidia");
        write(&prefix.join("lib64/libcuda.so.580.1"), &elf(2, 64));
        symlink("libcuda.so.580.1", prefix.join("lib64/libcuda.so.1")).unwrap();
        write(&prefix.join("bin/nvidia-smi"), &elf(2, 99));
        write(
            &root.join("usr/bin/nvidia-smi"),
            b"#!/bin/sh\nexec /usr/local/nvidia/bin/nvidia-smi \"$@\"\n",
        );
        write(&root.join("usr/bin/nvidia-debugdump"), b"#!/bin/sh\n");
        let cache = encode(
            Format::New,
            &[(X64, "libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1")],
        );
        write(&root.join("etc/ld.so.cache"), &cache);
        let v = build(&root, &work, "580.1").unwrap();
        assert_eq!(
            std::fs::read(v.path.join("bin/nvidia-smi")).unwrap(),
            elf(2, 99)
        );
        // A script and nothing better: the script.
        assert_eq!(
            std::fs::read(v.path.join("bin/nvidia-debugdump")).unwrap(),
            b"#!/bin/sh\n"
        );
    }

    #[test]
    fn rebuilding_only_adds_what_is_missing() {
        let t = tempfile::tempdir().unwrap();
        let (root, work) = (t.path().join("root"), t.path().join("work"));
        fake_root(&root);
        let v = build(&root, &work, "535.129.03").unwrap();
        let before = listing(&v.path);
        assert_eq!(build(&root, &work, "535.129.03").unwrap(), v);
        assert_eq!(listing(&v.path), before);
        // A file lost from the volume comes back; the others stay as they were.
        std::fs::remove_file(v.path.join("lib64/libcuda.so")).unwrap();
        build(&root, &work, "535.129.03").unwrap();
        let after = listing(&v.path);
        assert_eq!(after.len(), before.len());
        let changed: Vec<&str> = after
            .iter()
            .filter(|e| !before.contains(e))
            .map(|e| e.0.as_str())
            .collect();
        assert_eq!(changed, ["lib64", "lib64/libcuda.so"]);
        // A different file of the same name is not replaced.
        std::fs::remove_file(v.path.join("lib/libcuda.so.535.129.03")).unwrap();
        write(&v.path.join("lib/libcuda.so.535.129.03"), b"other");
        let e = build(&root, &work, "535.129.03").unwrap_err();
        assert!(matches!(e, VolumeError::Conflict { .. }), "{e}");
        assert!(e.to_string().contains("lib/libcuda.so.535.129.03"), "{e}");
    }

    #[test]
    fn concurrent_builds_agree() {
        let t = tempfile::tempdir().unwrap();
        let (root, work) = (t.path().join("root"), t.path().join("work"));
        fake_root(&root);
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| s.spawn(|| build(&root, &work, "535.129.03")))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in &results {
            assert_eq!(
                r.as_ref().unwrap().path,
                work.join("volumes/nvidia_535.129.03")
            );
        }
        assert_eq!(listing(&work.join("volumes/nvidia_535.129.03")).len(), 14);
        let volumes: Vec<_> = std::fs::read_dir(work.join("volumes"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(volumes, ["nvidia_535.129.03"]);
        let partial = std::fs::read_dir(work.join("volumes/nvidia_535.129.03"))
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with('.')
            })
            .count();
        assert_eq!(partial, 0);
    }

    #[test]
    fn copies_across_filesystems() {
        // /dev/shm is a tmpfs; the temp dir usually is not.
        let shm = Path::new("/dev/shm");
        let t = tempfile::tempdir().unwrap();
        let Ok(r) = tempfile::tempdir_in(shm) else {
            println!("skipped: no /dev/shm");
            return;
        };
        if std::fs::metadata(r.path()).unwrap().dev() == std::fs::metadata(t.path()).unwrap().dev()
        {
            println!("skipped: /dev/shm and the temp dir share a filesystem");
            return;
        }
        fake_root(r.path());
        let v = build(r.path(), t.path(), "1.2").unwrap();
        let dest = v.path.join("lib64/libcuda.so.535.129.03");
        let src = r
            .path()
            .join("usr/lib/x86_64-linux-gnu/libcuda.so.535.129.03");
        assert_ne!(
            std::fs::metadata(&dest).unwrap().ino(),
            std::fs::metadata(&src).unwrap().ino()
        );
        assert_eq!(std::fs::read(&dest).unwrap(), std::fs::read(&src).unwrap());
        let before = listing(&v.path);
        build(r.path(), t.path(), "1.2").unwrap();
        assert_eq!(listing(&v.path), before);
    }

    #[test]
    fn missing_cache_and_missing_driver_are_errors() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        std::fs::create_dir_all(root.join("etc")).unwrap();
        let e = build(&root, t.path(), "535.129.03").unwrap_err();
        assert!(matches!(e, VolumeError::NoLdCache { .. }), "{e}");
        assert!(e.to_string().contains("etc/ld.so.cache"), "{e}");

        write(&root.join("usr/lib/libfoo.so.1"), &elf(2, 64));
        write(
            &root.join("etc/ld.so.cache"),
            &encode(Format::New, &[(X64, "libfoo.so.1", "/usr/lib/libfoo.so.1")]),
        );
        let e = build(&root, t.path(), "535.129.03").unwrap_err();
        assert!(matches!(e, VolumeError::NoDriverLibraries { .. }), "{e}");

        write(
            &root.join("etc/ld.so.cache"),
            b"glibc-ld.so.cache1.1 but cut",
        );
        let e = build(&root, t.path(), "535.129.03").unwrap_err();
        assert!(e.to_string().contains("etc/ld.so.cache: truncated"), "{e}");

        let e = build(&root, t.path(), "../535").unwrap_err();
        assert!(matches!(e, VolumeError::BadVersion(_)), "{e}");
        assert!(!t.path().join("volumes").exists());
    }

    #[test]
    fn env_puts_the_volume_first_in_path() {
        let env = |p| container_env(p);
        assert_eq!(
            env(None),
            [
                (
                    "PATH".to_string(),
                    format!("/usr/local/nvidia/bin:{DEFAULT_PATH}")
                ),
                (
                    "LD_LIBRARY_PATH".to_string(),
                    "/usr/local/nvidia/lib:/usr/local/nvidia/lib64".to_string()
                ),
            ]
        );
        assert_eq!(
            env(Some("/opt/bin:/bin"))[0].1,
            "/usr/local/nvidia/bin:/opt/bin:/bin"
        );
        assert_eq!(
            env(Some(""))[0].1,
            format!("/usr/local/nvidia/bin:{DEFAULT_PATH}")
        );
        // nvidia/cuda images already name it.
        let cuda = "/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/bin";
        assert_eq!(env(Some(cuda))[0].1, cuda);
        let with = container_env_with(
            None,
            Some("/usr/local/cuda/compat:/usr/local/nvidia/lib64:"),
        );
        assert_eq!(
            with[1].1,
            "/usr/local/cuda/compat:/usr/local/nvidia/lib64:/usr/local/nvidia/lib"
        );
    }
}
