//! The OpenAPI 3.1 document of the HTTP API: its frame here (the route
//! table, `routes`, adds its paths from the handlers' route attributes and
//! its schemas from the `idem_protocol::api` types); served at
//! `GET /v1/openapi.json` as the route table built it.

use std::sync::Arc;

use axum::{Extension, Json};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::OpenApi as Document;
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "idem",
        description = "Desired state for a fleet of devices: register devices, set what they should run, follow the runs that push it. Every route but /healthz and /readyz needs `Authorization: Bearer <token>`; the role each route needs is in docs/OPERATIONS.md."
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

/// The document's frame: title, description and the token scheme; the
/// route table adds the paths.
pub(super) fn base() -> Document {
    ApiDoc::openapi()
}

/// The document the route table built, which the router carries as an
/// extension for [`openapi_json`].
#[derive(Clone)]
pub(super) struct Served(pub Arc<Document>);

/// `GET /v1/openapi.json`: this API's OpenAPI 3.1 document.
#[utoipa::path(get, path = "/v1/openapi.json", tag = "operations",
    responses((status = 200, content_type = "application/json", description = "OpenAPI 3.1 document")))]
pub(super) async fn openapi_json(Extension(Served(document)): Extension<Served>) -> Json<Document> {
    Json(Document::clone(&document))
}

#[cfg(test)]
mod tests {
    use super::super::routes::document;
    use crate::http::auth::{Access, AuthSettings};

    #[test]
    fn the_document_is_openapi_3_1_and_marks_exactly_the_open_routes_open() {
        let json = serde_json::to_value(document(AuthSettings::default())).unwrap();
        assert!(
            json["openapi"]
                .as_str()
                .is_some_and(|v| v.starts_with("3.1.")),
            "{}",
            json["openapi"]
        );
        let routes = super::super::routes(AuthSettings::default());
        for route in &routes {
            let method = route.method.as_str().to_ascii_lowercase();
            let operation = &json["paths"][&route.path][&method];
            assert!(
                operation.is_object(),
                "{method} {} is described",
                route.path
            );
            let open = operation["security"] == serde_json::json!([]);
            assert_eq!(
                open,
                route.access == Access::Open,
                "{method} {}",
                route.path
            );
            let documented = |status: &str| operation["responses"][status].is_object();
            assert!(
                documented("500") && documented("503"),
                "{method} {}",
                route.path
            );
            if !open {
                assert!(
                    documented("401") && documented("403"),
                    "{method} {}",
                    route.path
                );
            }
        }
        let opened = AuthSettings {
            open_metrics: true,
            ..AuthSettings::default()
        };
        let json = serde_json::to_value(document(opened)).unwrap();
        assert_eq!(
            json["paths"]["/metrics"]["get"]["security"],
            serde_json::json!([])
        );
    }

    #[test]
    fn every_error_code_is_listed_in_the_document() {
        let json = serde_json::to_value(document(AuthSettings::default())).unwrap();
        let listed = &json["components"]["schemas"]["ErrorCode"]["enum"];
        let expected: Vec<&str> = idem_protocol::api::ErrorCode::ALL
            .iter()
            .map(|c| c.as_str())
            .collect();
        assert_eq!(listed, &serde_json::json!(expected));
        assert_eq!(
            json["components"]["schemas"]["ErrorDetail"]["properties"]["code"]["$ref"],
            "#/components/schemas/ErrorCode"
        );
    }

    #[test]
    fn the_vocabulary_enums_are_described_with_their_names() {
        let json = serde_json::to_value(document(AuthSettings::default())).unwrap();
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

    #[test]
    fn the_document_states_the_rules_the_server_enforces_on_bodies() {
        let json = serde_json::to_value(document(AuthSettings::default())).unwrap();
        let text = json.to_string();
        let resolved = |schema: &serde_json::Value| -> serde_json::Value {
            match schema["$ref"].as_str() {
                Some(name) => json["components"]["schemas"]
                    [name.trim_start_matches("#/components/schemas/")]
                .clone(),
                None => schema.clone(),
            }
        };
        assert!(
            text.contains(r#""not":{"required":["max_failures","max_failure_ratio"]}"#),
            "a gate takes at most one failure bound"
        );
        let plan_body = resolved(
            &json["paths"]["/v1/plans"]["post"]["requestBody"]["content"]["application/json"]
                ["schema"],
        );
        assert_eq!(
            plan_body["allOf"][1]["not"],
            serde_json::json!({"required": ["rollout"]}),
            "a plan is made without a rollout: {plan_body}"
        );
        let mut rules = Vec::new();
        let mut open = vec![&json];
        while let Some(value) = open.pop() {
            match value {
                serde_json::Value::Object(map) => {
                    if let Some(rule) = map.get("x-idem-rule").and_then(|r| r.as_str()) {
                        rules.push(rule.to_owned());
                    }
                    open.extend(map.values());
                }
                serde_json::Value::Array(items) => open.extend(items),
                serde_json::Value::Null
                | serde_json::Value::Bool(_)
                | serde_json::Value::Number(_)
                | serde_json::Value::String(_) => {}
            }
        }
        for rule in [
            "wave sizes are cumulative",
            "a repeated id is 400 duplicate_device_id",
            "at most the server's --exemption-max",
        ] {
            assert!(
                rules.iter().any(|stated| stated.contains(rule)),
                "no x-idem-rule says {rule:?}: {rules:?}"
            );
        }
        let registration = resolved(&json["components"]["schemas"]["DeviceRegistration"]);
        let labels = resolved(&registration["properties"]["labels"]);
        assert_eq!(
            labels["propertyNames"]["pattern"],
            idem_protocol::api::bounds::NUL_FREE_PATTERN,
            "{labels}"
        );
        for (path, item) in json["paths"].as_object().unwrap() {
            for (method, operation) in item.as_object().unwrap() {
                if operation["requestBody"].is_object() {
                    assert!(
                        operation["responses"]["413"].is_object(),
                        "{method} {path} takes a body and does not list 413"
                    );
                }
            }
        }
    }
}
