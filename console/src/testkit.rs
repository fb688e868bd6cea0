//! A fake master for the console's tests: an Operator service that keeps
//! services (and their replicas' jobs) in memory and answers their calls
//! as the master does (docs/services.md), checking the caller's token;
//! every other call answers `UNIMPLEMENTED`. [`app`] serves it and gives
//! the console's router in front of it.

use std::pin::Pin;
use std::sync::{Arc, Mutex};

use axum::http::{header, Request, StatusCode};
use axum::Router;
use gpuctl_proto::pb;
use tonic::{Response, Status};
use tower_service::Service as _;

use crate::client::{AddressBook, Gateway};

/// The token the fake accepts; any other (or none) is UNAUTHENTICATED.
pub const TOKEN: &str = "Bearer gct_good";
/// The most replicas a scale may ask for, as the master's limit.
pub const MAX_REPLICAS: u32 = 1024;

/// The master's state: its services, by name.
#[derive(Debug, Default)]
pub struct FakeMaster {
    pub services: Mutex<Vec<pb::Service>>,
    /// The `authorization` of each call, in order.
    pub tokens: Mutex<Vec<String>>,
    next_job: Mutex<u32>,
}

type Answer<T> = Result<Response<T>, Status>;

impl FakeMaster {
    /// A service of `replicas` replicas of one GPU each, the first
    /// `running` of them RUNNING, the others QUEUED.
    pub fn add_service(&self, name: &str, replicas: u32, running: u32) {
        let mut list = self.services.lock().unwrap();
        let template = pb::JobSpec {
            image: "registry.local/llm-server:1".into(),
            command: vec!["python".into(), "-m".into(), "server".into()],
            resources: Some(pb::Resources {
                gpus: 1,
                cpus: 2.0,
                mem_mib: 0,
                ports: 1,
            }),
            ..Default::default()
        };
        let mut s = pb::Service {
            id: format!("svc-{}", list.len() + 1),
            name: name.into(),
            tenant: "team-a".into(),
            template: Some(template),
            created_at_ms: 1_700_000_000_000,
            events: vec![pb::JobEvent {
                kind: "Created".into(),
                message: format!("{replicas} replicas"),
                count: 1,
                ..Default::default()
            }],
            ..Default::default()
        };
        self.resize(&mut s, replicas);
        for r in s.replica_jobs.iter_mut().take(running as usize) {
            r.ready = true;
            if let Some(j) = r.job.as_mut() {
                j.state = pb::JobState::JobRunning as i32;
                j.retries = 2;
                j.tasks = vec![pb::Task {
                    id: format!("{}.2", j.id),
                    agent_id: "agent-1".into(),
                    state: pb::TaskState::TaskRunning as i32,
                    ..Default::default()
                }];
            }
        }
        s.running = running.min(replicas);
        s.ready = s.running;
        list.push(s);
    }

    /// New replicas queued up to `replicas`; the newest dropped down to it.
    fn resize(&self, s: &mut pb::Service, replicas: u32) {
        let mut next = self.next_job.lock().unwrap();
        s.replica_jobs.truncate(replicas as usize);
        while s.replica_jobs.len() < replicas as usize {
            *next += 1;
            let id = format!("job-{}", *next);
            let spec = pb::JobSpec {
                name: s.name.clone(),
                service: s.id.clone(),
                restart_policy: "always".into(),
                ..s.template.clone().unwrap_or_default()
            };
            s.replica_jobs.push(pb::ServiceReplica {
                index: s.replica_jobs.len() as u32,
                job_id: id.clone(),
                job: Some(pb::Job {
                    id,
                    spec: Some(spec),
                    state: pb::JobState::JobQueued as i32,
                    message: "Resources: waiting for resources to be freed".into(),
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
        s.replicas = replicas;
        s.running = s
            .replica_jobs
            .iter()
            .filter(|r| {
                r.job
                    .as_ref()
                    .is_some_and(|j| j.state == pb::JobState::JobRunning as i32)
            })
            .count() as u32;
        s.ready = s.replica_jobs.iter().filter(|r| r.ready).count() as u32;
    }

    fn check<T>(&self, req: &tonic::Request<T>) -> Result<(), Status> {
        let got = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        self.tokens.lock().unwrap().push(got.clone());
        if got.is_empty() {
            return Err(Status::unauthenticated("this cluster needs a token"));
        }
        if got != TOKEN {
            return Err(Status::unauthenticated("unknown token"));
        }
        Ok(())
    }
}

fn not_found(name: &str) -> Status {
    Status::not_found(format!("service {name:?} not found"))
}

/// The fake as the generated server takes it.
struct Served(Arc<FakeMaster>);

fn unused<T>() -> Answer<T> {
    Err(Status::unimplemented("not used by the console's tests"))
}

type Stream<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

/// The fake's answers, one plain method per call it answers.
impl FakeMaster {
    fn list_services(
        &self,
        req: tonic::Request<pb::ListServicesRequest>,
    ) -> Result<pb::ListServicesResponse, Status> {
        self.check(&req)?;
        let mut services = self.services.lock().unwrap().clone();
        services.sort_by(|a, b| a.name.cmp(&b.name));
        for s in &mut services {
            s.events.clear();
            for r in &mut s.replica_jobs {
                r.job = None;
            }
        }
        Ok(pb::ListServicesResponse { services })
    }

    fn get_service(
        &self,
        req: tonic::Request<pb::GetServiceRequest>,
    ) -> Result<pb::Service, Status> {
        self.check(&req)?;
        let name = req.into_inner().name;
        let list = self.services.lock().unwrap();
        let s = list.iter().find(|s| s.name == name);
        s.cloned().ok_or_else(|| not_found(&name))
    }

    fn scale_service(
        &self,
        req: tonic::Request<pb::ScaleServiceRequest>,
    ) -> Result<pb::Service, Status> {
        self.check(&req)?;
        let r = req.into_inner();
        if r.replicas > MAX_REPLICAS {
            return Err(Status::invalid_argument(format!(
                "invalid replicas: is {}: at most {MAX_REPLICAS}",
                r.replicas
            )));
        }
        let mut list = self.services.lock().unwrap();
        let s = list
            .iter_mut()
            .find(|s| s.name == r.name)
            .ok_or_else(|| not_found(&r.name))?;
        self.resize(s, r.replicas);
        s.events.push(pb::JobEvent {
            kind: "Scaled".into(),
            message: format!("to {} replicas", r.replicas),
            count: 1,
            ..Default::default()
        });
        Ok(s.clone())
    }

    fn delete_service(
        &self,
        req: tonic::Request<pb::DeleteServiceRequest>,
    ) -> Result<pb::DeleteServiceResponse, Status> {
        self.check(&req)?;
        let name = req.into_inner().name;
        let mut list = self.services.lock().unwrap();
        let at = list
            .iter()
            .position(|s| s.name == name)
            .ok_or_else(|| not_found(&name))?;
        let s = list.remove(at);
        Ok(pb::DeleteServiceResponse {
            job_ids: s.replica_jobs.into_iter().map(|r| r.job_id).collect(),
        })
    }
}

/// The generated trait: the calls answered forwarded to the plain
/// methods, the others `UNIMPLEMENTED` (one macro around the whole impl,
/// so that `async_trait` sees every method).
macro_rules! operator {
    (
        answered { $($name:ident($req:ty) -> $resp:ty;)* }
        unused { $($other:ident($oreq:ty) -> $oresp:ty;)* }
    ) => {
        #[tonic::async_trait]
        impl pb::operator_server::Operator for Served {
            $(async fn $name(&self, r: tonic::Request<$req>) -> Answer<$resp> {
                self.0.$name(r).map(Response::new)
            })*
            $(async fn $other(&self, _: tonic::Request<$oreq>) -> Answer<$oresp> {
                unused()
            })*
            type JobLogsStream = Stream<pb::LogChunk>;
            type WatchJobStream = Stream<pb::Job>;
            type WatchEndpointsStream = Stream<pb::ServiceEndpoints>;
            async fn watch_endpoints(
                &self,
                _: tonic::Request<pb::WatchEndpointsRequest>,
            ) -> Answer<Self::WatchEndpointsStream> {
                unused()
            }
            async fn job_logs(
                &self,
                _: tonic::Request<pb::JobLogsRequest>,
            ) -> Answer<Self::JobLogsStream> {
                unused()
            }
            async fn watch_job(
                &self,
                _: tonic::Request<pb::GetJobRequest>,
            ) -> Answer<Self::WatchJobStream> {
                unused()
            }
        }
    };
}

operator! {
    answered {
        list_services(pb::ListServicesRequest) -> pb::ListServicesResponse;
        get_service(pb::GetServiceRequest) -> pb::Service;
        scale_service(pb::ScaleServiceRequest) -> pb::Service;
        delete_service(pb::DeleteServiceRequest) -> pb::DeleteServiceResponse;
    }
    unused {
        submit_job(pb::SubmitJobRequest) -> pb::SubmitJobResponse;
        get_job(pb::GetJobRequest) -> pb::Job;
        list_jobs(pb::ListJobsRequest) -> pb::ListJobsResponse;
        cancel_job(pb::CancelJobRequest) -> pb::CancelJobResponse;
        list_agents(pb::ListAgentsRequest) -> pb::ListAgentsResponse;
        list_gpus(pb::ListGpusRequest) -> pb::ListGpusResponse;
        cordon_gpu(pb::CordonGpuRequest) -> pb::GpuStatus;
        set_mig_layout(pb::SetMigLayoutRequest) -> pb::GpuStatus;
        share_gpu(pb::ShareGpuRequest) -> pb::GpuStatus;
        drain_agent(pb::DrainAgentRequest) -> pb::Agent;
        undrain_agent(pb::UndrainAgentRequest) -> pb::Agent;
        list_masters(pb::ListMastersRequest) -> pb::ListMastersResponse;
        add_master(pb::AddMasterRequest) -> pb::ListMastersResponse;
        remove_master(pb::RemoveMasterRequest) -> pb::ListMastersResponse;
        usage(pb::UsageRequest) -> pb::UsageResponse;
        utilization(pb::UtilizationRequest) -> pb::UtilizationResponse;
        create_service(pb::CreateServiceRequest) -> pb::Service;
    }
}

/// Serves `fake` on a free local port; returns its address.
pub async fn serve(fake: Arc<FakeMaster>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::operator_server::OperatorServer::new(Served(fake)))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
    );
    addr
}

/// The console (a loopback one) in front of a new fake master.
pub async fn app() -> (Router, Arc<FakeMaster>) {
    let fake = Arc::new(FakeMaster::default());
    let addr = serve(fake.clone()).await;
    let book: AddressBook = Arc::new(move || vec![addr.clone()]);
    let app = crate::router_for_tests(Arc::new(Gateway::new(book, None)), true);
    (app, fake)
}

/// A request to the console as a browser of it sends it, with `token`;
/// a POST with `body` as JSON.
pub fn request(
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> Request<axum::body::Body> {
    let mut b = Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, "127.0.0.1:8080");
    if let Some(t) = token {
        b = b.header(header::AUTHORIZATION, t);
    }
    if body.is_some() {
        b = b.header(header::CONTENT_TYPE, "application/json");
    }
    b.body(axum::body::Body::from(body.unwrap_or_default().to_string()))
        .unwrap()
}

/// The console's answer: its status and its JSON.
pub async fn call(
    app: &mut Router,
    req: Request<axum::body::Body>,
) -> (StatusCode, serde_json::Value) {
    let resp = app.call(req).await.unwrap();
    let status = resp.status();
    let body = axum::body::to_bytes(resp.into_body(), 1 << 22)
        .await
        .unwrap();
    let v = serde_json::from_slice(&body)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(&body).into()));
    (status, v)
}
