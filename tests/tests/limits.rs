//! End to end: every bound on operator input is enforced with a 4xx whose
//! message names the limit, before anything reaches the database.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use idem_tests::{Scenario, ServerSettings};
use serde_json::{json, Map, Value};

fn labels(n: usize) -> Value {
    Value::Object(
        (0..n)
            .map(|i| (format!("k{i}"), json!("v")))
            .collect::<Map<_, _>>(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_limit_answers_4xx_naming_the_limit() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let server = &scenario.server;
    let (status, body) = server
        .post("/v1/devices", &json!([{"id": "lim-1"}, {"id": "lim-2"}]))
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");

    let many_devices: Vec<Value> = (0..10_001)
        .map(|i| json!({"id": format!("lim-many-{i}")}))
        .collect();
    let many_ids: Vec<String> = (0..100_001).map(|i| format!("lim-{i}")).collect();
    let long_after = "a".repeat(300);
    // (what, answer, expected status, code, text the message must hold)
    type Case<'a> = (&'a str, (u16, Value), u16, &'a str, &'a str);
    let cases: Vec<Case> = vec![
        (
            "registrations per request",
            server
                .post("/v1/devices", &Value::Array(many_devices))
                .await
                .unwrap(),
            413,
            "too_many_items",
            "at most 10000",
        ),
        (
            "ids per targeting request",
            server
                .post("/v1/runs", &json!({"devices": many_ids}))
                .await
                .unwrap(),
            413,
            "too_many_items",
            "at most 100000",
        ),
        (
            "selector labels",
            server
                .post("/v1/runs", &json!({"selector": {"labels": labels(65)}}))
                .await
                .unwrap(),
            413,
            "too_many_items",
            "at most 64",
        ),
        (
            "labels per device",
            server
                .put("/v1/devices/lim-1", &json!({"labels": labels(65)}))
                .await
                .unwrap(),
            400,
            "invalid_labels",
            "at most 64 labels",
        ),
        (
            "label key length",
            server
                .put(
                    "/v1/devices/lim-1",
                    &json!({"labels": {"k".repeat(129): "v"}}),
                )
                .await
                .unwrap(),
            400,
            "invalid_labels",
            "the limit is 128",
        ),
        (
            "label value length",
            server
                .put(
                    "/v1/devices/lim-1",
                    &json!({"labels": {"k": "v".repeat(257)}}),
                )
                .await
                .unwrap(),
            400,
            "invalid_labels",
            "the limit is 256",
        ),
        (
            "spec budget",
            server
                .put(
                    "/v1/devices/lim-1/desired",
                    &json!({"spec": {"x": "y".repeat(70_000)}}),
                )
                .await
                .unwrap(),
            413,
            "spec_too_large",
            "the limit is 65536 bytes",
        ),
        (
            "page size",
            server.get("/v1/devices?limit=1001").await.unwrap(),
            400,
            "invalid_limit",
            "1..=1000",
        ),
        (
            "query text length",
            server
                .get(&format!("/v1/devices?after={long_after}"))
                .await
                .unwrap(),
            400,
            "invalid_query",
            "the limit is 256",
        ),
        (
            "event filter text",
            server.get("/v1/events?type=a%00b").await.unwrap(),
            400,
            "invalid_query",
            "NUL",
        ),
    ];
    for (what, (status, body), want_status, code, names) in cases {
        assert_eq!(status, want_status, "{what}: {body}");
        assert_eq!(body["error"]["code"], code, "{what}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(names),
            "{what}: {message:?} does not name {names:?}"
        );
    }
    // Nothing of the refused requests was written.
    let devices: i64 = sqlx::query_scalar("SELECT count(*) FROM devices")
        .fetch_one(scenario.db.pool())
        .await
        .unwrap();
    assert_eq!(devices, 2);
    let (_, device) = server.get("/v1/devices/lim-1").await.unwrap();
    assert_eq!(device["labels"], json!({}), "{device}");
    assert_eq!(device["desired"], Value::Null, "{device}");
}
