//! `/v1/runs…` and the retries: starting a re-check (joining an identical
//! one in progress), releasing quarantined devices into a new run, and
//! reading runs and their outcomes.

use idem_protocol::api::ErrorCode;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::{Extension, Json};
use idem_protocol::api::{
    ApprovalView, ErrorBody, OutcomePage, OutcomeQuery, OutcomeRow, RunListQuery, RunPage,
    RunStarted, RunView, TargetedRequest,
};
use idem_protocol::{DeviceId, OutcomeKind};
use serde_json::json;

use super::command::{audited, audited_ids, recorded, start_or_join_manual_run, start_run};
use super::desired::{resolve_targets, targeting_summary};
use super::params::{page_limit, parse_run_id, registered, unknown_run};
use crate::engine::new_run::{NewRun, Trigger};
use crate::http::auth::{AuditNote, Call};
use crate::http::error::ApiError;
use crate::http::extract::{ApiJson, ApiPath, ApiQuery};
use crate::http::input;
use crate::http::state::AppState;
use crate::reconcile::rollout::StoredRollout;
use crate::store::runs::{RunRow, TargetRow};
use crate::store::{self, generation};

/// `POST /v1/runs`: re-checks the targeted devices without a change. A
/// re-check over exactly the targets (and force) of a manual run still in
/// progress joins it: a hundred identical calls cost one run.
#[utoipa::path(post, path = "/v1/runs", tag = "runs",
    request_body = idem_protocol::api::RunRequest,
    responses((status = 200, body = RunStarted), (status = "4XX", body = ErrorBody)))]
pub(super) async fn start_manual_run(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiJson(body): ApiJson<TargetedRequest>,
) -> Result<Response, ApiError> {
    if body.spec.is_some() {
        return Err(ApiError::bad_request(
            ErrorCode::UnexpectedSpec,
            "POST /v1/runs re-checks without a change; set a spec with POST /v1/desired",
        ));
    }
    if body.rollout.is_some() {
        return Err(ApiError::bad_request(
            ErrorCode::InvalidRollout,
            "POST /v1/runs re-checks without a change and is never staged; stage a change with `rollout` in POST /v1/desired",
        ));
    }
    let targets = resolve_targets(&state, &body).await?;
    let count = targets.len();
    let note = |joined: bool| AuditNote {
        targets: Some(count),
        detail: Some(json!({
            "targeting": targeting_summary(&body),
            "devices": audited_ids(targets.iter().map(DeviceId::as_str)),
            "force": body.force,
            "joined": joined,
        })),
        ..AuditNote::default()
    };
    let answer = |run_id, joined| RunStarted {
        run_id,
        targets: count as u64,
        joined: Some(joined),
    };
    let run = NewRun::new(targets.clone(), Trigger::Manual).forced(body.force);
    let started = start_or_join_manual_run(&state, &call, run, note(false)).await?;
    if started.joined {
        // Nothing new is committed: the middleware records the call.
        let note = AuditNote {
            run_id: Some(started.run_id),
            ..note(true)
        };
        return Ok(audited(note, StatusCode::OK, answer(started.run_id, true)));
    }
    Ok(recorded(StatusCode::OK, answer(started.run_id, false)))
}

/// `POST /v1/devices/{id}/retry`: releases a quarantined device and runs it.
#[utoipa::path(post, path = "/v1/devices/{id}/retry", tag = "runs",
    params(("id" = inline(DeviceId), Path, description = "device id")),
    responses((status = 200, body = RunStarted), (status = "4XX", body = ErrorBody)))]
pub(super) async fn retry_device(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(raw_id): ApiPath<String>,
) -> Result<Response, ApiError> {
    let id = registered(&state, &raw_id).await?;
    let note = AuditNote {
        targets: Some(1),
        detail: Some(json!({"devices": audited_ids([id.as_str()])})),
        ..AuditNote::default()
    };
    let run = NewRun::new(vec![id.clone()], Trigger::Retry).releasing_quarantine();
    let (run_id, _) = start_run(&state, &call, run, note).await?;
    let answer = RunStarted {
        run_id,
        targets: 1,
        joined: None,
    };
    Ok(recorded(StatusCode::OK, answer))
}

/// `POST /v1/runs/{id}/retry`: releases every quarantined device of a run
/// and runs them again.
#[utoipa::path(post, path = "/v1/runs/{id}/retry", tag = "runs",
    params(("id" = inline(idem_protocol::api::bounds::schema::UuidText), Path, description = "run id")),
    responses((status = 200, body = RunStarted), (status = "4XX", body = ErrorBody)))]
pub(super) async fn retry_run(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(raw): ApiPath<String>,
) -> Result<Response, ApiError> {
    let run_id = parse_run_id(&raw)?;
    if store::runs::get(&state.pool, run_id).await?.is_none() {
        return Err(unknown_run(run_id));
    }
    let quarantined = store::device_ids(
        &store::devices::quarantined_in_run(&state.pool, run_id).await?,
        "reading a run's quarantined targets",
    )?;
    if quarantined.is_empty() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::NothingQuarantined,
            "no device of this run is quarantined",
        ));
    }
    let note = AuditNote {
        targets: Some(quarantined.len()),
        detail: Some(json!({
            "retried_run": run_id,
            "devices": audited_ids(quarantined.iter().map(DeviceId::as_str)),
        })),
        ..AuditNote::default()
    };
    let run = NewRun::new(quarantined, Trigger::Retry).releasing_quarantine();
    let (run_id, targets) = start_run(&state, &call, run, note).await?;
    let answer = RunStarted {
        run_id,
        targets: targets as u64,
        joined: None,
    };
    Ok(recorded(StatusCode::OK, answer))
}

/// `GET /v1/runs`: runs, newest first.
#[utoipa::path(get, path = "/v1/runs", tag = "runs", params(RunListQuery),
    responses((status = 200, body = RunPage), (status = "4XX", body = ErrorBody)))]
pub(super) async fn list_runs(
    State(state): State<Arc<AppState>>,
    ApiQuery(query): ApiQuery<RunListQuery>,
) -> Result<Json<RunPage>, ApiError> {
    let limit = page_limit(query.limit)?;
    let rows = store::runs::list(&state.pool, query.before, limit).await?;
    let runs = rows.into_iter().map(run_view).collect();
    Ok(Json(RunPage { runs }))
}

/// `GET /v1/runs/{id}`.
#[utoipa::path(get, path = "/v1/runs/{id}", tag = "runs",
    params(("id" = inline(idem_protocol::api::bounds::schema::UuidText), Path, description = "run id")),
    responses((status = 200, body = RunView), (status = "4XX", body = ErrorBody)))]
pub(super) async fn get_run(
    State(state): State<Arc<AppState>>,
    ApiPath(raw): ApiPath<String>,
) -> Result<Json<RunView>, ApiError> {
    let id = parse_run_id(&raw)?;
    match store::runs::get(&state.pool, id).await? {
        Some(row) => Ok(Json(run_view(row))),
        None => Err(unknown_run(id)),
    }
}

fn run_view(row: RunRow) -> RunView {
    let counts = row.counts();
    RunView {
        id: row.id,
        summary: counts.summary(),
        counts,
        duration_ms: row
            .finished_at
            .map(|f| u64::try_from((f - row.started_at).num_milliseconds()).unwrap_or(0)),
        trigger: row.trigger,
        state: row.state,
        force: row.force,
        target_count: u64::try_from(row.target_count).unwrap_or(0),
        started_at: row.started_at,
        finished_at: row.finished_at,
        started_by: row.started_by,
        plan_id: row.plan_id,
        approval: row
            .approved_by
            .zip(row.approved_at)
            .map(|(by, at)| ApprovalView { wave: None, by, at }),
        rollout: row.rollout.and_then(|stored| {
            serde_json::from_value::<StoredRollout>(stored.0)
                .ok()
                .map(|stored| stored.view())
        }),
    }
}

/// `GET /v1/runs/{id}/outcomes`: a page of a run's rows in device-id order.
#[utoipa::path(get, path = "/v1/runs/{id}/outcomes", tag = "runs",
    params(("id" = inline(idem_protocol::api::bounds::schema::UuidText), Path, description = "run id"), OutcomeQuery),
    responses((status = 200, body = OutcomePage), (status = "4XX", body = ErrorBody)))]
pub(super) async fn run_outcomes(
    State(state): State<Arc<AppState>>,
    ApiPath(raw): ApiPath<String>,
    ApiQuery(query): ApiQuery<OutcomeQuery>,
) -> Result<Json<OutcomePage>, ApiError> {
    let id = parse_run_id(&raw)?;
    if let Some(after) = &query.after {
        input::check_query_text("after", after)?;
    }
    let outcome = match query.outcome.as_deref().map(OutcomeKind::parse) {
        None => None,
        Some(Some(kind)) => Some(kind),
        Some(None) => {
            let names: Vec<&str> = OutcomeKind::ALL.iter().map(|k| k.as_str()).collect();
            return Err(ApiError::bad_request(
                ErrorCode::InvalidOutcome,
                format!("outcome must be one of {names:?}"),
            ));
        }
    };
    if store::runs::get(&state.pool, id).await?.is_none() {
        return Err(unknown_run(id));
    }
    let limit = page_limit(query.limit)?;
    let rows =
        store::runs::outcomes(&state.pool, id, outcome, query.after.as_deref(), limit).await?;
    let next_after = (rows.len() as i64 == limit)
        .then(|| rows.last().map(|r| r.device_id.clone()))
        .flatten();
    let outcomes = rows.into_iter().map(outcome_row).collect();
    Ok(Json(OutcomePage {
        outcomes,
        next_after,
    }))
}

/// A stored outcome row (no outcome while undecided).
fn outcome_row(row: TargetRow) -> OutcomeRow {
    OutcomeRow {
        outcome: row.outcome,
        device_id: row.device_id,
        reason: row.reason,
        generation: row.generation.map(generation),
        health: row.health,
        decided_at: row.decided_at,
    }
}
