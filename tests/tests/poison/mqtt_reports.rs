//! Poison sent as device messages: a NUL in a spec, a report over the old
//! client limit, poison queued while the server was down, a `seq` far
//! ahead, and reports in shapes the protocol refuses or tolerates.

use std::time::{Duration, Instant};

use idem_device_sim::{Fleet, FleetPlan};
use idem_protocol::{Channel, DeviceId};
use idem_tests::{PrivateMosquitto, Scenario, ServerSettings, TestServer};
use serde_json::{json, Value};

use crate::{
    assert_the_fleet_is_still_served, converged_fleet, huge_report, metric, nul_report, reported,
    stored_seq, wait_metric, Injector,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_with_a_nul_in_its_spec_is_refused_while_every_other_device_is_stored() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let (_, fleet) = converged_fleet(&scenario, "nul-", 20).await;
    let mut injector = Injector::start(&scenario.broker).await;
    let victim = "nul-00003";
    let before = stored_seq(scenario.db.pool(), victim).await;

    injector
        .publish(reported(&scenario.server, victim), false, nul_report())
        .await;
    wait_metric(
        &scenario.server,
        "idem_reports_rejected_total{reason=\"nul_character\"}",
        1.0,
    )
    .await;

    assert_eq!(stored_seq(scenario.db.pool(), victim).await, before);
    assert_the_fleet_is_still_served(&scenario.server, scenario.db.pool(), &fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_over_the_old_client_limit_is_counted_without_dropping_the_connection() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let (_, fleet) = converged_fleet(&scenario, "huge-", 20).await;
    let mut injector = Injector::start(&scenario.broker).await;

    injector
        .publish(
            reported(&scenario.server, "huge-00001"),
            false,
            huge_report(),
        )
        .await;
    wait_metric(
        &scenario.server,
        "idem_reports_rejected_total{reason=\"oversized\"}",
        1.0,
    )
    .await;

    assert_eq!(
        metric(&scenario.server, "idem_mqtt_reconnects_total").await,
        0.0
    );
    assert_eq!(metric(&scenario.server, "idem_mqtt_connected").await, 1.0);
    assert_the_fleet_is_still_served(&scenario.server, scenario.db.pool(), &fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_queued_while_the_server_is_down_is_refused_after_restart_and_never_redelivered() {
    let settings = ServerSettings::default();
    let Scenario { server, db, broker } = Scenario::start(settings.clone()).await.unwrap();
    let plan = FleetPlan::new("queued-", 10).build().unwrap();
    let body: Vec<Value> = plan
        .devices
        .iter()
        .map(|d| json!({"id": d.id, "spec": plan.desired_spec}))
        .collect();
    let (status, answer) = server
        .post("/v1/devices", &Value::Array(body))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let root = server.topic_root.to_string();
    let instance = server.instance.clone();
    let victim = reported(&server, "queued-00000");
    let other = reported(&server, "queued-00001");
    server.stop().await.unwrap();

    // The server's persistent session queues these on the broker.
    let mut injector = Injector::start(&broker).await;
    injector.publish(victim.clone(), false, nul_report()).await;
    injector.publish(victim, false, huge_report()).await;
    injector
        .publish(
            other,
            false,
            json!({"seq": 42, "spec": plan.desired_spec})
                .to_string()
                .into_bytes(),
        )
        .await;

    let again = ServerSettings {
        topic_root: Some(root.clone()),
        instance: Some(instance.clone()),
        ..settings.clone()
    };
    let server = TestServer::start(&db, &broker, again.clone())
        .await
        .unwrap();
    wait_metric(
        &server,
        "idem_reports_rejected_total{reason=\"nul_character\"}",
        1.0,
    )
    .await;
    wait_metric(
        &server,
        "idem_reports_rejected_total{reason=\"oversized\"}",
        1.0,
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while stored_seq(db.pool(), "queued-00001").await != Some(42) {
        assert!(
            Instant::now() < deadline,
            "the good queued report was never stored"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(metric(&server, "idem_mqtt_reconnects_total").await, 0.0);
    let fleet = {
        let scenario_like = (&server, &broker);
        start_fleet_on(scenario_like.0, scenario_like.1, plan.devices.clone()).await
    };
    assert_the_fleet_is_still_served(&server, db.pool(), &fleet).await;
    server.stop().await.unwrap();

    // The poison was acknowledged: a third process is not sent it again.
    // The broker sends a resumed session's unacknowledged messages before
    // anything newer, so once a report published now is stored, any
    // redelivered poison would already have been counted.
    let server = TestServer::start(&db, &broker, again).await.unwrap();
    let marker = stored_seq(db.pool(), "queued-00001").await.unwrap() + 1;
    injector
        .publish(
            reported(&server, "queued-00001"),
            false,
            json!({"seq": marker, "spec": plan.desired_spec})
                .to_string()
                .into_bytes(),
        )
        .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while stored_seq(db.pool(), "queued-00001").await != Some(marker) {
        assert!(
            Instant::now() < deadline,
            "a report published after the restart was never stored"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for reason in ["nul_character", "oversized"] {
        let series = format!("idem_reports_rejected_total{{reason=\"{reason}\"}}");
        assert_eq!(metric(&server, &series).await, 0.0, "{reason} redelivered");
    }
    assert_the_fleet_is_still_served(&server, db.pool(), &fleet).await;
}

async fn start_fleet_on(
    server: &TestServer,
    broker: &PrivateMosquitto,
    devices: Vec<idem_device_sim::SimDevice>,
) -> Fleet {
    let n = devices.len();
    let config = idem_device_sim::FleetConfig::new(
        idem_device_sim::BrokerAddr::new(broker.host(), broker.port()),
        server.topic_root.clone(),
        devices,
    );
    let fleet = Fleet::start(config).unwrap();
    fleet
        .wait_connected(n, Duration::from_secs(30))
        .await
        .unwrap();
    fleet
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seq_far_ahead_is_refused_and_a_reset_lets_a_rewound_counter_report_again() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let (plan, fleet) = converged_fleet(&scenario, "seq-", 5).await;
    let mut injector = Injector::start(&scenario.broker).await;
    let server = &scenario.server;
    let victim = "seq-00002";

    let poison = json!({"seq": 9_223_372_036_854_775_807_u64, "spec": plan.desired_spec});
    injector
        .publish(
            reported(server, victim),
            false,
            poison.to_string().into_bytes(),
        )
        .await;
    wait_metric(
        server,
        "idem_reports_rejected_total{reason=\"seq_out_of_range\"}",
        1.0,
    )
    .await;
    // The device's own later reports are still stored.
    assert_the_fleet_is_still_served(server, scenario.db.pool(), &fleet).await;

    // A device whose counter went backwards (a factory reset without a
    // clock) is stale until an operator resets its reported state.
    let rewound = json!({"seq": 7, "spec": {"fw": "factory"}});
    injector
        .publish(
            reported(server, victim),
            false,
            rewound.to_string().into_bytes(),
        )
        .await;
    wait_metric(server, "idem_reports_total{result=\"stale\"}", 1.0).await;
    assert_ne!(stored_seq(scenario.db.pool(), victim).await, Some(7));

    let (status, device) = server
        .delete(&format!("/v1/devices/{victim}/reported"))
        .await
        .unwrap();
    assert_eq!(status, 200, "{device}");
    assert_eq!(device["reported"], Value::Null, "{device}");
    injector
        .publish(
            reported(server, victim),
            false,
            rewound.to_string().into_bytes(),
        )
        .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while stored_seq(scenario.db.pool(), victim).await != Some(7) {
        assert!(
            Instant::now() < deadline,
            "the report after the reset was not stored"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_in_unusual_shapes_are_handled_as_the_protocol_says() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let (plan, fleet) = converged_fleet(&scenario, "shape-", 5).await;
    let mut injector = Injector::start(&scenario.broker).await;
    let server = &scenario.server;

    // A JSON array whose items would fit the fields in order: refused.
    let array = json!([9_000_000_000_000_000_u64, null, plan.desired_spec]);
    injector
        .publish(
            reported(server, "shape-00000"),
            false,
            array.to_string().into_bytes(),
        )
        .await;
    wait_metric(
        server,
        "idem_reports_rejected_total{reason=\"malformed\"}",
        1.0,
    )
    .await;
    assert_ne!(
        stored_seq(scenario.db.pool(), "shape-00000").await,
        Some(9_000_000_000_000_000)
    );

    // An unknown health word keeps the report, health unknown, counted.
    let seq = fleet
        .state(&DeviceId::parse("shape-00001").unwrap())
        .unwrap()
        .seq
        + 1_000;
    let shouting = json!({"seq": seq, "spec": {"fw": "new"}, "health": "HEALTHY"});
    injector
        .publish(
            reported(server, "shape-00001"),
            false,
            shouting.to_string().into_bytes(),
        )
        .await;
    wait_metric(server, "idem_reports_health_unknown_total", 1.0).await;
    // The counter moves when the report is read, the row when its batch
    // commits: wait for the row.
    let device = device_with_seq(server, "shape-00001", seq).await;
    assert_eq!(device["reported"]["seq"], seq, "{device}");
    assert_eq!(device["reported"]["spec"], json!({"fw": "new"}), "{device}");
    assert_eq!(device["reported"]["health"], "unknown", "{device}");

    // The id `events` would put a device's topics inside `{root}/events/#`.
    let (status, body) = server
        .post("/v1/devices", &json!([{"id": "events"}]))
        .await
        .unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("invalid_device_id")),
        "{body}"
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("reserved"),
        "{body}"
    );
    // A refused status message is not counted as a refused report.
    let status_topic = server
        .topic_root
        .topic(&DeviceId::parse("shape-00002").unwrap(), Channel::Status);
    let rejected_reports = metric(server, "idem_reports_total{result=\"rejected\"}").await;
    injector
        .publish(status_topic, false, b"maybe".to_vec())
        .await;
    wait_metric(
        server,
        "idem_reports_rejected_total{reason=\"invalid_status\"}",
        1.0,
    )
    .await;
    assert_eq!(
        metric(server, "idem_reports_total{result=\"rejected\"}").await,
        rejected_reports
    );
}

/// The device as the API shows it once its stored report has `seq` (or
/// after 10 s, for the caller's assertion to say what it holds).
async fn device_with_seq(server: &TestServer, id: &str, seq: u64) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, device) = server.get(&format!("/v1/devices/{id}")).await.unwrap();
        if device["reported"]["seq"] == seq || tokio::time::Instant::now() >= deadline {
            return device;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_label_value_of_the_metrics_comes_from_a_device_however_it_reports() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let server = &scenario.server;
    let before = label_sets(&server.metrics().await.unwrap());
    assert!(
        before.iter().any(|series| series.contains('{')),
        "no labelled series before any device: {before:?}"
    );

    let plan = FleetPlan::new("labelled-", 6)
        .drifted(2)
        .rejecting(1)
        .seed(47)
        .build()
        .unwrap();
    let fleet = scenario.register_and_start(&plan, 6).await.unwrap();
    scenario.run_all(Duration::from_secs(30)).await.unwrap();
    let mut injector = Injector::start(&scenario.broker).await;
    // Refused for each reason a device can cause, on its own topics and on
    // those of ids nobody registered.
    let refused: [(&str, Vec<u8>); 4] = [
        ("labelled-00000", nul_report()),
        ("labelled-00001", b"{not json".to_vec()),
        (
            "labelled-never-registered",
            br#"{"seq":1,"spec":{}}"#.to_vec(),
        ),
        ("labelled-00002", huge_report()),
    ];
    for (device, payload) in refused {
        injector
            .publish(reported(server, device), false, payload)
            .await;
    }
    let unknown_channel = format!("{}/labelled-00003/sideways", server.topic_root);
    injector
        .publish(unknown_channel, false, b"{}".to_vec())
        .await;
    wait_metric(
        server,
        "idem_reports_rejected_total{reason=\"unknown_device\"}",
        1.0,
    )
    .await;
    wait_metric(
        server,
        "idem_reports_rejected_total{reason=\"oversized\"}",
        1.0,
    )
    .await;

    let exposition = server.metrics().await.unwrap();
    let after = label_sets(&exposition);
    let new: Vec<&String> = after.difference(&before).collect();
    assert_eq!(
        new,
        Vec::<&String>::new(),
        "series that appeared once devices reported (every label value must come from a fixed table)"
    );
    assert!(
        !exposition.contains("labelled-"),
        "a device id in /metrics:\n{exposition}"
    );
    fleet.shutdown().await.unwrap();
}

/// Every series of a Prometheus exposition, as its name and labels
/// (`name{label="value",…}`), without values or comments.
fn label_sets(exposition: &str) -> std::collections::BTreeSet<String> {
    exposition
        .lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .filter_map(|line| line.rsplit_once(' ').map(|(series, _)| series.to_owned()))
        .collect()
}
