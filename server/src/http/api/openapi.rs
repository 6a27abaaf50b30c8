//! The OpenAPI 3.1 document of the HTTP API, generated from the handlers'
//! route attributes and the `idem_protocol::api` types, served at
//! `GET /v1/openapi.json`. Every route of `crate::http::auth::ROUTES` is in it
//! (checked by the end-to-end test `openapi`).

use axum::Json;
use idem_protocol::api::ErrorBody;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::OpenApi as Document;
use utoipa::{Modify, OpenApi};

use super::{audit, credentials, desired, devices, fleet, ops, runs, tokens};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "idem",
        description = "Desired state for a fleet of devices: register devices, set what they should run, follow the runs that push it. Every route but /healthz and /readyz needs `Authorization: Bearer <token>`; the role each route needs is in docs/OPERATIONS.md."
    ),
    paths(
        ops::healthz,
        ops::readyz,
        ops::metrics,
        events,
        fleet::fleet_summary,
        devices::list_devices,
        devices::register_devices,
        devices::get_device,
        devices::upsert_device,
        devices::delete_device,
        devices::reset_reported,
        desired::set_device_desired,
        runs::retry_device,
        credentials::rotate,
        desired::set_desired_bulk,
        runs::list_runs,
        runs::start_manual_run,
        runs::get_run,
        runs::run_outcomes,
        runs::retry_run,
        tokens::list_tokens,
        tokens::create_token,
        tokens::revoke_token,
        audit::list_audit,
        openapi_json,
    ),
    modifiers(&BearerToken),
    security(("bearer" = []))
)]
struct ApiDoc;

/// Declares the operator token scheme the routes refer to.
struct BearerToken;

impl Modify for BearerToken {
    fn modify(&self, openapi: &mut Document) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
        );
    }
}

/// `GET /v1/events` is served by `crate::http::sse::events` (a stream, not JSON);
/// this describes it.
#[utoipa::path(get, path = "/v1/events", tag = "events",
    params(
        ("type" = Option<String>, Query, description = "only events of this type"),
        ("device" = Option<String>, Query, description = "only events about this device"),
        ("run" = Option<uuid::Uuid>, Query, description = "only events of this run"),
        ("after" = Option<i64>, Query, description = "start after this sequence (as Last-Event-ID does)"),
    ),
    responses((status = 200, content_type = "text/event-stream", body = String, description = "CloudEvents, one per SSE event"),
        (status = "4XX", body = ErrorBody), (status = 503, body = ErrorBody)))]
#[allow(dead_code)]
fn events() {}

/// The document, as served.
pub fn document() -> Document {
    ApiDoc::openapi()
}

/// `GET /v1/openapi.json`: this API's OpenAPI 3.1 document.
#[utoipa::path(get, path = "/v1/openapi.json", tag = "operations",
    responses((status = 200, content_type = "application/json", description = "OpenAPI 3.1 document")))]
pub(super) async fn openapi_json() -> Json<Document> {
    Json(document())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::auth::ROUTES;

    #[test]
    fn the_document_is_openapi_3_1_and_holds_every_route_of_the_table() {
        let document = document();
        let json = serde_json::to_value(&document).unwrap();
        assert!(
            json["openapi"]
                .as_str()
                .is_some_and(|v| v.starts_with("3.1.")),
            "{}",
            json["openapi"]
        );
        let missing: Vec<String> = ROUTES
            .iter()
            .filter(|(method, route, _)| {
                let Some(item) = document.paths.paths.get(*route) else {
                    return true;
                };
                let operation = match *method {
                    "GET" => &item.get,
                    "POST" => &item.post,
                    "PUT" => &item.put,
                    "DELETE" => &item.delete,
                    _ => return true,
                };
                operation.is_none()
            })
            .map(|(method, route, _)| format!("{method} {route}"))
            .collect();
        assert!(
            missing.is_empty(),
            "routes missing from the document: {missing:?}"
        );
    }

    #[test]
    fn the_vocabulary_enums_are_described_with_their_names() {
        let json = serde_json::to_value(document()).unwrap();
        let schemas = &json["components"]["schemas"];
        let names = |schema: &str| -> Vec<String> {
            let values = schemas[schema]["enum"].as_array();
            values
                .unwrap_or_else(|| panic!("{schema} is an enum: {}", schemas[schema]))
                .iter()
                .map(|v| v.as_str().unwrap().to_owned())
                .collect()
        };
        let words = |all: Vec<&str>| -> Vec<String> { all.into_iter().map(String::from).collect() };
        use idem_protocol::{DeviceStatus, Health, OutcomeKind, RunState, Trigger};
        assert_eq!(
            names("DeviceStatus"),
            words(DeviceStatus::ALL.map(DeviceStatus::as_str).to_vec())
        );
        assert_eq!(
            names("Health"),
            words(Health::ALL.map(Health::as_str).to_vec())
        );
        assert_eq!(
            names("OutcomeKind"),
            words(OutcomeKind::ALL.map(OutcomeKind::as_str).to_vec())
        );
        assert_eq!(
            names("RunState"),
            words(RunState::ALL.map(RunState::as_str).to_vec())
        );
        assert_eq!(
            names("Trigger"),
            words(Trigger::ALL.map(Trigger::as_str).to_vec())
        );
        assert_eq!(
            schemas["DeviceView"]["properties"]["status"]["$ref"],
            "#/components/schemas/DeviceStatus"
        );
        assert_eq!(
            schemas["RunView"]["properties"]["state"]["$ref"],
            "#/components/schemas/RunState"
        );
        assert_eq!(
            schemas["Generation"]["type"], "integer",
            "{}",
            schemas["Generation"]
        );
    }
}
