//! Several instances on one database and one broker, in process: what one
//! writes, the others' fleet caches follow (the `devices` versions and
//! `NOTIFY`), so a device registered or changed through one instance is
//! handled as such by every other.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use idem_device_sim::SimDevice;
use idem_protocol::DeviceId;
use idem_tests::{wait_until, PushWitness, Scenario, ServerSettings, TestServer};
use serde_json::{json, Value};

/// A scenario whose server shares `group`, and a second instance over the
/// same fleet, database and broker.
async fn two_instances(group: &str) -> (Scenario, TestServer) {
    let scenario = Scenario::start(ServerSettings {
        share_group: Some(group.to_owned()),
        ..ServerSettings::default()
    })
    .await
    .unwrap();
    let second = another_instance(&scenario, group).await;
    (scenario, second)
}

/// A second instance over the scenario's fleet, database and broker.
async fn another_instance(scenario: &Scenario, group: &str) -> TestServer {
    another_instance_with(scenario, group, ServerSettings::default()).await
}

/// [`another_instance`], otherwise as `settings` say.
async fn another_instance_with(
    scenario: &Scenario,
    group: &str,
    settings: ServerSettings,
) -> TestServer {
    TestServer::start(
        &scenario.db,
        &scenario.broker,
        ServerSettings {
            topic_root: Some(scenario.server.topic_root.to_string()),
            share_group: Some(group.to_owned()),
            ..settings
        },
    )
    .await
    .unwrap()
}

/// Waits until `check` holds for the device as `server` answers it.
async fn wait_device(
    server: &TestServer,
    id: &str,
    what: &str,
    check: impl Fn(u16, &Value) -> bool,
) {
    let path = format!("/v1/devices/{id}");
    wait_until(Duration::from_secs(5), what, || async {
        let (status, body) = server.get(&path).await.unwrap();
        check(status, &body)
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_registered_through_one_instance_have_their_reports_stored_by_either() {
    const DEVICES: usize = 40;
    let (scenario, second) = two_instances("follow-reports").await;
    // Registered through the first instance only, after both started.
    let devices: Vec<SimDevice> = (0..DEVICES)
        .map(|n| {
            SimDevice::new(
                DeviceId::parse(&format!("shared-{n:02}")).unwrap(),
                json!({"fw": "1"}),
            )
        })
        .collect();
    scenario
        .register(&devices, &json!({"fw": "1"}))
        .await
        .unwrap();
    let _fleet = scenario.start_fleet(devices).await.unwrap();
    // The broker hands each report to one of the two: the second instance
    // must know the devices to store its share.
    scenario
        .wait_reports_stored(DEVICES, Duration::from_secs(15))
        .await
        .unwrap();
    let metrics = second.metrics().await.unwrap();
    let refused = idem_device_sim::api::metric_value(
        &metrics,
        "idem_reports_rejected_total{reason=\"unknown_device\"}",
    )
    .unwrap();
    assert!(
        refused.is_none() || refused == Some(0.0),
        "the second instance refused reports of devices registered through the first: {refused:?}"
    );
    wait_device(
        &second,
        "shared-07",
        "a device registered elsewhere",
        |status, body| status == 200 && body["reported"]["spec"] == json!({"fw": "1"}),
    )
    .await;
}

/// Waits until `/readyz` of `server` says it owns `lease`.
async fn wait_owns(server: &TestServer, lease: &str) {
    wait_until(Duration::from_secs(10), lease, || async {
        let (_, ready) = server.get("/readyz").await.unwrap();
        ready["owns"]
            .as_array()
            .is_some_and(|owns| owns.iter().any(|o| o == lease))
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_desired_change_posted_to_an_instance_without_the_engine_is_pushed_with_its_new_generation(
) {
    let scenario = Scenario::start(ServerSettings {
        share_group: Some("follow-desired".to_owned()),
        ..ServerSettings::default()
    })
    .await
    .unwrap();
    let root = scenario.server.topic_root.clone();
    wait_owns(&scenario.server, "engine").await;
    let id = DeviceId::parse("moved-1").unwrap();
    let device = SimDevice::new(id.clone(), json!({"fw": "1"}));
    scenario
        .register(std::slice::from_ref(&device), &json!({"fw": "1"}))
        .await
        .unwrap();
    let _fleet = scenario.start_fleet(vec![device]).await.unwrap();
    scenario
        .wait_reports_stored(1, Duration::from_secs(10))
        .await
        .unwrap();
    // Started now, it loads the device at generation 1; the first instance
    // keeps the engine.
    let second = another_instance(&scenario, "follow-desired").await;
    let (_, ready) = second.get("/readyz").await.unwrap();
    assert_eq!(ready["owns"], json!([]), "{ready}");
    let witness = PushWitness::start(&scenario.broker, &root).await.unwrap();
    // Generation 2 is committed through the second instance; the engine of
    // the first takes the run up and pushes what its cache holds by then.
    let (status, body) = second
        .post(
            "/v1/desired",
            &json!({"devices": ["moved-1"], "spec": {"fw": "2"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let run_id = body["run_id"].as_str().unwrap().to_owned();
    let run = second
        .wait_run_completed(&run_id, Duration::from_secs(15))
        .await
        .unwrap();
    assert_eq!(
        run["summary"], "0 already converged, 1 provisioned, 0 failed",
        "{run}"
    );
    assert_eq!(
        witness.pushes().unwrap(),
        std::collections::HashMap::from([(("moved-1".to_owned(), 2), 1)]),
        "pushes (device, generation) → count"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_paused_past_its_lease_commits_nothing_once_the_lease_changed_hands() {
    use idem_server::store::cache::FleetCache;
    use idem_server::store::devices::{register, Registration};
    use idem_server::store::leases::{acquire_or_renew, Fence, LeaseHolder};
    use idem_server::store::{DeviceWriter, StoreError};
    let db = idem_tests::TestDatabase::create_with(&idem_server::MIGRATOR)
        .await
        .unwrap();
    let pool = db.pool();
    let holder = |instance: &str| LeaseHolder {
        instance: instance.to_owned(),
        id: uuid::Uuid::new_v4(),
        ttl: Duration::from_secs(10),
    };
    let (a, b) = (holder("a"), holder("b"));
    let writer = |pool: &sqlx::PgPool| {
        DeviceWriter::new(pool.clone(), std::sync::Arc::new(FleetCache::default()), 0)
    };
    let (writer_a, writer_b) = (writer(pool), writer(pool));
    let fence = |holder: &LeaseHolder, epoch| Fence {
        lease: "engine",
        holder_id: holder.id,
        epoch,
    };
    let registering = |id: &str| {
        vec![Registration {
            id: DeviceId::parse(id).unwrap(),
            labels: None,
        }]
    };
    let epoch_a = acquire_or_renew(pool, "engine", &a)
        .await
        .unwrap()
        .unwrap()
        .epoch;
    let mut write = writer_a
        .begin_fenced(Some(&fence(&a, epoch_a)))
        .await
        .unwrap();
    register(&mut write, &registering("by-a")).await.unwrap();
    write.commit("a's write").await.unwrap();

    // a is paused past its lease: refused even before anyone takes over.
    sqlx::query("UPDATE leases SET renewed_at = now() - interval '11 seconds'")
        .execute(pool)
        .await
        .unwrap();
    let refused = writer_a.begin_fenced(Some(&fence(&a, epoch_a))).await;
    assert!(
        matches!(refused, Err(StoreError::LeaseLost { .. })),
        "an engine past its lease began a write: {refused:?}"
    );
    // b takes the lease over; a wakes up and tries again: refused; b writes.
    let epoch_b = acquire_or_renew(pool, "engine", &b)
        .await
        .unwrap()
        .unwrap()
        .epoch;
    assert_eq!(epoch_b, epoch_a + 1);
    let refused = writer_a.begin_fenced(Some(&fence(&a, epoch_a))).await;
    assert!(
        matches!(refused, Err(StoreError::LeaseLost { .. })),
        "two engines committed: the former holder began a write after the lease changed hands: {refused:?}"
    );
    let mut write = writer_b
        .begin_fenced(Some(&fence(&b, epoch_b)))
        .await
        .unwrap();
    register(&mut write, &registering("by-b")).await.unwrap();
    write.commit("b's write").await.unwrap();
    let ids: Vec<String> = sqlx::query_scalar("SELECT id FROM devices ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(ids, ["by-a", "by-b"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instance_plans_on_the_status_the_engine_wrote() {
    let scenario = Scenario::start(ServerSettings {
        share_group: Some("follow-engine".to_owned()),
        max_attempts: 1,
        ..ServerSettings::default()
    })
    .await
    .unwrap();
    wait_owns(&scenario.server, "engine").await;
    let second = another_instance_with(
        &scenario,
        "follow-engine",
        ServerSettings {
            max_attempts: 1,
            ..ServerSettings::default()
        },
    )
    .await;
    let device = SimDevice::new(DeviceId::parse("stubborn-1").unwrap(), json!({"fw": "0"}))
        .with_behaviour(idem_device_sim::DeviceBehaviour::Reject {
            message: "no".into(),
        });
    scenario
        .register(std::slice::from_ref(&device), &json!({"fw": "1"}))
        .await
        .unwrap();
    let _fleet = scenario.start_fleet(vec![device]).await.unwrap();
    scenario
        .wait_reports_stored(1, Duration::from_secs(10))
        .await
        .unwrap();
    // The engine (the first instance's) quarantines it: one attempt only.
    let (_, run) = scenario.run_all(Duration::from_secs(15)).await.unwrap();
    assert_eq!(
        run["summary"], "0 already converged, 0 provisioned, 1 failed",
        "{run}"
    );
    // The second instance's plans are computed on its cache, which must
    // come to hold the status the engine wrote: the device is quarantined,
    // not converged on the spec it runs.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (status, plan) = second
            .post(
                "/v1/plans",
                &json!({"devices": ["stubborn-1"], "spec": {"fw": "0"}}),
            )
            .await
            .unwrap();
        assert_eq!(status, 201, "{plan}");
        if plan["counts"]["skipped_by_reason"]["quarantined"] == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the second instance still plans on a status older than the engine's: {plan}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exemptions_ended_through_an_instance_without_the_engine_bring_their_devices_up_to_date() {
    let scenario = Scenario::start(ServerSettings {
        share_group: Some("follow-exempt".to_owned()),
        ..ServerSettings::default()
    })
    .await
    .unwrap();
    wait_owns(&scenario.server, "engine").await;
    let devices: Vec<SimDevice> = ["ended-deleted", "ended-expired"]
        .iter()
        .map(|id| SimDevice::new(DeviceId::parse(id).unwrap(), json!({"fw": "1"})))
        .collect();
    scenario
        .register(&devices, &json!({"fw": "1"}))
        .await
        .unwrap();
    let fleet = scenario.start_fleet(devices).await.unwrap();
    scenario
        .wait_reports_stored(2, Duration::from_secs(10))
        .await
        .unwrap();
    let second = another_instance(&scenario, "follow-exempt").await;
    let (_, ready) = second.get("/readyz").await.unwrap();
    assert_eq!(ready["owns"], json!([]), "{ready}");

    let mut to_delete = String::new();
    for (id, expires_in) in [("ended-deleted", "1h"), ("ended-expired", "4s")] {
        let (status, created) = second
            .post(
                "/v1/exemptions",
                &json!({"device": id, "reason": "field test", "expires_in": expires_in}),
            )
            .await
            .unwrap();
        assert_eq!(status, 201, "{created}");
        if expires_in == "1h" {
            to_delete = created["id"].as_str().unwrap().to_owned();
        }
    }
    // The change is made through the second instance while both are exempt.
    let (status, body) = second
        .post(
            "/v1/desired",
            &json!({"devices": ["ended-deleted", "ended-expired"], "spec": {"fw": "2"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let run = second
        .wait_run_completed(body["run_id"].as_str().unwrap(), Duration::from_secs(15))
        .await
        .unwrap();
    assert_eq!(run["counts"]["skipped"], 2, "both exempt: {run}");
    let (status, answer) = second
        .delete(&format!("/v1/exemptions/{to_delete}"))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    for id in ["ended-deleted", "ended-expired"] {
        let device = DeviceId::parse(id).unwrap();
        wait_until(
            Duration::from_secs(20),
            &format!("{id} running generation 2 once its exemption ended"),
            || async { fleet.state(&device).unwrap().generation == Some(2) },
        )
        .await
        .unwrap();
        wait_device(&second, id, "converged and in sync", |status, body| {
            status == 200 && body["status"] == "converged" && body["in_sync"] == true
        })
        .await;
    }
}
