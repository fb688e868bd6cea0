//! `gpuctl` links no daemon: neither the master's storage and consensus
//! (sled, raft) nor the agent's Docker client and NVML. `gpuctl demo` runs
//! the daemon binaries instead. A dependency that pulls one in fails here.

use std::process::Command;

const FORBIDDEN: &[&str] = &[
    "gpuctl-master",
    "gpuctl-agent",
    "sled",
    "raft",
    "bollard",
    "nvml-wrapper",
];

#[test]
fn gpuctl_links_neither_sled_raft_bollard_nor_nvml() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-p",
            "gpuctl",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    let crates: Vec<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(crates.contains(&"gpuctl"), "unexpected output: {tree}");
    assert!(crates.contains(&"tonic"), "unexpected output: {tree}");
    let bad: Vec<&&str> = crates.iter().filter(|c| FORBIDDEN.contains(c)).collect();
    assert!(bad.is_empty(), "gpuctl links {bad:?}:\n{tree}");
}
