//! The HTTP API's request and answer bodies (`/v1/…`, `/healthz`,
//! `/readyz`), defined once: the server builds its answers from them, the
//! simulator and the tests decode them. Pure serde types, no IO; with the
//! `openapi` feature each derives `utoipa::ToSchema` (or `IntoParams` for a
//! query) for the server's OpenAPI document.
//!
//! Answers keep `null` for absent values (`Option` without
//! `skip_serializing_if`), as the API always has; requests leave absent
//! fields out.

mod access;
mod approvals;
pub mod bounds;
mod cluster;
mod devices;
mod error_code;
mod exemptions;
mod owned;
mod plans;
pub mod rollouts;
mod runs;
mod targeting;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use access::{
    AuditEntry, AuditPage, AuditQuery, TokenCreated, TokenList, TokenRequest, TokenRevoked,
    TokenView,
};
pub use approvals::{ApprovalPolicyList, ApprovalPolicyRequest, ApprovalPolicyView};
pub use cluster::{ClusterInstance, ClusterLease, ClusterView};
pub use devices::{
    Attempt, CredentialsRequest, DesiredSet, DesiredView, DeviceDeleted, DeviceDesired,
    DeviceListQuery, DevicePage, DeviceRegistration, DeviceUpsert, DeviceView, FieldChangeKind,
    FieldDiff, IssuedCredential, LastOutcome, Registered, ReportedError, ReportedView,
};
pub use error_code::ErrorCode;
#[cfg(feature = "openapi")]
pub use exemptions::schema::ExemptionRequest as ExemptionRequestSchema;
pub use exemptions::{ExemptionList, ExemptionRequest, ExemptionView};
pub use owned::{OwnedBySelector, OwnedFieldsDeclaration, OwnedFieldsProposal, OwnedFieldsView};
#[cfg(feature = "openapi")]
pub use plans::PlanRequest;
pub use plans::{
    Approval, PlanApplyRequest, PlanApproved, PlanChange, PlanCounts, PlanDevicePage,
    PlanDeviceQuery, PlanSkipCounts, PlanSkipReason, PlanState, PlanView, PlannedDevice,
};
pub use rollouts::{
    ApprovalView, GatesRequest, PausedView, RolloutActed, RolloutRequest, RolloutStateName,
    RolloutView, WaveDetail, WaveRequest, WaveSizeRequest, WaveState, WaveView,
};
pub use runs::{
    FleetSummary, OutcomePage, OutcomeQuery, OutcomeRow, PushCounts, RunListQuery, RunPage,
    RunStarted, RunView,
};
#[cfg(feature = "openapi")]
pub use targeting::schema::{DesiredRequest, RunRequest};
pub use targeting::{Selector, TargetedRequest, Targeting, TargetingError};

/// Every error answer: `{"error": {"code", "message"}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// A stable machine-readable `code` and a message that says what to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorDetail {
    /// An [`ErrorCode`]; kept as text so that a client reads the codes of
    /// a newer server too (`ErrorCode::parse`).
    #[cfg_attr(feature = "openapi", schema(value_type = ErrorCode))]
    pub code: String,
    pub message: String,
}

/// `GET /healthz`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Liveness {
    /// Always `ok`.
    pub status: String,
}

/// `GET /readyz` (200 when `ready`, 503 otherwise).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Readiness {
    pub ready: bool,
    pub database: bool,
    pub mqtt: bool,
    /// Workers (`ingest`, `engine`) failing to commit, with why.
    pub stuck: BTreeMap<String, String>,
    /// The work this instance owns now, of what one instance at a time
    /// does: `relay` (publishing the event log to MQTT).
    #[serde(default)]
    pub owns: Vec<String>,
}

/// Serde's `skip_serializing_if` for flags that are false by default.
#[allow(clippy::trivially_copy_pass_by_ref)]
fn is_false(flag: &bool) -> bool {
    !*flag
}
