//! Operations endpoints: `/metrics`, `/healthz`, `/readyz`, and the answer
//! to a path that is no endpoint.

use idem_protocol::api::ErrorCode;
use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use idem_protocol::api::{ErrorBody, Liveness, Readiness};

use crate::http::error::ApiError;
use crate::http::state::AppState;
use crate::store;

/// How long readiness waits for the database before saying not ready.
const READINESS_DB_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// `GET /metrics`: Prometheus text.
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, content_type = "text/plain", body = String, description = "Prometheus text format 0.0.4"),
        (status = "4XX", body = ErrorBody)))]
pub(super) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

/// `GET /healthz`: the process answers.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, body = Liveness)))]
pub(super) async fn healthz() -> Json<Liveness> {
    Json(Liveness {
        status: "ok".to_owned(),
    })
}

/// Ready when the database answers, the broker connection is subscribed,
/// and neither the ingest nor the engine has been failing to commit for
/// longer than [`crate::ops::stall::STUCK_AFTER`] (a worker can be stuck while a
/// plain `SELECT 1` still succeeds).
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses((status = 200, body = Readiness), (status = 503, body = Readiness)))]
pub(super) async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    let ping = tokio::time::timeout(READINESS_DB_TIMEOUT, store::ping(&state.pool)).await;
    let database = matches!(ping, Ok(Ok(())));
    let mqtt = state.mqtt.is_ready();
    let now = std::time::Instant::now();
    let mut stuck: BTreeMap<String, String> = [
        ("ingest", state.stalls.ingest.stuck_for(now)),
        ("engine", state.stalls.engine.stuck_for(now)),
    ]
    .into_iter()
    .filter_map(|(worker, stuck)| {
        stuck.map(|d| {
            (
                worker.to_owned(),
                format!(
                    "no write committed for {} s while work waits (see the server log)",
                    d.as_secs()
                ),
            )
        })
    })
    .collect();
    let backlog = state.intake.backlog(now);
    if backlog.oldest > state.config.readiness.max_intake_age {
        stuck.insert(
            "intake".to_owned(),
            format!(
                "{} received messages ({} bytes) wait for the ingest, the oldest for {} s (more than --ready-max-intake-age)",
                backlog.messages,
                backlog.bytes,
                backlog.oldest.as_secs()
            ),
        );
    }
    let ready = database && mqtt && stuck.is_empty();
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let answer = Readiness {
        ready,
        database,
        mqtt,
        stuck,
        owns: [
            (&state.engine_held, crate::engine::seat::ENGINE_LEASE),
            (&state.relay_held, crate::events::relay::RELAY_LEASE),
        ]
        .into_iter()
        .filter(|(held, _)| held.load(std::sync::atomic::Ordering::Relaxed))
        .map(|(_, lease)| lease.to_owned())
        .collect(),
    };
    (status, Json(answer)).into_response()
}

pub(super) async fn not_found() -> ApiError {
    ApiError::not_found(
        ErrorCode::NotFound,
        "no such endpoint; see README.md for the API",
    )
}

/// A known path with a method it does not have; axum adds the `Allow`
/// header listing those it has.
pub(super) async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        ErrorCode::MethodNotAllowed,
        "this path does not take this method; the Allow header lists those it takes",
    )
}
