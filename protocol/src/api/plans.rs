//! Bodies of `/v1/plans…`: a plan (what a desired change would do, device
//! by device, before anything moves), a page of its devices and the query
//! that asks for one.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::FieldDiff;
use crate::Generation;

/// `POST /v1/plans`, `GET /v1/plans/{id}`: a desired change computed and
/// not applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PlanView {
    pub plan_id: Uuid,
    pub state: PlanState,
    /// The run that applied it (`state` is `applied`).
    pub applied_run: Option<Uuid>,
    /// The operator token that made it.
    pub author: String,
    pub created_at: DateTime<Utc>,
    /// Applying it later is refused (`410 plan_expired`).
    pub expires_at: DateTime<Utc>,
    /// The digest of the planned desired spec.
    pub digest: String,
    pub force: bool,
    pub counts: PlanCounts,
    /// The first page of the devices it would push to, in id order, each
    /// with its field-level diff.
    pub devices: Vec<PlannedDevice>,
    /// Continue with `GET /v1/plans/{id}/devices?change=push&after=…`.
    pub next_after: Option<String>,
    /// Whether applying it needs another operator's approval, and who gave it.
    pub approval: Approval,
}

/// The approval of a plan or an exemption: required when the server
/// requires it of every change (`--require-approval`) or an approval policy
/// covers one of its devices (for a plan, judged again when it is applied).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Approval {
    pub required: bool,
    /// Why it is required (the flag, or the policy and how many of the
    /// change's devices it covers).
    pub reason: Option<String>,
    /// The token that approved it (`POST /v1/plans/{id}/approve`,
    /// `POST /v1/exemptions/{id}/approve`).
    pub approved_by: Option<String>,
    pub approved_at: Option<DateTime<Utc>>,
}

/// The body of `POST /v1/plans/{id}/apply` (optional): the waves to apply
/// the plan in.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PlanApplyRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::api::rollouts::schema::optional_rollout))]
    pub rollout: Option<super::RolloutRequest>,
}

/// The answer of `POST /v1/plans/{id}/approve`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PlanApproved {
    pub plan_id: Uuid,
    pub approved_by: String,
    pub approved_at: DateTime<Utc>,
}

/// Where a plan stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum PlanState {
    /// It can be applied.
    Open,
    /// A run applied it (`applied_run`).
    Applied,
    /// Past `expires_at`: re-plan.
    Expired,
}

/// How many targeted devices get each verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PlanCounts {
    pub targets: u64,
    /// Their report already matches: `already_converged`, no push.
    pub already_converged: u64,
    /// Applying pushes to them.
    pub push: u64,
    /// Applying does not push to them, by reason (below).
    pub skipped: u64,
    pub skipped_by_reason: PlanSkipCounts,
}

/// The skipped devices of a plan, by reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PlanSkipCounts {
    pub offline: u64,
    pub quarantined: u64,
    /// Covered by an exemption (`POST /v1/exemptions`).
    pub exempt: u64,
    /// Never reported: the run asks them to report and decides then.
    pub no_report: u64,
}

/// One targeted device of a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PlannedDevice {
    pub device_id: String,
    pub change: PlanChange,
    /// Why it is skipped (`change` is `skipped`).
    pub reason: Option<PlanSkipReason>,
    /// Its desired generation once the plan is applied.
    pub generation: Generation,
    /// True when its desired spec already is the planned one: applying
    /// creates no new generation for it.
    pub unchanged: bool,
    /// From its last report to the planned spec (`[]`: they match);
    /// `null` when it never reported.
    pub diff: Option<Vec<FieldDiff>>,
    /// True when the device reported again after the plan was made: `diff`
    /// is from that newer report. Applying the plan is refused when that
    /// report says something else than the one it was made on.
    pub reported_since_plan: bool,
}

/// What applying a plan does to a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum PlanChange {
    Push,
    Converged,
    Skipped,
}

/// Why a plan skips a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum PlanSkipReason {
    Offline,
    Quarantined,
    Exempt,
    NoReport,
}

/// `GET /v1/plans/{id}/devices`: a page in device-id order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PlanDevicePage {
    pub devices: Vec<PlannedDevice>,
    pub next_after: Option<String>,
}

/// The query of `GET /v1/plans/{id}/devices`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
pub struct PlanDeviceQuery {
    /// Only devices with this change.
    pub change: Option<PlanChange>,
    /// The previous page's `next_after`.
    #[cfg_attr(feature = "openapi", param(schema_with = crate::api::bounds::schema::query_text))]
    pub after: Option<String>,
    #[cfg_attr(feature = "openapi", param(schema_with = crate::api::bounds::schema::page_limit))]
    pub limit: Option<i64>,
}

/// The body of `POST /v1/plans` as the document states it: a
/// [`super::DesiredRequest`] without `rollout`, which is given when the plan
/// is applied.
#[cfg(feature = "openapi")]
pub struct PlanRequest;

#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for PlanRequest {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::extensions::Extensions;
        use utoipa::openapi::schema::{AllOfBuilder, ObjectBuilder};
        use utoipa::openapi::{Ref, RefOr};
        // `not`, which utoipa's builders lack, written as an extension
        // (serialized key by key).
        let no_rollout = ObjectBuilder::new().extensions(Some(Extensions::from_iter([(
            "not",
            serde_json::json!({ "required": ["rollout"] }),
        )])));
        RefOr::T(
            AllOfBuilder::new()
                .item(RefOr::Ref(Ref::from_schema_name("DesiredRequest")))
                .item(no_rollout)
                .description(Some(
                    "a desired change to plan; `rollout` is given when the plan is applied (POST /v1/plans/{id}/apply), and 400 invalid_rollout here",
                ))
                .into(),
        )
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for PlanRequest {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        schemas.push((
            "DesiredRequest".to_owned(),
            <super::DesiredRequest as utoipa::PartialSchema>::schema(),
        ));
    }
}
