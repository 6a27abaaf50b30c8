//! `/v1/tokens` and `/v1/audit`: operator tokens managed by an admin
//! through the API (the same operations as `idem-server token …`), and the
//! audit trail. Access is decided by `crate::auth`, not here.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};
use uuid::Uuid;

use super::{audited, page_limit, ApiError, ApiJson};
use crate::app::AppState;
use crate::auth::{Actor, AuditNote, Role};
use crate::config::parse_duration;
use crate::input;
use crate::store;
use crate::store::access::{AuditFilter, NewToken};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TokenRequest {
    name: String,
    role: String,
    /// e.g. `30d`; no expiry when absent.
    expires_in: Option<String>,
}

/// Names are what the audit trail shows: short, printable, no spaces.
const MAX_TOKEN_NAME_BYTES: usize = 64;

fn check_name(name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_TOKEN_NAME_BYTES
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request(
            "invalid_token_name",
            format!("a token name is 1 to {MAX_TOKEN_NAME_BYTES} letters, digits, '-', '_' or '.'"),
        ))
    }
}

/// `POST /v1/tokens`: creates a token and shows its secret, once.
pub(super) async fn create_token(
    State(state): State<Arc<AppState>>,
    Extension(actor): Extension<Actor>,
    ApiJson(body): ApiJson<TokenRequest>,
) -> Result<Response, ApiError> {
    check_name(&body.name)?;
    let Some(role) = Role::parse(&body.role) else {
        return Err(ApiError::bad_request(
            "invalid_role",
            "role must be viewer, operator or admin",
        ));
    };
    let expires_at = match &body.expires_in {
        None => None,
        Some(raw) => {
            let duration =
                parse_duration(raw).map_err(|e| ApiError::bad_request("invalid_expiry", e))?;
            let duration = chrono::Duration::from_std(duration)
                .map_err(|_| ApiError::bad_request("invalid_expiry", "expiry is too far away"))?;
            Some(chrono::Utc::now() + duration)
        }
    };
    let generated = crate::auth::generate_token();
    let created = store::access::create_token(
        &state.pool,
        &NewToken {
            name: &body.name,
            role: role.as_str(),
            hash: &generated.hash,
            created_by: Some(&actor.name),
            expires_at,
        },
    )
    .await?;
    let Some(row) = created else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "token_exists",
            format!("a token named {:?} exists already", body.name),
        ));
    };
    tracing::info!(name = %row.name, role = %row.role, by = %actor.name, "token created");
    let note = AuditNote {
        detail: Some(json!({"name": row.name, "role": row.role, "expires_at": row.expires_at})),
        ..AuditNote::default()
    };
    Ok(audited(
        note,
        StatusCode::CREATED,
        json!({
            "id": row.id,
            "name": row.name,
            "role": row.role,
            "expires_at": row.expires_at,
            "token": generated.secret,
            "note": "store the token now: it is shown only once",
        }),
    ))
}

/// `GET /v1/tokens`: every token, without secrets.
pub(super) async fn list_tokens(
    State(state): State<Arc<AppState>>,
) -> Result<Json<Value>, ApiError> {
    let rows = store::access::list_tokens(&state.pool).await?;
    Ok(Json(json!({ "tokens": rows })))
}

/// `DELETE /v1/tokens/{name}`: revokes a token at once.
pub(super) async fn revoke_token(
    State(state): State<Arc<AppState>>,
    Extension(actor): Extension<Actor>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    check_name(&name)?;
    let Some(row) = store::access::revoke_token(&state.pool, &name).await? else {
        return Err(ApiError::not_found(
            "unknown_token",
            format!("no token is named {name:?}"),
        ));
    };
    tracing::info!(name = %row.name, by = %actor.name, "token revoked");
    let note = AuditNote {
        detail: Some(json!({"name": row.name})),
        ..AuditNote::default()
    };
    Ok(audited(
        note,
        StatusCode::OK,
        json!({"name": row.name, "revoked_at": row.revoked_at}),
    ))
}

#[derive(Debug, Deserialize)]
pub(super) struct AuditQuery {
    actor: Option<String>,
    run: Option<Uuid>,
    /// Records older than this id (the previous page's `next_before`).
    before: Option<i64>,
    limit: Option<i64>,
}

/// `GET /v1/audit`: mutating calls, newest first.
pub(super) async fn list_audit(
    State(state): State<Arc<AppState>>,
    Query(query): Query<AuditQuery>,
) -> Result<Json<Value>, ApiError> {
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
    let next = (rows.len() as i64 == limit)
        .then(|| rows.last().map(|r| r.id))
        .flatten();
    Ok(Json(json!({ "entries": rows, "next_before": next })))
}
