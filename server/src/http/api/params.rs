//! Path and query parameters every resource reads the same way: device and
//! run ids, page limits, labels; and the selectors and reasons of the
//! bodies of exemptions and approval policies. Each refusal is the API's
//! error answer.

use idem_protocol::api::bounds::MAX_EXEMPTION_REASON_CHARS;
use idem_protocol::api::{ErrorCode, Selector};
use idem_protocol::DeviceId;
use serde_json::Value;
use uuid::Uuid;

use crate::http::error::ApiError;
use crate::http::input;
use crate::http::state::AppState;

use idem_protocol::api::bounds::{PAGE_LIMIT_DEFAULT, PAGE_LIMIT_MAX};

/// Most items one list page returns.
pub(super) const MAX_PAGE: i64 = PAGE_LIMIT_MAX as i64;
const DEFAULT_PAGE: i64 = PAGE_LIMIT_DEFAULT as i64;

pub(super) fn parse_id(raw: &str) -> Result<DeviceId, ApiError> {
    DeviceId::parse(raw)
        .map_err(|e| ApiError::bad_request(ErrorCode::InvalidDeviceId, format!("{raw:?}: {e}")))
}

/// A valid id of a registered device, or the matching 400 / 404. A device
/// this instance's cache does not hold may have been registered through
/// another instance a moment ago: the cache catches up first when the
/// change log is ahead of it.
pub(super) async fn registered(state: &AppState, raw: &str) -> Result<DeviceId, ApiError> {
    let id = parse_id(raw)?;
    if !state.fleet.contains(&id) {
        state.writer.follow_if_overtaken().await?;
        if !state.fleet.contains(&id) {
            return Err(unknown_device(&id));
        }
    }
    Ok(id)
}

pub(super) fn unknown_device(id: &DeviceId) -> ApiError {
    ApiError::not_found(
        ErrorCode::UnknownDevice,
        format!("device {id} is not registered"),
    )
}

pub(super) fn parse_run_id(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|_| {
        ApiError::bad_request(
            ErrorCode::InvalidRunId,
            format!("{raw:?} is not a run id (UUID)"),
        )
    })
}

/// An id in the hyphenated form the API answers with (36 characters: the
/// only form of that length `Uuid::parse_str` reads); otherwise `400 code`
/// saying it is not `what` ("a plan id (a UUID, as POST /v1/plans answers)").
pub(super) fn parse_hyphenated_id(
    raw: &str,
    code: ErrorCode,
    what: &str,
) -> Result<Uuid, ApiError> {
    (raw.len() == 36)
        .then(|| Uuid::parse_str(raw).ok())
        .flatten()
        .ok_or_else(|| ApiError::bad_request(code, format!("{raw:?} is not {what}")))
}

pub(super) fn unknown_run(id: Uuid) -> ApiError {
    ApiError::not_found(ErrorCode::UnknownRun, format!("run {id} does not exist"))
}

pub(super) fn page_limit(limit: Option<i64>) -> Result<i64, ApiError> {
    match limit {
        None => Ok(DEFAULT_PAGE),
        Some(n) if (1..=MAX_PAGE).contains(&n) => Ok(n),
        Some(n) => Err(ApiError::bad_request(
            ErrorCode::InvalidLimit,
            format!("limit must be 1..={MAX_PAGE}, got {n}"),
        )),
    }
}

pub(super) fn parse_labels(labels: Option<Value>) -> Result<Option<Value>, ApiError> {
    match labels {
        None => Ok(None),
        Some(labels) => {
            input::check_labels(&labels)?;
            Ok(Some(labels))
        }
    }
}

/// A selector naming at least one label, each within the label bounds.
pub(super) fn checked_selector(selector: &Selector) -> Result<Selector, ApiError> {
    if selector.labels.is_empty() {
        return Err(ApiError::bad_request(
            ErrorCode::EmptySelector,
            "selector.labels is empty; name at least one label",
        ));
    }
    input::check_count("selector labels", selector.labels.len(), input::MAX_LABELS)?;
    for (key, value) in &selector.labels {
        input::check_label_pair(key, value)?;
    }
    Ok(selector.clone())
}

/// The `reason` of an exemption or an approval policy: 1 to
/// [`MAX_EXEMPTION_REASON_CHARS`] characters, no NUL (PostgreSQL stores no
/// NUL in text; refused here, with the reason, before it gets there).
pub(super) fn checked_reason(reason: &str) -> Result<(), ApiError> {
    let chars = reason.chars().count();
    if !(1..=MAX_EXEMPTION_REASON_CHARS).contains(&chars) {
        return Err(ApiError::bad_request(
            ErrorCode::InvalidReason,
            format!("`reason` must be 1 to {MAX_EXEMPTION_REASON_CHARS} characters (got {chars})"),
        ));
    }
    if reason.contains('\0') {
        return Err(ApiError::bad_request(
            ErrorCode::InvalidReason,
            "`reason` holds a NUL character (\\u0000); write it without one",
        ));
    }
    Ok(())
}
