//! Tenants that share a machine cannot touch each other's tasks (issue 31),
//! with real processes: a master with mutual TLS and tokens for two
//! tenants, one agent (process runtime, as root, its work dir outside
//! `/tmp` so that every path is seen as it is), and both tenants' host
//! tasks side by side on it.
//!
//! Each task checks from inside that it can neither read, signal nor write
//! the other (its `/proc/PID/environ` with a secret, SIGSTOP, its sandbox,
//! its launch record); the test checks from outside, by `/proc`, that each
//! runs under a uid of its own in a PID namespace of its own, and that the
//! other's attempts changed nothing. The agent is then SIGKILLed and
//! restarted under both: they keep their users, and a new task gets
//! another. Last, the uid policy: a tenant's job naming another tenant's
//! uid or a system group is refused by the master, naming the field and
//! the rule, and one the master would let through (the admin's) is
//! refused by the agent.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuctl_tests::{root_or_skip, tail, wait_for, SecureSingle, TASK_USERS};
use serde_json::Value;

struct Tenants {
    c: SecureSingle,
    alpha: String,
    beta: String,
}

impl Tenants {
    fn start() -> Tenants {
        let c = SecureSingle::start_in(gpuctl_tests::test_dir(), &[], "2xA100-SXM4-40GB");
        let token = |args: &[&str]| {
            let mut all = vec!["tokens", "create", "--role", "user"];
            all.extend_from_slice(args);
            c.ok(&all)
        };
        let alpha = token(&[
            "--tenant",
            "alpha",
            "--allow-uids",
            "3000-3099",
            "--allow-gids",
            "3000-3099",
        ]);
        let beta = token(&[
            "--tenant",
            "beta",
            "--allow-uids",
            "3100-3199",
            "--allow-gids",
            "3100-3199",
        ]);
        Tenants { c, alpha, beta }
    }

    fn gpuctl(&self, token: &str, args: &[&str]) -> std::process::Output {
        std::process::Command::new(gpuctl_tests::bin("gpuctl"))
            .arg("--config")
            .arg(self.c.pki.join("gpuctl.toml"))
            .args(args)
            .env("GPUCTL_TOKEN", token)
            .env_remove("GPUCTL_MASTER")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    }

    fn ok(&self, token: &str, args: &[&str]) -> String {
        let out = self.gpuctl(token, args);
        assert!(
            out.status.success(),
            "gpuctl {args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.diagnostics()
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    fn diagnostics(&self) -> String {
        format!(
            "--- master ---\n{}\n--- agent ---\n{}",
            tail(&self.c.master.log_text(), 20),
            tail(&self.c.agent.log_text(), 30)
        )
    }

    fn job(&self, token: &str, id: &str) -> Value {
        serde_json::from_str(&self.ok(token, &["jobs", "get", id, "--json"])).unwrap()
    }

    fn task_id(&self, token: &str, job: &str) -> String {
        self.job(token, job)["tasks"][0]["id"]
            .as_str()
            .unwrap()
            .to_string()
    }

    fn wait_state(&self, token: &str, job: &str, want: &str) -> Value {
        let mut last = Value::Null;
        let ok = gpuctl_tests::try_wait_for(Duration::from_secs(30), || {
            last = self.job(token, job);
            last["state"] == want
        });
        assert!(
            ok,
            "job {job} never {want}: {last:#}\n{}",
            self.diagnostics()
        );
        last
    }

    fn work_dir(&self) -> PathBuf {
        self.c.dir.path().join("agent")
    }

    fn sandbox(&self, task: &str) -> PathBuf {
        self.work_dir().join("tasks").join(task)
    }

    fn log(&self, task: &str) -> String {
        std::fs::read_to_string(self.sandbox(task).join("output.log")).unwrap_or_default()
    }

    fn wait_log(&self, task: &str, needle: &str) {
        let ok =
            gpuctl_tests::try_wait_for(Duration::from_secs(30), || self.log(task).contains(needle));
        assert!(
            ok,
            "{needle:?} not in {task}'s log: {}\n{}",
            self.log(task),
            self.diagnostics()
        );
    }

    /// The host pid of the task's command: the child of its task-init,
    /// whose pid the supervisor recorded.
    fn command_pid(&self, task: &str) -> i32 {
        let state: Value = serde_json::from_str(
            &std::fs::read_to_string(
                self.work_dir()
                    .join("state")
                    .join(task)
                    .join("supervisor.json"),
            )
            .unwrap(),
        )
        .unwrap();
        let init = state["task"]["pid"].as_i64().unwrap();
        let children =
            std::fs::read_to_string(format!("/proc/{init}/task/{init}/children")).unwrap();
        children
            .split_whitespace()
            .next()
            .unwrap_or_else(|| panic!("task-init {init} of {task} has no child"))
            .parse()
            .unwrap()
    }
}

/// `Uid:` (real) and `State:` of a process, from `/proc`.
fn uid_and_state(pid: i32) -> (u32, char) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .to_string()
    };
    (
        field("Uid:").parse().unwrap(),
        field("State:").chars().next().unwrap(),
    )
}

fn pid_ns(pid: i32) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/pid"))
        .unwrap()
        .display()
        .to_string()
}

/// What a task tries against its neighbour, once the test has written the
/// neighbour's pid, sandbox and state dir into `peer` in its own sandbox;
/// then it idles until stopped.
const PROBE: &str = r#"
echo "uid=$(id -u) gid=$(id -g) groups=$(id -G)"
echo ready
while [ ! -s peer ]; do sleep 0.1; done
. ./peer
if cat /proc/$PEER_PID/environ >/dev/null 2>&1; then echo environ-read; else echo environ-denied; fi
if kill -STOP $PEER_PID 2>/dev/null; then echo stop-sent; else echo stop-denied; fi
kill -STOP -1 2>/dev/null
if echo intruder > $PEER_SANDBOX/intruder 2>/dev/null; then echo sandbox-written; else echo sandbox-write-denied; fi
if ls $PEER_SANDBOX >/dev/null 2>&1; then echo sandbox-listed; else echo sandbox-list-denied; fi
if cat $PEER_STATE/launch.json >/dev/null 2>&1; then echo launch-read; else echo launch-denied; fi
echo procs=$(ls /proc | grep -c '^[0-9]')
echo probed
while :; do sleep 1; done
"#;

fn peer_file(t: &Tenants, own: &str, peer: &str, peer_pid: i32) {
    let text = format!(
        "PEER_PID={peer_pid}\nPEER_SANDBOX={}\nPEER_STATE={}\n",
        t.sandbox(peer).display(),
        t.work_dir().join("state").join(peer).display()
    );
    let path = t.sandbox(own).join("peer");
    let tmp = t.sandbox(own).join(".peer");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
}

fn submit(t: &Tenants, token: &str, name: &str, extra: &[&str], script: &str) -> String {
    // Small: three at once on this agent's CPUs.
    let mut args = vec!["jobs", "submit", "--name", name, "--cpus", "0.25"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    t.ok(token, &args)
}

#[test]
fn tenants_on_one_machine_cannot_touch_each_other() {
    if !root_or_skip("tenants_on_one_machine_cannot_touch_each_other") {
        return;
    }
    let mut t = Tenants::start();
    let ja = submit(
        &t,
        &t.alpha.clone(),
        "alpha-task",
        &["--secret-env", "SECRET=alpha-secret"],
        PROBE,
    );
    let jb = submit(
        &t,
        &t.beta.clone(),
        "beta-task",
        &["--secret-env", "SECRET=beta-secret"],
        PROBE,
    );
    t.wait_state(&t.alpha, &ja, "RUNNING");
    t.wait_state(&t.beta, &jb, "RUNNING");
    let (ta, tb) = (t.task_id(&t.alpha, &ja), t.task_id(&t.beta, &jb));
    t.wait_log(&ta, "ready\n");
    t.wait_log(&tb, "ready\n");
    let (pa, pb) = (t.command_pid(&ta), t.command_pid(&tb));

    // From outside: a user of each task's own, from the agent's range, and
    // a PID namespace of each task's own.
    let (ua, _) = uid_and_state(pa);
    let (ub, _) = uid_and_state(pb);
    assert_ne!(ua, ub);
    assert!(
        TASK_USERS.contains(&ua) && TASK_USERS.contains(&ub),
        "{ua} {ub}"
    );
    let own_ns = pid_ns(std::process::id() as i32);
    let (na, nb) = (pid_ns(pa), pid_ns(pb));
    assert!(
        na != nb && na != own_ns && nb != own_ns,
        "{na} {nb} {own_ns}"
    );
    // Each sandbox is its task's, private.
    use std::os::unix::fs::MetadataExt;
    for (task, uid) in [(&ta, ua), (&tb, ub)] {
        let md = std::fs::metadata(t.sandbox(task)).unwrap();
        assert_eq!(
            (md.uid(), md.gid(), md.mode() & 0o777),
            (uid, uid, 0o700),
            "{task}"
        );
    }
    // Both print their ids before the probe: no groups but their own.
    for (task, uid) in [(&ta, ua), (&tb, ub)] {
        let want = format!("uid={uid} gid={uid} groups={uid}\n");
        assert!(t.log(task).contains(&want), "{task}: {}", t.log(task));
    }

    // Each tries the other, with its host pid, sandbox and state dir.
    peer_file(&t, &ta, &tb, pb);
    peer_file(&t, &tb, &ta, pa);
    t.wait_log(&ta, "probed\n");
    t.wait_log(&tb, "probed\n");
    for task in [&ta, &tb] {
        let log = t.log(task);
        for want in [
            "environ-denied",
            "stop-denied",
            "sandbox-write-denied",
            "sandbox-list-denied",
            "launch-denied",
        ] {
            assert!(log.contains(&format!("{want}\n")), "{task}: {want}: {log}");
        }
        // task-init, the shell, its subshell, ls and grep at most: no
        // process of the other task, the agent or the host.
        let procs: usize = log
            .lines()
            .find_map(|l| l.strip_prefix("procs="))
            .unwrap()
            .parse()
            .unwrap();
        assert!(procs <= 5, "{task}: {log}");
    }
    // And nothing happened: neither was stopped, no file was left.
    for pid in [pa, pb] {
        let (_, state) = uid_and_state(pid);
        assert_ne!(state, 'T', "process {pid} was stopped");
    }
    for task in [&ta, &tb] {
        assert!(!t.sandbox(task).join("intruder").exists());
    }

    // The agent dies (SIGKILL) and comes back under both: each keeps its
    // user, from outside and in its checkpoint; a new task gets another.
    t.c.restart_agent();
    wait_for(Duration::from_secs(30), "the agent back", || {
        t.c.agent_active()
    });
    assert_eq!(uid_and_state(pa).0, ua);
    assert_eq!(uid_and_state(pb).0, ub);
    for (task, uid) in [(&ta, ua), (&tb, ub)] {
        let rec: Value = serde_json::from_str(
            &std::fs::read_to_string(t.work_dir().join("state").join(task).join("user.json"))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(rec["uid"], uid, "{task}");
    }
    let jc = submit(&t, &t.alpha.clone(), "alpha-again", &[], "id -u; sleep 300");
    t.wait_state(&t.alpha, &jc, "RUNNING");
    let tc = t.task_id(&t.alpha, &jc);
    t.wait_log(&tc, "\n");
    let uc: u32 = t.log(&tc).trim().parse().unwrap();
    assert!(TASK_USERS.contains(&uc) && uc != ua && uc != ub, "{uc}");
    assert_eq!(t.job(&t.alpha, &ja)["state"], "RUNNING");
    assert_eq!(t.job(&t.beta, &jb)["state"], "RUNNING");
    for (token, job) in [(&t.alpha, &ja), (&t.beta, &jb), (&t.alpha, &jc)] {
        t.ok(token, &["jobs", "cancel", job]);
    }
    for (token, job) in [(&t.alpha, &ja), (&t.beta, &jb), (&t.alpha, &jc)] {
        t.wait_state(token, job, "CANCELLED");
    }
    // Whatever ran in their namespaces is gone.
    for pid in [pa, pb] {
        assert!(
            gpuctl_tests::try_wait_for(Duration::from_secs(5), || {
                !Path::new(&format!("/proc/{pid}")).exists()
            }),
            "process {pid} outlived its task"
        );
    }
}

#[test]
fn a_tenant_names_only_the_users_its_token_allows() {
    if !root_or_skip("a_tenant_names_only_the_users_its_token_allows") {
        return;
    }
    let t = Tenants::start();
    let refused = |token: &str, user: &str| {
        let out = t.gpuctl(
            token,
            &[
                "jobs",
                "submit",
                "--name",
                "as-another",
                "--user",
                user,
                "--",
                "true",
            ],
        );
        assert!(!out.status.success(), "--user {user} was accepted");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    // Another tenant's uid.
    let err = refused(&t.beta, "3000");
    assert!(err.contains("spec.security.user: uid 3000"), "{err}");
    assert!(
        err.contains("3100-3199") && err.contains("--allow-uids"),
        "{err}"
    );
    // Its own uid with a system group (shadow is 42 on Debian).
    let err = refused(&t.beta, "3100:42");
    assert!(err.contains("spec.security.user: gid 42"), "{err}");
    // Without a policy (the admin gave none), no user at all.
    let plain =
        t.c.ok(&["tokens", "create", "--role", "user", "--tenant", "gamma"]);
    let err = refused(&plain, "3100");
    assert!(err.contains("uid 3100") && err.contains("(none)"), "{err}");
    // Nothing of these reached the cluster.
    let jobs = t.c.ok(&["jobs", "list", "--json"]);
    assert_eq!(
        serde_json::from_str::<Value>(&jobs).unwrap(),
        serde_json::json!([])
    );

    // Within its range: runs as exactly that, without other groups.
    let job = t.ok(
        &t.beta,
        &[
            "jobs",
            "submit",
            "--name",
            "as-mine",
            "--user",
            "3100:3101",
            "--",
            "sh",
            "-c",
            "echo $(id -u) $(id -g) $(id -G)",
        ],
    );
    t.wait_state(&t.beta, &job, "SUCCEEDED");
    let task = t.task_id(&t.beta, &job);
    assert_eq!(t.log(&task), "3100 3101 3101\n");

    // The admin's token allows every id; the agent does not allow a system
    // group (nor its own task users), and says so to the master: the job
    // waits, naming the user and the agent option, and never reaches the
    // agent (which would refuse it itself: defence in depth, unit-tested
    // in agent/src/security.rs).
    for (user, ids) in [("3100:42", "3100:42"), ("80001", "80001:80001")] {
        let job = t.c.ok(&[
            "jobs", "submit", "--name", "admins", "--user", user, "--", "true",
        ]);
        let want = format!("no agent lets jobs run as user {ids} (agent option allowed_users)");
        let mut j = Value::Null;
        let waits = gpuctl_tests::try_wait_for(Duration::from_secs(30), || {
            j = serde_json::from_str(&t.c.ok(&["jobs", "get", &job, "--json"])).unwrap();
            j["reason"].as_str().is_some_and(|r| r.contains(&want))
        });
        assert!(waits, "{user}: {j:#}\n{}", t.diagnostics());
        assert_eq!(j["state"], "QUEUED", "{user}: {j:#}");
        assert_eq!(j["tasks"], serde_json::json!([]), "{user}: {j:#}");
        t.c.ok(&["jobs", "cancel", &job]);
    }
}

/// Forks 300 children that sleep, counting the forks the kernel allowed.
const FORK_BOMB: &str = "import os, time
n = 0
for i in range(300):
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
    except OSError:
        pass
print('forked', n, flush=True)
time.sleep(60)
";

/// One task cannot use up the host's pids under its neighbours: a fork
/// bomb stops at the agent's `task_pids_max` (the kernel counts the
/// refusals in the task's `pids.events`), and the neighbour on the same
/// agent still forks what it needs.
#[test]
fn a_tasks_fork_bomb_stops_at_its_pids_max() {
    if !root_or_skip("a_tasks_fork_bomb_stops_at_its_pids_max") {
        return;
    }
    let v1 = Path::new("/sys/fs/cgroup/pids/cgroup.procs").exists();
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    if !v1 && !v2 {
        eprintln!("skipped: no pids controller");
        return;
    }
    let mut c = gpuctl_tests::Cluster::start(&[]);
    let agent = c.add_agent(gpuctl_tests::AgentOpts {
        extra: vec!["--task-pids-max".into(), "40".into()],
        ..Default::default()
    });
    use gpuctl_tests::Gpuctl;
    let bomb = c.submit(&[
        "--name", "bomb", "--cpus", "0.25", "--", "python3", "-c", FORK_BOMB,
    ]);
    let job = c.wait_state(&bomb, "RUNNING", Duration::from_secs(30));
    let task = job["tasks"][0]["id"].as_str().unwrap().to_string();
    let cg = if v1 {
        PathBuf::from("/sys/fs/cgroup/pids/gpuctl")
            .join(&agent)
            .join(&task)
    } else {
        PathBuf::from("/sys/fs/cgroup/gpuctl")
            .join(&agent)
            .join(&task)
    };
    let read = |f: &str| std::fs::read_to_string(cg.join(f)).unwrap_or_default();
    let refused = || {
        read("pids.events")
            .split_whitespace()
            .nth(1)
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let hit = gpuctl_tests::try_wait_for(Duration::from_secs(20), || refused() > 0);
    assert!(
        hit,
        "no fork refused in {}: max {:?}, current {:?}, events {:?}; log: {}",
        cg.display(),
        read("pids.max"),
        read("pids.current"),
        read("pids.events"),
        c.ok(&["jobs", "logs", &bomb])
    );
    assert_eq!(read("pids.max").trim(), "40");
    let current: u64 = read("pids.current").trim().parse().unwrap();
    assert!(current <= 40, "{current}");
    // Seen from inside: far fewer than 300 forks went through.
    let mut log = String::new();
    wait_for(Duration::from_secs(20), "the bomb's count", || {
        log = c.ok(&["jobs", "logs", &bomb]);
        log.contains("forked ")
    });
    let forked: u64 = log.trim().trim_start_matches("forked ").parse().unwrap();
    assert!(forked < 40, "{log}");
    // The neighbour forks 30 processes beside the bomb at its limit.
    let neighbour = c.submit(&[
        "--name",
        "neighbour",
        "--cpus",
        "0.25",
        "--",
        "sh",
        "-c",
        "for i in $(seq 30); do sleep 1 & done; wait; echo neighbour-ok",
    ]);
    let (code, state) = c.wait_job(&neighbour, 60);
    assert_eq!((code, state.as_str()), (0, "SUCCEEDED"));
    assert!(c.ok(&["jobs", "logs", &neighbour]).contains("neighbour-ok"));
    c.ok(&["jobs", "cancel", &bomb]);
}
