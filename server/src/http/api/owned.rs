//! Device-owned fields: `PUT /v1/owned-fields` replaces the declaration of
//! the spec paths devices own (server-wide and per label selector),
//! committing it with its audit record and the cache's per-device owned
//! paths, then re-evaluates the fleet with a run; `GET /v1/owned-fields`
//! reads it.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::{Extension, Json};
use idem_protocol::api::{ErrorBody, ErrorCode, OwnedFieldsDeclaration, OwnedFieldsView};
use idem_protocol::Trigger;
use serde_json::json;

use super::command::{recorded, start_follow_up_run, DeviceWrite};
use crate::app::state::AppState;
use crate::engine::new_run::NewRun;
use crate::http::auth::{AuditNote, Call};
use crate::http::error::ApiError;
use crate::http::extract::ApiJson;
use crate::http::input;
use crate::reconcile::owned::OwnedFieldSet;
use crate::store;

/// `PUT /v1/owned-fields`: the spec paths devices own from now on (the whole
/// declaration; an empty one owns nothing). Devices whose only difference
/// from their desired spec lies in paths now owned are converged by the run
/// it starts, without a push.
#[utoipa::path(put, path = "/v1/owned-fields", tag = "owned-fields",
    request_body = OwnedFieldsDeclaration,
    responses((status = 200, body = OwnedFieldsView), (status = "4XX", body = ErrorBody)))]
pub(super) async fn put_owned_fields(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiJson(body): ApiJson<OwnedFieldsDeclaration>,
) -> Result<Response, ApiError> {
    for (i, owned) in body.by_selector.iter().enumerate() {
        if owned.selector.labels.is_empty() {
            return Err(ApiError::bad_request(
                ErrorCode::EmptySelector,
                format!(
                    "by_selector[{i}].selector.labels is empty; name at least one label \
                     (paths every device owns go in `fields`)"
                ),
            ));
        }
        input::check_count(
            "selector labels",
            owned.selector.labels.len(),
            input::MAX_LABELS,
        )?;
        for (key, value) in &owned.selector.labels {
            input::check_label_pair(key, value)?;
        }
    }
    let set = OwnedFieldSet::from_declaration(&body)
        .map_err(|e| ApiError::bad_request(ErrorCode::InvalidOwnedFields, e.to_string()))?;
    let mut write = DeviceWrite::begin(&state).await?;
    let updated_at = store::owned::save(write.tx(), &body, &call.actor.name).await?;
    // The run below re-judges the devices; the engine only republishes.
    let changed = write.refresh_owned(&set, store::Scope::All, false).await?;
    write.change([store::cache::FleetChange::OwnedSet(Arc::new(set))]);
    let count_changed = changed.len() as u64;
    let note = AuditNote {
        targets: Some(changed.len()),
        detail: Some(json!({
            "fields": body.fields,
            "by_selector": body.by_selector,
            "devices_changed": changed.len(),
        })),
        ..AuditNote::default()
    };
    write
        .commit(
            "committing the owned fields",
            call.audit(StatusCode::OK, note),
        )
        .await?;
    // The devices whose owned paths changed are re-evaluated as a new run
    // would: one whose only difference lay in paths now owned ends
    // `already_converged`, one that differs in a path no longer owned is
    // pushed. The declaration has committed: a run that cannot start now
    // (the server is stopping) is said in the log, not as a failure of the
    // call; the next start's reconciliation covers it.
    let run_id = if changed.is_empty() {
        None
    } else {
        let count = changed.len();
        match start_follow_up_run(&state, &call, NewRun::new(changed, Trigger::Manual)).await {
            Ok((run_id, _)) => Some(run_id),
            Err(e) => {
                tracing::warn!(error = ?e, devices = count, "owned fields declared; their re-evaluation run did not start");
                None
            }
        }
    };
    Ok(recorded(
        StatusCode::OK,
        OwnedFieldsView {
            fields: body.fields,
            by_selector: body.by_selector,
            updated_by: Some(call.actor.name.clone()),
            updated_at: Some(updated_at),
            devices: state.fleet.count_owning() as u64,
            devices_changed: Some(count_changed),
            run_id,
        },
    ))
}

/// `GET /v1/owned-fields`: the declaration in force.
#[utoipa::path(get, path = "/v1/owned-fields", tag = "owned-fields",
    responses((status = 200, body = OwnedFieldsView), (status = "4XX", body = ErrorBody)))]
pub(super) async fn get_owned_fields(
    State(state): State<Arc<AppState>>,
) -> Result<Json<OwnedFieldsView>, ApiError> {
    Ok(Json(view(&state).await?))
}

async fn view(state: &AppState) -> Result<OwnedFieldsView, ApiError> {
    let stored = store::owned::load(&state.pool).await?;
    let devices = state.fleet.count_owning() as u64;
    Ok(match stored {
        Some(stored) => OwnedFieldsView {
            fields: stored.declaration.fields,
            by_selector: stored.declaration.by_selector,
            updated_by: Some(stored.updated_by),
            updated_at: Some(stored.updated_at),
            devices,
            devices_changed: None,
            run_id: None,
        },
        None => OwnedFieldsView {
            fields: Vec::new(),
            by_selector: Vec::new(),
            updated_by: None,
            updated_at: None,
            devices,
            devices_changed: None,
            run_id: None,
        },
    })
}
