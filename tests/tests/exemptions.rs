//! Drift exemptions end to end against real PostgreSQL and a private
//! Mosquitto: an exempt device's drift is seen, evented and shown, never
//! remediated, until its exemption ends; then it is reconciled like any
//! drifted device.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use idem_device_sim::FleetPlan;
use idem_protocol::DeviceId;
use idem_tests::{wait_until, Scenario, ServerSettings};
use reqwest::Method;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exempt_device_that_drifts_is_evented_as_exempt_and_not_pushed_until_its_exemption_expires(
) {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("exempt-", 5).build().unwrap();
    let fleet = scenario.register_and_start(&plan, 5).await.unwrap();
    let exempt = plan.devices[0].id.to_string();
    let other = plan.devices[1].id.to_string();
    for device in [&exempt, &other] {
        wait_until(
            Duration::from_secs(10),
            "converged by its report",
            || async { scenario.device(device).await.unwrap()["status"] == "converged" },
        )
        .await
        .unwrap();
    }

    let (status, created) = scenario
        .server
        .post(
            "/v1/exemptions",
            &json!({"device": exempt, "reason": "field test of a new interval", "expires_in": "5s"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["devices"], 1, "{created}");
    assert_eq!(scenario.device(&exempt).await.unwrap()["exempt"], true);
    let (_, preview) = scenario
        .server
        .post(
            "/v1/plans",
            &json!({"all": true, "spec": plan.desired_spec}),
        )
        .await
        .unwrap();
    assert_eq!(
        preview["counts"]["skipped_by_reason"]["exempt"], 1,
        "{preview}"
    );

    // Both drift in the same field; only the one not exempt is remediated.
    let mut drifted = plan.desired_spec.clone();
    drifted["telemetry"]["interval_s"] = json!(30);
    for device in [&exempt, &other] {
        let id = DeviceId::parse(device).unwrap();
        fleet.set_local_spec(&id, drifted.clone()).unwrap();
        fleet.request_report(&id).unwrap();
    }
    wait_until(
        Duration::from_secs(15),
        "the other device remediated",
        || async {
            !scenario
                .event_data("io.idem.device.provisioned", &other)
                .await
                .unwrap()
                .is_empty()
        },
    )
    .await
    .unwrap();
    for (device, exempt_flag) in [(&exempt, true), (&other, false)] {
        let events = scenario
            .event_data("io.idem.device.drifted", device)
            .await
            .unwrap();
        assert_eq!(events.len(), 1, "{device}: {events:?}");
        assert_eq!(events[0]["exempt"], exempt_flag, "{device}: {events:?}");
        assert_eq!(
            events[0]["changed_paths"],
            json!(["telemetry.interval_s"]),
            "{device}: {events:?}"
        );
        // Paths only: no field of the event carries a spec value.
        let fields: Vec<&String> = events[0].as_object().unwrap().keys().collect();
        assert_eq!(
            fields,
            [
                "changed_paths",
                "desired_digest",
                "exempt",
                "reported_digest",
                "reported_seq"
            ],
            "{events:?}"
        );
    }
    assert_eq!(scenario.device(&exempt).await.unwrap()["status"], "drifted");

    // A run over it skips it as exempt.
    let (status, started) = scenario
        .server
        .post("/v1/runs", &json!({"devices": [exempt]}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{started}");
    let run_id = started["run_id"].as_str().unwrap();
    scenario
        .server
        .wait_run_completed(run_id, Duration::from_secs(15))
        .await
        .unwrap();
    let outcomes = scenario.server.run_outcomes(run_id).await.unwrap();
    assert_eq!(
        (
            &outcomes[exempt.as_str()]["outcome"],
            &outcomes[exempt.as_str()]["reason"]
        ),
        (&json!("skipped"), &json!("exempt"))
    );
    assert!(
        scenario
            .event_data("io.idem.device.provisioned", &exempt)
            .await
            .unwrap()
            .is_empty(),
        "an exempt device is never pushed"
    );

    // When the exemption expires, the device is reconciled like any drifted one.
    wait_until(
        Duration::from_secs(20),
        "the device remediated after its exemption",
        || async {
            !scenario
                .event_data("io.idem.device.provisioned", &exempt)
                .await
                .unwrap()
                .is_empty()
        },
    )
    .await
    .unwrap();
    let (_, list) = scenario.server.get("/v1/exemptions").await.unwrap();
    assert_eq!(list["exemptions"], json!([]), "{list}");
    let device = scenario.device(&exempt).await.unwrap();
    assert_eq!(
        (&device["status"], &device["exempt"]),
        (&json!("converged"), &json!(false))
    );
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exemptions_are_refused_without_a_bounded_expiry_and_listed_deleted_and_audited() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("exemptions-", 3).build().unwrap();
    scenario
        .register(&plan.devices, &plan.desired_spec)
        .await
        .unwrap();
    sqlx::query("UPDATE devices SET labels = '{\"site\": \"lab\"}' WHERE id <> $1")
        .bind(plan.devices[0].id.as_str())
        .execute(scenario.db.pool())
        .await
        .unwrap();
    let server = &scenario.server;
    let device = plan.devices[0].id.to_string();
    let refusals = [
        (
            json!({"device": device, "reason": "r"}),
            400,
            "missing_expiry",
            "30d",
        ),
        (
            json!({"device": device, "reason": "r", "expires_in": "31d"}),
            400,
            "invalid_expiry",
            "30d",
        ),
        (
            json!({"device": device, "reason": "", "expires_in": "1h"}),
            400,
            "invalid_reason",
            "512",
        ),
        (
            json!({"device": device, "selector": {"labels": {"a": "b"}}, "reason": "r", "expires_in": "1h"}),
            400,
            "invalid_targets",
            "exactly one",
        ),
        (
            json!({"device": "nobody", "reason": "r", "expires_in": "1h"}),
            404,
            "unknown_device",
            "nobody",
        ),
    ];
    for (body, status, code, named) in refusals {
        server
            .expect_refused(Method::POST, "/v1/exemptions", &body, (status, code, named))
            .await
            .unwrap();
    }
    let viewer = server
        .client_for_role("exemption-viewer", "viewer")
        .await
        .unwrap();
    let (status, _) = viewer
        .post(
            "/v1/exemptions",
            &json!({"device": device, "reason": "r", "expires_in": "1h"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 403);

    // A selector covers the devices its labels match, and the cache follows
    // a label change: a device relabelled into the selector becomes exempt.
    let (status, by_label) = server
        .post(
            "/v1/exemptions",
            &json!({"selector": {"labels": {"site": "lab"}}, "reason": "lab devices", "expires_in": "1h"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{by_label}");
    assert_eq!(by_label["devices"], 2, "{by_label}");
    assert_eq!(scenario.device(&device).await.unwrap()["exempt"], false);
    let (status, _) = server
        .put(
            &format!("/v1/devices/{device}"),
            &json!({"labels": {"site": "lab"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(scenario.device(&device).await.unwrap()["exempt"], true);
    let (_, list) = viewer.get("/v1/exemptions").await.unwrap();
    assert_eq!(list["exemptions"][0]["devices"], 3, "{list}");
    assert_eq!(list["exemptions"][0]["reason"], "lab devices");

    let id = by_label["id"].as_str().unwrap();
    let (status, deleted) = server
        .delete(&format!("/v1/exemptions/{id}"))
        .await
        .unwrap();
    assert_eq!(status, 200, "{deleted}");
    assert_eq!(scenario.device(&device).await.unwrap()["exempt"], false);
    let (status, again) = server
        .delete(&format!("/v1/exemptions/{id}"))
        .await
        .unwrap();
    assert_eq!(
        (status, &again["error"]["code"]),
        (404, &json!("unknown_exemption"))
    );

    let audited: Vec<(String, String, i32)> = sqlx::query_as(
        "SELECT method, route, status FROM audit_log WHERE route LIKE '/v1/exemptions%' \
         AND status < 300 ORDER BY at",
    )
    .fetch_all(scenario.db.pool())
    .await
    .unwrap();
    assert_eq!(
        audited,
        vec![
            ("POST".into(), "/v1/exemptions".into(), 201),
            ("DELETE".into(), "/v1/exemptions/{id}".into(), 200),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_operator_filling_their_exemption_slots_leaves_the_others_theirs() {
    use idem_protocol::api::bounds::MAX_EXEMPTIONS_PER_AUTHOR;
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("slots-", 2).build().unwrap();
    scenario
        .register(&plan.devices, &plan.desired_spec)
        .await
        .unwrap();
    let device = plan.devices[0].id.to_string();
    let alice = scenario
        .server
        .client_for_role("slots-alice", "operator")
        .await
        .unwrap();
    let bob = scenario
        .server
        .client_for_role("slots-bob", "operator")
        .await
        .unwrap();
    let body = json!({"device": device, "reason": "a long field test", "expires_in": "30d"});
    for _ in 0..MAX_EXEMPTIONS_PER_AUTHOR {
        let (status, answer) = alice.post("/v1/exemptions", &body).await.unwrap();
        assert_eq!(status, 201, "{answer}");
    }
    alice
        .expect_refused(
            Method::POST,
            "/v1/exemptions",
            &body,
            (409, "too_many_exemptions", "your exemptions"),
        )
        .await
        .unwrap();
    let (status, answer) = bob.post("/v1/exemptions", &body).await.unwrap();
    assert_eq!(status, 201, "another operator still has slots: {answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_made_while_exempt_reaches_the_device_once_its_exemption_expires_or_is_deleted() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("ends-", 3).build().unwrap();
    let fleet = scenario.register_and_start(&plan, 3).await.unwrap();
    let expiring = plan.devices[0].id.clone();
    let deleted = plan.devices[1].id.clone();
    for device in [&expiring, &deleted] {
        wait_until(
            Duration::from_secs(10),
            "converged by its report",
            || async { scenario.device(device.as_str()).await.unwrap()["status"] == "converged" },
        )
        .await
        .unwrap();
    }
    let exempt = |device: &DeviceId, expires_in: &str| {
        let body = json!({"device": device, "reason": "field test", "expires_in": expires_in});
        let server = &scenario.server;
        async move {
            let (status, created) = server.post("/v1/exemptions", &body).await.unwrap();
            assert_eq!(status, 201, "{created}");
            created["id"].as_str().unwrap().to_owned()
        }
    };
    exempt(&expiring, "4s").await;
    let to_delete = exempt(&deleted, "1h").await;

    let mut changed = plan.desired_spec.clone();
    changed["telemetry"]["interval_s"] = json!(45);
    let mut generations = Vec::new();
    for device in [&expiring, &deleted] {
        let (status, answer) = scenario
            .server
            .put(
                &format!("/v1/devices/{device}/desired"),
                &json!({"spec": changed}),
            )
            .await
            .unwrap();
        assert_eq!(status, 200, "{answer}");
        let run = answer["run_id"].as_str().unwrap();
        scenario
            .server
            .wait_run_completed(run, Duration::from_secs(15))
            .await
            .unwrap();
        let outcomes = scenario.server.run_outcomes(run).await.unwrap();
        assert_eq!(
            outcomes[device.as_str()]["reason"],
            "exempt",
            "{outcomes:?}"
        );
        // Exempt and not running its desired spec: drifted, not converged.
        let view = scenario.device(device.as_str()).await.unwrap();
        assert_eq!(
            (&view["status"], &view["in_sync"]),
            (&json!("drifted"), &json!(false)),
            "{view}"
        );
        generations.push(answer["generation"].as_u64().unwrap());
    }
    let (status, answer) = scenario
        .server
        .delete(&format!("/v1/exemptions/{to_delete}"))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");

    for (device, generation) in [&expiring, &deleted].into_iter().zip(generations) {
        wait_until(
            Duration::from_secs(20),
            &format!("{device} running generation {generation} after its exemption ended"),
            || async { fleet.state(device).unwrap().generation == Some(generation) },
        )
        .await
        .unwrap();
        wait_until(
            Duration::from_secs(10),
            &format!("{device} converged and in sync"),
            || async {
                let view = scenario.device(device.as_str()).await.unwrap();
                view["status"] == "converged" && view["in_sync"] == true
            },
        )
        .await
        .unwrap();
    }
    fleet.shutdown().await.unwrap();
}
