//! Desired state: `PUT /v1/devices/{id}/desired` and `POST /v1/desired`,
//! each committing the change with its run through [`super::command`]
//! (refused when it needs an approval: [`super::approvals`]);
//! and what a bulk call targets (shared with `POST /v1/runs`).

use idem_protocol::api::ErrorCode;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::Extension;
use idem_protocol::api::{
    DesiredSet, DeviceDesired, ErrorBody, RunStarted, TargetedRequest, Targeting,
};
use idem_protocol::{DeviceId, SpecDigest};
use serde_json::{json, Value};

use super::approvals::refuse_unapproved;
use super::command::{audited_ids, recorded, start_run};
use super::params::registered;
use crate::engine::new_run::{NewRun, Trigger};
use crate::http::auth::{AuditNote, Call};
use crate::http::error::ApiError;
use crate::http::extract::{ApiJson, ApiPath};
use crate::http::input;
use crate::http::state::AppState;
use crate::store;

/// Unknown ids named in an error message (and ids in an audit note), at most.
const MAX_IDS_SHOWN: usize = 20;

/// `PUT /v1/devices/{id}/desired`: a new desired spec for one device and
/// the run that applies it.
#[utoipa::path(put, path = "/v1/devices/{id}/desired", tag = "desired",
    params(("id" = inline(DeviceId), Path, description = "device id")),
    request_body = DeviceDesired,
    responses((status = 200, body = DesiredSet), (status = "4XX", body = ErrorBody)))]
pub(super) async fn set_device_desired(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(raw_id): ApiPath<String>,
    ApiJson(body): ApiJson<DeviceDesired>,
) -> Result<Response, ApiError> {
    let id = registered(&state, &raw_id).await?;
    input::check_spec(state.config.fleet.budget, &body.spec)?;
    refuse_unapproved(&state, &state.pool, std::slice::from_ref(&id)).await?;
    let note = AuditNote {
        targets: Some(1),
        detail: Some(
            json!({"devices": audited_ids([id.as_str()]), "digest": SpecDigest::of(&body.spec).to_string(), "force": body.force}),
        ),
        ..AuditNote::default()
    };
    let run = NewRun::new(vec![id.clone()], Trigger::Desired)
        .forced(body.force)
        .changing_desired_to(body.spec);
    let (run, _) = start_run(&state, &call, run, note).await?;
    let generation = state
        .fleet
        .get(&id)
        .and_then(|e| e.desired.map(|d| d.generation));
    let answer = DesiredSet {
        generation,
        run_id: run,
    };
    Ok(recorded(StatusCode::OK, answer))
}

/// `POST /v1/desired`: a new desired spec for the targeted devices and the
/// run that applies it.
#[utoipa::path(post, path = "/v1/desired", tag = "desired",
    request_body = idem_protocol::api::DesiredRequest,
    responses((status = 200, body = RunStarted), (status = "4XX", body = ErrorBody)))]
pub(super) async fn set_desired_bulk(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiJson(mut body): ApiJson<TargetedRequest>,
) -> Result<Response, ApiError> {
    let Some(spec) = body.spec.take() else {
        return Err(ApiError::bad_request(
            ErrorCode::MissingSpec,
            "`spec` is required; to re-check without a change use POST /v1/runs",
        ));
    };
    input::check_spec(state.config.fleet.budget, &spec)?;
    let rollout = body
        .rollout
        .as_ref()
        .map(super::rollouts::checked_rollout)
        .transpose()?;
    let targets = resolve_targets(&state, &body).await?;
    refuse_unapproved(&state, &state.pool, &targets).await?;
    let count = targets.len();
    let digest = SpecDigest::of(&spec).to_string();
    let note = AuditNote {
        targets: Some(count),
        detail: Some(json!({
            "targeting": targeting_summary(&body),
            "devices": audited_ids(targets.iter().map(DeviceId::as_str)),
            "digest": digest,
            "force": body.force,
            "rollout": body.rollout.as_ref().map(|r| json!(r)),
        })),
        ..AuditNote::default()
    };
    let run = NewRun::new(targets, Trigger::Desired)
        .forced(body.force)
        .changing_desired_to(spec)
        .in_waves(rollout);
    let (run, _) = start_run(&state, &call, run, note).await?;
    let answer = RunStarted {
        run_id: run,
        targets: count as u64,
        joined: None,
    };
    Ok(recorded(StatusCode::OK, answer))
}

/// How a bulk call chose its targets, for the audit trail (ids as sent,
/// capped).
pub(super) fn targeting_summary(body: &TargetedRequest) -> Value {
    if let Some(devices) = &body.devices {
        let shown: Vec<&String> = devices.iter().take(MAX_IDS_SHOWN).collect();
        json!({"devices": shown, "count": devices.len()})
    } else if let Some(selector) = &body.selector {
        json!({"selector": {"labels": selector.labels}})
    } else {
        json!({"all": true})
    }
}

/// The devices a bulk call targets: every named device must exist, a
/// selector or `all` must match at least one.
pub(super) async fn resolve_targets(
    state: &AppState,
    body: &TargetedRequest,
) -> Result<Vec<DeviceId>, ApiError> {
    let ids = matching(state, &checked_targeting(body)?).await?;
    if ids.is_empty() {
        return Err(ApiError::not_found(
            ErrorCode::NoMatchingDevices,
            "no registered device matches the selector",
        ));
    }
    Ok(ids)
}

/// What a bulk call's body targets, with its selector's labels checked.
pub(super) fn checked_targeting(body: &TargetedRequest) -> Result<Targeting, ApiError> {
    let targeting = body.targeting(input::MAX_TARGET_IDS_PER_REQUEST)?;
    if let Targeting::Selector(labels) = &targeting {
        input::check_count("selector labels", labels.len(), input::MAX_LABELS)?;
        for (key, value) in labels {
            input::check_label_pair(key, value)?;
        }
    }
    Ok(targeting)
}

/// The registered devices `targeting` names or matches now (a selector may
/// match none; a named device that is not registered is a 404).
pub(super) async fn matching(
    state: &AppState,
    targeting: &Targeting,
) -> Result<Vec<DeviceId>, ApiError> {
    let rows = match targeting {
        Targeting::Devices(ids) => return known(state, ids.clone()).await,
        Targeting::Selector(labels) => {
            let labels = serde_json::to_value(labels).unwrap_or_default();
            store::devices::ids_matching_labels(&state.pool, &labels).await?
        }
        Targeting::All => store::devices::ids_matching_labels(&state.pool, &json!({})).await?,
    };
    Ok(store::device_ids(
        &rows,
        "reading the devices a selector matches",
    )?)
}

/// `ids` when every one is registered (the cache caught up first when one
/// is missing, as in `params::registered`); otherwise a 404 naming the
/// unknown.
async fn known(state: &AppState, ids: Vec<DeviceId>) -> Result<Vec<DeviceId>, ApiError> {
    if ids.iter().any(|id| !state.fleet.contains(id)) {
        state.writer.follow_if_overtaken().await?;
    }
    let unknown: Vec<&str> = ids
        .iter()
        .filter(|id| !state.fleet.contains(id))
        .map(DeviceId::as_str)
        .collect();
    if unknown.is_empty() {
        return Ok(ids);
    }
    let shown: Vec<&str> = unknown.iter().take(MAX_IDS_SHOWN).copied().collect();
    Err(ApiError::not_found(
        ErrorCode::UnknownDevice,
        format!(
            "{} device(s) are not registered: {}",
            unknown.len(),
            shown.join(", ")
        ),
    ))
}
