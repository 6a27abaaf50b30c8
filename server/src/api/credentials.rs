//! Devices' broker credentials: issuing a password when a device is
//! registered (shown once), `POST /v1/devices/{id}/credentials` to issue a
//! new one, and creating or removing the account on the broker when the
//! server manages it (`--broker-accounts dynsec`).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use idem_protocol::api::{CredentialsRequest, ErrorBody, IssuedCredential};
use idem_protocol::DeviceId;
use serde_json::json;

use super::command::{audited, DeviceWrite};
use super::params::registered;
use crate::api_error::ApiError;
use crate::auth::AuditNote;
use crate::broker_accounts;
use crate::state::AppState;
use crate::store;

/// Shortest and longest password an operator may supply.
const MIN_PASSWORD_BYTES: usize = 12;
const MAX_PASSWORD_BYTES: usize = 256;

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
    let ok = (MIN_PASSWORD_BYTES..=MAX_PASSWORD_BYTES).contains(&password.len())
        && !password.chars().any(char::is_control);
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request(
            "invalid_broker_password",
            format!(
                "a broker password is {MIN_PASSWORD_BYTES} to {MAX_PASSWORD_BYTES} bytes without control characters"
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
                let password = supplied.unwrap_or_else(broker_accounts::generate_password);
                let hash = broker_accounts::mosquitto_hash(&password);
                Issued { id, password, hash }
            })
            .collect()
    })
    .await
    .map_err(|e| {
        tracing::error!(error = %e, "hashing broker passwords failed");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "issuing broker passwords failed (details are in the server log)",
        )
    })
}

/// Creates (or, for existing accounts, re-keys) the devices' accounts on
/// the broker when the server manages them there.
pub(super) async fn apply_on_broker(state: &AppState, issued: &[Issued]) -> Result<(), ApiError> {
    let Some(dynsec) = &state.dynsec else {
        return Ok(());
    };
    let root = &state.config.topic_root;
    let commands = issued
        .iter()
        .flat_map(|i| {
            let mut c = broker_accounts::create_device(root, &i.id, &i.password);
            // An account that exists already gets the new password.
            c.push(broker_accounts::set_device_password(&i.id, &i.password));
            c
        })
        .collect();
    dynsec.execute_all_ok(commands).await.map_err(|e| {
        tracing::error!(error = %e, devices = issued.len(), "creating broker accounts failed");
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            "broker_accounts_failed",
            format!(
                "the broker did not create the devices' accounts: {e}; issue new credentials with POST /v1/devices/{{id}}/credentials"
            ),
        )
    })
}

/// Removes a deleted device's account; failures are logged (the device is
/// gone from idem either way) and reported as `false`.
pub(super) async fn remove_from_broker(state: &AppState, id: &DeviceId) -> Option<bool> {
    let dynsec = state.dynsec.as_ref()?;
    match dynsec.execute(broker_accounts::delete_device(id)).await {
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
    params(("id" = String, Path, description = "device id")),
    request_body(content = Option<CredentialsRequest>, description = "optional; no body generates a password"),
    responses((status = 200, body = IssuedCredential), (status = "4XX", body = ErrorBody)))]
pub(super) async fn rotate(
    State(state): State<Arc<AppState>>,
    Path(raw_id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    // The body is optional: no body means "generate a password".
    let request: CredentialsRequest = if body.iter().all(u8::is_ascii_whitespace) {
        CredentialsRequest::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_body",
                e.to_string(),
            )
        })?
    };
    let id = registered(&state, &raw_id)?;
    if !state.config.config.broker_accounts.issues_passwords() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "broker_accounts_unmanaged",
            "this server does not issue broker credentials (--broker-accounts none); set IDEM_BROKER_ACCOUNTS=dynsec or password-file",
        ));
    }
    let supplied = request.password;
    if let Some(password) = &supplied {
        check_password(password)?;
    }
    let issued = issue(vec![(id.clone(), supplied)]).await?;
    let hashes: Vec<(String, String)> = issued
        .iter()
        .map(|i| (i.id.to_string(), i.hash.clone()))
        .collect();
    let mut write = DeviceWrite::begin(&state).await?;
    store::devices::set_broker_password_hashes(write.tx(), &hashes).await?;
    write.commit("committing broker credentials").await?;
    apply_on_broker(&state, &issued).await?;
    let note = AuditNote {
        targets: Some(1),
        detail: Some(json!({"credentials_for": id})),
        ..AuditNote::default()
    };
    Ok(audited(
        note,
        StatusCode::OK,
        issued.first().map(Issued::credential),
    ))
}
