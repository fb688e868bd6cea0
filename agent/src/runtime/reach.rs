//! Why a task's user could not start its program: the first directory it
//! cannot search, the program it cannot execute, or a script's interpreter
//! it cannot reach. A bare "Permission denied" from exec says none of it,
//! and names neither the user nor the path.
//!
//! Read from the mode bits, owner and group, as the kernel checks them for
//! a process of that user and group with no supplementary groups (a task
//! has none); ACLs and LSMs are not read, so when this finds nothing the
//! exec error is reported as it is.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use gpuctl_core::types::UserIds;

const READ: u32 = 4;
const EXEC: u32 = 1;

/// The program's path as exec would find it: itself when it names a
/// directory, else the first executable file of that name on `path_var`.
pub fn resolve(program: &str, cwd: &Path, path_var: Option<&str>) -> Option<PathBuf> {
    if program.contains('/') {
        return Some(cwd.join(program));
    }
    path_var?
        .split(':')
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(d).join(program))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Whether `user` may do `want` (READ, EXEC, or both) to a file of this
/// mode, owner and group.
fn allowed(meta: &std::fs::Metadata, user: UserIds, want: u32) -> bool {
    if user.uid == 0 {
        // Root may search any directory, execute any file with an x bit.
        return want & EXEC == 0 || meta.is_dir() || meta.mode() & 0o111 != 0;
    }
    let bits = if meta.uid() == user.uid {
        meta.mode() >> 6
    } else if meta.gid() == user.gid {
        meta.mode() >> 3
    } else {
        meta.mode()
    } & 0o7;
    bits & want == want
}

fn describe(path: &Path, meta: &std::fs::Metadata) -> String {
    format!(
        "{} (mode {:o}, owner {}:{})",
        path.display(),
        meta.mode() & 0o7777,
        meta.uid(),
        meta.gid()
    )
}

/// The first place on the way to `path` that `user` cannot pass, in words;
/// `None` when the bits allow all of it (or a part cannot be read).
fn blocked(path: &Path, user: UserIds, want: u32, what: &str) -> Option<String> {
    let mut so_far = PathBuf::new();
    let parts: Vec<_> = path.components().collect();
    for (i, part) in parts.iter().enumerate() {
        so_far.push(part);
        let last = i + 1 == parts.len();
        let meta = match std::fs::metadata(&so_far) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Some(format!("{what} {} does not exist", so_far.display()))
            }
            Err(_) => return None,
        };
        if !last && meta.is_dir() && !allowed(&meta, user, EXEC) {
            return Some(format!(
                "it cannot search the directory {} on the way to {what} {}",
                describe(&so_far, &meta),
                path.display()
            ));
        }
        if last && !allowed(&meta, user, want) {
            let verb = if want & READ != 0 {
                "read and execute"
            } else {
                "execute"
            };
            return Some(format!(
                "it cannot {verb} {what} {}",
                describe(&so_far, &meta)
            ));
        }
    }
    None
}

/// The interpreter a script names on its `#!` line.
fn interpreter(script: &Path) -> Option<PathBuf> {
    use std::io::Read;
    let mut head = [0u8; 256];
    let n = std::fs::File::open(script).ok()?.read(&mut head).ok()?;
    let line = head[..n].strip_prefix(b"#!")?;
    let line = line.split(|b| *b == b'\n').next()?;
    let text = std::str::from_utf8(line).ok()?;
    text.split_whitespace().next().map(PathBuf::from)
}

/// Why `user` could not exec `program` (found from `cwd` and `path_var`):
/// the path it could not reach, or `None` when that cannot be told.
pub fn why_not(program: &str, cwd: &Path, path_var: Option<&str>, user: UserIds) -> Option<String> {
    let path = resolve(program, cwd, path_var)?;
    if let Some(why) = blocked(&path, user, EXEC, "the program") {
        return Some(why);
    }
    let interp = interpreter(&path)?;
    // A script is read by its interpreter, run as the same user.
    if let Some(why) = blocked(&path, user, READ | EXEC, "the script") {
        return Some(why);
    }
    blocked(&interp, user, EXEC, "its interpreter")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user() -> UserIds {
        UserIds {
            uid: 81234,
            gid: 81234,
        }
    }

    fn chmod(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    fn script(p: &Path, first_line: &str) {
        std::fs::write(p, format!("{first_line}\necho hi\n")).unwrap();
        chmod(p, 0o755);
    }

    #[test]
    fn a_closed_directory_above_the_interpreter_is_named() {
        let d = tempfile::tempdir().unwrap();
        chmod(d.path(), 0o755);
        let private = d.path().join("root");
        let venv = private.join("venv");
        std::fs::create_dir_all(&venv).unwrap();
        script(&venv.join("python"), "#!/bin/sh");
        chmod(&private, 0o700);
        let work = d.path().join("work");
        std::fs::create_dir(&work).unwrap();
        chmod(&work, 0o755);
        script(
            &work.join("train.py"),
            &format!("#!{}", venv.join("python").display()),
        );
        let why = why_not("./train.py", &work, None, user()).unwrap();
        assert!(
            why.contains("cannot search the directory")
                && why.contains(&format!("{} (mode 700", private.display()))
                && why.contains("its interpreter"),
            "{why}"
        );
        // Open it, and nothing is in the way.
        chmod(&private, 0o755);
        assert_eq!(why_not("./train.py", &work, None, user()), None);
    }

    #[test]
    fn a_program_without_an_x_bit_for_the_user_is_named() {
        let d = tempfile::tempdir().unwrap();
        chmod(d.path(), 0o755);
        let p = d.path().join("run");
        script(&p, "#!/bin/sh");
        chmod(&p, 0o744);
        let why = why_not(p.to_str().unwrap(), Path::new("/"), None, user()).unwrap();
        assert!(why.contains("cannot execute the program"), "{why}");
        // Found on PATH the same way.
        let path = d.path().display().to_string();
        chmod(&p, 0o755);
        assert_eq!(
            resolve("run", Path::new("/"), Some(&format!("/nonexistent:{path}"))),
            Some(p.clone())
        );
        assert_eq!(why_not("run", Path::new("/"), Some(&path), user()), None);
    }

    #[test]
    fn a_missing_interpreter_is_named() {
        let d = tempfile::tempdir().unwrap();
        chmod(d.path(), 0o755);
        let p = d.path().join("x.py");
        script(&p, "#!/usr/bin/gpuctl-no-such-python -u");
        let why = why_not(p.to_str().unwrap(), Path::new("/"), None, user()).unwrap();
        assert!(
            why.contains("its interpreter /usr/bin/gpuctl-no-such-python does not exist"),
            "{why}"
        );
    }
}
