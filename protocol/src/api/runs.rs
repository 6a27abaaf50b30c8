//! Bodies of `/v1/runs…` and `/v1/fleet`: a started run, a run, its
//! outcomes and the fleet summary.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{Generation, Health, OutcomeCounts, OutcomeKind, RunState, Trigger};

/// The answer of every call that starts a run (`POST /v1/runs`,
/// `POST /v1/desired`, the retries).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunStarted {
    pub run_id: Uuid,
    pub targets: u64,
    /// `POST /v1/runs` only: whether the call joined an identical manual
    /// run still in progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub joined: Option<bool>,
}

/// A run as `GET /v1/runs/{id}` and `GET /v1/runs` show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunView {
    pub id: Uuid,
    pub trigger: Trigger,
    pub state: RunState,
    pub force: bool,
    pub target_count: u64,
    pub counts: OutcomeCounts,
    /// The summary line of `counts`.
    pub summary: String,
    pub started_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub duration_ms: Option<u64>,
    /// The operator token that started the run; `None` for runs the server
    /// started itself (see `trigger`).
    pub started_by: Option<String>,
    /// The plan this run applied (`POST /v1/plans/{id}/apply`); absent
    /// for every other run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan_id: Option<Uuid>,
    /// The approval of the plan it applied, when it needed one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<super::ApprovalView>,
    /// Its waves and where they stand, for a staged rollout; absent for
    /// every other run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<super::RolloutView>,
}

impl RunView {
    pub fn is_completed(&self) -> bool {
        self.state == RunState::Completed
    }
}

/// `GET /v1/runs`: newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunPage {
    pub runs: Vec<RunView>,
}

/// The query of `GET /v1/runs`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
pub struct RunListQuery {
    #[cfg_attr(feature = "openapi", param(schema_with = crate::api::bounds::schema::page_limit))]
    pub limit: Option<i64>,
    /// Runs started before this time (the last run's `started_at`).
    pub before: Option<DateTime<Utc>>,
}

/// One device's row in a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OutcomeRow {
    pub device_id: String,
    /// `None` while the device is undecided.
    pub outcome: Option<OutcomeKind>,
    pub reason: Option<String>,
    pub generation: Option<Generation>,
    pub health: Option<Health>,
    pub decided_at: Option<DateTime<Utc>>,
}

/// `GET /v1/runs/{id}/outcomes`: a page in device-id order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OutcomePage {
    pub outcomes: Vec<OutcomeRow>,
    pub next_after: Option<String>,
}

/// The query of `GET /v1/runs/{id}/outcomes`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
pub struct OutcomeQuery {
    /// Only rows with this `OutcomeKind`.
    #[cfg_attr(feature = "openapi", param(value_type = Option<crate::OutcomeKind>))]
    pub outcome: Option<String>,
    /// The previous page's `next_after`.
    #[cfg_attr(feature = "openapi", param(schema_with = crate::api::bounds::schema::query_text))]
    pub after: Option<String>,
    #[cfg_attr(feature = "openapi", param(schema_with = crate::api::bounds::schema::page_limit))]
    pub limit: Option<i64>,
}

/// `GET /v1/fleet`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FleetSummary {
    /// Registered devices.
    pub devices: u64,
    /// Devices per `DeviceStatus` name (every status, 0 included).
    pub by_status: BTreeMap<String, u64>,
    /// Converged devices that report bad health.
    pub unhealthy_converged: u64,
    pub pushes: PushCounts,
    pub attempts_in_flight: u64,
}

/// The engine's pushes right now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PushCounts {
    pub queued: u64,
    pub in_flight: u64,
}
