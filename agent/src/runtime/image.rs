//! A tiny local image for demos and tests, built without any registry.
//!
//! The image is the host's static busybox plus applet symlinks, imported as a
//! rootfs (`docker import`). It needs `/bin/busybox` to be statically linked
//! (Debian: the `busybox-static` package), since the image holds no libc.

use bollard::errors::Error as BollardError;
use bollard::image::CreateImageOptions;
use bollard::Docker;
use bytes::Bytes;
use futures::StreamExt;

use super::RuntimeError;

pub const LOCAL_BUSYBOX_IMAGE: &str = "gpuctl/busybox:local";
const REPO: &str = "gpuctl/busybox";
const TAG: &str = "local";
const BUSYBOX_PATH: &str = "/bin/busybox";

static IMPORT_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Applets linked in `bin/`.
const APPLETS: &[&str] = &[
    "sh", "echo", "cat", "ls", "sleep", "env", "true", "false", "printf", "test", "[", "id",
    "head", "tail", "wc", "grep", "date", "hostname", "ps", "kill", "mkdir", "rm", "touch", "seq",
];

/// Returns the name of the local busybox image, importing it first if the
/// daemon does not have it. Safe to call concurrently.
pub async fn ensure_busybox_image(docker: &Docker) -> Result<String, RuntimeError> {
    // Callers in one process import once; other processes may still race,
    // which only leaves an untagged duplicate image.
    let _import = IMPORT_LOCK.lock().await;
    match docker.inspect_image(LOCAL_BUSYBOX_IMAGE).await {
        Ok(_) => return Ok(LOCAL_BUSYBOX_IMAGE.to_string()),
        Err(BollardError::DockerResponseServerError {
            status_code: 404, ..
        }) => {}
        Err(e) => return Err(image_error(format!("inspect: {e}"))),
    }

    let rootfs = busybox_rootfs()?;

    tracing::info!(
        image = LOCAL_BUSYBOX_IMAGE,
        bytes = rootfs.len(),
        "importing local busybox image"
    );
    let mut import = docker.create_image(
        Some(CreateImageOptions {
            from_src: "-",
            repo: REPO,
            tag: TAG,
            changes: vec![r#"CMD ["/bin/sh"]"#],
            ..Default::default()
        }),
        Some(Bytes::from(rootfs)),
        None,
    );
    while let Some(progress) = import.next().await {
        progress.map_err(|e| image_error(format!("import: {e}")))?;
    }
    Ok(LOCAL_BUSYBOX_IMAGE.to_string())
}

/// The image's root filesystem as a tar archive: the host's static
/// busybox, its applets and a minimal /etc (for `docker import`, `podman
/// import`).
pub fn busybox_rootfs() -> Result<Vec<u8>, RuntimeError> {
    let busybox = std::fs::read(BUSYBOX_PATH)
        .map_err(|e| image_error(format!("{BUSYBOX_PATH}: {e} (install busybox-static)")))?;
    check_static_elf(&busybox).map_err(|reason| {
        image_error(format!(
            "{BUSYBOX_PATH}: {reason}; a static busybox is required (install busybox-static)"
        ))
    })?;
    build_rootfs(&busybox).map_err(|e| image_error(format!("building the rootfs tarball: {e}")))
}

fn image_error(reason: String) -> RuntimeError {
    RuntimeError::Image {
        image: LOCAL_BUSYBOX_IMAGE.to_string(),
        reason,
    }
}

/// A rootfs tarball: `bin/busybox`, applet symlinks, and the empty
/// directories a container runtime expects to mount over.
fn build_rootfs(busybox: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut tar = tar::Builder::new(Vec::new());
    for (dir, mode) in [
        ("bin", 0o755),
        ("dev", 0o755),
        ("etc", 0o755),
        ("proc", 0o555),
        ("sys", 0o555),
        ("tmp", 0o1777),
    ] {
        let mut h = header(tar::EntryType::Directory, mode, 0);
        tar.append_data(&mut h, format!("{dir}/"), std::io::empty())?;
    }
    for (path, text) in [
        (
            "etc/passwd",
            "root:x:0:0:root:/tmp:/bin/sh\nnobody:x:65534:65534:nobody:/tmp:/bin/false\n",
        ),
        ("etc/group", "root:x:0:\nnogroup:x:65534:\n"),
    ] {
        let mut h = header(tar::EntryType::Regular, 0o644, text.len() as u64);
        tar.append_data(&mut h, path, text.as_bytes())?;
    }
    let mut h = header(tar::EntryType::Regular, 0o755, busybox.len() as u64);
    tar.append_data(&mut h, "bin/busybox", busybox)?;
    for applet in APPLETS {
        let mut h = header(tar::EntryType::Symlink, 0o777, 0);
        tar.append_link(&mut h, format!("bin/{applet}"), "busybox")?;
    }
    tar.into_inner()
}

fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(size);
    h.set_uid(0);
    h.set_gid(0);
    h
}

/// Fails if `bytes` is not an ELF file or has a program interpreter
/// (`PT_INTERP`), i.e. is dynamically linked.
fn check_static_elf(bytes: &[u8]) -> Result<(), String> {
    const PT_INTERP: u32 = 3;
    if bytes.get(..4) != Some(b"\x7fELF".as_slice()) {
        return Err("not an ELF executable".into());
    }
    let little = match bytes.get(5) {
        Some(1) => true,
        Some(2) => false,
        _ => return Err("unknown ELF byte order".into()),
    };
    let truncated = || "truncated ELF header".to_string();
    let read = |off: usize, len: usize| -> Result<u64, String> {
        let b = bytes.get(off..off + len).ok_or_else(truncated)?;
        let mut v = 0u64;
        for i in 0..len {
            let byte = if little { b[len - 1 - i] } else { b[i] };
            v = (v << 8) | u64::from(byte);
        }
        Ok(v)
    };
    let (phoff, phentsize, phnum) = match bytes.get(4) {
        Some(1) => (read(0x1c, 4)?, read(0x2a, 2)?, read(0x2c, 2)?),
        Some(2) => (read(0x20, 8)?, read(0x36, 2)?, read(0x38, 2)?),
        _ => return Err("unknown ELF class".into()),
    };
    for i in 0..phnum {
        let off = usize::try_from(phoff + i * phentsize).map_err(|_| truncated())?;
        if read(off, 4)? == u64::from(PT_INTERP) {
            return Err("dynamically linked (it has an ELF interpreter)".into());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::docker::connect_or_skip;

    #[test]
    fn static_check_tells_static_from_dynamic() {
        let busybox = std::fs::read(BUSYBOX_PATH).expect("busybox-static is installed");
        check_static_elf(&busybox).unwrap();
        // Any dynamically linked system binary.
        let ls = std::fs::read("/bin/ls").unwrap();
        assert!(check_static_elf(&ls)
            .unwrap_err()
            .contains("dynamically linked"));
        assert!(check_static_elf(b"#!/bin/sh\n").is_err());
        assert!(check_static_elf(b"\x7fELF\x02\x01").is_err());
    }

    #[test]
    fn rootfs_has_busybox_and_applets() {
        let tarball = build_rootfs(b"fake busybox").unwrap();
        let mut archive = tar::Archive::new(tarball.as_slice());
        let mut names = vec![];
        for entry in archive.entries().unwrap() {
            let entry = entry.unwrap();
            let path = entry.path().unwrap().to_string_lossy().into_owned();
            if path == "bin/sh" {
                assert_eq!(entry.header().entry_type(), tar::EntryType::Symlink);
                assert_eq!(
                    entry.link_name().unwrap().unwrap().to_str(),
                    Some("busybox")
                );
            }
            names.push(path);
        }
        for want in [
            "bin/busybox",
            "bin/sh",
            "bin/[",
            "bin/seq",
            "tmp/",
            "proc/",
            "dev/",
        ] {
            assert!(
                names.iter().any(|n| n == want),
                "{want} missing from {names:?}"
            );
        }
    }

    #[tokio::test]
    async fn busybox_image_is_imported_and_reused() {
        let Some(rt) = connect_or_skip("busybox_image_is_imported_and_reused").await else {
            return;
        };
        // Concurrent callers must all succeed.
        let client = rt.client().unwrap();
        let (a, b) = tokio::join!(ensure_busybox_image(&client), ensure_busybox_image(&client));
        assert_eq!(a.unwrap(), LOCAL_BUSYBOX_IMAGE);
        assert_eq!(b.unwrap(), LOCAL_BUSYBOX_IMAGE);
        rt.client()
            .unwrap()
            .inspect_image(LOCAL_BUSYBOX_IMAGE)
            .await
            .unwrap();
        assert_eq!(
            ensure_busybox_image(&rt.client().unwrap()).await.unwrap(),
            LOCAL_BUSYBOX_IMAGE
        );
    }
}
