//! Security with real processes: a cluster of three masters and two agents
//! with mutual TLS and tokens (made by `gpuctl certs init`, agents joining
//! with join tokens) runs jobs end to end and across a leader SIGKILL, and
//! refuses what an outsider on the network tried (issue 18): forged status
//! updates, heartbeats and registrations under another agent's id, a
//! framework torn down by another tenant, RemoveMaster without admin,
//! other tenants' jobs, logs and env, Raft from a client, expired, revoked
//! and reused tokens, a certificate from another CA, plain connections.
//! Each refusal is made with a raw gRPC client, as the outsider did.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use gpuctl_auth::pki::Ca;
use gpuctl_auth::tls::{ClientAuth, Tls, TlsPaths};
use gpuctl_auth::CertRole;
use gpuctl_proto::pb;
use gpuctl_tests::{bin, free_port, tail, wait_for, Daemon, SecureSingle};
use serde_json::Value;
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

struct Secure {
    dir: tempfile::TempDir,
    pki: PathBuf,
    masters: Vec<(u64, String, Option<Daemon>)>,
    agents: Vec<Daemon>,
    agent_dirs: Vec<PathBuf>,
}

impl Secure {
    fn addrs(&self) -> String {
        self.masters
            .iter()
            .filter(|m| m.2.is_some())
            .map(|m| m.1.clone())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// gpuctl as the admin of `gpuctl certs init` (its gpuctl.toml), or with
    /// another token.
    fn gpuctl_with(&self, token: Option<&str>, args: &[&str]) -> Output {
        let mut cmd = Command::new(bin("gpuctl"));
        cmd.arg("--config")
            .arg(self.pki.join("gpuctl.toml"))
            .arg("--master")
            .arg(self.addrs())
            .args(args)
            .env_remove("GPUCTL_TOKEN")
            .env_remove("GPUCTL_MASTER")
            .stdin(Stdio::null());
        if let Some(t) = token {
            cmd.env("GPUCTL_TOKEN", t);
        }
        cmd.output().unwrap()
    }

    fn ok_with(&self, token: Option<&str>, args: &[&str]) -> String {
        let out = self.gpuctl_with(token, args);
        assert!(
            out.status.success(),
            "gpuctl {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.diagnostics()
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn admin(&self, args: &[&str]) -> String {
        self.ok_with(None, args)
    }

    fn diagnostics(&self) -> String {
        let mut s = String::new();
        for (id, _, d) in &self.masters {
            if let Some(d) = d {
                s.push_str(&format!(
                    "--- master {id} ---\n{}\n",
                    tail(&d.log_text(), 25)
                ));
            }
        }
        for (i, a) in self.agents.iter().enumerate() {
            s.push_str(&format!("--- agent {i} ---\n{}\n", tail(&a.log_text(), 25)));
        }
        s
    }

    fn job(&self, token: &str, id: &str) -> Value {
        serde_json::from_str(&self.ok_with(Some(token), &["jobs", "get", id, "--json"])).unwrap()
    }

    fn token(&self, args: &[&str]) -> String {
        let mut all = vec!["tokens", "create"];
        all.extend_from_slice(args);
        self.admin(&all).trim().to_string()
    }

    /// A TLS identity of files in this cluster's dirs.
    fn tls(&self, ca: &Path, cert: &Path, key: &Path) -> Arc<Tls> {
        Arc::new(
            Tls::from_files(
                &TlsPaths {
                    ca: ca.into(),
                    cert: cert.into(),
                    key: key.into(),
                },
                ClientAuth::Required,
            )
            .unwrap(),
        )
    }

    fn client_tls(&self) -> Arc<Tls> {
        self.tls(
            &self.pki.join("ca.crt"),
            &self.pki.join("client.crt"),
            &self.pki.join("client.key"),
        )
    }

    fn agent_tls(&self, n: usize) -> Arc<Tls> {
        let d = &self.agent_dirs[n];
        self.tls(
            &d.join("ca.crt"),
            &d.join("agent.pem"),
            &d.join("agent.pem"),
        )
    }

    /// Starts three masters with TLS and two agents that join with tokens.
    fn start() -> Secure {
        let dir = gpuctl_tests::test_dir();
        let (pki, masters) =
            gpuctl_tests::start_secure_masters(dir.path(), 3, &["--agent-timeout-secs", "15"]);
        // The secrets are the owner's alone.
        for f in [
            "ca.key",
            "bootstrap.token",
            "client.key",
            "gpuctl.toml",
            "master-1.key",
        ] {
            let mode = std::fs::metadata(pki.join(f)).unwrap().permissions();
            assert_eq!(
                std::os::unix::fs::PermissionsExt::mode(&mode) & 0o077,
                0,
                "{f}"
            );
        }
        let masters = masters
            .into_iter()
            .map(|(id, addr, d)| (id, addr, Some(d)))
            .collect();
        let mut c = Secure {
            dir,
            pki,
            masters,
            agents: vec![],
            agent_dirs: vec![],
        };
        // Serving, and the bootstrap admin token is in the state.
        wait_for(Duration::from_secs(40), "the admin token works", || {
            c.gpuctl_with(None, &["whoami"]).status.success()
        });
        for n in 0..2 {
            c.add_agent(n, &[]);
        }
        c
    }

    fn add_agent(&mut self, n: usize, extra: &[&str]) {
        let token = self.token(&["--join", "--description", &format!("agent {n}")]);
        let tls_dir = self.dir.path().join(format!("agent{n}-tls"));
        std::fs::create_dir_all(&tls_dir).unwrap();
        std::fs::copy(self.pki.join("ca.crt"), tls_dir.join("ca.crt")).unwrap();
        let mut args: Vec<String> = [
            "--master",
            &self.addrs(),
            "--work-dir",
            &self
                .dir
                .path()
                .join(format!("agent{n}"))
                .display()
                .to_string(),
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
            "--runtime",
            "process",
            "--simulate-gpus",
            "2xA100-SXM4-40GB",
            "--kill-grace-secs",
            "2",
            "--stop-tasks-on-shutdown",
            "--tls-dir",
            &tls_dir.display().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        let d = Daemon::spawn(
            &format!("agent{n}"),
            &bin("gpuctl-agent"),
            &args,
            &[("GPUCTL_AGENT_JOIN_TOKEN".into(), token)],
            self.dir.path().join(format!("agent{n}.log")),
        );
        self.agents.push(d);
        self.agent_dirs.push(tls_dir);
        let want = self.agents.len();
        wait_for(Duration::from_secs(30), "agents registered", || {
            let out = self.gpuctl_with(None, &["agents", "list", "--json"]);
            out.status.success()
                && serde_json::from_slice::<Value>(&out.stdout)
                    .ok()
                    .and_then(|v| v.as_array().map(|a| a.len()))
                    == Some(want)
        });
    }

    fn leader_addr(&self) -> String {
        let v: Value = serde_json::from_str(&self.admin(&["masters", "--json"])).unwrap();
        v.as_array()
            .unwrap()
            .iter()
            .find(|m| m["role"] == "leader")
            .and_then(|m| m["address"].as_str())
            .unwrap()
            .to_string()
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn channel(addr: &str, tls: Option<&Arc<Tls>>, role: CertRole) -> Channel {
    let e = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(3))
        .timeout(Duration::from_secs(10));
    gpuctl_auth::tls::channel(&e, tls, role)
}

fn with_token<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

fn code<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> Code {
    match r {
        Ok(v) => panic!("expected a refusal, got {v:?}"),
        Err(s) => {
            eprintln!("refused as expected: {:?} {}", s.code(), s.message());
            s.code()
        }
    }
}

#[test]
fn a_secure_cluster_runs_jobs_and_refuses_what_an_outsider_tried() {
    let mut c = Secure::start();
    let vision = c.token(&["--role", "user", "--tenant", "vision"]);
    let nlp = c.token(&["--role", "user", "--tenant", "nlp"]);

    // A job of tenant vision runs end to end; its secret stays hidden.
    let job = c
        .ok_with(
            Some(&vision),
            &[
                "jobs",
                "submit",
                "--name",
                "secret",
                "--gpus",
                "1",
                "--secret-env",
                "API_KEY=hunter2",
                "--",
                "sh",
                "-c",
                "echo ran-as-$(id -u); sleep 30",
            ],
        )
        .trim()
        .to_string();
    wait_for(Duration::from_secs(30), "job RUNNING", || {
        c.job(&vision, &job)["state"] == "RUNNING"
    });
    let got = c.job(&vision, &job);
    assert_eq!(got["tenant"], "vision", "{got}");
    let shown = c.ok_with(Some(&vision), &["jobs", "get", &job, "--json"]);
    assert!(!shown.contains("hunter2"), "secret shown: {shown}");
    assert!(shown.contains("<secret>"), "{shown}");
    let logs = c.ok_with(Some(&vision), &["jobs", "logs", &job]);
    assert!(logs.contains("ran-as-"), "{logs}");

    // Root on a host needs a token that allows it (and an agent that
    // does); privileged containers are refused to everyone.
    let out = c.gpuctl_with(
        Some(&vision),
        &[
            "jobs",
            "submit",
            "--name",
            "root",
            "--run-as-root",
            "--",
            "id",
            "-u",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("does not allow root"),
        "{err}"
    );

    // Another tenant sees nothing of it and cannot touch it.
    for args in [
        vec!["jobs", "get", &job],
        vec!["jobs", "logs", &job],
        vec!["jobs", "cancel", &job],
    ] {
        let out = c.gpuctl_with(Some(&nlp), &args);
        assert!(!out.status.success(), "nlp ran {args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("another tenant"), "{args:?}: {err}");
    }
    let listed = c.ok_with(Some(&nlp), &["jobs", "list", "--json"]);
    assert!(!listed.contains(&job), "nlp lists vision's job: {listed}");
    assert!(c.ok_with(Some(&vision), &["jobs", "list"]).contains(&job));

    let leader = c.leader_addr();
    let client_tls = c.client_tls();
    let rt = rt();
    let task: Value = c.job(&vision, &job)["tasks"][0].clone();
    let task_id = task["id"].as_str().unwrap().to_string();
    let owner = task["agent_id"].as_str().unwrap().to_string();
    let agents: Value = serde_json::from_str(&c.admin(&["agents", "list", "--json"])).unwrap();
    let ids: Vec<String> = agents
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["id"].as_str().unwrap().to_string())
        .collect();
    // The agent that does not run the task, and its certificate.
    let other_n = c
        .agent_dirs
        .iter()
        .position(|d| {
            let t = Tls::from_files(
                &TlsPaths {
                    ca: d.join("ca.crt"),
                    cert: d.join("agent.pem"),
                    key: d.join("agent.pem"),
                },
                ClientAuth::Required,
            )
            .unwrap();
            t.identity().unwrap().name != owner
        })
        .unwrap();
    let other_tls = c.agent_tls(other_n);
    let other_id = other_tls.identity().unwrap().name;
    assert!(ids.contains(&other_id) && other_id != owner);

    rt.block_on(async {
        let agent_chan = channel(&leader, Some(&other_tls), CertRole::Master);
        let mut am = pb::agent_manager_client::AgentManagerClient::new(agent_chan.clone());
        // A forged status update for another agent's task.
        let forged = pb::StatusUpdate {
            agent_id: owner.clone(),
            task_id: task_id.clone(),
            state: pb::TaskState::TaskFinished as i32,
            exit_code: Some(0),
            ..Default::default()
        };
        assert_eq!(
            code(am.update_status(forged.clone()).await),
            Code::PermissionDenied
        );
        // Under its own id, about a task that is not its own.
        let mut own = forged.clone();
        own.agent_id = other_id.clone();
        assert_ne!(code(am.update_status(own).await), Code::Ok);
        assert_eq!(
            code(
                am.update_statuses(pb::StatusUpdates {
                    updates: vec![forged]
                })
                .await
            ),
            Code::PermissionDenied
        );
        // Registering and heartbeating as another agent.
        let reg = pb::RegisterRequest {
            agent_id: owner.clone(),
            hostname: "evil".into(),
            address: "127.0.0.1:1".into(),
            ..Default::default()
        };
        assert_eq!(code(am.register(reg).await), Code::PermissionDenied);
        let hb = pb::HeartbeatRequest {
            mig_results: vec![],
            agent_id: owner.clone(),
            gpus: vec![pb::GpuReport {
                uuid: "GPU-x".into(),
                healthy: false,
                unhealthy_reason: "forged".into(),
                sample: None,
            }],
            runtimes: vec![],
        };
        assert_eq!(code(am.heartbeat(hb).await), Code::PermissionDenied);
        // An agent certificate cannot call the operator API.
        let mut op = pb::operator_client::OperatorClient::new(agent_chan);
        assert_eq!(
            code(op.list_jobs(pb::ListJobsRequest::default()).await),
            Code::PermissionDenied
        );

        // A client certificate: no token, a user's token, Raft.
        let chan = channel(&leader, Some(&client_tls), CertRole::Master);
        let mut op = pb::operator_client::OperatorClient::new(chan.clone());
        // Privileged mode, asked straight through the API: refused, named.
        let spec = pb::JobSpec {
            name: "priv".into(),
            image: "busybox".into(),
            command: vec!["true".into()],
            security: Some(pb::TaskSecurity {
                privileged: true,
                ..Default::default()
            }),
            ..Default::default()
        };
        let refused = op
            .submit_job(with_token(
                pb::SubmitJobRequest {
                    spec: Some(spec),
                    ..Default::default()
                },
                &vision,
            ))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument);
        assert!(
            refused.message().contains("privileged"),
            "{}",
            refused.message()
        );
        // Another tenant's name on a submission.
        let spec = pb::JobSpec {
            name: "theirs".into(),
            command: vec!["true".into()],
            tenant: "nlp".into(),
            ..Default::default()
        };
        assert_eq!(
            code(
                op.submit_job(with_token(
                    pb::SubmitJobRequest {
                        spec: Some(spec),
                        ..Default::default()
                    },
                    &vision
                ))
                .await
            ),
            Code::PermissionDenied
        );
        assert_eq!(
            code(op.list_jobs(pb::ListJobsRequest::default()).await),
            Code::Unauthenticated
        );
        assert_eq!(
            code(
                op.remove_master(with_token(pb::RemoveMasterRequest { id: 2 }, &vision))
                    .await
            ),
            Code::PermissionDenied
        );
        assert_eq!(
            code(op.remove_master(pb::RemoveMasterRequest { id: 2 }).await),
            Code::Unauthenticated
        );
        assert_eq!(
            code(
                op.drain_agent(with_token(
                    pb::DrainAgentRequest {
                        agent_id: owner.clone(),
                        ..Default::default()
                    },
                    &vision
                ))
                .await
            ),
            Code::PermissionDenied
        );
        let mut raft = pb::raft_transport_client::RaftTransportClient::new(chan.clone());
        assert_eq!(
            code(
                raft.step(pb::StepRequest {
                    from: 2,
                    from_address: String::new(),
                    messages: vec![],
                })
                .await
            ),
            Code::PermissionDenied
        );
        // A client cannot speak the agent protocol.
        let mut am = pb::agent_manager_client::AgentManagerClient::new(chan.clone());
        assert_eq!(
            code(
                am.heartbeat(pb::HeartbeatRequest {
                    mig_results: vec![],
                    agent_id: owner.clone(),
                    ..Default::default()
                })
                .await
            ),
            Code::PermissionDenied
        );

        // Reading output straight from the agent: masters only.
        let agent_addr = agents
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["id"] == owner.as_str())
            .and_then(|a| a["address"].as_str())
            .unwrap()
            .to_string();
        let mut api = pb::agent_api_client::AgentApiClient::new(channel(
            &agent_addr,
            Some(&client_tls),
            CertRole::Agent,
        ));
        assert_eq!(
            code(
                api.task_logs(pb::TaskLogsRequest {
                    task_id: task_id.clone(),
                    follow: false
                })
                .await
            ),
            Code::PermissionDenied
        );
        // Without TLS, or with a certificate of another CA: no connection.
        let mut plain =
            pb::operator_client::OperatorClient::new(channel(&leader, None, CertRole::Master));
        assert!(plain
            .list_jobs(pb::ListJobsRequest::default())
            .await
            .is_err());
        let evil = Ca::generate("evil", Duration::from_secs(3600)).unwrap();
        let issued = evil
            .issue(CertRole::Client, "admin", Duration::from_secs(3600), &[])
            .unwrap();
        let ca_pem = std::fs::read(c.pki.join("ca.crt")).unwrap();
        let stranger = Arc::new(
            Tls::from_pem(
                &ca_pem,
                Some((
                    issued.cert_pem.as_bytes(),
                    issued.key_pem.unwrap().as_bytes(),
                )),
                ClientAuth::Required,
            )
            .unwrap(),
        );
        let mut op = pb::operator_client::OperatorClient::new(channel(
            &leader,
            Some(&stranger),
            CertRole::Master,
        ));
        let r = op
            .list_jobs(with_token(pb::ListJobsRequest::default(), &vision))
            .await;
        assert!(r.is_err(), "a certificate of another CA was let in");
    });

    // The job ran on, untouched by all of that.
    assert_eq!(c.job(&vision, &job)["state"], "RUNNING");
    let gpus = c.admin(&["gpus", "--json"]);
    assert!(!gpus.contains("forged"), "{gpus}");

    // Frameworks: one tenant cannot tear down another's.
    let fw_vision = c.token(&["--role", "framework", "--tenant", "vision"]);
    let fw_nlp = c.token(&["--role", "framework", "--tenant", "nlp"]);
    rt.block_on(async {
        let chan = channel(&leader, Some(&client_tls), CertRole::Master);
        let mut s = pb::scheduler_client::SchedulerClient::new(chan.clone());
        let info = |role: &str| pb::FrameworkInfo {
            id: String::new(),
            name: "fw".into(),
            roles: vec![role.into()],
            capabilities: vec![],
            failover_timeout_secs: 60.0,
        };
        // Only the roles its token allows.
        assert_eq!(
            code(
                s.subscribe(with_token(
                    pb::SubscribeRequest {
                        demand: None,
                        request_id: String::new(),
                        framework: Some(info("nlp")),
                        suppressed: false
                    },
                    &fw_vision
                ))
                .await
            ),
            Code::PermissionDenied
        );
        // Users cannot act as frameworks.
        assert_eq!(
            code(
                s.subscribe(with_token(
                    pb::SubscribeRequest {
                        demand: None,
                        request_id: String::new(),
                        framework: Some(info("vision")),
                        suppressed: false
                    },
                    &vision
                ))
                .await
            ),
            Code::PermissionDenied
        );
        let mut events = s
            .subscribe(with_token(
                pb::SubscribeRequest {
                    demand: None,
                    request_id: String::new(),
                    framework: Some(info("vision")),
                    suppressed: true,
                },
                &fw_vision,
            ))
            .await
            .unwrap()
            .into_inner();
        let first = events.message().await.unwrap().unwrap();
        let Some(pb::event::Event::Subscribed(sub)) = first.event else {
            panic!("first event: {first:?}");
        };
        let fw_id = sub.framework_id;
        assert_eq!(
            code(
                s.teardown(with_token(
                    pb::TeardownRequest {
                        framework_id: fw_id.clone()
                    },
                    &fw_nlp
                ))
                .await
            ),
            Code::PermissionDenied
        );
        // The built-in scheduler is no one's to drive.
        assert_eq!(
            code(
                s.kill(with_token(
                    pb::KillRequest {
                        framework_id: "gpuctl-jobs".into(),
                        task_id: task_id.clone(),
                    },
                    &fw_vision
                ))
                .await
            ),
            Code::PermissionDenied
        );
        // Its own framework: allowed.
        s.teardown(with_token(
            pb::TeardownRequest {
                framework_id: fw_id,
            },
            &fw_vision,
        ))
        .await
        .unwrap();
    });

    // Tokens: expired, revoked, a join token used twice.
    let short = c.token(&["--role", "user", "--tenant", "vision", "--ttl", "1s"]);
    std::thread::sleep(Duration::from_millis(1500));
    let out = c.gpuctl_with(Some(&short), &["jobs", "list"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("expired"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doomed = c.token(&["--role", "user", "--tenant", "vision"]);
    assert!(c
        .gpuctl_with(Some(&doomed), &["jobs", "list"])
        .status
        .success());
    let doomed_id = &doomed[4..20];
    c.admin(&["tokens", "revoke", doomed_id]);
    let out = c.gpuctl_with(Some(&doomed), &["jobs", "list"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("revoked"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed = c.admin(&["tokens", "list", "--all"]);
    assert!(
        listed.contains(doomed_id) && listed.contains("revoked"),
        "{listed}"
    );
    assert!(
        !listed.contains(&doomed[21..]),
        "a secret in the list: {listed}"
    );
    // A user token cannot make tokens.
    let out = c.gpuctl_with(Some(&vision), &["tokens", "create", "--role", "admin"]);
    assert!(!out.status.success());
    // A join token joins once.
    let join = c.token(&["--join"]);
    rt.block_on(async {
        let ca_pem = std::fs::read(c.pki.join("ca.crt")).unwrap();
        let anon = Arc::new(Tls::from_pem(&ca_pem, None, ClientAuth::Required).unwrap());
        let mut id = pb::identity_client::IdentityClient::new(channel(
            &leader,
            Some(&anon),
            CertRole::Master,
        ));
        let (csr, _) = gpuctl_auth::pki::signing_request().unwrap();
        let req = |agent: &str| pb::JoinRequest {
            token: join.clone(),
            agent_id: agent.into(),
            csr_pem: csr.clone(),
        };
        // Not as an agent that exists.
        assert_eq!(code(id.join(req(&owner)).await), Code::Unauthenticated);
        let first = id.join(req("new-agent")).await.unwrap().into_inner();
        let who = gpuctl_auth::pki::identity_of(
            &gpuctl_auth::pki::certs_from_pem(first.cert_pem.as_bytes(), "t").unwrap()[0],
        )
        .unwrap();
        assert_eq!(
            (who.role, who.name.as_str()),
            (CertRole::Agent, "new-agent")
        );
        assert_eq!(code(id.join(req("another")).await), Code::Unauthenticated);
        // The same request sent again (its answer lost: the agent never got
        // its certificate) is answered again: the same agent, a certificate
        // for the same key. Another key is refused.
        for _ in 0..2 {
            let resent = id.join(req("new-agent")).await.unwrap().into_inner();
            let who = gpuctl_auth::pki::identity_of(
                &gpuctl_auth::pki::certs_from_pem(resent.cert_pem.as_bytes(), "t").unwrap()[0],
            )
            .unwrap();
            assert_eq!(
                (who.role, who.name.as_str()),
                (CertRole::Agent, "new-agent")
            );
        }
        let (other_key, _) = gpuctl_auth::pki::signing_request().unwrap();
        let stolen = pb::JoinRequest {
            token: join.clone(),
            agent_id: "new-agent".into(),
            csr_pem: other_key,
        };
        assert_eq!(code(id.join(stolen).await), Code::Unauthenticated);
    });

    // A tenant's GPU quota: vision holds 1 GPU; with a quota of 1 its next
    // GPU job waits, saying so, while nlp's runs; raised, it runs.
    c.admin(&["quota", "set", "vision", "--gpus", "1"]);
    let waits = c
        .ok_with(
            Some(&vision),
            &["jobs", "submit", "--name", "q", "--gpus", "1", "--", "true"],
        )
        .trim()
        .to_string();
    let other = c
        .ok_with(
            Some(&nlp),
            &["jobs", "submit", "--name", "q", "--gpus", "1", "--", "true"],
        )
        .trim()
        .to_string();
    assert_eq!(
        c.ok_with(Some(&nlp), &["jobs", "wait", &other, "--timeout", "60"])
            .trim(),
        "SUCCEEDED"
    );
    wait_for(Duration::from_secs(20), "a quota wait reason", || {
        c.job(&vision, &waits)["wait_reason"]["kind"] == "tenant_quota"
    });
    assert_eq!(c.job(&vision, &waits)["state"], "QUEUED");
    let quotas = c.ok_with(Some(&vision), &["quota"]);
    assert!(
        quotas.contains("vision") && !quotas.contains("nlp"),
        "{quotas}"
    );
    let out = c.gpuctl_with(Some(&vision), &["quota", "set", "vision", "--gpus", "9"]);
    assert!(!out.status.success(), "a user set a quota");
    c.admin(&["quota", "set", "vision", "--gpus", "2"]);
    assert_eq!(
        c.ok_with(Some(&vision), &["jobs", "wait", &waits, "--timeout", "60"])
            .trim(),
        "SUCCEEDED"
    );

    // The leader dies: a new one serves the same tokens and runs jobs.
    let leader_id = c
        .masters
        .iter()
        .find(|m| m.1 == leader)
        .map(|m| m.0)
        .unwrap();
    for m in c.masters.iter_mut() {
        if m.0 == leader_id {
            if let Some(mut d) = m.2.take() {
                d.kill();
            }
        }
    }
    wait_for(
        Duration::from_secs(40),
        "a new leader serves the user",
        || {
            c.gpuctl_with(Some(&vision), &["jobs", "list"])
                .status
                .success()
        },
    );
    let job2 = c
        .ok_with(
            Some(&vision),
            &[
                "jobs",
                "submit",
                "--name",
                "after",
                "--gpus",
                "1",
                "--",
                "echo",
                "after-failover",
            ],
        )
        .trim()
        .to_string();
    let out = c.gpuctl_with(Some(&vision), &["jobs", "wait", &job2, "--timeout", "60"]);
    assert!(
        out.status.success(),
        "{} {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        c.diagnostics()
    );
    assert!(c
        .ok_with(Some(&vision), &["jobs", "logs", &job2])
        .contains("after-failover"));
    // The revoked token stays revoked on the new leader.
    assert!(!c
        .gpuctl_with(Some(&doomed), &["jobs", "list"])
        .status
        .success());
    c.ok_with(Some(&vision), &["jobs", "cancel", &job]);
}

#[test]
fn an_agent_renews_its_certificate_and_keeps_its_place() {
    let mut c = SecureSingle::start(&["--agent-cert-ttl", "15s"], "1xA100-SXM4-40GB");
    let pem = c.agent_tls.join("agent.pem");
    let first = std::fs::read(&pem).unwrap();
    let mode = std::fs::metadata(&pem).unwrap().permissions();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o077, 0);
    // Renewed after two thirds of 15 s, then again: past the first
    // certificate's end the agent is still ACTIVE and runs jobs.
    wait_for(Duration::from_secs(30), "certificate renewed", || {
        std::fs::read(&pem).unwrap() != first
    });
    std::thread::sleep(Duration::from_secs(12));
    assert!(
        c.agent_active(),
        "agent not active after its first certificate expired\n{}",
        tail(&c.agent.log_text(), 30)
    );
    assert!(c.agent.log_text().contains("renewed"));
    // No call failed for an expired certificate: each renewal was used.
    assert!(
        !c.agent.log_text().contains("expired"),
        "{}",
        tail(&c.agent.log_text(), 30)
    );
    let job = c.ok(&[
        "jobs",
        "submit",
        "--name",
        "renewed",
        "--gpus",
        "1",
        "--",
        "echo",
        "renewed-ok",
    ]);
    let out = c.gpuctl(&["jobs", "wait", &job, "--timeout", "30"]);
    assert!(out.status.success(), "{}", tail(&c.agent.log_text(), 30));
    // Restarted, it needs no token: its certificate is on disk.
    c.restart_agent();
    wait_for(Duration::from_secs(30), "agent back", || c.agent_active());
    assert!(c.agent.is_running());
}

/// A user given only the CA and a token logs in (a client certificate made
/// here, signed by a master) and works with the config file login wrote;
/// a revoked token cannot log in.
#[test]
fn a_user_logs_in_with_a_token() {
    let c = SecureSingle::start(&[], "1xA100-SXM4-40GB");
    let token = c.ok(&["tokens", "create", "--role", "user", "--tenant", "vision"]);
    let home = c.dir.path().join("alice");
    let login = |token: &str| {
        Command::new(bin("gpuctl"))
            .args(["--master", &c.addr, "--token", token, "login", "--ca"])
            .arg(c.pki.join("ca.crt"))
            .arg("--dir")
            .arg(&home)
            .env_remove("GPUCTL_CONFIG")
            .output()
            .unwrap()
    };
    let out = login(&token);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let key = std::fs::metadata(home.join("tls/client.key"))
        .unwrap()
        .permissions();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&key) & 0o077, 0);
    let config = home.join("config.toml");
    let me = gpuctl_tests::secure_gpuctl(&config, &["whoami"]);
    let me = String::from_utf8_lossy(&me.stdout);
    assert!(me.contains("role user tenant vision"), "{me}");
    let job = gpuctl_tests::secure_gpuctl(
        &config,
        &[
            "jobs",
            "submit",
            "--name",
            "mine",
            "--",
            "echo",
            "logged-in",
        ],
    );
    let job = String::from_utf8_lossy(&job.stdout).trim().to_string();
    let done = gpuctl_tests::secure_gpuctl(&config, &["jobs", "wait", &job, "--timeout", "30"]);
    assert!(done.status.success());
    // The certificate names the token's tenant and id.
    let pem = std::fs::read(home.join("tls/client.crt")).unwrap();
    let who = gpuctl_auth::pki::identity_of(
        &gpuctl_auth::pki::certs_from_pem(&pem, "client.crt").unwrap()[0],
    )
    .unwrap();
    assert_eq!(who.role, CertRole::Client);
    assert_eq!(who.name, format!("vision.{}", &token[4..20]));
    // Revoked: no more logins (and no more calls).
    c.ok(&["tokens", "revoke", &token[4..20]]);
    let out = login(&token);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("revoked"));
    assert!(!gpuctl_tests::secure_gpuctl(&config, &["jobs", "list"])
        .status
        .success());
}

/// Issue 39: accounting is each tenant's own. Tokens of two tenants (two
/// of vision's) run jobs on a secure three-master cluster; at every
/// master (followers answer too), `gpuctl usage` with a user's token shows
/// only its tenant's rows, by tenant, token, job and GPU model; the admin
/// sees both tenants. A job's utilization curves are refused to another
/// tenant's token and given to its own.
#[test]
fn a_tenants_token_sees_only_its_own_usage_at_every_master() {
    let c = Secure::start();
    let vision = c.token(&["--role", "user", "--tenant", "vision"]);
    let vision2 = c.token(&["--role", "user", "--tenant", "vision"]);
    let nlp = c.token(&["--role", "user", "--tenant", "nlp"]);
    let run = |token: &str, name: &str| {
        let id = c
            .ok_with(
                Some(token),
                &[
                    "jobs", "submit", "--name", name, "--gpus", "1", "--", "sleep", "1",
                ],
            )
            .trim()
            .to_string();
        c.ok_with(Some(token), &["jobs", "wait", &id, "--timeout", "60"]);
        id
    };
    let v1 = run(&vision, "v1");
    let v2 = run(&vision2, "v2");
    let n1 = run(&nlp, "n1");
    // A token's id: what `usage --by user` names it by.
    let id_of = |t: &str| t[4..20].to_string();
    let at = |addr: &str, token: Option<&str>, by: &str| -> Value {
        let mut cmd = Command::new(bin("gpuctl"));
        cmd.arg("--config")
            .arg(c.pki.join("gpuctl.toml"))
            .args([
                "--master", addr, "usage", "--since", "1d", "--by", by, "--json",
            ])
            .env_remove("GPUCTL_TOKEN")
            .env_remove("GPUCTL_MASTER")
            .stdin(Stdio::null());
        if let Some(t) = token {
            cmd.env("GPUCTL_TOKEN", t);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "usage at {addr}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    // (key, tenant, tasks) of each row.
    let rows = |r: &Value| -> Vec<(String, String, u64)> {
        let mut v: Vec<(String, String, u64)> = r["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| {
                (
                    row["key"].as_str().unwrap().to_string(),
                    row["tenant"].as_str().unwrap_or_default().to_string(),
                    row["tasks"].as_u64().unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let s = |x: &str| x.to_string();
    for (id, addr, _) in &c.masters {
        // A follower may be a moment behind the last task's end.
        wait_for(Duration::from_secs(20), "the master has all three", || {
            rows(&at(addr, None, "tenant"))
                .iter()
                .map(|r| r.2)
                .sum::<u64>()
                == 3
        });
        assert_eq!(
            rows(&at(addr, None, "tenant")),
            [(s("nlp"), s(""), 1), (s("vision"), s(""), 2)],
            "master {id}"
        );
        assert_eq!(
            rows(&at(addr, Some(&vision), "tenant")),
            [(s("vision"), s(""), 2)],
            "master {id}"
        );
        let mut users = vec![
            (id_of(&vision), s("vision"), 1),
            (id_of(&vision2), s("vision"), 1),
        ];
        users.sort();
        assert_eq!(
            rows(&at(addr, Some(&vision2), "user")),
            users,
            "master {id}"
        );
        let mut jobs = vec![(v1.clone(), s("vision"), 1), (v2.clone(), s("vision"), 1)];
        jobs.sort();
        assert_eq!(rows(&at(addr, Some(&vision), "job")), jobs, "master {id}");
        assert_eq!(
            rows(&at(addr, Some(&nlp), "job")),
            [(n1.clone(), s("nlp"), 1)],
            "master {id}"
        );
        let models = rows(&at(addr, Some(&nlp), "gpu-model"));
        assert_eq!(models.len(), 1, "master {id}: {models:?}");
        assert_eq!(models[0].2, 1, "master {id}: only nlp's task: {models:?}");
    }
    // A job's curves: its tenant's, and nobody else's.
    let leader = c.leader_addr();
    rt().block_on(async {
        let chan = channel(&leader, Some(&c.client_tls()), CertRole::Master);
        let mut op = pb::operator_client::OperatorClient::new(chan);
        let ask = |job: &str| pb::UtilizationRequest {
            job_id: job.into(),
            ..Default::default()
        };
        let refused = op
            .utilization(with_token(ask(&v1), &nlp))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
        assert!(refused.message().contains(&v1), "{}", refused.message());
        op.utilization(with_token(ask(&v1), &vision2))
            .await
            .unwrap();
        op.utilization(with_token(ask(&n1), &nlp)).await.unwrap();
    });
}
