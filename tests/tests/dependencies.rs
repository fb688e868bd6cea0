//! What crates link, read from `cargo tree` (normal dependencies, any
//! depth): a dependency that pulls in what a crate must not link fails
//! here, rather than silently changing what it is.
//!
//! - gpuctl-core stays pure: no async runtime, RPC or HTTP stack.
//! - gpuctl-engine (the state machine, the allocator, the scheduler's
//!   decisions) links none of that either, nor storage or consensus, so it
//!   cannot block, do I/O or reach into Raft.
//! - gpuctl, the command line, links no daemon: neither the master's
//!   storage and consensus (sled, raft) nor the agent's Docker client and
//!   NVML. `gpuctl demo` runs the daemon binaries instead.
#![allow(clippy::unwrap_used)]

use std::process::Command;

/// Every crate `package` links, by name.
fn linked(package: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-p",
            package,
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
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .collect()
}

/// Fails naming what of `forbidden` `package` links; `expected` must be
/// there (the output is what it seems).
fn check(package: &str, expected: &str, forbidden: &[&str]) {
    let crates = linked(package);
    assert!(crates.iter().any(|c| c == package), "{crates:?}");
    assert!(crates.iter().any(|c| c == expected), "{crates:?}");
    let bad: Vec<&String> = crates
        .iter()
        .filter(|c| forbidden.contains(&c.as_str()))
        .collect();
    assert!(bad.is_empty(), "{package} links {bad:?}:\n{crates:?}");
}

#[test]
fn the_core_links_no_async_runtime_rpc_or_http_stack() {
    check(
        "gpuctl-core",
        "prost",
        &[
            "tokio",
            "tonic",
            "axum",
            "hyper",
            "h2",
            "mio",
            "tower",
            "async-std",
            "futures",
            "reqwest",
        ],
    );
}

#[test]
fn the_engine_links_no_runtime_rpc_storage_or_raft() {
    check(
        "gpuctl-engine",
        "gpuctl-core",
        &[
            "tokio",
            "tonic",
            "axum",
            "hyper",
            "h2",
            "mio",
            "tower",
            "async-std",
            "futures",
            "reqwest",
            "sled",
            "raft",
            "raft-proto",
            "protobuf",
            "gpuctl-proto",
            "gpuctl-master",
            "tracing",
        ],
    );
}

#[test]
fn gpuctl_links_neither_sled_raft_bollard_nor_nvml() {
    check(
        "gpuctl",
        "tonic",
        &[
            "gpuctl-master",
            "gpuctl-agent",
            "sled",
            "raft",
            "bollard",
            "nvml-wrapper",
        ],
    );
}
