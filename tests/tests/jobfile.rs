//! Job files end to end with the real binaries and host-process tasks (no
//! Docker needed): `jobs submit -f` with flags over the file, an unknown
//! key refused naming key and line, and `jobs get -o yaml` submitted again.
#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::process::{Command, Stdio};

use serde_json::Value;

use gpuctl_tests::Gpuctl;
use gpuctl_tests::{bin, AgentOpts, Cluster};

const JOB: &str = r#"# every kind of value: text, numbers, maps, lists, booleans
name: from-file
command: [sh, -c, 'echo "A=$A B=$B S=$S rank=$GPUCTL_RANK"']
gpus: 1
cpus: 0.5
mem: 256
ports: 2
env:
  A: 1
  B: from-file
secret_env:
  S: s3cret
gpu_model: "A100*"
gpu_mem_min: 1024
placement: spread
priority: 7
replicas: 2
max_retries: 1
no_requeue: true
"#;

/// The parts of `jobs get --json` that come from the spec.
fn spec_of(job: &Value) -> Value {
    let mut spec = serde_json::Map::new();
    for key in [
        "name",
        "tenant",
        "image",
        "command",
        "env",
        "resources",
        "placement",
        "priority",
        "replicas",
        "max_retries",
        "no_requeue",
        "no_fence",
        "security",
        "require_cuda",
    ] {
        spec.insert(key.to_string(), job[key].clone());
    }
    Value::Object(spec)
}

fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn job_files_submit_with_flags_over_them_and_round_trip() {
    let mut c = Cluster::start(&[]);
    c.add_agent(AgentOpts::default());
    let dir = gpuctl_tests::test_dir();
    let file = dir.path().join("job.yaml");
    std::fs::write(&file, JOB).unwrap();
    let path = file.to_str().unwrap();

    // The file's options, with two flags over it (one a key of `env`).
    let id = c.submit(&["-f", path, "--env", "B=flag", "--gpus", "2"]);
    let job = c.job(&id);
    assert_eq!(job["name"], "from-file", "{job}");
    assert_eq!(job["image"], Value::Null);
    assert_eq!(
        job["command"],
        serde_json::json!(["sh", "-c", "echo \"A=$A B=$B S=$S rank=$GPUCTL_RANK\""])
    );
    assert_eq!(
        job["resources"],
        serde_json::json!({"cpus": 0.5, "mem_mib": 256, "gpus": 2, "ports": 2})
    );
    assert_eq!(
        job["env"],
        serde_json::json!({"A": "1", "B": "flag", "S": "<secret>"})
    );
    assert_eq!(job["placement"]["policy"], "spread");
    assert_eq!(job["placement"]["gpu_model"], "A100*");
    assert_eq!(job["placement"]["gpu_mem_min_mib"], 1024);
    assert_eq!(job["priority"], 7);
    assert_eq!(job["replicas"], 2);
    assert_eq!(job["max_retries"], 1);
    assert_eq!(job["no_requeue"], true);
    assert_eq!(job["no_fence"], false);
    assert_eq!(c.wait_job(&id, 60), (0, "SUCCEEDED".to_string()));
    let logs = c.ok(&["jobs", "logs", &id]);
    assert!(logs.contains("A=1 B=flag S=s3cret"), "{logs}");

    // An unknown key: a usage error naming the file, the key and its line.
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "name: x\ncommand: [true]\n\ngpu_count: 2\n").unwrap();
    let out = c.gpuctl(&["jobs", "submit", "-f", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    let err = stderr_of(&out);
    assert!(
        err.starts_with("error: job file ")
            && err.contains("unknown field `gpu_count`")
            && err.contains("line 4"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    // A value of the wrong type names the key and line too.
    std::fs::write(&bad, "name: x\ncommand: [true]\ngpus: two\n").unwrap();
    let out = c.gpuctl(&["jobs", "submit", "-f", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    let err = stderr_of(&out);
    assert!(err.contains("gpus") && err.contains("line 3"), "{err}");

    // -o yaml prints a job file; the secret's value is not in it, and the
    // file is refused until the value is given.
    let yaml = c.ok(&["jobs", "get", &id, "-o", "yaml"]);
    assert!(!yaml.contains("s3cret"), "{yaml}");
    assert!(yaml.contains("S: <secret>"), "{yaml}");
    let again = dir.path().join("again.yaml");
    std::fs::write(&again, &yaml).unwrap();
    let again = again.to_str().unwrap();
    let out = c.gpuctl(&["jobs", "submit", "-f", again]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(
        stderr_of(&out).contains("--secret-env S=VALUE"),
        "{}",
        stderr_of(&out)
    );
    let id2 = c.submit(&["-f", again, "--secret-env", "S=s3cret"]);
    assert_ne!(id2, id);
    let job2 = c.job(&id2);
    assert_eq!(spec_of(&job2), spec_of(&job));
    // ... and prints the same file, but for its first line (the job's id).
    let yaml2 = c.ok(&["jobs", "get", &id2, "-o", "yaml"]);
    let body = |y: &str| y.lines().skip(1).collect::<Vec<_>>().join("\n");
    assert_eq!(body(&yaml2), body(&yaml));
    assert_eq!(c.wait_job(&id2, 60), (0, "SUCCEEDED".to_string()));
    assert!(c
        .ok(&["jobs", "logs", &id2])
        .contains("A=1 B=flag S=s3cret"));

    // `-f -` reads standard input.
    let mut child = Command::new(bin("gpuctl"))
        .args(["--master", &c.master_addr, "jobs", "submit", "-f", "-"])
        .args(["--name", "stdin-job"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"command: [echo, from-stdin]\nenv: {N: 3}\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let id3 = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let job3 = c.job(&id3);
    assert_eq!(job3["name"], "stdin-job");
    assert_eq!(job3["command"], serde_json::json!(["echo", "from-stdin"]));
    assert_eq!(job3["env"], serde_json::json!({"N": "3"}));
    assert_eq!(c.wait_job(&id3, 30).0, 0);
}

/// `gpuctl completions` and `gpuctl man` need no master nor config file,
/// and a closed pipe ends them quietly.
#[test]
fn completions_and_man_pages_from_the_binary() {
    let gpuctl = |args: &[&str]| {
        Command::new(bin("gpuctl"))
            .args([
                "--config",
                "/nonexistent/gpuctl.toml",
                "--master",
                "127.0.0.1:1",
            ])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let out = gpuctl(&["completions", "bash"]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    let script = String::from_utf8(out.stdout).unwrap();
    assert!(
        script.contains("gpuctl__subcmd__jobs__subcmd__submit"),
        "bash names jobs submit"
    );
    let out = gpuctl(&["completions", "tcsh"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));

    let dir = gpuctl_tests::test_dir();
    let man = dir.path().join("man1");
    let out = gpuctl(&["man", man.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    let listed = String::from_utf8(out.stdout).unwrap();
    let submit = man.join("gpuctl-jobs-submit.1");
    assert!(
        listed.lines().any(|l| l == submit.to_str().unwrap()),
        "{listed}"
    );
    let page = std::fs::read_to_string(&submit).unwrap();
    assert!(
        page.contains("\\-\\-gpus") && page.contains("\\-\\-file"),
        "{page}"
    );

    // `| head -1`: the pipe closes early; no panic, exit 0.
    let mut child = Command::new(bin("gpuctl"))
        .args(["completions", "zsh"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
}
