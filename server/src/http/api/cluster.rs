//! `GET /v1/cluster`: the server instances sharing this database, read
//! from their claims (`store::instances`), and the leases they hold
//! (`store::leases`).

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use idem_protocol::api::{ClusterInstance, ClusterLease, ClusterView, ErrorBody};

use crate::http::error::ApiError;
use crate::http::state::AppState;
use crate::store;

/// Seconds or milliseconds as the API gives them: whole, never negative.
fn whole(value: f64) -> u64 {
    if value.is_finite() && value > 0.0 {
        // Truncation is the intent; the value is finite and positive.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let whole = value as u64;
        whole
    } else {
        0
    }
}

/// `GET /v1/cluster`.
#[utoipa::path(get, path = "/v1/cluster", tag = "operations",
    responses((status = 200, body = ClusterView), (status = "4XX", body = ErrorBody)))]
pub(super) async fn cluster(
    State(state): State<Arc<AppState>>,
) -> Result<Json<ClusterView>, ApiError> {
    let rows = store::instances::all(&state.pool).await?;
    let instances = rows
        .into_iter()
        .map(|row| {
            let lease_ms = u64::try_from(row.holder.lease.as_millis()).unwrap_or(u64::MAX);
            let heartbeat_age_ms = whole(row.holder.heartbeat_age_secs * 1000.0);
            ClusterInstance {
                name: row.name,
                host: row.holder.host,
                pid: row.holder.pid,
                live: heartbeat_age_ms < lease_ms,
                heartbeat_age_ms,
                lease_ms,
                uptime_s: whole(row.holder.age_secs),
                drained_by: row.holder.drained_by,
            }
        })
        .collect();
    let leases = store::leases::all(&state.pool)
        .await?
        .into_iter()
        .map(|lease| {
            let ttl_ms = u64::try_from(lease.ttl.as_millis()).unwrap_or(u64::MAX);
            let renewed_age_ms = lease.renewed_age_secs.map(|secs| whole(secs * 1000.0));
            ClusterLease {
                name: lease.name,
                holder: lease.holder,
                epoch: lease.epoch,
                live: renewed_age_ms.is_some_and(|age| age < ttl_ms),
                renewed_age_ms,
                ttl_ms,
            }
        })
        .collect();
    Ok(Json(ClusterView {
        instance: state.config.fleet.instance.clone(),
        instances,
        leases,
    }))
}
