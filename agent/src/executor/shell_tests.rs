//! The executor's shell with an in-memory runtime: launch, report, forget,
//! recovery after a restart, the fence and a runtime that is down, without
//! processes or Docker (those are in `agent/tests` and `tests/`).

use super::*;
use crate::runtime::{Ended, LaunchSpec, Observed, RuntimeStatus};
use futures::future::BoxFuture;
use futures::FutureExt;
use gpuctl_core::types::{IdRanges, Resources};

/// Tasks by id; `Ended` ones end their `wait`.
#[derive(Default)]
struct Fake {
    tasks: Mutex<BTreeMap<String, Observed>>,
    /// Starts that fail as Unavailable before one succeeds.
    down_for: Mutex<u32>,
    changed: tokio::sync::Notify,
    /// What each task was started with.
    launched: Mutex<BTreeMap<String, LaunchSpec>>,
    /// Removals that fail (as a daemon still busy with one) before one works.
    remove_fails: Mutex<u32>,
    /// The exit code of each check command run beside a task (`exec`);
    /// 0 when not set, the runtime down when negative.
    exec_codes: Mutex<BTreeMap<String, i32>>,
}

impl Fake {
    fn set(&self, id: &str, o: Observed) {
        self.tasks.lock().unwrap().insert(id.into(), o);
        self.changed.notify_waiters();
    }
    fn get(&self, id: &str) -> Observed {
        self.tasks
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .unwrap_or(Observed::NotStarted)
    }
}

/// The fake, standing in for the runtime of this kind.
struct FakeRuntime(Arc<Fake>, Runtime);

impl ContainerRuntime for FakeRuntime {
    fn kind(&self) -> Runtime {
        self.1
    }
    fn start<'a>(
        &'a self,
        spec: &'a LaunchSpec,
    ) -> BoxFuture<'a, Result<(), crate::runtime::RuntimeError>> {
        let mut down = self.0.down_for.lock().unwrap();
        if *down > 0 {
            *down -= 1;
            return futures::future::ready(Err(crate::runtime::RuntimeError::Unavailable {
                runtime: Runtime::Process,
                reason: "down".into(),
            }))
            .boxed();
        }
        drop(down);
        self.0
            .launched
            .lock()
            .unwrap()
            .insert(spec.task.task_id.clone(), spec.clone());
        if self.0.get(&spec.task.task_id) == Observed::NotStarted {
            self.0.set(&spec.task.task_id, Observed::Running);
        }
        futures::future::ready(Ok(())).boxed()
    }
    fn observe<'a>(
        &'a self,
        t: &'a TaskRef,
    ) -> BoxFuture<'a, Result<Observed, crate::runtime::RuntimeError>> {
        futures::future::ready(Ok(self.0.get(&t.task_id))).boxed()
    }
    fn wait<'a>(
        &'a self,
        t: &'a TaskRef,
    ) -> BoxFuture<'a, Result<Ended, crate::runtime::RuntimeError>> {
        async move {
            loop {
                let notified = self.0.changed.notified();
                if let Observed::Ended(e) = self.0.get(&t.task_id) {
                    return Ok(e);
                }
                notified.await;
            }
        }
        .boxed()
    }
    fn stop<'a>(
        &'a self,
        t: &'a TaskRef,
        _g: Duration,
    ) -> BoxFuture<'a, Result<(), crate::runtime::RuntimeError>> {
        self.0.set(
            &t.task_id,
            Observed::Ended(Ended {
                code: Some(143),
                ..Default::default()
            }),
        );
        futures::future::ready(Ok(())).boxed()
    }
    fn remove<'a>(
        &'a self,
        _t: &'a TaskRef,
    ) -> BoxFuture<'a, Result<(), crate::runtime::RuntimeError>> {
        let mut fails = self.0.remove_fails.lock().unwrap();
        if *fails > 0 {
            *fails -= 1;
            return futures::future::ready(Err(crate::runtime::RuntimeError::Unavailable {
                runtime: Runtime::Process,
                reason: "removal already in progress".into(),
            }))
            .boxed();
        }
        futures::future::ready(Ok(())).boxed()
    }
    fn list<'a>(
        &'a self,
        _a: &'a str,
    ) -> BoxFuture<'a, Result<Vec<String>, crate::runtime::RuntimeError>> {
        futures::future::ready(Ok(Vec::new())).boxed()
    }
    fn status(&self) -> RuntimeStatus {
        RuntimeStatus {
            available: true,
            message: String::new(),
        }
    }
    fn exec<'a>(
        &'a self,
        _t: &'a TaskRef,
        command: &'a str,
        _timeout: Duration,
    ) -> BoxFuture<'a, Result<crate::runtime::ExecOutput, crate::runtime::RuntimeError>> {
        let code = self
            .0
            .exec_codes
            .lock()
            .unwrap()
            .get(command)
            .copied()
            .unwrap_or(0);
        if code < 0 {
            return futures::future::ready(Err(crate::runtime::RuntimeError::Unavailable {
                runtime: Runtime::Docker,
                reason: "restarting".into(),
            }))
            .boxed();
        }
        let out = crate::runtime::ExecOutput::new(Some(code), format!("said {code}\n").as_bytes());
        futures::future::ready(Ok(out)).boxed()
    }
}

struct Harness {
    dir: tempfile::TempDir,
    fake: Arc<Fake>,
    exec: Arc<Executor>,
    updates: mpsc::Receiver<StatusUpdate>,
}

/// An executor on `dir` (a new agent process on the same work dir).
fn harness_on(dir: tempfile::TempDir, fake: Arc<Fake>) -> Harness {
    let isolator = no_isolation(dir.path());
    harness_with(dir, fake, isolator, HashMap::new())
}

/// No cgroup hierarchy and no NVIDIA devices under `dir`: nothing to
/// isolate (a host with simulated GPUs).
fn no_isolation(dir: &std::path::Path) -> Arc<dyn Isolator> {
    Arc::new(
        crate::isolation::CgroupIsolator::new(
            &dir.join("no-cgroups"),
            "gpuctl/a1",
            &dir.join("dev"),
            true,
        )
        .unwrap(),
    )
}

/// An executor with this isolator and these GPUs and MIG devices.
fn harness_with(
    dir: tempfile::TempDir,
    fake: Arc<Fake>,
    isolator: Arc<dyn Isolator>,
    gpu_grants: HashMap<String, crate::isolation::DeviceGrant>,
) -> Harness {
    let mut runtimes: BTreeMap<Runtime, Arc<dyn ContainerRuntime>> = BTreeMap::new();
    for kind in [Runtime::Process, Runtime::Docker] {
        runtimes.insert(kind, Arc::new(FakeRuntime(fake.clone(), kind)));
    }
    // Two users of their own for host tasks.
    let users = IdRanges::parse("80000-80001").unwrap();
    let (tx, updates) = mpsc::channel(64);
    let exec = Executor::new(
        "a1".into(),
        dir.path().to_path_buf(),
        runtimes,
        Duration::from_secs(1),
        Duration::from_secs(3600),
        IsolationSetup {
            isolator,
            gpu_grants: Arc::new(std::sync::RwLock::new(gpu_grants)),
            driver_volume: None,
            policy: crate::security::TaskPolicy::new(
                crate::security::DEFAULT_TASK_USER,
                false,
                Vec::new(),
                gpuctl_core::types::UserIds { uid: 0, gid: 0 },
            )
            .with_users(users.clone(), IdRanges::parse("1000-59999").unwrap()),
            cdi: Default::default(),
            driver: Default::default(),
            // The host's own ids are not the executor's business here:
            // another agent on this machine (a demo, another test run)
            // runs tasks as ids of the same range.
            users: crate::task_users::TaskUsers::new(users, dir.path())
                .with_host_ids(crate::task_users::HostIds::default),
            mps: Arc::new(crate::gpu::mps::Mps::new(None, dir.path().join("mps"))),
            memcap: Arc::new(crate::gpu::memcap::DriverCap::off(
                dir.path().join("memcap"),
            )),
            cap_socket: None,
            cap_runtime: None,
            preflight: None,
        },
        tx,
    );
    Harness {
        dir,
        fake,
        exec,
        updates,
    }
}

fn spec(id: &str) -> TaskSpec {
    TaskSpec {
        share: None,
        task_id: id.into(),
        job_id: "job-1".into(),
        framework_id: String::new(),
        gpu_uuids: vec![],
        template: gpuctl_core::types::TaskTemplate {
            stop_grace_ms: None,
            checkpoint_dir: None,
            image: None,
            command: vec!["true".into()],
            env: BTreeMap::new(),
            resources: Resources::default(),
            no_fence: false,
            security: Default::default(),
            hang_timeout_ms: None,
            preflight: false,
            options: Default::default(),
        },
    }
}

fn wants(ids: &[&str], kill: &[&str]) -> Desired {
    Desired {
        run: ids.iter().map(|i| (i.to_string(), spec(i))).collect(),
        kill: kill.iter().map(|k| k.to_string()).collect(),
        notices: Default::default(),
    }
}

/// The next update, or a failure after 5 s.
async fn next(h: &mut Harness) -> StatusUpdate {
    tokio::time::timeout(Duration::from_secs(5), h.updates.recv())
        .await
        .expect("no update within 5 s")
        .expect("channel closed")
}

async fn until_state(h: &mut Harness, state: TaskState) -> StatusUpdate {
    loop {
        let u = next(h).await;
        if u.state == state {
            return u;
        }
    }
}

#[tokio::test]
async fn a_task_runs_ends_is_acknowledged_and_forgotten() {
    let mut h = harness_on(tempfile::tempdir().unwrap(), Arc::default());
    h.exec.set_desired(wants(&["t1"], &[]));
    assert_eq!(next(&mut h).await.state, TaskState::Starting);
    assert_eq!(next(&mut h).await.state, TaskState::Running);
    h.fake.set(
        "t1",
        Observed::Ended(Ended {
            code: Some(3),
            ..Default::default()
        }),
    );
    let fin = next(&mut h).await;
    assert_eq!((fin.state, fin.exit_code), (TaskState::Failed, Some(3)));
    let state_dir = h.dir.path().join("state/t1");
    let saved: StatusUpdate = checkpoint::read_json(&state_dir.join(checkpoint::FINAL_FILE))
        .unwrap()
        .unwrap();
    assert_eq!(saved, fin, "the final status is checkpointed as sent");
    // Still listed by the master: kept, never launched again.
    h.exec.acknowledged(&fin);
    assert!(state_dir.join(checkpoint::ACKED_FILE).exists());
    h.exec.set_desired(wants(&["t1"], &[]));
    assert!(h.exec.has_ended("t1"));
    // No longer listed: forgotten, checkpoint gone.
    h.exec.set_desired(wants(&[], &[]));
    assert!(h.exec.known_task_ids().is_empty());
    assert!(!state_dir.exists());
}

/// Host tasks get users of their own, recorded before they start, held
/// across an agent restart and until the task is forgotten, never two
/// at once; with every id held, a task fails saying so.
#[tokio::test]
async fn host_tasks_hold_users_of_their_own_until_forgotten() {
    let fake: Arc<Fake> = Arc::default();
    let mut h = harness_on(tempfile::tempdir().unwrap(), fake.clone());
    let user_of = |h: &Harness, id: &str| {
        checkpoint::read_json::<UserIds>(&h.dir.path().join("state").join(id).join("user.json"))
            .unwrap()
    };
    h.exec.set_desired(wants(&["a", "b"], &[]));
    until_state(&mut h, TaskState::Running).await;
    until_state(&mut h, TaskState::Running).await;
    let (a, b) = (user_of(&h, "a").unwrap(), user_of(&h, "b").unwrap());
    assert_ne!(a.uid, b.uid);
    for u in [a, b] {
        assert!((80000..=80001).contains(&u.uid) && u.gid == u.uid, "{u}");
    }
    // The agent restarts with both running: both keep theirs, and a
    // third task finds none free.
    let Harness { dir, .. } = h;
    let mut h = harness_on(dir, fake.clone());
    h.exec.recover();
    assert_eq!(h.exec.isolation.users.of("a"), Some(a));
    assert_eq!(h.exec.isolation.users.of("b"), Some(b));
    h.exec.set_desired(wants(&["a", "b", "c"], &[]));
    let refused = until_state(&mut h, TaskState::Failed).await;
    assert_eq!(refused.task_id, "c");
    assert!(
        refused.message.contains("no free user"),
        "{}",
        refused.message
    );
    assert_eq!(fake.get("c"), Observed::NotStarted);
    // "a" ends and is forgotten: its user is free again (and its
    // sandbox the agent's).
    fake.set(
        "a",
        Observed::Ended(Ended {
            code: Some(0),
            ..Default::default()
        }),
    );
    let fin = until_state(&mut h, TaskState::Finished).await;
    h.exec.acknowledged(&fin);
    h.exec.set_desired(wants(&["b"], &[]));
    assert_eq!(h.exec.isolation.users.of("a"), None);
    assert_eq!(h.exec.isolation.users.held(), 1);
    h.exec.set_desired(wants(&["b", "d"], &[]));
    until_state(&mut h, TaskState::Running).await;
    assert_eq!(user_of(&h, "d"), Some(a), "the freed id");
}

/// A task asking for more than the agent allows ends FAILED with a
/// message naming the option, and the runtime never sees it.
#[tokio::test]
async fn a_task_asking_for_more_than_the_agent_allows_is_refused() {
    let mut h = harness_on(tempfile::tempdir().unwrap(), Arc::default());
    let mut root = spec("root");
    root.template.security.run_as_root = true;
    h.exec.set_desired(Desired {
        run: [("root".to_string(), root)].into(),
        kill: Default::default(),
        notices: Default::default(),
    });
    let u = next(&mut h).await;
    assert_eq!(u.state, TaskState::Failed, "{u:?}");
    assert!(u.message.contains("allow_root_tasks"), "{}", u.message);
    assert_eq!(h.fake.get("root"), Observed::NotStarted);
    assert!(!h.exec.sandbox("root").exists(), "nothing made for it");

    let mut mount = spec("mount");
    mount.template.image = Some("img".into());
    mount.template.security.mounts = vec![gpuctl_core::types::HostMount {
        host_path: "/".into(),
        container_path: "/host".into(),
        read_only: true,
    }];
    h.exec.set_desired(Desired {
        run: [("mount".to_string(), mount)].into(),
        kill: Default::default(),
        notices: Default::default(),
    });
    let u = next(&mut h).await;
    assert_eq!(u.state, TaskState::Failed, "{u:?}");
    assert!(u.message.contains("allowed_mounts"), "{}", u.message);
    assert!(
        u.message.contains("security.mounts[0].host_path"),
        "{}",
        u.message
    );
}

#[tokio::test]
async fn an_ended_tasks_sandbox_goes_a_retention_after_it_is_forgotten() {
    let mut h = harness_on(tempfile::tempdir().unwrap(), Arc::default());
    h.exec.set_desired(wants(&["t1", "t2"], &[]));
    until_state(&mut h, TaskState::Running).await;
    until_state(&mut h, TaskState::Running).await;
    let work = h.dir.path().to_path_buf();
    let sandbox = |id: &str| work.join(checkpoint::SANDBOX_DIR).join(id);
    std::fs::write(sandbox("t1").join(LOG_FILE), "done\n").unwrap();
    h.fake.set(
        "t1",
        Observed::Ended(Ended {
            code: Some(0),
            ..Default::default()
        }),
    );
    let fin = until_state(&mut h, TaskState::Finished).await;
    // Ended but not yet acknowledged, then acknowledged but still
    // listed: kept whatever the time.
    let far = checkpoint::wall_ms() + 10 * 3_600_000;
    assert_eq!(h.exec.sweep_sandboxes(far), 0);
    h.exec.acknowledged(&fin);
    assert_eq!(h.exec.sweep_sandboxes(far), 0);
    assert!(sandbox("t1").join(LOG_FILE).exists());
    // No longer listed: forgotten, and its retention (an hour) starts.
    h.exec.set_desired(wants(&["t2"], &[]));
    let forgotten = checkpoint::wall_ms();
    let retired = work.join(checkpoint::RETIRED_DIR);
    assert!(retired.join("t1").exists());
    // The running task's sandbox stays even with a stale record.
    std::fs::write(retired.join("t2"), r#"{"forgotten_at_ms":0}"#).unwrap();
    assert_eq!(h.exec.sweep_sandboxes(forgotten + 3_599_000), 0);
    assert!(sandbox("t1").join(LOG_FILE).exists());
    assert_eq!(h.exec.sweep_sandboxes(forgotten + 3_601_000), 1);
    assert!(!sandbox("t1").exists() && !retired.join("t1").exists());
    assert!(sandbox("t2").exists() && h.exec.is_active("t2"));
}

#[tokio::test]
async fn a_restarted_agent_reattaches_and_resends_what_was_not_acknowledged() {
    let fake: Arc<Fake> = Arc::default();
    let mut h = harness_on(tempfile::tempdir().unwrap(), fake.clone());
    h.exec.set_desired(wants(&["run", "done"], &[]));
    until_state(&mut h, TaskState::Running).await;
    until_state(&mut h, TaskState::Running).await;
    fake.set(
        "done",
        Observed::Ended(Ended {
            code: Some(0),
            ..Default::default()
        }),
    );
    let fin = until_state(&mut h, TaskState::Finished).await;
    // The agent dies: no acknowledgement reached it.
    let Harness { dir, .. } = h;
    let mut h = harness_on(dir, fake.clone());
    h.exec.recover();
    let mut ids = h.exec.known_task_ids();
    ids.sort();
    assert_eq!(ids, vec!["done".to_string(), "run".to_string()]);
    // The unacknowledged final goes out again, same uuid; the running
    // task is followed again (RUNNING, no STARTING: never started twice).
    let mut seen = Vec::new();
    for _ in 0..2 {
        seen.push(next(&mut h).await);
    }
    assert!(
        seen.iter()
            .any(|u| u.task_id == "done" && u.uuid == fin.uuid),
        "{seen:?}"
    );
    assert!(
        seen.iter()
            .any(|u| u.task_id == "run" && u.state == TaskState::Running),
        "{seen:?}"
    );
    assert!(h.exec.is_active("run"));
    // The master kills it: stopped, reported KILLED.
    h.exec.set_desired(wants(&[], &["run"]));
    let killed = until_state(&mut h, TaskState::Killed).await;
    assert_eq!(killed.task_id, "run");
}

/// A master heard `ms` ago (wall clock), with a 60 s fence.
fn contact_ago(ms: u64) -> Contact {
    Contact {
        last_contact_ms: checkpoint::wall_ms() - ms,
        fence_timeout_ms: 60_000,
    }
}

#[tokio::test(start_paused = true)]
async fn past_the_fence_tasks_stop_and_nothing_starts() {
    let mut h = harness_on(tempfile::tempdir().unwrap(), Arc::default());
    h.exec.record_contact(contact_ago(0));
    h.exec.set_desired(wants(&["t1"], &[]));
    until_state(&mut h, TaskState::Running).await;
    // The last contact is long past.
    h.exec.record_contact(contact_ago(120_000));
    h.exec.reconcile();
    let u = until_state(&mut h, TaskState::Killed).await;
    assert!(u.fenced && u.message.contains("fenced"), "{u:?}");
    h.exec.set_desired(wants(&["t1", "t2"], &[]));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!h.exec.is_active("t2"), "launched past the fence");
}

#[tokio::test(start_paused = true)]
async fn a_runtime_that_is_down_delays_the_launch_without_failing_it() {
    let fake: Arc<Fake> = Arc::default();
    *fake.down_for.lock().unwrap() = 2;
    let mut h = harness_on(tempfile::tempdir().unwrap(), fake);
    h.exec.set_desired(wants(&["t1"], &[]));
    assert_eq!(next(&mut h).await.state, TaskState::Starting);
    let u = next(&mut h).await;
    assert_eq!(u.state, TaskState::Running, "{u:?}");
}

/// GPU-0 (minor 0) in MIG mode: MIG-a (caps 30, 31), MIG-b (caps 39,
/// 40) and MIG-c, whose caps the host did not list.
fn mig_grants() -> HashMap<String, crate::isolation::DeviceGrant> {
    use gpuctl_core::types::{GpuInfo, MigDevice, MigInfo};
    let mig = |uuid: &str, gi: u32, caps: &[u32]| MigDevice {
        uuid: uuid.into(),
        profile: "1g.10gb".into(),
        memory_mib: 9856,
        gpu_slices: 1,
        compute_slices: 1,
        gi_id: gi,
        ci_id: 0,
        caps_minors: caps.to_vec(),
    };
    let mut g = GpuInfo::new("GPU-0", 0, "A100", 40960);
    g.mig = MigInfo {
        enabled: true,
        devices: vec![
            mig("MIG-a", 1, &[30, 31]),
            mig("MIG-b", 2, &[39, 40]),
            mig("MIG-c", 3, &[]),
        ],
        ..MigInfo::default()
    };
    crate::isolation::grants::device_grants(&[g])
}

fn run(h: &Harness, specs: Vec<TaskSpec>) {
    h.exec.set_desired(Desired {
        run: specs.into_iter().map(|s| (s.task_id.clone(), s)).collect(),
        kill: Default::default(),
        notices: Default::default(),
    });
}

fn with_gpus(id: &str, uuids: &[&str]) -> TaskSpec {
    let mut spec = spec(id);
    spec.template.image = Some("img".into());
    spec.gpu_uuids = uuids.iter().map(|u| u.to_string()).collect();
    spec
}

/// A MIG UUID is a GPU of the task like any: its environment names it
/// as it is, and an unknown UUID is refused before anything starts.
#[tokio::test]
async fn a_mig_uuid_resolves_and_its_environment_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let isolator = no_isolation(dir.path());
    let mut h = harness_with(dir, Arc::default(), isolator, mig_grants());
    // No NVIDIA node here (simulated): MIG-c's unknown caps do not matter.
    run(&h, vec![with_gpus("t1", &["MIG-a", "MIG-c"])]);
    let u = until_state(&mut h, TaskState::Running).await;
    assert_eq!(u.task_id, "t1");
    let launched = h.fake.launched.lock().unwrap()["t1"].clone();
    for var in [
        "NVIDIA_VISIBLE_DEVICES",
        "CUDA_VISIBLE_DEVICES",
        "GPUCTL_GPUS",
    ] {
        assert_eq!(launched.env[var], "MIG-a,MIG-c", "{var}");
    }
    assert!(launched.isolation.gpu_task);
    assert!(launched.isolation.devices.is_empty(), "no node to give");

    run(&h, vec![with_gpus("t2", &["MIG-zz"])]);
    let u = until_state(&mut h, TaskState::Failed).await;
    assert_eq!(u.task_id, "t2");
    assert!(
        u.message
            .contains("MIG-zz is neither a GPU nor a MIG device of this agent"),
        "{}",
        u.message
    );
    assert_eq!(h.fake.get("t2"), Observed::NotStarted);
}

/// The parent GPU of a task's MIG device fails: the task is stopped and
/// ends FAILED with GPU_UNHEALTHY naming the parent, and a new task on
/// another MIG device of that parent is refused.
#[tokio::test]
async fn a_failed_parent_gpu_stops_its_mig_tasks() {
    let dir = tempfile::tempdir().unwrap();
    let isolator = no_isolation(dir.path());
    let mut h = harness_with(dir, Arc::default(), isolator, mig_grants());
    run(&h, vec![with_gpus("t1", &["MIG-a"])]);
    until_state(&mut h, TaskState::Running).await;
    h.exec
        .set_gpu_faults([("GPU-0".to_string(), "GPU is lost".to_string())].into());
    let u = until_state(&mut h, TaskState::Failed).await;
    assert_eq!(u.task_id, "t1");
    assert!(u.gpu_unhealthy, "{u:?}");
    assert_eq!(u.message, "GPU GPU-0 unhealthy: GPU is lost");
    run(
        &h,
        vec![with_gpus("t1", &["MIG-a"]), with_gpus("t2", &["MIG-b"])],
    );
    let u = until_state(&mut h, TaskState::Failed).await;
    assert_eq!((u.task_id.as_str(), u.gpu_unhealthy), ("t2", true));
    assert_eq!(h.fake.get("t2"), Observed::NotStarted);
}

/// On a host with NVIDIA nodes (fake ones, mknod), a MIG task's
/// container gets its parent's node and its caps; one whose caps node
/// is missing, or whose caps are not known, is refused naming it.
#[tokio::test]
async fn a_mig_task_gets_its_parent_and_caps_or_is_refused() {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipped: mknod needs root");
        return;
    }
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    let dir = tempfile::tempdir().unwrap();
    // A v2-looking root: containers get Docker's own device program,
    // so no cgroup is made and the devices are what is checked.
    let cg = dir.path().join("cg2");
    let dev = dir.path().join("dev");
    std::fs::create_dir_all(&cg).unwrap();
    std::fs::write(cg.join("cgroup.controllers"), "").unwrap();
    std::fs::create_dir_all(dev.join("nvidia-caps")).unwrap();
    for (name, major, minor) in [
        ("nvidia0", 195, 0),
        ("nvidiactl", 195, 255),
        ("nvidia-caps/nvidia-cap30", 240, 30),
        ("nvidia-caps/nvidia-cap31", 240, 31),
        ("nvidia-caps/nvidia-cap39", 240, 39),
    ] {
        mknod(
            &dev.join(name),
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o600),
            makedev(major, minor),
        )
        .unwrap();
    }
    let isolator: Arc<dyn Isolator> = Arc::new(
        crate::isolation::CgroupIsolator::new(
            &cg,
            "gpuctl/a1",
            &dev,
            nix::unistd::Uid::effective().is_root(),
        )
        .unwrap(),
    );
    let mut h = harness_with(dir, Arc::default(), isolator, mig_grants());
    run(&h, vec![with_gpus("a", &["MIG-a"])]);
    until_state(&mut h, TaskState::Running).await;
    let launched = h.fake.launched.lock().unwrap()["a"].clone();
    let given: Vec<&str> = launched
        .isolation
        .devices
        .iter()
        .map(|d| d.container_path.as_str())
        .collect();
    assert_eq!(
        given,
        [
            "/dev/nvidia0",
            "/dev/nvidia-caps/nvidia-cap30",
            "/dev/nvidia-caps/nvidia-cap31",
            "/dev/nvidiactl"
        ]
    );
    // The check after start tries every node, caps included.
    assert_eq!(launched.isolation.host_nodes.len(), 5);

    for (id, uuid, says) in [("b", "MIG-b", "nvidia-cap40"), ("c", "MIG-c", "MIG-c")] {
        run(&h, vec![with_gpus("a", &["MIG-a"]), with_gpus(id, &[uuid])]);
        let u = until_state(&mut h, TaskState::Failed).await;
        assert_eq!(u.task_id, id);
        assert!(u.message.contains(says), "{}", u.message);
        assert_eq!(h.fake.get(id), Observed::NotStarted);
    }
}

// Time: the outage backoff, removal retries and the tick on tokio's paused
// clock (the clock moves only when every task waits, so the waits below are
// exact and take no real time). The fence itself is on the wall clock (it
// survives restarts), so those tests move the contact instead.

#[tokio::test(start_paused = true)]
async fn a_launch_waits_out_an_outage_on_the_backoff_schedule() {
    let fake: Arc<Fake> = Arc::default();
    *fake.down_for.lock().unwrap() = 4;
    let mut h = harness_on(tempfile::tempdir().unwrap(), fake);
    let t0 = tokio::time::Instant::now();
    h.exec.set_desired(wants(&["t1"], &[]));
    assert_eq!(next(&mut h).await.state, TaskState::Starting);
    let u = next(&mut h).await;
    assert_eq!(u.state, TaskState::Running, "{u:?}");
    // Four refusals: 200 + 400 + 800 + 1600 ms, no more.
    let waited = t0.elapsed();
    let want = OUTAGE_BACKOFF_MIN * (1 + 2 + 4 + 8);
    assert!(
        waited >= want && waited < want + OUTAGE_BACKOFF_MIN,
        "{waited:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_kill_during_an_outage_ends_the_launch_without_waiting_out_the_backoff() {
    let fake: Arc<Fake> = Arc::default();
    *fake.down_for.lock().unwrap() = u32::MAX;
    let mut h = harness_on(tempfile::tempdir().unwrap(), fake.clone());
    h.exec.set_desired(wants(&["t1"], &[]));
    assert_eq!(next(&mut h).await.state, TaskState::Starting);
    // Deep into the backoff: each wait is at its 5 s cap by now.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let t0 = tokio::time::Instant::now();
    h.exec.set_desired(wants(&[], &["t1"]));
    let u = until_state(&mut h, TaskState::Killed).await;
    assert!(u.message.contains("before it started"), "{u:?}");
    assert!(
        t0.elapsed() < OUTAGE_BACKOFF_MIN,
        "waited {:?}",
        t0.elapsed()
    );
    assert!(!fake.launched.lock().unwrap().contains_key("t1"));
}

#[tokio::test(start_paused = true)]
async fn removal_retries_up_to_the_cap_and_gives_up_after_ten_tries() {
    let fake: Arc<Fake> = Arc::default();
    let rt: Arc<dyn ContainerRuntime> = Arc::new(FakeRuntime(fake.clone(), Runtime::Process));
    let tref = TaskRef {
        task_id: "t1".into(),
        agent_id: "a1".into(),
        state_dir: "/nonexistent".into(),
        log_path: "/nonexistent/output.log".into(),
    };
    let within = |got: Duration, want: Duration| {
        assert!(
            got >= want && got < want + Duration::from_millis(50),
            "{got:?} vs {want:?}"
        )
    };
    // Busy twice, then removed: 200 + 400 ms.
    *fake.remove_fails.lock().unwrap() = 2;
    let t0 = tokio::time::Instant::now();
    super::drive::remove_until_done(&rt, &tref).await;
    within(t0.elapsed(), OUTAGE_BACKOFF_MIN * 3);
    assert_eq!(*fake.remove_fails.lock().unwrap(), 0);
    // Never removed: ten tries, nine waits (200 ms doubling to the 5 s
    // cap), then it is left to the stray scan.
    *fake.remove_fails.lock().unwrap() = 100;
    let t0 = tokio::time::Instant::now();
    super::drive::remove_until_done(&rt, &tref).await;
    within(
        t0.elapsed(),
        Duration::from_millis(200 + 400 + 800 + 1600 + 3200) + OUTAGE_BACKOFF_MAX * 4,
    );
    assert_eq!(*fake.remove_fails.lock().unwrap(), 90);
}

#[tokio::test(start_paused = true)]
async fn the_tick_stops_tasks_past_the_fence_without_any_event() {
    let mut h = harness_on(tempfile::tempdir().unwrap(), Arc::default());
    h.exec.record_contact(contact_ago(0));
    h.exec.set_desired(wants(&["t1"], &[]));
    until_state(&mut h, TaskState::Running).await;
    let (stop_tx, stop_rx) = watch::channel(false);
    let ticking = tokio::spawn(h.exec.clone().tick(stop_rx));
    // The interval's first tick is at once.
    tokio::time::sleep(Duration::from_millis(10)).await;
    // The fence falls; nothing calls reconcile but the tick.
    h.exec.record_contact(contact_ago(120_000));
    let t0 = tokio::time::Instant::now();
    let u = until_state(&mut h, TaskState::Killed).await;
    assert!(u.fenced && u.message.contains("fenced"), "{u:?}");
    let waited = t0.elapsed();
    assert!(waited > Duration::ZERO && waited <= TICK, "{waited:?}");
    stop_tx.send(true).unwrap();
    ticking.await.unwrap();
}

/// An executor whose isolation is the fake, kept for the test to look at.
fn harness_with_fake_isolation(
    fake: Arc<Fake>,
) -> (Harness, Arc<crate::isolation::fake::FakeIsolator>) {
    let dir = tempfile::tempdir().unwrap();
    let iso = Arc::new(crate::isolation::fake::FakeIsolator {
        dev_root: dir.path().join("dev"),
        ..Default::default()
    });
    let h = harness_with(dir, fake, iso.clone(), HashMap::new());
    (h, iso)
}

#[tokio::test]
async fn a_task_whose_isolation_fails_never_starts_and_an_ended_one_is_released() {
    let fake: Arc<Fake> = Arc::default();
    let (mut h, iso) = harness_with_fake_isolation(fake.clone());
    iso.refuse
        .lock()
        .unwrap()
        .insert("bad".into(), "no device node /dev/nvidia7".into());
    h.exec.set_desired(wants(&["bad", "good"], &[]));
    let mut failed = None;
    let mut running = false;
    while failed.is_none() || !running {
        let u = next(&mut h).await;
        match (u.task_id.as_str(), u.state) {
            ("bad", TaskState::Failed) => failed = Some(u),
            ("good", TaskState::Running) => running = true,
            ("bad", TaskState::Running) => panic!("started without isolation: {u:?}"),
            _ => {}
        }
    }
    let failed = failed.unwrap();
    assert!(
        failed
            .message
            .contains("isolation: no device node /dev/nvidia7"),
        "{failed:?}"
    );
    assert!(!fake.launched.lock().unwrap().contains_key("bad"));
    assert!(iso.held.lock().unwrap().contains("good"));
    // It ends: its isolation is released (once the executor is done with it).
    fake.set(
        "good",
        Observed::Ended(Ended {
            code: Some(0),
            ..Default::default()
        }),
    );
    until_state(&mut h, TaskState::Finished).await;
    for _ in 0..100 {
        if !iso.held.lock().unwrap().contains("good") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!iso.held.lock().unwrap().contains("good"), "{iso:?}");
    assert!(iso.released.lock().unwrap().iter().any(|t| t == "good"));
}

/// A heartbeat directory of a task whose user is known is that user's
/// alone; one for a container of unknown user is root's and the task's own
/// group's (no one else may write it), under a root that no host process
/// but root may pass (only the container it is mounted into reaches it);
/// one of no user and no group is root's alone. Each is found by task id.
#[tokio::test]
async fn heartbeat_directories_are_reachable_only_by_their_task() {
    use std::os::unix::fs::MetadataExt;
    let h = harness_on(tempfile::tempdir().unwrap(), Arc::default());
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
    let user = UserIds {
        uid: 80000,
        gid: 80000,
    };
    let own = h
        .exec
        .make_heartbeat_dir("host-task", Some(user), None)
        .unwrap();
    let md = std::fs::metadata(&own).unwrap();
    assert_eq!((md.uid(), md.gid(), mode(&own)), (80000, 80000, 0o700));
    assert_eq!(mode(own.parent().unwrap()), 0o711);
    let grouped = h
        .exec
        .make_heartbeat_dir("container-task", None, Some(80001))
        .unwrap();
    let md = std::fs::metadata(&grouped).unwrap();
    assert_eq!((md.uid(), md.gid(), mode(&grouped)), (0, 80001, 0o770));
    assert_eq!(mode(grouped.parent().unwrap()), 0o700);
    assert_ne!(own.parent(), grouped.parent());
    let roots = h.exec.make_heartbeat_dir("root-task", None, None).unwrap();
    assert_eq!(mode(&roots), 0o700);
    assert_eq!(h.exec.heartbeat_dir("host-task"), own);
    assert_eq!(h.exec.heartbeat_dir("container-task"), grouped);
}

/// A task's checks run beside it: readiness is told when it changes, with
/// the failure's words; a liveness check failing `failures` times in a row
/// stops the task, which ends FAILED for it (REASON_LIVENESS_FAILED).
#[tokio::test]
async fn checks_tell_readiness_and_a_failed_liveness_check_stops_the_task() {
    let mut h = harness_on(tempfile::tempdir().unwrap(), Arc::default());
    h.fake.exec_codes.lock().unwrap().insert("ready?".into(), 1);
    let mut s = spec("t1");
    s.template.options.readiness = Some("interval=100ms failures=2 exec:ready?".parse().unwrap());
    s.template.options.liveness = Some("interval=100ms failures=3 exec:alive?".parse().unwrap());
    h.exec.set_desired(Desired {
        run: [("t1".to_string(), s)].into(),
        kill: Default::default(),
        notices: Default::default(),
    });
    until_state(&mut h, TaskState::Running).await;
    let not_ready = next(&mut h).await;
    let health = not_ready.health.clone().expect("health");
    assert!(!health.ready, "{not_ready:?}");
    assert_eq!(
        health.failure,
        "readiness: \"ready?\" exited with code 1: said 1"
    );
    h.fake.exec_codes.lock().unwrap().insert("ready?".into(), 0);
    let ready = next(&mut h).await;
    assert_eq!(ready.state, TaskState::Running);
    assert!(ready.health.as_ref().unwrap().ready, "{ready:?}");
    // A runtime that is down is no answer: nothing counts (10 intervals).
    h.fake
        .exec_codes
        .lock()
        .unwrap()
        .insert("alive?".into(), -1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    while let Ok(u) = h.updates.try_recv() {
        assert_eq!(u.state, TaskState::Running, "{u:?}");
    }
    assert!(h.exec.is_active("t1"));
    // Liveness fails: three in a row stop it.
    h.fake.exec_codes.lock().unwrap().insert("alive?".into(), 7);
    let fin = until_state(&mut h, TaskState::Failed).await;
    assert!(fin.liveness_failed, "{fin:?}");
    assert_eq!(
        fin.message,
        "liveness: \"alive?\" exited with code 7: said 7 (3 in a row)"
    );
    let u = pb_reason(&fin);
    assert_eq!(u, gpuctl_core::pb::Reason::LivenessFailed as i32);
}

fn pb_reason(u: &StatusUpdate) -> i32 {
    gpuctl_core::pb::StatusUpdate::from(u.clone()).reason
}

/// An agent restarted under a running task follows its checks again at
/// once, its start period long over: a failure counts from the first.
#[tokio::test]
async fn a_restarted_agent_checks_its_running_tasks_again_without_a_start_period() {
    let fake: Arc<Fake> = Arc::default();
    fake.exec_codes.lock().unwrap().insert("ready?".into(), 1);
    let mut h = harness_on(tempfile::tempdir().unwrap(), fake.clone());
    let mut s = spec("t1");
    s.template.options.readiness = Some(
        "interval=100ms failures=1 start=60s exec:ready?"
            .parse()
            .unwrap(),
    );
    let desired = || Desired {
        run: [("t1".to_string(), s.clone())].into(),
        kill: Default::default(),
        notices: Default::default(),
    };
    h.exec.set_desired(desired());
    until_state(&mut h, TaskState::Running).await;
    // In its start period: failures are not told.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        h.updates.try_recv().is_err(),
        "nothing told in the start period"
    );
    let Harness { dir, .. } = h;
    let mut h = harness_on(dir, fake.clone());
    h.exec.recover();
    h.exec.set_desired(desired());
    let told = loop {
        let u = next(&mut h).await;
        if u.health.is_some() {
            break u;
        }
    };
    let health = told.health.unwrap();
    assert!(!health.ready);
    assert!(health.failure.contains("exited with code 1"), "{health:?}");
}

/// A readiness check that flaps at its interval (a tenant's, on purpose)
/// costs the master at most one report a second per task.
#[tokio::test]
async fn a_flapping_check_is_told_at_most_once_a_second() {
    let fake: Arc<Fake> = Arc::default();
    let mut h = harness_on(tempfile::tempdir().unwrap(), fake.clone());
    let mut s = spec("t1");
    s.template.options.readiness = Some("interval=100ms failures=1 exec:ready?".parse().unwrap());
    h.exec.set_desired(Desired {
        run: [("t1".to_string(), s)].into(),
        kill: Default::default(),
        notices: Default::default(),
    });
    until_state(&mut h, TaskState::Running).await;
    let started = std::time::Instant::now();
    let mut code = 0;
    while started.elapsed() < Duration::from_millis(2500) {
        code = 1 - code;
        fake.exec_codes
            .lock()
            .unwrap()
            .insert("ready?".into(), code);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut told = 0;
    while let Ok(u) = h.updates.try_recv() {
        assert!(u.health.is_some(), "{u:?}");
        told += 1;
    }
    // 2.5 s: at most the first and one a second after it.
    assert!((1..=4).contains(&told), "{told} reports");
}
