//! Failover of the master group under many agents: how long after the
//! leader is SIGKILLed a surviving master accepts a write, and how long until
//! every agent has registered again with the new leader.
//!
//! Three `gpuctl-master` processes (release build) form a Raft group on
//! loopback. The agents are simulated in this process (`gpuctl_tests::sim`):
//! each speaks the real AgentManager API (Register with 4 simulated GPUs,
//! WatchTasks, a Heartbeat every interval the master asks for) and, like
//! `gpuctl-agent`, registers again whenever its stream or a call fails,
//! going where the `gpuctl-leader` redirect points or else to the next
//! address, with the agent's own backoff (100 ms doubling to 5 s; three
//! redirects in a row are followed at once; "no leader yet" is polled every
//! 200-300 ms). They share a few HTTP/2 connections per master.
//!
//! Each round: SIGKILL the leader at T0; poll `SubmitJob` at both survivors
//! every 20 ms until one accepts (the new leader serves writes); wait until
//! every agent's Register succeeded after T0; restart the killed master and
//! let it catch up. Only figures are printed.
//!
//! ```text
//! cargo bench -p gpuctl-tests --bench failover
//! FAILOVER_AGENTS=3000 FAILOVER_ROUNDS=5 cargo bench -p gpuctl-tests --bench failover
//! ```
//!
//! Environment: FAILOVER_AGENTS (default 1000), FAILOVER_ROUNDS (3),
//! FAILOVER_CONNECTIONS (HTTP/2 connections per master shared by the agents,
//! 4), FAILOVER_AGENT_TIMEOUT_SECS (the masters' --agent-timeout-secs, 10),
//! FAILOVER_BACKOFF_MAX_MS (the agents' longest pause between attempts, 5000
//! as in `gpuctl-agent`; a small value shows what the masters alone cost).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use gpuctl_proto::pb;
use gpuctl_proto::pb::operator_client::OperatorClient;
use gpuctl_tests::sim::{SimAgents, SimConfig};
use gpuctl_tests::{free_port, strip_ansi, Daemon};
use tonic::transport::{Channel, Endpoint};

const MASTERS: usize = 3;
const GPUS_PER_AGENT: u32 = 4;
/// `gpuctl-agent`'s longest pause between registration attempts.
const BACKOFF_MAX_MS: usize = 5000;
const POLL_EVERY: Duration = Duration::from_millis(20);
/// No round may take longer than this.
const ROUND_LIMIT: Duration = Duration::from_secs(180);

fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

fn channel(addr: &str) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(1))
        .tcp_nodelay(true)
        .connect_lazy()
}

/// Nanoseconds since the agents' epoch.
fn now_ns(sim: &SimAgents) -> u64 {
    sim.now().as_nanos() as u64
}

struct Masters {
    dir: tempfile::TempDir,
    bin: std::path::PathBuf,
    addrs: Vec<String>,
    args: Vec<Vec<String>>,
    daemons: Vec<Daemon>,
}

impl Masters {
    fn start(agent_timeout_secs: usize) -> Masters {
        let bin = gpuctl_tests::release_bin("gpuctl-master", "gpuctl-master");
        let dir = tempfile::tempdir().unwrap();
        let addrs: Vec<String> = (0..MASTERS)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect();
        let peers = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| format!("{}={a}", i + 1))
            .collect::<Vec<_>>()
            .join(",");
        let args: Vec<Vec<String>> = (0..MASTERS)
            .map(|i| {
                vec![
                    "--node-id".to_string(),
                    (i + 1).to_string(),
                    "--listen".into(),
                    addrs[i].clone(),
                    "--peers".into(),
                    peers.clone(),
                    "--data-dir".into(),
                    dir.path()
                        .join(format!("master{}", i + 1))
                        .display()
                        .to_string(),
                    "--agent-timeout-secs".into(),
                    agent_timeout_secs.to_string(),
                ]
            })
            .collect();
        let mut m = Masters {
            dir,
            bin,
            addrs,
            args,
            daemons: Vec::new(),
        };
        for i in 0..MASTERS {
            let d = m.spawn(i);
            m.daemons.push(d);
        }
        m
    }

    fn spawn(&self, i: usize) -> Daemon {
        Daemon::spawn(
            &format!("master{}", i + 1),
            &self.bin,
            &self.args[i],
            &[],
            self.dir.path().join(format!("master{}.log", i + 1)),
        )
    }

    fn restart(&mut self, i: usize) {
        self.daemons[i].kill();
        self.daemons[i] = self.spawn(i);
    }

    /// Occurrences of `needle` in the masters' logs.
    fn count_in_logs(&self, needle: &str) -> usize {
        self.daemons
            .iter()
            .map(|d| strip_ansi(&d.log_text()).matches(needle).count())
            .sum()
    }
}

/// The members as master `i` lists them; None when it does not answer.
async fn members(ops: &[OperatorClient<Channel>], i: usize) -> Option<Vec<pb::MasterInfo>> {
    let mut c = ops[i].clone();
    let call = c.list_masters(pb::ListMastersRequest {});
    match tokio::time::timeout(Duration::from_secs(3), call).await {
        Ok(Ok(r)) => Some(r.into_inner().masters),
        _ => None,
    }
}

/// Index of the leader, asked of the masters in `live`, once every live
/// master has applied everything the leader committed.
async fn settled_leader(ops: &[OperatorClient<Channel>], live: &[usize]) -> usize {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for &i in live {
            let Some(ms) = members(ops, i).await else {
                continue;
            };
            let Some(leader) = ms.iter().find(|m| m.role == "leader" && m.reachable) else {
                continue;
            };
            let caught_up = ms
                .iter()
                .filter(|m| live.contains(&(m.id as usize - 1)))
                .all(|m| m.reachable && m.applied_index >= leader.commit_index);
            if caught_up {
                return leader.id as usize - 1;
            }
        }
        assert!(Instant::now() < deadline, "the masters did not settle");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until every agent's latest Register succeeded after `after_ns` at
/// master `leader`; returns the per-agent delays from `after_ns`.
async fn wait_registered(sim: &SimAgents, leader: usize, after_ns: u64) -> Option<Vec<u64>> {
    let deadline = Instant::now() + ROUND_LIMIT;
    loop {
        let mut delays = Vec::with_capacity(sim.len());
        for i in 0..sim.len() {
            let Some(r) = sim.registration(i) else {
                continue;
            };
            let t = r.at.as_nanos() as u64;
            if t > after_ns && r.master == leader {
                delays.push(t - after_ns);
            }
        }
        if delays.len() == sim.len() {
            delays.sort_unstable();
            return Some(delays);
        }
        if Instant::now() > deadline {
            eprintln!(
                "only {} of {} agents registered again",
                delays.len(),
                sim.len()
            );
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn poll_spec(round: usize) -> pb::JobSpec {
    pb::JobSpec {
        placement: None,
        name: format!("failover-probe-{round}"),
        // No agent here has Docker: the job stays queued, placing nothing.
        image: "busybox".into(),
        command: vec!["true".into()],
        resources: Some(pb::Resources {
            cpus: 1.0,
            mem_mib: 0,
            gpus: 0,
            ports: 0,
        }),
        ..Default::default()
    }
}

/// Polls SubmitJob at every master of `survivors` every 20 ms until one
/// accepts; returns when (ns after the epoch) and the job id.
async fn first_write(
    sim: &SimAgents,
    ops: &[OperatorClient<Channel>],
    survivors: &[usize],
    round: usize,
) -> (u64, String, usize) {
    let polls = survivors.iter().map(|&i| {
        let mut c = ops[i].clone();
        async move {
            loop {
                let started = Instant::now();
                let call = c.submit_job(pb::SubmitJobRequest {
                    spec: Some(poll_spec(round)),
                    ..Default::default()
                });
                if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(1), call).await {
                    return (now_ns(sim), r.into_inner().job_id, i);
                }
                tokio::time::sleep(POLL_EVERY.saturating_sub(started.elapsed())).await;
            }
        }
    });
    let polls: Vec<_> = polls.map(Box::pin).collect();
    let (first, _, _) = futures::future::select_all(polls).await;
    first
}

fn pct(sorted: &[u64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)] as f64 / 1e6
}

fn main() {
    let n_agents = env_usize("FAILOVER_AGENTS", 1000);
    let rounds = env_usize("FAILOVER_ROUNDS", 3);
    let conns = env_usize("FAILOVER_CONNECTIONS", 4).max(1);
    let agent_timeout = env_usize("FAILOVER_AGENT_TIMEOUT_SECS", 10);
    let backoff_max =
        Duration::from_millis(env_usize("FAILOVER_BACKOFF_MAX_MS", BACKOFF_MAX_MS) as u64)
            // The agents' shortest pause (gpuctl_tests::sim, as the agent).
            .max(Duration::from_millis(100));
    // `cargo bench` passes --bench. Built and run by `cargo test
    // --all-targets` (without it), this only says how to run it.
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "failover: a benchmark; run it with `cargo bench -p gpuctl-tests --bench failover`"
        );
        return;
    }
    let mut masters = Masters::start(agent_timeout);
    println!(
        "failover: {MASTERS} masters ({}), {n_agents} simulated agents over {conns} connection(s) per master, agent backoff 100 ms doubling to {} ms, {rounds} rounds; {} CPUs",
        masters.bin.display(),
        backoff_max.as_millis(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let ops: Vec<OperatorClient<Channel>> = masters
            .addrs
            .iter()
            .map(|a| OperatorClient::new(channel(a)))
            .collect();
        let all: Vec<usize> = (0..MASTERS).collect();
        let leader = settled_leader(&ops, &all).await;
        let sim = SimAgents::start(
            &masters.addrs,
            SimConfig {
                agents: n_agents,
                gpus_per_agent: GPUS_PER_AGENT,
                connections: conns,
                backoff_max,
                id_prefix: "bench".into(),
                ..Default::default()
            },
        )
        .unwrap();
        let started = now_ns(&sim);
        let Some(first) = wait_registered(&sim, leader, 0).await else {
            panic!("the agents did not all register");
        };
        println!(
            "initial registration of {n_agents} agents: all in {:.0} ms (p50 {:.0} ms)",
            (first[first.len() - 1] - started) as f64 / 1e6,
            pct(&first, 0.5) - started as f64 / 1e6
        );
        // Heartbeats under way before the first kill.
        tokio::time::sleep(Duration::from_secs(3)).await;

        println!();
        println!(
            "| agents | round | new leader accepts a write (ms) | all agents re-registered (ms) | per-agent p50 (ms) | p99 (ms) |"
        );
        println!("|---:|---:|---:|---:|---:|---:|");
        let mut rows = Vec::new();
        for round in 1..=rounds {
            let leader = settled_leader(&ops, &all).await;
            // An agent that missed the agent timeout is first marked
            // unreachable (lost only after the much longer lost timeout).
            let lost_before = masters.count_in_logs("marking it unreachable");
            let survivors: Vec<usize> = all.iter().copied().filter(|i| *i != leader).collect();
            let t0 = now_ns(&sim);
            masters.daemons[leader].kill();
            let (written, job_id, new_leader) = first_write(&sim, &ops, &survivors, round).await;
            let delays = wait_registered(&sim, new_leader, t0).await;
            let write_ms = (written - t0) as f64 / 1e6;
            match &delays {
                Some(d) => {
                    let all_ms = d[d.len() - 1] as f64 / 1e6;
                    println!(
                        "| {n_agents} | {round} | {write_ms:.0} | {all_ms:.0} | {:.0} | {:.0} |",
                        pct(d, 0.5),
                        pct(d, 0.99)
                    );
                    rows.push((write_ms, all_ms));
                }
                None => println!("| {n_agents} | {round} | {write_ms:.0} | (not all within {}s) | | |", ROUND_LIMIT.as_secs()),
            }
            let lost = masters.count_in_logs("marking it unreachable") - lost_before;
            if lost > 0 {
                println!("  (round {round}: {lost} agents were marked unreachable)");
            }
            // Keep the queue empty for the next round.
            let mut c = ops[new_leader].clone();
            let _ = c.cancel_job(pb::CancelJobRequest { job_id }).await;
            masters.restart(leader);
            settled_leader(&ops, &all).await;
            // Agents heartbeat a while before the next kill.
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
        if !rows.is_empty() {
            let n = rows.len() as f64;
            println!(
                "\nmean over {} rounds: new leader accepts a write {:.0} ms, all {n_agents} agents re-registered {:.0} ms",
                rows.len(),
                rows.iter().map(|r| r.0).sum::<f64>() / n,
                rows.iter().map(|r| r.1).sum::<f64>() / n
            );
        }
    });
    rt.shutdown_background();
    drop(masters);
}
