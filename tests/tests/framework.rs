//! The framework API end to end: the example framework on a real cluster,
//! and a raw client checking that offers name GPUs and that an Accept that
//! would give a GPU twice, or reuse a task id, is refused whole with the
//! offers left outstanding.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use gpuctl_proto::pb;
use gpuctl_tests::Gpuctl;
use gpuctl_tests::{AgentOpts, Cluster};
use pb::scheduler_client::SchedulerClient;

#[test]
fn the_example_framework_runs_its_tasks_and_sees_every_update() {
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts::default());
    let out = std::process::Command::new(gpuctl_tests::bin("simple-framework"))
        .args([
            "--master",
            &c.master_addr,
            "--tasks",
            "4",
            "--gpu-tasks",
            "2",
            "--gpus-per-task",
            "2",
            "--timeout",
            "60",
            "--json",
            "--",
            "sh",
            "-c",
            "echo gpus=$NVIDIA_VISIBLE_DEVICES",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let tasks = report["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 4);
    let mut gpus = BTreeSet::new();
    for t in tasks {
        assert_eq!(t["state"], "FINISHED", "{report}");
        assert_eq!(t["exit_code"], 0);
        for g in t["gpus"].as_array().unwrap() {
            assert!(
                gpus.insert(g.as_str().unwrap().to_string()),
                "GPU used twice"
            );
        }
    }
    assert_eq!(gpus.len(), 4, "two tasks with two GPUs each");
    // It saw every state of every task, in order.
    for t in tasks {
        let id = t["id"].as_str().unwrap();
        let states: Vec<&str> = stderr
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("{id} ")))
            .filter_map(|l| l.split_whitespace().next())
            .filter(|w| w.chars().all(|c| c.is_ascii_uppercase()))
            .collect();
        assert_eq!(
            states.last().copied(),
            Some("FINISHED"),
            "{id}: {states:?}\n{stderr}"
        );
        assert!(states.contains(&"RUNNING"), "{id}: {states:?}");
    }
    // The master knows the framework's tasks ended and their GPUs are free.
    let free = c.json(&["gpus", "--json"]);
    assert!(free
        .as_array()
        .unwrap()
        .iter()
        .all(|g| g["task_id"].is_null()));
}

async fn next_event(
    events: &mut tonic::Streaming<pb::Event>,
    mut want: impl FnMut(&pb::event::Event) -> bool,
) -> pb::event::Event {
    loop {
        let e = tokio::time::timeout(Duration::from_secs(20), events.next())
            .await
            .expect("an event within 20 s")
            .expect("stream open")
            .expect("event");
        let e = e.event.unwrap();
        if want(&e) {
            return e;
        }
    }
}

#[test]
fn offers_name_gpus_and_bad_accepts_are_refused_leaving_the_offers() {
    let mut c = Cluster::start(&[]);
    let agent = c.add_agent(AgentOpts::default());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut client = SchedulerClient::connect(format!("http://{}", c.master_addr))
            .await
            .unwrap();
        // Bad input names the field.
        let err = client
            .subscribe(pb::SubscribeRequest {
                demand: None,
                request_id: String::new(),
                suppressed: false,
                framework: Some(pb::FrameworkInfo {
                    name: String::new(),
                    ..Default::default()
                }),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("framework.name"), "{err}");

        let mut events = client
            .subscribe(pb::SubscribeRequest {
                demand: None,
                request_id: String::new(),
                suppressed: false,
                framework: Some(pb::FrameworkInfo {
                    name: "raw".into(),
                    roles: vec!["ml".into()],
                    capabilities: vec![pb::FrameworkCapability::GpuResources as i32],
                    failover_timeout_secs: 30.0,
                    ..Default::default()
                }),
            })
            .await
            .unwrap()
            .into_inner();
        let pb::event::Event::Subscribed(sub) = next_event(&mut events, |e| {
            matches!(e, pb::event::Event::Subscribed(_))
        })
        .await
        else {
            unreachable!()
        };
        let fw = sub.framework_id;
        let pb::event::Event::Offers(offers) =
            next_event(&mut events, |e| matches!(e, pb::event::Event::Offers(_))).await
        else {
            unreachable!()
        };
        let offer = offers.offers[0].clone();
        assert_eq!(offer.agent_id, agent);
        assert_eq!(offer.gpus.len(), 4, "the whole agent, GPU by GPU");
        assert!(offer
            .gpus
            .iter()
            .all(|g| g.uuid.starts_with("GPU-") && g.memory_mib == 40960));
        let gpu = offer.gpus[0].uuid.clone();
        let task = |id: &str| pb::TaskInfo {
            task_id: id.into(),
            agent_id: agent.clone(),
            command: vec!["sleep".into(), "30".into()],
            resources: Some(pb::Resources {
                cpus: 0.1,
                mem_mib: 16,
                gpus: 1,
                ports: 0,
            }),
            gpu_uuids: vec![gpu.clone()],
            ..Default::default()
        };
        let accept = |ops: Vec<pb::TaskInfo>, offer_id: &str| pb::AcceptRequest {
            framework_id: fw.clone(),
            offer_ids: vec![offer_id.to_string()],
            operations: vec![pb::Operation {
                operation: Some(pb::operation::Operation::Launch(pb::Launch { tasks: ops })),
            }],
            filters: None,
        };
        // Two tasks naming the same GPU: refused before anything is taken,
        // naming the second, and the offer stays outstanding.
        let err = client
            .accept(accept(vec![task("a"), task("b")], &offer.id))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(
            err.message()
                .contains("operations[0].tasks[1].gpu_uuids[0]"),
            "{err}"
        );
        // One task naming one GPU twice: the same.
        let mut twice = task("a");
        twice.gpu_uuids = vec![gpu.clone(), gpu.clone()];
        if let Some(r) = twice.resources.as_mut() {
            r.gpus = 2;
        }
        let err = client
            .accept(accept(vec![twice], &offer.id))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(
            err.message()
                .contains("operations[0].tasks[0].gpu_uuids[1]"),
            "{err}"
        );
        // The same offer, used right: "a" launches.
        client
            .accept(accept(vec![task("a")], &offer.id))
            .await
            .unwrap();
        // The same Accept sent again (as after an unknown outcome) launches
        // nothing: its offer is used up, whatever the first one did.
        let err = client
            .accept(accept(vec![task("a")], &offer.id))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
        assert!(err.message().contains(&offer.id), "{err}");
        // A task id in use: AlreadyExists, naming it, and that offer too is
        // left for another try.
        // (a's updates come meanwhile: acknowledge them, or the master
        // holds its later ones back. A STAGING not overtaken by STARTING
        // before it was forwarded has no uuid and needs none.)
        let more = loop {
            match next_event(&mut events, |e| {
                matches!(e, pb::event::Event::Offers(_) | pb::event::Event::Update(_))
            })
            .await
            {
                pb::event::Event::Offers(o) => break o,
                pb::event::Event::Update(u) if u.uuid.is_empty() => {}
                pb::event::Event::Update(u) => {
                    client
                        .acknowledge(pb::AcknowledgeRequest {
                            framework_id: fw.clone(),
                            agent_id: u.agent_id.clone(),
                            task_id: u.task_id.clone(),
                            uuid: u.uuid.clone(),
                        })
                        .await
                        .unwrap();
                }
                _ => unreachable!(),
            }
        };
        let again = more.offers[0].clone();
        let other_gpu = again.gpus[0].uuid.clone();
        assert_ne!(other_gpu, gpu, "a's GPU is not offered again");
        let mut reused = task("a");
        reused.gpu_uuids = vec![other_gpu];
        let err = client
            .accept(accept(vec![reused], &again.id))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::AlreadyExists);
        assert!(
            err.message().contains("operations[0].tasks[0].task_id"),
            "{err}"
        );
        client
            .decline(pb::DeclineRequest {
                framework_id: fw.clone(),
                offer_ids: vec![again.id.clone()],
                filters: None,
            })
            .await
            .unwrap();
        let gpus = c.json(&["gpus", "--json"]);
        let holders: Vec<&str> = gpus
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|g| g["task_id"].as_str())
            .collect();
        assert_eq!(holders, vec![format!("{fw}.a").as_str()]);
        // An offer can be used once.
        let err = client
            .accept(pb::AcceptRequest {
                framework_id: fw.clone(),
                offer_ids: vec![offer.id.clone()],
                operations: vec![],
                filters: None,
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
        assert!(err.message().contains(&offer.id), "{err}");
        // Kill: the running task ends KILLED; acknowledge what carries a uuid.
        client
            .kill(pb::KillRequest {
                framework_id: fw.clone(),
                task_id: "a".into(),
            })
            .await
            .unwrap();
        loop {
            let pb::event::Event::Update(u) = next_event(
                &mut events,
                |e| matches!(e, pb::event::Event::Update(u) if u.task_id == "a"),
            )
            .await
            else {
                unreachable!()
            };
            if !u.uuid.is_empty() {
                client
                    .acknowledge(pb::AcknowledgeRequest {
                        framework_id: fw.clone(),
                        agent_id: u.agent_id.clone(),
                        task_id: u.task_id.clone(),
                        uuid: u.uuid.clone(),
                    })
                    .await
                    .unwrap();
            }
            if u.state == pb::TaskState::TaskKilled as i32 {
                break;
            }
        }
        client
            .teardown(pb::TeardownRequest { framework_id: fw })
            .await
            .unwrap();
    });
}

fn info(id: &str, failover_secs: f64) -> pb::SubscribeRequest {
    pb::SubscribeRequest {
        demand: None,
        request_id: String::new(),
        framework: Some(pb::FrameworkInfo {
            id: id.into(),
            name: "failover".into(),
            roles: vec![],
            capabilities: vec![pb::FrameworkCapability::GpuResources as i32],
            failover_timeout_secs: failover_secs,
        }),
        suppressed: false,
    }
}

#[test]
fn updates_wait_for_acknowledgement_and_frameworks_fail_over() {
    let mut c = Cluster::start(&[]);
    let agent = c.add_agent(AgentOpts::default());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let addr = format!("http://{}", c.master_addr);
        let mut client = SchedulerClient::connect(addr.clone()).await.unwrap();
        let mut events = client.subscribe(info("", 2.0)).await.unwrap().into_inner();
        let pb::event::Event::Subscribed(sub) = next_event(&mut events, |e| {
            matches!(e, pb::event::Event::Subscribed(_))
        })
        .await
        else {
            unreachable!()
        };
        let fw = sub.framework_id;
        let pb::event::Event::Offers(offers) =
            next_event(&mut events, |e| matches!(e, pb::event::Event::Offers(_))).await
        else {
            unreachable!()
        };
        let offer = &offers.offers[0];
        let task = |id: &str, cmd: &[&str], gpu: &str| pb::TaskInfo {
            task_id: id.into(),
            agent_id: agent.clone(),
            command: cmd.iter().map(|s| s.to_string()).collect(),
            resources: Some(pb::Resources {
                cpus: 0.1,
                mem_mib: 16,
                gpus: 1,
                ports: 0,
            }),
            gpu_uuids: vec![gpu.to_string()],
            ..Default::default()
        };
        client
            .accept(pb::AcceptRequest {
                framework_id: fw.clone(),
                offer_ids: vec![offer.id.clone()],
                operations: vec![pb::Operation {
                    operation: Some(pb::operation::Operation::Launch(pb::Launch {
                        tasks: vec![
                            task("quick", &["true"], &offer.gpus[0].uuid),
                            task("long", &["sleep", "300"], &offer.gpus[1].uuid),
                        ],
                    })),
                }],
                filters: None,
            })
            .await
            .unwrap();
        // "quick" ends at once, but its updates come one at a time: the
        // next only after the previous is acknowledged.
        let mut seen = Vec::new();
        loop {
            let pb::event::Event::Update(u) = next_event(
                &mut events,
                |e| matches!(e, pb::event::Event::Update(u) if u.task_id == "quick"),
            )
            .await
            else {
                unreachable!()
            };
            seen.push(u.state);
            if u.uuid.is_empty() {
                continue; // STAGING, made by the master
            }
            if u.state == pb::TaskState::TaskStarting as i32 {
                // Unacknowledged, nothing more comes for this task.
                let more = tokio::time::timeout(Duration::from_millis(1500), async {
                    next_event(
                        &mut events,
                        |e| matches!(e, pb::event::Event::Update(x) if x.task_id == "quick"),
                    )
                    .await
                })
                .await;
                assert!(
                    more.is_err(),
                    "an update arrived before the acknowledgement"
                );
            }
            client
                .acknowledge(pb::AcknowledgeRequest {
                    framework_id: fw.clone(),
                    agent_id: u.agent_id.clone(),
                    task_id: u.task_id.clone(),
                    uuid: u.uuid.clone(),
                })
                .await
                .unwrap();
            if u.state == pb::TaskState::TaskFinished as i32 {
                break;
            }
        }
        // STAGING is the master's own word and updates are forwarded as the
        // task's latest state: when the agent's STARTING is recorded before
        // the leader forwards, STAGING is skipped (docs/framework-api.md).
        // The agent's updates always come, in order.
        if seen.first() == Some(&(pb::TaskState::TaskStaging as i32)) {
            seen.remove(0);
        }
        assert_eq!(
            seen,
            vec![
                pb::TaskState::TaskStarting as i32,
                pb::TaskState::TaskRunning as i32,
                pb::TaskState::TaskFinished as i32
            ]
        );

        // Disconnect; re-subscribing with the id within the failover
        // timeout re-attaches: "long" is still there.
        drop(events);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut events = client.subscribe(info(&fw, 2.0)).await.unwrap().into_inner();
        let pb::event::Event::Subscribed(again) = next_event(&mut events, |e| {
            matches!(e, pb::event::Event::Subscribed(_))
        })
        .await
        else {
            unreachable!()
        };
        assert_eq!(again.framework_id, fw);
        let pb::event::Event::Update(u) = next_event(
            &mut events,
            |e| matches!(e, pb::event::Event::Update(u) if u.task_id == "long"),
        )
        .await
        else {
            unreachable!()
        };
        assert!(u.state != pb::TaskState::TaskKilled as i32);

        // Disconnect for longer than the timeout: the framework is removed
        // and its task killed; it cannot come back.
        drop(events);
        let long_key = format!("{fw}.long");
        // Poll asynchronously: this runtime also drives the client's
        // connection, which must tell the master the stream was dropped.
        let freed = tokio::time::timeout(Duration::from_secs(20), async {
            while c.ok(&["gpus", "--json"]).contains(&long_key) {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await;
        assert!(freed.is_ok(), "the long task's GPU was not freed");
        let err = client.subscribe(info(&fw, 2.0)).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
        assert!(err.message().contains("removed"), "{err}");
    });
}

#[test]
fn gpuctl_jobs_and_an_external_framework_share_the_cluster() {
    // Both go through the same offers: the built-in scheduler is a framework
    // too, so a job and a framework's tasks run side by side, never on the
    // same GPU.
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts::default());
    let job = c.submit(&[
        "--name",
        "side-by-side",
        "--gpus",
        "2",
        "--",
        "sh",
        "-c",
        // Long enough that the framework's tasks run while it holds its GPUs.
        "sleep 6",
    ]);
    let out = std::process::Command::new(gpuctl_tests::bin("simple-framework"))
        .args([
            "--master",
            &c.master_addr,
            "--tasks",
            "2",
            "--gpu-tasks",
            "2",
            "--gpus-per-task",
            "1",
            "--timeout",
            "60",
            "--json",
            "--",
            "sleep",
            "1",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(c.wait_job(&job, 60).0, 0);
    let job_gpus: BTreeSet<String> = c.job(&job)["tasks"][0]["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g.as_str().unwrap().to_string())
        .collect();
    for t in report["tasks"].as_array().unwrap() {
        assert_eq!(t["state"], "FINISHED");
        for g in t["gpus"].as_array().unwrap() {
            assert!(!job_gpus.contains(g.as_str().unwrap()), "shared GPU {g}");
        }
    }
}

/// The stream ends with an ERROR saying why, when a newer subscription
/// replaces it and at Teardown; Suppress and Revive honour `roles`.
#[test]
fn replaced_and_torn_down_streams_end_with_error_and_suppress_honours_roles() {
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts::default());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut client = SchedulerClient::connect(format!("http://{}", c.master_addr))
            .await
            .unwrap();
        let mut request = info("", 30.0);
        if let Some(f) = request.framework.as_mut() {
            f.roles = vec!["ml".into(), "batch".into()];
        }
        let mut first = client
            .subscribe(request.clone())
            .await
            .unwrap()
            .into_inner();
        let pb::event::Event::Subscribed(sub) =
            next_event(&mut first, |e| matches!(e, pb::event::Event::Subscribed(_))).await
        else {
            unreachable!()
        };
        let fw = sub.framework_id;
        next_event(&mut first, |e| matches!(e, pb::event::Event::Offers(_))).await;

        // Suppress with a role the framework does not have: refused,
        // naming it.
        let err = client
            .suppress(pb::SuppressRequest {
                framework_id: fw.clone(),
                roles: vec!["ml".into(), "web".into()],
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("roles[1]"), "{err}");
        // A role it has but is not offered in ("batch"; offers come in its
        // first role): nothing changes, its offer stays outstanding.
        client
            .suppress(pb::SuppressRequest {
                framework_id: fw.clone(),
                roles: vec!["batch".into()],
            })
            .await
            .unwrap();
        // Its own offer role: the outstanding offer is rescinded and no
        // other comes, even after a revive of "batch" only.
        client
            .suppress(pb::SuppressRequest {
                framework_id: fw.clone(),
                roles: vec!["ml".into()],
            })
            .await
            .unwrap();
        next_event(&mut first, |e| matches!(e, pb::event::Event::Rescind(_))).await;
        client
            .revive(pb::ReviveRequest {
                demand: None,
                framework_id: fw.clone(),
                roles: vec!["batch".into()],
            })
            .await
            .unwrap();
        let quiet = tokio::time::timeout(
            Duration::from_secs(3),
            next_event(&mut first, |e| matches!(e, pb::event::Event::Offers(_))),
        )
        .await;
        assert!(quiet.is_err(), "no offer while its role is suppressed");
        client
            .revive(pb::ReviveRequest {
                demand: None,
                framework_id: fw.clone(),
                roles: vec!["ml".into()],
            })
            .await
            .unwrap();
        next_event(&mut first, |e| matches!(e, pb::event::Event::Offers(_))).await;

        // A second subscription with the framework id replaces the first,
        // whose stream gets ERROR and ends.
        if let Some(f) = request.framework.as_mut() {
            f.id = fw.clone();
        }
        let mut second = client.subscribe(request).await.unwrap().into_inner();
        let pb::event::Event::Error(why) =
            next_event(&mut first, |e| matches!(e, pb::event::Event::Error(_))).await
        else {
            unreachable!()
        };
        assert!(why.contains("another connection"), "{why}");
        let end = tokio::time::timeout(Duration::from_secs(10), first.next())
            .await
            .expect("the replaced stream ends");
        assert!(end.is_none(), "{end:?}");
        next_event(&mut second, |e| {
            matches!(e, pb::event::Event::Subscribed(_))
        })
        .await;

        // Teardown ends the stream with ERROR too.
        client
            .teardown(pb::TeardownRequest {
                framework_id: fw.clone(),
            })
            .await
            .unwrap();
        let pb::event::Event::Error(why) =
            next_event(&mut second, |e| matches!(e, pb::event::Event::Error(_))).await
        else {
            unreachable!()
        };
        assert!(why.contains("teardown"), "{why}");
        let end = tokio::time::timeout(Duration::from_secs(10), second.next())
            .await
            .expect("the torn down stream ends");
        assert!(end.is_none(), "{end:?}");
    });
}

/// Whether a live process has `marker` in its command line (from /proc,
/// not from gpuctl).
fn process_alive(marker: &str) -> bool {
    std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
        std::fs::read(e.path().join("cmdline"))
            .map(|c| String::from_utf8_lossy(&c).contains(marker))
            .unwrap_or(false)
    })
}

/// An update whose acknowledgement does not come is forwarded again on
/// the same stream; and the task, ended on its agent meanwhile, frees its
/// GPU at once (the agent's latest_state), though its framework hears of
/// the end only after acknowledging the earlier updates.
#[test]
fn unacknowledged_updates_are_resent_and_an_ended_task_frees_its_gpu_at_once() {
    let mut c = Cluster::start(&["--update-resend-secs", "1"]);
    let agent = c.add_agent(AgentOpts::default());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let addr = format!("http://{}", c.master_addr);
        let mut client = SchedulerClient::connect(addr).await.unwrap();
        let mut events = client.subscribe(info("", 30.0)).await.unwrap().into_inner();
        let pb::event::Event::Subscribed(sub) = next_event(&mut events, |e| {
            matches!(e, pb::event::Event::Subscribed(_))
        })
        .await
        else {
            unreachable!()
        };
        let fw = sub.framework_id;
        let pb::event::Event::Offers(offers) =
            next_event(&mut events, |e| matches!(e, pb::event::Event::Offers(_))).await
        else {
            unreachable!()
        };
        let offer = &offers.offers[0];
        let gpu = offer.gpus[0].uuid.clone();
        let marker = format!("gpuctl-latest-state-{}", std::process::id());
        client
            .accept(pb::AcceptRequest {
                framework_id: fw.clone(),
                offer_ids: vec![offer.id.clone()],
                operations: vec![pb::Operation {
                    operation: Some(pb::operation::Operation::Launch(pb::Launch {
                        tasks: vec![pb::TaskInfo {
                            task_id: "quick".into(),
                            agent_id: agent.clone(),
                            command: vec![
                                "sh".into(),
                                "-c".into(),
                                "sleep 1; true".into(),
                                marker.clone(),
                            ],
                            resources: Some(pb::Resources {
                                cpus: 0.1,
                                mem_mib: 16,
                                gpus: 1,
ports: 0,
                            }),
                            gpu_uuids: vec![gpu.clone()],
                            ..Default::default()
                        }],
                    })),
                }],
                filters: None,
            })
            .await
            .unwrap();
        let quick = |e: &pb::event::Event| {
            matches!(e, pb::event::Event::Update(u) if u.task_id == "quick" && !u.uuid.is_empty())
        };
        let pb::event::Event::Update(first) = next_event(&mut events, quick).await else {
            unreachable!()
        };
        assert_eq!(first.state, pb::TaskState::TaskStarting as i32);
        // Not acknowledged: the same update again, on the same stream.
        let pb::event::Event::Update(again) = next_event(&mut events, quick).await else {
            unreachable!()
        };
        assert_eq!((again.state, &again.uuid), (first.state, &first.uuid));

        // The task ends on the agent (RUNNING and FINISHED wait behind the
        // unacknowledged STARTING): its process is gone, and its GPU is
        // free in the master and offered again, while the framework still
        // sees STARTING.
        let freed = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                let gpus: serde_json::Value =
                    serde_json::from_str(&c.ok(&["gpus", "--json"])).unwrap();
                let ours = gpus
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|g| g["uuid"] == gpu.as_str())
                    .cloned()
                    .unwrap();
                if ours["task_id"].is_null() && !process_alive(&marker) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await;
        assert!(freed.is_ok(), "the ended task's GPU was not freed");
        let pb::event::Event::Offers(o) = next_event(&mut events, |e| {
            matches!(e, pb::event::Event::Offers(o)
                if o.offers.iter().any(|o| o.gpus.iter().any(|g| g.uuid == gpu)))
        })
        .await
        else {
            unreachable!()
        };
        assert!(!o.offers.is_empty());

        // Acknowledging brings the rest, in order.
        let mut seen = vec![first.state];
        let mut u = first;
        loop {
            client
                .acknowledge(pb::AcknowledgeRequest {
                    framework_id: fw.clone(),
                    agent_id: u.agent_id.clone(),
                    task_id: u.task_id.clone(),
                    uuid: u.uuid.clone(),
                })
                .await
                .unwrap();
            if u.state == pb::TaskState::TaskFinished as i32 {
                break;
            }
            let prev = u.uuid.clone();
            let pb::event::Event::Update(next) = next_event(&mut events, |e| {
                matches!(e, pb::event::Event::Update(x)
                    if x.task_id == "quick" && !x.uuid.is_empty() && x.uuid != prev)
            })
            .await
            else {
                unreachable!()
            };
            seen.push(next.state);
            u = next;
        }
        assert_eq!(
            seen,
            vec![
                pb::TaskState::TaskStarting as i32,
                pb::TaskState::TaskRunning as i32,
                pb::TaskState::TaskFinished as i32
            ]
        );

        // Reconciling a task the master never knew: LOST, and said why.
        client
            .reconcile(pb::ReconcileRequest {
                framework_id: fw.clone(),
                tasks: vec![pb::ReconcileTask {
                    task_id: "never-launched".into(),
                    agent_id: agent.clone(),
                }],
            })
            .await
            .unwrap();
        let pb::event::Event::Update(u) = next_event(&mut events, |e| {
            matches!(e, pb::event::Event::Update(u) if u.task_id == "never-launched")
        })
        .await
        else {
            unreachable!()
        };
        assert_eq!(u.state, pb::TaskState::TaskLost as i32);
        assert_eq!(u.reason, pb::Reason::TaskUnknown as i32);
        assert!(u.uuid.is_empty());
    });
}

/// Issue 32: a new framework's Subscribe whose answer was lost (the stream
/// dropped before SUBSCRIBED was read) is sent again with the same request
/// id and re-attaches to the framework the first one made; another id
/// makes another framework; a bad id is refused naming the field.
#[test]
fn a_subscribe_sent_again_with_its_request_id_makes_one_framework() {
    let c = Cluster::start(&[]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let addr = format!("http://{}", c.master_addr);
        let subscribe = |key: &str| {
            let mut req = info("", 30.0);
            req.request_id = key.into();
            let addr = addr.clone();
            async move {
                let mut client = SchedulerClient::connect(addr).await.unwrap();
                client.subscribe(req).await
            }
        };
        let id_of = |events: tonic::Streaming<pb::Event>| async move {
            let mut events = events;
            let pb::event::Event::Subscribed(sub) = next_event(&mut events, |e| {
                matches!(e, pb::event::Event::Subscribed(_))
            })
            .await
            else {
                unreachable!()
            };
            sub.framework_id
        };
        // The first answer is read, then the stream is lost.
        let first = id_of(subscribe("fw-key-1").await.unwrap().into_inner()).await;
        let again = id_of(subscribe("fw-key-1").await.unwrap().into_inner()).await;
        assert_eq!(again, first, "the same key re-attaches");
        // Another key, another framework: the next one, so the resend
        // made none in between.
        let other = id_of(subscribe("fw-key-2").await.unwrap().into_inner()).await;
        let number = |id: &str| id.trim_start_matches("fw-").parse::<u64>().unwrap();
        assert_eq!(number(&other), number(&first) + 1, "{first} then {other}");
        let err = subscribe("bad key").await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("request_id"), "{err}");
    });
}
