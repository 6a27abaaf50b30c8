//! Device rows for the API and the device writer: reads by id, filter and
//! label; registration, desired state, accepted reports, status and the
//! engine's changes, written in a `DeviceTx`. How rows become cache entries
//! is `device_rows`.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use idem_protocol::{DeviceId, DeviceStatus, Generation, Health, OutcomeKind};

use super::device_rows::DEVICE_COLUMNS;
pub use super::device_rows::{load_all, DeviceRow};
use super::writer::DeviceTx;
use super::{generation, stored_generation, to_i64, Context, StoreError};
use crate::reconcile::machine::AttemptRecord;

pub async fn get(pool: &PgPool, id: &DeviceId) -> Result<Option<DeviceRow>, StoreError> {
    sqlx::query_as(&format!(
        "SELECT {DEVICE_COLUMNS} FROM devices WHERE id = $1"
    ))
    .bind(id.as_str())
    .fetch_optional(pool)
    .await
    .context("reading a device")
}

/// One device's last report as stored: its spec and seq.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct StoredReport {
    pub id: String,
    pub reported_spec: Option<Value>,
    pub reported_seq: Option<i64>,
}

/// The last report of each of `ids` that exists (for diffs).
pub async fn reports_of(pool: &PgPool, ids: &[DeviceId]) -> Result<Vec<StoredReport>, StoreError> {
    sqlx::query_as("SELECT id, reported_spec, reported_seq FROM devices WHERE id = ANY($1)")
        .bind(super::raw_ids(ids))
        .fetch_all(pool)
        .await
        .context("reading the last reports of devices")
}

/// Filters for the paged device list.
#[derive(Debug, Default, Clone)]
pub struct DeviceFilter {
    pub status: Option<DeviceStatus>,
    pub health: Option<Health>,
    /// Label subset the device must carry (`labels @> this`).
    pub labels: Option<Value>,
    /// Keyset cursor: ids strictly after this one.
    pub after: Option<String>,
    pub limit: i64,
}

pub async fn list(pool: &PgPool, filter: &DeviceFilter) -> Result<Vec<DeviceRow>, StoreError> {
    sqlx::query_as(&format!(
        "SELECT {DEVICE_COLUMNS} FROM devices \
         WHERE ($1::text IS NULL OR status = $1) \
           AND ($2::jsonb IS NULL OR labels @> $2) \
           AND ($3::text IS NULL OR id > $3) \
           AND ($5::text IS NULL OR reported_health = $5) \
         ORDER BY id LIMIT $4"
    ))
    .bind(filter.status)
    .bind(&filter.labels)
    .bind(&filter.after)
    .bind(filter.limit)
    .bind(filter.health)
    .fetch_all(pool)
    .await
    .context("listing devices")
}

/// Devices per status.
pub async fn count_by_status(pool: &PgPool) -> Result<Vec<(DeviceStatus, i64)>, StoreError> {
    sqlx::query_as("SELECT status, count(*) FROM devices GROUP BY status ORDER BY status")
        .fetch_all(pool)
        .await
        .context("counting devices by status")
}

/// Ids of the devices whose labels contain every pair of `labels`.
pub async fn ids_matching_labels(
    db: impl sqlx::PgExecutor<'_>,
    labels: &Value,
) -> Result<Vec<DeviceId>, StoreError> {
    const CONTEXT: &str = "selecting devices by labels";
    let ids: Vec<String> =
        sqlx::query_scalar("SELECT id FROM devices WHERE labels @> $1 ORDER BY id")
            .bind(labels)
            .fetch_all(db)
            .await
            .context(CONTEXT)?;
    super::device_ids(&ids, CONTEXT)
}

/// A device registration; `labels: None` keeps existing labels.
#[derive(Debug, Clone)]
pub struct Registration {
    pub id: DeviceId,
    pub labels: Option<Value>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RegistrationCounts {
    pub created: u64,
    pub updated: u64,
    pub unchanged: u64,
}

/// Upserts many devices in one statement; rows whose labels do not change are
/// not written.
pub async fn register(
    write: &mut DeviceTx<'_>,
    registrations: &[Registration],
) -> Result<RegistrationCounts, StoreError> {
    register_returning_new(write, registrations)
        .await
        .map(|(counts, _)| counts)
}

/// [`register`], also returning the ids of the devices that are new.
pub async fn register_returning_new(
    write: &mut DeviceTx<'_>,
    registrations: &[Registration],
) -> Result<(RegistrationCounts, Vec<DeviceId>), StoreError> {
    let tx = write.tx();
    let ids: Vec<&str> = registrations.iter().map(|r| r.id.as_str()).collect();
    let labels: Vec<Option<String>> = registrations
        .iter()
        .map(|r| r.labels.as_ref().map(Value::to_string))
        .collect();
    let created: Vec<String> = sqlx::query_scalar(
        "INSERT INTO devices (id, labels) \
         SELECT r.id, COALESCE(r.labels::jsonb, '{}'::jsonb) \
         FROM UNNEST($1::text[], $2::text[]) AS r(id, labels) \
         ON CONFLICT (id) DO NOTHING RETURNING id",
    )
    .bind(&ids)
    .bind(&labels)
    .fetch_all(&mut **tx)
    .await
    .context("registering new devices")?;
    let created_ids = super::device_ids(&created, "registering new devices")?;
    let created = created_ids.len() as u64;
    let updated = sqlx::query(
        "UPDATE devices d SET labels = r.labels::jsonb, updated_at = now() \
         FROM UNNEST($1::text[], $2::text[]) AS r(id, labels) \
         WHERE d.id = r.id AND r.labels IS NOT NULL AND d.labels IS DISTINCT FROM r.labels::jsonb",
    )
    .bind(&ids)
    .bind(&labels)
    .execute(&mut **tx)
    .await
    .context("updating device labels")?
    .rows_affected();
    let total = registrations.len() as u64;
    let counts = RegistrationCounts {
        created,
        updated,
        unchanged: total.saturating_sub(created + updated),
    };
    Ok((counts, created_ids))
}

/// Records the Mosquitto hashes of newly issued broker passwords.
pub async fn set_broker_password_hashes(
    write: &mut DeviceTx<'_>,
    hashes: &[(DeviceId, String)],
) -> Result<(), StoreError> {
    let tx = write.tx();
    if hashes.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = hashes.iter().map(|(id, _)| id.as_str()).collect();
    let values: Vec<&str> = hashes.iter().map(|(_, h)| h.as_str()).collect();
    sqlx::query(
        "UPDATE devices d SET broker_password_hash = r.hash \
         FROM UNNEST($1::text[], $2::text[]) AS r(id, hash) WHERE d.id = r.id",
    )
    .bind(&ids)
    .bind(&values)
    .execute(&mut **tx)
    .await
    .context("storing broker password hashes")?;
    Ok(())
}

/// Every device with an issued broker password: (id, Mosquitto hash).
pub async fn broker_password_hashes(pool: &PgPool) -> Result<Vec<(String, String)>, StoreError> {
    sqlx::query_as(
        "SELECT id, broker_password_hash FROM devices \
         WHERE broker_password_hash IS NOT NULL ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .context("reading broker password hashes")
}

/// The new desired state of one device after a write.
#[derive(Debug, Clone)]
pub struct DesiredWrite {
    pub id: DeviceId,
    pub generation: Generation,
}

/// Sets the same desired spec on many devices. The generation increases only
/// where the digest changes; unchanged rows are not written. Returns the
/// devices that changed with their new generation.
pub async fn set_desired(
    write: &mut DeviceTx<'_>,
    ids: &[DeviceId],
    spec: &Value,
    digest: &str,
) -> Result<Vec<DesiredWrite>, StoreError> {
    let tx = write.tx();
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "UPDATE devices SET desired_spec = $2, desired_digest = $3, \
             desired_generation = desired_generation + 1, desired_at = now(), updated_at = now() \
         WHERE id = ANY($1) AND desired_digest IS DISTINCT FROM $3 \
         RETURNING id, desired_generation",
    )
    .bind(super::raw_ids(ids))
    .bind(spec)
    .bind(digest)
    .fetch_all(&mut **tx)
    .await
    .context("writing desired state")?;
    rows.into_iter()
        .map(|(id, stored)| {
            Ok(DesiredWrite {
                id: super::device_id(&id, "reading the ids of a desired change")?,
                generation: generation(stored),
            })
        })
        .collect()
}

/// One accepted report, ready to store.
#[derive(Debug, Clone)]
pub struct ReportRow {
    pub id: DeviceId,
    pub seq: u64,
    pub spec: Value,
    pub digest: String,
    pub generation: Option<Generation>,
    pub error_generation: Option<Generation>,
    pub error: Option<String>,
    pub health: Option<Health>,
}

/// Stores a batch of reports (at most one per device); a row whose stored
/// seq is already as high is left alone. Returns how many rows changed.
pub async fn apply_reports(
    write: &mut DeviceTx<'_>,
    reports: &[&ReportRow],
    auto_register: bool,
) -> Result<u64, StoreError> {
    let tx = write.tx();
    if reports.is_empty() {
        return Ok(0);
    }
    let ids: Vec<&str> = reports.iter().map(|r| r.id.as_str()).collect();
    if auto_register {
        sqlx::query(
            "INSERT INTO devices (id) SELECT UNNEST($1::text[]) ON CONFLICT (id) DO NOTHING",
        )
        .bind(&ids)
        .execute(&mut **tx)
        .await
        .context("auto-registering reporting devices")?;
    }
    let seqs: Vec<i64> = reports.iter().map(|r| to_i64(r.seq)).collect();
    let specs: Vec<String> = reports.iter().map(|r| r.spec.to_string()).collect();
    let digests: Vec<&str> = reports.iter().map(|r| r.digest.as_str()).collect();
    let generations: Vec<Option<i64>> = reports
        .iter()
        .map(|r| r.generation.map(stored_generation))
        .collect();
    let error_generations: Vec<Option<i64>> = reports
        .iter()
        .map(|r| r.error_generation.map(stored_generation))
        .collect();
    let errors: Vec<Option<&str>> = reports.iter().map(|r| r.error.as_deref()).collect();
    let health: Vec<Option<Health>> = reports.iter().map(|r| r.health).collect();
    let changed = sqlx::query(
        "UPDATE devices d SET reported_spec = r.spec::jsonb, reported_digest = r.digest, reported_seq = r.seq, \
             reported_generation = r.generation, reported_error_generation = r.error_generation, \
             reported_error = r.error, reported_health = r.health, reported_at = now(), updated_at = now() \
         FROM UNNEST($1::text[], $2::int8[], $3::text[], $4::text[], $5::int8[], $6::int8[], $7::text[], $8::text[]) \
             AS r(id, seq, spec, digest, generation, error_generation, error, health) \
         WHERE d.id = r.id AND (d.reported_seq IS NULL OR d.reported_seq < r.seq)",
    )
    .bind(&ids)
    .bind(&seqs)
    .bind(&specs)
    .bind(&digests)
    .bind(&generations)
    .bind(&error_generations)
    .bind(&errors)
    .bind(&health)
    .execute(&mut **tx)
    .await
    .context("storing reports")?
    .rows_affected();
    Ok(changed)
}

/// Records the devices' connection state; unchanged rows are not written.
pub async fn set_online(
    write: &mut DeviceTx<'_>,
    changes: &[(String, bool)],
) -> Result<(), StoreError> {
    let tx = write.tx();
    if changes.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = changes.iter().map(|(id, _)| id.as_str()).collect();
    let online: Vec<bool> = changes.iter().map(|(_, o)| *o).collect();
    sqlx::query(
        "UPDATE devices d SET online = r.online, updated_at = now() \
         FROM UNNEST($1::text[], $2::bool[]) AS r(id, online) \
         WHERE d.id = r.id AND d.online IS DISTINCT FROM r.online",
    )
    .bind(&ids)
    .bind(&online)
    .execute(&mut **tx)
    .await
    .context("storing device connection state")?;
    Ok(())
}

/// Appends attempt history.
pub async fn record_attempts(
    write: &mut DeviceTx<'_>,
    rows: &[AttemptRecord],
) -> Result<(), StoreError> {
    let tx = write.tx();
    if rows.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = rows.iter().map(|r| r.device.as_str()).collect();
    let runs: Vec<Uuid> = rows.iter().map(|r| r.run_id).collect();
    let attempts: Vec<i32> = rows
        .iter()
        .map(|r| i32::try_from(r.attempt).unwrap_or(i32::MAX))
        .collect();
    let generations: Vec<Option<i64>> = rows
        .iter()
        .map(|r| r.generation.map(stored_generation))
        .collect();
    let results: Vec<OutcomeKind> = rows.iter().map(|r| r.result).collect();
    let reasons: Vec<Option<&str>> = rows.iter().map(|r| r.reason.as_deref()).collect();
    // Joined with devices: an attempt of a device deleted meanwhile is
    // dropped, not a foreign-key error that would fail the whole batch.
    sqlx::query(
        "INSERT INTO device_attempts (device_id, run_id, attempt, generation, result, reason) \
         SELECT r.id, r.run_id, r.attempt, r.generation, r.result, r.reason \
         FROM UNNEST($1::text[], $2::uuid[], $3::int4[], $4::int8[], $5::text[], $6::text[]) \
             AS r(id, run_id, attempt, generation, result, reason) \
         JOIN devices d ON d.id = r.id",
    )
    .bind(&ids)
    .bind(&runs)
    .bind(&attempts)
    .bind(&generations)
    .bind(&results)
    .bind(&reasons)
    .execute(&mut **tx)
    .await
    .context("appending attempt history")?;
    Ok(())
}

/// One device row's merged change (`None`: keep the stored value).
#[derive(Debug, Clone, Default)]
pub struct DeviceChangeRow<'a> {
    pub id: &'a str,
    pub status: Option<DeviceStatus>,
    /// Consecutive failed attempts and when the next is due (set together).
    pub failures: Option<(u32, Option<DateTime<Utc>>)>,
    pub last_error: Option<&'a str>,
    /// `(run, outcome, reason)` of the device's last outcome.
    pub last_outcome: Option<(Uuid, OutcomeKind, Option<&'a str>)>,
    pub retained_generation: Option<Generation>,
}

/// Writes each device's merged change in one statement; a row whose values
/// would not change is not rewritten.
pub async fn apply_changes(
    write: &mut DeviceTx<'_>,
    rows: &[DeviceChangeRow<'_>],
) -> Result<(), StoreError> {
    let tx = write.tx();
    if rows.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = rows.iter().map(|r| r.id).collect();
    let statuses: Vec<Option<DeviceStatus>> = rows.iter().map(|r| r.status).collect();
    let set_attempts: Vec<bool> = rows.iter().map(|r| r.failures.is_some()).collect();
    let attempts: Vec<i32> = rows
        .iter()
        .map(|r| {
            r.failures
                .map_or(0, |(n, _)| i32::try_from(n).unwrap_or(i32::MAX))
        })
        .collect();
    let next: Vec<Option<DateTime<Utc>>> = rows
        .iter()
        .map(|r| r.failures.and_then(|(_, at)| at))
        .collect();
    let errors: Vec<Option<&str>> = rows.iter().map(|r| r.last_error).collect();
    let set_outcome: Vec<bool> = rows.iter().map(|r| r.last_outcome.is_some()).collect();
    let run_ids: Vec<Option<Uuid>> = rows.iter().map(|r| r.last_outcome.map(|o| o.0)).collect();
    let outcomes: Vec<Option<OutcomeKind>> =
        rows.iter().map(|r| r.last_outcome.map(|o| o.1)).collect();
    let reasons: Vec<Option<&str>> = rows
        .iter()
        .map(|r| r.last_outcome.and_then(|o| o.2))
        .collect();
    let retained: Vec<Option<i64>> = rows
        .iter()
        .map(|r| r.retained_generation.map(stored_generation))
        .collect();
    sqlx::query(
        "WITH r AS ( \
             SELECT * FROM UNNEST($1::text[], $2::text[], $3::bool[], $4::int4[], $5::timestamptz[], \
                 $6::text[], $7::bool[], $8::uuid[], $9::text[], $10::text[], $11::int8[]) \
                 AS r(id, status, set_attempts, attempts, next_at, last_error, set_outcome, \
                     run_id, outcome, reason, retained) \
         ), n AS ( \
             SELECT d.id, \
                 COALESCE(r.status, d.status) AS status, \
                 CASE WHEN r.set_attempts THEN r.attempts ELSE d.attempts END AS attempts, \
                 CASE WHEN r.set_attempts THEN r.next_at ELSE d.next_attempt_at END AS next_at, \
                 COALESCE(r.last_error, d.last_error) AS last_error, \
                 CASE WHEN r.set_outcome THEN r.outcome ELSE d.last_outcome END AS outcome, \
                 CASE WHEN r.set_outcome THEN r.reason ELSE d.last_outcome_reason END AS reason, \
                 CASE WHEN r.set_outcome THEN r.run_id ELSE d.last_run_id END AS run_id, \
                 COALESCE(r.retained, d.retained_generation) AS retained \
             FROM r JOIN devices d ON d.id = r.id \
         ) \
         UPDATE devices d SET status = n.status, attempts = n.attempts, next_attempt_at = n.next_at, \
             last_error = n.last_error, last_outcome = n.outcome, last_outcome_reason = n.reason, \
             last_run_id = n.run_id, retained_generation = n.retained, updated_at = now() \
         FROM n \
         WHERE d.id = n.id AND (d.status, d.attempts, d.next_attempt_at, d.last_error, d.last_outcome, \
             d.last_outcome_reason, d.last_run_id, d.retained_generation) \
             IS DISTINCT FROM (n.status, n.attempts, n.next_at, n.last_error, n.outcome, n.reason, \
             n.run_id, n.retained)",
    )
    .bind(&ids)
    .bind(&statuses)
    .bind(&set_attempts)
    .bind(&attempts)
    .bind(&next)
    .bind(&errors)
    .bind(&set_outcome)
    .bind(&run_ids)
    .bind(&outcomes)
    .bind(&reasons)
    .bind(&retained)
    .execute(&mut **tx)
    .await
    .context("storing device changes")?;
    Ok(())
}

/// Forgets a device's reported state, so its next report is accepted
/// whatever its `seq` (an operator's way out of a poisoned seq). Returns
/// whether the device exists.
pub async fn reset_reported(write: &mut DeviceTx<'_>, id: &DeviceId) -> Result<bool, StoreError> {
    let tx = write.tx();
    let done = sqlx::query(
        "UPDATE devices SET reported_spec = NULL, reported_digest = NULL, reported_seq = NULL, \
             reported_generation = NULL, reported_error_generation = NULL, reported_error = NULL, \
             reported_health = NULL, reported_at = NULL, updated_at = now() \
         WHERE id = $1",
    )
    .bind(id.as_str())
    .execute(&mut **tx)
    .await
    .context("resetting reported state")?
    .rows_affected();
    Ok(done > 0)
}

/// Deletes a device with its attempt history; its outcomes in past runs stay.
/// Returns whether it existed.
pub async fn delete(write: &mut DeviceTx<'_>, id: &DeviceId) -> Result<bool, StoreError> {
    let tx = write.tx();
    let done = sqlx::query("DELETE FROM devices WHERE id = $1")
        .bind(id.as_str())
        .execute(&mut **tx)
        .await
        .context("deleting a device")?
        .rows_affected();
    Ok(done > 0)
}

/// Releases quarantined devices among `ids`: status `failed`, attempts 0
/// (written as a device change, the one path of device status), in the
/// caller's transaction. Returns the ids that were quarantined.
pub async fn release_quarantine(
    write: &mut DeviceTx<'_>,
    ids: &[DeviceId],
) -> Result<Vec<DeviceId>, StoreError> {
    const CONTEXT: &str = "finding quarantined devices";
    let tx = write.tx();
    let quarantined: Vec<String> =
        sqlx::query_scalar("SELECT id FROM devices WHERE id = ANY($1) AND status = $2 FOR UPDATE")
            .bind(super::raw_ids(ids))
            .bind(DeviceStatus::Quarantined)
            .fetch_all(&mut **tx)
            .await
            .context(CONTEXT)?;
    let quarantined = super::device_ids(&quarantined, CONTEXT)?;
    let changes: Vec<DeviceChangeRow<'_>> = quarantined
        .iter()
        .map(|id| DeviceChangeRow {
            id: id.as_str(),
            status: Some(DeviceStatus::Failed),
            failures: Some((0, None)),
            ..DeviceChangeRow::default()
        })
        .collect();
    apply_changes(write, &changes).await?;
    Ok(quarantined)
}

/// Quarantined devices among the targets of a run.
pub async fn quarantined_in_run(pool: &PgPool, run_id: Uuid) -> Result<Vec<DeviceId>, StoreError> {
    const CONTEXT: &str = "listing quarantined devices of a run";
    let ids: Vec<String> = sqlx::query_scalar(
        "SELECT d.id FROM devices d JOIN run_targets t ON t.device_id = d.id \
         WHERE t.run_id = $1 AND d.status = $2 ORDER BY d.id",
    )
    .bind(run_id)
    .bind(DeviceStatus::Quarantined)
    .fetch_all(pool)
    .await
    .context(CONTEXT)?;
    super::device_ids(&ids, CONTEXT)
}

#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct HistoryRow {
    pub run_id: Option<Uuid>,
    pub attempt: i32,
    pub generation: Option<i64>,
    pub result: OutcomeKind,
    pub reason: Option<String>,
    pub at: DateTime<Utc>,
}

/// The newest `limit` attempts of a device, newest first.
pub async fn history(
    pool: &PgPool,
    id: &DeviceId,
    limit: i64,
) -> Result<Vec<HistoryRow>, StoreError> {
    sqlx::query_as(
        "SELECT run_id, attempt, generation, result, reason, at FROM device_attempts \
         WHERE device_id = $1 ORDER BY id DESC LIMIT $2",
    )
    .bind(id.as_str())
    .bind(limit)
    .fetch_all(pool)
    .await
    .context("reading attempt history")
}

/// Converged devices whose last report says they are not healthy.
pub async fn count_unhealthy_converged(pool: &PgPool) -> Result<i64, StoreError> {
    sqlx::query_scalar(
        "SELECT count(*) FROM devices WHERE status = $1 AND reported_health = ANY($2)",
    )
    .bind(DeviceStatus::Converged)
    .bind([Health::Degraded, Health::Unhealthy])
    .fetch_one(pool)
    .await
    .context("counting unhealthy converged devices")
}

/// Deletes attempt history older than `max_age` or beyond the newest
/// `max_count` rows. Returns how many rows were deleted.
pub async fn prune_attempts(
    pool: &PgPool,
    max_age: std::time::Duration,
    max_count: i64,
) -> Result<u64, StoreError> {
    let max_age = chrono::Duration::from_std(max_age).unwrap_or(chrono::Duration::MAX);
    let cutoff = Utc::now()
        .checked_sub_signed(max_age)
        .unwrap_or(DateTime::<Utc>::MIN_UTC);
    let deleted = sqlx::query(
        "DELETE FROM device_attempts WHERE at < $1 \
            OR id <= (SELECT max(id) FROM device_attempts) - $2",
    )
    .bind(cutoff)
    .bind(max_count)
    .execute(pool)
    .await
    .context("pruning attempt history")?
    .rows_affected();
    Ok(deleted)
}
