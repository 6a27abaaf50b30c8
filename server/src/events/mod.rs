//! Outcome events as CloudEvents 1.0 (JSON structured mode): drafts built
//! from the typed data of `idem_protocol::event` (re-exported here), and how
//! a draft becomes a stored event once its gap-free sequence is known.
//!
//! Builds events only; storing them is `store::events`, in the same
//! transaction as the state change they report.

pub mod log;
pub(crate) mod relay;

use chrono::{DateTime, Utc};
use cloudevents::{EventBuilder, EventBuilderV10};
use uuid::Uuid;

pub use idem_protocol::event::{
    DeviceDriftedData, DeviceOutcomeData, DeviceQuarantinedData, EventType, RunCompletedData,
    RunStartedData,
};

pub use crate::reconcile::event_draft::EventDraft;
use crate::store::events::EventRow;

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
        .map(|(draft, sequence)| to_row(draft, Uuid::now_v7(), sequence, source, time))
        .collect()
}

/// `draft` as the CloudEvent with `id` at `sequence`.
fn to_row(
    draft: EventDraft,
    id: Uuid,
    sequence: u64,
    source: &str,
    time: DateTime<Utc>,
) -> Result<EventRow, EventError> {
    let event_type = draft.event_type.as_str();
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
        builder = builder.extension(
            "generation",
            i64::try_from(generation.get()).unwrap_or(i64::MAX),
        );
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
    use idem_protocol::{DeviceId, Generation, Health, OutcomeCounts, OutcomeKind, SpecDigest};
    use serde_json::json;

    fn device() -> DeviceId {
        DeviceId::parse("pump-7").unwrap()
    }

    #[test]
    fn a_device_outcome_draft_is_typed_by_its_outcome_and_keeps_the_data_shape() {
        let run_id = Uuid::now_v7();
        let draft = EventDraft::device_outcome(
            &device(),
            run_id,
            Some(Generation(3)),
            DeviceOutcomeData {
                outcome: OutcomeKind::Failed,
                reason: Some("timeout: device never reported its state".to_owned()),
                health: Some(Health::Unhealthy),
                success: false,
            },
        );
        assert_eq!(draft.event_type.as_str(), "io.idem.device.failed");
        assert_eq!(draft.subject, "pump-7");
        assert_eq!(draft.run_id, Some(run_id));
        assert_eq!(draft.generation, Some(Generation(3)));
        assert_eq!(
            draft.data.to_string(),
            json!({
                "outcome": "failed",
                "reason": "timeout: device never reported its state",
                "health": "unhealthy",
                "success": false,
            })
            .to_string()
        );
    }

    #[test]
    fn drifted_and_quarantined_drafts_keep_their_data_shape() {
        let desired = SpecDigest::of(&json!({"v": 1}));
        let reported = SpecDigest::of(&json!({"v": 2}));
        let drifted = EventDraft::device_drifted(
            &device(),
            Generation(4),
            DeviceDriftedData {
                desired_digest: desired,
                reported_digest: reported,
                reported_seq: 99,
                exempt: false,
                changed_paths: None,
                more_changed_paths: 0,
            },
        );
        assert_eq!(drifted.event_type, EventType::DeviceDrifted);
        assert_eq!(
            (drifted.run_id, drifted.generation),
            (None, Some(Generation(4)))
        );
        assert_eq!(
            drifted.data.to_string(),
            json!({
                "desired_digest": desired.to_string(),
                "reported_digest": reported.to_string(),
                "reported_seq": 99,
                "exempt": false,
            })
            .to_string()
        );

        let run_id = Uuid::now_v7();
        let quarantined = EventDraft::device_quarantined(
            &device(),
            run_id,
            None,
            DeviceQuarantinedData {
                attempts: 3,
                last_error: "rejected by device: no".to_owned(),
            },
        );
        assert_eq!(quarantined.event_type, EventType::DeviceQuarantined);
        assert_eq!(quarantined.subject, "pump-7");
        assert_eq!(quarantined.run_id, Some(run_id));
        assert_eq!(
            quarantined.data.to_string(),
            json!({"attempts": 3, "last_error": "rejected by device: no"}).to_string()
        );
    }

    #[test]
    fn run_drafts_have_the_run_as_subject_and_keep_their_data_shape() {
        let run_id = Uuid::now_v7();
        let started = EventDraft::run_started(
            run_id,
            RunStartedData {
                trigger: idem_protocol::Trigger::Desired,
                target_count: 2,
                force: false,
                started_by: Some("ci".to_owned()),
            },
        );
        assert_eq!(started.event_type, EventType::RunStarted);
        assert_eq!(started.subject, run_id.to_string());
        assert_eq!((started.run_id, started.generation), (Some(run_id), None));
        assert_eq!(
            started.data.to_string(),
            json!({"trigger": "desired", "target_count": 2, "force": false, "started_by": "ci"})
                .to_string()
        );

        let counts = OutcomeCounts {
            provisioned: 2,
            ..OutcomeCounts::default()
        };
        let outcomes = std::collections::BTreeMap::from([
            ("a".to_owned(), OutcomeKind::Provisioned),
            ("b".to_owned(), OutcomeKind::Provisioned),
        ]);
        let completed = EventDraft::run_completed(
            run_id,
            RunCompletedData {
                trigger: idem_protocol::Trigger::Desired,
                target_count: 2,
                counts,
                summary: counts.summary(),
                duration_ms: Some(1500),
                outcomes: Some(outcomes),
                outcomes_truncated: false,
            },
        );
        assert_eq!(completed.event_type, EventType::RunCompleted);
        assert_eq!(completed.subject, run_id.to_string());
        assert_eq!(
            completed.data.to_string(),
            json!({
                "trigger": "desired",
                "target_count": 2,
                "counts": counts,
                "summary": "0 already converged, 2 provisioned, 0 failed",
                "duration_ms": 1500,
                "outcomes": {"a": "provisioned", "b": "provisioned"},
                "outcomes_truncated": false,
            })
            .to_string()
        );
    }

    #[test]
    fn a_finalized_event_is_a_structured_cloudevent_with_our_extensions() {
        let run_id = Uuid::now_v7();
        let draft = EventDraft {
            event_type: EventType::Device(OutcomeKind::AlreadyConverged),
            subject: "pump-7".into(),
            run_id: Some(run_id),
            generation: Some(Generation(3)),
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
