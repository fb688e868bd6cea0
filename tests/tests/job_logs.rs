//! `gpuctl jobs logs` of a gang job: every rank's output interleaved by
//! line with a `[rank N]` prefix, one rank with `--rank`, an earlier
//! attempt with `--attempt`, and `--follow` for all ranks while they run.
//! Real master, agents and processes over loopback.
#![allow(clippy::unwrap_used)]

use gpuctl_tests::{AgentOpts, Cluster, Gpuctl};

fn agent(c: &mut Cluster) {
    c.add_agent(AgentOpts {
        simulate_gpus: Some("2xA100-SXM4-40GB"),
        ..Default::default()
    });
}

/// Each rank prints numbered lines, with pauses so that the ranks' lines
/// interleave, then a last line without its newline.
const SCRIPT: &str = r#"
for i in 1 2 3 4; do echo "r$GPUCTL_RANK line $i of attempt $A"; sleep 0.2; done
if [ "$GPUCTL_RANK" = 1 ] && [ ! -e "$OUT/failed-once" ]; then
  : > "$OUT/failed-once"; echo "r1 fails attempt $A"; exit 3
fi
printf "r$GPUCTL_RANK done"
"#;

fn lines_of(out: &str, prefix: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .map(str::to_string)
        .collect()
}

#[test]
fn every_ranks_output_by_line_with_its_rank() {
    let mut c = Cluster::start(&[]);
    agent(&mut c);
    agent(&mut c);
    let out = gpuctl_tests::task_writable_dir(&c.dir.path().join("out"));
    let env = format!("OUT={}", out.display());
    // The attempt number, for the lines: 1 before the marker exists.
    let script = format!("A=1; [ -e \"$OUT/failed-once\" ] && A=2; export A; {SCRIPT}");
    let j = c.submit(&[
        "--name",
        "ranks",
        "--cpus",
        "0.1",
        "--gpus",
        "1",
        "--replicas",
        "2",
        "--max-retries",
        "1",
        "--env",
        &env,
        "--",
        "sh",
        "-c",
        &script,
    ]);
    // Followed from the start: the first attempt's ranks, until they end.
    let followed = c.ok(&["jobs", "logs", &j, "--follow", "--attempt", "1"]);
    assert_eq!(c.wait_job(&j, 60), (0, "SUCCEEDED".to_string()));

    // The latest attempt: both ranks, every line whole and prefixed.
    let all = c.ok(&["jobs", "logs", &j]);
    for rank in 0..2 {
        let mine = lines_of(&all, &format!("[rank {rank}] "));
        let want: Vec<String> = (1..=4)
            .map(|i| format!("r{rank} line {i} of attempt 2"))
            .chain([format!("r{rank} done")])
            .collect();
        assert_eq!(mine, want, "rank {rank} in:\n{all}");
    }
    assert!(
        all.lines()
            .all(|l| l.starts_with("[rank 0] ") || l.starts_with("[rank 1] ")),
        "a line without its rank:\n{all}"
    );

    // One rank: its output as it is, without a prefix.
    let one = c.ok(&["jobs", "logs", &j, "--rank", "1"]);
    assert_eq!(
        one,
        "r1 line 1 of attempt 2\nr1 line 2 of attempt 2\nr1 line 3 of attempt 2\nr1 line 4 of attempt 2\nr1 done"
    );

    // The first attempt: rank 1 failed it.
    let first = c.ok(&["jobs", "logs", &j, "--attempt", "1"]);
    assert!(first.contains("[rank 1] r1 fails attempt 1\n"), "{first}");
    assert!(
        first.contains("[rank 0] r0 line 1 of attempt 1\n"),
        "{first}"
    );
    assert!(!first.contains("attempt 2"), "{first}");
    // What --follow printed while it ran is that attempt's output too.
    for l in [
        "[rank 1] r1 fails attempt 1",
        "[rank 0] r0 line 1 of attempt 1",
    ] {
        assert!(followed.contains(l), "{l} not followed:\n{followed}");
    }
    // Followed live, the ranks' lines come as they were written: both
    // ranks' first lines before either's last.
    let at = |l: &str| {
        followed
            .find(l)
            .unwrap_or_else(|| panic!("{l}:\n{followed}"))
    };
    for (a, b) in [(0, 1), (1, 0)] {
        assert!(
            at(&format!("r{a} line 1 of attempt 1")) < at(&format!("r{b} line 4 of attempt 1")),
            "not interleaved:\n{followed}"
        );
    }

    // Asking for what is not there names the field.
    let bad = c.gpuctl(&["jobs", "logs", &j, "--attempt", "3"]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("attempt") && err.contains("2 attempt"),
        "{err}"
    );
    let bad = c.gpuctl(&["jobs", "logs", &j, "--rank", "2"]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && err.contains("rank"), "{err}");
    let bad = c.gpuctl(&["jobs", "logs", &j, "--attempt", "0"]);
    assert!(!bad.status.success());
}
