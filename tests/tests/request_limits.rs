//! Big requests cost what they are (issue 31): three real masters with
//! mutual TLS and tokens; a tenant's client sends the leader, for several
//! seconds, SubmitJobs of a million env variables (13.4 MiB: over the
//! call's 1 MiB cap) and of 74,000 (just under it), while every master's
//! Raft term is watched. Each big one is refused at its size prefix with
//! RESOURCE_EXHAUSTED naming the call and the cap, each smaller one by the
//! field check naming spec.env; the term does not move (before, every big
//! send cost an election), and a normal submit still succeeds afterwards.
//! Timings are printed, not asserted.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes};
use gpuctl_auth::tls::{ClientAuth, Tls, TlsPaths};
use gpuctl_auth::CertRole;
use gpuctl_proto::pb;
use gpuctl_tests::{secure_gpuctl, tail, wait_for, Daemon};
use prost::Message as _;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

/// Three masters with TLS (`gpuctl certs init`), no agents.
struct SecureHa {
    _dir: tempfile::TempDir,
    pki: PathBuf,
    masters: Vec<(u64, String, Daemon)>,
}

impl SecureHa {
    fn start() -> SecureHa {
        let dir = gpuctl_tests::test_dir();
        let (pki, masters) = gpuctl_tests::start_secure_masters(dir.path(), 3, &[]);
        let c = SecureHa {
            _dir: dir,
            pki,
            masters,
        };
        wait_for(Duration::from_secs(40), "the admin token works", || {
            c.gpuctl(&["whoami"]).status.success()
        });
        c
    }

    fn gpuctl(&self, args: &[&str]) -> std::process::Output {
        let mut all = vec!["--master", &self.addrs()]
            .into_iter()
            .map(String::from)
            .collect::<Vec<_>>();
        all.extend(args.iter().map(|s| s.to_string()));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        secure_gpuctl(&self.pki.join("gpuctl.toml"), &all)
    }

    fn addrs(&self) -> String {
        self.masters
            .iter()
            .map(|m| m.1.clone())
            .collect::<Vec<_>>()
            .join(",")
    }

    fn admin_token(&self) -> String {
        std::fs::read_to_string(self.pki.join("bootstrap.token"))
            .unwrap()
            .trim()
            .to_string()
    }

    fn diagnostics(&self) -> String {
        let mut s = String::new();
        for (id, _, d) in &self.masters {
            s.push_str(&format!(
                "--- master {id} ---\n{}\n",
                tail(&d.log_text(), 30)
            ));
        }
        s
    }

    fn client_tls(&self) -> Arc<Tls> {
        let p = |f: &str| self.pki.join(f);
        Arc::new(
            Tls::from_files(
                &TlsPaths {
                    ca: p("ca.crt"),
                    cert: p("client.crt"),
                    key: p("client.key"),
                },
                ClientAuth::Required,
            )
            .unwrap(),
        )
    }
}

fn channel(addr: &str, tls: &Arc<Tls>) -> Channel {
    let e = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(3))
        .timeout(Duration::from_secs(60));
    gpuctl_auth::tls::channel(&e, Some(tls), CertRole::Master)
}

fn with_token<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

/// A request sent as bytes already encoded, so that the client spends no
/// time on it per send; the answer decoded as usual.
#[derive(Default)]
struct PreEncoded;

struct RawEncoder;
struct ReplyDecoder;

impl Codec for PreEncoded {
    type Encode = Bytes;
    type Decode = pb::SubmitJobResponse;
    type Encoder = RawEncoder;
    type Decoder = ReplyDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> ReplyDecoder {
        ReplyDecoder
    }
}

impl Encoder for RawEncoder {
    type Item = Bytes;
    type Error = Status;
    fn encode(&mut self, item: Bytes, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.put(item);
        Ok(())
    }
}

impl Decoder for ReplyDecoder {
    type Item = pb::SubmitJobResponse;
    type Error = Status;
    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
        pb::SubmitJobResponse::decode(buf)
            .map(Some)
            .map_err(|e| Status::internal(e.to_string()))
    }
}

/// A SubmitJob of `vars` env variables named `V000000`... with value `x`:
/// 14 bytes each on the wire.
fn submit_with_env(vars: usize) -> Bytes {
    let env = (0..vars)
        .map(|i| (format!("V{i:06}"), "x".to_string()))
        .collect();
    let req = pb::SubmitJobRequest {
        spec: Some(pb::JobSpec {
            name: "big".into(),
            command: vec!["true".into()],
            env,
            ..Default::default()
        }),
        ..Default::default()
    };
    Bytes::from(req.encode_to_vec())
}

async fn send_raw(ch: Channel, token: &str, body: Bytes) -> Result<pb::SubmitJobResponse, Status> {
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let path = PathAndQuery::from_static("/gpuctl.v1.Operator/SubmitJob");
    grpc.unary(with_token(body, token), path, PreEncoded)
        .await
        .map(|r| r.into_inner())
}

/// Each master's own view: (id, role, term), asked of the master itself.
async fn views(c: &SecureHa, tls: &Arc<Tls>, token: &str) -> Vec<(u64, String, u64)> {
    let mut out = Vec::new();
    for (id, addr, _) in &c.masters {
        let mut op = pb::operator_client::OperatorClient::new(channel(addr, tls));
        if let Ok(r) = op
            .list_masters(with_token(pb::ListMastersRequest::default(), token))
            .await
        {
            if let Some(me) = r.into_inner().masters.into_iter().find(|m| m.answered) {
                out.push((*id, me.role, me.term));
            }
        }
    }
    out
}

fn leader_of(views: &[(u64, String, u64)]) -> Option<(u64, u64)> {
    views
        .iter()
        .filter(|v| v.1 == "leader")
        .max_by_key(|v| v.2)
        .map(|v| (v.0, v.2))
}

#[test]
fn oversized_submits_are_refused_at_once_and_do_not_disturb_raft() {
    let c = SecureHa::start();
    let admin = c.admin_token();
    let tls = c.client_tls();
    let out = c.gpuctl(&["tokens", "create", "--role", "user", "--tenant", "t"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let user = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // A settled group: every master answers and names the same leader.
        let start = Instant::now();
        let before = loop {
            let before = views(&c, &tls, &admin).await;
            if before.len() == 3
                && before.iter().all(|v| v.2 == before[0].2)
                && leader_of(&before).is_some()
            {
                break before;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no settled group: {before:?}\n{}",
                c.diagnostics()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let (leader, term) = leader_of(&before).unwrap();
        let leader_addr = c.masters.iter().find(|m| m.0 == leader).unwrap().1.clone();
        eprintln!("before: {before:?}");

        // What the outsider sent: a million env variables, 13.4 MiB.
        let big = submit_with_env(1_000_000);
        assert!(big.len() > 13 * 1024 * 1024);
        // Just under SubmitJob's cap: it is decoded, and refused by the
        // field check that names spec.env.
        let under = submit_with_env(74_000);
        assert!(under.len() < 1024 * 1024 - 1024, "{}", under.len());

        let ch = channel(&leader_addr, &tls);
        let loop_start = Instant::now();
        let (mut big_took, mut under_took) = (Vec::new(), Vec::new());
        while big_took.len() < 5 || loop_start.elapsed() < Duration::from_secs(8) {
            let t = Instant::now();
            let s = send_raw(ch.clone(), &user, big.clone())
                .await
                .expect_err("a 13 MiB submit is refused");
            big_took.push(t.elapsed());
            assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
            assert!(
                s.message().contains("gpuctl.v1.Operator/SubmitJob")
                    && s.message().contains("at most 1 MiB")
                    && s.message().contains(&big.len().to_string()),
                "{s:?}"
            );
            let t = Instant::now();
            let s = send_raw(ch.clone(), &user, under.clone())
                .await
                .expect_err("74,000 env variables are refused");
            under_took.push(t.elapsed());
            assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
            assert!(
                s.message().contains("spec.env") && s.message().contains("at most 1024"),
                "{s:?}"
            );
            // Every master still answers, under the same term.
            let now = views(&c, &tls, &admin).await;
            assert!(
                now.len() == 3 && now.iter().all(|v| v.2 == term),
                "the term moved: {before:?} -> {now:?}\n{}",
                c.diagnostics()
            );
        }
        let summary = |took: &mut Vec<Duration>| {
            took.sort();
            format!(
                "{} sends, min {:?}, median {:?}, max {:?}",
                took.len(),
                took[0],
                took[took.len() / 2],
                took[took.len() - 1]
            )
        };
        eprintln!(
            "13.4 MiB submits ({} bytes): {}",
            big.len(),
            summary(&mut big_took)
        );
        eprintln!(
            "1 MiB submits ({} bytes): {}",
            under.len(),
            summary(&mut under_took)
        );

        let after = views(&c, &tls, &admin).await;
        eprintln!("after {:?}: {after:?}", loop_start.elapsed());
        assert_eq!(
            after.len(),
            3,
            "every master answers: {after:?}\n{}",
            c.diagnostics()
        );
        for (id, _, t) in &after {
            assert_eq!(
                *t,
                term,
                "master {id}'s term moved: {before:?} -> {after:?}\n{}",
                c.diagnostics()
            );
        }
        assert_eq!(leader_of(&after), Some((leader, term)), "{after:?}");

        // A normal submit still goes through, on the same connection.
        let mut op = pb::operator_client::OperatorClient::new(ch);
        let job = op
            .submit_job(with_token(
                pb::SubmitJobRequest {
                    spec: Some(pb::JobSpec {
                        name: "small".into(),
                        command: vec!["true".into()],
                        env: [("A".to_string(), "1".to_string())].into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                &user,
            ))
            .await
            .unwrap_or_else(|s| panic!("a normal submit: {s:?}\n{}", c.diagnostics()))
            .into_inner();
        assert!(job.job_id.starts_with("job-"), "{job:?}");
    });
}
