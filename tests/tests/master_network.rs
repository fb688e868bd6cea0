//! Issue 32: a bad network between masters, made as an operator's network
//! would make it. Three masters, a client (and an agent) each in a network
//! namespace of their own (tests/src/netlab.rs); links cut with iptables,
//! made lossy with random drops and slow with a 200 ms delay each way.
//! Everything is asked through the real CLI from the client's namespace.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::time::{Duration, Instant};

use gpuctl_tests::netlab::NetLab;
use gpuctl_tests::{bin, root_or_skip, strip_ansi, test_dir, try_wait_for, Daemon};

const MASTERS: [&str; 3] = ["m1", "m2", "m3"];
const PORT: u16 = 7050;

/// Three masters in a lab, with a client host.
struct LabCluster {
    lab: NetLab,
    dir: tempfile::TempDir,
    masters: Vec<Daemon>,
}

impl LabCluster {
    fn start(extra_hosts: &[&str], master_extra: &[&str]) -> LabCluster {
        let dir = test_dir();
        let mut hosts: Vec<&str> = MASTERS.to_vec();
        hosts.push("client");
        hosts.extend_from_slice(extra_hosts);
        let lab = NetLab::new(
            &hosts,
            Path::new(env!("CARGO_BIN_EXE_net-delay")),
            dir.path(),
        );
        let peers = MASTERS
            .iter()
            .enumerate()
            .map(|(i, m)| format!("{}={}:{PORT}", i + 1, lab.ip(m)))
            .collect::<Vec<_>>()
            .join(",");
        let mut masters = Vec::new();
        for (i, m) in MASTERS.iter().enumerate() {
            let mut args = vec![
                "--node-id".to_string(),
                (i + 1).to_string(),
                "--listen".into(),
                format!("{}:{PORT}", lab.ip(m)),
                "--data-dir".into(),
                dir.path()
                    .join(format!("master{}", i + 1))
                    .display()
                    .to_string(),
                "--peers".into(),
                peers.clone(),
                // The lab's addresses are not loopback; nothing outside the
                // test's namespaces reaches them.
                "--insecure".into(),
            ];
            args.extend(master_extra.iter().map(|s| s.to_string()));
            masters.push(lab.spawn(
                m,
                &format!("master{}", i + 1),
                &bin("gpuctl-master"),
                &args,
                &[],
                dir.path().join(format!("master{}.log", i + 1)),
            ));
        }
        let mut c = LabCluster { lab, dir, masters };
        let ok = try_wait_for(Duration::from_secs(60), || {
            if c.masters.iter_mut().any(|m| !m.is_running()) {
                return true;
            }
            c.gpuctl(&["jobs", "list", "--json"]).status.success()
        }) && c.masters.iter_mut().all(|m| m.is_running());
        assert!(ok, "the masters do not serve\n{}", c.logs());
        c
    }

    fn master_list(&self) -> String {
        MASTERS
            .iter()
            .map(|m| format!("{}:{PORT}", self.lab.ip(m)))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `gpuctl --master <all masters> ARGS` from the client host.
    fn gpuctl(&self, args: &[&str]) -> std::process::Output {
        let masters = self.master_list();
        let mut all = vec!["--master", masters.as_str()];
        all.extend_from_slice(args);
        self.lab.output("client", &bin("gpuctl"), &all)
    }

    /// Where each master's log (without colours) ends now.
    fn log_lens(&self) -> Vec<usize> {
        self.masters
            .iter()
            .map(|m| strip_ansi(&m.log_text()).len())
            .collect()
    }

    /// The terms begun since `from` (log lengths): one per election, won
    /// or not (a pre-vote that fails begins none).
    fn election_terms(&self, from: &[usize]) -> std::collections::BTreeSet<u64> {
        let terms_in = |range: &dyn Fn(&str) -> String| {
            let mut terms = std::collections::BTreeSet::new();
            for m in &self.masters {
                for line in range(&m.name).lines() {
                    if line.contains("raft role changed") {
                        if let Some(t) = field(line, "term=") {
                            terms.insert(t);
                        }
                    }
                }
            }
            terms
        };
        let logs: Vec<(String, String, usize)> = self
            .masters
            .iter()
            .zip(from)
            .map(|(m, f)| (m.name.clone(), strip_ansi(&m.log_text()), *f))
            .collect();
        let log = |name: &str| logs.iter().find(|l| l.0 == name).unwrap();
        let before = terms_in(&|n| log(n).1[..log(n).2.min(log(n).1.len())].to_string());
        let after = terms_in(&|n| log(n).1[log(n).2.min(log(n).1.len())..].to_string());
        let base = before.last().copied().unwrap_or(0);
        assert!(
            base >= 1,
            "no term found in the masters' logs before the window"
        );
        after.into_iter().filter(|t| *t > base).collect()
    }

    fn logs(&self) -> String {
        self.masters
            .iter()
            .map(|m| format!("--- {}\n{}", m.name, gpuctl_tests::tail(&m.log_text(), 40)))
            .collect()
    }
}

fn field(line: &str, key: &str) -> Option<u64> {
    let rest = &line[line.find(key)? + key.len()..];
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// What a stretch of submits through the CLI saw.
struct Submits {
    acked: usize,
    failed: Vec<String>,
    /// Longest stretch of the window without an acknowledged submit.
    longest_gap: Duration,
}

/// Submits jobs one after another through the CLI for `window`.
fn submit_for(c: &LabCluster, window: Duration, name: &str) -> Submits {
    let start = Instant::now();
    let mut last_ack = start;
    let mut longest_gap = Duration::ZERO;
    let mut acked = 0;
    let mut failed = Vec::new();
    let mut n = 0;
    while start.elapsed() < window {
        n += 1;
        let job = format!("{name}-{n}");
        let out = c.gpuctl(&["jobs", "submit", "--name", &job, "--", "true"]);
        if out.status.success() {
            let now = Instant::now();
            longest_gap = longest_gap.max(now - last_ack);
            last_ack = now;
            acked += 1;
        } else {
            failed.push(format!(
                "{job}: exit {:?}: {}",
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    longest_gap = longest_gap.max(last_ack.elapsed());
    Submits {
        acked,
        failed,
        longest_gap,
    }
}

/// 30% loss and 200 ms delay each way on every link between masters, the
/// default settings: writes keep flowing (no 10 s without an acknowledged
/// submit) and at most one election in 30 s.
#[test]
fn lossy_slow_links_between_masters_keep_writes_flowing() {
    if !root_or_skip("lossy_slow_links_between_masters_keep_writes_flowing") {
        return;
    }
    let t0 = Instant::now();
    let mut c = LabCluster::start(&[], &[]);
    println!("masters serving after {:.1} s", t0.elapsed().as_secs_f64());
    c.lab.degrade_mesh(&MASTERS, 0.3, 200);
    let from = c.log_lens();
    let s = submit_for(&c, Duration::from_secs(30), "lossy");
    let terms = c.election_terms(&from);
    println!(
        "30% loss + 200 ms between masters, 30 s: {} submits acknowledged, {} failed, longest gap {:.1} s, elections in terms {:?}",
        s.acked,
        s.failed.len(),
        s.longest_gap.as_secs_f64(),
        terms
    );
    for f in &s.failed {
        println!("  {f}");
    }
    c.lab.heal();
    assert!(
        terms.len() <= 1,
        "{} elections in 30 s (terms {terms:?})\n{}",
        terms.len(),
        c.logs()
    );
    assert!(
        s.longest_gap < Duration::from_secs(10),
        "{:.1} s without an acknowledged submit\n{}",
        s.longest_gap.as_secs_f64(),
        c.logs()
    );
    assert!(s.acked >= 3, "only {} submits acknowledged", s.acked);
    // The operator is told the link is slow for the election timeout.
    assert!(
        c.masters
            .iter()
            .any(|m| strip_ansi(&m.log_text()).contains("the round trip to this raft peer")),
        "no master warned of the round trip\n{}",
        c.logs()
    );
    let _ = &c.dir;
}
