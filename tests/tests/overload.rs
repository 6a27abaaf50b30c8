//! End to end: a broker that drops messages for the server (Mosquitto with
//! `max_queued_messages 100` and its default in-flight window of 20, so a
//! server that cannot acknowledge for a while loses the rest) never costs a
//! device its report. While PostgreSQL holds the server's device writes,
//! ~1,000 devices connect and report (or report anew); after the writes
//! resume the server notices what may be missing (an ingest held longer
//! than `--recheck-after-stall`, the broker's `$SYS` dropped counter), reads
//! the retained statuses again and asks the devices, paced, and every device
//! ends with its last published report stored within seconds.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use idem_device_sim::{Fleet, SimDevice};
use idem_protocol::DeviceId;
use idem_tests::{PrivateMosquitto, Scenario, ServerSettings};
use serde_json::json;

const DEVICES: usize = 1_000;
/// How long the device writes are held.
const HOLD: Duration = Duration::from_secs(15);
/// How long after the writes resume every last report must be stored.
const RECOVERY: Duration = Duration::from_secs(20);
/// Report requests (and status re-reads) per second of a recheck.
const RECHECK_RATE: u32 = 400;
/// The two cases take turns: each is a storm that the other would feed.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A broker that drops QoS 1 messages for a client past 20 in flight and
/// 100 queued, a server that rechecks after a 5 s stall, and the fleet
/// registered (without desired state: nothing but reports flows).
async fn dropping_setup() -> (Scenario, Vec<SimDevice>) {
    let broker = PrivateMosquitto::builder()
        .queue_limits(100, 20)
        .start()
        .unwrap();
    let settings = ServerSettings {
        resync_interval: Duration::ZERO,
        recheck_after_stall: Duration::from_secs(5),
        // What a queue of 100 with 20 in flight takes from a debug build
        // sharing two cores with the broker, 1,000 devices and PostgreSQL.
        recheck_rate: RECHECK_RATE,
        ..ServerSettings::default()
    };
    let scenario = Scenario::start_on(broker, settings).await.unwrap();
    let devices: Vec<SimDevice> = (0..DEVICES)
        .map(|i| {
            SimDevice::new(
                DeviceId::parse(&format!("dropped-{i:04}")).unwrap(),
                json!({"fw": "1.0"}),
            )
        })
        .collect();
    let body: Vec<_> = devices.iter().map(|d| json!({"id": d.id})).collect();
    let (status, answer) = scenario
        .server
        .post("/v1/devices", &json!(body))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    (scenario, devices)
}

/// Holds every write to `devices` until the returned transaction ends.
async fn hold_device_writes(scenario: &Scenario) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut hold = scenario.db.pool().begin().await.unwrap();
    sqlx::query("LOCK TABLE devices IN EXCLUSIVE MODE")
        .execute(&mut *hold)
        .await
        .unwrap();
    hold
}

/// Waits until every device's stored `seq` is the last one it published.
async fn wait_every_last_report_stored(scenario: &Scenario, fleet: &Fleet, resumed: Instant) {
    loop {
        let stored: HashMap<String, Option<i64>> =
            sqlx::query_as::<_, (String, Option<i64>)>("SELECT id, reported_seq FROM devices")
                .fetch_all(scenario.db.pool())
                .await
                .unwrap()
                .into_iter()
                .collect();
        let behind: Vec<String> = fleet
            .states()
            .into_iter()
            .filter(|d| stored.get(d.id.as_str()).copied().flatten() != Some(d.seq as i64))
            .map(|d| d.id.to_string())
            .collect();
        if behind.is_empty() {
            eprintln!(
                "every last report stored {:.1} s after the writes resumed",
                resumed.elapsed().as_secs_f64()
            );
            return;
        }
        if resumed.elapsed() > RECOVERY {
            let dropped = scenario
                .server
                .metric("idem_broker_messages_dropped")
                .await
                .unwrap_or(f64::NAN);
            panic!(
                "{} of {DEVICES} devices lack their last report {RECOVERY:?} after the writes resumed \
                 (broker dropped {dropped} messages), e.g. {:?}",
                behind.len(),
                &behind[..behind.len().min(5)]
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_reports_and_statuses_dropped_while_writes_are_held_are_all_stored_after() {
    let _serial = idem_tests::deadline::turn(&SERIAL, "overload tests")
        .await
        .unwrap();
    let (scenario, devices) = dropping_setup().await;
    let hold = hold_device_writes(&scenario).await;
    let fleet = scenario.start_fleet(devices).await.unwrap();
    fleet
        .wait_connected(DEVICES, Duration::from_secs(30))
        .await
        .unwrap();
    tokio::time::sleep(HOLD).await;
    hold.rollback().await.unwrap();
    let resumed = Instant::now();
    wait_every_last_report_stored(&scenario, &fleet, resumed).await;
    // The statuses dropped too are re-read, a chunk at a time.
    loop {
        let online: i64 = sqlx::query_scalar("SELECT count(*) FROM devices WHERE online")
            .fetch_one(scenario.db.pool())
            .await
            .unwrap();
        if online == DEVICES as i64 {
            eprintln!(
                "every device known online {:.1} s after the writes resumed",
                resumed.elapsed().as_secs_f64()
            );
            break;
        }
        assert!(
            resumed.elapsed() < RECOVERY,
            "{online} of {DEVICES} devices known online {RECOVERY:?} after the writes resumed"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newer_reports_dropped_while_writes_are_held_are_all_stored_after() {
    let _serial = idem_tests::deadline::turn(&SERIAL, "overload tests")
        .await
        .unwrap();
    let (scenario, devices) = dropping_setup().await;
    let ids: Vec<DeviceId> = devices.iter().map(|d| d.id.clone()).collect();
    let fleet = scenario.start_fleet(devices).await.unwrap();
    let started = Instant::now();
    wait_every_last_report_stored(&scenario, &fleet, started).await;

    let hold = hold_device_writes(&scenario).await;
    for id in &ids {
        fleet.set_local_spec(id, json!({"fw": "1.1"})).unwrap();
    }
    tokio::time::sleep(HOLD).await;
    hold.rollback().await.unwrap();
    let resumed = Instant::now();
    wait_every_last_report_stored(&scenario, &fleet, resumed).await;
    let asked = scenario
        .server
        .metric("idem_devices_asked_to_report_total{reason=\"recheck\"}")
        .await
        .unwrap();
    assert!(asked >= 1.0, "no device was asked by a recheck");
    fleet.shutdown().await.unwrap();
}
