//! An event before it has a sequence number: its type, subject, run and
//! generation, and its typed data as JSON. The core builds drafts; `events`
//! turns them into CloudEvents once the store has numbered them.

use idem_protocol::event::{
    DeviceDriftedData, DeviceOutcomeData, DeviceQuarantinedData, EventType, RunCompletedData,
    RunStartedData,
};
use idem_protocol::{DeviceId, Generation, Health, OutcomeKind};
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

/// An event before it has a sequence number.
#[derive(Debug, Clone)]
pub struct EventDraft {
    pub event_type: EventType,
    /// Device id for device events, run id for run events.
    pub subject: String,
    pub run_id: Option<Uuid>,
    pub generation: Option<Generation>,
    pub data: Value,
}

impl EventDraft {
    /// `io.idem.device.{outcome}`: `device`'s outcome in run `run_id`, for
    /// desired `generation`.
    pub fn device_outcome(
        device: &DeviceId,
        run_id: Uuid,
        generation: Option<Generation>,
        data: DeviceOutcomeData,
    ) -> Self {
        Self {
            event_type: EventType::Device(data.outcome),
            subject: device.to_string(),
            run_id: Some(run_id),
            generation,
            data: to_data(&data),
        }
    }

    /// `io.idem.device.already_converged`: `device` already ran desired
    /// `generation` (reporting `health`) when run `run_id` looked at it.
    /// The same event whether it is stored as a row or in a run slice.
    pub fn already_converged(
        device: &DeviceId,
        run_id: Uuid,
        generation: Generation,
        health: Option<Health>,
    ) -> Self {
        let data = DeviceOutcomeData {
            outcome: OutcomeKind::AlreadyConverged,
            reason: None,
            health,
            success: true,
        };
        Self::device_outcome(device, run_id, Some(generation), data)
    }

    /// `io.idem.device.drifted`: `device`, converged on desired
    /// `generation`, reported another spec (outside any run).
    pub fn device_drifted(
        device: &DeviceId,
        generation: Generation,
        data: DeviceDriftedData,
    ) -> Self {
        Self {
            event_type: EventType::DeviceDrifted,
            subject: device.to_string(),
            run_id: None,
            generation: Some(generation),
            data: to_data(&data),
        }
    }

    /// `io.idem.device.quarantined`: `device`'s last allowed attempt in run
    /// `run_id`, for desired `generation`, failed.
    pub fn device_quarantined(
        device: &DeviceId,
        run_id: Uuid,
        generation: Option<Generation>,
        data: DeviceQuarantinedData,
    ) -> Self {
        Self {
            event_type: EventType::DeviceQuarantined,
            subject: device.to_string(),
            run_id: Some(run_id),
            generation,
            data: to_data(&data),
        }
    }

    /// `io.idem.run.started`.
    pub fn run_started(run_id: Uuid, data: RunStartedData) -> Self {
        Self::run(EventType::RunStarted, run_id, to_data(&data))
    }

    /// `io.idem.run.completed`.
    pub fn run_completed(run_id: Uuid, data: RunCompletedData) -> Self {
        Self::run(EventType::RunCompleted, run_id, to_data(&data))
    }

    /// `io.idem.rollout.*`: a step of run `run_id`'s rollout, with that
    /// event type's data ([`EventType`] names it).
    pub fn rollout_step(event_type: EventType, run_id: Uuid, data: &impl Serialize) -> Self {
        Self::run(event_type, run_id, to_data(data))
    }

    fn run(event_type: EventType, run_id: Uuid, data: Value) -> Self {
        Self {
            event_type,
            subject: run_id.to_string(),
            run_id: Some(run_id),
            generation: None,
            data,
        }
    }
}

/// An event's `data` as JSON.
fn to_data(data: &impl Serialize) -> Value {
    // Invariant: only the event data types of `idem_protocol::event` (and
    // the rollout views they name) reach this, plain structs with derived
    // `Serialize` and string map keys, which `serde_json::to_value` never
    // refuses (a float that is not finite becomes `null`).
    serde_json::to_value(data)
        .unwrap_or_else(|e| unreachable!("event data always converts to JSON: {e}"))
}
