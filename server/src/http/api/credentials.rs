//! Devices' broker credentials: issuing a password when a device is
//! registered (shown once), `POST /v1/devices/{id}/credentials` to issue a
//! new one, and creating or removing the account on the broker when the
//! server manages it (`--broker-accounts dynsec`).

use idem_protocol::api::{bounds, ErrorCode};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::Extension;
use idem_protocol::api::{CredentialsRequest, ErrorBody, IssuedCredential};
use idem_protocol::DeviceId;
use serde_json::json;

use super::command::{recorded, DeviceWrite};
use super::params::registered;
use crate::broker::accounts::{self, AccountOwner};
use crate::http::auth::{AuditNote, Call};
use crate::http::error::ApiError;
use crate::http::extract::{decode_strictly, ApiPath};
use crate::http::state::AppState;
use crate::store;

/// A password issued to a device, shown once.
#[derive(Debug, Clone)]
pub(super) struct Issued {
    pub id: DeviceId,
    pub password: String,
    pub hash: String,
}

impl Issued {
    /// As the answer shows it: the user name is the device id.
    pub fn credential(&self) -> IssuedCredential {
        IssuedCredential {
            id: self.id.to_string(),
            username: self.id.to_string(),
            password: self.password.clone(),
        }
    }
}

/// An operator-supplied password: long enough, printable text.
pub(super) fn check_password(password: &str) -> Result<(), ApiError> {
    if bounds::is_broker_password(password) {
        Ok(())
    } else {
        Err(ApiError::bad_request(
            ErrorCode::InvalidBrokerPassword,
            format!(
                "a broker password is {} to {} characters without control characters",
                bounds::MIN_PASSWORD_CHARS,
                bounds::MAX_PASSWORD_CHARS
            ),
        ))
    }
}

/// Passwords (supplied or generated) and their Mosquitto hashes, hashed off
/// the async workers (PBKDF2 costs about 0.1 ms per device).
pub(super) async fn issue(
    wanted: Vec<(DeviceId, Option<String>)>,
) -> Result<Vec<Issued>, ApiError> {
    tokio::task::spawn_blocking(move || {
        wanted
            .into_iter()
            .map(|(id, supplied)| {
                let password = supplied.unwrap_or_else(accounts::generate_password);
                let hash = accounts::mosquitto_hash(&password);
                Issued { id, password, hash }
            })
            .collect()
    })
    .await
    .map_err(|e| {
        tracing::error!(error = %e, "hashing broker passwords failed");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Internal,
            "issuing broker passwords failed (details are in the server log)",
        )
    })
}

/// Ids shown in a refusal that names several, at most.
const MAX_IDS_NAMED: usize = 10;

/// Refuses device ids that name a broker account no device may have: the
/// reserved user names (built-in, the server's, configured) and every
/// account of `--broker-accounts-file`. Checked in every mode, so a device
/// row can never stand for such an account later either.
pub(super) fn refuse_reserved<'a>(
    state: &AppState,
    ids: impl IntoIterator<Item = &'a DeviceId>,
) -> Result<(), ApiError> {
    let security = &state.config.security;
    let mut reserved = security.reserved_broker_usernames();
    reserved.extend(security.broker_accounts_file_names().map_err(|e| {
        tracing::error!(error = %e, "cannot read the broker accounts file");
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::BrokerAccountsFileUnreadable,
            "the server cannot read its --broker-accounts-file (details are in the server log)",
        )
    })?);
    let taken: Vec<&str> = ids
        .into_iter()
        .filter(|id| reserved.contains(id.as_str()))
        .map(DeviceId::as_str)
        .collect();
    refuse_named(
        &taken,
        "is a reserved broker account (the server's, a reader's, an admin's or a configured one)",
    )
}

/// A 409 naming the first of `ids`, or `Ok` when there are none.
fn refuse_named(ids: &[&str], why: &str) -> Result<(), ApiError> {
    let Some(first) = ids.first() else {
        return Ok(());
    };
    let shown: Vec<&str> = ids.iter().take(MAX_IDS_NAMED).copied().collect();
    let message = if ids.len() == 1 {
        format!("device id {first:?} {why}; choose another id")
    } else {
        format!(
            "{} device ids name broker accounts that are not theirs ({why}): {}; choose other ids",
            ids.len(),
            shown.join(", ")
        )
    };
    Err(ApiError::new(
        StatusCode::CONFLICT,
        ErrorCode::ReservedBrokerAccount,
        message,
    ))
}

fn broker_unavailable(e: impl std::fmt::Display, devices: usize) -> ApiError {
    tracing::error!(error = %e, devices, "the broker's dynamic-security plugin failed");
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        ErrorCode::BrokerAccountsFailed,
        format!(
            "the broker did not answer for the devices' accounts: {e}; issue new credentials with POST /v1/devices/{{id}}/credentials"
        ),
    )
}

/// Whose the broker accounts named like `ids` are (`--broker-accounts
/// dynsec`; without it, every name counts as absent).
pub(super) async fn account_owners(
    state: &AppState,
    ids: &[DeviceId],
) -> Result<Vec<AccountOwner>, ApiError> {
    let Some(dynsec) = &state.dynsec else {
        return Ok(vec![AccountOwner::Absent; ids.len()]);
    };
    let answers = dynsec
        .execute(ids.iter().map(accounts::get_client).collect())
        .await
        .map_err(|e| broker_unavailable(e, ids.len()))?;
    if answers.len() != ids.len() {
        return Err(broker_unavailable(
            format!("{} answers to {} questions", answers.len(), ids.len()),
            ids.len(),
        ));
    }
    ids.iter()
        .zip(&answers)
        .map(|(id, answer)| {
            accounts::account_owner(id, answer).map_err(|e| broker_unavailable(e, ids.len()))
        })
        .collect()
}

/// Refuses, before anything is written, ids whose name is taken on the
/// broker by an account that is not theirs.
pub(super) async fn refuse_foreign_accounts(
    state: &AppState,
    ids: &[DeviceId],
) -> Result<(), ApiError> {
    let owners = account_owners(state, ids).await?;
    let foreign: Vec<&str> = ids
        .iter()
        .zip(&owners)
        .filter(|(_, owner)| **owner == AccountOwner::Foreign)
        .map(|(id, _)| id.as_str())
        .collect();
    refuse_named(
        &foreign,
        "names an account on the broker that is not this device's",
    )
}

/// Creates the devices' accounts on the broker, or sets the new password
/// on accounts that are already theirs, when the server manages them
/// there. A name taken by any other account meanwhile is left untouched and
/// refused.
pub(super) async fn apply_on_broker(state: &AppState, issued: &[Issued]) -> Result<(), ApiError> {
    let Some(dynsec) = &state.dynsec else {
        return Ok(());
    };
    let ids: Vec<DeviceId> = issued.iter().map(|i| i.id.clone()).collect();
    let owners = account_owners(state, &ids).await?;
    let root = &state.config.fleet.topic_root;
    let mut commands = Vec::new();
    let mut foreign = Vec::new();
    for (i, owner) in issued.iter().zip(owners) {
        match accounts::provision_device(root, &i.id, &i.password, owner) {
            Some(c) => commands.extend(c),
            None => foreign.push(i.id.as_str()),
        }
    }
    dynsec
        .execute_all_ok(commands)
        .await
        .map_err(|e| broker_unavailable(e, issued.len()))?;
    refuse_named(
        &foreign,
        "names an account on the broker that is not this device's (it was left untouched; delete the device)",
    )
}

/// Removes a deleted device's account when it is the device's own (any
/// other account of that name is left alone); failures are logged (the
/// device is gone from idem either way) and reported as `false`.
pub(super) async fn remove_from_broker(state: &AppState, id: &DeviceId) -> Option<bool> {
    let dynsec = state.dynsec.as_ref()?;
    let owner = match account_owners(state, std::slice::from_ref(id)).await {
        Ok(owners) => owners.first().copied(),
        Err(_) => None,
    };
    let commands = match owner {
        Some(AccountOwner::ThisDevice) => accounts::delete_device(id),
        Some(AccountOwner::Absent) => vec![accounts::delete_device_role(id)],
        Some(AccountOwner::Foreign) => {
            tracing::warn!(device = %id, "a broker account named like the deleted device is not its own; left it");
            return Some(false);
        }
        None => return Some(false),
    };
    match dynsec.execute(commands).await {
        Ok(results) => Some(
            results
                .iter()
                .all(|r| r.is_ok() || r.error.as_deref().is_some_and(|e| e.contains("not found"))),
        ),
        Err(e) => {
            tracing::warn!(device = %id, error = %e, "could not remove the device's broker account");
            Some(false)
        }
    }
}

/// `POST /v1/devices/{id}/credentials`: a new broker password for a device.
#[utoipa::path(post, path = "/v1/devices/{id}/credentials", tag = "devices",
    params(("id" = inline(DeviceId), Path, description = "device id")),
    request_body(content = Option<CredentialsRequest>, description = "optional; no body generates a password"),
    responses((status = 200, body = IssuedCredential), (status = "4XX", body = ErrorBody)))]
pub(super) async fn rotate(
    State(state): State<Arc<AppState>>,
    Extension(call): Extension<Call>,
    ApiPath(raw_id): ApiPath<String>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    // No body, or JSON `null`, means "generate a password".
    let value: serde_json::Value = if body.iter().all(u8::is_ascii_whitespace) {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad_request(ErrorCode::InvalidJson, e.to_string()))?
    };
    let request: CredentialsRequest = if value.is_null() {
        CredentialsRequest::default()
    } else {
        decode_strictly(&value).map_err(|e| {
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::InvalidBody,
                e.to_string(),
            )
        })?
    };
    let id = registered(&state, &raw_id).await?;
    if !state.config.security.broker_accounts.issues_passwords() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::BrokerAccountsUnmanaged,
            "this server does not issue broker credentials (--broker-accounts none); set IDEM_BROKER_ACCOUNTS=dynsec or password-file",
        ));
    }
    let supplied = request.password;
    if let Some(password) = &supplied {
        check_password(password)?;
    }
    // A device row named like a foreign account (registered before names
    // were reserved) never re-passwords that account.
    refuse_reserved(&state, [&id])?;
    refuse_foreign_accounts(&state, std::slice::from_ref(&id)).await?;
    let issued = issue(vec![(id.clone(), supplied)]).await?;
    let hashes: Vec<(DeviceId, String)> = issued
        .iter()
        .map(|i| (i.id.clone(), i.hash.clone()))
        .collect();
    let note = AuditNote {
        targets: Some(1),
        detail: Some(json!({"credentials_for": id})),
        ..AuditNote::default()
    };
    let mut write = DeviceWrite::begin(&state).await?;
    store::devices::set_broker_password_hashes(write.tx(), &hashes).await?;
    write
        .commit(
            "committing broker credentials",
            call.audit(StatusCode::OK, note),
        )
        .await?;
    apply_on_broker(&state, &issued).await?;
    Ok(recorded(
        StatusCode::OK,
        issued.first().map(Issued::credential),
    ))
}
