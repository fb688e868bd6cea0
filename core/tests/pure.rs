//! The core stays pure: nothing it links (normal dependencies, any depth)
//! is an async runtime, an RPC or an HTTP stack. Adding one fails this test
//! rather than silently making the state machine, the allocator and
//! placement able to block or do I/O.

use std::process::Command;

const FORBIDDEN: &[&str] = &[
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
];

#[test]
fn the_core_links_no_async_runtime_rpc_or_http_stack() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-p",
            "gpuctl-core",
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
    assert!(crates.contains(&"gpuctl-core"), "unexpected output: {tree}");
    assert!(crates.contains(&"prost"), "unexpected output: {tree}");
    let bad: Vec<&&str> = crates.iter().filter(|c| FORBIDDEN.contains(c)).collect();
    assert!(bad.is_empty(), "gpuctl-core links {bad:?}:\n{tree}");
}
