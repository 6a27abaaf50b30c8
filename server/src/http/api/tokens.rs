//! `/v1/tokens`: operator tokens managed by an admin through the API (the
//! same operations as `idem-server token …`). Access is decided by
//! `crate::http::auth`, not here.

use idem_protocol::api::{bounds, ErrorCode};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::{Extension, Json};
use idem_protocol::api::{
    ErrorBody, TokenCreated, TokenList, TokenRequest, TokenRevoked, TokenView,
};
use serde_json::json;

use super::command::recorded;
use crate::config::parse_expiry;
use crate::http::auth::{AuditNote, Call, Role};
use crate::http::error::ApiError;
use crate::http::extract::{ApiJson, ApiPath};
use crate::http::state::AppState;
use crate::store::access::{NewToken, TokenRow};
use crate::store::{self, Context};

/// Names are what the audit trail shows: short, printable, no spaces.
fn check_name(name: &str) -> Result<(), ApiError> {
    if bounds::is_token_name(name) {
        Ok(())
    } else {
        Err(ApiError::bad_request(
            ErrorCode::InvalidTokenName,
            format!(
                "a token name is 1 to {} letters, digits, '-', '_' or '.'",
                bounds::MAX_TOKEN_NAME_CHARS
            ),
        ))
    }
}

/// `POST /v1/tokens`: creates a token and shows its secret, once.
#[utoipa::path(post, path = "/v1/tokens", tag = "tokens", request_body = TokenRequest,
    responses((status = 201, body = TokenCreated), (status = "4XX", body = ErrorBody)))]
pub(super) async fn create_token(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiJson(body): ApiJson<TokenRequest>,
) -> Result<Response, ApiError> {
    check_name(&body.name)?;
    let Some(role) = Role::parse(&body.role) else {
        return Err(ApiError::bad_request(
            ErrorCode::InvalidRole,
            "role must be viewer, operator or admin",
        ));
    };
    let expires_at = match &body.expires_in {
        None => None,
        Some(raw) if !bounds::is_token_lifetime(raw) => {
            return Err(ApiError::bad_request(
                ErrorCode::InvalidExpiry,
                format!("{raw:?} is not a token lifetime: up to six digits and a unit (ms, s, m, h or d), e.g. 30d"),
            ))
        }
        Some(raw) => {
            let expires_at = parse_expiry(raw, chrono::Utc::now())
                .map_err(|e| ApiError::bad_request(ErrorCode::InvalidExpiry, e))?;
            Some(expires_at)
        }
    };
    let generated = crate::http::auth::generate_token();
    let mut tx = state.pool.begin().await.context("starting a transaction")?;
    let created = store::access::create_token(
        &mut *tx,
        &NewToken {
            name: &body.name,
            role: role.as_str(),
            hash: &generated.hash,
            created_by: Some(&call.actor.name),
            expires_at,
        },
    )
    .await?;
    let Some(row) = created else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::TokenExists,
            format!("a token named {:?} exists already", body.name),
        ));
    };
    let note = AuditNote {
        detail: Some(json!({"name": row.name, "role": row.role, "expires_at": row.expires_at})),
        ..AuditNote::default()
    };
    store::access::record_audit(&mut *tx, &call.audit(StatusCode::CREATED, note)).await?;
    tx.commit().await.context("committing a token")?;
    tracing::info!(name = %row.name, role = %row.role, by = %call.actor.name, "token created");
    Ok(recorded(
        StatusCode::CREATED,
        TokenCreated {
            id: row.id,
            name: row.name,
            role: row.role,
            expires_at: row.expires_at,
            token: generated.secret,
            note: "store the token now: it is shown only once".to_owned(),
        },
    ))
}

/// `GET /v1/tokens`: every token, without secrets.
#[utoipa::path(get, path = "/v1/tokens", tag = "tokens",
    responses((status = 200, body = TokenList), (status = "4XX", body = ErrorBody)))]
pub(super) async fn list_tokens(
    State(state): State<Arc<AppState>>,
) -> Result<Json<TokenList>, ApiError> {
    let rows = store::access::list_tokens(&state.pool).await?;
    let tokens = rows.into_iter().map(token_view).collect();
    Ok(Json(TokenList { tokens }))
}

fn token_view(row: TokenRow) -> TokenView {
    TokenView {
        id: row.id,
        name: row.name,
        role: row.role,
        created_at: row.created_at,
        created_by: row.created_by,
        expires_at: row.expires_at,
        revoked_at: row.revoked_at,
    }
}

/// `DELETE /v1/tokens/{name}`: revokes a token at once.
#[utoipa::path(delete, path = "/v1/tokens/{name}", tag = "tokens",
    params(("name" = inline(idem_protocol::api::bounds::schema::TokenName), Path, description = "token name")),
    responses((status = 200, body = TokenRevoked), (status = "4XX", body = ErrorBody)))]
pub(super) async fn revoke_token(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(name): ApiPath<String>,
) -> Result<Response, ApiError> {
    check_name(&name)?;
    let mut tx = state.pool.begin().await.context("starting a transaction")?;
    let Some(row) = store::access::revoke_token(&mut *tx, &name).await? else {
        return Err(ApiError::not_found(
            ErrorCode::UnknownToken,
            format!("no token is named {name:?}"),
        ));
    };
    let note = AuditNote {
        detail: Some(json!({"name": row.name})),
        ..AuditNote::default()
    };
    store::access::record_audit(&mut *tx, &call.audit(StatusCode::OK, note)).await?;
    tx.commit().await.context("committing a revocation")?;
    tracing::info!(name = %row.name, by = %call.actor.name, "token revoked");
    Ok(recorded(
        StatusCode::OK,
        TokenRevoked {
            name: row.name,
            revoked_at: row.revoked_at,
        },
    ))
}
