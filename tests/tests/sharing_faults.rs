//! Faults and abuse under GPU fractions shared through MPS (issue 34), end
//! to end: real masters, agent and gpuctl, real Docker containers,
//! tests/fake-mps's control daemon, and for the memory check fake-nvml's
//! per-process memory. Each test checks from outside the masters: the
//! containers Docker runs (ids, host pids, the MPS pipe mounted in them),
//! the daemon's pid from its pid file, and /proc.
//!
//! - The leader SIGKILLed, or frozen (SIGSTOP) and thawed, under two
//!   fractions: they run on untouched, their MPS daemon too, a fraction
//!   beyond the GPU's room is never placed meanwhile, the new leader's view
//!   is Docker's, and a fraction submitted afterwards joins the same daemon.
//! - A fraction whose process clears its environment (so it skips MPS and
//!   its limit) and takes more GPU memory than its fraction, NVML listing it
//!   as a plain compute process: the agent ends it with GPU_MEMORY_LIMIT,
//!   its neighbour on the GPU runs on, and a job's own `CUDA_MPS_*` are
//!   replaced by the agent's.
//!
//! - A tenant's root container that rewrites its MPS pid file to name
//!   another tenant's daemon: when its own daemon is stopped (idle), the
//!   other tenant's daemon runs on.
//!
//! The Docker daemon restarted under MPS fractions is in
//! `sharing_docker_restart.rs` (a binary of its own: it kills dockerd).
//! Needs root and Docker (skipped otherwise; required in CI).
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use gpuctl_tests::{
    alive, busybox_image, devices_task_cgroup, docker_or_skip, gpuctl_at, mps_daemon_pid,
    mps_groups, mps_pipe, running_task_containers, try_wait_for, wait_for, AgentOpts, Cluster,
    Gpuctl, HaCluster, RunningContainer,
};

const GIB: u64 = 1024;

/// Submits a fraction of `mib` MiB in a busybox container that says when it
/// runs and then sleeps; returns the job id.
fn fraction(c: &impl Gpuctl, image: &str, name: &str, mib: u64) -> String {
    let mem = format!("{mib}MiB");
    c.submit(&[
        "--name",
        name,
        "--image",
        image,
        "--gpu-mem",
        &mem,
        "--cpus",
        "0.1",
        "--",
        "sh",
        "-c",
        "echo ready; exec sleep 600",
    ])
}

/// The job's one task's id.
fn task_of(c: &impl Gpuctl, job: &str) -> String {
    c.job(job)["tasks"][0]["id"].as_str().unwrap().to_string()
}

/// The shares the masters count on `uuid`: task id -> MiB.
fn counted(c: &impl Gpuctl, uuid: &str) -> Option<BTreeMap<String, u64>> {
    let out = c.gpuctl(&["gpus", "--json"]);
    if !out.status.success() {
        return None;
    }
    let gpus: Value = serde_json::from_slice(&out.stdout).ok()?;
    let gpu = gpus.as_array()?.iter().find(|g| g["uuid"] == uuid)?;
    Some(
        gpu["shares"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| {
                (
                    s["task_id"].as_str().unwrap_or_default().to_string(),
                    s["mem_mib"].as_u64().unwrap_or_default(),
                )
            })
            .collect(),
    )
}

/// Waits until the masters' view agrees with Docker's: the tasks running
/// in containers are `want`'s (task id -> its fraction in MiB), each a
/// client of the daemon at `pipe`; the shared GPU counts exactly those
/// fractions (so its counted memory is their sum) and each one's job is
/// RUNNING. Returns Docker's view.
fn assert_views_agree(
    c: &impl Gpuctl,
    agent: &str,
    uuid: &str,
    pipe: &Path,
    want: &BTreeMap<String, u64>,
) -> BTreeMap<String, RunningContainer> {
    let mut last = String::new();
    let mut docker = BTreeMap::new();
    let ok = try_wait_for(Duration::from_secs(20), || {
        docker = running_task_containers(agent).unwrap_or_default();
        let master = counted(c, uuid).unwrap_or_default();
        let jobs_running = master.keys().all(|t| {
            let job = t.rsplit_once('.').map_or(t.as_str(), |(j, _)| j);
            c.job(job)["state"] == "RUNNING"
        });
        last = format!("docker: {docker:?}\nmasters count: {master:?}");
        docker.keys().eq(want.keys())
            && docker
                .values()
                .all(|r| Path::new(&r.mps_pipe) == pipe && alive(r.pid))
            && &master == want
            && jobs_running
    });
    assert!(
        ok,
        "the masters and Docker disagree (want {want:?}, daemon {}):\n{last}\n{}",
        pipe.display(),
        c.diagnostics()
    );
    assert_eq!(
        counted(c, uuid).unwrap().values().sum::<u64>(),
        want.values().sum::<u64>()
    );
    docker
}

/// The one MPS daemon group of the GPU: its directory and live pid.
fn the_daemon(work: &Path, uuid: &str) -> (PathBuf, i32) {
    let groups = mps_groups(work, uuid);
    assert_eq!(groups.len(), 1, "one daemon group: {groups:?}");
    let pipe = mps_pipe(&groups[0]);
    let pid = mps_daemon_pid(&pipe).expect("the MPS daemon runs");
    (groups[0].clone(), pid)
}

/// How often the daemon of `group` was started (tests/fake-mps's log).
fn daemon_starts(group: &Path) -> usize {
    std::fs::read_to_string(group.join("log/control.log"))
        .unwrap_or_default()
        .matches(" start ")
        .count()
}

/// Two 15 GiB fractions of a 40 GiB MPS GPU running in containers, and a
/// third of 15 GiB waiting for room, under three masters.
struct HaShares {
    c: HaCluster,
    agent: String,
    uuid: String,
    image: String,
    work: PathBuf,
    group: PathBuf,
    daemon: i32,
    /// task id -> MiB of the running fractions.
    running: BTreeMap<String, u64>,
    containers: BTreeMap<String, RunningContainer>,
    /// The fraction beyond the GPU's room.
    waiting: String,
}

impl HaShares {
    fn start() -> HaShares {
        let mut c = HaCluster::start(3, &[]);
        let image = busybox_image();
        let agent = c.add_agent(AgentOpts {
            simulate_gpus: Some("1xA100-SXM4-40GB"),
            runtime: "docker,process",
            extra: vec![
                "--share-gpus".into(),
                "mps".into(),
                "--mps-control".into(),
                gpuctl_tests::fake_mps_control().display().to_string(),
            ],
            ..Default::default()
        });
        let gpu = c.json(&["gpus", "--json"])[0].clone();
        assert_eq!(gpu["share_mode"], "mps", "{gpu}");
        let uuid = gpu["uuid"].as_str().unwrap().to_string();
        let work = c.dir.path().join("agent0");
        let mut running = BTreeMap::new();
        for name in ["a", "b"] {
            let job = fraction(&c, &image, name, 15 * GIB);
            let j = c.wait_state(&job, "RUNNING", Duration::from_secs(60));
            assert_eq!(j["tasks"][0]["enforcement"], "mps", "{j}");
            running.insert(task_of(&c, &job), 15 * GIB);
        }
        let (group, daemon) = the_daemon(&work, &uuid);
        let containers = assert_views_agree(&c, &agent, &uuid, &mps_pipe(&group), &running);
        // 30 of 40 GiB held: another 15 does not fit, and waits.
        let waiting = fraction(&c, &image, "beyond", 15 * GIB);
        std::thread::sleep(Duration::from_secs(2));
        assert_eq!(c.job(&waiting)["state"], "QUEUED");
        HaShares {
            c,
            agent,
            uuid,
            image,
            work,
            group,
            daemon,
            running,
            containers,
            waiting,
        }
    }

    /// What must hold at every instant of a failover, seen from outside
    /// the masters: the same containers (ids and host pids) run, nothing
    /// else does, and the daemon keeps its pid. What broke, if anything.
    fn untouched(
        agent: &str,
        containers: &BTreeMap<String, RunningContainer>,
        pipe: &Path,
        daemon: i32,
    ) -> Option<String> {
        let Some(now) = running_task_containers(agent) else {
            return Some("docker does not answer".into());
        };
        if &now != containers {
            return Some(format!("the containers changed: {now:?}"));
        }
        if let Some(r) = now.values().find(|r| !alive(r.pid)) {
            return Some(format!("{r:?} is not alive"));
        }
        let pid = mps_daemon_pid(pipe);
        (pid != Some(daemon)).then(|| format!("the MPS daemon is {pid:?}, was {daemon}"))
    }

    fn assert_untouched(&self) {
        let pipe = mps_pipe(&self.group);
        if let Some(why) = Self::untouched(&self.agent, &self.containers, &pipe, self.daemon) {
            panic!("{why}\n{}", self.c.diagnostics());
        }
    }

    /// Watches the outside (on a thread of its own, every 100 ms: a call
    /// to the masters may wait for gpuctl's timeout during an election,
    /// as followers forward to a leader that no longer answers) for
    /// `at_least`, and until `done` is true (at most 60 s); meanwhile the
    /// beyond-room fraction must not run, whenever the masters at `ask`
    /// answer.
    fn hold(&mut self, ask: &str, at_least: Duration, mut done: impl FnMut() -> bool) {
        let stop = Arc::new(AtomicBool::new(false));
        let watch = {
            let (agent, containers) = (self.agent.clone(), self.containers.clone());
            let (pipe, daemon, stop) = (mps_pipe(&self.group), self.daemon, stop.clone());
            std::thread::spawn(move || {
                let mut samples = 0;
                while !stop.load(Ordering::Relaxed) {
                    if let Some(why) = Self::untouched(&agent, &containers, &pipe, daemon) {
                        return Err(why);
                    }
                    samples += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Ok(samples)
            })
        };
        let start = Instant::now();
        let mut finished = false;
        // Until done and the time is up, or the watch saw something.
        while !(watch.is_finished() || finished && start.elapsed() >= at_least) {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the failover did not end in 60 s\n{}",
                self.c.diagnostics()
            );
            let out = gpuctl_at(ask, &["jobs", "get", &self.waiting, "--json"]);
            if out.status.success() {
                let j: Value = serde_json::from_slice(&out.stdout).unwrap();
                assert_eq!(j["state"], "QUEUED", "placed beyond the GPU's room: {j}");
            }
            finished = finished || done();
            std::thread::sleep(Duration::from_millis(200));
        }
        stop.store(true, Ordering::Relaxed);
        match watch.join().unwrap() {
            Ok(samples) => assert!(samples >= 10, "only {samples} looks at Docker"),
            Err(why) => panic!("during the failover: {why}\n{}", self.c.diagnostics()),
        }
    }

    /// After the failover: the views agree, the waiting fraction still
    /// waits, and a 10 GiB fraction (exactly the room left) is placed,
    /// given the same daemon, and counted.
    fn one_more_fraction(&mut self) {
        let pipe = mps_pipe(&self.group);
        assert_views_agree(&self.c, &self.agent, &self.uuid, &pipe, &self.running);
        self.assert_untouched();
        let small = fraction(&self.c, &self.image, "after", 10 * GIB);
        let j = self
            .c
            .wait_state(&small, "RUNNING", Duration::from_secs(60));
        assert_eq!(j["tasks"][0]["enforcement"], "mps", "{j}");
        self.running.insert(task_of(&self.c, &small), 10 * GIB);
        let docker = assert_views_agree(&self.c, &self.agent, &self.uuid, &pipe, &self.running);
        // The same daemon: one group, the same pid, started once.
        let (group, pid) = the_daemon(&self.work, &self.uuid);
        assert_eq!((group, pid), (self.group.clone(), self.daemon));
        assert_eq!(daemon_starts(&self.group), 1);
        // The first two untouched.
        for (t, r) in &self.containers {
            assert_eq!(docker.get(t), Some(r), "{t}");
        }
        // 40 of 40 GiB: the 15 GiB fraction still waits.
        std::thread::sleep(Duration::from_secs(2));
        assert_eq!(self.c.job(&self.waiting)["state"], "QUEUED");
        assert_eq!(
            running_task_containers(&self.agent).unwrap().len(),
            3,
            "a fourth container"
        );
    }
}

/// Every master's address but `id`'s, as `--master` takes them.
fn addrs_but(c: &HaCluster, id: u64) -> String {
    c.masters
        .values()
        .filter(|m| m.id != id)
        .map(|m| m.addr.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

/// The leader as the masters at `addrs` say (the reachable member calling
/// itself leader at the highest term); None during an election.
fn leader_at(addrs: &str) -> Option<u64> {
    let out = gpuctl_at(addrs, &["masters", "--json"]);
    let members: Value = serde_json::from_slice(&out.stdout).ok()?;
    members
        .as_array()?
        .iter()
        .filter(|m| m["reachable"] == true && m["role"] == "leader")
        .max_by_key(|m| m["term"].as_u64().unwrap_or(0))?["id"]
        .as_u64()
}

/// Whether master `old`, asked at `addr`, follows `new`.
fn follows(addr: &str, old: u64, new: u64) -> bool {
    let out = gpuctl_at(addr, &["masters", "--json"]);
    serde_json::from_slice::<Value>(&out.stdout).is_ok_and(|m| {
        let role = |id: u64| {
            m.as_array()
                .into_iter()
                .flatten()
                .find(|x| x["id"] == id)
                .map(|x| x["role"].clone())
        };
        role(old) == Some(json!("follower")) && role(new) == Some(json!("leader"))
    })
}

/// Sends a signal to a process by pid.
fn signal(pid: i32, sig: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig).unwrap();
}

/// Thaws a frozen master when the test ends, whatever happened.
struct Thaw(i32);

impl Drop for Thaw {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0),
            nix::sys::signal::Signal::SIGCONT,
        );
    }
}

#[test]
fn mps_fractions_outlive_a_leader_sigkill_and_the_new_leader_counts_them() {
    if !docker_or_skip("mps_fractions_outlive_a_leader_sigkill_and_the_new_leader_counts_them") {
        return;
    }
    let mut s = HaShares::start();
    let old = s.c.leader_id();
    s.c.kill_master(old);
    // Through the election and 3 s of the new leader's allocation passes.
    let others = addrs_but(&s.c, old);
    s.hold(&others, Duration::from_secs(3), || {
        leader_at(&others).is_some_and(|l| l != old)
    });
    s.one_more_fraction();
}

#[test]
fn mps_fractions_outlive_a_frozen_leader_and_agree_after_it_thaws() {
    if !docker_or_skip("mps_fractions_outlive_a_frozen_leader_and_agree_after_it_thaws") {
        return;
    }
    let mut s = HaShares::start();
    let old = s.c.leader_id();
    let pid = s.c.masters[&old].daemon.pid();
    let thaw = Thaw(pid);
    signal(pid, nix::sys::signal::Signal::SIGSTOP);
    // Frozen: its connections stay open and silent. A new leader is elected
    // without it, and runs its allocation passes for 3 s.
    let others = addrs_but(&s.c, old);
    let mut new = None;
    s.hold(&others, Duration::from_secs(3), || {
        new = leader_at(&others).filter(|l| *l != old);
        new.is_some()
    });
    let new = new.unwrap();
    // Thawed, the old leader (which still thinks it leads, at an old term)
    // must not touch anything as it steps down and follows.
    signal(pid, nix::sys::signal::Signal::SIGCONT);
    drop(thaw);
    let addr = s.c.addr(old).to_string();
    let all = s.c.addrs();
    s.hold(&all, Duration::from_secs(3), || follows(&addr, old, new));
    s.one_more_fraction();
    // The thawed master's own view is the same.
    let theirs: Value = serde_json::from_str(&s.c.ok_at(&addr, &["gpus", "--json"])).unwrap();
    let shares: BTreeMap<String, u64> = theirs[0]["shares"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["task_id"].as_str().unwrap().to_string(),
                x["mem_mib"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(shares, s.running, "{theirs}");
}

// ----- a fraction that skips MPS -----

/// One A100 of 40 GiB, listed by fake-nvml from a file the test rewrites.
const GPU0: &str = "GPU-0c5e6a3e-0000-4000-8000-000000000000";

fn write_machine(path: &Path, m: &Value) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(m).unwrap()).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A process of a task's container, found from outside: host pid, its
/// command, and whether its environment names an MPS pipe.
#[derive(Debug)]
struct TaskProcess {
    pid: i32,
    comm: String,
    mps_env: bool,
}

/// The live processes whose v1 devices cgroup is agent `agent`'s task
/// `task`'s (a container's cgroup nests inside its task's), read from
/// /proc. The agent counts: every test cluster has a `job-1.0`, and the
/// tests of this file run at once.
fn processes_of(agent: &str, task: &str) -> Vec<TaskProcess> {
    let mut out = Vec::new();
    let ours = format!("/gpuctl/{agent}/{task}");
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        if devices_task_cgroup(&cgroup).as_deref() != Some(task)
            || !cgroup.contains(&ours)
            || !alive(pid)
        {
            continue;
        }
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        out.push(TaskProcess {
            pid,
            comm: std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .unwrap_or_default()
                .trim()
                .to_string(),
            mps_env: environ
                .split(|b| *b == 0)
                .any(|v| v.starts_with(b"CUDA_MPS_PIPE_DIRECTORY=")),
        });
    }
    out
}

#[test]
fn a_fraction_that_skips_mps_and_takes_more_memory_is_stopped_and_its_neighbour_runs_on() {
    if !docker_or_skip(
        "a_fraction_that_skips_mps_and_takes_more_memory_is_stopped_and_its_neighbour_runs_on",
    ) {
        return;
    }
    let image = busybox_image();
    let mut c = Cluster::start(&[]);
    let machine_path = c.dir.path().join("machine.json");
    let mut machine = json!({
        "gpus": [{ "uuid": GPU0, "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960 }]
    });
    write_machine(&machine_path, &machine);
    let agent = c.add_agent(AgentOpts {
        simulate_gpus: None,
        runtime: "docker,process",
        extra: vec![
            "--nvml-lib".into(),
            gpuctl_tests::fake_nvml_lib().display().to_string(),
            "--health-interval-secs".into(),
            "0.2".into(),
            "--share-gpus".into(),
            "mps".into(),
            "--mps-control".into(),
            gpuctl_tests::fake_mps_control().display().to_string(),
        ],
        env: vec![(
            "FAKE_NVML_CONFIG".into(),
            machine_path.display().to_string(),
        )],
        ..Default::default()
    });
    assert_eq!(c.json(&["gpus", "--json"])[0]["share_mode"], "mps");

    // The hog is given MPS, then replaces itself by a process with an empty
    // environment: no pipe, no limit.
    let hog_job = c.submit(&[
        "--name",
        "hog",
        "--image",
        &image,
        "--gpu-mem",
        "1GiB",
        "--cpus",
        "0.1",
        "--",
        "sh",
        "-c",
        "echo given pipe=$CUDA_MPS_PIPE_DIRECTORY; \
         exec env -i sh -c 'echo bypass pipe=${CUDA_MPS_PIPE_DIRECTORY:-none}; exec sleep 600'",
    ]);
    // The neighbour sets MPS's variables itself: a pipe of its own, all of
    // the GPU's compute, a limit naming a GPU it cannot see. The agent's
    // values replace them (no --gpu-compute: no percentage at all).
    let fine_job = c.submit(&[
        "--name",
        "fine",
        "--image",
        &image,
        "--gpu-mem",
        "1GiB",
        "--cpus",
        "0.1",
        "--env",
        "CUDA_MPS_PIPE_DIRECTORY=/tmp/my-own-mps",
        "--env",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100",
        "--env",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40G,3=40G",
        "--",
        "sh",
        "-c",
        "echo pipe=$CUDA_MPS_PIPE_DIRECTORY mem=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT \
         pct=${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:-none}; exec sleep 600",
    ]);
    for j in [&hog_job, &fine_job] {
        let j = c.wait_state(j, "RUNNING", Duration::from_secs(60));
        assert_eq!(j["tasks"][0]["enforcement"], "mps", "{j}");
    }
    let (hog, fine) = (task_of(&c, &hog_job), task_of(&c, &fine_job));
    let logs = |j: &str| c.ok(&["jobs", "logs", j]);
    wait_for(Duration::from_secs(30), "the tasks' output", || {
        logs(&hog_job).contains("bypass") && logs(&fine_job).contains("pipe=")
    });
    let out = logs(&hog_job);
    assert!(
        out.contains("given pipe=/run/nvidia-mps") && out.contains("bypass pipe=none"),
        "{out}"
    );
    let out = logs(&fine_job);
    assert!(
        out.contains("pipe=/run/nvidia-mps mem=0=1024M pct=none"),
        "the job's own CUDA_MPS_* won: {out}"
    );

    // Their sleeps, from /proc: the hog's without MPS's environment.
    let mut procs = BTreeMap::new();
    wait_for(Duration::from_secs(10), "the tasks' sleeps", || {
        procs.clear();
        for t in [&hog, &fine] {
            if let Some(p) = processes_of(&agent, t)
                .into_iter()
                .find(|p| p.comm == "sleep")
            {
                procs.insert(t.clone(), p);
            }
        }
        procs.len() == 2
    });
    assert!(!procs[&hog].mps_env, "{:?}", procs[&hog]);
    assert!(procs[&fine].mps_env, "{:?}", procs[&fine]);
    let (hog_pid, fine_pid) = (procs[&hog].pid, procs[&fine].pid);
    let (group, daemon) = the_daemon(&c.dir.path().join("agent0"), GPU0);
    let before = running_task_containers(&agent).unwrap();
    assert_eq!(before.len(), 2, "{before:?}");

    // NVML: the hog a plain compute process (not an MPS client) with 2 GiB,
    // over its 1 GiB; the neighbour an MPS client with 512 MiB.
    machine["gpus"][0]["processes"] = json!([
        { "pid": hog_pid, "memory_used_mib": 2048, "mps_client": false },
        { "pid": fine_pid, "memory_used_mib": 512 },
    ]);
    write_machine(&machine_path, &machine);

    let j = c.wait_state(&hog_job, "FAILED", Duration::from_secs(30));
    let t = &j["tasks"][0];
    assert_eq!(t["reason"], "GPU_MEMORY_LIMIT", "{j}");
    let msg = t["message"].as_str().unwrap();
    assert!(
        msg.contains("2048 MiB") && msg.contains("1024 MiB"),
        "{msg}"
    );
    let got = c.ok(&["jobs", "get", &hog_job]);
    assert!(
        got.contains("GPU_MEMORY_LIMIT") && got.contains("2048 MiB"),
        "{got}"
    );
    // Gone from outside: its process, and its container from Docker's
    // running ones.
    wait_for(Duration::from_secs(15), "the hog's process gone", || {
        !alive(hog_pid) && processes_of(&agent, &hog).is_empty()
    });
    // The neighbour untouched: the same container and process, its share
    // the only one counted, the daemon the same.
    std::thread::sleep(Duration::from_secs(1));
    let want = BTreeMap::from([(fine.clone(), GIB)]);
    let after = assert_views_agree(&c, &agent, GPU0, &mps_pipe(&group), &want);
    assert_eq!(after.get(&fine), before.get(&fine));
    assert!(alive(fine_pid));
    assert_eq!(c.job(&fine_job)["state"], "RUNNING");
    assert_eq!(mps_daemon_pid(&mps_pipe(&group)), Some(daemon));
    c.ok(&["jobs", "cancel", &fine_job]);
    c.wait_job(&fine_job, 60);
}

/// The pipe directory is mounted read-write into a tenant's containers, and
/// a container running as root can rewrite the daemon's pid file there.
/// Tenant alpha names tenant beta's daemon in its own pid file and ends;
/// once alpha's daemon has been idle long enough, the agent stops alpha's
/// daemon, the one it recorded itself, and beta's runs on under beta's task.
#[test]
fn a_tenant_that_rewrites_its_mps_pid_file_cannot_get_another_tenants_daemon_stopped() {
    if !docker_or_skip(
        "a_tenant_that_rewrites_its_mps_pid_file_cannot_get_another_tenants_daemon_stopped",
    ) {
        return;
    }
    let image = busybox_image();
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts {
        simulate_gpus: Some("1xA100-SXM4-40GB"),
        runtime: "docker,process",
        extra: vec![
            "--share-gpus".into(),
            "mps".into(),
            "--mps-control".into(),
            gpuctl_tests::fake_mps_control().display().to_string(),
        ],
        ..Default::default()
    });
    let uuid = c.json(&["gpus", "--json"])[0]["uuid"]
        .as_str()
        .unwrap()
        .to_string();
    let work = c.dir.path().join("agent0");
    let beta = c.submit(&[
        "--name",
        "victim",
        "--tenant",
        "beta",
        "--image",
        &image,
        "--gpu-mem",
        "1GiB",
        "--cpus",
        "0.1",
        "--",
        "sleep",
        "600",
    ]);
    c.wait_state(&beta, "RUNNING", Duration::from_secs(60));
    let group = |tenant: &str| {
        mps_groups(&work, &uuid).into_iter().find(|g| {
            g.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(tenant))
        })
    };
    let beta_pipe = mps_pipe(&group("beta").unwrap());
    let beta_pid = mps_daemon_pid(&beta_pipe).unwrap();
    let script =
        format!("echo {beta_pid} > /run/nvidia-mps/nvidia-cuda-mps-control.pid && echo wrote");
    let alpha = c.submit(&[
        "--name",
        "attacker",
        "--tenant",
        "alpha",
        "--image",
        &image,
        "--gpu-mem",
        "1GiB",
        "--cpus",
        "0.1",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert_eq!(c.wait_job(&alpha, 60).0, 0);
    assert!(c.ok(&["jobs", "logs", &alpha]).contains("wrote"));
    let alpha_group = group("alpha").unwrap();
    let alpha_pid: i32 = std::fs::read_to_string(alpha_group.join("daemon.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_ne!(alpha_pid, beta_pid);
    // Idle for 30 s, then stopped by the agent's supervision.
    wait_for(
        Duration::from_secs(90),
        "alpha's daemon stopped when idle",
        || !alive(alpha_pid),
    );
    std::thread::sleep(Duration::from_secs(6));
    assert!(alive(beta_pid), "beta's daemon was stopped for alpha's");
    assert_eq!(
        mps_daemon_pid(&beta_pipe),
        Some(beta_pid),
        "beta's daemon restarted"
    );
    assert_eq!(c.job(&beta)["state"], "RUNNING");
    c.ok(&["jobs", "cancel", &beta]);
}
