//! Host ports and distributed training without wrappers: a two-rank gang
//! meets over TCP at the MASTER_ADDR and MASTER_PORT gpuctl gives it, and
//! tasks on one agent hold disjoint ports (each binds all of its own while
//! the others hold theirs, which the kernel refuses for a port taken), and
//! keep them across a SIGKILL and restart of their agent.
//! Real master, agents and processes over loopback; the tasks are Python.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::net::TcpStream;
use std::time::Duration;

use gpuctl_tests::{task_writable_dir, try_wait_for, AgentOpts, Cluster, Gpuctl};
use serde_json::Value;

/// Ranges below Linux's ephemeral ports (32768+), where the tests' own
/// connections cannot be.
fn agent(c: &mut Cluster, ports: &str) {
    c.add_agent(AgentOpts {
        simulate_gpus: Some("2xA100-SXM4-40GB"),
        extra: vec!["--ports".into(), ports.into()],
        ..Default::default()
    });
}

/// Rank 0 listens at MASTER_ADDR:MASTER_PORT; every other rank connects
/// (retrying while rank 0 starts) and says who it is; rank 0 answers each.
/// Both print what they learned from their environment.
const RENDEZVOUS: &str = r#"
import os, socket, sys, time
e = os.environ
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
        "MASTER_ADDR", "MASTER_PORT", "GPUCTL_PORTS"]
print("env " + " ".join(k + "=" + e.get(k, "-") for k in keys), flush=True)
rank, world = int(e["RANK"]), int(e["WORLD_SIZE"])
addr = (e["MASTER_ADDR"], int(e["MASTER_PORT"]))
if rank == 0:
    s = socket.create_server(addr)
    for _ in range(world - 1):
        c, _ = s.accept()
        hello = c.makefile().readline().strip()
        c.sendall(b"welcome\n")
        print("rank 0 met: " + hello, flush=True)
else:
    deadline = time.time() + 30
    while True:
        try:
            c = socket.create_connection(addr, timeout=5)
            break
        except OSError:
            if time.time() > deadline:
                sys.exit("rank %d: nobody at %s:%d" % (rank, addr[0], addr[1]))
            time.sleep(0.2)
    c.sendall(b"rank %d of %d\n" % (rank, world))
    print("rank %d got: %s" % (rank, c.makefile().readline().strip()), flush=True)
"#;

fn env_line(logs: &str, rank: u32) -> String {
    logs.lines()
        .find_map(|l| l.strip_prefix(&format!("[rank {rank}] env ")))
        .unwrap_or_else(|| panic!("no env line of rank {rank}:\n{logs}"))
        .to_string()
}

#[test]
fn a_two_rank_gang_meets_at_master_addr_and_port() {
    let mut c = Cluster::start(&[]);
    agent(&mut c, "29400-29409");
    agent(&mut c, "29410-29419");
    // Spread: one rank per agent, so NODE_RANK tells them apart.
    let j = c.submit(&[
        "--name",
        "ddp",
        "--cpus",
        "0.1",
        "--gpus",
        "1",
        "--replicas",
        "2",
        "--placement",
        "spread",
        "--",
        "/usr/bin/python3",
        "-c",
        RENDEZVOUS,
    ]);
    let (code, state) = c.wait_job(&j, 90);
    let logs = c.ok(&["jobs", "logs", &j]);
    assert_eq!(
        (code, state.as_str()),
        (0, "SUCCEEDED"),
        "{logs}\n{}",
        c.diagnostics()
    );
    assert!(logs.contains("[rank 0] rank 0 met: rank 1 of 2"), "{logs}");
    assert!(logs.contains("[rank 1] rank 1 got: welcome"), "{logs}");

    // What each rank was told, against where gpuctl put it.
    let job = c.job(&j);
    let tasks = job["tasks"].as_array().unwrap();
    let task = |rank: u64| {
        tasks
            .iter()
            .find(|t| t["rank"] == rank)
            .unwrap_or_else(|| panic!("no rank {rank}: {job}"))
    };
    let ports = |t: &Value| -> Vec<u64> {
        t["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_u64().unwrap())
            .collect()
    };
    let (t0, t1) = (task(0), task(1));
    assert_ne!(t0["agent_id"], t1["agent_id"], "spread: {job}");
    let (p0, p1) = (ports(t0), ports(t1));
    assert_eq!(
        (p0.len(), p1.len()),
        (1, 1),
        "a gang holds a port each: {job}"
    );
    for (rank, node_rank, own) in [(0, 0, p0[0]), (1, 1, p1[0])] {
        assert_eq!(
            env_line(&logs, rank),
            format!(
                "RANK={rank} WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
                 NODE_RANK={node_rank} MASTER_ADDR=127.0.0.1 MASTER_PORT={} GPUCTL_PORTS={own}",
                p0[0]
            )
        );
    }
    // Each port is from its own agent's range.
    for t in [t0, t1] {
        let agent = c
            .agents_json()
            .into_iter()
            .find(|a| a["id"] == t["agent_id"])
            .unwrap();
        let (lo, hi) = agent["ports"].as_str().unwrap().split_once('-').unwrap();
        let p = ports(t)[0];
        assert!(
            (lo.parse().unwrap()..=hi.parse().unwrap()).contains(&p),
            "{p} not of {agent}"
        );
    }
    let out = c.ok(&["jobs", "get", &j]);
    assert!(out.contains("PORTS"), "jobs get shows ports:\n{out}");
}

/// Binds every port in GPUCTL_PORTS (the kernel refuses one that is
/// bound), says so (a file named after its job, with the ports), and
/// holds them until the test drops a file.
const HOLD: &str = r#"
import os, socket, sys, time
held = []
for p in os.environ["GPUCTL_PORTS"].split(","):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", int(p)))
    except OSError as e:
        sys.exit("port %s: %s" % (p, e))
    s.listen()
    held.append(s)
# Written whole, then renamed: the test reads the file once it exists.
path = os.path.join(os.environ["OUT"], os.environ["GPUCTL_JOB_ID"])
with open(path + ".tmp", "w") as f:
    f.write(os.environ["GPUCTL_PORTS"])
os.rename(path + ".tmp", path)
deadline = time.time() + 60
while not os.path.exists(os.path.join(os.environ["OUT"], "release")) and time.time() < deadline:
    time.sleep(0.1)
"#;

#[test]
fn tasks_on_one_agent_never_share_a_port() {
    let mut c = Cluster::start(&[]);
    agent(&mut c, "29500-29505");
    let out = task_writable_dir(&c.dir.path().join("out"));
    let env = format!("OUT={}", out.display());
    let submit = |n: &str| {
        c.submit(&[
            "--name",
            "hold",
            "--cpus",
            "0.1",
            "--ports",
            n,
            "--env",
            &env,
            "--",
            "/usr/bin/python3",
            "-c",
            HOLD,
        ])
    };
    // Three jobs of two ports fill the six.
    let holders: Vec<String> = (0..3).map(|_| submit("2")).collect();
    let all_bound = try_wait_for(Duration::from_secs(60), || {
        holders.iter().all(|j| out.join(j).exists())
    });
    assert!(
        all_bound,
        "not all bound: {:?}\n{}",
        std::fs::read_dir(&out).unwrap().count(),
        c.diagnostics()
    );
    // From outside: six distinct ports, each one listening now.
    let mut seen = BTreeSet::new();
    for j in &holders {
        let list = std::fs::read_to_string(out.join(j)).unwrap();
        for p in list.split(',') {
            let p: u16 = p.parse().unwrap();
            assert!((29500..=29505).contains(&p), "{p} outside the range");
            assert!(seen.insert(p), "port {p} given twice");
            TcpStream::connect(("127.0.0.1", p)).unwrap_or_else(|e| panic!("port {p}: {e}"));
        }
    }
    assert_eq!(seen.len(), 6);
    // A fourth waits for ports, saying so; one asking more than the
    // agent has can never run, and says that.
    let fourth = submit("2");
    let w = c.job_with_reason(&fourth);
    assert_eq!(w["state"], "QUEUED", "{w}");
    assert!(
        w["reason"]
            .as_str()
            .unwrap()
            .contains("short of free ports"),
        "{w}"
    );
    let huge = submit("7");
    let w = c.job_with_reason(&huge);
    assert!(
        w["reason"]
            .as_str()
            .unwrap()
            .contains("offers 7 host ports"),
        "{w}"
    );
    c.ok(&["jobs", "cancel", &huge]);
    // The agent is SIGKILLed and restarted under the holders: they run on
    // (every port still answers, from outside), keep their ports, and the
    // fourth still waits for them.
    c.restart_agent(0);
    let active = try_wait_for(Duration::from_secs(30), || {
        c.agents_json()
            .first()
            .is_some_and(|a| a["state"] == "ACTIVE")
    });
    assert!(active, "agent not back\n{}", c.diagnostics());
    for p in &seen {
        TcpStream::connect(("127.0.0.1", *p))
            .unwrap_or_else(|e| panic!("port {p} after the restart: {e}"));
    }
    for j in &holders {
        let job = c.job(j);
        let ports: BTreeSet<u16> = job["tasks"][0]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_u64().unwrap() as u16)
            .collect();
        let file = std::fs::read_to_string(out.join(j)).unwrap();
        let bound: BTreeSet<u16> = file.split(',').map(|p| p.parse().unwrap()).collect();
        assert_eq!(ports, bound, "{j} after the restart: {job}");
    }
    let w = c.job_with_reason(&fourth);
    assert_eq!(w["state"], "QUEUED", "{w}");
    assert!(
        w["reason"]
            .as_str()
            .unwrap()
            .contains("short of free ports"),
        "{w}"
    );
    // Released: the holders end and the fourth gets ports they freed.
    std::fs::write(out.join("release"), "").unwrap();
    for j in holders.iter().chain([&fourth]) {
        let (code, state) = c.wait_job(j, 60);
        let logs = c.ok(&["jobs", "logs", j]);
        assert_eq!((code, state.as_str()), (0, "SUCCEEDED"), "{j}: {logs}");
    }
    let p4 = std::fs::read_to_string(out.join(&fourth)).unwrap();
    assert!(
        p4.split(',')
            .all(|p| seen.contains(&p.parse::<u16>().unwrap())),
        "{p4}"
    );
}
