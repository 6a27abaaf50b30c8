//! Who may call what on the HTTP API: operator bearer tokens (random, stored
//! as SHA-256 hashes), three roles, **the one table** of the role each route
//! needs, and the middleware that enforces it and records every mutating
//! call in the audit trail.
//!
//! Handlers never check roles themselves; they receive the caller as an
//! [`Actor`] (and, on mutating calls, the [`Call`]). A call that changes
//! something writes its audit record in the transaction of that change
//! ([`Call::audit`]) and marks its answer [`AuditWritten`]; the middleware
//! records every other mutating call (refusals, failures, calls that
//! changed nothing) itself.

use std::fmt;
use std::sync::Arc;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use idem_protocol::api::ErrorCode;
use serde_json::Value;
use sha2::{Digest as _, Sha256};
use uuid::Uuid;

use crate::http::error::ApiError;
use crate::ops::metrics::Metrics;
use crate::store::{self, access::AuditRecord};

pub use crate::config::AuthSettings;

/// What a token may do; each role includes the ones below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Read everything: devices, runs, fleet, events, metrics.
    Viewer,
    /// Also change desired state, start runs, retry, reset reported state.
    Operator,
    /// Also manage tokens, delete devices, issue broker credentials, read
    /// the audit trail.
    Admin,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Viewer, Role::Operator, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }

    pub fn parse(raw: &str) -> Option<Self> {
        Role::ALL.into_iter().find(|r| r.as_str() == raw)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a route requires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// No token (liveness, readiness).
    Open,
    /// A valid token with at least this role.
    Needs(Role),
}

/// One method on one path and who may call it: a row of the route table
/// (`crate::http::api::routes` builds it from the handlers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub method: Method,
    /// The path template, e.g. `/v1/devices/{id}`.
    pub path: String,
    pub access: Access,
}

/// What the middleware needs: the tokens and the audit trail (the pool),
/// the settings and the refusal counter; narrower than the handlers' state.
#[derive(Clone)]
pub struct AuthState {
    pub pool: sqlx::PgPool,
    pub settings: AuthSettings,
    pub metrics: Arc<Metrics>,
    /// The route table (`crate::http::api::routes`).
    pub routes: Arc<[Route]>,
}

/// The access `method` on the route `route` needs, by the route table
/// `routes`. `HEAD` is answered by the `GET` handler and needs what `GET`
/// needs. Methods missing from the table (a wrong method on a known path)
/// need a viewer token, so an unauthenticated caller learns nothing about
/// them.
pub fn access_for(
    settings: AuthSettings,
    routes: &[Route],
    method: &Method,
    route: &str,
) -> Access {
    if (settings.open_metrics && route == "/metrics")
        || (settings.open_events && route == "/v1/events")
    {
        return Access::Open;
    }
    let method = if method == Method::HEAD {
        &Method::GET
    } else {
        method
    };
    routes
        .iter()
        .find(|r| r.method == method && r.path == route)
        .map_or(Access::Needs(Role::Viewer), |r| r.access)
}

/// The authenticated caller, handed to handlers as a request extension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    /// The token's name (`anonymous` without auth).
    pub name: String,
    pub role: Role,
}

/// A mutating call being served: who made it and on which route, for the
/// audit record its change writes in its own transaction. In the request
/// extensions of every authenticated mutating call.
#[derive(Debug, Clone)]
pub struct Call {
    pub actor: Actor,
    pub method: Method,
    /// The route pattern (`/v1/devices/{id}`).
    pub route: String,
    /// The concrete path (`/v1/devices/pump-7`).
    pub path: String,
}

impl Call {
    /// The audit record of this call answered with `status`, having done
    /// what `note` says.
    pub fn audit(&self, status: StatusCode, note: AuditNote) -> AuditRecord {
        audit_record(
            &self.actor,
            &self.method,
            &self.route,
            &self.path,
            status.as_u16(),
            note,
        )
    }
}

/// Marks an answer whose audit record was written in the transaction of
/// the change it reports: the middleware writes none for it.
#[derive(Debug, Clone, Copy)]
pub struct AuditWritten;

/// Marks the answer of a mutating method that changes nothing by design
/// (a plan, `POST /v1/plans`): the audit trail keeps no record of it.
#[derive(Debug, Clone, Copy)]
pub struct DryRun;

/// What a mutating handler did, attached to its response for the audit
/// trail.
#[derive(Debug, Clone, Default)]
pub struct AuditNote {
    pub targets: Option<usize>,
    pub generation: Option<idem_protocol::Generation>,
    pub run_id: Option<Uuid>,
    pub detail: Option<Value>,
}

/// A freshly generated token: shown once, stored only as its hash.
#[derive(Debug)]
pub struct GeneratedToken {
    /// `idem_` followed by 64 hex digits (256 random bits).
    pub secret: String,
    pub hash: [u8; 32],
}

/// A new random token.
pub fn generate_token() -> GeneratedToken {
    let bytes: [u8; 32] = rand::random();
    let secret = format!("{TOKEN_PREFIX}{}", hex::encode(bytes));
    let hash = hash_token(&secret);
    GeneratedToken { secret, hash }
}

const TOKEN_PREFIX: &str = "idem_";

/// The stored form of a token. Tokens carry 256 random bits, so a plain
/// SHA-256 is enough (no password-style stretching needed).
pub fn hash_token(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

/// Why a request was not authenticated or not allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    MissingToken,
    UnknownToken,
    Expired,
    Revoked,
    Forbidden {
        needs: Role,
        has: Role,
        name: String,
    },
}

impl Refusal {
    /// Label value of `idem_http_auth_refusals_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::MissingToken => "missing",
            Refusal::UnknownToken => "unknown",
            Refusal::Expired => "expired",
            Refusal::Revoked => "revoked",
            Refusal::Forbidden { .. } => "forbidden",
        }
    }

    /// Every value of [`Refusal::reason`].
    pub const REASONS: [&'static str; 5] = crate::ops::metrics::AUTH_REFUSAL_REASONS;

    fn into_response(self) -> Response {
        let (status, code, message) = match &self {
            Refusal::MissingToken => (
                StatusCode::UNAUTHORIZED,
                ErrorCode::Unauthorized,
                "this call needs an operator token: send `Authorization: Bearer <token>` (create one with `idem-server token create`)".to_owned(),
            ),
            Refusal::UnknownToken => (
                StatusCode::UNAUTHORIZED,
                ErrorCode::Unauthorized,
                "the token is not valid".to_owned(),
            ),
            Refusal::Expired => (
                StatusCode::UNAUTHORIZED,
                ErrorCode::Unauthorized,
                "the token has expired".to_owned(),
            ),
            Refusal::Revoked => (
                StatusCode::UNAUTHORIZED,
                ErrorCode::Unauthorized,
                "the token was revoked".to_owned(),
            ),
            Refusal::Forbidden { needs, has, name } => (
                StatusCode::FORBIDDEN,
                ErrorCode::Forbidden,
                format!("this call needs the {needs} role; token `{name}` has {has}"),
            ),
        };
        let mut response = ApiError::new(status, code, message).into_response();
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// The token in `Authorization: Bearer <token>`, if any.
fn bearer(request: &Request) -> Option<&str> {
    let value = request
        .headers()
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// Looks the caller up and checks the route's access; `Ok(None)` for open
/// routes.
async fn authenticate(
    state: &AuthState,
    secret: Option<&str>,
    access: Access,
) -> Result<Option<Actor>, AuthFailure> {
    if state.settings.disabled {
        return Ok(Some(Actor {
            name: "anonymous".to_owned(),
            role: Role::Admin,
        }));
    }
    let needs = match access {
        Access::Open => return Ok(None),
        Access::Needs(role) => role,
    };
    let secret = secret.ok_or(AuthFailure::Refused(Refusal::MissingToken))?;
    let row = store::access::token_by_hash(&state.pool, &hash_token(secret))
        .await
        .map_err(AuthFailure::Store)?
        .ok_or(AuthFailure::Refused(Refusal::UnknownToken))?;
    if row.revoked_at.is_some() {
        return Err(AuthFailure::Refused(Refusal::Revoked));
    }
    if row.expires_at.is_some_and(|at| at <= Utc::now()) {
        return Err(AuthFailure::Refused(Refusal::Expired));
    }
    let Some(role) = Role::parse(&row.role) else {
        return Err(AuthFailure::Refused(Refusal::UnknownToken));
    };
    let actor = Actor {
        name: row.name,
        role,
    };
    if role < needs {
        return Err(AuthFailure::Refused(Refusal::Forbidden {
            needs,
            has: role,
            name: actor.name,
        }));
    }
    Ok(Some(actor))
}

enum AuthFailure {
    Refused(Refusal),
    Store(store::StoreError),
}

/// The middleware: authenticates, authorises by the route table, runs the
/// handler with the [`Actor`] attached, and records mutating calls.
pub async fn authorize(
    State(state): State<AuthState>,
    matched: Option<MatchedPath>,
    mut request: Request,
    next: Next,
) -> Response {
    let Some(route) = matched.map(|m| m.as_str().to_owned()) else {
        // No route matched: the fallback answers 404 for everyone.
        return next.run(request).await;
    };
    let method = request.method().clone();
    let mutating = !matches!(method, Method::GET | Method::HEAD | Method::OPTIONS);
    let path = request.uri().path().to_owned();
    let access = access_for(state.settings, &state.routes, &method, &route);
    // Copied out: a request body is not `Sync`, so no reference to the
    // request may live across an await.
    let secret = bearer(&request).map(str::to_owned);
    let actor = match authenticate(&state, secret.as_deref(), access).await {
        Ok(actor) => actor,
        Err(AuthFailure::Refused(refusal)) => {
            state.metrics.auth_refused(refusal.reason());
            tracing::info!(%method, %route, reason = refusal.reason(), "API call refused");
            // A known caller trying a mutation beyond its role is audited;
            // unauthenticated noise is only counted.
            if let (true, Refusal::Forbidden { has, name, .. }) = (mutating, &refusal) {
                let actor = Actor {
                    name: name.clone(),
                    role: *has,
                };
                let response = refusal.clone().into_response();
                let outcome = Answered::of(&response);
                record(&state, &actor, &method, &route, &path, outcome).await;
                return response;
            }
            return refusal.into_response();
        }
        Err(AuthFailure::Store(e)) => return ApiError::from(e).into_response(),
    };
    if let Some(actor) = &actor {
        request.extensions_mut().insert(actor.clone());
        if mutating {
            request.extensions_mut().insert(Call {
                actor: actor.clone(),
                method: method.clone(),
                route: route.clone(),
                path: path.clone(),
            });
        }
    }
    let response = next.run(request).await;
    let written = response.extensions().get::<AuditWritten>().is_some()
        || response.extensions().get::<DryRun>().is_some();
    if let (true, false, Some(actor)) = (mutating, written, actor) {
        let outcome = Answered::of(&response);
        record(&state, &actor, &method, &route, &path, outcome).await;
    }
    response
}

/// What the audit trail keeps of an answer. Copied out of the response: a
/// response body is not `Sync`, so no reference to it may cross an await.
struct Answered {
    status: u16,
    note: AuditNote,
}

impl Answered {
    fn of(response: &Response) -> Self {
        Self {
            status: response.status().as_u16(),
            note: response
                .extensions()
                .get::<AuditNote>()
                .cloned()
                .unwrap_or_default(),
        }
    }
}

/// Writes one audit record for a mutating call and its answer (calls whose
/// change wrote its own are not recorded here).
async fn record(
    state: &AuthState,
    actor: &Actor,
    method: &Method,
    route: &str,
    path: &str,
    answered: Answered,
) {
    let Answered { status, note } = answered;
    let audit = audit_record(actor, method, route, path, status, note);
    if let Err(e) = store::access::record_audit(&state.pool, &audit).await {
        tracing::error!(error = %e, actor = %actor.name, %method, %path, "could not write the audit trail");
    }
}

fn audit_record(
    actor: &Actor,
    method: &Method,
    route: &str,
    path: &str,
    status: u16,
    note: AuditNote,
) -> AuditRecord {
    AuditRecord {
        actor: actor.name.clone(),
        role: actor.role.as_str().to_owned(),
        method: method.as_str().to_owned(),
        route: route.to_owned(),
        path: path.to_owned(),
        status,
        targets: note.targets,
        generation: note.generation,
        run_id: note.run_id,
        detail: note.detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_are_ordered_and_round_trip_through_their_names() {
        assert!(Role::Viewer < Role::Operator && Role::Operator < Role::Admin);
        for role in Role::ALL {
            assert_eq!(Role::parse(role.as_str()), Some(role));
        }
        assert_eq!(Role::parse("root"), None);
    }

    #[test]
    fn a_token_is_long_random_and_stored_only_as_its_hash() {
        let a = generate_token();
        let b = generate_token();
        assert_ne!(a.secret, b.secret);
        assert!(a.secret.starts_with("idem_") && a.secret.len() == 5 + 64);
        assert_eq!(hash_token(&a.secret), a.hash);
        assert_ne!(a.hash, b.hash);
    }
}
