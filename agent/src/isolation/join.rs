//! Host processes join their task's cgroup before they exec, so not one
//! instruction of the task runs outside it.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use super::IsolationError;

/// Makes the child of `cmd` write itself into each `cgroup.procs` file
/// between fork and exec. A failure there fails the spawn.
pub fn join_before_exec(
    cmd: &mut tokio::process::Command,
    procs_files: &[PathBuf],
) -> Result<(), IsolationError> {
    join_before_exec_std(cmd.as_std_mut(), procs_files)
}

/// [`join_before_exec`] for a `std::process::Command` (the task supervisor).
#[allow(unsafe_code)]
pub fn join_before_exec_std(
    cmd: &mut std::process::Command,
    procs_files: &[PathBuf],
) -> Result<(), IsolationError> {
    use std::os::unix::process::CommandExt;
    if procs_files.is_empty() {
        return Ok(());
    }
    // Everything the child needs is allocated here, before the fork.
    let paths: Vec<CString> = procs_files
        .iter()
        .map(|p| {
            CString::new(p.as_os_str().as_bytes()).map_err(|_| IsolationError::Io {
                path: p.clone(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in path"),
            })
        })
        .collect::<Result<_, _>>()?;
    // SAFETY: the closure runs in the forked child before exec. It only makes
    // open, write and close system calls on memory prepared before the fork
    // (no allocation, no locks), which is async-signal-safe; writing "0" to
    // cgroup.procs moves the calling process itself.
    unsafe {
        cmd.pre_exec(move || {
            for p in &paths {
                let fd = nix::libc::open(p.as_ptr(), nix::libc::O_WRONLY | nix::libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let written = nix::libc::write(fd, b"0".as_ptr().cast(), 1);
                let err = std::io::Error::last_os_error();
                nix::libc::close(fd);
                if written != 1 {
                    return Err(err);
                }
            }
            Ok(())
        });
    }
    Ok(())
}
