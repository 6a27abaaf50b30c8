//! Device-owned fields: `PUT /v1/owned-fields` replaces the declaration of
//! the spec paths devices own (server-wide and per label selector),
//! committing it with its audit record and the cache's per-device owned
//! paths, then re-evaluates the fleet with a run; a declaration that would
//! change what devices an approval policy covers own is kept as a proposal
//! instead, put in force by `POST /v1/owned-fields/proposals/{id}/approve`
//! from another token; `GET /v1/owned-fields` reads both.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use idem_protocol::api::bounds::MAX_OWNED_FIELDS_PROPOSALS;
use idem_protocol::api::{
    ErrorBody, ErrorCode, OwnedFieldsDeclaration, OwnedFieldsProposal, OwnedFieldsView,
};
use idem_protocol::{DeviceId, Trigger};
use serde_json::json;
use uuid::Uuid;

use super::approvals::approval_needed;
use super::command::{recorded, start_follow_up_run, DeviceWrite};
use super::params::parse_hyphenated_id;
use crate::engine::new_run::NewRun;
use crate::http::auth::{AuditNote, Call};
use crate::http::error::ApiError;
use crate::http::extract::{ApiJson, ApiPath};
use crate::http::input;
use crate::http::state::AppState;
use crate::reconcile::owned::OwnedFieldSet;
use crate::store::owned::{Proposed, StoredProposal};
use crate::store::{self, Context};

/// `PUT /v1/owned-fields`: the spec paths devices own from now on (the whole
/// declaration; an empty one owns nothing). Devices whose only difference
/// from their desired spec lies in paths now owned are converged by the run
/// it starts, without a push. One that changes what a covered device owns
/// is answered `202` with the proposal, not in force until approved.
#[utoipa::path(put, path = "/v1/owned-fields", tag = "owned-fields",
    request_body = OwnedFieldsDeclaration,
    responses((status = 200, body = OwnedFieldsView),
        (status = 202, body = OwnedFieldsProposal, description = "the declaration needs another operator's approval: kept as this proposal, not in force"),
        (status = "4XX", body = ErrorBody)))]
pub(super) async fn put_owned_fields(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiJson(body): ApiJson<OwnedFieldsDeclaration>,
) -> Result<Response, ApiError> {
    let set = checked_declaration(&body)?;
    let mut write = DeviceWrite::begin(&state).await?;
    let based_on = store::owned::load(&mut **write.tx().tx())
        .await?
        .map(|d| d.updated_at);
    let updated_at = store::owned::save(write.tx(), &body, &call.actor.name).await?;
    let changed = write.refresh_owned(&set, store::Scope::All, false).await?;
    let needed = approval_needed(&state, &mut **write.tx().tx(), &changed).await?;
    if let Some(reason) = needed {
        // Nothing of the declaration is written: dropping the write rolls
        // it back, and the proposal is stored on its own.
        drop(write);
        let proposal = StoredProposal {
            id: Uuid::now_v7(),
            declaration: body,
            author: call.actor.name.clone(),
            based_on,
            reason,
            devices_changed: i64::try_from(changed.len()).unwrap_or(i64::MAX),
            created_at: Utc::now(),
        };
        return propose(&state, &call, proposal).await;
    }
    let declaration = Declared {
        body,
        set,
        changed,
        updated_at,
        approved_by: None,
    };
    declared(&state, &call, write, declaration).await
}

/// `POST /v1/owned-fields/proposals/{id}/approve`: puts a proposed
/// declaration in force, by a token other than its author's (403
/// `self_approval`), unless the declaration in force changed since it was
/// proposed (409 `owned_fields_changed`).
#[utoipa::path(post, path = "/v1/owned-fields/proposals/{id}/approve", tag = "owned-fields",
    params(("id" = inline(idem_protocol::api::bounds::schema::UuidText), Path, description = "proposal id")),
    responses((status = 200, body = OwnedFieldsView), (status = "4XX", body = ErrorBody)))]
pub(super) async fn approve_owned_fields(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(raw): ApiPath<String>,
) -> Result<Response, ApiError> {
    let id = parse_hyphenated_id(
        &raw,
        ErrorCode::InvalidOwnedFieldsProposalId,
        "a proposal id (a UUID, as PUT /v1/owned-fields answers with 202)",
    )?;
    let mut write = DeviceWrite::begin(&state).await?;
    let Some(proposal) = store::owned::proposal_for_approval(write.tx(), id).await? else {
        return Err(ApiError::not_found(
            ErrorCode::UnknownOwnedFieldsProposal,
            format!("no declaration of owned fields waits for approval as {id}"),
        ));
    };
    if proposal.author == call.actor.name {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::SelfApproval,
            format!(
                "proposal {id} was made by {}: its author cannot approve it; another operator's \
                 token must",
                proposal.author
            ),
        ));
    }
    let in_force = store::owned::load(&mut **write.tx().tx()).await?;
    let now_based_on = in_force.as_ref().map(|d| d.updated_at);
    if now_based_on != proposal.based_on {
        let by = in_force.map(|d| d.updated_by).unwrap_or_default();
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::OwnedFieldsChanged,
            format!(
                "the declaration in force changed since proposal {id} was made (by {by}); \
                 approving it would undo that: propose again (PUT /v1/owned-fields)"
            ),
        ));
    }
    let set = checked_declaration(&proposal.declaration)?;
    store::owned::delete_proposal(write.tx(), id).await?;
    let updated_at =
        store::owned::save(write.tx(), &proposal.declaration, &proposal.author).await?;
    let changed = write.refresh_owned(&set, store::Scope::All, false).await?;
    state.metrics.plan("approved");
    let approved = Declared {
        body: proposal.declaration,
        set,
        changed,
        updated_at,
        approved_by: Some((id, proposal.author)),
    };
    declared(&state, &call, write, approved).await
}

/// `GET /v1/owned-fields`: the declaration in force, and those waiting for
/// approval.
#[utoipa::path(get, path = "/v1/owned-fields", tag = "owned-fields",
    responses((status = 200, body = OwnedFieldsView), (status = "4XX", body = ErrorBody)))]
pub(super) async fn get_owned_fields(
    State(state): State<Arc<AppState>>,
) -> Result<Json<OwnedFieldsView>, ApiError> {
    Ok(Json(view(&state).await?))
}

/// A declaration's selectors within the label bounds, as the set it makes.
fn checked_declaration(body: &OwnedFieldsDeclaration) -> Result<OwnedFieldSet, ApiError> {
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
    OwnedFieldSet::from_declaration(body)
        .map_err(|e| ApiError::bad_request(ErrorCode::InvalidOwnedFields, e.to_string()))
}

/// Stores a proposal (replacing its author's last) with its audit record.
async fn propose(
    state: &AppState,
    call: &Call,
    proposal: StoredProposal,
) -> Result<Response, ApiError> {
    let mut tx = state.pool.begin().await.context("starting a transaction")?;
    let proposed = store::owned::propose(&mut tx, &proposal, MAX_OWNED_FIELDS_PROPOSALS).await?;
    let stored = match proposed {
        Proposed::Proposed(stored) => stored,
        Proposed::Full => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                ErrorCode::TooManyOwnedFieldsProposals,
                format!(
                    "{MAX_OWNED_FIELDS_PROPOSALS} declarations of other operators wait for \
                     approval, the most the server keeps; have one approved first"
                ),
            ))
        }
    };
    state.metrics.plan("refused_unapproved");
    let note = AuditNote {
        targets: Some(usize::try_from(stored.devices_changed).unwrap_or(usize::MAX)),
        detail: Some(json!({
            "proposal": stored.id,
            "fields": stored.declaration.fields,
            "by_selector": stored.declaration.by_selector,
            "approval_required": stored.reason,
        })),
        ..AuditNote::default()
    };
    store::access::record_audit(&mut *tx, &call.audit(StatusCode::ACCEPTED, note)).await?;
    tx.commit()
        .await
        .context("committing an owned-fields proposal")?;
    Ok(recorded(StatusCode::ACCEPTED, proposal_view(stored)))
}

/// A declaration written in a transaction not yet committed.
struct Declared {
    body: OwnedFieldsDeclaration,
    set: OwnedFieldSet,
    changed: Vec<DeviceId>,
    updated_at: DateTime<Utc>,
    /// The proposal approved, and its author.
    approved_by: Option<(Uuid, String)>,
}

/// Commits a declaration with its audit record and the cache's owned set,
/// then re-evaluates the devices whose owned paths changed.
async fn declared(
    state: &AppState,
    call: &Call,
    mut write: DeviceWrite<'_>,
    declared: Declared,
) -> Result<Response, ApiError> {
    let Declared {
        body,
        set,
        changed,
        updated_at,
        approved_by,
    } = declared;
    write.change([store::cache::FleetChange::OwnedSet(Arc::new(set))]);
    let count_changed = changed.len() as u64;
    let (proposal, author) = approved_by.unzip();
    let note = AuditNote {
        targets: Some(changed.len()),
        detail: Some(json!({
            "fields": body.fields,
            "by_selector": body.by_selector,
            "devices_changed": changed.len(),
            "proposal": proposal,
            "proposal_author": author,
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
        match start_follow_up_run(state, call, NewRun::new(changed, Trigger::Manual)).await {
            Ok((run_id, _)) => Some(run_id),
            Err(e) => {
                tracing::warn!(error = ?e, devices = count, "owned fields declared; their re-evaluation run did not start");
                None
            }
        }
    };
    let proposals = store::owned::proposals(&state.pool).await?;
    Ok(recorded(
        StatusCode::OK,
        OwnedFieldsView {
            fields: body.fields,
            by_selector: body.by_selector,
            updated_by: Some(author.unwrap_or_else(|| call.actor.name.clone())),
            updated_at: Some(updated_at),
            devices: state.fleet.count_owning() as u64,
            devices_changed: Some(count_changed),
            run_id,
            proposals: proposals.into_iter().map(proposal_view).collect(),
        },
    ))
}

fn proposal_view(stored: StoredProposal) -> OwnedFieldsProposal {
    OwnedFieldsProposal {
        id: stored.id,
        fields: stored.declaration.fields,
        by_selector: stored.declaration.by_selector,
        author: stored.author,
        created_at: stored.created_at,
        reason: stored.reason,
        devices_changed: u64::try_from(stored.devices_changed).unwrap_or(0),
    }
}

async fn view(state: &AppState) -> Result<OwnedFieldsView, ApiError> {
    let stored = store::owned::load(&state.pool).await?;
    let proposals = store::owned::proposals(&state.pool)
        .await?
        .into_iter()
        .map(proposal_view)
        .collect();
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
            proposals,
        },
        None => OwnedFieldsView {
            fields: Vec::new(),
            by_selector: Vec::new(),
            updated_by: None,
            updated_at: None,
            devices,
            devices_changed: None,
            run_id: None,
            proposals,
        },
    })
}
