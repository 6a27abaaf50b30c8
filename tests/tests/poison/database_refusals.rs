//! A database that refuses one report of a batch, and one that blocks the
//! ingest's writes until `/readyz` says so.

use std::time::{Duration, Instant};

use idem_protocol::DeviceId;
use idem_tests::{Scenario, ServerSettings};
use serde_json::json;

use crate::{
    assert_the_fleet_is_still_served, converged_fleet, metric, now_micros, reported, stored_seq,
    wait_metric, Injector,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_the_database_refuses_is_isolated_and_the_rest_of_its_batch_is_stored() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let (_, fleet) = converged_fleet(&scenario, "iso-", 20).await;
    // A rule the server does not know about: the database refuses any
    // reported spec with a `poison` key (as it would refuse data we failed
    // to foresee).
    sqlx::query(
        "ALTER TABLE devices ADD CONSTRAINT no_poison CHECK (reported_spec->>'poison' IS NULL)",
    )
    .execute(scenario.db.pool())
    .await
    .unwrap();
    let mut injector = Injector::start(&scenario.broker).await;
    // Newer than every device's own reports (their seq is the clock in µs).
    let seq = now_micros() + 10_000_000;
    // While another client holds the table, the burst queues up in the
    // ingest, so the poison shares a batch with good reports.
    let mut blocker = scenario.db.pool().begin().await.unwrap();
    sqlx::query("LOCK TABLE devices IN EXCLUSIVE MODE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    for i in 0..20 {
        let id = format!("iso-{i:05}");
        let payload = if i == 7 {
            json!({"seq": seq, "spec": {"poison": true}})
        } else {
            json!({"seq": seq, "spec": {"fw": "burst"}})
        };
        injector
            .publish(
                reported(&scenario.server, &id),
                false,
                payload.to_string().into_bytes(),
            )
            .await;
    }
    blocker.rollback().await.unwrap();
    wait_metric(
        &scenario.server,
        "idem_reports_rejected_total{reason=\"db_refused\"}",
        1.0,
    )
    .await;
    assert!(metric(&scenario.server, "idem_ingest_batch_splits_total").await >= 1.0);
    // The refused report is found (and counted) before the slices after it
    // in the batch are written: wait for those.
    let count_stored = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM devices WHERE reported_seq = $1")
            .bind(seq as i64)
            .fetch_one(scenario.db.pool())
            .await
            .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut stored = count_stored().await;
    while stored < 19 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        stored = count_stored().await;
    }
    assert_eq!(stored, 19, "every report but the refused one is stored");
    assert_eq!(
        stored_seq(scenario.db.pool(), "iso-00007")
            .await
            .map(|s| (s as u64) < seq),
        Some(true)
    );
    let (status, ready) = scenario.server.get("/readyz").await.unwrap();
    assert_eq!(status, 200, "{ready}");
    drop(fleet);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingest_that_cannot_commit_makes_readyz_fail_and_recovers() {
    let scenario = Scenario::start(ServerSettings {
        stuck_after: Duration::from_millis(500),
        ..ServerSettings::default()
    })
    .await
    .unwrap();
    let (_, fleet) = converged_fleet(&scenario, "stuck-", 5).await;
    // Another client holds the devices table: every ingest write waits.
    let mut blocker = scenario.db.pool().begin().await.unwrap();
    sqlx::query("LOCK TABLE devices IN EXCLUSIVE MODE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    fleet
        .request_report(&DeviceId::parse("stuck-00000").unwrap())
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let body = loop {
        let (status, body) = scenario.server.get("/readyz").await.unwrap();
        if status == 503 && body["stuck"]["ingest"].is_string() {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "readyz never reported the stuck ingest: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(body["ready"], false, "{body}");
    blocker.rollback().await.unwrap();
    assert_the_fleet_is_still_served(&scenario.server, scenario.db.pool(), &fleet).await;
}
