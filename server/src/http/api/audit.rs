//! `GET /v1/audit`: the audit trail of mutating calls, for admins (access
//! is decided by `crate::http::auth`; the trail is written there too).

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use idem_protocol::api::{AuditEntry, AuditPage, AuditQuery, ErrorBody};

use super::params::page_limit;
use crate::http::error::ApiError;
use crate::http::extract::ApiQuery;
use crate::http::input;
use crate::http::state::AppState;
use crate::store;
use crate::store::access::{AuditFilter, AuditRow};

/// `GET /v1/audit`: mutating calls, newest first.
#[utoipa::path(get, path = "/v1/audit", tag = "audit", params(AuditQuery),
    responses((status = 200, body = AuditPage), (status = "4XX", body = ErrorBody)))]
pub(super) async fn list_audit(
    State(state): State<Arc<AppState>>,
    ApiQuery(query): ApiQuery<AuditQuery>,
) -> Result<Json<AuditPage>, ApiError> {
    if let Some(actor) = &query.actor {
        input::check_query_text("actor", actor)?;
    }
    let limit = page_limit(query.limit)?;
    let rows = store::access::list_audit(
        &state.pool,
        &AuditFilter {
            actor: query.actor,
            run_id: query.run,
            before: query.before,
            limit,
        },
    )
    .await?;
    let next_before = (rows.len() as i64 == limit)
        .then(|| rows.last().map(|r| r.id))
        .flatten();
    let entries = rows.into_iter().map(audit_entry).collect();
    Ok(Json(AuditPage {
        entries,
        next_before,
    }))
}

fn audit_entry(row: AuditRow) -> AuditEntry {
    AuditEntry {
        id: row.id,
        at: row.at,
        actor: row.actor,
        role: row.role,
        method: row.method,
        route: row.route,
        path: row.path,
        status: row.status,
        targets: row.targets,
        generation: row.generation,
        run_id: row.run_id,
        detail: row.detail,
    }
}
