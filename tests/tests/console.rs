//! The web console (`gpuctl-master --http-listen`) in a real headless
//! Chromium, driven over the DevTools protocol as a person would use it:
//! pages load, a job submitted by filling and clicking the form runs, its
//! output streams while it runs, cancel works, tokens are asked for and a
//! wrong one is refused visibly, and a console on a follower keeps working
//! after the leader is SIGKILLed. Real masters, agents (GPUs through
//! fake-nvml or simulated) and host-process jobs; no Docker needed.
//! Screenshots are kept in `target/console-artifacts` (or
//! `$GPUCTL_ARTIFACTS`); `GPUCTL_UPDATE_DOCS_IMAGES=1` also copies them to
//! docs/img for docs/console.md.
//!
//! Skipped without Chromium (`apt-get install chromium`), unless
//! `GPUCTL_REQUIRE_DOCKER=1` (CI), where that fails.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpuctl_tests::browser::{update_doc_image, Browser};
use gpuctl_tests::{free_port, AgentOpts, Cluster, Gpuctl, HaCluster, SecureSingle};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(30);
const JOB_T: Duration = Duration::from_secs(60);

const GPU0: &str = "GPU-0c5e6a3e-0000-4000-8000-000000000000";
const GPU1: &str = "GPU-0c5e6a3e-0000-4000-8000-000000000001";

/// Two A100s for fake-nvml; GPU 1 busy at 87% with 12 GiB used, as if
/// something outside gpuctl ran there.
fn fake_machine(dir: &Path) -> PathBuf {
    let m = json!({
        "gpus": [
            { "uuid": GPU0, "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960,
              "temperature_c": 41, "power_mw": 61000 },
            { "uuid": GPU1, "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960,
              "memory_used_mib": 12288, "utilization_gpu_pct": 87,
              "temperature_c": 67, "power_mw": 250500 }
        ],
        "events": []
    });
    let path = dir.join("machine.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    path
}

fn shot(b: &Browser, name: &str) {
    let path = b.screenshot(name);
    update_doc_image(&path, name);
}

fn job_json(c: &impl Gpuctl, id: &str) -> Value {
    serde_json::from_str(&c.ok(&["jobs", "get", id, "--json"])).unwrap()
}

/// Fills the submit form field by field, clicks Submit and returns the id
/// of the job whose page the console then shows.
fn submit_through_form(b: &Browser, base: &str, fields: &[(&str, &str)]) -> String {
    b.goto(&format!("{base}#/submit"));
    b.wait_for("the submit form", "!!document.querySelector('#f-name')", T);
    for (sel, value) in fields {
        b.type_into(sel, value);
    }
    b.click("#f-submit");
    let id = b.wait_for(
        "the new job's page",
        "location.hash.startsWith('#/jobs/job-') && decodeURIComponent(location.hash.slice(7))",
        T,
    );
    id.as_str().unwrap().to_string()
}

/// The page's state badge once it reads `state`.
fn wait_page_state(b: &Browser, state: &str, timeout: Duration) {
    let js = format!("document.querySelector('#job-state')?.innerText === {state:?}");
    b.wait_for(&format!("the job's page to say {state}"), &js, timeout);
}

fn no_page_errors(b: &Browser) {
    let errors = b.errors();
    assert!(
        errors.is_empty(),
        "the page had errors:\n{}",
        errors.join("\n")
    );
}

#[test]
fn console_overview_submit_logs_cancel_in_chromium() {
    let Some(b) = Browser::start_or_skip("console_overview_submit_logs_cancel_in_chromium", &[])
    else {
        return;
    };
    let http = format!("127.0.0.1:{}", free_port());
    let mut c = Cluster::start(&["--http-listen", &http]);
    let machine = fake_machine(c.dir.path());
    let agent = c.add_agent(AgentOpts {
        simulate_gpus: None,
        extra: vec![
            "--nvml-lib".into(),
            gpuctl_tests::fake_nvml_lib().display().to_string(),
            "--health-interval-secs".into(),
            "0.5".into(),
        ],
        env: vec![("FAKE_NVML_CONFIG".into(), machine.display().to_string())],
        ..Default::default()
    });
    let base = format!("http://{http}/");

    // The cluster at a glance: the agent, each GPU with its live reading.
    b.goto(&base);
    b.wait_for(
        "the agent and both GPUs with readings",
        &format!(
            "document.querySelector('#agents tr[data-agent=\"{agent}\"]') && \
             document.querySelectorAll('#gpus tr[data-gpu]').length === 2 && \
             document.querySelector('#gpus tr[data-gpu=\"{GPU1}\"] .util')?.innerText === '87%'"
        ),
        T,
    );
    let gpu1 = b.text(&format!("#gpus tr[data-gpu=\"{GPU1}\"]"));
    for want in [
        "A100-SXM4-40GB",
        "87%",
        "12 / 40 GiB",
        "67 °C",
        "251 W",
        "healthy",
        "free",
    ] {
        assert!(gpu1.contains(want), "GPU 1's row lacks {want:?}: {gpu1}");
    }
    assert!(b.text("#agents").contains("ACTIVE"));
    assert!(b.text("#masters").contains("leader"));

    // A job submitted through the form: it prints a line a second.
    let script = "for i in 1 2 3 4 5 6 7 8; do echo \"line $i\"; sleep 1; done";
    b.goto(&format!("{base}#/submit"));
    b.wait_for("the submit form", "!!document.querySelector('#f-name')", T);
    for (sel, v) in [
        ("#f-name", "console-hello"),
        ("#f-command", script),
        ("#f-gpus", "1"),
        ("#f-cpus", "0.5"),
        ("#f-ports", "1"),
        ("#f-env", "GREETING=hello"),
    ] {
        b.type_into(sel, v);
    }
    shot(&b, "console-submit");
    b.click("#f-submit");
    let id = b
        .wait_for(
            "the new job's page",
            "location.hash.startsWith('#/jobs/job-') && decodeURIComponent(location.hash.slice(7))",
            T,
        )
        .as_str()
        .unwrap()
        .to_string();
    let spec = job_json(&c, &id);
    assert_eq!(spec["name"], "console-hello", "{spec}");
    assert_eq!(spec["command"], json!(["sh", "-c", script]), "{spec}");
    assert_eq!(spec["env"]["GREETING"], "hello", "{spec}");
    assert_eq!(spec["resources"]["gpus"], 1, "{spec}");
    assert_eq!(spec["resources"]["ports"], 1, "{spec}");

    // Its output streams: the first line shows while the job still runs.
    b.wait_for(
        "the first line of output",
        "document.querySelector('#logs')?.innerText.includes('line 1')",
        JOB_T,
    );
    let logs = b.text("#logs");
    let state = job_json(&c, &id)["state"].as_str().unwrap().to_string();
    assert_eq!(state, "RUNNING", "output came before the job ended");
    assert!(!logs.contains("line 8"), "not all at once: {logs}");
    assert_eq!(b.text("#log-status"), "streaming…");

    // While it runs, the overview shows its task on GPU 0 and a link to it.
    b.goto(&base);
    b.wait_for(
        "the job's task on GPU 0",
        &format!(
            "document.querySelector('#gpus tr[data-gpu=\"{GPU0}\"] .task a')?.innerText === '{id}.0'"
        ),
        T,
    );
    b.wait_for(
        "the summary",
        "document.querySelector('#summary')?.innerText.includes('1 / 2 busy')",
        T,
    );
    shot(&b, "console-overview");
    b.click(&format!("#gpus tr[data-gpu=\"{GPU0}\"] .task a"));

    // Its page: tasks, events, the whole output, the end.
    wait_page_state(&b, "SUCCEEDED", JOB_T);
    b.wait_for(
        "the whole output",
        "document.querySelector('#logs')?.innerText.includes('line 8') && \
         document.querySelector('#log-status')?.innerText === 'end of output'",
        T,
    );
    let tasks = b.text("#tasks");
    assert!(
        tasks.contains(&format!("{id}.0")) && tasks.contains("FINISHED"),
        "{tasks}"
    );
    b.wait_for(
        "the Succeeded event",
        "document.querySelector('#events')?.innerText.includes('Succeeded')",
        T,
    );
    let events = b.text("#events");
    for kind in ["Queued", "Scheduled", "Started", "Succeeded"] {
        assert!(events.contains(kind), "no {kind} event: {events}");
    }
    assert!(
        b.text("#logs").starts_with("line 1\nline 2\n"),
        "no prefix for one task"
    );
    assert!(b
        .eval("document.querySelector('#cancel').hidden")
        .as_bool()
        .unwrap());
    shot(&b, "console-job");

    // A gang: each line of output with its rank, as `gpuctl jobs logs`.
    let gang = submit_through_form(
        &b,
        &base,
        &[
            ("#f-name", "console-gang"),
            ("#f-command", "echo \"hello from $GPUCTL_RANK\""),
            ("#f-gpus", "1"),
            ("#f-cpus", "0.5"),
            ("#f-replicas", "2"),
        ],
    );
    wait_page_state(&b, "SUCCEEDED", JOB_T);
    b.wait_for(
        "both ranks' lines",
        "['[rank 0] hello from 0', '[rank 1] hello from 1'].every(l => \
         document.querySelector('#logs')?.innerText.includes(l))",
        T,
    );
    assert_eq!(job_json(&c, &gang)["replicas"], 2);

    // Cancel, from the job's page.
    let long = submit_through_form(
        &b,
        &base,
        &[
            ("#f-name", "console-long"),
            ("#f-command", "while true; do echo tick; sleep 1; done"),
            ("#f-cpus", "0.5"),
        ],
    );
    b.wait_for(
        "the long job's output",
        "document.querySelector('#logs')?.innerText.includes('tick')",
        JOB_T,
    );
    b.wait_for(
        "the cancel button",
        "document.querySelector('#cancel') && !document.querySelector('#cancel').hidden",
        T,
    );
    b.click("#cancel");
    wait_page_state(&b, "CANCELLED", JOB_T);
    assert_eq!(job_json(&c, &long)["state"], "CANCELLED");

    // The master's own check of the form, naming the field.
    b.goto(&format!("{base}#/submit"));
    b.wait_for("the submit form", "!!document.querySelector('#f-name')", T);
    b.type_into("#f-name", "bad name");
    b.type_into("#f-command", "true");
    b.click("#f-submit");
    let err = b.wait_for(
        "the form's error",
        "!document.querySelector('#form-error').hidden && document.querySelector('#form-error').innerText",
        T,
    );
    let err = err.as_str().unwrap();
    assert!(err.contains("spec.name") && err.contains("' '"), "{err}");
    assert!(b
        .eval("location.hash")
        .as_str()
        .unwrap()
        .ends_with("#/submit"));

    // A job no agent can hold waits, and the jobs page says why.
    let big = c.submit(&["--name", "too-big", "--gpus", "4", "--", "true"]);

    // The jobs page lists them with their states.
    b.goto(&format!("{base}#/jobs"));
    b.wait_for(
        "why the big job waits",
        &format!(
            "document.querySelector('#jobs tr[data-job=\"{big}\"] .why')?.innerText \
             .includes('no agent has 4 GPUs')"
        ),
        T,
    );
    for (job, state) in [
        (&id, "SUCCEEDED"),
        (&gang, "SUCCEEDED"),
        (&long, "CANCELLED"),
    ] {
        b.wait_for(
            &format!("{job} {state} in the list"),
            &format!("document.querySelector('#jobs tr[data-job=\"{job}\"] .state')?.innerText === '{state}'"),
            T,
        );
    }
    shot(&b, "console-jobs");
    no_page_errors(&b);
}

/// The services page: a service made with gpuctl is listed, its page
/// shows each replica's job running, the form scales it and the button
/// deletes it.
#[test]
fn console_services_list_scale_delete_in_chromium() {
    let Some(b) = Browser::start_or_skip("console_services_list_scale_delete_in_chromium", &[])
    else {
        return;
    };
    let http = format!("127.0.0.1:{}", free_port());
    let mut c = Cluster::start(&["--http-listen", &http]);
    c.add_agent(AgentOpts::default());
    let base = format!("http://{http}/");
    c.ok(&[
        "services",
        "create",
        "web",
        "--replicas",
        "2",
        "--gpus",
        "1",
        "--cpus",
        "0.5",
        "--",
        "sleep",
        "600",
    ]);

    b.goto(&format!("{base}#/services"));
    b.wait_for(
        "web with its 2 replicas running",
        "document.querySelector('#services tr[data-service=\"web\"] .replicas')?.innerText === '2/2'",
        JOB_T,
    );
    let row = b.text("#services tr[data-service=\"web\"]");
    assert!(row.contains("host process"), "{row}");
    b.click("#services tr[data-service=\"web\"] a");
    b.wait_for(
        "the service's page with both replicas' jobs",
        "document.querySelectorAll('#replicas tr[data-job]').length === 2 && \
         [...document.querySelectorAll('#replicas .state')].every(td => td.innerText === 'RUNNING')",
        T,
    );
    let replicas = b.text("#replicas");
    assert!(replicas.contains("job-"), "{replicas}");
    assert!(
        b.text("#events").contains("Created"),
        "{}",
        b.text("#events")
    );
    b.screenshot("console-service");

    b.type_into("#scale-replicas", "1");
    b.click("#scale-submit");
    b.wait_for(
        "one replica left",
        "document.querySelector('#service-replicas')?.innerText === '1/1 ready' && \
         document.querySelectorAll('#replicas tr[data-job]').length === 1",
        T,
    );
    let svc: Value = serde_json::from_str(&c.ok(&["services", "get", "web", "--json"])).unwrap();
    assert_eq!(svc["replicas"], 1, "{svc}");
    // A replica's job links back to its service and has no cancel.
    b.click("#replicas tr[data-replica=\"0\"] a");
    b.wait_for(
        "the replica's job page",
        "!!document.querySelector('#job-service')",
        T,
    );
    assert!(b
        .eval("document.querySelector('#cancel').hidden")
        .as_bool()
        .unwrap());
    b.click("#job-service");

    b.wait_for(
        "the service's page again",
        "document.querySelectorAll('#replicas tr[data-job]').length === 1",
        T,
    );
    b.click("#delete-service");
    b.wait_for(
        "the list without it",
        "location.hash === '#/services' && \
         document.querySelector('#services')?.innerText.includes('No services.')",
        T,
    );
    no_page_errors(&b);
}

/// HTTPS straight to the console, trusting only the cluster CA and asking
/// for the name every master certificate carries: proves it serves the
/// master's own certificate. Returns the answer's status line and body.
fn https_get(pki: &Path, addr: &str, path: &str, token: &str) -> (String, String) {
    let ca = std::fs::read(pki.join("ca.crt")).unwrap();
    let tls =
        gpuctl_auth::tls::Tls::from_pem(&ca, None, gpuctl_auth::tls::ClientAuth::Optional).unwrap();
    let mut config = (*tls.client_config()).clone();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let name = rustls::pki_types::ServerName::try_from("master.gpuctl").unwrap();
    let mut conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
    let mut tcp = std::net::TcpStream::connect(addr).unwrap();
    let mut stream = rustls::Stream::new(&mut conn, &mut tcp);
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    // The server may close without a TLS close_notify: keep what came.
    let _ = stream.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    (
        head.lines().next().unwrap_or_default().to_string(),
        body.to_string(),
    )
}

#[test]
fn console_over_tls_asks_for_a_token_and_refuses_a_wrong_one() {
    // The browser does not trust the test's throwaway CA; https_get below
    // checks the certificate against it instead.
    let Some(b) = Browser::start_or_skip(
        "console_over_tls_asks_for_a_token_and_refuses_a_wrong_one",
        &["--ignore-certificate-errors"],
    ) else {
        return;
    };
    let http = format!("127.0.0.1:{}", free_port());
    let c = SecureSingle::start(&["--http-listen", &http], "2xA100-SXM4-40GB");
    let admin = std::fs::read_to_string(c.pki.join("bootstrap.token"))
        .unwrap()
        .trim()
        .to_string();

    let (status, body) = https_get(&c.pki, &http, "/api/whoami", &admin);
    assert!(status.contains("200"), "{status}: {body}");
    assert!(body.contains("\"role\":\"admin\""), "{body}");
    let (status, body) = https_get(&c.pki, &http, "/api/agents", "gct_nonsense");
    assert!(status.contains("401"), "{status}: {body}");

    let base = format!("https://{http}/");
    b.goto(&base);
    // Over TLS the browser speaks HTTP/2: its log streams share one
    // connection instead of using up HTTP/1.1's six per host.
    let protocol = b.wait_for(
        "the page's protocol",
        "performance.getEntriesByType('navigation')[0]?.nextHopProtocol",
        T,
    );
    assert_eq!(protocol, "h2");
    // No token yet: the login box, with the master's words.
    let err = b.wait_for(
        "the login box",
        "!document.querySelector('#login').hidden && document.querySelector('#login-error').innerText",
        T,
    );
    assert!(err.as_str().unwrap().contains("no token"), "{err}");

    // A well-formed token the cluster does not know.
    let wrong = format!("gct_0123456789abcdef_{}", "A".repeat(43));
    b.type_into("#token-input", &wrong);
    b.click("#login-submit");
    b.wait_for(
        "the refusal",
        "document.querySelector('#login-error').innerText.includes('unknown token')",
        T,
    );
    assert!(!b
        .eval("document.querySelector('#login').hidden")
        .as_bool()
        .unwrap());
    shot(&b, "console-login");

    // The admin's token: in.
    b.type_into("#token-input", &admin);
    b.click("#login-submit");
    b.wait_for(
        "signed in as admin",
        "document.querySelector('#who').innerText.startsWith('admin') && \
         document.querySelector('#login').hidden",
        T,
    );
    b.wait_for(
        "the agent and its GPUs",
        "document.querySelectorAll('#agents tr[data-agent]').length === 1 && \
         document.querySelectorAll('#gpus tr[data-gpu]').length === 2",
        T,
    );
    let job = submit_through_form(
        &b,
        &base,
        &[
            ("#f-name", "secure-hello"),
            ("#f-command", "echo hello over TLS"),
            ("#f-cpus", "0.5"),
        ],
    );
    wait_page_state(&b, "SUCCEEDED", JOB_T);
    b.wait_for(
        "the output",
        "document.querySelector('#logs')?.innerText.includes('hello over TLS')",
        T,
    );

    // Another tenant's user sees the master's refusal, not the job.
    let user = c.ok(&["tokens", "create", "--role", "user", "--tenant", "team-b"]);
    b.click("#login-open");
    b.type_into("#token-input", &user);
    b.click("#login-submit");
    b.wait_for(
        "signed in as team-b",
        "document.querySelector('#who').innerText.includes('team-b')",
        T,
    );
    let banner = b.wait_for(
        "the refusal of another tenant's job",
        "!document.querySelector('#banner').hidden && document.querySelector('#banner').innerText",
        T,
    );
    let banner = banner.as_str().unwrap();
    assert!(
        banner.contains(&job) && banner.contains("another tenant"),
        "{banner}"
    );
    no_page_errors(&b);
}

#[test]
fn console_on_a_follower_follows_the_leader_across_its_death() {
    let Some(b) = Browser::start_or_skip(
        "console_on_a_follower_follows_the_leader_across_its_death",
        &[],
    ) else {
        return;
    };
    let ports: Vec<String> = (0..3)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let mut c = HaCluster::start_each(3, |id| {
        vec!["--http-listen".into(), ports[(id - 1) as usize].clone()]
    });
    c.add_agent(AgentOpts {
        simulate_gpus: Some("2xA100-SXM4-40GB"),
        ..Default::default()
    });
    let leader = c.leader_id();
    let follower = (1..=3).find(|id| *id != leader).unwrap();
    let base = format!("http://{}/", ports[(follower - 1) as usize]);

    b.goto(&base);
    b.wait_for(
        "three masters and the agent, through a follower",
        "document.querySelectorAll('#masters tbody tr').length === 3 && \
         document.querySelectorAll('#agents tr[data-agent]').length === 1",
        T,
    );
    let job = submit_through_form(
        &b,
        &base,
        &[
            ("#f-name", "before"),
            ("#f-command", "echo before the failover"),
            ("#f-cpus", "0.5"),
        ],
    );
    wait_page_state(&b, "SUCCEEDED", JOB_T);
    b.wait_for(
        "its output",
        "document.querySelector('#logs')?.innerText.includes('before the failover')",
        T,
    );

    // A job's output followed through the follower while the leader dies:
    // it goes on, each line once (the stream is opened again at the new
    // leader and what was shown is skipped).
    submit_through_form(
        &b,
        &base,
        &[
            ("#f-name", "ticker"),
            (
                "#f-command",
                "for i in $(seq 1 40); do echo \"tick $i\"; sleep 0.5; done",
            ),
            ("#f-cpus", "0.5"),
        ],
    );
    b.wait_for(
        "the ticker's first lines",
        "document.querySelector('#logs')?.innerText.includes('tick 3\\n')",
        JOB_T,
    );
    c.kill_master(leader);
    let new_leader = c.wait_new_leader(leader);
    assert_ne!(new_leader, leader);
    b.wait_for(
        "the ticker's output after the failover",
        "document.querySelector('#logs')?.innerText.includes('tick 30\\n')",
        JOB_T,
    );
    let logs = b.text("#logs");
    for i in 1..=30 {
        let n = logs.lines().filter(|l| *l == format!("tick {i}")).count();
        assert_eq!(n, 1, "tick {i} shown {n} times:\n{logs}");
    }
    // A fresh load of the same console: every call finds the new leader.
    b.goto(&base);
    b.wait_for(
        "the overview after the failover",
        "document.body.dataset.loaded === '1' && document.querySelector('#banner').hidden && \
         document.querySelector('#masters')?.innerText.includes('unreachable') && \
         document.querySelectorAll('#agents tr[data-agent]').length === 1",
        T,
    );
    let after = submit_through_form(
        &b,
        &base,
        &[
            ("#f-name", "after"),
            ("#f-command", "echo after the failover"),
            ("#f-cpus", "0.5"),
        ],
    );
    wait_page_state(&b, "SUCCEEDED", JOB_T);
    b.wait_for(
        "its output",
        "document.querySelector('#logs')?.innerText.includes('after the failover')",
        T,
    );
    b.goto(&format!("{base}#/jobs"));
    for j in [&job, &after] {
        b.wait_for(
            &format!("{j} in the list"),
            &format!("document.querySelector('#jobs tr[data-job=\"{j}\"] .state')?.innerText === 'SUCCEEDED'"),
            T,
        );
    }
    no_page_errors(&b);
}

/// Rewrites fake-nvml's machine with GPU 1 at `util1`% (whole, then
/// renamed: fake-nvml never reads half of it).
fn set_gpu1_util(path: &Path, util1: u32) {
    let mut m: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    m["gpus"][1]["utilization_gpu_pct"] = json!(util1);
    gpuctl_tests::write_fake_machine(path, &m);
}

/// Issue 39, item 4: the console draws utilization curves (SVG made by
/// the page) that follow the GPUs: per GPU on the cluster page, the
/// cluster's GPUs held against busy, a curve per GPU of a job on its page,
/// and the usage page's table. The test changes fake-nvml's GPU 1 from 87%
/// to 20% and sees the curves' last points follow.
#[test]
fn console_draws_utilization_curves_that_follow_the_gpus() {
    let Some(b) =
        Browser::start_or_skip("console_draws_utilization_curves_that_follow_the_gpus", &[])
    else {
        return;
    };
    let http = format!("127.0.0.1:{}", free_port());
    let mut c = Cluster::start(&["--http-listen", &http, "--utilization-period", "1s"]);
    let machine = fake_machine(c.dir.path());
    c.add_agent(AgentOpts::fake_nvml(&machine, "0.2"));
    let base = format!("http://{http}/");
    // A job holding both GPUs, so that its page has a curve per GPU.
    let job = c.submit(&["--name", "curves", "--gpus", "2", "--", "sleep", "300"]);
    c.wait_state(&job, "RUNNING", JOB_T);

    b.goto(&base);
    let gpu1_last = format!(
        "document.querySelector('#gpu-charts [data-gpu=\"{GPU1}\"] svg.chart')?.dataset.lastUtil"
    );
    b.wait_for("GPU 1's curve at 87%", &format!("{gpu1_last} === '87'"), T);
    let lines = b.eval(&format!(
        "document.querySelectorAll('#gpu-charts [data-gpu=\"{GPU1}\"] polyline').length"
    ));
    assert!(lines.as_u64().unwrap() >= 1, "{lines}");
    // The cluster: 2 GPUs held, 0.87 busy.
    b.wait_for(
        "the cluster chart",
        "document.querySelector('#cluster-chart svg.chart')?.dataset.lastAllocated === '2' && \
         document.querySelector('#cluster-chart svg.chart')?.dataset.lastUsed === '0.87'",
        T,
    );
    shot(&b, "console-utilization");
    set_gpu1_util(&machine, 20);
    b.wait_for(
        "GPU 1's curve following it down to 20%",
        &format!("{gpu1_last} === '20'"),
        T,
    );
    // The day's window draws the same GPU.
    b.eval("(() => { const s = document.querySelector('#util-window'); s.value = '1d'; s.dispatchEvent(new Event('change')); })()");
    b.wait_for("the day's curve", &format!("{gpu1_last} === '20'"), T);
    // The week's window: hourly means, this hour's between its 87% and 20%.
    b.eval("(() => { const s = document.querySelector('#util-window'); s.value = '7d'; s.dispatchEvent(new Event('change')); })()");
    b.wait_for(
        "the week's hourly curve",
        &format!(
            "document.querySelector('#gpu-charts [data-gpu=\"{GPU1}\"] svg.chart')?.dataset.periodMs === '3600000' && \
             (v => v >= 20 && v <= 87)(Number({gpu1_last} ?? 'x'))"
        ),
        T,
    );

    // The job's page: a curve per GPU it holds.
    b.goto(&format!("{base}#/jobs/{job}"));
    let job_last = format!(
        "document.querySelector('#job-charts [data-gpu=\"{GPU1}\"] svg.chart')?.dataset.lastUtil"
    );
    b.wait_for("the job's GPU 1 curve", &format!("{job_last} === '20'"), T);
    let charts = b.eval("document.querySelectorAll('#job-charts svg.chart').length");
    assert_eq!(charts.as_u64(), Some(2), "{charts}");
    set_gpu1_util(&machine, 55);
    b.wait_for(
        "the job's curve following it",
        &format!("{job_last} === '55'"),
        T,
    );
    shot(&b, "console-job-utilization");

    // The usage page: the default tenant with its GPU-hours (running
    // tasks count up to now) and their utilization.
    b.goto(&format!("{base}#/usage"));
    b.wait_for(
        "the usage table",
        "document.querySelector('#usage tr[data-key=\"default\"] .gpu-hours') !== null",
        T,
    );
    let row = b.text("#usage tr[data-key=\"default\"]");
    assert!(row.contains('%'), "{row}");
    // Its startup (held before it ran) beside its GPU-hours, a number.
    let startup = b.text("#usage tr[data-key=\"default\"] .gpu-startup");
    assert!(startup.trim().parse::<f64>().is_ok(), "{startup:?}");
    no_page_errors(&b);
    c.ok(&["jobs", "cancel", &job]);
}
