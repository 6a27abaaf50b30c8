//! The event log: gap-free `sequence`, written in the caller's transaction.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

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

pub async fn insert(
    tx: &mut Transaction<'_, Postgres>,
    events: &[EventRow],
) -> Result<(), StoreError> {
    if events.is_empty() {
        return Ok(());
    }
    let sequences: Vec<i64> = events.iter().map(|e| e.sequence).collect();
    let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
    let types: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
    let subjects: Vec<&str> = events.iter().map(|e| e.subject.as_str()).collect();
    let run_ids: Vec<Option<Uuid>> = events.iter().map(|e| e.run_id).collect();
    let times: Vec<DateTime<Utc>> = events.iter().map(|e| e.time).collect();
    let bodies: Vec<String> = events.iter().map(|e| e.cloudevent.to_string()).collect();
    sqlx::query(
        "INSERT INTO events (sequence, id, type, subject, run_id, time, cloudevent) \
         SELECT s, i, t, sub, r, tm, c::jsonb \
         FROM UNNEST($1::int8[], $2::uuid[], $3::text[], $4::text[], $5::uuid[], $6::timestamptz[], $7::text[]) \
             AS x(s, i, t, sub, r, tm, c)",
    )
    .bind(&sequences)
    .bind(&ids)
    .bind(&types)
    .bind(&subjects)
    .bind(&run_ids)
    .bind(&times)
    .bind(&bodies)
    .execute(&mut **tx)
    .await
    .context("appending to the event log")?;
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

/// Events after `after` in sequence order, optionally of one run / type.
pub async fn read(
    pool: &PgPool,
    after: i64,
    run_id: Option<Uuid>,
    event_type: Option<&str>,
    limit: i64,
) -> Result<Vec<StoredEvent>, StoreError> {
    sqlx::query_as(
        "SELECT sequence, type, subject, run_id, cloudevent FROM events \
         WHERE sequence > $1 AND ($2::uuid IS NULL OR run_id = $2) AND ($3::text IS NULL OR type = $3) \
         ORDER BY sequence LIMIT $4",
    )
    .bind(after)
    .bind(run_id)
    .bind(event_type)
    .bind(limit)
    .fetch_all(pool)
    .await
    .context("reading the event log")
}

/// Events per type for one run.
pub async fn count_by_type(pool: &PgPool, run_id: Uuid) -> Result<Vec<(String, i64)>, StoreError> {
    sqlx::query_as(
        "SELECT type, count(*) FROM events WHERE run_id = $1 GROUP BY type ORDER BY type",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
    .context("counting events of a run")
}
