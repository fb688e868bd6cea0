//! cgroup v2 device filtering: the eBPF program (type
//! `BPF_PROG_TYPE_CGROUP_DEVICE`) that decides, for each open or mknod of a
//! device node by a process of the cgroup, whether it may. Generated from
//! device rules, as runc and youki do. PURE: instructions as data;
//! `bpf_load.rs` loads them and `cgroup2.rs` attaches them to a host task's
//! cgroup before it runs.
//!
//! The kernel calls the program with a `struct bpf_cgroup_dev_ctx`:
//!
//! ```text
//! offset 0  u32 access_type   (access << 16) | type
//! offset 4  u32 major
//! offset 8  u32 minor
//! ```
//!
//! and allows the access when it returns 1. Rules are tried in order; the
//! first that matches decides; none matching gives the default.

use super::grants::TaskDevices;
use super::rules::{Access, DeviceKind, DeviceRule, HostDevices};

/// `BPF_DEVCG_DEV_*` of `include/uapi/linux/bpf.h`.
const DEV_BLOCK: i32 = 1;
const DEV_CHAR: i32 = 2;
/// `BPF_DEVCG_ACC_*`.
const ACC_MKNOD: i32 = 1;
const ACC_READ: i32 = 2;
const ACC_WRITE: i32 = 4;

// Opcodes (classic eBPF encoding: class | size/source | operation).
const LDX_W: u8 = 0x61; // dst = *(u32 *)(src + off)
const AND64_IMM: u8 = 0x57;
const RSH64_IMM: u8 = 0x77;
const MOV64_IMM: u8 = 0xb7;
const MOV64_REG: u8 = 0xbf;
const JNE_IMM: u8 = 0x55;
const EXIT: u8 = 0x95;

/// One eBPF instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Insn {
    pub code: u8,
    pub dst: u8,
    pub src: u8,
    pub off: i16,
    pub imm: i32,
}

impl Insn {
    const fn new(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
        Insn {
            code,
            dst,
            src,
            off,
            imm,
        }
    }

    /// The 8 bytes the kernel reads (little-endian hosts: x86-64, arm64).
    pub fn to_bytes(self) -> [u8; 8] {
        let mut b = [0u8; 8];
        b[0] = self.code;
        b[1] = (self.src << 4) | (self.dst & 0x0f);
        b[2..4].copy_from_slice(&self.off.to_le_bytes());
        b[4..8].copy_from_slice(&self.imm.to_le_bytes());
        b
    }
}

/// The program's bytes, as `BPF_PROG_LOAD` takes them.
pub fn to_bytes(prog: &[Insn]) -> Vec<u8> {
    prog.iter().flat_map(|i| i.to_bytes()).collect()
}

fn access_bits(a: Access) -> i32 {
    (if a.mknod { ACC_MKNOD } else { 0 })
        | (if a.read { ACC_READ } else { 0 })
        | (if a.write { ACC_WRITE } else { 0 })
}

/// Registers after the prologue: r2 type, r3 access, r4 major, r5 minor
/// (r1, the context, is free for scratch after it).
fn prologue() -> [Insn; 6] {
    [
        Insn::new(LDX_W, 2, 1, 0, 0),
        Insn::new(AND64_IMM, 2, 0, 0, 0xffff),
        Insn::new(LDX_W, 3, 1, 0, 0),
        Insn::new(RSH64_IMM, 3, 0, 0, 16),
        Insn::new(LDX_W, 4, 1, 4, 0),
        Insn::new(LDX_W, 5, 1, 8, 0),
    ]
}

/// The instructions of one rule: its tests, each jumping past the block
/// when it fails, then the verdict. A rule whose numbers do not fit the
/// compare (above i32::MAX; no Linux device has them) never matches.
fn rule_block(r: &DeviceRule) -> Vec<Insn> {
    // Tests jump to "next": patched once the block's length is known.
    let mut tests: Vec<Insn> = Vec::new();
    match r.kind {
        DeviceKind::Char => tests.push(Insn::new(JNE_IMM, 2, 0, 0, DEV_CHAR)),
        DeviceKind::Block => tests.push(Insn::new(JNE_IMM, 2, 0, 0, DEV_BLOCK)),
        DeviceKind::All => {}
    }
    let granted = access_bits(r.access);
    if granted != ACC_MKNOD | ACC_READ | ACC_WRITE {
        // The access asked must be a subset of the rule's: r1 = asked & !granted.
        tests.push(Insn::new(MOV64_REG, 1, 3, 0, 0));
        tests.push(Insn::new(AND64_IMM, 1, 0, 0, !granted));
        tests.push(Insn::new(JNE_IMM, 1, 0, 0, 0));
    }
    let number = |n: u32| i32::try_from(n).ok();
    for (reg, n) in [(4u8, r.major), (5u8, r.minor)] {
        if let Some(n) = n {
            match number(n) {
                Some(imm) => tests.push(Insn::new(JNE_IMM, reg, 0, 0, imm)),
                None => return Vec::new(),
            }
        }
    }
    let mut block = tests;
    block.push(Insn::new(MOV64_IMM, 0, 0, 0, i32::from(r.allow)));
    block.push(Insn::new(EXIT, 0, 0, 0, 0));
    let len = block.len();
    for (i, insn) in block.iter_mut().enumerate() {
        if insn.code == JNE_IMM {
            // Past the end of the block: len - (i + 1) instructions ahead.
            insn.off = i16::try_from(len - i - 1).unwrap_or(i16::MAX);
        }
    }
    block
}

/// The program for `rules`, tried in order, with `default_allow` when none
/// matches.
pub fn program(rules: &[DeviceRule], default_allow: bool) -> Vec<Insn> {
    let mut prog = prologue().to_vec();
    for r in rules {
        prog.extend(rule_block(r));
    }
    prog.push(Insn::new(MOV64_IMM, 0, 0, 0, i32::from(default_allow)));
    prog.push(Insn::new(EXIT, 0, 0, 0, 0));
    prog
}

fn char_dev(major: u32, minor: Option<u32>, access: Access) -> DeviceRule {
    DeviceRule {
        allow: true,
        kind: DeviceKind::Char,
        major: Some(major),
        minor,
        access,
    }
}

/// The devices every task may use, as runc's default set: creating any
/// node (opening it is what the rules decide), `/dev/null`, `zero`,
/// `full`, `random`, `urandom`, `tty`, `console`, `ptmx`, the pseudo
/// terminals, and `/dev/net/tun`.
pub fn harmless_devices() -> Vec<DeviceRule> {
    let m = Access {
        read: false,
        write: false,
        mknod: true,
    };
    let mut out = vec![
        DeviceRule {
            allow: true,
            kind: DeviceKind::Char,
            major: None,
            minor: None,
            access: m,
        },
        DeviceRule {
            allow: true,
            kind: DeviceKind::Block,
            major: None,
            minor: None,
            access: m,
        },
    ];
    for minor in [3, 5, 7, 8, 9] {
        out.push(char_dev(1, Some(minor), Access::RWM));
    }
    for minor in [0, 1, 2] {
        out.push(char_dev(5, Some(minor), Access::RWM));
    }
    out.push(char_dev(136, None, Access::RWM));
    out.push(char_dev(10, Some(200), Access::RWM));
    out
}

/// A task's device rules on cgroup v2: deny by default; allow the harmless
/// devices, and with GPUs or MIG devices its own nodes
/// ([`HostDevices::nodes_for`]: its GPUs or MIG devices' parents, its MIG
/// devices' caps, the control nodes). Every other GPU and caps node is
/// denied by default. A task without GPUs gets no NVIDIA node at all.
pub fn task_rules_v2(host: &HostDevices, task: &TaskDevices) -> Vec<DeviceRule> {
    let mut rules = harmless_devices();
    for node in host.nodes_for(task) {
        rules.push(char_dev(node.major, Some(node.minor), Access::RWM));
    }
    rules
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the program in rbpf's interpreter over one access.
    fn verdict(prog: &[Insn], kind: i32, access: i32, major: u32, minor: u32) -> bool {
        let bytes = to_bytes(prog);
        let vm = rbpf::EbpfVmRaw::new(Some(&bytes)).expect("rbpf accepts the program");
        let mut ctx = Vec::with_capacity(12);
        ctx.extend_from_slice(&((access << 16) | kind).to_le_bytes());
        ctx.extend_from_slice(&major.to_le_bytes());
        ctx.extend_from_slice(&minor.to_le_bytes());
        match vm.execute_program(&mut ctx).expect("runs") {
            0 => false,
            1 => true,
            other => panic!("the program returned {other}"),
        }
    }

    use crate::isolation::rules::test_host as host;

    const RW: i32 = ACC_READ | ACC_WRITE;

    #[test]
    fn a_task_opens_its_gpus_the_control_nodes_and_harmless_devices_only() {
        let prog = program(&task_rules_v2(&host(), &TaskDevices::gpus(&[1, 3])), false);
        // (type, access, major, minor, allowed)
        let table: &[(i32, i32, u32, u32, bool)] = &[
            (DEV_CHAR, RW, 195, 1, true),
            (DEV_CHAR, RW, 195, 3, true),
            (DEV_CHAR, ACC_READ, 195, 3, true),
            (DEV_CHAR, RW, 195, 0, false),
            (DEV_CHAR, RW, 195, 2, false),
            (DEV_CHAR, ACC_READ, 195, 2, false),
            (DEV_CHAR, RW, 195, 255, true),
            (DEV_CHAR, RW, 508, 0, true),
            (DEV_CHAR, RW, 508, 1, true),
            (DEV_CHAR, RW, 1, 3, true),         // null
            (DEV_CHAR, RW, 1, 9, true),         // urandom
            (DEV_CHAR, RW, 136, 7, true),       // a pty
            (DEV_CHAR, RW, 1, 1, false),        // /dev/mem
            (DEV_CHAR, RW, 10, 229, false),     // fuse
            (DEV_BLOCK, ACC_READ, 8, 0, false), // a disk
            (DEV_BLOCK, ACC_MKNOD, 8, 0, true), // creating is harmless
            (DEV_CHAR, ACC_MKNOD, 195, 0, true),
            (DEV_CHAR, RW | ACC_MKNOD, 195, 0, false),
            (DEV_BLOCK, RW, 195, 1, false), // a block device of the GPU's numbers
        ];
        for &(kind, access, major, minor, want) in table {
            assert_eq!(
                verdict(&prog, kind, access, major, minor),
                want,
                "type {kind} access {access} {major}:{minor}"
            );
        }
    }

    #[test]
    fn a_task_without_gpus_gets_no_nvidia_node() {
        let prog = program(&task_rules_v2(&host(), &TaskDevices::default()), false);
        for (major, minor) in [(195, 0), (195, 255), (508, 0)] {
            assert!(
                !verdict(&prog, DEV_CHAR, RW, major, minor),
                "{major}:{minor}"
            );
        }
        assert!(verdict(&prog, DEV_CHAR, RW, 1, 3));
    }

    #[test]
    fn a_mig_task_opens_its_parent_and_its_caps_only() {
        use crate::isolation::rules::test_mig_host;
        let task = TaskDevices {
            gpus: vec![3],
            caps: vec![30, 31],
            ..TaskDevices::default()
        };
        let prog = program(&task_rules_v2(&test_mig_host(), &task), false);
        // (major, minor, allowed)
        let table: &[(u32, u32, bool)] = &[
            (195, 3, true),   // the parent
            (240, 30, true),  // its GPU instance's access cap
            (240, 31, true),  // its compute instance's
            (240, 39, false), // another MIG device's
            (240, 40, false),
            (240, 1, false),  // mig-config
            (240, 2, false),  // mig-monitor
            (240, 77, false), // a caps node made after the program
            (195, 0, false),
            (195, 255, true),
            (508, 0, true),
        ];
        for &(major, minor, want) in table {
            assert_eq!(
                verdict(&prog, DEV_CHAR, RW, major, minor),
                want,
                "{major}:{minor}"
            );
        }
        // Without GPUs or MIG devices: no caps node either.
        let none = program(
            &task_rules_v2(&test_mig_host(), &TaskDevices::default()),
            false,
        );
        for (_, n) in &test_mig_host().caps {
            assert!(!verdict(&none, DEV_CHAR, RW, n.major, n.minor), "{n:?}");
        }
    }

    #[test]
    fn the_first_matching_rule_decides_and_access_must_be_granted_whole() {
        let deny_gpu0 = DeviceRule {
            allow: false,
            kind: DeviceKind::Char,
            major: Some(195),
            minor: Some(0),
            access: Access::RW,
        };
        let allow_all = DeviceRule {
            allow: true,
            kind: DeviceKind::All,
            major: None,
            minor: None,
            access: Access::RWM,
        };
        // The v1 shape: everything allowed but one GPU.
        let prog = program(&[deny_gpu0, allow_all], false);
        assert!(!verdict(&prog, DEV_CHAR, RW, 195, 0));
        assert!(!verdict(&prog, DEV_CHAR, ACC_WRITE, 195, 0));
        assert!(verdict(&prog, DEV_CHAR, RW, 195, 1));
        // mknod is outside the deny rule's rw: the next rule allows it.
        assert!(verdict(&prog, DEV_CHAR, ACC_MKNOD, 195, 0));
        assert!(verdict(&prog, DEV_BLOCK, RW, 8, 0));
        // A read-only rule does not grant a write.
        let ro = DeviceRule {
            allow: true,
            kind: DeviceKind::Char,
            major: Some(1),
            minor: Some(3),
            access: Access {
                read: true,
                write: false,
                mknod: false,
            },
        };
        let prog = program(&[ro], false);
        assert!(verdict(&prog, DEV_CHAR, ACC_READ, 1, 3));
        assert!(!verdict(&prog, DEV_CHAR, RW, 1, 3));
        // No rule: the default.
        assert!(verdict(&program(&[], true), DEV_CHAR, RW, 1, 1));
        assert!(!verdict(&program(&[], false), DEV_CHAR, RW, 1, 1));
    }

    #[test]
    fn every_jump_lands_inside_the_program() {
        let prog = program(
            &task_rules_v2(&host(), &TaskDevices::gpus(&[0, 1, 2, 3])),
            false,
        );
        for (i, insn) in prog.iter().enumerate() {
            if insn.code == JNE_IMM {
                let target = i as i64 + 1 + i64::from(insn.off);
                assert!(
                    target > i as i64 && (target as usize) < prog.len(),
                    "insn {i}"
                );
            }
        }
        assert_eq!(prog.last().map(|i| i.code), Some(EXIT));
        // 4096 instructions is the limit for unprivileged loads; a task's
        // program stays far below even with every GPU of a big host.
        assert!(prog.len() < 200, "{}", prog.len());
    }

    #[test]
    fn numbers_beyond_the_compare_never_match() {
        let huge = char_dev(u32::MAX, Some(0), Access::RWM);
        let prog = program(&[huge], false);
        assert!(!verdict(&prog, DEV_CHAR, RW, u32::MAX, 0));
    }
}
