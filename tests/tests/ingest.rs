//! End to end: the ingest stores only the newest report per device and
//! refuses bad messages with a counted reason, without stopping the others.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use idem_device_sim::FleetPlan;
use idem_protocol::{Channel, DeviceId, Reported};
use idem_tests::{Scenario, ServerSettings};
use rumqttc::{AsyncClient, QoS};
use serde_json::json;

fn report(seq: u64, firmware: &str) -> Vec<u8> {
    Reported {
        seq,
        generation: None,
        spec: json!({"firmware": firmware}),
        health: None,
        error: None,
    }
    .encode()
}

async fn stored_seq(scenario: &Scenario, id: &str) -> Option<i64> {
    sqlx::query_scalar("SELECT reported_seq FROM devices WHERE id = $1")
        .bind(id)
        .fetch_one(scenario.db.pool())
        .await
        .unwrap()
}

async fn stored_firmware(scenario: &Scenario, id: &str) -> Option<String> {
    sqlx::query_scalar("SELECT reported_spec->>'firmware' FROM devices WHERE id = $1")
        .bind(id)
        .fetch_one(scenario.db.pool())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_stale_and_malformed_reports_change_nothing_and_are_counted() {
    let settings = ServerSettings {
        max_spec_bytes: 256,
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let plan = FleetPlan::new("raw-", 3).build().unwrap();
    scenario
        .register(&plan.devices, &plan.desired_spec)
        .await
        .unwrap();
    let root = scenario.server.topic_root.clone();
    let (a, b) = (
        DeviceId::parse("raw-00000").unwrap(),
        DeviceId::parse("raw-00001").unwrap(),
    );

    let (client, mut eventloop) =
        AsyncClient::new(scenario.broker.mqtt_options("raw-publisher"), 100);
    let pump = tokio::spawn(async move { while eventloop.poll().await.is_ok() {} });
    let publish = |topic: String, payload: Vec<u8>| {
        let client = client.clone();
        async move {
            client
                .publish(topic, QoS::AtLeastOnce, false, payload)
                .await
                .unwrap()
        }
    };
    let reported = |id: &DeviceId| root.topic(id, Channel::Reported);

    publish(reported(&a), report(10, "1.0")).await;
    publish(reported(&a), report(10, "1.0-duplicate")).await; // same seq
    publish(reported(&a), report(9, "0.9-stale")).await; // lower seq
    publish(reported(&a), b"{not json".to_vec()).await;
    publish(reported(&a), vec![b' '; 9_000]).await; // over the 2 × 256 + 8 KiB report limit
    publish(format!("{}/bad$id/reported", root.as_str()), report(1, "x")).await;
    publish(
        format!("{}/stranger/reported", root.as_str()),
        report(1, "x"),
    )
    .await; // not registered
    publish(reported(&b), report(5, "2.0")).await; // another device, after all the bad ones

    scenario
        .wait_reports_stored(2, Duration::from_secs(10))
        .await
        .unwrap();
    // Let every message above pass the ingest before reading the counters.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while scenario
        .server
        .metric("idem_reports_total{result=\"rejected\"}")
        .await
        .unwrap()
        < 4.0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "{}",
            scenario.server.metrics().await.unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    assert_eq!(stored_seq(&scenario, a.as_str()).await, Some(10));
    assert_eq!(
        stored_firmware(&scenario, a.as_str()).await.as_deref(),
        Some("1.0")
    );
    assert_eq!(stored_seq(&scenario, b.as_str()).await, Some(5));
    assert_eq!(
        stored_firmware(&scenario, b.as_str()).await.as_deref(),
        Some("2.0")
    );

    let m = |s: &'static str| {
        let server = &scenario.server;
        async move { server.metric(s).await.unwrap() }
    };
    assert_eq!(m("idem_reports_total{result=\"applied\"}").await, 2.0);
    assert_eq!(m("idem_reports_total{result=\"duplicate\"}").await, 1.0);
    assert_eq!(m("idem_reports_total{result=\"stale\"}").await, 1.0);
    assert_eq!(m("idem_reports_total{result=\"rejected\"}").await, 4.0);
    assert_eq!(
        m("idem_reports_rejected_total{reason=\"malformed\"}").await,
        1.0
    );
    assert_eq!(
        m("idem_reports_rejected_total{reason=\"oversized\"}").await,
        1.0
    );
    assert_eq!(
        m("idem_reports_rejected_total{reason=\"invalid_device_id\"}").await,
        1.0
    );
    assert_eq!(
        m("idem_reports_rejected_total{reason=\"unknown_device\"}").await,
        1.0
    );

    // Ingestion goes on after all of that.
    publish(reported(&a), report(11, "1.1")).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while stored_seq(&scenario, a.as_str()).await != Some(11) {
        assert!(
            std::time::Instant::now() < deadline,
            "report 11 never stored"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    pump.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_answers_bad_input_with_clear_json_errors() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let server = &scenario.server;
    let plan = FleetPlan::new("api-", 2).build().unwrap();
    scenario
        .register(&plan.devices, &plan.desired_spec)
        .await
        .unwrap();

    let (status, body) = server
        .put("/v1/devices/bad$id/desired", &json!({"spec": {}}))
        .await
        .unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("invalid_device_id")),
        "{body}"
    );

    let (status, body) = server.post_raw("/v1/desired", "{not json").await.unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("invalid_json")),
        "{body}"
    );

    let (status, body) = server
        .put("/v1/devices/nobody/desired", &json!({"spec": {}}))
        .await
        .unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("unknown_device")),
        "{body}"
    );

    let (status, body) = server
        .post(
            "/v1/desired",
            &json!({"devices": ["api-00000", "ghost"], "spec": {}}),
        )
        .await
        .unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("unknown_device")),
        "{body}"
    );
    assert!(
        body["error"]["message"].as_str().unwrap().contains("ghost"),
        "{body}"
    );

    let (status, body) = server
        .post(
            "/v1/desired",
            &json!({"selector": {"labels": {}}, "spec": {}}),
        )
        .await
        .unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("empty_selector")),
        "{body}"
    );

    let (status, body) = server
        .post("/v1/desired", &json!({"spec": {}}))
        .await
        .unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("invalid_targets")),
        "{body}"
    );

    let (status, body) = server.get("/v1/runs/not-a-uuid").await.unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("invalid_run_id")),
        "{body}"
    );

    let (status, body) = server.get("/v1/devices/api-00000").await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["desired"]["generation"], 1);
    assert_eq!(body["status"], "unknown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_selector_targets_only_matching_devices() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let server = &scenario.server;
    let body = json!([
        {"id": "north-1", "labels": {"site": "north"}, "spec": {"v": 1}},
        {"id": "north-2", "labels": {"site": "north"}, "spec": {"v": 1}},
        {"id": "south-1", "labels": {"site": "south"}, "spec": {"v": 1}},
    ]);
    let (status, counts) = server.post("/v1/devices", &body).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(counts["created"], 3);
    let (_, again) = server.post("/v1/devices", &body).await.unwrap();
    assert_eq!(
        (again["created"].as_u64(), again["unchanged"].as_u64()),
        (Some(0), Some(3)),
        "{again}"
    );

    let (status, answer) = server
        .post(
            "/v1/desired",
            &json!({"selector": {"labels": {"site": "north"}}, "spec": {"v": 2}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["targets"], 2);
    let (_, south) = server.get("/v1/devices/south-1").await.unwrap();
    assert_eq!(south["desired"]["spec"], json!({"v": 1}));
    let (_, north) = server.get("/v1/devices/north-2").await.unwrap();
    assert_eq!(north["desired"]["spec"], json!({"v": 2}));
    assert_eq!(north["desired"]["generation"], 2);
}
