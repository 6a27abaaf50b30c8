//! HTTP API (axum, JSON): the operator's surface. Handlers validate input,
//! call the store and hand runs to the engine; they hold no reconciliation
//! logic. Errors are `{"error": {"code", "message"}}` with a fitting status.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::Extension;
use axum::{Json, Router};
use idem_protocol::{DeviceId, DeviceStatus, OutcomeCounts, OutcomeKind, SpecDigest};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::app::AppState;
use crate::auth::{Actor, AuditNote};
use crate::events;
use crate::fleet::{DesiredState, FleetChange};
use crate::input::{self, InputError};
use crate::reconcile::engine::EngineCommand;
use crate::reconcile::runs::{commit_run, CommitRunError, NewRun, Trigger};
use crate::store::devices::{DeviceFilter, DeviceRow, Registration};
use crate::store::runs::RunRow;
use crate::store::{self, Context, StoreError};

/// Most items one list page returns.
const MAX_PAGE: i64 = 1_000;
/// A device page stops growing once its JSON reaches this many bytes (it
/// always holds at least one device); `next_after` continues it.
const MAX_PAGE_BYTES: usize = 4 * 1024 * 1024;
/// Devices read from the database at a time while building a page.
const LIST_CHUNK: i64 = 100;
const DEFAULT_PAGE: i64 = 100;
/// How long readiness waits for the database before saying not ready.
const READINESS_DB_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);
/// Attempts shown in a device's history.
const HISTORY_SHOWN: i64 = 20;
/// Manual runs remembered for joining identical re-checks; beyond this the
/// memory is cleared (joining is an optimisation, not a guarantee).
const MAX_REMEMBERED_MANUAL_RUNS: usize = 1_024;
/// Unknown ids named in an error message, at most.
const MAX_IDS_IN_ERROR: usize = 20;

mod access;
mod credentials;

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/devices", post(register_devices).get(list_devices))
        .route(
            "/v1/devices/{id}",
            put(upsert_device).get(get_device).delete(delete_device),
        )
        .route("/v1/devices/{id}/reported", delete(reset_reported))
        .route("/v1/devices/{id}/desired", put(set_device_desired))
        .route("/v1/devices/{id}/retry", post(retry_device))
        .route("/v1/devices/{id}/credentials", post(credentials::rotate))
        .route("/v1/desired", post(set_desired_bulk))
        .route("/v1/runs", post(start_manual_run).get(list_runs))
        .route("/v1/runs/{id}", get(get_run))
        .route("/v1/runs/{id}/outcomes", get(run_outcomes))
        .route("/v1/runs/{id}/retry", post(retry_run))
        .route("/v1/fleet", get(fleet_summary))
        .route("/v1/events", get(crate::sse::events))
        .route(
            "/v1/tokens",
            get(access::list_tokens).post(access::create_token),
        )
        .route("/v1/tokens/{name}", delete(access::revoke_token))
        .route("/v1/audit", get(access::list_audit))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::auth::authorize,
        ))
        .with_state(state)
}

/// A JSON answer carrying what the call did, for the audit trail.
pub(crate) fn audited(note: AuditNote, status: StatusCode, body: Value) -> Response {
    (status, Extension(note), Json(body)).into_response()
}

// ---------- errors and JSON extraction ----------

#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }
    pub(crate) fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }
    fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"code": self.code, "message": self.message}});
        (self.status, Json(body)).into_response()
    }
}

/// Database errors are logged with their detail and answered without it:
/// SQL text and PostgreSQL messages never reach a client.
impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        tracing::error!(error = %e, "request failed on the database");
        if e.is_unavailable() {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "database_unavailable",
                "the database is unavailable; try again later (details are in the server log)",
            )
        } else {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "the database refused the request (details are in the server log)",
            )
        }
    }
}

impl From<events::EventError> for ApiError {
    fn from(e: events::EventError) -> Self {
        tracing::error!(error = %e, "building an event failed");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "an event could not be built (details are in the server log)",
        )
    }
}

impl From<InputError> for ApiError {
    fn from(e: InputError) -> Self {
        let status = if e.is_too_large() {
            StatusCode::PAYLOAD_TOO_LARGE
        } else {
            StatusCode::BAD_REQUEST
        };
        ApiError::new(status, e.code(), e.to_string())
    }
}

/// `Json<T>` whose rejections are our JSON errors.
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(value)) => Ok(ApiJson(value)),
            Err(rejection) => Err(json_rejection(rejection)),
        }
    }
}

// JsonRejection is #[non_exhaustive], so a catch-all arm is required here.
#[allow(clippy::wildcard_enum_match_arm)]
fn json_rejection(rejection: JsonRejection) -> ApiError {
    match rejection {
        JsonRejection::MissingJsonContentType(_) => ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "send the body as JSON with `Content-Type: application/json`",
        ),
        JsonRejection::JsonSyntaxError(e) => ApiError::bad_request("invalid_json", e.body_text()),
        JsonRejection::JsonDataError(e) => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
            e.body_text(),
        ),
        other => ApiError::bad_request("invalid_body", other.body_text()),
    }
}

fn parse_id(raw: &str) -> Result<DeviceId, ApiError> {
    DeviceId::parse(raw)
        .map_err(|e| ApiError::bad_request("invalid_device_id", format!("{raw:?}: {e}")))
}

/// A valid id of a registered device, or the matching 400 / 404.
fn registered(state: &AppState, raw: &str) -> Result<DeviceId, ApiError> {
    let id = parse_id(raw)?;
    if !state.fleet.contains(&id) {
        return Err(ApiError::not_found(
            "unknown_device",
            format!("device {id} is not registered"),
        ));
    }
    Ok(id)
}

fn parse_labels(labels: Option<Value>) -> Result<Option<Value>, ApiError> {
    match labels {
        None => Ok(None),
        Some(labels) => {
            input::check_labels(&labels)?;
            Ok(Some(labels))
        }
    }
}

// ---------- devices ----------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DeviceRegistration {
    id: String,
    labels: Option<Value>,
    spec: Option<Value>,
    /// The device's broker password when the server issues credentials
    /// (`--broker-accounts`); generated when absent. Only for new devices.
    broker_password: Option<String>,
}

async fn register_devices(
    State(state): State<Arc<AppState>>,
    ApiJson(body): ApiJson<Vec<DeviceRegistration>>,
) -> Result<Response, ApiError> {
    let requested = body.len();
    input::check_count("devices", body.len(), input::MAX_REGISTRATIONS_PER_REQUEST)?;
    let mut seen = HashSet::with_capacity(body.len());
    let mut registrations = Vec::with_capacity(body.len());
    let mut specs: BTreeMap<SpecDigest, (Value, Vec<String>)> = BTreeMap::new();
    let mut ids = Vec::with_capacity(body.len());
    let mut supplied_passwords = HashMap::new();
    for item in body {
        let id = parse_id(&item.id)?;
        if let Some(password) = item.broker_password {
            credentials::check_password(&password)?;
            supplied_passwords.insert(id.clone(), password);
        }
        if !seen.insert(id.clone()) {
            return Err(ApiError::bad_request(
                "duplicate_device_id",
                format!("{id} appears more than once"),
            ));
        }
        if let Some(spec) = item.spec {
            input::check_spec(state.config.budget, &spec)?;
            specs
                .entry(SpecDigest::of(&spec))
                .or_insert_with(|| (spec, Vec::new()))
                .1
                .push(id.to_string());
        }
        registrations.push(Registration {
            id: id.to_string(),
            labels: parse_labels(item.labels)?,
        });
        ids.push(id);
    }
    let _one_writer = state.device_writes.lock().await;
    let mut tx = state.pool.begin().await.context("starting a transaction")?;
    let (counts, created) = store::devices::register_returning_new(&mut tx, &registrations).await?;
    // Every new device gets its broker password, when the server issues them.
    let issued = if state.config.config.broker_accounts.issues_passwords() {
        let wanted = created
            .iter()
            .filter_map(|id| DeviceId::parse(id).ok())
            .map(|id| {
                let supplied = supplied_passwords.remove(&id);
                (id, supplied)
            })
            .collect();
        let issued = credentials::issue(wanted).await?;
        let hashes: Vec<(String, String)> = issued
            .iter()
            .map(|i| (i.id.to_string(), i.hash.clone()))
            .collect();
        store::devices::set_broker_password_hashes(&mut tx, &hashes).await?;
        issued
    } else {
        Vec::new()
    };
    let mut desired_changes = Vec::new();
    for (digest, (spec, group)) in &specs {
        let written =
            store::devices::set_desired(&mut tx, group, spec, &digest.to_string()).await?;
        let spec = Arc::new(spec.clone());
        desired_changes.extend(written.into_iter().map(|w| (w, *digest, spec.clone())));
    }
    tx.commit().await.context("committing registrations")?;
    state
        .fleet
        .apply(ids.into_iter().map(FleetChange::Registered));
    let desired_changed = desired_changes.len();
    let mut changed_ids = Vec::with_capacity(desired_changed);
    for (write, digest, spec) in desired_changes {
        if let Ok(id) = DeviceId::parse(&write.id) {
            let desired = DesiredState {
                generation: store::to_u64(write.desired_generation),
                digest,
                spec,
            };
            state
                .fleet
                .apply([FleetChange::Desired(id.clone(), desired)]);
            changed_ids.push(id);
        }
    }
    if !changed_ids.is_empty() {
        // The engine refreshes the retained desired message of devices that
        // have one; an engine that stopped leaves it to the next start.
        let _ = state
            .engine
            .send(EngineCommand::DesiredChanged(changed_ids))
            .await;
    }
    let mut answer = json!({
        "created": counts.created,
        "updated": counts.updated,
        "unchanged": counts.unchanged,
        "desired_changed": desired_changed,
    });
    // Recorded before the passwords join the answer: they are never audited.
    let note = AuditNote {
        targets: Some(requested),
        detail: Some(answer.clone()),
        ..AuditNote::default()
    };
    if !issued.is_empty() {
        drop(_one_writer);
        credentials::apply_on_broker(&state, &issued).await?;
        answer["credentials"] =
            Value::Array(issued.iter().map(credentials::Issued::to_json).collect());
    }
    Ok(audited(note, StatusCode::OK, answer))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DeviceUpsert {
    labels: Option<Value>,
}

async fn upsert_device(
    State(state): State<Arc<AppState>>,
    Path(raw_id): Path<String>,
    ApiJson(body): ApiJson<DeviceUpsert>,
) -> Result<Response, ApiError> {
    let id = parse_id(&raw_id)?;
    let registration = Registration {
        id: id.to_string(),
        labels: parse_labels(body.labels)?,
    };
    let mut tx = state.pool.begin().await.context("starting a transaction")?;
    let counts = store::devices::register(&mut tx, &[registration]).await?;
    tx.commit().await.context("committing a registration")?;
    state.fleet.apply([FleetChange::Registered(id.clone())]);
    let status = if counts.created > 0 {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let row = store::devices::get(&state.pool, id.as_str()).await?;
    let note = AuditNote {
        targets: Some(1),
        ..AuditNote::default()
    };
    Ok(audited(
        note,
        status,
        row.map(device_json).unwrap_or(Value::Null),
    ))
}

async fn get_device(
    State(state): State<Arc<AppState>>,
    Path(raw_id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = parse_id(&raw_id)?;
    let Some(row) = store::devices::get(&state.pool, id.as_str()).await? else {
        return Err(ApiError::not_found(
            "unknown_device",
            format!("device {id} is not registered"),
        ));
    };
    let history = store::devices::history(&state.pool, id.as_str(), HISTORY_SHOWN).await?;
    let mut device = device_json(row);
    device["history"] = json!(history);
    Ok(Json(device))
}

/// `DELETE /v1/devices/{id}`: removes the device and its attempt history
/// (its outcomes in past runs stay), ends any attempt on it as `skipped`
/// (`device deleted`) and clears its retained `desired` and `status`
/// messages on the broker.
async fn delete_device(
    State(state): State<Arc<AppState>>,
    Path(raw_id): Path<String>,
) -> Result<Response, ApiError> {
    let id = registered(&state, &raw_id)?;
    let _one_writer = state.device_writes.lock().await;
    let mut tx = state.pool.begin().await.context("starting a transaction")?;
    let existed = store::devices::delete(&mut tx, id.as_str()).await?;
    tx.commit().await.context("committing a device deletion")?;
    drop(_one_writer);
    state.fleet.apply([FleetChange::Removed(id.clone())]);
    state.publisher.clear_retained(&id);
    let broker_account_removed = credentials::remove_from_broker(&state, &id).await;
    let _ = state
        .engine
        .send(EngineCommand::DevicesRemoved(vec![id.clone()]))
        .await;
    tracing::info!(device = %id, existed, "device deleted");
    let note = AuditNote {
        targets: Some(1),
        ..AuditNote::default()
    };
    Ok(audited(
        note,
        StatusCode::OK,
        json!({"id": id, "deleted": true, "broker_account_removed": broker_account_removed}),
    ))
}

/// `DELETE /v1/devices/{id}/reported`: forgets the device's reported state,
/// so its next report is accepted whatever its `seq` (the way out for a
/// device whose counter went backwards, or that was sent a bogus `seq`).
async fn reset_reported(
    State(state): State<Arc<AppState>>,
    Path(raw_id): Path<String>,
) -> Result<Response, ApiError> {
    let id = registered(&state, &raw_id)?;
    let _one_writer = state.device_writes.lock().await;
    let mut tx = state.pool.begin().await.context("starting a transaction")?;
    store::devices::reset_reported(&mut tx, id.as_str()).await?;
    tx.commit()
        .await
        .context("committing a reported-state reset")?;
    state
        .fleet
        .apply([FleetChange::ReportedCleared(id.clone())]);
    drop(_one_writer);
    let row = store::devices::get(&state.pool, id.as_str()).await?;
    let note = AuditNote {
        targets: Some(1),
        ..AuditNote::default()
    };
    Ok(audited(
        note,
        StatusCode::OK,
        row.map(device_json).unwrap_or(Value::Null),
    ))
}

#[derive(Debug, Deserialize)]
struct DeviceListQuery {
    status: Option<String>,
    /// `healthy`, `degraded` or `unhealthy`.
    health: Option<String>,
    /// `key:value`; may be given once.
    label: Option<String>,
    after: Option<String>,
    limit: Option<i64>,
}

async fn list_devices(
    State(state): State<Arc<AppState>>,
    Query(query): Query<DeviceListQuery>,
) -> Result<Json<Value>, ApiError> {
    if let Some(status) = &query.status {
        if DeviceStatus::parse(status).is_none() {
            return Err(ApiError::bad_request(
                "invalid_status",
                format!(
                    "status must be one of {:?}",
                    DeviceStatus::ALL.map(DeviceStatus::as_str)
                ),
            ));
        }
    }
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
                    "invalid_label",
                    "label filter must be `key:value`",
                ))
            }
        },
    };
    let limit = page_limit(query.limit)?;
    if let Some(health) = &query.health {
        if idem_protocol::Health::parse(health).is_none() {
            return Err(ApiError::bad_request(
                "invalid_health",
                "health must be healthy, degraded or unhealthy",
            ));
        }
    }
    let mut filter = DeviceFilter {
        status: query.status,
        health: query.health,
        labels,
        after: query.after,
        limit: limit.min(LIST_CHUNK),
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
            let device = device_json(row);
            bytes += device.to_string().len();
            devices.push(device);
        }
    }
    let next = more.then_some(filter.after).flatten();
    Ok(Json(json!({ "devices": devices, "next_after": next })))
}

fn page_limit(limit: Option<i64>) -> Result<i64, ApiError> {
    match limit {
        None => Ok(DEFAULT_PAGE),
        Some(n) if (1..=MAX_PAGE).contains(&n) => Ok(n),
        Some(n) => Err(ApiError::bad_request(
            "invalid_limit",
            format!("limit must be 1..={MAX_PAGE}, got {n}"),
        )),
    }
}

fn device_json(row: DeviceRow) -> Value {
    let desired = row.desired_spec.map(|spec| {
        json!({
            "generation": row.desired_generation,
            "spec": spec,
            "digest": row.desired_digest,
            "updated_at": row.desired_at,
        })
    });
    let reported = row.reported_spec.map(|spec| {
        let error = match (row.reported_error_generation, &row.reported_error) {
            (Some(generation), Some(message)) => {
                json!({"generation": generation, "message": message})
            }
            _ => Value::Null,
        };
        json!({
            "seq": row.reported_seq,
            "generation": row.reported_generation,
            "spec": spec,
            "digest": row.reported_digest,
            "health": row.reported_health,
            "error": error,
            "at": row.reported_at,
        })
    });
    let last_outcome = row.last_outcome.map(|outcome| {
        json!({"outcome": outcome, "reason": row.last_outcome_reason, "run_id": row.last_run_id})
    });
    json!({
        "id": row.id,
        "labels": row.labels,
        "status": row.status,
        "online": row.online,
        "desired": desired,
        "reported": reported,
        "in_sync": match (&row.desired_digest, &row.reported_digest) {
            (Some(d), Some(r)) => Value::Bool(d == r),
            _ => Value::Null,
        },
        "attempts": row.attempts,
        "next_attempt_at": row.next_attempt_at,
        "last_error": row.last_error,
        "last_outcome": last_outcome,
        "updated_at": row.updated_at,
    })
}

// ---------- desired state and runs ----------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DeviceDesired {
    spec: Value,
    #[serde(default)]
    force: bool,
}

async fn set_device_desired(
    State(state): State<Arc<AppState>>,
    Extension(actor): Extension<Actor>,
    Path(raw_id): Path<String>,
    ApiJson(body): ApiJson<DeviceDesired>,
) -> Result<Response, ApiError> {
    let id = registered(&state, &raw_id)?;
    input::check_spec(state.config.budget, &body.spec)?;
    let run = create_run(
        &state,
        &actor,
        vec![id.clone()],
        Trigger::Desired,
        body.force,
        Some(body.spec),
    )
    .await?;
    let generation = state
        .fleet
        .get(&id)
        .and_then(|e| e.desired.map(|d| d.generation));
    let note = AuditNote {
        targets: Some(1),
        generation,
        run_id: Some(run),
        detail: Some(json!({"force": body.force})),
    };
    Ok(audited(
        note,
        StatusCode::OK,
        json!({ "generation": generation, "run_id": run }),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Selector {
    labels: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Targeting {
    devices: Option<Vec<String>>,
    selector: Option<Selector>,
    #[serde(default)]
    all: bool,
    spec: Option<Value>,
    #[serde(default)]
    force: bool,
}

async fn set_desired_bulk(
    State(state): State<Arc<AppState>>,
    Extension(actor): Extension<Actor>,
    ApiJson(mut body): ApiJson<Targeting>,
) -> Result<Response, ApiError> {
    let Some(spec) = body.spec.take() else {
        return Err(ApiError::bad_request(
            "missing_spec",
            "`spec` is required; to re-check without a change use POST /v1/runs",
        ));
    };
    input::check_spec(state.config.budget, &spec)?;
    let targets = resolve_targets(&state, &body).await?;
    let count = targets.len();
    let digest = SpecDigest::of(&spec).to_string();
    let run = create_run(
        &state,
        &actor,
        targets,
        Trigger::Desired,
        body.force,
        Some(spec),
    )
    .await?;
    let note = AuditNote {
        targets: Some(count),
        generation: None,
        run_id: Some(run),
        detail: Some(
            json!({"targeting": targeting_summary(&body), "digest": digest, "force": body.force}),
        ),
    };
    Ok(audited(
        note,
        StatusCode::OK,
        json!({ "run_id": run, "targets": count }),
    ))
}

/// How a bulk call chose its targets, for the audit trail (ids capped).
fn targeting_summary(body: &Targeting) -> Value {
    if let Some(devices) = &body.devices {
        let shown: Vec<&String> = devices.iter().take(MAX_IDS_IN_ERROR).collect();
        json!({"devices": shown, "count": devices.len()})
    } else if let Some(selector) = &body.selector {
        json!({"selector": {"labels": selector.labels}})
    } else {
        json!({"all": true})
    }
}

async fn start_manual_run(
    State(state): State<Arc<AppState>>,
    Extension(actor): Extension<Actor>,
    ApiJson(body): ApiJson<Targeting>,
) -> Result<Response, ApiError> {
    if body.spec.is_some() {
        return Err(ApiError::bad_request(
            "unexpected_spec",
            "POST /v1/runs re-checks without a change; set a spec with POST /v1/desired",
        ));
    }
    let targets = resolve_targets(&state, &body).await?;
    let count = targets.len();
    // A re-check over exactly the targets (and force) of a manual run still
    // in progress joins it: a hundred identical calls cost one run.
    let mut sorted: Vec<&str> = targets.iter().map(DeviceId::as_str).collect();
    sorted.sort_unstable();
    let key = (SpecDigest::of(&json!(sorted)), body.force);
    let candidate = state
        .manual_runs
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&key)
        .copied();
    if let Some(run_id) = candidate {
        if let Some(run) = store::runs::get(&state.pool, run_id).await? {
            if run.state == "running" {
                let note = AuditNote {
                    targets: Some(count),
                    run_id: Some(run_id),
                    detail: Some(
                        json!({"targeting": targeting_summary(&body), "force": body.force, "joined": true}),
                    ),
                    ..AuditNote::default()
                };
                return Ok(audited(
                    note,
                    StatusCode::OK,
                    json!({ "run_id": run_id, "targets": count, "joined": true }),
                ));
            }
        }
    }
    let run = create_run(&state, &actor, targets, Trigger::Manual, body.force, None).await?;
    let mut manual_runs = state
        .manual_runs
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if manual_runs.len() >= MAX_REMEMBERED_MANUAL_RUNS {
        manual_runs.clear();
    }
    manual_runs.insert(key, run);
    drop(manual_runs);
    let note = AuditNote {
        targets: Some(count),
        run_id: Some(run),
        detail: Some(
            json!({"targeting": targeting_summary(&body), "force": body.force, "joined": false}),
        ),
        ..AuditNote::default()
    };
    Ok(audited(
        note,
        StatusCode::OK,
        json!({ "run_id": run, "targets": count, "joined": false }),
    ))
}

/// Exactly one of `devices`, `selector`, `all`; every named device must exist.
async fn resolve_targets(state: &AppState, body: &Targeting) -> Result<Vec<DeviceId>, ApiError> {
    let ways = usize::from(body.devices.is_some())
        + usize::from(body.selector.is_some())
        + usize::from(body.all);
    if ways != 1 {
        return Err(ApiError::bad_request(
            "invalid_targets",
            "give exactly one of `devices` (a list of ids), `selector` ({\"labels\": {...}}) or `all: true`",
        ));
    }
    if let Some(raw) = &body.devices {
        if raw.is_empty() {
            return Err(ApiError::bad_request("empty_targets", "`devices` is empty"));
        }
        input::check_count("devices", raw.len(), input::MAX_TARGET_IDS_PER_REQUEST)?;
        let mut seen = HashSet::with_capacity(raw.len());
        let mut ids = Vec::with_capacity(raw.len());
        for r in raw {
            let id = parse_id(r)?;
            if seen.insert(id.clone()) {
                ids.push(id);
            }
        }
        let unknown: Vec<&str> = ids
            .iter()
            .filter(|id| !state.fleet.contains(id))
            .map(DeviceId::as_str)
            .collect();
        if !unknown.is_empty() {
            let shown: Vec<&str> = unknown.iter().take(MAX_IDS_IN_ERROR).copied().collect();
            return Err(ApiError::not_found(
                "unknown_device",
                format!(
                    "{} device(s) are not registered: {}",
                    unknown.len(),
                    shown.join(", ")
                ),
            ));
        }
        return Ok(ids);
    }
    let rows = if let Some(selector) = &body.selector {
        if selector.labels.is_empty() {
            return Err(ApiError::bad_request(
                "empty_selector",
                "selector.labels is empty; name at least one label, or use `all: true`",
            ));
        }
        input::check_count("selector labels", selector.labels.len(), input::MAX_LABELS)?;
        for (key, value) in &selector.labels {
            input::check_label_pair(key, value)?;
        }
        let labels = serde_json::to_value(&selector.labels).unwrap_or_default();
        store::devices::ids_matching_labels(&state.pool, &labels).await?
    } else {
        store::devices::ids_matching_labels(&state.pool, &json!({})).await?
    };
    if rows.is_empty() {
        return Err(ApiError::not_found(
            "no_matching_devices",
            "no registered device matches the selector",
        ));
    }
    Ok(rows
        .iter()
        .filter_map(|r| DeviceId::parse(r).ok())
        .collect())
}

/// Commits a run (with the desired change, if any, and its `run.started`
/// event) and hands it to the engine. Returns the run id.
async fn create_run(
    state: &AppState,
    actor: &Actor,
    targets: Vec<DeviceId>,
    trigger: Trigger,
    force: bool,
    spec: Option<Value>,
) -> Result<Uuid, ApiError> {
    let run = NewRun {
        targets,
        trigger,
        force,
        spec,
        started_by: Some(actor.name.clone()),
    };
    let run = commit_run(
        &state.pool,
        &state.device_writes,
        &state.fleet,
        &state.event_source,
        run,
    )
    .await
    .map_err(|e| match e {
        CommitRunError::Store(e) => ApiError::from(e),
        CommitRunError::Event(e) => ApiError::from(e),
    })?;
    state.events_wake.notify_one();
    state.metrics.events_committed.increment(1);
    let run_id = run.id;
    state
        .engine
        .send(EngineCommand::StartRun(run))
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                "the server is shutting down; the run resumes at next start",
            )
        })?;
    Ok(run_id)
}

/// `POST /v1/devices/{id}/retry`: releases a quarantined device and runs it.
async fn retry_device(
    State(state): State<Arc<AppState>>,
    Extension(actor): Extension<Actor>,
    Path(raw_id): Path<String>,
) -> Result<Response, ApiError> {
    let id = registered(&state, &raw_id)?;
    let released = release(&state, vec![id.to_string()]).await?;
    if released.is_empty() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "not_quarantined",
            format!("device {id} is not quarantined"),
        ));
    }
    let run = create_run(&state, &actor, released, Trigger::Retry, false, None).await?;
    let note = AuditNote {
        targets: Some(1),
        run_id: Some(run),
        ..AuditNote::default()
    };
    Ok(audited(
        note,
        StatusCode::OK,
        json!({ "run_id": run, "targets": 1 }),
    ))
}

/// `POST /v1/runs/{id}/retry`: releases every quarantined device of a run
/// and runs them again.
async fn retry_run(
    State(state): State<Arc<AppState>>,
    Extension(actor): Extension<Actor>,
    Path(raw): Path<String>,
) -> Result<Response, ApiError> {
    let run_id = parse_run_id(&raw)?;
    if store::runs::get(&state.pool, run_id).await?.is_none() {
        return Err(ApiError::not_found(
            "unknown_run",
            format!("run {run_id} does not exist"),
        ));
    }
    let quarantined = store::devices::quarantined_in_run(&state.pool, run_id).await?;
    let released = release(&state, quarantined).await?;
    if released.is_empty() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "nothing_quarantined",
            "no device of this run is quarantined",
        ));
    }
    let count = released.len();
    let run = create_run(&state, &actor, released, Trigger::Retry, false, None).await?;
    let note = AuditNote {
        targets: Some(count),
        run_id: Some(run),
        detail: Some(json!({"retried_run": run_id})),
        ..AuditNote::default()
    };
    Ok(audited(
        note,
        StatusCode::OK,
        json!({ "run_id": run, "targets": count }),
    ))
}

async fn release(state: &AppState, ids: Vec<String>) -> Result<Vec<DeviceId>, ApiError> {
    let released = store::devices::release_quarantine(&state.pool, &ids).await?;
    let released: Vec<DeviceId> = released
        .iter()
        .filter_map(|id| DeviceId::parse(id).ok())
        .collect();
    state
        .fleet
        .apply(released.iter().cloned().map(FleetChange::Released));
    Ok(released)
}

#[derive(Debug, Deserialize)]
struct RunListQuery {
    limit: Option<i64>,
    before: Option<chrono::DateTime<chrono::Utc>>,
}

async fn list_runs(
    State(state): State<Arc<AppState>>,
    Query(query): Query<RunListQuery>,
) -> Result<Json<Value>, ApiError> {
    let limit = page_limit(query.limit)?;
    let rows = store::runs::list(&state.pool, query.before, limit).await?;
    let runs: Vec<Value> = rows.into_iter().map(run_json).collect();
    Ok(Json(json!({ "runs": runs })))
}

fn parse_run_id(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|_| {
        ApiError::bad_request("invalid_run_id", format!("{raw:?} is not a run id (UUID)"))
    })
}

async fn get_run(
    State(state): State<Arc<AppState>>,
    Path(raw): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = parse_run_id(&raw)?;
    match store::runs::get(&state.pool, id).await? {
        Some(row) => Ok(Json(run_json(row))),
        None => Err(ApiError::not_found(
            "unknown_run",
            format!("run {id} does not exist"),
        )),
    }
}

#[derive(Debug, Serialize)]
struct RunView {
    id: Uuid,
    trigger: String,
    state: String,
    force: bool,
    target_count: i32,
    counts: OutcomeCounts,
    summary: String,
    started_at: chrono::DateTime<chrono::Utc>,
    finished_at: Option<chrono::DateTime<chrono::Utc>>,
    duration_ms: Option<i64>,
    /// The operator token that started the run; `None` for runs the server
    /// started itself (see `trigger`).
    started_by: Option<String>,
}

fn run_json(row: RunRow) -> Value {
    let counts = row.counts();
    let view = RunView {
        id: row.id,
        summary: counts.summary(),
        counts,
        duration_ms: row
            .finished_at
            .map(|f| (f - row.started_at).num_milliseconds()),
        trigger: row.trigger,
        state: row.state,
        force: row.force,
        target_count: row.target_count,
        started_at: row.started_at,
        finished_at: row.finished_at,
        started_by: row.started_by,
    };
    serde_json::to_value(view).unwrap_or_default()
}

#[derive(Debug, Deserialize)]
struct OutcomeQuery {
    outcome: Option<String>,
    after: Option<String>,
    limit: Option<i64>,
}

async fn run_outcomes(
    State(state): State<Arc<AppState>>,
    Path(raw): Path<String>,
    Query(query): Query<OutcomeQuery>,
) -> Result<Json<Value>, ApiError> {
    let id = parse_run_id(&raw)?;
    if let Some(after) = &query.after {
        input::check_query_text("after", after)?;
    }
    if let Some(o) = &query.outcome {
        if OutcomeKind::parse(o).is_none() {
            let names: Vec<&str> = OutcomeKind::ALL.iter().map(|k| k.as_str()).collect();
            return Err(ApiError::bad_request(
                "invalid_outcome",
                format!("outcome must be one of {names:?}"),
            ));
        }
    }
    if store::runs::get(&state.pool, id).await?.is_none() {
        return Err(ApiError::not_found(
            "unknown_run",
            format!("run {id} does not exist"),
        ));
    }
    let limit = page_limit(query.limit)?;
    let rows = store::runs::outcomes(
        &state.pool,
        id,
        query.outcome.as_deref(),
        query.after.as_deref(),
        limit,
    )
    .await?;
    let next = (rows.len() as i64 == limit)
        .then(|| rows.last().map(|r| r.device_id.clone()))
        .flatten();
    Ok(Json(json!({ "outcomes": rows, "next_after": next })))
}

async fn fleet_summary(State(state): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let counts = store::devices::count_by_status(&state.pool).await?;
    let mut by_status: BTreeMap<&str, i64> =
        DeviceStatus::ALL.iter().map(|s| (s.as_str(), 0)).collect();
    let mut total = 0;
    for (status, n) in &counts {
        if let Some(slot) = by_status.get_mut(status.as_str()) {
            *slot = *n;
        }
        total += n;
    }
    let unhealthy = store::devices::count_unhealthy_converged(&state.pool).await?;
    let stats = &state.engine_stats;
    Ok(Json(json!({
        "devices": total,
        "by_status": by_status,
        "unhealthy_converged": unhealthy,
        "pushes": {
            "queued": stats.queued_pushes.load(Ordering::Relaxed),
            "in_flight": stats.pushes_in_flight.load(Ordering::Relaxed),
        },
        "attempts_in_flight": stats.attempts_in_flight.load(Ordering::Relaxed),
    })))
}

// ---------- operations ----------

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// Ready when the database answers, the broker connection is subscribed,
/// and neither the ingest nor the engine has been failing to commit for
/// longer than [`crate::stall::STUCK_AFTER`] (a worker can be stuck while a
/// plain `SELECT 1` still succeeds).
async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    let ping = tokio::time::timeout(READINESS_DB_TIMEOUT, store::ping(&state.pool)).await;
    let database = matches!(ping, Ok(Ok(())));
    let mqtt = state.mqtt.is_ready();
    let now = std::time::Instant::now();
    let stuck: BTreeMap<&str, String> = [
        ("ingest", state.stalls.ingest.stuck_for(now)),
        ("engine", state.stalls.engine.stuck_for(now)),
    ]
    .into_iter()
    .filter_map(|(worker, stuck)| {
        stuck.map(|d| {
            (
                worker,
                format!(
                    "no write committed for {} s while work waits (see the server log)",
                    d.as_secs()
                ),
            )
        })
    })
    .collect();
    let ready = database && mqtt && stuck.is_empty();
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({"ready": ready, "database": database, "mqtt": mqtt, "stuck": stuck})),
    )
        .into_response()
}

async fn not_found() -> ApiError {
    ApiError::not_found("not_found", "no such endpoint; see README.md for the API")
}
