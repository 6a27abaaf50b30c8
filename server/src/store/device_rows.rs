//! Device rows as the fleet cache holds them: the row type and its columns,
//! reading rows whole or by the columns another writer changed (what a
//! catch-up reads under the device writer), and turning rows into cache
//! entries.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use std::collections::HashMap;
use std::sync::Arc;

use idem_protocol::{DeviceId, DeviceStatus, Health, OutcomeKind, SpecDigest};

use super::cache::FollowedReport;
use super::{generation, to_u64, Context, StoreError};
use crate::reconcile::change::DeviceChange;
use crate::reconcile::decide::ReportedState;
use crate::reconcile::device::{DesiredState, DeviceEntry};
use crate::reconcile::owned::{convergence_digest, OwnedFields, OwnedResolver};

/// One device as stored, for loading the cache and for the API.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct DeviceRow {
    pub id: String,
    pub labels: Value,
    pub desired_spec: Option<Value>,
    pub desired_generation: i64,
    pub desired_digest: Option<String>,
    pub desired_at: Option<DateTime<Utc>>,
    pub reported_spec: Option<Value>,
    pub reported_digest: Option<String>,
    pub reported_seq: Option<i64>,
    pub reported_generation: Option<i64>,
    pub reported_error_generation: Option<i64>,
    pub reported_error: Option<String>,
    pub reported_health: Option<Health>,
    pub reported_at: Option<DateTime<Utc>>,
    pub status: DeviceStatus,
    pub online: Option<bool>,
    pub attempts: i32,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub last_outcome: Option<OutcomeKind>,
    pub last_outcome_reason: Option<String>,
    pub last_run_id: Option<Uuid>,
    pub retained_generation: Option<i64>,
    pub updated_at: DateTime<Utc>,
}

pub(super) const DEVICE_COLUMNS: &str =
    "id, labels, desired_spec, desired_generation, desired_digest, desired_at, \
    reported_spec, reported_digest, reported_seq, reported_generation, reported_error_generation, \
    reported_error, reported_health, reported_at, status, online, attempts, next_attempt_at, \
    last_error, last_outcome, last_outcome_reason, last_run_id, retained_generation, updated_at";

/// The cache's entry of every row, owning what `owned` resolves for its
/// labels; desired specs shared by many devices are held once. A row whose
/// id breaks the id rules (a hand edit) is an error naming it: the server
/// does not start on a table it cannot mirror.
pub fn cache_entries(
    rows: &[DeviceRow],
    owned: &mut OwnedResolver,
) -> Result<Vec<(DeviceId, DeviceEntry)>, StoreError> {
    let mut specs = HashMap::new();
    rows.iter()
        .map(|row| {
            let id = super::device_id(&row.id, "loading the fleet cache")?;
            Ok((
                id,
                entry_from_row(row, &mut specs, owned.for_labels(&row.labels)),
            ))
        })
        .collect()
}

/// `specs` interns desired specs by digest, so a fleet sharing one
/// desired spec holds it once.
fn entry_from_row(
    row: &DeviceRow,
    specs: &mut HashMap<SpecDigest, Arc<Value>>,
    owned: Option<Arc<OwnedFields>>,
) -> DeviceEntry {
    let desired = match (&row.desired_spec, &row.desired_digest) {
        (Some(spec), Some(stored)) if row.desired_generation > 0 => {
            let digest = stored_digest(stored, spec);
            let spec = specs
                .entry(digest)
                .or_insert_with(|| Arc::new(spec.clone()))
                .clone();
            Some(DesiredState::new(
                generation(row.desired_generation),
                digest,
                spec,
                owned.as_deref(),
            ))
        }
        _ => None,
    };
    let reported = match (&row.reported_digest, row.reported_seq) {
        (Some(stored), Some(seq)) => Some(ReportedState {
            seq: to_u64(seq),
            digest: match &row.reported_spec {
                Some(spec) => {
                    convergence_digest(spec, stored_digest(stored, spec), owned.as_deref())
                }
                None => SpecDigest::parse(stored).unwrap_or_else(|_| SpecDigest::of(&Value::Null)),
            },
            generation: row.reported_generation.map(generation),
            rejection: match (row.reported_error_generation, &row.reported_error) {
                (Some(g), Some(msg)) => Some((generation(g), msg.clone())),
                _ => None,
            },
            drift: None,
        }),
        _ => None,
    };
    DeviceEntry {
        desired,
        reported,
        reported_at: row.reported_at,
        health: row.reported_health,
        online: row.online,
        status: row.status,
        failures: u32::try_from(row.attempts).unwrap_or(0),
        retained_generation: row.retained_generation.map(generation),
        // Set from the exemptions table (`store::exemptions`), not the row.
        exempt: false,
        owned,
    }
}

/// A stored digest, or the spec's digest recomputed if the stored text is
/// not a digest (a hand edit): the spec is the truth.
fn stored_digest(stored: &str, spec: &Value) -> SpecDigest {
    SpecDigest::parse(stored).unwrap_or_else(|_| SpecDigest::of(spec))
}

pub async fn load_all(pool: &PgPool) -> Result<Vec<DeviceRow>, StoreError> {
    sqlx::query_as(&format!("SELECT {DEVICE_COLUMNS} FROM devices"))
        .fetch_all(pool)
        .await
        .context("loading all devices")
}

/// The rows of `ids` that exist, read in `tx`.
pub async fn rows_of(
    tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
    ids: &[DeviceId],
) -> Result<Vec<DeviceRow>, StoreError> {
    let ids = super::raw_ids(ids);
    sqlx::query_as(&format!(
        "SELECT {DEVICE_COLUMNS} FROM devices WHERE id = ANY($1)"
    ))
    .bind(&ids)
    .fetch_all(&mut **tx)
    .await
    .context("reading devices other writers changed")
}

/// The engine's columns of `ids` as the cache holds them (status, failed
/// attempts, retained generation), as engine changes, read in `tx`.
pub async fn engine_columns_of(
    tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
    ids: &[DeviceId],
) -> Result<Vec<(DeviceId, DeviceChange)>, StoreError> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let raw = super::raw_ids(ids);
    let rows: Vec<(String, DeviceStatus, i32, Option<i64>)> = sqlx::query_as(
        "SELECT id, status, attempts, retained_generation FROM devices WHERE id = ANY($1)",
    )
    .bind(&raw)
    .fetch_all(&mut **tx)
    .await
    .context("reading the engine columns other writers changed")?;
    rows.into_iter()
        .map(|(id, status, attempts, retained)| {
            let id = super::device_id(&id, "reading the engine columns other writers changed")?;
            Ok((
                id,
                DeviceChange {
                    status: Some(status),
                    failures: Some((u32::try_from(attempts).unwrap_or(0), None)),
                    retained: retained.map(generation),
                    ..DeviceChange::default()
                },
            ))
        })
        .collect()
}

/// The reported columns of a row (`reported_columns_of`).
#[derive(sqlx::FromRow)]
struct ReportedColumns {
    id: String,
    reported_digest: Option<String>,
    reported_seq: Option<i64>,
    reported_generation: Option<i64>,
    reported_error_generation: Option<i64>,
    reported_error: Option<String>,
    reported_health: Option<Health>,
    reported_at: Option<DateTime<Utc>>,
    online: Option<bool>,
}

/// The reported columns and connection state of `ids` as the cache holds
/// them, for devices that own no fields (their convergence digest is the
/// stored digest), read in `tx`; the second list names the rows whose
/// stored digest is not one (a hand edit), to be read whole.
pub async fn reported_columns_of(
    tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
    ids: &[DeviceId],
) -> Result<(Vec<(DeviceId, FollowedReport)>, Vec<DeviceId>), StoreError> {
    if ids.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    let context = "reading the reports other writers stored";
    let raw = super::raw_ids(ids);
    let rows: Vec<ReportedColumns> = sqlx::query_as(
        "SELECT id, reported_digest, reported_seq, reported_generation, \
             reported_error_generation, reported_error, reported_health, reported_at, online \
         FROM devices WHERE id = ANY($1)",
    )
    .bind(&raw)
    .fetch_all(&mut **tx)
    .await
    .context(context)?;
    let mut followed = Vec::with_capacity(rows.len());
    let mut whole = Vec::new();
    for row in rows {
        let id = super::device_id(&row.id, context)?;
        let reported = match (&row.reported_digest, row.reported_seq) {
            (Some(stored), Some(seq)) => {
                let Ok(digest) = SpecDigest::parse(stored) else {
                    whole.push(id);
                    continue;
                };
                Some(ReportedState {
                    seq: to_u64(seq),
                    digest,
                    generation: row.reported_generation.map(generation),
                    rejection: match (row.reported_error_generation, row.reported_error) {
                        (Some(g), Some(msg)) => Some((generation(g), msg)),
                        _ => None,
                    },
                    drift: None,
                })
            }
            _ => None,
        };
        followed.push((
            id,
            FollowedReport {
                reported,
                reported_at: row.reported_at,
                health: row.reported_health,
                online: row.online,
            },
        ));
    }
    Ok((followed, whole))
}

/// Every row, read in `tx`.
pub async fn load_all_in(
    tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
) -> Result<Vec<DeviceRow>, StoreError> {
    sqlx::query_as(&format!("SELECT {DEVICE_COLUMNS} FROM devices"))
        .fetch_all(&mut **tx)
        .await
        .context("reloading every device")
}
