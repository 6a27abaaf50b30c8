//! End to end: a database that holds the ingest's writes for longer than the
//! MQTT keepalive never costs the server its broker session. The event loop
//! keeps reading into the intake queue (within its byte budget), so pings
//! are answered, nothing waits at the broker for an absent session, and
//! `/readyz` says how far behind the intake is until it caught up.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use idem_tests::{Scenario, ServerSettings};
use rumqttc::{AsyncClient, QoS};
use serde_json::json;

const DEVICES: usize = 1_000;
/// Reports per device sent while the writes are held: 20,000 messages,
/// more than any fixed hand-off between event loop and ingest would hold.
const REPORTS_EACH: usize = 20;
const KEEP_ALIVE: Duration = Duration::from_secs(2);
/// Device writes are held this long: several keepalives.
const HOLD: Duration = Duration::from_secs(8);

fn now_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_longer_than_the_keepalive_keeps_the_session_and_every_last_report_is_stored() {
    let settings = ServerSettings {
        mqtt_keep_alive: KEEP_ALIVE,
        ready_max_intake_age: Duration::from_secs(2),
        // No periodic work that would write devices during the hold.
        resync_interval: Duration::ZERO,
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let server = &scenario.server;
    let ids: Vec<String> = (0..DEVICES).map(|i| format!("backlog-{i:04}")).collect();
    let body: Vec<_> = ids.iter().map(|id| json!({"id": id})).collect();
    let (status, answer) = server.post("/v1/devices", &json!(body)).await.unwrap();
    assert_eq!(status, 200, "{answer}");

    // Hold every device write: the ingest's first batch blocks on the lock.
    let mut hold = scenario.db.pool().begin().await.unwrap();
    sqlx::query("LOCK TABLE devices IN EXCLUSIVE MODE")
        .execute(&mut *hold)
        .await
        .unwrap();
    let held_at = Instant::now();

    let mut options = scenario.broker.mqtt_options("backlog-publisher");
    options.set_inflight(1_000);
    let (publisher, mut eventloop) = AsyncClient::new(options, 1_000);
    let pump = tokio::spawn(async move { while eventloop.poll().await.is_ok() {} });
    let base = now_micros();
    let root = server.topic_root.as_str().to_owned();
    for round in 0..REPORTS_EACH {
        for id in &ids {
            let report = json!({"seq": base + round as u64, "spec": {"round": round}});
            publisher
                .publish(
                    format!("{root}/{id}/reported"),
                    QoS::AtLeastOnce,
                    false,
                    report.to_string(),
                )
                .await
                .unwrap();
        }
    }
    // While held: behind, and saying so.
    tokio::time::sleep(Duration::from_secs(4).saturating_sub(held_at.elapsed())).await;
    let (status, readiness) = server.get("/readyz").await.unwrap();
    assert_eq!(status, 503, "{readiness}");
    let intake = readiness["stuck"]["intake"].as_str().unwrap_or_default();
    assert!(intake.contains("wait for the ingest"), "{readiness}");
    tokio::time::sleep(HOLD.saturating_sub(held_at.elapsed())).await;
    hold.rollback().await.unwrap();

    let last_seq = (base + REPORTS_EACH as u64 - 1) as i64;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stored: i64 =
            sqlx::query_scalar("SELECT count(*) FROM devices WHERE reported_seq = $1")
                .bind(last_seq)
                .fetch_one(scenario.db.pool())
                .await
                .unwrap();
        if stored == DEVICES as i64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{stored} of {DEVICES} devices have their last report 30 s after the writes resumed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let reconnects = server.metric("idem_mqtt_reconnects_total").await.unwrap();
    assert_eq!(
        reconnects, 0.0,
        "the server lost its MQTT connection during a {HOLD:?} backlog (keepalive {KEEP_ALIVE:?})"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.get("/readyz").await.unwrap().0 != 200 {
        assert!(
            Instant::now() < deadline,
            "not ready again after the backlog"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    pump.abort();
}
