//! `GET /v1/fleet`: devices per status and the engine's live numbers.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use idem_protocol::api::{ErrorBody, FleetSummary, PushCounts};
use idem_protocol::DeviceStatus;

use crate::http::error::ApiError;
use crate::http::state::AppState;
use crate::store;
use crate::store::to_u64;

/// `GET /v1/fleet`.
#[utoipa::path(get, path = "/v1/fleet", tag = "fleet",
    responses((status = 200, body = FleetSummary), (status = "4XX", body = ErrorBody)))]
pub(super) async fn fleet_summary(
    State(state): State<Arc<AppState>>,
) -> Result<Json<FleetSummary>, ApiError> {
    let counts = store::devices::count_by_status(&state.pool).await?;
    let mut by_status: BTreeMap<String, u64> = DeviceStatus::ALL
        .iter()
        .map(|s| (s.as_str().to_owned(), 0))
        .collect();
    let mut devices = 0;
    for &(status, n) in &counts {
        let n = to_u64(n);
        if let Some(slot) = by_status.get_mut(status.as_str()) {
            *slot = n;
        }
        devices += n;
    }
    let unhealthy_converged = to_u64(store::devices::count_unhealthy_converged(&state.pool).await?);
    let stats = &state.engine_stats;
    Ok(Json(FleetSummary {
        devices,
        by_status,
        unhealthy_converged,
        pushes: PushCounts {
            queued: stats.queued_pushes.load(Ordering::Relaxed),
            in_flight: stats.pushes_in_flight.load(Ordering::Relaxed),
        },
        attempts_in_flight: stats.attempts_in_flight.load(Ordering::Relaxed),
    }))
}
