//! Staged rollouts over the API: the `rollout` of a desired change,
//! checked into waves (400 `invalid_rollout` naming the field), and
//! `POST /v1/rollouts/{run_id}/resume|abort|approve`, carried out by the
//! engine — this process's, or through the database the engine's holder's
//! when another instance holds it — and answered with the rollout as it
//! stands.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::Extension;
use idem_protocol::api::{
    ErrorBody, ErrorCode, GatesRequest, RolloutActed, RolloutRequest, WaveRequest, WaveSizeRequest,
};
use serde_json::json;
use tokio::sync::oneshot;

use super::command::audited;
use super::params::{parse_run_id, unknown_run};
use crate::config::parse_duration;
use crate::engine::RolloutRequest as EngineRolloutRequest;
use crate::http::auth::{AuditNote, Call};
use crate::http::error::ApiError;
use crate::http::extract::ApiPath;
use crate::http::state::AppState;
use crate::reconcile::machine::{RolloutAction, RolloutActionError};
use crate::reconcile::rollout::{
    FailureLimit, Gates, NotNow, Pause, RolloutSpec, StoredRollout, WaveSize, WaveSpec,
};
use crate::store;
use crate::tuning::{HOLDER_ANSWERS_WITHIN, HOLDER_ANSWER_POLL, HOLDER_CLAIMS_WITHIN};

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(ErrorCode::InvalidRollout, message)
}

/// `rollout` as the core's checked waves.
pub(super) fn checked_rollout(request: &RolloutRequest) -> Result<RolloutSpec, ApiError> {
    if request.waves.len() > idem_protocol::api::rollouts::MAX_WAVES {
        return Err(invalid(format!(
            "`rollout.waves` has {} waves; at most {} are allowed",
            request.waves.len(),
            idem_protocol::api::rollouts::MAX_WAVES
        )));
    }
    let default_pause = match &request.pause {
        Some(raw) => pause("rollout.pause", raw)?,
        None => Pause::None,
    };
    let default_gates = match &request.gates {
        Some(gates) => checked_gates("rollout.gates", gates)?,
        None => Gates::default(),
    };
    let mut waves = Vec::with_capacity(request.waves.len());
    let last = request.waves.len().saturating_sub(1);
    for (i, wave) in request.waves.iter().enumerate() {
        let field = format!("rollout.waves[{i}]");
        // Nothing follows the last wave for a pause to hold back: the
        // rollout's pause is for the waves before it (one the last wave
        // asks for itself is refused).
        let default_pause = if i == last {
            Pause::None
        } else {
            default_pause
        };
        let spec = match wave {
            WaveRequest::Size(size) => WaveSpec {
                size: wave_size(&format!("{field}.size"), size)?,
                pause: default_pause,
                gates: default_gates,
                approve: false,
            },
            WaveRequest::Detailed(detail) => WaveSpec {
                size: wave_size(&format!("{field}.size"), &detail.size)?,
                pause: match &detail.pause {
                    Some(raw) => pause(&format!("{field}.pause"), raw)?,
                    None => default_pause,
                },
                gates: match &detail.gates {
                    Some(gates) => checked_gates(&format!("{field}.gates"), gates)?,
                    None => default_gates,
                },
                approve: detail.approve,
            },
        };
        waves.push(spec);
    }
    RolloutSpec::new(waves).map_err(|e| invalid(e.to_string()))
}

fn wave_size(field: &str, size: &WaveSizeRequest) -> Result<WaveSize, ApiError> {
    match size {
        WaveSizeRequest::Count(n) => Ok(WaveSize::Count(*n)),
        WaveSizeRequest::Text(text) => text
            .strip_suffix('%')
            .and_then(|number| number.parse::<f64>().ok())
            .filter(|p| p.is_finite())
            .map(WaveSize::Percent)
            .ok_or_else(|| {
                invalid(format!(
                    "`{field}` is {text:?}; a wave is a count (10) or a percentage (\"10%\")"
                ))
            }),
    }
}

fn pause(field: &str, raw: &str) -> Result<Pause, ApiError> {
    if raw == "manual" {
        return Ok(Pause::Manual);
    }
    let duration =
        parse_duration(raw).map_err(|e| invalid(format!("`{field}`: {e}, or \"manual\"")))?;
    Ok(if duration == Duration::ZERO {
        Pause::None
    } else {
        Pause::For(duration)
    })
}

fn checked_gates(field: &str, gates: &GatesRequest) -> Result<Gates, ApiError> {
    let ratio = |name: &str, value: Option<f64>| match value {
        Some(v) if !(0.0..=1.0).contains(&v) => Err(invalid(format!(
            "`{field}.{name}` is {v}; a ratio is within [0, 1]"
        ))),
        Some(_) | None => Ok(value),
    };
    let min_success_ratio = ratio("min_success_ratio", gates.min_success_ratio)?;
    let max_failures = match (
        gates.max_failures,
        ratio("max_failure_ratio", gates.max_failure_ratio)?,
    ) {
        (Some(_), Some(_)) => {
            return Err(invalid(format!(
                "`{field}` has both `max_failures` and `max_failure_ratio`; give one"
            )))
        }
        (Some(count), None) => Some(FailureLimit::Count(count)),
        (None, Some(ratio)) => Some(FailureLimit::Ratio(ratio)),
        (None, None) => None,
    };
    Ok(Gates {
        min_success_ratio,
        max_failures,
    })
}

/// `POST /v1/rollouts/{run_id}/resume`: a paused rollout goes on (after a
/// gate, the paused wave's rest with its gate waived; after a manual or
/// timed pause, the next wave).
#[utoipa::path(post, path = "/v1/rollouts/{run_id}/resume", tag = "rollouts",
    params(("run_id" = inline(idem_protocol::api::bounds::schema::UuidText), Path, description = "the rollout's run id")),
    responses((status = 200, body = RolloutActed), (status = "4XX", body = ErrorBody)))]
pub(super) async fn resume_rollout(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(raw): ApiPath<String>,
) -> Result<Response, ApiError> {
    let asked = ("resume", call.actor.name.as_str());
    act(&state, &raw, RolloutAction::Resume, asked).await
}

/// `POST /v1/rollouts/{run_id}/abort`: nothing more is pushed; the devices
/// not yet pushed end `skipped` (`aborted`), those pushed keep the outcome
/// their answer gives.
#[utoipa::path(post, path = "/v1/rollouts/{run_id}/abort", tag = "rollouts",
    params(("run_id" = inline(idem_protocol::api::bounds::schema::UuidText), Path, description = "the rollout's run id")),
    responses((status = 200, body = RolloutActed), (status = "4XX", body = ErrorBody)))]
pub(super) async fn abort_rollout(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(raw): ApiPath<String>,
) -> Result<Response, ApiError> {
    let asked = ("abort", call.actor.name.as_str());
    act(&state, &raw, RolloutAction::Abort, asked).await
}

/// `POST /v1/rollouts/{run_id}/approve`: a rollout waiting after a wave
/// marked `approve` goes on; refused (403 `self_approval`) to the token
/// that started it.
#[utoipa::path(post, path = "/v1/rollouts/{run_id}/approve", tag = "rollouts",
    params(("run_id" = inline(idem_protocol::api::bounds::schema::UuidText), Path, description = "the rollout's run id")),
    responses((status = 200, body = RolloutActed), (status = "4XX", body = ErrorBody)))]
pub(super) async fn approve_rollout(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(raw): ApiPath<String>,
) -> Result<Response, ApiError> {
    let action = RolloutAction::Approve {
        by: call.actor.name.clone(),
    };
    act(&state, &raw, action, ("approve", call.actor.name.as_str())).await
}

async fn act(
    state: &AppState,
    raw: &str,
    action: RolloutAction,
    (verb, by): (&str, &str),
) -> Result<Response, ApiError> {
    let run_id = parse_run_id(raw)?;
    let row = store::runs::get(&state.pool, run_id)
        .await?
        .ok_or_else(|| unknown_run(run_id))?;
    let Some(stored) = row.rollout else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::NotARollout,
            format!("run {run_id} is not a rollout (it was started without `rollout`)"),
        ));
    };
    let shutting_down = || {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::ShuttingDown,
            "the server is shutting down; nothing was done, try again once it is back",
        )
    };
    let (reply, answer) = oneshot::channel();
    state
        .rollout_requests
        .send(EngineRolloutRequest {
            run_id,
            action,
            reply,
        })
        .await
        .map_err(|_| shutting_down())?;
    let acted = answer.await.map_err(|_| shutting_down())?;
    let stored = match acted {
        Ok(acted) => acted,
        Err(RolloutActionError::CarriedElsewhere) => {
            ask_the_holder(state, run_id, verb, by, &stored.0).await?
        }
        Err(e) => return Err(refused(run_id, &stored.0, e)),
    };
    let view = stored.view();
    let note = AuditNote {
        run_id: Some(run_id),
        detail: Some(json!({
            "rollout": verb,
            "wave": view.wave,
            "state": view.state,
        })),
        ..AuditNote::default()
    };
    Ok(audited(
        note,
        StatusCode::OK,
        RolloutActed {
            run_id,
            rollout: view,
        },
    ))
}

/// Asks the instance that holds the engine for `verb` on `run_id` (by the
/// token `by`), through the database, and waits for its answer.
async fn ask_the_holder(
    state: &AppState,
    run_id: uuid::Uuid,
    verb: &str,
    by: &str,
    stored: &serde_json::Value,
) -> Result<StoredRollout, ApiError> {
    use store::rollout_actions::{self as asked, ActionAnswer};
    let id = asked::ask(&state.pool, run_id, verb, by).await?;
    let started = tokio::time::Instant::now();
    let mut withdrawn_tried = false;
    loop {
        if let Some(answer) = asked::take_answer(&state.pool, id).await? {
            return match answer {
                ActionAnswer::Done(raw) => serde_json::from_value(raw).map_err(|e| {
                    tracing::error!(error = %e, %run_id, "the engine holder's answer to a rollout action is not a rollout");
                    ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        ErrorCode::Internal,
                        "the engine holder's answer could not be read; GET /v1/runs/{run_id} shows the rollout",
                    )
                }),
                ActionAnswer::Refused { refusal, message } => Err(match refusal.as_str() {
                    "self_approval" => refused(
                        run_id,
                        stored,
                        RolloutActionError::NotNow(NotNow::SelfApproval),
                    ),
                    "not_in_progress" => {
                        refused(run_id, stored, RolloutActionError::NotInProgress)
                    }
                    _ => ApiError::new(StatusCode::CONFLICT, ErrorCode::RolloutState, message),
                }),
            };
        }
        let waited = started.elapsed();
        if waited >= HOLDER_CLAIMS_WITHIN && !withdrawn_tried {
            withdrawn_tried = true;
            if asked::withdraw(&state.pool, id).await? {
                return Err(holder_silent(
                    "no instance holding the engine took the action up within 10 s; nothing \
                     was done: retry once GET /v1/cluster lists an engine holder",
                ));
            }
        }
        if waited >= HOLDER_CLAIMS_WITHIN + HOLDER_ANSWERS_WITHIN {
            return Err(holder_silent(
                "the instance holding the engine took the action up but did not answer within \
                 20 s; GET /v1/runs/{run_id} shows whether it was carried out",
            ));
        }
        tokio::time::sleep(HOLDER_ANSWER_POLL).await;
    }
}

fn holder_silent(message: &'static str) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::EngineNotAnswering,
        message,
    )
}

/// The answer to an action the rollout's state does not allow.
fn refused(run_id: uuid::Uuid, stored: &serde_json::Value, e: RolloutActionError) -> ApiError {
    match e {
        RolloutActionError::NotNow(NotNow::SelfApproval) => ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::SelfApproval,
            "the rollout's author cannot approve it; another operator's token must",
        ),
        RolloutActionError::NotNow(e) => {
            ApiError::new(StatusCode::CONFLICT, ErrorCode::RolloutState, e.to_string())
        }
        RolloutActionError::CarriedElsewhere => ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::RolloutState,
            "this instance does not carry reconciliation now: send the action to the instance \
             that holds the engine lease (GET /v1/cluster lists it under leases)",
        ),
        RolloutActionError::NotInProgress => {
            let state = serde_json::from_value::<StoredRollout>(stored.clone())
                .ok()
                .and_then(|stored| serde_json::to_value(stored.view().state).ok())
                .and_then(|state| state.as_str().map(str::to_owned))
                .unwrap_or_else(|| "not readable".to_owned());
            ApiError::new(
                StatusCode::CONFLICT,
                ErrorCode::RolloutState,
                format!("rollout {run_id} is {state}: it is not in progress"),
            )
        }
    }
}
