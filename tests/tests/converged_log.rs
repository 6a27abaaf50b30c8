//! A run over a converged fleet of 2,000 devices, as every consumer sees
//! it, while the store keeps its `already_converged` targets and events in
//! slices: SSE (live, and replayed with each filter, `after` and
//! `Last-Event-ID`, on both instances), an MQTT subscriber and the outcomes
//! API give, field for field, the events and outcomes the fleet says they
//! must, also once retention has pruned part of the log; a rollout counts
//! in its waves only the devices it pushes; and the pass costs the database
//! rows in proportion to the devices that changed, not to the fleet.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_device_sim::{FleetPlan, OfflineMode};
use idem_tests::table_writes::{summary, TableWrites};
use idem_tests::{Scenario, ServerSettings, SseClient, SseMessage, TestServer};
use rumqttc::{AsyncClient, Event, Packet, QoS};
use serde_json::{json, Value};

const DEVICES: usize = 2_000;
const CONVERGED: &str = "io.idem.device.already_converged";

/// What the fleet says each device's `already_converged` event of a run
/// must hold: its desired generation and reported health, from the
/// devices' rows.
async fn expected_events(pool: &sqlx::PgPool) -> BTreeMap<String, (i64, Option<String>)> {
    sqlx::query_as::<_, (String, i64, Option<String>)>(
        "SELECT id, desired_generation, reported_health FROM devices",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, generation, health)| (id, (generation, health)))
    .collect()
}

/// Every event MQTT subscribers get on the scenario's event topics.
struct MqttEvents {
    events: Arc<Mutex<Vec<Value>>>,
    _client: AsyncClient,
    task: tokio::task::JoinHandle<()>,
}

impl MqttEvents {
    async fn subscribe(scenario: &Scenario) -> Self {
        let mut options = scenario
            .broker
            .mqtt_options(format!("converged-log-{}", uuid::Uuid::new_v4().simple()));
        options.set_max_packet_size(2 << 20, 2 << 20);
        let (client, mut eventloop) = AsyncClient::new(options, 1_000);
        client
            .subscribe(scenario.server.topic_root.events_filter(), QoS::AtLeastOnce)
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            assert!(Instant::now() < deadline, "no SUBACK for the event topics");
            let event = tokio::time::timeout(Duration::from_secs(10), eventloop.poll())
                .await
                .expect("the event subscriber's broker is silent")
                .unwrap();
            if let Event::Incoming(Packet::SubAck(_)) = event {
                break;
            }
        }
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = events.clone();
        let task = tokio::spawn(async move {
            while let Ok(event) = eventloop.poll().await {
                if let Event::Incoming(Packet::Publish(p)) = event {
                    let event: Value = serde_json::from_slice(&p.payload).unwrap();
                    sink.lock().unwrap().push(event);
                }
            }
        });
        Self {
            events,
            _client: client,
            task,
        }
    }

    /// The device events of `run_id` once `count` of them arrived.
    async fn of_run(&self, run_id: &str, count: usize) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let got: Vec<Value> = self
                .events
                .lock()
                .unwrap()
                .iter()
                .filter(|e| e["runid"] == run_id && e["type"] == CONVERGED)
                .cloned()
                .collect();
            if got.len() >= count {
                return got;
            }
            assert!(
                Instant::now() < deadline,
                "{} of {count} events of run {run_id} on MQTT",
                got.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for MqttEvents {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The events of an SSE stream of `server` (`query` and `last_event_id`
/// as given) until `done` holds for the events read so far.
async fn sse_events(
    server: &TestServer,
    query: &str,
    last_event_id: Option<i64>,
    what: &str,
    done: impl Fn(&[Value]) -> bool,
) -> (Vec<Value>, Vec<SseMessage>) {
    let url = server.url(&format!("/v1/events{query}"));
    let mut client = SseClient::connect(&url, server.token(), last_event_id)
        .await
        .unwrap();
    let mut events = Vec::new();
    let mut others = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done(&events) {
        assert!(
            Instant::now() < deadline,
            "{what}: {} events so far",
            events.len()
        );
        let message = client
            .next_within(Duration::from_secs(20))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{what}: the stream ended"));
        if message.event.is_some() {
            others.push(message);
            continue;
        }
        let event: Value = serde_json::from_str(&message.data).unwrap();
        assert_eq!(
            message.id,
            event["sequence"].as_i64(),
            "{what}: the SSE id is the event's sequence"
        );
        events.push(event);
    }
    (events, others)
}

/// The events `client` streams until the one that completes `run_id`.
async fn until_completed(client: &mut SseClient, run_id: &str, what: &str) -> Vec<Value> {
    let mut events = Vec::new();
    while !completes(&events, run_id) {
        let message = client
            .next_within(Duration::from_secs(20))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{what} ended"));
        if message.event.is_none() {
            events.push(serde_json::from_str::<Value>(&message.data).unwrap());
        }
    }
    events
}

fn converged_of<'a>(events: &'a [Value], run_id: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|e| e["type"] == CONVERGED && e["runid"] == run_id)
        .collect()
}

fn completes(events: &[Value], run_id: &str) -> bool {
    events
        .iter()
        .any(|e| e["type"] == "io.idem.run.completed" && e["runid"] == run_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_converged_run_looks_the_same_to_every_consumer_on_every_instance_and_after_pruning() {
    let scenario = Scenario::start(ServerSettings {
        share_group: Some("converged-log".to_owned()),
        ..ServerSettings::default()
    })
    .await
    .unwrap();
    let second = TestServer::start(
        &scenario.db,
        &scenario.broker,
        ServerSettings {
            topic_root: Some(scenario.server.topic_root.to_string()),
            share_group: Some("converged-log".to_owned()),
            ..ServerSettings::default()
        },
    )
    .await
    .unwrap();
    let plan = FleetPlan::new("cl-", DEVICES).seed(17).build().unwrap();
    let fleet = scenario.register_and_start(&plan, DEVICES).await.unwrap();
    let pool = scenario.db.pool();
    // A few devices report themselves unhealthy: health is per device.
    for device in &plan.devices[..7] {
        fleet
            .set_health(&device.id, idem_protocol::Health::Unhealthy)
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM devices WHERE reported_health = 'unhealthy'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
        < 7
    {
        assert!(
            Instant::now() < deadline,
            "the unhealthy reports were not stored"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = idem_server::store::events::last_sequence(pool)
        .await
        .unwrap();
    let mqtt = MqttEvents::subscribe(&scenario).await;
    // Live on both instances: from the log's current end on.
    let url_a = scenario.server.url("/v1/events");
    let url_b = second.url("/v1/events");
    let mut live_a = SseClient::connect(&url_a, scenario.server.token(), Some(before))
        .await
        .unwrap();
    let mut live_b = SseClient::connect(&url_b, second.token(), Some(before))
        .await
        .unwrap();

    let (run_id, run) = scenario.run_all(Duration::from_secs(60)).await.unwrap();
    assert_eq!(
        run["summary"], "2,000 already converged, 0 provisioned, 0 failed",
        "{run}"
    );
    let slices: i64 = sqlx::query_scalar("SELECT count(*) FROM converged_event_slices")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(slices, 2, "the run's 2,000 converged events are two slices");

    // Live, on the instance that made the run.
    let live = until_completed(&mut live_a, &run_id, "the live stream").await;
    let started = live
        .iter()
        .find(|e| e["type"] == "io.idem.run.started" && e["runid"] == run_id)
        .expect("run.started on the live stream")
        .clone();
    let start = started["sequence"].as_i64().unwrap();
    let converged: Vec<Value> = converged_of(&live, &run_id).into_iter().cloned().collect();

    // Field for field what the fleet says, at the sequences right after
    // run.started, each with its own id.
    let fleet_view = expected_events(pool).await;
    assert_eq!(converged.len(), DEVICES);
    let mut subjects = HashSet::new();
    let mut ids = HashSet::new();
    for (event, sequence) in converged.iter().zip(start + 1..) {
        let subject = event["subject"].as_str().unwrap();
        let (generation, health) = &fleet_view[subject];
        let expected = json!({
            "specversion": "1.0",
            "id": event["id"],
            "type": CONVERGED,
            "source": started["source"],
            "subject": subject,
            "time": started["time"],
            "datacontenttype": "application/json",
            "runid": run_id,
            "generation": generation,
            "sequence": sequence,
            "data": {"outcome": "already_converged", "reason": null, "health": health, "success": true},
        });
        assert_eq!(event, &expected, "the event of {subject}");
        subjects.insert(subject.to_owned());
        ids.insert(event["id"].as_str().unwrap().to_owned());
    }
    assert_eq!(subjects.len(), DEVICES, "one event per device");
    assert_eq!(ids.len(), DEVICES, "every event has its own id");
    let unhealthy = converged
        .iter()
        .filter(|e| e["data"]["health"] == "unhealthy")
        .count();
    assert_eq!(unhealthy, 7);
    let by_sequence: HashMap<i64, &Value> = converged
        .iter()
        .map(|e| (e["sequence"].as_i64().unwrap(), e))
        .collect();
    let same_as_live = |got: &[&Value], what: &str| {
        for event in got {
            let sequence = event["sequence"].as_i64().unwrap();
            assert_eq!(
                Some(event),
                by_sequence.get(&sequence),
                "{what}: event {sequence}"
            );
        }
    };

    // Live on the other instance, and on MQTT: the same events.
    let live_other =
        until_completed(&mut live_b, &run_id, "the other instance's live stream").await;
    let other = converged_of(&live_other, &run_id);
    assert_eq!(other.len(), DEVICES);
    same_as_live(&other, "live on the other instance");
    let published = mqtt.of_run(&run_id, DEVICES).await;
    let published: Vec<&Value> = published.iter().collect();
    assert_eq!(published.len(), DEVICES, "one MQTT event per device");
    same_as_live(&published, "MQTT");

    // Replays on the other instance, with each filter.
    let run_filter = format!("?run={run_id}&type={CONVERGED}&after=0");
    let (replayed, _) = sse_events(&second, &run_filter, None, "replay by run and type", |e| {
        e.len() >= DEVICES
    })
    .await;
    assert_eq!(replayed.len(), DEVICES);
    same_as_live(
        &replayed.iter().collect::<Vec<_>>(),
        "replay by run and type",
    );
    let device = plan.devices[1_234].id.as_str();
    let (for_device, _) = sse_events(
        &second,
        &format!("?device={device}&after=0"),
        None,
        "replay by device",
        |e| converged_of(e, &run_id).len() == 1,
    )
    .await;
    let for_device = converged_of(&for_device, &run_id);
    assert_eq!(for_device[0]["subject"], device);
    same_as_live(&for_device, "replay by device");
    // From inside the second slice, with `after` and with Last-Event-ID.
    let middle = start + 1_500;
    for (query, last_event_id) in [
        (format!("?run={run_id}&after={middle}"), None),
        (format!("?run={run_id}"), Some(middle)),
    ] {
        let (rest, _) = sse_events(
            &second,
            &query,
            last_event_id,
            "replay from inside a slice",
            |e| completes(e, &run_id),
        )
        .await;
        let rest_converged = converged_of(&rest, &run_id);
        let sequences: Vec<i64> = rest_converged
            .iter()
            .map(|e| e["sequence"].as_i64().unwrap())
            .collect();
        assert_eq!(
            sequences,
            (middle + 1..=start + DEVICES as i64).collect::<Vec<_>>(),
            "{query} {last_event_id:?}"
        );
        same_as_live(&rest_converged, "replay from inside a slice");
    }

    // Outcomes, paged: every device once, as the fleet says.
    let outcomes = scenario.server.run_outcomes(&run_id).await.unwrap();
    assert_eq!(outcomes.len(), DEVICES);
    for (device, (generation, health)) in &fleet_view {
        let row = &outcomes[device];
        assert_eq!(row["outcome"], "already_converged", "{row}");
        assert_eq!(&row["generation"], generation, "{row}");
        assert_eq!(row["health"], json!(health), "{row}");
    }
    let (status, page) = scenario
        .server
        .get(&format!(
            "/v1/runs/{run_id}/outcomes?limit=3&outcome=already_converged&after={}",
            plan.devices[1_023].id
        ))
        .await
        .unwrap();
    assert_eq!(status, 200, "{page}");
    let names: Vec<&str> = page["outcomes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["device_id"].as_str().unwrap())
        .collect();
    let mut sorted: Vec<&str> = fleet_view.keys().map(String::as_str).collect();
    sorted.sort_unstable();
    let at = sorted
        .iter()
        .position(|d| *d == plan.devices[1_023].id.as_str())
        .unwrap();
    assert_eq!(
        names,
        sorted[at + 1..at + 4],
        "a page across the slices' seam"
    );

    // Retention prunes up to inside the second slice: the first goes, the
    // second stays whole; a replay from the start is told so and gets the
    // rest as before.
    let last = idem_server::store::events::last_sequence(pool)
        .await
        .unwrap();
    let week = Duration::from_secs(7 * 86_400);
    idem_server::store::events::prune(pool, last, week, last - (start + 1_100))
        .await
        .unwrap();
    let oldest = idem_server::store::events::oldest_sequence(pool)
        .await
        .unwrap();
    assert_eq!(
        oldest,
        Some(start + 1_025),
        "the second slice is kept whole"
    );
    let (after_pruning, notices) = sse_events(
        &second,
        &format!("?run={run_id}"),
        Some(1),
        "replay after pruning",
        |e| completes(e, &run_id),
    )
    .await;
    assert_eq!(notices[0].event.as_deref(), Some("reset"), "{notices:?}");
    let kept = converged_of(&after_pruning, &run_id);
    assert_eq!(kept.len(), DEVICES - 1_024);
    assert_eq!(kept[0]["sequence"], start + 1_025);
    same_as_live(&kept, "replay after pruning");

    drop(mqtt);
    second.stop().await.unwrap();
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_converged_pass_over_2000_devices_writes_rows_for_what_changed_not_for_the_fleet() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let plan = FleetPlan::new("rows-", DEVICES).seed(23).build().unwrap();
    let fleet = scenario.register_and_start(&plan, DEVICES).await.unwrap();
    let pool = scenario.db.pool();
    // The fleet's first run, then a pass over the converged fleet.
    scenario.run_all(Duration::from_secs(60)).await.unwrap();
    let before = TableWrites::snapshot(pool).await.unwrap();
    let (_, run) = scenario.run_all(Duration::from_secs(60)).await.unwrap();
    assert_eq!(
        run["summary"],
        "2,000 already converged, 0 provisioned, 0 failed"
    );
    let converged_pass = TableWrites::snapshot(pool).await.unwrap().since(&before);
    println!(
        "a converged pass over {DEVICES} devices: {}",
        summary(&converged_pass)
    );
    let rows = |writes: &BTreeMap<String, idem_tests::table_writes::Rows>, table: &str| {
        writes
            .get(table)
            .map(|r| r.inserted + r.updated)
            .unwrap_or(0)
    };
    let total = |writes: &BTreeMap<String, idem_tests::table_writes::Rows>| -> i64 {
        writes.values().map(|r| r.inserted + r.updated).sum()
    };
    assert_eq!(
        rows(&converged_pass, "run_targets"),
        0,
        "{converged_pass:?}"
    );
    // run.started and run.completed.
    assert_eq!(rows(&converged_pass, "events"), 2, "{converged_pass:?}");
    assert_eq!(rows(&converged_pass, "converged_event_slices"), 2);
    assert_eq!(rows(&converged_pass, "run_converged"), 2);
    // The run row and its updates, the audit record, leases and heartbeats.
    assert!(
        total(&converged_pass) <= 40,
        "a converged pass wrote {} rows: {}",
        total(&converged_pass),
        summary(&converged_pass)
    );

    // Twenty devices go offline: the next pass writes for those twenty.
    const AWAY: usize = 20;
    for device in &plan.devices[..AWAY] {
        fleet.take_offline(&device.id, OfflineMode::Clean).unwrap();
    }
    scenario
        .wait_offline(AWAY, Duration::from_secs(20))
        .await
        .unwrap();
    let before = TableWrites::snapshot(pool).await.unwrap();
    let (_, run) = scenario.run_all(Duration::from_secs(60)).await.unwrap();
    assert_eq!(
        run["summary"],
        "1,980 already converged, 0 provisioned, 0 failed, 20 skipped"
    );
    let changed_pass = TableWrites::snapshot(pool).await.unwrap().since(&before);
    println!(
        "a pass with {AWAY} devices offline: {}",
        summary(&changed_pass)
    );
    let targets = changed_pass.get("run_targets").copied().unwrap_or_default();
    assert_eq!(targets.inserted, AWAY as i64, "{changed_pass:?}");
    assert!(
        total(&changed_pass) <= AWAY as i64 * 8 + 40,
        "a pass with {AWAY} devices offline wrote {} rows: {}",
        total(&changed_pass),
        summary(&changed_pass)
    );
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_over_a_mostly_converged_fleet_counts_in_its_waves_only_the_devices_it_pushes() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let mut plan = FleetPlan::new("roc-", DEVICES).seed(29).build().unwrap();
    let mut new = plan.desired_spec.clone();
    new["firmware"] = json!("9.9.9");
    // All but twenty run the new spec already.
    for device in &mut plan.devices[20..] {
        device.spec = new.clone();
    }
    let fleet = scenario.register_and_start(&plan, DEVICES).await.unwrap();
    let body = json!({"all": true, "spec": new, "rollout": {"waves": ["50%", "100%"]}});
    let (status, started) = scenario.server.post("/v1/desired", &body).await.unwrap();
    assert_eq!(status, 200, "{started}");
    let run_id = started["run_id"].as_str().unwrap().to_owned();
    let run = scenario
        .server
        .wait_run_completed(&run_id, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        run["summary"], "1,980 already converged, 20 provisioned, 0 failed",
        "{run}"
    );
    let (_, view) = scenario
        .server
        .get(&format!("/v1/runs/{run_id}"))
        .await
        .unwrap();
    let waves = view["rollout"]["waves"].as_array().unwrap();
    let sizes: Vec<&Value> = waves.iter().map(|w| &w["size"]).collect();
    assert_eq!(sizes, [&json!(10), &json!(10)], "{view}");
    let provisioned: Vec<&Value> = waves.iter().map(|w| &w["provisioned"]).collect();
    assert_eq!(provisioned, [&json!(10), &json!(10)], "{view}");
    let outcomes = scenario.server.run_outcomes(&run_id).await.unwrap();
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for row in outcomes.values() {
        *kinds
            .entry(row["outcome"].as_str().unwrap().to_owned())
            .or_default() += 1;
    }
    assert_eq!(
        kinds,
        BTreeMap::from([
            ("already_converged".to_owned(), 1_980),
            ("provisioned".to_owned(), 20)
        ])
    );
    fleet.shutdown().await.unwrap();
}
