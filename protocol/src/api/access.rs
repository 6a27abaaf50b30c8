//! Bodies of `/v1/tokens…` and `/v1/audit`: operator tokens and the audit
//! trail.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

/// The body of `POST /v1/tokens`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TokenRequest {
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::api::bounds::schema::token_name))]
    pub name: String,
    /// `viewer`, `operator` or `admin`.
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::api::bounds::schema::token_role))]
    pub role: String,
    /// e.g. `30d`; no expiry when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::api::bounds::schema::token_lifetime))]
    pub expires_in: Option<String>,
}

/// The answer to `POST /v1/tokens`: the secret, shown once.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TokenCreated {
    pub id: Uuid,
    pub name: String,
    pub role: String,
    pub expires_at: Option<DateTime<Utc>>,
    pub token: String,
    pub note: String,
}

impl std::fmt::Debug for TokenCreated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenCreated({}, {}, ***)", self.name, self.role)
    }
}

/// A token without its secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TokenView {
    pub id: Uuid,
    pub name: String,
    pub role: String,
    pub created_at: DateTime<Utc>,
    pub created_by: Option<String>,
    pub expires_at: Option<DateTime<Utc>>,
    pub revoked_at: Option<DateTime<Utc>>,
}

/// `GET /v1/tokens`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TokenList {
    pub tokens: Vec<TokenView>,
}

/// The answer to `DELETE /v1/tokens/{name}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TokenRevoked {
    pub name: String,
    pub revoked_at: Option<DateTime<Utc>>,
}

/// One mutating API call, as the audit trail keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuditEntry {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub actor: String,
    pub role: String,
    pub method: String,
    /// The route's template, e.g. `/v1/devices/{id}`.
    pub route: String,
    pub path: String,
    pub status: i32,
    pub targets: Option<i32>,
    pub generation: Option<i64>,
    pub run_id: Option<Uuid>,
    /// What the call did, in the handler's words.
    pub detail: Option<Value>,
}

/// `GET /v1/audit`: newest first; `next_before` continues it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuditPage {
    pub entries: Vec<AuditEntry>,
    pub next_before: Option<i64>,
}

/// The query of `GET /v1/audit`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
pub struct AuditQuery {
    /// Only calls by this token name.
    #[cfg_attr(feature = "openapi", param(schema_with = crate::api::bounds::schema::query_text))]
    pub actor: Option<String>,
    /// Only calls about this run.
    pub run: Option<Uuid>,
    /// Records older than this id (the previous page's `next_before`).
    pub before: Option<i64>,
    #[cfg_attr(feature = "openapi", param(schema_with = crate::api::bounds::schema::page_limit))]
    pub limit: Option<i64>,
}
