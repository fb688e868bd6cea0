//! One job through every shape it is written in: `jobs submit`'s flags, the
//! job file, the wire, the domain `JobSpec`, the public JSON (`jobs get
//! --json`) and the job file `jobs get -o yaml` prints. A field dropped by
//! any of them fails here: every flag must be given below (checked against
//! clap's own list), and each hop must give back what went in.

use std::collections::BTreeSet;

use clap::{CommandFactory, Parser};
use gpuctl_core::types::JobSpec;
use gpuctl_proto::pb;
use serde_json::Value;

use super::jobfile::{self, JobFile, Text, SECRET_PLACEHOLDER};
use super::jobs::{JobsCommand, SubmitArgs};
use super::{Cli, Command};
use crate::output::JobJson;

/// Jobs that, together, give every flag a value other than its default
/// (some exclude others: whole GPUs, a MIG device or a fraction; mounts
/// for containers, root for host processes; retries or `never`).
const JOBS: &[&[&str]] = &[
    &[
        "--name",
        "train",
        "--image",
        "registry.local/train:1",
        "--gpus",
        "2",
        "--cpus",
        "2.5",
        "--mem",
        "4096",
        "--ports",
        "2",
        "--port",
        "http",
        "--readiness",
        "http:http/healthz interval=2s start=5m",
        "--liveness",
        "timeout=5s exec:test -f /tmp/alive",
        "--env",
        "EPOCHS=3",
        "--secret-env",
        "TOKEN=s3cret",
        "--tenant",
        "team-a",
        "--placement",
        "spread",
        "--gpu-model",
        "A100*",
        "--gpu-mem-min",
        "40000",
        "--constraint",
        "rack=r1",
        "--require-cuda",
        "cuda>=12.2",
        "--priority",
        "5",
        "--no-requeue",
        "--no-fence",
        "--replicas",
        "2:4",
        "--user",
        "1000:1000",
        "--mount",
        "/data:/in:rw",
        "--max-retries",
        "3",
        "--stop-grace",
        "90s",
        "--checkpoint-dir",
        "/ckpt/train",
        "--hang-timeout",
        "10m",
        "--restart-policy",
        "gang",
        "--restart-backoff",
        "10s",
        "--preflight",
        "--shm-size",
        "8GiB",
        "--request-id",
        "train-1",
        "--",
        "python",
        "train.py",
    ],
    &[
        "--name",
        "probe",
        "--mig",
        "1g.10gb",
        "--run-as-root",
        "--restart-policy",
        "never",
        "--",
        "nvidia-smi",
    ],
    &[
        "--name",
        "serve",
        "--image",
        "registry.local/serve:1",
        "--gpu-mem",
        "10GiB",
        "--gpu-compute",
        "30%",
        "--",
        "serve",
    ],
];

fn submit_args(flags: &[&str]) -> SubmitArgs {
    let argv = ["gpuctl", "jobs", "submit"].iter().chain(flags);
    match Cli::try_parse_from(argv).expect("flags parse").command {
        Command::Jobs(JobsCommand::Submit(a)) => *a,
        other => panic!("parsed as {other:?}"),
    }
}

#[test]
fn every_submit_flag_is_given_by_the_jobs_below() {
    let cli = Cli::command();
    let submit = cli
        .find_subcommand("jobs")
        .and_then(|j| j.find_subcommand("submit"))
        .expect("jobs submit");
    let given: BTreeSet<&str> = JOBS.iter().flat_map(|j| j.iter().copied()).collect();
    for arg in submit.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        // --file is the job file itself, exercised by every hop below.
        if long == "file" || long == "help" {
            continue;
        }
        let flag = format!("--{long}");
        assert!(
            given.contains(flag.as_str()),
            "{flag} is not given by any job of this test: add it, so that its way \
             through every shape of a job is checked"
        );
    }
}

/// The domain spec's JSON as (path, value) leaves; arrays are leaves.
fn leaves(prefix: &str, v: &Value, out: &mut Vec<(String, Value)>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                leaves(&path, v, out);
            }
        }
        other => out.push((prefix.to_string(), other.clone())),
    }
}

fn at<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, k| v.get(k))
}

#[test]
fn a_job_goes_through_flags_file_wire_domain_json_and_back_whole() {
    for flags in JOBS {
        let args = submit_args(flags);

        // Flags -> job file -> YAML -> job file.
        let file = args.as_file();
        let yaml = serde_yaml_ng::to_string(&file).unwrap();
        let read = jobfile::parse("test", &yaml).unwrap();
        assert_eq!(
            read, file,
            "{flags:?}: the job file's YAML round trip\n{yaml}"
        );

        // The flags over an empty file are the flags.
        let spec = args.to_spec().unwrap();
        assert_eq!(read.clone().into_spec().unwrap(), spec, "{flags:?}");

        // Wire -> domain -> wire -> domain.
        let domain = JobSpec::try_from(spec.clone()).unwrap();
        let again = JobSpec::try_from(pb::JobSpec::from(domain.clone())).unwrap();
        assert_eq!(again, domain, "{flags:?}: the wire round trip");

        // Domain -> public JSON: every field the domain has is shown with
        // the same value, at the same path (a fraction's under its keys).
        let job = pb::Job {
            id: "job-1".into(),
            spec: Some(pb::JobSpec::from(domain.clone())),
            ..Default::default()
        };
        let public = serde_json::to_value(JobJson::from(&job)).unwrap();
        let mut fields = Vec::new();
        leaves("", &serde_json::to_value(&domain).unwrap(), &mut fields);
        for (path, mut value) in fields {
            // The log writes the enum's Rust name (`Spread`), kept so that
            // older masters read newer entries; the public JSON its word.
            if let ("placement.policy", Value::String(p)) = (path.as_str(), &value) {
                value = Value::String(p.to_lowercase());
            }
            let shown = match path.as_str() {
                // Set by the master from the caller's token, never sent.
                "submitted_by" => continue,
                // Shown as `<secret>` values in `env`, not listed apart.
                "secret_env" => continue,
                "placement.fraction.mem_mib" => "placement.gpu_mem_mib",
                "placement.fraction.compute_pct" => "placement.gpu_compute_pct",
                p => p,
            };
            assert_eq!(
                at(&public, shown),
                Some(&value),
                "{flags:?}: the domain's {path} is not in jobs get --json as {shown}"
            );
        }

        // Public form -> the job file `jobs get -o yaml` prints -> the same
        // domain spec (a secret's value given again, as its comment asks).
        let mut printed = jobfile::from_spec(job.spec.as_ref().unwrap());
        for (k, v) in printed.secret_env.iter_mut() {
            assert_eq!(v.0, SECRET_PLACEHOLDER);
            *v = Text(domain.template.env[k].clone());
        }
        let printed = JobFile {
            // `jobs get -o yaml` never writes one: a copy is another job.
            request_id: read.request_id.clone(),
            ..printed
        };
        let resubmitted = JobSpec::try_from(printed.clone().into_spec().unwrap()).unwrap();
        assert_eq!(
            resubmitted, domain,
            "{flags:?}: jobs get -o yaml submits the same job"
        );
        let reread = jobfile::parse("printed", &serde_yaml_ng::to_string(&printed).unwrap());
        assert_eq!(reread.unwrap(), printed, "{flags:?}");
    }
}
