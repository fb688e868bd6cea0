//! Exactly once from the user's side (issue 32), with real processes.
//!
//! Three masters; both followers are frozen (SIGSTOP) while `gpuctl jobs
//! submit` talks to the leader, so its proposal cannot commit and the
//! leader steps down: gpuctl must end with exit 4 ("the outcome is
//! unknown"), naming the request id. Once the followers are thawed the
//! entry is committed after all; that id finds the one job, and a resend
//! with it answers that job instead of making a second. Then, on a master with TLS and
//! tokens: request ids belong to the token that sent them (another
//! tenant's token neither finds nor reuses them), a key reused for another
//! job is refused, and a token create sent again with its request id
//! prints the same secret instead of minting a second token.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use gpuctl_tests::{bin, gpuctl_at, tail, wait_for, Gpuctl, HaCluster};
use serde_json::Value;

/// Sends a signal by name through kill(1) (tests hold no unsafe code).
fn signal(pid: i32, sig: &str) -> bool {
    Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success())
}

/// Frozen processes, thawed when dropped (also when an assertion fails,
/// so that the cluster's drop can stop them).
struct Frozen(Vec<i32>);

impl Frozen {
    fn stop(pids: Vec<i32>) -> Frozen {
        for p in &pids {
            assert!(signal(*p, "STOP"), "SIGSTOP {p}");
        }
        Frozen(pids)
    }

    /// Thaws the last one.
    fn thaw_last(&mut self) {
        if let Some(p) = self.0.pop() {
            assert!(signal(p, "CONT"), "SIGCONT {p}");
        }
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        for p in &self.0 {
            signal(*p, "CONT");
        }
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).trim().to_string()
}

/// The request id an unknown outcome names: the KEY of its
/// "`gpuctl jobs get --request-id KEY`".
fn named_request_id(stderr: &str) -> String {
    let tail = stderr
        .split("gpuctl jobs get --request-id ")
        .nth(1)
        .unwrap_or_else(|| panic!("no request id named: {stderr}"));
    tail.split('`').next().unwrap().to_string()
}

#[test]
fn a_submit_whose_outcome_is_unknown_exits_4_and_its_request_id_makes_one_job() {
    let mut c = HaCluster::start(3, &[]);
    let leader = c.leader_id();
    let leader_addr = c.addr(leader).to_string();
    let followers: Vec<(u64, i32)> = c
        .masters
        .values()
        .filter(|m| m.id != leader)
        .map(|m| (m.id, m.daemon.pid()))
        .collect();
    let (thawed_first, _) = followers[followers.len() - 1];
    let mut frozen = Frozen::stop(followers.iter().map(|f| f.1).collect());
    // Only the leader is named: its proposal cannot commit without a
    // follower. It steps down (check-quorum) or the try times out; either
    // way the outcome is unknown, and no master leads until the thaw.
    let started = std::time::Instant::now();
    let out = Command::new(bin("gpuctl"))
        .args([
            "--master",
            &leader_addr,
            "jobs",
            "submit",
            "--name",
            "once",
            "--",
            "true",
        ])
        .env("GPUCTL_LEADER_DEADLINE", "3")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let took = started.elapsed();
    // One follower back: the old leader, whose log holds the entry and so
    // is ahead of it, is the only master it may elect, and the first thing
    // that leader commits in its new term commits the entry before it: the
    // submit is applied after gpuctl gave up (a leader committing what its
    // predecessor had, as in the issue). Then the other one.
    frozen.thaw_last();
    let live = format!("{leader_addr},{}", c.addr(thawed_first));
    wait_for(
        Duration::from_secs(60),
        "a leader of the two live masters",
        || gpuctl_at(&live, &["jobs", "list"]).status.success(),
    );
    drop(frozen);
    let stderr = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(4),
        "stdout {:?}, stderr {stderr}\n{}",
        text(&out.stdout),
        c.diagnostics()
    );
    assert_eq!(text(&out.stdout), "", "no job id printed");
    assert!(
        stderr.starts_with("error: the outcome is unknown"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    let key = named_request_id(&stderr);
    assert_eq!(key.len(), 32, "{stderr}");
    assert!(
        stderr.contains(&format!("--request-id {key}` added to the same command")),
        "{stderr}"
    );
    // The search went on past the plain 3 s once the outcome was unknown.
    assert!(took >= Duration::from_secs(6), "gave up after {took:?}");

    c.wait_serving();
    // The request id finds the job gpuctl could not confirm ...
    let found = c.json(&["jobs", "get", "--request-id", &key, "--json"]);
    assert_eq!(found["name"], "once", "{found}");
    let id = found["id"].as_str().unwrap().to_string();
    // ... and a resend with it answers that job instead of making another:
    // the cluster has exactly one.
    let again = c.ok(&[
        "jobs",
        "submit",
        "--name",
        "once",
        "--request-id",
        &key,
        "--",
        "true",
    ]);
    assert_eq!(again.trim(), id);
    let jobs = c.json(&["jobs", "list", "--json"]);
    let named: Vec<&Value> = jobs
        .as_array()
        .unwrap()
        .iter()
        .filter(|j| j["name"] == "once")
        .collect();
    assert_eq!(named.len(), 1, "{jobs}");
    // A key that no submit carried is not found, naming it.
    let out = c.gpuctl(&["jobs", "get", "--request-id", "never-sent"]);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        text(&out.stderr).contains("never-sent"),
        "{}",
        text(&out.stderr)
    );
}

/// One master with mutual TLS and tokens, no agent.
struct Secure {
    _dir: tempfile::TempDir,
    config: std::path::PathBuf,
    masters: Vec<(u64, String, gpuctl_tests::Daemon)>,
}

impl Secure {
    fn start() -> Secure {
        let dir = gpuctl_tests::test_dir();
        let (pki, masters) = gpuctl_tests::start_secure_masters(dir.path(), 1, &[]);
        let c = Secure {
            _dir: dir,
            config: pki.join("gpuctl.toml"),
            masters,
        };
        wait_for(Duration::from_secs(40), "the admin token works", || {
            c.run(None, &["whoami"]).status.success()
        });
        c
    }

    /// gpuctl with the config's admin token, or `token`.
    fn run(&self, token: Option<&str>, args: &[&str]) -> Output {
        let mut all: Vec<&str> = Vec::new();
        if let Some(t) = token {
            all.extend(["--token", t]);
        }
        all.extend_from_slice(args);
        gpuctl_tests::secure_gpuctl(&self.config, &all)
    }

    fn ok(&self, token: Option<&str>, args: &[&str]) -> String {
        let out = self.run(token, args);
        assert!(
            out.status.success(),
            "gpuctl {args:?}: {}\n{}",
            text(&out.stderr),
            tail(&self.masters[0].2.log_text(), 30)
        );
        text(&out.stdout)
    }
}

#[test]
fn request_ids_belong_to_their_token_and_a_resent_token_create_shows_its_secret() {
    let c = Secure::start();
    // A token create sent again with its request id: the same token and
    // secret, not a second one.
    let key = gpuctl_proto::new_request_id();
    let create = [
        "tokens",
        "create",
        "--role",
        "user",
        "--tenant",
        "alpha",
        "--request-id",
        &key,
    ];
    let alpha = c.ok(None, &create);
    assert!(alpha.starts_with("gct_"), "{alpha}");
    assert_eq!(c.ok(None, &create), alpha, "the same secret again");
    let listed = c.ok(None, &["tokens", "list"]);
    let alpha_tokens = listed.lines().filter(|l| l.contains("alpha")).count();
    assert_eq!(alpha_tokens, 1, "{listed}");
    // The same key for other settings: refused, naming the field.
    let out = c.run(
        None,
        &[
            "tokens",
            "create",
            "--role",
            "user",
            "--tenant",
            "beta",
            "--request-id",
            &key,
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("request_id"),
        "{}",
        text(&out.stderr)
    );
    // A key too short to seal a secret: a usage error naming the flag.
    let out = c.run(
        None,
        &[
            "tokens",
            "create",
            "--role",
            "user",
            "--tenant",
            "beta",
            "--request-id",
            "short",
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("--request-id"),
        "{}",
        text(&out.stderr)
    );
    let beta = c.ok(
        None,
        &["tokens", "create", "--role", "user", "--tenant", "beta"],
    );

    // Submits: a key is its token's.
    let submit = |token: &str, name: &str, gpus: &str| {
        c.run(
            Some(token),
            &[
                "jobs",
                "submit",
                "--name",
                name,
                "--gpus",
                gpus,
                "--request-id",
                "nightly",
                "--",
                "true",
            ],
        )
    };
    let a1 = text(&submit(&alpha, "a", "0").stdout);
    assert!(a1.starts_with("job-"), "{a1}");
    assert_eq!(
        text(&submit(&alpha, "a", "0").stdout),
        a1,
        "resent: the same job"
    );
    // Beta neither finds alpha's job through the key nor reuses it.
    let out = c.run(Some(&beta), &["jobs", "get", "--request-id", "nightly"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("nightly"),
        "{}",
        text(&out.stderr)
    );
    assert!(!text(&out.stderr).contains(&a1), "{}", text(&out.stderr));
    let b1 = text(&submit(&beta, "b", "0").stdout);
    assert!(b1.starts_with("job-") && b1 != a1, "{b1} {a1}");
    let got: Value = serde_json::from_str(&c.ok(
        Some(&beta),
        &["jobs", "get", "--request-id", "nightly", "--json"],
    ))
    .unwrap();
    assert_eq!(got["id"], b1.as_str());
    // Alpha's key sent with another job: refused, exit 1, naming the field.
    let out = submit(&alpha, "a", "1");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("request_id"),
        "{}",
        text(&out.stderr)
    );
    let got: Value = serde_json::from_str(&c.ok(
        Some(&alpha),
        &["jobs", "get", "--request-id", "nightly", "--json"],
    ))
    .unwrap();
    assert_eq!(got["id"], a1.as_str());
    let jobs: Value = serde_json::from_str(&c.ok(None, &["jobs", "list", "--json"])).unwrap();
    assert_eq!(jobs.as_array().unwrap().len(), 2, "{jobs}");
}
