//! End to end against real PostgreSQL and a private Mosquitto: runs skip what
//! already matches, push the rest, and record one outcome per device.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use idem_device_sim::{ExpectedOutcome, FleetPlan};
use idem_protocol::event::DeviceOutcomeData;
use idem_protocol::OutcomeKind;
use idem_tests::{outcome_of, DesiredWatcher, Scenario, ServerSettings};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_over_fifty_devices_pushes_only_to_the_four_that_differ() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("dev-", 50)
        .drifted(4)
        .seed(7)
        .build()
        .unwrap();
    let watcher = DesiredWatcher::start(&scenario.broker, &scenario.server.topic_root)
        .await
        .unwrap();
    let fleet = scenario.register_and_start(&plan, 50).await.unwrap();
    // A row's `xmin` changes with every write.
    let row_versions = || async {
        sqlx::query_as::<_, (String, String, String)>(
            "SELECT id, xmin::text, status FROM devices ORDER BY id",
        )
        .fetch_all(scenario.db.pool())
        .await
        .unwrap()
    };
    let drifted: BTreeSet<String> = plan
        .ids_expecting(ExpectedOutcome::Provisioned)
        .iter()
        .map(|d| d.to_string())
        .collect();
    // Reporting its desired state made each of the 46 converged already.
    let converged_rows = || async {
        let rows = row_versions().await;
        rows.into_iter()
            .filter(|(id, _, _)| !drifted.contains(id))
            .collect::<Vec<_>>()
    };
    // The engine records that status within a write interval of the report.
    let deadline = Instant::now() + Duration::from_secs(10);
    let before_first_run = loop {
        let rows = converged_rows().await;
        if rows.iter().all(|(_, _, status)| status == "converged") || Instant::now() > deadline {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        before_first_run.iter().all(|(_, _, status)| status == "converged"),
        "devices reporting their desired state are not converged before any run: {before_first_run:?}"
    );

    // Before the run, a drifted device shows what a push would change, field
    // by field; a converged one shows no change.
    let one_drifted = drifted.iter().next().unwrap().clone();
    let one_converged = before_first_run[0].0.clone();
    let diff_of = |id: String| {
        let server = &scenario.server;
        async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let (_, device) = server.get(&format!("/v1/devices/{id}")).await.unwrap();
                if device["diff"].is_array() || Instant::now() > deadline {
                    return device;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let device = diff_of(one_drifted.clone()).await;
    let changes = device["diff"]
        .as_array()
        .expect("a drifted device has a diff");
    assert!(!changes.is_empty(), "{device}");
    for change in changes {
        assert!(
            change["path"].as_str().is_some_and(|p| !p.is_empty()),
            "{device}"
        );
        assert!(
            matches!(
                change["change"].as_str(),
                Some("added" | "removed" | "changed")
            ),
            "{device}"
        );
    }
    let device = diff_of(one_converged).await;
    assert_eq!(device["diff"], serde_json::json!([]), "{device}");

    let started = Instant::now();
    let (run_id, run) = scenario.run_all(Duration::from_secs(30)).await.unwrap();
    let elapsed = started.elapsed();
    println!(
        "50-device run: trigger to completed in {elapsed:?} (server says {} ms)",
        run["duration_ms"]
    );

    assert_eq!(run["counts"]["already_converged"], 46, "{run}");
    assert_eq!(run["counts"]["provisioned"], 4, "{run}");
    assert_eq!(run["counts"]["failed"], 0, "{run}");
    assert_eq!(
        run["summary"],
        "46 already converged, 4 provisioned, 0 failed"
    );

    let outcomes = scenario.server.run_outcomes(&run_id).await.unwrap();
    assert_eq!(outcomes.len(), 50);
    for (id, expected) in &plan.expected {
        let got = outcome_of(&outcomes[id.as_str()]).unwrap();
        assert_eq!(got, Some(expected.kind()), "device {id}");
    }

    // The fleet's first run rewrote none of the 46 rows either.
    assert_eq!(
        converged_rows().await,
        before_first_run,
        "the first run rewrote converged devices' rows"
    );

    // The broker carried desired-state publishes for exactly the drifted four.
    // Every push of the run has reached the watcher once the run's
    // completed event has (same server connection, sent after them).
    watcher
        .wait_for_run_completed(&run_id, Duration::from_secs(10))
        .await
        .unwrap();
    let pushed: BTreeSet<String> = watcher.seen().keys().cloned().collect();
    let (_, device) = scenario
        .server
        .get(&format!("/v1/devices/{one_drifted}"))
        .await
        .unwrap();
    assert_eq!(
        device["diff"],
        serde_json::json!([]),
        "provisioned: {device}"
    );
    assert_eq!(pushed, drifted);
    assert_eq!(watcher.total(), 4);

    let events = scenario.event_counts(&run_id).await.unwrap();
    assert_eq!(events.get("io.idem.device.already_converged"), Some(&46));
    assert_eq!(events.get("io.idem.device.provisioned"), Some(&4));
    assert_eq!(events.get("io.idem.run.started"), Some(&1));
    assert_eq!(events.get("io.idem.run.completed"), Some(&1));
    assert_eq!(events.values().sum::<i64>(), 52, "{events:?}");

    // The same run again: everything already converged, nothing published,
    // and no device row rewritten.
    let before = row_versions().await;
    let (again_id, again) = scenario.run_all(Duration::from_secs(30)).await.unwrap();
    assert_eq!(
        again["summary"],
        "50 already converged, 0 provisioned, 0 failed"
    );
    assert_eq!(
        row_versions().await,
        before,
        "a converged pass rewrote device rows"
    );
    watcher
        .wait_for_run_completed(&again_id, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(
        watcher.total(),
        4,
        "a converged fleet must not be pushed to"
    );

    let (_, fleet_view) = scenario.server.get("/v1/fleet").await.unwrap();
    assert_eq!(fleet_view["by_status"]["converged"], 50, "{fleet_view}");
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejecting_and_unresponsive_devices_fail_with_reasons_and_the_run_completes() {
    let settings = ServerSettings {
        push_timeout: Duration::from_millis(1500),
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let plan = FleetPlan::new("flaky-", 8)
        .rejecting(1)
        .ignoring_pushes(1)
        .silent(1)
        .reject_message("flash full")
        .seed(3)
        .build()
        .unwrap();
    let fleet = scenario.register_and_start(&plan, 7).await.unwrap();

    let (run_id, run) = scenario.run_all(Duration::from_secs(20)).await.unwrap();
    assert_eq!(
        run["summary"], "5 already converged, 0 provisioned, 3 failed",
        "{run}"
    );
    let outcomes = scenario.server.run_outcomes(&run_id).await.unwrap();
    let reasons: BTreeSet<String> = outcomes
        .values()
        .filter(|o| match outcome_of(o).unwrap() {
            Some(OutcomeKind::Failed) => true,
            Some(
                OutcomeKind::AlreadyConverged
                | OutcomeKind::Provisioned
                | OutcomeKind::Skipped
                | OutcomeKind::Superseded,
            )
            | None => false,
        })
        .map(|o| o["reason"].as_str().unwrap_or_default().to_owned())
        .collect();
    let expected: BTreeSet<String> = [
        "rejected by device: flash full",
        "timeout: device did not confirm the pushed generation in time",
        "timeout: device never reported its state",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(reasons, expected);

    // The rejection's reason is in the device's failed event too.
    let rejecting = plan
        .devices
        .iter()
        .find(|d| {
            d.behaviour.answers_desired() && plan.expected(&d.id) == Some(ExpectedOutcome::Failed)
        })
        .unwrap();
    let event: serde_json::Value = sqlx::query_scalar(
        "SELECT cloudevent FROM events WHERE subject = $1 AND type = 'io.idem.device.failed'",
    )
    .bind(rejecting.id.as_str())
    .fetch_one(scenario.db.pool())
    .await
    .unwrap();
    let data: DeviceOutcomeData = serde_json::from_value(event["data"].clone()).unwrap();
    assert_eq!(
        data.reason.as_deref(),
        Some("rejected by device: flash full")
    );
    assert_eq!(event["runid"], run_id);

    let (_, device) = scenario
        .server
        .get(&format!("/v1/devices/{}", rejecting.id))
        .await
        .unwrap();
    // One attempt allowed (the test default): the device is quarantined.
    assert_eq!(device["status"], "quarantined");
    assert_eq!(device["reported"]["error"]["message"], "flash full");
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setting_desired_state_on_one_device_provisions_it_with_a_new_generation() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("one-", 3).seed(1).build().unwrap();
    let fleet = scenario.register_and_start(&plan, 3).await.unwrap();
    let target = &plan.devices[0].id;

    let (status, answer) = scenario
        .server
        .put(
            &format!("/v1/devices/{target}/desired"),
            &json!({"spec": {"firmware": "9.9.9"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["generation"], 2);
    let run = scenario
        .server
        .wait_run_completed(answer["run_id"].as_str().unwrap(), Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(
        run["summary"],
        "0 already converged, 1 provisioned, 0 failed"
    );
    assert_eq!(
        fleet.state(target).unwrap().spec,
        json!({"firmware": "9.9.9"})
    );
    assert_eq!(fleet.state(target).unwrap().generation, Some(2));

    // The same spec again, with keys in another order: nothing to do.
    let (_, answer) = scenario
        .server
        .put(
            &format!("/v1/devices/{target}/desired"),
            &json!({"spec": { "firmware" : "9.9.9" }}),
        )
        .await
        .unwrap();
    assert_eq!(
        answer["generation"], 2,
        "an unchanged spec keeps its generation"
    );
    let run = scenario
        .server
        .wait_run_completed(answer["run_id"].as_str().unwrap(), Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(
        run["summary"],
        "1 already converged, 0 provisioned, 0 failed"
    );
    fleet.shutdown().await.unwrap();
}
