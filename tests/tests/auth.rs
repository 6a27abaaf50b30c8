//! End to end: operator tokens and roles on every route of the API, revoked
//! and expired tokens, the `token` command line, and the audit trail.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use idem_protocol::event::RunStartedData;
use idem_server::http::auth::{Access, AuthSettings, Role};
use idem_server::http::routes;
use idem_tests::{ApiClient, Scenario, ServerSettings};
use serde_json::{json, Value};

/// The real server command line, built by this package.
const SERVER_BIN: &str = env!("CARGO_BIN_EXE_idem-server-under-test");

/// Who calls: no token, a made-up one, a revoked one, or one per role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Caller {
    Nobody,
    MadeUp,
    Revoked,
    Expired,
    With(Role),
}

impl Caller {
    fn label(self) -> String {
        match self {
            Caller::Nobody => "nobody".into(),
            Caller::MadeUp => "made-up".into(),
            Caller::Revoked => "revoked".into(),
            Caller::Expired => "expired".into(),
            Caller::With(role) => role.as_str().into(),
        }
    }
}

/// The status of one call, without reading the body (an event stream
/// never ends).
async fn status_of(client: &ApiClient, method: &str, path: &str, body: Option<Value>) -> u16 {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut request = client.request(method, path);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = tokio::time::timeout(Duration::from_secs(10), request.send())
        .await
        .unwrap_or_else(|_| panic!("{path}: no answer within 10 s"))
        .unwrap();
    response.status().as_u16()
}

/// A concrete path and body for a route, unique per caller where the call
/// would change something another caller relies on.
fn request_for(route: &str, method: &str, caller: &str, run_id: &str) -> (String, Option<Value>) {
    let device = match (method, route) {
        ("DELETE", "/v1/devices/{id}") => format!("auth-victim-{caller}"),
        _ => "auth-1".to_owned(),
    };
    let path = route
        .replace(
            "{id}",
            if route.starts_with("/v1/runs") {
                run_id
            } else {
                &device
            },
        )
        .replace("{name}", &format!("no-such-token-{caller}"));
    let body = match (method, route) {
        ("POST", "/v1/devices") => Some(json!([{"id": format!("auth-new-{caller}")}])),
        ("PUT", "/v1/devices/{id}") => Some(json!({"labels": {"touched-by": caller}})),
        ("PUT", "/v1/devices/{id}/desired") => Some(json!({"spec": {"fw": caller}})),
        ("POST", "/v1/desired") => Some(json!({"devices": ["auth-2"], "spec": {"fw": caller}})),
        ("POST", "/v1/runs") => Some(json!({"devices": ["auth-2"]})),
        ("POST", "/v1/tokens") => {
            Some(json!({"name": format!("made-by-{caller}"), "role": "viewer"}))
        }
        ("POST", _) | ("PUT", _) => Some(json!({})),
        _ => None,
    };
    (path, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_answers_each_caller_as_the_route_table_says() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let server = &scenario.server;
    let mut ids: Vec<Value> = ["auth-1", "auth-2"]
        .iter()
        .map(|id| json!({"id": id}))
        .collect();
    let callers = [
        Caller::Nobody,
        Caller::MadeUp,
        Caller::Revoked,
        Caller::Expired,
        Caller::With(Role::Viewer),
        Caller::With(Role::Operator),
        Caller::With(Role::Admin),
    ];
    for caller in callers {
        ids.push(json!({"id": format!("auth-victim-{}", caller.label())}));
    }
    let (status, body) = server
        .post("/v1/devices", &Value::Array(ids))
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let run_id = server
        .start_run(&json!({"devices": ["auth-1"]}))
        .await
        .unwrap();

    let revoked = server
        .client_for_role("soon-revoked", "operator")
        .await
        .unwrap();
    let (status, body) = server.delete("/v1/tokens/soon-revoked").await.unwrap();
    assert_eq!(status, 200, "{body}");
    let expired_secret = idem_tests::server::create_token(scenario.db.pool(), "expired", "admin")
        .await
        .unwrap();
    sqlx::query(
        "UPDATE api_tokens SET expires_at = now() - interval '1 minute' WHERE name = 'expired'",
    )
    .execute(scenario.db.pool())
    .await
    .unwrap();
    let mut clients = Vec::new();
    for caller in callers {
        let client = match caller {
            Caller::Nobody => server.client_with(None),
            Caller::MadeUp => server.client_with(Some("idem_0123456789abcdef")),
            Caller::Revoked => revoked.clone(),
            Caller::Expired => server.client_with(Some(&expired_secret)),
            Caller::With(role) => server
                .client_for_role(&format!("matrix-{}", role.as_str()), role.as_str())
                .await
                .unwrap(),
        };
        clients.push((caller, client));
    }

    let mut wrong = Vec::new();
    let mut checked = 0;
    let table = routes(AuthSettings::default());
    for route_entry in &table {
        let (method, route, access) = (
            route_entry.method.as_str(),
            route_entry.path.as_str(),
            &route_entry.access,
        );
        for (caller, client) in &clients {
            let (path, body) = request_for(route, method, &caller.label(), &run_id);
            let status = status_of(client, method, &path, body).await;
            let allowed = match (access, caller) {
                (Access::Open, _) => true,
                (Access::Needs(needs), Caller::With(role)) => role >= needs,
                (
                    Access::Needs(_),
                    Caller::Nobody | Caller::MadeUp | Caller::Revoked | Caller::Expired,
                ) => false,
            };
            let expected_refusal = match caller {
                Caller::With(_) => 403,
                Caller::Nobody | Caller::MadeUp | Caller::Revoked | Caller::Expired => 401,
            };
            let fine = if allowed {
                status != 401 && status != 403
            } else {
                status == expected_refusal
            };
            if !fine {
                wrong.push(format!(
                    "{method} {path} as {}: {status} (allowed: {allowed})",
                    caller.label()
                ));
            }
            checked += 1;
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {checked} calls answered wrongly:\n  {}",
        wrong.len(),
        wrong.join("\n  ")
    );

    // The refusals are JSON, with 401 and 403 told apart.
    let (status, body) = server.client_with(None).get("/v1/fleet").await.unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (401, Some("unauthorized")),
        "{body}"
    );
    let viewer = &clients
        .iter()
        .find(|(c, _)| *c == Caller::With(Role::Viewer))
        .unwrap()
        .1;
    let (status, body) = viewer
        .put("/v1/devices/auth-1/desired", &json!({"spec": {}}))
        .await
        .unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (403, Some("forbidden")),
        "{body}"
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("needs the operator role"),
        "{body}"
    );
    // A refused mutation changed nothing.
    let (_, device) = server
        .get("/v1/devices/auth-victim-operator")
        .await
        .unwrap();
    assert_eq!(
        device["id"], "auth-victim-operator",
        "an operator could delete a device"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_token_is_refused_at_once_and_without_a_token_nothing_but_health_answers() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let server = &scenario.server;
    let operator = server.client_for_role("ops", "operator").await.unwrap();
    let (status, _) = operator.get("/v1/fleet").await.unwrap();
    assert_eq!(status, 200);
    let (status, body) = server.delete("/v1/tokens/ops").await.unwrap();
    assert_eq!(status, 200, "{body}");
    let (status, body) = operator.get("/v1/fleet").await.unwrap();
    assert_eq!(status, 401, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("revoked"),
        "{body}"
    );

    let anonymous = server.client_with(None);
    for path in ["/healthz", "/readyz"] {
        let (status, _) = anonymous.get(path).await.unwrap();
        assert_eq!(status, 200, "{path}");
    }
    for path in [
        "/metrics",
        "/v1/fleet",
        "/v1/devices",
        "/v1/runs",
        "/v1/tokens",
    ] {
        let status = status_of(&anonymous, "GET", path, None).await;
        assert_eq!(status, 401, "{path}");
    }
    let status = status_of(&anonymous, "GET", "/v1/events", None).await;
    assert_eq!(status, 401, "/v1/events");
    let (status, _) = anonymous
        .post("/v1/desired", &json!({"all": true, "spec": {"fw": "evil"}}))
        .await
        .unwrap();
    assert_eq!(status, 401, "an anonymous desired change");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_events_open_only_with_their_flags() {
    let scenario = Scenario::start(ServerSettings {
        open_metrics: true,
        open_events: true,
        ..ServerSettings::default()
    })
    .await
    .unwrap();
    let anonymous = scenario.server.client_with(None);
    assert_eq!(status_of(&anonymous, "GET", "/metrics", None).await, 200);
    assert_eq!(status_of(&anonymous, "GET", "/v1/events", None).await, 200);
    assert_eq!(status_of(&anonymous, "GET", "/v1/fleet", None).await, 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_command_line_creates_lists_and_revokes_tokens() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let cli = |args: &[&str]| {
        let output = Command::new(SERVER_BIN)
            .args(args)
            .env("IDEM_DATABASE_URL", scenario.db.url())
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "idem-server {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap()
    };
    let secret = cli(&[
        "token",
        "create",
        "--name",
        "ci",
        "--role",
        "operator",
        "--expires-in",
        "1d",
    ]);
    let secret = secret.trim();
    assert!(secret.starts_with("idem_"), "{secret}");
    let ci = scenario.server.client_with(Some(secret));
    let (status, body) = ci.post("/v1/runs", &json!({"all": true})).await.unwrap();
    // No device yet: the call is authorised and answered on its merits.
    assert_eq!(status, 404, "{body}");
    let listed = cli(&["token", "list"]);
    assert!(
        listed.contains("ci") && listed.contains("operator"),
        "{listed}"
    );
    assert!(
        !listed.contains(secret),
        "token list must not print secrets"
    );
    cli(&["token", "revoke", "ci"]);
    let (status, _) = ci.get("/v1/fleet").await.unwrap();
    assert_eq!(status, 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_desired_change_is_audited_with_its_token_and_the_run_names_who_started_it() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let server = &scenario.server;
    let (status, body) = server
        .post(
            "/v1/devices",
            &json!([{"id": "audit-1", "spec": {"fw": "1"}}]),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let ci = server.client_for_role("ci", "operator").await.unwrap();
    let (status, answer) = ci
        .put("/v1/devices/audit-1/desired", &json!({"spec": {"fw": "2"}}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let run_id = answer["run_id"].as_str().unwrap();
    let (status, forbidden) = server
        .client_for_role("watcher", "viewer")
        .await
        .unwrap()
        .post("/v1/runs", &json!({"all": true}))
        .await
        .unwrap();
    assert_eq!(status, 403, "{forbidden}");

    let (_, run) = server.get(&format!("/v1/runs/{run_id}")).await.unwrap();
    assert_eq!(run["started_by"], "ci", "{run}");
    let started: Value = sqlx::query_scalar(
        "SELECT cloudevent FROM events WHERE type = 'io.idem.run.started' AND run_id = $1",
    )
    .bind(uuid::Uuid::parse_str(run_id).unwrap())
    .fetch_one(scenario.db.pool())
    .await
    .unwrap();
    let data: RunStartedData = serde_json::from_value(started["data"].clone()).unwrap();
    assert_eq!(data.started_by.as_deref(), Some("ci"), "{started}");

    let (status, audit) = server.get("/v1/audit?actor=ci").await.unwrap();
    assert_eq!(status, 200, "{audit}");
    let entries = audit["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "{audit}");
    let entry = &entries[0];
    assert_eq!(entry["method"], "PUT");
    assert_eq!(entry["route"], "/v1/devices/{id}/desired");
    assert_eq!(entry["path"], "/v1/devices/audit-1/desired");
    assert_eq!(entry["status"], 200);
    assert_eq!(entry["role"], "operator");
    assert_eq!(entry["targets"], 1);
    assert_eq!(entry["generation"], 2);
    assert_eq!(entry["run_id"], run_id);
    // The refused call is in the trail too, with its 403.
    let (_, audit) = server.get("/v1/audit?actor=watcher").await.unwrap();
    assert_eq!(audit["entries"][0]["status"], 403, "{audit}");
    // Reading is not audited; token management is.
    let (_, audit) = server.get("/v1/audit").await.unwrap();
    let routes: Vec<&str> = audit["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["route"].as_str().unwrap())
        .collect();
    assert!(routes.contains(&"/v1/tokens"), "{routes:?}");
    assert!(!routes.contains(&"/v1/runs/{id}"), "{routes:?}");
}
