//! Operator tokens (stored as SHA-256 hashes, never in clear) and the audit
//! trail of mutating API calls.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgExecutor, PgPool};
use uuid::Uuid;

use super::{Context, StoreError};

/// One token as stored; the hash is never read back out.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct TokenRow {
    pub id: Uuid,
    pub name: String,
    pub role: String,
    pub created_at: DateTime<Utc>,
    pub created_by: Option<String>,
    pub expires_at: Option<DateTime<Utc>>,
    pub revoked_at: Option<DateTime<Utc>>,
}

const TOKEN_COLUMNS: &str = "id, name, role, created_at, created_by, expires_at, revoked_at";

/// A token to create.
#[derive(Debug, Clone)]
pub struct NewToken<'a> {
    pub name: &'a str,
    pub role: &'a str,
    pub hash: &'a [u8],
    pub created_by: Option<&'a str>,
    pub expires_at: Option<DateTime<Utc>>,
}

/// Creates a token; `None` when the name is taken.
pub async fn create_token<'e>(
    executor: impl PgExecutor<'e>,
    token: &NewToken<'_>,
) -> Result<Option<TokenRow>, StoreError> {
    sqlx::query_as(&format!(
        "INSERT INTO api_tokens (id, name, role, token_hash, created_by, expires_at) \
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (name) DO NOTHING \
         RETURNING {TOKEN_COLUMNS}"
    ))
    .bind(Uuid::now_v7())
    .bind(token.name)
    .bind(token.role)
    .bind(token.hash)
    .bind(token.created_by)
    .bind(token.expires_at)
    .fetch_optional(executor)
    .await
    .context("creating a token")
}

/// The token with this hash, revoked or expired ones included.
pub async fn token_by_hash(pool: &PgPool, hash: &[u8]) -> Result<Option<TokenRow>, StoreError> {
    sqlx::query_as(&format!(
        "SELECT {TOKEN_COLUMNS} FROM api_tokens WHERE token_hash = $1"
    ))
    .bind(hash)
    .fetch_optional(pool)
    .await
    .context("looking up a token")
}

/// Every token, oldest first.
pub async fn list_tokens(pool: &PgPool) -> Result<Vec<TokenRow>, StoreError> {
    sqlx::query_as(&format!(
        "SELECT {TOKEN_COLUMNS} FROM api_tokens ORDER BY created_at, name"
    ))
    .fetch_all(pool)
    .await
    .context("listing tokens")
}

/// Revokes the token called `name`; `None` when there is none, the row
/// (with its first revocation time) otherwise.
pub async fn revoke_token<'e>(
    executor: impl PgExecutor<'e>,
    name: &str,
) -> Result<Option<TokenRow>, StoreError> {
    sqlx::query_as(&format!(
        "UPDATE api_tokens SET revoked_at = COALESCE(revoked_at, now()) WHERE name = $1 \
         RETURNING {TOKEN_COLUMNS}"
    ))
    .bind(name)
    .fetch_optional(executor)
    .await
    .context("revoking a token")
}

/// One mutating API call, as recorded.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct AuditRow {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub actor: String,
    pub role: String,
    pub method: String,
    pub route: String,
    pub path: String,
    pub status: i32,
    pub targets: Option<i32>,
    pub generation: Option<i64>,
    pub run_id: Option<Uuid>,
    pub detail: Option<Value>,
}

/// An audit record to write: who called what, how it was answered and
/// what it changed.
#[derive(Debug, Clone)]
pub struct AuditRecord {
    pub actor: String,
    pub role: String,
    pub method: String,
    pub route: String,
    pub path: String,
    pub status: u16,
    pub targets: Option<usize>,
    pub generation: Option<idem_protocol::Generation>,
    pub run_id: Option<Uuid>,
    pub detail: Option<Value>,
}

/// Writes `audit` through `executor`: the pool, or the transaction of the
/// change it records (so the change never commits without it).
pub async fn record_audit<'e>(
    executor: impl PgExecutor<'e>,
    audit: &AuditRecord,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO audit_log (actor, role, method, route, path, status, targets, generation, run_id, detail) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(&audit.actor)
    .bind(&audit.role)
    .bind(&audit.method)
    .bind(&audit.route)
    .bind(&audit.path)
    .bind(i32::from(audit.status))
    .bind(audit.targets.map(|n| i32::try_from(n).unwrap_or(i32::MAX)))
    .bind(audit.generation.map(super::stored_generation))
    .bind(audit.run_id)
    .bind(&audit.detail)
    .execute(executor)
    .await
    .context("writing the audit trail")?;
    Ok(())
}

/// Filters for the paged audit list (newest first).
#[derive(Debug, Clone, Default)]
pub struct AuditFilter {
    pub actor: Option<String>,
    pub run_id: Option<Uuid>,
    /// Keyset cursor: records older than this id.
    pub before: Option<i64>,
    pub limit: i64,
}

pub async fn list_audit(pool: &PgPool, filter: &AuditFilter) -> Result<Vec<AuditRow>, StoreError> {
    sqlx::query_as(
        "SELECT id, at, actor, role, method, route, path, status, targets, generation, run_id, detail \
         FROM audit_log \
         WHERE ($1::text IS NULL OR actor = $1) AND ($2::uuid IS NULL OR run_id = $2) \
           AND ($3::int8 IS NULL OR id < $3) \
         ORDER BY id DESC LIMIT $4",
    )
    .bind(&filter.actor)
    .bind(filter.run_id)
    .bind(filter.before)
    .bind(filter.limit)
    .fetch_all(pool)
    .await
    .context("listing the audit trail")
}

/// Deletes audit records older than `max_age`. Returns how many.
pub async fn prune_audit(pool: &PgPool, max_age: std::time::Duration) -> Result<u64, StoreError> {
    let max_age = chrono::Duration::from_std(max_age).unwrap_or(chrono::Duration::MAX);
    let cutoff = Utc::now()
        .checked_sub_signed(max_age)
        .unwrap_or(DateTime::<Utc>::MIN_UTC);
    let deleted = sqlx::query("DELETE FROM audit_log WHERE at < $1")
        .bind(cutoff)
        .execute(pool)
        .await
        .context("pruning the audit trail")?
        .rows_affected();
    Ok(deleted)
}
