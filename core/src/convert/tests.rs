use std::collections::BTreeMap;

use super::*;
use crate::pb;
use crate::types::*;

fn mig_gpu() -> GpuInfo {
    let mut g = GpuInfo::new("GPU-a", 0, "NVIDIA A100-SXM4-40GB", 40960);
    g.mig = MigInfo {
        enabled: true,
        pending: None,
        devices: vec![MigDevice {
            uuid: "MIG-1".into(),
            profile: "3g.20gb".into(),
            memory_mib: 19968,
            gpu_slices: 3,
            compute_slices: 3,
            gi_id: 1,
            ci_id: 0,
            caps_minors: vec![12, 13],
        }],
        free: vec![MigCapacity {
            profile: "1g.5gb".into(),
            count: 2,
        }],
        capable: true,
        profiles: vec![MigProfile {
            name: "1g.5gb".into(),
            gpu_slices: 1,
            memory_mib: 4864,
            max_count: 7,
        }],
    };
    g
}

#[test]
fn mig_devices_round_trip_and_bad_ones_are_refused_naming_the_field() {
    let g = mig_gpu();
    assert_eq!(gpu_from_pb("gpus[0]", g.clone().into()).unwrap(), g);
    // A GPU without MIG sends none and reads back as off.
    let plain = GpuInfo::new("GPU-b", 1, "T4", 15360);
    let pb_plain: pb::Gpu = plain.clone().into();
    assert!(pb_plain.mig.is_none());
    assert_eq!(gpu_from_pb("gpus[1]", pb_plain).unwrap(), plain);
    let bad = |edit: fn(&mut pb::MigInfo), field: &str| {
        let mut p: pb::Gpu = mig_gpu().into();
        edit(p.mig.as_mut().unwrap());
        let e = gpu_from_pb("gpus[0]", p).unwrap_err();
        assert_eq!(e.field, field, "{e}");
    };
    bad(|m| m.enabled = false, "gpus[0].mig.devices");
    bad(
        |m| m.devices.push(m.devices[0].clone()),
        "gpus[0].mig.devices[1].uuid",
    );
    bad(
        |m| m.devices[0].uuid = "GPU-a".into(),
        "gpus[0].mig.devices[0].uuid",
    );
    bad(|m| m.devices[0].uuid.clear(), "gpus[0].mig.devices[0].uuid");
    bad(
        |m| m.devices[0].profile = "x".repeat(33),
        "gpus[0].mig.devices[0].profile",
    );
    bad(
        |m| m.devices[0].caps_minors = vec![1; 9],
        "gpus[0].mig.devices[0].caps_minors",
    );
    bad(
        |m| m.devices = vec![m.devices[0].clone(); 17],
        "gpus[0].mig.devices",
    );
    bad(
        |m| m.free[0].profile = "bad\nname".into(),
        "gpus[0].mig.free[0].profile",
    );
}

fn spec() -> pb::JobSpec {
    pb::JobSpec {
        placement: None,
        name: "train-1".into(),
        image: "busybox:latest".into(),
        command: vec!["sh".into(), "-c".into(), "echo hi".into()],
        env: Default::default(),
        resources: Some(pb::Resources {
            cpus: 1.0,
            mem_mib: 256,
            gpus: 2,
            ports: 0,
        }),
        priority: -3,
        replicas: 4,
        max_retries: 2,
        no_requeue: true,
        no_fence: true,
        security: Some(pb::TaskSecurity {
            user: "1234:1234".into(),
            mounts: vec![pb::HostMount {
                host_path: "/data/sets".into(),
                container_path: "/data".into(),
                read_write: false,
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn valid_job_spec_converts_and_round_trips() {
    let s = JobSpec::try_from(spec()).unwrap();
    assert_eq!(s.template.image.as_deref(), Some("busybox:latest"));
    assert_eq!(s.template.resources.gpus, 2);
    assert_eq!(
        (
            s.priority,
            s.replicas,
            s.max_retries,
            s.no_requeue,
            s.template.no_fence
        ),
        (-3, 4, 2, true, true)
    );
    assert_eq!(s.template.security.user.as_deref(), Some("1234:1234"));
    assert_eq!(
        s.template.security.mounts,
        [HostMount {
            host_path: "/data/sets".into(),
            container_path: "/data".into(),
            read_only: true,
        }]
    );
    // A gang asked no port: each rank holds one, for MASTER_PORT.
    assert_eq!(s.template.resources.ports, 1);
    let mut want = spec();
    want.resources.as_mut().unwrap().ports = 1;
    assert_eq!(pb::JobSpec::from(s), want);
    // An old client's spec (no replicas) is one task.
    let mut old = spec();
    old.replicas = 0;
    assert_eq!(JobSpec::try_from(old).unwrap().replicas, 1);
}

#[test]
fn empty_image_means_host_process() {
    let mut p = spec();
    p.image.clear();
    // (Host processes take no mounts.)
    p.security = None;
    assert_eq!(JobSpec::try_from(p).unwrap().runtime(), Runtime::Process);
}

#[test]
fn bad_job_specs_name_the_field() {
    type Mutation = fn(&mut pb::JobSpec);
    let cases: Vec<(Mutation, &str)> = vec![
        (|s| s.name.clear(), "spec.name"),
        (|s| s.name = "a b".into(), "spec.name"),
        (|s| s.name = "x".repeat(200), "spec.name"),
        (|s| s.command.clear(), "spec.command"),
        (|s| s.command = vec![String::new()], "spec.command[0]"),
        (|s| s.image = "bad image".into(), "spec.image"),
        (
            |s| s.resources.as_mut().unwrap().cpus = -1.0,
            "spec.resources.cpus",
        ),
        (
            |s| s.resources.as_mut().unwrap().cpus = f64::NAN,
            "spec.resources.cpus",
        ),
        (
            |s| s.resources.as_mut().unwrap().gpus = 1000,
            "spec.resources.gpus",
        ),
        (
            |s| {
                s.env.insert("A=B".into(), "x".into());
            },
            "spec.env[\"A=B\"]",
        ),
        (|s| s.replicas = MAX_REPLICAS + 1, "spec.replicas"),
        (|s| s.max_retries = MAX_RETRIES + 1, "spec.max_retries"),
        (
            |s| s.stop_grace_ms = Some(MAX_STOP_GRACE_MS + 1),
            "spec.stop_grace_ms",
        ),
        (|s| s.checkpoint_dir = "ckpt".into(), "spec.checkpoint_dir"),
        (
            |s| s.checkpoint_dir = "/a/../b".into(),
            "spec.checkpoint_dir",
        ),
        (|s| s.checkpoint_dir = "/a:b".into(), "spec.checkpoint_dir"),
        (|s| s.checkpoint_dir = "/".into(), "spec.checkpoint_dir"),
        (
            |s| {
                s.replicas = 2;
                s.min_replicas = 3;
            },
            "spec.min_replicas",
        ),
        (
            |s| s.restart_policy = "sometimes".into(),
            "spec.restart_policy",
        ),
        (
            |s| {
                s.restart_policy = "never".into();
                s.max_retries = 1;
            },
            "spec.max_retries",
        ),
        (
            |s| s.restart_backoff_ms = Some(MAX_FIRST_RESTART_BACKOFF_MS + 1),
            "spec.restart_backoff_ms",
        ),
    ];
    for (mutate, field) in cases {
        let mut p = spec();
        mutate(&mut p);
        let err = JobSpec::try_from(p).unwrap_err();
        assert_eq!(err.field, field, "{err}");
        assert!(err.to_string().contains(field), "{err}");
    }
}

/// `--replicas MIN:MAX`, the restart policy and its backoff: to the spec
/// and back; MIN equal to MAX is a fixed gang; the backoff doubles per
/// retry up to 5 minutes (or the job's own first pause, if longer).
#[test]
fn elastic_replicas_and_restart_policy_go_to_the_spec_and_back() {
    let mut p = spec();
    p.replicas = 4;
    p.min_replicas = 2;
    p.restart_policy = "NEVER".into();
    p.max_retries = 0;
    p.restart_backoff_ms = Some(10_000);
    let s = JobSpec::try_from(p.clone()).unwrap();
    assert_eq!(
        (s.min_replicas(), s.replicas(), s.is_elastic()),
        (2, 4, true)
    );
    assert_eq!(s.restart_policy, RestartPolicy::Never);
    let back = pb::JobSpec::from(s);
    assert_eq!(
        (
            back.min_replicas,
            back.restart_policy.as_str(),
            back.restart_backoff_ms
        ),
        (2, "never", Some(10_000))
    );
    p.min_replicas = 4;
    p.restart_policy = String::new();
    let s = JobSpec::try_from(p).unwrap();
    assert_eq!((s.min_replicas, s.is_elastic()), (None, false));
    assert_eq!(s.restart_policy, RestartPolicy::Gang);
    assert_eq!(pb::JobSpec::from(s).restart_policy, "");
    let mut s = JobSpec::try_from(spec()).unwrap();
    let pauses: Vec<u64> = (1..=11).map(|r| s.restart_backoff(r)).collect();
    assert_eq!(
        pauses,
        [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300].map(|x| x * 1000)
    );
    s.restart_backoff_ms = Some(0);
    assert_eq!(s.restart_backoff(5), 0, "0: at once");
    s.restart_backoff_ms = Some(MAX_FIRST_RESTART_BACKOFF_MS);
    assert_eq!(s.restart_backoff(3), MAX_FIRST_RESTART_BACKOFF_MS);
    assert_eq!(s.restart_backoff(u32::MAX), MAX_FIRST_RESTART_BACKOFF_MS);
    // As written: N or MIN:MAX.
    assert_eq!(parse_replicas("4"), Ok((4, 4)));
    assert_eq!(parse_replicas(" 2 : 4 "), Ok((2, 4)));
    for bad in ["0", "4:2", "1:", "a:b", "1:99999", ""] {
        assert!(parse_replicas(bad).is_err(), "{bad}");
    }
}

#[test]
fn stop_grace_and_checkpoint_dir_go_to_the_spec_and_back() {
    let mut p = spec();
    p.stop_grace_ms = Some(90_000);
    p.checkpoint_dir = "/ckpt/run-1".into();
    let s = JobSpec::try_from(p.clone()).unwrap();
    assert_eq!(s.template.stop_grace_ms, Some(90_000));
    assert_eq!(s.template.checkpoint_dir.as_deref(), Some("/ckpt/run-1"));
    let back = pb::JobSpec::from(s);
    assert_eq!(
        (back.stop_grace_ms, back.checkpoint_dir.as_str()),
        (Some(90_000), "/ckpt/run-1")
    );
    let none = JobSpec::try_from(spec()).unwrap();
    assert_eq!(
        (none.template.stop_grace_ms, none.template.checkpoint_dir),
        (None, None)
    );
    // 0 is a grace too: SIGKILL at once.
    p.stop_grace_ms = Some(0);
    assert_eq!(
        JobSpec::try_from(p).unwrap().template.stop_grace_ms,
        Some(0)
    );
}

#[test]
fn a_hang_timeout_goes_to_the_spec_and_back_and_out_of_bounds_is_named() {
    let mut p = spec();
    p.hang_timeout_ms = Some(600_000);
    let s = JobSpec::try_from(p.clone()).unwrap();
    assert_eq!(s.template.hang_timeout_ms, Some(600_000));
    assert_eq!(pb::JobSpec::from(s).hang_timeout_ms, Some(600_000));
    for bad in [0, 999, MAX_HANG_TIMEOUT_MS + 1] {
        p.hang_timeout_ms = Some(bad);
        let e = JobSpec::try_from(p.clone()).unwrap_err();
        assert_eq!(e.field, "spec.hang_timeout_ms", "{e}");
    }
    // A hung task's status: FAILED only.
    let mut u = pb::StatusUpdate {
        agent_id: "a".into(),
        task_id: "t".into(),
        state: pb::TaskState::TaskFailed as i32,
        reason: pb::Reason::Hung as i32,
        uuid: vec![1; 16],
        ..Default::default()
    };
    assert!(StatusUpdate::try_from(u.clone()).unwrap().hung);
    u.state = pb::TaskState::TaskKilled as i32;
    assert_eq!(StatusUpdate::try_from(u).unwrap_err().field, "reason");
}

/// A task its runtime stopped as the runtime restarted: FAILED only, and
/// back to the wire with its reason.
#[test]
fn a_runtime_restart_is_a_reason_of_a_failed_task_only() {
    let mut u = pb::StatusUpdate {
        agent_id: "a".into(),
        task_id: "t".into(),
        state: pb::TaskState::TaskFailed as i32,
        exit_code: Some(143),
        reason: pb::Reason::RuntimeRestarted as i32,
        uuid: vec![1; 16],
        ..Default::default()
    };
    let d = StatusUpdate::try_from(u.clone()).unwrap();
    assert!(d.runtime_restarted && !d.hung && !d.gpu_unhealthy);
    assert_eq!(pb::StatusUpdate::from(d).reason, u.reason);
    u.state = pb::TaskState::TaskFinished as i32;
    assert_eq!(StatusUpdate::try_from(u).unwrap_err().field, "reason");
}

#[test]
fn stop_kinds_name_the_reason_generically() {
    assert_eq!(stop_kind(TaskReason::Preempted, false), "preempted");
    assert_eq!(stop_kind(TaskReason::AgentDrained, false), "drained");
    assert_eq!(stop_kind(TaskReason::Unspecified, true), "cancelled");
    assert_eq!(stop_kind(TaskReason::Unspecified, false), "killed");
    assert_eq!(stop_kind(TaskReason::KilledByFramework, false), "killed");
    assert_eq!(stop_kind(TaskReason::Reclaimed, false), "reclaimed");
    // Any other reason by its wire name: one added later needs nothing
    // here.
    assert_eq!(stop_kind(TaskReason::GpuUnhealthy, false), "gpu_unhealthy");
    // A cancel of a job whose task was already being preempted keeps
    // what the task recorded first.
    assert_eq!(stop_kind(TaskReason::Preempted, true), "preempted");
}

/// A job with `security` as `edit` makes it, host process or container.
fn with_security(image: &str, edit: impl FnOnce(&mut pb::TaskSecurity)) -> pb::JobSpec {
    let mut s = spec();
    s.image = image.into();
    let mut sec = pb::TaskSecurity::default();
    edit(&mut sec);
    s.security = Some(sec);
    s
}

fn mount(host: &str, container: &str) -> pb::HostMount {
    pb::HostMount {
        host_path: host.into(),
        container_path: container.into(),
        read_write: false,
    }
}

#[test]
fn every_security_error_names_its_field() {
    type Edit = Box<dyn Fn(&mut pb::TaskSecurity)>;
    let long = format!("/{}", "p".repeat(MAX_PATH_LEN));
    // (image, edit, field, words in the reason)
    let cases: Vec<(&str, Edit, &str, &str)> = vec![
        (
            "img",
            Box::new(|s| s.privileged = true),
            "spec.security.privileged",
            "privileged containers are never allowed",
        ),
        (
            "",
            Box::new(|s| s.privileged = true),
            "spec.security.privileged",
            "never allowed",
        ),
        (
            "img",
            Box::new(|s| s.user = "nobody".into()),
            "spec.security.user",
            "not UID or UID:GID",
        ),
        (
            "",
            Box::new(|s| s.user = "12:x".into()),
            "spec.security.user",
            "not UID or UID:GID",
        ),
        (
            "",
            Box::new(|s| s.user = "4294967295".into()),
            "spec.security.user",
            "not a valid id",
        ),
        (
            "",
            Box::new(|s| s.user = "1".repeat(33)),
            "spec.security.user",
            "at most 32",
        ),
        (
            "",
            Box::new(|s| s.user = "0".into()),
            "spec.security.user",
            "security.run_as_root instead",
        ),
        (
            "",
            Box::new(|s| s.user = "1000:0".into()),
            "spec.security.user",
            "root",
        ),
        (
            "",
            Box::new(|s| {
                s.user = "1000".into();
                s.run_as_root = true;
            }),
            "spec.security.run_as_root",
            "together with security.user",
        ),
        (
            "img",
            Box::new(|s| s.run_as_root = true),
            "spec.security.run_as_root",
            "only for host-process jobs",
        ),
        (
            "",
            Box::new(|s| s.mounts = vec![mount("/data", "/data")]),
            "spec.security.mounts",
            "only containers",
        ),
        (
            "img",
            Box::new(|s| s.mounts = vec![mount("/data", "/data"); MAX_MOUNTS + 1]),
            "spec.security.mounts",
            "at most 16",
        ),
        (
            "img",
            Box::new(|s| s.mounts = vec![mount("data", "/data")]),
            "spec.security.mounts[0].host_path",
            "must be an absolute path without '..'",
        ),
        (
            "img",
            Box::new(|s| s.mounts = vec![mount("/data", "/d"), mount("/data/../etc", "/data")]),
            "spec.security.mounts[1].host_path",
            "must be an absolute path without '..'",
        ),
        (
            "img",
            Box::new(|s| s.mounts = vec![mount("", "/data")]),
            "spec.security.mounts[0].host_path",
            "absolute",
        ),
        (
            "img",
            Box::new(|s| s.mounts = vec![mount("/data//x", "/data")]),
            "spec.security.mounts[0].host_path",
            "plain path",
        ),
        (
            "img",
            Box::new(|s| s.mounts = vec![mount("/data/./x", "/data")]),
            "spec.security.mounts[0].host_path",
            "plain path",
        ),
        (
            "img",
            Box::new(|s| s.mounts = vec![mount("/data/", "/data")]),
            "spec.security.mounts[0].host_path",
            "plain path",
        ),
        (
            "img",
            Box::new(|s| s.mounts = vec![mount("/data:/etc", "/data")]),
            "spec.security.mounts[0].host_path",
            "':'",
        ),
        (
            "img",
            Box::new(|s| s.mounts = vec![mount("/a,b", "/data")]),
            "spec.security.mounts[0].host_path",
            "','",
        ),
        (
            "img",
            Box::new(|s| s.mounts = vec![mount("/a\nb", "/data")]),
            "spec.security.mounts[0].host_path",
            "'\\n'",
        ),
        (
            "img",
            Box::new(move |s| s.mounts = vec![mount(&long, "/data")]),
            "spec.security.mounts[0].host_path",
            "at most 1024",
        ),
        (
            "img",
            Box::new(|s| s.mounts = vec![mount("/data", "data")]),
            "spec.security.mounts[0].container_path",
            "absolute path without '..'",
        ),
        (
            "img",
            Box::new(|s| s.mounts = vec![mount("/data", "/x/..")]),
            "spec.security.mounts[0].container_path",
            "absolute path without '..'",
        ),
        (
            "img",
            Box::new(|s| s.mounts = vec![mount("/data", "/")]),
            "spec.security.mounts[0].container_path",
            "must not be /",
        ),
        (
            "img",
            Box::new(|s| s.mounts = vec![mount("/data", "/usr/local/nvidia/lib")]),
            "spec.security.mounts[0].container_path",
            "driver volume",
        ),
        (
            "img",
            Box::new(|s| s.mounts = vec![mount("/a", "/data"), mount("/b", "/data")]),
            "spec.security.mounts[1].container_path",
            "mounted twice",
        ),
    ];
    for (image, edit, field, words) in cases {
        let err = JobSpec::try_from(with_security(image, edit)).unwrap_err();
        assert_eq!(err.field, field, "{err}");
        assert!(err.reason.contains(words), "{field}: {err}");
    }
    // The issue's wording.
    let err = JobSpec::try_from(with_security("img", |s| {
        s.mounts = vec![mount("/data/../etc", "/data")]
    }))
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid spec.security.mounts[0].host_path: must be an absolute path without '..'"
    );
}

#[test]
fn allowed_security_passes_and_limits_hold_at_the_edge() {
    let ok: Vec<pb::JobSpec> = vec![
        with_security("", |_| {}),
        with_security("", |s| s.user = "1234".into()),
        with_security("", |s| s.user = "65534:65534".into()),
        with_security("", |s| s.run_as_root = true),
        // A container may run as its own root: it has no more than the
        // default capabilities.
        with_security("img", |s| s.user = "0:0".into()),
        with_security("img", |s| {
            s.mounts = (0..MAX_MOUNTS)
                .map(|i| mount("/", &format!("/m{i}")))
                .collect()
        }),
        with_security("img", |s| {
            s.mounts = vec![mount(
                &format!("/{}", "p".repeat(MAX_PATH_LEN - 1)),
                "/usr/local/nvidiax",
            )]
        }),
    ];
    for spec in ok {
        let sec = spec.security.clone();
        let j = JobSpec::try_from(spec).unwrap_or_else(|e| panic!("{sec:?}: {e}"));
        // What the master sends the agent passes the agent's check too.
        let task = pb::TaskSpec::from(TaskSpec {
            share: None,
            task_id: "job-1.0".into(),
            job_id: "job-1".into(),
            framework_id: String::new(),
            gpu_uuids: vec![],
            template: crate::types::TaskTemplate {
                stop_grace_ms: None,
                checkpoint_dir: None,
                hang_timeout_ms: None,
                preflight: false,
                image: j.template.image.clone(),
                command: j.template.command.clone(),
                env: j.template.env.clone(),
                resources: Resources::default(),
                no_fence: false,
                security: j.template.security.clone(),
                options: Default::default(),
            },
        });
        assert_eq!(
            TaskSpec::try_from(task).unwrap().template.security,
            j.template.security
        );
    }
    // The default is not sent, and an absent one is the default.
    let mut s = spec();
    s.security = None;
    let j = JobSpec::try_from(s).unwrap();
    assert!(j.template.security.is_default());
    assert_eq!(pb::JobSpec::from(j).security, None);
}

#[test]
fn old_specs_without_security_still_decode() {
    // A job as stored (log, snapshot) before `security` existed.
    let old = r#"{"name":"j","image":null,"command":["true"],"env":{},"resources":{"cpus":1.0,"mem_mib":0,"gpus":0}}"#;
    let j: JobSpec = serde_json::from_str(old).unwrap();
    assert!(j.template.security.is_default());
    // And a default one is not written, so specs stay as they were.
    assert!(!serde_json::to_string(&j).unwrap().contains("security"));
    let t = r#"{"task_id":"t","job_id":"j","image":null,"command":["true"],"env":{},"resources":{"cpus":1.0,"mem_mib":0,"gpus":0},"gpu_uuids":[]}"#;
    let t: TaskSpec = serde_json::from_str(t).unwrap();
    assert!(t.template.security.is_default());
    // A mount without read_only is read-only.
    let m: HostMount = serde_json::from_str(r#"{"host_path":"/a","container_path":"/b"}"#).unwrap();
    assert!(m.read_only);
}

#[test]
fn register_rejects_gpu_count_mismatch_and_duplicates() {
    let gpu = |u: &str| pb::Gpu {
        uuid: u.into(),
        ..Default::default()
    };
    let mut r = pb::RegisterRequest {
        agent_id: "a1".into(),
        hostname: "h".into(),
        address: "127.0.0.1:1".into(),
        total: Some(pb::Resources {
            cpus: 2.0,
            mem_mib: 1024,
            gpus: 2,
            ports: 0,
        }),
        gpus: vec![gpu("GPU-1"), gpu("GPU-1")],
        runtimes: vec![pb::Runtime::Process as i32],
        running_task_ids: vec![],
        simulated_gpus: false,
        ..Default::default()
    };
    assert_eq!(
        AgentInfo::try_from(r.clone()).unwrap_err().field,
        "gpus[1].uuid"
    );
    r.gpus = vec![gpu("GPU-1")];
    assert_eq!(
        AgentInfo::try_from(r.clone()).unwrap_err().field,
        "total.gpus"
    );
    r.gpus.push(gpu("GPU-2"));
    let a = AgentInfo::try_from(r.clone()).unwrap();
    assert_eq!(a.gpus.len(), 2);
    r.runtimes = vec![42];
    assert_eq!(AgentInfo::try_from(r).unwrap_err().field, "runtimes");
}

#[test]
fn a_shares_tenant_must_be_a_safe_name_and_survives_the_wire() {
    let t = |tenant: &str| pb::TaskSpec {
        share: Some(pb::TaskShare {
            mem_mib: 1024,
            compute_pct: 0,
            mode: "mps".into(),
            tenant: tenant.into(),
        }),
        task_id: "job-1.0".into(),
        job_id: "job-1".into(),
        command: vec!["true".into()],
        resources: Some(pb::Resources::default()),
        gpu_uuids: vec!["GPU-1".into()],
        no_fence: true,
        ..Default::default()
    };
    // It names the agent's MPS directory: nothing that leaves it.
    for bad in ["..", "a/b", ".x"] {
        assert_eq!(
            TaskSpec::try_from(t(bad)).unwrap_err().field,
            "task.share.tenant",
            "{bad}"
        );
    }
    let ok = TaskSpec::try_from(t("team-a")).unwrap();
    assert_eq!(ok.share.as_ref().unwrap().tenant.name(), "team-a");
    let back = pb::TaskSpec::from(ok);
    assert_eq!(back.share.unwrap().tenant, "team-a");
}

#[test]
fn task_spec_gpu_list_must_match_count() {
    let t = pb::TaskSpec {
        share: None,
        task_id: "job-1.0".into(),
        job_id: "job-1".into(),
        image: String::new(),
        command: vec!["true".into()],
        env: Default::default(),
        resources: Some(pb::Resources {
            cpus: 0.0,
            mem_mib: 0,
            gpus: 1,
            ports: 0,
        }),
        gpu_uuids: vec![],
        framework_id: String::new(),
        no_fence: true,
        security: None,
        stop_grace_ms: None,
        checkpoint_dir: String::new(),
        hang_timeout_ms: None,
        preflight: false,
        options: None,
    };
    assert_eq!(
        TaskSpec::try_from(t.clone()).unwrap_err().field,
        "task.gpu_uuids"
    );
    // A task belongs to a job or a framework, never both or neither.
    let mut both = t.clone();
    both.gpu_uuids = vec!["GPU-1".into()];
    both.framework_id = "fw-1".into();
    assert_eq!(
        TaskSpec::try_from(both.clone()).unwrap_err().field,
        "task.job_id"
    );
    both.job_id.clear();
    let ok = TaskSpec::try_from(both.clone()).unwrap();
    assert!(ok.template.no_fence);
    assert_eq!(pb::TaskSpec::from(ok), both);
    both.framework_id.clear();
    assert_eq!(TaskSpec::try_from(both).unwrap_err().field, "task.job_id");
}

/// `ok` applied to a valid spec passes; `bad` fails naming `field`.
fn boundary<T: Clone>(
    base: &T,
    ok: impl Fn(&mut T),
    bad: impl Fn(&mut T),
    field: &str,
    convert: impl Fn(T) -> Result<()>,
) {
    let mut at = base.clone();
    ok(&mut at);
    if let Err(e) = convert(at) {
        panic!("at the limit of {field}: {e}");
    }
    let mut past = base.clone();
    bad(&mut past);
    let err = convert(past).expect_err(field);
    assert_eq!(err.field, field, "{err}");
    assert!(err.to_string().contains(field), "{err}");
}

fn job(s: pb::JobSpec) -> Result<()> {
    JobSpec::try_from(s).map(|_| ())
}

fn env_of(pairs: &[(&str, usize)]) -> std::collections::HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, n)| (k.to_string(), "v".repeat(*n)))
        .collect()
}

#[test]
fn job_spec_limits_pass_at_and_fail_past() {
    let base = spec();
    boundary(
        &base,
        |s| s.name = "n".repeat(MAX_NAME_LEN),
        |s| s.name = "n".repeat(MAX_NAME_LEN + 1),
        "spec.name",
        job,
    );
    boundary(
        &base,
        |s| s.image = "i".repeat(MAX_IMAGE_LEN),
        |s| s.image = "i".repeat(MAX_IMAGE_LEN + 1),
        "spec.image",
        job,
    );
    boundary(
        &base,
        |s| s.command = vec!["a".into(); MAX_COMMAND_ARGS],
        |s| s.command = vec!["a".into(); MAX_COMMAND_ARGS + 1],
        "spec.command",
        job,
    );
    let half = MAX_COMMAND_BYTES / 2;
    boundary(
        &base,
        |s| s.command = vec!["a".repeat(half), "b".repeat(half)],
        |s| s.command = vec!["a".repeat(half), "b".repeat(half + 1)],
        "spec.command",
        job,
    );
    boundary(
        &base,
        |s| s.env = env_of(&[(&"K".repeat(MAX_ENV_KEY_BYTES), 1)]),
        |s| s.env = env_of(&[(&"K".repeat(MAX_ENV_KEY_BYTES + 1), 1)]),
        // The name is cut in the field label.
        &format!("spec.env[\"{}...\"]", "K".repeat(64)),
        job,
    );
    boundary(
        &base,
        |s| s.env = env_of(&[("FOO", MAX_ENV_VALUE_BYTES)]),
        |s| s.env = env_of(&[("FOO", MAX_ENV_VALUE_BYTES + 1)]),
        "spec.env[\"FOO\"]",
        job,
    );
    // 8 variables of 2 + 32766 bytes: exactly the total.
    let full: Vec<(String, usize)> = (0..8)
        .map(|i| (format!("K{i}"), MAX_ENV_VALUE_BYTES - 2))
        .collect();
    let full_ref: Vec<(&str, usize)> = full.iter().map(|(k, n)| (k.as_str(), *n)).collect();
    assert_eq!(8 * MAX_ENV_VALUE_BYTES, MAX_ENV_TOTAL_BYTES);
    boundary(
        &base,
        |s| s.env = env_of(&full_ref),
        |s| {
            s.env = env_of(&full_ref);
            s.env.insert("X".into(), String::new());
        },
        "spec.env",
        job,
    );
    boundary(
        &base,
        |s| {
            s.env = (0..MAX_ENV_VARS)
                .map(|i| (format!("V{i}"), String::new()))
                .collect()
        },
        |s| {
            s.env = (0..=MAX_ENV_VARS)
                .map(|i| (format!("V{i}"), String::new()))
                .collect()
        },
        "spec.env",
        job,
    );
    boundary(
        &base,
        |s| {
            s.env = [("A".to_string(), String::new())].into();
            s.secret_env = vec!["A".into(); MAX_ENV_VARS];
        },
        |s| {
            s.env = [("A".to_string(), String::new())].into();
            s.secret_env = vec!["A".into(); MAX_ENV_VARS + 1];
        },
        "spec.secret_env",
        job,
    );
    boundary(
        &base,
        |s| s.replicas = MAX_REPLICAS,
        |s| s.replicas = MAX_REPLICAS + 1,
        "spec.replicas",
        job,
    );
    boundary(
        &base,
        |s| s.max_retries = MAX_RETRIES,
        |s| s.max_retries = MAX_RETRIES + 1,
        "spec.max_retries",
        job,
    );
    boundary(
        &base,
        |s| s.resources.as_mut().unwrap().cpus = MAX_CPUS,
        |s| s.resources.as_mut().unwrap().cpus = MAX_CPUS + 0.5,
        "spec.resources.cpus",
        job,
    );
    boundary(
        &base,
        |s| s.resources.as_mut().unwrap().cpus = 0.0,
        |s| s.resources.as_mut().unwrap().cpus = f64::INFINITY,
        "spec.resources.cpus",
        job,
    );
    boundary(
        &base,
        |s| s.resources.as_mut().unwrap().mem_mib = MAX_MEM_MIB,
        |s| s.resources.as_mut().unwrap().mem_mib = MAX_MEM_MIB + 1,
        "spec.resources.mem_mib",
        job,
    );
    boundary(
        &base,
        |s| s.resources.as_mut().unwrap().mem_mib = 0,
        |s| s.resources.as_mut().unwrap().mem_mib = u64::MAX,
        "spec.resources.mem_mib",
        job,
    );
    boundary(
        &base,
        |s| s.resources.as_mut().unwrap().gpus = MAX_GPUS,
        |s| s.resources.as_mut().unwrap().gpus = MAX_GPUS + 1,
        "spec.resources.gpus",
        job,
    );
    boundary(
        &base,
        |s| s.resources.as_mut().unwrap().ports = MAX_TASK_PORTS,
        |s| s.resources.as_mut().unwrap().ports = MAX_TASK_PORTS + 1,
        "spec.resources.ports",
        job,
    );
    boundary(
        &base,
        |s| s.placement.get_or_insert_with(Default::default).gpu_model = "m".repeat(MAX_ATTR_LEN),
        |s| {
            s.placement.get_or_insert_with(Default::default).gpu_model =
                "m".repeat(MAX_ATTR_LEN + 1)
        },
        "spec.placement.gpu_model",
        job,
    );
    boundary(
        &base,
        |s| {
            s.placement
                .get_or_insert_with(Default::default)
                .gpu_mem_min_mib = MAX_MEM_MIB
        },
        |s| {
            s.placement
                .get_or_insert_with(Default::default)
                .gpu_mem_min_mib = MAX_MEM_MIB + 1
        },
        "spec.placement.gpu_mem_min_mib",
        job,
    );
    boundary(
        &base,
        |s| {
            s.placement.get_or_insert_with(Default::default).constraints = (0..MAX_CONSTRAINTS)
                .map(|i| (format!("k{i}"), "v".into()))
                .collect()
        },
        |s| {
            s.placement.get_or_insert_with(Default::default).constraints = (0..=MAX_CONSTRAINTS)
                .map(|i| (format!("k{i}"), "v".into()))
                .collect()
        },
        "spec.placement.constraints",
        job,
    );
    boundary(
        &base,
        |s| {
            s.placement.get_or_insert_with(Default::default).constraints =
                [("k".repeat(MAX_ATTR_LEN), "v".into())].into()
        },
        |s| {
            s.placement.get_or_insert_with(Default::default).constraints =
                [("k".repeat(MAX_ATTR_LEN + 1), "v".into())].into()
        },
        "spec.placement.constraints",
        job,
    );
    boundary(
        &base,
        |s| {
            s.placement.get_or_insert_with(Default::default).constraints =
                [("zone".into(), "v".repeat(MAX_ATTR_LEN))].into()
        },
        |s| {
            s.placement.get_or_insert_with(Default::default).constraints =
                [("zone".into(), "v".repeat(MAX_ATTR_LEN + 1))].into()
        },
        "spec.placement.constraints[zone]",
        job,
    );
}

#[test]
fn the_issue_s_env_error_reads_as_documented() {
    let mut s = spec();
    s.env = env_of(&[("FOO", 40000)]);
    assert_eq!(
        JobSpec::try_from(s).unwrap_err().to_string(),
        "invalid spec.env[\"FOO\"]: value is 40000 bytes, at most 32768"
    );
}

#[test]
fn a_maximal_task_spec_encodes_under_one_mib() {
    use prost::Message as _;
    // Every limit at once, plus what the master adds to a gang's env.
    let env: BTreeMap<String, String> = (0..MAX_ENV_VARS - 3)
        .map(|i| {
            (
                format!("{i:0>8}"),
                "v".repeat(MAX_ENV_TOTAL_BYTES / MAX_ENV_VARS - 8),
            )
        })
        .collect();
    let total: usize = env.iter().map(|(k, v)| k.len() + v.len()).sum();
    assert!(total <= MAX_ENV_TOTAL_BYTES);
    let mut env = env;
    let peers = vec!["h".repeat(MAX_HOSTNAME_LEN); MAX_REPLICAS as usize].join(",");
    env.insert("GPUCTL_PEERS".into(), peers);
    env.insert("GPUCTL_RANK".into(), "4095".into());
    env.insert("GPUCTL_WORLD_SIZE".into(), "4096".into());
    let command: Vec<String> = (0..MAX_COMMAND_ARGS)
        .map(|_| "c".repeat(MAX_COMMAND_BYTES / MAX_COMMAND_ARGS))
        .collect();
    let t = pb::TaskSpec::from(TaskSpec {
        share: None,
        task_id: "t".repeat(2 * MAX_NAME_LEN + 1),
        job_id: "j".repeat(MAX_NAME_LEN),
        framework_id: String::new(),
        gpu_uuids: (0..MAX_GPUS).map(|i| format!("GPU-{i:0>36}")).collect(),
        template: crate::types::TaskTemplate {
            stop_grace_ms: None,
            checkpoint_dir: None,
            hang_timeout_ms: None,
            preflight: false,
            image: Some("i".repeat(MAX_IMAGE_LEN)),
            command,
            env,
            resources: Resources {
                cpus: MAX_CPUS,
                mem_mib: MAX_MEM_MIB,
                gpus: MAX_GPUS,
                ports: 0,
            },
            no_fence: false,
            security: TaskSecurity {
                user: Some("4294967294:4294967294".into()),
                mounts: (0..MAX_MOUNTS)
                    .map(|i| HostMount {
                        host_path: format!("/{i:0>1023}"),
                        container_path: format!("/{i:1>1023}"),
                        read_only: false,
                    })
                    .collect(),
                privileged: false,
                run_as_root: false,
            },
            options: TaskOptions {
                shm_size: Some(MiB(MAX_SHM_SIZE_MIB)),
                port: (0..MAX_TASK_PORTS).map(|i| format!("p{i:0>14}")).collect(),
                readiness: Some(Check::new(Probe::Http {
                    port: "p".repeat(15),
                    path: format!("/{}", "a".repeat(MAX_CHECK_PATH_LEN - 1)),
                })),
                liveness: Some(Check::new(Probe::Exec {
                    command: "c".repeat(MAX_CHECK_COMMAND_LEN),
                })),
            },
        },
    });
    let len = t.encoded_len();
    assert!(len < 700 * 1024, "{len} bytes");
}

fn register_request() -> pb::RegisterRequest {
    pb::RegisterRequest {
        agent_id: "a1".into(),
        hostname: "h".into(),
        address: "127.0.0.1:1".into(),
        total: Some(pb::Resources {
            cpus: 2.0,
            mem_mib: 1024,
            gpus: 1,
            ports: 0,
        }),
        gpus: vec![pb::Gpu {
            uuid: "GPU-0".into(),
            ..Default::default()
        }],
        runtimes: vec![pb::Runtime::Process as i32],
        ..Default::default()
    }
}

#[test]
fn agent_info_round_trips_through_its_registration() {
    let mut r = register_request();
    r.attributes = [("gpu.family".to_string(), "hopper".to_string())].into();
    r.driver_version = "550.54".into();
    r.allow_root_tasks = true;
    r.allowed_mounts = vec!["/data".into(), "/".into()];
    let info = AgentInfo::try_from(r).unwrap();
    assert!(info.allow_root_tasks);
    assert_eq!(info.allowed_mounts, ["/data", "/"]);
    let back = AgentInfo::try_from(pb::RegisterRequest::from(info.clone())).unwrap();
    assert_eq!(back, info);
    assert_eq!(back.driver_version.as_deref(), Some("550.54"));
    assert_eq!(back.cuda_driver_version, None);
}

fn register(r: pb::RegisterRequest) -> Result<()> {
    AgentInfo::try_from(r).map(|_| ())
}

fn gpus(n: usize) -> Vec<pb::Gpu> {
    (0..n)
        .map(|i| pb::Gpu {
            uuid: format!("GPU-{i}"),
            ..Default::default()
        })
        .collect()
}

#[test]
fn mig_jobs_name_a_profile_and_get_one_device() {
    let base = pb::JobSpec {
        name: "m".into(),
        command: vec!["true".into()],
        resources: Some(pb::Resources {
            gpus: 1,
            ..Default::default()
        }),
        placement: Some(pb::Placement {
            mig: "1g.10gb".into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    for good in [
        "1g.10gb",
        "7g.80gb",
        "1g.10gb+me",
        "1g.23gb-me",
        "1c.3g.40gb",
    ] {
        let mut s = base.clone();
        s.placement.as_mut().unwrap().mig = good.into();
        if let Err(e) = job(s) {
            panic!("{good}: {e}");
        }
    }
    let spec = JobSpec::try_from(base.clone()).unwrap();
    assert_eq!(spec.placement.mig.as_deref(), Some("1g.10gb"));
    assert_eq!(
        JobSpec::try_from(pb::JobSpec::from(spec.clone())).unwrap(),
        spec
    );
    boundary(
        &base,
        |s| s.resources.as_mut().unwrap().gpus = 1,
        |s| s.resources.as_mut().unwrap().gpus = 2,
        "spec.resources.gpus",
        job,
    );
    boundary(
        &base,
        |s| s.resources.as_mut().unwrap().gpus = 1,
        |s| s.resources.as_mut().unwrap().gpus = 0,
        "spec.resources.gpus",
        job,
    );
    for bad in [
        "10gb",
        "1g 10gb",
        "g.10gb",
        "1g/10gb",
        "1g.10gb\n",
        "1g.gb",
        "1g.10",
        "+me",
    ] {
        let mut s = base.clone();
        s.placement.as_mut().unwrap().mig = bad.into();
        let err = job(s).expect_err(bad);
        assert_eq!(err.field, "spec.placement.mig", "{bad}: {err}");
    }
    boundary(
        &base,
        |s| {
            s.placement.as_mut().unwrap().mig =
                format!("1g.{}gb", "1".repeat(MAX_MIG_PROFILE_LEN - 5))
        },
        |s| {
            s.placement.as_mut().unwrap().mig =
                format!("1g.{}gb", "1".repeat(MAX_MIG_PROFILE_LEN - 4))
        },
        "spec.placement.mig",
        job,
    );
}

#[test]
fn a_fraction_asks_memory_of_one_shared_gpu_not_gpus() {
    let base = pb::JobSpec {
        name: "f".into(),
        command: vec!["true".into()],
        placement: Some(pb::Placement {
            gpu_mem_mib: 10240,
            gpu_compute_pct: 25,
            ..Default::default()
        }),
        ..Default::default()
    };
    let spec = JobSpec::try_from(base.clone()).unwrap();
    assert_eq!(
        spec.placement.fraction,
        Some(GpuFraction {
            mem_mib: 10240,
            compute_pct: 25
        })
    );
    assert_eq!(
        JobSpec::try_from(pb::JobSpec::from(spec.clone())).unwrap(),
        spec
    );
    boundary(
        &base,
        |_| {},
        |s| {
            s.resources = Some(pb::Resources {
                gpus: 1,
                ..Default::default()
            })
        },
        "spec.resources.gpus",
        job,
    );
    boundary(
        &base,
        |s| s.placement.as_mut().unwrap().gpu_compute_pct = 100,
        |s| s.placement.as_mut().unwrap().gpu_compute_pct = 101,
        "spec.placement.gpu_compute_pct",
        job,
    );
    boundary(
        &base,
        |s| s.placement.as_mut().unwrap().gpu_mem_mib = MAX_MEM_MIB,
        |s| s.placement.as_mut().unwrap().gpu_mem_mib = MAX_MEM_MIB + 1,
        "spec.placement.gpu_mem_mib",
        job,
    );
    boundary(
        &base,
        |_| {},
        |s| s.placement.as_mut().unwrap().gpu_mem_mib = 0,
        "spec.placement.gpu_compute_pct",
        job,
    );
    boundary(
        &base,
        |_| {},
        |s| s.placement.as_mut().unwrap().mig = "1g.10gb".into(),
        "spec.placement.gpu_mem_mib",
        job,
    );
}

#[test]
fn an_agent_counts_its_mig_devices_and_names_each_once() {
    let dev = |uuid: &str| pb::MigDevice {
        uuid: uuid.into(),
        profile: "1g.10gb".into(),
        ..Default::default()
    };
    let mut base = register_request();
    base.gpus = vec![
        pb::Gpu {
            uuid: "GPU-0".into(),
            mig: Some(pb::MigInfo {
                enabled: true,
                devices: vec![dev("MIG-0"), dev("MIG-1")],
                ..Default::default()
            }),
            ..Default::default()
        },
        pb::Gpu {
            uuid: "GPU-1".into(),
            ..Default::default()
        },
    ];
    // Two MIG devices and one whole GPU; GPU-0 is not given whole.
    boundary(
        &base,
        |r| r.total.as_mut().unwrap().gpus = 3,
        |r| r.total.as_mut().unwrap().gpus = 2,
        "total.gpus",
        register,
    );
    base.total.as_mut().unwrap().gpus = 3;
    boundary(
        &base,
        |_| {},
        |r| {
            r.gpus[1].mig = Some(pb::MigInfo {
                enabled: true,
                devices: vec![dev("MIG-1")],
                ..Default::default()
            })
        },
        "gpus[1].mig.devices[0].uuid",
        register,
    );
}

#[test]
fn an_agents_share_default_is_a_mode_or_nothing() {
    let mut r = register_request();
    r.share_gpus = "mps".into();
    let info = AgentInfo::try_from(r.clone()).unwrap();
    assert_eq!(info.share_gpus, Some(ShareMode::Mps));
    assert_eq!(pb::RegisterRequest::from(info).share_gpus, "mps");
    r.share_gpus = "half".into();
    assert_eq!(AgentInfo::try_from(r).unwrap_err().field, "share_gpus");
    assert_eq!(
        AgentInfo::try_from(register_request()).unwrap().share_gpus,
        None
    );
}

#[test]
fn register_limits_pass_at_and_fail_past() {
    let base = register_request();
    let n = |r: &mut pb::RegisterRequest, count: usize| {
        r.gpus = gpus(count);
        r.total.as_mut().unwrap().gpus = count as u32;
    };
    boundary(
        &base,
        |r| n(r, MAX_AGENT_GPUS),
        |r| n(r, MAX_AGENT_GPUS + 1),
        "gpus",
        register,
    );
    let ports = |r: &mut pb::RegisterRequest, start: u32, end: u32, total: u32| {
        r.ports = Some(pb::PortRange { start, end });
        r.total.as_mut().unwrap().ports = total;
    };
    boundary(
        &base,
        |r| ports(r, 31000, 32000, 1001),
        |r| ports(r, 31000, 32000, 1000),
        "total.ports",
        register,
    );
    boundary(
        &base,
        |r| ports(r, 1, 65535, 65535),
        |r| ports(r, 0, 65535, 65536),
        "ports.start",
        register,
    );
    boundary(
        &base,
        |r| ports(r, 9, 9, 1),
        |r| ports(r, 9, 65536, 65528),
        "ports.end",
        register,
    );
    boundary(
        &base,
        |r| ports(r, 9, 9, 1),
        |r| ports(r, 10, 9, 0),
        "ports",
        register,
    );
    boundary(
        &base,
        |r| r.total.as_mut().unwrap().ports = 0,
        |r| r.total.as_mut().unwrap().ports = 5,
        "total.ports",
        register,
    );
    boundary(
        &base,
        |r| r.allowed_mounts = vec!["/data".into(); MAX_ALLOWED_MOUNTS],
        |r| r.allowed_mounts = vec!["/data".into(); MAX_ALLOWED_MOUNTS + 1],
        "allowed_mounts",
        register,
    );
    boundary(
        &base,
        |r| r.allowed_mounts = vec!["/a".into(), "/data".into()],
        |r| r.allowed_mounts = vec!["/a".into(), "data/../x".into()],
        "allowed_mounts[1]",
        register,
    );
    boundary(
        &base,
        |r| r.hostname = "h".repeat(MAX_HOSTNAME_LEN),
        |r| r.hostname = "h".repeat(MAX_HOSTNAME_LEN + 1),
        "hostname",
        register,
    );
    boundary(
        &base,
        |r| r.hostname = "h-1.example".into(),
        |r| r.hostname = "a,b".into(),
        "hostname",
        register,
    );
    boundary(
        &base,
        |r| r.address = "a".repeat(MAX_ADDRESS_LEN),
        |r| r.address = "a".repeat(MAX_ADDRESS_LEN + 1),
        "address",
        register,
    );
    boundary(
        &base,
        |r| {
            r.attributes = (0..MAX_AGENT_ATTRIBUTES)
                .map(|i| (format!("k{i}"), "v".into()))
                .collect()
        },
        |r| {
            r.attributes = (0..=MAX_AGENT_ATTRIBUTES)
                .map(|i| (format!("k{i}"), "v".into()))
                .collect()
        },
        "attributes",
        register,
    );
    boundary(
        &base,
        |r| r.attributes = [("k".repeat(MAX_ATTR_LEN), "v".into())].into(),
        |r| r.attributes = [("k".repeat(MAX_ATTR_LEN + 1), "v".into())].into(),
        "attributes",
        register,
    );
    boundary(
        &base,
        |r| r.attributes = [("zone".into(), "v".repeat(MAX_ATTR_VALUE_LEN))].into(),
        |r| r.attributes = [("zone".into(), "v".repeat(MAX_ATTR_VALUE_LEN + 1))].into(),
        "attributes[\"zone\"]",
        register,
    );
    boundary(
        &base,
        |r| r.gpus[0].model = "m".repeat(MAX_ATTR_LEN),
        |r| r.gpus[0].model = "m".repeat(MAX_ATTR_LEN + 1),
        "gpus[0].model",
        register,
    );
    boundary(
        &base,
        |r| r.gpus[0].unhealthy_reason = "r".repeat(MAX_REASON_LEN),
        |r| r.gpus[0].unhealthy_reason = "r".repeat(MAX_REASON_LEN + 1),
        "gpus[0].unhealthy_reason",
        register,
    );
    let peer = |u: &str| pb::GpuPeer {
        uuid: u.into(),
        nvlinks: 1,
        pcie: "SYS".into(),
    };
    // The most GPUs, each the peer of every other.
    let mesh = |r: &mut pb::RegisterRequest| {
        n(r, MAX_AGENT_GPUS);
        for i in 0..MAX_AGENT_GPUS {
            r.gpus[i].peers = (0..MAX_AGENT_GPUS)
                .filter(|j| *j != i)
                .map(|j| peer(&format!("GPU-{j}")))
                .collect();
        }
    };
    boundary(
        &base,
        mesh,
        |r| {
            mesh(r);
            r.gpus[0].peers = vec![peer("GPU-1"); MAX_AGENT_GPUS + 1];
        },
        "gpus[0].peers",
        register,
    );
    boundary(
        &base,
        mesh,
        |r| {
            mesh(r);
            r.gpus[3].peers[5] = peer("GPU-1");
        },
        "gpus[3].peers[5].uuid",
        register,
    );
    boundary(
        &base,
        mesh,
        |r| {
            mesh(r);
            r.gpus[2].peers[0] = peer("GPU-2");
        },
        "gpus[2].peers[0].uuid",
        register,
    );
    boundary(
        &base,
        mesh,
        |r| {
            mesh(r);
            r.gpus[2].peers[0].pcie = "P".repeat(MAX_PCIE_LEN + 1);
        },
        "gpus[2].peers[0].pcie",
        register,
    );
    boundary(
        &base,
        |r| r.gpus[0].uuid = "G".repeat(MAX_GPU_UUID_LEN),
        |r| r.gpus[0].uuid = "G".repeat(MAX_GPU_UUID_LEN + 1),
        "gpus[0].uuid",
        register,
    );
    boundary(
        &base,
        |r| r.driver_version = "5".repeat(MAX_ATTR_LEN),
        |r| r.driver_version = "5".repeat(MAX_ATTR_LEN + 1),
        "driver_version",
        register,
    );
    boundary(
        &base,
        |r| r.total.as_mut().unwrap().mem_mib = MAX_MEM_MIB,
        |r| r.total.as_mut().unwrap().mem_mib = u64::MAX,
        "total.mem_mib",
        register,
    );
    boundary(
        &base,
        |r| r.running_task_ids = vec!["t".repeat(2 * MAX_NAME_LEN + 1)],
        |r| r.running_task_ids = vec!["t".into(), "t".repeat(2 * MAX_NAME_LEN + 2)],
        "running_task_ids[1]",
        register,
    );
    boundary(
        &base,
        |r| r.running_task_ids = vec!["t".into(); MAX_AGENT_TASKS],
        |r| r.running_task_ids = vec!["t".into(); MAX_AGENT_TASKS + 1],
        "running_task_ids",
        register,
    );
    boundary(
        &base,
        |r| r.runtimes = vec![pb::Runtime::Process as i32; MAX_AGENT_RUNTIMES],
        |r| r.runtimes = vec![pb::Runtime::Process as i32; MAX_AGENT_RUNTIMES + 1],
        "runtimes",
        register,
    );
}

#[test]
fn payload_check_names_fields_under_its_prefix() {
    let env: BTreeMap<String, String> =
        [("FOO".to_string(), "v".repeat(MAX_ENV_VALUE_BYTES + 1))].into();
    let err = check_payload("operations[0].tasks[1]", "", &["true".into()], &env).unwrap_err();
    assert_eq!(err.field, "operations[0].tasks[1].env[\"FOO\"]");
    let err = check_payload("p", "bad image", &["true".into()], &BTreeMap::new()).unwrap_err();
    assert_eq!(err.field, "p.image");
    let err = check_payload("p", "", &[], &BTreeMap::new()).unwrap_err();
    assert_eq!(err.field, "p.command");
    assert!(check_payload("p", "busybox", &["true".into()], &BTreeMap::new()).is_ok());
}

#[test]
fn too_many_env_variables_are_refused_before_they_are_read() {
    // Every name is bad and the image too: the count alone answers,
    // before a million variables would be sorted and read.
    let env: std::collections::HashMap<String, String> = (0..=MAX_ENV_VARS)
        .map(|i| (format!("V={i}"), String::new()))
        .collect();
    let spec = pb::JobSpec {
        name: "j".into(),
        image: "bad image".into(),
        command: vec!["true".into()],
        env: env.clone(),
        ..Default::default()
    };
    let err = JobSpec::try_from(spec).unwrap_err();
    assert_eq!(err.field, "spec.env");
    assert!(err.to_string().contains("has 1025 variables"), "{err}");
    let task = pb::TaskInfo {
        task_id: "t".into(),
        agent_id: "a".into(),
        image: "bad image".into(),
        command: vec!["true".into()],
        env,
        ..Default::default()
    };
    let err = framework_task_from_pb("operations[0].tasks[0]", task).unwrap_err();
    assert_eq!(err.field, "operations[0].tasks[0].env");
}

#[test]
fn task_specs_from_the_master_are_checked_for_shape_not_size() {
    // A job's env at its limit, plus the GPUCTL_* variables the master
    // adds: the agent must take it.
    let env = (0..MAX_ENV_VARS + 3)
        .map(|i| (format!("V{i}"), String::new()))
        .collect();
    let t = pb::TaskSpec {
        task_id: "job-1.0".into(),
        job_id: "job-1".into(),
        command: vec!["true".into()],
        env,
        ..Default::default()
    };
    assert!(TaskSpec::try_from(t.clone()).is_ok());
    let mut bad = t;
    bad.env.insert("A=B".into(), String::new());
    assert_eq!(
        TaskSpec::try_from(bad).unwrap_err().field,
        "task.env[\"A=B\"]"
    );
}

#[test]
fn state_names() {
    assert_eq!(
        job_state_name(pb::JobState::JobSucceeded as i32),
        "SUCCEEDED"
    );
    assert_eq!(task_state_name(pb::TaskState::TaskKilled as i32), "KILLED");
    assert_eq!(
        task_state_name(pb::TaskState::TaskUnreachable as i32),
        "UNREACHABLE"
    );
    assert!(!TaskState::Unreachable.is_terminal());
    assert_eq!(TaskState::Unreachable.to_string(), "UNREACHABLE");
    assert_eq!(task_state_name(99), "UNKNOWN");
}

fn update(state: pb::TaskState, reason: pb::Reason) -> pb::StatusUpdate {
    pb::StatusUpdate {
        enforcement: String::new(),
        agent_id: "a1".into(),
        task_id: "job-1.0".into(),
        state: state as i32,
        exit_code: None,
        message: "no leader for 75s".into(),
        uuid: b"u".to_vec(),
        reason: reason as i32,
        latest_state: 0,
        requires: Vec::new(),
        failed_gpus: Vec::new(),
        health: None,
    }
}

#[test]
fn driver_refusals_carry_the_image_requirements() {
    let mut wire = update(
        pb::TaskState::TaskFailed,
        pb::Reason::DriverRequirementUnmet,
    );
    wire.requires = vec!["cuda>=12.2 brand=tesla,driver>=470,driver<471".into()];
    let u = StatusUpdate::try_from(wire.clone()).unwrap();
    assert_eq!(u.requires, wire.requires);
    assert_eq!(pb::StatusUpdate::from(u), wire);
    // The reason without requirements, requirements without the
    // reason, another state, too many: refused, naming the field.
    let mut bad = wire.clone();
    bad.requires.clear();
    assert_eq!(StatusUpdate::try_from(bad).unwrap_err().field, "requires");
    let mut bad = wire.clone();
    bad.reason = pb::Reason::Unspecified as i32;
    assert_eq!(StatusUpdate::try_from(bad).unwrap_err().field, "requires");
    let mut bad = wire.clone();
    bad.state = pb::TaskState::TaskKilled as i32;
    assert_eq!(StatusUpdate::try_from(bad).unwrap_err().field, "reason");
    let mut bad = wire.clone();
    bad.requires = vec!["cuda>=1".into(); crate::cuda_req::MAX_EXPRS + 1];
    assert_eq!(StatusUpdate::try_from(bad).unwrap_err().field, "requires");
    let mut bad = wire;
    bad.requires = vec!["cuda>=1\n".into()];
    assert_eq!(
        StatusUpdate::try_from(bad).unwrap_err().field,
        "requires[0]"
    );
}

#[test]
fn require_cuda_is_checked_at_submit() {
    let spec = |require_cuda: &str| pb::JobSpec {
        name: "j".into(),
        command: vec!["true".into()],
        resources: Some(pb::Resources {
            cpus: 1.0,
            mem_mib: 0,
            gpus: 0,
            ports: 0,
        }),
        require_cuda: require_cuda.into(),
        ..Default::default()
    };
    let ok = JobSpec::try_from(spec("cuda>=12.2 driver>=470,driver<471")).unwrap();
    assert_eq!(
        ok.require_cuda.as_ref().map(|e| e.text()),
        Some("cuda>=12.2 driver>=470,driver<471")
    );
    assert_eq!(
        pb::JobSpec::from(ok).require_cuda,
        "cuda>=12.2 driver>=470,driver<471"
    );
    assert_eq!(JobSpec::try_from(spec("  ")).unwrap().require_cuda, None);
    for (bad, why) in [
        ("cuda>=twelve", "not a version"),
        ("cudnn>=8", "unknown key"),
        ("cuda=>12", "unknown operator"),
        (",", "has no condition"),
        ("cuda>=12\tdriver>=1", "contains"),
    ] {
        let err = JobSpec::try_from(spec(bad)).unwrap_err();
        assert_eq!(err.field, "spec.require_cuda", "{bad}");
        assert!(err.reason.contains(why), "{bad}: {err}");
    }
}

#[test]
fn fenced_updates_round_trip_and_agents_cannot_send_unreachable() {
    let u = StatusUpdate::try_from(update(pb::TaskState::TaskKilled, pb::Reason::Fenced)).unwrap();
    assert!(u.fenced && !u.gpu_unhealthy);
    assert_eq!(u.state, TaskState::Killed);
    assert_eq!(
        pb::StatusUpdate::from(u),
        update(pb::TaskState::TaskKilled, pb::Reason::Fenced)
    );
    let plain =
        StatusUpdate::try_from(update(pb::TaskState::TaskKilled, pb::Reason::Unspecified)).unwrap();
    assert!(!plain.fenced);
    let err =
        StatusUpdate::try_from(update(pb::TaskState::TaskRunning, pb::Reason::Fenced)).unwrap_err();
    assert_eq!(err.field, "reason", "{err}");
    let err = StatusUpdate::try_from(update(
        pb::TaskState::TaskUnreachable,
        pb::Reason::Unspecified,
    ))
    .unwrap_err();
    assert_eq!(err.field, "state", "{err}");
}

#[test]
fn runtime_status_converts_and_checks_its_fields() {
    let wire = pb::RuntimeStatus {
        runtime: pb::Runtime::Docker as i32,
        available: false,
        message: "cannot connect to /var/run/docker.sock".into(),
    };
    let r = RuntimeStatus::try_from(wire.clone()).unwrap();
    assert_eq!(r.runtime, Runtime::Docker);
    assert!(!r.available);
    assert_eq!(pb::RuntimeStatus::from(r), wire);
    let mut bad = wire.clone();
    bad.runtime = 42;
    assert_eq!(
        RuntimeStatus::try_from(bad).unwrap_err().field,
        "runtimes.runtime"
    );
    let mut long = wire;
    long.message = "x".repeat(MAX_REASON_LEN + 1);
    assert_eq!(
        RuntimeStatus::try_from(long).unwrap_err().field,
        "runtimes.message"
    );
}

#[test]
fn gpu_reports_carry_task_memory_and_bound_it() {
    let wire = pb::GpuReport {
        uuid: "GPU-1".into(),
        healthy: true,
        unhealthy_reason: String::new(),
        sample: Some(pb::GpuSample {
            memory_used_mib: 3000,
            task_memory_used_mib: [("job-1.0".to_string(), 1024), ("job-2.0".into(), 512)].into(),
            ..Default::default()
        }),
    };
    let r = GpuReport::try_from(wire.clone()).unwrap();
    let s = r.sample.clone().unwrap();
    assert_eq!(s.task_memory_used_mib["job-1.0"], 1024);
    assert_eq!(s.task_memory_used_mib.len(), 2);
    assert_eq!(pb::GpuReport::from(r), wire);
    let with_tasks = |tasks: Vec<(String, u64)>| {
        let mut w = wire.clone();
        if let Some(s) = w.sample.as_mut() {
            s.task_memory_used_mib = tasks.into_iter().collect();
        }
        GpuReport::try_from(w).map_err(|e| e.field)
    };
    let many = |n: usize| (0..n).map(|i| (format!("t{i}"), 1)).collect::<Vec<_>>();
    assert!(with_tasks(many(MAX_SAMPLE_TASKS)).is_ok());
    assert_eq!(
        with_tasks(many(MAX_SAMPLE_TASKS + 1)).unwrap_err(),
        "gpus.sample.task_memory_used_mib"
    );
    assert_eq!(
        with_tasks(vec![("bad id".into(), 1)]).unwrap_err(),
        "gpus.sample.task_memory_used_mib"
    );
}

type Mutate<T> = fn(&mut T);

fn framework_task() -> pb::TaskInfo {
    pb::TaskInfo {
        task_id: "t1".into(),
        agent_id: "a1".into(),
        command: vec!["true".into()],
        resources: Some(pb::Resources {
            cpus: 1.0,
            mem_mib: 64,
            gpus: 0,
            ports: 0,
        }),
        ..Default::default()
    }
}

#[test]
fn framework_tasks_are_checked_like_jobs() {
    let field = "operations[0].tasks[1]";
    let convert = |t| framework_task_from_pb("operations[0].tasks[1]", t).map(|_| ());
    // The same limits as a job's, at the limit and one past it.
    boundary(
        &framework_task(),
        |t| t.env = [("FOO".into(), "v".repeat(MAX_ENV_VALUE_BYTES))].into(),
        |t| t.env = [("FOO".into(), "v".repeat(MAX_ENV_VALUE_BYTES + 1))].into(),
        &format!("{field}.env[\"FOO\"]"),
        convert,
    );
    boundary(
        &framework_task(),
        |t| t.command = vec!["a".into(); MAX_COMMAND_ARGS],
        |t| t.command = vec!["a".into(); MAX_COMMAND_ARGS + 1],
        &format!("{field}.command"),
        convert,
    );
    let cases: Vec<(Mutate<pb::TaskInfo>, &str)> = vec![
        (|t| t.image = "bad image".into(), "image"),
        (|t| t.command.clear(), "command"),
        (|t| t.command = vec!["a\0".into()], "command[0]"),
        (
            |t| t.env = [("A=B".into(), "x".into())].into(),
            "env[\"A=B\"]",
        ),
        (|t| t.task_id = "../x".into(), "task_id"),
        (|t| t.agent_id = String::new(), "agent_id"),
        (
            |t| {
                if let Some(r) = t.resources.as_mut() {
                    r.mem_mib = u64::MAX;
                }
            },
            "resources.mem_mib",
        ),
        (|t| t.gpu_uuids = vec!["GPU-0".into()], "gpu_uuids"),
        (
            |t| {
                t.gpu_uuids = vec!["GPU 0".into()];
                if let Some(r) = t.resources.as_mut() {
                    r.gpus = 1;
                }
            },
            "gpu_uuids[0]",
        ),
        // The same GPU twice: the second is named.
        (
            |t| {
                t.gpu_uuids = vec!["GPU-0".into(), "GPU-0".into()];
                if let Some(r) = t.resources.as_mut() {
                    r.gpus = 2;
                }
            },
            "gpu_uuids[1]",
        ),
    ];
    for (mutate, sub) in cases {
        let mut t = framework_task();
        mutate(&mut t);
        let err = framework_task_from_pb(field, t).expect_err(sub);
        assert_eq!(err.field, format!("{field}.{sub}"), "{err}");
    }
    let ok = framework_task_from_pb(field, framework_task()).unwrap();
    assert_eq!((ok.image, ok.command), (None, vec!["true".to_string()]));
}

/// Issue 34: a framework's task may ask a fraction of one shared GPU
/// instead of GPUs; it names the GPU there, and bad input names the
/// field.
#[test]
fn a_framework_task_asks_a_fraction_of_a_named_shared_gpu() {
    let field = "operations[0].tasks[1]";
    let with = |mem_mib, compute_pct| {
        let mut t = framework_task();
        t.gpu_fraction = Some(pb::GpuFraction {
            gpu_uuid: "GPU-0".into(),
            mem_mib,
            compute_pct,
        });
        t
    };
    let ok = framework_task_from_pb(field, with(10240, 25)).unwrap();
    assert_eq!(ok.gpu_uuids, vec!["GPU-0".to_string()]);
    assert_eq!(
        ok.fraction,
        Some(GpuFraction {
            mem_mib: 10240,
            compute_pct: 25
        })
    );
    assert_eq!(ok.resources.gpus, 0);
    assert_eq!(
        framework_task_from_pb(field, framework_task())
            .unwrap()
            .fraction,
        None
    );
    boundary(
        &with(MAX_MEM_MIB, 100),
        |_| {},
        |t| t.gpu_fraction.as_mut().unwrap().compute_pct = 101,
        &format!("{field}.gpu_fraction.compute_pct"),
        |t| framework_task_from_pb(field, t).map(|_| ()),
    );
    let cases: Vec<(Mutate<pb::TaskInfo>, &str)> = vec![
        (
            |t| t.gpu_fraction.as_mut().unwrap().mem_mib = 0,
            "gpu_fraction.mem_mib",
        ),
        (
            |t| t.gpu_fraction.as_mut().unwrap().mem_mib = MAX_MEM_MIB + 1,
            "gpu_fraction.mem_mib",
        ),
        (
            |t| t.gpu_fraction.as_mut().unwrap().gpu_uuid = String::new(),
            "gpu_fraction.gpu_uuid",
        ),
        (
            |t| t.gpu_fraction.as_mut().unwrap().gpu_uuid = "GPU 0/..".into(),
            "gpu_fraction.gpu_uuid",
        ),
        // A fraction is not a device: no GPUs beside it.
        (
            |t| {
                t.gpu_uuids = vec!["GPU-1".into()];
                if let Some(r) = t.resources.as_mut() {
                    r.gpus = 1;
                }
            },
            "resources.gpus",
        ),
        (|t| t.gpu_uuids = vec!["GPU-0".into()], "gpu_uuids"),
    ];
    for (mutate, sub) in cases {
        let mut t = with(1024, 0);
        mutate(&mut t);
        let err = framework_task_from_pb(field, t).expect_err(sub);
        assert_eq!(err.field, format!("{field}.{sub}"), "{err}");
    }
}

#[test]
fn framework_info_is_checked() {
    let info = || pb::FrameworkInfo {
        name: "trainer".into(),
        roles: vec!["research".into()],
        failover_timeout_secs: 60.0,
        capabilities: vec![pb::FrameworkCapability::GpuResources as i32],
        ..Default::default()
    };
    let ok = framework_info_from_pb(Some(info())).unwrap();
    assert!(ok.gpu_capable);
    assert_eq!(ok.failover_timeout_ms, 60_000);
    assert_eq!(framework_info_from_pb(None).unwrap_err().field, "framework");
    let cases: Vec<(Mutate<pb::FrameworkInfo>, &str)> = vec![
        (|f| f.id = BUILTIN_FRAMEWORK_ID.into(), "framework.id"),
        (|f| f.id = "a/b".into(), "framework.id"),
        (|f| f.name = " ".into(), "framework.name"),
        (
            |f| f.name = "n".repeat(MAX_FRAMEWORK_NAME + 1),
            "framework.name",
        ),
        (|f| f.roles = vec!["".into()], "framework.roles[]"),
        (
            |f| f.failover_timeout_secs = f64::NAN,
            "framework.failover_timeout_secs",
        ),
        (
            |f| f.failover_timeout_secs = MAX_FAILOVER_SECS + 1.0,
            "framework.failover_timeout_secs",
        ),
    ];
    for (mutate, field) in cases {
        let mut f = info();
        mutate(&mut f);
        assert_eq!(framework_info_from_pb(Some(f)).unwrap_err().field, field);
    }
}

#[test]
fn drain_deadlines_are_checked() {
    assert_eq!(drain_deadline(1_000, None), Ok(None));
    assert_eq!(drain_deadline(1_000, Some(0.0)), Ok(Some(1_000)));
    assert_eq!(drain_deadline(1_000, Some(2.5)), Ok(Some(3_500)));
    for bad in [-1.0, f64::INFINITY, f64::NAN, MAX_DRAIN_DEADLINE_SECS * 2.0] {
        assert_eq!(
            drain_deadline(0, Some(bad)).unwrap_err().field,
            "deadline_secs"
        );
    }
}

#[test]
fn task_reasons_have_their_wire_names() {
    assert_eq!(pb::Reason::from(TaskReason::Fenced), pb::Reason::Fenced);
    assert_eq!(
        pb::Reason::from(TaskReason::AgentDrained),
        pb::Reason::AgentDraining
    );
    assert_eq!(
        pb::Reason::from(TaskReason::default()),
        pb::Reason::Unspecified
    );
}

#[test]
fn a_gpu_failure_names_the_failed_gpus_and_only_it_may() {
    let mut wire = update(pb::TaskState::TaskFailed, pb::Reason::GpuUnhealthy);
    wire.failed_gpus = vec!["GPU-a-1".into()];
    let u = StatusUpdate::try_from(wire.clone()).unwrap();
    assert!(u.gpu_unhealthy);
    assert_eq!(u.failed_gpus, ["GPU-a-1"]);
    assert_eq!(pb::StatusUpdate::from(u), wire);
    // Another reason, too many, a bad name: refused, naming the field.
    let mut bad = update(pb::TaskState::TaskFailed, pb::Reason::Unspecified);
    bad.failed_gpus = vec!["GPU-a-1".into()];
    assert_eq!(
        StatusUpdate::try_from(bad).unwrap_err().field,
        "failed_gpus"
    );
    let mut bad = wire.clone();
    bad.failed_gpus = (0..=MAX_GPUS).map(|i| format!("GPU-{i}")).collect();
    assert_eq!(
        StatusUpdate::try_from(bad).unwrap_err().field,
        "failed_gpus"
    );
    let mut bad = wire;
    bad.failed_gpus = vec!["GPU a".into()];
    assert_eq!(
        StatusUpdate::try_from(bad).unwrap_err().field,
        "failed_gpus[0]"
    );
}

/// A template with every field away from its default: a field added to
/// [`TaskTemplate`] must be set here (the literal lists them all), so the
/// round trips below cover it.
fn full_template() -> TaskTemplate {
    TaskTemplate {
        image: Some("registry.local/train:1".into()),
        command: vec!["python".into(), "train.py".into()],
        env: BTreeMap::from([("EPOCHS".into(), "3".into())]),
        resources: Resources {
            cpus: 2.5,
            mem_mib: 4096,
            gpus: 2,
            ports: 1,
        },
        no_fence: true,
        security: TaskSecurity {
            user: Some("1000:1000".into()),
            mounts: vec![HostMount {
                host_path: "/data".into(),
                container_path: "/in".into(),
                read_only: false,
            }],
            privileged: false,
            run_as_root: false,
        },
        stop_grace_ms: Some(90_000),
        checkpoint_dir: Some("/ckpt/run-1".into()),
        hang_timeout_ms: Some(600_000),
        preflight: true,
        // Every option set (the struct literal lists them all).
        options: TaskOptions {
            shm_size: Some(MiB(8192)),
            port: vec!["http".into()],
            readiness: Some("http:http/healthz interval=2s start=5m".parse().unwrap()),
            liveness: Some("timeout=5s exec:test -f /tmp/alive".parse().unwrap()),
        },
    }
}

#[test]
fn a_template_crosses_both_wire_messages_whole() {
    let template = full_template();
    let mut job = JobSpec::new("j", Vec::new(), Resources::default());
    job.template = template.clone();
    let back = JobSpec::try_from(pb::JobSpec::from(job.clone())).unwrap();
    assert_eq!(back.template, template);
    assert_eq!(back, job);

    let task = TaskSpec {
        task_id: "t-1".into(),
        job_id: "job-1".into(),
        framework_id: String::new(),
        template: template.clone(),
        gpu_uuids: vec!["GPU-a".into(), "GPU-b".into()],
        share: None,
    };
    let back = TaskSpec::try_from(pb::TaskSpec::from(task.clone())).unwrap();
    assert_eq!(back, task);

    // The same fields, under the same names, in both messages.
    let wire_job = pb::JobSpec::from(job);
    let wire_task = pb::TaskSpec::from(task);
    assert_eq!(
        (
            &wire_job.image,
            &wire_job.command,
            &wire_job.resources,
            wire_job.no_fence
        ),
        (
            &wire_task.image,
            &wire_task.command,
            &wire_task.resources,
            wire_task.no_fence
        )
    );
    assert_eq!(
        (
            &wire_job.security,
            &wire_job.checkpoint_dir,
            wire_job.preflight
        ),
        (
            &wire_task.security,
            &wire_task.checkpoint_dir,
            wire_task.preflight
        )
    );
    assert_eq!(
        (
            wire_job.stop_grace_ms,
            wire_job.hang_timeout_ms,
            &wire_job.env
        ),
        (
            wire_task.stop_grace_ms,
            wire_task.hang_timeout_ms,
            &wire_task.env
        )
    );
}

/// The Raft log and snapshots hold `JobSpec`s, and agents keep `TaskSpec`s,
/// as JSON: the template is flattened, so what an earlier build wrote (the
/// fields at the top) reads the same, and is written the same.
#[test]
fn the_template_keeps_the_logs_json_form() {
    let written_before = serde_json::json!({
        "name": "train",
        "image": "registry.local/train:1",
        "command": ["python", "train.py"],
        "env": {"EPOCHS": "3"},
        "resources": {"cpus": 2.5, "mem_mib": 4096, "gpus": 2, "ports": 1},
        "replicas": 2,
        "no_fence": true,
        "security": {
            "user": "1000:1000",
            "mounts": [{"host_path": "/data", "container_path": "/in", "read_only": false}]
        },
        "stop_grace_ms": 90000,
        "checkpoint_dir": "/ckpt/run-1",
        "hang_timeout_ms": 600000,
        "preflight": true,
        "restart_policy": "never"
    });
    let spec: JobSpec = serde_json::from_value(written_before.clone()).unwrap();
    // That build had no options: the template is the full one without.
    let before_options = TaskTemplate {
        options: TaskOptions::default(),
        ..full_template()
    };
    assert_eq!(spec.template, before_options);
    assert_eq!(
        (spec.replicas, spec.restart_policy),
        (2, RestartPolicy::Never)
    );
    assert_eq!(serde_json::to_value(&spec).unwrap(), written_before);
    // An option is written beside the template's fields, in its own form.
    let mut with_options = spec.clone();
    with_options.template = full_template();
    let mut expected = written_before.clone();
    expected["shm_size"] = serde_json::json!("8GiB");
    expected["port"] = serde_json::json!(["http"]);
    expected["readiness"] = serde_json::json!("http:http/healthz start=5m interval=2s");
    expected["liveness"] = serde_json::json!("timeout=5s exec:test -f /tmp/alive");
    assert_eq!(serde_json::to_value(&with_options).unwrap(), expected);
    let back: JobSpec = serde_json::from_value(expected).unwrap();
    assert_eq!(back, with_options);

    // A plain job of an early build: only the fields it had then.
    let early = serde_json::json!({
        "name": "j", "image": null, "command": ["true"], "env": {},
        "resources": {"cpus": 1.0, "mem_mib": 0, "gpus": 0}
    });
    let spec: JobSpec = serde_json::from_value(early).unwrap();
    assert_eq!(
        spec.template,
        TaskTemplate::new(
            vec!["true".into()],
            Resources {
                cpus: 1.0,
                ..Resources::default()
            }
        )
    );

    // A task an agent kept: its no_fence was written even when false.
    let kept = serde_json::json!({
        "task_id": "t-1", "job_id": "job-1", "framework_id": "",
        "image": null, "command": ["true"], "env": {},
        "resources": {"cpus": 1.0, "mem_mib": 0, "gpus": 1, "ports": 0},
        "gpu_uuids": ["GPU-a"], "no_fence": false
    });
    let task: TaskSpec = serde_json::from_value(kept).unwrap();
    assert_eq!((task.template.command.len(), task.gpu_uuids.len()), (1, 1));
    assert!(!task.template.no_fence);
}

#[test]
fn shm_size_is_bounded_and_for_containers_only_naming_its_field() {
    let with = |image: &str, mib: u64| {
        let mut s = spec();
        s.image = image.into();
        s.security = None;
        s.options = Some(pb::TaskOptions {
            shm_size_mib: Some(mib),
            ..Default::default()
        });
        JobSpec::try_from(s)
    };
    let ok = with("busybox:latest", 8192).unwrap();
    assert_eq!(ok.template.options.shm_size, Some(MiB(8192)));
    assert_eq!(
        with("busybox:latest", MAX_SHM_SIZE_MIB)
            .unwrap()
            .template
            .options
            .shm_size,
        Some(MiB(MAX_SHM_SIZE_MIB))
    );
    for bad in [0, MAX_SHM_SIZE_MIB + 1] {
        let e = with("busybox:latest", bad).unwrap_err();
        assert_eq!(e.field, "spec.options.shm_size_mib", "{bad}");
    }
    let e = with("", 8192).unwrap_err();
    assert_eq!(e.field, "spec.options.shm_size_mib");
    assert!(e.reason.contains("container"), "{e}");
    // Unset: nothing on the wire, and the default back.
    let plain = JobSpec::try_from(spec()).unwrap();
    assert!(plain.template.options.is_default());
    assert_eq!(pb::JobSpec::from(plain).options, None);
}

#[test]
fn named_ports_are_task_ports_and_named_once_each() {
    let with = |ports: u32, names: &[&str]| {
        let mut s = spec();
        s.resources.as_mut().unwrap().ports = ports;
        s.options = Some(pb::TaskOptions {
            port_names: names.iter().map(|n| n.to_string()).collect(),
            ..Default::default()
        });
        JobSpec::try_from(s)
    };
    // No --ports: one per name; more ports than names: the first named.
    let j = with(0, &["http", "metrics"]).unwrap();
    assert_eq!(j.template.resources.ports, 2);
    assert_eq!(j.template.options.port, vec!["http", "metrics"]);
    assert_eq!(with(3, &["http"]).unwrap().template.resources.ports, 3);
    // Read again from its own wire: the same (the fill is idempotent).
    let again = JobSpec::try_from(pb::JobSpec::from(j.clone())).unwrap();
    assert_eq!(again, j);
    let e = with(1, &["http", "grpc"]).unwrap_err();
    assert_eq!(e.field, "spec.resources.ports", "{e}");
    for (names, field) in [
        (&["http", "http"][..], "spec.options.port_names[1]"),
        (&["HTTP"][..], "spec.options.port_names[0]"),
        (&["1http"][..], "spec.options.port_names[0]"),
        (&["a-very-long-port-name"][..], "spec.options.port_names[0]"),
    ] {
        let e = with(0, names).unwrap_err();
        assert_eq!(e.field, field, "{names:?}: {e}");
    }
}

#[test]
fn health_checks_name_a_port_of_the_task_and_keep_their_bounds() {
    let with = |names: &[&str], readiness: pb::HealthCheck| {
        let mut s = spec();
        s.options = Some(pb::TaskOptions {
            port_names: names.iter().map(|n| n.to_string()).collect(),
            readiness: Some(readiness),
            ..Default::default()
        });
        JobSpec::try_from(s)
    };
    let http = |port: &str| pb::HealthCheck {
        probe: "http".into(),
        port: port.into(),
        path: "/healthz".into(),
        ..Default::default()
    };
    // Zeros are the defaults; the check reads back as written.
    let j = with(&["http"], http("http")).unwrap();
    let c = j.template.options.readiness.clone().unwrap();
    assert_eq!(c.to_string(), "http:http/healthz");
    assert_eq!(
        (c.interval_ms, c.failures),
        (CHECK_INTERVAL_MS, CHECK_FAILURES)
    );
    assert_eq!(JobSpec::try_from(pb::JobSpec::from(j.clone())).unwrap(), j);
    for (names, check, field, words) in [
        (
            &["http"][..],
            http("grpc"),
            "spec.options.readiness.port",
            "not one of the task's port names (http",
        ),
        (
            &[][..],
            http("http"),
            "spec.options.readiness.port",
            "it has none",
        ),
        (
            &["http"][..],
            http(""),
            "spec.options.readiness.port",
            "names none",
        ),
        (
            &["http"][..],
            pb::HealthCheck {
                probe: "gopher".into(),
                ..http("http")
            },
            "spec.options.readiness.probe",
            "http, tcp or exec",
        ),
        (
            &["http"][..],
            pb::HealthCheck {
                probe: "exec".into(),
                path: String::new(),
                command: "true".into(),
                ..http("http")
            },
            "spec.options.readiness.port",
            "not for a \"exec\" probe",
        ),
        (
            &["http"][..],
            pb::HealthCheck {
                interval_ms: 10,
                ..http("http")
            },
            "spec.options.readiness.interval_ms",
            "from 100ms to 1h",
        ),
        (
            &["http"][..],
            pb::HealthCheck {
                failures: 101,
                ..http("http")
            },
            "spec.options.readiness.failures",
            "from 1 to 100",
        ),
        (
            &["http"][..],
            pb::HealthCheck {
                path: "no-slash".into(),
                ..http("http")
            },
            "spec.options.readiness.path",
            "must start with '/'",
        ),
    ] {
        let e = with(names, check).unwrap_err();
        assert_eq!(e.field, field, "{e}");
        assert!(e.to_string().contains(words), "{e}");
    }
}

#[test]
fn a_health_report_comes_with_running_and_a_liveness_stop_with_failed() {
    let mut u = update(pb::TaskState::TaskRunning, pb::Reason::Unspecified);
    u.health = Some(pb::TaskHealth {
        ready: true,
        failure: "readiness: GET / (port 31000): HTTP 503".into(),
    });
    let s = StatusUpdate::try_from(u.clone()).unwrap();
    assert!(s.health.as_ref().unwrap().ready);
    assert_eq!(pb::StatusUpdate::from(s), u);
    u.state = pb::TaskState::TaskFinished as i32;
    let e = StatusUpdate::try_from(u.clone()).unwrap_err();
    assert_eq!(e.field, "health", "{e}");
    u.health = Some(pb::TaskHealth {
        ready: false,
        failure: "two\nlines".into(),
    });
    u.state = pb::TaskState::TaskRunning as i32;
    assert_eq!(
        StatusUpdate::try_from(u).unwrap_err().field,
        "health.failure"
    );
    let e = StatusUpdate::try_from(update(
        pb::TaskState::TaskKilled,
        pb::Reason::LivenessFailed,
    ))
    .unwrap_err();
    assert_eq!(e.field, "reason", "{e}");
    let failed = StatusUpdate::try_from(update(
        pb::TaskState::TaskFailed,
        pb::Reason::LivenessFailed,
    ))
    .unwrap();
    assert!(failed.liveness_failed);
}
