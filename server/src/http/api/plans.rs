//! Plans: `POST /v1/plans` computes what a desired change would do, device
//! by device, with the decision a run takes (`reconcile::plan`), and changes
//! nothing in the fleet — no device row, run, event, audit record or MQTT
//! message — but keeps the plan in PostgreSQL (`store::plans`), where every
//! instance reads it; `GET /v1/plans/{id}` and `GET /v1/plans/{id}/devices` read it with
//! field-level diffs; `POST /v1/plans/{id}/approve` records another
//! operator's approval; `POST /v1/plans/{id}/apply` applies it (in waves,
//! if asked) through the command layer, refused when anything it was
//! computed on changed or an approval it needs is missing.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::Utc;
use idem_protocol::api::{
    Approval as ApiPlanApproval, ErrorBody, ErrorCode, PlanApplyRequest, PlanApproved, PlanChange,
    PlanCounts, PlanDevicePage, PlanDeviceQuery, PlanSkipCounts, PlanSkipReason,
    PlanState as ApiPlanState, PlanView, PlannedDevice, RunStarted, TargetedRequest,
};
use idem_protocol::{DeviceId, SpecDigest};
use serde_json::json;
use uuid::Uuid;

use super::approvals::{approval_needed, approval_required};
use super::command::{audited, audited_ids, recorded, start_run};
use super::desired::{checked_targeting, matching, targeting_summary};
use super::devices::field_diffs;
use super::params::{page_limit, parse_hyphenated_id};
use crate::engine::new_run::NewRun;
use crate::http::auth::{Actor, AuditNote, Call, DryRun};
use crate::http::error::ApiError;
use crate::http::extract::{ApiJson, ApiJsonOrEmpty, ApiPath, ApiQuery};
use crate::http::input;
use crate::http::large_reads::MAX_PAGE_BYTES;
use crate::http::state::AppState;
use crate::reconcile::owned::NewSpecDigests;
use crate::reconcile::plan::book::{self, BookRefusal};
use crate::reconcile::plan::{
    plan_devices, ApproveRefusal, Plan, PlanApproval, PlanSkip, PlanState, Unusable, Verdict,
};
use crate::reconcile::policy::Blocked;
use crate::reconcile::rollout::RolloutSpec;
use crate::store;

/// `POST /v1/plans`: what `POST /v1/desired` with this body would do, device
/// by device; nothing is changed or recorded.
#[utoipa::path(post, path = "/v1/plans", tag = "plans",
    request_body = idem_protocol::api::PlanRequest,
    responses((status = 201, body = PlanView), (status = "4XX", body = ErrorBody),
        (status = 503, description = "large_reads_busy: every turn of large reads taken; retry after Retry-After", body = ErrorBody)))]
pub(super) async fn create_plan(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiJson(mut body): ApiJson<TargetedRequest>,
) -> Result<Response, ApiError> {
    let Some(spec) = body.spec.take() else {
        return Err(ApiError::bad_request(
            ErrorCode::MissingSpec,
            "`spec` is required: a plan previews a change of desired state",
        ));
    };
    input::check_spec(state.config.fleet.budget, &spec)?;
    if body.rollout.is_some() {
        return Err(ApiError::bad_request(
            ErrorCode::InvalidRollout,
            "`rollout` is given when a plan is applied (POST /v1/plans/{id}/apply with \
             {\"rollout\": …}), not when it is made",
        ));
    }
    let targeting = checked_targeting(&body)?;
    let targets = matching(&state, &targeting).await?;
    let digest = SpecDigest::of(&spec);
    let mut digests = NewSpecDigests::new(&spec, digest);
    let (devices, counts) =
        plan_devices(&targets, |id| state.fleet.get(id), &mut digests, body.force);
    let now = Utc::now();
    let ttl = chrono::Duration::from_std(state.config.changes.plan_ttl)
        .unwrap_or(chrono::Duration::hours(1));
    let plan = Plan {
        id: Uuid::now_v7(),
        author: call.actor.name.clone(),
        created_at: now,
        expires_at: now + ttl,
        targeting,
        spec: Arc::new(spec),
        digest,
        force: body.force,
        devices,
        counts,
    };
    // The answer shows the plan's first page: a large read.
    let _turn = match state.large_reads.turn_for(Some(&call.actor.name)).await {
        Ok(turn) => turn,
        Err(refused) => return Ok(refused),
    };
    let admitted = store::plans::keep(&state.pool, &plan, |kept| {
        book::admit(
            kept,
            &plan.author,
            now,
            crate::config::MAX_PLANS_PER_AUTHOR,
            crate::config::MAX_PLANS_KEPT,
        )
    })
    .await?;
    admitted.map_err(|refusal| too_many_plans(&plan.author, refusal))?;
    let plan = Arc::new(plan);
    state.plans.remember(plan.clone());
    state.metrics.plan("created");
    let view = plan_view(&state, &plan, PlanState::Open, None).await?;
    Ok((StatusCode::CREATED, Extension(DryRun), Json(view)).into_response())
}

/// `GET /v1/plans/{id}`: a plan, with the first page of its pushes.
#[utoipa::path(get, path = "/v1/plans/{id}", tag = "plans",
    params(("id" = inline(idem_protocol::api::bounds::schema::UuidText), Path, description = "plan id")),
    responses((status = 200, body = PlanView), (status = "4XX", body = ErrorBody),
        (status = 503, description = "large_reads_busy: every turn of large reads taken; retry after Retry-After", body = ErrorBody)))]
pub(super) async fn get_plan(
    State(state): State<Arc<AppState>>,
    actor: Option<Extension<Actor>>,
    ApiPath(raw): ApiPath<String>,
) -> Result<Response, ApiError> {
    let id = plan_id(&raw)?;
    let kept = store::plans::kept(&state.pool, id)
        .await?
        .ok_or_else(|| unknown_plan(id))?;
    let token = actor.as_deref().map(|actor| actor.name.as_str());
    let _turn = match state.large_reads.turn_for(token).await {
        Ok(turn) => turn,
        Err(refused) => return Ok(refused),
    };
    let plan = content(&state, id).await?;
    let view = plan_view(&state, &plan, kept.state(Utc::now()), kept.approval).await?;
    Ok(Json(view).into_response())
}

/// `GET /v1/plans/{id}/devices`: a page of a plan's devices in id order.
#[utoipa::path(get, path = "/v1/plans/{id}/devices", tag = "plans",
    params(("id" = inline(idem_protocol::api::bounds::schema::UuidText), Path, description = "plan id"), PlanDeviceQuery),
    responses((status = 200, body = PlanDevicePage), (status = "4XX", body = ErrorBody),
        (status = 503, description = "large_reads_busy: every turn of large reads taken; retry after Retry-After", body = ErrorBody)))]
pub(super) async fn plan_devices_page(
    State(state): State<Arc<AppState>>,
    actor: Option<Extension<Actor>>,
    ApiPath(raw): ApiPath<String>,
    ApiQuery(query): ApiQuery<PlanDeviceQuery>,
) -> Result<Response, ApiError> {
    let id = plan_id(&raw)?;
    // 1..=PAGE_LIMIT_MAX, so it fits.
    let limit = usize::try_from(page_limit(query.limit)?).unwrap_or(1);
    if let Some(after) = &query.after {
        input::check_query_text("after", after)?;
    }
    let token = actor.as_deref().map(|actor| actor.name.as_str());
    let _turn = match state.large_reads.turn_for(token).await {
        Ok(turn) => turn,
        Err(refused) => return Ok(refused),
    };
    let plan = content(&state, id).await?;
    let (devices, next_after) =
        page(&state, &plan, query.change, query.after.as_deref(), limit).await?;
    Ok(Json(PlanDevicePage {
        devices,
        next_after,
    })
    .into_response())
}

/// `POST /v1/plans/{id}/apply`: the run that does what the plan said
/// (in the waves of `rollout`, if the body gives one), refused
/// (`409 plan_stale`) when a device it covers changed since, or a device
/// joined its targeting, or it was applied already, and
/// (`409 approval_required`) when it needs an approval it does not have.
#[utoipa::path(post, path = "/v1/plans/{id}/apply", tag = "plans",
    params(("id" = inline(idem_protocol::api::bounds::schema::UuidText), Path, description = "plan id")),
    request_body(content = Option<PlanApplyRequest>, description = "optional: the waves to apply it in"),
    responses((status = 200, body = RunStarted), (status = "4XX", body = ErrorBody)))]
pub(super) async fn apply_plan(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(raw): ApiPath<String>,
    ApiJsonOrEmpty(body): ApiJsonOrEmpty<PlanApplyRequest>,
) -> Result<Response, ApiError> {
    let id = plan_id(&raw)?;
    let rollout = body
        .rollout
        .as_ref()
        .map(super::rollouts::checked_rollout)
        .transpose()?;
    let now = Utc::now();
    let claimed = store::plans::claim(&state.pool, id, now, |kept| book::claim(kept, now)).await?;
    let approval = claimed.map_err(|unusable| refused(&state, id, unusable))?;
    let started = match content(&state, id).await {
        Ok(plan) => {
            let targets = plan.devices.len() as u64;
            let run = apply_claimed(&state, &call, plan, approval, rollout, body).await;
            run.map(|run| (run, targets))
        }
        Err(e) => Err(e),
    };
    // The run's row names the plan, which says it was applied whatever
    // the plan's own row says; an unreleased claim lapses (`CLAIM_LAPSE`).
    let (run, targets) = match started {
        Ok((run, targets)) => {
            if let Err(e) = store::plans::applied(&state.pool, id, run).await {
                tracing::warn!(plan = %id, error = %e, "could not record the plan applied");
            }
            (run, targets)
        }
        Err(e) => {
            if let Err(release) = store::plans::release(&state.pool, id).await {
                tracing::warn!(plan = %id, error = %release, "could not release the plan's claim");
            }
            return Err(e);
        }
    };
    state.metrics.plan("applied");
    let answer = RunStarted {
        run_id: run,
        targets,
        joined: None,
    };
    Ok(recorded(StatusCode::OK, answer))
}

/// Starts the run of a plan this call claimed, once its approval (if it
/// needs one) is there.
async fn apply_claimed(
    state: &AppState,
    call: &Call,
    plan: Arc<Plan>,
    approval: Option<PlanApproval>,
    rollout: Option<RolloutSpec>,
    body: PlanApplyRequest,
) -> Result<Uuid, ApiError> {
    let devices: Vec<DeviceId> = plan.devices.iter().map(|d| d.id.clone()).collect();
    // An approval given when none was needed is recorded all the same.
    if approval.is_none() {
        if let Some(reason) = approval_needed(state, &state.pool, &devices).await? {
            state.metrics.plan("refused_unapproved");
            return Err(approval_required(&reason));
        }
    }
    let count = plan.devices.len();
    let request = TargetedRequest::from(plan.targeting.clone());
    let note = AuditNote {
        targets: Some(count),
        detail: Some(json!({
            "plan_id": plan.id,
            "plan_author": plan.author,
            "approved_by": approval.as_ref().map(|a| a.by.as_str()),
            "approved_at": approval.as_ref().map(|a| a.at),
            "targeting": targeting_summary(&request),
            "devices": audited_ids(plan.devices.iter().map(|d| d.id.as_str())),
            "digest": plan.digest.to_string(),
            "force": plan.force,
            "rollout": body.rollout.as_ref().map(|r| json!(r)),
        })),
        ..AuditNote::default()
    };
    let run = NewRun::applying(plan.clone(), approval).in_waves(rollout);
    let (run, _) = start_run(state, call, run, note).await.inspect_err(|e| {
        if e.code() == ErrorCode::PlanStale {
            state.metrics.plan("refused_stale");
        }
    })?;
    Ok(run)
}

/// `POST /v1/plans/{id}/approve`: approves an open plan, by a token other
/// than its author's (403 `self_approval`); once approved, it can be
/// applied even where approval is required.
#[utoipa::path(post, path = "/v1/plans/{id}/approve", tag = "plans",
    params(("id" = inline(idem_protocol::api::bounds::schema::UuidText), Path, description = "plan id")),
    responses((status = 200, body = PlanApproved), (status = "4XX", body = ErrorBody)))]
pub(super) async fn approve_plan(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(raw): ApiPath<String>,
) -> Result<Response, ApiError> {
    let id = plan_id(&raw)?;
    let now = Utc::now();
    let mut author = None;
    let approved = store::plans::approve(&state.pool, id, |kept| {
        author = kept.map(|k| k.author.clone());
        book::approve(kept, &call.actor.name, now)
    })
    .await?;
    let approval = approved.map_err(|refusal| match refusal {
        ApproveRefusal::Unusable(unusable) => unusable_plan(id, unusable),
        ApproveRefusal::SelfApproval => ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::SelfApproval,
            format!(
                "plan {id} was made by {}: its author cannot approve it; another \
                 operator's token must",
                call.actor.name
            ),
        ),
        ApproveRefusal::Approved(given) => ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::AlreadyApproved,
            format!(
                "plan {id} was approved already, by {} at {}",
                given.by, given.at
            ),
        ),
    })?;
    state.metrics.plan("approved");
    let note = AuditNote {
        detail: Some(json!({
            "plan_id": id,
            "plan_author": author,
            "approved_by": approval.by,
        })),
        ..AuditNote::default()
    };
    Ok(audited(
        note,
        StatusCode::OK,
        PlanApproved {
            plan_id: id,
            approved_by: approval.by,
            approved_at: approval.at,
        },
    ))
}

/// Plan `id`'s content, kept (its row was read just before) or not.
async fn content(state: &AppState, id: Uuid) -> Result<Arc<Plan>, ApiError> {
    state
        .plans
        .get(&state.pool, id)
        .await?
        .ok_or_else(|| unknown_plan(id))
}

/// The refusal of a new plan the book has no room for.
fn too_many_plans(author: &str, refusal: BookRefusal) -> ApiError {
    let message = match refusal {
        BookRefusal::AuthorFull {
            per_author,
            oldest_expires,
        } => format!(
            "{author} keeps {per_author} plans in use, the most one operator keeps (open or \
             being applied); apply one, or make this one once the oldest expires at \
             {oldest_expires} (--plan-ttl). Another operator's plans are never forgotten to \
             make room"
        ),
        BookRefusal::BookFull { capacity } => format!(
            "the server keeps {capacity} plans in use, the most it keeps of all operators \
             together (each operator's {} at most); try again once some are applied or expire \
             (--plan-ttl)",
            crate::config::MAX_PLANS_PER_AUTHOR
        ),
    };
    ApiError::new(StatusCode::CONFLICT, ErrorCode::TooManyPlans, message)
}

fn plan_id(raw: &str) -> Result<Uuid, ApiError> {
    parse_hyphenated_id(
        raw,
        ErrorCode::InvalidPlanId,
        "a plan id (a UUID, as POST /v1/plans answers)",
    )
}

fn unknown_plan(id: Uuid) -> ApiError {
    ApiError::not_found(
        ErrorCode::UnknownPlan,
        format!(
            "no plan {id}: a plan is kept until it expired as long ago as it lived \
             (--plan-ttl); make a new one with POST /v1/plans"
        ),
    )
}

/// The refusal to apply a plan that cannot be, counted.
fn refused(state: &AppState, id: Uuid, unusable: Unusable) -> ApiError {
    match unusable {
        Unusable::Unknown => {}
        Unusable::Expired(_) => state.metrics.plan("refused_expired"),
        Unusable::Applying | Unusable::Applied(_) => state.metrics.plan("refused_stale"),
    }
    unusable_plan(id, unusable)
}

/// Why the plan cannot be applied (or approved).
fn unusable_plan(id: Uuid, unusable: Unusable) -> ApiError {
    match unusable {
        Unusable::Unknown => unknown_plan(id),
        Unusable::Expired(at) => ApiError::new(
            StatusCode::GONE,
            ErrorCode::PlanExpired,
            format!("plan {id} expired at {at}; re-plan with POST /v1/plans"),
        ),
        Unusable::Applying => ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::PlanStale,
            format!("plan {id} is being applied by another call; a plan applies once"),
        ),
        Unusable::Applied(run) => ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::PlanStale,
            format!("plan {id} was applied already, by run {run}; re-plan"),
        ),
    }
}

async fn plan_view(
    state: &AppState,
    plan: &Plan,
    plan_state: PlanState,
    approval: Option<PlanApproval>,
) -> Result<PlanView, ApiError> {
    let ids: Vec<DeviceId> = plan.devices.iter().map(|d| d.id.clone()).collect();
    let reason = approval_needed(state, &state.pool, &ids).await?;
    let (devices, next_after) = page(
        state,
        plan,
        Some(PlanChange::Push),
        None,
        idem_protocol::api::bounds::PAGE_LIMIT_DEFAULT as usize,
    )
    .await?;
    let (state_name, applied_run) = match plan_state {
        PlanState::Open => (ApiPlanState::Open, None),
        PlanState::Applied(run) => (ApiPlanState::Applied, Some(run)),
        PlanState::Expired => (ApiPlanState::Expired, None),
    };
    let counts = plan.counts;
    Ok(PlanView {
        plan_id: plan.id,
        state: state_name,
        applied_run,
        author: plan.author.clone(),
        created_at: plan.created_at,
        expires_at: plan.expires_at,
        digest: plan.digest.to_string(),
        force: plan.force,
        counts: PlanCounts {
            targets: counts.targets,
            already_converged: counts.converged,
            push: counts.push,
            skipped: counts.skipped(),
            skipped_by_reason: PlanSkipCounts {
                offline: counts.offline,
                quarantined: counts.quarantined,
                exempt: counts.exempt,
                no_report: counts.no_report,
            },
        },
        devices,
        next_after,
        approval: ApiPlanApproval {
            required: reason.is_some(),
            reason,
            approved_by: approval.as_ref().map(|a| a.by.clone()),
            approved_at: approval.map(|a| a.at),
        },
    })
}

/// A page of `plan`'s devices with `change` (any when `None`) after
/// `after`, each with its diff from its stored report, and the cursor of
/// the next page.
/// A plan's devices read at a time while building a page.
const PAGE_CHUNK: usize = 20;

async fn page(
    state: &AppState,
    plan: &Plan,
    change: Option<PlanChange>,
    after: Option<&str>,
    limit: usize,
) -> Result<(Vec<PlannedDevice>, Option<String>), ApiError> {
    let wanted = |verdict: Verdict| change.is_none_or(|c| c == change_of(verdict).0);
    let (devices, mut more) = plan.page(after, wanted, limit);
    // Reports read and diffs made a few devices at a time, and the page
    // ends once its JSON reaches the byte bound (with one device at least),
    // so neither the answer nor the memory it takes grows with the specs.
    let mut shown = Vec::new();
    let mut bytes = 0;
    'chunks: for chunk in devices.chunks(PAGE_CHUNK) {
        let ids: Vec<DeviceId> = chunk.iter().map(|d| d.id.clone()).collect();
        let mut reports: HashMap<String, store::devices::StoredReport> =
            store::devices::reports_of(&state.pool, &ids)
                .await?
                .into_iter()
                .map(|r| (r.id.clone(), r))
                .collect();
        for device in chunk {
            if bytes >= MAX_PAGE_BYTES {
                more = true;
                break 'chunks;
            }
            let report = reports.remove(device.id.as_str());
            let spec = report.as_ref().and_then(|r| r.reported_spec.as_ref());
            let seq = report
                .as_ref()
                .and_then(|r| r.reported_seq)
                .map(store::to_u64);
            let (change, reason) = change_of(device.verdict);
            let planned = PlannedDevice {
                device_id: device.id.to_string(),
                change,
                reason,
                generation: device.generation,
                unchanged: !device.new_generation,
                diff: spec.map(|reported| {
                    field_diffs(
                        reported,
                        &plan.spec,
                        state.fleet.owned(&device.id).as_deref(),
                    )
                }),
                reported_since_plan: seq != device.basis.reported_seq,
            };
            bytes += serde_json::to_vec(&planned).map_or(0, |json| json.len());
            shown.push(planned);
        }
    }
    let next_after = more
        .then(|| shown.last().map(|d| d.device_id.clone()))
        .flatten();
    Ok((shown, next_after))
}

fn change_of(verdict: Verdict) -> (PlanChange, Option<PlanSkipReason>) {
    match verdict {
        Verdict::Converged => (PlanChange::Converged, None),
        Verdict::Push => (PlanChange::Push, None),
        Verdict::Skipped(PlanSkip::Blocked(Blocked::Offline)) => {
            (PlanChange::Skipped, Some(PlanSkipReason::Offline))
        }
        Verdict::Skipped(PlanSkip::Blocked(Blocked::Quarantined)) => {
            (PlanChange::Skipped, Some(PlanSkipReason::Quarantined))
        }
        Verdict::Skipped(PlanSkip::Blocked(Blocked::Exempt)) => {
            (PlanChange::Skipped, Some(PlanSkipReason::Exempt))
        }
        Verdict::Skipped(PlanSkip::NoReport) => {
            (PlanChange::Skipped, Some(PlanSkipReason::NoReport))
        }
    }
}
