//! The event log as its readers see it: one CloudEvent per sequence number,
//! whether the store keeps it as a row or inside a converged slice (the
//! `already_converged` outcomes of up to `CONVERGED_SLICE` targets of one
//! run, decided when it was created). Writes those slices, and expands them
//! on every read into the same events a row would hold: same id, type,
//! source, subject, data and sequence.

use chrono::{DateTime, SubsecRound, Utc};
use idem_protocol::{DeviceId, Health};
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use super::{to_row, EventDraft};
use crate::store::events::{
    self as stored, ConvergedEventsRow, ConvergedSlice, EventFilter, LogEntry, StoredEvent,
};
use crate::store::runs::ConvergedTarget;
use crate::store::StoreError;
use crate::tuning::{CONVERGED_SLICE, CONVERGED_SLICES_PER_READ};

/// The time events written now carry: what `timestamptz` keeps (to the
/// microsecond), so an event rebuilt from its stored time is the same.
pub fn event_time(now: DateTime<Utc>) -> DateTime<Utc> {
    now.trunc_subsecs(6)
}

/// The first event id of each of `slices` slices: a UUIDv7 whose low 16
/// bits are zero, so the ids `first + i` of its events (i below
/// `CONVERGED_SLICE`) stay distinct UUIDv7s of the same instant.
fn slice_ids(slices: usize) -> Vec<Uuid> {
    (0..slices)
        .map(|_| Uuid::from_u128(Uuid::now_v7().as_u128() & !0xffff))
        .collect()
}

/// The id of the event at `index` in the slice that starts at `first_id`.
fn event_id(first_id: Uuid, index: i64) -> Uuid {
    let index = u128::try_from(index).unwrap_or(0);
    Uuid::from_u128(first_id.as_u128().wrapping_add(index))
}

/// Appends the `already_converged` outcome events of run `run_id`'s
/// `converged` targets, numbered from `first_sequence` in their order, in
/// the caller's transaction: one log entry per `CONVERGED_SLICE` of them.
pub async fn append_converged(
    tx: &mut Transaction<'_, Postgres>,
    run_id: Uuid,
    converged: &[ConvergedTarget<'_>],
    first_sequence: u64,
    source: &str,
    time: DateTime<Utc>,
) -> Result<(), StoreError> {
    if converged.is_empty() {
        return Ok(());
    }
    let row = ConvergedEventsRow {
        first_sequence: i64::try_from(first_sequence).unwrap_or(i64::MAX),
        run_id,
        source,
        time: event_time(time),
        slice_ids: slice_ids(converged.len().div_ceil(CONVERGED_SLICE)),
        subjects: converged.iter().map(|c| c.device_id.as_str()).collect(),
        generations: converged
            .iter()
            .map(|c| crate::store::stored_generation(c.generation))
            .collect(),
        health: converged
            .iter()
            .map(|c| c.health.map(Health::as_str))
            .collect(),
    };
    stored::insert_converged(tx, &row).await
}

/// Up to `limit` events after `after` that match `filter`, in sequence
/// order, converged slices expanded. Fewer than `limit` only when no more
/// are committed.
pub async fn read(
    pool: &PgPool,
    after: i64,
    filter: &EventFilter,
    limit: i64,
) -> Result<Vec<StoredEvent>, StoreError> {
    let mut events = Vec::new();
    let mut cursor = after;
    // With a device filter each slice holds at most one wanted event.
    let slice_limit = if filter.subject.is_some() {
        limit
    } else {
        CONVERGED_SLICES_PER_READ
    };
    let full = |events: &Vec<StoredEvent>| i64::try_from(events.len()).unwrap_or(i64::MAX) >= limit;
    while !full(&events) {
        let wanted = limit - i64::try_from(events.len()).unwrap_or(i64::MAX);
        let read = stored::read_entries(pool, cursor, filter, wanted, slice_limit).await?;
        // Complete up to `bound`: past the last row of a full page of rows
        // (or the last slice of a full page of slices) more may be stored.
        let last_of = |rows: bool| {
            read.entries
                .iter()
                .rev()
                .find(|e| matches!(e, LogEntry::Row(_)) == rows)
                .map(LogEntry::last_sequence)
        };
        let bound = [
            read.rows_full.then(|| last_of(true)).flatten(),
            read.slices_full.then(|| last_of(false)).flatten(),
        ]
        .into_iter()
        .flatten()
        .min();
        for entry in read.entries {
            match entry {
                LogEntry::Row(row) => {
                    if bound.is_none_or(|b| row.sequence <= b) {
                        events.push(row);
                    }
                }
                LogEntry::Converged(slice) => expand(&slice, bound, &mut events)?,
            }
        }
        match bound {
            Some(bound) => cursor = bound,
            None => break,
        }
    }
    events.truncate(usize::try_from(limit.max(0)).unwrap_or(usize::MAX));
    Ok(events)
}

/// Appends the events of `slice` up to `bound` to `out`.
fn expand(
    slice: &ConvergedSlice,
    bound: Option<i64>,
    out: &mut Vec<StoredEvent>,
) -> Result<(), StoreError> {
    const CONTEXT: &str = "expanding converged outcomes of the event log";
    let corrupt = |detail: String| StoreError::Corrupt {
        context: CONTEXT,
        detail,
    };
    let elements = slice
        .subjects
        .iter()
        .zip(&slice.generations)
        .zip(&slice.health);
    for (offset, ((subject, generation), health)) in (0_i64..).zip(elements) {
        let index = slice.skip + offset;
        let sequence = slice.first_sequence + index;
        if bound.is_some_and(|b| sequence > b) {
            break;
        }
        let device = DeviceId::parse(subject)
            .map_err(|e| corrupt(format!("subject {subject:?} at {sequence}: {e}")))?;
        let health = match health.as_deref() {
            None => None,
            Some(raw) => Some(
                Health::parse(raw)
                    .ok_or_else(|| corrupt(format!("health {raw:?} at {sequence}")))?,
            ),
        };
        let draft = EventDraft::already_converged(
            &device,
            slice.run_id,
            crate::store::generation(*generation),
            health,
        );
        let row = to_row(
            draft,
            event_id(slice.first_id, index),
            crate::store::to_u64(sequence),
            &slice.source,
            slice.time,
        )
        .map_err(|e| corrupt(e.to_string()))?;
        out.push(StoredEvent {
            sequence: row.sequence,
            event_type: row.event_type,
            subject: row.subject,
            run_id: row.run_id,
            cloudevent: row.cloudevent,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_protocol::event::DeviceOutcomeData;
    use idem_protocol::{Generation, OutcomeKind};

    fn slice(skip: i64, subjects: &[&str]) -> ConvergedSlice {
        ConvergedSlice {
            first_sequence: 100,
            last_sequence: 100 + skip + subjects.len() as i64 - 1,
            skip,
            first_id: slice_ids(1)[0],
            run_id: Uuid::now_v7(),
            source: "/idem/test".to_owned(),
            time: event_time(Utc::now()),
            subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
            generations: (1..=subjects.len() as i64).collect(),
            health: subjects
                .iter()
                .enumerate()
                .map(|(i, _)| (i % 2 == 0).then(|| "healthy".to_owned()))
                .collect(),
        }
    }

    #[test]
    fn an_expanded_converged_event_is_the_event_a_row_would_hold() {
        let slice = slice(0, &["pump-1", "pump-2"]);
        let mut expanded = Vec::new();
        expand(&slice, None, &mut expanded).unwrap();
        assert_eq!(expanded.len(), 2);
        let row_built = |index: usize, health| {
            let device = DeviceId::parse(&slice.subjects[index]).unwrap();
            let data = DeviceOutcomeData {
                outcome: OutcomeKind::AlreadyConverged,
                reason: None,
                health,
                success: true,
            };
            let draft = EventDraft::device_outcome(
                &device,
                slice.run_id,
                Some(Generation(index as u64 + 1)),
                data,
            );
            let id = event_id(slice.first_id, index as i64);
            to_row(draft, id, 100 + index as u64, "/idem/test", slice.time).unwrap()
        };
        for (index, health) in [(0, Some(Health::Healthy)), (1, None)] {
            let row = row_built(index, health);
            let event = &expanded[index];
            assert_eq!(event.cloudevent, row.cloudevent, "event {index}");
            assert_eq!(
                (
                    event.sequence,
                    &event.event_type,
                    &event.subject,
                    event.run_id
                ),
                (row.sequence, &row.event_type, &row.subject, row.run_id)
            );
        }
        assert_eq!(expanded[1].cloudevent["sequence"], 101);
        assert_eq!(expanded[1].cloudevent["subject"], "pump-2");
    }

    #[test]
    fn the_events_of_a_slice_have_distinct_version_7_ids() {
        let slice = slice(0, &["a", "b", "c"]);
        let mut expanded = Vec::new();
        expand(&slice, None, &mut expanded).unwrap();
        let ids: Vec<Uuid> = expanded
            .iter()
            .map(|e| e.cloudevent["id"].as_str().unwrap().parse().unwrap())
            .collect();
        assert_eq!(ids[0], slice.first_id);
        assert!(ids.windows(2).all(|w| w[0] != w[1]));
        assert!(ids.iter().all(|id| id.get_version_num() == 7));
        let last = event_id(slice.first_id, CONVERGED_SLICE as i64 - 1);
        assert_eq!(last.get_version_num(), 7, "the last id of a full slice");
        assert_eq!(last.as_u128() >> 16, slice.first_id.as_u128() >> 16);
    }

    #[test]
    fn a_slice_read_part_way_expands_from_its_skip_up_to_the_bound() {
        // Elements are those after `skip`: the events at 102, 103 and 104.
        let slice = slice(2, &["c", "d", "e"]);
        let mut expanded = Vec::new();
        expand(&slice, Some(103), &mut expanded).unwrap();
        let got: Vec<(i64, &str)> = expanded
            .iter()
            .map(|e| (e.sequence, e.subject.as_str()))
            .collect();
        assert_eq!(got, [(102, "c"), (103, "d")]);
        let id: Uuid = expanded[0].cloudevent["id"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(id, event_id(slice.first_id, 2));
    }
}
