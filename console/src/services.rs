//! `/api/services...`: the services page's calls (docs/services.md), each
//! one call of the masters' Operator API with the browser's token, as the
//! jobs' routes in api.rs: reads retried as reads, scale and delete as
//! cancel (both are safe to send again), errors mapped alike.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::routing::{get, post};
use axum::Router;
use gpuctl_proto::follow::READ_ATTEMPT;
use gpuctl_proto::pb;
use serde_json::json;

use super::api::{ok, token, ApiError, ApiResult};
use super::client::{operator, CallError, Gateway, RPC_TIMEOUT};
use super::json::{self, ServiceJson};

pub fn routes(gateway: Arc<Gateway>) -> Router {
    Router::new()
        .route("/api/services", get(list_services))
        .route("/api/services/:name", get(get_service))
        .route("/api/services/:name/scale", post(scale))
        .route("/api/services/:name/delete", post(delete))
        .with_state(gateway)
}

/// The tenant's services, by name (the master's order), without their
/// replicas' jobs and events.
async fn list_services(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> ApiResult {
    let t = token(&headers)?;
    let r = gw
        .call(Some(READ_ATTEMPT), |c| {
            let req = t.request(pb::ListServicesRequest {});
            async move { operator(c).list_services(req).await }
        })
        .await?;
    ok(json!({ "services": r.services.iter().map(ServiceJson::from).collect::<Vec<_>>() }))
}

/// One service with each replica's job and the service's events.
async fn get_service(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> ApiResult {
    let t = token(&headers)?;
    let s = gw
        .call(Some(READ_ATTEMPT), |c| {
            let req = t.request(pb::GetServiceRequest { name: name.clone() });
            async move { operator(c).get_service(req).await }
        })
        .await?;
    ok(json!(ServiceJson::from(&s)))
}

/// Parses the scale form; the error names the field.
pub fn parse_scale(body: &[u8]) -> Result<json::ScaleForm, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::BadRequest(format!("replicas: {e}")))
}

/// Sets the number of replicas; answers the service afterwards. The same
/// number sent twice is the same change: safe to retry.
async fn scale(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path(name): Path<String>,
    body: Bytes,
) -> ApiResult {
    let t = token(&headers)?;
    let form = parse_scale(&body)?;
    let s = gw
        .call(Some(RPC_TIMEOUT), |c| {
            let req = t.request(pb::ScaleServiceRequest {
                name: name.clone(),
                replicas: form.replicas,
            });
            async move { operator(c).scale_service(req).await }
        })
        .await
        .map_err(|e| {
            change_error(
                e,
                &format!(
                    "service {name} may or may not have been scaled to {} replicas",
                    form.replicas
                ),
                "scaling again to the same number is safe",
            )
        })?;
    ok(json!(ServiceJson::from(&s)))
}

/// Stops every replica and frees the name; answers the replicas' jobs.
async fn delete(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> ApiResult {
    let t = token(&headers)?;
    let r = gw
        .call(Some(RPC_TIMEOUT), |c| {
            let req = t.request(pb::DeleteServiceRequest { name: name.clone() });
            async move { operator(c).delete_service(req).await }
        })
        .await
        .map_err(|e| {
            change_error(
                e,
                &format!("service {name} may or may not have been deleted"),
                "the services page tells: a service no longer listed was deleted (its replicas' \
                 jobs are stopping)",
            )
        })?;
    ok(json!({ "job_ids": r.job_ids }))
}

/// A failed scale or delete. When some try may have been applied, the last
/// answer proves nothing (a delete sent again after the first deleted it
/// is answered NOT_FOUND), so the message says the outcome is unknown and
/// how to find it out; the status stays the last answer's.
pub fn change_error(e: CallError, what: &str, how_to_know: &str) -> ApiError {
    let maybe_applied = e.maybe_applied;
    match ApiError::from(e) {
        ApiError::Rpc { code, message } if maybe_applied => ApiError::Rpc {
            code,
            message: format!("the outcome is unknown: {what} ({message}); {how_to_know}"),
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::{app, call, request, TOKEN};
    use axum::http::StatusCode;
    use serde_json::Value;

    #[tokio::test]
    async fn the_list_has_each_service_without_its_replicas_jobs() {
        let (mut app, fake) = app().await;
        let (status, v) = call(&mut app, request("GET", "/api/services", Some(TOKEN), None)).await;
        assert_eq!((status, v), (StatusCode::OK, json!({ "services": [] })));
        fake.add_service("web", 1, 0);
        fake.add_service("llm", 3, 2);
        let (status, v) = call(&mut app, request("GET", "/api/services", Some(TOKEN), None)).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        let list = v["services"].as_array().unwrap();
        let names: Vec<&str> = list.iter().map(|s| s["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["llm", "web"], "by name");
        let llm = &list[0];
        assert_eq!((&llm["replicas"], &llm["running"]), (&json!(3), &json!(2)));
        assert_eq!(llm["ready"], 2, "{llm}");
        assert_eq!(llm["template"]["image"], "registry.local/llm-server:1");
        assert_eq!(llm["template"]["resources"]["gpus"], 1);
        assert_eq!(llm["replica_jobs"][1]["job_id"], "job-3");
        assert_eq!(llm["replica_jobs"][1]["job"], Value::Null);
        assert_eq!(llm["events"], json!([]));
        assert_eq!(fake.tokens.lock().unwrap().last().unwrap(), TOKEN);
    }

    #[tokio::test]
    async fn one_service_has_its_replicas_jobs_as_the_jobs_page_shows_them() {
        let (mut app, fake) = app().await;
        fake.add_service("llm", 2, 1);
        let (status, v) = call(
            &mut app,
            request("GET", "/api/services/llm", Some(TOKEN), None),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert_eq!(
            (&v["id"], &v["tenant"]),
            (&json!("svc-1"), &json!("team-a"))
        );
        assert_eq!(v["template"]["command"], json!(["python", "-m", "server"]));
        let svc = fake.services.lock().unwrap()[0].clone();
        for (i, r) in svc.replica_jobs.iter().enumerate() {
            let want = serde_json::to_value(json::JobJson::from(r.job.as_ref().unwrap())).unwrap();
            assert_eq!(v["replica_jobs"][i]["job"], want);
            assert_eq!(v["replica_jobs"][i]["index"], i);
        }
        let running = &v["replica_jobs"][0]["job"];
        assert_eq!(
            (&running["state"], &running["retries"]),
            (&json!("RUNNING"), &json!(2))
        );
        assert_eq!(running["tasks"][0]["agent_id"], "agent-1");
        assert_eq!(v["replica_jobs"][1]["job"]["state"], "QUEUED");
        assert_eq!(v["events"][0]["reason"], "Created");
        // Another tenant's service, or none: the master's NOT_FOUND.
        let (status, v) = call(
            &mut app,
            request("GET", "/api/services/gone", Some(TOKEN), None),
        )
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(v, json!({ "error": "service \"gone\" not found" }));
        let (status, v) = call(
            &mut app,
            request("GET", "/api/services/llm/nothing", Some(TOKEN), None),
        )
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(v["error"], "no such API call");
    }

    #[tokio::test]
    async fn scale_sets_the_replicas_and_answers_the_service() {
        let (mut app, fake) = app().await;
        fake.add_service("llm", 3, 3);
        let scale =
            |body: &str| request("POST", "/api/services/llm/scale", Some(TOKEN), Some(body));
        let (status, v) = call(&mut app, scale(r#"{"replicas": 5}"#)).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert_eq!((&v["replicas"], &v["running"]), (&json!(5), &json!(3)));
        assert_eq!(v["replica_jobs"].as_array().unwrap().len(), 5);
        assert_eq!(v["replica_jobs"][4]["job"]["state"], "QUEUED");
        let (status, v) = call(&mut app, scale(r#"{"replicas": 1}"#)).await;
        assert_eq!((status, &v["replicas"]), (StatusCode::OK, &json!(1)));
        assert_eq!(fake.services.lock().unwrap()[0].replicas, 1);
        // The master's own check, naming the field.
        let (status, v) = call(&mut app, scale(r#"{"replicas": 5000}"#)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(v["error"], "invalid replicas: is 5000: at most 1024");
        let (status, v) = call(
            &mut app,
            request(
                "POST",
                "/api/services/gone/scale",
                Some(TOKEN),
                Some(r#"{"replicas": 2}"#),
            ),
        )
        .await;
        assert_eq!(
            (status, &v["error"]),
            (StatusCode::NOT_FOUND, &json!("service \"gone\" not found"))
        );
    }

    #[tokio::test]
    async fn a_bad_scale_body_is_refused_naming_the_field_before_any_call() {
        let (mut app, fake) = app().await;
        fake.add_service("llm", 1, 0);
        for (body, says) in [
            (r#"{"replicas": "two"}"#, "invalid type: string \"two\""),
            (r#"{"replicas": -1}"#, "invalid value: integer `-1`"),
            (r#"{"replica": 2}"#, "unknown field `replica`"),
            ("{}", "missing field `replicas`"),
            ("not json", "expected"),
        ] {
            let req = request("POST", "/api/services/llm/scale", Some(TOKEN), Some(body));
            let (status, v) = call(&mut app, req).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {v}");
            let e = v["error"].as_str().unwrap();
            assert!(
                e.starts_with("replicas: ") && e.contains(says),
                "{body}: {e}"
            );
        }
        assert!(fake.tokens.lock().unwrap().is_empty(), "no call was made");
        assert_eq!(fake.services.lock().unwrap()[0].replicas, 1);
        // Not JSON at all: refused by the console's checks, as a job's.
        let req = axum::http::Request::post("/api/services/llm/scale")
            .header(axum::http::header::HOST, "127.0.0.1:8080")
            .header(axum::http::header::CONTENT_TYPE, "text/plain")
            .body(axum::body::Body::from(r#"{"replicas": 2}"#))
            .unwrap();
        let (status, _) = call(&mut app, req).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }

    #[tokio::test]
    async fn delete_answers_the_replicas_jobs_and_the_name_is_gone() {
        let (mut app, fake) = app().await;
        fake.add_service("llm", 2, 1);
        let delete = || request("POST", "/api/services/llm/delete", Some(TOKEN), Some("{}"));
        let (status, v) = call(&mut app, delete()).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert_eq!(v, json!({ "job_ids": ["job-1", "job-2"] }));
        assert!(fake.services.lock().unwrap().is_empty());
        let (status, v) = call(&mut app, delete()).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(v["error"], "service \"llm\" not found");
        // Reads only: a GET of a change is no such call.
        let (status, _) = call(
            &mut app,
            request("GET", "/api/services/llm/delete", Some(TOKEN), None),
        )
        .await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    }

    #[tokio::test]
    async fn the_browsers_token_goes_with_each_call_and_a_refusal_is_401() {
        let (mut app, fake) = app().await;
        fake.add_service("llm", 1, 0);
        for (method, path, body) in [
            ("GET", "/api/services", None),
            ("GET", "/api/services/llm", None),
            (
                "POST",
                "/api/services/llm/scale",
                Some(r#"{"replicas": 2}"#),
            ),
            ("POST", "/api/services/llm/delete", Some("{}")),
        ] {
            let (status, v) = call(&mut app, request(method, path, None, body)).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{path}");
            assert_eq!(v["error"], "this cluster needs a token", "{path}");
            let (status, v) = call(
                &mut app,
                request(method, path, Some("Bearer gct_bad"), body),
            )
            .await;
            assert_eq!(
                (status, &v["error"]),
                (StatusCode::UNAUTHORIZED, &json!("unknown token"))
            );
        }
        assert_eq!(fake.tokens.lock().unwrap().len(), 8);
        assert_eq!(
            fake.services.lock().unwrap()[0].replicas,
            1,
            "nothing changed"
        );
    }

    #[test]
    fn a_change_that_may_have_been_applied_says_the_outcome_is_unknown() {
        let failed = |maybe_applied| CallError {
            status: tonic::Status::not_found("service \"llm\" not found"),
            addr: "m1:7050".into(),
            gave_up_after: None,
            maybe_applied,
        };
        let e = change_error(
            failed(true),
            "service llm may or may not have been deleted",
            "look",
        );
        assert_eq!(e.status(), StatusCode::NOT_FOUND);
        assert_eq!(
            e.to_string(),
            "the outcome is unknown: service llm may or may not have been deleted \
             (service \"llm\" not found); look"
        );
        let e = change_error(failed(false), "x", "y");
        assert_eq!(e.to_string(), "service \"llm\" not found");
    }

    #[test]
    fn the_scale_form_is_one_whole_number() {
        assert_eq!(
            parse_scale(br#"{"replicas": 0}"#).unwrap(),
            json::ScaleForm { replicas: 0 }
        );
        let e = parse_scale(br#"{"replicas": 1.5}"#).unwrap_err();
        assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST);
    }
}
