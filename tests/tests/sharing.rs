//! Fractions of a shared GPU end to end (issue 34): real master, agent and
//! gpuctl binaries. One simulated A100 of 40 GiB marked shareable: four
//! quarter jobs run at once on it, a fifth waits, a whole-GPU job is never
//! given it, and an agent SIGKILLed under the shared tasks comes back to
//! the same count. With MPS (tests/fake-mps, a stand-in control program
//! that records what it is told) and real Docker: a daemon per GPU,
//! tenant and user, its pipe directory and /dev/shm in that GPU's tasks
//! only, the limits in each task's environment, surviving an agent
//! SIGKILL, started again when it dies. A framework (the scheduler API) offered the shared
//! GPU with its free room, launching two fractions of it.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use std::path::{Path, PathBuf};

use futures::StreamExt;
use gpuctl_proto::pb;
use gpuctl_tests::{busybox_image, docker_or_skip, wait_for, AgentOpts, Cluster, Gpuctl};

fn quarter(c: &Cluster, name: &str) -> String {
    c.submit(&[
        "--name",
        name,
        "--gpu-mem",
        "10GiB",
        "--cpus",
        "0.1",
        "--",
        "sleep",
        "600",
    ])
}

#[test]
fn four_quarters_share_a_gpu_and_the_fifth_waits() {
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts {
        simulate_gpus: Some("1xA100-SXM4-40GB"),
        // The agent's default: its GPU shareable from its registration on.
        extra: vec!["--share-gpus".into(), "time-slice".into()],
        // The shared tasks must outlive the agent's SIGKILL below.
        stop_tasks_on_shutdown: false,
        ..Default::default()
    });
    let gpus = c.json(&["gpus", "--json"]);
    assert_eq!(gpus[0]["share_mode"], "time-slice", "{gpus}");

    let jobs: Vec<String> = (0..4).map(|i| quarter(&c, &format!("q{i}"))).collect();
    for j in &jobs {
        c.wait_state(j, "RUNNING", Duration::from_secs(30));
    }
    let fifth = quarter(&c, "q4");
    let whole = c.submit(&[
        "--name", "whole", "--gpus", "1", "--cpus", "0.1", "--", "true",
    ]);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(c.job(&fifth)["state"], "QUEUED");
    assert_eq!(c.job(&whole)["state"], "QUEUED", "a shared GPU given whole");
    let shares = |c: &Cluster| {
        c.json(&["gpus", "--json"])[0]["shares"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    assert_eq!(shares(&c).len(), 4);
    let table = c.ok(&["gpus"]);
    assert!(table.contains("SHARED (time-slice)"), "{table}");
    assert_eq!(table.matches("└ share").count(), 4, "{table}");
    let got = c.ok(&["jobs", "get", &jobs[0]]);
    assert!(
        got.contains("a fraction of a shared GPU each: 10GiB"),
        "{got}"
    );
    // The list says what each holds, not "0 GPUs"; the fifth waits for
    // GPU memory on the shared GPU, not for a free GPU; JSON has the
    // fraction.
    let list = c.ok(&["jobs", "list"]);
    let row = |id: &str| {
        list.lines()
            .find(|l| l.starts_with(&format!("{id} ")))
            .unwrap_or_else(|| panic!("no row {id}: {list}"))
            .to_string()
    };
    let cells: Vec<String> = row(&jobs[0])
        .split_whitespace()
        .map(str::to_string)
        .collect();
    assert_eq!(cells[4], "frac:10GiB", "{list}");
    assert!(
        row(&fifth).contains("1 short of free GPU memory on shared GPUs"),
        "{list}"
    );
    assert!(!row(&fifth).contains("short of free GPUs"), "{list}");
    assert_eq!(c.job(&fifth)["placement"]["gpu_mem_mib"], 10 * 1024);
    // Each task says what its agent enforces of it: time-slicing, nothing.
    assert_eq!(c.job(&jobs[0])["tasks"][0]["enforcement"], "none");
    assert!(
        got.contains(&format!("Enforcement of {}.0: none", jobs[0])),
        "{got}"
    );

    // The agent SIGKILLed under them: they run on, and the count holds.
    c.restart_agent(0);
    wait_for(Duration::from_secs(30), "the agent back", || {
        c.agents_json()
            .first()
            .is_some_and(|a| a["state"] == "ACTIVE")
    });
    for j in &jobs {
        assert_eq!(c.job(j)["state"], "RUNNING", "{}", c.diagnostics());
    }
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(c.job(&fifth)["state"], "QUEUED");
    assert_eq!(shares(&c).len(), 4);

    // One ends: the fifth takes its place.
    c.ok(&["jobs", "cancel", &jobs[0]]);
    c.wait_state(&fifth, "RUNNING", Duration::from_secs(30));
    assert_eq!(c.job(&whole)["state"], "QUEUED");
    for j in jobs.iter().skip(1).chain([&fifth, &whole]) {
        c.ok(&["jobs", "cancel", j]);
    }
}

/// The pid in a daemon's pid file, when it names a live process.
fn daemon_pid(pipe: &Path) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let state = stat.rsplit_once(')')?.1.trim().chars().next()?;
    (state != 'Z').then_some(pid)
}

#[test]
fn mps_fractions_get_a_daemon_their_limits_and_only_their_gpus_pipe() {
    if !docker_or_skip("mps_fractions_get_a_daemon_their_limits_and_only_their_gpus_pipe") {
        return;
    }
    let image = busybox_image();
    let control = gpuctl_tests::fake_mps_control();
    let mut c = Cluster::start(&[]);
    let agent = c.add_agent(AgentOpts {
        simulate_gpus: Some("2xA100-SXM4-40GB"),
        runtime: "docker,process",
        extra: vec!["--mps-control".into(), control.display().to_string()],
        stop_tasks_on_shutdown: false,
        ..Default::default()
    });
    let gpus = c.json(&["gpus", "--json"]);
    let uuid = gpus[0]["uuid"].as_str().unwrap().to_string();
    c.ok(&["gpus", "share", &uuid, "--mode", "mps"]);
    let table = c.ok(&["gpus"]);
    assert!(table.contains("SHARED (mps)"), "{table}");

    // Two fractions, one of which tries to set its own MPS limit (naming a
    // GPU it cannot see, which would drop MPS's limit): the agent's wins.
    let script = "echo pipe=$CUDA_MPS_PIPE_DIRECTORY mem=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT \
                  pct=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; ls $CUDA_MPS_PIPE_DIRECTORY; \
                  touch /dev/shm/from-$GPUCTL_TASK_ID; echo ready; sleep 600";
    let frac = |name: &str, extra: &[&str]| {
        let mut args = vec![
            "--name",
            name,
            "--image",
            &image,
            "--gpu-mem",
            "10GiB",
            "--gpu-compute",
            "25",
            "--cpus",
            "0.1",
        ];
        args.extend(extra);
        args.extend(["--", "sh", "-c", script]);
        c.submit(&args)
    };
    let a = frac("a", &[]);
    let b = frac(
        "b",
        &["--env", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G,7=1G"],
    );
    // A whole GPU beside them: no MPS pipe in it.
    let whole = c.submit(&[
        "--name", "whole", "--image", &image, "--gpus", "1", "--cpus", "0.1", "--", "sh", "-c",
        "ls /run/nvidia-mps || echo no-mps-pipe; echo mps-env=${CUDA_MPS_PIPE_DIRECTORY:-none}; sleep 600",
    ]);
    for j in [&a, &b, &whole] {
        c.wait_state(j, "RUNNING", Duration::from_secs(60));
    }
    let logs = |j: &str| c.ok(&["jobs", "logs", j]);
    for j in [&a, &b] {
        wait_for(Duration::from_secs(30), "the task's output", || {
            logs(j).contains("ready")
        });
        let out = logs(j);
        assert!(
            out.contains("pipe=/run/nvidia-mps mem=0=10240M pct=25"),
            "{out}"
        );
        // The daemon's socket and pid file, seen through the mount.
        assert!(out.contains("control"), "{out}");
        assert!(out.contains("nvidia-cuda-mps-control.pid"), "{out}");
        assert_eq!(c.job(j)["tasks"][0]["enforcement"], "mps");
        let got = c.ok(&["jobs", "get", j]);
        assert!(got.contains(&format!("Enforcement of {j}.0: mps")), "{got}");
    }
    wait_for(
        Duration::from_secs(30),
        "the whole-GPU task's output",
        || logs(&whole).contains("mps-env="),
    );
    let out = logs(&whole);
    assert!(
        out.contains("no-mps-pipe") && out.contains("mps-env=none"),
        "{out}"
    );
    assert_eq!(
        c.job(&whole)["tasks"][0]["enforcement"],
        serde_json::Value::Null
    );

    // One daemon for the GPU and the (default) tenant, given the GPU.
    // Both containers run as the same user (their image's), so one daemon:
    // the default tenant's, for that user.
    let daemons: Vec<PathBuf> = std::fs::read_dir(c.dir.path().join(format!("agent0/mps/{uuid}")))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(daemons.len(), 1, "{daemons:?}");
    let server = daemons[0].clone();
    assert!(
        server
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("default."),
        "{}",
        server.display()
    );
    let pipe: PathBuf = server.join("pipe");
    let log = || std::fs::read_to_string(server.join("log/control.log")).unwrap_or_default();
    assert_eq!(log().matches(" start ").count(), 1, "{}", log());
    assert!(
        log().contains(&format!("CUDA_VISIBLE_DEVICES={uuid}")),
        "{}",
        log()
    );
    let pid = daemon_pid(&pipe).expect("the daemon runs");
    // Each container's id is recorded with its task: a container outside
    // its task's cgroup (Docker's systemd driver) is known by it when the
    // agent sums its processes' GPU memory.
    for j in [&a, &b] {
        let task = format!("{j}.0");
        let recorded = std::fs::read_to_string(
            c.dir
                .path()
                .join(format!("agent0/state/{task}/container-id")),
        )
        .unwrap();
        let ids = gpuctl_tests::task_containers(&agent, &task);
        assert!(
            ids.len() == 1 && recorded.starts_with(&ids[0]),
            "{recorded} vs {ids:?}"
        );
    }
    // Both tasks' /dev/shm is the daemon's.
    for j in [&a, &b] {
        assert!(
            server.join(format!("shm/from-{j}.0")).exists(),
            "{j}'s /dev/shm is not the daemon's"
        );
    }

    // The agent SIGKILLed: the daemon outlives it like the tasks do, and
    // the new agent keeps it.
    c.restart_agent(0);
    wait_for(Duration::from_secs(30), "the agent back", || {
        c.agents_json()
            .first()
            .is_some_and(|a| a["state"] == "ACTIVE")
    });
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(daemon_pid(&pipe), Some(pid), "{}", log());
    for j in [&a, &b] {
        assert_eq!(c.job(j)["state"], "RUNNING", "{}", c.diagnostics());
    }

    // The daemon dies under its tasks: the agent starts it again.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_for(Duration::from_secs(30), "the daemon restarted", || {
        daemon_pid(&pipe).is_some_and(|p| p != pid)
    });
    assert_eq!(log().matches(" start ").count(), 2, "{}", log());

    for j in [&a, &b, &whole] {
        c.ok(&["jobs", "cancel", j]);
        c.wait_job(j, 60);
    }
}

/// The next event of the stream that `want` takes, acknowledging every
/// update with a uuid on the way (the agent holds a task's later updates
/// until then).
async fn next_event(
    client: &mut pb::scheduler_client::SchedulerClient<tonic::transport::Channel>,
    framework_id: &str,
    events: &mut tonic::Streaming<pb::Event>,
    mut want: impl FnMut(&pb::event::Event) -> bool,
) -> pb::event::Event {
    loop {
        let e = tokio::time::timeout(Duration::from_secs(30), events.next())
            .await
            .expect("an event within 30 s")
            .expect("stream open")
            .expect("event")
            .event
            .unwrap();
        if let pb::event::Event::Update(u) = &e {
            if !u.uuid.is_empty() {
                client
                    .acknowledge(pb::AcknowledgeRequest {
                        framework_id: framework_id.to_string(),
                        agent_id: u.agent_id.clone(),
                        task_id: u.task_id.clone(),
                        uuid: u.uuid.clone(),
                    })
                    .await
                    .unwrap();
            }
        }
        if want(&e) {
            return e;
        }
    }
}

/// Issue 34, frameworks: the shared GPU is offered with its free room and
/// never whole; an Accept asking more of it than offered is refused whole,
/// naming the field; two halves launch and run at once, each given the
/// GPU's uuid and (MPS) its limit under the framework's tenant's daemon;
/// one killed, its half is offered again.
#[test]
fn a_framework_launches_two_fractions_of_a_shared_gpu() {
    // tests/fake-mps's daemon needs root (its /dev/shm is a tmpfs mount):
    // without root the GPU is time-sliced and MPS is not checked.
    let mps = nix::unistd::Uid::effective().is_root();
    let mut c = Cluster::start(&[]);
    let extra = if mps {
        vec![
            "--mps-control".into(),
            gpuctl_tests::fake_mps_control().display().to_string(),
        ]
    } else {
        eprintln!("not root: the framework's fractions are time-sliced, MPS is not checked");
        vec![]
    };
    let agent = c.add_agent(AgentOpts {
        simulate_gpus: Some("1xA100-SXM4-40GB"),
        extra,
        ..Default::default()
    });
    let uuid = c.json(&["gpus", "--json"])[0]["uuid"]
        .as_str()
        .unwrap()
        .to_string();
    let mode = if mps { "mps" } else { "time-slice" };
    c.ok(&["gpus", "share", &uuid, "--mode", mode]);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut client = pb::scheduler_client::SchedulerClient::connect(format!(
            "http://{}",
            c.master_addr
        ))
        .await
        .unwrap();
        let mut events = client
            .subscribe(pb::SubscribeRequest {
                framework: Some(pb::FrameworkInfo {
                    name: "fractions".into(),
                    capabilities: vec![pb::FrameworkCapability::GpuResources as i32],
                    failover_timeout_secs: 30.0,
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut fw = String::new();
        let mut offer = None;
        while offer.is_none() {
            match next_event(&mut client, &fw, &mut events, |e| {
                matches!(
                    e,
                    pb::event::Event::Subscribed(_) | pb::event::Event::Offers(_)
                )
            })
            .await
            {
                pb::event::Event::Subscribed(s) => fw = s.framework_id,
                pb::event::Event::Offers(o) => offer = o.offers.into_iter().next(),
                _ => unreachable!(),
            }
        }
        let offer = offer.unwrap();
        assert_eq!(offer.agent_id, agent);
        assert!(offer.gpus.is_empty(), "a shared GPU offered whole: {offer:?}");
        assert_eq!(offer.resources.as_ref().map(|r| r.gpus), Some(0));
        assert_eq!(offer.shared_gpus.len(), 1, "{offer:?}");
        let sh = &offer.shared_gpus[0];
        assert_eq!(sh.gpu.as_ref().map(|g| g.uuid.as_str()), Some(uuid.as_str()));
        assert_eq!(
            (sh.mode.as_str(), sh.free_mem_mib, sh.free_compute_pct),
            (mode, 40960, 100)
        );

        let script = "echo gpus=$NVIDIA_VISIBLE_DEVICES pipe=$CUDA_MPS_PIPE_DIRECTORY \
                      mem=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT pct=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; \
                      sleep 600";
        let half = |id: &str| pb::TaskInfo {
            task_id: id.into(),
            agent_id: agent.clone(),
            command: vec!["sh".into(), "-c".into(), script.into()],
            resources: Some(pb::Resources {
                cpus: 0.1,
                mem_mib: 16,
                gpus: 0,
                ports: 0,
            }),
            gpu_fraction: Some(pb::GpuFraction {
                gpu_uuid: uuid.clone(),
                mem_mib: 20480,
                compute_pct: 25,
            }),
            ..Default::default()
        };
        let accept = |tasks: Vec<pb::TaskInfo>| pb::AcceptRequest {
            framework_id: fw.clone(),
            offer_ids: vec![offer.id.clone()],
            operations: vec![pb::Operation {
                operation: Some(pb::operation::Operation::Launch(pb::Launch { tasks })),
            }],
            filters: None,
        };
        // Three halves: more than the GPU has. Refused whole, naming the
        // third; nothing launches and the offer stays outstanding.
        let err = client
            .accept(accept(vec![half("a"), half("b"), half("c")]))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(
            err.message()
                .contains("operations[0].tasks[2].gpu_fraction.mem_mib"),
            "{err}"
        );
        let mut bad = half("a");
        if let Some(f) = bad.gpu_fraction.as_mut() {
            f.compute_pct = 101;
        }
        let err = client.accept(accept(vec![bad])).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(
            err.message()
                .contains("operations[0].tasks[0].gpu_fraction.compute_pct"),
            "{err}"
        );
        // Two halves: both run at once on the one GPU.
        client
            .accept(accept(vec![half("a"), half("b")]))
            .await
            .unwrap();
        let mut running = std::collections::BTreeSet::new();
        while running.len() < 2 {
            if let pb::event::Event::Update(u) =
                next_event(&mut client, &fw, &mut events, |e| {
                    matches!(e, pb::event::Event::Update(_))
                })
                .await
            {
                assert!(
                    u.state != pb::TaskState::TaskError as i32
                        && u.state != pb::TaskState::TaskFailed as i32,
                    "{u:?}"
                );
                if u.state == pb::TaskState::TaskRunning as i32 {
                    running.insert(u.task_id);
                }
            }
        }
        // Seen from the master: two fractions of the GPU, none whole.
        let gpu = &c.json(&["gpus", "--json"])[0];
        assert!(gpu["task_id"].is_null(), "{gpu}");
        let shares = gpu["shares"].as_array().unwrap();
        assert_eq!(shares.len(), 2, "{gpu}");
        assert!(shares.iter().all(|s| s["mem_mib"] == 20480), "{gpu}");
        // Seen from the agent: each has the GPU, and, with MPS, its limit
        // under the daemon of the framework's (default) tenant.
        for id in ["a", "b"] {
            let log = c.dir.path().join(format!("agent0/tasks/{fw}.{id}/output.log"));
            let mut out = String::new();
            wait_for(Duration::from_secs(20), "the task's output", || {
                out = std::fs::read_to_string(&log).unwrap_or_default();
                out.contains("gpus=")
            });
            assert!(out.contains(&format!("gpus={uuid} ")), "{out}");
            if mps {
                // The daemon of the default tenant and the task's user: its
                // group's `pipe` link names the directory the task got.
                let pipe = out
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("pipe="))
                    .unwrap_or_default();
                let groups = c.dir.path().join(format!("agent0/mps/{uuid}"));
                let linked = std::fs::read_dir(&groups)
                    .unwrap()
                    .flatten()
                    .filter(|g| g.file_name().to_string_lossy().starts_with("default.u"))
                    .filter_map(|g| std::fs::read_link(g.path().join("pipe")).ok())
                    .any(|to| to == Path::new(pipe));
                assert!(
                    linked && pipe.contains("/mps/.pipes/") && out.contains(" mem=0=20480M pct=25"),
                    "{out}"
                );
            }
        }
        // One killed: its half is free, and offered again at once.
        client
            .kill(pb::KillRequest {
                framework_id: fw.clone(),
                task_id: "a".into(),
            })
            .await
            .unwrap();
        let again = next_event(&mut client, &fw, &mut events, |e| {
            matches!(e, pb::event::Event::Offers(o)
                if o.offers.iter().any(|o| !o.shared_gpus.is_empty()))
        })
        .await;
        let pb::event::Event::Offers(again) = again else {
            unreachable!()
        };
        let sh = again
            .offers
            .iter()
            .flat_map(|o| &o.shared_gpus)
            .next()
            .unwrap();
        assert_eq!((sh.free_mem_mib, sh.free_compute_pct), (20480, 75));
        client
            .teardown(pb::TeardownRequest { framework_id: fw })
            .await
            .unwrap();
    });
}
