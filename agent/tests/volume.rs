//! The driver volume built from a fake driver tree: real shared objects
//! made with gcc and a real ld.so cache written by `ldconfig -r`.
//!
//! Needs gcc, ldconfig and root (ldconfig chroots). Without them each test
//! prints "skipped: ..." and returns, unless `GPUCTL_REQUIRE_DOCKER=1` (CI),
//! where it fails.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use gpuctl_agent::volume::{self, ldcache, VolumeError};

const VERSION: &str = "535.129.03";
const LIBDIR: &str = "usr/lib/x86_64-linux-gnu";

/// Why the fixture cannot be made here, if it cannot.
fn missing_tools() -> Option<String> {
    if !nix::unistd::Uid::effective().is_root() {
        return Some("not root (ldconfig -r chroots)".into());
    }
    for tool in ["gcc", "ldconfig"] {
        let found = Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            return Some(format!("{tool} not found"));
        }
    }
    None
}

fn available(test: &str) -> bool {
    match missing_tools() {
        None => true,
        Some(why) if std::env::var("GPUCTL_REQUIRE_DOCKER").as_deref() == Ok("1") => {
            panic!(
                "{test}: gcc, ldconfig and root are required (GPUCTL_REQUIRE_DOCKER=1) but {why}"
            )
        }
        Some(why) => {
            println!("skipped: {test}: {why}");
            false
        }
    }
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `<root>/usr/lib/x86_64-linux-gnu/<file>` with soname `soname`.
fn shared_object(root: &Path, soname: &str, file: &str) {
    let src = root.join("empty.c");
    std::fs::write(&src, "int gpuctl_fake_symbol;\n").unwrap();
    run(Command::new("gcc")
        .args(["-shared", "-fPIC", &format!("-Wl,-soname,{soname}"), "-o"])
        .arg(root.join(LIBDIR).join(file))
        .arg(&src));
}

/// A driver tree for `version`, with its ld.so cache.
fn driver_root(root: &Path, version: &str) {
    std::fs::create_dir_all(root.join(LIBDIR)).unwrap();
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::create_dir_all(root.join("usr/bin")).unwrap();
    for lib in ["libnvidia-ml", "libcuda", "libnvidia-ptxjitcompiler"] {
        shared_object(root, &format!("{lib}.so.1"), &format!("{lib}.so.{version}"));
    }
    shared_object(root, "libfoo.so.1", "libfoo.so.1.0.0");
    for bin in ["nvidia-smi", "nvidia-debugdump", "unrelated-tool"] {
        let p = root.join("usr/bin").join(bin);
        std::fs::write(&p, format!("#!/bin/sh\necho {bin} {version}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::write(root.join("etc/ld.so.conf"), format!("/{LIBDIR}\n")).unwrap();
    // Writes the cache and, as on a real host, the soname symlinks.
    run(Command::new("ldconfig").arg("-r").arg(root));
}

/// (path, inode, mtime, link target) of everything under `dir`.
fn listing(dir: &Path) -> BTreeSet<(PathBuf, u64, i64, i64, Option<PathBuf>)> {
    let mut out = BTreeSet::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            out.insert((
                p.strip_prefix(dir).unwrap().to_path_buf(),
                m.ino(),
                m.mtime(),
                m.mtime_nsec(),
                std::fs::read_link(&p).ok(),
            ));
            if m.is_dir() {
                todo.push(p);
            }
        }
    }
    out
}

fn names(dir: &Path) -> Vec<String> {
    listing(dir)
        .into_iter()
        .map(|e| e.0.display().to_string())
        .collect()
}

#[test]
fn ldconfig_cache_lists_the_driver() {
    if !available("ldconfig_cache_lists_the_driver") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    driver_root(t.path(), VERSION);
    let cache = ldcache::read(&t.path().join("etc/ld.so.cache")).unwrap();
    assert_eq!(cache.format, ldcache::Format::New);
    let keys: BTreeSet<&str> = cache.entries.iter().map(|e| e.key.as_str()).collect();
    for k in [
        "libnvidia-ml.so.1",
        "libcuda.so.1",
        "libnvidia-ptxjitcompiler.so.1",
        "libfoo.so.1",
    ] {
        assert!(keys.contains(k), "{k} missing from {keys:?}");
    }
    let ml = cache
        .entries
        .iter()
        .find(|e| e.key == "libnvidia-ml.so.1")
        .unwrap();
    assert_eq!(
        ml.value,
        Path::new("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
    );

    // The old and compat layouts, written by the same ldconfig, read the same.
    for format in ["old", "compat"] {
        let file = format!("/etc/ld.so.cache.{format}");
        run(Command::new("ldconfig")
            .arg("-r")
            .arg(t.path())
            .args(["-c", format, "-C", &file]));
        let other = ldcache::read(&t.path().join(&file[1..])).unwrap();
        let want = match format {
            "old" => ldcache::Format::Old,
            _ => ldcache::Format::Compat,
        };
        assert_eq!(other.format, want);
        let other_keys: BTreeSet<&str> = other.entries.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(other_keys, keys, "{format}");
    }
}

#[test]
fn volume_from_a_fake_driver() {
    if !available("volume_from_a_fake_driver") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let (root, work) = (t.path().join("root"), t.path().join("work"));
    driver_root(&root, VERSION);
    let v = volume::build(&root, &work, VERSION).unwrap();
    assert_eq!(v.version, VERSION);
    assert_eq!(v.path, work.join(format!("volumes/nvidia_{VERSION}")));

    assert_eq!(
        names(&v.path),
        [
            "bin",
            "bin/nvidia-debugdump",
            "bin/nvidia-smi",
            "lib",
            "lib64",
            "lib64/libcuda.so",
            "lib64/libcuda.so.1",
            "lib64/libcuda.so.535.129.03",
            "lib64/libnvidia-ml.so.1",
            "lib64/libnvidia-ml.so.535.129.03",
            "lib64/libnvidia-ptxjitcompiler.so.1",
            "lib64/libnvidia-ptxjitcompiler.so.535.129.03",
        ]
    );
    // Hard links: the driver's own inodes (same filesystem here).
    let ino = |p: PathBuf| std::fs::metadata(p).unwrap().ino();
    for lib in ["libnvidia-ml", "libcuda", "libnvidia-ptxjitcompiler"] {
        let file = format!("{lib}.so.{VERSION}");
        assert_eq!(
            ino(v.path.join("lib64").join(&file)),
            ino(root.join(LIBDIR).join(&file)),
            "{file}"
        );
        assert_eq!(
            std::fs::read_link(v.path.join(format!("lib64/{lib}.so.1"))).unwrap(),
            Path::new(&file)
        );
    }
    assert_eq!(
        std::fs::read_link(v.path.join("lib64/libcuda.so")).unwrap(),
        Path::new("libcuda.so.1")
    );
    let smi = std::fs::metadata(v.path.join("bin/nvidia-smi")).unwrap();
    assert!(
        smi.permissions().mode() & 0o111 != 0,
        "nvidia-smi not executable"
    );
    let out = Command::new(v.path.join("bin/nvidia-smi"))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("nvidia-smi {VERSION}\n")
    );

    // Again: nothing changes, down to inodes and mtimes.
    let before = listing(&v.path);
    assert_eq!(volume::build(&root, &work, VERSION).unwrap(), v);
    assert_eq!(listing(&v.path), before);
}

#[test]
fn a_new_driver_version_gets_its_own_directory() {
    if !available("a_new_driver_version_gets_its_own_directory") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let (old_root, new_root, work) = (
        t.path().join("old"),
        t.path().join("new"),
        t.path().join("work"),
    );
    driver_root(&old_root, VERSION);
    driver_root(&new_root, "550.54.15");
    let old = volume::build(&old_root, &work, VERSION).unwrap();
    let before = listing(&old.path);
    let new = volume::build(&new_root, &work, "550.54.15").unwrap();
    assert_eq!(new.path, work.join("volumes/nvidia_550.54.15"));
    assert_ne!(new.path, old.path);
    assert!(new.path.join("lib64/libcuda.so.550.54.15").is_file());
    assert!(!new.path.join("lib64/libcuda.so.535.129.03").exists());
    assert_eq!(listing(&old.path), before, "the old volume changed");
}

#[test]
fn bad_version_and_missing_cache_are_errors() {
    if !available("bad_version_and_missing_cache_are_errors") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let (root, work) = (t.path().join("root"), t.path().join("work"));
    driver_root(&root, VERSION);
    for bad in ["", "../../etc", "535.129.03/x", "latest"] {
        let e = volume::build(&root, &work, bad).unwrap_err();
        assert!(matches!(e, VolumeError::BadVersion(_)), "{bad}: {e}");
    }
    std::fs::remove_file(root.join("etc/ld.so.cache")).unwrap();
    let e = volume::build(&root, &work, VERSION).unwrap_err();
    assert!(matches!(e, VolumeError::NoLdCache { .. }), "{e}");
    assert!(
        e.to_string()
            .contains(&root.join("etc/ld.so.cache").display().to_string()),
        "{e}"
    );
    assert!(!work
        .join("volumes")
        .join(format!("nvidia_{VERSION}"))
        .exists());
}
