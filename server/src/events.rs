//! Outcome events as CloudEvents 1.0 (JSON structured mode): their types and
//! how a draft becomes a stored event once its gap-free sequence is known.
//!
//! Builds events only; storing them is `store::events`, in the same
//! transaction as the state change they report.

use chrono::{DateTime, Utc};
use cloudevents::{EventBuilder, EventBuilderV10};
use serde_json::Value;
use uuid::Uuid;

use crate::reconcile::outcome::OutcomeKind;
use crate::store::events::EventRow;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    Device(OutcomeKind),
    DeviceDrifted,
    DeviceQuarantined,
    RunStarted,
    RunCompleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Device(kind) => match kind {
                OutcomeKind::AlreadyConverged => "io.idem.device.already_converged",
                OutcomeKind::Provisioned => "io.idem.device.provisioned",
                OutcomeKind::Failed => "io.idem.device.failed",
                OutcomeKind::Skipped => "io.idem.device.skipped",
                OutcomeKind::Superseded => "io.idem.device.superseded",
            },
            EventType::DeviceDrifted => "io.idem.device.drifted",
            EventType::DeviceQuarantined => "io.idem.device.quarantined",
            EventType::RunStarted => "io.idem.run.started",
            EventType::RunCompleted => "io.idem.run.completed",
        }
    }
}

/// An event before it has a sequence number.
#[derive(Debug, Clone)]
pub struct EventDraft {
    pub event_type: EventType,
    /// Device id for device events, run id for run events.
    pub subject: String,
    pub run_id: Option<Uuid>,
    pub generation: Option<u64>,
    pub data: Value,
}

#[derive(Debug, thiserror::Error)]
pub enum EventError {
    #[error("building CloudEvent {event_type}: {message}")]
    Build {
        event_type: &'static str,
        message: String,
    },
}

/// Turns drafts into stored events numbered from `first_sequence` on.
pub fn finalize(
    drafts: Vec<EventDraft>,
    first_sequence: u64,
    source: &str,
    time: DateTime<Utc>,
) -> Result<Vec<EventRow>, EventError> {
    drafts
        .into_iter()
        .zip(first_sequence..)
        .map(|(draft, sequence)| to_row(draft, sequence, source, time))
        .collect()
}

fn to_row(
    draft: EventDraft,
    sequence: u64,
    source: &str,
    time: DateTime<Utc>,
) -> Result<EventRow, EventError> {
    let event_type = draft.event_type.as_str();
    let id = Uuid::now_v7();
    let sequence = i64::try_from(sequence).unwrap_or(i64::MAX);
    let mut builder = EventBuilderV10::new()
        .id(id.to_string())
        .ty(event_type)
        .source(source)
        .subject(draft.subject.clone())
        .time(time)
        .extension("sequence", sequence)
        .data("application/json", draft.data);
    if let Some(run_id) = draft.run_id {
        builder = builder.extension("runid", run_id.to_string());
    }
    if let Some(generation) = draft.generation {
        builder = builder.extension("generation", i64::try_from(generation).unwrap_or(i64::MAX));
    }
    let event = builder.build().map_err(|e| EventError::Build {
        event_type,
        message: e.to_string(),
    })?;
    let cloudevent = serde_json::to_value(&event).map_err(|e| EventError::Build {
        event_type,
        message: e.to_string(),
    })?;
    Ok(EventRow {
        sequence,
        id,
        event_type: event_type.to_owned(),
        subject: draft.subject,
        run_id: draft.run_id,
        time,
        cloudevent,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_finalized_event_is_a_structured_cloudevent_with_our_extensions() {
        let run_id = Uuid::now_v7();
        let draft = EventDraft {
            event_type: EventType::Device(OutcomeKind::AlreadyConverged),
            subject: "pump-7".into(),
            run_id: Some(run_id),
            generation: Some(3),
            data: json!({"outcome": "already_converged"}),
        };
        let rows = finalize(vec![draft.clone(), draft], 41, "/idem/test", Utc::now()).unwrap();
        assert_eq!(
            rows.iter().map(|r| r.sequence).collect::<Vec<_>>(),
            vec![41, 42]
        );
        let ce = &rows[0].cloudevent;
        assert_eq!(ce["specversion"], "1.0");
        assert_eq!(ce["type"], "io.idem.device.already_converged");
        assert_eq!(ce["source"], "/idem/test");
        assert_eq!(ce["subject"], "pump-7");
        assert_eq!(ce["sequence"], 41);
        assert_eq!(ce["generation"], 3);
        assert_eq!(ce["runid"], run_id.to_string());
        assert_eq!(ce["datacontenttype"], "application/json");
        assert_eq!(ce["data"]["outcome"], "already_converged");
        let parsed: cloudevents::Event = serde_json::from_value(ce.clone()).unwrap();
        assert_eq!(
            cloudevents::AttributesReader::ty(&parsed),
            "io.idem.device.already_converged"
        );
    }
}
