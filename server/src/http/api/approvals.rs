//! Approval: whether a change (a desired state, an exemption, owned fields)
//! needs another operator's approval (the server's `--require-approval`, or
//! an approval policy covering one of its devices), the refusal of a
//! desired change outside an approved plan and of labels that would move a
//! covered device's exemptions or owned fields (409 `approval_required`),
//! and the policies themselves:
//! `POST /v1/approval-policies`, `GET /v1/approval-policies`,
//! `DELETE /v1/approval-policies/{id}`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::{Extension, Json};
use idem_protocol::api::bounds::MAX_APPROVAL_POLICIES;
use idem_protocol::api::{
    ApprovalPolicyList, ApprovalPolicyRequest, ApprovalPolicyView, ErrorBody, ErrorCode, Selector,
};
use idem_protocol::DeviceId;
use serde_json::json;
use sqlx::PgExecutor;
use uuid::Uuid;

use super::command::{recorded, DeviceWrite};
use super::params::{checked_reason, checked_selector, parse_hyphenated_id};
use crate::http::auth::{AuditNote, Call};
use crate::http::error::ApiError;
use crate::http::extract::{ApiJson, ApiPath};
use crate::http::state::AppState;
use crate::store::approvals::{ApprovalPolicyRow, Created, NewApprovalPolicy};
use crate::store::devices::Registration;
use crate::store::{self, Scope};

/// Why a change to `devices` needs approval, if it does: the server's flag
/// first, then the oldest policy covering one of them.
pub(super) async fn approval_needed(
    state: &AppState,
    executor: impl PgExecutor<'_>,
    devices: &[DeviceId],
) -> Result<Option<String>, ApiError> {
    if devices.is_empty() {
        return Ok(None);
    }
    if state.config.changes.require_approval {
        return Ok(Some(EVERY_CHANGE.to_owned()));
    }
    let covering = store::approvals::covering(executor, devices).await?;
    Ok(covering.map(|(policy, covered)| covered_by(&policy, covered)))
}

/// Why an exemption over the devices whose labels contain `selector` needs
/// approval, if it does: the server's flag (whatever it matches now, since
/// every device it comes to match is covered), then the oldest policy
/// covering one of the devices it matches now.
pub(super) async fn approval_needed_by_labels(
    state: &AppState,
    executor: impl PgExecutor<'_>,
    selector: &serde_json::Value,
) -> Result<Option<String>, ApiError> {
    if state.config.changes.require_approval {
        return Ok(Some(EVERY_CHANGE.to_owned()));
    }
    let covering = store::approvals::covering_labels(executor, selector).await?;
    Ok(covering.map(|(policy, covered)| covered_by(&policy, covered)))
}

const EVERY_CHANGE: &str = "the server requires approval of every change (--require-approval)";

fn covered_by(policy: &ApprovalPolicyRow, covered: i64) -> String {
    let labels = serde_json::to_string(&policy.selector).unwrap_or_default();
    format!(
        "approval policy {} (labels {labels}: {}) covers {covered} of its device(s)",
        policy.id, policy.reason
    )
}

/// Refuses labels that change the owned fields of devices that were
/// registered before (`changed`, read in the caller's transaction after the
/// labels were written) when a policy covers one of them: what a device
/// owns is never pushed, so moving it is a change like a desired one.
pub(super) async fn refuse_owned_moved(
    state: &AppState,
    executor: impl PgExecutor<'_>,
    changed: &[DeviceId],
) -> Result<(), ApiError> {
    let Some(reason) = approval_needed(state, executor, changed).await? else {
        return Ok(());
    };
    state.metrics.plan("refused_unapproved");
    Err(ApiError::new(
        StatusCode::CONFLICT,
        ErrorCode::ApprovalRequired,
        format!(
            "these labels change which fields {} device(s) own (the paths the server never \
             pushes), and {reason}; declare owned fields that give the new labels the same \
             paths (PUT /v1/owned-fields, approved by another operator) before relabelling",
            changed.len()
        ),
    ))
}

/// The refusal of a change that needs approval and was not made through
/// an approved plan.
pub(super) fn approval_required(reason: &str) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        ErrorCode::ApprovalRequired,
        format!(
            "this change needs another operator's approval: {reason}; make a plan \
             (POST /v1/plans), have a token other than yours approve it \
             (POST /v1/plans/{{id}}/approve), then apply it (POST /v1/plans/{{id}}/apply)"
        ),
    )
}

/// Refuses a direct desired change to `devices` when it needs approval.
pub(super) async fn refuse_unapproved(
    state: &AppState,
    executor: impl PgExecutor<'_>,
    devices: &[DeviceId],
) -> Result<(), ApiError> {
    match approval_needed(state, executor, devices).await? {
        Some(reason) => {
            state.metrics.plan("refused_unapproved");
            Err(approval_required(&reason))
        }
        None => Ok(()),
    }
}

/// Refuses registrations whose labels take a device out of a policy's
/// selector (read in the caller's transaction, before they are written):
/// leaving a policy is how its approval would be walked around (relabel,
/// change, relabel back). Entering one only adds protection, and is not
/// refused; a registration without labels keeps the device's.
pub(super) async fn refuse_leaving(
    state: &AppState,
    executor: impl PgExecutor<'_>,
    registrations: &[Registration],
) -> Result<(), ApiError> {
    let (ids, labels): (Vec<DeviceId>, Vec<String>) = registrations
        .iter()
        .filter_map(|r| r.labels.as_ref().map(|l| (r.id.clone(), l.to_string())))
        .unzip();
    if ids.is_empty() {
        return Ok(());
    }
    let Some((policy, device)) = store::approvals::first_left(executor, &ids, &labels).await?
    else {
        return Ok(());
    };
    state.metrics.plan("refused_unapproved");
    Err(ApiError::new(
        StatusCode::CONFLICT,
        ErrorCode::ApprovalRequired,
        format!(
            "these labels take device {device} out of approval policy {policy}, whose changes \
             need another operator's approval: a device leaves a policy only when an admin \
             narrows or deletes the policy (DELETE /v1/approval-policies/{policy}, audited), \
             never by its own labels"
        ),
    ))
}

/// `POST /v1/approval-policies`: desired changes to the devices whose
/// labels contain `selector` need another operator's approval from now on.
#[utoipa::path(post, path = "/v1/approval-policies", tag = "approvals",
    request_body = ApprovalPolicyRequest,
    responses((status = 201, body = ApprovalPolicyView), (status = "4XX", body = ErrorBody)))]
pub(super) async fn create_policy(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiJson(body): ApiJson<ApprovalPolicyRequest>,
) -> Result<Response, ApiError> {
    let selector = checked_selector(&body.selector)?;
    checked_reason(&body.reason)?;
    let id = Uuid::now_v7();
    let labels = serde_json::to_value(&selector.labels).unwrap_or_default();
    let new = NewApprovalPolicy {
        id,
        selector: &labels,
        reason: &body.reason,
        author: &call.actor.name,
    };
    let mut write = DeviceWrite::begin(&state).await?;
    let created = store::approvals::create(write.tx().tx(), new, MAX_APPROVAL_POLICIES).await?;
    let view = match created {
        Created::Created(row) => policy_view(row),
        Created::Full(existing) => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                ErrorCode::TooManyApprovalPolicies,
                format!(
                    "{existing} approval policies exist, the most the server allows \
                     ({MAX_APPROVAL_POLICIES}); delete one, or widen a selector"
                ),
            ))
        }
    };
    let note = AuditNote {
        detail: Some(json!({
            "approval_policy": id,
            "selector": labels,
            "reason": body.reason,
            "devices": view.devices,
        })),
        ..AuditNote::default()
    };
    // An exemption no second operator approved stops exempting the devices
    // the policy covers from now on.
    write.refresh_exemptions(Scope::All).await?;
    write
        .commit(
            "committing an approval policy",
            call.audit(StatusCode::CREATED, note),
        )
        .await?;
    Ok(recorded(StatusCode::CREATED, view))
}

/// `GET /v1/approval-policies`: every policy, oldest first.
#[utoipa::path(get, path = "/v1/approval-policies", tag = "approvals",
    responses((status = 200, body = ApprovalPolicyList), (status = "4XX", body = ErrorBody)))]
pub(super) async fn list_policies(
    State(state): State<Arc<AppState>>,
) -> Result<Json<ApprovalPolicyList>, ApiError> {
    let rows = store::approvals::list(&state.pool).await?;
    Ok(Json(ApprovalPolicyList {
        policies: rows.into_iter().map(policy_view).collect(),
    }))
}

/// `DELETE /v1/approval-policies/{id}`: changes to its devices no longer
/// need approval (unless another policy or the server's flag says so).
#[utoipa::path(delete, path = "/v1/approval-policies/{id}", tag = "approvals",
    params(("id" = inline(idem_protocol::api::bounds::schema::UuidText), Path, description = "approval policy id")),
    responses((status = 200, body = ApprovalPolicyView), (status = "4XX", body = ErrorBody)))]
pub(super) async fn delete_policy(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(raw): ApiPath<String>,
) -> Result<Response, ApiError> {
    let id = parse_hyphenated_id(
        &raw,
        ErrorCode::InvalidApprovalPolicyId,
        "an approval policy id (a UUID, as POST /v1/approval-policies answers)",
    )?;
    let mut write = DeviceWrite::begin(&state).await?;
    let row = store::approvals::delete(&mut **write.tx().tx(), id)
        .await?
        .ok_or_else(|| unknown(id))?;
    let note = AuditNote {
        detail: Some(json!({
            "approval_policy": id,
            "selector": row.selector,
            "reason": row.reason,
            "author": row.author,
        })),
        ..AuditNote::default()
    };
    // And exemptions no one approved exempt its devices again.
    write.refresh_exemptions(Scope::All).await?;
    write
        .commit(
            "committing an approval policy's deletion",
            call.audit(StatusCode::OK, note),
        )
        .await?;
    Ok(recorded(StatusCode::OK, policy_view(row)))
}

fn unknown(id: Uuid) -> ApiError {
    ApiError::not_found(
        ErrorCode::UnknownApprovalPolicy,
        format!("no approval policy {id} exists"),
    )
}

fn policy_view(row: ApprovalPolicyRow) -> ApprovalPolicyView {
    ApprovalPolicyView {
        id: row.id,
        selector: Selector {
            labels: serde_json::from_value(row.selector).unwrap_or_default(),
        },
        reason: row.reason,
        author: row.author,
        created_at: row.created_at,
        devices: u64::try_from(row.devices).unwrap_or(0),
    }
}
