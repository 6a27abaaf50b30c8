//! End to end: outcome events reach SSE clients (resumable, gap-free) and
//! MQTT subscribers (one valid CloudEvent per device per run), only once the
//! outcomes they report are committed, and the Prometheus counters agree with
//! the run.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use cloudevents::AttributesReader;
use idem_device_sim::{FleetPlan, OfflineMode};
use idem_protocol::event::EventType;
use idem_protocol::OutcomeKind;
use idem_tests::{Scenario, ServerSettings, SseMessage};
use rumqttc::{AsyncClient, Event, Packet, QoS};
use serde_json::{json, Value};

/// The harness's SSE reader, failing the test on any error.
struct SseClient(idem_tests::SseClient);

impl SseClient {
    async fn connect(scenario: &Scenario, url: &str, last_event_id: Option<i64>) -> Self {
        Self(
            idem_tests::SseClient::connect(url, scenario.server.token(), last_event_id)
                .await
                .unwrap(),
        )
    }

    /// The next message that carries data (keep-alive comments are skipped).
    async fn next(&mut self) -> SseMessage {
        self.0
            .next_within(Duration::from_secs(20))
            .await
            .unwrap()
            .expect("SSE stream ended")
    }
}

/// Whether `message` is the `io.idem.run.completed` event of `run_id`.
fn completes_run(message: &SseMessage, run_id: &str) -> bool {
    let event: Value = serde_json::from_str(&message.data).unwrap();
    event["type"] == "io.idem.run.completed" && event["runid"] == run_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sse_client_that_reconnects_with_last_event_id_misses_nothing_and_sees_nothing_twice() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("sse-", 200)
        .drifted(10)
        .seed(11)
        .build()
        .unwrap();
    let fleet = scenario.register_and_start(&plan, 200).await.unwrap();
    let url = scenario.server.url("/v1/events");

    let mut first = SseClient::connect(&scenario, &url, None).await;
    let (run_id, run) = scenario.run_all(Duration::from_secs(30)).await.unwrap();
    assert_eq!(
        run["summary"],
        "190 already converged, 10 provisioned, 0 failed"
    );

    // Read 37 events, then drop the connection.
    let mut ids = Vec::new();
    for _ in 0..37 {
        ids.push(first.next().await.id.unwrap());
    }
    drop(first);
    let k = *ids.last().unwrap();

    let mut second = SseClient::connect(&scenario, &url, Some(k)).await;
    let rest = second
        .0
        .read_until(
            Duration::from_secs(30),
            &format!("the run.completed event of run {run_id}"),
            |message| completes_run(message, &run_id),
        )
        .await
        .unwrap();
    ids.extend(rest.iter().map(|message| message.id.unwrap()));
    // run.started + 200 outcomes + run.completed, consecutive, each once.
    assert_eq!(ids.len(), 202, "{ids:?}");
    let first_id = ids[0];
    let expected: Vec<i64> = (first_id..first_id + 202).collect();
    assert_eq!(ids, expected);
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_older_than_the_retained_log_gets_a_reset_event_first() {
    use idem_server::store::events::{last_sequence, oldest_sequence, prune};
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("reset-", 5)
        .drifted(2)
        .seed(3)
        .build()
        .unwrap();
    let fleet = scenario.register_and_start(&plan, 5).await.unwrap();
    scenario.run_all(Duration::from_secs(30)).await.unwrap();
    let pool = scenario.db.pool();
    // The three converged outcomes are one slice of the log.
    let (slice_first, slice_last): (i64, i64) =
        sqlx::query_as("SELECT first_sequence, last_sequence FROM converged_event_slices")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(slice_last - slice_first, 2);
    let last = last_sequence(pool).await.unwrap();
    let week = std::time::Duration::from_secs(7 * 86_400);
    // Retention whose line falls inside the slice keeps it whole.
    prune(pool, last, week, last - (slice_last - 1))
        .await
        .unwrap();
    assert_eq!(oldest_sequence(pool).await.unwrap(), Some(slice_first));
    // Retention whose line is the slice's last event takes it.
    prune(pool, last, week, last - slice_last).await.unwrap();
    assert_eq!(oldest_sequence(pool).await.unwrap(), Some(slice_last + 1));

    let mut client =
        SseClient::connect(&scenario, &scenario.server.url("/v1/events"), Some(1)).await;
    let reset = client.next().await;
    assert_eq!(reset.event.as_deref(), Some("reset"));
    let body: Value = serde_json::from_str(&reset.data).unwrap();
    assert_eq!(body["resuming_from"], slice_last + 1);
    assert_eq!(client.next().await.id, Some(slice_last + 1));
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mqtt_subscriber_gets_one_valid_cloudevent_per_device_and_metrics_match_the_run() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("mqtt-ev-", 60)
        .drifted(6)
        .seed(5)
        .build()
        .unwrap();
    let root = scenario.server.topic_root.clone();

    let (client, mut eventloop) =
        AsyncClient::new(scenario.broker.mqtt_options("event-watcher"), 100);
    client
        .subscribe(root.events_filter(), QoS::AtLeastOnce)
        .await
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let pump = tokio::spawn(async move {
        while let Ok(event) = eventloop.poll().await {
            match event {
                Event::Incoming(Packet::Publish(p)) => {
                    let _ = tx.send((p.topic.clone(), p.payload.to_vec()));
                }
                Event::Incoming(Packet::SubAck(_)) => {
                    let _ = tx.send((String::new(), Vec::new()));
                }
                Event::Incoming(_) | Event::Outgoing(_) => {}
            }
        }
    });
    assert_eq!(rx.recv().await.unwrap().0, "", "expected the SUBACK first");

    let fleet = scenario.register_and_start(&plan, 60).await.unwrap();
    let (run_id, run) = scenario.run_all(Duration::from_secs(30)).await.unwrap();
    assert_eq!(
        run["summary"],
        "54 already converged, 6 provisioned, 0 failed"
    );

    let mut per_device: HashMap<String, Vec<String>> = HashMap::new();
    let mut run_events = BTreeMap::new();
    loop {
        let (topic, payload) = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .unwrap()
            .unwrap();
        let event: cloudevents::Event = serde_json::from_slice(&payload).unwrap();
        assert_eq!(
            topic,
            root.event_topic(event.ty(), event.subject().unwrap())
        );
        assert_eq!(
            event.source().to_string(),
            format!("/idem/{}", scenario.server.instance)
        );
        let ty = event.ty().to_owned();
        if ty.starts_with("io.idem.run.") {
            *run_events.entry(ty.clone()).or_insert(0) += 1;
            if ty == "io.idem.run.completed" {
                break;
            }
        } else {
            per_device
                .entry(event.subject().unwrap().to_owned())
                .or_default()
                .push(ty);
        }
    }
    assert_eq!(run_events.get("io.idem.run.started"), Some(&1));
    assert_eq!(per_device.len(), 60);
    let mut by_type: BTreeMap<String, usize> = BTreeMap::new();
    for (device, types) in &per_device {
        assert_eq!(types.len(), 1, "{device} got {types:?}");
        *by_type.entry(types[0].clone()).or_insert(0) += 1;
    }
    assert_eq!(by_type.get("io.idem.device.already_converged"), Some(&54));
    assert_eq!(by_type.get("io.idem.device.provisioned"), Some(&6));

    let m = |s: &'static str| {
        let server = &scenario.server;
        async move { server.metric(s).await.unwrap() }
    };
    assert_eq!(
        m("idem_device_outcomes_total{outcome=\"already_converged\"}").await,
        54.0
    );
    assert_eq!(
        m("idem_device_outcomes_total{outcome=\"provisioned\"}").await,
        6.0
    );
    assert_eq!(
        m("idem_device_outcomes_total{outcome=\"failed\"}").await,
        0.0
    );
    assert_eq!(
        m("idem_last_run_devices{outcome=\"already_converged\"}").await,
        54.0
    );
    assert_eq!(m("idem_pushes_total").await, 6.0);
    let _ = run_id;
    pump.abort();
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_filters_by_type_device_and_run() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("filter-", 20)
        .drifted(3)
        .seed(2)
        .build()
        .unwrap();
    let fleet = scenario.register_and_start(&plan, 20).await.unwrap();
    let (first_run, _) = scenario.run_all(Duration::from_secs(30)).await.unwrap();
    let (second_run, _) = scenario.run_all(Duration::from_secs(30)).await.unwrap();
    let base = scenario.server.url("/v1/events");

    let mut provisioned = SseClient::connect(
        &scenario,
        &format!("{base}?after=0&type=io.idem.device.provisioned"),
        None,
    )
    .await;
    for _ in 0..3 {
        let event: Value = serde_json::from_str(&provisioned.next().await.data).unwrap();
        assert_eq!(event["type"], "io.idem.device.provisioned");
        assert_eq!(event["runid"], first_run.as_str());
    }

    let device = plan.devices[7].id.as_str();
    let mut one_device =
        SseClient::connect(&scenario, &format!("{base}?after=0&device={device}"), None).await;
    for run in [&first_run, &second_run] {
        let event: Value = serde_json::from_str(&one_device.next().await.data).unwrap();
        assert_eq!(event["subject"], device);
        assert_eq!(event["runid"], run.as_str());
    }

    let mut second =
        SseClient::connect(&scenario, &format!("{base}?after=0&run={second_run}"), None).await;
    let started: Value = serde_json::from_str(&second.next().await.data).unwrap();
    assert_eq!(started["type"], "io.idem.run.started");
    for _ in 0..20 {
        let event: Value = serde_json::from_str(&second.next().await.data).unwrap();
        assert_eq!(event["type"], "io.idem.device.already_converged");
        assert_eq!(event["runid"], second_run.as_str());
    }
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcome_events_appear_only_once_the_outcomes_they_report_are_committed() {
    let scenario = Scenario::start(ServerSettings {
        stuck_after: Duration::from_millis(500),
        ..ServerSettings::default()
    })
    .await
    .unwrap();
    let plan = FleetPlan::new("commit-", 5).build().unwrap();
    let fleet = scenario.register_and_start(&plan, 5).await.unwrap();
    let pool = scenario.db.pool();
    // Offline: their outcome (skipped) is the engine's to decide; a
    // converged device would be decided in the transaction that creates
    // the run.
    for device in &plan.devices {
        fleet.take_offline(&device.id, OfflineMode::Clean).unwrap();
    }
    scenario
        .wait_offline(5, Duration::from_secs(20))
        .await
        .unwrap();

    // Another client holds every device row: the engine's write (which
    // updates them) waits, while the run itself (manual, no spec, targets
    // referencing the rows, nothing decided at creation) still commits.
    let mut blocker = pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM devices FOR NO KEY UPDATE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let run_id = scenario
        .server
        .start_run(&json!({"all": true}))
        .await
        .unwrap();
    // The engine has decided the five outcomes and waits to commit them.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = scenario.server.get("/readyz").await.unwrap();
        if status == 503 && body["stuck"]["engine"].is_string() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the engine's outcome write never waited: {body}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let decided: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM run_outcomes WHERE run_id = $1::uuid AND outcome IS NOT NULL",
    )
    .bind(&run_id)
    .fetch_one(pool)
    .await
    .unwrap();
    let logged: Vec<String> =
        sqlx::query_scalar("SELECT type FROM event_log WHERE run_id = $1::uuid ORDER BY sequence")
            .bind(&run_id)
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(decided, 0, "outcomes committed while the write was held");
    assert_eq!(
        logged,
        vec!["io.idem.run.started"],
        "events in the log (and so on SSE and MQTT) before the outcomes they report were committed"
    );

    blocker.rollback().await.unwrap();
    let run = scenario
        .server
        .wait_run_completed(&run_id, Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(
        run["summary"],
        "0 already converged, 0 provisioned, 0 failed, 5 skipped"
    );
    // Each device event now stands next to the committed outcome it reports.
    let reported: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT e.type, t.outcome FROM event_log e \
         LEFT JOIN run_outcomes t ON t.run_id = e.run_id AND t.device_id = e.subject \
         WHERE e.run_id = $1::uuid AND e.type LIKE 'io.idem.device.%' ORDER BY e.sequence",
    )
    .bind(&run_id)
    .fetch_all(pool)
    .await
    .unwrap();
    let reported: Vec<(Option<EventType>, Option<OutcomeKind>)> = reported
        .iter()
        .map(|(ty, outcome)| {
            (
                EventType::parse(ty),
                outcome.as_deref().and_then(OutcomeKind::parse),
            )
        })
        .collect();
    let expected = (
        Some(EventType::Device(OutcomeKind::Skipped)),
        Some(OutcomeKind::Skipped),
    );
    assert_eq!(reported, vec![expected; 5]);
    fleet.shutdown().await.unwrap();
}

/// Subscribes to every event topic of `root` and collects CloudEvent ids
/// (the sequence) as they arrive, with how often each came.
async fn event_witness(
    scenario: &Scenario,
    root: &idem_protocol::TopicRoot,
) -> (
    std::sync::Arc<std::sync::Mutex<BTreeMap<i64, usize>>>,
    tokio::task::JoinHandle<()>,
) {
    let (client, mut eventloop) = AsyncClient::new(
        scenario
            .broker
            .mqtt_options(format!("relay-witness-{}", uuid::Uuid::new_v4().simple())),
        100,
    );
    client
        .subscribe(root.events_filter(), QoS::AtLeastOnce)
        .await
        .unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(BTreeMap::new()));
    let (subscribed_tx, subscribed) = tokio::sync::oneshot::channel();
    let mut subscribed_tx = Some(subscribed_tx);
    let tally = seen.clone();
    let pump = tokio::spawn(async move {
        let _client = client;
        while let Ok(event) = eventloop.poll().await {
            match event {
                Event::Incoming(Packet::Publish(p)) => {
                    let event: Value = serde_json::from_slice(&p.payload).unwrap();
                    let id: i64 = event["id"].as_str().unwrap().parse().unwrap();
                    *tally.lock().unwrap().entry(id).or_insert(0) += 1;
                }
                Event::Incoming(Packet::SubAck(_)) => {
                    if let Some(tx) = subscribed_tx.take() {
                        let _ = tx.send(());
                    }
                }
                Event::Incoming(_) | Event::Outgoing(_) => {}
            }
        }
    });
    subscribed.await.unwrap();
    (seen, pump)
}

/// Waits until the witness saw every id in `ids`, then half a second more
/// than a second relay's poll would take; returns what it saw.
async fn seen_after(
    seen: &std::sync::Mutex<BTreeMap<i64, usize>>,
    ids: std::ops::RangeInclusive<i64>,
) -> BTreeMap<i64, usize> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ids.clone().all(|id| seen.lock().unwrap().contains_key(&id)) {
        assert!(
            Instant::now() < deadline,
            "events {ids:?} did not all reach MQTT within 20 s: {:?}",
            seen.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    seen.lock().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_database_publish_each_event_once_and_the_survivor_takes_over_the_relay(
) {
    let mut scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let root = scenario.server.topic_root.clone();
    let second = idem_tests::TestServer::start(
        &scenario.db,
        &scenario.broker,
        ServerSettings {
            topic_root: Some(root.to_string()),
            ..ServerSettings::default()
        },
    )
    .await
    .unwrap();
    let (seen, pump) = event_witness(&scenario, &root).await;
    // The first one took the relay lease at its start; `/readyz` says so.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, first_ready) = scenario.server.get("/readyz").await.unwrap();
        if first_ready["owns"]
            .as_array()
            .is_some_and(|owns| owns.contains(&json!("relay")))
        {
            break;
        }
        assert!(Instant::now() < deadline, "{first_ready}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, second_ready) = second.get("/readyz").await.unwrap();
    assert_eq!(second_ready["owns"], json!([]), "{second_ready}");

    let last = scenario.append_events(50, 0).await.unwrap();
    let first = last - 49;
    let got = seen_after(&seen, first..=last).await;
    let repeated: Vec<_> = got.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        repeated.is_empty(),
        "with two instances, events reached MQTT more than once (id → times): {repeated:?}"
    );

    // The first instance stops (releasing the lease); the second relays
    // what is committed next, from the shared cursor: once, none skipped.
    let first_server = std::mem::replace(&mut scenario.server, second);
    first_server.stop().await.unwrap();
    let last_after = scenario.append_events(50, 0).await.unwrap();
    let got = seen_after(&seen, first..=last_after).await;
    assert_eq!(
        got.keys().copied().collect::<Vec<_>>(),
        (first..=last_after).collect::<Vec<_>>(),
        "the survivor skipped events or published foreign ones"
    );
    let repeated: Vec<_> = got.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        repeated.is_empty(),
        "after the takeover, events reached MQTT more than once: {repeated:?}"
    );
    let (_, ready) = scenario.server.get("/readyz").await.unwrap();
    assert_eq!(ready["owns"], json!(["engine", "relay"]), "{ready}");
    let (status, cluster) = scenario.server.get("/v1/cluster").await.unwrap();
    assert_eq!(status, 200, "{cluster}");
    assert_eq!(
        cluster["instances"].as_array().unwrap().len(),
        1,
        "{cluster}"
    );
    let relay = &cluster["leases"][1];
    assert_eq!(relay["name"], "relay", "{cluster}");
    assert_eq!(
        relay["holder"],
        scenario.server.instance.as_str(),
        "{cluster}"
    );
    assert_eq!(relay["live"], true, "{cluster}");
    assert_eq!(relay["epoch"], 2, "the lease changed hands once: {cluster}");
    pump.abort();
}

/// A process asking for a lease as instance `instance`, with a 10 s lease.
fn lease_holder(instance: &str) -> idem_server::store::leases::LeaseHolder {
    idem_server::store::leases::LeaseHolder {
        instance: instance.to_owned(),
        id: uuid::Uuid::new_v4(),
        ttl: Duration::from_secs(10),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_lease_expired_and_changed_hands_cannot_move_the_shared_cursor() {
    use idem_server::store::events::{load_cursor, save_cursor_fenced};
    use idem_server::store::leases::acquire_or_renew;
    let db = idem_tests::TestDatabase::create_with(&idem_server::MIGRATOR)
        .await
        .unwrap();
    let pool = db.pool();
    let holder = lease_holder;
    let (a, b) = (holder("a"), holder("b"));
    let held_by_a = acquire_or_renew(pool, "relay", &a).await.unwrap().unwrap();
    assert!(
        acquire_or_renew(pool, "relay", &b).await.unwrap().is_none(),
        "b took a running lease"
    );
    assert!(
        save_cursor_fenced(pool, "relay", 10, "relay", a.id, held_by_a.epoch)
            .await
            .unwrap()
    );
    // a is paused past its lease; b takes the lease over.
    sqlx::query("UPDATE leases SET renewed_at = now() - interval '11 seconds'")
        .execute(pool)
        .await
        .unwrap();
    let held_by_b = acquire_or_renew(pool, "relay", &b).await.unwrap().unwrap();
    assert_eq!(held_by_b.epoch, held_by_a.epoch + 1);
    // a wakes up and saves: refused, the cursor stays where it was.
    assert!(
        !save_cursor_fenced(pool, "relay", 20, "relay", a.id, held_by_a.epoch)
            .await
            .unwrap()
    );
    assert_eq!(load_cursor(pool, "relay").await.unwrap(), Some(10));
    assert!(
        acquire_or_renew(pool, "relay", &a).await.unwrap().is_none(),
        "a took b's running lease back"
    );
    assert!(
        save_cursor_fenced(pool, "relay", 20, "relay", b.id, held_by_b.epoch)
            .await
            .unwrap()
    );
    assert_eq!(load_cursor(pool, "relay").await.unwrap(), Some(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_lease_held_by_a_dead_predecessor_of_the_same_name_or_released_is_taken_at_once() {
    use idem_server::store::leases::acquire_or_renew;
    let db = idem_tests::TestDatabase::create_with(&idem_server::MIGRATOR)
        .await
        .unwrap();
    let pool = db.pool();
    let process = lease_holder;
    let before_crash = acquire_or_renew(pool, "relay", &process("idem-1"))
        .await
        .unwrap()
        .unwrap();
    assert!(acquire_or_renew(pool, "relay", &process("idem-2"))
        .await
        .unwrap()
        .is_none());
    let after_restart = acquire_or_renew(pool, "relay", &process("idem-1"))
        .await
        .unwrap()
        .expect("the restarted idem-1 waits out its own dead predecessor's lease");
    assert_eq!(after_restart.epoch, before_crash.epoch + 1);

    // A graceful stop releases it: free at once for another instance, and
    // listed (by `GET /v1/cluster`) as released, not as an error.
    let restarted = process("idem-1");
    let held = acquire_or_renew(pool, "relay", &restarted)
        .await
        .unwrap()
        .unwrap();
    idem_server::store::leases::release(pool, "relay", restarted.id)
        .await
        .unwrap();
    let listed = idem_server::store::leases::all(pool).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].renewed_age_secs, None, "{listed:?}");
    let other = acquire_or_renew(pool, "relay", &process("idem-2"))
        .await
        .unwrap()
        .expect("a released lease is free at once");
    assert_eq!(other.epoch, held.epoch + 1);
}
