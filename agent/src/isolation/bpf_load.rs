//! Loading a cgroup device program (`bpf.rs`) into the kernel and attaching
//! it to a cgroup v2 directory, with the `bpf(2)` system call. The only
//! unsafe code is the two calls, each with a zeroed, fully sized
//! `union bpf_attr` whose pointers outlive the call.
//!
//! `cgroup2.rs` attaches one to each host-process task's cgroup before the
//! task execs (containers get Docker's own program).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use super::bpf::{to_bytes, Insn};

/// `BPF_PROG_LOAD`, `BPF_PROG_ATTACH` (`enum bpf_cmd`).
const BPF_PROG_LOAD: i64 = 5;
const BPF_PROG_ATTACH: i64 = 8;
/// `BPF_PROG_TYPE_CGROUP_DEVICE`.
const PROG_TYPE_CGROUP_DEVICE: u32 = 15;
/// `BPF_CGROUP_DEVICE` (`enum bpf_attach_type`).
const ATTACH_CGROUP_DEVICE: u32 = 6;
/// `BPF_F_ALLOW_MULTI`: programs of the parents keep running too.
const F_ALLOW_MULTI: u32 = 2;
/// Larger than any `union bpf_attr` the kernel reads for these commands;
/// the kernel checks that the bytes it does not know are zero.
const ATTR_SIZE: usize = 128;

#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    #[error("loading the device program: {source}; verifier: {log}")]
    Load { source: std::io::Error, log: String },
    #[error("opening cgroup {path}: {source}")]
    Cgroup {
        path: String,
        source: std::io::Error,
    },
    #[error("attaching the device program to {path}: {source}")]
    Attach {
        path: String,
        source: std::io::Error,
    },
}

fn put_u32(attr: &mut [u8; ATTR_SIZE], at: usize, v: u32) {
    attr[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}

fn put_u64(attr: &mut [u8; ATTR_SIZE], at: usize, v: u64) {
    attr[at..at + 8].copy_from_slice(&v.to_ne_bytes());
}

#[allow(unsafe_code)]
fn bpf(cmd: i64, attr: &mut [u8; ATTR_SIZE]) -> std::io::Result<i64> {
    // SAFETY: `attr` is a valid, writable buffer of ATTR_SIZE bytes for the
    // whole call; any pointers in it were set by the caller to buffers it
    // keeps alive across this call.
    let r = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr(),
            ATTR_SIZE as nix::libc::c_uint,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r)
}

#[allow(unsafe_code)]
fn own(fd: i32) -> OwnedFd {
    // SAFETY: the kernel just returned this new descriptor; nothing else
    // owns or closes it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// Loads `prog`; the returned descriptor keeps it alive until the program
/// is attached (an attached program lives as long as its cgroup).
pub fn load(prog: &[Insn]) -> Result<OwnedFd, BpfError> {
    let bytes = to_bytes(prog);
    let license = b"Apache-2.0\0";
    let mut log = vec![0u8; 64 * 1024];
    let mut attr = [0u8; ATTR_SIZE];
    // struct { u32 prog_type; u32 insn_cnt; u64 insns; u64 license;
    //          u32 log_level; u32 log_size; u64 log_buf; ... }
    put_u32(&mut attr, 0, PROG_TYPE_CGROUP_DEVICE);
    put_u32(&mut attr, 4, prog.len() as u32);
    put_u64(&mut attr, 8, bytes.as_ptr() as u64);
    put_u64(&mut attr, 16, license.as_ptr() as u64);
    put_u32(&mut attr, 24, 1);
    put_u32(&mut attr, 28, log.len() as u32);
    put_u64(&mut attr, 32, log.as_mut_ptr() as u64);
    match bpf(BPF_PROG_LOAD, &mut attr) {
        Ok(fd) => {
            let fd = i32::try_from(fd).map_err(|_| BpfError::Load {
                source: std::io::Error::other("descriptor out of range"),
                log: String::new(),
            })?;
            Ok(own(fd))
        }
        Err(source) => {
            let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
            Err(BpfError::Load {
                source,
                log: String::from_utf8_lossy(&log[..end]).trim().to_string(),
            })
        }
    }
}

/// Attaches a loaded device program to the cgroup v2 directory `cgroup`.
pub fn attach(prog: &OwnedFd, cgroup: &Path) -> Result<(), BpfError> {
    let dir = std::fs::File::open(cgroup).map_err(|source| BpfError::Cgroup {
        path: cgroup.display().to_string(),
        source,
    })?;
    let mut attr = [0u8; ATTR_SIZE];
    // struct { u32 target_fd; u32 attach_bpf_fd; u32 attach_type; u32 attach_flags; }
    put_u32(&mut attr, 0, dir.as_raw_fd() as u32);
    put_u32(&mut attr, 4, prog.as_raw_fd() as u32);
    put_u32(&mut attr, 8, ATTACH_CGROUP_DEVICE);
    put_u32(&mut attr, 12, F_ALLOW_MULTI);
    bpf(BPF_PROG_ATTACH, &mut attr)
        .map(|_| ())
        .map_err(|source| BpfError::Attach {
            path: cgroup.display().to_string(),
            source,
        })
}
