//! Bodies of `/v1/devices…`: registration, a device as the API shows it,
//! its pages, deletion, desired state of one device and broker credentials.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::{DeviceId, DeviceStatus, Generation, Health, OutcomeKind};

/// One item of `POST /v1/devices` (the body is a list of them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct DeviceRegistration {
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::api::bounds::schema::device_id))]
    pub id: String,
    /// A flat object of string labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::api::bounds::schema::optional_labels))]
    pub labels: Option<Value>,
    /// Desired state recorded for the device (no run is started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::api::bounds::schema::optional_spec))]
    pub spec: Option<Value>,
    /// The device's broker password when the server issues credentials
    /// (`--broker-accounts`); generated when absent. Only for new devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::api::bounds::schema::broker_password))]
    pub broker_password: Option<String>,
}

/// The answer to `POST /v1/devices`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Registered {
    pub created: u64,
    pub updated: u64,
    pub unchanged: u64,
    /// Devices whose desired state changed.
    pub desired_changed: u64,
    /// Broker credentials issued to the new devices (with
    /// `--broker-accounts dynsec|password-file`), shown only in this answer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub credentials: Vec<IssuedCredential>,
}

/// One device's broker credentials, shown once.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct IssuedCredential {
    pub id: String,
    /// The device's id.
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for IssuedCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IssuedCredential({}, ***)", self.id)
    }
}

/// The body of `PUT /v1/devices/{id}` (registers or relabels one device).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct DeviceUpsert {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::api::bounds::schema::optional_labels))]
    pub labels: Option<Value>,
}

/// A device as `GET /v1/devices/{id}` and the device lists show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeviceView {
    pub id: String,
    pub labels: Value,
    pub status: DeviceStatus,
    /// An exemption covers it (`GET /v1/exemptions`): its drift is shown
    /// and evented, never remediated.
    #[serde(default)]
    pub exempt: bool,
    /// `None` until the device has said.
    pub online: Option<bool>,
    pub desired: Option<DesiredView>,
    /// `None` until the server has stored a report.
    pub reported: Option<ReportedView>,
    /// Whether the digests match; `None` while one is missing.
    pub in_sync: Option<bool>,
    pub attempts: u32,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub last_outcome: Option<LastOutcome>,
    pub updated_at: DateTime<Utc>,
    /// The newest attempts, newest first (`GET /v1/devices/{id}` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<Vec<Attempt>>,
    /// What a push would change: the field-level diff from the device's
    /// last report to its desired spec, empty when they match
    /// (`GET /v1/devices/{id}` only, when both are known).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diff: Option<Vec<FieldDiff>>,
}

/// One changed leaf between a device's last report (`old`) and its desired
/// spec (`new`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FieldDiff {
    /// Where: `net.wifi.ssid`, `servers[2]`, `labels["a.b"]`; `$` is the
    /// whole spec.
    pub path: String,
    pub change: FieldChangeKind,
    /// The reported value; `null` when `change` is `added`.
    pub old: Option<serde_json::Value>,
    /// The desired value; `null` when `change` is `removed`.
    pub new: Option<serde_json::Value>,
    /// The path is one the device owns (`PUT /v1/owned-fields`): it never
    /// causes a push or a drift, and is never sent to the device.
    #[serde(default)]
    pub ignored: bool,
}

/// How a leaf differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum FieldChangeKind {
    /// The desired spec has it, the report does not.
    Added,
    /// The report has it, the desired spec does not.
    Removed,
    /// Both have it, with different values.
    Changed,
}

/// A device's desired state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DesiredView {
    pub generation: Generation,
    pub spec: Value,
    pub digest: Option<String>,
    pub updated_at: Option<DateTime<Utc>>,
}

/// A device's stored report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReportedView {
    pub seq: Option<u64>,
    pub generation: Option<Generation>,
    pub spec: Value,
    pub digest: Option<String>,
    pub health: Option<Health>,
    pub error: Option<ReportedError>,
    pub at: Option<DateTime<Utc>>,
}

/// The error a device reported for the generation it rejected.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReportedError {
    pub generation: Generation,
    pub message: String,
}

/// A device's outcome in the last run that decided it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LastOutcome {
    pub outcome: OutcomeKind,
    pub reason: Option<String>,
    pub run_id: Option<Uuid>,
}

/// One attempt in a device's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Attempt {
    pub run_id: Option<Uuid>,
    pub attempt: u32,
    pub generation: Option<Generation>,
    pub result: OutcomeKind,
    pub reason: Option<String>,
    pub at: DateTime<Utc>,
}

/// `GET /v1/devices`: a page in id order; `next_after` continues it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DevicePage {
    pub devices: Vec<DeviceView>,
    pub next_after: Option<String>,
}

/// The query of `GET /v1/devices`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
pub struct DeviceListQuery {
    /// A `DeviceStatus` name.
    #[cfg_attr(feature = "openapi", param(value_type = Option<crate::DeviceStatus>))]
    pub status: Option<String>,
    /// `healthy`, `degraded` or `unhealthy`.
    #[cfg_attr(feature = "openapi", param(value_type = Option<crate::Health>))]
    pub health: Option<String>,
    /// `key:value`; may be given once.
    #[cfg_attr(feature = "openapi", param(schema_with = crate::api::bounds::schema::label_filter))]
    pub label: Option<String>,
    /// The previous page's `next_after`.
    #[cfg_attr(feature = "openapi", param(schema_with = crate::api::bounds::schema::query_text))]
    pub after: Option<String>,
    /// 1 to 1,000 (default 100).
    #[cfg_attr(feature = "openapi", param(schema_with = crate::api::bounds::schema::page_limit))]
    pub limit: Option<i64>,
}

/// The answer to `DELETE /v1/devices/{id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeviceDeleted {
    pub id: DeviceId,
    pub deleted: bool,
    /// Whether the broker account is gone; `None` when the server does not
    /// manage accounts on the broker.
    pub broker_account_removed: Option<bool>,
}

/// The body of `PUT /v1/devices/{id}/desired`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct DeviceDesired {
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::api::bounds::schema::spec))]
    pub spec: Value,
    #[serde(default)]
    pub force: bool,
}

/// The answer to `PUT /v1/devices/{id}/desired`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DesiredSet {
    /// The device's desired generation after the change.
    pub generation: Option<Generation>,
    pub run_id: Uuid,
}

/// The optional body of `POST /v1/devices/{id}/credentials`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CredentialsRequest {
    /// A password of the operator's; generated when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::api::bounds::schema::broker_password))]
    pub password: Option<String>,
}
