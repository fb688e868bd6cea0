//! Real PyTorch through gpuctl (docs/scheduling.md, "PyTorch"): the
//! example `examples/pytorch/train.py` as a 2-rank gang, first with
//! `init_process_group` reading gpuctl's RANK/WORLD_SIZE/MASTER_* (no
//! wrapper), then under `torchrun` reading gpuctl's PET_* variables, which
//! resumes from the checkpoint the first run left in `--checkpoint-dir`.
//! DDP over gloo on CPU (simulated GPUs); both ranks must end with the same
//! weights.
//!
//! Needs a Python with torch: `GPUCTL_TEST_PYTHON` (CI installs one, see
//! `.ci/run`). Without it the test says it is skipped, unless
//! `GPUCTL_REQUIRE_TORCH=1`, where it fails.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use gpuctl_tests::{AgentOpts, Cluster, Gpuctl};

/// The Python with torch, or `None` (skip) when there is none and it is
/// not required.
fn torch_python() -> Option<String> {
    let required = std::env::var("GPUCTL_REQUIRE_TORCH").is_ok_and(|v| v == "1");
    let python = std::env::var("GPUCTL_TEST_PYTHON").ok();
    let works = python.as_ref().is_some_and(|p| {
        std::process::Command::new(p)
            .args(["-c", "import torch, torch.distributed"])
            .status()
            .is_ok_and(|s| s.success())
    });
    match (works, required) {
        (true, _) => python,
        (false, true) => {
            panic!("GPUCTL_REQUIRE_TORCH=1 but GPUCTL_TEST_PYTHON ({python:?}) has no torch")
        }
        (false, false) => {
            eprintln!("skipped: set GPUCTL_TEST_PYTHON to a Python with torch to run");
            None
        }
    }
}

/// What each rank wrote: `rank R of W: step S loss L weights-sum X`.
fn ranks(out: &Path) -> Vec<String> {
    let mut lines: Vec<String> = (0..2)
        .map(|r| {
            std::fs::read_to_string(out.join(format!("rank-{r}")))
                .unwrap_or_default()
                .trim()
                .to_string()
        })
        .collect();
    lines.sort();
    lines
}

/// The weights' sum a rank reported.
fn weights(line: &str) -> &str {
    line.rsplit(' ').next().unwrap()
}

#[test]
fn ddp_and_torchrun_gangs_train_and_resume_from_their_checkpoint() {
    let Some(python) = torch_python() else {
        return;
    };
    let mut c = Cluster::start(&[]);
    let root = c.dir.path().join("ckpt");
    std::fs::create_dir_all(&root).unwrap();
    c.add_agent(AgentOpts {
        simulate_gpus: Some("2xA100-SXM4-40GB"),
        extra: vec!["--allowed-mounts".into(), root.display().to_string()],
        ..Default::default()
    });
    // The example, where the tasks' users can read it.
    let work = gpuctl_tests::task_writable_dir(&c.dir.path().join("work"));
    let example = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/pytorch/train.py");
    let script = work.join("train.py");
    std::fs::copy(&example, &script).unwrap();
    let ckpt = root.join("run-1").display().to_string();
    let run = |name: &str, steps: &str, command: &[&str]| {
        let out = gpuctl_tests::task_writable_dir(&work.join(name));
        let env_out = format!("OUT={}", out.display());
        let env_steps = format!("STEPS={steps}");
        let mut args = vec![
            "--name",
            name,
            "--gpus",
            "1",
            "--cpus",
            "1",
            "--replicas",
            "2",
            // No --user: the ranks on one agent share the task user the
            // agent gives the job, which owns the checkpoint directory.
            "--checkpoint-dir",
            &ckpt,
            "--env",
            &env_out,
            "--env",
            &env_steps,
            "--",
        ];
        args.extend_from_slice(command);
        let job = c.submit(&args);
        let (code, state) = c.wait_job(&job, 240);
        let logs = String::from_utf8_lossy(&c.gpuctl(&["jobs", "logs", &job]).stdout).to_string();
        assert_eq!(
            (code, state.as_str()),
            (0, "SUCCEEDED"),
            "{}\n{logs}\n{}",
            c.job(&job),
            c.diagnostics()
        );
        (ranks(&out), logs)
    };
    let script = script.display().to_string();

    // One process per task, init_process_group("env://") on gpuctl's
    // variables.
    let (lines, _) = run("ddp", "30", &[&python, &script]);
    assert!(lines[0].starts_with("rank 0 of 2: step 30 "), "{lines:?}");
    assert!(lines[1].starts_with("rank 1 of 2: step 30 "), "{lines:?}");
    assert_eq!(
        weights(&lines[0]),
        weights(&lines[1]),
        "DDP keeps the ranks in step"
    );

    // torchrun in each task, with no arguments but the script: it reads
    // PET_NNODES, PET_NODE_RANK and PET_MASTER_*; resumes at step 30.
    let (lines, logs) = run(
        "torchrun",
        "50",
        &[&python, "-m", "torch.distributed.run", &script],
    );
    assert!(lines[0].starts_with("rank 0 of 2: step 50 "), "{lines:?}");
    assert!(lines[1].starts_with("rank 1 of 2: step 50 "), "{lines:?}");
    assert_eq!(weights(&lines[0]), weights(&lines[1]));
    assert!(
        logs.contains("resumed at step 30 with world size 2"),
        "{logs}"
    );
}
