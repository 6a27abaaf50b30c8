//! The event log: gap-free `sequence`, written in the caller's transaction.

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::Value;
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use super::copy::copy_in;
use super::{to_u64, Context, StoreError};

/// An event ready to be stored, with its sequence already assigned.
#[derive(Debug, Clone)]
pub struct EventRow {
    pub sequence: i64,
    pub id: Uuid,
    pub event_type: String,
    pub subject: String,
    pub run_id: Option<Uuid>,
    pub time: DateTime<Utc>,
    pub cloudevent: Value,
}

/// Reserves `count` consecutive sequence numbers and returns the first. The
/// counter row stays locked until the transaction ends, so sequences are
/// committed in order and a rollback leaves no gap.
pub async fn reserve_sequences(
    tx: &mut Transaction<'_, Postgres>,
    count: usize,
) -> Result<u64, StoreError> {
    let count = i64::try_from(count).unwrap_or(i64::MAX);
    let last: i64 = sqlx::query_scalar("UPDATE event_sequence SET last = last + $1 RETURNING last")
        .bind(count)
        .fetch_one(&mut **tx)
        .await
        .context("reserving event sequence numbers")?;
    Ok(to_u64(last - count + 1))
}

/// Appends `events` to the log (one `COPY`), in the caller's transaction.
pub async fn insert(
    tx: &mut Transaction<'_, Postgres>,
    events: &[EventRow],
) -> Result<(), StoreError> {
    copy_in(
        tx,
        "COPY events (sequence, id, type, subject, run_id, time, cloudevent) FROM STDIN",
        "appending to the event log",
        events,
        |rows, e| {
            rows.plain(e.sequence)
                .plain(e.id)
                .text(&e.event_type)
                .text(&e.subject)
                .optional_plain(e.run_id)
                .plain(e.time.to_rfc3339_opts(SecondsFormat::Micros, true))
                .json(&e.cloudevent);
        },
    )
    .await?;
    Ok(())
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct StoredEvent {
    pub sequence: i64,
    #[sqlx(rename = "type")]
    pub event_type: String,
    pub subject: String,
    pub run_id: Option<Uuid>,
    pub cloudevent: Value,
}

/// Which events a reader wants; `None` matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventFilter {
    pub run_id: Option<Uuid>,
    pub event_type: Option<String>,
    pub subject: Option<String>,
}

impl EventFilter {
    pub fn matches(&self, event: &StoredEvent) -> bool {
        self.run_id.is_none_or(|r| event.run_id == Some(r))
            && self
                .event_type
                .as_deref()
                .is_none_or(|t| event.event_type == t)
            && self.subject.as_deref().is_none_or(|s| event.subject == s)
    }
}

/// Events after `after` in sequence order that match `filter`.
pub async fn read(
    pool: &PgPool,
    after: i64,
    filter: &EventFilter,
    limit: i64,
) -> Result<Vec<StoredEvent>, StoreError> {
    sqlx::query_as(
        "SELECT sequence, type, subject, run_id, cloudevent FROM events \
         WHERE sequence > $1 AND ($2::uuid IS NULL OR run_id = $2) AND ($3::text IS NULL OR type = $3) \
         AND ($4::text IS NULL OR subject = $4) \
         ORDER BY sequence LIMIT $5",
    )
    .bind(after)
    .bind(filter.run_id)
    .bind(&filter.event_type)
    .bind(&filter.subject)
    .bind(limit)
    .fetch_all(pool)
    .await
    .context("reading the event log")
}

/// The highest committed sequence (0 when nothing was ever written).
pub async fn last_sequence(pool: &PgPool) -> Result<i64, StoreError> {
    sqlx::query_scalar("SELECT last FROM event_sequence")
        .fetch_one(pool)
        .await
        .context("reading the last event sequence")
}

/// The oldest retained sequence, or `None` when the log is empty.
pub async fn oldest_sequence(pool: &PgPool) -> Result<Option<i64>, StoreError> {
    sqlx::query_scalar("SELECT min(sequence) FROM events")
        .fetch_one(pool)
        .await
        .context("reading the oldest event sequence")
}

pub async fn load_cursor(pool: &PgPool, name: &str) -> Result<Option<i64>, StoreError> {
    sqlx::query_scalar("SELECT sequence FROM event_cursors WHERE name = $1")
        .bind(name)
        .fetch_optional(pool)
        .await
        .context("reading an event cursor")
}

/// Saves an event cursor (only ever forward), fenced by a lease: saved
/// only while `holder` still holds `lease` at `epoch`, checked in the same
/// statement. `false`: the lease has changed hands, nothing was saved.
pub async fn save_cursor_fenced(
    pool: &PgPool,
    name: &str,
    sequence: i64,
    lease: &str,
    holder: uuid::Uuid,
    epoch: i64,
) -> Result<bool, StoreError> {
    let fenced = sqlx::query(
        "INSERT INTO event_cursors (name, sequence) \
         SELECT $1, $2 WHERE EXISTS \
             (SELECT 1 FROM leases WHERE name = $3 AND holder_id = $4 AND epoch = $5) \
         ON CONFLICT (name) DO UPDATE SET sequence = EXCLUDED.sequence \
         WHERE event_cursors.sequence < EXCLUDED.sequence",
    )
    .bind(name)
    .bind(sequence)
    .bind(lease)
    .bind(holder)
    .bind(epoch)
    .execute(pool)
    .await
    .context("saving an event cursor under a lease")?;
    if fenced.rows_affected() == 1 {
        return Ok(true);
    }
    // Nothing written: either the lease is gone, or the cursor was already
    // at `sequence` (a batch saved twice); only the first is a loss.
    let held: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM leases WHERE name = $1 AND holder_id = $2 AND epoch = $3)",
    )
    .bind(lease)
    .bind(holder)
    .bind(epoch)
    .fetch_one(pool)
    .await
    .context("checking a lease")?;
    Ok(held)
}

/// Deletes relayed events (sequence ≤ `relayed`) that are older than
/// `max_age` or beyond the newest `max_count`. Returns how many were deleted.
pub async fn prune(
    pool: &PgPool,
    relayed: i64,
    max_age: std::time::Duration,
    max_count: i64,
) -> Result<u64, StoreError> {
    let max_age = chrono::Duration::from_std(max_age).unwrap_or(chrono::Duration::MAX);
    let cutoff = Utc::now()
        .checked_sub_signed(max_age)
        .unwrap_or(DateTime::<Utc>::MIN_UTC);
    let deleted = sqlx::query(
        "DELETE FROM events WHERE sequence <= $1 \
         AND (time < $2 OR sequence <= (SELECT last FROM event_sequence) - $3)",
    )
    .bind(relayed)
    .bind(cutoff)
    .bind(max_count)
    .execute(pool)
    .await
    .context("pruning the event log")?
    .rows_affected();
    Ok(deleted)
}
