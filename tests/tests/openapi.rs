//! End to end: `GET /v1/openapi.json` serves an OpenAPI 3.1 document that
//! describes every route of the route table (`idem_server::http::routes`).

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use idem_server::http::auth::AuthSettings;
use idem_server::http::routes;
use idem_tests::{Scenario, ServerSettings};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_served_document_is_openapi_3_1_and_describes_every_route() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let (status, document) = scenario.server.get("/v1/openapi.json").await.unwrap();
    assert_eq!(status, 200, "{document}");
    let version = document["openapi"].as_str().unwrap_or_default();
    assert!(version.starts_with("3.1."), "openapi is {version:?}");

    let spec = oas3::from_json(document.to_string()).expect("the document parses as OpenAPI 3.1");
    spec.validate_version()
        .expect("the document's version is one oas3 reads (3.1)");
    let paths = spec.paths.as_ref().expect("the document has paths");
    let table = routes(AuthSettings {
        disabled: false,
        open_metrics: false,
        open_events: false,
    });
    let missing: Vec<String> = table
        .iter()
        .filter(|route| {
            !paths.get(&route.path).is_some_and(|item| {
                item.methods()
                    .into_iter()
                    .any(|(m, _)| m.as_str() == route.method.as_str())
            })
        })
        .map(|route| format!("{} {}", route.method, route.path))
        .collect();
    assert!(
        missing.is_empty(),
        "routes missing from the document: {missing:?}"
    );
}
