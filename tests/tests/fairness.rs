//! Fair allocation among greedy frameworks, end to end: real masters and
//! agents, frameworks over gRPC that launch as many tasks as each offer
//! holds and decline the rest. The split is checked from outside the
//! master too: the tasks' live processes.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use gpuctl_proto::pb;
use gpuctl_tests::{AgentOpts, Cluster, Gpuctl};
use pb::scheduler_client::SchedulerClient;

/// A framework that fills every offer with tasks of one shape.
#[derive(Clone)]
struct Greedy {
    name: &'static str,
    role: &'static str,
    cpus: f64,
    mem_mib: u64,
    gpus: u32,
    /// How long each task runs (seconds; `sleep` in the task).
    run_secs: &'static str,
    /// Every offer it got, for checks on their shape.
    offers: Arc<Mutex<Vec<pb::Offer>>>,
    /// Subscribe stating its task size (for reclaim between frameworks).
    declare: bool,
    /// The inverse offers and task updates it got.
    inverse: Arc<Mutex<Vec<pb::InverseOffer>>>,
    updates: Arc<Mutex<Vec<pb::TaskStatus>>>,
}

impl Greedy {
    fn new(name: &'static str, role: &'static str, cpus: f64, mem_mib: u64, gpus: u32) -> Self {
        Greedy {
            name,
            role,
            cpus,
            mem_mib,
            gpus,
            run_secs: "600",
            offers: Arc::default(),
            declare: false,
            inverse: Arc::default(),
            updates: Arc::default(),
        }
    }

    /// The marker in its tasks' command lines, to find their processes.
    fn marker(&self, test: &str) -> String {
        format!("fairness-{test}-{}", self.name)
    }

    /// Subscribes, and returns once SUBSCRIBED came; then runs until the
    /// runtime ends.
    async fn start(self, master: String, test: &'static str) {
        let mut client = SchedulerClient::connect(format!("http://{master}"))
            .await
            .unwrap();
        let mut capabilities = vec![];
        if self.gpus > 0 {
            capabilities.push(pb::FrameworkCapability::GpuResources as i32);
        }
        let mut events = client
            .subscribe(pb::SubscribeRequest {
                demand: self.declare.then_some(pb::Resources {
                    cpus: self.cpus,
                    mem_mib: self.mem_mib,
                    gpus: self.gpus,
                    ports: 0,
                }),
                request_id: String::new(),
                suppressed: false,
                framework: Some(pb::FrameworkInfo {
                    name: self.name.into(),
                    roles: vec![self.role.into()],
                    capabilities,
                    failover_timeout_secs: 60.0,
                    ..Default::default()
                }),
            })
            .await
            .unwrap()
            .into_inner();
        let Some(pb::event::Event::Subscribed(sub)) = events.next().await.unwrap().unwrap().event
        else {
            panic!("SUBSCRIBED first")
        };
        let fw = sub.framework_id;
        let marker = self.marker(test);
        tokio::spawn(async move {
            let mut next = 0u32;
            while let Some(Ok(e)) = events.next().await {
                match e.event {
                    Some(pb::event::Event::Offers(o)) => {
                        for offer in o.offers {
                            self.offers.lock().unwrap().push(offer.clone());
                            let r = offer.resources.unwrap_or_default();
                            let mut fit = u32::MAX;
                            if self.cpus > 0.0 {
                                fit = fit.min(((r.cpus + 1e-9) / self.cpus) as u32);
                            }
                            if let Some(n) = r.mem_mib.checked_div(self.mem_mib) {
                                fit = fit.min(n as u32);
                            }
                            if let Some(n) = (offer.gpus.len() as u32).checked_div(self.gpus) {
                                fit = fit.min(n);
                            }
                            let mut gpus = offer.gpus.iter().map(|g| g.uuid.clone());
                            let tasks: Vec<pb::TaskInfo> = (0..fit)
                                .map(|_| {
                                    next += 1;
                                    pb::TaskInfo {
                                        task_id: format!("{}-{next}", self.name),
                                        agent_id: offer.agent_id.clone(),
                                        command: vec![
                                            "sh".into(),
                                            "-c".into(),
                                            format!("sleep {}; :", self.run_secs),
                                            marker.clone(),
                                        ],
                                        resources: Some(pb::Resources {
                                            cpus: self.cpus,
                                            mem_mib: self.mem_mib,
                                            gpus: self.gpus,
                                            ports: 0,
                                        }),
                                        gpu_uuids: gpus.by_ref().take(self.gpus as usize).collect(),
                                        // For gpuctl_tests::live_tasks: the
                                        // GPUs each live process was given.
                                        env: [(MARKER_VAR.to_string(), env_marker(test))].into(),
                                        ..Default::default()
                                    }
                                })
                                .collect();
                            if tasks.is_empty() {
                                let _ = client
                                    .decline(pb::DeclineRequest {
                                        framework_id: fw.clone(),
                                        offer_ids: vec![offer.id.clone()],
                                        filters: None,
                                    })
                                    .await;
                                continue;
                            }
                            let accepted = client
                                .accept(pb::AcceptRequest {
                                    framework_id: fw.clone(),
                                    offer_ids: vec![offer.id.clone()],
                                    operations: vec![pb::Operation {
                                        operation: Some(pb::operation::Operation::Launch(
                                            pb::Launch { tasks },
                                        )),
                                    }],
                                    filters: None,
                                })
                                .await;
                            // An offer rescinded meanwhile (its agent was
                            // just SIGKILLed) is refused: a framework takes
                            // the next one, as a real one would.
                            if let Err(e) = accepted {
                                assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
                                assert!(e.message().contains("no longer outstanding"), "{e}");
                            }
                        }
                    }
                    Some(pb::event::Event::InverseOffer(i)) => {
                        self.inverse.lock().unwrap().push(i);
                    }
                    Some(pb::event::Event::Update(u)) if !u.uuid.is_empty() => {
                        self.updates.lock().unwrap().push(u.clone());
                        let _ = client
                            .acknowledge(pb::AcknowledgeRequest {
                                framework_id: fw.clone(),
                                agent_id: u.agent_id,
                                task_id: u.task_id,
                                uuid: u.uuid,
                            })
                            .await;
                    }
                    _ => {}
                }
            }
        });
    }
}

/// The environment variable naming a test's tasks (all its frameworks').
const MARKER_VAR: &str = "GPUCTL_FAIRNESS_TEST";

fn env_marker(test: &str) -> String {
    gpuctl_tests::test_marker(&format!("fairness-{test}"))
}

/// Live processes whose command line holds `marker`, counted from /proc:
/// what runs, whatever the master believes.
fn live_tasks(marker: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .filter(|c| {
            let args: Vec<&[u8]> = c.split(|&b| b == 0).collect();
            // sh -c 'sleep N; :' MARKER: the task's shell, not its sleep.
            args.first() == Some(&&b"sh"[..]) && args.contains(&marker.as_bytes())
        })
        .count()
}

/// GPUs held per framework name, as the master reports them (task ids
/// are `<framework id>.<name>-<n>`).
fn gpus_by_name(c: &Cluster) -> BTreeMap<String, usize> {
    let mut by = BTreeMap::new();
    for g in c.json(&["gpus", "--json"]).as_array().unwrap() {
        if let Some(t) = g["task_id"].as_str() {
            let name = t.rsplit('.').next().unwrap_or(t);
            let name = name.split('-').next().unwrap_or("").to_string();
            *by.entry(name).or_default() += 1;
        }
    }
    by
}

/// Waits until `check` holds for 3 s in a row (the split is stable).
fn settles(what: &str, within: Duration, mut check: impl FnMut() -> Result<(), String>) {
    let deadline = Instant::now() + within;
    let mut since: Option<Instant> = None;
    loop {
        match check() {
            Ok(()) => {
                let s = *since.get_or_insert_with(Instant::now);
                if s.elapsed() >= Duration::from_secs(3) {
                    return;
                }
            }
            Err(e) => {
                since = None;
                assert!(Instant::now() < deadline, "{what}: {e}");
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The DRF paper's example: one agent of 9 cpus and 18 GiB; A runs tasks
/// of <1 cpu, 4 GiB>, B of <3 cpus, 1 GiB>. DRF gives A 3 tasks and B 2
/// (both at a dominant share of 2/3), whichever subscribes first, even
/// though both take everything they are offered.
#[test]
fn greedy_frameworks_get_the_drf_split_whichever_subscribes_first() {
    for (run, first_a) in [("ab", true), ("ba", false)] {
        let mut c = Cluster::start(&[]);
        let rt = tokio::runtime::Runtime::new().unwrap();
        let test: &'static str = if first_a { "drf-ab" } else { "drf-ba" };
        let a = Greedy::new("A", "default", 1.0, 4096, 0);
        let b = Greedy::new("B", "default", 3.0, 1024, 0);
        let (ma, mb) = (a.marker(test), b.marker(test));
        let order = if first_a { [a, b] } else { [b, a] };
        for f in order {
            rt.block_on(f.start(c.master_addr.clone(), test));
        }
        // Both are subscribed when the agent's resources appear.
        c.add_agent(AgentOpts {
            simulate_gpus: None,
            extra: vec![
                "--cpus".into(),
                "9".into(),
                "--mem-mib".into(),
                (18 * 1024).to_string(),
            ],
            ..AgentOpts::default()
        });
        settles(run, Duration::from_secs(60), || {
            let live = (live_tasks(&ma), live_tasks(&mb));
            if live == (3, 2) {
                Ok(())
            } else {
                Err(format!("{run}: live A/B {live:?}"))
            }
        });
        drop(rt);
    }
}

/// The same example with long tasks and the frameworks coming one after
/// the other: the first takes the whole agent (A4/B1 or B3/A0) and, without
/// reclaim, keeps it for as long as its tasks run. With reclaim the master
/// sends the framework above its fair share an inverse offer and kills the
/// named task at its deadline (REASON_RECLAIMED); the split is A3/B2
/// within 30 s of the second framework subscribing, whichever came first.
#[test]
fn a_framework_that_came_second_gets_its_drf_share_back_by_reclaim() {
    for first_a in [true, false] {
        // The first's tasks are past the minimum runtime when the second
        // comes: the reclaim may start at once.
        reclaims_to_the_drf_split(first_a, "1s", Duration::from_secs(2));
    }
}

/// The same, with the second framework subscribing while the first's
/// tasks are younger than the minimum runtime (5 s): for those seconds it
/// can only wait. It declines every offer it cannot use, as a greedy
/// framework does; its declared task size stays its unit, so it is never
/// offered less than one task (B3 leaves <0 cpus, 15 GiB>, which no unit
/// of A's fits: unoffered), and the reclaim comes once the minimum runtime
/// has passed. An independent client found A0/B3 for as long as it ran
/// when declining turned A's declared unit into "whole agents".
#[test]
fn a_framework_that_declines_what_it_cannot_use_gets_its_share_by_reclaim() {
    for first_a in [true, false] {
        reclaims_to_the_drf_split(first_a, "5s", Duration::ZERO);
    }
}

/// The DRF example on one agent of 9 cpus and 18 GiB with greedy, declaring
/// frameworks, A <1 cpu, 4 GiB> and B <3 cpus, 1 GiB>, one subscribing
/// after the other took the agent (`pause` after that): A3/B2 by reclaim,
/// told by an inverse offer to the one above its share only; no offer to
/// either smaller than its declared task.
fn reclaims_to_the_drf_split(first_a: bool, min_runtime: &str, pause: Duration) {
    let mut c = Cluster::start(&[
        "--reclaim-min-runtime",
        min_runtime,
        "--reclaim-notice",
        "2s",
    ]);
    c.add_agent(AgentOpts {
        simulate_gpus: None,
        extra: vec![
            "--cpus".into(),
            "9".into(),
            "--mem-mib".into(),
            (18 * 1024).to_string(),
        ],
        ..AgentOpts::default()
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    let test: &'static str = match (first_a, pause.is_zero()) {
        (true, false) => "reclaim-ab",
        (false, false) => "reclaim-ba",
        (true, true) => "reclaim-young-ab",
        (false, true) => "reclaim-young-ba",
    };
    let mut a = Greedy::new("A", "default", 1.0, 4096, 0);
    let mut b = Greedy::new("B", "default", 3.0, 1024, 0);
    a.declare = true;
    b.declare = true;
    let (ma, mb) = (a.marker(test), b.marker(test));
    let (inv_a, inv_b) = (a.inverse.clone(), b.inverse.clone());
    let (upd_a, upd_b) = (a.updates.clone(), b.updates.clone());
    let (offers_a, offers_b) = (a.offers.clone(), b.offers.clone());
    let (first, second, full) = if first_a {
        (a, b, (4, 0))
    } else {
        (b, a, (0, 3))
    };
    rt.block_on(first.start(c.master_addr.clone(), test));
    settles("the first takes the agent", Duration::from_secs(30), || {
        let live = (live_tasks(&ma), live_tasks(&mb));
        (live == full)
            .then_some(())
            .ok_or(format!("live A/B {live:?}"))
    });
    std::thread::sleep(pause);
    let came = Instant::now();
    rt.block_on(second.start(c.master_addr.clone(), test));
    // On a failure, the frameworks' last task updates say what ended
    // their tasks, and the last offers what they were offered.
    let last_updates = |u: &Arc<Mutex<Vec<pb::TaskStatus>>>| -> Vec<String> {
        let u = u.lock().unwrap();
        u.iter()
            .rev()
            .take(8)
            .map(|s| format!("{} {:?} {:?} {}", s.task_id, s.state, s.reason, s.message))
            .collect()
    };
    let last_offers = |o: &Arc<Mutex<Vec<pb::Offer>>>| -> Vec<String> {
        let o = o.lock().unwrap();
        o.iter()
            .rev()
            .take(4)
            .map(|o| {
                let r = o.resources.unwrap_or_default();
                format!("<{} cpus, {} MiB>", r.cpus, r.mem_mib)
            })
            .collect()
    };
    settles("A3/B2 by reclaim", Duration::from_secs(40), || {
        let live = (live_tasks(&ma), live_tasks(&mb));
        (live == (3, 2)).then_some(()).ok_or(format!(
            "live A/B {live:?}; A's last updates {:?}, offers {:?}; B's {:?}, {:?}",
            last_updates(&upd_a),
            last_offers(&offers_a),
            last_updates(&upd_b),
            last_offers(&offers_b),
        ))
    });
    eprintln!(
        "{test}: A3/B2 {:?} after the second subscribed",
        came.elapsed()
    );
    // No offer was smaller than the task its framework declared.
    for (name, offers, cpus, mem_mib) in [("A", &offers_a, 1.0, 4096), ("B", &offers_b, 3.0, 1024)]
    {
        for o in offers.lock().unwrap().iter() {
            let r = o.resources.unwrap_or_default();
            assert!(
                r.cpus + 1e-9 >= cpus && r.mem_mib >= mem_mib,
                "{test}: {name} was offered <{} cpus, {} MiB>, less than its task",
                r.cpus,
                r.mem_mib
            );
        }
    }
    // The framework above its share was told, then its task was killed
    // as reclaimed; the other was never told.
    let (told, quiet, updates) = if first_a {
        (&inv_a, &inv_b, &upd_a)
    } else {
        (&inv_b, &inv_a, &upd_b)
    };
    let told = told.lock().unwrap().clone();
    assert!(!told.is_empty(), "{test}: no inverse offer");
    assert!(
        quiet.lock().unwrap().is_empty(),
        "{test}: the framework below its share was told"
    );
    let named: Vec<String> = told.iter().flat_map(|i| i.task_ids.clone()).collect();
    assert!(told
        .iter()
        .all(|i| i.reason.contains("below its fair share")));
    let reclaimed: Vec<pb::TaskStatus> = updates
        .lock()
        .unwrap()
        .iter()
        .filter(|u| u.reason == pb::Reason::Reclaimed as i32)
        .cloned()
        .collect();
    assert!(!reclaimed.is_empty(), "{test}: no task ended RECLAIMED");
    assert!(
        reclaimed.iter().all(|u| named.contains(&u.task_id)),
        "{test}: reclaimed {reclaimed:?}, named {named:?}"
    );
    drop(rt);
}

/// Roles weighted 1:3 over 16 GPUs: A (weight 1) comes first and takes all
/// of them; B (weight 3) comes later. As A's tasks end, the GPUs go to the
/// role furthest below its weight, and the split converges to 4/12.
#[test]
fn weighted_roles_converge_to_their_weights_as_tasks_end() {
    let mut c = Cluster::start(&["--role", "light=weight:1", "--role", "heavy=weight:3"]);
    for _ in 0..2 {
        c.add_agent(AgentOpts {
            simulate_gpus: Some("8xA100-SXM4-40GB"),
            ..AgentOpts::default()
        });
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let test = "weights";
    let mut a = Greedy::new("A", "light", 0.05, 16, 1);
    let mut b = Greedy::new("B", "heavy", 0.05, 16, 1);
    a.run_secs = "3";
    b.run_secs = "3";
    let (ma, mb) = (a.marker(test), b.marker(test));
    rt.block_on(a.start(c.master_addr.clone(), test));
    // A, alone, has had all 16 at once. How many it keeps afterwards is
    // not asked: with 3 s tasks on a loaded machine several are between
    // their end and their replacement at any moment (CI saw 12 to 14).
    gpuctl_tests::wait_for(Duration::from_secs(60), "A alone on all 16 GPUs", || {
        live_tasks(&ma) == 16
    });
    rt.block_on(b.start(c.master_addr.clone(), test));
    // Tasks last 3 s and are replaced at once: a few rounds.
    settles_one_to_three("weights 1:3", &c, &ma, &mb);
    drop(rt);
}

/// Waits until A and B (markers `ma`, `mb`) run and hold 4 and 12 of 16
/// GPUs, as live processes and in the master's view: weights 1:3.
fn settles_one_to_three(what: &str, c: &Cluster, ma: &str, mb: &str) {
    settles(what, Duration::from_secs(90), || {
        let live = (live_tasks(ma), live_tasks(mb));
        let held = gpus_by_name(c);
        let held = (
            held.get("A").copied().unwrap_or(0),
            held.get("B").copied().unwrap_or(0),
        );
        // A task may be between its end and its replacement: in the
        // master's view one at most; as live processes, on a loaded
        // machine, a few (CI saw B at 10 of 12 for 3 s). Never more than
        // the share, either way.
        let near = |(a, b): (usize, usize)| (3..=4).contains(&a) && (11..=12).contains(&b);
        let live_near = |(a, b): (usize, usize)| (2..=4).contains(&a) && (9..=12).contains(&b);
        if live_near(live) && near(held) {
            Ok(())
        } else {
            Err(format!("live A/B {live:?}, GPUs held by A/B {held:?}"))
        }
    });
}

/// Foul weather for the weighted split: once it has converged, one of the
/// two agents is SIGKILLed while its tasks run, stays down for 5 s (its
/// tasks end meanwhile, unseen), and comes back. The master learns what
/// ended from the restarted agent, and the split converges to 1:3 again.
/// Throughout, from /proc: no GPU is used by two live processes of either
/// framework.
#[test]
fn the_weighted_split_recovers_from_an_agent_sigkill_without_sharing_a_gpu() {
    let mut c = Cluster::start(&["--role", "light=weight:1", "--role", "heavy=weight:3"]);
    for _ in 0..2 {
        c.add_agent(AgentOpts {
            simulate_gpus: Some("8xA100-SXM4-40GB"),
            ..AgentOpts::default()
        });
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let test = "weights-kill";
    let mut a = Greedy::new("A", "light", 0.05, 16, 1);
    let mut b = Greedy::new("B", "heavy", 0.05, 16, 1);
    a.run_secs = "3";
    b.run_secs = "3";
    let (ma, mb) = (a.marker(test), b.marker(test));
    // Every live process of both frameworks, every 50 ms.
    let watch = gpuctl_tests::InvariantWatch::start(MARKER_VAR, &env_marker(test));
    rt.block_on(a.start(c.master_addr.clone(), test));
    rt.block_on(b.start(c.master_addr.clone(), test));
    settles_one_to_three("weights 1:3", &c, &ma, &mb);
    c.agents[0].kill();
    std::thread::sleep(Duration::from_secs(5));
    c.restart_agent(0);
    settles_one_to_three("weights 1:3 after the agent's SIGKILL", &c, &ma, &mb);
    // What the watch saw over the whole run, not at one instant (tasks of
    // 3 s churn: how many live at a given moment depends on the machine's
    // load): tasks of both frameworks each with one GPU, never more live at
    // once than the 16 GPUs, and not just a handful (the check is not
    // vacuous).
    let seen = watch.assert_held();
    let of = |name: &str| {
        seen.tasks
            .keys()
            .filter(|t| t.rsplit('.').next().is_some_and(|n| n.starts_with(name)))
            .count()
    };
    assert!(
        of("A-") >= 4 && of("B-") >= 12,
        "the watch saw {} of A's tasks and {} of B's: {:?}",
        of("A-"),
        of("B-"),
        seen.tasks.keys().collect::<Vec<_>>()
    );
    assert!(
        seen.tasks.values().all(|g| g.len() == 1),
        "{:?}",
        seen.tasks
    );
    assert!(
        seen.most_at_once <= 16,
        "{} tasks live at once on 16 GPUs",
        seen.most_at_once
    );
    drop(rt);
}

/// A CPU-only framework that takes every cpu it is offered cannot leave
/// an 8-GPU agent's GPUs without the cpus and memory to use them, even
/// when GPU agents are offered to all; no offer carries GPUs without
/// their reserve.
#[test]
fn cpu_only_work_cannot_strand_gpus() {
    let mut c = Cluster::start(&["--offer-gpu-agents-to-all"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let test = "strand";
    let cpu = Greedy::new("C", "default", 1.0, 1024, 0);
    let gpu = Greedy::new("G", "default", 1.0, 1024, 1);
    let (mc, mg) = (cpu.marker(test), gpu.marker(test));
    let gpu_offers = gpu.offers.clone();
    rt.block_on(cpu.start(c.master_addr.clone(), test));
    c.add_agent(AgentOpts {
        simulate_gpus: Some("8xA100-SXM4-40GB"),
        extra: vec![
            "--cpus".into(),
            "64".into(),
            "--mem-mib".into(),
            (256 * 1024).to_string(),
        ],
        ..AgentOpts::default()
    });
    // All but the 8 GPUs' reserve (2 cpus, 8 GiB each): 48 tasks.
    settles("cpu-only", Duration::from_secs(60), || {
        let n = live_tasks(&mc);
        (n == 48).then_some(()).ok_or(format!("C runs {n}"))
    });
    rt.block_on(gpu.start(c.master_addr.clone(), test));
    settles("gpu", Duration::from_secs(60), || {
        let n = live_tasks(&mg);
        (n == 8).then_some(()).ok_or(format!("G runs {n}"))
    });
    for o in gpu_offers.lock().unwrap().iter() {
        let r = o.resources.unwrap_or_default();
        let g = o.gpus.len() as f64;
        assert!(
            r.cpus + 1e-9 >= 2.0 * g && r.mem_mib as f64 >= 8192.0 * g,
            "an offer of {} GPUs with {} cpus and {} MiB",
            o.gpus.len(),
            r.cpus,
            r.mem_mib
        );
    }
    drop(rt);
}
