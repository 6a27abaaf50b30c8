//! HTTP API (axum, JSON): the operator's surface. This module is the route
//! table's other half (`crate::http::auth::ROUTES` says who may call each route):
//! it maps each route to its handler, one module per resource. Handlers
//! validate input, call the store and go through [`command`] for writes
//! and runs; they hold no reconciliation logic. Request and answer bodies
//! are `idem_protocol::api`; errors are `crate::http::error::ApiError`.

use std::sync::Arc;

use axum::routing::{delete, get, post, put};
use axum::Router;

use crate::app::state::AppState;
use crate::http::auth::AuthState;
use crate::http::sse::SseState;

mod audit;
mod command;
mod credentials;
mod desired;
mod devices;
mod fleet;
pub mod openapi;
mod ops;
mod params;
mod runs;
mod tokens;

pub fn router(state: Arc<AppState>) -> Router {
    let auth = AuthState {
        pool: state.pool.clone(),
        settings: state.auth,
        metrics: state.metrics.clone(),
    };
    let sse = SseState {
        pool: state.pool.clone(),
        clients: state.sse.clone(),
        live_events: state.live_events.clone(),
        metrics: state.metrics.clone(),
    };
    Router::new()
        .route(
            "/v1/devices",
            post(devices::register_devices).get(devices::list_devices),
        )
        .route(
            "/v1/devices/{id}",
            put(devices::upsert_device)
                .get(devices::get_device)
                .delete(devices::delete_device),
        )
        .route("/v1/devices/{id}/reported", delete(devices::reset_reported))
        .route("/v1/devices/{id}/desired", put(desired::set_device_desired))
        .route("/v1/devices/{id}/retry", post(runs::retry_device))
        .route("/v1/devices/{id}/credentials", post(credentials::rotate))
        .route("/v1/desired", post(desired::set_desired_bulk))
        .route(
            "/v1/runs",
            post(runs::start_manual_run).get(runs::list_runs),
        )
        .route("/v1/runs/{id}", get(runs::get_run))
        .route("/v1/runs/{id}/outcomes", get(runs::run_outcomes))
        .route("/v1/runs/{id}/retry", post(runs::retry_run))
        .route("/v1/fleet", get(fleet::fleet_summary))
        .route("/v1/events", get(crate::http::sse::events).with_state(sse))
        .route(
            "/v1/tokens",
            get(tokens::list_tokens).post(tokens::create_token),
        )
        .route("/v1/tokens/{name}", delete(tokens::revoke_token))
        .route("/v1/audit", get(audit::list_audit))
        .route("/v1/openapi.json", get(openapi::openapi_json))
        .route("/metrics", get(ops::metrics))
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .fallback(ops::not_found)
        .layer(axum::middleware::from_fn_with_state(
            auth,
            crate::http::auth::authorize,
        ))
        .with_state(state)
}
