//! The outcome events' vocabulary: their CloudEvents types (`io.idem.…`) and
//! the typed `data` of each, shared by the server that writes the events and
//! every client that reads them (SSE, the MQTT event topics, the event log).
//!
//! Names and shapes only: building, numbering and storing CloudEvents is the
//! server's. Decoding ignores fields it does not know, so a newer server's
//! additions do not break older readers.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::digest::SpecDigest;
use crate::outcome::{OutcomeCounts, OutcomeKind};
use crate::payload::Health;
use crate::run::Trigger;

/// The CloudEvents `type` of an outcome event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    /// `io.idem.device.{outcome}`, data [`DeviceOutcomeData`].
    Device(OutcomeKind),
    /// `io.idem.device.drifted`, data [`DeviceDriftedData`].
    DeviceDrifted,
    /// `io.idem.device.quarantined`, data [`DeviceQuarantinedData`].
    DeviceQuarantined,
    /// `io.idem.run.started`, data [`RunStartedData`].
    RunStarted,
    /// `io.idem.run.completed`, data [`RunCompletedData`].
    RunCompleted,
    /// `io.idem.rollout.wave_started`, data [`RolloutWaveData`].
    RolloutWaveStarted,
    /// `io.idem.rollout.wave_completed`, data [`crate::api::WaveView`].
    RolloutWaveCompleted,
    /// `io.idem.rollout.paused`, data [`crate::api::PausedView`].
    RolloutPaused,
    /// `io.idem.rollout.resumed`, data [`RolloutWaveData`].
    RolloutResumed,
    /// `io.idem.rollout.approved`, data [`RolloutApprovedData`].
    RolloutApproved,
    /// `io.idem.rollout.aborted`, data [`RolloutWaveData`].
    RolloutAborted,
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
            EventType::RolloutWaveStarted => "io.idem.rollout.wave_started",
            EventType::RolloutWaveCompleted => "io.idem.rollout.wave_completed",
            EventType::RolloutPaused => "io.idem.rollout.paused",
            EventType::RolloutResumed => "io.idem.rollout.resumed",
            EventType::RolloutApproved => "io.idem.rollout.approved",
            EventType::RolloutAborted => "io.idem.rollout.aborted",
        }
    }

    /// Every event type: one per outcome, then the others.
    pub fn all() -> impl Iterator<Item = EventType> {
        OutcomeKind::ALL.into_iter().map(EventType::Device).chain([
            EventType::DeviceDrifted,
            EventType::DeviceQuarantined,
            EventType::RunStarted,
            EventType::RunCompleted,
            EventType::RolloutWaveStarted,
            EventType::RolloutWaveCompleted,
            EventType::RolloutPaused,
            EventType::RolloutResumed,
            EventType::RolloutApproved,
            EventType::RolloutAborted,
        ])
    }

    pub fn parse(raw: &str) -> Option<Self> {
        EventType::all().find(|t| t.as_str() == raw)
    }
}

impl fmt::Display for EventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for EventType {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for EventType {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        EventType::parse(&text)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown event type {text:?}")))
    }
}

/// `data` of `io.idem.device.{outcome}`: one device's outcome in one run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceOutcomeData {
    pub outcome: OutcomeKind,
    /// Why it failed or was skipped, in words; `null` otherwise.
    pub reason: Option<String>,
    /// The device's last reported health; `null` if it never reported one.
    pub health: Option<Health>,
    /// Provisioned or already converged.
    pub success: bool,
}

/// `data` of `io.idem.device.drifted`: a converged device reported a spec
/// other than its desired one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceDriftedData {
    pub desired_digest: SpecDigest,
    pub reported_digest: SpecDigest,
    /// The `seq` of the report that showed the drift.
    pub reported_seq: u64,
    /// An operator's exemption covers the device: the drift is recorded,
    /// not remediated, until the exemption ends.
    #[serde(default)]
    pub exempt: bool,
    /// Where the report differs from the desired spec: paths only, never
    /// values (a spec may hold secrets), as `GET /v1/devices/{id}`'s `diff`
    /// names them, at most 32 of at most 200 characters each; absent when
    /// the server did not compare (a report stored before a restart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changed_paths: Option<Vec<String>>,
    /// How many more paths differ than `changed_paths` lists.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub more_changed_paths: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// `data` of `io.idem.device.quarantined`: the device's last allowed attempt
/// failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceQuarantinedData {
    /// Attempts made, the failed last one included.
    pub attempts: u32,
    /// The last attempt's failure, in words.
    pub last_error: String,
}

/// `data` of `io.idem.rollout.wave_started`, `…resumed` and `…aborted`:
/// the wave that started, goes on, or was running or paused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutWaveData {
    pub wave: u32,
    /// Devices in the wave.
    pub size: u64,
}

/// `data` of `io.idem.rollout.approved`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutApprovedData {
    /// The wave the rollout waited after.
    pub wave: u32,
    /// The approving token's name.
    pub by: String,
}

/// `data` of `io.idem.run.started`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunStartedData {
    /// Why the run was started (`desired`, `manual`, `drift`, …).
    pub trigger: Trigger,
    pub target_count: u64,
    pub force: bool,
    /// The operator token that started it; `null` for the server's own runs.
    pub started_by: Option<String>,
}

/// `data` of `io.idem.run.completed`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunCompletedData {
    pub trigger: Trigger,
    pub target_count: u64,
    pub counts: OutcomeCounts,
    /// `counts` as the summary line ([`OutcomeCounts::summary`]).
    pub summary: String,
    /// Trigger to last outcome; for a run resumed after a restart, from
    /// the resume. `null` only from servers that did not measure it.
    pub duration_ms: Option<u64>,
    /// Device id → outcome, capped (see `outcomes_truncated`); for a run
    /// resumed after a restart only the outcomes decided since the resume
    /// (and `outcomes_truncated` is true).
    pub outcomes: Option<BTreeMap<String, OutcomeKind>>,
    /// Whether `outcomes` leaves devices out.
    pub outcomes_truncated: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn round_trip<T>(data: &T) -> Value
    where
        T: Serialize + serde::de::DeserializeOwned + PartialEq + fmt::Debug,
    {
        let json = serde_json::to_value(data).unwrap();
        let back: T = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(&back, data);
        json
    }

    #[test]
    fn event_types_round_trip_through_their_names() {
        let all: Vec<EventType> = EventType::all().collect();
        let names: std::collections::BTreeSet<&str> = all.iter().map(|t| t.as_str()).collect();
        assert_eq!(
            names.len(),
            OutcomeKind::ALL.len() + 10,
            "one name per type"
        );
        for t in all {
            assert_eq!(EventType::parse(t.as_str()), Some(t));
            assert_eq!(t.to_string(), t.as_str());
            let json = serde_json::to_value(t).unwrap();
            assert_eq!(json, Value::from(t.as_str()));
            assert_eq!(serde_json::from_value::<EventType>(json).unwrap(), t);
        }
        assert_eq!(
            EventType::Device(OutcomeKind::AlreadyConverged).as_str(),
            "io.idem.device.already_converged"
        );
        assert_eq!(EventType::parse("io.idem.device.converged"), None);
        assert!(serde_json::from_str::<EventType>("\"io.idem.run.paused\"").is_err());
    }

    #[test]
    fn device_outcome_data_has_the_outcome_reason_health_and_success() {
        let data = DeviceOutcomeData {
            outcome: OutcomeKind::Failed,
            reason: Some("rejected by device: flash full".to_owned()),
            health: Some(Health::Degraded),
            success: false,
        };
        assert_eq!(
            round_trip(&data),
            json!({
                "outcome": "failed",
                "reason": "rejected by device: flash full",
                "health": "degraded",
                "success": false,
            })
        );
        let data = DeviceOutcomeData {
            outcome: OutcomeKind::AlreadyConverged,
            reason: None,
            health: None,
            success: true,
        };
        assert_eq!(
            round_trip(&data),
            json!({"outcome": "already_converged", "reason": null, "health": null, "success": true})
        );
    }

    #[test]
    fn drifted_data_has_both_digests_and_the_reported_seq() {
        let desired = SpecDigest::of(&json!({"v": 1}));
        let reported = SpecDigest::of(&json!({"v": 2}));
        let data = DeviceDriftedData {
            desired_digest: desired,
            reported_digest: reported,
            reported_seq: 42,
            exempt: true,
            changed_paths: Some(vec!["net.wifi.ssid".into()]),
            more_changed_paths: 0,
        };
        assert_eq!(
            round_trip(&data),
            json!({
                "desired_digest": desired.to_string(),
                "reported_digest": reported.to_string(),
                "reported_seq": 42,
                "exempt": true,
                "changed_paths": ["net.wifi.ssid"],
            })
        );
    }

    #[test]
    fn quarantined_data_has_the_attempts_and_the_last_error() {
        let data = DeviceQuarantinedData {
            attempts: 3,
            last_error: "rejected by device: no".to_owned(),
        };
        assert_eq!(
            round_trip(&data),
            json!({"attempts": 3, "last_error": "rejected by device: no"})
        );
    }

    #[test]
    fn run_started_data_has_the_trigger_targets_force_and_starter() {
        let data = RunStartedData {
            trigger: Trigger::Manual,
            target_count: 50,
            force: true,
            started_by: None,
        };
        assert_eq!(
            round_trip(&data),
            json!({"trigger": "manual", "target_count": 50, "force": true, "started_by": null})
        );
    }

    #[test]
    fn run_completed_data_has_counts_summary_and_the_capped_outcome_map() {
        let counts = OutcomeCounts {
            already_converged: 1,
            provisioned: 1,
            ..OutcomeCounts::default()
        };
        let data = RunCompletedData {
            trigger: Trigger::Desired,
            target_count: 2,
            counts,
            summary: counts.summary(),
            duration_ms: Some(17),
            outcomes: Some(BTreeMap::from([
                ("a".to_owned(), OutcomeKind::AlreadyConverged),
                ("b".to_owned(), OutcomeKind::Provisioned),
            ])),
            outcomes_truncated: false,
        };
        assert_eq!(
            round_trip(&data),
            json!({
                "trigger": "desired",
                "target_count": 2,
                "counts": {
                    "already_converged": 1,
                    "provisioned": 1,
                    "failed": 0,
                    "skipped": 0,
                    "superseded": 0,
                },
                "summary": "1 already converged, 1 provisioned, 0 failed",
                "duration_ms": 17,
                "outcomes": {"a": "already_converged", "b": "provisioned"},
                "outcomes_truncated": false,
            })
        );
        let resumed = RunCompletedData {
            duration_ms: None,
            outcomes: None,
            outcomes_truncated: true,
            ..data
        };
        let json = round_trip(&resumed);
        assert_eq!(json["duration_ms"], Value::Null);
        assert_eq!(json["outcomes"], Value::Null);
    }
}
