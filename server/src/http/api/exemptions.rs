//! Drift exemptions: `POST /v1/exemptions` exempts one device or the devices
//! a label selector matches from remediation until it expires (their drift
//! is still detected, evented and shown), `GET /v1/exemptions` lists those
//! in force, `POST /v1/exemptions/{id}/approve` records another operator's
//! approval (without which an exemption exempts no device an approval
//! policy covers), `DELETE /v1/exemptions/{id}` ends one early. Creating,
//! approving and deleting commit with their audit record through the
//! command layer.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::{Extension, Json};
use chrono::Utc;
use idem_protocol::api::bounds::{MAX_EXEMPTIONS, MAX_EXEMPTIONS_PER_AUTHOR};
use idem_protocol::api::{
    Approval, ErrorBody, ErrorCode, ExemptionList, ExemptionRequest, ExemptionView, Selector,
};
use serde_json::json;
use uuid::Uuid;

use super::approvals::{approval_needed, approval_needed_by_labels};
use super::command::{recorded, DeviceWrite};
use super::params::{checked_reason, checked_selector, parse_hyphenated_id, registered};
use crate::config::parse_duration;
use crate::http::auth::{AuditNote, Call};
use crate::http::error::ApiError;
use crate::http::extract::{ApiJson, ApiPath};
use crate::http::state::AppState;
use crate::store;
use crate::store::exemptions::{self as stored, ExemptionRow, NewExemption};
use crate::store::Scope;

/// `POST /v1/exemptions`: exempts a device, or a selector's devices, from
/// remediation until `expires_in` has passed.
#[utoipa::path(post, path = "/v1/exemptions", tag = "exemptions",
    request_body = idem_protocol::api::ExemptionRequestSchema,
    responses((status = 201, body = ExemptionView), (status = "4XX", body = ErrorBody)))]
pub(super) async fn create_exemption(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiJson(body): ApiJson<ExemptionRequest>,
) -> Result<Response, ApiError> {
    let (device, selector) = match (&body.device, &body.selector) {
        (Some(raw), None) => (Some(registered(&state, raw).await?), None),
        (None, Some(selector)) => (None, Some(checked_selector(selector)?)),
        (Some(_), Some(_)) | (None, None) => {
            return Err(ApiError::bad_request(
                ErrorCode::InvalidTargets,
                "give exactly one of `device` (an id) and `selector` ({\"labels\": {...}})",
            ))
        }
    };
    checked_reason(&body.reason)?;
    let lifetime = lifetime(
        body.expires_in.as_deref(),
        state.config.changes.exemption_max,
    )?;
    let expires_at =
        Utc::now() + chrono::Duration::from_std(lifetime).unwrap_or(chrono::Duration::days(365));
    let mut write = DeviceWrite::begin(&state).await?;
    let own = store::exemptions::count_active_by(&mut **write.tx().tx(), &call.actor.name).await?;
    if own >= MAX_EXEMPTIONS_PER_AUTHOR {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::TooManyExemptions,
            format!(
                "{own} of your exemptions are in force, the most one operator may have \
                 ({MAX_EXEMPTIONS_PER_AUTHOR}); delete one of yours, or use a selector for many \
                 devices"
            ),
        ));
    }
    let active = store::exemptions::count_active(&mut **write.tx().tx()).await?;
    if active >= MAX_EXEMPTIONS {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::TooManyExemptions,
            format!(
                "{active} exemptions are in force, the most the server allows \
                 ({MAX_EXEMPTIONS}); delete one, or use a selector for many devices"
            ),
        ));
    }
    let id = Uuid::now_v7();
    let selector_labels = selector
        .as_ref()
        .map(|s| serde_json::to_value(&s.labels).unwrap_or_default());
    // Exempting a covered device changes what the server does to it: like
    // a desired change, it waits for another operator's approval.
    let needs_approval = match (&device, &selector_labels) {
        (Some(device), _) => {
            approval_needed(&state, &mut **write.tx().tx(), std::slice::from_ref(device)).await?
        }
        (None, Some(labels)) => {
            approval_needed_by_labels(&state, &mut **write.tx().tx(), labels).await?
        }
        (None, None) => None,
    };
    let new = NewExemption {
        id,
        device_id: device.as_ref().map(|d| d.as_str()),
        selector: selector_labels.as_ref(),
        reason: &body.reason,
        author: &call.actor.name,
        expires_at,
        needs_approval: needs_approval.as_deref(),
    };
    store::exemptions::create(write.tx(), new).await?;
    match &device {
        Some(device) => {
            write
                .refresh_exemptions(Scope::Devices(std::slice::from_ref(device)))
                .await?
        }
        None => write.refresh_exemptions(Scope::All).await?,
    }
    // Read in its own transaction: once committed, one with a lifetime of a
    // second may expire (and be swept) before it could be read back.
    let view = store::exemptions::get(&mut **write.tx().tx(), id)
        .await?
        .map(exemption_view)
        .ok_or_else(|| unknown(id))?;
    let note = AuditNote {
        detail: Some(json!({
            "exemption": id,
            "device": device.as_ref().map(|d| d.as_str()),
            "selector": selector_labels,
            "reason": body.reason,
            "expires_at": expires_at,
            "approval_required": needs_approval,
        })),
        ..AuditNote::default()
    };
    write
        .commit(
            "committing an exemption",
            call.audit(StatusCode::CREATED, note),
        )
        .await?;
    Ok(recorded(StatusCode::CREATED, view))
}

/// `GET /v1/exemptions`: every exemption in force.
#[utoipa::path(get, path = "/v1/exemptions", tag = "exemptions",
    responses((status = 200, body = ExemptionList), (status = "4XX", body = ErrorBody)))]
pub(super) async fn list_exemptions(
    State(state): State<Arc<AppState>>,
) -> Result<Json<ExemptionList>, ApiError> {
    let rows = store::exemptions::list(&state.pool).await?;
    Ok(Json(ExemptionList {
        exemptions: rows.into_iter().map(exemption_view).collect(),
    }))
}

/// `POST /v1/exemptions/{id}/approve`: approves an exemption in force, by a
/// token other than its author's (403 `self_approval`); from then on it
/// exempts the devices a policy covers too.
#[utoipa::path(post, path = "/v1/exemptions/{id}/approve", tag = "exemptions",
    params(("id" = inline(idem_protocol::api::bounds::schema::UuidText), Path, description = "exemption id")),
    responses((status = 200, body = ExemptionView), (status = "4XX", body = ErrorBody)))]
pub(super) async fn approve_exemption(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(raw): ApiPath<String>,
) -> Result<Response, ApiError> {
    let id = parse_hyphenated_id(
        &raw,
        ErrorCode::InvalidExemptionId,
        "an exemption id (a UUID, as POST /v1/exemptions answers)",
    )?;
    let mut write = DeviceWrite::begin(&state).await?;
    let row = match stored::approve(write.tx(), id, &call.actor.name).await? {
        stored::Approval::Approved(row) => row,
        stored::Approval::Unknown => return Err(unknown(id)),
        stored::Approval::OwnAuthor => {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                ErrorCode::SelfApproval,
                format!(
                    "exemption {id} was made by {}: its author cannot approve it; another \
                     operator's token must",
                    call.actor.name
                ),
            ))
        }
        stored::Approval::Already(by, at) => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                ErrorCode::AlreadyApproved,
                format!("exemption {id} was approved already, by {by} at {at}"),
            ))
        }
    };
    match &row.device_id {
        Some(device) => {
            let device = store::device_id(device, "reading an approved exemption's device")?;
            write
                .refresh_exemptions(Scope::Devices(std::slice::from_ref(&device)))
                .await?
        }
        None => write.refresh_exemptions(Scope::All).await?,
    }
    state.metrics.plan("approved");
    let note = AuditNote {
        detail: Some(json!({
            "exemption": id,
            "exemption_author": row.author,
            "approved_by": call.actor.name,
        })),
        ..AuditNote::default()
    };
    write
        .commit(
            "committing an exemption's approval",
            call.audit(StatusCode::OK, note),
        )
        .await?;
    Ok(recorded(StatusCode::OK, exemption_view(row)))
}

/// `DELETE /v1/exemptions/{id}`: ends an exemption now; its devices are
/// reconciled like any drifted one.
#[utoipa::path(delete, path = "/v1/exemptions/{id}", tag = "exemptions",
    params(("id" = inline(idem_protocol::api::bounds::schema::UuidText), Path, description = "exemption id")),
    responses((status = 200, body = ExemptionView), (status = "4XX", body = ErrorBody)))]
pub(super) async fn delete_exemption(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(raw): ApiPath<String>,
) -> Result<Response, ApiError> {
    let id = parse_hyphenated_id(
        &raw,
        ErrorCode::InvalidExemptionId,
        "an exemption id (a UUID, as POST /v1/exemptions answers)",
    )?;
    let mut write = DeviceWrite::begin(&state).await?;
    let Some(row) = store::exemptions::delete(write.tx(), id).await? else {
        return Err(unknown(id));
    };
    write.refresh_exemptions(Scope::All).await?;
    let note = AuditNote {
        detail: Some(json!({"exemption": id, "reason": row.reason, "author": row.author})),
        ..AuditNote::default()
    };
    write
        .commit("deleting an exemption", call.audit(StatusCode::OK, note))
        .await?;
    Ok(recorded(StatusCode::OK, exemption_view(row)))
}

/// `expires_in`, between a second and `max`.
fn lifetime(raw: Option<&str>, max: Duration) -> Result<Duration, ApiError> {
    let limit = humantime_like(max);
    let Some(raw) = raw else {
        return Err(ApiError::bad_request(
            ErrorCode::MissingExpiry,
            format!("`expires_in` is required (e.g. \"4h\", \"7d\"; at most {limit})"),
        ));
    };
    let lifetime = parse_duration(raw).map_err(|e| {
        ApiError::bad_request(ErrorCode::InvalidExpiry, format!("`expires_in`: {e}"))
    })?;
    if lifetime < Duration::from_secs(1) || lifetime > max {
        return Err(ApiError::bad_request(
            ErrorCode::InvalidExpiry,
            format!(
                "`expires_in` {raw:?} is outside 1s to {limit}, the longest exemption this \
                 server allows (--exemption-max)"
            ),
        ));
    }
    Ok(lifetime)
}

/// `30d`, `12h`, `90s`: a limit as an operator writes it.
fn humantime_like(d: Duration) -> String {
    let secs = d.as_secs();
    match secs {
        s if s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s % 3_600 == 0 => format!("{}h", s / 3_600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

fn unknown(id: Uuid) -> ApiError {
    ApiError::not_found(
        ErrorCode::UnknownExemption,
        format!("no exemption {id} is in force (it may have expired)"),
    )
}

fn exemption_view(row: ExemptionRow) -> ExemptionView {
    let selector = row
        .selector
        .and_then(|labels| serde_json::from_value(labels).ok())
        .map(|labels| Selector { labels });
    ExemptionView {
        id: row.id,
        device: row.device_id,
        selector,
        reason: row.reason,
        author: row.author,
        created_at: row.created_at,
        expires_at: row.expires_at,
        devices: u64::try_from(row.devices).unwrap_or(0),
        approval: Approval {
            required: row.needs_approval,
            reason: row.approval_reason,
            approved_by: row.approved_by,
            approved_at: row.approved_at,
        },
    }
}
