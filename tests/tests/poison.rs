//! End to end: no single message, request or client stops the fleet. Each
//! test sends one poison input that used to stall idem for every device (a
//! NUL in a spec, a packet over the MQTT client's limit, a `seq` of 2^63−1, a
//! spec the broker cannot carry, a database that refuses a row, …) and then
//! checks what matters: **every other device's reports keep being stored,
//! runs keep completing and the server stays ready** — for the queued poison
//! also after a restart.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_device_sim::{Fleet, FleetPlan, Plan};
use idem_protocol::{Channel, DeviceId};
use idem_tests::{PrivateMosquitto, Scenario, ServerSettings, TestServer};
use rumqttc::{AsyncClient, Event, Packet, QoS};
use serde_json::{json, Value};
use tokio::task::JoinHandle;

/// A raw MQTT client that publishes whatever a test hands it (any size) and
/// waits for the broker's PUBACK of each message.
struct Injector {
    client: AsyncClient,
    acked: Arc<AtomicUsize>,
    sent: usize,
    task: JoinHandle<()>,
}

impl Injector {
    async fn start(broker: &PrivateMosquitto) -> Injector {
        let mut options =
            broker.mqtt_options(format!("injector-{}", uuid::Uuid::new_v4().simple()));
        options.set_max_packet_size(8 << 20, 8 << 20);
        let (client, mut eventloop) = AsyncClient::new(options, 100);
        let acked = Arc::new(AtomicUsize::new(0));
        let counter = acked.clone();
        let task = tokio::spawn(async move {
            while let Ok(event) = eventloop.poll().await {
                if let Event::Incoming(Packet::PubAck(_)) = event {
                    counter.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        Injector {
            client,
            acked,
            sent: 0,
            task,
        }
    }

    /// Publishes with QoS 1 and returns once the broker acknowledged it.
    async fn publish(&mut self, topic: String, retain: bool, payload: Vec<u8>) {
        self.client
            .publish(topic, QoS::AtLeastOnce, retain, payload)
            .await
            .unwrap();
        self.sent += 1;
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.acked.load(Ordering::SeqCst) < self.sent {
            assert!(Instant::now() < deadline, "the broker never acknowledged");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for Injector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn now_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

fn reported(server: &TestServer, device: &str) -> String {
    server
        .topic_root
        .topic(&DeviceId::parse(device).unwrap(), Channel::Reported)
}

/// The poison of the NUL row: a NUL in the spec, with the largest `seq`.
fn nul_report() -> Vec<u8> {
    br#"{"seq":9223372036854775807,"spec":{"x":"\u0000"}}"#.to_vec()
}

/// A well-formed report of 1.1 MB: over what the MQTT client used to accept.
fn huge_report() -> Vec<u8> {
    format!(
        r#"{{"seq":5,"spec":{{"blob":"{}"}}}}"#,
        "x".repeat(1_100_000)
    )
    .into_bytes()
}

async fn metric(server: &TestServer, series: &str) -> f64 {
    server.metric(series).await.unwrap()
}

/// Waits until `series` reaches `at_least`.
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

async fn wait_metric(server: &TestServer, series: &str, at_least: f64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let value = metric(server, series).await;
        if value >= at_least {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{series} is {value}, expected at least {at_least}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn stored_seq(scenario_db: &sqlx::PgPool, id: &str) -> Option<i64> {
    sqlx::query_scalar("SELECT reported_seq FROM devices WHERE id = $1")
        .bind(id)
        .fetch_one(scenario_db)
        .await
        .unwrap()
}

/// What every poison test ends with: every device of `fleet` reports again
/// and each new report is stored; a run over the whole fleet completes with
/// every device already converged; `/readyz` says ready.
async fn assert_the_fleet_is_still_served(server: &TestServer, pool: &sqlx::PgPool, fleet: &Fleet) {
    for id in fleet.device_ids() {
        fleet.request_report(id).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    for device in fleet.states() {
        // The snapshot is read after the report was requested, so its seq
        // is at least the new report's (it may still be in flight).
        let want = fleet.state(&device.id).unwrap().seq;
        loop {
            let stored = stored_seq(pool, device.id.as_str()).await;
            if stored.is_some_and(|s| s as u64 >= want) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{}: stored seq {stored:?}, the device sent {want}",
                device.id
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let run_id = server.start_run(&json!({"all": true})).await.unwrap();
    let run = server
        .wait_run_completed(&run_id, Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(
        run["counts"]["already_converged"].as_u64(),
        Some(fleet.len() as u64),
        "{run}"
    );
    let (status, ready) = server.get("/readyz").await.unwrap();
    assert_eq!(status, 200, "{ready}");
}

async fn converged_fleet(scenario: &Scenario, prefix: &str, n: usize) -> (Plan, Fleet) {
    let plan = FleetPlan::new(prefix, n).build().unwrap();
    let fleet = scenario.register_and_start(&plan, n).await.unwrap();
    (plan, fleet)
}

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
async fn a_spec_over_the_budget_is_refused_by_every_endpoint_with_the_limit_named() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let (_, fleet) = converged_fleet(&scenario, "big-", 5).await;
    let server = &scenario.server;
    let huge = json!({"blob": "x".repeat(1_900_000)});

    let (status, body) = server
        .put(
            "/v1/devices/big-00000/desired",
            &json!({"spec": huge, "force": true}),
        )
        .await
        .unwrap();
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["error"]["code"], "spec_too_large");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("the limit is 65536 bytes"), "{message}");
    assert!(message.contains("IDEM_MAX_SPEC_BYTES"), "{message}");

    let just_over = json!({"blob": "x".repeat(65_536)});
    let (status, body) = server
        .post("/v1/desired", &json!({"all": true, "spec": just_over}))
        .await
        .unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (413, Some("spec_too_large")),
        "{body}"
    );
    let (status, body) = server
        .post(
            "/v1/devices",
            &json!([{"id": "big-new", "spec": just_over}]),
        )
        .await
        .unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (413, Some("spec_too_large")),
        "{body}"
    );

    assert_eq!(metric(server, "idem_mqtt_reconnects_total").await, 0.0);
    assert_eq!(metric(server, "idem_pushes_total").await, 0.0);
    assert_the_fleet_is_still_served(server, scenario.db.pool(), &fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_at_a_raised_budget_is_pushed_and_its_faithful_confirmation_accepted() {
    let settings = ServerSettings {
        max_spec_bytes: 128 * 1024,
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let (_, fleet) = converged_fleet(&scenario, "wide-", 3).await;
    let spec = json!({"blob": "y".repeat(70_000)});

    let (status, answer) = scenario
        .server
        .put("/v1/devices/wide-00001/desired", &json!({"spec": spec}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let run = scenario
        .server
        .wait_run_completed(answer["run_id"].as_str().unwrap(), Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(
        run["summary"], "0 already converged, 1 provisioned, 0 failed",
        "{run}"
    );
    let stored: Option<i32> = sqlx::query_scalar(
        "SELECT length(reported_spec->>'blob') FROM devices WHERE id = 'wide-00001'",
    )
    .fetch_one(scenario.db.pool())
    .await
    .unwrap();
    assert_eq!(stored, Some(70_000));
    assert_eq!(
        metric(
            &scenario.server,
            "idem_reports_rejected_total{reason=\"oversized\"}"
        )
        .await,
        0.0
    );
    drop(fleet);
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
async fn nul_in_specs_labels_and_query_text_gets_a_clear_error_without_database_text() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let (_, fleet) = converged_fleet(&scenario, "api-nul-", 3).await;
    let server = &scenario.server;
    let cases = [
        (
            server
                .put(
                    "/v1/devices/api-nul-00000/desired",
                    &json!({"spec": {"x": "a\u{0}"}}),
                )
                .await
                .unwrap(),
            "invalid_spec",
        ),
        (
            server
                .put(
                    "/v1/devices/api-nul-00000",
                    &json!({"labels": {"k": "v\u{0}"}}),
                )
                .await
                .unwrap(),
            "invalid_labels",
        ),
        (
            server
                .post(
                    "/v1/devices",
                    &json!([{"id": "api-nul-new", "labels": {"k\u{0}": "v"}}]),
                )
                .await
                .unwrap(),
            "invalid_labels",
        ),
        (
            server
                .post(
                    "/v1/desired",
                    &json!({"selector": {"labels": {"k": "\u{0}"}}, "spec": {}}),
                )
                .await
                .unwrap(),
            "invalid_labels",
        ),
        (
            server.get("/v1/devices?after=a%00b").await.unwrap(),
            "invalid_query",
        ),
        (
            server.get("/v1/devices?label=k:%00").await.unwrap(),
            "invalid_labels",
        ),
    ];
    for ((status, body), code) in cases {
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (400, Some(code)),
            "{body}"
        );
        let message = body["error"]["message"].as_str().unwrap().to_lowercase();
        for leak in ["sql", "postgres", "0x00", "invalid byte sequence"] {
            assert!(!message.contains(leak), "{message}");
        }
    }
    assert_the_fleet_is_still_served(server, scenario.db.pool(), &fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_are_capped_and_device_pages_stop_at_their_byte_bound() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let server = &scenario.server;
    let big_labels = json!({"k": "v".repeat(1_500_000)});
    let (status, body) = server
        .post(
            "/v1/devices",
            &json!([{"id": "label-1", "labels": big_labels}]),
        )
        .await
        .unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("invalid_labels")),
        "{body}"
    );
    assert!(
        body["error"]["message"].as_str().unwrap().contains("256"),
        "{body}"
    );

    // 100 devices with specs at the budget: ~6.4 MB of desired specs.
    let spec = json!({"blob": "z".repeat(64_000)});
    for chunk in 0..5 {
        let body: Vec<Value> = (chunk * 20..chunk * 20 + 20)
            .map(|i| json!({"id": format!("page-{i:03}"), "spec": spec}))
            .collect();
        let (status, answer) = server
            .post("/v1/devices", &Value::Array(body))
            .await
            .unwrap();
        assert_eq!(status, 200, "{answer}");
    }
    let mut after: Option<String> = None;
    let mut seen = 0;
    let mut pages = 0;
    loop {
        let path = match &after {
            Some(a) => format!("/v1/devices?limit=1000&after={a}"),
            None => "/v1/devices?limit=1000".to_owned(),
        };
        let (status, page) = server.get(&path).await.unwrap();
        assert_eq!(status, 200, "{page}");
        let size = page.to_string().len();
        assert!(size < 4 * 1024 * 1024 + 200_000, "a page of {size} bytes");
        seen += page["devices"].as_array().unwrap().len();
        pages += 1;
        match page["next_after"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(seen, 100);
    assert!(pages >= 2, "the byte bound must have split the list");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_manual_runs_while_one_is_in_progress_join_it() {
    let scenario = Scenario::start(ServerSettings {
        push_timeout: Duration::from_secs(3),
        ..ServerSettings::default()
    })
    .await
    .unwrap();
    // One silent device keeps every run open until its timeout.
    let plan = FleetPlan::new("join-", 50).silent(1).build().unwrap();
    let _fleet = scenario.register_and_start(&plan, 49).await.unwrap();
    let server = &scenario.server;

    let mut ids = std::collections::BTreeSet::new();
    for _ in 0..20 {
        let (status, answer) = server
            .post("/v1/runs", &json!({"all": true}))
            .await
            .unwrap();
        assert_eq!(status, 200, "{answer}");
        ids.insert(answer["run_id"].as_str().unwrap().to_owned());
    }
    assert_eq!(ids.len(), 1, "20 identical calls made {} runs", ids.len());
    let (_, forced) = server
        .post("/v1/runs", &json!({"all": true, "force": true}))
        .await
        .unwrap();
    assert_eq!(
        forced["joined"], false,
        "a forced run is another run: {forced}"
    );
    let targets: i64 = sqlx::query_scalar("SELECT count(*) FROM run_targets")
        .fetch_one(scenario.db.pool())
        .await
        .unwrap();
    assert_eq!(targets, 100, "two runs of 50 targets");
    let run_id = ids.into_iter().next().unwrap();
    let run = server
        .wait_run_completed(&run_id, Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(run["counts"]["failed"], 1, "{run}");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_and_greedy_event_streams_do_not_stop_the_fleet() {
    idem_tests::raise_fd_limit().unwrap();
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let (_, fleet) = converged_fleet(&scenario, "greedy-", 20).await;
    // A log worth replaying: 20,000 events of about 1 KB.
    scenario.append_events(20_000, 1_000).await.unwrap();
    // 1,100 connections that never send a request ...
    let mut idle = Vec::with_capacity(1_100);
    for _ in 0..1_100 {
        idle.push(
            tokio::net::TcpStream::connect(scenario.server.addr)
                .await
                .unwrap(),
        );
    }
    // ... and 20 event streams replaying everything, none of them reading.
    let mut streams = Vec::new();
    for _ in 0..20 {
        streams.push(
            idem_tests::StalledSseClient::open(
                scenario.server.addr,
                "/v1/events?after=0",
                scenario.server.token(),
            )
            .await
            .unwrap(),
        );
    }
    let started = Instant::now();
    let (status, _) = scenario.server.get("/healthz").await.unwrap();
    assert_eq!(status, 200);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert_the_fleet_is_still_served(&scenario.server, scenario.db.pool(), &fleet).await;
    drop(streams);
    drop(idle);
}
