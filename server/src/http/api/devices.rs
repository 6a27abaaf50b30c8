//! `/v1/devices…`: registering (one or many), reading, listing, deleting a
//! device and forgetting its reported state. Writes go through
//! [`super::command`]; broker credentials are [`super::credentials`].

use idem_protocol::api::ErrorCode;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use idem_protocol::api::{
    Attempt, DesiredView, DeviceDeleted, DeviceListQuery, DevicePage, DeviceRegistration,
    DeviceUpsert, DeviceView, ErrorBody, FieldChangeKind, FieldDiff, LastOutcome, Registered,
    ReportedError, ReportedView,
};
use idem_protocol::{DeviceId, DeviceStatus, Generation, SpecDigest};
use serde_json::{json, Value};

use super::approvals::{refuse_leaving, refuse_owned_moved, refuse_unapproved};
use super::command::{self, audited_ids, recorded, DeviceWrite};
use super::credentials::{self, Issued};
use super::params::{page_limit, parse_id, parse_labels, registered, unknown_device};
use crate::engine::EngineCommand;
use crate::http::auth::{Actor, AuditNote, Call};
use crate::http::error::ApiError;
use crate::http::extract::{ApiJson, ApiPath, ApiQuery};
use crate::http::input;
use crate::http::large_reads::MAX_PAGE_BYTES;
use crate::http::state::AppState;
use crate::reconcile::diff::{self, FieldChange};
use crate::reconcile::owned::OwnedFields;
use crate::store::cache::{DesiredState, FleetChange};
use crate::store::devices::{DeviceFilter, DeviceRow, HistoryRow, Registration};
use crate::store::{self, generation, to_u64};

/// Devices read from the database at a time while building a page.
const LIST_CHUNK: i64 = 100;
/// Attempts shown in a device's history.
const HISTORY_SHOWN: i64 = 20;

/// A registration body, checked: rows to upsert, specs grouped by digest,
/// operator-supplied broker passwords.
struct Registrations {
    requested: usize,
    rows: Vec<Registration>,
    ids: Vec<DeviceId>,
    specs: BTreeMap<SpecDigest, (Value, Vec<DeviceId>)>,
    passwords: HashMap<DeviceId, String>,
}

fn check_registrations(
    state: &AppState,
    body: Vec<DeviceRegistration>,
) -> Result<Registrations, ApiError> {
    input::check_count("devices", body.len(), input::MAX_REGISTRATIONS_PER_REQUEST)?;
    let mut seen = HashSet::with_capacity(body.len());
    let mut checked = Registrations {
        requested: body.len(),
        rows: Vec::with_capacity(body.len()),
        ids: Vec::with_capacity(body.len()),
        specs: BTreeMap::new(),
        passwords: HashMap::new(),
    };
    for item in body {
        let id = parse_id(&item.id)?;
        if let Some(password) = item.broker_password {
            credentials::check_password(&password)?;
            checked.passwords.insert(id.clone(), password);
        }
        if !seen.insert(id.clone()) {
            return Err(ApiError::bad_request(
                ErrorCode::DuplicateDeviceId,
                format!("{id} appears more than once"),
            ));
        }
        if let Some(spec) = item.spec {
            input::check_spec(state.config.fleet.budget, &spec)?;
            checked
                .specs
                .entry(SpecDigest::of(&spec))
                .or_insert_with(|| (spec, Vec::new()))
                .1
                .push(id.clone());
        }
        checked.rows.push(Registration {
            id: id.clone(),
            labels: parse_labels(item.labels)?,
        });
        checked.ids.push(id);
    }
    Ok(checked)
}

/// `POST /v1/devices`: registers devices (labels, desired state); new
/// devices get broker credentials when the server issues them.
#[utoipa::path(post, path = "/v1/devices", tag = "devices",
    request_body = idem_protocol::api::bounds::schema::Registrations,
    responses((status = 200, body = Registered), (status = "4XX", body = ErrorBody)))]
pub(super) async fn register_devices(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiJson(body): ApiJson<Vec<DeviceRegistration>>,
) -> Result<Response, ApiError> {
    let mut checked = check_registrations(&state, body)?;
    credentials::refuse_reserved(&state, &checked.ids)?;
    if state.config.security.broker_accounts.issues_passwords() {
        // New devices only: an existing one's account was checked when it
        // was registered, and a registration changes no existing account.
        let new: Vec<DeviceId> = checked
            .ids
            .iter()
            .filter(|id| !state.fleet.contains(id))
            .cloned()
            .collect();
        credentials::refuse_foreign_accounts(&state, &new).await?;
    }
    let mut write = DeviceWrite::begin(&state).await?;
    refuse_leaving(&state, &mut **write.tx().tx(), &checked.rows).await?;
    let (counts, created) =
        store::devices::register_returning_new(write.tx(), &checked.rows).await?;
    // Every new device gets its broker password, when the server issues them.
    let issued = if state.config.security.broker_accounts.issues_passwords() {
        let wanted = created
            .iter()
            .cloned()
            .map(|id| {
                let supplied = checked.passwords.remove(&id);
                (id, supplied)
            })
            .collect();
        let issued = credentials::issue(wanted).await?;
        let hashes: Vec<(DeviceId, String)> = issued
            .iter()
            .map(|i| (i.id.clone(), i.hash.clone()))
            .collect();
        store::devices::set_broker_password_hashes(write.tx(), &hashes).await?;
        issued
    } else {
        Vec::new()
    };
    let devices = audited_ids(checked.ids.iter().map(DeviceId::as_str));
    // Registered before their desired state: the cache applies in order.
    write.change(checked.ids.iter().cloned().map(FleetChange::Registered));
    // Their labels may have moved them into or out of a selector's exemption.
    write
        .refresh_exemptions(store::Scope::Devices(&checked.ids))
        .await?;
    // And into or out of a selector's owned fields: for a device registered
    // before, a change that needs approval when a policy covers it.
    let moved = write.refresh_owned_of(&checked.ids).await?;
    let moved: Vec<DeviceId> = moved
        .into_iter()
        .filter(|id| !created.contains(id))
        .collect();
    refuse_owned_moved(&state, &mut **write.tx().tx(), &moved).await?;
    let desired_changed = write_desired(&state, &mut write, &checked.specs).await?;
    let answer = Registered {
        created: counts.created,
        updated: counts.updated,
        unchanged: counts.unchanged,
        desired_changed,
        credentials: Vec::new(),
    };
    // Written before the passwords join the answer: they are never audited.
    let note = AuditNote {
        targets: Some(checked.requested),
        detail: Some(json!({
            "created": answer.created,
            "updated": answer.updated,
            "unchanged": answer.unchanged,
            "desired_changed": answer.desired_changed,
            "devices": devices,
            "new": audited_ids(created.iter().map(DeviceId::as_str)),
        })),
        ..AuditNote::default()
    };
    write
        .commit("committing registrations", call.audit(StatusCode::OK, note))
        .await?;
    let mut answer = answer;
    if !issued.is_empty() {
        credentials::apply_on_broker(&state, &issued).await?;
        answer.credentials = issued.iter().map(Issued::credential).collect();
    }
    Ok(recorded(StatusCode::OK, answer))
}

/// Writes the registrations' desired specs in `write`; the cache follows
/// after the commit and the engine refreshes the retained desired message
/// of devices that have one. Returns how many devices' desired state
/// changed. A change to a device that had a desired state already is
/// refused when it needs approval (a first desired state is not a change
/// to what a device runs).
async fn write_desired(
    state: &AppState,
    write: &mut DeviceWrite<'_>,
    specs: &BTreeMap<SpecDigest, (Value, Vec<DeviceId>)>,
) -> Result<u64, ApiError> {
    let mut changed = 0;
    let mut changed_ids = Vec::new();
    let mut replaced = Vec::new();
    let mut first = Vec::new();
    for (digest, (spec, group)) in specs {
        let written =
            store::devices::set_desired(write.tx(), group, spec, &digest.to_string()).await?;
        changed += written.len() as u64;
        let spec = Arc::new(spec.clone());
        for w in written {
            if w.generation > Generation::FIRST {
                replaced.push(w.id.clone());
            } else {
                first.push(w.id.clone());
            }
            // The cache leaves out what the device owns (`set_desired`).
            let desired = DesiredState::new(w.generation, *digest, spec.clone(), None);
            write.change([FleetChange::Desired(w.id.clone(), desired)]);
            changed_ids.push(w.id);
        }
    }
    // A device deleted while covered and registered again: its first
    // desired spec since is a change all the same.
    replaced.extend(
        store::approvals::departed_among(
            &mut **write.tx().tx(),
            &first,
            state.config.changes.require_approval,
        )
        .await?,
    );
    // Read in the registration's transaction: the labels it gave count.
    refuse_unapproved(state, &mut **write.tx().tx(), &replaced).await?;
    if !changed_ids.is_empty() {
        write.then_tell(EngineCommand::DesiredChanged(changed_ids));
    }
    Ok(changed)
}

/// `PUT /v1/devices/{id}`: registers one device or changes its labels.
#[utoipa::path(put, path = "/v1/devices/{id}", tag = "devices",
    params(("id" = inline(DeviceId), Path, description = "device id")),
    request_body = DeviceUpsert,
    responses((status = 200, body = DeviceView), (status = 201, body = DeviceView),
        (status = "4XX", body = ErrorBody)))]
pub(super) async fn upsert_device(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(raw_id): ApiPath<String>,
    ApiJson(body): ApiJson<DeviceUpsert>,
) -> Result<Response, ApiError> {
    let id = parse_id(&raw_id)?;
    credentials::refuse_reserved(&state, [&id])?;
    if !state.fleet.contains(&id) {
        credentials::refuse_foreign_accounts(&state, std::slice::from_ref(&id)).await?;
    }
    let registration = Registration {
        id: id.clone(),
        labels: parse_labels(body.labels)?,
    };
    let mut write = DeviceWrite::begin(&state).await?;
    let registration = [registration];
    refuse_leaving(&state, &mut **write.tx().tx(), &registration).await?;
    let counts = store::devices::register(write.tx(), &registration).await?;
    let status = if counts.created > 0 {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let note = AuditNote {
        targets: Some(1),
        detail: Some(json!({"devices": audited_ids([id.as_str()]), "created": counts.created > 0})),
        ..AuditNote::default()
    };
    write.change([FleetChange::Registered(id.clone())]);
    write
        .refresh_exemptions(store::Scope::Devices(std::slice::from_ref(&id)))
        .await?;
    let moved = write.refresh_owned_of(std::slice::from_ref(&id)).await?;
    if counts.created == 0 {
        refuse_owned_moved(&state, &mut **write.tx().tx(), &moved).await?;
    }
    write
        .commit("committing a registration", call.audit(status, note))
        .await?;
    let row = store::devices::get(&state.pool, &id).await?;
    Ok(recorded(status, row.map(|row| device_view(&state, row))))
}

/// `GET /v1/devices/{id}`: the device with its newest attempts.
#[utoipa::path(get, path = "/v1/devices/{id}", tag = "devices",
    params(("id" = inline(DeviceId), Path, description = "device id")),
    responses((status = 200, body = DeviceView), (status = "4XX", body = ErrorBody)))]
pub(super) async fn get_device(
    State(state): State<Arc<AppState>>,
    ApiPath(raw_id): ApiPath<String>,
) -> Result<Json<DeviceView>, ApiError> {
    let id = parse_id(&raw_id)?;
    let Some(row) = store::devices::get(&state.pool, &id).await? else {
        return Err(unknown_device(&id));
    };
    let history = store::devices::history(&state.pool, &id, HISTORY_SHOWN).await?;
    let mut device = device_view(&state, row);
    device.history = Some(history.into_iter().map(attempt).collect());
    device.diff = match (&device.reported, &device.desired) {
        (Some(reported), Some(desired)) => Some(field_diffs(
            &reported.spec,
            &desired.spec,
            state.fleet.owned(&id).as_deref(),
        )),
        _ => None,
    };
    Ok(Json(device))
}

/// The core's diff from `old` to `new`, as the API shows it, the paths a
/// device that owns `owned` owns marked ignored.
pub(super) fn field_diffs(old: &Value, new: &Value, owned: Option<&OwnedFields>) -> Vec<FieldDiff> {
    let changes = diff::diff(old, new);
    let ignored = match owned {
        Some(owned) => owned.ignored(old, new, &changes),
        None => vec![false; changes.len()],
    };
    changes
        .into_iter()
        .zip(ignored)
        .map(|(change, ignored)| field_diff(change, ignored))
        .collect()
}

/// A change of the core's diff as the API shows it.
fn field_diff(change: FieldChange, ignored: bool) -> FieldDiff {
    let path = change.path().to_string();
    let (change, old, new) = match change {
        FieldChange::Added { new, .. } => (FieldChangeKind::Added, None, Some(new)),
        FieldChange::Removed { old, .. } => (FieldChangeKind::Removed, Some(old), None),
        FieldChange::Changed { old, new, .. } => (FieldChangeKind::Changed, Some(old), Some(new)),
    };
    FieldDiff {
        path,
        change,
        old,
        new,
        ignored,
    }
}

/// `DELETE /v1/devices/{id}`: removes the device and its attempt history
/// (its outcomes in past runs stay), ends any attempt on it as `skipped`
/// (`device deleted`) and clears its retained `desired` and `status`
/// messages on the broker.
#[utoipa::path(delete, path = "/v1/devices/{id}", tag = "devices",
    params(("id" = inline(DeviceId), Path, description = "device id")),
    responses((status = 200, body = DeviceDeleted), (status = "4XX", body = ErrorBody)))]
pub(super) async fn delete_device(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(raw_id): ApiPath<String>,
) -> Result<Response, ApiError> {
    let id = registered(&state, &raw_id).await?;
    let mut write = DeviceWrite::begin(&state).await?;
    // Registered again, it stays under the policies that cover it now.
    let departures = store::approvals::record_departure(
        &mut **write.tx().tx(),
        &id,
        &call.actor.name,
        state.config.changes.require_approval,
    )
    .await?;
    let existed = store::devices::delete(write.tx(), &id).await?;
    let note = AuditNote {
        targets: Some(1),
        detail: Some(json!({
            "devices": audited_ids([id.as_str()]),
            "covered_departures": departures,
        })),
        ..AuditNote::default()
    };
    write.change([FleetChange::Removed(id.clone())]);
    write
        .commit(
            "committing a device deletion",
            call.audit(StatusCode::OK, note),
        )
        .await?;
    state.publisher.clear_retained(&id);
    let broker_account_removed = credentials::remove_from_broker(&state, &id).await;
    command::tell(&state, EngineCommand::DevicesRemoved(vec![id.clone()])).await;
    tracing::info!(device = %id, existed, "device deleted");
    let answer = DeviceDeleted {
        id,
        deleted: true,
        broker_account_removed,
    };
    Ok(recorded(StatusCode::OK, answer))
}

/// `DELETE /v1/devices/{id}/reported`: forgets the device's reported state,
/// so its next report is accepted whatever its `seq` (the way out for a
/// device whose counter went backwards, or that was sent a bogus `seq`).
#[utoipa::path(delete, path = "/v1/devices/{id}/reported", tag = "devices",
    params(("id" = inline(DeviceId), Path, description = "device id")),
    responses((status = 200, body = DeviceView), (status = "4XX", body = ErrorBody)))]
pub(super) async fn reset_reported(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(raw_id): ApiPath<String>,
) -> Result<Response, ApiError> {
    let id = registered(&state, &raw_id).await?;
    let mut write = DeviceWrite::begin(&state).await?;
    store::devices::reset_reported(write.tx(), &id).await?;
    let note = AuditNote {
        targets: Some(1),
        detail: Some(json!({"devices": audited_ids([id.as_str()])})),
        ..AuditNote::default()
    };
    write.change([FleetChange::ReportedCleared(id.clone())]);
    write
        .commit(
            "committing a reported-state reset",
            call.audit(StatusCode::OK, note),
        )
        .await?;
    let row = store::devices::get(&state.pool, &id).await?;
    Ok(recorded(
        StatusCode::OK,
        row.map(|row| device_view(&state, row)),
    ))
}

/// The store's filter for a device list query, each parameter checked.
fn device_filter(query: DeviceListQuery) -> Result<(DeviceFilter, i64), ApiError> {
    let status = match query.status.as_deref().map(DeviceStatus::parse) {
        None => None,
        Some(Some(status)) => Some(status),
        Some(None) => {
            return Err(ApiError::bad_request(
                ErrorCode::InvalidStatus,
                format!(
                    "status must be one of {:?}",
                    DeviceStatus::ALL.map(DeviceStatus::as_str)
                ),
            ))
        }
    };
    if let Some(after) = &query.after {
        input::check_query_text("after", after)?;
    }
    let labels = match &query.label {
        None => None,
        Some(pair) => match pair.split_once(':') {
            Some((k, v)) if !k.is_empty() => {
                input::check_label_pair(k, v)?;
                Some(json!({ k: v }))
            }
            _ => {
                return Err(ApiError::bad_request(
                    ErrorCode::InvalidLabel,
                    "label filter must be `key:value`",
                ))
            }
        },
    };
    let limit = page_limit(query.limit)?;
    let health = match query.health.as_deref().map(idem_protocol::Health::parse) {
        None => None,
        Some(Some(health)) => Some(health),
        Some(None) => {
            return Err(ApiError::bad_request(
                ErrorCode::InvalidHealth,
                "health must be healthy, degraded or unhealthy",
            ))
        }
    };
    let filter = DeviceFilter {
        status,
        health,
        labels,
        after: query.after,
        limit: limit.min(LIST_CHUNK),
    };
    Ok((filter, limit))
}

/// `GET /v1/devices`: a page of devices in id order.
#[utoipa::path(get, path = "/v1/devices", tag = "devices", params(DeviceListQuery),
    responses((status = 200, body = DevicePage), (status = "4XX", body = ErrorBody),
        (status = 503, description = "large_reads_busy: every turn of large reads taken; retry after Retry-After", body = ErrorBody)))]
pub(super) async fn list_devices(
    State(state): State<Arc<AppState>>,
    actor: Option<Extension<Actor>>,
    ApiQuery(query): ApiQuery<DeviceListQuery>,
) -> Result<Response, ApiError> {
    let (mut filter, limit) = device_filter(query)?;
    let token = actor.as_deref().map(|actor| actor.name.as_str());
    let _turn = match state.large_reads.turn_for(token).await {
        Ok(turn) => turn,
        Err(refused) => return Ok(refused),
    };
    // Read in chunks and stop at the byte bound, so neither the response nor
    // the server's memory grows with the size of the devices' specs.
    let mut devices = Vec::new();
    let mut bytes = 0;
    let mut more = true;
    while more && (devices.len() as i64) < limit && bytes < MAX_PAGE_BYTES {
        filter.limit = (limit - devices.len() as i64).min(LIST_CHUNK);
        let rows = store::devices::list(&state.pool, &filter).await?;
        more = rows.len() as i64 == filter.limit;
        for row in rows {
            if bytes >= MAX_PAGE_BYTES {
                more = true;
                break;
            }
            filter.after = Some(row.id.clone());
            let device = device_view(&state, row);
            bytes += serde_json::to_vec(&device).map_or(0, |json| json.len());
            devices.push(device);
        }
    }
    let next_after = more.then_some(filter.after).flatten();
    Ok(Json(DevicePage {
        devices,
        next_after,
    })
    .into_response())
}

/// A stored device as the API shows it (its exemption and owned fields
/// from the cache).
pub(super) fn device_view(state: &AppState, row: DeviceRow) -> DeviceView {
    let entry = DeviceId::parse(&row.id)
        .ok()
        .and_then(|id| state.fleet.get(&id));
    let exempt = entry.as_ref().is_some_and(|entry| entry.exempt);
    let owned = entry.and_then(|entry| entry.owned);
    let in_sync = match (&row.desired_digest, &row.reported_digest, &owned) {
        (Some(_), Some(_), Some(owned)) => match (&row.desired_spec, &row.reported_spec) {
            (Some(desired), Some(reported)) => {
                Some(owned.digest(desired) == owned.digest(reported))
            }
            _ => None,
        },
        (Some(d), Some(r), None) => Some(d == r),
        _ => None,
    };
    let desired = row.desired_spec.map(|spec| DesiredView {
        generation: generation(row.desired_generation),
        spec,
        digest: row.desired_digest.clone(),
        updated_at: row.desired_at,
    });
    let reported = row.reported_spec.map(|spec| ReportedView {
        seq: row.reported_seq.map(to_u64),
        generation: row.reported_generation.map(generation),
        spec,
        digest: row.reported_digest.clone(),
        health: row.reported_health,
        error: match (row.reported_error_generation, row.reported_error) {
            (Some(refused), Some(message)) => Some(ReportedError {
                generation: generation(refused),
                message,
            }),
            _ => None,
        },
        at: row.reported_at,
    });
    let last_outcome = row.last_outcome.map(|outcome| LastOutcome {
        outcome,
        reason: row.last_outcome_reason,
        run_id: row.last_run_id,
    });
    DeviceView {
        id: row.id,
        labels: row.labels,
        status: row.status,
        exempt,
        online: row.online,
        desired,
        reported,
        in_sync,
        attempts: u32::try_from(row.attempts).unwrap_or(0),
        next_attempt_at: row.next_attempt_at,
        last_error: row.last_error,
        last_outcome,
        updated_at: row.updated_at,
        history: None,
        diff: None,
    }
}

fn attempt(row: HistoryRow) -> Attempt {
    Attempt {
        run_id: row.run_id,
        attempt: u32::try_from(row.attempt).unwrap_or(0),
        generation: row.generation.map(generation),
        result: row.result,
        reason: row.reason,
        at: row.at,
    }
}
