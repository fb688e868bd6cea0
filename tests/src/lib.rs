//! Cluster fixtures for end-to-end tests: real `gpuctl-master`, `gpuctl-agent`
//! and `gpuctl` processes over loopback, each cluster in its own temp dir and
//! ports, so tests run in parallel.
//!
//! Tests that need root and a Docker daemon call [`docker_or_skip`]: without
//! them it prints why and the test returns; with `GPUCTL_REQUIRE_DOCKER=1`
//! (CI) it fails instead.
//!
//! [`sim`] runs many simulated agents inside the test process, against a
//! master's real agent API, for tests and benchmarks at scale.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod browser;
pub mod dockerd;
pub mod netlab;
pub mod sim;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Workspace root (this crate lives in `<root>/tests`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Cargo, in the workspace, without the variables cargo sets for the test
/// binary that runs it (`CARGO_MANIFEST_DIR`, `CARGO_PKG_NAME`, `OUT_DIR`,
/// ...). Build scripts ask to rerun when those change (ring's, and so the
/// whole TLS stack above it), and cargo compares them against its own
/// environment: inherited from a test, they differ from the top-level
/// `cargo test`'s, and each package's first test rebuilt half the
/// workspace (about 50 s of CI, twice).
pub fn cargo() -> Command {
    let mut cmd = Command::new(env!("CARGO"));
    cmd.current_dir(workspace_root());
    for (key, _) in std::env::vars_os() {
        if let Some(key) = key.to_str() {
            if is_crate_variable(key) {
                cmd.env_remove(key);
            }
        }
    }
    cmd
}

/// The variables cargo sets for a crate it compiles or runs (see "Environment
/// variables Cargo sets for crates"), as opposed to those a user sets for
/// cargo itself (`CARGO_HOME`, `CARGO_TARGET_DIR`, `CARGO_BUILD_*`, ...).
pub fn is_crate_variable(key: &str) -> bool {
    const EXACT: &[&str] = &[
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_MANIFEST_LINKS",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
        "OUT_DIR",
    ];
    EXACT.contains(&key) || key.starts_with("CARGO_PKG_") || key.starts_with("CARGO_BIN_EXE_")
}

/// Directory of the freshly built binaries. `cargo test` does not build
/// other packages' binaries, so build them once here (a no-op when fresh).
/// With the workspace's tests, so that features resolve as in `cargo test
/// --workspace` (the README's test command), dev-dependencies included
/// (tokio's `test-util`): a build without them resolves tokio otherwise
/// and rebuilt tokio, the TLS stack, tonic and every gpuctl crate in the
/// middle of the suite, about a minute of CI. Only the binaries are left
/// to build.
pub fn bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let status = cargo()
            .args(["build", "--workspace", "--bins", "--lib", "--tests"])
            .status()
            .expect("run cargo build");
        assert!(status.success(), "building the gpuctl binaries failed");
        target_dir().join("debug")
    })
}

/// Builds `name` of `package` with the release profile (for benchmarks;
/// the tests use the debug binaries of [`bin_dir`]) and returns its path.
pub fn release_bin(package: &str, name: &str) -> PathBuf {
    let status = cargo()
        .args(["build", "--release", "-p", package, "--bin", name])
        .status()
        .expect("run cargo build --release");
    assert!(status.success(), "building {name} (release) failed");
    target_dir().join("release").join(name)
}

/// Cargo's target directory (it may be moved by CARGO_TARGET_DIR or a
/// .cargo/config, so ask cargo).
pub fn target_dir() -> PathBuf {
    let out = cargo()
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success(), "cargo metadata: {}", out.status);
    let meta: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON");
    PathBuf::from(
        meta["target_directory"]
            .as_str()
            .expect("cargo metadata has target_directory"),
    )
}

/// The fake libnvidia-ml (tests/fake-nvml), built with the binaries.
pub fn fake_nvml_lib() -> PathBuf {
    bin_dir().join("libfake_nvml.so")
}

/// One of the example machines in tests/fake-nvml/configs.
pub fn fake_nvml_config(name: &str) -> PathBuf {
    workspace_root()
        .join("tests/fake-nvml/configs")
        .join(format!("{name}.json"))
}

pub fn bin(name: &str) -> PathBuf {
    bin_dir().join(name)
}

/// True when Docker tests can run here. Otherwise prints why and returns
/// false, or panics when `GPUCTL_REQUIRE_DOCKER=1`.
pub fn docker_or_skip(test: &str) -> bool {
    let why = if !nix::unistd::Uid::effective().is_root() {
        Some("not running as root".to_string())
    } else {
        match Command::new("docker")
            .args(["info", "--format", "{{.ServerVersion}}"])
            .output()
        {
            Ok(o) if o.status.success() => None,
            Ok(o) => Some(format!(
                "docker info failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => Some(format!("docker CLI not found: {e}")),
        }
    };
    match why {
        None => true,
        Some(why) if std::env::var("GPUCTL_REQUIRE_DOCKER").as_deref() == Ok("1") => {
            panic!("{test}: Docker is required (GPUCTL_REQUIRE_DOCKER=1) but {why}")
        }
        Some(why) => {
            eprintln!("skipped: {test}: needs root and a Docker daemon ({why})");
            false
        }
    }
}

/// `docker build -t TAG -` of `dockerfile` (no context: a local base
/// image and ENV/LABEL lines, no registry).
pub fn docker_build(tag: &str, dockerfile: &str) {
    use std::io::Write;
    let mut build = Command::new("docker")
        .args(["build", "-q", "-t", tag, "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    build
        .stdin
        .take()
        .unwrap()
        .write_all(dockerfile.as_bytes())
        .unwrap();
    assert!(build.wait().unwrap().success(), "docker build of {tag}");
}

/// True when running as root (host tasks as other users need it).
/// Otherwise prints why and returns false, or panics when
/// `GPUCTL_REQUIRE_DOCKER=1` (CI runs everything).
pub fn root_or_skip(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if std::env::var("GPUCTL_REQUIRE_DOCKER").as_deref() == Ok("1") {
        panic!("{test}: needs root (GPUCTL_REQUIRE_DOCKER=1)");
    }
    eprintln!("skipped: {test}: needs root to run tasks as other users");
    false
}

/// Makes sure the local busybox test image exists and returns its name.
pub fn busybox_image() -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let docker = gpuctl_agent::runtime::DockerRuntime::connect()
            .await
            .expect("connect to Docker");
        gpuctl_agent::runtime::image::ensure_busybox_image(&docker.client().expect("docker client"))
            .await
            .expect("make the busybox image")
    })
}

/// The users host-process tasks run as unless their job names one (the
/// agents' default `task_users`, a user of each task's own): tests run
/// their agents as root, not their tasks.
pub const TASK_USERS: std::ops::RangeInclusive<u32> = 80000..=89999;

/// Makes `dir` writable by every task's user (each task has one of its
/// own), for a test whose host-process tasks leave files there. Files that
/// several tasks append to are made by the test first (see
/// [`task_shared_file`]). Returns it.
pub fn task_writable_dir(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", dir.display()));
    dir.to_path_buf()
}

/// An empty file that every task's user may append to (tasks of several
/// jobs, or several runs of one, each with a user of its own).
pub fn task_shared_file(path: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, "").unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
    path.to_path_buf()
}

/// The live processes in the PID namespace `ns` (`pid:[INODE]`, what a
/// host task reads with `readlink /proc/self/ns/pid`): how a test finds a
/// task's processes from outside (inside its namespace the command is pid
/// 2, and task ids repeat across the clusters of one test binary).
pub fn pid_ns_members(ns: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .map(|(_, r)| r.trim_start().starts_with('Z'))
            })
            .unwrap_or(true);
        let same = std::fs::read_link(format!("/proc/{pid}/ns/pid"))
            .is_ok_and(|l| l.to_string_lossy() == ns);
        if same && !zombie {
            out.push(pid);
        }
    }
    out
}

/// A test's own directory for its cluster, removed when dropped. Not under
/// `/tmp`: host tasks get a private `/tmp` (and `/var/tmp`) of their own,
/// so what a test shares with its tasks (files, scripts, device nodes)
/// must lie elsewhere. Under `$GPUCTL_TEST_DIR`, else `/var/lib/gpuctl-tests`
/// when running as root, else the usual temp dir (nothing runs as another
/// user then). Mode 0755, like a real agent's work dir's parents, so that
/// each task's user reaches its sandbox by its path.
pub fn test_dir() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let base = match std::env::var_os("GPUCTL_TEST_DIR") {
        Some(d) => PathBuf::from(d),
        None if nix::unistd::Uid::effective().is_root() => PathBuf::from("/var/lib/gpuctl-tests"),
        None => std::env::temp_dir(),
    };
    std::fs::create_dir_all(&base).unwrap_or_else(|e| panic!("mkdir {}: {e}", base.display()));
    let dir = tempfile::Builder::new()
        .prefix("gpuctl-")
        .tempdir_in(&base)
        .unwrap_or_else(|e| panic!("a temp dir in {}: {e}", base.display()));
    for d in [&base, &dir.path().to_path_buf()] {
        let _ = std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755));
    }
    dir
}

/// A free loopback port (bound then released; good enough for tests). Never
/// the same port twice in one process, so that parallel tests do not pick
/// a port another test was given but has not bound yet.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if GIVEN.lock().unwrap_or_else(|p| p.into_inner()).insert(port) {
            return port;
        }
    }
}

/// A child daemon, stopped with SIGTERM (then SIGKILL) when dropped.
pub struct Daemon {
    pub name: String,
    child: Option<Child>,
    pub log: PathBuf,
}

impl Daemon {
    /// Starts `program` with `args`, its stdout and stderr appended to `log`.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        log: PathBuf,
    ) -> Daemon {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = Command::new(program)
            .args(args)
            .env("GPUCTL_LOG", "info")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display()));
        Daemon {
            name: name.to_string(),
            child: Some(child),
            log,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Whether the process was started and has not been stopped or killed
    /// through this handle (nor exited on its own).
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGTERM and wait (SIGKILL after 20 s).
    pub fn stop(&mut self) {
        self.signal_and_wait(nix::sys::signal::Signal::SIGTERM, Duration::from_secs(20));
    }

    /// SIGKILL: a crash.
    pub fn kill(&mut self) {
        self.signal_and_wait(nix::sys::signal::Signal::SIGKILL, Duration::from_secs(5));
    }

    fn signal_and_wait(&mut self, sig: nix::sys::signal::Signal, grace: Duration) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, sig);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // The agents first, so that none starts an MPS daemon again; then
        // the daemons they left (an agent killed by a test leaves them, as
        // a real one does), whether the test passed or not.
        for a in &mut self.agents {
            a.stop();
        }
        for n in 0..self.agents.len() {
            stop_mps_daemons(&self.dir.path().join(format!("agent{n}")));
        }
    }
}

impl Drop for HaCluster {
    fn drop(&mut self) {
        // As for [`Cluster`]: the agents, then the MPS daemons they left.
        for a in &mut self.agents {
            a.stop();
        }
        for n in 0..self.agents.len() {
            stop_mps_daemons(&self.dir.path().join(format!("agent{n}")));
        }
    }
}

pub type Env = Vec<(String, String)>;

/// A master, and agents added to it, in one temp dir.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub master_addr: String,
    pub master: Daemon,
    master_args: Vec<String>,
    pub agents: Vec<Daemon>,
    /// Each agent's arguments and environment, for `restart_agent`.
    agent_args: Vec<AgentArgs>,
}

pub struct AgentOpts<'a> {
    pub simulate_gpus: Option<&'a str>,
    pub runtime: &'a str,
    pub extra: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Test agents take their tasks down with them when the test drops
    /// them (`--stop-tasks-on-shutdown`), so nothing outlives a test;
    /// tests of task survival turn it off.
    pub stop_tasks_on_shutdown: bool,
}

impl Default for AgentOpts<'_> {
    fn default() -> Self {
        AgentOpts {
            simulate_gpus: Some("4xA100-SXM4-40GB"),
            runtime: "process",
            extra: vec![],
            env: vec![],
            stop_tasks_on_shutdown: true,
        }
    }
}

impl AgentOpts<'_> {
    /// An agent whose GPUs are fake-nvml's, described by the JSON file
    /// `machine`, probed every `health_interval_secs`.
    pub fn fake_nvml(machine: &Path, health_interval_secs: &str) -> Self {
        AgentOpts {
            simulate_gpus: None,
            extra: vec![
                "--nvml-lib".into(),
                fake_nvml_lib().display().to_string(),
                "--health-interval-secs".into(),
                health_interval_secs.into(),
            ],
            env: vec![("FAKE_NVML_CONFIG".into(), machine.display().to_string())],
            ..Default::default()
        }
    }
}

/// Replaces fake-nvml's machine description at once (written, then
/// renamed), so that fake-nvml never reads half of one.
pub fn write_fake_machine(path: &Path, machine: &serde_json::Value) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(machine).unwrap()).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

impl Cluster {
    /// Starts a master (with `extra` flags) and waits until it answers.
    pub fn start(extra: &[&str]) -> Cluster {
        let dir = test_dir();
        let port = free_port();
        let master_addr = format!("127.0.0.1:{port}");
        let mut master_args = vec![
            "--listen".to_string(),
            master_addr.clone(),
            "--data-dir".into(),
            dir.path().join("master").display().to_string(),
        ];
        master_args.extend(extra.iter().map(|s| s.to_string()));
        let master = Daemon::spawn(
            "master",
            &bin("gpuctl-master"),
            &master_args,
            &[],
            dir.path().join("master.log"),
        );
        let c = Cluster {
            dir,
            master_addr,
            master,
            master_args,
            agents: vec![],
            agent_args: vec![],
        };
        c.wait_master_up();
        c
    }

    fn wait_master_up(&self) {
        wait_for(Duration::from_secs(30), "master answers", || {
            self.gpuctl(&["jobs", "list", "--json"]).status.success()
        });
    }

    /// Stops the master (SIGTERM) and starts it again on the same data dir
    /// and address.
    pub fn restart_master(&mut self) {
        self.master.stop();
        self.master = Daemon::spawn(
            "master",
            &bin("gpuctl-master"),
            &self.master_args,
            &[],
            self.dir.path().join("master.log"),
        );
        self.wait_master_up();
    }

    /// Starts an agent and waits until it is ACTIVE; returns its id.
    pub fn add_agent(&mut self, opts: AgentOpts) -> String {
        let before = agent_ids(&self.agents_json());
        let (daemon, args) =
            spawn_agent(self.dir.path(), self.agents.len(), &self.master_addr, opts);
        self.agents.push(daemon);
        self.agent_args.push(args);
        wait_new_agent(&before, || self.agents_json())
    }

    /// Starts agent `n` again with the same options and work dir (after a
    /// `stop` or `kill`).
    pub fn restart_agent(&mut self, n: usize) {
        self.agents[n].kill();
        self.agents[n] = respawn_agent(self.dir.path(), n, &self.agent_args[n]);
    }
}

/// Runs `gpuctl --master <masters> args...` (`masters`: `HOST:PORT[,...]`).
pub fn gpuctl_at(masters: &str, args: &[&str]) -> Output {
    Command::new(bin("gpuctl"))
        .arg("--master")
        .arg(masters)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// `s` without ANSI escape sequences (the daemons colour their logs).
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                // Parameters, then one final byte in '@'..='~'.
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// One master of an [`HaCluster`].
pub struct HaMaster {
    pub id: u64,
    /// `127.0.0.1:PORT`: its API, which also carries Raft.
    pub addr: String,
    pub data_dir: PathBuf,
    pub daemon: Daemon,
    args: Vec<String>,
}

/// Several masters forming one Raft group (`--peers`), and agents given
/// every master's address, in one temp dir. Masters are numbered from 1
/// (their Raft node ids).
pub struct HaCluster {
    pub dir: tempfile::TempDir,
    /// By node id, including masters that were killed or added later.
    pub masters: std::collections::BTreeMap<u64, HaMaster>,
    pub agents: Vec<Daemon>,
    agent_args: Vec<AgentArgs>,
}

/// The agent timeout of [`HaCluster`] masters unless told otherwise: long
/// enough that no agent is marked lost during a failover.
pub const HA_AGENT_TIMEOUT_SECS: &str = "15";

impl HaCluster {
    /// Starts `n` masters (ids 1..=n, all with `--peers` naming every one,
    /// plus `extra` flags) and waits until one leads and serves.
    pub fn start(n: u64, extra: &[&str]) -> HaCluster {
        Self::start_each(n, |_| extra.iter().map(|s| s.to_string()).collect())
    }

    /// Like [`HaCluster::start`], with each master's own extra flags
    /// (`extra(id)`), e.g. a port of its own.
    pub fn start_each(n: u64, extra: impl Fn(u64) -> Vec<String>) -> HaCluster {
        assert!(n >= 1);
        let dir = test_dir();
        let addrs: Vec<(u64, String)> = (1..=n)
            .map(|id| (id, format!("127.0.0.1:{}", free_port())))
            .collect();
        let peers = addrs
            .iter()
            .map(|(id, a)| format!("{id}={a}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut c = HaCluster {
            dir,
            masters: Default::default(),
            agents: vec![],
            agent_args: vec![],
        };
        for (id, addr) in addrs {
            let mut args = vec!["--peers".to_string(), peers.clone()];
            args.extend(extra(id));
            c.spawn_master(id, addr, args);
        }
        c.wait_serving();
        c
    }

    fn spawn_master(&mut self, id: u64, addr: String, mut args: Vec<String>) {
        let data_dir = self.dir.path().join(format!("master{id}"));
        let mut all = vec![
            "--node-id".to_string(),
            id.to_string(),
            "--listen".into(),
            addr.clone(),
            "--data-dir".into(),
            data_dir.display().to_string(),
        ];
        if !args.iter().any(|a| a == "--agent-timeout-secs") {
            all.push("--agent-timeout-secs".into());
            all.push(HA_AGENT_TIMEOUT_SECS.into());
        }
        all.append(&mut args);
        let daemon = Daemon::spawn(
            &format!("master{id}"),
            &bin("gpuctl-master"),
            &all,
            &[],
            self.dir.path().join(format!("master{id}.log")),
        );
        self.masters.insert(
            id,
            HaMaster {
                id,
                addr,
                data_dir,
                daemon,
                args: all,
            },
        );
    }

    /// Starts master `id` with `--join` (empty, waiting for `gpuctl masters
    /// add`) on a new port; returns its address. It is not a member yet.
    pub fn start_joining_master(&mut self, id: u64, extra: &[&str]) -> String {
        assert!(!self.masters.contains_key(&id), "master {id} exists");
        let addr = format!("127.0.0.1:{}", free_port());
        let mut args = vec!["--join".to_string()];
        args.extend(extra.iter().map(|s| s.to_string()));
        self.spawn_master(id, addr.clone(), args);
        wait_for(Duration::from_secs(30), "joining master answers", || {
            gpuctl_at(&addr, &["masters", "--json"]).status.success()
        });
        self.assert_running(id);
        addr
    }

    /// Panics (with its log) when master `id` exited, e.g. because another
    /// process took its port, in which case that process may have answered
    /// in its place.
    pub fn assert_running(&mut self, id: u64) {
        let m = self.masters.get_mut(&id).expect("known master");
        assert!(
            m.daemon.is_running(),
            "master {id} ({}) exited:\n{}",
            m.addr,
            strip_ansi(&tail(&m.daemon.log_text(), 20))
        );
    }

    /// Every master's address, in id order, as `--master` takes them.
    pub fn addrs(&self) -> String {
        self.masters
            .values()
            .map(|m| m.addr.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The addresses of the masters whose process runs, in id order.
    pub fn live_addrs(&mut self) -> String {
        self.masters
            .values_mut()
            .filter_map(|m| m.daemon.is_running().then_some(m.addr.clone()))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn addr(&self, id: u64) -> &str {
        &self.masters[&id].addr
    }

    /// `gpuctl masters --json` asked of `masters` (any master answers it).
    pub fn members_at(&self, masters: &str) -> Option<Vec<Value>> {
        let out = gpuctl_at(masters, &["masters", "--json"]);
        if !out.status.success() {
            return None;
        }
        serde_json::from_slice::<Value>(&out.stdout)
            .ok()?
            .as_array()
            .cloned()
    }

    /// The leader as the live masters report themselves: each live master
    /// is asked for the group, and the reachable member calling itself
    /// leader with the highest term wins. None during an election.
    pub fn try_leader_id(&mut self) -> Option<u64> {
        let live = self.live_addrs();
        let members = self.members_at(&live)?;
        let leader = members
            .iter()
            .filter(|m| m["reachable"] == true && m["role"] == "leader")
            .max_by_key(|m| m["term"].as_u64().unwrap_or(0))?;
        let id = leader["id"].as_u64()?;
        // A master just killed may still be listed from a stale view.
        self.masters
            .get_mut(&id)
            .is_some_and(|m| m.daemon.is_running())
            .then_some(id)
    }

    /// Waits (up to 30 s) for a leader and returns its id.
    pub fn leader_id(&mut self) -> u64 {
        let mut id = None;
        let found = try_wait_for(Duration::from_secs(30), || {
            id = self.try_leader_id();
            id.is_some()
        });
        assert!(found, "no leader elected\n{}", self.diagnostics());
        id.unwrap_or_default()
    }

    /// Waits until a master other than `old` leads; returns its id.
    pub fn wait_new_leader(&mut self, old: u64) -> u64 {
        let mut id = None;
        let found = try_wait_for(Duration::from_secs(30), || {
            id = self.try_leader_id().filter(|l| *l != old);
            id.is_some()
        });
        assert!(
            found,
            "no new leader after master {old}\n{}",
            self.diagnostics()
        );
        id.unwrap_or_default()
    }

    /// Waits until a leader serves the API (a read through every address).
    pub fn wait_serving(&mut self) {
        self.leader_id();
        let ids: Vec<u64> = self.masters.keys().copied().collect();
        for id in ids {
            self.assert_running(id);
        }
        let ok = try_wait_for(Duration::from_secs(30), || {
            self.gpuctl(&["jobs", "list", "--json"]).status.success()
        });
        assert!(ok, "the masters do not serve\n{}", self.diagnostics());
    }

    /// SIGKILL: a crash of master `id`.
    pub fn kill_master(&mut self, id: u64) {
        self.masters
            .get_mut(&id)
            .expect("known master")
            .daemon
            .kill();
    }

    /// SIGTERM, and wait for the exit.
    pub fn stop_master(&mut self, id: u64) {
        self.masters
            .get_mut(&id)
            .expect("known master")
            .daemon
            .stop();
    }

    /// Starts master `id` again (after a kill or stop) with the same
    /// arguments, data dir and address, and waits until it answers.
    pub fn restart_master(&mut self, id: u64) {
        let log = self.dir.path().join(format!("master{id}.log"));
        let m = self.masters.get_mut(&id).expect("known master");
        m.daemon.kill();
        m.daemon = Daemon::spawn(
            &format!("master{id}"),
            &bin("gpuctl-master"),
            &m.args,
            &[],
            log,
        );
        let addr = m.addr.clone();
        wait_for(Duration::from_secs(30), "restarted master answers", || {
            gpuctl_at(&addr, &["masters", "--json"]).status.success()
        });
        self.assert_running(id);
    }

    /// Stops master `id`, deletes its data dir and starts it again, empty,
    /// with `--join` on the same address (to be added back with `gpuctl
    /// masters add` after it was removed).
    pub fn wipe_and_join(&mut self, id: u64) {
        let m = self.masters.get_mut(&id).expect("known master");
        m.daemon.stop();
        std::fs::remove_dir_all(&m.data_dir).unwrap();
        let addr = m.addr.clone();
        self.masters.remove(&id);
        self.spawn_master(id, addr.clone(), vec!["--join".to_string()]);
        wait_for(Duration::from_secs(30), "joining master answers", || {
            gpuctl_at(&addr, &["masters", "--json"]).status.success()
        });
        self.assert_running(id);
    }

    /// Starts an agent given every master's address and waits until it is
    /// ACTIVE; returns its id.
    pub fn add_agent(&mut self, opts: AgentOpts) -> String {
        let before = agent_ids(&self.agents_json());
        let (daemon, args) = spawn_agent(self.dir.path(), self.agents.len(), &self.addrs(), opts);
        self.agents.push(daemon);
        self.agent_args.push(args);
        wait_new_agent(&before, || self.agents_json())
    }

    /// Starts agent `n` again with the same options and work dir.
    pub fn restart_agent(&mut self, n: usize) {
        self.agents[n].kill();
        self.agents[n] = respawn_agent(self.dir.path(), n, &self.agent_args[n]);
    }
}

/// The gpuctl calls both fixtures make; they differ only in how gpuctl is
/// run (which masters) and in what a failure prints.
/// The ids of a job's tasks (`jobs get --json`), oldest first.
pub fn task_ids(job: &Value) -> Vec<String> {
    job["tasks"]
        .as_array()
        .map(|ts| {
            ts.iter()
                .filter_map(|t| t["id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

pub trait Gpuctl {
    /// Runs `gpuctl --master ... args...`.
    fn gpuctl(&self, args: &[&str]) -> Output;

    /// The last lines of the daemons' logs, for failure messages.
    fn diagnostics(&self) -> String;

    /// Runs gpuctl, asserts success and returns stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.gpuctl(args);
        assert!(
            out.status.success(),
            "gpuctl {args:?} failed ({:?}): {}\n{}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr),
            self.diagnostics()
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn json(&self, args: &[&str]) -> Value {
        let s = self.ok(args);
        serde_json::from_str(&s).unwrap_or_else(|e| panic!("gpuctl {args:?}: bad JSON {e}: {s}"))
    }

    /// Submits a job and returns its id.
    fn submit(&self, args: &[&str]) -> String {
        let mut all = vec!["jobs", "submit"];
        all.extend_from_slice(args);
        let id = self.ok(&all).trim().to_string();
        assert!(id.starts_with("job-"), "unexpected job id {id:?}");
        id
    }

    fn job(&self, id: &str) -> Value {
        self.json(&["jobs", "get", id, "--json"])
    }

    /// The job once the leader's queue pass has said why it waits (the
    /// pass publishes reasons after state changes, at most every 250 ms),
    /// or once it left the queue.
    fn job_with_reason(&self, id: &str) -> Value {
        let mut last = Value::Null;
        let found = try_wait_for(Duration::from_secs(15), || {
            last = self.job(id);
            // `reason` falls back to the job's message; `wait_reason` is
            // the pass's own.
            last["state"] != "QUEUED" || !last["wait_reason"].is_null()
        });
        assert!(
            found,
            "job {id} got no wait reason; last: {last}\n{}",
            self.diagnostics()
        );
        last
    }

    /// Waits until the job is in `state` (e.g. "RUNNING").
    fn wait_state(&self, id: &str, state: &str, timeout: Duration) -> Value {
        let mut last = Value::Null;
        let found = try_wait_for(timeout, || {
            last = self.job(id);
            last["state"] == state
        });
        assert!(
            found,
            "job {id} did not reach {state}; last: {last}\n{}",
            self.diagnostics()
        );
        last
    }

    /// `agents list --json`, empty when it fails.
    fn agents_json(&self) -> Vec<Value> {
        let out = self.gpuctl(&["agents", "list", "--json"]);
        if !out.status.success() {
            return vec![];
        }
        serde_json::from_slice::<Value>(&out.stdout)
            .ok()
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
    }

    /// Polls the job (`jobs get --json`) until `f` holds, at most
    /// `timeout`; returns the job as last read, or panics saying `what` it
    /// waited for.
    fn wait_job_until(
        &self,
        id: &str,
        timeout: Duration,
        what: &str,
        mut f: impl FnMut(&Value) -> bool,
    ) -> Value {
        let mut last = Value::Null;
        let ok = try_wait_for(timeout, || {
            last = self.job(id);
            f(&last)
        });
        assert!(
            ok,
            "job {id}: timed out waiting until {what}; last: {last}\n{}",
            self.diagnostics()
        );
        last
    }

    /// `gpuctl jobs wait`, returning (exit code, stdout).
    fn wait_job(&self, id: &str, timeout_secs: u32) -> (i32, String) {
        let t = timeout_secs.to_string();
        let out = self.gpuctl(&["jobs", "wait", id, "--timeout", &t]);
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        )
    }
}

impl Gpuctl for Cluster {
    /// Runs `gpuctl --master <this master> args...`.
    fn gpuctl(&self, args: &[&str]) -> Output {
        Command::new(bin("gpuctl"))
            .arg("--master")
            .arg(&self.master_addr)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    fn diagnostics(&self) -> String {
        let mut s = format!(
            "--- master log ---\n{}\n",
            tail(&self.master.log_text(), 40)
        );
        for a in &self.agents {
            s.push_str(&format!("--- agent log ---\n{}\n", tail(&a.log_text(), 30)));
        }
        s
    }
}

impl HaCluster {
    /// Runs gpuctl against `masters`, asserts success, returns stdout.
    pub fn ok_at(&self, masters: &str, args: &[&str]) -> String {
        let out = gpuctl_at(masters, args);
        assert!(
            out.status.success(),
            "gpuctl --master {masters} {args:?} failed ({:?}): {}\n{}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr),
            self.diagnostics()
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

impl Gpuctl for HaCluster {
    /// Runs `gpuctl --master <every master> args...`.
    fn gpuctl(&self, args: &[&str]) -> Output {
        gpuctl_at(&self.addrs(), args)
    }

    /// The last lines of every master's and agent's log.
    fn diagnostics(&self) -> String {
        let mut s = String::new();
        for m in self.masters.values() {
            s.push_str(&format!(
                "--- master {} ({}) ---\n{}\n",
                m.id,
                m.addr,
                strip_ansi(&tail(&m.daemon.log_text(), 25))
            ));
        }
        for a in &self.agents {
            s.push_str(&format!(
                "--- {} ---\n{}\n",
                a.name,
                strip_ansi(&tail(&a.log_text(), 15))
            ));
        }
        s
    }
}

/// How an agent of a test cluster was started: its arguments and environment.
pub type AgentArgs = (Vec<String>, Env);

/// Where agent `n` of a test cluster in `dir` writes its CDI spec: a
/// directory of its own, never the host's /var/run/cdi (agents of parallel
/// tests would overwrite each other's spec there, naming temp dirs).
pub fn agent_cdi_dir(dir: &Path, n: usize) -> PathBuf {
    dir.join(format!("agent{n}-cdi"))
}

/// Starts agent `n` of a test cluster (work dir and log under `dir`),
/// talking to `masters`.
fn spawn_agent(dir: &Path, n: usize, masters: &str, opts: AgentOpts) -> (Daemon, AgentArgs) {
    let started = agent_args(dir, n, masters, opts);
    (respawn_agent(dir, n, &started), started)
}

/// The arguments and environment of test agent `n` (work dir
/// `dir/agent{n}`), for fixtures that start it their own way.
pub fn agent_args(dir: &Path, n: usize, masters: &str, opts: AgentOpts) -> AgentArgs {
    let work = dir.join(format!("agent{n}"));
    let mut args = vec![
        "--master".to_string(),
        masters.to_string(),
        "--work-dir".into(),
        work.display().to_string(),
        "--listen".into(),
        format!("127.0.0.1:{}", free_port()),
        "--runtime".into(),
        opts.runtime.into(),
        "--kill-grace-secs".into(),
        "2".into(),
    ];
    if opts.stop_tasks_on_shutdown {
        args.push("--stop-tasks-on-shutdown".into());
    }
    if let Some(s) = opts.simulate_gpus {
        args.push("--simulate-gpus".into());
        args.push(s.into());
    }
    if !opts
        .extra
        .iter()
        .any(|a| a.starts_with("--cdi-dir") || a == "--no-cdi")
    {
        args.push("--cdi-dir".into());
        args.push(agent_cdi_dir(dir, n).display().to_string());
    }
    args.extend(opts.extra);
    (args, opts.env)
}

/// Starts agent `n` again with the arguments it was first started with.
fn respawn_agent(dir: &Path, n: usize, (args, env): &AgentArgs) -> Daemon {
    Daemon::spawn(
        &format!("agent{n}"),
        &bin("gpuctl-agent"),
        args,
        env,
        dir.join(format!("agent{n}.log")),
    )
}

fn agent_ids(agents: &[Value]) -> Vec<String> {
    agents
        .iter()
        .filter_map(|a| a["id"].as_str().map(str::to_string))
        .collect()
}

/// Waits until an agent not in `before` is ACTIVE in `list()`; its id.
fn wait_new_agent(before: &[String], list: impl Fn() -> Vec<Value>) -> String {
    let mut id = String::new();
    wait_for(Duration::from_secs(30), "agent registers", || {
        let found = list()
            .into_iter()
            .find(|a| a["state"] == "ACTIVE" && !before.iter().any(|b| a["id"] == b.as_str()));
        if let Some(a) = found {
            id = a["id"].as_str().unwrap_or_default().to_string();
        }
        !id.is_empty()
    });
    id
}

pub fn tail(s: &str, lines: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// Polls `f` every 100 ms until it is true or `timeout` passes.
pub fn try_wait_for(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn wait_for(timeout: Duration, what: &str, f: impl FnMut() -> bool) {
    assert!(try_wait_for(timeout, f), "timed out waiting until {what}");
}

/// Containers (running or not) carrying `label=value`.
/// The containers of one agent's task. Task ids repeat across test
/// clusters (every cluster has a `job-1.0`), so the agent's label is needed
/// too.
pub fn task_containers(agent_id: &str, task_id: &str) -> Vec<String> {
    let out = Command::new("docker")
        .args([
            "ps",
            "-aq",
            "--filter",
            &format!("label=gpuctl.agent_id={agent_id}"),
            "--filter",
            &format!("label=gpuctl.task_id={task_id}"),
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

pub fn containers_with_label(label: &str, value: &str) -> Vec<String> {
    let out = Command::new("docker")
        .args(["ps", "-aq", "--filter", &format!("label={label}={value}")])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// NVIDIA-style device nodes in `dir` (mknod, needs root): `nvidia0..n`
/// (major 195), `nvidiactl` (195:255), `nvidia-uvm` and `nvidia-uvm-tools`
/// (major 240, free on hosts without the driver, as uvm's major is dynamic).
/// With no driver behind them, opening an allowed node fails with ENXIO
/// and a denied one with EPERM.
pub fn make_dev_root(dir: &Path, gpus: u32) {
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    std::fs::create_dir_all(dir).unwrap();
    let mk = |name: &str, maj: u64, min: u64| {
        mknod(
            &dir.join(name),
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            makedev(maj, min),
        )
        .unwrap_or_else(|e| panic!("mknod {name}: {e}"));
    };
    for i in 0..gpus {
        mk(&format!("nvidia{i}"), 195, u64::from(i));
    }
    mk("nvidiactl", 195, 255);
    mk("nvidia-uvm", 240, 0);
    mk("nvidia-uvm-tools", 240, 1);
}

/// A fake NVIDIA driver under `root`: tiny shared objects built with gcc
/// (libnvidia-ml, libcuda, libnvidia-ptxjitcompiler), `nvidia-smi` in
/// usr/bin, and an ld.so cache written by the real `ldconfig -r root`.
pub fn make_driver_tree(root: &Path, version: &str) {
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::create_dir_all(root.join("usr/bin")).unwrap();
    std::fs::create_dir_all(root.join("etc")).unwrap();
    let src = root.join("empty.c");
    std::fs::write(&src, "int gpuctl_fake_driver_symbol = 1;\n").unwrap();
    for soname in [
        "libnvidia-ml.so.1",
        "libcuda.so.1",
        "libnvidia-ptxjitcompiler.so.1",
    ] {
        let base = soname.trim_end_matches(".1");
        let out = lib.join(format!("{base}.{version}"));
        let status = Command::new("gcc")
            .args(["-shared", "-fPIC", &format!("-Wl,-soname,{soname}"), "-o"])
            .arg(&out)
            .arg(&src)
            .status()
            .expect("gcc (needed to build the fake driver's libraries)");
        assert!(status.success(), "gcc failed for {soname}");
    }
    let smi = root.join("usr/bin/nvidia-smi");
    std::fs::write(&smi, "#!/bin/sh\necho fake nvidia-smi\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(root.join("etc/ld.so.conf"), "/usr/lib/x86_64-linux-gnu\n").unwrap();
    let status = Command::new("ldconfig")
        .arg("-r")
        .arg(root)
        .status()
        .expect("ldconfig");
    assert!(status.success(), "ldconfig -r {} failed", root.display());
    assert!(root.join("etc/ld.so.cache").exists());
}

/// Whether cgroup v1 with the devices controller is mounted (the isolation
/// tests need it; with GPUCTL_REQUIRE_DOCKER=1 its absence is a failure).
pub fn cgroup_v1_or_skip(test: &str) -> bool {
    let ok = Path::new("/sys/fs/cgroup/devices/devices.allow").exists();
    if !ok {
        if std::env::var("GPUCTL_REQUIRE_DOCKER").as_deref() == Ok("1") {
            panic!("{test}: cgroup v1 devices controller required (GPUCTL_REQUIRE_DOCKER=1)");
        }
        eprintln!("skipped: {test}: needs cgroup v1 with the devices controller");
    }
    ok
}

/// Task cgroup directories left in any hierarchy.
pub fn cgroup_dirs(parent: &str, task_id: &str) -> Vec<PathBuf> {
    std::fs::read_dir("/sys/fs/cgroup")
        .map(|d| {
            d.flatten()
                .map(|e| e.path().join(parent).join(task_id))
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}

/// A live process of a gpuctl task, seen from outside gpuctl: every process
/// on the host (container processes included) whose environment carries
/// `GPUCTL_TASK_ID`, read from `/proc/<pid>/environ`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveTask {
    pub pid: i32,
    pub task_id: String,
    pub job_id: String,
    pub gpus: Vec<String>,
    /// Its cgroup in the v1 devices hierarchy (`/proc/<pid>/cgroup`), when
    /// it is in a gpuctl task cgroup (`.../gpuctl/<agent>/<task>[/...]`).
    pub task_cgroup: Option<String>,
}

/// The gpuctl task cgroup a process is in, from `/proc/<pid>/cgroup`'s
/// devices line: the path below `/gpuctl/<agent-id>/`, i.e. `<task-id>`
/// (a container's own cgroup nested inside it counts as the task's).
pub fn devices_task_cgroup(proc_cgroup: &str) -> Option<String> {
    proc_cgroup.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
        if !ctrls.split(',').any(|c| c == "devices") {
            return None;
        }
        let rest = path.split("/gpuctl/").nth(1)?;
        let mut comps = rest.split('/');
        let _agent = comps.next()?;
        comps.next().filter(|t| !t.is_empty()).map(str::to_string)
    })
}

/// A marker value for one test's jobs (`--env MARKER=value`), unique across
/// test processes, so that [`live_tasks`] sees that test's tasks only.
pub fn test_marker(test: &str) -> String {
    format!("{test}-{}", std::process::id())
}

/// The live task processes whose environment has `marker=value` (a test's
/// own jobs, submitted with `--env marker=value`).
pub fn live_tasks(marker: &str, value: &str) -> Vec<LiveTask> {
    let want = format!("{marker}={value}");
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        // Zombies have ended: they hold nothing.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        {
            continue;
        }
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let vars: Vec<String> = env
            .split(|b| *b == 0)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .collect();
        if !vars.contains(&want) {
            continue;
        }
        let get = |k: &str| {
            vars.iter()
                .find_map(|v| v.strip_prefix(&format!("{k}=")).map(str::to_string))
                .unwrap_or_default()
        };
        let task_cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .ok()
            .and_then(|c| devices_task_cgroup(&c));
        out.push(LiveTask {
            pid,
            task_cgroup,
            task_id: get("GPUCTL_TASK_ID"),
            job_id: get("GPUCTL_JOB_ID"),
            gpus: get("GPUCTL_GPUS")
                .split(',')
                .filter(|g| !g.is_empty())
                .map(str::to_string)
                .collect(),
        });
    }
    out
}

/// What breaks gpuctl's promise in one sample of live tasks: a GPU used by
/// two live tasks, a job with two live tasks at once, or a task's process in
/// another task's cgroup (whose device rules are not its own).
pub fn invariant_violations(live: &[LiveTask]) -> Vec<String> {
    let mut gpu_tasks: std::collections::BTreeMap<&str, std::collections::BTreeSet<&str>> =
        Default::default();
    let mut job_tasks: std::collections::BTreeMap<&str, std::collections::BTreeSet<&str>> =
        Default::default();
    for t in live {
        for g in &t.gpus {
            gpu_tasks.entry(g).or_default().insert(&t.task_id);
        }
        // A framework's tasks belong to no job.
        if !t.job_id.is_empty() {
            job_tasks.entry(&t.job_id).or_default().insert(&t.task_id);
        }
    }
    let mut out = Vec::new();
    for t in live {
        if let Some(cg) = t.task_cgroup.as_deref().filter(|cg| *cg != t.task_id) {
            out.push(format!(
                "process {} of task {} is in task {cg}'s cgroup",
                t.pid, t.task_id
            ));
        }
    }
    for (g, tasks) in gpu_tasks.iter().filter(|(_, t)| t.len() > 1) {
        out.push(format!("GPU {g} used by live tasks {tasks:?}"));
    }
    for (j, tasks) in job_tasks.iter().filter(|(_, t)| t.len() > 1) {
        out.push(format!("job {j} runs twice at once: {tasks:?}"));
    }
    out
}

/// Samples the live tasks of a test (see [`live_tasks`]) every 50 ms on a
/// thread of its own until [`InvariantWatch::finish`], collecting every
/// violation of [`invariant_violations`] and what it saw.
pub struct InvariantWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: Option<std::thread::JoinHandle<Watched>>,
}

/// What an [`InvariantWatch`] saw over its whole run.
#[derive(Debug, Default)]
pub struct Watched {
    pub samples: usize,
    pub violations: Vec<String>,
    /// Every task seen live, with the GPUs it was given (`GPUCTL_GPUS`).
    pub tasks: std::collections::BTreeMap<String, Vec<String>>,
    /// The most tasks live in one sample.
    pub most_at_once: usize,
}

impl InvariantWatch {
    pub fn start(marker: &str, value: &str) -> InvariantWatch {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (marker, value, flag) = (marker.to_string(), value.to_string(), stop.clone());
        let handle = std::thread::spawn(move || {
            let mut w = Watched::default();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let live = live_tasks(&marker, &value);
                for v in invariant_violations(&live) {
                    if !w.violations.contains(&v) {
                        w.violations.push(v);
                    }
                }
                let at_once: std::collections::BTreeSet<&str> =
                    live.iter().map(|t| t.task_id.as_str()).collect();
                w.most_at_once = w.most_at_once.max(at_once.len());
                for t in live {
                    w.tasks.entry(t.task_id).or_insert(t.gpus);
                }
                w.samples += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            w
        });
        InvariantWatch {
            stop,
            handle: Some(handle),
        }
    }

    /// Stops sampling and fails the test on any violation seen, or when too
    /// few samples were taken for the check to mean anything. Returns what
    /// it saw, for the test's own checks.
    pub fn assert_held(self) -> Watched {
        let w = self.finish();
        assert!(
            w.samples > 10,
            "the invariant watcher took only {} samples",
            w.samples
        );
        assert!(
            w.violations.is_empty(),
            "GPU invariant broken: {:#?}",
            w.violations
        );
        w
    }

    /// Stops sampling; returns what it saw.
    pub fn finish(mut self) -> Watched {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.handle
            .take()
            .map(|h| h.join().unwrap())
            .unwrap_or_default()
    }
}

/// A master with mutual TLS and tokens (`gpuctl certs init`) and one agent
/// that joined it with a join token, in one temp dir; gpuctl runs as the
/// bootstrap admin (`pki/gpuctl.toml`).
pub struct SecureSingle {
    pub dir: tempfile::TempDir,
    /// What `gpuctl certs init` wrote.
    pub pki: PathBuf,
    pub addr: String,
    pub master: Daemon,
    pub agent: Daemon,
    /// The agent's TLS dir (`ca.crt`, and `agent.pem` once joined).
    pub agent_tls: PathBuf,
    /// The agent's arguments, to start it again.
    pub agent_args: Vec<String>,
}

impl SecureSingle {
    /// `master_extra`: more flags for the master; the agent has simulated
    /// GPUs (`gpus`, e.g. "2xA100-SXM4-40GB") and the process runtime.
    pub fn start(master_extra: &[&str], gpus: &str) -> SecureSingle {
        SecureSingle::start_in(test_dir(), master_extra, gpus)
    }

    /// [`SecureSingle::start`] in `dir` (one outside `/tmp`, say, whose
    /// paths host tasks then see as they are rather than behind their
    /// private `/tmp`).
    pub fn start_in(dir: tempfile::TempDir, master_extra: &[&str], gpus: &str) -> SecureSingle {
        let pki = dir.path().join("pki");
        let addr = format!("127.0.0.1:{}", free_port());
        let out = Command::new(bin("gpuctl"))
            .args(["certs", "init", "--dir"])
            .arg(&pki)
            .args(["--for-master", &addr])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut args = vec![
            "--listen".to_string(),
            addr.clone(),
            "--data-dir".into(),
            dir.path().join("m").display().to_string(),
            "--tls-dir".into(),
            pki.display().to_string(),
        ];
        args.extend(master_extra.iter().map(|s| s.to_string()));
        let master = Daemon::spawn(
            "master",
            &bin("gpuctl-master"),
            &args,
            &[],
            dir.path().join("master.log"),
        );
        let config = pki.join("gpuctl.toml");
        wait_for(Duration::from_secs(30), "master serves", || {
            secure_gpuctl(&config, &["whoami"]).status.success()
        });
        let join = secure_gpuctl(&config, &["tokens", "create", "--join"]);
        assert!(join.status.success());
        let join = String::from_utf8_lossy(&join.stdout).trim().to_string();
        let agent_tls = dir.path().join("agent-tls");
        std::fs::create_dir_all(&agent_tls).unwrap();
        std::fs::copy(pki.join("ca.crt"), agent_tls.join("ca.crt")).unwrap();
        let agent_args: Vec<String> = [
            "--master",
            &addr,
            "--work-dir",
            &dir.path().join("agent").display().to_string(),
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
            "--runtime",
            "process",
            "--simulate-gpus",
            gpus,
            "--stop-tasks-on-shutdown",
            "--tls-dir",
            &agent_tls.display().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let agent = Daemon::spawn(
            "agent",
            &bin("gpuctl-agent"),
            &agent_args,
            &[("GPUCTL_AGENT_JOIN_TOKEN".into(), join)],
            dir.path().join("agent.log"),
        );
        let c = SecureSingle {
            dir,
            pki,
            addr,
            master,
            agent,
            agent_tls,
            agent_args,
        };
        wait_for(Duration::from_secs(30), "agent joined", || c.agent_active());
        c
    }

    /// gpuctl as the bootstrap admin.
    pub fn gpuctl(&self, args: &[&str]) -> Output {
        secure_gpuctl(&self.pki.join("gpuctl.toml"), args)
    }

    /// gpuctl as the admin; asserts success, returns stdout trimmed.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.gpuctl(args);
        assert!(
            out.status.success(),
            "gpuctl {args:?}: {}\n--- master ---\n{}\n--- agent ---\n{}",
            String::from_utf8_lossy(&out.stderr),
            tail(&self.master.log_text(), 20),
            tail(&self.agent.log_text(), 20)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Whether the one agent is registered and ACTIVE.
    pub fn agent_active(&self) -> bool {
        let out = self.gpuctl(&["agents", "list", "--json"]);
        serde_json::from_slice::<Value>(&out.stdout)
            .ok()
            .and_then(|v| v.as_array().cloned())
            .is_some_and(|a| a.len() == 1 && a[0]["state"] == "ACTIVE")
    }

    /// Starts the agent again (after it was killed), without a join token.
    pub fn restart_agent(&mut self) {
        self.agent.kill();
        self.agent = Daemon::spawn(
            "agent",
            &bin("gpuctl-agent"),
            &self.agent_args,
            &[],
            self.dir.path().join("agent.log"),
        );
    }
}

/// Starts masters 1..=`n` with mutual TLS in `dir`: `gpuctl certs init`
/// into `dir/pki` (the CA, a certificate per master, the admin's client
/// certificate, `bootstrap.token`, `gpuctl.toml`), then each master on a
/// free loopback port with `extra` flags. Returns the pki dir and each
/// master's id, address and process; they are not waited for.
pub fn start_secure_masters(
    dir: &Path,
    n: u64,
    extra: &[&str],
) -> (PathBuf, Vec<(u64, String, Daemon)>) {
    let pki = dir.join("pki");
    let addrs: Vec<(u64, String)> = (1..=n)
        .map(|id| (id, format!("127.0.0.1:{}", free_port())))
        .collect();
    let join =
        |f: &dyn Fn(&(u64, String)) -> String| addrs.iter().map(f).collect::<Vec<_>>().join(",");
    let ids = join(&|(id, _)| id.to_string());
    let all = join(&|(_, a)| a.clone());
    let peers = join(&|(id, a)| format!("{id}={a}"));
    let out = Command::new(bin("gpuctl"))
        .args(["certs", "init", "--dir"])
        .arg(&pki)
        .args(["--masters", &ids, "--for-master", &all])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let masters = addrs
        .into_iter()
        .map(|(id, addr)| {
            let mut args: Vec<String> = [
                "--node-id",
                &id.to_string(),
                "--listen",
                &addr,
                "--peers",
                &peers,
                "--data-dir",
                &dir.join(format!("m{id}")).display().to_string(),
                "--tls-dir",
                &pki.display().to_string(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            args.extend(extra.iter().map(|s| s.to_string()));
            let d = Daemon::spawn(
                &format!("master{id}"),
                &bin("gpuctl-master"),
                &args,
                &[],
                dir.join(format!("master{id}.log")),
            );
            (id, addr, d)
        })
        .collect();
    (pki, masters)
}

/// Runs `gpuctl --config CONFIG args...`, ignoring the caller's GPUCTL_*.
pub fn secure_gpuctl(config: &Path, args: &[&str]) -> Output {
    Command::new(bin("gpuctl"))
        .arg("--config")
        .arg(config)
        .args(args)
        .env_remove("GPUCTL_TOKEN")
        .env_remove("GPUCTL_MASTER")
        .env_remove("GPUCTL_TLS_DIR")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// tests/fake-mps's stand-in `nvidia-cuda-mps-control`.
pub fn fake_mps_control() -> PathBuf {
    workspace_root().join("tests/fake-mps/nvidia-cuda-mps-control")
}

/// Kills the MPS daemons an agent with work dir `work` left (an agent
/// killed by a test does not stop them, as a real one does not) and
/// unmounts their shm, so nothing of a test outlives it (a [`Cluster`]
/// does this for its agents when dropped).
pub fn stop_mps_daemons(work: &Path) {
    let root = work.join("mps");
    for gpu in std::fs::read_dir(&root).into_iter().flatten().flatten() {
        for tenant in std::fs::read_dir(gpu.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let dir = tenant.path();
            let pid = std::fs::read_to_string(dir.join("pipe/nvidia-cuda-mps-control.pid"))
                .ok()
                .and_then(|p| p.trim().parse::<i32>().ok());
            if let Some(pid) = pid.filter(|p| *p > 1) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            let _ = nix::mount::umount2(&dir.join("shm"), nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// The pid in an MPS daemon's pid file (`<pipe>/nvidia-cuda-mps-control.pid`),
/// when it names a live process (not a zombie).
pub fn mps_daemon_pid(pipe: &Path) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let state = stat.rsplit_once(')')?.1.trim().chars().next()?;
    (state != 'Z').then_some(pid)
}

/// The MPS daemon directories an agent (work dir `work`) made for GPU
/// `gpu`: `<work>/mps/<gpu>/<tenant>.<user>`, one per daemon group.
pub fn mps_groups(work: &Path, gpu: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(work.join("mps").join(gpu))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .collect();
    out.sort();
    out
}

/// A daemon group's pipe directory: what its `pipe` link names (the
/// directory itself has a short name of its own, for the daemon's sockets).
pub fn mps_pipe(group: &Path) -> PathBuf {
    let link = group.join("pipe");
    std::fs::read_link(&link).unwrap_or(link)
}

/// A running task container, as Docker (not gpuctl) reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningContainer {
    pub id: String,
    /// Its main process on the host (`State.Pid`).
    pub pid: i32,
    /// The host directory mounted at `/run/nvidia-mps`: the MPS daemon
    /// whose client it is; empty when none.
    pub mps_pipe: String,
}

/// The running containers of agent `agent_id`, by task id, from `docker
/// ps` and `docker inspect`; `None` when Docker does not answer (each call
/// bounded, as a dead daemon's socket may hang the CLI). Asked up to three
/// times: a container removed between the two calls fails the inspect.
pub fn running_task_containers(
    agent_id: &str,
) -> Option<std::collections::BTreeMap<String, RunningContainer>> {
    (0..3).find_map(|_| running_task_containers_once(agent_id))
}

fn running_task_containers_once(
    agent_id: &str,
) -> Option<std::collections::BTreeMap<String, RunningContainer>> {
    let docker = |args: &[&str]| {
        let out = Command::new("timeout")
            .args(["10", "docker"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let label = format!("label=gpuctl.agent_id={agent_id}");
    let ids = docker(&[
        "ps",
        "-q",
        "--no-trunc",
        "--filter",
        &label,
        "--filter",
        "status=running",
    ])?;
    let ids: Vec<&str> = ids.split_whitespace().collect();
    let mut out = std::collections::BTreeMap::new();
    if ids.is_empty() {
        return Some(out);
    }
    let format = concat!(
        "{{.Id}} {{.State.Running}} {{.State.Pid}} {{index .Config.Labels \"gpuctl.task_id\"}} ",
        "{{range .Mounts}}{{if eq .Destination \"/run/nvidia-mps\"}}{{.Source}}{{end}}{{end}}"
    );
    let mut args = vec!["inspect", "-f", format];
    args.extend(&ids);
    let text = docker(&args)?;
    for line in text.lines() {
        let mut f = line.split_whitespace();
        let (Some(id), Some(running), Some(pid), Some(task)) =
            (f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        if running != "true" {
            continue;
        }
        out.insert(
            task.to_string(),
            RunningContainer {
                id: id.to_string(),
                pid: pid.parse().unwrap_or(0),
                mps_pipe: f.next().unwrap_or_default().to_string(),
            },
        );
    }
    Some(out)
}

/// Whether `pid` is a process that has not ended (neither gone nor a
/// zombie).
pub fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

/// A cgroup2 hierarchy mounted on a temp dir beside the machine's v1 one
/// (the same unified hierarchy at every mount): on drop, what a test made
/// under `top` is removed, deepest first, and it is unmounted.
pub struct Cgroup2 {
    mnt: tempfile::TempDir,
    /// Top directory made under it by the test.
    top: String,
}

impl Cgroup2 {
    /// `None` when cgroup2 cannot be mounted here.
    pub fn mount(top: &str) -> Option<Cgroup2> {
        let mnt = test_dir();
        let ok = Command::new("mount")
            .args(["-t", "cgroup2", "none"])
            .arg(mnt.path())
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Cgroup2 {
            mnt,
            top: top.to_string(),
        })
    }

    pub fn path(&self) -> &Path {
        self.mnt.path()
    }
}

impl Drop for Cgroup2 {
    fn drop(&mut self) {
        let mut dirs: Vec<PathBuf> = vec![];
        let mut stack = vec![self.mnt.path().join(&self.top)];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                if e.path().is_dir() {
                    stack.push(e.path());
                }
            }
            dirs.push(d);
        }
        for d in dirs.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
        let _ = Command::new("umount").arg(self.mnt.path()).status();
    }
}

#[cfg(test)]
mod invariant_tests {
    use super::*;

    #[test]
    fn task_cgroups_are_read_from_proc_cgroup_lines() {
        let text = "12:devices:/gpuctl/vm-1/job-3.0\n3:memory:/gpuctl/vm-1/job-3.0\n";
        assert_eq!(devices_task_cgroup(text), Some("job-3.0".into()));
        // A container's cgroup nested in the task's (cgroup parent).
        let nested = "5:devices:/gpuctl/vm-1/job-4.0/0123abcd\n";
        assert_eq!(devices_task_cgroup(nested), Some("job-4.0".into()));
        assert_eq!(devices_task_cgroup("5:devices:/user.slice\n"), None);
        assert_eq!(devices_task_cgroup("4:cpu,cpuacct:/gpuctl/a/t\n"), None);
    }

    fn t(pid: i32, task: &str, job: &str, gpus: &[&str]) -> LiveTask {
        LiveTask {
            pid,
            task_cgroup: Some(task.into()),
            task_id: task.into(),
            job_id: job.into(),
            gpus: gpus.iter().map(|g| g.to_string()).collect(),
        }
    }

    #[test]
    fn violations_are_found() {
        // Several processes of one task sharing its GPU are fine.
        let ok = [
            t(1, "j1.0", "j1", &["g0"]),
            t(2, "j1.0", "j1", &["g0"]),
            t(3, "j2.0", "j2", &["g1"]),
        ];
        assert!(invariant_violations(&ok).is_empty());
        let shared = [t(1, "j1.0", "j1", &["g0"]), t(2, "j2.0", "j2", &["g0"])];
        assert_eq!(invariant_violations(&shared).len(), 1);
        let mut wrong = t(1, "j1.0", "j1", &["g0"]);
        wrong.task_cgroup = Some("j2.0".into());
        assert_eq!(
            invariant_violations(&[wrong]),
            vec!["process 1 of task j1.0 is in task j2.0's cgroup".to_string()]
        );
        let twice = [t(1, "j1.0", "j1", &[]), t(2, "j1.1", "j1", &[])];
        assert_eq!(
            invariant_violations(&twice),
            vec!["job j1 runs twice at once: {\"j1.0\", \"j1.1\"}".to_string()]
        );
    }

    #[test]
    fn live_tasks_are_read_from_proc() {
        let marker = format!("m{}", std::process::id());
        let mut child = Command::new("sleep")
            .arg("30")
            .env("GPUCTL_INVARIANT_TEST", &marker)
            .env("GPUCTL_TASK_ID", "job-9.0")
            .env("GPUCTL_JOB_ID", "job-9")
            .env("GPUCTL_GPUS", "GPU-a,GPU-b")
            .spawn()
            .unwrap();
        // Until the child has exec'd, its environ is still ours.
        let mut live = Vec::new();
        let found = try_wait_for(Duration::from_secs(5), || {
            live = live_tasks("GPUCTL_INVARIANT_TEST", &marker);
            !live.is_empty()
        });
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(found, "the child never showed up in /proc");
        assert_eq!(
            live,
            vec![LiveTask {
                pid: child.id() as i32,
                task_cgroup: None,
                task_id: "job-9.0".into(),
                job_id: "job-9".into(),
                gpus: vec!["GPU-a".into(), "GPU-b".into()],
            }]
        );
        assert!(live_tasks("GPUCTL_INVARIANT_TEST", &marker).is_empty());
    }
}

#[cfg(test)]
mod cargo_tests {
    #[test]
    fn nested_cargo_drops_what_cargo_set_for_the_test_and_keeps_what_the_user_set() {
        for key in [
            "CARGO_MANIFEST_DIR",
            "CARGO_PKG_NAME",
            "CARGO_PKG_VERSION_MAJOR",
            "OUT_DIR",
            "CARGO_BIN_EXE_gpuctl",
        ] {
            assert!(super::is_crate_variable(key), "{key}");
        }
        for key in [
            "CARGO_HOME",
            "CARGO_TARGET_DIR",
            "CARGO_BUILD_JOBS",
            "CARGO",
            "RUSTFLAGS",
            "PATH",
        ] {
            assert!(!super::is_crate_variable(key), "{key}");
        }
        // This test runs under cargo, which set CARGO_MANIFEST_DIR for it.
        assert!(std::env::var_os("CARGO_MANIFEST_DIR").is_some());
        let cmd = super::cargo();
        assert!(cmd
            .get_envs()
            .any(|(k, v)| k == "CARGO_MANIFEST_DIR" && v.is_none()));
    }
}
