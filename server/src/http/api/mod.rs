//! HTTP API (axum, JSON): the operator's surface, one module per resource.
//! `routes` is the one route table (handler, method, path and the access it
//! needs); the router, the role check and the OpenAPI document come from it.
//! Handlers
//! validate input, call the store and go through [`command`] for writes
//! and runs; they hold no reconciliation logic. Request and answer bodies
//! are `idem_protocol::api`; errors are `crate::http::error::ApiError`.

use std::sync::Arc;

use axum::Router;

use crate::http::auth::AuthState;
use crate::http::state::AppState;

mod approvals;
mod audit;
mod cluster;
mod command;
mod credentials;
mod desired;
mod devices;
mod exemptions;
mod fleet;
pub mod openapi;
mod ops;
mod owned;
mod params;
mod plans;
mod rollouts;
mod routes;
mod runs;
mod tokens;

pub use routes::routes;

/// The API: the route table's router, behind the auth middleware, with
/// the JSON answers for paths and methods no route has.
pub fn router(state: Arc<AppState>) -> Router {
    let api = routes::build(state.auth);
    let auth = AuthState {
        pool: state.pool.clone(),
        settings: state.auth,
        metrics: state.metrics.clone(),
        routes: api.routes.clone().into(),
    };
    api.serving_its_document()
        .fallback(ops::not_found)
        .method_not_allowed_fallback(ops::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            auth,
            crate::http::auth::authorize,
        ))
        .with_state(state)
}
