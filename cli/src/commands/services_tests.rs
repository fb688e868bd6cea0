//! `gpuctl services ...`: the flags and job files `services create` takes
//! and refuses, the request it builds, and each command against a fake
//! master.
#![allow(clippy::result_large_err)]

use std::sync::{Arc, Mutex};

use clap::{CommandFactory, Parser};
use gpuctl_proto::pb;

use super::services::{run, CreateArgs, ServicesCommand};
use super::testkit::{dead_addr, serve, FakeOperator};
use super::{Cli, CliError, Command};
use crate::client::Master;
use crate::error::{EXIT_FAILURE, EXIT_NOT_FOUND, EXIT_USAGE};

fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
    Cli::try_parse_from(std::iter::once("gpuctl").chain(args.iter().copied()))
}

fn create_args(args: &[&str]) -> CreateArgs {
    let argv: Vec<&str> = ["services", "create"].iter().chain(args).copied().collect();
    match parse(&argv).expect("flags parse").command {
        Command::Services(ServicesCommand::Create(a)) => *a,
        other => panic!("parsed as {other:?}"),
    }
}

fn request(args: &[&str]) -> Result<pb::CreateServiceRequest, CliError> {
    create_args(args).request()
}

#[test]
fn create_builds_the_template_from_the_submit_flags() {
    let req = request(&[
        "web",
        "--replicas",
        "3",
        "--image",
        "nginx:1",
        "--gpus",
        "1",
        "--cpus",
        "0.5",
        "--mem",
        "512",
        "--ports",
        "1",
        "--env",
        "A=1",
        "--priority",
        "5",
        "--restart-backoff",
        "10s",
        "--stop-grace",
        "30s",
        "--shm-size",
        "1GiB",
        "--",
        "nginx",
        "-g",
        "daemon off;",
    ])
    .unwrap();
    assert_eq!((req.name.as_str(), req.replicas), ("web", 3));
    let t = req.template.unwrap();
    // One task, named as the service; no retries, no restart policy: the
    // master sets `always`.
    assert_eq!(t.name, "web");
    assert_eq!((t.replicas, t.min_replicas, t.max_retries), (1, 0, 0));
    assert_eq!((t.restart_policy.as_str(), t.no_requeue), ("", false));
    assert_eq!(t.image, "nginx:1");
    assert_eq!(t.command, ["nginx", "-g", "daemon off;"]);
    assert_eq!(
        t.resources,
        Some(pb::Resources {
            cpus: 0.5,
            mem_mib: 512,
            gpus: 1,
            ports: 1
        })
    );
    assert_eq!(t.env["A"], "1");
    assert_eq!(t.priority, 5);
    assert_eq!(t.restart_backoff_ms, Some(10_000));
    assert_eq!(t.stop_grace_ms, Some(30_000));
    assert_eq!(t.options.and_then(|o| o.shm_size_mib), Some(1024));
    // The template is the spec `jobs submit` makes of the same flags.
    let Command::Jobs(super::jobs::JobsCommand::Submit(submit)) = parse(&[
        "jobs", "submit", "--name", "web", "--image", "nginx:1", "--gpus", "1", "--", "nginx",
    ])
    .unwrap()
    .command
    else {
        panic!("not a submit")
    };
    let same = request(&["web", "--image", "nginx:1", "--gpus", "1", "--", "nginx"]).unwrap();
    assert_eq!(same.template, Some(submit.to_spec().unwrap()));
    // One replica unless asked; 0 is a service kept with none running.
    assert_eq!(same.replicas, 1);
    assert_eq!(
        request(&["web", "--replicas", "0", "--", "x"])
            .unwrap()
            .replicas,
        0
    );
}

#[test]
fn job_only_flags_are_refused_naming_the_flag() {
    for (flags, named) in [
        (&["--max-retries", "3"][..], "--max-retries"),
        (&["--restart-policy", "never"][..], "--restart-policy"),
        (&["--no-requeue"][..], "--no-requeue"),
        (&["--name", "other"][..], "--name"),
        (&["--request-id", "k-1"][..], "--request-id"),
    ] {
        let mut args = vec!["x"];
        args.extend(flags);
        args.extend(["--", "cmd"]);
        let err = request(&args).unwrap_err();
        assert_eq!(err.exit_code(), EXIT_USAGE, "{flags:?}: {err}");
        let text = err.to_string();
        assert!(
            text.starts_with(&format!("{named} is a job's flag")),
            "{text}"
        );
    }
    // A gang is refused by the parser, naming --replicas.
    for bad in ["2:4", "1025", "many"] {
        let err = parse(&["services", "create", "x", "--replicas", bad, "--", "cmd"]).unwrap_err();
        assert_eq!(err.exit_code(), i32::from(EXIT_USAGE), "{bad}");
        assert!(err.to_string().contains("--replicas"), "{bad}: {err}");
    }
    // The master's checks, before any call, in its words.
    let err = request(&["Web_1", "--", "cmd"]).unwrap_err();
    assert_eq!(err.exit_code(), EXIT_FAILURE);
    assert!(
        err.to_string().starts_with("invalid name: \"Web_1\""),
        "{err}"
    );
    let err = request(&["x", "--gpus", "65", "--", "cmd"]).unwrap_err();
    assert!(
        err.to_string().starts_with("invalid template.resources"),
        "{err}"
    );
}

#[test]
fn create_needs_a_name_and_a_command() {
    assert!(parse(&["services", "create", "--", "cmd"]).is_err());
    assert!(parse(&["services", "create", "web"]).is_err());
    // The job-only flags are hidden from the help; --replicas is the
    // service's.
    let mut cli = Cli::command();
    let create = cli
        .find_subcommand_mut("services")
        .and_then(|s| s.find_subcommand_mut("create"))
        .expect("services create");
    let help = create.render_help().to_string();
    let flags: Vec<&str> = help
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("-f, ").or(Some(l.trim_start())))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    for hidden in [
        "--max-retries",
        "--restart-policy",
        "--no-requeue",
        "--name",
        "--request-id",
    ] {
        assert!(!flags.contains(&hidden), "{hidden} in\n{help}");
    }
    for shown in [
        "--replicas <N>",
        "--gpus",
        "--image",
        "--env",
        "--shm-size",
        "[NAME]",
    ] {
        assert!(help.contains(shown), "{shown} not in\n{help}");
    }
}

#[test]
fn a_service_job_file_under_the_flags() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("svc.yaml");
    let p = path.to_str().unwrap();
    std::fs::write(
        &path,
        "kind: service\nname: web\nreplicas: 4\nimage: nginx:1\ngpus: 1\ncommand: [nginx]\n",
    )
    .unwrap();
    let req = request(&["-f", p]).unwrap();
    assert_eq!((req.name.as_str(), req.replicas), ("web", 4));
    let t = req.template.as_ref().unwrap();
    assert_eq!((t.name.as_str(), t.replicas), ("web", 1));
    assert_eq!(t.resources.map(|r| r.gpus), Some(1));
    // NAME and the flags override the file.
    let req = request(&["api", "-f", p, "--replicas", "2", "--gpus", "2"]).unwrap();
    assert_eq!((req.name.as_str(), req.replicas), ("api", 2));
    assert_eq!(req.template.unwrap().resources.map(|r| r.gpus), Some(2));

    // A job's file, a gang, a job-only key: refused, naming the file.
    for (text, want) in [
        ("name: web\ncommand: [x]\n", "add `kind: service`"),
        (
            "kind: job\nname: web\ncommand: [x]\n",
            "add `kind: service`",
        ),
        (
            "kind: service\nname: web\nreplicas: 2:4\ncommand: [x]\n",
            "replicas: 2:4",
        ),
        (
            "kind: service\nname: web\nmax_retries: 1\ncommand: [x]\n",
            "max_retries is a job's key",
        ),
        (
            "kind: service\nname: web\nrequest_id: a\ncommand: [x]\n",
            "request_id is a job's key",
        ),
        ("kind: service\ncommand: [x]\n", "no service name"),
    ] {
        std::fs::write(&path, text).unwrap();
        let err = request(&["-f", p]).unwrap_err();
        assert_eq!(err.exit_code(), EXIT_USAGE, "{text}: {err}");
        assert!(err.to_string().contains(want), "{text}: {err}");
    }
    std::fs::write(&path, "kind: deployment\n").unwrap();
    let err = request(&["-f", p]).unwrap_err();
    assert!(
        err.to_string().contains("kind") && err.to_string().contains("line 1"),
        "{err}"
    );

    // `jobs submit -f` of a service's file points to `services create`.
    std::fs::write(&path, "kind: service\nname: web\ncommand: [x]\n").unwrap();
    let Command::Jobs(super::jobs::JobsCommand::Submit(submit)) =
        parse(&["jobs", "submit", "-f", p]).unwrap().command
    else {
        panic!("not a submit")
    };
    let err = submit.submission().unwrap_err();
    assert_eq!(err.exit_code(), EXIT_USAGE);
    assert!(
        err.to_string()
            .contains(&format!("use `gpuctl services create -f {p}`")),
        "{err}"
    );
    // `kind: job` is a job's file.
    std::fs::write(&path, "kind: job\nname: web\ncommand: [x]\n").unwrap();
    let Command::Jobs(super::jobs::JobsCommand::Submit(submit)) =
        parse(&["jobs", "submit", "-f", p]).unwrap().command
    else {
        panic!("not a submit")
    };
    assert_eq!(submit.submission().unwrap().0.name, "web");
}

#[test]
fn the_other_commands_parse() {
    let cmd = |args: &[&str]| match parse(args).unwrap().command {
        Command::Services(c) => c,
        other => panic!("parsed as {other:?}"),
    };
    assert!(matches!(
        cmd(&["services", "list", "--json"]),
        ServicesCommand::List(super::JsonFlag { json: true })
    ));
    assert!(matches!(
        cmd(&["services", "get", "web"]),
        ServicesCommand::Get { name, json: super::JsonFlag { json: false } } if name == "web"
    ));
    assert!(matches!(
        cmd(&["services", "scale", "web", "--replicas", "0"]),
        ServicesCommand::Scale {
            replicas: 0,
            json: false,
            ..
        }
    ));
    assert!(matches!(
        cmd(&["services", "delete", "web"]),
        ServicesCommand::Delete { name } if name == "web"
    ));
    assert!(parse(&["services", "scale", "web"]).is_err());
    assert!(parse(&["services", "scale", "web", "--replicas", "1:2"]).is_err());
    assert!(parse(&["services", "scale", "web", "--replicas", "1025"]).is_err());
    assert!(parse(&["services", "get"]).is_err());
}

/// A master with one service, `web`; others are not found.
#[derive(Default)]
struct Fake {
    created: Mutex<Vec<pb::CreateServiceRequest>>,
    scaled: Mutex<Vec<pb::ScaleServiceRequest>>,
}

fn not_found(name: &str) -> tonic::Status {
    tonic::Status::not_found(format!("service {name} not found"))
}

impl FakeOperator for Fake {
    fn create_service(&self, r: pb::CreateServiceRequest) -> Result<pb::Service, tonic::Status> {
        self.created.lock().unwrap().push(r.clone());
        Ok(pb::Service {
            id: "svc-7".into(),
            name: r.name,
            replicas: r.replicas,
            template: r.template,
            ..Default::default()
        })
    }
    fn get_service(&self, r: pb::GetServiceRequest) -> Result<pb::Service, tonic::Status> {
        match r.name.as_str() {
            "web" => Ok(crate::output::sample_service()),
            other => Err(not_found(other)),
        }
    }
    fn list_services(
        &self,
        _: pb::ListServicesRequest,
    ) -> Result<pb::ListServicesResponse, tonic::Status> {
        let mut web = crate::output::sample_service();
        web.replica_jobs.iter_mut().for_each(|r| r.job = None);
        web.events.clear();
        let api = pb::Service {
            id: "svc-2".into(),
            name: "api".into(),
            ..web.clone()
        };
        Ok(pb::ListServicesResponse {
            services: vec![web, api],
        })
    }
    fn scale_service(&self, r: pb::ScaleServiceRequest) -> Result<pb::Service, tonic::Status> {
        self.scaled.lock().unwrap().push(r.clone());
        let mut s = self.get_service(pb::GetServiceRequest { name: r.name })?;
        s.replicas = r.replicas;
        Ok(s)
    }
    fn delete_service(
        &self,
        r: pb::DeleteServiceRequest,
    ) -> Result<pb::DeleteServiceResponse, tonic::Status> {
        match r.name.as_str() {
            "web" => Ok(pb::DeleteServiceResponse {
                job_ids: vec!["job-4".into(), "job-5".into(), "job-6".into()],
            }),
            other => Err(not_found(other)),
        }
    }
}

async fn run_cmd(m: &mut Master, args: &[&str]) -> (Result<u8, CliError>, String) {
    let Command::Services(cmd) = parse(args).unwrap().command else {
        panic!("not a services command")
    };
    let mut out = Vec::new();
    let r = run(m, cmd, &mut out).await;
    (r, String::from_utf8(out).unwrap())
}

#[tokio::test]
async fn each_command_against_a_master() {
    let fake = Arc::new(Fake::default());
    let live = serve(fake.clone()).await;
    let mut m = Master::connect(&[dead_addr(), live]).await.unwrap();

    let (r, out) = run_cmd(
        &mut m,
        &[
            "services",
            "create",
            "web",
            "--replicas",
            "2",
            "--gpus",
            "1",
            "--",
            "serve",
        ],
    )
    .await;
    assert_eq!(r.unwrap(), 0);
    assert_eq!(out, "svc-7 web\n");
    let sent = fake.created.lock().unwrap().clone();
    assert_eq!(sent.len(), 1);
    assert_eq!((sent[0].name.as_str(), sent[0].replicas), ("web", 2));
    assert_eq!(
        sent[0].template.as_ref().map(|t| t.command.clone()),
        Some(vec!["serve".into()])
    );
    let (r, out) = run_cmd(
        &mut m,
        &["services", "create", "web", "--json", "--", "serve"],
    )
    .await;
    assert_eq!(r.unwrap(), 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["id"].as_str(), v["replicas"].as_u64()),
        (Some("svc-7"), Some(1))
    );

    let (r, out) = run_cmd(&mut m, &["services", "list"]).await;
    assert_eq!(r.unwrap(), 0);
    let names: Vec<&str> = out
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(names, ["NAME", "api", "web"], "by name:\n{out}");
    let (_, out) = run_cmd(&mut m, &["services", "list", "--json"]).await;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[1]["name"], "web");
    assert!(v[1]["replica_jobs"][0]["job"].is_null(), "{v}");

    let (r, out) = run_cmd(&mut m, &["services", "get", "web"]).await;
    assert_eq!(r.unwrap(), 0);
    assert!(out.starts_with("ID:       svc-1\n"), "{out}");
    assert!(out.contains("Replica jobs:\n"), "{out}");
    let (_, out) = run_cmd(&mut m, &["services", "get", "web", "--json"]).await;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["replica_jobs"][0]["job"]["state"], "RUNNING");
    let (r, _) = run_cmd(&mut m, &["services", "get", "nope"]).await;
    let err = r.unwrap_err();
    assert_eq!(err.exit_code(), EXIT_NOT_FOUND);
    assert_eq!(err.to_string(), "service nope not found");

    let (r, out) = run_cmd(&mut m, &["services", "scale", "web", "--replicas", "5"]).await;
    assert_eq!(r.unwrap(), 0);
    assert_eq!(out, "web: 5 replicas asked, 1 running\n");
    assert_eq!(fake.scaled.lock().unwrap()[0].replicas, 5);

    let (r, out) = run_cmd(&mut m, &["services", "delete", "web"]).await;
    assert_eq!(r.unwrap(), 0);
    assert_eq!(out, "job-4\njob-5\njob-6\n");
    let (r, _) = run_cmd(&mut m, &["services", "delete", "nope"]).await;
    assert_eq!(r.unwrap_err().exit_code(), EXIT_NOT_FOUND);
}
