//! The event log: gap-free `sequence`, written in the caller's transaction,
//! as rows (`events`, one per event) and as converged slices
//! (`converged_event_slices`, one per run slice of `already_converged`
//! outcomes, each covering a contiguous range of sequence numbers). Both
//! are read in one statement, so a reader sees one committed prefix of the
//! log; `events::log` expands the slices into their events.

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::Value;
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use super::copy::copy_in;
use super::{to_u64, Context, StoreError};
use crate::tuning::CONVERGED_SLICE;

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

/// The `already_converged` outcome events of one run's converged targets,
/// numbered `first_sequence..` in the order of `subjects`, stored in slices
/// of `CONVERGED_SLICE` with the first event id of each slice in `slice_ids`.
#[derive(Debug, Clone)]
pub struct ConvergedEventsRow<'a> {
    pub first_sequence: i64,
    pub run_id: Uuid,
    pub source: &'a str,
    /// To the microsecond (what `timestamptz` keeps).
    pub time: DateTime<Utc>,
    pub slice_ids: Vec<Uuid>,
    pub subjects: Vec<&'a str>,
    pub generations: Vec<i64>,
    pub health: Vec<Option<&'a str>>,
}

/// Appends converged outcome events to the log, one `converged_event_slices`
/// row per slice (one statement), in the caller's transaction.
pub async fn insert_converged(
    tx: &mut Transaction<'_, Postgres>,
    events: &ConvergedEventsRow<'_>,
) -> Result<(), StoreError> {
    if events.subjects.is_empty() {
        return Ok(());
    }
    let slice_size = i64::try_from(CONVERGED_SLICE).unwrap_or(i64::MAX);
    sqlx::query(
        "INSERT INTO converged_event_slices (first_sequence, last_sequence, first_id, run_id, \
             source, time, subjects, generations, health) \
         SELECT $1 + min(u.ord) - 1, $1 + max(u.ord) - 1, s.first_id, $2, $3, $4, \
             array_agg(u.subject ORDER BY u.ord), array_agg(u.generation ORDER BY u.ord), \
             array_agg(u.health ORDER BY u.ord) \
         FROM unnest($5::text[], $6::int8[], $7::text[]) WITH ORDINALITY \
             AS u(subject, generation, health, ord) \
         JOIN unnest($8::uuid[]) WITH ORDINALITY AS s(first_id, slice) \
             ON s.slice = (u.ord - 1) / $9 + 1 \
         GROUP BY s.slice, s.first_id",
    )
    .bind(events.first_sequence)
    .bind(events.run_id)
    .bind(events.source)
    .bind(events.time)
    .bind(&events.subjects)
    .bind(&events.generations)
    .bind(&events.health)
    .bind(&events.slice_ids)
    .bind(slice_size)
    .execute(&mut **tx)
    .await
    .context("appending converged outcomes to the event log")?;
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

/// One entry of the log as read: an event row, or the part of a converged
/// slice a read wants.
#[derive(Debug, Clone)]
pub enum LogEntry {
    Row(StoredEvent),
    Converged(ConvergedSlice),
}

impl LogEntry {
    /// The last sequence this entry accounts for.
    pub fn last_sequence(&self) -> i64 {
        match self {
            LogEntry::Row(row) => row.sequence,
            LogEntry::Converged(slice) => slice.last_sequence,
        }
    }
}

/// The wanted events of one converged slice: element i of the arrays is
/// the event at `first_sequence + skip + i`, whose id is `first_id + skip +
/// i`; `last_sequence` is the slice's own last.
#[derive(Debug, Clone)]
pub struct ConvergedSlice {
    pub first_sequence: i64,
    pub last_sequence: i64,
    pub skip: i64,
    pub first_id: Uuid,
    pub run_id: Uuid,
    pub source: String,
    pub time: DateTime<Utc>,
    pub subjects: Vec<String>,
    pub generations: Vec<i64>,
    pub health: Vec<Option<String>>,
}

/// A log entry as the statement returns it (a row's columns or a slice's).
#[derive(Debug, sqlx::FromRow)]
struct EntryColumns {
    sequence: i64,
    last_sequence: i64,
    #[sqlx(rename = "type")]
    event_type: String,
    subject: Option<String>,
    run_id: Option<Uuid>,
    cloudevent: Option<Value>,
    skip: Option<i64>,
    first_id: Option<Uuid>,
    source: Option<String>,
    time: Option<DateTime<Utc>>,
    subjects: Option<Vec<String>>,
    generations: Option<Vec<i64>>,
    health: Option<Vec<Option<String>>>,
}

impl EntryColumns {
    fn entry(self) -> Result<LogEntry, StoreError> {
        let sequence = self.sequence;
        let broken = || StoreError::Corrupt {
            context: "reading the event log",
            detail: format!("the entry at sequence {sequence} lacks a column"),
        };
        if let Some(cloudevent) = self.cloudevent {
            return Ok(LogEntry::Row(StoredEvent {
                sequence: self.sequence,
                event_type: self.event_type,
                subject: self.subject.ok_or_else(broken)?,
                run_id: self.run_id,
                cloudevent,
            }));
        }
        let slice = ConvergedSlice {
            first_sequence: self.sequence,
            last_sequence: self.last_sequence,
            skip: self.skip.ok_or_else(broken)?,
            first_id: self.first_id.ok_or_else(broken)?,
            run_id: self.run_id.ok_or_else(broken)?,
            source: self.source.ok_or_else(broken)?,
            time: self.time.ok_or_else(broken)?,
            subjects: self.subjects.ok_or_else(broken)?,
            generations: self.generations.ok_or_else(broken)?,
            health: self.health.ok_or_else(broken)?,
        };
        Ok(LogEntry::Converged(slice))
    }
}

/// What one read of the log returned, in sequence order: at most
/// `row_limit` rows and `slice_limit` slices, both matching `filter` and
/// after `after`, from one snapshot.
#[derive(Debug, Default)]
pub struct LogRead {
    pub entries: Vec<LogEntry>,
    /// The rows reached `row_limit`: events past the last row may be left.
    pub rows_full: bool,
    /// The slices reached `slice_limit`: slices past the last may be left.
    pub slices_full: bool,
}

/// Entries after `after` that hold events matching `filter`: rows, and
/// converged slices cut to their events after `after` (to the one event of
/// `filter.subject`, if set), in one statement (one snapshot: sequences
/// commit in order, so what it sees is a prefix of the log).
pub async fn read_entries(
    pool: &PgPool,
    after: i64,
    filter: &EventFilter,
    row_limit: i64,
    slice_limit: i64,
) -> Result<LogRead, StoreError> {
    let converged_type =
        idem_protocol::event::EventType::Device(idem_protocol::OutcomeKind::AlreadyConverged)
            .as_str();
    let rows: Vec<EntryColumns> = sqlx::query_as(
        "(SELECT sequence, sequence AS last_sequence, type, subject, run_id, cloudevent, \
              NULL::int8 AS skip, NULL::uuid AS first_id, NULL::text AS source, \
              NULL::timestamptz AS time, NULL::text[] AS subjects, NULL::int8[] AS generations, \
              NULL::text[] AS health \
          FROM events \
          WHERE sequence > $1 AND ($2::uuid IS NULL OR run_id = $2) \
              AND ($3::text IS NULL OR type = $3) AND ($4::text IS NULL OR subject = $4) \
          ORDER BY sequence LIMIT $5) \
         UNION ALL \
         (SELECT first_sequence, last_sequence, $7, NULL, run_id, NULL, skip, first_id, source, \
              time, subjects[skip + 1 : upto], generations[skip + 1 : upto], \
              health[skip + 1 : upto] \
          FROM (SELECT *, \
                  CASE WHEN $4::text IS NULL THEN greatest(0, $1 - first_sequence + 1) \
                      ELSE array_position(subjects, $4) - 1 END AS skip, \
                  CASE WHEN $4::text IS NULL THEN cardinality(subjects) \
                      ELSE array_position(subjects, $4) END AS upto \
                FROM converged_event_slices \
                WHERE last_sequence > $1 AND ($2::uuid IS NULL OR run_id = $2) \
                    AND ($3::text IS NULL OR $3 = $7) \
                    AND ($4::text IS NULL OR $4 = ANY(subjects))) s \
          WHERE first_sequence + skip > $1 \
          ORDER BY first_sequence LIMIT $6) \
         ORDER BY sequence",
    )
    .bind(after)
    .bind(filter.run_id)
    .bind(&filter.event_type)
    .bind(&filter.subject)
    .bind(row_limit)
    .bind(slice_limit)
    .bind(converged_type)
    .fetch_all(pool)
    .await
    .context("reading the event log")?;
    let mut read = LogRead::default();
    let (mut row_count, mut slice_count) = (0_i64, 0_i64);
    for columns in rows {
        let entry = columns.entry()?;
        match &entry {
            LogEntry::Row(_) => row_count += 1,
            LogEntry::Converged(_) => slice_count += 1,
        }
        read.entries.push(entry);
    }
    read.rows_full = row_count >= row_limit;
    read.slices_full = slice_count >= slice_limit;
    Ok(read)
}

/// The highest committed sequence (0 when nothing was ever written).
pub async fn last_sequence(pool: &PgPool) -> Result<i64, StoreError> {
    sqlx::query_scalar("SELECT last FROM event_sequence")
        .fetch_one(pool)
        .await
        .context("reading the last event sequence")
}

/// The oldest retained sequence (of a row or a converged slice), or `None`
/// when the log is empty.
pub async fn oldest_sequence(pool: &PgPool) -> Result<Option<i64>, StoreError> {
    sqlx::query_scalar(
        "SELECT least((SELECT min(sequence) FROM events), \
                      (SELECT min(first_sequence) FROM converged_event_slices))",
    )
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
/// `max_age` or beyond the newest `max_count` events (counted by sequence,
/// so a converged slice counts as the events it holds). A slice goes only
/// whole, once its last event is past the line. Returns how many events
/// were deleted.
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
    let deleted: i64 = sqlx::query_scalar(
        "WITH rows AS ( \
             DELETE FROM events WHERE sequence <= $1 \
             AND (time < $2 OR sequence <= (SELECT last FROM event_sequence) - $3) \
             RETURNING 1), \
         slices AS ( \
             DELETE FROM converged_event_slices WHERE last_sequence <= $1 \
             AND (time < $2 OR last_sequence <= (SELECT last FROM event_sequence) - $3) \
             RETURNING cardinality(subjects) AS events) \
         SELECT (SELECT count(*) FROM rows) + coalesce((SELECT sum(events) FROM slices), 0)::int8",
    )
    .bind(relayed)
    .bind(cutoff)
    .bind(max_count)
    .fetch_one(pool)
    .await
    .context("pruning the event log")?;
    Ok(to_u64(deleted))
}
