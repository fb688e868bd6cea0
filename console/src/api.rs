//! `/api/...`: the console's JSON, each route one or two calls of the
//! masters' API made through the [`Gateway`] with the browser's token.
//! gRPC errors become HTTP statuses with the master's message as
//! `{"error": "..."}`; bodies are capped (`MAX_BODY`) and the master's own
//! checks judge the input (its errors name the field).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use gpuctl_proto::pb;
use serde::Deserialize;
use serde_json::{json, Value};
use tonic::Code;

use super::client::{access, operator, CallError, Gateway, Token, RPC_TIMEOUT};
use super::json;
use super::logs;
use gpuctl_proto::follow::READ_ATTEMPT;

/// Largest request body (a submitted job's JSON).
pub const MAX_BODY: usize = 1024 * 1024;
/// Jobs on the jobs page unless it asks for another number; the most.
const DEFAULT_JOBS: u32 = 200;
const MAX_JOBS: u32 = 1000;
/// Log pieces buffered for a slow browser before the relay waits.
const LOG_BUFFER: usize = 64;

/// The console layer's one error: what the browser gets, as a status and
/// `{"error": message}`.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A master's answer (or the last one, when none could serve in time).
    #[error("{message}")]
    Rpc { code: Code, message: String },
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// A submit whose outcome is unknown: some try may have made the job.
    /// The browser sends it again with the same request id, which makes
    /// at most one job.
    #[error(
        "the outcome is unknown: the job may or may not have been made ({message}); submit again \
         with the same request id {request_id}: it makes at most one job"
    )]
    OutcomeUnknown { message: String, request_id: String },
}

/// The HTTP status for a gRPC code.
pub fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted | Code::FailedPrecondition => StatusCode::CONFLICT,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Cancelled | Code::Unknown | Code::Internal | Code::DataLoss => {
            StatusCode::BAD_GATEWAY
        }
    }
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Rpc { code, .. } => http_status(*code),
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::OutcomeUnknown { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

impl From<CallError> for ApiError {
    fn from(e: CallError) -> ApiError {
        let msg = e.status.message().trim();
        let mut message = if gpuctl_proto::leader::is_transport_error(&e.status) || msg.is_empty() {
            let detail = if msg.is_empty() {
                String::new()
            } else {
                format!(": {msg}")
            };
            format!("master {} could not be reached{detail}", e.addr)
        } else {
            msg.to_string()
        };
        if let Some(after) = e.gave_up_after {
            message = format!(
                "no master could serve the call within {} s; last answer: {message}",
                after.as_secs_f64().round()
            );
        }
        ApiError::Rpc {
            code: e.status.code(),
            message,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = match &self {
            ApiError::OutcomeUnknown { request_id, .. } => json!({
                "error": self.to_string(),
                "outcome": "unknown",
                "request_id": request_id,
            }),
            _ => json!({ "error": self.to_string() }),
        };
        json_response(self.status(), &body)
    }
}

pub fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        v.to_string(),
    )
        .into_response()
}

pub(crate) type ApiResult = Result<Response, ApiError>;

pub(crate) fn ok(v: Value) -> ApiResult {
    Ok(json_response(StatusCode::OK, &v))
}

/// The browser's `Authorization` header, forwarded to the masters as it
/// is: they parse the token and say what is wrong with it.
pub fn token(headers: &HeaderMap) -> Result<Token, ApiError> {
    let Some(v) = headers.get(header::AUTHORIZATION) else {
        return Ok(Token(None));
    };
    let text = v
        .to_str()
        .map_err(|_| ApiError::Unauthenticated("the authorization header is not text".into()))?;
    let value = text
        .parse()
        .map_err(|_| ApiError::Unauthenticated("the authorization header is not valid".into()))?;
    Ok(Token(Some(value)))
}

pub fn routes(gateway: Arc<Gateway>) -> Router {
    Router::new()
        .route("/api/whoami", get(whoami))
        .route("/api/masters", get(masters))
        .route("/api/agents", get(agents))
        .route("/api/gpus", get(gpus))
        .route("/api/utilization", get(utilization))
        .route("/api/usage", get(usage))
        .route("/api/jobs", get(list_jobs).post(submit))
        .route("/api/jobs/:id", get(get_job))
        .route("/api/jobs/:id/cancel", post(cancel))
        .route("/api/jobs/:id/logs", get(job_logs))
        .route("/api/requests/:request_id", get(job_by_request))
        .route("/api/*rest", axum::routing::any(no_such_call))
        .with_state(gateway)
}

async fn no_such_call() -> ApiError {
    ApiError::NotFound("no such API call".into())
}

async fn whoami(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> ApiResult {
    let t = token(&headers)?;
    let r = gw
        .call(Some(READ_ATTEMPT), |c| {
            let req = t.request(pb::WhoAmIRequest {});
            async move { access(c).who_am_i(req).await }
        })
        .await?;
    ok(json!(json::whoami(&r)))
}

async fn masters(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> ApiResult {
    let t = token(&headers)?;
    let r = gw
        .call(Some(READ_ATTEMPT), |c| {
            let req = t.request(pb::ListMastersRequest {});
            async move { operator(c).list_masters(req).await }
        })
        .await?;
    ok(json!({ "masters": r.masters.iter().map(json::master).collect::<Vec<_>>() }))
}

async fn agents(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> ApiResult {
    let t = token(&headers)?;
    let r = gw
        .call(Some(READ_ATTEMPT), |c| {
            let req = t.request(pb::ListAgentsRequest {});
            async move { operator(c).list_agents(req).await }
        })
        .await?;
    let mut agents = r.agents;
    agents.sort_by(|a, b| a.id.cmp(&b.id));
    ok(json!({ "agents": agents.iter().map(json::AgentJson::from).collect::<Vec<_>>() }))
}

async fn gpus(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> ApiResult {
    let t = token(&headers)?;
    let r = gw
        .call(Some(READ_ATTEMPT), |c| {
            let req = t.request(pb::ListGpusRequest {});
            async move { operator(c).list_gpus(req).await }
        })
        .await?;
    let mut gpus = r.gpus;
    // As `gpuctl gpus` and `top`: by agent, then index.
    gpus.sort_by_key(|s| (s.agent_id.clone(), s.gpu.as_ref().map_or(0, |g| g.index)));
    ok(json!({ "gpus": gpus.iter().map(json::gpu_status).collect::<Vec<_>>() }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UtilizationQuery {
    /// How far back, as gpuctl writes durations (`1h`, `1d`); default 1h.
    #[serde(default)]
    window: Option<String>,
    /// A job: its GPUs over its tasks' lives instead.
    #[serde(default)]
    job: Option<String>,
}

/// A duration back from now, as ms since the epoch.
fn since(window: Option<&str>, default: &str) -> Result<u64, ApiError> {
    let w = window.unwrap_or(default);
    let d = gpuctl_core::time::parse_duration(w)
        .map_err(|e| ApiError::BadRequest(format!("window: {e}")))?;
    Ok(
        gpuctl_core::time::now_ms()
            .saturating_sub(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
    )
}

/// Points as numbers, `null` for a period without a reading.
fn points(bytes: &[u8]) -> Vec<Value> {
    bytes
        .iter()
        .map(|b| if *b == 255 { Value::Null } else { json!(b) })
        .collect()
}

/// GPU utilization curves: every GPU's (or a job's), and the cluster's
/// GPUs held against busy.
async fn utilization(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    query: Result<Query<UtilizationQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult {
    let t = token(&headers)?;
    let Query(q) = query.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    let since_ms = if q.job.is_some() && q.window.is_none() {
        0
    } else {
        since(q.window.as_deref(), "1h")?
    };
    // Past a day (the periods kept), hourly means (a week kept).
    let hourly = gpuctl_core::time::now_ms().saturating_sub(since_ms) > 24 * 3_600_000
        && (q.job.is_none() || q.window.is_some());
    let job_id = q.job.unwrap_or_default();
    let r = gw
        .call(Some(READ_ATTEMPT), |c| {
            let req = t.request(pb::UtilizationRequest {
                since_ms,
                gpus: Vec::new(),
                job_id: job_id.clone(),
                hourly,
            });
            async move { operator(c).utilization(req).await }
        })
        .await?;
    let gpus: Vec<Value> = r
        .gpus
        .iter()
        .map(|g| {
            json!({
                "gpu": g.gpu,
                "task_id": g.task_id,
                "own": g.own,
                "start_ms": g.start_ms,
                "period_ms": g.period_ms,
                "util": points(&g.util),
                "mem": points(&g.mem),
            })
        })
        .collect();
    ok(json!({
        "gpus": gpus,
        "cluster": {
            "start_ms": r.cluster_start_ms,
            "period_ms": r.cluster_period_ms,
            "allocated": r.allocated,
            "used": r.busy_pct_sum.iter().map(|b| f64::from(*b) / 100.0).collect::<Vec<_>>(),
        },
        "truncated": r.truncated,
        "hourly": hourly,
    }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UsageQuery {
    #[serde(default)]
    window: Option<String>,
    #[serde(default)]
    by: Option<String>,
}

/// The accounting report (`gpuctl usage`), for the usage page.
async fn usage(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    query: Result<Query<UsageQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult {
    let t = token(&headers)?;
    let Query(q) = query.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    let since_ms = since(q.window.as_deref(), "7d")?;
    let by = q.by.unwrap_or_default();
    let r = gw
        .call(Some(READ_ATTEMPT), |c| {
            let req = t.request(pb::UsageRequest {
                since_ms,
                by: by.clone(),
            });
            async move { operator(c).usage(req).await }
        })
        .await?;
    let hours = |ms: u64| ms as f64 / 3_600_000.0;
    let rows: Vec<Value> = r
        .rows
        .iter()
        .map(|row| {
            json!({
                "key": row.key,
                "tenant": row.tenant,
                "gpu_hours": hours(row.gpu_ms),
                "gpu_startup_hours": hours(row.gpu_startup_ms),
                "gpu_util_pct": (row.gpu_sampled_ms > 0)
                    .then(|| 100.0 * row.gpu_busy_ms as f64 / row.gpu_sampled_ms as f64),
                "cpu_hours": hours(row.cpu_ms),
                "mem_gib_hours": hours(row.mem_mib_ms) / 1024.0,
                "tasks": row.tasks,
                "running": row.running,
            })
        })
        .collect();
    ok(json!({
        "since_ms": r.since_ms,
        "until_ms": r.until_ms,
        "rows": rows,
        "truncated": r.truncated,
    }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JobsQuery {
    /// A job state word (`RUNNING`), or empty for all.
    #[serde(default)]
    state: String,
    limit: Option<u32>,
}

/// A state word of the jobs page as the wire value.
pub fn parse_state(s: &str) -> Result<Option<pb::JobState>, ApiError> {
    let state = match s.trim().to_ascii_uppercase().as_str() {
        "" => return Ok(None),
        "QUEUED" => pb::JobState::JobQueued,
        "STARTING" => pb::JobState::JobStarting,
        "RUNNING" => pb::JobState::JobRunning,
        "SUCCEEDED" => pb::JobState::JobSucceeded,
        "FAILED" => pb::JobState::JobFailed,
        "CANCELLED" => pb::JobState::JobCancelled,
        other => {
            return Err(ApiError::BadRequest(format!(
                "state: {other:?} is not a job state (QUEUED, STARTING, RUNNING, SUCCEEDED, \
                 FAILED, CANCELLED)"
            )))
        }
    };
    Ok(Some(state))
}

/// The newest jobs (one page of the master's, newest first).
async fn list_jobs(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    query: Result<Query<JobsQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult {
    let t = token(&headers)?;
    let Query(q) = query.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    let state = parse_state(&q.state)?;
    let limit = q.limit.unwrap_or(DEFAULT_JOBS).clamp(1, MAX_JOBS);
    let r = gw
        .call(Some(READ_ATTEMPT), |c| {
            let req = t.request(pb::ListJobsRequest {
                states: state.map(|s| s as i32).into_iter().collect(),
                limit,
                ..Default::default()
            });
            async move { operator(c).list_jobs(req).await }
        })
        .await?;
    ok(json!({
        "jobs": r.jobs.iter().map(json::JobJson::from).collect::<Vec<_>>(),
        "more": !r.next_page_token.is_empty(),
    }))
}

async fn get_job(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult {
    let t = token(&headers)?;
    let job = gw
        .call(Some(READ_ATTEMPT), |c| {
            let req = t.request(pb::GetJobRequest {
                job_id: id.clone(),
                ..Default::default()
            });
            async move { operator(c).get_job(req).await }
        })
        .await?;
    ok(json!(json::JobJson::from(&job)))
}

/// The job this browser's token submitted with a request id (after an
/// unknown outcome: was it made?).
async fn job_by_request(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path(request_id): Path<String>,
) -> ApiResult {
    let t = token(&headers)?;
    let job = gw
        .call(Some(READ_ATTEMPT), |c| {
            let req = t.request(pb::GetJobRequest {
                request_id: request_id.clone(),
                ..Default::default()
            });
            async move { operator(c).get_job(req).await }
        })
        .await?;
    ok(json!(json::JobJson::from(&job)))
}

/// Parses the submit form; the error names what is wrong with the JSON.
pub fn parse_form(body: &[u8]) -> Result<json::SubmitForm, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::BadRequest(format!("job: {e}")))
}

async fn submit(State(gw): State<Arc<Gateway>>, headers: HeaderMap, body: Bytes) -> ApiResult {
    let t = token(&headers)?;
    let form = parse_form(&body)?;
    let spec = form.to_spec();
    let request_id = if form.request_id.is_empty() {
        gpuctl_proto::new_request_id()
    } else {
        form.request_id.clone()
    };
    // The same key on every try: the master makes the job at most once.
    let r = gw
        .call(Some(RPC_TIMEOUT), |c| {
            let req = t.request(pb::SubmitJobRequest {
                spec: Some(spec.clone()),
                request_id: request_id.clone(),
            });
            async move { operator(c).submit_job(req).await }
        })
        .await
        .map_err(|e| submit_error(e, &request_id))?;
    Ok(json_response(
        StatusCode::CREATED,
        &json!({ "job_id": r.job_id }),
    ))
}

/// A failed submit: unknown when some try may have made the job, so that
/// the browser says so and sends it again with the same request id.
pub fn submit_error(e: CallError, request_id: &str) -> ApiError {
    let maybe_applied = e.maybe_applied;
    let err = ApiError::from(e);
    match err {
        ApiError::Rpc { message, .. } if maybe_applied => ApiError::OutcomeUnknown {
            message,
            request_id: request_id.to_string(),
        },
        other => other,
    }
}

async fn cancel(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult {
    let t = token(&headers)?;
    let r = gw
        .call(Some(RPC_TIMEOUT), |c| {
            let req = t.request(pb::CancelJobRequest { job_id: id.clone() });
            async move { operator(c).cancel_job(req).await }
        })
        .await?;
    ok(json!({ "state": gpuctl_core::convert::job_state_name(r.state) }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LogsQuery {
    #[serde(default)]
    follow: bool,
    rank: Option<u32>,
    attempt: Option<u32>,
}

/// The job's output as newline-delimited JSON (logs.rs). Errors before
/// the first byte (no such job, no token) are ordinary error answers.
async fn job_logs(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    query: Result<Query<LogsQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult {
    let t = token(&headers)?;
    let Query(q) = query.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    let which = logs::LogSelection {
        follow: q.follow,
        rank: q.rank,
        attempt: q.attempt,
    };
    let first = logs::open(&gw, &t, &id, which).await?;
    let (tx, rx) = tokio::sync::mpsc::channel(LOG_BUFFER);
    tokio::spawn(logs::relay(gw.clone(), t, id, which, first, tx));
    let body = Body::from_stream(tokio_stream::StreamExt::map(
        tokio_stream::wrappers::ReceiverStream::new(rx),
        Ok::<_, std::convert::Infallible>,
    ));
    let mut resp = Response::new(body);
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn grpc_codes_map_to_http_statuses() {
        for (code, status) in [
            (Code::Unauthenticated, 401),
            (Code::PermissionDenied, 403),
            (Code::NotFound, 404),
            (Code::InvalidArgument, 400),
            (Code::Unavailable, 503),
            (Code::FailedPrecondition, 409),
            (Code::ResourceExhausted, 429),
            (Code::DeadlineExceeded, 504),
            (Code::Internal, 502),
        ] {
            assert_eq!(http_status(code).as_u16(), status, "{code:?}");
        }
    }

    #[test]
    fn a_masters_error_keeps_its_message() {
        let e = ApiError::from(CallError {
            status: tonic::Status::invalid_argument("resources.gpus: must be at most 64"),
            addr: "m1:7050".into(),
            gave_up_after: None,
            maybe_applied: false,
        });
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.to_string(), "resources.gpus: must be at most 64");
        let e = ApiError::from(CallError {
            status: tonic::Status::unavailable("this master is not the leader"),
            addr: "m1:7050".into(),
            gave_up_after: Some(Duration::from_millis(15_200)),
            maybe_applied: false,
        });
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            e.to_string(),
            "no master could serve the call within 15 s; last answer: this master is not the leader"
        );
        let e = ApiError::from(CallError {
            status: tonic::Status::unavailable(""),
            addr: "m2:7050".into(),
            gave_up_after: None,
            maybe_applied: false,
        });
        assert_eq!(e.to_string(), "master m2:7050 could not be reached");
    }

    #[tokio::test]
    async fn a_submit_that_may_have_been_applied_says_the_outcome_is_unknown() {
        let gave_up = |maybe_applied| CallError {
            status: tonic::Status::unavailable(
                "this master is not the leader and no leader is elected yet; retry",
            ),
            addr: "m1:7050".into(),
            gave_up_after: Some(Duration::from_secs(15)),
            maybe_applied,
        };
        let e = submit_error(gave_up(true), "k1");
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        let text = e.to_string();
        assert!(
            text.contains("outcome is unknown") && text.contains("k1"),
            "{text}"
        );
        let r = e.into_response();
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["outcome"], "unknown");
        assert_eq!(v["request_id"], "k1");
        // Every try provably refused: an ordinary error.
        let e = submit_error(gave_up(false), "k1");
        assert!(matches!(e, ApiError::Rpc { .. }), "{e:?}");
        assert!(!e.to_string().contains("unknown"));
    }

    #[tokio::test]
    async fn errors_are_json_with_the_message() {
        let r = ApiError::Rpc {
            code: Code::Unauthenticated,
            message: "unknown token".into(),
        }
        .into_response();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
        let body = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v, json!({ "error": "unknown token" }));
    }

    #[test]
    fn the_token_is_forwarded_as_it_came() {
        let mut h = HeaderMap::new();
        assert!(token(&h).unwrap().0.is_none());
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer gct_x"),
        );
        let req = token(&h).unwrap().request(());
        assert_eq!(req.metadata().get("authorization").unwrap(), "Bearer gct_x");
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_bytes(b"Bearer \xff").unwrap(),
        );
        assert_eq!(token(&h).unwrap_err().status(), StatusCode::UNAUTHORIZED);
    }

    #[test]
    fn states_and_forms_are_checked_naming_what_is_wrong() {
        assert_eq!(
            parse_state("running").unwrap(),
            Some(pb::JobState::JobRunning)
        );
        assert_eq!(parse_state("").unwrap(), None);
        let e = parse_state("DONE").unwrap_err();
        assert!(e.to_string().contains("\"DONE\""), "{e}");
        let e = parse_form(br#"{"name": "x", "command": ["true"], "gpus": "two"}"#).unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert!(e.to_string().starts_with("job: invalid type"), "{e}");
        let e = parse_form(b"not json").unwrap_err();
        assert!(e.to_string().starts_with("job: "), "{e}");
        assert_eq!(gpuctl_proto::new_request_id().len(), 32);
    }
}
