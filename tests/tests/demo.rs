//! The README quickstart, `gpuctl demo`, runs to the end and exits 0.
#![allow(clippy::unwrap_used)]

use std::process::Command;

#[test]
fn demo_runs_both_jobs_and_exits_zero() {
    // With Docker when the test may use it, else host processes.
    let docker = gpuctl_tests::docker_or_skip("demo (Docker path)");
    let mut cmd = Command::new(gpuctl_tests::bin("gpuctl"));
    cmd.arg("demo");
    if !docker {
        cmd.arg("--no-docker");
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("simulated"), "{stdout}");
    for line in [
        "demo-1gpu: SUCCEEDED",
        "demo-2gpu: SUCCEEDED",
        "Both jobs SUCCEEDED",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in:\n{stdout}");
    }
    // The 2-GPU job printed the two GPUs it was given.
    let printed = stdout
        .lines()
        .find(|l| l.starts_with("[demo-2gpu] job"))
        .unwrap_or_else(|| panic!("no output of demo-2gpu in:\n{stdout}"));
    assert_eq!(printed.matches("GPU-").count(), 2, "{printed}");
    if docker {
        assert!(stdout.contains("Jobs run in Docker containers"), "{stdout}");
    } else {
        assert!(stdout.contains("host processes"), "{stdout}");
    }
}
