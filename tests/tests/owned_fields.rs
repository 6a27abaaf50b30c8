//! Device-owned fields end to end against real PostgreSQL and a private
//! Mosquitto: a report that changes only a field the device owns causes no
//! push, no drift and no `drifted` event, a change anywhere else does; the
//! owned paths are never sent to a device; declaring them re-evaluates the
//! fleet without pushing to devices whose only difference they were.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use idem_device_sim::{Fleet, FleetPlan};
use idem_protocol::{Channel, DeviceId};
use idem_tests::{wait_until, Scenario, ServerSettings, TestServer};
use reqwest::Method;
use serde_json::{json, Value};

/// Sets what the simulated device runs, makes it report, and waits until
/// the server has stored that report and the engine has had time to act.
async fn reports(scenario: &Scenario, fleet: &Fleet, id: &str, spec: Value) {
    let device_id = DeviceId::parse(id).unwrap();
    let before = fleet.state(&device_id).unwrap().seq;
    fleet.set_local_spec(&device_id, spec).unwrap();
    wait_until(Duration::from_secs(10), "the report stored", || async {
        scenario.device(id).await.unwrap()["reported"]["seq"]
            .as_u64()
            .is_some_and(|seq| seq > before)
    })
    .await
    .unwrap();
    // A drift is evented and debounced at once; a push would follow it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
}

async fn wait_converged(scenario: &Scenario, ids: &[&str]) {
    for id in ids {
        wait_until(Duration::from_secs(15), "converged", || async {
            scenario.device(id).await.unwrap()["status"] == "converged"
        })
        .await
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_changing_only_an_owned_field_causes_no_push_no_drift_and_no_drifted_event() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("owned-", 3).build().unwrap();
    let fleet = scenario.register_and_start(&plan, 3).await.unwrap();
    let ids: Vec<String> = plan.devices.iter().map(|d| d.id.to_string()).collect();
    let (everywhere, sensor, plain) = (ids[0].as_str(), ids[1].as_str(), ids[2].as_str());
    wait_converged(&scenario, &[everywhere, sensor, plain]).await;
    let (status, _) = scenario
        .server
        .put(
            &format!("/v1/devices/{sensor}"),
            &json!({"labels": {"kind": "sensor"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200);

    let (status, declared) = scenario
        .server
        .put(
            "/v1/owned-fields",
            &json!({
                "fields": ["uptime"],
                "by_selector": [{"selector": {"labels": {"kind": "sensor"}}, "fields": ["battery"]}],
            }),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{declared}");
    assert_eq!(declared["devices"], 3, "{declared}");
    let run_id = declared["run_id"].as_str().unwrap();
    scenario
        .server
        .wait_run_completed(run_id, Duration::from_secs(15))
        .await
        .unwrap();

    // Only owned fields changed: no drift, no push, no event; the diff
    // shows them ignored.
    let mut with_uptime = plan.desired_spec.clone();
    with_uptime["uptime"] = json!(12_345);
    reports(&scenario, &fleet, everywhere, with_uptime.clone()).await;
    let mut with_battery = with_uptime.clone();
    with_battery["battery"] = json!(81);
    reports(&scenario, &fleet, sensor, with_battery.clone()).await;
    for id in [everywhere, sensor] {
        assert!(
            scenario
                .event_data("io.idem.device.drifted", id)
                .await
                .unwrap()
                .is_empty(),
            "{id}: a change in an owned field is no drift"
        );
        assert!(
            scenario
                .event_data("io.idem.device.provisioned", id)
                .await
                .unwrap()
                .is_empty(),
            "{id}: a change in an owned field causes no push"
        );
        let view = scenario.device(id).await.unwrap();
        assert_eq!(
            (&view["status"], &view["in_sync"]),
            (&json!("converged"), &json!(true)),
            "{view}"
        );
        assert!(
            view["diff"]
                .as_array()
                .unwrap()
                .iter()
                .all(|d| d["ignored"] == true),
            "{view}"
        );
    }
    let diff = &scenario.device(sensor).await.unwrap()["diff"];
    assert_eq!(
        diff,
        &json!([
            {"path": "battery", "change": "removed", "old": 81, "new": null, "ignored": true},
            {"path": "uptime", "change": "removed", "old": 12_345, "new": null, "ignored": true},
        ])
    );

    // `battery` is owned by the sensors only: the plain device drifts.
    let mut plain_battery = plan.desired_spec.clone();
    plain_battery["battery"] = json!(50);
    plain_battery["uptime"] = json!(7);
    reports(&scenario, &fleet, plain, plain_battery).await;
    let drifted = scenario
        .event_data("io.idem.device.drifted", plain)
        .await
        .unwrap();
    assert_eq!(drifted.len(), 1, "{drifted:?}");
    assert_eq!(
        drifted[0]["changed_paths"],
        json!(["battery"]),
        "{drifted:?}"
    );

    // A change anywhere else drifts and is pushed, without the owned paths.
    let mut elsewhere = with_battery.clone();
    elsewhere["telemetry"]["interval_s"] = json!(30);
    reports(&scenario, &fleet, sensor, elsewhere).await;
    wait_until(Duration::from_secs(15), "the sensor remediated", || async {
        !scenario
            .event_data("io.idem.device.provisioned", sensor)
            .await
            .unwrap()
            .is_empty()
    })
    .await
    .unwrap();
    let drifted = scenario
        .event_data("io.idem.device.drifted", sensor)
        .await
        .unwrap();
    assert_eq!(drifted.len(), 1, "{drifted:?}");
    assert_eq!(
        drifted[0]["changed_paths"],
        json!(["telemetry.interval_s"]),
        "owned paths are not named: {drifted:?}"
    );

    // A desired spec naming an owned path: the path is never sent, and it
    // changes nothing a device compares.
    let mut desired = plan.desired_spec.clone();
    desired["uptime"] = json!(0);
    let (status, started) = scenario
        .server
        .post("/v1/desired", &json!({"all": true, "spec": desired}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{started}");
    let run_id = started["run_id"].as_str().unwrap();
    let run = scenario
        .server
        .wait_run_completed(run_id, Duration::from_secs(15))
        .await
        .unwrap();
    assert_eq!(run["counts"]["provisioned"], 0, "{run}");
    // The new generation's retained desired message, which a device reads
    // when it reconnects, leaves the owned path out (the sensor has one
    // since its push; the broker holds none for a device never pushed).
    {
        let id = sensor;
        let device_id = DeviceId::parse(id).unwrap();
        let generation = scenario.device(id).await.unwrap()["desired"]["generation"].clone();
        let topic = scenario
            .server
            .topic_root
            .topic(&device_id, Channel::Desired);
        let deadline = Instant::now() + Duration::from_secs(10);
        let retained = loop {
            let retained: Value = scenario
                .broker
                .retained_on(&topic)
                .await
                .map(|payload| serde_json::from_slice(&payload).unwrap())
                .unwrap_or_default();
            if retained["generation"] == generation {
                break retained;
            }
            assert!(Instant::now() < deadline, "{id}: retained {retained}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(retained["spec"].get("uptime"), None, "{id}: {retained}");
        assert_eq!(
            retained["spec"]["telemetry"], desired["telemetry"],
            "{retained}"
        );
    }
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declaring_owned_fields_converges_devices_that_differed_only_there_without_a_push() {
    // Drift is evented at once; its run would wait an hour.
    let settings = ServerSettings {
        debounce: Duration::from_secs(3600),
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let plan = FleetPlan::new("declare-", 4).build().unwrap();
    let fleet = scenario.register_and_start(&plan, 4).await.unwrap();
    let ids: Vec<String> = plan.devices.iter().map(|d| d.id.to_string()).collect();
    let (battery, elsewhere) = (ids[0].as_str(), ids[1].as_str());
    wait_converged(
        &scenario,
        &ids.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;

    let mut with_battery = plan.desired_spec.clone();
    with_battery["battery"] = json!(64);
    reports(&scenario, &fleet, battery, with_battery).await;
    let mut changed = plan.desired_spec.clone();
    changed["telemetry"]["interval_s"] = json!(45);
    reports(&scenario, &fleet, elsewhere, changed).await;
    for id in [battery, elsewhere] {
        assert_eq!(scenario.device(id).await.unwrap()["status"], "drifted");
    }
    let (status, stale_plan) = scenario
        .server
        .post(
            "/v1/plans",
            &json!({"all": true, "spec": plan.desired_spec}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{stale_plan}");
    assert_eq!(stale_plan["counts"]["push"], 2, "{stale_plan}");

    // Refused, naming the limit, and not for a viewer.
    let server = &scenario.server;
    let too_many: Vec<String> = (0..65).map(|i| format!("k{i}")).collect();
    let refusals = [
        (
            json!({"fields": ["net..rssi"]}),
            "invalid_owned_fields",
            "net..rssi",
        ),
        (
            json!({"fields": ["servers[0]"]}),
            "invalid_owned_fields",
            "array item",
        ),
        (json!({"fields": too_many}), "invalid_owned_fields", "64"),
        (
            json!({"by_selector": [{"selector": {"labels": {}}, "fields": ["a"]}]}),
            "empty_selector",
            "by_selector[0]",
        ),
    ];
    for (body, code, named) in refusals {
        server
            .expect_refused(Method::PUT, "/v1/owned-fields", &body, (400, code, named))
            .await
            .unwrap();
    }
    let viewer = server
        .client_for_role("owned-viewer", "viewer")
        .await
        .unwrap();
    let (status, _) = viewer
        .put("/v1/owned-fields", &json!({"fields": ["battery"]}))
        .await
        .unwrap();
    assert_eq!(status, 403);

    let (status, declared) = server
        .put("/v1/owned-fields", &json!({"fields": ["battery"]}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{declared}");
    assert_eq!(declared["devices_changed"], 4, "{declared}");
    let run_id = declared["run_id"].as_str().unwrap();
    server
        .wait_run_completed(run_id, Duration::from_secs(15))
        .await
        .unwrap();
    let outcomes = server.run_outcomes(run_id).await.unwrap();
    assert_eq!(
        outcomes[battery]["outcome"], "already_converged",
        "{outcomes:?}"
    );
    assert_eq!(
        outcomes[elsewhere]["outcome"], "provisioned",
        "{outcomes:?}"
    );
    assert!(
        scenario
            .event_data("io.idem.device.provisioned", battery)
            .await
            .unwrap()
            .is_empty(),
        "its only difference is owned now: no push"
    );
    assert_eq!(
        scenario.device(battery).await.unwrap()["status"],
        "converged"
    );

    // The plan was computed on the old declaration.
    let id = stale_plan["plan_id"].as_str().unwrap();
    let (status, refused) = server
        .post(&format!("/v1/plans/{id}/apply"), &json!({}))
        .await
        .unwrap();
    assert_eq!(
        (status, &refused["error"]["code"]),
        (409, &json!("plan_stale")),
        "{refused}"
    );
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("owned fields changed"),
        "{refused}"
    );

    let (_, read) = viewer.get("/v1/owned-fields").await.unwrap();
    assert_eq!(read["fields"], json!(["battery"]), "{read}");
    assert_eq!(read["updated_by"], declared["updated_by"], "{read}");
    assert_eq!(read["devices"], 4, "{read}");
    let audited: Vec<(String, i32)> = sqlx::query_as(
        "SELECT method, status FROM audit_log WHERE route = '/v1/owned-fields' ORDER BY at",
    )
    .fetch_all(scenario.db.pool())
    .await
    .unwrap();
    assert!(audited.contains(&("PUT".into(), 200)), "{audited:?}");

    // A retained desired message holding a path that becomes owned is
    // published again without it, at the same generation.
    let mut with_window = plan.desired_spec.clone();
    with_window["ota_window"] = json!("night");
    let (status, set) = server
        .put(
            &format!("/v1/devices/{elsewhere}/desired"),
            &json!({"spec": with_window}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{set}");
    server
        .wait_run_completed(set["run_id"].as_str().unwrap(), Duration::from_secs(15))
        .await
        .unwrap();
    let topic = server
        .topic_root
        .topic(&DeviceId::parse(elsewhere).unwrap(), Channel::Desired);
    let retained =
        |payload: Option<Vec<u8>>| -> Value { serde_json::from_slice(&payload.unwrap()).unwrap() };
    let before = retained(scenario.broker.retained_on(&topic).await);
    assert_eq!(before["spec"]["ota_window"], "night", "{before}");
    let (status, declared) = server
        .put(
            "/v1/owned-fields",
            &json!({"fields": ["battery", "ota_window"]}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{declared}");
    wait_until(
        Duration::from_secs(10),
        "the retained message republished",
        || async {
            retained(scenario.broker.retained_on(&topic).await)["spec"]
                .get("ota_window")
                .is_none()
        },
    )
    .await
    .unwrap();
    let after = retained(scenario.broker.retained_on(&topic).await);
    assert_eq!(after["generation"], before["generation"], "{after}");

    // Stored: a restarted server owns the same fields.
    fleet.shutdown().await.unwrap();
    let Scenario { server, db, broker } = scenario;
    let settings = ServerSettings {
        topic_root: Some(server.topic_root.to_string()),
        ..ServerSettings::default()
    };
    server.stop().await.unwrap();
    let restarted = TestServer::start(&db, &broker, settings).await.unwrap();
    let (_, again) = restarted
        .get(&format!("/v1/devices/{battery}"))
        .await
        .unwrap();
    // (Offline now: the fleet stopped before the restart.)
    assert_eq!(again["in_sync"], true, "{again}");
    let (_, read) = restarted.get("/v1/owned-fields").await.unwrap();
    assert_eq!(read["fields"], json!(["battery", "ota_window"]), "{read}");
    restarted.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_its_first_report_registers_owns_the_server_wide_fields() {
    let settings = ServerSettings {
        auto_register: true,
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let (status, declared) = scenario
        .server
        .put("/v1/owned-fields", &json!({"fields": ["uptime"]}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{declared}");
    let plan = FleetPlan::new("auto-", 1).build().unwrap();
    let fleet = scenario.start_fleet(plan.devices.clone()).await.unwrap();
    scenario
        .wait_reports_stored(1, Duration::from_secs(15))
        .await
        .unwrap();
    let id = plan.devices[0].id.to_string();
    let mut with_uptime = plan.desired_spec.clone();
    with_uptime["uptime"] = json!(99);
    reports(&scenario, &fleet, &id, with_uptime).await;

    // Its desired spec is what it runs but for `uptime`: nothing to push.
    let (status, set) = scenario
        .server
        .put(
            &format!("/v1/devices/{id}/desired"),
            &json!({"spec": plan.desired_spec}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{set}");
    let run_id = set["run_id"].as_str().unwrap();
    scenario
        .server
        .wait_run_completed(run_id, Duration::from_secs(15))
        .await
        .unwrap();
    let outcomes = scenario.server.run_outcomes(run_id).await.unwrap();
    assert_eq!(
        outcomes[id.as_str()]["outcome"],
        "already_converged",
        "{outcomes:?}"
    );
    fleet.shutdown().await.unwrap();
}
