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
    let table = routes(AuthSettings::default());
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rejection_answers_the_json_error_shape_with_a_code_the_document_lists() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let server = &scenario.server;
    let (_, document) = server.get("/v1/openapi.json").await.unwrap();
    let listed: Vec<&str> = document["components"]["schemas"]["ErrorCode"]["enum"]
        .as_array()
        .expect("the document lists the error codes")
        .iter()
        .map(|code| code.as_str().unwrap())
        .collect();
    use reqwest::Method;
    let cases: [(Method, &str, Option<&str>, u16, &str); 8] = [
        (
            Method::GET,
            "/v1/runs?limit=99999999999999999999",
            None,
            400,
            "invalid_query",
        ),
        (
            Method::GET,
            "/v1/devices?limit=many",
            None,
            400,
            "invalid_query",
        ),
        (
            Method::GET,
            "/v1/runs?before=yesterday",
            None,
            400,
            "invalid_query",
        ),
        (Method::GET, "/v1/devices/%FF%FE", None, 400, "invalid_path"),
        (
            Method::PATCH,
            "/v1/devices",
            None,
            405,
            "method_not_allowed",
        ),
        (
            Method::PUT,
            "/v1/devices/json-1",
            Some(r#"[{"site": "x"}]"#),
            422,
            "invalid_body",
        ),
        (
            Method::POST,
            "/v1/runs",
            Some(r#"{"all": tru"#),
            400,
            "invalid_json",
        ),
        (Method::GET, "/v1/no-such-route", None, 404, "not_found"),
    ];
    for (method, path, body, status, code) in cases {
        let mut request = server.request(method.clone(), path);
        if let Some(body) = body {
            request = request
                .header("content-type", "application/json")
                .body(body);
        }
        let response = request.send().await.unwrap();
        let headers = response.headers().clone();
        let got = response.status().as_u16();
        let text = response.text().await.unwrap();
        let what = format!("{method} {path}: {got} {headers:?} {text}");
        assert_eq!(got, status, "{what}");
        assert_eq!(
            headers.get("content-type").and_then(|v| v.to_str().ok()),
            Some("application/json"),
            "{what}"
        );
        let answer: serde_json::Value = serde_json::from_str(&text).expect(&what);
        assert_eq!(answer["error"]["code"], code, "{what}");
        assert!(
            answer["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{what}"
        );
        assert!(listed.contains(&code), "{code} is listed in the document");
        if status == 405 {
            assert!(headers.get("allow").is_some(), "{what}");
        }
    }
}
