//! End to end: idem keeps converging when devices misbehave — retries with
//! backoff, quarantine and operator retry, drift remediation, offline devices,
//! superseded pushes, push pacing and recorded health.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use idem_device_sim::{drifted_spec, DeviceBehaviour, Fleet, FleetPlan, OfflineMode, SimDevice};
use idem_protocol::event::DeviceOutcomeData;
use idem_protocol::{DeviceId, Health, OutcomeKind};
use idem_tests::{DesiredWatcher, Scenario, ServerSettings};
use serde_json::{json, Value};

fn retrying() -> ServerSettings {
    ServerSettings {
        max_attempts: 3,
        retry_backoff: Duration::from_millis(100),
        ..ServerSettings::default()
    }
}

/// Events about one device: type → count.
async fn device_events(scenario: &Scenario, device: &str) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT type, count(*) FROM event_log WHERE subject = $1 GROUP BY type")
            .bind(device)
            .fetch_all(scenario.db.pool())
            .await
            .unwrap();
    rows.into_iter().collect()
}

async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Completed runs with this trigger, newest first.
async fn runs_with_trigger(scenario: &Scenario, trigger: &str) -> Vec<Value> {
    let (_, body) = scenario.server.get("/v1/runs?limit=100").await.unwrap();
    body["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["trigger"] == trigger && r["state"] == "completed")
        .cloned()
        .collect()
}

/// A scenario with one drifted device that rejects its first `rejections`
/// pushes with `message`, registered, connected and reported.
async fn one_device_rejecting(
    prefix: &str,
    rejections: u32,
    message: &str,
) -> (Scenario, Fleet, DeviceId) {
    let scenario = Scenario::start(retrying()).await.unwrap();
    let plan = FleetPlan::new(prefix, 1).build().unwrap();
    let id = plan.devices[0].id.clone();
    let device = SimDevice::new(id.clone(), drifted_spec(&plan.desired_spec))
        .with_generation(Some(1))
        .with_behaviour(DeviceBehaviour::RejectTimes {
            times: rejections,
            message: message.into(),
        });
    scenario
        .register(std::slice::from_ref(&device), &plan.desired_spec)
        .await
        .unwrap();
    let fleet = scenario.start_fleet(vec![device]).await.unwrap();
    scenario
        .wait_reports_stored(1, Duration::from_secs(10))
        .await
        .unwrap();
    (scenario, fleet, id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_that_rejects_twice_is_provisioned_on_the_third_attempt() {
    let (scenario, fleet, id) = one_device_rejecting("flaky-", 2, "busy").await;

    let (run_id, run) = scenario.run_all(Duration::from_secs(20)).await.unwrap();
    assert_eq!(
        run["summary"],
        "0 already converged, 1 provisioned, 0 failed"
    );
    let (_, view) = scenario
        .server
        .get(&format!("/v1/devices/{id}"))
        .await
        .unwrap();
    let history: Vec<(i64, OutcomeKind)> = view["history"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .map(|h| {
            (
                h["attempt"].as_i64().unwrap(),
                serde_json::from_value(h["result"].clone()).unwrap(),
            )
        })
        .collect();
    assert_eq!(
        history,
        vec![
            (1, OutcomeKind::Failed),
            (2, OutcomeKind::Failed),
            (3, OutcomeKind::Provisioned)
        ],
        "{view}"
    );
    assert_eq!(view["history"][1]["reason"], "rejected by device: busy");
    assert_eq!(view["attempts"], 0, "a success resets the failure count");
    assert_eq!(view["status"], "converged");
    let outcomes = scenario.server.run_outcomes(&run_id).await.unwrap();
    assert_eq!(outcomes.len(), 1);
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_that_keeps_rejecting_is_quarantined_once_and_released_by_an_operator_retry() {
    // Rejects the three attempts the server allows, accepts the fourth.
    let (scenario, fleet, id) = one_device_rejecting("stubborn-", 3, "no").await;

    let (run_id, run) = scenario.run_all(Duration::from_secs(20)).await.unwrap();
    assert_eq!(
        run["summary"],
        "0 already converged, 0 provisioned, 1 failed"
    );
    let outcomes = scenario.server.run_outcomes(&run_id).await.unwrap();
    assert_eq!(outcomes.len(), 1, "exactly one outcome for the run");
    let (_, view) = scenario
        .server
        .get(&format!("/v1/devices/{id}"))
        .await
        .unwrap();
    assert_eq!(view["status"], "quarantined");
    assert_eq!(view["attempts"], 3);
    assert_eq!(view["last_error"], "rejected by device: no");
    let events = device_events(&scenario, id.as_str()).await;
    assert_eq!(
        events.get("io.idem.device.quarantined"),
        Some(&1),
        "{events:?}"
    );
    assert_eq!(events.get("io.idem.device.failed"), Some(&1), "{events:?}");

    // Left alone: a new run skips it.
    let (_, again) = scenario.run_all(Duration::from_secs(20)).await.unwrap();
    assert_eq!(
        again["summary"],
        "0 already converged, 0 provisioned, 0 failed, 1 skipped"
    );

    // The operator retries; the device now accepts.
    let (status, retry) = scenario
        .server
        .post(&format!("/v1/devices/{id}/retry"), &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{retry}");
    let run = scenario
        .server
        .wait_run_completed(retry["run_id"].as_str().unwrap(), Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(
        run["summary"],
        "0 already converged, 1 provisioned, 0 failed"
    );
    assert_eq!(run["trigger"], "retry");
    let (status, body) = scenario
        .server
        .post(&format!("/v1/devices/{id}/retry"), &json!({}))
        .await
        .unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (409, Some("not_quarantined"))
    );
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_converged_device_that_drifts_is_reprovisioned_without_an_operator() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("drift-", 5).build().unwrap();
    let fleet = scenario.register_and_start(&plan, 5).await.unwrap();
    let (_, run) = scenario.run_all(Duration::from_secs(20)).await.unwrap();
    assert_eq!(
        run["summary"],
        "5 already converged, 0 provisioned, 0 failed"
    );

    let id = plan.devices[2].id.clone();
    fleet
        .set_local_spec(&id, json!({"hand": "edited"}))
        .unwrap();
    wait_for("a completed drift run", Duration::from_secs(20), || async {
        !runs_with_trigger(&scenario, "drift").await.is_empty()
    })
    .await;
    let drift_run = &runs_with_trigger(&scenario, "drift").await[0];
    assert_eq!(
        drift_run["summary"], "0 already converged, 1 provisioned, 0 failed",
        "{drift_run}"
    );
    assert_eq!(fleet.state(&id).unwrap().spec, plan.desired_spec);
    let events = device_events(&scenario, id.as_str()).await;
    assert_eq!(events.get("io.idem.device.drifted"), Some(&1), "{events:?}");
    assert_eq!(
        events.get("io.idem.device.provisioned"),
        Some(&1),
        "{events:?}"
    );
    let (_, view) = scenario
        .server
        .get(&format!("/v1/devices/{id}"))
        .await
        .unwrap();
    assert_eq!(view["status"], "converged");
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offline_devices_are_skipped_and_reconciled_when_they_reconnect() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("roam-", 4).build().unwrap();
    let fleet = scenario.register_and_start(&plan, 4).await.unwrap();
    let away = plan.devices[1].id.clone();
    fleet.take_offline(&away, OfflineMode::Abrupt).unwrap();
    wait_for(
        "the server to see the device offline",
        Duration::from_secs(20),
        || async {
            scenario
                .server
                .get(&format!("/v1/devices/{away}"))
                .await
                .unwrap()
                .1["online"]
                == false
        },
    )
    .await;

    let (status, answer) = scenario
        .server
        .post(
            "/v1/desired",
            &json!({"all": true, "spec": {"firmware": "2.0"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let run = scenario
        .server
        .wait_run_completed(answer["run_id"].as_str().unwrap(), Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(
        run["summary"],
        "0 already converged, 3 provisioned, 0 failed, 1 skipped"
    );
    let (_, view) = scenario
        .server
        .get(&format!("/v1/devices/{away}"))
        .await
        .unwrap();
    assert_eq!(view["status"], "offline");
    assert_eq!(view["last_outcome"]["reason"], "offline");

    fleet.bring_online(&away).unwrap();
    wait_for(
        "a completed reconnect run",
        Duration::from_secs(20),
        || async { !runs_with_trigger(&scenario, "reconnect").await.is_empty() },
    )
    .await;
    let reconnect = &runs_with_trigger(&scenario, "reconnect").await[0];
    assert_eq!(
        reconnect["summary"], "0 already converged, 1 provisioned, 0 failed",
        "{reconnect}"
    );
    assert_eq!(fleet.state(&away).unwrap().spec, json!({"firmware": "2.0"}));
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_desired_change_during_a_push_supersedes_it_and_a_late_ack_does_not_count() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("slow-", 1)
        .apply_latency(Duration::from_millis(800), Duration::from_millis(800))
        .build()
        .unwrap();
    let fleet = scenario.register_and_start(&plan, 1).await.unwrap();
    let id = plan.devices[0].id.clone();
    let path = format!("/v1/devices/{id}/desired");

    let received_before = fleet.state(&id).unwrap().desired_received;
    let (_, first) = scenario
        .server
        .put(&path, &json!({"spec": {"firmware": "2"}}))
        .await
        .unwrap();
    // Change desired again while the device is applying generation 2.
    wait_for(
        "the device to receive generation 2",
        Duration::from_secs(10),
        || async { fleet.state(&id).unwrap().desired_received > received_before },
    )
    .await;
    let (_, second) = scenario
        .server
        .put(&path, &json!({"spec": {"firmware": "3"}}))
        .await
        .unwrap();
    assert_eq!(
        (first["generation"].as_i64(), second["generation"].as_i64()),
        (Some(2), Some(3))
    );

    let old = scenario
        .server
        .wait_run_completed(first["run_id"].as_str().unwrap(), Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(
        old["summary"],
        "0 already converged, 0 provisioned, 0 failed, 1 superseded"
    );
    let new = scenario
        .server
        .wait_run_completed(second["run_id"].as_str().unwrap(), Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(
        new["summary"],
        "0 already converged, 1 provisioned, 0 failed"
    );
    let outcome = &scenario
        .server
        .run_outcomes(second["run_id"].as_str().unwrap())
        .await
        .unwrap()[id.as_str()];
    assert_eq!(outcome["generation"], 3);

    // The device applied generation 2 (late) before 3; only 3 confirmed the run.
    let device = fleet.state(&id).unwrap();
    assert_eq!(device.generation, Some(3));
    assert_eq!(device.spec, json!({"firmware": "3"}));
    let (_, view) = scenario
        .server
        .get(&format!("/v1/devices/{id}"))
        .await
        .unwrap();
    assert_eq!(view["reported"]["generation"], 3);
    assert_eq!(view["status"], "converged");
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_targets_a_device_being_pushed_shares_the_push_and_both_runs_get_its_outcome() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("shared-", 1)
        .apply_latency(Duration::from_millis(800), Duration::from_millis(800))
        .build()
        .unwrap();
    let watcher = DesiredWatcher::start(&scenario.broker, &scenario.server.topic_root)
        .await
        .unwrap();
    let fleet = scenario.register_and_start(&plan, 1).await.unwrap();
    let id = plan.devices[0].id.clone();
    let pushes_before = watcher.total();

    let received_before = fleet.state(&id).unwrap().desired_received;
    let (_, desired) = scenario
        .server
        .put(
            &format!("/v1/devices/{id}/desired"),
            &json!({"spec": {"firmware": "2"}}),
        )
        .await
        .unwrap();
    // A re-check of the same device while it is applying the push.
    wait_for(
        "the device to receive the push",
        Duration::from_secs(10),
        || async { fleet.state(&id).unwrap().desired_received > received_before },
    )
    .await;
    let recheck = scenario
        .server
        .start_run(&json!({"devices": [id.as_str()]}))
        .await
        .unwrap();

    for run_id in [desired["run_id"].as_str().unwrap(), recheck.as_str()] {
        let run = scenario
            .server
            .wait_run_completed(run_id, Duration::from_secs(20))
            .await
            .unwrap();
        assert_eq!(
            run["summary"], "0 already converged, 1 provisioned, 0 failed",
            "{run}"
        );
        let outcomes = scenario.server.run_outcomes(run_id).await.unwrap();
        assert_eq!(outcomes.len(), 1, "{outcomes:?}");
        assert_eq!(outcomes[id.as_str()]["generation"], 2);
    }
    watcher
        .wait_for_run_completed(&recheck, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(
        watcher.total() - pushes_before,
        1,
        "the second run shares the push in flight"
    );
    assert_eq!(
        device_events(&scenario, id.as_str())
            .await
            .get("io.idem.device.provisioned"),
        Some(&2),
        "one outcome event per run"
    );
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_to_a_thousand_devices_never_exceed_the_rate_limit_in_any_second() {
    let settings = ServerSettings {
        push_rate: 200,
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let plan = FleetPlan::new("paced-", 1_000).build().unwrap();
    let watcher = DesiredWatcher::start(&scenario.broker, &scenario.server.topic_root)
        .await
        .unwrap();
    let fleet = scenario.register_and_start(&plan, 1_000).await.unwrap();

    let started = Instant::now();
    let (status, answer) = scenario
        .server
        .post(
            "/v1/desired",
            &json!({"all": true, "spec": {"firmware": "paced"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let mut saw_queue = false;
    let run_id = answer["run_id"].as_str().unwrap().to_owned();
    let run = loop {
        let (_, fleet_view) = scenario.server.get("/v1/fleet").await.unwrap();
        saw_queue |= fleet_view["pushes"]["queued"].as_u64().unwrap_or(0) > 0;
        let (_, run) = scenario
            .server
            .get(&format!("/v1/runs/{run_id}"))
            .await
            .unwrap();
        if run["state"] == "completed" {
            break run;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "run not completed: {run}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        run["summary"],
        "0 already converged, 1,000 provisioned, 0 failed"
    );
    assert!(
        saw_queue,
        "the push queue depth should be visible while pacing"
    );
    watcher
        .wait_for_run_completed(&run_id, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(watcher.total(), 1_000);
    let peak = watcher.max_per_second();
    println!(
        "1,000 pushes at 200/s: peak {peak} in one second, run took {:?}",
        started.elapsed()
    );
    assert!(peak <= 200, "{peak} pushes arrived within one second");
    // A loose floor, only to show that pacing lets pushes through at a
    // sizeable share of the limit even on a loaded machine; how close to
    // the limit it gets is a benchmark's question, not a test's.
    assert!(peak >= 50, "pacing far below the limit: {peak}/s");
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reported_health_is_recorded_with_outcomes_and_unhealthy_devices_are_listed() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("sick-", 3).build().unwrap();
    let mut devices = plan.devices.clone();
    devices[0] = devices[0].clone().with_health(Health::Unhealthy);
    scenario
        .register(&devices, &plan.desired_spec)
        .await
        .unwrap();
    let fleet = scenario.start_fleet(devices).await.unwrap();
    scenario
        .wait_reports_stored(3, Duration::from_secs(10))
        .await
        .unwrap();
    let (run_id, run) = scenario.run_all(Duration::from_secs(20)).await.unwrap();
    assert_eq!(
        run["summary"],
        "3 already converged, 0 provisioned, 0 failed"
    );
    let sick: DeviceId = plan.devices[0].id.clone();
    let outcomes = scenario.server.run_outcomes(&run_id).await.unwrap();
    assert_eq!(outcomes[sick.as_str()]["health"], "unhealthy");
    assert_eq!(outcomes[plan.devices[1].id.as_str()]["health"], "healthy");
    let [data] = scenario
        .event_data("io.idem.device.already_converged", sick.as_str())
        .await
        .unwrap()
        .try_into()
        .expect("one already_converged event of the sick device");
    let data: DeviceOutcomeData = serde_json::from_value(data).unwrap();
    assert_eq!(data.health, Some(Health::Unhealthy));
    let (_, fleet_view) = scenario.server.get("/v1/fleet").await.unwrap();
    assert_eq!(fleet_view["unhealthy_converged"], 1, "{fleet_view}");
    let (_, listed) = scenario
        .server
        .get("/v1/devices?status=converged&health=unhealthy")
        .await
        .unwrap();
    let ids: Vec<&str> = listed["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![sick.as_str()]);
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_periodic_resync_rechecks_every_device_and_asks_stale_ones_to_report() {
    let settings = ServerSettings {
        resync_interval: Duration::from_millis(1_500),
        stale_after: Duration::from_millis(500),
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let plan = FleetPlan::new("resync-", 6).drifted(1).build().unwrap();
    let fleet = scenario.register_and_start(&plan, 6).await.unwrap();
    wait_for(
        "a completed resync run",
        Duration::from_secs(20),
        || async { !runs_with_trigger(&scenario, "resync").await.is_empty() },
    )
    .await;
    let resync = runs_with_trigger(&scenario, "resync").await.pop().unwrap();
    assert_eq!(
        resync["summary"], "5 already converged, 1 provisioned, 0 failed",
        "{resync}"
    );
    wait_for(
        "stale devices asked to report",
        Duration::from_secs(10),
        || async { fleet.states().iter().all(|d| d.get_received >= 1) },
    )
    .await;
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_reconciles_the_whole_fleet_at_start_up() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("boot-", 8).build().unwrap();
    let fleet = scenario.register_and_start(&plan, 8).await.unwrap();
    let Scenario { server, db, broker } = scenario;
    let root = server.topic_root.to_string();
    server.stop().await.unwrap();

    let settings = ServerSettings {
        topic_root: Some(root),
        ..ServerSettings::default()
    };
    let server = idem_tests::TestServer::start(&db, &broker, settings)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let startup = loop {
        let (_, body) = server.get("/v1/runs").await.unwrap();
        let found = body["runs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["trigger"] == "startup")
            .cloned();
        if let Some(run) = found.filter(|r| r["state"] == "completed") {
            break run;
        }
        assert!(
            Instant::now() < deadline,
            "no completed startup run: {body}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert_eq!(
        startup["summary"],
        "8 already converged, 0 provisioned, 0 failed"
    );
    fleet.shutdown().await.unwrap();
}
