//! Fault tolerance end to end (at-least-once ingest): the real
//! `idem-server` binary as a child process that is SIGKILLed mid-run, and a
//! private PostgreSQL cluster that is stopped mid-run — against a private
//! Mosquitto and simulated devices. Every fault is injected into a service
//! the harness started and owns; nothing else is touched.
//!
//! "Published" is measured, not assumed. The simulator's snapshot `seq` is
//! the seq of the last report a device *built* (handed to its MQTT client),
//! which need not have reached the broker. In the SIGKILL test a
//! [`ReportWitness`], subscribed to every `reported` topic before the devices
//! start, records the highest `seq` the broker accepted per device; once a
//! device is cleanly offline it builds nothing more, and the test first
//! checks that the witness saw exactly the snapshot's seq ("last built" =
//! "last published"), then that Postgres holds exactly that seq. Only the
//! newest report can be checked this way, and only it matters: a report
//! with a lower seq is stale by protocol. Half of the devices leave while
//! the server is down, so their newest report exists only in the server's
//! persistent MQTT session. In the Postgres test devices send no
//! heartbeats, so each device's newest report is the one it sent last —
//! for the drifted ones, while the database was down.
//!
//! Here: what the tests share (the binary, one-at-a-time, registering and
//! starting fleets, waiting on what Postgres and the witness saw). By
//! topic: `decisions_fresh` (a change posted to one instance never
//! overtaken by an older push of the engine's holder), `server_killed` (the server SIGKILLed mid-run),
//! `rollout_killed` (SIGKILLed mid-wave), `instance_names` (a name claimed
//! by a live, a killed or a silent process), `shared_sessions` (an instance
//! sharing the subscriptions killed and never restarted), `instances_killed`
//! (of three instances, the one carrying a run killed and never restarted),
//! `plans_shared` (a plan made, approved and applied through different
//! instances, kept across a restart of both)
//! and `postgres_stopped` (the database stopped mid-run).

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_device_sim::{
    BrokerAddr, DeviceSnapshot, Fleet, FleetConfig, OfflineMode, Plan, SimDevice,
};
use idem_protocol::TopicRoot;
use idem_tests::{PrivateMosquitto, ProcessServer, ReportWitness, TestDatabase};
use rumqttc::{AsyncClient, Event, Packet, QoS};
use serde_json::{json, Value};
use sqlx::PgPool;

mod decisions_fresh;
mod instance_names;
mod instances_killed;
mod owner_paused;
mod plans_shared;
mod postgres_stopped;
mod relay_killed;
mod rollout_killed;
mod server_killed;
mod shared_sessions;

/// The real server command line, built by this package.
const SERVER_BIN: &str = env!("CARGO_BIN_EXE_idem-server-under-test");

/// Fault tests measure timings (a run must still be in flight when the fault
/// hits); running them one at a time keeps them from starving each other.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A short unique tag for topic roots and instance names.
fn unique_tag() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

/// What a test of several instances runs on: a private broker (the open-file
/// limit raised for it), a fresh database, a unique tag and the topic root
/// `{prefix}/{tag}`.
async fn private_services(prefix: &str) -> (PrivateMosquitto, TestDatabase, String, TopicRoot) {
    idem_tests::raise_fd_limit().unwrap();
    let broker = PrivateMosquitto::start().unwrap();
    let db = TestDatabase::create_with(&idem_server::MIGRATOR)
        .await
        .unwrap();
    let tag = unique_tag();
    let root = TopicRoot::new(format!("{prefix}/{tag}")).unwrap();
    (broker, db, tag, root)
}

/// Whether `server`'s `/readyz` says it holds `lease` (`engine`, `relay`).
async fn owns(server: &ProcessServer, lease: &str) -> bool {
    server.readyz().await.is_ok_and(|(_, ready)| {
        ready["owns"]
            .as_array()
            .is_some_and(|owns| owns.contains(&json!(lease)))
    })
}

/// The index of the server that holds `lease`, waiting up to `within`.
async fn holder_of(servers: &[ProcessServer], lease: &str, within: Duration) -> usize {
    let deadline = Instant::now() + within;
    loop {
        for (i, server) in servers.iter().enumerate() {
            if owns(server, lease).await {
                return i;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no instance holds the {lease} lease after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One real server process per name (instance `{name}-{tag}`), on `db`
/// and `broker` under `root`, each with `env`.
async fn start_servers(
    names: &[&str],
    (broker, db, tag, root): (&PrivateMosquitto, &TestDatabase, &str, &TopicRoot),
    env: &[(&str, &str)],
) -> Vec<ProcessServer> {
    let mut servers = Vec::new();
    for name in names {
        servers.push(
            ProcessServer::start(
                std::path::Path::new(SERVER_BIN),
                db.url(),
                &broker.url(),
                root,
                &format!("{name}-{tag}"),
                env,
            )
            .await
            .unwrap(),
        );
    }
    servers
}

/// Registers the plan's devices with the plan's desired spec.
async fn register(server: &ProcessServer, plan: &Plan) {
    let body: Vec<Value> = plan
        .devices
        .iter()
        .map(|d| json!({"id": d.id, "spec": plan.desired_spec}))
        .collect();
    let (status, answer) = server
        .post("/v1/devices", &Value::Array(body))
        .await
        .unwrap();
    assert_eq!(status, 200, "registering devices: {answer}");
}

/// Starts `devices` on the broker (with heartbeats every `heartbeat`, if
/// any) and waits until all are connected.
async fn start_fleet(
    broker: &PrivateMosquitto,
    root: &TopicRoot,
    devices: Vec<SimDevice>,
    heartbeat: Option<Duration>,
) -> Fleet {
    start_fleet_as(broker, root, devices, heartbeat, None).await
}

/// [`start_fleet`], each device logged in with its password in
/// `credentials`, over TLS trusting the broker's CA when it has one.
async fn start_fleet_as(
    broker: &PrivateMosquitto,
    root: &TopicRoot,
    devices: Vec<SimDevice>,
    heartbeat: Option<Duration>,
    credentials: Option<idem_device_sim::Credentials>,
) -> Fleet {
    let n = devices.len();
    let address = match broker.ca_file() {
        Some(_) => BrokerAddr::tls(broker.host(), broker.port()),
        None => BrokerAddr::new(broker.host(), broker.port()),
    };
    let mut config = FleetConfig::new(address, root.clone(), devices);
    config.report_interval = heartbeat;
    config.credentials = credentials;
    if let Some(ca) = broker.ca_file() {
        config.tls = Some(idem_device_sim::SimTls::from_files(Some(ca), None).unwrap());
    }
    let fleet = Fleet::start(config).unwrap();
    fleet
        .wait_connected(n, Duration::from_secs(30))
        .await
        .unwrap();
    fleet
}

/// Takes every device of `fleet` offline with a clean disconnect (retained
/// `offline`, then DISCONNECT after everything queued before it) and waits
/// until none is connected. Afterwards no device builds another report, so
/// the snapshots' `seq` are final.
async fn take_all_offline(fleet: &Fleet) -> Vec<DeviceSnapshot> {
    let ids: Vec<_> = fleet.device_ids().cloned().collect();
    for id in &ids {
        fleet.take_offline(id, OfflineMode::Clean).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while fleet.connected_count() > 0 {
        assert!(
            Instant::now() < deadline,
            "{} devices still connected 15 s after being taken offline",
            fleet.connected_count()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    fleet.states()
}

/// Device id → stored `reported_seq`.
async fn stored_seqs(pool: &PgPool) -> HashMap<String, Option<i64>> {
    sqlx::query_as::<_, (String, Option<i64>)>("SELECT id, reported_seq FROM devices")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// Waits until at least `n` devices have a stored report.
async fn wait_reports_stored(pool: &PgPool, n: usize, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let stored = stored_seqs(pool)
            .await
            .values()
            .filter(|s| s.is_some())
            .count();
        if stored >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "only {stored} of {n} devices have a stored report after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How many of a run's targets have an outcome, and the run's state.
async fn run_progress(pool: &PgPool, run_id: &str) -> (i64, String) {
    let id: uuid::Uuid = run_id.parse().unwrap();
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM run_outcomes WHERE run_id = $1 AND outcome IS NOT NULL), \
                (SELECT state FROM runs WHERE id = $1)",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Waits until `run_id` has at least `decided` outcomes stored.
async fn wait_decided(pool: &PgPool, run_id: &str, decided: i64, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let (done, state) = run_progress(pool, run_id).await;
        if done >= decided {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "run {run_id} has {done} of the expected {decided} outcomes after {timeout:?} \
             (state {state})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One row of `runs`, as the tests look at it.
#[derive(Debug, sqlx::FromRow)]
struct RunRow {
    id: uuid::Uuid,
    trigger: String,
    state: String,
    target_count: i32,
    already_converged: i32,
    provisioned: i32,
    failed: i32,
    skipped: i32,
    superseded: i32,
}

impl RunRow {
    fn decided(&self) -> i32 {
        self.already_converged + self.provisioned + self.failed + self.skipped + self.superseded
    }
}

/// Waits until every run in `runs` is `completed`; returns them all.
async fn wait_all_runs_completed(
    pool: &PgPool,
    server: &ProcessServer,
    timeout: Duration,
) -> Vec<RunRow> {
    let deadline = Instant::now() + timeout;
    loop {
        let runs: Vec<RunRow> = sqlx::query_as(
            "SELECT id, trigger, state, target_count, already_converged, provisioned, failed, \
                    skipped, superseded FROM runs ORDER BY started_at",
        )
        .fetch_all(pool)
        .await
        .unwrap();
        if runs.iter().all(|r| r.state == "completed") {
            return runs;
        }
        assert!(
            Instant::now() < deadline,
            "runs still unfinished {timeout:?} after the restart: {:#?}\n--- server log ---\n{}",
            runs.iter()
                .filter(|r| r.state != "completed")
                .collect::<Vec<_>>(),
            server.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the witness has seen, for every device of `fleet`, a report
/// with a higher seq than `before` holds for it: each device published again.
async fn wait_each_published_since(
    witness: &ReportWitness,
    fleet: &Fleet,
    before: &HashMap<String, u64>,
    when: &str,
) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        witness.check_intact().unwrap();
        let seen = witness.highest();
        let silent: Vec<&str> = fleet
            .device_ids()
            .map(|id| id.as_str())
            .filter(|id| seen.get(*id) <= before.get(*id))
            .collect();
        if silent.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} devices published nothing {when} within 15 s, e.g. {:?}",
            silent.len(),
            &silent[..silent.len().min(10)]
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the witness has seen, for every device, exactly the seq of
/// its last built report: every report a device built reached the broker.
async fn wait_witness_saw_final(witness: &ReportWitness, finals: &[DeviceSnapshot]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        witness.check_intact().unwrap();
        let seen = witness.highest();
        let missing: Vec<String> = finals
            .iter()
            .filter(|d| seen.get(d.id.as_str()) != Some(&d.seq))
            .map(|d| {
                format!(
                    "{}: built up to {}, broker delivered up to {:?}",
                    d.id,
                    d.seq,
                    seen.get(d.id.as_str())
                )
            })
            .collect();
        if missing.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the simulator built reports that never reached the broker (a harness or \
             simulator fault, not the server's) for {} devices, e.g. {:?}",
            missing.len(),
            &missing[..missing.len().min(10)]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until Postgres holds, for every device, exactly the seq of its last
/// published report; fails listing the devices that differ.
async fn wait_stored_equals_published(
    pool: &PgPool,
    server: &ProcessServer,
    finals: &[DeviceSnapshot],
    timeout: Duration,
) {
    let deadline = Instant::now() + timeout;
    loop {
        let stored = stored_seqs(pool).await;
        let wrong: Vec<String> = finals
            .iter()
            .filter_map(|d| {
                let have = stored.get(d.id.as_str()).copied().flatten();
                let want = i64::try_from(d.seq).unwrap();
                (have != Some(want)).then(|| format!("{}: published {want}, stored {have:?}", d.id))
            })
            .collect();
        if wrong.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} devices do not have their last published report stored after \
             {timeout:?}, e.g. {:?}\n--- server log ---\n{}",
            wrong.len(),
            finals.len(),
            &wrong[..wrong.len().min(10)],
            server.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every event the relay publishes to MQTT: sequence → how many times, and the
/// outcome events' (run id, device) → how many.
#[derive(Default)]
pub(crate) struct Published {
    pub by_id: BTreeMap<i64, usize>,
    /// The CloudEvent ids published with each sequence (one, unless a
    /// repeat carried another).
    pub ids: BTreeMap<i64, BTreeSet<String>>,
    pub outcomes: HashMap<(String, String), usize>,
    /// The witness's connection broke: its counts are worthless.
    pub lost: Option<String>,
}

pub(crate) async fn event_witness(
    broker: &PrivateMosquitto,
    root: &TopicRoot,
) -> Arc<Mutex<Published>> {
    let mut options =
        broker.mqtt_options(format!("events-witness-{}", uuid::Uuid::new_v4().simple()));
    // Events go up to 1 MiB on MQTT (a run's start lists its targets).
    options.set_max_packet_size(2 << 20, 2 << 20);
    let (client, mut eventloop) = AsyncClient::new(options, 1_000);
    client
        .subscribe(root.events_filter(), QoS::AtLeastOnce)
        .await
        .unwrap();
    let published = Arc::new(Mutex::new(Published::default()));
    let sink = published.clone();
    let (subscribed_tx, subscribed) = tokio::sync::oneshot::channel();
    let mut subscribed_tx = Some(subscribed_tx);
    tokio::spawn(async move {
        let _client = client;
        loop {
            let event = match eventloop.poll().await {
                Ok(event) => event,
                Err(e) => {
                    sink.lock().unwrap().lost = Some(e.to_string());
                    return;
                }
            };
            match event {
                Event::Incoming(Packet::Publish(p)) => {
                    let event: Value = serde_json::from_slice(&p.payload).unwrap();
                    let id = event["sequence"]
                        .as_i64()
                        .or_else(|| event["sequence"].as_str().and_then(|s| s.parse().ok()))
                        .unwrap();
                    let mut published = sink.lock().unwrap();
                    *published.by_id.entry(id).or_insert(0) += 1;
                    if let Some(event_id) = event["id"].as_str() {
                        published
                            .ids
                            .entry(id)
                            .or_default()
                            .insert(event_id.to_owned());
                    }
                    let is_outcome = event["type"]
                        .as_str()
                        .is_some_and(|t| t.starts_with("io.idem.device."));
                    if let (true, Some(run), Some(device)) = (
                        is_outcome,
                        event["runid"].as_str(),
                        event["subject"].as_str(),
                    ) {
                        *published
                            .outcomes
                            .entry((run.to_owned(), device.to_owned()))
                            .or_insert(0) += 1;
                    }
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
    published
}
